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

pub mod service;
mod warm;

use crate::cluster::registry::Command;
use crate::cluster::Cluster;
use crate::config::ReplicationSection;
use crate::state::Shared;
use kvmesh_core::replication::{
    plan_round, warm_failed, warm_round, ReplicationConfig, ReplicationPlan, SketchReport, WarmLimiter,
};
use kvmesh_core::BlockHash;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

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
    commit_lock: tokio::sync::Mutex<()>,
}

impl Replication {
    /// State for `section`.
    pub fn new(section: ReplicationSection) -> Self {
        let config = section.enabled.then(|| section.core());
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
        let max_age = (REPORT_MAX_AGE_INTERVALS * self.section.interval_ms as f64 / 1000.0).max(5.0);
        reports.retain(|_, (_, at)| at.elapsed().as_secs_f64() < max_age);
        let mut nodes = vec![own_id];
        nodes.extend(reports.keys().filter(|&&n| n != own_id));
        let merged = SketchReport::merge(
            std::iter::once(&own).chain(reports.iter().filter(|(n, _)| **n != own_id).map(|(_, (r, _))| r)),
        );
        (merged, nodes)
    }

    /// Everything this node knows of: its own sketch and its peers' reports.
    pub fn hot(&self, shared: &Shared) -> SketchReport {
        self.hot_with_nodes(shared).0
    }

    /// [`Replication::hot`] and the nodes it includes.
    pub fn hot_with_nodes(&self, shared: &Shared) -> (SketchReport, Vec<u64>) {
        let own = shared.own_report(self.section.report_top);
        self.merged(shared.core().node_id.0, own)
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

/// The leader's loop: every `interval_ms`, plan, commit, warm. Runs on every node and acts
/// only while it leads (always, without a cluster). Ends when `stop` turns true.
pub async fn run(shared: Arc<Shared>, cluster: Option<Arc<Cluster>>, mut stop: watch::Receiver<bool>) {
    let Some(config) = shared.replication.config.clone() else { return };
    if shared.config.lock().unwrap_or_else(|p| p.into_inner()).node.tokenizer.is_none() {
        tracing::warn!(
            "replication is on without node.tokenizer: warm-ups send kvmesh's approximate token ids, which only \
             kvmesh-engine-sim understands; real vLLM/SGLang replicas will fail to confirm them"
        );
    }
    let mut limiter = WarmLimiter::default();
    let (fail_tx, mut fail_rx) = mpsc::unbounded_channel::<WarmFailure>();
    let mut failures: Vec<WarmFailure> = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(shared.replication.section.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut leading = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let leads = cluster.as_ref().is_none_or(|c| c.leads());
        if leads != leading {
            tracing::info!(
                leading = leads,
                "replication: {}",
                if leads { "planning" } else { "following the leader's plan" }
            );
            leading = leads;
        }
        while let Ok(f) = fail_rx.try_recv() {
            tracing::warn!(replica = %f.replica, prefix = f.hash.0, attempt = f.attempt, reason = %f.reason, "replication: warm-up failed");
            failures.push(f);
        }
        if !leads {
            failures.clear();
            continue;
        }
        let committed = shared.replication.plan();
        let mut plan = (*committed).clone();
        let now = unix_now();
        for f in &failures {
            warm_failed(&config, &mut plan, f.hash, f.depth_blocks, &f.replica, f.attempt, &f.reason, now);
        }
        let (merged, _) = shared.replication.hot_with_nodes(&shared);
        let warmups = {
            let core = shared.core();
            plan = plan_round(&config, now, &merged, &core.fleet, &plan);
            let warmups = warm_round(&config, now, &core.fleet, &mut plan, &mut limiter).0;
            limiter.retain(|name| core.fleet.replica_by_name(name).is_some());
            warmups
        };
        if plan.version != committed.version {
            if let Err(e) = commit(&shared, cluster.as_deref(), &committed, plan.clone()).await {
                tracing::warn!(error = %e, "replication: plan not committed; the next round starts from the committed one");
                continue;
            }
            log_changes(&committed, &plan);
        }
        failures.clear();
        for w in warmups {
            tokio::spawn(warm::send(shared.clone(), w, fail_tx.clone()));
        }
    }
}

/// Commits `plan`, computed from `base` (the committed plan then): through Raft in a cluster
/// (a compare-and-set on the version; token ids of prefixes `base` already has are left out of
/// the entry), directly on a single node under the same rule.
///
/// # Errors
/// The plan moved on since `base` (another writer committed first), or no quorum.
pub(crate) async fn commit(
    shared: &Shared,
    cluster: Option<&Cluster>,
    base: &ReplicationPlan,
    mut plan: ReplicationPlan,
) -> Result<(), String> {
    match cluster {
        Some(c) => {
            let mut json = serde_json::to_value(&plan).map_err(|e| e.to_string())?;
            if let Some(prefixes) = json.get_mut("prefixes").and_then(|p| p.as_array_mut()) {
                for (p, v) in plan.prefixes.iter().zip(prefixes) {
                    if base.find(p.hash, p.depth_blocks).is_some_and(|b| b.tokens == p.tokens) {
                        if let Some(o) = v.as_object_mut() {
                            o.remove("tokens");
                        }
                    }
                }
            }
            let cmd = Command::SetReplicationPlan { plan: json, base_version: Some(base.version) };
            c.write(cmd).await.map(|_| ()).map_err(|e| e.to_string())
        }
        None => {
            let _one_writer = shared.replication.commit_lock.lock().await;
            let current = shared.replication.plan().version;
            if current != base.version {
                return Err(format!("stale replication plan: computed from v{}, the plan is v{current}", base.version));
            }
            plan.version = current + 1;
            shared.apply_plan(plan);
            Ok(())
        }
    }
}
fn log_changes(before: &ReplicationPlan, after: &ReplicationPlan) {
    for p in &after.prefixes {
        if before.find(p.hash, p.depth_blocks).is_none() {
            let targets: Vec<&str> = p.targets.iter().map(|t| t.replica.as_str()).collect();
            tracing::info!(prefix = p.hash.0, depth_blocks = p.depth_blocks, load_share = p.load_share,
                want_replicas = p.want_replicas, holders = ?p.holders, ?targets, "replication: prefix planned");
        }
    }
    for p in &before.prefixes {
        if after.find(p.hash, p.depth_blocks).is_none() {
            tracing::info!(
                prefix = p.hash.0,
                depth_blocks = p.depth_blocks,
                "replication: prefix cooled, plan retired"
            );
        }
    }
}
