//! The node state's unit tests.

use super::*;
use kvmesh_core::index::KvEvent;
use kvmesh_core::load::EngineMetrics;
use kvmesh_core::ReplicaStatus;
use kvmesh_core::RouteRequest;

/// A single node's state with `node` settings and no replica.
fn node(node: crate::config::NodeSection) -> Shared {
    super::test_node(node)
}

/// Registers a replica of 100 blocks at a closed port, with `fields` (TOML) on top.
fn add(shared: &Shared, fields: &str) {
    let replica = format!("{fields}\nhttp = \"http://127.0.0.1:9\"\ncapacity_blocks = 100");
    shared.add_replica(toml::from_str(&replica).unwrap()).unwrap();
}

#[test]
fn a_change_of_status_is_reported_once_with_what_it_means() {
    let shared = node(crate::config::NodeSection::default());
    add(&shared, "name = \"r0\"");
    let mut core = shared.core();
    assert_eq!(core.sync_routable("r0", 1.0), None);
    core.record_down("r0", "connection refused".into(), 1.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Unhealthy);
    // Logged when it changed, not again.
    assert_eq!(core.sync_routable("r0", 1.5), None);
    assert_eq!(core.status_detail(&core.replicas["r0"], ReplicaStatus::Unhealthy, 2.0), "connection refused");
    let metrics = EngineMetrics { running: 0, waiting: 0, kv_usage: 0.0, at: 2.0 };
    core.record_metrics("r0", metrics, None, 2.0, 2.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Ready);
    // An overload mark runs out with time: seen at the next sync.
    core.record_overload("r0", 5.0, 3.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Overloaded);
    assert_eq!(core.sync_routable("r0", 4.0), None);
    assert_eq!(core.sync_routable("r0", 6.0), Some((ReplicaStatus::Overloaded, ReplicaStatus::Ready)));
    assert_eq!(core.sync_routable("nobody", 6.0), None);
}

#[test]
fn status_changes_are_logged_after_the_lock_is_released() {
    let shared = Arc::new(node(crate::config::NodeSection::default()));
    add(&shared, "name = \"r0\"");
    // Each log line's writer records whether the core was free when the line was written.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (s, w) = (shared.clone(), seen.clone());
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || {
            w.lock().unwrap().push(s.core.try_lock().is_some());
            std::io::sink()
        })
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let mut core = shared.core();
        core.record_down("r0", "connection refused".into(), 1.0);
        let queued = core.status_changes.clone();
        assert_eq!(
            queued,
            vec![StatusChange {
                replica: "r0".into(),
                from: ReplicaStatus::Ready,
                to: ReplicaStatus::Unhealthy,
                detail: "connection refused".into()
            }]
        );
        assert!(seen.lock().unwrap().is_empty(), "nothing logged under the lock");
        drop(core);
    });
    assert_eq!(*seen.lock().unwrap(), vec![true]);
    assert!(shared.core().status_changes.is_empty());
}

#[test]
fn an_engine_that_serves_no_token_with_requests_in_flight_is_hung_and_routed_around() {
    let shared =
        node(crate::config::NodeSection { hung_after: std::time::Duration::from_secs(60), ..Default::default() });
    add(&shared, "name = \"r0\"");
    let mut core = shared.core();
    let m = |at| EngineMetrics { running: 1, waiting: 0, kv_usage: 0.1, at };
    let in_flight = |core: &mut Core, n| core.replicas.get_mut("r0").unwrap().proxied = n;
    // Idle for a long while: a counter standing still with nothing in flight is no hang;
    // nor are bookings that are not this node's proxied requests (a gRPC Route caller's).
    core.record_metrics("r0", m(1.0), Some(100.0), 1.0, 1.0);
    let req = RouteRequest {
        prompt_tokens: 64,
        hashes: vec![],
        max_tokens: Some(8),
        prompt_key: 1,
        key: 1,
        streamed: true,
        output_hint: None,
        model: None,
    };
    let decision = core.decide(&req, 100.0).unwrap();
    core.book(&req, decision, 100.0).unwrap();
    core.record_metrics("r0", m(200.0), Some(100.0), 200.0, 200.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Ready);
    // A proxied request in flight from the scrape at 202; the counter still from 1 s on.
    in_flight(&mut core, 1);
    core.record_metrics("r0", m(202.0), Some(100.0), 202.0, 202.0);
    core.record_metrics("r0", m(261.0), Some(100.0), 261.0, 261.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Ready, "59 s: not yet");
    core.record_metrics("r0", m(262.0), Some(100.0), 262.0, 262.0);
    let r = &core.replicas["r0"];
    assert_eq!(r.reported, ReplicaStatus::Unhealthy);
    assert_eq!(
        core.status_detail(r, ReplicaStatus::Unhealthy, 262.0),
        "hung: its engine served no token for 261 s with requests in flight; routed around until it serves \
         again (or tried again once idle for node.hung_after)"
    );
    // Its request times out (504): still out, until nothing of ours was in flight for 60 s.
    in_flight(&mut core, 0);
    core.record_metrics("r0", m(800.0), Some(100.0), 800.0, 800.0);
    core.record_metrics("r0", m(859.0), Some(100.0), 859.0, 859.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Unhealthy, "idle for 59 s");
    core.record_metrics("r0", m(860.0), Some(100.0), 860.0, 860.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Ready, "tried again");
    // Hung again with a request in flight; then it serves: back at once.
    in_flight(&mut core, 1);
    core.record_metrics("r0", m(861.0), Some(100.0), 861.0, 861.0);
    core.record_metrics("r0", m(921.0), Some(100.0), 921.0, 921.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Unhealthy);
    core.record_metrics("r0", m(922.0), Some(140.0), 922.0, 922.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Ready);
    // An SGLang page's counter moves only as requests finish: never judged hung.
    core.replicas["r0"].health.lock().counts_every_step = false;
    core.record_metrics("r0", m(1_100.0), Some(140.0), 1_100.0, 1_100.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Ready);
    drop(core);
    let off = node(crate::config::NodeSection { hung_after: std::time::Duration::ZERO, ..Default::default() });
    add(&off, "name = \"r0\"");
    let mut core = off.core();
    in_flight(&mut core, 1);
    core.record_metrics("r0", m(2.0), Some(100.0), 2.0, 2.0);
    core.record_metrics("r0", m(500.0), Some(100.0), 500.0, 500.0);
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Ready, "0: off");
}

#[test]
fn a_drained_replica_is_idle_after_a_fresh_idle_scrape_or_a_served_counter_standing_still() {
    let shared = node(crate::config::NodeSection::default());
    add(&shared, "name = \"r0\"");
    let busy = |at| EngineMetrics { running: 1, waiting: 0, kv_usage: 0.1, at };
    let mut core = shared.core();
    core.record_metrics("r0", busy(9.0), Some(100.0), 9.0, 9.0);
    let r = core.replicas.get_mut("r0").unwrap();
    r.draining_since = Some(10.0);
    let progress = |core: &Core, now| core.drain_progress(&core.replicas["r0"], now).unwrap();
    // The scrape from before the drain does not count.
    assert_eq!(progress(&core, 10.5).engine, None);
    // One begun after it: busy, its counter unchanged since the drain for 1 s only.
    core.record_metrics("r0", busy(11.0), Some(100.0), 11.0, 11.1);
    let p = progress(&core, 11.1);
    assert_eq!((p.engine, p.stalled, p.idle()), (Some((1, 0)), false, false));
    // The counter moves at 13: the engine is working.
    core.record_metrics("r0", busy(13.0), Some(180.0), 13.0, 13.1);
    core.record_metrics("r0", busy(16.0), Some(180.0), 16.0, 16.1);
    assert!(!progress(&core, 16.1).idle());
    // Still for 5 s (13 to 18): stale gauges, idle — on a vLLM page; SGLang's counter
    // moves only as requests finish, so there it says nothing.
    core.record_metrics("r0", busy(18.0), Some(180.0), 18.0, 18.1);
    core.replicas["r0"].health.lock().counts_every_step = false;
    assert_eq!((progress(&core, 18.1).stalled, progress(&core, 18.1).idle()), (false, false));
    core.replicas["r0"].health.lock().counts_every_step = true;
    let p = progress(&core, 18.1);
    assert_eq!((p.stalled, p.idle()), (true, true));
    assert!(core.replicas["r0"].idle_logged);
    // An idle report is idle at once; undrained, there is no progress to show.
    core.record_metrics(
        "r0",
        EngineMetrics { running: 0, waiting: 0, kv_usage: 0.0, at: 19.0 },
        Some(180.0),
        19.0,
        19.1,
    );
    assert_eq!(progress(&core, 19.1).engine, Some((0, 0)));
    drop(core);
    shared.set_draining("r0", false).unwrap();
    let core = shared.core();
    assert_eq!(core.drain_progress(&core.replicas["r0"], 20.0), None);
}

#[test]
fn a_replica_the_registry_holds_starting_is_out_of_rotation_from_its_first_moment() {
    let shared = node(crate::config::NodeSection::default());
    shared.set_rotation_ahead("s", true, true);
    shared.set_rotation_ahead("d", true, false);
    for name in ["s", "d", "r"] {
        add(&shared, &format!("name = \"{name}\""));
    }
    let core = shared.core();
    let view = |name: &str| {
        let r = &core.replicas[name];
        (core.status(r, 1.0), core.fleet.replica(r.id).unwrap().routable())
    };
    assert_eq!(view("s"), (ReplicaStatus::Starting, false));
    assert_eq!(view("d"), (ReplicaStatus::Draining, false));
    assert_eq!(view("r"), (ReplicaStatus::Ready, true));
    assert!(core.rotation_ahead.is_empty());
}

#[test]
fn a_replica_registered_without_capacity_is_starting_until_its_engine_reports_one() {
    let shared = node(crate::config::NodeSection::default());
    shared.add_replica(toml::from_str("name = \"r0\"\nhttp = \"http://127.0.0.1:9\"").unwrap()).unwrap();
    add(&shared, "name = \"r1\"");
    let view = |core: &Core, name: &str| {
        let r = &core.replicas[name];
        (
            core.status(r, 1.0),
            core.fleet.replica(r.id).unwrap().routable(),
            core.fleet.replica(r.id).unwrap().spec.capacity_blocks,
        )
    };
    let mut core = shared.core();
    let detail = |core: &Core| core.status_detail(&core.replicas["r0"], ReplicaStatus::Starting, 1.0);
    // Before its engine's first page.
    assert_eq!(view(&core, "r0"), (ReplicaStatus::Starting, false, 0));
    assert_eq!(
        detail(&core),
        "waiting for its engine to report its KV capacity (num_gpu_blocks of vllm:cache_config_info at \
         http://127.0.0.1:9/metrics): capacity_blocks is not configured; not routed to until then"
    );
    // Its engine answers, but its page does not say how many KV blocks it allocated.
    let metrics = EngineMetrics { running: 0, waiting: 0, kv_usage: 0.0, at: 1.0 };
    core.record_metrics("r0", metrics, None, 1.0, 1.0);
    assert_eq!(view(&core, "r0"), (ReplicaStatus::Starting, false, 0));
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Starting);
    assert_eq!(
        detail(&core),
        "capacity_blocks is not configured and its engine's metrics page (http://127.0.0.1:9/metrics) does not \
         report its KV capacity (no vllm:cache_config_info num_gpu_blocks: an SGLang engine never does): set \
         capacity_blocks; not routed to until then"
    );
    // Its page reports a KV cache of no blocks: said as such, not as "waiting".
    core.replicas["r0"].health.lock().engine_kv_blocks = Some(0);
    assert_eq!(
        detail(&core),
        "capacity_blocks is not configured and its engine's metrics page (http://127.0.0.1:9/metrics) reports \
         num_gpu_blocks 0 (vllm:cache_config_info): no KV cache to route to; check the engine, or set \
         capacity_blocks; not routed to until then"
    );
    assert_eq!(view(&core, "r0"), (ReplicaStatus::Starting, false, 0));
    // Its engine says: the scrape takes its figure.
    core.replicas["r0"].health.lock().engine_kv_blocks = Some(2_000);
    assert_eq!(core.learn_capacity("r0", 2_000, 2.0), Some(0));
    assert_eq!(core.learn_capacity("r0", 2_000, 2.5), None, "changed once");
    assert_eq!(view(&core, "r0"), (ReplicaStatus::Ready, true, 2_000));
    assert_eq!(core.replicas["r0"].reported, ReplicaStatus::Ready, "synced at once");
    // A restarted engine that sized its cache anew is followed.
    assert_eq!(core.learn_capacity("r0", 1_800, 3.0), Some(2_000));
    assert_eq!(view(&core, "r0").2, 1_800);
    // A configured capacity is the operator's: the engine's figure does not replace it.
    assert_eq!(core.learn_capacity("r1", 2_000, 3.0), None);
    assert_eq!(view(&core, "r1").2, 100);
}

#[test]
fn the_policy_goes_by_its_canonical_name() {
    // `kv-cost` is `kv_cost`: one label value per policy in metrics and status.
    let shared = node(crate::config::NodeSection { policy: "kv-cost".into(), ..Default::default() });
    assert_eq!(&*shared.policy_name(), "kv_cost");
    shared.set_policy(" round-robin", &Default::default()).unwrap();
    assert_eq!(&*shared.policy_name(), "round_robin");
    assert!(shared.set_policy("fastest", &Default::default()).is_err());
    assert_eq!(&*shared.policy_name(), "round_robin");
}

#[test]
fn a_kv_event_owed_longer_than_events_silent_s_means_no_events() {
    let shared =
        node(crate::config::NodeSection { events_silent: std::time::Duration::from_secs(10), ..Default::default() });
    let replica =
        "name = \"e\"\nhttp = \"http://127.0.0.1:9\"\nkv_events = \"tcp://127.0.0.1:9\"\ncapacity_blocks = 100";
    shared.add_replica(toml::from_str(replica).unwrap()).unwrap();
    let mut core = shared.core();
    let status = |core: &Core, at: f64| core.status(&core.replicas["e"], at);
    // A request that began at 100 s filled new blocks; no event has come.
    core.served_new_blocks("e", 100.0);
    assert_eq!(status(&core, 105.0), ReplicaStatus::Ready);
    assert_eq!(status(&core, 110.5), ReplicaStatus::NoEvents);
    // An event settles it.
    let id = core.replicas["e"].id;
    assert!(shared.index.write().apply(id, KvEvent::Cleared).is_some());
    core.events_applied("e", id, AppliedBatch { accepted: 1, rejected: 0, heard: true, usable: true }, 111.0);
    assert_eq!(status(&core, 112.0), ReplicaStatus::Ready);
    // A request that began before that event owes nothing more.
    core.served_new_blocks("e", 105.0);
    assert_eq!(status(&core, 200.0), ReplicaStatus::Ready);
    // Sparse traffic: one request, and no event for 10 s, is enough.
    core.served_new_blocks("e", 300.0);
    assert_eq!(status(&core, 311.0), ReplicaStatus::NoEvents);
}

#[test]
fn a_peers_demand_counts_by_its_increase_and_starts_over_when_the_peer_restarts() {
    let shared = node(crate::config::NodeSection::default());
    let mut core = shared.core();
    let mut seen = |peer: u64, incarnation: u64, demand: f64| {
        core.peer_demand(peer, incarnation, demand);
        core.booked_tokens
    };
    // A peer's first report is its base: what it counted before this node heard it.
    assert_eq!(seen(2, 7, 100.0), 0.0);
    // The same report again (a summary-only batch) adds nothing; a lost batch loses nothing.
    assert_eq!(seen(2, 7, 100.0), 0.0);
    assert_eq!(seen(2, 7, 250.0), 150.0);
    assert_eq!(seen(3, 1, 40.0), 150.0);
    assert_eq!(seen(3, 1, 65.0), 175.0);
    // Node 2 restarted: its count starts over from 0.
    assert_eq!(seen(2, 9, 30.0), 205.0);
    assert_eq!(seen(2, 9, f64::NAN), 205.0);
    assert_eq!(seen(2, 9, 10.0), 205.0);
    assert_eq!(core.own_demand_tokens, 0.0);
}

#[test]
fn a_decision_reads_the_published_index_and_never_waits_for_its_writer() {
    // Dynamo's cost: the replica caching more of the prompt is cheaper, whatever the load.
    let shared = Arc::new(node(crate::config::NodeSection { policy: "kv_cost".into(), ..Default::default() }));
    add(&shared, "name = \"r0\"\nkv_events = \"tcp://127.0.0.1:9\"");
    add(&shared, "name = \"r1\"\nkv_events = \"tcp://127.0.0.1:9\"");
    let tokens: Vec<u32> = (0..64).collect();
    let hasher = shared.settings.hasher;
    let req = RouteRequest::new(&hasher, &tokens, Some(1));
    let id1 = shared.core().replicas["r1"].id;
    // Both replicas' streams have begun (a clear each): they are routed on their events.
    for name in ["r0", "r1"] {
        let id = shared.core().replicas[name].id;
        assert!(shared.index.write().apply(id, kvmesh_core::index::KvEvent::Cleared).is_some());
        let batch = AppliedBatch { accepted: 1, rejected: 0, heard: true, usable: true };
        shared.core().events_applied(name, id, batch, 0.5);
    }
    // r1 stores the prompt's first three blocks; its writer is not done yet.
    let mut writer = shared.index.write();
    let store = kvmesh_core::index::KvEvent::Stored(kvmesh_core::index::Stored {
        block_hashes: (1..=3).map(kvmesh_core::EngineBlockHash).collect(),
        parent: None,
        token_ids: tokens[..48].to_vec(),
        block_size: 16,
        medium: kvmesh_core::Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        kv_group: None,
    });
    assert_eq!(writer.apply(id1, store).unwrap().stored, 3);
    // A decision on another thread meanwhile: it does not wait, and sees none of it.
    let decide = |shared: &Arc<Shared>, req: &RouteRequest| {
        let (shared, req) = (shared.clone(), req.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(shared.core().decide(&req, 1.0).unwrap()).unwrap());
        rx.recv_timeout(std::time::Duration::from_secs(10)).expect("the decision waited for the index's writer")
    };
    assert_eq!(decide(&shared, &req).overlap_blocks, 0);
    // Done: the next decision sees all three blocks on r1, and takes it.
    drop(writer);
    let d = decide(&shared, &req);
    assert_eq!((d.replica, d.overlap_blocks), (id1, 3));
}
