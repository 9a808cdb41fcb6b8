//! Dynamo's KV-router indexes (crates.io `dynamo-kv-router` 1.6.1, ai-dynamo/dynamo
//! `lib/kv-router/src/indexer/`): the single-threaded `RadixTree` (`radix_tree.rs`) and the
//! `ConcurrentRadixTreeCompressed` (`concurrent_radix_tree_compressed/`) behind the
//! `ThreadPoolIndexer` (`thread_pool.rs`) its KV router runs by default.
//!
//! Both take `RouterEvent`s whose stored blocks carry the engine's `block_hash` and the
//! block's `tokens_hash` (Dynamo's `LocalBlockHash`, computed by the router's event decoder
//! from the tokens before the indexer sees them, so not timed here), and queries of
//! `LocalBlockHash`es. Answers are `OverlapScores` (worker → matched blocks), with
//! `early_exit` off so every worker's depth is exact.

use super::Index;
use crate::workload::{Op, Query};
use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};
use rustc_hash::FxHashMap;

/// Turns workload ops into `RouterEvent`s, numbering each worker's events.
#[derive(Default)]
struct Events {
    next_id: FxHashMap<u32, u64>,
}

impl Events {
    fn of(&mut self, op: &Op) -> Option<RouterEvent> {
        let (engine, data) = match op {
            Op::Store { engine, parent, blocks } => (
                *engine,
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: blocks
                        .iter()
                        .map(|b| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(b.engine_id),
                            tokens_hash: LocalBlockHash(b.local),
                            mm_extra_info: None,
                        })
                        .collect(),
                }),
            ),
            Op::Remove { engine, engine_ids } => (
                *engine,
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: engine_ids.iter().map(|&h| ExternalSequenceBlockHash(h)).collect(),
                }),
            ),
            Op::Query(_) => return None,
        };
        let id = self.next_id.entry(engine).or_insert(0);
        *id += 1;
        Some(RouterEvent::new(engine as u64, KvCacheEvent { event_id: *id, data, dp_rank: 0 }))
    }
}

fn locals(q: &Query) -> Vec<LocalBlockHash> {
    q.locals.iter().map(|&l| LocalBlockHash(l)).collect()
}

fn scores_into(scores: OverlapScores, out: &mut Vec<(u32, u32)>) {
    out.clear();
    out.extend(scores.scores.iter().filter(|(_, &d)| d > 0).map(|(w, &d)| (w.worker_id as u32, d)));
    out.sort_unstable();
}

/// Dynamo's single-threaded `RadixTree`.
pub struct DynamoRadixTree {
    tree: RadixTree,
    events: Events,
    errors: u64,
}

impl DynamoRadixTree {
    /// An empty tree.
    pub fn new() -> Self {
        DynamoRadixTree { tree: RadixTree::new(), events: Events::default(), errors: 0 }
    }
}

impl Default for DynamoRadixTree {
    fn default() -> Self {
        Self::new()
    }
}

impl Index for DynamoRadixTree {
    type Event = RouterEvent;
    type Query = Vec<LocalBlockHash>;
    type Answer = OverlapScores;

    fn name(&self) -> &'static str {
        "Dynamo RadixTree"
    }

    fn query_includes(&self) -> &'static str {
        "find_matches on LocalBlockHashes (precomputed), early_exit off"
    }

    fn event(&mut self, op: &Op) -> Option<RouterEvent> {
        self.events.of(op)
    }

    fn query_input(&self, q: &Query) -> Self::Query {
        locals(q)
    }

    fn apply(&mut self, event: RouterEvent) {
        self.errors += self.tree.apply_event(event).is_err() as u64;
    }

    fn query(&self, q: Self::Query) -> OverlapScores {
        self.tree.find_matches(q, false)
    }

    fn answer(&self, a: OverlapScores, out: &mut Vec<(u32, u32)>) {
        scores_into(a, out);
    }

    fn apply_errors(&self) -> u64 {
        self.errors
    }
}

/// Dynamo's `ConcurrentRadixTreeCompressed` behind a `ThreadPoolIndexer`: events go to its
/// worker thread(s) over a channel; queries run on the caller's thread.
pub struct DynamoConcurrent {
    pool: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    events: Events,
    runtime: tokio::runtime::Runtime,
}

impl DynamoConcurrent {
    /// An empty tree with `threads` event threads (Dynamo's default `router_event_threads` is
    /// 4; the sequential passes use 1 so its apply is measured on one core like the others).
    pub fn new(threads: usize) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime");
        let pool =
            runtime.block_on(async { ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), threads, 16) });
        DynamoConcurrent { pool, events: Events::default(), runtime }
    }

    /// The shared tree (queries may run on any thread).
    pub fn backend(&self) -> &ConcurrentRadixTreeCompressed {
        self.pool.backend()
    }

    /// Queues one event for the worker threads.
    pub fn enqueue(&self, event: RouterEvent) {
        self.pool.enqueue_event(event).expect("the indexer's workers are running");
    }
}

impl Index for DynamoConcurrent {
    type Event = RouterEvent;
    type Query = Vec<LocalBlockHash>;
    type Answer = OverlapScores;

    fn name(&self) -> &'static str {
        "Dynamo ConcurrentRadixTreeCompressed (ThreadPoolIndexer)"
    }

    fn query_includes(&self) -> &'static str {
        "find_matches on LocalBlockHashes (precomputed) on the caller's thread, early_exit off"
    }

    fn event(&mut self, op: &Op) -> Option<RouterEvent> {
        self.events.of(op)
    }

    fn query_input(&self, q: &Query) -> Self::Query {
        locals(q)
    }

    fn apply(&mut self, event: RouterEvent) {
        self.enqueue(event);
    }

    fn flush(&mut self) {
        self.runtime.block_on(self.pool.flush_and_wait()).expect("the indexer's workers are running");
    }

    fn query(&self, q: Self::Query) -> OverlapScores {
        self.pool.backend().find_matches(&q, false)
    }

    fn answer(&self, a: OverlapScores, out: &mut Vec<(u32, u32)>) {
        scores_into(a, out);
    }
}

/// Dynamo's concurrent tree with the workload's queries prepared, for [`crate::run::concurrent_pass`].
pub struct SharedConcurrent {
    inner: DynamoConcurrent,
    events: std::sync::Mutex<Events>,
    queries: Vec<Vec<LocalBlockHash>>,
}

impl SharedConcurrent {
    /// An empty tree with one event thread.
    pub fn new(w: &crate::workload::Workload) -> Self {
        SharedConcurrent {
            inner: DynamoConcurrent::new(1),
            events: std::sync::Mutex::new(Events::default()),
            queries: w.queries.iter().map(locals).collect(),
        }
    }
}

impl super::Shared for SharedConcurrent {
    fn write(&self, op: &Op) {
        let event = self.events.lock().expect("no writer panics").of(op);
        if let Some(event) = event {
            self.inner.enqueue(event);
        }
    }

    fn read(&self, q: usize) -> usize {
        self.inner.backend().find_matches(&self.queries[q], false).scores.len()
    }

    fn settle(&self) {
        self.inner.runtime.block_on(self.inner.pool.flush_and_wait()).expect("the indexer's workers are running");
    }
}
