//! Dynamo's active-sequence tracking (dynamo `lib/kv-router/src/sequences/`, crate
//! `dynamo-kv-router` 1.6.1): what the KV router counts as each worker's load, from the
//! requests it routed itself.
//!
//! Per worker:
//! - **active prefill tokens**: the sum of each routed request's uncached prompt tokens
//!   (`isl − cached` on the worker it went to) until its first token
//!   (`mark_prefill_completed`);
//! - **active blocks**: the distinct full prompt blocks of every live request there, shared
//!   prefixes counted once (blocks are reference-counted by their chained hash), cached blocks
//!   included, until the request ends (`free`). Output blocks are not counted
//!   (`router_track_output_blocks` is off by default).

use crate::ids::{BlockHash, ReplicaId};
use crate::load::{BookingId, FleetEvent};
use crate::policy::tenant_tree::leading_run;
use rustc_hash::FxHashMap;

#[derive(Debug, Default)]
struct Worker {
    blocks: FxHashMap<BlockHash, u32>,
    active_prefill_tokens: u64,
}

#[derive(Debug)]
struct Live {
    worker: ReplicaId,
    hashes: Vec<BlockHash>,
    prefill_tokens: u64,
    prefilling: bool,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct ActiveSequences {
    workers: Vec<Worker>,
    live: FxHashMap<BookingId, Live>,
}

impl ActiveSequences {
    /// `worker`'s active prefill tokens.
    pub(crate) fn active_prefill_tokens(&self, worker: ReplicaId) -> u64 {
        self.workers.get(worker.index()).map_or(0, |w| w.active_prefill_tokens)
    }

    /// `worker`'s active blocks.
    pub(crate) fn active_blocks(&self, worker: ReplicaId) -> u64 {
        self.workers.get(worker.index()).map_or(0, |w| w.blocks.len() as u64)
    }

    /// How many leading blocks of `hashes` are already active on `worker` (Dynamo's match
    /// against its trie of active prompts). Active prompts are prefix-closed, so a binary
    /// search finds it.
    pub(crate) fn active_run(&self, worker: ReplicaId, hashes: &[BlockHash]) -> usize {
        match self.workers.get(worker.index()) {
            Some(w) if !w.blocks.is_empty() => leading_run(hashes.len(), |k| w.blocks.contains_key(&hashes[k])),
            _ => 0,
        }
    }

    /// A request of full blocks `hashes` and `prefill_tokens` uncached prompt tokens was sent to
    /// `worker` as `booking`.
    pub(crate) fn add(&mut self, booking: BookingId, worker: ReplicaId, hashes: &[BlockHash], prefill_tokens: u64) {
        let i = worker.index();
        if self.workers.len() <= i {
            self.workers.resize_with(i + 1, Worker::default);
        }
        let w = &mut self.workers[i];
        for &h in hashes {
            *w.blocks.entry(h).or_default() += 1;
        }
        w.active_prefill_tokens += prefill_tokens;
        let live = Live { worker, hashes: hashes.to_vec(), prefill_tokens, prefilling: true };
        self.live.insert(booking, live);
    }

    /// Applies first tokens and ends; unknown bookings are ignored.
    pub(crate) fn observe(&mut self, events: &[FleetEvent]) {
        for ev in events {
            match *ev {
                FleetEvent::FirstToken(b) => {
                    if let Some(l) = self.live.get_mut(&b) {
                        if l.prefilling {
                            l.prefilling = false;
                            self.workers[l.worker.index()].active_prefill_tokens -= l.prefill_tokens;
                        }
                    }
                }
                FleetEvent::Ended(b) => {
                    let Some(l) = self.live.remove(&b) else { continue };
                    let w = &mut self.workers[l.worker.index()];
                    if l.prefilling {
                        w.active_prefill_tokens -= l.prefill_tokens;
                    }
                    for h in &l.hashes {
                        if let Some(c) = w.blocks.get_mut(h) {
                            *c -= 1;
                            if *c == 0 {
                                w.blocks.remove(h);
                            }
                        }
                    }
                }
                FleetEvent::ReplicaRemoved(r) => {
                    self.live.retain(|_, l| l.worker != r);
                    if let Some(w) = self.workers.get_mut(r.index()) {
                        *w = Worker::default();
                    }
                }
            }
        }
    }
}
