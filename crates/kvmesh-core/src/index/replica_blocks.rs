//! One replica's side of the prefix index: the engine-id → block map its removals need, its
//! event counters and its sync status.

use super::outcome::EventCounters;
use super::segments::Pos;
use super::table::Table;

/// One engine id's block and copies, packed into a `u64`: segment (32 bits), offset (24 bits,
/// [`super::segments::MAX_SEGMENT`] keeps offsets below 2^24), copies (8 bits, 1–255: a store
/// past 255 copies under one id is counted and changes nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mapping {
    pub(crate) pos: Pos,
    pub(crate) copies: u8,
}

impl Mapping {
    pub(crate) fn pack(self) -> u64 {
        (self.pos.seg as u64) << 32 | (self.pos.off as u64) << 8 | self.copies as u64
    }

    pub(crate) fn unpack(v: u64) -> Self {
        Mapping { pos: Pos { seg: (v >> 32) as u32, off: (v >> 8) as u32 & 0xFF_FFFF }, copies: v as u8 }
    }
}

/// Per-replica index state.
#[derive(Debug, Clone, Default)]
pub(crate) struct ReplicaBlocks {
    /// Engine id → where its block is and the copies stored under this id ([`Mapping`],
    /// packed), per medium (`[GPU, CPU]`): removals carry engine ids only. The block's holder
    /// counts the replica's copies under all its ids together.
    pub(crate) engine: [Table<u64>; 2],
    pub(crate) health: IndexHealth,
    /// Its stores' hasher, when it serves another model than the index's
    /// ([`super::PrefixIndex::set_replica_hasher`]).
    pub(crate) hasher: Option<crate::hashing::BlockHasher>,
    /// KV cache groups (`group_idx`) seen storing blocks the index does not follow: their
    /// removals are left aside too (a removal names its group, not its kind).
    pub(crate) other_groups: Vec<u32>,
    /// Whether this replica's history is partial ([`super::PrefixIndex::set_partial_history`]).
    pub(crate) partial_history: bool,
    /// Stores waiting for a parent, while the history is partial.
    pub(crate) orphans: super::orphans::Orphans,
    /// Engine id → the ids of the blocks inferred before it from a routed prompt
    /// ([`super::PrefixIndex::adopt_prompt`]), removed with it.
    pub(crate) inferred: rustc_hash::FxHashMap<u64, Vec<u64>>,
    /// Its sliding-window KV cache groups ([`super::window`]).
    pub(crate) windows: Vec<super::window::WindowGroup>,
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

#[cfg(test)]
#[test]
fn mappings_pack_losslessly() {
    let m = Mapping { pos: Pos { seg: u32::MAX, off: 0xFF_FFFF }, copies: 255 };
    assert_eq!(Mapping::unpack(m.pack()), m);
    let m = Mapping { pos: Pos { seg: 7, off: 9 }, copies: 1 };
    assert_eq!(Mapping::unpack(m.pack()), m);
}

impl ReplicaBlocks {
    /// Empty state whose tables mix engine ids with `seed`.
    pub(crate) fn with_seed(seed: u64) -> Self {
        ReplicaBlocks {
            engine: [Table::with_seed(seed), Table::with_seed(seed)],
            health: IndexHealth::default(),
            hasher: None,
            other_groups: Vec::new(),
            partial_history: false,
            orphans: Default::default(),
            inferred: Default::default(),
            windows: Vec::new(),
        }
    }

    /// Distinct (engine id, medium) mappings held.
    pub(crate) fn mappings(&self) -> usize {
        self.engine[0].len() + self.engine[1].len()
    }
}
