//! kvmesh-events: engines' wire formats — KV-cache events, load metrics and streamed
//! completions — decoded into [`kvmesh_core`] types. No I/O.
//!
//! vLLM publishes KV events on a ZMQ PUB socket (`vllm/distributed/kv_events.py`,
//! `ZmqEventPublisher`) as multipart messages
//!
//! ```text
//! [topic, seq (u64 big-endian, 8 bytes), payload (msgpack)]
//! payload = [ts (float, seconds), events (array), data_parallel_rank (int | nil)?]
//!         | {"ts": …, "events": […], "data_parallel_rank": …}   (vLLM after 0.33)
//! ```
//!
//! Each event is either a map tagged by `"type"` (vLLM ≥ 0.24, SGLang) or a positional array
//! led by the tag (older vLLM): `BlockStored`, `BlockRemoved`, `AllBlocksCleared`. Gaps in
//! `seq` are recovered through the publisher's ROUTER replay socket ([`replay`]).
//!
//! - [`message`]: frames → [`EventMessage`] (topic, sequence number, [`EventBatch`]).
//! - [`batch`]: the msgpack payload → [`EventBatch`].
//! - `event`: one msgpack event → [`kvmesh_core::index::KvEvent`], read in place (`cursor`;
//!   `extra_keys`, rare, as a tree).
//! - [`replay`]: the replay request and both reply framings.
//! - [`encode`]: the publishing side (core events → vLLM's format), for stand-in engines.
//! - [`metrics`]: an engine's load from its Prometheus `/metrics` page (vLLM and SGLang names).
//! - [`sse`]: server-sent events, as engines stream completions (one parser for the proxy and
//!   the clients).
//! - [`endpoint`]: where each data-parallel rank publishes (the port plus the rank).
//! - [`budget`]: [`DecodeLimits`] checked on the raw bytes before decoding allocates.
//! - [`DecodeError`]: "incomplete" (truncated), "malformed" (never valid) or "over budget".
//!
//! Nothing here panics on any input (fuzzed: `crates/kvmesh-events/fuzz`); one bad event in a
//! batch is reported in [`EventBatch::skipped`] and the others still apply.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod batch;
pub mod budget;
mod cursor;
pub mod encode;
pub mod endpoint;
pub mod error;
mod event;
pub mod message;
pub mod metrics;
pub mod replay;
pub mod sse;

pub use batch::{decode_batch, decode_batch_with, EventBatch, SkippedEvent};
pub use budget::{check_budget, DecodeLimits};
pub use endpoint::{offset_endpoint_port, EndpointError, EndpointProblem};
pub use error::{DecodeError, EventError};
pub use message::{decode_message, decode_message_with, EventMessage};
pub use metrics::{
    parse_engine_metrics, parse_engine_page, parse_engine_page_of, parse_served_tokens, Dialect, EnginePage,
    MetricsError,
};
pub use replay::{decode_replay_reply, decode_replay_reply_with, replay_request, ReplayReply};
pub use sse::{SseEvent, SseReader};
