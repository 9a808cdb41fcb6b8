//! Autoscaling a pool of engine replicas that take a cold start to serve.
//!
//! A new GPU replica serves only after its cold start (weights, compile caches: 15 s to
//! minutes). An autoscaler that reacts to current load scales too late for a burst, and one
//! that keeps reading high load from the ready replicas while new ones start scales again and
//! again (a cascade, case C19). kvmesh's policy, [`ColdStartAware`]:
//!
//! - **Forecast** arriving token load over a horizon no shorter than the cold start: a
//!   trend-following smoother (Holt's linear method, damped trend) on the load sampled each
//!   evaluation,
//!   plus a short panic window in the style of Knative's autoscaler — when the last few
//!   seconds need twice the capacity on hand, the burst wins over the smoothed forecast.
//! - **Headroom for short bursts**: never below the load of the last minute's busier
//!   intervals (its 80th percentile): a burst shorter than a cold start is over before any
//!   replica started for it serves, so only capacity on hand can take it. This sizes bursty
//!   traffic for its bursts (steady traffic for a little above its mean: the percentile of its
//!   per-interval noise), and the pool chases fewer bursts with starts that arrive too late
//!   (BENCHMARKS.md, "Autoscaling").
//! - **Size**: `need = max(⌈forecast ÷ (capacity per replica × target utilisation)⌉,
//!   ⌈(forecast + backlog ÷ backlog_drain_s) ÷ capacity per replica⌉)`, within
//!   `[min_replicas, max_replicas]`: the headroom below full load drains a backlog first, and
//!   a pool that fell behind while replicas started sizes for its queue when that is not
//!   enough.
//! - **No cascade**: replicas that are starting count as capacity already on its way, so a
//!   pool waiting for its new replicas does not ask for them again.
//! - **Scale down** only to the largest need of the last cold start (`scale_down_delay_s`),
//!   never while panicking: an idle replica costs less than a restart's cold start for that
//!   long (the ski-rental break-even), so a dip shorter than a cold start keeps the pool. With
//!   the headroom above, a need falls only once the lower load fills 80 % of the headroom
//!   window (about 48 s of the default 60), so a sustained drop shrinks the pool that long
//!   plus the scale-down window after it began (108 s with a 60 s cold start). The caller
//!   drains the extra replicas (stop routing to them, wait for their requests, then release
//!   them); [`pick_releases`] says which.
//!
//! The baselines it is measured against (they do not count starting replicas):
//! [`Reactive`] (a utilisation threshold, as a CPU-style horizontal autoscaler) and [`Knative`]
//! (stable and panic windows). An oracle that knows the future is the simulator's business.
//!
//! Load is in tokens per second of token load (uncached prefill plus expected output tokens,
//! as booked) and capacity in the same unit per replica. Pure: the caller passes `now` and the
//! measurements; every decision carries its reason and inputs so it can be logged and audited.

mod capacity;
mod policy;
mod release;
#[cfg(test)]
mod tests;

pub use capacity::CapacityMeter;
pub use policy::{ColdStartAware, Knative, Reactive};
pub use release::{pick_releases, ReleaseCandidate};

use crate::error::Error;

/// Settings of the autoscaling policies. Deserialised from a node's `[autoscaler]` table
/// (durations as text: `interval = "2s"`; every key optional), which leaves out the reactive
/// baseline's two thresholds.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AutoscaleConfig {
    /// Time between evaluations. Default 2 s.
    #[serde(rename = "interval", with = "crate::seconds")]
    pub interval_s: f64,
    /// Utilisation each replica should run at, in (0, 1]. Default 0.7.
    pub target_utilisation: f64,
    /// How long a new replica takes to serve, when no start has been measured yet. Default 60 s.
    #[serde(rename = "cold_start", with = "crate::seconds")]
    pub cold_start_s: f64,
    /// Fewest replicas. Default 1. 0 lets a pool scale to zero once no load arrives (KEDA's
    /// `IsActive` turns false), but not back by itself: a router refuses a request that finds no
    /// replica before it counts as demand, so an operator (or KEDA's `minReplicaCount`) starts
    /// the first.
    pub min_replicas: u32,
    /// Most replicas. Default 64.
    pub max_replicas: u32,
    /// Knative's stable window (and the window the reactive baseline averages).
    /// Default 60 s.
    #[serde(rename = "stable_window", with = "crate::seconds")]
    pub stable_window_s: f64,
    /// The panic window. Default 6 s.
    #[serde(rename = "panic_window", with = "crate::seconds")]
    pub panic_window_s: f64,
    /// Panic when the panic window needs this many times the replicas on hand. Default 2.
    pub panic_ratio: f64,
    /// A panic lasts at least this long (no scale down meanwhile). Default 60 s.
    #[serde(rename = "panic_hold", with = "crate::seconds")]
    pub panic_hold_s: f64,
    /// kvmesh's policy shrinks the pool only to the largest need of this last window
    /// (needs exactly this old still count, so a need lasts until the first evaluation after);
    /// 0 (default): one cold start of the pool. That is the break-even of keeping an idle
    /// replica against restarting it (the ski-rental rule: an idle spell shorter than a cold
    /// start costs less than the restart's cold start), so a dip shorter than a cold start
    /// keeps the pool. The reactive baseline waits `stable_window` instead.
    #[serde(rename = "scale_down_delay", with = "crate::seconds")]
    pub scale_down_delay_s: f64,
    /// Holt's level smoothing per evaluation, in (0, 1]. Default 0.5.
    pub level_smoothing: f64,
    /// Holt's trend smoothing per evaluation, in (0, 1]. Default 0.1.
    pub trend_smoothing: f64,
    /// Damping of the trend per evaluation ahead, in (0, 1] (Gardner & McKenzie's damped
    /// trend): a forecast `h` evaluations ahead adds `trend·(φ + φ² + … + φʰ)`, at most
    /// `trend·φ/(1−φ)`, so one spike does not project a cold start's worth of growth.
    /// Default 0.9.
    pub trend_damping: f64,
    /// The prefill backlog queued on the pool should drain within this long: the pool
    /// is also sized so that at full load it serves the forecast plus `queued_tokens /
    /// backlog_drain` (a pool that fell behind during a cold start sizes for its backlog
    /// too; the headroom below full load drains it first). Default 30 s.
    #[serde(rename = "backlog_drain", with = "crate::seconds")]
    pub backlog_drain_s: f64,
    /// The reactive baseline scales up above this utilisation of its ready replicas. Default 0.8.
    #[serde(skip)]
    pub reactive_high: f64,
    /// … and down below this one. Default 0.4.
    #[serde(skip)]
    pub reactive_low: f64,
    /// kvmesh's policy sizes for at least this quantile, in [0, 1], of the load measured over
    /// the last `headroom_window` (one sample per evaluation; nearest rank, so 0 is the
    /// window's least load: in effect no headroom). Default 0.8.
    pub headroom_quantile: f64,
    /// The window of `headroom_quantile`. Default 60 s.
    #[serde(rename = "headroom_window", with = "crate::seconds")]
    pub headroom_window_s: f64,
}

impl Default for AutoscaleConfig {
    fn default() -> Self {
        AutoscaleConfig {
            interval_s: 2.0,
            target_utilisation: 0.7,
            cold_start_s: 60.0,
            min_replicas: 1,
            max_replicas: 64,
            stable_window_s: 60.0,
            panic_window_s: 6.0,
            panic_ratio: 2.0,
            panic_hold_s: 60.0,
            scale_down_delay_s: 0.0,
            backlog_drain_s: 30.0,
            level_smoothing: 0.5,
            trend_smoothing: 0.1,
            trend_damping: 0.9,
            reactive_high: 0.8,
            reactive_low: 0.4,
            headroom_quantile: 0.8,
            headroom_window_s: 60.0,
        }
    }
}

impl AutoscaleConfig {
    /// Checks ranges.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field and quoting the value.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |field: &'static str, reason: String| Err(Error::InvalidConfig { field, reason });
        for (field, v) in [
            ("interval", self.interval_s),
            ("cold_start", self.cold_start_s),
            ("stable_window", self.stable_window_s),
            ("panic_window", self.panic_window_s),
            ("panic_hold", self.panic_hold_s),
            ("backlog_drain", self.backlog_drain_s),
            ("panic_ratio", self.panic_ratio),
            ("headroom_window", self.headroom_window_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(field, format!("must be positive, got {v}"));
            }
        }
        if !(0.0..=1.0).contains(&self.headroom_quantile) {
            return bad("headroom_quantile", format!("must be in [0, 1], got {}", self.headroom_quantile));
        }
        if !(self.scale_down_delay_s.is_finite() && self.scale_down_delay_s >= 0.0) {
            return bad("scale_down_delay", format!("must be ≥ 0 seconds, got {}", self.scale_down_delay_s));
        }
        for (field, v) in [
            ("target_utilisation", self.target_utilisation),
            ("level_smoothing", self.level_smoothing),
            ("trend_smoothing", self.trend_smoothing),
            ("trend_damping", self.trend_damping),
            ("reactive_high", self.reactive_high),
            ("reactive_low", self.reactive_low),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= 1.0) {
                return bad(field, format!("must be in (0, 1], got {v}"));
            }
        }
        if self.min_replicas > self.max_replicas || self.max_replicas == 0 {
            return bad(
                "max_replicas",
                format!(
                    "must be positive and at least min_replicas ({}), got {}",
                    self.min_replicas, self.max_replicas
                ),
            );
        }
        Ok(())
    }
}

/// What one pool looks like at an evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolInputs {
    /// Seconds on the caller's clock.
    pub now: f64,
    /// Token load arriving over the last interval, tokens per second.
    pub demand_tokens_per_s: f64,
    /// What one ready replica serves at full load, tokens per second (measured).
    pub capacity_tokens_per_s: f64,
    /// Replicas serving.
    pub ready: u32,
    /// When each replica still starting was started, seconds.
    pub starting: Vec<f64>,
    /// Seconds a start takes in this pool (measured from real starts; else the configured
    /// default).
    pub cold_start_s: f64,
    /// Prefill tokens queued on the pool's replicas and not yet computed, tokens.
    pub queued_tokens: f64,
}

/// Why a decision is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleReason {
    /// The pool is the right size.
    Hold,
    /// The forecast needs more replicas (the smoothed forecast, the backlog, or the headroom
    /// for short bursts: by default the last minute's 80th-percentile load).
    ScaleUp,
    /// The panic window needs more replicas now.
    Burst,
    /// The forecast has stayed below the pool for the delay.
    ScaleDown,
    /// Fewer would do now, but the count is held at the largest need of the scale-down
    /// window (one cold start by default) or through a panic, before shrinking — also when
    /// that held count is above the replicas on hand (an actuator still catching up).
    HoldDown,
}

impl ScaleReason {
    /// Snake-case name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            ScaleReason::Hold => "hold",
            ScaleReason::ScaleUp => "scale_up",
            ScaleReason::Burst => "burst",
            ScaleReason::ScaleDown => "scale_down",
            ScaleReason::HoldDown => "hold_down",
        }
    }
}

/// One evaluation's outcome, with its inputs: what a Raft entry and an operator's audit show.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleDecision {
    /// When, seconds.
    pub at: f64,
    /// Replicas the pool should have (ready and starting together).
    pub desired: u32,
    /// Why.
    pub reason: ScaleReason,
    /// Replicas ready at the decision.
    pub ready: u32,
    /// Replicas starting at the decision.
    pub starting: u32,
    /// The token load the decision sized for, tokens per second.
    pub forecast_tokens_per_s: f64,
    /// Capacity per replica it assumed, tokens per second.
    pub capacity_tokens_per_s: f64,
    /// Whether the panic window ruled.
    pub panic: bool,
}

/// An autoscaling policy: one decision per evaluation.
pub trait ScalePolicy: std::fmt::Debug + Send {
    /// Its name.
    fn name(&self) -> &'static str;
    /// The decision for `inputs`.
    fn decide(&mut self, inputs: &PoolInputs) -> ScaleDecision;
}

/// Replicas needed to serve `load` at `utilisation` of `capacity` each, within the config's
/// bounds; 0 capacity needs the most.
fn replicas_at(config: &AutoscaleConfig, load: f64, capacity: f64, utilisation: f64) -> u32 {
    let per = capacity * utilisation;
    let n = if per > 0.0 && per.is_finite() { (load.max(0.0) / per).ceil() } else { f64::from(config.max_replicas) };
    (n.min(f64::from(config.max_replicas)) as u32).clamp(config.min_replicas, config.max_replicas)
}

/// [`replicas_at`] the target utilisation.
fn replicas_for(config: &AutoscaleConfig, load: f64, capacity: f64) -> u32 {
    replicas_at(config, load, capacity, config.target_utilisation)
}
