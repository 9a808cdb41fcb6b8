//! What one replica's bad KV-event stream may cost: complaints logged at a bounded rate, and
//! a quarantine once bad messages keep coming. Pure bookkeeping on node seconds; the ingest
//! task owns one per replica and acts on its answers (outside the core lock).

use crate::config::LimitsSection;
use std::collections::VecDeque;

/// One replica's bad-message record.
#[derive(Debug)]
pub struct EventGuard {
    window_s: f64,
    threshold: usize,
    quarantine_s: f64,
    /// Node seconds of the bad messages within the window, oldest first.
    bad: VecDeque<f64>,
    /// End of the current quarantine, node seconds.
    until: Option<f64>,
    /// Complaints about this replica's events.
    pub log: LogLimiter,
    /// Complaints about its stream: a stream that restarts at every message is recovered
    /// each time, and logged about once per 10 s.
    pub stream: StreamLogs,
}

/// The limiters of one replica's stream complaints, kept apart so that a gap's warning does
/// not hide why its recovery failed.
#[derive(Debug)]
pub struct StreamLogs {
    /// Sequence gaps and restarts, socket errors.
    pub sequence: LogLimiter,
    /// Replay failures (unreachable, timed out, bad or cut answers).
    pub replay: LogLimiter,
}

impl StreamLogs {
    /// Both limiters at one line per 10 s.
    pub fn new() -> Self {
        StreamLogs { sequence: LogLimiter::new(10.0), replay: LogLimiter::new(10.0) }
    }
}

impl Default for StreamLogs {
    fn default() -> Self {
        Self::new()
    }
}

/// Problems found in one message's events (decoder skips and index rejections).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Problems {
    /// Events that were not applied because they were bad.
    pub events: u64,
    /// The first one's reason, for the log.
    pub first: Option<String>,
}

impl Problems {
    /// Adds `other`'s problems to these.
    pub fn add(&mut self, other: Problems) {
        self.events += other.events;
        if self.first.is_none() {
            self.first = other.first;
        }
    }
}

impl EventGuard {
    /// A clean record with `limits`' thresholds; complaints at most every 10 s.
    pub fn new(limits: &LimitsSection) -> Self {
        EventGuard {
            window_s: limits.kv_event_bad_window.as_secs_f64(),
            threshold: limits.kv_event_bad_messages.max(1) as usize,
            quarantine_s: limits.kv_event_quarantine.as_secs_f64(),
            bad: VecDeque::new(),
            until: None,
            log: LogLimiter::new(10.0),
            stream: StreamLogs::new(),
        }
    }

    /// Counts a bad message at `now`. Returns the end of a quarantine that starts now, when
    /// this message makes `kv_event_bad_messages` within the window.
    pub fn bad_message(&mut self, now: f64) -> Option<f64> {
        while self.bad.front().is_some_and(|&t| now - t >= self.window_s) {
            self.bad.pop_front();
        }
        self.bad.push_back(now);
        if self.until.is_none() && self.bad.len() >= self.threshold {
            self.bad.clear();
            let until = now + self.quarantine_s;
            self.until = Some(until);
            return Some(until);
        }
        None
    }

    /// Seconds of quarantine left at `now`, if quarantined.
    pub fn remaining(&self, now: f64) -> Option<f64> {
        self.until.filter(|&u| now < u).map(|u| u - now)
    }

    /// Whether the replica is quarantined at `now`.
    pub fn quarantined(&self, now: f64) -> bool {
        self.until.is_some_and(|u| now < u)
    }

    /// Whether the record holds nothing a fresh one would not at `now`: no bad message within
    /// the window, no quarantine (ended or not) to act on, no complaint within its 10 s. Such a
    /// record can be forgotten (a replica's pushes, once sound again, cost no memory).
    pub fn idle(&self, now: f64) -> bool {
        self.until.is_none()
            && self.bad.back().is_none_or(|&t| now - t >= self.window_s)
            && self.log.last.is_none_or(|t| now - t >= self.log.every_s)
    }

    /// True once, at the first call at or after the quarantine's end: the caller rebuilds the
    /// replica's blocks and applies its events again.
    pub fn quarantine_over(&mut self, now: f64) -> bool {
        if self.until.is_some_and(|u| now >= u) {
            self.until = None;
            return true;
        }
        false
    }
}

/// Lets one log line through per `every_s`, counting the ones held back.
#[derive(Debug)]
pub struct LogLimiter {
    every_s: f64,
    last: Option<f64>,
    held: u64,
}

impl LogLimiter {
    /// A limiter that lets a line through at most every `every_s` seconds.
    pub fn new(every_s: f64) -> Self {
        LogLimiter { every_s, last: None, held: 0 }
    }

    /// `Some(lines held back since the last one let through)` when a line may be logged at
    /// `now`; `None` (and one more held back) otherwise.
    pub fn allow(&mut self, now: f64) -> Option<u64> {
        if self.last.is_some_and(|t| now - t < self.every_s) {
            self.held += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> EventGuard {
        EventGuard::new(&LimitsSection {
            kv_event_bad_messages: 3,
            kv_event_bad_window: std::time::Duration::from_secs(10),
            kv_event_quarantine: std::time::Duration::from_secs(60),
            ..LimitsSection::default()
        })
    }

    #[test]
    fn a_record_is_idle_once_its_window_quarantine_and_complaints_are_over() {
        let mut g = guard();
        assert!(g.idle(0.0));
        assert_eq!(g.bad_message(0.0), None);
        assert_eq!(g.log.allow(0.0), Some(0));
        assert!(!g.idle(9.9));
        assert!(g.idle(10.0));
        g.bad_message(1.0);
        assert_eq!(g.bad_message(2.0), Some(62.0));
        assert!(!g.idle(70.0), "an ended quarantine not yet acted on is kept");
        assert!(g.quarantine_over(70.0));
        assert!(g.idle(70.0));
    }

    #[test]
    fn quarantines_at_the_threshold_within_the_window_and_ends_once() {
        let mut g = guard();
        assert_eq!(g.bad_message(0.0), None);
        assert_eq!(g.bad_message(5.0), None);
        // The first has left the window at 10 s: two within it.
        assert_eq!(g.bad_message(10.0), None);
        assert_eq!(g.bad_message(12.0), Some(72.0));
        assert!(g.quarantined(71.9));
        assert_eq!(g.remaining(62.0), Some(10.0));
        assert_eq!(g.remaining(72.0), None);
        // More bad messages while quarantined do not extend it.
        assert_eq!(g.bad_message(20.0), None);
        assert!(!g.quarantine_over(71.9));
        assert!(g.quarantine_over(72.0));
        assert!(!g.quarantine_over(73.0));
        assert!(!g.quarantined(72.0));
        // Counting starts afresh after it.
        assert_eq!(g.bad_message(75.0), None);
        assert_eq!(g.bad_message(76.0), None);
        assert_eq!(g.bad_message(77.0), Some(137.0));
    }

    #[test]
    fn the_limiter_counts_what_it_held_back() {
        let mut l = LogLimiter::new(10.0);
        assert_eq!(l.allow(0.0), Some(0));
        assert_eq!(l.allow(1.0), None);
        assert_eq!(l.allow(9.9), None);
        assert_eq!(l.allow(10.0), Some(2));
        assert_eq!(l.allow(25.0), Some(0));
    }
}
