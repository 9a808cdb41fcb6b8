//! `vs-dynamo`: kvmesh's prefix index against Dynamo's `RadixTree` and concurrent tree, on one
//! workload built from the Mooncake conversation trace, in one process (see the library docs
//! and BENCHMARKS.md). Exits 1 when any index answers a query differently from the truth.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use anyhow::{bail, Context};
use clap::Parser;
use kvmesh_bench::alloc::Counting;
use kvmesh_bench::contender::dynamo::{DynamoConcurrent, DynamoRadixTree, SharedConcurrent};
use kvmesh_bench::contender::kvmesh::{Kvmesh, SharedKvmesh};
use kvmesh_bench::contender::Index;
use kvmesh_bench::decision::decision_pass;
use kvmesh_bench::floor::engine_map_pass;
use kvmesh_bench::report::{IndexRow, Latency, Report};
use kvmesh_bench::run::{apply_pass, concurrent_pass, query_pass, ConcurrentFigures};
use kvmesh_bench::workload::{build, Variant, Workload, WorkloadConfig};
use std::path::PathBuf;

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Prefix index side by side: kvmesh against Dynamo's KV router (dynamo-kv-router 1.6.1).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Mooncake JSONL trace [default: $KVMESH_TRACES/mooncake/conversation_trace.jsonl,
    /// KVMESH_TRACES defaulting to ../shared/traces].
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Simulated engines, comma-separated; each holds 2^20 / N blocks.
    #[arg(long, value_delimiter = ',', default_value = "16,128,1024")]
    replicas: Vec<usize>,
    /// How the engines' events are cut.
    #[arg(long, value_enum, default_value_t = Variant::Chunked)]
    variant: Variant,
    /// Use only the trace's first N requests.
    #[arg(long)]
    requests: Option<usize>,
    /// (block, engine) entries of the full fleet.
    #[arg(long, default_value_t = 1 << 20)]
    entries: usize,
    /// Skip the reader-and-writer pass.
    #[arg(long)]
    no_concurrent: bool,
    /// Time only kvmesh's whole decisions (no index passes): for profiling the decision path.
    #[arg(long)]
    decision_only: bool,
    /// Time only event apply: kvmesh's index, Dynamo's `RadixTree` and the engine-id maps alone
    /// (a std hash map per engine: what one probe per block costs) alternated N times on the
    /// same workload (no queries, no table, no --json): for comparing builds of the index.
    #[arg(long, value_name = "N", conflicts_with_all = ["json", "decision_only"])]
    apply_only: Option<usize>,
    /// Also write the reports as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let path =
        args.trace.clone().unwrap_or_else(|| kvmesh_sim::trace::traces_dir().join("mooncake/conversation_trace.jsonl"));
    let trace = kvmesh_sim::trace::load(&path).with_context(|| format!("reading the trace {}", path.display()))?;
    if trace.block_tokens != Some(512) {
        bail!("{} has no 512-token hash_ids (a Mooncake trace is needed)", path.display());
    }
    let mut reports = Vec::new();
    for &n in &args.replicas {
        let mut config = WorkloadConfig::new(n, args.variant);
        config.max_requests = args.requests;
        config.total_blocks = args.entries;
        eprintln!("{n} replicas: building the workload ({:?})…", args.variant);
        let w = build(&trace, &config);
        if let Some(rounds) = args.apply_only {
            apply_rounds(&w, rounds)?;
            continue;
        }
        let report = measure(&w, &config, !args.no_concurrent, args.decision_only);
        println!(
            "\n{n} replicas, {:?} events: {} requests, {} queries, {} entries",
            args.variant, report.requests, report.queries, report.entries
        );
        println!("{}", report.table());
        if let (Some(d), Some(h), Some(f)) = (report.decision, report.decision_hash, report.decision_decide) {
            println!(
                "kvmesh whole decision (hash + query + token_load): p50 {:.2} µs, p99 {:.2} µs \
                 (hashing p50 {:.2} / p99 {:.2} µs, Fleet::decide p50 {:.2} / p99 {:.2} µs)",
                d.p50_us, d.p99_us, h.p50_us, h.p99_us, f.p50_us, f.p99_us
            );
        }
        reports.push(report);
    }
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&reports)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    let bad: Vec<String> = reports
        .iter()
        .flat_map(|r| {
            r.rows.iter().filter(|x| x.mismatches > 0).map(move |x| format!("{} at {} replicas", x.index, r.replicas))
        })
        .collect();
    if !bad.is_empty() {
        bail!("answers differ from the truth: {}", bad.join(", "));
    }
    Ok(())
}

/// `rounds` apply passes of kvmesh's index, Dynamo's `RadixTree` and a std hash map per engine
/// from its block ids alone ([`kvmesh_bench::floor`]), alternated, each printed.
fn apply_rounds(w: &Workload, rounds: usize) -> anyhow::Result<()> {
    for round in 1..=rounds {
        let k = apply_pass(Kvmesh::new, w);
        let d = apply_pass(DynamoRadixTree::new, w);
        let f = engine_map_pass(w);
        if k.errors + d.errors + f.errors > 0 {
            bail!(
                "events refused in the apply pass: kvmesh {}, Dynamo RadixTree {}, engine-id maps {}",
                k.errors,
                d.errors,
                f.errors
            );
        }
        let per_entry = |bytes: isize| bytes as f64 / w.entries.max(1) as f64;
        println!(
            "{} replicas, round {round}: apply M blocks/s kvmesh {:.2}, Dynamo RadixTree {:.2} ({:.2}×); kvmesh {:.1} B / entry; \
             engine-id maps alone {:.2} M blocks/s, {:.1} B / entry (their time {:.2}× RadixTree's)",
            w.engines,
            k.mblocks_per_s(),
            d.mblocks_per_s(),
            k.mblocks_per_s() / d.mblocks_per_s(),
            per_entry(k.heap_bytes),
            f.mblocks_per_s(),
            per_entry(f.heap_bytes),
            d.mblocks_per_s() / f.mblocks_per_s()
        );
    }
    Ok(())
}

/// Every pass of every index on `w`.
fn measure(w: &Workload, config: &WorkloadConfig, concurrent: bool, decision_only: bool) -> Report {
    let entries = w.entries;
    let mut rows = Vec::new();
    let concurrent = concurrent && !decision_only;
    let conc_kvmesh = concurrent.then(|| {
        eprintln!("  kvmesh: reader and writer");
        concurrent_pass(&SharedKvmesh::new(w, w.engines as u32), w)
    });
    if !decision_only {
        rows.push(row(Kvmesh::new, w, entries, conc_kvmesh));
        rows.push(row(DynamoRadixTree::new, w, entries, None));
    }
    let conc_dynamo = concurrent.then(|| {
        eprintln!("  Dynamo concurrent tree: reader and writer");
        concurrent_pass(&SharedConcurrent::new(w), w)
    });
    if !decision_only {
        rows.push(row(|| DynamoConcurrent::new(1), w, entries, conc_dynamo));
    }
    eprintln!("  kvmesh: whole decisions");
    let capacity = (config.total_blocks / config.engines.max(1)) as u64;
    let times = decision_pass(w, capacity);
    let decision = Some(Latency::of(&times.whole));
    Report {
        replicas: w.engines,
        variant: config.variant,
        requests: w.requests,
        queries: w.queries.len(),
        entries,
        rows,
        decision,
        decision_hash: Some(Latency::of(&times.hash)),
        decision_decide: Some(Latency::of(&times.decide)),
    }
}

fn row<I: Index>(make: impl Fn() -> I, w: &Workload, entries: usize, conc: Option<ConcurrentFigures>) -> IndexRow {
    let probe = make();
    let (name, query_includes) = (probe.name(), probe.query_includes());
    drop(probe);
    eprintln!("  {name}: apply pass");
    let a = apply_pass(&make, w);
    eprintln!("  {name}: query pass");
    let q = query_pass(&make, w);
    if let Some(m) = &q.first_mismatch {
        eprintln!("  {name}: {} mismatches; first: {m}", q.mismatches);
    }
    IndexRow {
        index: name.to_string(),
        query_includes: query_includes.to_string(),
        pre: Latency::of(&q.pre),
        post: Latency::of(&q.post),
        apply_mblocks_per_s: a.mblocks_per_s(),
        bytes_per_entry: a.heap_bytes as f64 / entries.max(1) as f64,
        mismatches: q.mismatches,
        apply_errors: a.errors,
        concurrent: conc.map(|c| Latency::of(&c.queries)),
    }
}
