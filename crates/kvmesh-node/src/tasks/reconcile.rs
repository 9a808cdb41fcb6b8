//! Keeps this node in line with the replicated state: its replica actors follow the registry
//! (once seeded; before that, the node's own `[[replicas]]`), draining follows the registry's
//! state, and the policy and the replication plan follow the cluster's.

use crate::cluster::registry::ClusterState;
use crate::config::ReplicaConfig;
use crate::replica::SupervisorMsg;
use crate::state::Shared;
use kvmesh_core::ReplicaStatus;
use ractor::ActorRef;
use std::sync::Arc;
use tokio::sync::watch;

/// Follows `state` until `stop` turns true.
pub async fn run(
    shared: Arc<Shared>,
    supervisor: ActorRef<SupervisorMsg>,
    mut state: watch::Receiver<Arc<ClusterState>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let current = state.borrow_and_update().clone();
        if current.seeded {
            sync(&shared, &supervisor, &current).await;
        }
        tokio::select! {
            r = state.changed() => if r.is_err() { return },
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

async fn sync(shared: &Shared, supervisor: &ActorRef<SupervisorMsg>, state: &ClusterState) {
    let desired: Vec<&ReplicaConfig> = state.live_replicas().map(|e| &e.config).collect();
    let current: Vec<ReplicaConfig> = shared.core().replicas.values().map(|r| r.config.clone()).collect();
    for old in &current {
        if !desired.contains(&old) {
            if let Ok(Err(e)) = ractor::call!(supervisor, SupervisorMsg::Remove, old.name.clone()) {
                tracing::warn!(replica = %old.name, error = %e, "registry: remove failed");
            }
        }
    }
    for e in state.live_replicas() {
        let new = &e.config;
        if !current.contains(new) {
            // Out of rotation from its first moment if it is starting or draining (a node
            // restarting re-adds every replica).
            shared.set_rotation_ahead(&new.name, e.state != ReplicaStatus::Ready, e.state == ReplicaStatus::Starting);
            match ractor::call!(supervisor, SupervisorMsg::Add, Box::new(new.clone())) {
                Ok(Ok(())) => {
                    tracing::info!(replica = %new.name, state = e.state.as_str(), "registry: replica added")
                }
                Ok(Err(e)) => tracing::warn!(replica = %new.name, error = %e, "registry: add failed"),
                Err(e) => tracing::warn!(replica = %new.name, error = %e, "registry: supervisor unreachable"),
            }
        }
    }
    for e in state.live_replicas() {
        // A starting replica is not routed to either: it cannot serve yet.
        let draining = e.state != ReplicaStatus::Ready;
        let _ = shared.set_rotation(&e.config.name, draining, e.state == ReplicaStatus::Starting);
    }
    if let Some(plan) = &state.replication_plan {
        match serde_json::from_value::<kvmesh_core::replication::ReplicationPlan>(plan.clone()) {
            Ok(plan) if plan.version != shared.replication.plan().version => shared.apply_plan(plan),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "registry: replication plan not understood"),
        }
    }
    shared.autoscaler.follow(&state.scale_decisions);
    if let Some(p) = &state.policy {
        if let Err(e) = shared.set_policy(p, &state.policy_params) {
            tracing::warn!(policy = %p, error = %e, "registry: policy not applied");
        }
    }
}
