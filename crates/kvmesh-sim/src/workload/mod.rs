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
pub mod rollouts;
pub mod scenarios;

pub use chat::Workload;
