//! kvmesh as a Gateway API Inference Extension endpoint picker (EPP): Envoy's
//! `envoy.service.ext_proc.v3.ExternalProcessor`, served on the node's gRPC port.
//!
//! One gRPC stream is one HTTP request through the gateway. The picker reads its headers and
//! body as Envoy sends them (the body mode comes in `protocol_config`), routes it with the
//! node's policy exactly as the proxy would (same tokenizer path, checks, admission and
//! booking), answers with the replica's `<ip:port>` ([`protocol`]), then follows the response
//! going by — first token, end of stream, usage — and releases the booking when it ends, or
//! when the stream breaks off (the client or gateway gone: `disconnected`). Requests on other
//! paths (`/v1/models` …) get the policy's pick for an empty prompt, unbooked.
//!
//! A data plane that sends no `protocol_config` is taken to run `FULL_DUPLEX_STREAMED`, the
//! Inference Extension's mode (in `BUFFERED` it would wait for the headers' answer, which
//! full duplex holds until the body is read: configure such a gateway in full duplex).

mod pick;
pub mod protocol;

use crate::config::EppSection;
use crate::in_flight::InFlight;

/// A pick: the endpoint, its data-parallel rank, and a disaggregated request's prefill
/// endpoint.
type Picked = (String, Option<u32>, Option<String>);
use crate::request::{check, parse, read_chat, read_completion, Parsed, Rejected};
use crate::state::Shared;
use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{processing_request, ProcessingRequest, ProcessingResponse};
use protocol::BodyMode;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::mpsc;

/// The service; one task per stream.
#[derive(Clone)]
pub struct EndpointPicker {
    /// The node.
    pub shared: Arc<Shared>,
    /// `[epp]`.
    pub section: Arc<EppSection>,
    /// Replicas already warned about being registered by host name.
    pub by_name: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl EndpointPicker {
    /// The picker for `shared`, with `section`.
    pub fn new(shared: Arc<Shared>, section: EppSection) -> Self {
        EndpointPicker { shared, section: Arc::new(section), by_name: Default::default() }
    }
}

/// The answers on one stream.
type Answers = Pin<Box<dyn futures_util::Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for EndpointPicker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Answers>, tonic::Status> {
        let (tx, rx) = mpsc::channel(8);
        let exchange = Exchange::new(self, tx);
        tokio::spawn(exchange.run(request.into_inner()));
        Ok(tonic::Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

/// What the pick failed on: the client's answer, and whether `epp.fail_open` may let the
/// request go on instead.
struct Refusal {
    status: u16,
    message: String,
    kind: &'static str,
    retry_after_s: Option<u64>,
    may_fail_open: bool,
}

impl Refusal {
    fn from_rejected(r: Rejected) -> Refusal {
        let kind = if r.status.is_server_error() { "service_unavailable" } else { "invalid_request_error" };
        Refusal { status: r.status.as_u16(), message: r.message, kind, retry_after_s: None, may_fail_open: true }
    }

    fn unavailable(message: String, may_fail_open: bool) -> Refusal {
        Refusal { status: 503, message, kind: "service_unavailable", retry_after_s: None, may_fail_open }
    }
}

/// The response as the picker follows it.
#[derive(Default)]
struct Following {
    /// Server-sent events (`text/event-stream`).
    streamed: bool,
    sse: kvmesh_events::SseReader,
    events: u32,
    done: bool,
    /// A non-streamed answer's bytes, up to [`USAGE_BYTES`] (for its `usage`).
    body: Vec<u8>,
}

/// The largest body chunk sent back to the gateway (Envoy's ext_proc proto recommends at most
/// 64 KiB per `StreamedBodyResponse`).
const BODY_CHUNK: usize = 64 * 1024;

/// Most of a non-streamed answer kept to read its `usage` from; a longer one is released
/// without its output count.
const USAGE_BYTES: usize = 1 << 20;

/// One HTTP request's exchange with the gateway.
struct Exchange {
    shared: Arc<Shared>,
    section: Arc<EppSection>,
    out: mpsc::Sender<Result<ProcessingResponse, tonic::Status>>,
    request_mode: BodyMode,
    response_full_duplex: bool,
    path: String,
    headers: http::HeaderMap,
    subset: Option<Vec<String>>,
    arrived: tokio::time::Instant,
    body: Vec<u8>,
    /// The body's bytes in the node's body budget (shared with the proxy), until picked.
    held: Option<crate::body_budget::Held>,
    /// The pick must come by then (the body complete): `limits.http_idle_timeout` after
    /// the headers.
    pick_by: Option<tokio::time::Instant>,
    picked: bool,
    in_flight: Option<InFlight>,
    /// A disaggregated request's prefill leg (its decode side is `in_flight`): released when
    /// the response starts, by which time the decode pod's sidecar has run it.
    prefill_in_flight: Option<InFlight>,
    following: Following,
    by_name: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl Exchange {
    fn new(picker: &EndpointPicker, out: mpsc::Sender<Result<ProcessingResponse, tonic::Status>>) -> Self {
        Exchange {
            shared: picker.shared.clone(),
            section: picker.section.clone(),
            out,
            request_mode: BodyMode::FullDuplex,
            response_full_duplex: true,
            path: String::new(),
            headers: http::HeaderMap::new(),
            subset: None,
            arrived: tokio::time::Instant::now(),
            body: Vec::new(),
            held: None,
            pick_by: None,
            picked: false,
            in_flight: None,
            prefill_in_flight: None,
            following: Following::default(),
            by_name: picker.by_name.clone(),
        }
    }

    /// Reads the gateway's messages until the request and its response are through or the
    /// stream ends; a booking still held then is released as `disconnected` (its drop).
    async fn run(mut self, mut inbound: tonic::Streaming<ProcessingRequest>) {
        loop {
            let waiting = self.pick_by.filter(|_| !self.picked);
            let message = tokio::select! {
                m = inbound.message() => m,
                // The gateway stopped reading our answers: nothing more will come through.
                () = self.out.closed() => break,
                () = tokio::time::sleep_until(waiting.unwrap_or_else(tokio::time::Instant::now)), if waiting.is_some() => {
                    let s = crate::config::human(self.shared.limits.http_idle_timeout);
                    let message = format!("the request body did not arrive within {s} (limits.http_idle_timeout)");
                    let _ = self.send(protocol::immediate(408, &message, "timeout", None)).await;
                    break;
                }
            };
            let m = match message {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "epp: the gateway's stream broke off");
                    break;
                }
            };
            match self.step(m).await {
                Ok(true) => {}
                Ok(false) | Err(()) => break,
            }
        }
        // Dropping `in_flight` here releases an unfinished request as `disconnected`.
    }

    async fn send(&self, r: ProcessingResponse) -> Result<(), ()> {
        self.out.send(Ok(r)).await.map_err(|_| ())
    }

    /// Handles one message; `Ok(false)` when the exchange is over.
    async fn step(&mut self, m: ProcessingRequest) -> Result<bool, ()> {
        if let Some(pc) = m.protocol_config {
            self.request_mode = BodyMode::from_envoy(pc.request_body_mode);
            self.response_full_duplex = BodyMode::from_envoy(pc.response_body_mode) == BodyMode::FullDuplex;
        }
        let Some(request) = m.request else { return Ok(true) };
        match request {
            processing_request::Request::RequestHeaders(h) => {
                self.arrived = tokio::time::Instant::now();
                self.pick_by = Some(self.arrived + self.shared.limits.http_idle_timeout);
                self.path = protocol::pseudo(h.headers.as_ref(), ":path").unwrap_or("/").to_string();
                self.headers = protocol::to_http_headers(h.headers.as_ref());
                self.subset = protocol::subset(m.metadata_context.as_ref(), &self.section.subset_namespace);
                if h.end_of_stream || self.request_mode == BodyMode::None {
                    return self.pick_and_answer(None, false).await;
                }
                match self.request_mode {
                    BodyMode::Buffered => self.send(protocol::request_headers(None, None)).await?,
                    BodyMode::Streamed => {
                        let _ = self
                            .out
                            .send(Err(tonic::Status::invalid_argument(
                                "kvmesh's endpoint picker needs the request body before the headers go on: \
                                 set the ext_proc request_body_mode to FULL_DUPLEX_STREAMED (the Inference \
                                 Extension's) or BUFFERED, not STREAMED",
                            )))
                            .await;
                        return Ok(false);
                    }
                    // Held until the body is read.
                    BodyMode::FullDuplex | BodyMode::None => {}
                }
            }
            processing_request::Request::RequestBody(b) => {
                if self.picked {
                    // A body after the pick (buffered partial): pass it on.
                    let streamed = (self.request_mode == BodyMode::FullDuplex).then_some((b.body, b.end_of_stream));
                    self.send(protocol::request_body(streamed, None, None)).await?;
                    return Ok(true);
                }
                let limit = self.shared.limits.http_max_body_bytes;
                if self.body.len() + b.body.len() > limit {
                    self.shared.metrics.request("too_long");
                    let message = format!("the request body exceeds {limit} bytes (limits.http_max_body_bytes)");
                    self.send(protocol::immediate(413, &message, "invalid_request_error", None)).await?;
                    return Ok(false);
                }
                let budget = &self.shared.body_budget;
                if !self.held.get_or_insert_with(|| budget.hold()).grow(b.body.len()) {
                    let message = budget.full_message();
                    self.send(protocol::immediate(503, &message, "service_unavailable", Some(1))).await?;
                    return Ok(false);
                }
                self.body.extend_from_slice(&b.body);
                // Buffered modes send the body in one message, whatever it says.
                if b.end_of_stream || self.request_mode != BodyMode::FullDuplex {
                    let body = Bytes::from(std::mem::take(&mut self.body));
                    return self.pick_and_answer(Some(body), false).await;
                }
            }
            processing_request::Request::RequestTrailers(_) => {
                // In full duplex, trailers are how the gateway says the body is complete.
                if !self.picked {
                    let body = Bytes::from(std::mem::take(&mut self.body));
                    if !self.pick_and_answer(Some(body), true).await? {
                        return Ok(false);
                    }
                }
                self.send(protocol::trailers(true)).await?;
            }
            processing_request::Request::ResponseHeaders(h) => {
                let status = protocol::pseudo(h.headers.as_ref(), ":status").and_then(|s| s.parse::<u16>().ok());
                let headers = protocol::to_http_headers(h.headers.as_ref());
                self.following.streamed = headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|c| c.starts_with("text/event-stream"));
                self.send(protocol::response_headers()).await?;
                self.response_status(status.unwrap_or(200));
                if h.end_of_stream {
                    self.finish();
                }
            }
            processing_request::Request::ResponseBody(b) => {
                let echo = self.response_full_duplex.then(|| (b.body.clone(), b.end_of_stream));
                self.follow(&b.body);
                if b.end_of_stream {
                    self.finish();
                }
                self.send(protocol::response_body(echo)).await?;
            }
            processing_request::Request::ResponseTrailers(_) => {
                self.finish();
                self.send(protocol::trailers(false)).await?;
            }
        }
        Ok(true)
    }

    /// A non-2xx answer: released at once with its outcome; 429/503 mark the replica
    /// overloaded for `node.overload_backoff`, as the proxy does.
    fn response_status(&mut self, status: u16) {
        if let Some(mut p) = self.prefill_in_flight.take() {
            let ok = (200..300).contains(&status);
            if ok {
                p.first_token(false);
            }
            p.release(None, if ok { "ok" } else { "upstream_error" });
        }
        if (200..300).contains(&status) {
            return;
        }
        let Some(mut f) = self.in_flight.take() else { return };
        let outcome = if status == 429 || status == 503 {
            let now = self.shared.now();
            self.shared.core().record_overload(&f.replica, now + self.shared.settings.overload_backoff_s, now);
            "backpressure"
        } else if (400..500).contains(&status) {
            "client_error"
        } else {
            "upstream_error"
        };
        f.release(None, outcome);
    }

    /// A response chunk going by.
    fn follow(&mut self, chunk: &[u8]) {
        let Some(f) = self.in_flight.as_mut() else { return };
        let fo = &mut self.following;
        if fo.streamed {
            f.first_token(true);
            fo.sse.push(chunk);
            while let Some(event) = fo.sse.next_event() {
                if event.is_done() {
                    fo.done = true;
                } else {
                    fo.events += 1;
                }
            }
            // Only counted; the bytes go on unchanged.
            let _ = fo.sse.take_parsed();
        } else if fo.body.len() + chunk.len() <= USAGE_BYTES {
            fo.body.extend_from_slice(chunk);
        }
    }

    /// The response ended: the booking is released with its output count.
    fn finish(&mut self) {
        let Some(mut f) = self.in_flight.take() else { return };
        let fo = &self.following;
        if fo.streamed {
            // Each token is one `data:` event, plus a last one with the finish reason.
            let outcome = if fo.done { "ok" } else { "upstream_error" };
            let output = fo.done.then(|| fo.events.saturating_sub(1).max(1));
            f.release(output, outcome);
        } else {
            f.first_token(false);
            let output = crate::response::read_usage(&self.shared, &fo.body);
            f.release(output, "ok");
        }
    }
}
