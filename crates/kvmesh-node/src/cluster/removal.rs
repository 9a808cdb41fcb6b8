//! Learning of a removal this node missed.
//!
//! The leader that commits a node's removal tells that node (`LeaveRequest.removed_notice`,
//! `cluster::membership`); a node that was down then never hears it, and nothing else would
//! tell it: the leader replicates nothing more to it. Restarted, it would campaign for ever
//! and route on a registry that no longer reaches it. So a node that has known no leader for a
//! while asks the members it knows how they see the cluster, and takes the word of one that
//! follows a leader under a newer membership without it.

use super::forward::{channel_to, mark_forwarded};
use super::Cluster;
use kvmesh_proto::v1;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Whether `answer` (a member's `Cluster.Status`) says node `own_id` was removed: it follows a
/// leader other than `own_id`, and its membership, applied there (so committed) and newer than
/// `own_index` (the log index of the membership `own_id` applies), lists no `own_id`.
pub(super) fn says_removed(own_id: u64, own_index: u64, answer: &v1::ClusterStatus) -> bool {
    answer.initialized
        && answer.leader_id.is_some_and(|l| l != own_id)
        && answer.membership_index > own_index
        && answer.membership_index <= answer.last_applied
        && !answer.members.iter().any(|m| m.node_id == own_id)
}

/// Watches, while this node is a member by its own membership (a node that never joined, or
/// a learner not caught up yet, is not in it and is never judged), for a leaderless spell of
/// `period` (four election timeouts, at least 2 s); then asks each other member it knows for
/// its status (2 s each) and marks this node removed ([`Cluster::mark_removed`]) when one
/// `says_removed`. Ends once removed, or when `stop` turns true.
pub async fn watch(cluster: Arc<Cluster>, mut stop: watch::Receiver<bool>) {
    let period = cluster.leaderless_window();
    let tick = (period / 4).max(Duration::from_millis(100));
    let mut leaderless_since: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if cluster.removed() {
            return;
        }
        // Following a leader (or leading) means being a member.
        let follows = cluster.leader().is_some_and(|(id, _)| id != cluster.id) || cluster.leads();
        // Its own membership, not `members()`: that falls back to the configured peers before
        // any membership, where a wiped node that has not joined yet would find itself.
        let listed =
            cluster.raft.metrics().borrow().membership_config.membership().nodes().any(|(id, _)| *id == cluster.id);
        let own_index = cluster.membership_index();
        if follows || !listed || cluster.faults.isolated() {
            leaderless_since = None;
            continue;
        }
        let since = *leaderless_since.get_or_insert_with(tokio::time::Instant::now);
        if since.elapsed() < period {
            continue;
        }
        let ask = async {
            for (id, addr) in cluster.members().into_iter().filter(|(id, _)| *id != cluster.id) {
                let Some(answer) = status_of(&cluster, &addr).await else { continue };
                if says_removed(cluster.id, own_index, &answer) {
                    return Some((id, answer));
                }
            }
            None
        };
        let told = tokio::select! {
            told = ask => told,
            _ = stop.wait_for(|s| *s) => return,
        };
        if let Some((id, answer)) = told {
            tracing::warn!(
                told_by = id,
                leader = answer.leader_id,
                membership_index = answer.membership_index,
                own_membership_index = own_index,
                "a member follows a newer membership without this node: it was removed while it was down"
            );
            cluster.mark_removed();
            return;
        }
        // Asked everyone: wait another spell before asking again.
        leaderless_since = None;
    }
}

/// The member at `addr`'s `Cluster.Status`, asked with this node's cluster token; `None` when
/// it does not answer within 2 s.
async fn status_of(cluster: &Cluster, addr: &str) -> Option<v1::ClusterStatus> {
    let call = async {
        let mut client = v1::cluster_client::ClusterClient::new(channel_to(addr, cluster.tls.as_ref()).ok()?);
        let mut request = tonic::Request::new(v1::ClusterStatusRequest {});
        mark_forwarded(request.metadata_mut(), &cluster.token);
        client.status(request).await.ok().map(tonic::Response::into_inner)
    };
    tokio::time::timeout(Duration::from_secs(2), call).await.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(leader: Option<u64>, members: &[u64], membership_index: u64) -> v1::ClusterStatus {
        v1::ClusterStatus {
            node_id: 1,
            leader_id: leader,
            initialized: true,
            membership_index,
            last_applied: membership_index + 5,
            members: members.iter().map(|&node_id| v1::ClusterMember { node_id, ..Default::default() }).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn only_a_newer_membership_under_a_leader_without_this_node_removes_it() {
        // Node 4, whose own membership entry is at index 40.
        assert!(says_removed(4, 40, &answer(Some(1), &[1, 2, 3], 41)));
        // The same membership or an older one (this node joined after it): not removed.
        assert!(!says_removed(4, 40, &answer(Some(1), &[1, 2, 3], 40)));
        assert!(!says_removed(4, 40, &answer(Some(1), &[1, 2, 3], 12)));
        // Listed (joined again while down): a member.
        assert!(!says_removed(4, 40, &answer(Some(1), &[1, 2, 3, 4], 50)));
        // No leader there, or this node named as leader (a stale answer): no word to take.
        assert!(!says_removed(4, 40, &answer(None, &[1, 2, 3], 50)));
        assert!(!says_removed(4, 40, &answer(Some(4), &[1, 2, 3], 50)));
        // A membership the member has not applied may not be committed (a stale leader's).
        assert!(!says_removed(4, 40, &v1::ClusterStatus { last_applied: 44, ..answer(Some(1), &[1, 2, 3], 45) }));
        // A member not bootstrapped yet knows no membership.
        assert!(!says_removed(4, 0, &v1::ClusterStatus { initialized: false, ..answer(Some(1), &[1], 3) }));
    }
}
