//! `vllm_cache_aware`: the vLLM project's router (vllm-project/router, PyPI `vllm-router`
//! 0.1.17; `src/policies/cache_aware.rs` `select_prepared`, tree in `src/tree.rs`), on its HTTP
//! path with token ids, with its CLI defaults. A fork of SGLang's router that matches each
//! worker's own prefix and picks the least loaded of the best matches.
//!
//! The router's information: its own tree of the token ids it routed ([`TenantTree`]) and its
//! own in-flight request count per worker (no KV events, no engine metrics).
//!
//! 1. Per healthy worker: `rate = tokens of the longest prefix of the prompt this worker holds
//!    in the tree / prompt tokens`; `best_rate` the highest.
//! 2. `use_prefix = !imbalanced && best_rate > cache_threshold`, imbalanced as SGLang's test
//!    (`max − min > balance_abs_threshold && max > min × balance_rel_threshold`, in-flight
//!    counts over healthy workers).
//! 3. Among the workers at exactly `best_rate` (with `use_prefix`) or all healthy workers
//!    (without), the one with the fewest in flight — the **first** in the router's worker list
//!    on ties (`min_by_key`). That list is the worker registry's `DashMap` order: arbitrary per
//!    process and stable while it lives, so here a seeded random permutation drawn at the first
//!    decision.
//! 4. The prompt is inserted for the chosen worker. Every `eviction_interval_s` each worker's
//!    tree is cut to `max_tree_size` characters (8 per token: each token id is keyed as 8 hex
//!    characters), least recently inserted first.
//!
//! Defaults (CLI): cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5,
//! eviction_interval_s 120, max_tree_size 2^25 characters (about 4.19 M tokens per worker).

use super::cache_aware::{imbalanced, match_rate, CacheAwareParams};
use super::choose::first_lowest;
use super::tenant_tree::TenantTree;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::ids::ReplicaId;
use crate::load::{BookingId, FleetEvent};
use crate::view::FleetView;
use crate::view::RouteRequest;
use rand::seq::SliceRandom;
use rand::RngCore;

/// Characters the vLLM router's tree spends per token id.
const CHARS_PER_TOKEN_ID: f64 = 8.0;

/// The vLLM router's cache-aware routing.
#[derive(Debug)]
pub struct VllmCacheAware {
    params: CacheAwareParams,
    tree: TenantTree,
    /// Each replica's place in the router's worker list (by replica index), drawn once.
    order: Vec<u32>,
    next_eviction: Option<f64>,
    rates: Vec<(usize, f64)>,
    candidates: Vec<(usize, (u32, u32))>,
    /// Each tenant's run of the request, by replica index.
    runs: Vec<u32>,
}

impl VllmCacheAware {
    /// A policy with `params` ([`CacheAwareParams::vllm_router`] are the vLLM router's
    /// defaults).
    pub fn new(params: CacheAwareParams) -> Self {
        VllmCacheAware {
            params,
            tree: TenantTree::new(true),
            order: Vec::new(),
            next_eviction: None,
            rates: Vec::new(),
            candidates: Vec::new(),
            runs: Vec::new(),
        }
    }

    /// The replica's place in the worker list (replicas registered after the first draw are
    /// drawn among themselves and come after it: a `DashMap` keeps existing entries in place).
    fn place(&self, id: ReplicaId) -> u32 {
        self.order.get(id.index()).copied().unwrap_or(id.0)
    }

    fn draw_order(&mut self, view: &FleetView<'_>, rng: &mut dyn RngCore) {
        let n = view.replicas.iter().map(|r| r.id.index() + 1).max().unwrap_or(0);
        if self.order.len() >= n {
            return;
        }
        let old = self.order.len() as u32;
        let mut fresh: Vec<u32> = (old..n as u32).collect();
        fresh.shuffle(rng);
        self.order.extend(fresh);
    }
}

impl Policy for VllmCacheAware {
    fn name(&self) -> &'static str {
        "vllm_cache_aware"
    }

    fn reads_kv_events(&self) -> bool {
        false
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        self.draw_order(view, rng);
        let due = *self.next_eviction.get_or_insert(view.now + self.params.eviction_interval_s);
        if view.now >= due {
            let chars_per_block = CHARS_PER_TOKEN_ID * view.config.block_size as f64;
            self.tree.evict_over((self.params.max_tree_size / chars_per_block) as u64);
            self.next_eviction = Some(view.now + self.params.eviction_interval_s);
        }
        let p = self.params;
        let (bs, prompt) = (view.config.block_size, req.prompt_tokens);
        self.tree.runs(&req.hashes, &mut self.runs);
        let mut rates = std::mem::take(&mut self.rates);
        rates.clear();
        for i in view.routable() {
            let run = self.runs.get(view.replicas[i].id.index()).copied().unwrap_or(0);
            rates.push((i, match_rate(run as usize, bs, prompt)));
        }
        let best = rates.iter().map(|r| r.1).fold(0.0, f64::max);
        let loads = rates.iter().map(|&(i, _)| view.load(i).outstanding());
        let (min, max) = loads.fold((u32::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        let use_prefix =
            !imbalanced(min, max, p.balance_abs_threshold, p.balance_rel_threshold) && best > p.cache_threshold;
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.clear();
        for &(i, rate) in &rates {
            if !use_prefix || rate == best {
                candidates.push((i, (view.load(i).outstanding(), self.place(view.replicas[i].id))));
            }
        }
        let pick = first_lowest(&candidates);
        self.rates = rates;
        self.candidates = candidates;
        let i = pick.ok_or(Error::NoReplicaReady)?;
        let reason = if use_prefix { Reason::PrefixMatch } else { Reason::FewestOutstanding };
        Ok(Decision::at(view, req, i, reason))
    }

    fn booked(&mut self, req: &RouteRequest, decision: &Decision, _booking: BookingId, _now: f64) {
        self.tree.insert(decision.replica, &req.hashes);
    }

    fn observe(&mut self, events: &[FleetEvent]) {
        self.tree.forget_removed(events);
    }
}
