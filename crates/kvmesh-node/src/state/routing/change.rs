//! A replica's status change found under the lock, logged after it ([`crate::state::CoreGuard`]).

use kvmesh_core::ReplicaStatus;

/// One replica's status change, as [`super::Core::sync_routable`] found it.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusChange {
    /// The replica's name.
    pub replica: String,
    /// Its status before.
    pub from: ReplicaStatus,
    /// Its status now.
    pub to: ReplicaStatus,
    /// Why, for operators (empty for `ready`).
    pub detail: String,
}

impl StatusChange {
    /// Logs the change at the level it deserves.
    pub fn log(&self) {
        let (name, from_s, to_s, detail) = (&self.replica, self.from.as_str(), self.to.as_str(), &self.detail);
        match self.to {
            // Backpressure comes and goes every `overload_backoff` under load; it is
            // counted (`kvmesh_requests_total{outcome="backpressure"}`), and logged at debug.
            ReplicaStatus::Overloaded => {
                tracing::debug!(replica = %name, from = from_s, to = to_s, %detail, "replica status changed")
            }
            ReplicaStatus::Ready if self.from == ReplicaStatus::Overloaded => {
                tracing::debug!(replica = %name, from = from_s, "replica ready")
            }
            ReplicaStatus::Ready => tracing::info!(replica = %name, from = from_s, "replica ready"),
            ReplicaStatus::Draining | ReplicaStatus::Starting | ReplicaStatus::Removed => {
                tracing::info!(replica = %name, from = from_s, to = to_s, %detail, "replica status changed")
            }
            ReplicaStatus::BlockSizeMismatch => {
                tracing::error!(replica = %name, from = from_s, to = to_s, %detail, "replica status changed")
            }
            ReplicaStatus::Unhealthy
            | ReplicaStatus::OutOfSync
            | ReplicaStatus::NoEvents
            | ReplicaStatus::BadEvents => {
                tracing::warn!(replica = %name, from = from_s, to = to_s, %detail, "replica status changed")
            }
        }
    }
}
