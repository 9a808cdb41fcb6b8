//! `least_outstanding_requests`: the replica with the fewest requests this router has in flight
//! there, random among ties: the load balancer's anchor (the rule of AWS ALB's documented "least
//! outstanding requests" algorithm), not an LLM router's policy. None of the LLM routers
//! compared here ships it: the vLLM router has none, SGLang's `least_load` is token-based.

use super::choose::lowest;
use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::view::FleetView;
use crate::view::RouteRequest;
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

    fn reads_kv_events(&self) -> bool {
        false
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error> {
        self.scores.clear();
        self.scores.extend(view.routable().map(|i| (i, view.load(i).outstanding() as f64)));
        let i = lowest(&self.scores, 0.0, rng).ok_or(Error::NoReplicaReady)?;
        Ok(Decision::at(view, req, i, Reason::FewestOutstanding))
    }
}
