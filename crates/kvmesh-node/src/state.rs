//! The node's shared state: the routing core ([`Fleet`] + policy) and the replica registry
//! with each replica's live status, behind one short-held lock.
//!
//! Every lock section is a few microseconds (one decision, one event batch, one report), so
//! one mutex serves thousands of decisions per second without a queue; nothing holds it
//! across I/O.

mod drain;
mod guard;

use crate::config::{NodeConfig, ReplicaConfig};
use crate::metrics::Metrics;
use crate::replica::endpoints::Endpoints;
pub use drain::{DrainProgress, DRAIN_SETTLE_S, ENGINE_STALL_S};
pub use guard::{CoreGuard, StatusChange};
use kvmesh_core::fleet::ReplicaStatus as CoreStatus;
use kvmesh_core::index::{ApplyOutcome, KvEvent};
use kvmesh_core::load::{BookingId, EngineMetrics};
use kvmesh_core::{
    Decision, Fleet, FleetConfig, Namespace, Policy, PolicyKind, ReplicaId, ReplicaSpec, RouteRequest, Routed,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Leading block hashes a shared booking carries (the prefix other nodes credit as pending):
/// 512 blocks of 16 tokens cover 8k-token prompts; longer ones share their first 8k.
const GOSSIP_PREFIX_BLOCKS: usize = 512;
/// Deltas waiting for the gossip sender before the oldest are dropped (summaries repair).
const GOSSIP_MAX_PENDING: usize = 100_000;
/// How long an ended peer booking is remembered, seconds.
const TOMBSTONE_S: f64 = 30.0;
/// A peer that routed within this many seconds may be deciding alongside this node (herding):
/// long enough that a burst after a quiet spell still finds its peers counted.
const ACTIVE_PEER_WINDOW_S: f64 = 10.0;
use std::time::Instant;

/// What a replica is doing, as operators see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Routable, events (if configured) current.
    Ready,
    /// Not routed to by operator request or a scale-down; in-flight requests finish.
    Draining,
    /// Registered `starting` in the cluster's registry (its engine still loading): not routed
    /// to until marked ready.
    Starting,
    /// Events were missed; being resynced (routed on load meanwhile).
    OutOfSync,
    /// Configured for events, none arrive while it serves (routed on load and the record).
    NoEvents,
    /// Its events carry another block size (routed on load only).
    BlockSizeMismatch,
    /// Its KV-event stream kept bringing bad messages: quarantined, its blocks dropped and
    /// its stream not followed for `limits.kv_event_quarantine_s` (routed on load only).
    BadEvents,
    /// Failing health checks or connects; not routed to.
    Unhealthy,
    /// Answered 429/503; out of rotation until the backoff ends.
    Overloaded,
}

impl Status {
    /// Stable lower-case name (metrics label, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ready => "ready",
            Status::Draining => "draining",
            Status::Starting => "starting",
            Status::OutOfSync => "out_of_sync",
            Status::NoEvents => "no_events",
            Status::BlockSizeMismatch => "block_size_mismatch",
            Status::BadEvents => "bad_events",
            Status::Unhealthy => "unhealthy",
            Status::Overloaded => "overloaded",
        }
    }

    /// Every status, for metrics.
    pub const ALL: [Status; 9] = [
        Status::Ready,
        Status::Draining,
        Status::Starting,
        Status::OutOfSync,
        Status::NoEvents,
        Status::BlockSizeMismatch,
        Status::BadEvents,
        Status::Unhealthy,
        Status::Overloaded,
    ];
}

/// Prompts kept per replica whose history is partial ([`Replica::recent_prompts`]), at most.
pub const RECENT_PROMPTS: usize = 16;

/// Their tokens, at most, all together: the oldest leave first (each store that arrives
/// orphaned is matched against all of them, under the core lock).
pub const RECENT_PROMPT_TOKENS: usize = 65_536;

/// Places `id`'s waiting stores that continue `tokens`, a prompt of namespace `selected`
/// ([`kvmesh_core::Fleet::adopt_prompt`]).
fn adopt(
    fleet: &mut kvmesh_core::Fleet,
    id: ReplicaId,
    tokens: &[u32],
    selected: &crate::models::Selected,
) -> Option<ApplyOutcome> {
    fleet.adopt_prompt(id, tokens, selected.adapter.as_deref(), selected.salt.as_deref()).ok()
}

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
    /// ([`Core::adopt_prompt`]).
    pub recent_prompts: std::collections::VecDeque<(Arc<[u32]>, crate::models::Selected)>,
    /// The LoRA adapters its engine's `/v1/models` listed last (entries with a `parent`);
    /// `None` until it answered. `config.lora_adapters`, when given, is used instead.
    pub listed_adapters: Option<Vec<String>>,
    /// Last KV-event sequence number applied.
    pub last_seq: Option<u64>,
    /// Node time of the last KV-event message.
    pub last_event_at: Option<f64>,
    /// Node time a request began that filled KV blocks the replica did not hold, with no KV
    /// event since (so one is owed); cleared by the next event.
    pub unpublished_since: Option<f64>,
    /// Node time it was registered.
    pub added_at: f64,
    /// A gap or restart was found and the replica is being resynced.
    pub resyncing: bool,
    /// Its blocks must be rebuilt, and why (the ingest task takes this): `recovery` — it came
    /// back after being unhealthy, perhaps a new engine whose first messages went out before
    /// this node's subscriber reconnected; `unknown_parent` — a stored event chained to a
    /// block this node never saw (case C03); `restart` — its generated-token counter went back
    /// (the engine restarted, whether or not it publishes again).
    pub resync_requested: Option<&'static str>,
    /// Node time of the last such rebuild (rebuilds from unknown parents are spaced out, so a
    /// replay buffer that starts mid-chain cannot loop).
    pub last_resync_at: Option<f64>,
    /// Node time the ingest task last saw its engine restart (the sequence went back), so a
    /// scrape that then sees the counters fall does not drop the new engine's blocks again.
    pub restart_seen_at: Option<f64>,
    /// Event counts.
    pub events_applied: u64,
    /// Events rejected by the decoder or the index.
    pub events_rejected: u64,
    /// End of its KV-event quarantine, node seconds (status `bad_events` until then).
    pub bad_events_until: Option<f64>,
    /// The status last logged: a change is logged once, when it is first seen.
    pub reported: Status,
}

impl Replica {
    /// Out of rotation: draining, or starting (see `starting`).
    pub fn draining(&self) -> bool {
        self.draining_since.is_some()
    }
}

/// The routing core and registry.
pub struct Core {
    /// Index, bookings, replicas' core state.
    pub fleet: Fleet,
    /// The configured policy.
    pub policy: Box<dyn Policy>,
    /// Its randomness.
    pub rng: SmallRng,
    /// Replicas by name.
    pub replicas: BTreeMap<String, Replica>,
    unhealthy_after: u32,
    /// Seconds a drain takes to settle across the tier ([`drain::settle_s`]).
    drain_settle_s: f64,
    /// Rotation flags (draining, starting) for replicas about to be added.
    rotation_ahead: BTreeMap<String, (bool, bool)>,
    events_silent_s: f64,
    hung_after_s: f64,
    /// When every replica's routable flag was last re-evaluated (node seconds).
    synced_at: f64,
    /// This node's booking deltas for its peers (`None`: single node or gossip off).
    pub outbox: Option<kvmesh_core::gossip::Outbox>,
    /// The peers' live bookings, merged into `fleet`.
    pub remote: kvmesh_core::gossip::RemoteBookings,
    /// This node's id in its cluster (0 alone).
    pub node_id: kvmesh_core::gossip::NodeId,
    /// This node's hot-prefix counts (replication on).
    pub sketch: Option<kvmesh_core::replication::PrefixSketch>,
    /// Token load of the requests that arrived since start, at this node and (through gossip)
    /// its peers, each counted once whether it was routed or held: uncached prompt plus
    /// expected output tokens. The autoscaler's demand is its rate.
    pub booked_tokens: f64,
    /// The part of `booked_tokens` counted on this node itself, tokens (gossiped to peers).
    pub own_demand_tokens: f64,
    /// Per peer: its incarnation and the last own demand it reported, tokens.
    peer_demand: BTreeMap<u64, (u64, f64)>,
    /// Status changes found in this lock section, logged by [`CoreGuard`] after it.
    status_changes: Vec<StatusChange>,
}

impl Settings {
    /// The hasher of requests selecting `selected`: its model's namespace (the routing
    /// core's hasher for `node.model`, as [`kvmesh_core::Fleet::hasher_for`] makes it for
    /// another), then its LoRA adapter's seed, as the index hashes stores with that
    /// `lora_name`, then its `cache_salt`, as the index salts a sequence's first block.
    pub fn hasher_for(&self, selected: &crate::models::Selected) -> kvmesh_core::BlockHasher {
        let base = match &selected.model {
            Some(m) if *m != self.model => {
                let ns = Namespace { model: m.clone(), ..Namespace::default() };
                let bs = selected.block_size.unwrap_or(self.block_size);
                kvmesh_core::BlockHasher::new(bs, &ns).unwrap_or(self.hasher)
            }
            _ => self.hasher,
        };
        let adapted = selected.adapter.as_deref().map_or(base, |a| base.for_adapter(a));
        adapted.for_salt(selected.salt.as_deref().unwrap_or_default())
    }
}

/// A replica's name and URLs.
pub type NamedReplica = (String, Arc<Endpoints>);

/// The node settings the request path reads, fixed at start (no lock).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Served model name; empty accepts any.
    pub model: String,
    /// Other replicas tried after a connect failure or backpressure.
    pub retries: u32,
    /// How long a 429/503 keeps a replica out, seconds.
    pub overload_backoff_s: f64,
    /// Tokens per block.
    pub block_size: u32,
    /// The routing core's block hasher (a copy), so requests are hashed outside the core lock.
    pub hasher: kvmesh_core::BlockHasher,
    /// The engines' step-time profile (`node.engine_profile` at `node.engine_speed`).
    pub profile: kvmesh_core::load::ReplicaProfile,
    /// Longest prompt routed, tokens.
    pub max_prompt_tokens: u32,
}

/// Shared by every task of the node.
pub struct Shared {
    /// The configuration the node started with, replicas as currently registered.
    pub config: Mutex<NodeConfig>,
    /// Settings the request path reads.
    pub settings: Settings,
    /// The key of `Router.Route`'s booking handles.
    pub booking_keys: crate::booking_token::BookingKeys,
    /// `[limits]`, fixed at start.
    pub limits: crate::config::LimitsSection,
    /// Prompt text → token ids.
    pub tokenizer: crate::tokenize::Tokenizer,
    /// The models served, by the replicas registered ([`Shared::add_replica`]).
    pub models: crate::models::ServedModels,
    /// The routing policy's name and parameters (they change when the cluster's do).
    policy_name: Mutex<(Arc<str>, std::collections::BTreeMap<String, f64>)>,
    started: Instant,
    core: parking_lot::Mutex<Core>,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// The bytes of request bodies all clients may have in flight: the proxy's and the
    /// endpoint picker's (`limits.http_body_budget_bytes`).
    pub body_budget: Arc<crate::body_budget::BodyBudget>,
    /// Requests this node follows to their end now (proxied, or picked for a gateway):
    /// [`crate::in_flight::InFlight`]s not yet released. Shutdown waits for them.
    pub in_flight: std::sync::atomic::AtomicUsize,
    /// Set when the node begins to shut down: it reports not ready from then on.
    pub stopping: std::sync::atomic::AtomicBool,
    /// The proxy's client to the engines; used on the proxy's runtime only, so its
    /// connections (and their tasks) live on the proxy's threads.
    pub http: reqwest::Client,
    /// The client for engine metrics scrapes, health checks and warm-ups, on the node's main
    /// runtime (sharing the proxy's pool would hand the proxy connections driven elsewhere).
    pub probe_http: reqwest::Client,
    /// This node's cluster membership, once started (metrics read it).
    pub cluster: std::sync::OnceLock<Arc<crate::cluster::Cluster>>,
    /// Bearer tokens (`[security]`).
    pub tokens: crate::auth::Tokens,
    /// The latest routing decisions, newest last (`kvmesh status`).
    decisions: Mutex<std::collections::VecDeque<DecisionRecord>>,
    /// Hot-prefix replication.
    pub replication: crate::replication::Replication,
    /// The autoscaler's decisions.
    pub autoscaler: crate::autoscaler::Autoscaling,
    /// Admission control.
    pub admission: crate::admission::Admission,
}

/// One routing decision as operators see it.
#[derive(Debug, Clone, PartialEq)]
pub struct DecisionRecord {
    /// Node seconds.
    pub at: f64,
    /// `http` or `grpc`.
    pub via: &'static str,
    /// The chosen replica.
    pub replica: String,
    /// The policy's reason.
    pub reason: &'static str,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Leading blocks the replica held.
    pub overlap_blocks: u32,
    /// Tokens it must compute.
    pub uncached_tokens: u32,
    /// The estimated TTFT there, seconds.
    pub estimated_ttft_s: f64,
}

/// Decisions kept for `kvmesh status`.
const DECISIONS_KEPT: usize = 64;

/// Why a replica could not be added.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The name is taken.
    #[error("replica {0:?} already exists")]
    Exists(String),
    /// No such replica.
    #[error("unknown replica {0:?}")]
    Unknown(String),
    /// Bad fields.
    #[error("{0}")]
    Invalid(String),
}

impl Shared {
    /// A node's shared state for `config` (replicas are added by the supervisor).
    ///
    /// # Errors
    /// An invalid policy or block size.
    pub fn new(config: NodeConfig) -> anyhow::Result<Self> {
        let kind: PolicyKind = config.node.policy.parse().map_err(|e| anyhow::anyhow!("node.policy: {e}"))?;
        let fleet_config = FleetConfig {
            block_size: config.node.block_size,
            namespace: Namespace { model: config.node.model.clone(), ..Namespace::default() },
            lease_s: config.node.booking_lease_s,
            learn_output_lengths: config.node.learn_output_lengths,
            // A per-process secret: engine ids from the network cannot be chosen to collide.
            index_seed: {
                use std::hash::{BuildHasher, Hasher};
                std::collections::hash_map::RandomState::new().build_hasher().finish()
            },
            ..FleetConfig::default()
        };
        let fleet = Fleet::new(fleet_config).map_err(|e| anyhow::anyhow!("{e}"))?;
        let core = Core {
            fleet,
            policy: kind.build_with(&config.node.params()).map_err(|e| anyhow::anyhow!("node.policy_params: {e}"))?,
            // Nodes of one cluster break ties differently: identical seeds would make every
            // node send a burst's first requests to the same replica (case C12).
            rng: SmallRng::seed_from_u64(0x6b76_6d65_7368 ^ config.cluster.as_ref().map_or(0, |c| c.id)),
            replicas: BTreeMap::new(),
            unhealthy_after: config.node.unhealthy_after.max(1),
            drain_settle_s: drain::settle_s(config.cluster.as_ref()),
            rotation_ahead: BTreeMap::new(),
            events_silent_s: config.node.events_silent_s,
            hung_after_s: config.node.hung_after_s,
            synced_at: f64::NEG_INFINITY,
            outbox: config
                .cluster
                .as_ref()
                .filter(|c| c.gossip)
                .map(|_| kvmesh_core::gossip::Outbox::new(GOSSIP_PREFIX_BLOCKS, GOSSIP_MAX_PENDING)),
            // A peer's stream is ordered and summaries reject older deltas: tombstones only need
            // to outlive a reconnect's reordering.
            remote: kvmesh_core::gossip::RemoteBookings::new(TOMBSTONE_S),
            node_id: kvmesh_core::gossip::NodeId(config.cluster.as_ref().map_or(0, |c| c.id)),
            booked_tokens: 0.0,
            own_demand_tokens: 0.0,
            peer_demand: BTreeMap::new(),
            status_changes: Vec::new(),
            sketch: config.replication.enabled.then(|| {
                kvmesh_core::replication::PrefixSketch::new(config.replication.core().sketch, config.node.block_size)
            }),
        };
        let client = || {
            reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(config.node.request_timeout_s.max(1)))
                .connect_timeout(std::time::Duration::from_secs(2))
                .build()
        };
        let (http, probe_http) = (client()?, client()?);
        let settings = Settings {
            model: config.node.model.clone(),
            retries: config.node.retries,
            overload_backoff_s: config.node.overload_backoff_ms as f64 / 1000.0,
            block_size: config.node.block_size,
            hasher: *core.fleet.hasher(),
            profile: config.node.replica_profile().map_err(anyhow::Error::msg)?,
            max_prompt_tokens: config.node.max_prompt_tokens,
        };
        let tokenizer = crate::tokenize::Tokenizer::load(config.node.tokenizer.as_deref())?;
        // The canonical name (`kv-cost` is `kv_cost`): it labels metrics and status.
        let canonical = config.node.policy.parse::<PolicyKind>().map_or(config.node.policy.as_str(), |k| k.as_str());
        let policy_name = Mutex::new((Arc::from(canonical), config.node.policy_params.clone()));
        let config_security = config.security.clone();
        let replication = crate::replication::Replication::new(config.replication.clone());
        let autoscaler = crate::autoscaler::Autoscaling::new(config.autoscaler.clone());
        let admission = crate::admission::Admission::new(config.admission.clone());
        let metrics = Metrics::new();
        let l = &config.limits;
        let body_budget = crate::body_budget::BodyBudget::new(
            l.http_body_budget_bytes,
            l.http_max_body_bytes,
            std::time::Duration::from_secs(l.http_idle_timeout_s),
            metrics.http_body_bytes.clone(),
        );
        let models = crate::models::ServedModels::new(&config.node.model, &config.node.lora_adapters);
        Ok(Shared {
            models,
            booking_keys: crate::booking_token::BookingKeys::random(),
            limits: config.limits.clone(),
            config: Mutex::new(config),
            settings,
            tokenizer,
            policy_name,
            started: Instant::now(),
            core: parking_lot::Mutex::new(core),
            metrics,
            body_budget,
            in_flight: Default::default(),
            stopping: Default::default(),
            http,
            probe_http,
            cluster: std::sync::OnceLock::new(),
            tokens: crate::auth::Tokens::load(&config_security)?,
            decisions: Mutex::new(std::collections::VecDeque::with_capacity(DECISIONS_KEPT)),
            replication,
            autoscaler,
            admission,
        })
    }

    /// Seconds since the node started: the clock the routing core runs on.
    pub fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The routing core, locked. Keep the guard for one short, I/O-free section; the status
    /// changes the section finds are logged when it ends.
    pub fn core(&self) -> CoreGuard<'_> {
        CoreGuard::new(self.core.lock())
    }

    /// What a client refused by admission control is told: seconds before retrying and why
    /// ([`crate::admission::Admission::refusal`]). The backlog ahead of it is the prefill
    /// still queued on the replicas (drained at their prefill rate since booked) plus the
    /// token load waiting in the queue; the pool's capacity is the routable replicas times
    /// the capacity per replica (as the autoscaler measures it).
    pub fn refusal(&self, why: crate::admission::Refused) -> (u64, String) {
        let now = self.now();
        let (queued, routable) = {
            let core = self.core();
            let routable = core.fleet.replicas().iter().filter(|r| r.routable()).count();
            (core.fleet.bookings().queued_prefill_at(now), routable)
        };
        let per_replica = self.autoscaler.capacity_tokens_per_s(self.settings.profile.full_load_tokens_per_s_prior());
        self.admission.refusal(why, queued + self.admission.waiting_load(), routable as f64 * per_replica)
    }

    /// This node's hottest `top` prefixes (empty with replication off).
    pub fn own_report(&self, top: usize) -> kvmesh_core::replication::SketchReport {
        let now = self.now();
        self.core().sketch.as_ref().map(|s| s.report(now, top)).unwrap_or_default()
    }

    /// Routes by a committed replication plan from now on, and publishes it (watchers, metrics).
    pub fn apply_plan(&self, plan: kvmesh_core::replication::ReplicationPlan) {
        let grace = self.replication.section.grace_ttl_s;
        let now = self.now();
        self.core().fleet.set_replication_plan(&plan, grace, now);
        self.replication.publish(plan);
    }

    /// Remembers a decision for `kvmesh status` (the last 64).
    pub fn record_decision(&self, d: DecisionRecord) {
        let mut q = self.decisions.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() == DECISIONS_KEPT {
            q.pop_front();
        }
        q.push_back(d);
    }

    /// The latest `n` decisions, newest first.
    pub fn recent_decisions(&self, n: usize) -> Vec<DecisionRecord> {
        self.decisions.lock().unwrap_or_else(|p| p.into_inner()).iter().rev().take(n).cloned().collect()
    }

    /// The routing policy's name.
    pub fn policy_name(&self) -> Arc<str> {
        self.policy_name.lock().unwrap_or_else(|p| p.into_inner()).0.clone()
    }

    /// Switches the routing policy and its parameters (the cluster changed them). A no-op
    /// when both are current.
    ///
    /// # Errors
    /// An unknown policy name or parameter.
    pub fn set_policy(&self, name: &str, params: &std::collections::BTreeMap<String, f64>) -> Result<(), String> {
        let kind: PolicyKind = name.parse().map_err(|e| format!("{e}"))?;
        let name = kind.as_str();
        let mut current = self.policy_name.lock().unwrap_or_else(|p| p.into_inner());
        if &*current.0 == name && &current.1 == params {
            return Ok(());
        }
        let list: Vec<(String, f64)> = params.iter().map(|(k, v)| (k.clone(), *v)).collect();
        self.core().policy = kind.build_with(&list).map_err(|e| e.to_string())?;
        *current = (Arc::from(name), params.clone());
        tracing::info!(policy = name, ?params, "routing policy changed");
        Ok(())
    }

    /// Registers a replica in the routing core.
    ///
    /// # Errors
    /// [`RegistryError::Exists`] or [`RegistryError::Invalid`].
    pub fn add_replica(&self, config: ReplicaConfig) -> Result<ReplicaId, RegistryError> {
        config.validate().map_err(RegistryError::Invalid)?;
        let endpoints = Arc::new(
            Endpoints::parse(&config.http).map_err(RegistryError::Invalid)?.with_rank(config.data_parallel_rank),
        );
        let mut core = self.core();
        if core.replicas.contains_key(&config.name) {
            return Err(RegistryError::Exists(config.name));
        }
        let spec = ReplicaSpec {
            publishes_events: config.kv_events.is_some(),
            profile: self.settings.profile,
            model: self.models.of_replica(config.model.as_deref()).to_string(),
            block_size: config.block_size.unwrap_or(0),
            role: config.role,
            ..ReplicaSpec::new(config.name.clone(), config.capacity_blocks)
        };
        let id = core.fleet.add_replica(spec).map_err(|e| RegistryError::Invalid(e.to_string()))?;
        self.models.added(config.model.as_deref());
        let model = self.models.of_replica(config.model.as_deref());
        self.models.set_block_size(model, core.fleet.block_size_of(core.fleet.replica(id).map(|r| r.model)));
        for a in config.lora_adapters.iter().flatten() {
            // Validation keeps a declared adapter's name apart from the models.
            let _ = self.models.learn_adapter(a, config.model.as_deref());
        }
        let now = self.now();
        // Out of rotation from the start when the registry says so (set_rotation_ahead).
        let (draining, starting) = core.rotation_ahead.remove(&config.name).unwrap_or((false, false));
        let replica = Replica {
            id,
            config: config.clone(),
            endpoints,
            draining_since: draining.then_some(now),
            starting: starting && draining,
            idle_logged: false,
            failures: 0,
            last_error: None,
            overloaded_until: 0.0,
            engine: None,
            engine_at: None,
            engine_served: None,
            busy_since: None,
            proxied: 0,
            counts_every_step: true,
            hung: None,
            recent_prompts: Default::default(),
            listed_adapters: None,
            last_seq: None,
            last_event_at: None,
            unpublished_since: None,
            added_at: now,
            resyncing: false,
            resync_requested: None,
            last_resync_at: None,
            restart_seen_at: None,
            events_applied: 0,
            events_rejected: 0,
            bad_events_until: None,
            reported: Status::Ready,
        };
        core.replicas.insert(config.name.clone(), replica);
        // In line with the flags in the same lock section: never routed to in between.
        let _ = core.sync_routable(&config.name, now);
        drop(core);
        let mut c = self.config.lock().unwrap_or_else(|p| p.into_inner());
        if !c.replicas.iter().any(|r| r.name == config.name) {
            c.replicas.push(config);
        }
        Ok(id)
    }

    /// Forgets a replica: its blocks, its bookings' load, its status.
    ///
    /// # Errors
    /// [`RegistryError::Unknown`].
    pub fn remove_replica(&self, name: &str) -> Result<(), RegistryError> {
        let mut core = self.core();
        let r = core.replicas.remove(name).ok_or_else(|| RegistryError::Unknown(name.into()))?;
        let _ = core.fleet.remove_replica(r.id);
        self.models.removed(r.config.model.as_deref());
        // Its bookings went with it: tell the peers they ended.
        let now = self.now();
        if let Some(out) = core.outbox.as_mut() {
            out.release_replica(name, now);
        }
        drop(core);
        self.autoscaler.forget(name);
        self.config.lock().unwrap_or_else(|p| p.into_inner()).replicas.retain(|c| c.name != name);
        Ok(())
    }

    /// Sets or clears a replica's draining flag.
    ///
    /// # Errors
    /// [`RegistryError::Unknown`].
    pub fn set_draining(&self, name: &str, draining: bool) -> Result<(), RegistryError> {
        self.set_rotation(name, draining, false)
    }

    /// The rotation `name` takes when it is added next ([`Shared::set_rotation`]'s flags): a
    /// replica the registry holds starting or draining is out of rotation from its first
    /// moment on this node.
    pub fn set_rotation_ahead(&self, name: &str, draining: bool, starting: bool) {
        self.core().rotation_ahead.insert(name.to_string(), (draining, starting));
    }

    /// Takes a replica out of rotation (`draining`, or `starting`: still loading) or puts it
    /// back, as the cluster's registry says.
    ///
    /// # Errors
    /// [`RegistryError::Unknown`].
    pub fn set_rotation(&self, name: &str, draining: bool, starting: bool) -> Result<(), RegistryError> {
        let now = self.now();
        let mut core = self.core();
        let r = core.replicas.get_mut(name).ok_or_else(|| RegistryError::Unknown(name.into()))?;
        r.starting = starting && draining;
        if draining != r.draining() {
            r.draining_since = draining.then_some(now);
            r.idle_logged = false;
        }
        let _ = core.sync_routable(name, now);
        Ok(())
    }
}

impl Core {
    /// The status operators see for `r` at `now`.
    pub fn status(&self, r: &Replica, now: f64) -> Status {
        if r.starting {
            return Status::Starting;
        }
        if r.draining() {
            return Status::Draining;
        }
        if r.failures >= self.unhealthy_after || r.hung.is_some() || self.hung_for(r, now).is_some() {
            return Status::Unhealthy;
        }
        if r.overloaded_until > now {
            return Status::Overloaded;
        }
        // Time-based: a quarantine ends by itself even when nothing acts on its end (an
        // `Events.Publish` pusher that never comes back).
        if r.bad_events_until.is_some_and(|u| now < u) {
            return Status::BadEvents;
        }
        if let Some(health) = self.fleet.index().health(r.id) {
            if health.block_size_mismatch.is_some() {
                return Status::BlockSizeMismatch;
            }
            if health.out_of_sync || r.resyncing {
                return Status::OutOfSync;
            }
        }
        // An event owed for longer than `events_silent_s`: the stream is silent, however
        // sparse the traffic.
        if r.config.kv_events.is_some() && r.unpublished_since.is_some_and(|t| now - t > self.events_silent_s) {
            return Status::NoEvents;
        }
        Status::Ready
    }

    /// How long `r`'s engine has served no token while this node had requests in flight on
    /// it, seconds, once that reaches `hung_after_s`: a hung engine whose metrics endpoint
    /// still answers (its served-token counter stands still).
    fn hung_for(&self, r: &Replica, now: f64) -> Option<f64> {
        if !r.counts_every_step {
            return None;
        }
        let (_, still_since) = r.engine_served?;
        let hung = now - still_since.max(r.busy_since?);
        (self.hung_after_s > 0.0 && hung >= self.hung_after_s).then_some(hung)
    }

    /// Whether a replica takes new requests (ready, or degraded but still serving).
    fn routable(status: Status) -> bool {
        !matches!(status, Status::Draining | Status::Starting | Status::Unhealthy | Status::Overloaded)
    }

    /// What `r`'s `status` means at `now`, for operators (empty when the status says it all).
    pub fn status_detail(&self, r: &Replica, status: Status, now: f64) -> String {
        match status {
            Status::BlockSizeMismatch => {
                let ours = self.fleet.block_size_of(self.fleet.replica(r.id).map(|s| s.model));
                self.fleet.index().health(r.id).and_then(|h| h.block_size_mismatch).map_or(String::new(), |b| {
                    format!("events carry block size {b}, this node uses {ours}: routed on load only")
                })
            }
            Status::Unhealthy if r.hung.is_some() || self.hung_for(r, now).is_some() => {
                let still = r.engine_served.map_or(0.0, |(_, since)| now - since);
                format!(
                    "hung: its engine served no token for {still:.0} s with requests in flight; routed \
                     around until it serves again (or tried again once idle for hung_after_s)"
                )
            }
            Status::Unhealthy => r.last_error.clone().unwrap_or_default(),
            Status::Overloaded => "answered 429/503; backing off".into(),
            Status::BadEvents => r.bad_events_until.map_or(String::new(), |u| {
                format!(
                    "its KV events kept being refused: quarantined for {:.0} s more (blocks dropped, stream \
                     not followed; routed on load only), then rebuilt",
                    (u - now).max(0.0)
                )
            }),
            Status::NoEvents => "serving, but no KV event arrives: routed on load and the router's record".into(),
            Status::OutOfSync => {
                "KV events were missed: its blocks are being rebuilt (routed on load meanwhile)".into()
            }
            Status::Starting => match (&r.engine, &r.last_error) {
                (Some(_), None) => "starting: the engine answers; not routed to until marked ready".into(),
                (_, Some(e)) => format!("starting: the engine does not answer yet ({e})"),
                (None, None) => "starting: no scrape of the engine yet".into(),
            },
            Status::Draining => self.drain_progress(r, now).map_or(String::new(), |p| p.to_string()),
            Status::Ready => String::new(),
        }
    }

    /// Brings the core's ready/draining flag in line with `name`'s status, and queues a change
    /// of status to be logged once, after the lock ([`CoreGuard`]); returns the change, (from,
    /// to), if there was one.
    pub fn sync_routable(&mut self, name: &str, now: f64) -> Option<(Status, Status)> {
        let r = self.replicas.get(name)?;
        let status = self.status(r, now);
        let id = r.id;
        let _ =
            self.fleet.set_status(id, if Core::routable(status) { CoreStatus::Ready } else { CoreStatus::Draining });
        let from = r.reported;
        if from == status {
            return None;
        }
        let detail = self.status_detail(r, status, now);
        self.status_changes.push(StatusChange { replica: name.to_string(), from, to: status, detail });
        if let Some(r) = self.replicas.get_mut(name) {
            r.reported = status;
        }
        Some((from, status))
    }

    /// Re-evaluates every replica (overload marks expire with time, case C18).
    pub fn sync_all(&mut self, now: f64) {
        let names: Vec<String> = self.replicas.keys().cloned().collect();
        for n in names {
            let _ = self.sync_routable(&n, now);
        }
    }

    /// A request that began at `began` (node seconds) finished on `name` having filled KV
    /// blocks its engine did not hold: the engine owes an event for them unless one came
    /// since it began (the no-events status counts from the oldest such request).
    pub fn served_new_blocks(&mut self, name: &str, began: f64) {
        if let Some(r) = self.replicas.get_mut(name) {
            if r.last_event_at.is_none_or(|e| e < began) {
                r.unpublished_since.get_or_insert(began);
            }
        }
    }

    /// Records a failed scrape or connect; returns the replica's status after it.
    pub fn record_failure(&mut self, name: &str, error: String, now: f64) -> Option<Status> {
        let r = self.replicas.get_mut(name)?;
        r.failures += 1;
        r.last_error = Some(error);
        let _ = self.sync_routable(name, now);
        self.note_idle(name, now);
        self.replicas.get(name).map(|r| self.status(r, now))
    }

    /// A connect failure takes a replica out at once: a dead engine is routed around now, not
    /// after `unhealthy_after` scrapes.
    pub fn record_down(&mut self, name: &str, error: String, now: f64) {
        let threshold = self.unhealthy_after;
        if let Some(r) = self.replicas.get_mut(name) {
            r.failures = r.failures.max(threshold);
            r.last_error = Some(error);
        }
        let _ = self.sync_routable(name, now);
    }

    /// Records a backpressure answer (429/503): out of rotation until `until`.
    pub fn record_overload(&mut self, name: &str, until: f64, now: f64) {
        if let Some(r) = self.replicas.get_mut(name) {
            r.overloaded_until = until;
        }
        let _ = self.sync_routable(name, now);
    }

    /// Records a good scrape, asked for at `asked_at` and answered by `now` (node seconds),
    /// with the engine's served-token counter when its page has one (tokens).
    pub fn record_metrics(&mut self, name: &str, metrics: EngineMetrics, served: Option<f64>, asked_at: f64, now: f64) {
        let threshold = self.unhealthy_after;
        let Some(r) = self.replicas.get_mut(name) else { return };
        if r.failures >= threshold {
            r.resync_requested = Some("recovery");
        }
        r.failures = 0;
        r.last_error = None;
        r.engine = Some(metrics);
        r.engine_at = Some(asked_at);
        r.engine_served = match (served, r.engine_served) {
            (Some(v), Some((old, since))) if v == old => Some((old, since)),
            (Some(v), old) => {
                // Served something (or restarted): not hung.
                if old.is_some() {
                    r.hung = None;
                }
                Some((v, asked_at))
            }
            (None, _) => None,
        };
        r.busy_since = (r.proxied > 0).then(|| r.busy_since.unwrap_or(asked_at));
        let id = r.id;
        let hung_after_s = self.hung_after_s;
        let found = self.replicas.get(name).and_then(|r| self.hung_for(r, now));
        let Some(r) = self.replicas.get_mut(name) else { return };
        if found.is_some() && r.hung.is_none() {
            r.hung = Some(None);
        }
        // Nothing of ours in flight on a hung engine for hung_after_s: try it again (if it is
        // still hung, the next requests find that out within hung_after_s).
        if let Some(idle_since) = r.hung.as_mut() {
            if r.proxied > 0 {
                *idle_since = None;
            } else if now - *idle_since.get_or_insert(asked_at) >= hung_after_s {
                r.hung = None;
            }
        }
        let _ = self.fleet.report_metrics(id, metrics);
        let _ = self.sync_routable(name, now);
        self.note_idle(name, now);
    }

    /// Applies one decoded event for `name`.
    pub fn apply(&mut self, name: &str, event: &KvEvent, now: f64) -> Option<ApplyOutcome> {
        let id = self.replicas.get(name)?.id;
        let mut outcome = self.fleet.apply_event(id, event, now).ok()?;
        if outcome.orphaned > 0 {
            // Perhaps the store of a request that already ended here: its prompt places it.
            let Core { replicas, fleet, .. } = self;
            for (tokens, selected) in &replicas.get(name)?.recent_prompts {
                if fleet.index().orphan_blocks(id) == 0 {
                    break;
                }
                if let Some(o) = adopt(fleet, id, tokens, selected) {
                    outcome.inferred += o.inferred;
                    outcome.adopted += o.adopted;
                }
            }
        }
        let r = self.replicas.get_mut(name)?;
        r.last_event_at = Some(now);
        r.unpublished_since = None;
        if outcome.rejection.is_some() {
            r.events_rejected += 1;
        } else {
            r.events_applied += 1;
        }
        Some(outcome)
    }

    /// A prompt `tokens` of namespace `selected` ended well on replica `name`: when its
    /// history is partial, the stores waiting there that continue it are placed now
    /// ([`kvmesh_core::Fleet::adopt_prompt`]), and it is kept among the replica's
    /// `recent_prompts` for stores still on their way. `None` when the history is whole.
    pub fn adopt_prompt(
        &mut self,
        name: &str,
        tokens: &Arc<[u32]>,
        selected: &crate::models::Selected,
    ) -> Option<kvmesh_core::index::ApplyOutcome> {
        let id = self.replicas.get(name)?.id;
        if !self.fleet.index().history_is_partial(id) {
            return None;
        }
        let r = self.replicas.get_mut(name)?;
        if tokens.len() <= RECENT_PROMPT_TOKENS {
            let mut kept: usize = r.recent_prompts.iter().map(|(t, _)| t.len()).sum();
            while r.recent_prompts.len() >= RECENT_PROMPTS || kept + tokens.len() > RECENT_PROMPT_TOKENS {
                let Some((gone, _)) = r.recent_prompts.pop_front() else { break };
                kept -= gone.len();
            }
            r.recent_prompts.push_back((tokens.clone(), selected.clone()));
        }
        if self.fleet.index().orphan_blocks(id) == 0 {
            return None;
        }
        adopt(&mut self.fleet, id, tokens, selected)
    }

    /// Says whether replica `name`'s event history is partial
    /// ([`kvmesh_core::Fleet::set_partial_history`]).
    pub fn set_partial_history(&mut self, name: &str, partial: bool) {
        if let Some(r) = self.replicas.get_mut(name) {
            let _ = self.fleet.set_partial_history(r.id, partial);
            if !partial {
                r.recent_prompts.clear();
            }
        }
    }

    /// The replicas (sorted ids, within `subset` when given) of model `model` that serve LoRA
    /// adapter `adapter` — declared in their `lora_adapters`, listed by their engine's
    /// `/v1/models`, or not known (taken to serve it: no answer yet, or an engine that lists
    /// no adapter at all, as SGLang's and a vLLM without `--enable-lora` do) — when that
    /// leaves any of the model's replicas out; `None` when all of them serve it.
    pub fn serving_adapter(
        &self,
        model: &str,
        adapter: &str,
        subset: Option<&[kvmesh_core::ReplicaId]>,
    ) -> Option<Vec<kvmesh_core::ReplicaId>> {
        let of_model = |r: &&Replica| self.fleet.replica(r.id).is_some_and(|s| s.spec.model == model);
        let serves = |r: &&Replica| {
            let listed = r.listed_adapters.as_ref().filter(|l| !l.is_empty());
            r.config.lora_adapters.as_ref().or(listed).is_none_or(|list| list.iter().any(|a| a == adapter))
        };
        if self.replicas.values().filter(of_model).all(|r| serves(&r)) {
            return None;
        }
        let mut ids: Vec<_> = self
            .replicas
            .values()
            .filter(|r| of_model(r) && serves(r) && subset.is_none_or(|s| s.binary_search(&r.id).is_ok()))
            .map(|r| r.id)
            .collect();
        ids.sort_unstable();
        Some(ids)
    }

    /// Why a request for LoRA adapter `adapter` of model `model` cannot be served: the
    /// model's replicas' adapters are all known and none serves it; `None` otherwise.
    pub fn adapter_unserved(&self, model: &str, adapter: &str) -> Option<String> {
        let serving = self.serving_adapter(model, adapter, None)?;
        serving.is_empty().then(|| {
            format!(
                "LoRA adapter {adapter:?} is served by no replica of {model:?} (a replica's adapters are its \
                 lora_adapters, or what its engine's /v1/models lists)"
            )
        })
    }

    /// Decides where `req` would go at `now`, booking nothing (admission control checks the
    /// decision before [`Core::book`] commits it).
    ///
    /// # Errors
    /// The core's error (no replica ready, …).
    pub fn decide(&mut self, req: &RouteRequest, now: f64) -> Result<Decision, kvmesh_core::Error> {
        self.decide_within(req, None, now)
    }

    /// [`Core::decide`] among `subset` only (replica ids, sorted), when given: a gateway's
    /// endpoint subset ([`crate::epp`]).
    ///
    /// # Errors
    /// No replica of the subset takes traffic.
    pub fn decide_within(
        &mut self,
        req: &RouteRequest,
        subset: Option<&[kvmesh_core::ReplicaId]>,
        now: f64,
    ) -> Result<Decision, kvmesh_core::Error> {
        self.ready_to_decide(now);
        let Core { fleet, policy, rng, .. } = self;
        fleet.decide_within(policy.as_mut(), req, subset, rng, now)
    }

    /// What every decision at `now` needs first: replicas' routable flags current, and the
    /// active peers (gossip) told to the fleet.
    fn ready_to_decide(&mut self, now: f64) {
        // Status changes on events, scrapes and failures re-sync their replica at once; only
        // the passing of time (an overload mark or event silence running out) needs a sweep,
        // and a sweep every 10 ms is plenty.
        if now - self.synced_at > 0.01 {
            self.sync_all(now);
            self.synced_at = now;
        }
        let (peers, rank) = self.remote.active_peers(self.node_id, now, ACTIVE_PEER_WINDOW_S);
        self.fleet.set_active_peers(peers, rank);
    }

    /// Books `decision` (from [`Core::decide`] for `req`) and tells the peers; returns the
    /// booking, the replica's name and its URLs.
    ///
    /// # Errors
    /// The replica is gone or no longer routable.
    pub fn book(
        &mut self,
        req: &RouteRequest,
        decision: Decision,
        now: f64,
    ) -> Result<(Routed, String, Arc<Endpoints>), kvmesh_core::Error> {
        // The core knows each replica's name (a binary search), the registry its endpoint;
        // looked up first, so a failure leaves nothing booked.
        let id = decision.replica;
        let (name, endpoints) = self
            .fleet
            .replica(id)
            .and_then(|state| self.replicas.get(&state.spec.name))
            .map(|r| (r.config.name.clone(), r.endpoints.clone()))
            .ok_or(kvmesh_core::Error::UnknownReplica(id))?;
        let routed = self.fleet.book_decision(self.policy.as_mut(), req, decision, now)?;
        if let Some(out) = self.outbox.as_mut() {
            out.routed(&self.fleet, &routed, &req.hashes, now);
        }
        Ok((routed, name, endpoints))
    }

    /// Whether requests of `model` go to a prefill and a decode replica, among `subset`
    /// (sorted ids) when given (see [`kvmesh_core::Fleet::disaggregated`]).
    pub fn disaggregated(
        &self,
        model: Option<kvmesh_core::ModelKey>,
        subset: Option<&[kvmesh_core::ReplicaId]>,
    ) -> bool {
        self.fleet.disaggregated(model, subset)
    }

    /// Decides both sides of a disaggregated `req` at `now` among `subset` (sorted ids), when
    /// given, booking nothing ([`kvmesh_core::Fleet::decide_pd`]).
    ///
    /// # Errors
    /// Either side has no routable replica.
    pub fn decide_pd_within(
        &mut self,
        req: &RouteRequest,
        subset: Option<&[kvmesh_core::ReplicaId]>,
        now: f64,
    ) -> Result<kvmesh_core::PdDecision, kvmesh_core::Error> {
        self.ready_to_decide(now);
        let Core { fleet, policy, rng, .. } = self;
        fleet.decide_pd(policy.as_mut(), req, subset, rng, now)
    }

    /// Books both sides of `d` (from [`Core::decide_pd_within`] for `req`) and tells the
    /// peers; returns the bookings and each side's name and URLs (prefill, decode).
    ///
    /// # Errors
    /// Either replica is gone or no longer routable; nothing stays booked.
    pub fn book_pd(
        &mut self,
        req: &RouteRequest,
        d: kvmesh_core::PdDecision,
        now: f64,
    ) -> Result<(kvmesh_core::PdRouted, [NamedReplica; 2]), kvmesh_core::Error> {
        let side = |id: kvmesh_core::ReplicaId| {
            self.fleet
                .replica(id)
                .and_then(|state| self.replicas.get(&state.spec.name))
                .map(|r| (r.config.name.clone(), r.endpoints.clone()))
                .ok_or(kvmesh_core::Error::UnknownReplica(id))
        };
        let sides = [side(d.prefill.replica)?, side(d.decode.replica)?];
        let routed = self.fleet.book_pd(self.policy.as_mut(), req, d, now)?;
        if let Some(out) = self.outbox.as_mut() {
            out.routed(&self.fleet, &routed.prefill, &req.hashes, now);
            out.routed(&self.fleet, &routed.decode, &req.hashes, now);
        }
        Ok((routed, sides))
    }

    /// Counts `req` (decided as `decision`) as arriving demand: its token load (uncached
    /// prefill plus expected output, tokens) for the autoscaler, and its prompt `tokens` for
    /// the hot-prefix sketch (`hot_prefix` false: not, e.g. a LoRA adapter's request, whose
    /// blocks replication's base-model warm-ups would not reproduce). Once per request — not
    /// again on a retry, nor on a re-route after waiting in the admission queue — whether or
    /// not it is ever sent.
    pub fn count_demand(
        &mut self,
        req: &RouteRequest,
        tokens: &[u32],
        decision: &Decision,
        now: f64,
        hot_prefix: bool,
    ) {
        let output = self.fleet.expected_output_tokens(req);
        let load = decision.uncached_tokens as f64 + output as f64;
        self.booked_tokens += load;
        self.own_demand_tokens += load;
        if let Some(sketch) = self.sketch.as_mut().filter(|_| hot_prefix) {
            sketch.observe(now, &req.hashes, Some(tokens), load);
        }
    }

    /// Adds a peer's gossiped demand to this node's: `demand_tokens` is the peer's own
    /// cumulative count for its `incarnation`, so only the increase since its last report
    /// counts (a lost batch loses nothing; a restarted peer starts over from 0). A peer's
    /// first report is only the base: it holds everything the peer counted before this node
    /// heard from it (before this node started, say), not demand arriving now.
    pub fn peer_demand(&mut self, peer: u64, incarnation: u64, demand_tokens: f64) {
        let base = if demand_tokens.is_finite() { demand_tokens.max(0.0) } else { 0.0 };
        let (inc, last) = self.peer_demand.entry(peer).or_insert((incarnation, base));
        if *inc != incarnation {
            *inc = incarnation;
            *last = 0.0;
        }
        if demand_tokens.is_finite() && demand_tokens > *last {
            self.booked_tokens += demand_tokens - *last;
            *last = demand_tokens;
        }
    }

    /// A booking's first token arrived.
    ///
    /// # Errors
    /// An unknown booking (released or expired).
    pub fn first_token(&mut self, booking: BookingId, now: f64) -> Result<(), kvmesh_core::Error> {
        self.fleet.first_token(booking, now)?;
        if let Some(out) = self.outbox.as_mut() {
            out.first_token(booking.0, now);
        }
        Ok(())
    }

    /// Ends a booking at `now`.
    ///
    /// # Errors
    /// An unknown booking (already released or expired): nothing changes.
    pub fn release(
        &mut self,
        booking: BookingId,
        output_tokens: Option<u32>,
        now: f64,
    ) -> Result<(), kvmesh_core::Error> {
        // Peers hear of the end even when the fleet no longer holds the booking (its replica
        // was removed, or its lease ran out first): a booking advertised must be ended.
        if let Some(out) = self.outbox.as_mut() {
            out.release(booking.0, output_tokens, now);
        }
        self.fleet.release(booking, output_tokens)
    }

    /// Housekeeping at `now`: bookings past their lease end (and are announced as ended),
    /// peers silent for `peer_timeout_s` lose theirs. Returns the expired local bookings.
    pub fn expire(&mut self, now: f64, peer_timeout_s: f64) -> usize {
        let expired = self.fleet.expire(now);
        if let Some(out) = self.outbox.as_mut() {
            for b in &expired {
                out.release(b.0, None, now);
            }
        }
        for peer in self.remote.expire(&mut self.fleet, now, peer_timeout_s) {
            tracing::warn!(%peer, "peer silent: its shared bookings were dropped");
        }
        expired.len()
    }
}

/// A node with `node` settings and nothing else configured (no replica, no cluster), for
/// unit tests.
#[cfg(test)]
pub(crate) fn test_node(node: crate::config::NodeSection) -> Shared {
    let config = NodeConfig {
        node,
        replicas: vec![],
        cluster: None,
        security: Default::default(),
        replication: Default::default(),
        autoscaler: Default::default(),
        admission: Default::default(),
        limits: Default::default(),
        epp: Default::default(),
    };
    Shared::new(config).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A single node's state with `node` settings and no replica.
    fn node(node: crate::config::NodeSection) -> Shared {
        super::test_node(node)
    }

    /// Registers a replica of 100 blocks at a closed port, with `fields` (TOML) on top.
    fn add(shared: &Shared, fields: &str) {
        let replica = format!("{fields}\nhttp = \"http://127.0.0.1:9\"\ncapacity_blocks = 100");
        shared.add_replica(toml::from_str(&replica).unwrap()).unwrap();
    }

    #[test]
    fn a_change_of_status_is_reported_once_with_what_it_means() {
        let shared = node(crate::config::NodeSection::default());
        add(&shared, "name = \"r0\"");
        let mut core = shared.core();
        assert_eq!(core.sync_routable("r0", 1.0), None);
        core.record_down("r0", "connection refused".into(), 1.0);
        assert_eq!(core.replicas["r0"].reported, Status::Unhealthy);
        // Logged when it changed, not again.
        assert_eq!(core.sync_routable("r0", 1.5), None);
        assert_eq!(core.status_detail(&core.replicas["r0"], Status::Unhealthy, 2.0), "connection refused");
        let metrics = EngineMetrics { running: 0, waiting: 0, kv_usage: 0.0, at: 2.0 };
        core.record_metrics("r0", metrics, None, 2.0, 2.0);
        assert_eq!(core.replicas["r0"].reported, Status::Ready);
        // An overload mark runs out with time: seen at the next sync.
        core.record_overload("r0", 5.0, 3.0);
        assert_eq!(core.replicas["r0"].reported, Status::Overloaded);
        assert_eq!(core.sync_routable("r0", 4.0), None);
        assert_eq!(core.sync_routable("r0", 6.0), Some((Status::Overloaded, Status::Ready)));
        assert_eq!(core.sync_routable("nobody", 6.0), None);
    }

    #[test]
    fn status_changes_are_logged_after_the_lock_is_released() {
        let shared = Arc::new(node(crate::config::NodeSection::default()));
        add(&shared, "name = \"r0\"");
        // Each log line's writer records whether the core was free when the line was written.
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (s, w) = (shared.clone(), seen.clone());
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || {
                w.lock().unwrap().push(s.core.try_lock().is_some());
                std::io::sink()
            })
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let mut core = shared.core();
            core.record_down("r0", "connection refused".into(), 1.0);
            let queued = core.status_changes.clone();
            assert_eq!(
                queued,
                vec![StatusChange {
                    replica: "r0".into(),
                    from: Status::Ready,
                    to: Status::Unhealthy,
                    detail: "connection refused".into()
                }]
            );
            assert!(seen.lock().unwrap().is_empty(), "nothing logged under the lock");
            drop(core);
        });
        assert_eq!(*seen.lock().unwrap(), vec![true]);
        assert!(shared.core().status_changes.is_empty());
    }

    #[test]
    fn an_engine_that_serves_no_token_with_requests_in_flight_is_hung_and_routed_around() {
        let shared = node(crate::config::NodeSection { hung_after_s: 60.0, ..Default::default() });
        add(&shared, "name = \"r0\"");
        let mut core = shared.core();
        let m = |at| EngineMetrics { running: 1, waiting: 0, kv_usage: 0.1, at };
        let in_flight = |core: &mut Core, n| core.replicas.get_mut("r0").unwrap().proxied = n;
        // Idle for a long while: a counter standing still with nothing in flight is no hang;
        // nor are bookings that are not this node's proxied requests (a gRPC Route caller's).
        core.record_metrics("r0", m(1.0), Some(100.0), 1.0, 1.0);
        let req = RouteRequest {
            prompt_tokens: 64,
            hashes: vec![],
            max_tokens: Some(8),
            prompt_key: 1,
            key: 1,
            streamed: true,
            output_hint: None,
            model: None,
        };
        let decision = core.decide(&req, 100.0).unwrap();
        core.book(&req, decision, 100.0).unwrap();
        core.record_metrics("r0", m(200.0), Some(100.0), 200.0, 200.0);
        assert_eq!(core.replicas["r0"].reported, Status::Ready);
        // A proxied request in flight from the scrape at 202; the counter still from 1 s on.
        in_flight(&mut core, 1);
        core.record_metrics("r0", m(202.0), Some(100.0), 202.0, 202.0);
        core.record_metrics("r0", m(261.0), Some(100.0), 261.0, 261.0);
        assert_eq!(core.replicas["r0"].reported, Status::Ready, "59 s: not yet");
        core.record_metrics("r0", m(262.0), Some(100.0), 262.0, 262.0);
        let r = &core.replicas["r0"];
        assert_eq!(r.reported, Status::Unhealthy);
        assert_eq!(
            core.status_detail(r, Status::Unhealthy, 262.0),
            "hung: its engine served no token for 261 s with requests in flight; routed around until it serves \
             again (or tried again once idle for hung_after_s)"
        );
        // Its request times out (504): still out, until nothing of ours was in flight for 60 s.
        in_flight(&mut core, 0);
        core.record_metrics("r0", m(800.0), Some(100.0), 800.0, 800.0);
        core.record_metrics("r0", m(859.0), Some(100.0), 859.0, 859.0);
        assert_eq!(core.replicas["r0"].reported, Status::Unhealthy, "idle for 59 s");
        core.record_metrics("r0", m(860.0), Some(100.0), 860.0, 860.0);
        assert_eq!(core.replicas["r0"].reported, Status::Ready, "tried again");
        // Hung again with a request in flight; then it serves: back at once.
        in_flight(&mut core, 1);
        core.record_metrics("r0", m(861.0), Some(100.0), 861.0, 861.0);
        core.record_metrics("r0", m(921.0), Some(100.0), 921.0, 921.0);
        assert_eq!(core.replicas["r0"].reported, Status::Unhealthy);
        core.record_metrics("r0", m(922.0), Some(140.0), 922.0, 922.0);
        assert_eq!(core.replicas["r0"].reported, Status::Ready);
        // An SGLang page's counter moves only as requests finish: never judged hung.
        core.replicas.get_mut("r0").unwrap().counts_every_step = false;
        core.record_metrics("r0", m(1_100.0), Some(140.0), 1_100.0, 1_100.0);
        assert_eq!(core.replicas["r0"].reported, Status::Ready);
        drop(core);
        let off = node(crate::config::NodeSection { hung_after_s: 0.0, ..Default::default() });
        add(&off, "name = \"r0\"");
        let mut core = off.core();
        in_flight(&mut core, 1);
        core.record_metrics("r0", m(2.0), Some(100.0), 2.0, 2.0);
        core.record_metrics("r0", m(500.0), Some(100.0), 500.0, 500.0);
        assert_eq!(core.replicas["r0"].reported, Status::Ready, "0: off");
    }

    #[test]
    fn a_drained_replica_is_idle_after_a_fresh_idle_scrape_or_a_served_counter_standing_still() {
        let shared = node(crate::config::NodeSection::default());
        add(&shared, "name = \"r0\"");
        let busy = |at| EngineMetrics { running: 1, waiting: 0, kv_usage: 0.1, at };
        let mut core = shared.core();
        core.record_metrics("r0", busy(9.0), Some(100.0), 9.0, 9.0);
        let r = core.replicas.get_mut("r0").unwrap();
        r.draining_since = Some(10.0);
        let progress = |core: &Core, now| core.drain_progress(&core.replicas["r0"], now).unwrap();
        // The scrape from before the drain does not count.
        assert_eq!(progress(&core, 10.5).engine, None);
        // One begun after it: busy, its counter unchanged since the drain for 1 s only.
        core.record_metrics("r0", busy(11.0), Some(100.0), 11.0, 11.1);
        let p = progress(&core, 11.1);
        assert_eq!((p.engine, p.stalled, p.idle()), (Some((1, 0)), false, false));
        // The counter moves at 13: the engine is working.
        core.record_metrics("r0", busy(13.0), Some(180.0), 13.0, 13.1);
        core.record_metrics("r0", busy(16.0), Some(180.0), 16.0, 16.1);
        assert!(!progress(&core, 16.1).idle());
        // Still for 5 s (13 to 18): stale gauges, idle — on a vLLM page; SGLang's counter
        // moves only as requests finish, so there it says nothing.
        core.record_metrics("r0", busy(18.0), Some(180.0), 18.0, 18.1);
        core.replicas.get_mut("r0").unwrap().counts_every_step = false;
        assert_eq!((progress(&core, 18.1).stalled, progress(&core, 18.1).idle()), (false, false));
        core.replicas.get_mut("r0").unwrap().counts_every_step = true;
        let p = progress(&core, 18.1);
        assert_eq!((p.stalled, p.idle()), (true, true));
        assert!(core.replicas["r0"].idle_logged);
        // An idle report is idle at once; undrained, there is no progress to show.
        core.record_metrics(
            "r0",
            EngineMetrics { running: 0, waiting: 0, kv_usage: 0.0, at: 19.0 },
            Some(180.0),
            19.0,
            19.1,
        );
        assert_eq!(progress(&core, 19.1).engine, Some((0, 0)));
        drop(core);
        shared.set_draining("r0", false).unwrap();
        let core = shared.core();
        assert_eq!(core.drain_progress(&core.replicas["r0"], 20.0), None);
    }

    #[test]
    fn a_replica_the_registry_holds_starting_is_out_of_rotation_from_its_first_moment() {
        let shared = node(crate::config::NodeSection::default());
        shared.set_rotation_ahead("s", true, true);
        shared.set_rotation_ahead("d", true, false);
        for name in ["s", "d", "r"] {
            add(&shared, &format!("name = \"{name}\""));
        }
        let core = shared.core();
        let view = |name: &str| {
            let r = &core.replicas[name];
            (core.status(r, 1.0), core.fleet.replica(r.id).unwrap().routable())
        };
        assert_eq!(view("s"), (Status::Starting, false));
        assert_eq!(view("d"), (Status::Draining, false));
        assert_eq!(view("r"), (Status::Ready, true));
        assert!(core.rotation_ahead.is_empty());
    }

    #[test]
    fn the_policy_goes_by_its_canonical_name() {
        // `kv-cost` is `kv_cost`: one label value per policy in metrics and status.
        let shared = node(crate::config::NodeSection { policy: "kv-cost".into(), ..Default::default() });
        assert_eq!(&*shared.policy_name(), "kv_cost");
        shared.set_policy(" round-robin", &Default::default()).unwrap();
        assert_eq!(&*shared.policy_name(), "round_robin");
        assert!(shared.set_policy("fastest", &Default::default()).is_err());
        assert_eq!(&*shared.policy_name(), "round_robin");
    }

    #[test]
    fn a_kv_event_owed_longer_than_events_silent_s_means_no_events() {
        let shared = node(crate::config::NodeSection { events_silent_s: 10.0, ..Default::default() });
        let replica =
            "name = \"e\"\nhttp = \"http://127.0.0.1:9\"\nkv_events = \"tcp://127.0.0.1:9\"\ncapacity_blocks = 100";
        shared.add_replica(toml::from_str(replica).unwrap()).unwrap();
        let mut core = shared.core();
        let status = |core: &Core, at: f64| core.status(&core.replicas["e"], at);
        // A request that began at 100 s filled new blocks; no event has come.
        core.served_new_blocks("e", 100.0);
        assert_eq!(status(&core, 105.0), Status::Ready);
        assert_eq!(status(&core, 110.5), Status::NoEvents);
        // An event settles it.
        core.apply("e", &KvEvent::Cleared, 111.0);
        assert_eq!(status(&core, 112.0), Status::Ready);
        // A request that began before that event owes nothing more.
        core.served_new_blocks("e", 105.0);
        assert_eq!(status(&core, 200.0), Status::Ready);
        // Sparse traffic: one request, and no event for 10 s, is enough.
        core.served_new_blocks("e", 300.0);
        assert_eq!(status(&core, 311.0), Status::NoEvents);
    }

    #[test]
    fn a_peers_demand_counts_by_its_increase_and_starts_over_when_the_peer_restarts() {
        let shared = node(crate::config::NodeSection::default());
        let mut core = shared.core();
        let mut seen = |peer: u64, incarnation: u64, demand: f64| {
            core.peer_demand(peer, incarnation, demand);
            core.booked_tokens
        };
        // A peer's first report is its base: what it counted before this node heard it.
        assert_eq!(seen(2, 7, 100.0), 0.0);
        // The same report again (a summary-only batch) adds nothing; a lost batch loses nothing.
        assert_eq!(seen(2, 7, 100.0), 0.0);
        assert_eq!(seen(2, 7, 250.0), 150.0);
        assert_eq!(seen(3, 1, 40.0), 150.0);
        assert_eq!(seen(3, 1, 65.0), 175.0);
        // Node 2 restarted: its count starts over from 0.
        assert_eq!(seen(2, 9, 30.0), 205.0);
        assert_eq!(seen(2, 9, f64::NAN), 205.0);
        assert_eq!(seen(2, 9, 10.0), 205.0);
        assert_eq!(core.own_demand_tokens, 0.0);
    }
}
