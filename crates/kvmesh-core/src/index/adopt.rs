//! Placing a partial history's waiting stores from the prompts this node routes.
//!
//! Why: a long-lived prefix (a system prompt) cached before the oldest message of the
//! engine's replay buffer is never announced again while it stays cached, so every store
//! under it waits for a parent that never comes ([`super::orphans`]). A prompt this node
//! routes to that replica has those very tokens: where one of its blocks is the first block
//! of a waiting store, the blocks before it are the store's parent chain — the engine could
//! only have stored a continuation of that prefix by holding it (vLLM caches a block only
//! under its cached parent). The prefix is placed under ids of kvmesh's own ([`inferred_id`]),
//! the parent's last block under the engine id the waiting store named; the waiting stores
//! follow. Removing that engine id removes the inferred blocks with it: the engine evicts a
//! chain from its end, so its parent's other blocks cannot be told apart afterwards.

use super::event::{ExtraKeys, Removed, Stored};
use super::{ApplyOutcome, PrefixIndex};
use crate::ids::{EngineBlockHash, Medium, ReplicaId};

/// The id kvmesh gives block `j` of the prefix inferred under engine id `anchor` (the last
/// block, which keeps its engine id): a mix of both, so one inferred chain's ids are its own.
fn inferred_id(anchor: u64, j: usize) -> u64 {
    let mut z = anchor ^ (j as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl PrefixIndex {
    /// Places `replica`'s waiting stores (see [`PrefixIndex::set_partial_history`]) that
    /// continue `tokens`, a prompt this node routed to it (`lora_name` and `cache_salt`
    /// select its namespace, as a `BlockStored`'s do): for each block `k ≥ 1` of `tokens`
    /// that is the first block of a store waiting for parent `p`, blocks `0..k` are stored
    /// for `replica` (the last as `p`), and the stores waiting for `p` follow (a store made
    /// under another adapter than `lora_name`, or whose tokens part from the prompt's, is no
    /// match; a block that starts stores under two parents is skipped). Returns the
    /// blocks so inferred in `inferred` and the waiting blocks placed in `adopted`. Costs one
    /// slot lookup when nothing waits; tokens are `block_size`-token blocks, a partial last
    /// block ignored.
    pub fn adopt_prompt(
        &mut self,
        replica: ReplicaId,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let Some(Some(rb)) = self.replicas.get(replica.index()) else { return out };
        if rb.orphans.blocks() == 0 {
            return out;
        }
        let bs = self.hasher_of(replica).block_size() as usize;
        // A block that continues stores under two different parents (one question asked after
        // two system prompts) says nothing about which parent this prompt's prefix is.
        let found: Vec<(usize, u64)> = (1..tokens.len() / bs)
            .filter_map(|k| match rb.orphans.parents_continued_by(&tokens[k * bs..], bs, lora_name)[..] {
                [p] => Some((k, p)),
                _ => None,
            })
            .collect();
        for (k, parent) in found {
            let rb = self.slot(replica);
            if rb.engine[Medium::Gpu.index()].get(parent).is_some() {
                // Placed meanwhile (an earlier match of this prompt named the same parent).
                continue;
            }
            let mut ids: Vec<EngineBlockHash> = (0..k - 1).map(|j| EngineBlockHash(inferred_id(parent, j))).collect();
            ids.push(EngineBlockHash(parent));
            let s = Stored {
                block_hashes: ids,
                parent: None,
                token_ids: tokens[..k * bs].to_vec(),
                block_size: bs as u32,
                medium: Medium::Gpu,
                lora_name: lora_name.map(str::to_string),
                extra_keys: cache_salt
                    .map(|salt| ExtraKeys { cache_salt: Some(salt.to_string()), unverifiable: vec![] }),
                kv_group: None,
            };
            let placed = self.store_or_keep(replica, &s);
            if placed.stored == 0 {
                continue;
            }
            let inferred: Vec<u64> = s.block_hashes[..k - 1].iter().map(|h| h.0).collect();
            self.slot(replica).inferred.insert(parent, inferred);
            out.inferred += placed.stored;
            out.adopted += placed.adopted;
        }
        out
    }

    /// Removes the blocks inferred under each engine id `r` removes (see the module docs).
    pub(super) fn remove_inferred(&mut self, replica: ReplicaId, r: &Removed) -> u32 {
        let rb = self.slot(replica);
        if rb.inferred.is_empty() || r.medium != Medium::Gpu {
            return 0;
        }
        let gone: Vec<EngineBlockHash> =
            r.block_hashes.iter().filter_map(|h| rb.inferred.remove(&h.0)).flatten().map(EngineBlockHash).collect();
        if gone.is_empty() {
            return 0;
        }
        self.remove(replica, &Removed { block_hashes: gone, medium: Medium::Gpu, kv_group: None }).removed
    }
}
