//! One simulated vLLM-like engine replica.
//!
//! Continuous batching with chunked prefill, as vLLM v1 schedules
//! (`vllm/v1/core/sched/scheduler.py`): each step first serves running sequences (one decode
//! token each, or the next prefill chunk) and then admits waiting ones in arrival order while
//! the step's token budget, the batch limit and the KV cache allow. Admission looks up the
//! prompt's leading full blocks in the prefix cache; cached blocks are not recomputed. When a
//! running sequence needs a block and none can be had, the most recently admitted sequence is
//! preempted (its blocks freed; the output it already sent stands, its KV is recomputed) and
//! requeued at the front. A step takes
//! `β0 + β1·prefill tokens + β2·decode tokens` seconds. At the end of a step the engine
//! reports first tokens, finished requests and the KV events of the step (evictions, then
//! newly cached blocks), in vLLM's event shapes.

mod kv;
mod profile;
mod seq;
use seq::Seq;

pub use kv::KvCache;
pub use profile::EngineProfile;

use kvmesh_core::index::{KvEvent, Removed, Stored};
use kvmesh_core::{BlockHasher, EngineBlockHash, Medium};
use std::collections::VecDeque;
use std::sync::Arc;

/// A request as the engine receives it.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// The simulation's request id.
    pub id: u64,
    /// Prompt tokens.
    pub tokens: Arc<[u32]>,
    /// Tokens to generate (at least 1).
    pub output_tokens: u32,
    /// The LoRA adapter it runs under, if any: its blocks are another chain than the base
    /// model's (vLLM's block hash includes the adapter) and its `BlockStored`s name it.
    pub lora: Option<Arc<str>>,
    /// Its prompt's KV comes from a prefill replica (a disaggregated decode request, vLLM's
    /// `kv_transfer_params.do_remote_prefill`): the blocks it does not find cached are loaded,
    /// not computed — admitted whole, outside the step's token budget, at no compute cost (the
    /// transfer's time is the caller's to wait before enqueueing).
    pub remote_prefill: bool,
}

/// What one step produced.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Requests whose first token came out at the end of the step, with their cached prompt
    /// tokens (prefix hits at their first admission).
    pub first_tokens: Vec<(u64, u32)>,
    /// Requests that generated a token after their first in the step (a decode step).
    pub decoded: Vec<u64>,
    /// Requests that finished in the step.
    pub finished: Vec<u64>,
    /// KV events of the step, in order.
    pub events: Vec<KvEvent>,
    /// Prefill tokens computed in the step.
    pub prefill_tokens: u64,
}

/// One engine replica.
#[derive(Debug)]
pub struct Engine {
    profile: EngineProfile,
    block_size: u32,
    hasher: BlockHasher,
    kv: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    stepping: bool,
    /// Prefill tokens not yet computed, over waiting and running sequences, tokens.
    pending_prefill: u64,
    /// Sequences preempted so far (their KV freed, to be recomputed).
    preemptions: u64,
    /// Whether blocks filled during decode enter the prefix cache (vLLM caches every full
    /// block, output included); otherwise only prompt blocks are cached.
    output_blocks: bool,
}

impl Engine {
    /// An idle engine with an empty cache. `hasher` is the engine's own block hashing (its ids
    /// are opaque to the router); its block size is the engine's.
    pub fn new(profile: EngineProfile, hasher: BlockHasher) -> Self {
        let block_size = hasher.block_size();
        let kv = KvCache::new(profile.kv_blocks(block_size));
        Engine {
            profile,
            block_size,
            hasher,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stepping: false,
            pending_prefill: 0,
            preemptions: 0,
            output_blocks: false,
        }
    }

    /// Caches the blocks a sequence fills while decoding — as vLLM's `KVCacheManager` caches
    /// every full block, prompt or output (`vllm/v1/core/kv_cache_manager.py`, `cache_blocks`
    /// after each step), announcing each in a `BlockStored`. Generated token ids are
    /// [`output_token`]s, so two requests' outputs differ as sampled ones do. Off by default:
    /// a trace's next turn never repeats the simulated output, so in trace replays such
    /// blocks could only take room in the LRU.
    pub fn with_output_blocks(mut self) -> Self {
        self.output_blocks = true;
        self
    }

    /// The engine's profile.
    pub fn profile(&self) -> &EngineProfile {
        &self.profile
    }

    /// Queues a request.
    pub fn enqueue(&mut self, req: EngineRequest) {
        let hasher = req.lora.as_deref().map_or(self.hasher, |l| self.hasher.for_adapter(l));
        let hashes = hasher.hash_blocks(&req.tokens).into_iter().map(|h| h.0).collect();
        self.pending_prefill += req.tokens.len() as u64;
        self.waiting.push_back(Seq {
            req,
            hashes,
            computed: 0,
            cached_tokens: None,
            generated: 0,
            shared: 0,
            private: 0,
            scheduled: 0,
        });
    }

    /// Leading full blocks of `tokens` (under LoRA adapter `lora`) this engine's prefix cache
    /// does not hold, plus the partial last block: what a decode replica of a disaggregated
    /// pair still has to receive from its prefill replica (NIXL pulls only those).
    pub fn lacking_blocks(&self, tokens: &[u32], lora: Option<&str>) -> u64 {
        let hasher = lora.map_or(self.hasher, |l| self.hasher.for_adapter(l));
        let held = hasher.hash_blocks(tokens).iter().take_while(|h| self.kv.contains(h.0)).count();
        tokens.len().div_ceil(self.block_size as usize) as u64 - held as u64
    }

    /// Whether a step is in flight.
    pub fn stepping(&self) -> bool {
        self.stepping
    }

    /// Whether any request is queued or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// `(running, waiting, KV usage 0..1)`, as vLLM's metrics endpoint reports them.
    pub fn metrics(&self) -> (u32, u32, f64) {
        (
            self.running.len() as u32,
            self.waiting.len() as u32,
            self.kv.active() as f64 / self.kv.capacity().max(1) as f64,
        )
    }

    /// Prefill tokens still to compute here (a waiting request's whole prompt, since its cache
    /// hit is known only at admission), tokens: the engine's true prefill queue.
    pub fn pending_prefill(&self) -> u64 {
        self.pending_prefill
    }

    /// Sequences preempted so far: their KV freed when a running sequence needed a block and
    /// none was free, their prompt and output so far recomputed when readmitted.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// The KV cache.
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Schedules the next step; returns its duration in seconds, or `None` when there is
    /// nothing to run. Requests that can never fit — prompt plus output larger than the KV
    /// cache, which vLLM rejects up front (`max_model_len`) — are dropped and their ids
    /// appended to `rejected`.
    pub fn start_step(&mut self, rejected: &mut Vec<u64>) -> Option<f64> {
        debug_assert!(!self.stepping);
        let bs = self.block_size as u64;
        let mut budget = self.profile.chunk_tokens;
        let (mut prefill, mut decode, mut loaded) = (0u64, 0u64, 0u64);
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            let seq = &self.running[i];
            let want = match (seq.prefilling(), seq.req.remote_prefill) {
                (true, true) => seq.remaining_prefill() as u32,
                (true, false) => (seq.remaining_prefill() as u32).min(budget),
                (false, _) => budget.min(1),
            };
            if want == 0 {
                self.running[i].scheduled = 0;
                i += 1;
                continue;
            }
            let tokens_after = seq.computed as u64 + want as u64;
            let need = tokens_after.div_ceil(bs).saturating_sub(seq.held());
            if !self.kv.reserve(need) {
                // Preempt the most recently admitted sequence (possibly this one) and retry.
                let victim = self.running.pop().expect("running is not empty");
                self.requeue(victim);
                self.preemptions += 1;
                preempted = true;
                continue;
            }
            self.kv.alloc_private(need);
            let seq = &mut self.running[i];
            seq.private += need;
            seq.scheduled = want;
            if seq.prefilling() && seq.req.remote_prefill {
                loaded += want as u64;
            } else if seq.prefilling() {
                budget -= want;
                prefill += want as u64;
            } else {
                budget -= want;
                decode += 1;
            }
            i += 1;
        }
        while !preempted && budget > 0 && (self.running.len() as u32) < self.profile.max_batch {
            let Some(mut seq) = self.waiting.pop_front() else { break };
            let lifetime_blocks = (seq.prompt() as u64 + seq.req.output_tokens as u64).div_ceil(bs);
            if lifetime_blocks > self.kv.capacity() {
                self.pending_prefill -= seq.remaining_prefill();
                rejected.push(seq.req.id);
                continue;
            }
            // Prefix hit: leading full blocks already cached, leaving at least one token.
            let max_hit = ((seq.prompt() - 1) / self.block_size) as usize;
            let hit = seq.hashes.iter().take(max_hit).take_while(|h| self.kv.contains(**h)).count();
            let computed = hit as u32 * self.block_size;
            let want = if seq.req.remote_prefill {
                seq.prefill_target() - computed
            } else {
                (seq.prefill_target() - computed).min(budget)
            };
            let need = (computed as u64 + want as u64).div_ceil(bs) - hit as u64;
            // As vLLM's `allocate_slots`: check the room first (hits nobody references leave
            // the evictable pool once taken), and touch the cache only if the request fits, so
            // a request that waits does not reorder the LRU.
            let taken_from_pool = seq.hashes[..hit].iter().filter(|h| self.kv.is_evictable(**h)).count() as u64;
            if self.kv.available() < need + taken_from_pool {
                self.waiting.push_front(seq);
                break;
            }
            for h in &seq.hashes[..hit] {
                self.kv.acquire(*h);
            }
            if !self.kv.reserve(need) {
                // Unreachable (room was checked); undo tail first, as vLLM frees.
                for h in seq.hashes[..hit].iter().rev() {
                    self.kv.release(*h);
                }
                self.waiting.push_front(seq);
                break;
            }
            seq.shared = hit;
            seq.computed = computed;
            self.kv.alloc_private(need);
            self.pending_prefill -= seq.computed as u64;
            seq.cached_tokens.get_or_insert(seq.computed);
            seq.private = need;
            seq.scheduled = want;
            if seq.req.remote_prefill {
                loaded += want as u64;
            } else {
                budget -= want;
                prefill += want as u64;
            }
            self.running.push(seq);
        }
        if prefill + decode + loaded == 0 {
            return None;
        }
        self.stepping = true;
        let p = &self.profile;
        Some(p.step_overhead_s + p.prefill_s_per_token * prefill as f64 + p.decode_s_per_token * decode as f64)
    }

    /// Aborts request `id` (its client went away, as vLLM aborts on disconnect): it leaves the
    /// queue or the batch, and its blocks are freed (cached prompt blocks stay cached,
    /// evictable). Returns whether it was here.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.req.id == id) {
            let seq = self.waiting.remove(i).expect("position is in range");
            self.pending_prefill -= seq.remaining_prefill();
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.req.id == id) {
            let seq = self.running.remove(i);
            // Tokens scheduled in the step in flight were counted out of the queue only when
            // the step finishes, which this request will not see.
            self.pending_prefill -= seq.remaining_prefill();
            self.free(&seq);
            return true;
        }
        false
    }

    /// Drops the request at the head of the queue (one that cannot be scheduled even on an
    /// idle engine); returns its id.
    pub fn reject_head(&mut self) -> Option<u64> {
        let seq = self.waiting.pop_front()?;
        self.pending_prefill -= seq.remaining_prefill();
        Some(seq.req.id)
    }

    /// Completes the step in flight: advances every scheduled sequence and reports what came
    /// out.
    pub fn finish_step(&mut self) -> StepOutcome {
        self.stepping = false;
        let mut out = StepOutcome::default();
        let evicted = self.kv.take_evicted();
        if !evicted.is_empty() {
            let block_hashes = evicted.into_iter().map(EngineBlockHash).collect();
            out.events.push(KvEvent::Removed(Removed { block_hashes, medium: Medium::Gpu, kv_group: None }));
        }
        let bs = self.block_size as usize;
        let mut k = 0;
        while k < self.running.len() {
            let seq = &mut self.running[k];
            let n = std::mem::take(&mut seq.scheduled);
            let mut done = false;
            if n > 0 && seq.prefilling() {
                seq.computed += n;
                if !seq.req.remote_prefill {
                    out.prefill_tokens += n as u64;
                }
                self.pending_prefill -= n as u64;
                // Newly full prompt blocks enter the prefix cache.
                let full = (seq.computed as usize / bs).min(seq.hashes.len());
                if full > seq.shared {
                    let from = seq.shared;
                    // Only blocks new to the cache are announced: a block another sequence
                    // cached meanwhile is shared, not stored twice.
                    let mut run_start = None;
                    for b in from..=full {
                        let stored = b < full && self.kv.promote(seq.hashes[b]);
                        match (stored, run_start) {
                            (true, None) => run_start = Some(b),
                            (false, Some(start)) => {
                                out.events.push(stored_event(seq, start, b, self.block_size));
                                run_start = None;
                            }
                            _ => {}
                        }
                    }
                    seq.private -= (full - from) as u64;
                    seq.shared = full;
                }
                // The first token comes out when the prompt is done; a resumed request (after
                // a preemption) has sent it already and just goes back to decoding.
                if !seq.prefilling() && seq.generated == 0 {
                    seq.generated = 1;
                    out.first_tokens.push((seq.req.id, seq.cached_tokens.unwrap_or(0)));
                    done = seq.generated >= seq.req.output_tokens;
                }
            } else if n > 0 {
                seq.computed += 1;
                seq.generated += 1;
                out.decoded.push(seq.req.id);
                done = seq.generated >= seq.req.output_tokens;
                // A block just filled by this token's KV (the previous output token's, as a
                // decode step writes): cached and announced like a prompt block.
                if self.output_blocks {
                    let b = seq.computed as usize / bs;
                    if (seq.computed as usize).is_multiple_of(bs)
                        && b == seq.hashes.len() + 1
                        && seq.shared == seq.hashes.len()
                    {
                        let tokens = seq_tokens(seq, (b - 1) * bs, b * bs);
                        let parent = seq.hashes.last().map(|&h| kvmesh_core::BlockHash(h));
                        // A sequence's first block carries its adapter in its seed.
                        let hasher = match (&seq.req.lora, parent) {
                            (Some(l), None) => self.hasher.for_adapter(l),
                            _ => self.hasher,
                        };
                        seq.hashes.push(hasher.hash_block(parent, &tokens).0);
                        seq.private -= 1;
                        seq.shared += 1;
                        if self.kv.promote(seq.hashes[b - 1]) {
                            out.events.push(stored_event(seq, b - 1, b, self.block_size));
                        }
                    }
                }
            }
            if done {
                let seq = self.running.remove(k);
                out.finished.push(seq.req.id);
                self.free(&seq);
            } else {
                k += 1;
            }
        }
        out
    }

    /// Releases a sequence's blocks tail first, as vLLM's `KVCacheManager.free` does, so a
    /// cached chain is evicted from its end and its leading blocks stay usable longest.
    fn free(&mut self, seq: &Seq) {
        for h in seq.hashes[..seq.shared].iter().rev() {
            self.kv.release(*h);
        }
        self.kv.free_private(seq.private);
    }

    /// Preempts a sequence: its blocks are freed (cached ones stay cached, evictable) and it
    /// goes back to the front of the queue; its output so far stands, and it will recompute
    /// its prompt and generated tokens (vLLM's recompute preemption).
    fn requeue(&mut self, mut seq: Seq) {
        self.free(&seq);
        let before = seq.remaining_prefill();
        seq.computed = 0;
        seq.shared = 0;
        seq.private = 0;
        seq.scheduled = 0;
        self.pending_prefill += seq.remaining_prefill() - before;
        self.waiting.push_front(seq);
    }
}

/// The id of the `k`-th generated token (0-based) of request `id` when output blocks are
/// cached: a mix of both, standing for a sampled token.
pub fn output_token(id: u64, k: u64) -> u32 {
    let mut z = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ k.wrapping_add(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 30)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as u32
}

/// Tokens `from..to` of `seq`: its prompt, then its generated tokens.
fn seq_tokens(seq: &Seq, from: usize, to: usize) -> Vec<u32> {
    let prompt = seq.req.tokens.len();
    (from..to)
        .map(|i| seq.req.tokens.get(i).copied().unwrap_or_else(|| output_token(seq.req.id, (i - prompt) as u64)))
        .collect()
}

/// vLLM's `BlockStored` for blocks `from..to` of `seq` (prompt blocks, then blocks filled by
/// its output).
fn stored_event(seq: &Seq, from: usize, to: usize, block_size: u32) -> KvEvent {
    let bs = block_size as usize;
    KvEvent::Stored(Stored {
        block_hashes: seq.hashes[from..to].iter().map(|&h| EngineBlockHash(h)).collect(),
        parent: from.checked_sub(1).map(|p| EngineBlockHash(seq.hashes[p])),
        token_ids: seq_tokens(seq, from * bs, to * bs),
        block_size,
        medium: Medium::Gpu,
        lora_name: seq.req.lora.as_deref().map(str::to_string),
        extra_keys: None,
        kv_group: None,
    })
}

#[cfg(test)]
mod tests;
