//! The engine loop: kvmesh-sim's engine stepping in real time (step durations ÷ `speed`),
//! fed by HTTP requests, answering each with its first token, its decode tokens and its end.

use crate::EngineSimConfig;
use kvmesh_core::hashing::Namespace;
use kvmesh_core::index::KvEvent;
use kvmesh_core::BlockHasher;
use kvmesh_sim::engine::{Engine, EngineRequest};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// What a request hears from the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// The first token, with the prompt tokens served from the prefix cache.
    FirstToken {
        /// Prompt tokens that were prefix-cache hits.
        cached_tokens: u32,
    },
    /// One more generated token.
    Token,
    /// The request is complete.
    Done,
    /// The engine cannot ever run it (prompt plus output larger than the KV cache).
    Rejected,
}

/// One request for the engine.
#[derive(Debug)]
pub struct Submission {
    /// Prompt token ids.
    pub tokens: Arc<[u32]>,
    /// Tokens to generate (at least 1).
    pub output_tokens: u32,
    /// The LoRA adapter it names (one of the engine's `lora_modules`), if any.
    pub lora: Option<Arc<str>>,
    /// A decode leg of a disaggregated request: its prompt's KV comes from a prefill replica
    /// ([`kvmesh_sim::engine::EngineRequest::remote_prefill`]), the blocks the engine's prefix
    /// cache lacks taking this many seconds each (real time) before the engine takes it.
    pub transfer_s_per_block: Option<f64>,
    /// Where its outputs go; dropping the receiver aborts the request at its next token.
    pub outputs: mpsc::UnboundedSender<Output>,
}

/// Engine counters for `/metrics`, in vLLM's terms.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    /// Requests in the running batch.
    pub running: u32,
    /// Requests waiting.
    pub waiting: u32,
    /// Fraction of KV blocks held by running requests.
    pub kv_usage: f64,
    /// Prompt tokens computed (prefill), total.
    pub prompt_tokens_total: u64,
    /// Tokens generated, total.
    pub generation_tokens_total: u64,
    /// Prompt tokens served from the prefix cache, total.
    pub prefix_cache_hits_total: u64,
    /// Requests finished, total.
    pub requests_total: u64,
    /// Blocks in the prefix cache now (what a router's index should hold).
    pub cached_blocks: u64,
}

/// The running loop.
pub struct EngineTask {
    /// Its counters.
    pub stats: Arc<Mutex<Stats>>,
    /// Its task.
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts the loop.
///
/// # Errors
/// An invalid block size.
pub fn spawn(
    config: &EngineSimConfig,
    events: mpsc::UnboundedSender<Vec<KvEvent>>,
    mut stop: watch::Receiver<bool>,
    mut restarts: watch::Receiver<u64>,
) -> anyhow::Result<(EngineTask, mpsc::UnboundedSender<Submission>)> {
    // The engine's own block ids are opaque to routers: seed them apart from kvmesh's hashes.
    let ns = Namespace { model: format!("engine-sim/{}", config.model), ..Namespace::default() };
    let hasher = BlockHasher::new(config.block_size, &ns)?;
    let profile = config.profile.clone();
    let fresh = move || Engine::new(profile.clone(), hasher).with_output_blocks();
    let mut engine = fresh();
    let (submit, mut inbox) = mpsc::unbounded_channel::<Submission>();
    let stats = Arc::new(Mutex::new(Stats::default()));
    let shared = stats.clone();
    let speed = config.speed;
    let sliding_window = config.sliding_window;
    let task = tokio::spawn(async move {
        let mut waiters: HashMap<u64, mpsc::UnboundedSender<Output>> = HashMap::new();
        let mut next_id = 0u64;
        let mut rejected = Vec::new();
        // Decode legs whose KV is on its way: (when it has arrived, the submission).
        let mut transfers: Vec<(tokio::time::Instant, Submission)> = Vec::new();
        let mut enqueue = |engine: &mut Engine, waiters: &mut HashMap<u64, _>, s: Submission| {
            next_id += 1;
            engine.enqueue(EngineRequest {
                id: next_id,
                tokens: s.tokens,
                output_tokens: s.output_tokens.max(1),
                lora: s.lora,
                remote_prefill: s.transfer_s_per_block.is_some(),
            });
            waiters.insert(next_id, s.outputs);
        };
        // A decode leg waits for the blocks its cache lacks; anything else goes in at once.
        let arrive = |engine: &Engine, transfers: &mut Vec<(tokio::time::Instant, Submission)>, s: Submission| match s
            .transfer_s_per_block
        {
            Some(per_block) => {
                let lacking = engine.lacking_blocks(&s.tokens, s.lora.as_deref());
                let at = tokio::time::Instant::now() + Duration::from_secs_f64(per_block * lacking as f64);
                transfers.push((at, s));
                None
            }
            None => Some(s),
        };
        loop {
            while let Ok(s) = inbox.try_recv() {
                if let Some(s) = arrive(&engine, &mut transfers, s) {
                    enqueue(&mut engine, &mut waiters, s);
                }
            }
            let now = tokio::time::Instant::now();
            while let Some(k) = transfers.iter().position(|(at, _)| *at <= now) {
                let (_, s) = transfers.swap_remove(k);
                enqueue(&mut engine, &mut waiters, s);
            }
            let next_transfer = transfers.iter().map(|(at, _)| *at).min();
            rejected.clear();
            let step = engine.start_step(&mut rejected);
            for id in rejected.drain(..) {
                if let Some(w) = waiters.remove(&id) {
                    let _ = w.send(Output::Rejected);
                }
            }
            let Some(duration) = step else {
                if engine.has_work() {
                    // Nothing fits even on an idle engine: refuse the head instead of spinning.
                    if let Some(w) = engine.reject_head().and_then(|id| waiters.remove(&id)) {
                        let _ = w.send(Output::Rejected);
                    }
                    continue;
                }
                publish_stats(&engine, &shared, None);
                let transfer_done = async {
                    match next_transfer {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    s = inbox.recv() => match s {
                        Some(s) => {
                            if let Some(s) = arrive(&engine, &mut transfers, s) {
                                enqueue(&mut engine, &mut waiters, s);
                            }
                        }
                        None => break,
                    },
                    () = transfer_done => {}
                    _ = stop.wait_for(|s| *s) => break,
                    Ok(()) = restarts.changed() => {
                        transfers.clear();
                        restart(&mut engine, fresh(), &mut waiters, &shared, &events);
                    }
                }
                continue;
            };
            // The batch as scheduled, as vLLM's scheduler stats show it during a step (not the
            // state after the previous one, which shows an engine mid-prefill as idle).
            publish_stats(&engine, &shared, None);
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs_f64(duration / speed)) => {}
                _ = stop.wait_for(|s| *s) => break,
                Ok(()) = restarts.changed() => {
                    transfers.clear();
                    restart(&mut engine, fresh(), &mut waiters, &shared, &events);
                    continue;
                }
            }
            let out = engine.finish_step();
            // A client that went away drops its receiver: abort its request, as vLLM does.
            let mut gone = Vec::new();
            for &(id, cached_tokens) in &out.first_tokens {
                if waiters.get(&id).is_some_and(|w| w.send(Output::FirstToken { cached_tokens }).is_err()) {
                    gone.push(id);
                }
            }
            for &id in &out.decoded {
                if waiters.get(&id).is_some_and(|w| w.send(Output::Token).is_err()) {
                    gone.push(id);
                }
            }
            for id in gone {
                if !out.finished.contains(&id) {
                    engine.abort(id);
                }
                waiters.remove(&id);
            }
            for id in &out.finished {
                if let Some(w) = waiters.remove(id) {
                    let _ = w.send(Output::Done);
                }
            }
            let generated = (out.first_tokens.len() + out.decoded.len()) as u64;
            let hits: u64 = out.first_tokens.iter().map(|&(_, c)| c as u64).sum();
            publish_stats(&engine, &shared, Some((out.prefill_tokens, generated, hits, out.finished.len() as u64)));
            if !out.events.is_empty() {
                let _ = events.send(match sliding_window {
                    Some(window) => per_group(out.events, window),
                    None => out.events,
                });
            }
        }
    });
    Ok((EngineTask { stats, task }, submit))
}

/// A hybrid model's events: each store and removal for the full-attention group 0, then for
/// the sliding-window group 1 of `window` tokens (the same block hashes: vLLM names a block
/// alike in every group).
fn per_group(events: Vec<KvEvent>, window: u32) -> Vec<KvEvent> {
    use kvmesh_core::index::KvGroup;
    let group = |idx: u32| KvGroup {
        idx,
        kind: Some(if idx == 0 { "full_attention" } else { "sliding_window" }.into()),
        sliding_window: (idx == 1).then_some(window),
    };
    let mut out = Vec::with_capacity(events.len() * 2);
    for e in events {
        match e {
            KvEvent::Stored(s) => {
                out.push(KvEvent::Stored(kvmesh_core::index::Stored { kv_group: Some(group(0)), ..s.clone() }));
                out.push(KvEvent::Stored(kvmesh_core::index::Stored { kv_group: Some(group(1)), ..s }));
            }
            KvEvent::Removed(r) => {
                out.push(KvEvent::Removed(kvmesh_core::index::Removed { kv_group: Some(0), ..r.clone() }));
                out.push(KvEvent::Removed(kvmesh_core::index::Removed { kv_group: Some(1), ..r }));
            }
            other => out.push(other),
        }
    }
    out
}

/// The engine process restarted: `engine` becomes `new` (an empty cache), the requests in
/// flight are cut (their outputs closed, as a dead process's connections are), the counters
/// start from 0, and the publisher is told with an empty batch — in order with the batches
/// before it, so none of the old engine's is numbered as the new one's.
fn restart(
    engine: &mut Engine,
    new: Engine,
    waiters: &mut HashMap<u64, mpsc::UnboundedSender<Output>>,
    stats: &Mutex<Stats>,
    events: &mpsc::UnboundedSender<Vec<KvEvent>>,
) {
    *engine = new;
    let _ = events.send(Vec::new());
    waiters.clear();
    *stats.lock().unwrap_or_else(|p| p.into_inner()) = Stats::default();
    tracing::info!("engine-sim restarted (restart_engine fault): cache emptied, counters from 0");
}

fn publish_stats(engine: &Engine, stats: &Mutex<Stats>, step: Option<(u64, u64, u64, u64)>) {
    let (running, waiting, kv_usage) = engine.metrics();
    let mut s = stats.lock().unwrap_or_else(|p| p.into_inner());
    s.running = running;
    s.waiting = waiting;
    s.kv_usage = kv_usage;
    s.cached_blocks = engine.kv().cached();
    if let Some((prefill, generated, hits, finished)) = step {
        // As vLLM counts it: whole prompts, cached tokens included (vllm/v1/metrics/stats.py).
        s.prompt_tokens_total += prefill + hits;
        s.generation_tokens_total += generated;
        s.prefix_cache_hits_total += hits;
        s.requests_total += finished;
    }
}
