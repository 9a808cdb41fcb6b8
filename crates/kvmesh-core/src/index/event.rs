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
}

/// vLLM `BlockRemoved`: the named blocks (one copy each) left `medium`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    /// The engine's ids of the removed blocks.
    pub block_hashes: Vec<EngineBlockHash>,
    /// The medium they were removed from.
    pub medium: Medium,
}
