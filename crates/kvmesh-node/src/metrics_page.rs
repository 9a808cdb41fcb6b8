//! The `/metrics` page: the gauges that mirror the node's state (per replica, gossip, Raft,
//! replication, the autoscaler, admission) refreshed from [`Shared`] at scrape time, then the
//! text exposition of [`crate::metrics::Metrics`]. It lives here, above the state, so that the
//! metrics module depends on nothing of the node's (the state, and everything beside it,
//! records into it).

use crate::metrics::recovered_ratio;
use crate::state::Shared;
use kvmesh_core::ReplicaStatus;
use prometheus_client::encoding::text::encode;

/// The text exposition, with per-replica gauges refreshed from `shared`.
pub fn render(shared: &Shared) -> String {
    let m = &shared.metrics;
    let now = shared.now();
    {
        let core = shared.core();
        // Removed replicas must disappear from every per-replica family.
        m.replica_status.clear();
        m.replica_queued_prefill.clear();
        m.replica_bookings.clear();
        m.replica_kv_usage.clear();
        m.replica_index_blocks.clear();
        m.replica_capacity_blocks.clear();
        m.replica_orphan_blocks.clear();
        m.replica_recovered.clear();
        m.replica_idle.clear();
        for r in core.replicas.values() {
            let status = core.status(r, now);
            for s in ReplicaStatus::OBSERVED {
                let labels = vec![("replica", r.config.name.clone()), ("status", s.as_str().to_string())];
                m.replica_status.get_or_create(&labels).set((s == status) as i64);
            }
            let l = vec![("replica", r.config.name.clone())];
            let load = core.fleet.bookings().load(r.id);
            m.replica_queued_prefill.get_or_create(&l).set(load.queued_prefill_tokens as i64);
            m.replica_bookings.get_or_create(&l).set((load.prefilling + load.decoding) as i64);
            m.replica_kv_usage.get_or_create(&l).set(r.health.lock().engine.map_or(0.0, |e| e.kv_usage));
            m.replica_index_blocks.get_or_create(&l).set(core.fleet.index().replica_blocks(r.id) as i64);
            let capacity = core.fleet.replica_capacity_blocks(r.id);
            m.replica_capacity_blocks.get_or_create(&l).set(i64::try_from(capacity).unwrap_or(i64::MAX));
            let (placed, waiting) = (core.fleet.index().replica_blocks(r.id), core.fleet.index().orphan_blocks(r.id));
            m.replica_orphan_blocks.get_or_create(&l).set(waiting as i64);
            m.replica_recovered.get_or_create(&l).set(recovered_ratio(placed, waiting));
            m.replica_idle.get_or_create(&l).set(core.drain_progress(r, now).is_some_and(|p| p.idle()) as i64);
        }
    }
    m.gossip_peer_bookings.clear();
    m.gossip_peer_age.clear();
    m.gossip_peer_up.clear();
    {
        let core = shared.core();
        for (peer, live, _) in core.remote.peers() {
            m.gossip_peer_bookings.get_or_create(&vec![("peer", peer.0.to_string())]).set(live as i64);
        }
        // Every other member has an age and an up/down series, silent ones included (a
        // peer never heard counts from this node's start), so a lag alert can fire.
        if let Some(c) = shared.cluster.get() {
            let timeout_s = c.section.peer_timeout.as_secs_f64();
            for id in c.members().into_keys().filter(|id| *id != c.id) {
                let l = vec![("peer", id.to_string())];
                // Its bookings are dropped once it is silent: 0, not a missing series.
                let _ = m.gossip_peer_bookings.get_or_create(&l);
                let age = core.remote.last_heard(kvmesh_core::gossip::NodeId(id)).map_or(now, |h| now - h);
                m.gossip_peer_age.get_or_create(&l).set(age);
                m.gossip_peer_up.get_or_create(&l).set(i64::from(age <= timeout_s));
            }
        }
    }
    if let Some(c) = shared.cluster.get() {
        let r = c.raft.metrics().borrow().clone();
        let membership = r.membership_config.membership();
        // In RAFT's order.
        let values = [
            r.current_term as i64,
            r.current_leader.unwrap_or(0) as i64,
            c.leads() as i64,
            r.last_applied.map_or(0, |l| l.index) as i64,
            r.last_log_index.unwrap_or(0) as i64,
            membership.voter_ids().count() as i64,
        ];
        for (g, v) in m.raft.iter().zip(values) {
            g.set(v);
        }
    }
    if shared.replication.enabled() {
        let plan = shared.replication.plan();
        // In PLAN's order.
        for (g, v) in m.replication.iter().zip([plan.version, plan.prefixes.len() as u64, plan.planned_blocks()]) {
            g.set(v as i64);
        }
        let counts = plan.target_counts();
        for (state, n) in ["pending", "warming", "confirmed", "failed"].into_iter().zip(counts) {
            m.replication_targets.get_or_create(&vec![("state", state.to_string())]).set(n as i64);
        }
        let hot = crate::tasks::replication::hot(shared);
        let top = hot.prefixes.iter().map(|p| p.load_tokens_per_s).fold(0.0, f64::max);
        m.replication_top_share.set(if hot.total_load_tokens_per_s > 0.0 {
            top / hot.total_load_tokens_per_s
        } else {
            0.0
        });
    }
    m.admission_queue.set(shared.admission.depth() as i64);
    for (which, d) in [("committed", shared.autoscaler.latest()), ("evaluated", shared.autoscaler.evaluated())] {
        let Some(d) = d else { continue };
        // In AUTOSCALER's order.
        let values = [
            f64::from(d.desired_replicas),
            f64::from(d.ready),
            f64::from(d.starting),
            d.demand_tokens_per_s,
            d.forecast_tokens_per_s,
            d.capacity_tokens_per_s,
            f64::from(u8::from(d.panic)),
            d.at,
        ];
        let l = vec![("decision", which.to_string())];
        for (f, v) in m.autoscaler.iter().zip(values) {
            f.get_or_create(&l).set(v);
        }
    }
    let mut out = String::new();
    let _ = encode(&mut out, &m.registry);
    out
}
