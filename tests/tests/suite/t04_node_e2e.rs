//! One router node in front of four engine-sims, real sockets on loopback: KV events flow,
//! repeated prefixes stick to the replica that holds them, a killed engine is routed around,
//! streams pass through, the gRPC API answers, and every booking is released.

use crate::common;

use common::{engines, eventually, replica, section, single};
use kvmesh_engine_sim::EngineSim;
use kvmesh_node::Node;
use kvmesh_proto::v1;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

async fn node(engines: &[EngineSim]) -> Node {
    let replicas = engines.iter().enumerate().map(|(i, e)| replica(i, e)).collect();
    kvmesh_node::start(single(section(), replicas)).await.unwrap()
}

async fn complete(client: &reqwest::Client, node: &Node, prompt: &str) -> (u16, String, Value) {
    let r = client
        .post(format!("http://{}/v1/completions", node.http))
        .json(&json!({"model": "m", "prompt": prompt, "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let replica = r.headers().get("x-kvmesh-replica").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    (status, replica, r.json().await.unwrap_or(Value::Null))
}

fn index_blocks(node: &Node, name: &str) -> usize {
    let core = node.shared.core();
    core.replicas.get(name).map_or(0, |r| core.fleet.index().replica_blocks(r.id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_flow_prefixes_stick_dead_engines_are_routed_around_and_bookings_end() {
    let mut engines = engines(4, 5.0).await;
    let node = node(&engines).await;
    // Every replica scraped once: the node sees them all.
    eventually("first scrapes", || node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some()))
        .await;
    let client = reqwest::Client::new();
    let system = "You are a careful assistant that answers in one short sentence. ".repeat(20);

    let (status, first, body) = complete(&client, &node, &format!("{system}Question 0?")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], " t t t");
    // The engine's BlockStored events reach the node's index for that replica only.
    eventually("KV events", || index_blocks(&node, &first) > 0).await;
    let held = index_blocks(&node, &first);
    assert_eq!(held, (system.len() + 12) / 4 / 16, "every full block of the prompt");
    for other in ["e0", "e1", "e2", "e3"].iter().filter(|n| **n != first) {
        assert_eq!(index_blocks(&node, other), 0);
    }

    // The same long prefix goes back to the replica holding it, and the engine confirms hits.
    for q in 1..=5 {
        let (status, replica, body) = complete(&client, &node, &format!("{system}Question {q}?")).await;
        assert_eq!((status, replica.as_str()), (200, first.as_str()), "question {q}");
        let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        assert!(cached >= 16 * (held as u64 - 1), "question {q}: {cached} cached tokens");
    }

    // Streaming passes through chunk by chunk, ending with [DONE].
    let sse = client
        .post(format!("http://{}/v1/chat/completions", node.http))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(sse.headers()["content-type"], "text/event-stream");
    let text = sse.text().await.unwrap();
    assert_eq!(text.matches("data: ").count(), 6, "4 tokens, the finish chunk, [DONE]: {text}");
    assert!(text.trim_end().ends_with("data: [DONE]"));
    // With stream_options.include_usage (vLLM, OpenAI), a usage chunk with no choices comes
    // before [DONE]; the node passes it through and counts the engine's cached tokens.
    let body = json!({"model": "m", "prompt": "hello there", "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true}});
    let sse = client.post(format!("http://{}/v1/completions", node.http)).json(&body).send().await.unwrap();
    let text = sse.text().await.unwrap();
    let chunks: Vec<&str> = text.split("\n\n").filter(|c| c.starts_with("data: ")).collect();
    assert_eq!(chunks.len(), 6, "3 tokens, the finish chunk, usage, [DONE]: {text}");
    let usage: Value = serde_json::from_str(&chunks[4]["data: ".len()..]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        (usage["usage"]["prompt_tokens"].as_u64(), usage["usage"]["completion_tokens"].as_u64()),
        (Some(3), Some(3))
    );

    // Kill the replica holding the prefix: the next request is served by another one.
    let i: usize = first[1..].parse().unwrap();
    engines.remove(i).stop().await;
    let (status, replica, body) = complete(&client, &node, &format!("{system}Question 6?")).await;
    assert_eq!(status, 200, "{body}");
    assert_ne!(replica, first);

    // gRPC: Admin lists the dead replica as unhealthy; Router routes; health answers.
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await.unwrap();
    let admin = v1::admin_client::AdminClient::new(channel.clone());
    // Marked by the proxy's failed connect when the request tried it first, else by the next
    // refused scrape (100 ms here): polled for up to 5 s.
    let dead_status = || {
        let mut admin = admin.clone();
        let first = first.clone();
        async move {
            let list = admin.list_replicas(v1::ListReplicasRequest {}).await.unwrap().into_inner();
            list.replicas.iter().find(|r| r.spec.as_ref().unwrap().name == first).unwrap().status
        }
    };
    let mut status = dead_status().await;
    for _ in 0..250 {
        if status == v1::ReplicaStatus::Unhealthy as i32 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        status = dead_status().await;
    }
    assert_eq!(status, v1::ReplicaStatus::Unhealthy as i32);
    // Server reflection answers in both versions (grpcurl speaks v1; many clients v1alpha).
    macro_rules! reflected_services {
        ($version:ident) => {{
            use tonic_reflection::pb::$version as r;
            let list = r::ServerReflectionRequest {
                host: String::new(),
                message_request: Some(r::server_reflection_request::MessageRequest::ListServices(String::new())),
            };
            let mut client = r::server_reflection_client::ServerReflectionClient::new(channel.clone());
            let mut answers = client.server_reflection_info(tokio_stream::iter([list])).await.unwrap().into_inner();
            match answers.message().await.unwrap().unwrap().message_response {
                Some(r::server_reflection_response::MessageResponse::ListServicesResponse(l)) => {
                    l.service.into_iter().map(|s| s.name).collect::<Vec<_>>()
                }
                other => panic!("not a service list: {other:?}"),
            }
        }};
    }
    for services in [reflected_services!(v1), reflected_services!(v1alpha)] {
        for name in ["kvmesh.v1.Router", "kvmesh.v1.Admin", "kvmesh.v1.Autoscaler", "grpc.health.v1.Health"] {
            assert!(services.iter().any(|s| s == name), "{name} not in {services:?}");
        }
    }
    let mut router = v1::router_client::RouterClient::new(channel);
    let routed = router
        .route(v1::RouteRequest {
            model: "m".into(),
            prompt: Some(v1::route_request::Prompt::Text(format!("{system}Question 7?"))),
            max_tokens: Some(3),
            session_key: None,
            lora_name: None,
            expected_output_tokens: None,
            cache_salt: None,
            accept_disaggregated: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(routed.replica_id, first);
    assert_eq!(routed.block_size, 16);
    // A stranger cannot end the booking: not with its handle under another token, not with
    // a guessed one (the old sequential ids), not with the id swapped under its tag.
    assert_eq!(routed.booking.len(), 48);
    let mut stranger = v1::ReleaseRequest { booking: routed.booking.clone(), output_tokens: None };
    let mut with_token = tonic::Request::new(stranger.clone());
    with_token.metadata_mut().insert("authorization", "Bearer someone-else".parse().unwrap());
    assert_eq!(router.release(with_token).await.unwrap_err().code(), tonic::Code::PermissionDenied);
    stranger.booking = format!("{:016x}{}", 0u64, &routed.booking[16..]);
    assert_eq!(router.release(stranger.clone()).await.unwrap_err().code(), tonic::Code::PermissionDenied);
    stranger.booking = "1".into();
    assert_eq!(router.release(stranger).await.unwrap_err().code(), tonic::Code::InvalidArgument);
    // Without a token the handle is bound to the caller's address: the same handle from
    // another host (127.0.0.2 stands in for one) is refused.
    let elsewhere = tonic::transport::Endpoint::from_shared(format!("http://{}", node.grpc))
        .unwrap()
        .local_address(Some("127.0.0.2".parse().unwrap()))
        .connect()
        .await
        .unwrap();
    let from_elsewhere = v1::ReleaseRequest { booking: routed.booking.clone(), output_tokens: None };
    let refused = v1::router_client::RouterClient::new(elsewhere).release(from_elsewhere).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    assert_eq!(node.shared.core().fleet.bookings().len(), 1, "the refused releases ended nothing");
    router.release(v1::ReleaseRequest { booking: routed.booking.clone(), output_tokens: Some(3) }).await.unwrap();
    let again = router.release(v1::ReleaseRequest { booking: routed.booking.clone(), output_tokens: None }).await;
    assert_eq!(again.unwrap_err().code(), tonic::Code::NotFound);

    // Every admitted request was released.
    assert!(node.shared.core().fleet.bookings().is_empty());
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_errors_pass_through_and_all_down_is_a_clear_503() {
    let engines = engines(2, 5.0).await;
    let node = node(&engines).await;
    eventually("first scrapes", || node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some()))
        .await;
    let client = reqwest::Client::new();
    // A 400 from the engine reaches the client and does not mark the replica (case C15).
    let r = client
        .post(format!("http://{}/v1/completions", node.http))
        .json(&json!({"model": "m", "prompt": "x", "max_tokens": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert!(node.shared.core().replicas.values().all(|r| r.health.lock().failures == 0));
    // Malformed JSON is the node's own 400; so is JSON that is not an object.
    let r = client.post(format!("http://{}/v1/completions", node.http)).body("{").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let r = client.post(format!("http://{}/v1/completions", node.http)).body("[1, 2]").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["message"], "the body must be a JSON object, not an array");
    // Paths and methods it does not serve get OpenAI-shaped errors too, not empty bodies.
    let r = client.get(format!("http://{}/v1/completions", node.http)).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let r = client.post(format!("http://{}/v1/embeddings", node.http)).body("{}").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "not_found_error", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("no route /v1/embeddings"), "{body}");
    // Every replica down: a 503 with a JSON error, and the node still up (case C16).
    for e in engines {
        e.stop().await;
    }
    let r = client
        .post(format!("http://{}/v1/completions", node.http))
        .json(&json!({"model": "m", "prompt": "hello", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let body: Value = r.json().await.unwrap();
    // Stopping engines may still answer 503 for a moment instead of refusing connections:
    // either way the client learns why, and no replica is left to try.
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("unreachable") || msg.contains("no replica is ready"), "{body}");
    let health = client.get(format!("http://{}/health", node.http)).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 503);
    assert!(node.shared.core().fleet.bookings().is_empty());
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_are_added_drained_and_removed_at_runtime() {
    let engines = engines(2, 5.0).await;
    let node = node(&engines[..1]).await;
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await.unwrap();
    let mut admin = v1::admin_client::AdminClient::new(channel);
    let spec = v1::ReplicaSpec {
        name: "e1".into(),
        http_endpoint: engines[1].base_url(),
        kv_events_endpoint: engines[1].kv_events.clone(),
        replay_endpoint: engines[1].replay.clone(),
        capacity_blocks: 1000,
        block_size: 16,
        ..v1::ReplicaSpec::default()
    };
    let added = admin
        .add_replica(v1::AddReplicaRequest { spec: Some(spec.clone()), starting: false })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(added.spec.unwrap().name, "e1");
    let again =
        admin.add_replica(v1::AddReplicaRequest { spec: Some(spec.clone()), starting: false }).await.unwrap_err();
    assert_eq!(again.code(), tonic::Code::AlreadyExists);
    let bad = v1::ReplicaSpec { name: "e2".into(), block_size: 32, ..spec.clone() };
    assert_eq!(
        admin.add_replica(v1::AddReplicaRequest { spec: Some(bad), starting: false }).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    // Starting replicas live in a cluster's registry.
    let starting = v1::ReplicaSpec { name: "e3".into(), http_endpoint: "http://127.0.0.1:9".into(), ..spec.clone() };
    let e = admin.add_replica(v1::AddReplicaRequest { spec: Some(starting), starting: true }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    // The new replica's actor follows its engine: scraped, then routable.
    eventually("e1 scraped", || {
        node.shared.core().replicas.get("e1").is_some_and(|r| r.health.lock().engine.is_some())
    })
    .await;
    let drained = admin.drain_replica(v1::ReplicaRef { name: "e0".into() }).await.unwrap().into_inner();
    assert_eq!(drained.status, v1::ReplicaStatus::Draining as i32);
    let client = reqwest::Client::new();
    for q in 0..3 {
        let (status, replica, _) = complete(&client, &node, &format!("drained {q}")).await;
        assert_eq!((status, replica.as_str()), (200, "e1"), "nothing goes to the draining replica");
    }
    let back = admin.undrain_replica(v1::ReplicaRef { name: "e0".into() }).await.unwrap().into_inner();
    assert_ne!(back.status, v1::ReplicaStatus::Draining as i32);
    let unknown = admin.undrain_replica(v1::ReplicaRef { name: "nope".into() }).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    admin.remove_replica(v1::ReplicaRef { name: "e1".into() }).await.unwrap();
    let missing = admin.remove_replica(v1::ReplicaRef { name: "e1".into() }).await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    let names: Vec<String> = admin
        .list_replicas(v1::ListReplicasRequest {})
        .await
        .unwrap()
        .into_inner()
        .replicas
        .into_iter()
        .map(|r| r.spec.unwrap().name)
        .collect();
    assert_eq!(names, vec!["e0"]);
    let config = admin.get_config(v1::GetConfigRequest {}).await.unwrap().into_inner().toml;
    assert!(config.contains("name = \"e0\"") && !config.contains("name = \"e1\""), "{config}");
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_replica_actor_is_restarted_alone_and_reload_syncs_the_replica_list() {
    use kvmesh_node::replica::actor::ReplicaMsg;
    use kvmesh_node::replica::SupervisorMsg;
    let engines = engines(2, 5.0).await;
    let node = node(&engines).await;
    let children = || async { ractor::call!(node.supervisor, SupervisorMsg::Children).unwrap() };
    let before = children().await;
    assert_eq!(before.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["e0", "e1"]);
    // e0's actor fails (as when one of its tasks dies): the supervisor restarts it after its
    // backoff; e1's actor is untouched.
    before[0].1.cast(ReplicaMsg::TaskEnded("test", "injected failure".into())).unwrap();
    let t0 = Instant::now();
    let after = loop {
        let now = children().await;
        if now.len() == 2 && now[0].1.get_id() != before[0].1.get_id() {
            break now;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "not restarted: {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(after[1].1.get_id(), before[1].1.get_id(), "the other replica's actor kept running");
    // A reload with e1 removed and e2 added stops one actor and starts another.
    let mut config = node.shared.config.lock().unwrap().clone();
    config.replicas.retain(|r| r.name != "e1");
    let mut e2 = config.replicas[0].clone();
    e2.name = "e2".into();
    e2.http = engines[1].base_url();
    e2.kv_events = Some(engines[1].kv_events.clone());
    config.replicas.push(e2);
    node.reload(&config).await.unwrap();
    let names: Vec<String> = children().await.into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec!["e0", "e2"]);
    // On a single node the file is the registry: a reload puts back what the admin API drained.
    node.shared.set_draining("e0", true).unwrap();
    assert!(node.shared.core().replicas["e0"].draining());
    node.reload(&config).await.unwrap();
    assert!(!node.shared.core().replicas["e0"].draining(), "a listed replica stays drained after a reload");
    // ... but not what the autoscaler drained to release (`drain_on_scale_down`).
    node.shared.autoscaler.record_local(kvmesh_node::autoscaler::Decision {
        pool: "default".into(),
        desired_replicas: 1,
        reason: "scale down".into(),
        ready: 2,
        starting: 0,
        forecast_tokens_per_s: 0.0,
        demand_tokens_per_s: 0.0,
        capacity_tokens_per_s: 1.0,
        panic: false,
        at: 0.0,
        log_index: 0,
        drain: vec!["e2".into()],
        base_log_index: 0,
        cold_start_s: 0.0,
    });
    node.shared.set_draining("e0", true).unwrap();
    node.shared.set_draining("e2", true).unwrap();
    node.reload(&config).await.unwrap();
    let draining = |name: &str| node.shared.core().replicas[name].draining();
    assert!(!draining("e0") && draining("e2"), "reload undrains e0 only, not the autoscaler's e2");
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

mod proxy;
