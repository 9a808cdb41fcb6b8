//! `round_robin`: each routable replica in turn, in id order.

use super::{Decision, Policy, Reason};
use crate::error::Error;
use crate::view::FleetView;
use crate::view::RouteRequest;
use rand::RngCore;

/// Rotates over routable replicas; the counter survives membership changes.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn reads_kv_events(&self) -> bool {
        false
    }

    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, _rng: &mut dyn RngCore) -> Result<Decision, Error> {
        let n = view.routable().count();
        if n == 0 {
            return Err(Error::NoReplicaReady);
        }
        let i = view.routable().nth(self.next % n).ok_or(Error::NoReplicaReady)?;
        self.next = self.next.wrapping_add(1);
        Ok(Decision::at(view, req, i, Reason::Rotation))
    }
}
