//! One replica's health as the node sees it: its engine's last report, failed scrapes and
//! connects, backpressure answers, and the watch for a hung engine.
//!
//! The replica's scrape task (started by its actor) writes it, as do the proxy, the gRPC
//! handlers and the endpoint picker when the engine refuses a connection or answers 429/503
//! (through [`crate::state::Core`]'s `record_*` methods). The replica's status is derived from
//! it ([`crate::state::Core::status`]). It sits behind a lock of its own, like the event
//! stream's record ([`super::Stream`]), not in the core's state: a routing decision reads none
//! of it (it reads the routable flag and the load the core was given). Lock order: a health
//! lock may be taken while the core's is held; the core's is never taken while a health lock
//! is held, nor is a stream lock.

use kvmesh_core::load::EngineMetrics;
use std::sync::{Arc, Mutex, MutexGuard};

/// What the node knows of one replica's health.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthState {
    /// Consecutive failed scrapes or connects.
    pub failures: u32,
    /// The last failure, for status.
    pub last_error: Option<String>,
    /// Out of rotation until this time (node seconds) after a 429/503.
    pub overloaded_until: f64,
    /// The engine's last report.
    pub engine: Option<EngineMetrics>,
    /// Node time, seconds, the scrape that brought that report began.
    pub engine_at: Option<f64>,
    /// The engine's served-token counter (prompt computed plus generated, tokens) at the last
    /// scrape, and the node time, seconds, of the scrape that first saw that value: a counter
    /// that stands still while the engine reports requests running means stale gauges.
    pub engine_served: Option<(f64, f64)>,
    /// Node time, seconds, of the first scrape of an unbroken run that found this node's
    /// proxy with requests in flight on the replica; `None` when the last scrape found none.
    pub busy_since: Option<f64>,
    /// Its engine's served-token counter moves at every engine step (vLLM's does; SGLang's
    /// moves only as requests finish), so standing still with requests in flight means hung.
    pub counts_every_step: bool,
    /// Found hung (see [`crate::state::Core::status`]): out of rotation until its
    /// served-token counter moves, or for another try once it has had nothing of this node's
    /// in flight for `hung_after` (the node time that spell began, if it has).
    pub hung: Option<Option<f64>>,
    /// Tokens per block its engine reports on its metrics page (vLLM's
    /// `vllm:cache_config_info{block_size}`), when it does: a size other than the node's is a
    /// mismatch before any KV event says so.
    pub engine_block_size: Option<u32>,
    /// KV blocks its engine reports on its metrics page (vLLM's
    /// `vllm:cache_config_info{num_gpu_blocks}`) at the last good scrape; `None` when the page
    /// does not say (SGLang's never does).
    pub engine_kv_blocks: Option<u64>,
}

impl Default for HealthState {
    /// Never scraped, never failed; a vLLM-like counter until a page says otherwise.
    fn default() -> Self {
        HealthState {
            failures: 0,
            last_error: None,
            overloaded_until: 0.0,
            engine: None,
            engine_at: None,
            engine_served: None,
            busy_since: None,
            counts_every_step: true,
            engine_kv_blocks: None,
            hung: None,
            engine_block_size: None,
        }
    }
}

/// A replica's [`HealthState`], shared by the parts that watch it (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Health(Arc<Mutex<HealthState>>);

impl Health {
    /// The state, locked. A panic while it was held leaves it as it was then: every update
    /// is a few fields of one observation, each valid alone.
    pub fn lock(&self) -> MutexGuard<'_, HealthState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
