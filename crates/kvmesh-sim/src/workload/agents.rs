//! `agents`: multi-turn tool loops, as an agent harness drives an LLM.
//!
//! A session starts with one of [`AGENTS`] agent prompts ([`AGENT_BLOCKS`] blocks of 512
//! tokens: instructions and tool definitions, shared by every session of that agent) and a user
//! task of 300–1,500 tokens. Each turn but the last is a **tool call**: a short output
//! (lognormal, median [`CALL_MEDIAN`] tokens, σ [`CALL_SIGMA`]); the harness runs the tool and
//! sends the next turn: the previous prompt, that output, and the tool's result (lognormal,
//! median [`RESULT_MEDIAN`] tokens, σ 1.0) — so turn k+1's prompt extends turn k's, and its
//! full blocks keep their ids. The last turn is the **answer**: long (median
//! [`ANSWER_MEDIAN`], σ [`ANSWER_SIGMA`]). Turns per session: 3–12. Every request sends
//! `max_tokens` = [`MAX_TOKENS`], as agent frameworks do, far above the tool calls' lengths.
//!
//! The workload is open-loop, as the other scenarios: turn k+1 arrives a service-time estimate
//! after turn k (0.2 s plus 8 ms per output token: decode on a lightly loaded H100) plus the
//! tool's run time (lognormal, median [`TOOL_MEDIAN_S`] s, σ 1.0), whatever the fleet does. Each
//! request's `group` is its session, so a replay reports session completion times (first
//! arrival to last finish: what the user waits for) in its steps columns.

use super::params::ScenarioParams;
use super::{into_trace, lognormal};
use crate::trace::{mooncake::BLOCK_TOKENS, Trace, TraceRequest};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Agent prompts sessions start with.
pub const AGENTS: u64 = 4;
/// Blocks of 512 tokens of each agent prompt.
pub const AGENT_BLOCKS: u64 = 4;
/// Median tool-call output, tokens.
pub const CALL_MEDIAN: f64 = 80.0;
/// Lognormal σ of tool-call outputs.
pub const CALL_SIGMA: f64 = 0.6;
/// Median final answer, tokens.
pub const ANSWER_MEDIAN: f64 = 600.0;
/// Lognormal σ of final answers.
pub const ANSWER_SIGMA: f64 = 0.8;
/// Median tool result appended to the next turn's prompt, tokens.
pub const RESULT_MEDIAN: f64 = 400.0;
/// Median tool run time, seconds.
pub const TOOL_MEDIAN_S: f64 = 1.5;
/// The `max_tokens` every request sends.
pub const MAX_TOKENS: u32 = 4096;
/// Turns per session, inclusive.
pub const TURNS: (u32, u32) = (3, 12);

/// Generates `p.requests` agent turns at a mean of `p.rate` per second (see the module docs).
pub fn generate(p: &ScenarioParams) -> Trace {
    let mut rng = SmallRng::seed_from_u64(p.seed);
    let mean_turns = f64::from(TURNS.0 + TURNS.1) / 2.0;
    let session_rate = p.rate / mean_turns;
    let mut next_id = AGENTS * AGENT_BLOCKS;
    let mut out = Vec::new();
    let (mut t, mut session) = (0.0, 0u32);
    // Twice the sessions needed, then the first `requests` arrivals: an exact count.
    while (out.len() as f64) < 2.0 * f64::from(p.requests) {
        t += -(1.0 - rng.random::<f64>()).ln() / session_rate;
        let agent = rng.random_range(0..AGENTS);
        let mut ids: Vec<u64> = (0..AGENT_BLOCKS).map(|b| agent * AGENT_BLOCKS + b).collect();
        let mut len = (AGENT_BLOCKS as u32) * BLOCK_TOKENS + rng.random_range(300..=1500);
        let turns = rng.random_range(TURNS.0..=TURNS.1);
        let mut at = t;
        for turn in 0..turns {
            // Full blocks of the previous prompt keep their ids; the rest are new.
            ids.truncate(ids.len().min((len / BLOCK_TOKENS) as usize));
            while ids.len() < len.div_ceil(BLOCK_TOKENS) as usize {
                ids.push(next_id);
                next_id += 1;
            }
            let last = turn + 1 == turns;
            let (median, sigma) = if last { (ANSWER_MEDIAN, ANSWER_SIGMA) } else { (CALL_MEDIAN, CALL_SIGMA) };
            let output = (lognormal(&mut rng, median, sigma).round() as u32).clamp(1, MAX_TOKENS);
            out.push(TraceRequest {
                arrival_s: at,
                input_tokens: len,
                output_tokens: output,
                block_ids: ids.clone(),
                max_tokens: Some(MAX_TOKENS),
                group: Some(session),
            });
            let result = (lognormal(&mut rng, RESULT_MEDIAN, 1.0).round() as u32).clamp(16, 16_000);
            len += output + result;
            at += 0.2 + 0.008 * f64::from(output) + lognormal(&mut rng, TOOL_MEDIAN_S, 1.0);
        }
        session += 1;
    }
    // The first `requests` arrivals, whichever sessions they belong to.
    out.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    out.truncate(p.requests as usize);
    into_trace(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn sessions_are_tool_loops_whose_turns_extend_each_other() {
        let t = generate(&ScenarioParams { requests: 6_000, rate: 20.0, seed: 4 });
        assert_eq!(t.requests.len(), 6_000);
        assert_eq!(t, generate(&ScenarioParams { requests: 6_000, rate: 20.0, seed: 4 }), "seeded");
        let mut sessions: BTreeMap<u32, Vec<&TraceRequest>> = BTreeMap::new();
        for r in &t.requests {
            assert_eq!(r.block_ids.len(), r.input_tokens.div_ceil(BLOCK_TOKENS) as usize);
            assert!(r.block_ids[0] < AGENTS * AGENT_BLOCKS, "starts with an agent prompt");
            assert_eq!(r.max_tokens, Some(MAX_TOKENS));
            sessions.entry(r.group.unwrap()).or_default().push(r);
        }
        // Within a session, each turn's prompt starts with the previous one's full blocks.
        let mut calls = Vec::new();
        for turns in sessions.values() {
            for w in turns.windows(2) {
                let kept = (w[0].input_tokens / BLOCK_TOKENS) as usize;
                assert_eq!(w[1].block_ids[..kept], w[0].block_ids[..kept]);
                assert!(w[1].input_tokens > w[0].input_tokens && w[1].arrival_s > w[0].arrival_s);
                calls.push(w[0].output_tokens);
            }
        }
        // Tool calls are short (median 80), the requests' mean rate is the one asked for.
        calls.sort_unstable();
        let median = calls[calls.len() / 2];
        assert!((70..=90).contains(&median), "{median}");
        let span = t.requests.last().unwrap().arrival_s;
        assert!((6_000.0 / span - 20.0).abs() < 2.0, "{} req/s", 6_000.0 / span);
    }
}
