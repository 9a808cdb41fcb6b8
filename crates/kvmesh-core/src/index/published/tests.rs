//! The published index answers as one index fed the same operations, shows a write only when
//! its writer is dropped, and never makes a reader wait.

use super::*;
use crate::hashing::Namespace;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

// The index tests' event makers: 4-token blocks, GPU.
use crate::index::tests::{removed, stored, BS, R0, R1};

fn hasher() -> BlockHasher {
    BlockHasher::new(BS, &Namespace::default()).unwrap()
}

fn overlaps(ix: &PrefixIndex, tokens: &[u32]) -> Vec<(ReplicaId, u32)> {
    let mut out = Vec::new();
    ix.overlaps(&ix.hasher().hash_blocks(tokens), &mut out);
    out.into_iter().map(|(r, o)| (r, o.gpu)).collect()
}

#[test]
fn a_write_shows_when_its_writer_is_dropped_and_a_reader_never_waits_for_it() {
    let p = PublishedIndex::new(hasher(), 7);
    p.write().register(R0, None);
    let toks: Vec<u32> = (0..8).collect();
    let mut w = p.write();
    assert_eq!(w.apply(R0, stored(&[1, 2], None, toks.clone())).unwrap().stored, 2);
    assert_eq!(overlaps(w.index(), &toks), vec![(R0, 2)]);
    // The writer holds its copy; a reader, here on the same thread, takes the other one.
    assert_eq!(overlaps(&p.read(), &toks), vec![]);
    drop(w);
    assert_eq!(overlaps(&p.read(), &toks), vec![(R0, 2)]);
    // The next writer first brings its copy (the old front) up to date.
    let w = p.write();
    assert_eq!(overlaps(w.index(), &toks), vec![(R0, 2)]);
    assert_eq!(overlaps(&p.read(), &toks), vec![(R0, 2)]);
}

#[test]
fn events_of_a_replica_not_registered_or_removed_are_refused() {
    let p = PublishedIndex::new(hasher(), 0);
    let toks: Vec<u32> = (0..4).collect();
    let mut w = p.write();
    assert_eq!(w.apply(R1, stored(&[1], None, toks.clone())), None);
    w.register(R1, None);
    assert_eq!(w.apply(R1, stored(&[1], None, toks.clone())).unwrap().stored, 1);
    assert_eq!(w.remove_replica(R1), 1);
    assert_eq!(w.apply(R1, stored(&[1], None, toks.clone())), None);
    assert_eq!(w.adopt_prompt(R1, &toks, None, None), None);
    drop(w);
    assert_eq!(overlaps(&p.read(), &toks), vec![]);
    assert_eq!(p.read().entries(), 0);
    let w = p.write();
    assert_eq!(w.index().entries(), 0);
}

/// A seeded stream over 4 replicas (replica 3 hashed as another model) of stores (some under
/// parents never seen), removals, clears, partial-history switches, prompts placing waiting
/// stores, and a replica removed and registered again, written in writes of 1 to
/// 5 operations, against one [`PrefixIndex`] fed the same: after every write both copies (the
/// front, and the back once the next writer catches it up) answer every probe as that index
/// does.
#[test]
fn both_copies_answer_as_one_index_fed_the_same() {
    let mut rng = SmallRng::seed_from_u64(42);
    let p = PublishedIndex::new(hasher(), 99);
    let mut reference = PrefixIndex::with_seed(hasher(), 99);
    let other = BlockHasher::new(BS, &Namespace { model: "other".into(), ..Namespace::default() }).unwrap();
    // 6 prompts of 6 blocks sharing a 2-block prefix per pair; engine ids per (prompt, block).
    let prompts: Vec<Vec<u32>> =
        (0..6u32).map(|k| (0..24).map(|t| if t < 8 { k / 2 * 1000 + t } else { k * 1000 + t }).collect()).collect();
    let id = |k: usize, b: usize| (if b < 2 { k / 2 * 100 + b } else { k * 100 + b }) as u64 + 1;
    let replicas: Vec<ReplicaId> = (0..4).map(ReplicaId).collect();
    let hasher_of = |r: ReplicaId| (r == ReplicaId(3)).then_some(other);
    {
        let mut w = p.write();
        for &r in &replicas {
            w.register(r, hasher_of(r));
            if let Some(h) = hasher_of(r) {
                reference.set_replica_hasher(r, h);
            }
        }
    }
    let mut counts = [0usize; 6];
    let mut placed = 0;
    for _ in 0..400 {
        let mut w = p.write();
        for _ in 0..rng.random_range(1..=5) {
            let r = replicas[rng.random_range(0..4)];
            let k = rng.random_range(0..6);
            let what = rng.random_range(0..20);
            counts[match what {
                0..=11 => 0,
                12..=14 => 1,
                15 => 2,
                16 => 3,
                17..=18 => 4,
                _ => 5,
            }] += 1;
            match what {
                0..=11 => {
                    let (from, to) = (rng.random_range(0..6), rng.random_range(1..=6));
                    let (from, to) = (from.min(to - 1), to);
                    let hashes: Vec<u64> = (from..to).map(|b| id(k, b)).collect();
                    let parent = (from > 0).then(|| id(k, from - 1));
                    let e = stored(&hashes, parent, prompts[k][from * 4..to * 4].to_vec());
                    let want = reference.apply(r, &e);
                    assert_eq!(w.apply(r, e), Some(want));
                }
                12..=14 => {
                    let e = removed(&[id(k, rng.random_range(0..6))]);
                    let want = reference.apply(r, &e);
                    assert_eq!(w.apply(r, e), Some(want));
                }
                15 => {
                    let want = reference.apply(r, &KvEvent::Cleared);
                    assert_eq!(w.apply(r, KvEvent::Cleared), Some(want));
                }
                16 => {
                    let partial = rng.random_bool(0.7);
                    reference.set_partial_history(r, partial);
                    w.set_partial_history(r, partial);
                }
                17..=18 => {
                    let n = rng.random_range(1..=6) * 4;
                    let want = reference.adopt_prompt(r, &prompts[k][..n], None, None);
                    placed += want.adopted + want.inferred;
                    assert_eq!(w.adopt_prompt(r, &prompts[k][..n], None, None), Some(want));
                }
                _ => {
                    assert_eq!(w.remove_replica(r), reference.remove_replica(r));
                    w.register(r, hasher_of(r));
                    if let Some(h) = hasher_of(r) {
                        reference.set_replica_hasher(r, h);
                    }
                }
            }
        }
        drop(w);
        let check = |ix: &PrefixIndex| {
            assert_eq!(ix.entries(), reference.entries());
            for prompt in &prompts {
                assert_eq!(overlaps(ix, prompt), overlaps(&reference, prompt));
            }
            for &r in &replicas {
                assert_eq!(ix.replica_blocks(r), reference.replica_blocks(r));
                assert_eq!(ix.orphan_blocks(r), reference.orphan_blocks(r));
                assert_eq!(ix.health(r), reference.health(r));
                assert_eq!(ix.history_is_partial(r), reference.history_is_partial(r));
            }
        };
        check(&p.read());
        // An empty write swaps the copies after catching the back one up.
        drop(p.write());
        check(&p.read());
    }
    // Every kind of operation was exercised, and blocks were held and waited.
    assert!(counts.iter().all(|&n| n > 40), "{counts:?}");
    assert!(placed > 0, "no waiting store was ever placed from a prompt");
    assert!(reference.entries() > 0);
}

#[test]
fn a_write_that_panics_is_dropped_whole_and_the_next_writer_starts_from_the_readers_copy() {
    let p = PublishedIndex::new(hasher(), 3);
    p.write().register(R0, None);
    let toks: Vec<u32> = (0..8).collect();
    p.write().apply(R0, stored(&[1], None, toks[..4].to_vec()));
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut w = p.write();
        w.apply(R0, stored(&[2], Some(1), toks[4..].to_vec()));
        panic!("a bug in the middle of a write");
    }));
    assert!(panicked.is_err());
    // Readers still see the write before; the half-done one never shows.
    assert_eq!(overlaps(&p.read(), &toks), vec![(R0, 1)]);
    // The next writers work on copies rebuilt from the readers' one: both answer alike.
    let mut w = p.write();
    assert_eq!(overlaps(w.index(), &toks), vec![(R0, 1)]);
    assert_eq!(w.apply(R0, stored(&[2], Some(1), toks[4..].to_vec())).unwrap().stored, 1);
    drop(w);
    assert_eq!(overlaps(&p.read(), &toks), vec![(R0, 2)]);
    drop(p.write());
    assert_eq!(overlaps(&p.read(), &toks), vec![(R0, 2)]);
}

#[test]
fn readers_on_other_threads_see_whole_writes_only() {
    // A writer stores a 2-block chain on replica 0 and removes it again, in one write each,
    // until both readers (two threads) have seen both states (at most 200,000 times); the
    // readers must never see 1 block, a write half done.
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    let p = std::sync::Arc::new(PublishedIndex::new(hasher(), 1));
    p.write().register(R0, None);
    let toks: Vec<u32> = (0..8).collect();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let satisfied = std::sync::Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (p, stop, satisfied, toks) = (p.clone(), stop.clone(), satisfied.clone(), toks.clone());
            std::thread::spawn(move || {
                let mut seen = [0u64; 3];
                let mut told = false;
                while !stop.load(Ordering::Relaxed) {
                    let o = overlaps(&p.read(), &toks);
                    seen[o.first().map_or(0, |x| x.1) as usize] += 1;
                    if !told && seen[0] > 0 && seen[2] > 0 {
                        told = true;
                        satisfied.fetch_add(1, Ordering::Relaxed);
                    }
                }
                seen
            })
        })
        .collect();
    for _ in 0..200_000 {
        if satisfied.load(Ordering::Relaxed) == 2 {
            break;
        }
        let mut w = p.write();
        w.apply(R0, stored(&[1], None, toks[..4].to_vec()));
        w.apply(R0, stored(&[2], Some(1), toks[4..].to_vec()));
        drop(w);
        let mut w = p.write();
        w.apply(R0, removed(&[2]));
        w.apply(R0, removed(&[1]));
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        let seen = r.join().unwrap();
        assert_eq!(seen[1], 0, "a reader saw one block of two");
        assert!(seen[0] > 0 && seen[2] > 0, "a reader never saw both states: {seen:?}");
    }
}
