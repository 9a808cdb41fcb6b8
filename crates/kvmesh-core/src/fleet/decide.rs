//! Decisions: a request's view prepared (overlaps from the index, the routing record and
//! planned warm-ups), the policy run on it, the decision booked; whether a request fits.

use super::*;
use crate::error::Error;
use crate::hashing::ModelKey;
use crate::ids::ReplicaId;
use crate::load::BookingSpec;
use crate::overlap::Overlap;
use crate::policy::{Decision, Policy};
use rand::RngCore;

impl Fleet {
    /// Builds the decision snapshot for `req` and lets `policy` pick.
    ///
    /// # Errors
    /// [`Error::NoReplicaReady`] when no replica takes traffic.
    pub fn decide(
        &mut self,
        policy: &mut dyn Policy,
        req: &RouteRequest,
        rng: &mut dyn RngCore,
        now: f64,
    ) -> Result<Decision, Error> {
        self.decide_within(policy, req, None, rng, now)
    }

    /// [`Fleet::decide`] among `subset` only (replica ids, sorted ascending), when given: the
    /// endpoint subset a gateway sends with a request (the Gateway API Inference Extension's
    /// `x-gateway-destination-endpoint-subset`, docs/proposals/004-endpoint-picker-protocol).
    ///
    /// # Errors
    /// [`Error::NoReplicaReady`] when no replica of the subset takes traffic.
    pub fn decide_within(
        &mut self,
        policy: &mut dyn Policy,
        req: &RouteRequest,
        subset: Option<&[ReplicaId]>,
        rng: &mut dyn RngCore,
        now: f64,
    ) -> Result<Decision, Error> {
        self.decide_role(Role::Both, policy, req, subset, rng, now)
    }

    /// [`Fleet::decide_within`] among the replicas of `role` only: one side of a
    /// disaggregated request decided by `policy` (the simulator's peer pairs: SGLang's and the
    /// vLLM router's disaggregated modes pick each side with a policy of their own).
    ///
    /// # Errors
    /// [`Error::NoReplicaReady`] when no replica of `role` takes traffic.
    pub fn decide_role(
        &mut self,
        role: Role,
        policy: &mut dyn Policy,
        req: &RouteRequest,
        subset: Option<&[ReplicaId]>,
        rng: &mut dyn RngCore,
        now: f64,
    ) -> Result<Decision, Error> {
        self.ready_for(policy, req, now);
        let view = self.view(role, req, subset, now);
        if view.routable().next().is_none() {
            return Err(Error::NoReplicaReady);
        }
        let decision = policy.pick(req, &view, rng)?;
        // A policy is user-extensible code: never book on a replica that cannot take traffic.
        match self.pos(decision.replica) {
            Some(p) if view.takes(p) => Ok(decision),
            _ => Err(Error::UnknownReplica(decision.replica)),
        }
    }

    /// Readies the fleet for a decision on `req` at `now`: the policy told of the lifecycle
    /// events since its last pick, decoding outputs re-estimated, the overlaps filled.
    fn ready_for(&mut self, policy: &mut dyn Policy, req: &RouteRequest, now: f64) {
        if !self.lifecycle.is_empty() {
            policy.observe(&self.lifecycle);
            self.lifecycle.clear();
        }
        self.refresh_outputs(now);
        self.prepare(req, policy.reads_kv_events(), policy.pending_prefix_s(), now);
    }

    /// The decision snapshot for `req` among the replicas of `role` (after
    /// [`Fleet::ready_for`]).
    pub(super) fn view<'a>(
        &'a self,
        role: Role,
        req: &RouteRequest,
        subset: Option<&'a [ReplicaId]>,
        now: f64,
    ) -> FleetView<'a> {
        debug_assert!(subset.is_none_or(|s| s.is_sorted()), "the subset must be sorted by id");
        // A model of another block size: the view counts its blocks in that size.
        let config = self.config_of(req.model);
        FleetView {
            now,
            epoch: self.epoch,
            config,
            replicas: &self.replicas,
            loads: self.bookings.loads(),
            overlaps: &self.overlaps,
            expected_output_tokens: self.expected_output_tokens(req),
            active_peers: self.active_peers,
            peer_rank: self.peer_rank,
            subset,
            model: req.model.unwrap_or(self.hasher.model()),
            role,
        }
    }

    /// Routes `req` at `now`: decides, books the chosen replica, and records the prefix in the
    /// routing record when a policy or an approximate-mode replica needs it.
    ///
    /// # Errors
    /// As [`Fleet::decide`].
    pub fn route(
        &mut self,
        policy: &mut dyn Policy,
        req: &RouteRequest,
        rng: &mut dyn RngCore,
        now: f64,
    ) -> Result<Routed, Error> {
        let decision = self.decide(policy, req, rng, now)?;
        self.book_decision(policy, req, decision, now)
    }

    /// Books `decision`, made by [`Fleet::decide`] for `req` on this fleet, at `now` (what
    /// [`Fleet::route`] does after deciding; apart for a caller that checks the decision
    /// first, as admission control does).
    ///
    /// # Errors
    /// [`Error::UnknownReplica`] when the chosen replica is gone or no longer routable.
    pub fn book_decision(
        &mut self,
        policy: &mut dyn Policy,
        req: &RouteRequest,
        decision: Decision,
        now: f64,
    ) -> Result<Routed, Error> {
        let p = self
            .pos(decision.replica)
            .filter(|&p| self.replicas[p].routable())
            .ok_or(Error::UnknownReplica(decision.replica))?;
        let spec = BookingSpec {
            uncached_prefill_tokens: decision.uncached_tokens,
            uncached_blocks: decision.uncached_blocks,
            expected_output_tokens: self.expected_output_tokens(req),
            reports_first_token: req.streamed,
            output_key: crate::load::output_key(&req.hashes),
            reestimate_up_to: req
                .max_tokens
                .filter(|_| self.config.learn_output_lengths && req.output_hint.is_none())
                .map(|m| m.min(u32::try_from(self.largest_kv_tokens()).unwrap_or(u32::MAX))),
        };
        let booking = self.bookings.book(decision.replica, spec, now);
        let r = &mut self.replicas[p];
        r.last_routed_at = Some(now);
        let approx = r.overlap_source() == OverlapSource::Approximate;
        if policy.pending_prefix_s().is_some() || (approx && policy.reads_kv_events()) {
            self.record.record(decision.replica, &req.hashes, now);
        }
        self.own.insert(booking);
        policy.booked(req, &decision, booking, now);
        Ok(Routed { decision, booking })
    }

    /// With [`FleetConfig::learn_output_lengths`], at most every [`OUTPUT_REFRESH_S`]:
    /// re-estimates decoding bookings' outputs from what each has generated (its time since
    /// first token over its replica's decode step, β0 + β2 · decoding).
    fn refresh_outputs(&mut self, now: f64) {
        if !self.config.learn_output_lengths || now - self.outputs_refreshed_at < OUTPUT_REFRESH_S {
            return;
        }
        self.outputs_refreshed_at = now;
        self.step_s.clear();
        for r in &self.replicas {
            let i = r.id.index();
            if self.step_s.len() <= i {
                self.step_s.resize(i + 1, f64::NAN);
            }
            let decoding = self.bookings.load(r.id).decoding;
            let p = &r.spec.profile;
            self.step_s[i] = p.step_overhead_s + p.decode_s_per_token * f64::from(decoding);
        }
        let steps = &self.step_s;
        self.bookings.refresh_outputs(now, |i| steps.get(i).copied().unwrap_or(f64::NAN));
    }

    /// The most KV any registered replica holds, tokens (its `capacity_blocks` blocks of
    /// `block_size` tokens); 0 with no replica.
    pub fn largest_kv_tokens(&self) -> u64 {
        self.largest_blocks().saturating_mul(u64::from(self.config.block_size))
    }

    fn largest_blocks(&self) -> u64 {
        self.largest_blocks
    }

    /// The largest `capacity_blocks` among the replicas serving `model` (`None` or
    /// [`ModelKey::ANY`]: all replicas) whose capacity is known; 0 with none.
    fn largest_blocks_of(&self, model: Option<ModelKey>) -> u64 {
        let of = |r: &&ReplicaState| model.is_none_or(|m| m == ModelKey::ANY || r.model == m);
        self.replicas.iter().filter(of).map(|r| r.spec.capacity_blocks).max().unwrap_or(0)
    }

    /// Whether a request of `prompt_tokens` and at most `max_tokens` output tokens fits no
    /// registered replica even empty, as the KV headroom check counts it (prompt and output
    /// each rounded up to whole blocks of `block_size`): more blocks than the largest
    /// `capacity_blocks` known (a replica whose engine has not reported its capacity yet is
    /// judged once it has: one that never does must not keep every request waiting). `None`
    /// when it fits one, or with no replica of known capacity.
    /// [`FitsNowhere::certain`] says whether the engine would refuse it too (vLLM starts only
    /// with `max_model_len` within its KV, and counts the sequence's tokens as a whole).
    pub fn fits_nowhere(&self, prompt_tokens: u32, max_tokens: Option<u32>) -> Option<FitsNowhere> {
        self.fits_nowhere_for(None, prompt_tokens, max_tokens)
    }

    /// [`Fleet::fits_nowhere`] among the replicas serving `model` only (a request's
    /// [`RouteRequest::model`]; `None` or [`ModelKey::ANY`]: every replica).
    pub fn fits_nowhere_for(
        &self,
        model: Option<ModelKey>,
        prompt_tokens: u32,
        max_tokens: Option<u32>,
    ) -> Option<FitsNowhere> {
        let block_size = self.block_size_of(model);
        let bs = u64::from(block_size);
        let (prompt, output) = (u64::from(prompt_tokens), u64::from(max_tokens.unwrap_or(0)));
        let counted = prompt.div_ceil(bs) + output.div_ceil(bs);
        let needed_blocks = (prompt + output).div_ceil(bs);
        let largest_blocks = self.largest_blocks_of(model);
        (largest_blocks > 0 && counted > largest_blocks).then_some(FitsNowhere {
            prompt_tokens,
            max_tokens: max_tokens.unwrap_or(0),
            needed_blocks,
            largest_blocks,
            block_size,
        })
    }

    /// The output tokens `req` is expected to produce, booked as its decode work and KV:
    /// its hint, its output key's learned mean (with [`FleetConfig::learn_output_lengths`]),
    /// its `max_tokens`, else the running mean of outputs (in that order:
    /// [`crate::load::OutputEstimator::expect_for`]);
    /// at most the largest replica's KV, so that a `max_tokens` of 4,294,967,295 does not book
    /// more decode work than any replica could ever run. (Not less: with its prompt, a request
    /// that fits nowhere must still fit nowhere.)
    pub fn expected_output_tokens(&self, req: &RouteRequest) -> u32 {
        let key = crate::load::output_key(&req.hashes);
        let learn = self.config.learn_output_lengths;
        let expected = self.bookings.outputs().expect_for(req.max_tokens, req.output_hint, key, learn);
        expected.min(u32::try_from(self.largest_kv_tokens()).unwrap_or(u32::MAX))
    }

    /// Whether capacity is short for `decision`: no replica had KV headroom for the request
    /// (reason [`crate::Reason::NoKvHeadroom`]), or every routable replica already carries its
    /// profile's `max_num_seqs` requests or more (`decision` is not booked yet: admission
    /// control checks before [`Fleet::book_decision`]) — every routable replica of the chosen
    /// replica's model and role. This is the trigger of admission control (wait rather than pile onto
    /// full replicas).
    pub fn capacity_short(&self, decision: &Decision) -> bool {
        if decision.reason == crate::policy::Reason::NoKvHeadroom {
            return true;
        }
        let loads = self.bookings.loads();
        // Only the chosen replica's model's replicas could have taken the request.
        let model = self.replica(decision.replica).map(|r| (r.model, r.spec.role));
        let mut routable =
            self.replicas.iter().filter(|r| r.routable() && Some((r.model, r.spec.role)) == model).peekable();
        routable.peek().is_some()
            && routable.all(|r| loads.get(r.id.index()).map_or(0, |l| l.outstanding()) >= r.spec.profile.max_num_seqs)
    }

    /// Fills the per-replica overlap scratch for `req`: index overlaps for event-fed replicas,
    /// record overlaps for approximate ones (nothing at all for a policy that reads no KV
    /// events), and, when the policy counts pending prefixes, recent routing-record entries merged into the
    /// overlaps as cached (routed there, not yet confirmed by events). "Recent" is per replica:
    /// `pending` seconds plus the replica's current prefill queue delay, since a prefix routed
    /// behind a queue is computed only when the queue reaches it — and once it should have been,
    /// only the replica's own events count (they also show evictions, which the record cannot).
    fn prepare(&mut self, req: &RouteRequest, events: bool, pending: Option<f64>, now: f64) {
        let n = self.replicas.len();
        self.overlaps.clear();
        self.overlaps.resize(n, Overlap::default());
        if !events {
            return;
        }
        self.sparse.clear();
        self.index.read().overlaps(&req.hashes, &mut self.sparse);
        scatter(&self.sparse, &self.replicas, |p, o| self.overlaps[p] = o);
        let any_approx = self.replicas.iter().any(|r| r.overlap_source() == OverlapSource::Approximate);
        if any_approx {
            self.record_overlaps.clear();
            self.record_overlaps.resize(n, 0);
            self.sparse.clear();
            self.record.overlaps(&req.hashes, now, &mut self.sparse);
            scatter(&self.sparse, &self.replicas, |p, o| self.record_overlaps[p] = o.gpu);
            for (p, r) in self.replicas.iter().enumerate() {
                if r.overlap_source() == OverlapSource::Approximate {
                    self.overlaps[p] = Overlap::gpu(self.record_overlaps[p]);
                }
            }
        }
        if let Some(base) = pending {
            self.sparse.clear();
            let (bookings, config) = (&self.bookings, &self.config);
            let (replicas, positions) = (&self.replicas, &self.positions);
            // Asked once per record entry, so once per replica listed under each of the
            // prompt's recorded blocks: each replica's window is worked out once.
            self.pending_windows.clear();
            self.pending_windows.resize(self.next_id as usize, std::cell::Cell::new(f64::NAN));
            let memo = &self.pending_windows;
            let window = |id: ReplicaId| {
                let Some(cell) = memo.get(id.index()) else { return 0.0 };
                if !cell.get().is_nan() {
                    return cell.get();
                }
                let w = match super::membership::position(positions, id) {
                    Some(p) => {
                        let rate = replicas[p].profile(config.learn_prefill_rate).prefill_s_per_token;
                        base + bookings.load(id).queued_prefill_at(now, rate) as f64 * rate
                    }
                    // (A replica removed: its entries were forgotten with it.)
                    None => base,
                };
                cell.set(w);
                w
            };
            // Every window is at least `base`: entries younger than that count unasked.
            self.record.overlaps_within(&req.hashes, now, base, window, &mut self.sparse);
            scatter(&self.sparse, &self.replicas, |p, o| self.overlaps[p].gpu = self.overlaps[p].gpu.max(o.gpu));
        }
        // Planned replication targets: warm-ups are on their way (see `set_replication_plan`).
        for w in &self.planned {
            let d = w.depth as usize;
            if req.hashes.len() < d || req.hashes[d - 1] != w.hash {
                continue;
            }
            for &(id, until) in &w.targets {
                if now < until {
                    if let Some(p) = super::membership::position(&self.positions, id) {
                        self.overlaps[p].gpu = self.overlaps[p].gpu.max(w.depth);
                    }
                }
            }
        }
    }
}

/// Calls `set(position, overlap)` for each `(replica, overlap)` of `sparse` (sorted by id)
/// whose replica is registered.
fn scatter(sparse: &[(ReplicaId, Overlap)], replicas: &[ReplicaState], mut set: impl FnMut(usize, Overlap)) {
    let mut p = 0;
    for &(id, o) in sparse {
        while p < replicas.len() && replicas[p].id < id {
            p += 1;
        }
        if p < replicas.len() && replicas[p].id == id {
            set(p, o);
        }
    }
}
