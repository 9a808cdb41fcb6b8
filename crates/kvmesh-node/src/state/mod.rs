//! The node's shared state: the routing core ([`Fleet`] + policy) and the replica registry
//! with each replica's live status, behind one short-held lock.
//!
//! Every lock section is a few microseconds (one decision, one event batch, one report), so
//! one mutex serves thousands of decisions per second without a queue; nothing holds it
//! across I/O.
//!
//! - [`Shared`] (this file): what every task of the node holds — settings, clients, metrics,
//!   the services' handles — and the registry's writes (add, remove, drain a replica).
//! - [`Core`] (`routing/`): what the lock guards — the fleet, the policy, every replica's
//!   live state ([`Replica`], `replica.rs`) — with its status rules (`routing/health.rs`),
//!   KV events (`routing/events.rs`) and decisions (`routing/decide.rs`).
//! - [`Stream`] (`stream.rs`): each replica's event-stream record (sequence, resyncs,
//!   quarantine, counts), behind a lock of its own that its ingest and pushes take, not
//!   this one.
//! - [`Health`] (`health.rs`): each replica's health (engine report, failures, backpressure,
//!   hang watch), behind a lock of its own that its scrape task takes; its status is derived
//!   from it under this one.
//! - [`Settings`] (`settings.rs`), drains (`drain.rs`), the lock
//!   guard that logs status changes after the lock is released (`guard.rs`).

mod drain;
mod guard;
mod health;
mod replica;
mod routing;
mod settings;
mod stream;
#[cfg(test)]
mod tests;

use crate::config::{NodeConfig, ReplicaConfig};
use crate::endpoints::Endpoints;
use crate::metrics::Metrics;
pub use drain::{DrainProgress, DRAIN_SETTLE_S, ENGINE_STALL_S};
pub use guard::CoreGuard;
pub use health::{Health, HealthState};
use kvmesh_core::{Fleet, FleetConfig, Namespace, PolicyKind, ReplicaId, ReplicaSpec};
use rand::rngs::SmallRng;
use rand::SeedableRng;
pub use replica::{RecentPrompt, Replica, RECENT_PROMPTS, RECENT_PROMPT_TOKENS};
pub use routing::{AppliedBatch, Core, StatusChange};
pub use settings::{NamedReplica, Settings};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
pub use stream::{Stream, StreamState};

/// Leading block hashes a shared booking carries (the prefix other nodes credit as pending):
/// 512 blocks of 16 tokens cover 8k-token prompts; longer ones share their first 8k.
const GOSSIP_PREFIX_BLOCKS: usize = 512;
/// Deltas waiting for the gossip sender before the oldest are dropped (summaries repair).
const GOSSIP_MAX_PENDING: usize = 100_000;
/// How long an ended peer booking is remembered, seconds.
const TOMBSTONE_S: f64 = 30.0;
/// A peer that routed within this many seconds may be deciding alongside this node (herding):
/// long enough that a burst after a quiet spell still finds its peers counted.
pub(crate) const ACTIVE_PEER_WINDOW_S: f64 = 10.0;

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
    /// The prefix index, outside the core's lock: replicas' KV events are applied through its
    /// writer without that lock, and a decision reads it without waiting for them
    /// ([`kvmesh_core::index::PublishedIndex`]; the core's fleet reads the same index).
    pub index: Arc<kvmesh_core::index::PublishedIndex>,
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
    /// Refused by the fleet (its replica limit, a clash with a live replica).
    #[error("{0}")]
    Invalid(String),
    /// Refused by [`crate::config::NodeConfig::validate`]'s checks of one replica.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Registered, but its actor did not start (it is unregistered again).
    #[error("starting {name}: {error}")]
    NotStarted {
        /// The replica.
        name: String,
        /// The actor system's error.
        error: String,
    },
}

impl Shared {
    /// A node's shared state for `config` (replicas are added by the supervisor).
    ///
    /// # Errors
    /// An invalid policy or block size; a tokenizer or token file that does not load.
    pub fn new(config: NodeConfig) -> anyhow::Result<Self> {
        let tokenizer = crate::tokenize::Tokenizer::load(config.node.tokenizer.as_deref())?;
        let tokens = crate::auth::Tokens::load(&config.security)?;
        Self::with_loaded(config, tokenizer, tokens)
    }

    /// [`Shared::new`] with the tokenizer and tokens already loaded (by
    /// [`crate::preflight::check`]).
    ///
    /// # Errors
    /// An invalid policy or block size.
    pub fn with_loaded(
        config: NodeConfig,
        tokenizer: crate::tokenize::Tokenizer,
        tokens: crate::auth::Tokens,
    ) -> anyhow::Result<Self> {
        let kind: PolicyKind = config.node.policy.parse().map_err(|e| anyhow::anyhow!("node.policy: {e}"))?;
        let fleet_config = FleetConfig {
            block_size: config.node.block_size,
            namespace: Namespace { model: config.node.model.clone(), ..Namespace::default() },
            lease_s: config.node.booking_lease.as_secs_f64(),
            learn_output_lengths: config.node.learn_output_lengths,
            // A per-process secret: engine ids from the network cannot be chosen to collide.
            index_seed: {
                use std::hash::{BuildHasher, Hasher};
                std::collections::hash_map::RandomState::new().build_hasher().finish()
            },
            ..FleetConfig::default()
        };
        let mut fleet = Fleet::new(fleet_config).map_err(|e| anyhow::anyhow!("{e}"))?;
        let index = fleet.publish_index().map_err(|e| anyhow::anyhow!("{e}"))?;
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
            events_silent_s: config.node.events_silent.as_secs_f64(),
            hung_after_s: config.node.hung_after.as_secs_f64(),
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
                kvmesh_core::replication::PrefixSketch::new(config.replication.plan.sketch, config.node.block_size)
            }),
        };
        let client = || {
            reqwest::Client::builder()
                .timeout(config.node.request_timeout.max(std::time::Duration::from_secs(1)))
                .connect_timeout(std::time::Duration::from_secs(2))
                .build()
        };
        let (http, probe_http) = (client()?, client()?);
        let settings = Settings {
            model: config.node.model.clone(),
            retries: config.node.retries,
            overload_backoff_s: config.node.overload_backoff.as_secs_f64(),
            block_size: config.node.block_size,
            hasher: *core.fleet.hasher(),
            profile: config.node.replica_profile()?,
            max_prompt_tokens: config.node.max_prompt_tokens,
        };
        // The canonical name (`kv-cost` is `kv_cost`): it labels metrics and status.
        let canonical = config.node.policy.parse::<PolicyKind>().map_or(config.node.policy.as_str(), |k| k.as_str());
        let policy_name = Mutex::new((Arc::from(canonical), config.node.policy_params.clone()));
        let replication = crate::replication::Replication::new(config.replication.clone());
        let autoscaler = crate::autoscaler::Autoscaling::new(config.autoscaler.clone());
        let admission = crate::admission::Admission::new(config.admission.clone());
        let metrics = Metrics::new();
        let l = &config.limits;
        let body_budget = crate::body_budget::BodyBudget::new(
            l.http_body_budget_bytes,
            l.http_max_body_bytes,
            l.http_idle_timeout,
            &metrics,
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
            index,
            metrics,
            body_budget,
            in_flight: Default::default(),
            stopping: Default::default(),
            http,
            probe_http,
            cluster: std::sync::OnceLock::new(),
            tokens,
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
        let grace = self.replication.section.plan.grace_ttl_s;
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
    /// The core's error for an unknown policy name or parameter.
    pub fn set_policy(
        &self,
        name: &str,
        params: &std::collections::BTreeMap<String, f64>,
    ) -> Result<(), kvmesh_core::Error> {
        let kind: PolicyKind = name.parse()?;
        let name = kind.as_str();
        let mut current = self.policy_name.lock().unwrap_or_else(|p| p.into_inner());
        if &*current.0 == name && &current.1 == params {
            return Ok(());
        }
        let list: Vec<(String, f64)> = params.iter().map(|(k, v)| (k.clone(), *v)).collect();
        self.core().policy = kind.build_with(&list)?;
        *current = (Arc::from(name), params.clone());
        tracing::info!(policy = name, ?params, "routing policy changed");
        Ok(())
    }

    /// Registers a replica in the routing core (and in the published index, under the core's
    /// lock: a registry change may wait for an event batch being applied).
    ///
    /// # Errors
    /// [`RegistryError::Exists`], [`RegistryError::Config`] or [`RegistryError::Invalid`].
    pub fn add_replica(&self, config: ReplicaConfig) -> Result<ReplicaId, RegistryError> {
        config.validate()?;
        let endpoints = Arc::new(
            Endpoints::parse(&config.http)
                .map_err(|e| RegistryError::Invalid(e.to_string()))?
                .with_rank(config.data_parallel_rank),
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
        self.models.set_block_size(model, core.fleet.replica_block_size(id));
        for a in config.lora_adapters.iter().flatten() {
            // Validation keeps a declared adapter's name apart from the models.
            let _ = self.models.learn_adapter(a, config.model.as_deref());
        }
        let now = self.now();
        // Out of rotation from the start when the registry says so (set_rotation_ahead).
        let rotation = core.rotation_ahead.remove(&config.name).unwrap_or((false, false));
        let mut replica = Replica::new(id, config.clone(), endpoints, now, rotation);
        // What it starts as is no change of status (the supervisor's "replica added" says it).
        replica.reported = core.status(&replica, now);
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
