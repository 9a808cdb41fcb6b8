//! Logs and traces: `tracing` everywhere; output as text or JSON lines, and spans exported
//! with OpenTelemetry OTLP (gRPC) when an endpoint is configured.
//!
//! Trace context: an incoming W3C `traceparent` (and `tracestate`) makes the request span
//! its child ([`parent_from`]); each call to an engine carries its `upstream` span's context
//! on ([`inject`]). Request spans are SERVER spans and upstream calls CLIENT spans; a
//! request that ends in anything but `ok` has error status. The resource names the service
//! (`OTEL_SERVICE_NAME`, default `kvmesh-node`) and the node (`service.instance.id`).
//! Export that fails is logged as a warning at most once a minute (with a count).
//!
//! Per request the proxy opens a `request` span (route decision with its reason, overlap and
//! estimated TTFT, the chosen replica, the outcome) with an `upstream` child span for each
//! attempt at an engine, and `first_token` / `complete` events. All of these are at debug: they
//! always reach the OTLP exporter, and the log only at debug
//! (`RUST_LOG=info,kvmesh_node::proxy=debug`). Pitfalls handled here (see
//! `../shared/LIBRARIES.md` §5): the batch exporter needs a multi-thread tokio runtime (the node
//! has one); OpenTelemetry's own logs are kept out of the OTel layer (re-entrancy), and the
//! provider is shut down off the async workers with a timeout.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The target of every per-request span and event, wherever the request came in (the
/// proxy or the endpoint picker): one `RUST_LOG=info,kvmesh_node::proxy=debug` turns them
/// on in the log, and the trace exporter takes them at debug.
pub const REQUEST_TARGET: &str = "kvmesh_node::proxy";

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (for log shippers).
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("unknown log format {other:?}: use text or json")),
        }
    }
}

/// Keeps the trace exporter alive; [`Telemetry::shutdown`] flushes it.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Installs the global subscriber: `RUST_LOG`-style `filter` (default `default_filter`),
    /// logs in `format`, and spans to `otlp_endpoint` (e.g. `http://otel-collector:4317`) when
    /// given. Call from inside the node's multi-thread tokio runtime.
    ///
    /// # Errors
    /// A bad endpoint URL, or a subscriber already installed.
    ///
    /// `instance` names this node in the resource (`service.instance.id`): its cluster id or
    /// its address. The service name is `OTEL_SERVICE_NAME` when set, else `kvmesh-node`;
    /// `OTEL_RESOURCE_ATTRIBUTES` adds to the resource.
    pub fn init(
        format: LogFormat,
        otlp_endpoint: Option<&str>,
        default_filter: &str,
        instance: &str,
    ) -> anyhow::Result<Telemetry> {
        let filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
        let fmt = match format {
            // Colour codes only on a terminal (a log shipper would store them as text), and
            // not when `NO_COLOR` is set (https://no-color.org).
            LogFormat::Text => tracing_subscriber::fmt::layer()
                .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()))
                .with_writer(std::io::stderr)
                .boxed(),
            LogFormat::Json => tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr).boxed(),
        };
        let mut export_line = None;
        let (otel, provider) = match otlp_endpoint {
            Some(endpoint) => {
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint)
                    .build()
                    .map_err(|e| anyhow::anyhow!("OTLP exporter for {endpoint}: {e}"))?;
                // The builder's detectors read OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
                let mut resource = opentelemetry_sdk::Resource::builder();
                if std::env::var_os("OTEL_SERVICE_NAME").is_none_or(|v| v.is_empty()) {
                    resource = resource.with_service_name(DEFAULT_SERVICE_NAME);
                }
                let resource = resource
                    .with_attribute(opentelemetry::KeyValue::new("service.instance.id", instance.to_string()))
                    .build();
                let service = resource
                    .get(&opentelemetry::Key::new("service.name"))
                    .map_or_else(|| DEFAULT_SERVICE_NAME.to_string(), |v| v.to_string());
                let provider = SdkTracerProvider::builder()
                    .with_batch_exporter(Warned::new(exporter, endpoint))
                    .with_resource(resource)
                    .build();
                opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
                PROPAGATING.store(true, Ordering::Relaxed);
                export_line = Some(format!(
                    "trace export on: OTLP/gRPC to {endpoint}, service {service:?}, instance {instance:?}"
                ));
                let tracer = provider.tracer("kvmesh-node");
                // Only kvmesh's own spans and events, at info and above whatever RUST_LOG says,
                // plus the proxy's per-request spans and events (debug in the log: formatting
                // them for every request costs too much there): the request spans are the
                // point, and the exporter's own transport (tonic, h2, hyper) and
                // OpenTelemetry's logs must never feed back into it.
                let ours = tracing_subscriber::filter::filter_fn(|m| {
                    m.target().starts_with("kvmesh")
                        && (*m.level() <= tracing::Level::INFO
                            || (m.target() == REQUEST_TARGET && *m.level() <= tracing::Level::DEBUG))
                });
                let layer = tracing_opentelemetry::layer().with_tracer(tracer).with_filter(ours);
                (Some(layer), Some(provider))
            }
            None => (None, None),
        };
        tracing_subscriber::registry()
            .with(fmt.with_filter(filter()))
            .with(otel)
            .try_init()
            .map_err(|e| anyhow::anyhow!("installing the log subscriber: {e}"))?;
        match export_line {
            Some(line) => tracing::info!("{line}"),
            None => tracing::info!("trace export off (no --otlp-endpoint / OTEL_EXPORTER_OTLP_ENDPOINT)"),
        }
        Ok(Telemetry { provider })
    }

    /// Flushes and stops the exporter (at most 5 s).
    pub async fn shutdown(self) {
        if let Some(p) = self.provider {
            let _ =
                tokio::task::spawn_blocking(move || p.shutdown_with_timeout(std::time::Duration::from_secs(5))).await;
        }
    }
}

/// The service name in the resource without `OTEL_SERVICE_NAME`.
pub const DEFAULT_SERVICE_NAME: &str = "kvmesh-node";

/// Whether trace context is read and passed on (export on): without it, both are skipped
/// and a client's `traceparent` goes to the engine untouched with the other headers.
static PROPAGATING: AtomicBool = AtomicBool::new(false);

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct HeadersMut<'a>(&'a mut http::HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (http::HeaderName::from_bytes(key.as_bytes()), http::HeaderValue::from_str(&value)) {
            self.0.insert(k, v);
        }
    }
}

/// Makes `span` a child of the W3C trace context in `headers` (`traceparent`, `tracestate`),
/// when export is on and the client sent one (an invalid one is ignored: a new trace).
pub fn parent_from(span: &tracing::Span, headers: &http::HeaderMap) {
    if !PROPAGATING.load(Ordering::Relaxed) || !headers.contains_key("traceparent") {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&Headers(headers));
    let _ = span.set_parent(cx);
}

/// Writes `span`'s trace context into `headers` (`traceparent`, `tracestate`) for the engine,
/// when export is on, replacing the client's.
pub fn inject(span: &tracing::Span, headers: &mut http::HeaderMap) {
    if PROPAGATING.load(Ordering::Relaxed) {
        TraceContextPropagator::new().inject_context(&span.context(), &mut HeadersMut(headers));
    }
}

/// Marks `span` failed with `why` (OpenTelemetry error status; no-op without export).
pub fn failed(span: &tracing::Span, why: &str) {
    span.set_status(opentelemetry::trace::Status::error(why.to_string()));
}

/// The exporter, with a warning when export fails: at most one a minute, with the count of
/// failed exports since the last.
#[derive(Debug)]
struct Warned<E> {
    inner: E,
    endpoint: String,
    /// Failed exports since the last warning.
    failed: AtomicU64,
    /// When the last warning was.
    warned_at: Mutex<Option<std::time::Instant>>,
}

impl<E> Warned<E> {
    fn new(inner: E, endpoint: &str) -> Self {
        Warned { inner, endpoint: endpoint.to_string(), failed: AtomicU64::new(0), warned_at: Mutex::new(None) }
    }
}

/// Least time between two export-failure warnings.
const WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

impl<E: SpanExporter> SpanExporter for Warned<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        if let Err(e) = &result {
            let failed = self.failed.fetch_add(1, Ordering::Relaxed) + 1;
            let mut at = self.warned_at.lock().unwrap_or_else(|p| p.into_inner());
            if at.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                *at = Some(std::time::Instant::now());
                self.failed.store(0, Ordering::Relaxed);
                // Outside any span, so the OTel layer drops it (exporting it is what failed);
                // the log gets it.
                tracing::warn!(endpoint = %self.endpoint, error = %e, failed_exports = failed, spans,
                    "trace export failing (warned at most once a minute)");
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: std::time::Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[derive(Debug)]
    struct Down;

    impl SpanExporter for Down {
        async fn export(&self, _batch: Vec<SpanData>) -> OTelSdkResult {
            Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure("collector unreachable".into()))
        }
    }

    /// Counts warnings.
    struct Warnings(Arc<AtomicUsize>);

    impl<S: tracing::Subscriber> Layer<S> for Warnings {
        fn on_event(&self, e: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            if *e.metadata().level() == tracing::Level::WARN {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    #[test]
    fn a_failing_export_warns_once_a_minute_and_counts_the_rest() {
        let warnings = Arc::new(AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry().with(Warnings(warnings.clone()));
        let exporter = Warned::new(Down, "http://collector:4317");
        tracing::subscriber::with_default(subscriber, || {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            for _ in 0..3 {
                assert!(rt.block_on(exporter.export(vec![])).is_err(), "the failure is passed on");
            }
        });
        assert_eq!(warnings.load(Ordering::Relaxed), 1, "one warning for three failures");
        assert_eq!(exporter.failed.load(Ordering::Relaxed), 2, "the other two counted for the next");
    }
}
