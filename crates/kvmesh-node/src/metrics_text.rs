//! The metrics page in Prometheus' classic text format (version 0.0.4), for scrapers that do
//! not speak OpenMetrics. prometheus-client writes OpenMetrics only: its counter families are
//! named without `_total` (so a classic parser, seeing `# TYPE kvmesh_requests counter` and
//! then samples `kvmesh_requests_total`, reads every counter as untyped), `info` and `unknown`
//! are not classic types, and the page ends with `# EOF` and may carry `# UNIT` lines and
//! exemplars. The classic format: prometheus.io/docs/instrumenting/exposition_formats/.

use std::collections::HashMap;

/// Content type of the OpenMetrics page (the default).
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of the classic page.
pub const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether an `Accept` header asks for the classic format: it names `text/plain` and not
/// `application/openmetrics-text`. Without the header, or with `*/*` alone, OpenMetrics (what
/// Prometheus asks for first).
pub fn wants_classic(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| {
        let a = a.to_ascii_lowercase();
        a.contains("text/plain") && !a.contains("application/openmetrics-text")
    })
}

/// `page`, OpenMetrics text as prometheus-client writes it, in the classic format: counter
/// families named with `_total`, `info` as a gauge named with `_info`, `unknown` as
/// `untyped`; no `# UNIT`, no `# EOF`, no exemplars, no counters' `_created` samples.
pub fn to_classic(page: &str) -> String {
    let kinds: HashMap<&str, &str> = page.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' ')).collect();
    let family = |name: &str| -> String {
        match kinds.get(name).copied() {
            Some("counter") => format!("{name}_total"),
            Some("info") => format!("{name}_info"),
            _ => name.to_string(),
        }
    };
    let mut out = String::with_capacity(page.len());
    for line in page.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let kind = match kind {
                "counter" | "gauge" | "histogram" | "summary" => kind,
                "info" | "stateset" | "gaugehistogram" => "gauge",
                _ => "untyped",
            };
            out.push_str(&format!("# TYPE {} {kind}\n", family(name)));
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push_str(&format!("# HELP {} {help}\n", family(name)));
        } else if line.starts_with('#') || line.is_empty() {
            // `# EOF`, `# UNIT`: not in the classic format.
        } else {
            let sample = line.split_once(" # {").map_or(line, |(s, _)| s);
            let name = sample.split(['{', ' ']).next().unwrap_or("");
            let created = name.strip_suffix("_created").is_some_and(|f| kinds.get(f) == Some(&"counter"));
            if !created {
                out.push_str(sample);
                out.push('\n');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_becomes_classic_text() {
        let page = "# HELP kvmesh_requests Requests by outcome.\n# TYPE kvmesh_requests counter\n\
                    kvmesh_requests_total{outcome=\"ok\"} 3\nkvmesh_requests_created{outcome=\"ok\"} 1.5\n\
                    # HELP kvmesh_lag_seconds Lag.\n# TYPE kvmesh_lag_seconds histogram\n# UNIT kvmesh_lag_seconds seconds\n\
                    kvmesh_lag_seconds_bucket{le=\"0.1\"} 2 # {trace_id=\"ab\"} 0.05\nkvmesh_lag_seconds_sum 0.1\n\
                    kvmesh_lag_seconds_count 2\n# TYPE kvmesh_build info\nkvmesh_build_info{version=\"1\"} 1\n\
                    # TYPE kvmesh_x unknown\nkvmesh_x 7\n# EOF\n";
        assert_eq!(
            to_classic(page),
            "# HELP kvmesh_requests_total Requests by outcome.\n# TYPE kvmesh_requests_total counter\n\
             kvmesh_requests_total{outcome=\"ok\"} 3\n\
             # HELP kvmesh_lag_seconds Lag.\n# TYPE kvmesh_lag_seconds histogram\n\
             kvmesh_lag_seconds_bucket{le=\"0.1\"} 2\nkvmesh_lag_seconds_sum 0.1\nkvmesh_lag_seconds_count 2\n\
             # TYPE kvmesh_build_info gauge\nkvmesh_build_info{version=\"1\"} 1\n# TYPE kvmesh_x untyped\nkvmesh_x 7\n"
        );
    }

    #[test]
    fn only_a_plain_text_accept_without_openmetrics_gets_classic() {
        assert!(!wants_classic(None));
        assert!(!wants_classic(Some("*/*")));
        // Prometheus' own scrape header prefers OpenMetrics.
        let prometheus =
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,\
                          text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(!wants_classic(Some(prometheus)));
        assert!(wants_classic(Some("text/plain;version=0.0.4")));
        assert!(wants_classic(Some("Text/Plain")));
    }
}
