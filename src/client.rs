//! The Kubernetes client `serve` runs with: kube's own layers (its base URI, authentication,
//! extra headers, and retries of 429, 503 and 504 where the configuration asks for them; its
//! connect, read and write timeouts) and a debug span per request as kube's (`HTTP`, with the
//! method, URL and status), over connections that notice a dead peer.
//!
//! kube's client sets no TCP keepalive, so a connection to an API server that went away
//! without a reset (its machine lost, a partition dropping packets) read nothing until the
//! read timeout: a watch on it counted as current all along, its cache frozen. Here an
//! idle connection probes its peer after [`KEEPALIVE_IDLE`], every [`KEEPALIVE_INTERVAL`],
//! [`KEEPALIVE_PROBES`] times, and on Linux data or a probe left unacknowledged for
//! [`UNACKNOWLEDGED`] ends it (`TCP_USER_TIMEOUT`, which then bounds the probes too): a watch
//! on a dead connection fails within about a minute and is
//! resumed on a new one, which a load balancer sends to an API server that answers. (A peer
//! whose kernel still answers, an API server process hung, is seen by the watches' bound on
//! silence: [`crate::state::WATCH_TIMEOUT_SECONDS`].) Watches of one resource begin at most
//! once a second ([`WATCH_MIN_INTERVAL`]). Through a proxy (`proxy_url`), kube's own client is
//! used as it is: no keepalive, and watches not paced.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::{BoxFuture, Either};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use kube::client::retry::RetryPolicy;
use tower::ServiceBuilder;
use tower_http::classify::ServerErrorsFailureClass;
use tracing::Span;

/// How long a connection is idle before its peer is probed.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// Between two probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Probes unanswered before the connection is given up.
pub const KEEPALIVE_PROBES: u32 = 3;
/// How long sent data may stay unacknowledged before the connection is given up (Linux).
pub const UNACKNOWLEDGED: Duration = Duration::from_secs(60);

/// A client for `config`, its connections kept alive as above.
pub fn client(config: kube::Config) -> Result<kube::Client, kube::Error> {
    if config.proxy_url.is_some() {
        return kube::Client::try_from(config);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_keepalive(Some(KEEPALIVE_IDLE));
    http.set_keepalive_interval(Some(KEEPALIVE_INTERVAL));
    http.set_keepalive_retries(Some(KEEPALIVE_PROBES));
    #[cfg(target_os = "linux")]
    http.set_tcp_user_timeout(Some(UNACKNOWLEDGED));
    let mut connector =
        hyper_timeout::TimeoutConnector::new(config.rustls_https_connector_with_connector(http)?);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let client: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Builder::new(TokioExecutor::new()).build(connector);
    // In kube's order: the base URI, retries, authentication, extra headers.
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| tower::retry::RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        // A debug span per request, named and filled in as kube's client does (`RUST_LOG=debug`
        // or a filter naming this module shows them); its failures (an error, a 5xx answer) are
        // debug events here, since the callers say what failed with more context.
        .layer(
            tower_http::trace::TraceLayer::new_for_http()
                .make_span_with(|request: &http::Request<kube::client::Body>| {
                    tracing::debug_span!(
                        "HTTP",
                        http.method = %request.method(),
                        http.url = %request.uri(),
                        http.status_code = tracing::field::Empty,
                        // The verb kube's request builders name ("list", "watch", ...).
                        otel.name = request.extensions().get::<&'static str>().unwrap_or(&"HTTP"),
                        otel.kind = "client",
                        otel.status_code = tracing::field::Empty,
                    )
                })
                .on_request(|_: &http::Request<kube::client::Body>, _: &Span| {
                    tracing::debug!("requesting");
                })
                .on_response(
                    |response: &http::Response<Incoming>, _: Duration, span: &Span| {
                        let status = response.status();
                        span.record("http.status_code", status.as_u16());
                        if status.is_client_error() || status.is_server_error() {
                            span.record("otel.status_code", "ERROR");
                        }
                    },
                )
                .on_body_chunk(())
                .on_eos(|_: Option<&http::HeaderMap>, _: Duration, _: &Span| {
                    tracing::debug!("stream closed");
                })
                .on_failure(
                    |failure: ServerErrorsFailureClass, _: Duration, span: &Span| {
                        span.record("otel.status_code", "ERROR");
                        tracing::debug!(%failure, "failed");
                    },
                ),
        )
        .map_err(tower::BoxError::from)
        .service(PaceWatches::new(client));
    Ok(kube::Client::new(service, config.default_namespace))
}

/// The least time between the starts of two watches of the same resource and selectors.
pub const WATCH_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Watches of one resource and selectors begun at most once per [`WATCH_MIN_INTERVAL`].
/// kube-runtime's watcher asks again at once when a watch ends (the API server ends each at its
/// timeout, minutes after it began), with no pause: an API server or a load balancer that ends
/// every watch as it begins would be asked again as fast as it answers. Such a watch waits
/// until the interval has passed since the last one began; no other request waits.
#[derive(Clone)]
struct PaceWatches<S> {
    inner: S,
    /// When the last watch of each resource and selectors began (or will).
    began: Arc<Mutex<HashMap<String, tokio::time::Instant>>>,
}

/// Watches remembered before those begun over an interval ago are forgotten.
const PACED_KEPT: usize = 64;

impl<S> PaceWatches<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            began: Arc::default(),
        }
    }

    /// How long a request for `uri` (accepting `accept`) waits: a watch begun again within the
    /// interval, until the interval has passed; anything else, not at all.
    fn wait_for(&self, uri: &http::Uri, accept: Option<&http::HeaderValue>) -> Option<Duration> {
        let query = uri.query()?;
        let params = query.split('&');
        if !params.clone().any(|p| p == "watch=true" || p == "watch=1") {
            return None;
        }
        // The resource, selectors and encoding: the path, every parameter but where it resumes,
        // and what it accepts (a protobuf watch and a JSON one are two watches).
        let mut key = uri.path().to_owned();
        for p in params.filter(|p| !p.starts_with("resourceVersion=")) {
            key.push('&');
            key.push_str(p);
        }
        if let Some(accept) = accept.and_then(|a| a.to_str().ok()) {
            key.push('|');
            key.push_str(accept);
        }
        let now = tokio::time::Instant::now();
        let mut began = crate::sync::lock(&self.began);
        if began.len() >= PACED_KEPT {
            began.retain(|_, at| now.duration_since(*at) < WATCH_MIN_INTERVAL);
        }
        let at = began
            .get(&key)
            .map_or(now, |last| (*last + WATCH_MIN_INTERVAL).max(now));
        began.insert(key, at);
        (at > now).then(|| at - now)
    }
}

impl<S, B> tower::Service<http::Request<B>> for PaceWatches<S>
where
    S: tower::Service<http::Request<B>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<S::Future, BoxFuture<'static, Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let accept = request.headers().get(http::header::ACCEPT);
        let Some(wait) = self.wait_for(request.uri(), accept) else {
            return Either::Left(self.inner.call(request));
        };
        // The service made ready goes with the request; this one keeps a clone.
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        tracing::debug!(uri = %request.uri(), ?wait, "a watch begun again within a second of the last: it waits");
        Either::Right(Box::pin(async move {
            tokio::time::sleep(wait).await;
            ready.call(request).await
        }))
    }
}

#[cfg(test)]
mod pacing_tests {
    use super::*;
    use tower::{Service as _, ServiceExt as _};

    /// A watch ended at once and asked again at once waits for the interval; a watch of another
    /// resource, selectors or encoding, and any other request, does not wait.
    #[tokio::test(start_paused = true)]
    async fn a_watch_begun_again_at_once_waits_for_the_interval() {
        let start = tokio::time::Instant::now();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let seen = calls.clone();
        let inner = tower::service_fn(move |request: http::Request<()>| {
            let seen = seen.clone();
            async move {
                let uri = request.uri().to_string();
                crate::sync::lock(&seen).push((uri, start.elapsed()));
                Ok::<_, std::convert::Infallible>(())
            }
        });
        let mut paced = PaceWatches::new(inner);
        let get = |uri: &str| http::Request::get(uri).body(()).expect("request");
        let pods = "/api/v1/pods?watch=true&timeoutSeconds=290&resourceVersion=";
        for (uri, rv) in [
            (pods, "1"),
            (pods, "2"),
            (pods, "3"),
            ("/api/v1/nodes?watch=true&resourceVersion=", "1"),
            (
                "/api/v1/pods?watch=true&labelSelector=a%3Db&resourceVersion=",
                "1",
            ),
            ("/api/v1/pods?limit=500", ""),
            (pods, "4"),
        ] {
            let mut request = get(&format!("{uri}{rv}"));
            if rv == "4" {
                let protobuf = "application/vnd.kubernetes.protobuf";
                let accept = http::HeaderValue::from_static(protobuf);
                request.headers_mut().insert(http::header::ACCEPT, accept);
            }
            paced
                .ready()
                .await
                .expect("ready")
                .call(request)
                .await
                .expect("called");
        }
        let calls = crate::sync::lock(&calls).clone();
        let at: Vec<Duration> = calls.iter().map(|(_, at)| *at).collect();
        assert_eq!(at[0], Duration::ZERO, "{calls:?}");
        assert_eq!(at[1], WATCH_MIN_INTERVAL, "{calls:?}");
        assert_eq!(at[2], WATCH_MIN_INTERVAL * 2, "{calls:?}");
        assert!(at[3..].iter().all(|t| *t == at[2]), "none waits: {calls:?}");
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// The timer the kernel runs on the TCP socket from local port `local` to port `remote`
    /// (`/proc/net/tcp`'s `tr`: 2 is keepalive) and when it fires, in seconds.
    fn timer(local: u16, remote: u16) -> Option<(u32, f64)> {
        let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
        table.lines().skip(1).find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let port = |address: &str| u16::from_str_radix(address.rsplit(':').next()?, 16).ok();
            if port(fields.get(1)?)? != local || port(fields.get(2)?)? != remote {
                return None;
            }
            let (kind, when) = fields.get(5)?.split_once(':')?;
            // In clock ticks (USER_HZ, 100 a second).
            let when = u64::from_str_radix(when, 16).ok()? as f64 / 100.0;
            Some((u32::from_str_radix(kind, 16).ok()?, when))
        })
    }

    /// A connection the client opened to an API server that read its request and answers
    /// nothing: the kernel probes the peer once it is idle for 30 s (kube's own client sets
    /// no keepalive: no timer at all).
    #[tokio::test]
    async fn the_client_s_connections_probe_an_idle_peer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("address").port();
        let mut config =
            kube::Config::new(format!("http://127.0.0.1:{port}").parse().expect("URL"));
        config.default_retry = false;
        let client = client(config).expect("client");
        let asking = tokio::spawn(async move {
            let request = http::Request::get("/api")
                .body(Vec::new())
                .expect("request");
            let _ = client.request_text(request).await;
        });
        let (mut stream, peer) = listener.accept().await.expect("the client connects");
        let mut head = [0u8; 1024];
        assert!(stream.read(&mut head).await.expect("read") > 0, "a request");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let found = loop {
            // Armed once the request is acknowledged and the connection idle.
            if let Some(found @ (2, _)) = timer(peer.port(), port) {
                break found;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no keepalive timer on the client's socket: {:?}",
                timer(peer.port(), port)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let when = found.1;
        assert!((20.0..=30.0).contains(&when), "probes in {when} s");
        asking.abort();
    }
}
