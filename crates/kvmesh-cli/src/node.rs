//! `kvmesh node`: runs a router node until Ctrl-C or SIGTERM; SIGHUP reloads the replicas.

use crate::cli::NodeArgs;
use anyhow::Context;
use kvmesh_node::config::NodeConfig;

/// Every configuration key (generated from the config types by t09_config_reference).
const REFERENCE: &str = include_str!("../../../docs/configuration.md");

pub fn run(args: &NodeArgs) -> anyhow::Result<()> {
    if args.reference {
        return crate::emit(REFERENCE);
    }
    let format: kvmesh_node::telemetry::LogFormat = args.log_format.parse().map_err(anyhow::Error::msg)?;
    let config = with_cluster_flags(NodeConfig::read(args.config_path())?, args, true)?;
    if args.check {
        return check(&config, args);
    }
    // A multi-thread runtime (one worker per core by default) so one slow handler cannot
    // stall event ingest. `--workers` caps it for machines whose cores other processes share.
    // The HTTP proxy is not on it: it has its own thread(s) (`node.proxy_threads`).
    // Names this node in exported traces: its cluster id, else its HTTP address.
    let instance = match &config.cluster {
        Some(c) => format!("node-{}", c.id),
        None => config.node.http.to_string(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(
            args.workers.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())).max(1),
        )
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async {
        // Inside the runtime: the OTLP batch exporter runs on it.
        let telemetry = kvmesh_node::telemetry::Telemetry::init(
            format,
            args.otlp_endpoint.as_deref(),
            "info,openraft=error,openraft::replication=off",
            &instance,
        )?;
        let node = kvmesh_node::start(config).await?;
        // With JSON logs every line a log shipper reads is JSON: the banner is a log event.
        let json = format == kvmesh_node::telemetry::LogFormat::Json;
        let say = |line: String| {
            if json {
                tracing::info!("{line}");
            } else {
                println!("kvmesh node: {line}");
            }
        };
        say(format!("OpenAI API and /metrics on http://{}, gRPC on {}", node.http, node.grpc));
        if let Some(c) = &node.cluster {
            say(format!("cluster member {} at {}, Raft data in {}", c.id, c.addr, c.section.data_dir.display()));
        }
        wait_for_stop(&node, args).await;
        say("stopping".into());
        node.stop().await;
        telemetry.shutdown().await;
        Ok(())
    })
}

/// `--check`: what `kvmesh_node::start` verifies before it binds anything
/// ([`kvmesh_node::preflight::check`]), then what it would run and every warning.
fn check(config: &NodeConfig, args: &NodeArgs) -> anyhow::Result<()> {
    let path = args.config_path().display();
    let pre = kvmesh_node::preflight::check(config).map_err(|e| anyhow::anyhow!("{path}: {e:#}"))?;
    // The policy by the name metrics and the cluster use (`token-load` is `token_load`).
    let policy =
        config.node.policy.parse::<kvmesh_core::PolicyKind>().map_or(config.node.policy.as_str(), |k| k.as_str());
    let mut out = format!(
        "{path}: ok — policy {policy}, {} replica(s), HTTP {}, gRPC {}",
        config.replicas.len(),
        config.node.http,
        config.node.grpc
    );
    if let Some(c) = &config.cluster {
        out += &format!(", cluster node {} ({} configured peer(s))", c.id, c.peers.len());
    }
    out.push('\n');
    // The services off by default, when this file turns them on.
    let mut on = Vec::new();
    if config.autoscaler.enabled {
        let p = &config.autoscaler.policy;
        on.push(format!("autoscaler ({}–{} replicas)", p.min_replicas, p.max_replicas));
    }
    if config.admission.enabled {
        let slo = config.admission.ttft_slo.map(|s| format!(", TTFT SLO {}", kvmesh_node::config::human(s)));
        on.push(format!("admission (queue ≤ {}{})", config.admission.queue_limit, slo.unwrap_or_default()));
    }
    if config.replication.enabled {
        on.push("hot-prefix replication".into());
    }
    if pre.tls.is_some() {
        on.push("TLS".into());
    }
    if let Some(t) = &config.node.tokenizer {
        on.push(format!("tokenizer {}", t.display()));
    }
    if !on.is_empty() {
        out += &format!("also on: {}\n", on.join(", "));
    }
    for warning in pre.warnings {
        out += &format!("warning: {warning}\n");
    }
    crate::emit(&out)
}

/// Applies `--http`, `--grpc`, `--id`, `--raft-addr`, `--peers` and `--data-dir` (or their
/// environment variables) over the file; `--id` alone makes a `[cluster]` section. Then refuses
/// what the node would refuse, and with `to_start` the files it names that are not there.
fn with_cluster_flags(mut config: NodeConfig, args: &NodeArgs, to_start: bool) -> anyhow::Result<NodeConfig> {
    if let Some(a) = args.http {
        config.node.http = a;
    }
    if let Some(a) = args.grpc {
        config.node.grpc = a;
    }
    let any = args.id.is_some() || args.raft_addr.is_some() || args.peers.is_some() || args.data_dir.is_some();
    if any {
        apply_cluster_flags(config.cluster.get_or_insert_with(Default::default), args);
    }
    if let (true, Some(c)) = (args.insecure, config.cluster.as_mut()) {
        c.insecure = true;
    }
    // Every refusal at once, each at its line: one run shows the whole fix.
    if to_start {
        config.validate_file_to_start(args.config_path())?;
    } else {
        config.validate_file(args.config_path())?;
    }
    Ok(config)
}

fn apply_cluster_flags(c: &mut kvmesh_node::config::ClusterSection, args: &NodeArgs) {
    if let Some(id) = args.id {
        c.id = id;
    }
    if let Some(a) = &args.raft_addr {
        c.addr = a.clone();
    }
    if let Some(p) = &args.peers {
        c.peers = p.iter().filter(|s| !s.trim().is_empty()).cloned().collect();
    }
    if let Some(d) = &args.data_dir {
        c.data_dir = d.clone();
    }
}

#[cfg(unix)]
async fn wait_for_stop(node: &kvmesh_node::Node, args: &NodeArgs) {
    let path = args.config_path();
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut hup)) = (signal(SignalKind::terminate()), signal(SignalKind::hangup())) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return,
            _ = term.recv() => return,
            // (A reload reads no token, TLS or tokenizer file: one gone since the start is not
            // its business.)
            _ = hup.recv() => match NodeConfig::read(path).and_then(|c| with_cluster_flags(c, args, false)) {
                Ok(c) => match node.reload(&c).await {
                    Ok(()) => tracing::info!(config = %path.display(), "replicas reloaded"),
                    Err(e) => tracing::error!(error = %e, "reload failed; keeping the current replicas"),
                },
                Err(e) => tracing::error!(error = %e, "reload failed; keeping the current replicas"),
            },
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_stop(_node: &kvmesh_node::Node, _args: &NodeArgs) {
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    #[test]
    fn a_reload_does_not_refuse_a_file_only_a_start_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvmesh.toml");
        let toml = "[node]\ntokenizer = \"/nonexistent/tokenizer.json\"\n\n[[replicas]]\nname = \"vllm-0\"\n\
                    http = \"http://10.0.0.7:8000\"\ncapacity_blocks = 100\n";
        std::fs::write(&path, toml).unwrap();
        let cli = Cli::try_parse_from(["kvmesh", "node", "--config", path.to_str().unwrap()]).unwrap();
        let Command::Node(args) = cli.command else { panic!("a node command") };
        let read = || NodeConfig::read(&path).unwrap();
        let start = with_cluster_flags(read(), &args, true).unwrap_err().to_string();
        assert!(start.ends_with("kvmesh.toml:2: node.tokenizer names /nonexistent/tokenizer.json, which cannot be read: No such file or directory (os error 2); fix the path, or remove the key (without it, prompts are counted approximately)"), "{start}");
        // SIGHUP's reload applies the replicas and reads no tokenizer: the file is not its concern.
        assert_eq!(with_cluster_flags(read(), &args, false).unwrap().replicas.len(), 1);
    }
}
