//! A size cap on the ZMTP frames an engine sends, enforced before zeromq sees them.
//!
//! zeromq 0.7 has no `ZMQ_MAXMSGSIZE`: its codec reserves a buffer of whatever length a frame
//! header declares, so a 10-byte header declaring 2^50 bytes aborts the process (allocation
//! failure), and a multipart message may grow without bound. The node's ZMQ sockets therefore
//! reach an engine through this guard, a loopback relay that parses the engine's side of the
//! stream (ZMTP 3: a 64-byte greeting, then frames of `flags, size (1 or 8 bytes), body`,
//! rfc.zeromq.org/spec/23) and cuts the connection at the first frame, or multipart message,
//! over the cap. zeromq then reconnects by itself; the messages lost in between are a
//! sequence gap, recovered like any other.
//!
//! It also reads the first bytes of each message's last frame (the msgpack payload, in vLLM's
//! `[topic, seq, payload]` and in replay answers) and cuts the connection when they already
//! declare more events or values than the decode budget allows
//! ([`kvmesh_events::check_budget`] on that prefix): such a message is refused whatever
//! follows, so none of its bytes need reach the node.
//!
//! ```text
//! node's SUB/DEALER ──tcp──► 127.0.0.1:guard ──tcp──► engine's PUB/ROUTER
//!                     bytes out: copied      bytes in: frame sizes checked, then copied
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

/// Connections a relay cut, by reason, since it started.
#[derive(Debug, Default)]
pub struct Cuts {
    /// A frame or multipart message over the size cap (`frame_too_large`).
    pub too_large: AtomicU64,
    /// A payload whose first bytes declare more than the decode budget (`over_budget`).
    pub over_budget: AtomicU64,
}

impl Cuts {
    /// The counts by reason, as metric labels: `frame_too_large`, then `over_budget`.
    pub fn by_reason(&self) -> [(&'static str, u64); 2] {
        [
            ("frame_too_large", self.too_large.load(Ordering::Relaxed)),
            ("over_budget", self.over_budget.load(Ordering::Relaxed)),
        ]
    }
}

/// Why a relay cut a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cut {
    /// Over the size cap.
    TooLarge(String),
    /// Over the decode budget, from the payload's first bytes.
    OverBudget(String),
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cut::TooLarge(why) | Cut::OverBudget(why) => f.write_str(why),
        }
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
    /// Connections cut, by reason, since the start.
    pub cuts: Arc<Cuts>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FrameGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `tcp://host:port` → `host:port` (`*` → `0.0.0.0`).
///
/// # Errors
/// Another transport, or no port.
pub fn tcp_address(endpoint: &str) -> anyhow::Result<String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| anyhow::anyhow!("{endpoint:?}: only tcp://host:port endpoints are supported"))?;
    let rest = rest.strip_prefix("*:").map_or_else(|| rest.to_string(), |port| format!("0.0.0.0:{port}"));
    if rest.rsplit_once(':').is_none_or(|(_, p)| p.parse::<u16>().is_err()) {
        anyhow::bail!("{endpoint:?} has no port (tcp://host:port)");
    }
    Ok(rest)
}

impl FrameGuard {
    /// Starts a relay for `direction` that cuts frames and messages over
    /// `limits.max_message_bytes`, and payloads that declare more than `limits` allow.
    ///
    /// # Errors
    /// A listening socket cannot be bound.
    pub async fn start(direction: Direction, limits: DecodeLimits, replica: &str) -> anyhow::Result<FrameGuard> {
        let cut = Arc::new(Cuts::default());
        let replica = replica.to_string();
        match direction {
            Direction::ToEngine { engine } => {
                let listener = TcpListener::bind("127.0.0.1:0").await?;
                let socket_endpoint = format!("tcp://{}", listener.local_addr()?);
                let c = cut.clone();
                let task = tokio::spawn(async move {
                    loop {
                        let Ok((node_side, _)) = listener.accept().await else { continue };
                        let (engine, c, replica) = (engine.clone(), c.clone(), replica.clone());
                        tokio::spawn(async move {
                            let dialed = tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(&engine)).await;
                            if let Ok(Ok(engine_side)) = dialed {
                                relay(engine_side, node_side, limits, &c, &replica).await;
                            }
                        });
                    }
                });
                Ok(FrameGuard { socket_endpoint, socket_binds: false, cuts: cut, task })
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
                Ok(FrameGuard { socket_endpoint, socket_binds: true, cuts: cut, task })
            }
        }
    }
}

/// Copies both ways until either side closes or the engine sends a frame or message over
/// the cap, or a payload over the budget (then both are closed and `cuts` counts it).
async fn relay(engine: TcpStream, node: TcpStream, limits: DecodeLimits, cuts: &Cuts, replica: &str) {
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
        loop {
            let n = match engine_rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Err(why) = frames.check(&buf[..n]) {
                let counter = match why {
                    Cut::TooLarge(_) => &cuts.too_large,
                    Cut::OverBudget(_) => &cuts.over_budget,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                // The ingest task counts cuts and complains about them at a bounded rate.
                tracing::debug!(%replica, %why, "KV-event connection cut before decoding");
                return;
            }
            if node_wr.write_all(&buf[..n]).await.is_err() {
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
/// bytes of each message's last frame.
#[derive(Debug)]
pub struct Frames {
    max: u64,
    limits: DecodeLimits,
    state: State,
    /// Bytes of the multipart message so far (frames with MORE, then the last).
    message: u64,
    /// The current payload's first bytes, while they are being gathered.
    prefix: Vec<u8>,
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
    /// gathered in `prefix` and checked against the budget.
    Body { left: u64, payload: bool },
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
        }
    }

    /// Checks the next `bytes` of the stream.
    ///
    /// # Errors
    /// What went over the cap or the budget.
    pub fn check(&mut self, mut bytes: &[u8]) -> Result<(), Cut> {
        while !bytes.is_empty() {
            match self.state {
                State::Greeting(left) => {
                    let take = left.min(bytes.len() as u64);
                    bytes = &bytes[take as usize..];
                    self.state = if left == take { State::Flags } else { State::Greeting(left - take) };
                }
                State::Flags => {
                    let flags = bytes[0];
                    bytes = &bytes[1..];
                    let len = if flags & 0b10 != 0 { 8 } else { 1 };
                    self.state = State::Size { flags, len, got: 0, value: 0 };
                }
                State::Size { flags, len, got, value } => {
                    let value = (value << 8) | u64::from(bytes[0]);
                    bytes = &bytes[1..];
                    if got + 1 < len {
                        self.state = State::Size { flags, len, got: got + 1, value };
                        continue;
                    }
                    let command = flags & 0b100 != 0;
                    if value > self.max {
                        return Err(Cut::TooLarge(format!(
                            "a frame of {value} bytes, over the {}-byte limit",
                            self.max
                        )));
                    }
                    if !command {
                        self.message += value;
                        if self.message > self.max {
                            return Err(Cut::TooLarge(format!(
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
                    self.state = if value == 0 { State::Flags } else { State::Body { left: value, payload } };
                }
                State::Body { left, payload } => {
                    let take = left.min(bytes.len() as u64);
                    let gathering = payload && self.prefix.len() < PAYLOAD_PREFIX;
                    if gathering {
                        let want = (PAYLOAD_PREFIX - self.prefix.len()).min(take as usize);
                        self.prefix.extend_from_slice(&bytes[..want]);
                        if self.prefix.len() == PAYLOAD_PREFIX || left == want as u64 {
                            self.check_prefix()?;
                        }
                    }
                    bytes = &bytes[take as usize..];
                    self.state = if left == take { State::Flags } else { State::Body { left: left - take, payload } };
                }
            }
        }
        Ok(())
    }

    /// Refuses the payload when its first bytes already declare more than the budget; what
    /// they cannot tell (truncated, malformed) the decoder judges on the whole message.
    fn check_prefix(&self) -> Result<(), Cut> {
        match check_budget(&self.prefix, &self.limits) {
            Err(DecodeError::OverBudget(why)) => Err(Cut::OverBudget(why)),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(more: bool, body: usize) -> Vec<u8> {
        let mut f = Vec::new();
        if body > 255 {
            f.push(0b10 | more as u8);
            f.extend_from_slice(&(body as u64).to_be_bytes());
        } else {
            f.push(more as u8);
            f.push(body as u8);
        }
        f.resize(f.len() + body, 0xc0);
        f
    }

    #[test]
    fn frames_and_messages_are_capped_wherever_the_reads_split() {
        let mut stream = vec![0xffu8; 64];
        stream.extend(frame(true, 0));
        stream.extend(frame(true, 8));
        stream.extend(frame(false, 300));
        // Fed a byte at a time or whole, the same verdict.
        for step in [1, 7, stream.len()] {
            let mut f = Frames::new(cap(308));
            for chunk in stream.chunks(step) {
                f.check(chunk).unwrap();
            }
        }
        let mut f = Frames::new(cap(307));
        assert_eq!(
            stream.chunks(5).try_for_each(|c| f.check(c)),
            Err(Cut::TooLarge("a message of 308 bytes or more, over the 307-byte limit".into()))
        );
    }

    #[test]
    fn a_huge_declared_frame_is_refused_at_its_header() {
        let mut stream = vec![0u8; 64];
        stream.push(0b10);
        stream.extend_from_slice(&(1u64 << 50).to_be_bytes());
        let mut f = Frames::new(DecodeLimits::default());
        assert_eq!(
            f.check(&stream),
            Err(Cut::TooLarge(format!("a frame of {} bytes, over the 8388608-byte limit", 1u64 << 50)))
        );
        // Commands (READY, …) count against the frame cap but are not message parts.
        let mut f = Frames::new(cap(10));
        let mut s = vec![0u8; 64];
        s.extend([0b100, 10]);
        s.extend([0u8; 10]);
        s.extend(frame(false, 10));
        assert_eq!(f.check(&s), Ok(()));
    }

    fn cap(bytes: usize) -> DecodeLimits {
        DecodeLimits { max_message_bytes: bytes, ..DecodeLimits::default() }
    }

    /// A vLLM message `[topic "", seq, payload]` as ZMTP frames.
    fn message(payload: &[u8]) -> Vec<u8> {
        let mut m = frame(true, 0);
        m.extend(frame(true, 8));
        let mut last = frame(false, payload.len());
        let start = last.len() - payload.len();
        last[start..].copy_from_slice(payload);
        m.extend(last);
        m
    }

    #[test]
    fn a_payload_declaring_too_many_events_is_refused_from_its_first_bytes() {
        let limits = DecodeLimits { max_events: 1000, ..DecodeLimits::default() };
        let sound = kvmesh_events::encode::encode_nil_batch(1.0, 1000);
        let hostile = kvmesh_events::encode::encode_nil_batch(1.0, 100_000);
        let mut stream = vec![0u8; 64];
        stream.extend(message(&sound));
        let hostile_at = stream.len();
        stream.extend(message(&hostile));
        for step in [1, 13, 4096] {
            let mut f = Frames::new(limits);
            let mut fed = 0;
            let verdict = stream.chunks(step).try_for_each(|c| {
                fed += c.len();
                f.check(c)
            });
            assert_eq!(verdict, Err(Cut::OverBudget("batch of 100000 events, over the 1000-event limit".into())));
            // Refused within its first 64 payload bytes (plus the frame headers), not after its 100 kB.
            assert!(fed <= hostile_at + 2 + 9 + 9 + PAYLOAD_PREFIX + step, "read {fed} of {}", stream.len());
        }
        // Only a message's last frame is a payload: the same over-budget header in a MORE
        // frame or a command passes (the decoder judges those), in the last frame it is cut.
        let header = [0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
        let with_body = |flags: u8| {
            let mut f = vec![flags, header.len() as u8];
            f.extend_from_slice(&header);
            f
        };
        let mut s = vec![0u8; 64];
        s.extend(with_body(0b001));
        s.extend(with_body(0b100));
        assert_eq!(Frames::new(DecodeLimits::default()).check(&s), Ok(()));
        // A payload shorter than the 64-byte prefix is checked at its end, however it is split.
        s.extend(with_body(0b000));
        for step in [1, 2, 5] {
            let mut f = Frames::new(DecodeLimits::default());
            let verdict = s.chunks(step).try_for_each(|c| f.check(c));
            assert_eq!(verdict, Err(Cut::OverBudget("batch of 4294967295 events, over the 65536-event limit".into())));
        }
    }

    #[test]
    fn endpoints() {
        assert_eq!(tcp_address("tcp://vllm-0.vllm:5557").unwrap(), "vllm-0.vllm:5557");
        assert_eq!(tcp_address("tcp://*:5557").unwrap(), "0.0.0.0:5557");
        assert!(tcp_address("ipc:///tmp/x").is_err());
        assert!(tcp_address("tcp://host").is_err());
    }
}
