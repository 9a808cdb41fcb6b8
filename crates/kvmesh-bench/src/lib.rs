//! Side-by-side benchmarks of kvmesh's prefix index against Dynamo's KV-router indexes, in one
//! process, on one workload built from a public trace.
//!
//! ```text
//! Mooncake trace ──workload──► ops: KV events of N simulated engines + queries with truth
//!                                  │
//!        ┌─────────────────────────┼──────────────────────────────┐
//!   kvmesh PrefixIndex     Dynamo RadixTree     Dynamo concurrent tree (ThreadPoolIndexer)
//!        └── apply pass · query pass (each query once, checked) · concurrent pass ──┘
//! ```
//!
//! Run it with `cargo run --release -p kvmesh-bench --bin vs-dynamo` (see `--help`); the
//! figures and how to read them are in BENCHMARKS.md, "Prefix index against Dynamo's".

// Only the counting allocator needs `unsafe` (a `GlobalAlloc` cannot be written without it).
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod alloc;
pub mod contender;
pub mod decision;
pub mod engine;
pub mod floor;
pub mod report;
pub mod run;
pub mod workload;
