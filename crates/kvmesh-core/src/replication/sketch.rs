//! Per-node heavy-hitter counts of prefixes, with exponential decay and bounded memory.
//!
//! Every routed request is counted at a ladder of depths (4, 6, 8, 12, 16, 24, … blocks: two
//! steps per doubling, so a shared prefix is matched to within a third of its length) under the
//! key (depth, [`BlockHash`] of the block at that depth) — a chained hash, so the key names the
//! whole prefix. Each entry sums, decayed with half-life `half_life_s`:
//!
//! - the prefill tokens the requests would spend on the prefix uncached (`depth × block_size`
//!   each);
//! - the token load the requests carry (their booked uncached prompt tokens plus expected
//!   output tokens) — what the prefix's holders must serve, and what ranks the report;
//! - the requests.
//!
//! Decay is forward decay (Cormode et al., "Forward Decay", ICDE 2009): weights are stored
//! multiplied by `e^{λ(t − landmark)}`, so an update touches one entry, and the landmark moves
//! forward before the factor overflows. Memory is bounded by pruning: past `2 × capacity`
//! entries, only the `capacity` heaviest by *repeat* load (the load of every sighting after an
//! entry's first) survive — the "prune to the top" variant of lossy counting, where a prompt
//! seen once weighs nothing, so unique prompts, however long, never push a recurring prefix
//! out. Token ids are kept from a prefix's second sighting, one copy per request shared by its
//! depths, and only for the [`TOKENS_KEPT`] heaviest entries after each prune.
//!
//! A report lists prefixes seen at least twice, by load, and leaves out an ancestor whose
//! requests are nearly all (≥ 90 %) its listed descendant's: a 3,072-token system prompt is one
//! row at its deepest shared depth, not one per ladder step.

use crate::ids::BlockHash;
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// Shallowest depth counted, blocks: shorter shared prefixes are not worth replicating.
pub const MIN_DEPTH_BLOCKS: u32 = 4;

/// Entries that keep their token ids after a prune (the heaviest).
pub const TOKENS_KEPT: usize = 256;

/// Prefixes of a gossiped report that carry their token ids (the hottest; the rest only
/// count): enough for the prefixes a plan can take, small enough for a 250 ms cadence.
pub const GOSSIP_TOKENS_TOP: usize = 4;

/// Rates above this (per second) are treated as garbage from the network and zeroed.
pub const MAX_RATE: f64 = 1e12;

/// Sketch settings (a node's `[replication.sketch]`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SketchConfig {
    /// Entries kept after a prune (memory holds at most twice as many). Default 4,096.
    pub capacity: usize,
    /// Half-life of every count. Default 10 s.
    #[serde(rename = "half_life", with = "crate::seconds")]
    pub half_life_s: f64,
    /// Deepest prefix counted, blocks (longer prompts count up to here). Default 2,048.
    pub max_depth_blocks: u32,
}

impl Default for SketchConfig {
    fn default() -> Self {
        SketchConfig { capacity: 4096, half_life_s: 10.0, max_depth_blocks: 2048 }
    }
}

/// One counted prefix, as reported: rates are the decayed sums turned into per-second rates
/// (a steady stream of `r` requests per second reads `r`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HotPrefix {
    /// Hash of the prefix's last block (chained: names the whole prefix).
    pub hash: BlockHash,
    /// Prefix length, blocks of `block_size` tokens.
    pub depth_blocks: u32,
    /// Prefill tokens per second the prefix costs uncached (`depth × block_size` per request).
    pub prefix_tokens_per_s: f64,
    /// Token load per second of the requests carrying it (uncached prompt + expected output
    /// tokens, as booked).
    pub load_tokens_per_s: f64,
    /// Requests per second carrying it.
    pub requests_per_s: f64,
    /// The prefix's token ids (`depth × block_size` of them), once seen twice: what a warm-up
    /// request sends. `None` for a prefix seen once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Arc<[u32]>>,
}

/// A node's view of where its traffic's token load goes.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct SketchReport {
    /// Token load per second of every request counted (uncached prompt + expected output
    /// tokens).
    pub total_load_tokens_per_s: f64,
    /// The heaviest prefixes, by `load_tokens_per_s`, heaviest first.
    pub prefixes: Vec<HotPrefix>,
}

impl SketchReport {
    /// This report as a node gossips it: token ids only on the [`GOSSIP_TOKENS_TOP`] hottest.
    pub fn for_gossip(mut self) -> SketchReport {
        for p in self.prefixes.iter_mut().skip(GOSSIP_TOKENS_TOP) {
            p.tokens = None;
        }
        self
    }

    /// Makes a report from the network safe to merge: rates that are not finite or are
    /// negative or absurd become 0; prefixes outside the ladder's depths go; token ids not
    /// exactly `depth_blocks × block_size` long are dropped; at most `top` prefixes stay.
    pub fn sanitize(mut self, block_size: u32, max_depth_blocks: u32, top: usize) -> SketchReport {
        let rate = |v: f64| if v.is_finite() && (0.0..=MAX_RATE).contains(&v) { v } else { 0.0 };
        self.total_load_tokens_per_s = rate(self.total_load_tokens_per_s);
        self.prefixes.retain(|p| (MIN_DEPTH_BLOCKS..=max_depth_blocks).contains(&p.depth_blocks));
        self.prefixes.truncate(top);
        for p in &mut self.prefixes {
            p.prefix_tokens_per_s = rate(p.prefix_tokens_per_s);
            p.load_tokens_per_s = rate(p.load_tokens_per_s);
            p.requests_per_s = rate(p.requests_per_s);
            if p.tokens.as_ref().is_some_and(|t| t.len() as u64 != p.depth_blocks as u64 * block_size as u64) {
                p.tokens = None;
            }
        }
        self
    }

    /// Sums reports from several nodes: totals add, equal prefixes (same depth and hash) add,
    /// token ids come from whichever report has them. Heaviest first.
    pub fn merge<'a>(reports: impl IntoIterator<Item = &'a SketchReport>) -> SketchReport {
        let mut out = SketchReport::default();
        let mut at: FxHashMap<(u32, BlockHash), usize> = FxHashMap::default();
        for r in reports {
            out.total_load_tokens_per_s += r.total_load_tokens_per_s;
            for p in &r.prefixes {
                match at.get(&(p.depth_blocks, p.hash)) {
                    Some(&i) => {
                        let q = &mut out.prefixes[i];
                        q.prefix_tokens_per_s += p.prefix_tokens_per_s;
                        q.load_tokens_per_s += p.load_tokens_per_s;
                        q.requests_per_s += p.requests_per_s;
                        if q.tokens.is_none() {
                            q.tokens.clone_from(&p.tokens);
                        }
                    }
                    None => {
                        at.insert((p.depth_blocks, p.hash), out.prefixes.len());
                        out.prefixes.push(p.clone());
                    }
                }
            }
        }
        sort_heaviest_first(&mut out.prefixes);
        out
    }
}

/// By load, deeper first among equals (a deeper prefix covers its ancestors).
fn sort_heaviest_first(p: &mut [HotPrefix]) {
    p.sort_by(|a, b| {
        b.load_tokens_per_s
            .total_cmp(&a.load_tokens_per_s)
            .then(b.depth_blocks.cmp(&a.depth_blocks))
            .then(a.hash.cmp(&b.hash))
    });
}

#[derive(Debug, Clone)]
struct Entry {
    /// Load of every sighting after the first: the pruning weight.
    repeat_load: f64,
    prefix_tokens: f64,
    load_tokens: f64,
    requests: f64,
    /// Raw sightings (saturating).
    seen: u32,
    /// The key one ladder step shallower, as seen on insertion.
    parent: Option<(u32, BlockHash)>,
    /// A prompt whose first `depth × block_size` ids are the prefix (shared by the depths of
    /// the request that supplied it).
    tokens: Option<Arc<[u32]>>,
}

/// The decayed heavy-hitter sketch. See the module docs.
#[derive(Debug, Clone)]
pub struct PrefixSketch {
    config: SketchConfig,
    block_size: u32,
    /// λ = ln 2 / half-life, per second.
    lambda: f64,
    landmark: f64,
    total_load: f64,
    entries: FxHashMap<(u32, BlockHash), Entry>,
}

/// Past this exponent the stored weights are rescaled to a new landmark (e^200 ≪ f64::MAX).
const RESCALE_EXPONENT: f64 = 200.0;

impl PrefixSketch {
    /// An empty sketch for blocks of `block_size` tokens. A zero capacity, block size or
    /// non-positive half-life is raised to the smallest valid value.
    pub fn new(config: SketchConfig, block_size: u32) -> Self {
        let half_life =
            if config.half_life_s.is_finite() && config.half_life_s > 0.0 { config.half_life_s } else { 1.0 };
        PrefixSketch {
            config: SketchConfig { capacity: config.capacity.max(1), half_life_s: half_life, ..config },
            block_size: block_size.max(1),
            lambda: std::f64::consts::LN_2 / half_life,
            landmark: 0.0,
            total_load: 0.0,
            entries: FxHashMap::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SketchConfig {
        &self.config
    }

    /// Entries held now (at most twice the capacity).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing has been counted (or everything was pruned).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Counts one request routed at `now` (seconds): `hashes` are its prompt's chained block
    /// hashes, `tokens` its prompt token ids (kept for a recurring prefix, for warm-ups; `None`
    /// when unknown), `load_tokens` the token load it was booked with, tokens.
    pub fn observe(&mut self, now: f64, hashes: &[BlockHash], tokens: Option<&[u32]>, load_tokens: f64) {
        if !now.is_finite() {
            return;
        }
        if self.lambda * (now - self.landmark) > RESCALE_EXPONENT {
            self.rescale(now);
        }
        let g = (self.lambda * (now - self.landmark)).exp();
        let load = if load_tokens.is_finite() { load_tokens.max(0.0) * g } else { 0.0 };
        self.total_load += load;
        let top = (hashes.len() as u32).min(self.config.max_depth_blocks);
        let bs = self.block_size as usize;
        let mut parent = None;
        // One copy of the prompt per request, made on the first depth that needs it.
        let mut shared: Option<Arc<[u32]>> = None;
        for depth in ladder(top) {
            let key = (depth, hashes[depth as usize - 1]);
            let prefix = depth as f64 * self.block_size as f64 * g;
            match self.entries.get_mut(&key) {
                Some(e) => {
                    e.repeat_load += load;
                    e.prefix_tokens += prefix;
                    e.load_tokens += load;
                    e.requests += g;
                    e.seen = e.seen.saturating_add(1);
                    let need = depth as usize * bs;
                    if e.tokens.is_none() {
                        if let Some(t) = tokens.filter(|t| t.len() >= need) {
                            let keep = top as usize * bs;
                            e.tokens = Some(shared.get_or_insert_with(|| Arc::from(&t[..keep.min(t.len())])).clone());
                        }
                    }
                }
                None => {
                    let e = Entry {
                        repeat_load: 0.0,
                        prefix_tokens: prefix,
                        load_tokens: load,
                        requests: g,
                        seen: 1,
                        parent,
                        tokens: None,
                    };
                    self.entries.insert(key, e);
                }
            }
            parent = Some(key);
        }
        if self.entries.len() > 2 * self.config.capacity {
            self.prune();
        }
    }

    /// The `top` heaviest prefixes seen at least twice (ancestors covered by a descendant left
    /// out, see the module docs) and the total at `now`, as per-second rates.
    pub fn report(&self, now: f64, top: usize) -> SketchReport {
        // Decayed sum × λ is the rate of a steady stream.
        let scale = self.lambda * (-self.lambda * (now - self.landmark)).exp();
        let mut recurring: Vec<(&(u32, BlockHash), &Entry)> =
            self.entries.iter().filter(|(_, e)| e.seen >= 2).collect();
        recurring.sort_by(|a, b| {
            b.1.load_tokens.total_cmp(&a.1.load_tokens).then(b.0 .0.cmp(&a.0 .0)).then(a.0 .1.cmp(&b.0 .1))
        });
        // Walk the heaviest few (and their ancestors): enough to fill `top` distinct chains.
        let mut covered: rustc_hash::FxHashSet<(u32, BlockHash)> = Default::default();
        let mut out = Vec::with_capacity(top);
        for (_, e) in recurring.iter().take(top.saturating_mul(8).max(64)) {
            let mut up = e.parent;
            while let Some(k) = up {
                let Some(p) = self.entries.get(&k) else { break };
                if e.requests >= 0.9 * p.requests {
                    covered.insert(k);
                }
                up = p.parent;
            }
        }
        for (key, e) in recurring {
            if out.len() >= top {
                break;
            }
            if covered.contains(key) {
                continue;
            }
            let need = key.0 as usize * self.block_size as usize;
            out.push(HotPrefix {
                hash: key.1,
                depth_blocks: key.0,
                prefix_tokens_per_s: e.prefix_tokens * scale,
                load_tokens_per_s: e.load_tokens * scale,
                requests_per_s: e.requests * scale,
                tokens: e.tokens.as_ref().filter(|t| t.len() >= need).map(|t| Arc::from(&t[..need])),
            });
        }
        sort_heaviest_first(&mut out);
        SketchReport { total_load_tokens_per_s: self.total_load * scale, prefixes: out }
    }

    fn rescale(&mut self, now: f64) {
        let f = (-self.lambda * (now - self.landmark)).exp();
        self.total_load *= f;
        for e in self.entries.values_mut() {
            e.repeat_load *= f;
            e.prefix_tokens *= f;
            e.load_tokens *= f;
            e.requests *= f;
        }
        self.landmark = now;
    }

    fn prune(&mut self) {
        let cut = |entries: &FxHashMap<(u32, BlockHash), Entry>, keep: usize| {
            let mut w: Vec<f64> = entries.values().map(|e| e.repeat_load).collect();
            if w.len() <= keep {
                return f64::NEG_INFINITY;
            }
            let at = w.len() - keep;
            *w.select_nth_unstable_by(at, f64::total_cmp).1
        };
        let c = cut(&self.entries, self.config.capacity);
        // Strictly above the cut, then ties up to the capacity: memory stays bounded however
        // many entries weigh the same (every unique prompt weighs 0).
        let mut room = self.config.capacity
            - self.entries.values().filter(|e| e.repeat_load > c).count().min(self.config.capacity);
        self.entries.retain(|_, e| {
            if e.repeat_load > c {
                return true;
            }
            if e.repeat_load == c && room > 0 {
                room -= 1;
                return true;
            }
            false
        });
        let t = cut(&self.entries, TOKENS_KEPT);
        for e in self.entries.values_mut() {
            if e.repeat_load < t {
                e.tokens = None;
            }
        }
    }
}

/// The depths counted for a prompt of `blocks` full blocks: 4, 6, 8, 12, 16, 24, … ≤ `blocks`.
pub fn ladder(blocks: u32) -> impl Iterator<Item = u32> {
    let mut next = MIN_DEPTH_BLOCKS;
    let mut half = false;
    std::iter::from_fn(move || {
        if next > blocks {
            return None;
        }
        let d = next;
        // From a power of two p: p → 1.5·p → 2·p.
        if half {
            next = d / 3 * 4;
        } else {
            next = d + d / 2;
        }
        half = !half;
        Some(d)
    })
}
