//! The core's lock guard. Status changes found under the lock are queued on the core and
//! logged once the guard has released it: a log write (stderr, perhaps a slow pipe) never
//! holds up the decisions waiting for the lock.

use super::Core;
use kvmesh_core::ReplicaStatus;
use parking_lot::MutexGuard;
use std::ops::{Deref, DerefMut};

/// One replica's status change, as [`Core::sync_routable`] found it.
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
            // Backpressure comes and goes every `overload_backoff_ms` under load; it is
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

/// The locked core ([`super::Shared::core`]); logs the queued status changes on drop, after
/// unlocking.
pub struct CoreGuard<'a> {
    inner: Option<MutexGuard<'a, Core>>,
}

impl<'a> CoreGuard<'a> {
    pub(super) fn new(inner: MutexGuard<'a, Core>) -> Self {
        CoreGuard { inner: Some(inner) }
    }

    /// Hands the lock to a thread waiting for it, if one is, and takes it back after: a
    /// writer applying a long batch in sections lets each waiting routing decision in
    /// between (unlocking and locking again would not: the running writer wins the race
    /// against a waiter that must first be woken).
    pub fn bump(&mut self) {
        if let Some(inner) = self.inner.as_mut() {
            MutexGuard::bump(inner);
        }
    }
}

impl Deref for CoreGuard<'_> {
    type Target = Core;
    fn deref(&self) -> &Core {
        self.inner.as_deref().expect("the guard holds the lock until dropped")
    }
}

impl DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut Core {
        self.inner.as_deref_mut().expect("the guard holds the lock until dropped")
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        let Some(mut core) = self.inner.take() else { return };
        // Taking an empty Vec allocates nothing: the common section pays nothing here.
        let changes = std::mem::take(&mut core.status_changes);
        drop(core);
        for c in &changes {
            c.log();
        }
    }
}
