//! The `kvmesh.v1` Raft, Cluster and Gossip services of one node.

use crate::cluster::registry::Command;
use crate::cluster::Cluster;
use crate::state::Shared;
use kvmesh_core::gossip::{Delta, NodeId};
use kvmesh_proto::v1::{self, cluster_server, gossip_server, raft_server};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::Arc;
use tonic::{Request, Response, Status, Streaming};

/// The handles the cluster services need.
#[derive(Clone)]
pub struct ClusterServices {
    /// This node's cluster membership.
    pub cluster: Arc<Cluster>,
    /// Node state (gossip merges into its fleet).
    pub shared: Arc<Shared>,
    /// Turns true when the node stops (long-lived gossip streams end then).
    pub stopped: tokio::sync::watch::Receiver<bool>,
}

fn decode<T: DeserializeOwned>(p: v1::RaftPayload) -> Result<T, Status> {
    serde_json::from_slice(&p.json).map_err(|e| Status::invalid_argument(format!("bad Raft payload: {e}")))
}

fn encode<T: Serialize>(v: &T) -> Result<Response<v1::RaftPayload>, Status> {
    serde_json::to_vec(v)
        .map(|json| Response::new(v1::RaftPayload { json }))
        .map_err(|e| Status::internal(e.to_string()))
}

impl ClusterServices {
    /// Node-to-node calls: the cluster token.
    fn peer_auth(&self, meta: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        crate::auth::check(meta, &[&self.cluster.token])
    }

    /// Operators' calls: the admin token.
    fn admin_auth(&self, meta: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        crate::auth::check(meta, &[&self.shared.tokens.admin])
    }

    /// Calls an operator makes (the admin token), or a node forwards for one: marked
    /// forwarded, signed with the nodes' token, *and* carrying the operator's admin token,
    /// which this node verifies itself ([`crate::cluster::operator`]). The nodes' token alone is not
    /// an operator's credential.
    fn admin_or_peer_auth(&self, meta: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        if meta.contains_key(crate::cluster::FORWARDED) {
            self.peer_auth(meta)?;
            let operator = crate::cluster::operator::forwarded_credential(meta);
            crate::auth::check(&operator, &[&self.shared.tokens.admin]).map_err(|_| {
                Status::permission_denied("a forwarded operator write must carry the operator's own admin token")
            })
        } else {
            crate::auth::check(meta, &[&self.shared.tokens.admin])
        }
    }

    fn reachable(&self) -> Result<(), Status> {
        if self.cluster.faults.isolated() {
            return Err(Status::unavailable("isolated by an injected fault"));
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl raft_server::Raft for ClusterServices {
    async fn append_entries(&self, r: Request<v1::RaftPayload>) -> Result<Response<v1::RaftPayload>, Status> {
        self.peer_auth(r.metadata())?;
        self.reachable()?;
        let result = self.cluster.raft.append_entries(decode(r.into_inner())?).await;
        encode(&result)
    }

    async fn vote(&self, r: Request<v1::RaftPayload>) -> Result<Response<v1::RaftPayload>, Status> {
        self.peer_auth(r.metadata())?;
        self.reachable()?;
        let result = self.cluster.raft.vote(decode(r.into_inner())?).await;
        encode(&result)
    }

    async fn install_snapshot(&self, r: Request<v1::RaftPayload>) -> Result<Response<v1::RaftPayload>, Status> {
        self.peer_auth(r.metadata())?;
        self.reachable()?;
        let result = self.cluster.raft.install_snapshot(decode(r.into_inner())?).await;
        encode(&result)
    }
}

impl ClusterServices {
    fn status(&self) -> v1::ClusterStatus {
        let mut s = self.cluster.status();
        for e in &mut s.registry {
            if let Some(spec) = e.spec.as_mut().filter(|spec| spec.block_size == 0) {
                spec.block_size = self.shared.settings.block_size;
            }
        }
        let now = self.shared.now();
        let core = self.shared.core();
        let peers: std::collections::BTreeMap<u64, (usize, f64)> =
            core.remote.peers().map(|(n, live, heard)| (n.0, (live, now - heard))).collect();
        let me = s.node_id;
        for m in s.members.iter_mut().filter(|m| m.node_id != me) {
            // A silent peer's bookings are dropped, not its age: a member never heard counts
            // from this node's start, as kvmesh_gossip_peer_age_seconds does.
            let (live, age) = peers.get(&m.node_id).copied().unwrap_or_else(|| {
                (0, core.remote.last_heard(kvmesh_core::gossip::NodeId(m.node_id)).map_or(now, |h| now - h))
            });
            m.shared_bookings = live as u64;
            m.gossip_age_s = Some(age);
        }
        s
    }
}

#[tonic::async_trait]
impl cluster_server::Cluster for ClusterServices {
    async fn init(&self, r: Request<v1::InitRequest>) -> Result<Response<v1::ClusterStatus>, Status> {
        self.admin_auth(r.metadata())?;
        self.cluster.init().await?;
        Ok(Response::new(self.status()))
    }

    async fn join(&self, r: Request<v1::JoinRequest>) -> Result<Response<v1::ClusterStatus>, Status> {
        self.admin_or_peer_auth(r.metadata())?;
        let r = r.into_inner();
        if r.node_id == 0 || !r.addr.contains(':') {
            return Err(Status::invalid_argument("node_id must be positive and addr host:port"));
        }
        self.cluster.join(r.node_id, r.addr).await?;
        Ok(Response::new(self.status()))
    }

    async fn leave(&self, r: Request<v1::LeaveRequest>) -> Result<Response<v1::ClusterStatus>, Status> {
        let (meta, _, r) = r.into_parts();
        if r.removed_notice {
            // The leader telling this node its removal is committed: a node's word.
            self.peer_auth(&meta)?;
            if r.node_id != self.cluster.id {
                return Err(Status::invalid_argument(format!(
                    "a removal notice names its receiver (this is node {}, not {})",
                    self.cluster.id, r.node_id
                )));
            }
            // A late notice for a node that has joined again since: its own membership entry
            // is the newer one.
            let own = self.cluster.membership_index();
            if own > r.membership_index {
                tracing::info!(
                    at = r.membership_index,
                    own,
                    "ignoring a removal notice older than this node's membership"
                );
            } else {
                self.cluster.mark_removed();
            }
            return Ok(Response::new(self.status()));
        }
        self.admin_or_peer_auth(&meta)?;
        self.cluster.leave(r.node_id).await?;
        Ok(Response::new(self.status()))
    }

    async fn status(&self, r: Request<v1::ClusterStatusRequest>) -> Result<Response<v1::ClusterStatus>, Status> {
        crate::auth::check_read(r.metadata(), &self.shared.tokens)?;
        Ok(Response::new(self.status()))
    }

    async fn write(&self, r: Request<v1::WriteRequest>) -> Result<Response<v1::WriteResponse>, Status> {
        let forwarded = r.metadata().contains_key(crate::cluster::FORWARDED);
        let (meta, _, body) = r.into_parts();
        // A credential first, then the command is parsed.
        if forwarded {
            self.peer_auth(&meta)?;
        } else {
            self.admin_auth(&meta)?;
        }
        let cmd: Command = serde_json::from_slice(&body.command_json)
            .map_err(|e| Status::invalid_argument(format!("bad command: {e}")))?;
        if forwarded && cmd.by_operator() {
            // An operator's write a node forwards: the operator's own token too.
            self.admin_or_peer_auth(&meta)?;
        }
        if forwarded {
            // Another node's write: an injected partition drops it like the network would.
            self.reachable()?;
        }
        let (result, log_index) = self.cluster.write_from(cmd, forwarded).await.map_err(Status::from)?;
        let result_json = serde_json::to_vec(&result).map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(v1::WriteResponse { result_json, log_index }))
    }

    async fn inject_fault(&self, r: Request<v1::FaultRequest>) -> Result<Response<v1::FaultResponse>, Status> {
        self.admin_auth(r.metadata())?;
        if !self.cluster.section.allow_fault_injection {
            return Err(Status::permission_denied(
                "fault injection is off on this node (set [cluster] allow_fault_injection = true, for tests only)",
            ));
        }
        let r = r.into_inner();
        if !(0.0..=1.0).contains(&r.gossip_drop) {
            return Err(Status::invalid_argument("gossip_drop must be within 0..1"));
        }
        self.cluster.faults.set(r.isolate, r.gossip_drop);
        tracing::warn!(isolate = r.isolate, gossip_drop = r.gossip_drop, "fault injected");
        Ok(Response::new(v1::FaultResponse {}))
    }
}

#[tonic::async_trait]
impl gossip_server::Gossip for ClusterServices {
    async fn stream(&self, r: Request<Streaming<v1::GossipBatch>>) -> Result<Response<v1::GossipAck>, Status> {
        self.peer_auth(r.metadata())?;
        let mut stream = r.into_inner();
        let mut stopped = self.stopped.clone();
        loop {
            let batch = tokio::select! {
                b = stream.message() => match b? {
                    Some(b) => b,
                    None => break,
                },
                _ = stopped.wait_for(|s| *s) => break,
            };
            if self.cluster.faults.isolated() {
                continue;
            }
            let peer = NodeId(batch.node_id);
            if batch.node_id == self.cluster.id {
                return Err(Status::invalid_argument("a node does not gossip to itself (two nodes share an id?)"));
            }
            let arrived = self.shared.now();
            let deltas: Vec<Delta> = batch
                .deltas
                .into_iter()
                .filter_map(|d| kvmesh_proto::gossip::delta_from_proto(d, arrived).ok())
                .collect();
            self.shared.metrics.gossip_deltas_received.inc_by(deltas.len() as u64);
            let summary = batch.summary.map(|s| kvmesh_proto::gossip::summary_from_proto(s, arrived));
            if let Some(hot) = batch.hot {
                if self.shared.replication.enabled() {
                    let bs = self.shared.settings.block_size;
                    self.shared.replication.store_report(batch.node_id, hot.into(), bs);
                }
            }
            let now = self.shared.now();
            let mut core = self.shared.core();
            let core = &mut *core;
            if core.remote.observe_incarnation(&mut core.fleet, peer, batch.incarnation) {
                tracing::info!(%peer, "peer restarted; its old bookings were released");
            }
            core.remote.apply(&mut core.fleet, peer, &deltas, now);
            match batch.demand_tokens {
                Some(d) => core.peer_demand(batch.node_id, batch.incarnation, d),
                // An older peer: its bookings are its demand.
                None => {
                    for d in &deltas {
                        if let kvmesh_core::gossip::DeltaKind::Book { spec, .. } = &d.kind {
                            core.booked_tokens +=
                                f64::from(spec.uncached_prefill_tokens) + f64::from(spec.expected_output_tokens);
                        }
                    }
                }
            }
            if let Some(s) = &summary {
                core.remote.apply_summary(&mut core.fleet, peer, s, now);
            }
        }
        Ok(Response::new(v1::GossipAck {}))
    }
}
