//! The tier's autoscaler on a node (`[autoscaler]`, `kvmesh_core::autoscale`).
//!
//! Every node evaluates the policy every `interval_s` on the same tier-wide inputs, so a
//! follower's forecast is warm when it becomes leader; only the Raft leader (a single node:
//! itself) commits. The inputs:
//! - demand: the rate of token load booked across the tier (this node's routing and, through
//!   gossip, every peer's);
//! - capacity per replica: `capacity_tokens_per_s`, else measured from the engines' served-token
//!   counters while they had requests waiting (`CapacityMeter`), else the engine profile's
//!   estimate;
//! - ready replicas (routable), starting ones (registered `starting`, with the time this node
//!   first saw them so), the router-side prefill backlog, and the cold start measured from the
//!   starts it saw end (`starting` → `ready`).
//!
//! It commits a decision (a `RecordScaleDecision` Raft entry with reason and inputs; the last
//! 100 are kept) whenever the desired count or the pool's ready and starting counts change,
//! and every 30 s otherwise. Every node
//! follows the committed decisions and serves them (`service`): `kvmesh.v1.Autoscaler` and
//! KEDA's external-scaler protocol. The counts are absolute and count starting replicas, so a
//! new leader continues without scaling twice; it also resumes from the last committed
//! decision (holding its count for a scale-down window, and committing only what changes),
//! so a leader change neither loses nor repeats a decision. What it held while it only
//! shadowed the leader is dropped at the takeover: the leader change is not a scale-up.
//!
//! With `drain_on_scale_down`, a scale-down also names the replicas to release
//! (`kvmesh_core::autoscale::pick_releases`) and drains them in the same entry; a replica is
//! then safe to release once it is idle (`Core::drain_progress`, `Replica.idle` in the admin
//! API: nothing in flight anywhere).

pub(crate) mod starts;

use crate::config::AutoscalerSection;
use kvmesh_core::autoscale::CapacityMeter;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tokio::sync::watch;

/// A decision re-committed unchanged after this long, seconds: watchers see the policy alive.
pub(crate) const REFRESH_S: f64 = 30.0;

/// One committed decision, as stored in Raft and served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// The pool.
    pub pool: String,
    /// Replicas the pool should have, ready and starting together.
    pub desired_replicas: u32,
    /// `hold`, `scale_up`, `burst`, `scale_down`, `hold_down`.
    pub reason: String,
    /// Ready replicas at the decision.
    pub ready: u32,
    /// Starting replicas at the decision.
    pub starting: u32,
    /// Token load sized for, tokens per second.
    pub forecast_tokens_per_s: f64,
    /// Token load measured over the last interval, tokens per second.
    pub demand_tokens_per_s: f64,
    /// Capacity per replica assumed, tokens per second.
    pub capacity_tokens_per_s: f64,
    /// Whether the panic window ruled.
    pub panic: bool,
    /// Unix seconds.
    pub at: f64,
    /// The Raft log index of its entry (0 on a single node).
    #[serde(default)]
    pub log_index: u64,
    /// Replicas this scale-down drains for release (`drain_on_scale_down`); empty otherwise.
    /// In the log: those its entry drained.
    #[serde(default)]
    pub drain: Vec<String>,
    /// The log index of the latest decision its leader had seen: its drains apply only if no
    /// decision was committed since (0 on a single node).
    #[serde(default)]
    pub base_log_index: u64,
    /// The cold start it assumed, seconds: the mean of the starts measured, else
    /// `cold_start` configured.
    #[serde(default)]
    pub cold_start_s: f64,
}

impl Decision {
    /// The policy's decision `d` for `pool` at `now` (Unix seconds), with the `demand`
    /// measured over the last interval (tokens per second) and the cold start assumed
    /// (seconds); not yet in the log.
    pub(crate) fn new(
        pool: &str,
        d: &kvmesh_core::autoscale::ScaleDecision,
        demand: f64,
        cold_start_s: f64,
        now: f64,
    ) -> Self {
        Decision {
            pool: pool.to_string(),
            desired_replicas: d.desired,
            reason: d.reason.as_str().into(),
            ready: d.ready,
            starting: d.starting,
            forecast_tokens_per_s: d.forecast_tokens_per_s,
            demand_tokens_per_s: demand,
            capacity_tokens_per_s: d.capacity_tokens_per_s,
            panic: d.panic,
            at: now,
            log_index: 0,
            drain: Vec::new(),
            base_log_index: 0,
            cold_start_s,
        }
    }
}

/// A node's view of the decisions, and the replicas' measured capacity.
pub struct Autoscaling {
    /// The settings.
    pub section: AutoscalerSection,
    decisions: watch::Sender<Arc<Vec<Decision>>>,
    capacity: std::sync::Mutex<CapacityMeter>,
    /// This node's latest evaluation (every `interval_s`, leader or not), committed or not:
    /// a committed decision can be `REFRESH_S` old while the load moves.
    evaluated: std::sync::Mutex<Option<Decision>>,
}

impl Autoscaling {
    /// State for `section`.
    pub fn new(section: AutoscalerSection) -> Self {
        Autoscaling {
            section,
            decisions: watch::channel(Arc::new(Vec::new())).0,
            capacity: std::sync::Mutex::new(CapacityMeter::default()),
            evaluated: std::sync::Mutex::new(None),
        }
    }

    /// This node's latest evaluation of the policy (not necessarily committed: only a change
    /// of the count, or `REFRESH_S` passing, commits one).
    pub fn evaluated(&self) -> Option<Decision> {
        self.evaluated.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn set_evaluated(&self, d: &Decision) {
        *self.evaluated.lock().unwrap_or_else(|p| p.into_inner()) = Some(d.clone());
    }

    /// A scrape of replica `name` at `at` (seconds): the tokens its engine served so far and
    /// its waiting requests (see [`CapacityMeter::observe`]).
    pub fn observe_served(&self, name: &str, served_tokens: f64, waiting: u32, at: f64) {
        self.meter().observe(name, served_tokens, waiting, at);
    }

    /// Forgets a removed replica's measurements.
    pub fn forget(&self, name: &str) {
        self.meter().forget(name);
    }

    /// What one replica serves at full load, tokens per second: `capacity_tokens_per_s` when
    /// set; else the mean measured from the engines' counters while they had requests waiting;
    /// else `prior` (the engine profile's estimate).
    pub fn capacity_tokens_per_s(&self, prior: f64) -> f64 {
        if self.section.capacity_tokens_per_s > 0.0 {
            return self.section.capacity_tokens_per_s;
        }
        self.meter().per_replica().unwrap_or(prior)
    }

    fn meter(&self) -> std::sync::MutexGuard<'_, CapacityMeter> {
        self.capacity.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the autoscaler runs.
    pub fn enabled(&self) -> bool {
        self.section.enabled
    }

    /// The latest decision.
    pub fn latest(&self) -> Option<Decision> {
        self.decisions.borrow().last().cloned()
    }

    /// The decisions kept (the last 100), oldest first.
    pub fn all(&self) -> Arc<Vec<Decision>> {
        self.decisions.borrow().clone()
    }

    /// Follows the committed decisions.
    pub fn watch(&self) -> watch::Receiver<Arc<Vec<Decision>>> {
        self.decisions.subscribe()
    }

    /// Takes the decisions committed in Raft (JSON; entries it cannot read are skipped).
    pub fn follow(&self, committed: &[serde_json::Value]) {
        let parsed: Vec<Decision> = committed.iter().filter_map(|v| serde_json::from_value(v.clone()).ok()).collect();
        self.decisions.send_if_modified(|d| {
            let changed = **d != parsed;
            if changed {
                *d = Arc::new(parsed);
            }
            changed
        });
    }

    /// Records a single node's own decision (the autoscaler task's, with no Raft log to
    /// commit it to), keeping the newest 100.
    pub fn record_local(&self, decision: Decision) {
        self.decisions.send_modify(|d| {
            let mut v = (**d).clone();
            v.push(decision);
            let excess = v.len().saturating_sub(100);
            v.drain(..excess);
            *d = Arc::new(v);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_configured_else_measured_else_the_prior() {
        let a = Autoscaling::new(AutoscalerSection::default());
        assert_eq!(a.capacity_tokens_per_s(33_423.0), 33_423.0);
        // Two scrapes 2 s apart, both with a queue: 90,000 tokens served.
        a.observe_served("e0", 10_000.0, 4, 100.0);
        a.observe_served("e0", 100_000.0, 2, 102.0);
        assert_eq!(a.capacity_tokens_per_s(33_423.0), 45_000.0);
        a.forget("e0");
        assert_eq!(a.capacity_tokens_per_s(33_423.0), 33_423.0);
        let fixed = Autoscaling::new(AutoscalerSection { capacity_tokens_per_s: 2_000.0, ..Default::default() });
        fixed.observe_served("e0", 10_000.0, 4, 100.0);
        fixed.observe_served("e0", 100_000.0, 2, 102.0);
        assert_eq!(fixed.capacity_tokens_per_s(33_423.0), 2_000.0);
    }
}
