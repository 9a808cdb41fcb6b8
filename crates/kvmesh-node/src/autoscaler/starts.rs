//! Replica starts as one node sees them in the registry: which replicas are on their way (the
//! autoscaler counts them as capacity arriving), and how long a start takes (the cold start).
//!
//! A start is measured from when this node first saw the replica `starting` to when it saw it
//! `ready`, and only if the node saw the start begin: one already starting when the node came
//! up would measure short. A start drained or removed before it ended was cancelled, not
//! measured. The cold start is the mean of the latest [`STARTS_KEPT`] starts. A start older
//! than [`STALE_START_COLD_STARTS`] cold starts is no longer counted: its engine never came up,
//! or nobody marked it ready, and counting it would hold back every scale-up.

use crate::cluster::registry::ClusterState;
use kvmesh_core::ReplicaStatus;
use std::collections::BTreeMap;

/// A start this old, in cold starts, is no longer counted as capacity on its way.
pub const STALE_START_COLD_STARTS: f64 = 3.0;
/// The cold start is the mean of this many latest starts: a new image or node type moves it.
pub const STARTS_KEPT: usize = 20;

/// One start in progress.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Start {
    /// When this node first saw the replica `starting`, seconds on the autoscaler's
    /// monotonic clock.
    since: f64,
    /// This node saw the start begin.
    whole: bool,
    /// Stale (warned once; not counted).
    stale: bool,
}

/// The starts a node follows, and the durations it measured.
#[derive(Debug, Default)]
pub struct Starts {
    starting: BTreeMap<String, Start>,
    measured: std::collections::VecDeque<f64>,
    observed: bool,
}

impl Starts {
    /// Follows `state` at `now` (seconds on the autoscaler's monotonic clock, never set
    /// back): starts that began, ended (measured) or were cancelled. Returns the replicas starting, by name, with a key that orders them from
    /// the oldest start to the newest the same on every node (the registry's log index).
    pub fn observe(&mut self, state: &ClusterState, now: f64) -> BTreeMap<String, f64> {
        let whole = self.observed;
        self.observed = true;
        let mut order = BTreeMap::new();
        for e in state.live_replicas() {
            let name = &e.config.name;
            match e.state {
                ReplicaStatus::Starting => {
                    self.starting.entry(name.clone()).or_insert(Start { since: now, whole, stale: false });
                    order.insert(name.clone(), e.changed_at as f64);
                }
                ReplicaStatus::Ready => {
                    if let Some(s) = self.starting.remove(name).filter(|s| s.whole) {
                        if self.measured.len() == STARTS_KEPT {
                            self.measured.pop_front();
                        }
                        self.measured.push_back(now - s.since);
                    }
                }
                // The registry holds lifecycle states only (`ReplicaStatus::is_lifecycle`).
                _ => {}
            }
        }
        self.starting.retain(|n, _| order.contains_key(n));
        order
    }

    /// The cold start, seconds: the mean of the latest [`STARTS_KEPT`] starts measured, else
    /// `configured`.
    pub fn cold_start_s(&self, configured: f64) -> f64 {
        if self.measured.is_empty() {
            configured
        } else {
            self.measured.iter().sum::<f64>() / self.measured.len() as f64
        }
    }

    /// When each start still counted as capacity on its way began (on the same clock), at `now`
    /// with cold starts of `cold_start`; a start that turns stale is warned about once.
    pub fn counted(&mut self, now: f64, cold_start_s: f64) -> Vec<f64> {
        for (name, s) in self.starting.iter_mut().filter(|(_, s)| !s.stale) {
            if now - s.since > STALE_START_COLD_STARTS * cold_start_s {
                s.stale = true;
                tracing::warn!(replica = %name, starting_for_s = now - s.since, cold_start_s,
                    "autoscaler: replica still starting after {STALE_START_COLD_STARTS} cold starts; no longer counted as capacity on its way (mark it ready, or remove it)");
            }
        }
        self.starting.values().filter(|s| !s.stale).map(|s| s.since).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::registry::RegistryEntry;
    use crate::config::ReplicaConfig;

    fn state(replicas: &[(&str, ReplicaStatus, u64)]) -> ClusterState {
        let mut s = ClusterState::default();
        for &(name, state, changed_at) in replicas {
            let config: ReplicaConfig =
                toml::from_str(&format!("name = \"{name}\"\nhttp = \"http://{name}:8000\"\ncapacity_blocks = 100"))
                    .unwrap();
            s.replicas.insert(name.into(), RegistryEntry { config, state, changed_at });
        }
        s
    }

    #[test]
    fn starts_are_measured_when_seen_whole_and_stop_counting_when_stale() {
        use ReplicaStatus::*;
        let mut starts = Starts::default();
        // Already starting when the node came up: counted, never measured.
        let order = starts.observe(&state(&[("a", Starting, 5), ("b", Ready, 2)]), 100.0);
        assert_eq!(order, BTreeMap::from([("a".to_string(), 5.0)]));
        assert_eq!(starts.counted(100.0, 60.0), [100.0]);
        // c and d start later; a turns ready (unmeasured), d is drained (cancelled).
        starts.observe(&state(&[("a", Starting, 5), ("c", Starting, 9), ("d", Starting, 8)]), 110.0);
        starts.observe(&state(&[("a", Ready, 11), ("c", Starting, 9), ("d", Draining, 12)]), 130.0);
        assert_eq!(starts.cold_start_s(60.0), 60.0);
        // c turns ready 40 s after it was first seen: measured.
        starts.observe(&state(&[("c", Ready, 13)]), 150.0);
        assert_eq!(starts.cold_start_s(60.0), 40.0);
        assert_eq!(starts.counted(150.0, 40.0), Vec::<f64>::new());
        // e starts and never ends: counted for 3 cold starts (120 s), then not.
        let order = starts.observe(&state(&[("e", Starting, 20)]), 160.0);
        assert_eq!(order, BTreeMap::from([("e".to_string(), 20.0)]));
        assert_eq!(starts.counted(280.0, 40.0), [160.0]);
        assert_eq!(starts.counted(280.5, 40.0), Vec::<f64>::new());
        // Marked ready at last: measured like any other.
        starts.observe(&state(&[("e", Ready, 30)]), 300.0);
        assert_eq!(starts.cold_start_s(60.0), 90.0);
        // Only the latest 20 starts count: 20 of 30 s push out the 40 s and 140 s ones.
        for i in 0..20u64 {
            let t = 400.0 + 100.0 * i as f64;
            starts.observe(&state(&[("f", Starting, 40 + i)]), t);
            starts.observe(&state(&[("f", Ready, 41 + i)]), t + 30.0);
        }
        assert_eq!(starts.cold_start_s(60.0), 30.0);
    }
}
