//! The HTTP accept loop, with the limits axum's `serve` lacks: a header-read timeout
//! (slowloris), an idle keep-alive timeout, and a cap on open connections, so clients that
//! hold connections open cannot take the node's file descriptors.
//!
//! ```text
//! accept (one permit of `max_connections` each) ─► hyper http1
//!     └─ watchdog, while no request is in flight on the connection:
//!          a request's first bytes came `header_timeout` ago, its headers still incomplete ─► close
//!          nothing came for `idle_timeout` since the last response (or the connect)      ─► close
//! ```
//!
//! The watchdog, not hyper's `header_read_timeout`, keeps both clocks: hyper starts that timer
//! as soon as a keep-alive connection goes idle, which would make the idle timeout the header
//! timeout.

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
    /// A connection with nothing in flight and no new request for this long is closed.
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
        ServeLimits { header_timeout: l.http_header_timeout, idle_timeout: l.http_idle_timeout, max_connections }
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
    let activity = Arc::new(Activity {
        started: Instant::now(),
        first_read_ms: AtomicU64::new(0),
        idle_since_ms: AtomicU64::new(0),
        in_flight: AtomicUsize::new(0),
    });
    let io = Watched { inner: io, activity: activity.clone() };
    let requests = activity.clone();
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
    builder.timer(TokioTimer::new()).header_read_timeout(None).keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(io), service).with_upgrades();
    let mut conn = std::pin::pin!(conn);
    let check =
        (limits.idle_timeout.min(limits.header_timeout) / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
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
                // Nothing of the client's is in flight: dropping the connection loses nothing.
                if activity.overdue(&limits).is_some() {
                    return;
                }
            }
            _ = stop.wait_for(|s| *s), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// One connection's clocks, milliseconds since `started` (0: not set; stamps are +1).
struct Activity {
    started: Instant,
    /// When the first byte of a request not yet handed to the service came.
    first_read_ms: AtomicU64,
    /// When the last request ended (its response body sent or dropped).
    idle_since_ms: AtomicU64,
    in_flight: AtomicUsize,
}

/// Why a connection is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Overdue {
    /// Its request's headers did not complete within the header timeout.
    Headers,
    /// It sat idle past the idle timeout.
    Idle,
}

impl Activity {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64 + 1
    }

    /// Whether the connection, with nothing in flight, is past a limit now.
    fn overdue(&self, limits: &ServeLimits) -> Option<Overdue> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let now = self.now_ms();
        let since = |t: u64| Duration::from_millis(now.saturating_sub(t));
        match self.first_read_ms.load(Ordering::Acquire) {
            0 => (since(self.idle_since_ms.load(Ordering::Acquire)) >= limits.idle_timeout).then_some(Overdue::Idle),
            first => (since(first) >= limits.header_timeout).then_some(Overdue::Headers),
        }
    }
}

/// Counts one request in flight on its connection until dropped.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(a: Arc<Activity>) -> Self {
        a.in_flight.fetch_add(1, Ordering::AcqRel);
        // Its headers are in: the header clock stops.
        a.first_read_ms.store(0, Ordering::Release);
        InFlight(a)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.idle_since_ms.store(self.0.now_ms(), Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
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

/// An IO that starts the header clock at the first byte of a request.
struct Watched<I> {
    inner: I,
    activity: Arc<Activity>,
}

impl<I> Watched<I> {
    fn read_some(&self) {
        let a = &self.activity;
        if a.in_flight.load(Ordering::Acquire) == 0 {
            let _ = a.first_read_ms.compare_exchange(0, a.now_ms(), Ordering::AcqRel, Ordering::Acquire);
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.read_some();
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_clock_runs_from_a_requests_first_byte_and_the_idle_clock_from_the_last_response() {
        let limits = ServeLimits {
            header_timeout: Duration::from_millis(100),
            idle_timeout: Duration::from_millis(1000),
            max_connections: 1,
        };
        let a = Arc::new(Activity {
            started: Instant::now() - Duration::from_millis(5000),
            first_read_ms: AtomicU64::new(0),
            idle_since_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
        });
        // Connected 5 s ago, nothing sent: idle.
        assert_eq!(a.overdue(&limits), Some(Overdue::Idle));
        // Half a header, 200 ms ago: slowloris.
        a.first_read_ms.store(a.now_ms() - 200, Ordering::Release);
        assert_eq!(a.overdue(&limits), Some(Overdue::Headers));
        // Its headers done: in flight, never overdue however long it runs.
        let req = InFlight::new(a.clone());
        assert_eq!(a.overdue(&limits), None);
        drop(req);
        // Just answered: neither clock has run out.
        assert_eq!(a.overdue(&limits), None);
        a.idle_since_ms.store(a.now_ms() - 1500, Ordering::Release);
        assert_eq!(a.overdue(&limits), Some(Overdue::Idle));
    }
}
