//! What applying one event did: counted outcomes, never panics (cases C02–C05, C20).

/// Why an event (or part of one) was not applied. Each kind is counted per replica in
/// [`EventCounters`] so operators see a replica that sends bad events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Rejection {
    /// The event's `block_size` differs from the index's (case C04): the whole event is dropped
    /// and the replica flagged, since its overlaps would silently be wrong.
    BlockSizeMismatch {
        /// The engine's block size, in tokens.
        got: u32,
        /// The index's block size, in tokens.
        want: u32,
    },
    /// `token_ids.len()` is not `block_hashes.len() × block_size`.
    TokenCountMismatch,
    /// The stored event's parent is one of its own blocks, or it repeats a block id (case C02).
    SelfReferential,
    /// The stored event's parent was never seen on this replica (case C03): the replica is now
    /// out of sync and must be resynced (replay, or clear and rebuild).
    UnknownParent,
    /// A removal named a block this replica does not hold (already removed, or never seen).
    UnknownBlock,
    /// An engine id arrived again for different tokens than it held; the old mapping was
    /// replaced.
    ConflictingBlock,
    /// The replica id is `u32::MAX`, which the index reserves; nothing was applied.
    ReservedReplica,
}

impl Rejection {
    /// A stable snake_case name, for logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Rejection::BlockSizeMismatch { .. } => "block_size_mismatch",
            Rejection::TokenCountMismatch => "token_count_mismatch",
            Rejection::SelfReferential => "self_referential",
            Rejection::UnknownParent => "unknown_parent",
            Rejection::UnknownBlock => "unknown_block",
            Rejection::ConflictingBlock => "conflicting_block",
            Rejection::ReservedReplica => "reserved_replica",
        }
    }
}

/// The result of applying one event to one replica.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Block copies added (a stored block already held adds a copy, case C20).
    pub stored: u32,
    /// Block copies removed.
    pub removed: u32,
    /// Blocks dropped by a clear.
    pub cleared: u32,
    /// Blocks of a KV cache group the index does not follow (a hybrid model's
    /// sliding-window, Mamba or local group: [`crate::index::KvGroup::covers_whole_prefix`]),
    /// left aside.
    pub other_group: u32,
    /// Blocks of a store whose parent is unknown, kept aside while the replica's history is
    /// partial (see [`crate::PrefixIndex::set_partial_history`]).
    pub orphaned: u32,
    /// Blocks of stores kept aside earlier, placed now that this event stored their parent.
    pub adopted: u32,
    /// Blocks of a lost prefix placed from a prompt routed to the replica
    /// ([`crate::PrefixIndex::adopt_prompt`]).
    pub inferred: u32,
    /// Blocks kept aside that left: removed by the engine, or past the bound.
    pub orphans_dropped: u32,
    /// The first problem found, if any. A store is all or nothing (except a conflicting id,
    /// which is replaced); a removal applies every block it knows and skips the others.
    pub rejection: Option<Rejection>,
}

/// Per-replica running counts of what the index did with that replica's events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventCounters {
    /// Events applied without any rejection.
    pub applied: u64,
    /// Block copies stored.
    pub blocks_stored: u64,
    /// Block copies removed.
    pub blocks_removed: u64,
    /// Clears applied.
    pub clears: u64,
    /// Rejections, by kind: `[block_size_mismatch, token_count_mismatch, self_referential,
    /// unknown_parent, unknown_block, conflicting_block, reserved_replica]`.
    pub rejected: [u64; 7],
}

impl EventCounters {
    pub(crate) fn count(&mut self, outcome: &ApplyOutcome) {
        self.blocks_stored += outcome.stored as u64;
        self.blocks_removed += outcome.removed as u64;
        match outcome.rejection {
            None => self.applied += 1,
            Some(r) => self.rejected[rejection_slot(r)] += 1,
        }
    }

    /// The count of one rejection kind.
    pub fn rejected(&self, kind: Rejection) -> u64 {
        self.rejected[rejection_slot(kind)]
    }
}

fn rejection_slot(r: Rejection) -> usize {
    match r {
        Rejection::BlockSizeMismatch { .. } => 0,
        Rejection::TokenCountMismatch => 1,
        Rejection::SelfReferential => 2,
        Rejection::UnknownParent => 3,
        Rejection::UnknownBlock => 4,
        Rejection::ConflictingBlock => 5,
        Rejection::ReservedReplica => 6,
    }
}
