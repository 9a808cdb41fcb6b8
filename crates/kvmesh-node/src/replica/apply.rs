//! Applying a replica's KV events to the node's state: one path for both sources, the ZMQ
//! stream ([`super::ingest`]) and gRPC `Events.Publish` ([`super::push`]) — the same metrics,
//! last-event time, unknown-parent resync, quarantine and routable sync for each.
//!
//! Events go to the published prefix index through its writer, never under the core's lock;
//! the core hears what they did in one short section per batch. The writer is never held while
//! waiting for the core's lock (the core's holders may wait for the writer).

use super::event_guard::Problems;
use crate::state::{AppliedBatch, Health, Shared, Stream, StreamState};
use kvmesh_core::fleet::events_usable;
use kvmesh_core::index::KvEvent;
use kvmesh_core::ReplicaId;
use kvmesh_events::EventBatch;
use prometheus_client::metrics::counter::Counter;
use std::sync::{Arc, OnceLock};

/// The labels of a rejected-events count: the replica and the reason.
pub(super) fn labels(replica: &str, what: &str) -> Vec<(&'static str, String)> {
    vec![("replica", replica.to_string()), ("reason", what.to_string())]
}

/// Counts `n` whole messages of replica `name` (`target`) refused for `reason` (a metric
/// label): in the metrics and in its stream record.
pub(super) fn count_rejected(shared: &Shared, name: &str, target: &Target, reason: &str, n: u64) {
    shared.metrics.events_rejected.get_or_create(&labels(name, reason)).inc_by(n);
    target.stream.lock().events_rejected += n;
}

/// Drops replica `name`'s (`target`'s) blocks and marks it `bad_events` until `until` (node
/// seconds).
pub(super) fn quarantine(shared: &Shared, name: &str, target: &Target, until: f64) {
    let now = shared.now();
    clear(shared, name, target, now);
    {
        let mut s = target.stream.lock();
        s.bad_events_until = Some(until);
        s.last_seq = None;
    }
    let _ = shared.core().sync_routable(name, now);
    shared.metrics.quarantines.get_or_create(&vec![("replica", name.to_string())]).inc();
}

/// Drops every block of replica `name` (`target`) through the index's writer, outside the
/// core's lock (a large replica's clear takes a while), then tells the core. A replica
/// removed since `target` was looked up is left alone (the index refuses its old id).
fn clear(shared: &Shared, name: &str, target: &Target, now: f64) {
    let id = target.id;
    let mut writer = shared.index.write();
    let Some(outcome) = writer.apply(id, KvEvent::Cleared) else { return };
    let usable = events_usable(writer.index(), id);
    drop(writer);
    let batch = AppliedBatch {
        accepted: u64::from(outcome.rejection.is_none()),
        rejected: u64::from(outcome.rejection.is_some()),
        heard: true,
        usable,
    };
    count(&mut target.stream.lock(), &batch);
    shared.core().events_applied(name, id, batch, now);
}

/// Says whether replica `name`'s (`target`'s) event history is partial
/// ([`kvmesh_core::PrefixIndex::set_partial_history`]), through the index's writer; a whole
/// history drops the prompts kept for its waiting stores.
pub(super) fn set_partial_history(shared: &Shared, name: &str, target: &Target, partial: bool) {
    let id = target.id;
    shared.index.write().set_partial_history(id, partial);
    if !partial {
        shared.core().history_whole(name, id);
    }
}

/// Records a live batch's publish-to-applied time (see [`crate::metrics::Metrics::event_lag`]);
/// a batch without a usable timestamp, or from a clock ahead of ours, is not recorded.
pub(super) fn record_lag(shared: &Shared, ts: f64) {
    let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) else { return };
    let lag = now.as_secs_f64() - ts;
    if ts > 0.0 && lag.is_finite() && lag >= 0.0 {
        shared.metrics.event_lag.observe(lag);
    }
}

/// Drops replica `name`'s (`target`'s) blocks so they rebuild from its next events.
pub(super) fn resync_by_clearing(shared: &Shared, name: &str, target: &Target, how: &str) {
    let now = shared.now();
    // A clear also ends the index's out-of-sync mark: the replica rebuilds from here.
    clear(shared, name, target, now);
    // A restarted engine's history starts afresh: this node will see all of it. (Otherwise
    // the history stays as partial as it was: a gap or a rebuild is missed events, which
    // case C03 resyncs; only a replay buffer that no longer reaches back to the engine's
    // first message makes it partial.)
    if how == "restart" {
        set_partial_history(shared, name, target, false);
    }
    shared.metrics.resyncs.get_or_create(&vec![("replica", name.to_string()), ("method", how.to_string())]).inc();
}

/// The registered replica a batch or a scrape is for: its id, data-parallel rank, stream
/// record and health record, looked up once (by its actor when it starts, by a push per
/// batch). What a batch, a clear, a quarantine or a partial-history mark does for a replica
/// removed since changes neither the index (it refuses the old id) nor the core's record (it
/// checks the id), even if another replica was registered under the same name meanwhile; only
/// the old, unregistered records hear of it.
#[derive(Debug, Clone)]
pub struct Target {
    id: ReplicaId,
    rank: Option<u32>,
    stream: Stream,
    health: Health,
    /// Its `events_applied` counter of each kind ([`KINDS`]), looked up when that kind is
    /// first applied and kept: a family lookup builds and hashes the label set, which once per
    /// batch was 3 % of the CPU of a node following 1,024 replicas.
    applied: Arc<[OnceLock<Counter>; 3]>,
}

impl Target {
    /// Replica `r`'s.
    pub fn of(r: &crate::state::Replica) -> Self {
        Target {
            id: r.id,
            rank: r.config.data_parallel_rank,
            stream: r.stream.clone(),
            health: r.health.clone(),
            applied: Arc::default(),
        }
    }

    /// Its id in the routing core (a replica added again under the same name has another).
    pub fn id(&self) -> ReplicaId {
        self.id
    }

    /// Its stream record.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Its health record.
    pub fn health(&self) -> &Health {
        &self.health
    }
}

/// Applies `batch` (message `seq`) of replica `name` (`target`) through the index's writer, then records what it did: in the replica's stream record, then
/// in a short section of the core's lock (so a routing decision never waits for the index
/// being written). Returns its bad events (for the caller to log and count): events the
/// decoder skipped, and stores no sound engine sends (token count off, self-referential);
/// and the number of events applied. An unknown parent is not a bad event: it means this
/// node missed events, and leads to a rebuild instead.
pub(super) fn apply_to(shared: &Shared, name: &str, target: &Target, seq: u64, batch: EventBatch) -> (Problems, u64) {
    let now = shared.now();
    let mut problems = Problems {
        events: batch.skipped.len() as u64,
        first: batch.skipped.first().map(|s| format!("event {}: {}", s.index, s.reason)),
    };
    if !batch.skipped.is_empty() {
        shared
            .metrics
            .events_rejected
            .get_or_create(&labels(name, "undecodable_event"))
            .inc_by(batch.skipped.len() as u64);
    }
    let Target { id, rank: want, ref stream, .. } = *target;
    // One data-parallel rank's stream carries its rank (vLLM annotates every batch): another
    // rank's batches here mean its endpoints are that rank's, and would mix two indexes.
    if let (Some(want), Some(got)) = (want, batch.data_parallel_rank) {
        if got != i64::from(want) {
            let n = batch.events.len().max(1) as u64;
            shared.metrics.events_rejected.get_or_create(&labels(name, "other_data_parallel_rank")).inc_by(n);
            problems.events += n;
            problems.first = Some(format!(
                "a batch from data-parallel rank {got}, but this replica is rank {want}: its kv_events/replay \
                 endpoints are another rank's (vLLM binds rank k's at the configured ports + k)"
            ));
            return (problems, 0);
        }
    }
    let mut unknown_parent = false;
    let mut applied = [0u64; 3];
    // Blocks kept aside (parent unknown, partial history), placed from earlier, and of lost
    // prefixes placed from prompts routed there.
    let (mut orphaned, mut adopted, mut inferred) = (0u64, 0u64, 0u64);
    // Index rejections by reason, counted after the writer.
    let mut rejected: Vec<kvmesh_core::index::Rejection> = Vec::new();
    let mut done = AppliedBatch::default();
    let mut complete = true;
    // An empty batch (a step that stored nothing) only moves the sequence on.
    let mut writer = (!batch.events.is_empty()).then(|| shared.index.write());
    for e in batch.events {
        let Some(w) = writer.as_mut() else { break };
        let kind = kind_of(&e);
        let Some(mut o) = w.apply(id, e) else {
            // Removed meanwhile.
            complete = false;
            break;
        };
        // A clear (kind 2) is heard even when it found nothing to drop.
        done.heard |= o.rejection.is_none() || o.stored + o.removed > 0 || kind == 2;
        if o.orphaned > 0 {
            // Perhaps the store of a request that already ended here: its prompt places it.
            // The store is published first and the prompts read after, under the core's lock
            // (never waited for while holding the writer): a prompt kept meanwhile either saw
            // the store waiting and placed it itself (`Core::keep_prompt`), or is read here.
            writer = None;
            let prompts = shared.core().recent_prompts(name);
            let w = writer.insert(shared.index.write());
            for (tokens, selected) in &prompts {
                if w.index().orphan_blocks(id) == 0 {
                    break;
                }
                let (adapter, salt) = (selected.adapter.as_deref(), selected.salt.as_deref());
                if let Some(a) = w.adopt_prompt(id, tokens, adapter, salt) {
                    o.inferred += a.inferred;
                    o.adopted += a.adopted;
                }
            }
        }
        orphaned += u64::from(o.orphaned);
        adopted += u64::from(o.adopted);
        inferred += u64::from(o.inferred);
        let Some(r) = o.rejection else {
            done.accepted += 1;
            applied[kind] += 1;
            continue;
        };
        done.rejected += 1;
        use kvmesh_core::index::Rejection as R;
        if matches!(r, R::UnknownParent) {
            unknown_parent = true;
        } else if matches!(r, R::TokenCountMismatch | R::SelfReferential) {
            // Never valid from a sound engine. The others happen to sound streams: removals of
            // blocks this node never saw (after any clear or a join mid-stream), a block-size
            // mismatch (its own status).
            problems.events += 1;
            problems.first.get_or_insert_with(|| format!("{} event rejected: {}", KINDS[kind], r.as_str()));
        }
        rejected.push(r);
    }
    if let Some(w) = writer.take() {
        done.usable = events_usable(w.index(), id);
    }
    {
        // The stream's own record first, under its own lock (never held while taking the core's).
        let mut s = stream.lock();
        count(&mut s, &done);
        if complete {
            s.last_seq = Some(seq);
            s.resyncing = false;
            // Case C03: blocks are missing; rebuild, at most every UNKNOWN_PARENT_RESYNC_S.
            // Said once per rebuild: batches before the stream task takes the request ask again.
            if unknown_parent && s.last_resync_at.is_none_or(|t| now - t > UNKNOWN_PARENT_RESYNC_S) {
                unknown_parent = s.resync_requested.is_none();
                s.resync_requested.get_or_insert("unknown_parent");
            } else {
                unknown_parent = false;
            }
        }
    }
    let mut core = shared.core();
    core.events_applied(name, id, done, now);
    if complete {
        if let Some(r) = core.replicas.get_mut(name).filter(|r| r.id == id) {
            r.last_event_at = Some(now);
        }
        // A status the events change (block size mismatch, back in sync) is logged once, now.
        let _ = core.sync_routable(name, now);
    }
    drop(core);
    // Metrics after the locks.
    for ((kind, counter), n) in KINDS.iter().zip(target.applied.iter()).zip(applied).filter(|(_, n)| *n > 0) {
        counter
            .get_or_init(|| {
                let labels = vec![("replica", name.into()), ("kind", (*kind).into())];
                shared.metrics.events_applied.get_or_create(&labels).clone()
            })
            .inc_by(n);
    }
    for r in rejected {
        shared.metrics.events_rejected.get_or_create(&labels(name, r.as_str())).inc();
    }
    let replica = || vec![("replica", name.to_string())];
    if orphaned > 0 {
        shared.metrics.orphaned_blocks.get_or_create(&replica()).inc_by(orphaned);
    }
    if adopted > 0 {
        shared.metrics.adopted_blocks.get_or_create(&replica()).inc_by(adopted);
    }
    if inferred > 0 {
        shared.metrics.inferred_blocks.get_or_create(&replica()).inc_by(inferred);
    }
    if unknown_parent && complete {
        tracing::warn!(replica = %name, seq, "a stored event names a parent never seen: replica out of sync, rebuilding");
    }
    let total = applied.iter().sum();
    (problems, total)
}

/// Adds what a batch did to its stream's counts.
fn count(s: &mut StreamState, batch: &AppliedBatch) {
    s.events_applied += batch.accepted;
    s.events_rejected += batch.rejected;
}

/// Event kinds as metric labels, in [`kind_of`]'s order.
const KINDS: [&str; 3] = ["stored", "removed", "cleared"];

fn kind_of(e: &KvEvent) -> usize {
    match e {
        KvEvent::Stored(_) => 0,
        KvEvent::Removed(_) => 1,
        KvEvent::Cleared => 2,
    }
}

/// The shortest time between rebuilds caused by unknown parents, seconds.
pub(super) const UNKNOWN_PARENT_RESYNC_S: f64 = 30.0;

#[cfg(test)]
mod tests;
