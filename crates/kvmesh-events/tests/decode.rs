//! Decoding rules with exact values: hash integer forms (C05), schema drift (C06), skipped
//! events, incomplete versus malformed input, replay framings, and no panic on any bytes.

use kvmesh_core::index::{KvEvent, Removed, Stored};
use kvmesh_core::{EngineBlockHash, Medium};
use kvmesh_events::{
    decode_batch, decode_message, decode_replay_reply, replay_request, DecodeError, EventError, ReplayReply,
};
use proptest::prelude::*;
use rmpv::Value;

fn s(v: &str) -> Value {
    Value::from(v)
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn map(kv: Vec<(&str, Value)>) -> Value {
    Value::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn stored_map(hashes: Vec<Value>, parent: Value) -> Value {
    let n = hashes.len();
    map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(hashes)),
        ("parent_block_hash", parent),
        ("token_ids", Value::Array((0..4 * n as u64).map(Value::from).collect())),
        ("block_size", Value::from(4)),
    ])
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    encode(&Value::Array(vec![Value::F64(12.5), Value::Array(events), Value::from(3)]))
}

#[test]
fn c05_uint64_and_negative_int64_hashes_are_the_same_64_bits() {
    let unsigned = stored_map(vec![Value::from(u64::MAX - 1)], Value::Nil);
    let signed = stored_map(vec![Value::from(-2i64)], Value::Nil);
    let a = decode_batch(&batch(vec![unsigned])).unwrap();
    let b = decode_batch(&batch(vec![signed])).unwrap();
    assert_eq!(a.events, b.events);
    let KvEvent::Stored(st) = &a.events[0] else { panic!() };
    assert_eq!(st.block_hashes, vec![EngineBlockHash(u64::MAX - 1)]);
}

#[test]
fn c06_two_element_batch_unknown_keys_and_trailing_elements_decode() {
    // A map event with keys vLLM may add later, and a positional one with extra trailing fields.
    let mut with_extra = stored_map(vec![Value::from(7)], Value::from(6));
    if let Value::Map(kv) = &mut with_extra {
        kv.push((s("some_future_field"), Value::Array(vec![Value::Nil])));
        kv.push((s("medium"), s("CPU")));
    }
    let positional =
        Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::from(7)]), s("GPU"), Value::from(1), s("x")]);
    let cleared = Value::Array(vec![s("AllBlocksCleared"), Value::Nil]);
    let payload = encode(&Value::Array(vec![Value::from(5), Value::Array(vec![with_extra, positional, cleared])]));
    let b = decode_batch(&payload).unwrap();
    assert_eq!((b.ts, b.data_parallel_rank, b.skipped.len()), (5.0, None, 0));
    assert_eq!(
        b.events,
        vec![
            KvEvent::Stored(Stored {
                block_hashes: vec![EngineBlockHash(7)],
                parent: Some(EngineBlockHash(6)),
                token_ids: vec![0, 1, 2, 3],
                block_size: 4,
                medium: Medium::Cpu,
                lora_name: None,
                extra_keys: None,
                kv_group: None,
            }),
            // Its fourth element is vLLM's `group_idx` (since hybrid KV groups); the fifth is
            // past every field vLLM declares.
            KvEvent::Removed(Removed {
                block_hashes: vec![EngineBlockHash(7)],
                medium: Medium::Gpu,
                kv_group: Some(1)
            }),
            KvEvent::Cleared,
        ]
    );
    // A batch may also carry trailing elements after the rank.
    let longer = encode(&Value::Array(vec![Value::F64(1.0), Value::Array(vec![]), Value::Nil, s("later")]));
    assert_eq!(decode_batch(&longer).unwrap().events, vec![]);
}

#[test]
fn omitted_defaults_and_lora_forms() {
    // msgspec's omit_defaults drops trailing default fields from the positional form.
    let short = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(1)]),
        Value::Nil,
        Value::Array((0..4u64).map(Value::from).collect()),
        Value::from(4),
        Value::from(9),
    ]);
    let named = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(2)])),
        ("token_ids", Value::Array((0..4u64).map(Value::from).collect())),
        ("block_size", Value::from(4)),
        ("lora_id", Value::from(9)),
        ("lora_name", s("sql-adapter")),
    ]);
    let b = decode_batch(&batch(vec![short, named])).unwrap();
    let loras: Vec<_> = b
        .events
        .iter()
        .map(|e| match e {
            KvEvent::Stored(s) => (s.parent, s.medium, s.lora_name.clone()),
            _ => panic!(),
        })
        .collect();
    assert_eq!(
        loras,
        vec![(None, Medium::Gpu, Some("lora-id:9".to_string())), (None, Medium::Gpu, Some("sql-adapter".to_string()))]
    );
}

#[test]
fn a_bad_event_is_skipped_with_its_reason_and_the_rest_apply() {
    let events = vec![
        map(vec![("type", s("BlockUpdated"))]),
        Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::from(1)]), s("DISK")]),
        Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![s("not a hash")]),
            Value::Nil,
            Value::Array(vec![]),
            Value::from(4),
        ]),
        Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![]),
            Value::Nil,
            Value::Array(vec![Value::from(-1)]),
            Value::from(4),
        ]),
        Value::Array(vec![s("BlockStored"), Value::Array(vec![]), Value::Nil, Value::Array(vec![]), Value::from(0)]),
        Value::from(42),
        Value::Array(vec![s("AllBlocksCleared")]),
    ];
    let b = decode_batch(&batch(events)).unwrap();
    assert_eq!(b.events, vec![KvEvent::Cleared]);
    let reasons: Vec<(usize, String)> = b.skipped.iter().map(|s| (s.index, s.reason.to_string())).collect();
    // Typed, for callers that count by kind; the messages below are what operators read.
    assert_eq!(b.skipped[0].reason, EventError::UnknownType("BlockUpdated".into()));
    assert_eq!(
        b.skipped[3].reason,
        EventError::OutOfRange { field: "token id", value: "-1".into(), expected: "a u32" }
    );
    assert_eq!(
        reasons.iter().map(|(i, r)| (*i, r.as_str())).collect::<Vec<_>>(),
        vec![
            (0, "unknown event type \"BlockUpdated\""),
            (1, "unsupported medium \"DISK\" (kvmesh indexes GPU and CPU)"),
            (2, "block hash is a string, not an integer or bytes"),
            (3, "token id -1 is not a u32"),
            (4, "block_size is not a positive integer"),
            (5, "event is an integer, not a map or an array"),
        ]
    );
}

/// An event with an unknown field nested `k` arrays deep, in a batch: the batch, its events
/// and the event are 3 containers, so 13 reach the budget's 16 levels and 14 pass them.
fn nested_batch(k: usize) -> Vec<u8> {
    let deep = (0..k).fold(Value::Nil, |v, _| Value::Array(vec![v]));
    let mut event = stored_map(vec![Value::from(1u64)], Value::Nil);
    if let Value::Map(kv) = &mut event {
        kv.push((s("future_field"), deep));
    }
    batch(vec![event])
}

#[test]
fn nesting_up_to_the_budget_decodes_and_deeper_is_refused_whole() {
    let ok = decode_batch(&nested_batch(13)).unwrap();
    assert_eq!((ok.events.len(), ok.skipped.len()), (1, 0));
    assert_eq!(decode_batch(&nested_batch(14)), Err(DecodeError::Malformed("payload nests too deeply".into())));
}

#[test]
fn truncated_input_is_incomplete_and_wrong_input_is_malformed() {
    let good = batch(vec![stored_map(vec![Value::from(1), Value::from(2)], Value::Nil)]);
    for cut in 0..good.len() {
        let err = decode_batch(&good[..cut]).unwrap_err();
        assert!(err.is_incomplete(), "cut at {cut}: {err}");
    }
    let mut trailing = good.clone();
    trailing.push(0xc0);
    assert_eq!(decode_batch(&trailing), Err(DecodeError::Malformed("1 bytes after the payload".into())));
    assert_eq!(
        decode_batch(&encode(&Value::from("x"))),
        Err(DecodeError::Malformed("payload is a string, not an array [ts, events, rank]".into()))
    );
    assert_eq!(
        decode_batch(&encode(&Value::Array(vec![Value::F64(1.0)]))),
        Err(DecodeError::Malformed("payload has 1 elements, not [ts, events, rank?]".into()))
    );
    // 100,000 nested arrays: refused, no stack overflow.
    let deep = vec![0x91u8; 100_000];
    assert_eq!(decode_batch(&deep), Err(DecodeError::Malformed("payload nests too deeply".into())));
    // A claimed 2^32-element array with no elements: incomplete, nothing preallocated.
    assert!(decode_batch(&[0xdc, 0x00, 0x05]).unwrap_err().is_incomplete());
    // A claim no budget allows is refused at its header, before any allocation.
    assert_eq!(decode_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff]).unwrap_err().kind(), "over_budget");
}

#[test]
fn message_frames() {
    let payload = batch(vec![]);
    let msg = decode_message(&[b"topic".to_vec(), 9u64.to_be_bytes().to_vec(), payload.clone()]).unwrap();
    assert_eq!((msg.topic.as_slice(), msg.seq, msg.batch.data_parallel_rank), (&b"topic"[..], 9, Some(3)));
    assert_eq!(
        decode_message(std::slice::from_ref(&payload)),
        Err(DecodeError::Malformed("1 frames, expected 3: [topic, seq, payload]".into()))
    );
    assert_eq!(
        decode_message(&[vec![], vec![1, 2], payload]),
        Err(DecodeError::Malformed("sequence frame is 2 bytes, expected 8".into()))
    );
}

#[test]
fn replay_request_and_both_reply_framings() {
    assert_eq!(replay_request(3), [vec![], vec![0, 0, 0, 0, 0, 0, 0, 3]]);
    let payload = batch(vec![Value::Array(vec![s("AllBlocksCleared")])]);
    let seq = 4u64.to_be_bytes().to_vec();
    let newer = [vec![], b"kv".to_vec(), seq.clone(), payload.clone()];
    let older = [vec![], seq.clone(), payload.clone()];
    let bare = [seq.clone(), payload];
    for frames in [&newer[..], &older[..], &bare[..]] {
        match decode_replay_reply(frames).unwrap() {
            ReplayReply::Message { seq, batch } => assert_eq!((seq, batch.events), (4, vec![KvEvent::Cleared])),
            ReplayReply::End => panic!("not the end"),
        }
    }
    let end_seq = (-1i64).to_be_bytes().to_vec();
    assert_eq!(decode_replay_reply(&[vec![], b"kv".to_vec(), end_seq.clone(), vec![]]), Ok(ReplayReply::End));
    assert_eq!(decode_replay_reply(&[vec![], end_seq, vec![]]), Ok(ReplayReply::End));
    assert!(decode_replay_reply(&[vec![]]).is_err());
}

proptest! {
    /// No input panics the decoder: random bytes, and valid messages with bytes flipped or cut.
    #[test]
    fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512), flip in any::<(u16, u8)>(), cut in any::<u16>()) {
        let _ = decode_batch(&bytes);
        let _ = decode_message(&[bytes.clone(), bytes.clone(), bytes.clone()]);
        let _ = decode_replay_reply(&[bytes.clone(), bytes.clone()]);
        let mut good = batch(vec![stored_map(vec![Value::from(1), Value::from(-5)], Value::from(u64::MAX))]);
        let i = flip.0 as usize % good.len();
        good[i] ^= flip.1;
        let _ = decode_batch(&good);
        let _ = decode_batch(&good[..cut as usize % (good.len() + 1)]);
    }
}

/// A `BlockStored` with every field vLLM's current `kv_events.py` declares (`lora_id`,
/// `medium`, `lora_name`, `extra_keys`, `group_idx`, `kv_cache_spec_kind`,
/// `kv_cache_spec_sliding_window`), in a map-encoded batch with its `data_parallel_rank`.
#[test]
fn every_current_block_stored_field_decodes() {
    let keys = |v: Vec<Value>| Value::Array(v);
    let event = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(11u64), Value::from(12u64), Value::from(13u64)])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", Value::Array((0..12u64).map(Value::from).collect())),
        ("block_size", Value::from(4)),
        ("lora_id", Value::from(1)),
        ("medium", s("GPU")),
        ("lora_name", s("sql")),
        (
            "extra_keys",
            Value::Array(vec![
                // Block 0: the adapter, then the request's cache_salt.
                keys(vec![s("sql"), s("tenant-7")]),
                // Block 1: the adapter and an image (identifier, offset in the block).
                keys(vec![s("sql"), keys(vec![s("mm-hash-abc"), Value::from(2)])]),
                // Block 2: the adapter only.
                keys(vec![s("sql")]),
            ]),
        ),
        ("group_idx", Value::from(0)),
        ("kv_cache_spec_kind", s("full_attention")),
        ("kv_cache_spec_sliding_window", Value::Nil),
    ]);
    let payload = encode(&map(vec![
        ("ts", Value::F64(7.5)),
        ("events", Value::Array(vec![event])),
        ("data_parallel_rank", Value::from(1)),
    ]));
    let b = decode_batch(&payload).unwrap();
    assert_eq!((b.ts, b.data_parallel_rank, b.skipped.len()), (7.5, Some(1), 0));
    let KvEvent::Stored(st) = &b.events[0] else { panic!("{:?}", b.events) };
    assert_eq!(st.lora_name.as_deref(), Some("sql"));
    assert_eq!(
        st.kv_group,
        Some(kvmesh_core::index::KvGroup { idx: 0, kind: Some("full_attention".into()), sliding_window: None })
    );
    let extra = st.extra_keys.as_ref().unwrap();
    assert_eq!(extra.cache_salt.as_deref(), Some("tenant-7"));
    assert_eq!(extra.unverifiable.len(), 3);
    assert_eq!((extra.unverifiable[0], extra.unverifiable[2]), (0, 0), "{extra:?}");
    assert_ne!(extra.unverifiable[1], 0);
    // The same image at another offset is another block.
    let other = |offset: i64| {
        let e = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", Value::Array(vec![Value::from(21u64)])),
            ("parent_block_hash", Value::from(20u64)),
            ("token_ids", Value::Array((0..4u64).map(Value::from).collect())),
            ("block_size", Value::from(4)),
            ("extra_keys", Value::Array(vec![keys(vec![keys(vec![s("mm-hash-abc"), Value::from(offset)])])])),
        ]);
        let KvEvent::Stored(st) = decode_batch(&batch(vec![e])).unwrap().events.remove(0) else { panic!() };
        st.extra_keys.unwrap()
    };
    assert_ne!(other(0).unverifiable, other(1).unverifiable);
    // A string on a continuation's block is no salt (vLLM salts a sequence's first block only).
    assert_eq!(other(0).cache_salt, None);
    // Extra keys of nils, or of the adapter alone, are no extra keys.
    let plain = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(31u64), Value::from(32u64)])),
        ("token_ids", Value::Array((0..8u64).map(Value::from).collect())),
        ("block_size", Value::from(4)),
        ("lora_name", s("sql")),
        ("extra_keys", Value::Array(vec![Value::Nil, keys(vec![s("sql")])])),
    ]);
    let KvEvent::Stored(st) = decode_batch(&batch(vec![plain])).unwrap().events.remove(0) else { panic!() };
    assert_eq!(st.extra_keys, None);
    let bad = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(41u64)])),
        ("token_ids", Value::Array((0..4u64).map(Value::from).collect())),
        ("block_size", Value::from(4)),
        ("extra_keys", s("x")),
    ]);
    assert_eq!(
        decode_batch(&batch(vec![bad])).unwrap().skipped[0].reason.to_string(),
        "extra_keys is a string, not an array"
    );
    let short = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(41u64), Value::from(42u64)])),
        ("token_ids", Value::Array((0..8u64).map(Value::from).collect())),
        ("block_size", Value::from(4)),
        ("extra_keys", Value::Array(vec![Value::Nil])),
    ]);
    assert_eq!(
        decode_batch(&batch(vec![short])).unwrap().skipped[0].reason.to_string(),
        "extra_keys has 1 entries for 2 blocks"
    );
    // A hybrid model's sliding-window group, and a removal naming its group (positional form).
    let window = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(51u64)])),
        ("token_ids", Value::Array((0..4u64).map(Value::from).collect())),
        ("block_size", Value::from(4)),
        ("group_idx", Value::from(1)),
        ("kv_cache_spec_kind", s("sliding_window")),
        ("kv_cache_spec_sliding_window", Value::from(4096)),
    ]);
    let removed =
        Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::from(51u64)]), s("GPU"), Value::from(1)]);
    let events = decode_batch(&batch(vec![window, removed])).unwrap().events;
    let KvEvent::Stored(st) = &events[0] else { panic!() };
    let group = kvmesh_core::index::KvGroup { idx: 1, kind: Some("sliding_window".into()), sliding_window: Some(4096) };
    assert_eq!(st.kv_group, Some(group));
    assert!(!st.kv_group.as_ref().unwrap().covers_whole_prefix());
    assert_eq!(st.kv_group.as_ref().unwrap().window(), Some(4096));
    let KvEvent::Removed(r) = &events[1] else { panic!() };
    assert_eq!(r.kv_group, Some(1));
}

#[test]
fn a_rank_past_i64_reads_as_a_rank_no_replica_has() {
    let batch = |rank: Value| encode(&Value::Array(vec![Value::from(5), Value::Array(vec![]), rank]));
    let rank = |v: Value| decode_batch(&batch(v)).unwrap().data_parallel_rank;
    assert_eq!(rank(Value::from(3u64)), Some(3));
    assert_eq!(rank(Value::from(i64::MAX as u64)), Some(i64::MAX));
    // It read as no rank, which a replica of any rank took.
    assert_eq!(rank(Value::from(u64::MAX)), Some(i64::MAX));
    assert_eq!(rank(Value::from(-1)), Some(-1));
    assert_eq!(rank(Value::Nil), None);
}
