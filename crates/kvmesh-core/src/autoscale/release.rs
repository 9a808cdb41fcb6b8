//! Which replicas a scale-down releases.
//!
//! A scale-down from `n` to `m` replicas (ready and starting together) releases `n − m` of
//! them by draining: no new requests, in-flight ones finish, then the replica goes. Which ones
//! matter: releasing a replica throws away its KV cache (the prefixes routed to it) and makes
//! its in-flight requests hold up the release. So, in this order:
//!
//! 1. **starting** replicas first: they serve nothing yet, hold no cache, and cancelling a
//!    start saves the rest of its cold start;
//! 2. then ready replicas with the **fewest requests in flight** (the release comes soonest);
//! 3. then the **fewest cached blocks** (the least prefix cache lost);
//! 4. then by name, so every node and a new leader pick the same ones.

/// A replica a scale-down may release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseCandidate {
    /// Its registry name.
    pub name: String,
    /// Still in its cold start (registered `starting`): serves nothing yet.
    pub starting: bool,
    /// Requests routed to it and not finished (every router node's bookings, or the engine's
    /// running plus waiting requests, whichever is larger).
    pub in_flight: u32,
    /// KV blocks the prefix index holds for it, blocks of `block_size` tokens.
    pub cached_blocks: u64,
}

/// The names of the `count` replicas of `candidates` to release, in the order above; all of
/// them when `count` exceeds their number.
pub fn pick_releases(candidates: &[ReleaseCandidate], count: usize) -> Vec<String> {
    let mut order: Vec<&ReleaseCandidate> = candidates.iter().collect();
    order.sort_by(|a, b| {
        (!a.starting, a.in_flight, a.cached_blocks, &a.name).cmp(&(!b.starting, b.in_flight, b.cached_blocks, &b.name))
    });
    order.into_iter().take(count).map(|c| c.name.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(name: &str, starting: bool, in_flight: u32, cached_blocks: u64) -> ReleaseCandidate {
        ReleaseCandidate { name: name.into(), starting, in_flight, cached_blocks }
    }

    #[test]
    fn starting_first_then_fewest_in_flight_then_least_cache_then_name() {
        let pool = [
            c("e0", false, 3, 10),
            c("e1", false, 0, 900),
            c("e2", true, 0, 0),
            c("e3", false, 0, 40),
            c("e4", false, 0, 40),
            c("e5", true, 0, 0),
        ];
        assert_eq!(pick_releases(&pool, 0), Vec::<String>::new());
        assert_eq!(pick_releases(&pool, 2), ["e2", "e5"]);
        assert_eq!(pick_releases(&pool, 4), ["e2", "e5", "e3", "e4"]);
        assert_eq!(pick_releases(&pool, 9), ["e2", "e5", "e3", "e4", "e1", "e0"]);
        // The order does not depend on the order given.
        let mut reversed = pool.to_vec();
        reversed.reverse();
        assert_eq!(pick_releases(&reversed, 5), pick_releases(&pool, 5));
    }
}
