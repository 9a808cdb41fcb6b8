//! One simulated engine's prefix cache: an LRU of block ids with leaf-first eviction.
//!
//! vLLM frees a finished request's blocks in reverse order (`BlockPool.free_blocks`, deepest
//! block first), so the free queue evicts leaves before their parents. The model keeps that
//! property by touching a request's blocks deepest first: every parent is then more recent
//! than each of its children, and the least recent block never has a cached child.

use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// An LRU of engine block ids (`u64`), `capacity` blocks.
#[derive(Debug)]
pub struct EngineCache {
    capacity: usize,
    clock: u64,
    /// Block id → its last touch.
    stamp: FxHashMap<u64, u64>,
    /// Last touch → block id, oldest first.
    order: BTreeMap<u64, u64>,
}

impl EngineCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        EngineCache { capacity, clock: 0, stamp: FxHashMap::default(), order: BTreeMap::new() }
    }

    /// Blocks the cache holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.stamp.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.stamp.is_empty()
    }

    /// Whether block `id` is held.
    pub fn holds(&self, id: u64) -> bool {
        self.stamp.contains_key(&id)
    }

    /// Makes `id` the most recent block, inserting it if absent (the caller evicts first).
    pub fn touch(&mut self, id: u64) {
        self.clock += 1;
        if let Some(old) = self.stamp.insert(id, self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, id);
    }

    /// Removes and returns the least recent block.
    pub fn evict(&mut self) -> Option<u64> {
        let (_, id) = self.order.pop_first()?;
        self.stamp.remove(&id);
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deepest_first_touches_evict_leaves_first() {
        let mut c = EngineCache::new(4);
        // Chain 1 → 2 → 3, touched deepest first.
        for id in [3, 2, 1] {
            c.touch(id);
        }
        // A second child of 1: 4, then its parent again.
        for id in [4, 1] {
            c.touch(id);
        }
        assert_eq!((c.len(), c.holds(3), c.holds(5)), (4, true, false));
        assert_eq!(c.evict(), Some(3));
        assert_eq!(c.evict(), Some(2));
        assert_eq!(c.evict(), Some(4));
        assert_eq!(c.evict(), Some(1));
        assert_eq!(c.evict(), None);
        assert!(c.is_empty());
    }
}
