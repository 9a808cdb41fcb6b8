//! Hot-prefix replication end to end, with engine-sims on loopback: a hot prompt appears, the
//! plan commits, targets are warmed (their KV events show the blocks), traffic spreads across
//! the holders, the prompt cools and the plan is retired; the `Replication` gRPC service
//! (hot prefixes, plan, watch, manual trigger with a transfer sidecar test double); and in a
//! 3-node cluster the plan commits through Raft, every node routes by it, and it survives a
//! leader kill. The multi-process kill -9 version is `chaos/replication_leader_kill.sh`.

use crate::common;

use common::{engines, eventually_within, ports, replica, section};
use kvmesh_core::replication::{ReplicationConfig, SketchConfig};
use kvmesh_engine_sim::EngineSim;
use kvmesh_node::config::{ClusterSection, NodeConfig, NodeSection, ReplicaConfig, ReplicationSection};
use kvmesh_node::Node;
use kvmesh_proto::v1;
use serde_json::json;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Fast settings for tests: plan every 100 ms, counts with a 1 s half-life, cool after 1 s.
fn fast() -> ReplicationSection {
    let d = ReplicationSection::default().plan;
    ReplicationSection {
        enabled: true,
        plan: ReplicationConfig {
            interval_s: 0.1,
            cooldown_s: 1.0,
            warm_timeout_s: 3.0,
            warm_share: 1.0,
            sketch: SketchConfig { half_life_s: 1.0, ..d.sketch },
            ..d
        },
        ..ReplicationSection::default()
    }
}

/// `blocks` full 16-token blocks (4 bytes per approximate token) unique to `tag`.
fn text(tag: &str, blocks: usize) -> String {
    let unit = format!("{tag:>4}");
    unit.repeat(blocks * 16)
}

/// A hot request: the 32-block hot system prompt, then 2 blocks unique to `i`.
fn hot(i: usize) -> String {
    format!("{}{}", text("HOT!", 32), text(&format!("{:04}", i % 10_000), 2))
}

async fn send(node: &Node, prompt: String) -> u16 {
    send_to(node.http, prompt).await
}

async fn send_to(http: std::net::SocketAddr, prompt: String) -> u16 {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 2});
    let r = reqwest::Client::new().post(format!("http://{http}/v1/completions")).json(&body).send().await;
    r.map_or(0, |r| r.status().as_u16())
}

fn plan(node: &Node) -> Arc<kvmesh_core::replication::ReplicationPlan> {
    node.shared.replication.plan()
}

fn confirmed(node: &Node) -> usize {
    plan(node).prefixes.iter().flat_map(|p| &p.targets).filter(|t| t.state.name() == "confirmed").count()
}

/// Replicas whose index holds the hot prompt's 32 blocks.
fn holders(node: &Node) -> Vec<String> {
    let core = node.shared.core();
    let tokens = kvmesh_core::prompt::approximate_tokens(&text("HOT!", 32));
    let chain = core.fleet.hasher().hash_blocks(&tokens);
    let mut names: Vec<String> = core
        .fleet
        .holders(&chain)
        .into_iter()
        .filter_map(|id| core.fleet.replica(id).map(|r| r.spec.name.clone()))
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_prompt_is_planned_warmed_spread_and_retired() {
    let engines = engines(4, 5.0).await;
    let replicas: Vec<ReplicaConfig> = engines.iter().enumerate().map(|(i, e)| replica(i, e)).collect();
    let config = NodeConfig {
        node: section(),
        replicas,
        cluster: None,
        security: Default::default(),
        replication: fast(),
        autoscaler: Default::default(),
        admission: Default::default(),
        limits: Default::default(),
        epp: Default::default(),
    };
    let node = kvmesh_node::start(config).await.unwrap();
    eventually_within("first scrapes", 10, || {
        node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some())
    })
    .await;

    // The hot prompt appears: one request after another (mostly on the first holder by
    // affinity).
    for i in 0..12 {
        assert_eq!(send(&node, hot(i)).await, 200);
    }
    // The plan: the prompt carries all the load on 4 replicas: 1.0 · 4 / 0.7 → all 4, its
    // holders and targets together (a target that already holds it is both).
    eventually_within("the hot prompt planned", 10, || !plan(&node).prefixes.is_empty()).await;
    let p = plan(&node).prefixes[0].clone();
    assert_eq!(p.depth_blocks, 32, "the ladder depth matching the shared prompt exactly");
    assert_eq!(p.want_replicas, 4);
    let mut planned: Vec<&str> =
        p.holders.iter().map(String::as_str).chain(p.targets.iter().map(|t| t.replica.as_str())).collect();
    planned.sort();
    planned.dedup();
    assert_eq!(planned, ["e0", "e1", "e2", "e3"]);
    // Warm-ups land: every target's own KV events show the 32 blocks.
    eventually_within("targets confirmed by their KV events", 10, || confirmed(&node) == p.targets.len()).await;
    assert_eq!(holders(&node), vec!["e0", "e1", "e2", "e3"]);

    // Traffic spreads: 16 concurrent hot requests land on more than one replica, each cached.
    let before = node.shared.recent_decisions(64).len();
    let sends: Vec<_> = (100..116).map(|i| send_to(node.http, hot(i))).collect();
    for s in futures_join(sends).await {
        assert_eq!(s, 200);
    }
    let decisions = node.shared.recent_decisions(64);
    let recent = &decisions[..decisions.len() - before.min(decisions.len())];
    let mut used: Vec<&str> = recent.iter().map(|d| d.replica.as_str()).collect();
    used.sort();
    used.dedup();
    assert!(used.len() >= 2, "hot requests all went to {used:?}");
    assert!(recent.iter().all(|d| d.overlap_blocks >= 32), "every hot request found the prompt cached");

    // Metrics show the plan.
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&page).unwrap_or_else(|e| panic!("{e}\n{page}"));
    for family in [
        "kvmesh_replication_plan_version",
        "kvmesh_replication_plan_prefixes",
        "kvmesh_replication_plan_blocks",
        "kvmesh_replication_targets",
        "kvmesh_replication_warmups",
        "kvmesh_replication_top_prefix_load_share",
    ] {
        assert!(parsed.families.contains_key(family), "{family} missing:\n{page}");
    }
    assert!(page.contains("kvmesh_replication_plan_prefixes 1\n"), "{page}");
    assert!(page.contains(&format!("kvmesh_replication_targets{{state=\"confirmed\"}} {}", p.targets.len())));
    assert!(page.contains("kvmesh_replication_warmups_total{result=\"sent\"}"));

    // Traffic moves on to other prompts: the hot one cools and its plan is retired.
    let t0 = Instant::now();
    let mut i = 0;
    while !plan(&node).prefixes.is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(15), "the plan was never retired");
        send(&node, text(&format!("o{:03}", i % 1000), 8)).await;
        i += 1;
    }
    node.stop().await;
}

/// Waits for every future (a tiny join_all, to avoid a dependency for one test).
async fn futures_join<F: std::future::Future<Output = u16> + Send + 'static>(fs: Vec<F>) -> Vec<u16> {
    let handles: Vec<_> = fs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// A transfer sidecar test double: records each call, and "transfers" by prefilling the
/// target itself (what a real LMCache/NIXL sidecar does by copying blocks).
#[derive(Clone, Default)]
struct Sidecar {
    calls: Arc<Mutex<Vec<v1::TransferRequest>>>,
}

#[tonic::async_trait]
impl v1::replication_transfer_server::ReplicationTransfer for Sidecar {
    async fn transfer(
        &self,
        request: tonic::Request<v1::TransferRequest>,
    ) -> Result<tonic::Response<v1::TransferResponse>, tonic::Status> {
        let r = request.into_inner();
        self.calls.lock().unwrap().push(r.clone());
        let body = json!({"prompt": r.token_ids, "max_tokens": 1});
        let ok =
            reqwest::Client::new().post(format!("{}/v1/completions", r.to_endpoint)).json(&body).send().await.is_ok();
        Ok(tonic::Response::new(v1::TransferResponse { accepted: ok, detail: String::new() }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_service_lists_watches_and_triggers_through_a_transfer_sidecar() {
    let engines = engines(3, 5.0).await;
    let replicas: Vec<ReplicaConfig> = engines.iter().enumerate().map(|(i, e)| replica(i, e)).collect();
    let sidecar = Sidecar::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = sidecar.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(v1::replication_transfer_server::ReplicationTransferServer::new(server))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    });
    let fast = fast();
    let replication = ReplicationSection {
        transfer_endpoint: format!("http://{addr}"),
        // Detection off in practice: only the manual trigger plans.
        plan: ReplicationConfig { min_requests_per_s: 1e9, cooldown_s: 60.0, ..fast.plan.clone() },
        ..fast
    };
    let config = NodeConfig {
        node: section(),
        replicas,
        cluster: None,
        security: Default::default(),
        replication,
        autoscaler: Default::default(),
        admission: Default::default(),
        limits: Default::default(),
        epp: Default::default(),
    };
    let node = kvmesh_node::start(config).await.unwrap();
    eventually_within("first scrapes", 10, || {
        node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some())
    })
    .await;
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await.unwrap();
    let mut client = v1::replication_client::ReplicationClient::new(ch);

    // The hot prompt is served by e-something once (a holder to copy from), then seen again.
    for i in 0..3 {
        assert_eq!(send(&node, hot(i)).await, 200);
    }
    let list = client.list_hot_prefixes(v1::ListHotPrefixesRequest { limit: 50 }).await.unwrap().into_inner();
    assert!(list.enabled);
    assert_eq!((list.routable_replicas, list.nodes.clone()), (3, vec![0]));
    let top = list.prefixes.iter().find(|p| p.depth_blocks == 32).expect("the 32-block prompt is counted");
    assert!(top.warmable && !top.planned);
    assert_eq!(top.tokens, 512);
    assert_eq!(top.holders.len(), 1);
    let holder = top.holders[0].clone();

    let mut watch = client.watch_plan(v1::GetPlanRequest {}).await.unwrap().into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!((first.version, first.prefixes.len()), (0, 0));

    // Trigger by hash onto one chosen replica (the admin API; open here).
    let target = ["e0", "e1", "e2"].into_iter().find(|n| *n != holder).unwrap().to_string();
    let req = v1::TriggerRequest {
        prefix: Some(v1::trigger_request::Prefix::Hash(top.hash)),
        replicas: vec![target.clone()],
    };
    let planned = client.trigger(req).await.unwrap().into_inner();
    assert_eq!(planned.version, 1);
    let p = &planned.prefixes[0];
    assert_eq!((p.origin.as_str(), p.depth_blocks, p.want_replicas), ("manual", 32, 2));
    assert_eq!(p.targets.iter().map(|t| t.replica.as_str()).collect::<Vec<_>>(), vec![target.as_str()]);
    let next = watch.message().await.unwrap().unwrap();
    assert_eq!(next.version, 1, "the watch sees the trigger");

    // The sidecar is asked first, copies from the holder, and the target's events confirm.
    let t0 = Instant::now();
    while confirmed(&node) != 1 {
        let targets: Vec<_> = plan(&node).prefixes.iter().flat_map(|p| p.targets.clone()).collect();
        assert!(t0.elapsed() < Duration::from_secs(10), "target never confirmed: {targets:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let calls = sidecar.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1);
    assert_eq!((calls[0].from_replica.as_str(), calls[0].to_replica.as_str()), (holder.as_str(), target.as_str()));
    assert_eq!((calls[0].depth_blocks, calls[0].token_ids.len()), (32, 512));
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_replication_warmups_total{result=\"transferred\"} 1"), "{page}");

    // Bad triggers are clear.
    let bad = v1::TriggerRequest { prefix: Some(v1::trigger_request::Prefix::Hash(12345)), replicas: vec![] };
    let e = client.trigger(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    let bad = v1::TriggerRequest {
        prefix: Some(v1::trigger_request::Prefix::Text(text("HOT!", 32))),
        replicas: vec!["nope".into()],
    };
    let e = client.trigger(bad).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::InvalidArgument, "invalid replicas: \"nope\" is not a routable replica")
    );
    node.stop().await;
}

/// Requests the engines completed (`vllm:request_success_total`), warm-ups included.
async fn served(engines: &[EngineSim]) -> u64 {
    let mut total = 0;
    for e in engines {
        let page = reqwest::get(format!("{}/metrics", e.base_url())).await.unwrap().text().await.unwrap();
        let line = page.lines().find(|l| l.starts_with("vllm:request_success_total")).unwrap();
        total += line.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64;
    }
    total
}

fn cluster_config(id: u64, ports: &[u16], dir: &Path, replicas: Vec<ReplicaConfig>) -> NodeConfig {
    let node = NodeSection { grpc: format!("127.0.0.1:{}", ports[id as usize - 1]).parse().unwrap(), ..section() };
    let cluster = ClusterSection {
        id,
        peers: ports.iter().enumerate().map(|(i, p)| format!("{}=127.0.0.1:{p}", i + 1)).collect(),
        data_dir: dir.join(format!("node{id}")),
        summary_interval: std::time::Duration::from_millis(200),
        insecure: true,
        ..ClusterSection::default()
    };
    NodeConfig {
        node,
        replicas,
        cluster: Some(cluster),
        security: Default::default(),
        replication: fast(),
        autoscaler: Default::default(),
        admission: Default::default(),
        limits: Default::default(),
        epp: Default::default(),
    }
}

fn leader(nodes: &[&Node]) -> Option<u64> {
    nodes.iter().find_map(|n| {
        let c = n.cluster.as_ref().unwrap();
        c.leader().filter(|(id, _)| *id == c.id).map(|(id, _)| id)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plan_commits_through_raft_and_survives_a_leader_kill() {
    let _serial = common::serial().await;
    let dir = tempfile::tempdir().unwrap();
    let engines = engines(4, 5.0).await;
    let replicas: Vec<ReplicaConfig> = engines.iter().enumerate().map(|(i, e)| replica(i, e)).collect();
    let ports = ports(3);
    let mut nodes = Vec::new();
    for id in 1..=3 {
        nodes.push(kvmesh_node::start(cluster_config(id, &ports, dir.path(), replicas.clone())).await.unwrap());
    }
    let ch =
        tonic::transport::Channel::from_shared(format!("http://{}", nodes[0].grpc)).unwrap().connect().await.unwrap();
    v1::cluster_client::ClusterClient::new(ch).init(v1::InitRequest {}).await.unwrap();
    let all: Vec<&Node> = nodes.iter().collect();
    eventually_within("a leader", 10, || leader(&all).is_some()).await;
    eventually_within("seeded everywhere", 10, || {
        all.iter().all(|n| n.cluster.as_ref().unwrap().state.borrow().seeded)
    })
    .await;

    // Hot traffic arrives at the two followers: the leader plans from their gossiped counts.
    let first = leader(&all).unwrap();
    let followers: Vec<&Node> = nodes.iter().filter(|n| n.cluster.as_ref().unwrap().id != first).collect();
    for i in 0..12 {
        assert_eq!(send(followers[i % 2], hot(i)).await, 200);
    }
    eventually_within("the plan on every node", 10, || all.iter().all(|n| !plan(n).prefixes.is_empty())).await;
    eventually_within("targets confirmed", 10, || {
        let p = plan(&nodes[0]);
        !p.prefixes[0].targets.is_empty() && confirmed(&nodes[0]) == p.prefixes[0].targets.len()
    })
    .await;
    let committed = plan(&nodes[0]);
    let in_raft = nodes[0].cluster.as_ref().unwrap().state.borrow().replication_plan.clone().unwrap();
    assert_eq!(in_raft["version"].as_u64(), Some(committed.version));
    for n in &all {
        assert_eq!(plan(n).prefixes[0].hash, committed.prefixes[0].hash);
    }

    // Kill the leader: a new one takes over with the same plan and keeps it (no re-planning
    // from scratch, no duplicate warm-ups of confirmed targets).
    let idx = nodes.iter().position(|n| n.cluster.as_ref().unwrap().id == first).unwrap();
    let old = nodes.remove(idx);
    old.stop().await;
    let rest: Vec<&Node> = nodes.iter().collect();
    eventually_within("a new leader", 10, || leader(&rest).is_some_and(|l| l != first)).await;
    let new_leader = rest.iter().find(|n| Some(n.cluster.as_ref().unwrap().id) == leader(&rest)).unwrap();
    // A new leader has every committed entry in its log, but may apply the last ones only
    // once it commits one of its own term: wait for that, not for a fixed instant.
    eventually_within("the committed plan applied on the new leader", 10, || {
        plan(new_leader).version >= committed.version
    })
    .await;
    let survived = plan(new_leader);
    assert_eq!(survived.prefixes[0].hash, committed.prefixes[0].hash);
    let sent_before = served(&engines).await;
    // Keep the prompt hot through the new leader's rounds: the plan stays, confirmed.
    for i in 200..210 {
        assert_eq!(send(rest[i % 2], hot(i)).await, 200);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = plan(new_leader);
    assert_eq!(after.prefixes.len(), 1);
    assert_eq!(confirmed(new_leader), after.prefixes[0].targets.len(), "confirmed targets stay confirmed");
    let sent_after = served(&engines).await;
    assert_eq!(sent_after - sent_before, 10, "no warm-up repeated: only the 10 client requests reached engines");

    // A manual trigger through a follower answers with the plan that holds it (committed
    // through the leader; the follower's copy of the plan follows a moment later).
    let follower = rest.iter().find(|n| n.cluster.as_ref().unwrap().id != leader(&rest).unwrap()).unwrap();
    let before = plan(follower).version;
    let ch =
        tonic::transport::Channel::from_shared(format!("http://{}", follower.grpc)).unwrap().connect().await.unwrap();
    let req = v1::TriggerRequest {
        prefix: Some(v1::trigger_request::Prefix::TokenIds(v1::TokenIds { ids: (7_000..7_512).collect() })),
        replicas: vec!["e0".into()],
    };
    let planned = v1::replication_client::ReplicationClient::new(ch).trigger(req).await.unwrap().into_inner();
    assert!(planned.version > before, "v{} after v{before}", planned.version);
    assert_eq!(planned.prefixes.len(), 2, "{planned:?}");
    for n in nodes {
        n.stop().await;
    }
}
