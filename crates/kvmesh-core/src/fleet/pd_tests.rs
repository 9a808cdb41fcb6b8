//! Disaggregated routing: which replicas each side considers, the decode side's KV limit and
//! cost, and both bookings.

use super::*;
use crate::fleet::{FleetConfig, ReplicaSpec, ReplicaStatus};
use crate::policy::PolicyKind;
use rand::rngs::SmallRng;
use rand::SeedableRng;

fn spec(name: &str, role: Role, capacity_blocks: u64) -> ReplicaSpec {
    ReplicaSpec { role, ..ReplicaSpec::new(name, capacity_blocks) }
}

/// A fleet of one whole replica `w`, prefill replicas `p0`, `p1` and decode replicas `d0`,
/// `d1` (10,000 blocks each unless `small_d0`: then d0 holds 20).
fn fleet(small_d0: bool) -> (Fleet, [ReplicaId; 5]) {
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    let w = f.add_replica(spec("w", Role::Both, 10_000)).unwrap();
    let p0 = f.add_replica(spec("p0", Role::Prefill, 10_000)).unwrap();
    let p1 = f.add_replica(spec("p1", Role::Prefill, 10_000)).unwrap();
    let d0 = f.add_replica(spec("d0", Role::Decode, if small_d0 { 20 } else { 10_000 })).unwrap();
    let d1 = f.add_replica(spec("d1", Role::Decode, 10_000)).unwrap();
    (f, [w, p0, p1, d0, d1])
}

fn toks(n: u32) -> Vec<u32> {
    (0..n).collect()
}

#[test]
fn a_model_is_disaggregated_while_both_sides_have_a_routable_replica() {
    let (mut f, [w, p0, p1, d0, d1]) = fleet(false);
    assert!(f.disaggregated(None, None));
    let mut p = PolicyKind::TokenLoad.build();
    let req = RouteRequest::new(f.hasher(), &toks(64), Some(8));
    // A whole request goes to the whole replica only, however often it is decided.
    for s in 0..20 {
        let d = f.decide(p.as_mut(), &req, &mut SmallRng::seed_from_u64(s), 0.0).unwrap();
        assert_eq!(d.replica, w);
    }
    // A subset without a decode replica (a gateway's, or a retry's exclusions): served whole.
    assert!(!f.disaggregated(None, Some(&[w, p0, p1])));
    assert!(f.disaggregated(None, Some(&[p0, d1])));
    f.set_status(d0, ReplicaStatus::Draining).unwrap();
    assert!(f.disaggregated(None, None));
    f.set_status(d1, ReplicaStatus::Draining).unwrap();
    assert!(!f.disaggregated(None, None));
    assert!(!f.disaggregated(Some(crate::ModelKey::of("other")), None));
    assert_eq!(f.decide_pd(p.as_mut(), &req, None, &mut SmallRng::seed_from_u64(1), 0.0), Err(Error::NoReplicaReady));
}

#[test]
fn prefill_goes_where_the_prefix_is_and_decode_where_fewer_sequences_run() {
    let (mut f, [_, p0, p1, d0, d1]) = fleet(false);
    let prompt = toks(640);
    // p1 holds the prompt's first 32 blocks; d0 carries three decoding requests.
    f.apply_event(p1, &crate::fleet::tests::stored(&prompt[..512], 100), 0.0).unwrap();
    let mut p = PolicyKind::TokenLoad.build();
    for k in 0..3 {
        let other = RouteRequest::new(f.hasher(), &toks(100 + k), Some(100));
        let b = f.book_decision(p.as_mut(), &other, Decision { replica: d0, ..decision_on(d0) }, 0.0).unwrap();
        f.first_token(b.booking, 0.0).unwrap();
    }
    let req = RouteRequest::new(f.hasher(), &prompt, Some(200));
    let d = f.decide_pd(p.as_mut(), &req, None, &mut SmallRng::seed_from_u64(7), 0.0).unwrap();
    assert_eq!((d.prefill.replica, d.prefill.overlap_blocks, d.prefill.uncached_tokens), (p1, 32, 128));
    assert_ne!(d.prefill.replica, p0);
    assert_eq!(d.decode.replica, d1);
    assert_eq!((d.decode.uncached_tokens, d.decode.uncached_blocks, d.decode.overlap_blocks), (0, 40, 0));
    assert_eq!(d.decode.reason, Reason::LowestCost);
    // Idle d1: one step of a batch of one, β0 + β2 = 5.75 ms + 6 µs; nothing to wait for.
    assert!((d.decode.estimated_ttft_s - (5.75e-3 + 6.0e-6)).abs() < 1e-12, "{}", d.decode.estimated_ttft_s);
    assert_eq!(d.decode.estimated_queue_wait_s, 0.0);
}

/// A decision on `replica` booking nothing of a prompt: for setting up decode load.
fn decision_on(replica: ReplicaId) -> Decision {
    Decision {
        replica,
        reason: Reason::LowestCost,
        overlap_blocks: 0,
        uncached_tokens: 0,
        uncached_blocks: 1,
        estimated_ttft_s: 0.0,
        estimated_queue_wait_s: 0.0,
    }
}

#[test]
fn kv_headroom_on_the_decode_side_is_a_hard_limit() {
    // d0 is idle but holds 20 blocks; the request needs 40 prompt blocks and 13 output blocks.
    let (mut f, [_, _, _, d0, d1]) = fleet(true);
    let mut p = PolicyKind::TokenLoad.build();
    for k in 0..5 {
        let other = RouteRequest::new(f.hasher(), &toks(100 + k), Some(100));
        f.book_decision(p.as_mut(), &other, decision_on(d1), 0.0).unwrap();
    }
    let req = RouteRequest::new(f.hasher(), &toks(640), Some(200));
    for s in 0..10 {
        let d = f.decide_pd(p.as_mut(), &req, None, &mut SmallRng::seed_from_u64(s), 0.0).unwrap();
        assert_eq!((d.decode.replica, d.decode.reason), (d1, Reason::LowestCost));
    }
    // With d1 draining only d0 is left: it does not fit, and says so.
    f.set_status(d1, ReplicaStatus::Draining).unwrap();
    let d = f.decide_pd(p.as_mut(), &req, None, &mut SmallRng::seed_from_u64(1), 0.0).unwrap();
    assert_eq!((d.decode.replica, d.decode.reason), (d0, Reason::NoKvHeadroom));
    assert!(f.capacity_short(&d.decode));
}

#[test]
fn both_sides_are_booked_and_released_apart() {
    let (mut f, [_, p0, p1, d0, d1]) = fleet(false);
    let mut p = PolicyKind::TokenLoad.build();
    let req = RouteRequest::new(f.hasher(), &toks(640), Some(200));
    let d = f.decide_pd(p.as_mut(), &req, None, &mut SmallRng::seed_from_u64(3), 0.0).unwrap();
    let r = f.book_pd(p.as_mut(), &req, d, 0.0).unwrap();
    let (pre, dec) = (f.bookings().load(d.prefill.replica), f.bookings().load(d.decode.replica));
    // The prefill leg: the whole uncached prompt, its 40 blocks, one output token.
    assert_eq!((pre.queued_prefill_tokens, pre.prompt_blocks, pre.expected_decode_tokens), (640, 40, 1));
    // The decode side: no prefill, the 40 received blocks and the request's 200 tokens.
    assert_eq!((dec.queued_prefill_tokens, dec.prompt_blocks, dec.expected_decode_tokens), (0, 40, 200));
    assert_eq!(dec.kv_blocks, 40 + 13);
    f.release(r.prefill.booking, None).unwrap();
    assert_eq!(f.bookings().load(d.prefill.replica).outstanding(), 0);
    assert_eq!(f.bookings().load(d.decode.replica).outstanding(), 1);
    f.release(r.decode.booking, Some(180)).unwrap();
    assert!(f.bookings().is_empty());
    for id in [p0, p1, d0, d1] {
        assert_eq!(f.bookings().load(id).kv_blocks, 0);
    }
    // A decode replica gone between decision and booking: nothing stays booked.
    let d = f.decide_pd(p.as_mut(), &req, None, &mut SmallRng::seed_from_u64(3), 1.0).unwrap();
    f.remove_replica(d.decode.replica).unwrap();
    assert_eq!(f.book_pd(p.as_mut(), &req, d, 1.0), Err(Error::UnknownReplica(d.decode.replica)));
    assert!(f.bookings().is_empty());
}

#[test]
fn equal_decode_replicas_are_chosen_at_random() {
    // Case C10: ties never go to the first replica.
    let (mut f, [_, _, _, d0, d1]) = fleet(false);
    let mut p = PolicyKind::TokenLoad.build();
    let req = RouteRequest::new(f.hasher(), &toks(64), Some(8));
    let mut seen = [0u32; 2];
    for s in 0..40 {
        let d = f.decide_pd(p.as_mut(), &req, None, &mut SmallRng::seed_from_u64(s), 0.0).unwrap();
        seen[usize::from(d.decode.replica == d1)] += 1;
        assert!(d.decode.replica == d0 || d.decode.replica == d1);
    }
    assert!(seen[0] > 5 && seen[1] > 5, "{seen:?}");
}

#[test]
fn a_hash_ring_per_side_owns_every_key_on_that_side() {
    // The vLLM router keeps one worker list per side: no key owned by the other side's
    // replicas spills onto the first routable one.
    let (mut f, [_, p0, p1, d0, d1]) = fleet(false);
    let (mut pre, mut dec) = (PolicyKind::ConsistentHash.build(), PolicyKind::ConsistentHash.build());
    let mut rng = SmallRng::seed_from_u64(1);
    let mut seen = [0u32; 4];
    for k in 0..64 {
        let req = RouteRequest::new(f.hasher(), &toks(40 + k), Some(8));
        let p = f.decide_role(Role::Prefill, pre.as_mut(), &req.prefill_leg(), None, &mut rng, 0.0).unwrap();
        let d = f.decide_role(Role::Decode, dec.as_mut(), &req, None, &mut rng, 0.0).unwrap();
        assert_eq!((p.reason, d.reason), (Reason::RingOwner, Reason::RingOwner), "key {k}");
        for (i, id) in [p0, p1, d0, d1].into_iter().enumerate() {
            seen[i] += u32::from(p.replica == id || d.replica == id);
        }
    }
    assert!(seen.iter().all(|&n| n >= 16), "every replica owns keys: {seen:?}");
    assert_eq!(seen.iter().sum::<u32>(), 128);
}
