//! Replicas that scale: a pool of up to `SimConfig::replicas` engines of which an autoscaling
//! policy keeps some running. A replica the policy adds costs GPU time from that moment but
//! serves only after `cold_start_s`; one it removes is drained (no new requests) and released
//! once idle. The router routes only to ready replicas.
//!
//! The policy sees what a real one would: the token load the router booked over the last
//! interval, each ready replica's measured capacity (tokens it served per second of steps it
//! ran with requests waiting, i.e. at full load; the profile's estimate until one is
//! measured), the pool's ready and starting replicas, and the cold start measured from the
//! starts so far. The oracle is told the load ahead instead: the most load booked in each
//! interval by any earlier pass of the same run, one on the whole pool and then passes of its
//! own (see `run`).

use kvmesh_core::autoscale::{
    pick_releases, AutoscaleConfig, ColdStartAware, Knative, PoolInputs, Reactive, ReleaseCandidate, ScaleDecision,
    ScalePolicy,
};
use std::fmt;
use std::str::FromStr;

/// Which autoscaler runs the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Autoscaler {
    /// kvmesh's cold-start-aware policy.
    Kvmesh,
    /// A utilisation threshold on ready replicas.
    Reactive,
    /// Knative-style stable and panic windows.
    Knative,
    /// Knows the load one cold start ahead.
    Oracle,
}

impl Autoscaler {
    /// Every autoscaler.
    pub const ALL: [Autoscaler; 4] =
        [Autoscaler::Kvmesh, Autoscaler::Reactive, Autoscaler::Knative, Autoscaler::Oracle];
}

impl fmt::Display for Autoscaler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Autoscaler::Kvmesh => "kvmesh",
            Autoscaler::Reactive => "reactive",
            Autoscaler::Knative => "knative",
            Autoscaler::Oracle => "oracle",
        })
    }
}

impl FromStr for Autoscaler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "kvmesh" => Ok(Autoscaler::Kvmesh),
            "reactive" => Ok(Autoscaler::Reactive),
            "knative" => Ok(Autoscaler::Knative),
            "oracle" => Ok(Autoscaler::Oracle),
            other => Err(format!("unknown autoscaler {other:?}; known: kvmesh, reactive, knative, oracle")),
        }
    }
}

/// Scaling settings of one simulation.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalingConfig {
    /// The autoscaler.
    pub autoscaler: Autoscaler,
    /// Its settings (bounds, windows, target utilisation).
    pub policy: AutoscaleConfig,
    /// Seconds from adding a replica to its serving, seconds (the truth the simulator applies;
    /// policies learn it from the starts they see).
    pub cold_start_s: f64,
    /// Replicas ready at the start.
    pub initial: u32,
}

/// One replica's place in the pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Slot {
    /// Not running (no GPU).
    Off,
    /// Added at `since`; serves from `ready_at`.
    Starting { since: f64, ready_at: f64 },
    /// Serving since `since` (GPU time counts from `gpu_since`).
    Ready { gpu_since: f64 },
    /// No new requests; released when idle.
    Draining { gpu_since: f64 },
}

/// What scaling did in one run.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct ScalingStats {
    /// GPU-seconds: every replica's time from being added to being released.
    pub gpu_seconds: f64,
    /// Replicas added.
    pub replicas_started: u64,
    /// Replicas drained.
    pub replicas_drained: u64,
    /// The most replicas running (starting, ready or draining) at once.
    pub max_replicas: u32,
    /// The largest `desired` any decision asked for.
    pub max_desired: u32,
    /// Decisions taken.
    pub decisions: u64,
}

/// The pool, its policy and its measurements.
pub(crate) struct Scaler {
    pub config: ScalingConfig,
    policy: Option<Box<dyn ScalePolicy>>,
    pub slots: Vec<Slot>,
    /// Token load booked since the last evaluation, tokens.
    pub booked: f64,
    last_eval: f64,
    /// Tokens served and seconds stepped at full load, per replica, since the last evaluation.
    pub served: Vec<(f64, f64)>,
    capacity: f64,
    starts: Vec<f64>,
    /// The oracle's load per interval, tokens per second.
    future: Vec<f64>,
    pub stats: ScalingStats,
    /// Every decision, in order.
    pub timeline: Vec<ScalePoint>,
}

/// One evaluation of the pool, for plots and audits.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ScalePoint {
    /// Seconds.
    pub at: f64,
    /// Token load booked over the last interval, tokens per second.
    pub demand_tokens_per_s: f64,
    /// What the decision sized for, tokens per second.
    pub forecast_tokens_per_s: f64,
    /// Capacity per replica it assumed, tokens per second.
    pub capacity_tokens_per_s: f64,
    /// Replicas asked for.
    pub desired: u32,
    /// Replicas serving before the decision.
    pub ready: u32,
    /// Replicas starting before the decision.
    pub starting: u32,
    /// Prefill tokens queued on the engines, tokens.
    pub queued_tokens: f64,
}

impl Scaler {
    /// A pool of `n` replicas, `initial` of them ready, with `capacity_prior` tokens per second
    /// per replica until one is measured.
    /// `known_load`: what the oracle is told, the load per `known_every_s`, tokens per second
    /// (empty for the other autoscalers).
    pub fn new(config: ScalingConfig, n: usize, capacity_prior: f64, known_load: &[f64], known_every_s: f64) -> Self {
        let p = config.policy.clone();
        let policy: Option<Box<dyn ScalePolicy>> = match config.autoscaler {
            Autoscaler::Kvmesh => Some(Box::new(ColdStartAware::new(p))),
            Autoscaler::Reactive => Some(Box::new(Reactive::new(p))),
            Autoscaler::Knative => Some(Box::new(Knative::new(p))),
            Autoscaler::Oracle => None,
        };
        let initial = (config.initial as usize).min(n);
        let slots = (0..n).map(|i| if i < initial { Slot::Ready { gpu_since: 0.0 } } else { Slot::Off }).collect();
        let future = regrid(known_load, known_every_s, config.policy.interval_s);
        Scaler {
            policy,
            slots,
            booked: 0.0,
            last_eval: 0.0,
            served: vec![(0.0, 0.0); n],
            capacity: capacity_prior,
            starts: Vec::new(),
            future,
            stats: ScalingStats::default(),
            timeline: Vec::new(),
            config,
        }
    }

    /// Whether replica `r` takes new requests.
    pub fn routable(&self, r: usize) -> bool {
        matches!(self.slots[r], Slot::Ready { .. })
    }

    /// Replica `r` finished a step of `secs` serving `tokens` with requests waiting.
    pub fn saturated_step(&mut self, r: usize, tokens: f64, secs: f64) {
        let s = &mut self.served[r];
        s.0 += tokens;
        s.1 += secs;
    }

    /// One evaluation at `now`: returns the replicas to start (indices) and to drain. A
    /// scale-down picks its replicas as the node does (`pick_releases`), from `load(r)`:
    /// replica `r`'s requests in flight and cached blocks.
    pub fn evaluate(
        &mut self,
        now: f64,
        queued_tokens: f64,
        load: impl Fn(usize) -> (u32, u64),
    ) -> (Vec<usize>, Vec<usize>) {
        let span = now - self.last_eval;
        self.last_eval = now;
        // The first evaluation (at 0) has no interval behind it to measure.
        let booked = std::mem::take(&mut self.booked);
        let demand = if span > 1e-6 { booked / span } else { 0.0 };
        // Measured capacity: tokens per second of full-load steps, over replicas that ran any.
        let (tokens, secs) = self.served.iter().fold((0.0, 0.0), |(t, s), &(a, b)| (t + a, s + b));
        self.served.iter_mut().for_each(|s| *s = (0.0, 0.0));
        if secs >= 0.5 {
            // A slow moving average: one burst's mix does not redefine a replica.
            self.capacity = 0.8 * self.capacity + 0.2 * (tokens / secs);
        }
        let ready = self.slots.iter().filter(|s| matches!(s, Slot::Ready { .. })).count() as u32;
        let starting: Vec<f64> = self
            .slots
            .iter()
            .filter_map(|s| if let Slot::Starting { since, .. } = s { Some(*since) } else { None })
            .collect();
        let cold_start_s = if self.starts.is_empty() {
            self.config.policy.cold_start_s
        } else {
            self.starts.iter().sum::<f64>() / self.starts.len() as f64
        };
        let inputs = PoolInputs {
            now,
            demand_tokens_per_s: demand,
            capacity_tokens_per_s: self.capacity,
            ready,
            starting,
            cold_start_s,
            queued_tokens,
        };
        let decision = match self.policy.as_mut() {
            Some(p) => p.decide(&inputs),
            None => self.oracle(&inputs),
        };
        self.timeline.push(ScalePoint {
            at: now,
            demand_tokens_per_s: demand,
            forecast_tokens_per_s: decision.forecast_tokens_per_s,
            capacity_tokens_per_s: decision.capacity_tokens_per_s,
            desired: decision.desired,
            ready: inputs.ready,
            starting: inputs.starting.len() as u32,
            queued_tokens,
        });
        self.stats.decisions += 1;
        self.stats.max_desired = self.stats.max_desired.max(decision.desired);
        let on_hand = (inputs.ready + inputs.starting.len() as u32) as usize;
        let want = decision.desired as usize;
        let mut start = Vec::new();
        let mut drain = Vec::new();
        if want > on_hand {
            for (r, s) in self.slots.iter_mut().enumerate() {
                if start.len() + on_hand >= want {
                    break;
                }
                if *s == Slot::Off {
                    *s = Slot::Starting { since: now, ready_at: now + self.config.cold_start_s };
                    start.push(r);
                }
            }
            self.stats.replicas_started += start.len() as u64;
        } else if want < on_hand {
            // Cancel starts first (newest first), then drain the ready replicas with the
            // fewest requests in flight and the least cache.
            let (slots, candidates): (Vec<usize>, Vec<ReleaseCandidate>) = self
                .slots
                .iter()
                .enumerate()
                .filter_map(|(r, s)| {
                    let (starting, starting_since, (in_flight, cached_blocks)) = match *s {
                        Slot::Starting { since, .. } => (true, since, (0, 0)),
                        Slot::Ready { .. } => (false, 0.0, load(r)),
                        _ => return None,
                    };
                    let name = format!("{r:06}");
                    Some((r, ReleaseCandidate { name, starting, starting_since, in_flight, cached_blocks }))
                })
                .unzip();
            for i in pick_releases(&candidates, on_hand - want) {
                let r = slots[i];
                match self.slots[r] {
                    Slot::Starting { since, .. } => {
                        self.stats.gpu_seconds += now - since;
                        self.slots[r] = Slot::Off;
                    }
                    Slot::Ready { gpu_since } => {
                        self.slots[r] = Slot::Draining { gpu_since };
                        drain.push(r);
                    }
                    _ => {}
                }
            }
            self.stats.replicas_drained += drain.len() as u64;
        }
        self.note_running();
        (start, drain)
    }

    /// Replica `r`'s cold start ended at `now`; returns whether it is now ready (a start that
    /// was cancelled is not).
    pub fn ready(&mut self, r: usize, now: f64) -> bool {
        match self.slots[r] {
            Slot::Starting { since, ready_at } if (ready_at - now).abs() < 1e-6 => {
                self.slots[r] = Slot::Ready { gpu_since: since };
                self.starts.push(now - since);
                true
            }
            _ => false,
        }
    }

    /// A draining replica ran out of work at `now`: release it.
    pub fn release(&mut self, r: usize, now: f64) {
        if let Slot::Draining { gpu_since } = self.slots[r] {
            self.stats.gpu_seconds += now - gpu_since;
            self.slots[r] = Slot::Off;
        }
    }

    /// Ends the run at `now`: every running replica's GPU time is counted.
    pub fn finish(&mut self, now: f64) -> ScalingStats {
        for s in &mut self.slots {
            match *s {
                Slot::Starting { since, .. } => self.stats.gpu_seconds += now - since,
                Slot::Ready { gpu_since } | Slot::Draining { gpu_since } => self.stats.gpu_seconds += now - gpu_since,
                Slot::Off => {}
            }
            *s = Slot::Off;
        }
        self.stats
    }

    fn note_running(&mut self) {
        let running = self.slots.iter().filter(|s| **s != Slot::Off).count() as u32;
        self.stats.max_replicas = self.stats.max_replicas.max(running);
    }

    /// The oracle: sized for the most load from now to one cold start ahead. A replica it adds
    /// now serves a cold start from now, exactly when the load that needs it arrives; one it
    /// will need again within a cold start it keeps, since idling that gap costs less than the
    /// restart's cold start, and any other it releases at once. For a known need this is the
    /// least GPU time (the ski-rental break-even, with no uncertainty).
    fn oracle(&self, inputs: &PoolInputs) -> ScaleDecision {
        let c = &self.config.policy;
        let k = |t: f64| (t / c.interval_s).max(0.0) as usize;
        let (from, to) = (k(inputs.now), k(inputs.now + self.config.cold_start_s));
        let load = self.future.iter().skip(from).take(to + 1 - from).copied().fold(0.0, f64::max);
        let per = inputs.capacity_tokens_per_s * c.target_utilisation;
        let desired = ((load / per.max(f64::MIN_POSITIVE)).ceil().min(f64::from(c.max_replicas)) as u32)
            .clamp(c.min_replicas, c.max_replicas);
        ScaleDecision {
            at: inputs.now,
            desired,
            reason: kvmesh_core::autoscale::ScaleReason::Hold,
            ready: inputs.ready,
            starting: inputs.starting.len() as u32,
            forecast_tokens_per_s: load,
            capacity_tokens_per_s: inputs.capacity_tokens_per_s,
            panic: false,
        }
    }
}

/// Raises each of `known`'s samples to `booked`'s at the same index, extending `known` to
/// `booked`'s length: the most load of either, tokens per second.
pub(crate) fn raise_to(known: &mut Vec<f64>, booked: &[f64]) {
    if known.len() < booked.len() {
        known.resize(booked.len(), 0.0);
    }
    for (k, &b) in known.iter_mut().zip(booked) {
        *k = k.max(b);
    }
}

/// `load` sampled every `from_s` (sample `k` covers `(k·from_s, (k+1)·from_s]`) as means over
/// intervals of `to_s`.
fn regrid(load: &[f64], from_s: f64, to_s: f64) -> Vec<f64> {
    let span = load.len() as f64 * from_s;
    let n = (span / to_s).ceil() as usize;
    (0..n)
        .map(|k| {
            let (a, b) = (k as f64 * to_s, (k + 1) as f64 * to_s);
            let picked: Vec<f64> = load
                .iter()
                .enumerate()
                .filter(|(i, _)| {
                    let t = (*i as f64 + 1.0) * from_s;
                    t > a && t <= b
                })
                .map(|(_, &v)| v)
                .collect();
            if picked.is_empty() {
                0.0
            } else {
                picked.iter().sum::<f64>() / picked.len() as f64
            }
        })
        .collect()
}
