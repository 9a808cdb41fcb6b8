//! Prefix-index tests: the shared cases (C02–C05, C20) with exact values, and a property test
//! against a naive reference model that identifies blocks by their whole token prefix.

use super::*;
use crate::hashing::Namespace;
use crate::ids::EngineBlockHash;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};
use xxhash_rust::xxh3::xxh3_64;

pub(super) const BS: u32 = 4;

fn index() -> PrefixIndex {
    PrefixIndex::new(BlockHasher::new(BS, &Namespace::default()).unwrap())
}

fn e(h: u64) -> EngineBlockHash {
    EngineBlockHash(h)
}

pub(super) fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::Stored(Stored {
        block_hashes: hashes.iter().map(|&h| e(h)).collect(),
        parent: parent.map(e),
        token_ids: tokens,
        block_size: BS,
        medium: Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        kv_group: None,
    })
}

pub(super) fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::Removed(Removed {
        block_hashes: hashes.iter().map(|&h| e(h)).collect(),
        medium: Medium::Gpu,
        kv_group: None,
    })
}

fn gpu_overlap(ix: &PrefixIndex, r: ReplicaId, tokens: &[u32]) -> u32 {
    let hashes = ix.hasher().hash_blocks(tokens);
    let mut out = Vec::new();
    ix.overlaps(&hashes, &mut out);
    out.iter().find(|(x, _)| *x == r).map_or(0, |(_, o)| o.gpu)
}

pub(super) const R0: ReplicaId = ReplicaId(0);
pub(super) const R1: ReplicaId = ReplicaId(1);

#[test]
fn stored_chain_gives_leading_overlap() {
    let mut ix = index();
    let toks: Vec<u32> = (0..12).collect();
    assert_eq!(ix.apply(R0, &stored(&[10, 11], None, toks[..8].to_vec())).stored, 2);
    assert_eq!(ix.apply(R0, &stored(&[12], Some(11), toks[8..].to_vec())).stored, 1);
    assert_eq!(gpu_overlap(&ix, R0, &toks), 3);
    // Same tokens from block 1 on but a different first block: the chain gives no overlap.
    let mut other = toks.clone();
    other[0] = 99;
    assert_eq!(gpu_overlap(&ix, R0, &other), 0);
    assert_eq!(ix.entries(), 3);
}

#[test]
fn c02_self_referential_and_repeated_hashes_are_counted_no_ops() {
    let mut ix = index();
    let toks: Vec<u32> = (0..8).collect();
    ix.apply(R1, &stored(&[1, 2], None, toks.clone()));
    let parent_is_own = stored(&[5, 6], Some(6), toks.clone());
    let repeated = stored(&[7, 7], None, toks.clone());
    for ev in [parent_is_own, repeated] {
        let out = ix.apply(R0, &ev);
        assert_eq!(out.rejection, Some(Rejection::SelfReferential));
        assert_eq!(out.stored, 0);
    }
    assert_eq!(ix.health(R0).unwrap().counters.rejected(Rejection::SelfReferential), 2);
    assert_eq!(ix.replica_blocks(R0), 0);
    assert_eq!(gpu_overlap(&ix, R1, &toks), 2, "other replicas unaffected");
    assert_eq!(ix.entries(), 2);
    // Past 16 blocks the check runs on a set each thread reuses: a repeat is still caught, and
    // the next event starts from an empty set (its ids, seen in the refused one, are no repeat).
    let long_toks: Vec<u32> = (0..80).collect();
    let mut ids: Vec<u64> = (100..120).collect();
    ids[19] = 100;
    let out = ix.apply(R0, &stored(&ids, None, long_toks.clone()));
    assert_eq!((out.stored, out.rejection), (0, Some(Rejection::SelfReferential)));
    ids[19] = 119;
    assert_eq!(ix.apply(R0, &stored(&ids, None, long_toks)).stored, 20);
}

#[test]
fn c03_unknown_parent_marks_out_of_sync_until_resync() {
    let mut ix = index();
    let out = ix.apply(R0, &stored(&[2], Some(1), vec![5, 6, 7, 8]));
    assert_eq!(out.rejection, Some(Rejection::UnknownParent));
    let h = ix.health(R0).unwrap();
    assert!(h.out_of_sync);
    assert_eq!(h.counters.rejected(Rejection::UnknownParent), 1);
    ix.apply(R0, &KvEvent::Cleared);
    assert!(!ix.health(R0).unwrap().out_of_sync, "a clear is a resync");
    ix.apply(R0, &stored(&[2], Some(1), vec![5, 6, 7, 8]));
    ix.mark_in_sync(R0);
    assert!(!ix.health(R0).unwrap().out_of_sync);
}

#[test]
fn c04_block_size_mismatch_is_loud() {
    let mut ix = index();
    let ev = KvEvent::Stored(Stored {
        block_hashes: vec![e(1)],
        parent: None,
        token_ids: (0..8).collect(),
        block_size: 8,
        medium: Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        kv_group: None,
    });
    let out = ix.apply(R0, &ev);
    assert_eq!(out.rejection, Some(Rejection::BlockSizeMismatch { got: 8, want: 4 }));
    assert_eq!(ix.health(R0).unwrap().block_size_mismatch, Some(8));
    assert_eq!(ix.entries(), 0);
    ix.apply(R0, &stored(&[1], None, vec![1, 2, 3, 4]));
    assert_eq!(ix.health(R0).unwrap().block_size_mismatch, None);
}

#[test]
fn token_count_mismatch_is_rejected() {
    let mut ix = index();
    let out = ix.apply(R0, &stored(&[1, 2], None, vec![1, 2, 3, 4, 5]));
    assert_eq!(out.rejection, Some(Rejection::TokenCountMismatch));
    assert_eq!(ix.entries(), 0);
}

#[test]
fn c05_signed_and_unsigned_hash_forms_are_the_same_block() {
    let mut ix = index();
    let big: u64 = 0xF000_0000_0000_0001;
    ix.apply(R0, &stored(&[big], None, vec![1, 2, 3, 4]));
    let signed = EngineBlockHash::from(big as i64);
    let ev = KvEvent::Removed(Removed { block_hashes: vec![signed], medium: Medium::Gpu, kv_group: None });
    assert_eq!(ix.apply(R0, &ev).removed, 1);
    assert_eq!(ix.entries(), 0);
}

#[test]
fn c20_the_same_block_stored_twice_is_removed_twice() {
    let mut ix = index();
    let toks: Vec<u32> = (0..8).collect();
    ix.apply(R0, &stored(&[1, 2], None, toks.clone()));
    ix.apply(R0, &stored(&[2], Some(1), toks[4..].to_vec()));
    ix.apply(R0, &removed(&[2]));
    assert_eq!(gpu_overlap(&ix, R0, &toks), 2, "one copy of h2 left");
    ix.apply(R0, &removed(&[2]));
    assert_eq!(gpu_overlap(&ix, R0, &toks), 1, "only h1 left");
    let out = ix.apply(R0, &removed(&[2]));
    assert_eq!((out.removed, out.rejection), (0, Some(Rejection::UnknownBlock)));
    assert_eq!(ix.entries(), 1);
}

#[test]
fn conflicting_engine_id_replaces_the_old_block() {
    let mut ix = index();
    ix.apply(R0, &stored(&[1], None, vec![1, 2, 3, 4]));
    let out = ix.apply(R0, &stored(&[1], None, vec![9, 9, 9, 9]));
    assert_eq!(out.rejection, Some(Rejection::ConflictingBlock));
    assert_eq!(gpu_overlap(&ix, R0, &[1, 2, 3, 4]), 0);
    assert_eq!(gpu_overlap(&ix, R0, &[9, 9, 9, 9]), 1);
    assert_eq!(ix.entries(), 1);
}

#[test]
fn lora_blocks_match_only_requests_for_that_adapter() {
    let mut ix = index();
    let toks: Vec<u32> = (0..8).collect();
    let ev = KvEvent::Stored(Stored {
        block_hashes: vec![e(1), e(2)],
        parent: None,
        token_ids: toks.clone(),
        block_size: BS,
        medium: Medium::Gpu,
        lora_name: Some("sql-lora".into()),
        extra_keys: None,
        kv_group: None,
    });
    ix.apply(R0, &ev);
    assert_eq!(gpu_overlap(&ix, R0, &toks), 0, "a base-model request does not match");
    let lora = ix.hasher().for_adapter("sql-lora").hash_blocks(&toks);
    let mut out = Vec::new();
    ix.overlaps(&lora, &mut out);
    assert_eq!(out, vec![(R0, Overlap::gpu(2))]);
}

#[test]
fn salted_blocks_match_their_salt_and_unverifiable_blocks_match_nothing() {
    let mut ix = index();
    let toks: Vec<u32> = (0..12).collect();
    // vLLM's extra keys: the cache_salt on the first block, an image in the second.
    let ev = KvEvent::Stored(Stored {
        block_hashes: vec![e(1), e(2), e(3)],
        parent: None,
        token_ids: toks.clone(),
        block_size: BS,
        medium: Medium::Gpu,
        lora_name: Some("sql".into()),
        extra_keys: Some(ExtraKeys { cache_salt: Some("tenant-7".into()), unverifiable: vec![0, 99, 0] }),
        kv_group: None,
    });
    ix.apply(R0, &ev);
    let overlap = |ix: &PrefixIndex, hashes: Vec<crate::BlockHash>| {
        let mut out = Vec::new();
        ix.overlaps(&hashes, &mut out);
        out.first().map_or(0, |(_, o)| o.gpu)
    };
    let salted = ix.hasher().for_adapter("sql").for_salt("tenant-7");
    // The first block only: the second holds an image no request's tokens show, and the
    // third chains from it.
    assert_eq!(overlap(&ix, salted.hash_blocks(&toks)), 1);
    assert_eq!(overlap(&ix, ix.hasher().for_adapter("sql").hash_blocks(&toks)), 0, "no salt, no match");
    assert_eq!(overlap(&ix, ix.hasher().for_adapter("sql").for_salt("tenant-8").hash_blocks(&toks)), 0);
    // A continuation chains from the stored hashes (salt and image included): it is found
    // under the request's own first block and no further, as the image block is.
    let next = KvEvent::Stored(Stored {
        block_hashes: vec![e(4)],
        parent: Some(e(3)),
        token_ids: (12..16).collect(),
        block_size: BS,
        medium: Medium::Gpu,
        lora_name: Some("sql".into()),
        extra_keys: None,
        kv_group: None,
    });
    ix.apply(R0, &next);
    assert_eq!(ix.replica_blocks(R0), 4);
    let all: Vec<u32> = (0..16).collect();
    assert_eq!(overlap(&ix, salted.hash_blocks(&all)), 1);
}

#[test]
fn a_hybrid_models_partial_groups_are_left_aside() {
    let mut ix = index();
    let toks: Vec<u32> = (0..8).collect();
    let group = |idx: u32, kind: &str| Some(KvGroup { idx, kind: Some(kind.into()), sliding_window: None });
    let store = |kv_group: Option<KvGroup>| {
        KvEvent::Stored(Stored {
            block_hashes: vec![e(1), e(2)],
            parent: None,
            token_ids: toks.clone(),
            block_size: BS,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: None,
            kv_group,
        })
    };
    let remove =
        |kv_group: Option<u32>| KvEvent::Removed(Removed { block_hashes: vec![e(2)], medium: Medium::Gpu, kv_group });
    // The same engine ids in the full-attention group 0 and the sliding-window group 1.
    assert_eq!(ix.apply(R0, &store(group(0, "full_attention"))).stored, 2);
    assert_eq!(ix.apply(R0, &store(group(1, "sliding_window"))).other_group, 2);
    assert_eq!(gpu_overlap(&ix, R0, &toks), 2);
    // The window group lets block 2 go: the full-attention group still holds it.
    assert_eq!(ix.apply(R0, &remove(Some(1))).other_group, 1);
    assert_eq!(gpu_overlap(&ix, R0, &toks), 2);
    // The full-attention group lets it go: gone, whatever the window group holds.
    assert_eq!(ix.apply(R0, &remove(Some(0))).removed, 1);
    assert_eq!(gpu_overlap(&ix, R0, &toks), 1);
    // MLA and a kind-less group count; Mamba does not.
    assert!(KvGroup { idx: 2, kind: Some("mla_attention".into()), sliding_window: None }.covers_whole_prefix());
    assert!(KvGroup { idx: 2, kind: None, sliding_window: None }.covers_whole_prefix());
    assert!(!KvGroup { idx: 2, kind: Some("mamba".into()), sliding_window: None }.covers_whole_prefix());
}

#[test]
fn a_sliding_window_group_cuts_the_hit_as_vllm_does() {
    // 10 blocks of 4 tokens in the full-attention group (ids 1–10) and in a sliding-window
    // group of 9 tokens (2 blocks needed before the hit point), as a hybrid vLLM sends them.
    let toks: Vec<u32> = (0..40).collect();
    let window = Some(KvGroup { idx: 1, kind: Some("sliding_window".into()), sliding_window: Some(9) });
    let in_group = |e: KvEvent, g: Option<KvGroup>| match e {
        KvEvent::Stored(s) => KvEvent::Stored(Stored { kv_group: g, ..s }),
        KvEvent::Removed(r) => KvEvent::Removed(Removed { kv_group: g.map(|g| g.idx), ..r }),
        other => other,
    };
    let ids: Vec<u64> = (1..=10).collect();
    let mut ix = index();
    assert_eq!(ix.apply(R0, &stored(&ids, None, toks.clone())).stored, 10);
    let without_windows = ix.memory_bytes();
    // The window group's blocks come as two stores, the second under the first's last block.
    assert_eq!(ix.apply(R0, &in_group(stored(&ids[..4], None, toks[..16].to_vec()), window.clone())).stored, 4);
    assert_eq!(ix.apply(R0, &in_group(stored(&ids[4..], Some(4), toks[16..].to_vec()), window.clone())).stored, 6);
    assert_eq!((ix.replica_blocks(R0), ix.window_blocks(R0)), (10, 10));
    assert!(ix.memory_bytes() > without_windows, "the window group's maps are counted");
    assert_eq!(gpu_overlap(&ix, R0, &toks), 10);
    // The window group lets block 8 (id 9) go: the last run of 2 ends at block 8.
    assert_eq!(ix.apply(R0, &in_group(removed(&[9]), window.clone())).removed, 1);
    assert_eq!(gpu_overlap(&ix, R0, &toks), 8);
    // A 9-block request: the full-attention hit is 9, the window group's run of 2 ends at 8.
    assert_eq!(gpu_overlap(&ix, R0, &toks[..36]), 8);
    // A CPU copy of a window block is left aside: it restores nothing of the GPU hit.
    let cpu = |e: KvEvent| match e {
        KvEvent::Stored(s) => KvEvent::Stored(Stored { medium: Medium::Cpu, ..s }),
        KvEvent::Removed(r) => KvEvent::Removed(Removed { medium: Medium::Cpu, ..r }),
        other => other,
    };
    let o = ix.apply(R0, &cpu(in_group(stored(&[9], Some(8), toks[32..36].to_vec()), window.clone())));
    assert_eq!((o.stored, o.other_group), (0, 1));
    assert_eq!(gpu_overlap(&ix, R0, &toks), 8);
    let o = ix.apply(R0, &cpu(in_group(removed(&[10]), window.clone())));
    assert_eq!((o.removed, o.other_group), (0, 1));
    assert_eq!(gpu_overlap(&ix, R0, &toks), 8);
    // Blocks 1, 3, 5 and 7 gone too: no run of 2 before 8 but the one from the start.
    ix.apply(R0, &in_group(removed(&[2, 4, 6, 8]), window.clone()));
    assert_eq!(gpu_overlap(&ix, R0, &toks), 1);
    // The full-attention group bounds it as before.
    ix.apply(R0, &removed(&[1]));
    assert_eq!(gpu_overlap(&ix, R0, &toks), 0);
    // A window store under a parent known in neither group is left aside.
    let o = ix.apply(R1, &in_group(stored(&[70], Some(69), toks[..4].to_vec()), window.clone()));
    assert_eq!((o.stored, o.other_group), (0, 1));
    // A clear drops the window groups too.
    ix.apply(R0, &KvEvent::Cleared);
    assert_eq!(ix.window_blocks(R0), 0);
}

#[test]
fn window_group_stores_follow_cases_c02_and_c20() {
    let toks: Vec<u32> = (0..8).collect();
    let window = Some(KvGroup { idx: 1, kind: Some("sliding_window".into()), sliding_window: Some(5) });
    let in_window = |e: KvEvent| match e {
        KvEvent::Stored(s) => KvEvent::Stored(Stored { kv_group: window.clone(), ..s }),
        KvEvent::Removed(r) => KvEvent::Removed(Removed { kv_group: Some(1), ..r }),
        other => other,
    };
    let mut ix = index();
    ix.apply(R0, &stored(&[1, 2], None, toks.clone()));
    // C02: a repeated id within one window store is a counted no-op.
    let o = ix.apply(R0, &in_window(stored(&[1, 1], None, toks.clone())));
    assert_eq!((o.stored, o.rejection), (0, Some(Rejection::SelfReferential)));
    assert_eq!(ix.window_blocks(R0), 0);
    // C20: block 2 stored twice in the window group is removed twice.
    ix.apply(R0, &in_window(stored(&[1, 2], None, toks.clone())));
    assert_eq!(ix.apply(R0, &in_window(stored(&[2], Some(1), toks[4..].to_vec()))).stored, 1);
    assert_eq!(ix.apply(R0, &in_window(removed(&[2]))).removed, 1);
    assert_eq!((ix.window_blocks(R0), gpu_overlap(&ix, R0, &toks)), (2, 2));
    assert_eq!(ix.apply(R0, &in_window(removed(&[2]))).removed, 1);
    // A 5-token window needs one block before the hit: block 0 alone still makes 1.
    assert_eq!((ix.window_blocks(R0), gpu_overlap(&ix, R0, &toks)), (1, 1));
}

#[test]
fn with_a_partial_history_unknown_parents_wait_for_their_parent() {
    let toks: Vec<u32> = (0..16).collect();
    // The engine's history: blocks 1, 2 (its replay buffer no longer holds that store), then
    // 3 under 2 and 4 under 3 (held).
    let (first, third, fourth) = (
        stored(&[1, 2], None, toks[..8].to_vec()),
        stored(&[3], Some(2), toks[8..12].to_vec()),
        stored(&[4], Some(3), toks[12..].to_vec()),
    );
    // Without a partial history an unknown parent is lost events: out of sync, as before.
    let mut ix = index();
    assert_eq!(ix.apply(R0, &third).rejection, Some(Rejection::UnknownParent));
    assert!(ix.health(R0).unwrap().out_of_sync);
    // With one, they wait (the replica stays in sync), in any order ...
    let mut ix = index();
    ix.set_partial_history(R0, true);
    let o = ix.apply(R0, &fourth);
    assert_eq!((o.rejection, o.orphaned), (None, 1));
    assert_eq!(ix.apply(R0, &third).orphaned, 1);
    assert!(!ix.health(R0).unwrap().out_of_sync);
    assert_eq!((ix.orphan_blocks(R0), ix.replica_blocks(R0), gpu_overlap(&ix, R0, &toks)), (2, 0, 0));
    // ... until the engine stores their parent again: then both chains are placed.
    let o = ix.apply(R0, &first);
    assert_eq!((o.stored, o.adopted), (2, 2));
    assert_eq!((ix.orphan_blocks(R0), ix.replica_blocks(R0), gpu_overlap(&ix, R0, &toks)), (0, 4, 4));
    // A store whose block the engine removes first leaves whole; a clear drops the rest.
    let mut ix = index();
    ix.set_partial_history(R0, true);
    ix.apply(R0, &stored(&[5, 6], Some(2), (0..8).collect()));
    ix.apply(R0, &stored(&[7], Some(9), (0..4).collect()));
    assert_eq!(ix.apply(R0, &removed(&[6])).orphans_dropped, 2);
    assert_eq!(ix.orphan_blocks(R0), 1);
    ix.apply(R0, &KvEvent::Cleared);
    assert_eq!(ix.orphan_blocks(R0), 0);
    // A whole history again (a restarted engine): nothing waits any more.
    ix.apply(R0, &stored(&[7], Some(9), (0..4).collect()));
    ix.set_partial_history(R0, false);
    assert_eq!(ix.orphan_blocks(R0), 0);
}

#[test]
fn a_routed_prompt_places_the_stores_that_continue_it() {
    // A system prompt of 3 blocks (tokens 0..12) cached before the replay buffer's oldest
    // message; held: two stores under its last block (engine id 30), one under the other.
    let system: Vec<u32> = (0..12).collect();
    let prompt = |tail: u32| -> Vec<u32> { system.iter().copied().chain(tail..tail + 4).collect() };
    let mut ix = index();
    ix.set_partial_history(R0, true);
    ix.apply(R0, &stored(&[40], Some(30), (100..104).collect()));
    ix.apply(R0, &stored(&[50], Some(30), (200..204).collect()));
    let empty = ix.memory_bytes();
    ix.apply(R0, &stored(&[51], Some(50), (300..304).collect()));
    assert_eq!((ix.orphan_blocks(R0), ix.replica_blocks(R0)), (3, 0));
    assert!(ix.memory_bytes() > empty, "what waits is counted");
    // Nothing waits on another replica, or for a prompt no store continues: nothing changes.
    assert_eq!(ix.adopt_prompt(R1, &prompt(100), None, None), ApplyOutcome::default());
    assert_eq!(ix.adopt_prompt(R0, &prompt(900), None, None), ApplyOutcome::default());
    // A prompt under an adapter matches no store the base model made.
    assert_eq!(ix.adopt_prompt(R0, &prompt(100), Some("sql"), None), ApplyOutcome::default());
    // The prompt routed there ends with block 40's tokens: the system prompt is placed (its
    // last block as engine id 30) and every store waiting under it follows.
    let o = ix.adopt_prompt(R0, &prompt(100), None, None);
    assert_eq!((o.inferred, o.adopted, o.stored, o.rejection), (3, 3, 0, None));
    assert_eq!((ix.orphan_blocks(R0), ix.replica_blocks(R0)), (0, 6));
    assert_eq!(gpu_overlap(&ix, R0, &prompt(100)), 4);
    let chain: Vec<u32> = system.iter().copied().chain(200..204).chain(300..304).collect();
    assert_eq!(gpu_overlap(&ix, R0, &chain), 5);
    // Adopting again finds nothing waiting.
    assert_eq!(ix.adopt_prompt(R0, &prompt(100), None, None), ApplyOutcome::default());
    // The engine evicts the system prompt's last block (after its children): the inferred
    // blocks before it go with it.
    ix.apply(R0, &removed(&[51, 50, 40]));
    let o = ix.apply(R0, &removed(&[30]));
    assert_eq!((o.removed, o.rejection), (3, None));
    assert_eq!((ix.replica_blocks(R0), gpu_overlap(&ix, R0, &prompt(100))), (0, 0));
    // One question waiting under two parents (asked after two lost system prompts): which
    // one a prompt's prefix is cannot be told, so nothing is placed; a store whose tokens
    // part from the prompt's after its first block is no match either.
    let mut ix = index();
    ix.set_partial_history(R0, true);
    ix.apply(R0, &stored(&[60], Some(31), (100..104).collect()));
    ix.apply(R0, &stored(&[61], Some(32), (100..104).collect()));
    ix.apply(R0, &stored(&[62, 63], Some(33), (200..204).chain(900..904).collect()));
    assert_eq!(ix.adopt_prompt(R0, &prompt(100), None, None), ApplyOutcome::default());
    let parted: Vec<u32> = system.iter().copied().chain(200..204).chain(300..304).collect();
    assert_eq!(ix.adopt_prompt(R0, &parted, None, None), ApplyOutcome::default());
    assert_eq!(ix.orphan_blocks(R0), 4);
}

#[test]
fn cpu_medium_is_tracked_apart_from_gpu() {
    let mut ix = index();
    let toks: Vec<u32> = (0..8).collect();
    ix.apply(R0, &stored(&[1, 2], None, toks.clone()));
    let cpu = KvEvent::Stored(Stored {
        block_hashes: vec![e(1)],
        parent: None,
        token_ids: toks[..4].to_vec(),
        block_size: BS,
        medium: Medium::Cpu,
        lora_name: None,
        extra_keys: None,
        kv_group: None,
    });
    ix.apply(R0, &cpu);
    ix.apply(R0, &removed(&[2, 1]));
    let hashes = ix.hasher().hash_blocks(&toks);
    let mut out = Vec::new();
    ix.overlaps(&hashes, &mut out);
    assert_eq!(out, vec![(R0, Overlap { gpu: 0, cpu: 1 })]);
}

#[test]
fn remove_replica_frees_everything_and_memory_shrinks() {
    let mut ix = index();
    let toks: Vec<u32> = (0..4000).collect();
    let hashes: Vec<u64> = (1..=1000).collect();
    ix.apply(R0, &stored(&hashes, None, toks.clone()));
    ix.apply(R1, &stored(&hashes, None, toks));
    let full = ix.memory_bytes();
    assert_eq!(ix.entries(), 2000);
    assert_eq!(ix.remove_replica(R0), 1000);
    assert_eq!(ix.entries(), 1000);
    assert_eq!(ix.remove_replica(R1), 1000);
    assert_eq!((ix.entries(), ix.blocks()), (0, 0));
    assert!(ix.memory_bytes() < full / 4, "{} vs {full}", ix.memory_bytes());
}

mod model;
mod walk;
