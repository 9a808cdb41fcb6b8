//! Overlap: how many leading blocks of a request a replica already holds, and the one-pass
//! longest-leading-run computation ([`Runs`]) the prefix index walks with.

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

/// One replica's entry in one block's holder list, as seen by [`Runs`].
pub(crate) trait Holding {
    fn replica(&self) -> ReplicaId;
}

/// Media as bits of a mask: bit 0 GPU, bit 1 CPU.
pub(crate) const GPU_BIT: u8 = 1;
/// See [`GPU_BIT`].
pub(crate) const CPU_BIT: u8 = 2;

/// One replica's runs while the walk goes on. A run that ends at block `i` has length `i`
/// (every run starts at block 0), so only the end is written, once.
#[derive(Clone, Copy)]
struct Run {
    replica: ReplicaId,
    /// Media whose run is still going, as [`GPU_BIT`] | [`CPU_BIT`].
    alive: u8,
    len: [u32; 2],
}

impl Run {
    fn overlap(&self, blocks_walked: u32) -> Overlap {
        let len = |m: usize| if self.alive & (1 << m) != 0 { blocks_walked } else { self.len[m] };
        Overlap { gpu: len(0), cpu: len(1) }
    }
}

thread_local! {
    /// Each thread's run list between walks (readers query the index from many threads at
    /// once, so it cannot live in the index). A query allocated its list and freed it:
    /// measured on a heap holding a million-entry index, that malloc and free were up to half
    /// of a query's time. A walk that ends without [`Runs::finish`] just drops its list.
    static SCRATCH: std::cell::Cell<Vec<Run>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Each replica's runs during one walk over a request's blocks: start with the first block's
/// holders, [`Runs::step`] each later block's (in order), [`Runs::finish`] where the walk
/// stopped. A shrinking set of replicas still matching is intersected with each block's
/// holders (merge, or binary search when the holder list is much longer than the set); the
/// walk can stop as soon as [`Runs::is_done`].
pub(crate) struct Runs {
    active: Vec<Run>,
    start: usize,
}

impl Runs {
    /// Runs for every holder of the first block (`held(h)`: the media `h` holds it in, as a
    /// mask of [`GPU_BIT`] and [`CPU_BIT`]); `out` is where ended runs go.
    pub(crate) fn start<H: Holding>(first: &[H], held: impl Fn(&H) -> u8, out: &[(ReplicaId, Overlap)]) -> Self {
        // The run list of this thread's previous walk, reused: an allocation per query cost
        // as much as the walk on a large heap (see `SCRATCH`).
        let mut active = SCRATCH.try_with(std::cell::Cell::take).unwrap_or_default();
        active.clear();
        active.extend(first.iter().filter_map(|h| {
            let alive = held(h);
            (alive != 0).then(|| Run { replica: h.replica(), alive, len: [0, 0] })
        }));
        Runs { active, start: out.len() }
    }

    /// Whether every run has ended.
    #[inline]
    pub(crate) fn is_done(&self) -> bool {
        self.active.is_empty()
    }

    /// Matches block number `block` (holders `hs`, sorted by replica id) against every run.
    #[inline]
    pub(crate) fn step<H: Holding, G: Fn(&H) -> u8>(
        &mut self,
        hs: &[H],
        block: u32,
        held: &G,
        out: &mut Vec<(ReplicaId, Overlap)>,
    ) {
        step(&mut self.active, hs, block, held, out);
    }

    /// Ends the walk after `walked` blocks: the runs still going have that length. Appends
    /// every replica's overlap to `out`, sorted by replica id.
    pub(crate) fn finish(self, walked: u32, out: &mut Vec<(ReplicaId, Overlap)>) {
        out.extend(self.active.iter().map(|r| (r.replica, r.overlap(walked))));
        // (A thread being torn down has no scratch left: the list is just dropped.)
        let _ = SCRATCH.try_with(|s| s.set(self.active));
        // `out` holds stretches already in id order (each step's ended runs, then the live
        // ones): std's stable sort finds the long ones and merges, where the unstable sort
        // partitioned everything again — at 1,024 replicas sharing a system prompt, most of
        // the answer is one stretch, and the sort was two thirds of a decision's index query.
        // (Past ~341 entries it takes a heap scratch buffer.) Ids are distinct, so both give
        // the same order.
        out[self.start..].sort_by_key(|(r, _)| *r);
    }
}

/// [`Runs`] over `n_blocks` blocks whose holders `holders(i)` gives (`None`: nobody holds
/// block `i`), for the tests of the run logic.
#[cfg(test)]
fn leading_runs<'a, H, F, G>(n_blocks: usize, mut holders: F, held: G, out: &mut Vec<(ReplicaId, Overlap)>)
where
    H: Holding + 'a,
    F: FnMut(usize) -> Option<&'a [H]>,
    G: Fn(&H) -> u8,
{
    if n_blocks == 0 {
        return;
    }
    let Some(first) = holders(0) else { return };
    let mut runs = Runs::start(first, &held, out);
    let mut i = 1;
    while i < n_blocks && !runs.is_done() {
        runs.step(holders(i).unwrap_or(&[]), i as u32, &held, out);
        i += 1;
    }
    runs.finish(i as u32, out);
}

/// Matches block `block` (holders `hs`) against every active run; runs that end there go to
/// `out` with their lengths. Runs that go on are not written to: the common case (the same
/// replicas hold the next block too) is a read-only, well-predicted loop.
#[inline]
fn step<H: Holding, G: Fn(&H) -> u8>(
    active: &mut Vec<Run>,
    hs: &[H],
    block: u32,
    held: &G,
    out: &mut Vec<(ReplicaId, Overlap)>,
) {
    // Fast path: the same replicas hold this block as the last one (a shared prefix), in every
    // medium still running — then no run changes. One branch-free pass decides it.
    if hs.len() == active.len() {
        let unchanged = active
            .iter()
            .zip(hs)
            .fold(true, |ok, (run, h)| ok & (h.replica() == run.replica) & (held(h) & run.alive == run.alive));
        if unchanged {
            return;
        }
    }
    let merge = hs.len() <= 8 * active.len();
    let (mut j, mut kept) = (0, 0);
    for k in 0..active.len() {
        let run = active[k];
        let media = if merge {
            // Both lists are sorted by replica id.
            while j < hs.len() && hs[j].replica() < run.replica {
                j += 1;
            }
            match hs.get(j) {
                Some(h) if h.replica() == run.replica => held(h),
                _ => 0,
            }
        } else {
            match hs.binary_search_by_key(&run.replica, |h| h.replica()) {
                Ok(i) => held(&hs[i]),
                Err(_) => 0,
            }
        };
        let alive = run.alive & media;
        if alive == run.alive {
            active[kept] = run;
            kept += 1;
            continue;
        }
        let mut next = run;
        let ended = run.alive & !alive;
        for m in 0..2 {
            if ended & (1 << m) != 0 {
                next.len[m] = block;
            }
        }
        next.alive = alive;
        if alive != 0 {
            active[kept] = next;
            kept += 1;
        } else {
            out.push((run.replica, next.overlap(block)));
        }
    }
    active.truncate(kept);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
    struct H(u32, [bool; 2]);

    fn mask(held: [bool; 2]) -> u8 {
        (held[0] as u8 * GPU_BIT) | (held[1] as u8 * CPU_BIT)
    }
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
        leading_runs(4, |i| blocks.get(i).map(|v| v.as_slice()), |h| mask(h.1), &mut out);
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
    fn runs_ending_in_waves_come_out_in_replica_order_after_what_was_there() {
        // Replicas 0, 2, 4 end at block 1, then 1 and 3 at block 2, and 5 runs to the end:
        // three sorted stretches, merged into one order; an entry already in `out` stays put.
        let g = [true, false];
        let blocks: Vec<Vec<H>> =
            vec![(0..6).map(|r| H(r, g)).collect(), vec![H(1, g), H(3, g), H(5, g)], vec![H(5, g)], vec![H(5, g)]];
        let mut out = vec![(ReplicaId(99), Overlap::gpu(7))];
        leading_runs(4, |i| blocks.get(i).map(|v| v.as_slice()), |h| mask(h.1), &mut out);
        let gpu: Vec<(u32, u32)> = out.iter().map(|(r, o)| (r.0, o.gpu)).collect();
        assert_eq!(gpu, vec![(99, 7), (0, 1), (1, 2), (2, 1), (3, 2), (4, 1), (5, 4)]);
    }

    #[test]
    fn merge_and_binary_search_agree() {
        // Few active runs against a long holder list takes the binary-search path; many active
        // runs the merge path. Both must give the same runs.
        let g = [true, false];
        let first: Vec<H> = vec![H(3, g), H(150, g)];
        let long: Vec<H> = (0..200).filter(|r| r % 2 == 0).map(|r| H(r, g)).collect();
        let blocks = [first, long.clone(), long];
        let mut out = Vec::new();
        leading_runs(3, |i| blocks.get(i).map(|v| v.as_slice()), |h| mask(h.1), &mut out);
        assert_eq!(out, vec![(ReplicaId(3), Overlap::gpu(1)), (ReplicaId(150), Overlap::gpu(3))]);
        let all: Vec<H> = (0..200).map(|r| H(r, g)).collect();
        let blocks = [all, blocks[1].clone()];
        out.clear();
        leading_runs(2, |i| blocks.get(i).map(|v| v.as_slice()), |h| mask(h.1), &mut out);
        assert_eq!(out.len(), 200);
        assert_eq!((out[0], out[1]), ((ReplicaId(0), Overlap::gpu(2)), (ReplicaId(1), Overlap::gpu(1))));
    }
}
