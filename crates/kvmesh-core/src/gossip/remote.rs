//! Peers' live bookings, merged into this node's [`Fleet`].

use super::{Delta, DeltaKind, NodeId, Summary};
use crate::fleet::Fleet;
use crate::load::{BookingId, BookingSpec};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// What one merge did, for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MergeStats {
    /// Bookings added to the fleet.
    pub booked: u32,
    /// Bookings whose first token was applied.
    pub first_tokens: u32,
    /// Bookings released.
    pub released: u32,
    /// Deltas already applied (duplicates) or about bookings already ended (late).
    pub ignored: u32,
    /// Deltas naming a replica this node does not know (its registry lags, or the peer's).
    pub unknown_replica: u32,
}

#[derive(Debug, Default)]
struct Peer {
    /// Peer booking id → (local booking, the sequence number of its Book, first token seen).
    live: FxHashMap<u64, (BookingId, u64, bool)>,
    /// Peer booking ids that ended, and when to forget them (node seconds): a Book that
    /// arrives after its Release must not bring it back.
    ended: FxHashMap<u64, f64>,
    last_heard: f64,
    /// The highest summary sequence applied: a delta at or below it is already reflected
    /// (a Book delayed past a summary that no longer lists it must not bring it back).
    summary_seq: u64,
    incarnation: u64,
    /// When it last routed a request (its last Book delta arrived), node seconds.
    last_book_at: f64,
}

/// This node's view of its peers' live bookings.
///
/// Deltas are idempotent (a duplicate Book, FirstToken or Release changes nothing), a
/// Release that overtakes its Book leaves a tombstone, and a delta older than the last
/// summary is ignored (the summary already reflects it), so loss, reordering and duplicates
/// cannot leak load; a [`Summary`] repairs what was lost. A peer silent for longer than
/// the timeout given to [`RemoteBookings::expire`] has its bookings dropped.
#[derive(Debug)]
pub struct RemoteBookings {
    peers: BTreeMap<NodeId, Peer>,
    tombstone_s: f64,
    /// When each peer was last heard, node seconds, kept after its bookings are dropped (a
    /// silent peer's gossip age goes on growing, so a lag alert can fire).
    heard: BTreeMap<NodeId, f64>,
}

impl RemoteBookings {
    /// An empty view; ended bookings are remembered for `tombstone_s` seconds (use the
    /// booking lease: no delta about a booking outlives it).
    pub fn new(tombstone_s: f64) -> Self {
        RemoteBookings { peers: BTreeMap::new(), tombstone_s, heard: BTreeMap::new() }
    }

    /// Applies `peer`'s deltas received at `now` (seconds). A Book counts from its decision
    /// ([`Delta::at`], at most `now`): its prefill drains, and its prefix credit fades, from
    /// then; so does a first token.
    pub fn apply(&mut self, fleet: &mut Fleet, peer: NodeId, deltas: &[Delta], now: f64) -> MergeStats {
        let tombstone_s = self.tombstone_s;
        let p = self.peers.entry(peer).or_default();
        p.last_heard = now;
        self.heard.insert(peer, now);
        let mut stats = MergeStats::default();
        for d in deltas {
            if d.seq <= p.summary_seq {
                stats.ignored += 1;
                continue;
            }
            match &d.kind {
                DeltaKind::Book { replica, spec, prefix } => {
                    if p.live.contains_key(&d.booking) || p.ended.contains_key(&d.booking) {
                        stats.ignored += 1;
                        continue;
                    }
                    let Some(id) = fleet.replica_by_name(replica).map(|r| r.id) else {
                        stats.unknown_replica += 1;
                        continue;
                    };
                    let at = d.at.min(now);
                    if let Ok(local) = fleet.book(id, remote_spec(*spec), at) {
                        // Above 0, which means "never booked" (a decision from before this
                        // node started is timed below 0).
                        p.last_book_at = p.last_book_at.max(at.max(f64::MIN_POSITIVE));
                        if !prefix.is_empty() {
                            fleet.record_prefix(id, prefix, at);
                        }
                        p.live.insert(d.booking, (local, d.seq, false));
                        stats.booked += 1;
                    }
                }
                DeltaKind::FirstToken => match p.live.get_mut(&d.booking) {
                    Some((local, _, seen)) if !*seen => {
                        *seen = true;
                        let _ = fleet.first_token_shared(*local, d.at.min(now));
                        stats.first_tokens += 1;
                    }
                    _ => stats.ignored += 1,
                },
                DeltaKind::Release { output_tokens } => {
                    p.ended.insert(d.booking, now + tombstone_s);
                    match p.live.remove(&d.booking) {
                        Some((local, _, _)) => {
                            let _ = fleet.release(local, *output_tokens);
                            stats.released += 1;
                        }
                        None => stats.ignored += 1,
                    }
                }
            }
        }
        stats
    }

    /// Makes `peer`'s bookings equal to its summary: bookings it no longer lists (and booked
    /// at or before the summary's sequence) are released, listed ones this node missed are
    /// booked (without their prefix, which only deltas carry).
    pub fn apply_summary(&mut self, fleet: &mut Fleet, peer: NodeId, summary: &Summary, now: f64) -> MergeStats {
        let tombstone_s = self.tombstone_s;
        let p = self.peers.entry(peer).or_default();
        p.last_heard = now;
        self.heard.insert(peer, now);
        let mut stats = MergeStats::default();
        p.summary_seq = p.summary_seq.max(summary.seq);
        let listed: rustc_hash::FxHashSet<u64> = summary.live.iter().map(|e| e.booking).collect();
        let gone: Vec<u64> = p
            .live
            .iter()
            .filter(|(b, (_, seq, _))| *seq <= summary.seq && !listed.contains(b))
            .map(|(b, _)| *b)
            .collect();
        for b in gone {
            if let Some((local, _, _)) = p.live.remove(&b) {
                let _ = fleet.release(local, None);
                p.ended.insert(b, now + tombstone_s);
                stats.released += 1;
            }
        }
        for e in &summary.live {
            if let Some((local, _, seen)) = p.live.get_mut(&e.booking) {
                if e.first_token && !*seen {
                    *seen = true;
                    let _ = fleet.first_token_shared(*local, now);
                    stats.first_tokens += 1;
                }
                continue;
            }
            if p.ended.contains_key(&e.booking) {
                stats.ignored += 1;
                continue;
            }
            let Some(id) = fleet.replica_by_name(&e.replica).map(|r| r.id) else {
                stats.unknown_replica += 1;
                continue;
            };
            if let Ok(local) = fleet.book(id, remote_spec(e.spec), e.booked_at.min(now)) {
                if e.first_token {
                    let _ = fleet.first_token_shared(local, now);
                }
                p.live.insert(e.booking, (local, summary.seq, e.first_token));
                stats.booked += 1;
            }
        }
        stats
    }

    /// Housekeeping at `now`: drops every booking of peers silent for more than
    /// `peer_timeout_s` seconds (returned), forgets old tombstones, and forgets bookings the
    /// fleet already ended by lease.
    pub fn expire(&mut self, fleet: &mut Fleet, now: f64, peer_timeout_s: f64) -> Vec<NodeId> {
        let silent: Vec<NodeId> =
            self.peers.iter().filter(|(_, p)| now - p.last_heard > peer_timeout_s).map(|(n, _)| *n).collect();
        for n in &silent {
            self.drop_peer(fleet, *n);
        }
        for p in self.peers.values_mut() {
            p.ended.retain(|_, until| *until > now);
            p.live.retain(|_, (local, _, _)| fleet.bookings().get(*local).is_some());
        }
        silent
    }

    /// Notes the incarnation (a per-process random id) `peer`'s messages carry. A peer that
    /// restarted numbers its deltas from 1 again and has none of its old bookings: its old
    /// bookings are released and its sequence forgotten. Returns whether it restarted.
    pub fn observe_incarnation(&mut self, fleet: &mut Fleet, peer: NodeId, incarnation: u64) -> bool {
        match self.peers.get(&peer) {
            Some(p) if p.incarnation == incarnation => false,
            Some(_) => {
                self.drop_peer(fleet, peer);
                self.peers.entry(peer).or_default().incarnation = incarnation;
                true
            }
            None => {
                self.peers.entry(peer).or_default().incarnation = incarnation;
                false
            }
        }
    }

    /// Releases every booking of `peer` (it left the cluster or went silent); returns how
    /// many.
    pub fn drop_peer(&mut self, fleet: &mut Fleet, peer: NodeId) -> usize {
        let Some(p) = self.peers.remove(&peer) else { return 0 };
        for (local, _, _) in p.live.values() {
            let _ = fleet.release(*local, None);
        }
        p.live.len()
    }

    /// Peers that routed a request within the last `window_s` seconds (the routers that may be
    /// deciding at the same time as this one), and `me`'s rank among them and itself by node
    /// id: the arguments of [`Fleet::set_active_peers`].
    pub fn active_peers(&self, me: NodeId, now: f64, window_s: f64) -> (u32, u32) {
        let mut active = 0;
        let mut below = 0;
        for (id, p) in &self.peers {
            if p.last_book_at > 0.0 && now - p.last_book_at <= window_s {
                active += 1;
                if *id < me {
                    below += 1;
                }
            }
        }
        (active, below)
    }

    /// `peer`'s live bookings as this node holds them.
    pub fn live(&self, peer: NodeId) -> usize {
        self.peers.get(&peer).map_or(0, |p| p.live.len())
    }

    /// When `peer` was last heard, node seconds, even after its bookings were dropped for its
    /// silence; `None` if never.
    pub fn last_heard(&self, peer: NodeId) -> Option<f64> {
        self.heard.get(&peer).copied()
    }

    /// Peers heard from, with their live bookings and the node time they were last heard.
    pub fn peers(&self) -> impl Iterator<Item = (NodeId, usize, f64)> + '_ {
        self.peers.iter().map(|(n, p)| (*n, p.live.len(), p.last_heard))
    }
}

/// A peer's booking as this node books it: its first token reaches this node a gossip hop
/// late (or, for a non-streamed answer, only at its end), so its prefill is drained on the
/// clock rather than held until then.
fn remote_spec(spec: BookingSpec) -> BookingSpec {
    BookingSpec { reports_first_token: false, ..spec }
}
