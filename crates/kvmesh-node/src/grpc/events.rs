//! `kvmesh.v1.Events`: KV events pushed by engines without ZMQ (`Publish`).

use super::Services;
use kvmesh_proto::v1::{self, events_server};
use tonic::{Request, Response, Status as GrpcStatus, Streaming};

#[tonic::async_trait]
impl events_server::Events for Services {
    async fn publish(
        &self,
        request: Request<Streaming<v1::PublishRequest>>,
    ) -> Result<Response<v1::PublishResponse>, GrpcStatus> {
        // Event pushers (engine sidecars) hold the events token (or an operator's): not the
        // nodes' token, which would let a sidecar talk Raft.
        let t = &self.shared.tokens;
        crate::auth::check(request.metadata(), &[&t.events, &t.admin])?;
        let mut stream = request.into_inner();
        let mut summary = v1::PublishResponse::default();
        while let Some(batch) = stream.message().await? {
            use crate::replica::push::PushError;
            let pushed = self.push.apply(&self.shared, batch).map_err(|e| match e {
                PushError::UnknownReplica(_) => GrpcStatus::not_found(e.to_string()),
                PushError::Quarantined { .. } => GrpcStatus::unavailable(e.to_string()),
            })?;
            summary.batches += 1;
            summary.events_applied += pushed.applied;
            summary.events_rejected += pushed.rejected;
        }
        Ok(Response::new(summary))
    }
}
