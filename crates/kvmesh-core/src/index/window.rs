//! A hybrid model's sliding-window KV cache groups, and vLLM's rule for a prefix hit over them.
//!
//! Why: a model with sliding-window layers beside full-attention ones (Gemma 3, gpt-oss, …)
//! keeps one KV cache group per kind. A full-attention group needs every block before the hit
//! point; a sliding-window group needs only the last `⌈(window − 1) / block_size⌉` blocks
//! before it, and vLLM frees the blocks that slide out of the window while a request runs, so
//! they are evicted sooner. vLLM's hit is the longest length every group accepts
//! (vllm/v1/core/kv_cache_coordinator.py `HybridKVCacheCoordinator.find_longest_cache_hit`:
//! full attention first, then each other group within that length, until no group shortens
//! it; vllm/v1/core/single_type_kv_cache_manager.py `SlidingWindowManager.find_longest_cache_hit`:
//! scanning right to left, the hit ends where that many contiguous blocks end, or, with no
//! such run, is the run from the start). The index keeps each sliding-window group's blocks
//! per replica beside the full-attention chains and applies that rule to each replica's
//! full-attention overlap.

use super::event::Removed;
use crate::ids::{BlockHash, EngineBlockHash};
use rustc_hash::FxHashMap;

/// One replica's blocks of one sliding-window group.
#[derive(Debug, Clone)]
pub(crate) struct WindowGroup {
    /// vLLM's `group_idx`.
    pub(crate) idx: u32,
    /// Contiguous blocks a hit needs before its end: `⌈(window − 1) / block_size⌉`.
    pub(crate) need: u32,
    /// Engine id → the block's hash (kvmesh's chained hash) and its copies under that id.
    by_engine: FxHashMap<u64, (u64, u32)>,
    /// Block hash → copies held, all ids together.
    held: FxHashMap<u64, u32>,
}

impl WindowGroup {
    /// An empty group `idx` of `window` tokens, blocks of `block_size` tokens.
    pub(crate) fn new(idx: u32, window: u32, block_size: u32) -> Self {
        WindowGroup {
            idx,
            need: window.saturating_sub(1).div_ceil(block_size.max(1)),
            by_engine: FxHashMap::default(),
            held: FxHashMap::default(),
        }
    }

    /// The hash engine id `id` names in this group, if held.
    pub(crate) fn hash_of(&self, id: u64) -> Option<u64> {
        self.by_engine.get(&id).map(|&(h, _)| h)
    }

    /// Heap bytes of its maps.
    pub(crate) fn heap_bytes(&self) -> usize {
        super::map_bytes(&self.by_engine) + super::map_bytes(&self.held)
    }

    /// Blocks held (distinct hashes).
    pub(crate) fn blocks(&self) -> usize {
        self.held.len()
    }

    /// Stores one copy of each block: engine id `ids[k]` names the block whose hash is
    /// `blocks[k]` ([`super::PrefixIndex`] hashes a store's chain). Returns the copies added.
    pub(crate) fn store(&mut self, ids: &[EngineBlockHash], blocks: &[BlockHash]) -> u32 {
        let mut added = 0;
        for (id, block) in ids.iter().zip(blocks) {
            let entry = self.by_engine.entry(id.0).or_insert((block.0, 0));
            let replaced = (entry.0 != block.0).then(|| std::mem::replace(entry, (block.0, 0)));
            entry.1 += 1;
            if let Some((old, copies)) = replaced {
                // The engine reused the id for other tokens: the newest store wins.
                self.release(old, copies);
            }
            *self.held.entry(block.0).or_default() += 1;
            added += 1;
        }
        added
    }

    /// Removes one copy of each block `r` names; returns the copies removed.
    pub(crate) fn remove(&mut self, r: &Removed) -> u32 {
        let mut removed = 0;
        for id in &r.block_hashes {
            let Some(entry) = self.by_engine.get_mut(&id.0) else { continue };
            let hash = entry.0;
            entry.1 -= 1;
            if entry.1 == 0 {
                self.by_engine.remove(&id.0);
            }
            self.release(hash, 1);
            removed += 1;
        }
        removed
    }

    fn release(&mut self, hash: u64, copies: u32) {
        if let Some(n) = self.held.get_mut(&hash) {
            *n = n.saturating_sub(copies);
            if *n == 0 {
                self.held.remove(&hash);
            }
        }
    }

    /// vLLM's sliding-window hit within the first `max` blocks of `hashes`: scanning from
    /// block `max − 1` down, the end of the first run of [`WindowGroup::need`] contiguous
    /// blocks held; with none, the run held from block 0.
    pub(crate) fn hit(&self, hashes: &[BlockHash], max: u32) -> u32 {
        let max = (max as usize).min(hashes.len());
        if self.need == 0 {
            return max as u32;
        }
        let mut run = 0u32;
        for i in (0..max).rev() {
            if self.held.contains_key(&hashes[i].0) {
                run += 1;
                if run >= self.need {
                    return i as u32 + run;
                }
            } else {
                run = 0;
            }
        }
        run
    }
}

/// The hit every group accepts, from the full-attention hit `full` (vLLM's fixed point: each
/// group shortens it or accepts it, until none shortens it).
pub(crate) fn hybrid_hit(groups: &[WindowGroup], hashes: &[BlockHash], full: u32) -> u32 {
    let mut hit = full;
    loop {
        let before = hit;
        for g in groups {
            hit = hit.min(g.hit(hashes, hit));
        }
        if hit >= before {
            return hit;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{BlockHasher, Namespace};

    #[test]
    fn the_hit_ends_where_enough_contiguous_blocks_end() {
        let hasher = BlockHasher::new(4, &Namespace::default()).unwrap();
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = hasher.hash_blocks(&tokens);
        // A 9-token window at 4-token blocks needs ⌈8 / 4⌉ = 2 blocks before the hit point.
        let mut g = WindowGroup::new(1, 9, 4);
        assert_eq!(g.need, 2);
        let held = |g: &mut WindowGroup, blocks: &[usize]| {
            for &b in blocks {
                assert_eq!(g.store(&[EngineBlockHash(100 + b as u64)], &hashes[b..=b]), 1);
            }
        };
        // Held: 0, 1, 2 (the start), 5, 6 (a run of 2), 8 (alone).
        held(&mut g, &[0, 1, 2, 5, 6, 8]);
        assert_eq!(g.blocks(), 6);
        assert_eq!(g.hit(&hashes, 10), 7, "the run 5–6 ends at 7");
        assert_eq!(g.hit(&hashes, 9), 7, "block 8 alone is not enough");
        assert_eq!(g.hit(&hashes, 6), 3, "within 6: the run 1–2 ends at 3");
        assert_eq!(g.hit(&hashes, 1), 1, "no run of 2 within 1: the run from the start");
        // The fixed point with a second group holding 0–3 only.
        let mut h = WindowGroup::new(2, 9, 4);
        held(&mut h, &[0, 1, 2, 3]);
        assert_eq!(hybrid_hit(&[g, h], &hashes, 10), 3);
        // A removal takes a copy away.
        let mut g = WindowGroup::new(1, 9, 4);
        held(&mut g, &[5, 6]);
        let r = Removed { block_hashes: vec![EngineBlockHash(106)], medium: crate::Medium::Gpu, kv_group: Some(1) };
        assert_eq!(g.remove(&r), 1);
        assert_eq!((g.blocks(), g.hit(&hashes, 10)), (1, 0));
        // A window of one token needs no block: any full-attention hit stands.
        assert_eq!(WindowGroup::new(3, 1, 4).hit(&hashes, 10), 10);
    }
}
