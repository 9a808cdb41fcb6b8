//! `rl`: asynchronous GRPO-style RL rollouts — the decode-heavy traffic of an RL trainer.
//!
//! Every step the trainer submits [`PROMPTS_PER_STEP`] prompts, each sampled
//! [`GROUP_SIZE`] times (the group shares its prompt), all within the step's first second, and
//! waits for the step's last rollout; it does not wait before submitting the next step (fully
//! asynchronous, as off-policy trainers run), so steps are `P · G / rate` seconds apart.
//!
//! Prompts: one of [`TASKS`] task prompts (one 512-token block each: instructions and
//! few-shot examples), then a question of 1–2 blocks of its own, its last block cut short by
//! up to 300 tokens. Output lengths are lognormal per task — medians [`TASK_MEDIANS`], σ
//! [`SIGMA`] (so a few rollouts run 5–10× the median: the stragglers) — clamped to
//! [1, [`MAX_TOKENS`]]; every request sends `max_tokens` = [`MAX_TOKENS`], far above the
//! medians, as RL trainers do. Each request's `group` is its step.

use super::params::ScenarioParams;
use super::{into_trace, lognormal};
use crate::trace::{mooncake::BLOCK_TOKENS, Trace, TraceRequest};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Samples per prompt (GRPO's G).
pub const GROUP_SIZE: u32 = 8;
/// Prompts per step.
pub const PROMPTS_PER_STEP: u32 = 16;
/// Task prompts the questions are drawn under.
pub const TASKS: usize = 4;
/// Median output length per task, tokens.
pub const TASK_MEDIANS: [f64; TASKS] = [192.0, 384.0, 768.0, 1536.0];
/// Lognormal σ of output lengths (of the natural log).
pub const SIGMA: f64 = 1.0;
/// The `max_tokens` every rollout sends, tokens.
pub const MAX_TOKENS: u32 = 8192;

/// Generates `p.requests` rollouts at a mean of `p.rate` per second (see the module docs).
pub fn generate(p: &ScenarioParams) -> Trace {
    let mut rng = SmallRng::seed_from_u64(p.seed);
    let per_step = PROMPTS_PER_STEP * GROUP_SIZE;
    let period = f64::from(per_step) / p.rate;
    // Block ids: the task prompts take 0..TASKS, questions count on from there.
    let mut next_id = TASKS as u64;
    let mut out = Vec::with_capacity(p.requests as usize);
    let mut step = 0u32;
    while out.len() < p.requests as usize {
        let start = f64::from(step) * period;
        for _ in 0..PROMPTS_PER_STEP {
            let task = rng.random_range(0..TASKS);
            let question = rng.random_range(1..=2u64);
            let mut block_ids = vec![task as u64];
            block_ids.extend(next_id..next_id + question);
            next_id += question;
            let input_tokens = (1 + question as u32) * BLOCK_TOKENS - rng.random_range(0..=300);
            for _ in 0..GROUP_SIZE {
                let len = lognormal(&mut rng, TASK_MEDIANS[task], SIGMA);
                out.push(TraceRequest {
                    arrival_s: start + rng.random::<f64>(),
                    input_tokens,
                    output_tokens: (len.round() as u32).clamp(1, MAX_TOKENS),
                    block_ids: block_ids.clone(),
                    max_tokens: Some(MAX_TOKENS),
                    group: Some(step),
                });
            }
        }
        step += 1;
    }
    out.truncate(p.requests as usize);
    into_trace(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn trace() -> Trace {
        generate(&ScenarioParams { requests: 4096, rate: 64.0, seed: 5 })
    }

    #[test]
    fn steps_are_groups_of_shared_prompts_two_seconds_apart() {
        let t = trace();
        assert_eq!(t.requests.len(), 4096);
        let mut steps: HashMap<u32, Vec<&TraceRequest>> = HashMap::new();
        for r in &t.requests {
            steps.entry(r.group.unwrap()).or_default().push(r);
        }
        // 4,096 / 128 = 32 whole steps, 128 / 64 = 2 s apart, each within its first second.
        assert_eq!(steps.len(), 32);
        for (s, rs) in &steps {
            assert_eq!(rs.len(), 128);
            let first = rs.iter().map(|r| r.arrival_s).fold(f64::INFINITY, f64::min);
            let last = rs.iter().map(|r| r.arrival_s).fold(0.0, f64::max);
            assert!(last - first < 1.0, "step {s} spans {}", last - first);
            // 16 prompts, 8 samples each.
            let mut prompts: HashMap<&[u64], u32> = HashMap::new();
            for r in rs {
                *prompts.entry(&r.block_ids).or_default() += 1;
                assert!(r.block_ids[0] < TASKS as u64 && (2..=3).contains(&r.block_ids.len()));
                assert_eq!(r.max_tokens, Some(MAX_TOKENS));
            }
            assert_eq!(prompts.len(), 16);
            assert!(prompts.values().all(|&n| n == 8));
        }
        let start = |s: u32| steps[&s].iter().map(|r| r.arrival_s).fold(f64::INFINITY, f64::min);
        assert!((start(10) - start(9) - 2.0).abs() < 1.0);
    }

    #[test]
    fn output_lengths_are_heavy_tailed_per_task() {
        let t = generate(&ScenarioParams { requests: 40_000, rate: 64.0, seed: 9 });
        for (task, median) in TASK_MEDIANS.iter().enumerate() {
            let mut v: Vec<u32> =
                t.requests.iter().filter(|r| r.block_ids[0] == task as u64).map(|r| r.output_tokens).collect();
            v.sort_unstable();
            let q = |x: f64| f64::from(v[(x * v.len() as f64) as usize]);
            // Lognormal σ = 1: the median within 5 %, the 99th percentile e^2.326 ≈ 10× it.
            assert!((q(0.5) / median - 1.0).abs() < 0.05, "task {task}: median {}", q(0.5));
            let tail = q(0.99) / q(0.5);
            assert!((8.5..12.0).contains(&tail) || q(0.99) == f64::from(MAX_TOKENS), "task {task}: p99/p50 {tail}");
        }
        assert!(t.requests.iter().all(|r| (1..=MAX_TOKENS).contains(&r.output_tokens)));
    }

    #[test]
    fn seeded() {
        assert_eq!(trace(), trace());
        assert_ne!(trace(), generate(&ScenarioParams { requests: 4096, rate: 64.0, seed: 6 }));
    }
}
