//! Unit tests of `bookings`.

use super::*;
use proptest::prelude::*;

fn spec(uncached: u32, blocks: u32, out: u32) -> BookingSpec {
    BookingSpec {
        uncached_prefill_tokens: uncached,
        uncached_blocks: blocks,
        expected_output_tokens: out,
        reports_first_token: true,
        output_key: None,
        reestimate_up_to: None,
    }
}

#[test]
fn decoding_bookings_are_re_expected_as_they_run_and_release_to_zero() {
    let mut b = Bookings::new(600.0, 16).unwrap();
    for n in [100, 100, 100, 1000] {
        b.outputs.observe_keyed(Some(1), n);
    }
    let r = ReplicaId(0);
    let learned = BookingSpec { output_key: Some(1), reestimate_up_to: Some(8192), ..spec(32, 2, 8192) };
    let id = b.book(r, learned, 0.0);
    let fixed = b.book(r, spec(32, 2, 300), 0.0);
    let step = |_: usize| 0.01;
    // Before its first token nothing is re-estimated: 2 + 512 and 2 + 19 blocks.
    b.refresh_outputs(1.0, step);
    assert_eq!((b.load(r).expected_decode_tokens, b.load(r).kv_blocks), (8192 + 300, 514 + 21));
    b.first_token(id, 1.0).unwrap();
    b.first_token(fixed, 1.0).unwrap();
    // 200 tokens in (2 s at 10 ms a step): only the 1,000 of its key's lengths lies beyond,
    // its bucket's middle 2^(39.5/4) ≈ 939 tokens: 2 + 59 blocks.
    b.refresh_outputs(3.0, step);
    assert_eq!((b.load(r).expected_decode_tokens, b.load(r).kv_blocks), (939 + 300, 61 + 21));
    // 2,000 in: past every length seen, 1.25 × 2,000.
    b.refresh_outputs(21.0, step);
    assert_eq!((b.load(r).expected_decode_tokens, b.load(r).kv_blocks), (2500 + 300, 159 + 21));
    assert_eq!(b.get(id).unwrap().spec.expected_output_tokens, 2500);
    b.release(id, Some(2100)).unwrap();
    b.release(fixed, Some(300)).unwrap();
    assert_eq!(b.load(r), TokenLoad::default());
}

#[test]
fn lifecycle_moves_load_from_prefill_to_decode_to_zero() {
    let mut b = Bookings::new(60.0, 16).unwrap();
    let r = ReplicaId(2);
    let id = b.book(r, spec(1000, 70, 100), 0.0);
    let want = TokenLoad {
        queued_prefill_tokens: 1000,
        prefilling: 1,
        decoding: 0,
        expected_decode_tokens: 100,
        kv_blocks: 77,
        prompt_blocks: 70,
        prefill_busy_until: 1000.0 * 17.25e-6,
        unstarted_tokens: 0,
    };
    assert_eq!(b.load(r), want);
    b.first_token(id, 0.5).unwrap();
    let decoding = TokenLoad {
        queued_prefill_tokens: 0,
        prefilling: 0,
        decoding: 1,
        prefill_busy_until: 0.0,
        unstarted_tokens: 0,
        ..want
    };
    assert_eq!(b.load(r), decoding);
    assert_eq!(b.get(id).unwrap().lease_until, 60.5);
    b.release(id, Some(90)).unwrap();
    assert_eq!(b.load(r), TokenLoad::default());
    assert_eq!(b.release(id, None), Err(Error::UnknownBooking(0)));
    assert_eq!(b.outputs().expect(None), 90);
}

#[test]
fn queued_prefill_drains_at_the_prefill_rate() {
    let mut b = Bookings::new(60.0, 16).unwrap();
    let r = ReplicaId(0);
    b.set_prefill_rate(r, 1e-3);
    b.book(r, spec(1000, 0, 0), 10.0); // virtually done at 11.0
    let c = b.book(r, spec(500, 0, 0), 10.5); // queued behind: done at 11.5
    let l = b.load(r);
    assert_eq!(l.queued_prefill_at(10.0, 1e-3), 1500);
    assert_eq!(l.queued_prefill_at(11.0, 1e-3), 500);
    // No first token by 12.0: the second request cannot have started (first come, first
    // served), so its 500 tokens stay queued however the virtual clock runs.
    assert_eq!(l.queued_prefill_at(12.0, 1e-3), 500);
    // A first token takes its tokens out of the held count; the virtual clock stays, and
    // the smaller of the two counts: 900 tokens of virtual work are left at 10.6.
    b.first_token(c, 10.6).unwrap();
    assert_eq!(b.load(r).queued_prefill_tokens, 1000);
    assert_eq!(b.load(r).queued_prefill_at(10.6, 1e-3), 900);
    assert_eq!(b.prefill_rate(r), 1e-3);
    assert_eq!(b.prefill_rate(ReplicaId(9)), 17.25e-6);
    // Summed over replicas, each at its own rate: 200 tokens at 2 ms each on replica 1,
    // half done at 10.8.
    let s = ReplicaId(1);
    b.set_prefill_rate(s, 2e-3);
    b.book(s, spec(200, 0, 0), 10.6);
    assert_eq!(b.queued_prefill_at(10.8), 700 + 100);
}

#[test]
fn leases_end_lost_bookings() {
    let mut b = Bookings::new(10.0, 16).unwrap();
    let a = b.book(ReplicaId(0), spec(5, 1, 1), 0.0);
    let c = b.book(ReplicaId(1), spec(5, 1, 1), 4.0);
    b.first_token(c, 9.0).unwrap();
    assert_eq!(b.expire(9.99), vec![]);
    assert_eq!(b.expire(10.0), vec![a]);
    assert_eq!(b.expire(18.99), vec![]);
    assert_eq!(b.expire(19.0), vec![c]);
    assert!(b.is_empty());
    assert_eq!(b.loads(), &[TokenLoad::default(), TokenLoad::default()]);
}

#[test]
fn bad_config_is_an_error() {
    assert!(Bookings::new(0.0, 16).is_err());
    assert_eq!(Bookings::new(1.0, 0).unwrap_err(), Error::ZeroBlockSize);
}

#[derive(Debug, Clone)]
enum Step {
    Book(u32, u32),
    First(usize),
    Release(usize),
    Lose(usize),
    Tick(u8),
}

proptest! {
    /// Random lifecycles where some releases are lost: once every lease has run out, every
    /// replica's load is exactly zero and nothing is live.
    #[test]
    fn no_booking_leaks(steps in prop::collection::vec(prop_oneof![
        3 => (0..4u32, 0..5000u32).prop_map(|(r, t)| Step::Book(r, t)),
        2 => (0..64usize).prop_map(Step::First),
        2 => (0..64usize).prop_map(Step::Release),
        1 => (0..64usize).prop_map(Step::Lose),
        1 => (0..30u8).prop_map(Step::Tick),
    ], 1..200)) {
        let mut b = Bookings::new(30.0, 16).unwrap();
        let mut ids: Vec<BookingId> = Vec::new();
        let mut now = 0.0;
        for s in steps {
            match s {
                Step::Book(r, t) => ids.push(b.book(ReplicaId(r), spec(t, t / 16, 64), now)),
                Step::First(i) if !ids.is_empty() => { let _ = b.first_token(ids[i % ids.len()], now); }
                Step::Release(i) if !ids.is_empty() => { let _ = b.release(ids.remove(i % ids.len()), Some(10)); }
                Step::Lose(i) if !ids.is_empty() => { ids.remove(i % ids.len()); }
                Step::Tick(dt) => { now += dt as f64; b.expire(now); }
                _ => {}
            }
            let total: u64 = b.loads().iter().map(|l| l.outstanding() as u64).sum();
            prop_assert_eq!(total, b.len() as u64);
        }
        b.expire(now + 30.0);
        prop_assert!(b.is_empty());
        for l in b.loads() {
            prop_assert_eq!(*l, TokenLoad::default());
        }
    }
}
