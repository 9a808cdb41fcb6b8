//! History older than the replay buffer: a node that starts following an engine whose
//! replay buffer no longer reaches back to the store of a long-lived prefix keeps what the
//! buffer gives and keeps the stores chained under that prefix aside — no "out of sync", no
//! rebuild every 30 s wiping the index again — and places them, with the prefix, once a
//! prompt it routes there shows the prefix's tokens: the recovered fraction of what the
//! engine holds rises as traffic flows.

use crate::common;

use common::{eventually_within, metric};
use kvmesh_core::ReplicaStatus;
use kvmesh_engine_sim::EngineSimConfig;
use kvmesh_node::config::NodeSection;
use serde_json::json;

/// The system prompt: exactly 32 blocks (16 bytes are 4 approximate tokens).
fn system() -> String {
    "careful helper. ".repeat(128)
}

/// A question of exactly 2 blocks after the system prompt.
fn question(k: usize) -> String {
    format!("follow-up {k:05}.").repeat(8)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_older_than_the_buffer_is_recovered_from_the_prompts_routed_there() {
    // An engine that keeps only its last 4 messages for replay.
    let engine =
        kvmesh_engine_sim::start(EngineSimConfig { replay_buffer: 4, speed: 50.0, ..EngineSimConfig::default() })
            .await
            .unwrap();
    let client = reqwest::Client::new();
    let send = |url: String, prompt: String| {
        let client = client.clone();
        async move {
            let r = client.post(&url).json(&json!({"prompt": prompt, "max_tokens": 1})).send().await.unwrap();
            assert_eq!(r.status().as_u16(), 200);
        }
    };
    // Before the node starts: six questions under the system prompt, one message each (the
    // first stores all 34 blocks, the others their 2). The buffer keeps the last four.
    let direct = format!("{}/v1/completions", engine.base_url());
    for k in 0..6 {
        send(direct.clone(), format!("{}{}", system(), question(k))).await;
    }
    assert_eq!(engine.cached_blocks(), [32 + 6 * 2]);

    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    let node = kvmesh_node::start(common::single(section, vec![common::replica(0, &engine)])).await.unwrap();
    let status = |node: &kvmesh_node::Node| {
        let now = node.shared.now();
        let core = node.shared.core();
        core.status(&core.replicas["e0"], now)
    };
    let counts = |node: &kvmesh_node::Node| {
        let id = node.shared.core().replicas["e0"].id;
        let index = node.shared.index.read();
        (index.replica_blocks(id), index.orphan_blocks(id))
    };
    // The replay gives the last four stores, each under a block this node never heard of:
    // all kept aside, and the replica is not out of sync.
    eventually_within("the buffer replayed", 10, || counts(&node) == (0, 8)).await;
    assert_eq!(status(&node), ReplicaStatus::Ready);
    assert!(
        metric(&node, "kvmesh_replica_recovered_ratio{").ends_with(" 0.0"),
        "{}",
        metric(&node, "kvmesh_replica_recovered_ratio{")
    );

    // One question through the node: its prompt shows the system prompt's tokens before the
    // store the engine makes of its question, so the system prompt is placed (32 blocks
    // inferred), and every store waiting under it follows (its own and the four replayed).
    let via_node = format!("http://{}/v1/completions", node.http);
    send(via_node.clone(), format!("{}{}", system(), question(100))).await;
    eventually_within("the prefix recovered", 10, || counts(&node) == (32 + 10, 0)).await;
    assert_eq!(engine.cached_blocks(), [32 + 7 * 2]);
    let inferred = metric(&node, "kvmesh_events_inferred_blocks_total");
    assert_eq!(inferred, "kvmesh_events_inferred_blocks_total{replica=\"e0\"} 32");
    let adopted = metric(&node, "kvmesh_events_adopted_blocks_total");
    assert_eq!(adopted, "kvmesh_events_adopted_blocks_total{replica=\"e0\"} 10");
    // The recovered fraction of what the engine holds, as traffic flows: what was lost is
    // the two stores that left the buffer (4 blocks); the rest, and all that follows, is held.
    let mut fractions = Vec::new();
    for k in 0..10 {
        send(via_node.clone(), format!("{}{}", system(), question(200 + k))).await;
        let want = 32 + 10 + 2 * (k + 1);
        eventually_within("each question placed", 10, || counts(&node) == (want, 0)).await;
        fractions.push(want as f64 / engine.cached_blocks()[0] as f64);
    }
    assert_eq!(engine.cached_blocks(), [32 + 17 * 2]);
    assert!(fractions.windows(2).all(|w| w[0] < w[1]), "{fractions:?}");
    assert_eq!(*fractions.last().unwrap(), 62.0 / 66.0);
    assert!(fractions[0] >= 0.9, "{fractions:?}");
    // And routing sees it: the system prompt is overlap on e0.
    send(via_node.clone(), format!("{}{}", system(), question(300))).await;
    let d = node.shared.recent_decisions(1).remove(0);
    assert_eq!(d.overlap_blocks, 32);
    assert!(metric(&node, "kvmesh_replica_recovered_ratio{").ends_with(" 1.0"));
    let resyncs = metric(&node, "kvmesh_resyncs_total");
    assert!(!resyncs.contains("unknown_parent"), "{resyncs}");

    node.stop().await;
    engine.stop().await;
}
