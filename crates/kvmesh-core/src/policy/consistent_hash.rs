//! `consistent_hash` with bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing
//! with Bounded Loads", SODA 2018).
//!
//! Each replica owns `vnodes` points on a 64-bit ring at `xxh3(name ‖ "#" ‖ k)`, so the ring
//! depends on names only, never on registration order, and is the same on every router node
//! (case C11). A request's key (session key or first block hash, see
//! [`RouteRequest::key`]) goes to the first replica clockwise whose outstanding requests are
//! below the bound `⌈c · (m + 1) / n⌉` (`m` outstanding requests in the fleet, `n` routable
//! replicas, `c` = 1.25 by default). Removing a replica moves only the keys it owned (while no
//! bound binds).

use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::fleet::{FleetView, RouteRequest};
use crate::ids::ReplicaId;
use rand::RngCore;
use std::fmt::Write;
use xxhash_rust::xxh3::xxh3_64;

/// Parameters of [`ConsistentHash`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConsistentHashParams {
    /// The load bound factor `c` (> 1). Default 1.25.
    pub load_factor: f64,
    /// Ring points per replica. Default 160.
    pub vnodes: u32,
}

impl Default for ConsistentHashParams {
    fn default() -> Self {
        ConsistentHashParams { load_factor: 1.25, vnodes: 160 }
    }
}

/// Consistent hashing with bounded loads.
#[derive(Debug)]
pub struct ConsistentHash {
    params: ConsistentHashParams,
    /// `(point, name key, replica)`, sorted; rebuilt when the fleet epoch changes.
    ring: Vec<(u64, u64, ReplicaId)>,
    epoch: Option<u64>,
}

impl ConsistentHash {
    /// A policy with `params`.
    pub fn new(params: ConsistentHashParams) -> Self {
        ConsistentHash { params, ring: Vec::new(), epoch: None }
    }

    fn rebuild(&mut self, view: &FleetView<'_>) {
        self.ring.clear();
        let mut label = String::new();
        for i in view.routable() {
            let r = &view.replicas[i];
            for k in 0..self.params.vnodes {
                label.clear();
                let _ = write!(label, "{}#{k}", r.spec.name);
                self.ring.push((xxh3_64(label.as_bytes()), r.name_key, r.id));
            }
        }
        // Ties between points (astronomically rare) are ordered by name key, not id, so the
        // ring stays independent of registration order.
        self.ring.sort_unstable_by_key(|&(p, key, _)| (p, key));
        self.epoch = Some(view.epoch);
    }
}

impl Policy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, _rng: &mut dyn RngCore) -> Result<Decision, Error> {
        if self.epoch != Some(view.epoch) {
            self.rebuild(view);
        }
        if self.ring.is_empty() {
            return Err(Error::NoReplicaReady);
        }
        let routable: Vec<usize> = view.routable().collect();
        let total: u64 = routable.iter().map(|&i| view.load(i).outstanding() as u64).sum();
        let bound = (self.params.load_factor * (total + 1) as f64 / routable.len() as f64).ceil() as u64;
        let key = xxh3_64(&req.key.to_le_bytes());
        let start = self.ring.partition_point(|&(p, _, _)| p < key);
        let mut owner = None;
        for step in 0..self.ring.len() {
            let id = self.ring[(start + step) % self.ring.len()].2;
            let Ok(i) = view.replicas.binary_search_by_key(&id, |r| r.id) else { continue };
            if owner.is_none() {
                owner = Some(id);
            }
            if (view.load(i).outstanding() as u64) < bound {
                let reason = if owner == Some(id) { Reason::RingOwner } else { Reason::RingSpill };
                return Ok(Decision::at(view, req, i, reason));
            }
        }
        // Unreachable while c > 1 (some replica is always below the bound); stay total anyway.
        let i = routable[0];
        Ok(Decision::at(view, req, i, Reason::RingSpill))
    }
}
