//! Policy tests: each policy's documented behaviour, thresholds flipping at the documented
//! values, random tie-breaks (C10) and ring order independence (C11).

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
        let spec = BookingSpec { uncached_prefill_tokens: prefill, uncached_blocks: 0, expected_output_tokens: 0 };
        f.book(r, spec, at).unwrap();
    }
}

/// Routes `toks` to `r` with a record-keeping policy, so the routing record holds it.
fn record(f: &mut Fleet, r: ReplicaId, toks: &[u32]) {
    #[derive(Debug)]
    struct To(ReplicaId);
    impl Policy for To {
        fn name(&self) -> &'static str {
            "to"
        }
        fn uses_record(&self) -> bool {
            true
        }
        fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, _: &mut dyn RngCore) -> Result<Decision, Error> {
            let i = view.replicas.iter().position(|x| x.id == self.0).unwrap();
            Ok(Decision::at(view, req, i, Reason::Rotation))
        }
    }
    let req = RouteRequest::new(f.hasher(), toks, Some(1));
    let routed = f.route(&mut To(r), &req, &mut rng(), 0.0).unwrap();
    f.release(routed.booking, None).unwrap();
}

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
        if matches!(kind, PolicyKind::RoundRobin | PolicyKind::ConsistentHash) {
            continue; // deterministic by design
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
fn power_of_two_with_two_replicas_always_takes_the_lighter() {
    let (mut f, ids) = fleet(2);
    load(&mut f, ids[0], 1, 500);
    for s in 0..20 {
        let req = RouteRequest::new(f.hasher(), &tokens(s, 16), None);
        let d = f.decide(&mut PowerOfTwo, &req, &mut SmallRng::seed_from_u64(s as u64), 0.0).unwrap();
        assert_eq!(d.replica, ids[1]);
    }
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
fn consistent_hash_spills_past_the_load_bound() {
    let (mut f, _) = fleet(2);
    let mut p = ConsistentHash::new(ConsistentHashParams::default());
    let req = RouteRequest::from_hashes(64, vec![], None).with_key(7);
    let owner = f.decide(&mut p, &req, &mut rng(), 0.0).unwrap();
    assert_eq!(owner.reason, Reason::RingOwner);
    // m = 2 outstanding on the owner: bound = ceil(1.25 · 3 / 2) = 2, so the owner is full.
    load(&mut f, owner.replica, 2, 0);
    let d = f.decide(&mut p, &req, &mut rng(), 0.0).unwrap();
    assert_eq!(d.reason, Reason::RingSpill);
    assert_ne!(d.replica, owner.replica);
    // m = 1: bound = ceil(1.25 · 2 / 2) = 2 > 1, so the owner keeps it.
    let (mut f, _) = fleet(2);
    let owner = f.decide(&mut p, &req, &mut rng(), 0.0).unwrap();
    load(&mut f, owner.replica, 1, 0);
    assert_eq!(f.decide(&mut p, &req, &mut rng(), 0.0).unwrap().replica, owner.replica);
}

#[test]
fn cache_aware_imbalance_thresholds_flip_at_documented_values() {
    assert!(cache_aware::imbalanced(0, 33, 32, 1.1));
    assert!(!cache_aware::imbalanced(0, 32, 32, 1.1));
    assert!(cache_aware::imbalanced(100, 133, 32, 1.1));
    assert!(!cache_aware::imbalanced(400, 433, 32, 1.1), "433 ≤ 400 × 1.1");
    let (mut f, ids) = fleet(2);
    let toks = tokens(3, 10 * BS);
    record(&mut f, ids[0], &toks);
    load(&mut f, ids[0], 33, 0);
    let d = decide(&mut f, &mut CacheAware::new(CacheAwareParams::default()), &toks);
    assert_eq!((d.replica, d.reason), (ids[1], Reason::Imbalance));
}

#[test]
fn cache_aware_match_rate_threshold_is_strict() {
    let (mut f, ids) = fleet(2);
    let toks = tokens(4, 10 * BS);
    // Replica 0 has 5 of 10 blocks recorded: rate 0.5 is not > 0.5 → smallest tree, replica 1.
    record(&mut f, ids[0], &toks[..5 * BS as usize]);
    let mut p = CacheAware::new(CacheAwareParams::default());
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (ids[1], Reason::LeastCached));
    record(&mut f, ids[0], &toks[..6 * BS as usize]);
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (ids[0], Reason::PrefixMatch));
}

#[test]
fn prefix_affinity_thresholds_flip_at_documented_values() {
    let (mut f, ids) = fleet(3);
    let toks = tokens(5, 10 * BS);
    record(&mut f, ids[0], &toks[..BS as usize]);
    let mut p = PrefixAffinity::new(PrefixAffinityParams::default());
    // 1 of 10 blocks = 0.1 ≥ 0.1: affinity.
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (ids[0], Reason::PrefixMatch));
    // 1 of 11 blocks < 0.1: the smallest recorded caches (replicas 1 and 2).
    let longer = tokens(5, 11 * BS);
    let d = decide(&mut f, &mut p, &longer);
    assert_eq!(d.reason, Reason::LeastCached);
    assert_ne!(d.replica, ids[0]);
    // Queue gap 10: still balanced; 11: imbalanced.
    load(&mut f, ids[0], 10, 0);
    assert_eq!(decide(&mut f, &mut p, &toks).reason, Reason::PrefixMatch);
    load(&mut f, ids[0], 1, 0);
    assert_eq!(decide(&mut f, &mut p, &toks).reason, Reason::Imbalance);
}

#[test]
fn kv_cost_is_prefill_minus_overlap_plus_decode_blocks() {
    let (mut f, ids) = fleet(2);
    let toks = tokens(6, 8 * BS);
    hold(&mut f, ids[0], &toks, 6, 1.0);
    let spec = BookingSpec { uncached_prefill_tokens: 10 * BS, uncached_blocks: 4, expected_output_tokens: 0 };
    f.book(ids[0], spec, 0.0).unwrap();
    let req = RouteRequest::new(f.hasher(), &toks, Some(16));
    let p = KvCost::new(KvCostParams::default());
    let view_cost = |f: &mut Fleet, i: usize| {
        #[derive(Debug)]
        struct Probe(KvCost, usize, f64);
        impl Policy for Probe {
            fn name(&self) -> &'static str {
                "probe"
            }
            fn pick(
                &mut self,
                req: &RouteRequest,
                view: &FleetView<'_>,
                _: &mut dyn RngCore,
            ) -> Result<Decision, Error> {
                self.2 = self.0.cost(view, req, self.1);
                Ok(Decision::at(view, req, self.1, Reason::LowestCost))
            }
        }
        let mut probe = Probe(KvCost::new(KvCostParams::default()), i, 0.0);
        f.decide(&mut probe, &req, &mut rng(), 1.0).unwrap();
        probe.2
    };
    // Replica 0: prefill (160 + 128 − 96)/16 = 12, decode 4 active + (8 − 6) new = 6 → 18.
    assert_eq!(view_cost(&mut f, 0), 18.0);
    // Replica 1: prefill 128/16 = 8, decode 0 active + 8 new = 8 → 16.
    assert_eq!(view_cost(&mut f, 1), 16.0);
    let mut p = p;
    assert_eq!(f.decide(&mut p, &req, &mut rng(), 1.0).unwrap().replica, ids[1]);
}

#[test]
fn weighted_scorer_sums_documented_weights() {
    let (mut f, ids) = fleet(2);
    let toks = tokens(7, 4 * BS);
    record(&mut f, ids[0], &toks);
    // Replica 0: prefix 1.0·3 + queue 1.0·2 + kv 1.0·2 = 7 (metrics: no waiting, empty KV).
    // Replica 1: prefix 0 + queue 0 (it has the longest queue) + kv 0.5·2 = 1.
    f.report_metrics(ids[0], EngineMetrics { running: 0, waiting: 0, kv_usage: 0.0, at: 1.0 }).unwrap();
    f.report_metrics(ids[1], EngineMetrics { running: 4, waiting: 9, kv_usage: 0.5, at: 1.0 }).unwrap();
    let d = decide(&mut f, &mut WeightedScorer::new(WeightedScorerParams::default()), &toks);
    assert_eq!(d.replica, ids[0]);
    // Another prefix recorded on replica 1, replica 0's KV full: replica 0 scores
    // 0 + 2 + 0 = 2, replica 1 scores 3 + 0 + 1 = 4.
    let other = tokens(8, 4 * BS);
    record(&mut f, ids[1], &other);
    f.report_metrics(ids[0], EngineMetrics { running: 0, waiting: 0, kv_usage: 1.0, at: 1.0 }).unwrap();
    assert_eq!(decide(&mut f, &mut WeightedScorer::new(WeightedScorerParams::default()), &other).replica, ids[1]);
}

#[test]
fn token_load_trades_overlap_against_queue() {
    let (mut f, ids) = fleet(2);
    let toks = tokens(9, 64 * BS); // 1,024 tokens
    hold(&mut f, ids[0], &toks, 64, 1.0);
    let mut p = TokenLoadPolicy::new(TokenLoadParams::default());
    // Fully cached on replica 0: 1 token to compute there against 1,024 on replica 1.
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason, d.overlap_blocks, d.uncached_tokens), (ids[0], Reason::LowestCost, 64, 1));
    // Greedy (no recompute charge): a 1,101-token queue (3 requests) on replica 0 outweighs
    // the 1,023 tokens its cache saves.
    load(&mut f, ids[0], 3, 367);
    let mut greedy = TokenLoadPolicy::new(TokenLoadParams { move_weight: 0.0, ..TokenLoadParams::default() });
    let d = decide(&mut f, &mut greedy, &toks);
    assert_eq!((d.replica, d.uncached_tokens), (ids[1], 1024));
    let want = 17.25e-6 * 1024.0 + 5.75e-3;
    assert!((d.estimated_ttft_s - want).abs() < 1e-12);
    // Nothing queued there: all of it is the request's own prefill.
    assert_eq!(d.estimated_queue_wait_s, 0.0);
    // With the charge: pressure 3 requests / 2 replicas = 1.5, less the 1.0 the fleet absorbs,
    // prices the move at 0.5 · 1,023 · 17.25 µs = 8.8 ms, so replica 0 (24.8 ms) beats
    // replica 1 (23.4 + 8.8 ms)…
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!(d.replica, ids[0]);
    // …where 19.0 ms of it is the 1,101 tokens queued ahead.
    assert!((d.estimated_queue_wait_s - 17.25e-6 * 1101.0).abs() < 1e-12, "{}", d.estimated_queue_wait_s);
    // …until its queue outgrows the charge: one more request of 2,000 tokens (pressure 2,
    // charge 17.6 ms) puts replica 0 at 59.3 ms against 23.4 + 17.6 = 41.1 ms.
    load(&mut f, ids[0], 1, 2000);
    assert_eq!(decide(&mut f, &mut p, &toks).replica, ids[1]);
    // With spare capacity (pressure at or under the floor) nothing is charged.
    let (mut g, gids) = fleet(2);
    hold(&mut g, gids[0], &toks, 64, 1.0);
    load(&mut g, gids[0], 1, 1101);
    assert_eq!(decide(&mut g, &mut p, &toks).replica, gids[1]);
}

/// A policy that always picks `self.0`: to read the shared estimate for one replica.
#[derive(Debug)]
struct Fixed(ReplicaId);

impl Policy for Fixed {
    fn name(&self) -> &'static str {
        "fixed"
    }
    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, _: &mut dyn RngCore) -> Result<Decision, Error> {
        let i = view.replicas.iter().position(|x| x.id == self.0).unwrap();
        Ok(Decision::at(view, req, i, Reason::Rotation))
    }
}

#[test]
fn token_load_overlap_credit_fades_only_once_the_replica_serves_silently() {
    let (mut f, ids) = fleet(2);
    let toks = tokens(10, 64 * BS);
    hold(&mut f, ids[0], &toks, 64, 0.0);
    // Greedy, to see the credit alone.
    let mut p = TokenLoadPolicy::new(TokenLoadParams { move_weight: 0.0, ..TokenLoadParams::default() });
    let req = RouteRequest::new(f.hasher(), &toks, Some(16));
    let uncached_on_0 =
        |f: &mut Fleet, now: f64| f.decide(&mut Fixed(ids[0]), &req, &mut rng(), now).unwrap().uncached_tokens;
    // Idle since its last event: silence proves nothing, full credit even at 1,000 s.
    assert_eq!(uncached_on_0(&mut f, 1000.0), 1);
    // It delivers a first token at 10 s without a new event: from then on the silence counts.
    let spec = BookingSpec { uncached_prefill_tokens: 0, uncached_blocks: 0, expected_output_tokens: 0 };
    let b = f.book(ids[0], spec, 5.0).unwrap();
    f.first_token(b, 10.0).unwrap();
    // Age 30 s: full credit; the cache beats a 600-token queue booked just now.
    assert_eq!(uncached_on_0(&mut f, 30.0), 1);
    load_at(&mut f, ids[0], 1, 600, 30.0);
    assert_eq!(f.decide(&mut p, &req, &mut rng(), 30.0).unwrap().replica, ids[0]);
    // Age 165 s: credit (300 − 165)/270 = 0.5 → 32 of 64 blocks, 512 tokens to compute; with
    // a fresh 600-token queue that is more than replica 1's 1,024.
    assert_eq!(uncached_on_0(&mut f, 165.0), 512);
    load_at(&mut f, ids[0], 1, 600, 165.0);
    assert_eq!(f.decide(&mut p, &req, &mut rng(), 165.0).unwrap().replica, ids[1]);
    // Age 97.5 s: credit 0.75 → 48 blocks cached, 256 tokens.
    assert_eq!(uncached_on_0(&mut f, 97.5), 256);
    // Stale: no credit at all.
    assert_eq!(uncached_on_0(&mut f, 300.0), 1024);
}

#[test]
fn token_load_respects_kv_headroom_as_a_hard_limit() {
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    let small = f.add_replica(ReplicaSpec::new("small", 100)).unwrap();
    let big = f.add_replica(ReplicaSpec::new("big", 10_000)).unwrap();
    load(&mut f, big, 1, 5000);
    let mut p = TokenLoadPolicy::new(TokenLoadParams::default());
    // 96 prompt blocks + 1 output block fit in 100: the idle small replica wins.
    let d = decide(&mut f, &mut p, &tokens(11, 96 * BS));
    assert_eq!(d.replica, small);
    // 100 prompt blocks + 1 output block do not: the loaded big replica is the only fit.
    let d = decide(&mut f, &mut p, &tokens(11, 100 * BS));
    assert_eq!((d.replica, d.reason), (big, Reason::LowestCost));
    // Nothing fits anywhere: lowest TTFT regardless, flagged.
    let d = decide(&mut f, &mut p, &tokens(11, 20_000 * BS));
    assert_eq!(d.reason, Reason::NoKvHeadroom);
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
fn token_load_takes_turns_among_near_equal_replicas() {
    let (mut f, ids) = fleet(3);
    // Short prompts on idle replicas: each routing leaves a booking worth far less than the
    // 1 ms near-equal band, so all three stay near-equal and they take turns, the one routed
    // to longest ago first (round robin's spacing, without its blindness to load).
    let mut p = TokenLoadPolicy::new(TokenLoadParams::default());
    let mut got = Vec::new();
    for s in 0..6 {
        let req = RouteRequest::new(f.hasher(), &tokens(s, 16), Some(1));
        got.push(f.route(&mut p, &req, &mut rng(), 1.0 + s as f64 * 0.001).unwrap().decision.replica);
    }
    assert_eq!(got[3..], got[..3], "a rotation");
    let mut first: Vec<ReplicaId> = got[..3].to_vec();
    first.sort();
    assert_eq!(first, ids);
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
    assert!(err(p(PolicyKind::ConsistentHash, &[("load_factor", 0.0)])).contains("load_factor must be within 1..=100"));
    assert!(err(p(PolicyKind::RoundRobin, &[("x", 1.0)])).contains("policy round_robin has no parameter \"x\""));
    assert_eq!(p(PolicyKind::RoundRobin, &[]).unwrap().name(), "round_robin");
}
