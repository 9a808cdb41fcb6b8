//! Flags and subcommands.

use clap::{Args, Parser, Subcommand};
use kvmesh_core::PolicyKind;
use std::path::PathBuf;

/// kvmesh routes LLM requests across vLLM / SGLang replicas on token load, with prefix-cache
/// overlap as a discount on prefill: run router nodes (`node`), operate them (`status`,
/// `cluster`, `replica`, `replication`, `autoscaler`), measure them (`loadtest`), study traffic
/// offline (`analyze`, `replay`, `policies`), or see it all at once (`demo`).
#[derive(Debug, Parser)]
#[command(name = "kvmesh", version, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a whole kvmesh tier on this machine and drive it with real traffic: 3 router nodes
    /// (Raft, gossip, gRPC, ZMQ on loopback), 8 stand-in vLLM engines, streaming OpenAI
    /// requests from a workload fitted to the Mooncake conversation trace (or --trace), with a
    /// live view; then the same requests with round robin, a summary and report files.
    Demo(DemoArgs),
    /// Summarise a serving trace: volume, rate, length percentiles, prefix reuse and how
    /// concentrated it is — what you need to pick a routing strategy.
    ///
    /// Reads Mooncake JSONL (`hash_ids` of 512-token blocks), Azure LLM 2023 CSV and kvmesh
    /// JSONL traces. Without --trace, analyses the built-in generated multi-turn workload.
    Analyze(AnalyzeArgs),
    /// Replay a trace (or a built-in scenario) through the fleet simulator under every chosen
    /// policy, and print TTFT/TPOT percentiles, throughput, hit rate and load balance side by
    /// side. All policies see the identical arrival sequence; the same seed gives the same
    /// numbers.
    Replay(ReplayArgs),
    /// List the routing policies and what each decides on.
    Policies,
    /// Run a router node in front of vLLM / SGLang replicas: OpenAI-compatible HTTP proxy,
    /// gRPC Router/Admin/Events API, one actor per replica following its KV events and
    /// metrics. With --id and --peers (or a [cluster] section) it is one of 3 or 5 nodes that
    /// share the replica registry through Raft and their load through gossip. SIGHUP reloads
    /// the replica list from the config file (a single node, or a cluster not yet seeded).
    Node(NodeArgs),
    /// Show a running node over gRPC: its cluster (leader, term, members, lag), its replicas
    /// (status, engine load, router-side token load, index and event counts), its admission
    /// queue (waiting requests and refusals), the autoscaler's latest decision, its hot prefixes
    /// and replication plan (when `[replication]` is on) and its latest routing decisions with
    /// their reasons.
    Status(StatusArgs),
    /// Load-test a router or an engine: open-loop HTTP completions at a fixed rate (or
    /// closed-loop saturation), latency p50/p99 of successful requests and errors by kind; or
    /// gRPC `Route` calls per second.
    Loadtest(LoadtestArgs),
    /// Operate a cluster of router nodes (Raft): bootstrap it, add or remove nodes, show the
    /// leader, term, members and their replication lag.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Add, remove, drain or undrain an engine replica, or mark its start and its readiness,
    /// through a node's admin API (in a cluster the change goes through the Raft leader and
    /// every node follows it).
    #[command(subcommand)]
    Replica(ReplicaCommand),
    /// Hot prefixes and their replication plan (`[replication]` on the nodes): show what is
    /// hot, where it is held and warmed, or plan a prefix by hand.
    #[command(subcommand)]
    Replication(ReplicationCommand),
    /// The tier's autoscaler (`[autoscaler]` on the nodes): the latest decision, the stream
    /// of them, and the audit log, each with its reason and inputs.
    #[command(subcommand)]
    Autoscaler(AutoscalerCommand),
}

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
    /// Print JSON (`watch`: one object per line).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ReplicationCommand {
    /// The hottest prefixes (all nodes' counts) and the committed plan with each target's
    /// warm-up state.
    Status(ReplicationStatusArgs),
    /// Plan a prefix by hand: pinned for `cooldown_s`, warmed on exactly --replicas (or on
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
    /// Print the hot prefixes and the plan as JSON.
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

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Engine replicas (kvmesh-engine-sim, Llama-3-8B on H100 profile).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub replicas: usize,
    /// Router nodes (3 or 5 form a Raft cluster; 1 runs a single node).
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub nodes: usize,
    /// The routing policy to show (`kvmesh policies`).
    #[arg(long, default_value = "token_load", value_name = "NAME")]
    pub policy: String,
    /// Replay the same requests with this policy afterwards, for comparison (`none`: skip).
    #[arg(long, default_value = "round_robin", value_name = "NAME")]
    pub compare: String,
    /// Time compression: engines run this many times faster than an H100 and requests arrive
    /// this many times denser (the same load, sooner). Times are reported in engine seconds.
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    pub speed: f64,
    /// Mean arrival rate, requests per engine second (8 replicas tip over near 35).
    #[arg(long, default_value_t = 22.0, value_name = "R")]
    pub rate: f64,
    /// About how many requests to send per policy.
    #[arg(long, default_value_t = 600, value_name = "N")]
    pub requests: usize,
    /// A Mooncake JSONL or Azure LLM CSV trace to replay instead of the built-in workload
    /// (e.g. ../shared/traces/mooncake/conversation_trace.jsonl; see README for downloads).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Where to write summary.md, summary.json and one CSV of requests per policy.
    #[arg(long, default_value = "kvmesh-demo-report", value_name = "DIR")]
    pub out: PathBuf,
    /// Seed of the built-in workload.
    #[arg(long, default_value_t = 1, value_name = "S")]
    pub seed: u64,
    /// No live view (progress lines only).
    #[arg(long)]
    pub quiet: bool,
    /// Turn on hot-prefix replication in the tier (`[replication]`, its times divided by
    /// --speed) for the shown policy; the live view shows the plan.
    #[arg(long)]
    pub replication: bool,
    /// Turn on the tier's autoscaler (`[autoscaler]`, its times divided by --speed) for the
    /// shown policy: the live view shows its recommendation for the engine pool (the demo's
    /// engines stay as they are: kvmesh recommends, an actuator such as KEDA acts).
    #[arg(long)]
    pub autoscale: bool,
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
    /// KV-cache capacity, blocks.
    #[arg(long, value_name = "BLOCKS")]
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
    /// The replica's name.
    #[arg(long)]
    pub name: String,
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
    /// (the environment variable KVMESH_ADMIN_TOKEN takes precedence).
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
    /// Print JSON instead of a table.
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
    /// {…}}` (null where the node has none).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct LoadtestArgs {
    /// What to drive: `http` (OpenAI completions), `route` (kvmesh gRPC Route + Release) or
    /// `epp` (a node's Gateway API endpoint picker, Envoy ext_proc, as a gateway drives it).
    #[arg(long, default_value = "http", value_name = "MODE")]
    pub mode: String,
    /// Base URLs to send to (`http://host:port`), comma-separated; several are used in turn
    /// (a client-side round robin, for measuring engines directly). For `route` and `epp`,
    /// the node's gRPC address as `http://host:port`.
    #[arg(long, value_name = "URLS")]
    pub url: String,
    /// Requests per second, open loop (0: closed loop with --concurrency workers, saturation).
    /// `--mode route` and `--mode epp` always run closed loop and ignore it.
    #[arg(long, default_value_t = 100.0, value_name = "R")]
    pub rate: f64,
    /// Workers in closed-loop mode; cap on requests in flight in open-loop mode (for each
    /// stream, with `--baseline`).
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub concurrency: usize,
    /// Seconds to run.
    #[arg(long, default_value_t = 10.0, value_name = "S")]
    pub duration: f64,
    /// Seconds of warm-up before measuring.
    #[arg(long, default_value_t = 1.0, value_name = "S")]
    pub warmup: f64,
    /// Distinct shared prefixes (system prompts) the prompts draw from.
    #[arg(long, default_value_t = 8)]
    pub prefixes: u32,
    /// Length of each shared prefix, tokens as kvmesh's approximate scheme counts them (4 bytes
    /// each; English text is about as many BPE tokens). A unique ~10-token question follows.
    #[arg(long, default_value_t = 168, value_name = "N")]
    pub prefix_tokens: u32,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 1)]
    pub max_tokens: u32,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// HTTP: retry a request once on the next URL when its connection is refused or reset
    /// (what a client of a router tier does when one router dies).
    #[arg(long)]
    pub retry_once: bool,
    /// HTTP: ask for streamed answers (`"stream": true`) and also report TTFT, the time to
    /// the first chunk of each answer.
    #[arg(long)]
    pub stream: bool,
    /// HTTP, open loop: also send the same rate to these base URLs (comma-separated, in turn),
    /// interleaved with `--url`'s requests (half a gap apart), and report both and the
    /// difference. With the engines as the baseline and a router as `--url`, that difference
    /// is the router's added latency, both sides measured over the same seconds.
    #[arg(long, value_name = "URLS")]
    pub baseline: Option<String>,
}

#[derive(Debug, Args)]
pub struct NodeArgs {
    /// The node's TOML configuration (every key: `kvmesh node --reference`).
    #[arg(long, value_name = "FILE", required_unless_present = "reference")]
    pub config: Option<PathBuf>,
    /// Print every configuration key with its default and meaning (Markdown, the same as
    /// docs/configuration.md), then exit.
    #[arg(long)]
    pub reference: bool,
    /// Worker threads of the node's main runtime: KV events, gRPC, Raft, gossip, scrapes
    /// (default: one per core). The HTTP proxy runs on threads of its own: `node.proxy_threads`.
    #[arg(long, value_name = "N")]
    pub workers: Option<usize>,
    /// HTTP listen address; overrides `[node] http` (several nodes on one host share a file).
    #[arg(long, value_name = "HOST:PORT", env = "KVMESH_HTTP")]
    pub http: Option<std::net::SocketAddr>,
    /// gRPC listen address; overrides `[node] grpc`.
    #[arg(long, value_name = "HOST:PORT", env = "KVMESH_GRPC_LISTEN")]
    pub grpc: Option<std::net::SocketAddr>,
    /// Cluster: this node's Raft id (> 0); sets or overrides `[cluster] id`.
    #[arg(long, value_name = "N", env = "KVMESH_NODE_ID")]
    pub id: Option<u64>,
    /// Cluster: this node's gRPC address as peers reach it (`host:port`; default its gRPC
    /// listen address); `[cluster] addr`.
    #[arg(long, value_name = "HOST:PORT", env = "KVMESH_RAFT_ADDR")]
    pub raft_addr: Option<String>,
    /// Cluster: the initial voters, `id=host:port,...` (this node included); `[cluster] peers`.
    #[arg(long, value_name = "LIST", env = "KVMESH_PEERS", value_delimiter = ',')]
    pub peers: Option<Vec<String>>,
    /// Cluster: the Raft store's directory; `[cluster] data_dir`.
    #[arg(long, value_name = "DIR", env = "KVMESH_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Cluster: run without authentication (`[cluster] insecure`): Raft, gossip and registry
    /// writes open to anyone who reaches the gRPC port. Without it a cluster node needs a
    /// cluster token or mTLS. Logs a warning at every start.
    #[arg(long)]
    pub insecure: bool,
    /// Log lines as `text` or `json` (one object per line). The level comes from RUST_LOG
    /// (default `info`).
    #[arg(long, default_value = "text", value_name = "FORMAT", env = "KVMESH_LOG_FORMAT")]
    pub log_format: String,
    /// Export trace spans (one per request: decision, upstream call, first token, completion)
    /// with OpenTelemetry OTLP over gRPC to this collector, e.g. `http://otel-collector:4317`.
    /// With export on, a client's W3C `traceparent` is continued and passed on to the engines;
    /// the service name comes from `OTEL_SERVICE_NAME` (default `kvmesh-node`).
    #[arg(long, value_name = "URL", env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

impl NodeArgs {
    /// The configuration file (clap requires it unless `--reference`, which reads none).
    pub fn config_path(&self) -> &std::path::Path {
        self.config.as_deref().expect("clap requires --config without --reference")
    }
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Trace file: Mooncake `*.jsonl`, Azure LLM `*.csv`, or kvmesh JSONL (`arrival_s` lines).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Built-in scenario instead of a trace: shared-0, shared-50, shared-90, hot-prompt, hot-rotating, zipf,
    /// bursts, chat, rl (RL rollouts: steps of 16 prompts × 8 samples, heavy-tailed outputs,
    /// max_tokens 8,192; a decode table with step completion times follows the main one),
    /// agents (tool loops of 3–12 turns: short calls, a long answer, tool results appended;
    /// the decode table's steps are sessions). Default when no --trace: chat.
    #[arg(long, value_name = "NAME")]
    pub scenario: Option<String>,
    /// Engine replicas.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub replicas: u32,
    /// Comma-separated policies (default: all). See `kvmesh policies`. A `+replication`
    /// suffix (`token_load+replication`) runs the policy with hot-prefix replication.
    #[arg(long, value_name = "LIST")]
    pub policies: Option<String>,
    /// Also run `token_load+replication`: hot-prefix detection, a replication plan and
    /// warm-ups, with a node's `[replication]` defaults (README: hot-prefix replication).
    #[arg(long)]
    pub replication: bool,
    /// Replicas that scale: run each listed autoscaler (kvmesh, reactive, knative, oracle;
    /// `all`) over a pool of up to --replicas, starting with --initial-replicas; one row per
    /// (policy, autoscaler), with SLO attainment (share of requests with TTFT within
    /// --ttft-slo) and GPU-seconds (from adding each replica to releasing it). Policies
    /// default to token_load.
    #[arg(long, value_name = "LIST")]
    pub autoscale: Option<String>,
    /// Admission control on every run, as a node's `[admission]` with its defaults: a request
    /// that finds no replica with room (no KV headroom, or every replica at max_num_seqs)
    /// waits at the router — at most 256 at once, for at most 30 s, else it is refused and
    /// counted late — and is routed as capacity frees, smallest token load first.
    #[arg(long)]
    pub admission: bool,
    /// Admission control (as --admission) with its TTFT gate at --ttft-slo, as a node's
    /// `admission.ttft_slo_s`: a request also waits when its estimated TTFT on the best
    /// replica would miss what is left of the SLO and more than half the SLO is queued there;
    /// requests that have waited less than half the SLO go before late ones (those that have
    /// waited longer), and a full queue refuses its largest late request rather than a new one.
    #[arg(long)]
    pub admission_slo: bool,
    /// With --autoscale: the utilisation every autoscaler sizes replicas for, in (0, 1].
    #[arg(long, default_value_t = 0.7, value_name = "U")]
    pub target_utilisation: f64,
    /// With --autoscale: write every autoscaling decision to this CSV (policy, seed, time,
    /// demand, forecast, capacity, desired, ready, starting, queued tokens), to plot replicas
    /// against load.
    #[arg(long, value_name = "FILE")]
    pub scale_csv: Option<std::path::PathBuf>,
    /// With --autoscale: seconds from adding a replica to its serving.
    #[arg(long, default_value_t = 60.0, value_name = "S")]
    pub cold_start: f64,
    /// With --autoscale: replicas ready at the start.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub initial_replicas: u32,
    /// With --autoscale: fewest replicas the autoscalers keep.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub min_replicas: u32,
    /// Rate steps: the replayed span (after --requests) in equal parts, each replayed this many
    /// times faster (after --rate-scale), e.g. `1,2,1` doubles the rate in the middle third.
    #[arg(long, value_name = "LIST")]
    pub rate_steps: Option<String>,
    /// First seed (policy tie-breaks and scenario generation).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seeds to run per policy (seed, seed+1, …); figures are their mean.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub seeds: u32,
    /// Divide every arrival time by this: 2 replays the trace twice as fast.
    #[arg(long, default_value_t = 1.0, value_name = "X", allow_negative_numbers = true)]
    pub rate_scale: f64,
    /// Scenario arrival rate, requests per second (scenarios only, default 10; use
    /// --rate-scale for traces).
    #[arg(long, value_name = "R", allow_negative_numbers = true)]
    pub rate: Option<f64>,
    /// Requests: how many a scenario generates (default 2,000), or the first N of a trace.
    #[arg(long, value_name = "N")]
    pub requests: Option<usize>,
    /// Delay from an engine's KV event to the router applying it, milliseconds.
    #[arg(long, default_value_t = 0.0, value_name = "MS", allow_negative_numbers = true)]
    pub event_delay_ms: f64,
    /// Router nodes sharing the replicas; requests arrive at them in turn. Each has its own
    /// view; booking deltas reach the others after --gossip-delay-ms.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub routers: u32,
    /// With --routers > 1: delay from a node's booking change to its peers, milliseconds.
    #[arg(long, default_value_t = 5.0, value_name = "MS", allow_negative_numbers = true)]
    pub gossip_delay_ms: f64,
    /// With --routers > 1: nodes do not share bookings (each sees only its own).
    #[arg(long)]
    pub no_gossip: bool,
    /// Engine profile: h100, a100, or a JSON file with `name`, `prefill_s_per_token`,
    /// `decode_s_per_token`, `step_overhead_s` (seconds), `chunk_tokens`, `kv_tokens`,
    /// `max_batch` and optionally `cold_start_s`.
    #[arg(long, default_value = "h100", value_name = "NAME|FILE")]
    pub profile: String,
    /// KV block size, tokens (engines and router).
    #[arg(long, default_value_t = 16, value_name = "TOKENS")]
    pub block_size: u32,
    /// TTFT SLO, seconds (a node's `admission.ttft_slo_s`): requests above it are counted in
    /// the >SLO column. Formerly `--slo-ttft`, still accepted.
    #[arg(long, alias = "slo-ttft", default_value_t = 5.0, value_name = "S", allow_negative_numbers = true)]
    pub ttft_slo: f64,
    /// Clients send max_tokens equal to the true output length.
    #[arg(long)]
    pub max_tokens_known: bool,
    /// What the router knows of each request's output length: learned (a node's default: a
    /// request with max_tokens is expected at the mean output of completed requests whose
    /// first 4 prompt blocks (64 tokens) match, re-estimated as it decodes), max-tokens (its max_tokens,
    /// booked whole: a node with learn_output_lengths off), hint (the client sends the true
    /// length rounded up to a power of two), oracle (the client sends the true length).
    /// Requests without max_tokens (the public traces) are expected at the running mean in
    /// every mode but hint and oracle.
    #[arg(long, default_value = "learned", value_name = "MODE")]
    pub output_info: String,
    /// Keep bucketed timestamps as they are (default: spread each bucket over the gap to the
    /// next, as Mooncake's 3 s buckets need).
    #[arg(long)]
    pub no_spread: bool,
    /// Simulations to run at once (default: one per core).
    #[arg(long, value_name = "N")]
    pub jobs: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Print a Markdown table instead of a terminal table.
    #[arg(long, conflicts_with = "json")]
    pub markdown: bool,
    /// Draw each policy's TTFT CDF into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Write every request's outcome to this CSV (policy, seed, arrival, replica, prompt,
    /// cached and output tokens, TTFT, the router's estimated TTFT, E2E; seconds), in trace
    /// order per run: to see which requests make a tail.
    #[arg(long, value_name = "FILE.csv")]
    pub outcomes_csv: Option<PathBuf>,
    /// Replay on a prefill/decode-disaggregated fleet of P prefill and D decode replicas
    /// (replacing --replicas: P + D GPUs), e.g. 8:8. Each request's prefill leg runs on a
    /// prefill replica, its KV crosses --pd-link-gbps, and a decode replica generates the
    /// answer (TTFT is the decode side's first token). One router; no admission control,
    /// scaling or replication.
    #[arg(long, value_name = "P:D")]
    pub pd: Option<String>,
    /// The KV link into each decode replica, Gb/s (with --pd).
    #[arg(long, default_value_t = 100.0, value_name = "GBPS")]
    pub pd_link_gbps: f64,
    /// The decode side's policy (with --pd); default: each policy picks its own decode side
    /// too, token_load with kvmesh's decode pick (KV headroom, then decode time).
    #[arg(long, value_name = "POLICY")]
    pub decode_policy: Option<String>,
    /// Set one parameter of one policy, `POLICY.NAME=VALUE` (repeatable), e.g.
    /// `token_load.affinity_budget=0.6`: the names and ranges a cluster's `policy_params`
    /// takes (README: policies). The rest keep their defaults.
    #[arg(long = "policy-param", value_name = "POLICY.NAME=VALUE")]
    pub policy_params: Vec<String>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Args)]
pub struct AnalyzeArgs {
    /// Trace file: Mooncake `*.jsonl`, Azure LLM 2023 `*.csv`, or kvmesh JSONL (`arrival_s`
    /// lines). See README.md for where to get the public traces.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Print the statistics as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// How many of the largest shared-prefix groups to list.
    #[arg(long, default_value_t = 5, value_name = "N")]
    pub top: usize,
    /// Fail (exit 1) if any line of the trace is malformed, instead of skipping it.
    #[arg(long)]
    pub strict: bool,
    /// Without --trace: which built-in workload — `chat` (the replay default) or
    /// `conversation` (fitted to the Mooncake conversation trace; `kvmesh demo`'s default).
    #[arg(long, default_value = "chat", value_name = "NAME")]
    pub workload: String,
    /// Advise a prefill:decode split of this many replicas for the trace at its own rate
    /// (prefill and decode work balanced at the utilisation the SLOs allow; check it with
    /// `kvmesh replay --pd P:D`). 0: no advice.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub gpus: u32,
    /// TTFT SLO for the split advice, seconds.
    #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
    pub ttft_slo: f64,
    /// TPOT SLO for the split advice, seconds per token (bounds the decode batch).
    #[arg(long, value_name = "SECONDS")]
    pub tpot_slo: Option<f64>,
    /// Engine profile for the split advice: h100, a100, or a JSON profile file.
    #[arg(long, default_value = "h100")]
    pub profile: String,
    /// The KV link from prefill to decode replica, Gb/s, for the split advice (a prompt's
    /// transfer counts in its TTFT).
    #[arg(long, default_value_t = 100.0, value_name = "GBPS")]
    pub link_gbps: f64,
}

/// `kvmesh policies`.
pub fn print_policies() {
    let about = |k: PolicyKind| {
        match k {
        PolicyKind::RoundRobin => "each replica in turn",
        PolicyKind::Random => "uniformly random replica",
        PolicyKind::LeastOutstandingRequests => "fewest requests in flight (load-balancer anchor)",
        PolicyKind::PowerOfTwo => "vLLM router: fewer in flight of two random replicas",
        PolicyKind::ConsistentHash => "vLLM router: hash ring on the session key, else the prompt; no load bound",
        PolicyKind::CacheAware => "SGLang router: own prompt tree, match > 0.3 to its creator unless in-flight imbalanced (64 abs, 1.5 rel); else least loaded",
        PolicyKind::VllmCacheAware => "vLLM router: least loaded of the best own-prefix matches when > 0.3 and balanced (64, 1.5); else least loaded",
        PolicyKind::PrefixAffinity => "Ray Serve: own prompt tree, match ≥ 0.1 to its holders, else smallest tree; fewest ongoing",
        PolicyKind::KvCost => "Dynamo KV router: prefill blocks − overlap + active blocks (KV events, own sequences), lowest wins",
        PolicyKind::WeightedScorer => "llm-d: 3·prefix (own index) + 2·queue + 2·free KV (scraped every 50 ms), highest wins",
        PolicyKind::TokenLoad => "kvmesh default: lowest estimated TTFT on token load, overlap as prefill discount, KV shortage priced as the wait until room",
    }
    };
    for k in PolicyKind::ALL {
        println!("{:<28}{}", k.as_str(), about(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// Every `kvmesh …` command in a shipped manifest's scripts, with the pod's environment
    /// filled in, parses with this CLI: a renamed flag cannot leave deploy/ behind.
    #[test]
    fn the_engine_pods_lifecycle_commands_parse() {
        let yaml = include_str!("../../../deploy/engines.yaml");
        let joined = yaml.replace("\\\n", " ");
        let commands: Vec<Vec<String>> = joined
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .filter_map(|l| l.find("kvmesh replica").map(|i| &l[i..]))
            .map(|l| {
                // The command ends where the shell's `; do` or `||` begins.
                let end = [l.find("; do"), l.find(" ||")].into_iter().flatten().min().unwrap_or(l.len());
                l[..end]
                    .replace("\"$POD_NAME\"", "vllm-7d9f-abcde")
                    .replace("$POD_IP", "10.0.0.7")
                    .replace('"', "")
                    .split_whitespace()
                    .map(String::from)
                    .collect()
            })
            .collect();
        let verbs: Vec<&str> = commands.iter().map(|c| c[2].as_str()).collect();
        assert_eq!(verbs, ["add", "ready", "drain", "remove"]);
        for c in &commands {
            let cli = Cli::try_parse_from(c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
            let Command::Replica(cmd) = cli.command else { panic!("{c:?}") };
            match cmd {
                ReplicaCommand::Add(a) => {
                    assert_eq!((a.name.as_str(), a.http.as_str()), ("vllm-7d9f-abcde", "http://10.0.0.7:8000"));
                    assert_eq!((a.capacity_blocks, a.starting), (29_375, true));
                    assert_eq!(a.replay.as_deref(), Some("tcp://10.0.0.7:5558"));
                }
                ReplicaCommand::Ready(r) => assert!(r.wait && r.timeout == 1800.0),
                ReplicaCommand::Drain(d) => assert!(d.wait && d.timeout == 600.0 && !d.remove),
                ReplicaCommand::Starting(a) | ReplicaCommand::Remove(a) => assert_eq!(a.name, "vllm-7d9f-abcde"),
                ReplicaCommand::Undrain(_) => panic!("{c:?}"),
            }
        }
    }
}
