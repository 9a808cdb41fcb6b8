//! `power_of_two`: two random routable replicas, the one with the lower token load wins
//! (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", IEEE TPDS 2001).
//! Token load here is queued uncached prefill tokens plus expected decode tokens; exact ties
//! are broken at random.

use super::choose::two;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::fleet::{FleetView, RouteRequest};
use rand::{Rng, RngCore};

/// Power of two choices on token load.
#[derive(Debug, Default, Clone, Copy)]
pub struct PowerOfTwo;

/// Token load of position `i`, tokens: queued uncached prefill plus expected decode tokens.
pub(crate) fn token_load(view: &FleetView<'_>, i: usize) -> u64 {
    let l = view.load(i);
    l.queued_prefill_tokens + l.expected_decode_tokens
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let candidates: Vec<usize> = view.routable().collect();
        if candidates.is_empty() {
            return Err(Error::NoReplicaReady);
        }
        let (a, b) = two(&candidates, rng);
        let (la, lb) = (token_load(view, a), token_load(view, b));
        let i = match la.cmp(&lb) {
            std::cmp::Ordering::Less => a,
            std::cmp::Ordering::Greater => b,
            std::cmp::Ordering::Equal if rng.random_bool(0.5) => a,
            std::cmp::Ordering::Equal => b,
        };
        Ok(Decision::at(view, req, i, Reason::LowerOfTwo))
    }
}
