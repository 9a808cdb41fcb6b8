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
//! ```text
//! node's SUB/DEALER ──tcp──► 127.0.0.1:guard ──tcp──► engine's PUB/ROUTER
//!                     bytes out: copied      bytes in: frame sizes checked, then copied
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long dialing the engine may take before the node's socket is turned away.
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// Connections cut for an oversized frame or message, since the start.
    pub cut: Arc<AtomicU64>,
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
        .ok_or_else(|| anyhow::anyhow!("KV-event endpoint {endpoint:?}: only tcp:// is supported"))?;
    let rest = rest.strip_prefix("*:").map_or_else(|| rest.to_string(), |port| format!("0.0.0.0:{port}"));
    if rest.rsplit_once(':').is_none_or(|(_, p)| p.parse::<u16>().is_err()) {
        anyhow::bail!("KV-event endpoint {endpoint:?} has no port");
    }
    Ok(rest)
}

impl FrameGuard {
    /// Starts a relay for `direction` that cuts frames and messages over `max_bytes`.
    ///
    /// # Errors
    /// A listening socket cannot be bound.
    pub async fn start(direction: Direction, max_bytes: usize, replica: &str) -> anyhow::Result<FrameGuard> {
        let cut = Arc::new(AtomicU64::new(0));
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
                                relay(engine_side, node_side, max_bytes, &c, &replica).await;
                            }
                        });
                    }
                });
                Ok(FrameGuard { socket_endpoint, socket_binds: false, cut, task })
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
                                relay(engine_side, node_side, max_bytes, &c, &replica).await;
                            }
                        });
                    }
                });
                Ok(FrameGuard { socket_endpoint, socket_binds: true, cut, task })
            }
        }
    }
}

/// Copies both ways until either side closes or the engine sends a frame or message over
/// `max_bytes` (then both are closed and `cut` counts it).
async fn relay(engine: TcpStream, node: TcpStream, max_bytes: usize, cut: &AtomicU64, replica: &str) {
    let _ = engine.set_nodelay(true);
    let _ = node.set_nodelay(true);
    let (mut engine_rd, mut engine_wr) = engine.into_split();
    let (mut node_rd, mut node_wr) = node.into_split();
    let outbound = async {
        let _ = tokio::io::copy(&mut node_rd, &mut engine_wr).await;
    };
    let inbound = async {
        let mut frames = Frames::new(max_bytes as u64);
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match engine_rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Err(why) = frames.check(&buf[..n]) {
                cut.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%replica, %why, "KV-event connection cut before decoding");
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

/// The engine's side of a ZMTP 3 stream, parsed incrementally for frame sizes only.
#[derive(Debug)]
pub struct Frames {
    max: u64,
    state: State,
    /// Bytes of the multipart message so far (frames with MORE, then the last).
    message: u64,
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// Greeting bytes still to pass.
    Greeting(u64),
    /// Waiting for a frame's flags byte.
    Flags,
    /// Size bytes read so far, of `len` (1 or 8), the flags, and the value so far.
    Size { flags: u8, len: u8, got: u8, value: u64 },
    /// Body bytes still to pass.
    Body { left: u64 },
}

impl Frames {
    /// A fresh stream whose frames and messages may hold at most `max` bytes.
    pub fn new(max: u64) -> Self {
        Frames { max, state: State::Greeting(64), message: 0 }
    }

    /// Checks the next `bytes` of the stream.
    ///
    /// # Errors
    /// What went over the cap.
    pub fn check(&mut self, mut bytes: &[u8]) -> Result<(), String> {
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
                        return Err(format!("a frame of {value} bytes, over the {}-byte limit", self.max));
                    }
                    if !command {
                        self.message += value;
                        if self.message > self.max {
                            return Err(format!(
                                "a message of {} bytes or more, over the {}-byte limit",
                                self.message, self.max
                            ));
                        }
                        if flags & 1 == 0 {
                            self.message = 0;
                        }
                    }
                    self.state = if value == 0 { State::Flags } else { State::Body { left: value } };
                }
                State::Body { left } => {
                    let take = left.min(bytes.len() as u64);
                    bytes = &bytes[take as usize..];
                    self.state = if left == take { State::Flags } else { State::Body { left: left - take } };
                }
            }
        }
        Ok(())
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
            let mut f = Frames::new(308);
            for chunk in stream.chunks(step) {
                f.check(chunk).unwrap();
            }
        }
        let mut f = Frames::new(307);
        assert_eq!(
            stream.chunks(5).try_for_each(|c| f.check(c)),
            Err("a message of 308 bytes or more, over the 307-byte limit".into())
        );
    }

    #[test]
    fn a_huge_declared_frame_is_refused_at_its_header() {
        let mut stream = vec![0u8; 64];
        stream.push(0b10);
        stream.extend_from_slice(&(1u64 << 50).to_be_bytes());
        let mut f = Frames::new(8 << 20);
        assert_eq!(f.check(&stream), Err(format!("a frame of {} bytes, over the 8388608-byte limit", 1u64 << 50)));
        // Commands (READY, …) count against the frame cap but are not message parts.
        let mut f = Frames::new(10);
        let mut s = vec![0u8; 64];
        s.extend([0b100, 10]);
        s.extend([0u8; 10]);
        s.extend(frame(false, 10));
        assert_eq!(f.check(&s), Ok(()));
    }

    #[test]
    fn endpoints() {
        assert_eq!(tcp_address("tcp://vllm-0.vllm:5557").unwrap(), "vllm-0.vllm:5557");
        assert_eq!(tcp_address("tcp://*:5557").unwrap(), "0.0.0.0:5557");
        assert!(tcp_address("ipc:///tmp/x").is_err());
        assert!(tcp_address("tcp://host").is_err());
    }
}
