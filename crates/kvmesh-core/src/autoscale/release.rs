//! Which replicas a scale-down releases.
//!
//! A scale-down from `n` to `m` replicas (ready and starting together) releases `n − m` of
//! them by draining: no new requests, in-flight ones finish, then the replica goes. Which ones
//! matter: releasing a replica throws away its KV cache (the prefixes routed to it) and makes
//! its in-flight requests hold up the release. So, in this order:
//!
//! 1. **starting** replicas first, the newest first: they serve nothing yet and hold no
//!    cache, and cancelling the newest start saves the most cold start;
//! 2. then ready replicas with the **fewest requests in flight** (the release comes soonest);
//! 3. then the **fewest cached blocks** (the least prefix cache lost);
//! 4. then by name, so that candidates alike are always picked in the same order.

/// A replica a scale-down may release.
#[derive(Debug, Clone, PartialEq)]
pub struct ReleaseCandidate {
    /// Its registry name.
    pub name: String,
    /// Still in its cold start (registered `starting`): serves nothing yet.
    pub starting: bool,
    /// When a starting replica's cold start began (seconds, or any key that grows with time
    /// and is shared by the candidates, such as a Raft log index); ignored for ready ones.
    pub starting_since: f64,
    /// Requests routed to it and not finished (every router node's bookings, or the engine's
    /// running plus waiting requests, whichever is larger).
    pub in_flight: u32,
    /// KV blocks the prefix index holds for it, blocks of `block_size` tokens.
    pub cached_blocks: u64,
}

/// The `count` replicas of `candidates` to release, as indices into it, in the order above;
/// all of them when `count` exceeds their number.
pub fn pick_releases(candidates: &[ReleaseCandidate], count: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&i, &j| {
        let (a, b) = (&candidates[i], &candidates[j]);
        let newest_start = if a.starting && b.starting {
            b.starting_since.total_cmp(&a.starting_since)
        } else {
            std::cmp::Ordering::Equal
        };
        b.starting
            .cmp(&a.starting)
            .then(newest_start)
            .then(a.in_flight.cmp(&b.in_flight))
            .then(a.cached_blocks.cmp(&b.cached_blocks))
            .then_with(|| a.name.cmp(&b.name))
    });
    order.truncate(count);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(name: &str, starting: bool, in_flight: u32, cached_blocks: u64) -> ReleaseCandidate {
        ReleaseCandidate { name: name.into(), starting, starting_since: 0.0, in_flight, cached_blocks }
    }

    fn names(pool: &[ReleaseCandidate], count: usize) -> Vec<&str> {
        pick_releases(pool, count).into_iter().map(|i| pool[i].name.as_str()).collect()
    }

    #[test]
    fn starting_first_then_fewest_in_flight_then_least_cache_then_name() {
        let pool = [
            c("e0", false, 3, 10),
            c("e1", false, 0, 900),
            c("e2", true, 0, 0),
            c("e3", false, 0, 40),
            c("e4", false, 0, 40),
            ReleaseCandidate { starting_since: 30.0, ..c("e5", true, 0, 0) },
        ];
        assert_eq!(pick_releases(&pool, 0), Vec::<usize>::new());
        // e5 began its cold start last: the most of it is saved.
        assert_eq!(pick_releases(&pool, 1), [5]);
        assert_eq!(names(&pool, 4), ["e5", "e2", "e3", "e4"]);
        assert_eq!(names(&pool, 9), ["e5", "e2", "e3", "e4", "e1", "e0"]);
        // The order does not depend on the order given.
        let mut reversed = pool.to_vec();
        reversed.reverse();
        assert_eq!(names(&reversed, 5), names(&pool, 5));
    }
}
