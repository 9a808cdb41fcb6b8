//! The msgpack payload of one message: vLLM's `KVEventBatch`, encoded array-like by msgspec as
//! `[ts, events, data_parallel_rank]` (the rank is omitted by older vLLM and may be nil), or —
//! since vLLM's `EventBatch` dropped `array_like` (vllm/distributed/kv_events.py, after
//! 0.33) — as a map `{"ts", "events", "data_parallel_rank"?}` (fields left out at their
//! defaults).
//!
//! Read in place (the crate's `cursor`): scalars and bytes are taken where they lie and each
//! event is decoded as it is reached; apart from the rare `extra_keys` (read as a tree), what
//! is allocated is what a [`KvEvent`] keeps (a prefill step's batch decodes in about half the
//! time a `rmpv::Value` tree took; BENCHMARKS.md). The payload's top-level fields follow
//! msgpack maps' usual rule, the last of a repeated key kept.

use crate::budget::{extent, DecodeLimits};
use crate::cursor::{Cursor, Item};
use crate::error::DecodeError;
use crate::event::decode_event;
use kvmesh_core::index::KvEvent;

/// One decoded payload.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The engine's timestamp of the batch, seconds since the Unix epoch (engine clock).
    pub ts: f64,
    /// The events that decoded, in order.
    pub events: Vec<KvEvent>,
    /// vLLM's data-parallel rank of the publishing engine, when sent. A rank past `i64::MAX`
    /// reads as `i64::MAX`, a rank no replica has (it read as none, which any replica took).
    pub data_parallel_rank: Option<i64>,
    /// Events that did not decode: the others still apply, and the caller counts these.
    pub skipped: Vec<SkippedEvent>,
}

/// An event left out of a batch, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedEvent {
    /// Its position in the batch's `events` array.
    pub index: usize,
    /// What was wrong with it.
    pub reason: crate::EventError,
}

/// Decodes one msgpack payload.
///
/// # Errors
/// [`DecodeError::Incomplete`] when the bytes stop inside a value; [`DecodeError::Malformed`]
/// when they hold anything but one array `[ts, events, rank?]` or one map with `ts` and
/// `events` (trailing elements and unknown keys are ignored, trailing bytes are not), or nest
/// deeper than [`crate::budget::MAX_NESTING`]; [`DecodeError::OverBudget`] past the default
/// [`DecodeLimits`].
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    decode_batch_with(payload, &DecodeLimits::default())
}

/// [`decode_batch`] within `limits`, checked on the bytes before anything is allocated
/// ([`crate::check_budget`]).
///
/// # Errors
/// As [`decode_batch`], and [`DecodeError::OverBudget`].
pub fn decode_batch_with(payload: &[u8], limits: &DecodeLimits) -> Result<EventBatch, DecodeError> {
    let end = extent(payload, limits)?;
    if end < payload.len() {
        return Err(DecodeError::malformed(format!("{} bytes after the payload", payload.len() - end)));
    }
    let Top { ts, events, rank } = top(payload)?;
    let ts = match ts.map_or(Item::Nil, Cursor::first) {
        Item::F64(t) => t,
        Item::F32(t) => t as f64,
        Item::Int(i) => i.as_f64(),
        other => return Err(DecodeError::malformed(format!("ts is {}, not a number", other.kind()))),
    };
    let (events, skipped) = match events {
        Events::Decoded(events, skipped) => (events, skipped),
        Events::Not(kind) => return Err(DecodeError::malformed(format!("events is {kind}, not an array"))),
    };
    let data_parallel_rank = match rank.map_or(Item::Nil, Cursor::first) {
        Item::Nil => None,
        Item::Int(i) => Some(i.as_i64().unwrap_or(i64::MAX)),
        other => return Err(DecodeError::malformed(format!("data_parallel_rank is {}, not an integer", other.kind()))),
    };
    Ok(EventBatch { ts, events, data_parallel_rank, skipped })
}

/// A payload's fields: `ts` and `data_parallel_rank` as bytes (`None` when left out), `events`
/// decoded where they lie.
struct Top<'a> {
    ts: Option<&'a [u8]>,
    events: Events,
    rank: Option<&'a [u8]>,
}

/// The `events` field: decoded, or the type it was instead of an array.
enum Events {
    Decoded(Vec<KvEvent>, Vec<SkippedEvent>),
    Not(&'static str),
}

/// Reads the array form `[ts, events, rank?, …]` or the map form (unknown keys ignored, the
/// last of a repeated key kept). `payload` holds one whole value ([`extent`] said so).
fn top(payload: &[u8]) -> Result<Top<'_>, DecodeError> {
    let mut cur = Cursor::new(payload);
    match cur.item() {
        Item::Array(n) if n < 2 => {
            Err(DecodeError::malformed(format!("payload has {n} elements, not [ts, events, rank?]")))
        }
        Item::Array(n) => {
            let ts = cur.value();
            let events_field = events(&mut cur);
            let rank = if n > 2 { cur.value() } else { None };
            Ok(Top { ts, events: events_field, rank })
        }
        Item::Map(n) => {
            let (mut ts, mut events_field, mut rank) = (None, None, None);
            for _ in 0..cur.at_most(n) {
                match Cursor::first(cur.value().unwrap_or_default()) {
                    Item::Str(b"ts") => ts = cur.value(),
                    Item::Str(b"events") => events_field = Some(events(&mut cur)),
                    Item::Str(b"data_parallel_rank") => rank = cur.value(),
                    _ => {
                        cur.value();
                    }
                }
            }
            match (ts, events_field) {
                (None, _) => Err(DecodeError::malformed("payload map has no ts")),
                (_, None) => Err(DecodeError::malformed("payload map has no events")),
                (ts, Some(events)) => Ok(Top { ts, events, rank }),
            }
        }
        other => Err(DecodeError::malformed(format!("payload is {}, not an array [ts, events, rank]", other.kind()))),
    }
}

/// Decodes the events array at `cur` (or skips a value that is not one), leaving `cur` after it.
fn events(cur: &mut Cursor<'_>) -> Events {
    let at = *cur;
    let n = match cur.item() {
        Item::Array(n) => n,
        other => {
            *cur = at;
            cur.value();
            return Events::Not(other.kind());
        }
    };
    // The smallest event that decodes, `["AllBlocksCleared"]`, is 18 bytes.
    let mut events = Vec::with_capacity(n.min(cur.remaining() / 18));
    let mut skipped = vec![];
    for index in 0..cur.at_most(n) {
        match decode_event(cur) {
            Ok(event) => events.push(event),
            Err(reason) => skipped.push(SkippedEvent { index, reason }),
        }
    }
    Events::Decoded(events, skipped)
}
