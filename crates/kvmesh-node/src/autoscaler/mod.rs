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
//! so a leader change neither loses nor repeats a decision.
//!
//! With `drain_on_scale_down`, a scale-down also names the replicas to release
//! (`kvmesh_core::autoscale::pick_releases`) and drains them in the same entry; a replica is
//! then safe to release once it is idle (`Core::drain_progress`, `Replica.idle` in the admin
//! API: nothing in flight anywhere).

pub mod service;
mod starts;

use crate::cluster::registry::Command;
use crate::cluster::Cluster;
use crate::config::AutoscalerSection;
use crate::state::Shared;
use kvmesh_core::autoscale::{
    pick_releases, CapacityMeter, ColdStartAware, PoolInputs, ReleaseCandidate, ScalePolicy, ScaleReason,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// A decision re-committed unchanged after this long, seconds: watchers see the policy alive.
const REFRESH_S: f64 = 30.0;

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
    /// `cold_start_s` configured.
    #[serde(default)]
    pub cold_start_s: f64,
}

impl Decision {
    /// The policy's decision `d` for `pool` at `now` (Unix seconds), with the `demand`
    /// measured over the last interval (tokens per second) and the cold start assumed
    /// (seconds); not yet in the log.
    fn new(pool: &str, d: &kvmesh_core::autoscale::ScaleDecision, demand: f64, cold_start_s: f64, now: f64) -> Self {
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

    fn set_evaluated(&self, d: &Decision) {
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

    /// A single node's own decision.
    fn record_local(&self, decision: Decision) {
        self.decisions.send_modify(|d| {
            let mut v = (**d).clone();
            v.push(decision);
            let excess = v.len().saturating_sub(100);
            v.drain(..excess);
            *d = Arc::new(v);
        });
    }
}

/// The leader's loop (see the module docs). Ends when `stop` turns true.
pub async fn run(shared: Arc<Shared>, cluster: Option<Arc<Cluster>>, mut stop: watch::Receiver<bool>) {
    let section = shared.autoscaler.section.clone();
    if !section.enabled {
        return;
    }
    let mut policy = ColdStartAware::new(section.core());
    let prior = shared.settings.profile.full_load_tokens_per_s_prior();
    // The first evaluation one interval in: demand is a rate over a whole interval.
    let every = Duration::from_secs_f64(section.interval_s);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut starts = starts::Starts::default();
    let mut last = (Instant::now(), shared.core().booked_tokens);
    // The policy, the starts and the refresh run on a monotonic clock (seconds since this
    // loop began): a wall clock set back or forward would hold or expire their windows. Wall
    // time only stamps the decisions, for the audit log.
    let epoch = Instant::now();
    // What the last committed decision said: (desired, ready, starting, when on `mono`).
    let mut committed: Option<(u32, u32, u32, f64)> = None;
    // The newest committed decision seen (its Raft index), and when this node's own last one
    // was made (to tell its own entries from another leader's).
    let mut seen_index = 0u64;
    let mut own_at: Option<f64> = None;
    // The log index of this node's own last decision: the base of its next one even before
    // its follower task has applied it.
    let mut own_index = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let now = crate::replication::unix_now();
        let mono = epoch.elapsed().as_secs_f64();
        // Replicas registered `starting`, and starts measured as they end.
        let start_order = match &cluster {
            Some(c) => starts.observe(&c.state.borrow(), mono),
            None => BTreeMap::new(),
        };
        let leads = cluster.as_ref().is_none_or(|c| c.leads());
        let held = shared.admission.waiting_load();
        let (booked, ready, queued) = {
            let core = shared.core();
            let ready = core.fleet.replicas().iter().filter(|r| r.routable()).count() as u32;
            // Requests held by admission control are a backlog too.
            let queued = core.fleet.bookings().queued_prefill_at(shared.now()) + held;
            (core.booked_tokens, ready, queued)
        };
        let dt = last.0.elapsed().as_secs_f64().max(1e-3);
        let demand = (booked - last.1).max(0.0) / dt;
        last = (Instant::now(), booked);
        let cold_start_s = starts.cold_start_s(section.cold_start_s);
        let inputs = PoolInputs {
            now: mono,
            demand_tokens_per_s: demand,
            capacity_tokens_per_s: shared.autoscaler.capacity_tokens_per_s(prior),
            ready,
            starting: starts.counted(mono, cold_start_s),
            cold_start_s,
            queued_tokens: queued as f64,
        };
        if !leads {
            // Shadow the leader: the same inputs keep this node's forecast warm.
            let d = policy.decide(&inputs);
            shared.autoscaler.set_evaluated(&Decision::new(&section.pool, &d, demand, cold_start_s, now));
            continue;
        }
        // Continue from any decision committed by another leader (this node's first as leader,
        // or one it applies only now: a new leader may not have applied the last entries yet).
        if let Some(last) = shared.autoscaler.latest().filter(|l| l.log_index > seen_index) {
            seen_index = last.log_index;
            if own_at != Some(last.at) {
                policy.resume(mono, last.desired_replicas);
                // Its age on the wall clocks (another node's, then ours), at most one refresh: the
                // next refresh comes REFRESH_S after it was committed, not after it was seen.
                let age = (now - last.at).clamp(0.0, REFRESH_S);
                committed = Some((last.desired_replicas, last.ready, last.starting, mono - age));
            }
        }
        let d = policy.decide(&inputs);
        let mut decision = Decision::new(&section.pool, &d, demand, cold_start_s, now);
        if section.drain_on_scale_down && d.reason == ScaleReason::ScaleDown {
            let excess = (d.ready + d.starting).saturating_sub(d.desired) as usize;
            let candidates = release_candidates(&shared, &start_order);
            decision.drain =
                pick_releases(&candidates, excess).into_iter().map(|i| candidates[i].name.clone()).collect();
        }
        decision.base_log_index = shared.autoscaler.latest().map_or(0, |l| l.log_index).max(own_index);
        shared.autoscaler.set_evaluated(&decision);
        let due = committed.is_none_or(|(desired, ready, starting, at)| {
            (desired, ready, starting) != (d.desired, d.ready, d.starting) || mono - at >= REFRESH_S
        });
        if !due {
            continue;
        }
        let asked = !decision.drain.is_empty();
        // The replicas the committed entry drained (the state machine may drain fewer).
        let drained = match &cluster {
            None => {
                let drain = decision.drain.clone();
                for name in &drain {
                    let _ = shared.set_draining(name, true);
                }
                shared.autoscaler.record_local(decision);
                drain
            }
            Some(c) => {
                let json = match serde_json::to_value(&decision) {
                    Ok(j) => j,
                    Err(_) => continue,
                };
                match c.write(Command::RecordScaleDecision { decision: json }).await {
                    Ok((_, index)) => {
                        own_index = index;
                        entry_drain(&c.state.borrow().scale_decisions, index)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "autoscaler: decision not committed; the next evaluation decides again");
                        continue;
                    }
                }
            }
        };
        if committed.is_none_or(|(desired, ..)| desired != d.desired) {
            tracing::info!(pool = %section.pool, desired = d.desired, reason = d.reason.as_str(), ready, starting = d.starting,
                demand_tokens_per_s = demand, forecast_tokens_per_s = d.forecast_tokens_per_s, "autoscaler: decision");
        }
        if !drained.is_empty() {
            tracing::info!(pool = %section.pool, desired = d.desired, replicas = %drained.join(", "),
                "autoscaler: scale-down drains replicas; release each once idle (`kvmesh replica drain --wait`)");
        }
        own_at = Some(now);
        if asked && drained.is_empty() {
            // A decision committed meanwhile (another leader's): decide again next interval,
            // on what it did, rather than after REFRESH_S.
            committed = None;
            continue;
        }
        committed = Some((d.desired, d.ready, d.starting, mono));
    }
}

/// The replicas the committed decision at log `index` drained (empty if it is not among
/// `decisions`, the last 100).
fn entry_drain(decisions: &[serde_json::Value], index: u64) -> Vec<String> {
    decisions
        .iter()
        .rev()
        .find(|d| d.get("log_index").and_then(|i| i.as_u64()) == Some(index))
        .and_then(|d| d.get("drain"))
        .and_then(|d| serde_json::from_value(d.clone()).ok())
        .unwrap_or_default()
}

/// The replicas a scale-down may release: the routable ones and those still `starting`
/// (`starting`: by name, a key that orders them from the oldest start to the newest).
fn release_candidates(shared: &Shared, starting: &BTreeMap<String, f64>) -> Vec<ReleaseCandidate> {
    let core = shared.core();
    core.replicas
        .values()
        .filter_map(|r| {
            let routable = core.fleet.replica(r.id).is_some_and(|f| f.routable());
            let since = starting.get(&r.config.name).copied();
            if !routable && since.is_none() {
                return None;
            }
            let load = core.fleet.bookings().load(r.id);
            let engine = r.engine.map_or(0, |e| e.running + e.waiting);
            Some(ReleaseCandidate {
                name: r.config.name.clone(),
                starting: since.is_some(),
                starting_since: since.unwrap_or(0.0),
                in_flight: (load.prefilling + load.decoding).max(engine),
                cached_blocks: core.fleet.index().replica_blocks(r.id) as u64,
            })
        })
        .collect()
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
