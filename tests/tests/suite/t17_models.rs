//! Several models on one node: each replica serves its declared `model` (default
//! `node.model`), a request (HTTP `model`, gRPC Route's `model`) is routed only among its
//! model's replicas, and overlap counts only blocks of its model's namespace — the same tokens
//! cached for another model, or under a LoRA adapter, are no overlap.

use crate::common;

use common::publisher::{stored_batch, Publisher};
use common::{blocks, eventually_within};
use kvmesh_engine_sim::EngineSimConfig;
use kvmesh_node::config::{NodeSection, ReplicaConfig};
use kvmesh_node::tokenize::Tokenizer;
use kvmesh_proto::v1;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_and_two_adapters_on_four_replicas_never_cross() {
    // One prompt of 64 blocks (the approximate tokenizer's count), cached three ways: e0 for
    // m1 (the default model), e1 for m1's adapter "sql", e2 for m2. e3 (m2) holds nothing.
    let prompt = "sql?".repeat(64 * 16);
    let tokens = Tokenizer::load(None).unwrap().encode(&prompt);
    assert_eq!(tokens.len(), 1024);
    let publishers =
        [Publisher::start().await, Publisher::start().await, Publisher::start().await, Publisher::start().await];
    for (p, lora, first) in [(0, None, 1000), (1, Some("sql"), 2000), (2, None, 3000)] {
        let hashes: Vec<u64> = (first..first + 64).collect();
        publishers[p].buffer.lock().unwrap().push((0, stored_batch(&hashes, &tokens, lora, 1.0)));
    }
    // Engines named as vLLM's --served-model-name would name them.
    let mut engines = Vec::new();
    for model in ["m1", "m1", "m2", "m2", "m3"] {
        let config = EngineSimConfig { model: model.into(), speed: 20.0, ..EngineSimConfig::default() };
        engines.push(kvmesh_engine_sim::start(config).await.unwrap());
    }
    let mut section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    section.model = "m1".into();
    section.lora_adapters = vec!["sql".into(), "chat".into()];
    let replicas: Vec<ReplicaConfig> = (0..4)
        .map(|i| ReplicaConfig { model: (i >= 2).then(|| "m2".to_string()), ..publishers[i].replica(i, &engines[i]) })
        .collect();
    let node = kvmesh_node::start(common::single(section, replicas)).await.unwrap();
    eventually_within("three replicas indexed, all scraped", 10, || {
        ["e0", "e1", "e2"].iter().all(|r| blocks(&node, r) == 64)
            && node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some())
    })
    .await;
    assert_eq!(node.shared.models.counts(), [("m1".to_string(), 2), ("m2".to_string(), 2)].into_iter().collect());

    // gRPC: the model and the adapter select the namespace and the candidates.
    let router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let route = |model: &str, lora: Option<&str>| common::route_request(model, &tokens, lora);
    let ask = |request: v1::RouteRequest| {
        let mut router = router.clone();
        async move {
            let routed = router.route(request).await?.into_inner();
            let release = v1::ReleaseRequest { booking: routed.booking.clone(), output_tokens: Some(4) };
            router.release(release).await.unwrap();
            Ok::<_, tonic::Status>((routed.replica_id, routed.overlap_blocks))
        }
    };
    assert_eq!(ask(route("m1", None)).await.unwrap(), ("e0".to_string(), 64));
    assert_eq!(ask(route("", None)).await.unwrap(), ("e0".to_string(), 64), "no model: the default");
    assert_eq!(ask(route("m1", Some("sql"))).await.unwrap(), ("e1".to_string(), 64));
    assert_eq!(ask(route("sql", None)).await.unwrap(), ("e1".to_string(), 64), "an adapter named as the model");
    assert_eq!(ask(route("m2", None)).await.unwrap(), ("e2".to_string(), 64));
    let (replica, overlap) = ask(route("chat", None)).await.unwrap();
    assert!(["e0", "e1"].contains(&replica.as_str()) && overlap == 0, "{replica} {overlap}");
    let unknown = ask(route("m3", None)).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    assert_eq!(unknown.message(), "model \"m3\" is not served here (this router serves [\"m1\", \"m2\"])");

    // HTTP: 30 distinct prompts, each model in turn; every answer from a replica of its model.
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", node.http);
    let expected = |model: &str| if model == "m2" { ["e2", "e3"] } else { ["e0", "e1"] };
    let mut served = std::collections::BTreeMap::<String, u32>::new();
    for k in 0..30 {
        let model = ["m1", "m2", "sql"][k % 3];
        let body = json!({"model": model, "prompt": format!("request {k} ").repeat(40), "max_tokens": 2});
        let r = client.post(&url).json(&body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "model {model}");
        let replica = r.headers()["x-kvmesh-replica"].to_str().unwrap().to_string();
        assert!(expected(model).contains(&replica.as_str()), "{model} went to {replica}");
        *served.entry(replica).or_default() += 1;
    }
    // Both replicas of each model took some: the model narrows the candidates, it does not pin.
    assert_eq!(served.len(), 4, "{served:?}");
    // The same prompt over HTTP: m2's request finds m2's copy only.
    let r = client.post(&url).json(&json!({"model": "m2", "prompt": prompt, "max_tokens": 2})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let d = node.shared.recent_decisions(1).remove(0);
    assert_eq!((d.replica.as_str(), d.overlap_blocks), ("e2", 64));
    let r = client.post(&url).json(&json!({"model": "m3", "prompt": "x", "max_tokens": 2})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // What the engines were asked for: m2's engines only m2, m1's never m2.
    for (i, e) in engines.iter().take(4).enumerate() {
        let asked = e.asked_models();
        if i >= 2 {
            assert_eq!(asked.keys().collect::<Vec<_>>(), ["m2"], "e{i}: {asked:?}");
        } else {
            assert!(!asked.is_empty() && !asked.contains_key("m2"), "e{i}: {asked:?}");
        }
    }

    // /v1/models lists every model served, one replica of each asked.
    let listed: serde_json::Value =
        client.get(format!("http://{}/v1/models", node.http)).send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = listed["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["m1", "m2"], "{listed}");

    // A replica of a third model registered at run time serves it, and only it.
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await;
    let mut admin = v1::admin_client::AdminClient::new(channel.unwrap());
    let spec = v1::ReplicaSpec {
        name: "e4".into(),
        http_endpoint: engines[4].base_url(),
        kv_events_endpoint: engines[4].kv_events.clone(),
        replay_endpoint: engines[4].replay.clone(),
        capacity_blocks: 1000,
        block_size: 16,
        model: "m3".into(),
        ..v1::ReplicaSpec::default()
    };
    admin.add_replica(v1::AddReplicaRequest { spec: Some(spec), starting: false }).await.unwrap();
    assert_eq!(ask(route("m3", None)).await.unwrap(), ("e4".to_string(), 0));
    let r = client.post(&url).json(&json!({"model": "m3", "prompt": "hello", "max_tokens": 2})).send().await.unwrap();
    assert_eq!((r.status().as_u16(), r.headers()["x-kvmesh-replica"].to_str().unwrap()), (200, "e4"));
    admin.remove_replica(v1::ReplicaRef { name: "e4".into() }).await.unwrap();
    assert_eq!(ask(route("m3", None)).await.unwrap_err().code(), tonic::Code::NotFound);

    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

/// vLLM's `cache_salt` (a tenant's own cache): blocks stored with a salt (vLLM puts it in the
/// first block's `extra_keys`) match only requests with that salt; a block holding an image
/// (a multimodal extra key) matches no request's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salted_and_multimodal_blocks_match_only_what_they_can() {
    use kvmesh_core::index::{ExtraKeys, KvEvent, Stored};
    use kvmesh_core::{EngineBlockHash, Medium};
    use kvmesh_events::encode::{encode_batch, Encoding};
    let prompt = "salt".repeat(64 * 16);
    let tokens = Tokenizer::load(None).unwrap().encode(&prompt);
    let store = |first: u64, extra_keys: Option<ExtraKeys>| {
        let event = KvEvent::Stored(Stored {
            block_hashes: (first..first + 64).map(EngineBlockHash).collect(),
            parent: None,
            token_ids: tokens.clone(),
            block_size: 16,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys,
            kv_group: None,
        });
        bytes::Bytes::from(encode_batch(1.0, &[event], Some(0), Encoding::Map))
    };
    let publishers = [Publisher::start().await, Publisher::start().await, Publisher::start().await];
    let salted = ExtraKeys { cache_salt: Some("tenant-7".into()), unverifiable: vec![] };
    // e2: the same prompt with an image in its 11th block (an extra key no request shows).
    let mut image = vec![0; 64];
    image[10] = 0xfeed;
    let pictured = ExtraKeys { cache_salt: None, unverifiable: image };
    for (p, payload) in [(0, store(1000, Some(salted))), (1, store(2000, None)), (2, store(3000, Some(pictured)))] {
        publishers[p].buffer.lock().unwrap().push((0, payload));
    }
    let engines = common::engines(3, 20.0).await;
    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    let replicas = (0..3).map(|i| publishers[i].replica(i, &engines[i])).collect();
    let node = kvmesh_node::start(common::single(section, replicas)).await.unwrap();
    eventually_within("all indexed and scraped", 10, || {
        ["e0", "e1", "e2"].iter().all(|r| blocks(&node, r) == 64)
            && node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some())
    })
    .await;
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", node.http);
    let ask = |salt: Option<&str>| {
        let mut body = json!({"prompt": prompt, "max_tokens": 2});
        if let Some(s) = salt {
            body["cache_salt"] = s.into();
        }
        let (client, url, node) = (client.clone(), url.clone(), &node);
        async move {
            let r = client.post(&url).json(&body).send().await.unwrap();
            assert_eq!(r.status().as_u16(), 200);
            let d = node.shared.recent_decisions(1).remove(0);
            (d.replica, d.overlap_blocks)
        }
    };
    assert_eq!(ask(Some("tenant-7")).await, ("e0".to_string(), 64));
    // Unsalted: e1's copy in full; e2's only up to its image block.
    assert_eq!(ask(None).await, ("e1".to_string(), 64));
    let (_, other_tenant) = ask(Some("tenant-8")).await;
    assert_eq!(other_tenant, 0);
    let overlaps = {
        let core = node.shared.core();
        let hashes = kvmesh_core::RouteRequest::new(core.fleet.hasher(), &tokens, None).hashes;
        let mut out = Vec::new();
        core.fleet.index().overlaps(&hashes, &mut out);
        out.into_iter().map(|(id, o)| (core.fleet.replica(id).unwrap().spec.name.clone(), o.gpu)).collect::<Vec<_>>()
    };
    assert_eq!(overlaps, [("e1".to_string(), 64), ("e2".to_string(), 10)]);
    // Route takes the salt too.
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let routed = router
        .route(v1::RouteRequest {
            prompt: Some(v1::route_request::Prompt::TokenIds(v1::TokenIds { ids: tokens.clone() })),
            max_tokens: Some(2),
            cache_salt: Some("tenant-7".into()),
            ..v1::RouteRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((routed.replica_id.as_str(), routed.overlap_blocks), ("e0", 64));
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

/// Adapters as engines serve them: each engine-sim loads its own (`--lora-modules`), the node
/// learns them from each engine's `/v1/models` (entries with a `parent`), and a request for an
/// adapter goes only to the replicas serving it; blocks an adapter stored are never another
/// namespace's overlap, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_learned_from_the_engines_go_only_where_they_are_loaded() {
    // m1: e0 serves adapter sql, e1 serves sql and chat; m2: e2 and e3, no adapters.
    let mut engines = Vec::new();
    for (model, adapters) in [("m1", &["sql"][..]), ("m1", &["sql", "chat"]), ("m2", &[]), ("m2", &[])] {
        let lora_modules = adapters.iter().map(|a| a.to_string()).collect();
        let config = EngineSimConfig { model: model.into(), lora_modules, speed: 20.0, ..EngineSimConfig::default() };
        engines.push(kvmesh_engine_sim::start(config).await.unwrap());
    }
    let mut section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    section.model = "m1".into();
    let replicas: Vec<ReplicaConfig> = (0..4)
        .map(|i| ReplicaConfig { model: (i >= 2).then(|| "m2".to_string()), ..common::replica(i, &engines[i]) })
        .collect();
    let node = kvmesh_node::start(common::single(section, replicas)).await.unwrap();
    eventually_within("every engine's adapters listed", 10, || {
        node.shared.core().replicas.values().all(|r| r.listed_adapters.is_some() && r.health.lock().engine.is_some())
    })
    .await;
    let listed: Vec<Vec<String>> = ["e0", "e1", "e2", "e3"]
        .iter()
        .map(|r| node.shared.core().replicas[*r].listed_adapters.clone().unwrap())
        .collect();
    assert_eq!(listed, [vec!["sql"], vec!["chat", "sql"], vec![], vec![]]);
    // The admin API (and `kvmesh status --json`, under `spec.lora_adapters`) shows them.
    let mut admin = v1::admin_client::AdminClient::new(common::grpc(node.grpc).await);
    let list = admin.list_replicas(v1::ListReplicasRequest {}).await.unwrap().into_inner();
    let shown: Vec<Vec<String>> = list.replicas.into_iter().map(|r| r.spec.unwrap().lora_adapters).collect();
    assert_eq!(shown, [vec!["sql"], vec!["chat", "sql"], vec![], vec![]]);

    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", node.http);
    let send = |model: &'static str, prompt: String| {
        let (client, url, node) = (client.clone(), url.clone(), &node);
        async move {
            let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
            let r = client.post(&url).json(&body).send().await.unwrap();
            assert_eq!(r.status().as_u16(), 200, "model {model}");
            let d = node.shared.recent_decisions(1).remove(0);
            (d.replica, d.overlap_blocks)
        }
    };
    // 40 distinct prompts, the four names in turn: none misrouted.
    let allowed = |model: &str| match model {
        "m1" | "sql" => &["e0", "e1"][..],
        "chat" => &["e1"],
        _ => &["e2", "e3"],
    };
    for k in 0..40 {
        let model = ["m1", "m2", "sql", "chat"][k % 4];
        let (replica, _) = send(model, format!("distinct request {k:03} ").repeat(30)).await;
        assert!(allowed(model).contains(&replica.as_str()), "{model} went to {replica}");
    }
    let asked: Vec<_> = engines.iter().map(|e| e.asked_models()).collect();
    assert!(asked[0].keys().all(|m| m == "m1" || m == "sql"), "e0 {:?}", asked[0]);
    assert!(asked[1].keys().all(|m| ["m1", "sql", "chat"].contains(&m.as_str())), "e1 {:?}", asked[1]);
    assert_eq!(asked[1]["chat"], 10, "every chat request ran on e1");
    for e in &asked[2..] {
        assert_eq!(e.keys().collect::<Vec<_>>(), ["m2"]);
    }

    // One 40-block prompt stored under sql: overlap for sql only, never for m1, chat or m2.
    let prompt = "shared prompt body. ".repeat(128);
    let held = |replica: &str| common::blocks(&node, replica);
    let before: Vec<usize> = ["e0", "e1"].map(held).to_vec();
    let (sql_replica, first) = send("sql", prompt.clone()).await;
    assert_eq!(first, 0);
    let before = before[if sql_replica == "e0" { 0 } else { 1 }];
    eventually_within("its blocks indexed", 10, || held(&sql_replica) == before + 40).await;
    assert_eq!(send("sql", prompt.clone()).await, (sql_replica.clone(), 40));
    assert_eq!(send("m1", prompt.clone()).await.1, 0, "the base model never counts the adapter's blocks");
    assert_eq!(send("chat", prompt.clone()).await.1, 0, "nor another adapter");
    assert_eq!(send("m2", prompt.clone()).await.1, 0, "nor another model");
    // gRPC Route with lora_name: the adapter's replicas only, where the chat request above
    // stored the prompt under chat.
    let tokens = Tokenizer::load(None).unwrap().encode(&prompt);
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    eventually_within("chat's copy indexed", 10, || held("e1") >= 40).await;
    for _ in 0..4 {
        let routed = router.route(common::route_request("m1", &tokens, Some("chat"))).await.unwrap().into_inner();
        assert_eq!((routed.replica_id.as_str(), routed.overlap_blocks), ("e1", 40));
        router.release(v1::ReleaseRequest { booking: routed.booking, output_tokens: Some(1) }).await.unwrap();
    }
    let unknown = router.route(common::route_request("m1", &tokens, Some("nope"))).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");

    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

/// Models of different block sizes on one node: m2's engines use 32-token blocks while
/// `node.block_size` (m1's) is 16; each model's events, requests and overlaps are counted in
/// its own blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_counts_its_own_block_size() {
    let mut engines = Vec::new();
    for (model, block_size) in [("m1", 16), ("m2", 32)] {
        let config = EngineSimConfig { model: model.into(), block_size, speed: 20.0, ..EngineSimConfig::default() };
        engines.push(kvmesh_engine_sim::start(config).await.unwrap());
    }
    let mut section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    section.model = "m1".into();
    let replicas = vec![
        common::replica(0, &engines[0]),
        ReplicaConfig { model: Some("m2".into()), block_size: Some(32), ..common::replica(1, &engines[1]) },
    ];
    let node = kvmesh_node::start(common::single(section, replicas)).await.unwrap();
    eventually_within("scraped", 10, || node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some()))
        .await;
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", node.http);
    // 640 tokens: 40 blocks of 16, 20 of 32.
    let prompt = "sized:..".repeat(320);
    let send = |model: &'static str| {
        let (client, url, node, prompt) = (client.clone(), url.clone(), &node, prompt.clone());
        async move {
            let r = client.post(&url).json(&json!({"model": model, "prompt": prompt, "max_tokens": 2})).send().await;
            assert_eq!(r.unwrap().status().as_u16(), 200);
            let d = node.shared.recent_decisions(1).remove(0);
            (d.replica, d.overlap_blocks)
        }
    };
    assert_eq!(send("m2").await, ("e1".to_string(), 0));
    eventually_within("m2's 20 blocks of 32", 10, || blocks(&node, "e1") == 20).await;
    assert_eq!(send("m2").await, ("e1".to_string(), 20));
    assert_eq!(send("m1").await, ("e0".to_string(), 0));
    eventually_within("m1's 40 blocks of 16", 10, || blocks(&node, "e0") == 40).await;
    assert_eq!(send("m1").await, ("e0".to_string(), 40));
    // Neither replica is reported with a block-size mismatch.
    let now = node.shared.now();
    for name in ["e0", "e1"] {
        let core = node.shared.core();
        assert_eq!(core.status(&core.replicas[name], now), kvmesh_core::ReplicaStatus::Ready, "{name}");
    }
    // A third m2 replica in 16-token blocks is refused.
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await;
    let mut admin = v1::admin_client::AdminClient::new(channel.unwrap());
    let spec = v1::ReplicaSpec {
        name: "e2".into(),
        http_endpoint: engines[0].base_url(),
        capacity_blocks: 1000,
        block_size: 16,
        model: "m2".into(),
        ..v1::ReplicaSpec::default()
    };
    let refused = admin.add_replica(v1::AddReplicaRequest { spec: Some(spec), starting: false }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("its model's replicas have 32-token blocks"), "{}", refused.message());
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}
