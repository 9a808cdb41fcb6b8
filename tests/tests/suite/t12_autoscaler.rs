//! The tier's autoscaler end to end: load through a node makes the leader decide, the decision
//! reaches `kvmesh.v1.Autoscaler` and a KEDA external-scaler client (the proto KEDA speaks),
//! and in a 3-node cluster decisions are Raft entries every node serves, counting a replica
//! registered `starting` as capacity on its way, and surviving the leader; while capacity is
//! short, admission control queues requests and refuses the excess with 429 `Retry-After`, and
//! with a TTFT SLO holds a request that would queue past it.

use crate::common;

use common::{engines, eventually, eventually_within, replica, section};
use kvmesh_core::autoscale::AutoscaleConfig;
use kvmesh_engine_sim::EngineSimConfig;
use kvmesh_node::config::{AutoscalerSection, ClusterSection, NodeConfig, NodeSection, ReplicaConfig};
use kvmesh_node::Node;
use kvmesh_proto::externalscaler as keda;
use kvmesh_proto::v1;

/// Decides every 100 ms; a replica serves 2,000 tokens/s (so a little load needs more).
fn autoscaler() -> AutoscalerSection {
    AutoscalerSection {
        enabled: true,
        capacity_tokens_per_s: 2_000.0,
        policy: AutoscaleConfig { interval_s: 0.1, max_replicas: 8, ..AutoscaleConfig::default() },
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
    let _serial = common::serial().await;
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

mod admission;
mod scale_down;
