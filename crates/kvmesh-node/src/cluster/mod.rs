//! The router tier as a cluster: Raft (openraft 0.9, log and state machine in sled) for
//! membership, the replica registry and configuration; gossip for shared bookings.
//!
//! - [`registry`]: the replicated state and its commands (the state machine's logic).
//! - [`store`]: the sled-backed Raft log and state machine.
//! - [`network`]: Raft RPCs over tonic, and injected faults.
//! - [`service`]: the `kvmesh.v1` Raft, Cluster and Gossip gRPC services.
//! - [`gossip`]: streaming this node's booking deltas to its peers.
//! - [`follow`]: keeping the node's replica actors and policy in line with the registry.
//!
//! The data path never waits for Raft: every node follows every replica itself and routes on
//! its own view; losing the leader or quorum freezes configuration changes only.

pub mod network;
pub mod operator;
pub mod registry;
pub mod store;

use crate::config::{ClusterSection, ReplicaConfig};
use kvmesh_proto::v1;
use network::{Faults, Network};
use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, Raft, ServerState, SnapshotPolicy};
use registry::{ClusterState, Command, CommandResult};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

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

/// Logs each change of Raft leader this node sees (who, in which term; a lost leader as a
/// warning) until `stop` turns true: an operator reading one node's log sees failovers.
pub async fn log_leadership(cluster: Arc<Cluster>, mut stop: watch::Receiver<bool>) {
    let mut m = cluster.raft.metrics();
    let mut last = m.borrow().current_leader;
    loop {
        tokio::select! {
            changed = m.changed() => if changed.is_err() { return },
            _ = stop.wait_for(|s| *s) => return,
        }
        let (leader, term) = {
            let b = m.borrow();
            (b.current_leader, b.current_term)
        };
        if leader != last {
            match leader {
                Some(l) if l == cluster.id => tracing::info!(term, "raft: this node leads"),
                Some(l) => tracing::info!(leader = l, term, "raft: leader elected"),
                None => tracing::warn!(term, previous = last, "raft: no leader (election running)"),
            }
            last = leader;
        }
    }
}

/// Seconds a joining node has to answer the leader's first append (an address nobody
/// listens on fails fast).
pub const JOIN_ANSWER_S: u64 = 5;
/// Seconds a joining node has to catch up with the leader's log before it is promoted.
pub const JOIN_CATCH_UP_S: u64 = 30;

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
        let (log_store, sm_store) = store::open(&section.data_dir)?;
        let state = sm_store.subscribe();
        let config = openraft::Config {
            cluster_name: "kvmesh".into(),
            heartbeat_interval: section.heartbeat_ms,
            election_timeout_min: section.election_timeout_min_ms,
            election_timeout_max: section.election_timeout_max_ms,
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
            backoff: Duration::from_millis(section.heartbeat_ms),
            token: token.clone(),
            tls: tls.clone(),
            down: down.clone(),
        };
        let raft = Raft::new(section.id, Arc::new(config), network, log_store, sm_store)
            .await
            .map_err(|e| anyhow::anyhow!("starting Raft: {e}"))?;
        let addr = if section.addr.is_empty() { default_addr } else { section.addr.clone() };
        let seed = (seed_replicas, seed_policy.0, seed_policy.1);
        Ok(Cluster { id: section.id, addr, raft, state, faults, section, token, tls, seed, down })
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
            .map_err(ClusterError::Rejected)?
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
            let list: Vec<String> = down.iter().map(|(id, addr)| format!("{id} at {addr}")).collect();
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

    /// Whether this node is the Raft leader now. Not `leader()` naming itself: a node that
    /// restarts reads its last vote back and names itself leader until it hears the newer
    /// term, while it is in fact a follower.
    pub fn leads(&self) -> bool {
        let m = self.raft.metrics().borrow().clone();
        m.state == openraft::ServerState::Leader && m.current_leader == Some(self.id)
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

    /// Adds node `id` at `addr`: as a learner until it has caught up, then as a voter.
    /// Forwarded to the leader. A voter already at `addr` is left as it is.
    ///
    /// # Errors
    /// No leader; `id` already a member at another address; a node that does not answer
    /// within [`JOIN_ANSWER_S`] or catch up within [`JOIN_CATCH_UP_S`] (it is removed again,
    /// not left a learner the leader keeps calling); [`ClusterError::NotCommitted`] when a
    /// membership change is not committed within 5 s; openraft's refusal (e.g. a membership
    /// change already in progress).
    pub async fn join(&self, id: u64, addr: String) -> Result<(), ClusterError> {
        if let Some(leader) = self.forward_target()? {
            return forward_join(&leader, id, addr, &self.token, self.tls.as_ref()).await;
        }
        let (voters, members) = (self.voters(), self.members());
        match members.get(&id) {
            Some(at) if *at != addr => {
                let role = if voters.contains(&id) { "voter" } else { "learner" };
                return Err(ClusterError::Rejected(format!(
                    "node {id} is already a {role} at {at}; to move it, `kvmesh cluster leave --id {id}` first"
                )));
            }
            Some(_) if voters.contains(&id) => return Ok(()),
            _ => {}
        }
        // openraft's `blocking` gives up waiting after a short time and answers Ok even for an
        // address nobody listens on (seen: "joined" in 0.2 s): the catch-up is checked below.
        // The learner entry itself commits like any write: not without quorum.
        let added = tokio::time::timeout(
            Duration::from_secs(5),
            self.raft.add_learner(id, BasicNode { addr: addr.clone() }, false),
        )
        .await
        .map_err(|_| ClusterError::NotCommitted)?;
        let target = match added {
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => match f.leader_node {
                Some(n) => return forward_join(&n.addr, id, addr, &self.token, self.tls.as_ref()).await,
                None => return Err(ClusterError::NoLeader),
            },
            Err(e) => return Err(ClusterError::Raft(e.to_string())),
            Ok(resp) => resp.log_id.index,
        };
        // R5: promote only a learner that has caught up.
        if let Err(why) = self.caught_up(id, target).await {
            let remove = openraft::ChangeMembers::RemoveNodes(BTreeSet::from([id]));
            let removed =
                tokio::time::timeout(Duration::from_secs(5), self.raft.change_membership(remove, false)).await;
            let then = if matches!(removed, Ok(Ok(_))) { "not added" } else { "left a learner; remove it with leave" };
            return Err(ClusterError::Rejected(format!(
                "node {id} at {addr} {why}: {then} (start it with --id {id} first, then join)"
            )));
        }
        // AddVoterIds changes only this member: two joins at once cannot undo each other.
        let change = openraft::ChangeMembers::AddVoterIds(BTreeSet::from([id]));
        match tokio::time::timeout(Duration::from_secs(5), self.raft.change_membership(change, false)).await {
            Err(_) => Err(ClusterError::NotCommitted),
            Ok(r) => r.map(|_| ()).map_err(|e| ClusterError::Raft(e.to_string())),
        }
    }

    /// Waits until this leader has replicated its log up to index `target` to node `id`.
    ///
    /// # Errors
    /// Why not: no answer within [`JOIN_ANSWER_S`], or not caught up within
    /// [`JOIN_CATCH_UP_S`].
    async fn caught_up(&self, id: u64, target: u64) -> Result<(), String> {
        let mut m = self.raft.metrics();
        let matched = move |m: &openraft::RaftMetrics<u64, BasicNode>| {
            m.replication.as_ref().and_then(|r| r.get(&id).cloned().flatten()).map(|l| l.index)
        };
        tokio::time::timeout(Duration::from_secs(JOIN_ANSWER_S), m.wait_for(|m| matched(m).is_some()))
            .await
            .map_err(|_| format!("did not answer within {JOIN_ANSWER_S} s"))?
            .map_err(|_| "raft stopped".to_string())?;
        tokio::time::timeout(Duration::from_secs(JOIN_CATCH_UP_S), m.wait_for(|m| matched(m) >= Some(target)))
            .await
            .map_err(|_| format!("did not catch up within {JOIN_CATCH_UP_S} s"))?
            .map_err(|_| "raft stopped".to_string())?;
        Ok(())
    }

    /// Removes node `id` (a voter, or a learner) from the cluster. Forwarded to the leader.
    ///
    /// # Errors
    /// No leader; an unknown node; the last voter; [`ClusterError::NotCommitted`] when the
    /// change is not committed within 5 s; openraft's refusal.
    pub async fn leave(&self, id: u64) -> Result<(), ClusterError> {
        if let Some(leader) = self.forward_target()? {
            let mut c = v1::cluster_client::ClusterClient::new(channel_to(&leader, self.tls.as_ref())?);
            let mut request = tonic::Request::new(v1::LeaveRequest { node_id: id });
            mark_forwarded(request.metadata_mut(), &self.token);
            operator::attach(request.metadata_mut());
            return c.leave(request).await.map(|_| ()).map_err(|s| from_forwarded(&leader, &s));
        }
        let voters = self.voters();
        let change = if voters.contains(&id) {
            if voters.len() == 1 {
                return Err(ClusterError::Rejected("the last node cannot leave".into()));
            }
            openraft::ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        } else if self.members().contains_key(&id) {
            // A learner (a join that did not finish): removed outright.
            openraft::ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        } else {
            return Err(ClusterError::Rejected(format!("node {id} is not a member")));
        };
        // Without quorum the change would wait for ever: answer like any other write.
        match tokio::time::timeout(Duration::from_secs(5), self.raft.change_membership(change, false)).await {
            Err(_) => Err(ClusterError::NotCommitted),
            Ok(r) => r.map(|_| ()).map_err(|e| ClusterError::Raft(e.to_string())),
        }
    }

    /// `None` when this node is the leader; the leader's address otherwise.
    fn forward_target(&self) -> Result<Option<String>, ClusterError> {
        match self.leader() {
            Some((id, _)) if id != self.id && self.faults.isolated() => Err(ClusterError::NoLeader),
            Some((id, _)) if id == self.id && self.leads() => Ok(None),
            // Named on the vote it restarted with, not leading: the real leader is not known yet.
            Some((id, _)) if id == self.id => Err(ClusterError::NoLeader),
            Some((_, addr)) => Ok(Some(addr)),
            None => Err(ClusterError::NoLeader),
        }
    }

    /// Current voter ids.
    pub fn voters(&self) -> BTreeSet<u64> {
        self.raft.metrics().borrow().membership_config.membership().voter_ids().collect()
    }

    /// Every member (voters and learners) with its address, this node included.
    pub fn members(&self) -> BTreeMap<u64, String> {
        let m = self.raft.metrics().borrow().clone();
        let members: BTreeMap<u64, String> =
            m.membership_config.membership().nodes().map(|(id, n)| (*id, n.addr.clone())).collect();
        if members.is_empty() {
            // Not bootstrapped yet: the configured peers are the best guess (gossip starts early).
            return self.section.peer_map().unwrap_or_default().into_iter().collect();
        }
        members
    }

    /// The cluster as this node sees it.
    pub fn status(&self) -> v1::ClusterStatus {
        let m = self.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership().clone();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let state = match m.state {
            ServerState::Leader => "leader",
            ServerState::Follower => "follower",
            ServerState::Candidate => "candidate",
            ServerState::Learner => "learner",
            ServerState::Shutdown => "shutdown",
        };
        let last_log = m.last_log_index.unwrap_or(0);
        let members = membership
            .nodes()
            .map(|(id, n)| v1::ClusterMember {
                node_id: *id,
                addr: n.addr.clone(),
                role: if voters.contains(id) { "voter" } else { "learner" }.into(),
                lag: m
                    .replication
                    .as_ref()
                    .and_then(|r| r.get(id))
                    .map(|matched| last_log.saturating_sub(matched.map_or(0, |l| l.index))),
                shared_bookings: 0,
                gossip_age_s: None,
            })
            .collect();
        let (leader_id, leader_addr) = match self.leader() {
            Some((id, addr)) => (Some(id), addr),
            None => (None, String::new()),
        };
        let cs = self.state.borrow().clone();
        let initialized = membership.nodes().next().is_some();
        v1::ClusterStatus {
            node_id: self.id,
            state: state.into(),
            leader_id,
            leader_addr,
            term: m.current_term,
            last_applied: m.last_applied.map_or(0, |l| l.index),
            last_log_index: last_log,
            members,
            initialized,
            seeded: cs.seeded,
            policy: cs.policy.clone().unwrap_or_default(),
            policy_params: cs.policy_params.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            registry: cs
                .replicas
                .values()
                .map(|e| v1::RegistryEntry { spec: Some(e.config.to_spec(0)), state: e.state.as_str().into() })
                .collect(),
        }
    }
}

/// The largest Raft or gossip message a node accepts (tonic's default is 4 MiB): snapshot
/// chunks travel as JSON and a delayed gossip batch at thousands of requests/s is large.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Metadata marking a write forwarded by another node.
pub const FORWARDED: &str = "x-kvmesh-forwarded";

/// Marks a request as forwarded by a node and signs it with the nodes' token. The leader
/// takes the nodes' token as the *node's* credential only; an operator's write forwarded
/// carries the operator's own too ([`operator`]).
fn mark_forwarded(meta: &mut tonic::metadata::MetadataMap, token: &Option<crate::auth::Secret>) {
    meta.insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
    if let Some(t) = token {
        t.attach(meta);
    }
}

fn channel_to(
    addr: &str,
    tls: Option<&tonic::transport::ClientTlsConfig>,
) -> Result<tonic::transport::Channel, ClusterError> {
    network::channel(addr, tls).map_err(|e| ClusterError::Forward { addr: addr.into(), error: e.to_string() })
}

async fn forward_join(
    leader: &str,
    id: u64,
    addr: String,
    token: &Option<crate::auth::Secret>,
    tls: Option<&tonic::transport::ClientTlsConfig>,
) -> Result<(), ClusterError> {
    let mut c = v1::cluster_client::ClusterClient::new(channel_to(leader, tls)?);
    let mut request = tonic::Request::new(v1::JoinRequest { node_id: id, addr });
    mark_forwarded(request.metadata_mut(), token);
    operator::attach(request.metadata_mut());
    c.join(request).await.map(|_| ()).map_err(|s| from_forwarded(leader, &s))
}

/// The leader's answer to a forwarded request, as this node's own error.
fn from_forwarded(addr: &str, s: &tonic::Status) -> ClusterError {
    match s.code() {
        tonic::Code::FailedPrecondition | tonic::Code::InvalidArgument => {
            ClusterError::Rejected(s.message().to_string())
        }
        tonic::Code::Unavailable if s.message().starts_with("no Raft leader") => ClusterError::NoLeader,
        tonic::Code::DeadlineExceeded if s.message().starts_with("not committed") => ClusterError::NotCommitted,
        _ => ClusterError::Forward { addr: addr.to_string(), error: s.message().to_string() },
    }
}

/// Why a forwarded write failed.
enum Forwarded {
    /// The leader refused the connection: nothing was sent.
    Refused(ClusterError),
    /// Anything else (the write may or may not have been applied).
    Failed(ClusterError),
}

async fn forward_write(
    addr: &str,
    cmd: &Command,
    token: &Option<crate::auth::Secret>,
    tls: Option<&tonic::transport::ClientTlsConfig>,
) -> Result<(CommandResult, u64), Forwarded> {
    let fwd = |error: String| Forwarded::Failed(ClusterError::Forward { addr: addr.to_string(), error });
    let mut c = v1::cluster_client::ClusterClient::new(channel_to(addr, tls).map_err(Forwarded::Failed)?);
    let json = serde_json::to_vec(cmd).map_err(|e| fwd(e.to_string()))?;
    let mut request = tonic::Request::new(v1::WriteRequest { command_json: json });
    mark_forwarded(request.metadata_mut(), token);
    operator::attach(request.metadata_mut());
    let reply = c.write(request).await.map_err(|s| {
        let e = from_forwarded(addr, &s);
        if connection_refused(&s) {
            Forwarded::Refused(e)
        } else {
            Forwarded::Failed(e)
        }
    })?;
    let r = reply.into_inner();
    let result: CommandResult = serde_json::from_slice(&r.result_json).map_err(|e| fwd(e.to_string()))?;
    Ok((result, r.log_index))
}

/// Whether `s` reports a refused TCP connection (somewhere in its source chain).
fn connection_refused(s: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(e) = source {
        if e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused) {
            return true;
        }
        source = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_forward_to_a_closed_port_is_refused_and_a_bad_reply_is_not() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let cmd = Command::RemoveReplica { name: "e0".into() };
        let refused = forward_write(&closed.to_string(), &cmd, &None, None).await;
        assert!(matches!(refused, Err(Forwarded::Refused(ClusterError::Forward { .. }))));
        // Something listens but does not speak gRPC: the write may have been read, so it is
        // not retried.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                use tokio::io::AsyncWriteExt;
                let _ = s.write_all(b"HTTP/1.1 500 nope\r\n\r\n").await;
            }
        });
        let failed = forward_write(&addr.to_string(), &cmd, &None, None).await;
        assert!(matches!(failed, Err(Forwarded::Failed(_))));
    }
}
