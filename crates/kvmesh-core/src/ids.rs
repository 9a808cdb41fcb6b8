//! Identifiers shared by every part of the core: replicas, blocks, engine block ids and media.

use std::fmt;

/// A dense id of one engine replica inside one [`crate::Fleet`] (an index into its replica table).
///
/// Dense so that per-replica state is a `Vec` slot, not a map lookup, on the hot path. Ids are
/// assigned at registration and never reused while the fleet lives. Stable, human names
/// (`"vllm-0"`) live beside the id in [`crate::fleet::ReplicaState::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaId(pub u32);

impl ReplicaId {
    /// The id as a `Vec` index.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "replica#{}", self.0)
    }
}

/// kvmesh's own chained hash of one full block of `block_size` tokens (see [`crate::hashing`]).
///
/// Equal `BlockHash`es mean equal whole prefixes up to and including the block, within one
/// namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// The engine's own opaque id for a block, as carried by its KV events.
///
/// vLLM sends 64-bit (often ≥ 2^63) `sha256_cbor`-derived ids, SGLang sends signed 64-bit ids:
/// both are stored as the same 64 bits. kvmesh never interprets them; it only maps them to the
/// [`BlockHash`] it recomputed from the event's tokens, for later removals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineBlockHash(pub u64);

impl From<i64> for EngineBlockHash {
    /// SGLang's signed ids: the same 64 bits as vLLM's unsigned form (case C05).
    fn from(v: i64) -> Self {
        EngineBlockHash(v as u64)
    }
}

impl From<u64> for EngineBlockHash {
    fn from(v: u64) -> Self {
        EngineBlockHash(v)
    }
}

/// Where a replica keeps a block: GPU memory (usable at once) or CPU memory (offloaded; must be
/// copied back, still far cheaper than recomputing). vLLM's events say `"GPU"` or `"CPU"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// GPU HBM, vLLM's default medium.
    Gpu,
    /// Host memory (KV offloading).
    Cpu,
}

impl Medium {
    /// Both media, in index order.
    pub const ALL: [Medium; 2] = [Medium::Gpu, Medium::Cpu];

    /// 0 for GPU, 1 for CPU: the slot in per-medium arrays.
    #[inline]
    pub fn index(self) -> usize {
        match self {
            Medium::Gpu => 0,
            Medium::Cpu => 1,
        }
    }
}
