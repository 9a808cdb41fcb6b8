//! `token_load`'s documented behaviour: overlap against queue, the overlap credit's fade, KV
//! headroom as a hard limit, taking turns among near-equal replicas.

use super::*;

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

/// Gives `r` `n` sequences decoding (booked with nothing to prefill, past their first token).
fn decoding(f: &mut Fleet, r: ReplicaId, n: u32) {
    for _ in 0..n {
        let b = f.book(r, booking(0), 1.0).unwrap();
        f.first_token(b, 1.0).unwrap();
    }
}

#[test]
fn token_load_charges_a_move_for_the_decode_time_it_takes_from_others() {
    let (mut f, ids) = fleet(2);
    let toks = tokens(9, 64 * BS); // 1,024 tokens, all cached on replica 0
    hold(&mut f, ids[0], &toks, 64, 1.0);
    // Replica 0: 1,101 tokens queued (24.76 ms to the first token). Replica 1: nothing queued,
    // 4 sequences decoding; the whole prompt to compute, 17.25 µs · 1,024 + 5.75 ms + 4 · 6 µs
    // = 23.44 ms.
    load(&mut f, ids[0], 3, 367);
    decoding(&mut f, ids[1], 4);
    let greedy = TokenLoadParams { move_weight: 0.0, ..TokenLoadParams::default() };
    // The move's 1,023 extra tokens delay each of replica 1's 4 decoding sequences by 17.6 ms:
    // 0.05 of that, 3.53 ms, puts replica 1 at 26.97 ms, more than the 1 ms near-equal band
    // over replica 0's 24.76 ms: the request stays with its cache.
    let d = decide(&mut f, &mut TokenLoadPolicy::new(greedy), &toks);
    assert_eq!((d.replica, d.uncached_tokens), (ids[0], 1));
    assert!((d.estimated_ttft_s - (17.25e-6 * 1102.0 + 5.75e-3)).abs() < 1e-12, "{}", d.estimated_ttft_s);
    // Blind to it (0), the lower TTFT wins.
    let blind = TokenLoadParams { interference_weight: 0.0, ..greedy };
    let d = decide(&mut f, &mut TokenLoadPolicy::new(blind), &toks);
    assert_eq!((d.replica, d.uncached_tokens), (ids[1], 1024));
    assert!(
        (d.estimated_ttft_s - (17.25e-6 * 1024.0 + 5.75e-3 + 4.0 * 6.0e-6)).abs() < 1e-12,
        "{}",
        d.estimated_ttft_s
    );
}

#[test]
fn token_load_charges_no_interference_for_leaving_a_replica_without_kv_room() {
    // The queue and decodes of the test above, but the best-cached replica's engine reports all
    // 64 of its blocks in use: the request (1 uncached block, 1 output block) lacks 2 of them
    // there. Its priced wait for them is small (2 blocks · 1 token · a 24.74 ms step / 64 blocks
    // in use = 0.77 ms, weighted 0.25: 24.96 ms in all), but staying would preempt that
    // replica's own decodes, so the move is not charged for replica 1's: replica 1 wins at
    // 23.44 ms. Charged as above (26.97 ms), it would lose.
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    let full = f.add_replica(ReplicaSpec::new("full", 64)).unwrap();
    let other = f.add_replica(ReplicaSpec::new("other", 10_000)).unwrap();
    let toks = tokens(9, 64 * BS);
    hold(&mut f, full, &toks, 64, 1.0);
    load(&mut f, full, 3, 367);
    f.report_metrics(full, EngineMetrics { running: 0, waiting: 0, kv_usage: 1.0, at: 1.0 }).unwrap();
    decoding(&mut f, other, 4);
    let greedy = TokenLoadParams { move_weight: 0.0, ..TokenLoadParams::default() };
    let req = RouteRequest::new(f.hasher(), &toks, Some(1));
    let mut p = TokenLoadPolicy::new(greedy);
    let d = f.decide(&mut p, &req, &mut rng(), 1.0).unwrap();
    assert_eq!((d.replica, d.uncached_tokens), (other, 1024));
    // With room there (the engine reports none in use), the charge holds the request, as above.
    f.report_metrics(full, EngineMetrics { running: 0, waiting: 0, kv_usage: 0.0, at: 1.0 }).unwrap();
    let d = f.decide(&mut p, &req, &mut rng(), 1.0).unwrap();
    assert_eq!((d.replica, d.uncached_tokens), (full, 1));
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
    let spec = BookingSpec {
        uncached_prefill_tokens: 0,
        uncached_blocks: 0,
        expected_output_tokens: 0,
        reports_first_token: true,
        output_key: None,
        reestimate_up_to: None,
    };
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
fn token_load_prices_a_kv_shortage_as_the_wait_until_room() {
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    let small = f.add_replica(ReplicaSpec::new("small", 100)).unwrap();
    let big = f.add_replica(ReplicaSpec::new("big", 10_000)).unwrap();
    load(&mut f, big, 1, 5000);
    let mut p = TokenLoadPolicy::new(TokenLoadParams::default());
    // 96 prompt blocks + 1 output block fit in 100: the idle small replica wins.
    let d = decide(&mut f, &mut p, &tokens(11, 96 * BS));
    assert_eq!(d.replica, small);
    // 100 + 1 blocks on the empty small replica: 1 block short. Nothing decodes there, so the
    // wait is 1 block · 16 output tokens · 5.75 ms (one step) / 1 block in use = 92 ms, priced
    // at 0.25: 23 ms. Small: 1,600 · 17.25 µs + 5.75 ms + 23 ms = 56.35 ms; big, behind 5,000
    // queued tokens: 6,600 · 17.25 µs + 5.75 ms = 119.6 ms. The short replica still wins…
    let toks = tokens(11, 100 * BS);
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (small, Reason::LowestCost));
    // …where a hard limit (weight 0) sends it behind the queue.
    let mut hard = TokenLoadPolicy::new(TokenLoadParams { kv_wait_weight: 0.0, ..TokenLoadParams::default() });
    assert_eq!(decide(&mut f, &mut hard, &toks).replica, big);
    // With 1,000 blocks short (the wait 1,000 times longer) the queue is the better bet.
    let mut g = Fleet::new(FleetConfig::default()).unwrap();
    let small = g.add_replica(ReplicaSpec::new("small", 100)).unwrap();
    let big = g.add_replica(ReplicaSpec::new("big", 100_000)).unwrap();
    load(&mut g, big, 1, 5000);
    let d = decide(&mut g, &mut p, &tokens(12, 1_099 * BS));
    assert_ne!(d.replica, small);
    assert_eq!(d.replica, big);
    // Nothing fits anywhere: flagged, for admission control to hold it.
    let d = decide(&mut f, &mut p, &tokens(11, 20_000 * BS));
    assert_eq!(d.reason, Reason::NoKvHeadroom);
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
fn token_load_holds_affinity_within_the_tail_budget() {
    let (mut f, ids) = fleet(2);
    let toks = tokens(13, 64 * BS); // 1,024 tokens, all cached on replica 0
    hold(&mut f, ids[0], &toks, 64, 1.0);
    // 4 requests of 2,000 tokens queued there: 8,000 tokens, about 140 ms of wait.
    load(&mut f, ids[0], 4, 2000);
    let greedy = TokenLoadParams { move_weight: 0.0, ..TokenLoadParams::default() };
    // A fresh policy has seen no long prompt: its budget is 0.7 × this request's own 5.8 ms
    // prefill, and the idle replica wins (23.4 ms against about 144 ms).
    let mut p = TokenLoadPolicy::new(greedy);
    assert_eq!(decide(&mut f, &mut p, &toks).replica, ids[1]);
    // After 20,000-token prompts (own prefill 17.25 µs · 20,000 + 3 · 5.75 ms = 362 ms, the
    // recent p99), the budget is 0.7 × 362 = 253 ms: replica 0's 144 ms is within it and its
    // cache wins.
    let mut p = TokenLoadPolicy::new(greedy);
    for s in 0..10 {
        decide(&mut f, &mut p, &tokens(100 + s, 1250 * BS));
    }
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (ids[0], Reason::PrefixMatch));
    // Off (0), the greedy choice again.
    let mut off = TokenLoadPolicy::new(TokenLoadParams { affinity_budget: 0.0, ..greedy });
    for s in 0..10 {
        decide(&mut f, &mut off, &tokens(100 + s, 1250 * BS));
    }
    assert_eq!(decide(&mut f, &mut off, &toks).replica, ids[1]);
}

#[test]
fn token_load_spreads_among_peers_only_after_holding_affinity() {
    let (mut f, ids) = fleet(3);
    let toks = tokens(13, 64 * BS); // 1,024 tokens, all cached on replica 0
    hold(&mut f, ids[0], &toks, 64, 1.0);
    load(&mut f, ids[0], 4, 2000);
    let greedy = TokenLoadParams { move_weight: 0.0, ..TokenLoadParams::default() };
    let mut p = TokenLoadPolicy::new(greedy);
    for s in 0..10 {
        decide(&mut f, &mut p, &tokens(100 + s, 1250 * BS));
    }
    // Three other router nodes routing: replicas 1 and 2 are equally cheap and cache nothing,
    // so by rank this node would take one of them; but replica 0's hit is within the tail
    // budget (as in the test above) and is held.
    f.set_active_peers(3, 1);
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (ids[0], Reason::PrefixMatch));
    // Without a hit worth holding, the ranks split the equal replicas: rank 1 and rank 2 take
    // different ones.
    let fresh = tokens(77, 64 * BS);
    let one = decide(&mut f, &mut p, &fresh).replica;
    f.set_active_peers(3, 2);
    let two = decide(&mut f, &mut p, &fresh).replica;
    assert_ne!(one, two);
    assert!([one, two].iter().all(|r| *r != ids[0]), "{one:?} {two:?}");
}

/// A decode-heavy request (output at least half its prompt) holds affinity only where its KV
/// fits while another replica has room; a prompt-heavy one holds it where it waits for room.
#[test]
fn token_load_holds_a_decode_heavy_request_only_where_it_has_kv_room() {
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    let small = f.add_replica(ReplicaSpec::new("small", 64)).unwrap();
    let big = f.add_replica(ReplicaSpec::new("big", 10_000)).unwrap();
    let toks = tokens(13, 64 * BS); // 1,024 tokens, all 64 blocks cached on the small replica
    hold(&mut f, small, &toks, 64, 1.0);
    let ask = |f: &mut Fleet, p: &mut TokenLoadPolicy, max_tokens: u32| {
        let req = RouteRequest::new(f.hasher(), &toks, Some(max_tokens));
        f.decide(p, &req, &mut rng(), 1.0).unwrap()
    };
    let mut p = TokenLoadPolicy::new(TokenLoadParams::default());
    // 16 output tokens: 1 uncached block + 1 output block fit in the 64 free blocks; cached.
    let d = ask(&mut f, &mut p, 16);
    assert_eq!((d.replica, d.uncached_tokens), (small, 1));
    // 512 output tokens (half the prompt): 1 + 32 blocks still fit.
    assert_eq!(ask(&mut f, &mut p, 512).replica, small);
    // 1,024: 1 + 64 blocks do not. The priced wait for room makes the big replica cheapest,
    // and without the rule the tail budget would hold the cached prefix anyway (its TTFT,
    // 5.77 ms, is the fastest)…
    let mut without = TokenLoadPolicy::new(TokenLoadParams { affinity_room_share: 0.0, ..TokenLoadParams::default() });
    let d = ask(&mut f, &mut without, 1024);
    assert_eq!((d.replica, d.reason), (small, Reason::PrefixMatch));
    // …where with it the request goes where it fits, recomputing its 1,024 tokens.
    let d = ask(&mut f, &mut p, 1024);
    assert_eq!((d.replica, d.uncached_tokens), (big, 1024));
    // A share of 2 counts 1,024 output tokens on a 1,024-token prompt as prompt-heavy.
    let mut lax = TokenLoadPolicy::new(TokenLoadParams { affinity_room_share: 2.0, ..TokenLoadParams::default() });
    assert_eq!(ask(&mut f, &mut lax, 1024).replica, small);
}
