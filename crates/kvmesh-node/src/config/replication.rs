//! `[replication]`: hot-prefix detection and partial KV replication.

use serde::{Deserialize, Serialize};

/// `[replication]`: hot-prefix detection and partial KV replication (see
/// `kvmesh_core::replication`). Every node counts the prefixes it routes and gossips its
/// hottest; the Raft leader (or a single node) plans and sends warm-ups — prefill-only
/// requests with `max_tokens: 1` through the replica's OpenAI API, sent as token ids, so the
/// node needs the model's `tokenizer` (or engines that tokenize like kvmesh's approximate
/// scheme, such as kvmesh-engine-sim).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicationSection {
    /// Detect hot prefixes and replicate them. Off by default: warm-ups are requests kvmesh
    /// sends to your engines by itself.
    pub enabled: bool,
    /// How often the leader plans and sends warm-ups (and nodes gossip their counts),
    /// milliseconds.
    pub interval_ms: u64,
    /// Utilisation a hot prefix's holders should run at, in (0, 1]: a prefix carrying share
    /// `s` of the token load over `n` replicas is held on `s·n / target_utilisation`.
    pub target_utilisation: f64,
    /// A prefix needs at least this many requests per second (all nodes together) to be
    /// planned or stay planned.
    pub min_requests_per_s: f64,
    /// Fewest replicas a planned prefix is held on, ≥ 2.
    pub min_replicas: u32,
    /// A planned prefix cools when it needs fewer than `cool_ratio × its planned replicas`, in
    /// (0, 1).
    pub cool_ratio: f64,
    /// A prefix cool this long leaves the plan (and a manual trigger is pinned this long),
    /// seconds.
    pub cooldown_s: f64,
    /// Share of each replica's KV capacity the plan may fill with replicated prefixes, in [0, 1].
    pub memory_budget: f64,
    /// Most prefixes planned at once.
    pub max_prefixes: usize,
    /// Routers treat a planned target as holding its prefix this long after first seeing it
    /// planned, until its KV events confirm it, seconds.
    pub grace_ttl_s: f64,
    /// Warm-ups never take more than this share of a replica's prefill time, in (0, 1].
    pub warm_share: f64,
    /// A warm-up its target's KV events have not confirmed this long after it was sent is
    /// retried, seconds. The warm-up request itself (transfer call and prefill together) must
    /// finish within 90 % of it.
    pub warm_timeout_s: f64,
    /// Warm-ups per target before giving up on it.
    pub max_attempts: u32,
    /// Half-life of the prefix counts, seconds.
    pub half_life_s: f64,
    /// Prefixes each node's sketch keeps (memory holds at most twice as many; token ids only for
    /// the heaviest 256).
    pub sketch_capacity: usize,
    /// Prefixes a node gossips per report, every `interval_ms` (token ids go with the hottest 4
    /// only).
    pub report_top: usize,
    /// gRPC address (`http://host:port`) of a sidecar implementing
    /// `kvmesh.v1.ReplicationTransfer` (LMCache, NIXL, Mooncake store): called before warming
    /// with a prefill, which remains the fallback. Empty: prefill warm-ups only.
    pub transfer_endpoint: String,
}

impl Default for ReplicationSection {
    fn default() -> Self {
        let c = kvmesh_core::replication::ReplicationConfig::default();
        ReplicationSection {
            enabled: false,
            interval_ms: (c.interval_s * 1000.0) as u64,
            target_utilisation: c.target_utilisation,
            min_requests_per_s: c.min_requests_per_s,
            min_replicas: c.min_replicas,
            cool_ratio: c.cool_ratio,
            cooldown_s: c.cooldown_s,
            memory_budget: c.memory_budget,
            max_prefixes: c.max_prefixes,
            grace_ttl_s: c.grace_ttl_s,
            warm_share: c.warm_share,
            warm_timeout_s: c.warm_timeout_s,
            max_attempts: c.max_attempts,
            half_life_s: c.sketch.half_life_s,
            sketch_capacity: c.sketch.capacity,
            report_top: 16,
            transfer_endpoint: String::new(),
        }
    }
}

impl ReplicationSection {
    /// The core's settings.
    pub fn core(&self) -> kvmesh_core::replication::ReplicationConfig {
        let d = kvmesh_core::replication::ReplicationConfig::default();
        kvmesh_core::replication::ReplicationConfig {
            interval_s: self.interval_ms as f64 / 1000.0,
            target_utilisation: self.target_utilisation,
            min_requests_per_s: self.min_requests_per_s,
            min_replicas: self.min_replicas,
            cool_ratio: self.cool_ratio,
            cooldown_s: self.cooldown_s,
            memory_budget: self.memory_budget,
            max_prefixes: self.max_prefixes,
            grace_ttl_s: self.grace_ttl_s,
            warm_share: self.warm_share,
            warm_timeout_s: self.warm_timeout_s,
            max_attempts: self.max_attempts,
            sketch: kvmesh_core::replication::SketchConfig {
                capacity: self.sketch_capacity,
                half_life_s: self.half_life_s,
                ..d.sketch
            },
        }
    }

    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the `replication.` key.
    pub fn validate(&self) -> Result<(), String> {
        if self.interval_ms == 0 {
            return Err("replication.interval_ms must be positive".into());
        }
        if self.report_top == 0 {
            return Err("replication.report_top must be positive".into());
        }
        let e = &self.transfer_endpoint;
        if !(e.is_empty() || e.starts_with("http://") || e.starts_with("https://")) {
            return Err(format!(
                "replication.transfer_endpoint must be an http:// or https:// gRPC address, got {:?}",
                self.transfer_endpoint
            ));
        }
        self.core().validate().map_err(|e| format!("replication.{e}").replace("replication.invalid ", "replication."))
    }
}
