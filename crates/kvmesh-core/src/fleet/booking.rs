//! Bookings through the fleet: booked, first token, released, expired, and peers' deciding.

use super::*;
use crate::error::Error;
use crate::ids::{BlockHash, ReplicaId};
use crate::load::{BookingId, BookingSpec, FleetEvent};

impl Fleet {
    /// Books load on `replica` directly, outside a decision (a booking learned from another
    /// router node, or a test setting up load).
    ///
    /// # Errors
    /// [`Error::UnknownReplica`].
    pub fn book(&mut self, replica: ReplicaId, spec: BookingSpec, now: f64) -> Result<BookingId, Error> {
        self.pos(replica).ok_or(Error::UnknownReplica(replica))?;
        Ok(self.bookings.book(replica, spec, now))
    }

    /// The request's first token arrived at `now`; its wait feeds the replica's learned
    /// prefill cost.
    ///
    /// # Errors
    /// [`Error::UnknownBooking`].
    pub fn first_token(&mut self, booking: BookingId, now: f64) -> Result<(), Error> {
        let Some(b) = self.bookings.first_token(booking, now)? else { return Ok(()) };
        if self.own.contains(&booking) {
            self.lifecycle.push(FleetEvent::FirstToken(booking));
        }
        if let Some(p) = self.pos(b.replica) {
            let r = &mut self.replicas[p];
            r.last_first_token_at = Some(r.last_first_token_at.map_or(now, |t| t.max(now)));
            let tokens = b.queued_ahead_tokens + b.spec.uncached_prefill_tokens as u64;
            r.prefill.observe(&r.spec.profile, tokens, now - b.booked_at, b.decoding_at_booking);
            let rate = r.profile(self.config.learn_prefill_rate).prefill_s_per_token;
            self.bookings.set_prefill_rate(b.replica, rate / self.config.prefill_efficiency);
        }
        Ok(())
    }

    /// How many other router nodes are routing to these replicas now, and this router's rank
    /// among them (see [`FleetView::active_peers`], [`FleetView::peer_rank`]); set from gossip
    /// before each decision.
    pub fn set_active_peers(&mut self, peers: u32, rank: u32) {
        self.active_peers = peers;
        self.peer_rank = rank.min(peers);
    }

    /// A shared booking's first token (one learned from another router node): its prefill
    /// leaves the queue, but its wait (measured on another node's clock) does not feed the
    /// learned prefill cost.
    ///
    /// # Errors
    /// [`Error::UnknownBooking`].
    pub fn first_token_shared(&mut self, booking: BookingId, now: f64) -> Result<(), Error> {
        self.bookings.first_token(booking, now).map(|_| ())
    }

    /// Records that `hashes` (a prompt's leading blocks) were routed to `replica` at `now`
    /// by someone else (another router node), for policies that count pending prefixes and
    /// for approximate-mode replicas. Unknown replicas are ignored.
    pub fn record_prefix(&mut self, replica: ReplicaId, hashes: &[BlockHash], now: f64) {
        if self.pos(replica).is_some() {
            self.record.record(replica, hashes, now);
        }
    }

    /// The request ended; `output_tokens` when it completed normally.
    ///
    /// # Errors
    /// [`Error::UnknownBooking`].
    pub fn release(&mut self, booking: BookingId, output_tokens: Option<u32>) -> Result<(), Error> {
        self.bookings.release(booking, output_tokens)?;
        if self.own.remove(&booking) {
            self.lifecycle.push(FleetEvent::Ended(booking));
        }
        Ok(())
    }

    /// Housekeeping at `now`: ends bookings past their lease (returned) and expires old
    /// routing-record entries. Call it every second or so.
    pub fn expire(&mut self, now: f64) -> Vec<BookingId> {
        self.record.expire(now);
        let gone = self.bookings.expire(now);
        for b in &gone {
            if self.own.remove(b) {
                self.lifecycle.push(FleetEvent::Ended(*b));
            }
        }
        gone
    }
}
