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

use super::apply::{
    apply_to, count_rejected, labels, quarantine, record_lag, resync_by_clearing, set_partial_history, Target,
};
use super::event_guard::{EventGuard, Problems, StreamLogs};
use super::frame_guard::{Direction, FrameGuard};
use super::replayed::Replayed;
use crate::endpoints::tcp_address;
use crate::state::Shared;
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
    /// The replica the events are for, and its stream record (the task's to keep).
    pub target: Target,
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
    source.target.stream().lock().bad_events_until = None;
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
            count_refused(&shared, &source, &relay, &mut refused_seen, &mut guard);
            if guard.quarantined(shared.now()) {
                continue;
            }
            let why = socket_trouble(relay.dial_error(), &e.to_string());
            let news = {
                let (now, mut stream) = (shared.now(), source.target.stream().lock());
                let (down, news) = socket_down(stream.socket_down.take(), &why, now);
                stream.socket_down = Some(down);
                news
            };
            // Warned once per reason: a fleet of engines still starting would otherwise warn
            // for each of them at every retry. (The replica's status detail says it meanwhile.)
            if news {
                tracing::warn!(replica = %source.name, endpoint = %source.endpoint, %why, error = %e, "KV-event socket not up; retrying (said again only if the reason changes)");
            } else {
                tracing::debug!(replica = %source.name, endpoint = %source.endpoint, %why, error = %e, "KV-event socket still not up; retrying");
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
            continue;
        }
        backoff = Duration::from_millis(100);
        source.target.stream().lock().socket_down = None;
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
        let unknown = source.target.stream().lock().last_seq.is_none();
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
                    count_refused(&shared, &source, &relay, &mut refused_seen, &mut guard);
                    if guard.quarantined(shared.now()) {
                        break;
                    }
                    let requested = source.target.stream().lock().resync_requested.take();
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
                    count_rejected(&shared, &source.name, &source.target, e.kind(), 1);
                    Some(format!("message dropped: {e}"))
                }
            };
            if let Some(why) = problem {
                let now = shared.now();
                if let Some(held) = guard.log.allow(now) {
                    tracing::warn!(replica = %source.name, problem = %why, held_back = held, "bad KV events");
                }
                if let Some(until) = guard.bad_message(now) {
                    quarantine(&shared, &source.name, &source.target, until);
                    // Stop following it: dropping the socket disconnects from its publisher.
                    break;
                }
            }
        }
    }
}

/// Why a replica's KV-event socket did not come up, for its status: what the relay met
/// dialing the engine when it failed to, else zeromq's error told in an operator's words
/// (zeromq 0.7 names the handshake, not its cause).
fn socket_trouble(dial_error: Option<String>, zmq_error: &str) -> String {
    if let Some(why) = dial_error {
        return why;
    }
    if zmq_error.contains("not compatible") {
        "the endpoint is a ZMQ socket of another kind than PUB (is kv_events set to the replay \
         endpoint? it takes vLLM's `endpoint`, replay its `replay_endpoint`)"
            .into()
    } else if zmq_error.contains("reeting") {
        "the endpoint does not speak ZMQ (an HTTP or other port?)".into()
    } else {
        format!("ZMQ handshake failed: {zmq_error}")
    }
}

/// The socket's down state after a failed attempt at `now` for `why`, from the one before
/// (`None`: it was up): since when it has been down, why; and whether that is news (it was up,
/// or down for another reason), which is what the log warns about.
fn socket_down(before: Option<(f64, String)>, why: &str, now: f64) -> ((f64, String), bool) {
    match before {
        Some((since, was)) => ((since, why.to_string()), was != why),
        None => ((now, why.to_string()), true),
    }
}

/// Counts what the frame guard refused since `seen` (cut connections and dropped messages,
/// by reason, as
/// [`super::frame_guard::Refused::by_reason`]) as bad messages.
fn count_refused(shared: &Shared, source: &Source, relay: &FrameGuard, seen: &mut [u64; 2], guard: &mut EventGuard) {
    let name = &source.name;
    let refused = relay.refused.by_reason();
    let now = shared.now();
    for (i, (reason, to)) in refused.into_iter().enumerate() {
        let from = seen[i];
        seen[i] = to;
        if to == from {
            continue;
        }
        count_rejected(shared, name, &source.target, reason, to - from);
        if let Some(held) = guard.log.allow(now) {
            tracing::warn!(replica = %name, reason, refused = to - from, held_back = held, "KV-event messages refused before decoding");
        }
        for _ in from..to {
            if let Some(until) = guard.bad_message(now) {
                quarantine(shared, name, &source.target, until);
            }
        }
    }
}

/// Ends `source`'s quarantine: its status clears and its blocks are rebuilt.
async fn end_quarantine(shared: &Shared, source: &Source, logs: &mut StreamLogs, replayed: &mut Replayed) {
    source.target.stream().lock().bad_events_until = None;
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
    let last = source.target.stream().lock().last_seq;
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
            resync_by_clearing(shared, &source.name, &source.target, "restart");
            source.target.stream().lock().restart_seen_at = Some(shared.now());
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
                resync_by_clearing(shared, &source.name, &source.target, "clear");
            }
        }
    }
    let ts = batch.ts;
    problems.add(apply_to(shared, &source.name, &source.target, seq, batch).0);
    record_lag(shared, ts);
    problems
}

/// Drops the replica's blocks and rebuilds them from its replay buffer when it has one, else
/// from its next events: after it recovered from being unhealthy (perhaps a restarted engine
/// whose first messages were published before this subscriber reconnected), or after a stored
/// event named a parent this node never saw (case C03). `why` labels the resync metric.
async fn rebuild(shared: &Shared, source: &Source, why: &'static str, logs: &mut StreamLogs, replayed: &mut Replayed) {
    tracing::info!(replica = %source.name, why, "rebuilding the replica's blocks");
    resync_by_clearing(shared, &source.name, &source.target, why);
    {
        let mut s = source.target.stream().lock();
        s.last_seq = None;
        s.last_resync_at = Some(shared.now());
    }
    if let Some(ep) = &source.replay {
        replay(shared, source, ep, 0, u64::MAX, logs, replayed).await;
    }
}

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
        source.target.stream().lock().resyncing = on;
        let now = shared.now();
        let _ = shared.core().sync_routable(&source.name, now);
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
                    set_partial_history(shared, &source.name, &source.target, seq > 0);
                }
                if seq == next && seq < to {
                    apply_to(shared, &source.name, &source.target, seq, batch);
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
            count_rejected(shared, &source.name, &source.target, reason, n);
        }
    }
    // A bounded replay is complete with its last message; "everything it holds" only at the end.
    let complete = if to == u64::MAX { ended } else { next == to };
    let how = if complete { "replay" } else { "replay_incomplete" };
    shared.metrics.resyncs.get_or_create(&vec![("replica", source.name.clone()), ("method", how.to_string())]).inc();
    (complete, ended)
}

#[cfg(test)]
mod tests {
    use super::{socket_down, socket_trouble};

    #[test]
    fn a_socket_down_for_the_same_reason_is_news_once() {
        let refused = "cannot reach 10.0.0.7:5557: Connection refused (os error 111)";
        let (down, news) = socket_down(None, refused, 3.0);
        assert_eq!((down.clone(), news), ((3.0, refused.to_string()), true));
        // Retried: still down since 3 s, for the same reason: not news.
        let (down, news) = socket_down(Some(down), refused, 8.0);
        assert_eq!((down.clone(), news), ((3.0, refused.to_string()), false));
        // Another reason is news; the outage still dates from its start.
        let (down, news) = socket_down(Some(down), "ZMQ handshake failed: Other", 9.0);
        assert_eq!((down, news), ((3.0, "ZMQ handshake failed: Other".to_string()), true));
    }

    #[test]
    fn socket_trouble_says_what_to_check() {
        let dial = "cannot reach 10.0.0.7:5557: Connection refused (os error 111)".to_string();
        assert_eq!(socket_trouble(Some(dial.clone()), "Codec Error: Failed Greeting exchange"), dial);
        assert_eq!(
            socket_trouble(None, "Provided sockets combination is not compatible"),
            "the endpoint is a ZMQ socket of another kind than PUB (is kv_events set to the replay endpoint? it \
             takes vLLM's `endpoint`, replay its `replay_endpoint`)"
        );
        assert_eq!(
            socket_trouble(None, "Codec Error: Bad first byte of greeting"),
            "the endpoint does not speak ZMQ (an HTTP or other port?)"
        );
        assert_eq!(socket_trouble(None, "Other"), "ZMQ handshake failed: Other");
    }
}
