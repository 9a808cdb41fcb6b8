//! The replicas holding one block: a compact, replica-sorted list with per-medium copy counts.
//!
//! Most blocks are held by one replica, so one holder is stored inline (16 bytes in all) and
//! only shared blocks pay for a heap list.

use crate::ids::{Medium, ReplicaId};
use crate::overlap::Holding;

/// One replica's copies of one block, per medium.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) replica: ReplicaId,
    /// Copies held, `[GPU, CPU]`. Engines may hold several physical copies (case C20).
    pub(crate) copies: [u16; 2],
}

impl Holding for Holder {
    #[inline]
    fn replica(&self) -> ReplicaId {
        self.replica
    }
}

impl Holder {
    /// Whether the block is held, as `[GPU, CPU]`.
    #[inline]
    pub(crate) fn held(&self) -> [bool; 2] {
        [self.copies[0] > 0, self.copies[1] > 0]
    }
}

/// The holders of one block, sorted by replica id; never empty while in the index.
#[derive(Debug, Clone)]
pub(crate) enum Holders {
    One([Holder; 1]),
    Many(Box<Vec<Holder>>),
}

impl Holders {
    pub(crate) fn new(replica: ReplicaId, medium: Medium) -> Self {
        let mut copies = [0; 2];
        copies[medium.index()] = 1;
        Holders::One([Holder { replica, copies }])
    }

    #[inline]
    pub(crate) fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::One(h) => h,
            Holders::Many(v) => v,
        }
    }

    /// Adds one copy for `replica` in `medium`; returns true when the replica is a new holder.
    pub(crate) fn add(&mut self, replica: ReplicaId, medium: Medium) -> bool {
        let m = medium.index();
        match self {
            Holders::One([h]) if h.replica == replica => {
                h.copies[m] = h.copies[m].saturating_add(1);
                false
            }
            Holders::One([h]) => {
                let mut copies = [0; 2];
                copies[m] = 1;
                let new = Holder { replica, copies };
                let v = if h.replica < replica { vec![*h, new] } else { vec![new, *h] };
                *self = Holders::Many(Box::new(v));
                true
            }
            Holders::Many(v) => match v.binary_search_by_key(&replica, |h| h.replica) {
                Ok(i) => {
                    v[i].copies[m] = v[i].copies[m].saturating_add(1);
                    false
                }
                Err(i) => {
                    let mut copies = [0; 2];
                    copies[m] = 1;
                    v.insert(i, Holder { replica, copies });
                    true
                }
            },
        }
    }

    /// Removes `n` copies (at most all) for `replica` in `medium`. Returns `(replica no longer
    /// holds the block at all, list now empty)`.
    pub(crate) fn remove(&mut self, replica: ReplicaId, medium: Medium, n: u32) -> (bool, bool) {
        let m = medium.index();
        match self {
            Holders::One([h]) => {
                if h.replica != replica {
                    return (false, false);
                }
                h.copies[m] = h.copies[m].saturating_sub(n.min(u16::MAX as u32) as u16);
                let gone = h.copies == [0, 0];
                (gone, gone)
            }
            Holders::Many(v) => {
                let Ok(i) = v.binary_search_by_key(&replica, |h| h.replica) else {
                    return (false, false);
                };
                v[i].copies[m] = v[i].copies[m].saturating_sub(n.min(u16::MAX as u32) as u16);
                if v[i].copies != [0, 0] {
                    return (false, false);
                }
                v.remove(i);
                if v.len() == 1 {
                    *self = Holders::One([v[0]]);
                }
                (true, false)
            }
        }
    }

    /// Heap bytes owned beyond the inline slot.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Holders::One(_) => 0,
            Holders::Many(v) => std::mem::size_of::<Vec<Holder>>() + v.capacity() * std::mem::size_of::<Holder>(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_slot_is_16_bytes() {
        assert_eq!(std::mem::size_of::<Holders>(), 16);
    }

    #[test]
    fn add_and_remove_keep_sorted_and_collapse() {
        let mut h = Holders::new(ReplicaId(5), Medium::Gpu);
        assert!(h.add(ReplicaId(2), Medium::Gpu));
        assert!(h.add(ReplicaId(9), Medium::Cpu));
        assert!(!h.add(ReplicaId(5), Medium::Gpu));
        let ids: Vec<u32> = h.as_slice().iter().map(|x| x.replica.0).collect();
        assert_eq!(ids, vec![2, 5, 9]);
        assert_eq!(h.remove(ReplicaId(5), Medium::Gpu, 1), (false, false));
        assert_eq!(h.remove(ReplicaId(5), Medium::Gpu, 1), (true, false));
        assert_eq!(h.remove(ReplicaId(2), Medium::Gpu, 1), (true, false));
        assert!(matches!(h, Holders::One(_)));
        assert_eq!(h.remove(ReplicaId(9), Medium::Cpu, 1), (true, true));
    }
}
