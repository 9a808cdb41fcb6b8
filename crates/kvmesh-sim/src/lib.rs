//! kvmesh-sim: the discrete-event fleet simulator that drives kvmesh-core's real routing
//! policies on simulated vLLM-like engines, with the traces and workloads it replays.
//!
//! - [`engine`]: one simulated replica (continuous batching, chunked prefill, prefix-cached
//!   paged KV, preemption, vLLM-format KV events) and its [`engine::EngineProfile`].
//! - [`simulation`]: the event loop routing every request through [`kvmesh_core::Fleet`],
//!   and the [`simulation::RunMetrics`] and floors a run is judged by.
//! - [`trace`]: Mooncake JSONL, Azure LLM CSV and kvmesh JSONL traces → [`trace::Trace`].
//! - [`tokens`]: token ids synthesised from a trace's prefix-block ids.
//! - [`workload`]: the built-in chat workload, scenarios, arrival spreading and rate scaling.
//! - [`analyze`]: the statistics `kvmesh analyze` prints.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod analyze;
pub mod engine;
pub mod simulation;
pub mod tokens;
pub mod trace;
pub mod workload;
