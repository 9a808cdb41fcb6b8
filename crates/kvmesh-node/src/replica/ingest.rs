//! KV events in: one replica's ZMQ SUB socket, sequence tracking, gap recovery.
//!
//! vLLM numbers its messages from 0 at engine start. A gap (seq > last + 1) is recovered from
//! the replica's replay socket (a fresh DEALER per request: zeromq's DEALER does not
//! reconnect) when it has one, else by dropping the replica's blocks (case C07). A sequence
//! that goes back (seq ≤ last) is an engine restart: its old blocks are dropped (case C08) —
//! unless the message is a live copy of one a replay just applied ([`Replayed`]). Whenever
//! the node does not know where the replica's stream stands (its first subscription, or after
//! a quarantine), it asks the replay socket for everything the engine holds at once, so a warm
//! engine that publishes nothing (its prompts already cached) is still indexed.
//! Every reconnect of the SUB is treated as a possible gap (zeromq 0.7's SUB reconnects on
//! its own and the slow-joiner loss is silent).
//!
//! A message is checked against `[limits]` before it is decoded (size, then the payload's
//! declared counts, without allocating). Bad messages are counted per replica and reason and
//! complained about at most every 10 s, never under the core lock; a replica whose stream
//! stays bad is quarantined ([`EventGuard`]): status `bad_events`, its blocks dropped, its
//! stream not followed at all (the socket closed, so it costs the node nothing) until the
//! quarantine ends and its blocks are rebuilt. Before
//! any of that, the ZMQ sockets reach the engine through a [`FrameGuard`], which cuts the
//! connection at a frame or message over the size limit (zeromq would allocate whatever a
//! frame header declares), and drops whole any message whose payload's first bytes declare
//! more than the budget (the connection stays up).

use super::event_guard::{EventGuard, Problems, StreamLogs};
use super::frame_guard::{Direction, FrameGuard};
use super::replayed::Replayed;
use crate::endpoints::tcp_address;
use crate::state::Shared;
use kvmesh_core::index::KvEvent;
use kvmesh_events::{decode_message_with, decode_replay_reply_with, replay_request, EventBatch, ReplayReply};
use std::sync::Arc;
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Where one replica's events come from.
#[derive(Debug, Clone)]
pub struct Source {
    /// The replica's name.
    pub name: String,
    /// Its publisher endpoint.
    pub endpoint: String,
    /// Bind instead of connect.
    pub bind: bool,
    /// Its replay endpoint.
    pub replay: Option<String>,
    /// How long to wait for each replay reply.
    pub replay_timeout: Duration,
}

/// Follows `source` until the task is aborted. Returns only on a socket setup error that
/// retrying cannot fix (a bad endpoint), which fails the actor.
pub async fn run(shared: Arc<Shared>, source: Source) -> anyhow::Result<()> {
    let mut guard = EventGuard::new(&shared.limits);
    let limits = shared.limits.kv_events();
    let address = tcp_address(&source.endpoint)?;
    let direction =
        if source.bind { Direction::FromEngine { listen: address } } else { Direction::ToEngine { engine: address } };
    let relay = FrameGuard::start(direction, limits, &source.name).await?;
    let mut refused_seen = [0u64; 2];
    let mut replayed = Replayed::default();
    // A restarted task starts with a clean record: a quarantine it did not start is over.
    if let Some(r) = shared.core().replicas.get_mut(&source.name) {
        r.bad_events_until = None;
    }
    let mut backoff = Duration::from_millis(100);
    let mut first_follow = true;
    loop {
        // Quarantined: not followed at all (no socket, nothing received) until it ends.
        if let Some(left) = guard.remaining(shared.now()) {
            tokio::time::sleep(Duration::from_secs_f64(left)).await;
        }
        if guard.quarantine_over(shared.now()) {
            end_quarantine(&shared, &source, &mut guard.stream, &mut replayed).await;
        }
        let mut sub = zeromq::SubSocket::new();
        let setup = async {
            if relay.socket_binds {
                sub.bind(&relay.socket_endpoint).await.map(|_| ())
            } else {
                sub.connect(&relay.socket_endpoint).await
            }
        };
        if let Err(e) = setup.await {
            // A handshake the frame guard cut counts as a bad message like any other.
            count_refused(&shared, &source.name, &relay, &mut refused_seen, &mut guard);
            if guard.quarantined(shared.now()) {
                continue;
            }
            tracing::warn!(replica = %source.name, endpoint = %source.endpoint, error = %e, "KV-event socket not up; retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
            continue;
        }
        backoff = Duration::from_millis(100);
        sub.subscribe("").await?;
        // Said once; a stream cut again and again (frame guard) reconnects each time.
        if std::mem::take(&mut first_follow) {
            tracing::info!(replica = %source.name, endpoint = %source.endpoint, "following KV events");
        } else {
            tracing::debug!(replica = %source.name, endpoint = %source.endpoint, "following KV events again");
        }
        // A warm engine (this node restarted, or the replica was added to a running fleet) may
        // publish nothing for long: a prompt it holds whole stores no block. So what it holds
        // is asked for now, with the subscriber already connected (what it publishes meanwhile
        // queues there; the copies of replayed messages among it are told apart, `Replayed`).
        let unknown = shared.core().replicas.get(&source.name).is_some_and(|r| r.last_seq.is_none());
        if let (true, Some(ep)) = (unknown, &source.replay) {
            tracing::info!(replica = %source.name, "asking the replay socket for everything the engine holds");
            replay(&shared, &source, ep, 0, u64::MAX, &mut guard.stream, &mut replayed).await;
        }
        let mut check = tokio::time::interval(Duration::from_millis(250));
        loop {
            let msg = tokio::select! {
                m = sub.recv() => match m {
                    Ok(m) => m,
                    Err(e) => {
                        if let Some(held) = guard.stream.sequence.allow(shared.now()) {
                            tracing::warn!(replica = %source.name, error = %e, held_back = held, "KV-event socket error; reconnecting");
                        }
                        break;
                    }
                },
                _ = check.tick() => {
                    count_refused(&shared, &source.name, &relay, &mut refused_seen, &mut guard);
                    if guard.quarantined(shared.now()) {
                        break;
                    }
                    let requested = shared.core().replicas.get_mut(&source.name).and_then(|r| r.resync_requested.take());
                    if let Some(why) = requested {
                        rebuild(&shared, &source, why, &mut guard.stream, &mut replayed).await;
                    }
                    continue;
                }
            };
            let frames: Vec<bytes::Bytes> = msg.into_vec();
            let problem = match decode_message_with(&frames, &limits) {
                Ok(m) => {
                    let payload = frames.last().map_or(&[][..], |f| &f[..]);
                    let p = handle(&shared, &source, m.seq, m.batch, payload, &mut guard.stream, &mut replayed).await;
                    p.first.map(|why| format!("{} bad events, the first: {why}", p.events))
                }
                Err(e) => {
                    count_rejected(&shared, &source.name, e.kind(), 1);
                    Some(format!("message dropped: {e}"))
                }
            };
            if let Some(why) = problem {
                let now = shared.now();
                if let Some(held) = guard.log.allow(now) {
                    tracing::warn!(replica = %source.name, problem = %why, held_back = held, "bad KV events");
                }
                if let Some(until) = guard.bad_message(now) {
                    quarantine(&shared, &source.name, until);
                    // Stop following it: dropping the socket disconnects from its publisher.
                    break;
                }
            }
        }
    }
}

fn labels(replica: &str, what: &str) -> Vec<(&'static str, String)> {
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

/// Counts what the frame guard refused since `seen` (cut connections and dropped messages,
/// by reason, as
/// [`super::frame_guard::Refused::by_reason`]) as bad messages.
fn count_refused(shared: &Shared, name: &str, relay: &FrameGuard, seen: &mut [u64; 2], guard: &mut EventGuard) {
    let refused = relay.refused.by_reason();
    let now = shared.now();
    for (i, (reason, to)) in refused.into_iter().enumerate() {
        let from = seen[i];
        seen[i] = to;
        if to == from {
            continue;
        }
        count_rejected(shared, name, reason, to - from);
        if let Some(held) = guard.log.allow(now) {
            tracing::warn!(replica = %name, reason, refused = to - from, held_back = held, "KV-event messages refused before decoding");
        }
        for _ in from..to {
            if let Some(until) = guard.bad_message(now) {
                quarantine(shared, name, until);
            }
        }
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

/// Ends `source`'s quarantine: its status clears and its blocks are rebuilt.
async fn end_quarantine(shared: &Shared, source: &Source, logs: &mut StreamLogs, replayed: &mut Replayed) {
    if let Some(r) = shared.core().replicas.get_mut(&source.name) {
        r.bad_events_until = None;
    }
    tracing::info!(replica = %source.name, "KV-event quarantine over");
    rebuild(shared, source, "quarantine_end", logs, replayed).await;
}

/// Sequence check, recovery, then apply. Returns the message's bad events (a replay's are
/// counted in the metrics only). Sequence trouble is logged through `logs`. `payload` is the
/// message's last frame, to tell a copy of a replayed message from a restart.
async fn handle(
    shared: &Shared,
    source: &Source,
    seq: u64,
    batch: EventBatch,
    payload: &[u8],
    logs: &mut StreamLogs,
    replayed: &mut Replayed,
) -> Problems {
    let mut problems = Problems::default();
    let last = shared.core().replicas.get(&source.name).and_then(|r| r.last_seq);
    match last {
        Some(l) if seq == l.wrapping_add(1) => {}
        None if seq > 0 => {
            // Joined a running engine: what it cached before is only in its replay buffer.
            if let Some(ep) = &source.replay {
                tracing::info!(replica = %source.name, seq, "joining mid-stream: replaying from 0");
                replay(shared, source, ep, 0, seq, logs, replayed).await;
            }
        }
        None => {}
        Some(_) if replayed.is_copy(seq, payload) => {
            // Queued live while the replay sent it: applied already.
            tracing::debug!(replica = %source.name, seq, "live copy of a replayed message; skipped");
            shared.metrics.replay_copies.get_or_create(&vec![("replica", source.name.clone())]).inc();
            return problems;
        }
        Some(l) if seq <= l => {
            if let Some(held) = logs.sequence.allow(shared.now()) {
                tracing::warn!(replica = %source.name, seq, last = l, held_back = held, "sequence restarted: engine restart, dropping its blocks");
            }
            resync_by_clearing(shared, &source.name, "restart");
            let now = shared.now();
            if let Some(r) = shared.core().replicas.get_mut(&source.name) {
                r.restart_seen_at = Some(now);
            }
            // The restarted engine's messages before this one are in its replay buffer.
            if let (true, Some(ep)) = (seq > 0, &source.replay) {
                replay(shared, source, ep, 0, seq, logs, replayed).await;
            }
        }
        Some(l) => {
            if let Some(held) = logs.sequence.allow(shared.now()) {
                tracing::warn!(replica = %source.name, seq, last = l, held_back = held, "sequence gap: recovering {} messages", seq - l - 1);
            }
            let recovered = match &source.replay {
                Some(ep) => replay(shared, source, ep, l.wrapping_add(1), seq, logs, replayed).await,
                None => false,
            };
            if !recovered {
                resync_by_clearing(shared, &source.name, "clear");
            }
        }
    }
    problems.add(apply(shared, &source.name, seq, &batch).0);
    record_lag(shared, batch.ts);
    problems
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

/// Drops the replica's blocks and rebuilds them from its replay buffer when it has one, else
/// from its next events: after it recovered from being unhealthy (perhaps a restarted engine
/// whose first messages were published before this subscriber reconnected), or after a stored
/// event named a parent this node never saw (case C03). `why` labels the resync metric.
async fn rebuild(shared: &Shared, source: &Source, why: &'static str, logs: &mut StreamLogs, replayed: &mut Replayed) {
    tracing::info!(replica = %source.name, why, "rebuilding the replica's blocks");
    resync_by_clearing(shared, &source.name, why);
    let now = shared.now();
    if let Some(r) = shared.core().replicas.get_mut(&source.name) {
        r.last_seq = None;
        r.last_resync_at = Some(now);
    }
    if let Some(ep) = &source.replay {
        replay(shared, source, ep, 0, u64::MAX, logs, replayed).await;
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
const UNKNOWN_PARENT_RESYNC_S: f64 = 30.0;

/// Asks the replay socket for `from..to` (`to` = `u64::MAX`: everything it has) and applies
/// what comes back, in sequence. True when every message in `from..to` was recovered. The
/// replica shows `out_of_sync` while it runs; once the replay socket has sent all it holds
/// (nothing, for a fresh engine), no longer; a replay that failed leaves it `out_of_sync`
/// until the next live event. Its trouble is logged through `logs`; what it applied is
/// remembered in `replayed` (and the previous replay's record forgotten).
async fn replay(
    shared: &Shared,
    source: &Source,
    endpoint: &str,
    from: u64,
    to: u64,
    logs: &mut StreamLogs,
    replayed: &mut Replayed,
) -> bool {
    let set = |on: bool| {
        let now = shared.now();
        let mut core = shared.core();
        if let Some(r) = core.replicas.get_mut(&source.name) {
            r.resyncing = on;
        }
        let _ = core.sync_routable(&source.name, now);
    };
    set(true);
    replayed.start();
    let (complete, ended) = replay_messages(shared, source, endpoint, from, to, logs, replayed).await;
    if ended {
        set(false);
    }
    complete
}

/// [`replay`]'s exchange: (every message in `from..to` recovered, the socket sent its end).
async fn replay_messages(
    shared: &Shared,
    source: &Source,
    endpoint: &str,
    from: u64,
    to: u64,
    logs: &mut StreamLogs,
    replayed: &mut Replayed,
) -> (bool, bool) {
    let mut warn = |what: &str, error: Option<String>| {
        if let Some(held) = logs.replay.allow(shared.now()) {
            tracing::warn!(replica = %source.name, %endpoint, error = error.unwrap_or_default(), held_back = held, "{what}");
        }
    };
    let mut dealer = zeromq::DealerSocket::new();
    let t = source.replay_timeout;
    // The replay socket's answers pass the same frame guard as the live stream.
    let relay = match tcp_address(endpoint) {
        Ok(engine) => FrameGuard::start(Direction::ToEngine { engine }, shared.limits.kv_events(), &source.name).await,
        Err(e) => Err(e),
    };
    let relay = match relay {
        Ok(r) => r,
        Err(e) => {
            warn("replay socket unusable", Some(e.to_string()));
            return (false, false);
        }
    };
    if !matches!(tokio::time::timeout(t, dealer.connect(&relay.socket_endpoint)).await, Ok(Ok(()))) {
        warn("replay socket unreachable", None);
        return (false, false);
    }
    let [delim, start] = replay_request(from);
    let Ok(request) = ZmqMessage::try_from(vec![bytes::Bytes::from(delim), bytes::Bytes::from(start)]) else {
        return (false, false);
    };
    if dealer.send(request).await.is_err() {
        return (false, false);
    }
    let mut next = from;
    let mut ended = false;
    // Asked for all it holds from the start: the buffer keeps the newest `buffer_steps`
    // messages (vLLM: 10,000) and answers from its oldest, so start from whatever comes first.
    let mut first = from == 0;
    loop {
        let reply = match tokio::time::timeout(t, dealer.recv()).await {
            Ok(Ok(m)) => m.into_vec(),
            _ => {
                // An answer the relay refused shows here as a timeout: say why.
                match relay.refused.by_reason().into_iter().find(|(_, n)| *n > 0) {
                    Some((reason, _)) => warn("replay answer refused before decoding", Some(reason.to_string())),
                    None => warn("replay timed out", None),
                }
                break;
            }
        };
        match decode_replay_reply_with(&reply, &shared.limits.kv_events()) {
            Ok(ReplayReply::End) => {
                ended = true;
                break;
            }
            Ok(ReplayReply::Message { seq, batch }) => {
                if std::mem::take(&mut first) {
                    next = seq;
                    // The buffer starts after the engine's first message: what the engine
                    // stored before is history this node cannot have (stores under it wait).
                    shared.core().set_partial_history(&source.name, seq > 0);
                }
                if seq == next && seq < to {
                    apply(shared, &source.name, seq, &batch);
                    replayed.record(seq, reply.last().map_or(&[][..], |f| &f[..]));
                    next += 1;
                }
            }
            Err(e) => {
                // One line per replay at most: the exchange ends here.
                warn("bad replay reply", Some(e.to_string()));
                shared.metrics.events_rejected.get_or_create(&labels(&source.name, e.kind())).inc();
                break;
            }
        }
    }
    for (reason, n) in relay.refused.by_reason() {
        if n > 0 {
            count_rejected(shared, &source.name, reason, n);
        }
    }
    // A bounded replay is complete with its last message; "everything it holds" only at the end.
    let complete = if to == u64::MAX { ended } else { next == to };
    let how = if complete { "replay" } else { "replay_incomplete" };
    shared.metrics.resyncs.get_or_create(&vec![("replica", source.name.clone()), ("method", how.to_string())]).inc();
    (complete, ended)
}
