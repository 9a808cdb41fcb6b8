//! `cache_aware`: SGLang's router (lightseekorg/smg 1.9.0 at 73da68ca, the SGLang model
//! gateway's current home; `model_gateway/src/policies/cache_aware.rs`, tree in
//! `crates/kv_index/src/string_tree.rs`; sgl-project/sglang `sgl-model-gateway/` 0.3.2 decides
//! alike), on its HTTP path, with its CLI defaults.
//!
//! SGLang routes on its own tree of the prompts it sent ([`TenantTree`]), never on KV events
//! (its event mode serves gRPC workers only), and on its own in-flight request count per worker
//! (incremented when a request is sent, decremented when its response ends).
//!
//! 1. **Imbalanced** — `max − min > balance_abs_threshold` **and** `max > min ×
//!    balance_rel_threshold` over the healthy workers' in-flight counts: the least loaded
//!    worker (ties: fewest requests ever routed there, then the first in the worker list).
//! 2. Otherwise match the prompt against the shared tree: `match_rate = matched / prompt`.
//!    **Above `cache_threshold`** (strictly): the tenant of the deepest node matched — the worker
//!    whose prompt first reached that node, while it still holds it.
//! 3. **Miss**: the least loaded worker, as in 1.
//!
//! Every routed prompt is then inserted for the chosen worker (imbalanced ones too). Every
//! `eviction_interval_s` each worker's share of the tree is cut to `max_tree_size` characters,
//! least recently inserted first.
//!
//! Defaults (`smg` CLI): cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold
//! 1.5, eviction_interval_s 120, max_tree_size 2^26 characters. Tokens stand for characters
//! here at [`CHARS_PER_TOKEN`] per token (for the size cap only: a match rate is the same
//! fraction of the prompt either way), matched in whole blocks.
//! If the matched tenant is no longer healthy, SGLang sends the request to the first healthy
//! worker and records nothing; so does this.

use super::choose::first_lowest;
use super::tenant_tree::TenantTree;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::ids::ReplicaId;
use crate::load::{BookingId, FleetEvent};
use crate::view::FleetView;
use crate::view::RouteRequest;
use rand::RngCore;

/// Characters per token assumed where SGLang counts characters (English text under a Llama-3
/// tokenizer averages about 4).
pub const CHARS_PER_TOKEN: f64 = 4.0;

/// Parameters of [`CacheAware`] and of [`super::VllmCacheAware`] (the vLLM router forked
/// SGLang's; its defaults are [`CacheAwareParams::vllm_router`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareParams {
    /// Match rate above which the matched tenant is chosen. Default 0.3.
    pub cache_threshold: f64,
    /// Absolute in-flight gap (requests) for imbalance. Default 64.
    pub balance_abs_threshold: u32,
    /// Relative in-flight ratio for imbalance. Default 1.5.
    pub balance_rel_threshold: f64,
    /// Seconds between tree evictions. Default 120.
    pub eviction_interval_s: f64,
    /// Characters of the tree each worker may hold. Default 2^26 (the vLLM router's 2^25).
    pub max_tree_size: f64,
}

impl Default for CacheAwareParams {
    /// SGLang's (smg CLI) defaults.
    fn default() -> Self {
        CacheAwareParams {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_s: 120.0,
            max_tree_size: (1u64 << 26) as f64,
        }
    }
}

impl CacheAwareParams {
    /// The vLLM router's CLI defaults: SGLang's, with trees of 2^25 characters.
    pub fn vllm_router() -> Self {
        CacheAwareParams { max_tree_size: (1u64 << 25) as f64, ..CacheAwareParams::default() }
    }
}

/// SGLang's cache-aware routing.
#[derive(Debug)]
pub struct CacheAware {
    params: CacheAwareParams,
    tree: TenantTree,
    /// Requests ever routed to each worker (smg's `processed` counter), by replica index.
    processed: Vec<u64>,
    next_eviction: Option<f64>,
    /// The last pick fell back to the first healthy worker: SGLang records nothing for it.
    skip_record: bool,
    scores: Vec<(usize, (u32, u64))>,
}

impl CacheAware {
    /// A policy with `params`.
    pub fn new(params: CacheAwareParams) -> Self {
        CacheAware {
            params,
            tree: TenantTree::new(true),
            processed: Vec::new(),
            next_eviction: None,
            skip_record: false,
            scores: Vec::new(),
        }
    }

    /// Blocks the tree holds for `replica`.
    pub fn tree_blocks(&self, replica: ReplicaId) -> u64 {
        self.tree.size(replica)
    }

    fn processed(&self, replica: ReplicaId) -> u64 {
        self.processed.get(replica.index()).copied().unwrap_or(0)
    }

    fn evict(&mut self, view: &FleetView<'_>) {
        let due = *self.next_eviction.get_or_insert(view.now + self.params.eviction_interval_s);
        if view.now >= due {
            let chars_per_block = CHARS_PER_TOKEN * view.config.block_size as f64;
            self.tree.evict_over((self.params.max_tree_size / chars_per_block) as u64);
            self.next_eviction = Some(view.now + self.params.eviction_interval_s);
        }
    }
}

/// Whether SGLang's imbalance test fires for loads `min` and `max` (requests).
pub(crate) fn imbalanced(min: u32, max: u32, abs: u32, rel: f64) -> bool {
    max.saturating_sub(min) > abs && max as f64 > min as f64 * rel
}

/// The rate of `matched` blocks over a prompt of `prompt_tokens`, in (0, 1].
pub(crate) fn match_rate(matched: usize, block_size: u32, prompt_tokens: u32) -> f64 {
    if prompt_tokens == 0 {
        return 0.0;
    }
    (matched as f64 * block_size as f64 / prompt_tokens as f64).min(1.0)
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn reads_kv_events(&self) -> bool {
        false
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, _rng: &mut dyn RngCore) -> Result<Decision, Error> {
        self.evict(view);
        self.skip_record = false;
        let p = self.params;
        let mut scores = std::mem::take(&mut self.scores);
        scores.clear();
        scores.extend(view.routable().map(|i| (i, (view.load(i).outstanding(), self.processed(view.replicas[i].id)))));
        let least = first_lowest(&scores);
        let (min, max) = scores.iter().fold((u32::MAX, 0), |(lo, hi), s| (lo.min(s.1 .0), hi.max(s.1 .0)));
        self.scores = scores;
        let least = least.ok_or(Error::NoReplicaReady)?;
        if imbalanced(min, max, p.balance_abs_threshold, p.balance_rel_threshold) {
            return Ok(Decision::at(view, req, least, Reason::Imbalance));
        }
        let depth = self.tree.deepest(&req.hashes, |_| true);
        if match_rate(depth, view.config.block_size, req.prompt_tokens) > p.cache_threshold {
            let tenant = self.tree.holders(req.hashes[depth - 1]).next();
            let pos = tenant.and_then(|t| view.replicas.iter().position(|r| r.id == t).filter(|&i| view.takes(i)));
            return Ok(match pos {
                Some(i) => Decision::at(view, req, i, Reason::PrefixMatch),
                None => {
                    self.skip_record = true;
                    let first = view.routable().next().ok_or(Error::NoReplicaReady)?;
                    Decision::at(view, req, first, Reason::PrefixMatch)
                }
            });
        }
        Ok(Decision::at(view, req, least, Reason::FewestOutstanding))
    }

    fn booked(&mut self, req: &RouteRequest, decision: &Decision, _booking: BookingId, _now: f64) {
        if std::mem::take(&mut self.skip_record) {
            return;
        }
        self.tree.insert(decision.replica, &req.hashes);
        let i = decision.replica.index();
        if self.processed.len() <= i {
            self.processed.resize(i + 1, 0);
        }
        self.processed[i] += 1;
    }

    fn observe(&mut self, events: &[FleetEvent]) {
        self.tree.forget_removed(events);
    }
}
