//! One registered replica as the node follows it: how to reach it, its place in rotation,
//! what this node's proxy has in flight on it, and handles to its event stream's record
//! ([`Stream`]) and its health record ([`Health`]: what its engine last reported, failures,
//! backpressure), each behind a lock of its own.

use super::health::Health;
use super::stream::Stream;
use crate::config::ReplicaConfig;
use crate::endpoints::Endpoints;
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
    /// Requests this node's proxy has in flight on the replica (not gRPC `Route` callers'
    /// bookings, nor peers', nor warm-ups: only what this node waits on).
    pub proxied: u32,
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
    /// Its health: engine report, failures, backpressure, hang watch (behind a lock of its own).
    pub health: Health,
    /// The status last logged: a change is logged once, when it is first seen.
    pub reported: ReplicaStatus,
}

impl Replica {
    /// Replica `id` registered at `now` (node seconds) from `config`, reached at `endpoints`;
    /// out of rotation from the start when the registry says so (`draining`, and `starting`
    /// with it). Its status is set by the caller, who can compute it ([`super::Core::status`]).
    pub fn new(
        id: ReplicaId,
        config: ReplicaConfig,
        endpoints: Arc<Endpoints>,
        now: f64,
        rotation: (bool, bool),
    ) -> Self {
        let (draining, starting) = rotation;
        Replica {
            id,
            config,
            endpoints,
            draining_since: draining.then_some(now),
            starting: starting && draining,
            idle_logged: false,
            proxied: 0,
            recent_prompts: Default::default(),
            listed_adapters: None,
            last_event_at: None,
            unpublished_since: None,
            added_at: now,
            stream: Default::default(),
            health: Default::default(),
            reported: ReplicaStatus::Ready,
        }
    }

    /// Out of rotation: draining, or starting (see `starting`).
    pub fn draining(&self) -> bool {
        self.draining_since.is_some()
    }
}
