//! KV events pushed over gRPC (`Events.Publish`, for engines without ZMQ): the same budget,
//! accounting and quarantine as a followed ZMQ stream ([`super::ingest`]), one record per
//! replica. A quarantined replica's pushes are refused before the routing core is locked.

use super::apply;
use super::event_guard::EventGuard;
use crate::config::LimitsSection;
use crate::state::Shared;
use kvmesh_core::index::KvEvent;
use kvmesh_events::{EventBatch, EventError, SkippedEvent};
use kvmesh_proto::v1;
use std::collections::HashMap;
use std::sync::Mutex;

/// Every pushing replica's bad-message record.
#[derive(Debug)]
pub struct PushGuards {
    limits: LimitsSection,
    /// Records of replicas that sent bad batches lately; idle ones are forgotten.
    guards: Mutex<HashMap<String, EventGuard>>,
    /// Held from reading a replica's last sequence number to applying the batch, so two
    /// batches pushed at once are checked and applied in one order (else the second could be
    /// judged against the sequence from before the first, a false gap that drops blocks).
    order: Mutex<()>,
}

/// Why a pushed batch was refused whole.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PushError {
    /// No replica of that name is registered.
    #[error("unknown replica {0:?}")]
    UnknownReplica(String),
    /// The replica's pushes kept bringing bad events.
    #[error(
        "replica {replica:?} is quarantined for {left_s:.0} s more: its pushed KV events kept being refused \
         (see kvmesh_events_rejected_total)"
    )]
    Quarantined {
        /// The replica.
        replica: String,
        /// Seconds of quarantine left.
        left_s: f64,
    },
}

/// What one pushed batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pushed {
    /// Events applied to the index.
    pub applied: u64,
    /// Events not applied (undecodable, over the budget, or refused by the index).
    pub rejected: u64,
}

impl PushGuards {
    /// A clean record for every replica, with `limits`' budget and thresholds.
    pub fn new(limits: &LimitsSection) -> Self {
        PushGuards { limits: limits.clone(), guards: Mutex::new(HashMap::new()), order: Mutex::new(()) }
    }

    /// Applies `batch` to its replica: the sequence checked as on the ZMQ path (a gap or a
    /// restart drops the replica's blocks: a pusher has no replay socket), then its events.
    /// A batch over the budget (`over_budget`: refused whole), or one holding
    /// undecodable or impossible events, counts as a bad message; `kv_event_bad_messages` of them within the window quarantine
    /// the replica (`bad_events`, its blocks dropped) for `kv_event_quarantine`.
    ///
    /// # Errors
    /// [`PushError::UnknownReplica`]; [`PushError::Quarantined`] while the quarantine lasts.
    pub fn apply(&self, shared: &Shared, batch: v1::PublishRequest) -> Result<Pushed, PushError> {
        let name = batch.replica_id;
        let now = shared.now();
        // Only replicas that already sent bad batches have a record; none is made here, so
        // unknown names cannot grow the map.
        let left = {
            let mut guards = self.guards.lock().unwrap_or_else(|p| p.into_inner());
            guards.get_mut(&name).and_then(|g| {
                g.quarantine_over(now);
                g.remaining(now)
            })
        };
        if let Some(left_s) = left {
            return Err(PushError::Quarantined { replica: name, left_s });
        }
        // Looked up once: a replica removed meanwhile is left alone (see `apply::Target`).
        let Some((target, follows)) =
            shared.core().replicas.get(&name).map(|r| (apply::Target::of(r), r.config.kv_events.is_some()))
        else {
            return Err(PushError::UnknownReplica(name));
        };
        let total = batch.events.len() as u64;
        if let Some(why) = self.over_budget(&batch.events) {
            apply::count_rejected(shared, &name, &target, "over_budget", 1);
            self.bad_message(shared, &name, &target, &why);
            return Ok(Pushed { applied: 0, rejected: total });
        }
        // Converted before taking `order`: pushers of different replicas convert in parallel.
        let mut decoded =
            EventBatch { ts: batch.ts, events: Vec::new(), data_parallel_rank: None, skipped: Vec::new() };
        for (index, e) in batch.events.into_iter().enumerate() {
            match KvEvent::try_from(e) {
                Ok(e) => decoded.events.push(e),
                Err(e) => decoded.skipped.push(SkippedEvent { index, reason: EventError::Pushed(e.to_string()) }),
            }
        }
        let (problems, applied) = {
            let _order = self.order.lock().unwrap_or_else(|p| p.into_inner());
            let last = target.stream().lock().last_seq;
            if let Some(l) = last.filter(|l| batch.seq != l.wrapping_add(1)) {
                apply::resync_by_clearing(shared, &name, &target, if batch.seq <= l { "restart" } else { "clear" });
            }
            apply::apply_to(shared, &name, &target, batch.seq, decoded)
        };
        apply::record_lag(shared, batch.ts);
        if !follows {
            rebuild_if_asked(shared, &name, &target, now);
        }
        if let Some(first) = problems.first {
            self.bad_message(shared, &name, &target, &format!("{} bad events, the first: {first}", problems.events));
        }
        Ok(Pushed { applied, rejected: total - applied })
    }

    /// Why `events` are over the budget, if they are: more than `kv_event_max_events`, or
    /// more than `kv_event_max_elements` block hashes and token ids together (the ZMQ path
    /// counts msgpack values; these are the repeated fields that can be large).
    fn over_budget(&self, events: &[v1::KvEvent]) -> Option<String> {
        let max_events = self.limits.kv_event_max_events;
        if events.len() > max_events {
            return Some(format!("batch of {} events, over the {max_events} allowed", events.len()));
        }
        let elements: usize = events
            .iter()
            .map(|e| match &e.event {
                Some(v1::kv_event::Event::Stored(s)) => s.block_hashes.len() + s.token_ids.len(),
                Some(v1::kv_event::Event::Removed(r)) => r.block_hashes.len(),
                _ => 0,
            })
            .sum();
        let max_elements = self.limits.kv_event_max_elements;
        (elements > max_elements)
            .then(|| format!("batch of {elements} block hashes and token ids, over the {max_elements} allowed"))
    }

    /// Counts a bad message from `name` (logged at a bounded rate); quarantines it when that
    /// makes the threshold.
    fn bad_message(&self, shared: &Shared, name: &str, target: &apply::Target, why: &str) {
        let now = shared.now();
        let (held, until) = self.guard(name, now, |g| (g.log.allow(now), g.bad_message(now)));
        if let Some(held) = held {
            tracing::warn!(replica = %name, problem = %why, held_back = held, "bad pushed KV events");
        }
        if let Some(until) = until {
            apply::quarantine(shared, name, target, until);
        }
    }

    fn guard<T>(&self, name: &str, now: f64, f: impl FnOnce(&mut EventGuard) -> T) -> T {
        let mut guards = self.guards.lock().unwrap_or_else(|p| p.into_inner());
        // Records are made only here, so pruning here bounds them: a replica that stopped
        // sending bad batches (or was removed) is forgotten once its record is idle.
        guards.retain(|n, g| n == name || !g.idle(now));
        let g = guards.entry(name.to_string()).or_insert_with(|| EventGuard::new(&self.limits));
        f(g)
    }
}

/// A stored event named a parent this node never saw: the replica missed events. A pusher has
/// no replay socket (and no ingest task to act on the request), so its blocks are dropped here
/// and rebuild from its next events; at most every 30 s, as on the ZMQ path, since
/// `apply::apply_to` asks only that often. (A replica that also has a ZMQ stream leaves the
/// request to its ingest task, which can replay: the caller skips those.)
fn rebuild_if_asked(shared: &Shared, name: &str, target: &apply::Target, now: f64) {
    {
        let mut s = target.stream().lock();
        if s.resync_requested != Some("unknown_parent") {
            return;
        }
        s.resync_requested = None;
        s.last_resync_at = Some(now);
    }
    apply::resync_by_clearing(shared, name, target, "unknown_parent");
}
