//! The simulation's event queue: a min-heap on (time, insertion order), so equal times pop in
//! the order they were pushed and every run replays exactly.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// What happens at a point in simulated time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ev {
    /// Request `i` of the trace arrives at the router.
    Arrival(u32),
    /// Replica `r`'s step in flight ends.
    StepDone(u32),
    /// The oldest KV event in flight reaches the routers.
    Deliver,
    /// The oldest batch of booking deltas in flight reaches the other routers.
    Gossip,
    /// The router polls engine metrics and expires old state.
    Tick,
    /// The router scrapes engine metrics only, at the policy's own interval when that is
    /// shorter than the tick's ([`kvmesh_core::Policy::scrape_interval_s`]).
    Scrape,
    /// The leader's replication round (replication only).
    Replicate,
    /// The autoscaler's evaluation (scaling only).
    Autoscale,
    /// Replica `r`'s cold start ends (scaling only).
    Ready(u32),
    /// Request `i`'s prompt KV has reached its decode replica (disaggregated runs only).
    Transferred(u32),
}

#[derive(Debug)]
struct Item {
    t: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Item {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Item {}
impl PartialOrd for Item {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Item {
    // Reversed: BinaryHeap is a max-heap and we want the earliest first.
    fn cmp(&self, other: &Self) -> Ordering {
        other.t.total_cmp(&self.t).then(other.seq.cmp(&self.seq))
    }
}

/// Pending events by time.
#[derive(Debug, Default)]
pub(crate) struct Queue {
    heap: BinaryHeap<Item>,
    seq: u64,
    popped: u64,
}

impl Queue {
    pub(crate) fn push(&mut self, t: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Item { t, seq: self.seq, ev });
    }

    pub(crate) fn pop(&mut self) -> Option<(f64, Ev)> {
        let item = self.heap.pop()?;
        self.popped += 1;
        Some((item.t, item.ev))
    }

    /// Events processed so far.
    pub(crate) fn processed(&self) -> u64 {
        self.popped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earliest_first_then_insertion_order() {
        let mut q = Queue::default();
        q.push(2.0, Ev::Tick);
        q.push(1.0, Ev::StepDone(3));
        q.push(1.0, Ev::Arrival(0));
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, vec![(1.0, Ev::StepDone(3)), (1.0, Ev::Arrival(0)), (2.0, Ev::Tick)]);
        assert_eq!(q.processed(), 3);
    }
}
