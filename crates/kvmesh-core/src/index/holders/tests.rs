//! The holder lists' kinds (inline, pair, quad, list) and their moves between them.

use super::*;

#[test]
fn holder_is_8_bytes() {
    assert_eq!(std::mem::size_of::<Holder>(), 8);
}

#[test]
fn add_and_remove_keep_sorted_and_collapse() {
    let mut arena = Arena::default();
    let mut h = Holder::one(ReplicaId(5), Medium::Gpu);
    assert_eq!(arena.add(&mut h, ReplicaId(2), Medium::Gpu), Added::NewHolder);
    assert_eq!(arena.add(&mut h, ReplicaId(9), Medium::Cpu), Added::NewHolder);
    assert_eq!(arena.add(&mut h, ReplicaId(5), Medium::Gpu), Added::Copy);
    let ids: Vec<u32> = arena.slice(&h).iter().map(|x| x.replica.0).collect();
    assert_eq!(ids, vec![2, 5, 9]);
    let r = arena.remove(&mut h, ReplicaId(5), Medium::Gpu, 1);
    assert_eq!(r, Removal { left: 1, replica_gone: false, block_empty: false });
    let r = arena.remove(&mut h, ReplicaId(5), Medium::Gpu, 1);
    assert_eq!(r, Removal { left: 0, replica_gone: true, block_empty: false });
    arena.remove(&mut h, ReplicaId(2), Medium::Gpu, 1);
    assert_eq!(h, Holder { replica: ReplicaId(9), copies: [0, 1] }, "collapsed back inline");
    assert_eq!((arena.lists.len(), arena.free.len()), (0, 0), "the last list freed gives the table back");
    assert_eq!((arena.pairs.len(), arena.free_pairs.len()), (0, 0), "and the last pair the pairs'");
    let r = arena.remove(&mut h, ReplicaId(9), Medium::Cpu, u16::MAX);
    assert_eq!(r, Removal { left: 0, replica_gone: true, block_empty: true });
    // A new list starts the table again.
    let mut g = Holder::one(ReplicaId(1), Medium::Gpu);
    arena.add(&mut g, ReplicaId(3), Medium::Gpu);
    assert_eq!((g.replica, g.list_index()), (MANY, PAIR_BIT as usize), "two holders: the first pair");
    // Equal lists mark the second; a medium that differs clears the mark.
    let mut k = Holder::one(ReplicaId(1), Medium::Gpu);
    arena.add(&mut k, ReplicaId(3), Medium::Gpu);
    arena.refresh_same(Some(&g), &mut k);
    assert!(k.same_as_previous() && !g.same_as_previous());
    assert_eq!(arena.slice(&k).len(), 2, "the mark leaves the handle's list alone");
    arena.add(&mut k, ReplicaId(3), Medium::Cpu);
    arena.refresh_same(Some(&g), &mut k);
    assert!(!k.same_as_previous());
    arena.refresh_same(None, &mut k);
    assert!(!k.same_as_previous());
}

#[test]
fn a_pair_grows_into_a_quad_then_a_list_and_shrinks_back() {
    let mut arena = Arena::default();
    let held = |a: &Arena, h: &Holder| a.slice(h).iter().map(|x| (x.replica.0, x.copies)).collect::<Vec<_>>();
    let tables = |a: &Arena| {
        (a.pairs.len() - a.free_pairs.len(), a.quads.len() - a.free_quads.len(), a.lists.len() - a.free.len())
    };
    let mut h = Holder::one(ReplicaId(4), Medium::Gpu);
    arena.add(&mut h, ReplicaId(8), Medium::Gpu);
    assert_eq!(tables(&arena), (1, 0, 0));
    assert_eq!(arena.add(&mut h, ReplicaId(8), Medium::Cpu), Added::Copy, "a pair counts copies in place");
    assert_eq!(arena.add(&mut h, ReplicaId(6), Medium::Gpu), Added::NewHolder);
    assert_eq!(held(&arena, &h), vec![(4, [1, 0]), (6, [1, 0]), (8, [1, 1])]);
    assert_eq!((h.list_index(), tables(&arena)), (QUAD_BIT as usize, (0, 1, 0)), "three: a quad, the pair freed");
    assert_eq!(arena.add(&mut h, ReplicaId(1), Medium::Gpu), Added::NewHolder);
    assert_eq!(arena.add(&mut h, ReplicaId(6), Medium::Gpu), Added::Copy, "a quad counts copies in place");
    assert_eq!(held(&arena, &h), vec![(1, [1, 0]), (4, [1, 0]), (6, [2, 0]), (8, [1, 1])]);
    assert_eq!(tables(&arena), (0, 1, 0), "four: still the quad");
    assert_eq!(arena.add(&mut h, ReplicaId(5), Medium::Cpu), Added::NewHolder);
    assert_eq!(held(&arena, &h), vec![(1, [1, 0]), (4, [1, 0]), (5, [0, 1]), (6, [2, 0]), (8, [1, 1])]);
    assert_eq!((h.list_index(), tables(&arena)), (0, (0, 0, 1)), "five: a list, the quad freed");
    arena.remove(&mut h, ReplicaId(1), Medium::Gpu, 1);
    assert_eq!(held(&arena, &h), vec![(4, [1, 0]), (5, [0, 1]), (6, [2, 0]), (8, [1, 1])]);
    assert_eq!(tables(&arena), (0, 1, 0), "four left: a quad again");
    let r = arena.remove(&mut h, ReplicaId(6), Medium::Gpu, 1);
    assert_eq!(r, Removal { left: 1, replica_gone: false, block_empty: false });
    arena.remove(&mut h, ReplicaId(5), Medium::Cpu, 1);
    assert_eq!(held(&arena, &h), vec![(4, [1, 0]), (6, [1, 0]), (8, [1, 1])]);
    assert_eq!(tables(&arena), (0, 1, 0), "three left: the same quad");
    arena.remove(&mut h, ReplicaId(4), Medium::Gpu, 1);
    assert_eq!(held(&arena, &h), vec![(6, [1, 0]), (8, [1, 1])]);
    assert_eq!((h.list_index(), tables(&arena)), (PAIR_BIT as usize, (1, 0, 0)), "two left: a pair again");
    let unknown = arena.remove(&mut h, ReplicaId(7), Medium::Gpu, 1);
    assert_eq!(unknown, Removal { left: 0, replica_gone: false, block_empty: false });
    let r = arena.remove(&mut h, ReplicaId(8), Medium::Gpu, 1);
    assert_eq!(r, Removal { left: 0, replica_gone: false, block_empty: false }, "8 still holds a CPU copy");
    arena.remove(&mut h, ReplicaId(8), Medium::Cpu, 1);
    assert_eq!(h, Holder { replica: ReplicaId(6), copies: [1, 0] }, "one left: inline");
    assert_eq!((arena.pairs.len(), arena.quads.len(), arena.lists.len()), (0, 0, 0), "every table given back");
}

proptest::proptest! {
    /// Any sequence of adds and removals over eight replicas: the holder's list is the
    /// model's, sorted, and what each call reports agrees with the model.
    #[test]
    fn holders_follow_a_map_through_every_kind(ops in proptest::collection::vec((0..8u32, proptest::bool::ANY, 0..3u16, proptest::bool::weighted(0.6)), 1..200)) {
        use std::collections::BTreeMap;
        let mut arena = Arena::default();
        let mut model: BTreeMap<u32, [u16; 2]> = BTreeMap::new();
        let mut h: Option<Holder> = None;
        for (r, cpu, n, add) in ops {
            let (replica, medium) = (ReplicaId(r), if cpu { Medium::Cpu } else { Medium::Gpu });
            let m = medium.index();
            if add {
                match h.as_mut() {
                    None => h = Some(Holder::one(replica, medium)),
                    Some(h) => {
                        let want = if model.contains_key(&r) { Added::Copy } else { Added::NewHolder };
                        proptest::prop_assert_eq!(arena.add(h, replica, medium), want);
                    }
                }
                model.entry(r).or_insert([0, 0])[m] += 1;
            } else if let Some(hh) = h.as_mut() {
                let got = arena.remove(hh, replica, medium, n);
                let want = match model.get_mut(&r) {
                    None => Removal { left: 0, replica_gone: false, block_empty: false },
                    Some(c) => {
                        c[m] = c[m].saturating_sub(n);
                        let (left, gone) = (c[m], *c == [0, 0]);
                        if gone {
                            model.remove(&r);
                        }
                        Removal { left, replica_gone: gone, block_empty: model.is_empty() }
                    }
                };
                proptest::prop_assert_eq!(got, want);
                if model.is_empty() {
                    h = None;
                }
            }
            // Now and then the holder carries the "same as previous" mark, as slots in a
            // segment do: it must not change what the handle stands for.
            if let Some(hh) = h.as_mut() {
                if r % 3 == 0 {
                    let copy = *hh;
                    arena.refresh_same(Some(&copy), hh);
                }
            }
            let listed: Vec<(u32, [u16; 2])> = h.as_ref().map_or(Vec::new(), |h| arena.slice(h).iter().map(|x| (x.replica.0, x.copies)).collect());
            let want: Vec<(u32, [u16; 2])> = model.iter().map(|(r, c)| (*r, *c)).collect();
            proptest::prop_assert_eq!(listed, want);
            // The list lives in the table its length says, alone: every other entry was freed.
            let kind = match h.as_ref() {
                None => 0,
                Some(h) if h.replica != MANY => 1,
                Some(h) => match h.kind() {
                    Kind::Pair(_) => 2,
                    Kind::Quad(_) => 4,
                    Kind::List(_) => 5,
                },
            };
            let by_length = match model.len() {
                0 => 0,
                1 => 1,
                2 => 2,
                3 | 4 => 4,
                _ => 5,
            };
            proptest::prop_assert_eq!(kind, by_length);
            let live = |len: usize, free: usize| len - free;
            let tables = (live(arena.pairs.len(), arena.free_pairs.len()), live(arena.quads.len(), arena.free_quads.len()), live(arena.lists.len(), arena.free.len()));
            proptest::prop_assert_eq!(tables, ((kind == 2) as usize, (kind == 4) as usize, (kind == 5) as usize));
        }
    }
}

#[test]
fn a_saturated_count_adds_nothing_in_every_kind() {
    let mut arena = Arena::default();
    let mut h = Holder::one(ReplicaId(1), Medium::Gpu);
    for r in 2..=6 {
        arena.add(&mut h, ReplicaId(r), Medium::Gpu);
        // The count of replica 2, whatever kind the list is now (pair, quad, quad, list, list).
        let before = arena.slice(&h).iter().find(|x| x.replica == ReplicaId(2)).map(|x| x.copies);
        let mut added = Added::Copy;
        while added == Added::Copy {
            added = arena.add(&mut h, ReplicaId(2), Medium::Cpu);
        }
        assert_eq!(added, Added::Full, "{r} holders");
        let after = arena.slice(&h).iter().find(|x| x.replica == ReplicaId(2)).map(|x| x.copies);
        assert_eq!((before.map(|c| c[0]), after), (Some(1), Some([1, u16::MAX])), "{r} holders");
        arena.remove(&mut h, ReplicaId(2), Medium::Cpu, u16::MAX);
    }
    assert_eq!(arena.slice(&h).len(), 6);
}
