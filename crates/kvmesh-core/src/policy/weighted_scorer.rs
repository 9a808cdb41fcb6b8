//! `weighted_scorer`: llm-d's default scheduling profile (llm-d/llm-d-router v0.10.0+62 at
//! ebab6879, the inference scheduler's current home; `pkg/epp/config/loader/defaults.go`, the
//! scorers under `pkg/epp/framework/plugins/scheduling/scorer/`, the picker
//! `picker/maxscore/picker.go`; the llm-d inference-scheduling guide ships the same weights).
//!
//! Each candidate's score is `3·prefix + 2·queue + 2·kv`, each term clamped to [0, 1]; the
//! highest wins, uniformly at random among exact ties (`max-score-picker` shuffles, then sorts
//! stably). No filters.
//!
//! - **prefix** (`prefix-cache-scorer` on the approximate prefix producer): matched blocks /
//!   the request's blocks, on llm-d's own index of where it sent each prompt ([`LruPrefixIndex`]:
//!   64-token blocks — the engine's block size clamped to at least 64 —, the final partial block
//!   included, at most 131,072 tokens; per server an LRU of `num_gpu_blocks` entries);
//! - **queue** (`queue-scorer`): `(max − q) / (max − min)` of the servers' waiting queues
//!   (`vllm:num_requests_waiting`), 1.0 for all when they are equal;
//! - **kv** (`kv-cache-utilization-scorer`): `1 − vllm:kv_cache_usage_perc`.
//!
//! llm-d scrapes every server's metrics every 50 ms (`--refresh-metrics-interval`) and scores on
//! the latest scrape, however old (its staleness threshold only feeds the saturation
//! detector, which holds nothing back by default); a server not scraped yet reads queue 0 and
//! KV 0. It counts none of its own in-flight requests. The policy asks for that scrape
//! interval ([`Policy::scrape_interval_s`]).

use super::choose::highest;
use super::lru_prefix::{LruPrefixIndex, LLMD_BLOCK_TOKENS, LLMD_MAX_PREFIX_TOKENS};
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::ids::ReplicaId;
use crate::load::{BookingId, FleetEvent};
use crate::view::FleetView;
use crate::view::RouteRequest;
use rand::RngCore;
use rustc_hash::FxHashMap;

/// llm-d's default LRU size per server, entries, when the engine does not report
/// `num_gpu_blocks` (`LRUCapacityPerServer`).
pub const LLMD_DEFAULT_LRU_CAPACITY: usize = 31_250;

/// llm-d's default metrics refresh interval, seconds.
pub const LLMD_SCRAPE_INTERVAL_S: f64 = 0.05;

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
    index: LruPrefixIndex,
    /// Each replica's LRU size (its `capacity_blocks`, vLLM's `num_gpu_blocks`), by index, as
    /// of the last pick.
    capacity: Vec<usize>,
    block_size: u32,
    hashes: Vec<u64>,
    matches: FxHashMap<ReplicaId, u32>,
    scores: Vec<(usize, f64)>,
}

impl WeightedScorer {
    /// A policy with `params`.
    pub fn new(params: WeightedScorerParams) -> Self {
        WeightedScorer {
            params,
            index: LruPrefixIndex::default(),
            capacity: Vec::new(),
            block_size: 16,
            hashes: Vec::new(),
            matches: FxHashMap::default(),
            scores: Vec::new(),
        }
    }
}

/// llm-d's prefix block hashes of `req` into `out`, for kvmesh blocks of `block_size` tokens:
/// blocks of the smallest multiple of `block_size` that is at least 64 tokens, each identified
/// by kvmesh's chained hash at its last block (the whole prefix up to there), and the final
/// partial block by the prompt's own key.
pub(crate) fn llmd_hashes(req: &RouteRequest, block_size: u32, out: &mut Vec<u64>) {
    out.clear();
    let per = LLMD_BLOCK_TOKENS.div_ceil(block_size.max(1));
    let tokens = per * block_size;
    let prompt = req.prompt_tokens.min(LLMD_MAX_PREFIX_TOKENS);
    let full = (prompt / tokens) as usize;
    out.extend((0..full).filter_map(|k| req.hashes.get((k + 1) * per as usize - 1).map(|h| h.0)));
    if !prompt.is_multiple_of(tokens) && prompt == req.prompt_tokens {
        out.push(req.prompt_key);
    }
}

impl Policy for WeightedScorer {
    fn name(&self) -> &'static str {
        "weighted_scorer"
    }

    fn reads_kv_events(&self) -> bool {
        false
    }

    fn scrape_interval_s(&self) -> Option<f64> {
        Some(LLMD_SCRAPE_INTERVAL_S)
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let p = self.params;
        self.block_size = view.config.block_size;
        for r in view.replicas {
            let k = r.id.index();
            if self.capacity.len() <= k {
                self.capacity.resize(k + 1, LLMD_DEFAULT_LRU_CAPACITY);
            }
            self.capacity[k] =
                if r.spec.capacity_blocks > 0 { r.spec.capacity_blocks as usize } else { LLMD_DEFAULT_LRU_CAPACITY };
        }
        llmd_hashes(req, self.block_size, &mut self.hashes);
        self.index.matches(&self.hashes, &mut self.matches);
        let waiting = |i: usize| view.replicas[i].metrics.map_or(0.0, |m| f64::from(m.waiting));
        let (qmin, qmax) =
            view.routable().map(waiting).fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), q| (a.min(q), b.max(q)));
        let total = self.hashes.len() as f64;
        self.scores.clear();
        for i in view.routable() {
            let matched = self.matches.get(&view.replicas[i].id).copied().unwrap_or(0);
            let prefix = if total > 0.0 { f64::from(matched) / total } else { 0.0 };
            let queue = if qmax > qmin { (qmax - waiting(i)) / (qmax - qmin) } else { 1.0 };
            let kv = 1.0 - view.replicas[i].metrics.map_or(0.0, |m| m.kv_usage);
            let score = p.prefix_weight * prefix.clamp(0.0, 1.0)
                + p.queue_weight * queue.clamp(0.0, 1.0)
                + p.kv_weight * kv.clamp(0.0, 1.0);
            self.scores.push((i, score));
        }
        let i = highest(&self.scores, rng).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, Reason::HighestScore))
    }

    fn booked(&mut self, req: &RouteRequest, decision: &Decision, _booking: BookingId, _now: f64) {
        llmd_hashes(req, self.block_size, &mut self.hashes);
        let capacity = self.capacity.get(decision.replica.index()).copied().unwrap_or(LLMD_DEFAULT_LRU_CAPACITY);
        self.index.add(decision.replica, &self.hashes, capacity);
    }

    fn observe(&mut self, events: &[FleetEvent]) {
        for ev in events {
            if let FleetEvent::ReplicaRemoved(r) = *ev {
                self.index.forget(r);
            }
        }
    }
}
