//! Decisions, bookings, first tokens, releases and expiry.

use super::Core;
use crate::endpoints::Endpoints;
use crate::state::{NamedReplica, ACTIVE_PEER_WINDOW_S};
use kvmesh_core::load::BookingId;
use kvmesh_core::{Decision, RouteRequest, Routed};
use std::sync::Arc;

impl Core {
    /// Decides where `req` would go at `now`, booking nothing (admission control checks the
    /// decision before [`Core::book`] commits it).
    ///
    /// # Errors
    /// The core's error (no replica ready, …).
    pub fn decide(&mut self, req: &RouteRequest, now: f64) -> Result<Decision, kvmesh_core::Error> {
        self.decide_within(req, None, now)
    }

    /// [`Core::decide`] among `subset` only (replica ids, sorted), when given: a gateway's
    /// endpoint subset ([`crate::epp`]).
    ///
    /// # Errors
    /// No replica of the subset takes traffic.
    pub fn decide_within(
        &mut self,
        req: &RouteRequest,
        subset: Option<&[kvmesh_core::ReplicaId]>,
        now: f64,
    ) -> Result<Decision, kvmesh_core::Error> {
        self.ready_to_decide(now);
        let Core { fleet, policy, rng, .. } = self;
        fleet.decide_within(policy.as_mut(), req, subset, rng, now)
    }

    /// What every decision at `now` needs first: replicas' routable flags current, and the
    /// active peers (gossip) told to the fleet.
    fn ready_to_decide(&mut self, now: f64) {
        // Status changes on events, scrapes and failures re-sync their replica at once; only
        // the passing of time (an overload mark or event silence running out) needs a sweep,
        // and a sweep every 10 ms is plenty.
        if now - self.synced_at > 0.01 {
            self.sync_all(now);
            self.synced_at = now;
        }
        let (peers, rank) = self.remote.active_peers(self.node_id, now, ACTIVE_PEER_WINDOW_S);
        self.fleet.set_active_peers(peers, rank);
    }

    /// Books `decision` (from [`Core::decide`] for `req`) and tells the peers; returns the
    /// booking, the replica's name and its URLs.
    ///
    /// # Errors
    /// The replica is gone or no longer routable.
    pub fn book(
        &mut self,
        req: &RouteRequest,
        decision: Decision,
        now: f64,
    ) -> Result<(Routed, String, Arc<Endpoints>), kvmesh_core::Error> {
        // The core knows each replica's name (a binary search), the registry its endpoint;
        // looked up first, so a failure leaves nothing booked.
        let id = decision.replica;
        let (name, endpoints) = self
            .fleet
            .replica(id)
            .and_then(|state| self.replicas.get(&state.spec.name))
            .map(|r| (r.config.name.clone(), r.endpoints.clone()))
            .ok_or(kvmesh_core::Error::UnknownReplica(id))?;
        let routed = self.fleet.book_decision(self.policy.as_mut(), req, decision, now)?;
        if let Some(out) = self.outbox.as_mut() {
            out.routed(&self.fleet, &routed, &req.hashes, now);
        }
        Ok((routed, name, endpoints))
    }

    /// Whether requests of `model` go to a prefill and a decode replica, among `subset`
    /// (sorted ids) when given (see [`kvmesh_core::Fleet::disaggregated`]).
    pub fn disaggregated(
        &self,
        model: Option<kvmesh_core::ModelKey>,
        subset: Option<&[kvmesh_core::ReplicaId]>,
    ) -> bool {
        self.fleet.disaggregated(model, subset)
    }

    /// Decides both sides of a disaggregated `req` at `now` among `subset` (sorted ids), when
    /// given, booking nothing ([`kvmesh_core::Fleet::decide_pd`]).
    ///
    /// # Errors
    /// Either side has no routable replica.
    pub fn decide_pd_within(
        &mut self,
        req: &RouteRequest,
        subset: Option<&[kvmesh_core::ReplicaId]>,
        now: f64,
    ) -> Result<kvmesh_core::PdDecision, kvmesh_core::Error> {
        self.ready_to_decide(now);
        let Core { fleet, policy, rng, .. } = self;
        fleet.decide_pd(policy.as_mut(), req, subset, rng, now)
    }

    /// Books both sides of `d` (from [`Core::decide_pd_within`] for `req`) and tells the
    /// peers; returns the bookings and each side's name and URLs (prefill, decode).
    ///
    /// # Errors
    /// Either replica is gone or no longer routable; nothing stays booked.
    pub fn book_pd(
        &mut self,
        req: &RouteRequest,
        d: kvmesh_core::PdDecision,
        now: f64,
    ) -> Result<(kvmesh_core::PdRouted, [NamedReplica; 2]), kvmesh_core::Error> {
        let side = |id: kvmesh_core::ReplicaId| {
            self.fleet
                .replica(id)
                .and_then(|state| self.replicas.get(&state.spec.name))
                .map(|r| (r.config.name.clone(), r.endpoints.clone()))
                .ok_or(kvmesh_core::Error::UnknownReplica(id))
        };
        let sides = [side(d.prefill.replica)?, side(d.decode.replica)?];
        let routed = self.fleet.book_pd(self.policy.as_mut(), req, d, now)?;
        if let Some(out) = self.outbox.as_mut() {
            out.routed(&self.fleet, &routed.prefill, &req.hashes, now);
            out.routed(&self.fleet, &routed.decode, &req.hashes, now);
        }
        Ok((routed, sides))
    }

    /// Counts `req` (decided as `decision`) as arriving demand: its token load (uncached
    /// prefill plus expected output, tokens) for the autoscaler, and its prompt `tokens` for
    /// the hot-prefix sketch (`hot_prefix` false: not, e.g. a LoRA adapter's request, whose
    /// blocks replication's base-model warm-ups would not reproduce). Once per request — not
    /// again on a retry, nor on a re-route after waiting in the admission queue — whether or
    /// not it is ever sent.
    pub fn count_demand(
        &mut self,
        req: &RouteRequest,
        tokens: &[u32],
        decision: &Decision,
        now: f64,
        hot_prefix: bool,
    ) {
        let output = self.fleet.expected_output_tokens(req);
        let load = decision.uncached_tokens as f64 + output as f64;
        self.booked_tokens += load;
        self.own_demand_tokens += load;
        if let Some(sketch) = self.sketch.as_mut().filter(|_| hot_prefix) {
            sketch.observe(now, &req.hashes, Some(tokens), load);
        }
    }

    /// Adds a peer's gossiped demand to this node's: `demand_tokens` is the peer's own
    /// cumulative count for its `incarnation`, so only the increase since its last report
    /// counts (a lost batch loses nothing; a restarted peer starts over from 0). A peer's
    /// first report is only the base: it holds everything the peer counted before this node
    /// heard from it (before this node started, say), not demand arriving now.
    pub fn peer_demand(&mut self, peer: u64, incarnation: u64, demand_tokens: f64) {
        let base = if demand_tokens.is_finite() { demand_tokens.max(0.0) } else { 0.0 };
        let (inc, last) = self.peer_demand.entry(peer).or_insert((incarnation, base));
        if *inc != incarnation {
            *inc = incarnation;
            *last = 0.0;
        }
        if demand_tokens.is_finite() && demand_tokens > *last {
            self.booked_tokens += demand_tokens - *last;
            *last = demand_tokens;
        }
    }

    /// A booking's first token arrived.
    ///
    /// # Errors
    /// An unknown booking (released or expired).
    pub fn first_token(&mut self, booking: BookingId, now: f64) -> Result<(), kvmesh_core::Error> {
        self.fleet.first_token(booking, now)?;
        if let Some(out) = self.outbox.as_mut() {
            out.first_token(booking.0, now);
        }
        Ok(())
    }

    /// Ends a booking at `now`.
    ///
    /// # Errors
    /// An unknown booking (already released or expired): nothing changes.
    pub fn release(
        &mut self,
        booking: BookingId,
        output_tokens: Option<u32>,
        now: f64,
    ) -> Result<(), kvmesh_core::Error> {
        // Peers hear of the end even when the fleet no longer holds the booking (its replica
        // was removed, or its lease ran out first): a booking advertised must be ended.
        if let Some(out) = self.outbox.as_mut() {
            out.release(booking.0, output_tokens, now);
        }
        self.fleet.release(booking, output_tokens)
    }

    /// Housekeeping at `now`: bookings past their lease end (and are announced as ended),
    /// peers silent for `peer_timeout_s` lose theirs. Returns the expired local bookings.
    pub fn expire(&mut self, now: f64, peer_timeout_s: f64) -> usize {
        let expired = self.fleet.expire(now);
        if let Some(out) = self.outbox.as_mut() {
            for b in &expired {
                out.release(b.0, None, now);
            }
        }
        for peer in self.remote.expire(&mut self.fleet, now, peer_timeout_s) {
            tracing::warn!(%peer, "peer silent: its shared bookings were dropped");
        }
        expired.len()
    }
}
