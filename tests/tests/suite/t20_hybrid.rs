//! Hybrid models: KV events per KV cache group, as a vLLM serving a model with sliding-window
//! layers sends them (`group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`). The
//! node follows the full-attention and the sliding-window groups, and a prefix hit is vLLM's:
//! the full-attention hit, cut where the window group's last run of `⌈(window − 1) / block⌉`
//! blocks ends.

use crate::common;

use common::publisher::Publisher;
use common::{blocks, eventually_within};
use kvmesh_core::index::{KvEvent, KvGroup, Stored};
use kvmesh_core::{EngineBlockHash, Medium};
use kvmesh_engine_sim::EngineSimConfig;
use kvmesh_events::encode::{encode_batch, Encoding};
use kvmesh_node::config::NodeSection;
use kvmesh_node::tokenize::Tokenizer;
use kvmesh_proto::v1;
use serde_json::json;

fn window_blocks(node: &kvmesh_node::Node, name: &str) -> usize {
    let core = node.shared.core();
    core.replicas.get(name).map_or(0, |r| core.fleet.index().window_blocks(r.id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_group_that_lost_blocks_cuts_the_overlap_where_vllm_would() {
    // One 64-block prompt. e0's full-attention group holds all of it; its 64-token window
    // group (4 blocks needed before a hit ends) only blocks 0–7 and 40–47, the rest slid out
    // and was evicted. e1, no hybrid, holds the first 30 blocks.
    let prompt = "hyb!".repeat(64 * 16);
    let tokens = Tokenizer::load(None).unwrap().encode(&prompt);
    assert_eq!(tokens.len(), 1024);
    let ids: Vec<EngineBlockHash> = (1000..1064).map(EngineBlockHash).collect();
    let store = |from: usize, to: usize, kv_group: Option<KvGroup>| {
        KvEvent::Stored(Stored {
            block_hashes: ids[from..to].to_vec(),
            parent: from.checked_sub(1).map(|p| ids[p]),
            token_ids: tokens[from * 16..to * 16].to_vec(),
            block_size: 16,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: None,
            kv_group,
        })
    };
    let full = Some(KvGroup { idx: 0, kind: Some("full_attention".into()), sliding_window: None });
    let window = Some(KvGroup { idx: 1, kind: Some("sliding_window".into()), sliding_window: Some(64) });
    let hybrid = vec![store(0, 64, full), store(0, 8, window.clone()), store(40, 48, window)];
    let (p0, p1) = (Publisher::start().await, Publisher::start().await);
    p0.buffer.lock().unwrap().push((0, bytes::Bytes::from(encode_batch(1.0, &hybrid, Some(0), Encoding::Map))));
    let plain = [store(0, 30, None)];
    p1.buffer.lock().unwrap().push((0, bytes::Bytes::from(encode_batch(1.0, &plain, Some(0), Encoding::Map))));
    let engines = common::engines(2, 20.0).await;
    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    let replicas = vec![p0.replica(0, &engines[0]), p1.replica(1, &engines[1])];
    let node = kvmesh_node::start(common::single(section, replicas)).await.unwrap();
    eventually_within("both indexed", 10, || {
        blocks(&node, "e0") == 64 && window_blocks(&node, "e0") == 16 && blocks(&node, "e1") == 30
    })
    .await;
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let routed = router.route(common::route_request("", &tokens, None)).await.unwrap().into_inner();
    // Not 64: the window group's last run of 4 ends at block 48. Still more than e1's 30.
    assert_eq!((routed.replica_id.as_str(), routed.overlap_blocks), ("e0", 48));
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_sim_serving_a_hybrid_model_is_indexed_per_group() {
    let config = EngineSimConfig { sliding_window: Some(128), speed: 20.0, ..EngineSimConfig::default() };
    let engine = kvmesh_engine_sim::start(config).await.unwrap();
    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    let node = kvmesh_node::start(common::single(section, vec![common::replica(0, &engine)])).await.unwrap();
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", node.http);
    let prompt = "window!!".repeat(8 * 20);
    for _ in 0..2 {
        let r = client.post(&url).json(&json!({"prompt": prompt, "max_tokens": 2})).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        // 20 blocks in each group.
        eventually_within("both groups indexed", 10, || blocks(&node, "e0") == 20 && window_blocks(&node, "e0") == 20)
            .await;
    }
    // The second request found the whole prompt: the window group holds its last blocks.
    let d = node.shared.recent_decisions(1).remove(0);
    assert_eq!(d.overlap_blocks, 20);
    node.stop().await;
    engine.stop().await;
}
