//! The replicas holding one block: 8 bytes inline for the common single holder, a shared list
//! in an arena for blocks several replicas hold — a pair (16 bytes in a table of pairs, the
//! common shared block) or a longer list.
//!
//! A [`Holder`] is either one replica's copy counts or, when its replica field is [`MANY`], a
//! handle to a list in the [`Arena`] (sorted by replica id). Keeping the map value at 8 bytes
//! keeps each segment slot (block hash and holder) at 16 bytes — the index's memory is
//! dominated by these slots and the engine-id maps.

use crate::ids::{Medium, ReplicaId};
use crate::overlap::{Holding, CPU_BIT, GPU_BIT};

/// The replica-field marker of a handle to an arena list. Fleets never assign this id.
pub(crate) const MANY: ReplicaId = ReplicaId(u32::MAX);

/// In a handle's index: "the previous slot's list is equal".
const SAME_BIT: u32 = 1 << 31;
/// In a handle's index: the list is a pair, in the arena's table of pairs (lists of each kind
/// number below 2^30).
const PAIR_BIT: u32 = 1 << 30;

/// One replica's copies of one block, per medium — or, with `replica == MANY`, an arena handle
/// whose index is `copies[0] | copies[1] << 16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) replica: ReplicaId,
    /// Copies held, `[GPU, CPU]`: engines may hold several physical copies (case C20).
    /// Saturates at 65,535 copies per medium.
    pub(crate) copies: [u16; 2],
}

/// Nobody: the holder of an empty segment slot ([`Holder::is_empty`]).
impl Default for Holder {
    fn default() -> Self {
        Holder { replica: ReplicaId(0), copies: [0, 0] }
    }
}

impl Holding for Holder {
    #[inline]
    fn replica(&self) -> ReplicaId {
        self.replica
    }
}

impl Holder {
    /// One copy of a block for `replica` in `medium`.
    pub(crate) fn one(replica: ReplicaId, medium: Medium) -> Self {
        let mut copies = [0; 2];
        copies[medium.index()] = 1;
        Holder { replica, copies }
    }

    /// Whether nobody holds the block (the [`Default`] holder).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.replica != MANY && self.copies == [0, 0]
    }

    /// Whether `self`, the next slot of `previous` in a segment, is held by exactly the same
    /// replicas in the same media (copy counts aside): then a walk over the chain can skip it.
    #[inline]
    pub(crate) fn same_holders_as(&self, previous: &Holder) -> bool {
        self.same_as_previous()
            || (self.replica != MANY
                && self.replica == previous.replica
                && self.media() != 0
                && self.media() == previous.media())
    }

    /// The holder as one word: equal words are the same replica with the same copies, so the
    /// same holders (two slots never share a list's handle, so shared lists never compare
    /// equal).
    #[inline(always)]
    pub(crate) fn bits(&self) -> u64 {
        u64::from(self.replica.0) | u64::from(self.copies[0]) << 32 | u64::from(self.copies[1]) << 48
    }

    /// The media the block is held in, as a mask of `GPU_BIT` and `CPU_BIT`.
    #[inline]
    pub(crate) fn media(&self) -> u8 {
        ((self.copies[0] != 0) as u8 * GPU_BIT) | ((self.copies[1] != 0) as u8 * CPU_BIT)
    }

    fn handle(index: u32) -> Self {
        Holder { replica: MANY, copies: [index as u16, (index >> 16) as u16] }
    }

    fn list_index(&self) -> usize {
        ((self.copies[0] as u32 | (self.copies[1] as u32) << 16) & !SAME_BIT) as usize
    }

    /// Whether this handle's list holds the same replicas in the same media as the previous
    /// slot's (see [`Arena::refresh_same`]); always false for an inline holder.
    #[inline]
    pub(crate) fn same_as_previous(&self) -> bool {
        self.replica == MANY && self.copies[1] & (SAME_BIT >> 16) as u16 != 0
    }
}

/// What adding a copy did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Added {
    /// The replica did not hold the block before.
    NewHolder,
    /// The replica held it; one more copy is counted.
    Copy,
    /// The replica holds 65,535 copies in that medium: nothing was counted.
    Full,
}

/// What removing copies did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Removal {
    /// Copies the replica still holds in that medium.
    pub(crate) left: u16,
    /// The replica no longer holds the block in any medium (a (block, replica) entry ended).
    pub(crate) replica_gone: bool,
    /// Nobody holds the block any more: its slot is emptied.
    pub(crate) block_empty: bool,
}

/// Shared holder lists, reused through free lists. A block two replicas hold takes 16 bytes
/// in `pairs`; a list of three or more a `Vec` in `lists` (24 bytes and its buffer: a pair
/// kept that way cost 40 bytes; BENCHMARKS.md).
#[derive(Debug, Clone, Default)]
pub(crate) struct Arena {
    pairs: Vec<[Holder; 2]>,
    free_pairs: Vec<u32>,
    lists: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

impl Arena {
    /// The holders `h` stands for, sorted by replica id.
    #[inline]
    pub(crate) fn slice<'a>(&'a self, h: &'a Holder) -> &'a [Holder] {
        if h.replica != MANY {
            return std::slice::from_ref(h);
        }
        match h.list_index() {
            i if i & PAIR_BIT as usize != 0 => &self.pairs[i & !(PAIR_BIT as usize)],
            i => &self.lists[i],
        }
    }

    /// Adds one copy for `replica` in `medium`; says whether the replica is a new holder, or
    /// already held it and the copy was counted, or was at 65,535 copies there already.
    pub(crate) fn add(&mut self, h: &mut Holder, replica: ReplicaId, medium: Medium) -> Added {
        let m = medium.index();
        let count = |copies: &mut u16| match copies.checked_add(1) {
            Some(c) => {
                *copies = c;
                Added::Copy
            }
            None => Added::Full,
        };
        if h.replica == replica {
            return count(&mut h.copies[m]);
        }
        let new = Holder::one(replica, medium);
        if h.replica != MANY {
            let pair = if h.replica < replica { [*h, new] } else { [new, *h] };
            *h = Holder::handle(self.alloc_pair(pair) | PAIR_BIT);
            return Added::NewHolder;
        }
        let index = h.list_index();
        if index & PAIR_BIT as usize != 0 {
            let p = index & !(PAIR_BIT as usize);
            if let Some(x) = self.pairs[p].iter_mut().find(|x| x.replica == replica) {
                return count(&mut x.copies[m]);
            }
            // A third holder: the pair becomes a list.
            let mut list = Vec::with_capacity(3);
            list.extend_from_slice(&self.pairs[p]);
            let at = list.partition_point(|x: &Holder| x.replica < replica);
            list.insert(at, new);
            self.release_pair(p);
            *h = Holder::handle(self.alloc(list));
            return Added::NewHolder;
        }
        let list = &mut self.lists[index];
        match list.binary_search_by_key(&replica, |x| x.replica) {
            Ok(i) => count(&mut list[i].copies[m]),
            Err(i) => {
                list.insert(i, Holder::one(replica, medium));
                Added::NewHolder
            }
        }
    }

    /// Removes `n` copies (at most all) held by `replica` in `medium`.
    pub(crate) fn remove(&mut self, h: &mut Holder, replica: ReplicaId, medium: Medium, n: u16) -> Removal {
        let m = medium.index();
        let none = Removal { left: 0, replica_gone: false, block_empty: false };
        if h.replica == replica {
            h.copies[m] = h.copies[m].saturating_sub(n);
            let gone = h.copies == [0, 0];
            return Removal { left: h.copies[m], replica_gone: gone, block_empty: gone };
        }
        if h.replica != MANY {
            return none;
        }
        let index = h.list_index();
        if index & PAIR_BIT as usize != 0 {
            let p = index & !(PAIR_BIT as usize);
            let Some(k) = self.pairs[p].iter().position(|x| x.replica == replica) else { return none };
            let x = &mut self.pairs[p][k];
            x.copies[m] = x.copies[m].saturating_sub(n);
            let left = x.copies[m];
            if x.copies != [0, 0] {
                return Removal { left, replica_gone: false, block_empty: false };
            }
            // The other holder is left: inline again.
            *h = self.pairs[p][1 - k];
            self.release_pair(p);
            return Removal { left: 0, replica_gone: true, block_empty: false };
        }
        let list = &mut self.lists[index];
        let Ok(i) = list.binary_search_by_key(&replica, |x| x.replica) else { return none };
        list[i].copies[m] = list[i].copies[m].saturating_sub(n);
        let left = list[i].copies[m];
        if list[i].copies != [0, 0] {
            return Removal { left, replica_gone: false, block_empty: false };
        }
        list.remove(i);
        if let [a, b] = list[..] {
            // Two left: a pair again.
            self.release(index);
            *h = Holder::handle(self.alloc_pair([a, b]) | PAIR_BIT);
        }
        Removal { left: 0, replica_gone: true, block_empty: false }
    }

    /// Sets `h`'s "same as previous" mark: true when both are handles whose lists hold the same
    /// replicas in the same media (copy counts aside). A query then reuses the previous
    /// block's list and skips this one's: on a prefix many replicas share, each block would
    /// otherwise cost a cache miss on its own list.
    pub(crate) fn refresh_same(&self, previous: Option<&Holder>, h: &mut Holder) {
        if h.replica != MANY {
            return;
        }
        let same = previous.is_some_and(|p| {
            p.replica == MANY && {
                let (a, b) = (self.slice(p), self.slice(h));
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.replica == y.replica && x.media() == y.media())
            }
        });
        let index = h.list_index() as u32 | if same { SAME_BIT } else { 0 };
        *h = Holder::handle(index);
    }

    /// Heap bytes held by the arena.
    pub(crate) fn heap_bytes(&self) -> usize {
        let lists: usize = self.lists.iter().map(|l| l.capacity() * std::mem::size_of::<Holder>()).sum();
        lists
            + self.lists.capacity() * std::mem::size_of::<Vec<Holder>>()
            + self.free.capacity() * 4
            + self.pairs.capacity() * std::mem::size_of::<[Holder; 2]>()
            + self.free_pairs.capacity() * 4
    }

    fn alloc(&mut self, list: Vec<Holder>) -> u32 {
        put(&mut self.lists, &mut self.free, list)
    }

    fn alloc_pair(&mut self, pair: [Holder; 2]) -> u32 {
        put(&mut self.pairs, &mut self.free_pairs, pair)
    }

    fn release(&mut self, index: usize) {
        take(&mut self.lists, &mut self.free, index);
    }

    fn release_pair(&mut self, index: usize) {
        take(&mut self.pairs, &mut self.free_pairs, index);
    }
}

/// Stores `item` in `table`, in a slot from `free` if one is, and returns its index.
fn put<T>(table: &mut Vec<T>, free: &mut Vec<u32>, item: T) -> u32 {
    match free.pop() {
        Some(i) => {
            table[i as usize] = item;
            i
        }
        None => {
            table.push(item);
            let i = (table.len() - 1) as u32;
            // Checked in release builds too: an index past 2^30 would read as the other kind.
            assert!(i < PAIR_BIT, "2^30 holder lists of one kind");
            i
        }
    }
}

/// Frees `table[index]`; when nothing in `table` is in use any more (e.g. after clears), gives
/// the table and its free list back.
fn take<T: Default>(table: &mut Vec<T>, free: &mut Vec<u32>, index: usize) {
    table[index] = T::default();
    free.push(index as u32);
    if free.len() == table.len() {
        *table = Vec::new();
        *free = Vec::new();
    }
}

#[cfg(test)]
mod tests {
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
    fn a_pair_grows_into_a_list_and_shrinks_back_into_a_pair() {
        let mut arena = Arena::default();
        let mut h = Holder::one(ReplicaId(4), Medium::Gpu);
        arena.add(&mut h, ReplicaId(8), Medium::Gpu);
        assert_eq!((arena.pairs.len(), arena.lists.len()), (1, 0));
        assert_eq!(arena.add(&mut h, ReplicaId(8), Medium::Cpu), Added::Copy, "a pair counts copies in place");
        assert_eq!(arena.add(&mut h, ReplicaId(6), Medium::Gpu), Added::NewHolder);
        let held = |a: &Arena, h: &Holder| a.slice(h).iter().map(|x| (x.replica.0, x.copies)).collect::<Vec<_>>();
        assert_eq!(held(&arena, &h), vec![(4, [1, 0]), (6, [1, 0]), (8, [1, 1])]);
        assert_eq!(h.list_index(), 0, "three holders: a list, the pair freed");
        assert_eq!((arena.pairs.len(), arena.lists.len()), (0, 1));
        arena.remove(&mut h, ReplicaId(4), Medium::Gpu, 1);
        assert_eq!(held(&arena, &h), vec![(6, [1, 0]), (8, [1, 1])]);
        assert_eq!(h.list_index(), PAIR_BIT as usize, "two left: a pair again");
        assert_eq!((arena.pairs.len(), arena.lists.len()), (1, 0));
        let unknown = arena.remove(&mut h, ReplicaId(7), Medium::Gpu, 1);
        assert_eq!(unknown, Removal { left: 0, replica_gone: false, block_empty: false });
        let r = arena.remove(&mut h, ReplicaId(8), Medium::Gpu, 1);
        assert_eq!(r, Removal { left: 0, replica_gone: false, block_empty: false }, "8 still holds a CPU copy");
        arena.remove(&mut h, ReplicaId(8), Medium::Cpu, 1);
        assert_eq!(h, Holder { replica: ReplicaId(6), copies: [1, 0] }, "one left: inline");
        assert_eq!((arena.pairs.len(), arena.free_pairs.len()), (0, 0));
    }
}
