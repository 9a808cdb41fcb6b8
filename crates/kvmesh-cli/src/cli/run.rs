//! Arguments of the commands that run something: `node`, `demo`, `loadtest`.

use super::*;

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
    /// the first chunk of each answer. A stream counts as an error unless it ends with
    /// `data: [DONE]` and carries no error event (`sse_error`: the router's event for an
    /// upstream that broke off after the 200; `sse_truncated`: cut short).
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
    /// Read the configuration (flags and environment applied), validate it, read the token
    /// and TLS files it names, print what it would run and every warning, then exit: 0 when
    /// the node would start, 1 (with the reason) when it would refuse. Binds no port,
    /// contacts nothing.
    #[arg(long, conflicts_with = "reference")]
    pub check: bool,
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
