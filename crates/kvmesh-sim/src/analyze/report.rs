//! The terminal rendering of [`TraceStats`].

use super::{Distribution, TraceStats};
use crate::trace::TraceFormat;
use std::fmt::Write;

impl TraceStats {
    /// A readable report for a terminal, `source` naming the trace.
    pub fn render(&self, source: &str) -> String {
        let mut out = String::new();
        let format = match self.format {
            TraceFormat::Mooncake => "Mooncake JSONL",
            TraceFormat::Azure => "Azure LLM CSV",
            TraceFormat::Native => "kvmesh JSONL",
        };
        let _ = if source.starts_with("built-in") {
            writeln!(out, "{:<17}{source}", "trace")
        } else {
            writeln!(out, "{:<17}{source} ({format})", "trace")
        };
        let _ = writeln!(
            out,
            "{:<17}{} ({} malformed lines skipped)",
            "requests",
            thousands(self.requests),
            self.skipped_lines
        );
        let _ = writeln!(out, "{:<17}{:.1} s", "span", self.span_s);
        let _ = match self.rate_rps {
            Some(r) => writeln!(out, "{:<17}{r:.2} req/s", "rate"),
            None => writeln!(out, "{:<17}n/a: every request arrives at the same time", "rate"),
        };
        let _ = writeln!(out, "{:<17}{}", "input tokens", dist(&self.input_tokens));
        let _ = writeln!(out, "{:<17}{}", "output tokens", dist(&self.output_tokens));
        match &self.prefix {
            None => {
                let _ = writeln!(out, "{:<17}n/a: this format carries no prefix information", "prefix reuse");
            }
            Some(p) => {
                let _ = writeln!(
                    out,
                    "{:<17}{:.3} ({} of {} block references seen before; {}-token blocks, {} distinct)",
                    "prefix reuse",
                    p.reuse_ratio,
                    thousands(p.reused_refs),
                    thousands(p.block_refs),
                    p.block_tokens,
                    thousands(p.distinct_blocks)
                );
                let tops: Vec<String> =
                    p.top_k_share.iter().map(|(k, s)| format!("top {k} {:.1}%", 100.0 * s)).collect();
                if let Some((id, share)) = p.first_block {
                    let _ = writeln!(
                        out,
                        "{:<17}block {id} is the first block of {:.1}% of requests",
                        "common start",
                        100.0 * share
                    );
                }
                let _ = writeln!(
                    out,
                    "{:<17}{} {} (each request by the deepest block it shares with another); \
                     share of requests in the largest: {}; {:.1}% share no prefix",
                    "shared prefixes",
                    thousands(p.groups),
                    if p.groups == 1 { "group" } else { "groups" },
                    tops.join(", "),
                    100.0 * p.unshared_share
                );
                for g in &p.top {
                    let _ = writeln!(
                        out,
                        "{:<17}block {} at depth {} ({} tokens): {} requests ({:.2}%)",
                        "",
                        g.block_id,
                        g.depth_blocks,
                        thousands(g.depth_blocks as u64 * p.block_tokens as u64),
                        thousands(g.requests),
                        100.0 * g.share
                    );
                }
            }
        }
        out
    }
}

fn dist(d: &Distribution) -> String {
    format!(
        "mean {}  p50 {}  p90 {}  p99 {}  max {}",
        thousands(d.mean.round() as u64),
        thousands(d.p50 as u64),
        thousands(d.p90 as u64),
        thousands(d.p99 as u64),
        thousands(d.max as u64)
    )
}

/// `12031` → `12,031`.
pub(crate) fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn thousands_separators() {
        assert_eq!(super::thousands(0), "0");
        assert_eq!(super::thousands(999), "999");
        assert_eq!(super::thousands(12031), "12,031");
        assert_eq!(super::thousands(1234567), "1,234,567");
    }
}
