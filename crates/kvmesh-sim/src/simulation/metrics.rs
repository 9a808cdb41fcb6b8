//! The figures a run is judged by, and the floors no router can beat.

use super::{Run, SimConfig};
use crate::trace::Trace;
use kvmesh_core::load::ReplicaProfile;
use std::collections::HashMap;

/// Summary of one run, as `kvmesh replay` prints it. Times in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct RunMetrics {
    /// Requests in the trace.
    pub requests: u64,
    /// Requests completed.
    pub completed: u64,
    /// Requests no engine could serve.
    pub rejected: u64,
    /// TTFT percentiles.
    pub ttft_p50: f64,
    /// 90th percentile TTFT.
    pub ttft_p90: f64,
    /// 99th percentile TTFT.
    pub ttft_p99: f64,
    /// The p99 TTFT this run's cache hits allow with no queueing: the 99th percentile of each
    /// completed request's own prefill of its uncached tokens, alone on its replica
    /// ([`ReplicaProfile::ttft`]`(prompt − cached, 0)`). `ttft_p99` minus it is what waiting
    /// added; it minus [`Floors::p99_all_cached`] is what the fleet's caches lost (evicted, or
    /// held where the request did not go).
    pub ttft_p99_no_queue: f64,
    /// Time per output token after the first (median), seconds/token.
    pub tpot_p50: f64,
    /// 99th percentile TPOT.
    pub tpot_p99: f64,
    /// Median end-to-end latency (arrival to last token).
    pub e2e_p50: f64,
    /// 99th percentile end-to-end latency.
    pub e2e_p99: f64,
    /// Groups of the trace (RL steps); 0 without groups.
    pub steps: u64,
    /// Median step completion time (a group's first arrival to its last finish); 0 without
    /// groups, infinite if a step never completed.
    pub step_p50: f64,
    /// 99th percentile step completion time (nearest rank: with fewer than 100 steps, the
    /// slowest).
    pub step_p99: f64,
    /// Sequences the engines preempted for KV (see [`super::Run::preemptions`]).
    pub preemptions: u64,
    /// Completed requests per second, first arrival to last completion.
    pub throughput_rps: f64,
    /// Output tokens per second over the same span.
    pub output_tps: f64,
    /// Prompt tokens served from engines' prefix caches / all prompt tokens (completed).
    pub hit_rate: f64,
    /// Largest engine prefill queue, averaged over arrivals, tokens (waiting requests count
    /// their whole prompt: their cache hit is known only at admission).
    pub load_max: f64,
    /// Mean engine prefill queue, averaged over arrivals, tokens.
    pub load_mean: f64,
    /// Requests whose TTFT exceeded the SLO (or that never got a first token).
    pub slo_violations: u64,
    /// Warm-up requests replication sent (0 without replication).
    pub warmups: u64,
    /// Tokens those warm-ups prefilled.
    pub warm_tokens: u64,
    /// KV memory the replication plan placed on targets, mean over the run, share of the
    /// fleet's KV capacity.
    pub replicated_kv_mean: f64,
    /// The same at its peak.
    pub replicated_kv_peak: f64,
    /// Share of requests whose TTFT met the SLO (completed requests over the SLO, and
    /// requests never served, count against it).
    pub slo_attainment: f64,
    /// GPU-seconds the pool ran (scaling only: every replica from being added to released;
    /// without scaling, every replica over the run).
    pub gpu_seconds: f64,
    /// Replicas added by the autoscaler.
    pub replicas_started: u64,
    /// The most replicas running at once.
    pub max_replicas: u32,
    /// The largest count any autoscaling decision asked for.
    pub max_desired: u32,
    /// Simulated events processed.
    pub events: u64,
    /// Wall-clock seconds.
    pub wall_s: f64,
}

/// Nearest-rank percentile of sorted `v` (0 when empty).
fn pct(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

impl RunMetrics {
    /// The figures of `run` under `config`.
    pub fn of(run: &Run, config: &SimConfig) -> Self {
        let done: Vec<_> = run.outcomes.iter().filter(|o| o.finish_s.is_finite()).collect();
        let ttft = sorted(done.iter().map(|o| o.first_token_s - o.arrival_s).collect());
        let step = config.profile.step();
        let own = sorted(done.iter().map(|o| o.no_queue_ttft_s(&step)).collect());
        let tpot = sorted(
            done.iter()
                .filter(|o| o.output_tokens > 1)
                .map(|o| (o.finish_s - o.first_token_s) / (o.output_tokens - 1) as f64)
                .collect(),
        );
        let e2e = sorted(done.iter().map(|o| o.finish_s - o.arrival_s).collect());
        let steps = sorted(run.group_times.clone());
        let start = run.outcomes.iter().map(|o| o.arrival_s).fold(f64::INFINITY, f64::min);
        let end = done.iter().map(|o| o.finish_s).fold(f64::NEG_INFINITY, f64::max);
        let span = (end - start).max(f64::MIN_POSITIVE);
        let prompt: u64 = done.iter().map(|o| o.prompt_tokens as u64).sum();
        let cached: u64 = done.iter().map(|o| o.cached_tokens as u64).sum();
        let output: u64 = done.iter().map(|o| o.output_tokens as u64).sum();
        let late = run
            .outcomes
            .iter()
            .filter(|o| !(o.first_token_s.is_finite() && o.first_token_s - o.arrival_s <= config.ttft_slo_s))
            .count();
        RunMetrics {
            requests: run.outcomes.len() as u64,
            completed: done.len() as u64,
            rejected: run.outcomes.iter().filter(|o| o.rejected).count() as u64,
            ttft_p50: pct(&ttft, 0.5),
            ttft_p90: pct(&ttft, 0.9),
            ttft_p99: pct(&ttft, 0.99),
            ttft_p99_no_queue: pct(&own, 0.99),
            tpot_p50: pct(&tpot, 0.5),
            tpot_p99: pct(&tpot, 0.99),
            e2e_p50: pct(&e2e, 0.5),
            e2e_p99: pct(&e2e, 0.99),
            steps: run.group_times.len() as u64,
            step_p50: pct(&steps, 0.5),
            step_p99: pct(&steps, 0.99),
            preemptions: run.preemptions,
            throughput_rps: done.len() as f64 / span,
            output_tps: output as f64 / span,
            hit_rate: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
            load_max: run.load_max_mean.0,
            load_mean: run.load_max_mean.1,
            slo_violations: late as u64,
            slo_attainment: 1.0 - late as f64 / run.outcomes.len().max(1) as f64,
            gpu_seconds: run.scaling.map_or(span * config.replicas as f64, |s| s.gpu_seconds),
            replicas_started: run.scaling.map_or(0, |s| s.replicas_started),
            max_replicas: run.scaling.map_or(config.replicas, |s| s.max_replicas),
            max_desired: run.scaling.map_or(config.replicas, |s| s.max_desired),
            warmups: run.replication.map_or(0, |r| r.warmups),
            warm_tokens: run.replication.map_or(0, |r| r.warm_tokens),
            replicated_kv_mean: run.replication.map_or(0.0, |r| r.planned_blocks_mean / r.fleet_blocks.max(1) as f64),
            replicated_kv_peak: run
                .replication
                .map_or(0.0, |r| r.planned_blocks_peak as f64 / r.fleet_blocks.max(1) as f64),
            events: run.events,
            wall_s: run.wall_s,
        }
    }

    /// The mean of several runs' figures (e.g. over seeds).
    pub fn mean(runs: &[RunMetrics]) -> RunMetrics {
        let n = runs.len().max(1) as f64;
        let avg = |f: fn(&RunMetrics) -> f64| runs.iter().map(f).sum::<f64>() / n;
        let avg_u = |f: fn(&RunMetrics) -> u64| (runs.iter().map(f).sum::<u64>() as f64 / n).round() as u64;
        RunMetrics {
            requests: avg_u(|m| m.requests),
            completed: avg_u(|m| m.completed),
            rejected: avg_u(|m| m.rejected),
            ttft_p50: avg(|m| m.ttft_p50),
            ttft_p90: avg(|m| m.ttft_p90),
            ttft_p99: avg(|m| m.ttft_p99),
            ttft_p99_no_queue: avg(|m| m.ttft_p99_no_queue),
            tpot_p50: avg(|m| m.tpot_p50),
            tpot_p99: avg(|m| m.tpot_p99),
            e2e_p50: avg(|m| m.e2e_p50),
            e2e_p99: avg(|m| m.e2e_p99),
            steps: avg_u(|m| m.steps),
            step_p50: avg(|m| m.step_p50),
            step_p99: avg(|m| m.step_p99),
            preemptions: avg_u(|m| m.preemptions),
            throughput_rps: avg(|m| m.throughput_rps),
            output_tps: avg(|m| m.output_tps),
            hit_rate: avg(|m| m.hit_rate),
            load_max: avg(|m| m.load_max),
            load_mean: avg(|m| m.load_mean),
            slo_violations: avg_u(|m| m.slo_violations),
            slo_attainment: avg(|m| m.slo_attainment),
            gpu_seconds: avg(|m| m.gpu_seconds),
            replicas_started: avg_u(|m| m.replicas_started),
            max_replicas: avg_u(|m| u64::from(m.max_replicas)) as u32,
            max_desired: avg_u(|m| u64::from(m.max_desired)) as u32,
            warmups: avg_u(|m| m.warmups),
            warm_tokens: avg_u(|m| m.warm_tokens),
            replicated_kv_mean: avg(|m| m.replicated_kv_mean),
            replicated_kv_peak: avg(|m| m.replicated_kv_peak),
            events: avg_u(|m| m.events),
            wall_s: avg(|m| m.wall_s),
        }
    }
}

/// The p99s no router can beat: every request alone on a replica, with no queueing.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Floors {
    /// p99 TTFT with nothing cached, seconds.
    pub p99_uncached: f64,
    /// p99 TTFT with every reusable prefix (leading blocks seen in an earlier request) cached,
    /// seconds.
    pub p99_all_cached: f64,
    /// p99 end-to-end latency with every reusable prefix cached and every request decoding
    /// alone (a batch of one, the fastest step there is): its prefill, then one step of
    /// `β0 + β2` per output token after the first, seconds.
    pub e2e_p99_all_cached: f64,
    /// p99 step completion time (a group's first arrival to its last finish, as
    /// [`RunMetrics::step_p99`]) with every request of the group served as in
    /// [`Floors::e2e_p99_all_cached`] from its own arrival, seconds; 0 without groups.
    pub step_p99_all_cached: f64,
    /// The most output tokens per second a run can show ([`RunMetrics::output_tps`]): every
    /// output token over the shortest span from the first arrival to the last finish, each
    /// request served as in [`Floors::e2e_p99_all_cached`] from its own arrival.
    pub output_tps_ceiling: f64,
}

/// The floors of `trace` on `profile` with blocks of `block_size` tokens.
///
/// A request alone computes its uncached prompt in `⌈u / C⌉` steps ([`ReplicaProfile::ttft`]
/// with nothing decoding), its first token at the end of the last, then one decode step of
/// `β0 + β2` per further token: the simulator's engine serves a lone request in that time
/// (a fully cached prompt recomputes a whole block there, counted here as one token), and
/// any batch, queue or cache miss only adds to it. The floors cover every request of the
/// trace, like the TTFT floors: a run that refuses requests (admission control, or an engine
/// that cannot hold them) is measured over fewer and can read past them.
pub fn floors(trace: &Trace, profile: &ReplicaProfile, block_size: u32) -> Floors {
    let cold: Vec<f64> = trace.requests.iter().map(|r| profile.ttft(u64::from(r.input_tokens.max(1)), 0)).collect();
    let warm: Vec<f64> = uncached_prompt_tokens(trace, block_size).into_iter().map(|u| profile.ttft(u, 0)).collect();
    let step = profile.step_overhead_s + profile.decode_s_per_token;
    let e2e: Vec<f64> =
        trace.requests.iter().zip(&warm).map(|(r, ttft)| ttft + f64::from(r.output_tokens.max(1) - 1) * step).collect();
    let steps =
        super::group_spans(trace.requests.iter().zip(&e2e).map(|(r, e)| (r.group, r.arrival_s, r.arrival_s + e)));
    let first = trace.requests.iter().map(|r| r.arrival_s).fold(f64::INFINITY, f64::min);
    let last = trace.requests.iter().zip(&e2e).map(|(r, e)| r.arrival_s + e).fold(f64::NEG_INFINITY, f64::max);
    // As the engine counts them: every request produces at least its first token.
    let output: u64 = trace.requests.iter().map(|r| u64::from(r.output_tokens.max(1))).sum();
    Floors {
        output_tps_ceiling: if last > first { output as f64 / (last - first) } else { 0.0 },
        p99_uncached: pct(&sorted(cold), 0.99),
        p99_all_cached: pct(&sorted(warm), 0.99),
        e2e_p99_all_cached: pct(&sorted(e2e), 0.99),
        step_p99_all_cached: pct(&sorted(steps), 0.99),
    }
}

impl Floors {
    /// Each figure's mean over `floors` (a generated scenario draws one trace per seed, and a
    /// run's figures are means over its seeds); all zero when empty.
    pub fn mean(floors: &[Floors]) -> Floors {
        let n = floors.len().max(1) as f64;
        let avg = |f: fn(&Floors) -> f64| floors.iter().map(f).sum::<f64>() / n;
        Floors {
            p99_uncached: avg(|f| f.p99_uncached),
            p99_all_cached: avg(|f| f.p99_all_cached),
            e2e_p99_all_cached: avg(|f| f.e2e_p99_all_cached),
            step_p99_all_cached: avg(|f| f.step_p99_all_cached),
            output_tps_ceiling: avg(|f| f.output_tps_ceiling),
        }
    }
}

/// Per request of `trace`, in order, the prompt tokens no earlier request computed: its
/// prompt minus the leading tokens of block ids some earlier request covered (as far as it
/// covered them), in whole blocks of `block_size` tokens, at least one token (the prompt's last
/// is always computed). Without block ids: the whole prompt. An infinite cache shared by the
/// fleet — what the floors and `kvmesh analyze`'s P:D advice assume.
pub fn uncached_prompt_tokens(trace: &Trace, block_size: u32) -> Vec<u64> {
    // Tokens of each id some earlier request computed (a request's last id may be partial).
    let mut seen: HashMap<u64, u64> = HashMap::new();
    let bt = u64::from(trace.block_tokens.unwrap_or(0));
    let bs = u64::from(block_size.max(1));
    let mut out = Vec::with_capacity(trace.requests.len());
    for r in &trace.requests {
        let input = u64::from(r.input_tokens.max(1));
        let covered = |k: usize| bt.min(input.saturating_sub(k as u64 * bt));
        let mut reused = 0;
        for (k, id) in r.block_ids.iter().enumerate() {
            match seen.get(id) {
                Some(&had) => {
                    reused += had.min(covered(k));
                    if had < covered(k) {
                        break;
                    }
                }
                None => break,
            }
        }
        out.push(input - (reused / bs * bs).min(input - 1));
        for (k, id) in r.block_ids.iter().enumerate() {
            let c = seen.entry(*id).or_default();
            *c = (*c).max(covered(k));
        }
    }
    out
}
