//! `weighted_scorer`: llm-d's default scheduling profile (llm-d `inference-scheduler`, the
//! Gateway API Inference Extension scorers): the replica with the highest weighted sum of
//!
//! - **prefix** (weight 3): `matched blocks / request blocks` on the router's own routing
//!   record (llm-d's default prefix-cache scorer is approximate, tracking its own routing);
//! - **queue** (weight 2): min-max normalised waiting queue, `(max − q) / (max − min)`, 1.0 when
//!   all are equal; `q` is the engine-reported waiting count when every routable replica has
//!   fresh metrics (llm-d reads engine metrics), else — for all replicas alike, so one scale is
//!   normalised — the requests this router booked that are still prefilling;
//! - **KV utilisation** (weight 2): `1 − kv_usage` from fresh engine metrics, else booked
//!   blocks over capacity.
//!
//! Ties at random.

use super::choose::highest;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::fleet::{FleetView, RouteRequest};
use crate::load::EngineMetrics;
use rand::RngCore;

/// Parameters of [`WeightedScorer`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WeightedScorerParams {
    /// Prefix scorer weight. Default 3.
    pub prefix_weight: f64,
    /// Queue scorer weight. Default 2.
    pub queue_weight: f64,
    /// KV-utilisation scorer weight. Default 2.
    pub kv_weight: f64,
}

impl Default for WeightedScorerParams {
    fn default() -> Self {
        WeightedScorerParams { prefix_weight: 3.0, queue_weight: 2.0, kv_weight: 2.0 }
    }
}

/// llm-d's weighted scorers.
#[derive(Debug)]
pub struct WeightedScorer {
    params: WeightedScorerParams,
    scores: Vec<(usize, f64)>,
}

impl WeightedScorer {
    /// A policy with `params`.
    pub fn new(params: WeightedScorerParams) -> Self {
        WeightedScorer { params, scores: Vec::new() }
    }
}

/// Fresh engine metrics of position `i`.
fn fresh(view: &FleetView<'_>, i: usize) -> Option<EngineMetrics> {
    view.replicas[i].metrics.filter(|m| m.age(view.now) <= view.config.metrics_fresh_s)
}

/// The waiting queue of position `i`, requests, from the engine or (`engine == false`) from
/// this router's bookings.
fn queue(view: &FleetView<'_>, i: usize, engine: bool) -> f64 {
    match fresh(view, i) {
        Some(m) if engine => m.waiting as f64,
        _ => view.load(i).prefilling as f64,
    }
}

impl Policy for WeightedScorer {
    fn name(&self) -> &'static str {
        "weighted_scorer"
    }

    fn uses_record(&self) -> bool {
        true
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let p = self.params;
        let engine = view.routable().all(|i| fresh(view, i).is_some());
        let (qmin, qmax) = view
            .routable()
            .map(|i| queue(view, i, engine))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), q| (a.min(q), b.max(q)));
        self.scores.clear();
        for i in view.routable() {
            let prefix = if req.blocks() == 0 { 0.0 } else { view.record_overlaps[i] as f64 / req.blocks() as f64 };
            let q = if qmax > qmin { (qmax - queue(view, i, engine)) / (qmax - qmin) } else { 1.0 };
            let used = match fresh(view, i) {
                Some(m) => m.kv_usage.clamp(0.0, 1.0),
                None => (view.load(i).kv_blocks as f64 / view.replicas[i].spec.capacity_blocks as f64).min(1.0),
            };
            let kv = 1.0 - used;
            self.scores.push((i, p.prefix_weight * prefix + p.queue_weight * q + p.kv_weight * kv));
        }
        let i = highest(&self.scores, rng).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, Reason::HighestScore))
    }
}
