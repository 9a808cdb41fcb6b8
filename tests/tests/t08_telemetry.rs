//! Trace export: a node with an OTLP endpoint sends one `request` span per proxied request
//! (with the decision: replica, reason, overlap, estimate, outcome, and its `first token` and
//! `complete` events) and an `upstream` child per attempt, over real OTLP/gRPC to a collector (a minimal one, in this test).
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
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
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
    let telemetry = Telemetry::init(LogFormat::Json, Some(&format!("http://{addr}")), "info").unwrap();

    let engine = common::engines(1, 5.0).await.remove(0);
    let replicas = vec![ReplicaConfig { capacity_blocks: 1000, ..common::replica(0, &engine) }];
    let section = NodeSection { scrape_interval_ms: NodeSection::default().scrape_interval_ms, ..common::section() };
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
    node.stop().await;
    engine.stop().await;
    telemetry.shutdown().await;

    let t0 = Instant::now();
    let spans = loop {
        let spans = collector.spans.lock().unwrap().clone();
        if spans.iter().filter(|s| s.name == "request").count() >= 2 || t0.elapsed() > Duration::from_secs(10) {
            break spans;
        }
        drop(spans);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let requests: Vec<&Span> = spans.iter().filter(|s| s.name == "request").collect();
    assert_eq!(requests.len(), 2, "{:?}", spans.iter().map(|s| &s.name).collect::<Vec<_>>());
    for r in &requests {
        assert_eq!(attr(r, "replica").as_deref(), Some("e0"));
        assert_eq!(attr(r, "reason").as_deref(), Some("lowest_cost"));
        assert_eq!(attr(r, "outcome").as_deref(), Some("ok"));
        assert_eq!(attr(r, "prompt_tokens").as_deref(), Some("7"));
        assert_eq!(attr(r, "path").as_deref(), Some("/v1/completions"));
        assert!(attr(r, "estimated_ttft_s").is_some());
        // The per-request events ride on it (debug in the log, exported all the same).
        let events: Vec<&str> = r.events.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(events, ["first token", "complete"]);
        // Its upstream call is a child span.
        let children: Vec<&Span> = spans.iter().filter(|s| s.parent_span_id == r.span_id).collect();
        assert_eq!(children.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), vec!["upstream"]);
    }
}
