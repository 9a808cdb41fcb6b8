//! What a replica serves at full load, measured from its engine's counters.
//!
//! An engine's cumulative served tokens (vLLM: `prompt_tokens − prefix_cache_hits +
//! generation_tokens`, i.e. computed prefill plus decode, the unit of token load) rise at its
//! capacity only while it has requests waiting; over a run of scrapes that all saw a queue,
//! the rise over the run is one measurement. Each replica keeps a slow moving average (one burst's
//! mix does not redefine a replica), and the pool's capacity per replica is their mean.

use std::collections::BTreeMap;

/// Weight of a new measurement in a replica's moving average.
const WEIGHT: f64 = 0.2;
/// Shortest gap between scrapes that measures, seconds (shorter ones are mostly noise).
const MIN_GAP_S: f64 = 0.5;

/// One replica's measurements.
#[derive(Debug, Clone, Copy, Default)]
struct Replica {
    /// Where the current run of scrapes with a queue began: (served tokens, time).
    run: Option<(f64, f64)>,
    /// The moving average, tokens per second.
    avg: Option<f64>,
}

/// Per-replica capacity measurements, tokens per second.
#[derive(Debug, Clone, Default)]
pub struct CapacityMeter {
    replicas: BTreeMap<String, Replica>,
}

impl CapacityMeter {
    /// A scrape of `replica` at `at` (seconds): `served_tokens` so far (tokens, a counter) and
    /// `waiting` requests. A run of scrapes that all saw requests waiting measures once it
    /// spans half a second, then starts over; a scrape without a queue ends the run. A counter
    /// that went back (an engine restart) starts the run over.
    pub fn observe(&mut self, replica: &str, served_tokens: f64, waiting: u32, at: f64) {
        if !served_tokens.is_finite() || served_tokens < 0.0 || !at.is_finite() {
            return;
        }
        let Replica { run, avg } = self.replicas.entry(replica.to_string()).or_default();
        if waiting == 0 {
            *run = None;
            return;
        }
        match *run {
            Some((tokens, since)) if served_tokens >= tokens => {
                let gap = at - since;
                if gap >= MIN_GAP_S {
                    let rate = (served_tokens - tokens) / gap;
                    *avg = Some(avg.map_or(rate, |a| (1.0 - WEIGHT) * a + WEIGHT * rate));
                    *run = Some((served_tokens, at));
                }
            }
            _ => *run = Some((served_tokens, at)),
        }
    }

    /// Forgets `replica` (removed from the pool).
    pub fn forget(&mut self, replica: &str) {
        self.replicas.remove(replica);
    }

    /// A replica's measured capacity, tokens per second; `None` before it was measured.
    pub fn of(&self, replica: &str) -> Option<f64> {
        self.replicas.get(replica).and_then(|e| e.avg)
    }

    /// Mean measured capacity over the replicas measured, tokens per second; `None` before
    /// any was.
    pub fn per_replica(&self) -> Option<f64> {
        let measured: Vec<f64> = self.replicas.values().filter_map(|e| e.avg).collect();
        (!measured.is_empty()).then(|| measured.iter().sum::<f64>() / measured.len() as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_gaps_with_a_queue_at_both_ends_measure() {
        let mut m = CapacityMeter::default();
        m.observe("a", 0.0, 0, 0.0);
        // Idle at the start of the gap: what it served says nothing of its capacity.
        m.observe("a", 5_000.0, 3, 1.0);
        assert_eq!(m.of("a"), None);
        // Queued at both ends: 30,000 tokens in 1 s.
        m.observe("a", 35_000.0, 2, 2.0);
        assert_eq!(m.of("a"), Some(30_000.0));
        // Then 40,000 in 1 s: the average moves a fifth of the way.
        m.observe("a", 75_000.0, 1, 3.0);
        assert_eq!(m.of("a"), Some(32_000.0));
        // Queue gone: no measurement; too short a gap: none either.
        m.observe("a", 80_000.0, 0, 4.0);
        m.observe("a", 90_000.0, 4, 5.0);
        m.observe("a", 95_000.0, 4, 5.1);
        assert_eq!(m.of("a"), Some(32_000.0));
        m.observe("b", 0.0, 1, 0.0);
        m.observe("b", 20_000.0, 1, 1.0);
        assert_eq!(m.per_replica(), Some(26_000.0));
        m.forget("a");
        assert_eq!(m.per_replica(), Some(20_000.0));
    }

    #[test]
    fn a_restarted_engine_or_a_bad_sample_does_not_measure() {
        let mut m = CapacityMeter::default();
        m.observe("a", 50_000.0, 1, 0.0);
        m.observe("a", 10.0, 1, 1.0);
        m.observe("a", f64::NAN, 1, 2.0);
        m.observe("a", -1.0, 1, 2.0);
        assert_eq!(m.per_replica(), None);
        m.observe("a", 1_010.0, 1, 2.0);
        assert_eq!(m.of("a"), Some(1_000.0));
    }
}
