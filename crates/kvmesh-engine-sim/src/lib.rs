//! kvmesh-engine-sim: a stand-in vLLM engine for tests, the demo and chaos runs.
//!
//! One process (or one in-process instance, [`start`]) is one replica:
//!
//! - **OpenAI HTTP** (`/v1/completions`, `/v1/chat/completions` with `stream` SSE,
//!   `/v1/models`, `/health`, `/metrics` with vLLM's metric names) — [`http`];
//! - **the engine**: kvmesh-sim's vLLM-like engine (continuous batching, chunked prefill,
//!   prefix-cached paged KV with LRU eviction, recompute preemption) run in real time, its
//!   step durations from the profile divided by `speed`; blocks its output fills are cached
//!   and announced too, as vLLM's are (each request's generated ids its own, as sampled
//!   outputs differ) — [`engine_task`];
//! - **KV events** in vLLM's wire format on a ZMQ PUB socket, with a ROUTER replay socket
//!   buffering the last messages — [`publisher`];
//! - **faults** settable at start or at runtime (`POST /admin/faults`): drop or delay events,
//!   restart the sequence, answer 400/429/503, hang, die — [`faults`];
//! - **prefill/decode disaggregation** as vLLM's `NixlConnector` plays it (and SGLang's
//!   bootstrap room, by `role`): a prefill leg answers with `kv_transfer_params`, a decode leg
//!   waits for its prompt's KV over a link of `kv_link_gbps`, loads it uncomputed and
//!   generates; `GET /admin/pd` counts each kind — [`http::PdState`].
//!
//! [`fleet`] (binary `kvmesh-fleet-sim`) is another kind of stand-in: many busy replicas'
//! KV events and metrics from one process, no serving, for measuring how many replicas one
//! node can follow.
//!
//! Prompts are tokenized with kvmesh's approximate scheme ([`kvmesh_core::prompt`]), so a
//! kvmesh node without a tokenizer computes exactly the engine's token ids.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod engine_task;
pub mod faults;
pub mod fleet;
pub mod http;
pub mod outputs;
mod page_rest;
pub mod publisher;

use anyhow::Context;
use kvmesh_sim::engine::EngineProfile;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::watch;

pub use faults::Faults;

/// How to run one stand-in engine.
#[derive(Debug, Clone)]
pub struct EngineSimConfig {
    /// Served model name (`/v1/models`, the `model` field it accepts).
    pub model: String,
    /// HTTP listen address; port 0 picks a free one.
    pub http: SocketAddr,
    /// ZMQ endpoint the KV-event PUB socket binds, e.g. `tcp://127.0.0.1:5557` (port 0: free).
    pub kv_events: String,
    /// ZMQ endpoint the replay ROUTER socket binds (port 0: free).
    pub replay: String,
    /// ZMQ topic frame of event messages.
    pub topic: String,
    /// Step-time and KV profile (β0, β1, β2, chunk, KV tokens).
    pub profile: EngineProfile,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Time compression: step durations are divided by this (1 = real time).
    pub speed: f64,
    /// Messages kept for replay.
    pub replay_buffer: usize,
    /// Faults at start.
    pub faults: Faults,
    /// LoRA adapters it serves (vLLM `--lora-modules NAME=PATH`): listed by `/v1/models`
    /// with the model as their `parent`, as vLLM lists them; a request whose `model` names
    /// one runs under it (its blocks another chain, its `BlockStored`s carrying `lora_name`).
    pub lora_modules: Vec<String>,
    /// A hybrid model's sliding-window layers, window in tokens: its KV events then come per
    /// KV cache group, as a hybrid vLLM sends them — each store and removal once for the
    /// full-attention group 0 (`kv_cache_spec_kind = "full_attention"`) and once for the
    /// sliding-window group 1 (`"sliding_window"`, `kv_cache_spec_sliding_window` = this),
    /// with the same block hashes. `None`: one group, no group fields.
    pub sliding_window: Option<u32>,
    /// Output lengths drawn from a lognormal ([`outputs`]): each request generates
    /// `min(max_tokens, L)` tokens. `None`: every request generates its `max_tokens`. An
    /// output-length hint a client sends (`x-kvmesh-expected-output-tokens`) is never read
    /// here: only a router honours it.
    pub output_lengths: Option<outputs::OutputLengths>,
    /// Data-parallel ranks behind the one HTTP API (vLLM `--data-parallel-size`): each an
    /// engine of its own with its own KV cache, publishing at `kv_events` and `replay` with
    /// the port plus its rank, its batches annotated with the rank; a request goes to the rank
    /// its `X-data-parallel-rank` header names, else to the ranks in turn; `/metrics` has one
    /// series per rank (`engine="<rank>"`). Default 1.
    pub data_parallel_size: u32,
    /// Its part in disaggregated serving ([`kvmesh_core::Role`]), as vLLM's `kv_role`
    /// (`kv_producer`, `kv_consumer`, `kv_both`). Whatever the role, a request is served as its
    /// `kv_transfer_params` ask, as a vLLM with a KV connector serves it ([`http`]); a
    /// request of the other side's kind, or a whole one on a prefill or decode replica, is
    /// counted apart (`GET /admin/pd`), for tests to see what a router sent where.
    pub role: kvmesh_core::Role,
    /// The link a decode replica receives a prompt's KV over, gigabits per second: a decode
    /// request waits `blocks × block_size × kv_bytes_per_token × 8 / (gbps × 10⁹)` seconds
    /// (÷ `speed`) for the blocks its prefix cache lacks before its engine takes it. Default
    /// 100 (RDMA-class NIC).
    pub kv_link_gbps: f64,
}

impl Default for EngineSimConfig {
    fn default() -> Self {
        EngineSimConfig {
            model: "kvmesh-sim-llama-3-8b".into(),
            http: SocketAddr::from(([127, 0, 0, 1], 0)),
            kv_events: "tcp://127.0.0.1:0".into(),
            replay: "tcp://127.0.0.1:0".into(),
            topic: "kv-events".into(),
            profile: EngineProfile::h100(),
            block_size: 16,
            speed: 1.0,
            replay_buffer: 10_000,
            faults: Faults::default(),
            lora_modules: Vec::new(),
            sliding_window: None,
            output_lengths: None,
            data_parallel_size: 1,
            role: kvmesh_core::Role::Both,
            kv_link_gbps: 100.0,
        }
    }
}

/// A running engine: where it listens, and how to stop it.
#[derive(Debug)]
pub struct EngineSim {
    /// The bound HTTP address.
    pub http: SocketAddr,
    /// The bound KV-event endpoint (`tcp://host:port`).
    pub kv_events: String,
    /// The bound replay endpoint.
    pub replay: String,
    /// Every data-parallel rank's bound KV-event and replay endpoints, by rank (rank 0's are
    /// `kv_events` and `replay`).
    pub ranks: Vec<(String, String)>,
    /// Shared fault switches.
    pub faults: Arc<faults::FaultState>,
    traceparents: Arc<std::sync::Mutex<std::collections::VecDeque<String>>>,
    asked_models: Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>,
    pd: Arc<http::PdState>,
    by_rank: Arc<Vec<std::sync::atomic::AtomicU64>>,
    stats: Vec<Arc<std::sync::Mutex<engine_task::Stats>>>,
    stop: Arc<watch::Sender<bool>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl EngineSim {
    /// The base URL of its OpenAI API.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// The W3C `traceparent` headers of the latest completion requests that carried one,
    /// oldest first (also served at `GET /admin/traceparents`).
    pub fn traceparents(&self) -> Vec<String> {
        self.traceparents.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect()
    }

    /// How many completion requests named each `model` (`""`: none), since start (also served
    /// at `GET /admin/models`).
    pub fn asked_models(&self) -> std::collections::BTreeMap<String, u64> {
        self.asked_models.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Completion requests by disaggregated kind since start: whole, prefill legs
    /// (`do_remote_decode`), decode legs (`do_remote_prefill`) — also `GET /admin/pd`.
    pub fn pd_counts(&self) -> http::PdCounts {
        self.pd.counts()
    }

    /// Completion requests each data-parallel rank was given, by rank.
    pub fn requests_by_rank(&self) -> Vec<u64> {
        self.by_rank.iter().map(|n| n.load(std::sync::atomic::Ordering::Relaxed)).collect()
    }

    /// Blocks in each rank's prefix cache now, by rank: the truth a router's index is
    /// measured against.
    pub fn cached_blocks(&self) -> Vec<u64> {
        self.stats.iter().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).cached_blocks).collect()
    }

    /// Resolves once the engine has stopped (the `die` fault, or [`EngineSim::stop`]).
    pub fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.stop.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    /// Stops serving and closes its sockets (a dead engine, as seen by a router).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            t.abort();
            let _ = t.await;
        }
    }
}

/// Starts an engine on the current tokio runtime.
///
/// # Errors
/// A bind failure (address in use, bad endpoint), or an invalid profile.
pub async fn start(config: EngineSimConfig) -> anyhow::Result<EngineSim> {
    config.profile.validate().map_err(anyhow::Error::msg).context("engine profile")?;
    anyhow::ensure!(config.speed.is_finite() && config.speed > 0.0, "speed must be positive, got {}", config.speed);
    anyhow::ensure!(config.block_size > 0, "block size must be positive");
    anyhow::ensure!(
        config.kv_link_gbps.is_finite() && config.kv_link_gbps > 0.0,
        "KV link must be positive Gb/s, got {}",
        config.kv_link_gbps
    );
    anyhow::ensure!(
        (1..=1024).contains(&config.data_parallel_size),
        "data-parallel size must be 1..=1024, got {}",
        config.data_parallel_size
    );
    let outputs = config.output_lengths.map(outputs::OutputSampler::new).transpose()?.map(Arc::new);
    let faults = Arc::new(faults::FaultState::new(config.faults.clone()));
    let (stop, stopped) = watch::channel(false);
    let stop = Arc::new(stop);
    let (mut tasks, mut ranks, mut submit, mut stats) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for rank in 0..config.data_parallel_size {
        // As vLLM's publisher of each rank binds: the configured ports plus the rank.
        let at = |ep: &str| kvmesh_events::offset_endpoint_port(ep, rank).map_err(anyhow::Error::msg);
        let of_rank =
            EngineSimConfig { kv_events: at(&config.kv_events)?, replay: at(&config.replay)?, ..config.clone() };
        let publisher = publisher::start(&of_rank, rank, faults.clone(), stopped.clone()).await?;
        let (engine, inbox) =
            engine_task::spawn(&of_rank, publisher.sender.clone(), stopped.clone(), faults.restarts())?;
        tasks.extend(publisher.tasks);
        tasks.push(engine.task);
        ranks.push((publisher.kv_events, publisher.replay));
        submit.push(inbox);
        stats.push(engine.stats);
    }
    let by_rank: Arc<Vec<std::sync::atomic::AtomicU64>> = Arc::new(ranks.iter().map(|_| Default::default()).collect());
    let listener =
        tokio::net::TcpListener::bind(config.http).await.with_context(|| format!("bind HTTP {}", config.http))?;
    let http_addr = listener.local_addr()?;
    let traceparents = Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
    let asked_models = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
    let pd = Arc::new(http::PdState {
        role: config.role,
        engine_id: format!("engine-sim-{}", http_addr.port()),
        host: http_addr.ip().to_string(),
        port: http_addr.port(),
        kv_link_gbps: config.kv_link_gbps,
        speed: config.speed,
        counts: Default::default(),
    });
    let app = http::router(http::AppState {
        model: config.model.clone(),
        lora_modules: config.lora_modules.iter().map(|m| Arc::from(m.as_str())).collect(),
        outputs,
        submit,
        stats: stats.clone(),
        by_rank: by_rank.clone(),
        turn: Default::default(),
        faults: faults.clone(),
        profile: config.profile.clone(),
        block_size: config.block_size,
        stop: stop.clone(),
        traceparents: traceparents.clone(),
        asked_models: asked_models.clone(),
        pd: pd.clone(),
    });
    let mut stop_http = stopped.clone();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_http.wait_for(|s| *s).await;
            })
            .await;
    });
    tasks.push(server);
    let (kv_events, replay) = ranks[0].clone();
    tracing::info!(http = %http_addr, %kv_events, %replay, ranks = ranks.len(), "engine-sim ready");
    Ok(EngineSim {
        http: http_addr,
        kv_events,
        replay,
        ranks,
        faults,
        traceparents,
        asked_models,
        pd,
        by_rank,
        stats,
        stop,
        tasks,
    })
}
