//! One budget for the request bodies all clients have in flight, so that many large bodies
//! at once cannot take the node's memory. A body's buffer is reserved from the budget as it
//! grows (so a client that declares 64 MiB and sends a byte holds a byte's worth, not 64 MiB);
//! a body that no longer fits gets 503 with `Retry-After`. A body over the per-route cap gets
//! 413 (from its `Content-Length`, before any of it is read); one not complete within the
//! body deadline, 408. The bytes stay reserved until the request's response is ready.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The shared byte budget and the per-body cap.
#[derive(Debug)]
pub struct BodyBudget {
    budget: usize,
    used: AtomicUsize,
    /// Largest body accepted, bytes.
    pub max_body: usize,
    /// Longest a whole body may take to arrive.
    pub deadline: Duration,
    /// Mirrors `used` (`kvmesh_http_body_bytes_in_flight`).
    gauge: Gauge,
    /// `kvmesh_requests_total`: the proxy's requests this budget refuses are counted there by
    /// outcome, like every other client request.
    requests: Family<crate::metrics::Labels, Counter>,
}

impl BodyBudget {
    /// A budget of `budget` bytes for bodies of at most `max_body` bytes each, whose use is
    /// kept in `metrics.http_body_bytes`; the proxy's requests it refuses are counted in
    /// `metrics.requests` by outcome.
    pub fn new(budget: usize, max_body: usize, deadline: Duration, metrics: &crate::metrics::Metrics) -> Arc<Self> {
        let (gauge, requests) = (metrics.http_body_bytes.clone(), metrics.requests.clone());
        Arc::new(BodyBudget { budget, used: AtomicUsize::new(0), max_body, deadline, gauge, requests })
    }

    /// Bytes reserved now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    fn try_reserve(self: &Arc<Self>, n: usize) -> bool {
        let ok = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_add(n).filter(|&t| t <= self.budget))
            .is_ok();
        if ok {
            self.gauge.inc_by(n as i64);
        }
        ok
    }
}

/// Bytes of the budget held by one request, given back when dropped.
pub struct Held {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl BodyBudget {
    /// An empty reservation to [`Held::grow`] as a body arrives.
    pub fn hold(self: &Arc<Self>) -> Held {
        Held { budget: self.clone(), bytes: 0 }
    }

    /// The message for a body that no longer fits the budget.
    pub fn full_message(&self) -> String {
        format!(
            "request bodies in flight fill the node's {}-byte budget (limits.http_body_budget_bytes); retry shortly",
            self.budget
        )
    }
}

impl Held {
    /// Reserves `n` more bytes; false (nothing reserved) when the budget cannot spare them.
    pub fn grow(&mut self, n: usize) -> bool {
        let ok = self.budget.try_reserve(n);
        if ok {
            self.bytes += n;
        }
        ok
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        self.budget.gauge.dec_by(self.bytes as i64);
    }
}

/// The proxy's error answer (OpenAI's shape, as every other), counted under `outcome`.
fn refuse(budget: &BodyBudget, status: StatusCode, outcome: &'static str, message: String) -> Response {
    crate::metrics::count_outcome(&budget.requests, outcome);
    let mut r = crate::openai_error::error(status, message);
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// Middleware: reads the body within the budget, then hands the buffered request on.
pub async fn limit(State(budget): State<Arc<BodyBudget>>, req: Request, next: Next) -> Response {
    let declared =
        req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    let max = budget.max_body;
    if let Some(n) = declared.filter(|&n| n > max) {
        let message = format!("request body of {n} bytes, over the {max}-byte limit");
        return refuse(&budget, StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", message);
    }
    let mut held = budget.hold();
    let (parts, body) = req.into_parts();
    let mut stream = body.into_data_stream();
    let mut buf = bytes::BytesMut::new();
    let deadline = tokio::time::Instant::now() + budget.deadline;
    loop {
        let chunk = match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => {
                return refuse(
                    &budget,
                    StatusCode::REQUEST_TIMEOUT,
                    "body_timeout",
                    format!("request body not complete within {} s", budget.deadline.as_secs()),
                )
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return refuse(
                    &budget,
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("reading the request body: {e}"),
                )
            }
            Ok(Some(Ok(c))) => c,
        };
        let need = buf.len() + chunk.len();
        if need > max || declared.is_some_and(|n| need > n) {
            let message = format!("request body over the {max}-byte limit");
            return refuse(&budget, StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", message);
        }
        if need > buf.capacity() {
            // Grow by doubling (to the declared length at most), paying for the new room first.
            let cap = need.max(buf.capacity() * 2).min(declared.unwrap_or(max)).max(need);
            if !held.grow(cap.saturating_sub(held.bytes)) {
                return busy(&budget);
            }
            buf.reserve(cap - buf.len());
        }
        buf.extend_from_slice(&chunk);
    }
    let resp = next.run(Request::from_parts(parts, Body::from(buf.freeze()))).await;
    drop(held);
    resp
}

fn busy(budget: &BodyBudget) -> Response {
    refuse(budget, StatusCode::SERVICE_UNAVAILABLE, "body_budget", budget.full_message())
}
