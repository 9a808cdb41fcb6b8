//! The registry state machine's unit tests.

use super::*;

fn replica(name: &str) -> ReplicaConfig {
    ReplicaConfig {
        name: name.into(),
        http: format!("http://{name}:8000"),
        kv_events: None,
        replay: None,
        kv_events_bind: false,
        metrics_url: None,
        capacity_blocks: 100,
        engine: "vllm".into(),
        model: None,
        block_size: None,
        data_parallel_rank: None,
        lora_adapters: None,
        data_parallel_size: None,
        role: Default::default(),
        bootstrap_port: None,
    }
}

#[test]
fn only_the_newest_removed_replicas_are_remembered() {
    let mut s = ClusterState::default();
    let names: Vec<String> = (0..MAX_REMOVED + 6).map(|i| format!("pod-{i:03}")).collect();
    let seed = Command::Seed {
        replicas: names.iter().map(|n| replica(n)).collect(),
        policy: "token_load".into(),
        params: Default::default(),
    };
    assert_eq!(s.apply(&seed, 1), CommandResult::default());
    for (i, n) in names.iter().enumerate() {
        assert_eq!(s.apply(&Command::RemoveReplica { name: n.clone() }, 2 + i as u64), CommandResult::default());
    }
    // The 6 removed first are forgotten; the last 64 stay as removed.
    let kept: Vec<&String> = s.replicas.keys().collect();
    assert_eq!(kept.len(), MAX_REMOVED);
    assert_eq!(kept[0], "pod-006");
    assert!(s.replicas.values().all(|e| e.state == ReplicaStatus::Removed));
    // A forgotten name can be registered again like any new one.
    let again = Command::AddReplica { config: replica("pod-000"), starting: false };
    assert_eq!(s.apply(&again, 1000), CommandResult::default());
}

#[test]
fn commands_build_the_registry() {
    let mut s = ClusterState::default();
    assert_eq!(
        s.apply(&Command::AddReplica { config: replica("z"), starting: false }, 0).error.as_deref(),
        Some("the registry is not seeded yet: run `kvmesh cluster init` first")
    );
    assert!(!s.seeded && s.replicas.is_empty());
    let seed = Command::Seed {
        replicas: vec![replica("a"), replica("b")],
        policy: "token_load".into(),
        params: Default::default(),
    };
    assert_eq!(s.apply(&seed, 1), CommandResult::default());
    assert_eq!(s.apply(&seed, 2).error.as_deref(), Some("the registry is already seeded"));
    assert_eq!(
        s.apply(&Command::AddReplica { config: replica("a"), starting: false }, 3).error.as_deref(),
        Some("replica \"a\" already exists")
    );
    let drain = Command::SetReplicaState { name: "b".into(), state: ReplicaStatus::Draining, from: None };
    assert_eq!(s.apply(&drain, 4), CommandResult::default());
    // A start marked done only from `starting`: b is draining, and stays so.
    let ready =
        Command::SetReplicaState { name: "b".into(), state: ReplicaStatus::Ready, from: Some(ReplicaStatus::Starting) };
    assert_eq!(s.apply(&ready, 4).error.as_deref(), Some("replica \"b\" is draining, not starting"));
    assert_eq!(s.apply(&Command::RemoveReplica { name: "a".into() }, 5), CommandResult::default());
    assert_eq!(
        s.apply(&Command::RemoveReplica { name: "a".into() }, 6).error.as_deref(),
        Some("unknown replica \"a\"")
    );
    // A removed name can be registered again.
    assert_eq!(s.apply(&Command::AddReplica { config: replica("a"), starting: false }, 7), CommandResult::default());
    let live: Vec<(&str, ReplicaStatus, u64)> =
        s.live_replicas().map(|e| (e.config.name.as_str(), e.state, e.changed_at)).collect();
    assert_eq!(live, vec![("a", ReplicaStatus::Ready, 7), ("b", ReplicaStatus::Draining, 4)]);
    let set = |policy: &str, params: &[(&str, f64)]| Command::SetPolicy {
        policy: policy.into(),
        params: params.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
    };
    assert!(s.apply(&set("fastest", &[]), 8).error.is_some());
    assert_eq!(
        s.apply(&set("kv_cost", &[("weight", 2.0)]), 8).error.as_deref(),
        Some("invalid policy_params: policy kv_cost has no parameter \"weight\"")
    );
    assert_eq!(s.apply(&set("kv_cost", &[("overlap_weight", 2.0)]), 9), CommandResult::default());
    assert_eq!((s.policy.as_deref(), s.policy_params.get("overlap_weight")), (Some("kv_cost"), Some(&2.0)));
    for i in 0..105 {
        s.apply(&Command::RecordScaleDecision { decision: serde_json::json!(i) }, 10 + i);
    }
    assert_eq!((s.scale_decisions.len(), s.scale_decisions[0].clone()), (100, serde_json::json!(5)));
    // A scale-down drains the live replicas it names, in its own entry; unknown and
    // removed names are skipped.
    s.apply(&Command::AddReplica { config: replica("c"), starting: false }, 200);
    s.apply(&Command::RemoveReplica { name: "b".into() }, 201);
    s.apply(&Command::AddReplica { config: replica("d"), starting: false }, 202);
    // Registered starting in one entry; on the wire only when set.
    let e = Command::AddReplica { config: replica("e"), starting: true };
    assert!(serde_json::to_string(&e).unwrap().contains("\"starting\":true"));
    assert!(!serde_json::to_string(&Command::AddReplica { config: replica("e"), starting: false })
        .unwrap()
        .contains("starting"));
    let mut other = s.clone();
    assert_eq!(other.apply(&e, 202), CommandResult::default());
    assert_eq!(other.replicas["e"].state, ReplicaStatus::Starting);
    let down = |drain: serde_json::Value| Command::RecordScaleDecision {
        decision: serde_json::json!({"desired_replicas": 2, "drain": drain}),
    };
    let states = |s: &ClusterState| -> Vec<(String, ReplicaStatus, u64)> {
        s.replicas.values().map(|e| (e.config.name.clone(), e.state, e.changed_at)).collect()
    };
    // a, c and d serve; down to 2 drains one: removed and unknown names are skipped.
    assert_eq!(s.apply(&down(serde_json::json!(["b", "zz", "a", "c"])), 203), CommandResult::default());
    let after = vec![
        ("a".to_string(), ReplicaStatus::Draining, 203),
        ("b".to_string(), ReplicaStatus::Removed, 201),
        ("c".to_string(), ReplicaStatus::Ready, 200),
        ("d".to_string(), ReplicaStatus::Ready, 202),
    ];
    assert_eq!(states(&s), after);
    let last = s.scale_decisions.last().unwrap();
    assert_eq!((&last["log_index"], &last["drain"]), (&serde_json::json!(203), &serde_json::json!(["a"])));
    // Asked for more than the registry holds above the count: nothing more is drained.
    assert_eq!(s.apply(&down(serde_json::json!(["d"])), 204), CommandResult::default());
    assert_eq!(states(&s), after);
    assert_eq!(s.scale_decisions.last().unwrap()["drain"], serde_json::json!([]));
    // A leader's scale-down decided after the latest decision (204) drains; one decided
    // before it (a second leader that had not seen it) drains nothing.
    let based = |base: u64, desired: u64, drain: serde_json::Value| Command::RecordScaleDecision {
        decision: serde_json::json!({"desired_replicas": desired, "drain": drain, "base_log_index": base}),
    };
    assert_eq!(s.apply(&based(203, 1, serde_json::json!(["c"])), 205), CommandResult::default());
    assert_eq!((states(&s), &s.scale_decisions.last().unwrap()["drain"]), (after.clone(), &serde_json::json!([])));
    assert_eq!(s.apply(&based(205, 1, serde_json::json!(["c"])), 206), CommandResult::default());
    assert_eq!(s.scale_decisions.last().unwrap()["drain"], serde_json::json!(["c"]));
    assert_eq!(states(&s)[2], ("c".to_string(), ReplicaStatus::Draining, 206));
}

#[test]
fn plan_writes_are_compare_and_set_and_carry_token_ids_once() {
    let mut s = ClusterState::default();
    let set = |plan: serde_json::Value, base: Option<u64>| Command::SetReplicationPlan { plan, base_version: base };
    let prefix = |tokens: Option<Vec<u32>>| {
        let mut p = serde_json::json!({"hash": 7, "depth_blocks": 4, "targets": []});
        if let Some(t) = tokens {
            p["tokens"] = t.into();
        }
        p
    };
    // From v0: committed as v1 whatever version the writer put in.
    let first = serde_json::json!({"version": 5, "prefixes": [prefix(Some(vec![1, 2, 3]))]});
    assert_eq!(s.apply(&set(first, Some(0)), 1).error, None);
    assert_eq!(s.replication_plan.as_ref().unwrap()["version"], 1);
    // A writer still on v0 is refused; the next from v1 may leave the known ids out.
    let racing = serde_json::json!({"version": 9, "prefixes": []});
    let refused = s.apply(&set(racing, Some(0)), 2).error.unwrap();
    assert_eq!(refused, "stale replication plan: computed from v0, the committed plan is v1");
    let next = serde_json::json!({"version": 2, "prefixes": [prefix(None)]});
    assert_eq!(s.apply(&set(next, Some(1)), 3).error, None);
    let plan = s.replication_plan.clone().unwrap();
    assert_eq!(
        (plan["version"].as_u64(), plan["prefixes"][0]["tokens"].clone()),
        (Some(2), serde_json::json!([1, 2, 3]))
    );
    // An operator's raw write must be newer.
    let raw = serde_json::json!({"version": 2, "prefixes": []});
    assert_eq!(s.apply(&set(raw, None), 4).error.unwrap(), "stale replication plan: version 2 is not newer than 2");
}

#[test]
fn commands_have_a_stable_json_form() {
    let cmd = Command::SetReplicaState { name: "vllm-0".into(), state: ReplicaStatus::Draining, from: None };
    let json = serde_json::to_string(&cmd).unwrap();
    assert_eq!(json, r#"{"op":"set_replica_state","name":"vllm-0","state":"draining"}"#);
    assert_eq!(serde_json::from_str::<Command>(&json).unwrap(), cmd);
    // Parameters are optional on the wire.
    let set: Command = serde_json::from_str(r#"{"op":"set_policy","policy":"kv_cost"}"#).unwrap();
    assert_eq!(set, Command::SetPolicy { policy: "kv_cost".into(), params: Default::default() });
}
