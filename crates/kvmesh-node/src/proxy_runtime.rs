//! The HTTP proxy's own runtime, on threads of its own (`node.proxy_threads`).
//!
//! Why: on the node's main runtime a proxied request shares workers with KV-event ingestion,
//! Raft, gossip and scrapes, and its connections share a pool with the scrapes. On a runtime
//! of its own the proxy's tasks and its engine connections stay on its threads; with one
//! thread every hand-off (client connection, engine connection, response) stays on it.

use std::net::TcpListener as StdListener;

use anyhow::Context;
use axum::Router;
use tokio::sync::{oneshot, watch};

/// Serves `app` on `listener` (with TLS when `tls` is set) from `threads` threads of a new
/// runtime (a current-thread one for 1), until `stopped` turns true (graceful: open requests
/// finish). Returns a task on the caller's runtime that ends once the proxy's runtime is gone
/// (its connections closed, the port released); aborting that task closes every open
/// connection at once.
///
/// # Errors
/// The runtime cannot be built, the listener cannot be moved to it, or the thread cannot
/// start.
pub fn spawn(
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    app: Router,
    limits: crate::http_server::ServeLimits,
    threads: u32,
    mut stopped: watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let runtime = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads as usize)
            .thread_name("kvmesh-proxy")
            .enable_all()
            .build()
    }
    .context("starting the HTTP proxy's runtime")?;
    // A tokio listener is registered with the runtime that made it: move it as a std one.
    let listener: StdListener = listener.into_std().context("moving the HTTP listener to the proxy runtime")?;
    let listener = {
        let _inside = runtime.enter();
        Listener::new(tokio::net::TcpListener::from_std(listener)?, tls, limits.max_connections)?
    };
    let (done_tx, done_rx) = oneshot::channel::<()>();
    // Dropped when the waiting task below ends or is aborted: the proxy stops serving at once.
    let (abort_tx, abort_rx) = oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("kvmesh-proxy".into())
        .spawn(move || {
            runtime.block_on(async move {
                let shutdown = async move {
                    let _ = stopped.wait_for(|s| *s).await;
                };
                tokio::select! {
                    r = listener.serve(app, limits, shutdown) => if let Err(e) = r {
                        tracing::error!(error = %e, "HTTP proxy ended");
                    },
                    _ = abort_rx => {}
                }
            });
            // Its connections and the engine pool's tasks end with the runtime, before the
            // node hears that the proxy is done.
            drop(runtime);
            drop(done_tx);
        })
        .context("starting the HTTP proxy thread")?;
    Ok(tokio::spawn(async move {
        let _abort = abort_tx;
        let _ = done_rx.await;
    }))
}

enum Listener {
    Plain(tokio::net::TcpListener),
    Tls(crate::tls::TlsListener),
}

impl Listener {
    /// Call inside the proxy's runtime: a TLS listener starts its handshake task there. At
    /// most `max_pending` TLS connections wait accepted and not yet served.
    fn new(
        tcp: tokio::net::TcpListener,
        tls: Option<tokio_rustls::TlsAcceptor>,
        max_pending: usize,
    ) -> std::io::Result<Listener> {
        Ok(match tls {
            Some(acceptor) => Listener::Tls(crate::tls::TlsListener::new(tcp, acceptor, max_pending)?),
            None => Listener::Plain(tcp),
        })
    }

    async fn serve(
        self,
        app: Router,
        limits: crate::http_server::ServeLimits,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        use crate::http_server::serve;
        match self {
            Listener::Tls(l) => serve(l, app, limits, shutdown).await,
            // No Nagle on client connections: streamed tokens leave as the engine sends them
            // (what nginx and Envoy do for proxied traffic).
            Listener::Plain(l) => {
                use axum::serve::ListenerExt;
                let l = l.tap_io(|tcp| {
                    let _ = tcp.set_nodelay(true);
                });
                serve(l, app, limits, shutdown).await
            }
        }
    }
}
