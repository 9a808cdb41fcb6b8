//! Shared bookings between router nodes ("gossip"): the deltas a node streams to its peers,
//! the periodic summary that makes loss, reordering and duplicates converge, and the merge of
//! a peer's bookings into this node's [`crate::Fleet`].
//!
//! Why: each router sees only its own bookings, so N routers deciding in the same instant all
//! pick the same "best" replica (herding, case C12). A booking learned from a peer carries
//! what the routing policy needs from it — its [`BookingSpec`] (token load) and the prefix it
//! was routed for — so every node's token load and pending-prefix view include the other
//! nodes' routing.
//!
//! - [`Outbox`]: a node's own deltas, numbered by a per-node sequence, and the live set a
//!   summary lists.
//! - [`RemoteBookings`]: a node's view of its peers' live bookings, merged into its fleet.
//!
//! Transport, batching and peer membership are the node's job; this module is pure.

mod outbox;
mod remote;

pub use outbox::Outbox;
pub use remote::{MergeStats, RemoteBookings};

use crate::ids::BlockHash;
use crate::load::BookingSpec;
use std::fmt;

/// A router node's id (the Raft node id). Not a [`crate::ReplicaId`]: replicas are engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node#{}", self.0)
    }
}

/// One change to one of a node's bookings.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    /// The sending node's sequence number: 1, 2, 3, … per node, never reused while it runs.
    pub seq: u64,
    /// The booking's id on the sending node.
    pub booking: u64,
    /// What happened.
    pub kind: DeltaKind,
    /// When it happened (for a Book: the routing decision), node seconds of the node holding
    /// the delta: the sender's clock in its outbox, the receiver's once received. Nodes'
    /// clocks differ, so the wire carries its age instead (`BookingDelta.age_s`): a delta that
    /// waited (a paused sender, a slow link) arrives as old as it is, and a peer's prefix
    /// credit and prefill drain count from the decision, not from the arrival.
    pub at: f64,
}

/// What happened to a booking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeltaKind {
    /// A request was routed to `replica` (its registry name: replica ids are per node).
    Book {
        /// Replica name.
        replica: String,
        /// The token load it carries.
        spec: BookingSpec,
        /// The leading block hashes of its prompt (at most the outbox's prefix limit), blocks
        /// of `block_size` tokens: the prefix now on its way to `replica`.
        prefix: Vec<BlockHash>,
    },
    /// Its first token arrived: its prefill is done.
    FirstToken,
    /// It ended; `output_tokens` when it completed normally.
    Release {
        /// Output tokens, tokens.
        output_tokens: Option<u32>,
    },
}

/// A node's complete live set: everything its deltas up to `seq` add up to.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Summary {
    /// The last delta sequence number this summary reflects.
    pub seq: u64,
    /// Every live booking, sorted by id.
    pub live: Vec<SummaryEntry>,
}

/// One live booking in a [`Summary`] (no prefix: a summary repairs load, and stays small).
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryEntry {
    /// The booking's id on the sending node.
    pub booking: u64,
    /// Replica name.
    pub replica: String,
    /// Its token load.
    pub spec: BookingSpec,
    /// Whether its first token arrived.
    pub first_token: bool,
    /// When it was booked, node seconds of the node holding the summary (as [`Delta::at`]).
    pub booked_at: f64,
}

#[cfg(test)]
mod tests;
