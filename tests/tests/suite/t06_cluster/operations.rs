//! A cluster in operation: gossip under loss, nodes joining and leaving, its metrics, one
//! mapping of keys to replicas on every node.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_bookings_converge_with_10_percent_of_gossip_lost() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let engines = engines(2, 5.0).await;
    let replicas: Vec<ReplicaConfig> = engines.iter().enumerate().map(|(i, e)| replica(i, e)).collect();
    let ports = ports(3);
    let nodes = start_all(&ports, dir.path(), &replicas, true).await;
    for n in &nodes {
        n.cluster.as_ref().unwrap().faults.set(false, 0.1);
    }
    let mut clients = Vec::new();
    for n in &nodes {
        clients.push(v1::router_client::RouterClient::new(grpc(n.grpc).await));
    }
    // 300 bookings spread over the nodes; every other one released, a third of the rest at
    // their first token.
    let mut live = 0;
    for i in 0..300u32 {
        let c = &mut clients[i as usize % 3];
        let req = v1::RouteRequest {
            prompt: Some(v1::route_request::Prompt::TokenIds(v1::TokenIds {
                ids: (i * 1000..i * 1000 + 100).collect(),
            })),
            max_tokens: Some(16),
            ..Default::default()
        };
        let r = c.route(req).await.unwrap().into_inner();
        if i % 2 == 0 {
            c.release(v1::ReleaseRequest { booking: r.booking.clone(), output_tokens: Some(16) }).await.unwrap();
        } else {
            live += 1;
            if i % 3 == 0 {
                c.first_token(v1::FirstTokenRequest { booking: r.booking.clone() }).await.unwrap();
            }
        }
        if i % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let all: Vec<&Node> = nodes.iter().collect();
    // Per node: per replica (prefilling, decoding).
    let loads = || -> Vec<Vec<(u32, u32)>> {
        all.iter()
            .map(|n| {
                let core = n.shared.core();
                core.fleet
                    .replicas()
                    .iter()
                    .map(|r| {
                        let l = core.fleet.bookings().load(r.id);
                        (l.prefilling, l.decoding)
                    })
                    .collect()
            })
            .collect()
    };
    // Every node holds exactly the live bookings, with the same load per replica everywhere
    // (first tokens included).
    let took = eventually("every node holds exactly the live bookings, alike", || {
        all.iter().all(|n| n.shared.core().fleet.bookings().len() == live) && loads().windows(2).all(|w| w[0] == w[1])
    })
    .await;
    println!("converged on {live} live bookings {:.0} ms after the last delta", took.as_secs_f64() * 1e3);
    let l = loads();
    let decoding: u32 = l[0].iter().map(|x| x.1).sum();
    assert_eq!(decoding, 50, "every third of the 150 live bookings had its first token: {l:?}");
    for n in nodes {
        n.stop().await;
    }
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_from_a_snapshot_becomes_a_voter_and_leaves() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let engines = engines(2, 5.0).await;
    let replicas: Vec<ReplicaConfig> = engines.iter().enumerate().map(|(i, e)| replica(i, e)).collect();
    let all_ports = ports(5);
    let ports3 = &all_ports[..3];
    let mut nodes = start_all(ports3, dir.path(), &replicas, true).await;
    nodes[0].cluster.as_ref().unwrap().init().await.unwrap();
    let c1 = nodes[0].cluster.as_ref().unwrap().clone();
    // 30 writes with snapshot_every = 20: a snapshot is taken and the log before it purged.
    for i in 0..30 {
        let policy = if i % 2 == 0 { "kv_cost" } else { "token_load" };
        let cmd =
            kvmesh_node::cluster::registry::Command::SetPolicy { policy: policy.into(), params: Default::default() };
        c1.write(cmd).await.unwrap();
    }
    let all: Vec<&Node> = nodes.iter().collect();
    eventually("a snapshot and a purged log on every node", || {
        all.iter().all(|n| {
            let m = n.cluster.as_ref().unwrap().raft.metrics().borrow().clone();
            m.snapshot.is_some() && m.purged.is_some()
        })
    })
    .await;

    // Node 4 starts empty (no peers) and joins through a follower: it must be sent the
    // snapshot (its missing log is purged), then becomes a voter.
    let mut config4 = config(4, &all_ports, dir.path(), vec![], true);
    config4.cluster.as_mut().unwrap().peers.clear();
    let n4 = kvmesh_node::start(config4).await.unwrap();
    let leader = leader_of(&all).unwrap();
    let follower = nodes.iter().find(|n| n.cluster.as_ref().unwrap().id != leader).unwrap();
    let mut cf = v1::cluster_client::ClusterClient::new(grpc(follower.grpc).await);
    let status = cf
        .join(v1::JoinRequest { node_id: 4, addr: format!("127.0.0.1:{}", all_ports[3]) })
        .await
        .unwrap()
        .into_inner();
    let roles: Vec<(u64, String)> = status.members.iter().map(|m| (m.node_id, m.role.clone())).collect();
    assert_eq!(roles, vec![(1, "voter".into()), (2, "voter".into()), (3, "voter".into()), (4, "voter".into())]);
    eventually("node 4 follows the registry and policy", || {
        has_replica(&n4, "e0") && has_replica(&n4, "e1") && &*n4.shared.policy_name() == "token_load"
    })
    .await;
    let m4 = n4.cluster.as_ref().unwrap().raft.metrics().borrow().clone();
    assert!(m4.snapshot.is_some(), "node 4 caught up from a snapshot");

    // Joining again at the same address changes nothing; an id taken at another address, and a
    // node that does not answer, are refused and leave the membership as it was.
    let ids = |s: &v1::ClusterStatus| s.members.iter().map(|m| (m.node_id, m.role.clone())).collect::<Vec<_>>();
    let again = cf.join(v1::JoinRequest { node_id: 4, addr: format!("127.0.0.1:{}", all_ports[3]) }).await;
    assert_eq!(ids(&again.unwrap().into_inner()), roles);
    let taken = cf.join(v1::JoinRequest { node_id: 3, addr: "127.0.0.1:9".into() }).await.unwrap_err();
    assert_eq!(taken.code(), tonic::Code::FailedPrecondition, "{taken:?}");
    assert!(
        taken.message().starts_with(&format!("node 3 is already a voter at 127.0.0.1:{}", all_ports[2])),
        "{taken:?}"
    );
    let nobody = cf.join(v1::JoinRequest { node_id: 5, addr: "127.0.0.1:9".into() }).await.unwrap_err();
    assert_eq!(nobody.code(), tonic::Code::FailedPrecondition, "{nobody:?}");
    // The last error the leader met names the cause (here nothing listens).
    let m = nobody.message();
    assert!(m.starts_with("node 5 at 127.0.0.1:9 did not answer within 5 s (last error: Unavailable: "), "{m}");
    assert!(m.ends_with("): not added (start it with --id 5 first, then join)"), "{m}");
    // (The follower may apply the learner's removal a moment after the leader answered.)
    let mut status = cf.status(v1::ClusterStatusRequest {}).await.unwrap().into_inner();
    for _ in 0..100 {
        if ids(&status) == roles {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        status = cf.status(v1::ClusterStatusRequest {}).await.unwrap().into_inner();
    }
    assert_eq!(ids(&status), roles);

    // And leaves again.
    // (As above: the node answering may apply the removal a moment after the leader did.)
    let members = |s: &v1::ClusterStatus| s.members.iter().map(|m| m.node_id).collect::<Vec<_>>();
    let mut status = cf
        .leave(v1::LeaveRequest { node_id: 4, removed_notice: false, membership_index: 0 })
        .await
        .unwrap()
        .into_inner();
    for _ in 0..100 {
        if members(&status) == [1, 2, 3] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        status = cf.status(v1::ClusterStatusRequest {}).await.unwrap().into_inner();
    }
    assert_eq!(members(&status), vec![1, 2, 3]);
    // The leader tells the node it removed, which would otherwise never learn it (nothing
    // more is replicated to it): it reports not ready, "removed", and its Raft stops.
    eventually("node 4 knows it was removed", || n4.cluster.as_ref().unwrap().removed()).await;
    let health = reqwest::get(format!("http://{}/health", n4.http)).await.unwrap();
    assert_eq!(health.status(), 503);
    assert_eq!(health.json::<serde_json::Value>().await.unwrap()["status"], "removed");
    assert!(nodes.iter().all(|n| !n.cluster.as_ref().unwrap().removed()), "only node 4 was removed");
    // A notice names its receiver: one sent to the wrong node changes nothing there.
    let wrong = cf.leave(v1::LeaveRequest { node_id: 4, removed_notice: true, membership_index: 0 }).await.unwrap_err();
    assert_eq!(wrong.code(), tonic::Code::InvalidArgument, "{wrong:?}");
    assert!(!follower.cluster.as_ref().unwrap().removed());
    // The removal is recorded in its data_dir: restarted, it stays out of Raft and not ready.
    n4.stop().await;
    let mut again = config(4, &all_ports, dir.path(), vec![], true);
    again.cluster.as_mut().unwrap().peers.clear();
    let n4 = kvmesh_node::start(again).await.unwrap();
    assert!(n4.cluster.as_ref().unwrap().removed());
    assert!(!kvmesh_node::health::Readiness::of(&n4.shared).ready());
    let unknown =
        cf.leave(v1::LeaveRequest { node_id: 9, removed_notice: false, membership_index: 0 }).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::FailedPrecondition, "{unknown:?}");
    n4.stop().await;

    // A node removed while it is down learns it from the members when it comes back (the
    // leader's notice found nobody): node 5 joins, stops, is removed, and is started again.
    let mut config5 = config(5, &all_ports, dir.path(), vec![], true);
    config5.cluster.as_mut().unwrap().peers.clear();
    let n5 = kvmesh_node::start(config5.clone()).await.unwrap();
    cf.join(v1::JoinRequest { node_id: 5, addr: format!("127.0.0.1:{}", all_ports[4]) }).await.unwrap();
    let follows = |n: &Node| n.cluster.as_ref().unwrap().leader().is_some_and(|(id, _)| id != 5);
    eventually("node 5 follows the leader", || follows(&n5)).await;
    n5.stop().await;
    cf.leave(v1::LeaveRequest { node_id: 5, removed_notice: false, membership_index: 0 }).await.unwrap();
    // On another port, so the leader's retried notice cannot reach it: it must ask.
    config5.node.grpc = format!("127.0.0.1:{}", ports(1)[0]).parse().unwrap();
    let n5 = kvmesh_node::start(config5).await.unwrap();
    assert!(!n5.cluster.as_ref().unwrap().removed(), "not told yet: its data_dir has no removal recorded");
    eventually("node 5 learns it was removed", || n5.cluster.as_ref().unwrap().removed()).await;
    assert!(!kvmesh_node::health::Readiness::of(&n5.shared).ready());
    assert!(nodes.iter().all(|n| !n.cluster.as_ref().unwrap().removed()), "only node 5 was removed");
    n5.stop().await;
    for n in nodes.drain(..) {
        n.stop().await;
    }
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_metrics_are_valid_openmetrics() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let engines = engines(1, 5.0).await;
    let replicas = vec![replica(0, &engines[0])];
    let ports = ports(3);
    let nodes = start_all(&ports, dir.path(), &replicas, true).await;
    nodes[0].cluster.as_ref().unwrap().init().await.unwrap();
    let all: Vec<&Node> = nodes.iter().collect();
    eventually("gossip heard from both peers", || all.iter().all(|n| n.shared.core().remote.peers().count() == 2))
        .await;
    // One request, for the per-replica request families to have a series.
    eventually("the replica ready", || kvmesh_node::health::Readiness::of(&nodes[1].shared).routable == 1).await;
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", nodes[1].http))
        .json(&serde_json::json!({"prompt": "one request", "max_tokens": 2, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await.unwrap();
    let page = reqwest::get(format!("http://{}/metrics", nodes[1].http)).await.unwrap().text().await.unwrap();
    let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&page).unwrap_or_else(|e| panic!("{e}\n{page}"));
    for family in [
        "kvmesh_raft_term",
        "kvmesh_gossip_peer_bookings",
        "kvmesh_gossip_peer_age_seconds",
        "kvmesh_gossip_batches_sent",
    ] {
        assert!(parsed.families.contains_key(family), "{family} missing:\n{page}");
    }
    // The shipped dashboard and alert rules chart and alert on metrics a node serves (the
    // autoscaler's, which this tier does not run, in t12).
    let named = common::observability_metrics();
    assert!(named.len() >= 15, "{named:?}");
    for name in named.iter().filter(|n| !n.starts_with("kvmesh_autoscaler_")) {
        assert!(common::serves(&page, name), "deploy/observability names {name}, not a series on the page:\n{page}");
    }
    let leader = leader_of(&all).unwrap();
    assert!(page.contains(&format!("kvmesh_raft_leader_id {leader}\n")), "{page}");
    assert!(page.contains("kvmesh_raft_voters 3\n"), "{page}");
    let id = |n: &Node| n.cluster.as_ref().unwrap().id;
    let (me, gone) = (id(&nodes[1]), id(&nodes[2]));
    let up = |page: &str, peer: u64| {
        page.lines()
            .find_map(|l| l.strip_prefix(&format!("kvmesh_gossip_peer_up{{peer=\"{peer}\"}} ")))
            .map(str::to_string)
    };
    assert_eq!(up(&page, gone).as_deref(), Some("1"), "{page}");
    assert_eq!(up(&page, me), None, "no series for the node itself");
    // A peer that goes silent keeps its series: down, its age growing past the timeout.
    let mut nodes = nodes;
    nodes.pop().unwrap().stop().await;
    let t0 = Instant::now();
    let page = loop {
        let page = reqwest::get(format!("http://{}/metrics", nodes[1].http)).await.unwrap().text().await.unwrap();
        if up(&page, gone).as_deref() == Some("0") {
            break page;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "peer {gone} still up:\n{page}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let age = page
        .lines()
        .find_map(|l| l.strip_prefix(&format!("kvmesh_gossip_peer_age_seconds{{peer=\"{gone}\"}} ")))
        .map(|v| v.parse::<f64>().unwrap());
    assert!(age.is_some_and(|a| a > 5.0), "{page}");
    // Its bookings series stays too (0: dropped when it went silent), and `cluster status`
    // shows its age, not a blank.
    let bookings = format!("kvmesh_gossip_peer_bookings{{peer=\"{gone}\"}} 0\n");
    assert!(page.contains(&bookings), "{page}");
    let mut cluster = v1::cluster_client::ClusterClient::new(grpc(nodes[1].grpc).await);
    let status = cluster.status(v1::ClusterStatusRequest {}).await.unwrap().into_inner();
    let silent = status.members.iter().find(|m| m.node_id == gone).unwrap();
    assert!(silent.gossip_age_s.is_some_and(|a| a > 5.0), "{status:?}");
    let mine = status.members.iter().find(|m| m.node_id == me).unwrap();
    assert_eq!(mine.gossip_age_s, None, "no gossip age for the node itself");
    for n in nodes {
        n.stop().await;
    }
    for e in engines {
        e.stop().await;
    }
}

/// Case C11 across nodes: consistent hashing sends a key to the same replica whichever node
/// routes it (every node registers the replicas from the same registry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c11_every_node_maps_a_key_to_the_same_replica() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let engines = engines(4, 5.0).await;
    let replicas: Vec<ReplicaConfig> = engines.iter().enumerate().map(|(i, e)| replica(i, e)).collect();
    let ports = ports(3);
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        // Each node's file lists the replicas in a different order; the registry decides.
        let mut mine = replicas.clone();
        mine.rotate_left(id as usize);
        let mut c = config(id, &ports, dir.path(), mine, true);
        c.node.policy = "consistent_hash".into();
        // The subject is the mapping, not health: a scrape that times out on a loaded CI
        // machine must not take a replica out of the ring mid-test.
        c.node.unhealthy_after = 1_000;
        nodes.push(kvmesh_node::start(c).await.unwrap());
    }
    nodes[2].cluster.as_ref().unwrap().init().await.unwrap();
    let all: Vec<&Node> = nodes.iter().collect();
    eventually("seeded and scraped everywhere", || {
        all.iter().all(|n| {
            n.cluster.as_ref().unwrap().state.borrow().seeded
                && n.shared.core().replicas.len() == 4
                && n.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some())
        })
    })
    .await;
    let mut maps = Vec::new();
    for n in &nodes {
        // Bounded-load hashing moves a key off a loaded replica: let the previous node's
        // releases reach every node first, so all decide on the same (empty) load.
        eventually("no booking anywhere", || all.iter().all(|n| n.shared.core().fleet.bookings().is_empty())).await;
        let mut router = v1::router_client::RouterClient::new(grpc(n.grpc).await);
        let mut map = Vec::new();
        for key in 0..40 {
            let req = v1::RouteRequest {
                prompt: Some(v1::route_request::Prompt::TokenIds(v1::TokenIds { ids: vec![1, 2, 3] })),
                session_key: Some(format!("user-{key}")),
                ..Default::default()
            };
            let r = router.route(req).await.unwrap().into_inner();
            router.release(v1::ReleaseRequest { booking: r.booking.clone(), output_tokens: None }).await.unwrap();
            map.push(r.replica_id);
        }
        maps.push(map);
    }
    assert!(maps.windows(2).all(|w| w[0] == w[1]), "{maps:?}");
    let mut used = maps[0].clone();
    used.sort();
    used.dedup();
    assert!(used.len() >= 3, "40 keys over 4 replicas used only {used:?}");
    for n in nodes {
        n.stop().await;
    }
    for e in engines {
        e.stop().await;
    }
}
