//! Overlap: how many leading blocks of a request a replica already holds, and the one-pass
//! longest-leading-run computation shared by the prefix index and the routing record.

use crate::ids::ReplicaId;

/// Leading blocks of one request that one replica holds, per medium, in blocks of `block_size`
/// tokens. `gpu` and `cpu` are each the longest run from the first block held in that medium.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Leading blocks held in GPU memory.
    pub gpu: u32,
    /// Leading blocks held in CPU (offload) memory.
    pub cpu: u32,
}

impl Overlap {
    /// An overlap of `blocks` GPU blocks and no CPU blocks.
    pub fn gpu(blocks: u32) -> Self {
        Overlap { gpu: blocks, cpu: 0 }
    }
}

/// One replica's entry in one block's holder list, as seen by [`leading_runs`].
pub(crate) trait Holding {
    fn replica(&self) -> ReplicaId;
}

#[derive(Clone, Copy)]
struct Run {
    replica: ReplicaId,
    alive: [bool; 2],
    len: [u32; 2],
}

/// Computes, for each replica holding the first block, its longest leading run per medium over
/// `blocks`, appending `(replica, overlap)` sorted by replica id to `out` (replicas that hold
/// nothing are left out). `holders(i)` gives block `i`'s holders sorted by replica id, or `None`
/// when nobody holds it; `is_held(h)` says whether holder `h` counts, as `[GPU, CPU]`.
///
/// One pass: a shrinking set of replicas still matching is intersected with each block's
/// holders (merge, or binary search when the set is much smaller), and the walk stops as soon
/// as that set is empty. Cost is O(Σ min(active, holders)) over the blocks actually matched.
pub(crate) fn leading_runs<'a, H, F, G>(
    n_blocks: usize,
    mut holders: F,
    is_held: G,
    out: &mut Vec<(ReplicaId, Overlap)>,
) where
    H: Holding + 'a,
    F: FnMut(usize) -> Option<&'a [H]>,
    G: Fn(&H) -> [bool; 2],
{
    if n_blocks == 0 {
        return;
    }
    let Some(first) = holders(0) else { return };
    let mut active: Vec<Run> = first
        .iter()
        .filter_map(|h| {
            let held = is_held(h);
            (held[0] || held[1]).then(|| Run {
                replica: h.replica(),
                alive: held,
                len: [held[0] as u32, held[1] as u32],
            })
        })
        .collect();
    let start = out.len();
    for i in 1..n_blocks {
        if active.is_empty() {
            break;
        }
        let hs = holders(i).unwrap_or(&[]);
        let mut j = 0;
        active.retain_mut(|run| {
            let held = if active_is_small(hs.len()) {
                // Merge: both lists are sorted by replica id.
                while j < hs.len() && hs[j].replica() < run.replica {
                    j += 1;
                }
                match hs.get(j) {
                    Some(h) if h.replica() == run.replica => is_held(h),
                    _ => [false, false],
                }
            } else {
                match hs.binary_search_by_key(&run.replica, |h| h.replica()) {
                    Ok(k) => is_held(&hs[k]),
                    Err(_) => [false, false],
                }
            };
            for m in 0..2 {
                run.alive[m] &= held[m];
                run.len[m] += run.alive[m] as u32;
            }
            if run.alive[0] || run.alive[1] {
                true
            } else {
                out.push((run.replica, Overlap { gpu: run.len[0], cpu: run.len[1] }));
                false
            }
        });
    }
    out.extend(active.iter().map(|r| (r.replica, Overlap { gpu: r.len[0], cpu: r.len[1] })));
    out[start..].sort_unstable_by_key(|(r, _)| *r);
}

/// Merge while the holder list is not much longer than a typical active set; beyond that a
/// binary search per active replica touches fewer holders.
#[inline]
fn active_is_small(holders: usize) -> bool {
    holders <= 64
}

#[cfg(test)]
mod tests {
    use super::*;

    struct H(u32, [bool; 2]);
    impl Holding for H {
        fn replica(&self) -> ReplicaId {
            ReplicaId(self.0)
        }
    }

    #[test]
    fn runs_per_medium_stop_at_first_gap() {
        let g = [true, false];
        let both = [true, true];
        let blocks: Vec<Vec<H>> = vec![
            vec![H(0, both), H(1, g), H(2, [false, true])],
            vec![H(0, g), H(1, g), H(2, [false, true])],
            vec![H(0, both), H(2, [false, true])],
            vec![H(0, g), H(1, g)],
        ];
        let mut out = Vec::new();
        leading_runs(4, |i| blocks.get(i).map(|v| v.as_slice()), |h| h.1, &mut out);
        assert_eq!(
            out,
            vec![
                (ReplicaId(0), Overlap { gpu: 4, cpu: 1 }),
                (ReplicaId(1), Overlap { gpu: 2, cpu: 0 }),
                (ReplicaId(2), Overlap { gpu: 0, cpu: 3 }),
            ]
        );
    }

    #[test]
    fn long_holder_lists_use_binary_search_with_same_result() {
        let many: Vec<H> = (0..200).map(|r| H(r, [true, false])).collect();
        let second: Vec<H> = (0..200).filter(|r| r % 2 == 0).map(|r| H(r, [true, false])).collect();
        let blocks = [many, second];
        let mut out = Vec::new();
        leading_runs(2, |i| blocks.get(i).map(|v| v.as_slice()), |h| h.1, &mut out);
        assert_eq!(out.len(), 200);
        assert_eq!(out[0], (ReplicaId(0), Overlap::gpu(2)));
        assert_eq!(out[1], (ReplicaId(1), Overlap::gpu(1)));
    }
}
