//! The tier's autoscaler end to end: load through a node makes the leader decide, the decision
//! reaches `kvmesh.v1.Autoscaler` and a KEDA external-scaler client (the proto KEDA speaks),
//! and in a 3-node cluster decisions are Raft entries every node serves, counting a replica
//! registered `starting` as capacity on its way, and surviving the leader; while capacity is
//! short, admission control queues requests and refuses the excess with 429 `Retry-After`, and
//! with a TTFT SLO holds a request that would queue past it.

use crate::common;

use common::{engines, eventually, eventually_within, replica, section};
use kvmesh_engine_sim::EngineSimConfig;
use kvmesh_node::config::{AutoscalerSection, ClusterSection, NodeConfig, NodeSection, ReplicaConfig};
use kvmesh_node::Node;
use kvmesh_proto::externalscaler as keda;
use kvmesh_proto::v1;

/// Decides every 100 ms; a replica serves 2,000 tokens/s (so a little load needs more).
fn autoscaler() -> AutoscalerSection {
    AutoscalerSection {
        enabled: true,
        interval_s: 0.1,
        capacity_tokens_per_s: 2_000.0,
        max_replicas: 8,
        ..AutoscalerSection::default()
    }
}

/// 20 routed requests of ~1,000 tokens each through gRPC `Router.Route` (booked, not served).
async fn load(node: &Node) {
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await.unwrap();
    let mut router = v1::router_client::RouterClient::new(ch);
    for i in 0..20u32 {
        let ids: Vec<u32> = (i * 10_000..i * 10_000 + 1_000).collect();
        let req = v1::RouteRequest {
            prompt: Some(v1::route_request::Prompt::TokenIds(v1::TokenIds { ids })),
            max_tokens: Some(16),
            ..Default::default()
        };
        router.route(req).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_makes_a_decision_that_the_autoscaler_api_and_keda_see() {
    let engines = engines(2, 20.0).await;
    let replicas = engines.iter().enumerate().map(|(i, e)| ReplicaConfig { replay: None, ..replica(i, e) }).collect();
    let config = NodeConfig {
        node: section(),
        replicas,
        cluster: None,
        security: Default::default(),
        replication: Default::default(),
        autoscaler: autoscaler(),
        admission: Default::default(),
        limits: Default::default(),
        epp: Default::default(),
    };
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("both replicas ready", || {
        node.shared.core().fleet.replicas().iter().filter(|r| r.routable()).count() == 2
    })
    .await;
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await.unwrap();
    let mut api = v1::autoscaler_client::AutoscalerClient::new(ch.clone());
    let mut keda = keda::external_scaler_client::ExternalScalerClient::new(ch);
    let mut watch = {
        eventually("a first decision", || node.shared.autoscaler.latest().is_some()).await;
        api.watch_decisions(v1::AutoscalerRequest { pool: String::new() }).await.unwrap().into_inner()
    };
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!((first.pool.as_str(), first.ready), ("default", 2));

    // ~17,000 tokens of load in a moment: far more than 2 replicas × 2,000 tokens/s.
    load(&node).await;
    eventually("a scale-up", || node.shared.autoscaler.latest().is_some_and(|d| d.desired_replicas > 2)).await;
    let d = api.get_recommendation(v1::AutoscalerRequest { pool: "default".into() }).await.unwrap().into_inner();
    assert!(d.desired_replicas > 2 && d.desired_replicas <= 8, "{d:?}");
    assert!(["scale_up", "burst"].contains(&d.reason.as_str()), "{d:?}");
    assert!(d.demand_tokens_per_s > 0.0 && d.capacity_tokens_per_s == 2_000.0);
    // The watch saw a change.
    let next = watch.message().await.unwrap().unwrap();
    assert_ne!(next, first);

    // KEDA: one metric, target 1 per replica, valued at the desired count; active.
    let so = keda::ScaledObjectRef { name: "vllm".into(), namespace: "llm".into(), ..Default::default() };
    let spec = keda.get_metric_spec(so.clone()).await.unwrap().into_inner();
    assert_eq!(spec.metric_specs.len(), 1);
    assert_eq!(
        (spec.metric_specs[0].metric_name.as_str(), spec.metric_specs[0].target_size),
        ("kvmesh-desired-replicas", 1)
    );
    let req =
        keda::GetMetricsRequest { scaled_object_ref: Some(so.clone()), metric_name: "kvmesh-desired-replicas".into() };
    let m = keda.get_metrics(req).await.unwrap().into_inner();
    let latest = node.shared.autoscaler.latest().unwrap();
    assert!(
        m.metric_values[0].metric_value >= 3
            && m.metric_values[0].metric_value <= i64::from(latest.desired_replicas.max(8))
    );
    assert!(keda.is_active(so.clone()).await.unwrap().into_inner().result);
    let mut stream = keda.stream_is_active(so).await.unwrap().into_inner();
    assert!(stream.message().await.unwrap().unwrap().result);
    // The decision is on the metrics page.
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&page).unwrap_or_else(|e| panic!("{e}\n{page}"));
    assert!(parsed.families.contains_key("kvmesh_autoscaler_desired_replicas"), "{page}");
    // The dashboard's autoscaler metrics are these.
    for name in common::observability_metrics().iter().filter(|n| n.starts_with("kvmesh_autoscaler_")) {
        assert!(common::serves(&page, name), "deploy/observability names {name}:\n{page}");
    }
    assert!(page.contains("kvmesh_autoscaler_desired_replicas{decision=\"committed\"}"), "{page}");
    // This node's evaluation, every interval, committed or not.
    assert!(page.contains("kvmesh_autoscaler_demand_tokens_per_second{decision=\"evaluated\"}"), "{page}");
    // Unknown pools and metrics are clear errors.
    let e = api.get_recommendation(v1::AutoscalerRequest { pool: "gpu-b".into() }).await.unwrap_err();
    assert_eq!((e.code(), e.message()), (tonic::Code::NotFound, "unknown pool \"gpu-b\"; this tier's is \"default\""));
    // A single node keeps its decisions itself (log index 0), and has no registry for
    // starting replicas.
    let log = api.list_decisions(v1::AutoscalerRequest::default()).await.unwrap().into_inner().decisions;
    assert!(!log.is_empty() && log.iter().all(|d| d.log_index == 0), "{log:?}");
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await.unwrap();
    let e =
        v1::admin_client::AdminClient::new(ch).mark_starting(v1::ReplicaRef { name: "e0".into() }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    node.stop().await;
}

/// Three router nodes in front of `replicas` with `autoscaler`, their Raft state in `dir`;
/// not yet initialised.
async fn three_nodes(dir: &std::path::Path, replicas: &[ReplicaConfig], autoscaler: AutoscalerSection) -> Vec<Node> {
    let ports = common::ports(3);
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let node = NodeSection { grpc: format!("127.0.0.1:{}", ports[id as usize - 1]).parse().unwrap(), ..section() };
        let cluster = ClusterSection {
            id,
            peers: ports.iter().enumerate().map(|(i, p)| format!("{}=127.0.0.1:{p}", i + 1)).collect(),
            data_dir: dir.join(format!("node{id}")),
            insecure: true,
            ..ClusterSection::default()
        };
        let config = NodeConfig {
            node,
            replicas: replicas.to_vec(),
            cluster: Some(cluster),
            security: Default::default(),
            replication: Default::default(),
            autoscaler: autoscaler.clone(),
            admission: Default::default(),
            limits: Default::default(),
            epp: Default::default(),
        };
        nodes.push(kvmesh_node::start(config).await.unwrap());
    }
    nodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_are_raft_entries_count_starting_replicas_and_survive_the_leader() {
    let dir = tempfile::tempdir().unwrap();
    let engines = engines(3, 20.0).await;
    let replicas: Vec<ReplicaConfig> =
        engines.iter().enumerate().map(|(i, e)| ReplicaConfig { replay: None, ..replica(i, e) }).collect();
    let mut nodes = three_nodes(dir.path(), &replicas, autoscaler()).await;
    nodes[0].cluster.as_ref().unwrap().init().await.unwrap();
    // e2 is a replica still starting: not routed to, counted as capacity on its way.
    let ch =
        tonic::transport::Channel::from_shared(format!("http://{}", nodes[0].grpc)).unwrap().connect().await.unwrap();
    let e2 = v1::admin_client::AdminClient::new(ch.clone())
        .mark_starting(v1::ReplicaRef { name: "e2".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(e2.spec.map(|s| s.name).as_deref(), Some("e2"));
    // Its engine answers (what `kvmesh replica ready --wait` waits for), and status says so.
    let mut admin = v1::admin_client::AdminClient::new(ch.clone());
    let mut e2 = v1::Replica::default();
    for _ in 0..400 {
        let list = admin.list_replicas(v1::ListReplicasRequest {}).await.unwrap().into_inner().replicas;
        e2 = list.into_iter().find(|r| r.spec.as_ref().unwrap().name == "e2").unwrap();
        if e2.engine_up {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        (e2.status, e2.idle, e2.engine_up, e2.status_detail.as_str()),
        (
            v1::ReplicaStatus::Starting as i32,
            false,
            true,
            "starting: the engine answers; not routed to until marked ready"
        )
    );
    let committed = |n: &Node| n.cluster.as_ref().unwrap().state.borrow().scale_decisions.len();
    eventually("decisions in Raft on every node", || nodes.iter().all(|n| committed(n) > 0)).await;
    eventually("e2 counted as starting", || {
        nodes.iter().all(|n| n.shared.autoscaler.latest().is_some_and(|d| d.starting == 1 && d.ready == 2))
    })
    .await;
    load(&nodes[1]).await;
    eventually("a scale-up every node serves", || {
        nodes.iter().all(|n| n.shared.autoscaler.latest().is_some_and(|d| d.desired_replicas > 3))
    })
    .await;
    let before = nodes[0].shared.autoscaler.latest().unwrap();
    // The desired count includes e2: asked once, not again while it starts.
    let leader = nodes.iter().position(|n| {
        let c = n.cluster.as_ref().unwrap();
        c.leader().is_some_and(|(id, _)| id == c.id)
    });
    let old = nodes.remove(leader.expect("a leader"));
    let killed_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    old.stop().await;
    eventually("a new leader", || {
        nodes.iter().any(|n| {
            let c = n.cluster.as_ref().unwrap();
            c.leader().is_some_and(|(id, _)| id == c.id)
        })
    })
    .await;
    // The scale-up goes on: e2 has loaded. The new leader commits that (the pool changed),
    // continuing from the last committed decision: the same count, not a second scale-up.
    let ch =
        tonic::transport::Channel::from_shared(format!("http://{}", nodes[0].grpc)).unwrap().connect().await.unwrap();
    let ready = v1::admin_client::AdminClient::new(ch.clone())
        .mark_ready(v1::ReplicaRef { name: "e2".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ready.status, v1::ReplicaStatus::Ready as i32);
    eventually("the new leader decides with e2 ready", || {
        nodes[0].shared.autoscaler.latest().is_some_and(|d| d.at > killed_at && d.starting == 0)
    })
    .await;
    let log = v1::autoscaler_client::AutoscalerClient::new(ch)
        .list_decisions(v1::AutoscalerRequest::default())
        .await
        .unwrap()
        .into_inner()
        .decisions;
    let first_new = log.iter().position(|d| d.at > killed_at).expect("a decision after the kill");
    let last_old = &log[first_new - 1];
    assert!(last_old.desired_replicas >= before.desired_replicas, "{last_old:?} after {before:?}");
    // Not below the last count (nothing lost), not a second scale-up on top of it (one more
    // for the noise of the new leader's own demand samples).
    let kept = |d: &v1::ScaleDecision| {
        (last_old.desired_replicas..=last_old.desired_replicas + 1).contains(&d.desired_replicas)
    };
    assert!(log[first_new..].iter().all(kept), "{log:?}");
    // The audit log: each decision once, by its Raft log index, in order.
    let indices: Vec<u64> = log.iter().map(|d| d.log_index).collect();
    assert!(indices.len() >= 2 && indices[0] > 0, "{indices:?}");
    assert!(indices.windows(2).all(|w| w[0] < w[1]), "{indices:?}");

    for n in nodes {
        n.stop().await;
    }
}

/// A node with admission control (at most 2 waiting) in front of one engine that the router
/// believes holds 40 blocks of KV: one 480-token request (30 blocks plus its output) at a time.
/// Its capacity is set at 200 tokens/s, so `Retry-After` is the backlog's tokens ÷ 200.
/// Bookings not released end after `booking_lease_s`.
async fn short_node(booking_lease_s: f64) -> (Node, Vec<kvmesh_engine_sim::EngineSim>) {
    use kvmesh_node::config::AdmissionSection;
    let engines = engines(1, 20.0).await;
    let replicas = vec![ReplicaConfig { capacity_blocks: 40, replay: None, ..replica(0, &engines[0]) }];
    let config = NodeConfig {
        // The node believes its engine 100,000× slower than an H100: a booking's 480 prompt
        // tokens stay queued (in its estimate) for ~15 minutes, so Retry-After's backlog is
        // exact here however slow the test machine.
        node: NodeSection { booking_lease_s, engine_speed: 1e-5, ..section() },
        replicas,
        cluster: None,
        security: Default::default(),
        replication: Default::default(),
        autoscaler: AutoscalerSection { capacity_tokens_per_s: 200.0, ..Default::default() },
        admission: AdmissionSection { enabled: true, queue_limit: 2, max_wait_s: 10.0, ttft_slo_s: None },
        limits: Default::default(),
        epp: Default::default(),
    };
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("the replica ready", || node.shared.core().fleet.replicas().iter().any(|r| r.routable())).await;
    (node, engines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_capacity_is_short_requests_wait_and_the_excess_gets_429() {
    let (node, _engines) = short_node(600.0).await;
    let http = node.http;
    let send = |i: usize| async move {
        let body = serde_json::json!({"model": "m", "prompt": format!("{i:04}").repeat(480), "max_tokens": 16});
        let r = reqwest::Client::new().post(format!("http://{http}/v1/completions")).json(&body).send().await.unwrap();
        let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_string);
        let status = r.status().as_u16();
        let body: serde_json::Value = r.json().await.unwrap_or_default();
        if status == 429 {
            // OpenAI clients read the type.
            assert_eq!(body["error"]["type"], "rate_limit_exceeded", "{body}");
        }
        (status, retry)
    };
    let calls: Vec<_> = (0..6).map(|i| tokio::spawn(send(i))).collect();
    let mut results = Vec::new();
    for c in calls {
        results.push(c.await.unwrap());
    }
    let ok = results.iter().filter(|(s, _)| *s == 200).count();
    let refused: Vec<_> = results.iter().filter(|(s, _)| *s == 429).collect();
    // One runs, two wait and run after it, the rest are refused at once with Retry-After.
    assert_eq!((ok, refused.len()), (3, 3), "{results:?}");
    // Retry-After: the backlog at 200 tokens/s — the two waiting (496 tokens each) and the
    // booked one's 480 prompt tokens (queued in the node's estimate): 1,472 / 200 → 8 s; or,
    // if a waiter was already booked in the first one's place, one waiting: 976 / 200 → 5 s.
    assert!(refused.iter().all(|(_, r)| matches!(r.as_deref(), Some("5" | "8"))), "{results:?}");
    // Every admitted request was released; nothing waits.
    assert!(node.shared.core().fleet.bookings().is_empty());
    assert_eq!(node.shared.admission.depth(), 0);
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_requests_total{outcome=\"queue_full\"} 3"), "{page}");
    assert!(page.contains("kvmesh_admission_refused_total{outcome=\"queue_full\"} 3"), "{page}");
    // `kvmesh status` counts them too.
    let list = v1::admin_client::AdminClient::new(common::grpc(node.grpc).await)
        .list_replicas(v1::ListReplicasRequest {})
        .await
        .unwrap();
    let a = list.into_inner().admission.unwrap();
    assert_eq!((a.waiting, a.waiting_tokens, a.queue_limit, a.ttft_slo_s), (0, 0, 2, 0.0));
    assert_eq!((a.refused_queue_full, a.refused_evicted_late, a.refused_timeout), (3, 0, 0));
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_route_waits_while_capacity_is_short_and_refuses_the_excess_with_resource_exhausted() {
    let (node, _engines) = short_node(600.0).await;
    let ch = common::grpc(node.grpc).await;
    let route = |i: usize| {
        let mut router = v1::router_client::RouterClient::new(ch.clone());
        async move {
            let text = format!("{i:04}").repeat(480);
            let req = v1::RouteRequest {
                model: "m".into(),
                prompt: Some(v1::route_request::Prompt::Text(text)),
                max_tokens: Some(16),
                session_key: None,
                lora_name: None,
                expected_output_tokens: None,
                cache_salt: None,
                accept_disaggregated: false,
            };
            router.route(req).await.map(|r| r.into_inner().booking)
        }
    };
    let release = |booking: String| {
        let mut router = v1::router_client::RouterClient::new(ch.clone());
        async move { router.release(v1::ReleaseRequest { booking, output_tokens: Some(16) }).await.unwrap() }
    };
    // The first is booked at once; the next two wait (nothing booked for them); the fourth
    // finds the queue full.
    let first = route(0).await.unwrap();
    let second = tokio::spawn(route(1));
    eventually("the second waiting", || node.shared.admission.depth() == 1).await;
    let third = tokio::spawn(route(2));
    eventually("the third waiting", || node.shared.admission.depth() == 2).await;
    assert_eq!(node.shared.core().fleet.bookings().len(), 1);
    let refused = route(3).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(refused.message().contains("the admission queue is full"), "{}", refused.message());
    // The backlog ahead: the first one's 480 prompt tokens queued on the engine (the node's
    // estimate drains one in ~2 s) and the two waiting (480 + 16 output tokens each): about
    // 1,472 tokens at 200 tokens/s, 7.36 s.
    let after = refused.metadata().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_string);
    assert_eq!(after.as_deref(), Some("8"));
    assert!(refused.message().ends_with("retry after 8 s"), "{}", refused.message());
    // Each release lets the next one go, in turn.
    release(first).await;
    let second = second.await.unwrap().unwrap();
    assert_eq!(node.shared.admission.depth(), 1);
    // A caller that gives up while waiting (its call cancelled) leaves the queue.
    let gone = tokio::spawn(route(4));
    eventually("a fourth waiting", || node.shared.admission.depth() == 2).await;
    gone.abort();
    eventually("the fourth's wait abandoned", || node.shared.admission.depth() == 1).await;
    release(second).await;
    let third = third.await.unwrap().unwrap();
    release(third).await;
    assert!(node.shared.core().fleet.bookings().is_empty());
    assert_eq!(node.shared.admission.depth(), 0);
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_admission_refused_total{outcome=\"queue_full\"} 1"), "{page}");
    // Three waited (one gave up), each observed once; the one refused at once by the full
    // queue never waited.
    assert!(page.contains("kvmesh_admission_wait_seconds_count 3\n"), "{page}");
    assert!(page.contains("kvmesh_admission_abandoned_total 1\n"), "{page}");
    assert_eq!(node.shared.admission.refused_total(), (1, 0, 0));
    // A proxied request whose client gives up while it waits counts as disconnected too.
    let held = route(5).await.unwrap();
    let http = node.http;
    let client = tokio::spawn(async move {
        let body = serde_json::json!({"model": "m", "prompt": "0006".repeat(480), "max_tokens": 16});
        reqwest::Client::new().post(format!("http://{http}/v1/completions")).json(&body).send().await
    });
    eventually("the proxied request waiting", || node.shared.admission.depth() == 1).await;
    client.abort();
    eventually("its wait abandoned", || node.shared.admission.depth() == 0).await;
    release(held).await;
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_admission_abandoned_total 2\n"), "{page}");
    assert!(page.contains("kvmesh_requests_total{outcome=\"disconnected\"} 1\n"), "{page}");
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_can_never_fit_is_refused_at_once_not_held() {
    let (node, _engines) = short_node(600.0).await;
    let completions = format!("http://{}/v1/completions", node.http);
    // 480 prompt tokens (30 blocks of 16) and up to 1,000 output tokens (63 blocks), in a
    // replica of 40 blocks. Held, it would wait max_wait_s (10 s) for room that never comes.
    // Token ids are an exact count: 400 at once.
    let ids: Vec<u32> = (0..480).collect();
    let body = serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 1000});
    let r = reqwest::Client::new().post(&completions).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        body["error"]["message"],
        "the prompt (480 tokens) and max_tokens (1000) need 93 KV blocks of 16 tokens; the largest replica holds 40 \
         (capacity_blocks): lower max_tokens or shorten the prompt"
    );
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let req = v1::RouteRequest {
        model: "m".into(),
        prompt: Some(v1::route_request::Prompt::TokenIds(v1::TokenIds { ids })),
        max_tokens: Some(1000),
        session_key: None,
        lora_name: None,
        expected_output_tokens: None,
        cache_salt: None,
        accept_disaggregated: false,
    };
    assert_eq!(router.route(req).await.unwrap_err().code(), tonic::Code::InvalidArgument);
    // Text without a tokenizer is an approximate count: not refused, not held either — sent
    // for the engine to judge (this stand-in serves it).
    let body = serde_json::json!({"model": "m", "prompt": "0000".repeat(480), "max_tokens": 1000});
    let r = reqwest::Client::new().post(&completions).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // A body the router cannot read: 400 saying where, and counted.
    let r =
        reqwest::Client::new().post(&completions).body(r#"{"prompt": "hi", "max_tokens": -1}"#).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("the body is not a JSON completion request: invalid value: integer `-1`"), "{message}");
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_requests_total{outcome=\"too_long\"} 1\n"), "{page}");
    assert!(page.contains("kvmesh_requests_total{outcome=\"bad_request\"} 1\n"), "{page}");
    assert!(page.contains("kvmesh_admission_wait_seconds_count 0\n"), "{page}");
    assert!(node.shared.core().fleet.bookings().is_empty());
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_never_released_ends_at_its_lease_and_the_waiting_one_goes() {
    let (node, _engines) = short_node(1.0).await;
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let route = |i: usize| v1::RouteRequest {
        model: "m".into(),
        prompt: Some(v1::route_request::Prompt::Text(format!("{i:04}").repeat(480))),
        max_tokens: Some(16),
        session_key: None,
        lora_name: None,
        expected_output_tokens: None,
        cache_salt: None,
        accept_disaggregated: false,
    };
    // Booked and never released: it fills the replica.
    let forgotten = router.route(route(0)).await.unwrap().into_inner().booking;
    let mut r2 = router.clone();
    let second = tokio::spawn(async move { r2.route(route(1)).await.map(|r| r.into_inner().booking) });
    eventually("the second waiting", || node.shared.admission.depth() == 1).await;
    // The lease (1 s) ends the forgotten booking, and the second is booked in its place.
    let booked = second.await.unwrap().unwrap();
    assert_ne!(booked, forgotten);
    // Released before its own 1 s lease can end it.
    router.release(v1::ReleaseRequest { booking: booked, output_tokens: None }).await.unwrap();
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_bookings_expired_total 1\n"), "{page}");
    // Releasing it late is an unknown booking, not an error that hurts anything.
    let late = router.release(v1::ReleaseRequest { booking: forgotten, output_tokens: None }).await;
    assert_eq!(late.unwrap_err().code(), tonic::Code::NotFound);
    assert!(node.shared.core().fleet.bookings().is_empty());
    node.stop().await;
}

/// One engine 20× slower than the H100 profile (a 960-token prompt takes ~0.45 s to its first
/// token), known as such to the node, with admission control and `ttft_slo_s`.
async fn slow_node(ttft_slo_s: Option<f64>) -> (Node, kvmesh_engine_sim::EngineSim) {
    use kvmesh_node::config::AdmissionSection;
    let engine = kvmesh_engine_sim::start(EngineSimConfig { speed: 0.05, ..EngineSimConfig::default() }).await.unwrap();
    let config = NodeConfig {
        node: NodeSection { engine_speed: 0.05, ..section() },
        replicas: vec![ReplicaConfig { replay: None, ..replica(0, &engine) }],
        cluster: None,
        security: Default::default(),
        replication: Default::default(),
        autoscaler: Default::default(),
        admission: AdmissionSection { enabled: true, ttft_slo_s, ..AdmissionSection::default() },
        limits: Default::default(),
        epp: Default::default(),
    };
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("the replica ready", || node.shared.core().fleet.replicas().iter().any(|r| r.routable())).await;
    (node, engine)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_ttft_slo_a_request_that_would_queue_past_it_waits_at_the_router() {
    for slo in [Some(0.2), None] {
        let (node, _engine) = slow_node(slo).await;
        let http = node.http;
        let send = |i: usize| {
            tokio::spawn(async move {
                let prompt = format!("{i:04}").repeat(960);
                let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4, "stream": true});
                let r = reqwest::Client::new().post(format!("http://{http}/v1/completions")).json(&body).send();
                let r = r.await.unwrap();
                let status = r.status().as_u16();
                r.bytes().await.unwrap();
                status
            })
        };
        let first = send(0);
        eventually("the first request booked", || node.shared.core().fleet.bookings().len() == 1).await;
        let one = node.shared.core().booked_tokens;
        let second = send(1);
        if slo.is_some() {
            // ~0.45 s of prefill queued ahead of it, more than half the SLO: it waits.
            eventually("the second request held", || node.shared.admission.depth() == 1).await;
            assert_eq!(node.shared.core().fleet.bookings().len(), 1);
            // What `kvmesh status` shows: one waiting, with the first's load (the same size,
            // nothing shared), and the settings.
            let mut admin = v1::admin_client::AdminClient::new(common::grpc(node.grpc).await);
            // A waiter leaves the queue for a moment at each 250 ms re-check: ask again then.
            let mut a = v1::AdmissionState::default();
            for _ in 0..5 {
                let list = admin.list_replicas(v1::ListReplicasRequest {}).await.unwrap().into_inner();
                a = list.admission.unwrap();
                if a.waiting == 1 {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            assert_eq!((a.enabled, a.waiting, a.waiting_tokens as f64), (true, 1, one));
            assert_eq!((a.queue_limit, a.max_wait_s, a.ttft_slo_s), (256, 30.0, 0.2));
            assert_eq!((a.refused_queue_full, a.refused_evicted_late, a.refused_timeout), (0, 0, 0));
        } else {
            eventually("the second request sent", || node.shared.core().fleet.bookings().len() == 2).await;
        }
        assert_eq!((first.await.unwrap(), second.await.unwrap()), (200, 200), "slo {slo:?}");
        assert!(node.shared.core().fleet.bookings().is_empty());
        assert_eq!(node.shared.admission.depth(), 0);
        // The autoscaler's demand counts each request once, however often it was re-routed
        // while it waited (the same prompt size, so twice the first one's load).
        assert_eq!(node.shared.core().booked_tokens, 2.0 * one, "slo {slo:?}");
        // Both (streamed) TTFTs are measured; each is over 0.2 s (0.45 s of prefill alone),
        // counted as over the SLO only when one is set.
        let page = reqwest::get(format!("http://{http}/metrics")).await.unwrap().text().await.unwrap();
        let over = if slo.is_some() { 2 } else { 0 };
        assert!(page.contains("kvmesh_ttft_seconds_count 2\n"), "{page}");
        assert!(page.contains(&format!("kvmesh_ttft_over_slo_total {over}\n")), "{page}");
        // The held request's wait is measured once, when it was routed.
        let waited = if slo.is_some() { 1 } else { 0 };
        assert!(page.contains(&format!("kvmesh_admission_wait_seconds_count {waited}\n")), "{page}");
        node.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_per_replica_is_measured_from_the_engine_while_requests_wait() {
    capacity_is_measured(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_per_replica_is_measured_while_admission_control_holds_the_queue() {
    capacity_is_measured(true).await;
}

/// 40 requests at once to a replica that serves one at a time (a queue of ~3 s: a few busy
/// scrapes even on a loaded machine); with `admission` the router
/// holds all but one (`node.max_num_seqs = 1`), so the engine never reports a queue.
async fn capacity_is_measured(admission: bool) {
    use kvmesh_node::config::AdmissionSection;
    // One sequence at a time, 0.1 ms per prefill token: a replica that queues at once.
    let profile = kvmesh_sim::engine::EngineProfile {
        max_batch: 1,
        prefill_s_per_token: 1e-4,
        ..kvmesh_sim::engine::EngineProfile::h100()
    };
    let engine =
        kvmesh_engine_sim::start(EngineSimConfig { speed: 1.0, profile, ..EngineSimConfig::default() }).await.unwrap();
    let config = NodeConfig {
        node: NodeSection { max_num_seqs: if admission { 1 } else { 256 }, ..section() },
        replicas: vec![ReplicaConfig { replay: None, ..replica(0, &engine) }],
        cluster: None,
        security: Default::default(),
        replication: Default::default(),
        autoscaler: AutoscalerSection { capacity_tokens_per_s: 0.0, ..autoscaler() },
        admission: AdmissionSection { enabled: admission, queue_limit: 64, max_wait_s: 30.0, ttft_slo_s: None },
        limits: Default::default(),
        epp: Default::default(),
    };
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("the replica ready", || node.shared.core().fleet.replicas().iter().any(|r| r.routable())).await;
    // The profile's estimate until the engine has been seen busy.
    assert_eq!(node.shared.autoscaler.capacity_tokens_per_s(-1.0), -1.0);
    let http = node.http;
    let calls: Vec<_> = (0..40)
        .map(|i| {
            tokio::spawn(async move {
                let body = serde_json::json!({"model": "m", "prompt": format!("{i:04} ").repeat(400), "max_tokens": 4});
                reqwest::Client::new().post(format!("http://{http}/v1/completions")).json(&body).send().await.unwrap()
            })
        })
        .collect();
    for c in calls {
        assert_eq!(c.await.unwrap().status(), 200);
    }
    if admission {
        let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
        // All but the first waited (a straggler arriving as a slot frees may not).
        let waited: u32 = page
            .lines()
            .find_map(|l| l.strip_prefix("kvmesh_admission_wait_seconds_count "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!((36..=39).contains(&waited), "{waited} waited: {page}");
    }
    let measured = node.shared.autoscaler.capacity_tokens_per_s(-1.0);
    // Each request: ~500 prompt tokens in one 5.75 + 50 ms step, then 3 decode steps of ~5.8 ms:
    // ~6,900 tokens/s while the queue lasts (6,300 measured here; scrape edges cost a little).
    assert!((4_000.0..9_000.0).contains(&measured), "measured {measured} tokens/s");
    node.stop().await;
}

/// A streamed completion through `node` that runs until the returned response is dropped
/// (10,000 tokens on a slow engine), and the replica serving it.
async fn long_request(node: &Node) -> (reqwest::Response, String) {
    let body = serde_json::json!({"model": "m", "prompt": "hold ".repeat(200), "max_tokens": 10_000, "stream": true});
    let mut r =
        reqwest::Client::new().post(format!("http://{}/v1/completions", node.http)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let replica = r.headers()["x-kvmesh-replica"].to_str().unwrap().to_string();
    // The first chunk: the engine runs it.
    r.chunk().await.unwrap().unwrap();
    (r, replica)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_down_drains_the_replicas_it_releases_and_each_turns_idle() {
    let engines = engines(3, 0.05).await;
    let replicas = engines.iter().enumerate().map(|(i, e)| ReplicaConfig { replay: None, ..replica(i, e) }).collect();
    let config = NodeConfig {
        node: NodeSection { engine_speed: 0.05, ..section() },
        replicas,
        cluster: None,
        security: Default::default(),
        replication: Default::default(),
        // Capacity far above any load here: one replica would do.
        autoscaler: AutoscalerSection {
            capacity_tokens_per_s: 1e9,
            min_replicas: 1,
            cold_start_s: 0.5,
            scale_down_delay_s: 1.5,
            drain_on_scale_down: true,
            ..autoscaler()
        },
        admission: Default::default(),
        limits: Default::default(),
        epp: Default::default(),
    };
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("three replicas ready", || {
        node.shared.core().fleet.replicas().iter().filter(|r| r.routable()).count() == 3
    })
    .await;
    // One request in flight: its replica is the one a scale-down to 1 keeps. Not e2, which
    // the order by name alone would keep too.
    let sent_at = kvmesh_node::replication::unix_now();
    let (response, busy) = loop {
        let (response, busy) = long_request(&node).await;
        if busy != "e2" {
            break (response, busy);
        }
        drop(response);
        eventually("the request on e2 released", || node.shared.core().fleet.bookings().is_empty()).await;
    };
    eventually("a scale-down", || node.shared.autoscaler.all().iter().any(|d| d.reason == "scale_down")).await;
    let all = node.shared.autoscaler.all();
    let down = all.iter().find(|d| d.reason == "scale_down").unwrap();
    assert!(down.at > sent_at, "decided before the request: {down:?}");
    let mut idle_ones: Vec<String> = ["e0", "e1", "e2"].iter().filter(|n| **n != busy).map(|n| n.to_string()).collect();
    idle_ones.sort();
    assert_eq!((down.desired_replicas, down.ready, &down.drain), (1, 3, &idle_ones), "{down:?}");
    // No decision drains the busy one, and none drains twice.
    let drained: Vec<&String> = all.iter().flat_map(|d| &d.drain).collect();
    assert_eq!(drained, idle_ones.iter().collect::<Vec<_>>());

    // The two drained replicas are idle once their engines report so after the drain.
    let admin = v1::admin_client::AdminClient::new(common::grpc(node.grpc).await);
    let list = || {
        let mut admin = admin.clone();
        async move { admin.list_replicas(v1::ListReplicasRequest {}).await.unwrap().into_inner().replicas }
    };
    let view = |rs: &[v1::Replica], name: &str| {
        let r = rs.iter().find(|r| r.spec.as_ref().unwrap().name == name).unwrap();
        (v1::ReplicaStatus::try_from(r.status).unwrap(), r.idle, r.status_detail.clone())
    };
    let idle_detail = "idle: nothing in flight, safe to release".to_string();
    for _ in 0..400 {
        let rs = list().await;
        if idle_ones.iter().all(|n| view(&rs, n).1) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let rs = list().await;
    for n in &idle_ones {
        assert_eq!(view(&rs, n), (v1::ReplicaStatus::Draining, true, idle_detail.clone()), "{n}");
    }
    assert_eq!(view(&rs, &busy), (v1::ReplicaStatus::Ready, false, String::new()));
    // Alertable: an idle replica nobody released.
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    for n in &idle_ones {
        assert!(page.contains(&format!("kvmesh_replica_idle{{replica=\"{n}\"}} 1\n")), "{page}");
    }
    assert!(page.contains(&format!("kvmesh_replica_idle{{replica=\"{busy}\"}} 0\n")), "{page}");

    // Draining the busy one by hand: not idle while its request runs, idle once it ends.
    admin.clone().drain_replica(v1::ReplicaRef { name: busy.clone() }).await.unwrap();
    let in_flight = "not idle: 1 routed by the tier unfinished; the engine reports 1 running, 0 waiting".to_string();
    for _ in 0..400 {
        if view(&list().await, &busy).2 == in_flight {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(view(&list().await, &busy), (v1::ReplicaStatus::Draining, false, in_flight));
    drop(response);
    for _ in 0..400 {
        if view(&list().await, &busy).1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(view(&list().await, &busy), (v1::ReplicaStatus::Draining, true, idle_detail));
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_cluster_a_scale_down_drains_through_raft_starting_replicas_first_and_never_twice() {
    use kvmesh_core::ReplicaStatus;
    use kvmesh_node::cluster::registry::Command;
    let dir = tempfile::tempdir().unwrap();
    let engines = engines(3, 20.0).await;
    let replicas: Vec<ReplicaConfig> =
        engines.iter().enumerate().map(|(i, e)| ReplicaConfig { replay: None, ..replica(i, e) }).collect();
    // No load needs more than one replica; the pool holds for 2 s first.
    let section = AutoscalerSection {
        capacity_tokens_per_s: 1e9,
        min_replicas: 1,
        scale_down_delay_s: 2.0,
        drain_on_scale_down: true,
        ..autoscaler()
    };
    let mut nodes = three_nodes(dir.path(), &replicas[..2], section).await;
    nodes[0].cluster.as_ref().unwrap().init().await.unwrap();
    // e2 is registered starting, in one entry (never routed to): the scale-down cancels it
    // first.
    let spec = v1::ReplicaSpec {
        name: "e2".into(),
        http_endpoint: replicas[2].http.clone(),
        kv_events_endpoint: replicas[2].kv_events.clone().unwrap(),
        capacity_blocks: replicas[2].capacity_blocks,
        ..Default::default()
    };
    let e2 = v1::admin_client::AdminClient::new(common::grpc(nodes[1].grpc).await)
        .add_replica(v1::AddReplicaRequest { spec: Some(spec), starting: true })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(e2.status, v1::ReplicaStatus::Starting as i32);
    eventually("e2 starting on every node", || {
        nodes.iter().all(|n| {
            n.shared
                .core()
                .replicas
                .get("e2")
                .is_some_and(|r| r.starting && !r.reported.eq(&kvmesh_core::ReplicaStatus::Ready))
        })
    })
    .await;
    // The replicas drained, in order, and the count the last drain was for: e2 (starting)
    // first, then e0 — in one scale-down to 1, or one to 2 and one to 1 when e2 registered
    // after the policy's window began.
    let drains = |n: &Node| -> (Vec<String>, Option<u32>) {
        let all = n.shared.autoscaler.all();
        let with: Vec<_> = all.iter().filter(|d| !d.drain.is_empty()).collect();
        (with.iter().flat_map(|d| d.drain.clone()).collect(), with.last().map(|d| d.desired_replicas))
    };
    let expected = (vec!["e2".to_string(), "e0".to_string()], Some(1));
    eventually_within("the scale-down on every node", 20, || nodes.iter().all(|n| drains(n) == expected)).await;
    let states = |n: &Node| -> Vec<(String, ReplicaStatus)> {
        n.cluster.as_ref().unwrap().state.borrow().live_replicas().map(|e| (e.config.name.clone(), e.state)).collect()
    };
    let after = vec![
        ("e0".to_string(), ReplicaStatus::Draining),
        ("e1".to_string(), ReplicaStatus::Ready),
        ("e2".to_string(), ReplicaStatus::Draining),
    ];
    eventually("every node applied the drains", || {
        nodes.iter().all(|n| {
            states(n) == after && n.shared.core().fleet.replicas().iter().filter(|r| r.routable()).count() == 1
        })
    })
    .await;
    // The cancelled start is draining, not starting.
    let detail = |n: &Node, name: &str| {
        let core = n.shared.core();
        let r = &core.replicas[name];
        core.status_detail(r, core.status(r, n.shared.now()), n.shared.now())
    };
    let e2 = detail(&nodes[1], "e2");
    assert!(e2.starts_with("not idle: ") || e2.starts_with("idle: "), "{e2}");
    // Its engine comes up after all: marking the start done does not undo the drain.
    let mut admin = v1::admin_client::AdminClient::new(common::grpc(nodes[1].grpc).await);
    let e = admin.mark_ready(v1::ReplicaRef { name: "e2".into() }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(e.message().starts_with("replica \"e2\" is draining (a scale-down cancelled its start"), "{e:?}");
    // A ready replica stays ready; an unknown one is not found.
    let e1 = admin.mark_ready(v1::ReplicaRef { name: "e1".into() }).await.unwrap().into_inner();
    assert_eq!(e1.status, v1::ReplicaStatus::Ready as i32);
    let e = admin.mark_ready(v1::ReplicaRef { name: "e9".into() }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);

    // A scale-down decided before the latest decision (a leader that had not seen it) drains
    // nothing, whatever it names.
    let c = nodes[0].cluster.as_ref().unwrap();
    let stale = serde_json::json!({"pool": "default", "desired_replicas": 0, "reason": "scale_down", "ready": 1,
        "starting": 0, "forecast_tokens_per_s": 0.0, "demand_tokens_per_s": 0.0, "capacity_tokens_per_s": 1e9,
        "panic": false, "at": 0.0, "drain": ["e1"], "base_log_index": 1});
    c.write(Command::RecordScaleDecision { decision: stale }).await.unwrap();
    let last = c.state.borrow().scale_decisions.last().cloned().unwrap();
    assert_eq!(last["drain"], serde_json::json!([]), "{last}");
    assert_eq!(states(&nodes[0]), after);

    // A new leader continues at one replica and drains nothing more.
    let leader = nodes.iter().position(|n| {
        let c = n.cluster.as_ref().unwrap();
        c.leader().is_some_and(|(id, _)| id == c.id)
    });
    let old = nodes.remove(leader.expect("a leader"));
    old.stop().await;
    eventually_within("a new leader", 20, || {
        nodes.iter().any(|n| {
            let c = n.cluster.as_ref().unwrap();
            c.leader().is_some_and(|(id, _)| id == c.id)
        })
    })
    .await;
    // Ten of its evaluations.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    for n in &nodes {
        assert_eq!(drains(n), expected);
        assert_eq!(states(n), after);
    }
    for n in nodes {
        n.stop().await;
    }
}
