//! What an operator needs from a trace to pick a routing strategy: volume, rate, length
//! percentiles, how much of the prompt traffic repeats an earlier prefix, and how concentrated
//! that reuse is.
//!
//! Definitions (block = one `hash_ids` entry, 512 tokens for Mooncake):
//! - **prefix-reuse ratio**: of all block references, in arrival order, the fraction whose
//!   block id appeared in an earlier request — the hit rate of an infinite, shared cache.
//! - **shared prefix of a request**: its leading blocks that at least one other request of
//!   the trace also has; requests are grouped by the last such block, and the report gives the
//!   share of requests in the largest groups — how much traffic a handful of prefixes carry.
//!   A request is in one group only, its deepest: a system prompt that every conversation
//!   starts with shows as the share of requests that start with the most common first block,
//!   not as its group (which holds only the requests that share nothing longer).

mod pd;
mod report;

pub use pd::{advise_pd, PdAdvice, PdTarget};

use crate::trace::{Trace, TraceFormat};
use std::collections::{HashMap, HashSet};

/// Mean and percentiles of one per-request quantity, tokens.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Distribution {
    /// Arithmetic mean.
    pub mean: f64,
    /// Median (nearest rank).
    pub p50: u32,
    /// 90th percentile (nearest rank).
    pub p90: u32,
    /// 99th percentile (nearest rank).
    pub p99: u32,
    /// Largest value.
    pub max: u32,
}

impl Distribution {
    /// The distribution of `values` (all zeros when empty).
    pub fn of(values: impl Iterator<Item = u32>) -> Self {
        let mut v: Vec<u32> = values.collect();
        if v.is_empty() {
            return Distribution { mean: 0.0, p50: 0, p90: 0, p99: 0, max: 0 };
        }
        v.sort_unstable();
        let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        Distribution { mean, p50: rank(0.5), p90: rank(0.9), p99: rank(0.99), max: *v.last().unwrap_or(&0) }
    }
}

/// One group of requests sharing the same longest shared prefix.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PrefixGroup {
    /// The last block id of the shared prefix.
    pub block_id: u64,
    /// Its length, blocks.
    pub depth_blocks: u32,
    /// Requests in the group.
    pub requests: u64,
    /// Their share of all requests, 0 to 1.
    pub share: f64,
}

/// Prefix statistics (traces with block ids only).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PrefixStats {
    /// Tokens per block.
    pub block_tokens: u32,
    /// Block references over all requests.
    pub block_refs: u64,
    /// References to a block seen in an earlier request.
    pub reused_refs: u64,
    /// `reused_refs / block_refs`.
    pub reuse_ratio: f64,
    /// Distinct block ids.
    pub distinct_blocks: u64,
    /// Share of requests sharing no leading block with any other request.
    pub unshared_share: f64,
    /// The most common first block and the share of requests that start with it (ties: the
    /// lowest block id); `None` when no two requests start with the same block.
    pub first_block: Option<(u64, f64)>,
    /// Distinct shared-prefix groups.
    pub groups: u64,
    /// Share of requests in the largest 1, 10 and 100 groups: `(k, share)`.
    pub top_k_share: Vec<(u32, f64)>,
    /// The largest groups, largest first (ties by block id), at most `top` of them.
    pub top: Vec<PrefixGroup>,
}

/// Everything `kvmesh analyze` reports about a trace.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TraceStats {
    /// The trace's format.
    pub format: TraceFormat,
    /// Requests read.
    pub requests: u64,
    /// Lines skipped as malformed.
    pub skipped_lines: u64,
    /// First to last arrival, seconds.
    pub span_s: f64,
    /// Requests per second over the span; `None` when every request arrives at the same time
    /// (no span to divide by).
    pub rate_rps: Option<f64>,
    /// Prompt lengths, tokens.
    pub input_tokens: Distribution,
    /// Output lengths, tokens.
    pub output_tokens: Distribution,
    /// Prefix statistics; `None` when the trace has no prefix information.
    pub prefix: Option<PrefixStats>,
}

/// Computes the statistics of `trace`, listing the `top` largest prefix groups.
pub fn analyze(trace: &Trace, top: usize) -> TraceStats {
    let reqs = &trace.requests;
    let span_s = match (reqs.first(), reqs.last()) {
        (Some(a), Some(b)) => b.arrival_s - a.arrival_s,
        _ => 0.0,
    };
    TraceStats {
        format: trace.format,
        requests: reqs.len() as u64,
        skipped_lines: trace.skipped.len() as u64,
        span_s,
        rate_rps: (span_s > 0.0).then(|| reqs.len() as f64 / span_s),
        input_tokens: Distribution::of(reqs.iter().map(|r| r.input_tokens)),
        output_tokens: Distribution::of(reqs.iter().map(|r| r.output_tokens)),
        prefix: trace
            .block_tokens
            .filter(|_| reqs.iter().any(|r| !r.block_ids.is_empty()))
            .map(|bt| prefix_stats(trace, bt, top)),
    }
}

fn prefix_stats(trace: &Trace, block_tokens: u32, top: usize) -> PrefixStats {
    let mut seen: HashSet<u64> = HashSet::new();
    let mut users: HashMap<u64, u64> = HashMap::new();
    let (mut refs, mut reused) = (0u64, 0u64);
    for r in &trace.requests {
        for id in &r.block_ids {
            refs += 1;
            reused += seen.contains(id) as u64;
            *users.entry(*id).or_default() += 1;
        }
        seen.extend(r.block_ids.iter().copied());
    }
    let mut groups: HashMap<(u64, u32), u64> = HashMap::new();
    let mut unshared = 0u64;
    for r in &trace.requests {
        let depth = r.block_ids.iter().take_while(|id| users[id] >= 2).count();
        match depth {
            0 => unshared += 1,
            d => *groups.entry((r.block_ids[d - 1], d as u32)).or_default() += 1,
        }
    }
    let n = trace.requests.len().max(1) as f64;
    let mut firsts: HashMap<u64, u64> = HashMap::new();
    for id in trace.requests.iter().filter_map(|r| r.block_ids.first()) {
        *firsts.entry(*id).or_default() += 1;
    }
    let first_block = firsts
        .into_iter()
        .filter(|&(_, k)| k >= 2)
        .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
        .map(|(id, k)| (id, k as f64 / n));
    let mut sizes: Vec<((u64, u32), u64)> = groups.into_iter().collect();
    sizes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0 .0.cmp(&b.0 .0)));
    let top_k_share = [1u32, 10, 100]
        .iter()
        .map(|&k| (k, sizes.iter().take(k as usize).map(|s| s.1).sum::<u64>() as f64 / n))
        .collect();
    PrefixStats {
        block_tokens,
        block_refs: refs,
        reused_refs: reused,
        reuse_ratio: if refs == 0 { 0.0 } else { reused as f64 / refs as f64 },
        distinct_blocks: seen.len() as u64,
        unshared_share: unshared as f64 / n,
        first_block,
        groups: sizes.len() as u64,
        top_k_share,
        top: sizes
            .iter()
            .take(top)
            .map(|&((block_id, depth_blocks), requests)| PrefixGroup {
                block_id,
                depth_blocks,
                requests,
                share: requests as f64 / n,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceRequest;

    fn req(at: f64, input: u32, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            arrival_s: at,
            input_tokens: input,
            output_tokens: input / 2,
            block_ids: ids.to_vec(),
            max_tokens: None,
            group: None,
        }
    }

    #[test]
    fn reuse_ratio_counts_references_seen_in_earlier_requests() {
        let trace = Trace {
            format: TraceFormat::Mooncake,
            block_tokens: Some(512),
            requests: vec![
                req(0.0, 1000, &[0, 1]),
                req(1.0, 1500, &[0, 1, 2]),
                req(4.0, 900, &[0, 3]),
                req(4.0, 10, &[9]),
            ],
            skipped: vec![],
        };
        let s = analyze(&trace, 5);
        assert_eq!((s.requests, s.span_s, s.rate_rps), (4, 4.0, Some(1.0)));
        let at_once = Trace { requests: trace.requests[..1].to_vec(), ..trace.clone() };
        assert_eq!(analyze(&at_once, 5).rate_rps, None, "one request: no span, no rate");
        let p = s.prefix.unwrap();
        // 8 references; 0 and 1 again in request 2, 0 again in request 3.
        assert_eq!((p.block_refs, p.reused_refs, p.reuse_ratio), (8, 3, 0.375));
        assert_eq!(p.distinct_blocks, 5);
        // Groups: {r1, r2} share [0, 1]; r3 shares [0]; r4 shares nothing.
        assert_eq!(p.groups, 2);
        assert_eq!(p.unshared_share, 0.25);
        // Three of four start with block 0 (one of them shares nothing longer).
        assert_eq!(p.first_block, Some((0, 0.75)));
        assert_eq!(p.top[0], PrefixGroup { block_id: 1, depth_blocks: 2, requests: 2, share: 0.5 });
        assert_eq!(p.top_k_share, vec![(1, 0.5), (10, 0.75), (100, 0.75)]);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let d = Distribution::of(1..=100);
        assert_eq!((d.p50, d.p90, d.p99, d.max, d.mean), (50, 90, 99, 100, 50.5));
        assert_eq!(Distribution::of([7].into_iter()).p99, 7);
    }
}
