//! Prefill/decode disaggregation: 2 prefill and 2 decode engine-sims behind one node. Each
//! request goes to one prefill and one decode replica, handed over as vLLM's
//! `kv_transfer_params` (or SGLang's bootstrap fields) ask, streamed back unchanged for the
//! client; a failing side is left out and the request decided again (never decoded twice);
//! every booking is released.

use crate::common;

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
    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    let node = kvmesh_node::start(common::single(section, replicas)).await.unwrap();
    eventually("all four replicas scraped", || {
        node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some())
    })
    .await;
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

/// `kvmesh_pd_errors_total{side, kind}` now (every series is there from the start, at 0).
fn pd_errors(node: &kvmesh_node::Node, side: &str, kind: &str) -> u64 {
    let page = metric(node, "kvmesh_pd_errors_total");
    let line = page
        .lines()
        .find(|l| l.contains(&format!("side=\"{side}\"")) && l.contains(&format!("kind=\"{kind}\"")))
        .unwrap_or_else(|| panic!("no series for {side} {kind} in {page}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Stops the node, then its engines.
async fn shutdown(node: kvmesh_node::Node, engines: Vec<EngineSim>) {
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

async fn all_released(node: &kvmesh_node::Node) {
    eventually("every booking released", || node.shared.core().fleet.bookings().is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2p2d_fleet_prefills_on_one_side_and_decodes_on_the_other() {
    let (engines, replicas) = fleet("vllm").await;
    let node = node(replicas).await;
    assert!(node.shared.core().disaggregated(None, None));
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
    shutdown(node, engines).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_side_is_left_out_and_no_request_is_decoded_twice() {
    let (engines, replicas) = fleet("vllm").await;
    let node = node(replicas).await;
    let index = |name: &str| ["p0", "p1", "d0", "d1"].iter().position(|n| *n == name).unwrap();
    // A first request caches its prompt on one prefill replica, which then fails every
    // prefill (500): the requests sharing that prompt go there first, by their overlap.
    let prompt = "shared prefix ".repeat(80);
    let (status, _, cached_on, _, _) = stream(&node, &format!("{prompt} first"), 2).await;
    assert_eq!(status, 200);
    all_released(&node).await;
    // A gRPC caller's booking (kept) makes one decode replica busier: the other, idle, is
    // picked first, and refuses every decode (503).
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let ids: Vec<u32> = (0..64).collect();
    let request = v1::RouteRequest { accept_disaggregated: true, ..common::route_request("", &ids, None) };
    let held = router.route(request).await.unwrap().into_inner();
    let busy = held.decode.clone().unwrap().replica_id;
    let refusing = if busy == "d0" { "d1" } else { "d0" };
    let serving_prefill = if cached_on == "p0" { "p1" } else { "p0" };
    engines[index(&cached_on)].faults.set(Faults { status: Some(500), ..Faults::default() });
    engines[index(refusing)].faults.set(Faults { status: Some(503), ..Faults::default() });
    let before: Vec<PdCounts> = engines.iter().map(EngineSim::pd_counts).collect();
    for k in 0..6 {
        let (status, decode, prefill, tokens, _) = stream(&node, &format!("{prompt} {k}"), 4).await;
        assert_eq!(
            (status, decode.as_str(), prefill.as_str(), tokens),
            (200, busy.as_str(), serving_prefill, 4),
            "{k}"
        );
    }
    let d: Vec<PdCounts> = engines
        .iter()
        .zip(&before)
        .map(|(e, b)| {
            let c = e.pd_counts();
            PdCounts { whole: c.whole - b.whole, prefill: c.prefill - b.prefill, decode: c.decode - b.decode }
        })
        .collect();
    // Each request decoded once, on the busy replica; the refusing one was sent a decode leg
    // (and refused it) at least once, each refusal costing one fresh prefill leg.
    let refusals = d[index(refusing)].decode;
    assert_eq!(d[index(&busy)].decode, 6);
    assert!(refusals >= 1, "the idle decode replica was tried first");
    assert_eq!(d[index(serving_prefill)].prefill, 6 + refusals);
    assert!(d[index(&cached_on)].prefill >= 1, "the cached prefill replica was tried first");
    assert_eq!(d.iter().map(|c| c.whole).sum::<u64>(), 0);
    assert!(pd_errors(&node, "prefill", "failed") >= 1 && pd_errors(&node, "decode", "overloaded") >= 1);
    // Only the failing side is charged: the decode replica that was never sent a failed
    // prefill's request has no prefill_error against it.
    let charged = metric(&node, "kvmesh_replica_requests_total");
    assert!(!charged.contains(&format!("replica=\"{busy}\",outcome=\"prefill_error\"")), "{charged}");
    assert!(charged.contains(&format!("replica=\"{cached_on}\",outcome=\"prefill_error\"")), "{charged}");
    for booking in [held.booking, held.decode.unwrap().booking] {
        router.release(v1::ReleaseRequest { booking, output_tokens: None }).await.unwrap();
    }
    all_released(&node).await;
    assert!(metric(&node, "kvmesh_requests_total").contains("kvmesh_requests_total{outcome=\"ok\"} 7"));

    // Both decode replicas refuse: the client hears which side failed, nothing stays booked,
    // and no decode ran (the refusals are the engines' 503s).
    engines[index(&busy)].faults.set(Faults { status: Some(500), ..Faults::default() });
    let url = format!("http://{}/v1/completions", node.http);
    let body = json!({"prompt": "doomed ".repeat(80), "max_tokens": 4});
    let r = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let e: serde_json::Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "decode_error", "{e}");
    all_released(&node).await;
    shutdown(node, engines).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_took_the_request_and_hung_is_not_sent_again() {
    let (engines, replicas) = fleet("vllm").await;
    let section = NodeSection {
        scrape_interval: std::time::Duration::from_millis(50),
        request_timeout: std::time::Duration::from_secs(1),
        ..common::section()
    };
    let node = kvmesh_node::start(common::single(section, replicas)).await.unwrap();
    eventually("all four replicas scraped", || {
        node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some())
    })
    .await;
    for e in &engines[2..] {
        e.faults.set(Faults { hang: true, ..Faults::default() });
    }
    let url = format!("http://{}/v1/completions", node.http);
    let body = json!({"prompt": "hung ".repeat(80), "max_tokens": 4});
    let r = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 504);
    let e: serde_json::Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "decode_error", "{e}");
    // One prefill leg, one decode leg: the decode side may have been decoding, so it is not
    // decoded again elsewhere.
    assert_eq!(kinds(&engines), (1, 1, 0));
    all_released(&node).await;
    for e in &engines[2..] {
        e.faults.set(Faults::default());
    }
    shutdown(node, engines).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_with_one_side_left_is_not_ready_and_says_which_side_is_missing() {
    let (engines, replicas) = fleet("vllm").await;
    let node = node(replicas).await;
    let health = |node: &kvmesh_node::Node| kvmesh_node::health::Readiness::of(&node.shared);
    assert_eq!((health(&node).routable, health(&node).ready()), (4, true));
    for d in ["d0", "d1"] {
        node.shared.set_draining(d, true).unwrap();
    }
    // Two prefill replicas routable, but nothing they could serve.
    assert_eq!((health(&node).routable, health(&node).ready()), (0, false));
    let url = format!("http://{}/v1/completions", node.http);
    let r =
        reqwest::Client::new().post(url).json(&json!({"prompt": "one side", "max_tokens": 2})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let e: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        e["error"]["message"],
        "this model is served disaggregated and no decode replica is routable (2 prefill and 0 decode replicas \
         routable), and it has no routable `both` replica to serve it whole"
    );
    assert!(node.shared.core().fleet.bookings().is_empty());
    shutdown(node, engines).await;
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
    shutdown(node, engines).await;
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
    // Both prefill sides fail (500) while the decode side answers: the answer is the
    // client's, decoded once; the prefill failures are counted.
    for e in &engines[..2] {
        e.faults.set(Faults { status: Some(500), ..Faults::default() });
    }
    let (status, _, _, tokens, _) = stream(&node, &"sglang failing prefill ".repeat(30), 3).await;
    assert_eq!((status, tokens), (200, 3));
    assert_eq!(kinds(&engines), (5, 5, 0));
    all_released(&node).await;
    eventually("the prefill failures counted", || pd_errors(&node, "prefill", "failed") >= 1).await;
    for e in &engines[..2] {
        e.faults.set(Faults::default());
    }
    // gRPC Route names both sides and the bootstrap fields a gateway would send.
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let ids: Vec<u32> = (0..640).collect();
    // A caller that cannot run the flow is told so (no `both` replica to serve it whole).
    let whole = router.route(common::route_request("", &ids, None)).await.unwrap_err();
    assert_eq!(whole.code(), tonic::Code::FailedPrecondition, "{whole:?}");
    assert!(node.shared.core().fleet.bookings().is_empty());
    let request = v1::RouteRequest { accept_disaggregated: true, ..common::route_request("", &ids, None) };
    let routed = router.route(request).await.unwrap().into_inner();
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
    shutdown(node, engines).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_tier_routes_the_same_fleet_disaggregated() {
    let _serial = common::serial().await;
    use kvmesh_node::config::{ClusterSection, NodeConfig};
    let dir = tempfile::tempdir().unwrap();
    let (engines, replicas) = fleet("vllm").await;
    let ports = common::ports(3);
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let node = NodeSection {
            grpc: format!("127.0.0.1:{}", ports[id as usize - 1]).parse().unwrap(),
            scrape_interval: std::time::Duration::from_millis(50),
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
        }) && nodes.iter().all(|n| n.shared.core().disaggregated(None, None))
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
