//! The prefix index: which replica holds which block, built from the replicas' KV events.
//!
//! ```text
//!  replica r's events ──apply──► per-replica engine-id map ──► segments: chains of (block, holders)
//!  request block hashes ──overlaps──► each replica's longest leading run, per medium
//! ```
//!
//! Engine block ids are opaque (vLLM and SGLang compute them differently), so a `Stored` event's
//! tokens are re-hashed with kvmesh's own chained [`crate::BlockHasher`], chained from the
//! parent's kvmesh hash. Blocks live in `segments`: chains stored contiguously, so a query
//! reads consecutive blocks from consecutive memory and looks a block up by hash only where a
//! chain branches. Each replica keeps an engine-id → position map for its removals. Copies
//! are counted, not set-membership (case C20): per engine id in that map, and per replica and
//! medium (all ids together) with the block's holder; an id's mapping goes with its last copy,
//! so one block held under two ids (a cache salt) loses each id's copies on their own. Bad events are counted no-ops
//! ([`Rejection`]), never panics. Memory follows what the replicas hold: removals and clears
//! shrink the per-replica maps, pop empty slots off a segment's end and free a segment nobody
//! holds anything in (an empty slot before a held one stays until then; the segment table
//! itself shrinks only when every segment is free); [`PrefixIndex::memory_bytes`] reports it.

mod adopt;
mod event;
mod holders;
mod orphans;
mod outcome;
mod published;
mod replica_blocks;
mod segments;
mod table;
mod window;
mod write;

pub use event::{ExtraKeys, KvEvent, KvGroup, Removed, Stored};
pub use outcome::{ApplyOutcome, EventCounters, Rejection};
pub use published::{IndexWriter, PublishedIndex};
pub use replica_blocks::IndexHealth;

use crate::hashing::BlockHasher;
use crate::ids::{BlockHash, EngineBlockHash, Medium, ReplicaId};
use crate::overlap::{Overlap, Runs};
use holders::{Added, Arena, Holder};
use replica_blocks::{Mapping, ReplicaBlocks};
use rustc_hash::FxHashSet;
use segments::{Pos, Segments};
use table::Table;

/// The fleet-wide prefix index for one namespace and block size.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    hasher: BlockHasher,
    blocks: Segments,
    arena: Arena,
    replicas: Vec<Option<ReplicaBlocks>>,
    entries: usize,
    seed: u64,
    /// A stored event's block hashes, reused between events.
    scratch: Vec<BlockHash>,
    /// Whether any replica has a sliding-window group ([`window`]): overlaps then apply
    /// vLLM's hybrid rule.
    windowed: bool,
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
            blocks: Segments::with_seed(seed),
            arena: Arena::default(),
            replicas: Vec::new(),
            entries: 0,
            seed,
            scratch: Vec::new(),
            windowed: false,
        }
    }

    /// Hashes `replica`'s stored blocks with `hasher` instead of the index's own: a replica
    /// serving another model (its namespace), whose blocks must match only requests for
    /// that model, in that model's block size (its events must have it).
    pub fn set_replica_hasher(&mut self, replica: ReplicaId, hasher: BlockHasher) {
        if replica != holders::MANY {
            self.slot(replica).hasher = Some(hasher);
        }
    }

    /// The hasher `replica`'s stores are hashed with.
    fn hasher_of(&self, replica: ReplicaId) -> BlockHasher {
        self.replicas.get(replica.index()).and_then(Option::as_ref).and_then(|rb| rb.hasher).unwrap_or(self.hasher)
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
        let outcome = match event {
            // Window groups in GPU memory only: the hit they cut is the GPU one (an offloaded
            // window block is left aside, and never touches the full-attention copies).
            KvEvent::Stored(s)
                if s.medium == Medium::Gpu && s.kv_group.as_ref().and_then(KvGroup::window).is_some() =>
            {
                self.store_window(replica, s)
            }
            KvEvent::Removed(r) if r.kv_group.is_some_and(|g| self.window_group(replica, g).is_some()) => {
                let g = r.kv_group.and_then(|g| self.window_group(replica, g)).expect("checked in the guard");
                if r.medium == Medium::Gpu {
                    let removed = self.slot(replica).windows[g].remove(r);
                    ApplyOutcome { removed, ..ApplyOutcome::default() }
                } else {
                    ApplyOutcome { other_group: r.block_hashes.len() as u32, ..ApplyOutcome::default() }
                }
            }
            _ if self.left_aside(replica, event) => {
                ApplyOutcome { other_group: event.blocks() as u32, ..ApplyOutcome::default() }
            }
            KvEvent::Stored(s) => self.store_or_keep(replica, s),
            KvEvent::Removed(r) => {
                let mut out = self.remove(replica, r);
                out.removed += self.remove_inferred(replica, r);
                let rb = self.slot(replica);
                if rb.orphans.blocks() > 0 {
                    let dropped: usize = r.block_hashes.iter().map(|h| rb.orphans.forget_block(h.0)).sum();
                    out.orphans_dropped += dropped as u32;
                }
                out
            }
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

    /// Whether `event` belongs to a hybrid model's KV cache group the index does not follow
    /// (remembering such a group from its stores): one that holds only a sequence's recent
    /// part names its blocks with the same engine ids, and its copies would outlive the full
    /// attention group's, which decides the hit.
    fn left_aside(&mut self, replica: ReplicaId, event: &KvEvent) -> bool {
        let rb = self.slot(replica);
        match event {
            KvEvent::Stored(s) => match s.kv_group.as_ref().filter(|g| !g.covers_whole_prefix()) {
                Some(g) => {
                    if !rb.other_groups.contains(&g.idx) {
                        rb.other_groups.push(g.idx);
                    }
                    true
                }
                None => false,
            },
            KvEvent::Removed(r) => r.kv_group.is_some_and(|g| rb.other_groups.contains(&g)),
            KvEvent::Cleared => false,
        }
    }

    /// Says whether `replica`'s history is partial: its events since it last started cover
    /// only part of what it holds (the node followed it from a replay buffer that no longer
    /// starts at its first message: what it stored before cannot be had). Then a store
    /// under a parent never seen is kept aside ([`ApplyOutcome::orphaned`]) rather than marking
    /// the replica out of sync, and placed once its parent is stored
    /// ([`ApplyOutcome::adopted`]); a removal of any of its blocks drops it. Turning it off (a
    /// restarted engine, whose stream this node has whole) drops what waits.
    pub fn set_partial_history(&mut self, replica: ReplicaId, partial: bool) {
        if replica == holders::MANY {
            return;
        }
        let rb = self.slot(replica);
        rb.partial_history = partial;
        if !partial {
            rb.orphans.clear();
        }
    }

    /// Blocks held in `replica`'s sliding-window groups, all groups together.
    pub fn window_blocks(&self, replica: ReplicaId) -> usize {
        self.replicas
            .get(replica.index())
            .and_then(Option::as_ref)
            .map_or(0, |rb| rb.windows.iter().map(|g| g.blocks()).sum())
    }

    /// Whether `replica`'s history is partial ([`PrefixIndex::set_partial_history`]).
    pub fn history_is_partial(&self, replica: ReplicaId) -> bool {
        self.replicas.get(replica.index()).and_then(Option::as_ref).is_some_and(|rb| rb.partial_history)
    }

    /// Blocks of `replica` kept aside, waiting for their parent (0 for an unknown replica).
    pub fn orphan_blocks(&self, replica: ReplicaId) -> usize {
        self.replicas.get(replica.index()).and_then(Option::as_ref).map_or(0, |rb| rb.orphans.blocks())
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
    /// sorted by replica id; replicas holding no leading block are left out.
    ///
    /// One pass along the chains the blocks are stored in: within a segment the request's
    /// hashes are compared with the slots in order, and a slot held exactly as the one before
    /// it changes no run and is skipped; a hash is looked up only where the stored chain
    /// branches or ends. Stops as soon as no replica can match further.
    pub fn overlaps(&self, hashes: &[BlockHash], out: &mut Vec<(ReplicaId, Overlap)>) {
        let start = out.len();
        self.full_attention_overlaps(hashes, out);
        if self.windowed {
            self.apply_windows(hashes, out, start);
        }
    }

    /// [`PrefixIndex::overlaps`] over the full-attention chains only.
    fn full_attention_overlaps(&self, hashes: &[BlockHash], out: &mut Vec<(ReplicaId, Overlap)>) {
        let Some(first) = hashes.first() else { return };
        let Some(mut pos) = self.blocks.next(None, first.0) else { return };
        let mut previous = self.blocks.slot(pos).holder;
        if previous.is_empty() {
            return;
        }
        let held = Holder::media;
        let mut runs = Runs::start(self.arena.slice(&previous), held, out);
        // Every block before `i` matched every run still going; `pos` is block `i − 1`'s.
        let mut i = 1;
        'walk: while i < hashes.len() && !runs.is_done() {
            let slots = self.blocks.after(pos);
            // Eight blocks at a time while they match and carry the very holder word the
            // previous slot does (one replica's own chain: same replica, same copies; a shared
            // list's handle differs from slot to slot): one branch per eight blocks, where the
            // loop below takes two per block and reads each holder's media. Anything else, and
            // the rest of the segment, goes through that loop: going back to eight at a time
            // after a change cost more than it saved (BENCHMARKS.md; post-query p50 at 16
            // replicas 0.55 → 0.41 µs).
            let n = slots.len().min(hashes.len() - i);
            let mut k = 0;
            let was = previous.bits();
            while k + 8 <= n {
                let (s, h) = (&slots[k..k + 8], &hashes[i + k..i + k + 8]);
                let off = s.iter().zip(h).fold(0, |acc, (s, h)| acc | (s.hash ^ h.0) | (s.holder.bits() ^ was));
                if off != 0 {
                    break;
                }
                k += 8;
            }
            i += k;
            for (s, h) in slots[k..].iter().zip(&hashes[i..]) {
                if s.hash != h.0 {
                    break;
                }
                if !s.holder.same_holders_as(&previous) {
                    if s.holder.is_empty() {
                        break 'walk;
                    }
                    runs.step(self.arena.slice(&s.holder), i as u32, &held, out);
                    if runs.is_done() {
                        break 'walk;
                    }
                }
                previous = s.holder;
                i += 1;
            }
            if i == hashes.len() {
                break;
            }
            // The stored chain branches or ends here: the block may start a segment of its own.
            let Some(p) = self.blocks.next(None, hashes[i].0) else { break };
            previous = self.blocks.slot(p).holder;
            if previous.is_empty() {
                break;
            }
            runs.step(self.arena.slice(&previous), i as u32, &held, out);
            pos = p;
            i += 1;
        }
        runs.finish(i as u32, out);
    }

    /// (block, replica) pairs held, whatever the medium or copy count.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Distinct blocks held by any replica.
    pub fn blocks(&self) -> usize {
        self.blocks.live()
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
            bytes += rb.orphans.heap_bytes() + rb.windows.iter().map(window::WindowGroup::heap_bytes).sum::<usize>();
            bytes += map_bytes(&rb.inferred) + rb.inferred.values().map(|v| v.capacity() * 8).sum::<usize>();
        }
        bytes + self.replicas.capacity() * std::mem::size_of::<Option<ReplicaBlocks>>()
    }

    // === apply ===

    /// Each of `out[start..]`'s GPU overlaps cut to vLLM's hybrid hit where its replica has
    /// sliding-window groups; entries left with nothing are dropped.
    fn apply_windows(&self, hashes: &[BlockHash], out: &mut Vec<(ReplicaId, Overlap)>, start: usize) {
        for (r, o) in &mut out[start..] {
            let Some(Some(rb)) = self.replicas.get(r.index()) else { continue };
            if !rb.windows.is_empty() && o.gpu > 0 {
                o.gpu = window::hybrid_hit(&rb.windows, hashes, o.gpu);
            }
        }
        let mut k = start;
        for i in start..out.len() {
            if out[i].1.gpu > 0 || out[i].1.cpu > 0 {
                out.swap(k, i);
                k += 1;
            }
        }
        out.truncate(k);
    }
}

/// Heap bytes of a hash map's table: its slots and their control bytes (hashbrown's layout).
pub(crate) fn map_bytes<K, V, S>(m: &std::collections::HashMap<K, V, S>) -> usize {
    m.capacity() * (std::mem::size_of::<(K, V)>() + 1)
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
        // One set per thread, cleared and reused: built afresh per event, its growth and
        // rehashing were a tenth of applying a 128-block store (perf, vs-dynamo at 16 replicas).
        thread_local!(static SEEN: std::cell::RefCell<FxHashSet<EngineBlockHash>> = std::cell::RefCell::default());
        SEEN.with_borrow_mut(|seen| {
            seen.clear();
            !hs.iter().all(|h| seen.insert(*h))
        })
    }
}

#[cfg(test)]
mod tests;
