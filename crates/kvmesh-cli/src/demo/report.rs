//! The demo's summary: one row per policy, as a terminal table, Markdown and JSON, plus each
//! request's outcome as CSV.

use super::drive::Outcome;
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// One policy's results. Times are engine seconds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    /// The routing policy.
    pub policy: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// TTFT percentiles, seconds.
    pub ttft_p50_s: f64,
    /// 90th.
    pub ttft_p90_s: f64,
    /// 99th.
    pub ttft_p99_s: f64,
    /// Mean end-to-end time, seconds.
    pub e2e_mean_s: f64,
    /// Cached prompt tokens ÷ prompt tokens, engine-reported.
    pub hit_rate: f64,
    /// Max ÷ mean requests per replica (1 = perfectly even).
    pub replica_skew: f64,
}

/// Nearest-rank percentile of sorted `v` (0 when empty).
pub fn pct(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

impl Row {
    /// Summarises one run over `replicas` (their names: a replica that served nothing
    /// counts in the skew's mean).
    pub fn of(policy: &str, outcomes: &[Outcome], replicas: &[String]) -> Row {
        let mut ttft: Vec<f64> = outcomes.iter().filter_map(|o| o.ttft_s).collect();
        ttft.sort_by(f64::total_cmp);
        let e2e: Vec<f64> = outcomes.iter().filter_map(|o| o.e2e_s).collect();
        let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
        let prompt: u64 = ok.iter().map(|o| o.prompt_tokens as u64).sum();
        let cached: u64 = ok.iter().map(|o| o.cached_tokens as u64).sum();
        let mut per_replica: std::collections::BTreeMap<&str, usize> =
            replicas.iter().map(|r| (r.as_str(), 0)).collect();
        for o in &ok {
            *per_replica.entry(o.replica.as_str()).or_default() += 1;
        }
        let max = per_replica.values().copied().max().unwrap_or(0) as f64;
        let mean = if per_replica.is_empty() { 0.0 } else { ok.len() as f64 / per_replica.len() as f64 };
        Row {
            policy: policy.to_string(),
            requests: outcomes.len(),
            errors: outcomes.len() - ok.len(),
            ttft_p50_s: pct(&ttft, 0.5),
            ttft_p90_s: pct(&ttft, 0.9),
            ttft_p99_s: pct(&ttft, 0.99),
            e2e_mean_s: if e2e.is_empty() { 0.0 } else { e2e.iter().sum::<f64>() / e2e.len() as f64 },
            hit_rate: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
            replica_skew: if mean > 0.0 { max / mean } else { 0.0 },
        }
    }
}

/// Seconds as `123 ms` or `1.23 s`.
pub fn secs(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// A row's cells, in the column order of [`HEADER`].
fn cells(r: &Row) -> [String; 9] {
    [
        r.policy.clone(),
        r.requests.to_string(),
        r.errors.to_string(),
        secs(r.ttft_p50_s),
        secs(r.ttft_p90_s),
        secs(r.ttft_p99_s),
        secs(r.e2e_mean_s),
        format!("{:.1}%", r.hit_rate * 100.0),
        format!("{:.2}", r.replica_skew),
    ]
}

const HEADER: [&str; 9] =
    ["policy", "requests", "errors", "TTFT p50", "TTFT p90", "TTFT p99", "E2E mean", "hit rate", "skew"];

/// What the columns a reader cannot guess mean, under the table.
const LEGEND: &str = "hit rate: cached prompt tokens ÷ prompt tokens, as the engines report them · skew: the \
                      busiest replica's successful requests ÷ their mean per replica (1.00 = even)";

/// The rows as a terminal table, and the legend.
pub fn table(rows: &[Row]) -> String {
    let mut t = crate::table::plain(&HEADER, &[1, 2, 3, 4, 5, 6, 7, 8]);
    for r in rows {
        t.add_row(cells(r).to_vec());
    }
    format!("{}\n{LEGEND}\n", crate::table::lines(&t))
}

/// The rows as Markdown, with a header saying what ran, and the legend.
pub fn markdown(rows: &[Row], setup: &str) -> String {
    let mut out = format!("# kvmesh demo\n\n{setup}\n\n| {} |\n|{}\n", HEADER.join(" | "), "---|".repeat(9));
    for r in rows {
        let _ = writeln!(out, "| {} |", cells(r).join(" | "));
    }
    let _ = writeln!(out, "\n{LEGEND}");
    out
}

/// Writes `summary.md`, `summary.json` and `requests-<policy>.csv` into `dir`; returns the
/// paths written.
///
/// # Errors
/// The directory or a file cannot be written.
pub fn write(dir: &Path, rows: &[Row], runs: &[(String, Vec<Outcome>)], setup: &str) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
    let mut written = Vec::new();
    let md = dir.join("summary.md");
    std::fs::write(&md, markdown(rows, setup))?;
    written.push(md);
    let json = dir.join("summary.json");
    std::fs::write(&json, serde_json::to_string_pretty(&serde_json::json!({"setup": setup, "results": rows}))?)?;
    written.push(json);
    for (policy, outcomes) in runs {
        let csv = dir.join(format!("requests-{policy}.csv"));
        let mut text = String::from("arrival_s,node,replica,ttft_s,e2e_s,prompt_tokens,cached_tokens,error\n");
        for o in outcomes {
            let f = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.6}"));
            let _ = writeln!(
                text,
                "{:.6},{},{},{},{},{},{},{}",
                o.arrival_s,
                o.node,
                o.replica,
                f(o.ttft_s),
                f(o.e2e_s),
                o.prompt_tokens,
                o.cached_tokens,
                o.error.as_deref().unwrap_or("").replace(',', ";")
            );
        }
        std::fs::write(&csv, text)?;
        written.push(csv);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(replica: &str, ttft: Option<f64>, prompt: u32, cached: u32) -> Outcome {
        Outcome {
            arrival_s: 0.0,
            node: 1,
            replica: replica.into(),
            ttft_s: ttft,
            e2e_s: ttft.map(|t| t + 1.0),
            prompt_tokens: prompt,
            cached_tokens: cached,
            error: ttft.is_none().then(|| "HTTP 503".to_string()),
        }
    }

    #[test]
    fn a_row_summarises_exactly() {
        let runs = [
            o("e0", Some(0.1), 1000, 500),
            o("e0", Some(0.2), 1000, 0),
            o("e1", Some(0.4), 2000, 1000),
            o("e1", None, 3000, 0),
        ];
        let names: Vec<String> = ["e0", "e1", "e2"].iter().map(|s| s.to_string()).collect();
        let r = Row::of("token_load", &runs, &names);
        assert_eq!((r.requests, r.errors), (4, 1));
        assert_eq!((r.ttft_p50_s, r.ttft_p99_s), (0.2, 0.4));
        assert!((r.hit_rate - 1500.0 / 4000.0).abs() < 1e-12);
        assert!((r.e2e_mean_s - (1.1 + 1.2 + 1.4) / 3.0).abs() < 1e-12);
        // 3 served requests over 3 replicas (e2 idle): mean 1, max 2.
        assert!((r.replica_skew - 2.0).abs() < 1e-12);
        let t = table(&[r]);
        assert_eq!(
            t,
            format!(
                " policy      requests  errors  TTFT p50  TTFT p90  TTFT p99  E2E mean  hit rate  skew\n \
                 token_load         4       1    200 ms    400 ms    400 ms    1.23 s     37.5%  2.00\n{LEGEND}\n"
            )
        );
        // A policy that sends everything to one of them is not "even".
        let one = [o("e0", Some(0.1), 10, 0), o("e0", Some(0.1), 10, 0)];
        assert!((Row::of("x", &one, &names).replica_skew - 3.0).abs() < 1e-12);
    }
}
