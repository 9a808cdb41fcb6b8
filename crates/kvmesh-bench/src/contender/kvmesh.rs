//! kvmesh's [`PrefixIndex`]: takes vLLM-shaped events with token ids (it re-hashes them into
//! its own chained block hashes), and queries of precomputed block hashes.

use super::Index;
use crate::workload::{tokens_of, Op, Query, BLOCK_TOKENS};
use kvmesh_core::index::{KvEvent, PublishedIndex, Removed, Stored};
use kvmesh_core::{BlockHash, BlockHasher, EngineBlockHash, Medium, Namespace, Overlap, PrefixIndex, ReplicaId};
use std::cell::RefCell;

/// kvmesh's index.
pub struct Kvmesh {
    index: PrefixIndex,
    hasher: BlockHasher,
    out: RefCell<Vec<(ReplicaId, Overlap)>>,
    errors: u64,
}

impl Kvmesh {
    /// An empty index for 16-token blocks.
    pub fn new() -> Self {
        let hasher = BlockHasher::new(BLOCK_TOKENS, &Namespace::default()).expect("block size 16");
        Kvmesh { index: PrefixIndex::new(hasher), hasher, out: RefCell::new(Vec::new()), errors: 0 }
    }

    /// The index.
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }
}

impl Default for Kvmesh {
    fn default() -> Self {
        Self::new()
    }
}

/// A query's block hashes as kvmesh computes them from the tokens.
pub fn block_hashes(hasher: &BlockHasher, q: &Query) -> Vec<BlockHash> {
    let tokens: Vec<u32> = q.locals.iter().flat_map(|&l| tokens_of(l)).collect();
    hasher.hash_blocks(&tokens)
}

/// `op` as the kvmesh event vLLM's stream decodes to.
pub fn event_of(op: &Op) -> Option<(ReplicaId, KvEvent)> {
    match op {
        Op::Store { engine, parent, blocks } => Some((
            ReplicaId(*engine),
            KvEvent::Stored(Stored {
                block_hashes: blocks.iter().map(|b| EngineBlockHash(b.engine_id)).collect(),
                parent: parent.map(EngineBlockHash),
                token_ids: blocks.iter().flat_map(|b| tokens_of(b.local)).collect(),
                block_size: BLOCK_TOKENS,
                medium: Medium::Gpu,
                lora_name: None,
                extra_keys: None,
                kv_group: None,
            }),
        )),
        Op::Remove { engine, engine_ids } => Some((
            ReplicaId(*engine),
            KvEvent::Removed(Removed {
                block_hashes: engine_ids.iter().map(|&h| EngineBlockHash(h)).collect(),
                medium: Medium::Gpu,
                kv_group: None,
            }),
        )),
        Op::Query(_) => None,
    }
}

impl Index for Kvmesh {
    type Event = (ReplicaId, KvEvent);
    type Query = Vec<BlockHash>;
    type Answer = ();

    fn name(&self) -> &'static str {
        "kvmesh PrefixIndex"
    }

    fn query_includes(&self) -> &'static str {
        "lookup only (block hashes precomputed); events include re-hashing the tokens"
    }

    fn event(&mut self, op: &Op) -> Option<Self::Event> {
        event_of(op)
    }

    fn query_input(&self, q: &Query) -> Self::Query {
        block_hashes(&self.hasher, q)
    }

    fn apply(&mut self, (replica, event): Self::Event) {
        self.errors += self.index.apply(replica, &event).rejection.is_some() as u64;
    }

    fn query(&self, q: Self::Query) {
        let mut found = self.out.borrow_mut();
        found.clear();
        self.index.overlaps(&q, &mut found);
    }

    fn answer(&self, (): (), out: &mut Vec<(u32, u32)>) {
        out.clear();
        out.extend(self.out.borrow().iter().map(|(r, o)| (r.0, o.gpu)));
    }

    fn apply_errors(&self) -> u64 {
        self.errors
    }
}

/// kvmesh's index shared by a writer and readers the way a node shares it: a
/// [`PublishedIndex`] (two copies; readers take the one not being written and never wait for
/// the writer), each event one write, as the node's ingest applies a batch per write.
pub struct SharedKvmesh {
    index: PublishedIndex,
    queries: Vec<Vec<BlockHash>>,
}

impl SharedKvmesh {
    /// An empty index, engines `0..engines` registered, and the workload's queries as block
    /// hashes.
    pub fn new(w: &crate::workload::Workload, engines: u32) -> Self {
        let k = Kvmesh::new();
        let queries = w.queries.iter().map(|q| block_hashes(&k.hasher, q)).collect();
        let index = PublishedIndex::new(k.hasher, 0);
        let mut writer = index.write();
        for e in 0..engines {
            writer.register(ReplicaId(e), None);
        }
        drop(writer);
        SharedKvmesh { index, queries }
    }
}

impl super::Shared for SharedKvmesh {
    fn write(&self, op: &Op) {
        if let Some((replica, event)) = event_of(op) {
            self.index.write().apply(replica, event);
        }
    }

    fn read(&self, q: usize) -> usize {
        thread_local!(static OUT: RefCell<Vec<(ReplicaId, Overlap)>> = const { RefCell::new(Vec::new()) });
        OUT.with_borrow_mut(|out| {
            out.clear();
            self.index.read().overlaps(&self.queries[q], out);
            out.len()
        })
    }
}
