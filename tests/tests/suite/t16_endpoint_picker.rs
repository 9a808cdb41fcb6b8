//! kvmesh as a Gateway API Inference Extension endpoint picker: a client built on Envoy's own
//! ext_proc types sends exactly Envoy's message sequence (request headers with the protocol
//! configuration, body chunks, end of stream; then response headers and body, or an early
//! close), forwards to the endpoint the picker named as a gateway would, and checks the pick,
//! the booking's release on every path, fail-open and fail-closed, the subset rule and both
//! body modes.

use crate::common;

use common::{eventually, metric};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use kvmesh_engine_sim::EngineSim;
use kvmesh_node::config::{EppSection, NodeConfig};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;

const FULL_DUPLEX: i32 = 4;
const BUFFERED: i32 = 2;

/// One HTTP request's ext_proc stream, as Envoy drives it.
struct Gateway {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Gateway {
    async fn open(node: &kvmesh_node::Node) -> Gateway {
        let mut client = ExternalProcessorClient::new(common::grpc(node.grpc).await);
        let (tx, rx) = mpsc::channel(16);
        let rx = client.process(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
        Gateway { tx, rx }
    }

    async fn send(&self, r: processing_request::Request) {
        self.send_with(r, None, None).await;
    }

    async fn send_with(&self, r: processing_request::Request, mode: Option<i32>, metadata: Option<Metadata>) {
        let protocol_config = mode.map(|m| ProtocolConfiguration {
            request_body_mode: m,
            response_body_mode: m,
            send_body_without_waiting_for_header_response: false,
        });
        let m =
            ProcessingRequest { request: Some(r), protocol_config, metadata_context: metadata, ..Default::default() };
        self.tx.send(m).await.unwrap();
    }

    async fn answer(&mut self) -> Answer {
        let next = tokio::time::timeout(std::time::Duration::from_secs(10), self.rx.next()).await;
        next.expect("an answer within 10 s").expect("the stream is open").unwrap().response.unwrap()
    }

    async fn answer_with_metadata(&mut self) -> ProcessingResponse {
        tokio::time::timeout(std::time::Duration::from_secs(10), self.rx.next()).await.unwrap().unwrap().unwrap()
    }
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue { key: k.to_string(), value: String::new(), raw_value: v.as_bytes().to_vec() })
            .collect(),
    }
}

fn request_headers(path: &str, end_of_stream: bool) -> processing_request::Request {
    processing_request::Request::RequestHeaders(HttpHeaders {
        headers: Some(headers(&[
            (":method", if end_of_stream { "GET" } else { "POST" }),
            (":path", path),
            (":authority", "gateway.example"),
            ("content-type", "application/json"),
        ])),
        end_of_stream,
        ..Default::default()
    })
}

fn request_body(body: &[u8], end_of_stream: bool) -> processing_request::Request {
    processing_request::Request::RequestBody(HttpBody { body: body.to_vec(), end_of_stream, ..Default::default() })
}

fn response_headers(status: u16, content_type: &str) -> processing_request::Request {
    processing_request::Request::ResponseHeaders(HttpHeaders {
        headers: Some(headers(&[(":status", &status.to_string()), ("content-type", content_type)])),
        end_of_stream: false,
        ..Default::default()
    })
}

fn response_body(body: &[u8], end_of_stream: bool) -> processing_request::Request {
    processing_request::Request::ResponseBody(HttpBody { body: body.to_vec(), end_of_stream, ..Default::default() })
}

/// The destination a headers or body answer sets: (header value, dynamic-metadata value).
fn destination(r: &ProcessingResponse) -> (Option<String>, Option<String>) {
    let common = match r.response.as_ref().unwrap() {
        Answer::RequestHeaders(h) => h.response.as_ref(),
        Answer::RequestBody(b) => b.response.as_ref(),
        other => panic!("not a request answer: {other:?}"),
    };
    let header = common.and_then(|c| c.header_mutation.as_ref()).and_then(|m| {
        m.set_headers
            .iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == "x-gateway-destination-endpoint")
            .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
    });
    let meta = r.dynamic_metadata.as_ref().and_then(|m| match &m.fields.get("envoy.lb")?.kind {
        Some(Kind::StructValue(s)) => match &s.fields.get("x-gateway-destination-endpoint")?.kind {
            Some(Kind::StringValue(v)) => Some(v.clone()),
            _ => None,
        },
        _ => None,
    });
    (header, meta)
}

fn streamed_body(a: &Answer) -> (Vec<u8>, bool) {
    let common = match a {
        Answer::RequestBody(b) | Answer::ResponseBody(b) => b.response.as_ref().unwrap(),
        other => panic!("not a body answer: {other:?}"),
    };
    match common.body_mutation.as_ref().and_then(|m| m.mutation.as_ref()) {
        Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body.clone(), s.end_of_stream),
        other => panic!("no streamed body: {other:?}"),
    }
}

fn authority(e: &EngineSim) -> String {
    e.http.to_string()
}

async fn fleet(n: usize, epp: EppSection) -> (kvmesh_node::Node, Vec<EngineSim>) {
    let engines = common::engines(n, 50.0).await;
    let replicas = engines.iter().enumerate().map(|(i, e)| common::replica(i, e)).collect();
    let mut section = common::section();
    section.model = "m".into();
    let config = NodeConfig { epp, ..common::single(section, replicas) };
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("every replica ready", || kvmesh_node::health::Readiness::of(&node.shared).routable == n).await;
    (node, engines)
}

fn completion(stream: bool) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "m", "prompt": "the gateway sends this prompt to be routed", "max_tokens": 4, "stream": stream
    }))
    .unwrap()
}

fn live_bookings(node: &kvmesh_node::Node) -> usize {
    node.shared.core().fleet.bookings().len()
}

/// Full duplex (the Inference Extension's mode): the headers' answer waits for the body, names
/// the replica in the header and the metadata alike, the body is sent back whole; the
/// streamed answer is followed to its end and the booking released as `ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_completion_is_picked_followed_and_released() {
    let (node, engines) = fleet(2, EppSection::default()).await;
    let body = completion(true);
    let mut gw = Gateway::open(&node).await;
    gw.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
    let (a, b) = body.split_at(body.len() / 2);
    gw.send(request_body(a, false)).await;
    gw.send(request_body(b, true)).await;
    let headers_answer = gw.answer_with_metadata().await;
    let (header, meta) = destination(&headers_answer);
    let endpoint = header.clone().expect("a destination header");
    assert_eq!(meta, header, "the header and the metadata name the same endpoint");
    assert!(engines.iter().any(|e| authority(e) == endpoint), "{endpoint} is one of the engines");
    let Answer::RequestHeaders(h) = headers_answer.response.unwrap() else { panic!() };
    let set = &h.response.as_ref().unwrap().header_mutation.as_ref().unwrap().set_headers;
    let length = set.iter().filter_map(|o| o.header.as_ref()).find(|h| h.key == "content-length").unwrap();
    assert_eq!(length.raw_value, body.len().to_string().into_bytes());
    assert!(h.response.unwrap().clear_route_cache);
    assert_eq!(streamed_body(&gw.answer().await), (body.clone(), true), "the body goes on whole");
    assert_eq!(live_bookings(&node), 1, "booked while it runs");

    // The gateway forwards to the endpoint and streams the answer through the picker.
    let upstream = reqwest::Client::new()
        .post(format!("http://{endpoint}/v1/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    gw.send(response_headers(200, "text/event-stream")).await;
    assert!(matches!(gw.answer().await, Answer::ResponseHeaders(_)));
    let mut stream = upstream.bytes_stream();
    let mut through = Vec::new();
    let mut sent = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        sent.extend_from_slice(&chunk);
        gw.send(response_body(&chunk, false)).await;
        let (echo, eos) = streamed_body(&gw.answer().await);
        assert!(!eos);
        through.extend(echo);
    }
    gw.send(response_body(b"", true)).await;
    assert_eq!(streamed_body(&gw.answer().await), (vec![], true));
    assert_eq!(through, sent, "the answer passes through unchanged");
    assert!(String::from_utf8(sent).unwrap().ends_with("data: [DONE]\n\n"));
    eventually("released", || live_bookings(&node) == 0).await;
    let replica = engines.iter().position(|e| authority(e) == endpoint).unwrap();
    let ok = format!("kvmesh_replica_requests_total{{replica=\"e{replica}\",outcome=\"ok\"}} 1");
    assert!(metric(&node, "kvmesh_replica_requests_total").contains(&ok), "{}", metric(&node, "kvmesh_replica"));
    let decisions = node.shared.recent_decisions(1);
    assert_eq!(decisions.last().map(|d| d.via), Some("gateway"));
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

/// The gateway goes away after the pick (the client hung up, Envoy reset the stream): the
/// booking is released as `disconnected`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_breaks_off_after_the_pick_releases_its_booking() {
    let (node, engines) = fleet(1, EppSection::default()).await;
    let mut gw = Gateway::open(&node).await;
    gw.send_with(request_headers("/v1/chat/completions", false), Some(FULL_DUPLEX), None).await;
    let chat =
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8});
    gw.send(request_body(chat.to_string().as_bytes(), true)).await;
    assert_eq!(destination(&gw.answer_with_metadata().await).0, Some(authority(&engines[0])));
    let _ = gw.answer().await;
    gw.send(response_headers(200, "text/event-stream")).await;
    let _ = gw.answer().await;
    assert_eq!(live_bookings(&node), 1);
    drop(gw);
    eventually("released on the break", || live_bookings(&node) == 0).await;
    assert!(metric(&node, "kvmesh_requests_total").contains("outcome=\"disconnected\"} 1"));
    node.stop().await;
    engines.into_iter().next().unwrap().stop().await;
}

/// Buffered mode: the headers are answered at once (continue), the body's answer carries the
/// pick; a non-streamed answer's usage releases it as `ok`; an engine's 429 releases it as
/// backpressure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_mode_picks_on_the_body_and_a_429_counts_as_backpressure() {
    let (node, engines) = fleet(1, EppSection::default()).await;
    for (status, outcome) in [(200, "ok"), (429, "backpressure")] {
        let mut gw = Gateway::open(&node).await;
        gw.send_with(request_headers("/v1/completions", false), Some(BUFFERED), None).await;
        let Answer::RequestHeaders(h) = gw.answer().await else { panic!("headers answered first") };
        assert!(h.response.is_none(), "a plain continue");
        gw.send(request_body(&completion(false), true)).await;
        let answer = gw.answer_with_metadata().await;
        let want = Some(authority(&engines[0]));
        assert_eq!(destination(&answer), (want.clone(), want));
        gw.send(response_headers(status, "application/json")).await;
        let _ = gw.answer().await;
        let usage = br#"{"choices":[{"text":" t t t t"}],"usage":{"prompt_tokens":9,"completion_tokens":4}}"#;
        gw.send(response_body(usage, true)).await;
        let Answer::ResponseBody(b) = gw.answer().await else { panic!() };
        assert!(b.response.is_none(), "buffered: not echoed");
        eventually("released", || live_bookings(&node) == 0).await;
        let line = format!("kvmesh_replica_requests_total{{replica=\"e0\",outcome=\"{outcome}\"}} 1");
        assert!(metric(&node, "kvmesh_replica_requests_total").contains(&line), "{}", metric(&node, "kvmesh_replica"));
    }
    node.stop().await;
    engines.into_iter().next().unwrap().stop().await;
}

fn subset_metadata(endpoints: &[&str]) -> Metadata {
    let list = ListValue {
        values: endpoints.iter().map(|e| Value { kind: Some(Kind::StringValue(e.to_string())) }).collect(),
    };
    let inner = Struct {
        fields: [("x-gateway-destination-endpoint-subset".to_string(), Value { kind: Some(Kind::ListValue(list)) })]
            .into_iter()
            .collect(),
    };
    Metadata {
        filter_metadata: [("envoy.lb.subset_hint".to_string(), inner)].into_iter().collect(),
        ..Default::default()
    }
}

/// A subset restricts the pick; a subset naming no replica is a 503 even failing open (the
/// protocol's rule); a bodiless request (`GET /v1/models`) gets a destination on its headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pick_stays_inside_the_gateways_subset() {
    let (node, engines) = fleet(2, EppSection { fail_open: true, ..EppSection::default() }).await;
    for target in [1, 0, 1] {
        let mut gw = Gateway::open(&node).await;
        let only = authority(&engines[target]);
        gw.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), Some(subset_metadata(&[&only])))
            .await;
        gw.send(request_body(&completion(false), true)).await;
        assert_eq!(destination(&gw.answer_with_metadata().await).0, Some(only));
    }
    let mut gw = Gateway::open(&node).await;
    gw.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), Some(subset_metadata(&["10.9.9.9:80"])))
        .await;
    gw.send(request_body(&completion(false), true)).await;
    let Answer::ImmediateResponse(i) = gw.answer().await else { panic!("an immediate 503") };
    assert_eq!(i.status.unwrap().code, 503);

    let mut gw = Gateway::open(&node).await;
    gw.send_with(
        request_headers("/v1/models", true),
        Some(FULL_DUPLEX),
        Some(subset_metadata(&[&authority(&engines[0])])),
    )
    .await;
    assert_eq!(destination(&gw.answer_with_metadata().await).0, Some(authority(&engines[0])));
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

mod failures;
