//! kvmesh-core benchmarks: routing decision latency, event apply throughput, index memory.
//!
//! `cargo bench -p kvmesh-core` runs the criterion groups, then prints the per-decision
//! p50/p99 (single-threaded loop of timed decisions) and the index memory per
//! (block, replica) entry, both as the estimate the index reports and as heap bytes actually
//! allocated (a counting global allocator).
//!
//! Fleet shape for the decision benchmark, chosen to look like a chat fleet: 64 shared system
//! prompts of 64 blocks (1,024 tokens); each replica holds 8 of them plus unique conversation
//! blocks up to 1,048,576 (block, replica) entries in total. The request is 4,096 tokens
//! (256 blocks): a shared system prompt, then 128 blocks of a conversation one replica holds,
//! then 64 new blocks — so the index walk narrows from ~N/8 replicas to one, then stops.

use criterion::{BenchmarkId, Criterion, Throughput};
use kvmesh_core::index::{KvEvent, Removed, Stored};
use kvmesh_core::{
    EngineBlockHash, Fleet, FleetConfig, Medium, PolicyKind, PrefixIndex, ReplicaId, ReplicaSpec, RouteRequest,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

struct Counting;
static ALLOCATED: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(l.size() as isize, Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        ALLOCATED.fetch_sub(l.size() as isize, Ordering::Relaxed);
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        System.realloc(p, l, new)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BS: u32 = 16;
const ENTRIES: usize = 1 << 20;
const SYSTEM_PROMPTS: usize = 64;
const SYSTEM_BLOCKS: usize = 64;

fn system_prompt(k: usize) -> Vec<u32> {
    (0..SYSTEM_BLOCKS as u32 * BS).map(|t| (k as u32) << 20 | t).collect()
}

fn conversation(replica: usize, conv: usize, blocks: usize) -> Vec<u32> {
    (0..(blocks as u32 * BS))
        .map(|t| 0x8000_0000 | (replica as u32) << 19 ^ (conv as u32) << 12 ^ t.wrapping_mul(2654435761))
        .collect()
}

fn stored(ids: &mut u64, tokens: &[u32]) -> KvEvent {
    let n = tokens.len() / BS as usize;
    let block_hashes: Vec<EngineBlockHash> = (0..n).map(|i| EngineBlockHash(*ids + i as u64)).collect();
    *ids += n as u64;
    KvEvent::Stored(Stored {
        block_hashes,
        parent: None,
        token_ids: tokens.to_vec(),
        block_size: BS,
        medium: Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        kv_group: None,
    })
}

/// A fleet of `n` replicas whose index holds ~1M entries, and the 4,096-token request.
fn fleet(n: usize) -> (Fleet, Vec<u32>) {
    let mut f = Fleet::new(FleetConfig::default()).unwrap();
    let mut rng = SmallRng::seed_from_u64(7);
    let mut ids = 1u64;
    let per_replica = ENTRIES / n;
    let convo_blocks = 192usize;
    let mut request = Vec::new();
    for r in 0..n {
        let id = f.add_replica(ReplicaSpec::new(format!("vllm-{r}"), 2 * per_replica as u64 + 4096)).unwrap();
        let mut held = 0;
        for k in 0..8 {
            // Every 8th replica holds system prompt 0, the one the request starts with.
            let sp = system_prompt(if r % 8 == 0 && k == 0 { 0 } else { rng.random_range(1..SYSTEM_PROMPTS) });
            let ev = stored(&mut ids, &sp);
            f.apply_event(id, &ev, 0.0).unwrap();
            held += SYSTEM_BLOCKS;
        }
        let mut conv = 0;
        while held < per_replica {
            let blocks = convo_blocks.min(per_replica - held).max(1);
            let toks = conversation(r, conv, blocks);
            let ev = stored(&mut ids, &toks);
            f.apply_event(id, &ev, 0.0).unwrap();
            if r == n / 2 && conv == 0 {
                request = toks;
            }
            held += blocks;
            conv += 1;
        }
    }
    // The request: system prompt 0 (held by every 8th replica), then 128 blocks of replica
    // n/2's first conversation, then 64 new blocks. Replica n/2 holds that exact chain (a
    // previous turn), so the walk goes 192 blocks deep there.
    let mut req = system_prompt(0);
    req.extend_from_slice(&request[..128 * BS as usize]);
    let target = ReplicaId((n / 2) as u32);
    let ev = stored(&mut ids, &req);
    f.apply_event(target, &ev, 0.0).unwrap();
    req.extend((0..64 * BS).map(|t| 0xFFF0_0000 | t));
    assert_eq!(req.len(), 4096);
    (f, req)
}

/// One request decided over and over: a profiling aid, not a decision latency (a router
/// decides each request once; BENCHMARKS.md reports `vs-dynamo`'s fresh decisions instead).
fn bench_decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("route_decision_4096_tokens");
    for n in [16usize, 128, 1024] {
        let (mut f, tokens) = fleet(n);
        let mut policy = PolicyKind::TokenLoad.build();
        let mut rng = SmallRng::seed_from_u64(1);
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                let req = RouteRequest::new(f.hasher(), black_box(&tokens), Some(256));
                f.decide(policy.as_mut(), &req, &mut rng, 1.0).unwrap()
            })
        });
    }
    g.finish();
}

/// The decision's parts at 128 replicas: hashing alone, and the index walk alone.
fn bench_parts(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision_parts_128_replicas");
    let (f, tokens) = fleet(128);
    g.bench_function("hash_4096_tokens", |b| b.iter(|| f.hasher().hash_blocks(black_box(&tokens))));
    let hashes = f.hasher().hash_blocks(&tokens);
    let mut out = Vec::new();
    g.bench_function("index_overlaps_256_blocks", |b| {
        b.iter(|| {
            out.clear();
            f.index().overlaps(black_box(&hashes), &mut out);
            out.len()
        })
    });
    g.finish();
}

fn bench_apply(c: &mut Criterion) {
    let mut g = c.benchmark_group("event_apply");
    let hasher = kvmesh_core::BlockHasher::new(BS, &Default::default()).unwrap();
    let mut ix = PrefixIndex::new(hasher);
    // Steady state: 64 replicas, each event stores 16 blocks and a later one removes them.
    let mut ids = 1u64;
    let events: Vec<(ReplicaId, KvEvent, KvEvent)> = (0..4096usize)
        .map(|i| {
            let toks = conversation(i % 64, i, 16);
            let ev = stored(&mut ids, &toks);
            let KvEvent::Stored(s) = &ev else { unreachable!() };
            let rm =
                KvEvent::Removed(Removed { block_hashes: s.block_hashes.clone(), medium: Medium::Gpu, kv_group: None });
            (ReplicaId((i % 64) as u32), ev, rm)
        })
        .collect();
    g.throughput(Throughput::Elements(4096 * 16));
    g.bench_function("store_then_remove_16_block_events", |b| {
        b.iter(|| {
            for (r, ev, _) in &events {
                ix.apply(*r, ev);
            }
            for (r, _, rm) in &events {
                ix.apply(*r, rm);
            }
        })
    });
    g.finish();
}

/// Replication: counting one routed 4,096-token request in the hot-prefix sketch (on every
/// decision when `[replication]` is on), and one leader planning round at 128 replicas.
fn bench_replication(c: &mut Criterion) {
    use kvmesh_core::replication::{plan_round, PrefixSketch, ReplicationConfig, ReplicationPlan, SketchConfig};
    let mut g = c.benchmark_group("replication");
    let (f, tokens) = fleet(128);
    let hashes = f.hasher().hash_blocks(&tokens);
    // A sketch in steady state: full of other prompts' prefixes, this one recurring.
    let mut sketch = PrefixSketch::new(SketchConfig::default(), BS);
    for i in 0..4096u32 {
        let other: Vec<u32> = (0..1024).map(|t| i.wrapping_mul(7919) ^ (t << 12)).collect();
        sketch.observe(i as f64 * 0.001, &f.hasher().hash_blocks(&other), Some(&other), 1000.0);
        sketch.observe(i as f64 * 0.001, &hashes, Some(&tokens), 1000.0);
    }
    let mut t = 4.096;
    g.bench_function("sketch_observe_4096_tokens", |b| {
        b.iter(|| {
            t += 1e-4;
            sketch.observe(t, black_box(&hashes), Some(&tokens), 1000.0)
        })
    });
    let report = sketch.report(t, 16);
    let config = ReplicationConfig::default();
    g.bench_function("plan_round_128_replicas", |b| {
        b.iter(|| plan_round(&config, t, black_box(&report), &f, &ReplicationPlan::default()))
    });
    g.finish();
}

/// The routing record's pending-prefix query (`token_load` asks it on every decision) at
/// 1,024 replicas with hot prefixes: 8 system prompts of 32 blocks routed to every replica
/// within the last second, each with a 64-block conversation of its own, and 1,024 distinct
/// requests (a system prompt and a new conversation) asked in turn, each once per pass.
fn bench_record(c: &mut Criterion) {
    use kvmesh_core::{BlockHash, RoutingRecord};
    let mut g = c.benchmark_group("routing_record");
    const REPLICAS: u32 = 1024;
    let prompt = |system: u64, conv: u64| -> Vec<BlockHash> {
        (0..96u64).map(|i| BlockHash(if i < 32 { system << 32 | i } else { 1 << 63 | conv << 16 | i })).collect()
    };
    let mut rec = RoutingRecord::new(120.0, 1 << 22);
    for k in 0..8 * REPLICAS as u64 {
        let r = (k % REPLICAS as u64) as u32;
        rec.record(ReplicaId(r), &prompt(k / REPLICAS as u64, k), 9.0 + k as f64 / (8 * REPLICAS) as f64);
    }
    let queries: Vec<Vec<BlockHash>> = (0..1024u64).map(|q| prompt(q % 8, 1 << 20 | q)).collect();
    // Windows of 2 s plus a queue delay of 0–3 s. Asked at 10 s every entry is younger than
    // the 2 s floor; at 12 s every one is older, so each replica's window is asked.
    let windows: Vec<f64> = (0..REPLICAS).map(|r| 2.0 + f64::from(r % 4)).collect();
    let mut out = Vec::new();
    for (name, now) in [("pending_overlaps_1024_replicas_hot_prefix", 10.0), ("past_the_floor", 12.0)] {
        let mut q = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                q = (q + 1) % queries.len();
                out.clear();
                rec.overlaps_within(black_box(&queries[q]), now, 2.0, |r| windows[r.index()], &mut out);
                out.len()
            })
        });
    }
    g.finish();
}

/// Timed single decisions: p50 and p99 in microseconds.
// A benchmark measures wall time; the crate itself never reads a clock (clippy.toml).
#[allow(clippy::disallowed_methods)]
fn report_percentiles() {
    println!("\nper-decision latency (token_load, hash + index query + score, 20,000 decisions of one request — for profiling; fresh requests: vs-dynamo --decision-only):");
    for n in [16usize, 128, 1024] {
        let (mut f, tokens) = fleet(n);
        let mut policy = PolicyKind::TokenLoad.build();
        let mut rng = SmallRng::seed_from_u64(1);
        let mut ns: Vec<u64> = (0..20_000)
            .map(|_| {
                let t = Instant::now();
                let req = RouteRequest::new(f.hasher(), black_box(&tokens), Some(256));
                black_box(f.decide(policy.as_mut(), &req, &mut rng, 1.0).unwrap());
                t.elapsed().as_nanos() as u64
            })
            .collect();
        ns.sort_unstable();
        let p = |q: f64| ns[((ns.len() as f64 * q) as usize).min(ns.len() - 1)] as f64 / 1000.0;
        println!(
            "  {n:>5} replicas: p50 {:.2} µs, p99 {:.2} µs (index {} entries)",
            p(0.5),
            p(0.99),
            f.index().entries()
        );
    }
}

/// Index memory per (block, replica) entry at ~1M entries.
fn report_memory() {
    println!("\nindex memory at ~1M (block, replica) entries:");
    for n in [16usize, 128, 1024] {
        let before = ALLOCATED.load(Ordering::Relaxed);
        let (f, _) = fleet(n);
        let after = ALLOCATED.load(Ordering::Relaxed);
        let entries = f.index().entries();
        println!(
            "  {n:>5} replicas: {entries} entries, {} distinct blocks; reported {:.1} B/entry, allocated (whole fleet) {:.1} B/entry",
            f.index().blocks(),
            f.index().memory_bytes() as f64 / entries as f64,
            (after - before) as f64 / entries as f64
        );
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench_decision(&mut c);
    bench_parts(&mut c);
    bench_apply(&mut c);
    bench_replication(&mut c);
    bench_record(&mut c);
    c.final_summary();
    if std::env::args().any(|a| a == "--bench") {
        report_percentiles();
        report_memory();
    }
}
