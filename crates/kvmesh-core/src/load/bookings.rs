//! Bookings: each routed request's token load on its replica, from the routing decision until
//! release — or until its lease runs out, so a lost release cannot leak load forever.
//!
//! Lifecycle: [`Bookings::book`] at routing → [`Bookings::first_token`] (prefill done: its
//! uncached tokens leave the prefill queue, it starts decoding, its lease is renewed) →
//! [`Bookings::release`] on completion, error or disconnect. [`Bookings::expire`] ends
//! bookings whose lease ran out.

use super::{OutputEstimator, TokenLoad};
use crate::error::Error;
use crate::ids::ReplicaId;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::fmt;

/// The id of one booking, unique within one [`Bookings`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BookingId(pub u64);

impl fmt::Display for BookingId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "booking#{}", self.0)
    }
}

/// What happened to a booking after its decision, or to a replica, as policies that keep
/// their own record of routed requests are told ([`crate::policy::Policy::observe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetEvent {
    /// The request's first token arrived: its prefill is done.
    FirstToken(BookingId),
    /// The booking ended: completed, failed, released or expired.
    Ended(BookingId),
    /// The replica was removed from the fleet (its bookings' ends come first): forget it.
    ReplicaRemoved(ReplicaId),
}

/// What a routing decision books on the chosen replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BookingSpec {
    /// Prompt tokens the replica must compute (not cached there), tokens.
    pub uncached_prefill_tokens: u32,
    /// KV blocks the prompt adds on the replica: its uncached blocks (the cached prefix is
    /// shared and already held), partial last block included, in blocks of `block_size` tokens.
    pub uncached_blocks: u32,
    /// Expected output tokens (see [`OutputEstimator`]), tokens.
    pub expected_output_tokens: u32,
    /// Whether its first token will be reported when it comes (a streamed answer): only
    /// then is its prefill known unstarted while it waits (see
    /// [`crate::load::TokenLoad::queued_prefill_at`]).
    pub reports_first_token: bool,
    /// The request's output key ([`crate::load::output_key`]): its output, when it
    /// finishes, is learned under it (on every node: gossip carries it). `None` for a prompt
    /// without a full block.
    pub output_key: Option<u64>,
    /// When its expected output came from learned lengths (no hint): re-estimated as it
    /// decodes ([`Bookings::refresh_outputs`]), at most this many tokens (its `max_tokens`).
    /// `None`: fixed at booking.
    pub reestimate_up_to: Option<u32>,
}

/// One live booking.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Booking {
    /// The replica the request was routed to.
    pub replica: ReplicaId,
    /// What was booked.
    pub spec: BookingSpec,
    /// KV blocks held: uncached prompt blocks plus expected output blocks.
    pub kv_blocks: u32,
    /// Prefill tokens queued ahead of it on the replica when booked, tokens.
    pub queued_ahead_tokens: u64,
    /// Sequences decoding on the replica when booked.
    pub decoding_at_booking: u32,
    /// Decision time, seconds.
    pub booked_at: f64,
    /// First-token time, seconds, once seen.
    pub first_token_at: Option<f64>,
    /// The booking ends by itself at this time, seconds.
    pub lease_until: f64,
    /// Its expected output when booked, tokens (`spec.expected_output_tokens` may be
    /// re-estimated since): what the routing decision assumed.
    pub expected_at_booking: u32,
}

/// One replica's bookings before their first token, in booking order, and their tokens.
#[derive(Debug, Default)]
struct PrefillOrder {
    queue: VecDeque<(BookingId, u32)>,
    tokens: u64,
}

impl PrefillOrder {
    /// The tokens of every booking but the oldest: the prefill the engine cannot have started
    /// yet (it prefills first come, first served).
    fn unstarted(&self) -> u64 {
        self.tokens - self.queue.front().map_or(0, |x| u64::from(x.1))
    }
}

/// All live bookings of one router, and the per-replica [`TokenLoad`] they add up to.
#[derive(Debug)]
pub struct Bookings {
    live: FxHashMap<BookingId, Booking>,
    loads: Vec<TokenLoad>,
    /// Seconds per prefill token, per replica, for the virtual drain clock.
    prefill_s_per_token: Vec<f64>,
    /// Per replica, the bookings before their first token in booking order, with their
    /// uncached tokens.
    prefill_order: Vec<PrefillOrder>,
    next: u64,
    lease_s: f64,
    block_size: u32,
    /// Per replica index, its block size when it differs from `block_size` (0: the same).
    block_sizes: Vec<u32>,
    outputs: OutputEstimator,
}

impl Bookings {
    /// An empty ledger whose leases last `lease_s` seconds (from booking, renewed at first
    /// token), for blocks of `block_size` tokens.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a non-positive lease, [`Error::ZeroBlockSize`].
    pub fn new(lease_s: f64, block_size: u32) -> Result<Self, Error> {
        if !(lease_s.is_finite() && lease_s > 0.0) {
            return Err(Error::InvalidConfig {
                field: "lease_s",
                reason: format!("must be positive seconds, got {lease_s}"),
            });
        }
        if block_size == 0 {
            return Err(Error::ZeroBlockSize);
        }
        Ok(Bookings {
            live: FxHashMap::default(),
            loads: Vec::new(),
            prefill_s_per_token: Vec::new(),
            prefill_order: Vec::new(),
            next: 0,
            lease_s,
            block_size,
            block_sizes: Vec::new(),
            outputs: OutputEstimator::default(),
        })
    }

    /// The running output-length estimator fed by releases.
    pub fn outputs(&self) -> &OutputEstimator {
        &self.outputs
    }

    /// The booked load of `replica` (zero for a replica with no bookings).
    pub fn load(&self, replica: ReplicaId) -> TokenLoad {
        self.loads.get(replica.index()).copied().unwrap_or_default()
    }

    /// The booked loads, indexed by replica id.
    pub fn loads(&self) -> &[TokenLoad] {
        &self.loads
    }

    /// Prefill still queued at `now` on all replicas together, tokens: each replica's
    /// [`TokenLoad::queued_prefill_at`] at its prefill rate (not the whole booked prompt of
    /// every request before its first token, which a non-streamed answer reports only at its
    /// end).
    pub fn queued_prefill_at(&self, now: f64) -> u64 {
        self.loads.iter().enumerate().map(|(i, l)| l.queued_prefill_at(now, self.rate_at(i))).sum()
    }

    /// Live bookings.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no booking is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// A live booking.
    pub fn get(&self, id: BookingId) -> Option<&Booking> {
        self.live.get(&id)
    }

    /// Sets the prefill speed used to drain `replica`'s queued prefill over time, seconds per
    /// token (default: the H100 profile's 17.25 µs). [`crate::Fleet`] passes the profile's β1
    /// divided by [`crate::FleetConfig::prefill_efficiency`]: the rate sustained under a queue.
    pub fn set_prefill_rate(&mut self, replica: ReplicaId, s_per_token: f64) {
        let i = replica.index();
        if self.prefill_s_per_token.len() <= i {
            self.prefill_s_per_token.resize(i + 1, super::ReplicaProfile::H100_LLAMA3_8B.prefill_s_per_token);
        }
        if s_per_token.is_finite() && s_per_token > 0.0 {
            self.prefill_s_per_token[i] = s_per_token;
        }
    }

    /// Counts `replica`'s KV in blocks of `block_size` tokens (a replica of a model with
    /// another block size than the fleet's).
    pub fn set_block_size(&mut self, replica: ReplicaId, block_size: u32) {
        let i = replica.index();
        if self.block_sizes.len() <= i {
            self.block_sizes.resize(i + 1, 0);
        }
        self.block_sizes[i] = if block_size == self.block_size { 0 } else { block_size };
    }

    /// The block size the replica at `index` counts its KV in, tokens.
    fn block_size_of(&self, index: usize) -> u32 {
        self.block_sizes.get(index).copied().filter(|&b| b > 0).unwrap_or(self.block_size)
    }

    /// The prefill speed of `replica`, seconds per token.
    pub fn prefill_rate(&self, replica: ReplicaId) -> f64 {
        self.rate_at(replica.index())
    }

    /// The prefill speed of the replica at `index`, seconds per token (the H100 profile's
    /// until set).
    fn rate_at(&self, index: usize) -> f64 {
        self.prefill_s_per_token
            .get(index)
            .copied()
            .unwrap_or(super::ReplicaProfile::H100_LLAMA3_8B.prefill_s_per_token)
    }

    /// Books `spec` on `replica` at `now` (seconds).
    pub fn book(&mut self, replica: ReplicaId, spec: BookingSpec, now: f64) -> BookingId {
        let id = BookingId(self.next);
        self.next += 1;
        let i = replica.index();
        let kv_blocks =
            spec.uncached_blocks.saturating_add(spec.expected_output_tokens.div_ceil(self.block_size_of(i)));
        if self.loads.len() <= i {
            self.loads.resize(i + 1, TokenLoad::default());
        }
        let s_per_token = self.prefill_rate(replica);
        let l = &mut self.loads[i];
        let b = Booking {
            replica,
            spec,
            kv_blocks,
            queued_ahead_tokens: l.queued_prefill_at(now, s_per_token),
            decoding_at_booking: l.decoding,
            booked_at: now,
            first_token_at: None,
            lease_until: now + self.lease_s,
            expected_at_booking: spec.expected_output_tokens,
        };
        let s_per_token = self
            .prefill_s_per_token
            .get(i)
            .copied()
            .unwrap_or(super::ReplicaProfile::H100_LLAMA3_8B.prefill_s_per_token);
        l.prefill_busy_until = l.prefill_busy_until.max(now) + spec.uncached_prefill_tokens as f64 * s_per_token;
        l.prefilling += 1;
        l.queued_prefill_tokens += spec.uncached_prefill_tokens as u64;
        l.expected_decode_tokens += spec.expected_output_tokens as u64;
        l.kv_blocks += kv_blocks as u64;
        l.prompt_blocks += spec.uncached_blocks as u64;
        if self.prefill_order.len() <= i {
            self.prefill_order.resize_with(i + 1, PrefillOrder::default);
        }
        if spec.reports_first_token {
            let order = &mut self.prefill_order[i];
            order.queue.push_back((id, spec.uncached_prefill_tokens));
            order.tokens += u64::from(spec.uncached_prefill_tokens);
            l.unstarted_tokens = order.unstarted();
        }
        self.live.insert(id, b);
        id
    }

    /// Re-estimates the expected output of every decoding booking whose
    /// [`BookingSpec::reestimate_up_to`] is set, from what it has generated by `now`: its
    /// time since first token over its replica's decode step (`step_s(replica index)`,
    /// seconds), the length distribution's E[L | L > generated]
    /// ([`OutputEstimator::expect_given`]). Survivors of heavy-tailed lengths are expected
    /// longer, and their KV booked accordingly. O(live bookings).
    pub fn refresh_outputs(&mut self, now: f64, step_s: impl Fn(usize) -> f64) {
        let (fleet_bs, sizes) = (self.block_size, &self.block_sizes);
        let bs_of = |i: usize| sizes.get(i).copied().filter(|&b| b > 0).unwrap_or(fleet_bs);
        for b in self.live.values_mut() {
            let (Some(cap), Some(ft)) = (b.spec.reestimate_up_to, b.first_token_at) else { continue };
            let i = b.replica.index();
            let step = step_s(i);
            if !(step.is_finite() && step > 0.0) {
                continue;
            }
            let generated = ((now - ft).max(0.0) / step).min(f64::from(u32::MAX)) as u32;
            let Some(e) = self.outputs.expect_given(b.spec.output_key, generated, cap) else { continue };
            let old = b.spec.expected_output_tokens;
            if e == old {
                continue;
            }
            let kv = b.spec.uncached_blocks.saturating_add(e.div_ceil(bs_of(i)));
            let l = &mut self.loads[i];
            l.expected_decode_tokens = l.expected_decode_tokens - u64::from(old) + u64::from(e);
            l.kv_blocks = l.kv_blocks - u64::from(b.kv_blocks) + u64::from(kv);
            b.spec.expected_output_tokens = e;
            b.kv_blocks = kv;
        }
    }

    /// `id` (on replica index `i`) is no longer before its first token.
    fn prefill_done(&mut self, i: usize, id: BookingId) {
        let Some(order) = self.prefill_order.get_mut(i) else { return };
        // Usually the oldest: first tokens come in booking order.
        if let Some(k) = order.queue.iter().position(|x| x.0 == id) {
            if let Some((_, t)) = order.queue.remove(k) {
                order.tokens -= u64::from(t);
            }
        }
        self.loads[i].unstarted_tokens = order.unstarted();
    }

    /// The request's first token arrived at `now`: its prefill leaves the queue and it counts
    /// as decoding; the lease is renewed. Returns the booking as it was before, on the first
    /// call only (a second call is a no-op returning `None`).
    ///
    /// # Errors
    /// [`Error::UnknownBooking`] when the booking is not live.
    pub fn first_token(&mut self, id: BookingId, now: f64) -> Result<Option<Booking>, Error> {
        let b = self.live.get_mut(&id).ok_or(Error::UnknownBooking(id.0))?;
        if b.first_token_at.is_some() {
            return Ok(None);
        }
        let before = *b;
        b.first_token_at = Some(now);
        b.lease_until = now + self.lease_s;
        let (i, replica) = (b.replica.index(), b.replica);
        let l = &mut self.loads[i];
        l.prefilling -= 1;
        l.decoding += 1;
        l.queued_prefill_tokens -= b.spec.uncached_prefill_tokens as u64;
        if l.prefilling == 0 {
            l.prefill_busy_until = 0.0;
        }
        let _ = replica;
        self.prefill_done(i, id);
        Ok(Some(before))
    }

    /// Ends a booking (completion, error, disconnect). `output_tokens`, when the request
    /// finished normally, feeds the output-length estimate.
    ///
    /// # Errors
    /// [`Error::UnknownBooking`] when the booking is not live (released twice, or expired).
    pub fn release(&mut self, id: BookingId, output_tokens: Option<u32>) -> Result<Booking, Error> {
        let b = self.live.remove(&id).ok_or(Error::UnknownBooking(id.0))?;
        self.unload(&b);
        if b.first_token_at.is_none() {
            self.prefill_done(b.replica.index(), id);
        }
        if let Some(n) = output_tokens {
            self.outputs.observe_keyed(b.spec.output_key, n);
        }
        Ok(b)
    }

    /// Ends every booking whose lease ran out by `now`; returns their ids, sorted.
    pub fn expire(&mut self, now: f64) -> Vec<BookingId> {
        let mut gone: Vec<BookingId> =
            self.live.iter().filter(|(_, b)| b.lease_until <= now).map(|(id, _)| *id).collect();
        gone.sort_unstable();
        for id in &gone {
            if let Some(b) = self.live.remove(id) {
                self.unload(&b);
                if b.first_token_at.is_none() {
                    self.prefill_done(b.replica.index(), *id);
                }
            }
        }
        gone
    }

    /// Ends every booking on `replica` (it was removed); returns how many.
    pub fn drop_replica(&mut self, replica: ReplicaId) -> usize {
        let before = self.live.len();
        self.live.retain(|_, b| b.replica != replica);
        if let Some(l) = self.loads.get_mut(replica.index()) {
            *l = TokenLoad::default();
        }
        if let Some(order) = self.prefill_order.get_mut(replica.index()) {
            *order = PrefillOrder::default();
        }
        before - self.live.len()
    }

    fn unload(&mut self, b: &Booking) {
        let l = &mut self.loads[b.replica.index()];
        if b.first_token_at.is_none() {
            l.prefilling -= 1;
            l.queued_prefill_tokens -= b.spec.uncached_prefill_tokens as u64;
            if l.prefilling == 0 {
                l.prefill_busy_until = 0.0;
            }
        } else {
            l.decoding -= 1;
        }
        l.expected_decode_tokens -= b.spec.expected_output_tokens as u64;
        l.kv_blocks -= b.kv_blocks as u64;
        l.prompt_blocks -= b.spec.uncached_blocks as u64;
    }
}

#[cfg(test)]
mod tests;
