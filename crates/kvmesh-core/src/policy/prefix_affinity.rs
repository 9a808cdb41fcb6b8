//! `prefix_affinity`: Ray Serve's `PrefixCacheAffinityRouter` (ray 2.60.0, commit b7f4259e;
//! `python/ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py`, tree
//! in `prefix_tree.py`), with its defaults.
//!
//! Ray routes on its own tree of the prompts it sent ([`TenantTree`], shared by the
//! deployment's routers, never evicted by default) and on each replica's ongoing requests
//! (probed from the replica and kept current by the router's own sends and completions: with
//! one router, the requests it has in flight there). No KV events, no engine metrics.
//!
//! 1. If `max − min > imbalanced_threshold` over the replicas' ongoing requests: Ray's default
//!    power of two choices (two random replicas, the one with fewer ongoing requests, the first
//!    drawn on ties). The default threshold is infinite: never.
//! 2. Match the prompt against the tree among the available replicas:
//!    `match_rate = matched / prompt`. At least `match_rate_threshold`: the candidates are the
//!    replicas holding the deepest node matched, in the order they reached it. Below it: the
//!    replicas with the smallest tree (fewest characters; here blocks), in registration order.
//! 3. Among the candidates, the one with the fewest ongoing requests — the first on ties.
//!
//! The prompt is then inserted for the chosen replica. Defaults: imbalanced_threshold ∞
//! (`float("inf")`; 10 before Ray 2.60), match_rate_threshold 0.1, no eviction.

use super::cache_aware::match_rate;
use super::choose::{first_lowest, two};
use super::tenant_tree::TenantTree;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::load::{BookingId, FleetEvent};
use crate::view::FleetView;
use crate::view::RouteRequest;
use rand::RngCore;

/// Parameters of [`PrefixAffinity`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixAffinityParams {
    /// Ongoing-request gap above which affinity is abandoned for power of two choices.
    /// Default `f64::INFINITY` (never).
    pub imbalanced_threshold: f64,
    /// Minimum match rate for affinity. Default 0.1.
    pub match_rate_threshold: f64,
}

impl Default for PrefixAffinityParams {
    fn default() -> Self {
        PrefixAffinityParams { imbalanced_threshold: f64::INFINITY, match_rate_threshold: 0.1 }
    }
}

/// Ray Serve's prefix-cache affinity routing.
#[derive(Debug)]
pub struct PrefixAffinity {
    params: PrefixAffinityParams,
    tree: TenantTree,
    candidates: Vec<(usize, u32)>,
    /// Replica index → view position of the routable ones at this pick (`usize::MAX`: none).
    position: Vec<usize>,
    routable: Vec<usize>,
}

impl PrefixAffinity {
    /// A policy with `params`.
    pub fn new(params: PrefixAffinityParams) -> Self {
        PrefixAffinity {
            params,
            tree: TenantTree::new(false),
            candidates: Vec::new(),
            position: Vec::new(),
            routable: Vec::new(),
        }
    }
}

impl Policy for PrefixAffinity {
    fn name(&self) -> &'static str {
        "prefix_affinity"
    }

    fn reads_kv_events(&self) -> bool {
        false
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let p = self.params;
        let mut routable = std::mem::take(&mut self.routable);
        routable.clear();
        routable.extend(view.routable());
        if routable.is_empty() {
            self.routable = routable;
            return Err(Error::NoReplicaReady);
        }
        let ongoing = |i: usize| view.load(i).outstanding();
        let loads = routable.iter().map(|&i| ongoing(i));
        let (min, max) = loads.fold((u32::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        if f64::from(max - min) > p.imbalanced_threshold {
            let (a, b) = two(&routable, rng);
            let i = if ongoing(b) < ongoing(a) { b } else { a };
            self.routable = routable;
            return Ok(Decision::at(view, req, i, Reason::Imbalance));
        }
        // Replica index → its position in the view, for the routable ones.
        self.position.clear();
        for &i in &routable {
            let k = view.replicas[i].id.index();
            if self.position.len() <= k {
                self.position.resize(k + 1, usize::MAX);
            }
            self.position[k] = i;
        }
        let position = &self.position;
        let at = |id: crate::ids::ReplicaId| position.get(id.index()).copied().filter(|&i| i != usize::MAX);
        let depth = self.tree.deepest(&req.hashes, |id| at(id).is_some());
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.clear();
        let reason = if depth > 0
            && match_rate(depth, view.config.block_size, req.prompt_tokens) >= p.match_rate_threshold
        {
            candidates.extend(self.tree.holders(req.hashes[depth - 1]).filter_map(at).map(|i| (i, ongoing(i))));
            Reason::PrefixMatch
        } else {
            let smallest = routable.iter().map(|&i| self.tree.size(view.replicas[i].id)).min().unwrap_or(0);
            candidates.extend(
                routable.iter().filter(|&&i| self.tree.size(view.replicas[i].id) == smallest).map(|&i| (i, ongoing(i))),
            );
            Reason::LeastCached
        };
        let pick = first_lowest(&candidates);
        self.candidates = candidates;
        self.routable = routable;
        let i = pick.ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, reason))
    }

    fn booked(&mut self, req: &RouteRequest, decision: &Decision, _booking: BookingId, _now: f64) {
        self.tree.insert(decision.replica, &req.hashes);
    }

    fn observe(&mut self, events: &[FleetEvent]) {
        self.tree.forget_removed(events);
    }
}
