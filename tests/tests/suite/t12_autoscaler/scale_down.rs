//! Capacity measured from the engines, and scale-downs that drain what they release.

use super::*;

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
        admission: AdmissionSection {
            enabled: admission,
            queue_limit: 64,
            max_wait: std::time::Duration::from_millis(30000),
            ttft_slo: None,
        },
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
        autoscaler: {
            let a = autoscaler();
            AutoscalerSection {
                capacity_tokens_per_s: 1e9,
                policy: kvmesh_core::autoscale::AutoscaleConfig {
                    min_replicas: 1,
                    cold_start_s: 0.5,
                    scale_down_delay_s: 1.5,
                    ..a.policy.clone()
                },
                drain_on_scale_down: true,
                ..a
            }
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
    let _serial = common::serial().await;
    use kvmesh_core::ReplicaStatus;
    use kvmesh_node::cluster::registry::Command;
    let dir = tempfile::tempdir().unwrap();
    let engines = engines(3, 20.0).await;
    let replicas: Vec<ReplicaConfig> =
        engines.iter().enumerate().map(|(i, e)| ReplicaConfig { replay: None, ..replica(i, e) }).collect();
    // No load needs more than one replica; the pool holds for 2 s first.
    let a = autoscaler();
    let section = AutoscalerSection {
        capacity_tokens_per_s: 1e9,
        policy: kvmesh_core::autoscale::AutoscaleConfig {
            min_replicas: 1,
            scale_down_delay_s: 2.0,
            ..a.policy.clone()
        },
        drain_on_scale_down: true,
        ..a
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
