//! Autoscaling tests: no cascade while replicas start (case C19), bursts, delayed scale-down,
//! the trend, and the baselines' behaviour the policy is measured against.

use super::*;

/// 10,000 tokens/s per replica, 70 % target: 7,000 tokens/s per replica.
const CAP: f64 = 10_000.0;

/// The defaults without the headroom for short bursts, for tests of the other rules (the
/// headroom holds the last minute's load, which would mask them).
fn no_headroom() -> AutoscaleConfig {
    AutoscaleConfig { headroom_quantile: 0.0, ..AutoscaleConfig::default() }
}

fn inputs(now: f64, demand: f64, ready: u32, starting: Vec<f64>) -> PoolInputs {
    PoolInputs {
        now,
        demand_tokens_per_s: demand,
        capacity_tokens_per_s: CAP,
        ready,
        starting,
        cold_start_s: 60.0,
        queued_tokens: 0.0,
    }
}

/// Evaluates `policy` every 2 s for `secs` at a constant `demand`; started replicas never
/// become ready (a cold start longer than the run). Returns each decision's `desired`.
fn run_cold(policy: &mut dyn ScalePolicy, ready: u32, demand: f64, secs: u32) -> Vec<u32> {
    let mut starting: Vec<f64> = Vec::new();
    let mut out = Vec::new();
    for k in 0..=secs / 2 {
        let now = f64::from(k) * 2.0;
        let d = policy.decide(&inputs(now, demand, ready, starting.clone()));
        let on_hand = ready + starting.len() as u32;
        for _ in on_hand..d.desired {
            starting.push(now);
        }
        out.push(d.desired);
    }
    out
}

#[test]
fn starting_replicas_count_so_there_is_no_cascade() {
    // Load jumps to 56,000 tokens/s on 4 ready replicas: 8 needed at 70 %.
    let mut kvmesh = ColdStartAware::new(AutoscaleConfig::default());
    let desired = run_cold(&mut kvmesh, 4, 56_000.0, 40);
    assert_eq!(desired[0], 8);
    assert!(desired.iter().all(|&d| d == 8), "kvmesh kept asking: {desired:?}");
    // The reactive baseline reads the same hot ready replicas every time and adds again.
    let mut reactive = Reactive::new(AutoscaleConfig::default());
    let desired = run_cold(&mut reactive, 4, 56_000.0, 40);
    assert_eq!(&desired[..4], &[8, 12, 16, 20]);
    assert_eq!(*desired.last().unwrap(), 64, "capped at max_replicas");
}

#[test]
fn a_burst_scales_at_once_and_holds_the_pool() {
    let config = AutoscaleConfig::default();
    let mut p = ColdStartAware::new(config.clone());
    // A quiet minute on 2 replicas.
    for k in 0..30 {
        let d = p.decide(&inputs(f64::from(k) * 2.0, 7_000.0, 2, vec![]));
        assert_eq!((d.desired, d.reason), (2, ScaleReason::HoldDown), "one replica would do, but not before 120 s");
    }
    // 140,000 tokens/s arrive: the 6 s panic window's mean, (3 · 7,000 + 140,000) / 4, needs
    // 6 ≥ 2 × 2 replicas: panic, and the pool grows at once.
    let d = p.decide(&inputs(60.0, 140_000.0, 2, vec![]));
    assert!(d.panic);
    assert_eq!((d.desired, d.reason), (BURST_DESIRED, ScaleReason::ScaleUp));
    // The burst ends: no scale-down while the panic holds (until 120 s), nor while the need
    // of the last cold start (60 s) was higher; then the pool follows that need down.
    let mut shrinks = Vec::new();
    let mut on_hand = BURST_DESIRED;
    for k in 1..200 {
        let now = 60.0 + f64::from(k) * 2.0;
        let d = p.decide(&inputs(now, 7_000.0, on_hand, vec![]));
        if d.reason == ScaleReason::ScaleDown {
            shrinks.push((now, d.desired));
        } else {
            assert_eq!(d.desired, on_hand, "grew after the burst at {now}: {d:?}");
        }
        assert!(now > 120.0 || d.desired == BURST_DESIRED, "shrank during the panic at {now}: {d:?}");
        on_hand = d.desired;
    }
    assert_eq!(shrinks.first().map(|s| s.0), Some(122.0));
    assert_eq!(shrinks.last(), Some(&(SHRUNK_AT, 1)));
    assert!(shrinks.windows(2).all(|w| w[1].1 < w[0].1), "shrinks only: {shrinks:?}");
}

/// The damped-trend forecast of the spike above: level 73,500 + trend 6,650 × (0.9 + … + 0.9³⁰).
const BURST_DESIRED: u32 = 19;
/// When the pool is back to one replica after the burst: the forecast (level smoothing 0.5 per
/// evaluation) needs one replica again from 74 s, and the window keeps 60 s of needs.
const SHRUNK_AT: f64 = 134.0;

#[test]
fn a_rising_trend_is_forecast_over_the_cold_start() {
    let mut p = ColdStartAware::new(AutoscaleConfig::default());
    let mut last = None;
    // Load rises by 1,000 tokens/s every 2 s from 7,000.
    for k in 0..20 {
        let demand = 7_000.0 + 1_000.0 * f64::from(k);
        last = Some(p.decide(&inputs(f64::from(k) * 2.0, demand, 4, vec![])));
    }
    let d = last.unwrap();
    // Now at 26,000 tokens/s, which 4 replicas serve at 70 %; the damped trend looks ahead
    // to ~33,400 and asks for the 5th before the load gets there (a cold start later).
    assert!(d.forecast_tokens_per_s > 33_000.0 && d.forecast_tokens_per_s < 34_000.0, "{d:?}");
    assert_eq!((d.desired, d.reason), (5, ScaleReason::ScaleUp));
}

#[test]
fn a_backlog_is_sized_for_too() {
    let mut p = ColdStartAware::new(AutoscaleConfig::default());
    // 14,000 tokens/s needs 2 replicas at 70 %; 630,000 queued tokens to drain in 30 s add
    // 21,000/s, which at full load (10,000 per replica) take ⌈35,000 / 10,000⌉ = 4.
    let d = p.decide(&PoolInputs { queued_tokens: 630_000.0, ..inputs(0.0, 14_000.0, 2, vec![]) });
    assert_eq!((d.desired, d.reason), (4, ScaleReason::ScaleUp));
    assert_eq!(d.forecast_tokens_per_s, 35_000.0);
}

#[test]
fn knative_sizes_on_its_windows() {
    let mut k = Knative::new(AutoscaleConfig::default());
    for i in 0..30 {
        k.decide(&inputs(f64::from(i) * 2.0, 14_000.0, 2, vec![]));
    }
    let d = k.decide(&inputs(60.0, 14_000.0, 2, vec![]));
    assert_eq!((d.desired, d.reason, d.panic), (2, ScaleReason::Hold, false));
    // A burst: the 6 s panic window (4 samples) needs ⌈(3·14,000 + 70,000) / 4 / 7,000⌉ = 4 ≥
    // 2 × 2 ready: panic, sized on it (the 60 s window alone would say 3).
    let d = k.decide(&inputs(62.0, 70_000.0, 2, vec![]));
    assert_eq!((d.desired, d.reason, d.panic), (4, ScaleReason::Burst, true));
}

#[test]
fn config_ranges_are_checked() {
    assert!(AutoscaleConfig::default().validate().is_ok());
    let bad = AutoscaleConfig { min_replicas: 8, max_replicas: 4, ..AutoscaleConfig::default() };
    assert_eq!(
        bad.validate().unwrap_err().to_string(),
        "invalid max_replicas: must be positive and at least min_replicas (8), got 4"
    );
    let bad = AutoscaleConfig { target_utilisation: 0.0, ..AutoscaleConfig::default() };
    assert_eq!(bad.validate().unwrap_err().to_string(), "invalid target_utilisation: must be in (0, 1], got 0");
    let bad = AutoscaleConfig { headroom_quantile: 1.5, ..AutoscaleConfig::default() };
    assert_eq!(bad.validate().unwrap_err().to_string(), "invalid headroom_quantile: must be in [0, 1], got 1.5");
    assert!(AutoscaleConfig { headroom_quantile: f64::NAN, ..AutoscaleConfig::default() }.validate().is_err());
    assert!(AutoscaleConfig { headroom_window_s: 0.0, ..AutoscaleConfig::default() }.validate().is_err());
}

#[test]
fn a_dip_shorter_than_a_cold_start_keeps_the_pool() {
    let mut p = ColdStartAware::new(no_headroom());
    // 35,000 tokens/s on 5 replicas (7,000 each at 70 %) for two minutes.
    for k in 0..60 {
        let d = p.decide(&inputs(f64::from(k) * 2.0, 35_000.0, 5, vec![]));
        assert_eq!(d.desired, 5);
    }
    // The load halves for 50 s, less than the 60 s cold start: the pool stays.
    for k in 60..85 {
        let d = p.decide(&inputs(f64::from(k) * 2.0, 17_500.0, 5, vec![]));
        assert_eq!((d.desired, d.reason), (5, ScaleReason::HoldDown), "at {}", k * 2);
    }
    // A cold start after the last need for 5 (118 s) it shrinks, at 180 s, following the
    // smoothed forecast down to what the lower load needs (3).
    let shrunk: Vec<u32> =
        (85..100).map(|k| p.decide(&inputs(f64::from(k) * 2.0, 17_500.0, 5, vec![])).desired).collect();
    assert_eq!(shrunk, [5, 5, 5, 5, 5, 4, 4, 3, 3, 3, 3, 3, 3, 3, 3]);
}

#[test]
fn a_new_leader_resumes_from_the_committed_decision() {
    // A fresh policy (a node that just became Raft leader) told the last committed count
    // holds it for a window although its own forecast, without history, needs fewer.
    // The old leader asked for 9; 6 are ready and 1 has started so far (7 on hand), and the
    // load needs 5.
    let mut p = ColdStartAware::new(AutoscaleConfig::default());
    p.resume(100.0, 9);
    let d = p.decide(&inputs(100.0, 35_000.0, 6, vec![99.0]));
    assert_eq!((d.desired, d.starting), (9, 1));
    // Above the 7 on hand, but only because the old leader's count is held: holding.
    assert_eq!(d.reason, ScaleReason::HoldDown);
    // Without it, a fresh policy would hold only what is on hand.
    let d = ColdStartAware::new(AutoscaleConfig::default()).decide(&inputs(100.0, 35_000.0, 6, vec![99.0]));
    assert_eq!(d.desired, 7);
    // …and lets it go a cold start (and an interval) later.
    let d = p.decide(&inputs(162.0, 35_000.0, 9, vec![]));
    assert_eq!((d.desired, d.reason), (5, ScaleReason::ScaleDown));
}

#[test]
fn a_new_leader_does_not_hold_what_it_only_shadowed() {
    // A follower shadowing the leader saw 98,000 tokens/s (14 replicas at 7,000 each) before
    // the load settled at 63,000 (9); the leader committed 9. Taking over, the follower holds
    // the committed 9, not its own uncommitted 14: the leader change is not a scale-up.
    let shadow = |p: &mut ColdStartAware| {
        assert_eq!(p.decide(&inputs(0.0, 98_000.0, 9, vec![])).desired, 14);
        for k in 1..20 {
            p.decide(&inputs(f64::from(k) * 2.0, 63_000.0, 9, vec![]));
        }
    };
    let mut follower = ColdStartAware::new(no_headroom());
    shadow(&mut follower);
    follower.resume(40.0, 9);
    assert_eq!(follower.decide(&inputs(40.0, 63_000.0, 9, vec![])).desired, 9);
    // Still leading on its own history (no resume), it would hold the 14 for the window.
    let mut alone = ColdStartAware::new(no_headroom());
    shadow(&mut alone);
    assert_eq!(alone.decide(&inputs(40.0, 63_000.0, 9, vec![])).desired, 14);
    // New load after the takeover counts at once: a jump to 126,000 moves the warm forecast
    // (level and rising trend over the cold start) to 117,474 tokens/s, 17 replicas.
    let d = follower.decide(&inputs(42.0, 126_000.0, 9, vec![]));
    assert_eq!((d.desired, d.forecast_tokens_per_s.round()), (17, 117_474.0));
}

#[test]
fn the_scale_down_window_defaults_to_the_cold_start() {
    let mut short = ColdStartAware::new(AutoscaleConfig { scale_down_delay_s: 10.0, ..no_headroom() });
    short.decide(&inputs(0.0, 35_000.0, 5, vec![]));
    // 12 s later the load fell to 7,000: with a 10 s window the pool shrinks to what the
    // smoothed forecast, (7,000 + 35,000) / 2, needs; the default (the 60 s cold start) holds.
    assert_eq!(short.decide(&inputs(12.0, 7_000.0, 5, vec![])).desired, 3);
    let mut default = ColdStartAware::new(no_headroom());
    default.decide(&inputs(0.0, 35_000.0, 5, vec![]));
    assert_eq!(default.decide(&inputs(12.0, 7_000.0, 5, vec![])).desired, 5);
    let bad = AutoscaleConfig { scale_down_delay_s: -1.0, ..AutoscaleConfig::default() };
    assert_eq!(bad.validate().unwrap_err().to_string(), "invalid scale_down_delay: must be ≥ 0 seconds, got -1");
}

#[test]
fn a_held_count_the_actuator_never_delivered_is_holding_not_growing() {
    let mut p = ColdStartAware::new(AutoscaleConfig { panic_ratio: 100.0, ..no_headroom() });
    // 35,000 tokens/s on 3 ready replicas: 5 needed at 70 %.
    let d = p.decide(&inputs(0.0, 35_000.0, 3, vec![]));
    assert_eq!((d.desired, d.reason), (5, ScaleReason::ScaleUp));
    // The load stops and no replica was added: 5 is held for the window (a cold start), but
    // nothing needs it now, so the reason says holding rather than growing.
    for k in 1..=30 {
        let d = p.decide(&inputs(f64::from(k) * 2.0, 0.0, 3, vec![]));
        assert_eq!((d.desired, d.reason), (5, ScaleReason::HoldDown), "at {} s", k * 2);
    }
    // A cold start on, the window holds only the falling forecast's needs (17,500 tokens/s
    // at 2 s: 3 replicas), what is on hand.
    let d = p.decide(&inputs(62.0, 0.0, 3, vec![]));
    assert_eq!((d.desired, d.reason), (3, ScaleReason::HoldDown));
    // 70,000 tokens/s on 3 replicas: 10 needed; then none on 4 (one delivered): today's
    // need (the falling forecast, 32,800 tokens/s: 5) is above the 4 on hand, but the 10
    // asked for is the held need, so the reason is holding, not growing.
    let d = p.decide(&inputs(64.0, 70_000.0, 3, vec![]));
    assert_eq!((d.desired, d.reason), (10, ScaleReason::ScaleUp));
    let d = p.decide(&inputs(66.0, 0.0, 4, vec![]));
    assert_eq!((d.desired, d.reason, (d.forecast_tokens_per_s / 7_000.0).ceil()), (10, ScaleReason::HoldDown, 5.0));
}

#[test]
fn bursty_load_is_sized_for_its_bursts_not_its_mean() {
    // Every 20 s, 6 s at 35,000 tokens/s and 14 s at 7,000: a mean of 15,400 tokens/s (3
    // replicas at 70 %), bursts that need 5; a 10 s cold start, so each burst is over before a
    // replica started for it serves. The actuator delivers every decision at once.
    let run = |config: AutoscaleConfig| {
        let mut p = ColdStartAware::new(config);
        let mut on_hand = 3;
        (0..90)
            .map(|k| {
                let demand = if k % 10 < 3 { 35_000.0 } else { 7_000.0 };
                let d =
                    p.decide(&PoolInputs { cold_start_s: 10.0, ..inputs(f64::from(k) * 2.0, demand, on_hand, vec![]) });
                on_hand = d.desired;
                d.desired
            })
            .collect::<Vec<u32>>()
    };
    let with = run(AutoscaleConfig::default());
    let without = run(no_headroom());
    // With the headroom the pool keeps what the bursts need (5; 6 while a burst's trend is
    // forecast); without it, it shrinks to 2 between bursts and grows again for each one.
    assert_eq!((with[30..].iter().min(), with[30..].iter().max()), (Some(&5), Some(&6)), "{with:?}");
    assert_eq!((without[30..].iter().min(), without[30..].iter().max()), (Some(&2), Some(&6)), "{without:?}");
    let grows = |d: &[u32]| d.windows(2).filter(|w| w[1] > w[0]).count();
    assert_eq!((grows(&with[30..]), grows(&without[30..])), (6, 17));
}

#[test]
fn a_sustained_drop_shrinks_once_the_headroom_window_and_a_cold_start_have_passed() {
    let mut p = ColdStartAware::new(AutoscaleConfig::default());
    for k in 0..60 {
        assert_eq!(p.decide(&inputs(f64::from(k) * 2.0, 35_000.0, 5, vec![])).desired, 5);
    }
    // The load falls to 7,000 tokens/s for good at 120 s.
    let first_shrink = (60..200)
        .map(|k| (f64::from(k) * 2.0, p.decide(&inputs(f64::from(k) * 2.0, 7_000.0, 5, vec![])).desired))
        .find(|&(_, d)| d < 5);
    // The headroom keeps sizing for 35,000 until the new load fills 80 % of its 60 s window
    // (about 48 s: the need falls at ~170 s), then the scale-down window holds that need for a
    // cold start (60 s): the pool shrinks, to what the new load needs, 108 s after the drop.
    assert_eq!(first_shrink, Some((228.0, 1)));
}

#[test]
fn a_clock_stepped_back_holds_an_old_need_or_a_panic_one_window_not_an_hour() {
    // A burst at t = 1,000 s on 2 replicas: 14 needed, a panic. Then the clock steps back an
    // hour and the load is a tenth: the need and the panic (stamped an hour ahead) hold the
    // pool one window (60 s) from the step, not until the clock catches up.
    let mut p = ColdStartAware::new(no_headroom());
    let d = p.decide(&inputs(1_000.0, 98_000.0, 2, vec![]));
    assert_eq!((d.desired, d.panic), (14, true));
    let (mut shrank_at, mut last) = (None, 0);
    for k in 0..40 {
        let now = -2_600.0 + f64::from(k) * 2.0;
        let d = p.decide(&inputs(now, 9_800.0, 14, vec![]));
        if d.reason == ScaleReason::ScaleDown {
            shrank_at = shrank_at.or(Some((now, d.panic)));
        }
        last = d.desired;
    }
    // The need re-stamped at -2,600 s counts until -2,540 s inclusive; the panic ends at
    // -2,540 s too. The pool then follows the falling forecast's needs down to 2.
    assert_eq!((shrank_at, last), (Some((-2_538.0, false)), 2));
}

#[test]
fn a_new_leader_resuming_after_a_clock_step_back_is_not_held_by_stale_needs() {
    let mut p = ColdStartAware::new(no_headroom());
    p.decide(&inputs(1_000.0, 98_000.0, 14, vec![]));
    p.resume(-2_600.0, 3);
    // The 14 needed at 1,000 s is gone with the resume (re-stamped, it would hold 14 for a
    // window): the first decision follows the forecast, (9,800 + 98,000) / 2 = 53,900
    // tokens/s, 8 replicas.
    let first = p.decide(&inputs(-2_600.0, 9_800.0, 14, vec![]));
    assert_eq!((first.desired, first.reason), (8, ScaleReason::ScaleDown));
    let mut last = None;
    for k in 1..40 {
        last = Some(p.decide(&inputs(-2_600.0 + f64::from(k) * 2.0, 9_800.0, 14, vec![])));
    }
    assert_eq!(last.map(|d| (d.desired, d.reason)), Some((2, ScaleReason::ScaleDown)));
}
