//! Policy tests: each policy's documented behaviour, thresholds flipping at the documented
//! values, random tie-breaks (C10) and ring order independence (C11).

mod peers;
mod token_load;

use super::*;
use crate::fleet::{Fleet, FleetConfig, ReplicaSpec};
use crate::index::{KvEvent, Stored};
use crate::load::{BookingSpec, EngineMetrics};
use crate::{EngineBlockHash, Medium};
use rand::rngs::SmallRng;
use rand::SeedableRng;

const BS: u32 = 16;

fn fleet(n: usize) -> (Fleet, Vec<ReplicaId>) {
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    let ids = (0..n).map(|i| f.add_replica(ReplicaSpec::new(format!("r{i}"), 10_000)).unwrap()).collect();
    (f, ids)
}

fn rng() -> SmallRng {
    SmallRng::seed_from_u64(42)
}

fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| seed.wrapping_mul(1_000_003).wrapping_add(i)).collect()
}

/// Makes `r` hold the first `blocks` blocks of `toks`, by a real Stored event.
fn hold(f: &mut Fleet, r: ReplicaId, toks: &[u32], blocks: usize, now: f64) {
    let ev = KvEvent::Stored(Stored {
        block_hashes: (0..blocks as u64).map(|b| EngineBlockHash(toks[0] as u64 * 10_000 + b)).collect(),
        parent: None,
        token_ids: toks[..blocks * BS as usize].to_vec(),
        block_size: BS,
        medium: Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        kv_group: None,
    });
    f.apply_event(r, &ev, now).unwrap();
}

/// Gives `r` exactly `n` outstanding requests, each with `prefill` queued uncached tokens,
/// booked at 1.0 s (the time `decide` decides at, so nothing has drained yet).
fn load(f: &mut Fleet, r: ReplicaId, n: u32, prefill: u32) {
    load_at(f, r, n, prefill, 1.0);
}

fn load_at(f: &mut Fleet, r: ReplicaId, n: u32, prefill: u32, at: f64) {
    for _ in 0..n {
        f.book(r, booking(prefill), at).unwrap();
    }
}

/// A streamed request with `prefill` uncached tokens to compute and no output expected.
fn booking(prefill: u32) -> BookingSpec {
    BookingSpec {
        uncached_prefill_tokens: prefill,
        uncached_blocks: 0,
        expected_output_tokens: 0,
        reports_first_token: true,
        output_key: None,
        reestimate_up_to: None,
    }
}

/// Routes `toks` to `r` with a record-keeping policy, so the routing record holds it.
fn decide(f: &mut Fleet, p: &mut dyn Policy, toks: &[u32]) -> Decision {
    let req = RouteRequest::new(f.hasher(), toks, Some(16));
    f.decide(p, &req, &mut rng(), 1.0).unwrap()
}

#[test]
fn c10_unrelated_requests_spread_over_idle_replicas() {
    for kind in
        [PolicyKind::TokenLoad, PolicyKind::KvCost, PolicyKind::LeastOutstandingRequests, PolicyKind::RoundRobin]
    {
        let (mut f, _) = fleet(4);
        let mut p = kind.build();
        let mut chosen = Vec::new();
        for s in 0..3 {
            let req = RouteRequest::new(f.hasher(), &tokens(s, 512), Some(16));
            chosen.push(f.route(p.as_mut(), &req, &mut rng(), 0.0).unwrap().decision.replica);
        }
        chosen.sort();
        chosen.dedup();
        assert_eq!(chosen.len(), 3, "{kind}");
    }
}

#[test]
fn c10_exact_ties_are_uniform() {
    for kind in PolicyKind::ALL {
        if matches!(
            kind,
            PolicyKind::RoundRobin
                | PolicyKind::ConsistentHash
                | PolicyKind::CacheAware
                | PolicyKind::VllmCacheAware
                | PolicyKind::PrefixAffinity
        ) {
            continue; // deterministic by design, or the peer's own first-of-the-list tie-break
        }
        let (mut f, _) = fleet(4);
        let mut p = kind.build();
        let mut r = SmallRng::seed_from_u64(9);
        let mut counts = [0u32; 4];
        let req = RouteRequest::new(f.hasher(), &tokens(1, 64), Some(16));
        for _ in 0..1000 {
            counts[f.decide(p.as_mut(), &req, &mut r, 0.0).unwrap().replica.index()] += 1;
        }
        for c in counts {
            assert!((200..=300).contains(&c), "{kind}: {counts:?}");
        }
    }
}

#[test]
fn round_robin_rotates_in_id_order() {
    let (mut f, ids) = fleet(3);
    let mut p = RoundRobin::default();
    let got: Vec<ReplicaId> = (0..4).map(|_| decide(&mut f, &mut p, &tokens(0, 16)).replica).collect();
    assert_eq!(got, vec![ids[0], ids[1], ids[2], ids[0]]);
}

#[test]
fn least_outstanding_picks_fewest() {
    let (mut f, ids) = fleet(3);
    load(&mut f, ids[0], 2, 0);
    load(&mut f, ids[2], 1, 0);
    let d = decide(&mut f, &mut LeastOutstanding::default(), &tokens(0, 16));
    assert_eq!((d.replica, d.reason), (ids[1], Reason::FewestOutstanding));
}

#[test]
fn c11_ring_ignores_registration_order_and_removal_moves_only_own_keys() {
    let names = ["a", "b", "c", "d"];
    let build = |order: &[usize]| {
        let mut f = Fleet::new(FleetConfig::default()).unwrap();
        for &i in order {
            f.add_replica(ReplicaSpec::new(names[i], 10_000)).unwrap();
        }
        f
    };
    let map = |f: &mut Fleet| -> Vec<String> {
        let mut p = ConsistentHash::new(ConsistentHashParams::default());
        (0..300u64)
            .map(|k| {
                let req = RouteRequest::from_hashes(64, vec![], None).with_key(k);
                let d = f.decide(&mut p, &req, &mut rng(), 0.0).unwrap();
                f.replica(d.replica).unwrap().spec.name.clone()
            })
            .collect()
    };
    let m1 = map(&mut build(&[0, 1, 2, 3]));
    let m2 = map(&mut build(&[2, 0, 3, 1]));
    assert_eq!(m1, m2);
    for n in names {
        assert!(m1.iter().filter(|x| *x == n).count() > 30, "every replica owns keys");
    }
    let mut f = build(&[0, 1, 2, 3]);
    let b = f.replica_by_name("b").unwrap().id;
    f.remove_replica(b).unwrap();
    let m3 = map(&mut f);
    for (before, after) in m1.iter().zip(&m3) {
        if before != "b" {
            assert_eq!(before, after);
        }
    }
}

#[test]
fn draining_replicas_take_nothing_and_an_empty_fleet_is_an_error() {
    let (mut f, ids) = fleet(2);
    f.set_status(ids[0], crate::ReplicaStatus::Draining).unwrap();
    for kind in PolicyKind::ALL {
        let mut p = kind.build();
        for s in 0..10 {
            assert_eq!(decide(&mut f, p.as_mut(), &tokens(s, 64)).replica, ids[1], "{kind}");
        }
    }
    f.set_status(ids[1], crate::ReplicaStatus::Draining).unwrap();
    let req = RouteRequest::new(f.hasher(), &tokens(0, 64), None);
    let mut p = PolicyKind::TokenLoad.build();
    assert_eq!(f.decide(p.as_mut(), &req, &mut rng(), 0.0), Err(Error::NoReplicaReady));
}

#[test]
fn policy_names_parse_and_round_trip() {
    for k in PolicyKind::ALL {
        assert_eq!(k.as_str().parse::<PolicyKind>().unwrap(), k);
        assert_eq!(k.build().name(), k.as_str());
    }
    assert_eq!("power-of-two".parse::<PolicyKind>().unwrap(), PolicyKind::PowerOfTwo);
    let err = "fastest".parse::<PolicyKind>().unwrap_err().to_string();
    assert!(err.starts_with("unknown policy \"fastest\"; known policies: round_robin, random,"), "{err}");
}

#[test]
fn policies_take_named_parameters() {
    let p = |k: PolicyKind, params: &[(&str, f64)]| {
        let params: Vec<(String, f64)> = params.iter().map(|(n, v)| (n.to_string(), *v)).collect();
        k.build_with(&params)
    };
    assert_eq!(
        p(PolicyKind::TokenLoad, &[("move_weight", 0.5), ("near_equal_s", 0.002)]).unwrap().name(),
        "token_load"
    );
    assert_eq!(p(PolicyKind::ConsistentHash, &[("vnodes", 64.0)]).unwrap().name(), "consistent_hash");
    let err = |r: Result<Box<dyn Policy>, Error>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(p(PolicyKind::TokenLoad, &[("speed", 1.0)])).contains("policy token_load has no parameter \"speed\""));
    assert!(err(p(PolicyKind::ConsistentHash, &[("vnodes", 1.5)])).contains("vnodes must be a whole number, got 1.5"));
    assert!(err(p(PolicyKind::KvCost, &[("overlap_weight", -1.0)])).contains("must be a non-negative number"));
    assert!(err(p(PolicyKind::ConsistentHash, &[("vnodes", 0.0)])).contains("vnodes must be within 1..=4096, got 0"));
    assert!(err(p(PolicyKind::ConsistentHash, &[("vnodes", 4e9)])).contains("vnodes must be within 1..=4096"));
    assert!(err(p(PolicyKind::ConsistentHash, &[("load_factor", 1.25)]))
        .contains("policy consistent_hash has no parameter \"load_factor\""));
    assert!(err(p(PolicyKind::CacheAware, &[("eviction_interval_s", 0.0)])).contains("within 1..=86400"));
    assert_eq!(p(PolicyKind::VllmCacheAware, &[("cache_threshold", 0.5)]).unwrap().name(), "vllm_cache_aware");
    assert_eq!(p(PolicyKind::PrefixAffinity, &[("imbalanced_threshold", 10.0)]).unwrap().name(), "prefix_affinity");
    assert!(err(p(PolicyKind::RoundRobin, &[("x", 1.0)])).contains("policy round_robin has no parameter \"x\""));
    assert_eq!(p(PolicyKind::RoundRobin, &[]).unwrap().name(), "round_robin");
}
