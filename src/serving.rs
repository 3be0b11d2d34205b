//! The serving loop, generic over the app it serves: the HTTPS webhook port and the plain-HTTP
//! probe port both run it. Every connection and request is bounded, and shutdown drains
//! gracefully: once readiness is off ([`Server::draining`]) each HTTP/1 connection closes with
//! its next answer and each HTTP/2 one (chosen in the TLS handshake, or its preface read) is
//! told GOAWAY, and at the shutdown the listener closes and the connections left are closed
//! gracefully, within the idle bound (a client that never acknowledges a GOAWAY's ping is not
//! waited for longer).
//!
//! Bounds ([`Limits`]): a cap on concurrent connections (at it, the connection idle the longest,
//! of those not closing already, is closed to make room, within 0.2 s whatever is in flight on
//! it; a new one is refused only if none frees in time); a deadline for the TLS handshake; a deadline for request headers (HTTP/1:
//! each request's, from the request's first byte; HTTP/2: the first request's, from the
//! connection's first byte after the handshake, past which a connection speaking HTTP/2 is told
//! GOAWAY, and any other closed at once); an idle timeout (no byte read or written for that long
//! closes the connection: a body that stops arriving, a keep-alive or HTTP/2 connection left
//! open); a bound on HTTP/2 streams per connection; a maximum age (HTTP/1: the next answer says
//! `connection: close`, so that a client never sends a request on a connection the server is
//! closing); a send timeout (a client that reads nothing of its answers: its socket taking no
//! byte, or an HTTP/2 answer none of whose pieces is taken, closes the connection at once).
//! The idle, header, age and send bounds share one timer per connection. Requests are
//! bounded by [`RequestLimit::run`], per endpoint: a body is read within a deadline and a size
//! limit before the request counts as in flight, its bytes and what decoding it may build
//! ([`json_values`]) are taken from the endpoint's byte share, then one of its slots (a refused
//! request's body is read and dropped, so its client gets the answer).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
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
    /// Deadline for a request's headers to arrive, from the request's first byte (an HTTP/2
    /// connection's: from its first byte, only if its first request is late; one chosen in the
    /// TLS handshake is then told GOAWAY). A connection that sends nothing is bound by
    /// `idle_timeout`.
    pub header_timeout: Duration,
    /// A connection with no byte read or written for this long is closed.
    pub idle_timeout: Duration,
    /// Concurrent HTTP/2 streams per connection.
    pub max_streams: u32,
    /// A connection, however active (HTTP/2 pings included), is closed gracefully at this age:
    /// no client holds a slot forever, and clients spread over new replicas after a rollout.
    pub max_age: Duration,
    /// A connection whose socket takes no byte of what it has to send for this long (its
    /// client reads nothing: HTTP/1 or HTTP/2), or an HTTP/2 connection with an answer none of
    /// whose pieces could be sent for this long (its client reads none: a window of zero), is
    /// closed at once, within twice this: what its answers hold of the endpoints' shares is
    /// given back then, not at the idle bound or its maximum age.
    pub send_timeout: Duration,
    /// Bytes a second: an HTTP/1 answer larger than one piece ([`ANSWER_PIECE`]: a conversion,
    /// never a review's) is handed over whole within `send_timeout` plus its size at this rate,
    /// or its connection is closed at once. A client that reads steadily but slowly (a byte
    /// now and then, each within the send timeout) holds what its answer keeps of the
    /// endpoint's share for that long at most, not until the connection's maximum age.
    pub min_send_rate: u64,
}

impl Limits {
    /// The webhook port's limits. An idle connection outlasts the API server's own bound for
    /// one (client-go closes a connection idle for 90 s), so the API server closes it first and
    /// never sends a review on a connection this side is closing.
    pub const WEBHOOK: Limits = Limits {
        max_connections: 1024,
        handshake_timeout: Duration::from_secs(10),
        header_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(120),
        max_streams: 16,
        max_age: Duration::from_secs(600),
        send_timeout: Duration::from_secs(10),
        min_send_rate: MIN_SEND_RATE,
    };

    /// The probe port's limits: a kubelet and a Prometheus need a few short connections, so
    /// idle ones go soon (and the most idle makes room at the cap).
    pub const PROBES: Limits = Limits {
        max_connections: 64,
        handshake_timeout: Duration::from_secs(5),
        header_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(5),
        max_streams: 8,
        max_age: Duration::from_secs(600),
        send_timeout: Duration::from_secs(5),
        min_send_rate: MIN_SEND_RATE,
    };
}

/// The slowest an answer is read ([`Limits::min_send_rate`]): 256 KiB a second, a fraction of
/// what the slowest network between an API server and its webhooks carries (a 64 MiB
/// conversion within 4 minutes and 26 seconds).
pub const MIN_SEND_RATE: u64 = 256 << 10;

/// hyper's read buffer for an HTTP/1 connection (`max_buf_size`): a request's head not complete
/// once this much is read is answered 431 and its connection closed, so a connection holds at
/// most about twice this (one more read) before its body is counted by a [`Budget`]. hyper's own
/// default is about 400 KiB; a review's head is under 1 KiB. (HTTP/2 heads are bounded by
/// [`H2_HEADER_LIST_BYTES`].)
pub const HEADER_BYTES: usize = 32 << 10;

/// The largest HTTP/2 request head taken (`SETTINGS_MAX_HEADER_LIST_SIZE`, decoded; hyper's
/// default is 16 KiB): a stream's head is held before its body is counted by a [`Budget`],
/// so at most this times the streams of every connection (16 x 1,024 at the webhook port's
/// limits: 128 MiB) waits so. A review's head is under 1 KiB.
pub const H2_HEADER_LIST_BYTES: u32 = 8 << 10;

/// A JSON error body `{"error": message}` with `status`.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

/// What the requests of one endpoint may hold at once.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Requests handled at once (a request counts only once its body is read).
    pub in_flight: usize,
    /// Bytes: of the bodies being read or handled, plus what decoding them may build
    /// ([`VALUE_COST`] per JSON value).
    pub bytes: usize,
    /// Object keys whose values the endpoint's decoder skips wherever they are (never built):
    /// each counts as one value ([`json_values_pruned`]).
    pub pruned: &'static [&'static str],
    /// Bytes handling a request may hold beyond its body and its counted values, per byte of
    /// the body, charged with it (a conversion copies strings out of it and answers with its
    /// objects; a review's answer is small).
    pub held_per_byte: usize,
}

/// What decoding one JSON value may cost at most, in bytes (a one-entry map as a
/// `serde_json::Value` is a B-tree node of several hundred bytes; a typed element a few
/// hundred with its vector's growth).
pub const VALUE_COST: usize = 512;

/// A request whose body would cost more to decode than its endpoint's whole budget: its
/// handler answers it without decoding it (with the uid, when the envelope gives one).
#[derive(Clone, Copy, Debug)]
pub struct TooComplex {
    /// The JSON values the body holds.
    pub values: usize,
}

impl TooComplex {
    /// Why nothing is decoded, for an answer.
    pub fn message(self) -> String {
        format!(
            "the request holds {} JSON values, more than this server decodes at once",
            self.values
        )
    }
}

/// Units of one budget (an endpoint's slots or bytes) free now. Requests never wait for them
/// (they are refused at once), so a count taken and given back with atomics is all it takes.
struct Free(AtomicUsize);

impl Free {
    /// Takes `n` units if they are free now.
    fn sub(&self, n: usize) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |free| {
                free.checked_sub(n)
            })
            .is_ok()
    }

    /// `n` units, if free now. (Built only once taken: a `Taken` dropped gives its units
    /// back, so one built for a refusal would add units that were never taken.)
    fn take(&self, n: usize) -> Option<Taken<'_>> {
        if self.sub(n) {
            Some(Taken { free: self, n })
        } else {
            None
        }
    }

    /// The units free now.
    fn available(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

/// Units taken from a [`Free`] count, given back when dropped.
struct Taken<'a> {
    free: &'a Free,
    n: usize,
}

impl Taken<'_> {
    /// `n` more units, if free now (else none, and what is held stays held).
    fn more(&mut self, n: usize) -> bool {
        let taken = self.free.sub(n);
        if taken {
            self.n += n;
        }
        taken
    }
}

impl Taken<'_> {
    /// Up to `n` of the units held, no longer given back by this one (handed to an
    /// [`AnswerHold`]): how many.
    fn hand_over(&mut self, n: usize) -> usize {
        let n = n.min(self.n);
        self.n -= n;
        n
    }
}

impl Taken<'_> {
    /// Gives back up to `n` of the units held.
    fn give_back(&mut self, n: usize) {
        let n = n.min(self.n);
        self.n -= n;
        self.free.0.fetch_add(n, Ordering::AcqRel);
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        self.free.0.fetch_add(self.n, Ordering::AcqRel);
    }
}

/// Bytes of an endpoint's share that an answer holds until it is sent (or dropped unsent): an
/// answer its client does not read stays within the share, however long its connection lives.
struct AnswerHold {
    limit: Arc<LimitState>,
    /// The share's place in `limit.shares` (`None`: the other paths').
    share: Option<usize>,
    n: usize,
}

impl Drop for AnswerHold {
    fn drop(&mut self) {
        let share = self
            .share
            .map_or(&self.limit.other, |i| &self.limit.shares[i].1);
        share.bytes.0.fetch_add(self.n, Ordering::AcqRel);
    }
}

/// The most of an answer handed to the connection at once: an answer is sent in pieces, so
/// that what its connection has not sent yet stays within the endpoint's share ([`Held`]).
const ANSWER_PIECE: usize = 16 << 10;

/// An answer's body that holds its bytes of the endpoint's share ([`AnswerHold`]) until the
/// connection drops it: HTTP/2 once its last piece (at most [`ANSWER_PIECE`]) is sent, which
/// needs the client's window; HTTP/1 once that piece is queued. A client that never reads its
/// answers (HTTP/2 with a window of zero, say) holds at most the share, not the server's
/// memory, and over HTTP/2 only until [`Limits::send_timeout`] closes its connection.
struct Held {
    inner: Body,
    rest: Bytes,
    /// Given back when the connection drops the body.
    _hold: AnswerHold,
}

impl http_body::Body for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if this.rest.is_empty() {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => this.rest = data,
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Poll::Ready(None) => return Poll::Ready(None),
                other => return other,
            }
        }
        // Most answers are one piece: handed over whole, without splitting the buffer.
        let piece = if this.rest.len() <= ANSWER_PIECE {
            std::mem::take(&mut this.rest)
        } else {
            this.rest.split_to(ANSWER_PIECE)
        };
        Poll::Ready(Some(Ok(http_body::Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let mut hint = self.inner.size_hint();
        let rest = self.rest.len() as u64;
        // The upper bound first: a lower one above it panics.
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper + rest);
        }
        hint.set_lower(hint.lower() + rest);
        hint
    }
}

/// One endpoint's share: its slots and its bytes.
struct Share {
    slots: Free,
    bytes: Free,
    budget: Budget,
    /// The largest body it takes, where not the limit's own.
    max_body: Option<usize>,
}

impl Share {
    fn new(budget: Budget, max_body: Option<usize>) -> Self {
        Self {
            slots: Free(AtomicUsize::new(budget.in_flight)),
            bytes: Free(AtomicUsize::new(budget.bytes)),
            budget,
            max_body,
        }
    }

    /// `n` more bytes of this share into `held`, if free now.
    fn bytes<'a>(&'a self, held: &mut Option<Taken<'a>>, n: usize) -> bool {
        match held {
            Some(held) => held.more(n),
            None => {
                *held = self.bytes.take(n);
                held.is_some()
            }
        }
    }
}

/// Requests in flight per endpoint, the bytes they hold, and how long reading and handling one
/// may take. Slow or heavy requests to one endpoint never take another's share. Cloned per
/// request (one reference count).
#[derive(Clone)]
pub struct RequestLimit(Arc<LimitState>);

/// What a [`RequestLimit`] holds.
struct LimitState {
    /// The endpoints with a share of their own (a few: looked up in order).
    shares: Vec<(String, Share)>,
    other: Share,
    timeout: Duration,
    body_timeout: Duration,
    max_body: usize,
    /// Counts refused requests by path (the webhook port).
    metrics: Option<Arc<Metrics>>,
}

impl RequestLimit {
    /// Paths without a share of their own get `other`; each request is answered within
    /// `timeout` once its body (at most `max_body` bytes) is read; refusals counted in
    /// `metrics` if given.
    pub fn new(
        other: Budget,
        timeout: Duration,
        max_body: usize,
        metrics: Option<Arc<Metrics>>,
    ) -> Self {
        Self(Arc::new(LimitState {
            shares: Vec::new(),
            other: Share::new(other, None),
            timeout,
            body_timeout: timeout,
            max_body,
            metrics,
        }))
    }

    /// `path` gets a share of its own (the limit is built anew, every count free: called as it
    /// is set up, before it serves).
    pub fn endpoint(self, path: &str, budget: Budget) -> Self {
        self.endpoint_taking(path, budget, None)
    }

    /// [`RequestLimit::endpoint`], with bodies of up to `max_body` bytes (none: the limit's).
    pub fn endpoint_taking(self, path: &str, budget: Budget, max_body: Option<usize>) -> Self {
        let old = &self.0;
        let mut shares: Vec<(String, Share)> = old
            .shares
            .iter()
            .map(|(p, s)| (p.clone(), Share::new(s.budget, s.max_body)))
            .collect();
        shares.push((path.to_owned(), Share::new(budget, max_body)));
        Self(Arc::new(LimitState {
            shares,
            other: Share::new(old.other.budget, None),
            timeout: old.timeout,
            body_timeout: old.body_timeout,
            max_body: old.max_body,
            metrics: old.metrics.clone(),
        }))
    }
}

impl LimitState {
    /// The share of `path`, the path it is kept under (`other` for the rest), and its place.
    fn share(&self, path: &str) -> (&str, &Share, Option<usize>) {
        self.shares
            .iter()
            .position(|(p, _)| p == path)
            .map_or(("other", &self.other, None), |i| {
                (&self.shares[i].0, &self.shares[i].1, Some(i))
            })
    }

    fn refused(&self, path: &str, result: AdmissionResult) {
        if let Some(m) = &self.metrics {
            m.refused(path, result);
        }
    }
}

/// Counts the JSON values in `body` (each scalar, array and object, and each key), without
/// decoding it: what
/// decoding it may build is bounded by this count. Text that is not JSON counts what it looks
/// like; a parser rejects it later.
pub fn json_values(body: &[u8]) -> usize {
    let (mut values, mut in_scalar, mut i) = (0usize, false, 0usize);
    while let Some(&b) = body.get(i) {
        i += 1;
        match b {
            b'"' => {
                values += 1;
                in_scalar = false;
                // Most of a review's bytes are inside strings: jump to the closing quote (past
                // escaped characters) with memchr rather than byte by byte.
                loop {
                    match memchr::memchr2(b'"', b'\\', &body[i.min(body.len())..]) {
                        Some(at) if body.get(i + at) == Some(&b'\\') => i += at + 2,
                        Some(at) => {
                            i += at + 1;
                            break;
                        }
                        None => return values,
                    }
                }
            }
            b'{' | b'[' => {
                in_scalar = false;
                values += 1;
            }
            b'}' | b']' | b',' | b':' | b' ' | b'\n' | b'\r' | b'\t' => in_scalar = false,
            _ => {
                if !in_scalar {
                    values += 1;
                    in_scalar = true;
                }
            }
        }
    }
    values
}

/// As [`json_values`], but the value of a key in `pruned` (written without escapes) counts as
/// one, its contents skipped: what a decoder that skips those keys wherever they are may build
/// (it skips at least these: a key spelt with escapes is counted in full here).
pub fn json_values_pruned(body: &[u8], pruned: &[&str]) -> usize {
    if pruned.is_empty() {
        return json_values(body);
    }
    let (mut values, mut from) = (0usize, 0usize);
    let mut i = 0usize;
    while let Some(&b) = body.get(i) {
        if b != b'"' {
            i += 1;
            continue;
        }
        let start = i + 1;
        let Some(end) = string_end(body, start) else {
            break;
        };
        i = end;
        let key = &body[start..end - 1];
        if !pruned.iter().any(|p| p.as_bytes() == key) {
            continue;
        }
        let mut at = end;
        while matches!(body.get(at), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            at += 1;
        }
        if body.get(at) != Some(&b':') {
            continue;
        }
        // The key and what precedes it as usual; its value as one; on after it.
        values += json_values(&body[from..end]) + 1;
        i = skip_value(body, at + 1);
        from = i;
    }
    values + json_values(body.get(from..).unwrap_or_default())
}

/// Where the string whose contents begin at `start` ends (past its closing quote), if it does.
fn string_end(body: &[u8], mut start: usize) -> Option<usize> {
    loop {
        let at = memchr::memchr2(b'"', b'\\', body.get(start..)?)?;
        if body[start + at] == b'\\' {
            start += at + 2;
        } else {
            return Some(start + at + 1);
        }
    }
}

/// Where the JSON value starting at or after `i` (past whitespace) ends: a string, an object or
/// array with all it holds, or a scalar. The end of `body` if it does not.
fn skip_value(body: &[u8], mut i: usize) -> usize {
    while matches!(body.get(i), Some(b' ' | b'\n' | b'\r' | b'\t')) {
        i += 1;
    }
    let mut depth = 0usize;
    while let Some(&b) = body.get(i) {
        match b {
            b'"' => match string_end(body, i + 1) {
                Some(end) => i = end,
                None => return body.len(),
            },
            b'{' | b'[' => {
                depth += 1;
                i += 1;
            }
            b'}' | b']' if depth > 0 => {
                depth -= 1;
                i += 1;
            }
            // The end of the value's container, or the next value of it (a scalar ends there).
            b'}' | b']' => return i,
            b',' if depth == 0 => return i,
            _ => i += 1,
        }
        if depth == 0 && (b == b'"' || b == b'}' || b == b']') {
            return i;
        }
    }
    i
}

/// How long a request's handler may take: `limit`, or less when its URL asks for less. The API
/// server calls a webhook with `?timeout=Ns` (its `timeoutSeconds`) and gives up after it: an
/// answer later than that is counted as timed out, not as answered.
fn timeout_asked(uri: &axum::http::Uri, limit: Duration) -> Duration {
    uri.query()
        .and_then(|query| query.split('&').find_map(|kv| kv.strip_prefix("timeout=")))
        .and_then(|value| value.strip_suffix('s'))
        .and_then(|seconds| seconds.parse::<u64>().ok())
        .filter(|seconds| *seconds > 0)
        .map_or(limit, |seconds| limit.min(Duration::from_secs(seconds)))
}

/// Middleware: [`RequestLimit::run`] around the rest of the app (the request's body handed on
/// whole, a [`TooComplex`] mark in its extensions).
pub async fn limit_requests(
    State(limit): State<RequestLimit>,
    request: Request,
    next: Next,
) -> Response {
    limit
        .run(request, |request, too_complex| {
            let mut request = request.map(Body::from);
            if let Some(t) = too_complex {
                request.extensions_mut().insert(t);
            }
            next.run(request)
        })
        .await
}

impl RequestLimit {
    /// Reads the body first (within the timeout, at most the body limit, its bytes taken from
    /// the endpoint's share as they arrive), then takes the bytes its decoding may build and one
    /// of the endpoint's slots; without them it is answered 503 with a JSON message at once
    /// (never queued), so slow or heavy uploads to one endpoint never shed another's requests.
    /// Then `handler` answers, given the body whole and, for a body whose decoding could never
    /// fit its share, a [`TooComplex`]; taking longer than the timeout, it is answered 503.
    pub async fn run<F, Fut>(&self, request: Request, handler: F) -> Response
    where
        F: FnOnce(axum::http::Request<Bytes>, Option<TooComplex>) -> Fut,
        Fut: Future<Output = Response>,
    {
        self.run_in(request, false, handler).await
    }

    /// [`RequestLimit::run`] within the other paths' share, whatever the request's path (an
    /// answer that is no endpoint's: a method it does not take, say).
    pub async fn run_as_other<F, Fut>(&self, request: Request, handler: F) -> Response
    where
        F: FnOnce(axum::http::Request<Bytes>, Option<TooComplex>) -> Fut,
        Fut: Future<Output = Response>,
    {
        self.run_in(request, true, handler).await
    }

    async fn run_in<F, Fut>(&self, request: Request, as_other: bool, handler: F) -> Response
    where
        F: FnOnce(axum::http::Request<Bytes>, Option<TooComplex>) -> Fut,
        Fut: Future<Output = Response>,
    {
        let limit = &*self.0;
        // Refusals are counted under the share's own path (no copy of the request's is kept).
        let (path, share, share_at) = if as_other {
            ("other", &limit.other, None)
        } else {
            limit.share(request.uri().path())
        };
        let max_body = share.max_body.unwrap_or(limit.max_body);
        let (parts, body) = request.into_parts();
        // Most bodies arrive as one chunk: kept as it came, copied only when a second one
        // follows, into room for the length its head gives.
        let expected = http_body::Body::size_hint(&body).exact();
        let mut bytes = Chunks::expecting(expected.and_then(|n| usize::try_from(n).ok()), max_body);
        let mut chunks = body.into_data_stream();
        let mut held: Option<Taken<'_>> = None;
        let read = tokio::time::timeout(limit.body_timeout, async {
            while let Some(chunk) = chunks.next().await {
                let Ok(chunk) = chunk else {
                    return Err((
                        StatusCode::BAD_REQUEST,
                        "the request body could not be read".to_owned(),
                    ));
                };
                if bytes.len() + chunk.len() > max_body {
                    return Err((
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("the request body is larger than {max_body} bytes"),
                    ));
                }
                // Charged for what it is copied out of too, given back once that is freed.
                let copied = bytes.copied_with(chunk.len());
                if !share.bytes(&mut held, bytes.cost_of(chunk.len()) + copied) {
                    return Err((
                        StatusCode::SERVICE_UNAVAILABLE,
                        "too many bytes in flight; retry".to_owned(),
                    ));
                }
                bytes.push(chunk);
                if let Some(held) = held.as_mut() {
                    held.give_back(copied);
                }
            }
            Ok(())
        })
        .await;
        let refusal = match read {
            Ok(Ok(())) => None,
            Ok(Err(refusal)) => Some(refusal),
            Err(_) => Some((
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive in time".to_owned(),
            )),
        };
        if let Some((status, message)) = refusal {
            // What the body held is freed as its charge is given back.
            drop(bytes);
            drop(held);
            let result = if status == StatusCode::SERVICE_UNAVAILABLE {
                AdmissionResult::Overloaded
            } else {
                AdmissionResult::BadRequest
            };
            limit.refused(path, result);
            // What is still coming is read and dropped, so the client gets the answer.
            discard_body(chunks, max_body, DISCARD_WITHIN).await;
            return error_response(status, &message);
        }
        // What the body holds (its buffer's room, at most twice its bytes), as charged.
        let body_held = bytes.held();
        let bytes = bytes.into_bytes();
        // What decoding may build is bounded by one value per byte: when that bound is small
        // beside what the share has free, it is taken as it is, without counting the values.
        let bound = bytes.len().saturating_mul(VALUE_COST);
        let quick = bound.saturating_add(body_held) <= share.budget.bytes
            && share.bytes.available() >= bound.saturating_mul(QUICK_SLACK);
        let (values, decoded) = if quick {
            (bytes.len(), bound)
        } else {
            let values = json_values_pruned(&bytes, share.budget.pruned);
            (values, values.saturating_mul(VALUE_COST))
        };
        let beyond = bytes.len().saturating_mul(share.budget.held_per_byte);
        let cost = decoded.saturating_add(beyond);
        let mut too_complex = None;
        if cost.saturating_add(body_held) > share.budget.bytes {
            too_complex = Some(TooComplex { values });
        } else if cost > 0 && !share.bytes(&mut held, cost) {
            limit.refused(path, AdmissionResult::Overloaded);
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many bytes in flight; retry",
            );
        }
        let Some(_slot) = share.slots.take(1) else {
            limit.refused(path, AdmissionResult::Overloaded);
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many requests in flight; retry",
            );
        };
        let timeout = timeout_asked(&parts.uri, limit.timeout);
        let request = axum::http::Request::from_parts(parts, bytes);
        let answered = tokio::time::timeout(timeout, handler(request, too_complex)).await;
        let response = match answered {
            Ok(response) => response,
            Err(_) => {
                limit.refused(path, AdmissionResult::TimedOut);
                error_response(StatusCode::SERVICE_UNAVAILABLE, "request timed out")
            }
        };
        // The answer keeps as many of the bytes the request held as it has, until it is sent.
        let size = http_body::Body::size_hint(response.body());
        let len = usize::try_from(size.upper().unwrap_or(size.lower())).unwrap_or(usize::MAX);
        let kept = held.as_mut().map_or(0, |held| held.hand_over(len));
        drop(held);
        if kept == 0 {
            return response;
        }
        let hold = AnswerHold {
            limit: self.0.clone(),
            share: share_at,
            n: kept,
        };
        response.map(|inner| {
            Body::new(Held {
                inner,
                rest: Bytes::new(),
                _hold: hold,
            })
        })
    }

    /// Answers `response` to `request` without reading it as a request: what is still coming
    /// of its body is read and dropped first ([`discard_body`]), so the client gets the answer
    /// (a refusal decided from the request's head alone).
    pub async fn refuse(&self, request: Request, response: Response) -> Response {
        let chunks = request.into_body().into_data_stream();
        discard_body(chunks, self.0.max_body, DISCARD_WITHIN).await;
        response
    }
}

/// How long a refused request's body is read and dropped at most: a client still sending
/// after that gets its answer on a connection that is then closed.
const DISCARD_WITHIN: Duration = Duration::from_secs(1);

/// A body whose bound on decoding ([`VALUE_COST`] per byte) leaves at least this many times
/// that bound free in its share takes the bound without counting its JSON values.
const QUICK_SLACK: usize = 4;

/// A body's chunks as they arrived: the first kept as it came, the others copied into one buffer
/// as they come (not kept as they came: each is a slice of the connection's read buffer, which
/// it would hold whole). The buffer grows by doubling, up to the length the body's head gives
/// (its `content-length`, where it ends exactly) or the largest body taken: it holds at most
/// about twice what has arrived, whatever length the head claims. What it holds is what the
/// share is charged ([`Chunks::cost_of`]), before it is allocated; as it grows, what it is
/// copied out of (the first chunk, or its old room) is charged too until it is freed
/// ([`Chunks::copied_with`]).
#[derive(Default)]
struct Chunks {
    /// The body's length, as its head gives it (`content-length`), if within the largest taken.
    expected: Option<usize>,
    /// The largest body taken.
    max_body: usize,
    /// The bytes so far.
    len: usize,
    first: Option<Bytes>,
    joined: Vec<u8>,
    /// The bytes the share was charged for so far.
    charged: usize,
}

impl Chunks {
    /// Chunks of a body of `expected` bytes, if known (ignored over `max_body`: such a body is
    /// refused once its bytes pass it).
    fn expecting(expected: Option<usize>, max_body: usize) -> Self {
        Self {
            expected: expected.filter(|n| *n <= max_body),
            max_body,
            ..Self::default()
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    /// The bytes held, as charged.
    fn held(&self) -> usize {
        self.charged
    }

    /// The bytes held once `incoming` more are taken: the first chunk as it came; then the
    /// buffer's room (twice what it had, within the length the head gives or the largest body).
    fn held_with(&self, incoming: usize) -> usize {
        let len = self.len + incoming;
        if self.first.is_none() && self.joined.capacity() == 0 {
            return len;
        }
        let room = self.joined.capacity();
        if len <= room {
            return room;
        }
        let most = self.expected.unwrap_or(self.max_body).max(len);
        len.max(room.saturating_mul(2)).min(most)
    }

    /// What the share is to be charged before a chunk of `incoming` bytes is taken.
    fn cost_of(&self, incoming: usize) -> usize {
        self.held_with(incoming).saturating_sub(self.charged)
    }

    /// The bytes taking `incoming` more copies out of and then frees (the first chunk, or the
    /// buffer's old room as it grows): held beside the new room for a moment.
    fn copied_with(&self, incoming: usize) -> usize {
        match &self.first {
            Some(first) => first.len(),
            None if self.held_with(incoming) > self.joined.capacity() => self.joined.capacity(),
            None => 0,
        }
    }

    /// Takes `chunk` (the share charged for it: [`Chunks::cost_of`]).
    fn push(&mut self, chunk: Bytes) {
        let held = self.held_with(chunk.len());
        self.charged = self.charged.max(held);
        self.len += chunk.len();
        if self.first.is_none() && self.joined.capacity() == 0 {
            self.first = Some(chunk);
            return;
        }
        if held > self.joined.capacity() {
            self.joined.reserve_exact(held - self.joined.len());
        }
        if let Some(first) = self.first.take() {
            self.joined.extend_from_slice(&first);
        }
        self.joined.extend_from_slice(&chunk);
    }

    fn into_bytes(self) -> Bytes {
        match self.first {
            Some(first) => first,
            None => self.joined.into(),
        }
    }
}

/// Reads the rest of a refused request's body and drops it, chunk by chunk (at most `max`
/// bytes, within `within`), so that a client still sending gets the answer and an HTTP/1
/// connection stays usable: a connection closed with unread data is reset, and the answer can
/// be lost with it (as nginx discards the body of a request it answers early).
async fn discard_body(mut chunks: axum::body::BodyDataStream, max: usize, within: Duration) {
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

/// Marks the requests of a connection whose client presented a certificate verified against
/// `--client-ca` (HTTPS connections only; other connections' requests carry no mark, so they
/// pay for no extension).
#[derive(Clone, Copy, Debug)]
pub struct VerifiedClient;

/// When a connection last read or wrote a byte, since when it has waited for a request's
/// headers, and whether its next answer closes it.
#[derive(Clone)]
struct Activity(Arc<ActivityState>);

struct ActivityState {
    base: Instant,
    /// When a byte last moved, in µs since `base`.
    last_micros: AtomicU64,
    /// Since when (µs since `base`) the connection has waited for a request's headers, or
    /// [`HANDLING`], [`NO_HEADER_DEADLINE`] or [`AWAITING`].
    waiting_micros: AtomicU64,
    /// An HTTP/1 connection past its maximum age between two requests: its next answer says
    /// `connection: close` and ends it.
    closing: AtomicBool,
    /// The connection speaks HTTP/2 (chosen in the TLS handshake, or its preface read).
    http2: AtomicBool,
    /// The HTTP/2 answers handed to the connection and not yet sent whole ([`Unsent`]): each
    /// one's number and when a piece of it was last taken to be sent (or it was handed over),
    /// in µs since `base`. Control frames (a ping's answer) and other answers are no progress.
    unsent: std::sync::Mutex<Vec<(u64, u64)>>,
    /// The number of the last answer counted in `unsent`.
    answers: AtomicU64,
    /// Since when (µs since `base`, plus one; zero: not) a write to the socket has waited, no
    /// byte of it taken.
    blocked_micros: AtomicU64,
    /// Wakes the bound timer as a write starts to wait (rare: the socket's buffer full), and
    /// as a large answer is handed over.
    blocked: tokio::sync::Notify,
    /// When (µs since `base`; zero: none) the large HTTP/1 answer being handed over is due
    /// whole ([`Limits::min_send_rate`]).
    answer_due_micros: AtomicU64,
}

/// A request is being handled: no headers are due.
const HANDLING: u64 = u64::MAX;
/// An HTTP/2 connection: its requests' headers have no deadline of their own (its streams and
/// idle bound hold it).
const NO_HEADER_DEADLINE: u64 = u64::MAX - 1;
/// A connection waiting for a request, no byte of it read yet (set up, or an HTTP/1 one kept
/// alive after an answer): the idle bound holds it, and the request's header deadline starts
/// with its first byte. So the server never closes a connection its client holds as idle as a
/// header deadline runs out, while the client may be sending a request on it, which the client
/// could not tell from a connection closed after reading it. The API server does not retry a
/// webhook call that failed so, and holds fresh connections unused: its HTTP/1 client dials one
/// for a call that another connection then serves, and keeps it for the next call.
const AWAITING: u64 = u64::MAX - 2;

impl Activity {
    /// A connection starting now, awaiting its first request.
    fn new() -> Self {
        Self(Arc::new(ActivityState {
            base: Instant::now(),
            last_micros: AtomicU64::new(0),
            waiting_micros: AtomicU64::new(AWAITING),
            closing: AtomicBool::new(false),
            http2: AtomicBool::new(false),
            unsent: std::sync::Mutex::new(Vec::new()),
            answers: AtomicU64::new(0),
            blocked_micros: AtomicU64::new(0),
            blocked: tokio::sync::Notify::new(),
            answer_due_micros: AtomicU64::new(0),
        }))
    }

    /// µs since the connection started (kept under the sentinels [`HANDLING`],
    /// [`NO_HEADER_DEADLINE`] and [`AWAITING`], which it could reach only after half a
    /// million years).
    fn now_micros(&self) -> u64 {
        u64::try_from(self.0.base.elapsed().as_micros()).unwrap_or(AWAITING - 1)
    }

    /// When a byte last moved (the connection's start if none has).
    fn last(&self) -> Instant {
        self.0.base + Duration::from_micros(self.0.last_micros.load(Ordering::Relaxed))
    }

    fn touch(&self) {
        self.0
            .last_micros
            .store(self.now_micros(), Ordering::Relaxed);
    }

    /// A write to the socket waits, no byte of it taken: from now on (if not already) held to
    /// [`Limits::send_timeout`].
    fn write_waits(&self) {
        if self.0.blocked_micros.load(Ordering::Relaxed) == 0 {
            self.0
                .blocked_micros
                .store(self.now_micros() + 1, Ordering::Relaxed);
            self.0.blocked.notify_one();
        }
    }

    /// Bytes were written: activity, and no write waits.
    fn bytes_written(&self) {
        self.touch();
        if self.0.blocked_micros.load(Ordering::Relaxed) != 0 {
            self.0.blocked_micros.store(0, Ordering::Relaxed);
        }
    }

    /// An HTTP/2 answer is handed to the connection: unsent until [`Activity::answer_sent`]
    /// with the number returned, its sending held to [`Limits::send_timeout`] from now.
    fn answer_unsent(&self) -> u64 {
        let answer = self.0.answers.fetch_add(1, Ordering::Relaxed) + 1;
        let now = self.now_micros();
        crate::sync::lock(&self.0.unsent).push((answer, now));
        answer
    }

    /// A piece of `answer` was taken to be sent (a connection takes one only with room in its
    /// client's window for it).
    fn answer_progressed(&self, answer: u64) {
        let now = self.now_micros();
        if let Some(entry) = crate::sync::lock(&self.0.unsent)
            .iter_mut()
            .find(|(n, _)| *n == answer)
        {
            entry.1 = now;
        }
    }

    /// `answer` was sent whole, or dropped.
    fn answer_sent(&self, answer: u64) {
        let mut unsent = crate::sync::lock(&self.0.unsent);
        if let Some(at) = unsent.iter().position(|(n, _)| *n == answer) {
            unsent.swap_remove(at);
        }
    }

    /// A large HTTP/1 answer of `len` bytes is handed over: due whole within `send_timeout` plus
    /// `len` at `min_send_rate` from now (none at a rate of zero).
    fn answer_due(&self, len: u64, (send_timeout, min_send_rate): (Duration, u64)) {
        if min_send_rate == 0 {
            return;
        }
        let micros = u64::try_from(send_timeout.as_micros()).unwrap_or(u64::MAX);
        let at_rate = len.saturating_mul(1_000_000) / min_send_rate;
        let due = self
            .now_micros()
            .saturating_add(micros)
            .saturating_add(at_rate)
            .max(1);
        self.0.answer_due_micros.store(due, Ordering::Relaxed);
        self.0.blocked.notify_one();
    }

    /// The large HTTP/1 answer was handed over whole, or dropped.
    fn answer_handed_over(&self) {
        self.0.answer_due_micros.store(0, Ordering::Relaxed);
    }

    /// When the answer longest without progress last made some, if any is unsent.
    fn stalest_answer(&self) -> Option<u64> {
        crate::sync::lock(&self.0.unsent)
            .iter()
            .map(|(_, at)| *at)
            .min()
    }

    /// Resolves once no byte has moved for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = Duration::from_micros(self.0.last_micros.load(Ordering::Relaxed));
            let quiet = self.0.base.elapsed().saturating_sub(last);
            if quiet >= idle {
                return;
            }
            tokio::time::sleep(idle - quiet).await;
        }
    }

    /// The connection awaits a request (it is set up, or an HTTP/1 request was answered and it
    /// is kept alive): no headers due until the request's first byte ([`Activity::bytes_read`]).
    fn awaits_request(&self) {
        self.0.waiting_micros.store(AWAITING, Ordering::Relaxed);
    }

    /// Bytes were read: activity, and on a connection awaiting a request that request's header
    /// deadline starts.
    fn bytes_read(&self) {
        self.touch();
        self.request_bytes_read();
    }

    /// Bytes of a request were read (from the socket, or decrypted): on a connection awaiting a
    /// request, that request's header deadline starts. A request's bytes that arrived with the
    /// TLS handshake's last flight were read from the socket before the connection awaited one:
    /// they start it as they are decrypted and read.
    fn request_bytes_read(&self) {
        if self.0.waiting_micros.load(Ordering::Relaxed) == AWAITING {
            let _ = self.0.waiting_micros.compare_exchange(
                AWAITING,
                self.now_micros(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// An HTTP/1 connection with no request in flight (set up, or kept alive after an
    /// answer).
    fn between_requests(&self) -> bool {
        !matches!(
            self.0.waiting_micros.load(Ordering::Relaxed),
            HANDLING | NO_HEADER_DEADLINE
        )
    }

    /// The connection speaks HTTP/2: told GOAWAY, not closed, when it is to end. Called only
    /// before the connection is served or from within its own IO (the preface's tap), so that
    /// `run_http` may read it after polling the connection, with no waker.
    fn speaks_http2(&self) {
        self.0.http2.store(true, Ordering::Relaxed);
    }

    /// Whether the connection speaks HTTP/2 ([`Activity::speaks_http2`]).
    fn serves_http2(&self) -> bool {
        self.0.http2.load(Ordering::Relaxed)
    }

    /// Its next answer says `connection: close` (and hyper then ends the connection); its
    /// maximum age counts one idle bound later.
    fn close_with_next_answer(&self) {
        self.0.closing.store(true, Ordering::Relaxed);
    }

    /// Whether its next answer closes it ([`Activity::close_with_next_answer`]).
    fn closes_with_next_answer(&self) -> bool {
        self.0.closing.load(Ordering::Relaxed)
    }

    /// A request's headers arrived: it is handled, and no headers are due until it is
    /// answered (HTTP/1); an HTTP/2 request's connection has no header deadline from then on.
    fn headers_arrived(&self, version: axum::http::Version) {
        let state = if version == axum::http::Version::HTTP_2 {
            NO_HEADER_DEADLINE
        } else {
            HANDLING
        };
        self.0.waiting_micros.store(state, Ordering::Relaxed);
    }

    /// Resolves, with its reason, once the connection is past one of its bounds: no byte
    /// moved for `limits.idle_timeout`, a request's headers waited for `limits.header_timeout`
    /// (never while a request is handled, nor on a connection awaiting a request before its
    /// first byte, nor after an HTTP/2 request), or `limits.max_age` reached (one idle bound
    /// later when the connection closes with its next answer already). One timer per connection, reset
    /// only when it fires (hyper's own header deadline arms and drops a timer for every
    /// request).
    async fn past_bound(&self, limits: &Limits) -> Bound {
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        loop {
            let last = self.0.last_micros.load(Ordering::Relaxed);
            let mut due = (
                Bound::Idle,
                last.saturating_add(micros(limits.idle_timeout)),
            );
            if let since @ 0..AWAITING = self.0.waiting_micros.load(Ordering::Relaxed) {
                let late = since.saturating_add(micros(limits.header_timeout));
                if late < due.1 {
                    due = (Bound::HeadersLate, late);
                }
            }
            // Closing with its next answer already, it is waited for one idle bound more: an
            // answer its client reads slowly but steadily would otherwise keep it for good.
            let mut old = micros(limits.max_age);
            if self.closes_with_next_answer() {
                old = old.saturating_add(micros(limits.idle_timeout));
            }
            if old < due.1 {
                due = (Bound::MaxAge, old);
            }
            let send = micros(limits.send_timeout);
            if let since @ 1.. = self.0.blocked_micros.load(Ordering::Relaxed) {
                let stalled = (since - 1).saturating_add(send);
                if stalled < due.1 {
                    due = (Bound::Stalled, stalled);
                }
            }
            if let Some(stalest) = self.stalest_answer() {
                let stalled = stalest.saturating_add(send);
                if stalled < due.1 {
                    due = (Bound::Stalled, stalled);
                }
            }
            if let late @ 1.. = self.0.answer_due_micros.load(Ordering::Relaxed)
                && late < due.1
            {
                due = (Bound::ReadTooSlowly, late);
            }
            let now = self.now_micros();
            if now >= due.1 {
                return due.0;
            }
            // An HTTP/2 connection is looked at again within the send timeout: an answer that
            // became unsent since is not held to the idle bound (nothing wakes this timer when
            // one does, so that no answer pays for it). A write that starts to wait wakes it.
            let wake = if self.serves_http2() {
                due.1.min(now.saturating_add(send))
            } else {
                due.1
            };
            tokio::select! {
                () = tokio::time::sleep(Duration::from_micros(wake - now)) => {}
                () = self.0.blocked.notified() => {}
            }
        }
    }
}

/// Why a connection is closed by its bounds ([`Activity::past_bound`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bound {
    /// No byte moved for the idle timeout.
    Idle,
    /// A request's headers did not arrive in time.
    HeadersLate,
    /// At its maximum age.
    MaxAge,
    /// The socket took no byte of what it had to send, or an HTTP/2 answer not sent whole had
    /// none of its pieces taken, for the send timeout.
    Stalled,
    /// A large HTTP/1 answer was not handed over whole by its due time
    /// ([`Limits::min_send_rate`]).
    ReadTooSlowly,
}

/// The app of one connection: each request marks the connection's header deadline as met when
/// it arrives, and the connection as kept alive once it is answered (or, past its maximum age,
/// closed by that answer).
#[derive(Clone)]
struct Marked<S> {
    inner: S,
    activity: Activity,
    /// [`Limits::send_timeout`] and [`Limits::min_send_rate`]: when a large answer is due.
    send: (Duration, u64),
}

impl<S, B> tower_service::Service<axum::http::Request<B>> for Marked<S>
where
    S: tower_service::Service<axum::http::Request<B>, Response = Response>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Answering<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: axum::http::Request<B>) -> Self::Future {
        let version = request.version();
        self.activity.headers_arrived(version);
        let http2 = version == axum::http::Version::HTTP_2;
        Answering {
            answer: self.inner.call(request),
            activity: (!http2).then(|| self.activity.clone()),
            unsent: http2.then(|| self.activity.clone()),
            send: self.send,
        }
    }
}

pin_project_lite::pin_project! {
    /// A request's answer: once it is ready, its HTTP/1 connection is kept alive for the next
    /// request, or, past its maximum age, the answer says `connection: close` (hyper then ends
    /// the connection once it is written: the client knows its next request needs another).
    struct Answering<F> {
        #[pin]
        answer: F,
        activity: Option<Activity>,
        // An HTTP/2 request's connection: its answer is counted unsent until sent whole.
        unsent: Option<Activity>,
        send: (Duration, u64),
    }
}

impl<F, E> std::future::Future for Answering<F>
where
    F: std::future::Future<Output = Result<Response, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let mut polled = this.answer.poll(cx);
        if let Poll::Ready(Ok(response)) = &mut polled
            && let Some(activity) = this.unsent.take()
        {
            let answer = activity.answer_unsent();
            let body = std::mem::take(response.body_mut());
            *response.body_mut() = Body::new(Unsent {
                inner: body,
                activity,
                answer: Some(answer),
            });
        }
        if polled.is_ready()
            && let Some(activity) = this.activity.take()
        {
            // Larger than one piece (never a review's): due whole by a deadline.
            if let Poll::Ready(Ok(response)) = &mut polled
                && let len = http_body::Body::size_hint(response.body()).lower()
                && len > ANSWER_PIECE as u64
            {
                activity.answer_due(len, *this.send);
                let body = std::mem::take(response.body_mut());
                *response.body_mut() = Body::new(Unsent {
                    inner: body,
                    activity: activity.clone(),
                    answer: None,
                });
            }
            activity.awaits_request();
            if activity.closes_with_next_answer()
                && let Poll::Ready(Ok(response)) = &mut polled
            {
                response.headers_mut().insert(
                    axum::http::header::CONNECTION,
                    axum::http::HeaderValue::from_static("close"),
                );
            }
        }
        polled
    }
}

/// An answer's body its connection keeps track of until it drops it: an HTTP/2 answer counted
/// unsent until sent whole, or its stream or connection gone ([`Limits::send_timeout`]); a
/// large HTTP/1 answer due whole until handed over whole, or its connection gone
/// ([`Limits::min_send_rate`]).
struct Unsent {
    inner: Body,
    activity: Activity,
    /// An HTTP/2 answer's number on the connection; `None`: a large HTTP/1 answer.
    answer: Option<u64>,
}

impl Drop for Unsent {
    fn drop(&mut self) {
        match self.answer {
            Some(answer) => self.activity.answer_sent(answer),
            None => self.activity.answer_handed_over(),
        }
    }
}

impl http_body::Body for Unsent {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let (Poll::Ready(Some(Ok(_))), Some(answer)) = (&polled, self.answer) {
            self.activity.answer_progressed(answer);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// An IO that tells its [`Tap`] of the bytes moving through it.
struct Tapped<IO, T> {
    inner: IO,
    tap: T,
    /// What is sent in place of a write its tap [`Tap::answer_instead`] of, and how much of it
    /// has been: sent before any later write, flush or shutdown.
    instead: Option<(Vec<u8>, usize)>,
}

/// What a [`Tapped`] IO is told of the bytes moving through it.
trait Tap {
    /// `new` bytes were read (none: the read was pending, or at its end).
    fn read(&mut self, new: &[u8]);
    /// `n` bytes were written.
    fn wrote(&self, n: usize);
    /// A write waits: no byte of it could be taken.
    fn write_waits(&self) {}
    /// The bytes to send in place of `written` (one write), if any.
    fn answer_instead(&self, _written: &[u8]) -> Option<Vec<u8>> {
        None
    }
}

/// The socket's own tap: a byte read or written is the connection's activity.
impl Tap for Activity {
    fn read(&mut self, new: &[u8]) {
        if !new.is_empty() {
            self.bytes_read();
        }
    }

    fn wrote(&self, n: usize) {
        if n > 0 {
            self.bytes_written();
        }
    }

    fn write_waits(&self) {
        Activity::write_waits(self);
    }
}

/// The HTTP/2 client preface (RFC 9113, section 3.4).
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The bytes hyper reads (decrypted): a request's first one starts its header deadline; and a
/// connection's first bytes checked for the HTTP/2 preface, where the TLS handshake chose no
/// protocol: a client speaking HTTP/2 from the start is then told GOAWAY as one that chose it.
struct Preface {
    activity: Activity,
    /// How many of the preface's bytes have been read; `None` once the protocol is told apart
    /// (or needs no telling).
    matched: Option<usize>,
}

impl Tap for Preface {
    fn read(&mut self, new: &[u8]) {
        if !new.is_empty() {
            self.activity.request_bytes_read();
        }
        let Some(matched) = self.matched else { return };
        let want = &HTTP2_PREFACE[matched..];
        let n = new.len().min(want.len());
        self.matched = if new[..n] != want[..n] {
            None
        } else if n == want.len() {
            self.activity.speaks_http2();
            None
        } else {
            Some(matched + n)
        };
    }

    fn wrote(&self, _: usize) {}

    fn answer_instead(&self, written: &[u8]) -> Option<Vec<u8>> {
        with_json_message(written)
    }
}

/// hyper's own answer to a request head it could not take (HTTP/1: 400 malformed, 414 URI too
/// long, 431 over [`HEADER_BYTES`]), written as a head alone with `content-length: 0` and
/// `connection: close`, given a JSON message as every other refusal has: the same head, a
/// `content-type` and the message. Any other write: `None` (every answer of this server's own
/// handlers carries a body).
fn with_json_message(written: &[u8]) -> Option<Vec<u8>> {
    use memchr::memmem::find;
    const LENGTH: &[u8] = b"\r\ncontent-length: 0\r\n";
    let status = written
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| written.strip_prefix(b"HTTP/1.0 "))?;
    let message = match status.get(..4)? {
        b"400 " => "the request's HTTP head is malformed".to_owned(),
        b"414 " => "the request's URI is too long".to_owned(),
        b"431 " => format!(
            "the request's HTTP head is over its bound ({} KiB)",
            HEADER_BYTES >> 10
        ),
        _ => return None,
    };
    // One whole head (its one blank line at the end), no body, the connection closing.
    let end = written.len().checked_sub(4)?;
    if &written[end..] != b"\r\n\r\n" || find(&written[..end], b"\r\n\r\n").is_some() {
        return None;
    }
    let at = find(written, LENGTH)?;
    find(written, b"\r\nconnection: close\r\n")?;
    let body = serde_json::to_vec(&json!({ "error": message })).ok()?;
    let mut answer = Vec::with_capacity(written.len() + body.len() + 48);
    answer.extend_from_slice(&written[..at]);
    answer.extend_from_slice(b"\r\ncontent-type: application/json\r\ncontent-length: ");
    answer.extend_from_slice(body.len().to_string().as_bytes());
    answer.extend_from_slice(&written[at + LENGTH.len() - 2..]);
    answer.extend_from_slice(&body);
    Some(answer)
}

impl<IO: AsyncWrite + Unpin, T> Tapped<IO, T> {
    /// Sends what replaced an earlier write, before anything else is.
    fn send_instead(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while let Some((bytes, sent)) = &mut self.instead {
            if *sent == bytes.len() {
                self.instead = None;
                break;
            }
            match Pin::new(&mut self.inner).poll_write(cx, &bytes[*sent..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => *sent += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncWrite + Unpin, T: Tap> Tapped<IO, T> {
    /// Takes `written` whole when the tap answers something else instead, which is sent from
    /// now on (what is not sent at once is sent first by whatever comes next).
    fn instead_of(
        &mut self,
        cx: &mut Context<'_>,
        written: &[u8],
    ) -> Option<Poll<std::io::Result<usize>>> {
        let instead = self.tap.answer_instead(written)?;
        self.instead = Some((instead, 0));
        Some(match self.send_instead(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(written.len())),
        })
    }
}

impl<IO, T: Tap> Tapped<IO, T> {
    /// Tells the tap of a write that moved bytes, or waits; returns it unchanged.
    fn wrote(&self, polled: Poll<std::io::Result<usize>>) -> Poll<std::io::Result<usize>> {
        match polled {
            Poll::Ready(Ok(n)) => self.tap.wrote(n),
            Poll::Pending => self.tap.write_waits(),
            Poll::Ready(Err(_)) => {}
        }
        polled
    }
}

impl<IO: AsyncRead + Unpin, T: Tap + Unpin> AsyncRead for Tapped<IO, T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        this.tap.read(&buf.filled()[before..]);
        polled
    }
}

impl<IO: AsyncWrite + Unpin, T: Tap + Unpin> AsyncWrite for Tapped<IO, T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.send_instead(cx))?;
        if let Some(taken) = this.instead_of(cx, buf) {
            return taken;
        }
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(polled)
    }

    // Vectored writes pass through, so that rustls writes the TLS records it has queued (a
    // handshake flight) in one system call rather than one call and one segment per record.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.send_instead(cx))?;
        // A head written alone is one slice (hyper queues a head and a body's pieces).
        if let Some((first, rest)) = bufs.split_first()
            && rest.iter().all(|b| b.is_empty())
            && let Some(taken) = this.instead_of(cx, first)
        {
            return taken;
        }
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.wrote(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        std::task::ready!(self.send_instead(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        std::task::ready!(self.send_instead(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The threads of a server of its own (`serve --admission-threads N`): N runtimes of one thread
/// each. The first one accepts, and hands each new connection to the thread serving the fewest
/// (connections are spread evenly, whichever thread the kernel wakes), which serves it to its
/// end. What runs on them is never held up by the process's main runtime (the controllers'
/// reconciles, the caches' relists); no connection moves between threads once served (with one
/// runtime of N threads, moving them cost a quarter more CPU per review, bench/NOTEBOOK.md); and a
/// thread the kernel preempts holds up only its own connections. Shut down in the background
/// when dropped (a runtime may not be dropped within async code, where `serve` holds them);
/// what they still run then (Events being published) is let go.
pub struct ServerThreads(Vec<tokio::runtime::Runtime>);

/// How many threads serve admission unless told otherwise (`serve --admission-threads`).
pub const ADMISSION_THREADS: u16 = 2;

/// The name of the admission threads (what `ps -L` and `/proc/PID/task/*/comm` show).
pub const ADMISSION_THREAD: &str = "pps-admission";

/// The EEVDF slice the admission threads ask for unless told otherwise
/// (`serve --admission-slice-micros`): the shortest Linux grants.
pub const ADMISSION_SLICE: Duration = Duration::from_micros(100);

impl ServerThreads {
    /// `threads` runtimes (at least one) of one thread each, named `name`, at the priority of
    /// the calling thread (new threads inherit it), each asking the kernel for `slice` (none:
    /// its default; see [`request_slice`]).
    pub fn new(name: &str, threads: usize, slice: Option<Duration>) -> std::io::Result<Self> {
        (0..threads.max(1))
            .map(|_| {
                let mut builder = tokio::runtime::Builder::new_multi_thread();
                builder.worker_threads(1).thread_name(name).enable_all();
                if let Some(slice) = slice {
                    builder.on_thread_start(move || {
                        if let Err(e) = request_slice(slice) {
                            static WARNED: std::sync::Once = std::sync::Once::new();
                            WARNED.call_once(|| {
                                tracing::warn!(error = %e, slice_micros = slice.as_micros(),
                                    "the admission threads keep the kernel's default slice");
                            });
                        }
                    });
                }
                builder.build()
            })
            .collect::<std::io::Result<_>>()
            .map(Self)
    }

    /// Runs `server` on `listener` (bound on the caller's runtime) from these threads, as
    /// [`serve`] does (one connection cap over them all). The task returned ends once the
    /// server has drained after its shutdown.
    pub fn serve(
        &self,
        listener: TcpListener,
        server: Server,
    ) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let first = self
            .0
            .first()
            .ok_or_else(|| std::io::Error::other("no server threads"))?;
        let listener = {
            let _entered = first.enter();
            TcpListener::from_std(listener.into_std()?)?
        };
        let threads = Spread(
            self.0
                .iter()
                .map(|runtime| (runtime.handle().clone(), Arc::default()))
                .collect(),
        );
        Ok(first.spawn(accept(listener, server, threads)))
    }
}

impl Drop for ServerThreads {
    fn drop(&mut self) {
        for runtime in self.0.drain(..) {
            runtime.shutdown_background();
        }
    }
}

/// Asks the kernel to run the calling thread in slices of `slice` (EEVDF's `sched_runtime` of
/// a normal thread, honoured from Linux 6.12, which clamps it to 0.1-100 ms; older kernels
/// ignore it). A thread with a shorter slice gets an earlier deadline when it wakes, so a
/// review arriving while another thread holds the core (the API server's, on a shared node)
/// preempts it sooner instead of waiting out that thread's slice (bench/NOTEBOOK.md, part 3).
/// The thread's policy, nice value and flags are kept; a thread not of the normal or batch
/// policy (set by an operator, `chrt`) is left as it is.
pub fn request_slice(slice: Duration) -> std::io::Result<()> {
    let mut attr = sched_getattr(0)?;
    if !matches!(
        attr.sched_policy as i32,
        libc::SCHED_OTHER | libc::SCHED_BATCH
    ) {
        return Ok(());
    }
    attr.sched_runtime = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
    // SAFETY: sched_setattr reads `size` bytes of a valid, initialised sched_attr; pid 0 is the
    // calling thread.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_sched_setattr,
            0,
            &attr as *const libc::sched_attr,
            0,
        )
    };
    syscall_result(rc)
}

/// A raw syscall's return as a result: 0 is success, anything else the thread's errno.
fn syscall_result(rc: libc::c_long) -> std::io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The scheduling attributes of the thread `tid` (0: the calling thread), as the kernel reports
/// them: policy, nice value, and from Linux 6.12 a normal thread's slice (`sched_runtime`).
pub fn sched_getattr(tid: libc::pid_t) -> std::io::Result<libc::sched_attr> {
    // SAFETY: sched_attr is plain integers, valid zeroed.
    let mut attr: libc::sched_attr = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::sched_attr>();
    attr.size = u32::try_from(size).map_err(std::io::Error::other)?;
    // SAFETY: sched_getattr writes at most `size` bytes into `attr`, which has them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            tid,
            &mut attr as *mut libc::sched_attr,
            size,
            0,
        )
    };
    syscall_result(rc).map(|()| attr)
}

/// How many steps of `nice` below the process's own priority its main runtime runs unless told
/// otherwise (`serve --background-nice`).
pub const BACKGROUND_NICE: u8 = 5;

/// The process's main runtime (the controllers, the caches' watches, leader election, the
/// probe server): threads named `pps-background`, each run `nice` steps below the priority of
/// the thread that builds it (Linux's nice, at most 19; 0: unchanged). Only the threads are
/// lowered, never that thread, so [`ServerThreads`] built from it later, within `block_on`,
/// keep the process's priority: when both want the CPU, a review waits less behind a relist
/// or a reconcile (nice 5 is about a third of the weight). A thread the kernel refuses to
/// lower (some sandboxes) keeps its priority, with a warning.
pub fn main_runtime(nice: u8) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all().thread_name("pps-background");
    if nice > 0 {
        let own = rustix::process::getpriority_process(Some(rustix::thread::gettid()))?;
        // Set as a value, not a step: a thread spawned by one already lowered starts lowered.
        let lowered = own.saturating_add(i32::from(nice)).min(19);
        builder.on_thread_start(move || {
            let tid = Some(rustix::thread::gettid());
            if let Err(e) = rustix::process::setpriority_process(tid, lowered) {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(error = %e, nice = lowered,
                        "the main runtime's threads keep the process's priority");
                });
            }
        });
    }
    builder.build()
}

/// The threads a server's connections are spread over, each with how many it serves now;
/// none: the accepting task's own runtime serves them.
struct Spread(Vec<(tokio::runtime::Handle, Arc<AtomicUsize>)>);

impl Spread {
    /// The thread serving the fewest connections (the first of those tied), and its count.
    fn least_loaded(&self) -> Option<&(tokio::runtime::Handle, Arc<AtomicUsize>)> {
        self.0
            .iter()
            .min_by_key(|(_, serving)| serving.load(Ordering::Relaxed))
    }
}

/// One connection counted on its thread until dropped.
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn new(serving: &Arc<AtomicUsize>) -> Self {
        serving.fetch_add(1, Ordering::Relaxed);
        Self(serving.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A server: the app it serves, over TLS when `tls` is given, within `limits`, until
/// `shutdown`; then it drains connections for at most `drain`.
pub struct Server {
    /// The TLS acceptor; none: plain HTTP.
    pub tls: Option<TlsAcceptor>,
    /// What it answers.
    pub app: Router,
    /// What a connection and a request may take.
    pub limits: Limits,
    /// Cancelled when readiness turns off, before `shutdown`: from then on each HTTP/1
    /// connection closes with its next answer (`connection: close`), and each HTTP/2 one
    /// (chosen in the TLS handshake, or its preface read) is told GOAWAY at once,
    /// its streams in flight answered, so that its client reconnects, through the Service, to a
    /// replica that stays, instead of keeping a connection this one closes at `shutdown`.
    pub draining: CancellationToken,
    /// Stops accepting when cancelled.
    pub shutdown: CancellationToken,
    /// How long connections may take to finish after the shutdown.
    pub drain: Duration,
}

/// A listener on `addr` (in a Tokio runtime). The unspecified IPv6 address (`[::]`, the
/// default) takes IPv4 connections as well, whatever `net.ipv6.bindv6only` says, as a Go
/// server's `:PORT` does, so one default serves IPv4, IPv6 and dual-stack clusters. Where the
/// kernel has no IPv6 at all (booted with `ipv6.disable=1`), it listens on `0.0.0.0` at the same
/// port instead, and logs that.
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    match listen_on(addr) {
        Err(e) if addr.is_ipv6() && addr.ip().is_unspecified() && no_ipv6(&e) => {
            let v4 = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), addr.port());
            tracing::info!(%addr, listening = %v4, error = %e, "no IPv6 on this host: listening on IPv4 alone");
            listen_on(v4)
        }
        bound => bound,
    }
}

/// Whether `e`, from creating or binding an IPv6 socket, says the host has no IPv6.
fn no_ipv6(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL | libc::EPROTONOSUPPORT)
    )
}

/// A listener on `addr` as Tokio's `TcpListener::bind` makes one (address reuse, a backlog of
/// 1,024), dual-stack when `addr` is the unspecified IPv6 address.
fn listen_on(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

/// Runs `server` on `listener`, on the caller's runtime.
pub async fn serve(listener: TcpListener, server: Server) {
    accept(listener, server, Spread(Vec::new())).await;
}

async fn accept(listener: TcpListener, server: Server, threads: Spread) {
    let Server {
        tls,
        app,
        limits,
        draining,
        shutdown,
        drain,
    } = server;
    let connections = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let live = Live::default();
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
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            // At the cap: the connection idle the longest makes room (whoever holds
            // connections open cannot lock others out), if one frees in time.
            Err(_) => {
                live.evict_most_idle();
                let freed = tokio::select! {
                    freed = tokio::time::timeout(EVICTION_WAIT, slots.clone().acquire_owned()) => freed,
                    () = shutdown.cancelled() => break,
                };
                match freed {
                    Ok(Ok(slot)) => slot,
                    _ => {
                        tracing::debug!(%peer, "connection limit reached; closing the new connection");
                        drop(tcp);
                        continue;
                    }
                }
            }
        };
        let (tls, app) = (tls.clone(), app.clone());
        let entry = live.enter(&shutdown, &draining);
        let Some((thread, serving)) = threads.least_loaded() else {
            connections.spawn(async move {
                let _slot = slot;
                serve_connection(tls, tcp, peer, app, limits, entry).await;
            });
            continue;
        };
        // Moved to the chosen thread's reactor: taken off this one's here, put on that one's
        // there.
        let tcp = match tcp.into_std() {
            Ok(tcp) => tcp,
            Err(error) => {
                tracing::debug!(%error, %peer, "could not hand the connection to a thread");
                continue;
            }
        };
        let counted = Counted::new(serving);
        thread.spawn(connections.track_future(async move {
            let (_slot, _counted) = (slot, counted);
            match TcpStream::from_std(tcp) {
                Ok(tcp) => serve_connection(tls, tcp, peer, app, limits, entry).await,
                Err(error) => tracing::debug!(%error, %peer, "could not serve the connection"),
            }
        }));
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

/// How long a new connection at the cap waits for the evicted one's slot.
const EVICTION_WAIT: Duration = Duration::from_millis(500);

/// How long an evicted connection may take to close gracefully (a request in flight on it
/// finishing) before it is dropped: less than [`EVICTION_WAIT`], so that the connection it
/// makes room for gets the slot, however slowly the evicted one's client sends or reads.
const EVICTED_CLOSE: Duration = Duration::from_millis(200);

/// One open connection as the cap sees it: its activity, the token that closes it (shutdown
/// or eviction), and the one that says it was evicted.
type LiveConnection = (Activity, CancellationToken, CancellationToken);

/// The open connections, by id.
#[derive(Clone, Default)]
struct Live(
    Arc<std::sync::Mutex<HashMap<u64, LiveConnection>>>,
    Arc<AtomicU64>,
);

/// A connection's place among the live ones, left when dropped.
struct Entry {
    live: Live,
    id: u64,
    activity: Activity,
    close: CancellationToken,
    /// Cancelled when the cap evicts it.
    evicted: CancellationToken,
    /// The server's [`Server::draining`].
    draining: CancellationToken,
}

impl Live {
    /// Registers a new connection, closed by `shutdown` or by eviction (and told to close
    /// once `draining`).
    fn enter(&self, shutdown: &CancellationToken, draining: &CancellationToken) -> Entry {
        let id = self.1.fetch_add(1, Ordering::Relaxed);
        let (activity, close) = (Activity::new(), shutdown.child_token());
        let evicted = CancellationToken::new();
        crate::sync::lock(&self.0).insert(id, (activity.clone(), close.clone(), evicted.clone()));
        Entry {
            live: self.clone(),
            id,
            activity,
            close,
            evicted,
            draining: draining.clone(),
        }
    }

    /// Evicts the connection that has moved no byte for the longest, of those not closing
    /// already (a request in flight on one closing finishes); where every one is closing, the
    /// one idle the longest of them. Evicted, a connection ends within [`EVICTED_CLOSE`],
    /// whatever is in flight on it: a client that sends or reads slowly on every connection
    /// cannot hold the cap.
    fn evict_most_idle(&self) {
        let live = crate::sync::lock(&self.0);
        if let Some((_, (_, close, evicted))) = live
            .iter()
            .filter(|(_, (_, _, evicted))| !evicted.is_cancelled())
            .min_by_key(|(id, (activity, close, _))| (close.is_cancelled(), activity.last(), **id))
        {
            evicted.cancel();
            close.cancel();
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        crate::sync::lock(&self.live.0).remove(&self.id);
    }
}

async fn serve_connection(
    tls: Option<TlsAcceptor>,
    tcp: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: Limits,
    entry: Entry,
) {
    let (activity, stops) = (
        entry.activity.clone(),
        Stops {
            draining: entry.draining.clone(),
            shutdown: entry.close.clone(),
            evicted: entry.evicted.clone(),
        },
    );
    let tcp = Tapped {
        instead: None,
        inner: tcp,
        tap: activity.clone(),
    };
    match tls {
        None => run_http(tcp, peer, app, limits, activity, stops, None).await,
        Some(acceptor) => {
            // Closed when evicted at the cap, or at shutdown, in its handshake too: a slot held
            // by a handshake that never ends makes room as an idle connection does.
            let handshake = tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp));
            let accepted = tokio::select! {
                accepted = handshake => accepted,
                () = stops.shutdown.cancelled() => {
                    tracing::debug!(%peer, "closed in its TLS handshake (evicted at the cap, or shutdown)");
                    return;
                }
            };
            match accepted {
                Ok(Ok(stream)) => {
                    // A client that presented a certificate the configured CA verified (rustls
                    // refused the handshake if it presented a bad one) has its requests marked.
                    let app = if stream.get_ref().1.peer_certificates().is_some() {
                        app.layer(axum::Extension(VerifiedClient))
                    } else {
                        app
                    };
                    let chosen = match stream.get_ref().1.alpn_protocol() {
                        Some(b"h2") => Some(axum::http::Version::HTTP_2),
                        Some(_) => Some(axum::http::Version::HTTP_11),
                        None => None,
                    };
                    run_http(stream, peer, app, limits, activity, stops, chosen).await
                }
                Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        }
    }
}

/// What ends a connection from this side, besides its bounds.
struct Stops {
    /// Readiness is off: an HTTP/1 connection closes with its next answer, an HTTP/2 one is
    /// told GOAWAY.
    draining: CancellationToken,
    /// The server's shutdown, or this connection's eviction: closed now, gracefully (and
    /// cancelled once the connection is closing, which eviction then passes over while it
    /// has another to evict).
    shutdown: CancellationToken,
    /// This connection's eviction at the cap: it closes within [`EVICTED_CLOSE`].
    evicted: CancellationToken,
}

/// Serves one connection within its bounds, in the protocol the client `chosen` in the TLS
/// handshake (none chosen: the one its first bytes speak). An HTTP/2 connection is told apart
/// from its first byte when it was chosen so, otherwise from its preface.
async fn run_http<IO>(
    io: IO,
    peer: SocketAddr,
    app: Router,
    limits: Limits,
    activity: Activity,
    stops: Stops,
    chosen: Option<axum::http::Version>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // So hyper serves HTTP/2 from the preface on: told to close before the preface is read, it
    // still says GOAWAY once it is (as the protocol sniffer would not).
    let mut builder = match chosen {
        None => auto::Builder::new(TokioExecutor::new()),
        Some(axum::http::Version::HTTP_2) => {
            activity.speaks_http2();
            auto::Builder::new(TokioExecutor::new()).http2_only()
        }
        Some(_) => auto::Builder::new(TokioExecutor::new()).http1_only(),
    };
    // Where nothing was chosen, the preface tells HTTP/2 apart before its first request.
    let io = Tapped {
        instead: None,
        inner: io,
        tap: Preface {
            activity: activity.clone(),
            matched: chosen.is_none().then_some(0),
        },
    };
    // The header deadline is this loop's own ([`Activity::past_bound`]), not hyper's.
    builder
        .http1()
        .header_read_timeout(None)
        .max_buf_size(HEADER_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_streams)
        .max_header_list_size(H2_HEADER_LIST_BYTES);
    // Set up (the handshake done): what the client sends next is a request, whenever it does.
    activity.awaits_request();
    let app = Marked {
        inner: app,
        activity: activity.clone(),
        send: (limits.send_timeout, limits.min_send_rate),
    };
    let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
    tokio::pin!(conn);
    let mut draining = false;
    // How long a graceful close may take: the idle bound, or for a connection with no request
    // yet a header deadline.
    let mut at_most = limits.idle_timeout;
    let why = loop {
        tokio::select! {
            // In this order: a review that arrives as readiness turns off is answered with
            // `connection: close`.
            biased;
            () = stops.draining.cancelled(), if !draining => {
                draining = true;
                // HTTP/2 says so at once (GOAWAY): the client finishes its streams and opens
                // the next on a new connection, which the Service sends to a replica that
                // stays.
                if activity.serves_http2() {
                    break "readiness is off";
                }
                tracing::debug!(%peer, "readiness is off: the next answer closes the connection");
                activity.close_with_next_answer();
            }
            result = conn.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%peer, %error, "connection ended with an error");
                }
                return;
            }
            // Readiness turned off before the protocol was told apart: the HTTP/2 preface read
            // since is told GOAWAY too. Read by the branch above, in the same pass over the
            // branches (no waker needed).
            () = std::future::poll_fn(|_| {
                if activity.serves_http2() { Poll::Ready(()) } else { Poll::Pending }
            }), if draining => break "readiness is off",
            bound = activity.past_bound(&limits) => match bound {
                Bound::Idle => break "idle",
                // An HTTP/1 connection between requests is not closed under a request the
                // client may be sending: its next answer closes it (or the idle bound, which
                // outlasts the API server's own for an idle connection).
                Bound::MaxAge if activity.between_requests() && !activity.closes_with_next_answer() => {
                    tracing::debug!(%peer, "at its maximum age: the next answer closes the connection");
                    activity.close_with_next_answer();
                }
                Bound::MaxAge => break "at its maximum age",
                // Its client reads nothing: closed at once (a graceful close would wait for
                // the very answers it does not read), which gives back what they hold.
                Bound::Stalled => {
                    tracing::info!(%peer, "closing a connection whose client reads none of its answers");
                    return;
                }
                // Its client reads, but too slowly to take its answer by its due time: closed
                // at once too, which gives back what the answer holds.
                Bound::ReadTooSlowly => {
                    tracing::info!(%peer, "closing a connection whose client reads its answer too slowly");
                    return;
                }
                // No request is in flight on an HTTP/2 connection waiting for its first one
                // (a client may dial one ahead and hold it unused): it is told GOAWAY, so
                // that its client never sends a request on it as it closes.
                Bound::HeadersLate if activity.serves_http2() => {
                    at_most = limits.header_timeout;
                    break "its first request is late";
                }
                Bound::HeadersLate => {
                    // No request is in flight: closed at once, as hyper closes one late with
                    // its headers.
                    tracing::debug!(%peer, "closing the connection: a request's headers are late");
                    return;
                }
            },
            () = stops.shutdown.cancelled() => break "shutting down",
        }
    };
    tracing::debug!(%peer, why, "closing the connection");
    // Closing already: at the connection cap, eviction passes it over for one it can close.
    stops.shutdown.cancel();
    conn.as_mut().graceful_shutdown();
    // What is in flight finishes, within the idle bound again, and within `at_most` in all (an
    // HTTP/2 client that keeps sending frames but never acknowledges the GOAWAY's ping is not
    // waited for longer).
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%peer, %error, "connection ended with an error while closing");
            }
        }
        () = activity.idle_for(limits.idle_timeout) => {}
        () = tokio::time::sleep(at_most) => {
            tracing::debug!(%peer, "closing the connection: it did not end in time");
        }
        () = async {
            stops.evicted.cancelled().await;
            tokio::time::sleep(EVICTED_CLOSE).await;
        } => {
            tracing::debug!(%peer, "closing the connection: evicted at the cap, it did not end in time");
        }
    }
}

#[cfg(test)]
mod tests {
    /// A body in several chunks is held in one buffer the share is charged for before it is
    /// allocated: at most about twice what has arrived, whatever length its head claims; as
    /// large as that length once it has all arrived, within the largest body where the head
    /// gives none; never the chunks as they came.
    #[test]
    fn a_body_in_chunks_is_held_in_one_buffer_charged_before_it_is_allocated() {
        let pieces = || (0..40u8).map(|i| super::Bytes::from(vec![i; 1000 + usize::from(i)]));
        let whole: Vec<u8> = pieces().flat_map(|c| c.to_vec()).collect();
        let largest = whole.len() + 100;
        let known = super::Chunks::expecting(Some(whole.len()), largest);
        let unknown = super::Chunks::expecting(None, largest);
        let oversized = super::Chunks::expecting(Some(2 * largest), largest);
        for (mut chunks, room) in [
            (known, whole.len()),
            (unknown, largest),
            (oversized, largest),
        ] {
            let mut charged = 0;
            for chunk in pieces() {
                // At the copy, the old storage and the new room are held at once.
                let old = chunks.first.as_ref().map_or(0, |f| f.len()) + chunks.joined.capacity();
                let copied = chunks.copied_with(chunk.len());
                charged += chunks.cost_of(chunk.len());
                let new = chunks.held_with(chunk.len());
                let at_the_copy = if new > chunks.joined.capacity() {
                    old + new
                } else {
                    old
                };
                assert_eq!(
                    charged + copied,
                    at_the_copy,
                    "what is held at the copy is what is charged then"
                );
                chunks.push(chunk);
                let held = chunks.first.as_ref().map_or(0, |f| f.len()) + chunks.joined.capacity();
                assert_eq!(charged, held, "what is held is what was charged");
                assert_eq!(chunks.held(), held);
                assert!(held <= 2 * chunks.len(), "{held} for {}", chunks.len());
            }
            assert!(
                chunks.joined.capacity() <= room,
                "{}",
                chunks.joined.capacity()
            );
            assert_eq!(chunks.into_bytes(), whole);
        }
        // A head claiming 10,000 bytes, which come one at a time: charged twice what came at
        // most, and exactly 10,000 once they all have.
        let mut declared = super::Chunks::expecting(Some(10_000), 1 << 20);
        for _ in 0..10_000 {
            let _ = declared.cost_of(1);
            declared.push(super::Bytes::from_static(b"x"));
            assert!(declared.held() <= 2 * declared.len());
        }
        assert_eq!(declared.joined.capacity(), 10_000);
        let mut one = super::Chunks::expecting(None, 10);
        assert_eq!(one.cost_of(2), 2);
        one.push(super::Bytes::from_static(b"{}"));
        assert_eq!(one.into_bytes(), &b"{}"[..]);
    }

    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn a_request_may_ask_for_less_time_than_the_limit_never_more() {
        let limit = Duration::from_secs(10);
        let asked = |uri: &str| timeout_asked(&uri.parse().expect("uri"), limit);
        assert_eq!(asked("/mutate-pod?timeout=5s"), Duration::from_secs(5));
        assert_eq!(asked("/mutate-pod?x=1&timeout=3s"), Duration::from_secs(3));
        for more_or_odd in [
            "/mutate-pod",
            "/mutate-pod?timeout=30s",
            "/mutate-pod?timeout=0s",
            "/mutate-pod?timeout=1m0s",
            "/mutate-pod?timeout=soon",
        ] {
            assert_eq!(asked(more_or_odd), limit, "{more_or_odd}");
        }
    }

    /// The API server gives up on a webhook after its `timeoutSeconds` (sent as `?timeout=`):
    /// a handler still running then is answered, and counted, as timed out at that time.
    #[tokio::test(start_paused = true)]
    async fn a_handler_slower_than_the_time_asked_is_answered_as_timed_out_then() {
        let budget = Budget {
            in_flight: 4,
            bytes: 1 << 20,
            pruned: &[],
            held_per_byte: 0,
        };
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let limit = RequestLimit::new(
            budget,
            Duration::from_secs(10),
            1 << 20,
            Some(metrics.clone()),
        );
        let request = Request::post("/convert?timeout=2s")
            .body(Body::from("{}"))
            .expect("request");
        let started = tokio::time::Instant::now();
        let answer = limit
            .run(request, |_, _| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                StatusCode::OK.into_response()
            })
            .await;
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(2) && took < Duration::from_secs(3),
            "{took:?}"
        );
        let text = metrics.encode();
        assert!(text.contains("result=\"timed_out\"} 1"), "{text}");
    }

    #[tokio::test]
    async fn an_answer_holds_its_bytes_of_the_share_until_it_is_sent_or_dropped() {
        use http_body_util::BodyExt;
        let budget = Budget {
            in_flight: 4,
            bytes: 256 << 10,
            pruned: &[],
            held_per_byte: 0,
        };
        let limit = RequestLimit::new(budget, Duration::from_secs(5), 1 << 20, None);
        let request = || {
            Request::post("/convert")
                .body(Body::from(vec![b' '; 100 << 10]))
                .expect("request")
        };
        let answer = || async { (StatusCode::OK, vec![b'a'; 100 << 10]).into_response() };
        let free = |limit: &RequestLimit| limit.0.share("/convert").1.bytes.available();

        let unread = limit.run(request(), |_, _| answer()).await;
        assert_eq!(free(&limit), (256 - 100) << 10, "held while unsent");
        // Sent in pieces; given back once the last is handed over.
        let mut body = unread.into_body();
        let mut pieces = 0;
        while let Some(frame) = body.frame().await {
            let data = frame.expect("frame").into_data().expect("data");
            assert!(data.len() <= ANSWER_PIECE);
            pieces += 1;
            // Exact between pieces too.
            let hint = http_body::Body::size_hint(&body);
            assert_eq!(hint.exact(), Some(hint.lower()));
        }
        assert_eq!(pieces, 7);
        assert_eq!(
            free(&limit),
            (256 - 100) << 10,
            "held until the connection drops it"
        );
        drop(body);
        assert_eq!(free(&limit), 256 << 10);
        // Dropped unsent (its connection closed): given back too.
        let dropped = limit.run(request(), |_, _| answer()).await;
        assert_eq!(free(&limit), (256 - 100) << 10);
        drop(dropped);
        assert_eq!(free(&limit), 256 << 10);
        // Two answers nobody reads fill the share: the next request is refused, not buffered.
        let held = [
            limit.run(request(), |_, _| answer()).await,
            limit.run(request(), |_, _| answer()).await,
        ];
        assert_eq!(
            (held[0].status(), held[1].status(), free(&limit)),
            (StatusCode::OK, StatusCode::OK, (256 - 200) << 10)
        );
        let refused = limit.run(request(), |_, _| answer()).await;
        let status = refused.status();
        let said = refused
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{said:?}");
        assert_eq!(
            free(&limit),
            (256 - 200) << 10,
            "a refusal gives back nothing"
        );
        drop(held);
        assert_eq!(free(&limit), 256 << 10);
    }

    #[tokio::test]
    async fn an_endpoint_answering_with_its_request_is_charged_for_both() {
        let budget = Budget {
            in_flight: 4,
            bytes: 256 << 10,
            pruned: &[],
            held_per_byte: 1,
        };
        let limit = RequestLimit::new(budget, Duration::from_secs(5), 1 << 20, None);
        let free = |limit: &RequestLimit| limit.0.share("/convert").1.bytes.available();
        let request = |n: usize| {
            Request::post("/convert")
                .body(Body::from(vec![b' '; n]))
                .expect("request")
        };
        let (seen, complex) = (AtomicUsize::new(0), AtomicBool::new(false));
        let handle = |too_complex: Option<TooComplex>| {
            seen.store(free(&limit), Ordering::Relaxed);
            complex.store(too_complex.is_some(), Ordering::Relaxed);
            async { (StatusCode::OK, vec![b'a'; 100 << 10]).into_response() }
        };
        let answer = limit.run(request(100 << 10), |_, t| handle(t)).await;
        assert!(!complex.load(Ordering::Relaxed));
        assert_eq!(
            seen.load(Ordering::Relaxed),
            (256 - 200) << 10,
            "the request and the answer it may make, while it is handled"
        );
        assert_eq!(free(&limit), (256 - 100) << 10, "then the answer alone");
        drop(answer);
        assert_eq!(free(&limit), 256 << 10);
        // Twice 130 KiB is more than the share: not handled as it is.
        drop(limit.run(request(130 << 10), |_, t| handle(t)).await);
        assert!(complex.load(Ordering::Relaxed));
        assert_eq!(free(&limit), 256 << 10);
    }

    #[tokio::test]
    async fn an_answer_that_is_no_endpoints_takes_nothing_of_the_endpoints_share() {
        let small = Budget {
            in_flight: 1,
            bytes: 1 << 10,
            pruned: &[],
            held_per_byte: 0,
        };
        let other = Budget {
            bytes: 1 << 20,
            ..small
        };
        let limit = RequestLimit::new(other, Duration::from_secs(5), 1 << 20, None)
            .endpoint("/mutate-pod", small);
        let put = || {
            Request::put("/mutate-pod")
                .body(Body::from(vec![b' '; 8 << 10]))
                .expect("request")
        };
        let answer = |_, _| async { StatusCode::METHOD_NOT_ALLOWED.into_response() };
        let refused = limit.run(put(), answer).await;
        assert_eq!(
            refused.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "the endpoint's"
        );
        let answered = limit.run_as_other(put(), answer).await;
        assert_eq!(
            answered.status(),
            StatusCode::METHOD_NOT_ALLOWED,
            "the other paths'"
        );
    }

    #[tokio::test]
    async fn refusals_are_counted_under_the_endpoint_or_other() {
        use tower::ServiceExt;
        let metrics = Arc::new(Metrics::new());
        let none = Budget {
            in_flight: 0,
            bytes: 1 << 20,
            pruned: &[],
            held_per_byte: 0,
        };
        let limit = RequestLimit::new(none, Duration::from_secs(1), 1 << 20, Some(metrics.clone()))
            .endpoint("/mutate-pod", none);
        let app = Router::new()
            .route("/mutate-pod", axum::routing::post(|| async { "" }))
            .route("/elsewhere", axum::routing::post(|| async { "" }))
            .route_layer(axum::middleware::from_fn_with_state(limit, limit_requests));
        for path in ["/mutate-pod", "/elsewhere"] {
            let request = Request::post(path).body(Body::empty()).expect("request");
            let response = app.clone().oneshot(request).await.expect("infallible");
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "{path}");
        }
        let text = metrics.encode();
        for endpoint in ["/mutate-pod", "other"] {
            let series = format!(
                "pps_admission_requests_total{{endpoint=\"{endpoint}\",result=\"overloaded\"}} 1"
            );
            assert!(text.contains(&series), "{series} in {text}");
        }
    }

    /// This thread's nice value.
    fn nice() -> i32 {
        rustix::process::getpriority_process(Some(rustix::thread::gettid())).expect("nice")
    }

    #[test]
    fn the_main_runtime_runs_below_its_builder_and_server_threads_built_after_it_do_not() {
        let own = nice();
        let runtime = main_runtime(3).expect("runtime");
        let expected = (own + 3).min(19);
        let worker = runtime.block_on(async { tokio::spawn(async { nice() }).await });
        assert_eq!(worker.expect("task"), expected, "a worker");
        // A blocking thread spawned by a worker (already lowered) is not lowered twice.
        let nested = runtime.block_on(async {
            tokio::spawn(async { tokio::task::spawn_blocking(nice).await }).await
        });
        assert_eq!(
            nested.expect("task").expect("task"),
            expected,
            "a blocking thread"
        );
        assert_eq!(nice(), own, "the thread that built and entered it");
        let servers = ServerThreads::new("pps-test-nice", 1, None).expect("runtimes");
        let server = servers.0[0].block_on(async { tokio::spawn(async { nice() }).await });
        assert_eq!(server.expect("task"), own, "a server thread");
        let unchanged = main_runtime(0).expect("runtime");
        let worker = unchanged.block_on(async { tokio::spawn(async { nice() }).await });
        assert_eq!(worker.expect("task"), own, "nice 0: unchanged");
    }

    /// The calling thread's slice and nice value as the kernel reports them.
    fn slice_and_nice() -> (u64, i32) {
        let attr = sched_getattr(0).expect("sched_getattr");
        (attr.sched_runtime, attr.sched_nice)
    }

    #[test]
    fn server_threads_ask_for_their_slice_and_keep_their_nice_value() {
        let (default, own) = slice_and_nice();
        let asked = Duration::from_micros(300);
        let servers = ServerThreads::new("pps-test-slice", 2, Some(asked)).expect("runtimes");
        for runtime in &servers.0 {
            let (slice, nice) = runtime
                .block_on(async { tokio::spawn(async { slice_and_nice() }).await })
                .expect("task");
            assert_eq!(nice, own, "the nice value is kept");
            if default == 0 {
                // A kernel before 6.12 reports no slice of a normal thread, and ignores one.
                assert_eq!(slice, 0, "ignored");
            } else {
                assert_eq!(
                    slice, 300_000,
                    "the slice asked for (the default: {default} ns)"
                );
            }
        }
        let plain = ServerThreads::new("pps-test-slice", 1, None).expect("runtimes");
        let (slice, _) = plain.0[0]
            .block_on(async { tokio::spawn(async { slice_and_nice() }).await })
            .expect("task");
        assert_eq!(slice, default, "none asked: the kernel's default");
    }

    #[tokio::test]
    async fn the_default_listener_takes_ipv4_and_ipv6_connections() {
        let listener = listen("[::]:0".parse().expect("addr")).expect("listen");
        let bound = listener.local_addr().expect("addr");
        let at = |ip: &str| SocketAddr::new(ip.parse().expect("ip"), bound.port());
        // IPv4 whether the host has IPv6 or not (then it listens on 0.0.0.0 alone), and IPv6
        // where the host has a loopback address of it (a container may have IPv6 turned off by
        // sysctl: the socket binds, ::1 does not exist).
        let mut targets = vec![at("127.0.0.1")];
        if bound.is_ipv6() {
            assert!(bound.ip().is_unspecified(), "{bound}");
            if std::net::TcpListener::bind("[::1]:0").is_ok() {
                targets.push(at("::1"));
            }
        } else {
            assert!(
                listen_on("[::]:0".parse().expect("addr")).is_err_and(|e| no_ipv6(&e)),
                "fell back to IPv4 only where there is no IPv6: {bound}"
            );
        }
        for target in targets {
            let (dialled, accepted) = tokio::join!(TcpStream::connect(target), listener.accept());
            dialled.unwrap_or_else(|e| panic!("{target}: {e}"));
            let (_, peer) = accepted.unwrap_or_else(|e| panic!("{target}: {e}"));
            let from = match peer.ip() {
                std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer.ip(), Into::into),
                v4 => v4,
            };
            assert_eq!(from, target.ip(), "{target} accepted from {peer}");
        }
        // A port in use is an error, not a fallback.
        let taken = listen(SocketAddr::new(bound.ip(), bound.port()));
        assert!(
            taken.is_err_and(|e| e.kind() == std::io::ErrorKind::AddrInUse),
            "{bound} in use"
        );
        let again = listen(format!("[::]:{}", bound.port()).parse().expect("addr"));
        assert!(again.is_err(), "[::]:{} in use", bound.port());
        // An address given is bound as it is.
        let v4 = listen("127.0.0.1:0".parse().expect("addr")).expect("listen");
        assert!(v4.local_addr().expect("addr").is_ipv4());
    }

    #[tokio::test]
    async fn a_server_on_threads_of_its_own_spreads_connections_over_them_and_stops_with_them() {
        let threads = ServerThreads::new("pps-test-own", 2, None).expect("runtimes");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        // The handler says which thread runs it.
        let app = Router::new().route(
            "/",
            axum::routing::get(|| async {
                let thread = std::thread::current();
                format!("{:?} {}", thread.id(), thread.name().unwrap_or_default())
            }),
        );
        let shutdown = CancellationToken::new();
        let server = threads
            .serve(
                listener,
                Server {
                    tls: None,
                    app,
                    limits: Limits::PROBES,
                    draining: CancellationToken::new(),
                    shutdown: shutdown.clone(),
                    drain: Duration::from_secs(1),
                },
            )
            .expect("serving");
        // Eight connections held open, one after the other: each goes to the thread serving
        // fewer, so they alternate (whichever thread the kernel would have woken to accept).
        let mut held = Vec::new();
        let mut served_on = Vec::new();
        for _ in 0..8 {
            let mut tcp = TcpStream::connect(addr).await.expect("connect");
            tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .expect("write");
            let mut answer = Vec::new();
            let mut buf = [0u8; 512];
            while !answer.ends_with(b"pps-test-own") {
                let n = tcp.read(&mut buf).await.expect("read");
                assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&answer));
                answer.extend_from_slice(&buf[..n]);
            }
            let answer = String::from_utf8(answer).expect("text");
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            let thread = answer.rsplit("\r\n").next().unwrap_or_default().to_owned();
            served_on.push(thread);
            held.push(tcp);
        }
        let (first, second) = (&served_on[0], &served_on[1]);
        assert_ne!(first, second, "two threads serve: {served_on:?}");
        for (k, thread) in served_on.iter().enumerate() {
            let expected = if k % 2 == 0 { first } else { second };
            assert_eq!(thread, expected, "alternating: {served_on:?}");
        }
        assert!(!server.is_finished(), "serving until shut down");
        // Awaited from the caller's runtime; the runtimes are then dropped within async code.
        drop(held);
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("stopped in time")
            .expect("the server ended without a panic");
        drop(threads);
    }

    #[test]
    fn the_least_loaded_thread_is_the_first_of_those_serving_fewest() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let spread = Spread(
            [3, 1, 1]
                .into_iter()
                .map(|n| (runtime.handle().clone(), Arc::new(AtomicUsize::new(n))))
                .collect(),
        );
        let least = |spread: &Spread| {
            let (_, serving) = spread.least_loaded().expect("a thread");
            spread
                .0
                .iter()
                .position(|(_, s)| Arc::ptr_eq(s, serving))
                .expect("one of them")
        };
        assert_eq!(least(&spread), 1);
        let counted = Counted::new(&spread.0[1].1);
        assert_eq!(
            least(&spread),
            2,
            "one more on the second: the third serves fewest"
        );
        drop(counted);
        assert_eq!(least(&spread), 1, "counted off when dropped");
        assert!(Spread(Vec::new()).least_loaded().is_none());
    }

    #[test]
    fn a_share_takes_only_what_is_free_and_gets_it_back_when_dropped() {
        let share = Share::new(
            Budget {
                in_flight: 1,
                bytes: 100,
                pruned: &[],
                held_per_byte: 0,
            },
            None,
        );
        let free = Free::available;
        let mut held = None;
        assert!(share.bytes(&mut held, 60));
        assert!(!share.bytes(&mut held, 50), "over the budget: refused");
        assert_eq!(free(&share.bytes), 40, "a refusal takes nothing");
        assert!(share.bytes(&mut held, 40));
        assert_eq!(free(&share.bytes), 0);
        drop(held);
        assert_eq!(free(&share.bytes), 100, "all given back at once");
        let slot = share.slots.take(1);
        assert!(slot.is_some());
        assert!(share.slots.take(1).is_none(), "the only slot is held");
        drop(slot);
        assert!(share.slots.take(1).is_some(), "given back");
    }

    #[tokio::test]
    async fn headers_are_due_from_a_request_s_first_byte_and_age_waits_for_the_next_answer() {
        let limits = Limits {
            header_timeout: Duration::from_millis(20),
            idle_timeout: Duration::from_millis(200),
            max_age: Duration::from_secs(60),
            ..Limits::WEBHOOK
        };
        // Set up, nothing sent: bound by being idle, however long past the header deadline
        // (a client may hold a fresh connection for its next request).
        let activity = Activity::new();
        activity.awaits_request();
        assert_eq!(activity.past_bound(&limits).await, Bound::Idle);
        // The first request's first byte: its headers are due from then.
        activity.bytes_read();
        assert_eq!(activity.past_bound(&limits).await, Bound::HeadersLate);
        // A request is handled: its connection is bound by being idle, not by headers.
        activity.headers_arrived(axum::http::Version::HTTP_11);
        activity.touch();
        assert_eq!(activity.past_bound(&limits).await, Bound::Idle);
        // Answered and kept alive: no headers due while nothing arrives (however long past
        // the header deadline), only the idle bound.
        activity.awaits_request();
        activity.touch();
        assert_eq!(activity.past_bound(&limits).await, Bound::Idle);
        // The next request's first byte: its headers are due from then.
        activity.bytes_read();
        assert_eq!(activity.past_bound(&limits).await, Bound::HeadersLate);
        // Past its maximum age between two requests, a connection that closes with its next
        // answer is bound by being idle or late, and by its age only one idle bound later.
        let old = Limits {
            max_age: Duration::from_millis(1),
            ..limits
        };
        let activity = Activity::new();
        activity.bytes_read();
        assert_eq!(activity.past_bound(&old).await, Bound::MaxAge);
        activity.close_with_next_answer();
        assert_eq!(activity.past_bound(&old).await, Bound::HeadersLate);
        activity.awaits_request();
        activity.touch();
        let then = Instant::now();
        assert_eq!(activity.past_bound(&old).await, Bound::MaxAge);
        assert!(
            then.elapsed() >= old.idle_timeout / 2,
            "{:?}",
            then.elapsed()
        );
        let (young, idle) = (
            Activity::new(),
            Limits {
                max_age: Duration::from_secs(60),
                ..old
            },
        );
        young.close_with_next_answer();
        young.awaits_request();
        assert_eq!(young.past_bound(&idle).await, Bound::Idle);
        // An HTTP/2 connection has no header deadline once its first request arrived.
        let activity = Activity::new();
        activity.headers_arrived(axum::http::Version::HTTP_2);
        activity.touch();
        assert_eq!(activity.past_bound(&limits).await, Bound::Idle);
        activity.bytes_read();
        assert_eq!(activity.past_bound(&limits).await, Bound::Idle);
        assert!(!activity.between_requests());
        assert_eq!(activity.past_bound(&old).await, Bound::MaxAge);
    }

    /// Past its maximum age, closing with its next answer, an HTTP/1 connection whose answer
    /// its client reads slowly but steadily (bytes move, never idle nor stalled) is bound by its
    /// age one idle bound later: not held until the answer is read, however long that takes.
    #[tokio::test]
    async fn a_closing_connection_whose_answer_trickles_out_is_bound_by_its_age_and_the_idle_bound()
    {
        let limits = Limits {
            max_age: Duration::from_millis(1),
            idle_timeout: Duration::from_millis(300),
            ..Limits::WEBHOOK
        };
        let activity = Activity::new();
        activity.headers_arrived(axum::http::Version::HTTP_11);
        activity.close_with_next_answer();
        // Its answer is ready and being written, a piece every 20 ms.
        activity.awaits_request();
        let writer = activity.clone();
        let trickle = tokio::spawn(async move {
            loop {
                writer.bytes_written();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        let started = Instant::now();
        let bound = tokio::time::timeout(Duration::from_secs(5), activity.past_bound(&limits))
            .await
            .expect("bound within 5 s");
        trickle.abort();
        assert_eq!(bound, Bound::MaxAge);
        assert!(
            started.elapsed() >= limits.idle_timeout / 2,
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn a_watched_socket_writes_vectored_and_counts_it_as_activity() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let tcp = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (mut peer, _) = listener.accept().await.expect("accept");
        // Started a second ago and never touched: a touch now stores about 1000 ms (in µs).
        let activity = Activity(Arc::new(ActivityState {
            base: Instant::now()
                .checked_sub(Duration::from_secs(1))
                .expect("a second of uptime"),
            last_micros: AtomicU64::new(0),
            waiting_micros: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            http2: AtomicBool::new(false),
            unsent: std::sync::Mutex::new(Vec::new()),
            answers: AtomicU64::new(0),
            blocked_micros: AtomicU64::new(0),
            blocked: tokio::sync::Notify::new(),
            answer_due_micros: AtomicU64::new(0),
        }));
        let mut watched = Tapped {
            instead: None,
            inner: tcp,
            tap: activity.clone(),
        };
        assert!(watched.is_write_vectored(), "forwarded from the socket");
        let slices = [
            std::io::IoSlice::new(b"two "),
            std::io::IoSlice::new(b"records"),
        ];
        let written = watched.write_vectored(&slices).await.expect("write");
        assert_eq!(written, 11, "both slices in one call");
        assert!(
            activity.0.last_micros.load(Ordering::Relaxed) >= 1_000_000,
            "counted as activity"
        );

        let mut got = [0u8; 11];
        peer.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"two records");
    }

    #[tokio::test]
    async fn an_http2_answer_unsent_past_the_send_timeout_ends_its_connection_however_busy() {
        let limits = Limits {
            idle_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_millis(100),
            ..Limits::WEBHOOK
        };
        let activity = Activity::new();
        activity.speaks_http2();
        activity.headers_arrived(axum::http::Version::HTTP_2);
        // An answer becomes unsent after the bound was first looked at; bytes are read all
        // along (pings, other requests): bound by the send timeout, looked at again within it.
        let start = Instant::now();
        let bound = activity.past_bound(&limits);
        tokio::pin!(bound);
        let stuck = std::cell::Cell::new(0);
        let busy = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            stuck.set(activity.answer_unsent());
            // Another answer sent piece by piece all along is no progress of this one.
            let flowing = activity.answer_unsent();
            loop {
                activity.bytes_read();
                activity.answer_progressed(flowing);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let found = tokio::select! {
            found = &mut bound => found,
            () = busy => unreachable!("busy forever"),
        };
        assert_eq!(found, Bound::Stalled);
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(150) && took < Duration::from_millis(400),
            "{took:?}"
        );
        // A piece taken keeps it going; once both are sent, only the idle bound holds it.
        activity.answer_progressed(stuck.get());
        activity.answer_progressed(stuck.get() + 1);
        let again = tokio::time::timeout(Duration::from_millis(50), activity.past_bound(&limits));
        assert!(again.await.is_err(), "a piece taken just now");
        activity.answer_sent(stuck.get());
        activity.answer_sent(stuck.get() + 1);
        assert_eq!(activity.stalest_answer(), None);
        let idle = Limits {
            idle_timeout: Duration::from_millis(300),
            ..limits
        };
        let start = Instant::now();
        assert_eq!(activity.past_bound(&idle).await, Bound::Idle);
        assert!(
            start.elapsed() >= Duration::from_millis(200),
            "{:?}",
            start.elapsed()
        );
    }

    /// A connection whose socket takes nothing of what it has to send (its client reads
    /// nothing, HTTP/1 as HTTP/2) is past its bound after the send timeout, however long its
    /// idle bound; a client that reads, however slowly, keeps it going.
    #[tokio::test]
    async fn a_socket_that_takes_nothing_to_send_is_past_its_bound_after_the_send_timeout() {
        let limits = Limits {
            idle_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_millis(100),
            ..Limits::WEBHOOK
        };
        let activity = Activity::new();
        activity.headers_arrived(axum::http::Version::HTTP_11);
        let (server, mut client) = tokio::io::duplex(64);
        let mut tapped = Tapped {
            instead: None,
            inner: server,
            tap: activity.clone(),
        };
        let bound = activity.past_bound(&limits);
        tokio::pin!(bound);
        let writing = async {
            let _ = tapped.write_all(&[0u8; 1 << 20]).await;
            unreachable!("a megabyte written through a client that reads 16 bytes at a time");
        };
        tokio::pin!(writing);
        // Read 16 bytes every 20 ms for 400 ms: the write waits, but never for long.
        let reading = async {
            let mut buf = [0u8; 16];
            let until = Instant::now() + Duration::from_millis(400);
            while Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(20)).await;
                assert!(client.read(&mut buf).await.expect("read") > 0);
            }
        };
        tokio::select! {
            found = &mut bound => panic!("{found:?} while its client reads"),
            () = &mut writing => {}
            () = reading => {}
        }
        // Reading no more: the send bound, not the idle one.
        let stopped = Instant::now();
        let found = tokio::select! {
            found = &mut bound => found,
            () = &mut writing => unreachable!(),
        };
        assert_eq!(found, Bound::Stalled);
        let took = stopped.elapsed();
        assert!(took < Duration::from_millis(500), "{took:?}");
    }

    /// A connection served by `app` under `limits` over a pipe whose client end (4 KiB of
    /// buffer) has sent `GET /big`: the client end, and the serving that ends as the connection
    /// does.
    async fn asked_for_big(
        app: Router,
        limits: Limits,
    ) -> (
        tokio::io::DuplexStream,
        impl std::future::Future<Output = ()>,
    ) {
        let activity = Activity::new();
        let (server, mut client) = tokio::io::duplex(4096);
        let io = Tapped {
            instead: None,
            inner: server,
            tap: activity.clone(),
        };
        let stops = Stops {
            draining: CancellationToken::new(),
            shutdown: CancellationToken::new(),
            evicted: CancellationToken::new(),
        };
        client
            .write_all(b"GET /big HTTP/1.1\r\nhost: pps\r\n\r\n")
            .await
            .expect("request");
        let peer: SocketAddr = "127.0.0.1:1".parse().expect("address");
        (
            client,
            run_http(io, peer, app, limits, activity, stops, None),
        )
    }

    /// An HTTP/1 client that asks for an answer and reads none of it is closed once its socket
    /// took nothing for the send timeout, not held to the idle bound (30 s here).
    #[tokio::test]
    async fn an_http1_client_that_reads_none_of_its_answer_is_closed_after_the_send_timeout() {
        let limits = Limits {
            idle_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_millis(200),
            ..Limits::WEBHOOK
        };
        let app = Router::new().route("/big", axum::routing::get(|| async { vec![b'x'; 1 << 20] }));
        let (mut client, serving) = asked_for_big(app, limits).await;
        let start = Instant::now();
        tokio::time::timeout(Duration::from_secs(5), serving)
            .await
            .expect("closed long before its idle bound");
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(200), "{took:?}");
        // Some of the answer was sent (the socket's buffer), never the whole.
        let mut got = Vec::new();
        let _ = client.read_to_end(&mut got).await;
        assert!(
            !got.is_empty() && got.len() < 1 << 20,
            "{} bytes",
            got.len()
        );
    }

    /// An HTTP/1 client that reads its large answer steadily but too slowly (each read well
    /// within the send timeout) is closed once the answer is not handed over by its due time,
    /// the send timeout plus its size at the minimum rate, not held to the idle bound or the
    /// maximum age; one that reads faster gets it whole, on a connection kept alive.
    #[tokio::test]
    async fn an_http1_client_that_reads_its_answer_too_slowly_is_closed_at_its_due_time() {
        let limits = Limits {
            idle_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_millis(200),
            // A mebibyte due within 1.2 s.
            min_send_rate: 1 << 20,
            ..Limits::WEBHOOK
        };
        // Handed over in pieces, as the endpoints' limits hand over an answer ([`Held`]).
        struct Pieces(Bytes);
        impl http_body::Body for Pieces {
            type Data = Bytes;
            type Error = axum::Error;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
                let n = self.0.len().min(ANSWER_PIECE);
                Poll::Ready((n > 0).then(|| Ok(http_body::Frame::data(self.0.split_to(n)))))
            }
            fn size_hint(&self) -> http_body::SizeHint {
                http_body::SizeHint::with_exact(self.0.len() as u64)
            }
        }
        let app = Router::new().route(
            "/big",
            axum::routing::get(|| async { Body::new(Pieces(Bytes::from(vec![b'x'; 1 << 20]))) }),
        );
        // 4 KiB every 20 ms (200 KiB a second: 5 s for the answer), then as fast as it comes.
        for slow in [true, false] {
            let (mut client, serving) = asked_for_big(app.clone(), limits).await;
            let start = Instant::now();
            tokio::pin!(serving);
            let mut got = 0usize;
            let reading = async {
                let mut buf = vec![0u8; 4096];
                loop {
                    if slow {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    match client.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got += n,
                    }
                    if got > 1 << 20 {
                        // The head and the whole answer.
                        return;
                    }
                }
            };
            let closed = tokio::time::timeout(Duration::from_secs(10), async {
                tokio::select! {
                    () = &mut serving => true,
                    () = reading => false,
                }
            })
            .await
            .expect("within 10 s");
            let took = start.elapsed();
            if slow {
                assert!(closed, "closed before the answer was read");
                assert!(
                    took >= Duration::from_millis(1200) && took < Duration::from_secs(4),
                    "closed at its due time: {took:?}"
                );
                assert!(got < 1 << 20, "{got} bytes");
            } else {
                assert!(!closed && got > 1 << 20, "read whole: {got} bytes");
                // Past the due time the answer had (1.2 s): handed over whole, it holds none.
                let open = tokio::time::timeout(Duration::from_millis(1500), &mut serving).await;
                assert!(open.is_err(), "kept alive");
            }
        }
    }

    /// hyper's own answer to a head it could not parse, as it writes it.
    const HYPERS_400: &[u8] = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\ndate: Sun, 06 Dec 2026 23:03:01 GMT\r\n\r\n";

    #[test]
    fn only_hypers_own_bodiless_refusals_are_given_a_json_message() {
        let answer = with_json_message(HYPERS_400).expect("hyper's 400");
        let text = String::from_utf8(answer).expect("text");
        let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
        assert!(head.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{head}");
        assert!(
            head.contains("\r\ncontent-type: application/json\r\n"),
            "{head}"
        );
        assert!(
            head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
            "{head}"
        );
        assert!(head.contains("\r\nconnection: close\r\n") && head.contains("\r\ndate: "));
        let message: serde_json::Value = serde_json::from_str(body).expect("json");
        assert!(
            message["error"]
                .as_str()
                .is_some_and(|m| m.contains("malformed"))
        );
        let swap = |from: &str, to: &str| {
            String::from_utf8_lossy(HYPERS_400)
                .replace(from, to)
                .into_bytes()
        };
        let too_large = swap("400 Bad Request", "431 Request Header Fields Too Large");
        assert!(with_json_message(&too_large).is_some());
        // Anything else passes as it is: another status, an answer with a body or kept alive,
        // a part of a head, a head and more.
        for other in [
            swap("400 Bad Request", "404 Not Found"),
            swap("400 Bad Request", "200 OK"),
            swap("content-length: 0", "content-length: 17"),
            swap("connection: close\r\n", ""),
            HYPERS_400[..HYPERS_400.len() - 2].to_vec(),
            [HYPERS_400, b"{}".as_slice()].concat(),
            [HYPERS_400, HYPERS_400].concat(),
            b"HTTP/1.1 400".to_vec(),
            Vec::new(),
        ] {
            assert_eq!(
                with_json_message(&other),
                None,
                "{}",
                String::from_utf8_lossy(&other)
            );
        }
    }

    /// The answer put in place of hyper's head is sent whole, before what is written after it,
    /// however few bytes the socket takes at a time.
    #[tokio::test]
    async fn an_answer_sent_instead_goes_out_whole_through_a_narrow_socket() {
        let (server, mut client) = tokio::io::duplex(7);
        let mut io = Tapped {
            instead: None,
            inner: server,
            tap: Preface {
                activity: Activity::new(),
                matched: None,
            },
        };
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.map(|_| got)
        });
        io.write_all(HYPERS_400).await.expect("head");
        io.write_all(b"after").await.expect("more");
        io.shutdown().await.expect("shutdown");
        drop(io);
        let got = reader.await.expect("reader").expect("read");
        let mut want = with_json_message(HYPERS_400).expect("answer");
        want.extend_from_slice(b"after");
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&want)
        );
    }

    #[test]
    fn the_http2_preface_is_told_apart_however_its_bytes_arrive() {
        let sniff = |reads: &[&[u8]]| {
            let activity = Activity::new();
            let mut preface = Preface {
                activity: activity.clone(),
                matched: Some(0),
            };
            for read in reads {
                preface.read(read);
            }
            (activity.serves_http2(), preface.matched)
        };
        for at in 0..=HTTP2_PREFACE.len() {
            let (head, tail) = HTTP2_PREFACE.split_at(at);
            assert_eq!(sniff(&[head, b"", tail]), (true, None), "split at {at}");
        }
        let head = &HTTP2_PREFACE[..7];
        assert_eq!(
            sniff(&[b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04"]),
            (true, None)
        );
        assert_eq!(sniff(&[head]), (false, Some(7)), "not yet told apart");
        assert_eq!(sniff(&[b"POST /mutate HTTP/1.1\r\n"]), (false, None));
        assert_eq!(sniff(&[b"PRI * HTTP/1.1\r\n"]), (false, None));
        // Told apart as not HTTP/2 for good: a later preface is a body's bytes.
        assert_eq!(sniff(&[b"GET ", HTTP2_PREFACE]), (false, None));
    }
}
