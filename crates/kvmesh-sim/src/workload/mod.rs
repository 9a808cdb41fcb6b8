//! Workloads: the built-in generators and the arrival-time preparation every trace goes
//! through before a replay.
//!
//! - [`chat`]: seeded multi-turn chat sessions in the Mooncake trace's shape (the default
//!   workload of `kvmesh analyze` and `kvmesh replay` without a trace).
//! - [`scenarios`]: the shapes that decide strategy choice — shared system prompts at a given
//!   sharing ratio, a hot prompt, Zipf prefix popularity, agent bursts.
//! - [`arrivals`]: rate scaling and spreading of bucketed timestamps.

pub mod arrivals;
pub mod chat;
pub mod scenarios;

pub use chat::Workload;
