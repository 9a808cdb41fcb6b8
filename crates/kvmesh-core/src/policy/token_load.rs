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
//! only while its queue is shorter than the recompute it saves. Queued prefill drains at the
//! replica's prefill rate between first tokens ([`crate::load::TokenLoad::queued_prefill_at`]).
//!
//! A greedy per-request TTFT gives up cache affinity exactly when it matters: near capacity
//! every replica has a queue, and each move away from the replica that caches the prefix adds
//! its recompute to the fleet's work, which every later request waits for. So each candidate
//! is charged for the prefill it needs beyond the best-cached candidate, scaled by the fleet
//! pressure above what spare capacity absorbs (requests queued for prefill per replica, less
//! `pressure_floor`, capped at `max_pressure`):
//!
//! ```text
//! cost = TTFT + move_weight · clamp(pressure − pressure_floor, 0, max_pressure) · β1 · (uncached − fewest uncached)
//! ```
//!
//! A fleet with spare capacity pays nothing (it recomputes for free, and spreading a prefix
//! to more replicas is then cheap replication); a fleet whose replicas queue holds affinity
//! harder. The overlap `credit` fades from 1 to 0 as the replica's last KV event ages from
//! `event_fresh_s` to `event_stale_s`, but only once the replica has delivered a first token
//! since that event (an idle replica's silence proves nothing; see
//! [`crate::fleet::FleetView::overlap_credit`]); stale → load only. KV headroom is a hard limit: a replica whose free blocks are fewer than the
//! request's uncached prompt blocks plus expected output blocks is skipped while any other
//! fits (if none fits, the lowest cost wins, reason `no_kv_headroom`). Replicas within
//! `max(near_equal_s, near_equal_rel × best)` of the best cost are near-equal; among them the
//! one this router sent a request to longest ago wins (random among exact ties), so equal
//! replicas take turns instead of herding on the first.

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
    /// Relative near-equal band, fraction of the best cost. Default 0: on a long prompt even
    /// 2 % is tens of milliseconds of its own TTFT, which showed in p99.
    pub near_equal_rel: f64,
    /// Weight of the recompute charge for moving a request away from the replica that caches
    /// most of its prefix (see the module docs). 0 turns it off. Default 1.0.
    pub move_weight: f64,
    /// Cap on the fleet pressure that scales the recompute charge, requests. Default 8.
    pub max_pressure: f64,
    /// Pressure the fleet absorbs without charge, requests queued per replica: below it,
    /// spare capacity recomputes a prefix for free (and spreads hot prefixes to more
    /// replicas). Default 1.
    pub pressure_floor: f64,
    /// Prefixes routed to a replica within this many seconds, plus the replica's prefill queue
    /// delay, count as cached there before its KV events confirm them (0 turns it off).
    /// Default 2.
    pub pending_prefix_s: f64,
    /// With other router nodes active: costs closer than this count as equal when the nodes
    /// order candidates for their ranks (about how far apart their views of one booking are:
    /// gossip batching plus the network), seconds. Default 0.01.
    pub peer_order_step_s: f64,
}

impl Default for TokenLoadParams {
    fn default() -> Self {
        TokenLoadParams {
            near_equal_s: 0.001,
            near_equal_rel: 0.0,
            move_weight: 1.0,
            max_pressure: 8.0,
            pressure_floor: 1.0,
            pending_prefix_s: 2.0,
            peer_order_step_s: 0.01,
        }
    }
}

/// Lowest estimated TTFT on token load.
#[derive(Debug)]
pub struct TokenLoadPolicy {
    params: TokenLoadParams,
    estimates: Vec<(usize, crate::fleet::Estimate)>,
    fits: Vec<(usize, f64)>,
    all: Vec<(usize, f64)>,
    near: Vec<(usize, f64)>,
}

impl TokenLoadPolicy {
    /// A policy with `params`.
    pub fn new(params: TokenLoadParams) -> Self {
        TokenLoadPolicy { params, estimates: Vec::new(), fits: Vec::new(), all: Vec::new(), near: Vec::new() }
    }
}

fn scores_of<'a>(fits: &'a [(usize, f64)], all: &'a [(usize, f64)]) -> &'a [(usize, f64)] {
    if fits.is_empty() {
        all
    } else {
        fits
    }
}

/// With `k` other router nodes deciding at the same time, each sees the same "best"
/// replica, and the gossip that would tell them about each other arrives only after they
/// decided: all `k + 1` requests land on it together (herding, case C12). The best
/// replica's true cost is then up to `k` of this request's prefills higher, so any of the
/// `k + 1` cheapest replicas costing no more than that, and caching as much of the prompt, is
/// as good. Each node takes the one at its own rank among the active nodes, in an order every
/// node computes alike (cost in steps of `peer_order_step_s`, then live bookings, then the
/// replica's name hash): simultaneous deciders whose views agree do not collide, where independent random
/// picks would (a birthday problem); views that differ across a step, or fewer candidates
/// than deciders, can still pair some of them up.
/// Spreading among near-best choices is the known remedy for deciding on stale load
/// (Mitzenmacher, "How useful is old information?", IEEE TPDS 2000). Measured in the
/// simulator (BENCHMARKS.md, multi-router): it costs nothing at moderate load; its gain is in
/// synchronized bursts, where only it can separate decisions gossip cannot reach in time.
fn spread_among_peers(
    params: &TokenLoadParams,
    scores: &[(usize, f64)],
    estimates: &[(usize, crate::fleet::Estimate)],
    near: &mut Vec<(usize, f64)>,
    best: f64,
    view: &FleetView<'_>,
) -> Option<usize> {
    let k = view.active_peers as usize;
    let (best_i, _) = *scores.iter().find(|s| s.1 <= best)?;
    let e = estimates.iter().find(|(i, _)| *i == best_i)?.1;
    let s_per_token = view.replicas[best_i].profile(view.config.learn_prefill_rate).prefill_s_per_token;
    let band = k as f64 * e.uncached_tokens as f64 * s_per_token;
    // Only among replicas that cache as much of the prompt as the best: spreading must not
    // throw a cache hit away (a replica holding the prefix keeps it, case C12's exception).
    let cached_alike = |i: usize| estimates.iter().any(|(j, x)| *j == i && x.uncached_tokens == e.uncached_tokens);
    near.clear();
    near.extend(scores.iter().copied().filter(|s| s.1 <= best + band && cached_alike(s.0)));
    if near.len() <= 1 {
        return None;
    }
    // Nodes see the same bookings a few ms apart (each drains a peer's booking from when it
    // arrived), so near-equal costs can sort differently on each node and two ranks meet on
    // one replica. Costs are compared in steps of `peer_order_step_s` (about that skew), equal
    // steps going by name: the order, and so the ranks, agree. A coarser step (one prefill)
    // was measured: it cost 25 % of p99 TTFT in the 4-router simulation (BENCHMARKS.md).
    // Within a step, fewer live bookings first: a count every node agrees on once gossip has
    // delivered, where the name alone would send every lightly loaded wave to the same
    // `k + 1` replicas.
    let unit = params.peer_order_step_s.max(1e-6);
    let key = |c: &(usize, f64)| {
        (((c.1 - best) / unit).floor() as i64, view.load(c.0).outstanding(), view.replicas[c.0].name_key)
    };
    near.sort_by_key(key);
    near.truncate(k + 1);
    Some(near[view.peer_rank as usize % near.len()].0)
}

impl Policy for TokenLoadPolicy {
    fn name(&self) -> &'static str {
        "token_load"
    }

    fn pending_prefix_s(&self) -> Option<f64> {
        (self.params.pending_prefix_s > 0.0).then_some(self.params.pending_prefix_s)
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        self.estimates.clear();
        self.fits.clear();
        self.all.clear();
        let estimator = view.estimator(req);
        self.estimates.extend(view.routable().map(|i| (i, estimator.at(i))));
        // The recompute charge: prefill a move away from the best-cached replica adds to the
        // fleet's work, weighted by how many requests already queue per replica.
        let fewest_uncached = self.estimates.iter().map(|(_, e)| e.uncached_tokens).min().unwrap_or(0);
        let n = self.estimates.len().max(1) as f64;
        let pressure = self.estimates.iter().map(|&(i, _)| view.load(i).prefilling as f64).sum::<f64>() / n;
        let charge =
            self.params.move_weight * (pressure - self.params.pressure_floor).clamp(0.0, self.params.max_pressure);
        for &(i, e) in &self.estimates {
            let extra = e.uncached_tokens - fewest_uncached;
            let cost = if charge > 0.0 && extra > 0 {
                let s_per_token = view.replicas[i].profile(view.config.learn_prefill_rate).prefill_s_per_token;
                e.ttft_s + charge * extra as f64 * s_per_token
            } else {
                e.ttft_s
            };
            self.all.push((i, cost));
            if e.kv_headroom_blocks >= 0 {
                self.fits.push((i, cost));
            }
        }
        let (scores, reason) =
            if self.fits.is_empty() { (&self.all, Reason::NoKvHeadroom) } else { (&self.fits, Reason::LowestCost) };
        let best = scores.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
        if view.active_peers > 0 {
            let scores = scores_of(&self.fits, &self.all);
            if let Some(i) = spread_among_peers(&self.params, scores, &self.estimates, &mut self.near, best, view) {
                return Ok(Decision::at(view, req, i, reason));
            }
        }
        let tolerance = self.params.near_equal_s.max(self.params.near_equal_rel * best);
        // Among near-equal replicas, the one routed to longest ago (a random one among exact
        // ties): the estimate cannot see a step already running, and rotating among equals
        // spaces arrivals out on each replica, as round robin does, instead of letting two
        // land together on one.
        self.near.clear();
        self.near.extend(
            scores
                .iter()
                .filter(|s| s.1 <= best + tolerance)
                .map(|&(i, _)| (i, view.replicas[i].last_routed_at.unwrap_or(f64::NEG_INFINITY))),
        );
        let i = lowest(&self.near, 0.0, rng).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, reason))
    }
}
