//! Admission control's TTFT gate: while replicas are overloaded, hold a request at the router
//! rather than send it to a replica whose queue makes it miss its TTFT SLO, and serve the
//! requests that have not waited long (under half the SLO) before late ones.
//!
//! Why: an engine serves its queue in arrival order (vLLM's scheduler is FCFS), so once its
//! queue is longer than the SLO every request behind it is late too, and a burst that
//! overloads the fleet by a fifth can make most of its requests late. Held at the router, the
//! queue can be reordered: requests that can still make it go first (smallest token load
//! first, as the admission queue orders them), and those that cannot are sent only while the
//! replica's queue is short, leaving the rest of the SLO to the others. This is the
//! overload-ordering idea of adaptive LIFO and CoDel in request queues (Maurer, "Fail at
//! Scale", ACM Queue 13(8), 2015), applied to the router's own TTFT estimate.

use crate::error::Error;
use crate::policy::Decision;

/// The share of the SLO that a request which can no longer meet it may find queued on its
/// replica: such a request is sent once the queue ahead of it is at most this share of the
/// SLO, so it is served and leaves the rest for requests that can still make it.
pub const LATE_SHARE: f64 = 0.5;

/// A TTFT SLO that admission control holds requests to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftGate {
    slo_s: f64,
}

impl TtftGate {
    /// A gate for a TTFT SLO of `slo_s` seconds.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] unless `slo_s` is positive and finite.
    pub fn new(slo_s: f64) -> Result<Self, Error> {
        if !(slo_s.is_finite() && slo_s > 0.0) {
            return Err(Error::InvalidConfig {
                field: "ttft_slo_s",
                reason: format!("must be positive seconds, got {slo_s}"),
            });
        }
        Ok(TtftGate { slo_s })
    }

    /// The SLO, seconds.
    pub fn slo_s(&self) -> f64 {
        self.slo_s
    }

    /// Whether a request that has waited `waited_s` seconds at the router may go where
    /// `decision` sends it: when its estimated TTFT there fits what is left of the SLO, or
    /// when the queue ahead of it there is at most [`LATE_SHARE`] of the SLO (a request
    /// that cannot meet the SLO even on an idle replica is still served).
    pub fn admits(&self, decision: &Decision, waited_s: f64) -> bool {
        decision.estimated_ttft_s <= self.slo_s - waited_s || decision.estimated_queue_wait_s <= LATE_SHARE * self.slo_s
    }

    /// Whether a request that has waited `waited_s` seconds is late: past the point
    /// ((1 − [`LATE_SHARE`]) × SLO) from which only a short queue admits it, so it waits
    /// behind every request that is not late.
    pub fn late(&self, waited_s: f64) -> bool {
        waited_s >= (1.0 - LATE_SHARE) * self.slo_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::ReplicaId;
    use crate::policy::Reason;

    fn decision(ttft_s: f64, queue_wait_s: f64) -> Decision {
        Decision {
            replica: ReplicaId(0),
            reason: Reason::LowestCost,
            overlap_blocks: 0,
            uncached_tokens: 100,
            uncached_blocks: 7,
            estimated_ttft_s: ttft_s,
            estimated_queue_wait_s: queue_wait_s,
        }
    }

    #[test]
    fn a_request_goes_when_it_fits_what_is_left_of_the_slo_or_the_queue_is_short() {
        let gate = TtftGate::new(2.0).unwrap();
        // Fresh: 1.9 s fits, 2.1 s does not unless the queue ahead is ≤ 1 s.
        assert!(gate.admits(&decision(1.9, 1.5), 0.0));
        assert!(!gate.admits(&decision(2.1, 1.5), 0.0));
        assert!(gate.admits(&decision(2.1, 1.0), 0.0));
        // After 0.5 s at the router only 1.5 s is left.
        assert!(gate.admits(&decision(1.5, 1.2), 0.5));
        assert!(!gate.admits(&decision(1.6, 1.2), 0.5));
        // Late: only a short queue admits it, however long its own prefill (3 s here).
        assert!(!gate.admits(&decision(4.1, 1.1), 5.0));
        assert!(gate.admits(&decision(4.0, 1.0), 5.0));
    }

    #[test]
    fn a_request_is_late_from_half_the_slo_on() {
        let gate = TtftGate::new(2.0).unwrap();
        assert!(!gate.late(0.0));
        assert!(!gate.late(0.999));
        assert!(gate.late(1.0));
        assert!(gate.late(30.0));
    }

    #[test]
    fn the_slo_must_be_positive_and_finite() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = TtftGate::new(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidConfig { field: "ttft_slo_s", .. }), "{bad}: {e}");
        }
        assert_eq!(TtftGate::new(2.0).unwrap().slo_s(), 2.0);
    }
}
