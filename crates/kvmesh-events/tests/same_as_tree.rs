//! The in-place decoder against the tree decoder it replaced (`tree/`, kept as an oracle): on
//! generated batches — both encodings, every field with right and wrong types, unknown and
//! repeated keys, keys that are not strings, strings that are not UTF-8, values nested past the
//! budget's limit — written in every encoding msgpack allows, and on the same bytes cut short or
//! with bytes changed, both give the same events, the same skipped events and reasons, and the
//! same errors.

mod tree;
mod wide;

use kvmesh_events::{decode_batch_with, DecodeLimits};
use proptest::prelude::*;
use rmpv::Value;

const FIELDS: [&str; 12] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "unknown_field",
];

const TAGS: [&str; 5] = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockMoved", "type"];

/// A msgpack string that is not UTF-8.
fn not_utf8() -> Value {
    rmpv::decode::read_value(&mut &[0xa2, 0xff, 0xfe][..]).unwrap()
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(not_utf8()),
        Just(Value::Nil),
        any::<bool>().prop_map(Value::from),
        (0u64..40).prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-40i64..0).prop_map(Value::from),
        Just(Value::from(u32::MAX)),
        Just(Value::from(u64::from(u32::MAX) + 1)),
        any::<f64>().prop_map(Value::F64),
        any::<f32>().prop_map(Value::F32),
        prop::sample::select(vec!["GPU", "cpu", "disk", "", "lora-a", "salt", "full_attention", "BlockStored"])
            .prop_map(Value::from),
        prop::collection::vec(any::<u8>(), 0..6).prop_map(Value::Binary),
        (any::<i8>(), prop::collection::vec(any::<u8>(), 0..3)).prop_map(|(t, d)| Value::Ext(t, d)),
    ]
}

/// A field's value: a scalar, or an array (mostly integers, as hashes and token ids are) that
/// may hold arrays (as `extra_keys` does), or a small map.
fn field_value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(2, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(prop_oneof![4 => (0u64..1 << 33).prop_map(Value::from), 1 => inner.clone()], 0..6)
                .prop_map(Value::Array),
            prop::collection::vec((inner.clone(), inner), 0..3).prop_map(Value::Map),
        ]
    })
}

fn event() -> impl Strategy<Value = Value> {
    let tag = prop_oneof![4 => prop::sample::select(TAGS.to_vec()).prop_map(Value::from), 1 => scalar()];
    // A field's value, or the same wrapped in arrays up to the budget's nesting limit and past it.
    let nested = (field_value(), 0usize..18).prop_map(|(v, depth)| (0..depth).fold(v, |v, _| Value::Array(vec![v])));
    let fields = prop::collection::vec(
        (prop::sample::select(FIELDS.to_vec()).prop_map(Value::from), prop_oneof![6 => field_value(), 1 => nested]),
        0..8,
    );
    // Keys that are not strings: an integer, an array.
    let odd_key = prop_oneof![Just(Value::from(3)), Just(Value::Array(vec![Value::from("block_hashes")]))];
    prop_oneof![
        // Map form: the tag somewhere among the fields, sometimes twice or not at all.
        (tag.clone(), fields, 0usize..10, any::<bool>(), prop::option::of((odd_key, field_value()))).prop_map(
            |(tag, mut kv, at, twice, odd)| {
                kv.extend(odd);
                if at < 9 {
                    kv.insert(at.min(kv.len()), (Value::from("type"), tag.clone()));
                }
                if twice {
                    kv.push((Value::from("type"), Value::from("BlockRemoved")));
                }
                Value::Map(kv)
            }
        ),
        // Array form: the tag, then values by position.
        (tag, prop::collection::vec(field_value(), 0..13))
            .prop_map(|(tag, rest)| { Value::Array(std::iter::once(tag).chain(rest).collect()) }),
        scalar(),
    ]
}

/// One block's `extra_keys` entry as vLLM sends them: nothing, the LoRA name, a salt, a
/// multimodal key.
fn extra_key() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Nil),
        Just(Value::Array(vec![Value::from("lora-a")])),
        Just(Value::Array(vec![Value::from("lora-a"), Value::from("salt")])),
        Just(Value::Array(vec![Value::Array(vec![Value::from("mm"), Value::from(3), Value::from(0)])])),
        Just(Value::from(5)),
    ]
}

fn well_formed_stored() -> impl Strategy<Value = Value> {
    let extra = prop::option::of(prop::collection::vec(extra_key(), 4));
    (1usize..5, any::<bool>(), any::<bool>(), extra).prop_map(|(n, map, parent, extra)| {
        let hashes = Value::Array((0..n as u64).map(|h| Value::from(h.wrapping_mul(0x9e37_79b9_7f4a_7c15))).collect());
        let tokens = Value::Array((0..16 * n as u64).map(Value::from).collect());
        let parent = if parent { Value::from(7u64) } else { Value::Nil };
        let (lora, extra) = match extra {
            Some(keys) => (Value::from("lora-a"), Value::Array(keys.into_iter().take(n).collect())),
            None => (Value::Nil, Value::Nil),
        };
        let values = [hashes, parent, tokens, Value::from(16), Value::Nil, Value::from("GPU"), lora, extra];
        if map {
            Value::Map(
                std::iter::once((Value::from("type"), Value::from("BlockStored")))
                    .chain(FIELDS.iter().zip(values).map(|(k, v)| (Value::from(*k), v)))
                    .collect(),
            )
        } else {
            Value::Array(std::iter::once(Value::from("BlockStored")).chain(values).collect())
        }
    })
}

fn batch() -> impl Strategy<Value = Value> {
    let events = prop::collection::vec(prop_oneof![2 => event(), 1 => well_formed_stored()], 0..5);
    let ts = prop_oneof![4 => any::<f64>().prop_map(Value::F64), 1 => scalar()];
    let rank = prop_oneof![Just(None), scalar().prop_map(Some)];
    prop_oneof![
        (ts.clone(), events.clone(), rank.clone(), any::<bool>()).prop_map(|(ts, events, rank, trailing)| {
            let mut fields = vec![ts, Value::Array(events)];
            fields.extend(rank);
            if trailing {
                fields.push(Value::from("more"));
            }
            Value::Array(fields)
        }),
        (ts, events, rank, any::<u8>()).prop_map(|(ts, events, rank, drop)| {
            let mut kv = vec![(Value::from("ts"), ts), (Value::from("events"), Value::Array(events))];
            if let Some(r) = rank {
                kv.push((Value::from("data_parallel_rank"), r));
            }
            kv.push((Value::from(1), Value::from("key not a string")));
            if drop % 5 == 0 {
                kv.remove(usize::from(drop / 5) % 2);
            }
            // A repeated key: the last one counts.
            match drop % 7 {
                1 => kv.push((Value::from("ts"), Value::F64(2.5))),
                2 => kv.push((Value::from("events"), Value::Array(vec![]))),
                3 => kv.push((Value::from("events"), Value::Nil)),
                _ => {}
            }
            Value::Map(kv)
        }),
        (scalar(), prop::collection::vec(scalar(), 0..2))
            .prop_map(|(a, b)| { Value::Array(std::iter::once(a).chain(b).collect()) }),
    ]
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// Both decoders' answers, as text (a NaN timestamp is equal to itself there).
fn both(bytes: &[u8]) -> (String, String) {
    let limits = DecodeLimits::default();
    (
        format!("{:?}", decode_batch_with(bytes, &limits)),
        format!("{:?}", tree::batch::decode_batch_with(bytes, &limits)),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn generated_batches_decode_as_the_tree_did(b in batch()) {
        let bytes = encode(&b);
        let (in_place, tree) = both(&bytes);
        prop_assert_eq!(in_place, tree);
    }

    #[test]
    fn every_encoding_of_a_batch_decodes_as_the_tree_did(b in batch(), pick in prop::collection::vec(any::<u8>(), 1..64)) {
        let bytes = wide::encode(&b, &pick);
        // The wide encoding is the same value: rmpv reads it back equal.
        prop_assert_eq!(&rmpv::decode::read_value(&mut &bytes[..]).unwrap(), &b);
        let (in_place, tree) = both(&bytes);
        prop_assert_eq!(in_place, tree);
    }

    #[test]
    fn changed_and_cut_bytes_decode_as_the_tree_did(
        b in batch(),
        changes in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let mut bytes = encode(&b);
        for (at, byte) in changes {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        if do_cut {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        let (in_place, tree) = both(&bytes);
        prop_assert_eq!(in_place, tree);
    }
}

#[test]
fn the_vllm_fixtures_decode_as_the_tree_did() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vllm_events");
    let unhex = |s: &str| -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
    };
    let mut payloads = 0;
    for file in ["vllm-0.23.0-steps.jsonl", "vllm-0.33.0-steps.jsonl"] {
        for line in std::fs::read_to_string(dir.join(file)).unwrap().lines() {
            let line: serde_json::Value = serde_json::from_str(line).unwrap();
            let frames = line["frames_hex"].as_array().unwrap();
            let payload = unhex(frames.last().unwrap().as_str().unwrap());
            let (in_place, tree) = both(&payload);
            assert!(in_place.starts_with("Ok("), "{file}: {in_place}");
            assert_eq!(in_place, tree, "{file}");
            payloads += 1;
        }
    }
    assert!(payloads >= 4, "{payloads} fixture payloads");
}
