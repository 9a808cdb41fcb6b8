//! Joining and leaving the cluster, and who its members are.

use super::forward::{channel_to, forward_join, from_forwarded, mark_forwarded};
use super::*;
use kvmesh_proto::v1;
use openraft::error::{ClientWriteError, RaftError};
use openraft::BasicNode;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

impl Cluster {
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
            // A later join of this id starts with a clean record of its errors.
            self.down.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
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
    /// [`CatchUp`]: no answer within [`JOIN_ANSWER_S`], not caught up within
    /// [`JOIN_CATCH_UP_S`], or this node's Raft stopped meanwhile.
    async fn caught_up(&self, id: u64, target: u64) -> Result<(), CatchUp> {
        let mut m = self.raft.metrics();
        let matched = move |m: &openraft::RaftMetrics<u64, BasicNode>| {
            m.replication.as_ref().and_then(|r| r.get(&id).cloned().flatten()).map(|l| l.index)
        };
        tokio::time::timeout(Duration::from_secs(JOIN_ANSWER_S), m.wait_for(|m| matched(m).is_some()))
            .await
            .map_err(|_| CatchUp::NoAnswer { last_error: self.peer_error(id) })?
            .map_err(|_| CatchUp::Stopped)?;
        tokio::time::timeout(Duration::from_secs(JOIN_CATCH_UP_S), m.wait_for(|m| matched(m) >= Some(target)))
            .await
            .map_err(|_| CatchUp::Behind)?
            .map_err(|_| CatchUp::Stopped)?;
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
            let mut request =
                tonic::Request::new(v1::LeaveRequest { node_id: id, removed_notice: false, membership_index: 0 });
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
        let addr = self.members().get(&id).cloned();
        // Without quorum the change would wait for ever: answer like any other write.
        let committed =
            match tokio::time::timeout(Duration::from_secs(5), self.raft.change_membership(change, false)).await {
                Err(_) => return Err(ClusterError::NotCommitted),
                Ok(r) => r.map_err(|e| ClusterError::Raft(e.to_string()))?,
            };
        // Committed. The leader replicates nothing more to the node it removed, so that node
        // would keep serving as a member: tell it.
        if id == self.id {
            self.mark_removed();
        } else if let Some(addr) = addr {
            let at = committed.log_id.index;
            tokio::spawn(notify_removed(id, at, addr, self.token.clone(), self.tls.clone()));
        }
        Ok(())
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
}

/// Why a joining node was not promoted (the sentence continues "node 4 at host:port …").
#[derive(Debug, thiserror::Error)]
enum CatchUp {
    /// It never answered the leader's first replication call (the last error, when one).
    #[error("did not answer within {JOIN_ANSWER_S} s{}", last_error.as_ref().map(|e| format!(" (last error: {e})")).unwrap_or_default())]
    NoAnswer { last_error: Option<String> },
    /// It answered but did not reach the log index of its addition in time.
    #[error("did not catch up within {JOIN_CATCH_UP_S} s")]
    Behind,
    /// This node's Raft stopped while waiting.
    #[error("raft stopped")]
    Stopped,
}

/// Tells node `id` at `addr` that its removal, the membership entry at log index `at`, is
/// committed (`LeaveRequest.removed_notice`):
/// three tries a second apart, two seconds each. A node that is down then learns it from the
/// members when it comes back ([`super::removal`]).
async fn notify_removed(
    id: u64,
    at: u64,
    addr: String,
    token: Option<crate::auth::Secret>,
    tls: Option<tonic::transport::ClientTlsConfig>,
) {
    let mut last = String::new();
    for attempt in 0..3 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let call = async {
            let mut c = v1::cluster_client::ClusterClient::new(channel_to(&addr, tls.as_ref())?);
            let mut request =
                tonic::Request::new(v1::LeaveRequest { node_id: id, removed_notice: true, membership_index: at });
            mark_forwarded(request.metadata_mut(), &token);
            c.leave(request).await.map(|_| ()).map_err(|s| from_forwarded(&addr, &s))
        };
        match tokio::time::timeout(Duration::from_secs(2), call).await {
            Ok(Ok(())) => {
                tracing::info!(node = id, %addr, "told the removed node it was removed");
                return;
            }
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "no answer within 2 s".into(),
        }
    }
    tracing::warn!(node = id, %addr, error = %last, "could not tell the removed node it was removed: stop it by hand");
}
