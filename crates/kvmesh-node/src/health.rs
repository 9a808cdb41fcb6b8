//! The node's readiness, one answer for both protocols: HTTP `/health` and gRPC
//! `grpc.health.v1.Health` say the same thing, so a Kubernetes probe, a gRPC load balancer
//! and an operator reading `/health` never disagree.
//!
//! Ready means at least one replica is routable (the proxy and `Router.Route` can place a
//! request) and the node is not shutting down, removed from its cluster, nor refused by every
//! other member of it (a wrong cluster token). gRPC reports it for the server as a whole (`""`) and for `kvmesh.v1.Router`;
//! `Admin` and `Events` answer whatever the replicas do, so they stay `SERVING`.

use crate::state::Shared;
use kvmesh_proto::v1::router_server::RouterServer;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// How often the gRPC health status follows the replicas: well under a probe's period
/// (Kubernetes: 10 s by default) and cheap (one routable sync).
pub const FOLLOW_EVERY: Duration = Duration::from_millis(500);

/// The replicas a node knows and how many of them are routable now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Readiness {
    /// Replicas in the node's registry.
    pub replicas: usize,
    /// Of those, the ones a request may be routed to now (a disaggregated side counts only
    /// while its model has a routable replica on the other side too).
    pub routable: usize,
    /// Of those, the ones out of rotation only because they answered 429/503 (status
    /// `overloaded`, for `node.overload_backoff`): alive, and back in seconds.
    pub backing_off: usize,
    /// The node is shutting down (draining what it follows): not ready, whatever the
    /// replicas.
    pub stopping: bool,
    /// The node was removed from its cluster ([`crate::cluster::Cluster::removed`]): not
    /// ready, whatever the replicas.
    pub removed: bool,
    /// Every other member of its cluster refuses its cluster token
    /// ([`crate::cluster::Cluster::refused_by_every_peer`]): not ready, whatever the replicas.
    pub token_refused: bool,
}

impl Readiness {
    /// Reads it now (after a routable sync, so expired marks count).
    pub fn of(shared: &Shared) -> Readiness {
        let now = shared.now();
        let mut core = shared.core();
        core.sync_all(now);
        Readiness {
            replicas: core.replicas.len(),
            backing_off: core.backing_off(now).0,
            // A prefill replica without a decode replica (or the reverse) serves nothing.
            routable: core.fleet.servable_replicas(),
            stopping: shared.stopping.load(std::sync::atomic::Ordering::Acquire),
            removed: shared.cluster.get().is_some_and(|c| c.removed()),
            token_refused: shared.cluster.get().is_some_and(|c| c.refused_by_every_peer()),
        }
    }

    /// Whether the node takes traffic: a request can be placed, or will be once the
    /// replicas backing off from a 429/503 are back (seconds). A fleet that is only busy keeps
    /// its routers in their Service, answering 503 with `Retry-After`, instead of taking every
    /// one out (a readiness probe failing for a few periods) and leaving clients no router.
    pub fn ready(&self) -> bool {
        (self.routable > 0 || self.backing_off > 0) && !self.stopping && !self.removed && !self.token_refused
    }

    /// The gRPC health status this readiness answers with.
    pub fn serving(&self) -> ServingStatus {
        if self.ready() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        }
    }
}

/// Envoy's ext_proc service name, the endpoint picker's health name ([`crate::epp`]).
const EXT_PROC: &str =
    <envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer<
        crate::epp::EndpointPicker,
    > as tonic::server::NamedService>::NAME;

/// Keeps `reporter`'s status of the server (`""`), of `kvmesh.v1.Router`, of the endpoint
/// picker (`envoy.service.ext_proc.v3.ExternalProcessor`) and of `readiness` equal to
/// [`Readiness::of`] every [`FOLLOW_EVERY`], logging each change, until `stop` turns true.
pub async fn follow_grpc(shared: Arc<Shared>, reporter: HealthReporter, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(FOLLOW_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let readiness = Readiness::of(&shared);
        let status = readiness.serving();
        if last == Some(status) {
            continue;
        }
        if last.is_some() {
            tracing::info!(routable = readiness.routable, replicas = readiness.replicas, status = ?status, "gRPC health changed");
        }
        last = Some(status);
        reporter.set_service_status("", status).await;
        reporter
            .set_service_status(<RouterServer<crate::grpc::Services> as tonic::server::NamedService>::NAME, status)
            .await;
        reporter.set_service_status(EXT_PROC, status).await;
        reporter.set_service_status("readiness", status).await;
    }
}
