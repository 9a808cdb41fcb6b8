use super::event::{decode_event, kind};
use kvmesh_events::{check_budget, DecodeError, DecodeLimits, EventBatch, SkippedEvent};
use rmpv::Value;

/// Deepest msgpack nesting rmpv is asked to read: rmpv spends two units per container level and
/// up to three on the innermost value, so this lets every payload through that the budget
/// check (`MAX_NESTING` = 16 levels) accepts; the budget, checked first, is the limit.
const MAX_DEPTH: usize = 2 * 16 + 3;

/// [`decode_batch`] within `limits`, checked on the bytes before anything is allocated
/// ([`check_budget`]).
///
/// # Errors
/// As [`decode_batch`], and [`DecodeError::OverBudget`].
pub(crate) fn decode_batch_with(payload: &[u8], limits: &DecodeLimits) -> Result<EventBatch, DecodeError> {
    check_budget(payload, limits)?;
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH).map_err(msgpack_error)?;
    if !rd.is_empty() {
        return Err(malformed(format!("{} bytes after the payload", rd.len())));
    }
    let fields = match value {
        Value::Array(fields) => fields,
        Value::Map(entries) => map_fields(entries)?,
        other => return Err(malformed(format!("payload is {}, not an array [ts, events, rank]", kind(&other)))),
    };
    if fields.len() < 2 {
        return Err(malformed(format!("payload has {} elements, not [ts, events, rank?]", fields.len())));
    }
    let ts = match &fields[0] {
        Value::F64(t) => *t,
        Value::F32(t) => *t as f64,
        Value::Integer(i) => i.as_f64().unwrap_or(0.0),
        other => return Err(malformed(format!("ts is {}, not a number", kind(other)))),
    };
    let Value::Array(raw_events) = &fields[1] else {
        return Err(malformed(format!("events is {}, not an array", kind(&fields[1]))));
    };
    let data_parallel_rank = match fields.get(2) {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(i)) => Some(i.as_i64().unwrap_or(i64::MAX)),
        Some(other) => return Err(malformed(format!("data_parallel_rank is {}, not an integer", kind(other)))),
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
        [false, _] => Err(malformed("payload map has no ts")),
        [_, false] => Err(malformed("payload map has no events")),
    }
}

fn msgpack_error(e: rmpv::decode::Error) -> DecodeError {
    match e {
        rmpv::decode::Error::InvalidMarkerRead(io) | rmpv::decode::Error::InvalidDataRead(io)
            if io.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            DecodeError::Incomplete("payload ends inside a msgpack value".into())
        }
        rmpv::decode::Error::DepthLimitExceeded => malformed("payload nests too deeply"),
        other => malformed(format!("invalid msgpack: {other}")),
    }
}

fn malformed(what: impl Into<String>) -> DecodeError {
    DecodeError::Malformed(what.into())
}
