//! kvmesh's whole routing decision on the workload: hash the prompt's tokens, query the
//! index, score every replica with `token_load` (no Dynamo counterpart: its cost function runs
//! outside the indexer).

use crate::contender::kvmesh::event_of;
use crate::run::histogram;
use crate::workload::{tokens_of, Op, Workload};
use hdrhistogram::Histogram;
use kvmesh_core::{Fleet, FleetConfig, PolicyKind, ReplicaSpec, RouteRequest};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::time::Instant;

/// Decision latencies, nanoseconds, one decision per query of the workload (each asked once).
#[derive(Debug)]
pub struct DecisionTimes {
    /// `RouteRequest::new` hashing 4,096 tokens, then `Fleet::decide` (nothing booked).
    pub whole: Histogram<u64>,
    /// The hashing alone (`RouteRequest::new`).
    pub hash: Histogram<u64>,
    /// `Fleet::decide` alone: the index query, the view and `token_load`'s pick.
    pub decide: Histogram<u64>,
}

/// Times every query of `w` decided once on a fleet of `w.engines` replicas of
/// `capacity_blocks` blocks fed the workload's events (one clock read between the parts).
pub fn decision_pass(w: &Workload, capacity_blocks: u64) -> DecisionTimes {
    let mut fleet = Fleet::new(FleetConfig::default()).expect("the default fleet config is valid");
    let ids: Vec<_> = (0..w.engines)
        .map(|e| fleet.add_replica(ReplicaSpec::new(format!("engine-{e}"), capacity_blocks)).expect("distinct names"))
        .collect();
    let mut policy = PolicyKind::TokenLoad.build();
    let mut rng = SmallRng::seed_from_u64(1);
    let (mut whole, mut hash, mut decide) = (histogram(), histogram(), histogram());
    for op in &w.ops {
        if let Op::Query(q) = op {
            let tokens: Vec<u32> = w.queries[*q].locals.iter().flat_map(|&l| tokens_of(l)).collect();
            let t = Instant::now();
            let req = RouteRequest::new(fleet.hasher(), &tokens, Some(256));
            let hashed = Instant::now();
            let d = fleet.decide(policy.as_mut(), &req, &mut rng, 1.0);
            let done = Instant::now();
            std::hint::black_box(d.expect("every replica is routable"));
            whole.saturating_record(ns(done - t));
            hash.saturating_record(ns(hashed - t));
            decide.saturating_record(ns(done - hashed));
        } else if let Some((replica, event)) = event_of(op) {
            fleet.apply_event(ids[replica.index()], &event, 1.0).expect("replicas are registered");
        }
    }
    DecisionTimes { whole, hash, decide }
}

/// `elapsed` in whole nanoseconds, at least 1 (the histogram's lowest value).
fn ns(elapsed: std::time::Duration) -> u64 {
    (elapsed.as_nanos() as u64).max(1)
}
