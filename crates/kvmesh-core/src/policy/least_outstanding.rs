//! `least_outstanding_requests`: the replica with the fewest requests booked by this router
//! (vLLM router's and SGLang router's "least requests"), random among ties.

use super::choose::lowest;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::fleet::{FleetView, RouteRequest};
use rand::RngCore;

/// Fewest outstanding requests.
#[derive(Debug, Default)]
pub struct LeastOutstanding {
    scores: Vec<(usize, f64)>,
}

impl Policy for LeastOutstanding {
    fn name(&self) -> &'static str {
        "least_outstanding_requests"
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        self.scores.clear();
        self.scores.extend(view.routable().map(|i| (i, view.load(i).outstanding() as f64)));
        let i = lowest(&self.scores, 0.0, rng).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, Reason::FewestOutstanding))
    }
}
