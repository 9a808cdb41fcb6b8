//! The cluster as one node sees it: what `kvmesh cluster status` and `Cluster.Status` show.

use super::Cluster;
use kvmesh_proto::v1;
use openraft::ServerState;
use std::collections::BTreeSet;

impl Cluster {
    /// The cluster as this node sees it.
    pub fn status(&self) -> v1::ClusterStatus {
        let m = self.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership().clone();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let state = match m.state {
            ServerState::Leader if self.quorum_lost(&m) => "leader without quorum",
            ServerState::Leader => "leader",
            ServerState::Follower => "follower",
            ServerState::Candidate => "candidate",
            ServerState::Learner => "learner",
            ServerState::Shutdown => "shutdown",
        };
        let last_log = m.last_log_index.unwrap_or(0);
        let membership_index = self.membership_index();
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
            membership_index,
            registry: cs
                .replicas
                .values()
                .map(|e| v1::RegistryEntry { spec: Some(e.config.to_spec(0)), state: e.state.as_str().into() })
                .collect(),
        }
    }
}
