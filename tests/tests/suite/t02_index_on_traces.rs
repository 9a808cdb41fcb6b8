//! The core's prefix index, fed vLLM-style Stored events for a real trace, sees exactly the
//! reuse the trace analysis counts: one replica with unbounded cache, each request's leading
//! overlap queried before its new blocks are stored. Mooncake ids name whole prefixes, so the
//! overlap of a request equals the number of its ids seen before.

use kvmesh_core::index::{KvEvent, Stored};
use kvmesh_core::{BlockHasher, EngineBlockHash, Medium, Namespace, PrefixIndex, ReplicaId};
use kvmesh_sim::trace;
use kvmesh_tests::trace as fixture;

const BS: u32 = 16;

/// 16 synthetic tokens standing for one Mooncake block id.
fn block_tokens(id: u64) -> impl Iterator<Item = u32> {
    (0..BS).map(move |i| (id as u32).wrapping_mul(2_654_435_761) ^ (i << 27) ^ (id >> 32) as u32)
}

#[test]
fn index_overlap_equals_trace_reuse() {
    let Some(path) = fixture("mooncake/conversation_trace.jsonl") else { return };
    let t = trace::load(&path).unwrap();
    let hasher = BlockHasher::new(BS, &Namespace::default()).unwrap();
    let mut ix = PrefixIndex::new(hasher);
    let r = ReplicaId(0);
    let (mut overlap_total, mut out) = (0u64, Vec::new());
    for req in &t.requests {
        let tokens: Vec<u32> = req.block_ids.iter().flat_map(|&id| block_tokens(id)).collect();
        let hashes = hasher.hash_blocks(&tokens);
        out.clear();
        ix.overlaps(&hashes, &mut out);
        let held = out.first().map_or(0, |(_, o)| o.gpu) as usize;
        overlap_total += held as u64;
        if held < req.block_ids.len() {
            let ev = KvEvent::Stored(Stored {
                block_hashes: req.block_ids[held..].iter().map(|&id| EngineBlockHash(id)).collect(),
                parent: held.checked_sub(1).map(|p| EngineBlockHash(req.block_ids[p])),
                token_ids: tokens[held * BS as usize..].to_vec(),
                block_size: BS,
                medium: Medium::Gpu,
                lora_name: None,
                extra_keys: None,
                kv_group: None,
            });
            assert_eq!(ix.apply(r, &ev).rejection, None);
        }
    }
    assert_eq!(overlap_total, 105_710);
    assert_eq!(ix.entries(), 182_790);
}
