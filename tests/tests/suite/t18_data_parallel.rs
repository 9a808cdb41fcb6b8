//! A data-parallel engine (vLLM `--data-parallel-size 2`: two ranks behind one API server,
//! each publishing KV events at the configured ports plus its rank): one `[[replicas]]`
//! entry with `data_parallel_size = 2` becomes two replicas, each indexed from its own
//! rank's stream and loaded from its own metrics series; every request routed to one carries
//! `X-data-parallel-rank`, so the engine runs it on the rank whose cache was counted.

use crate::common;

use common::{blocks, eventually_within};
use kvmesh_core::ReplicaStatus;
use kvmesh_engine_sim::EngineSimConfig;
use kvmesh_node::config::NodeConfig;
use kvmesh_proto::v1;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_behind_one_api_are_indexed_loaded_and_routed_apart() {
    let p = common::consecutive_ports(4);
    let (events, replay) = (format!("tcp://127.0.0.1:{p}"), format!("tcp://127.0.0.1:{}", p + 2));
    let engine = kvmesh_engine_sim::start(EngineSimConfig {
        kv_events: events.clone(),
        replay: replay.clone(),
        data_parallel_size: 2,
        speed: 20.0,
        ..EngineSimConfig::default()
    })
    .await
    .unwrap();
    assert_eq!(engine.ranks[1], (format!("tcp://127.0.0.1:{}", p + 1), format!("tcp://127.0.0.1:{}", p + 3)));

    // The file an operator writes: one entry for the engine, its ranks written out at load.
    // "crossed" claims rank 1 but is pointed at rank 0's stream (a misconfiguration), under
    // another name for the engine's host (the same URL twice is refused at load).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node.toml");
    let url = engine.base_url();
    let alias = url.replace("127.0.0.1", "localhost");
    let toml = format!(
        "[node]\nhttp = \"127.0.0.1:0\"\ngrpc = \"127.0.0.1:0\"\nscrape_interval = \"50ms\"\nshutdown_grace = \"1s\"\n\n\
         [[replicas]]\nname = \"e0\"\nhttp = \"{url}\"\nkv_events = \"{events}\"\nreplay = \"{replay}\"\n\
         capacity_blocks = 29375\ndata_parallel_size = 2\n\n\
         [[replicas]]\nname = \"crossed\"\nhttp = \"{alias}\"\nkv_events = \"{events}\"\ncapacity_blocks = 29375\n\
         data_parallel_rank = 1\n"
    );
    std::fs::write(&path, toml).unwrap();
    let config = NodeConfig::load(&path).unwrap();
    let names: Vec<(&str, Option<u32>, Option<&str>)> =
        config.replicas.iter().map(|r| (r.name.as_str(), r.data_parallel_rank, r.kv_events.as_deref())).collect();
    let rank1 = format!("tcp://127.0.0.1:{}", p + 1);
    assert_eq!(
        names,
        [
            ("e0-dp0", Some(0), Some(events.as_str())),
            ("e0-dp1", Some(1), Some(rank1.as_str())),
            ("crossed", Some(1), Some(events.as_str()))
        ]
    );
    assert_eq!(config.replicas[1].replay.as_deref(), Some(format!("tcp://127.0.0.1:{}", p + 3).as_str()));
    let node = kvmesh_node::start(config).await.unwrap();
    eventually_within("every rank scraped", 10, || {
        node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some())
    })
    .await;

    // Distinct prompts: each answer's rank (the engine's count) is the rank of the replica
    // the node named.
    let client = reqwest::Client::new();
    let completions = format!("http://{}/v1/completions", node.http);
    let mut chosen = std::collections::BTreeMap::<String, u32>::new();
    for k in 0..12 {
        let before = engine.requests_by_rank();
        let prompt = format!("prompt {k} ").repeat(80);
        let r = client.post(&completions).json(&json!({"prompt": prompt, "max_tokens": 2})).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let replica = r.headers()["x-kvmesh-replica"].to_str().unwrap().to_string();
        let after = engine.requests_by_rank();
        let ran_on: Vec<usize> = (0..2).filter(|&i| after[i] > before[i]).collect();
        let want = if replica == "e0-dp0" { 0 } else { 1 };
        assert_eq!(ran_on, [want], "{replica} ran on {ran_on:?}");
        *chosen.entry(replica).or_default() += 1;
    }
    assert!(chosen.get("e0-dp0").is_some_and(|n| *n > 0) && chosen.get("e0-dp1").is_some_and(|n| *n > 0), "{chosen:?}");
    // Each rank's blocks come from its own stream.
    eventually_within("both ranks indexed", 10, || blocks(&node, "e0-dp0") > 0 && blocks(&node, "e0-dp1") > 0).await;

    // A long prompt cached on one rank is found there, and only there.
    let long = "cached on one rank ".repeat(200);
    let first = client.post(&completions).json(&json!({"prompt": long, "max_tokens": 2})).send().await.unwrap();
    let home = first.headers()["x-kvmesh-replica"].to_str().unwrap().to_string();
    assert!(home.starts_with("e0-dp"), "{home}");
    let held = node.shared.recent_decisions(1).remove(0).prompt_tokens / 16;
    eventually_within("the long prompt indexed on its rank", 10, || {
        let core = node.shared.core();
        let hashes =
            kvmesh_core::RouteRequest::new(core.fleet.hasher(), &node.shared.tokenizer.encode(&long), None).hashes;
        let holders = core.fleet.holders(&hashes[..held as usize]);
        holders == [core.replicas[&home].id]
    })
    .await;
    let router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let route = v1::RouteRequest {
        prompt: Some(v1::route_request::Prompt::Text(long.clone())),
        max_tokens: Some(2),
        ..v1::RouteRequest::default()
    };
    let routed = router.clone().route(route).await.unwrap().into_inner();
    let rank = if home == "e0-dp0" { 0 } else { 1 };
    assert_eq!(
        (routed.replica_id.as_str(), routed.data_parallel_rank, routed.overlap_blocks),
        (home.as_str(), Some(rank), held)
    );
    assert_eq!(routed.endpoint, url);

    // The replica pointed at another rank's stream refuses its batches and is quarantined.
    eventually_within("crossed quarantined", 10, || {
        let now = node.shared.now();
        let core = node.shared.core();
        core.status(&core.replicas["crossed"], now) == ReplicaStatus::BadEvents
    })
    .await;
    assert_eq!(blocks(&node, "crossed"), 0);
    let rejected = common::metric(&node, "kvmesh_events_rejected_total{");
    assert!(
        rejected.contains("reason=\"other_data_parallel_rank\",replica=\"crossed\"")
            || rejected.contains("replica=\"crossed\",reason=\"other_data_parallel_rank\""),
        "{rejected}"
    );

    node.stop().await;
    engine.stop().await;
}
