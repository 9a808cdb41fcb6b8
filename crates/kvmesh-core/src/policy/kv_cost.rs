//! `kv_cost`: Dynamo's KV router (ai-dynamo/dynamo `lib/kv-router`, crate `dynamo-kv-router`
//! 1.6.1, git 0d9c24a8; `scheduling/selector/reference.rs` `DefaultWorkerScorer::worker_logit`,
//! loads from `sequences/`), at its defaults.
//!
//! For each worker, in blocks of the engine's `block_size`:
//!
//! ```text
//! logit = prefill_load_scale · max(0, (active_prefill_tokens + isl) / block_size − overlap_score_credit · overlap)
//!       + active_blocks + (⌊isl / block_size⌋ − active_run)
//! ```
//!
//! - `overlap`: the worker's device (GPU) prefix blocks from its KV events (kvmesh's index);
//! - `active_prefill_tokens`, `active_blocks`, `active_run`: Dynamo's own tracking of the
//!   requests it routed ([`ActiveSequences`]): uncached prompt tokens until first token;
//!   distinct prompt blocks of live requests; the request's leading blocks already active
//!   there. The new request's uncached blocks so count in both terms.
//!
//! Defaults (`KvRouterConfig::default`): `overlap_score_credit` 1.0, `prefill_load_scale` 1.0,
//! `decode_active_request_weight` 0.0 (no per-request term), `router_temperature` 0.0: the
//! lowest logit wins, uniformly at random among exact ties (Dynamo's reservoir pick). Router
//! queueing (`router_queue_threshold`) is off by default in 1.6.1, and so here.
//! What Dynamo sees: worker KV events and its own routed requests; no engine metrics.

use super::active_sequences::ActiveSequences;
use super::choose::lowest;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::ids::ReplicaId;
use crate::load::{BookingId, FleetEvent};
use crate::view::FleetView;
use crate::view::OverlapSource;
use crate::view::RouteRequest;
use rand::RngCore;

/// Parameters of [`KvCost`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCostParams {
    /// Dynamo's `overlap_score_credit`: device overlap blocks credited against prefill.
    /// Default 1.0.
    pub overlap_weight: f64,
    /// Dynamo's `prefill_load_scale`: weight of the prefill term. Default 1.0.
    pub prefill_load_scale: f64,
}

impl Default for KvCostParams {
    fn default() -> Self {
        KvCostParams { overlap_weight: 1.0, prefill_load_scale: 1.0 }
    }
}

/// Dynamo's KV-aware cost routing.
#[derive(Debug)]
pub struct KvCost {
    params: KvCostParams,
    active: ActiveSequences,
    /// The fleet's block size at the last pick, tokens.
    block_size: u32,
    /// The last pick and its event overlap, blocks: what Dynamo books as cached.
    picked: Option<(ReplicaId, u32)>,
    scores: Vec<(usize, f64)>,
}

impl KvCost {
    /// A policy with `params`.
    pub fn new(params: KvCostParams) -> Self {
        KvCost { params, active: ActiveSequences::default(), block_size: 16, picked: None, scores: Vec::new() }
    }

    /// Dynamo's active blocks on `replica`: distinct prompt blocks of its live requests.
    pub fn active_blocks(&self, replica: ReplicaId) -> u64 {
        self.active.active_blocks(replica)
    }

    /// Dynamo's active prefill tokens on `replica`: uncached prompt tokens before first token.
    pub fn active_prefill_tokens(&self, replica: ReplicaId) -> u64 {
        self.active.active_prefill_tokens(replica)
    }

    /// The logit of position `i`, blocks.
    pub fn cost(&self, view: &FleetView<'_>, req: &RouteRequest, i: usize) -> f64 {
        let bs = view.config.block_size as f64;
        let id = view.replicas[i].id;
        let isl = req.prompt_tokens as f64;
        let raw_prefill = (self.active.active_prefill_tokens(id) as f64 + isl) / bs;
        let overlap = event_overlap(view, i) as f64;
        let prefill = (raw_prefill - self.params.overlap_weight * overlap).max(0.0);
        let new_blocks = req.hashes.len() - self.active.active_run(id, &req.hashes);
        let decode = (self.active.active_blocks(id) + new_blocks as u64) as f64;
        self.params.prefill_load_scale * prefill + decode
    }
}

/// Position `i`'s device overlap from its KV events: Dynamo's indexer knows only events, so a
/// replica kvmesh routes on its own record (no event yet) overlaps nothing.
fn event_overlap(view: &FleetView<'_>, i: usize) -> u32 {
    match view.replicas[i].overlap_source() {
        OverlapSource::Events => view.overlaps[i].gpu,
        OverlapSource::Approximate => 0,
    }
}

impl Policy for KvCost {
    fn name(&self) -> &'static str {
        "kv_cost"
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        self.block_size = view.config.block_size;
        let mut scores = std::mem::take(&mut self.scores);
        scores.clear();
        scores.extend(view.routable().map(|i| (i, self.cost(view, req, i))));
        let pick = lowest(&scores, 0.0, rng);
        self.scores = scores;
        let i = pick.ok_or(Error::NoReplicaReady)?;
        self.picked = Some((view.replicas[i].id, event_overlap(view, i)));
        Ok(Decision::at(view, req, i, Reason::LowestCost))
    }

    fn booked(&mut self, req: &RouteRequest, decision: &Decision, booking: BookingId, _now: f64) {
        // Dynamo books `isl − min(cached, isl)` with cached = device overlap · block_size.
        let overlap = match self.picked.take() {
            Some((r, o)) if r == decision.replica => o,
            _ => 0,
        };
        let cached = u64::from(overlap) * u64::from(self.block_size);
        let uncached = u64::from(req.prompt_tokens).saturating_sub(cached);
        self.active.add(booking, decision.replica, &req.hashes, uncached);
    }

    fn observe(&mut self, events: &[FleetEvent]) {
        self.active.observe(events);
    }
}
