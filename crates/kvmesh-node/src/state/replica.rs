//! One registered replica as the node follows it: how to reach it, its health, its event
//! stream's progress and what its engine last reported.

use super::stream::Stream;
use crate::config::ReplicaConfig;
use crate::endpoints::Endpoints;
use kvmesh_core::load::EngineMetrics;
use kvmesh_core::ReplicaId;
use kvmesh_core::ReplicaStatus;
use std::sync::Arc;

/// Prompts kept per replica whose history is partial ([`Replica::recent_prompts`]), at most.
pub const RECENT_PROMPTS: usize = 16;

/// Their tokens, at most, all together: the oldest leave first (each store that arrives
/// orphaned is matched against all of them, under the index's writer).
pub const RECENT_PROMPT_TOKENS: usize = 65_536;

/// A prompt kept for a replica's waiting stores, and its namespace.
pub type RecentPrompt = (Arc<[u32]>, crate::models::Selected);

/// One registered replica.
#[derive(Debug, Clone)]
pub struct Replica {
    /// Its id in the routing core.
    pub id: ReplicaId,
    /// How to reach it.
    pub config: ReplicaConfig,
    /// Its OpenAI API URLs, parsed from `config.http`.
    pub endpoints: Arc<Endpoints>,
    /// Node time, seconds, draining began (by the admin API, the registry or a scale-down);
    /// `None` while in rotation. Only a scrape begun after the drain settled can show the
    /// engine idle.
    pub draining_since: Option<f64>,
    /// Registered `starting` in the cluster's registry (not routed to, like draining, but not
    /// being released).
    pub starting: bool,
    /// This drain's turn to idle was logged.
    pub idle_logged: bool,
    /// Consecutive failed scrapes or connects.
    pub failures: u32,
    /// The last failure, for status.
    pub last_error: Option<String>,
    /// Out of rotation until this time (node seconds) after a 429/503.
    pub overloaded_until: f64,
    /// Last engine report.
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
    /// Requests this node's proxy has in flight on the replica (not gRPC `Route` callers'
    /// bookings, nor peers', nor warm-ups: only what this node waits on).
    pub proxied: u32,
    /// Its engine's served-token counter moves at every engine step (vLLM's does; SGLang's
    /// moves only as requests finish), so standing still with requests in flight means hung.
    pub counts_every_step: bool,
    /// Found hung (see [`Core::status`]): out of rotation until its served-token counter moves,
    /// or for another try once it has had nothing of this node's in flight for
    /// `hung_after_s` (the node time that spell began, if it has).
    pub hung: Option<Option<f64>>,
    /// The latest prompts this node routed here that ended well, with their namespaces,
    /// kept while its history is partial (at most [`RECENT_PROMPTS`] of [`RECENT_PROMPT_TOKENS`]): a store that arrives
    /// after its request ended, under a parent never seen, is matched against them
    /// ([`Core::keep_prompt`]).
    pub recent_prompts: std::collections::VecDeque<RecentPrompt>,
    /// The LoRA adapters its engine's `/v1/models` listed last (entries with a `parent`);
    /// `None` until it answered. `config.lora_adapters`, when given, is used instead.
    pub listed_adapters: Option<Vec<String>>,
    /// Node time of the last KV-event message.
    pub last_event_at: Option<f64>,
    /// Node time a request began that filled KV blocks the replica did not hold, with no KV
    /// event since (so one is owed); cleared by the next event.
    pub unpublished_since: Option<f64>,
    /// Node time it was registered.
    pub added_at: f64,
    /// Its event stream: sequence, resyncs, quarantine, counts (behind a lock of its own).
    pub stream: Stream,
    /// The status last logged: a change is logged once, when it is first seen.
    pub reported: ReplicaStatus,
}

impl Replica {
    /// Out of rotation: draining, or starting (see `starting`).
    pub fn draining(&self) -> bool {
        self.draining_since.is_some()
    }
}
