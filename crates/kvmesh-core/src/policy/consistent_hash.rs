//! `consistent_hash`: the vLLM router's consistent hashing (vllm-project/router, PyPI
//! `vllm-router` 0.1.17, `src/policies/consistent_hash.rs` and `hash_key.rs`).
//!
//! Each registered replica owns [`VIRTUAL_NODES`] points on a 64-bit ring at
//! `hash(name ‖ ":" ‖ k)`, so the ring depends on names only, never on registration order, and
//! is the same on every router node (case C11). A request's key — the client's session key
//! when it sends one (the vLLM router reads `x-session-id`, `x-user-id`, … headers, then
//! `session_id` / `user` body fields), else the whole prompt (the router hashes the request
//! text) — goes to the first point clockwise. If that replica is not routable the request
//! goes to the first routable replica (the vLLM router's `healthy_indices[0]`; it does not walk
//! on). No load bound: a hot key stays on its replica. The ring is built over every registered
//! replica of the request's model (and disaggregated side), routable or not, so a replica
//! going unhealthy moves only its own keys.
//!
//! The vLLM router hashes with mcrouter's `furc_hash` and MurmurHash64A; xxh3 here places the
//! points as uniformly (the map of keys to replicas differs, not its statistics).

use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::ids::ReplicaId;
use crate::view::FleetView;
use crate::view::RouteRequest;
use rand::RngCore;
use std::fmt::Write;
use xxhash_rust::xxh3::xxh3_64;

/// Ring points per replica (`VIRTUAL_NODES_PER_WORKER`).
pub const VIRTUAL_NODES: u32 = 160;

/// Parameters of [`ConsistentHash`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConsistentHashParams {
    /// Ring points per replica. Default 160.
    pub vnodes: u32,
}

impl Default for ConsistentHashParams {
    fn default() -> Self {
        ConsistentHashParams { vnodes: VIRTUAL_NODES }
    }
}

/// Consistent hashing on the session or prompt key.
#[derive(Debug)]
pub struct ConsistentHash {
    params: ConsistentHashParams,
    /// Per worker list (role and model), `(point, name key, replica)`, sorted; all rebuilt
    /// when the fleet epoch changes.
    rings: rustc_hash::FxHashMap<(crate::Role, crate::ModelKey), Ring>,
    epoch: Option<u64>,
}

/// A hash ring: `(point, name key, replica)`, sorted.
type Ring = Vec<(u64, u64, ReplicaId)>;

impl ConsistentHash {
    /// A policy with `params`.
    pub fn new(params: ConsistentHashParams) -> Self {
        ConsistentHash { params, rings: Default::default(), epoch: None }
    }

    /// The ring of `view`'s worker list (its role and model), built if missing.
    fn ring(&mut self, view: &FleetView<'_>) -> &Ring {
        if self.epoch != Some(view.epoch) {
            self.rings.clear();
            self.epoch = Some(view.epoch);
        }
        let vnodes = self.params.vnodes;
        self.rings.entry((view.role, view.model)).or_insert_with(|| {
            // One ring per worker list, as the vLLM router keeps one per model and, in its
            // disaggregated mode, one for prefill and one for decode workers: a replica of
            // another model or role owning a key would spill every such key onto the first
            // routable one.
            let of_list = |r: &&crate::ReplicaState| {
                r.spec.role == view.role && (view.model == crate::ModelKey::ANY || r.model == view.model)
            };
            let mut ring = Vec::new();
            let mut label = String::new();
            for r in view.replicas.iter().filter(of_list) {
                for k in 0..vnodes {
                    label.clear();
                    let _ = write!(label, "{}:{k}", r.spec.name);
                    ring.push((xxh3_64(label.as_bytes()), r.name_key, r.id));
                }
            }
            // Ties between points (astronomically rare) are ordered by name key, not id, so the
            // ring stays independent of registration order.
            ring.sort_unstable_by_key(|&(p, key, _)| (p, key));
            ring
        })
    }
}

impl Policy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn reads_kv_events(&self) -> bool {
        false
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, _rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let first = view.routable().next().ok_or(Error::NoReplicaReady)?;
        let key = xxh3_64(&req.key.to_le_bytes());
        let ring = self.ring(view);
        let start = ring.partition_point(|&(p, _, _)| p < key);
        let Some(&(_, _, owner)) = ring.get(start % ring.len().max(1)) else {
            return Ok(Decision::at(view, req, first, Reason::RingSpill));
        };
        match view.replicas.binary_search_by_key(&owner, |r| r.id) {
            Ok(i) if view.takes(i) => Ok(Decision::at(view, req, i, Reason::RingOwner)),
            _ => Ok(Decision::at(view, req, first, Reason::RingSpill)),
        }
    }
}
