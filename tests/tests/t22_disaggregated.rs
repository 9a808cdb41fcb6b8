//! Prefill/decode disaggregation: 2 prefill and 2 decode engine-sims behind one node. Each
//! request goes to one prefill and one decode replica, handed over as vLLM's
//! `kv_transfer_params` (or SGLang's bootstrap fields) ask, streamed back unchanged for the
//! client; a failing side is left out and the request decided again (never decoded twice);
//! every booking is released.

mod common;

use common::{blocks, eventually, metric};
use kvmesh_engine_sim::http::PdCounts;
use kvmesh_engine_sim::{EngineSim, EngineSimConfig, Faults};
use kvmesh_node::config::{NodeSection, ReplicaConfig};
use kvmesh_proto::v1;
use serde_json::json;

/// Engine-sims p0, p1 (prefill) and d0, d1 (decode) at 20× speed, and their replica entries
/// (`engine` vllm or sglang).
async fn fleet(engine: &str) -> (Vec<EngineSim>, Vec<ReplicaConfig>) {
    use kvmesh_core::Role;
    let mut engines = Vec::new();
    let mut replicas = Vec::new();
    for (i, (name, role)) in [("p0", Role::Prefill), ("p1", Role::Prefill), ("d0", Role::Decode), ("d1", Role::Decode)]
        .into_iter()
        .enumerate()
    {
        let e = kvmesh_engine_sim::start(EngineSimConfig { speed: 20.0, role, ..EngineSimConfig::default() })
            .await
            .unwrap();
        let bootstrap_port = (engine == "sglang" && role == Role::Prefill).then_some(8998 + i as u16);
        replicas.push(ReplicaConfig {
            name: name.into(),
            role,
            engine: engine.into(),
            bootstrap_port,
            ..common::replica(i, &e)
        });
        engines.push(e);
    }
    (engines, replicas)
}

async fn node(replicas: Vec<ReplicaConfig>) -> kvmesh_node::Node {
    let section = NodeSection { scrape_interval_ms: 50, ..common::section() };
    let node = kvmesh_node::start(common::single(section, replicas)).await.unwrap();
    eventually("all four replicas scraped", || node.shared.core().replicas.values().all(|r| r.engine.is_some())).await;
    node
}

/// Sums of the engines' request kinds: (prefill legs on p0+p1, decode legs on d0+d1, whole
/// requests anywhere).
fn kinds(engines: &[EngineSim]) -> (u64, u64, u64) {
    let c: Vec<PdCounts> = engines.iter().map(EngineSim::pd_counts).collect();
    (c[0].prefill + c[1].prefill, c[2].decode + c[3].decode, c.iter().map(|c| c.whole).sum())
}

/// A streamed completion of `max_tokens` tokens: (status, decode replica, prefill replica,
/// tokens streamed, whether it ended with `[DONE]`).
async fn stream(node: &kvmesh_node::Node, prompt: &str, max_tokens: u32) -> (u16, String, String, usize, bool) {
    let url = format!("http://{}/v1/completions", node.http);
    let body = json!({"model": "kvmesh-sim-llama-3-8b", "prompt": prompt, "max_tokens": max_tokens, "stream": true});
    let r = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
    let header = |h: &str| r.headers().get(h).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let (status, decode, prefill) =
        (r.status().as_u16(), header("x-kvmesh-replica"), header("x-kvmesh-prefill-replica"));
    let text = r.text().await.unwrap();
    let tokens = text.matches("\"text\":\" t\"").count();
    (status, decode, prefill, tokens, text.ends_with("data: [DONE]\n\n"))
}

async fn all_released(node: &kvmesh_node::Node) {
    eventually("every booking released", || node.shared.core().fleet.bookings().is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2p2d_fleet_prefills_on_one_side_and_decodes_on_the_other() {
    let (engines, replicas) = fleet("vllm").await;
    let node = node(replicas).await;
    assert!(node.shared.core().disaggregated(None));
    let mut decodes = std::collections::BTreeSet::new();
    let mut prefill_of = Vec::new();
    for k in 0..8 {
        // 64 blocks of a prompt each, distinct per request.
        let prompt = format!("request {k} ").repeat(100);
        let (status, decode, prefill, tokens, done) = stream(&node, &prompt, 5).await;
        assert_eq!((status, tokens, done), (200, 5, true), "request {k}");
        assert!(
            ["d0", "d1"].contains(&decode.as_str()) && ["p0", "p1"].contains(&prefill.as_str()),
            "{decode} {prefill}"
        );
        decodes.insert(decode);
        prefill_of.push(prefill);
    }
    // Every request prefilled once on a prefill replica and decoded once on a decode replica;
    // none served whole.
    assert_eq!(kinds(&engines), (8, 8, 0));
    assert_eq!(decodes.len(), 2, "both decode replicas took requests");
    all_released(&node).await;
    assert!(metric(&node, "kvmesh_requests_total").contains("kvmesh_requests_total{outcome=\"ok\"} 8"));
    // The decode side announced the blocks it received: the node's index holds them there
    // (each prompt's full blocks, at least).
    let tokenizer = kvmesh_node::tokenize::Tokenizer::load(None).unwrap();
    let full: usize = (0..8).map(|k| tokenizer.encode(&format!("request {k} ").repeat(100)).len() / 16).sum();
    assert_eq!(full, 120);
    eventually("received blocks indexed on the decode side", || blocks(&node, "d0") + blocks(&node, "d1") >= full)
        .await;
    // The same prompt again: its prefill goes where the prompt is cached.
    let again = format!("request {} ", 3).repeat(100);
    let (status, _, prefill, tokens, _) = stream(&node, &again, 3).await;
    assert_eq!((status, tokens, prefill.as_str()), (200, 3, prefill_of[3].as_str()));
    all_released(&node).await;
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_side_is_left_out_and_no_request_is_decoded_twice() {
    let (engines, replicas) = fleet("vllm").await;
    let node = node(replicas).await;
    // p0 fails every prefill (500); d0 refuses every decode (503: overloaded).
    engines[0].faults.set(Faults { status: Some(500), ..Faults::default() });
    engines[2].faults.set(Faults { status: Some(503), ..Faults::default() });
    for k in 0..6 {
        let prompt = format!("failing {k} ").repeat(80);
        let (status, decode, prefill, tokens, _) = stream(&node, &prompt, 4).await;
        assert_eq!((status, decode.as_str(), prefill.as_str(), tokens), (200, "d1", "p1", 4), "request {k}");
    }
    // Each request decoded exactly once, on d1; p1 prefilled all six and once more for each
    // request whose decode d0 refused (a fresh prefill).
    let c: Vec<PdCounts> = engines.iter().map(EngineSim::pd_counts).collect();
    assert_eq!((c[2].decode, c[3].decode), (0, 6));
    let refused_by_d0 = c[1].prefill - 6;
    let errors = metric(&node, "kvmesh_pd_errors_total");
    assert!(
        errors.contains("side=\"prefill\",kind=\"failed\"") || errors.contains("kind=\"failed\",side=\"prefill\""),
        "{errors}"
    );
    if refused_by_d0 > 0 {
        assert!(errors.contains("overloaded"), "{errors}");
    }
    all_released(&node).await;
    assert!(metric(&node, "kvmesh_requests_total").contains("kvmesh_requests_total{outcome=\"ok\"} 6"));

    // Both decode replicas refuse: the client hears which side failed, nothing stays booked.
    engines[3].faults.set(Faults { status: Some(500), ..Faults::default() });
    let url = format!("http://{}/v1/completions", node.http);
    let body = json!({"prompt": "doomed ".repeat(80), "max_tokens": 4});
    let r = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let e: serde_json::Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "decode_error", "{e}");
    all_released(&node).await;
    assert_eq!(engines.iter().map(|e| e.pd_counts().decode).sum::<u64>(), 6, "no decode ran for it");
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefill_replica_is_marked_down_and_its_requests_go_to_the_other() {
    let (mut engines, replicas) = fleet("vllm").await;
    let node = node(replicas).await;
    engines.remove(0).stop().await;
    for k in 0..4 {
        let (status, _, prefill, tokens, _) = stream(&node, &format!("dead {k} ").repeat(50), 2).await;
        assert_eq!((status, prefill.as_str(), tokens), (200, "p1", 2), "request {k}");
    }
    assert_eq!(engines[0].pd_counts().prefill, 4, "p1 prefilled every request");
    all_released(&node).await;
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_sides_get_the_bootstrap_fields_at_once() {
    let (engines, replicas) = fleet("sglang").await;
    let node = node(replicas).await;
    for k in 0..4 {
        let (status, decode, _, tokens, done) = stream(&node, &format!("sglang {k} ").repeat(60), 3).await;
        assert_eq!((status, tokens, done), (200, 3, true), "request {k}");
        assert!(decode.starts_with('d'));
    }
    // Both sides saw every request (the engine-sim reads bootstrap_room by its role).
    assert_eq!(kinds(&engines), (4, 4, 0));
    all_released(&node).await;
    // gRPC Route names both sides and the bootstrap fields a gateway would send.
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let ids: Vec<u32> = (0..640).collect();
    let routed = router.route(common::route_request("", &ids, None)).await.unwrap().into_inner();
    let decode = routed.decode.clone().expect("a decode side");
    let bootstrap = routed.bootstrap.clone().expect("bootstrap fields for SGLang");
    assert!(["p0", "p1"].contains(&routed.replica_id.as_str()));
    assert!(["d0", "d1"].contains(&decode.replica_id.as_str()));
    assert_eq!(bootstrap.host, "127.0.0.1");
    assert_eq!(bootstrap.port, if routed.replica_id == "p0" { 8998 } else { 8999 });
    assert!(bootstrap.room < 1 << 63);
    assert_eq!((routed.uncached_tokens, routed.overlap_blocks), (640, 0));
    for booking in [routed.booking, decode.booking] {
        router.release(v1::ReleaseRequest { booking, output_tokens: None }).await.unwrap();
    }
    assert!(node.shared.core().fleet.bookings().is_empty());
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_tier_routes_the_same_fleet_disaggregated() {
    use kvmesh_node::config::{ClusterSection, NodeConfig};
    let dir = tempfile::tempdir().unwrap();
    let (engines, replicas) = fleet("vllm").await;
    let ports = common::ports(3);
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let node = NodeSection {
            grpc: format!("127.0.0.1:{}", ports[id as usize - 1]).parse().unwrap(),
            scrape_interval_ms: 50,
            ..common::section()
        };
        let cluster = ClusterSection {
            id,
            peers: ports.iter().enumerate().map(|(i, p)| format!("{}=127.0.0.1:{p}", i + 1)).collect(),
            data_dir: dir.path().join(format!("node{id}")),
            insecure: true,
            ..ClusterSection::default()
        };
        let config = NodeConfig { cluster: Some(cluster), ..common::single(node, replicas.clone()) };
        nodes.push(kvmesh_node::start(config).await.unwrap());
    }
    nodes[0].cluster.as_ref().unwrap().init().await.unwrap();
    eventually("every node has the four replicas, roles included, from the registry", || {
        nodes.iter().all(|n| {
            let c = n.cluster.as_ref().unwrap().state.borrow();
            c.seeded && c.replicas.values().filter(|e| e.config.role != kvmesh_core::Role::Both).count() == 4
        }) && nodes.iter().all(|n| n.shared.core().disaggregated(None))
    })
    .await;
    // Twelve requests, each node in turn.
    for k in 0..12 {
        let node = &nodes[k % 3];
        let (status, decode, prefill, tokens, done) = stream(node, &format!("tier {k} ").repeat(60), 3).await;
        assert_eq!((status, tokens, done), (200, 3, true), "request {k} via node {}", k % 3 + 1);
        assert!(decode.starts_with('d') && prefill.starts_with('p'), "{decode} {prefill}");
    }
    assert_eq!(kinds(&engines), (12, 12, 0));
    for n in &nodes {
        all_released(n).await;
        assert!(metric(n, "kvmesh_requests_total").contains("kvmesh_requests_total{outcome=\"ok\"} 4"));
    }
    for n in nodes {
        n.stop().await;
    }
    for e in engines {
        e.stop().await;
    }
}
