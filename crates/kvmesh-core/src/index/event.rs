//! The engine KV-cache events the index applies, in kvmesh's own decoded form.
//!
//! These mirror vLLM's `BlockStored`, `BlockRemoved` and `AllBlocksCleared`
//! (`vllm/distributed/kv_events.py`) and SGLang's equivalents; the wire decoding lives in
//! `kvmesh-events`. Engine hashes are opaque: the index recomputes its own chained
//! [`crate::BlockHash`]es from `token_ids`.

use crate::ids::{EngineBlockHash, Medium};

/// One KV-cache event from one replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks were written to the cache.
    Stored(Stored),
    /// Blocks were evicted (or freed) from the cache.
    Removed(Removed),
    /// The replica dropped every block (vLLM `AllBlocksCleared`, e.g. `reset_prefix_cache`).
    Cleared,
}

/// vLLM `BlockStored`: consecutive full blocks of one sequence, the first chained to `parent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The engine's ids of the stored blocks, in sequence order.
    pub block_hashes: Vec<EngineBlockHash>,
    /// The engine's id of the block before the first one; `None` when the first stored block
    /// starts the sequence.
    pub parent: Option<EngineBlockHash>,
    /// The tokens of all stored blocks: exactly `block_hashes.len() × block_size` ids.
    pub token_ids: Vec<u32>,
    /// The engine's block size, in tokens; must equal the index's.
    pub block_size: u32,
    /// Where the blocks were stored (vLLM's `medium`; `None` on the wire means GPU).
    pub medium: Medium,
    /// The LoRA adapter the blocks were computed with (vLLM's `lora_name`; `None` for the base
    /// model). It seeds the chain of a sequence's first block (see
    /// [`crate::BlockHasher::for_adapter`]), so adapter blocks never match base-model requests.
    pub lora_name: Option<String>,
    /// What vLLM's per-block `extra_keys` add to its block hashes beyond the LoRA adapter
    /// (`None`: nothing, or an engine that sends no extra keys).
    pub extra_keys: Option<ExtraKeys>,
    /// The KV cache group the blocks belong to (hybrid models; `None`: the engine's only
    /// group, or an engine that does not say).
    pub kv_group: Option<KvGroup>,
}

/// One of a hybrid model's KV cache groups, as vLLM's `BlockStored` names it (`group_idx`,
/// `kv_cache_spec_kind`; vllm/v1/kv_cache_interface.py `KVCacheSpecKind`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroup {
    /// `group_idx`.
    pub idx: u32,
    /// `kv_cache_spec_kind` (`full_attention`, `mla_attention`, `sliding_window`, `mamba`, …),
    /// when sent.
    pub kind: Option<String>,
    /// `kv_cache_spec_sliding_window`: a sliding-window group's window, tokens, when sent.
    pub sliding_window: Option<u32>,
}

impl KvGroup {
    /// Whether the group keeps every token's KV, so that it decides a prefix hit over the
    /// whole prefix: full attention, MLA, sink full attention (or a kind not sent). The
    /// index follows these groups only; a hybrid model's sliding-window, Mamba or local
    /// groups hold only the recent part of a sequence, and vLLM's hit needs them only there
    /// (vllm/v1/core/kv_cache_coordinator.py `HybridKVCacheCoordinator`).
    pub fn covers_whole_prefix(&self) -> bool {
        self.kind.as_deref().is_none_or(|k| matches!(k, "full_attention" | "mla_attention" | "sink_full_attention"))
    }

    /// The window, tokens, of a sliding-window group whose window was sent: the index
    /// follows such a group too, and a prefix hit needs its last blocks before the hit point
    /// ([`crate::PrefixIndex::overlaps`]).
    pub fn window(&self) -> Option<u32> {
        self.sliding_window.filter(|_| matches!(self.kind.as_deref(), Some("sliding_window" | "sliding_window_mla")))
    }
}

/// vLLM's per-block `extra_keys` (vllm/v1/core/kv_cache_utils.py
/// `generate_block_hash_extra_keys`: the LoRA name, multimodal `(identifier, offset)` pairs,
/// the `cache_salt` on a sequence's first block, prompt-embedding digests) as the index uses
/// them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    /// The `cache_salt` of the sequence the store starts (its first block's string key that is
    /// not the LoRA name): the chain is seeded in the salted namespace
    /// ([`crate::BlockHasher::for_salt`]), so the blocks match only requests with that salt.
    pub cache_salt: Option<String>,
    /// Per stored block, in order, a digest of the keys a router cannot verify from a
    /// request's tokens (multimodal identifiers, embedding digests); 0 for a block without
    /// any. Such a block and the rest of its chain never count as overlap for a request
    /// ([`crate::BlockHasher::with_extra`]). Empty: no block has any.
    pub unverifiable: Vec<u64>,
}

/// vLLM `BlockRemoved`: the named blocks (one copy each) left `medium`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    /// The engine's ids of the removed blocks.
    pub block_hashes: Vec<EngineBlockHash>,
    /// The KV cache group they left (vLLM's `group_idx`), when sent.
    pub kv_group: Option<u32>,
    /// The medium they were removed from.
    pub medium: Medium,
}

impl KvEvent {
    /// Blocks the event names (0 for a clear).
    pub fn blocks(&self) -> usize {
        match self {
            KvEvent::Stored(s) => s.block_hashes.len(),
            KvEvent::Removed(r) => r.block_hashes.len(),
            KvEvent::Cleared => 0,
        }
    }

    /// The event as events of at most `most` blocks each, in order, which apply to the index
    /// as the whole one does: a store is split into consecutive stores, each chained to the
    /// last block of the one before, a removal into removals of its parts. A store the index
    /// rejects whole (token count off, a block id repeated or its own parent: case C02) is
    /// left whole, so it still is; so is any event of at most `most` blocks (borrowed).
    ///
    /// What it is for: a writer that must let readers in (a router's routing decisions)
    /// applies a long prefill chunk or eviction a part at a time.
    pub fn sections(&self, most: usize) -> impl Iterator<Item = std::borrow::Cow<'_, KvEvent>> {
        use std::borrow::Cow;
        let most = most.max(1);
        let n = self.blocks();
        let splits = match self {
            KvEvent::Stored(s) => {
                n > most && s.token_ids.len() == n * s.block_size as usize && {
                    let mut ids: std::collections::HashSet<_> = s.block_hashes.iter().copied().collect();
                    ids.len() == n && s.parent.is_none_or(|p| ids.insert(p))
                }
            }
            KvEvent::Removed(_) => n > most,
            KvEvent::Cleared => false,
        };
        let pieces = if splits { n.div_ceil(most) } else { 1 };
        (0..pieces).map(move |i| {
            if !splits {
                return Cow::Borrowed(self);
            }
            let range = i * most..((i + 1) * most).min(n);
            Cow::Owned(match self {
                KvEvent::Stored(s) => {
                    let bs = s.block_size as usize;
                    KvEvent::Stored(Stored {
                        block_hashes: s.block_hashes[range.clone()].to_vec(),
                        parent: if i == 0 { s.parent } else { Some(s.block_hashes[range.start - 1]) },
                        token_ids: s.token_ids[range.start * bs..range.end * bs].to_vec(),
                        block_size: s.block_size,
                        medium: s.medium,
                        lora_name: s.lora_name.clone(),
                        extra_keys: s.extra_keys.as_ref().map(|e| ExtraKeys {
                            cache_salt: e.cache_salt.clone(),
                            unverifiable: {
                                let len = e.unverifiable.len();
                                e.unverifiable[range.start.min(len)..range.end.min(len)].to_vec()
                            },
                        }),
                        kv_group: s.kv_group.clone(),
                    })
                }
                KvEvent::Removed(r) => KvEvent::Removed(Removed {
                    block_hashes: r.block_hashes[range].to_vec(),
                    medium: r.medium,
                    kv_group: r.kv_group,
                }),
                KvEvent::Cleared => KvEvent::Cleared,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{EngineBlockHash as H, Medium};

    fn stored(ids: std::ops::Range<u64>, parent: Option<u64>) -> KvEvent {
        let n = ids.end - ids.start;
        KvEvent::Stored(Stored {
            block_hashes: ids.map(H).collect(),
            parent: parent.map(H),
            token_ids: (0..n as u32 * 2).collect(),
            block_size: 2,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: None,
            kv_group: None,
        })
    }

    #[test]
    fn a_long_store_splits_into_chained_stores_and_a_removal_into_parts() {
        let e = stored(10..15, Some(9));
        let pieces: Vec<KvEvent> = e.sections(2).map(|p| p.into_owned()).collect();
        let KvEvent::Stored(first) = &pieces[0] else { panic!() };
        assert_eq!(pieces.len(), 3);
        assert_eq!(
            (first.block_hashes.clone(), first.parent, first.token_ids.clone()),
            (vec![H(10), H(11)], Some(H(9)), vec![0, 1, 2, 3])
        );
        let KvEvent::Stored(last) = &pieces[2] else { panic!() };
        assert_eq!(
            (last.block_hashes.clone(), last.parent, last.token_ids.clone()),
            (vec![H(14)], Some(H(13)), vec![8, 9])
        );
        let r =
            KvEvent::Removed(Removed { block_hashes: (1..6).map(H).collect(), medium: Medium::Cpu, kv_group: None });
        let parts: Vec<Vec<u64>> = r
            .sections(2)
            .map(|p| match p.into_owned() {
                KvEvent::Removed(r) => r.block_hashes.iter().map(|h| h.0).collect(),
                _ => panic!(),
            })
            .collect();
        assert_eq!(parts, vec![vec![1, 2], vec![3, 4], vec![5]]);
    }

    #[test]
    fn events_the_index_rejects_whole_are_not_split() {
        // A repeated id, its own parent, a token count off: case C02 and the like stay whole.
        let mut repeated = stored(1..6, None);
        if let KvEvent::Stored(s) = &mut repeated {
            s.block_hashes[4] = H(1);
        }
        let own_parent = stored(1..6, Some(3));
        let mut short = stored(1..6, None);
        if let KvEvent::Stored(s) = &mut short {
            s.token_ids.pop();
        }
        for e in [repeated, own_parent, short, stored(1..3, None), KvEvent::Cleared] {
            let pieces: Vec<_> = e.sections(2).collect();
            assert_eq!(pieces.len(), 1);
            assert!(matches!(pieces[0], std::borrow::Cow::Borrowed(_)));
        }
    }
}
