//! Flags and subcommands.

use clap::{Args, Parser, Subcommand};
use kvmesh_core::PolicyKind;
use std::path::PathBuf;

mod admin;
mod replay;
mod run;

pub use admin::{
    AutoscalerCommand, ClusterCommand, ClusterTarget, ReplicaCommand, ReplicaNameArgs, ReplicationCommand, StatusArgs,
};
pub use replay::{AnalyzeArgs, ReplayArgs};
pub use run::{DemoArgs, LoadtestArgs, NodeArgs};

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

    #[test]
    fn a_replica_is_named_by_position_or_by_name_flag_not_both() {
        let parse = |args: &[&str]| Cli::try_parse_from(["kvmesh", "replica"].iter().chain(args));
        let name = |args: &[&str]| match parse(args).unwrap().command {
            Command::Replica(ReplicaCommand::Drain(d)) => d.replica.name().to_string(),
            Command::Replica(ReplicaCommand::Remove(a) | ReplicaCommand::Undrain(a)) => a.name().to_string(),
            Command::Replica(ReplicaCommand::Ready(r)) => r.replica.name().to_string(),
            other => panic!("{other:?}"),
        };
        assert_eq!(name(&["drain", "vllm-0"]), "vllm-0");
        assert_eq!(name(&["drain", "--name", "vllm-0", "--wait"]), "vllm-0");
        assert_eq!(name(&["undrain", "vllm-1"]), "vllm-1");
        assert_eq!(name(&["ready", "--wait", "vllm-2"]), "vllm-2");
        assert_eq!(name(&["remove", "--name", "vllm-3"]), "vllm-3");
        for bad in [&["drain"][..], &["drain", "a", "--name", "b"], &["remove", "a", "b"]] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    /// Every `kvmesh …` command in a shipped manifest's scripts, with the pod's environment
    /// filled in, parses with this CLI: a renamed flag cannot leave deploy/ behind.
    #[test]
    fn the_engine_pods_lifecycle_commands_parse() {
        let yaml = include_str!("../../../../deploy/engines.yaml");
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
                    // No capacity: the router reads each pod's from its engine.
                    assert_eq!((a.capacity_blocks, a.starting), (0, true));
                    assert_eq!(a.replay.as_deref(), Some("tcp://10.0.0.7:5558"));
                }
                ReplicaCommand::Ready(r) => assert!(r.wait && r.timeout == 1800.0),
                ReplicaCommand::Drain(d) => assert!(d.wait && d.timeout == 600.0 && !d.remove),
                ReplicaCommand::Starting(a) | ReplicaCommand::Remove(a) => assert_eq!(a.name(), "vllm-7d9f-abcde"),
                ReplicaCommand::Undrain(_) => panic!("{c:?}"),
            }
        }
    }
}
