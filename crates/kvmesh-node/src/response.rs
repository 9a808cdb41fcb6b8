//! Answers to clients: errors in OpenAI's shape (`openai_error`), the usage read from an engine's answer, and
//! an engine's answer relayed (streamed or whole) with the router's headers. Shared by the
//! proxy and the disaggregated flow, below both.

use crate::in_flight::InFlight;
use crate::state::Shared;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::json;

pub(crate) use crate::openai_error::{error, error_of_kind};

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
    let usage = usage_of(body)?;
    usage.count_cached(shared, count_cached);
    usage.completion_tokens
}

/// What an answer's (or a stream event's) `usage` says, when it has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct UsageSeen {
    /// `completion_tokens`, at most `u32::MAX`.
    pub(crate) completion_tokens: Option<u32>,
    /// `prompt_tokens_details.cached_tokens`: the engine's own prefix-cache hit count.
    pub(crate) cached_tokens: Option<u64>,
}

impl UsageSeen {
    /// Adds the engine's hit count to `kvmesh_engine_cached_tokens_total`, when `count` (not
    /// for a disaggregated request's decode side, whose "cached" tokens are the KV it received).
    fn count_cached(&self, shared: &Shared, count: bool) {
        if let Some(c) = self.cached_tokens.filter(|_| count) {
            shared.metrics.engine_cached_tokens.inc_by(c);
        }
    }
}

/// The `usage` of an OpenAI answer or stream chunk (`body`: its JSON), if it carries one.
pub(crate) fn usage_of(body: &[u8]) -> Option<UsageSeen> {
    let usage = serde_json::from_slice::<ResponseUsage>(body).ok().and_then(|r| r.usage)?;
    Some(UsageSeen {
        completion_tokens: usage.completion_tokens.map(|n| n.min(u32::MAX as u64) as u32),
        cached_tokens: usage.prompt_tokens_details.as_ref().and_then(|d| d.cached_tokens),
    })
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
        /// The last `usage` an event carried (`stream_options.include_usage`: the last chunk;
        /// `continuous_usage_stats`: every chunk, cumulative), read when the stream ends.
        usage: Option<UsageSeen>,
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
        usage: None,
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
                            // Token chunks carry no usage unless the client asked for it:
                            // parsed only when the event names one.
                            if event.data.contains("\"usage\"") {
                                st.usage = usage_of(event.data.as_bytes()).or(st.usage);
                            }
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
                    let event = broken(&mut st.booking, crate::errors::error_chain(&e), e.is_timeout());
                    return Some((Ok(event), None));
                }
                None if !st.done => {
                    let why = "the stream ended without `data: [DONE]`".to_string();
                    return Some((Ok(broken(&mut st.booking, why, false)), None));
                }
                // After [DONE] the answer is whole, however the connection ends.
                Some(Err(_)) | None => {
                    let usage = st.usage.unwrap_or_default();
                    usage.count_cached(&st.booking.shared, st.booking.side != crate::in_flight::Side::Decode);
                    // The usage's count when sent; else each token is one `data:` event, plus
                    // a last one with the finish reason.
                    let output = usage.completion_tokens.unwrap_or(st.events.saturating_sub(1).max(1));
                    st.booking.release(Some(output), "ok");
                    let rest = std::mem::take(&mut st.sse).into_buffered();
                    return (!rest.is_empty()).then(|| (Ok(Bytes::from(rest)), None));
                }
            }
        }
    })
}
