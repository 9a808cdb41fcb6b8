//! One emulated replica's model: its sequences, KV blocks, LRU evictions and the vLLM events
//! each step publishes.

use super::*;

/// The shared system prompts: their tokens and engine block hashes (the same on every replica,
/// as vLLM's content hashes are).
pub(super) struct SystemPrompts {
    /// Per prompt: (tokens, block hashes).
    pub(super) prompts: Vec<(Vec<u32>, Vec<EngineBlockHash>)>,
}

impl SystemPrompts {
    pub(super) fn new(config: &FleetConfig) -> Self {
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
    pub(super) fn blocks(&self) -> usize {
        self.prompts.iter().map(|(_, h)| h.len()).sum()
    }
}

/// An engine's id for a block: a chained content hash (vLLM's is sha256 or xxhash of the
/// parent's hash and the block's tokens).
pub(super) fn engine_hash(parent: Option<EngineBlockHash>, tokens: &[u32]) -> EngineBlockHash {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(parent.map_or(0, |p| p.0));
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    // vLLM's ids are signed 64-bit on the wire: keep them positive.
    EngineBlockHash(h.digest() >> 1)
}

/// A request in prefill or decode.
pub(super) struct Sequence {
    /// Its blocks so far (system prompt excluded), in order.
    pub(super) blocks: Vec<EngineBlockHash>,
    /// The last block stored (the parent of the next).
    pub(super) last: Option<EngineBlockHash>,
    /// Unique prompt blocks not yet prefilled.
    pub(super) prefill_left: usize,
    /// System prompt blocks not yet prefilled (0 on a cache hit).
    pub(super) system_left: usize,
    /// Which system prompt.
    pub(super) prompt: usize,
    /// Output tokens still to generate.
    pub(super) output_left: u32,
    /// Tokens in its partial last block.
    pub(super) partial: u32,
}

/// One replica's scheduler and KV cache, reduced to the events they publish.
pub(super) struct ReplicaModel {
    pub(super) rng: SmallRng,
    pub(super) prompts: Arc<SystemPrompts>,
    /// Which system prompts this replica holds.
    pub(super) holds_prompt: Vec<bool>,
    pub(super) waiting: VecDeque<Sequence>,
    /// The request in prefill (front) — one at a time.
    pub(super) prefilling: Option<Sequence>,
    pub(super) running: Vec<Sequence>,
    /// Finished requests' blocks, oldest request first, each in sequence order.
    pub(super) evictable: VecDeque<Vec<EngineBlockHash>>,
    /// Blocks in `evictable`.
    pub(super) evictable_blocks: usize,
    /// Blocks held.
    pub(super) cached: usize,
    pub(super) capacity: usize,
    pub(super) block_size: u32,
    pub(super) chunk_blocks: usize,
    pub(super) max_running: usize,
    pub(super) request_rate: f64,
    /// Token ids of unique blocks come from this counter (distinct across replicas).
    pub(super) next_token: u64,
    pub(super) prompt_tokens: u64,
    pub(super) generation_tokens: u64,
    pub(super) finished: u64,
}

impl ReplicaModel {
    pub(super) fn new(config: &FleetConfig, i: usize, prompts: Arc<SystemPrompts>) -> Self {
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
    pub(super) fn step(&mut self, dt: f64) -> Vec<KvEvent> {
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
    pub(super) fn arrive(&mut self, dt: f64) {
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
    pub(super) fn unique_blocks(&mut self, s: &mut Sequence, n: usize) -> Stored {
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

    pub(super) fn stored(
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
    pub(super) fn evict(&mut self, incoming: usize) -> Vec<EngineBlockHash> {
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
    pub(super) fn empty() -> Self {
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
