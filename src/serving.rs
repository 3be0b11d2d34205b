//! The serving loop, generic over the app it serves: the HTTPS webhook port and the plain-HTTP
//! probe port both run it. Every connection and request is bounded, and shutdown drains
//! gracefully.
//!
//! Bounds ([`Limits`]): a cap on concurrent connections (over it, a new connection is closed at
//! once); a deadline for the TLS handshake; a deadline for request headers (HTTP/1); an idle
//! timeout (no byte read or written for that long closes the connection: a stalled HTTP/2
//! preface, a body that stops arriving, a keep-alive or HTTP/2 connection left open); a bound
//! on HTTP/2 streams per connection. Requests in flight and their duration are bounded by
//! [`limit_requests`] (a refused request's body is read and dropped, so its client gets the
//! answer), bodies by the router's limit.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt as _;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use axum::Json;
use axum::response::IntoResponse;
use serde_json::json;

use crate::metrics::{AdmissionResult, Metrics};

/// What a connection and a request may take.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Concurrent connections; over it a new connection is closed at once.
    pub max_connections: usize,
    /// Deadline of the TLS handshake.
    pub handshake_timeout: Duration,
    /// Deadline for a request's headers to arrive (HTTP/1).
    pub header_timeout: Duration,
    /// A connection with no byte read or written for this long is closed.
    pub idle_timeout: Duration,
    /// Concurrent HTTP/2 streams per connection.
    pub max_streams: u32,
    /// A connection, however active (HTTP/2 pings included), is closed gracefully at this age:
    /// no client holds a slot forever, and clients spread over new replicas after a rollout.
    pub max_age: Duration,
}

impl Limits {
    /// The webhook port's limits.
    pub const WEBHOOK: Limits = Limits {
        max_connections: 1024,
        handshake_timeout: Duration::from_secs(10),
        header_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(30),
        max_streams: 64,
        max_age: Duration::from_secs(600),
    };

    /// The probe port's limits (a kubelet and a Prometheus need a few connections).
    pub const PROBES: Limits = Limits {
        max_connections: 64,
        handshake_timeout: Duration::from_secs(10),
        header_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(30),
        max_streams: 8,
        max_age: Duration::from_secs(600),
    };
}

/// A JSON error body `{"error": message}` with `status`.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

/// Requests in flight, and how long one may take.
#[derive(Clone)]
pub struct RequestLimit {
    permits: Arc<Semaphore>,
    timeout: Duration,
    /// The largest body a refused request has read and dropped.
    max_body: usize,
    /// Counts refused requests by path (the webhook port).
    metrics: Option<Arc<Metrics>>,
}

impl RequestLimit {
    /// At most `in_flight` requests at once, each answered within `timeout`; a refused
    /// request's body (up to `max_body` bytes) is read and dropped; refusals counted in
    /// `metrics` if given.
    pub fn new(
        in_flight: usize,
        timeout: Duration,
        max_body: usize,
        metrics: Option<Arc<Metrics>>,
    ) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(in_flight)),
            timeout,
            max_body,
            metrics,
        }
    }

    fn refused(&self, path: &str, result: AdmissionResult) {
        if let Some(m) = &self.metrics {
            m.refused(path, result);
        }
    }
}

/// Middleware: beyond the requests in flight allowed, a request is answered with 503 and a JSON
/// message as soon as its body has been read and dropped (never queued, never handled); a
/// request that takes longer than the timeout gets 503.
pub async fn limit_requests(
    State(limit): State<RequestLimit>,
    request: Request,
    next: Next,
) -> Response {
    let Ok(_permit) = limit.permits.clone().try_acquire_owned() else {
        limit.refused(request.uri().path(), AdmissionResult::Overloaded);
        discard_body(request.into_body(), limit.max_body, limit.timeout).await;
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many requests in flight; retry",
        );
    };
    let path = request.uri().path().to_owned();
    match tokio::time::timeout(limit.timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            limit.refused(&path, AdmissionResult::TimedOut);
            error_response(StatusCode::SERVICE_UNAVAILABLE, "request timed out")
        }
    }
}

/// Reads a refused request's body to its end and drops it, chunk by chunk (at most `max`
/// bytes, within `within`), so that a client still sending gets the answer and an HTTP/1
/// connection stays usable: a connection closed with unread data is reset, and the answer can
/// be lost with it (as nginx discards the body of a request it answers early).
async fn discard_body(body: Body, max: usize, within: Duration) {
    let mut chunks = body.into_data_stream();
    let mut read = 0usize;
    let _ = tokio::time::timeout(within, async {
        while let Some(Ok(chunk)) = chunks.next().await {
            read += chunk.len();
            if read > max {
                break;
            }
        }
    })
    .await;
}

/// Whether a connection's client presented a verified certificate (HTTPS connections only).
#[derive(Clone, Copy, Debug)]
pub struct ClientCertificate {
    /// Presented and verified against `--client-ca`.
    pub verified: bool,
}

/// When a connection last read or wrote a byte.
#[derive(Clone)]
struct Activity {
    base: Instant,
    last_millis: Arc<AtomicU64>,
}

impl Activity {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            last_millis: Arc::default(),
        }
    }

    fn touch(&self) {
        let now = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_millis.store(now, Ordering::Relaxed);
    }

    /// Resolves once no byte has moved for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = Duration::from_millis(self.last_millis.load(Ordering::Relaxed));
            let quiet = self.base.elapsed().saturating_sub(last);
            if quiet >= idle {
                return;
            }
            tokio::time::sleep(idle - quiet).await;
        }
    }
}

/// An IO that records its activity.
struct Watched<IO> {
    inner: IO,
    activity: Activity,
}

impl<IO> Watched<IO> {
    /// Counts a write that moved bytes as activity; returns it unchanged.
    fn wrote(&self, polled: Poll<std::io::Result<usize>>) -> Poll<std::io::Result<usize>> {
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Watched<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Watched<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote(polled)
    }

    // Vectored writes pass through, so that rustls writes the TLS records it has queued (a
    // handshake flight) in one system call rather than one call and one segment per record.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serves `app` on `listener` until `shutdown` (over TLS when `tls` is given), then drains
/// connections for at most `drain`.
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
    drain: Duration,
) {
    let connections = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(error) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        // Answers are small and latency-bound: send each as soon as it is written (no Nagle
        // delay behind the peer's delayed ACK).
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, %peer, "could not set TCP_NODELAY");
        }
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "connection limit reached; closing the new connection");
            drop(tcp);
            continue;
        };
        let (tls, app, shutdown) = (tls.clone(), app.clone(), shutdown.clone());
        connections.spawn(async move {
            let _slot = slot;
            serve_connection(tls, tcp, peer, app, limits, shutdown).await;
        });
    }
    drop(listener);
    connections.close();
    if tokio::time::timeout(drain, connections.wait())
        .await
        .is_err()
    {
        tracing::warn!("drain deadline reached with connections still open");
    }
}

async fn serve_connection(
    tls: Option<TlsAcceptor>,
    tcp: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let activity = Activity::new();
    let tcp = Watched {
        inner: tcp,
        activity: activity.clone(),
    };
    match tls {
        None => run_http(tcp, peer, app, limits, activity, shutdown).await,
        Some(acceptor) => {
            match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => {
                    // Whether the client presented a certificate the configured CA verified
                    // (rustls refused the handshake if it presented a bad one).
                    let verified = stream.get_ref().1.peer_certificates().is_some();
                    let app = app.layer(axum::Extension(ClientCertificate { verified }));
                    run_http(stream, peer, app, limits, activity, shutdown).await
                }
                Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        }
    }
}

async fn run_http<IO>(
    io: IO,
    peer: SocketAddr,
    app: Router,
    limits: Limits,
    activity: Activity,
    shutdown: CancellationToken,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_streams);
    let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
    tokio::pin!(conn);
    let why = tokio::select! {
        result = conn.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
            return;
        }
        () = activity.idle_for(limits.idle_timeout) => "idle",
        () = tokio::time::sleep(limits.max_age) => "at its maximum age",
        () = shutdown.cancelled() => "shutting down",
    };
    tracing::debug!(%peer, why, "closing the connection");
    conn.as_mut().graceful_shutdown();
    // What is in flight finishes, within the idle bound again.
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%peer, %error, "connection ended with an error while closing");
            }
        }
        () = activity.idle_for(limits.idle_timeout) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_watched_socket_writes_vectored_and_counts_it_as_activity() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let tcp = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (mut peer, _) = listener.accept().await.expect("accept");
        // Started a second ago and never touched: a touch now stores about 1000 ms.
        let activity = Activity {
            base: Instant::now()
                .checked_sub(Duration::from_secs(1))
                .expect("a second of uptime"),
            last_millis: Arc::default(),
        };
        let mut watched = Watched {
            inner: tcp,
            activity: activity.clone(),
        };
        assert!(watched.is_write_vectored(), "forwarded from the socket");
        let slices = [
            std::io::IoSlice::new(b"two "),
            std::io::IoSlice::new(b"records"),
        ];
        let written = watched.write_vectored(&slices).await.expect("write");
        assert_eq!(written, 11, "both slices in one call");
        assert!(
            activity.last_millis.load(Ordering::Relaxed) >= 1000,
            "counted as activity"
        );
        let mut got = [0u8; 11];
        peer.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"two records");
    }
}
