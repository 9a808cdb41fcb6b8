use super::*;
use crate::fleet::{Fleet, FleetConfig, ReplicaSpec};
use crate::ids::{BlockHash, ReplicaId};
use proptest::prelude::*;

fn fleet() -> Fleet {
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    f.add_replica(ReplicaSpec::new("a", 1000)).unwrap();
    f.add_replica(ReplicaSpec::new("b", 1000)).unwrap();
    f
}

fn spec(prefill: u32) -> BookingSpec {
    BookingSpec {
        uncached_prefill_tokens: prefill,
        uncached_blocks: prefill / 16,
        expected_output_tokens: 100,
        reports_first_token: true,
        output_key: None,
        reestimate_up_to: None,
    }
}

fn queued(f: &Fleet, r: u32) -> (u64, u32, u32) {
    let l = f.bookings().load(ReplicaId(r));
    (l.queued_prefill_tokens, l.prefilling, l.decoding)
}

const PEER: NodeId = NodeId(7);

#[test]
fn a_peer_booking_adds_its_load_until_released() {
    let mut out = Outbox::new(64, 1000);
    out.book(1, "b", spec(512), &[BlockHash(11), BlockHash(12)], 0.0);
    let mut f = fleet();
    let mut remote = RemoteBookings::new(60.0);
    let s = remote.apply(&mut f, PEER, &out.take(), 1.0);
    assert_eq!(s, MergeStats { booked: 1, ..Default::default() });
    assert_eq!(queued(&f, 1), (512, 1, 0));
    assert_eq!(queued(&f, 0), (0, 0, 0));
    // The prefix it was routed for is pending on b for this node's policies too.
    assert_eq!(f.record().replica_blocks(ReplicaId(1)), 1, "the prompt's last block (stride 8)");
    out.first_token(1, 0.0);
    remote.apply(&mut f, PEER, &out.take(), 1.5);
    assert_eq!(queued(&f, 1), (0, 0, 1));
    out.release(1, Some(90), 0.0);
    let s = remote.apply(&mut f, PEER, &out.take(), 2.0);
    assert_eq!(s.released, 1);
    assert_eq!(queued(&f, 1), (0, 0, 0));
    assert_eq!(remote.live(PEER), 0);
}

#[test]
fn a_peer_booking_counts_from_its_decision_not_its_arrival() {
    let mut out = Outbox::new(64, 1000);
    out.book(1, "b", spec(512), &[BlockHash(11), BlockHash(12)], 3.0);
    let mut f = fleet();
    let ttl = f.record().ttl();
    let mut remote = RemoteBookings::new(60.0);
    // The batch waited (a paused sender) past the record's lifetime: its prefix is stale
    // on arrival and earns no credit, though its load counts while it lives.
    let late = 3.0 + ttl + 1.0;
    remote.apply(&mut f, PEER, &out.take(), late);
    f.expire(late);
    assert_eq!(f.record().replica_blocks(ReplicaId(1)), 0);
    assert_eq!(remote.live(PEER), 1);
    // Delivered in time, the same booking's prefix is credited from its decision on.
    let mut out = Outbox::new(64, 1000);
    out.book(2, "b", spec(512), &[BlockHash(11), BlockHash(12)], 3.0);
    let mut f = fleet();
    remote.apply(&mut f, NodeId(8), &out.take(), 4.0);
    f.expire(3.0 + ttl - 0.5);
    assert_eq!(f.record().replica_blocks(ReplicaId(1)), 1);
    f.expire(3.0 + ttl);
    assert_eq!(f.record().replica_blocks(ReplicaId(1)), 0, "gone ttl after the decision, not the arrival");
    // A delta timed after its arrival (clocks are per node; the wire carries ages, but a
    // summary or a bad peer might not): never later than the arrival.
    let mut out = Outbox::new(64, 1000);
    out.book(3, "a", spec(512), &[BlockHash(21)], 50.0);
    remote.apply(&mut f, NodeId(9), &out.take(), 10.0);
    f.expire(10.0 + ttl);
    assert_eq!(f.record().replica_blocks(ReplicaId(0)), 0);
}

#[test]
fn duplicates_change_nothing() {
    let mut out = Outbox::new(64, 1000);
    out.book(1, "a", spec(100), &[], 0.0);
    out.first_token(1, 0.0);
    out.first_token(1, 0.0); // a second first token is not sent twice
    let batch = out.take();
    assert_eq!(batch.iter().map(|d| d.seq).collect::<Vec<_>>(), vec![1, 2]);
    let mut f = fleet();
    let mut remote = RemoteBookings::new(60.0);
    remote.apply(&mut f, PEER, &batch, 1.0);
    let again = remote.apply(&mut f, PEER, &batch, 1.1);
    assert_eq!(again, MergeStats { ignored: 2, ..Default::default() });
    assert_eq!(queued(&f, 0), (0, 0, 1));
    assert_eq!(f.bookings().len(), 1);
}

#[test]
fn a_release_that_overtakes_its_book_wins() {
    let mut out = Outbox::new(64, 1000);
    out.book(5, "a", spec(300), &[], 0.0);
    out.release(5, None, 0.0);
    let mut batch = out.take();
    batch.reverse();
    let mut f = fleet();
    let mut remote = RemoteBookings::new(60.0);
    let s = remote.apply(&mut f, PEER, &batch, 1.0);
    assert_eq!(s, MergeStats { ignored: 2, ..Default::default() });
    assert!(f.bookings().is_empty());
    // The tombstone is forgotten after its time, not before.
    remote.expire(&mut f, 60.5, 100.0);
    assert_eq!(remote.apply(&mut f, PEER, &batch[1..], 60.6).ignored, 1);
    remote.expire(&mut f, 61.5, 100.0);
    assert_eq!(remote.apply(&mut f, PEER, &batch[1..], 61.6).booked, 1);
}

#[test]
fn a_summary_repairs_lost_books_and_releases() {
    let mut out = Outbox::new(64, 1000);
    let mut f = fleet();
    let mut remote = RemoteBookings::new(60.0);
    out.book(1, "a", spec(100), &[], 0.0);
    out.book(2, "b", spec(200), &[], 0.0);
    remote.apply(&mut f, PEER, &out.take(), 1.0);
    // Lost: the release of 1 and the book of 3.
    out.release(1, None, 0.0);
    out.book(3, "a", spec(400), &[], 0.0);
    out.first_token(3, 0.0);
    let _ = out.take();
    let summary = out.summary();
    assert_eq!(summary.seq, 5);
    let s = remote.apply_summary(&mut f, PEER, &summary, 2.0);
    assert_eq!(s, MergeStats { booked: 1, released: 1, first_tokens: 0, ..Default::default() });
    assert_eq!(queued(&f, 0), (0, 0, 1));
    assert_eq!(queued(&f, 1), (200, 1, 0));
    // The same summary again changes nothing.
    assert_eq!(remote.apply_summary(&mut f, PEER, &summary, 2.1), MergeStats::default());
}

#[test]
fn a_summary_keeps_bookings_newer_than_itself() {
    let mut f = fleet();
    let mut remote = RemoteBookings::new(60.0);
    let book = Delta {
        seq: 9,
        booking: 4,
        kind: DeltaKind::Book { replica: "a".into(), spec: spec(64), prefix: vec![] },
        at: 0.0,
    };
    remote.apply(&mut f, PEER, &[book], 1.0);
    // A summary taken before seq 9 does not list booking 4: it must stay.
    let s = remote.apply_summary(&mut f, PEER, &Summary { seq: 8, live: vec![] }, 1.1);
    assert_eq!(s.released, 0);
    assert_eq!(queued(&f, 0), (64, 1, 0));
}

#[test]
fn a_silent_peer_loses_its_bookings() {
    let mut out = Outbox::new(64, 1000);
    out.book(1, "a", spec(100), &[], 0.0);
    out.book(2, "a", spec(100), &[], 0.0);
    let mut f = fleet();
    let mut remote = RemoteBookings::new(60.0);
    remote.apply(&mut f, PEER, &out.take(), 1.0);
    assert!(remote.expire(&mut f, 5.9, 5.0).is_empty());
    assert_eq!(remote.expire(&mut f, 6.1, 5.0), vec![PEER]);
    assert_eq!(queued(&f, 0), (0, 0, 0));
    assert!(f.bookings().is_empty());
}

#[test]
fn unknown_replicas_are_counted_not_booked() {
    let mut out = Outbox::new(64, 1000);
    out.book(1, "zzz", spec(100), &[], 0.0);
    let mut f = fleet();
    let mut remote = RemoteBookings::new(60.0);
    let s = remote.apply(&mut f, PEER, &out.take(), 1.0);
    assert_eq!(s, MergeStats { unknown_replica: 1, ..Default::default() });
    assert!(f.bookings().is_empty());
}

#[test]
fn removing_a_replica_releases_its_bookings_to_peers() {
    let mut out = Outbox::new(64, 1000);
    out.book(1, "a", spec(100), &[], 0.0);
    out.book(2, "b", spec(100), &[], 0.0);
    out.book(3, "a", spec(100), &[], 0.0);
    let _ = out.take();
    assert_eq!(out.release_replica("a", 0.0), 2);
    let kinds: Vec<(u64, bool)> =
        out.take().iter().map(|d| (d.booking, matches!(d.kind, DeltaKind::Release { .. }))).collect();
    assert_eq!(kinds, vec![(1, true), (3, true)]);
    assert_eq!(out.summary().live.iter().map(|e| e.booking).collect::<Vec<_>>(), vec![2]);
}

#[test]
fn the_outbox_caps_prefixes_and_pending_deltas() {
    let mut out = Outbox::new(2, 4);
    out.book(1, "a", spec(1), &[BlockHash(1), BlockHash(2), BlockHash(3)], 0.0);
    match &out.take()[0].kind {
        DeltaKind::Book { prefix, .. } => assert_eq!(prefix, &vec![BlockHash(1), BlockHash(2)]),
        other => panic!("{other:?}"),
    }
    for b in 2..=6 {
        out.book(b, "a", spec(1), &[], 0.0);
    }
    // 5 deltas into room for 4: the oldest two went, the summary still lists all six.
    assert_eq!(out.take_at_most(2).iter().map(|d| d.seq).collect::<Vec<_>>(), vec![4, 5]);
    assert_eq!(out.take_at_most(2).iter().map(|d| d.seq).collect::<Vec<_>>(), vec![6]);
    assert_eq!(out.dropped(), 2);
    assert_eq!(out.summary().live.len(), 6);
}

#[test]
fn a_restarted_peer_starts_over() {
    let mut out = Outbox::new(64, 1000);
    out.book(1, "a", spec(100), &[], 0.0);
    let mut f = fleet();
    let mut remote = RemoteBookings::new(60.0);
    assert!(!remote.observe_incarnation(&mut f, PEER, 111));
    remote.apply(&mut f, PEER, &out.take(), 1.0);
    remote.apply_summary(&mut f, PEER, &out.summary(), 1.1);
    // The new process numbers from 1 again; its first Book must count.
    let mut fresh = Outbox::new(64, 1000);
    fresh.book(1, "b", spec(300), &[], 0.0);
    assert!(!remote.observe_incarnation(&mut f, PEER, 111));
    assert!(remote.observe_incarnation(&mut f, PEER, 222));
    assert_eq!(remote.apply(&mut f, PEER, &fresh.take(), 2.0).booked, 1);
    assert_eq!(queued(&f, 0), (0, 0, 0));
    assert_eq!(queued(&f, 1), (300, 1, 0));
}

proptest! {
    /// Whatever the network does to the deltas (drop, duplicate, reorder), the peer's load
    /// equals the sender's once a summary arrives.
    #[test]
    fn loss_reordering_and_duplicates_converge_after_a_summary(
        ops in proptest::collection::vec((0u8..3, 0u64..12, 1u32..2000, any::<bool>()), 1..80),
        fate in proptest::collection::vec(0u8..4, 80 * 3),
        seed in any::<u64>(),
    ) {
        let mut out = Outbox::new(8, 10_000);
        let mut sent = Vec::new();
        // Booking ids are unique per node: books take the next id, the rest name an earlier one.
        let mut next = 0u64;
        for (op, b, tokens, on_b) in &ops {
            match op {
                0 => {
                    next += 1;
                    out.book(next, if *on_b { "b" } else { "a" }, spec(*tokens), &[BlockHash(next)], 0.0);
                }
                1 => out.first_token(b % (next + 1), 0.0),
                _ => out.release(b % (next + 1), None, 0.0),
            }
            sent.extend(out.take());
        }
        // Fate per delta: 0 lost, 1 delivered, 2 delivered twice, 3 delivered late (reordered).
        let mut now_batch = Vec::new();
        let mut late = Vec::new();
        for (i, d) in sent.iter().enumerate() {
            match fate[i % fate.len()] {
                0 => {}
                1 => now_batch.push(d.clone()),
                2 => { now_batch.push(d.clone()); now_batch.push(d.clone()); }
                _ => late.push(d.clone()),
            }
        }
        let k = if late.is_empty() { 0 } else { (seed as usize) % late.len() };
        late.rotate_left(k);
        let mut f = fleet();
        let mut remote = RemoteBookings::new(1e9);
        remote.apply(&mut f, PEER, &now_batch, 1.0);
        remote.apply_summary(&mut f, PEER, &out.summary(), 2.0);
        remote.apply(&mut f, PEER, &late, 3.0);
        let mut expect = fleet();
        for e in out.summary().live {
            let id = expect.replica_by_name(&e.replica).unwrap().id;
            let bid = expect.book(id, e.spec, 0.0).unwrap();
            if e.first_token { expect.first_token_shared(bid, 0.0).unwrap(); }
        }
        for r in 0..2 {
            let (got, want) = (f.bookings().load(ReplicaId(r)), expect.bookings().load(ReplicaId(r)));
            prop_assert_eq!(got.prefilling, want.prefilling);
            prop_assert_eq!(got.decoding, want.decoding);
            prop_assert_eq!(got.kv_blocks, want.kv_blocks);
            prop_assert_eq!(got.expected_decode_tokens, want.expected_decode_tokens);
        }
        prop_assert_eq!(remote.live(PEER), out.live());
    }
}

/// Case C12 in the core: four routers with the same view decide at once. Each takes the
/// replica at its own rank among the cheapest, so they spread instead of piling on one.
#[test]
fn simultaneous_routers_with_one_view_take_different_replicas() {
    use crate::fleet::RouteRequest;
    use crate::policy::PolicyKind;
    use rand::SeedableRng;
    let fleet = |n: usize| {
        let mut f = Fleet::new(FleetConfig::default()).unwrap();
        for i in 0..n {
            f.add_replica(ReplicaSpec::new(format!("e{i}"), 100_000)).unwrap();
        }
        // One replica already busy: it is never among the four cheapest.
        f.book(ReplicaId(5), spec(8000), 0.0).unwrap();
        f
    };
    let tokens: Vec<u32> = (0..4096).collect();
    let mut picks = Vec::new();
    for rank in 0..4 {
        let mut f = fleet(8);
        f.set_active_peers(3, rank);
        let req = RouteRequest::new(f.hasher(), &tokens, Some(64));
        let mut policy = PolicyKind::TokenLoad.build();
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        picks.push(f.route(policy.as_mut(), &req, &mut rng, 0.0).unwrap().decision.replica.0);
    }
    let mut distinct = picks.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "{picks:?}");
    assert!(!picks.contains(&5), "{picks:?}");
    // Without peers (or with peers unknown) the same view and seed give the same replica to
    // all four: the herd that gossip and ranks prevent.
    let mut alone = Vec::new();
    for _ in 0..4 {
        let mut f = fleet(8);
        let req = RouteRequest::new(f.hasher(), &tokens, Some(64));
        let mut policy = PolicyKind::TokenLoad.build();
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        alone.push(f.route(policy.as_mut(), &req, &mut rng, 0.0).unwrap().decision.replica.0);
    }
    assert!(alone.windows(2).all(|w| w[0] == w[1]), "{alone:?}");
}

#[test]
fn a_silent_peer_is_still_known_by_when_it_was_last_heard() {
    let mut out = Outbox::new(64, 1000);
    out.book(1, "a", spec(100), &[], 0.0);
    let mut f = fleet();
    let mut remote = RemoteBookings::new(60.0);
    assert_eq!(remote.last_heard(PEER), None);
    remote.apply(&mut f, PEER, &out.take(), 2.0);
    assert_eq!(remote.last_heard(PEER), Some(2.0));
    // Silent past the timeout: its bookings go, its last hearing stays.
    assert_eq!(remote.expire(&mut f, 10.0, 5.0), vec![PEER]);
    assert_eq!((remote.live(PEER), remote.last_heard(PEER)), (0, Some(2.0)));
}
