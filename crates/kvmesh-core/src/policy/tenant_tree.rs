//! A block-granular model of the approximate radix tree that SGLang's router, the vLLM router
//! and Ray Serve's prefix router build from the prompts they route: one tree shared by all
//! workers, each worker a *tenant* of the nodes its prompts passed through.
//!
//! Those trees key on characters (SGLang, Ray) or token ids (the vLLM router); this one keys on
//! kvmesh's chained block hashes, so a position in it is a whole prefix up to a block boundary
//! and a match is counted in whole blocks (at most one block short of a character match). Per
//! block it keeps the tenants in the order they first reached it: the first one still holding
//! a block is the tenant SGLang reports for that node (its `last_tenant`, set by the insert that
//! created the node and copied on splits), and the order is Ray's node tenant order.
//!
//! Every tenant's blocks are prefix-closed (inserting a block inserts its whole prefix, and
//! eviction takes a tenant's deepest blocks first), so "some tenant holds block `k`" is monotone
//! in `k` and the deepest match is found by binary search.

use crate::ids::{BlockHash, ReplicaId};
use crate::load::FleetEvent;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::collections::VecDeque;

#[derive(Debug, Clone, Copy)]
struct Holder {
    tenant: ReplicaId,
    /// The insert that last passed through the block for this tenant (a logical clock, as
    /// SGLang's epoch counter).
    stamp: u64,
}

/// The shared tree; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct TenantTree {
    blocks: FxHashMap<BlockHash, SmallVec<[Holder; 2]>>,
    /// Blocks held, per tenant (replica index).
    sizes: Vec<u64>,
    /// Per tenant, `(stamp, block)` in the order stamped, for least-recently-inserted eviction;
    /// an item is stale once its block's stamp for the tenant moved on. Kept only when the
    /// tree evicts.
    order: Vec<VecDeque<(u64, BlockHash)>>,
    clock: u64,
    evicts: bool,
}

impl TenantTree {
    /// An empty tree; `evicts` keeps the bookkeeping [`Self::evict_over`] needs.
    pub(crate) fn new(evicts: bool) -> Self {
        TenantTree { evicts, ..TenantTree::default() }
    }

    /// Records that a prompt whose full blocks are `hashes` was routed to `tenant`.
    pub(crate) fn insert(&mut self, tenant: ReplicaId, hashes: &[BlockHash]) {
        self.clock += 1;
        let (t, stamp) = (tenant.index(), self.clock);
        if self.sizes.len() <= t {
            self.sizes.resize(t + 1, 0);
            if self.evicts {
                self.order.resize_with(t + 1, VecDeque::new);
            }
        }
        for &h in hashes {
            let list = self.blocks.entry(h).or_default();
            match list.iter_mut().find(|x| x.tenant == tenant) {
                Some(x) => x.stamp = stamp,
                None => {
                    list.push(Holder { tenant, stamp });
                    self.sizes[t] += 1;
                }
            }
        }
        if self.evicts {
            // Deepest first: among blocks of one stamp, eviction must take descendants before
            // their prefix, so the tenant's blocks stay prefix-closed.
            let order = &mut self.order[t];
            order.extend(hashes.iter().rev().map(|&h| (stamp, h)));
            if order.len() > 2 * (self.sizes[t] as usize).max(1024) {
                let blocks = &self.blocks;
                order.retain(|(s, h)| {
                    blocks.get(h).and_then(|l| l.iter().find(|x| x.tenant == tenant)).is_some_and(|x| x.stamp == *s)
                });
            }
        }
    }

    /// The deepest leading run of `hashes` that some tenant accepted by `keep` holds, blocks.
    pub(crate) fn deepest(&self, hashes: &[BlockHash], keep: impl Fn(ReplicaId) -> bool) -> usize {
        let held = |k: usize| self.blocks.get(&hashes[k]).is_some_and(|l| l.iter().any(|x| keep(x.tenant)));
        leading_run(hashes.len(), held)
    }

    /// Every tenant's deepest leading run of `hashes`, blocks, into `runs` (indexed by replica
    /// index, resized to cover every tenant seen). One walk that stops at the first block no
    /// tenant continues: O(blocks · holders), not a search per tenant.
    pub(crate) fn runs(&self, hashes: &[BlockHash], runs: &mut Vec<u32>) {
        runs.clear();
        runs.resize(self.sizes.len(), 0);
        for (k, h) in hashes.iter().enumerate() {
            let mut any = false;
            for x in self.blocks.get(h).into_iter().flatten() {
                let r = &mut runs[x.tenant.index()];
                if *r == k as u32 {
                    *r += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
    }

    /// The tenants holding `hash`, in the order they first reached it.
    pub(crate) fn holders(&self, hash: BlockHash) -> impl Iterator<Item = ReplicaId> + '_ {
        self.blocks.get(&hash).into_iter().flat_map(|l| l.iter().map(|x| x.tenant))
    }

    /// Blocks `tenant` holds.
    pub(crate) fn size(&self, tenant: ReplicaId) -> u64 {
        self.sizes.get(tenant.index()).copied().unwrap_or(0)
    }

    /// Forgets everything `tenant` holds (its worker was removed).
    pub(crate) fn forget(&mut self, tenant: ReplicaId) {
        if self.size(tenant) == 0 {
            return;
        }
        self.blocks.retain(|_, list| {
            list.retain(|x| x.tenant != tenant);
            !list.is_empty()
        });
        self.sizes[tenant.index()] = 0;
        if let Some(order) = self.order.get_mut(tenant.index()) {
            order.clear();
        }
    }

    /// Forgets the tenants `events` say were removed.
    pub(crate) fn forget_removed(&mut self, events: &[FleetEvent]) {
        for ev in events {
            if let FleetEvent::ReplicaRemoved(r) = *ev {
                self.forget(r);
            }
        }
    }

    /// Evicts, from every tenant holding more than `max_blocks`, its least recently inserted
    /// blocks (deepest first among equals) until it holds `max_blocks`. A no-op for a tree made
    /// without eviction.
    pub(crate) fn evict_over(&mut self, max_blocks: u64) {
        for t in 0..self.order.len() {
            let tenant = ReplicaId(t as u32);
            while self.sizes[t] > max_blocks {
                let Some((stamp, h)) = self.order[t].pop_front() else { break };
                let Some(list) = self.blocks.get_mut(&h) else { continue };
                let Some(pos) = list.iter().position(|x| x.tenant == tenant && x.stamp == stamp) else { continue };
                list.remove(pos);
                if list.is_empty() {
                    self.blocks.remove(&h);
                }
                self.sizes[t] -= 1;
            }
        }
    }
}

/// The length of the leading run of `0..n` where `held` is true, for a `held` that is true on a
/// prefix of `0..n` and false after it (binary search: O(log n) lookups).
pub(crate) fn leading_run(n: usize, held: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if held(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}
