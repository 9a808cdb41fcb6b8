//! Decoding rules with exact values: hash integer forms (C05), schema drift (C06), skipped
//! events, incomplete versus malformed input, replay framings, and no panic on any bytes.

use kvmesh_core::index::{KvEvent, Removed, Stored};
use kvmesh_core::{EngineBlockHash, Medium};
use kvmesh_events::{decode_batch, decode_message, decode_replay_reply, replay_request, DecodeError, ReplayReply};
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
            }),
            KvEvent::Removed(Removed { block_hashes: vec![EngineBlockHash(7)], medium: Medium::Gpu }),
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
    let reasons: Vec<(usize, &str)> = b.skipped.iter().map(|s| (s.index, s.reason.as_str())).collect();
    assert_eq!(
        reasons,
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
