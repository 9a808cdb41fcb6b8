//! Admission control while capacity is short (`[admission]`): instead of piling requests onto
//! replicas until they preempt, a request that finds no replica with room — none with KV
//! headroom for it, or every one at `max_num_seqs` — waits in a bounded queue and is routed
//! when capacity frees, smallest token load first; beyond the bound, or after `max_wait_s`,
//! it gets 429 with `Retry-After`.
//!
//! "Capacity frees" is every booking that ends on this node, and a 250 ms re-check besides
//! (bookings of peer nodes end there, and their release reaches this node by gossip).

use crate::config::AdmissionSection;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::oneshot;

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Refused {
    /// The queue is full.
    QueueFull,
    /// It waited `max_wait_s`.
    Timeout,
}

type Waiter = (Reverse<u64>, Reverse<u64>, WaiterTx);

/// A waiter's wake-up, ordered by nothing (the heap orders by load and arrival).
struct WaiterTx(oneshot::Sender<()>);

impl PartialEq for WaiterTx {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for WaiterTx {}
impl PartialOrd for WaiterTx {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for WaiterTx {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

/// The queue.
pub struct Admission {
    /// The settings.
    pub section: AdmissionSection,
    waiting: Mutex<BinaryHeap<Waiter>>,
    seq: AtomicU64,
}

impl Admission {
    /// A queue for `section`.
    pub fn new(section: AdmissionSection) -> Self {
        Admission { section, waiting: Mutex::new(BinaryHeap::new()), seq: AtomicU64::new(0) }
    }

    /// Requests waiting now.
    pub fn depth(&self) -> usize {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The token load of the requests waiting now, tokens.
    pub fn waiting_load(&self) -> u64 {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|w| (w.0).0).sum()
    }

    /// Waits until capacity may have freed (a booking ended, or 250 ms passed), as one of at
    /// most `queue_limit` waiters; `load` (tokens) orders who is woken first. `deadline` is
    /// when the request's wait ends.
    ///
    /// # Errors
    /// [`Refused::QueueFull`] at once when the queue is full; [`Refused::Timeout`] past
    /// `deadline`.
    pub async fn wait(&self, load: u64, deadline: tokio::time::Instant) -> Result<(), Refused> {
        if tokio::time::Instant::now() >= deadline {
            return Err(Refused::Timeout);
        }
        let (tx, rx) = oneshot::channel();
        {
            let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
            // Waiters whose request went away (woken or timed out) do not count.
            w.retain(|(_, _, tx)| !tx.0.is_closed());
            if w.len() >= self.section.queue_limit {
                return Err(Refused::QueueFull);
            }
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            w.push((Reverse(load), Reverse(seq), WaiterTx(tx)));
        }
        let recheck = tokio::time::Instant::now() + Duration::from_millis(250);
        let _ = tokio::time::timeout_at(recheck.min(deadline), rx).await;
        Ok(())
    }

    /// A booking ended: the waiter with the smallest load tries again.
    pub fn capacity_freed(&self) {
        let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        while let Some((_, _, tx)) = w.pop() {
            if tx.0.send(()).is_ok() {
                return;
            }
        }
    }

    /// Seconds a refused client should wait before retrying: a second per queued request per
    /// 64, between 1 and `max_wait_s`.
    pub fn retry_after_s(&self) -> u64 {
        let depth = self.depth() as f64;
        (1.0 + depth / 64.0).min(self.section.max_wait_s).ceil() as u64
    }
}
