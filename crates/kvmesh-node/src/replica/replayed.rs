//! What the last replay applied, so that its live copies are not taken for an engine restart.
//!
//! The subscriber is connected before a replay starts (nothing published meanwhile may be
//! lost), so the live messages it queues during the replay include some the replay also
//! sent: sequence numbers at or below the last one applied. A restarted engine sends such
//! numbers too (vLLM counts from 0 at engine start). The difference is the content: a copy is
//! the very payload the replay sent for that number (vLLM's `ZmqEventPublisher` buffers the
//! serialized payload it published and replays those bytes), a restarted engine's is not.
//! So each replayed message's payload digest (xxh3-64) is kept, and a live message whose
//! number and digest match one is a copy, dropped unapplied.

use std::collections::VecDeque;
use xxhash_rust::xxh3::xxh3_64;

/// Replayed messages remembered: far more than a subscriber queues during one replay (it
/// reads the live stream again as soon as the replay ends), at 16 bytes each.
pub const KEEP: usize = 4096;

/// The (sequence number, payload digest) of the newest [`KEEP`] messages of the last replay.
#[derive(Debug, Default)]
pub struct Replayed {
    /// Ascending by sequence number.
    seen: VecDeque<(u64, u64)>,
}

impl Replayed {
    /// Forgets the previous replay: a new one starts.
    pub fn start(&mut self) {
        self.seen.clear();
    }

    /// Remembers that the replay applied message `seq` with `payload`.
    pub fn record(&mut self, seq: u64, payload: &[u8]) {
        if self.seen.back().is_some_and(|&(last, _)| last >= seq) {
            return;
        }
        if self.seen.len() == KEEP {
            self.seen.pop_front();
        }
        self.seen.push_back((seq, xxh3_64(payload)));
    }

    /// Whether live message `seq` with `payload` is a copy of one the replay applied.
    pub fn is_copy(&self, seq: u64, payload: &[u8]) -> bool {
        match self.seen.binary_search_by_key(&seq, |&(s, _)| s) {
            Ok(i) => self.seen[i].1 == xxh3_64(payload),
            Err(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_matches_number_and_payload_and_nothing_else() {
        let mut r = Replayed::default();
        for seq in 3..8u64 {
            r.record(seq, format!("batch {seq}").as_bytes());
        }
        assert!(r.is_copy(5, b"batch 5"));
        assert!(r.is_copy(7, b"batch 7"));
        // A restarted engine's message 5: another payload under the same number.
        assert!(!r.is_copy(5, b"batch 0"));
        // Numbers the replay did not send.
        assert!(!r.is_copy(2, b"batch 2"));
        assert!(!r.is_copy(8, b"batch 8"));
        // Out of order or repeated numbers are not recorded twice.
        r.record(6, b"other");
        assert!(r.is_copy(6, b"batch 6"));
        r.start();
        assert!(!r.is_copy(5, b"batch 5"));
    }

    #[test]
    fn only_the_newest_are_kept() {
        let mut r = Replayed::default();
        for seq in 0..(KEEP as u64 + 10) {
            r.record(seq, &seq.to_le_bytes());
        }
        assert!(!r.is_copy(9, &9u64.to_le_bytes()));
        assert!(r.is_copy(10, &10u64.to_le_bytes()));
        assert!(r.is_copy(KEEP as u64 + 9, &(KEEP as u64 + 9).to_le_bytes()));
    }
}
