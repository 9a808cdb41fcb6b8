//! The node's background loops, above its state: each reads and writes the node's state
//! ([`crate::state::Shared`]) and drives a service whose handle the state holds.
//!
//! - [`autoscaler`]: every node evaluates the tier's scale policy, the Raft leader commits.
//! - [`replication`]: hot-prefix planning, commits and warm-ups ([`warm`] sends them).
//! - [`reconcile`]: brings this node's replicas, rotation and routing settings in line with the
//!   cluster's registry.
//! - [`gossip`]: booking deltas and summaries to and from the other router nodes.

pub mod autoscaler;
pub mod gossip;
pub mod reconcile;
pub mod replication;
pub mod warm;
