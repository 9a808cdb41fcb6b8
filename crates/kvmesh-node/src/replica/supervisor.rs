//! The replica supervisor: starts, stops and restarts replica actors.
//!
//! ractor's default supervisor behaviour stops the parent when any child ends; this one
//! overrides it: a failed replica actor is restarted after a short backoff, at most
//! [`MAX_RESTARTS`] times per [`RESTART_WINDOW`], and other replicas never notice.

use super::actor::{ReplicaActor, ReplicaArgs, ReplicaMsg};
use crate::config::ReplicaConfig;
use crate::state::{RegistryError, Shared};
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Restarts allowed per replica within [`RESTART_WINDOW`] before it is left stopped.
pub const MAX_RESTARTS: usize = 5;
/// See [`MAX_RESTARTS`].
pub const RESTART_WINDOW: Duration = Duration::from_secs(60);
const RESTART_BACKOFF: Duration = Duration::from_millis(500);

/// The supervisor actor.
pub struct Supervisor;

/// Messages to the supervisor.
pub enum SupervisorMsg {
    /// Register a replica and start its actor.
    Add(Box<ReplicaConfig>, RpcReplyPort<Result<(), RegistryError>>),
    /// Stop a replica's actor and forget the replica.
    Remove(String, RpcReplyPort<Result<(), RegistryError>>),
    /// Start a replica's actor again (after a failure).
    Restart(String),
    /// The running replica actors, by replica name (status pages, tests).
    Children(RpcReplyPort<Vec<(String, ActorRef<ReplicaMsg>)>>),
}

/// Children and their restart history.
pub struct SupervisorState {
    shared: Arc<Shared>,
    children: HashMap<String, ActorRef<ReplicaMsg>>,
    restarts: HashMap<String, Vec<Instant>>,
}

impl SupervisorState {
    fn name_of(&self, id: ActorId) -> Option<String> {
        self.children.iter().find(|(_, a)| a.get_id() == id).map(|(n, _)| n.clone())
    }
}

async fn start_child(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState,
    config: ReplicaConfig,
) -> Result<(), RegistryError> {
    let name = config.name.clone();
    let args = ReplicaArgs { shared: state.shared.clone(), config };
    let (child, _) = Actor::spawn_linked(None, ReplicaActor, args, myself.get_cell())
        .await
        .map_err(|e| RegistryError::NotStarted { name: name.clone(), error: e.to_string() })?;
    state.children.insert(name, child);
    Ok(())
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        _me: ActorRef<SupervisorMsg>,
        shared: Arc<Shared>,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        Ok(SupervisorState { shared, children: HashMap::new(), restarts: HashMap::new() })
    }

    async fn handle(
        &self,
        me: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Add(config, reply) => {
                let config = *config;
                let result = match state.shared.add_replica(config.clone()) {
                    Ok(_) => {
                        let r = start_child(&me, state, config.clone()).await;
                        if r.is_err() {
                            let _ = state.shared.remove_replica(&config.name);
                        } else {
                            let (status, detail) = {
                                let (core, now) = (state.shared.core(), state.shared.now());
                                core.replicas.get(&config.name).map_or(
                                    (kvmesh_core::ReplicaStatus::Removed, String::new()),
                                    |r| {
                                        let status = core.status(r, now);
                                        (status, core.status_detail(r, status, now))
                                    },
                                )
                            };
                            tracing::info!(replica = %config.name, status = status.as_str(), detail = %detail, "replica added");
                        }
                        r
                    }
                    Err(e) => Err(e),
                };
                let _ = reply.send(result);
            }
            SupervisorMsg::Remove(name, reply) => {
                let result = state.shared.remove_replica(&name);
                if let Some(child) = state.children.remove(&name) {
                    child.stop(Some("replica removed".into()));
                }
                state.restarts.remove(&name);
                if result.is_ok() {
                    tracing::info!(replica = %name, "replica removed");
                }
                let _ = reply.send(result);
            }
            SupervisorMsg::Children(reply) => {
                let mut children: Vec<_> = state.children.iter().map(|(n, a)| (n.clone(), a.clone())).collect();
                children.sort_by(|a, b| a.0.cmp(&b.0));
                let _ = reply.send(children);
            }
            SupervisorMsg::Restart(name) => {
                // Removed (and perhaps added again) since the failure: its actor is current.
                if state.children.contains_key(&name) {
                    return Ok(());
                }
                let config = state.shared.core().replicas.get(&name).map(|r| r.config.clone());
                if let Some(config) = config {
                    if let Err(e) = start_child(&me, state, config).await {
                        tracing::error!(replica = %name, error = %e, "restart failed");
                    }
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        me: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (id, why) = match event {
            SupervisionEvent::ActorFailed(cell, err) => (cell.get_id(), err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => (cell.get_id(), reason.unwrap_or_default()),
            _ => return Ok(()),
        };
        // A child we stopped on purpose is already out of `children`.
        let Some(name) = state.name_of(id) else { return Ok(()) };
        state.children.remove(&name);
        let history = state.restarts.entry(name.clone()).or_default();
        history.retain(|t| t.elapsed() < RESTART_WINDOW);
        if history.len() >= MAX_RESTARTS {
            tracing::error!(replica = %name, reason = %why, "replica actor keeps failing; left stopped and out of rotation");
            let now = state.shared.now();
            state.shared.core().record_down(&name, format!("replica actor keeps failing: {why}"), now);
            return Ok(());
        }
        history.push(Instant::now());
        tracing::warn!(replica = %name, reason = %why, "replica actor ended; restarting");
        tokio::spawn(async move {
            tokio::time::sleep(RESTART_BACKOFF).await;
            let _ = me.cast(SupervisorMsg::Restart(name));
        });
        Ok(())
    }
}
