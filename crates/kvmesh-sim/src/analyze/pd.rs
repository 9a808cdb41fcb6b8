//! A prefill:decode split for a trace: how many of `gpus` replicas to give each side so both
//! carry the trace's work at the utilisation its SLOs allow.
//!
//! A capacity balance, not a simulation (check the advice with `kvmesh replay --pd P:D`):
//!
//! - **Prefill work** per request: its uncached prompt tokens (the prompt minus the leading
//!   blocks an earlier request of the trace computed, as [`crate::simulation::floors`] counts
//!   them — an optimistic cache) at `β1 + β0 / chunk` seconds a token (a busy prefill replica
//!   packs whole chunks per step). A prefill replica runs at most at the utilisation `ρp` the
//!   TTFT SLO leaves room for: the largest `ρ` with `t99 + ρ / (1 − ρ) · s̄ ≤ SLO`, where `s̄`
//!   is the mean prefill time and `t99` the 99th percentile of a request's prefill plus its
//!   whole prompt's KV transfer over the link (the queueing wait of a single-server queue,
//!   `ρ / (1 − ρ)` mean services, on top of the slowest prompts), capped at 0.95.
//! - **Decode work** per output token: `(β0 + β2 · B) / B` seconds at a decode batch of `B`
//!   sequences — as many as the KV cache holds at the trace's mean context (prompt plus half
//!   the output), at most `max_batch`, and at most what keeps a step within the TPOT SLO
//!   (`β0 + β2 · B ≤ TPOT`). A decode replica runs at up to 0.9.
//! - At the trace's own rate `λ`, prefill needs `λ · s̄ / ρp` replicas and decode
//!   `λ · ō · c / 0.9` (ō the mean output, c the cost per token): `gpus` are split in that
//!   proportion (at least one each), and `max_rate_scale` says how far the rate can grow on
//!   that split before one side is full.

use crate::engine::EngineProfile;
use crate::trace::Trace;

/// Decode replicas run at most this busy.
const DECODE_UTILISATION: f64 = 0.9;
/// Prefill replicas never plan past this utilisation.
const MAX_PREFILL_UTILISATION: f64 = 0.95;

/// What the SLOs are and how many replicas there are to split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdTarget {
    /// Replicas (GPUs) to split.
    pub gpus: u32,
    /// TTFT SLO, seconds.
    pub ttft_slo_s: f64,
    /// TPOT SLO, seconds per token; `None`: no bound on the decode batch but KV and
    /// `max_batch`.
    pub tpot_slo_s: Option<f64>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The link a prompt's KV crosses from prefill to decode replica, Gb/s.
    pub link_gbps: f64,
}

/// A split and the figures behind it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PdAdvice {
    /// Replicas split.
    pub gpus: u32,
    /// Prefill replicas advised.
    pub prefill: u32,
    /// Decode replicas advised.
    pub decode: u32,
    /// Mean prefill time of a request on an idle replica (uncached tokens), seconds.
    pub prefill_s_mean: f64,
    /// Its 99th percentile, seconds.
    pub prefill_s_p99: f64,
    /// The 99th percentile of a request's prefill plus its prompt's KV transfer, seconds: the
    /// least TTFT the slowest prompts see on an idle fleet.
    pub handoff_s_p99: f64,
    /// Prefill utilisation the TTFT SLO allows (0 when even an idle fleet misses it).
    pub prefill_utilisation: f64,
    /// Whether the slowest prompts' prefill and transfer fit the TTFT SLO at all; when not, the
    /// split balances work alone (prefill at 0.95).
    pub slo_reachable: bool,
    /// Decode batch the KV cache, `max_batch` and the TPOT SLO allow, sequences.
    pub decode_batch: u32,
    /// Decode seconds per output token at that batch.
    pub decode_s_per_token: f64,
    /// Prefill replicas busy at the trace's own rate (at their utilisation).
    pub prefill_replicas_needed: f64,
    /// Decode replicas busy at the trace's own rate (at 0.9).
    pub decode_replicas_needed: f64,
    /// How far the trace's rate can be scaled on the advised split before either side is at
    /// its utilisation.
    pub max_rate_scale: f64,
}

/// The split of `target.gpus` replicas of `profile` for `trace` (see the module docs); `None`
/// when the trace has no span (every request at once: no rate) or no request.
pub fn advise_pd(trace: &Trace, profile: &EngineProfile, target: &PdTarget) -> Option<PdAdvice> {
    let reqs = &trace.requests;
    let span = reqs.last()?.arrival_s - reqs.first()?.arrival_s;
    if span <= 0.0 || target.gpus < 2 {
        return None;
    }
    let rate = reqs.len() as f64 / span;
    let per_token = profile.prefill_s_per_token + profile.step_overhead_s / f64::from(profile.chunk_tokens.max(1));
    let bs = u64::from(target.block_size.max(1));
    let per_block = (bs * profile.kv_bytes_per_token) as f64 * 8.0 / (target.link_gbps * 1e9);
    let uncached = crate::simulation::uncached_prompt_tokens(trace, target.block_size);
    let mut prefill: Vec<f64> = uncached.iter().map(|&u| u as f64 * per_token).collect();
    let mut handoff: Vec<f64> = uncached
        .iter()
        .zip(reqs)
        .map(|(&u, r)| u as f64 * per_token + u64::from(r.input_tokens.max(1)).div_ceil(bs) as f64 * per_block)
        .collect();
    prefill.sort_by(f64::total_cmp);
    handoff.sort_by(f64::total_cmp);
    let n = prefill.len() as f64;
    let at99 = |v: &[f64]| v[((0.99 * n).ceil() as usize).clamp(1, v.len()) - 1];
    let mean = prefill.iter().sum::<f64>() / n;
    let (p99, h99) = (at99(&prefill), at99(&handoff));
    // The largest ρ with h99 + ρ/(1−ρ)·mean ≤ SLO: ρ = x / (1 + x), x = (SLO − h99) / mean.
    let room = target.ttft_slo_s - h99;
    let rho =
        if room <= 0.0 || mean <= 0.0 { 0.0 } else { (room / mean / (1.0 + room / mean)).min(MAX_PREFILL_UTILISATION) };
    let mean_in = reqs.iter().map(|r| f64::from(r.input_tokens)).sum::<f64>() / n;
    let mean_out = reqs.iter().map(|r| f64::from(r.output_tokens.max(1))).sum::<f64>() / n;
    let by_kv = (profile.kv_tokens as f64 / (mean_in + mean_out / 2.0).max(1.0)).floor();
    let by_tpot = target
        .tpot_slo_s
        .map_or(f64::INFINITY, |t| ((t - profile.step_overhead_s) / profile.decode_s_per_token).floor());
    let batch = by_kv.min(by_tpot).min(f64::from(profile.max_batch)).max(1.0);
    let decode_per_token = (profile.step_overhead_s + profile.decode_s_per_token * batch) / batch;
    // An SLO the slowest prompts miss even on an idle fleet: split by work alone.
    let slo_reachable = rho > 0.0;
    let prefill_needed = rate * mean / if slo_reachable { rho } else { MAX_PREFILL_UTILISATION };
    let decode_needed = rate * mean_out * decode_per_token / DECODE_UTILISATION;
    let gpus = f64::from(target.gpus);
    let share = prefill_needed / (prefill_needed + decode_needed);
    let p = ((gpus * share).round() as u32).clamp(1, target.gpus - 1);
    let d = target.gpus - p;
    let max_rate_scale = (f64::from(p) / prefill_needed).min(f64::from(d) / decode_needed);
    Some(PdAdvice {
        gpus: target.gpus,
        prefill: p,
        decode: d,
        prefill_s_mean: mean,
        prefill_s_p99: p99,
        handoff_s_p99: h99,
        prefill_utilisation: rho,
        slo_reachable,
        decode_batch: batch as u32,
        decode_s_per_token: decode_per_token,
        prefill_replicas_needed: prefill_needed,
        decode_replicas_needed: decode_needed,
        max_rate_scale,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{TraceFormat, TraceRequest};

    fn trace(reqs: &[(f64, u32, u32, &[u64])]) -> Trace {
        let requests = reqs
            .iter()
            .map(|&(arrival_s, input_tokens, output_tokens, ids)| TraceRequest {
                arrival_s,
                input_tokens,
                output_tokens,
                block_ids: ids.to_vec(),
                max_tokens: None,
                group: None,
            })
            .collect();
        Trace { format: TraceFormat::Mooncake, block_tokens: Some(512), requests, skipped: vec![] }
    }

    #[test]
    fn the_split_balances_prefill_and_decode_work_at_their_utilisations() {
        // Four requests over 3 s: 2,048-token prompts, the last two sharing the first's
        // leading 1,024 tokens; 100 output tokens each.
        let t = trace(&[
            (0.0, 2048, 100, &[1, 2, 3, 4]),
            (1.0, 2048, 100, &[5, 6, 7, 8]),
            (2.0, 2048, 100, &[1, 2, 9, 10]),
            (3.0, 2048, 100, &[5, 6, 11, 12]),
        ]);
        let h100 = EngineProfile::h100();
        let target = PdTarget { gpus: 16, ttft_slo_s: 1.0, tpot_slo_s: None, block_size: 16, link_gbps: 100.0 };
        let a = advise_pd(&t, &h100, &target).unwrap();
        // Prefill: 2,048, 2,048, 1,024, 1,024 tokens at 17.25 µs + 5.75 ms / 8,192.
        let per = 17.25e-6 + 5.75e-3 / 8192.0;
        assert!((a.prefill_s_mean - 1536.0 * per).abs() < 1e-12);
        assert!((a.prefill_s_p99 - 2048.0 * per).abs() < 1e-12);
        // The slowest hand-off: 2,048 tokens' prefill and 128 blocks of 2 MiB at 100 Gb/s.
        let h99 = 2048.0 * per + 128.0 * (16.0 * 131_072.0 * 8.0 / 100e9);
        assert!((a.handoff_s_p99 - h99).abs() < 1e-12);
        let x = (1.0 - h99) / (1536.0 * per);
        assert!((a.prefill_utilisation - 0.95f64.min(x / (1.0 + x))).abs() < 1e-12);
        // Decode: 470,000 KV tokens / (2,048 + 50) = 224 sequences, under max_batch 256.
        assert_eq!(a.decode_batch, 224);
        assert!((a.decode_s_per_token - (5.75e-3 + 6e-6 * 224.0) / 224.0).abs() < 1e-15);
        let rate = 4.0 / 3.0;
        assert!((a.prefill_replicas_needed - rate * 1536.0 * per / a.prefill_utilisation).abs() < 1e-12);
        assert!((a.decode_replicas_needed - rate * 100.0 * a.decode_s_per_token / 0.9).abs() < 1e-12);
        // Prefill-heavy: 0.0387 against 0.0047 replicas busy → 14 of 16 for prefill.
        assert_eq!((a.prefill, a.decode), (14, 2));
        // A TPOT SLO of 6 ms caps the batch at (6 − 5.75) ms / 6 µs = 41.
        let tight = advise_pd(&t, &h100, &PdTarget { tpot_slo_s: Some(6e-3), ..target }).unwrap();
        assert_eq!(tight.decode_batch, 41);
        // An SLO below the slowest prompt's prefill and transfer: said so, split by work alone
        // (prefill at 0.95, as here).
        let hopeless = advise_pd(&t, &h100, &PdTarget { ttft_slo_s: 0.01, ..target }).unwrap();
        assert_eq!((hopeless.slo_reachable, hopeless.prefill_utilisation), (false, 0.0));
        assert_eq!((hopeless.prefill, hopeless.decode), (14, 2));
        assert_eq!(advise_pd(&trace(&[(0.0, 10, 1, &[])]), &h100, &target), None);
    }
}
