//! The public traces load with their documented sizes, and `analyze` gives the figures the
//! routing-core issue fixes (prefix-reuse ratio 0.366 conversation, 0.640 synthetic).

use kvmesh_sim::analyze::analyze;
use kvmesh_sim::trace::{self, TraceFormat};
use kvmesh_tests::trace as fixture;

#[test]
fn mooncake_conversation_figures() {
    let Some(path) = fixture("mooncake/conversation_trace.jsonl") else { return };
    let t = trace::load(&path).unwrap();
    assert_eq!((t.requests.len(), t.skipped.len()), (12_031, 0));
    let s = analyze(&t, 5);
    assert_eq!(s.span_s, 3536.999);
    let p = s.prefix.unwrap();
    assert_eq!((p.block_refs, p.reused_refs, p.distinct_blocks), (288_500, 105_710, 182_790));
    assert_eq!(format!("{:.3}", p.reuse_ratio), "0.366");
    // Every request starts with the shared 512-token system block.
    assert_eq!(p.unshared_share, 0.0);
    assert_eq!((p.top[0].block_id, p.top[0].depth_blocks, p.top[0].requests), (0, 1, 5_114));
}

#[test]
fn mooncake_synthetic_figures() {
    let Some(path) = fixture("mooncake/synthetic_trace.jsonl") else { return };
    let s = analyze(&trace::load(&path).unwrap(), 5);
    assert_eq!(s.requests, 3_993);
    let p = s.prefix.unwrap();
    assert_eq!((p.block_refs, p.reused_refs), (121_877, 77_953));
    assert_eq!(format!("{:.3}", p.reuse_ratio), "0.640");
}

#[test]
fn azure_traces_load_without_prefix_information() {
    for (file, rows) in [("AzureLLMInferenceTrace_code.csv", 8_819), ("AzureLLMInferenceTrace_conv.csv", 19_366)] {
        let Some(path) = fixture(&format!("azure_llm_2023/{file}")) else { return };
        let t = trace::load(&path).unwrap();
        assert_eq!(t.format, TraceFormat::Azure);
        assert_eq!((t.requests.len(), t.skipped.len()), (rows, 0), "{file}");
        assert!(analyze(&t, 5).prefix.is_none());
    }
}
