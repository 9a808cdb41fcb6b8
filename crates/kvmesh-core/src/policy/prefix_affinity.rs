//! `prefix_affinity`: Ray Serve's `PrefixCacheAffinityRouter`
//! (ray `python/ray/llm/_internal/serve/request_router/prefix_aware/prefix_aware_router.py`),
//! block-granular on the router's own routing record in place of Ray's character tree.
//!
//! 1. If queue lengths (outstanding requests) are imbalanced — `max − min >
//!    imbalanced_threshold` — fall back to power of two choices over all replicas.
//! 2. Otherwise, if the best recorded match rate (`matched blocks / request blocks`) is at
//!    least `match_rate_threshold`, the candidates are the replicas with that best match;
//!    below it, the replicas with the smallest recorded cache.
//! 3. Power of two choices (fewer outstanding requests) among the candidates.
//!
//! Defaults: imbalanced_threshold 10, match_rate_threshold 0.1.

use super::choose::two;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::fleet::{FleetView, RouteRequest};
use rand::{Rng, RngCore};

/// Parameters of [`PrefixAffinity`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixAffinityParams {
    /// Queue-length gap (requests) above which affinity is abandoned. Default 10.
    pub imbalanced_threshold: u32,
    /// Minimum match rate for affinity. Default 0.1.
    pub match_rate_threshold: f64,
}

impl Default for PrefixAffinityParams {
    fn default() -> Self {
        PrefixAffinityParams { imbalanced_threshold: 10, match_rate_threshold: 0.1 }
    }
}

/// Ray Serve's prefix-cache affinity routing.
#[derive(Debug)]
pub struct PrefixAffinity {
    params: PrefixAffinityParams,
    candidates: Vec<usize>,
}

impl PrefixAffinity {
    /// A policy with `params`.
    pub fn new(params: PrefixAffinityParams) -> Self {
        PrefixAffinity { params, candidates: Vec::new() }
    }
}

/// Power of two choices on outstanding requests among `candidates` (Ray's default router).
fn pow2(view: &FleetView<'_>, candidates: &[usize], rng: &mut dyn RngCore) -> usize {
    let (a, b) = two(candidates, rng);
    let (la, lb) = (view.load(a).outstanding(), view.load(b).outstanding());
    if la < lb || (la == lb && rng.random_bool(0.5)) {
        a
    } else {
        b
    }
}

impl Policy for PrefixAffinity {
    fn name(&self) -> &'static str {
        "prefix_affinity"
    }

    fn uses_record(&self) -> bool {
        true
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let p = self.params;
        self.candidates.clear();
        self.candidates.extend(view.routable());
        if self.candidates.is_empty() {
            return Err(Error::NoReplicaReady);
        }
        let loads = self.candidates.iter().map(|&i| view.load(i).outstanding());
        let (min, max) = loads.fold((u32::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        if max - min > p.imbalanced_threshold {
            let i = pow2(view, &self.candidates, rng);
            return Ok(Decision::at(view, req, i, Reason::Imbalance));
        }
        let best = self.candidates.iter().map(|&i| view.record_overlaps[i]).max().unwrap_or(0);
        let rate = if req.blocks() == 0 { 0.0 } else { best as f64 / req.blocks() as f64 };
        let reason = if best > 0 && rate >= p.match_rate_threshold {
            self.candidates.retain(|&i| view.record_overlaps[i] == best);
            Reason::PrefixMatch
        } else {
            let size = |i: usize| view.record.replica_blocks(view.replicas[i].id);
            let smallest = self.candidates.iter().map(|&i| size(i)).min().unwrap_or(0);
            self.candidates.retain(|&i| size(i) == smallest);
            Reason::LeastCached
        };
        let i = pow2(view, &self.candidates, rng);
        Ok(Decision::at(view, req, i, reason))
    }
}
