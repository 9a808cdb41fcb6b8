//! `kvmesh.v1.Admin`: operators' reads and writes (replicas, policy, decisions, config).

use super::{not_found_or, Services};
use crate::cluster::registry::Command;
use crate::cluster::ClusterError;
use crate::config::ReplicaConfig;
use crate::replica::SupervisorMsg;
use crate::state::RegistryError;
use kvmesh_core::ReplicaStatus;
use kvmesh_proto::v1::{self, admin_server};
use tonic::{Request, Response, Status as GrpcStatus};

/// Response metadata of `Admin.AddReplica`: a warning about the replica added (one engine
/// already registered under another name).
pub const WARNING: &str = "kvmesh-warning";

#[tonic::async_trait]
impl admin_server::Admin for Services {
    async fn list_replicas(
        &self,
        request: Request<v1::ListReplicasRequest>,
    ) -> Result<Response<v1::ListReplicasResponse>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let names: Vec<String> = self.shared.core().replicas.keys().cloned().collect();
        let a = &self.shared.admission;
        let (queue_full, evicted_late, timeout) = a.refused_total();
        let admission = v1::AdmissionState {
            enabled: a.section.enabled,
            waiting: u32::try_from(a.depth()).unwrap_or(u32::MAX),
            waiting_tokens: a.waiting_load(),
            queue_limit: u32::try_from(a.section.queue_limit).unwrap_or(u32::MAX),
            max_wait_s: a.section.max_wait.as_secs_f64(),
            // A gate configured on a queue that is off holds nothing.
            ttft_slo_s: a.gate().filter(|_| a.section.enabled).map_or(0.0, |g| g.slo_s()),
            refused_queue_full: queue_full,
            refused_evicted_late: evicted_late,
            refused_timeout: timeout,
        };
        Ok(Response::new(v1::ListReplicasResponse {
            replicas: names.iter().filter_map(|n| self.replica(n)).collect(),
            admission: Some(admission),
        }))
    }

    async fn add_replica(&self, request: Request<v1::AddReplicaRequest>) -> Result<Response<v1::Replica>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let request = request.into_inner();
        let starting = request.starting;
        let spec = request.spec.ok_or_else(|| GrpcStatus::invalid_argument("spec is required"))?;
        let config = ReplicaConfig::from_spec(spec)?;
        // One block size per model (node.model's is the node's): refused here, before the
        // registry would take it.
        let model = self.shared.models.of_replica(config.model.as_deref()).to_string();
        let core_spec = kvmesh_core::ReplicaSpec {
            model,
            block_size: config.block_size.unwrap_or(0),
            ..kvmesh_core::ReplicaSpec::new(config.name.clone(), config.capacity_blocks.max(1))
        };
        if let Err(e) = self.shared.core().fleet.block_size_for(&core_spec) {
            return Err(GrpcStatus::invalid_argument(e.to_string()));
        }
        let name = config.name.clone();
        // One engine under two names is booked twice and scraped twice. Said, not refused: in
        // Kubernetes a pod that died without its preStop hook leaves its entry behind, and the
        // next pod given the same IP must still be able to register.
        let same_engine = self
            .shared
            .core()
            .replicas
            .values()
            .find_map(|r| (r.config.name != name && r.config.same_engine(&config)).then(|| r.config.name.clone()));
        // Told to the caller too (response metadata `kvmesh-warning`, which the CLI prints).
        let warning = same_engine.map(|other| {
            tracing::warn!(
                replica = %name, registered = %other, http = %config.http,
                "replica added for an engine already registered under another name (remove the stale one: `kvmesh replica remove --name {other}`)"
            );
            format!(
                "{name} and replica {other} are one engine ({}): remove the stale one with `kvmesh replica remove --name \
                 {other}`",
                config.http
            )
        });
        let warned = |mut r: Response<v1::Replica>| {
            if let Some(v) = warning.as_deref().and_then(|w| tonic::metadata::MetadataValue::try_from(w).ok()) {
                r.metadata_mut().insert(WARNING, v);
            }
            r
        };
        if let Some(c) = &self.cluster {
            config.validate().map_err(|e| GrpcStatus::invalid_argument(e.to_string()))?;
            c.write(Command::AddReplica { config, starting }).await.map_err(|e| match e {
                ClusterError::Rejected(m) if m.contains("already exists") => GrpcStatus::already_exists(m),
                e => GrpcStatus::from(e),
            })?;
            if starting && c.state.borrow().replicas.get(&name).is_some_and(|e| e.state == ReplicaStatus::Starting) {
                // Once added here; the follower task applies it too, doing it here makes the
                // answer show it.
                let _ = self.await_replica(&name).await;
                let _ = self.shared.set_rotation(&name, true, true);
            }
            return self.await_replica(&name).await.map(warned);
        }
        if starting {
            return Err(GrpcStatus::failed_precondition(
                "starting replicas live in the cluster's registry: this node runs without [cluster]",
            ));
        }
        let result = ractor::call!(self.supervisor, SupervisorMsg::Add, Box::new(config))
            .map_err(|e| GrpcStatus::internal(e.to_string()))?;
        result.map_err(|e| match e {
            RegistryError::Exists(_) => GrpcStatus::already_exists(e.to_string()),
            RegistryError::Unknown(_) | RegistryError::Invalid(_) | RegistryError::Config(_) => {
                GrpcStatus::invalid_argument(e.to_string())
            }
            RegistryError::NotStarted { .. } => GrpcStatus::internal(e.to_string()),
        })?;
        self.replica(&name)
            .map(|r| warned(Response::new(r)))
            .ok_or_else(|| GrpcStatus::internal("added replica vanished"))
    }

    async fn remove_replica(
        &self,
        request: Request<v1::ReplicaRef>,
    ) -> Result<Response<v1::RemoveReplicaResponse>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let name = request.into_inner().name;
        if let Some(c) = &self.cluster {
            c.write(Command::RemoveReplica { name }).await.map_err(not_found_or)?;
            return Ok(Response::new(v1::RemoveReplicaResponse {}));
        }
        let result = ractor::call!(self.supervisor, SupervisorMsg::Remove, name)
            .map_err(|e| GrpcStatus::internal(e.to_string()))?;
        result.map_err(|e| GrpcStatus::not_found(e.to_string()))?;
        Ok(Response::new(v1::RemoveReplicaResponse {}))
    }

    async fn drain_replica(&self, request: Request<v1::ReplicaRef>) -> Result<Response<v1::Replica>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        self.set_draining(request.into_inner().name, true).await
    }

    async fn undrain_replica(&self, request: Request<v1::ReplicaRef>) -> Result<Response<v1::Replica>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        self.set_draining(request.into_inner().name, false).await
    }

    async fn mark_ready(&self, request: Request<v1::ReplicaRef>) -> Result<Response<v1::Replica>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let name = request.into_inner().name;
        let Some(c) = &self.cluster else {
            // No starts without a cluster: ready unless an operator drained it.
            let draining = self.shared.core().replicas.get(&name).map(|r| r.draining());
            return match draining {
                None => Err(GrpcStatus::not_found(format!("unknown replica {name:?}"))),
                Some(true) => Err(GrpcStatus::failed_precondition(format!(
                    "replica {name:?} is draining: `kvmesh replica undrain` puts it back into rotation"
                ))),
                Some(false) => self.replica(&name).map(Response::new).ok_or_else(|| GrpcStatus::not_found(name)),
            };
        };
        let drained = GrpcStatus::failed_precondition(format!(
            "replica {name:?} is draining (a scale-down cancelled its start, or an operator drained it): release \
             it, or `kvmesh replica undrain` to put it into rotation anyway"
        ));
        self.transition(c, &name, ReplicaStatus::Starting, ReplicaStatus::Ready, drained).await
    }

    async fn mark_starting(&self, request: Request<v1::ReplicaRef>) -> Result<Response<v1::Replica>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let name = request.into_inner().name;
        let Some(c) = &self.cluster else {
            return Err(GrpcStatus::failed_precondition(
                "starting replicas live in the cluster's registry: this node runs without [cluster]",
            ));
        };
        // Only a replica in rotation starts: a drain that came first (its pod is going away)
        // must not be undone.
        let draining = GrpcStatus::failed_precondition(format!(
            "replica {name:?} is draining: a start marked now would put it back (undrain it first)"
        ));
        self.transition(c, &name, ReplicaStatus::Ready, ReplicaStatus::Starting, draining).await
    }

    async fn recent_decisions(
        &self,
        request: Request<v1::RecentDecisionsRequest>,
    ) -> Result<Response<v1::RecentDecisionsResponse>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let n = match request.into_inner().limit {
            0 => 20,
            n => n.min(64) as usize,
        };
        let now = self.shared.now();
        let decisions = self
            .shared
            .recent_decisions(n)
            .into_iter()
            .map(|d| v1::RecentDecision {
                age_s: now - d.at,
                via: d.via.into(),
                replica: d.replica,
                reason: d.reason.into(),
                prompt_tokens: d.prompt_tokens,
                overlap_blocks: d.overlap_blocks,
                uncached_tokens: d.uncached_tokens,
                estimated_ttft_s: d.estimated_ttft_s,
            })
            .collect();
        Ok(Response::new(v1::RecentDecisionsResponse { decisions }))
    }

    async fn get_config(
        &self,
        request: Request<v1::GetConfigRequest>,
    ) -> Result<Response<v1::GetConfigResponse>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let toml = self.shared.config.lock().unwrap_or_else(|p| p.into_inner()).to_toml();
        Ok(Response::new(v1::GetConfigResponse { toml }))
    }
}
