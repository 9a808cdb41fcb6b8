//! One replica's side of the prefix index: the engine-id → block map its removals need, its
//! event counters and its sync status.

use super::outcome::EventCounters;
use crate::ids::{BlockHash, EngineBlockHash};
use rustc_hash::FxHashMap;

/// Per-replica index state.
#[derive(Debug, Default)]
pub(crate) struct ReplicaBlocks {
    /// Engine id → kvmesh block, per medium (`[GPU, CPU]`): removals carry engine ids only.
    /// Copy counts live with the block's holder.
    pub(crate) engine: [FxHashMap<EngineBlockHash, BlockHash>; 2],
    pub(crate) health: IndexHealth,
}

/// What the index knows about the health of one replica's event stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexHealth {
    /// Running counts of applied and rejected events.
    pub counters: EventCounters,
    /// A stored event referenced a parent never seen (case C03): some blocks are missing from
    /// the index until the replica is resynced (replay, or clear and rebuild). Cleared by a
    /// clear or [`crate::PrefixIndex::mark_in_sync`].
    pub out_of_sync: bool,
    /// The block size, in tokens, of the last event rejected for a block-size mismatch
    /// (case C04); `None` once a matching event has been applied.
    pub block_size_mismatch: Option<u32>,
}

impl ReplicaBlocks {
    /// Distinct (engine id, medium) mappings held.
    pub(crate) fn mappings(&self) -> usize {
        self.engine[0].len() + self.engine[1].len()
    }

    /// Gives memory back after many evictions, so the index stays bounded by what the replica
    /// really holds rather than by its historical peak.
    pub(crate) fn maybe_shrink(&mut self, medium: usize) {
        let map = &mut self.engine[medium];
        if map.capacity() > 64 && map.len() < map.capacity() / 4 {
            map.shrink_to(map.len() * 2);
        }
    }
}

/// Estimated heap bytes of a hashbrown table of `capacity` usable slots of `slot` bytes each:
/// buckets are a power of two at most 7/8 full, plus one control byte per bucket.
pub(crate) fn table_bytes(capacity: usize, slot: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets =
        if capacity < 8 { (capacity + 1).next_power_of_two() } else { (capacity * 8 / 7).next_power_of_two() };
    buckets * (slot + 1) + 16
}
