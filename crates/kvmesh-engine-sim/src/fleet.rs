//! A fleet emulator: N replicas' KV events and metrics from one process, at the rates a busy
//! vLLM fleet publishes them, for measuring how many replicas one router node can follow.
//!
//! Each replica is a ZMQ PUB socket sending vLLM's `[topic, seq, payload]` messages (the same
//! encoder as a single [`crate::publisher`]), stepping `steps_per_s` times a second with a
//! random phase. It models what vLLM's scheduler publishes per step (one `KVEventBatch` per
//! step that has events, none on an idle step):
//!
//! - requests arrive as a Poisson process of `request_rate` per replica; each is one of
//!   `prompts` shared system prompts (text as `kvmesh loadtest` builds it, so routed requests
//!   from the load test see real overlap) plus 16–128 unique blocks, then 64–512 output tokens;
//! - prefill runs one request at a time, `chunk_blocks` blocks per step, stored together in
//!   one `BlockStored` (a system prompt the replica holds already is a cache hit: not stored);
//! - each running sequence decodes one token per step and stores a block every `block_size`
//!   tokens (one `BlockStored` of one block, as vLLM does);
//! - finished requests' blocks become evictable, oldest request first and each request's
//!   blocks tail first (vLLM frees a sequence's blocks in reverse); a step that stores beyond
//!   `capacity_blocks` first removes that many in one `BlockRemoved`. System prompts stay.
//!
//! Each replica starts stepping when its first subscriber connects. Memory: zeromq 0.7's PUB
//! socket preallocates a 100,000-message queue (about 4 MB), so 1,024 replicas take ~4 GB.
//!
//! Metrics: one HTTP server answers `GET /r/{i}/metrics` with replica `i`'s page under vLLM's
//! metric names (running, waiting, KV usage, token counters, `cache_config_info`), by default
//! among the rest of a vLLM server's page (histograms and the like, fixed values:
//! [`FleetConfig::full_metrics_pages`]). No replay socket and no OpenAI API: the emulator is
//! for following, not serving.

use crate::page_rest::VLLM_PAGE_REST;
use anyhow::Context;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvmesh_core::index::{KvEvent, Removed, Stored};
use kvmesh_core::{EngineBlockHash, Medium};
use kvmesh_events::encode::{encode_batch, Encoding};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use zeromq::{Socket, SocketSend, ZmqMessage};

mod model;
use model::{ReplicaModel, SystemPrompts};

/// How to run the emulated fleet.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Replicas.
    pub replicas: usize,
    /// Scheduler steps per second of each replica (vLLM under load: 20–50).
    pub steps_per_s: f64,
    /// Requests per second arriving at each replica (Poisson).
    pub request_rate: f64,
    /// KV-cache capacity of each replica, blocks.
    pub capacity_blocks: usize,
    /// Tokens per block.
    pub block_size: u32,
    /// Shared system prompts.
    pub prompts: u32,
    /// Tokens of each system prompt (rounded down to whole blocks).
    pub prompt_tokens: u32,
    /// Prefill blocks per step (vLLM's chunked prefill).
    pub chunk_blocks: usize,
    /// Most sequences decoding at once per replica (vLLM `max_num_seqs`).
    pub max_running: usize,
    /// Host the sockets bind (port 0 each).
    pub host: String,
    /// Seed of every replica's generator (replica `i` uses `seed + i`).
    pub seed: u64,
    /// Serve the whole page a vLLM server exposes (the families a router reads among its
    /// latency and token-count histograms, `_created` series, HTTP and process metrics: 600
    /// lines, 60 KB), not only the families a router reads.
    pub full_metrics_pages: bool,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            replicas: 64,
            steps_per_s: 25.0,
            request_rate: 1.0,
            capacity_blocks: 4096,
            block_size: 16,
            prompts: 8,
            prompt_tokens: 1024,
            chunk_blocks: 32,
            max_running: 64,
            host: "127.0.0.1".into(),
            seed: 1,
            full_metrics_pages: true,
        }
    }
}

/// What the emulator has sent so far (all replicas).
#[derive(Debug, Default)]
pub struct FleetStats {
    /// Event batches (ZMQ messages) published.
    pub batches: AtomicU64,
    /// Blocks stored.
    pub stored: AtomicU64,
    /// Blocks removed.
    pub removed: AtomicU64,
}

/// One replica's figures for its metrics page.
#[derive(Debug, Default)]
struct PageStats {
    running: AtomicU64,
    waiting: AtomicU64,
    cached: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    finished: AtomicU64,
}

/// A running fleet.
pub struct Fleet {
    /// Each replica's KV-event endpoint (`tcp://host:port`), in replica order.
    pub kv_events: Vec<String>,
    /// Each replica's metrics URL, in replica order.
    pub metrics_urls: Vec<String>,
    /// Totals over the fleet.
    pub stats: Arc<FleetStats>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Fleet {
    /// Stops every replica and the metrics server.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            t.abort();
            let _ = t.await;
        }
    }
}

/// Binds every replica's socket and the metrics server, and starts stepping.
///
/// # Errors
/// A bad configuration (zero replicas, steps or capacity) or a bind failure.
pub async fn start(config: FleetConfig) -> anyhow::Result<Fleet> {
    anyhow::ensure!(config.replicas > 0, "replicas must be positive");
    anyhow::ensure!(config.steps_per_s.is_finite() && config.steps_per_s > 0.0, "steps_per_s must be positive");
    anyhow::ensure!(config.request_rate.is_finite() && config.request_rate >= 0.0, "request_rate must be ≥ 0");
    anyhow::ensure!(config.block_size > 0 && config.chunk_blocks > 0, "block_size and chunk_blocks must be positive");
    let prompts = Arc::new(SystemPrompts::new(&config));
    anyhow::ensure!(
        config.capacity_blocks > prompts.blocks() + 1024,
        "capacity_blocks must exceed the system prompts' {} blocks by 1,024",
        prompts.blocks()
    );
    let (stop, stopped) = watch::channel(false);
    let stats = Arc::new(FleetStats::default());
    let pages: Arc<Vec<PageStats>> = Arc::new((0..config.replicas).map(|_| PageStats::default()).collect());
    let listener = tokio::net::TcpListener::bind((config.host.as_str(), 0)).await.context("bind metrics")?;
    let metrics_addr: SocketAddr = listener.local_addr()?;
    let mut tasks = Vec::with_capacity(config.replicas + 1);
    let app = axum::Router::new().route("/r/{i}/metrics", axum::routing::get(page)).with_state(PageState {
        pages: pages.clone(),
        capacity: config.capacity_blocks,
        block_size: config.block_size,
        rest: if config.full_metrics_pages { VLLM_PAGE_REST } else { "" },
    });
    let mut stop_http = stopped.clone();
    tasks.push(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_http.wait_for(|s| *s).await;
            })
            .await;
    }));
    let mut kv_events = Vec::with_capacity(config.replicas);
    let mut metrics_urls = Vec::with_capacity(config.replicas);
    for i in 0..config.replicas {
        let mut socket = zeromq::PubSocket::new();
        let monitor = socket.monitor();
        let endpoint = format!("tcp://{}:0", config.host);
        let bound = socket.bind(&endpoint).await.with_context(|| format!("bind replica {i}'s {endpoint}"))?;
        kv_events.push(bound.to_string());
        metrics_urls.push(format!("http://{metrics_addr}/r/{i}/metrics"));
        let model = ReplicaModel::new(&config, i, prompts.clone());
        let (stats, pages, stop) = (stats.clone(), pages.clone(), stopped.clone());
        let replica = Replica { index: i, socket, monitor, model };
        tasks.push(tokio::spawn(run_replica(config.clone(), replica, stats, pages, stop)));
    }
    Ok(Fleet { kv_events, metrics_urls, stats, stop, tasks })
}

/// One emulated replica's parts.
struct Replica<M> {
    index: usize,
    socket: zeromq::PubSocket,
    /// The socket's monitor (zeromq's event stream).
    monitor: M,
    model: ReplicaModel,
}

/// Steps one replica until stopped, publishing each step's events. It starts stepping once a
/// subscriber has connected (and had a moment to subscribe): the emulated engine starts with
/// its router already following, so the router sees every event from the first. (A router
/// that joins a running engine needs its replay buffer; the emulator keeps none.)
async fn run_replica<M: futures_util::Stream<Item = zeromq::SocketEvent> + Unpin>(
    config: FleetConfig,
    replica: Replica<M>,
    stats: Arc<FleetStats>,
    pages: Arc<Vec<PageStats>>,
    mut stop: watch::Receiver<bool>,
) {
    let Replica { index: i, mut socket, mut monitor, mut model } = replica;
    loop {
        tokio::select! {
            e = futures_util::StreamExt::next(&mut monitor) => match e {
                Some(zeromq::SocketEvent::Accepted(..)) | None => break,
                Some(_) => continue,
            },
            _ = stop.wait_for(|s| *s) => return,
        }
    }
    drop(monitor);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let period = Duration::from_secs_f64(1.0 / config.steps_per_s);
    // A random phase, so a thousand replicas do not step in the same millisecond.
    let phase = period.mul_f64(model.rng.random::<f64>());
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + phase, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let topic = Bytes::from_static(b"kv-events");
    let mut seq = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let events = model.step(1.0 / config.steps_per_s);
        let page = &pages[i];
        page.running.store(model.running.len() as u64, Ordering::Relaxed);
        page.waiting.store(model.waiting.len() as u64, Ordering::Relaxed);
        page.cached.store(model.cached as u64, Ordering::Relaxed);
        page.prompt_tokens.store(model.prompt_tokens, Ordering::Relaxed);
        page.generation_tokens.store(model.generation_tokens, Ordering::Relaxed);
        page.finished.store(model.finished, Ordering::Relaxed);
        if events.is_empty() {
            continue;
        }
        for e in &events {
            match e {
                KvEvent::Stored(s) => stats.stored.fetch_add(s.block_hashes.len() as u64, Ordering::Relaxed),
                KvEvent::Removed(r) => stats.removed.fetch_add(r.block_hashes.len() as u64, Ordering::Relaxed),
                KvEvent::Cleared => 0,
            };
        }
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let payload = Bytes::from(encode_batch(ts, &events, Some(0), Encoding::Map));
        let frames = vec![topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload];
        if let Ok(msg) = ZmqMessage::try_from(frames) {
            // A PUB with no subscriber drops the message, as libzmq's does.
            let _ = socket.send(msg).await;
        }
        seq += 1;
        stats.batches.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Clone)]
struct PageState {
    pages: Arc<Vec<PageStats>>,
    capacity: usize,
    block_size: u32,
    /// The rest of a full page ([`VLLM_PAGE_REST`]), or nothing.
    rest: &'static str,
}

/// `GET /r/{i}/metrics`: replica `i`'s page, vLLM's metric names.
async fn page(State(s): State<PageState>, Path(i): Path<usize>) -> Response {
    let Some(p) = s.pages.get(i) else { return StatusCode::NOT_FOUND.into_response() };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], page_text(p, &s)).into_response()
}

/// Replica `p`'s page: the families a router reads, then `s.rest`.
fn page_text(p: &PageStats, s: &PageState) -> String {
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let labels = "engine=\"0\",model_name=\"kvmesh-sim-llama-3-8b\"";
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, value: String| {
        out.push_str(&format!("# TYPE {name} {kind}\n{name}{{{labels}}} {value}\n"));
    };
    metric("vllm:num_requests_running", "gauge", format!("{}.0", get(&p.running)));
    metric("vllm:num_requests_waiting", "gauge", format!("{}.0", get(&p.waiting)));
    metric("vllm:kv_cache_usage_perc", "gauge", format!("{}", get(&p.cached) as f64 / s.capacity as f64));
    metric("vllm:prompt_tokens_total", "counter", format!("{}.0", get(&p.prompt_tokens)));
    metric("vllm:generation_tokens_total", "counter", format!("{}.0", get(&p.generation_tokens)));
    metric("vllm:request_success_total", "counter", format!("{}.0", get(&p.finished)));
    out.push_str(&format!(
        "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0\n",
        s.block_size, s.capacity
    ));
    out.push_str(s.rest);
    out
}

#[cfg(test)]
mod tests;
