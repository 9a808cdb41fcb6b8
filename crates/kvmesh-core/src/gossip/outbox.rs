//! A node's own booking deltas, waiting to be sent, and its live set for summaries.

use super::{Delta, DeltaKind, Summary, SummaryEntry};
use crate::fleet::{Fleet, Routed};
use crate::ids::BlockHash;
use crate::load::BookingSpec;
use std::collections::BTreeMap;

/// Deltas not yet taken by the sender, and the live bookings a [`Summary`] lists.
///
/// Bounded: at most `max_pending` deltas wait (older ones are dropped when peers are gone and
/// nobody takes them — the next summary repairs what they carried).
#[derive(Debug)]
pub struct Outbox {
    seq: u64,
    pending: Vec<Delta>,
    live: BTreeMap<u64, SummaryEntry>,
    max_prefix_blocks: usize,
    max_pending: usize,
    dropped: u64,
}

impl Outbox {
    /// An empty outbox whose Book deltas carry at most `max_prefix_blocks` leading block
    /// hashes and which holds at most `max_pending` deltas.
    pub fn new(max_prefix_blocks: usize, max_pending: usize) -> Self {
        Outbox {
            seq: 0,
            pending: Vec::new(),
            live: BTreeMap::new(),
            max_prefix_blocks,
            max_pending: max_pending.max(1),
            dropped: 0,
        }
    }

    fn push(&mut self, booking: u64, kind: DeltaKind, now: f64) {
        self.seq += 1;
        if self.pending.len() >= self.max_pending {
            let half = self.max_pending / 2;
            self.dropped += half as u64;
            self.pending.drain(..half.max(1));
        }
        self.pending.push(Delta { seq: self.seq, booking, kind, at: now });
    }

    /// A local request was routed to `replica` at `now` (node seconds); `prefix` is its block
    /// hashes.
    pub fn book(&mut self, booking: u64, replica: &str, spec: BookingSpec, prefix: &[BlockHash], now: f64) {
        let prefix = prefix[..prefix.len().min(self.max_prefix_blocks)].to_vec();
        let entry = SummaryEntry { booking, replica: replica.to_string(), spec, first_token: false, booked_at: now };
        self.live.insert(booking, entry);
        self.push(booking, DeltaKind::Book { replica: replica.to_string(), spec, prefix }, now);
    }

    /// `routed` was just booked in `fleet` at `now` for a prompt with block hashes `prefix`:
    /// announces it with the replica's name and the booking's spec (nothing if the fleet no
    /// longer has either).
    pub fn routed(&mut self, fleet: &Fleet, routed: &Routed, prefix: &[BlockHash], now: f64) {
        let name = fleet.replica(routed.decision.replica).map(|r| r.spec.name.as_str());
        if let (Some(name), Some(b)) = (name, fleet.bookings().get(routed.booking)) {
            self.book(routed.booking.0, name, b.spec, prefix, now);
        }
    }

    /// A local booking's first token arrived at `now` (ignored for an unknown booking).
    pub fn first_token(&mut self, booking: u64, now: f64) {
        if let Some(e) = self.live.get_mut(&booking) {
            if !e.first_token {
                e.first_token = true;
                self.push(booking, DeltaKind::FirstToken, now);
            }
        }
    }

    /// A local booking ended at `now` (ignored for an unknown booking, so a double release
    /// sends once).
    pub fn release(&mut self, booking: u64, output_tokens: Option<u32>, now: f64) {
        if self.live.remove(&booking).is_some() {
            self.push(booking, DeltaKind::Release { output_tokens }, now);
        }
    }

    /// Every local booking on `replica` ended at once at `now` (the replica was removed, its
    /// bookings dropped with it); returns how many.
    pub fn release_replica(&mut self, replica: &str, now: f64) -> usize {
        let gone: Vec<u64> = self.live.values().filter(|e| e.replica == replica).map(|e| e.booking).collect();
        for b in &gone {
            self.release(*b, None, now);
        }
        gone.len()
    }

    /// Takes the deltas waiting to be sent, in sequence order.
    pub fn take(&mut self) -> Vec<Delta> {
        std::mem::take(&mut self.pending)
    }

    /// Takes at most `n` of the waiting deltas, oldest first.
    pub fn take_at_most(&mut self, n: usize) -> Vec<Delta> {
        if self.pending.len() <= n {
            return self.take();
        }
        let rest = self.pending.split_off(n);
        std::mem::replace(&mut self.pending, rest)
    }

    /// The live set as of the latest sequence number.
    pub fn summary(&self) -> Summary {
        Summary { seq: self.seq, live: self.live.values().cloned().collect() }
    }

    /// The latest sequence number.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Live local bookings.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Deltas dropped because nobody took them (the summary repaired them).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}
