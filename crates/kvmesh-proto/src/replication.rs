//! Replication messages ↔ [`kvmesh_core::replication`] types: gossiped hot-prefix reports and
//! the plan as the `Replication` service shows it.

use crate::v1;
use kvmesh_core::replication::{HotPrefix, ReplicationPlan, SketchReport, TargetState};
use kvmesh_core::BlockHash;

impl From<&SketchReport> for v1::HotPrefixReport {
    /// Token ids go as the report has them (cut it with `SketchReport::for_gossip` first).
    fn from(r: &SketchReport) -> Self {
        v1::HotPrefixReport {
            total_load_tokens_per_s: r.total_load_tokens_per_s,
            prefixes: r
                .prefixes
                .iter()
                .map(|p| v1::HotPrefixEntry {
                    hash: p.hash.0,
                    depth_blocks: p.depth_blocks,
                    prefix_tokens_per_s: p.prefix_tokens_per_s,
                    load_tokens_per_s: p.load_tokens_per_s,
                    requests_per_s: p.requests_per_s,
                    tokens: p.tokens.as_ref().map_or_else(Vec::new, |t| t.to_vec()),
                })
                .collect(),
        }
    }
}

impl From<v1::HotPrefixReport> for SketchReport {
    /// As sent: check it with `SketchReport::sanitize` before use.
    fn from(r: v1::HotPrefixReport) -> Self {
        SketchReport {
            total_load_tokens_per_s: r.total_load_tokens_per_s,
            prefixes: r
                .prefixes
                .into_iter()
                .map(|p| HotPrefix {
                    hash: BlockHash(p.hash),
                    depth_blocks: p.depth_blocks,
                    prefix_tokens_per_s: p.prefix_tokens_per_s,
                    load_tokens_per_s: p.load_tokens_per_s,
                    requests_per_s: p.requests_per_s,
                    tokens: (!p.tokens.is_empty()).then(|| p.tokens.into()),
                })
                .collect(),
        }
    }
}

impl From<&ReplicationPlan> for v1::ReplicationPlan {
    fn from(plan: &ReplicationPlan) -> Self {
        v1::ReplicationPlan {
            version: plan.version,
            planned_blocks: plan.planned_blocks(),
            enabled: true,
            prefixes: plan
                .prefixes
                .iter()
                .map(|p| v1::PlannedPrefix {
                    hash: p.hash.0,
                    depth_blocks: p.depth_blocks,
                    load_share: p.load_share,
                    want_replicas: p.want_replicas,
                    holders: p.holders.clone(),
                    targets: p
                        .targets
                        .iter()
                        .map(|t| v1::PlanTarget {
                            replica: t.replica.clone(),
                            state: t.state.name().into(),
                            reason: match &t.state {
                                TargetState::Failed { reason, .. } => reason.clone(),
                                _ => String::new(),
                            },
                            attempts: t.attempts,
                            since: match t.state {
                                TargetState::Warming { since } => Some(since),
                                TargetState::Confirmed { at } => Some(at),
                                _ => None,
                            },
                        })
                        .collect(),
                    planned_at: p.planned_at,
                    cool_since: p.cool_since,
                    origin: match p.origin {
                        kvmesh_core::replication::Origin::Detected => "detected".into(),
                        kvmesh_core::replication::Origin::Manual => "manual".into(),
                    },
                    pinned_until: p.pinned_until,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_garbage_is_cleaned() {
        let p = |i: u64| HotPrefix {
            hash: BlockHash(i),
            depth_blocks: 4,
            prefix_tokens_per_s: 100.0 - i as f64,
            load_tokens_per_s: 10.0,
            requests_per_s: 1.0,
            tokens: Some(vec![1u32; 64].into()),
        };
        let r = SketchReport { total_load_tokens_per_s: 50.0, prefixes: (0..6).map(p).collect() }.for_gossip();
        let back = SketchReport::from(v1::HotPrefixReport::from(&r));
        assert_eq!(back, r);
        assert_eq!(back.prefixes.iter().filter(|p| p.tokens.is_some()).count(), 4);
        let mut bad = v1::HotPrefixReport::from(&r);
        bad.total_load_tokens_per_s = f64::NAN;
        bad.prefixes[0].load_tokens_per_s = -5.0;
        bad.prefixes[1].requests_per_s = 1e308;
        bad.prefixes[2].tokens.push(7); // 65 ids for 4 blocks of 16
        bad.prefixes[3].depth_blocks = u32::MAX;
        let clean = SketchReport::from(bad).sanitize(16, 2048, 16);
        assert_eq!(clean.total_load_tokens_per_s, 0.0);
        assert_eq!((clean.prefixes[0].load_tokens_per_s, clean.prefixes[1].requests_per_s), (0.0, 0.0));
        assert_eq!(clean.prefixes[2].tokens, None);
        assert_eq!(clean.prefixes.len(), 5, "the out-of-range depth is gone");
    }
}
