//! The node's configuration file (`kvmesh node --config kvmesh.toml`).
//!
//! ```toml
//! [node]
//! http = "0.0.0.0:8080"          # OpenAI-compatible proxy, /health, /metrics
//! grpc = "0.0.0.0:50051"         # kvmesh.v1 Router/Admin/Events, health, reflection
//! policy = "token_load"          # see `kvmesh policies`
//! block_size = 16                # tokens per KV block; must equal the engines' --block-size
//! model = "meta-llama/Llama-3.1-8B-Instruct"
//! tokenizer = "/models/llama-3.1-8b/tokenizer.json"   # optional: exact token ids
//!
//! [[replicas]]
//! name = "vllm-0"
//! http = "http://10.0.0.7:8000"
//! kv_events = "tcp://10.0.0.7:5557"   # vLLM --kv-events-config endpoint; omit: no events
//! replay = "tcp://10.0.0.7:5558"      # vLLM replay_endpoint; omit: resync by clearing
//! capacity_blocks = 29375             # vLLM logs "GPU KV cache size: N tokens"; N / block_size
//!
//! [cluster]                 # optional: run as one of 3 or 5 router nodes (Raft + gossip)
//! id = 1                    # this node's id, > 0, unique in the cluster
//! addr = "10.0.1.1:50051"   # its gRPC address as peers reach it (default: node.grpc)
//! peers = ["1=10.0.1.1:50051", "2=10.0.1.2:50051", "3=10.0.1.3:50051"]   # initial voters
//! data_dir = "/var/lib/kvmesh"   # Raft log and state machine (sled)
//! ```
//!
//! In a cluster the `[[replicas]]` list seeds the replicated registry at `kvmesh cluster init`;
//! from then on the registry (admin API, through the Raft leader) is what every node follows.

use kvmesh_core::{PolicyKind, Role};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::Path;

mod epp;
mod hints;
mod limits;
pub use epp::EppSection;
pub use limits::LimitsSection;

/// Everything a node runs with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Node-wide settings (every key has a default, so the section may be left out).
    #[serde(default)]
    pub node: NodeSection,
    /// The engine replicas to route to.
    #[serde(default)]
    pub replicas: Vec<ReplicaConfig>,
    /// Cluster membership; absent: a single node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterSection>,
    /// Bearer tokens for the admin and cluster-internal gRPC; absent: open.
    #[serde(default, skip_serializing_if = "is_default")]
    pub security: crate::auth::SecuritySection,
    /// Hot-prefix detection and partial KV replication; off unless `enabled`.
    #[serde(default)]
    pub replication: ReplicationSection,
    /// The tier's autoscaler; off unless `enabled`.
    #[serde(default)]
    pub autoscaler: AutoscalerSection,
    /// Admission control while capacity is short; off unless `enabled`.
    #[serde(default)]
    pub admission: AdmissionSection,
    /// Caps on what one replica, client or peer may cost the node.
    #[serde(default)]
    pub limits: LimitsSection,
    /// The Gateway API Inference Extension endpoint picker (Envoy ext_proc on the gRPC port).
    #[serde(default)]
    pub epp: EppSection,
}

/// `[admission]`: while capacity is short — no replica with KV headroom for a request, or
/// every one at `node.max_num_seqs`, or (with `ttft_slo_s`) none where it would meet its TTFT
/// SLO — requests wait in a bounded queue and are routed as capacity frees (smallest token
/// load first); beyond the bound or after `max_wait_s`: 429 with `Retry-After` (the seconds
/// the routable replicas need to serve the backlog at `autoscaler.capacity_tokens_per_s` each,
/// which is measured when left at 0, even with the autoscaler off).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionSection {
    /// Queue requests while capacity is short instead of sending them to full replicas.
    pub enabled: bool,
    /// Requests that may wait at once on this node (1 to 1,000,000); beyond, 429.
    pub queue_limit: usize,
    /// Longest a request waits before 429, seconds. With `ttft_slo_s`, late requests wait
    /// behind fresh ones and may wait this long under sustained overload: a few times the SLO
    /// bounds how late an answer can come.
    pub max_wait_s: f64,
    /// A TTFT SLO to hold requests to, seconds (unset: off). A request then also waits when
    /// its estimated TTFT on the best replica exceeds what is left of the SLO and more than
    /// half the SLO is queued there; requests that have waited less than half the SLO go
    /// before those that have waited longer (late ones), and a full queue refuses its largest
    /// late request instead of a new one. Why: engines serve in arrival order, so a queue
    /// longer than the SLO makes every request behind it late.
    pub ttft_slo_s: Option<f64>,
}

impl Default for AdmissionSection {
    fn default() -> Self {
        AdmissionSection { enabled: false, queue_limit: 256, max_wait_s: 30.0, ttft_slo_s: None }
    }
}

impl AdmissionSection {
    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the `admission.` key.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.max_wait_s > 0.0 && self.max_wait_s <= 86_400.0) {
            return Err(format!(
                "admission.max_wait_s must be positive seconds, at most a day, got {}",
                self.max_wait_s
            ));
        }
        // Each waiter is a parked request and its connection: a million is far past any node.
        if !(1..=1_000_000).contains(&self.queue_limit) {
            return Err(format!("admission.queue_limit must be 1 to 1000000 requests, got {}", self.queue_limit));
        }
        if let Some(slo) = self.ttft_slo_s {
            kvmesh_core::admission::TtftGate::new(slo)
                .map_err(|_| format!("admission.ttft_slo_s must be a positive, finite number of seconds, got {slo}"))?;
        }
        Ok(())
    }
}

/// `[autoscaler]`: the Raft leader (a single node: itself) decides how many replicas the
/// pool should have (`kvmesh_core::autoscale`: cold-start-aware, no cascade) and commits each
/// decision with its reason and inputs; `kvmesh.v1.Autoscaler` and KEDA's external-scaler
/// protocol serve them to an actuator. kvmesh does not start or stop engines itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AutoscalerSection {
    /// Decide and serve decisions.
    pub enabled: bool,
    /// The pool's name in decisions and the KEDA metric.
    pub pool: String,
    /// Seconds between decisions.
    pub interval_s: f64,
    /// Fewest replicas. 0 lets the pool scale to zero once no load arrives (KEDA's
    /// `IsActive` turns false), but not back: a request that finds no replica is refused
    /// before it counts as demand, so an operator (or KEDA's `minReplicaCount`) has to
    /// start the first one.
    pub min_replicas: u32,
    /// Most replicas.
    pub max_replicas: u32,
    /// Seconds a new replica takes to serve (until starts are measured from replicas
    /// registered `starting` that turn `ready`).
    pub cold_start_s: f64,
    /// Utilisation each replica should run at, in (0, 1].
    pub target_utilisation: f64,
    /// What one replica serves at full load, tokens per second; 0: measured from the engines'
    /// served-token counters (vLLM prompt − prefix-cache hits + generation tokens) while
    /// requests wait (at the engine, or at the router with `[admission]` while the engine runs
    /// full: `max_num_seqs` running or 90 % of its KV in use), and estimated from
    /// the engine profile until then. Admission control's `Retry-After` uses it too.
    pub capacity_tokens_per_s: f64,
    /// The pool shrinks only to the largest need of this last window, seconds; 0: one cold
    /// start (measured), the break-even of keeping an idle replica against restarting it.
    pub scale_down_delay_s: f64,
    /// A scale-down names the replicas to release (`drain` in the decision: starting ones
    /// first, then those with the fewest requests in flight and the least cache) and drains
    /// them in the same Raft entry, so no node routes to them; the actuator releases each
    /// once it is idle (`kvmesh replica drain --wait`). Leave it off when the actuator picks
    /// which engines go (KEDA scaling a Deployment: Kubernetes picks the pods, and a preStop
    /// hook drains each, see deploy/README.md). Turn it on only once every node runs a
    /// version that has it: an older node ignores the drain in the decision's entry.
    pub drain_on_scale_down: bool,
}

impl Default for AutoscalerSection {
    fn default() -> Self {
        let c = kvmesh_core::autoscale::AutoscaleConfig::default();
        AutoscalerSection {
            enabled: false,
            pool: "default".into(),
            interval_s: c.interval_s,
            min_replicas: c.min_replicas,
            max_replicas: c.max_replicas,
            cold_start_s: c.cold_start_s,
            target_utilisation: c.target_utilisation,
            capacity_tokens_per_s: 0.0,
            scale_down_delay_s: c.scale_down_delay_s,
            drain_on_scale_down: false,
        }
    }
}

impl AutoscalerSection {
    /// The core's settings.
    pub fn core(&self) -> kvmesh_core::autoscale::AutoscaleConfig {
        kvmesh_core::autoscale::AutoscaleConfig {
            interval_s: self.interval_s,
            min_replicas: self.min_replicas,
            max_replicas: self.max_replicas,
            cold_start_s: self.cold_start_s,
            target_utilisation: self.target_utilisation,
            scale_down_delay_s: self.scale_down_delay_s,
            ..kvmesh_core::autoscale::AutoscaleConfig::default()
        }
    }

    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the `autoscaler.` key.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.capacity_tokens_per_s.is_finite() && self.capacity_tokens_per_s >= 0.0) {
            return Err(format!("autoscaler.capacity_tokens_per_s must be ≥ 0, got {}", self.capacity_tokens_per_s));
        }
        self.core().validate().map_err(|e| match e {
            kvmesh_core::Error::InvalidConfig { field, reason } => format!("autoscaler.{field} {reason}"),
            other => format!("autoscaler: {other}"),
        })
    }
}

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

fn is_default(s: &crate::auth::SecuritySection) -> bool {
    *s == crate::auth::SecuritySection::default()
}

/// `[cluster]`: Raft between router nodes and shared bookings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSection {
    /// This node's Raft id, > 0.
    pub id: u64,
    /// Its gRPC address as the other nodes reach it (`host:port`); empty: `node.grpc`.
    pub addr: String,
    /// The initial voters, `id=host:port` each, this node included; `kvmesh cluster init`
    /// bootstraps them. A node that joins later lists none.
    pub peers: Vec<String>,
    /// Directory of the Raft log and state machine (sled); created if missing.
    pub data_dir: std::path::PathBuf,
    /// Share bookings with the other nodes.
    pub gossip: bool,
    /// Booking deltas are batched this long before they are sent, milliseconds.
    pub gossip_interval_ms: u64,
    /// A full summary of this node's live bookings goes out this often, milliseconds.
    pub summary_interval_ms: u64,
    /// A peer silent this long has its bookings dropped, milliseconds.
    pub peer_timeout_ms: u64,
    /// Raft heartbeat interval, milliseconds.
    pub heartbeat_ms: u64,
    /// Raft election timeout, a random value in [min, max), milliseconds.
    pub election_timeout_min_ms: u64,
    /// See `election_timeout_min_ms`.
    pub election_timeout_max_ms: u64,
    /// A snapshot is taken (and the log before it purged) after this many new log entries.
    pub snapshot_every: u64,
    /// Accept `Cluster.InjectFault` (`kvmesh cluster fault`): tests and chaos runs only.
    pub allow_fault_injection: bool,
    /// Run the cluster without authentication: anyone who reaches the gRPC port can then
    /// send Raft and gossip messages and write the registry. Without it a node in a cluster
    /// refuses to start unless it has a cluster token (`[security] cluster_token_file` or
    /// `KVMESH_CLUSTER_TOKEN`) or mTLS (`tls_client_auth`); with it, it warns at every start.
    /// `kvmesh node --insecure` sets it.
    pub insecure: bool,
}

impl Default for ClusterSection {
    fn default() -> Self {
        ClusterSection {
            id: 0,
            addr: String::new(),
            peers: Vec::new(),
            data_dir: "kvmesh-data".into(),
            gossip: true,
            gossip_interval_ms: 5,
            summary_interval_ms: 1000,
            peer_timeout_ms: 5000,
            heartbeat_ms: 100,
            election_timeout_min_ms: 300,
            election_timeout_max_ms: 600,
            snapshot_every: 1000,
            allow_fault_injection: false,
            insecure: false,
        }
    }
}

impl ClusterSection {
    /// `peers` as (id, address) pairs.
    ///
    /// # Errors
    /// An entry that is not `id=host:port` with a positive id, or an id listed twice.
    pub fn peer_map(&self) -> Result<std::collections::BTreeMap<u64, String>, String> {
        let mut out = std::collections::BTreeMap::new();
        for p in &self.peers {
            let (id, addr) = p.split_once('=').ok_or_else(|| format!("cluster.peers: {p:?} is not id=host:port"))?;
            let id: u64 = id.trim().parse().map_err(|_| format!("cluster.peers: {p:?}: the id is not a number"))?;
            if id == 0 || addr.trim().is_empty() || !addr.contains(':') {
                return Err(format!("cluster.peers: {p:?} is not id=host:port with id > 0"));
            }
            if out.insert(id, addr.trim().to_string()).is_some() {
                return Err(format!("cluster.peers: id {id} appears twice"));
            }
        }
        Ok(out)
    }

    /// Checks this node's own entry in `peers` against where it serves gRPC (`grpc_port`, the
    /// bound port) and `addr`: peers dial that entry, so a typo there cuts the node off.
    ///
    /// # Errors
    /// The entry differs from `addr` when `addr` is set, or names another port when it is not.
    pub fn check_own_peer(&self, grpc_port: u16) -> Result<(), String> {
        let peers = self.peer_map()?;
        let Some(own) = peers.get(&self.id) else { return Ok(()) };
        let port = own.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok());
        let wrong = if self.addr.is_empty() { port != Some(grpc_port) } else { *own != self.addr };
        if wrong {
            let serves = if self.addr.is_empty() { format!("port {grpc_port}") } else { self.addr.clone() };
            return Err(format!(
                "cluster.peers lists this node (id {}) at {own}, but it serves gRPC on {serves}: peers would dial the \
                 wrong address; fix its entry in peers (or cluster.addr)",
                self.id
            ));
        }
        Ok(())
    }
}

/// `[node]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeSection {
    /// HTTP listen address (OpenAI proxy, `/health`, `/metrics`).
    pub http: SocketAddr,
    /// gRPC listen address.
    pub grpc: SocketAddr,
    /// Routing policy name.
    pub policy: String,
    /// The policy's parameters by name (the fields of its `…Params` in kvmesh-core, e.g.
    /// `{ move_weight = 0.5 }` for token_load); unset ones keep their defaults.
    pub policy_params: std::collections::BTreeMap<String, f64>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The default served model (vLLM `--served-model-name`): replicas that declare no
    /// `model` of their own serve it, and requests that name no model, or this one, are
    /// routed among them. A request naming a replica's declared model goes to that model's
    /// replicas only; any other name gets 404. Empty: any name no replica declares is taken
    /// as the default model.
    pub model: String,
    /// LoRA adapters of `node.model` (vLLM `--lora-modules NAME=PATH`; clients ask for one by
    /// `model: NAME`), askable before any engine lists them. A request for an adapter is
    /// routed on the prefix overlap of blocks stored under it only (vLLM's block hash and its
    /// `BlockStored.lora_name` include the adapter), never the base model's, and only to
    /// replicas serving it (`[[replicas]] lora_adapters`, else learned from each engine's
    /// `/v1/models`). gRPC `Route` takes the adapter in `lora_name` (any name when this list
    /// is empty and no engine listed it).
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    /// Engine metrics scrape (and health check) interval, milliseconds.
    pub scrape_interval_ms: u64,
    /// Consecutive failed scrapes or connects before a replica is unhealthy.
    pub unhealthy_after: u32,
    /// How long a 429/503 from a replica keeps it out of rotation, milliseconds.
    pub overload_backoff_ms: u64,
    /// Other replicas tried after a connect failure or backpressure answer.
    pub retries: u32,
    /// Upper bound on one proxied request, seconds.
    pub request_timeout_s: u64,
    /// A booking not released ends by itself this long after it was made or after its first
    /// token, seconds (at most a day): the load of a gRPC `Route` caller that never calls
    /// `Release` (or crashed) stops counting then. Keep it at least `request_timeout_s`, or
    /// long proxied requests stop counting while they run.
    pub booking_lease_s: f64,
    /// On shutdown (SIGTERM, Ctrl-C), the node first stops reporting ready (`/health` 503,
    /// gRPC health `NOT_SERVING`, so load balancers and gateways send elsewhere) and lets the
    /// requests it follows — proxied, or picked for a gateway — finish, for at most this long,
    /// seconds (0 to 3,600); then it stops, cutting what is left. Keep the pod's
    /// `terminationGracePeriodSeconds` above it.
    pub shutdown_grace_s: f64,
    /// Expect a request that gives `max_tokens` to produce what completed requests whose first
    /// 4 KV blocks of prompt match produced (once 4 have), re-estimated as a streamed answer
    /// decodes, instead of booking its whole `max_tokens` as decode work and KV. RL trainers and
    /// agents send a `max_tokens` far above their outputs; booked whole it made every replica
    /// look full (BENCHMARKS.md, decode-heavy traffic). Off: `max_tokens` is booked as given
    /// (a client's `x-kvmesh-expected-output-tokens` hint still wins).
    pub learn_output_lengths: bool,
    /// A replica that owes a KV event this long (a request filled KV blocks it did not hold,
    /// and no event came since the request began) is reported `no_events`, seconds.
    pub events_silent_s: f64,
    /// A replica whose engine served no token this long (its served-token counter standing
    /// still at every scrape) while this node's proxy had requests in flight on it at every
    /// scrape is reported `unhealthy` (hung: an engine whose metrics endpoint still answers),
    /// seconds; 0: off. It is routed around until the counter moves, or tried again once
    /// nothing of this node's was in flight on it for this long. vLLM pages only (its prompt
    /// and generation token totals move every step; vLLM counts a prompt when its first token
    /// comes, so keep this above the longest prefill); at least twice the scrape interval.
    pub hung_after_s: f64,
    /// How long to wait for each replay reply, milliseconds.
    pub replay_timeout_ms: u64,
    /// The model's `tokenizer.json` (Hugging Face format): prompts are routed on the engine's
    /// real token ids, and chats rendered with the `chat_template` of the
    /// `tokenizer_config.json` beside it. Without one, on kvmesh's approximate ids
    /// (`kvmesh_core::prompt`), which match only engines using the same scheme
    /// (kvmesh-engine-sim).
    pub tokenizer: Option<std::path::PathBuf>,
    /// The engines' step-time profile the token-load estimates use: `h100` or `a100`
    /// (Llama-3-8B under vLLM; see `kvmesh_core::load::ReplicaProfile`).
    pub engine_profile: String,
    /// Longest prompt the proxy routes, tokens; longer ones get 413 before any work (the
    /// request body itself is capped at 64 MiB).
    pub max_prompt_tokens: u32,
    /// Time compression of the engines: step times are divided by this. 1 for real engines;
    /// kvmesh-engine-sim's `--speed` for stand-in ones (`kvmesh demo` sets it).
    pub engine_speed: f64,
    /// Most sequences each engine runs at once: vLLM's `--max-num-seqs`, SGLang's
    /// `--max-running-requests`. A replica at this many requests makes new ones wait for a
    /// slot, and `token_load` counts that wait.
    pub max_num_seqs: u32,
    /// Threads serving the HTTP proxy, on a runtime of their own with their own connections
    /// to the engines (KV events, gRPC, Raft and scrapes run on the main runtime, `--workers`).
    /// Request bodies of 16 KiB and more are parsed and tokenized on a blocking pool either
    /// way. 2 (the default): a request that is slow anyway (a chat template, a `/metrics`
    /// page) holds up only its thread. 1 keeps every hand-off on one thread: a little less CPU
    /// per request, and more requests/s on a small machine. Raise it on machines with cores
    /// to spare for the proxy.
    pub proxy_threads: u32,
}

impl NodeSection {
    /// `policy_params` as the list `PolicyKind::build_with` takes.
    pub fn params(&self) -> Vec<(String, f64)> {
        self.policy_params.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// The step-time profile for token-load estimates, with `engine_speed` applied.
    ///
    /// # Errors
    /// An unknown profile name or a non-positive speed.
    pub fn replica_profile(&self) -> Result<kvmesh_core::load::ReplicaProfile, String> {
        let base = match self.engine_profile.as_str() {
            "h100" => kvmesh_core::load::ReplicaProfile::H100_LLAMA3_8B,
            "a100" => kvmesh_core::load::ReplicaProfile::A100_LLAMA3_8B,
            other => return Err(format!("node.engine_profile: unknown profile {other:?} (use h100 or a100)")),
        };
        if !(self.engine_speed.is_finite() && self.engine_speed > 0.0) {
            return Err(format!("node.engine_speed must be a positive number, got {}", self.engine_speed));
        }
        if self.max_num_seqs == 0 {
            return Err("node.max_num_seqs must be positive".into());
        }
        let s = self.engine_speed;
        Ok(kvmesh_core::load::ReplicaProfile {
            prefill_s_per_token: base.prefill_s_per_token / s,
            decode_s_per_token: base.decode_s_per_token / s,
            step_overhead_s: base.step_overhead_s / s,
            chunk_tokens: base.chunk_tokens,
            max_num_seqs: self.max_num_seqs,
        })
    }
}

impl Default for NodeSection {
    fn default() -> Self {
        NodeSection {
            http: SocketAddr::from(([0, 0, 0, 0], 8080)),
            grpc: SocketAddr::from(([0, 0, 0, 0], 50051)),
            policy: "token_load".into(),
            policy_params: Default::default(),
            block_size: 16,
            model: String::new(),
            lora_adapters: Vec::new(),
            scrape_interval_ms: 1000,
            unhealthy_after: 3,
            overload_backoff_ms: 2000,
            retries: 2,
            request_timeout_s: 600,
            booking_lease_s: 600.0,
            shutdown_grace_s: 30.0,
            learn_output_lengths: true,
            events_silent_s: 30.0,
            hung_after_s: 60.0,
            replay_timeout_ms: 1000,
            tokenizer: None,
            engine_profile: "h100".into(),
            max_prompt_tokens: 1 << 20,
            engine_speed: 1.0,
            max_num_seqs: 256,
            proxy_threads: 2,
        }
    }
}

/// One `[[replicas]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Unique name.
    pub name: String,
    /// Base URL of its OpenAI API (`http://host:port`, optionally with a path prefix). Plain
    /// HTTP only: `https://` is refused at load (the node's engine client has no TLS).
    pub http: String,
    /// Its KV-event publisher endpoint (`tcp://host:port`; `tcp://*:port` with
    /// `kv_events_bind`); `None`: it publishes none. Other transports (`ipc://`) are refused
    /// at load.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its replay endpoint (`tcp://host:port`); `None`: gaps are recovered by dropping its
    /// blocks.
    #[serde(default)]
    pub replay: Option<String>,
    /// Bind the event endpoint instead of connecting (when the engine connects to the router).
    #[serde(default)]
    pub kv_events_bind: bool,
    /// Its Prometheus metrics URL; default `<http>/metrics`.
    #[serde(default)]
    pub metrics_url: Option<String>,
    /// KV-cache capacity, blocks.
    pub capacity_blocks: u64,
    /// `vllm` or `sglang`. Both event formats are read either way; for a `prefill` or
    /// `decode` replica it decides how a disaggregated request is handed between its sides
    /// (vLLM's `kv_transfer_params`, SGLang's bootstrap room) and must be one of the two.
    #[serde(default = "default_engine")]
    pub engine: String,
    /// The model it serves (vLLM `--served-model-name`); default `node.model`. Requests for a
    /// model are routed only among the replicas serving it, on the prefix overlap of that
    /// model's blocks only (its KV events are hashed in the model's namespace). Several
    /// models may share one node; they share its tokenizer (each may have its own
    /// `block_size`), and replication warms `node.model`'s replicas only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The LoRA adapters it serves (vLLM `--lora-modules NAME=PATH`, or loaded at run time
    /// with `/v1/load_lora_adapter`). A request for an adapter goes only to replicas serving
    /// it. Default: learned from the engine's `/v1/models` (the entries with a `parent`),
    /// asked at start and every 10 s; until an answer comes, or when the engine lists no
    /// adapter at all (SGLang does not list them), the replica is taken to serve every adapter
    /// a request names. A declared empty list means it serves none (through the admin API an
    /// empty list means: learn them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_adapters: Option<Vec<String>>,
    /// Its KV block size (vLLM `--block-size`), tokens; default `node.block_size`. A replica
    /// of `node.model` must have `node.block_size`; another model may have its own, shared by
    /// all its replicas (its events, requests and KV are then counted in its blocks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// This entry is one data-parallel rank of an engine serving several behind one API
    /// server (vLLM `--data-parallel-size`), routed, indexed and loaded as a replica of its
    /// own: requests sent to it carry `X-data-parallel-rank: <rank>` (vLLM's API server then
    /// schedules them on that rank), its load is read from the `/metrics` series labelled
    /// `engine="<rank>"` (or `dp_rank`), and `kv_events`/`replay` are that rank's own
    /// publisher's (vLLM binds rank k's at the configured ports + k). Usually written for you
    /// by `data_parallel_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_rank: Option<u32>,
    /// Shorthand for an engine's N data-parallel ranks: at load this entry becomes N entries
    /// `<name>-dp<k>` (k = 0…N−1), each with `data_parallel_rank = k`, `kv_events` and
    /// `replay` at the given ports + k (vLLM's `ZmqEventPublisher.offset_endpoint_port`,
    /// vllm/distributed/kv_events.py) and `capacity_blocks` each (one rank's KV, as that
    /// rank logs it). 1..=1024.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_size: Option<u32>,
    /// Its part in prefill/decode-disaggregated serving: `both` (default: it serves requests
    /// whole), `prefill` or `decode` (vLLM: a KV connector such as `NixlConnector` in
    /// `--kv-transfer-config`; SGLang: `--disaggregation-mode`). While a model has a routable
    /// replica of each side, each of its requests goes to one prefill and one decode replica,
    /// picked together (prefill by the node's policy — token load with prefix overlap by
    /// default — decode by KV headroom, then decode load); otherwise its `both` replicas serve
    /// it whole.
    #[serde(default, skip_serializing_if = "Role::is_both")]
    pub role: Role,
    /// A `prefill` replica of `engine = "sglang"`: its disaggregation bootstrap port
    /// (SGLang `--disaggregation-bootstrap-port`), sent to both sides as `bootstrap_port`.
    /// Default 8998, SGLang's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Most data-parallel ranks one `[[replicas]]` entry may stand for.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 1024;

fn default_engine() -> String {
    "vllm".into()
}

impl ReplicaConfig {
    /// This entry as the replicas it stands for: itself, or with `data_parallel_size` N one
    /// entry per rank (see [`ReplicaConfig::data_parallel_size`]).
    ///
    /// # Errors
    /// A size of 0 or over [`MAX_DATA_PARALLEL_SIZE`], a size beside a rank, or an endpoint
    /// whose port cannot be offset (no port, or past 65535).
    pub fn ranks(&self) -> Result<Vec<ReplicaConfig>, String> {
        let Some(size) = self.data_parallel_size else { return Ok(vec![self.clone()]) };
        let bad = |what: String| Err(format!("replica {:?}: {what}", self.name));
        if size == 0 || size > MAX_DATA_PARALLEL_SIZE {
            return bad(format!("data_parallel_size must be 1..={MAX_DATA_PARALLEL_SIZE}, got {size}"));
        }
        if self.data_parallel_rank.is_some() {
            return bad(
                "data_parallel_size and data_parallel_rank exclude each other (the size writes the ranks)".into()
            );
        }
        let mut out = Vec::with_capacity(size as usize);
        for k in 0..size {
            let offset = |field: &str, ep: &Option<String>| match ep {
                Some(ep) => kvmesh_events::offset_endpoint_port(ep, k)
                    .map(Some)
                    .map_err(|e| format!("replica {:?}: {field} {e}", self.name)),
                None => Ok(None),
            };
            out.push(ReplicaConfig {
                name: format!("{}-dp{k}", self.name),
                kv_events: offset("kv_events", &self.kv_events)?,
                replay: offset("replay", &self.replay)?,
                data_parallel_rank: Some(k),
                data_parallel_size: None,
                ..self.clone()
            });
        }
        // vLLM moves both ports up by the rank: two ports fewer than `size` apart put one
        // rank's publisher on another's replay socket.
        let mut seen = std::collections::HashSet::new();
        for ep in out.iter().flat_map(|r| r.kv_events.iter().chain(r.replay.iter())) {
            if !seen.insert(ep.as_str()) {
                return bad(format!(
                    "with data_parallel_size {size}, {ep} is both a publisher and a replay socket (vLLM adds the \
                     rank to both ports): keep kv_events and replay at least {size} ports apart"
                ));
            }
        }
        Ok(out)
    }

    /// The metrics URL to scrape.
    pub fn metrics(&self) -> String {
        self.metrics_url.clone().unwrap_or_else(|| format!("{}/metrics", self.http.trim_end_matches('/')))
    }

    /// Checks the fields a node cannot run without.
    ///
    /// # Errors
    /// A message naming the replica and the field.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |what: &str| Err(format!("replica {:?}: {what}", self.name));
        if self.name.is_empty() {
            return Err("a replica has an empty name".into());
        }
        if self.http.starts_with("https://") {
            // Accepting it would fail every request later: the node's engine client is built
            // without a TLS backend.
            return bad(&format!(
                "http {:?}: https:// engines are not supported (the node talks plain HTTP to engines); \
                 use the engine's http:// address on the pod network, or a TLS-terminating sidecar beside it",
                self.http
            ));
        }
        if !self.http.starts_with("http://") {
            return bad(&format!("http must be an http:// URL, got {:?}", self.http));
        }
        if let Err(e) = crate::replica::endpoints::Endpoints::parse(&self.http) {
            return bad(&format!("http: {e}"));
        }
        for (field, ep) in [("kv_events", &self.kv_events), ("replay", &self.replay)] {
            if let Some(ep) = ep {
                // What the frame guard will need at start; checked here, since at start a bad
                // endpoint would fail the replica's actor again and again.
                if let Err(e) = crate::replica::frame_guard::tcp_address(ep) {
                    return bad(&format!("{field} {e}"));
                }
            }
        }
        if self.capacity_blocks == 0 {
            return bad("capacity_blocks must be positive");
        }
        if self.data_parallel_size.is_some() {
            return bad("data_parallel_size is expanded into ranks when the file is read; register each rank (data_parallel_rank) through the API");
        }
        if self.data_parallel_rank.is_some_and(|k| k >= MAX_DATA_PARALLEL_SIZE) {
            return bad(&format!("data_parallel_rank must be below {MAX_DATA_PARALLEL_SIZE}"));
        }
        // Informational for a replica serving whole requests; the hand-over of a disaggregated
        // one depends on it.
        if self.role != Role::Both && self.engine != "vllm" && self.engine != "sglang" {
            return bad(&format!(
                "engine must be vllm or sglang for a {} replica (it decides the hand-over), got {:?}",
                self.role.as_str(),
                self.engine
            ));
        }
        if self.bootstrap_port.is_some() && (self.engine != "sglang" || self.role != Role::Prefill) {
            return bad("bootstrap_port is for a prefill replica of engine = \"sglang\" only");
        }
        for (i, a) in self.lora_adapters.iter().flatten().enumerate() {
            if a.is_empty() || Some(a) == self.model.as_ref() {
                return bad(&format!("lora_adapters: {a:?} is empty or the replica's model"));
            }
            if self.lora_adapters.iter().flatten().take(i).any(|b| b == a) {
                return bad(&format!("lora_adapters: {a:?} appears twice"));
            }
        }
        Ok(())
    }
}

impl NodeConfig {
    /// Replaces every entry with a `data_parallel_size` by its ranks
    /// ([`ReplicaConfig::ranks`]), in place.
    ///
    /// # Errors
    /// As [`ReplicaConfig::ranks`].
    pub fn expand_data_parallel(&mut self) -> Result<(), String> {
        let mut out = Vec::with_capacity(self.replicas.len());
        for r in &self.replicas {
            out.extend(r.ranks()?);
        }
        self.replicas = out;
        Ok(())
    }

    /// Reads and validates a TOML file.
    ///
    /// # Errors
    /// The file cannot be read, is not valid TOML for this schema (with the line), or fails
    /// [`NodeConfig::validate`].
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let config = Self::read(path)?;
        config.validate().map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(config)
    }

    /// Reads a TOML file without validating it (command-line flags complete it first).
    ///
    /// # Errors
    /// The file cannot be read or is not valid TOML for this schema (with the line).
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        let mut config: NodeConfig = toml::from_str(&text).map_err(|e| {
            anyhow::anyhow!("{}: {}{}", path.display(), e.to_string().trim_end(), hints::hint(&e, &text))
        })?;
        config.expand_data_parallel().map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(config)
    }

    /// Valid but probably not meant: each a line for the start-up log.
    pub fn doubts(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.replicas.is_empty() && self.cluster.is_none() {
            out.push(
                "no [[replicas]] configured: the node routes nothing until replicas are added (`kvmesh replica add`, \
                 or [[replicas]] in this file and SIGHUP)"
                    .into(),
            );
        }
        let wanted = self
            .node
            .policy
            .parse::<PolicyKind>()
            .ok()
            .and_then(|k| k.build_with(&self.node.params()).ok())
            .and_then(|p| p.scrape_interval_s().map(|s| (p.name(), s)));
        if let Some((policy, s)) = wanted {
            let ms = (s * 1e3).round() as u64;
            if self.node.scrape_interval_ms > ms {
                out.push(format!(
                    "policy {policy} reproduces a router that reads engine metrics every {ms} ms; node.scrape_interval_ms \
                     is {}, so it scores on older gauges than that router would (set node.scrape_interval_ms = {ms} to match)",
                    self.node.scrape_interval_ms
                ));
            }
        }
        // Before 2026-12-06 a replica's `model` was informational; now it is the model it
        // serves, and a request is routed among its model's replicas only.
        let mut others: Vec<&str> = self
            .replicas
            .iter()
            .filter_map(|r| r.model.as_deref())
            .filter(|m| !m.is_empty() && *m != self.node.model)
            .collect();
        others.sort_unstable();
        others.dedup();
        if !others.is_empty() {
            out.push(format!(
                "replicas declare models other than node.model ({:?}): {others:?}; each serves only requests naming its \
                 model (a request naming none goes to node.model's replicas)",
                self.node.model
            ));
        }
        // A disaggregated model needs both sides: one alone serves nothing.
        for (model, (prefill, decode)) in self.sides() {
            if prefill == 0 || decode == 0 {
                let (has, lacks) = if prefill > 0 { ("prefill", "decode") } else { ("decode", "prefill") };
                out.push(format!(
                    "model {model:?} has {has} replicas but no {lacks} replica: its requests go to its `both` replicas \
                     only, and the {has} replicas serve nothing until a {lacks} replica is added"
                ));
            }
        }
        let a = &self.autoscaler;
        if a.enabled && self.replicas.len() > a.max_replicas as usize {
            out.push(format!(
                "autoscaler.max_replicas ({}) is below the {} replicas configured: no decision asks for more than {}",
                a.max_replicas,
                self.replicas.len(),
                a.max_replicas
            ));
        }
        out
    }

    /// Per model with disaggregated replicas: how many prefill and decode replicas it has.
    fn sides(&self) -> std::collections::BTreeMap<&str, (usize, usize)> {
        let mut sides = std::collections::BTreeMap::<&str, (usize, usize)>::new();
        for r in self.replicas.iter().filter(|r| r.role != Role::Both) {
            let e = sides.entry(r.model.as_deref().unwrap_or(&self.node.model)).or_default();
            if r.role == Role::Prefill {
                e.0 += 1;
            } else {
                e.1 += 1;
            }
        }
        sides
    }

    /// Checks values and combinations.
    ///
    /// # Errors
    /// A message naming the field.
    pub fn validate(&self) -> Result<(), String> {
        // One hand-over per model: a prefill replica's engine decides it, so a decode replica
        // of another engine would receive fields it does not read.
        let mut engines = std::collections::BTreeMap::<&str, (&str, &str)>::new();
        for r in self.replicas.iter().filter(|r| r.role != Role::Both) {
            let model = r.model.as_deref().unwrap_or(&self.node.model);
            let (first, name) = *engines.entry(model).or_insert((r.engine.as_str(), r.name.as_str()));
            if first != r.engine {
                return Err(format!(
                    "model {model:?}: replica {:?} has engine {:?} but replica {name:?} has {first:?}; a disaggregated \
                     model's prefill and decode replicas must run one engine (it decides the hand-over)",
                    r.name, r.engine
                ));
            }
        }
        let kind = self.node.policy.parse::<PolicyKind>().map_err(|e| format!("node.policy: {e}"))?;
        kind.build_with(&self.node.params()).map_err(|e| format!("node.policy_params: {e}"))?;
        if self.node.block_size == 0 {
            return Err("node.block_size must be positive".into());
        }
        self.node.replica_profile()?;
        if self.node.proxy_threads == 0 {
            return Err("node.proxy_threads must be at least 1".into());
        }
        if self.node.scrape_interval_ms == 0 {
            return Err("node.scrape_interval_ms must be positive".into());
        }
        let hung = self.node.hung_after_s;
        let scrape_s = self.node.scrape_interval_ms as f64 / 1e3;
        if !(hung.is_finite() && (hung == 0.0 || hung >= 2.0 * scrape_s)) {
            return Err(format!(
                "node.hung_after_s must be 0 (off) or at least twice node.scrape_interval_ms ({} s), got {hung}",
                2.0 * scrape_s
            ));
        }
        let mut adapters = std::collections::HashSet::new();
        for a in &self.node.lora_adapters {
            if a.is_empty() || *a == self.node.model {
                return Err(format!("node.lora_adapters: {a:?} is empty or the base model's name"));
            }
            if !adapters.insert(a) {
                return Err(format!("node.lora_adapters: {a:?} appears twice"));
            }
        }
        // A model named like an adapter could never be asked for: the adapter wins the name.
        if let Some(r) = self.replicas.iter().find(|r| r.model.as_ref().is_some_and(|m| adapters.contains(m))) {
            return Err(format!(
                "replica {:?}: model {:?} is also one of node.lora_adapters; a request naming it would get the adapter",
                r.name,
                r.model.as_deref().unwrap_or_default()
            ));
        }
        let grace = self.node.shutdown_grace_s;
        if !(0.0..=3600.0).contains(&grace) {
            return Err(format!("node.shutdown_grace_s must be 0 to 3600 seconds, got {grace}"));
        }
        let lease = self.node.booking_lease_s;
        if !(lease > 0.0 && lease <= 86_400.0) {
            return Err(format!("node.booking_lease_s must be positive seconds, at most a day, got {lease}"));
        }
        self.replication.validate()?;
        self.autoscaler.validate()?;
        self.admission.validate()?;
        self.limits.validate()?;
        self.epp.validate()?;
        if let Some(c) = &self.cluster {
            if c.id == 0 {
                return Err("cluster.id must be positive (or --id / KVMESH_NODE_ID)".into());
            }
            let peers = c.peer_map()?;
            if !peers.is_empty() && !peers.contains_key(&c.id) {
                return Err(format!("cluster.peers must include this node (id {})", c.id));
            }
            if c.election_timeout_min_ms <= c.heartbeat_ms || c.election_timeout_max_ms <= c.election_timeout_min_ms {
                return Err("cluster: need heartbeat_ms < election_timeout_min_ms < election_timeout_max_ms".into());
            }
            if c.peer_timeout_ms <= 2 * c.summary_interval_ms {
                return Err("cluster: peer_timeout_ms must exceed twice summary_interval_ms (an idle peer is heard only through summaries)".into());
            }
            if c.gossip_interval_ms == 0 || c.summary_interval_ms == 0 || c.snapshot_every == 0 {
                return Err(
                    "cluster: gossip_interval_ms, summary_interval_ms and snapshot_every must be positive".into()
                );
            }
        }
        let mut names = std::collections::HashSet::new();
        // One block size per model; node.model's is node.block_size.
        let mut sizes: std::collections::HashMap<&str, (u32, &str)> = std::collections::HashMap::new();
        for r in &self.replicas {
            r.validate()?;
            let model = r.model.as_deref().filter(|m| !m.is_empty()).unwrap_or(&self.node.model);
            let bs = r.block_size.unwrap_or(self.node.block_size);
            if model == self.node.model && bs != self.node.block_size {
                return Err(format!(
                    "replica {:?}: block_size {bs} differs from node.block_size {} (a replica of node.model has its \
                     block size; another model may have its own)",
                    r.name, self.node.block_size
                ));
            }
            for a in r.lora_adapters.iter().flatten() {
                let taken = *a == self.node.model
                    || self.replicas.iter().any(|o| o.model.as_deref() == Some(a.as_str()))
                    || self.node.lora_adapters.iter().any(|n| n == a) && model != self.node.model;
                if taken {
                    return Err(format!(
                        "replica {:?}: lora_adapters: {a:?} is a model's name (or node.model's adapter) here",
                        r.name
                    ));
                }
            }
            match sizes.get(model) {
                Some(&(other, first)) if other != bs => {
                    return Err(format!(
                        "replica {:?}: block_size {bs} differs from replica {first:?}'s {other}: the replicas of model \
                         {model:?} must share one block size",
                        r.name
                    ))
                }
                _ => {
                    sizes.insert(model, (bs, &r.name));
                }
            }
            if !names.insert(&r.name) {
                return Err(format!("replica name {:?} appears twice", r.name));
            }
        }
        Ok(())
    }

    /// The configuration as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot render: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
[node]
http = "127.0.0.1:8080"
policy = "kv_cost"

[[replicas]]
name = "vllm-0"
http = "http://10.0.0.7:8000"
kv_events = "tcp://10.0.0.7:5557"
capacity_blocks = 100
"#;

    #[test]
    fn doubts_name_a_node_with_no_replicas_and_a_cap_below_the_fleet() {
        let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
        assert_eq!(c.doubts(), Vec::<String>::new());
        c.autoscaler.enabled = true;
        c.autoscaler.max_replicas = 1;
        let mut second = c.replicas[0].clone();
        second.name = "vllm-1".into();
        c.replicas.push(second);
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(
            c.doubts(),
            ["autoscaler.max_replicas (1) is below the 2 replicas configured: no decision asks for more than 1"]
        );
        c.node.policy = "weighted_scorer".into();
        assert_eq!(
            c.doubts()[0],
            "policy weighted_scorer reproduces a router that reads engine metrics every 50 ms; node.scrape_interval_ms \
             is 1000, so it scores on older gauges than that router would (set node.scrape_interval_ms = 50 to match)"
        );
        c.node.scrape_interval_ms = 50;
        c.node.hung_after_s = 60.0;
        assert_eq!(c.doubts().len(), 1, "only the autoscaler's doubt is left");
        let empty: NodeConfig = toml::from_str("").unwrap();
        assert_eq!(empty.doubts().len(), 1);
        assert!(empty.doubts()[0].starts_with("no [[replicas]] configured: the node routes nothing"));
        // A cluster node gets its replicas from the registry.
        let joining: NodeConfig = toml::from_str("[cluster]\nid = 2\n").unwrap();
        assert_eq!(joining.doubts(), Vec::<String>::new());
    }

    #[test]
    fn parses_with_defaults_and_validates() {
        let c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
        assert_eq!((c.node.policy.as_str(), c.node.block_size, c.node.grpc.port()), ("kv_cost", 16, 50051));
        assert_eq!(c.replicas[0].metrics(), "http://10.0.0.7:8000/metrics");
        assert_eq!((c.replicas[0].replay.as_deref(), c.replicas[0].engine.as_str()), (None, "vllm"));
        c.validate().unwrap();
        let back: NodeConfig = toml::from_str(&c.to_toml()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn autoscaler_settings_are_checked_in_the_same_words() {
        let with = |extra: &str| toml::from_str::<NodeConfig>(&format!("{EXAMPLE}\n[autoscaler]\n{extra}\n")).unwrap();
        assert_eq!(
            with("target_utilisation = 2").validate().unwrap_err(),
            "autoscaler.target_utilisation must be in (0, 1], got 2"
        );
        assert_eq!(
            with("min_replicas = 3\nmax_replicas = 2").validate().unwrap_err(),
            "autoscaler.max_replicas must be positive and at least min_replicas (3), got 2"
        );
    }

    #[test]
    fn admission_settings_are_checked() {
        let with = |extra: &str| toml::from_str::<NodeConfig>(&format!("{EXAMPLE}\n[admission]\n{extra}\n")).unwrap();
        let c = with("enabled = true\nttft_slo_s = 2.5");
        assert_eq!(c.admission.ttft_slo_s, Some(2.5));
        c.validate().unwrap();
        assert_eq!(
            with("ttft_slo_s = 0").validate().unwrap_err(),
            "admission.ttft_slo_s must be a positive, finite number of seconds, got 0"
        );
        assert_eq!(
            with("max_wait_s = -1").validate().unwrap_err(),
            "admission.max_wait_s must be positive seconds, at most a day, got -1"
        );
        assert!(with("max_wait_s = 1e19").validate().is_err());
        assert_eq!(
            with("queue_limit = 0").validate().unwrap_err(),
            "admission.queue_limit must be 1 to 1000000 requests, got 0"
        );
        with("queue_limit = 1000000").validate().unwrap();
        let lease = |v: &str| {
            let text = EXAMPLE.replacen("[node]\n", &format!("[node]\nbooking_lease_s = {v}\n"), 1);
            toml::from_str::<NodeConfig>(&text).unwrap().validate()
        };
        assert_eq!(lease("0").unwrap_err(), "node.booking_lease_s must be positive seconds, at most a day, got 0");
        lease("30").unwrap();
        assert_eq!(toml::from_str::<NodeConfig>(EXAMPLE).unwrap().admission.ttft_slo_s, None);
    }

    #[test]
    fn a_data_parallel_size_becomes_one_replica_per_rank_at_the_offset_ports() {
        let entry = |extra: &str| {
            let text = format!(
                "name = \"v\"\nhttp = \"http://10.0.0.7:8000\"\nkv_events = \"tcp://10.0.0.7:5557\"\n\
                 replay = \"tcp://10.0.0.7:5600\"\ncapacity_blocks = 100\n{extra}"
            );
            toml::from_str::<ReplicaConfig>(&text).unwrap()
        };
        let ranks = entry("data_parallel_size = 3").ranks().unwrap();
        type Rank = (String, Option<u32>, Option<String>, Option<String>, u64);
        let got: Vec<Rank> = ranks
            .iter()
            .map(|r| (r.name.clone(), r.data_parallel_rank, r.kv_events.clone(), r.replay.clone(), r.capacity_blocks))
            .collect();
        let want = |k: u32| {
            (
                format!("v-dp{k}"),
                Some(k),
                Some(format!("tcp://10.0.0.7:{}", 5557 + k)),
                Some(format!("tcp://10.0.0.7:{}", 5600 + k)),
                100,
            )
        };
        assert_eq!(got, [want(0), want(1), want(2)]);
        assert!(ranks.iter().all(|r| r.http == "http://10.0.0.7:8000" && r.data_parallel_size.is_none()));
        assert!(ranks.iter().all(|r| r.validate().is_ok()));
        // Without a size the entry stands for itself; a size of 1 is one rank.
        assert_eq!(entry("").ranks().unwrap(), [entry("")]);
        assert_eq!(entry("data_parallel_size = 1").ranks().unwrap()[0].name, "v-dp0");
        for (extra, err) in [
            ("data_parallel_size = 0", "replica \"v\": data_parallel_size must be 1..=1024, got 0"),
            ("data_parallel_size = 1025", "replica \"v\": data_parallel_size must be 1..=1024, got 1025"),
            (
                "data_parallel_size = 2\ndata_parallel_rank = 1",
                "replica \"v\": data_parallel_size and data_parallel_rank exclude each other (the size writes the ranks)",
            ),
        ] {
            assert_eq!(entry(extra).ranks().unwrap_err(), err);
        }
        let close = ReplicaConfig { replay: Some("tcp://10.0.0.7:5558".into()), ..entry("data_parallel_size = 2") };
        assert_eq!(
            close.ranks().unwrap_err(),
            "replica \"v\": with data_parallel_size 2, tcp://10.0.0.7:5558 is both a publisher and a replay socket \
             (vLLM adds the rank to both ports): keep kv_events and replay at least 2 ports apart"
        );
        let high = ReplicaConfig { kv_events: Some("tcp://h:65535".into()), ..entry("data_parallel_size = 2") };
        assert_eq!(
            high.ranks().unwrap_err(),
            "replica \"v\": kv_events \"tcp://h:65535\": port 65535 + rank 1 is past 65535"
        );
        // An entry that still has a size was not read through NodeConfig::read.
        assert!(entry("data_parallel_size = 2").validate().unwrap_err().contains("data_parallel_size is expanded"));
    }

    #[test]
    fn replica_models_other_than_the_default_are_said_and_never_an_adapters_name() {
        let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
        c.node.model = "m1".into();
        c.replicas[0].model = Some("m2".into());
        assert_eq!(
            c.doubts(),
            ["replicas declare models other than node.model (\"m1\"): [\"m2\"]; each serves only requests naming its \
              model (a request naming none goes to node.model's replicas)"]
        );
        c.node.lora_adapters = vec!["m2".into()];
        assert_eq!(
            c.validate().unwrap_err(),
            "replica \"vllm-0\": model \"m2\" is also one of node.lora_adapters; a request naming it would get the adapter"
        );
    }

    #[test]
    fn a_disaggregated_model_needs_both_sides_and_one_engine() {
        let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
        c.node.model = "m".into();
        c.replicas[0].role = Role::Prefill;
        assert_eq!(
            c.doubts(),
            ["model \"m\" has prefill replicas but no decode replica: its requests go to its `both` replicas only, and \
              the prefill replicas serve nothing until a decode replica is added"]
        );
        let mut decode = c.replicas[0].clone();
        decode.name = "vllm-1".into();
        decode.role = Role::Decode;
        decode.engine = "sglang".into();
        c.replicas.push(decode);
        assert_eq!(c.doubts(), Vec::<String>::new());
        assert_eq!(
            c.validate().unwrap_err(),
            "model \"m\": replica \"vllm-1\" has engine \"sglang\" but replica \"vllm-0\" has \"vllm\"; a disaggregated \
             model's prefill and decode replicas must run one engine (it decides the hand-over)"
        );
        c.replicas[1].engine = "vllm".into();
        assert_eq!(c.validate(), Ok(()));
        // Informational for a replica serving whole requests, as it always was.
        c.replicas[0].role = Role::Both;
        c.replicas[0].engine = "trtllm".into();
        assert_eq!(c.replicas[0].validate(), Ok(()));
        c.replicas[0].role = Role::Prefill;
        assert_eq!(
            c.replicas[0].validate().unwrap_err(),
            "replica \"vllm-0\": engine must be vllm or sglang for a prefill replica (it decides the hand-over), got \"trtllm\""
        );
    }

    #[test]
    fn lora_adapters_are_named_once_and_not_the_base_model() {
        let with = |v: &str| {
            let text = EXAMPLE.replacen("[node]\n", &format!("[node]\nmodel = \"m\"\nlora_adapters = {v}\n"), 1);
            toml::from_str::<NodeConfig>(&text).unwrap().validate()
        };
        with("[\"sql\", \"chat\"]").unwrap();
        assert_eq!(with("[\"sql\", \"sql\"]").unwrap_err(), "node.lora_adapters: \"sql\" appears twice");
        assert_eq!(with("[\"m\"]").unwrap_err(), "node.lora_adapters: \"m\" is empty or the base model's name");
        assert_eq!(with("[\"\"]").unwrap_err(), "node.lora_adapters: \"\" is empty or the base model's name");
        // A replica's own list: the same rules.
        let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
        c.replicas[0].model = Some("m2".into());
        c.replicas[0].lora_adapters = Some(vec!["sql".into(), "sql".into()]);
        assert_eq!(c.validate().unwrap_err(), "replica \"vllm-0\": lora_adapters: \"sql\" appears twice");
        c.replicas[0].lora_adapters = Some(vec!["m2".into()]);
        assert_eq!(
            c.validate().unwrap_err(),
            "replica \"vllm-0\": lora_adapters: \"m2\" is empty or the replica's model"
        );
        c.replicas[0].lora_adapters = Some(vec!["sql".into()]);
        c.validate().unwrap();
        // Never another model's name: a request naming it would mean the model.
        c.node.model = "m1".into();
        c.replicas[0].lora_adapters = Some(vec!["m1".into()]);
        assert_eq!(
            c.validate().unwrap_err(),
            "replica \"vllm-0\": lora_adapters: \"m1\" is a model's name (or node.model's adapter) here"
        );
    }

    #[test]
    fn errors_name_the_field() {
        let bad = EXAMPLE.replace("kv_cost", "fastest");
        let c: NodeConfig = toml::from_str(&bad).unwrap();
        assert!(c.validate().unwrap_err().starts_with("node.policy: "), "{:?}", c.validate());
        let bad = EXAMPLE.replace("tcp://10.0.0.7:5557", "10.0.0.7:5557");
        let c: NodeConfig = toml::from_str(&bad).unwrap();
        assert_eq!(
            c.validate().unwrap_err(),
            "replica \"vllm-0\": kv_events \"10.0.0.7:5557\": only tcp://host:port endpoints are supported"
        );
        // No port: refused here, not retried as a parse error at every restart of the actor.
        let c: NodeConfig = toml::from_str(&EXAMPLE.replace("tcp://10.0.0.7:5557", "tcp://10.0.0.7")).unwrap();
        assert_eq!(
            c.validate().unwrap_err(),
            "replica \"vllm-0\": kv_events \"tcp://10.0.0.7\" has no port (tcp://host:port)"
        );
        let c: NodeConfig = toml::from_str(&EXAMPLE.replace(
            "kv_events = \"tcp://10.0.0.7:5557\"",
            "kv_events = \"tcp://10.0.0.7:5557\"\nreplay = \"ipc:///tmp/replay\"",
        ))
        .unwrap();
        assert_eq!(
            c.validate().unwrap_err(),
            "replica \"vllm-0\": replay \"ipc:///tmp/replay\": only tcp://host:port endpoints are supported"
        );
        // https engines: refused up front (the engine client has no TLS backend).
        let c: NodeConfig = toml::from_str(&EXAMPLE.replace("http://10.0.0.7:8000", "https://10.0.0.7:8000")).unwrap();
        assert!(c
            .validate()
            .unwrap_err()
            .starts_with("replica \"vllm-0\": http \"https://10.0.0.7:8000\": https:// engines are not supported"));
        let clustered = format!("{EXAMPLE}\n[cluster]\nid = 2\npeers = [\"1=a:1\", \"3=c:3\"]\n");
        let c: NodeConfig = toml::from_str(&clustered).unwrap();
        assert_eq!(c.validate().unwrap_err(), "cluster.peers must include this node (id 2)");
        let c: NodeConfig = toml::from_str(&clustered.replace("3=c:3", "2=b")).unwrap();
        assert_eq!(c.validate().unwrap_err(), "cluster.peers: \"2=b\" is not id=host:port with id > 0");
        let c: NodeConfig = toml::from_str(&clustered.replace("3=c:3", "2=b:2")).unwrap();
        c.validate().unwrap();
        assert_eq!(c.cluster.unwrap().peer_map().unwrap().get(&2).map(String::as_str), Some("b:2"));
        let c: NodeConfig =
            toml::from_str(&EXAMPLE.replace("capacity_blocks = 100", "capacity_blocks = 100\nblock_size = 32"))
                .unwrap();
        assert_eq!(
            c.validate().unwrap_err(),
            "replica \"vllm-0\": block_size 32 differs from node.block_size 16 (a replica of node.model has its block \
             size; another model may have its own)"
        );
        // Another model may have its own, one per model.
        let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
        let mut other = c.replicas[0].clone();
        other.name = "qwen-0".into();
        other.model = Some("qwen".into());
        other.block_size = Some(32);
        c.replicas.push(other.clone());
        c.validate().unwrap();
        other.name = "qwen-1".into();
        other.block_size = None;
        c.replicas.push(other);
        assert_eq!(
            c.validate().unwrap_err(),
            "replica \"qwen-1\": block_size 16 differs from replica \"qwen-0\"'s 32: the replicas of model \"qwen\" must \
             share one block size"
        );
        let c: NodeConfig = toml::from_str(
            &EXAMPLE.replace("policy = \"kv_cost\"", "policy = \"kv_cost\"\npolicy_params = { weight = 1.0 }"),
        )
        .unwrap();
        assert_eq!(
            c.validate().unwrap_err(),
            "node.policy_params: invalid policy_params: policy kv_cost has no parameter \"weight\""
        );
        let c: NodeConfig =
            toml::from_str(&EXAMPLE.replace("policy = \"kv_cost\"", "policy = \"kv_cost\"\nproxy_threads = 0"))
                .unwrap();
        assert_eq!(c.validate().unwrap_err(), "node.proxy_threads must be at least 1");
        let typo = EXAMPLE.replace("capacity_blocks", "capacity");
        assert!(toml::from_str::<NodeConfig>(&typo).unwrap_err().to_string().contains("unknown field `capacity`"));
    }

    #[test]
    fn a_nodes_own_entry_in_peers_must_be_where_it_serves() {
        let section = |addr: &str, own: &str| ClusterSection {
            id: 2,
            addr: addr.into(),
            peers: vec!["1=10.0.0.1:50051".into(), format!("2={own}")],
            ..ClusterSection::default()
        };
        assert_eq!(section("", "10.0.0.2:50051").check_own_peer(50051), Ok(()));
        assert_eq!(section("10.0.0.2:50051", "10.0.0.2:50051").check_own_peer(40000), Ok(()));
        assert_eq!(
            section("", "10.0.0.2:50099").check_own_peer(50051).unwrap_err(),
            "cluster.peers lists this node (id 2) at 10.0.0.2:50099, but it serves gRPC on port 50051: peers would dial \
             the wrong address; fix its entry in peers (or cluster.addr)"
        );
        assert!(section("10.0.0.2:50051", "10.0.0.9:50051").check_own_peer(50051).is_err());
        // A node that joins later lists no peers.
        assert_eq!(ClusterSection { id: 4, ..ClusterSection::default() }.check_own_peer(1), Ok(()));
    }
}
