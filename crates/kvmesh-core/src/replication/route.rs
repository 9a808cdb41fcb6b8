//! Routing by a committed plan: the fleet counts each sent warm-up's target as holding its
//! prefix for a grace period ([`Fleet::set_replication_plan`]). Written here, beside the plan,
//! so the fleet knows only its own planned-warm records, not the plan's type.

use super::ReplicationPlan;
use crate::fleet::{Fleet, PlannedWarm};

impl Fleet {
    /// Routes by a committed replication plan from `now` (seconds on this fleet's clock): each
    /// target of a planned prefix whose warm-up was sent counts as holding it for
    /// `grace_ttl_s` after this fleet first saw it sent, after which only its KV events count
    /// (a pending target, waiting for the rate limit, is not warm). Unknown replica names are
    /// skipped (the registry may be ahead of this node).
    pub fn set_replication_plan(&mut self, plan: &ReplicationPlan, grace_ttl_s: f64, now: f64) {
        let mut next = Vec::with_capacity(plan.prefixes.len());
        for p in &plan.prefixes {
            let old = self.planned().iter().find(|w| w.hash == p.hash && w.depth == p.depth_blocks);
            let mut targets = Vec::new();
            for t in p.targets.iter().filter(|t| t.state.is_sent()) {
                let Some(r) = self.replica_by_name(&t.replica) else { continue };
                let seen = old.and_then(|w| w.targets.iter().find(|(id, _)| *id == r.id)).map(|&(_, until)| until);
                targets.push((r.id, seen.unwrap_or(now + grace_ttl_s)));
            }
            if !targets.is_empty() && p.depth_blocks > 0 {
                next.push(PlannedWarm { hash: p.hash, depth: p.depth_blocks, targets });
            }
        }
        self.set_planned(next);
    }
}
