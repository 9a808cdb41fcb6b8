//! A decode budget, checked on the raw bytes before anything is allocated.
//!
//! The decoder reads in place ([`crate::batch`]), but a message of millions of tiny values
//! still costs time per value, on the task that follows the replica, and the rare fields it
//! reads as a tree (`extra_keys`) cost memory per value. [`check_budget`] walks the bytes once, without allocating, and
//! refuses a message whose *declared* sizes exceed [`DecodeLimits`] — an array that claims
//! 2^32 elements is refused at its header, before its first element is read.
//!
//! The defaults were sized from vLLM's publisher (`vllm/distributed/kv_events.py`,
//! `vllm/v1/core/block_pool.py`, v0.11): one batch per engine step, holding at most one
//! `BlockStored` per request scheduled in the step (its `token_ids` bounded by
//! `max_num_batched_tokens`) and one `BlockRemoved` per evicted block. At
//! `max_num_batched_tokens = 131072` (long-context serving without chunked prefill) and
//! 16-token blocks that is ≤ 131,072 token ids, ≤ 8,192 stored block hashes and ≤ 8,192
//! removals: ~160 k msgpack elements, < 1.5 MiB. The defaults leave ~6× headroom on each.

use crate::cursor::{Cursor, Item};
use crate::error::DecodeError;

/// Limits on one KV-event message, applied before decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest message accepted, bytes (all frames together).
    pub max_message_bytes: usize,
    /// Most events in one batch's `events` array.
    pub max_events: usize,
    /// Most msgpack values in the payload, containers and scalars alike.
    pub max_elements: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits { max_message_bytes: 8 << 20, max_events: 65_536, max_elements: 1 << 20 }
    }
}

/// Deepest container nesting [`check_budget`] accepts. A real payload nests 5 levels (batch →
/// events → event → `extra_keys` → key).
pub const MAX_NESTING: usize = 16;

/// Checks `payload` (one batch: `[ts, events, rank?]`, or the map `{"ts", "events", …}`)
/// against `limits` without allocating.
///
/// # Errors
/// [`DecodeError::OverBudget`] when the payload is larger than `max_message_bytes`, its events
/// array (the second element of the array form; any array value of the map form) holds more
/// than `max_events`, or it declares more than
/// `max_elements` values; [`DecodeError::Malformed`] when it nests deeper than
/// [`MAX_NESTING`] or uses the reserved marker; [`DecodeError::Incomplete`] when a declared
/// length runs past the end.
pub fn check_budget(payload: &[u8], limits: &DecodeLimits) -> Result<(), DecodeError> {
    extent(payload, limits).map(|_| ())
}

/// [`check_budget`], and the length of the payload's one value when it passes (the bytes
/// after it are not part of the batch).
pub(crate) fn extent(payload: &[u8], limits: &DecodeLimits) -> Result<usize, DecodeError> {
    if payload.len() > limits.max_message_bytes {
        return Err(DecodeError::OverBudget(format!(
            "payload of {} bytes, over the {}-byte limit",
            payload.len(),
            limits.max_message_bytes
        )));
    }
    // Values still to read at each open container level; [0] is the top level (one value).
    let mut open = [0u64; MAX_NESTING + 1];
    let mut depth = 0usize;
    open[0] = 1;
    // Position of the next value within the top-level array (the events array is its [1]).
    let mut top_index = 0u64;
    let mut elements = 0u64;
    // Newer vLLM encodes the batch as a map (`{"ts", "events", "data_parallel_rank"}`): there
    // the events array is the one array among the map's values.
    let top_is_map = matches!(Cursor::first(payload), Item::Map(_));
    let mut cur = Cursor::new(payload);
    while depth > 0 || open[0] > 0 {
        if open[depth] == 0 {
            depth -= 1;
            if depth == 1 {
                top_index += 1;
            }
            continue;
        }
        open[depth] -= 1;
        elements += 1;
        // Scalars, strings and binary are read past whole; a container's values come next.
        let item = cur.item();
        let children = match item {
            Item::Array(n) => n as u64,
            Item::Map(n) => 2 * n as u64,
            Item::Truncated => return Err(DecodeError::Incomplete("payload ends inside a msgpack value".into())),
            Item::Reserved => return Err(DecodeError::malformed("reserved msgpack marker 0xc1")),
            _ => 0,
        };
        // The events array: the top-level array's second element, or the top-level map's array.
        let events = if top_is_map { matches!(item, Item::Array(_)) } else { top_index == 1 };
        if depth == 1 && events && children > limits.max_events as u64 {
            return Err(DecodeError::OverBudget(format!(
                "batch of {children} events, over the {}-event limit",
                limits.max_events
            )));
        }
        if elements + children > limits.max_elements as u64 {
            return Err(DecodeError::OverBudget(format!(
                "payload declares more than {} msgpack values",
                limits.max_elements
            )));
        }
        match children {
            0 if depth == 1 => top_index += 1,
            0 => {}
            n => {
                if depth == MAX_NESTING {
                    return Err(DecodeError::malformed("payload nests too deeply"));
                }
                depth += 1;
                open[depth] = n;
            }
        }
    }
    Ok(payload.len() - cur.remaining())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(events: usize, elements: usize) -> DecodeLimits {
        DecodeLimits { max_message_bytes: 1 << 20, max_events: events, max_elements: elements }
    }

    fn nils(n: usize) -> Vec<u8> {
        crate::encode::encode_nil_batch(1.0, n as u32)
    }

    #[test]
    fn counts_every_value_and_the_events_array() {
        // 1 batch + ts + events array + 10 nils + rank = 14 values.
        assert_eq!(check_budget(&nils(10), &limits(10, 14)), Ok(()));
        assert!(matches!(check_budget(&nils(10), &limits(10, 13)), Err(DecodeError::OverBudget(_))));
        let e = check_budget(&nils(11), &limits(10, 100)).unwrap_err();
        assert_eq!(e, DecodeError::OverBudget("batch of 11 events, over the 10-event limit".into()));
    }

    #[test]
    fn a_map_encoded_batch_has_its_events_array_counted_too() {
        // {"ts": 1.0, "events": [nil × n]} (vLLM's batch without `array_like`).
        let map = |n: u16| {
            let mut b = vec![0x82, 0xa2, b't', b's', 0xcb];
            b.extend_from_slice(&1.0f64.to_be_bytes());
            b.extend_from_slice(&[0xa6, b'e', b'v', b'e', b'n', b't', b's', 0xdc]);
            b.extend_from_slice(&n.to_be_bytes());
            b.extend(std::iter::repeat_n(0xc0, n as usize));
            b
        };
        // 1 map + 2 keys + ts + events array + 10 nils = 15 values.
        assert_eq!(check_budget(&map(10), &limits(10, 15)), Ok(()));
        assert!(matches!(check_budget(&map(10), &limits(10, 14)), Err(DecodeError::OverBudget(_))));
        let e = check_budget(&map(11), &limits(10, 100)).unwrap_err();
        assert_eq!(e, DecodeError::OverBudget("batch of 11 events, over the 10-event limit".into()));
    }

    #[test]
    fn a_declared_length_is_refused_at_its_header() {
        // An array claiming 2^32 − 1 values in 6 bytes: refused before reading any.
        let b = [0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
        let e = check_budget(&b, &DecodeLimits::default()).unwrap_err();
        assert_eq!(e, DecodeError::OverBudget("batch of 4294967295 events, over the 65536-event limit".into()));
        let deep_map = [0x91, 0xdf, 0x7f, 0xff, 0xff, 0xff];
        assert!(matches!(check_budget(&deep_map, &DecodeLimits::default()), Err(DecodeError::OverBudget(_))));
    }

    #[test]
    fn nesting_truncation_and_size() {
        let mut deep = vec![0x91; MAX_NESTING];
        deep.push(0xc0);
        assert_eq!(check_budget(&deep, &DecodeLimits::default()), Ok(()));
        let mut deeper = vec![0x91; MAX_NESTING + 1];
        deeper.push(0xc0);
        assert_eq!(
            check_budget(&deeper, &DecodeLimits::default()),
            Err(DecodeError::malformed("payload nests too deeply"))
        );
        assert!(check_budget(&[0x92, 0xc0], &DecodeLimits::default()).unwrap_err().is_incomplete());
        assert!(check_budget(&[0xda, 0x00, 0x05, b'a'], &DecodeLimits::default()).unwrap_err().is_incomplete());
        let small = DecodeLimits { max_message_bytes: 4, ..DecodeLimits::default() };
        assert_eq!(
            check_budget(&nils(1), &small),
            Err(DecodeError::OverBudget("payload of 17 bytes, over the 4-byte limit".into()))
        );
    }
}
