//! Small simulations with exact expected outcomes.

use super::*;
use crate::trace::{TraceFormat, TraceRequest};
use kvmesh_core::policy::{Decision, PolicyKind};
use kvmesh_core::FleetView;
use rand::RngCore;

/// A tiny engine whose step times make small differences decisive (shared with the P/D tests).
pub(super) fn profile() -> EngineProfile {
    EngineProfile {
        name: "tiny".into(),
        // Slow enough that a 4-token difference is far outside token_load's 1 ms near-equal band.
        prefill_s_per_token: 1e-3,
        decode_s_per_token: 1e-4,
        step_overhead_s: 1e-3,
        chunk_tokens: 64,
        kv_tokens: 4096,
        max_batch: 16,
        cold_start_s: 0.0,
        kv_bytes_per_token: 131_072,
    }
}

fn config(delay: f64) -> SimConfig {
    SimConfig { replicas: 2, profile: profile(), block_size: 4, event_delay_s: delay, ..SimConfig::default() }
}

fn trace(reqs: &[(f64, &[u64])]) -> Trace {
    let requests = reqs
        .iter()
        .map(|&(at, ids)| TraceRequest {
            arrival_s: at,
            input_tokens: 4 * ids.len() as u32,
            output_tokens: 1,
            block_ids: ids.to_vec(),
            max_tokens: None,
            group: None,
        })
        .collect();
    Trace { format: TraceFormat::Mooncake, block_tokens: Some(4), requests, skipped: vec![] }
}

fn run(cfg: &SimConfig, t: &Trace) -> Run {
    let mut p = PolicyKind::TokenLoad.build();
    simulate(cfg, t, p.as_mut(), 7, &mut |_| {}).unwrap()
}

/// token_load without its pending-prefix credit: it then sees only what KV events say.
fn run_events_only(cfg: &SimConfig, t: &Trace) -> Run {
    use kvmesh_core::policy::{TokenLoadParams, TokenLoadPolicy};
    let mut p = TokenLoadPolicy::new(TokenLoadParams { pending_prefix_s: 0.0, ..TokenLoadParams::default() });
    simulate(cfg, t, &mut p, 7, &mut |_| {}).unwrap()
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-12, "{a} != {b}");
}

#[test]
fn known_prefix_gives_known_ttfts() {
    let t = trace(&[(0.0, &[1, 2, 3]), (1.0, &[1, 2, 9]), (1.0, &[5, 6, 7])]);
    let r = run(&config(0.0), &t);
    let [a, b, c] = [r.outcomes[0], r.outcomes[1], r.outcomes[2]];
    // A: 12 uncached tokens, one step.
    close(a.first_token_s - a.arrival_s, 1e-3 + 12.0 * 1e-3);
    // B shares A's first two blocks: it goes where they are cached and computes 4 tokens.
    assert_eq!((b.replica, b.cached_tokens), (a.replica, 8));
    close(b.first_token_s - b.arrival_s, 1e-3 + 4.0 * 1e-3);
    close(b.estimated_ttft_s, 1e-3 + 4.0 * 1e-3);
    // C shares nothing and arrives with B queued on A's replica: the other replica.
    assert_ne!(c.replica, a.replica);
    close(c.first_token_s - c.arrival_s, 1e-3 + 12.0 * 1e-3);
    assert!(r.fleet.bookings().is_empty(), "every booking released");
    let m = RunMetrics::of(&r, &config(0.0));
    assert_eq!((m.completed, m.rejected, m.slo_violations), (3, 0, 0));
    close(m.hit_rate, 8.0 / 36.0);
}

#[test]
fn event_delay_makes_the_router_stale_by_exactly_the_delay() {
    // Two warm-up requests make both replicas' event streams live (before a replica's first
    // event the router runs it on its own routing record, case C09). Then A's blocks are
    // stored at 1.013 s and reach the router 0.5 s later, at 1.513 s.
    let warm: [(f64, &[u64]); 2] = [(0.0, &[20]), (0.0, &[21])];
    let at = |b: f64| trace(&[warm[0], warm[1], (1.0, &[1, 2, 3]), (b, &[1, 2, 9])]);
    let warmed = run_events_only(&config(0.5), &at(2.0));
    assert_ne!(warmed.outcomes[0].replica, warmed.outcomes[1].replica);
    let before = run_events_only(&config(0.5), &at(1.512_999));
    close(before.outcomes[3].estimated_ttft_s, 1e-3 + 12.0 * 1e-3);
    let after = run_events_only(&config(0.5), &at(1.513_001));
    close(after.outcomes[3].estimated_ttft_s, 1e-3 + 4.0 * 1e-3);
    assert_eq!(after.outcomes[3].replica, after.outcomes[2].replica);
}

/// Wraps a core policy and counts its calls: the simulator must decide through kvmesh-core's
/// `Policy::pick` on a `FleetView`, as the node does.
#[derive(Debug)]
struct Counting {
    inner: Box<dyn Policy>,
    calls: u32,
    picks: Vec<u32>,
}

impl Policy for Counting {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn pending_prefix_s(&self) -> Option<f64> {
        self.inner.pending_prefix_s()
    }
    fn scrape_interval_s(&self) -> Option<f64> {
        self.inner.scrape_interval_s()
    }
    fn reads_kv_events(&self) -> bool {
        self.inner.reads_kv_events()
    }
    fn booked(&mut self, req: &RouteRequest, d: &Decision, b: kvmesh_core::load::BookingId, now: f64) {
        self.inner.booked(req, d, b, now);
    }
    fn observe(&mut self, events: &[kvmesh_core::load::FleetEvent]) {
        self.inner.observe(events);
    }
    fn pick(
        &mut self,
        req: &RouteRequest,
        view: &FleetView<'_>,
        rng: &mut dyn RngCore,
    ) -> Result<Decision, kvmesh_core::Error> {
        self.calls += 1;
        let d = self.inner.pick(req, view, rng)?;
        self.picks.push(d.replica.0);
        Ok(d)
    }
}

#[test]
fn every_policy_decides_through_the_core() {
    let t = trace(&[(0.0, &[1, 2]), (0.1, &[1, 3]), (0.2, &[4]), (0.3, &[1, 2, 5]), (0.4, &[6, 7])]);
    for kind in PolicyKind::ALL {
        let mut p = Counting { inner: kind.build(), calls: 0, picks: vec![] };
        let r = simulate(&config(0.0), &t, &mut p, 3, &mut |_| {}).unwrap();
        assert_eq!(p.calls, 5, "{kind}");
        assert_eq!(p.picks, r.outcomes.iter().map(|o| o.replica).collect::<Vec<_>>(), "{kind}");
        assert!(r.fleet.bookings().is_empty(), "{kind}");
    }
}

#[test]
fn same_seed_same_run() {
    let t = trace(&[(0.0, &[1, 2]), (0.0, &[3]), (0.0, &[4]), (0.0, &[5])]);
    let mut p = PolicyKind::Random.build();
    let a = simulate(&config(0.0), &t, p.as_mut(), 11, &mut |_| {}).unwrap();
    let b = simulate(&config(0.0), &t, p.as_mut(), 11, &mut |_| {}).unwrap();
    assert_eq!(a.outcomes, b.outcomes);
}

#[test]
fn floors_are_the_no_queue_prefill_times() {
    let t = trace(&[(0.0, &[1, 2, 3]), (1.0, &[1, 2, 9])]);
    let f = floors(&t, &profile().step(), 4);
    close(f.p99_uncached, 1e-3 + 12.0 * 1e-3);
    // With every reusable prefix cached, request 2 computes 4 tokens; p99 of {12, 4} is 12.
    close(f.p99_all_cached, 1e-3 + 12.0 * 1e-3);
    // One output token each: the E2E floor is the TTFT floor; no groups, no step floor.
    close(f.e2e_p99_all_cached, f.p99_all_cached);
    close(f.step_p99_all_cached, 0.0);
}

#[test]
fn floors_over_seeds_are_each_figures_mean() {
    let f = |x: f64| Floors {
        p99_uncached: x,
        p99_all_cached: 2.0 * x,
        e2e_p99_all_cached: 3.0 * x,
        step_p99_all_cached: 4.0 * x,
        output_tps_ceiling: 5.0 * x,
    };
    assert_eq!(Floors::mean(&[f(1.0), f(2.0)]), f(1.5));
    assert_eq!(Floors::mean(&[]), f(0.0));
}

/// Requests of `(arrival, block ids, output tokens, group)`, 4 tokens a block.
fn grouped(reqs: &[(f64, &[u64], u32, u32)]) -> Trace {
    let mut t = trace(&reqs.iter().map(|&(at, ids, _, _)| (at, ids)).collect::<Vec<_>>());
    for (r, &(_, _, out, g)) in t.requests.iter_mut().zip(reqs) {
        (r.output_tokens, r.group) = (out, Some(g));
    }
    t
}

#[test]
fn the_e2e_and_step_floors_are_each_request_alone_decoding_in_a_batch_of_one() {
    // A one-block prompt (4 tokens): TTFT alone 1 ms + 4 × 1 ms = 5 ms; each further token a
    // decode step of 1 ms + 0.1 ms. Group 0 runs from 0 to request 2's finish at
    // 0.5 + 5 ms + 2 × 1.1 ms. Group 1 is one 100-token prompt, two 64-token chunks:
    // 2 × 1 ms + 100 ms, then one decode step.
    let long: Vec<u64> = (3..28).collect();
    let t = grouped(&[(0.0, &[1], 1, 0), (0.5, &[2], 3, 0), (2.0, &long, 2, 1)]);
    let f = floors(&t, &profile().step(), 4);
    close(f.e2e_p99_all_cached, 0.102 + 1.1e-3);
    close(f.step_p99_all_cached, 0.5 + 5e-3 + 2.0 * 1.1e-3);
    // 6 output tokens from 0 to the last finish, 2 + 0.1031 s.
    close(f.output_tps_ceiling, 6.0 / (2.0 + 0.102 + 1.1e-3));
    // Apart in time, nothing queues or shares a batch: the simulated fleet meets both floors
    // (what makes them floors: the engine serves a lone request in exactly that time).
    let cfg = config(0.0);
    let m = RunMetrics::of(&run(&cfg, &t), &cfg);
    close(m.e2e_p99, f.e2e_p99_all_cached);
    close(m.step_p99, f.step_p99_all_cached);
    close(m.output_tps, f.output_tps_ceiling);
}

#[test]
fn the_no_queue_p99_is_each_request_alone_with_the_cache_hits_it_got() {
    // One replica. Two 4-token prompts at once: the second waits for the first's 5 ms step.
    // Later a prompt reusing the first's block computes only its own 4 tokens.
    let cfg = SimConfig { replicas: 1, ..config(0.0) };
    let t = trace(&[(0.0, &[1]), (0.0, &[2]), (1.0, &[1, 3])]);
    let r = run(&cfg, &t);
    assert_eq!(r.outcomes.iter().map(|o| o.cached_tokens).collect::<Vec<_>>(), vec![0, 0, 4]);
    let m = RunMetrics::of(&r, &cfg);
    // Each alone: 1 ms step + 4 tokens × 1 ms (the third's cached 4 not computed again).
    close(m.ttft_p99_no_queue, 0.005);
    // The waiting one sets the real p99: its own 5 ms after the first's 5 ms.
    close(m.ttft_p99, 0.010);
}

#[test]
fn routers_take_requests_in_turn_and_simultaneous_ones_do_not_collide() {
    // Two routers, two replicas. Two warm-up requests (one per router) make each router know
    // the other is active; then two unrelated prompts arrive at the same instant, one per
    // router. Both see two idle replicas at equal cost; by rank, router 0 takes the first and
    // router 1 the second, so neither waits: TTFT = one 1 ms step + 12 tokens × 1 ms.
    let cfg = SimConfig { routers: 2, ..config(0.0) };
    let t = trace(&[(0.0, &[1, 2, 3]), (0.0, &[4, 5, 6]), (1.0, &[7, 8, 9]), (1.0, &[10, 11, 12])]);
    let r = run(&cfg, &t);
    assert_eq!(r.outcomes.iter().map(|o| o.router).collect::<Vec<_>>(), vec![0, 1, 0, 1]);
    let [c, d] = [r.outcomes[2], r.outcomes[3]];
    assert_ne!(c.replica, d.replica);
    close(c.first_token_s - c.arrival_s, 0.013);
    close(d.first_token_s - d.arrival_s, 0.013);
}

#[test]
fn four_routers_release_every_booking_everywhere() {
    let reqs: Vec<(f64, Vec<u64>)> = (0..40).map(|i| (i as f64 * 0.002, vec![1, 2, 100 + i])).collect();
    let refs: Vec<(f64, &[u64])> = reqs.iter().map(|(t, v)| (*t, v.as_slice())).collect();
    let t = trace(&refs);
    for gossip in [true, false] {
        let cfg = SimConfig { routers: 4, gossip, ..config(0.0) };
        let r = run(&cfg, &t);
        assert_eq!(r.outcomes.iter().map(|o| o.router).collect::<Vec<_>>(), (0..40).map(|i| i % 4).collect::<Vec<_>>());
        assert!(r.outcomes.iter().all(|o| o.finish_s.is_finite()));
        assert!(r.fleet.bookings().is_empty(), "router 0 still holds {} bookings", r.fleet.bookings().len());
    }
    let bad = SimConfig { routers: 0, ..config(0.0) };
    let mut p = PolicyKind::TokenLoad.build();
    assert_eq!(simulate(&bad, &t, p.as_mut(), 7, &mut |_| {}).unwrap_err(), "routers must be at least 1");
}

#[test]
fn replication_warms_a_hot_prompt_that_appears_and_spends_the_kv_it_reports() {
    use crate::workload::scenarios::{Scenario, ScenarioParams};
    let t = Scenario::HotRotating.generate(&ScenarioParams { requests: 3000, rate: 60.0, seed: 1 });
    let base = SimConfig { replicas: 8, ..SimConfig::default() };
    let with = SimConfig { replication: Some(ReplicationConfig::default()), ..base.clone() };
    let plain = simulate(&base, &t, PolicyKind::TokenLoad.build().as_mut(), 1, &mut |_| {}).unwrap();
    let replicated = simulate(&with, &t, PolicyKind::TokenLoad.build().as_mut(), 1, &mut |_| {}).unwrap();
    assert!(plain.replication.is_none());
    let stats = replicated.replication.unwrap();
    // Three hot prompts in 50 s (a new one every 20 s), each planned and warmed.
    assert_eq!(stats.prefixes_planned, 3);
    assert_eq!((stats.warmups, stats.warm_tokens), (WARMUPS, WARMUPS * 3072));
    assert_eq!(stats.fleet_blocks, 8 * 29_375);
    assert!(stats.planned_blocks_peak >= 192 && stats.planned_blocks_mean > 0.0);
    // Every warm-up ended: the router holds no booking, and no trace request was lost.
    assert!(replicated.fleet.bookings().is_empty());
    assert!(replicated.outcomes.iter().all(|o| o.finish_s.is_finite()));
    let (p, r) = (RunMetrics::of(&plain, &base), RunMetrics::of(&replicated, &with));
    assert!(r.hit_rate >= p.hit_rate - 0.002, "hit rate {} vs {}", r.hit_rate, p.hit_rate);
    assert_eq!(r.warmups, WARMUPS);
}

/// Warm-ups sent in the 3,000-request hot-rotating run above (seeded: exact).
const WARMUPS: u64 = 10;

#[test]
fn an_autoscaled_pool_starts_replicas_after_their_cold_start_and_counts_gpu_time() {
    use crate::workload::scenarios::{Scenario, ScenarioParams};
    use kvmesh_core::autoscale::AutoscaleConfig;
    // 30 s at 10 req/s, then 30 s at 40 req/s (rate steps 1, 4).
    let mut t = Scenario::Shared { percent: 50 }.generate(&ScenarioParams { requests: 1500, rate: 10.0, seed: 3 });
    crate::workload::arrivals::truncate(&mut t, 300);
    let mut burst = Scenario::Shared { percent: 50 }.generate(&ScenarioParams { requests: 1200, rate: 40.0, seed: 4 });
    for r in &mut burst.requests {
        r.arrival_s += 30.0;
    }
    t.requests.retain(|r| r.arrival_s < 30.0);
    t.requests.extend(burst.requests);
    let run = |autoscaler| {
        let scaling = ScalingConfig {
            autoscaler,
            policy: AutoscaleConfig { max_replicas: 16, cold_start_s: 20.0, ..AutoscaleConfig::default() },
            cold_start_s: 20.0,
            initial: 2,
        };
        let config = SimConfig { replicas: 16, scaling: Some(scaling), ..SimConfig::default() };
        let r = simulate(&config, &t, PolicyKind::TokenLoad.build().as_mut(), 1, &mut |_| {}).unwrap();
        let m = RunMetrics::of(&r, &config);
        // One timeline point per decision, in time order, every 2 s.
        let at: Vec<f64> = r.scale_timeline.iter().map(|p| p.at).collect();
        assert_eq!(at.len() as u64, r.scaling.unwrap().decisions);
        assert!(at.windows(2).all(|w| (w[1] - w[0] - 2.0).abs() < 1e-9), "{at:?}");
        (r.scaling.unwrap(), m, r.outcomes.iter().all(|o| o.finish_s.is_finite()), r.fleet.bookings().is_empty())
    };
    let (kvmesh, km, done, clean) = run(Autoscaler::Kvmesh);
    assert!(done && clean, "every request served and released");
    let (reactive, rm, _, _) = run(Autoscaler::Reactive);
    // Both scale up for the step; the reactive baseline, blind to its starting replicas while
    // the ready ones stay hot for 20 s, asks for more than kvmesh does.
    assert!(kvmesh.replicas_started > 0 && reactive.replicas_started > 0);
    assert!(kvmesh.max_desired <= reactive.max_desired, "kvmesh {kvmesh:?} vs reactive {reactive:?}");
    // GPU time: at least the two initial replicas over the run, at most the whole pool.
    let span = t.requests.last().unwrap().arrival_s;
    assert!(km.gpu_seconds >= 2.0 * span && km.gpu_seconds <= 16.0 * (span + 60.0), "{}", km.gpu_seconds);
    assert!(rm.gpu_seconds >= 2.0 * span);
    assert!(km.slo_attainment > 0.0 && km.slo_attainment <= 1.0);
}

/// Three prompts on one replica whose KV holds 1,024 blocks: A (700 blocks) runs; B (400)
/// does not fit beside it and waits at the router; C (200), arriving behind B, waits too.
fn admission_run(queue_limit: Option<usize>) -> Run {
    let ids = |from: u64, n: u64| (from..from + n).collect::<Vec<u64>>();
    let (a, b, c) = (ids(0, 700), ids(1_000, 400), ids(2_000, 200));
    let t = trace(&[(0.0, &a), (0.01, &b), (0.02, &c)]);
    let admission = queue_limit.map(|queue_limit| AdmissionConfig { queue_limit, max_wait_s: 30.0, gate: None });
    let cfg = SimConfig { replicas: 1, admission, ..config(0.0) };
    run(&cfg, &t)
}

#[test]
fn admission_control_holds_requests_while_kv_is_short_and_routes_the_smallest_first() {
    let r = admission_run(Some(256));
    let [a, b, c] = [r.outcomes[0], r.outcomes[1], r.outcomes[2]];
    assert!(r.outcomes.iter().all(|o| !o.rejected && o.finish_s.is_finite()), "{:?}", r.outcomes);
    // B and C start only once A is done, and C (smaller) before B although B came first.
    assert!(b.first_token_s > a.finish_s && c.first_token_s > a.finish_s, "{a:?} {b:?} {c:?}");
    assert!(c.first_token_s < b.first_token_s, "{b:?} {c:?}");
    assert!(r.fleet.bookings().is_empty());
    // Without admission control all three pile onto the replica and its queue serves them in
    // arrival order: B before C.
    let r = admission_run(None);
    let [b, c] = [r.outcomes[1], r.outcomes[2]];
    assert!(b.first_token_s < c.first_token_s, "{b:?} {c:?}");
}

#[test]
fn admission_control_refuses_beyond_its_queue_and_counts_it_late() {
    let r = admission_run(Some(1));
    let rejected: Vec<bool> = r.outcomes.iter().map(|o| o.rejected).collect();
    assert_eq!(rejected, [false, false, true]);
    let m = RunMetrics::of(&r, &SimConfig { replicas: 1, ..config(0.0) });
    assert_eq!((m.rejected, m.slo_violations), (1, 1));
    assert!(r.fleet.bookings().is_empty());
}

/// One replica, a TTFT SLO of 0.5 s: A, B and C (400 tokens each, 0.4 s of prefill) arrive
/// 10 ms apart, then D (20 tokens).
fn gated_run(gate: bool) -> Run {
    let ids = |from: u64, n: u64| (from..from + n).collect::<Vec<u64>>();
    let (a, b, c, d) = (ids(0, 100), ids(1_000, 100), ids(2_000, 100), ids(3_000, 5));
    let t = trace(&[(0.0, &a), (0.01, &b), (0.02, &c), (0.03, &d)]);
    let gate = gate.then(|| TtftGate::new(0.5).unwrap());
    let admission = Some(AdmissionConfig { gate, ..AdmissionConfig::default() });
    run(&SimConfig { replicas: 1, admission, ttft_slo_s: 0.5, ..config(0.0) }, &t)
}

#[test]
fn the_ttft_gate_holds_requests_that_would_miss_the_slo_so_a_small_one_behind_them_does_not() {
    let ttfts = |r: &Run| r.outcomes.iter().map(|o| o.first_token_s - o.arrival_s).collect::<Vec<f64>>();
    let late = |r: &Run| ttfts(r).iter().map(|&t| t > 0.5).collect::<Vec<bool>>();
    // Without the gate the engine serves in arrival order: D waits behind B and C.
    let open = gated_run(false);
    assert_eq!(late(&open), [false, true, true, true], "{:?}", ttfts(&open));
    // With it, B and C wait at the router (the queue ahead of them is more than half the
    // SLO), D goes straight behind A and meets the SLO; B and C are still served.
    let gated = gated_run(true);
    assert_eq!(late(&gated), [false, true, true, false], "{:?}", ttfts(&gated));
    assert!(gated.outcomes.iter().all(|o| !o.rejected && o.finish_s.is_finite()));
    assert!(gated.fleet.bookings().is_empty());
    let (g, o) = (ttfts(&gated), ttfts(&open));
    close(g[0], o[0]);
    assert!(g[3] < o[3] / 2.0, "{g:?} {o:?}");
}

#[test]
fn raise_to_keeps_the_larger_load_of_each_interval_and_the_longer_run() {
    let mut known = vec![5.0, 1.0];
    super::scaling::raise_to(&mut known, &[3.0, 4.0, 2.0]);
    assert_eq!(known, [5.0, 4.0, 2.0]);
    super::scaling::raise_to(&mut known, &[6.0]);
    assert_eq!(known, [6.0, 4.0, 2.0]);
}

#[test]
fn group_times_run_from_first_arrival_to_last_finish() {
    let req = |group| TraceRequest {
        arrival_s: 0.0,
        input_tokens: 4,
        output_tokens: 1,
        block_ids: vec![],
        max_tokens: None,
        group,
    };
    let out = |arrival_s: f64, finish_s: f64| Outcome {
        arrival_s,
        replica: 0,
        router: 0,
        first_token_s: finish_s,
        finish_s,
        prompt_tokens: 4,
        cached_tokens: 0,
        output_tokens: 1,
        estimated_ttft_s: 0.0,
        rejected: !finish_s.is_finite(),
    };
    let requests = [req(Some(1)), req(Some(0)), req(Some(1)), req(None), req(Some(0)), req(Some(2))];
    let outcomes = [out(1.0, 3.0), out(0.5, 1.0), out(1.5, 9.0), out(0.0, 99.0), out(0.0, 2.0), out(4.0, f64::NAN)];
    // Group 0: 0.0 → 2.0; group 1: 1.0 → 9.0; group 2 never finished; the ungrouped one ignored.
    assert_eq!(group_times(&requests, &outcomes), vec![2.0, 8.0, f64::INFINITY]);
    assert!(group_times(&requests[3..4], &outcomes[3..4]).is_empty());
}

#[test]
fn output_info_hints_and_names() {
    assert_eq!(OutputInfo::MaxTokens.hint(300), None);
    assert_eq!(OutputInfo::Learned.hint(300), None);
    assert_eq!(OutputInfo::Hint.hint(300), Some(512));
    assert_eq!(OutputInfo::Hint.hint(512), Some(512));
    assert_eq!(OutputInfo::Oracle.hint(300), Some(300));
    assert_eq!(OutputInfo::Oracle.hint(0), Some(1));
    for n in OutputInfo::NAMES {
        assert_eq!(n.parse::<OutputInfo>().unwrap().to_string(), n);
    }
    assert!("soon".parse::<OutputInfo>().unwrap_err().starts_with("unknown output info \"soon\""));
}

/// With `--output-info learned` the router books what requests alike produced, not their
/// `max_tokens`; the preemptions and step times a grouped trace is judged by are reported.
#[test]
fn learned_output_lengths_book_less_than_max_tokens_and_steps_are_timed() {
    // 12 requests of one leading prompt (6 blocks of 4 tokens), in two groups, max_tokens
    // 1,000 against true outputs of 8.
    let requests: Vec<TraceRequest> = (0..12u64)
        .map(|i| TraceRequest {
            arrival_s: i as f64,
            input_tokens: 24,
            output_tokens: 8,
            block_ids: vec![1, 2, 3, 4, 5, 100 + i],
            max_tokens: Some(1000),
            group: Some(i as u32 / 6),
        })
        .collect();
    let t = Trace { format: TraceFormat::Mooncake, block_tokens: Some(4), requests, skipped: vec![] };
    for info in [OutputInfo::MaxTokens, OutputInfo::Learned] {
        let cfg = SimConfig { output_info: info, ..config(0.0) };
        let r = run(&cfg, &t);
        let m = RunMetrics::of(&r, &cfg);
        assert_eq!((m.completed, m.steps, m.preemptions), (12, 2, 0));
        // Each group: 6 arrivals 1 s apart, the last done within a second of arriving.
        assert!(m.step_p50 > 5.0 && m.step_p50 < 6.0 && m.step_p99 < 6.0, "{m:?}");
        // The next request of that prompt: 8 tokens expected once learned, else its max_tokens.
        let tokens = prompt_tokens(&t.requests[0], 0, Some(4));
        let next = RouteRequest::new(r.fleet.hasher(), &tokens, Some(1000));
        let want = if info == OutputInfo::Learned { 8 } else { 1000 };
        assert_eq!(r.fleet.expected_output_tokens(&next), want, "{info}");
        assert_eq!(r.fleet.bookings().outputs().observed(), 12);
        assert_eq!(r.fleet.bookings().outputs().keys(), 1, "one leading prompt");
    }
}
