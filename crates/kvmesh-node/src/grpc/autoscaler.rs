//! `kvmesh.v1.Autoscaler` and KEDA's `externalscaler.ExternalScaler` over the committed
//! decisions. The KEDA metric is the desired replica count with a target of 1 per replica, so
//! a ScaledObject's HPA sets the Deployment to exactly the decision.

use crate::autoscaler::Decision;
use crate::state::Shared;
use kvmesh_proto::externalscaler::{self as keda, external_scaler_server::ExternalScaler};
use kvmesh_proto::v1::{self, autoscaler_server::Autoscaler};
use std::pin::Pin;
use std::sync::Arc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// The KEDA metric's name.
pub const METRIC: &str = "kvmesh-desired-replicas";

/// Both services; every node serves them.
#[derive(Clone)]
pub struct AutoscalerService {
    /// The node.
    pub shared: Arc<Shared>,
}

fn message(d: &Decision) -> v1::ScaleDecision {
    v1::ScaleDecision {
        pool: d.pool.clone(),
        desired_replicas: d.desired_replicas,
        reason: d.reason.clone(),
        ready: d.ready,
        starting: d.starting,
        forecast_tokens_per_s: d.forecast_tokens_per_s,
        demand_tokens_per_s: d.demand_tokens_per_s,
        capacity_tokens_per_s: d.capacity_tokens_per_s,
        panic: d.panic,
        at: d.at,
        log_index: d.log_index,
        drain: d.drain.clone(),
        cold_start_s: d.cold_start_s,
    }
}

impl AutoscalerService {
    fn check_pool(&self, pool: &str) -> Result<(), Status> {
        let a = &self.shared.autoscaler;
        if !a.enabled() {
            return Err(Status::failed_precondition(
                "the autoscaler is off on this node; set [autoscaler] enabled = true",
            ));
        }
        if !pool.is_empty() && pool != a.section.pool {
            return Err(Status::not_found(format!("unknown pool {pool:?}; this tier's is {:?}", a.section.pool)));
        }
        Ok(())
    }

    fn latest(&self) -> Result<Decision, Status> {
        self.shared
            .autoscaler
            .latest()
            .ok_or_else(|| Status::unavailable("no decision yet (the first comes after one interval)"))
    }
}

type Stream2<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Sends `f(decisions)` now and on every change, deduplicated, until the client leaves.
fn follow<T, F>(shared: &Shared, f: F) -> Stream2<T>
where
    T: PartialEq + Clone + Send + 'static,
    F: Fn(&[Decision]) -> Option<T> + Send + 'static,
{
    let mut rx = shared.autoscaler.watch();
    let (tx, out) = tokio::sync::mpsc::channel(8);
    tokio::spawn(async move {
        let mut last: Option<T> = None;
        loop {
            let item = f(&rx.borrow_and_update());
            if let Some(item) = item.filter(|i| last.as_ref() != Some(i)) {
                last = Some(item.clone());
                if tx.send(Ok(item)).await.is_err() {
                    return;
                }
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(out))
}

#[tonic::async_trait]
impl Autoscaler for AutoscalerService {
    async fn get_recommendation(
        &self,
        r: Request<v1::AutoscalerRequest>,
    ) -> Result<Response<v1::ScaleDecision>, Status> {
        crate::auth::check_read(r.metadata(), &self.shared.tokens)?;
        self.check_pool(&r.into_inner().pool)?;
        Ok(Response::new(message(&self.latest()?)))
    }

    async fn list_decisions(
        &self,
        r: Request<v1::AutoscalerRequest>,
    ) -> Result<Response<v1::ScaleDecisionList>, Status> {
        crate::auth::check_read(r.metadata(), &self.shared.tokens)?;
        self.check_pool(&r.into_inner().pool)?;
        let decisions = self.shared.autoscaler.all().iter().map(message).collect();
        Ok(Response::new(v1::ScaleDecisionList { decisions }))
    }

    type WatchDecisionsStream = Stream2<v1::ScaleDecision>;

    async fn watch_decisions(
        &self,
        r: Request<v1::AutoscalerRequest>,
    ) -> Result<Response<Self::WatchDecisionsStream>, Status> {
        crate::auth::check_read(r.metadata(), &self.shared.tokens)?;
        self.check_pool(&r.into_inner().pool)?;
        Ok(Response::new(follow(&self.shared, |d| d.last().map(message))))
    }
}

/// The pool a ScaledObject names (`scalerMetadata.pool`), or the tier's.
fn pool_of(r: &keda::ScaledObjectRef) -> &str {
    r.scaler_metadata.get("pool").map_or("", String::as_str)
}

/// Active while the pool has load or wants more than its minimum (KEDA scales from zero on it).
fn active(d: &Decision, min: u32) -> bool {
    d.demand_tokens_per_s > 0.0 || d.desired_replicas > min
}

#[tonic::async_trait]
impl ExternalScaler for AutoscalerService {
    async fn is_active(&self, r: Request<keda::ScaledObjectRef>) -> Result<Response<keda::IsActiveResponse>, Status> {
        self.check_pool(pool_of(r.get_ref()))?;
        let min = self.shared.autoscaler.section.policy.min_replicas;
        Ok(Response::new(keda::IsActiveResponse { result: self.latest().is_ok_and(|d| active(&d, min)) }))
    }

    type StreamIsActiveStream = Stream2<keda::IsActiveResponse>;

    async fn stream_is_active(
        &self,
        r: Request<keda::ScaledObjectRef>,
    ) -> Result<Response<Self::StreamIsActiveStream>, Status> {
        self.check_pool(pool_of(r.get_ref()))?;
        let min = self.shared.autoscaler.section.policy.min_replicas;
        Ok(Response::new(follow(&self.shared, move |d| {
            d.last().map(|d| keda::IsActiveResponse { result: active(d, min) })
        })))
    }

    async fn get_metric_spec(
        &self,
        r: Request<keda::ScaledObjectRef>,
    ) -> Result<Response<keda::GetMetricSpecResponse>, Status> {
        self.check_pool(pool_of(r.get_ref()))?;
        let spec = keda::MetricSpec { metric_name: METRIC.into(), target_size: 1, target_size_float: 1.0 };
        Ok(Response::new(keda::GetMetricSpecResponse { metric_specs: vec![spec] }))
    }

    async fn get_metrics(
        &self,
        r: Request<keda::GetMetricsRequest>,
    ) -> Result<Response<keda::GetMetricsResponse>, Status> {
        let r = r.into_inner();
        self.check_pool(r.scaled_object_ref.as_ref().map_or("", pool_of))?;
        if !r.metric_name.is_empty() && r.metric_name != METRIC {
            return Err(Status::not_found(format!("unknown metric {:?}; kvmesh serves {METRIC:?}", r.metric_name)));
        }
        let d = self.latest()?;
        let value = keda::MetricValue {
            metric_name: METRIC.into(),
            metric_value: i64::from(d.desired_replicas),
            metric_value_float: f64::from(d.desired_replicas),
        };
        Ok(Response::new(keda::GetMetricsResponse { metric_values: vec![value] }))
    }
}
