//! A vLLM-like paged KV cache with automatic prefix caching.
//!
//! Capacity is a number of blocks of `block_size` tokens. Full prompt blocks are cached under
//! the engine's own block hash and shared by every sequence that needs them (a reference
//! count); when no running sequence references a cached block it stays cached but becomes
//! evictable, least recently used first (vLLM `kv_cache_manager.py`, `block_pool.py`). A
//! sequence's partial last block and its output blocks are private and freed when it ends.
//! Every block that enters or leaves the cache is reported, so the engine can publish the
//! same `BlockStored` / `BlockRemoved` events a real vLLM would.

use rustc_hash::FxHashMap;

/// "No node": the end of the LRU list.
const NIL: u32 = u32::MAX;

/// One cached block, in a slab so the LRU list can link blocks by index.
#[derive(Debug, Clone, Copy)]
struct Cached {
    hash: u64,
    refs: u32,
    /// LRU neighbours while evictable (refs == 0): `prev` is less recently released.
    prev: u32,
    next: u32,
}

/// The cache of one engine.
#[derive(Debug)]
pub struct KvCache {
    capacity: u64,
    private: u64,
    /// Cached block hash → slab index.
    cached: FxHashMap<u64, u32>,
    slab: Vec<Cached>,
    free_slots: Vec<u32>,
    /// Evictable blocks, a doubly linked list through the slab in release order: O(1) touch,
    /// release and eviction (the simulator's hottest path past capacity).
    lru_head: u32,
    lru_tail: u32,
    evictable: u64,
    /// Blocks evicted since the last [`KvCache::take_evicted`], in eviction order.
    evicted: Vec<u64>,
}

impl KvCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: u64) -> Self {
        KvCache {
            capacity,
            private: 0,
            cached: FxHashMap::default(),
            slab: Vec::new(),
            free_slots: Vec::new(),
            lru_head: NIL,
            lru_tail: NIL,
            evictable: 0,
            evicted: Vec::new(),
        }
    }

    /// Capacity, blocks.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Blocks in use: cached (evictable or not) plus private.
    pub fn used(&self) -> u64 {
        self.cached.len() as u64 + self.private
    }

    /// Blocks in the prefix cache (referenced or evictable): what the engine would hit.
    pub fn cached(&self) -> u64 {
        self.cached.len() as u64
    }

    /// Blocks held by running sequences (what vLLM reports as `kv_cache_usage_perc`): cached
    /// blocks with references plus private blocks.
    pub fn active(&self) -> u64 {
        self.cached.len() as u64 - self.evictable + self.private
    }

    /// Blocks that could be had now: free plus evictable.
    pub fn available(&self) -> u64 {
        self.capacity - self.active()
    }

    /// Whether `hash` is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.cached.contains_key(&hash)
    }

    /// Whether `hash` is cached with no reference: taking one removes it from what
    /// [`KvCache::available`] counts.
    pub fn is_evictable(&self, hash: u64) -> bool {
        self.cached.get(&hash).is_some_and(|&i| self.slab[i as usize].refs == 0)
    }

    /// Takes a reference on a cached block (a prefix hit). Returns false if not cached.
    pub fn acquire(&mut self, hash: u64) -> bool {
        let Some(&i) = self.cached.get(&hash) else { return false };
        if self.slab[i as usize].refs == 0 {
            self.unlink(i);
        }
        self.slab[i as usize].refs += 1;
        true
    }

    /// Drops a reference; the block stays cached and becomes evictable at zero.
    pub fn release(&mut self, hash: u64) {
        let Some(&i) = self.cached.get(&hash) else { return };
        let c = &mut self.slab[i as usize];
        if c.refs == 0 {
            return;
        }
        c.refs -= 1;
        if c.refs == 0 {
            self.push_back(i);
        }
    }

    /// Makes room for `n` more blocks, evicting least recently used blocks as needed. Returns
    /// false (evicting nothing) when even evicting every evictable block is not enough.
    pub fn reserve(&mut self, n: u64) -> bool {
        if self.available() < n {
            return false;
        }
        while self.capacity - self.used() < n {
            let i = self.lru_head;
            if i == NIL {
                return false;
            }
            self.unlink(i);
            let hash = self.slab[i as usize].hash;
            self.cached.remove(&hash);
            self.free_slots.push(i);
            self.evicted.push(hash);
        }
        true
    }

    /// Takes `n` private blocks; call [`KvCache::reserve`] first.
    pub fn alloc_private(&mut self, n: u64) {
        debug_assert!(self.used() + n <= self.capacity);
        self.private += n;
    }

    /// Frees `n` private blocks.
    pub fn free_private(&mut self, n: u64) {
        self.private = self.private.saturating_sub(n);
    }

    /// Turns one private block (a just-filled prompt block) into the cached block `hash`, with
    /// one reference. Returns false when `hash` was already cached: the reference goes to the
    /// existing block and the private block is freed (vLLM would keep a duplicate; one copy is
    /// enough for the model).
    pub fn promote(&mut self, hash: u64) -> bool {
        self.private = self.private.saturating_sub(1);
        if self.acquire(hash) {
            return false;
        }
        let node = Cached { hash, refs: 1, prev: NIL, next: NIL };
        let i = match self.free_slots.pop() {
            Some(i) => {
                self.slab[i as usize] = node;
                i
            }
            None => {
                self.slab.push(node);
                (self.slab.len() - 1) as u32
            }
        };
        self.cached.insert(hash, i);
        true
    }

    fn unlink(&mut self, i: u32) {
        let Cached { prev, next, .. } = self.slab[i as usize];
        match prev {
            NIL => self.lru_head = next,
            p => self.slab[p as usize].next = next,
        }
        match next {
            NIL => self.lru_tail = prev,
            n => self.slab[n as usize].prev = prev,
        }
        self.evictable -= 1;
    }

    fn push_back(&mut self, i: u32) {
        let tail = self.lru_tail;
        let c = &mut self.slab[i as usize];
        c.prev = tail;
        c.next = NIL;
        match tail {
            NIL => self.lru_head = i,
            t => self.slab[t as usize].next = i,
        }
        self.lru_tail = i;
        self.evictable += 1;
    }

    /// The blocks evicted since the last call, in eviction order.
    pub fn take_evicted(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.evicted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_released_first() {
        let mut kv = KvCache::new(4);
        for h in [1, 2, 3] {
            assert!(kv.reserve(1));
            kv.alloc_private(1);
            assert!(kv.promote(h));
        }
        // Release in the order 2, 1, 3: 2 is the least recently used.
        for h in [2, 1, 3] {
            kv.release(h);
        }
        assert_eq!((kv.used(), kv.active(), kv.available()), (3, 0, 4));
        assert!(kv.acquire(1), "a hit takes 1 off the LRU");
        assert!(kv.reserve(3));
        assert_eq!(kv.take_evicted(), vec![2, 3]);
        kv.alloc_private(3);
        assert!(!kv.reserve(1), "1 is referenced and nothing else is evictable");
        assert_eq!(kv.take_evicted(), Vec::<u64>::new());
    }

    #[test]
    fn promoting_an_already_cached_hash_shares_it() {
        let mut kv = KvCache::new(2);
        kv.reserve(2);
        kv.alloc_private(2);
        assert!(kv.promote(7));
        assert!(!kv.promote(7));
        assert_eq!((kv.used(), kv.active()), (1, 1));
        kv.release(7);
        assert_eq!(kv.active(), 1, "one reference left");
        kv.release(7);
        assert_eq!(kv.active(), 0);
        kv.release(7);
        assert_eq!((kv.active(), kv.available()), (0, 2), "a release past zero changes nothing");
        assert!(kv.reserve(2));
        assert_eq!(kv.take_evicted(), vec![7], "evicted once");
    }
}
