//! `weighted_scorer`: llm-d's default scheduling profile (llm-d `inference-scheduler`, the
//! Gateway API Inference Extension scorers): the replica with the highest weighted sum of
//!
//! - **prefix** (weight 3): `matched blocks / request blocks` on the router's own routing
//!   record (llm-d's default prefix-cache scorer is approximate, tracking its own routing);
//! - **queue** (weight 2): min-max normalised waiting queue, `(max − q) / (max − min)`, 1.0 when
//!   all are equal; `q` is the engine-reported waiting count when fresh, else the requests this
//!   router booked that are still prefilling;
//! - **KV utilisation** (weight 2): `1 − used / capacity` blocks.
//!
//! Ties at random.

use super::choose::highest;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::fleet::{FleetView, RouteRequest};
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

/// The waiting queue of position `i`, requests.
fn queue(view: &FleetView<'_>, i: usize) -> f64 {
    match view.replicas[i].metrics {
        Some(m) if m.age(view.now) <= view.config.metrics_fresh_s => m.waiting as f64,
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
        let (qmin, qmax) = view
            .routable()
            .map(|i| queue(view, i))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), q| (a.min(q), b.max(q)));
        self.scores.clear();
        for i in view.routable() {
            let prefix = if req.blocks() == 0 { 0.0 } else { view.record_overlaps[i] as f64 / req.blocks() as f64 };
            let q = if qmax > qmin { (qmax - queue(view, i)) / (qmax - qmin) } else { 1.0 };
            let cap = view.replicas[i].spec.capacity_blocks as f64;
            let kv = 1.0 - (view.kv_used_blocks(i) as f64 / cap).min(1.0);
            self.scores.push((i, p.prefix_weight * prefix + p.queue_weight * q + p.kv_weight * kv));
        }
        let i = highest(&self.scores, rng).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, Reason::LowestCost))
    }
}
