//! Flags and subcommands.

use clap::{Args, Parser, Subcommand};
use kvmesh_core::PolicyKind;
use std::path::PathBuf;

/// kvmesh routes LLM requests across vLLM / SGLang replicas on token load, with prefix-cache
/// overlap as a discount on prefill.
#[derive(Debug, Parser)]
#[command(name = "kvmesh", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Summarise a serving trace: volume, rate, length percentiles, prefix reuse and how
    /// concentrated it is — what you need to pick a routing strategy.
    ///
    /// Reads Mooncake JSONL (`hash_ids` of 512-token blocks) and Azure LLM 2023 CSV traces.
    /// Without --trace, analyses the built-in generated multi-turn workload.
    Analyze(AnalyzeArgs),
    /// List the routing policies and what each decides on.
    Policies,
}

#[derive(Debug, Args)]
pub struct AnalyzeArgs {
    /// Trace file: `*.jsonl` (Mooncake) or `*.csv` (Azure LLM 2023). Public copies live in
    /// ../shared/traces (or $KVMESH_TRACES) in the kvmesh workspace.
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
}

/// `kvmesh policies`.
pub fn print_policies() {
    let about = |k: PolicyKind| {
        match k {
        PolicyKind::RoundRobin => "each replica in turn",
        PolicyKind::Random => "uniformly random replica",
        PolicyKind::LeastOutstandingRequests => "fewest requests in flight",
        PolicyKind::PowerOfTwo => "lower token load of two random replicas",
        PolicyKind::ConsistentHash => "hash ring on the prefix/session key, bounded load 1.25",
        PolicyKind::CacheAware => "SGLang router: prefix match > 0.5 unless load imbalanced (32 abs, 1.1 rel)",
        PolicyKind::PrefixAffinity => "Ray Serve: prefix match ≥ 0.1 unless queues differ by > 10; then power of two",
        PolicyKind::KvCost => "Dynamo KV router: prefill blocks − overlap + decode blocks, lowest wins",
        PolicyKind::WeightedScorer => "llm-d: 3·prefix + 2·queue + 2·free KV, highest wins",
        PolicyKind::TokenLoad => "kvmesh default: lowest estimated TTFT on token load, overlap as prefill discount, KV headroom as a hard limit",
    }
    };
    for k in PolicyKind::ALL {
        println!("{:<28}{}", k.as_str(), about(k));
    }
}
