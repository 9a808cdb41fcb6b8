//! A replica's status: one enum for the routing core, the cluster's registry, the node's
//! health rules, the API and the CLI.

use serde::{Deserialize, Serialize};

/// Where a replica is in its life and how it is doing, as the router sees it.
///
/// The cluster's registry records the operator's intent (`starting`, `ready`, `draining`,
/// `removed`; its serde names are the Raft log's); a node derives the rest from what it
/// observes (scrapes, KV events, answers). The routing core takes only what
/// [`ReplicaStatus::routable`] says of it. The lower-case names ([`ReplicaStatus::as_str`])
/// are the metrics label values, the log fields, the CLI's words and, upper-cased after
/// `REPLICA_STATUS_`, the gRPC enum's value names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaStatus {
    /// Routable, events (if configured) current.
    Ready,
    /// Not routed to by operator request or a scale-down; in-flight requests finish.
    Draining,
    /// Registered `starting` (its engine still loading weights): not routed to until marked
    /// ready. A node also reports a replica registered without `capacity_blocks` so until its
    /// engine has reported its KV capacity (the routing core takes no replica without one).
    Starting,
    /// Events were missed; being resynced (routed on load meanwhile).
    OutOfSync,
    /// Configured for events, none arrive while it serves (routed on load and the record).
    NoEvents,
    /// Its events carry another block size (routed on load only).
    BlockSizeMismatch,
    /// Its KV-event stream kept bringing bad messages: quarantined, its blocks dropped and
    /// its stream not followed for a while (routed on load only).
    BadEvents,
    /// Failing health checks or connects; not routed to.
    Unhealthy,
    /// Answered 429/503; out of rotation until the backoff ends.
    Overloaded,
    /// Removed from the registry (kept there so operators see what was removed and when);
    /// a node no longer follows it.
    Removed,
}

impl ReplicaStatus {
    /// Stable lower-case name (metrics label, logs, CLI).
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaStatus::Ready => "ready",
            ReplicaStatus::Draining => "draining",
            ReplicaStatus::Starting => "starting",
            ReplicaStatus::OutOfSync => "out_of_sync",
            ReplicaStatus::NoEvents => "no_events",
            ReplicaStatus::BlockSizeMismatch => "block_size_mismatch",
            ReplicaStatus::BadEvents => "bad_events",
            ReplicaStatus::Unhealthy => "unhealthy",
            ReplicaStatus::Overloaded => "overloaded",
            ReplicaStatus::Removed => "removed",
        }
    }

    /// Whether new requests may go to a replica in this status: ready, or serving with an
    /// event stream that cannot be trusted (routed on load, and on the router's own record).
    pub fn routable(self) -> bool {
        matches!(
            self,
            ReplicaStatus::Ready
                | ReplicaStatus::OutOfSync
                | ReplicaStatus::NoEvents
                | ReplicaStatus::BlockSizeMismatch
                | ReplicaStatus::BadEvents
        )
    }

    /// Whether the cluster's registry may record this status: the operator's intent
    /// (`starting`, `ready`, `draining`, `removed`), not what a node observes.
    pub fn is_lifecycle(self) -> bool {
        matches!(
            self,
            ReplicaStatus::Starting | ReplicaStatus::Ready | ReplicaStatus::Draining | ReplicaStatus::Removed
        )
    }

    /// Every status a followed replica can be in (all but `removed`): the metrics' series.
    pub const OBSERVED: [ReplicaStatus; 9] = [
        ReplicaStatus::Ready,
        ReplicaStatus::Draining,
        ReplicaStatus::Starting,
        ReplicaStatus::OutOfSync,
        ReplicaStatus::NoEvents,
        ReplicaStatus::BlockSizeMismatch,
        ReplicaStatus::BadEvents,
        ReplicaStatus::Unhealthy,
        ReplicaStatus::Overloaded,
    ];
}

impl std::fmt::Display for ReplicaStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::ReplicaStatus;

    fn all_with_removed() -> Vec<ReplicaStatus> {
        let mut all = ReplicaStatus::OBSERVED.to_vec();
        all.push(ReplicaStatus::Removed);
        all
    }

    #[test]
    fn names_are_the_serde_names_and_routable_is_ready_or_serving_on_load() {
        for s in all_with_removed() {
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{}\"", s.as_str()));
            assert_eq!(serde_json::from_str::<ReplicaStatus>(&format!("\"{s}\"")).unwrap(), s);
        }
        let routable: Vec<&str> = ReplicaStatus::OBSERVED.iter().filter(|s| s.routable()).map(|s| s.as_str()).collect();
        assert_eq!(routable, ["ready", "out_of_sync", "no_events", "block_size_mismatch", "bad_events"]);
        assert!(!ReplicaStatus::Removed.routable());
        let lifecycle: Vec<&str> =
            all_with_removed().into_iter().filter(|s| s.is_lifecycle()).map(|s| s.as_str()).collect();
        assert_eq!(lifecycle, ["ready", "draining", "starting", "removed"]);
    }
}
