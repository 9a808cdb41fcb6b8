//! Workloads: the built-in generators and the arrival-time preparation every trace goes
//! through before a replay.
//!
//! - [`chat`]: seeded multi-turn chat sessions in the Mooncake trace's shape (`kvmesh analyze`
//!   without a trace uses its default size; `kvmesh replay` without a trace runs it as the `chat`
//!   scenario, 2,000 requests at 10 req/s).
//! - [`scenarios`]: the shapes that decide strategy choice — shared system prompts at a given
//!   sharing ratio, a hot prompt, Zipf prefix popularity, agent bursts.
//! - [`rollouts`]: asynchronous RL rollouts (the `rl` scenario): groups of samples per
//!   prompt, heavy-tailed output lengths, steps a trainer waits for.
//! - [`agents`]: multi-turn tool loops (the `agents` scenario): short tool calls, a long final
//!   answer, tool results appended turn after turn, sessions a user waits for.
//! - [`arrivals`]: rate scaling and spreading of bucketed timestamps.

pub mod agents;
pub mod arrivals;
pub mod chat;
pub mod params;
pub mod rollouts;
pub mod scenarios;

pub use chat::Workload;

use crate::trace::{mooncake::BLOCK_TOKENS, Trace, TraceFormat, TraceRequest};
use rand::rngs::SmallRng;
use rand::Rng;

/// One standard normal draw (Box–Muller, two uniforms of `rng`).
pub fn normal(rng: &mut SmallRng) -> f64 {
    let u1 = 1.0 - rng.random::<f64>(); // (0, 1]: ln stays finite
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// One lognormal draw: median `median`, `sigma` the σ of its natural log.
pub fn lognormal(rng: &mut SmallRng, median: f64, sigma: f64) -> f64 {
    median * (sigma * normal(rng)).exp()
}

/// A generated workload as a trace in Mooncake's 512-token blocks: `requests` sorted by
/// arrival, the first arriving at 0 s.
fn into_trace(mut requests: Vec<TraceRequest>) -> Trace {
    requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    let first = requests.first().map_or(0.0, |r| r.arrival_s);
    for r in &mut requests {
        r.arrival_s -= first;
    }
    Trace { format: TraceFormat::Mooncake, block_tokens: Some(BLOCK_TOKENS), requests, skipped: Vec::new() }
}
