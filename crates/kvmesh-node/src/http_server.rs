//! The HTTP accept loop, with the limits axum's `serve` lacks: a header-read timeout
//! (slowloris), an idle keep-alive timeout, and a cap on open connections, so clients that
//! hold connections open cannot take the node's file descriptors.
//!
//! ```text
//! accept (one permit of `max_connections` each) ─► hyper http1 (header_read_timeout)
//!     └─ watchdog: no request in flight and no byte moved for `idle_timeout` ─► graceful close
//! ```

use axum::body::Body;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// What one client connection may hold.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// A request's headers must arrive within this.
    pub header_timeout: Duration,
    /// A connection with nothing in flight and no byte moving for this long is closed.
    pub idle_timeout: Duration,
    /// Most connections open at once (the rest wait in the listen backlog).
    pub max_connections: usize,
}

impl ServeLimits {
    /// `[limits]`' HTTP keys, with the connection cap lowered to the process's open-file limit
    /// less 256 (its own sockets and files) when that is smaller, with a warning.
    pub fn from_config(l: &crate::config::LimitsSection) -> Self {
        let mut max_connections = l.http_max_connections;
        if let Some(fds) = open_file_limit() {
            let room = fds.saturating_sub(256).max(16) as usize;
            if room < max_connections {
                tracing::warn!(
                    configured = max_connections,
                    open_file_limit = fds,
                    using = room,
                    "limits.http_max_connections is above the open-file limit less 256; lowered (raise `ulimit -n` to allow more)"
                );
                max_connections = room;
            }
        }
        ServeLimits {
            header_timeout: Duration::from_millis(l.http_header_timeout_ms),
            idle_timeout: Duration::from_secs(l.http_idle_timeout_s),
            max_connections,
        }
    }
}

/// The soft open-file limit (Linux: `/proc/self/limits`); `None` elsewhere or unlimited.
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Serves `app` on `listener` within `limits` until `shutdown` resolves, then closes idle
/// connections and waits for open requests to finish.
///
/// # Errors
/// Never at present (accept errors are retried by the listener); the `Result` leaves room.
pub async fn serve<L>(
    mut listener: L,
    app: Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()>
where
    L: axum::serve::Listener,
    L::Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = &mut shutdown => break,
        };
        let (io, _) = tokio::select! {
            a = listener.accept() => a,
            _ = &mut shutdown => break,
        };
        tokio::spawn(connection(io, app.clone(), limits, stop_rx.clone(), permit));
    }
    let _ = stop_tx.send(true);
    // Every connection holds a permit until it ends.
    let _ = permits.acquire_many(limits.max_connections as u32).await;
    Ok(())
}

async fn connection<I>(
    io: I,
    app: Router,
    limits: ServeLimits,
    mut stop: watch::Receiver<bool>,
    _permit: tokio::sync::OwnedSemaphorePermit,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let started = Instant::now();
    let last_byte = Arc::new(AtomicU64::new(0));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let io = Watched { inner: io, started, last_byte: last_byte.clone() };
    let requests = in_flight.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let guard = InFlight::new(requests.clone());
        let app = app.clone();
        async move {
            let resp = app.oneshot(req.map(Body::new)).await?;
            // The request counts until its response body has been sent (a stream included).
            Ok::<_, std::convert::Infallible>(resp.map(|b| Body::new(Guarded { inner: b, _guard: guard })))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(io), service).with_upgrades();
    let mut conn = std::pin::pin!(conn);
    let check = (limits.idle_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut closing = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "HTTP connection ended with an error");
                }
                return;
            }
            _ = tokio::time::sleep(check), if !closing => {
                let idle = started.elapsed().saturating_sub(Duration::from_millis(last_byte.load(Ordering::Relaxed)));
                if in_flight.load(Ordering::Relaxed) == 0 && idle >= limits.idle_timeout {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            _ = stop.wait_for(|s| *s), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Counts one request in flight on its connection until dropped.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(n: Arc<AtomicUsize>) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        InFlight(n)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that keeps its request counted in flight until it is done or dropped.
struct Guarded {
    inner: Body,
    _guard: InFlight,
}

impl http_body::Body for Guarded {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// An IO that notes when a byte last moved, milliseconds since `started`.
struct Watched<I> {
    inner: I,
    started: Instant,
    last_byte: Arc<AtomicU64>,
}

impl<I> Watched<I> {
    fn touch(&self) {
        self.last_byte.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
