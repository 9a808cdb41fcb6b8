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
}
