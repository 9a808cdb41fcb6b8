//! The OpenAI-compatible HTTP proxy: route, forward, stream back, release.
//!
//! `/v1/completions` and `/v1/chat/completions` are routed per request (a chat is routed on
//! its whole rendered conversation, so a session's next turn finds the replica holding the
//! previous ones) and forwarded unchanged; server-sent events stream back chunk by chunk. The
//! booking is released when the response ends, fails, or the client goes away (dropping the
//! response drops the upstream request too). Connect failures move on to another replica
//! and take the dead one out at once; 429/503 are backpressure (the replica sits out a
//! backoff, then returns); other 4xx pass through without counting against the replica.

use crate::admit::NotAdmitted;
use crate::endpoints::Api;
use crate::in_flight::InFlight;
use crate::request::{check, parse, read_chat, read_completion, upstream_headers, Checked, Parsed};
use crate::response::{error, error_of_kind, read_usage, stream_through, with_content_type, with_replica};
use crate::state::Shared;
use axum::body::{Body, Bytes};
use axum::extract::DefaultBodyLimit;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvmesh_core::RouteRequest;
use serde_json::json;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use tracing::Instrument;

/// The proxy's routes (plus `/health` and `/metrics`).
///
/// The completion routes read their bodies within the node's body budget
/// ([`crate::body_budget`]): `limits.http_max_body_bytes` each (long multi-turn and multimodal
/// bodies exceed axum's 2 MB default), `limits.http_body_budget_bytes` in all.
pub fn router(shared: Arc<Shared>) -> Router {
    let l = &shared.limits;
    let budget = shared.body_budget.clone();
    let max_body = l.http_max_body_bytes;
    let completions = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route_layer(axum::middleware::from_fn_with_state(budget, crate::body_budget::limit));
    Router::new()
        .merge(completions)
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(shared)
}

/// Any other path: an OpenAI-shaped 404 naming what the node serves.
async fn not_found(uri: axum::http::Uri) -> Response {
    let message = format!(
        "no route {}: this router serves POST /v1/completions and /v1/chat/completions, GET /v1/models, /health \
         and /metrics",
        uri.path()
    );
    error(StatusCode::NOT_FOUND, message)
}

/// A served path asked with another method (`GET /v1/completions`): an OpenAI-shaped 405.
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    error(StatusCode::METHOD_NOT_ALLOWED, format!("{method} is not allowed on {}", uri.path()))
}

async fn completions(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    // The TTFT clock starts before parsing and tokenizing (which may queue on the blocking pool).
    let arrived = tokio::time::Instant::now();
    match parse(&shared, &body, read_completion).await {
        Ok(p) => forward(shared, Api::Completions, &headers, body, p, arrived).await,
        Err(r) => error(r.status, r.message),
    }
}

async fn chat_completions(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let arrived = tokio::time::Instant::now();
    match parse(&shared, &body, read_chat).await {
        Ok(p) => forward(shared, Api::ChatCompletions, &headers, body, p, arrived).await,
        Err(r) => error(r.status, r.message),
    }
}

async fn forward(
    shared: Arc<Shared>,
    api: Api,
    headers: &HeaderMap,
    body: Bytes,
    Parsed { model: asked_model, max_tokens, tokens, exact, stream, cache_salt }: Parsed,
    arrived: tokio::time::Instant,
) -> Response {
    let headers = upstream_headers(headers);
    let (retries, backoff_s) = (shared.settings.retries, shared.settings.overload_backoff_s);
    let Checked { selected, max_tokens, hint } =
        match check(&shared, (asked_model.as_deref(), cache_salt), tokens.len(), max_tokens, &headers) {
            Ok(c) => c,
            Err(r) => {
                shared.metrics.request(r.outcome);
                return error(r.status, r.message);
            }
        };
    // What went wrong on the last replica tried, if one was, and on which side of a
    // disaggregated request.
    let mut last_failure: Option<String> = None;
    let mut last_side: Option<crate::in_flight::Side> = None;
    // Hashed once, outside the core lock.
    let req = RouteRequest::new(&shared.settings.hasher_for(&selected), &tokens, max_tokens)
        .streamed(stream)
        .with_output_hint(hint);
    let span = crate::in_flight::request_span(api.path(), tokens.len(), &shared.policy_name());
    crate::telemetry::parent_from(&span, &headers);
    // Kept across retries: demand counted once, one `max_wait` for all the waits.
    let mut ticket =
        crate::admit::Ticket::new(&shared, crate::admit::Via::Proxy, exact, arrived).for_selected(&selected);
    // Whether a replica already closed the connection on this request unanswered.
    let mut lost_once = false;
    for attempt in 0..=retries {
        span.record("attempts", attempt + 1);
        let crate::admit::Admitted { routed, replica: name, endpoints, at: now, decision_s, decode } =
            match ticket.route(&req, &tokens, max_tokens).await {
                Ok(a) => a,
                Err(NotAdmitted::NoReplica(e)) => {
                    shared.metrics.request("no_replica");
                    span.record("outcome", "no_replica");
                    crate::telemetry::failed(&span, "no_replica");
                    let e = crate::disaggregated::why_unserved(&shared, req.model).unwrap_or_else(|| e.to_string());
                    let message = match &last_failure {
                        Some(f) => format!("{f}; then: {e}"),
                        None => e,
                    };
                    return unavailable(&shared, message, last_side.map(crate::disaggregated::error_type));
                }
                Err(NotAdmitted::Refused(why)) => {
                    shared.metrics.request(why.outcome());
                    span.record("outcome", why.outcome());
                    crate::telemetry::failed(&span, why.outcome());
                    return too_many(&shared, why);
                }
                Err(NotAdmitted::NeverFits(f)) => {
                    shared.metrics.request("too_long");
                    span.record("outcome", "too_long");
                    crate::telemetry::failed(&span, "too_long");
                    return error(StatusCode::BAD_REQUEST, NotAdmitted::never_fits(&f));
                }
            };
        if let Some(decode) = decode {
            use crate::disaggregated::{forward as pd_forward, Legs, Step};
            let n = tokens.len() as u32;
            let legs = Legs::new(
                &shared,
                (routed, name, endpoints),
                decode,
                (now, decision_s),
                n,
                &span,
                arrived,
                (&tokens, &selected),
            );
            match pd_forward(&shared, api, &headers, &body, legs, &span).await {
                Step::Done(r) => return r,
                Step::Retry { failure, exclude, side } => {
                    ticket.exclude(exclude);
                    // Every side that failed is named in the final error, oldest first.
                    last_failure = Some(match last_failure.take() {
                        Some(before) => format!("{before}; {failure}"),
                        None => failure,
                    });
                    last_side = Some(side);
                    continue;
                }
            }
        }
        let mut booking =
            InFlight::routed(&shared, &routed, &name, now, decision_s, tokens.len() as u32, "http", &span, arrived)
                .with_prompt(&tokens, &selected);
        let upstream = tracing::debug_span!(parent: &span, "upstream", otel.kind = "client", replica = %name, attempt = attempt + 1);
        let mut sent_headers = headers.clone();
        crate::telemetry::inject(&upstream, &mut sent_headers);
        if let Some((name, rank)) = endpoints.rank_header() {
            sent_headers.insert(name, rank);
        }
        let sent = shared
            .http
            .post(endpoints.url(api).clone())
            .headers(sent_headers)
            .body(body.clone())
            .send()
            .instrument(upstream.clone())
            .await;
        match &sent {
            Ok(r) if !r.status().is_success() => crate::telemetry::failed(&upstream, r.status().as_str()),
            Err(e) => crate::telemetry::failed(&upstream, &crate::errors::error_chain(e)),
            Ok(_) => {}
        }
        let resp = match sent {
            Ok(r) => r,
            Err(e) if e.is_connect() => {
                last_failure = Some(format!("replica {name} unreachable ({})", crate::errors::error_chain(&e)));
                tracing::warn!(replica = %name, error = %e, "upstream connect failed; trying another replica");
                shared.core().record_down(&name, e.to_string(), shared.now());
                booking.release_retried("upstream_error");
                continue;
            }
            Err(e) if !lost_once && crate::errors::lost_before_response(&e) => {
                // No answer at all: an engine that died or restarted under a pooled
                // connection. Elsewhere, but not back to it for this request, and once per
                // request only: a request that itself crashes engines takes down one more at
                // most. It counts as a failed health check (as a 5xx does), not as down: a
                // keep-alive race with a healthy engine ends the same way.
                lost_once = true;
                let why = crate::errors::error_chain(&e);
                last_failure = Some(format!("replica {name} closed the connection unanswered ({why})"));
                tracing::warn!(replica = %name, error = %e, "upstream closed the connection unanswered; trying another replica");
                shared.core().record_failure(&name, e.to_string(), shared.now());
                ticket.exclude(routed.decision.replica);
                booking.release_retried("upstream_error");
                continue;
            }
            Err(e) => {
                // The replica may be running the request (a timeout): retrying elsewhere would
                // run it twice.
                booking.release(None, "upstream_error");
                let code = if e.is_timeout() { StatusCode::GATEWAY_TIMEOUT } else { StatusCode::BAD_GATEWAY };
                return with_replica(
                    error(code, format!("replica {name} failed: {}", crate::errors::error_chain(&e))),
                    &name,
                );
            }
        };
        let status = resp.status();
        if status == reqwest::StatusCode::TOO_MANY_REQUESTS || status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
            last_failure = Some(format!("replica {name} answered {status}"));
            let now = shared.now();
            shared.core().record_overload(&name, now + backoff_s, now);
            booking.release_retried("backpressure");
            continue;
        }
        if !status.is_success() {
            // A client error (400: prompt too long …) is the request's fault, not the replica's.
            let outcome = if status.is_client_error() { "client_error" } else { "upstream_error" };
            let ct = resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
            let bytes = resp.bytes().await.unwrap_or_default();
            booking.release(None, outcome);
            let code = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            return with_replica(with_content_type(code, ct, Body::from(bytes)), &name);
        }
        let ct = resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
        let streaming = ct.as_ref().and_then(|c| c.to_str().ok()).is_some_and(|c| c.starts_with("text/event-stream"));
        if streaming {
            let r = with_content_type(StatusCode::OK, ct, Body::from_stream(stream_through(resp, booking)));
            return with_replica(r, &name);
        }
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => {
                booking.release(None, "upstream_error");
                let code = if e.is_timeout() { StatusCode::GATEWAY_TIMEOUT } else { StatusCode::BAD_GATEWAY };
                let message = format!("replica {name} failed mid-response: {}", crate::errors::error_chain(&e));
                return with_replica(error(code, message), &name);
            }
        };
        booking.first_token(false);
        let output = read_usage(&shared, &bytes);
        booking.release(output, "ok");
        return with_replica(with_content_type(StatusCode::OK, ct, Body::from(bytes)), &name);
    }
    shared.metrics.request("no_replica");
    span.record("outcome", "no_replica");
    crate::telemetry::failed(&span, "no_replica");
    let last = last_failure.unwrap_or_else(|| "no replica could be tried".into());
    let kind = last_side.map(crate::disaggregated::error_type);
    unavailable(&shared, format!("{last}; no other replica could take the request"), kind)
}

/// 503: no replica could take the request; `Retry-After`: when the first one backing off is back.
fn unavailable(shared: &Shared, message: String, kind: Option<&'static str>) -> Response {
    let mut r = error_of_kind(StatusCode::SERVICE_UNAVAILABLE, message, kind);
    let now = shared.now();
    if let (_, Some(first)) = shared.core().backing_off(now) {
        let after = (first - now).ceil().max(1.0) as u64;
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(after));
    }
    r
}

/// 429 with `Retry-After`: capacity is short and the admission queue refused the request
/// (full, evicted as late, or waited `max_wait`).
fn too_many(shared: &Shared, why: crate::admission::Refused) -> Response {
    let (after, message) = shared.refusal(why);
    let mut r = error(StatusCode::TOO_MANY_REQUESTS, message);
    if let Ok(v) = HeaderValue::from_str(&after.to_string()) {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

async fn models(State(shared): State<Arc<Shared>>) -> Response {
    // Per served model, any healthy replica of it can answer (case C17: the first one may be
    // down); one model's answer passes through as it came, several models' lists are merged.
    let now = shared.now();
    let groups: BTreeMap<String, Vec<(String, String)>> = {
        let core = shared.core();
        let mut v: Vec<_> = core
            .replicas
            .values()
            .map(|r| {
                let model = shared.models.of_replica(r.config.model.as_deref()).to_string();
                (
                    core.status(r, now) != kvmesh_core::ReplicaStatus::Ready,
                    model,
                    r.config.name.clone(),
                    r.endpoints.base.clone(),
                )
            })
            .collect();
        v.sort();
        let mut groups = BTreeMap::<String, Vec<(String, String)>>::new();
        for (_, model, name, url) in v {
            groups.entry(model).or_default().push((name, url));
        }
        groups
    };
    let mut answers = Vec::new();
    for urls in groups.into_values() {
        if let Some(a) = first_models_answer(&shared, urls).await {
            answers.push(a);
        }
    }
    if answers.len() == 1 {
        let (ct, body) = answers.remove(0);
        return with_content_type(StatusCode::OK, ct, Body::from(body));
    }
    let mut data: Vec<Value> = Vec::new();
    for (_, body) in &answers {
        let listed = serde_json::from_slice::<Value>(body).ok().and_then(|v| v.get("data").cloned());
        for m in listed.as_ref().and_then(Value::as_array).into_iter().flatten() {
            if !data.iter().any(|d| d.get("id") == m.get("id")) {
                data.push(m.clone());
            }
        }
    }
    if answers.is_empty() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "no replica answered /v1/models");
    }
    Json(json!({"object": "list", "data": data})).into_response()
}

/// The first successful `/v1/models` answer of `replicas` (name, base URL), tried in order:
/// its content type and body.
async fn first_models_answer(shared: &Shared, replicas: Vec<(String, String)>) -> Option<(Option<HeaderValue>, Bytes)> {
    for (name, url) in replicas {
        let get = shared.http.get(format!("{url}/v1/models")).timeout(std::time::Duration::from_secs(5));
        match get.send().await {
            Ok(r) if r.status().is_success() => {
                let ct = r.headers().get(reqwest::header::CONTENT_TYPE).cloned();
                if let Ok(b) = r.bytes().await {
                    return Some((ct, b));
                }
            }
            Ok(r) => tracing::debug!(replica = %name, status = %r.status(), "models: replica declined"),
            Err(e) => tracing::debug!(replica = %name, error = %e, "models: replica unreachable"),
        }
    }
    None
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    let r = crate::health::Readiness::of(&shared);
    let body = Json(json!({
        "status": if r.stopping {
            "stopping"
        } else if r.removed {
            "removed"
        } else if r.token_refused {
            "cluster_token_refused"
        } else if r.ready() && r.routable == 0 {
            "backing_off"
        } else if r.ready() {
            "ok"
        } else {
            "no_replica_ready"
        },
        "replicas": r.replicas,
        "routable": r.routable,
    }));
    if r.ready() {
        body.into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

/// OpenMetrics, or Prometheus' classic text when `Accept` asks for it and not for OpenMetrics
/// (see [`crate::metrics_text`]).
async fn metrics(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    use crate::metrics_text::{to_classic, wants_classic, CLASSIC, OPENMETRICS};
    let text = crate::metrics_page::render(&shared);
    if wants_classic(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok())) {
        return ([(header::CONTENT_TYPE, CLASSIC)], to_classic(&text)).into_response();
    }
    ([(header::CONTENT_TYPE, OPENMETRICS)], text).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    /// The client's side of `stream_through` over an upstream that sends `chunks`, and the
    /// outcome the booking was released with.
    async fn through(chunks: &[&'static str]) -> (String, &'static str) {
        let (text, page) = through_with_page(chunks).await;
        let outcome = ["ok", "upstream_error"]
            .into_iter()
            .find(|o| page.contains(&format!("kvmesh_requests_total{{outcome=\"{o}\"}} 1\n")))
            .expect("one outcome counted");
        (text, outcome)
    }

    /// The stream passed through, and the node's metrics page after it.
    async fn through_with_page(chunks: &[&'static str]) -> (String, String) {
        let shared = Arc::new(crate::state::test_node(Default::default()));
        let replica = "name = \"e0\"\nhttp = \"http://127.0.0.1:9\"\ncapacity_blocks = 100";
        shared.add_replica(toml::from_str(replica).unwrap()).unwrap();
        let req = RouteRequest {
            prompt_tokens: 16,
            hashes: vec![],
            max_tokens: Some(4),
            prompt_key: 1,
            key: 1,
            streamed: true,
            output_hint: None,
            model: None,
        };
        let routed = {
            let mut core = shared.core();
            let decision = core.decide(&req, 0.0).unwrap();
            core.book(&req, decision, 0.0).unwrap().0
        };
        let booking = InFlight {
            shared: shared.clone(),
            id: Some(routed.booking),
            replica: "e0".into(),
            first_token_seen: false,
            span: tracing::Span::none(),
            prompt_tokens: 16,
            overlap_blocks: 0,
            routed_at: 0.0,
            arrived: tokio::time::Instant::now(),
            prompt: None,
            side: crate::in_flight::Side::Whole,
        };
        let parts: Vec<Result<Bytes, std::io::Error>> = chunks.iter().map(|c| Ok(Bytes::from(*c))).collect();
        let body = reqwest::Body::wrap_stream(futures_util::stream::iter(parts));
        let resp = reqwest::Response::from(axum::http::Response::new(body));
        let out: Vec<_> = stream_through(resp, booking).collect().await;
        let text = out.into_iter().map(|c| String::from_utf8(c.unwrap().to_vec()).unwrap()).collect();
        assert!(shared.core().fleet.bookings().is_empty(), "released");
        (text, crate::metrics_page::render(&shared))
    }

    const ERROR: &str = "data: {\"error\":{\"code\":502,\"message\":\"replica e0 failed mid-stream: the stream \
                         ended without `data: [DONE]`\",\"type\":\"upstream_error\"}}\n\n";

    #[tokio::test]
    async fn a_stream_that_ends_with_done_is_passed_through_as_it_is_even_split_mid_marker() {
        let chunks = ["data: {\"t\":1}\n\n", "data: [DO", "NE]\n\n"];
        assert_eq!(through(&chunks).await, (chunks.concat(), "ok"));
        let crlf = ["data: {\"t\":1}\r\n\r\ndata: [DONE]\r\n\r\n"];
        assert_eq!(through(&crlf).await, (crlf.concat(), "ok"));
    }

    #[tokio::test]
    async fn a_stream_that_ends_without_done_gets_an_error_event_after_its_last_whole_event() {
        let whole = "data: {\"t\":1}\n\n";
        assert_eq!(through(&[whole]).await, (format!("{whole}{ERROR}"), "upstream_error"));
        // A half-sent event is dropped, so the client reads the error, not a broken line.
        assert_eq!(through(&[whole, "data: {\"t\""]).await, (format!("{whole}{ERROR}"), "upstream_error"));
        // The marker inside a token's text is no end.
        let text = "data: {\"text\":\"data: [DONE]\"}\n\n";
        assert_eq!(through(&[text]).await, (format!("{text}{ERROR}"), "upstream_error"));
    }

    #[tokio::test]
    async fn a_streams_usage_chunk_counts_the_engines_cached_tokens_once() {
        // `stream_options.include_usage`: a last chunk with the usage and no choices (vLLM).
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":300,\"completion_tokens\":2,\
                     \"prompt_tokens_details\":{\"cached_tokens\":288}}}\n\n";
        let chunks = ["data: {\"t\":1}\n\n", "data: {\"t\":2}\n\n", usage, "data: [DONE]\n\n"];
        let (text, page) = through_with_page(&chunks).await;
        assert_eq!(text, chunks.concat());
        assert!(page.contains("kvmesh_engine_cached_tokens_total 288\n"), "{page}");
        // Without a usage chunk nothing is counted.
        let (_, page) = through_with_page(&["data: {\"t\":1}\n\n", "data: [DONE]\n\n"]).await;
        assert!(page.contains("kvmesh_engine_cached_tokens_total 0\n"), "{page}");
    }
}
