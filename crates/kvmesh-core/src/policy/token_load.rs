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
    estimates: Vec<(usize, crate::view::Estimate)>,
    fits: Vec<(usize, f64)>,
    all: Vec<(usize, f64)>,
    near: Vec<(usize, f64)>,
    /// Own prefill times (uncached part at the best-cached replica, no queue) of recent requests.
    own_prefill: RecentP99,
    /// View position → index into `estimates`, per pick.
    slot: Vec<usize>,
}

impl TokenLoadPolicy {
    /// A policy with `params`.
    pub fn new(params: TokenLoadParams) -> Self {
        TokenLoadPolicy {
            params,
            estimates: Vec::new(),
            fits: Vec::new(),
            all: Vec::new(),
            near: Vec::new(),
            own_prefill: RecentP99::new(),
            slot: Vec::new(),
        }
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
    estimates: &[(usize, crate::view::Estimate)],
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
        let p = self.params;
        self.estimates.clear();
        self.fits.clear();
        self.all.clear();
        let estimator = view.estimator(req);
        self.estimates.extend(view.routable().map(|i| (i, estimator.at(i))));
        let Some(&(first, _)) = self.estimates.first() else { return Err(Error::NoReplicaReady) };
        // View position → its estimate, for the lookups below (O(1) each: fleets of a thousand
        // replicas decide here).
        self.slot.clear();
        self.slot.resize(view.replicas.len(), usize::MAX);
        for (k, &(i, _)) in self.estimates.iter().enumerate() {
            self.slot[i] = k;
        }
        // The recompute charge: prefill a move away from the best-cached replica adds to the
        // fleet's work, weighted by how many requests already queue per replica.
        // The fewest uncached tokens, whether a replica computing only those has KV room, and
        // the first such replica, in one pass.
        let (fewest_uncached, best_cached_fits, cached_best) =
            self.estimates.iter().fold((u32::MAX, false, first), |(fewest, fits, at), &(i, e)| {
                match e.uncached_tokens.cmp(&fewest) {
                    std::cmp::Ordering::Less => (e.uncached_tokens, e.kv_headroom_blocks >= 0, i),
                    std::cmp::Ordering::Equal => (fewest, fits || e.kv_headroom_blocks >= 0, at),
                    std::cmp::Ordering::Greater => (fewest, fits, at),
                }
            });
        let n = self.estimates.len() as f64;
        let pressure = self.estimates.iter().map(|&(i, _)| view.load(i).prefilling as f64).sum::<f64>() / n;
        let charge = p.move_weight * (pressure - p.pressure_floor).clamp(0.0, p.max_pressure);
        // Staying is worth the decode time a move would take from others only where staying
        // fits: a replica short of KV room would preempt its own decodes instead.
        let interference = if best_cached_fits { p.interference_weight } else { 0.0 };
        for &(i, e) in &self.estimates {
            let extra = e.uncached_tokens - fewest_uncached;
            let mut cost = e.ttft_s + p.kv_wait_weight * e.kv_wait_s;
            if (charge > 0.0 || interference > 0.0) && extra > 0 {
                let s_per_token = view.replicas[i].profile(view.config.learn_prefill_rate).prefill_s_per_token;
                let decoding = f64::from(view.load(i).decoding);
                cost += (charge + interference * decoding) * extra as f64 * s_per_token;
            }
            self.all.push((i, cost));
            if e.kv_headroom_blocks >= 0 {
                self.fits.push((i, cost));
            }
        }
        let reason = if self.fits.is_empty() { Reason::NoKvHeadroom } else { Reason::LowestCost };
        let scores = if p.kv_wait_weight > 0.0 || self.fits.is_empty() { &self.all } else { &self.fits };
        let best = scores.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
        let tolerance = p.near_equal_s.max(p.near_equal_rel * best);
        let (estimates, slot) = (&self.estimates, &self.slot);
        let est = |i: usize| estimates[slot[i]].1;
        // The request's own prefill, no queue, at the replica caching most of it.
        let profile = view.replicas[cached_best].profile(view.config.learn_prefill_rate);
        self.own_prefill.observe(profile.ttft(u64::from(fewest_uncached), 0));
        if p.affinity_budget > 0.0 {
            // Its wait there: queue and prefill. Not the wait for KV room the cost prices: with it
            // in, synthetic ×21 read 2.08 s p99 against 1.92 s, conversation ×17.6 1.45 against
            // 1.42 s (BENCHMARKS.md); a replica chosen short of room is priced there anyway.
            let wait = |i: usize| est(i).ttft_s;
            let fastest = scores.iter().map(|s| wait(s.0)).fold(f64::INFINITY, f64::min);
            let budget = (p.affinity_budget * self.own_prefill.p99()).max(fastest);
            // A request that grows in decode, held on a replica short of KV room while others
            // have room, fills it to preemption: running sequences' next blocks evict each
            // other (RL rollouts at ~100 % load, seed 1: 29,174 preemptions, step p99 85.7 s →
            // 0 and 63.3 s; BENCHMARKS.md, decode-heavy traffic). It applies to requests
            // without max_tokens too: expected at the running mean, a short prompt counts. A prompt-heavy one only waits there
            // for room, which the budget prices: requiring room for every request cost p99
            // TTFT on the Mooncake conversation trace at ×22 (1.62 → 1.77 s), for those whose
            // output is at least a quarter of the prompt 1.73 s, half or more 1.62 s.
            let share = p.affinity_room_share;
            let room = share > 0.0 && !self.fits.is_empty();
            let heavy = room && f64::from(view.expected_output_tokens) >= share * f64::from(req.prompt_tokens);
            let fits = move |i: usize| !heavy || est(i).kv_headroom_blocks >= 0;
            let within = || scores.iter().filter(move |s| wait(s.0) <= budget && fits(s.0));
            let most_cached = within().map(|s| est(s.0).uncached_tokens).min();
            let greedy = scores.iter().filter(|s| s.1 <= best + tolerance).map(|s| est(s.0).uncached_tokens).min();
            if let (Some(f), Some(g)) = (most_cached, greedy) {
                if f < g {
                    let pick = within().filter(|s| est(s.0).uncached_tokens == f).min_by(|a, b| a.1.total_cmp(&b.1));
                    if let Some(&(i, _)) = pick {
                        let reason = if reason == Reason::NoKvHeadroom { reason } else { Reason::PrefixMatch };
                        return Ok(Decision::at(view, req, i, reason));
                    }
                }
            }
        }
        // Spreading comes after affinity: a cache hit held within the tail budget is not given
        // away, and every request's own prefill feeds that budget. (Before it, with peers
        // active, conversation ×22 through 4 router nodes lost hit rate 0.248 → 0.221 and p99
        // read 2.20 s against 1.71 s without spreading: BENCHMARKS.md, multi-router.)
        if view.active_peers > 0 {
            if let Some(i) = spread_among_peers(&p, scores, &self.estimates, &mut self.near, best, view) {
                return Ok(Decision::at(view, req, i, reason));
            }
        }
        // Among near-equal replicas, the lowest TTFT, then the one routed to longest ago (a
        // random one among exact ties): the estimate cannot see a step already running, and
        // rotating among equals spaces arrivals out on each replica, as round robin does,
        // instead of letting two land together on one.
        let near_cost = |s: &&(usize, f64)| s.1 <= best + tolerance;
        let fastest = scores.iter().filter(near_cost).map(|s| est(s.0).ttft_s).fold(f64::INFINITY, f64::min);
        self.near.clear();
        self.near.extend(
            scores
                .iter()
                .filter(near_cost)
                .filter(|s| est(s.0).ttft_s <= fastest + tolerance)
                .map(|&(i, _)| (i, view.replicas[i].last_routed_at.unwrap_or(f64::NEG_INFINITY))),
        );
        let i = lowest(&self.near, 0.0, rng).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, reason))
    }
}
