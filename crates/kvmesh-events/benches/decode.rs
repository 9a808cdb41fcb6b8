//! Decoding vLLM KV-event payloads: `cargo bench -p kvmesh-events --bench decode`.
//!
//! Two batch shapes a busy vLLM engine publishes (one batch per scheduler step,
//! vllm/distributed/kv_events.py): a prefill step (one `BlockStored` of 32 blocks, 512 token
//! ids, and a `BlockRemoved` of the 8 blocks the free queue evicted) and a decode step (one
//! `BlockStored` of 1 block). Each in vLLM ≥ 0.34's map encoding and the older array encoding,
//! 1,024 distinct payloads per cell, each decoded once per pass (no payload twice in a row).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvmesh_core::index::{KvEvent, Removed, Stored};
use kvmesh_core::{EngineBlockHash, Medium};
use kvmesh_events::decode_batch;
use kvmesh_events::encode::{encode_batch, encode_map_batch, Encoding};

const PAYLOADS: usize = 1024;

fn stored(seed: u64, blocks: u64) -> KvEvent {
    let h = |k: u64| EngineBlockHash((seed * 1_000 + k).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    KvEvent::Stored(Stored {
        block_hashes: (0..blocks).map(h).collect(),
        parent: Some(h(1_000)),
        token_ids: (0..16 * blocks).map(|t| ((seed * 7_919 + t * 31) % 151_000) as u32).collect(),
        block_size: 16,
        medium: Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        kv_group: None,
    })
}

fn removed(seed: u64, blocks: u64) -> KvEvent {
    let block_hashes =
        (0..blocks).map(|k| EngineBlockHash((seed * 31 + k).wrapping_mul(0xd6e8_feb8_6659_fd93))).collect();
    KvEvent::Removed(Removed { block_hashes, medium: Medium::Gpu, kv_group: None })
}

fn payloads(prefill: bool, map: bool) -> Vec<Vec<u8>> {
    (0..PAYLOADS as u64)
        .map(|seed| {
            let events = if prefill { vec![stored(seed, 32), removed(seed, 8)] } else { vec![stored(seed, 1)] };
            let ts = 1.7e9 + seed as f64 * 0.04;
            if map {
                encode_map_batch(ts, &events, Some(0))
            } else {
                encode_batch(ts, &events, Some(0), Encoding::Array)
            }
        })
        .collect()
}

fn bench_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_batch");
    for (step, prefill) in [("prefill_step", true), ("decode_step", false)] {
        for (encoding, map) in [("map", true), ("array", false)] {
            let payloads = payloads(prefill, map);
            group.throughput(Throughput::Elements(1));
            let mut next = 0;
            group.bench_function(BenchmarkId::new(step, encoding), |b| {
                b.iter(|| {
                    next = (next + 1) % PAYLOADS;
                    decode_batch(&payloads[next]).expect("a well-formed payload")
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
