//! Where a fleet's prefix index lives: in the fleet itself (the simulator, one thread), or
//! published beside it (the node: ingest applies events without the fleet, and a decision
//! reads the index without waiting for them; [`PublishedIndex`]).

use crate::hashing::BlockHasher;
use crate::ids::ReplicaId;
use crate::index::{ApplyOutcome, KvEvent, PrefixIndex, PublishedIndex};
use std::sync::{Arc, RwLockReadGuard};

// One per fleet, never in a collection: the size difference costs nothing, a box would cost
// the simulator a pointer chase per query.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(super) enum IndexHome {
    Owned(PrefixIndex),
    Published(Arc<PublishedIndex>),
}

/// The fleet's prefix index, read ([`crate::Fleet::index`]): a reference to its own, or a
/// read guard on the published one's front copy (hold it for a few reads only: the index's
/// writer waits for it before its next write).
#[derive(Debug)]
pub enum IndexRef<'a> {
    /// The fleet's own index.
    Owned(&'a PrefixIndex),
    /// The published index's front copy.
    Published(RwLockReadGuard<'a, PrefixIndex>),
}

impl std::ops::Deref for IndexRef<'_> {
    type Target = PrefixIndex;
    fn deref(&self) -> &PrefixIndex {
        match self {
            IndexRef::Owned(ix) => ix,
            IndexRef::Published(g) => g,
        }
    }
}

impl IndexHome {
    pub(super) fn read(&self) -> IndexRef<'_> {
        match self {
            IndexHome::Owned(ix) => IndexRef::Owned(ix),
            IndexHome::Published(p) => IndexRef::Published(p.read()),
        }
    }

    pub(super) fn register(&mut self, id: ReplicaId, hasher: Option<BlockHasher>) {
        match self {
            IndexHome::Owned(ix) => {
                if let Some(h) = hasher {
                    ix.set_replica_hasher(id, h);
                }
            }
            IndexHome::Published(p) => p.write().register(id, hasher),
        }
    }

    pub(super) fn apply(&mut self, id: ReplicaId, event: &KvEvent) -> ApplyOutcome {
        match self {
            IndexHome::Owned(ix) => ix.apply(id, event),
            IndexHome::Published(p) => p.write().apply(id, event.clone()).unwrap_or_default(),
        }
    }

    pub(super) fn set_partial_history(&mut self, id: ReplicaId, partial: bool) {
        match self {
            IndexHome::Owned(ix) => ix.set_partial_history(id, partial),
            IndexHome::Published(p) => p.write().set_partial_history(id, partial),
        }
    }

    pub(super) fn adopt_prompt(
        &mut self,
        id: ReplicaId,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> ApplyOutcome {
        match self {
            IndexHome::Owned(ix) => ix.adopt_prompt(id, tokens, lora_name, cache_salt),
            IndexHome::Published(p) => p.write().adopt_prompt(id, tokens, lora_name, cache_salt).unwrap_or_default(),
        }
    }

    pub(super) fn remove_replica(&mut self, id: ReplicaId) {
        match self {
            IndexHome::Owned(ix) => {
                ix.remove_replica(id);
            }
            IndexHome::Published(p) => {
                p.write().remove_replica(id);
            }
        }
    }
}
