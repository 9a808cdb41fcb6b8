//! Tokens: admin calls need the admin token, and nodes sharing the cluster token still talk.

use super::*;

/// `[security]`: admin calls need the admin token, nodes talk with the cluster token (Raft,
/// gossip and forwarded writes keep working), and a missing or wrong token is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_guard_admin_calls_and_nodes_still_talk() {
    let _serial = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let (admin_file, cluster_file) = (dir.path().join("admin-token"), dir.path().join("cluster-token"));
    std::fs::write(&admin_file, "operator-secret\n").unwrap();
    std::fs::write(&cluster_file, "node-secret").unwrap();
    let engines = engines(2, 5.0).await;
    let replicas: Vec<ReplicaConfig> = engines.iter().take(1).enumerate().map(|(i, e)| replica(i, e)).collect();
    let ports = ports(3);
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let mut c = config(id, &ports, dir.path(), replicas.clone(), true);
        c.security.admin_token_file = Some(admin_file.clone());
        c.security.cluster_token_file = Some(cluster_file.clone());
        nodes.push(kvmesh_node::start(c).await.unwrap());
    }
    let bearer = |t: &str| tonic::metadata::MetadataValue::try_from(format!("Bearer {t}")).unwrap();
    let mut c1 = v1::cluster_client::ClusterClient::new(grpc(&nodes[0].grpc).await);
    let refused = c1.init(v1::InitRequest {}).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let mut wrong = tonic::Request::new(v1::InitRequest {});
    wrong.metadata_mut().insert("authorization", bearer("node-secret"));
    assert_eq!(
        c1.init(wrong).await.unwrap_err().code(),
        tonic::Code::Unauthenticated,
        "the node token is not an admin token"
    );
    let mut init = tonic::Request::new(v1::InitRequest {});
    init.metadata_mut().insert("authorization", bearer("operator-secret"));
    c1.init(init).await.unwrap();
    // Raft and gossip run with the cluster token.
    let all: Vec<&Node> = nodes.iter().collect();
    eventually("seeded everywhere and gossip heard", || {
        all.iter()
            .all(|n| n.cluster.as_ref().unwrap().state.borrow().seeded && n.shared.core().remote.peers().count() == 2)
    })
    .await;
    // An admin write through a follower is forwarded with the cluster token.
    let leader = leader_of(&all).unwrap();
    let follower = nodes.iter().find(|n| n.cluster.as_ref().unwrap().id != leader).unwrap();
    let mut admin = v1::admin_client::AdminClient::new(grpc(follower.grpc).await);
    let spec = v1::ReplicaSpec {
        name: "e1".into(),
        http_endpoint: engines[1].base_url(),
        capacity_blocks: 100,
        ..Default::default()
    };
    let denied =
        admin.add_replica(v1::AddReplicaRequest { spec: Some(spec.clone()), starting: false }).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::Unauthenticated);
    let mut add = tonic::Request::new(v1::AddReplicaRequest { spec: Some(spec), starting: false });
    add.metadata_mut().insert("authorization", bearer("operator-secret"));
    admin.add_replica(add).await.unwrap();
    eventually("e1 on every node", || all.iter().all(|n| has_replica(n, "e1"))).await;
    assert_eq!(admin.list_replicas(v1::ListReplicasRequest {}).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    // Raft RPCs without the cluster token are refused.
    let mut raft = v1::raft_client::RaftClient::new(grpc(&nodes[0].grpc).await);
    let vote = raft.vote(v1::RaftPayload { json: b"{}".to_vec() }).await.unwrap_err();
    assert_eq!(vote.code(), tonic::Code::Unauthenticated);
    // The nodes' token is not an operator's: a write carrying it, not forwarded, is refused.
    let mut cw = v1::cluster_client::ClusterClient::new(grpc(follower.grpc).await);
    let mut write =
        tonic::Request::new(v1::WriteRequest { command_json: br#"{"op":"set_policy","policy":"kv_cost"}"#.to_vec() });
    write.metadata_mut().insert("authorization", bearer("node-secret"));
    assert_eq!(cw.write(write).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    // A leave sent to a follower is forwarded with the nodes' token: the leader answers on the
    // merits (node 9 is not a member), not with UNAUTHENTICATED.
    let mut leave = tonic::Request::new(v1::LeaveRequest { node_id: 9, removed_notice: false, membership_index: 0 });
    leave.metadata_mut().insert("authorization", bearer("operator-secret"));
    assert_eq!(cw.leave(leave).await.unwrap_err().code(), tonic::Code::FailedPrecondition);
    // The cluster token plus the forwarded mark is not an operator either: an operator write
    // "forwarded" without the operator's own token is refused by the leader itself.
    let leader_node = nodes.iter().find(|n| n.cluster.as_ref().unwrap().id == leader).unwrap();
    let mut cl = v1::cluster_client::ClusterClient::new(grpc(leader_node.grpc).await);
    let mut forged =
        tonic::Request::new(v1::WriteRequest { command_json: br#"{"op":"set_policy","policy":"kv_cost"}"#.to_vec() });
    forged.metadata_mut().insert("authorization", bearer("node-secret"));
    forged.metadata_mut().insert("x-kvmesh-forwarded", "1".parse().unwrap());
    assert_eq!(cl.write(forged).await.unwrap_err().code(), tonic::Code::PermissionDenied);
    assert_eq!(leader_node.shared.policy_name().as_ref(), "token_load", "the forged write changed nothing");
    // Without any token, a forged AppendEntries (a "leader 99") is refused.
    let mut raft_leader = v1::raft_client::RaftClient::new(grpc(&leader_node.grpc).await);
    let append = br#"{"vote":{"leader_id":{"term":99,"node_id":99},"committed":true},"prev_log_id":null,"entries":[],"leader_commit":null}"#;
    let refused = raft_leader.append_entries(v1::RaftPayload { json: append.to_vec() }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    // Message sizes: 5 MiB is refused unread without the nodes' token, read with it (Raft's
    // limit is 64 MiB: here it is read and found no Raft payload), and too large for the
    // public Router (4 MiB).
    let big = vec![b' '; 5 << 20];
    let raft_big = raft_leader.append_entries(v1::RaftPayload { json: big.clone() }).await.unwrap_err();
    assert_eq!(raft_big.code(), tonic::Code::Unauthenticated, "{raft_big:?}");
    let mut with_token = tonic::Request::new(v1::RaftPayload { json: big.clone() });
    with_token.metadata_mut().insert("authorization", bearer("node-secret"));
    let read = raft_leader.append_entries(with_token).await.unwrap_err();
    assert_eq!(read.code(), tonic::Code::InvalidArgument, "{read:?}");
    let mut router = v1::router_client::RouterClient::new(grpc(&leader_node.grpc).await);
    let text = String::from_utf8(big).unwrap();
    let route = v1::RouteRequest { prompt: Some(v1::route_request::Prompt::Text(text)), ..Default::default() };
    let too_big = router.route(route).await.unwrap_err();
    assert_eq!(too_big.code(), tonic::Code::OutOfRange, "{too_big:?}");
    // With tokens on, the topology reads need one: the admin's or the nodes'.
    assert_eq!(c1.status(v1::ClusterStatusRequest {}).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    for t in ["operator-secret", "node-secret"] {
        let mut read = tonic::Request::new(v1::ClusterStatusRequest {});
        read.metadata_mut().insert("authorization", bearer(t));
        c1.status(read).await.unwrap();
    }
    let mut plan = v1::replication_client::ReplicationClient::new(grpc(&nodes[0].grpc).await);
    assert_eq!(plan.get_plan(v1::GetPlanRequest {}).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    // A member restarted with another cluster token: every peer refuses it, so it reports not
    // ready (it would route on a registry it can no longer follow); the others stay ready.
    let third = nodes.pop().unwrap();
    let third_id = third.cluster.as_ref().unwrap().id;
    third.stop().await;
    let other_file = dir.path().join("other-token");
    std::fs::write(&other_file, "not-the-node-secret").unwrap();
    let mut c = config(third_id, &ports, dir.path(), replicas.clone(), true);
    c.security.admin_token_file = Some(admin_file.clone());
    c.security.cluster_token_file = Some(other_file);
    let stray = kvmesh_node::start(c).await.unwrap();
    eventually("every peer refuses the stray node", || stray.cluster.as_ref().unwrap().refused_by_every_peer()).await;
    let health = reqwest::get(format!("http://{}/health", stray.http)).await.unwrap();
    assert_eq!(health.status(), 503);
    assert_eq!(health.json::<serde_json::Value>().await.unwrap()["status"], "cluster_token_refused");
    for n in &nodes {
        assert!(!n.cluster.as_ref().unwrap().refused_by_every_peer(), "one peer of two refusing is not every peer");
        assert!(kvmesh_node::health::Readiness::of(&n.shared).ready());
    }
    stray.stop().await;
    for n in nodes {
        n.stop().await;
    }
    // A cluster without a token (nor mTLS) runs only when asked to be insecure.
    let mut open = config(1, &ports, dir.path(), vec![], true);
    open.cluster.as_mut().unwrap().insecure = false;
    let err = kvmesh_node::start(open).await.err().expect("refused").to_string();
    assert!(err.contains("--insecure") && err.contains("cluster token"), "{err}");
    // An admin token without a cluster token would leave Raft open: the node refuses to start.
    let mut c = config(1, &ports, dir.path(), vec![], true);
    c.security.admin_token_file = Some(admin_file.clone());
    let err = kvmesh_node::start(c).await.err().expect("refused").to_string();
    assert!(err.contains("set cluster_token_file"), "{err}");
    for e in engines {
        e.stop().await;
    }
}
