//! `token_load`, kvmesh's default: the lowest estimated time to first token on token load.
//!
//! For each routable replica ([`crate::fleet::FleetView::estimate`]):
//!
//! ```text
//! uncached = prompt tokens − (GPU overlap blocks · credit) · block_size   (≥ 1 token)
//! TTFT     = β1·(queued uncached prefill + uncached) + ⌈…/C⌉·(β0 + β2·decoding sequences)
//! ```
//!
//! Overlap is a *discount* on prefill, not the objective: a replica holding the prefix wins
//! only while its queue is shorter than the recompute it saves. `credit` fades from 1 to 0 as
//! the replica's last KV event ages from `event_fresh_s` to `event_stale_s` (stale → load
//! only). KV headroom is a hard limit: a replica whose free blocks are fewer than the
//! request's uncached prompt blocks plus expected output blocks is skipped while any other
//! fits (if none fits, the lowest TTFT wins, reason `no_kv_headroom`). Replicas within
//! `max(near_equal_s, near_equal_rel × best)` of the best TTFT are near-equal and one is
//! picked at random, so equal replicas share traffic instead of herding on the first.

use super::choose::lowest;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::fleet::{FleetView, RouteRequest};
use rand::RngCore;

/// Parameters of [`TokenLoadPolicy`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLoadParams {
    /// Absolute near-equal band, seconds. Default 0.001.
    pub near_equal_s: f64,
    /// Relative near-equal band, fraction of the best TTFT. Default 0.02.
    pub near_equal_rel: f64,
}

impl Default for TokenLoadParams {
    fn default() -> Self {
        TokenLoadParams { near_equal_s: 0.001, near_equal_rel: 0.02 }
    }
}

/// Lowest estimated TTFT on token load.
#[derive(Debug)]
pub struct TokenLoadPolicy {
    params: TokenLoadParams,
    fits: Vec<(usize, f64)>,
    all: Vec<(usize, f64)>,
}

impl TokenLoadPolicy {
    /// A policy with `params`.
    pub fn new(params: TokenLoadParams) -> Self {
        TokenLoadPolicy { params, fits: Vec::new(), all: Vec::new() }
    }
}

impl Policy for TokenLoadPolicy {
    fn name(&self) -> &'static str {
        "token_load"
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        self.fits.clear();
        self.all.clear();
        let estimator = view.estimator(req);
        for i in view.routable() {
            let e = estimator.at(i);
            self.all.push((i, e.ttft_s));
            if e.kv_headroom_blocks >= 0 {
                self.fits.push((i, e.ttft_s));
            }
        }
        let (scores, reason) =
            if self.fits.is_empty() { (&self.all, Reason::NoKvHeadroom) } else { (&self.fits, Reason::LowestCost) };
        let best = scores.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
        let tolerance = self.params.near_equal_s.max(self.params.near_equal_rel * best);
        let i = lowest(scores, tolerance, rng).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, reason))
    }
}
