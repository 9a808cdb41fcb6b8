//! `cache_aware`: SGLang router's cache-aware policy (sglang `sgl-router`,
//! `src/policies/cache_aware.rs`), block-granular on the router's own routing record in place
//! of SGLang's per-worker character radix tree.
//!
//! 1. If the load is imbalanced — `max − min > balance_abs_threshold` **and**
//!    `max > min × balance_rel_threshold`, loads being outstanding requests — go to the least
//!    loaded replica (shortest queue).
//! 2. Otherwise take the replica with the longest recorded prefix match; if
//!    `matched blocks / request blocks > cache_threshold`, route there.
//! 3. Otherwise route to the replica with the smallest recorded "tree" (fewest recorded blocks),
//!    to grow the cache where there is room.
//!
//! Defaults are SGLang's: cache_threshold 0.5, balance_abs_threshold 32, balance_rel_threshold
//! 1.1. The record ages out by the fleet's `record_ttl_s` (SGLang evicts by tree size).

use super::choose::{highest, lowest};
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::fleet::{FleetView, RouteRequest};
use rand::RngCore;

/// Parameters of [`CacheAware`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareParams {
    /// Match rate above which the best-matching replica is chosen. Default 0.5.
    pub cache_threshold: f64,
    /// Absolute load gap (requests) for imbalance. Default 32.
    pub balance_abs_threshold: u32,
    /// Relative load ratio for imbalance. Default 1.1.
    pub balance_rel_threshold: f64,
}

impl Default for CacheAwareParams {
    fn default() -> Self {
        CacheAwareParams { cache_threshold: 0.5, balance_abs_threshold: 32, balance_rel_threshold: 1.1 }
    }
}

/// SGLang's cache-aware routing.
#[derive(Debug)]
pub struct CacheAware {
    params: CacheAwareParams,
    scores: Vec<(usize, f64)>,
}

impl CacheAware {
    /// A policy with `params`.
    pub fn new(params: CacheAwareParams) -> Self {
        CacheAware { params, scores: Vec::new() }
    }
}

/// Whether SGLang's imbalance test fires for loads `min` and `max` (requests).
pub(crate) fn imbalanced(min: u32, max: u32, abs: u32, rel: f64) -> bool {
    max.saturating_sub(min) > abs && max as f64 > min as f64 * rel
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn uses_record(&self) -> bool {
        true
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let p = self.params;
        let loads = view.routable().map(|i| view.load(i).outstanding());
        let (min, max) = loads.fold((u32::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        self.scores.clear();
        if imbalanced(min, max, p.balance_abs_threshold, p.balance_rel_threshold) {
            self.scores.extend(view.routable().map(|i| (i, view.load(i).outstanding() as f64)));
            let i = lowest(&self.scores, 0.0, rng).ok_or(Error::NoReplicaReady)?;
            return Ok(Decision::at(view, req, i, Reason::Imbalance));
        }
        self.scores.extend(view.routable().map(|i| (i, view.record_overlaps[i] as f64)));
        let best = highest(&self.scores, rng).ok_or(Error::NoReplicaReady)?;
        let rate = if req.blocks() == 0 { 0.0 } else { view.record_overlaps[best] as f64 / req.blocks() as f64 };
        if rate > p.cache_threshold {
            return Ok(Decision::at(view, req, best, Reason::PrefixMatch));
        }
        self.scores.clear();
        self.scores.extend(view.routable().map(|i| (i, view.record.replica_blocks(view.replicas[i].id) as f64)));
        let i = lowest(&self.scores, 0.0, rng).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, Reason::LeastCached))
    }
}
