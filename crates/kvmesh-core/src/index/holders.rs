//! The replicas holding one block: 8 bytes inline for the common single holder, a shared list
//! in an arena for blocks several replicas hold — a pair (16 bytes in a table of pairs, the
//! common shared block), a quad of three or four (32 bytes in a table of quads) or a longer
//! list. Pairs and quads are read with one cache miss where a list takes two (its header, then
//! its buffer): a query meets a new list at every branch of a chain.
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
/// number below 2^29).
const PAIR_BIT: u32 = 1 << 30;
/// In a handle's index: the list is a quad (three or four holders), in the table of quads.
const QUAD_BIT: u32 = 1 << 29;

/// Which of the arena's tables a handle's list is in, and where.
enum Kind {
    Pair(usize),
    Quad(usize),
    List(usize),
}

/// Three or four holders, aligned so that one never straddles two cache lines (a `[Holder; 4]`
/// is 4-byte aligned: in a buffer starting mid-line every other one would).
#[derive(Debug, Clone, Copy, Default)]
#[repr(align(32))]
struct Quad([Holder; 4]);

/// The holders a quad holds: three, or four when its last entry is live (a live entry never
/// holds zero copies).
#[inline]
fn quad_len(q: &[Holder; 4]) -> usize {
    3 + (q[3].copies != [0, 0]) as usize
}

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

    /// Where a handle's list is.
    #[inline]
    fn kind(&self) -> Kind {
        let i = self.list_index() as u32;
        let at = (i & !(PAIR_BIT | QUAD_BIT)) as usize;
        if i & PAIR_BIT != 0 {
            Kind::Pair(at)
        } else if i & QUAD_BIT != 0 {
            Kind::Quad(at)
        } else {
            Kind::List(at)
        }
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
/// in `pairs`, three or four 32 bytes in `quads`; a list of five or more a `Vec` in `lists`
/// (24 bytes and its buffer: a pair kept that way cost 40 bytes; BENCHMARKS.md).
#[derive(Debug, Clone, Default)]
pub(crate) struct Arena {
    pairs: Vec<[Holder; 2]>,
    free_pairs: Vec<u32>,
    quads: Vec<Quad>,
    free_quads: Vec<u32>,
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
        match h.kind() {
            Kind::Pair(p) => &self.pairs[p],
            Kind::Quad(q) => {
                let quad = &self.quads[q].0;
                &quad[..quad_len(quad)]
            }
            Kind::List(l) => &self.lists[l],
        }
    }

    /// Adds one copy for `replica` in `medium`; says whether the replica is a new holder, or
    /// already held it and the copy was counted, or was at 65,535 copies there already.
    pub(crate) fn add(&mut self, h: &mut Holder, replica: ReplicaId, medium: Medium) -> Added {
        // An empty holder would enter a list as a dead entry (copies [0, 0]), which a quad's
        // length reads as absent: the caller starts an empty slot with `Holder::one` instead.
        debug_assert!(!h.is_empty(), "Arena::add on an empty holder");
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
        match h.kind() {
            Kind::Pair(p) => {
                if let Some(x) = self.pairs[p].iter_mut().find(|x| x.replica == replica) {
                    return count(&mut x.copies[m]);
                }
                // A third holder: the pair becomes a quad.
                let [a, b] = self.pairs[p];
                let mut three = [a, b, new];
                three.sort_unstable_by_key(|x| x.replica);
                self.release_pair(p);
                let [a, b, c] = three;
                *h = Holder::handle(self.alloc_quad([a, b, c, Holder::default()]) | QUAD_BIT);
                Added::NewHolder
            }
            Kind::Quad(q) => {
                let quad = &mut self.quads[q].0;
                let len = quad_len(quad);
                if let Some(x) = quad[..len].iter_mut().find(|x| x.replica == replica) {
                    return count(&mut x.copies[m]);
                }
                let at = quad[..len].partition_point(|x| x.replica < replica);
                if len == 3 {
                    quad.copy_within(at..3, at + 1);
                    quad[at] = new;
                    return Added::NewHolder;
                }
                // A fifth holder: the quad becomes a list.
                let mut list = Vec::with_capacity(5);
                list.extend_from_slice(quad);
                list.insert(at, new);
                self.release_quad(q);
                *h = Holder::handle(self.alloc(list));
                Added::NewHolder
            }
            Kind::List(l) => {
                let list = &mut self.lists[l];
                match list.binary_search_by_key(&replica, |x| x.replica) {
                    Ok(i) => count(&mut list[i].copies[m]),
                    Err(i) => {
                        list.insert(i, new);
                        Added::NewHolder
                    }
                }
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
        let gone = Removal { left: 0, replica_gone: true, block_empty: false };
        match h.kind() {
            Kind::Pair(p) => {
                let Some(k) = self.pairs[p].iter().position(|x| x.replica == replica) else { return none };
                if let Some(kept) = take_copies(&mut self.pairs[p][k], m, n) {
                    return kept;
                }
                // The other holder is left: inline again.
                *h = self.pairs[p][1 - k];
                self.release_pair(p);
                gone
            }
            Kind::Quad(q) => {
                let quad = &mut self.quads[q].0;
                let len = quad_len(quad);
                let Some(k) = quad[..len].iter().position(|x| x.replica == replica) else { return none };
                if let Some(kept) = take_copies(&mut quad[k], m, n) {
                    return kept;
                }
                quad.copy_within(k + 1..4, k);
                quad[3] = Holder::default();
                if len == 3 {
                    // Two left: a pair again.
                    let pair = [quad[0], quad[1]];
                    self.release_quad(q);
                    *h = Holder::handle(self.alloc_pair(pair) | PAIR_BIT);
                }
                gone
            }
            Kind::List(l) => {
                let list = &mut self.lists[l];
                let Ok(i) = list.binary_search_by_key(&replica, |x| x.replica) else { return none };
                if let Some(kept) = take_copies(&mut list[i], m, n) {
                    return kept;
                }
                list.remove(i);
                if let [a, b, c, d] = list[..] {
                    // Four left: a quad again.
                    self.release(l);
                    *h = Holder::handle(self.alloc_quad([a, b, c, d]) | QUAD_BIT);
                }
                gone
            }
        }
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
            + self.quads.capacity() * std::mem::size_of::<Quad>()
            + self.free_quads.capacity() * 4
    }

    fn alloc(&mut self, list: Vec<Holder>) -> u32 {
        put(&mut self.lists, &mut self.free, list)
    }

    fn alloc_pair(&mut self, pair: [Holder; 2]) -> u32 {
        put(&mut self.pairs, &mut self.free_pairs, pair)
    }

    fn alloc_quad(&mut self, quad: [Holder; 4]) -> u32 {
        put(&mut self.quads, &mut self.free_quads, Quad(quad))
    }

    fn release_quad(&mut self, index: usize) {
        take(&mut self.quads, &mut self.free_quads, index);
    }

    fn release(&mut self, index: usize) {
        take(&mut self.lists, &mut self.free, index);
    }

    fn release_pair(&mut self, index: usize) {
        take(&mut self.pairs, &mut self.free_pairs, index);
    }
}

/// Takes `n` copies in medium `m` from a list's entry `x`: the removal when the replica still
/// holds the block (in either medium), `None` when it just let go of it (the entry must leave).
fn take_copies(x: &mut Holder, m: usize, n: u16) -> Option<Removal> {
    x.copies[m] = x.copies[m].saturating_sub(n);
    (x.copies != [0, 0]).then_some(Removal { left: x.copies[m], replica_gone: false, block_empty: false })
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
            // Checked in release builds too: an index past 2^29 would read as another kind.
            assert!(i < QUAD_BIT, "2^29 holder lists of one kind");
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
mod tests;
