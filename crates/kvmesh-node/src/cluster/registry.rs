//! The replicated state: the replica registry, the cluster's routing configuration, and the
//! slots later capabilities fill (replication plan, scale decisions). Commands are Raft log
//! entries; [`ClusterState::apply`] is the deterministic state machine every node runs.

use crate::config::ReplicaConfig;
use kvmesh_core::ReplicaStatus;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One registered replica.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegistryEntry {
    /// How to reach and size it.
    pub config: ReplicaConfig,
    /// Its lifecycle state.
    pub state: ReplicaStatus,
    /// The log index of its last change.
    pub changed_at: u64,
}

/// One replicated command (a Raft log entry's payload).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// Fills an empty registry from the bootstrapping node's configuration (once).
    Seed {
        /// Its `[[replicas]]`.
        replicas: Vec<ReplicaConfig>,
        /// Its `node.policy`.
        policy: String,
        /// Its `node.policy_params`.
        #[serde(default)]
        params: BTreeMap<String, f64>,
    },
    /// Registers a replica (ready, or starting). Fails if a live replica has the name.
    AddReplica {
        /// The replica.
        config: ReplicaConfig,
        /// Registered `starting` (its engine still loading) rather than ready: in one entry,
        /// so it is never routed to before its engine serves.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        starting: bool,
    },
    /// Marks a replica removed.
    RemoveReplica {
        /// Its name.
        name: String,
    },
    /// Sets a replica's state (drain, undrain, ready after a start).
    SetReplicaState {
        /// Its name.
        name: String,
        /// The new state.
        state: ReplicaStatus,
        /// Only from this state (else the command is rejected and changes nothing): marking
        /// a start done must not undo a scale-down's drain of that start.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from: Option<ReplicaStatus>,
    },
    /// Changes the routing policy on every node.
    SetPolicy {
        /// A policy name (`kvmesh policies`).
        policy: String,
        /// Its parameters by name; unset ones keep their defaults.
        #[serde(default)]
        params: BTreeMap<String, f64>,
    },
    /// The hot-prefix replication plan (`kvmesh_core::replication::ReplicationPlan` as JSON).
    /// With `base_version` it is a compare-and-set: refused unless the committed plan is still
    /// at that version, and committed as version `base_version + 1` — so a writer working from
    /// an older plan (a deposed leader, a trigger racing a planning round) never overwrites a
    /// newer one. Without it (an operator's raw write), refused unless its `version` is newer.
    /// A prefix the committed plan already has may leave out its `tokens`: they are copied
    /// over, so each entry carries a prefix's token ids once.
    SetReplicationPlan {
        /// The plan, as its owner encodes it.
        plan: serde_json::Value,
        /// The committed version this plan was computed from.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        base_version: Option<u64>,
    },
    /// One autoscaler decision (filled by the autoscaling capability); the last 100 are kept.
    /// The live replicas its `drain` array names turn draining in the same entry, so a
    /// scale-down and the replicas it releases commit together — only when no decision was
    /// committed since the one its leader decided after (`base_log_index`: a second leader's
    /// scale-down, decided before it saw the first, drains nothing), and at most as many as
    /// the registry holds above `desired_replicas`; `drain` is rewritten to the replicas this
    /// entry drained.
    RecordScaleDecision {
        /// The decision with its reason and inputs.
        decision: serde_json::Value,
    },
}

impl Command {
    /// Whether only an operator may issue it (the registry and the policy); the others are
    /// the nodes' own (the leader's autoscaler decisions and replication plans), which a
    /// member may forward with the nodes' token alone.
    pub fn by_operator(&self) -> bool {
        !matches!(self, Command::SetReplicationPlan { .. } | Command::RecordScaleDecision { .. })
    }
}

/// What a command did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CommandResult {
    /// Why it changed nothing; `None`: applied.
    pub error: Option<String>,
}

/// Removed replicas the registry remembers (the newest; older ones are forgotten).
pub const MAX_REMOVED: usize = 64;

/// The replicated state.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ClusterState {
    /// Whether the registry was seeded (before that, each node follows its own config file).
    pub seeded: bool,
    /// Replicas by name, the last [`MAX_REMOVED`] removed ones included.
    pub replicas: BTreeMap<String, RegistryEntry>,
    /// The routing policy every node uses; `None`: each node's own `node.policy`.
    pub policy: Option<String>,
    /// Its parameters by name.
    #[serde(default)]
    pub policy_params: BTreeMap<String, f64>,
    /// The current hot-prefix replication plan.
    pub replication_plan: Option<serde_json::Value>,
    /// The latest autoscaler decisions, oldest first.
    pub scale_decisions: Vec<serde_json::Value>,
}

impl ClusterState {
    /// Drains the replicas a scale-down `decision` names (see `RecordScaleDecision`), and
    /// rewrites its `drain` to those it drained.
    fn drain_for(&mut self, decision: &mut serde_json::Value, index: u64) {
        let Some(d) = decision.as_object_mut() else { return };
        let Some(names) = d.get("drain").and_then(|n| n.as_array()).cloned() else { return };
        let desired = d.get("desired_replicas").and_then(|n| n.as_u64()).unwrap_or(u64::MAX);
        let last = self.scale_decisions.last().and_then(|p| p.get("log_index")).and_then(|i| i.as_u64()).unwrap_or(0);
        if d.get("base_log_index").and_then(|b| b.as_u64()).is_some_and(|base| base != last) {
            d.insert("drain".into(), serde_json::Value::Array(Vec::new()));
            return;
        }
        let serving = |e: &RegistryEntry| matches!(e.state, ReplicaStatus::Ready | ReplicaStatus::Starting);
        let mut excess = (self.replicas.values().filter(|e| serving(e)).count() as u64).saturating_sub(desired);
        let mut drained = Vec::new();
        for name in names.iter().filter_map(|n| n.as_str()) {
            if excess == 0 {
                break;
            }
            if let Some(e) = self.replicas.get_mut(name).filter(|e| serving(e)) {
                e.state = ReplicaStatus::Draining;
                e.changed_at = index;
                drained.push(serde_json::Value::from(name));
                excess -= 1;
            }
        }
        d.insert("drain".into(), drained.into());
    }

    /// Applies `cmd` committed at log `index`. Deterministic: every node gets the same state.
    pub fn apply(&mut self, cmd: &Command, index: u64) -> CommandResult {
        let err = |e: String| CommandResult { error: Some(e) };
        match cmd {
            Command::Seed { replicas, policy, params } => {
                if self.seeded {
                    return err("the registry is already seeded".into());
                }
                if let Err(e) = check_policy(policy, params) {
                    return err(e.to_string());
                }
                self.seeded = true;
                self.policy = Some(policy.clone());
                self.policy_params = params.clone();
                for r in replicas {
                    self.replicas.insert(
                        r.name.clone(),
                        RegistryEntry { config: r.clone(), state: ReplicaStatus::Ready, changed_at: index },
                    );
                }
            }
            Command::AddReplica { config, starting } => {
                if let Err(e) = config.validate() {
                    return err(e.to_string());
                }
                // Until the seed, every node follows its own file; a registry holding only this
                // replica would make them all drop the rest.
                if !self.seeded {
                    return err("the registry is not seeded yet: run `kvmesh cluster init` first".into());
                }
                if self.replicas.get(&config.name).is_some_and(|e| e.state != ReplicaStatus::Removed) {
                    return err(format!("replica {:?} already exists", config.name));
                }
                self.replicas.insert(
                    config.name.clone(),
                    RegistryEntry {
                        config: config.clone(),
                        state: if *starting { ReplicaStatus::Starting } else { ReplicaStatus::Ready },
                        changed_at: index,
                    },
                );
            }
            Command::RemoveReplica { name } => match self.replicas.get_mut(name) {
                Some(e) if e.state != ReplicaStatus::Removed => {
                    e.state = ReplicaStatus::Removed;
                    e.changed_at = index;
                    self.prune_removed();
                }
                _ => return err(format!("unknown replica {name:?}")),
            },
            Command::SetReplicaState { state, .. } if !state.is_lifecycle() => {
                return err(format!("{state} is not a registry state (starting, ready, draining or removed)"));
            }
            Command::SetReplicaState { name, state, from } => match self.replicas.get_mut(name) {
                Some(e) if e.state != ReplicaStatus::Removed && from.is_some_and(|f| f != e.state) => {
                    let f = from.map_or("", |f| f.as_str());
                    return err(format!("replica {name:?} is {}, not {f}", e.state.as_str()));
                }
                Some(e) if e.state != ReplicaStatus::Removed => {
                    e.state = *state;
                    e.changed_at = index;
                }
                _ => return err(format!("unknown replica {name:?}")),
            },
            Command::SetPolicy { policy, params } => {
                if let Err(e) = check_policy(policy, params) {
                    return err(e.to_string());
                }
                self.policy = Some(policy.clone());
                self.policy_params = params.clone();
            }
            Command::SetReplicationPlan { plan, base_version } => {
                match merge_plan(self.replication_plan.as_ref(), plan, *base_version) {
                    Ok(plan) => self.replication_plan = Some(plan),
                    Err(e) => return err(e),
                }
            }
            Command::RecordScaleDecision { decision } => {
                // The entry's log index identifies the decision in audits (and shows that a
                // new leader neither lost nor repeated one).
                let mut decision = decision.clone();
                if let Some(d) = decision.as_object_mut() {
                    d.insert("log_index".into(), index.into());
                }
                self.drain_for(&mut decision, index);
                self.scale_decisions.push(decision);
                let excess = self.scale_decisions.len().saturating_sub(100);
                self.scale_decisions.drain(..excess);
            }
        }
        CommandResult::default()
    }

    /// Keeps the [`MAX_REMOVED`] most recently removed entries and drops older ones: an
    /// autoscaled pool registers each pod under its own name, and the registry (snapshots,
    /// `cluster status`) must not grow with every pod that ever ran. Deterministic (by log
    /// index), so every node's state machine drops the same ones.
    fn prune_removed(&mut self) {
        let mut removed: Vec<(u64, String)> = self
            .replicas
            .iter()
            .filter(|(_, e)| e.state == ReplicaStatus::Removed)
            .map(|(n, e)| (e.changed_at, n.clone()))
            .collect();
        if removed.len() <= MAX_REMOVED {
            return;
        }
        removed.sort_unstable();
        for (_, name) in &removed[..removed.len() - MAX_REMOVED] {
            self.replicas.remove(name);
        }
    }

    /// Replicas every node should follow (not removed), by name.
    pub fn live_replicas(&self) -> impl Iterator<Item = &RegistryEntry> {
        self.replicas.values().filter(|e| e.state != ReplicaStatus::Removed)
    }
}

/// How a refused plan's message starts when another writer committed first (the state
/// machine's result crosses Raft as text).
pub(crate) const STALE_PLAN: &str = "stale replication plan: ";

/// The plan `new` would make of the committed `current` (see
/// [`Command::SetReplicationPlan`]), or why it is refused.
fn merge_plan(
    current: Option<&serde_json::Value>,
    new: &serde_json::Value,
    base_version: Option<u64>,
) -> Result<serde_json::Value, String> {
    let version = |p: &serde_json::Value| p.get("version").and_then(serde_json::Value::as_u64);
    let current_version = current.and_then(version).unwrap_or(0);
    let mut plan = new.clone();
    match base_version {
        Some(base) if base != current_version => {
            return Err(format!("{STALE_PLAN}computed from v{base}, the committed plan is v{current_version}"))
        }
        Some(_) => plan["version"] = (current_version + 1).into(),
        None => {
            let v = version(new).unwrap_or(0);
            if current.is_some() && v <= current_version {
                return Err(format!("{STALE_PLAN}version {v} is not newer than {current_version}"));
            }
        }
    }
    let key = |p: &serde_json::Value| (p.get("hash").cloned(), p.get("depth_blocks").cloned());
    let known: Vec<&serde_json::Value> = current
        .and_then(|c| c.get("prefixes"))
        .and_then(|p| p.as_array())
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    if let Some(prefixes) = plan.get_mut("prefixes").and_then(|p| p.as_array_mut()) {
        for p in prefixes {
            let has_tokens = p.get("tokens").and_then(|t| t.as_array()).is_some_and(|t| !t.is_empty());
            if !has_tokens {
                if let Some(old) = known.iter().find(|o| key(o) == key(p)).and_then(|o| o.get("tokens")) {
                    p["tokens"] = old.clone();
                }
            }
        }
    }
    Ok(plan)
}

/// Whether `policy` with `params` can be built (so no node fails to apply it).
fn check_policy(policy: &str, params: &BTreeMap<String, f64>) -> Result<(), kvmesh_core::Error> {
    let kind: kvmesh_core::PolicyKind = policy.parse()?;
    let params: Vec<(String, f64)> = params.iter().map(|(k, v)| (k.clone(), *v)).collect();
    kind.build_with(&params).map(|_| ())
}

#[cfg(test)]
mod tests {
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
        let ready = Command::SetReplicaState {
            name: "b".into(),
            state: ReplicaStatus::Ready,
            from: Some(ReplicaStatus::Starting),
        };
        assert_eq!(s.apply(&ready, 4).error.as_deref(), Some("replica \"b\" is draining, not starting"));
        assert_eq!(s.apply(&Command::RemoveReplica { name: "a".into() }, 5), CommandResult::default());
        assert_eq!(
            s.apply(&Command::RemoveReplica { name: "a".into() }, 6).error.as_deref(),
            Some("unknown replica \"a\"")
        );
        // A removed name can be registered again.
        assert_eq!(
            s.apply(&Command::AddReplica { config: replica("a"), starting: false }, 7),
            CommandResult::default()
        );
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
}
