//! The replicas holding one block: 8 bytes inline for the common single holder, a shared list
//! in an arena for blocks several replicas hold.
//!
//! A [`Holder`] is either one replica's copy counts or, when its replica field is [`MANY`], a
//! handle to a list in the [`Arena`] (sorted by replica id). Keeping the map value at 8 bytes
//! keeps each segment slot (block hash and holder) at 16 bytes — the index's memory is
//! dominated by these slots and the engine-id maps.

use crate::ids::{Medium, ReplicaId};
use crate::overlap::{Holding, CPU_BIT, GPU_BIT};

/// The replica-field marker of a handle to an arena list. Fleets never assign this id.
pub(crate) const MANY: ReplicaId = ReplicaId(u32::MAX);

/// In a handle's index: "the previous slot's list is equal" (lists number below 2^31).
const SAME_BIT: u32 = 1 << 31;

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

/// Shared holder lists, reused through a free list.
#[derive(Debug, Clone, Default)]
pub(crate) struct Arena {
    lists: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

impl Arena {
    /// The holders `h` stands for, sorted by replica id.
    #[inline]
    pub(crate) fn slice<'a>(&'a self, h: &'a Holder) -> &'a [Holder] {
        if h.replica == MANY {
            &self.lists[h.list_index()]
        } else {
            std::slice::from_ref(h)
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
        if h.replica != MANY {
            let new = Holder::one(replica, medium);
            let list = if h.replica < replica { vec![*h, new] } else { vec![new, *h] };
            *h = Holder::handle(self.alloc(list));
            return Added::NewHolder;
        }
        let list = &mut self.lists[h.list_index()];
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
        let list = &mut self.lists[index];
        let Ok(i) = list.binary_search_by_key(&replica, |x| x.replica) else { return none };
        list[i].copies[m] = list[i].copies[m].saturating_sub(n);
        let left = list[i].copies[m];
        if list[i].copies != [0, 0] {
            return Removal { left, replica_gone: false, block_empty: false };
        }
        list.remove(i);
        if list.len() == 1 {
            *h = list[0];
            self.release(index);
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
        lists + self.lists.capacity() * std::mem::size_of::<Vec<Holder>>() + self.free.capacity() * 4
    }

    fn alloc(&mut self, list: Vec<Holder>) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.lists[i as usize] = list;
                i
            }
            None => {
                self.lists.push(list);
                (self.lists.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, index: usize) {
        self.lists[index] = Vec::new();
        self.free.push(index as u32);
        if self.free.len() == self.lists.len() {
            // Nothing shared any more (e.g. after clears): give the handle table back too.
            self.lists = Vec::new();
            self.free = Vec::new();
        }
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
        let r = arena.remove(&mut h, ReplicaId(9), Medium::Cpu, u16::MAX);
        assert_eq!(r, Removal { left: 0, replica_gone: true, block_empty: true });
        // A new list starts the table again.
        let mut g = Holder::one(ReplicaId(1), Medium::Gpu);
        arena.add(&mut g, ReplicaId(3), Medium::Gpu);
        assert_eq!((g.replica, g.list_index()), (MANY, 0));
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
}
