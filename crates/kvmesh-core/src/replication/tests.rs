//! Replication tests: the sketch's rates, pruning and token capture; the planner's hot rule,
//! sizing, target choice, memory budget, chain dedupe and cooling; warm-ups and their limiter;
//! routing by a plan.

use super::sketch::ladder;
use super::*;
use crate::index::{KvEvent, Stored};
use crate::load::BookingSpec;
use crate::{EngineBlockHash, Fleet, FleetConfig, Medium, PolicyKind, ReplicaId, ReplicaSpec, RouteRequest};
use rand::rngs::SmallRng;
use rand::SeedableRng;

const BS: usize = 16;

fn hot_tokens() -> Vec<u32> {
    (0..64 * BS as u32).collect()
}

/// `n` replicas of 10,000 blocks named r0, r1, …
fn fleet(n: u32) -> Fleet {
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    for i in 0..n {
        f.add_replica(ReplicaSpec::new(format!("r{i}"), 10_000)).unwrap();
    }
    f
}

/// Replica `id` stores `tokens` (whole blocks) by KV event.
fn store(f: &mut Fleet, id: u32, tokens: &[u32], now: f64) {
    let blocks = tokens.len() / BS;
    let ev = KvEvent::Stored(Stored {
        block_hashes: (0..blocks as u64).map(|b| EngineBlockHash(1000 * id as u64 + b)).collect(),
        parent: None,
        token_ids: tokens[..blocks * BS].to_vec(),
        block_size: BS as u32,
        medium: Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        kv_group: None,
    });
    f.apply_event(ReplicaId(id), &ev, now).unwrap();
}

/// A report where the 64-block hot prefix carries `share` of the load (total 1,000 tokens/s).
fn report(f: &Fleet, share: f64) -> SketchReport {
    let tokens = hot_tokens();
    let chain = f.hasher().hash_blocks(&tokens);
    SketchReport {
        total_load_tokens_per_s: 1000.0,
        prefixes: vec![HotPrefix {
            hash: chain[63],
            depth_blocks: 64,
            prefix_tokens_per_s: 5000.0,
            load_tokens_per_s: 1000.0 * share,
            requests_per_s: 5.0,
            tokens: Some(tokens.into()),
        }],
    }
}

#[test]
fn ladder_steps_twice_per_doubling() {
    assert_eq!(ladder(200).collect::<Vec<_>>(), vec![4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192]);
    assert_eq!(ladder(3).count(), 0);
    assert_eq!(ladder(4).collect::<Vec<_>>(), vec![4]);
}

#[test]
fn sketch_rates_decay_with_the_half_life() {
    let f = fleet(1);
    let tokens = hot_tokens();
    let hashes = f.hasher().hash_blocks(&tokens);
    let mut s = PrefixSketch::new(SketchConfig { half_life_s: 10.0, ..SketchConfig::default() }, BS as u32);
    s.observe(0.0, &hashes, Some(&tokens), 100.0);
    assert!(s.report(0.0, 100).prefixes.is_empty(), "a prompt seen once is not reported");
    s.observe(0.0, &hashes, Some(&tokens), 100.0);
    let lambda = std::f64::consts::LN_2 / 10.0;
    // One half-life later: half of λ × the weights. The ladder's 9 depths (4 … 64) are one
    // row: every ancestor's requests are its descendant's.
    let r = s.report(10.0, 100);
    assert_eq!(r.prefixes.len(), 1);
    let top = &r.prefixes[0];
    assert_eq!((top.depth_blocks, top.hash), (64, hashes[63]));
    assert!((top.prefix_tokens_per_s - 2.0 * 64.0 * 16.0 * lambda * 0.5).abs() < 1e-9);
    assert!((top.requests_per_s - 2.0 * lambda * 0.5).abs() < 1e-12);
    assert!((top.load_tokens_per_s - 200.0 * lambda * 0.5).abs() < 1e-9);
    assert!((r.total_load_tokens_per_s - 200.0 * lambda * 0.5).abs() < 1e-9);
    assert_eq!(top.tokens.as_deref(), Some(&tokens[..]), "ids kept from the second sighting on");
    // A steady stream of one request per second reads λ / (1 − e^{−λ}) ≈ 1.035 requests/s,
    // through a landmark rescale (λ·t passes 200 at t ≈ 2,885 s).
    for t in 1..4000 {
        s.observe(t as f64, &hashes, Some(&tokens), 100.0);
    }
    let r = s.report(3999.0, 1);
    let steady = lambda / (1.0 - (-lambda).exp());
    assert!((r.prefixes[0].requests_per_s - steady).abs() < 1e-9, "{}", r.prefixes[0].requests_per_s);
}

#[test]
fn a_shared_system_prompt_is_one_row_at_its_deepest_shared_depth() {
    let f = fleet(1);
    let mut s = PrefixSketch::new(SketchConfig::default(), BS as u32);
    // 48 shared blocks, then 16 unique ones per request: ladder depths 4 … 48 shared, 64 not.
    for i in 0..10u32 {
        let mut t: Vec<u32> = (0..48 * BS as u32).collect();
        t.extend((0..16 * BS as u32).map(|k| 1_000_000 * (i + 1) + k));
        s.observe(i as f64, &f.hasher().hash_blocks(&t), Some(&t), 10.0);
    }
    let r = s.report(10.0, 16);
    assert_eq!(r.prefixes.iter().map(|p| p.depth_blocks).collect::<Vec<_>>(), vec![48]);
    assert_eq!(r.prefixes[0].tokens.as_ref().map(|t| t.len()), Some(48 * BS));
}

#[test]
fn sketch_memory_is_bounded_and_keeps_the_heavy() {
    let f = fleet(1);
    let hot = hot_tokens();
    let hot_hashes = f.hasher().hash_blocks(&hot);
    let mut s = PrefixSketch::new(SketchConfig { capacity: 16, ..SketchConfig::default() }, BS as u32);
    for i in 0..2000u32 {
        let t = i as f64 * 0.01;
        if i % 2 == 0 {
            s.observe(t, &hot_hashes, Some(&hot), 10.0);
        } else {
            let unique: Vec<u32> = (0..8 * BS as u32).map(|k| 1_000_000 + i * 1000 + k).collect();
            s.observe(t, &f.hasher().hash_blocks(&unique), None, 10.0);
        }
        assert!(s.len() <= 32, "at most twice the capacity");
    }
    let r = s.report(20.0, 1);
    assert_eq!((r.prefixes[0].depth_blocks, r.prefixes[0].hash), (64, hot_hashes[63]));
}

#[test]
fn reports_merge_by_prefix() {
    let f = fleet(1);
    let a = report(&f, 0.5);
    let mut b = report(&f, 0.1);
    b.prefixes[0].tokens = None;
    b.prefixes.push(HotPrefix { hash: crate::BlockHash(7), depth_blocks: 4, tokens: None, ..b.prefixes[0].clone() });
    let m = SketchReport::merge([&a, &b]);
    assert_eq!(m.total_load_tokens_per_s, 2000.0);
    assert_eq!(m.prefixes.len(), 2);
    assert_eq!(m.prefixes[0].load_tokens_per_s, 600.0);
    assert_eq!(m.prefixes[0].prefix_tokens_per_s, 10_000.0);
    assert!(m.prefixes[0].tokens.is_some());
}

#[test]
fn a_hot_prefix_gets_replicas_sized_to_its_share() {
    let mut f = fleet(8);
    store(&mut f, 0, &hot_tokens(), 0.0);
    // r1 is busy: it is chosen last.
    f.book(
        ReplicaId(1),
        BookingSpec {
            uncached_prefill_tokens: 5000,
            uncached_blocks: 313,
            expected_output_tokens: 100,
            reports_first_token: true,
            output_key: None,
            reestimate_up_to: None,
        },
        0.0,
    )
    .unwrap();
    let config = ReplicationConfig::default();
    // 30 % of the load on 8 replicas at 70 %: 0.3 · 8 / 0.7 = 3.43 → 4 holders; r0 holds it.
    let plan = plan_round(&config, 1.0, &report(&f, 0.3), &f, &ReplicationPlan::default());
    assert_eq!(plan.version, 1);
    let p = &plan.prefixes[0];
    assert_eq!((p.depth_blocks, p.want_replicas, p.origin), (64, 4, Origin::Detected));
    assert_eq!(p.holders, vec!["r0".to_string()]);
    let targets: Vec<&str> = p.targets.iter().map(|t| t.replica.as_str()).collect();
    assert_eq!(targets, vec!["r2", "r3", "r4"]);
    assert!(p.targets.iter().all(|t| t.state == TargetState::Pending));
    assert_eq!(plan.planned_blocks(), 3 * 64);
    // The same input again changes nothing but the shares: same version.
    let again = plan_round(&config, 2.0, &report(&f, 0.3), &f, &plan);
    assert_eq!(again.version, 1);
    // More load grows the set (never shrinks it while planned): 0.6 · 8 / 0.7 = 6.86 → 7.
    let more = plan_round(&config, 3.0, &report(&f, 0.6), &f, &again);
    assert_eq!((more.version, more.prefixes[0].want_replicas, more.prefixes[0].targets.len()), (2, 7, 6));
}

#[test]
fn a_prefix_its_holders_can_serve_is_not_hot() {
    let mut f = fleet(8);
    store(&mut f, 0, &hot_tokens(), 0.0);
    store(&mut f, 1, &hot_tokens(), 0.0);
    // 0.15 · 8 / 0.7 = 1.71 ≤ 2 holders.
    let plan = plan_round(&ReplicationConfig::default(), 1.0, &report(&f, 0.15), &f, &ReplicationPlan::default());
    assert!(plan.prefixes.is_empty());
    assert_eq!(plan.version, 0);
    // Without token ids a prefix cannot be warmed, so it is not planned.
    let mut r = report(&f, 0.9);
    r.prefixes[0].tokens = None;
    assert!(plan_round(&ReplicationConfig::default(), 1.0, &r, &f, &ReplicationPlan::default()).prefixes.is_empty());
}

#[test]
fn the_memory_budget_limits_targets() {
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    f.add_replica(ReplicaSpec::new("big", 10_000)).unwrap();
    f.add_replica(ReplicaSpec::new("small", 600)).unwrap(); // 10 %: 60 blocks < 64
    f.add_replica(ReplicaSpec::new("holder", 10_000)).unwrap();
    store(&mut f, 2, &hot_tokens(), 0.0);
    let plan = plan_round(&ReplicationConfig::default(), 1.0, &report(&f, 0.9), &f, &ReplicationPlan::default());
    let p = &plan.prefixes[0];
    assert_eq!(p.want_replicas, 3);
    assert_eq!(p.targets.iter().map(|t| t.replica.as_str()).collect::<Vec<_>>(), vec!["big"]);
}

#[test]
fn only_the_deepest_prefix_of_a_chain_is_planned() {
    let f = fleet(4);
    let mut r = report(&f, 0.9);
    let tokens = hot_tokens();
    let chain = f.hasher().hash_blocks(&tokens);
    let shallow = HotPrefix {
        hash: chain[31],
        depth_blocks: 32,
        tokens: Some(tokens[..32 * BS].into()),
        ..r.prefixes[0].clone()
    };
    r.prefixes.push(shallow);
    let plan = plan_round(&ReplicationConfig::default(), 1.0, &r, &f, &ReplicationPlan::default());
    assert_eq!(plan.prefixes.len(), 1);
    assert_eq!(plan.prefixes[0].depth_blocks, 64);
}

#[test]
fn a_cool_prefix_retires_after_the_cooldown() {
    let mut f = fleet(4);
    store(&mut f, 0, &hot_tokens(), 0.0);
    let config = ReplicationConfig { cooldown_s: 30.0, ..ReplicationConfig::default() };
    let plan = plan_round(&config, 0.0, &report(&f, 0.5), &f, &ReplicationPlan::default());
    assert_eq!(plan.prefixes[0].want_replicas, 3); // 0.5 · 4 / 0.7 = 2.86
                                                   // 0.1 · 4 / 0.7 = 0.57 ≥ 0.5 · 3 = 1.5? No: cooling starts.
    let cooling = plan_round(&config, 10.0, &report(&f, 0.1), &f, &plan);
    assert_eq!(cooling.prefixes[0].cool_since, Some(10.0));
    // Hot again before the cooldown ends: cooling stops.
    let hot = plan_round(&config, 20.0, &report(&f, 0.5), &f, &cooling);
    assert_eq!(hot.prefixes[0].cool_since, None);
    let c1 = plan_round(&config, 30.0, &report(&f, 0.1), &f, &hot);
    let c2 = plan_round(&config, 59.0, &report(&f, 0.1), &f, &c1);
    assert_eq!(c2.prefixes.len(), 1);
    let gone = plan_round(&config, 60.0, &report(&f, 0.1), &f, &c2);
    assert!(gone.prefixes.is_empty());
    assert_eq!(gone.version, c2.version + 1);
}

#[test]
fn a_prefix_whose_traffic_stops_cools_though_its_share_stays() {
    let mut f = fleet(4);
    store(&mut f, 0, &hot_tokens(), 0.0);
    let config = ReplicationConfig::default();
    let plan = plan_round(&config, 0.0, &report(&f, 0.9), &f, &ReplicationPlan::default());
    // All traffic decays alike, so the share holds at 0.9; the rate falls below 0.5 req/s.
    let mut quiet = report(&f, 0.9);
    quiet.prefixes[0].requests_per_s = 0.4;
    assert_eq!(plan_round(&config, 5.0, &quiet, &f, &plan).prefixes[0].cool_since, Some(5.0));
    // Nor is a prefix that slow planned in the first place.
    assert!(plan_round(&config, 0.0, &quiet, &f, &ReplicationPlan::default()).prefixes.is_empty());
}

#[test]
fn warm_ups_are_limited_confirmed_retried_and_given_up() {
    let mut f = fleet(3);
    store(&mut f, 0, &hot_tokens(), 0.0);
    let config =
        ReplicationConfig { warm_share: 0.1, warm_timeout_s: 10.0, max_attempts: 2, ..ReplicationConfig::default() };
    let mut plan = plan_round(&config, 0.0, &report(&f, 0.9), &f, &ReplicationPlan::default());
    assert_eq!(plan.prefixes[0].targets.len(), 2);
    let mut limiter = WarmLimiter::default();
    let (w, changed) = warm_round(&config, 0.0, &f, &mut plan, &mut limiter);
    assert!(changed);
    assert_eq!(w.iter().map(|w| w.replica.as_str()).collect::<Vec<_>>(), vec!["r1", "r2"]);
    // 1,024 tokens at 17.25 µs.
    assert!((w[0].cost_s - 1024.0 * 17.25e-6).abs() < 1e-12);
    assert_eq!(w[0].attempt, 1);
    // r1's events show the prefix: confirmed. r2 stays silent: after 10 s it is retried ...
    store(&mut f, 1, &hot_tokens(), 1.0);
    let (w, _) = warm_round(&config, 1.0, &f, &mut plan, &mut limiter);
    assert!(w.is_empty());
    assert_eq!(plan.prefixes[0].targets[0].state, TargetState::Confirmed { at: 1.0 });
    let (w, _) = warm_round(&config, 10.0, &f, &mut plan, &mut limiter);
    assert!(w.is_empty());
    assert_eq!(plan.prefixes[0].targets[1].state, TargetState::Pending);
    let (w, _) = warm_round(&config, 10.5, &f, &mut plan, &mut limiter);
    assert_eq!(w[0].attempt, 2);
    // ... and given up after its second attempt.
    warm_round(&config, 20.5, &f, &mut plan, &mut limiter);
    let TargetState::Failed { reason, at } = &plan.prefixes[0].targets[1].state else { panic!("not failed") };
    assert_eq!(*at, 20.5);
    assert_eq!(reason, "KV events did not show the prefix within 10 s of each of 2 warm-ups");
    // A failed replica rests for cooldown_s (30 s) before it is chosen again for the prefix.
    let replanned = plan_round(&config, 21.0, &report(&f, 0.9), &f, &plan);
    let t = &replanned.prefixes[0].targets;
    assert_eq!((t.len(), t[1].replica.as_str(), t[1].state.name()), (2, "r2", "failed"));
    let later = plan_round(&config, 51.0, &report(&f, 0.9), &f, &replanned);
    let t = &later.prefixes[0].targets;
    assert_eq!((t.len(), t[1].replica.as_str(), t[1].state.name(), t[1].attempts), (2, "r2", "pending", 0));
}

#[test]
fn the_limiter_keeps_warm_ups_to_their_share() {
    let mut l = WarmLimiter::default();
    // 0.1 s of prefill per second, 0.1 s banked; a 0.5 s warm-up leaves r0 0.4 s in debt,
    // earned back in 4 s.
    assert!(l.try_take(0.1, "r0", 0.5, 0.0));
    assert!(!l.try_take(0.1, "r0", 0.5, 3.9));
    assert!(l.try_take(0.1, "r1", 0.5, 3.9), "per replica");
    assert!(l.try_take(0.1, "r0", 0.5, 4.0 + 1e-9));
}

#[test]
fn a_failed_send_retries_then_gives_up() {
    let mut f = fleet(2);
    store(&mut f, 0, &hot_tokens(), 0.0);
    let config = ReplicationConfig { max_attempts: 1, ..ReplicationConfig::default() };
    let mut plan = plan_round(&config, 0.0, &report(&f, 0.9), &f, &ReplicationPlan::default());
    let (w, _) = warm_round(&config, 0.0, &f, &mut plan, &mut WarmLimiter::default());
    assert!(!warm_failed(&config, &mut plan, w[0].hash, 64, "r1", 0, "late", 1.0), "an older attempt's report");
    assert!(warm_failed(&config, &mut plan, w[0].hash, 64, "r1", 1, "HTTP 500", 1.0));
    assert_eq!(
        plan.prefixes[0].targets[0].state,
        TargetState::Failed { reason: "warm-up 1 of 1 failed: HTTP 500".into(), at: 1.0 }
    );
    assert!(!warm_failed(&config, &mut plan, w[0].hash, 64, "r1", 1, "again", 2.0), "only a warming target");
}

#[test]
fn routers_treat_planned_targets_as_warm_for_the_grace_ttl() {
    let mut f = fleet(2);
    store(&mut f, 0, &hot_tokens(), 0.0);
    let config = ReplicationConfig::default();
    let mut plan = plan_round(&config, 0.0, &report(&f, 0.9), &f, &ReplicationPlan::default());
    // Pending targets are not warm: nothing was sent to them yet.
    f.set_replication_plan(&plan, 10.0, 0.5);
    f.book(
        ReplicaId(0),
        BookingSpec {
            uncached_prefill_tokens: 20_000,
            uncached_blocks: 1250,
            expected_output_tokens: 10,
            reports_first_token: false,
            output_key: None,
            reestimate_up_to: None,
        },
        0.5,
    )
    .unwrap();
    let d = f
        .decide(
            PolicyKind::TokenLoad.build().as_mut(),
            &RouteRequest::new(f.hasher(), &hot_tokens(), Some(10)),
            &mut SmallRng::seed_from_u64(1),
            0.5,
        )
        .unwrap();
    assert_eq!(d.overlap_blocks, if d.replica == ReplicaId(0) { 64 } else { 0 });
    warm_round(&config, 0.0, &f, &mut plan, &mut WarmLimiter::default());
    let mut prompt = hot_tokens();
    prompt.extend(5000..5100);
    let req = RouteRequest::new(f.hasher(), &prompt, Some(10));
    let mut policy = PolicyKind::TokenLoad.build();
    let mut rng = SmallRng::seed_from_u64(1);
    let mut overlap = |f: &mut Fleet, now: f64| {
        let mut rng2 = rng.clone();
        let d = f.decide(policy.as_mut(), &req, &mut rng2, now).unwrap();
        (d.replica, d.overlap_blocks)
    };
    // Before the plan r0 is the only holder; both cost the same otherwise.
    assert_eq!(overlap(&mut f, 1.0), (ReplicaId(0), 64));
    f.set_replication_plan(&plan, 10.0, 1.0);
    // Load r0 so the planned r1 wins on the same 64 cached blocks.
    f.book(
        ReplicaId(0),
        BookingSpec {
            uncached_prefill_tokens: 20_000,
            uncached_blocks: 1250,
            expected_output_tokens: 10,
            reports_first_token: false,
            output_key: None,
            reestimate_up_to: None,
        },
        2.0,
    )
    .unwrap();
    assert_eq!(overlap(&mut f, 2.0), (ReplicaId(1), 64));
    // Re-applying the same plan keeps the first deadline (1 + 10 s).
    f.set_replication_plan(&plan, 10.0, 5.0);
    let d = f.decide(policy.as_mut(), &req, &mut rng, 11.0).unwrap();
    assert_eq!((d.replica, d.overlap_blocks), (ReplicaId(0), 64), "after the grace TTL only events count");
}

#[test]
fn triggers_pin_a_prefix_on_chosen_replicas() {
    let f = fleet(3);
    let config = ReplicationConfig::default();
    // 10 blocks, down to the ladder's 8; on r2 exactly.
    let plan =
        trigger(&config, 5.0, &f, &ReplicationPlan::default(), &hot_tokens()[..160], &["r2".into()], None).unwrap();
    let p = &plan.prefixes[0];
    assert_eq!((p.depth_blocks, p.origin, p.pinned_until, p.want_replicas), (8, Origin::Manual, 35.0, 1));
    assert_eq!(p.targets.iter().map(|t| t.replica.as_str()).collect::<Vec<_>>(), vec!["r2"]);
    // Without names: min_replicas chosen by load.
    let auto = trigger(&config, 5.0, &f, &ReplicationPlan::default(), &hot_tokens(), &[], None).unwrap();
    assert_eq!(auto.prefixes[0].targets.iter().map(|t| t.replica.as_str()).collect::<Vec<_>>(), vec!["r0", "r1"]);
    let wrong =
        trigger(&config, 5.0, &f, &plan, &hot_tokens(), &[], Some(crate::BlockHash(1))).unwrap_err().to_string();
    assert_eq!(wrong, "invalid prefix: the token ids known for this hash do not hash to it");
    // Pinned: no load does not cool it until the pin ends.
    let r = SketchReport { total_load_tokens_per_s: 1.0, prefixes: vec![] };
    let kept = plan_round(&config, 20.0, &r, &f, &plan);
    assert_eq!(kept.prefixes[0].cool_since, None);
    let err = trigger(&config, 5.0, &f, &plan, &[1, 2, 3], &[], None).unwrap_err().to_string();
    assert_eq!(err, "invalid prefix: needs at least 4 blocks of 16 tokens, got 3 tokens");
    let err = trigger(&config, 5.0, &f, &plan, &hot_tokens(), &["nope".into()], None).unwrap_err().to_string();
    assert_eq!(err, "invalid replicas: \"nope\" is not a routable replica");
}

#[test]
fn config_ranges_are_checked() {
    assert!(ReplicationConfig::default().validate().is_ok());
    let bad = ReplicationConfig { min_replicas: 1, ..ReplicationConfig::default() };
    assert_eq!(bad.validate().unwrap_err().to_string(), "invalid min_replicas: must be at least 2, got 1");
    let bad = ReplicationConfig { target_utilisation: 1.5, ..ReplicationConfig::default() };
    assert_eq!(bad.validate().unwrap_err().to_string(), "invalid target_utilisation: must be in (0, 1], got 1.5");
}

#[test]
fn decode_replicas_of_a_disaggregated_fleet_are_never_warmed() {
    // r2 and r3 decode; a plain one-token warm-up is no request their engines expect.
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    for i in 0..8 {
        let role = if i == 2 || i == 3 { crate::Role::Decode } else { crate::Role::Both };
        f.add_replica(ReplicaSpec { role, ..ReplicaSpec::new(format!("r{i}"), 10_000) }).unwrap();
    }
    store(&mut f, 0, &hot_tokens(), 0.0);
    let plan = plan_round(&ReplicationConfig::default(), 1.0, &report(&f, 0.3), &f, &ReplicationPlan::default());
    let targets: Vec<&str> = plan.prefixes[0].targets.iter().map(|t| t.replica.as_str()).collect();
    // Sized on the 6 replicas that compute prompts: 0.3 · 6 / 0.7 = 2.57 → 3 holders, r0 one.
    assert_eq!(targets, vec!["r1", "r4"]);
}
