//! The policies: kvmesh's cold-start-aware one and the two baselines.

use super::{replicas_at, replicas_for, AutoscaleConfig, PoolInputs, ScaleDecision, ScalePolicy, ScaleReason};
use std::collections::VecDeque;

/// Load samples over a window: (time, tokens per second).
#[derive(Debug, Clone, Default)]
struct Window {
    samples: VecDeque<(f64, f64)>,
}

impl Window {
    fn push(&mut self, now: f64, v: f64, keep_s: f64) {
        clamp_future(&mut self.samples, now);
        self.samples.push_back((now, v.max(0.0)));
        while self.samples.front().is_some_and(|&(t, _)| now - t > keep_s) {
            self.samples.pop_front();
        }
    }

    /// The `q` quantile (nearest rank) of the samples within the last `span_s`; 0 without any.
    fn quantile(&self, now: f64, span_s: f64, q: f64) -> f64 {
        let mut v: Vec<f64> = self.samples.iter().filter(|&&(t, _)| now - t <= span_s).map(|&(_, v)| v).collect();
        if v.is_empty() {
            return 0.0;
        }
        v.sort_by(f64::total_cmp);
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
        v[rank - 1]
    }

    /// Mean of the samples within the last `span_s`.
    fn mean(&self, now: f64, span_s: f64) -> f64 {
        let (sum, n) = self
            .samples
            .iter()
            .filter(|&&(t, _)| now - t <= span_s)
            .fold((0.0, 0u32), |(s, n), &(_, v)| (s + v, n + 1));
        if n == 0 {
            0.0
        } else {
            sum / f64::from(n)
        }
    }
}

/// Re-stamps at `now` the entries of a time-ordered deque stamped after it: after the
/// caller's clock stepped back (a wall clock set back), they would not age out of their window
/// until the clock caught up again, however long the step. Re-stamped, they keep their values
/// and order and age out one window later.
fn clamp_future<T>(entries: &mut VecDeque<(f64, T)>, now: f64) {
    for e in entries.iter_mut().rev() {
        if e.0 <= now {
            break;
        }
        e.0 = now;
    }
}

fn decision(inputs: &PoolInputs, desired: u32, reason: ScaleReason, forecast: f64, panic: bool) -> ScaleDecision {
    ScaleDecision {
        at: inputs.now,
        desired,
        reason,
        ready: inputs.ready,
        starting: inputs.starting.len() as u32,
        forecast_tokens_per_s: forecast,
        capacity_tokens_per_s: inputs.capacity_tokens_per_s,
        panic,
    }
}

/// kvmesh's policy (see the module docs): Holt forecast over the cold start, panic window,
/// headroom for short bursts, starting replicas counted, scale-down to the largest need of the
/// last cold start.
#[derive(Debug, Clone)]
pub struct ColdStartAware {
    config: AutoscaleConfig,
    level: Option<f64>,
    trend: f64,
    window: Window,
    panic_until: f64,
    /// Each evaluation's need, as (time, replicas), over the scale-down window.
    needs: VecDeque<(f64, u32)>,
}

impl ColdStartAware {
    /// A policy with `config`.
    pub fn new(config: AutoscaleConfig) -> Self {
        ColdStartAware {
            config,
            level: None,
            trend: 0.0,
            window: Window::default(),
            panic_until: f64::NEG_INFINITY,
            needs: VecDeque::new(),
        }
    }

    /// Continues from a decision committed elsewhere (a previous Raft leader's): the pool is
    /// held at `desired` replicas or more for a scale-down window from `now`, as if this
    /// policy had decided it.
    ///
    /// The needs this policy held before (a follower's shadow evaluations) are dropped: they
    /// were never committed, and holding them would make the leader change itself a
    /// scale-up (a follower's forecast overshooting a load step by a replica or two, say).
    /// The forecast and the load samples stay warm, so a need the new load brings is
    /// counted at the next evaluation.
    pub fn resume(&mut self, now: f64, desired: u32) {
        self.needs.clear();
        self.needs.push_back((now, desired));
    }

    /// The smoothed load `horizon_s` ahead, tokens per second (never below 0).
    fn forecast(&mut self, demand: f64, horizon_s: f64) -> f64 {
        let (a, b) = (self.config.level_smoothing, self.config.trend_smoothing);
        let level = match self.level {
            None => demand,
            Some(l) => {
                // Load is never negative: neither is the level a falling trend leads to.
                let next = (a * demand + (1.0 - a) * (l + self.trend)).max(0.0);
                self.trend = b * (next - l) + (1.0 - b) * self.trend;
                next
            }
        };
        self.level = Some(level);
        let steps = (horizon_s / self.config.interval_s).ceil().min(1e6) as i32;
        let phi = self.config.trend_damping;
        let ahead = if phi >= 1.0 { f64::from(steps) } else { phi * (1.0 - phi.powi(steps)) / (1.0 - phi) };
        // A falling trend is not trusted to keep falling for a whole cold start: the pool
        // shrinks on the delayed path instead.
        (level + self.trend.max(0.0) * ahead).max(0.0)
    }
}

impl ScalePolicy for ColdStartAware {
    fn name(&self) -> &'static str {
        "kvmesh"
    }

    fn decide(&mut self, inputs: &PoolInputs) -> ScaleDecision {
        let c = &self.config;
        let now = inputs.now;
        let keep = c.stable_window_s.max(c.panic_window_s).max(c.headroom_window_s);
        // A panic ends at most `panic_hold_s` from now, also after the clock stepped back.
        self.panic_until = self.panic_until.min(now + c.panic_hold_s);
        self.window.push(now, inputs.demand_tokens_per_s, keep);
        let horizon = inputs.cold_start_s.max(c.interval_s);
        let smoothed = self.forecast(inputs.demand_tokens_per_s, horizon);
        let c = &self.config;
        // Starting replicas are capacity on its way: they are counted, never asked for again.
        let on_hand = inputs.ready + inputs.starting.len() as u32;
        let burst = self.window.mean(now, c.panic_window_s);
        let burst_need = replicas_for(c, burst, inputs.capacity_tokens_per_s);
        if f64::from(burst_need) >= c.panic_ratio * f64::from(on_hand.max(1)) {
            self.panic_until = now + c.panic_hold_s;
        }
        let panic = now < self.panic_until;
        let forecast = if panic { smoothed.max(burst) } else { smoothed };
        // Short bursts are served by capacity on hand or not at all (see the module docs).
        let forecast = forecast.max(self.window.quantile(now, c.headroom_window_s, c.headroom_quantile));
        let backlog = inputs.queued_tokens.max(0.0) / c.backlog_drain_s;
        let cap = inputs.capacity_tokens_per_s;
        let need = replicas_for(c, forecast, cap).max(replicas_at(c, forecast + backlog, cap, 1.0));
        // Shrink only to the largest need of the last window (one cold start by default).
        let window = if c.scale_down_delay_s > 0.0 { c.scale_down_delay_s } else { inputs.cold_start_s };
        clamp_future(&mut self.needs, now);
        if self.needs.is_empty() {
            // No history yet: the pool as it is counts as needed for a window.
            self.needs.push_back((now, on_hand));
        }
        self.needs.push_back((now, need));
        while self.needs.front().is_some_and(|&(t, _)| now - t > window) {
            self.needs.pop_front();
        }
        let held = self.needs.iter().map(|&(_, n)| n).max().unwrap_or(need);
        let desired = if panic { held.max(on_hand) } else { held };
        let reason = match desired.cmp(&on_hand) {
            // More than today's need only because an earlier need is held (an actuator that
            // has not delivered it yet): holding, not growing — also when today's need is
            // itself above what is on hand.
            std::cmp::Ordering::Greater if need < desired => ScaleReason::HoldDown,
            std::cmp::Ordering::Greater if panic && burst >= smoothed => ScaleReason::Burst,
            std::cmp::Ordering::Greater => ScaleReason::ScaleUp,
            std::cmp::Ordering::Less => ScaleReason::ScaleDown,
            std::cmp::Ordering::Equal if need < on_hand => ScaleReason::HoldDown,
            std::cmp::Ordering::Equal => ScaleReason::Hold,
        };
        decision(inputs, desired, reason, forecast + backlog, panic)
    }
}

/// Baseline: a utilisation threshold on the ready replicas, as a CPU-style horizontal
/// autoscaler. Above `reactive_high` it adds the replicas the ready ones lack for the target
/// utilisation on top of the pool; below `reactive_low` (for `stable_window_s`, as a
/// horizontal autoscaler's stabilisation window) it removes the excess. It does not count starting replicas: while new ones start, the ready ones stay
/// hot and it asks again (the cascade of case C19).
#[derive(Debug, Clone)]
pub struct Reactive {
    config: AutoscaleConfig,
    below_since: Option<f64>,
}

impl Reactive {
    /// A baseline with `config`.
    pub fn new(config: AutoscaleConfig) -> Self {
        Reactive { config, below_since: None }
    }
}

impl ScalePolicy for Reactive {
    fn name(&self) -> &'static str {
        "reactive"
    }

    fn decide(&mut self, inputs: &PoolInputs) -> ScaleDecision {
        let c = &self.config;
        let ready = inputs.ready.max(1);
        let on_hand = inputs.ready + inputs.starting.len() as u32;
        let util =
            inputs.demand_tokens_per_s / (f64::from(ready) * inputs.capacity_tokens_per_s).max(f64::MIN_POSITIVE);
        let need = replicas_for(c, inputs.demand_tokens_per_s, inputs.capacity_tokens_per_s);
        let demand = inputs.demand_tokens_per_s;
        if util > c.reactive_high {
            self.below_since = None;
            let add = need.saturating_sub(inputs.ready);
            let desired = (on_hand + add).min(c.max_replicas);
            return decision(inputs, desired, ScaleReason::ScaleUp, demand, false);
        }
        if util < c.reactive_low && need < on_hand {
            let since = *self.below_since.get_or_insert(inputs.now);
            if inputs.now - since >= c.stable_window_s {
                self.below_since = None;
                return decision(inputs, need, ScaleReason::ScaleDown, demand, false);
            }
            return decision(inputs, on_hand, ScaleReason::HoldDown, demand, false);
        }
        self.below_since = None;
        decision(inputs, on_hand, ScaleReason::Hold, demand, false)
    }
}

/// Baseline: Knative's autoscaler (KPA) — desired from the stable window's mean load, from the
/// panic window's when that needs `panic_ratio` × the ready replicas (then no scale-down for
/// `panic_hold_s`). It sizes on ready replicas only and ignores the cold start.
#[derive(Debug, Clone)]
pub struct Knative {
    config: AutoscaleConfig,
    window: Window,
    panic_until: f64,
    /// The first evaluation: no scale-down before a whole stable window is seen.
    since: Option<f64>,
}

impl Knative {
    /// A baseline with `config`.
    pub fn new(config: AutoscaleConfig) -> Self {
        Knative { config, window: Window::default(), panic_until: f64::NEG_INFINITY, since: None }
    }
}

impl ScalePolicy for Knative {
    fn name(&self) -> &'static str {
        "knative"
    }

    fn decide(&mut self, inputs: &PoolInputs) -> ScaleDecision {
        let c = &self.config;
        let now = inputs.now;
        self.window.push(now, inputs.demand_tokens_per_s, c.stable_window_s);
        let stable = self.window.mean(now, c.stable_window_s);
        let burst = self.window.mean(now, c.panic_window_s);
        let on_hand = inputs.ready + inputs.starting.len() as u32;
        let burst_need = replicas_for(c, burst, inputs.capacity_tokens_per_s);
        if f64::from(burst_need) >= c.panic_ratio * f64::from(inputs.ready.max(1)) {
            self.panic_until = now + c.panic_hold_s;
        }
        let panic = now < self.panic_until;
        let mut stable_need = replicas_for(c, stable, inputs.capacity_tokens_per_s);
        if now - *self.since.get_or_insert(now) < c.stable_window_s {
            stable_need = stable_need.max(on_hand);
        }
        if panic {
            let desired = burst_need.max(stable_need).max(on_hand);
            let reason = if desired > on_hand { ScaleReason::Burst } else { ScaleReason::Hold };
            return decision(inputs, desired, reason, burst.max(stable), true);
        }
        let reason = match stable_need.cmp(&on_hand) {
            std::cmp::Ordering::Greater => ScaleReason::ScaleUp,
            std::cmp::Ordering::Less => ScaleReason::ScaleDown,
            std::cmp::Ordering::Equal => ScaleReason::Hold,
        };
        decision(inputs, stable_need, reason, stable, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_quantile_is_the_nearest_rank_within_the_span() {
        let mut w = Window::default();
        for (k, v) in [50.0, 10.0, 40.0, 20.0, 30.0].into_iter().enumerate() {
            w.push(k as f64 * 2.0, v, 60.0);
        }
        // At 8 s: all five samples; nearest rank ⌈q·5⌉ of 10, 20, 30, 40, 50.
        assert_eq!(w.quantile(8.0, 60.0, 0.8), 40.0);
        assert_eq!(w.quantile(8.0, 60.0, 0.81), 50.0);
        assert_eq!(w.quantile(8.0, 60.0, 0.0), 10.0, "rank at least 1: the least");
        assert_eq!(w.quantile(8.0, 60.0, 1.0), 50.0);
        // The last 4 s: 40, 20, 30 (samples exactly `span` old still count).
        assert_eq!(w.quantile(8.0, 4.0, 0.5), 30.0);
        assert_eq!(Window::default().quantile(8.0, 60.0, 0.8), 0.0, "no samples");
        assert_eq!(w.mean(8.0, 4.0), 30.0);
    }

    #[test]
    fn a_clock_stepped_back_restamps_the_samples_after_it() {
        let mut w = Window::default();
        w.push(100.0, 90.0, 60.0);
        w.push(102.0, 80.0, 60.0);
        // The clock steps back 500 s: the two samples from "the future" would otherwise count
        // until the clock passed them again. Re-stamped at 500 s they count one window more.
        w.push(-400.0, 10.0, 60.0);
        assert_eq!(w.samples.iter().map(|s| s.0).collect::<Vec<_>>(), [-400.0, -400.0, -400.0]);
        assert_eq!(w.quantile(-340.0, 60.0, 1.0), 90.0);
        w.push(-338.0, 20.0, 60.0);
        assert_eq!(w.quantile(-338.0, 60.0, 1.0), 20.0, "aged out one window after the step");
    }
}
