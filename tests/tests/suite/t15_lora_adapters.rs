//! LoRA adapters on one tier: a request for an adapter (HTTP `model: NAME`, gRPC `lora_name`)
//! is routed on the overlap of blocks stored under that adapter only (vLLM's `BlockStored`
//! carries `lora_name`, and its block hash includes the adapter), and a base-model request
//! never counts an adapter's blocks.

use crate::common;

use common::publisher::{stored_batch, Publisher};
use common::{blocks, eventually_within};
use kvmesh_node::config::NodeSection;
use kvmesh_node::tokenize::Tokenizer;
use kvmesh_proto::v1;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_requests_match_only_their_adapters_blocks() {
    // The prompt, as the node counts its tokens (no tokenizer: the approximate one). Long
    // enough that its prefill (~18 ms here) outweighs the near-equal band (1 ms) in which an
    // idle fleet takes turns whatever it caches.
    let prompt = "sql?".repeat(64 * 16);
    let tokens = Tokenizer::load(None).unwrap().encode(&prompt);
    assert_eq!(tokens.len(), 1024);
    // e0 holds the prompt's 64 blocks under adapter "sql", e1 the same tokens for the base
    // model: their engines' replay buffers say so.
    let (on_sql, on_base) = (Publisher::start().await, Publisher::start().await);
    let (sql_hashes, base_hashes): (Vec<u64>, Vec<u64>) = ((1000..1064).collect(), (2000..2064).collect());
    on_sql.buffer.lock().unwrap().push((0, stored_batch(&sql_hashes, &tokens, Some("sql"), 1.0)));
    on_base.buffer.lock().unwrap().push((0, stored_batch(&base_hashes, &tokens, None, 1.0)));
    let engines = common::engines(2, 20.0).await;
    let mut section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    section.model = "m".into();
    section.lora_adapters = vec!["sql".into(), "chat".into()];
    let node = kvmesh_node::start(common::single(
        section,
        vec![on_sql.replica(0, &engines[0]), on_base.replica(1, &engines[1])],
    ))
    .await
    .unwrap();
    eventually_within("both replicas indexed and ready", 10, || {
        blocks(&node, "e0") == 64
            && blocks(&node, "e1") == 64
            && node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some())
    })
    .await;

    let router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let route = |lora: Option<&str>| common::route_request("m", &tokens, lora);
    // Each booking released at once, so that load never outweighs the overlap asked about.
    let ask = |lora: Option<&'static str>| {
        let mut router = router.clone();
        let request = route(lora);
        async move {
            let routed = router.route(request).await.unwrap().into_inner();
            let release = v1::ReleaseRequest { booking: routed.booking.clone(), output_tokens: Some(4) };
            router.release(release).await.unwrap();
            (routed.replica_id, routed.overlap_blocks)
        }
    };
    assert_eq!(ask(Some("sql")).await, ("e0".to_string(), 64));
    assert_eq!(ask(None).await, ("e1".to_string(), 64));
    // An adapter nobody stored anything under: no overlap anywhere.
    assert_eq!(ask(Some("chat")).await.1, 0);
    let unknown = router.clone().route(route(Some("nope"))).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");

    // Over HTTP the adapter is the request's model; the base model's name is the base.
    let client = reqwest::Client::new();
    for (model, replica) in [("sql", "e0"), ("m", "e1")] {
        let r = client
            .post(format!("http://{}/v1/completions", node.http))
            .json(&json!({"model": model, "prompt": prompt, "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "model {model}");
        let d = node.shared.recent_decisions(1).remove(0);
        assert_eq!(r.headers()["x-kvmesh-replica"], replica, "model {model}: {d:?}");
        assert_eq!((d.replica.as_str(), d.overlap_blocks), (replica, 64), "model {model}");
    }
    let r = client
        .post(format!("http://{}/v1/completions", node.http))
        .json(&json!({"model": "other", "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}
