//! Decisions within a subset, and several models on one fleet (block sizes, namespaces).

use super::*;

/// A gateway's endpoint subset: every policy picks inside it, and an empty or unroutable
/// subset is `NoReplicaReady` even with other replicas free.
#[test]
fn a_decision_within_a_subset_picks_only_from_it() {
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    let ids: Vec<ReplicaId> = ["a", "b", "c"].into_iter().map(|n| f.add_replica(silent(n)).unwrap()).collect();
    let req = RouteRequest::new(f.hasher(), &toks(64), Some(16));
    for kind in [PolicyKind::TokenLoad, PolicyKind::ConsistentHash, PolicyKind::RoundRobin] {
        let mut p = kind.build();
        for k in 0..6 {
            let only = [ids[2]];
            let d = f.decide_within(p.as_mut(), &req, Some(&only), &mut rng(), k as f64).unwrap();
            assert_eq!(d.replica, ids[2], "{kind:?}");
        }
        let none = f.decide_within(p.as_mut(), &req, Some(&[]), &mut rng(), 7.0);
        assert_eq!(none.unwrap_err(), Error::NoReplicaReady, "{kind:?}");
        // Unrestricted, six different prompts booked at once spread over more than one replica.
        let mut seen = std::collections::BTreeSet::new();
        let mut booked = Vec::new();
        for k in 0..6u32 {
            let other = RouteRequest::new(f.hasher(), &(k * 1000..k * 1000 + 64).collect::<Vec<u32>>(), Some(16));
            let r = f.route(p.as_mut(), &other, &mut rng(), 10.0 + k as f64).unwrap();
            seen.insert(r.decision.replica);
            booked.push(r.booking);
        }
        if kind != PolicyKind::ConsistentHash {
            assert!(seen.len() > 1, "{kind:?}: {seen:?}");
        }
        for b in booked {
            f.release(b, Some(16)).unwrap();
        }
    }
}

#[test]
fn a_model_may_have_its_own_block_size() {
    // m1 (the namespace model) in 16-token blocks; m2's engines in 32-token blocks.
    let ns = Namespace { model: "m1".into(), ..Namespace::default() };
    let mut f = Fleet::new(FleetConfig { namespace: ns, ..FleetConfig::default() }).unwrap();
    let spec =
        |name: &str, m: &str, bs: u32| ReplicaSpec { model: m.into(), block_size: bs, ..ReplicaSpec::new(name, 1_000) };
    let a = f.add_replica(spec("a", "m1", 0)).unwrap();
    let c = f.add_replica(spec("c", "m2", 32)).unwrap();
    let d = f.add_replica(spec("d", "m2", 0)).unwrap();
    assert_eq!((f.hasher_for("m2").block_size(), f.block_size_of(Some(ModelKey::of("m2")))), (32, 32));
    assert_eq!(f.block_size_of(Some(ModelKey::of("m1"))), 16);
    // One block size per model, and the namespace model's is the fleet's.
    let err = f.add_replica(spec("e", "m2", 16)).unwrap_err().to_string();
    assert!(err.contains("replica \"e\" has 16-token blocks, but its model's replicas have 32-token blocks"), "{err}");
    assert!(f.add_replica(spec("g", "m1", 32)).is_err());
    // c's 32-token events are indexed; the same 16-token event is refused as a mismatch.
    let t = toks(128);
    let in32 = KvEvent::Stored(Stored {
        block_hashes: (0..4).map(|k| EngineBlockHash(500 + k)).collect(),
        parent: None,
        token_ids: t.clone(),
        block_size: 32,
        medium: Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        kv_group: None,
    });
    assert_eq!(f.apply_event(c, &in32, 0.0).unwrap().stored, 4);
    assert!(f.apply_event(d, &stored(&t, 900), 0.0).unwrap().rejection.is_some());
    assert!(f.apply_event(a, &stored(&t, 100), 0.0).unwrap().rejection.is_none());
    // An m2 request: 4 blocks of 32 held on c, and its KV counted in 32-token blocks.
    let mut p = PolicyKind::TokenLoad.build();
    let m2 = RouteRequest::new(&f.hasher_for("m2"), &toks(160), Some(64));
    let routed = f.route(p.as_mut(), &m2, &mut rng(), 1.0).unwrap();
    let dec = &routed.decision;
    assert_eq!((dec.replica, dec.overlap_blocks, dec.uncached_tokens, dec.uncached_blocks), (c, 4, 32, 1));
    assert_eq!(f.bookings().load(c).kv_blocks, 1 + 2, "1 prompt block and 64 output tokens in 32-token blocks");
    // An m1 request of the same tokens: 8 blocks of 16 on a.
    let m1 = RouteRequest::new(f.hasher(), &toks(160), Some(64));
    let one = f.decide(p.as_mut(), &m1, &mut rng(), 1.0).unwrap();
    assert_eq!((one.replica, one.overlap_blocks, one.uncached_tokens), (a, 8, 32));
    // What fits nowhere counts in the model's blocks: 1,000 blocks of 32 tokens.
    assert!(f.fits_nowhere_for(Some(ModelKey::of("m2")), 31_000, Some(900)).is_none());
    assert_eq!(f.fits_nowhere_for(Some(ModelKey::of("m2")), 32_000, Some(100)).unwrap().block_size, 32);
    // Its last replica gone, m2 may come back in 16-token blocks.
    f.remove_replica(c).unwrap();
    assert_eq!(f.block_size_of(Some(ModelKey::of("m2"))), 32, "d is still there");
    f.remove_replica(d).unwrap();
    let h = f.add_replica(spec("h", "m2", 16)).unwrap();
    assert_eq!((f.block_size_of(Some(ModelKey::of("m2"))), f.hasher_for("m2").block_size()), (16, 16));
    assert!(f.apply_event(h, &stored(&t, 700), 3.0).unwrap().rejection.is_none());
}

#[test]
fn each_model_is_its_own_namespace_and_candidate_set() {
    let ns = Namespace { model: "m1".into(), ..Namespace::default() };
    let mut f = Fleet::new(FleetConfig { namespace: ns, ..FleetConfig::default() }).unwrap();
    let model = |name: &str, m: &str| ReplicaSpec { model: m.into(), ..ReplicaSpec::new(name, 10_000) };
    let a = f.add_replica(model("a", "")).unwrap();
    let b = f.add_replica(model("b", "m1")).unwrap();
    let c = f.add_replica(model("c", "m2")).unwrap();
    let d = f.add_replica(model("d", "m2")).unwrap();
    assert_eq!(f.hasher_for(""), *f.hasher());
    assert_eq!(f.hasher_for("m1"), *f.hasher());
    assert_ne!(f.hasher_for("m2").seed(), f.hasher().seed());
    assert_eq!(f.replica(a).unwrap().model, f.replica(b).unwrap().model);
    assert_eq!(f.replica(c).unwrap().model, ModelKey::of("m2"));
    // The same 64 tokens cached on c (an m2 replica) and later on a (m1).
    let t = toks(64);
    f.apply_event(c, &stored(&t, 100), 0.0).unwrap();
    let mut p = PolicyKind::TokenLoad.build();
    let m1 = RouteRequest::new(f.hasher(), &t, Some(1));
    let m2 = RouteRequest::new(&f.hasher_for("m2"), &t, Some(1));
    assert_eq!(m2.model, Some(ModelKey::of("m2")));
    // m2's blocks are no overlap for m1, and m1's request never goes to an m2 replica.
    let one = f.decide(p.as_mut(), &m1, &mut rng(), 1.0).unwrap();
    assert_eq!(one.overlap_blocks, 0);
    assert!([a, b].contains(&one.replica), "{one:?}");
    let two = f.decide(p.as_mut(), &m2, &mut rng(), 1.0).unwrap();
    assert_eq!((two.replica, two.overlap_blocks), (c, 4));
    f.apply_event(a, &stored(&t, 200), 2.0).unwrap();
    let one = f.decide(p.as_mut(), &m1, &mut rng(), 3.0).unwrap();
    assert_eq!((one.replica, one.overlap_blocks), (a, 4));
    let two = f.decide(p.as_mut(), &m2, &mut rng(), 3.0).unwrap();
    assert_eq!((two.replica, two.overlap_blocks), (c, 4));
    // Every policy keeps to the model's replicas, load or not.
    for kind in PolicyKind::ALL {
        let mut p = kind.build();
        for k in 0..40u32 {
            let tokens: Vec<u32> = (k * 1000..k * 1000 + 48).collect();
            let r1 = f.route(p.as_mut(), &RouteRequest::new(f.hasher(), &tokens, Some(8)), &mut rng(), 4.0).unwrap();
            let r2 = f.route(p.as_mut(), &RouteRequest::new(&f.hasher_for("m2"), &tokens, Some(8)), &mut rng(), 4.0);
            let r2 = r2.unwrap();
            assert!([a, b].contains(&r1.decision.replica), "{kind:?} sent m1 to {:?}", r1.decision.replica);
            assert!([c, d].contains(&r2.decision.replica), "{kind:?} sent m2 to {:?}", r2.decision.replica);
        }
    }
    // A request of any model (a gateway's request without a body) may go anywhere.
    let any = RouteRequest { model: Some(ModelKey::ANY), ..RouteRequest::new(f.hasher(), &toks(16), Some(1)) };
    let mut seen = std::collections::BTreeSet::new();
    let mut rr = PolicyKind::RoundRobin.build();
    for _ in 0..8 {
        seen.insert(f.decide(rr.as_mut(), &any, &mut rng(), 4.5).unwrap().replica);
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), [a, b, c, d]);
    // What fits nowhere is judged among the model's own replicas.
    let mut g = Fleet::new(FleetConfig::default()).unwrap();
    g.add_replica(ReplicaSpec { model: "big".into(), ..ReplicaSpec::new("x", 1_000) }).unwrap();
    g.add_replica(ReplicaSpec::new("y", 100)).unwrap();
    assert_eq!(g.fits_nowhere(3_200, None), None, "the big model's replica holds 200 blocks");
    let small = g.fits_nowhere_for(Some(g.hasher().model()), 3_200, None).unwrap();
    assert_eq!((small.needed_blocks, small.largest_blocks), (200, 100));
    assert_eq!(g.fits_nowhere_for(Some(ModelKey::of("big")), 3_200, None), None);
    // A model nobody serves has no replica ready; draining m2's replicas leaves m2 none.
    let m3 = RouteRequest::new(&f.hasher_for("m3"), &t, Some(1));
    assert_eq!(f.decide(p.as_mut(), &m3, &mut rng(), 5.0), Err(Error::NoReplicaReady));
    f.set_status(c, ReplicaStatus::Draining).unwrap();
    f.set_status(d, ReplicaStatus::Draining).unwrap();
    assert_eq!(f.decide(p.as_mut(), &m2, &mut rng(), 5.0), Err(Error::NoReplicaReady));
    assert!(f.decide(p.as_mut(), &m1, &mut rng(), 5.0).is_ok());
}
