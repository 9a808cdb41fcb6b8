//! A stand-in for vLLM's `ZmqEventPublisher`, for tests that decide what an engine publishes.

use kvmesh_core::index::{KvEvent, Stored};
use kvmesh_core::{EngineBlockHash, Medium};
use kvmesh_events::encode::{encode_batch, Encoding};
use std::sync::{Arc, Mutex};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// A stand-in publisher speaking vLLM's `ZmqEventPublisher` protocol: a PUB for
/// `[topic, seq, payload]` and a ROUTER answering `["", start_seq]` with every buffered
/// message from `start_seq` on, then an end marker (sequence -1, empty payload). The test
/// decides what is live and what is buffered.
pub struct Publisher {
    live: zeromq::PubSocket,
    /// What the replay socket holds: (sequence number, payload).
    pub buffer: Arc<Mutex<Vec<(u64, bytes::Bytes)>>>,
    /// The PUB endpoint (`tcp://127.0.0.1:port`).
    pub kv_events: String,
    /// The ROUTER endpoint.
    pub replay: String,
}

impl Publisher {
    /// Binds both sockets on loopback and starts answering replay requests.
    pub async fn start() -> Publisher {
        let mut live = zeromq::PubSocket::new();
        let kv_events = live.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let mut router = zeromq::RouterSocket::new();
        let replay = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let buffer: Arc<Mutex<Vec<(u64, bytes::Bytes)>>> = Arc::default();
        let b = buffer.clone();
        tokio::spawn(async move {
            while let Ok(m) = router.recv().await {
                let frames = m.into_vec();
                let id = frames[0].clone();
                let from = u64::from_be_bytes(frames.last().unwrap().as_ref().try_into().unwrap());
                let held: Vec<_> = b.lock().unwrap().iter().filter(|(s, _)| *s >= from).cloned().collect();
                for (seq, payload) in held.into_iter().chain([(u64::MAX, bytes::Bytes::new())]) {
                    let frames = vec![
                        id.clone(),
                        bytes::Bytes::new(),
                        bytes::Bytes::new(),
                        bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ];
                    router.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
                }
            }
        });
        Publisher { live, buffer, kv_events, replay }
    }

    /// Replica `e{i}` whose HTTP and metrics are engine-sim `engine`'s but whose KV events
    /// and replay socket are this publisher's.
    pub fn replica(&self, i: usize, engine: &kvmesh_engine_sim::EngineSim) -> kvmesh_node::config::ReplicaConfig {
        kvmesh_node::config::ReplicaConfig {
            kv_events: Some(self.kv_events.clone()),
            replay: Some(self.replay.clone()),
            ..super::replica(i, engine)
        }
    }

    /// Publishes live message `seq` (empty topic).
    pub async fn send(&mut self, seq: u64, payload: &bytes::Bytes) {
        let frames = vec![bytes::Bytes::new(), bytes::Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
        self.live.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
    }
}

/// A batch stamped `ts` of one store: blocks `hashes` (a sequence's first and on) holding
/// `tokens` (16 per block), computed under `lora_name`.
pub fn stored_batch(hashes: &[u64], tokens: &[u32], lora_name: Option<&str>, ts: f64) -> bytes::Bytes {
    let event = KvEvent::Stored(Stored {
        block_hashes: hashes.iter().map(|&h| EngineBlockHash(h)).collect(),
        parent: None,
        token_ids: tokens.to_vec(),
        block_size: 16,
        medium: Medium::Gpu,
        lora_name: lora_name.map(str::to_string),
        extra_keys: None,
        kv_group: None,
    });
    bytes::Bytes::from(encode_batch(ts, &[event], Some(0), Encoding::Map))
}
