//! Stores whose parent the index has never seen, kept aside while a replica's history is
//! partial.
//!
//! Why: a router that starts following a long-running engine gets only the newest messages of
//! its replay buffer (vLLM keeps 10,000). Stores that chain under a prefix the engine cached
//! before that (a long-lived system prompt) name a parent no message still held mentions. A
//! rebuild cannot help — the buffer has nothing older — so instead of wiping the replica and
//! replaying again (which fails the same way), such a store waits here until its parent turns
//! up (the engine stores it again), and leaves if the engine removes any of its blocks first.

use super::event::Stored;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;

/// Most orphaned stores kept per replica; past it the oldest leave first.
pub const MAX_ORPHAN_STORES: usize = 4096;

/// One replica's orphaned stores.
#[derive(Debug, Clone, Default)]
pub(crate) struct Orphans {
    /// Parent engine id → the stores waiting for it, in arrival order.
    by_parent: FxHashMap<u64, Vec<Stored>>,
    /// An orphaned block's engine id → its store's parent id.
    parent_of: FxHashMap<u64, u64>,
    /// Parent ids in arrival order, one per store (for the bound).
    order: VecDeque<u64>,
    /// A waiting store's first block's tokens ([`content_key`]) → its parent ids: how a
    /// routed request's tokens find the stores that continue it.
    by_first: FxHashMap<u64, Vec<u64>>,
    blocks: usize,
}

/// A key for one block's token ids (not chained: the same tokens after any prefix).
pub(crate) fn content_key(tokens: &[u32]) -> u64 {
    use std::hash::Hasher;
    let mut h = rustc_hash::FxHasher::default();
    for &t in tokens {
        h.write_u32(t);
    }
    h.finish()
}

/// The first block's tokens of `s`, if it has one whole.
fn first_block(s: &Stored) -> Option<&[u32]> {
    s.token_ids.get(..s.block_size as usize).filter(|b| !b.is_empty())
}

impl Orphans {
    /// Blocks waiting.
    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }

    /// Heap bytes of what waits and of its maps.
    pub(crate) fn heap_bytes(&self) -> usize {
        // Each list's slots, and each store's own vectors.
        let stores: usize = self
            .by_parent
            .values()
            .map(|list| {
                list.capacity() * std::mem::size_of::<Stored>()
                    + list.iter().map(|s| s.token_ids.capacity() * 4 + s.block_hashes.capacity() * 8).sum::<usize>()
            })
            .sum();
        let lists: usize = self.by_first.values().map(|v| v.capacity() * 8).sum();
        stores
            + lists
            + super::map_bytes(&self.by_parent)
            + super::map_bytes(&self.parent_of)
            + super::map_bytes(&self.by_first)
            + self.order.capacity() * 8
    }

    /// Keeps `s` (whose parent is `parent`) aside; returns the blocks dropped to stay within
    /// [`MAX_ORPHAN_STORES`].
    pub(crate) fn keep(&mut self, parent: u64, s: Stored) -> usize {
        let mut dropped = 0;
        while self.order.len() >= MAX_ORPHAN_STORES {
            let Some(oldest) = self.order.pop_front() else { break };
            let gone = self.by_parent.get_mut(&oldest).and_then(|list| (!list.is_empty()).then(|| list.remove(0)));
            if self.by_parent.get(&oldest).is_some_and(Vec::is_empty) {
                self.by_parent.remove(&oldest);
            }
            if let Some(gone) = gone {
                dropped += self.unlink(&gone);
            }
        }
        for id in &s.block_hashes {
            self.parent_of.insert(id.0, parent);
        }
        self.blocks += s.block_hashes.len();
        if let Some(first) = first_block(&s) {
            self.by_first.entry(content_key(first)).or_default().push(parent);
        }
        self.by_parent.entry(parent).or_default().push(s);
        self.order.push_back(parent);
        dropped
    }

    /// The stores waiting for `parent`, taken out.
    pub(crate) fn take_children(&mut self, parent: u64) -> Vec<Stored> {
        let Some(list) = self.by_parent.remove(&parent) else { return Vec::new() };
        for s in &list {
            self.unlink(s);
        }
        // Their `order` entries stay until the bound reaches them; they find nothing then.
        list
    }

    /// The engine let block `id` go: a waiting store holding it leaves whole (the rest of it
    /// is going too: vLLM evicts a sequence's blocks from its end). Returns the blocks dropped.
    pub(crate) fn forget_block(&mut self, id: u64) -> usize {
        let Some(parent) = self.parent_of.get(&id).copied() else { return 0 };
        let Some(list) = self.by_parent.get_mut(&parent) else { return 0 };
        let Some(i) = list.iter().position(|s| s.block_hashes.iter().any(|h| h.0 == id)) else { return 0 };
        let gone = list.remove(i);
        if list.is_empty() {
            self.by_parent.remove(&parent);
        }
        self.unlink(&gone)
    }

    /// The parents of waiting stores that `rest` (a prompt's tokens from a block boundary on)
    /// continues: each store's first block is `rest`'s first `block_size` tokens, its tokens
    /// agree with `rest` as far as both go, and it was stored under LoRA adapter `lora_name`
    /// (vLLM names a store's adapter in every `BlockStored`). Distinct parents, in no order.
    pub(crate) fn parents_continued_by(&self, rest: &[u32], block_size: usize, lora_name: Option<&str>) -> Vec<u64> {
        let Some(first) = rest.get(..block_size) else { return Vec::new() };
        let list = self.by_first.get(&content_key(first)).map_or(&[][..], Vec::as_slice);
        let mut out: Vec<u64> = list
            .iter()
            .copied()
            .filter(|p| {
                // Keys can collide: the tokens themselves decide.
                self.by_parent.get(p).is_some_and(|stores| {
                    stores.iter().any(|s| {
                        let n = s.token_ids.len().min(rest.len());
                        first_block(s) == Some(first)
                            && s.token_ids[..n] == rest[..n]
                            && s.lora_name.as_deref() == lora_name
                    })
                })
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Drops everything.
    pub(crate) fn clear(&mut self) {
        *self = Orphans::default();
    }

    fn unlink(&mut self, s: &Stored) -> usize {
        for id in &s.block_hashes {
            self.parent_of.remove(&id.0);
        }
        if let (Some(first), Some(parent)) = (first_block(s), s.parent) {
            let key = content_key(first);
            if let Some(list) = self.by_first.get_mut(&key) {
                if let Some(i) = list.iter().position(|&p| p == parent.0) {
                    list.swap_remove(i);
                }
                if list.is_empty() {
                    self.by_first.remove(&key);
                }
            }
        }
        self.blocks -= s.block_hashes.len();
        s.block_hashes.len()
    }
}
