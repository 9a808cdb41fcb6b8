//! Where the index keeps its blocks: chains stored contiguously, so a query walks memory in
//! order instead of probing a hash table once per block.
//!
//! A [`Segment`] is a run of blocks in which block `i + 1`'s parent is block `i`, each slot
//! holding the block's kvmesh hash and its holders. Every block sits at exactly one
//! [`Pos`]: right after its parent in the parent's segment, or at offset 0 of a segment of
//! its own, found through `starts` (first block hash → segment). Block hashes are chained, so a
//! hash names its whole prefix and `starts` needs no parent in its key. Segments never split
//! or move: a second child of a block mid-segment starts a segment of its own, so the
//! positions the replicas' engine-id maps point to stay valid while the replica holds the
//! block (copies are counted per engine id, and an id's mapping goes with its last copy). A block nobody holds leaves an empty slot ([`Holder::is_empty`]): popped when it is
//! the segment's last, the whole segment freed (and its id reused) when no slot is held.
//!
//! This is Dynamo's compressed radix tree turned inside out: its edges are found by walking
//! from the root and split when a branch appears mid-edge (ai-dynamo/dynamo
//! `lib/kv-router/src/indexer/radix_tree.rs`); here a branch is one more entry in `starts`.

use super::holders::Holder;
use super::table::Table;

/// Slots per segment at most (offsets fit the engine-id maps' 24 bits); a longer chain goes
/// on in a segment of its own.
pub(crate) const MAX_SEGMENT: usize = 1 << 24;

/// A block's place: segment id and offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pos {
    pub(crate) seg: u32,
    pub(crate) off: u32,
}

/// One block in a segment: 16 bytes.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Slot {
    /// The block's kvmesh hash (`BlockHash.0`).
    pub(crate) hash: u64,
    pub(crate) holder: Holder,
}

/// A chain of blocks.
#[derive(Debug, Clone, Default)]
pub(crate) struct Segment {
    pub(crate) slots: Vec<Slot>,
    /// Slots whose holder is not empty.
    live: u32,
}

/// Every segment, the free ids, and the first-block index.
#[derive(Debug, Clone)]
pub(crate) struct Segments {
    segs: Vec<Segment>,
    free: Vec<u32>,
    /// First block hash → segment id, for every live segment.
    starts: Table<u32>,
    /// Slots held, over all segments (distinct blocks in the index).
    live: usize,
}

impl Segments {
    pub(crate) fn with_seed(seed: u64) -> Self {
        Segments { segs: Vec::new(), free: Vec::new(), starts: Table::with_seed(seed), live: 0 }
    }

    /// Distinct blocks held by anyone.
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    #[inline]
    pub(crate) fn slot(&self, p: Pos) -> &Slot {
        &self.segs[p.seg as usize].slots[p.off as usize]
    }

    /// The slots after `p` in its segment (the blocks that continue `p`'s chain in place).
    #[inline]
    pub(crate) fn after(&self, p: Pos) -> &[Slot] {
        let slots = &self.segs[p.seg as usize].slots;
        slots.get(p.off as usize + 1..).unwrap_or(&[])
    }

    #[inline]
    pub(crate) fn holder_mut(&mut self, p: Pos) -> &mut Holder {
        &mut self.segs[p.seg as usize].slots[p.off as usize].holder
    }

    /// The holder at `p` and a copy of the one before it in the segment (`None` at offset 0);
    /// `None` when `p` is past the segment's end.
    pub(crate) fn with_previous(&mut self, p: Pos) -> Option<(Option<Holder>, &mut Holder)> {
        let slots = &mut self.segs.get_mut(p.seg as usize)?.slots;
        let off = p.off as usize;
        let previous = off.checked_sub(1).and_then(|o| slots.get(o)).map(|s| s.holder);
        Some((previous, &mut slots.get_mut(off)?.holder))
    }

    /// The position of block `hash` whose parent is at `parent` (`None`: a first block),
    /// `None` when the index has no such block. What a query walks with.
    #[inline]
    pub(crate) fn next(&self, parent: Option<Pos>, hash: u64) -> Option<Pos> {
        if let Some(p) = parent {
            if let Some(s) = self.segs[p.seg as usize].slots.get(p.off as usize + 1) {
                if s.hash == hash {
                    return Some(Pos { seg: p.seg, off: p.off + 1 });
                }
            }
        }
        self.starts.get(hash).map(|&seg| Pos { seg, off: 0 })
    }

    /// The position of block `hash` after `parent`, making a slot for it when absent (at the
    /// end of the parent's segment when the parent is its last slot, else in a new segment of
    /// `reserve` slots' room). A new slot is empty: the caller adds a holder at once.
    pub(crate) fn locate_or_insert(&mut self, parent: Option<Pos>, hash: u64, reserve: usize) -> Pos {
        if let Some(p) = self.next(parent, hash) {
            return p;
        }
        if let Some(p) = parent {
            let seg = &mut self.segs[p.seg as usize];
            if p.off as usize + 1 == seg.slots.len() && seg.slots.len() < MAX_SEGMENT {
                if seg.slots.len() == seg.slots.capacity() {
                    // The rest of the event, and at least a quarter more: chains built a block
                    // at a time (decode) grow in amortised constant time.
                    seg.slots.reserve_exact(reserve.max(seg.slots.len() / 4).max(1));
                }
                seg.slots.push(Slot { hash, holder: Holder::default() });
                return Pos { seg: p.seg, off: p.off + 1 };
            }
        }
        let mut slots = Vec::with_capacity(reserve.max(1));
        slots.push(Slot { hash, holder: Holder::default() });
        let segment = Segment { slots, live: 0 };
        let seg = match self.free.pop() {
            Some(id) => {
                self.segs[id as usize] = segment;
                id
            }
            None => {
                self.segs.push(segment);
                (self.segs.len() - 1) as u32
            }
        };
        self.starts.insert(hash, seg);
        Pos { seg, off: 0 }
    }

    /// Reads the first-block index's slot for `hash` ahead of a lookup (see `Table::touch`).
    #[inline]
    pub(crate) fn touch_start(&self, hash: u64) -> u64 {
        self.starts.touch(hash)
    }

    /// Counts a slot that just got its first holder.
    pub(crate) fn occupied(&mut self, p: Pos) {
        self.segs[p.seg as usize].live += 1;
        self.live += 1;
    }

    /// Counts a slot whose last holder just left (its holder must be empty now): pops empty
    /// slots off the segment's end, frees the segment when nothing in it is held.
    pub(crate) fn vacated(&mut self, p: Pos) {
        self.live -= 1;
        let seg = &mut self.segs[p.seg as usize];
        seg.live -= 1;
        if seg.live == 0 {
            let first = seg.slots[0].hash;
            *seg = Segment::default();
            self.starts.remove(first);
            self.free.push(p.seg);
            if self.free.len() == self.segs.len() {
                // Nothing held at all: give the segment table back too.
                self.segs = Vec::new();
                self.free = Vec::new();
            }
            return;
        }
        while seg.slots.last().is_some_and(|s| s.holder.is_empty()) {
            seg.slots.pop();
        }
        if seg.slots.capacity() > 2 * seg.slots.len() + 8 {
            seg.slots.shrink_to_fit();
        }
    }

    /// Heap bytes: segment table, slots, free list, first-block index.
    pub(crate) fn heap_bytes(&self) -> usize {
        let slots: usize = self.segs.iter().map(|s| s.slots.capacity() * std::mem::size_of::<Slot>()).sum();
        slots
            + self.segs.capacity() * std::mem::size_of::<Segment>()
            + self.free.capacity() * 4
            + self.starts.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Medium, ReplicaId};

    fn held(s: &mut Segments, p: Pos) {
        *s.holder_mut(p) = Holder::one(ReplicaId(0), Medium::Gpu);
        s.occupied(p);
    }

    fn empty(s: &mut Segments, p: Pos) {
        *s.holder_mut(p) = Holder::default();
        s.vacated(p);
    }

    #[test]
    fn chains_extend_in_place_and_branches_start_segments() {
        assert_eq!(std::mem::size_of::<Slot>(), 16);
        let mut s = Segments::with_seed(0);
        let a = s.locate_or_insert(None, 10, 4);
        held(&mut s, a);
        let b = s.locate_or_insert(Some(a), 11, 4);
        held(&mut s, b);
        let c = s.locate_or_insert(Some(b), 12, 4);
        held(&mut s, c);
        assert_eq!((a, b, c), (Pos { seg: 0, off: 0 }, Pos { seg: 0, off: 1 }, Pos { seg: 0, off: 2 }));
        // A second child of 11 starts segment 1; walking finds both children.
        let d = s.locate_or_insert(Some(b), 13, 1);
        held(&mut s, d);
        assert_eq!(d, Pos { seg: 1, off: 0 });
        assert_eq!((s.next(Some(b), 12), s.next(Some(b), 13), s.next(Some(b), 14)), (Some(c), Some(d), None));
        assert_eq!(s.locate_or_insert(Some(b), 13, 1), d, "an existing block is found, not duplicated");
        assert_eq!(s.live(), 4);
        // The tail empties and is popped; then re-storing it appends again.
        empty(&mut s, c);
        assert_eq!(s.segs[0].slots.len(), 2);
        assert_eq!(s.locate_or_insert(Some(b), 12, 1), c);
        // A segment with nothing held is freed and its id reused.
        empty(&mut s, d);
        assert_eq!((s.next(Some(b), 13), s.free.clone()), (None, vec![1]));
        assert_eq!(s.locate_or_insert(None, 20, 1), Pos { seg: 1, off: 0 });
    }
}
