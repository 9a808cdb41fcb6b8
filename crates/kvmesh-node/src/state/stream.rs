//! One replica's KV-event stream as the node follows it: where its sequence stands, its
//! resyncs and quarantine, and its counts.
//!
//! The replica's own parts write it: its actor's ingest task (the ZMQ stream), the gRPC
//! pushes for it (`Events.Publish`), and its scrape (a restart seen in the engine's counters);
//! status and the admin API read it. It sits behind a lock of its own, not the core's, so a
//! batch's sequence check and bookkeeping never wait for a routing decision (a decision reads
//! none of it; a status check under the core's lock may wait for one such short section).
//! Lock order: a stream's lock may be taken while the core's is held; the core's is never
//! taken while a stream's is held.

use std::sync::{Arc, Mutex, MutexGuard};

/// What the node knows of one replica's event stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamState {
    /// The last KV-event sequence number applied; `None` when the node does not know where
    /// the stream stands (never heard, or after a rebuild or quarantine).
    pub last_seq: Option<u64>,
    /// A gap or restart was found and the replica is being resynced (a replay runs).
    pub resyncing: bool,
    /// Its blocks must be rebuilt, and why (the ingest task takes this): `recovery` — it came
    /// back after being unhealthy, perhaps a new engine whose first messages went out before
    /// this node's subscriber reconnected; `unknown_parent` — a stored event chained to a
    /// block this node never saw (case C03); `restart` — its generated-token counter went back
    /// (the engine restarted, whether or not it publishes again).
    pub resync_requested: Option<&'static str>,
    /// Node time, seconds, of the last such rebuild (rebuilds from unknown parents are spaced
    /// out, so a replay buffer that starts mid-chain cannot loop).
    pub last_resync_at: Option<f64>,
    /// Node time, seconds, the ingest task last saw its engine restart (the sequence went
    /// back), so a scrape that then sees the counters fall does not drop the new engine's
    /// blocks again.
    pub restart_seen_at: Option<f64>,
    /// Events applied to the index.
    pub events_applied: u64,
    /// Events and messages refused: by the decoder, the budget or the index.
    pub events_rejected: u64,
    /// End of its KV-event quarantine, node seconds (status `bad_events` until then).
    pub bad_events_until: Option<f64>,
    /// Since when (node seconds) its KV-event socket has failed to come up, and why, in
    /// words an operator can act on; `None` while it is up (status `no_events` once this
    /// lasts `node.events_silent`).
    pub socket_down: Option<(f64, String)>,
}

/// A replica's [`StreamState`], shared by the parts that follow it (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Stream(Arc<Mutex<StreamState>>);

impl Stream {
    /// The state, locked. A panic while it was held leaves it as it was then: every update
    /// is one field or a counter, never half an invariant.
    pub fn lock(&self) -> MutexGuard<'_, StreamState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
