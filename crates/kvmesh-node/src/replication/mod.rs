//! Hot-prefix replication on a node (`[replication]`, `kvmesh_core::replication`).
//!
//! - Every node counts the prefixes it routes in its sketch (in the routing core) and gossips
//!   its hottest each interval (`cluster::gossip`); reports from peers land here.
//! - The Raft leader (a single node: itself) runs [`run`]: merges the reports, plans, commits
//!   the plan through Raft (`SetReplicationPlan`, a compare-and-set on the plan's version), then
//!   sends the round's warm-ups ([`warm`]). Warm-ups are not sent for a plan that did not
//!   commit; the next round starts again from the committed plan.
//! - Every node routes by the committed plan (`cluster::follow` → [`crate::state::Shared::apply_plan`]).
//! - [`service`]: the `Replication` gRPC service.

use crate::config::ReplicationSection;
use kvmesh_core::replication::{ReplicationConfig, ReplicationPlan, SketchReport};
use kvmesh_core::BlockHash;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::watch;

/// A peer's report older than this many report intervals (and 5 s) is left out of the merge.
const REPORT_MAX_AGE_INTERVALS: f64 = 3.0;

/// A node's replication state, shared by the driver, gossip, follow and the gRPC service.
pub struct Replication {
    /// The settings.
    pub section: ReplicationSection,
    /// The core's settings, when enabled.
    pub config: Option<ReplicationConfig>,
    reports: Mutex<BTreeMap<u64, (SketchReport, Instant)>>,
    plan: watch::Sender<Arc<ReplicationPlan>>,
    /// Serialises plan writes on a single node (the cluster's are serialised by Raft).
    pub(crate) commit_lock: tokio::sync::Mutex<()>,
}

impl Replication {
    /// State for `section`.
    pub fn new(section: ReplicationSection) -> Self {
        let config = section.enabled.then(|| section.plan.clone());
        Replication {
            section,
            config,
            reports: Mutex::new(BTreeMap::new()),
            plan: watch::channel(Arc::new(ReplicationPlan::default())).0,
            commit_lock: tokio::sync::Mutex::new(()),
        }
    }

    /// Whether replication is on.
    pub fn enabled(&self) -> bool {
        self.config.is_some()
    }

    /// Keeps `node`'s latest gossiped report, cleaned and cut to what this node would send
    /// itself ([`SketchReport::sanitize`]): a peer cannot grow this node's memory or poison the
    /// plan with it.
    pub fn store_report(&self, node: u64, report: SketchReport, block_size: u32) {
        let max_depth = self.config.as_ref().map_or(0, |c| c.sketch.max_depth_blocks);
        let report = report.sanitize(block_size, max_depth, self.section.report_top);
        self.reports.lock().unwrap_or_else(|p| p.into_inner()).insert(node, (report, Instant::now()));
    }

    /// This node's report merged with its peers' recent ones, and the nodes included
    /// (`own_id` first).
    pub fn merged(&self, own_id: u64, own: SketchReport) -> (SketchReport, Vec<u64>) {
        let mut reports = self.reports.lock().unwrap_or_else(|p| p.into_inner());
        let max_age = (REPORT_MAX_AGE_INTERVALS * self.section.plan.interval_s).max(5.0);
        reports.retain(|_, (_, at)| at.elapsed().as_secs_f64() < max_age);
        let mut nodes = vec![own_id];
        nodes.extend(reports.keys().filter(|&&n| n != own_id));
        let merged = SketchReport::merge(
            std::iter::once(&own).chain(reports.iter().filter(|(n, _)| **n != own_id).map(|(_, (r, _))| r)),
        );
        (merged, nodes)
    }

    /// The committed plan (a single node: its own).
    pub fn plan(&self) -> Arc<ReplicationPlan> {
        self.plan.borrow().clone()
    }

    /// Follows the committed plan.
    pub fn watch(&self) -> watch::Receiver<Arc<ReplicationPlan>> {
        self.plan.subscribe()
    }

    /// Publishes a newly committed plan.
    pub(crate) fn publish(&self, plan: ReplicationPlan) {
        self.plan.send_if_modified(|p| {
            let changed = **p != plan;
            if changed {
                *p = Arc::new(plan);
            }
            changed
        });
    }
}

/// A warm-up that could not be sent, reported back to the next round.
#[derive(Debug)]
pub(crate) struct WarmFailure {
    pub hash: BlockHash,
    pub depth_blocks: u32,
    pub replica: String,
    pub attempt: u32,
    pub reason: String,
}

/// Seconds since the Unix epoch: plan and decision timestamps must mean the same on every node
/// and leader (and to the CLI that shows their age).
pub fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}
