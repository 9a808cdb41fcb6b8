//! The engine-id maps alone: what one hashed probe per block costs on the workload's events.
//!
//! vLLM's `BlockRemoved` names blocks by the engine's own block hashes only
//! (`vllm/distributed/kv_events.py`), opaque to a router, so an index exact on vLLM's events
//! looks each removed id up in a map from (engine, id) to where it holds the block, and puts
//! every stored id in that map. This pass keeps such a map and nothing else — per engine a
//! `std::collections::HashMap` (hashbrown's SwissTable) with rustc's Fx hash, 16 bytes an
//! entry, one insert per stored block and one removal per removed block — timed as
//! [`crate::run::apply_pass`] times an index. No block hashes, no holders, no queries. Dynamo's
//! `RadixTree` keeps a map like it beside its tree (`lookup`: worker →
//! `FxHashMap<ExternalSequenceBlockHash, SharedRadixBlock>`, dynamo-kv-router 1.6.1
//! `src/indexer/radix_tree.rs`), and kvmesh its engine-id tables. Each event's ids are looked
//! up once, all of them, before they are inserted or removed: the lookups do not depend on each
//! other, so some of their cache misses overlap and the writes find their slots in cache (10 %
//! faster at 128 engines than one id after another). Not a lower bound for every table: one
//! whose probes overlap with no branch on what they read could be faster.

use crate::alloc::live_bytes;
use crate::run::ApplyFigures;
use crate::workload::{Op, Workload};
use rustc_hash::FxHashMap;
use std::time::Instant;

/// The engine-id maps alone, fed every event of `w` (the blocks after `w.warm_ops` timed);
/// `heap_bytes` by the counting allocator, as for an index; `errors` counts removals of ids
/// not in the map (expected 0).
pub fn engine_map_pass(w: &Workload) -> ApplyFigures {
    let before = live_bytes();
    let mut maps: Vec<FxHashMap<u64, u64>> = vec![FxHashMap::default(); w.engines];
    let (mut ns, mut errors) = (0u64, 0u64);
    for (k, op) in w.ops.iter().enumerate() {
        let t = Instant::now();
        match op {
            Op::Store { engine, blocks, .. } => {
                let map = &mut maps[*engine as usize];
                let mut sink = 0u64;
                for b in blocks {
                    sink ^= map.get(&b.engine_id).copied().unwrap_or(0);
                }
                std::hint::black_box(sink);
                for b in blocks {
                    map.insert(b.engine_id, b.local);
                }
            }
            Op::Remove { engine, engine_ids } => {
                let map = &mut maps[*engine as usize];
                let mut sink = 0u64;
                for id in engine_ids {
                    sink ^= map.get(id).copied().unwrap_or(0);
                }
                std::hint::black_box(sink);
                for id in engine_ids {
                    errors += map.remove(id).is_none() as u64;
                }
            }
            Op::Query(_) => continue,
        }
        if k >= w.warm_ops {
            ns += t.elapsed().as_nanos() as u64;
        }
    }
    let heap_bytes = live_bytes() - before;
    std::hint::black_box(&maps);
    ApplyFigures { ns, blocks: w.event_blocks(w.warm_ops), heap_bytes, errors }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Block;

    fn store(engine: u32, ids: &[u64]) -> Op {
        Op::Store { engine, parent: None, blocks: ids.iter().map(|&id| Block { local: id, engine_id: id }).collect() }
    }

    fn workload(ops: Vec<Op>, warm_ops: usize) -> Workload {
        Workload { ops, queries: Vec::new(), warm_ops, engines: 2, requests: 0, entries: 4 }
    }

    #[test]
    fn the_maps_count_the_timed_blocks_and_removals_they_cannot_find() {
        // Two engines may use the same id; each map is its own engine's.
        let ops = vec![
            store(0, &[1, 2, 3]),
            store(1, &[1, 2]),
            Op::Query(0),
            Op::Remove { engine: 1, engine_ids: vec![2] },
            Op::Remove { engine: 0, engine_ids: vec![2, 3] },
        ];
        let f = engine_map_pass(&workload(ops, 2));
        // Timed from op 2 on: 1 + 2 blocks removed.
        assert_eq!((f.blocks, f.errors), (3, 0));
        // Engine 1 never stored 1; engine 0 removes 2 twice.
        let ops = vec![
            store(0, &[1, 2]),
            Op::Remove { engine: 1, engine_ids: vec![1] },
            Op::Remove { engine: 0, engine_ids: vec![2, 2] },
        ];
        assert_eq!(engine_map_pass(&workload(ops, 0)).errors, 2);
    }
}
