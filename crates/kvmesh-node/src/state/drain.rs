//! A draining replica's way to release: what it still has in flight, and when it is idle.
//!
//! An actuator releases a drained engine (deletes the pod) only once nothing is in flight on
//! it. Two views count, because neither sees everything: the tier's bookings (this node's and,
//! through gossip, its peers' — they include requests routed but not yet at the engine) and the
//! engine's own running and waiting requests (they include requests that reached it another
//! way). The drain must settle first: other nodes apply it a little later than this one, and
//! their bookings reach this one by gossip (a lost delta only with the next summary). So the
//! engine's count is read only from a scrape begun after the drain settled.
//!
//! vLLM's running/waiting gauges can stay stale when its last requests were aborted (they are
//! refreshed by the next engine step, and a drained engine gets none): an engine whose
//! served-token counter stands still for [`ENGINE_STALL_S`] after the drain settled, with no
//! booking left, is counted idle whatever its gauges say.

use super::{Core, Replica};
use crate::config::ClusterSection;
use std::fmt;

/// The shortest settle, seconds: nodes apply a committed drain within a few hundred ms.
pub const DRAIN_SETTLE_S: f64 = 2.0;
/// Seconds the served-token counter must stand still before the engine's gauges are taken
/// for stale (a running request advances it every step, tens of milliseconds).
pub const ENGINE_STALL_S: f64 = 5.0;

/// How long a drain settles, seconds: [`DRAIN_SETTLE_S`], or two gossip summaries when those
/// are slower (a booking delta lost on the way is repaired by the next summary); none on a
/// single node, where the drain and the bookings are under one lock.
pub fn settle_s(cluster: Option<&ClusterSection>) -> f64 {
    cluster.map_or(0.0, |c| DRAIN_SETTLE_S.max(2.0 * c.summary_interval.as_secs_f64()))
}

/// What a draining replica still has in flight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrainProgress {
    /// Requests the tier routed to it and has not released (every node's bookings).
    pub bookings: u32,
    /// The engine's running and waiting requests, from a scrape begun after the drain
    /// settled; `None` until one arrives.
    pub engine: Option<(u32, u32)>,
    /// The engine's served-token counter stood still for [`ENGINE_STALL_S`] after the drain
    /// settled: its running/waiting gauges are stale (vLLM pages only, see
    /// `HealthState::counts_every_step`).
    pub stalled: bool,
    /// Its health checks fail: an engine that does not answer has nothing left to finish.
    pub unhealthy: bool,
    /// The drain is older than the settle time (`settle_s`, seconds).
    pub settled: bool,
    /// The settle time, seconds.
    pub settle_s: f64,
}

impl DrainProgress {
    /// Safe to release: settled, no booking left, and the engine idle since (nothing running
    /// or waiting, stale gauges, or no answer).
    pub fn idle(&self) -> bool {
        self.settled && self.bookings == 0 && (self.unhealthy || self.stalled || self.engine == Some((0, 0)))
    }
}

impl fmt::Display for DrainProgress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.idle() {
            return f.write_str(match (self.unhealthy, self.engine) {
                (true, _) => "idle: the engine does not answer (nothing left to finish there), safe to release",
                (false, Some((0, 0))) => "idle: nothing in flight, safe to release",
                _ => "idle: the engine has served no token for 5 s (its running/waiting gauges are stale), safe to release",
            });
        }
        let mut left = Vec::new();
        if self.bookings > 0 {
            left.push(format!("{} routed by the tier unfinished", self.bookings));
        }
        match (self.engine, self.unhealthy) {
            (_, true) | (Some((0, 0)), false) => {}
            (Some((running, waiting)), false) => {
                left.push(format!("the engine reports {running} running, {waiting} waiting"))
            }
            (None, false) if self.settled => left.push("no engine report since the drain settled yet".into()),
            (None, false) => {}
        }
        if !self.settled {
            left.push(format!(
                "the drain is under {} s old here (router nodes apply it a moment apart)",
                self.settle_s
            ));
        }
        write!(f, "not idle: {}", left.join("; "))
    }
}

impl Core {
    /// Logs, once per drain, that `name` has turned idle (called after each scrape).
    pub(super) fn note_idle(&mut self, name: &str, now: f64) {
        let Some(r) = self.replicas.get(name).filter(|r| !r.idle_logged) else { return };
        let Some(p) = self.drain_progress(r, now).filter(DrainProgress::idle) else { return };
        tracing::info!(replica = %name, detail = %p, "replica idle: safe to release");
        if let Some(r) = self.replicas.get_mut(name) {
            r.idle_logged = true;
        }
    }

    /// `r`'s way to release at `now` (node seconds) while it is draining; `None` when it takes
    /// traffic or is starting.
    pub fn drain_progress(&self, r: &Replica, now: f64) -> Option<DrainProgress> {
        let since = r.draining_since.filter(|_| !r.starting)?;
        let settled_at = since + self.drain_settle_s;
        let load = self.fleet.bookings().load(r.id);
        let h = r.health.lock();
        let fresh = h.engine_at.filter(|&at| at >= settled_at);
        // Only a counter that moves every engine step (vLLM's) standing still says the gauges
        // are stale; SGLang's moves as requests finish, and stands still through a long one.
        let stalled = match (fresh, h.engine_served) {
            (Some(at), Some((_, unchanged_since))) if h.counts_every_step => {
                at - unchanged_since.max(settled_at) >= ENGINE_STALL_S
            }
            _ => false,
        };
        Some(DrainProgress {
            bookings: load.prefilling + load.decoding,
            engine: h.engine.filter(|_| fresh.is_some()).map(|e| (e.running, e.waiting)),
            stalled,
            unhealthy: h.failures >= self.unhealthy_after,
            settled: now >= settled_at,
            settle_s: self.drain_settle_s,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(bookings: u32, engine: Option<(u32, u32)>, unhealthy: bool) -> DrainProgress {
        DrainProgress { bookings, engine, stalled: false, unhealthy, settled: true, settle_s: 2.0 }
    }

    #[test]
    fn idle_needs_a_settled_drain_no_booking_and_an_idle_engine_report_since() {
        assert!(p(0, Some((0, 0)), false).idle());
        assert!(!DrainProgress { settled: false, ..p(0, Some((0, 0)), false) }.idle());
        assert!(!p(1, Some((0, 0)), false).idle());
        assert!(!p(0, Some((1, 0)), false).idle());
        assert!(!p(0, Some((0, 2)), false).idle());
        assert!(!p(0, None, false).idle());
        assert!(p(0, None, true).idle());
        assert!(!p(2, None, true).idle());
        // Stale gauges count as idle, a booking left does not.
        assert!(DrainProgress { stalled: true, ..p(0, Some((1, 0)), false) }.idle());
        assert!(!DrainProgress { stalled: true, ..p(1, Some((1, 0)), false) }.idle());
        assert_eq!(p(0, Some((0, 0)), false).to_string(), "idle: nothing in flight, safe to release");
        assert_eq!(
            p(0, None, true).to_string(),
            "idle: the engine does not answer (nothing left to finish there), safe to release"
        );
        assert_eq!(
            DrainProgress { stalled: true, ..p(0, Some((1, 0)), false) }.to_string(),
            "idle: the engine has served no token for 5 s (its running/waiting gauges are stale), safe to release"
        );
        assert_eq!(
            p(3, Some((2, 1)), false).to_string(),
            "not idle: 3 routed by the tier unfinished; the engine reports 2 running, 1 waiting"
        );
        assert_eq!(p(0, None, false).to_string(), "not idle: no engine report since the drain settled yet");
        assert_eq!(p(1, None, true).to_string(), "not idle: 1 routed by the tier unfinished");
        assert_eq!(
            DrainProgress { settled: false, ..p(1, Some((0, 0)), false) }.to_string(),
            "not idle: 1 routed by the tier unfinished; the drain is under 2 s old here (router nodes apply it a moment apart)"
        );
    }

    #[test]
    fn the_settle_is_two_gossip_summaries_at_least_two_seconds_and_none_alone() {
        assert_eq!(settle_s(None), 0.0);
        let c = ClusterSection::default();
        assert_eq!((c.summary_interval, settle_s(Some(&c))), (std::time::Duration::from_secs(1), 2.0));
        let slow =
            ClusterSection { summary_interval: std::time::Duration::from_millis(1500), ..ClusterSection::default() };
        assert_eq!(settle_s(Some(&slow)), 3.0);
    }
}
