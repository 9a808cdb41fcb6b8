//! `kvmesh.v1.Replication`: hot prefixes, the committed plan (get and watch), and manual
//! triggers (admin token).

use crate::cluster::Cluster;
use crate::state::Shared;
use kvmesh_core::replication::{trigger, ReplicationPlan};
use kvmesh_core::BlockHash;
use kvmesh_proto::v1::{self, replication_server};
use std::pin::Pin;
use std::sync::Arc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// The service; every node serves it.
#[derive(Clone)]
pub struct ReplicationService {
    /// The node.
    pub shared: Arc<Shared>,
    /// In a cluster, triggers commit through Raft.
    pub cluster: Option<Arc<Cluster>>,
}

fn disabled() -> Status {
    Status::failed_precondition("replication is off on this node; set [replication] enabled = true")
}

impl ReplicationService {
    fn plan_message(&self, plan: &ReplicationPlan) -> v1::ReplicationPlan {
        v1::ReplicationPlan { enabled: self.shared.replication.enabled(), ..v1::ReplicationPlan::from(plan) }
    }
}

#[tonic::async_trait]
impl replication_server::Replication for ReplicationService {
    async fn list_hot_prefixes(
        &self,
        request: Request<v1::ListHotPrefixesRequest>,
    ) -> Result<Response<v1::HotPrefixList>, Status> {
        crate::auth::check_read(request.metadata(), &self.shared.tokens)?;
        let limit = match request.into_inner().limit {
            0 => 20,
            n => n as usize,
        };
        let rep = &self.shared.replication;
        let (hot, nodes) = crate::tasks::replication::hot_with_nodes(&self.shared);
        let plan = rep.plan();
        let hasher = self.shared.settings.hasher;
        let bs = hasher.block_size();
        let listed: Vec<_> = hot.prefixes.iter().take(limit).collect();
        // Hash outside the core lock: token ids come from peers too.
        let chains: Vec<Option<Vec<kvmesh_core::BlockHash>>> =
            listed.iter().map(|p| p.tokens.as_ref().map(|t| hasher.hash_blocks(t))).collect();
        let core = self.shared.core();
        let prefixes = listed
            .iter()
            .zip(&chains)
            .map(|(p, chain)| {
                let holders = chain.as_ref().map_or_else(Vec::new, |chain| {
                    let mut names: Vec<String> = core
                        .fleet
                        .holders(chain)
                        .into_iter()
                        .filter_map(|id| core.fleet.replica(id).map(|r| r.spec.name.clone()))
                        .collect();
                    names.sort();
                    names
                });
                v1::HotPrefix {
                    hash: p.hash.0,
                    depth_blocks: p.depth_blocks,
                    tokens: p.depth_blocks.saturating_mul(bs),
                    load_share: if hot.total_load_tokens_per_s > 0.0 {
                        p.load_tokens_per_s / hot.total_load_tokens_per_s
                    } else {
                        0.0
                    },
                    requests_per_s: p.requests_per_s,
                    prefix_tokens_per_s: p.prefix_tokens_per_s,
                    load_tokens_per_s: p.load_tokens_per_s,
                    holders,
                    planned: plan.find(p.hash, p.depth_blocks).is_some(),
                    warmable: p.tokens.is_some(),
                }
            })
            .collect();
        Ok(Response::new(v1::HotPrefixList {
            total_load_tokens_per_s: hot.total_load_tokens_per_s,
            prefixes,
            routable_replicas: core.fleet.replicas().iter().filter(|r| r.routable()).count() as u32,
            nodes,
            enabled: rep.enabled(),
        }))
    }

    async fn get_plan(&self, r: Request<v1::GetPlanRequest>) -> Result<Response<v1::ReplicationPlan>, Status> {
        crate::auth::check_read(r.metadata(), &self.shared.tokens)?;
        Ok(Response::new(self.plan_message(&self.shared.replication.plan())))
    }

    type WatchPlanStream = Pin<Box<dyn Stream<Item = Result<v1::ReplicationPlan, Status>> + Send>>;

    async fn watch_plan(&self, r: Request<v1::GetPlanRequest>) -> Result<Response<Self::WatchPlanStream>, Status> {
        crate::auth::check_read(r.metadata(), &self.shared.tokens)?;
        let mut rx = self.shared.replication.watch();
        let this = self.clone();
        let stream = async_stream(move |tx| async move {
            loop {
                let plan = rx.borrow_and_update().clone();
                if tx.send(Ok(this.plan_message(&plan))).await.is_err() {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(stream))
    }

    async fn trigger(&self, request: Request<v1::TriggerRequest>) -> Result<Response<v1::ReplicationPlan>, Status> {
        crate::auth::check(request.metadata(), &[&self.shared.tokens.admin])?;
        let rep = &self.shared.replication;
        let Some(config) = rep.config.clone() else { return Err(disabled()) };
        let r = request.into_inner();
        let (tokens, expect): (Vec<u32>, Option<BlockHash>) = match r.prefix {
            Some(v1::trigger_request::Prefix::TokenIds(t)) => (t.ids, None),
            Some(v1::trigger_request::Prefix::Text(t)) => (self.shared.tokenizer.encode(&t), None),
            Some(v1::trigger_request::Prefix::Hash(h)) => {
                let hot = crate::tasks::replication::hot(&self.shared);
                let p = hot.prefixes.iter().find(|p| p.hash == BlockHash(h)).ok_or_else(|| {
                    Status::not_found(format!(
                        "prefix {h} is not among this node's hot prefixes (kvmesh replication status)"
                    ))
                })?;
                let t = p.tokens.as_ref().map(|t| t.to_vec()).ok_or_else(|| {
                    Status::failed_precondition(format!("prefix {h}'s token ids are unknown (not among the hottest)"))
                })?;
                (t, Some(BlockHash(h)))
            }
            None => return Err(Status::invalid_argument("set token_ids, text or hash")),
        };
        // Two tries: the leader may commit a round between reading the plan and writing ours.
        for attempt in 0..2 {
            let current = rep.plan();
            let plan = {
                let core = self.shared.core();
                trigger(&config, crate::replication::unix_now(), &core.fleet, &current, &tokens, &r.replicas, expect)
                    .map_err(|e| Status::invalid_argument(e.to_string()))?
            };
            match crate::tasks::replication::commit(&self.shared, self.cluster.as_deref(), &current, plan).await {
                Ok(()) => {
                    // Committed and applied to this node's Raft state; its copy of the plan
                    // follows that a moment later: answer with the plan that includes ours.
                    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
                    while rep.plan().version <= current.version && tokio::time::Instant::now() < deadline {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                    return Ok(Response::new(self.plan_message(&rep.plan())));
                }
                Err(e @ crate::tasks::replication::CommitError::Stale(_)) if attempt == 0 => {
                    tracing::debug!(error = %e, "replication trigger raced a planning round; retrying");
                    // Let follow publish the newer plan before retrying.
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => return Err(Status::unavailable(e.to_string())),
            }
        }
        Err(Status::aborted("the plan kept changing; try again"))
    }
}

/// A stream fed by `f` through a small channel.
fn async_stream<F, Fut>(f: F) -> Pin<Box<dyn Stream<Item = Result<v1::ReplicationPlan, Status>> + Send>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<v1::ReplicationPlan, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
