//! Case C01: messages produced by vLLM's own event classes, in both encodings, decode and
//! apply to the overlaps vLLM's steps imply.

use kvmesh_core::hashing::Namespace;
use kvmesh_core::{BlockHasher, PrefixIndex, ReplicaId};
use kvmesh_events::decode_message;
use serde_json::Value;
use std::path::Path;

fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vllm_events").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

fn tokens(expected: &Value, request: &str) -> Vec<u32> {
    expected["requests"][request].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// Applies every message of `file` to one replica and returns (A, B) overlaps after each.
fn overlaps_after_each(file: &str, expected: &Value) -> Vec<(u32, u32)> {
    let hasher = BlockHasher::new(expected["block_size"].as_u64().unwrap() as u32, &Namespace::default()).unwrap();
    let mut index = PrefixIndex::new(hasher);
    let replica = ReplicaId(0);
    let (a, b) = (hasher.hash_blocks(&tokens(expected, "A")), hasher.hash_blocks(&tokens(expected, "B")));
    let mut seen = Vec::new();
    for (n, line) in fixture(file).lines().enumerate() {
        let line: Value = serde_json::from_str(line).unwrap();
        let frames: Vec<Vec<u8>> =
            line["frames_hex"].as_array().unwrap().iter().map(|f| unhex(f.as_str().unwrap())).collect();
        let msg = decode_message(&frames).unwrap_or_else(|e| panic!("{file} message {n}: {e}"));
        assert_eq!(msg.seq, n as u64, "{file}: sequence numbers count from 0");
        assert_eq!(msg.topic, b"kv-events");
        assert!(msg.batch.skipped.is_empty(), "{file} message {n}: {:?}", msg.batch.skipped);
        for event in &msg.batch.events {
            let outcome = index.apply(replica, event);
            assert_eq!(outcome.rejection, None, "{file} message {n}: {event:?}");
        }
        let run = |hashes: &[kvmesh_core::BlockHash]| {
            let mut out = Vec::new();
            index.overlaps(hashes, &mut out);
            out.first().map_or(0, |(_, o)| o.gpu)
        };
        seen.push((run(&a), run(&b)));
    }
    seen
}

fn expected() -> (Value, Vec<(u32, u32)>) {
    let expected: Value = serde_json::from_str(&fixture("steps-expected.json")).unwrap();
    let steps = expected["expected_overlap_blocks_after_each_message"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["A"].as_u64().unwrap() as u32, s["B"].as_u64().unwrap() as u32))
        .collect();
    (expected, steps)
}

#[test]
fn c01_map_tagged_encoding_vllm_0_33() {
    let (expected, steps) = expected();
    assert_eq!(steps, vec![(4, 2), (4, 4), (2, 4), (0, 0)]);
    assert_eq!(overlaps_after_each("vllm-0.33.0-steps.jsonl", &expected), steps);
}

#[test]
fn c01_positional_encoding_vllm_0_23() {
    let (expected, steps) = expected();
    assert_eq!(overlaps_after_each("vllm-0.23.0-steps.jsonl", &expected), steps);
}

#[test]
fn c01_both_encodings_carry_the_same_events() {
    let decode_all = |file: &str| -> Vec<_> {
        fixture(file)
            .lines()
            .map(|l| {
                let l: Value = serde_json::from_str(l).unwrap();
                let frames: Vec<Vec<u8>> =
                    l["frames_hex"].as_array().unwrap().iter().map(|f| unhex(f.as_str().unwrap())).collect();
                decode_message(&frames).unwrap().batch
            })
            .collect()
    };
    let (new, old) = (decode_all("vllm-0.33.0-steps.jsonl"), decode_all("vllm-0.23.0-steps.jsonl"));
    assert_eq!(new, old);
    // The real sha256_cbor ids, ≥ 2^63 included, survive as the same 64 bits.
    let ids = expected().0["vllm_block_hashes_u64"]["A"].clone();
    let kvmesh_core::index::KvEvent::Stored(first) = &new[0].events[0] else { panic!("first event is a store") };
    let got: Vec<u64> = first.block_hashes.iter().map(|h| h.0).collect();
    let want: Vec<u64> = ids.as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(got, want);
    assert!(got.iter().any(|&h| h >= 1 << 63));
    assert_eq!((new[0].ts, new[0].data_parallel_rank), (1_700_000_000.0, Some(0)));
}
