//! `[cluster]`: Raft between router nodes and shared bookings.

use super::ConfigError;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `[cluster]`: Raft between router nodes and shared bookings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSection {
    /// This node's Raft id, > 0.
    pub id: u64,
    /// Its gRPC address as the other nodes reach it (`host:port`); empty: `node.grpc`.
    pub addr: String,
    /// The initial voters, `id=host:port` each, this node included; `kvmesh cluster init`
    /// bootstraps them. A node that joins later lists none.
    pub peers: Vec<String>,
    /// Directory of the Raft log and state machine (sled); created if missing.
    pub data_dir: std::path::PathBuf,
    /// Share bookings with the other nodes.
    pub gossip: bool,
    /// Booking deltas are batched this long before they are sent.
    #[serde(with = "humantime_serde")]
    pub gossip_interval: Duration,
    /// A full summary of this node's live bookings goes out this often.
    #[serde(with = "humantime_serde")]
    pub summary_interval: Duration,
    /// A peer silent this long has its bookings dropped.
    #[serde(with = "humantime_serde")]
    pub peer_timeout: Duration,
    /// Raft heartbeat interval.
    #[serde(with = "humantime_serde")]
    pub heartbeat: Duration,
    /// Raft election timeout, a random value in [min, max).
    #[serde(with = "humantime_serde")]
    pub election_timeout_min: Duration,
    /// See `election_timeout_min`.
    #[serde(with = "humantime_serde")]
    pub election_timeout_max: Duration,
    /// A snapshot is taken (and the log before it purged) after this many new log entries.
    pub snapshot_every: u64,
    /// Accept `Cluster.InjectFault` (`kvmesh cluster fault`): tests and chaos runs only.
    pub allow_fault_injection: bool,
    /// Run the cluster without authentication: anyone who reaches the gRPC port can then
    /// send Raft and gossip messages and write the registry. Without it a node in a cluster
    /// refuses to start unless it has a cluster token (`[security] cluster_token_file` or
    /// `KVMESH_CLUSTER_TOKEN`) or mTLS (`tls_client_auth`); with it, it warns at every start.
    /// `kvmesh node --insecure` sets it.
    pub insecure: bool,
}

impl Default for ClusterSection {
    fn default() -> Self {
        ClusterSection {
            id: 0,
            addr: String::new(),
            peers: Vec::new(),
            data_dir: "kvmesh-data".into(),
            gossip: true,
            gossip_interval: Duration::from_millis(5),
            summary_interval: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_millis(100),
            election_timeout_min: Duration::from_millis(300),
            election_timeout_max: Duration::from_millis(600),
            snapshot_every: 1000,
            allow_fault_injection: false,
            insecure: false,
        }
    }
}

impl ClusterSection {
    /// `peers` as (id, address) pairs.
    ///
    /// # Errors
    /// An entry that is not `id=host:port` with a positive id, or an id listed twice.
    pub fn peer_map(&self) -> Result<std::collections::BTreeMap<u64, String>, ConfigError> {
        let mut out = std::collections::BTreeMap::<u64, String>::new();
        for p in &self.peers {
            let bad = |problem: String| ConfigError::setting("cluster.peers", problem);
            let (id, addr) = p.split_once('=').ok_or_else(|| bad(format!("entry {p:?} is not id=host:port")))?;
            let id: u64 = id.trim().parse().map_err(|_| bad(format!("entry {p:?}: the id is not a number")))?;
            if id == 0 || addr.trim().is_empty() || !addr.contains(':') {
                return Err(bad(format!("entry {p:?} is not id=host:port with id > 0")));
            }
            if let Some((other, _)) = out.iter().find(|(_, a)| a.as_str() == addr.trim()) {
                return Err(bad(format!(
                    "lists {} for ids {other} and {id}: each node serves at an address of its own",
                    addr.trim()
                )));
            }
            if out.insert(id, addr.trim().to_string()).is_some() {
                return Err(bad(format!("has id {id} twice: each node has an id of its own")));
            }
        }
        Ok(out)
    }

    /// Checks this node's own entry in `peers` against where it serves gRPC (`grpc_port`, the
    /// bound port) and `addr`: peers dial that entry, so a typo there cuts the node off.
    ///
    /// # Errors
    /// The entry differs from `addr` when `addr` is set, or names another port when it is not.
    pub fn check_own_peer(&self, grpc_port: u16) -> Result<(), ConfigError> {
        let peers = self.peer_map()?;
        let Some(own) = peers.get(&self.id) else { return Ok(()) };
        let port = own.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok());
        let wrong = if self.addr.is_empty() { port != Some(grpc_port) } else { *own != self.addr };
        if wrong {
            let serves = if self.addr.is_empty() { format!("port {grpc_port}") } else { self.addr.clone() };
            return Err(ConfigError::Conflict(format!(
                "cluster.peers lists this node (id {}) at {own}, but it serves gRPC on {serves}: peers would dial the \
                 wrong address; fix its entry in peers (or cluster.addr)",
                self.id
            )));
        }
        Ok(())
    }
}
