//! llm-d's approximate prefix index (llm-d-router `pkg/epp/framework/plugins/requestcontrol/
//! dataproducer/approximateprefix/indexer.go`): per server, an LRU of the block hashes of the
//! requests the scheduler sent there, each block [`LLMD_BLOCK_TOKENS`] tokens, capped at the
//! server's `num_gpu_blocks` entries; and, per hash, the servers holding it.
//!
//! A hash added again moves to the front of its server's LRU; a lookup does not. An entry
//! pushed out of the LRU leaves the hash's server list.

use crate::ids::ReplicaId;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::collections::VecDeque;

/// llm-d's smallest prefix block, tokens: its auto-tuned block size is the engine's
/// (`vllm:cache_config_info`'s `block_size`) clamped to at least this (`minBlockSizeTokens`).
pub(crate) const LLMD_BLOCK_TOKENS: u32 = 64;

/// llm-d's cap on the prefix it hashes, tokens (`MaxPrefixTokensToMatch`).
pub(crate) const LLMD_MAX_PREFIX_TOKENS: u32 = 131_072;

#[derive(Debug, Default)]
struct ServerLru {
    capacity: usize,
    stamps: FxHashMap<u64, u64>,
    /// `(stamp, hash)` oldest first; stale once the hash's stamp moved on.
    order: VecDeque<(u64, u64)>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct LruPrefixIndex {
    servers: Vec<ServerLru>,
    pods: FxHashMap<u64, SmallVec<[ReplicaId; 2]>>,
    clock: u64,
}

impl LruPrefixIndex {
    /// Adds `hashes` (one request's, in order) to `server`'s LRU. `capacity` (entries) is fixed
    /// when the server gets its first entry, as llm-d sizes each server's LRU once.
    pub(crate) fn add(&mut self, server: ReplicaId, hashes: &[u64], capacity: usize) {
        let s = server.index();
        if self.servers.len() <= s {
            self.servers.resize_with(s + 1, ServerLru::default);
        }
        let lru = &mut self.servers[s];
        if lru.capacity == 0 {
            lru.capacity = capacity.max(1);
        }
        for &h in hashes {
            self.clock += 1;
            if lru.stamps.insert(h, self.clock).is_none() {
                self.pods.entry(h).or_default().push(server);
            }
            lru.order.push_back((self.clock, h));
            while lru.stamps.len() > lru.capacity {
                let Some((stamp, old)) = lru.order.pop_front() else { break };
                if lru.stamps.get(&old) == Some(&stamp) {
                    lru.stamps.remove(&old);
                    if let Some(list) = self.pods.get_mut(&old) {
                        list.retain(|r| *r != server);
                        if list.is_empty() {
                            self.pods.remove(&old);
                        }
                    }
                }
            }
        }
        if lru.order.len() > 2 * lru.stamps.len().max(1024) {
            let stamps = &lru.stamps;
            lru.order.retain(|(t, h)| stamps.get(h) == Some(t));
        }
    }

    /// Forgets `server` (removed from the pool, as llm-d drops servers no longer in it).
    pub(crate) fn forget(&mut self, server: ReplicaId) {
        let Some(lru) = self.servers.get_mut(server.index()) else { return };
        let lru = std::mem::take(lru);
        for h in lru.stamps.keys() {
            if let Some(list) = self.pods.get_mut(h) {
                list.retain(|r| *r != server);
                if list.is_empty() {
                    self.pods.remove(h);
                }
            }
        }
    }

    /// llm-d's `matchLongestPrefix`: walks `hashes` until one no server holds and, for every
    /// hash before it, counts one for each server holding it. Appends `(server, count)` to `out`.
    /// (A server missing block `i` still counts block `i + 1` while another server keeps the
    /// walk going: llm-d counts held blocks, not a run per server.)
    pub(crate) fn matches(&self, hashes: &[u64], out: &mut FxHashMap<ReplicaId, u32>) {
        out.clear();
        for h in hashes {
            let Some(list) = self.pods.get(h) else { break };
            for &s in list {
                *out.entry(s).or_default() += 1;
            }
        }
    }

    /// Entries in `server`'s LRU.
    #[cfg(test)]
    pub(crate) fn len(&self, server: ReplicaId) -> usize {
        self.servers.get(server.index()).map_or(0, |l| l.stamps.len())
    }
}
