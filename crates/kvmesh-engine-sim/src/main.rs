//! `kvmesh-engine-sim`: one stand-in vLLM replica (see the crate docs).

use clap::Parser;
use kvmesh_engine_sim::{EngineSimConfig, Faults};
use kvmesh_sim::engine::EngineProfile;
use std::net::SocketAddr;

/// A stand-in vLLM engine: OpenAI HTTP, vLLM-format KV events over ZMQ with replay, vLLM
/// metrics, the kvmesh simulator's step-time and prefix-cache model in real time.
#[derive(Debug, Parser)]
#[command(name = "kvmesh-engine-sim", version)]
struct Args {
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    http: SocketAddr,
    /// KV-event PUB endpoint to bind (vLLM's `endpoint`).
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    kv_events: String,
    /// Replay ROUTER endpoint to bind (vLLM's `replay_endpoint`).
    #[arg(long, default_value = "tcp://127.0.0.1:5558")]
    replay: String,
    /// Served model name.
    #[arg(long, default_value = "kvmesh-sim-llama-3-8b")]
    model: String,
    /// Engine profile: h100, a100, or a JSON profile file (see kvmesh-sim's engine docs).
    #[arg(long, default_value = "h100")]
    profile: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Time compression: step durations are divided by this.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// A LoRA adapter it serves, `NAME` or vLLM's `NAME=PATH` (the path is not read);
    /// repeat for several. Listed by `/v1/models` with the model as `parent`.
    #[arg(long = "lora-modules", num_args = 1..)]
    lora_modules: Vec<String>,
    /// A hybrid model with sliding-window layers of this window, tokens: KV events per KV
    /// cache group (full-attention group 0, sliding-window group 1).
    #[arg(long, value_name = "TOKENS")]
    sliding_window: Option<u32>,
    /// Draw each answer's length from a lognormal of this median (tokens), capped by the
    /// request's max_tokens (an answer that ends sooner stops); default: every answer is
    /// max_tokens long.
    #[arg(long, value_name = "TOKENS")]
    output_median: Option<f64>,
    /// The σ of the output lengths' logarithm (with --output-median).
    #[arg(long, default_value_t = 1.0)]
    output_sigma: f64,
    /// Seed of the output-length draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Data-parallel ranks behind the one HTTP API (vLLM `--data-parallel-size`): rank k
    /// publishes at the KV-event and replay ports + k; `X-data-parallel-rank` picks the rank.
    #[arg(long, default_value_t = 1)]
    data_parallel_size: u32,
    /// Its part in prefill/decode-disaggregated serving: both, prefill or decode (vLLM's
    /// kv_both, kv_producer, kv_consumer). Requests are served as their kv_transfer_params
    /// ask whatever the role; `GET /admin/pd` counts what came.
    #[arg(long, default_value = "both", value_parser = parse_role)]
    role: kvmesh_core::Role,
    /// A decode replica receives a prompt's KV over a link of this many Gb/s (the wait is the
    /// blocks its prefix cache lacks × block size × the profile's kv_bytes_per_token × 8 /
    /// link, ÷ --speed).
    #[arg(long, default_value_t = 100.0)]
    kv_link_gbps: f64,
    /// Fault: publish no KV events.
    #[arg(long)]
    drop_events: bool,
    /// Fault: delay every KV-event message, milliseconds.
    #[arg(long, default_value_t = 0)]
    delay_events_ms: u64,
    /// Fault: answer inference requests with this HTTP status.
    #[arg(long)]
    status: Option<u16>,
}

fn parse_role(s: &str) -> Result<kvmesh_core::Role, String> {
    s.parse()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Colour only on a terminal: tests and chaos runs redirect the log to files.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_ansi(colour)
        .init();
    let a = Args::parse();
    let profile = EngineProfile::resolve(&a.profile).map_err(anyhow::Error::msg)?;
    let config = EngineSimConfig {
        model: a.model,
        http: a.http,
        kv_events: a.kv_events,
        replay: a.replay,
        profile,
        block_size: a.block_size,
        speed: a.speed,
        data_parallel_size: a.data_parallel_size,
        role: a.role,
        kv_link_gbps: a.kv_link_gbps,
        sliding_window: a.sliding_window,
        output_lengths: a.output_median.map(|median| kvmesh_engine_sim::outputs::OutputLengths {
            median,
            sigma: a.output_sigma,
            seed: a.seed,
        }),
        lora_modules: a.lora_modules.iter().map(|m| m.split('=').next().unwrap_or(m).to_string()).collect(),
        faults: Faults {
            drop_events: a.drop_events,
            delay_events_ms: a.delay_events_ms,
            status: a.status,
            ..Faults::default()
        },
        ..EngineSimConfig::default()
    };
    let engine = kvmesh_engine_sim::start(config).await?;
    println!(
        "kvmesh-engine-sim: OpenAI API on {}, KV events on {}, replay on {}",
        engine.base_url(),
        engine.kv_events,
        engine.replay
    );
    let died = engine.stopped();
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = died => println!("kvmesh-engine-sim: died (fault injected)"),
    }
    engine.stop().await;
    Ok(())
}
