//! History older than the replay buffer: a node that starts following an engine whose
//! replay buffer no longer reaches back to the store of a long-lived prefix keeps what the
//! buffer gives and keeps the stores chained under that prefix aside — no "out of sync", no
//! rebuild every 30 s wiping the index again.

mod common;

use common::{blocks, eventually_within, metric};
use kvmesh_engine_sim::EngineSimConfig;
use kvmesh_node::config::NodeSection;
use kvmesh_node::state::Status;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_under_a_prefix_older_than_the_buffer_wait_instead_of_wiping_the_index() {
    // An engine that keeps only its last 4 messages for replay.
    let engine =
        kvmesh_engine_sim::start(EngineSimConfig { replay_buffer: 4, speed: 50.0, ..EngineSimConfig::default() })
            .await
            .unwrap();
    let client = reqwest::Client::new();
    let direct = format!("{}/v1/completions", engine.base_url());
    // A long-lived system prompt (32 blocks), cached by the engine long before the node starts.
    let system = "you are a careful assistant. ".repeat(18);
    let send = |url: String, prompt: String| {
        let client = client.clone();
        async move {
            let r = client.post(&url).json(&json!({"prompt": prompt, "max_tokens": 1})).send().await.unwrap();
            assert_eq!(r.status().as_u16(), 200);
        }
    };
    send(direct.clone(), format!("{system}first question")).await;
    // Enough other traffic that the system prompt's store leaves the 4-message buffer.
    for k in 0..12 {
        send(direct.clone(), format!("unrelated prompt number {k} ").repeat(8)).await;
    }

    let section = NodeSection { scrape_interval_ms: 50, ..common::section() };
    let node = kvmesh_node::start(common::single(section, vec![common::replica(0, &engine)])).await.unwrap();
    let status = |node: &kvmesh_node::Node| {
        let now = node.shared.now();
        let core = node.shared.core();
        core.status(&core.replicas["e0"], now)
    };
    eventually_within("the buffer replayed", 10, || blocks(&node, "e0") > 0 && status(&node) == Status::Ready).await;
    let replayed = blocks(&node, "e0");

    // Through the node, continuations of the system prompt: the engine holds it, so it stores
    // only each question's blocks, chained under a block this node never heard of.
    let via_node = format!("http://{}/v1/completions", node.http);
    for k in 0..4 {
        send(via_node.clone(), format!("{system}follow-up question {k} with some detail to fill a block")).await;
    }
    eventually_within("the continuations kept aside", 10, || {
        metric(&node, "kvmesh_events_orphaned_blocks_total").contains("e0")
    })
    .await;
    // Kept aside, not an out-of-sync replica: it stays ready, nothing was wiped or rebuilt.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(status(&node), Status::Ready);
    assert!(blocks(&node, "e0") >= replayed, "{} < {replayed}", blocks(&node, "e0"));
    let waiting_blocks = {
        let core = node.shared.core();
        core.fleet.index().orphan_blocks(core.replicas["e0"].id)
    };
    assert!(waiting_blocks > 0);
    let resyncs = metric(&node, "kvmesh_resyncs_total");
    assert!(!resyncs.contains("unknown_parent"), "{resyncs}");
    let waiting = metric(&node, "kvmesh_replica_orphan_blocks{");
    assert!(waiting.contains("replica=\"e0\"") && !waiting.ends_with(" 0"), "{waiting}");

    node.stop().await;
    engine.stop().await;
}
