//! A load test's summary: counts, rates, latency percentiles, printed or as JSON.

use super::*;

/// One stream's figures: requests/s, latency (and, streamed, TTFT) quantiles in
/// milliseconds, errors by kind.
pub(super) struct Summary {
    pub(super) rps: f64,
    pub(super) ok: u64,
    pub(super) errors: BTreeMap<String, u64>,
    pub(super) retried: u64,
    pub(super) dropped: u64,
    pub(super) p50_ms: f64,
    pub(super) p90_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
    /// TTFT p50, p90 and p99 with `--stream`, milliseconds.
    pub(super) ttft_ms: Option<[f64; 3]>,
    /// ITL p50 and p99 with `--stream`, milliseconds.
    pub(super) itl_ms: Option<[f64; 2]>,
}

impl Summary {
    pub(super) fn new(t: &Tally, elapsed: f64) -> Summary {
        let empty = Histogram::new(3).expect("valid");
        let h = t.latency.as_ref().unwrap_or(&empty);
        let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
        let ttft = t.ttft.as_ref().map(|h| [0.5, 0.9, 0.99].map(|p| h.value_at_quantile(p) as f64 / 1000.0));
        Summary {
            rps: t.ok as f64 / elapsed,
            ok: t.ok,
            errors: t.errors.clone(),
            retried: t.retried,
            dropped: t.dropped,
            p50_ms: q(0.5),
            p90_ms: q(0.9),
            p99_ms: q(0.99),
            max_ms: h.max() as f64 / 1000.0,
            ttft_ms: ttft,
            itl_ms: t.itl.as_ref().map(|h| [0.5, 0.99].map(|p| h.value_at_quantile(p) as f64 / 1000.0)),
        }
    }

    pub(super) fn print(&self) {
        // Errors (a 429 answered at once, say) would pull the percentiles down: say which.
        let of = if self.errors.is_empty() { "" } else { " (successful requests only)" };
        println!(
            "  latency{of} p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            self.p50_ms, self.p90_ms, self.p99_ms, self.max_ms
        );
        if let Some([p50, p90, p99]) = self.ttft_ms {
            println!("  TTFT (first chunk) p50 {p50:.2} ms, p90 {p90:.2} ms, p99 {p99:.2} ms");
        }
        if let Some([p50, p99]) = self.itl_ms {
            println!("  ITL (between chunks) p50 {p50:.2} ms, p99 {p99:.2} ms");
        }
        if !self.errors.is_empty() {
            println!("  errors {:?}", self.errors);
        }
        if self.retried > 0 {
            println!("  retried on the next URL after a refused or reset connection: {}", self.retried);
        }
        if self.dropped > 0 {
            println!("  dropped (over --concurrency in flight): {}", self.dropped);
        }
    }
}
