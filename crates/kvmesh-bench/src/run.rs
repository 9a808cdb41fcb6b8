//! The passes every index runs, on the same workload in the same process.
//!
//! - [`apply_pass`]: every event in order, no queries; the events after the fleet is full are
//!   timed (blocks stored + removed per second) and heap bytes are read at the end.
//! - [`query_pass`]: the events again, with each query asked **once** at its place (after
//!   a flush for asynchronous indexes, untimed), timed alone and checked against the truth.
//! - [`concurrent_pass`] (kvmesh and Dynamo's concurrent tree): a writer applies the events
//!   after the fleet is full while one reader thread asks the queries; only queries that
//!   finished while the writer was still writing count.

use crate::alloc::live_bytes;
use crate::contender::{Index, Shared};
use crate::workload::{Op, Phase, Workload};
use hdrhistogram::Histogram;
use std::time::Instant;

/// Query latencies, nanoseconds.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// What [`apply_pass`] measured.
#[derive(Debug, Clone)]
pub struct ApplyFigures {
    /// Nanoseconds spent applying the events after the fleet was full (flush included).
    pub ns: u64,
    /// Blocks stored plus removed in those events.
    pub blocks: u64,
    /// Heap bytes the index holds at the end.
    pub heap_bytes: isize,
    /// Events the index reported as errors (expected 0).
    pub errors: u64,
}

impl ApplyFigures {
    /// Millions of blocks applied per second.
    pub fn mblocks_per_s(&self) -> f64 {
        self.blocks as f64 / self.ns.max(1) as f64 * 1e3
    }
}

/// Runs every event into the index `make` builds.
pub fn apply_pass<I: Index>(make: impl FnOnce() -> I, w: &Workload) -> ApplyFigures {
    let before = live_bytes();
    let mut index = make();
    let mut ns = 0u64;
    for (k, op) in w.ops.iter().enumerate() {
        let Some(ev) = index.event(op) else { continue };
        let t = Instant::now();
        index.apply(ev);
        if k >= w.warm_ops {
            ns += t.elapsed().as_nanos() as u64;
        }
    }
    let t = Instant::now();
    index.flush();
    ns += t.elapsed().as_nanos() as u64;
    let heap_bytes = live_bytes() - before;
    ApplyFigures { ns, blocks: w.event_blocks(w.warm_ops), heap_bytes, errors: index.apply_errors() }
}

/// What [`query_pass`] measured.
#[derive(Debug, Clone)]
pub struct QueryFigures {
    /// Latency of queries asked before their request's events.
    pub pre: Histogram<u64>,
    /// Latency of queries asked after them.
    pub post: Histogram<u64>,
    /// Queries whose answer differed from the truth.
    pub mismatches: u64,
    /// The first such query, described.
    pub first_mismatch: Option<String>,
}

/// Replays the workload with its queries into the index `make` builds.
pub fn query_pass<I: Index>(make: impl FnOnce() -> I, w: &Workload) -> QueryFigures {
    let mut index = make();
    let mut f = QueryFigures { pre: histogram(), post: histogram(), mismatches: 0, first_mismatch: None };
    let mut got = Vec::new();
    for op in &w.ops {
        let Op::Query(qi) = op else {
            if let Some(ev) = index.event(op) {
                index.apply(ev);
            }
            continue;
        };
        index.flush();
        let q = &w.queries[*qi];
        let input = index.query_input(q);
        let t = Instant::now();
        let answer = index.query(input);
        let ns = t.elapsed().as_nanos() as u64;
        index.answer(answer, &mut got);
        match q.phase {
            Phase::Pre => f.pre.saturating_record(ns.max(1)),
            Phase::Post => f.post.saturating_record(ns.max(1)),
        }
        if got != q.truth {
            f.mismatches += 1;
            f.first_mismatch
                .get_or_insert_with(|| format!("query {qi} ({:?}): got {:?}, truth {:?}", q.phase, &got, &q.truth));
        }
    }
    f
}

/// What [`concurrent_pass`] measured.
#[derive(Debug, Clone)]
pub struct ConcurrentFigures {
    /// Latency of queries that finished while the writer was writing.
    pub queries: Histogram<u64>,
    /// Nanoseconds the writer took for the events after the fleet was full.
    pub writer_ns: u64,
}

/// Applies the warm-up events, then runs a writer (the rest of the events) and one reader
/// (the queries, in order, once) on two threads.
pub fn concurrent_pass<S: Shared>(shared: &S, w: &Workload) -> ConcurrentFigures {
    use std::sync::atomic::{AtomicBool, Ordering};
    for op in &w.ops[..w.warm_ops] {
        if !matches!(op, Op::Query(_)) {
            shared.write(op);
        }
    }
    shared.settle();
    let writing = AtomicBool::new(true);
    let mut queries = histogram();
    let mut writer_ns = 0;
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let t = Instant::now();
            for op in &w.ops[w.warm_ops..] {
                if !matches!(op, Op::Query(_)) {
                    shared.write(op);
                }
            }
            shared.settle();
            writing.store(false, Ordering::Release);
            t.elapsed().as_nanos() as u64
        });
        let mut sink = 0usize;
        for q in 0..w.queries.len() {
            let t = Instant::now();
            sink = sink.wrapping_add(shared.read(q));
            let ns = t.elapsed().as_nanos() as u64;
            if !writing.load(Ordering::Acquire) {
                break;
            }
            queries.saturating_record(ns.max(1));
        }
        std::hint::black_box(sink);
        writer_ns = writer.join().expect("the writer thread does not panic");
    });
    ConcurrentFigures { queries, writer_ns }
}
