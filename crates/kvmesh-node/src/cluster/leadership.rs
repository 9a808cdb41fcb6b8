//! The leader as one node sees it, in its log.

use super::Cluster;
use std::sync::Arc;
use tokio::sync::watch;

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
