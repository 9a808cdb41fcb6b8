//! Raft RPCs over tonic (openraft 0.9's `RaftNetwork`): each request and reply is openraft's
//! own type as JSON inside a `kvmesh.v1.RaftPayload`. A peer that cannot be reached is
//! `Unreachable` (openraft backs off and retries); injected faults act here and in the
//! server ([`Faults`]).

use super::TypeConfig;
use kvmesh_proto::v1::{raft_client::RaftClient, RaftPayload};
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::BasicNode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

type NodeId = u64;

/// Faults injected for tests and chaos scenarios (`Cluster.InjectFault`).
#[derive(Debug, Default)]
pub struct Faults {
    isolated: AtomicBool,
    gossip_drop_ppm: AtomicU32,
}

impl Faults {
    /// Drop all Raft and gossip traffic to and from this node (a partition), or stop.
    pub fn set(&self, isolate: bool, gossip_drop: f64) {
        self.isolated.store(isolate, Ordering::Relaxed);
        self.gossip_drop_ppm.store((gossip_drop.clamp(0.0, 1.0) * 1e6) as u32, Ordering::Relaxed);
    }

    /// Whether this node is cut off.
    pub fn isolated(&self) -> bool {
        self.isolated.load(Ordering::Relaxed)
    }

    /// Whether to drop one outgoing gossip batch, given a uniform draw in [0, 1).
    pub fn drop_gossip(&self, draw: f64) -> bool {
        self.isolated() || draw * 1e6 < self.gossip_drop_ppm.load(Ordering::Relaxed) as f64
    }
}

/// A lazily connecting gRPC channel to `addr` (`host:port`).
///
/// # Errors
/// An address that is not a valid URI authority.
pub fn channel(addr: &str, tls: Option<&ClientTlsConfig>) -> Result<Channel, tonic::transport::Error> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))?
        .connect_timeout(std::time::Duration::from_millis(500))
        .tcp_nodelay(true);
    if let Some(t) = tls {
        endpoint = endpoint.tls_config(t.clone())?;
    }
    Ok(endpoint.connect_lazy())
}

/// Makes one [`PeerClient`] per Raft peer.
#[derive(Clone)]
pub struct Network {
    /// Shared with the server side.
    pub faults: Arc<Faults>,
    /// How long openraft waits after an unreachable peer before trying again. openraft's
    /// default (500 ms) is longer than kvmesh's election timeout: a leader that backed off
    /// from a follower after one reset connection would skip heartbeats and be deposed.
    pub backoff: std::time::Duration,
    /// The token presented to the other nodes.
    pub token: Option<crate::auth::Secret>,
    /// TLS to the other nodes (`[security] tls_*`).
    pub tls: Option<ClientTlsConfig>,
    /// Peers not answering (one warning per peer every 10 s, whatever client calls it).
    pub down: DownPeers,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerClient {
        PeerClient {
            target,
            node: node.clone(),
            client: None,
            faults: self.faults.clone(),
            backoff: self.backoff,
            token: self.token.clone(),
            tls: self.tls.clone(),
            down: self.down.clone(),
        }
    }
}

/// Peers that stopped answering, by id: shared by every client to a peer (openraft makes a
/// new client for each election's vote requests).
pub type DownPeers = Arc<std::sync::Mutex<std::collections::HashMap<NodeId, Down>>>;

/// A peer that stopped answering: since when, failed calls since, and the last warning.
pub struct Down {
    since: std::time::Instant,
    failures: u64,
    warned: std::time::Instant,
    /// The last error's text (`code: message`).
    pub last_error: String,
    /// The last error was the peer refusing this node's cluster token.
    pub refused: bool,
    /// When the last call failed. A follower makes no Raft calls, so a mark it got while it
    /// campaigned stays until it calls again: readers judge by its age.
    pub at: std::time::Instant,
}

/// Seconds between warnings about a peer that stays unreachable (openraft retries it every
/// heartbeat, and its own error per retry is off in the default log filter).
const DOWN_WARN_EVERY_S: u64 = 10;

/// Sends Raft RPCs to one peer.
pub struct PeerClient {
    target: NodeId,
    node: BasicNode,
    client: Option<RaftClient<Channel>>,
    faults: Arc<Faults>,
    backoff: std::time::Duration,
    token: Option<crate::auth::Secret>,
    tls: Option<ClientTlsConfig>,
    down: DownPeers,
}

#[derive(Clone, Copy)]
enum Rpc {
    Append,
    Vote,
    Snapshot,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Transport(String);

impl PeerClient {
    async fn call<Req, Resp, E>(
        &mut self,
        rpc: Rpc,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        if self.faults.isolated() {
            return Err(RPCError::Unreachable(Unreachable::new(&Transport("isolated by an injected fault".into()))));
        }
        let client = match &mut self.client {
            Some(c) => c,
            None => {
                let ch = channel(&self.node.addr, self.tls.as_ref())
                    .map_err(|e| RPCError::Unreachable(Unreachable::new(&e)))?;
                self.client.insert(RaftClient::new(ch).max_encoding_message_size(super::MAX_MESSAGE_BYTES))
            }
        };
        let json = serde_json::to_vec(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let mut request = tonic::Request::new(RaftPayload { json });
        request.set_timeout(option.hard_ttl());
        if let Some(t) = &self.token {
            t.attach(request.metadata_mut());
        }
        let reply = match rpc {
            Rpc::Append => client.append_entries(request).await,
            Rpc::Vote => client.vote(request).await,
            Rpc::Snapshot => client.install_snapshot(request).await,
        };
        let (target, addr) = (self.target, &self.node.addr);
        {
            let mut down = self.down.lock().unwrap_or_else(|p| p.into_inner());
            // A peer that refuses this node's cluster token is as unreachable as a down one,
            // and the operator must hear why: the tokens differ.
            let refused = |c: tonic::Code| matches!(c, tonic::Code::Unauthenticated | tonic::Code::PermissionDenied);
            match &reply {
                Err(s) if s.code() == tonic::Code::Unavailable || refused(s.code()) => {
                    let now = std::time::Instant::now();
                    let d = down.entry(target).or_insert(Down {
                        since: now,
                        failures: 0,
                        warned: now,
                        last_error: String::new(),
                        refused: false,
                        at: now,
                    });
                    d.failures += 1;
                    d.last_error = format!("{:?}: {}", s.code(), s.message());
                    d.refused = refused(s.code());
                    d.at = now;
                    let due = d.failures == 1 || now - d.warned >= std::time::Duration::from_secs(DOWN_WARN_EVERY_S);
                    if due && refused(s.code()) {
                        d.warned = now;
                        tracing::warn!(peer = target, %addr, failures = d.failures, error = %s.message(),
                            "raft peer refuses this node's cluster token: give every node the same cluster token");
                    } else if due {
                        d.warned = now;
                        tracing::warn!(peer = target, %addr, failures = d.failures, down_s = d.since.elapsed().as_secs(),
                            error = %s.message(), "raft peer unreachable; retrying");
                    }
                }
                Ok(_) => {
                    if let Some(d) = down.remove(&target) {
                        tracing::info!(peer = target, %addr, down_s = d.since.elapsed().as_secs(), "raft peer reachable again");
                    }
                }
                Err(_) => {}
            }
        }
        let reply = reply.map_err(|s| {
            let e = Transport(format!("{}: {}", s.code(), s.message()));
            // Unreachable makes openraft back off; only a peer that cannot be reached at all
            // (refused, down, cut off) deserves that. A timeout or a reset is retried at once.
            match s.code() {
                tonic::Code::Unavailable | tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                    RPCError::Unreachable(Unreachable::new(&e))
                }
                _ => RPCError::Network(NetworkError::new(&e)),
            }
        })?;
        let result: Result<Resp, RaftError<NodeId, E>> =
            serde_json::from_slice(&reply.into_inner().json).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new_with_node(self.target, self.node.clone(), e)))
    }
}

impl RaftNetwork<TypeConfig> for PeerClient {
    fn backoff(&self) -> openraft::network::Backoff {
        openraft::network::Backoff::new(std::iter::repeat(self.backoff))
    }

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(Rpc::Append, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>>
    {
        self.call(Rpc::Snapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(Rpc::Vote, &rpc, &option).await
    }
}
