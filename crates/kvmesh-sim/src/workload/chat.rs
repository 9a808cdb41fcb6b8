//! A built-in, seeded workload in the Mooncake trace's shape, for runs without a trace file.
//!
//! Multi-turn chat sessions: each session starts with one of `system_prompts` shared system
//! prompts (popularity ∝ 1/rank, Zipf s = 1), then each turn appends the previous answer and
//! a new user message, so turn `k`'s prompt extends turn `k−1`'s. Block ids are prefix-chained
//! like Mooncake's `hash_ids` (512-token blocks): a full block keeps its id across turns, and
//! blocks past the shared part get fresh ids. Sessions arrive as a Poisson process; turns
//! follow after a think time. Same seed, same trace.

use crate::trace::{mooncake::BLOCK_TOKENS, Trace, TraceFormat, TraceRequest};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Parameters of the built-in workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Sessions to generate.
    pub sessions: u32,
    /// Session arrivals per second (Poisson).
    pub session_rate: f64,
    /// Shared system prompts to choose from.
    pub system_prompts: u32,
    /// System prompt length, blocks of 512 tokens.
    pub system_blocks: u32,
    /// Turns per session, inclusive range.
    pub turns: (u32, u32),
    /// User message length per turn, tokens, inclusive range.
    pub message_tokens: (u32, u32),
    /// Answer length, tokens, inclusive range.
    pub output_tokens: (u32, u32),
    /// Seconds between a turn's arrival and the next, inclusive range.
    pub think_s: (f64, f64),
    /// RNG seed.
    pub seed: u64,
}

impl Default for Workload {
    /// 300 sessions at 1 session/s, 8 system prompts of 2 blocks (1,024 tokens), 1–6 turns,
    /// messages of 200–3,000 tokens, answers of 50–600 tokens, 5–30 s between turns.
    fn default() -> Self {
        Workload {
            sessions: 300,
            session_rate: 1.0,
            system_prompts: 8,
            system_blocks: 2,
            turns: (1, 6),
            message_tokens: (200, 3000),
            output_tokens: (50, 600),
            think_s: (5.0, 30.0),
            seed: 1,
        }
    }
}

impl Workload {
    /// Generates the trace.
    pub fn generate(&self) -> Trace {
        let mut rng = SmallRng::seed_from_u64(self.seed);
        let mut next_id = self.system_prompts as u64 * self.system_blocks as u64;
        let weights: Vec<f64> = (1..=self.system_prompts.max(1)).map(|k| 1.0 / k as f64).collect();
        let total: f64 = weights.iter().sum();
        let mut requests = Vec::new();
        let mut t = 0.0;
        for _ in 0..self.sessions {
            t += -(1.0 - rng.random::<f64>()).ln() / self.session_rate;
            let mut pick = rng.random::<f64>() * total;
            let sp = weights.iter().position(|w| {
                pick -= w;
                pick <= 0.0
            });
            let sp = sp.unwrap_or(0) as u64;
            let mut ids: Vec<u64> =
                (0..self.system_blocks as u64).map(|b| sp * self.system_blocks as u64 + b).collect();
            let mut len = self.system_blocks * BLOCK_TOKENS;
            let mut at = t;
            let turns = rng.random_range(self.turns.0..=self.turns.1);
            for turn in 0..turns {
                if turn > 0 {
                    at += rng.random_range(self.think_s.0..=self.think_s.1);
                }
                len += rng.random_range(self.message_tokens.0..=self.message_tokens.1);
                // Full blocks of the previous prompt keep their ids; the rest are new.
                let keep = (ids.len()).min(full_blocks(len));
                ids.truncate(keep);
                while ids.len() < len.div_ceil(BLOCK_TOKENS) as usize {
                    ids.push(next_id);
                    next_id += 1;
                }
                let output = rng.random_range(self.output_tokens.0..=self.output_tokens.1);
                requests.push(TraceRequest {
                    arrival_s: at,
                    input_tokens: len,
                    output_tokens: output,
                    block_ids: ids.clone(),
                });
                // The previous prompt's trailing partial block is recomputed next turn.
                ids.truncate(full_blocks(len));
                len += output;
            }
        }
        requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
        let first = requests.first().map_or(0.0, |r| r.arrival_s);
        for r in &mut requests {
            r.arrival_s -= first;
        }
        Trace { format: TraceFormat::Mooncake, block_tokens: Some(BLOCK_TOKENS), requests, skipped: Vec::new() }
    }
}

fn full_blocks(tokens: u32) -> usize {
    (tokens / BLOCK_TOKENS) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_trace_and_turns_extend_their_prefix() {
        let w = Workload { sessions: 20, ..Workload::default() };
        let a = w.generate();
        assert_eq!(a, w.generate());
        assert_ne!(a, Workload { seed: 2, ..w.clone() }.generate());
        for r in &a.requests {
            assert_eq!(r.block_ids.len(), r.input_tokens.div_ceil(512) as usize);
            assert!(r.block_ids[0] < 16, "starts with a system prompt block");
        }
        // Some later request carries an earlier request's full blocks as its leading blocks.
        let extends = a.requests.iter().enumerate().any(|(i, r)| {
            a.requests[..i]
                .iter()
                .any(|p| p.block_ids.len() > 3 && r.block_ids.starts_with(&p.block_ids[..p.block_ids.len() - 1]))
        });
        assert!(extends);
    }
}
