//! Applying a replica's KV events to the node's state: one path for both sources, the ZMQ
//! stream ([`super::ingest`]) and gRPC `Events.Publish` ([`super::push`]) — the same metrics,
//! last-event time, unknown-parent resync, quarantine and routable sync for each.

use super::event_guard::Problems;
use crate::state::Shared;
use kvmesh_core::index::KvEvent;
use kvmesh_events::EventBatch;

/// The labels of a rejected-events count: the replica and the reason.
pub(super) fn labels(replica: &str, what: &str) -> Vec<(&'static str, String)> {
    vec![("replica", replica.to_string()), ("reason", what.to_string())]
}

/// Counts `n` whole messages of `name` refused for `reason` (a metric label): in the metrics
/// and in the replica's own record.
pub(super) fn count_rejected(shared: &Shared, name: &str, reason: &str, n: u64) {
    shared.metrics.events_rejected.get_or_create(&labels(name, reason)).inc_by(n);
    if let Some(r) = shared.core().replicas.get_mut(name) {
        r.events_rejected += n;
    }
}

/// Drops `name`'s blocks and marks it `bad_events` until `until` (node seconds).
pub(super) fn quarantine(shared: &Shared, name: &str, until: f64) {
    let now = shared.now();
    {
        let mut core = shared.core();
        core.apply(name, &KvEvent::Cleared, now);
        if let Some(r) = core.replicas.get_mut(name) {
            r.bad_events_until = Some(until);
            r.last_seq = None;
        }
        let _ = core.sync_routable(name, now);
    }
    shared.metrics.quarantines.get_or_create(&vec![("replica", name.to_string())]).inc();
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

/// Drops the replica's blocks so they rebuild from its next events.
pub(super) fn resync_by_clearing(shared: &Shared, name: &str, how: &str) {
    let now = shared.now();
    let mut core = shared.core();
    // A clear also ends the index's out-of-sync mark: the replica rebuilds from here.
    core.apply(name, &KvEvent::Cleared, now);
    // A restarted engine's history starts afresh: this node will see all of it. (Otherwise
    // the history stays as partial as it was: a gap or a rebuild is missed events, which
    // case C03 resyncs; only a replay buffer that no longer reaches back to the engine's
    // first message makes it partial.)
    if how == "restart" {
        core.set_partial_history(name, false);
    }
    shared.metrics.resyncs.get_or_create(&vec![("replica", name.to_string()), ("method", how.to_string())]).inc();
}

/// Applies `batch` under the core lock; returns its bad events (for the caller to log and
/// count outside the lock): events the decoder skipped, and stores no sound engine sends
/// (token count off, self-referential); and the number of events applied. An unknown parent
/// is not a bad event: it means this node missed events, and leads to a rebuild instead.
pub(super) fn apply(shared: &Shared, name: &str, seq: u64, batch: &EventBatch) -> (Problems, u64) {
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
    let mut unknown_parent = false;
    let mut applied = [0u64; 3];
    // Blocks kept aside (parent unknown, partial history), placed from earlier, and of lost
    // prefixes placed from prompts routed there.
    let (mut orphaned, mut adopted, mut inferred) = (0u64, 0u64, 0u64);
    // Index rejections by reason, counted after the lock.
    let mut rejected: Vec<kvmesh_core::index::Rejection> = Vec::new();
    let mut core = shared.core();
    // One data-parallel rank's stream carries its rank (vLLM annotates every batch): another
    // rank's batches here mean its endpoints are that rank's, and would mix two indexes.
    let want = core.replicas.get(name).and_then(|r| r.config.data_parallel_rank);
    if let (Some(want), Some(got)) = (want, batch.data_parallel_rank) {
        if got != i64::from(want) {
            drop(core);
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
    let mut complete = true;
    // Blocks applied since the lock was taken: it is let go every SECTION_BLOCKS, so a routing
    // decision waits for at most that much of a large chunk or eviction, never a whole batch.
    let mut section = 0usize;
    'events: for e in &batch.events {
        let kind = kind_of(e);
        let mut refused = None;
        for piece in e.sections(SECTION_BLOCKS) {
            if section >= SECTION_BLOCKS {
                core.bump();
                section = 0;
            }
            section += piece.blocks().max(1);
            let Some(o) = core.apply(name, &piece, now) else {
                complete = false;
                break 'events;
            };
            orphaned += u64::from(o.orphaned);
            adopted += u64::from(o.adopted);
            inferred += u64::from(o.inferred);
            let Some(r) = o.rejection else { continue };
            use kvmesh_core::index::Rejection as R;
            let whole = !matches!(r, R::UnknownBlock | R::ConflictingBlock);
            refused.get_or_insert(r);
            // The rest of a split store whose first part was refused has lost its parent; a
            // removal of some unknown blocks, or a store that replaced a mapping, goes on.
            if whole {
                break;
            }
        }
        let Some(r) = refused else {
            applied[kind] += 1;
            continue;
        };
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
    if complete {
        if let Some(r) = core.replicas.get_mut(name) {
            r.last_seq = Some(seq);
            r.last_event_at = Some(now);
            r.resyncing = false;
            // Case C03: blocks are missing; rebuild, at most every UNKNOWN_PARENT_RESYNC_S.
            // Said once per rebuild: batches before the stream task takes the request ask again.
            if unknown_parent && r.last_resync_at.is_none_or(|t| now - t > UNKNOWN_PARENT_RESYNC_S) {
                unknown_parent = r.resync_requested.is_none();
                r.resync_requested.get_or_insert("unknown_parent");
            } else {
                unknown_parent = false;
            }
        }
        // A status the events change (block size mismatch, back in sync) is logged once, now.
        let _ = core.sync_routable(name, now);
    }
    drop(core);
    // Metrics after the lock: a family lookup per label set, once per batch and kind.
    for (kind, n) in applied.into_iter().enumerate().filter(|(_, n)| *n > 0) {
        shared
            .metrics
            .events_applied
            .get_or_create(&vec![("replica", name.into()), ("kind", KINDS[kind].into())])
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

/// Most blocks applied under one hold of the core lock (a store or removal of more is split).
/// 64 blocks apply in ~10 µs, about one routing decision's time.
const SECTION_BLOCKS: usize = 64;

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
