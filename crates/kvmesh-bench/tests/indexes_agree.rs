//! The side-by-side run on a short prefix of the Mooncake conversation trace: every index
//! answers every query exactly as the engines hold the blocks. Skips without the public
//! traces (set `KVMESH_TRACES`); `KVMESH_REQUIRE_TRACES=1` (CI) makes their absence a failure.

use kvmesh_bench::contender::dynamo::{DynamoConcurrent, DynamoRadixTree};
use kvmesh_bench::contender::kvmesh::Kvmesh;
use kvmesh_bench::run::{apply_pass, query_pass};
use kvmesh_bench::workload::{build, Op, Variant, WorkloadConfig};

fn trace() -> Option<kvmesh_sim::trace::Trace> {
    use std::io::Write;
    let dir = std::env::var_os(kvmesh_sim::trace::TRACES_ENV).map_or_else(
        || std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/traces"),
        std::path::PathBuf::from,
    );
    let path = dir.join("mooncake/conversation_trace.jsonl");
    if !path.is_file() {
        assert!(std::env::var_os("KVMESH_REQUIRE_TRACES").is_none(), "{} is missing", path.display());
        // Straight to the stderr handle: libtest captures `eprintln!`, and a skip must be seen.
        let _ = writeln!(std::io::stderr(), "SKIPPED: {} is missing (set KVMESH_TRACES)", path.display());
        return None;
    }
    Some(kvmesh_sim::trace::load(&path).expect("the public trace loads"))
}

#[test]
fn every_index_answers_every_query_like_the_engines() {
    let Some(trace) = trace() else { return };
    for variant in [Variant::Chunked, Variant::Vllm] {
        let mut config = WorkloadConfig::new(16, variant);
        config.total_blocks = 1 << 16;
        config.max_requests = Some(400);
        let w = build(&trace, &config);
        let stores = w.ops.iter().filter(|op| matches!(op, Op::Store { .. })).count();
        assert!(w.queries.len() > 100 && stores > 400, "{variant:?}: {} queries, {stores} stores", w.queries.len());
        assert!(w.entries as f64 >= 0.99 * (1 << 16) as f64, "{variant:?}: the fleet fills ({} entries)", w.entries);
        let k = query_pass(Kvmesh::new, &w);
        let r = query_pass(DynamoRadixTree::new, &w);
        let c = query_pass(|| DynamoConcurrent::new(1), &w);
        for (name, f) in [("kvmesh", &k), ("RadixTree", &r), ("concurrent tree", &c)] {
            assert_eq!(f.mismatches, 0, "{variant:?} {name}: {:?}", f.first_mismatch);
            assert_eq!(f.pre.len() + f.post.len(), w.queries.len() as u64);
        }
        let a = apply_pass(Kvmesh::new, &w);
        assert_eq!((a.errors, a.blocks), (0, w.event_blocks(w.warm_ops)));
        assert_eq!(apply_pass(DynamoRadixTree::new, &w).errors, 0);
    }
}
