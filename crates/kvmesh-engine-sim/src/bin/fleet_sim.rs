//! `kvmesh-fleet-sim`: N emulated vLLM replicas' KV events and metrics from one process (see
//! [`kvmesh_engine_sim::fleet`]), and the kvmesh node config that follows them.

use clap::Parser;
use kvmesh_engine_sim::fleet::{self, FleetConfig};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Emulates a fleet of busy vLLM replicas for one kvmesh node to follow: per replica a ZMQ PUB
/// socket with vLLM-format KV events (one batch per scheduler step: prefill chunks stored
/// together, decode blocks one at a time, LRU removals) and a vLLM metrics page. Prints the
/// events it sends every 5 s.
#[derive(Debug, Parser)]
#[command(name = "kvmesh-fleet-sim", version)]
struct Args {
    /// Replicas to emulate.
    #[arg(long, default_value_t = 64)]
    replicas: usize,
    /// Scheduler steps per second of each replica (vLLM under load: 20–50).
    #[arg(long, default_value_t = 25.0)]
    steps_per_s: f64,
    /// Requests per second arriving at each replica.
    #[arg(long, default_value_t = 1.0)]
    request_rate: f64,
    /// KV-cache capacity of each replica, blocks.
    #[arg(long, default_value_t = 4096)]
    capacity_blocks: usize,
    /// Shared system prompts (`kvmesh loadtest --prefixes`).
    #[arg(long, default_value_t = 8)]
    prompts: u32,
    /// Tokens of each system prompt (`kvmesh loadtest --prefix-tokens`).
    #[arg(long, default_value_t = 1024)]
    prompt_tokens: u32,
    /// Seed of the replicas' generators.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Serve each replica's metrics as only the families a router reads, instead of a vLLM
    /// server's whole page (600 lines, 60 KB, mostly histograms).
    #[arg(long)]
    minimal_metrics_pages: bool,
    /// Write a kvmesh node config following this fleet here.
    #[arg(long, value_name = "FILE")]
    node_config: Option<PathBuf>,
    /// The written node's HTTP address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    node_http: String,
    /// The written node's gRPC address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    node_grpc: String,
    /// Stop after this many seconds (0: at Ctrl-C).
    #[arg(long, default_value_t = 0.0)]
    duration: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let a = Args::parse();
    let config = FleetConfig {
        replicas: a.replicas,
        steps_per_s: a.steps_per_s,
        request_rate: a.request_rate,
        capacity_blocks: a.capacity_blocks,
        prompts: a.prompts,
        prompt_tokens: a.prompt_tokens,
        seed: a.seed,
        full_metrics_pages: !a.minimal_metrics_pages,
        ..FleetConfig::default()
    };
    let block_size = config.block_size;
    let fleet = fleet::start(config).await?;
    if let Some(path) = &a.node_config {
        let mut toml = format!(
            "# Written by kvmesh-fleet-sim: a node following {} emulated replicas.\n[node]\nhttp = \"{}\"\ngrpc = \"{}\"\nblock_size = {block_size}\n",
            a.replicas, a.node_http, a.node_grpc
        );
        for (i, (events, metrics)) in fleet.kv_events.iter().zip(&fleet.metrics_urls).enumerate() {
            // The emulator serves no OpenAI API: `http` is where a real engine's would be.
            let http = metrics.trim_end_matches("/metrics");
            let _ = write!(
                toml,
                "\n[[replicas]]\nname = \"r{i}\"\nhttp = \"{http}\"\nkv_events = \"{events}\"\nmetrics_url = \"{metrics}\"\ncapacity_blocks = {}\n",
                a.capacity_blocks
            );
        }
        std::fs::write(path, toml).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    println!("kvmesh-fleet-sim: {} replicas publishing; node config: {:?}", a.replicas, a.node_config);
    let start = Instant::now();
    let mut report = tokio::time::interval(Duration::from_secs(5));
    report.tick().await;
    let until = (a.duration > 0.0).then(|| Duration::from_secs_f64(a.duration));
    loop {
        tokio::select! {
            _ = report.tick() => {
                let s = &fleet.stats;
                println!(
                    "kvmesh-fleet-sim: {:.0} s: {} batches, {} blocks stored, {} removed",
                    start.elapsed().as_secs_f64(),
                    s.batches.load(Ordering::Relaxed),
                    s.stored.load(Ordering::Relaxed),
                    s.removed.load(Ordering::Relaxed)
                );
            }
            r = tokio::signal::ctrl_c() => { r?; break; }
        }
        if until.is_some_and(|u| start.elapsed() >= u) {
            break;
        }
    }
    fleet.stop().await;
    Ok(())
}
