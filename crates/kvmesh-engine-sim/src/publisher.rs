//! KV events out: a ZMQ PUB socket sending vLLM's `[topic, seq, payload]` messages, and a
//! ROUTER replay socket answering `["", start_seq]` with every buffered message from
//! `start_seq` on, then an end marker with an empty payload (vLLM `ZmqEventPublisher`).

use crate::faults::FaultState;
use crate::EngineSimConfig;
use anyhow::Context;
use bytes::Bytes;
use kvmesh_core::index::KvEvent;
use kvmesh_events::encode::{encode_batch, Encoding};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// The replay end marker's sequence frame (vLLM sends -1 as a signed 64-bit integer).
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// A started publisher.
pub struct Publisher {
    /// Where step events go.
    pub sender: mpsc::UnboundedSender<Vec<KvEvent>>,
    /// The bound PUB endpoint.
    pub kv_events: String,
    /// The bound ROUTER endpoint.
    pub replay: String,
    /// Its tasks.
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Binds both sockets and starts their tasks: the publisher of data-parallel rank `rank`
/// (its batches say so), at `config`'s endpoints.
///
/// # Errors
/// A bind failure.
pub async fn start(
    config: &EngineSimConfig,
    rank: u32,
    faults: Arc<FaultState>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Publisher> {
    let mut pub_socket = zeromq::PubSocket::new();
    let kv_events =
        pub_socket.bind(&config.kv_events).await.with_context(|| format!("bind {}", config.kv_events))?.to_string();
    let mut router = zeromq::RouterSocket::new();
    let replay = router.bind(&config.replay).await.with_context(|| format!("bind {}", config.replay))?.to_string();
    let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
    let topic = Bytes::from(config.topic.clone().into_bytes());
    let (sender, mut batches) = mpsc::unbounded_channel::<Vec<KvEvent>>();
    let (cap, buf, top) = (config.replay_buffer.max(1), buffer.clone(), topic.clone());
    let mut stop_pub = stop.clone();
    let publish = tokio::spawn(async move {
        let mut seq = 0u64;
        let mut hostile_tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            let events = tokio::select! {
                e = batches.recv() => match e { Some(e) => Some(e), None => break },
                _ = stop_pub.wait_for(|s| *s) => break,
                _ = hostile_tick.tick() => None,
            };
            if events.as_ref().is_some_and(Vec::is_empty) {
                // The engine loop restarted (`restart_engine`; it sends nothing else empty, and
                // in order with its batches): a new publisher, numbering from 0, nothing to replay.
                seq = 0;
                buf.lock().unwrap_or_else(|p| p.into_inner()).clear();
                continue;
            }
            let Some(events) = events else {
                if faults.get().hostile_events {
                    let frames = vec![
                        top.clone(),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        Bytes::from(kvmesh_events::encode::encode_nil_batch(0.0, 4_194_280)),
                    ];
                    if let Ok(msg) = ZmqMessage::try_from(frames) {
                        let _ = pub_socket.send(msg).await;
                    }
                    seq += 1;
                }
                continue;
            };
            if faults.take_restart() {
                seq = 0;
                buf.lock().unwrap_or_else(|p| p.into_inner()).clear();
            }
            let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
            let payload = Bytes::from(encode_batch(ts, &events, Some(i64::from(rank)), Encoding::Map));
            {
                let mut b = buf.lock().unwrap_or_else(|p| p.into_inner());
                b.push_back((seq, payload.clone()));
                while b.len() > cap {
                    b.pop_front();
                }
            }
            let f = faults.get();
            let dropped = f.drop_events || (f.drop_every > 0 && (seq + 1).is_multiple_of(f.drop_every));
            if !dropped {
                if f.delay_events_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(f.delay_events_ms)).await;
                }
                let frames = vec![top.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload];
                if let Ok(msg) = ZmqMessage::try_from(frames) {
                    // A PUB with no subscriber drops the message, as libzmq's does.
                    let _ = pub_socket.send(msg).await;
                }
            }
            seq += 1;
        }
    });
    let mut stop_replay = stop;
    let serve_replay = tokio::spawn(async move {
        loop {
            let msg = tokio::select! {
                m = router.recv() => match m { Ok(m) => m, Err(_) => continue },
                _ = stop_replay.wait_for(|s| *s) => break,
            };
            let frames = msg.into_vec();
            // [identity, "", start_seq]
            let (Some(identity), Some(start)) = (frames.first(), frames.last()) else { continue };
            let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else { continue };
            let replies: Vec<(u64, Bytes)> = {
                let b = buffer.lock().unwrap_or_else(|p| p.into_inner());
                b.iter().filter(|(s, _)| *s >= start).cloned().collect()
            };
            for (seq, payload) in replies {
                let frames = vec![
                    identity.clone(),
                    Bytes::new(),
                    topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ];
                if let Ok(m) = ZmqMessage::try_from(frames) {
                    let _ = router.send(m).await;
                }
            }
            let end =
                vec![identity.clone(), Bytes::new(), topic.clone(), Bytes::copy_from_slice(&END_SEQ), Bytes::new()];
            if let Ok(m) = ZmqMessage::try_from(end) {
                let _ = router.send(m).await;
            }
        }
    });
    Ok(Publisher { sender, kv_events, replay, tasks: vec![publish, serve_replay] })
}
