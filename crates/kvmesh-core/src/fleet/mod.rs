//! The fleet: every replica's registration, the prefix index, the routing record and the
//! bookings, and the one call that routes a request through a [`Policy`].
//!
//! ```text
//!  KV events ──► apply_event ──► PrefixIndex ─┐
//!  engine metrics ──► report_metrics ─────────┤
//!  route(req) ──► FleetView (snapshot) ──► Policy::pick ──► Decision ──► book ──► BookingId
//!  first_token / release / expire ──► Bookings ──► TokenLoad
//! ```
//!
//! The fleet never reads a clock or an RNG: callers pass `now` (seconds on their clock) and a
//! random source, so the simulator replays a run from its seed and the node uses real time.
//! The same `route` runs in the node and the simulator.

mod pd;

pub use crate::view::{
    Estimate, Estimator, FleetConfig, FleetView, OverlapSource, ReplicaSpec, ReplicaState, ReplicaStatus, Role,
    RouteRequest,
};
pub use pd::{PdDecision, PdRouted};

use crate::error::Error;
use crate::hashing::{BlockHasher, ModelKey, Namespace};
use crate::ids::{BlockHash, ReplicaId};
use crate::index::{ApplyOutcome, KvEvent, PrefixIndex};
use crate::load::{BookingId, BookingSpec, Bookings, EngineMetrics, FleetEvent};
use crate::overlap::Overlap;
use crate::policy::{Decision, Policy};
use crate::record::RoutingRecord;
use rand::RngCore;
use rustc_hash::{FxHashMap, FxHashSet};
use xxhash_rust::xxh3::xxh3_64;

/// A routing decision and the booking it made.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Routed {
    /// What the policy chose and why.
    pub decision: Decision,
    /// The booking to end with [`Fleet::release`].
    pub booking: BookingId,
}

/// A request no replica could hold ([`Fleet::fits_nowhere`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FitsNowhere {
    /// Its prompt, tokens.
    pub prompt_tokens: u32,
    /// Its `max_tokens` (0 when not given).
    pub max_tokens: u32,
    /// KV blocks its whole sequence (prompt and output) needs.
    pub needed_blocks: u64,
    /// The largest replica's `capacity_blocks`.
    pub largest_blocks: u64,
    /// Tokens per block.
    pub block_size: u32,
}

impl FitsNowhere {
    /// Whether the whole sequence exceeds the largest replica (the engine refuses it too), not
    /// only the router's per-part rounding.
    pub fn certain(&self) -> bool {
        self.needed_blocks > self.largest_blocks
    }
}

/// Everything one router knows about its replicas.
#[derive(Debug)]
pub struct Fleet {
    config: FleetConfig,
    hasher: BlockHasher,
    replicas: Vec<ReplicaState>,
    index: PrefixIndex,
    record: RoutingRecord,
    bookings: Bookings,
    next_id: u32,
    epoch: u64,
    active_peers: u32,
    peer_rank: u32,
    /// Planned replication targets treated as holding their prefix until a deadline.
    planned: Vec<PlannedWarm>,
    /// Live bookings this fleet's own decisions made (not ones learned from peers): the
    /// bookings whose lifecycle policies are told of.
    own: FxHashSet<BookingId>,
    /// First tokens and ends of `own` bookings and replica removals since the last decision,
    /// oldest first; handed to the policy before it next picks ([`Policy::observe`]). At most
    /// two per own booking, one per removal.
    lifecycle: Vec<FleetEvent>,
    // Per-decision scratch, reused so routing does not allocate.
    sparse: Vec<(ReplicaId, Overlap)>,
    overlaps: Vec<Overlap>,
    record_overlaps: Vec<u32>,
    /// Each replica's pending-prefix window this decision, by replica id; NaN until asked.
    pending_windows: Vec<std::cell::Cell<f64>>,
    /// When decoding bookings' expected outputs were last re-estimated, seconds.
    outputs_refreshed_at: f64,
    /// Per replica id, its decode step time, seconds (scratch for the re-estimate).
    step_s: Vec<f64>,
    /// The settings of each model whose replicas declared another block size than the
    /// fleet's: the fleet's with that block size (what its decisions' views read).
    model_configs: FxHashMap<ModelKey, FleetConfig>,
}

/// How often decoding bookings' expected outputs are re-estimated from what they generated,
/// seconds (with [`FleetConfig::learn_output_lengths`]): O(live bookings) each time.
const OUTPUT_REFRESH_S: f64 = 0.25;

impl Fleet {
    /// An empty fleet.
    ///
    /// # Errors
    /// As [`FleetConfig::validate`].
    pub fn new(config: FleetConfig) -> Result<Self, Error> {
        config.validate()?;
        let hasher = BlockHasher::new(config.block_size, &config.namespace)?;
        Ok(Fleet {
            index: PrefixIndex::with_seed(hasher, config.index_seed),
            record: RoutingRecord::new(config.record_ttl_s, config.record_max_entries),
            bookings: Bookings::new(config.lease_s, config.block_size)?,
            hasher,
            config,
            replicas: Vec::new(),
            next_id: 0,
            epoch: 0,
            active_peers: 0,
            peer_rank: 0,
            planned: Vec::new(),
            own: FxHashSet::default(),
            lifecycle: Vec::new(),
            sparse: Vec::new(),
            overlaps: Vec::new(),
            record_overlaps: Vec::new(),
            pending_windows: Vec::new(),
            outputs_refreshed_at: f64::NEG_INFINITY,
            step_s: Vec::new(),
            model_configs: FxHashMap::default(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &FleetConfig {
        &self.config
    }

    /// The hasher requests for the fleet's namespace model must be hashed with.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// The hasher of requests for `model` (empty: the namespace model, [`Fleet::hasher`]):
    /// the fleet's namespace with that model name, the one replicas registered with that
    /// [`ReplicaSpec::model`] have their KV events hashed with.
    pub fn hasher_for(&self, model: &str) -> BlockHasher {
        if model.is_empty() || model == self.config.namespace.model {
            return self.hasher;
        }
        let ns = Namespace { model: model.to_string(), ..self.config.namespace.clone() };
        let bs = self.block_size_of(Some(ModelKey::of(model)));
        // Block sizes were checked when the fleet was made and the replica added.
        BlockHasher::new(bs, &ns).unwrap_or(self.hasher)
    }

    /// The block size of `model`'s replicas, tokens (the fleet's unless they declared
    /// another; `None` or [`ModelKey::ANY`]: the fleet's).
    pub fn block_size_of(&self, model: Option<ModelKey>) -> u32 {
        self.config_of(model).block_size
    }

    /// The settings a decision for `model` reads: the fleet's, in the model's block size.
    fn config_of(&self, model: Option<ModelKey>) -> &FleetConfig {
        model.and_then(|m| self.model_configs.get(&m)).unwrap_or(&self.config)
    }

    /// The prefix index.
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// The bookings.
    pub fn bookings(&self) -> &Bookings {
        &self.bookings
    }

    /// The routing record.
    pub fn record(&self) -> &RoutingRecord {
        &self.record
    }

    /// Registered replicas, sorted by id.
    pub fn replicas(&self) -> &[ReplicaState] {
        &self.replicas
    }

    /// A registered replica.
    pub fn replica(&self, id: ReplicaId) -> Option<&ReplicaState> {
        self.pos(id).map(|p| &self.replicas[p])
    }

    /// The replica registered under `name`.
    pub fn replica_by_name(&self, name: &str) -> Option<&ReplicaState> {
        self.replicas.iter().find(|r| r.spec.name == name)
    }

    /// Registers a replica, ready for traffic.
    ///
    /// # Errors
    /// [`Error::DuplicateReplica`] for a name already registered; [`Error::InvalidConfig`] for
    /// zero capacity or a bad profile.
    pub fn add_replica(&mut self, spec: ReplicaSpec) -> Result<ReplicaId, Error> {
        if self.replica_by_name(&spec.name).is_some() {
            return Err(Error::DuplicateReplica(spec.name));
        }
        if spec.capacity_blocks == 0 {
            return Err(Error::InvalidConfig {
                field: "capacity_blocks",
                reason: format!("replica {:?} has 0 blocks", spec.name),
            });
        }
        spec.profile.validate()?;
        if self.next_id == u32::MAX {
            return Err(Error::InvalidConfig { field: "replicas", reason: "replica id space exhausted".into() });
        }
        let id = ReplicaId(self.next_id);
        self.next_id += 1;
        let key = self.hasher_for(&spec.model).model();
        let block_size = self.model_block_size(&spec, key)?;
        let name_key = xxh3_64(spec.name.as_bytes());
        self.bookings.set_prefill_rate(id, spec.profile.prefill_s_per_token / self.config.prefill_efficiency);
        if block_size != self.config.block_size {
            self.model_configs.insert(key, FleetConfig { block_size, ..self.config.clone() });
        } else {
            self.model_configs.remove(&key);
        }
        self.bookings.set_block_size(id, block_size);
        let hasher = self.hasher_for(&spec.model);
        if hasher != self.hasher {
            self.index.set_replica_hasher(id, hasher);
        }
        self.replicas.push(ReplicaState {
            id,
            spec,
            name_key,
            model: hasher.model(),
            status: ReplicaStatus::Ready,
            last_event_at: None,
            last_routed_at: None,
            last_first_token_at: None,
            events_usable: true,
            metrics: None,
            kv_booked_at_report: 0,
            prefill: Default::default(),
        });
        self.epoch += 1;
        Ok(id)
    }

    /// The block size a replica of `spec` would count in (its own, else its model's), checked
    /// as [`Fleet::add_replica`] checks it.
    ///
    /// # Errors
    /// As [`Fleet::add_replica`]'s for the block size.
    pub fn block_size_for(&self, spec: &ReplicaSpec) -> Result<u32, Error> {
        self.model_block_size(spec, self.hasher_for(&spec.model).model())
    }

    /// The block size `spec` (of model `key`) counts in: its own, else its model's.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for another block size than its model's replicas', or than the
    /// fleet's for the namespace model.
    fn model_block_size(&self, spec: &ReplicaSpec, key: ModelKey) -> Result<u32, Error> {
        let of_model = self.replicas.iter().any(|r| r.model == key);
        let want = self.block_size_of(Some(key));
        let bs = if spec.block_size == 0 { want } else { spec.block_size };
        let fixed = key == self.hasher.model() || of_model;
        if bs != want && fixed {
            return Err(Error::InvalidConfig {
                field: "block_size",
                reason: format!(
                    "replica {:?} has {bs}-token blocks, but its model's replicas have {want}-token blocks (one \
                     block size per model)",
                    spec.name
                ),
            });
        }
        Ok(bs)
    }

    /// Removes a replica: its blocks, routing record and bookings go with it. Returns how many
    /// live bookings were dropped.
    ///
    /// # Errors
    /// [`Error::UnknownReplica`].
    pub fn remove_replica(&mut self, id: ReplicaId) -> Result<usize, Error> {
        let p = self.pos(id).ok_or(Error::UnknownReplica(id))?;
        let gone = self.replicas.remove(p);
        if !self.replicas.iter().any(|r| r.model == gone.model) {
            // The model's last replica: a new one may come with another block size.
            self.model_configs.remove(&gone.model);
        }
        self.index.remove_replica(id);
        self.record.forget_replica(id);
        self.epoch += 1;
        let bookings = &self.bookings;
        let mut gone: Vec<BookingId> =
            self.own.iter().copied().filter(|b| bookings.get(*b).is_some_and(|x| x.replica == id)).collect();
        gone.sort_unstable();
        for b in gone {
            self.own.remove(&b);
            self.lifecycle.push(FleetEvent::Ended(b));
        }
        self.lifecycle.push(FleetEvent::ReplicaRemoved(id));
        Ok(self.bookings.drop_replica(id))
    }

    /// Sets a replica's status; whether it takes new requests is
    /// [`ReplicaStatus::routable`].
    ///
    /// # Errors
    /// [`Error::UnknownReplica`].
    pub fn set_status(&mut self, id: ReplicaId, status: ReplicaStatus) -> Result<(), Error> {
        let p = self.pos(id).ok_or(Error::UnknownReplica(id))?;
        let was = std::mem::replace(&mut self.replicas[p].status, status);
        // The epoch marks a change of the routable set (what the policies' caches follow).
        if was.routable() != status.routable() {
            self.epoch += 1;
        }
        Ok(())
    }

    /// Applies one KV event from `id` received at `now` (seconds). The first accepted event
    /// of a replica ends its approximate mode: from then on its overlaps come from the index
    /// (its routing-record entries simply expire). A stream that turns unusable (block-size
    /// mismatch, out of sync) sends it back to approximate mode until a clean event arrives.
    ///
    /// # Errors
    /// [`Error::UnknownReplica`]; a bad event is not an error but a counted rejection in the
    /// outcome.
    pub fn apply_event(&mut self, id: ReplicaId, event: &KvEvent, now: f64) -> Result<ApplyOutcome, Error> {
        let p = self.pos(id).ok_or(Error::UnknownReplica(id))?;
        let outcome = self.index.apply(id, event);
        let r = &mut self.replicas[p];
        let applied = outcome.stored + outcome.removed > 0 || matches!(event, KvEvent::Cleared);
        if outcome.rejection.is_none() || applied {
            r.last_event_at = Some(r.last_event_at.map_or(now, |t| t.max(now)));
        }
        r.events_usable = self.index.health(id).is_some_and(|h| h.block_size_mismatch.is_none() && !h.out_of_sync);
        Ok(outcome)
    }

    /// Says whether `id`'s event history is partial (see
    /// [`PrefixIndex::set_partial_history`]): stores under parents never seen then wait for
    /// their parent instead of marking the replica out of sync.
    ///
    /// # Errors
    /// [`Error::UnknownReplica`].
    pub fn set_partial_history(&mut self, id: ReplicaId, partial: bool) -> Result<(), Error> {
        self.pos(id).ok_or(Error::UnknownReplica(id))?;
        self.index.set_partial_history(id, partial);
        Ok(())
    }

    /// Places `id`'s waiting stores that continue a prompt routed there (see
    /// [`PrefixIndex::adopt_prompt`]).
    ///
    /// # Errors
    /// [`Error::UnknownReplica`].
    pub fn adopt_prompt(
        &mut self,
        id: ReplicaId,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<ApplyOutcome, Error> {
        self.pos(id).ok_or(Error::UnknownReplica(id))?;
        Ok(self.index.adopt_prompt(id, tokens, lora_name, cache_salt))
    }

    /// Records the engine's own load report.
    ///
    /// # Errors
    /// [`Error::UnknownReplica`].
    pub fn report_metrics(&mut self, id: ReplicaId, metrics: EngineMetrics) -> Result<(), Error> {
        let p = self.pos(id).ok_or(Error::UnknownReplica(id))?;
        self.replicas[p].metrics = Some(metrics);
        self.replicas[p].kv_booked_at_report = self.bookings.load(id).kv_blocks;
        Ok(())
    }

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
    fn view<'a>(&'a self, role: Role, req: &RouteRequest, subset: Option<&'a [ReplicaId]>, now: f64) -> FleetView<'a> {
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
        self.replicas.iter().map(|r| r.spec.capacity_blocks).max().unwrap_or(0)
    }

    /// The largest `capacity_blocks` among the replicas serving `model` (`None` or
    /// [`ModelKey::ANY`]: all replicas).
    fn largest_blocks_of(&self, model: Option<ModelKey>) -> u64 {
        let of = |r: &&ReplicaState| model.is_none_or(|m| m == ModelKey::ANY || r.model == m);
        self.replicas.iter().filter(of).map(|r| r.spec.capacity_blocks).max().unwrap_or(0)
    }

    /// Whether a request of `prompt_tokens` and at most `max_tokens` output tokens fits no
    /// registered replica even empty, as the KV headroom check counts it (prompt and output
    /// each rounded up to whole blocks of `block_size`): more blocks than the largest
    /// `capacity_blocks`. `None` when it fits one, or with no replica.
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

    /// Books load on `replica` directly, outside a decision (a booking learned from another
    /// router node, or a test setting up load).
    ///
    /// # Errors
    /// [`Error::UnknownReplica`].
    pub fn book(&mut self, replica: ReplicaId, spec: BookingSpec, now: f64) -> Result<BookingId, Error> {
        self.pos(replica).ok_or(Error::UnknownReplica(replica))?;
        Ok(self.bookings.book(replica, spec, now))
    }

    /// The request's first token arrived at `now`; its wait feeds the replica's learned
    /// prefill cost.
    ///
    /// # Errors
    /// [`Error::UnknownBooking`].
    pub fn first_token(&mut self, booking: BookingId, now: f64) -> Result<(), Error> {
        let Some(b) = self.bookings.first_token(booking, now)? else { return Ok(()) };
        if self.own.contains(&booking) {
            self.lifecycle.push(FleetEvent::FirstToken(booking));
        }
        if let Some(p) = self.pos(b.replica) {
            let r = &mut self.replicas[p];
            r.last_first_token_at = Some(r.last_first_token_at.map_or(now, |t| t.max(now)));
            let tokens = b.queued_ahead_tokens + b.spec.uncached_prefill_tokens as u64;
            r.prefill.observe(&r.spec.profile, tokens, now - b.booked_at, b.decoding_at_booking);
            let rate = r.profile(self.config.learn_prefill_rate).prefill_s_per_token;
            self.bookings.set_prefill_rate(b.replica, rate / self.config.prefill_efficiency);
        }
        Ok(())
    }

    /// How many other router nodes are routing to these replicas now, and this router's rank
    /// among them (see [`FleetView::active_peers`], [`FleetView::peer_rank`]); set from gossip
    /// before each decision.
    pub fn set_active_peers(&mut self, peers: u32, rank: u32) {
        self.active_peers = peers;
        self.peer_rank = rank.min(peers);
    }

    /// A shared booking's first token (one learned from another router node): its prefill
    /// leaves the queue, but its wait (measured on another node's clock) does not feed the
    /// learned prefill cost.
    ///
    /// # Errors
    /// [`Error::UnknownBooking`].
    pub fn first_token_shared(&mut self, booking: BookingId, now: f64) -> Result<(), Error> {
        self.bookings.first_token(booking, now).map(|_| ())
    }

    /// Records that `hashes` (a prompt's leading blocks) were routed to `replica` at `now`
    /// by someone else (another router node), for policies that count pending prefixes and
    /// for approximate-mode replicas. Unknown replicas are ignored.
    pub fn record_prefix(&mut self, replica: ReplicaId, hashes: &[BlockHash], now: f64) {
        if self.pos(replica).is_some() {
            self.record.record(replica, hashes, now);
        }
    }

    /// The request ended; `output_tokens` when it completed normally.
    ///
    /// # Errors
    /// [`Error::UnknownBooking`].
    pub fn release(&mut self, booking: BookingId, output_tokens: Option<u32>) -> Result<(), Error> {
        self.bookings.release(booking, output_tokens)?;
        if self.own.remove(&booking) {
            self.lifecycle.push(FleetEvent::Ended(booking));
        }
        Ok(())
    }

    /// Housekeeping at `now`: ends bookings past their lease (returned) and expires old
    /// routing-record entries. Call it every second or so.
    pub fn expire(&mut self, now: f64) -> Vec<BookingId> {
        self.record.expire(now);
        let gone = self.bookings.expire(now);
        for b in &gone {
            if self.own.remove(b) {
                self.lifecycle.push(FleetEvent::Ended(*b));
            }
        }
        gone
    }

    /// Replicas whose KV events show every block of `chain` (a prompt's leading block
    /// hashes) in GPU memory, sorted by id.
    pub fn holders(&self, chain: &[BlockHash]) -> Vec<ReplicaId> {
        let mut sparse = Vec::new();
        self.index.overlaps(chain, &mut sparse);
        sparse.into_iter().filter(|(_, o)| o.gpu as usize >= chain.len()).map(|(id, _)| id).collect()
    }

    /// The planned warm targets this fleet routes by ([`crate::replication`] sets them).
    pub(crate) fn planned(&self) -> &[PlannedWarm] {
        &self.planned
    }

    /// Replaces the planned warm targets.
    pub(crate) fn set_planned(&mut self, planned: Vec<PlannedWarm>) {
        self.planned = planned;
    }

    fn pos(&self, id: ReplicaId) -> Option<usize> {
        self.replicas.binary_search_by_key(&id, |r| r.id).ok()
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
        self.index.overlaps(&req.hashes, &mut self.sparse);
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
            let replicas = &self.replicas;
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
                let w = match replicas.binary_search_by_key(&id, |r| r.id) {
                    Ok(p) => {
                        let rate = replicas[p].profile(config.learn_prefill_rate).prefill_s_per_token;
                        base + bookings.load(id).queued_prefill_at(now, rate) as f64 * rate
                    }
                    Err(_) => 0.0,
                };
                cell.set(w);
                w
            };
            self.record.overlaps_within(&req.hashes, now, window, &mut self.sparse);
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
                    if let Ok(p) = self.replicas.binary_search_by_key(&id, |r| r.id) {
                        self.overlaps[p].gpu = self.overlaps[p].gpu.max(w.depth);
                    }
                }
            }
        }
    }
}

/// A planned prefix's targets and until when each counts as holding it, seconds.
#[derive(Debug, Clone)]
pub(crate) struct PlannedWarm {
    /// The prefix's last block hash.
    pub(crate) hash: BlockHash,
    /// Its depth, blocks.
    pub(crate) depth: u32,
    /// Each target and until when it counts as holding the prefix, seconds.
    pub(crate) targets: Vec<(ReplicaId, f64)>,
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

#[cfg(test)]
mod tests;
