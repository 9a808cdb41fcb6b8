//! The autoscaling loop: every node evaluates on the tier's inputs read from the node's state,
//! the leader commits through Raft, every node follows what is committed (module docs of
//! [`crate::autoscaler`]). It sits above the state; the decisions it keeps
//! ([`crate::autoscaler::Autoscaling`]) sit below it.

use crate::autoscaler::{starts, Decision, REFRESH_S};
use crate::cluster::registry::Command;
use crate::cluster::Cluster;
use crate::state::Shared;
use kvmesh_core::autoscale::{pick_releases, ColdStartAware, PoolInputs, ReleaseCandidate, ScalePolicy, ScaleReason};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The leader's loop (see the module docs). Ends when `stop` turns true.
pub async fn run(shared: Arc<Shared>, cluster: Option<Arc<Cluster>>, mut stop: watch::Receiver<bool>) {
    let section = shared.autoscaler.section.clone();
    if !section.enabled {
        return;
    }
    let mut policy = ColdStartAware::new(section.policy.clone());
    let prior = shared.settings.profile.full_load_tokens_per_s_prior();
    // The first evaluation one interval in: demand is a rate over a whole interval.
    let every = Duration::from_secs_f64(section.policy.interval_s);
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
    // Whether this node led at the last evaluation (a takeover is the first one it leads).
    let mut led = false;
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
        let cold_start_s = starts.cold_start_s(section.policy.cold_start_s);
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
            led = false;
            // Shadow the leader: the same inputs keep this node's forecast warm.
            let d = policy.decide(&inputs);
            shared.autoscaler.set_evaluated(&Decision::new(&section.pool, &d, demand, cold_start_s, now));
            continue;
        }
        // Continue from the decision committed last: at every takeover (the needs this node
        // held while shadowing were never committed), and whenever another leader's appears
        // (one this node applies only now: a new leader may not have applied the last entries
        // yet). An entry at or below this node's own last index is its own or older: its
        // own hold stays.
        let took_over = !led;
        led = true;
        if let Some(last) = shared.autoscaler.latest().filter(|l| took_over || l.log_index > seen_index) {
            seen_index = seen_index.max(last.log_index);
            let own = own_at == Some(last.at) || (own_index > 0 && last.log_index <= own_index);
            if took_over || !own {
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
            let engine = r.health.lock().engine.map_or(0, |e| e.running + e.waiting);
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
