//! Arguments of the operator's commands: `status`, `replica`, `cluster`, `replication`,
//! `autoscaler`.

use super::*;

#[derive(Debug, Subcommand)]
pub enum AutoscalerCommand {
    /// The committed decisions the node keeps (the last 100), oldest first: Raft log index,
    /// time, replicas wanted, reason, the pool's ready and starting replicas, the load
    /// measured and sized for, and the capacity per replica assumed.
    Decisions(AutoscalerArgs),
    /// The latest decision (`Autoscaler.GetRecommendation`): what an actuator should scale
    /// the pool to now, with its reason and inputs.
    Recommend(AutoscalerArgs),
    /// The latest decision, then again whenever a newer one commits (`Autoscaler.WatchDecisions`;
    /// decisions that commit in quick succession show as the last of them), one line each (JSON
    /// lines with --json), until Ctrl-C or the reader goes away; exits 1 if the node stops.
    Watch(AutoscalerArgs),
}

#[derive(Debug, Args)]
pub struct AutoscalerArgs {
    #[command(flatten)]
    pub target: ClusterTarget,
    /// The pool (default: the tier's).
    #[arg(long, default_value = "")]
    pub pool: String,
    /// Print the decisions as JSON, proto3 mapping (`watch`: one object per line).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ReplicationCommand {
    /// The hottest prefixes (all nodes' counts) and the committed plan with each target's
    /// warm-up state.
    Status(ReplicationStatusArgs),
    /// Plan a prefix by hand: pinned for `cooldown`, warmed on exactly --replicas (or on
    /// `min_replicas` chosen by load). Give the prefix as --hash (from `status`), --text or
    /// --token-ids; its length is cut down to the depths the nodes count (4, 6, 8, 12, 16, 24,
    /// … blocks). Needs the admin token.
    Trigger(ReplicationTriggerArgs),
}

#[derive(Debug, Args)]
pub struct ReplicationStatusArgs {
    #[command(flatten)]
    pub target: ClusterTarget,
    /// Hot prefixes to list.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub limit: u32,
    /// Print `{"hot": …, "plan": …}` as JSON (proto3 mapping: hashes as strings).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
#[group(id = "prefix", required = true, multiple = false)]
pub struct ReplicationTriggerArgs {
    #[command(flatten)]
    pub target: ClusterTarget,
    /// A hot prefix's hash, as `kvmesh replication status` lists it.
    #[arg(long, group = "prefix")]
    pub hash: Option<u64>,
    /// The prefix as text (tokenized by the node).
    #[arg(long, group = "prefix")]
    pub text: Option<String>,
    /// The prefix as comma-separated token ids.
    #[arg(long, group = "prefix", value_delimiter = ',', value_name = "IDS")]
    pub token_ids: Option<Vec<u32>>,
    /// Replicas to warm, comma-separated (default: chosen by load).
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    pub replicas: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum ReplicaCommand {
    /// Register a replica and start following it. Registering the same name with the same
    /// endpoints again changes nothing (exit 0), so a start-up script can retry it.
    Add(ReplicaAddArgs),
    /// Stop following a replica and forget its blocks and bookings.
    Remove(ReplicaNameArgs),
    /// Stop routing new requests to a replica; in-flight requests finish. With --wait, wait
    /// until it is idle (safe to release), e.g. in an engine pod's preStop hook.
    Drain(DrainArgs),
    /// Put a drained or starting replica into rotation — also one a scale-down drained (an
    /// operator's override).
    Undrain(ReplicaNameArgs),
    /// Mark a registered replica as starting (a new engine still loading): not routed to,
    /// counted by the autoscaler as capacity on its way; `kvmesh replica ready` when it
    /// serves, and its cold start is measured. Needs a cluster.
    Starting(ReplicaNameArgs),
    /// A starting replica's engine serves: into rotation, its cold start measured. Refused
    /// when it is draining (a scale-down cancelled the start: release it).
    Ready(ReadyArgs),
}

#[derive(Debug, Args)]
pub struct ReplicaAddArgs {
    #[command(flatten)]
    pub target: ClusterTarget,
    /// Unique name, e.g. `vllm-0`.
    #[arg(long)]
    pub name: String,
    /// Base URL of its OpenAI API, e.g. `http://10.0.0.7:8000`.
    #[arg(long, value_name = "URL")]
    pub http: String,
    /// Its KV-event publisher, e.g. `tcp://10.0.0.7:5557`.
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events: Option<String>,
    /// Its replay endpoint, e.g. `tcp://10.0.0.7:5558`.
    #[arg(long, value_name = "ENDPOINT")]
    pub replay: Option<String>,
    /// KV-cache capacity, blocks (vLLM logs "GPU KV cache size: N tokens": N / block size).
    /// Default: read from the engine's metrics page (vLLM's `num_gpu_blocks`); the replica is
    /// `starting` until it is. Required for SGLang and for a data-parallel rank.
    #[arg(long, value_name = "BLOCKS", default_value_t = 0, hide_default_value = true)]
    pub capacity_blocks: u64,
    /// The model it serves (vLLM `--served-model-name`); default the node's `node.model`.
    /// Requests are routed only among the replicas of the model they name.
    #[arg(long)]
    pub model: Option<String>,
    /// It is this data-parallel rank of an engine serving several behind one API (vLLM
    /// `--data-parallel-size`): requests to it carry `X-data-parallel-rank`, and
    /// --kv-events/--replay are that rank's (vLLM: the configured ports + the rank).
    #[arg(long, value_name = "RANK")]
    pub data_parallel_rank: Option<u32>,
    /// A LoRA adapter it serves (vLLM `--lora-modules NAME=PATH`'s NAME); repeat for
    /// several. Default: the node learns them from the engine's `/v1/models`.
    #[arg(long = "lora-adapter", value_name = "NAME")]
    pub lora_adapters: Vec<String>,
    /// Its part in prefill/decode-disaggregated serving: both (default), prefill or decode.
    /// While its model has a routable replica of each side, requests go to one of each.
    #[arg(long, default_value = "both", value_parser = ["both", "prefill", "decode"])]
    pub role: String,
    /// `vllm` or `sglang`: how a disaggregated request is handed over (vLLM's
    /// kv_transfer_params, SGLang's bootstrap room).
    #[arg(long, default_value = "vllm", value_parser = ["vllm", "sglang"])]
    pub engine: String,
    /// An SGLang prefill replica's disaggregation bootstrap port (default 8998).
    #[arg(long, value_name = "PORT")]
    pub bootstrap_port: Option<u16>,
    /// Register it as starting (its engine still loading; needs a cluster), in the same Raft
    /// entry: never routed to, counted by the autoscaler, until `kvmesh replica ready`.
    #[arg(long)]
    pub starting: bool,
}

#[derive(Debug, Args)]
pub struct ReplicaNameArgs {
    #[command(flatten)]
    pub target: ClusterTarget,
    /// The replica's name (or give it as --name NAME).
    #[arg(value_name = "NAME", required_unless_present = "name_flag", conflicts_with = "name_flag")]
    name_arg: Option<String>,
    /// The replica's name.
    #[arg(long = "name", id = "name_flag", value_name = "NAME")]
    name_flag: Option<String>,
}

impl ReplicaNameArgs {
    /// The replica's name, given either way (clap requires one of the two).
    pub fn name(&self) -> &str {
        self.name_arg.as_deref().or(self.name_flag.as_deref()).unwrap_or_default()
    }
}

#[derive(Debug, Args)]
pub struct ReadyArgs {
    #[command(flatten)]
    pub replica: ReplicaNameArgs,
    /// First wait until the node's scrapes reach its engine (the engine answers), e.g. in an
    /// engine pod's start-up script; exit 0 once it is marked ready.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up after this many seconds and exit 124 (it stays starting).
    #[arg(long, default_value_t = 1800.0, value_name = "SECONDS", requires = "wait")]
    pub timeout: f64,
}

#[derive(Debug, Args)]
pub struct DrainArgs {
    #[command(flatten)]
    pub replica: ReplicaNameArgs,
    /// Wait until nothing is in flight on it — no request the tier routed there unreleased,
    /// and its engine reports none running or waiting (or has served no token for 5 s, or no
    /// longer answers) — printing what is left; exit 0 then.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up after this many seconds and exit 124 (it stays draining; other
    /// errors exit 1). The wait includes the drain's settle (2 s in a cluster).
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS", requires = "wait")]
    pub timeout: f64,
    /// With --wait: once idle, also remove it from the registry (a pod that is going away).
    #[arg(long, requires = "wait")]
    pub remove: bool,
}

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Bootstrap a fresh cluster: the node at --grpc initializes Raft with the peers of its
    /// `[cluster]` section and seeds the replica registry from its `[[replicas]]`. Once per
    /// cluster.
    Init(ClusterTarget),
    /// Add a node (started with `kvmesh node --id N` and no peers): it joins as a learner and
    /// becomes a voter once caught up. Any member can take the request.
    Join(JoinArgs),
    /// Remove a node from the cluster (before wiping its data). Any member can take it.
    Leave(LeaveArgs),
    /// Leader, term, members (role, replication lag, shared bookings), the registry.
    Status(ClusterStatusArgs),
    /// Inject a fault into one node (tests and chaos): cut it off, or drop a share of its
    /// outgoing gossip. `--isolate false --gossip-drop 0` heals it.
    Fault(FaultArgs),
}

#[derive(Debug, Args)]
pub struct ClusterTarget {
    /// A node's gRPC address (in a cluster, any member's); `https://` for nodes serving TLS (trusting the PEM CA in
    /// KVMESH_CA_FILE; with mTLS, KVMESH_TLS_CERT_FILE and KVMESH_TLS_KEY_FILE are the client's).
    #[arg(long, default_value = "http://127.0.0.1:50051", value_name = "URL", env = "KVMESH_GRPC")]
    pub grpc: String,
    /// A file holding the admin token, for nodes with `[security] admin_token_file`
    /// (without it, the environment variable KVMESH_ADMIN_TOKEN).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct JoinArgs {
    #[command(flatten)]
    pub target: ClusterTarget,
    /// The new node's id.
    #[arg(long, value_name = "N")]
    pub id: u64,
    /// The new node's gRPC address as the others reach it (`host:port`).
    #[arg(long, value_name = "HOST:PORT")]
    pub addr: String,
}

#[derive(Debug, Args)]
pub struct LeaveArgs {
    #[command(flatten)]
    pub target: ClusterTarget,
    /// The id of the node to remove.
    #[arg(long, value_name = "N")]
    pub id: u64,
}

#[derive(Debug, Args)]
pub struct ClusterStatusArgs {
    #[command(flatten)]
    pub target: ClusterTarget,
    /// Print `Cluster.Status`'s answer as JSON (proto3 mapping) instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct FaultArgs {
    #[command(flatten)]
    pub target: ClusterTarget,
    /// Drop all Raft and gossip traffic to and from the node.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub isolate: bool,
    /// Drop this share (0..1) of the node's outgoing gossip batches.
    #[arg(long, default_value_t = 0.0, value_name = "SHARE")]
    pub gossip_drop: f64,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub target: ClusterTarget,
    /// How many of the latest routing decisions to list (0: none).
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub decisions: u32,
    /// Print JSON instead of the tables: `{"replicas": […], "admission": {…}, "autoscaler":
    /// {…}, "decisions": […]}` (null where the node has none; the latest `--decisions`, newest
    /// first), each the node's gRPC message in the proto3 JSON mapping (enums by name, 64-bit
    /// integers as strings).
    #[arg(long)]
    pub json: bool,
}
