//! What a routing decision reads, below both the fleet that owns it and the policies that
//! decide on it: the fleet-wide settings ([`FleetConfig`]), each replica's registered spec and
//! live state ([`ReplicaSpec`], [`ReplicaState`], [`ReplicaStatus`], [`Role`]), the request
//! ([`RouteRequest`]), and the view a policy decides on ([`FleetView`]).
//!
//! [`FleetView`]: the read-only snapshot one routing decision reads — every replica's state,
//! booked load and overlap with the request — and the TTFT / KV-headroom estimate all policies
//! share.

mod config;
mod replica;
mod request;
mod status;

pub use config::FleetConfig;
pub use replica::{OverlapSource, ReplicaSpec, ReplicaState, Role};
pub use request::RouteRequest;
pub use status::ReplicaStatus;

use crate::load::TokenLoad;
use crate::overlap::Overlap;

/// What a policy may read for one decision. Slices `replicas` and `overlaps` are parallel
/// (position `i` is one replica); `loads` is indexed by replica id. Policies that reproduce a
/// peer router keep what that peer records of its own routing themselves (see
/// [`crate::policy::Policy::booked`]).
#[derive(Debug, Clone, Copy)]
pub struct FleetView<'a> {
    /// Decision time, seconds.
    pub now: f64,
    /// Fleet membership epoch: changes whenever a replica is added, removed or changes whether it is routable,
    /// so policies can cache structures built from membership (the hash ring).
    pub epoch: u64,
    /// Fleet settings (block size, freshness windows).
    pub config: &'a FleetConfig,
    /// Registered replicas, sorted by id (draining ones included: check `routable`).
    pub replicas: &'a [ReplicaState],
    /// Booked load, indexed by replica id.
    pub loads: &'a [TokenLoad],
    /// Each replica's overlap with the request, from its events (or its approximate record).
    pub overlaps: &'a [Overlap],
    /// Expected output tokens of this request (see [`crate::load::OutputEstimator`]).
    pub expected_output_tokens: u32,
    /// Other router nodes routing to the same replicas right now (heard from recently by
    /// gossip), whose latest decisions this view may not include yet; 0 for a single router.
    pub active_peers: u32,
    /// This router's position (0..=`active_peers`) among itself and its active peers, by node
    /// id: simultaneous deciders that see the same view take different ranks.
    pub peer_rank: u32,
    /// The replicas this decision may pick from, sorted by id (a gateway's endpoint subset,
    /// see [`crate::fleet::Fleet::decide_within`]); `None`: every routable replica.
    pub subset: Option<&'a [crate::ids::ReplicaId]>,
    /// The model the request asks for: only replicas serving it take the request
    /// ([`crate::ModelKey::ANY`]: any replica).
    pub model: crate::hashing::ModelKey,
    /// The role the picked replica plays: [`Role::Both`] for a whole request, or one side of
    /// a disaggregated one. Only replicas of that role take it.
    pub role: Role,
}

/// One replica's estimated cost for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// Prompt tokens the replica would compute after the overlap credit, tokens.
    pub uncached_tokens: u32,
    /// KV blocks the prompt adds there (uncached blocks, partial last block included).
    pub uncached_blocks: u32,
    /// Estimated time to first token, queue included, seconds.
    pub ttft_s: f64,
    /// Free KV blocks minus the blocks this request needs; negative = it does not fit now.
    pub kv_headroom_blocks: i64,
    /// Prefill queued ahead of the request there now (booked, drained at the replica's rate),
    /// tokens.
    pub queued_tokens: u64,
    /// When the request does not fit the replica's free KV now: the estimated wait for
    /// running sequences to finish and free the blocks it lacks, seconds; else 0.
    pub kv_wait_s: f64,
    /// The replica's prefill speed the estimate used, seconds per token (its profile's β1, or
    /// the learned rate with [`FleetConfig::learn_prefill_rate`]).
    pub prefill_s_per_token: f64,
    /// Booked requests there before their first token, and decoding
    /// ([`TokenLoad::prefilling`], [`TokenLoad::decoding`]).
    pub prefilling: u32,
    /// See [`Estimate::prefilling`].
    pub decoding: u32,
}

impl<'a> FleetView<'a> {
    /// Positions of replicas that take new requests: routable, of the view's role, serving
    /// the request's model, within the subset if one is given.
    pub fn routable(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.replicas.len()).filter(|&i| self.takes(i))
    }

    /// Whether the replica at position `i` may take this request: routable, of the view's
    /// role, serving its model, and in the subset when one is given.
    #[inline]
    pub fn takes(&self, i: usize) -> bool {
        let r = &self.replicas[i];
        r.routable()
            && r.spec.role == self.role
            && (r.model == self.model || self.model == crate::hashing::ModelKey::ANY)
            && self.subset.is_none_or(|s| s.binary_search(&r.id).is_ok())
    }

    /// Booked load of the replica at position `i`.
    #[inline]
    pub fn load(&self, i: usize) -> TokenLoad {
        self.loads.get(self.replicas[i].id.index()).copied().unwrap_or_default()
    }

    /// How much of the replica's event overlap to trust, 0.0 to 1.0. vLLM publishes no
    /// heartbeat, so an idle replica's silence proves nothing; but a replica that delivered a
    /// first token after its last event has computed blocks it did not announce. From then on
    /// the silence counts: full credit while the last event is at most `event_fresh_s` old,
    /// fading linearly to zero at `event_stale_s` (the index may be missing blocks or holding
    /// evicted ones, so the policy falls back to load only). Replicas in approximate mode get
    /// full credit: their record expires by its own TTL.
    pub fn overlap_credit(&self, i: usize) -> f64 {
        let r = &self.replicas[i];
        if r.overlap_source() == OverlapSource::Approximate {
            return 1.0;
        }
        let (Some(at), Some(served)) = (r.last_event_at, r.last_first_token_at) else { return 1.0 };
        if served <= at {
            return 1.0;
        }
        let age = (self.now - at).max(0.0);
        let (fresh, stale) = (self.config.event_fresh_s, self.config.event_stale_s);
        if age <= fresh {
            1.0
        } else if age >= stale {
            0.0
        } else {
            (stale - age) / (stale - fresh)
        }
    }

    /// KV blocks in use on the replica at `i`: with a fresh engine report, the engine's figure
    /// moved by what this router booked or released since (the report is up to a scrape old),
    /// and at least the router's own bookings; else the bookings alone.
    pub fn kv_used_blocks(&self, i: usize) -> u64 {
        self.kv_used_blocks_booked(i, self.load(i).kv_blocks)
    }

    /// [`Self::kv_used_blocks`] with the replica's booked KV blocks already read.
    #[inline]
    fn kv_used_blocks_booked(&self, i: usize, booked: u64) -> u64 {
        let r = &self.replicas[i];
        match r.metrics {
            Some(m) if m.age(self.now) <= self.config.metrics_fresh_s => {
                let reported = m.kv_usage.clamp(0.0, 1.0) * r.spec.capacity_blocks as f64;
                let since = booked as f64 - r.kv_booked_at_report as f64;
                let now = (reported + since).clamp(0.0, r.spec.capacity_blocks as f64) as u64;
                booked.max(now)
            }
            _ => booked,
        }
    }

    /// The cost of sending `req` to the replica at `i` (see [`Estimator::at`]).
    pub fn estimate(&self, i: usize, req: &RouteRequest) -> Estimate {
        self.estimator(req).at(i)
    }

    /// The part of `e` (the replica at `i`'s [`Estimate`]) spent waiting before the request's
    /// own prefill runs there — the prefill queued ahead, slowed by the replica's decodes, and
    /// the wait for a batch slot — seconds. Computed for a chosen replica only, not while
    /// scoring every one.
    pub fn queue_wait_s(&self, i: usize, e: &Estimate) -> f64 {
        let profile = self.replicas[i].profile(self.config.learn_prefill_rate);
        (e.ttft_s - profile.ttft(u64::from(e.uncached_tokens), self.load(i).decoding)).max(0.0)
    }

    /// The per-request part of [`Self::estimate`], computed once for scoring every replica.
    #[inline]
    pub fn estimator(&self, req: &RouteRequest) -> Estimator<'_, 'a> {
        let bs = self.config.block_size;
        Estimator {
            view: self,
            block_size: bs as u64,
            prompt: req.prompt_tokens as u64,
            prompt_blocks: req.prompt_tokens.div_ceil(bs) as u64,
            output_blocks: self.expected_output_tokens.div_ceil(bs) as i64,
        }
    }
}

/// Scores one request against each replica of a view.
#[derive(Debug, Clone, Copy)]
pub struct Estimator<'v, 'a> {
    view: &'v FleetView<'a>,
    block_size: u64,
    prompt: u64,
    prompt_blocks: u64,
    output_blocks: i64,
}

impl Estimator<'_, '_> {
    /// The cost of the request on the replica at `i`, with its event overlap discounted by
    /// [`FleetView::overlap_credit`]. vLLM always recomputes at least the prompt's last token
    /// (it needs its logits), so a fully cached prompt still costs one token. KV need is the
    /// uncached prompt blocks plus the expected output blocks.
    ///
    /// Runs once per replica per decision, so it avoids integer division: cached tokens are
    /// whole blocks, so uncached blocks are `⌈prompt / block_size⌉ − cached blocks`.
    // Always inlined: returned through memory, the estimate's fields were read back before
    // their stores could forward (at 1,024 replicas a third of the policy's own time).
    #[inline(always)]
    pub fn at(&self, i: usize) -> Estimate {
        let view = self.view;
        let held = view.overlaps[i].gpu as u64;
        let cached_blocks = if held == 0 {
            0
        } else {
            let credit = view.overlap_credit(i);
            if credit >= 1.0 {
                held
            } else {
                (held as f64 * credit) as u64
            }
        };
        let (uncached, uncached_blocks) = if self.prompt == 0 {
            (0, 0)
        } else if cached_blocks * self.block_size >= self.prompt {
            (1, 1)
        } else {
            (self.prompt - cached_blocks * self.block_size, self.prompt_blocks - cached_blocks)
        };
        let load = view.load(i);
        let r = &view.replicas[i];
        let profile = if view.config.learn_prefill_rate { r.profile(true) } else { r.spec.profile };
        let queued = load.queued_prefill_at(view.now, profile.prefill_s_per_token);
        let slot_wait = profile.slot_wait(load.outstanding(), load.decoding, view.expected_output_tokens);
        let ttft_s = profile.ttft(queued + uncached, load.decoding) + slot_wait;
        let used = view.kv_used_blocks_booked(i, load.kv_blocks);
        let free = r.spec.capacity_blocks as i64 - used as i64;
        let headroom = free - uncached_blocks as i64 - self.output_blocks;
        let kv_wait_s = if headroom >= 0 {
            0.0
        } else {
            // Decoding sequences free what they hold as they finish: with `used` blocks spread
            // over sequences a mean output apart, about `used / (output · step)` blocks a
            // second, each step also carrying a prefill chunk while prefill is queued.
            let chunk = queued.min(u64::from(profile.chunk_tokens)) as f64;
            let step = profile.step_overhead_s
                + profile.decode_s_per_token * f64::from(load.decoding)
                + profile.prefill_s_per_token * chunk;
            let output = f64::from(view.expected_output_tokens.max(1));
            (-headroom) as f64 * output * step / used.max(1) as f64
        };
        Estimate {
            uncached_tokens: uncached as u32,
            uncached_blocks: uncached_blocks as u32,
            ttft_s,
            kv_headroom_blocks: headroom,
            queued_tokens: queued,
            kv_wait_s,
            prefill_s_per_token: profile.prefill_s_per_token,
            prefilling: load.prefilling,
            decoding: load.decoding,
        }
    }
}
