//! A draining replica's way to release: what it still has in flight, and when it is idle.
//!
//! An actuator releases a drained engine (deletes the pod) only once nothing is in flight on
//! it, or the requests still running there fail. Two views count, because neither sees
//! everything: the tier's bookings (this node's and, through gossip, its peers' — they include
//! requests routed but not yet at the engine) and the engine's own running and waiting
//! requests (they include requests that reached it another way). The engine's count is read
//! only from a scrape made after draining began: an older one may predate the last request
//! routed there.

use super::{Core, Replica};
use std::fmt;

/// What a draining replica still has in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainProgress {
    /// Requests the tier routed to it and has not released (every node's bookings).
    pub bookings: u32,
    /// The engine's running and waiting requests, from a scrape since draining began;
    /// `None` until one arrives.
    pub engine: Option<(u32, u32)>,
    /// Its health checks fail: an engine that does not answer has nothing left to finish.
    pub unhealthy: bool,
}

impl DrainProgress {
    /// Safe to release: no booking left, and the engine reported nothing running or waiting
    /// since draining began (or it no longer answers).
    pub fn idle(&self) -> bool {
        self.bookings == 0 && (self.unhealthy || self.engine == Some((0, 0)))
    }
}

impl fmt::Display for DrainProgress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.idle() {
            return f.write_str("idle: nothing in flight, safe to release");
        }
        write!(f, "in flight: {} routed by the tier", self.bookings)?;
        match (self.engine, self.unhealthy) {
            (_, true) => f.write_str("; the engine does not answer"),
            (Some((running, waiting)), false) => write!(f, "; the engine reports {running} running, {waiting} waiting"),
            (None, false) => f.write_str("; waiting for the engine's first report since draining began"),
        }
    }
}

impl Core {
    /// `r`'s way to release, while it is draining (or starting: not routed to); `None` when
    /// it takes traffic.
    pub fn drain_progress(&self, r: &Replica) -> Option<DrainProgress> {
        let since = r.draining_since.filter(|_| r.draining)?;
        let load = self.fleet.bookings().load(r.id);
        let fresh = r.engine_at.is_some_and(|at| at >= since);
        Some(DrainProgress {
            bookings: load.prefilling + load.decoding,
            engine: r.engine.filter(|_| fresh).map(|e| (e.running, e.waiting)),
            unhealthy: r.failures >= self.unhealthy_after,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_needs_no_booking_and_an_idle_engine_report_since_the_drain() {
        let p = |bookings, engine, unhealthy| DrainProgress { bookings, engine, unhealthy };
        assert!(p(0, Some((0, 0)), false).idle());
        assert!(!p(1, Some((0, 0)), false).idle());
        assert!(!p(0, Some((1, 0)), false).idle());
        assert!(!p(0, Some((0, 2)), false).idle());
        assert!(!p(0, None, false).idle());
        assert!(p(0, None, true).idle());
        assert!(!p(2, None, true).idle());
        assert_eq!(p(0, Some((0, 0)), false).to_string(), "idle: nothing in flight, safe to release");
        assert_eq!(
            p(3, Some((2, 1)), false).to_string(),
            "in flight: 3 routed by the tier; the engine reports 2 running, 1 waiting"
        );
        assert_eq!(
            p(0, None, false).to_string(),
            "in flight: 0 routed by the tier; waiting for the engine's first report since draining began"
        );
        assert_eq!(p(1, None, true).to_string(), "in flight: 1 routed by the tier; the engine does not answer");
    }
}
