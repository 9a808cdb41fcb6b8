//! One budget for the request bodies all clients have in flight, so that many large bodies
//! at once cannot take the node's memory: a body is admitted only while the bytes it declares
//! (or, without a `Content-Length`, the bytes received so far) fit; otherwise 503 with
//! `Retry-After`. A body over the per-route cap gets 413; one that stalls for the idle
//! timeout, 408. The bytes stay reserved until the request's response is ready.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
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
    /// Longest wait for the next chunk of a body.
    pub stall: Duration,
}

impl BodyBudget {
    /// A budget of `budget` bytes for bodies of at most `max_body` bytes each.
    pub fn new(budget: usize, max_body: usize, stall: Duration) -> Arc<Self> {
        Arc::new(BodyBudget { budget, used: AtomicUsize::new(0), max_body, stall })
    }

    /// Bytes reserved now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    fn try_reserve(self: &Arc<Self>, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_add(n).filter(|&t| t <= self.budget))
            .is_ok()
    }
}

/// Bytes of the budget held by one request.
struct Held {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl Held {
    fn grow(&mut self, n: usize) -> bool {
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
    }
}

fn refuse(status: StatusCode, message: String) -> Response {
    let mut r = (status, axum::Json(serde_json::json!({"error": {"message": message, "type": "kvmesh_limit"}})))
        .into_response();
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
        return refuse(StatusCode::PAYLOAD_TOO_LARGE, format!("request body of {n} bytes, over the {max}-byte limit"));
    }
    let mut held = Held { budget: budget.clone(), bytes: 0 };
    if let Some(n) = declared {
        if !held.grow(n) {
            return busy(&budget);
        }
    }
    let (parts, body) = req.into_parts();
    let mut stream = body.into_data_stream();
    let mut buf = bytes::BytesMut::with_capacity(declared.unwrap_or(0));
    loop {
        let chunk = match tokio::time::timeout(budget.stall, stream.next()).await {
            Err(_) => {
                return refuse(
                    StatusCode::REQUEST_TIMEOUT,
                    format!("request body stalled for {} s", budget.stall.as_secs()),
                )
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => return refuse(StatusCode::BAD_REQUEST, format!("reading the request body: {e}")),
            Ok(Some(Ok(c))) => c,
        };
        if buf.len() + chunk.len() > max || declared.is_some_and(|n| buf.len() + chunk.len() > n) {
            return refuse(StatusCode::PAYLOAD_TOO_LARGE, format!("request body over the {max}-byte limit"));
        }
        if declared.is_none() && !held.grow(chunk.len()) {
            return busy(&budget);
        }
        buf.extend_from_slice(&chunk);
    }
    let resp = next.run(Request::from_parts(parts, Body::from(buf.freeze()))).await;
    drop(held);
    resp
}

fn busy(budget: &BodyBudget) -> Response {
    refuse(
        StatusCode::SERVICE_UNAVAILABLE,
        format!(
            "request bodies in flight fill the node's {}-byte budget (limits.http_body_budget_bytes); retry shortly",
            budget.budget
        ),
    )
}
