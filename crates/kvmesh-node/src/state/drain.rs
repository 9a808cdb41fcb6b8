//! A draining replica's way to release: what it still has in flight, and when it is idle.
//!
//! An actuator releases a drained engine (deletes the pod) only once nothing is in flight on
//! it. Two views count, because neither sees everything: the tier's bookings (this node's and,
//! through gossip, its peers' — they include requests routed but not yet at the engine) and the
//! engine's own running and waiting requests (they include requests that reached it another
//! way). The engine's count is read only from a scrape begun after draining began: an older
//! one may predate the last request routed there. And the drain must have settled: other nodes
//! apply it a little later than this one, and their bookings reach this one by gossip.

use super::{Core, Replica};
use std::fmt;

/// How long a drain settles before its replica can be idle, seconds: other nodes apply the
/// drain from the Raft log and gossip their bookings within a few hundred milliseconds.
pub const DRAIN_SETTLE_S: f64 = 2.0;

/// What a draining replica still has in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainProgress {
    /// Requests the tier routed to it and has not released (every node's bookings).
    pub bookings: u32,
    /// The engine's running and waiting requests, from a scrape begun since draining began;
    /// `None` until one arrives.
    pub engine: Option<(u32, u32)>,
    /// Its health checks fail: an engine that does not answer has nothing left to finish.
    pub unhealthy: bool,
    /// Draining for at least [`DRAIN_SETTLE_S`].
    pub settled: bool,
}

impl DrainProgress {
    /// Safe to release: settled, no booking left, and the engine reported nothing running or
    /// waiting since draining began (or it no longer answers).
    pub fn idle(&self) -> bool {
        self.settled && self.bookings == 0 && (self.unhealthy || self.engine == Some((0, 0)))
    }
}

impl fmt::Display for DrainProgress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.idle() && self.unhealthy {
            return f.write_str("idle: the engine does not answer (nothing left to finish there), safe to release");
        }
        if self.idle() {
            return f.write_str("idle: nothing in flight, safe to release");
        }
        let mut left = Vec::new();
        if self.bookings > 0 {
            left.push(format!("{} routed by the tier unfinished", self.bookings));
        }
        match (self.engine, self.unhealthy) {
            (_, true) => {}
            (Some((0, 0)), false) => {}
            (Some((running, waiting)), false) => {
                left.push(format!("the engine reports {running} running, {waiting} waiting"))
            }
            (None, false) => left.push("no engine report since draining began yet".into()),
        }
        if !self.settled {
            left.push(format!("the drain is under {DRAIN_SETTLE_S} s old here (router nodes apply it a moment apart)"));
        }
        write!(f, "not idle: {}", left.join("; "))
    }
}

impl Core {
    /// Logs, once per drain, that `name` has turned idle (called after each scrape).
    pub(super) fn note_idle(&mut self, name: &str, now: f64) {
        let Some(r) = self.replicas.get(name).filter(|r| !r.idle_logged) else { return };
        let Some(p) = self.drain_progress(r, now).filter(DrainProgress::idle) else { return };
        tracing::info!(replica = %name, detail = %p, "replica drained: safe to release");
        if let Some(r) = self.replicas.get_mut(name) {
            r.idle_logged = true;
        }
    }

    /// `r`'s way to release while it is draining; `None` when it takes traffic or is starting.
    pub fn drain_progress(&self, r: &Replica, now: f64) -> Option<DrainProgress> {
        let since = r.draining_since.filter(|_| r.draining && !r.starting)?;
        let load = self.fleet.bookings().load(r.id);
        let fresh = r.engine_at.is_some_and(|at| at >= since);
        Some(DrainProgress {
            bookings: load.prefilling + load.decoding,
            engine: r.engine.filter(|_| fresh).map(|e| (e.running, e.waiting)),
            unhealthy: r.failures >= self.unhealthy_after,
            settled: now - since >= DRAIN_SETTLE_S,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_needs_a_settled_drain_no_booking_and_an_idle_engine_report_since() {
        let p = |bookings, engine, unhealthy| DrainProgress { bookings, engine, unhealthy, settled: true };
        assert!(p(0, Some((0, 0)), false).idle());
        assert!(!DrainProgress { settled: false, ..p(0, Some((0, 0)), false) }.idle());
        assert!(!p(1, Some((0, 0)), false).idle());
        assert!(!p(0, Some((1, 0)), false).idle());
        assert!(!p(0, Some((0, 2)), false).idle());
        assert!(!p(0, None, false).idle());
        assert!(p(0, None, true).idle());
        assert_eq!(
            p(0, None, true).to_string(),
            "idle: the engine does not answer (nothing left to finish there), safe to release"
        );
        assert!(!p(2, None, true).idle());
        assert_eq!(p(0, Some((0, 0)), false).to_string(), "idle: nothing in flight, safe to release");
        assert_eq!(
            p(3, Some((2, 1)), false).to_string(),
            "not idle: 3 routed by the tier unfinished; the engine reports 2 running, 1 waiting"
        );
        assert_eq!(p(0, None, false).to_string(), "not idle: no engine report since draining began yet");
        assert_eq!(p(1, None, true).to_string(), "not idle: 1 routed by the tier unfinished");
        assert_eq!(
            DrainProgress { settled: false, ..p(0, Some((0, 0)), false) }.to_string(),
            "not idle: the drain is under 2 s old here (router nodes apply it a moment apart)"
        );
    }
}
