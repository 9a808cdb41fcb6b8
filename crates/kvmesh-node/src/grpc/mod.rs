//! The gRPC API (`proto/kvmesh/v1/`), a file per service: `Router` for external proxies
//! (`router`), `Admin` for operators (`admin`), `Events.Publish` for engines without ZMQ
//! (`events`), the cluster's own (`cluster`), `Replication` and `Autoscaler` with KEDA's
//! (`replication`, `autoscaler`); plus the standard health service and server reflection, so
//! `grpcurl -plaintext host:50051 list` works out of the box.

mod admin;
pub use admin::WARNING as ADD_REPLICA_WARNING;
pub mod autoscaler;
pub mod cluster;
mod events;
pub mod replication;
mod router;

use crate::admission::Refused;
use crate::cluster::registry::Command;
use crate::cluster::{Cluster, ClusterError};
use crate::replica::SupervisorMsg;
use crate::state::Shared;
use kvmesh_core::load::BookingId;
use kvmesh_core::ReplicaStatus;
use kvmesh_proto::v1;
use ractor::ActorRef;
use std::sync::Arc;
use tonic::{Request, Response, Status as GrpcStatus};

/// The services' shared handles.
#[derive(Clone)]
pub struct Services {
    /// Node state.
    pub shared: Arc<Shared>,
    /// The replica supervisor (admin add/remove).
    pub supervisor: ActorRef<SupervisorMsg>,
    /// In a cluster, admin writes go through Raft.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
    /// Pushing replicas' bad-event records (`Events.Publish`).
    pub push: Arc<crate::replica::push::PushGuards>,
}

fn not_found_or(e: ClusterError) -> GrpcStatus {
    match e {
        ClusterError::Rejected(m) if m.starts_with("unknown replica") => GrpcStatus::not_found(m),
        e => GrpcStatus::from(e),
    }
}

impl Services {
    /// The booking a `FirstToken` or `Release` names, if it was issued to `request`'s caller.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a malformed handle, `PERMISSION_DENIED` for another's.
    fn open_booking<T>(&self, request: &Request<T>, handle: &str) -> Result<BookingId, GrpcStatus> {
        use crate::booking_token::{Caller, HandleError};
        self.shared.booking_keys.open(handle, &Caller::of(request)).map_err(|e| match e {
            HandleError::Malformed(_) => GrpcStatus::invalid_argument(e.to_string()),
            HandleError::NotYours => GrpcStatus::permission_denied(e.to_string()),
        })
    }

    /// Admission control's refusal: `RESOURCE_EXHAUSTED` saying why, with when to retry in
    /// seconds in a `retry-after` metadata entry (as the proxy's `Retry-After` header).
    fn too_many(&self, why: Refused) -> GrpcStatus {
        let (after, message) = self.shared.refusal(why);
        let mut status = GrpcStatus::resource_exhausted(message);
        if let Ok(v) = after.to_string().parse() {
            status.metadata_mut().insert("retry-after", v);
        }
        status
    }

    /// Drains or undrains `name`: through Raft in a cluster, locally otherwise.
    async fn set_draining(&self, name: String, draining: bool) -> Result<Response<v1::Replica>, GrpcStatus> {
        if let Some(c) = &self.cluster {
            let state = if draining { ReplicaStatus::Draining } else { ReplicaStatus::Ready };
            c.write(Command::SetReplicaState { name: name.clone(), state, from: None }).await.map_err(not_found_or)?;
            // The follower task applies it too; doing it here makes the answer show it.
            let _ = self.shared.set_draining(&name, draining);
            return self.await_replica(&name).await;
        }
        self.shared.set_draining(&name, draining).map_err(|e| GrpcStatus::not_found(e.to_string()))?;
        self.replica(&name).map(Response::new).ok_or_else(|| GrpcStatus::not_found(name))
    }

    /// Moves `name` from `from` to `to` in the registry, a compare-and-set (`MarkReady`,
    /// `MarkStarting`): one already `to` is left as it is; one draining is refused with
    /// `draining`, also when it was drained between the look and the write.
    async fn transition(
        &self,
        c: &Cluster,
        name: &str,
        from: ReplicaStatus,
        to: ReplicaStatus,
        draining: GrpcStatus,
    ) -> Result<Response<v1::Replica>, GrpcStatus> {
        let state = c.state.borrow().replicas.get(name).map(|e| e.state);
        match state {
            None | Some(ReplicaStatus::Removed) => {
                return Err(GrpcStatus::not_found(format!("unknown replica {name:?}")))
            }
            Some(ReplicaStatus::Draining) => return Err(draining),
            Some(s) if s == to => return self.await_replica(name).await,
            Some(_) => {}
        }
        let write = Command::SetReplicaState { name: name.to_string(), state: to, from: Some(from) };
        match c.write(write).await {
            Ok(_) => {}
            // Moved by another call meanwhile: what was asked.
            Err(ClusterError::Rejected(m)) if m.contains(&format!(" is {}, ", to.as_str())) => {}
            Err(ClusterError::Rejected(m)) if m.contains(" is draining, ") => return Err(draining),
            Err(e) => return Err(not_found_or(e)),
        }
        // The follower task applies it too; doing it here makes the answer show it.
        let _ = self.shared.set_rotation(name, to != ReplicaStatus::Ready, to == ReplicaStatus::Starting);
        self.await_replica(name).await
    }

    fn admin_auth(&self, meta: &tonic::metadata::MetadataMap) -> Result<(), GrpcStatus> {
        crate::auth::check(meta, &[&self.shared.tokens.admin])
    }

    /// A replica committed through Raft, once this node's follower has applied it (2 s).
    async fn await_replica(&self, name: &str) -> Result<Response<v1::Replica>, GrpcStatus> {
        for _ in 0..200 {
            if let Some(r) = self.replica(name) {
                return Ok(Response::new(r));
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        Err(GrpcStatus::deadline_exceeded(format!("replica {name:?} committed, but not yet applied on this node")))
    }

    fn replica(&self, name: &str) -> Option<v1::Replica> {
        let now = self.shared.now();
        let core = self.shared.core();
        let r = core.replicas.get(name)?;
        let status = core.status(r, now);
        let load = core.fleet.bookings().load(r.id);
        let block_size = core.fleet.replica_block_size(r.id);
        let detail = core.status_detail(r, status, now);
        let index_blocks = core.fleet.index().replica_blocks(r.id) as u64;
        let stream = r.stream.lock().clone();
        let (engine, failures) = {
            let h = r.health.lock();
            (h.engine, h.failures)
        };
        let mut spec = r.config.to_spec(block_size);
        if spec.lora_adapters.is_empty() {
            // Not declared: what its engine lists.
            spec.lora_adapters = r.listed_adapters.clone().unwrap_or_default();
        }
        let capacity_from_engine = spec.capacity_blocks == 0;
        if capacity_from_engine {
            // Not configured: what its engine reported (0 until it has).
            spec.capacity_blocks = core.fleet.replica_capacity_blocks(r.id);
        }
        Some(v1::Replica {
            spec: Some(spec),
            status: v1::ReplicaStatus::from(status) as i32,
            status_detail: detail,
            running: engine.map_or(0, |e| e.running),
            waiting: engine.map_or(0, |e| e.waiting),
            kv_usage: engine.map_or(0.0, |e| e.kv_usage),
            queued_prefill_tokens: load.queued_prefill_tokens,
            live_bookings: load.prefilling + load.decoding,
            index_blocks,
            events_applied: stream.events_applied,
            events_rejected: stream.events_rejected,
            last_event_age_s: r.last_event_at.map(|t| now - t),
            last_seq: stream.last_seq,
            idle: core.drain_progress(r, now).is_some_and(|p| p.idle()),
            engine_up: failures == 0 && engine.is_some(),
            capacity_from_engine,
        })
    }
}
