//! The core's one error type. Every fallible core call returns [`Error`]; none panics on input.

use crate::ids::ReplicaId;

/// What went wrong in a core call, with the offending values quoted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `block_size` must be at least one token.
    #[error("block_size must be at least 1 token, got 0")]
    ZeroBlockSize,
    /// The replica id is not (or no longer) registered in the fleet.
    #[error("unknown replica {0}")]
    UnknownReplica(ReplicaId),
    /// A replica with this name is already registered.
    #[error("replica name {0:?} is already registered")]
    DuplicateReplica(String),
    /// A routing decision was asked of a fleet with no replica that may take traffic.
    #[error("no replica is ready to take traffic")]
    NoReplicaReady,
    /// The booking id is unknown: already released, expired, or never booked.
    #[error("unknown booking {0}")]
    UnknownBooking(u64),
    /// A policy name that [`crate::policy::PolicyKind`] does not know.
    #[error("unknown policy {name:?}; known policies: {known}")]
    UnknownPolicy {
        /// The name given.
        name: String,
        /// The accepted names, comma separated.
        known: String,
    },
    /// A configuration value outside its valid range.
    #[error("invalid {field}: {reason}")]
    InvalidConfig {
        /// The field, as named in the config.
        field: &'static str,
        /// Why the value is rejected, quoting it.
        reason: String,
    },
}
