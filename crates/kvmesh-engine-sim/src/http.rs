//! The OpenAI-compatible HTTP API, vLLM-style: completions and chat completions (streamed as
//! server-sent events when `stream` is true), models, health, and Prometheus metrics with
//! vLLM's names. Each generated token's text is `" t"`.

use crate::engine_task::{Output, Stats, Submission};
use crate::faults::{FaultState, Faults};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use kvmesh_core::prompt::{approximate_tokens, render_chat};
use kvmesh_sim::engine::EngineProfile;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

mod pd;
use pd::{note_pd, transfer, Transfer};
pub use pd::{PdCounts, PdState};

/// Everything a handler needs.
#[derive(Clone)]
pub struct AppState {
    /// Served model name.
    pub model: String,
    /// LoRA adapters served ([`crate::EngineSimConfig::lora_modules`]).
    pub lora_modules: Vec<Arc<str>>,
    /// Output lengths, when drawn ([`crate::EngineSimConfig::output_lengths`]).
    pub outputs: Option<Arc<crate::outputs::OutputSampler>>,
    /// Each data-parallel rank's engine loop inbox, by rank.
    pub submit: Vec<mpsc::UnboundedSender<Submission>>,
    /// Each rank's engine counters.
    pub stats: Vec<Arc<Mutex<Stats>>>,
    /// Completion requests given to each rank.
    pub by_rank: Arc<Vec<std::sync::atomic::AtomicU64>>,
    /// The next rank for a request that names none.
    pub turn: Arc<std::sync::atomic::AtomicUsize>,
    /// Fault switches.
    pub faults: Arc<FaultState>,
    /// Its profile (for `/metrics`' cache config).
    pub profile: EngineProfile,
    /// Tokens per block.
    pub block_size: u32,
    /// Stops the whole engine (the `die` fault).
    pub stop: Arc<tokio::sync::watch::Sender<bool>>,
    /// The W3C `traceparent` of the latest completion requests that carried one, oldest
    /// first (at most [`TRACEPARENTS_KEPT`]): what a router passed on.
    pub traceparents: Arc<Mutex<std::collections::VecDeque<String>>>,
    /// How many completion requests named each `model` (`""`: none named): where a router
    /// sent each model's requests.
    pub asked_models: Arc<Mutex<std::collections::BTreeMap<String, u64>>>,
    /// Disaggregated serving: role, identity, link, counts.
    pub pd: Arc<PdState>,
}

/// How many received `traceparent`s are kept.
pub const TRACEPARENTS_KEPT: usize = 64;

/// Keeps (and logs at debug) the request's `traceparent`, if it has one.
fn note_traceparent(s: &AppState, headers: &HeaderMap) {
    let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) else { return };
    tracing::debug!(traceparent = tp, "completion request");
    let mut kept = s.traceparents.lock().unwrap_or_else(|p| p.into_inner());
    if kept.len() == TRACEPARENTS_KEPT {
        kept.pop_front();
    }
    kept.push_back(tp.to_string());
}

/// The data-parallel rank a request goes to: the one its `X-data-parallel-rank` header names
/// (vLLM's OpenAI server reads it), else the ranks in turn.
///
/// # Errors
/// The message of a 400, for a header that is no rank of this engine (vLLM refuses it).
fn rank_for(s: &AppState, headers: &HeaderMap) -> Result<usize, String> {
    let Some(v) = headers.get("x-data-parallel-rank") else {
        return Ok(s.turn.fetch_add(1, Ordering::Relaxed) % s.submit.len());
    };
    match v.to_str().ok().and_then(|v| v.trim().parse::<usize>().ok()) {
        Some(k) if k < s.submit.len() => Ok(k),
        _ => Err(format!("data_parallel_rank {v:?} is out of range [0, {})", s.submit.len())),
    }
}

/// Counts the request's `model` (the engine serves whatever it is asked; a router's choice is
/// what tests read from it).
fn note_model(s: &AppState, body: &Value) {
    let model = body.get("model").and_then(Value::as_str).unwrap_or_default();
    *s.asked_models.lock().unwrap_or_else(|p| p.into_inner()).entry(model.to_string()).or_default() += 1;
}

/// The routes.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/admin/faults", get(get_faults).post(set_faults))
        .route("/admin/traceparents", get(traceparents))
        .route("/admin/models", get(asked_models))
        .route("/admin/pd", get(pd_counts))
        .with_state(state)
}

const TOKEN_TEXT: &str = " t";

fn error(status: StatusCode, message: &str) -> Response {
    let kind = if status.is_client_error() { "BadRequestError" } else { "ServiceUnavailableError" };
    (status, Json(json!({"error": {"message": message, "type": kind, "code": status.as_u16()}}))).into_response()
}

/// Faults that answer before any work: a forced status, or a hang.
async fn injected(faults: &FaultState) -> Option<Response> {
    let f = faults.get();
    if f.hang {
        std::future::pending::<()>().await;
    }
    let status = StatusCode::from_u16(f.status?).ok()?;
    Some(error(status, &format!("injected fault: status {}", status.as_u16())))
}

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

struct Parsed {
    tokens: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage and no choices (vLLM, OpenAI).
    include_usage: bool,
    /// The served LoRA adapter its `model` names, if it names one.
    lora: Option<Arc<str>>,
    /// Its disaggregated part.
    transfer: Transfer,
}

fn common(s: &AppState, body: &Value, tokens: Vec<u32>) -> Result<Parsed, Box<Response>> {
    if tokens.is_empty() {
        return Err(Box::new(error(StatusCode::BAD_REQUEST, "the prompt is empty")));
    }
    let max_tokens = match body.get("max_tokens").or_else(|| body.get("max_completion_tokens")) {
        None | Some(Value::Null) => 16,
        Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()).filter(|&n| n > 0) {
            Some(n) => n,
            None => return Err(Box::new(error(StatusCode::BAD_REQUEST, "max_tokens must be a positive integer"))),
        },
    };
    let include_usage = body.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let transfer = transfer(body, s.pd.role).map_err(|m| Box::new(error(StatusCode::BAD_REQUEST, &m)))?;
    Ok(Parsed {
        transfer,
        tokens,
        max_tokens,
        stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage,
        lora: body
            .get("model")
            .and_then(Value::as_str)
            .and_then(|m| s.lora_modules.iter().find(|l| &***l == m))
            .cloned(),
    })
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    note_traceparent(&s, &headers);
    note_model(&s, &body);
    note_pd(&s, &body);
    if let Some(r) = injected(&s.faults).await {
        return r;
    }
    let tokens = match body.get("prompt") {
        Some(Value::String(p)) => approximate_tokens(p),
        Some(Value::Array(ids)) if ids.iter().all(Value::is_u64) => {
            ids.iter().filter_map(Value::as_u64).map(|t| t.min(u32::MAX as u64) as u32).collect()
        }
        _ => return error(StatusCode::BAD_REQUEST, "prompt must be a string or an array of token ids"),
    };
    match common(&s, &body, tokens) {
        Ok(p) => match rank_for(&s, &headers) {
            Ok(rank) => generate(s, p, false, rank).await,
            Err(m) => error(StatusCode::BAD_REQUEST, &m),
        },
        Err(r) => *r,
    }
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    note_traceparent(&s, &headers);
    note_model(&s, &body);
    note_pd(&s, &body);
    if let Some(r) = injected(&s.faults).await {
        return r;
    }
    let Some(messages) = body.get("messages").and_then(Value::as_array) else {
        return error(StatusCode::BAD_REQUEST, "messages must be an array");
    };
    let mut parts = Vec::with_capacity(messages.len());
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let content = match m.get("content") {
            Some(Value::String(c)) => c.clone(),
            // Content parts: the text parts, concatenated.
            Some(Value::Array(ps)) => ps.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect(),
            _ => String::new(),
        };
        parts.push((role.to_string(), content));
    }
    let text = render_chat(parts.iter().map(|(r, c)| (r.as_str(), c.as_str())));
    match common(&s, &body, approximate_tokens(&text)) {
        Ok(p) => match rank_for(&s, &headers) {
            Ok(rank) => generate(s, p, true, rank).await,
            Err(m) => error(StatusCode::BAD_REQUEST, &m),
        },
        Err(r) => *r,
    }
}

async fn generate(s: AppState, p: Parsed, chat: bool, rank: usize) -> Response {
    let prompt_tokens = p.tokens.len();
    let (tx, mut rx) = mpsc::unbounded_channel();
    // An answer shorter than max_tokens stops (its end of sequence), as vLLM says.
    let output_tokens = s.outputs.as_ref().map_or(p.max_tokens, |o| o.sample(p.max_tokens));
    let finish_reason = if output_tokens < p.max_tokens { "stop" } else { "length" };
    // A decode leg: the engine receives the blocks it lacks over the link before it takes the
    // request (seconds per block, real time).
    let transfer_s_per_block = match p.transfer {
        Transfer::FromPrefill { .. } => {
            let bytes = u64::from(s.block_size) * s.profile.kv_bytes_per_token;
            Some(bytes as f64 * 8.0 / (s.pd.kv_link_gbps * 1e9) / s.pd.speed)
        }
        _ => None,
    };
    let handoff = (p.transfer == Transfer::ToDecode).then(|| p.tokens.len().div_ceil(s.block_size as usize));
    let submission =
        Submission { tokens: p.tokens.into(), output_tokens, lora: p.lora, transfer_s_per_block, outputs: tx };
    s.by_rank[rank].fetch_add(1, Ordering::Relaxed);
    if s.submit[rank].send(submission).is_err() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "engine is shutting down");
    }
    let id = format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, uuid_like());
    let created = now_s();
    let model = s.model.clone();
    if p.stream {
        let id_for_usage = id.clone();
        let chunk = move |delta: Option<&str>, finish: Option<&str>, first: bool| -> Bytes {
            let choice = if chat {
                let delta = match (first, delta) {
                    (true, _) => json!({"role": "assistant", "content": delta.unwrap_or("")}),
                    (false, Some(t)) => json!({"content": t}),
                    (false, None) => json!({}),
                };
                json!({"index": 0, "delta": delta, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": delta.unwrap_or(""), "finish_reason": finish})
            };
            let object = if chat { "chat.completion.chunk" } else { "text_completion" };
            let v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
            Bytes::from(format!("data: {v}\n\n"))
        };
        let include_usage = p.include_usage;
        let usage_chunk = {
            let (id, model) = (id_for_usage, s.model.clone());
            move |cached: u32, generated: u32| -> Bytes {
                let object = if chat { "chat.completion.chunk" } else { "text_completion" };
                let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                    "total_tokens": prompt_tokens + generated as usize, "prompt_tokens_details": {"cached_tokens": cached}});
                let v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage});
                Bytes::from(format!("data: {v}\n\n"))
            }
        };
        let stream = async_stream(move |emit| async move {
            // `emit` fails once the client has gone: stop, dropping `rx`, so the engine aborts
            // the request at its next token.
            let (mut cached, mut generated) = (0u32, 0u32);
            while let Some(out) = rx.recv().await {
                let sent = match out {
                    Output::FirstToken { cached_tokens } => {
                        (cached, generated) = (cached_tokens, 1);
                        emit(chunk(Some(TOKEN_TEXT), None, true))
                    }
                    Output::Token => {
                        generated += 1;
                        emit(chunk(Some(TOKEN_TEXT), None, false))
                    }
                    Output::Done => {
                        emit(chunk(None, Some(finish_reason), false));
                        if include_usage {
                            emit(usage_chunk(cached, generated));
                        }
                        emit(Bytes::from_static(b"data: [DONE]\n\n"));
                        break;
                    }
                    Output::Rejected => {
                        let e = json!({"error": {"message": "prompt plus max_tokens exceeds the KV cache", "type": "BadRequestError", "code": 400}});
                        emit(Bytes::from(format!("data: {e}\n\n")));
                        break;
                    }
                };
                if !sent {
                    break;
                }
            }
        });
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(stream))
            .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response build failed"));
    }
    let (mut generated, mut cached) = (0u32, 0u32);
    loop {
        match rx.recv().await {
            Some(Output::FirstToken { cached_tokens }) => {
                cached = cached_tokens;
                generated += 1;
            }
            Some(Output::Token) => generated += 1,
            Some(Output::Done) => break,
            Some(Output::Rejected) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "prompt plus max_tokens exceeds the KV cache (vLLM max_model_len)",
                )
            }
            None => return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped"),
        }
    }
    let text = TOKEN_TEXT.repeat(generated as usize);
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated as usize, "prompt_tokens_details": {"cached_tokens": cached}});
    let mut body = if chat {
        json!({"id": id, "object": "chat.completion", "created": created, "model": s.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}], "usage": usage})
    } else {
        json!({"id": id, "object": "text_completion", "created": created, "model": s.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}], "usage": usage})
    };
    if let Some(blocks) = handoff {
        // What NixlConnector's `request_finished` hands back for the decode replica.
        body["kv_transfer_params"] = json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": (0..blocks).collect::<Vec<_>>(), "remote_engine_id": s.pd.engine_id,
            "remote_request_id": id, "remote_host": s.pd.host, "remote_port": s.pd.port, "tp_size": 1});
    }
    Json(body).into_response()
}

/// A stream of byte chunks produced by an async body that calls `emit` (a small channel-backed
/// generator, so the response starts before the request completes).
fn async_stream<F, Fut>(body: F) -> impl futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>>
where
    F: FnOnce(Box<dyn Fn(Bytes) -> bool + Send>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    // `emit` returns false once the response body was dropped (the client went away).
    let emit: Box<dyn Fn(Bytes) -> bool + Send> = Box::new(move |b| tx.send(b).is_ok());
    tokio::spawn(body(emit));
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok(b), rx)) })
}

/// A completion id unique across processes (one counter per process, started from the
/// process id and the start time, as several sims behind one router must not share ids).
fn uuid_like() -> String {
    use std::sync::atomic::AtomicU64;
    static NEXT: std::sync::OnceLock<AtomicU64> = std::sync::OnceLock::new();
    let next = NEXT.get_or_init(|| {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        AtomicU64::new((u64::from(std::process::id()) << 40) ^ nanos)
    });
    format!("{:016x}", next.fetch_add(1, Ordering::Relaxed))
}

async fn models(State(s): State<AppState>) -> Response {
    if let Some(r) = injected(&s.faults).await {
        return r;
    }
    // As vLLM's `OpenAIServingModels.show_available_models`: the base model (`parent` null),
    // then each adapter with the base model as its `parent`.
    let created = now_s();
    let card = |id: &str, parent: Option<&str>| {
        json!({"id": id, "object": "model", "created": created, "owned_by": "kvmesh-engine-sim",
            "root": parent.map_or(id.to_string(), |_| format!("/adapters/{id}")), "parent": parent})
    };
    let mut data = vec![card(&s.model, None)];
    data.extend(s.lora_modules.iter().map(|l| card(l, Some(&s.model))));
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn health(State(s): State<AppState>) -> Response {
    match s.faults.get().status {
        Some(503) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        _ => StatusCode::OK.into_response(),
    }
}

async fn metrics(State(s): State<AppState>) -> Response {
    let stats: Vec<Stats> = s.stats.iter().map(|st| st.lock().unwrap_or_else(|p| p.into_inner()).clone()).collect();
    let mut out = String::new();
    // One family per metric, one series per data-parallel rank, as vLLM labels its engines.
    let mut metric = |name: &str, kind: &str, help: &str, value: &dyn Fn(&Stats) -> String| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (rank, st) in stats.iter().enumerate() {
            let labels = format!("engine=\"{rank}\",model_name=\"{}\"", s.model);
            out.push_str(&format!("{name}{{{labels}}} {}\n", value(st)));
        }
    };
    metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", &|st| {
        format!("{}.0", st.running)
    });
    metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", &|st| {
        format!("{}.0", st.waiting)
    });
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", &|st| {
        format!("{}", st.kv_usage)
    });
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed (whole prompts, cached tokens included).",
        &|st| format!("{}.0", st.prompt_tokens_total),
    );
    metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", &|st| {
        format!("{}.0", st.generation_tokens_total)
    });
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &|st| format!("{}.0", st.prefix_cache_hits_total),
    );
    metric("vllm:request_success_total", "counter", "Count of successfully processed requests.", &|st| {
        format!("{}.0", st.requests_total)
    });
    // One cache config for the whole engine, its data-parallel ranks' blocks summed, as vLLM
    // reports it (see kvmesh_events::EnginePage::kv_blocks).
    let blocks = s.profile.kv_blocks(s.block_size) * stats.len().max(1) as u64;
    out.push_str(&format!(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",engine=\"0\",num_gpu_blocks=\"{blocks}\"}} 1.0\n",
        s.block_size
    ));
    // What else a vLLM server's page carries (histograms, `_created` twins, process
    // collectors): ten times the families above, which a router must read past.
    out.push_str(crate::page_rest::VLLM_PAGE_REST);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], out).into_response()
}

/// The `traceparent`s received lately, oldest first, as a JSON array.
async fn traceparents(State(s): State<AppState>) -> Json<Vec<String>> {
    Json(s.traceparents.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect())
}

/// Completion requests received per `model` named, as a JSON object.
async fn asked_models(State(s): State<AppState>) -> Json<std::collections::BTreeMap<String, u64>> {
    Json(s.asked_models.lock().unwrap_or_else(|p| p.into_inner()).clone())
}

/// Completion requests by disaggregated kind, as JSON ([`PdCounts`]).
async fn pd_counts(State(s): State<AppState>) -> Json<PdCounts> {
    Json(s.pd.counts())
}

async fn get_faults(State(s): State<AppState>) -> Json<Faults> {
    Json(s.faults.get())
}

async fn set_faults(State(s): State<AppState>, Json(f): Json<Faults>) -> Json<Faults> {
    tracing::warn!(faults = ?f, "faults set");
    s.faults.set(f.clone());
    if f.die {
        // Answer first, then go: the stop closes the listener after this response.
        let stop = s.stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            let _ = stop.send(true);
        });
    }
    Json(f)
}
