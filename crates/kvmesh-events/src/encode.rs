//! The publishing side, for stand-in engines and tests: core events → vLLM's wire format.
//!
//! Produces exactly what [`crate::decode_message`] reads and vLLM's own subscriber example
//! decodes: a msgpack `[ts, events, data_parallel_rank]`, each event a map tagged by `"type"`
//! (vLLM ≥ 0.24) or a positional array led by the tag (older vLLM).

use kvmesh_core::index::KvEvent;
use kvmesh_core::Medium;
use rmpv::Value;

/// Which of vLLM's two event encodings to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    /// Maps tagged by `"type"` (vLLM ≥ 0.24, SGLang).
    #[default]
    Map,
    /// Positional arrays led by the tag (older vLLM).
    Array,
}

/// Encodes one batch payload.
pub fn encode_batch(ts: f64, events: &[KvEvent], data_parallel_rank: Option<i64>, encoding: Encoding) -> Vec<u8> {
    let events = events.iter().map(|e| event(e, encoding)).collect();
    let mut fields = vec![Value::F64(ts), Value::Array(events)];
    if let Some(rank) = data_parallel_rank {
        fields.push(Value::from(rank));
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Array(fields)).expect("writing to a Vec cannot fail");
    out
}

/// Encodes one batch payload as vLLM after 0.33 does (its `EventBatch` no longer
/// `array_like`): a map `{"ts", "events", "data_parallel_rank"}` (the rank left out when
/// `None`, as msgspec's `omit_defaults` does), events as maps tagged by `"type"`.
pub fn encode_map_batch(ts: f64, events: &[KvEvent], data_parallel_rank: Option<i64>) -> Vec<u8> {
    let events = events.iter().map(|e| event(e, Encoding::Map)).collect();
    let mut fields = vec![(Value::from("ts"), Value::F64(ts)), (Value::from("events"), Value::Array(events))];
    if let Some(rank) = data_parallel_rank {
        fields.push((Value::from("data_parallel_rank"), Value::from(rank)));
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Map(fields)).expect("writing to a Vec cannot fail");
    out
}

/// `[ts, [nil × n], nil]`: a batch of `n` events that are all nil, written directly (no
/// msgpack tree) — the hostile message that once stalled every node following a replica, for
/// stand-in engines' `hostile_events` fault and tests.
pub fn encode_nil_batch(ts: f64, n: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(n as usize + 16);
    b.extend_from_slice(&[0x93, 0xcb]);
    b.extend_from_slice(&ts.to_be_bytes());
    b.push(0xdd);
    b.extend_from_slice(&n.to_be_bytes());
    b.resize(b.len() + n as usize, 0xc0);
    b.push(0xc0);
    b
}

/// The three frames of one publisher message: `[topic, seq (u64 big-endian), payload]`.
pub fn message_frames(topic: &[u8], seq: u64, payload: Vec<u8>) -> [Vec<u8>; 3] {
    [topic.to_vec(), seq.to_be_bytes().to_vec(), payload]
}

fn medium(m: Medium) -> Value {
    Value::from(match m {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
    })
}

/// vLLM's per-block `extra_keys` for `extra`: the LoRA name on every block (as vLLM puts it),
/// the salt on the first, and a stand-in multimodal key `["mm", digest, 0]` on each
/// unverifiable block (decoding gives another digest of it, also nonzero).
fn extra_keys(s: &kvmesh_core::index::Stored, extra: &kvmesh_core::index::ExtraKeys) -> Value {
    let blocks = s.block_hashes.len();
    Value::Array(
        (0..blocks)
            .map(|k| {
                let mut keys: Vec<Value> = s.lora_name.iter().map(|l| Value::from(l.as_str())).collect();
                if let Some(d) = extra.unverifiable.get(k).filter(|&&d| d != 0) {
                    keys.push(Value::Array(vec![Value::from("mm"), Value::from(*d), Value::from(0)]));
                }
                if let Some(salt) = extra.cache_salt.as_deref().filter(|_| k == 0 && s.parent.is_none()) {
                    keys.push(Value::from(salt));
                }
                if keys.is_empty() {
                    Value::Nil
                } else {
                    Value::Array(keys)
                }
            })
            .collect(),
    )
}

fn event(e: &KvEvent, encoding: Encoding) -> Value {
    let hashes = |hs: &[kvmesh_core::EngineBlockHash]| Value::Array(hs.iter().map(|h| Value::from(h.0)).collect());
    let (tag, fields): (&str, Vec<(&str, Value)>) = match e {
        KvEvent::Stored(s) => {
            let mut fields = vec![
                ("block_hashes", hashes(&s.block_hashes)),
                ("parent_block_hash", s.parent.map_or(Value::Nil, |p| Value::from(p.0))),
                ("token_ids", Value::Array(s.token_ids.iter().map(|&t| Value::from(t)).collect())),
                ("block_size", Value::from(s.block_size)),
                ("lora_id", Value::Nil),
                ("medium", medium(s.medium)),
                ("lora_name", s.lora_name.as_deref().map_or(Value::Nil, Value::from)),
            ];
            if let Some(extra) = &s.extra_keys {
                fields.push(("extra_keys", extra_keys(s, extra)));
            }
            if let Some(g) = &s.kv_group {
                if s.extra_keys.is_none() {
                    fields.push(("extra_keys", Value::Nil));
                }
                fields.push(("group_idx", Value::from(g.idx)));
                fields.push(("kv_cache_spec_kind", g.kind.as_deref().map_or(Value::Nil, Value::from)));
                fields.push(("kv_cache_spec_sliding_window", g.sliding_window.map_or(Value::Nil, Value::from)));
            }
            ("BlockStored", fields)
        }
        KvEvent::Removed(r) => {
            let mut fields = vec![("block_hashes", hashes(&r.block_hashes)), ("medium", medium(r.medium))];
            if let Some(g) = r.kv_group {
                fields.push(("group_idx", Value::from(g)));
            }
            ("BlockRemoved", fields)
        }
        KvEvent::Cleared => ("AllBlocksCleared", vec![]),
    };
    match encoding {
        Encoding::Map => Value::Map(
            std::iter::once(("type", Value::from(tag))).chain(fields).map(|(k, v)| (Value::from(k), v)).collect(),
        ),
        Encoding::Array => {
            Value::Array(std::iter::once(Value::from(tag)).chain(fields.into_iter().map(|(_, v)| v)).collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode_message;
    use kvmesh_core::index::{Removed, Stored};
    use kvmesh_core::EngineBlockHash;

    #[test]
    fn a_map_encoded_batch_decodes_like_the_array_one() {
        let events = vec![
            KvEvent::Cleared,
            KvEvent::Removed(Removed { block_hashes: vec![EngineBlockHash(7)], medium: Medium::Gpu, kv_group: None }),
        ];
        for rank in [None, Some(3)] {
            let from_map = crate::decode_batch(&encode_map_batch(2.5, &events, rank)).unwrap();
            let from_array = crate::decode_batch(&encode_batch(2.5, &events, rank, Encoding::Map)).unwrap();
            assert_eq!(from_map, from_array);
            assert_eq!((from_map.ts, from_map.events.len(), from_map.data_parallel_rank), (2.5, 2, rank));
        }
        // Unknown keys pass; a map without events or ts is malformed.
        let write = |v: Value| {
            let mut out = Vec::new();
            rmpv::encode::write_value(&mut out, &v).unwrap();
            out
        };
        let extra = Value::Map(vec![
            (Value::from("ts"), Value::F64(1.0)),
            (Value::from("new_field"), Value::from(9)),
            (Value::from("events"), Value::Array(vec![])),
        ]);
        assert_eq!(crate::decode_batch(&write(extra)).unwrap().ts, 1.0);
        let no_events = Value::Map(vec![(Value::from("ts"), Value::F64(1.0))]);
        assert_eq!(
            crate::decode_batch(&write(no_events)).unwrap_err().to_string(),
            crate::DecodeError::malformed("payload map has no events").to_string()
        );
        let no_ts = Value::Map(vec![(Value::from("events"), Value::Array(vec![]))]);
        assert!(crate::decode_batch(&write(no_ts)).unwrap_err().to_string().contains("no ts"));
    }

    #[test]
    fn both_encodings_decode_back_to_the_same_events() {
        let events = vec![
            KvEvent::Stored(Stored {
                block_hashes: vec![EngineBlockHash(u64::MAX), EngineBlockHash(3)],
                parent: Some(EngineBlockHash(1)),
                token_ids: (0..8).collect(),
                block_size: 4,
                medium: Medium::Gpu,
                lora_name: Some("a".into()),
                extra_keys: None,
                kv_group: None,
            }),
            KvEvent::Stored(Stored {
                block_hashes: vec![EngineBlockHash(9)],
                parent: None,
                token_ids: (0..4).collect(),
                block_size: 4,
                medium: Medium::Gpu,
                lora_name: None,
                extra_keys: None,
                kv_group: Some(kvmesh_core::index::KvGroup {
                    idx: 1,
                    kind: Some("sliding_window".into()),
                    sliding_window: Some(4096),
                }),
            }),
            KvEvent::Removed(Removed { block_hashes: vec![EngineBlockHash(3)], medium: Medium::Cpu, kv_group: None }),
            KvEvent::Removed(Removed {
                block_hashes: vec![EngineBlockHash(9)],
                medium: Medium::Gpu,
                kv_group: Some(1),
            }),
            KvEvent::Cleared,
        ];
        for encoding in [Encoding::Map, Encoding::Array] {
            let frames = message_frames(b"kv", 41, encode_batch(2.5, &events, Some(1), encoding));
            let msg = decode_message(&frames).unwrap();
            assert_eq!((msg.seq, msg.batch.ts, msg.batch.data_parallel_rank), (41, 2.5, Some(1)));
            assert_eq!(msg.batch.events, events, "{encoding:?}");
        }
    }
}
