//! The routing core and replica registry, behind the node's one lock: the fleet (bookings,
//! routing record; it reads the prefix index published beside it, [`crate::state::Shared::index`],
//! which KV events are applied to without this lock) and policy, each replica's live state,
//! and what the gossip and autoscaler keep beside them. Its methods are split by what they
//! serve: [`health`] (status from scrapes, failures and drains), [`events`] (what applied KV
//! events did, and the prompts that place orphaned stores), [`decide`] (decisions, bookings,
//! releases).

mod change;
mod decide;
mod events;
mod health;

use crate::state::Replica;
pub use change::StatusChange;
pub use events::AppliedBatch;
use kvmesh_core::{Fleet, Policy};
use rand::rngs::SmallRng;
use std::collections::BTreeMap;

/// The routing core and registry.
pub struct Core {
    /// Index, bookings, replicas' core state.
    pub fleet: Fleet,
    /// The configured policy.
    pub policy: Box<dyn Policy>,
    /// Its randomness.
    pub rng: SmallRng,
    /// Replicas by name.
    pub replicas: BTreeMap<String, Replica>,
    pub(in crate::state) unhealthy_after: u32,
    /// Seconds a drain takes to settle across the tier ([`drain::settle_s`]).
    pub(in crate::state) drain_settle_s: f64,
    /// Rotation flags (draining, starting) for replicas about to be added.
    pub(in crate::state) rotation_ahead: BTreeMap<String, (bool, bool)>,
    pub(in crate::state) events_silent_s: f64,
    pub(in crate::state) hung_after_s: f64,
    /// When every replica's routable flag was last re-evaluated (node seconds).
    pub(in crate::state) synced_at: f64,
    /// This node's booking deltas for its peers (`None`: single node or gossip off).
    pub outbox: Option<kvmesh_core::gossip::Outbox>,
    /// The peers' live bookings, merged into `fleet`.
    pub remote: kvmesh_core::gossip::RemoteBookings,
    /// This node's id in its cluster (0 alone).
    pub node_id: kvmesh_core::gossip::NodeId,
    /// This node's hot-prefix counts (replication on).
    pub sketch: Option<kvmesh_core::replication::PrefixSketch>,
    /// Token load of the requests that arrived since start, at this node and (through gossip)
    /// its peers, each counted once whether it was routed or held: uncached prompt plus
    /// expected output tokens. The autoscaler's demand is its rate.
    pub booked_tokens: f64,
    /// The part of `booked_tokens` counted on this node itself, tokens (gossiped to peers).
    pub own_demand_tokens: f64,
    /// Per peer: its incarnation and the last own demand it reported, tokens.
    pub(in crate::state) peer_demand: BTreeMap<u64, (u64, f64)>,
    /// Status changes found in this lock section, logged by [`crate::state::CoreGuard`] after it.
    pub(in crate::state) status_changes: Vec<StatusChange>,
}
