//! The router tier as a cluster: Raft (openraft 0.9, log and state machine in sled) for
//! membership, the replica registry and configuration; gossip for shared bookings.
//!
//! - [`registry`]: the replicated state and its commands (the state machine's logic).
//! - [`store`]: the sled-backed Raft log and state machine.
//! - [`network`]: Raft RPCs over tonic, and injected faults.
//! - [`operator`]: the operator's `kvmesh cluster` calls.
//! - [`removal`]: a node removed while it was down learns it from the members.
//! - `membership`: joins and leaves; `forward`: a write sent on to the leader; `status`: the
//!   cluster as this node sees it; `leadership`: leader changes in the log.
//!
//! Beside it: the Raft, Cluster and Gossip gRPC services in [`crate::grpc::cluster`], gossip of
//! this node's booking deltas in [`crate::tasks::gossip`], and keeping the node's replica
//! actors and policy in line with the registry in [`crate::tasks::reconcile`].
//!
//! The data path never waits for Raft: every node follows every replica itself and routes on
//! its own view; losing the leader or quorum freezes configuration changes only.

mod forward;
mod leadership;
mod membership;
pub mod network;
pub mod operator;
pub mod registry;
pub mod removal;
mod status;
pub mod store;

use forward::{forward_write, Forwarded};
pub use leadership::log_leadership;

use crate::config::{ClusterSection, ReplicaConfig};
use network::{Faults, Network};
use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, Raft, ServerState, SnapshotPolicy};
use registry::{ClusterState, Command, CommandResult};
use std::collections::BTreeMap;
use std::io::Cursor;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// `d` in whole milliseconds, as openraft's settings take them.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Metadata marking a write forwarded by another node.
pub const FORWARDED: &str = "x-kvmesh-forwarded";

openraft::declare_raft_types!(
    /// kvmesh's Raft types: registry commands in the log, u64 node ids, gRPC addresses.
    pub TypeConfig:
        D = Command,
        R = CommandResult,
);

/// Why a cluster operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// No leader is known (an election is running, or this side of a partition has no quorum).
    #[error("no Raft leader reachable (election running or quorum lost): configuration is frozen, routing continues")]
    NoLeader,
    /// The command was committed but changed nothing, and why.
    #[error("{0}")]
    Rejected(String),
    /// `init` on a node that already belongs to a cluster.
    #[error("this node is already initialized (a cluster is bootstrapped once)")]
    AlreadyInitialized,
    /// The leader could not be reached to forward to it.
    #[error("forwarding to the leader at {addr}: {error}")]
    Forward {
        /// The leader's address.
        addr: String,
        /// What went wrong.
        error: String,
    },
    /// openraft's own error.
    #[error("raft: {0}")]
    Raft(String),
    /// The change reached the leader's log but was not committed in time (no quorum): it may
    /// still take effect if quorum returns.
    #[error(
        "not committed within 5 s (no quorum of voters reachable?): the change may still take effect when quorum \
         returns; check `kvmesh cluster status`"
    )]
    NotCommitted,
}

/// Seconds a joining node has to answer the leader's first append (an address nobody
/// listens on fails fast).
pub const JOIN_ANSWER_S: u64 = 5;
/// Seconds a joining node has to catch up with the leader's log before it is promoted.
pub const JOIN_CATCH_UP_S: u64 = 30;

/// The file in `data_dir` that records this node's removal from its cluster
/// ([`Cluster::mark_removed`]), so a restart stays out.
pub const REMOVED_MARKER: &str = "REMOVED";

/// How often a write retries while no leader is reachable.
const RETRY_EVERY: Duration = Duration::from_millis(50);

/// One write attempt's outcome.
enum Attempt {
    /// Committed, refused for good, or out of time.
    Done(Result<(CommandResult, u64), ClusterError>),
    /// Not sent: no leader is known or it refused the connection; worth another try.
    NoLeaderYet(ClusterError),
}

impl From<ClusterError> for tonic::Status {
    fn from(e: ClusterError) -> Self {
        let msg = e.to_string();
        match e {
            ClusterError::NoLeader | ClusterError::Forward { .. } => tonic::Status::unavailable(msg),
            // gRPC's code for "may have completed anyway".
            ClusterError::NotCommitted => tonic::Status::deadline_exceeded(msg),
            ClusterError::Rejected(_) | ClusterError::AlreadyInitialized => tonic::Status::failed_precondition(msg),
            ClusterError::Raft(_) => tonic::Status::internal(msg),
        }
    }
}

/// This node's membership in the cluster.
pub struct Cluster {
    /// This node's id.
    pub id: u64,
    /// Its gRPC address as peers reach it.
    pub addr: String,
    /// The Raft instance.
    pub raft: Raft<TypeConfig>,
    /// The replicated state as applied here.
    pub state: watch::Receiver<Arc<ClusterState>>,
    /// Injected faults (tests, chaos).
    pub faults: Arc<Faults>,
    /// The `[cluster]` settings.
    pub section: ClusterSection,
    /// The token this node presents to the others (`[security] cluster_token_file`).
    pub token: Option<crate::auth::Secret>,
    /// TLS to the other nodes, when `[security] tls_cert_file` is set.
    pub tls: Option<tonic::transport::ClientTlsConfig>,
    seed: (Vec<ReplicaConfig>, String, BTreeMap<String, f64>),
    /// Peers this node's Raft calls find unreachable (shared with its network).
    down: network::DownPeers,
    /// Removed from the cluster ([`Cluster::mark_removed`]).
    removed: std::sync::atomic::AtomicBool,
}

impl Cluster {
    /// Opens the store in `section.data_dir` and starts Raft. A node with stored state rejoins
    /// its cluster by itself; a fresh one waits for `init` (or for a leader to add it).
    ///
    /// # Errors
    /// A corrupt or unopenable store, or invalid Raft timings.
    pub async fn start(
        section: ClusterSection,
        default_addr: String,
        seed_replicas: Vec<ReplicaConfig>,
        seed_policy: (String, BTreeMap<String, f64>),
        token: Option<crate::auth::Secret>,
        tls: Option<tonic::transport::ClientTlsConfig>,
    ) -> anyhow::Result<Cluster> {
        let (log_store, sm_store) = store::open_waiting(&section.data_dir).await?;
        let state = sm_store.subscribe();
        let config = openraft::Config {
            cluster_name: "kvmesh".into(),
            heartbeat_interval: millis(section.heartbeat),
            election_timeout_min: millis(section.election_timeout_min),
            election_timeout_max: millis(section.election_timeout_max),
            install_snapshot_timeout: 2000,
            // JSON spells each snapshot byte as up to 4 characters: 1 MiB chunks stay far
            // below MAX_MESSAGE_BYTES.
            snapshot_max_chunk_size: 1 << 20,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(section.snapshot_every),
            max_in_snapshot_log_to_keep: section.snapshot_every / 2,
            ..Default::default()
        }
        .validate()
        .map_err(|e| anyhow::anyhow!("cluster timings: {e}"))?;
        let faults = Arc::new(Faults::default());
        let down = network::DownPeers::default();
        let network = Network {
            faults: faults.clone(),
            backoff: section.heartbeat,
            token: token.clone(),
            tls: tls.clone(),
            down: down.clone(),
        };
        let raft = Raft::new(section.id, Arc::new(config), network, log_store, sm_store)
            .await
            .map_err(|e| anyhow::anyhow!("starting Raft: {e}"))?;
        let addr = if section.addr.is_empty() { default_addr } else { section.addr.clone() };
        let seed = (seed_replicas, seed_policy.0, seed_policy.1);
        // Removed before it stopped: its log still lists it (nothing after its removal
        // reached it), so only this marker says so.
        let removed = section.data_dir.join(REMOVED_MARKER).exists();
        if removed {
            tracing::warn!(
                node = section.id,
                data_dir = %section.data_dir.display(),
                "this node was removed from its cluster: it takes no part in Raft and reports not ready; wipe its \
                 data_dir and join it again to bring it back"
            );
            let _ = tokio::time::timeout(Duration::from_secs(2), raft.shutdown()).await;
        }
        Ok(Cluster {
            id: section.id,
            addr,
            raft,
            state,
            faults,
            section,
            token,
            tls,
            seed,
            down,
            removed: std::sync::atomic::AtomicBool::new(removed),
        })
    }

    /// Bootstraps a fresh cluster with the configured peers as voters, waits for a leader and
    /// seeds the registry from this node's configuration.
    ///
    /// # Errors
    /// [`ClusterError::AlreadyInitialized`]; a leader not elected within 10 s.
    pub async fn init(&self) -> Result<(), ClusterError> {
        if self.raft.metrics().borrow().membership_config.nodes().next().is_some() {
            // A bootstrap that initialized Raft but never wrote the seed (no leader within the
            // wait) is finished here; a seeded cluster is not bootstrapped twice.
            if self.state.borrow().seeded {
                return Err(ClusterError::AlreadyInitialized);
            }
            return self.seed().await;
        }
        let mut members: BTreeMap<u64, BasicNode> = self
            .section
            .peer_map()
            .map_err(|e| ClusterError::Rejected(e.to_string()))?
            .into_iter()
            .map(|(id, addr)| (id, BasicNode { addr }))
            .collect();
        members.entry(self.id).or_insert_with(|| BasicNode { addr: self.addr.clone() });
        match self.raft.initialize(members).await {
            Ok(()) => {}
            Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => {
                return Err(ClusterError::AlreadyInitialized)
            }
            Err(e) => return Err(ClusterError::Raft(e.to_string())),
        }
        self.seed().await
    }

    /// Writes the seed once a leader exists (a seeded registry refuses it: fine).
    async fn seed(&self) -> Result<(), ClusterError> {
        if let Err(e) = self.wait_for_leader(Duration::from_secs(10)).await {
            // Say who did not answer: an election needs a majority of the peers up.
            let down = self.unreachable_peers();
            if down.is_empty() {
                return Err(e);
            }
            // With why, when they answered at all: a peer that refuses the cluster token is up.
            let list: Vec<String> = down
                .iter()
                .map(|(id, addr)| match self.peer_error(*id).filter(|e| !e.starts_with("Unavailable")) {
                    Some(e) => format!("{id} at {addr} ({e})"),
                    None => format!("{id} at {addr}"),
                })
                .collect();
            return Err(ClusterError::Rejected(format!(
                "no Raft leader elected within 10 s; peers not answering: {}. Start them (with the same peers) and \
                 run `kvmesh cluster init` again",
                list.join(", ")
            )));
        }
        let seed =
            Command::Seed { replicas: self.seed.0.clone(), policy: self.seed.1.clone(), params: self.seed.2.clone() };
        match self.write(seed).await {
            Ok(_) | Err(ClusterError::Rejected(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Members this node's Raft calls currently find unreachable, with their addresses.
    pub fn unreachable_peers(&self) -> Vec<(u64, String)> {
        let members = self.members();
        let down = self.down.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(u64, String)> =
            down.keys().map(|id| (*id, members.get(id).cloned().unwrap_or_default())).collect();
        out.sort();
        out
    }

    /// The last error this node's Raft calls to `id` met, while it stays unreachable.
    pub fn peer_error(&self, id: u64) -> Option<String> {
        self.down.lock().unwrap_or_else(|p| p.into_inner()).get(&id).map(|d| d.last_error.clone())
    }

    /// Waits until some leader is known.
    ///
    /// # Errors
    /// [`ClusterError::NoLeader`] after `timeout`.
    pub async fn wait_for_leader(&self, timeout: Duration) -> Result<u64, ClusterError> {
        let mut m = self.raft.metrics();
        let found = tokio::time::timeout(timeout, async {
            loop {
                if let Some(l) = m.borrow().current_leader {
                    return l;
                }
                if m.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        found.map_err(|_| ClusterError::NoLeader)
    }

    /// Whether this node was removed from the cluster: by a leave it led, or told so by the
    /// leader that committed its removal. It then takes no part in Raft and reports not ready.
    pub fn removed(&self) -> bool {
        self.removed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether every other member refuses this node's cluster token: the last Raft call to
    /// each, within the last few election timeouts, was refused as unauthenticated. Its token
    /// differs from theirs, so it takes no part in the cluster, and it reports not ready until
    /// that changes. Only with two or more other members: with one, the two sides look alike
    /// (either may hold the wrong token), and taking the sound one out would be an outage.
    pub fn refused_by_every_peer(&self) -> bool {
        let peers: Vec<u64> = self.members().into_keys().filter(|&p| p != self.id).collect();
        // A node refused by all campaigns every election timeout, so its marks stay this fresh;
        // once it follows a leader it calls nobody, and its old marks age out.
        let fresh = self.leaderless_window();
        let down = self.down.lock().unwrap_or_else(|p| p.into_inner());
        peers.len() >= 2 && peers.iter().all(|p| down.get(p).is_some_and(|d| d.refused && d.at.elapsed() < fresh))
    }

    /// How long a member goes without a leader before that says more than an election running:
    /// four of the longest election timeouts, at least 2 s (a slow flush or a starved CPU can
    /// stretch one).
    pub fn leaderless_window(&self) -> Duration {
        (4 * self.section.election_timeout_max).max(Duration::from_secs(2))
    }

    /// The log index of the membership entry this node applies; 0 before any.
    pub fn membership_index(&self) -> u64 {
        self.raft.metrics().borrow().membership_config.log_id().map_or(0, |l| l.index)
    }

    /// Records that this node was removed and stops its Raft (in the background: a removed
    /// node's elections would only disturb the members). Idempotent.
    pub fn mark_removed(&self) {
        if self.removed.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        tracing::warn!(
            node = self.id,
            "this node was removed from the cluster: it no longer takes part in Raft and reports not ready; stop it, \
             or start it afresh (empty data_dir) and join it again"
        );
        let marker = self.section.data_dir.join(REMOVED_MARKER);
        if let Err(e) = std::fs::write(&marker, format!("node {} was removed from its cluster\n", self.id)) {
            tracing::warn!(path = %marker.display(), error = %e, "cannot record the removal: a restart would rejoin Raft");
        }
        let raft = self.raft.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(2), raft.shutdown()).await;
        });
    }

    /// Whether this node is the Raft leader now. Not `leader()` naming itself: a node that
    /// restarts reads its last vote back and names itself leader until it hears the newer
    /// term, while it is in fact a follower.
    ///
    /// Nor a leader a quorum no longer answers (partitioned, or its peers down): Raft keeps
    /// its state until it hears a newer term, but nothing it writes can commit, so it is not
    /// leading ([`Cluster::quorum_lost`]).
    pub fn leads(&self) -> bool {
        let m = self.raft.metrics().borrow().clone();
        m.state == openraft::ServerState::Leader && m.current_leader == Some(self.id) && !self.quorum_lost(&m)
    }

    /// Whether this node is in the leader state with no acknowledgement from a quorum for
    /// twice the longest election timeout (`cluster.election_timeout_max`: by then the
    /// others have elected a new leader if they could; twice, so a slow flush or a starved CPU
    /// does not flip it). A leader not acknowledged yet (just elected) counts as leading; a
    /// single voter is its own quorum.
    fn quorum_lost(&self, m: &openraft::RaftMetrics<u64, openraft::BasicNode>) -> bool {
        if m.state != ServerState::Leader || m.membership_config.membership().voter_ids().count() <= 1 {
            return false;
        }
        m.millis_since_quorum_ack.is_some_and(|ms| ms > 2 * millis(self.section.election_timeout_max))
    }

    /// The leader's id and address, if one is known.
    pub fn leader(&self) -> Option<(u64, String)> {
        let m = self.raft.metrics().borrow().clone();
        let id = m.current_leader?;
        let addr = m.membership_config.membership().get_node(&id).map(|n| n.addr.clone())?;
        Some((id, addr))
    }

    /// Replicates `cmd` through the leader (forwarding it there from a follower) and returns
    /// its result and log index once committed.
    ///
    /// # Errors
    /// [`ClusterError::NoLeader`] or [`ClusterError::NotCommitted`] without quorum,
    /// [`ClusterError::Rejected`] when the state machine refused it (unknown replica, duplicate
    /// name, …).
    pub async fn write(&self, cmd: Command) -> Result<(CommandResult, u64), ClusterError> {
        self.write_from(cmd, false).await
    }

    /// [`Cluster::write`]; `forwarded` when another node sent it here believing this node
    /// leads: it is not forwarded again (no loops between nodes with stale views).
    ///
    /// During a failover the write waits for the next leader instead of failing at once:
    /// while no leader is known (an election is running), or the leader this node knew
    /// refuses connections (it just died), it retries every 50 ms within the 5 s limit.
    ///
    /// # Errors
    /// As [`Cluster::write`]; after 5 s without a commit (this side of a partition has no
    /// quorum): [`ClusterError::NoLeader`] when nothing was sent, [`ClusterError::NotCommitted`]
    /// when it reached a leader's log (it may still take effect).
    pub async fn write_from(&self, cmd: Command, forwarded: bool) -> Result<(CommandResult, u64), ClusterError> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let (result, index) = loop {
            match self.write_once(&cmd, forwarded, deadline).await {
                Attempt::Done(r) => break r?,
                Attempt::NoLeaderYet(e) => {
                    if tokio::time::Instant::now() + RETRY_EVERY >= deadline {
                        return Err(ClusterError::NoLeader);
                    }
                    tracing::debug!(error = %e, "no reachable leader yet; retrying the write");
                    tokio::time::sleep(RETRY_EVERY).await;
                }
            }
        };
        // Read your writes: answer once this node's state machine has applied it too (a
        // forwarded write commits on the leader first).
        let mut m = self.raft.metrics();
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            m.wait_for(|m| m.last_applied.is_some_and(|l| l.index >= index)),
        )
        .await;
        match result.error {
            Some(e) => Err(ClusterError::Rejected(e)),
            None => Ok((result, index)),
        }
    }

    /// One try of [`Cluster::write_from`], within `deadline`.
    async fn write_once(&self, cmd: &Command, forwarded: bool, deadline: tokio::time::Instant) -> Attempt {
        if self.faults.isolated() {
            // An injected partition cuts this node off like the real one would: no leader is
            // reachable, and waiting will not change that.
            return Attempt::Done(Err(ClusterError::NoLeader));
        }
        let written = tokio::time::timeout_at(deadline, self.raft.client_write(cmd.clone())).await;
        let forward_to = match written {
            // In this leader's log, not committed: no quorum answers.
            Err(_) => return Attempt::Done(Err(ClusterError::NotCommitted)),
            Ok(Ok(resp)) => return Attempt::Done(Ok((resp.data, resp.log_id.index))),
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => match f.leader_node {
                Some(node) if !forwarded && f.leader_id != Some(self.id) => node.addr,
                // An election is running, or this node names itself on the vote it restarted
                // with: nothing was sent anywhere.
                _ if !forwarded => return Attempt::NoLeaderYet(ClusterError::NoLeader),
                _ => return Attempt::Done(Err(ClusterError::NoLeader)),
            },
            Ok(Err(e)) => return Attempt::Done(Err(ClusterError::Raft(e.to_string()))),
        };
        match tokio::time::timeout_at(deadline, forward_write(&forward_to, cmd, &self.token, self.tls.as_ref())).await {
            // Sent to the leader, no answer in time: it may yet commit.
            Err(_) => Attempt::Done(Err(ClusterError::NotCommitted)),
            // Refused before it was sent: safe to send again once a new leader is known.
            Ok(Err(Forwarded::Refused(e))) => Attempt::NoLeaderYet(e),
            Ok(Err(Forwarded::Failed(e))) => Attempt::Done(Err(e)),
            Ok(Ok(r)) => Attempt::Done(Ok(r)),
        }
    }
}

/// The largest Raft or gossip message a node accepts (tonic's default is 4 MiB): snapshot
/// chunks travel as JSON and a delayed gossip batch at thousands of requests/s is large.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
