//! One replica count's figures, as a table and as JSON.

use hdrhistogram::Histogram;
use serde::Serialize;

/// Percentiles of one latency histogram, microseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Latency {
    /// Samples.
    pub n: u64,
    /// Median, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Largest, µs.
    pub max_us: f64,
}

impl Latency {
    /// The percentiles of `h` (nanoseconds).
    pub fn of(h: &Histogram<u64>) -> Self {
        let us = |v: u64| v as f64 / 1000.0;
        Latency {
            n: h.len(),
            p50_us: us(h.value_at_quantile(0.5)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        }
    }
}

/// One index's figures at one replica count.
#[derive(Debug, Clone, Serialize)]
pub struct IndexRow {
    /// The index.
    pub index: String,
    /// What a query's time includes.
    pub query_includes: String,
    /// Queries before their request's events.
    pub pre: Latency,
    /// Queries after them.
    pub post: Latency,
    /// Events applied after the fleet was full, millions of blocks per second.
    pub apply_mblocks_per_s: f64,
    /// Heap bytes per (block, engine) entry at the end.
    pub bytes_per_entry: f64,
    /// Queries answered differently from the truth.
    pub mismatches: u64,
    /// Events the index reported as errors.
    pub apply_errors: u64,
    /// Queries while a writer applies events (concurrent pass), when run.
    pub concurrent: Option<Latency>,
}

/// Everything measured at one replica count.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Simulated engines.
    pub replicas: usize,
    /// Event shape.
    pub variant: crate::workload::Variant,
    /// Requests played.
    pub requests: usize,
    /// Queries asked (pre + post).
    pub queries: usize,
    /// (block, engine) entries at the end.
    pub entries: usize,
    /// One row per index.
    pub rows: Vec<IndexRow>,
    /// kvmesh's whole decision (hash + query + token_load), when run.
    pub decision: Option<Latency>,
    /// Its hashing part, when run.
    pub decision_hash: Option<Latency>,
    /// Its `Fleet::decide` part (query + token_load), when run.
    pub decision_decide: Option<Latency>,
}

impl Report {
    /// The table, with kvmesh's ratio to the best Dynamo index in each column.
    pub fn table(&self) -> comfy_table::Table {
        let mut t = comfy_table::Table::new();
        t.load_preset(comfy_table::presets::ASCII_MARKDOWN);
        t.set_header([
            "index",
            "pre p50 µs",
            "pre p99 µs",
            "post p50 µs",
            "post p99 µs",
            "concurrent p50 / p99 µs",
            "apply M blocks/s",
            "B / entry",
            "mismatches",
        ]);
        let f = |v: f64| format!("{v:.2}");
        for r in &self.rows {
            t.add_row([
                r.index.clone(),
                f(r.pre.p50_us),
                f(r.pre.p99_us),
                f(r.post.p50_us),
                f(r.post.p99_us),
                r.concurrent.map_or("—".into(), |c| format!("{:.2} / {:.2}", c.p50_us, c.p99_us)),
                f(r.apply_mblocks_per_s),
                format!("{:.1}", r.bytes_per_entry),
                r.mismatches.to_string(),
            ]);
        }
        if let (Some(k), Some(best)) = (self.rows.first(), self.best_dynamo()) {
            let ratio = |a: f64, b: f64| format!("{:.2}×", a / b);
            let conc = match (k.concurrent, self.rows.iter().filter_map(|r| r.concurrent).nth(1)) {
                (Some(a), Some(b)) => format!("{} / {}", ratio(a.p50_us, b.p50_us), ratio(a.p99_us, b.p99_us)),
                _ => "—".into(),
            };
            t.add_row([
                "kvmesh ÷ best Dynamo".to_string(),
                ratio(k.pre.p50_us, best.pre.p50_us),
                ratio(k.pre.p99_us, best.pre.p99_us),
                ratio(k.post.p50_us, best.post.p50_us),
                ratio(k.post.p99_us, best.post.p99_us),
                conc,
                ratio(k.apply_mblocks_per_s, best.apply_mblocks_per_s),
                ratio(k.bytes_per_entry, best.bytes_per_entry),
                String::new(),
            ]);
        }
        t
    }

    /// Per column, the best of the Dynamo rows (lowest latency and memory, highest apply).
    pub fn best_dynamo(&self) -> Option<IndexRow> {
        let d: Vec<&IndexRow> = self.rows.iter().skip(1).collect();
        let first = (*d.first()?).clone();
        let min = |g: fn(&IndexRow) -> f64| d.iter().map(|r| g(r)).fold(f64::INFINITY, f64::min);
        let best = |g: fn(&Latency) -> f64, pre: bool| {
            d.iter().map(|r| g(if pre { &r.pre } else { &r.post })).fold(f64::INFINITY, f64::min)
        };
        Some(IndexRow {
            index: "best Dynamo".into(),
            pre: Latency { p50_us: best(|l| l.p50_us, true), p99_us: best(|l| l.p99_us, true), ..first.pre },
            post: Latency { p50_us: best(|l| l.p50_us, false), p99_us: best(|l| l.p99_us, false), ..first.post },
            apply_mblocks_per_s: d.iter().map(|r| r.apply_mblocks_per_s).fold(0.0, f64::max),
            bytes_per_entry: min(|r| r.bytes_per_entry),
            ..first
        })
    }
}
