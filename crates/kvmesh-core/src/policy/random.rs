//! `random`: a uniformly random routable replica.

use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::view::FleetView;
use crate::view::RouteRequest;
use rand::{Rng, RngCore};

/// Uniform random choice.
#[derive(Debug, Default, Clone, Copy)]
pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn reads_kv_events(&self) -> bool {
        false
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let n = view.routable().count();
        if n == 0 {
            return Err(Error::NoReplicaReady);
        }
        let k = rng.random_range(0..n);
        let i = view.routable().nth(k).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, Reason::Random))
    }
}
