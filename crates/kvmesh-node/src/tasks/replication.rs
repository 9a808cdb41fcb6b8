//! The replication loop (plan, commit, warm; module docs of [`crate::replication`]) and what
//! reads the node's state for it: the hot prefixes this node knows of. It sits above the
//! state; the plan and reports it keeps ([`crate::replication::Replication`]) sit below it.

use crate::cluster::registry::{Command, STALE_PLAN};
use crate::cluster::{Cluster, ClusterError};

use crate::replication::{unix_now, WarmFailure};
use crate::state::Shared;
use kvmesh_core::replication::{plan_round, warm_failed, warm_round, ReplicationPlan, SketchReport, WarmLimiter};
use std::sync::Arc;
use tokio::sync::{mpsc, watch};

/// The leader's loop: every `interval`, plan, commit, warm. Runs on every node and acts
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
    let mut tick = tokio::time::interval(shared.replication.section.interval());
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
        let (merged, _) = hot_with_nodes(&shared);
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
            tokio::spawn(super::warm::send(shared.clone(), w, fail_tx.clone()));
        }
    }
}

/// Why a replication plan was not committed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CommitError {
    /// Another writer committed first: the plan was computed from an older one.
    #[error("{STALE_PLAN}{0}")]
    Stale(String),
    /// The cluster refused or could not commit it.
    #[error(transparent)]
    Cluster(ClusterError),
    /// The plan did not encode (not expected: plain data).
    #[error("encoding the plan: {0}")]
    Encode(#[from] serde_json::Error),
}

/// Commits `plan`, computed from `base` (the committed plan then): through Raft in a cluster
/// (a compare-and-set on the version; token ids of prefixes `base` already has are left out of
/// the entry), directly on a single node under the same rule.
///
/// # Errors
/// [`CommitError::Stale`]: the plan moved on since `base` (another writer committed first);
/// [`CommitError::Cluster`]: no quorum, or another refusal.
pub(crate) async fn commit(
    shared: &Shared,
    cluster: Option<&Cluster>,
    base: &ReplicationPlan,
    mut plan: ReplicationPlan,
) -> Result<(), CommitError> {
    match cluster {
        Some(c) => {
            let mut json = serde_json::to_value(&plan)?;
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
            c.write(cmd).await.map(|_| ()).map_err(|e| match e {
                ClusterError::Rejected(m) if m.starts_with(STALE_PLAN) => {
                    CommitError::Stale(m[STALE_PLAN.len()..].into())
                }
                other => CommitError::Cluster(other),
            })
        }
        None => {
            let _one_writer = shared.replication.commit_lock.lock().await;
            let current = shared.replication.plan().version;
            if current != base.version {
                return Err(CommitError::Stale(format!("computed from v{}, the plan is v{current}", base.version)));
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

/// Everything this node knows of: its own sketch and its peers' reports.
pub fn hot(shared: &Shared) -> SketchReport {
    hot_with_nodes(shared).0
}

/// [`hot`] and the nodes it includes.
pub fn hot_with_nodes(shared: &Shared) -> (SketchReport, Vec<u64>) {
    let own = shared.own_report(shared.replication.section.report_top);
    shared.replication.merged(shared.core().node_id.0, own)
}
