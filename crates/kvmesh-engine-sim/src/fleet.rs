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
//! metric names (running, waiting, KV usage, token counters, `cache_config_info`). No replay
//! socket and no OpenAI API: the emulator is for following, not serving.

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

/// The shared system prompts: their tokens and engine block hashes (the same on every replica,
/// as vLLM's content hashes are).
struct SystemPrompts {
    /// Per prompt: (tokens, block hashes).
    prompts: Vec<(Vec<u32>, Vec<EngineBlockHash>)>,
}

impl SystemPrompts {
    fn new(config: &FleetConfig) -> Self {
        let bs = config.block_size as usize;
        let prompts = (0..config.prompts.max(1))
            .map(|p| {
                // The text `kvmesh loadtest` sends as prompt p's shared part.
                let sentence = format!("System prompt number {p} for the load test. ");
                let text: String = sentence.chars().cycle().take(4 * config.prompt_tokens as usize).collect();
                let mut tokens = kvmesh_core::prompt::approximate_tokens(&text);
                tokens.truncate(tokens.len() / bs * bs);
                let mut parent = None;
                let hashes = tokens
                    .chunks(bs)
                    .map(|block| {
                        let h = engine_hash(parent, block);
                        parent = Some(h);
                        h
                    })
                    .collect();
                (tokens, hashes)
            })
            .collect();
        SystemPrompts { prompts }
    }

    /// Blocks of all prompts together.
    fn blocks(&self) -> usize {
        self.prompts.iter().map(|(_, h)| h.len()).sum()
    }
}

/// An engine's id for a block: a chained content hash (vLLM's is sha256 or xxhash of the
/// parent's hash and the block's tokens).
fn engine_hash(parent: Option<EngineBlockHash>, tokens: &[u32]) -> EngineBlockHash {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(parent.map_or(0, |p| p.0));
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    // vLLM's ids are signed 64-bit on the wire: keep them positive.
    EngineBlockHash(h.digest() >> 1)
}

/// A request in prefill or decode.
struct Sequence {
    /// Its blocks so far (system prompt excluded), in order.
    blocks: Vec<EngineBlockHash>,
    /// The last block stored (the parent of the next).
    last: Option<EngineBlockHash>,
    /// Unique prompt blocks not yet prefilled.
    prefill_left: usize,
    /// System prompt blocks not yet prefilled (0 on a cache hit).
    system_left: usize,
    /// Which system prompt.
    prompt: usize,
    /// Output tokens still to generate.
    output_left: u32,
    /// Tokens in its partial last block.
    partial: u32,
}

/// One replica's scheduler and KV cache, reduced to the events they publish.
struct ReplicaModel {
    rng: SmallRng,
    prompts: Arc<SystemPrompts>,
    /// Which system prompts this replica holds.
    holds_prompt: Vec<bool>,
    waiting: VecDeque<Sequence>,
    /// The request in prefill (front) — one at a time.
    prefilling: Option<Sequence>,
    running: Vec<Sequence>,
    /// Finished requests' blocks, oldest request first, each in sequence order.
    evictable: VecDeque<Vec<EngineBlockHash>>,
    /// Blocks in `evictable`.
    evictable_blocks: usize,
    /// Blocks held.
    cached: usize,
    capacity: usize,
    block_size: u32,
    chunk_blocks: usize,
    max_running: usize,
    request_rate: f64,
    /// Token ids of unique blocks come from this counter (distinct across replicas).
    next_token: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    finished: u64,
}

impl ReplicaModel {
    fn new(config: &FleetConfig, i: usize, prompts: Arc<SystemPrompts>) -> Self {
        ReplicaModel {
            rng: SmallRng::seed_from_u64(config.seed.wrapping_add(i as u64)),
            holds_prompt: vec![false; prompts.prompts.len()],
            prompts,
            waiting: VecDeque::new(),
            prefilling: None,
            running: Vec::new(),
            evictable: VecDeque::new(),
            evictable_blocks: 0,
            cached: 0,
            capacity: config.capacity_blocks,
            block_size: config.block_size,
            chunk_blocks: config.chunk_blocks,
            max_running: config.max_running,
            request_rate: config.request_rate,
            next_token: (i as u64) << 40,
            prompt_tokens: 0,
            generation_tokens: 0,
            finished: 0,
        }
    }

    /// One scheduler step of `dt` seconds: its events (removals first), empty when idle.
    fn step(&mut self, dt: f64) -> Vec<KvEvent> {
        self.arrive(dt);
        let mut stores: Vec<Stored> = Vec::new();
        if self.prefilling.is_none() && self.running.len() < self.max_running {
            // Admitted only when its whole prompt and output fit beside what the running
            // sequences will still grow by (vLLM would preempt instead; this model never needs to).
            let bs = self.block_size as usize;
            let need = |s: &Sequence| s.system_left + s.prefill_left + (s.output_left as usize).div_ceil(bs) + 1;
            let growing: usize = self.running.iter().map(|s| (s.output_left as usize).div_ceil(bs) + 1).sum();
            let free = (self.capacity + self.evictable_blocks).saturating_sub(self.cached + growing);
            if self.waiting.front().is_some_and(|s| need(s) <= free) {
                self.prefilling = self.waiting.pop_front();
                // A prompt another request prefilled since this one arrived is a cache hit.
                if let Some(s) = self.prefilling.as_mut().filter(|s| self.holds_prompt[s.prompt]) {
                    s.system_left = 0;
                }
            }
        }
        if let Some(mut s) = self.prefilling.take() {
            let mut budget = self.chunk_blocks;
            if s.system_left > 0 {
                let (tokens, hashes) = &self.prompts.prompts[s.prompt];
                let done = hashes.len() - s.system_left;
                let n = s.system_left.min(budget);
                let bs = self.block_size as usize;
                stores.push(self.stored(
                    hashes[done..done + n].to_vec(),
                    done.checked_sub(1).map(|d| hashes[d]),
                    tokens[done * bs..(done + n) * bs].to_vec(),
                ));
                s.system_left -= n;
                budget -= n;
                if s.system_left == 0 {
                    self.holds_prompt[s.prompt] = true;
                }
            }
            if s.system_left == 0 && budget > 0 && s.prefill_left > 0 {
                let n = s.prefill_left.min(budget);
                stores.push(self.unique_blocks(&mut s, n));
                s.prefill_left -= n;
            }
            if s.system_left == 0 && s.prefill_left == 0 {
                self.running.push(s);
            } else {
                self.prefilling = Some(s);
            }
        }
        let mut finished = Vec::new();
        for k in 0..self.running.len() {
            let mut s = std::mem::replace(&mut self.running[k], Sequence::empty());
            s.output_left -= 1;
            s.partial += 1;
            self.generation_tokens += 1;
            if s.partial == self.block_size {
                s.partial = 0;
                stores.push(self.unique_blocks(&mut s, 1));
            }
            if s.output_left == 0 {
                finished.push(k);
            }
            self.running[k] = s;
        }
        for k in finished.into_iter().rev() {
            let s = self.running.swap_remove(k);
            self.evictable_blocks += s.blocks.len();
            self.evictable.push_back(s.blocks);
            self.finished += 1;
        }
        let new_blocks: usize = stores.iter().map(|s| s.block_hashes.len()).sum();
        let mut events = Vec::with_capacity(stores.len() + 1);
        let removed = self.evict(new_blocks);
        if !removed.is_empty() {
            events.push(KvEvent::Removed(Removed { block_hashes: removed, medium: Medium::Gpu, kv_group: None }));
        }
        self.cached += new_blocks;
        events.extend(stores.into_iter().map(KvEvent::Stored));
        events
    }

    /// Poisson arrivals over `dt` seconds.
    fn arrive(&mut self, dt: f64) {
        let mut left = dt;
        loop {
            // Exponential gaps: the next arrival falls within this step or not.
            let gap = -(1.0 - self.rng.random::<f64>()).ln() / self.request_rate.max(1e-12);
            if gap > left {
                break;
            }
            left -= gap;
            let prompt = self.rng.random_range(0..self.prompts.prompts.len());
            let system_left = if self.holds_prompt[prompt] { 0 } else { self.prompts.prompts[prompt].1.len() };
            let prefill_left = self.rng.random_range(16..=128);
            self.prompt_tokens += (self.prompts.prompts[prompt].1.len() + prefill_left) as u64 * self.block_size as u64;
            let last = self.prompts.prompts[prompt].1.last().copied();
            self.waiting.push_back(Sequence {
                blocks: Vec::new(),
                last,
                prefill_left,
                system_left,
                prompt,
                output_left: self.rng.random_range(64..=512),
                partial: 0,
            });
        }
    }

    /// `n` new unique blocks of `s`, chained to its last one.
    fn unique_blocks(&mut self, s: &mut Sequence, n: usize) -> Stored {
        let bs = self.block_size as usize;
        let mut tokens = Vec::with_capacity(n * bs);
        let mut hashes = Vec::with_capacity(n);
        let parent = s.last;
        for _ in 0..n {
            let block: Vec<u32> = (0..bs)
                .map(|_| {
                    self.next_token += 1;
                    (self.next_token % 32_000) as u32 ^ ((self.next_token >> 20) as u32 & 0x7fff)
                })
                .collect();
            let h = engine_hash(s.last, &block);
            s.last = Some(h);
            s.blocks.push(h);
            hashes.push(h);
            tokens.extend_from_slice(&block);
        }
        self.stored(hashes, parent, tokens)
    }

    fn stored(
        &self,
        block_hashes: Vec<EngineBlockHash>,
        parent: Option<EngineBlockHash>,
        token_ids: Vec<u32>,
    ) -> Stored {
        Stored {
            block_hashes,
            parent,
            token_ids,
            block_size: self.block_size,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: None,
            kv_group: None,
        }
    }

    /// Frees room for `incoming` blocks: the evicted blocks' ids.
    fn evict(&mut self, incoming: usize) -> Vec<EngineBlockHash> {
        let mut out = Vec::new();
        while self.cached + incoming > self.capacity {
            let Some(front) = self.evictable.front_mut() else { break };
            // In sequence order, so popping from the back frees the tail first.
            let Some(block) = front.pop() else {
                self.evictable.pop_front();
                continue;
            };
            out.push(block);
            self.evictable_blocks -= 1;
            self.cached -= 1;
        }
        out
    }
}

impl Sequence {
    fn empty() -> Self {
        Sequence {
            blocks: Vec::new(),
            last: None,
            prefill_left: 0,
            system_left: 0,
            prompt: 0,
            output_left: 0,
            partial: 0,
        }
    }
}

#[derive(Clone)]
struct PageState {
    pages: Arc<Vec<PageStats>>,
    capacity: usize,
    block_size: u32,
}

/// `GET /r/{i}/metrics`: replica `i`'s page, vLLM's metric names.
async fn page(State(s): State<PageState>, Path(i): Path<usize>) -> Response {
    let Some(p) = s.pages.get(i) else { return StatusCode::NOT_FOUND.into_response() };
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
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], out).into_response()
}

#[cfg(test)]
mod tests;
