//! The prefix index: which replica holds which block, built from the replicas' KV events.
//!
//! ```text
//!  replica r's events ──apply──► per-replica engine-id map ──► blocks: BlockHash → holders
//!  request block hashes ──overlaps──► each replica's longest leading run, per medium
//! ```
//!
//! Engine block ids are opaque (vLLM and SGLang compute them differently), so a `Stored` event's
//! tokens are re-hashed with kvmesh's own chained [`crate::BlockHasher`], chained from the
//! parent's kvmesh hash. Each replica keeps an engine-id → block map for its removals. Copies
//! are counted, not set-membership (case C20): the per-medium copy count lives with the
//! block's holder, and an engine id's mapping goes when its block's last copy on that replica
//! and medium does. Bad events are counted no-ops
//! ([`Rejection`]), never panics. Memory follows what the replicas hold: removals and clears
//! free entries and shrink the per-replica maps; [`PrefixIndex::memory_bytes`] reports it.

mod event;
mod holders;
mod outcome;
mod replica_blocks;
mod table;

pub use event::{KvEvent, Removed, Stored};
pub use outcome::{ApplyOutcome, EventCounters, Rejection};
pub use replica_blocks::IndexHealth;

use crate::hashing::BlockHasher;
use crate::ids::{BlockHash, Medium, ReplicaId};
use crate::overlap::{leading_runs, Overlap};
use holders::{Arena, Holder};
use replica_blocks::ReplicaBlocks;
use rustc_hash::FxHashSet;
use table::Table;

/// The fleet-wide prefix index for one namespace and block size.
#[derive(Debug)]
pub struct PrefixIndex {
    hasher: BlockHasher,
    blocks: Table<Holder>,
    arena: Arena,
    replicas: Vec<Option<ReplicaBlocks>>,
    entries: usize,
    seed: u64,
}

impl PrefixIndex {
    /// An empty index hashing blocks with `hasher` (its block size is the one events must have).
    pub fn new(hasher: BlockHasher) -> Self {
        Self::with_seed(hasher, 0)
    }

    /// Like [`PrefixIndex::new`], with the index's hash tables keyed by `seed`. Engine block
    /// ids arrive from the network; with a secret seed nobody can pick ids that degrade the
    /// tables (a node passes a random seed; the simulator keeps 0 for reproducible runs).
    pub fn with_seed(hasher: BlockHasher, seed: u64) -> Self {
        PrefixIndex {
            hasher,
            blocks: Table::with_seed(seed),
            arena: Arena::default(),
            replicas: Vec::new(),
            entries: 0,
            seed,
        }
    }

    /// The hasher whose block size and namespace this index uses.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Applies one event from `replica`, registering the replica on first sight. Replica ids
    /// index a table, so they must be dense, as [`crate::Fleet`] assigns them (and never
    /// `u32::MAX`, which is reserved).
    ///
    /// Never panics on any event content; problems are reported in the outcome's `rejection`
    /// and counted in the replica's [`IndexHealth`].
    pub fn apply(&mut self, replica: ReplicaId, event: &KvEvent) -> ApplyOutcome {
        if replica == holders::MANY {
            return ApplyOutcome { rejection: Some(Rejection::ReservedReplica), ..ApplyOutcome::default() };
        }
        self.slot(replica);
        let outcome = match event {
            KvEvent::Stored(s) => self.store(replica, s),
            KvEvent::Removed(r) => self.remove(replica, r),
            KvEvent::Cleared => {
                let cleared = self.clear(replica);
                ApplyOutcome { cleared, ..ApplyOutcome::default() }
            }
        };
        let rb = self.slot(replica);
        rb.health.counters.count(&outcome);
        match outcome.rejection {
            Some(Rejection::BlockSizeMismatch { got, .. }) => rb.health.block_size_mismatch = Some(got),
            Some(Rejection::UnknownParent) => rb.health.out_of_sync = true,
            _ if matches!(event, KvEvent::Stored(_)) => rb.health.block_size_mismatch = None,
            _ => {}
        }
        outcome
    }

    /// Drops every block of `replica` and forgets it. Returns the (block, replica) entries
    /// dropped.
    pub fn remove_replica(&mut self, replica: ReplicaId) -> u32 {
        let before = self.entries;
        if self.replicas.get(replica.index()).is_some_and(|r| r.is_some()) {
            self.clear(replica);
            self.replicas[replica.index()] = None;
        }
        (before - self.entries) as u32
    }

    /// Marks `replica` back in sync after the caller resynced it (e.g. a completed replay).
    pub fn mark_in_sync(&mut self, replica: ReplicaId) {
        if let Some(Some(rb)) = self.replicas.get_mut(replica.index()) {
            rb.health.out_of_sync = false;
        }
    }

    /// Each replica's longest leading run of `hashes` it holds, per medium, appended to `out`
    /// sorted by replica id; replicas holding no leading block are left out. One pass over the
    /// blocks that stops as soon as no replica can match further.
    pub fn overlaps(&self, hashes: &[BlockHash], out: &mut Vec<(ReplicaId, Overlap)>) {
        leading_runs(hashes.len(), |i| self.blocks.get(hashes[i].0).map(|h| self.arena.slice(h)), Holder::media, out);
    }

    /// Whether `replica` holds `block`, as `[GPU, CPU]`.
    pub fn holds(&self, replica: ReplicaId, block: BlockHash) -> [bool; 2] {
        self.blocks
            .get(block.0)
            .and_then(|h| self.arena.slice(h).iter().find(|x| x.replica == replica).map(|x| x.held()))
            .unwrap_or([false, false])
    }

    /// (block, replica) pairs held, whatever the medium or copy count.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Distinct blocks held by any replica.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Distinct (engine id, medium) mappings `replica` holds; 0 for an unknown replica.
    pub fn replica_blocks(&self, replica: ReplicaId) -> usize {
        self.replicas.get(replica.index()).and_then(Option::as_ref).map_or(0, ReplicaBlocks::mappings)
    }

    /// The event-stream health of `replica`, if it ever sent an event.
    pub fn health(&self, replica: ReplicaId) -> Option<&IndexHealth> {
        self.replicas.get(replica.index()).and_then(Option::as_ref).map(|r| &r.health)
    }

    /// Heap bytes held by the index: its tables, shared holder lists and per-replica state.
    pub fn memory_bytes(&self) -> usize {
        let mut bytes = self.blocks.heap_bytes() + self.arena.heap_bytes();
        for rb in self.replicas.iter().flatten() {
            bytes += rb.engine.iter().map(Table::heap_bytes).sum::<usize>();
        }
        bytes + self.replicas.capacity() * std::mem::size_of::<Option<ReplicaBlocks>>()
    }

    // === apply ===

    fn slot(&mut self, replica: ReplicaId) -> &mut ReplicaBlocks {
        let i = replica.index();
        if self.replicas.len() <= i {
            self.replicas.resize_with(i + 1, || None);
        }
        let seed = self.seed;
        self.replicas[i].get_or_insert_with(|| ReplicaBlocks::with_seed(seed))
    }

    fn store(&mut self, replica: ReplicaId, s: &Stored) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let want = self.hasher.block_size();
        if s.block_size != want {
            out.rejection = Some(Rejection::BlockSizeMismatch { got: s.block_size, want });
            return out;
        }
        if s.token_ids.len() as u64 != s.block_hashes.len() as u64 * want as u64 {
            out.rejection = Some(Rejection::TokenCountMismatch);
            return out;
        }
        if is_self_referential(s) {
            out.rejection = Some(Rejection::SelfReferential);
            return out;
        }
        let m = s.medium.index();
        let rb = self.replicas[replica.index()].as_mut().expect("slot registered by apply");
        let mut prev = match s.parent {
            None => None,
            Some(p) => match rb.engine[m].get(p.0).or_else(|| rb.engine[1 - m].get(p.0)) {
                Some(&block) => Some(BlockHash(block)),
                None => {
                    out.rejection = Some(Rejection::UnknownParent);
                    return out;
                }
            },
        };
        let hasher = match &s.lora_name {
            Some(adapter) if prev.is_none() => self.hasher.for_adapter(adapter),
            _ => self.hasher,
        };
        let chunks = s.token_ids.chunks_exact(want as usize);
        for (&engine_hash, tokens) in s.block_hashes.iter().zip(chunks) {
            let block = hasher.hash_block(prev, tokens);
            prev = Some(block);
            match rb.engine[m].insert(engine_hash.0, block.0) {
                Some(old) if old != block.0 => {
                    // The engine reused an id for other tokens: trust the newest event and drop
                    // the old block's copies in this medium.
                    if let Some(h) = self.blocks.get_mut(old) {
                        let r = self.arena.remove(h, replica, s.medium, u16::MAX);
                        self.entries -= r.replica_gone as usize;
                        if r.block_empty {
                            self.blocks.remove(old);
                        }
                    }
                    out.rejection.get_or_insert(Rejection::ConflictingBlock);
                }
                _ => {}
            }
            let added = match self.blocks.entry(block.0, Holder::one(replica, s.medium)) {
                (_, true) => true,
                (h, false) => self.arena.add(h, replica, s.medium),
            };
            self.entries += added as usize;
            out.stored += 1;
        }
        out
    }

    fn remove(&mut self, replica: ReplicaId, r: &Removed) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let m = r.medium.index();
        let rb = self.replicas[replica.index()].as_mut().expect("slot registered by apply");
        for engine_hash in &r.block_hashes {
            let Some(&block) = rb.engine[m].get(engine_hash.0) else {
                out.rejection.get_or_insert(Rejection::UnknownBlock);
                continue;
            };
            let removal = match self.blocks.get_mut(block) {
                Some(h) => self.arena.remove(h, replica, r.medium, 1),
                None => holders::Removal { left: 0, replica_gone: false, block_empty: false },
            };
            if removal.left == 0 {
                rb.engine[m].remove(engine_hash.0);
            }
            if removal.block_empty {
                self.blocks.remove(block);
            }
            self.entries -= removal.replica_gone as usize;
            out.removed += 1;
        }
        out
    }

    fn clear(&mut self, replica: ReplicaId) -> u32 {
        let Some(Some(rb)) = self.replicas.get_mut(replica.index()) else { return 0 };
        let mut cleared = 0;
        for medium in Medium::ALL {
            let map = std::mem::replace(&mut rb.engine[medium.index()], Table::with_seed(self.seed));
            for (_, block) in map.iter() {
                let Some(h) = self.blocks.get_mut(block) else { continue };
                let before =
                    self.arena.slice(h).iter().find(|x| x.replica == replica).map_or(0, |x| x.copies[medium.index()]);
                let r = self.arena.remove(h, replica, medium, u16::MAX);
                cleared += before as u32;
                self.entries -= r.replica_gone as usize;
                if r.block_empty {
                    self.blocks.remove(block);
                }
            }
        }
        rb.health.out_of_sync = false;
        rb.health.counters.clears += 1;
        cleared
    }
}

/// Case C02: a parent that is one of the event's own blocks, or a block id repeated within the
/// event, would chain a block to itself.
fn is_self_referential(s: &Stored) -> bool {
    let hs = &s.block_hashes;
    if s.parent.is_some_and(|p| hs.contains(&p)) {
        return true;
    }
    if hs.len() <= 16 {
        hs.iter().enumerate().any(|(i, h)| hs[i + 1..].contains(h))
    } else {
        let mut seen = FxHashSet::default();
        !hs.iter().all(|h| seen.insert(*h))
    }
}

#[cfg(test)]
mod tests;
