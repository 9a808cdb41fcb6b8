//! `kv_cost`: Dynamo's KV router cost (dynamo `lib/llm/src/kv_router/scheduler.rs`), at
//! temperature 0 (always the lowest cost; ties at random).
//!
//! ```text
//! cost = overlap_weight · prefill_blocks + decode_blocks
//! prefill_blocks = (queued prefill tokens + prompt tokens − overlap · block_size) / block_size
//! decode_blocks  = active prompt blocks booked on the replica + this request's new blocks
//! ```
//!
//! where the request's new blocks are its prompt blocks minus the overlap (Dynamo's
//! `potential_blocks`: active blocks plus blocks the request would add; no output
//! reservation). The overlap is the event-fed index's GPU run, used as is (Dynamo applies no
//! staleness fade). Default `overlap_weight` 1.0, Dynamo's `overlap_score_weight`.

use super::choose::lowest;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::fleet::{FleetView, RouteRequest};
use rand::RngCore;

/// Parameters of [`KvCost`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCostParams {
    /// Weight of prefill blocks against decode blocks. Default 1.0.
    pub overlap_weight: f64,
}

impl Default for KvCostParams {
    fn default() -> Self {
        KvCostParams { overlap_weight: 1.0 }
    }
}

/// Dynamo's KV-aware cost routing.
#[derive(Debug)]
pub struct KvCost {
    params: KvCostParams,
    scores: Vec<(usize, f64)>,
}

impl KvCost {
    /// A policy with `params`.
    pub fn new(params: KvCostParams) -> Self {
        KvCost { params, scores: Vec::new() }
    }

    /// The cost of position `i`, in blocks.
    pub fn cost(&self, view: &FleetView<'_>, req: &RouteRequest, i: usize) -> f64 {
        let bs = view.config.block_size as f64;
        let load = view.load(i);
        let cached = (view.overlaps[i].gpu as u64 * view.config.block_size as u64).min(req.prompt_tokens as u64);
        let prefill = (load.queued_prefill_tokens + req.prompt_tokens as u64 - cached) as f64 / bs;
        let new_blocks = req.prompt_tokens.div_ceil(view.config.block_size).saturating_sub(view.overlaps[i].gpu);
        let decode = load.prompt_blocks as f64 + new_blocks as f64;
        self.params.overlap_weight * prefill + decode
    }
}

impl Policy for KvCost {
    fn name(&self) -> &'static str {
        "kv_cost"
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let mut scores = std::mem::take(&mut self.scores);
        scores.clear();
        scores.extend(view.routable().map(|i| (i, self.cost(view, req, i))));
        let pick = lowest(&scores, 0.0, rng);
        self.scores = scores;
        let i = pick.ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, Reason::LowestCost))
    }
}
