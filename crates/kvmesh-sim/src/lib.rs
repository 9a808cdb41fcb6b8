//! kvmesh-sim: trace loaders, a built-in workload and trace analysis — the ground the fleet
//! simulator (which drives kvmesh-core's real policies on simulated engines) stands on.
//!
//! - [`trace`]: Mooncake JSONL and Azure LLM CSV traces → [`trace::Trace`].
//! - [`workload`]: a seeded, Mooncake-shaped multi-turn workload for runs without a file.
//! - [`analyze`]: the statistics `kvmesh analyze` prints.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod analyze;
pub mod engine;
pub mod simulation;
pub mod tokens;
pub mod trace;
pub mod workload;
