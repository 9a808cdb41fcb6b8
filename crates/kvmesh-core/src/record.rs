//! The routing record: where this router itself sent each prefix, as speculative blocks with a
//! time-to-live.
//!
//! Two users:
//! - **approximate mode** for replicas that publish no KV events (or whose publisher is silent,
//!   case C09): the record stands in for the prefix index, as in llm-d's approximate prefix
//!   scorer;
//! - `token_load`'s pending prefixes: routed here, not yet confirmed by the replica's events.
//!
//! (The peer policies that match on their router's own record keep their own, as their
//! projects do: see [`crate::policy`].)
//!
//! An entry lives `ttl` seconds from the *decision* time passed to [`RoutingRecord::record`],
//! not from when it was stored, so a late-delivered record is not younger than the decision.
//! Memory is bounded by `max_entries` (oldest dropped first) as well as by the TTL.
//!
//! Only every [`STRIDE`]-th block of a routed prompt and its last block are recorded: a
//! block hash stands for its whole prefix, so those are enough to find where a later prompt
//! leaves a recorded one when it leaves at a stride block or at the recorded prompt's end (a
//! continuation); a prompt that leaves one mid-stride matches to the stride block before
//! (at most `STRIDE − 1` blocks short). Recording costs an eighth of the lookups, and
//! queries walk the stride blocks.

use crate::ids::{BlockHash, ReplicaId};
use crate::overlap::{Holding, Overlap};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::collections::VecDeque;

/// Blocks between recorded blocks of one prompt by default (see the module docs).
pub const STRIDE: usize = 8;

#[derive(Debug, Clone, Copy)]
struct Sent {
    replica: ReplicaId,
    /// Decision time, seconds.
    at: f64,
}

impl Holding for Sent {
    #[inline]
    fn replica(&self) -> ReplicaId {
        self.replica
    }
}

/// Speculative (block, replica) entries from this router's own decisions.
#[derive(Debug)]
pub struct RoutingRecord {
    ttl: f64,
    max_entries: usize,
    /// Most blocks were sent to one replica: one entry inline, no allocation per block.
    blocks: FxHashMap<BlockHash, SmallVec<[Sent; 1]>>,
    /// Insertion order, for expiry; an item is stale if the block's entry was refreshed later.
    order: VecDeque<(f64, BlockHash, ReplicaId)>,
    per_replica: Vec<u64>,
    entries: usize,
    stride: usize,
}

impl RoutingRecord {
    /// A record whose entries live `ttl` seconds, holding at most `max_entries` (block, replica)
    /// entries.
    pub fn new(ttl: f64, max_entries: usize) -> Self {
        Self::with_stride(ttl, max_entries, STRIDE)
    }

    /// [`Self::new`], recording every `stride`-th block of a prompt and its last (1: every
    /// block, exact runs always).
    pub fn with_stride(ttl: f64, max_entries: usize, stride: usize) -> Self {
        RoutingRecord {
            stride: stride.max(1),
            ttl,
            max_entries,
            blocks: FxHashMap::default(),
            order: VecDeque::new(),
            per_replica: Vec::new(),
            entries: 0,
        }
    }

    /// The entries' time-to-live, seconds.
    pub fn ttl(&self) -> f64 {
        self.ttl
    }

    /// Records that a request whose blocks are `hashes` was routed to `replica` at `at`
    /// (seconds), refreshing entries already there.
    pub fn record(&mut self, replica: ReplicaId, hashes: &[BlockHash], at: f64) {
        let n = hashes.len();
        let stride = self.stride;
        let kept = hashes.iter().enumerate().filter(|(i, _)| (i + 1) % stride == 0 || i + 1 == n).map(|(_, h)| h);
        for &h in kept {
            let list = self.blocks.entry(h).or_default();
            match list.binary_search_by_key(&replica, |s| s.replica) {
                Ok(i) => list[i].at = list[i].at.max(at),
                Err(i) => {
                    list.insert(i, Sent { replica, at });
                    self.entries += 1;
                    let i = replica.index();
                    if self.per_replica.len() <= i {
                        self.per_replica.resize(i + 1, 0);
                    }
                    self.per_replica[i] += 1;
                }
            }
            self.order.push_back((at, h, replica));
        }
        while self.entries > self.max_entries {
            let Some((t, h, r)) = self.order.pop_front() else { break };
            self.drop_if(h, r, |at| at <= t);
        }
        // Refreshes leave stale items in `order`; drop them once they outnumber live entries,
        // so memory stays proportional to the entries (amortised O(1) per record).
        if self.order.len() > 2 * self.entries.max(1024) {
            let blocks = &self.blocks;
            self.order.retain(|(t, h, r)| {
                blocks.get(h).and_then(|l| l.iter().find(|s| s.replica == *r)).is_some_and(|s| s.at == *t)
            });
        }
    }

    /// Items in the expiry queue (live entries plus not yet compacted refreshes).
    pub fn queued(&self) -> usize {
        self.order.len()
    }

    /// Drops entries whose decision time is more than `ttl` before `now` (seconds). Amortised
    /// O(1) per recorded block.
    pub fn expire(&mut self, now: f64) {
        while let Some(&(t, h, r)) = self.order.front() {
            if t + self.ttl > now {
                break;
            }
            self.order.pop_front();
            let ttl = self.ttl;
            self.drop_if(h, r, |at| at + ttl <= now);
        }
    }

    /// Forgets everything recorded for `replica` (removed, or its real events now supersede
    /// the record).
    pub fn forget_replica(&mut self, replica: ReplicaId) {
        if self.per_replica.get(replica.index()).copied().unwrap_or(0) == 0 {
            return;
        }
        let mut dropped = 0;
        self.blocks.retain(|_, list| {
            if let Ok(i) = list.binary_search_by_key(&replica, |s| s.replica) {
                list.remove(i);
                dropped += 1;
            }
            !list.is_empty()
        });
        self.entries -= dropped;
        self.per_replica[replica.index()] = 0;
        self.order.retain(|(_, _, r)| *r != replica);
    }

    /// Each replica's longest leading run of `hashes` recorded and not expired at `now`,
    /// appended to `out` sorted by replica id (in the `gpu` field).
    pub fn overlaps(&self, hashes: &[BlockHash], now: f64, out: &mut Vec<(ReplicaId, Overlap)>) {
        // `expire` drops old entries lazily, so an entry past its TTL must not count here.
        self.overlaps_within(hashes, now, f64::INFINITY, |_| f64::INFINITY, out);
    }

    /// Like [`Self::overlaps`], counting only entries recorded less than `window(replica)`
    /// seconds before `now` (and within the TTL): prefixes routed recently enough that the
    /// replica's KV events may not have confirmed them yet. `out` is sorted by replica.
    /// `floor` is at most every replica's window, seconds: an entry younger than it counts
    /// without asking `window` (a hot prefix lists every replica it was routed to; asking
    /// each one's window, a queue estimate, was most of a 1,024-replica fleet's query).
    ///
    /// Cost: one visit per (recorded block of the prompt, replica) entry, O(1) each (dense
    /// per-replica scratch instead of sorted sets): a hot prefix routed to all of a large
    /// fleet lists every replica under each of its stride blocks.
    pub fn overlaps_within(
        &self,
        hashes: &[BlockHash],
        now: f64,
        floor: f64,
        window: impl Fn(ReplicaId) -> f64,
        out: &mut Vec<(ReplicaId, Overlap)>,
    ) {
        let n = hashes.len();
        let ttl = self.ttl;
        // (A floor that is not a positive number proves nothing: every entry asks.)
        let sure = if floor > 0.0 { floor.min(ttl) } else { f64::NEG_INFINITY };
        let live = |s: &Sent| s.at + sure > now || s.at + window(s.replica).min(ttl) > now;
        let holders = |i: usize| self.blocks.get(&hashes[i]).map_or(&[][..], |l| l.as_slice());
        // Every recorded replica has an index below `per_replica.len()`.
        let m = self.per_replica.len();
        // Each replica's run so far, blocks; and the last stride window it held the stride
        // block of (`NONE`: not yet), so "held every stride block so far" is one comparison.
        const NONE: u32 = u32::MAX;
        let mut run = vec![0u32; m];
        let mut held_through = vec![NONE; m];
        let mut w = 0u32;
        // Replicas holding every stride block so far (all of them before the first one).
        let mut alive = 0usize;
        let mut start = 0;
        while start < n {
            let stride_at = start + self.stride - 1;
            let candidate = |held_through: &[u32], r: ReplicaId| w == 0 || held_through[r.index()] == w - 1;
            if stride_at >= n {
                // The last, partial window: its recorded blocks are prompts' ends.
                for i in start..n {
                    for s in holders(i).iter().filter(|s| live(s) && candidate(&held_through, s.replica)) {
                        let r = &mut run[s.replica.index()];
                        *r = (*r).max(i as u32 + 1);
                    }
                }
                break;
            }
            // The replicas holding this window's stride block run through it. (One pass: the
            // loop below only reaches replicas that stop before it, whose runs end earlier.)
            let mut next = 0usize;
            for s in holders(stride_at) {
                if live(s) && candidate(&held_through, s.replica) {
                    held_through[s.replica.index()] = w;
                    run[s.replica.index()] = stride_at as u32 + 1;
                    next += 1;
                }
            }
            // Replicas that stop in this window may still end a recorded prompt inside it.
            if w == 0 || next < alive {
                let stops = |r: ReplicaId| candidate(&held_through, r) && held_through[r.index()] != w;
                for i in start..stride_at {
                    for s in holders(i).iter().filter(|s| live(s) && stops(s.replica)) {
                        let r = &mut run[s.replica.index()];
                        *r = (*r).max(i as u32 + 1);
                    }
                }
            }
            if next == 0 {
                break;
            }
            alive = next;
            w += 1;
            start += self.stride;
        }
        out.extend(
            run.iter().enumerate().filter(|(_, &r)| r > 0).map(|(i, &r)| (ReplicaId(i as u32), Overlap::gpu(r))),
        );
    }

    /// (block, replica) entries recorded for `replica` (stride blocks and prompts' ends).
    pub fn replica_blocks(&self, replica: ReplicaId) -> u64 {
        self.per_replica.get(replica.index()).copied().unwrap_or(0)
    }

    /// (block, replica) entries held.
    pub fn entries(&self) -> usize {
        self.entries
    }

    fn drop_if(&mut self, h: BlockHash, r: ReplicaId, stale: impl Fn(f64) -> bool) {
        let Some(list) = self.blocks.get_mut(&h) else { return };
        if let Ok(i) = list.binary_search_by_key(&r, |s| s.replica) {
            if stale(list[i].at) {
                list.remove(i);
                self.entries -= 1;
                self.per_replica[r.index()] -= 1;
                if list.is_empty() {
                    self.blocks.remove(&h);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    impl RoutingRecord {
        /// The previous implementation of [`Self::overlaps_within`] (sorted sets, binary
        /// searches): the property test holds the new one to it.
        pub(super) fn overlaps_within_reference(
            &self,
            hashes: &[BlockHash],
            now: f64,
            window: impl Fn(ReplicaId) -> f64,
            out: &mut Vec<(ReplicaId, Overlap)>,
        ) {
            type Ids = SmallVec<[ReplicaId; 16]>;
            let n = hashes.len();
            let ttl = self.ttl;
            let live = |s: &Sent| s.at + window(s.replica).min(ttl) > now;
            let holders = |i: usize| self.blocks.get(&hashes[i]).map_or(&[][..], |l| l.as_slice());
            // Each replica's run so far, blocks, sorted by replica (holder lists are sorted too, so
            // every membership test below is a binary search).
            let mut best: SmallVec<[(ReplicaId, u32); 16]> = SmallVec::new();
            let note = |best: &mut SmallVec<[(ReplicaId, u32); 16]>, r: ReplicaId, run: u32| match best
                .binary_search_by_key(&r, |x| x.0)
            {
                Ok(k) => best[k].1 = best[k].1.max(run),
                Err(k) => best.insert(k, (r, run)),
            };
            // Replicas that hold every stride block so far (all of them before the first one).
            let (mut alive, mut next): (Ids, Ids) = (SmallVec::new(), SmallVec::new());
            let mut first = true;
            let mut start = 0;
            while start < n {
                let stride_at = start + self.stride - 1;
                let candidate = |alive: &Ids, r: ReplicaId| first || alive.binary_search(&r).is_ok();
                if stride_at >= n {
                    // The last, partial window: its recorded blocks are prompts' ends.
                    for i in start..n {
                        for s in holders(i).iter().filter(|s| live(s) && candidate(&alive, s.replica)) {
                            note(&mut best, s.replica, i as u32 + 1);
                        }
                    }
                    break;
                }
                next.clear();
                next.extend(
                    holders(stride_at).iter().filter(|s| live(s) && candidate(&alive, s.replica)).map(|s| s.replica),
                );
                // Replicas that stop in this window may still end a recorded prompt inside it.
                let stops = |r: ReplicaId| candidate(&alive, r) && next.binary_search(&r).is_err();
                if first || alive.iter().any(|&r| stops(r)) {
                    for i in start..stride_at {
                        for s in holders(i).iter().filter(|s| live(s) && stops(s.replica)) {
                            note(&mut best, s.replica, i as u32 + 1);
                        }
                    }
                }
                for &r in &next {
                    note(&mut best, r, stride_at as u32 + 1);
                }
                if next.is_empty() {
                    break;
                }
                std::mem::swap(&mut alive, &mut next);
                first = false;
                start += self.stride;
            }
            out.extend(best.into_iter().map(|(r, run)| (r, Overlap::gpu(run))));
        }

        fn with_stride_1(ttl: f64, max: usize) -> Self {
            RoutingRecord::with_stride(ttl, max, 1)
        }
    }

    fn hs(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&h| BlockHash(h)).collect()
    }

    fn overlap(rec: &RoutingRecord, blocks: &[u64], now: f64) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        rec.overlaps(&hs(blocks), now, &mut out);
        out.into_iter().map(|(r, o)| (r.0, o.gpu)).collect()
    }

    #[test]
    fn entries_live_ttl_from_their_decision_time_and_refresh() {
        let mut rec = RoutingRecord::with_stride_1(10.0, 100);
        rec.record(ReplicaId(1), &hs(&[1, 2, 3]), 0.0);
        rec.record(ReplicaId(2), &hs(&[1, 2]), 5.0);
        assert_eq!(overlap(&rec, &[1, 2, 3], 9.0), vec![(1, 3), (2, 2)]);
        rec.record(ReplicaId(1), &hs(&[1]), 8.0);
        // At 10.0, replica 1's blocks 2 and 3 (recorded at 0.0) are gone; block 1 was refreshed.
        assert_eq!(overlap(&rec, &[1, 2, 3], 10.0), vec![(1, 1), (2, 2)]);
        rec.expire(10.0);
        assert_eq!((rec.entries(), rec.replica_blocks(ReplicaId(1))), (3, 1));
        rec.expire(18.0);
        assert_eq!(rec.entries(), 0);
    }

    #[test]
    fn max_entries_drops_the_oldest() {
        let mut rec = RoutingRecord::with_stride_1(100.0, 4);
        rec.record(ReplicaId(0), &hs(&[1, 2, 3]), 0.0);
        rec.record(ReplicaId(1), &hs(&[7, 8]), 1.0);
        assert_eq!(rec.entries(), 4);
        assert_eq!(overlap(&rec, &[1, 2, 3], 2.0), vec![], "block 1 was the oldest entry");
        assert_eq!(overlap(&rec, &[2, 3], 2.0), vec![(0, 2)]);
    }

    #[test]
    fn refreshes_do_not_grow_memory_without_bound() {
        let mut rec = RoutingRecord::with_stride_1(1e9, 1 << 20);
        for i in 0..10_000 {
            rec.record(ReplicaId(0), &hs(&[1, 2, 3, 4]), i as f64);
        }
        assert_eq!(rec.entries(), 4);
        assert!(rec.queued() <= 2 * 1024 + 4, "{}", rec.queued());
        assert_eq!(overlap(&rec, &[1, 2, 3, 4], 1e4), vec![(0, 4)]);
    }

    #[test]
    fn stride_blocks_and_prompt_ends_give_exact_runs_and_a_mid_stride_exit_rounds_down() {
        let mut rec = RoutingRecord::new(100.0, 1 << 20);
        let long: Vec<u64> = (1..=20).collect();
        rec.record(ReplicaId(0), &hs(&long), 0.0);
        rec.record(ReplicaId(1), &hs(&long[..5]), 0.0);
        // 20 blocks: stride blocks 8 and 16 and the end, 20: 3 entries; 5 blocks: its end.
        assert_eq!((rec.replica_blocks(ReplicaId(0)), rec.replica_blocks(ReplicaId(1))), (3, 1));
        assert_eq!(overlap(&rec, &long, 1.0), vec![(0, 20), (1, 5)]);
        // A continuation of the 5-block prompt, and one of the 20-block prompt.
        let mut more = long[..5].to_vec();
        more.extend([50, 51, 52, 53, 54]);
        // (Replica 0 holds those 5 blocks too, inside its prompt: mid-stride, so not counted.)
        assert_eq!(overlap(&rec, &more, 1.0), vec![(1, 5)]);
        let mut longer = long.clone();
        longer.extend([60, 61]);
        assert_eq!(overlap(&rec, &longer, 1.0), vec![(0, 20), (1, 5)]);
        // Leaving the 20-block prompt after block 12 (mid-stride): 8, the stride block before.
        let mut left = long[..12].to_vec();
        left.extend([70, 71, 72, 73, 74, 75]);
        assert_eq!(overlap(&rec, &left, 1.0), vec![(0, 8), (1, 5)]);
        // Leaving at a stride block is exact.
        let mut at16 = long[..16].to_vec();
        at16.push(80);
        assert_eq!(overlap(&rec, &at16, 1.0), vec![(0, 16), (1, 5)]);
    }

    #[test]
    fn forgetting_a_replica_keeps_the_others() {
        let mut rec = RoutingRecord::with_stride_1(100.0, 100);
        rec.record(ReplicaId(0), &hs(&[1, 2]), 0.0);
        rec.record(ReplicaId(1), &hs(&[1, 2]), 0.0);
        rec.forget_replica(ReplicaId(0));
        assert_eq!((rec.entries(), rec.replica_blocks(ReplicaId(0))), (2, 0));
        assert_eq!(overlap(&rec, &[1, 2], 1.0), vec![(1, 2)]);
    }

    proptest! {
        /// The dense-scratch walk gives exactly what the sorted-set walk gave, on records of
        /// prompts that share, branch from and continue each other, with expiry, refreshes and
        /// per-replica windows.
        #[test]
        fn overlaps_within_matches_the_reference(
            stride in 1usize..5,
            prompts in prop::collection::vec((0u32..6, 0u64..4, 1usize..24, 0u32..20), 1..40),
            query in (0u64..4, 1usize..30, 0usize..60),
            now in 0u32..25,
            windows in prop::collection::vec(0u32..12, 6),
            floor_share in 0u32..=4,
            ttl in 1u32..12,
        ) {
            // A prompt: a shared trunk `t` for its first blocks, then its own tail.
            let blocks = |trunk: u64, len: usize, own: u64| -> Vec<BlockHash> {
                (0..len).map(|i| BlockHash(if i < 10 { trunk * 1000 + i as u64 } else { own * 100_000 + i as u64 })).collect()
            };
            let mut rec = RoutingRecord::with_stride(f64::from(ttl), 1 << 20, stride);
            for (k, &(replica, trunk, len, at)) in prompts.iter().enumerate() {
                rec.record(ReplicaId(replica), &blocks(trunk, len, k as u64 + 7), f64::from(at));
            }
            rec.expire(f64::from(now) - 1.0);
            // Half the time a recorded prompt, cut short or run on (continuations, mid-stride
            // exits); else a new prompt on a trunk.
            let q = match prompts.get(query.2) {
                Some(&(_, trunk, _, _)) => blocks(trunk, query.1, query.2 as u64 + 7),
                None => blocks(query.0, query.1, 3),
            };
            let window = |r: ReplicaId| f64::from(windows[r.index() % windows.len()]);
            // Any floor up to the shortest window gives the same answer.
            let floor = f64::from(windows.iter().min().copied().unwrap_or(0)) * f64::from(floor_share) / 4.0;
            let (mut got, mut want) = (Vec::new(), Vec::new());
            rec.overlaps_within(&q, f64::from(now), floor, window, &mut got);
            rec.overlaps_within_reference(&q, f64::from(now), window, &mut want);
            prop_assert_eq!(got, want);
        }
    }
}
