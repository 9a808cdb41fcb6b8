//! Logs and traces: `tracing` everywhere; output as text or JSON lines, and spans exported
//! with OpenTelemetry OTLP (gRPC) when an endpoint is configured.
//!
//! Per request the proxy opens a `request` span (route decision with its reason, overlap and
//! estimated TTFT, the chosen replica, the outcome) with an `upstream` child span for each
//! attempt at an engine, and `first_token` / `complete` events. All of these are at debug: they
//! always reach the OTLP exporter, and the log only at debug
//! (`RUST_LOG=info,kvmesh_node::proxy=debug`). Pitfalls handled here (see
//! `../shared/LIBRARIES.md` §5): the batch exporter needs a multi-thread tokio runtime (the node
//! has one); OpenTelemetry's own logs are kept out of the OTel layer (re-entrancy), and the
//! provider is shut down off the async workers with a timeout.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::io::IsTerminal;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

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
    pub fn init(format: LogFormat, otlp_endpoint: Option<&str>, default_filter: &str) -> anyhow::Result<Telemetry> {
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
        let (otel, provider) = match otlp_endpoint {
            Some(endpoint) => {
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint)
                    .build()
                    .map_err(|e| anyhow::anyhow!("OTLP exporter for {endpoint}: {e}"))?;
                let provider = SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(opentelemetry_sdk::Resource::builder().with_service_name("kvmesh-node").build())
                    .build();
                let tracer = provider.tracer("kvmesh-node");
                // Only kvmesh's own spans and events, at info and above whatever RUST_LOG says,
                // plus the proxy's per-request spans and events (debug in the log: formatting
                // them for every request costs too much there): the request spans are the
                // point, and the exporter's own transport (tonic, h2, hyper) and
                // OpenTelemetry's logs must never feed back into it.
                let ours = tracing_subscriber::filter::filter_fn(|m| {
                    m.target().starts_with("kvmesh")
                        && (*m.level() <= tracing::Level::INFO
                            || (m.target() == "kvmesh_node::proxy" && *m.level() <= tracing::Level::DEBUG))
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
