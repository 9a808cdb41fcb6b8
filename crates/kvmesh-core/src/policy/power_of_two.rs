//! `power_of_two`: the vLLM router's power of two choices (vllm-project/router, PyPI
//! `vllm-router` 0.1.17, `src/policies/power_of_two.rs`; Mitzenmacher, "The Power of Two
//! Choices in Randomized Load Balancing", IEEE TPDS 2001): two distinct healthy workers drawn
//! at random, the one with fewer requests in flight from this router wins, the first drawn on
//! ties (`load1 <= load2`; the draw order is random, so ties split evenly).
//!
//! The vLLM router prefers a load it polls from each worker's `/get_load` (every 30 s), which
//! vLLM engines do not serve; it then falls back to its own in-flight count, as here.

use super::choose::two;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::view::FleetView;
use crate::view::RouteRequest;
use rand::RngCore;

/// Power of two choices on in-flight requests.
#[derive(Debug, Default)]
pub struct PowerOfTwo {
    candidates: Vec<usize>,
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn reads_kv_events(&self) -> bool {
        false
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        self.candidates.clear();
        self.candidates.extend(view.routable());
        if self.candidates.is_empty() {
            return Err(Error::NoReplicaReady);
        }
        let (a, b) = two(&self.candidates, rng);
        let i = if view.load(a).outstanding() <= view.load(b).outstanding() { a } else { b };
        Ok(Decision::at(view, req, i, Reason::LowerOfTwo))
    }
}
