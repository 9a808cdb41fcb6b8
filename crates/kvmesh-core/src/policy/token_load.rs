//! `token_load`, kvmesh's default: the lowest estimated time to first token on token load,
//! holding cache affinity where it costs the tail nothing.
//!
//! For each routable replica ([`crate::fleet::FleetView::estimate`]):
//!
//! ```text
//! uncached = prompt tokens − (GPU overlap blocks · credit) · block_size   (≥ 1 token)
//! TTFT     = β1·(queued uncached prefill + uncached) + ⌈…/C⌉·(β0 + β2·decoding sequences)
//! kv_wait  = (blocks short) · output · step / blocks in use      (0 when the request fits)
//! ```
//!
//! Overlap is a *discount* on prefill, not the objective. Queued prefill drains at the
//! replica's prefill rate, but never below what the engine cannot have started: every booked
//! request but the oldest still before its first token
//! ([`crate::load::TokenLoad::queued_prefill_at`]). KV capacity is not ignored and not a wall:
//! a replica whose free blocks (the engine's last report moved by what this router booked
//! since) are fewer than the request's uncached prompt and expected output blocks makes it
//! wait until running sequences free them — about `used / (output · step)` blocks a second,
//! each step carrying a prefill chunk while prefill is queued — and that wait is priced.
//!
//! ```text
//! extra = uncached − fewest uncached   (the prefill a move away from the best-cached replica adds)
//! cost  = TTFT + kv_wait_weight · kv_wait
//!       + move_weight · clamp(pressure − pressure_floor, 0, max_pressure) · β1 · extra
//!       + interference_weight · decoding sequences there · β1 · extra
//! ```
//!
//! The third term charges a move for the recompute it adds to the fleet's work, scaled by the
//! fleet pressure (requests queued for prefill per replica) above what spare capacity absorbs.
//! The last charges it for the decode time it takes from others: chunked prefill runs in the
//! same engine steps as decoding, so each sequence decoding on the replica a request moves to
//! waits about `β1 · extra` longer for its tokens (prefill–decode interference: Agrawal et al.,
//! Sarathi-Serve, OSDI 2024; Zhong et al., DistServe, OSDI 2024). It is charged only while a
//! best-cached replica has KV room for the request (staying where it does not fit would
//! preempt that replica's own decodes), and only to moves: staying adds the request's own
//! small uncached prefill beside the best-cached replica's decodes, which is not charged.
//! Pressure stays low where prompts are mostly cached, so without it a multi-turn agent's next
//! turn left its replica whenever a queue formed there, recomputing thousands of tokens of
//! context beside another replica's decodes (agents at ~100 % load: E2E p99 24.8 → 19.2 s, hit rate 0.765 → 0.810;
//! BENCHMARKS.md, decode-heavy traffic).
//!
//! **Affinity within the tail budget.** p99 TTFT is set by the requests whose own prefill is
//! longest; a request whose TTFT stays well under those costs the p99 nothing by waiting, and
//! what its cache hit saves is capacity for everyone. So among the replicas whose estimated
//! TTFT is within `affinity_budget × p99` of the last 1,024 requests' own prefill times (or
//! the best estimate, if higher), the one caching most of the prompt wins (the cheapest of
//! those on ties), when it caches more than the cost-best choice would.
//!
//! Otherwise the lowest cost wins. Replicas within `max(near_equal_s, near_equal_rel × best)`
//! of the best cost are near-equal; among them the lowest TTFT, then the one this router sent
//! a request to longest ago (random among exact ties), so equal replicas take turns instead of
//! herding on the first. The overlap `credit` fades from 1 to 0 as the replica's last KV event
//! ages from `event_fresh_s` to `event_stale_s`, but only once the replica has delivered a first
//! token since that event (an idle replica's silence proves nothing; see
//! [`crate::fleet::FleetView::overlap_credit`]). The reason is `no_kv_headroom` when no
//! replica has room for the request now (admission control holds such requests).

use super::choose::lowest;
use super::recent_p99::RecentP99;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::view::FleetView;
use crate::view::RouteRequest;
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
    /// Weight of the estimated wait for KV room in the cost. 0 skips replicas without room
    /// instead, while any has room (a hard limit). Default 0.25.
    pub kv_wait_weight: f64,
    /// The tail budget for holding affinity, as a share of the p99 of recent requests' own
    /// prefill times (see the module docs). 0 turns it off. Default 0.7.
    pub affinity_budget: f64,
    /// A request whose expected output is at least this share of its prompt (decode-heavy:
    /// its KV grows while it runs) holds affinity only on a replica with KV room for it while
    /// any replica has room; 0 turns it off (affinity on any replica within the budget).
    /// Default 0.5.
    pub affinity_room_share: f64,
    /// With other router nodes active: costs closer than this count as equal when the nodes
    /// order candidates for their ranks (about how far apart their views of one booking are:
    /// gossip batching plus the network), seconds. Default 0.01.
    pub peer_order_step_s: f64,
    /// Weight of the decode time a move takes from the sequences already decoding where it
    /// moves (see the module docs: extra prefill tokens × prefill s/token × decoding
    /// sequences, sequence-seconds). 0 turns it off. Default 0.05.
    pub interference_weight: f64,
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
            kv_wait_weight: 0.25,
            affinity_budget: 0.7,
            affinity_room_share: 0.5,
            peer_order_step_s: 0.01,
            interference_weight: 0.05,
        }
    }
}

/// Lowest estimated TTFT on token load.
#[derive(Debug)]
pub struct TokenLoadPolicy {
    params: TokenLoadParams,
    /// The routable replicas of a pick, in view order, with what scoring reads of each.
    cands: Vec<Candidate>,
    near: Vec<(usize, f64)>,
    /// Own prefill times (uncached part at the best-cached replica, no queue) of recent requests.
    own_prefill: RecentP99,
}

/// One routable replica of a pick: its estimate's parts that scoring reads, and its cost.
/// Kept in one contiguous array: one pass over the view fills it, and the few passes after it
/// read 56 bytes per replica instead of the replica's state through the view (fleets of a
/// thousand replicas decide here: at 1,024 replicas each pass over the view cost
/// microseconds).
#[derive(Debug, Clone, Copy)]
struct Candidate {
    /// Position in the view.
    i: usize,
    cost: f64,
    ttft_s: f64,
    kv_wait_s: f64,
    prefill_s_per_token: f64,
    uncached_tokens: u32,
    decoding: u32,
    /// Whether it has KV room for the request now (`kv_headroom_blocks ≥ 0`).
    fits: bool,
}

impl TokenLoadPolicy {
    /// A policy with `params`.
    pub fn new(params: TokenLoadParams) -> Self {
        TokenLoadPolicy { params, cands: Vec::new(), near: Vec::new(), own_prefill: RecentP99::new() }
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
    scores: impl Iterator<Item = Candidate> + Clone,
    near: &mut Vec<(usize, f64)>,
    best: f64,
    view: &FleetView<'_>,
) -> Option<usize> {
    let k = view.active_peers as usize;
    let first = scores.clone().find(|c| c.cost <= best)?;
    let band = k as f64 * first.uncached_tokens as f64 * first.prefill_s_per_token;
    // Only among replicas that cache as much of the prompt as the best: spreading must not
    // throw a cache hit away (a replica holding the prefix keeps it, case C12's exception).
    near.clear();
    near.extend(
        scores.filter(|c| c.cost <= best + band && c.uncached_tokens == first.uncached_tokens).map(|c| (c.i, c.cost)),
    );
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

/// `x` when it is below `m`, else `m`: `f64::min` for a running minimum that never starts
/// as NaN (a NaN `x` is ignored, as `f64::min` ignores it). A compare and branch, where
/// `f64::min`'s NaN handling is a dependent sequence chained through every replica of a
/// pass (the passes' running minimums were a sixth of the pick at 1,024 replicas).
#[inline(always)]
fn lower(m: f64, x: f64) -> f64 {
    if x < m {
        x
    } else {
        m
    }
}

impl Policy for TokenLoadPolicy {
    fn name(&self) -> &'static str {
        "token_load"
    }

    fn pending_prefix_s(&self) -> Option<f64> {
        (self.params.pending_prefix_s > 0.0).then_some(self.params.pending_prefix_s)
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let p = self.params;
        // One pass over the view: each routable replica's estimate; the fewest uncached
        // tokens, whether a replica computing only those has KV room, and the first such
        // replica; and the requests prefilling, for the fleet's pressure.
        self.cands.clear();
        let estimator = view.estimator(req);
        let learn = view.config.learn_prefill_rate;
        let (mut fewest_uncached, mut best_cached_fits, mut cached_best) = (u32::MAX, false, usize::MAX);
        // (Counted in integers: an f64 sum chains one addition's latency per replica.)
        let (mut prefilling, mut any_fits) = (0u64, false);
        for i in view.routable() {
            let e = estimator.at(i);
            let fits = e.kv_headroom_blocks >= 0;
            any_fits |= fits;
            match e.uncached_tokens.cmp(&fewest_uncached) {
                std::cmp::Ordering::Less => {
                    (fewest_uncached, best_cached_fits, cached_best) = (e.uncached_tokens, fits, i)
                }
                std::cmp::Ordering::Equal => best_cached_fits |= fits,
                std::cmp::Ordering::Greater => {}
            }
            prefilling += u64::from(e.prefilling);
            self.cands.push(Candidate {
                i,
                cost: 0.0,
                ttft_s: e.ttft_s,
                kv_wait_s: e.kv_wait_s,
                prefill_s_per_token: e.prefill_s_per_token,
                uncached_tokens: e.uncached_tokens,
                decoding: e.decoding,
                fits,
            });
        }
        let Some(first) = self.cands.first() else { return Err(Error::NoReplicaReady) };
        // (A prompt of u32::MAX uncached tokens leaves no replica "fewer": the first one stands.)
        if cached_best == usize::MAX {
            cached_best = first.i;
        }
        // The recompute charge: prefill a move away from the best-cached replica adds to the
        // fleet's work, weighted by how many requests already queue per replica.
        let pressure = prefilling as f64 / self.cands.len() as f64;
        let charge = p.move_weight * (pressure - p.pressure_floor).clamp(0.0, p.max_pressure);
        // Staying is worth the decode time a move would take from others only where staying
        // fits: a replica short of KV room would preempt its own decodes instead.
        let interference = if best_cached_fits { p.interference_weight } else { 0.0 };
        // The replicas scored: all of them when a KV shortage is priced (or none has room),
        // else those with room. One pass costs them and finds the lowest cost and TTFT among
        // them (passes over every replica are what a decision at 1,024 replicas spends).
        let score_all = p.kv_wait_weight > 0.0 || !any_fits;
        let (mut best, mut fastest) = (f64::INFINITY, f64::INFINITY);
        for c in &mut self.cands {
            let extra = c.uncached_tokens - fewest_uncached;
            c.cost = c.ttft_s + p.kv_wait_weight * c.kv_wait_s;
            if (charge > 0.0 || interference > 0.0) && extra > 0 {
                c.cost += (charge + interference * f64::from(c.decoding)) * extra as f64 * c.prefill_s_per_token;
            }
            if score_all || c.fits {
                (best, fastest) = (lower(best, c.cost), lower(fastest, c.ttft_s));
            }
        }
        let reason = if any_fits { Reason::LowestCost } else { Reason::NoKvHeadroom };
        let scores = self.cands.iter().copied().filter(move |c| score_all || c.fits);
        let tolerance = p.near_equal_s.max(p.near_equal_rel * best);
        let near_cost = move |c: &Candidate| c.cost <= best + tolerance;
        // The request's own prefill, no queue, at the replica caching most of it.
        let profile = view.replicas[cached_best].profile(learn);
        self.own_prefill.observe(profile.ttft(u64::from(fewest_uncached), 0));
        // Its wait there: queue and prefill. Not the wait for KV room the cost prices: with it
        // in, synthetic ×21 read 2.08 s p99 against 1.92 s, conversation ×17.6 1.45 against
        // 1.42 s (BENCHMARKS.md); a replica chosen short of room is priced there anyway. (With
        // affinity off no replica is within it.)
        let budget = if p.affinity_budget > 0.0 {
            (p.affinity_budget * self.own_prefill.p99()).max(fastest)
        } else {
            f64::NEG_INFINITY
        };
        // A request that grows in decode, held on a replica short of KV room while others
        // have room, fills it to preemption: running sequences' next blocks evict each
        // other (RL rollouts at ~100 % load, seed 1: 29,174 preemptions, step p99 85.7 s →
        // 0 and 63.3 s; BENCHMARKS.md, decode-heavy traffic). It applies to requests
        // without max_tokens too: expected at the running mean, a short prompt counts. A prompt-heavy one only waits there
        // for room, which the budget prices: requiring room for every request cost p99
        // TTFT on the Mooncake conversation trace at ×22 (1.62 → 1.77 s), for those whose
        // output is at least a quarter of the prompt 1.73 s, half or more 1.62 s.
        let share = p.affinity_room_share;
        let room = share > 0.0 && any_fits;
        let heavy = room && f64::from(view.expected_output_tokens) >= share * f64::from(req.prompt_tokens);
        // One pass: the lowest TTFT and the most any near-best replica caches (what the cost
        // alone would give); and within the budget (and room, for a heavy request), the
        // replica caching most, the cheapest of those, the first on ties. (Kept as scalars,
        // not a copied candidate: this loop runs over every replica.)
        let (mut held, mut held_uncached, mut held_cost) = (None, 0, 0.0);
        let (mut greedy, mut any_near, mut fastest_near) = (u32::MAX, false, f64::INFINITY);
        for c in self.cands.iter().filter(|c| score_all || c.fits) {
            if near_cost(c) {
                (greedy, any_near) = (greedy.min(c.uncached_tokens), true);
                fastest_near = lower(fastest_near, c.ttft_s);
            }
            let within = c.ttft_s <= budget && (!heavy || c.fits);
            if within
                && (held.is_none()
                    || c.uncached_tokens < held_uncached
                    || (c.uncached_tokens == held_uncached && c.cost.total_cmp(&held_cost).is_lt()))
            {
                (held, held_uncached, held_cost) = (Some(c.i), c.uncached_tokens, c.cost);
            }
        }
        // (When the cost's own choice caches as much, there is nothing to hold.)
        if let Some(h) = held.filter(|_| any_near && held_uncached < greedy) {
            let reason = if reason == Reason::NoKvHeadroom { reason } else { Reason::PrefixMatch };
            return Ok(Decision::at(view, req, h, reason));
        }
        // Spreading comes after affinity: a cache hit held within the tail budget is not given
        // away, and every request's own prefill feeds that budget. (Before it, with peers
        // active, conversation ×22 through 4 router nodes lost hit rate 0.248 → 0.221 and p99
        // read 2.20 s against 1.71 s without spreading: BENCHMARKS.md, multi-router.)
        if view.active_peers > 0 {
            if let Some(i) = spread_among_peers(&p, scores.clone(), &mut self.near, best, view) {
                return Ok(Decision::at(view, req, i, reason));
            }
        }
        // Among near-equal replicas, the lowest TTFT, then the one routed to longest ago (a
        // random one among exact ties): the estimate cannot see a step already running, and
        // rotating among equals spaces arrivals out on each replica, as round robin does,
        // instead of letting two land together on one.
        self.near.clear();
        self.near.extend(
            scores
                .filter(near_cost)
                .filter(|c| c.ttft_s <= fastest_near + tolerance)
                .map(|c| (c.i, view.replicas[c.i].last_routed_at.unwrap_or(f64::NEG_INFINITY))),
        );
        let i = lowest(&self.near, 0.0, rng).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, reason))
    }
}
