//! `[limits]`: what one replica, client or peer may cost the node before it is refused.

use super::ConfigError;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `[limits]`: caps that keep a hostile or broken replica, client or peer from degrading the
/// others. Every key has a default sized for real traffic with headroom (see each key).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsSection {
    /// Largest KV-event message accepted, bytes (all frames). vLLM's largest real batch (one
    /// engine step at `max_num_batched_tokens = 131072`) is < 1.5 MiB. zeromq 0.7 has no
    /// `ZMQ_MAXMSGSIZE`: the node's frame guard cuts the connection at the first frame or
    /// message over this, before zeromq allocates for it.
    pub kv_event_max_message_bytes: usize,
    /// Most events in one KV-event batch (vLLM: one per request stored in a step plus one per
    /// evicted block, ≤ ~16 k at 131072 batched tokens).
    pub kv_event_max_events: usize,
    /// Most msgpack values one KV-event payload may declare (a real step: ≤ ~160 k), checked
    /// on the bytes before decoding allocates. For batches pushed over `Events.Publish`: most
    /// block hashes and token ids in one batch, all its events together.
    pub kv_event_max_elements: usize,
    /// A replica whose stream brings this many bad messages (refused or undecodable, or with
    /// events the decoder or index rejected) within `kv_event_bad_window` is quarantined:
    /// status `bad_events`, its blocks dropped and its stream not followed (disconnected),
    /// routed on load only. Only what no sound engine sends counts, so two are already a
    /// pattern; each one before the quarantine costs the node reading it (a message over the
    /// budget is dropped by the frame guard from its first bytes, the rest skipped unread) and,
    /// for one over `kv_event_max_message_bytes`, a cut connection and a reconnect.
    pub kv_event_bad_messages: u32,
    /// The window `kv_event_bad_messages` counts over.
    #[serde(with = "humantime_serde")]
    pub kv_event_bad_window: Duration,
    /// How long a quarantine lasts; then the replica's blocks are rebuilt (from its
    /// replay socket when it has one) and its events apply again.
    #[serde(with = "humantime_serde")]
    pub kv_event_quarantine: Duration,
    /// A request's headers must be complete this long after their first byte arrived,
    /// or the connection is closed (slowloris).
    #[serde(with = "humantime_serde")]
    pub http_header_timeout: Duration,
    /// A client connection with no request in flight and none begun for this long (since the
    /// connect or the last response) is closed. It is also how long a request body
    /// may take to arrive in full (408 beyond).
    #[serde(with = "humantime_serde")]
    pub http_idle_timeout: Duration,
    /// Most client connections open at once (TLS handshakes included), at most 1,048,576;
    /// further ones wait in the listen backlog. Keep it below the process's open-file limit
    /// (the node lowers it to that limit less 256 for its own sockets and files, with a
    /// warning).
    pub http_max_connections: usize,
    /// Request bodies being received or routed at once, all clients together, bytes (each
    /// body's buffer as it grows); beyond it: 503 with `Retry-After`.
    pub http_body_budget_bytes: usize,
    /// Largest body of a completion or chat request, bytes (413 beyond).
    pub http_max_body_bytes: usize,
    /// Largest gRPC message of the services operators and clients call (`Router`, `Admin`,
    /// `Events`, `Cluster`, `Replication`, `Autoscaler`, KEDA's scaler), bytes, both
    /// directions. Raft and gossip take up to 64 MiB, fixed, since every member must agree on
    /// it (a Raft snapshot or an append of many entries), and only after the nodes' token.
    pub grpc_public_max_message_bytes: usize,
    /// Requests one gRPC connection may have in flight at once; further ones wait.
    pub grpc_concurrency_per_connection: usize,
    /// Largest engine `/metrics` page read, bytes; a longer one fails the scrape (counted
    /// like any failed scrape). vLLM's page, histograms and LoRA series included, is well
    /// under 1 MiB.
    pub metrics_max_page_bytes: usize,
}

impl Default for LimitsSection {
    fn default() -> Self {
        let events = kvmesh_events::DecodeLimits::default();
        LimitsSection {
            kv_event_max_message_bytes: events.max_message_bytes,
            kv_event_max_events: events.max_events,
            kv_event_max_elements: events.max_elements,
            kv_event_bad_messages: 2,
            kv_event_bad_window: Duration::from_secs(30),
            kv_event_quarantine: Duration::from_secs(60),
            http_header_timeout: Duration::from_secs(10),
            http_idle_timeout: Duration::from_secs(120),
            http_max_connections: 4096,
            http_body_budget_bytes: 256 << 20,
            http_max_body_bytes: 64 << 20,
            grpc_public_max_message_bytes: 4 << 20,
            grpc_concurrency_per_connection: 256,
            metrics_max_page_bytes: 8 << 20,
        }
    }
}

impl LimitsSection {
    /// The KV-event decode limits.
    pub fn kv_events(&self) -> kvmesh_events::DecodeLimits {
        kvmesh_events::DecodeLimits {
            max_message_bytes: self.kv_event_max_message_bytes,
            max_events: self.kv_event_max_events,
            max_elements: self.kv_event_max_elements,
        }
    }

    /// Checks every limit is usable.
    ///
    /// # Errors
    /// The first zero or non-positive limit, or a body cap above the body budget.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("kv_event_max_message_bytes", self.kv_event_max_message_bytes),
            ("kv_event_max_events", self.kv_event_max_events),
            ("kv_event_max_elements", self.kv_event_max_elements),
            ("kv_event_bad_messages", self.kv_event_bad_messages as usize),
            ("http_max_connections", self.http_max_connections),
            ("http_body_budget_bytes", self.http_body_budget_bytes),
            ("http_max_body_bytes", self.http_max_body_bytes),
            ("grpc_public_max_message_bytes", self.grpc_public_max_message_bytes),
            ("grpc_concurrency_per_connection", self.grpc_concurrency_per_connection),
            ("metrics_max_page_bytes", self.metrics_max_page_bytes),
        ];
        if let Some((k, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::setting(format!("limits.{k}"), "must be positive"));
        }
        for (k, v) in [
            ("limits.kv_event_bad_window", self.kv_event_bad_window),
            ("limits.kv_event_quarantine", self.kv_event_quarantine),
            ("limits.http_header_timeout", self.http_header_timeout),
            ("limits.http_idle_timeout", self.http_idle_timeout),
        ] {
            super::up_to_a_day(k, v, false)?;
        }
        if self.http_max_connections > 1 << 20 {
            return Err(ConfigError::setting(
                "limits.http_max_connections",
                format!("must be at most 1048576, got {}", self.http_max_connections),
            ));
        }
        if self.http_max_body_bytes > self.http_body_budget_bytes {
            return Err(ConfigError::Conflict(format!(
                "limits.http_max_body_bytes ({}) is above limits.http_body_budget_bytes ({}): no such body could ever be accepted",
                self.http_max_body_bytes, self.http_body_budget_bytes
            )));
        }
        Ok(())
    }
}
