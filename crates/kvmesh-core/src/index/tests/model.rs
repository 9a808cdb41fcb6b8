//! The index against a reference model: random event sequences, every engine id, every query.

use super::*;

// === reference model ===

/// Blocks identified by their whole token prefix, copies in a plain map: no hashing at all.
#[derive(Default)]
struct Model {
    held: HashMap<(u32, usize, u64), (Vec<u32>, u32)>,
}

impl Model {
    fn apply(&mut self, r: u32, ev: &KvEvent) {
        match ev {
            KvEvent::Stored(s) => {
                if s.block_size != BS || s.token_ids.len() != s.block_hashes.len() * BS as usize {
                    return;
                }
                let mut uniq = HashSet::new();
                if s.parent.is_some_and(|p| s.block_hashes.contains(&p))
                    || !s.block_hashes.iter().all(|h| uniq.insert(*h))
                {
                    return;
                }
                let m = s.medium.index();
                let mut prefix = match s.parent {
                    None => Vec::new(),
                    Some(p) => match self.held.get(&(r, m, p.0)).or_else(|| self.held.get(&(r, 1 - m, p.0))) {
                        Some((pre, _)) => pre.clone(),
                        None => return,
                    },
                };
                for (h, toks) in s.block_hashes.iter().zip(s.token_ids.chunks(BS as usize)) {
                    prefix.extend_from_slice(toks);
                    let entry = self.held.entry((r, m, h.0)).or_insert((prefix.clone(), 0));
                    if entry.0 != prefix {
                        *entry = (prefix.clone(), 0);
                    }
                    entry.1 += 1;
                }
            }
            KvEvent::Removed(rm) => {
                let m = rm.medium.index();
                for h in &rm.block_hashes {
                    if let Some(entry) = self.held.get_mut(&(r, m, h.0)) {
                        entry.1 -= 1;
                        if entry.1 == 0 {
                            self.held.remove(&(r, m, h.0));
                        }
                    }
                }
            }
            KvEvent::Cleared => self.held.retain(|(x, _, _), _| *x != r),
        }
    }

    fn entries(&self) -> usize {
        self.held.iter().map(|((r, _, _), (pre, _))| (*r, pre.clone())).collect::<HashSet<_>>().len()
    }

    /// Distinct blocks (token prefixes) anyone holds.
    fn blocks(&self) -> usize {
        self.held.values().map(|(pre, _)| pre.clone()).collect::<HashSet<_>>().len()
    }

    fn overlap(&self, r: u32, tokens: &[u32]) -> Overlap {
        let have: HashSet<(usize, &[u32])> = self
            .held
            .iter()
            .filter(|((x, _, _), _)| *x == r)
            .map(|((_, m, _), (pre, _))| (*m, pre.as_slice()))
            .collect();
        let run = |m: usize| {
            (1..=tokens.len() / BS as usize).take_while(|&i| have.contains(&(m, &tokens[..i * BS as usize]))).count()
                as u32
        };
        Overlap { gpu: run(0), cpu: run(1) }
    }
}

/// Blocks per document in the first test: short chains, where stores, removals, shared blocks
/// and reused ids meet often.
const SHORT: usize = 6;
/// Blocks per document in the second: more than twice the eight blocks a query compares at
/// once, so chains are walked both ways (eight at a time, and block by block where holders
/// change).
const LONG: usize = 20;

/// Documents share prefixes: tokens come from a tiny alphabet, so random docs often agree on
/// their first blocks. `blocks` blocks long.
fn doc(seed: u8, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * BS).map(|i| ((seed as u32 >> (i / BS).min(3)) + i / BS) % 3).collect()
}

/// The engine's id for a block: a function of the whole prefix, as vLLM's is.
fn engine_id(prefix: &[u32]) -> u64 {
    xxh3_64(&prefix.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()) % 500
}

#[derive(Debug, Clone)]
enum Op {
    /// `salt`: the engine names the same blocks with other ids (vLLM's `cache_salt` or
    /// multimodal keys change its hash, not the tokens), so one replica can hold a block under
    /// two ids.
    Store {
        r: u32,
        doc: u8,
        start: usize,
        len: usize,
        cpu: bool,
        salt: bool,
    },
    Remove {
        r: u32,
        doc: u8,
        block: usize,
        cpu: bool,
        salt: bool,
    },
    Clear {
        r: u32,
    },
    DropReplica {
        r: u32,
    },
    WrongBlockSize {
        r: u32,
    },
    SelfRef {
        r: u32,
        doc: u8,
    },
}

/// Events on documents of `blocks` blocks: stores start near a document's beginning half the
/// time (chains are built from their first block) and removals pick near it as often, so
/// short-document collisions stay common in long documents too.
fn op(blocks: usize, replicas: u32) -> impl Strategy<Value = Op> {
    let start = prop_oneof![0..4usize, 0..blocks - 2];
    let len = if blocks <= SHORT { 1..4 } else { 1..blocks - 4 };
    let block = prop_oneof![0..SHORT, 0..blocks];
    prop_oneof![
        6 => (0..replicas, 0..16u8, start, len, prop::bool::weighted(0.2), prop::bool::weighted(0.2))
            .prop_map(|(r, doc, start, len, cpu, salt)| Op::Store { r, doc, start, len, cpu, salt }),
        4 => (0..replicas, 0..16u8, block, prop::bool::weighted(0.2), prop::bool::weighted(0.2))
            .prop_map(|(r, doc, block, cpu, salt)| Op::Remove { r, doc, block, cpu, salt }),
        1 => (0..replicas).prop_map(|r| Op::Clear { r }),
        1 => (0..replicas).prop_map(|r| Op::DropReplica { r }),
        1 => (0..replicas).prop_map(|r| Op::WrongBlockSize { r }),
        1 => (0..replicas, 0..16u8).prop_map(|(r, doc)| Op::SelfRef { r, doc }),
    ]
}

fn to_event(op: &Op, blocks: usize) -> (u32, Option<KvEvent>) {
    let medium = |cpu: bool| if cpu { Medium::Cpu } else { Medium::Gpu };
    let b = BS as usize;
    match *op {
        Op::Store { r, doc: d, start, len, cpu, salt } => {
            let t = doc(d, blocks);
            let end = (start + len).min(blocks);
            let id = |k: usize| e(engine_id(&t[..k * b]) + 500 * salt as u64);
            let ids = (start..end).map(|k| id(k + 1)).collect();
            let parent = (start > 0).then(|| id(start));
            let ev = Stored {
                block_hashes: ids,
                parent,
                token_ids: t[start * b..end * b].to_vec(),
                block_size: BS,
                medium: medium(cpu),
                lora_name: None,
                extra_keys: None,
                kv_group: None,
            };
            (r, Some(KvEvent::Stored(ev)))
        }
        Op::Remove { r, doc: d, block, cpu, salt } => {
            let t = doc(d, blocks);
            let id = e(engine_id(&t[..(block + 1) * b]) + 500 * salt as u64);
            let ev = Removed { block_hashes: vec![id], medium: medium(cpu), kv_group: None };
            (r, Some(KvEvent::Removed(ev)))
        }
        Op::Clear { r } => (r, Some(KvEvent::Cleared)),
        Op::DropReplica { r } => (r, None),
        Op::WrongBlockSize { r } => {
            let ev = Stored {
                block_hashes: vec![e(1)],
                parent: None,
                token_ids: vec![0; 2 * b],
                block_size: 2 * BS,
                medium: Medium::Gpu,
                lora_name: None,
                extra_keys: None,
                kv_group: None,
            };
            (r, Some(KvEvent::Stored(ev)))
        }
        Op::SelfRef { r, doc: d } => {
            let t = doc(d, blocks);
            let id = e(engine_id(&t[..b]));
            let ev = Stored {
                block_hashes: vec![id],
                parent: Some(id),
                token_ids: t[..b].to_vec(),
                block_size: BS,
                medium: Medium::Gpu,
                lora_name: None,
                extra_keys: None,
                kv_group: None,
            };
            (r, Some(KvEvent::Stored(ev)))
        }
    }
}

/// Applies `ops` (from `replicas` replicas, on documents of `blocks` blocks) to the index and
/// the model, checking every document's overlaps after each step.
fn matches_model(ops: &[Op], blocks: usize, replicas: u32) -> Result<(), TestCaseError> {
    let mut ix = index();
    let mut model = Model::default();
    for op in ops {
        match to_event(op, blocks) {
            (r, Some(ev)) => {
                ix.apply(ReplicaId(r), &ev);
                model.apply(r, &ev);
            }
            (r, None) => {
                ix.remove_replica(ReplicaId(r));
                model.apply(r, &KvEvent::Cleared);
            }
        }
        prop_assert_eq!(ix.entries(), model.entries());
        prop_assert_eq!(ix.blocks(), model.blocks());
        // After every step, not only at the end: chains are stored in segments whose
        // slots empty, pop and get reused as events come and go.
        for d in 0..16u8 {
            let t = doc(d, blocks);
            let hashes = ix.hasher().hash_blocks(&t);
            let mut got = Vec::new();
            ix.overlaps(&hashes, &mut got);
            for r in 0..replicas {
                let want = model.overlap(r, &t);
                let have = got.iter().find(|(x, _)| x.0 == r).map_or(Overlap::default(), |(_, o)| *o);
                prop_assert_eq!(have, want, "replica {} doc {}", r, d);
            }
        }
    }
    for r in 0..replicas {
        ix.remove_replica(ReplicaId(r));
    }
    prop_assert_eq!((ix.entries(), ix.blocks()), (0, 0));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_reference_model(ops in prop::collection::vec(op(SHORT, 3), 1..60)) {
        matches_model(&ops, SHORT, 3)?;
    }

    #[test]
    // Six replicas: blocks held by three to six of them (quads and lists).
    fn index_matches_reference_model_on_long_chains(ops in prop::collection::vec(op(LONG, 6), 1..80)) {
        matches_model(&ops, LONG, 6)?;
    }
}

#[test]
fn a_seeded_index_answers_like_an_unseeded_one_for_every_engine_id() {
    // Ids 0 and the seed itself take the tables' side slot in one of the two indexes.
    let seed = 0x5eed_u64;
    let hasher = BlockHasher::new(BS, &Namespace::default()).unwrap();
    let (mut plain, mut seeded) = (index(), PrefixIndex::with_seed(hasher, seed));
    let r = ReplicaId(0);
    let tokens: Vec<u32> = (0..12).collect();
    let events = [
        stored(&[0, seed, 7], None, tokens.clone()),
        removed(&[7]),
        stored(&[7], Some(seed), tokens[8..12].to_vec()),
        removed(&[seed]),
    ];
    let mut seen = Vec::new();
    for ev in &events {
        assert_eq!(plain.apply(r, ev), seeded.apply(r, ev));
        let (a, b) = (gpu_overlap(&plain, r, &tokens), gpu_overlap(&seeded, r, &tokens));
        assert_eq!(a, b);
        seen.push(a);
    }
    // Stored 3, removed the last, stored it again, removed the middle: the run stops at 1.
    assert_eq!(seen, vec![3, 2, 3, 1]);
    assert_eq!((plain.entries(), seeded.entries()), (2, 2));
}

#[test]
fn one_block_under_two_engine_ids_keeps_each_ids_copies() {
    // The engine names block B twice (ids 2 and 3, as with a cache salt): each id's copy is
    // its own, and an id whose copies are gone is unknown, whatever happened to the slot.
    let mut ix = index();
    let ab: Vec<u32> = (0..8).collect();
    ix.apply(R0, &stored(&[1, 2], None, ab.clone()));
    ix.apply(R0, &stored(&[3], Some(1), ab[4..].to_vec()));
    assert_eq!((ix.entries(), ix.replica_blocks(R0)), (2, 3));
    assert_eq!(ix.apply(R0, &removed(&[2])).rejection, None);
    assert_eq!(gpu_overlap(&ix, R0, &ab), 2, "B is still held under id 3");
    ix.apply(R0, &removed(&[3]));
    assert_eq!(gpu_overlap(&ix, R0, &ab), 1);
    assert_eq!(ix.apply(R0, &removed(&[2])).rejection, Some(Rejection::UnknownBlock));
    let c: Vec<u32> = (8..12).collect();
    assert_eq!(ix.apply(R0, &stored(&[4], Some(2), c)).rejection, Some(Rejection::UnknownParent));
    assert_eq!((ix.entries(), ix.blocks()), (1, 1));

    // T under ids 1 and 2, both removed; U takes the freed place; T again under id 1 is a
    // plain store, not a conflict with U.
    let mut ix = index();
    let (t, u): (Vec<u32>, Vec<u32>) = ((0..4).collect(), (10..14).collect());
    ix.apply(R0, &stored(&[1], None, t.clone()));
    ix.apply(R0, &stored(&[2], None, t.clone()));
    ix.apply(R0, &removed(&[1]));
    assert_eq!(gpu_overlap(&ix, R0, &t), 1);
    ix.apply(R0, &removed(&[2]));
    assert_eq!((ix.entries(), gpu_overlap(&ix, R0, &t)), (0, 0));
    ix.apply(R0, &stored(&[3], None, u.clone()));
    assert_eq!(ix.apply(R0, &stored(&[1], None, t.clone())).rejection, None);
    assert_eq!((gpu_overlap(&ix, R0, &u), gpu_overlap(&ix, R0, &t), ix.entries()), (1, 1, 2));
    // An id reused for other tokens drops only the copies stored under it.
    ix.apply(R0, &stored(&[5], None, u.clone()));
    assert_eq!(ix.apply(R0, &stored(&[5], None, t.clone())).rejection, Some(Rejection::ConflictingBlock));
    assert_eq!((gpu_overlap(&ix, R0, &u), gpu_overlap(&ix, R0, &t)), (1, 1), "U keeps its copy under id 3");
    assert_eq!(ix.apply(R0, &KvEvent::Cleared).cleared, 3);
}

#[test]
fn a_holder_full_of_copies_takes_no_more_under_any_id() {
    // 65,535 copies per replica and medium is the holder's limit: a store under yet another id
    // is counted and changes nothing, so clearing every id empties the block exactly once.
    let mut ix = index();
    let t: Vec<u32> = (0..4).collect();
    for id in 1..=65_536u64 {
        ix.apply(R0, &stored(&[id], None, t.clone()));
    }
    assert_eq!((ix.replica_blocks(R0), gpu_overlap(&ix, R0, &t)), (65_535, 1));
    assert_eq!(ix.apply(R0, &removed(&[65_536])).rejection, Some(Rejection::UnknownBlock));
    assert_eq!(ix.apply(R0, &KvEvent::Cleared).cleared, 65_535);
    assert_eq!((ix.entries(), ix.blocks(), gpu_overlap(&ix, R0, &t)), (0, 0, 0));
    let other: Vec<u32> = (10..14).collect();
    ix.apply(R1, &stored(&[1], None, other.clone()));
    assert_eq!(ix.apply(R0, &stored(&[2], Some(65_536), other)).rejection, Some(Rejection::UnknownParent));
}
