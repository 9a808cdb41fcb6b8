//! The msgpack payload of one message: vLLM's `KVEventBatch`, encoded array-like by msgspec as
//! `[ts, events, data_parallel_rank]` (the rank is omitted by older vLLM and may be nil), or —
//! since vLLM's `EventBatch` dropped `array_like` (vllm/distributed/kv_events.py, after
//! 0.33) — as a map `{"ts", "events", "data_parallel_rank"?}` (fields left out at their
//! defaults).

use crate::budget::{check_budget, DecodeLimits};
use crate::error::DecodeError;
use crate::event::{decode_event, kind};
use kvmesh_core::index::KvEvent;
use rmpv::Value;

/// Deepest msgpack nesting accepted. A real payload nests 5 levels (batch → events → event →
/// `extra_keys` → key); rmpv spends two units per container level.
const MAX_DEPTH: usize = 32;

/// One decoded payload.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The engine's timestamp of the batch, seconds since the Unix epoch (engine clock).
    pub ts: f64,
    /// The events that decoded, in order.
    pub events: Vec<KvEvent>,
    /// vLLM's data-parallel rank of the publishing engine, when sent.
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
/// `events` (trailing elements and unknown keys are ignored, trailing bytes are not).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    decode_batch_with(payload, &DecodeLimits::default())
}

/// [`decode_batch`] within `limits`, checked on the bytes before anything is allocated
/// ([`check_budget`]).
///
/// # Errors
/// As [`decode_batch`], and [`DecodeError::OverBudget`].
pub fn decode_batch_with(payload: &[u8], limits: &DecodeLimits) -> Result<EventBatch, DecodeError> {
    check_budget(payload, limits)?;
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH).map_err(msgpack_error)?;
    if !rd.is_empty() {
        return Err(DecodeError::malformed(format!("{} bytes after the payload", rd.len())));
    }
    let fields = match value {
        Value::Array(fields) => fields,
        Value::Map(entries) => map_fields(entries)?,
        other => {
            return Err(DecodeError::malformed(format!("payload is {}, not an array [ts, events, rank]", kind(&other))))
        }
    };
    if fields.len() < 2 {
        return Err(DecodeError::malformed(format!("payload has {} elements, not [ts, events, rank?]", fields.len())));
    }
    let ts = match &fields[0] {
        Value::F64(t) => *t,
        Value::F32(t) => *t as f64,
        Value::Integer(i) => i.as_f64().unwrap_or(0.0),
        other => return Err(DecodeError::malformed(format!("ts is {}, not a number", kind(other)))),
    };
    let Value::Array(raw_events) = &fields[1] else {
        return Err(DecodeError::malformed(format!("events is {}, not an array", kind(&fields[1]))));
    };
    let data_parallel_rank = match fields.get(2) {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(i)) => i.as_i64(),
        Some(other) => {
            return Err(DecodeError::malformed(format!("data_parallel_rank is {}, not an integer", kind(other))))
        }
    };
    let mut batch =
        EventBatch { ts, events: Vec::with_capacity(raw_events.len()), data_parallel_rank, skipped: vec![] };
    for (index, raw) in raw_events.iter().enumerate() {
        match decode_event(raw) {
            Ok(event) => batch.events.push(event),
            Err(reason) => batch.skipped.push(SkippedEvent { index, reason }),
        }
    }
    Ok(batch)
}

/// A map-encoded batch's `ts`, `events` and `data_parallel_rank` (nil when left out), in the
/// array form's order.
fn map_fields(entries: Vec<(Value, Value)>) -> Result<Vec<Value>, DecodeError> {
    let mut fields = vec![Value::Nil, Value::Nil, Value::Nil];
    let mut seen = [false; 2];
    for (k, v) in entries {
        let slot = match k.as_str() {
            Some("ts") => 0,
            Some("events") => 1,
            Some("data_parallel_rank") => 2,
            _ => continue,
        };
        if slot < 2 {
            seen[slot] = true;
        }
        fields[slot] = v;
    }
    match seen {
        [true, true] => Ok(fields),
        [false, _] => Err(DecodeError::malformed("payload map has no ts")),
        [_, false] => Err(DecodeError::malformed("payload map has no events")),
    }
}

fn msgpack_error(e: rmpv::decode::Error) -> DecodeError {
    match e {
        rmpv::decode::Error::InvalidMarkerRead(io) | rmpv::decode::Error::InvalidDataRead(io)
            if io.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            DecodeError::Incomplete("payload ends inside a msgpack value".into())
        }
        rmpv::decode::Error::DepthLimitExceeded => DecodeError::malformed("payload nests too deeply"),
        other => DecodeError::malformed(format!("invalid msgpack: {other}")),
    }
}
