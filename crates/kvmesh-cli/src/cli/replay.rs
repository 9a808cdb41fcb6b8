//! Arguments of the simulator's commands: `replay`, `analyze`.

use super::*;

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
    /// `admission.ttft_slo`: a request also waits when its estimated TTFT on the best
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
    /// TTFT SLO, seconds (a node's `admission.ttft_slo`): requests above it are counted in
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
