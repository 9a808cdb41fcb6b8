//! A prefix index that routing reads while events are being applied to it.
//!
//! [`PublishedIndex`] keeps two copies of a [`PrefixIndex`] (the left-right scheme: Ramalhete
//! and Correia, "Left-Right: A Concurrency Control Technique with Wait-Free Population
//! Oblivious Reads", 2015; jonhoo's `left-right` crate). Readers query the *front* copy; the one
//! writer applies to the *back* copy, then swaps the two, and brings the old front up to date
//! with the same operations when it next writes. A reader never blocks on the writer: it
//! takes whichever copy is not being written (retrying, without sleeping, in the instant the
//! copies swap). The writer waits, at most, for the readers still on the copy it is about to
//! bring up to date (one query each).
//!
//! Lock order, for callers that hold other locks: a reader's guard must not be held while
//! taking the writer (the writer may be waiting for that very guard), and the writer must not
//! be held while waiting for a lock whose holders may take the writer.
//!
//! ```text
//!  ingest ──write()──► back copy: catch up on the last write's ops, apply, log ──drop──► swap
//!  route  ──read()───► front copy (never the one being written)
//! ```
//!
//! The price: every write is applied twice, and the index is held twice. Both copies start
//! empty with the same seed and see the same operations in the same order, and the index is
//! deterministic, so both answer every query alike (pinned by the tests). A write that panics
//! (a bug: the index never panics on event content) is dropped whole: readers keep the copy
//! before it, and the next writer rebuilds its copy from theirs. Built from std locks only: no
//! `unsafe`.

use super::{ApplyOutcome, KvEvent, PrefixIndex};
use crate::hashing::BlockHasher;
use crate::ids::ReplicaId;
use rustc_hash::FxHashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};

/// A [`PrefixIndex`] shared between one writer at a time and any number of readers that never
/// wait for it (see the module doc).
#[derive(Debug)]
pub struct PublishedIndex {
    copies: [RwLock<PrefixIndex>; 2],
    /// Which copy readers take: 0 or 1.
    front: AtomicUsize,
    /// The writer's own state; held for as long as an [`IndexWriter`] lives.
    writer: Mutex<WriterState>,
}

/// What the writer keeps between writes.
#[derive(Debug, Default)]
struct WriterState {
    /// Operations applied to the front copy that the back copy still lacks.
    behind: Vec<Op>,
    /// Replicas registered and not removed: events of any other id are refused, so that the
    /// events of a replica removed while they were on their way leave nothing behind.
    registered: FxHashSet<ReplicaId>,
    /// A write panicked: the back copy is half written and must be rebuilt from the front.
    diverged: bool,
}

/// One write, kept to be applied again to the other copy.
#[derive(Debug)]
enum Op {
    Register(ReplicaId, Option<BlockHasher>),
    Event(ReplicaId, KvEvent),
    Partial(ReplicaId, bool),
    Adopt { replica: ReplicaId, tokens: Vec<u32>, lora_name: Option<String>, cache_salt: Option<String> },
    Remove(ReplicaId),
}

impl Op {
    fn apply(&self, index: &mut PrefixIndex) {
        match self {
            Op::Register(id, hasher) => {
                if let Some(h) = hasher {
                    index.set_replica_hasher(*id, *h);
                }
            }
            Op::Event(id, event) => {
                index.apply(*id, event);
            }
            Op::Partial(id, partial) => index.set_partial_history(*id, *partial),
            Op::Adopt { replica, tokens, lora_name, cache_salt } => {
                index.adopt_prompt(*replica, tokens, lora_name.as_deref(), cache_salt.as_deref());
            }
            Op::Remove(id) => {
                index.remove_replica(*id);
            }
        }
    }
}

impl PublishedIndex {
    /// An empty index, as [`PrefixIndex::with_seed`] makes it, held twice.
    pub fn new(hasher: BlockHasher, seed: u64) -> Self {
        PublishedIndex {
            copies: [
                RwLock::new(PrefixIndex::with_seed(hasher, seed)),
                RwLock::new(PrefixIndex::with_seed(hasher, seed)),
            ],
            front: AtomicUsize::new(0),
            writer: Mutex::new(WriterState::default()),
        }
    }

    /// The index as of the last finished write. Never blocks on the writer: when the copy a
    /// reader picked is being written (the writer swapped the copies in between), it takes the
    /// other one. Hold the guard for one query or a few reads, and never while taking the
    /// writer: the writer's next write waits for it.
    pub fn read(&self) -> RwLockReadGuard<'_, PrefixIndex> {
        loop {
            let front = self.front.load(Ordering::Acquire);
            match self.copies[front].try_read() {
                Ok(guard) => return guard,
                Err(TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(TryLockError::WouldBlock) => std::hint::spin_loop(),
            }
        }
    }

    /// The writer: brings the back copy up to date with the last write (waiting for readers
    /// still on it) and applies to it; readers see its writes when it is dropped. One writer
    /// at a time: a second caller waits for the first to be dropped.
    pub fn write(&self) -> IndexWriter<'_> {
        let mut state = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        // Only the writer moves `front`, and it holds `state`: this read is current.
        let back = 1 - self.front.load(Ordering::Acquire);
        let mut copy = self.copies[back].write().unwrap_or_else(PoisonError::into_inner);
        if state.diverged {
            *copy = self.copies[1 - back].read().unwrap_or_else(PoisonError::into_inner).clone();
            state.behind.clear();
            state.diverged = false;
        }
        for op in state.behind.drain(..) {
            op.apply(&mut copy);
        }
        IndexWriter { owner: self, state, copy: Some(copy), back }
    }
}

/// The one writer of a [`PublishedIndex`] ([`PublishedIndex::write`]). Its writes become
/// visible to readers when it is dropped, all together.
#[derive(Debug)]
pub struct IndexWriter<'a> {
    owner: &'a PublishedIndex,
    state: MutexGuard<'a, WriterState>,
    /// The back copy; `None` only while dropping.
    copy: Option<RwLockWriteGuard<'a, PrefixIndex>>,
    back: usize,
}

impl IndexWriter<'_> {
    fn copy(&mut self) -> &mut PrefixIndex {
        self.copy.as_mut().expect("the writer holds its copy until dropped")
    }

    fn log(&mut self, op: Op) {
        op.apply(self.copy());
        self.state.behind.push(op);
    }

    /// The index with every write so far, this writer's included.
    pub fn index(&self) -> &PrefixIndex {
        self.copy.as_ref().expect("the writer holds its copy until dropped")
    }

    /// Registers `replica`, whose blocks are hashed with `hasher` when given (another model's
    /// namespace: [`PrefixIndex::set_replica_hasher`]), else the index's own.
    pub fn register(&mut self, replica: ReplicaId, hasher: Option<BlockHasher>) {
        self.state.registered.insert(replica);
        self.log(Op::Register(replica, hasher));
    }

    /// Whether `replica` is registered.
    pub fn is_registered(&self, replica: ReplicaId) -> bool {
        self.state.registered.contains(&replica)
    }

    /// Applies one event from `replica` ([`PrefixIndex::apply`]); `None` (nothing applied)
    /// for a replica not registered, or removed.
    pub fn apply(&mut self, replica: ReplicaId, event: KvEvent) -> Option<ApplyOutcome> {
        if !self.is_registered(replica) {
            return None;
        }
        let outcome = self.copy().apply(replica, &event);
        self.state.behind.push(Op::Event(replica, event));
        Some(outcome)
    }

    /// [`PrefixIndex::set_partial_history`], for a registered replica.
    pub fn set_partial_history(&mut self, replica: ReplicaId, partial: bool) {
        if self.is_registered(replica) {
            self.log(Op::Partial(replica, partial));
        }
    }

    /// [`PrefixIndex::adopt_prompt`]; `None` for a replica not registered.
    pub fn adopt_prompt(
        &mut self,
        replica: ReplicaId,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Option<ApplyOutcome> {
        if !self.is_registered(replica) {
            return None;
        }
        let outcome = self.copy().adopt_prompt(replica, tokens, lora_name, cache_salt);
        self.state.behind.push(Op::Adopt {
            replica,
            tokens: tokens.to_vec(),
            lora_name: lora_name.map(str::to_string),
            cache_salt: cache_salt.map(str::to_string),
        });
        Some(outcome)
    }

    /// Drops every block of `replica` and forgets it ([`PrefixIndex::remove_replica`]): its
    /// events are refused from now on. Returns the entries dropped.
    pub fn remove_replica(&mut self, replica: ReplicaId) -> u32 {
        self.state.registered.remove(&replica);
        let dropped = self.copy().remove_replica(replica);
        self.state.behind.push(Op::Remove(replica));
        dropped
    }
}

impl Drop for IndexWriter<'_> {
    fn drop(&mut self) {
        // Unlock the written copy before readers are sent to it: a reader that finds it still
        // locked would only spin.
        drop(self.copy.take());
        if std::thread::panicking() {
            // Half written: readers stay where they are, and the next writer starts afresh.
            self.state.behind.clear();
            self.state.diverged = true;
            return;
        }
        self.owner.front.store(self.back, Ordering::Release);
    }
}

#[cfg(test)]
mod tests;
