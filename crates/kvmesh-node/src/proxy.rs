//! The OpenAI-compatible HTTP proxy: route, forward, stream back, release.
//!
//! `/v1/completions` and `/v1/chat/completions` are routed per request (a chat is routed on
//! its whole rendered conversation, so a session's next turn finds the replica holding the
//! previous ones) and forwarded unchanged; server-sent events stream back chunk by chunk. The
//! booking is released when the response ends, fails, or the client goes away (dropping the
//! response drops the upstream request too). Connect failures move on to another replica
//! and take the dead one out at once; 429/503 are backpressure (the replica sits out a
//! backoff, then returns); other 4xx pass through without counting against the replica.

use crate::admission::NotAdmitted;
use crate::in_flight::InFlight;
use crate::replica::endpoints::Api;
use crate::state::Shared;
use axum::body::{Body, Bytes};
use axum::extract::DefaultBodyLimit;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use kvmesh_core::RouteRequest;
use serde::Deserialize;
use serde_json::json;
use serde_json::Value;
use std::borrow::Cow;
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
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(shared)
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    error_of_kind(status, message, None)
}

/// An OpenAI-shaped error answer; `kind` overrides the type the status implies (a
/// disaggregated request's `prefill_error` / `decode_error`).
pub(crate) fn error_of_kind(status: StatusCode, message: impl Into<String>, kind: Option<&'static str>) -> Response {
    let message = message.into();
    // OpenAI's error types: a 429 is `rate_limit_exceeded` to its clients.
    let kind = kind.unwrap_or(match status {
        StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => "invalid_request_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_exceeded",
        StatusCode::GATEWAY_TIMEOUT => "timeout",
        _ => "service_unavailable",
    });
    (status, Json(json!({"error": {"message": message, "type": kind, "code": status.as_u16()}}))).into_response()
}

/// The client's output-length hint: the [`HINT_HEADER`] header as a positive whole number of
/// tokens, if sent.
///
/// # Errors
/// A message for a 400 when the header is not a number from 1 to 4,294,967,295.
fn expected_output_tokens(headers: &HeaderMap) -> Result<Option<u32>, String> {
    let Some(v) = headers.get(HINT_HEADER) else { return Ok(None) };
    match v.to_str().ok().and_then(|s| s.trim().parse::<u32>().ok()).filter(|&n| n > 0) {
        Some(n) => Ok(Some(n)),
        None => Err(format!("{HINT_HEADER} must be a whole number of tokens from 1 to {}, got {v:?}", u32::MAX)),
    }
}

/// The request header carrying a client's expected output length, tokens (an agent harness
/// or RL trainer that knows its length class); gRPC `Route`'s `expected_output_tokens`.
pub const HINT_HEADER: &str = "x-kvmesh-expected-output-tokens";

/// Request headers passed to the engine: everything but hop-by-hop headers and the ones the
/// client connection defines (`Authorization` for vLLM's `--api-key` included).
fn upstream_headers(headers: &HeaderMap) -> HeaderMap {
    // The router picks the data-parallel rank: a client's own rank header never passes.
    const SKIP: [&str; 10] = [
        crate::replica::endpoints::DATA_PARALLEL_RANK_HEADER,
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ];
    let mut out = HeaderMap::with_capacity(headers.len());
    for (k, v) in headers {
        if !SKIP.contains(&k.as_str()) {
            out.append(k.clone(), v.clone());
        }
    }
    // The body was read as JSON whatever the client declared; say so to the engine.
    out.entry(header::CONTENT_TYPE).or_insert(HeaderValue::from_static("application/json"));
    out
}

/// A request's routing inputs once [`check`]ed.
pub(crate) struct Checked {
    /// The model, or LoRA adapter, its `model` names (vLLM's OpenAI server).
    pub selected: crate::models::Selected,
    /// Its `max_tokens` (or `max_completion_tokens`), tokens.
    pub max_tokens: Option<u32>,
    /// The client's output-length hint ([`HINT_HEADER`]), tokens.
    pub hint: Option<u32>,
}

/// Why a request is refused before routing: the HTTP status, the client's message and the
/// `kvmesh_requests_total` outcome.
pub(crate) struct Rejected {
    pub status: StatusCode,
    pub message: String,
    pub outcome: &'static str,
}

impl Rejected {
    /// A 400 `bad_request`.
    fn bad(message: String) -> Rejected {
        Rejected { status: StatusCode::BAD_REQUEST, message, outcome: "bad_request" }
    }
}

/// The checks every routed request passes before it is decided, the proxy's and the
/// endpoint picker's alike: the model asked for is served ([`crate::models::ServedModels::select`];
/// the selection carries `cache_salt`),
/// the prompt (`prompt_tokens`) is within `node.max_prompt_tokens`, and the output-length
/// hint in `headers` is well formed.
///
/// # Errors
/// [`Rejected`]: 404 `unknown_model`, 413 `too_long`, 400 `bad_request`.
pub(crate) fn check(
    shared: &Shared,
    (asked_model, cache_salt): (Option<&str>, Option<String>),
    prompt_tokens: usize,
    max_tokens: Option<u64>,
    headers: &HeaderMap,
) -> Result<Checked, Rejected> {
    let mut selected = shared.models.select(asked_model).map_err(|e| Rejected {
        status: StatusCode::NOT_FOUND,
        message: e.to_string(),
        outcome: "unknown_model",
    })?;
    let model = shared.models.of_replica(selected.model.as_deref());
    if let Some(message) = selected.adapter.as_deref().and_then(|a| shared.core().adapter_unserved(model, a)) {
        return Err(Rejected { status: StatusCode::NOT_FOUND, message, outcome: "unknown_model" });
    }
    selected.salt = cache_salt;
    let limit = shared.settings.max_prompt_tokens;
    if prompt_tokens > limit as usize {
        return Err(Rejected {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "the prompt has {prompt_tokens} tokens; this router accepts at most {limit} (node.max_prompt_tokens)"
            ),
            outcome: "too_long",
        });
    }
    let hint = expected_output_tokens(headers).map_err(|message| Rejected {
        status: StatusCode::BAD_REQUEST,
        message,
        outcome: "bad_request",
    })?;
    Ok(Checked { selected, max_tokens: max_tokens.map(|n| n.min(u32::MAX as u64) as u32), hint })
}

/// The request fields routing reads (everything else passes through untouched); borrowed
/// from the body, no JSON tree built.
#[derive(Deserialize)]
struct RequestFields<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt: Option<Prompt<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Ids(Vec<u64>),
    Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(#[serde(borrow)] Vec<Part<'a>>),
    Other(serde::de::IgnoredAny),
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// What routing needs from a request body: the model asked for, `max_tokens`, the prompt's
/// token ids, and whether their count is the engine's (token ids given, or a model
/// tokenizer) or an estimate.
pub(crate) struct Parsed {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub tokens: Arc<[u32]>,
    pub exact: bool,
    /// The client asked for a streamed answer (its first token is seen when it comes).
    pub stream: bool,
    /// vLLM's `cache_salt`: the request's prefix cache is its tenant's own (vLLM salts the
    /// first block's hash with it), so only blocks stored with the same salt are overlap.
    pub cache_salt: Option<String>,
}

impl Parsed {
    fn new(f: &RequestFields<'_>, tokens: Vec<u32>, exact: bool) -> Parsed {
        Parsed {
            model: f.model.as_deref().map(str::to_string),
            max_tokens: f.max_tokens.or(f.max_completion_tokens),
            tokens: tokens.into(),
            exact,
            stream: f.stream.unwrap_or(false),
            cache_salt: f.cache_salt.as_deref().filter(|s| !s.is_empty()).map(str::to_string),
        }
    }
}

/// Bodies at least this large are parsed and tokenized on tokio's blocking pool: a real
/// tokenizer on a long prompt (or chat template) takes milliseconds, which would hold up every
/// other request on the proxy's thread. Smaller ones stay inline (the hand-off would cost more).
const INLINE_BODY_BYTES: usize = 16 * 1024;

/// Reads a request body of one API: [`read_completion`] or [`read_chat`].
pub(crate) type Reader = fn(&Shared, &[u8]) -> Result<Parsed, Rejected>;

/// Runs `read` on `body`, inline or (for large bodies) on the blocking pool; a client error
/// counts as `bad_request`.
///
/// # Errors
/// What `read` refuses, or a 500 when the blocking pool's task failed.
pub(crate) async fn parse(shared: &Arc<Shared>, body: &Bytes, read: Reader) -> Result<Parsed, Rejected> {
    let parsed = if body.len() < INLINE_BODY_BYTES {
        read(shared, body)
    } else {
        let (s, b) = (shared.clone(), body.clone());
        tokio::task::spawn_blocking(move || read(&s, &b)).await.unwrap_or_else(|e| {
            Err(Rejected {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("reading the request failed: {e}"),
                outcome: "internal_error",
            })
        })
    };
    if parsed.as_ref().is_err_and(|r| r.status.is_client_error()) {
        shared.metrics.request("bad_request");
    }
    parsed
}

pub(crate) fn read_completion(shared: &Shared, body: &[u8]) -> Result<Parsed, Rejected> {
    let f = serde_json::from_slice::<RequestFields<'_>>(body)
        .map_err(|e| Rejected::bad(format!("the body is not a JSON completion request: {e}")))?;
    let exact = shared.tokenizer.exact(false);
    let (tokens, exact) = match &f.prompt {
        Some(Prompt::Text(p)) => (shared.tokenizer.encode(p), exact),
        Some(Prompt::Ids(ids)) if !ids.is_empty() => {
            (ids.iter().map(|&t| t.min(u32::MAX as u64) as u32).collect(), true)
        }
        // A batch of prompts: route on the first (they share one replica).
        Some(Prompt::Texts(ps)) if !ps.is_empty() => (shared.tokenizer.encode(&ps[0]), exact),
        _ => return Err(Rejected::bad("prompt must be a string, strings, or token ids".into())),
    };
    Ok(Parsed::new(&f, tokens, exact))
}

pub(crate) fn read_chat(shared: &Shared, body: &[u8]) -> Result<Parsed, Rejected> {
    let f = serde_json::from_slice::<RequestFields<'_>>(body)
        .map_err(|e| Rejected::bad(format!("the body is not a JSON chat completion request: {e}")))?;
    let Some(messages) = &f.messages else {
        return Err(Rejected::bad("messages must be an array".into()));
    };
    let parts: Vec<(&str, String)> = messages
        .iter()
        .map(|m| {
            let content = match &m.content {
                Some(Content::Text(c)) => c.to_string(),
                Some(Content::Parts(ps)) => ps.iter().filter_map(|p| p.text.as_deref()).collect(),
                _ => String::new(),
            };
            (m.role.as_deref().unwrap_or("user"), content)
        })
        .collect();
    let messages: Vec<(&str, &str)> = parts.iter().map(|(r, c)| (*r, c.as_str())).collect();
    let tokens = shared.tokenizer.encode_chat(&messages);
    Ok(Parsed::new(&f, tokens, shared.tokenizer.exact(true)))
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
    // Kept across retries: demand counted once, one `max_wait_s` for all the waits.
    let mut ticket =
        crate::admission::Ticket::new(&shared, crate::admission::Via::Proxy, exact, arrived).for_selected(&selected);
    for attempt in 0..=retries {
        span.record("attempts", attempt + 1);
        let crate::admission::Admitted { routed, replica: name, endpoints, at: now, decision_s, decode } =
            match ticket.route(&req, &tokens, max_tokens).await {
                Ok(a) => a,
                Err(NotAdmitted::NoReplica(e)) => {
                    shared.metrics.request("no_replica");
                    crate::telemetry::failed(&span, "no_replica");
                    let e = crate::disaggregated::why_unserved(&shared, req.model).unwrap_or_else(|| e.to_string());
                    let message = match &last_failure {
                        Some(f) => format!("{f}; then: {e}"),
                        None => e,
                    };
                    let kind = last_side.map(crate::disaggregated::error_type);
                    return error_of_kind(StatusCode::SERVICE_UNAVAILABLE, message, kind);
                }
                Err(NotAdmitted::Refused(why)) => {
                    shared.metrics.request(why.outcome());
                    span.record("outcome", why.outcome());
                    crate::telemetry::failed(&span, why.outcome());
                    return too_many(&shared, why);
                }
                Err(NotAdmitted::NeverFits(f)) => {
                    shared.metrics.request("too_long");
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
            Err(e) => crate::telemetry::failed(&upstream, &crate::error_chain(e)),
            Ok(_) => {}
        }
        let resp = match sent {
            Ok(r) => r,
            Err(e) if e.is_connect() => {
                last_failure = Some(format!("replica {name} unreachable ({})", crate::error_chain(&e)));
                tracing::warn!(replica = %name, error = %e, "upstream connect failed; trying another replica");
                shared.core().record_down(&name, e.to_string(), shared.now());
                booking.release(None, "upstream_error");
                continue;
            }
            Err(e) => {
                // The replica took the request: retrying elsewhere would run it twice.
                booking.release(None, "upstream_error");
                let code = if e.is_timeout() { StatusCode::GATEWAY_TIMEOUT } else { StatusCode::BAD_GATEWAY };
                return with_replica(error(code, format!("replica {name} failed: {}", crate::error_chain(&e))), &name);
            }
        };
        let status = resp.status();
        if status == reqwest::StatusCode::TOO_MANY_REQUESTS || status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
            last_failure = Some(format!("replica {name} answered {status}"));
            let now = shared.now();
            shared.core().record_overload(&name, now + backoff_s, now);
            booking.release(None, "backpressure");
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
                let message = format!("replica {name} failed mid-response: {}", crate::error_chain(&e));
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
    error_of_kind(StatusCode::SERVICE_UNAVAILABLE, format!("{last}; no other replica could take the request"), kind)
}

/// 429 with `Retry-After`: capacity is short and the admission queue refused the request
/// (full, evicted as late, or waited `max_wait_s`).
fn too_many(shared: &Shared, why: crate::admission::Refused) -> Response {
    let (after, message) = shared.refusal(why);
    let mut r = error(StatusCode::TOO_MANY_REQUESTS, message);
    if let Ok(v) = HeaderValue::from_str(&after.to_string()) {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

/// A non-streamed OpenAI answer's `completion_tokens`, if it has a `usage`; its
/// `prompt_tokens_details.cached_tokens` (the engine's own hit count) is counted in
/// `kvmesh_engine_cached_tokens`.
pub(crate) fn read_usage(shared: &Shared, body: &[u8]) -> Option<u32> {
    read_usage_from(shared, body, true)
}

/// [`read_usage`]; with `count_cached` false the hit count is not counted (a disaggregated
/// request's decode side counts the KV it received as cached: its prefill side's answer is
/// counted instead).
pub(crate) fn read_usage_from(shared: &Shared, body: &[u8], count_cached: bool) -> Option<u32> {
    let usage = serde_json::from_slice::<ResponseUsage>(body).ok().and_then(|r| r.usage)?;
    if let Some(c) = usage.prompt_tokens_details.as_ref().and_then(|d| d.cached_tokens).filter(|_| count_cached) {
        shared.metrics.engine_cached_tokens.inc_by(c);
    }
    usage.completion_tokens.map(|n| n.min(u32::MAX as u64) as u32)
}

/// The `usage` of an OpenAI response (the output-length estimate and the engine-reported hit
/// count), read without building the rest.
#[derive(Deserialize)]
struct ResponseUsage {
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// Names the replica that served a response (`x-kvmesh-replica`), for clients and debugging.
pub(crate) fn with_replica(mut r: Response, replica: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(replica) {
        r.headers_mut().insert("x-kvmesh-replica", v);
    }
    r
}

pub(crate) fn with_content_type(status: StatusCode, ct: Option<HeaderValue>, body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    if let Some(ct) = ct {
        r.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    r
}

/// Passes an upstream SSE body through chunk by chunk. The first chunk marks the first token;
/// the end releases the booking with the events counted; an upstream error or the client
/// dropping the body releases it too (the booking's drop).
pub(crate) fn stream_through(
    resp: reqwest::Response,
    booking: InFlight,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    struct St<S> {
        upstream: S,
        booking: InFlight,
        events: u32,
        /// The closing `data: [DONE]` event came (vLLM and SGLang end every stream with it).
        done: bool,
        /// The stream parsed so far; bytes after the last whole event are passed on with the
        /// rest of their event, so an error event never lands inside a half-sent one.
        sse: kvmesh_events::SseReader,
    }
    /// An SSE error event (what OpenAI's clients raise on) for a stream that broke off.
    fn broken(booking: &mut InFlight, why: String, timeout: bool) -> Bytes {
        let replica = booking.replica.clone();
        let message = format!("replica {replica} failed mid-stream: {why}");
        tracing::warn!(replica = %replica, error = %why, "upstream stream broke off; the client gets an error event");
        booking.release(None, "upstream_error");
        let (kind, code) = if timeout { ("timeout", 504) } else { ("upstream_error", 502) };
        let event = json!({"error": {"message": message, "type": kind, "code": code}});
        Bytes::from(format!("data: {event}\n\n"))
    }
    let st = St {
        upstream: Box::pin(resp.bytes_stream()),
        booking,
        events: 0,
        done: false,
        sse: kvmesh_events::SseReader::new(),
    };
    futures_util::stream::unfold(Some(st), |st| async move {
        let mut st = st?;
        loop {
            match st.upstream.next().await {
                Some(Ok(chunk)) => {
                    st.booking.first_token(true);
                    st.sse.push(&chunk);
                    while let Some(event) = st.sse.next_event() {
                        if event.is_done() {
                            st.done = true;
                        } else {
                            st.events += 1;
                        }
                    }
                    let whole = st.sse.take_parsed();
                    if whole.is_empty() {
                        continue;
                    }
                    return Some((Ok(Bytes::from(whole)), Some(st)));
                }
                // Headers and some tokens are sent: the status cannot change any more. An error
                // event ends the stream in words rather than cutting it short (a half-sent
                // event is dropped: a client would fail on it before reading the error).
                Some(Err(e)) if !st.done => {
                    let event = broken(&mut st.booking, crate::error_chain(&e), e.is_timeout());
                    return Some((Ok(event), None));
                }
                None if !st.done => {
                    let why = "the stream ended without `data: [DONE]`".to_string();
                    return Some((Ok(broken(&mut st.booking, why, false)), None));
                }
                // After [DONE] the answer is whole, however the connection ends.
                Some(Err(_)) | None => {
                    // Each token is one `data:` event, plus a last one with the finish reason.
                    st.booking.release(Some(st.events.saturating_sub(1).max(1)), "ok");
                    let rest = std::mem::take(&mut st.sse).into_buffered();
                    return (!rest.is_empty()).then(|| (Ok(Bytes::from(rest)), None));
                }
            }
        }
    })
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
                    core.status(r, now) != crate::state::Status::Ready,
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
        "status": if r.stopping { "stopping" } else if r.ready() { "ok" } else { "no_replica_ready" },
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

    /// The client's side of `stream_through` over an upstream that sends `chunks`, and the
    /// outcome the booking was released with.
    async fn through(chunks: &[&'static str]) -> (String, &'static str) {
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
        let page = crate::metrics_page::render(&shared);
        let outcome = ["ok", "upstream_error"]
            .into_iter()
            .find(|o| page.contains(&format!("kvmesh_requests_total{{outcome=\"{o}\"}} 1\n")))
            .expect("one outcome counted");
        (text, outcome)
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
}
