//! The peer policies' choices in small hand-computed scenarios that follow each project's
//! source: formulas, thresholds at their documented values, fallbacks and tie-breaks.

use super::*;
use crate::load::FleetEvent;
use crate::policy::lru_prefix::LruPrefixIndex;
use crate::policy::weighted_scorer::llmd_hashes;

/// Tells `p` that a prompt of `toks` was routed to `r` (as the fleet does after booking).
fn tell(f: &Fleet, p: &mut dyn Policy, r: ReplicaId, toks: &[u32], booking: u64) {
    let req = RouteRequest::new(f.hasher(), toks, Some(16));
    let d = Decision {
        replica: r,
        reason: Reason::Rotation,
        overlap_blocks: 0,
        uncached_tokens: toks.len() as u32,
        uncached_blocks: req.blocks(),
        estimated_ttft_s: 0.0,
        estimated_queue_wait_s: 0.0,
    };
    p.booked(&req, &d, BookingId(booking), 0.0);
}

fn decide_at(f: &mut Fleet, p: &mut dyn Policy, toks: &[u32], now: f64) -> Decision {
    let req = RouteRequest::new(f.hasher(), toks, Some(16));
    f.decide(p, &req, &mut rng(), now).unwrap()
}

fn metrics(f: &mut Fleet, r: ReplicaId, waiting: u32, kv_usage: f64) {
    f.report_metrics(r, EngineMetrics { running: 0, waiting, kv_usage, at: 0.0 }).unwrap();
}

// ---- SGLang `cache_aware` (smg) ----

#[test]
fn sglang_imbalance_needs_both_thresholds_at_64_and_1_5() {
    assert!(cache_aware::imbalanced(0, 65, 64, 1.5));
    assert!(!cache_aware::imbalanced(0, 64, 64, 1.5), "a gap of 64 is not > 64");
    assert!(cache_aware::imbalanced(100, 165, 64, 1.5), "165 > 150 and 65 > 64");
    assert!(!cache_aware::imbalanced(200, 265, 64, 1.5), "265 ≤ 200 × 1.5");
    // Imbalanced: the least loaded replica, whatever the tree says.
    let (mut f, ids) = fleet(2);
    let toks = tokens(3, 10 * BS);
    let mut p = CacheAware::new(CacheAwareParams::default());
    tell(&f, &mut p, ids[0], &toks, 100);
    load(&mut f, ids[0], 65, 0);
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (ids[1], Reason::Imbalance));
}

#[test]
fn sglang_match_rate_must_exceed_0_3_and_a_miss_goes_to_the_least_loaded() {
    let (mut f, ids) = fleet(2);
    let toks = tokens(4, 10 * BS);
    let mut p = CacheAware::new(CacheAwareParams::default());
    // Replica 0 holds 3 of the 10 blocks: 0.3 is not > 0.3, a miss → the least loaded (1).
    tell(&f, &mut p, ids[0], &toks[..3 * BS as usize], 100);
    load(&mut f, ids[0], 1, 0);
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (ids[1], Reason::FewestOutstanding));
    // 4 of 10: a hit, on the loaded replica.
    tell(&f, &mut p, ids[0], &toks[..4 * BS as usize], 101);
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (ids[0], Reason::PrefixMatch));
}

#[test]
fn sglang_a_hit_goes_to_the_worker_whose_prompt_first_reached_the_deepest_node() {
    let (mut f, ids) = fleet(3);
    let mut p = CacheAware::new(CacheAwareParams::default());
    let a = tokens(5, 10 * BS);
    let mut b = a[..6 * BS as usize].to_vec();
    b.extend(tokens(6, 4 * BS));
    tell(&f, &mut p, ids[2], &a, 100);
    tell(&f, &mut p, ids[1], &b, 101);
    load(&mut f, ids[2], 3, 0);
    // Shares a's and b's first 6 blocks, then neither: the node of block 6 was created by
    // replica 2's prompt, so replica 2 takes it although replica 1 holds it too, idler.
    let mut c = a[..6 * BS as usize].to_vec();
    c.extend(tokens(7, 4 * BS));
    let d = decide(&mut f, &mut p, &c);
    assert_eq!((d.replica, d.reason), (ids[2], Reason::PrefixMatch));
    // b itself matches down to replica 1's own blocks.
    assert_eq!(decide(&mut f, &mut p, &b).replica, ids[1]);
}

#[test]
fn sglang_breaks_load_ties_by_fewest_routed_then_list_order() {
    let (mut f, ids) = fleet(3);
    let mut p = CacheAware::new(CacheAwareParams::default());
    // Nothing matches a fresh prompt; loads are all 0. Replica 0 was routed one request
    // before: replica 1 (fewest routed, first in the list) takes it, every time.
    tell(&f, &mut p, ids[0], &tokens(8, BS), 100);
    for s in 0..5 {
        let d = decide(&mut f, &mut p, &tokens(20 + s, 10 * BS));
        assert_eq!((d.replica, d.reason), (ids[1], Reason::FewestOutstanding));
    }
}

#[test]
fn sglang_evicts_each_worker_down_to_max_tree_size_every_interval() {
    let (mut f, ids) = fleet(2);
    // 5 blocks of 16 tokens at 4 characters per token.
    let params = CacheAwareParams { max_tree_size: 5.0 * 16.0 * 4.0, ..CacheAwareParams::default() };
    let mut p = CacheAware::new(params);
    let toks = tokens(9, 10 * BS);
    decide_at(&mut f, &mut p, &tokens(1, BS), 0.0); // the first decision starts the clock
    tell(&f, &mut p, ids[0], &toks, 100);
    decide_at(&mut f, &mut p, &tokens(1, BS), 119.0);
    assert_eq!(p.tree_blocks(ids[0]), 10, "not due before 120 s");
    decide_at(&mut f, &mut p, &tokens(1, BS), 120.0);
    assert_eq!(p.tree_blocks(ids[0]), 5, "the deepest blocks go first");
    // The 5 left are the prompt's first: a 10-block request still matches 0.5 there.
    let d = decide_at(&mut f, &mut p, &toks, 121.0);
    assert_eq!((d.replica, d.reason), (ids[0], Reason::PrefixMatch));
}

#[test]
fn sglang_sends_a_hit_on_an_unhealthy_worker_to_the_first_healthy_one_unrecorded() {
    let (mut f, ids) = fleet(3);
    let mut p = CacheAware::new(CacheAwareParams::default());
    let toks = tokens(10, 10 * BS);
    tell(&f, &mut p, ids[1], &toks, 100);
    f.set_status(ids[1], crate::ReplicaStatus::Draining).unwrap();
    load(&mut f, ids[0], 2, 0);
    let req = RouteRequest::new(f.hasher(), &toks, Some(16));
    let routed = f.route(&mut p, &req, &mut rng(), 1.0).unwrap();
    assert_eq!((routed.decision.replica, routed.decision.reason), (ids[0], Reason::PrefixMatch));
    assert_eq!(p.tree_blocks(ids[0]), 0, "nothing recorded for the fallback");
    // A normal decision records again.
    let routed = f.route(&mut p, &RouteRequest::new(f.hasher(), &tokens(11, 2 * BS), None), &mut rng(), 1.0).unwrap();
    assert_eq!(routed.decision.replica, ids[2]);
    assert_eq!(p.tree_blocks(ids[2]), 2);
}

// ---- vLLM router `cache_aware` ----

#[test]
fn vllm_router_takes_the_least_loaded_of_the_best_own_matches() {
    let (mut f, ids) = fleet(3);
    let mut p = VllmCacheAware::new(CacheAwareParams::vllm_router());
    let toks = tokens(12, 10 * BS);
    tell(&f, &mut p, ids[0], &toks[..6 * BS as usize], 100);
    tell(&f, &mut p, ids[1], &toks[..6 * BS as usize], 101);
    tell(&f, &mut p, ids[2], &toks[..3 * BS as usize], 102);
    load(&mut f, ids[0], 3, 0);
    load(&mut f, ids[1], 2, 0);
    // Best rate 0.6 on replicas 0 and 1: the less loaded, replica 1 (SGLang would take the
    // creator, replica 0).
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (ids[1], Reason::PrefixMatch));
    // Best rate 0.3 is not > 0.3: the least loaded of all, replica 2.
    let short = tokens(13, 10 * BS);
    tell(&f, &mut p, ids[0], &short[..3 * BS as usize], 103);
    let d = decide(&mut f, &mut p, &short);
    assert_eq!((d.replica, d.reason), (ids[2], Reason::FewestOutstanding));
}

#[test]
fn vllm_router_breaks_ties_by_one_fixed_worker_order() {
    // Equal loads, nothing cached: always the first of the worker list, which is drawn once
    // (a DashMap's order) and then stays.
    for seed in 0..4u64 {
        let (mut f, _) = fleet(4);
        let mut p = VllmCacheAware::new(CacheAwareParams::vllm_router());
        let mut r = SmallRng::seed_from_u64(seed);
        let req = RouteRequest::new(f.hasher(), &tokens(14, 4 * BS), None);
        let first = f.decide(&mut p, &req, &mut r, 0.0).unwrap().replica;
        for _ in 0..20 {
            assert_eq!(f.decide(&mut p, &req, &mut r, 0.0).unwrap().replica, first);
        }
    }
}

// ---- Ray Serve `PrefixCacheAffinityRouter` ----

#[test]
fn ray_affinity_starts_at_a_match_rate_of_0_1_inclusive() {
    let (mut f, ids) = fleet(3);
    let mut p = PrefixAffinity::new(PrefixAffinityParams::default());
    let toks = tokens(15, 10 * BS);
    tell(&f, &mut p, ids[0], &toks[..BS as usize], 100);
    load(&mut f, ids[0], 5, 0);
    // 1 of 10 blocks = 0.1 ≥ 0.1: replica 0, the only holder, despite its 5 ongoing.
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!((d.replica, d.reason), (ids[0], Reason::PrefixMatch));
    // 1 of 11 < 0.1: the smallest trees (replicas 1 and 2, empty); fewer ongoing, then the
    // first: replica 1; with one ongoing on replica 1, replica 2.
    let longer = tokens(15, 11 * BS);
    let d = decide(&mut f, &mut p, &longer);
    assert_eq!((d.replica, d.reason), (ids[1], Reason::LeastCached));
    load(&mut f, ids[1], 1, 0);
    assert_eq!(decide(&mut f, &mut p, &longer).replica, ids[2]);
}

#[test]
fn ray_orders_matched_replicas_by_arrival_and_never_falls_back_by_default() {
    let (mut f, ids) = fleet(3);
    let mut p = PrefixAffinity::new(PrefixAffinityParams::default());
    let toks = tokens(16, 10 * BS);
    tell(&f, &mut p, ids[2], &toks, 100);
    tell(&f, &mut p, ids[0], &toks, 101);
    // Equal ongoing: the replica that reached the node first, 2.
    assert_eq!(decide(&mut f, &mut p, &toks).replica, ids[2]);
    // Fewer ongoing wins: replica 0.
    load(&mut f, ids[2], 1, 0);
    assert_eq!(decide(&mut f, &mut p, &toks).replica, ids[0]);
    // An ongoing gap of 100 is not imbalance with the default infinite threshold…
    load(&mut f, ids[2], 100, 0);
    load(&mut f, ids[0], 100, 0);
    assert_eq!(decide(&mut f, &mut p, &toks).reason, Reason::PrefixMatch);
    // …and is with a threshold of 10 (Ray before 2.60): power of two over all replicas.
    let mut p10 = PrefixAffinity::new(PrefixAffinityParams { imbalanced_threshold: 10.0, ..Default::default() });
    tell(&f, &mut p10, ids[2], &toks, 102);
    assert_eq!(decide(&mut f, &mut p10, &toks).reason, Reason::Imbalance);
}

// ---- llm-d `weighted_scorer` ----

#[test]
fn llmd_hashes_64_token_blocks_and_the_partial_last_one() {
    let f = fleet(1).0;
    let toks = tokens(17, 200);
    let req = RouteRequest::new(f.hasher(), &toks, None);
    let mut out = Vec::new();
    llmd_hashes(&req, 16, &mut out);
    // 200 tokens: three 64-token blocks (ends of kvmesh blocks 4, 8, 12) and 8 tokens more.
    assert_eq!(out, vec![req.hashes[3].0, req.hashes[7].0, req.hashes[11].0, req.prompt_key]);
    let exact = RouteRequest::new(f.hasher(), &toks[..192], None);
    llmd_hashes(&exact, 16, &mut out);
    assert_eq!(out.len(), 3, "no partial block when it ends on one");
}

#[test]
fn llmd_counts_held_blocks_until_no_server_has_one() {
    let mut ix = LruPrefixIndex::default();
    let (s0, s1) = (ReplicaId(0), ReplicaId(1));
    ix.add(s0, &[1, 2, 3], 100);
    ix.add(s1, &[2, 3], 100);
    let mut m = Default::default();
    ix.matches(&[1, 2, 3, 4], &mut m);
    // Server 1 lacks block 1 yet counts 2 and 3: server 0 keeps the walk going.
    assert_eq!((m.get(&s0).copied(), m.get(&s1).copied()), (Some(3), Some(2)));
    ix.matches(&[9, 2, 3], &mut m);
    assert!(m.is_empty(), "nobody holds the first block: no match at all");
    // LRU of 2: adding 3 blocks pushes the first out, and it leaves the server's list.
    let mut small = LruPrefixIndex::default();
    small.add(s0, &[1, 2, 3], 2);
    assert_eq!(small.len(s0), 2);
    small.matches(&[1, 2, 3], &mut m);
    assert!(m.is_empty());
    small.matches(&[2, 3], &mut m);
    assert_eq!(m.get(&s0).copied(), Some(2));
}

#[test]
fn llmd_scores_3_prefix_2_queue_2_kv_on_the_latest_scrape() {
    let (mut f, ids) = fleet(2);
    let mut p = WeightedScorer::new(WeightedScorerParams::default());
    let toks = tokens(18, 200);
    decide(&mut f, &mut p, &toks);
    tell(&f, &mut p, ids[0], &toks, 100);
    // Replica 0: prefix 4/4 · 3 + queue (3 − 3)/(3 − 1) · 2 + (1 − 0.5) · 2 = 4.0.
    // Replica 1: prefix 0 + queue (3 − 1)/2 · 2 + (1 − 0.1) · 2 = 3.8.
    metrics(&mut f, ids[0], 3, 0.5);
    metrics(&mut f, ids[1], 1, 0.1);
    assert_eq!(decide_at(&mut f, &mut p, &toks, 100.0).replica, ids[0], "a 100 s old scrape still counts");
    // Replica 1 at KV 0: 2 + 2 = 4.0, a tie: uniform among the two.
    metrics(&mut f, ids[1], 1, 0.0);
    let req = RouteRequest::new(f.hasher(), &toks, None);
    let mut r = SmallRng::seed_from_u64(1);
    let ones = (0..400).filter(|_| f.decide(&mut p, &req, &mut r, 1.0).unwrap().replica == ids[1]).count();
    assert!((150..=250).contains(&ones), "{ones}");
}

#[test]
fn llmd_reads_zeros_before_the_first_scrape_and_counts_no_in_flight_requests() {
    let (mut f, ids) = fleet(2);
    let mut p = WeightedScorer::new(WeightedScorerParams::default());
    // Neither scraped: queue 0 and KV 0 for both (tied). Replica 0 then has 50 requests in
    // flight from this router, unseen: with a prefix recorded there it still wins 7 to 4.
    let toks = tokens(19, 128);
    decide(&mut f, &mut p, &toks);
    tell(&f, &mut p, ids[0], &toks, 100);
    load(&mut f, ids[0], 50, 1000);
    assert_eq!(decide(&mut f, &mut p, &toks).replica, ids[0]);
    assert_eq!(p.scrape_interval_s(), Some(0.05));
}

// ---- Dynamo `kv_cost` ----

#[test]
fn dynamo_cost_is_prefill_blocks_less_overlap_plus_active_blocks() {
    let (mut f, ids) = fleet(2);
    let mut p = KvCost::new(KvCostParams::default());
    let cost = |f: &mut Fleet, p: &mut KvCost, toks: &[u32], i: usize| {
        let req = RouteRequest::new(f.hasher(), toks, Some(16));
        #[derive(Debug)]
        struct Probe<'a>(&'a mut KvCost, usize, f64);
        impl Policy for Probe<'_> {
            fn name(&self) -> &'static str {
                "probe"
            }
            fn observe(&mut self, events: &[FleetEvent]) {
                self.0.observe(events);
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
        let mut probe = Probe(p, i, 0.0);
        f.decide(&mut probe, &req, &mut rng(), 1.0).unwrap();
        probe.2
    };
    // An unrelated 10-block request routed to replica 0 through the policy: 160 active
    // prefill tokens and 10 active blocks there.
    let first = RouteRequest::new(f.hasher(), &tokens(20, 10 * BS), Some(16));
    let mut to0 = Fixed0(&mut p);
    let routed = f.route(&mut to0, &first, &mut rng(), 0.0).unwrap();
    assert_eq!(routed.decision.replica, ids[0]);
    // The request: 8 blocks (128 tokens), 6 of them cached on replica 0 by its events.
    let toks = tokens(21, 8 * BS);
    hold(&mut f, ids[0], &toks, 6, 0.5);
    // Replica 0: max(0, (160 + 128)/16 − 6) + 10 + (8 − 0) = 12 + 18 = 30.
    // Replica 1: 128/16 + 0 + 8 = 16.
    assert_eq!(cost(&mut f, &mut p, &toks, 0), 30.0);
    assert_eq!(cost(&mut f, &mut p, &toks, 1), 16.0);
    // Its first token: the 160 tokens leave the prefill term, its 10 blocks stay: 2 + 18 = 20.
    f.first_token(routed.booking, 1.0).unwrap();
    assert_eq!(cost(&mut f, &mut p, &toks, 0), 20.0);
    // It ends: 2 + 8 = 10, now below replica 1's 16.
    f.release(routed.booking, Some(16)).unwrap();
    assert_eq!(cost(&mut f, &mut p, &toks, 0), 10.0);
    let req = RouteRequest::new(f.hasher(), &toks, Some(16));
    assert_eq!(f.decide(&mut p, &req, &mut rng(), 2.0).unwrap().replica, ids[0]);
}

/// Wraps a [`KvCost`] but always picks the first replica, so its tracking sees a booking there.
#[derive(Debug)]
struct Fixed0<'a>(&'a mut KvCost);

impl Policy for Fixed0<'_> {
    fn name(&self) -> &'static str {
        "fixed0"
    }
    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, _: &mut dyn RngCore) -> Result<Decision, Error> {
        Ok(Decision::at(view, req, 0, Reason::LowestCost))
    }
    fn booked(&mut self, req: &RouteRequest, d: &Decision, b: BookingId, now: f64) {
        self.0.booked(req, d, b, now);
    }
}

#[test]
fn dynamo_counts_shared_active_blocks_once() {
    let (mut f, ids) = fleet(2);
    let mut p = KvCost::new(KvCostParams::default());
    let toks = tokens(22, 8 * BS);
    let req = RouteRequest::new(f.hasher(), &toks, Some(16));
    // Two requests for the same 8-block prompt on replica 0: 8 active blocks, not 16.
    for _ in 0..2 {
        f.route(&mut Fixed0(&mut p), &req, &mut rng(), 0.0).unwrap();
    }
    f.decide(&mut p, &req, &mut rng(), 0.1).unwrap();
    assert_eq!(p.active_blocks(ids[0]), 8);
    assert_eq!(p.active_prefill_tokens(ids[0]), 256, "uncached twice: no events yet");
}

// ---- vLLM router `power_of_two` and `consistent_hash` ----

#[test]
fn power_of_two_takes_the_one_with_fewer_in_flight_and_splits_ties() {
    let (mut f, ids) = fleet(2);
    load(&mut f, ids[0], 1, 0);
    let mut p = PowerOfTwo::default();
    for s in 0..20 {
        let req = RouteRequest::new(f.hasher(), &tokens(s, 16), None);
        let d = f.decide(&mut p, &req, &mut SmallRng::seed_from_u64(s as u64), 0.0).unwrap();
        assert_eq!(d.replica, ids[1]);
    }
    // Token load does not enter: a replica with one request of 100,000 queued tokens ties one
    // with a single short request.
    let (mut f, ids) = fleet(2);
    load(&mut f, ids[0], 1, 100_000);
    load(&mut f, ids[1], 1, 10);
    let req = RouteRequest::new(f.hasher(), &tokens(1, 16), None);
    let mut r = SmallRng::seed_from_u64(3);
    let zeros = (0..400).filter(|_| f.decide(&mut p, &req, &mut r, 0.0).unwrap().replica == ids[0]).count();
    assert!((150..=250).contains(&zeros), "{zeros}");
}

#[test]
fn consistent_hash_keeps_a_hot_key_on_its_owner_and_skips_a_draining_one_to_the_first() {
    let (mut f, ids) = fleet(3);
    let mut p = ConsistentHash::new(ConsistentHashParams::default());
    let req = RouteRequest::from_hashes(64, vec![], None).with_key(7);
    let owner = f.decide(&mut p, &req, &mut rng(), 0.0).unwrap();
    assert_eq!(owner.reason, Reason::RingOwner);
    load(&mut f, owner.replica, 500, 0);
    assert_eq!(f.decide(&mut p, &req, &mut rng(), 0.0).unwrap().replica, owner.replica, "no load bound");
    f.set_status(owner.replica, crate::ReplicaStatus::Draining).unwrap();
    let d = f.decide(&mut p, &req, &mut rng(), 0.0).unwrap();
    let first = *ids.iter().find(|&&r| r != owner.replica).unwrap();
    assert_eq!((d.replica, d.reason), (first, Reason::RingSpill));
    // Without a session key the whole prompt is the key: equal prompts stay together.
    let a = RouteRequest::new(f.hasher(), &tokens(30, 40), None);
    let b = RouteRequest::new(f.hasher(), &tokens(30, 40), None);
    assert_eq!(a.key, b.key);
    assert_ne!(a.key, RouteRequest::new(f.hasher(), &tokens(30, 41), None).key);
}

#[test]
fn removed_replicas_leave_the_peers_records() {
    // SGLang: the tree forgets a removed worker, so its prefixes no longer pull requests to
    // "the first healthy worker" (the fallback for a matched tenant that is gone).
    let (mut f, ids) = fleet(3);
    let mut p = CacheAware::new(CacheAwareParams::default());
    let toks = tokens(40, 10 * BS);
    tell(&f, &mut p, ids[2], &toks, 100);
    assert_eq!(p.tree_blocks(ids[2]), 10);
    load(&mut f, ids[0], 1, 0);
    f.remove_replica(ids[2]).unwrap();
    let d = decide(&mut f, &mut p, &toks);
    assert_eq!(p.tree_blocks(ids[2]), 0);
    assert_eq!((d.replica, d.reason), (ids[1], Reason::FewestOutstanding), "a miss: the least loaded");
    // llm-d: the server's LRU and its place in every hash's list go.
    let mut ix = LruPrefixIndex::default();
    ix.add(ReplicaId(0), &[1, 2], 10);
    ix.add(ReplicaId(1), &[1, 2], 10);
    ix.forget(ReplicaId(0));
    let mut m = Default::default();
    ix.matches(&[1, 2], &mut m);
    assert_eq!(
        (ix.len(ReplicaId(0)), m.get(&ReplicaId(0)).copied(), m.get(&ReplicaId(1)).copied()),
        (0, None, Some(2))
    );
}
