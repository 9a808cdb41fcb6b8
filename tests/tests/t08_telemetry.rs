//! Trace export: a node with an OTLP endpoint sends one `request` span per proxied request
//! (with the decision: replica, reason, overlap, estimate, outcome, and its `first token` and
//! `complete` events) and an `upstream` child per attempt, over real OTLP/gRPC to a collector
//! (a minimal one, in this test); W3C trace context goes from the client through the node to
//! the engine, with SERVER/CLIENT kinds, error status and the service's resource.
//!
//! Alone in its test binary: the subscriber it installs is process-global.

mod common;

use kvmesh_node::config::{NodeSection, ReplicaConfig};
use kvmesh_node::telemetry::{LogFormat, Telemetry};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
    resources: Arc<Mutex<Vec<opentelemetry_proto::tonic::resource::v1::Resource>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            self.resources.lock().unwrap().extend(rs.resource);
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

fn attr(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| a.value.as_ref()?.value.as_ref()).map(|v| match v {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        Value::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_spans_reach_an_otlp_collector() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = TraceServiceServer::new(collector.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(server)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    // Alone in this process: nothing else reads the environment meanwhile.
    std::env::set_var("OTEL_SERVICE_NAME", "router-under-test");
    let telemetry = Telemetry::init(LogFormat::Json, Some(&format!("http://{addr}")), "info", "node-7").unwrap();

    let engine = common::engines(1, 5.0).await.remove(0);
    let replicas = vec![ReplicaConfig { capacity_blocks: 1000, ..common::replica(0, &engine) }];
    let section = NodeSection { scrape_interval: NodeSection::default().scrape_interval, ..common::section() };
    let node = kvmesh_node::start(common::single(section, replicas)).await.unwrap();
    let client = reqwest::Client::new();
    for stream in [false, true] {
        let r = client
            .post(format!("http://{}/v1/completions", node.http))
            .json(&serde_json::json!({"model": "m", "prompt": "hello world, tell me a story", "max_tokens": 3, "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await.unwrap();
    }
    // A client that traces: its trace goes on through the node to the engine.
    let (trace, parent) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let r = client
        .post(format!("http://{}/v1/completions", node.http))
        .header("traceparent", format!("00-{trace}-{parent}-01"))
        .json(&serde_json::json!({"model": "m", "prompt": "a traced request", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await.unwrap();
    // An engine failure: both spans end in error.
    engine.faults.set(kvmesh_engine_sim::faults::Faults { status: Some(500), ..Default::default() });
    let r = client
        .post(format!("http://{}/v1/completions", node.http))
        .json(&serde_json::json!({"model": "m", "prompt": "this one fails", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
    let received = engine.traceparents();
    node.stop().await;
    engine.stop().await;
    telemetry.shutdown().await;

    let t0 = Instant::now();
    let spans = loop {
        let spans = collector.spans.lock().unwrap().clone();
        if spans.iter().filter(|s| s.name == "request").count() >= 4 || t0.elapsed() > Duration::from_secs(10) {
            break spans;
        }
        drop(spans);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let requests: Vec<&Span> = spans.iter().filter(|s| s.name == "request").collect();
    assert_eq!(requests.len(), 4, "{:?}", spans.iter().map(|s| &s.name).collect::<Vec<_>>());
    use opentelemetry_proto::tonic::trace::v1::{span::SpanKind, status::StatusCode};
    let child =
        |r: &Span| spans.iter().find(|s| s.parent_span_id == r.span_id && s.name == "upstream").cloned().unwrap();
    let status = |s: &Span| s.status.as_ref().map_or(StatusCode::Unset as i32, |st| st.code);
    for r in &requests {
        assert_eq!(r.kind, SpanKind::Server as i32, "request spans are SERVER spans");
        assert_eq!(child(r).kind, SpanKind::Client as i32, "upstream calls are CLIENT spans");
    }
    // Every engine call carried the upstream span's context: the trace and that span's id.
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    assert_eq!(received.len(), 4, "{received:?}");
    for (r, tp) in requests.iter().zip(&received) {
        assert_eq!(*tp, format!("00-{}-{}-01", hex(&r.trace_id), hex(&child(r).span_id)));
    }
    let traced = requests[2];
    assert_eq!((hex(&traced.trace_id), hex(&traced.parent_span_id)), (trace.to_string(), parent.to_string()));
    let failed = requests[3];
    assert_eq!(attr(failed, "outcome").as_deref(), Some("upstream_error"));
    assert_eq!((status(failed), status(&child(failed))), (StatusCode::Error as i32, StatusCode::Error as i32));
    assert_eq!(status(requests[0]), StatusCode::Unset as i32, "an ok request has no error status");
    let resource = collector.resources.lock().unwrap()[0].clone();
    let res = |key: &str| {
        resource.attributes.iter().find(|a| a.key == key).and_then(|a| match a.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            _ => None,
        })
    };
    assert_eq!(res("service.name").as_deref(), Some("router-under-test"));
    assert_eq!(res("service.instance.id").as_deref(), Some("node-7"));
    for r in &requests[..2] {
        assert_eq!(attr(r, "replica").as_deref(), Some("e0"));
        assert_eq!(attr(r, "reason").as_deref(), Some("lowest_cost"));
        assert_eq!(attr(r, "outcome").as_deref(), Some("ok"));
        assert_eq!(attr(r, "prompt_tokens").as_deref(), Some("7"));
        assert_eq!(attr(r, "path").as_deref(), Some("/v1/completions"));
        assert!(attr(r, "estimated_ttft_s").is_some());
        // The per-request events ride on it (debug in the log, exported all the same).
        let events: Vec<&str> = r.events.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(events, ["routed", "first token", "complete"]);
        // Its upstream call is a child span.
        let children: Vec<&Span> = spans.iter().filter(|s| s.parent_span_id == r.span_id).collect();
        assert_eq!(children.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), vec!["upstream"]);
    }
}
