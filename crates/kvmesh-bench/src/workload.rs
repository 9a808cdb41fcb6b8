//! The side-by-side workload: a Mooncake trace played onto N simulated engines, as the KV
//! events each engine would publish and the routing queries a router would ask, each query
//! with its ground truth.
//!
//! Blocks: the trace's 512-token `hash_ids` re-chunked into 16-token blocks — block k of a
//! request comes from `hash_ids[k / 32]`, sub-block `k % 32` — so requests that share leading
//! `hash_ids` share leading blocks. A block has a *local* hash (its tokens: what Dynamo's tree
//! is keyed by) and an *engine* id chained from its parent's (what vLLM publishes as
//! `block_hash` and names in removals); kvmesh receives the tokens and re-hashes them.
//!
//! Engines: each request goes to one engine drawn with a seeded RNG; each engine is an LRU of
//! `2^20 / N` blocks ([`EngineCache`]), so the fleet holds ~1,048,576 (block, engine) entries.
//! A request touches its cached prefix, evicts leaf-first for what it adds, and stores its
//! suffix in events of at most [`WorkloadConfig::store_chunk`] blocks; the vLLM-shaped
//! variant stores prefill chunks of 512 blocks (vLLM's default 8,192-token chunk), evicting
//! per chunk as the free queue would, then its output one block per event (decode).
//!
//! Queries: the first [`WorkloadConfig::query_blocks`] blocks of every request that has that
//! many, asked once before the request's own events ("pre": what a router sees when it
//! routes) and once after ("post": the chosen engine then holds them all). Only after the
//! fleet is full. The truth is each engine's longest leading run, from a naive map of which
//! engines hold each block.

use crate::engine::EngineCache;
use kvmesh_sim::trace::Trace;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rustc_hash::FxHashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Tokens per block.
pub const BLOCK_TOKENS: u32 = 16;
/// Blocks per Mooncake `hash_ids` entry (512 / 16).
const SUB_BLOCKS: usize = 32;

/// How events are cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// The suffix in events of at most `store_chunk` blocks, evictions in one removal before.
    Chunked,
    /// vLLM-shaped: 512-block prefill chunks each after its own evictions, then the output one
    /// block per event.
    Vllm,
}

/// Workload parameters.
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    /// Simulated engines.
    pub engines: usize,
    /// (block, engine) entries the fleet holds when full; each engine holds `total / engines`.
    pub total_blocks: usize,
    /// Event shape.
    pub variant: Variant,
    /// Blocks per stored event in [`Variant::Chunked`].
    pub store_chunk: usize,
    /// Blocks per query.
    pub query_blocks: usize,
    /// Requests of the trace used (from its start); `None` for all.
    pub max_requests: Option<usize>,
    /// Seeds the engine each request goes to.
    pub seed: u64,
}

impl WorkloadConfig {
    /// The shape for `engines` engines: 2^20 entries, 128-block stores, 256-block
    /// queries, the whole trace, seed 1.
    pub fn new(engines: usize, variant: Variant) -> Self {
        WorkloadConfig {
            engines,
            total_blocks: 1 << 20,
            variant,
            store_chunk: 128,
            query_blocks: 256,
            max_requests: None,
            seed: 1,
        }
    }
}

/// One block: its tokens' hash and its engine id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    /// Hash of the block's tokens alone (Dynamo's `LocalBlockHash`; seeds [`tokens_of`]).
    pub local: u64,
    /// The engine's id for the block, chained from its parent's (vLLM's `block_hash`).
    pub engine_id: u64,
}

/// When a query is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Before the request's own events.
    Pre,
    /// After them.
    Post,
}

/// One routing query and what every index must answer.
#[derive(Debug, Clone)]
pub struct Query {
    /// Before or after the request's events.
    pub phase: Phase,
    /// The queried blocks' local hashes, in order.
    pub locals: Vec<u64>,
    /// `(engine, leading blocks held)` for every engine holding the first block, by engine.
    pub truth: Vec<(u32, u32)>,
}

/// One step of the workload, in order.
#[derive(Debug, Clone)]
pub enum Op {
    /// An engine stored blocks under a parent.
    Store {
        /// The engine, 0-based.
        engine: u32,
        /// The engine's id of the block they follow; `None` for a prompt's first block.
        parent: Option<u64>,
        /// The blocks, in sequence order.
        blocks: Vec<Block>,
    },
    /// An engine evicted blocks.
    Remove {
        /// The engine, 0-based.
        engine: u32,
        /// The engine's ids of the evicted blocks.
        engine_ids: Vec<u64>,
    },
    /// A query (index into [`Workload::queries`]).
    Query(usize),
}

/// The whole workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Steps in order.
    pub ops: Vec<Op>,
    /// The queries the ops name.
    pub queries: Vec<Query>,
    /// Ops before the fleet was full (not timed).
    pub warm_ops: usize,
    /// Engines.
    pub engines: usize,
    /// Requests played.
    pub requests: usize,
    /// (block, engine) entries the fleet holds at the end.
    pub entries: usize,
}

impl Workload {
    /// Blocks stored plus blocks removed in `ops[from..]`.
    pub fn event_blocks(&self, from: usize) -> u64 {
        self.ops[from..]
            .iter()
            .map(|op| match op {
                Op::Store { blocks, .. } => blocks.len() as u64,
                Op::Remove { engine_ids, .. } => engine_ids.len() as u64,
                Op::Query(_) => 0,
            })
            .sum()
    }
}

/// The 16 token ids of the block whose local hash is `local` (deterministic, so every engine
/// and index sees the same tokens for the same block).
pub fn tokens_of(local: u64) -> impl Iterator<Item = u32> {
    (0..BLOCK_TOKENS as u64).map(move |j| xxh3_64_with_seed(&j.to_le_bytes(), local) as u32)
}

/// The fleet model the workload is generated from: engines, and which engines hold each block.
struct Fleet {
    engines: Vec<EngineCache>,
    holders: FxHashMap<u64, Vec<u32>>,
    held: usize,
}

impl Fleet {
    fn insert(&mut self, e: u32, id: u64) {
        if !self.engines[e as usize].holds(id) {
            self.holders.entry(id).or_default().push(e);
            self.held += 1;
        }
        self.engines[e as usize].touch(id);
    }

    /// Evicts from engine `e` until `room` more blocks fit; returns the evicted ids.
    fn make_room(&mut self, e: u32, room: usize) -> Vec<u64> {
        let cache = &mut self.engines[e as usize];
        let mut out = Vec::new();
        while cache.len() + room > cache.capacity() {
            let Some(id) = cache.evict() else { break };
            out.push(id);
        }
        for id in &out {
            let hs = self.holders.get_mut(id).expect("held blocks are in the holder map");
            hs.retain(|&x| x != e);
            if hs.is_empty() {
                self.holders.remove(id);
            }
        }
        self.held -= out.len();
        out
    }

    /// Each engine's longest leading run of `chain`.
    fn truth(&self, chain: &[Block]) -> Vec<(u32, u32)> {
        let Some(first) = self.holders.get(&chain[0].engine_id) else { return Vec::new() };
        let mut active: Vec<u32> = first.clone();
        let mut out = Vec::new();
        for (i, b) in chain.iter().enumerate().skip(1) {
            let hs = self.holders.get(&b.engine_id).map_or(&[][..], Vec::as_slice);
            active.retain(|e| {
                let keep = hs.contains(e);
                if !keep {
                    out.push((*e, i as u32));
                }
                keep
            });
            if active.is_empty() {
                break;
            }
        }
        out.extend(active.iter().map(|&e| (e, chain.len() as u32)));
        out.sort_unstable();
        out
    }
}

/// The blocks of a request's prompt: `n` blocks from its `hash_ids`.
fn prompt_blocks(hash_ids: &[u64], n: usize) -> Vec<Block> {
    let mut parent = 0x6b76_6d65_7368u64;
    (0..n)
        .map(|k| {
            let local = xxh3_64_with_seed(&((k % SUB_BLOCKS) as u64).to_le_bytes(), hash_ids[k / SUB_BLOCKS]);
            parent = xxh3_64_with_seed(&local.to_le_bytes(), parent);
            Block { local, engine_id: parent }
        })
        .collect()
}

/// Plays `trace` onto the engines of `config`.
pub fn build(trace: &Trace, config: &WorkloadConfig) -> Workload {
    let n_engines = config.engines.max(1);
    let capacity = (config.total_blocks / n_engines).max(1);
    let mut fleet = Fleet {
        engines: (0..n_engines).map(|_| EngineCache::new(capacity)).collect(),
        holders: FxHashMap::default(),
        held: 0,
    };
    let mut rng = SmallRng::seed_from_u64(config.seed);
    let mut w =
        Workload { ops: Vec::new(), queries: Vec::new(), warm_ops: 0, engines: n_engines, requests: 0, entries: 0 };
    let full_at = (capacity * n_engines) as f64 * 0.99;
    let mut full = false;
    let requests = trace.requests.iter().filter(|r| !r.block_ids.is_empty());
    for (i, r) in requests.take(config.max_requests.unwrap_or(usize::MAX)).enumerate() {
        w.requests += 1;
        let n = (r.input_tokens / BLOCK_TOKENS) as usize;
        let n = n.min(r.block_ids.len() * SUB_BLOCKS).min(capacity);
        if n == 0 {
            continue;
        }
        let blocks = prompt_blocks(&r.block_ids, n);
        let e = rng.random_range(0..n_engines) as u32;
        if !full && fleet.held as f64 >= full_at {
            full = true;
            w.warm_ops = w.ops.len();
        }
        let query = full && n >= config.query_blocks;
        if query {
            ask(&mut w, &fleet, Phase::Pre, &blocks[..config.query_blocks]);
        }
        let cached = blocks.iter().take_while(|b| fleet.engines[e as usize].holds(b.engine_id)).count();
        // The cached prefix is in use: most recent, so the evictions below spare it.
        for b in blocks[..cached].iter().rev() {
            fleet.engines[e as usize].touch(b.engine_id);
        }
        let chunk = match config.variant {
            Variant::Chunked => {
                let room = n - cached;
                push_removal(&mut w, e, fleet.make_room(e, room));
                config.store_chunk.max(1)
            }
            Variant::Vllm => 512,
        };
        let mut start = cached;
        while start < n {
            let end = (start + chunk).min(n);
            if config.variant == Variant::Vllm {
                push_removal(&mut w, e, fleet.make_room(e, end - start));
            }
            store(&mut w, &mut fleet, e, &blocks, start, end);
            start = end;
        }
        let mut chain = blocks;
        if config.variant == Variant::Vllm {
            let decode = ((r.output_tokens / BLOCK_TOKENS) as usize).min(capacity - n);
            let mut parent = chain[n - 1].engine_id;
            for j in 0..decode {
                let local = xxh3_64_with_seed(&(j as u64).to_le_bytes(), 0xdec0_de00_0000_0000 ^ i as u64);
                parent = xxh3_64_with_seed(&local.to_le_bytes(), parent);
                chain.push(Block { local, engine_id: parent });
                push_removal(&mut w, e, fleet.make_room(e, 1));
                let k = chain.len();
                store(&mut w, &mut fleet, e, &chain, k - 1, k);
            }
        }
        // Deepest first, so parents stay more recent than children (leaf-first eviction).
        for b in chain.iter().rev() {
            fleet.engines[e as usize].touch(b.engine_id);
        }
        if query {
            ask(&mut w, &fleet, Phase::Post, &chain[..config.query_blocks]);
        }
    }
    if !full {
        w.warm_ops = w.ops.len();
    }
    w.entries = fleet.held;
    w
}

fn ask(w: &mut Workload, fleet: &Fleet, phase: Phase, chain: &[Block]) {
    let truth = fleet.truth(chain);
    w.ops.push(Op::Query(w.queries.len()));
    w.queries.push(Query { phase, locals: chain.iter().map(|b| b.local).collect(), truth });
}

fn push_removal(w: &mut Workload, e: u32, engine_ids: Vec<u64>) {
    if !engine_ids.is_empty() {
        w.ops.push(Op::Remove { engine: e, engine_ids });
    }
}

fn store(w: &mut Workload, fleet: &mut Fleet, e: u32, chain: &[Block], start: usize, end: usize) {
    for b in chain[start..end].iter().rev() {
        fleet.insert(e, b.engine_id);
    }
    let parent = start.checked_sub(1).map(|p| chain[p].engine_id);
    w.ops.push(Op::Store { engine: e, parent, blocks: chain[start..end].to_vec() });
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_sim::trace::{TraceFormat, TraceRequest};

    fn trace(reqs: &[(u32, &[u64])]) -> Trace {
        Trace {
            format: TraceFormat::Mooncake,
            block_tokens: Some(512),
            requests: reqs
                .iter()
                .map(|&(input, ids)| TraceRequest {
                    arrival_s: 0.0,
                    input_tokens: input,
                    output_tokens: 64,
                    block_ids: ids.to_vec(),
                    max_tokens: None,
                    group: None,
                })
                .collect(),
            skipped: Vec::new(),
        }
    }

    /// Blocks per stored event, in order.
    fn store_sizes(w: &Workload) -> Vec<usize> {
        w.ops
            .iter()
            .filter_map(|op| if let Op::Store { blocks, .. } = op { Some(blocks.len()) } else { None })
            .collect()
    }

    #[test]
    fn shared_hash_ids_share_blocks_and_truth_follows_the_engines() {
        // One engine of 80 blocks; queries of 40 blocks (1,024 tokens = 64 blocks per request).
        let t = trace(&[(1024, &[1, 2]), (1024, &[1, 3]), (1024, &[1, 2])]);
        let config = WorkloadConfig {
            engines: 1,
            total_blocks: 80,
            variant: Variant::Chunked,
            store_chunk: 16,
            query_blocks: 40,
            max_requests: None,
            seed: 1,
        };
        let w = build(&t, &config);
        // Request 1 stores 64 blocks in 4 events; the fleet (80 blocks) is not full yet.
        // Request 2 shares hash_id 1 (32 blocks), adds 32: evicts 16 leaves of request 1.
        // Full from then on: request 3 is queried before (its prefix 1,2 lost its last 16
        // blocks to request 2, and the first 32 are shared) and after.
        assert_eq!(store_sizes(&w), vec![16, 16, 16, 16, 16, 16, 16]);
        let removed: Vec<usize> = w
            .ops
            .iter()
            .filter_map(|op| if let Op::Remove { engine_ids, .. } = op { Some(engine_ids.len()) } else { None })
            .collect();
        assert_eq!(removed, vec![16, 16]);
        assert_eq!(w.queries.len(), 2);
        assert_eq!((w.queries[0].phase, w.queries[0].truth.clone()), (Phase::Pre, vec![(0, 40)]));
        assert_eq!((w.queries[1].phase, w.queries[1].truth.clone()), (Phase::Post, vec![(0, 40)]));
        assert_eq!(w.queries[0].locals[..32], w.queries[1].locals[..32]);
        assert_eq!(w.event_blocks(0), 7 * 16 + 2 * 16);
        assert_eq!(w.entries, 80);
    }

    #[test]
    fn the_vllm_variant_stores_decode_blocks_one_at_a_time() {
        let t = trace(&[(1024, &[1, 2])]);
        let mut config = WorkloadConfig::new(1, Variant::Vllm);
        config.total_blocks = 1000;
        let w = build(&t, &config);
        // 64 prompt blocks in one chunk, then 64 / 16 = 4 output blocks.
        assert_eq!(store_sizes(&w), vec![64, 1, 1, 1, 1]);
        let Op::Store { parent, .. } = &w.ops[1] else { panic!("a store") };
        let Op::Store { blocks, .. } = &w.ops[0] else { panic!("a store") };
        assert_eq!(*parent, Some(blocks[63].engine_id));
    }
}
