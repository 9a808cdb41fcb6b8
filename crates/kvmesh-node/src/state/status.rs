//! A replica's status as operators see it (metrics, logs, `kvmesh status`, the API).

/// What a replica is doing, as operators see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Routable, events (if configured) current.
    Ready,
    /// Not routed to by operator request or a scale-down; in-flight requests finish.
    Draining,
    /// Registered `starting` in the cluster's registry (its engine still loading): not routed
    /// to until marked ready.
    Starting,
    /// Events were missed; being resynced (routed on load meanwhile).
    OutOfSync,
    /// Configured for events, none arrive while it serves (routed on load and the record).
    NoEvents,
    /// Its events carry another block size (routed on load only).
    BlockSizeMismatch,
    /// Its KV-event stream kept bringing bad messages: quarantined, its blocks dropped and
    /// its stream not followed for `limits.kv_event_quarantine_s` (routed on load only).
    BadEvents,
    /// Failing health checks or connects; not routed to.
    Unhealthy,
    /// Answered 429/503; out of rotation until the backoff ends.
    Overloaded,
}

impl Status {
    /// Stable lower-case name (metrics label, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ready => "ready",
            Status::Draining => "draining",
            Status::Starting => "starting",
            Status::OutOfSync => "out_of_sync",
            Status::NoEvents => "no_events",
            Status::BlockSizeMismatch => "block_size_mismatch",
            Status::BadEvents => "bad_events",
            Status::Unhealthy => "unhealthy",
            Status::Overloaded => "overloaded",
        }
    }

    /// Every status, for metrics.
    pub const ALL: [Status; 9] = [
        Status::Ready,
        Status::Draining,
        Status::Starting,
        Status::OutOfSync,
        Status::NoEvents,
        Status::BlockSizeMismatch,
        Status::BadEvents,
        Status::Unhealthy,
        Status::Overloaded,
    ];
}
