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
//! The index lives in the fleet, or, after [`Fleet::publish_index`], beside it: a router
//! applies KV events to the published index without holding the fleet, and decisions read it
//! without waiting for them.
//!
//! The fleet never reads a clock or an RNG: callers pass `now` (seconds on their clock) and a
//! random source, so the simulator replays a run from its seed and the node uses real time.
//! The same `route` runs in the node and the simulator.

mod booking;
mod decide;
mod index_home;
mod membership;
mod pd;

pub use crate::view::{
    Estimate, Estimator, FleetConfig, FleetView, OverlapSource, ReplicaSpec, ReplicaState, ReplicaStatus, Role,
    RouteRequest,
};
pub use index_home::IndexRef;
pub use pd::{PdDecision, PdRouted};

use crate::error::Error;
use crate::hashing::{BlockHasher, ModelKey, Namespace};
use crate::ids::{BlockHash, ReplicaId};
use crate::index::{ApplyOutcome, KvEvent, PrefixIndex, PublishedIndex};
use crate::load::{BookingId, Bookings, EngineMetrics, FleetEvent};
use crate::overlap::Overlap;
use crate::policy::Decision;
use crate::record::RoutingRecord;
use index_home::IndexHome;
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;
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
    /// Each replica id's position in `replicas` (`NO_POSITION`: none), by id: a decision
    /// looks up every replica its routing record names (all of them, under a prefix routed to
    /// the whole fleet); a binary search each was ~2 % of a node's CPU following 1,024 busy
    /// replicas (a profile; BENCHMARKS.md, "How many replicas one node follows").
    positions: Vec<u32>,
    index: IndexHome,
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
    /// The largest `capacity_blocks` of any registered replica (0 with none): read by every
    /// decision, so kept here instead of found by a pass over the replicas.
    largest_blocks: u64,
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
            index: IndexHome::Owned(PrefixIndex::with_seed(hasher, config.index_seed)),
            record: RoutingRecord::new(config.record_ttl_s, config.record_max_entries),
            bookings: Bookings::new(config.lease_s, config.block_size)?,
            hasher,
            config,
            replicas: Vec::new(),
            positions: Vec::new(),
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
            largest_blocks: 0,
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

    /// The block size replica `id`'s blocks are hashed in, tokens: its model's (the fleet's
    /// for an unknown replica).
    pub fn replica_block_size(&self, id: ReplicaId) -> u32 {
        self.block_size_of(self.replica(id).map(|r| r.model))
    }

    /// The KV capacity replica `id` is routed by, blocks ([`ReplicaSpec::capacity_blocks`]);
    /// 0 while it is not known yet, or for an unknown replica.
    pub fn replica_capacity_blocks(&self, id: ReplicaId) -> u64 {
        self.replica(id).map_or(0, |r| r.spec.capacity_blocks)
    }

    /// The settings a decision for `model` reads: the fleet's, in the model's block size.
    fn config_of(&self, model: Option<ModelKey>) -> &FleetConfig {
        model.and_then(|m| self.model_configs.get(&m)).unwrap_or(&self.config)
    }

    /// The prefix index: the fleet's own, or the published one's front copy (see
    /// [`Fleet::publish_index`]).
    pub fn index(&self) -> IndexRef<'_> {
        self.index.read()
    }

    /// Moves the prefix index out of the fleet into a [`PublishedIndex`] shared with the
    /// caller, before any replica is registered: from then on the fleet registers and removes
    /// replicas there, and each decision reads its front copy, never waiting for a write. The
    /// caller applies KV events through [`PublishedIndex::write`] and tells the fleet what
    /// they did with [`Fleet::note_events`] ([`Fleet::apply_event`] still works, writing
    /// through the same writer). Calling it again returns the same index.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] once replicas are registered.
    pub fn publish_index(&mut self) -> Result<Arc<PublishedIndex>, Error> {
        if let IndexHome::Published(p) = &self.index {
            return Ok(p.clone());
        }
        if self.next_id > 0 {
            return Err(Error::InvalidConfig {
                field: "index",
                reason: "the index is published before any replica is registered".into(),
            });
        }
        let published = Arc::new(PublishedIndex::new(self.hasher, self.config.index_seed));
        self.index = IndexHome::Published(published.clone());
        Ok(published)
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
        self.pos(id).ok_or(Error::UnknownReplica(id))?;
        let outcome = self.index.apply(id, event);
        let applied = outcome.stored + outcome.removed > 0 || matches!(event, KvEvent::Cleared);
        let usable = events_usable(&self.index.read(), id);
        self.note_events(id, outcome.rejection.is_none() || applied, usable, now)?;
        Ok(outcome)
    }

    /// What events of `id` applied to a published index ([`Fleet::publish_index`]) at `now`
    /// did: `heard` when any was accepted or changed a block (the replica's events are then
    /// fresh as of `now`), `usable` as [`events_usable`] reads the index after them.
    ///
    /// # Errors
    /// [`Error::UnknownReplica`].
    pub fn note_events(&mut self, id: ReplicaId, heard: bool, usable: bool, now: f64) -> Result<(), Error> {
        let p = self.pos(id).ok_or(Error::UnknownReplica(id))?;
        let r = &mut self.replicas[p];
        if heard {
            r.last_event_at = Some(r.last_event_at.map_or(now, |t| t.max(now)));
        }
        r.events_usable = usable;
        Ok(())
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

    /// Replicas whose KV events show every block of `chain` (a prompt's leading block
    /// hashes) in GPU memory, sorted by id.
    pub fn holders(&self, chain: &[BlockHash]) -> Vec<ReplicaId> {
        let mut sparse = Vec::new();
        self.index.read().overlaps(chain, &mut sparse);
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
}

/// Whether `id`'s KV events can be routed on, as `index` reads after them: none refused for
/// another block size, and in sync.
pub fn events_usable(index: &PrefixIndex, id: ReplicaId) -> bool {
    index.health(id).is_some_and(|h| h.block_size_mismatch.is_none() && !h.out_of_sync)
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

#[cfg(test)]
mod tests;
