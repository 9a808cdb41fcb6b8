//! A size cap on the ZMTP frames an engine sends, enforced before zeromq sees them.
//!
//! zeromq 0.7 has no `ZMQ_MAXMSGSIZE`: its codec reserves a buffer of whatever length a frame
//! header declares, so a 10-byte header declaring 2^50 bytes aborts the process (allocation
//! failure), and a multipart message may grow without bound. The node's ZMQ sockets therefore
//! reach an engine through this guard, a loopback relay that parses the engine's side of the
//! stream (ZMTP 3: a 64-byte greeting, then frames of `flags, size (1 or 8 bytes), body`,
//! rfc.zeromq.org/spec/23) and cuts the connection at the first frame, or multipart message,
//! over the cap (its declared length may be anything, so the stream cannot be followed past
//! it). zeromq then reconnects by itself; the messages lost in between are a sequence gap,
//! recovered like any other.
//!
//! It also reads the first bytes of each message's last frame (the msgpack payload, in vLLM's
//! `[topic, seq, payload]` and in replay answers) and drops the whole message when they
//! already declare more events or values than the decode budget allows
//! ([`kvmesh_events::check_budget`] on that prefix): such a message is refused whatever
//! follows, so none of its bytes reach the node, and the rest of its payload is skipped
//! unread. The connection stays up (a cut costs a reconnect and a resync on every node that
//! follows the replica), and the dropped message's sequence number is a gap like any other.
//!
//! ```text
//! node's SUB/DEALER ──tcp──► 127.0.0.1:guard ──tcp──► engine's PUB/ROUTER
//!                     bytes out: copied      bytes in: frame sizes and payload budgets checked,
//!                                            messages over the budget left out
//! ```

use kvmesh_events::{check_budget, DecodeError, DecodeLimits};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long dialing the engine may take before the node's socket is turned away.
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// Bytes of a payload's start checked against the budget: a batch's array header, its
/// timestamp (≤ 9 bytes) and its events array's header fit with room to spare.
const PAYLOAD_PREFIX: usize = 64;

/// What a relay refused, by reason, since it started.
#[derive(Debug, Default)]
pub struct Refused {
    /// Connections cut at a frame or multipart message over the size cap (`frame_too_large`).
    pub too_large: AtomicU64,
    /// Messages dropped whole, their payload's first bytes declaring more than the decode
    /// budget (`over_budget`).
    pub over_budget: AtomicU64,
}

impl Refused {
    /// The counts by reason, as metric labels: `frame_too_large`, then `over_budget`.
    pub fn by_reason(&self) -> [(&'static str, u64); 2] {
        [
            ("frame_too_large", self.too_large.load(Ordering::Relaxed)),
            ("over_budget", self.over_budget.load(Ordering::Relaxed)),
        ]
    }
}

/// Why a relay cut a connection: a frame or message over the size cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut(pub String);

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where the relay sits and what it relays to.
#[derive(Debug, Clone)]
pub enum Direction {
    /// The node dials the engine (`connect`): the relay listens on loopback for the node's
    /// socket and dials `engine` (`host:port`) for each connection.
    ToEngine {
        /// The engine's address.
        engine: String,
    },
    /// The engine dials the node (`kv_events_bind`): the relay listens on `listen` for the
    /// engine and dials the node's socket on its private loopback port.
    FromEngine {
        /// Where engines connect, `host:port` (`*` for every interface).
        listen: String,
    },
}

/// A running relay; it stops when dropped.
#[derive(Debug)]
pub struct FrameGuard {
    /// The endpoint the node's ZMQ socket uses instead of the engine's (`tcp://127.0.0.1:…`),
    /// and whether the socket binds it (the engine dials the node) or connects to it.
    pub socket_endpoint: String,
    /// Whether the node's socket must bind `socket_endpoint`.
    pub socket_binds: bool,
    /// What it refused, by reason, since the start.
    pub refused: Arc<Refused>,
    /// Why it last failed to reach the engine (dialing it, `ToEngine`); `None` once a dial
    /// succeeds. The node's socket sees only its connection closed.
    dial_error: Arc<std::sync::Mutex<Option<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FrameGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FrameGuard {
    /// Why the relay last failed to reach the engine, if its last dial failed.
    pub fn dial_error(&self) -> Option<String> {
        self.dial_error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Starts a relay for `direction` that cuts the connection at a frame or message over
    /// `limits.max_message_bytes`, and drops messages whose payload declares more than
    /// `limits` allow.
    ///
    /// # Errors
    /// A listening socket cannot be bound.
    pub async fn start(direction: Direction, limits: DecodeLimits, replica: &str) -> anyhow::Result<FrameGuard> {
        let cut = Arc::new(Refused::default());
        let dial_error: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
        let replica = replica.to_string();
        match direction {
            Direction::ToEngine { engine } => {
                let listener = TcpListener::bind("127.0.0.1:0").await?;
                let socket_endpoint = format!("tcp://{}", listener.local_addr()?);
                let (c, failed) = (cut.clone(), dial_error.clone());
                let task = tokio::spawn(async move {
                    loop {
                        let Ok((node_side, _)) = listener.accept().await else { continue };
                        let (engine, c, replica, failed) = (engine.clone(), c.clone(), replica.clone(), failed.clone());
                        tokio::spawn(async move {
                            let dialed = tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(&engine)).await;
                            // Said before the node's side is dropped: its socket then reads why.
                            let why = match &dialed {
                                Ok(Ok(_)) => None,
                                Ok(Err(e)) => Some(format!("cannot reach {engine}: {e}")),
                                Err(_) => Some(format!("cannot reach {engine}: no answer within {DIAL_TIMEOUT:?}")),
                            };
                            *failed.lock().unwrap_or_else(|p| p.into_inner()) = why;
                            if let Ok(Ok(engine_side)) = dialed {
                                relay(engine_side, node_side, limits, &c, &replica).await;
                            }
                        });
                    }
                });
                Ok(FrameGuard { socket_endpoint, socket_binds: false, refused: cut, dial_error, task })
            }
            Direction::FromEngine { listen } => {
                let listener = TcpListener::bind(&listen).await?;
                // The node's socket binds a free loopback port, learnt by binding it here first.
                let private = TcpListener::bind("127.0.0.1:0").await?.local_addr()?;
                let socket_endpoint = format!("tcp://{private}");
                let c = cut.clone();
                let task = tokio::spawn(async move {
                    loop {
                        let Ok((engine_side, _)) = listener.accept().await else { continue };
                        let (c, replica) = (c.clone(), replica.clone());
                        tokio::spawn(async move {
                            let dialed = tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(private)).await;
                            if let Ok(Ok(node_side)) = dialed {
                                relay(engine_side, node_side, limits, &c, &replica).await;
                            }
                        });
                    }
                });
                Ok(FrameGuard { socket_endpoint, socket_binds: true, refused: cut, dial_error, task })
            }
        }
    }
}

/// Copies both ways until either side closes or the engine sends a frame or message over
/// the cap (then both are closed); messages whose payload is over the budget are left out.
/// `refused` counts both.
async fn relay(engine: TcpStream, node: TcpStream, limits: DecodeLimits, refused: &Refused, replica: &str) {
    let _ = engine.set_nodelay(true);
    let _ = node.set_nodelay(true);
    let (mut engine_rd, mut engine_wr) = engine.into_split();
    let (mut node_rd, mut node_wr) = node.into_split();
    let outbound = async {
        let _ = tokio::io::copy(&mut node_rd, &mut engine_wr).await;
    };
    let inbound = async {
        let mut frames = Frames::new(limits);
        let mut buf = vec![0u8; 64 << 10];
        let mut out = Vec::with_capacity(64 << 10);
        loop {
            let n = match engine_rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            out.clear();
            match frames.feed(&buf[..n], &mut out) {
                Ok(fed) => {
                    if fed.dropped > 0 {
                        refused.over_budget.fetch_add(fed.dropped, Ordering::Relaxed);
                        // The ingest task counts refusals and complains about them at a bounded rate.
                        tracing::debug!(%replica, why = fed.why.unwrap_or_default(), "KV-event message dropped before decoding");
                    }
                }
                Err(why) => {
                    refused.too_large.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%replica, %why, "KV-event connection cut before decoding");
                    return;
                }
            }
            if !out.is_empty() && node_wr.write_all(&out).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = outbound => {}
        _ = inbound => {}
    }
}

/// The engine's side of a ZMTP 3 stream, parsed incrementally for frame sizes and the first
/// bytes of each message's last frame, and filtered: a message whose payload is over the
/// budget is left out of what is forwarded.
///
/// A multipart message's frames are held back until its last frame's first bytes are judged
/// (at most `max_message_bytes`: every frame before the last counts against the cap), then
/// forwarded together, or dropped together with the rest of that frame skipped unread.
/// Commands (READY, PING, …) pass at once.
#[derive(Debug)]
pub struct Frames {
    max: u64,
    limits: DecodeLimits,
    state: State,
    /// Bytes of the multipart message so far (frames with MORE, then the last).
    message: u64,
    /// The current payload's first bytes, while they are being gathered.
    prefix: Vec<u8>,
    /// The message in progress, held back until its payload is judged.
    held: Vec<u8>,
}

/// Where a frame's bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sink {
    /// Forwarded as they come (greeting, commands, a payload judged sound).
    Out,
    /// Held back with the message in progress.
    Held,
    /// Left out (the rest of a payload over the budget).
    Skip,
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// Greeting bytes still to pass.
    Greeting(u64),
    /// Waiting for a frame's flags byte.
    Flags,
    /// Size bytes read so far, of `len` (1 or 8), the flags, and the value so far.
    Size { flags: u8, len: u8, got: u8, value: u64 },
    /// Body bytes still to pass; `payload`: a message's last frame, whose first bytes are
    /// gathered in `prefix` and judged against the budget.
    Body { left: u64, payload: bool, sink: Sink },
}

/// What one [`Frames::feed`] left out.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Fed {
    /// Whole messages left out, their payloads over the budget.
    pub dropped: u64,
    /// Why the last of them was.
    pub why: Option<String>,
}

impl Frames {
    /// A fresh stream whose frames and messages may hold at most `limits.max_message_bytes`
    /// bytes, and whose payloads must not declare more than `limits` allow.
    pub fn new(limits: DecodeLimits) -> Self {
        Frames {
            max: limits.max_message_bytes as u64,
            limits,
            state: State::Greeting(64),
            message: 0,
            prefix: Vec::with_capacity(PAYLOAD_PREFIX),
            held: Vec::new(),
        }
    }

    /// Parses the next `bytes` of the stream and appends to `out` what may be forwarded now,
    /// in order; a message over the budget is never appended, not even in part.
    ///
    /// # Errors
    /// A frame or message over the size cap: the stream cannot be followed past it (its
    /// declared length may be anything), so the connection must be cut.
    pub fn feed(&mut self, mut bytes: &[u8], out: &mut Vec<u8>) -> Result<Fed, Cut> {
        let mut fed = Fed::default();
        while !bytes.is_empty() {
            match self.state {
                State::Greeting(left) => {
                    let take = left.min(bytes.len() as u64) as usize;
                    out.extend_from_slice(&bytes[..take]);
                    bytes = &bytes[take..];
                    self.state = if left == take as u64 { State::Flags } else { State::Greeting(left - take as u64) };
                }
                State::Flags => {
                    let flags = bytes[0];
                    self.sink_for(flags, out).push(flags);
                    bytes = &bytes[1..];
                    let len = if flags & 0b10 != 0 { 8 } else { 1 };
                    self.state = State::Size { flags, len, got: 0, value: 0 };
                }
                State::Size { flags, len, got, value } => {
                    self.sink_for(flags, out).push(bytes[0]);
                    let value = (value << 8) | u64::from(bytes[0]);
                    bytes = &bytes[1..];
                    if got + 1 < len {
                        self.state = State::Size { flags, len, got: got + 1, value };
                        continue;
                    }
                    self.frame_starts(flags, value, out, &mut fed)?;
                }
                State::Body { left, payload, sink } => {
                    let take = left.min(bytes.len() as u64) as usize;
                    let (now, rest) = bytes.split_at(take);
                    bytes = rest;
                    let mut sink = sink;
                    let mut from = 0;
                    if payload && sink == Sink::Held {
                        // Still judging: gather the prefix, hold it, judge it once complete.
                        let want = (PAYLOAD_PREFIX - self.prefix.len()).min(take);
                        self.prefix.extend_from_slice(&now[..want]);
                        self.held.extend_from_slice(&now[..want]);
                        from = want;
                        if self.prefix.len() == PAYLOAD_PREFIX || left == want as u64 {
                            sink = self.judge(out, &mut fed);
                        }
                    }
                    match sink {
                        Sink::Out => out.extend_from_slice(&now[from..]),
                        Sink::Held => self.held.extend_from_slice(&now[from..]),
                        Sink::Skip => {}
                    }
                    let left = left - take as u64;
                    self.state = if left == 0 { State::Flags } else { State::Body { left, payload, sink } };
                }
            }
        }
        Ok(fed)
    }

    /// Commands pass at once; message frames are held with their message.
    fn sink_for<'a>(&'a mut self, flags: u8, out: &'a mut Vec<u8>) -> &'a mut Vec<u8> {
        if flags & 0b100 != 0 {
            out
        } else {
            &mut self.held
        }
    }

    /// A frame header of `flags` declaring `value` body bytes is complete.
    fn frame_starts(&mut self, flags: u8, value: u64, out: &mut Vec<u8>, fed: &mut Fed) -> Result<(), Cut> {
        let command = flags & 0b100 != 0;
        if value > self.max {
            return Err(Cut(format!("a frame of {value} bytes, over the {}-byte limit", self.max)));
        }
        if !command {
            self.message += value;
            if self.message > self.max {
                return Err(Cut(format!(
                    "a message of {} bytes or more, over the {}-byte limit",
                    self.message, self.max
                )));
            }
            if flags & 1 == 0 {
                self.message = 0;
            }
        }
        let payload = !command && flags & 1 == 0;
        self.prefix.clear();
        let sink = if command { Sink::Out } else { Sink::Held };
        self.state = match (value, payload) {
            // An empty payload is judged at once (the decoder refuses it if it must).
            (0, true) => {
                self.judge(out, fed);
                State::Flags
            }
            (0, false) => State::Flags,
            _ => State::Body { left: value, payload, sink },
        };
        Ok(())
    }

    /// Judges the gathered payload prefix: a sound one releases the held message to `out`
    /// (and the rest of its payload follows it there), one over the budget drops it.
    fn judge(&mut self, out: &mut Vec<u8>, fed: &mut Fed) -> Sink {
        match check_budget(&self.prefix, &self.limits) {
            // What the first bytes cannot tell (truncated, malformed) the decoder judges on
            // the whole message.
            Err(DecodeError::OverBudget(why)) => {
                self.held.clear();
                fed.dropped += 1;
                fed.why = Some(why);
                Sink::Skip
            }
            _ => {
                out.append(&mut self.held);
                Sink::Out
            }
        }
    }
}

#[cfg(test)]
mod tests;
