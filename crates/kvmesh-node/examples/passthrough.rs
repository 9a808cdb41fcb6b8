//! The floor for `tests/load/router_compare.sh`: an HTTP hop built from the same libraries as
//! the node's proxy (axum server, reqwest client, one current-thread tokio runtime) that does
//! nothing else — no parsing, no routing, no bookings, no metrics; engines taken in turn.
//! What a router adds beyond this is its own work.
//!
//! Usage: `passthrough LISTEN_ADDR ENGINE_URL[,ENGINE_URL…]`

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

struct Engines {
    http: reqwest::Client,
    urls: Vec<String>,
    next: AtomicUsize,
}

async fn forward(State(e): State<Arc<Engines>>, body: Bytes) -> Response {
    let url = &e.urls[e.next.fetch_add(1, Ordering::Relaxed) % e.urls.len()];
    let sent = e.http.post(url).header("content-type", "application/json").body(body).send().await;
    match sent {
        Ok(r) => {
            let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            match r.bytes().await {
                Ok(b) => (status, [("content-type", "application/json")], Body::from(b)).into_response(),
                Err(err) => (StatusCode::BAD_GATEWAY, err.to_string()).into_response(),
            }
        }
        Err(err) => (StatusCode::BAD_GATEWAY, err.to_string()).into_response(),
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(engine_urls)) = (args.next(), args.next()) else {
        eprintln!("usage: passthrough LISTEN_ADDR ENGINE_URL[,ENGINE_URL…]");
        std::process::exit(2);
    };
    let urls = engine_urls.split(',').map(|u| format!("{}/v1/completions", u.trim_end_matches('/'))).collect();
    let engines = Arc::new(Engines { http: reqwest::Client::new(), urls, next: AtomicUsize::new(0) });
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let app = Router::new()
            .route("/v1/completions", post(forward))
            .route("/health", get(|| async { "ok" }))
            .with_state(engines);
        let listener = tokio::net::TcpListener::bind(&listen).await?;
        eprintln!("passthrough: listening on {listen}, forwarding /v1/completions to {engine_urls}");
        use axum::serve::ListenerExt;
        // No Nagle, as the node's proxy.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, app).await?;
        Ok(())
    })
}
