//! The proxy's prefill/decode-disaggregated flow: one request, a prefill replica and a
//! decode replica picked and booked together ([`kvmesh_core::Fleet::decide_pd`]), handed from
//! one to the other as the engines expect, streamed back to the client as a whole request is.
//!
//! - **vLLM** (a KV connector such as `NixlConnector`; the flow of vLLM's
//!   `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`): the prefill leg is the
//!   request with `kv_transfer_params` `{do_remote_decode: true, …}`, `max_tokens` 1 (and
//!   `max_completion_tokens`, if given), not streamed, without `stream_options`, `min_tokens`
//!   and `min_completion_tokens`; its answer's `kv_transfer_params` (the prefill replica's
//!   engine id, block ids, host and port) go into the request sent to the decode replica,
//!   whose answer is the client's. Both legs carry one `X-Request-Id`.
//! - **SGLang** (`--disaggregation-mode`; sgl-model-gateway's PD router): both sides get the
//!   request with `bootstrap_host` (the prefill replica's host), `bootstrap_port` (its
//!   `bootstrap_port`, default 8998) and a random `bootstrap_room`, at once; the decode
//!   replica's answer is the client's, the prefill replica's is read and dropped.
//!
//! Failures, before any byte reaches the client: a prefill replica that cannot be reached,
//! is overloaded (429/503), fails (5xx, a timeout) or answers 200 with no JSON is left out and
//! the request is decided again — a prefill leg runs again harmlessly. A decode replica that
//! refuses the request (unreachable, 429/503, 5xx) is left out and the request decided again
//! with a fresh prefill; one that took it and then failed without an answer (a timeout, a
//! reset) is not sent it again: one request is never decoded twice. With SGLang, a decode
//! side that answered is the client's answer whatever the prefill side's answer was. A client error (4xx) of either side
//! is the request's and goes back to the client. Every booking is released on every path;
//! failures count in `kvmesh_pd_errors_total{side, kind}` and the final answer's error type
//! names the side (`prefill_error`, `decode_error`).

use crate::admit::Leg;
use crate::endpoints::{Api, Endpoints};
use crate::in_flight::{InFlight, Side};
use crate::response::{error_of_kind, read_usage_from, stream_through, with_content_type, with_replica};
use crate::state::Shared;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use tracing::Instrument;

mod wire;
use wire::prefill_leg;
pub(crate) use wire::{bootstrap, random_u64};

/// What one disaggregated attempt came to.
pub(crate) enum Step {
    /// The client's answer (success, or an error that is the request's own).
    Done(Response),
    /// Try again with `exclude` left out: `failure` says what went wrong, on `side`.
    Retry { failure: String, exclude: kvmesh_core::ReplicaId, side: Side },
}

/// A disaggregated request's two booked sides, followed to their ends.
pub(crate) struct Legs {
    pub prefill: InFlight,
    pub prefill_id: kvmesh_core::ReplicaId,
    pub prefill_endpoints: Arc<Endpoints>,
    pub decode: InFlight,
    pub decode_id: kvmesh_core::ReplicaId,
    pub decode_endpoints: Arc<Endpoints>,
}

impl Legs {
    /// Follows the prefill side `(routed, replica, endpoints)` and the decode side `decode`,
    /// both decided at `at` in `decision_s` for a prompt of `prompt_tokens` (see
    /// [`InFlight::routed_side`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shared: &Arc<Shared>,
        (routed, replica, endpoints): (kvmesh_core::Routed, String, Arc<Endpoints>),
        decode: Leg,
        (at, decision_s): (f64, f64),
        prompt_tokens: u32,
        span: &tracing::Span,
        arrived: tokio::time::Instant,
        prompt: (&Arc<[u32]>, &crate::models::Selected),
    ) -> Legs {
        let side = |routed: &kvmesh_core::Routed, name: &str, side: Side| {
            InFlight::routed_side(shared, routed, name, (at, decision_s), prompt_tokens, "http", span, arrived, side)
                .with_prompt(prompt.0, prompt.1)
        };
        Legs {
            prefill: side(&routed, &replica, Side::Prefill),
            prefill_id: routed.decision.replica,
            prefill_endpoints: endpoints,
            decode: side(&decode.routed, &decode.replica, Side::Decode),
            decode_id: decode.routed.decision.replica,
            decode_endpoints: decode.endpoints,
        }
    }
}

/// How a failed hand-off counts and what happens next.
fn failed(shared: &Shared, legs: &mut Legs, side: Side, kind: &'static str, failure: String) -> Step {
    let (name, id) = match side {
        Side::Decode => (legs.decode.replica.clone(), legs.decode_id),
        _ => (legs.prefill.replica.clone(), legs.prefill_id),
    };
    count(shared, side, kind);
    tracing::warn!(replica = %name, side = side_name(side), kind, error = %failure, "disaggregated hand-off failed; the side is left out of the request's retries");
    let outcome = if side == Side::Decode { "decode_error" } else { "prefill_error" };
    // Only the failing side's replica is charged; the other was not (or is no longer) at fault.
    // The request goes on: its own outcome is counted where it ends.
    if side == Side::Decode {
        legs.prefill.release_untouched(outcome);
        legs.decode.release_retried(outcome);
    } else {
        legs.prefill.release_retried(outcome);
        legs.decode.release_untouched(outcome);
    }
    Step::Retry { failure, exclude: id, side }
}

fn count(shared: &Shared, side: Side, kind: &'static str) {
    let labels = vec![("side", side_name(side).to_string()), ("kind", kind.to_string())];
    shared.metrics.pd_errors.get_or_create(&labels).inc();
}

/// Why a request for `model` finds no replica, when the reason is a disaggregated model with
/// a side missing (and no `both` replica to serve it whole); `None` otherwise.
pub(crate) fn why_unserved(shared: &Shared, model: Option<kvmesh_core::ModelKey>) -> Option<String> {
    let core = shared.core();
    let key = model.unwrap_or(core.fleet.hasher().model());
    let disaggregated = core
        .fleet
        .replicas()
        .iter()
        .any(|r| r.spec.role != kvmesh_core::Role::Both && (key == kvmesh_core::ModelKey::ANY || r.model == key));
    let [both, prefill, decode] = core.fleet.routable_roles(model);
    if !disaggregated || both > 0 || (prefill > 0 && decode > 0) {
        return None;
    }
    let lacking = match (prefill, decode) {
        (0, 0) => "neither side has a routable replica",
        (0, _) => "no prefill replica is routable",
        _ => "no decode replica is routable",
    };
    Some(format!(
        "this model is served disaggregated and {lacking} ({prefill} prefill and {decode} decode replicas routable), \
         and it has no routable `both` replica to serve it whole"
    ))
}

/// `prefill` or `decode`.
pub(crate) fn side_name(side: Side) -> &'static str {
    if side == Side::Decode {
        "decode"
    } else {
        "prefill"
    }
}

/// The error type a client sees for a failure on `side`.
pub(crate) fn error_type(side: Side) -> &'static str {
    if side == Side::Decode {
        "decode_error"
    } else {
        "prefill_error"
    }
}

/// The prefill side's request failed without an answer: left out and decided again (a
/// prefill leg runs again harmlessly); an unreachable replica is marked down.
fn prefill_unsent(shared: &Shared, mut legs: Legs, e: &reqwest::Error) -> Step {
    let name = legs.prefill.replica.clone();
    let failure = format!("prefill replica {name} failed: {}", crate::errors::error_chain(e));
    if e.is_connect() {
        shared.core().record_down(&name, e.to_string(), shared.now());
        return failed(shared, &mut legs, Side::Prefill, "unreachable", failure);
    }
    failed(shared, &mut legs, Side::Prefill, "failed", failure)
}

/// Runs one attempt of the disaggregated flow for `body` (the client's JSON request, `api`),
/// with `headers` (the client's, hop-by-hop ones dropped) on `legs`.
pub(crate) async fn forward(
    shared: &Arc<Shared>,
    api: Api,
    headers: &HeaderMap,
    body: &Bytes,
    mut legs: Legs,
    span: &tracing::Span,
) -> Step {
    let Ok(Value::Object(mut request)) = serde_json::from_slice::<Value>(body) else {
        // Parsed once already; only a body that is JSON but not an object gets here.
        legs.prefill.release(None, "bad_request");
        legs.decode.release(None, "bad_request");
        return Step::Done(error_of_kind(StatusCode::BAD_REQUEST, "the body must be a JSON object", None));
    };
    // The hand-over is the router's to set: a client's own transfer parameters or bootstrap
    // fields would point an engine at a host of the client's choosing.
    for k in ["kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"] {
        request.remove(k);
    }
    let (engine, bootstrap_port) = {
        let core = shared.core();
        let r = core.replicas.get(&legs.prefill.replica);
        (r.map(|r| r.config.engine.clone()), r.and_then(|r| r.config.bootstrap_port))
    };
    let mut headers = headers.clone();
    if !headers.contains_key("x-request-id") {
        headers.insert(
            "x-request-id",
            HeaderValue::from_str(&format!("kvmesh-{:016x}", random_u64()))
                .unwrap_or(HeaderValue::from_static("kvmesh")),
        );
    }
    if engine.as_deref() == Some("sglang") {
        return sglang(shared, api, &headers, request, legs, bootstrap_port, span).await;
    }
    vllm(shared, api, &headers, request, legs, span).await
}

/// POSTs `body` to one side's replica, its data-parallel rank and the trace context added.
async fn send(
    shared: &Shared,
    endpoints: &Endpoints,
    api: Api,
    headers: &HeaderMap,
    body: Vec<u8>,
    span: &tracing::Span,
    side: Side,
) -> Result<reqwest::Response, reqwest::Error> {
    let upstream = tracing::debug_span!(parent: span, "upstream", otel.kind = "client", side = side_name(side));
    let mut sent = headers.clone();
    crate::telemetry::inject(&upstream, &mut sent);
    if let Some((name, rank)) = endpoints.rank_header() {
        sent.insert(name, rank);
    }
    shared.http.post(endpoints.url(api).clone()).headers(sent).body(body).send().instrument(upstream).await
}

/// The vLLM flow: prefill leg, then decode with its `kv_transfer_params`.
async fn vllm(
    shared: &Arc<Shared>,
    api: Api,
    headers: &HeaderMap,
    mut request: Map<String, Value>,
    mut legs: Legs,
    span: &tracing::Span,
) -> Step {
    let leg = prefill_leg(&request);
    let sent = send(shared, &legs.prefill_endpoints, api, headers, leg, span, Side::Prefill).await;
    let resp = match sent {
        Ok(r) => r,
        Err(e) => return prefill_unsent(shared, legs, &e),
    };
    if let Some(step) = refused(shared, &mut legs, Side::Prefill, resp.status()) {
        return settle(step, resp, legs, Side::Prefill).await;
    }
    let answer = match resp.bytes().await {
        Ok(b) => b,
        Err(e) => {
            let failure =
                format!("prefill replica {} broke off: {}", legs.prefill.replica, crate::errors::error_chain(&e));
            return failed(shared, &mut legs, Side::Prefill, "failed", failure);
        }
    };
    let Ok(mut answer_json) = serde_json::from_slice::<Value>(&answer) else {
        let failure = format!("prefill replica {} answered 200 with a body that is not JSON", legs.prefill.replica);
        return failed(shared, &mut legs, Side::Prefill, "failed", failure);
    };
    // The prompt's cache hits are the prefill side's (the decode side counts received KV as
    // cached).
    let _ = read_usage_from(shared, &answer, true);
    legs.prefill.first_token(false);
    legs.prefill.release(None, "ok");
    let params = answer_json.get_mut("kv_transfer_params").map(Value::take);
    match params.filter(|p| !p.is_null()) {
        Some(p) => {
            request.insert("kv_transfer_params".into(), p);
        }
        None => {
            // A prefill replica without a KV connector: the decode replica computes the
            // prompt itself (as vLLM's own proxy goes on), slowly but correctly.
            count(shared, Side::Prefill, "no_transfer_params");
            tracing::warn!(replica = %legs.prefill.replica, "prefill answer without kv_transfer_params: is --kv-transfer-config set on it?");
        }
    }
    let body = serde_json::to_vec(&request).unwrap_or_default();
    decode(shared, api, headers, body, legs, span).await
}

/// The SGLang flow: both sides at once with the bootstrap fields.
async fn sglang(
    shared: &Arc<Shared>,
    api: Api,
    headers: &HeaderMap,
    mut request: Map<String, Value>,
    mut legs: Legs,
    port: Option<u16>,
    span: &tracing::Span,
) -> Step {
    let (host, port, room) = bootstrap(&legs.prefill_endpoints, port);
    request.insert("bootstrap_host".into(), json!(host));
    request.insert("bootstrap_port".into(), json!(port));
    request.insert("bootstrap_room".into(), json!(room));
    let body = serde_json::to_vec(&request).unwrap_or_default();
    let (prefill, decode) = tokio::join!(
        send(shared, &legs.prefill_endpoints, api, headers, body.clone(), span, Side::Prefill),
        send(shared, &legs.decode_endpoints, api, headers, body, span, Side::Decode),
    );
    // The decode side first: a decode that answered is the client's answer whatever became of
    // the prefill side's (its KV arrived, or the decode could not have answered).
    let decode = match decode {
        Ok(r) => match refused(shared, &mut legs, Side::Decode, r.status()) {
            // Refused before decoding: decided again (a fresh room) unless it is the client's.
            Some(step) => return settle(step, r, legs, Side::Decode).await,
            None => r,
        },
        Err(e) => return decode_unsent(shared, legs, &e),
    };
    let Legs { prefill: mut prefill_leg, decode: decode_leg, .. } = legs;
    let prefill_name = prefill_leg.replica.clone();
    // The prefill side's answer is read to its end in the background; its booking ends there.
    let drain = shared.clone();
    tokio::spawn(async move {
        let outcome = match prefill {
            Ok(r) if r.status().is_success() => match r.bytes().await {
                Ok(b) => {
                    prefill_leg.first_token(false);
                    let _ = read_usage_from(&drain, &b, true);
                    "ok"
                }
                Err(_) => "upstream_error",
            },
            _ => "upstream_error",
        };
        if outcome != "ok" {
            count(&drain, Side::Prefill, "failed");
        }
        prefill_leg.release(None, outcome);
    });
    answer(shared, decode, decode_leg, &prefill_name).await
}

/// Sends the decode side its request and answers the client with its response.
async fn decode(
    shared: &Arc<Shared>,
    api: Api,
    headers: &HeaderMap,
    body: Vec<u8>,
    mut legs: Legs,
    span: &tracing::Span,
) -> Step {
    match send(shared, &legs.decode_endpoints, api, headers, body, span, Side::Decode).await {
        Ok(resp) => match refused(shared, &mut legs, Side::Decode, resp.status()) {
            Some(step) => settle(step, resp, legs, Side::Decode).await,
            None => {
                let prefill = legs.prefill.replica.clone();
                answer(shared, resp, legs.decode, &prefill).await
            }
        },
        Err(e) => decode_unsent(shared, legs, &e),
    }
}

/// The decode side's request failed without an answer: a connect failure (it never got the
/// request) is decided again with a fresh prefill; any other failure (a timeout, a reset
/// after sending) may have left it decoding, so it is not sent again — the client gets a
/// `decode_error`.
fn decode_unsent(shared: &Shared, mut legs: Legs, e: &reqwest::Error) -> Step {
    let name = legs.decode.replica.clone();
    let failure = format!("decode replica {name} failed: {}", crate::errors::error_chain(e));
    if e.is_connect() {
        shared.core().record_down(&name, e.to_string(), shared.now());
        return failed(shared, &mut legs, Side::Decode, "unreachable", failure);
    }
    count(shared, Side::Decode, "failed");
    tracing::warn!(replica = %name, error = %failure, "decode replica took the request and failed; not sent again");
    legs.prefill.release(None, "decode_error");
    legs.decode.release(None, "upstream_error");
    let code = if e.is_timeout() { StatusCode::GATEWAY_TIMEOUT } else { StatusCode::BAD_GATEWAY };
    Step::Done(with_replica(error_of_kind(code, failure, Some("decode_error")), &name))
}

/// The decode side's successful response to the client: streamed through, or whole.
async fn answer(shared: &Arc<Shared>, resp: reqwest::Response, mut decode: InFlight, prefill: &str) -> Step {
    let name = decode.replica.clone();
    let ct = resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
    let streaming = ct.as_ref().and_then(|c| c.to_str().ok()).is_some_and(|c| c.starts_with("text/event-stream"));
    if streaming {
        let r = with_content_type(StatusCode::OK, ct, Body::from_stream(stream_through(resp, decode)));
        return Step::Done(with_prefill(with_replica(r, &name), prefill));
    }
    match resp.bytes().await {
        Ok(bytes) => {
            decode.first_token(false);
            let output = read_usage_from(shared, &bytes, false);
            decode.release(output, "ok");
            let r = with_content_type(StatusCode::OK, ct, Body::from(bytes));
            Step::Done(with_prefill(with_replica(r, &name), prefill))
        }
        Err(e) => {
            // Bytes of the answer may have been generated: never decoded again.
            count(shared, Side::Decode, "failed");
            decode.release(None, "upstream_error");
            let code = if e.is_timeout() { StatusCode::GATEWAY_TIMEOUT } else { StatusCode::BAD_GATEWAY };
            let message = format!("decode replica {name} failed mid-response: {}", crate::errors::error_chain(&e));
            Step::Done(with_replica(error_of_kind(code, message, Some("decode_error")), &name))
        }
    }
}

/// Carries out a [`Refusal`] of `resp`: a retry as decided, or the client error passed back
/// (both bookings released).
async fn settle(r: Refusal, resp: reqwest::Response, mut legs: Legs, side: Side) -> Step {
    match r {
        Refusal::Retry(step) => step,
        Refusal::Client => {
            let replica = if side == Side::Decode { legs.decode.replica.clone() } else { legs.prefill.replica.clone() };
            let r = client_error(resp, &replica).await;
            legs.prefill.release(None, "client_error");
            legs.decode.release(None, "client_error");
            Step::Done(r)
        }
    }
}

/// What a side's error status means.
enum Refusal {
    /// Decide again without the replica.
    Retry(Step),
    /// The request's own fault (4xx but 429): back to the client.
    Client,
}

/// `None` for a success status; otherwise what to do (overload marks the replica).
fn refused(shared: &Shared, legs: &mut Legs, side: Side, status: reqwest::StatusCode) -> Option<Refusal> {
    if status.is_success() {
        return None;
    }
    let name = if side == Side::Decode { legs.decode.replica.clone() } else { legs.prefill.replica.clone() };
    if status == reqwest::StatusCode::TOO_MANY_REQUESTS || status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
        let now = shared.now();
        shared.core().record_overload(&name, now + shared.settings.overload_backoff_s, now);
        let failure = format!("{} replica {name} answered {status}", side_name(side));
        return Some(Refusal::Retry(failed(shared, legs, side, "overloaded", failure)));
    }
    if status.is_client_error() {
        return Some(Refusal::Client);
    }
    let failure = format!("{} replica {name} answered {status}", side_name(side));
    // Counted as a failed scrape is: `unhealthy_after` in a row take it out.
    let _ = shared.core().record_failure(&name, failure.clone(), shared.now());
    Some(Refusal::Retry(failed(shared, legs, side, "failed", failure)))
}

/// A side's client-error answer, passed through as it came.
async fn client_error(resp: reqwest::Response, replica: &str) -> Response {
    let code = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ct = resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
    let bytes = resp.bytes().await.unwrap_or_default();
    with_replica(with_content_type(code, ct, Body::from(bytes)), replica)
}

/// Names the prefill replica of a disaggregated answer (`x-kvmesh-prefill-replica`).
fn with_prefill(mut r: Response, replica: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(replica) {
        r.headers_mut().insert("x-kvmesh-prefill-replica", v);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_leg_asks_for_a_remote_decode_of_one_unstreamed_token() {
        let request = json!({"model": "m", "prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50,
            "stream": true, "stream_options": {"include_usage": true}, "min_tokens": 3, "temperature": 0.5});
        let Value::Object(request) = request else { unreachable!() };
        let leg: Value = serde_json::from_slice(&prefill_leg(&request)).unwrap();
        assert_eq!(
            leg,
            json!({"model": "m", "prompt": "hi", "max_tokens": 1, "max_completion_tokens": 1, "stream": false,
                "temperature": 0.5, "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}})
        );
    }
}
