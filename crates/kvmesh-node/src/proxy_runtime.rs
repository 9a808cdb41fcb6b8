//! The HTTP proxy's own runtime, on threads of its own (`node.proxy_threads`).
//!
//! Why: a proxied request hands off between the client's connection task, the engine
//! connection's task and back. On the node's main multi-thread runtime those tasks land on
//! whichever worker is awake, and each cross-thread wake-up is a futex and a context switch on
//! the request's path. With one proxy thread every hand-off stays on it; event ingestion, Raft,
//! gossip and scrapes run on the main runtime and do not delay it.

use std::net::TcpListener as StdListener;

use anyhow::Context;
use axum::Router;
use tokio::sync::{oneshot, watch};

/// Serves `app` on `listener` (with TLS when `tls` is set) from `threads` threads of a new
/// runtime, until `stopped` turns true (graceful: open requests finish). Returns a task on
/// the caller's runtime that ends when the proxy has; aborting that task closes every open
/// connection at once.
///
/// # Errors
/// The listener cannot be moved off the caller's runtime, or the thread cannot start.
pub fn spawn(
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    app: Router,
    threads: u32,
    mut stopped: watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    // A tokio listener is registered with the runtime that made it: move it as a std one.
    let listener: StdListener = listener.into_std().context("moving the HTTP listener to the proxy runtime")?;
    let (done_tx, done_rx) = oneshot::channel::<()>();
    // Dropped when the waiting task below ends or is aborted: the proxy stops serving at once.
    let (abort_tx, abort_rx) = oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("kvmesh-proxy".into())
        .spawn(move || {
            let built = if threads <= 1 {
                tokio::runtime::Builder::new_current_thread().enable_all().build()
            } else {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(threads as usize)
                    .thread_name("kvmesh-proxy")
                    .enable_all()
                    .build()
            };
            let runtime = match built {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(error = %e, "starting the HTTP proxy runtime; the proxy is not serving");
                    return;
                }
            };
            runtime.block_on(async move {
                let shutdown = async move {
                    let _ = stopped.wait_for(|s| *s).await;
                };
                let serve = serve(listener, tls, app, shutdown);
                tokio::select! {
                    r = serve => if let Err(e) = r {
                        tracing::error!(error = %e, "HTTP proxy ended");
                    },
                    _ = abort_rx => {}
                }
            });
            drop(done_tx);
        })
        .context("starting the HTTP proxy thread")?;
    Ok(tokio::spawn(async move {
        let _abort = abort_tx;
        let _ = done_rx.await;
    }))
}

async fn serve(
    listener: StdListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    match tls {
        Some(acceptor) => {
            let l = crate::tls::TlsListener::new(listener, acceptor)?;
            axum::serve(l, app).with_graceful_shutdown(shutdown).await
        }
        // No Nagle on client connections: streamed tokens leave as the engine sends them
        // (what nginx and Envoy do for proxied traffic).
        None => {
            use axum::serve::ListenerExt;
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            axum::serve(listener, app).with_graceful_shutdown(shutdown).await
        }
    }
}
