//! Choosing among scored replicas with random tie-breaks (case C10: ties never go to the
//! first replica).

use rand::{Rng, RngCore};

/// The position with the lowest score, uniformly at random among those within `tolerance` of
/// the lowest (`score ≤ min + tolerance`; use 0.0 for exact ties). `None` when empty.
pub(crate) fn lowest(scores: &[(usize, f64)], tolerance: f64, rng: &mut dyn RngCore) -> Option<usize> {
    let min = scores.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
    pick_where(scores, |s| s <= min + tolerance, rng)
}

/// The position with the highest score, uniformly at random among exact ties.
pub(crate) fn highest(scores: &[(usize, f64)], rng: &mut dyn RngCore) -> Option<usize> {
    let max = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
    pick_where(scores, |s| s >= max, rng)
}

/// Uniform choice among the entries whose score passes `keep`: count them, draw one index,
/// walk to it (one random draw however many tie).
fn pick_where(scores: &[(usize, f64)], keep: impl Fn(f64) -> bool, rng: &mut dyn RngCore) -> Option<usize> {
    let n = scores.iter().filter(|s| keep(s.1)).count();
    if n == 0 {
        return None;
    }
    let k = if n == 1 { 0 } else { rng.random_range(0..n) };
    scores.iter().filter(|s| keep(s.1)).nth(k).map(|s| s.0)
}

/// Two distinct positions of `candidates` at random (the same one twice if only one).
pub(crate) fn two(candidates: &[usize], rng: &mut dyn RngCore) -> (usize, usize) {
    let n = candidates.len();
    let a = rng.random_range(0..n);
    if n == 1 {
        return (candidates[a], candidates[a]);
    }
    let mut b = rng.random_range(0..n - 1);
    if b >= a {
        b += 1;
    }
    (candidates[a], candidates[b])
}

/// The position with the lowest key, the first one among equals: the tie-break of peers that
/// take `min_by_key` over their worker list (kvmesh's own policy never does, case C10).
pub(crate) fn first_lowest<K: Ord + Copy>(scores: &[(usize, K)]) -> Option<usize> {
    scores.iter().min_by_key(|s| s.1).map(|s| s.0)
}
