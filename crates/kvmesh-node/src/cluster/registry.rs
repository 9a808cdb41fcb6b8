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
mod tests;
