//! One replica's side of the prefix index: the engine-id → block map its removals need, its
//! event counters and its sync status.

use super::outcome::EventCounters;
use super::table::Table;

/// Per-replica index state.
#[derive(Debug, Default)]
pub(crate) struct ReplicaBlocks {
    /// Engine id → kvmesh block hash (the ids' `u64`s), per medium (`[GPU, CPU]`): removals
    /// carry engine ids only. Copy counts live with the block's holder.
    pub(crate) engine: [Table<u64>; 2],
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
    /// Empty state whose tables mix engine ids with `seed`.
    pub(crate) fn with_seed(seed: u64) -> Self {
        ReplicaBlocks { engine: [Table::with_seed(seed), Table::with_seed(seed)], health: IndexHealth::default() }
    }

    /// Distinct (engine id, medium) mappings held.
    pub(crate) fn mappings(&self) -> usize {
        self.engine[0].len() + self.engine[1].len()
    }
}
