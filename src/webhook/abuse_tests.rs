//! Bad input over the real HTTPS serving loop (issue 10.6): a table of malformed requests for
//! each endpoint, and misbehaving connections. Each gets a clear answer (a review carrying the
//! uid, or a 4xx with a JSON message) or a closed connection within its bound, and the server
//! keeps serving. Runs in process on loopback with short bounds, so it takes seconds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::runtime::watcher;
use rustls::pki_types::ServerName;
use rustls::pki_types::pem::PemObject;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

use super::testing::state;
use super::{MAX_BODY, endpoints, router};
use crate::certs;
use crate::serving::{self, HEADER_BYTES, Limits, serve};

const TEST_LIMITS: Limits = Limits {
    max_connections: 64,
    handshake_timeout: Duration::from_millis(800),
    header_timeout: Duration::from_millis(800),
    idle_timeout: Duration::from_millis(800),
    max_streams: 8,
    max_age: Duration::from_secs(3),
    send_timeout: Duration::from_secs(3),
    min_send_rate: serving::MIN_SEND_RATE,
};

struct Server {
    addr: std::net::SocketAddr,
    /// `connector`'s configuration.
    config: Arc<rustls::ClientConfig>,
    connector: TlsConnector,
    h2: TlsConnector,
    /// Choosing no protocol in the TLS handshake (ALPN).
    unchosen: TlsConnector,
    /// Like `connector`, without a client certificate.
    anonymous: TlsConnector,
    /// Readiness off ([`serving::Server::draining`]).
    draining: CancellationToken,
    stop: CancellationToken,
}

async fn start() -> Server {
    start_with(None, TEST_LIMITS).await
}

async fn start_with(client_auth: Option<(&str, &str, &str)>, limits: Limits) -> Server {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!(
        "pps-abuse-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    let bundle = certs::generate(&["localhost".into()], None).expect("certs");
    certs::write(&bundle, &dir).expect("write certs");
    let client_ca = client_auth.map(|(ca, _, _)| {
        let path = dir.join("client-ca.crt");
        std::fs::write(&path, ca).expect("write client CA");
        path
    });
    let tls = super::tls::server_config(
        &dir.join("tls.crt"),
        &dir.join("tls.key"),
        client_ca.as_deref(),
        prometheus_client::metrics::gauge::Gauge::default(),
    )
    .expect("tls config");
    let mut state = state(true);
    Arc::get_mut(&mut state).expect("unshared").client_auth = client_auth.is_some();
    let pps = serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
        "metadata": {"name": "web", "namespace": "ns"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                 "preferredPersistentTopology": [{"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}}]},
        "status": {"observedGeneration": 1, "podStates": {"web-0": {"nodeName": "n1",
            "nodeTopologyLabels": {"kubernetes.io/hostname": "n1"}}}}
    }))
    .expect("pps");
    state.caches.apply_pps(watcher::Event::Apply(pps));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (draining, stop) = (CancellationToken::new(), CancellationToken::new());
    tokio::spawn(serve(
        listener,
        serving::Server {
            tls: Some(tokio_rustls::TlsAcceptor::from(tls)),
            app: router(state),
            limits,
            draining: draining.clone(),
            shutdown: stop.clone(),
            drain: Duration::from_secs(1),
        },
    ));
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(bundle.ca_cert.as_bytes()) {
        roots.add(cert.expect("ca")).expect("root");
    }
    let client = |alpn: &[&[u8]], client_auth: Option<(&str, &str, &str)>| {
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots.clone());
        let mut config = match client_auth {
            Some((_, cert, key)) => builder
                .with_client_auth_cert(
                    rustls::pki_types::CertificateDer::pem_slice_iter(cert.as_bytes())
                        .collect::<Result<Vec<_>, _>>()
                        .expect("client cert"),
                    rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes())
                        .expect("client key"),
                )
                .expect("client auth"),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = alpn.iter().map(|protocol| protocol.to_vec()).collect();
        Arc::new(config)
    };
    std::fs::remove_dir_all(&dir).ok();
    let config = client(&[b"http/1.1"], client_auth);
    Server {
        addr,
        connector: TlsConnector::from(config.clone()),
        config,
        h2: TlsConnector::from(client(&[b"h2"], client_auth)),
        unchosen: TlsConnector::from(client(&[], client_auth)),
        anonymous: TlsConnector::from(client(&[b"http/1.1"], None)),
        draining,
        stop,
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default()
}

/// What came back for one exchange.
#[derive(Debug)]
enum Got {
    /// An HTTP answer: status and body.
    Answer(u16, String),
    /// The server closed the connection without an answer.
    Closed,
}

impl Server {
    async fn tls(&self, connector: &TlsConnector) -> tokio_rustls::client::TlsStream<TcpStream> {
        let tcp = TcpStream::connect(self.addr).await.expect("connect");
        connector
            .connect(ServerName::try_from("localhost").expect("name"), tcp)
            .await
            .expect("handshake")
    }

    /// Sends raw bytes over TLS (HTTP/1.1) and reads until the server closes or answers.
    async fn raw(&self, bytes: &[u8]) -> Got {
        let mut stream = self.tls(&self.connector).await;
        // A write may fail if the server already closed (e.g. an oversized body): still read.
        let _ = stream.write_all(bytes).await;
        read_answer(&mut stream).await
    }

    async fn post(&self, path: &str, content_type: &str, body: &[u8]) -> Got {
        let mut request = format!(
            "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        request.extend_from_slice(body);
        self.raw(&request).await
    }
}

async fn read_answer<S: tokio::io::AsyncRead + Unpin>(stream: &mut S) -> Got {
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut buf)).await;
    assert!(
        read.is_ok(),
        "the server neither answered nor closed within 10 s"
    );
    let text = String::from_utf8_lossy(&buf).into_owned();
    let Some(status) = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
    else {
        return Got::Closed;
    };
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Got::Answer(status, body)
}

/// What a case must get.
#[derive(Clone, Copy, Debug)]
enum Want {
    /// HTTP 200 with a review carrying the uid `u-bad`.
    Uid,
    /// This 4xx with a JSON `error` message.
    Error(u16),
    /// HTTP 200 with the uid, or a 4xx with a JSON message (where either is right).
    UidOrError,
}

fn check(path: &str, what: &str, got: &Got, want: Want) {
    let json = |body: &str| -> Option<Value> {
        // Chunked bodies: the JSON document is the line that parses.
        body.lines().find_map(|l| serde_json::from_str(l).ok())
    };
    let has_uid = |body: &str| json(body).is_some_and(|v| v["response"]["uid"] == "u-bad");
    let has_error = |body: &str| json(body).is_some_and(|v| v["error"].is_string());
    let ok = match (want, got) {
        (Want::Uid, Got::Answer(200, body)) => has_uid(body),
        (Want::Error(code), Got::Answer(status, body)) => *status == code && has_error(body),
        (Want::UidOrError, Got::Answer(200, body)) => has_uid(body),
        (Want::UidOrError, Got::Answer(status, body)) => {
            (400..500).contains(status) && has_error(body)
        }
        _ => false,
    };
    assert!(ok, "{path} {what}: wanted {want:?}, got {got:?}");
}

fn review(request: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}))
        .expect("json")
}

fn pod_request(overrides: Value) -> Value {
    let mut request = json!({
        "uid": "u-bad", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "operation": "CREATE", "userInfo": {}, "namespace": "ns", "name": "web-0",
        "object": {"metadata": {"name": "web-0", "ownerReferences": [{"apiVersion": "apps/v1",
            "kind": "StatefulSet", "name": "web", "uid": "x", "controller": true}]},
            "spec": {"containers": [{"name": "c"}]}}
    });
    for (k, v) in overrides.as_object().into_iter().flatten() {
        request[k] = v.clone();
    }
    request
}

/// The malformed bodies, each with what it must get from an admission endpoint.
fn bodies() -> Vec<(&'static str, Vec<u8>, Want)> {
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n)).into_bytes();
    let mut huge = review(pod_request(json!({})));
    huge.splice(
        1..1,
        format!("\"pad\":\"{}\",", "x".repeat(MAX_BODY)).into_bytes(),
    );
    let mut deep_object = br#"{"request":{"uid":"u-bad","kind":{"group":"","version":"v1","kind":"Pod"},"operation":"CREATE","object":"#.to_vec();
    deep_object.extend(deep(5000));
    deep_object.extend(b"}}");
    // Trees of tiny maps of nearly 3 MiB: hundreds of MB if built as `Value`s.
    let tree = |n: usize| Value::Array(vec![json!({"": 0}); n]);
    let tiny_maps = 2_800_000 / 7;
    let mut bad_utf8 = br#"{"request":{"uid":"u-bad","name":""#.to_vec();
    bad_utf8.extend([0xff, 0xfe]);
    bad_utf8.extend(br#""}}"#);
    vec![
        ("empty body", Vec::new(), Want::Error(400)),
        ("not JSON", b"hello".to_vec(), Want::Error(400)),
        ("truncated JSON, the uid read", br#"{"apiVersion":"admission.k8s.io/v1","request":{"uid":"u-bad""#.to_vec(), Want::Uid),
        ("truncated JSON, within the uid", br#"{"apiVersion":"admission.k8s.io/v1","request":{"uid":"u-b"#.to_vec(), Want::Error(400)),
        ("a JSON array", b"[]".to_vec(), Want::Error(400)),
        ("a JSON number", b"42".to_vec(), Want::Error(400)),
        ("a JSON string", br#""review""#.to_vec(), Want::Error(400)),
        ("JSON null", b"null".to_vec(), Want::Error(400)),
        ("an empty object", b"{}".to_vec(), Want::Error(400)),
        ("a null request", br#"{"request":null}"#.to_vec(), Want::Error(400)),
        ("no uid", br#"{"request":{}}"#.to_vec(), Want::Error(400)),
        ("a numeric uid", br#"{"request":{"uid":7}}"#.to_vec(), Want::Error(400)),
        ("an empty uid", br#"{"request":{"uid":""}}"#.to_vec(), Want::Error(400)),
        ("deep nesting", deep(100_000), Want::Error(400)),
        ("deep nesting in the object", deep_object, Want::UidOrError),
        ("invalid UTF-8", bad_utf8, Want::UidOrError),
        ("over 3 MiB", huge, Want::Error(413)),
        ("an apiVersion out of range before the uid", br#"{"apiVersion":1e400,"request":{"uid":"u-bad","kind":{"group":"","version":"v1","kind":"Pod"},"operation":"CREATE","object":{}}}"#.to_vec(), Want::Uid),
        ("a lone surrogate in the apiVersion", br#"{"apiVersion":"\ud800","request":{"uid":"u-bad","operation":"CREATE","object":{}}}"#.to_vec(), Want::Uid),
        ("a lone surrogate in a key before the uid", br#"{"request":{"\udead":0,"uid":"u-bad","operation":"CREATE","object":{}}}"#.to_vec(), Want::Uid),
        ("an escaped uid key after a bad key", br#"{"\udead":1,"request":{"\u0075id":"u-bad","operation":"CREATE","object":{}}}"#.to_vec(), Want::Uid),
        ("trailing garbage", [review(pod_request(json!({}))), b"garbage".to_vec()].concat(), Want::Uid),
        ("wrong review kind", serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "Pod", "request": pod_request(json!({}))})).expect("json"), Want::Uid),
        ("unknown apiVersion", serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v9", "request": pod_request(json!({}))})).expect("json"), Want::Uid),
        ("unknown operation", review(pod_request(json!({"operation": "TELEPORT"}))), Want::Uid),
        ("null resource", review(pod_request(json!({"resource": null}))), Want::Uid),
        ("null kind", review(pod_request(json!({"kind": null}))), Want::Uid),
        ("kind of the wrong type", review(pod_request(json!({"kind": "Pod"}))), Want::Uid),
        ("object not a pod", review(pod_request(json!({"object": [1, 2, 3]}))), Want::Uid),
        ("object a string", review(pod_request(json!({"object": "pod"}))), Want::Uid),
        ("object with a wrong field type", review(pod_request(json!({"object": {"metadata": {"name": 5}}}))), Want::Uid),
        ("no object", review(pod_request(json!({"object": null}))), Want::Uid),
        ("dryRun not a boolean", review(pod_request(json!({"dryRun": "yes"}))), Want::Uid),
        ("a huge name", review(pod_request(json!({"name": "n".repeat(100_000)}))), Want::Uid),
        ("many unknown fields", review(pod_request(json!({"x1": [1], "x2": {"a": null}, "x3": "y"}))), Want::Uid),
        ("a tree in the uid", review(pod_request(json!({"uid": tree(tiny_maps)}))), Want::Error(400)),
        ("a tree in the kind", review(pod_request(json!({"kind": tree(tiny_maps)}))), Want::Uid),
        ("a tree in the operation", review(pod_request(json!({"operation": tree(tiny_maps)}))), Want::Uid),
        ("a tree in the object", review(pod_request(json!({"object": {"metadata": {"name": "web-0"}, "spec": tree(tiny_maps)}}))), Want::Uid),
        ("huge tolerations", review(pod_request(json!({"object": {"metadata": {"name": "web-0"},
            "spec": {"tolerations": vec![json!({}); 900_000]}}}))), Want::Uid),
        ("hundreds of thousands of objects to convert", serde_json::to_vec(&json!({"request": {"uid": "u-bad",
            "desiredAPIVersion": "apps.kruise.io/v1beta1", "objects": vec![json!({}); 900_000]}})).expect("json"), Want::Uid),
    ]
}

#[tokio::test]
async fn malformed_requests_get_clear_answers_and_the_server_keeps_serving() {
    let server = start().await;
    let good = review(pod_request(json!({})));
    let paths = [
        endpoints::MUTATE_POD,
        endpoints::VALIDATE_PPS,
        endpoints::CONVERT,
    ];
    let mut cases = 0;
    for path in paths {
        for (what, body, want) in bodies() {
            // Conversion reviews have another shape: what admission reads as a request with a
            // uid is a conversion request with a uid and no desired version (a failure).
            let want = match (path, what, want) {
                (p, _, Want::Uid) if p == endpoints::CONVERT => Want::Uid,
                // A conversion may be a whole list, bound by a limit of its own: read.
                (p, "over 3 MiB", _) if p == endpoints::CONVERT => Want::Uid,
                (_, _, w) => w,
            };
            let got = server.post(path, "application/json", &body).await;
            if path == endpoints::CONVERT && matches!(want, Want::Uid) {
                let answered =
                    matches!(&got, Got::Answer(200, b) if b.contains("\"uid\":\"u-bad\""));
                assert!(answered, "{path} {what}: {got:?}");
            } else {
                check(path, what, &got, want);
            }
            cases += 1;
        }
        for (what, got, want) in [
            ("wrong content type", server.post(path, "text/plain", &good).await, Want::Error(415)),
            ("no content type", server.raw(format!("POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}").as_bytes()).await, Want::Error(415)),
            ("GET", server.raw(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes()).await, Want::Error(405)),
            ("PUT", server.raw(format!("PUT {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").as_bytes()).await, Want::Error(405)),
            // Heads hyper itself refuses: its own 400, given the JSON message every refusal has.
            ("a header line with no colon", server.raw(format!("POST {path} HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n").as_bytes()).await, Want::Error(400)),
            ("a malformed method", server.raw(format!("P@ST {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes()).await, Want::Error(400)),
            ("an unknown HTTP version", server.raw(format!("POST {path} HTTP/7.1\r\nhost: x\r\n\r\n").as_bytes()).await, Want::Error(400)),
            ("a content-length that is no number", server.raw(format!("POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: two\r\n\r\n{{}}").as_bytes()).await, Want::Error(400)),
            ("an HTTP/1.0 head with a bad header", server.raw(format!("POST {path} HTTP/1.0\r\nbad\x01name: x\r\n\r\n").as_bytes()).await, Want::Error(400)),
        ] {
            check(path, what, &got, want);
            cases += 1;
        }
        if path == endpoints::CONVERT {
            let mut over = review(pod_request(json!({})));
            over.splice(
                1..1,
                format!("\"pad\":\"{}\",", "x".repeat(super::MAX_CONVERT_BODY)).into_bytes(),
            );
            let got = server.post(path, "application/json", &over).await;
            check(path, "over its own limit", &got, Want::Error(413));
            cases += 1;
        }
        // The real thing still works.
        let got = server.post(path, "application/json", &good).await;
        assert!(
            matches!(got, Got::Answer(200, _)),
            "{path} after abuse: {got:?}"
        );
    }
    check(
        "/nowhere",
        "unknown path",
        &server.post("/nowhere", "application/json", &good).await,
        Want::Error(404),
    );
    println!(
        "{cases} malformed requests over HTTPS, each answered clearly; the server kept serving"
    );
    assert!(cases >= 3 * 30);
    server.stop.cancel();
}

#[tokio::test]
async fn misbehaving_connections_are_closed_within_their_bounds() {
    let server = start().await;
    let bound = TEST_LIMITS.idle_timeout + Duration::from_secs(2);
    let closed_within = |start: Instant, what: &str, got: &Got| {
        assert!(
            matches!(got, Got::Closed) || matches!(got, Got::Answer(status, _) if *status >= 400),
            "{what}: {got:?}"
        );
        assert!(
            start.elapsed() < bound,
            "{what}: closed after {:?}",
            start.elapsed()
        );
    };

    // Plain HTTP on the TLS port: the handshake fails, the connection is closed.
    let start = Instant::now();
    let mut tcp = TcpStream::connect(server.addr).await.expect("connect");
    tcp.write_all(b"POST /mutate-pod HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    closed_within(start, "plain HTTP", &read_answer(&mut tcp).await);

    // A TCP connection that never starts the handshake.
    let start = Instant::now();
    let mut tcp = TcpStream::connect(server.addr).await.expect("connect");
    closed_within(start, "no handshake", &read_answer(&mut tcp).await);

    // Idle after the handshake.
    let start = Instant::now();
    let mut idle = server.tls(&server.connector).await;
    closed_within(
        start,
        "idle after the handshake",
        &read_answer(&mut idle).await,
    );

    // Headers sent slowly: a byte every 300 ms keeps the connection active but never ends.
    let start = Instant::now();
    let mut slow = server.tls(&server.connector).await;
    let trickle = async {
        for b in b"POST /mutate-pod HTTP/1.1\r\nhost: localhost\r\nx-slow: "
            .iter()
            .chain(std::iter::repeat(&b'a'))
        {
            if slow.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            if start.elapsed() > bound {
                break;
            }
        }
    };
    trickle.await;
    closed_within(start, "slow headers", &read_answer(&mut slow).await);

    // HTTP/2 negotiated, then a preface that stops half-way.
    let start = Instant::now();
    let mut h2 = server.tls(&server.h2).await;
    h2.write_all(b"PRI * HTTP/2.0\r\n").await.expect("write");
    closed_within(start, "stalled HTTP/2 preface", &read_answer(&mut h2).await);

    // A body that stops arriving.
    let start = Instant::now();
    let mut partial = server.tls(&server.connector).await;
    partial
        .write_all(b"POST /mutate-pod HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"request\":")
        .await
        .expect("write");
    closed_within(start, "stalled body", &read_answer(&mut partial).await);

    // Still serving.
    let got = server
        .post(
            endpoints::MUTATE_POD,
            "application/json",
            &review(pod_request(json!({}))),
        )
        .await;
    assert!(matches!(got, Got::Answer(200, _)), "{got:?}");
    server.stop.cancel();
}

#[tokio::test]
async fn a_request_head_over_its_bound_is_refused_before_it_is_handled() {
    let server = start().await;
    let body = review(pod_request(json!({})));
    let head = |extra: usize| {
        let mut request = format!(
            "POST {} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\nx-pad: {}\r\n\r\n",
            endpoints::MUTATE_POD,
            body.len(),
            "a".repeat(extra)
        )
        .into_bytes();
        request.extend_from_slice(&body);
        request
    };
    // Within the bound: answered.
    let got = server.raw(&head(HEADER_BYTES / 2)).await;
    assert!(matches!(got, Got::Answer(200, _)), "{got:?}");
    // Over twice it (hyper alone would hold about 400 KiB of head per connection): never
    // handled.
    let over = 2 * HEADER_BYTES + (16 << 10);
    let got = server.raw(&head(over)).await;
    // Closed under the bytes still arriving (the client's read may then fail), or answered
    // with a JSON message.
    if let Got::Answer(..) = got {
        check(
            "a head",
            &format!("of {over} bytes"),
            &got,
            Want::Error(431),
        );
    }
    server.stop.cancel();
}

#[tokio::test]
async fn with_a_client_ca_admission_needs_a_verified_client_certificate() {
    let (ca, cert, key) = super::tls::tests::client_identity();
    let body = review(pod_request(json!({})));
    let with = start_with(Some((&ca, &cert, &key)), TEST_LIMITS).await;
    let got = with
        .post(endpoints::MUTATE_POD, "application/json", &body)
        .await;
    assert!(
        matches!(got, Got::Answer(200, _)),
        "verified client: {got:?}"
    );

    // The same server, reached without a client certificate.
    let anonymous = Server {
        connector: with.anonymous.clone(),
        ..with
    };
    let got = anonymous
        .post(endpoints::MUTATE_POD, "application/json", &body)
        .await;
    check(
        endpoints::MUTATE_POD,
        "no client certificate",
        &got,
        Want::Error(403),
    );
    // Refused before its body is read as a review: an unauthenticated client learns nothing
    // from what it sends (not even that it was malformed, or of the wrong type).
    for path in [endpoints::MUTATE_POD, endpoints::VALIDATE_PPS] {
        for (content_type, sent) in [
            ("application/json", &b"{not json"[..]),
            ("text/plain", &body[..]),
        ] {
            let got = anonymous.post(path, content_type, sent).await;
            check(
                path,
                "no client certificate, bad body",
                &got,
                Want::Error(403),
            );
        }
    }
    let conversion = serde_json::to_vec(&json!({"request": {"uid": "c", "desiredAPIVersion": "apps.kruise.io/v1beta1", "objects": []}}))
        .expect("json");
    let got = anonymous
        .post(endpoints::CONVERT, "application/json", &conversion)
        .await;
    assert!(
        matches!(got, Got::Answer(200, _)),
        "conversion stays open: {got:?}"
    );
    anonymous.stop.cancel();
}

#[tokio::test]
async fn the_plain_probe_port_caps_connections_and_closes_idle_ones() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = CancellationToken::new();
    let limits = Limits {
        max_connections: 2,
        ..TEST_LIMITS
    };
    let app = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
    tokio::spawn(serve(
        listener,
        serving::Server {
            tls: None,
            app,
            limits,
            draining: CancellationToken::new(),
            shutdown: stop.clone(),
            drain: Duration::from_secs(1),
        },
    ));
    let get = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n";

    // Two connections, each answered once and then left open (keep-alive), the first idle
    // the longest.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut tcp = TcpStream::connect(addr).await.expect("connect");
        tcp.write_all(get).await.expect("write");
        let mut buf = [0u8; 256];
        let n = tcp.read(&mut buf).await.expect("read");
        assert!(
            String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"),
            "answered"
        );
        held.push((tcp, Instant::now()));
    }
    // A third, at the cap, makes room: the connection idle the longest is closed, and the
    // third is answered.
    let mut third = TcpStream::connect(addr).await.expect("connect");
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    assert!(
        matches!(read_answer(&mut third).await, Got::Answer(200, _)),
        "answered at the cap"
    );
    let (mut first, _) = held.remove(0);
    assert!(
        matches!(read_answer(&mut first).await, Got::Closed),
        "the most idle made room"
    );
    // The other idle keep-alive connection is closed within the idle bound.
    let bound = TEST_LIMITS.idle_timeout + Duration::from_secs(2);
    for (mut tcp, since) in held {
        assert!(matches!(read_answer(&mut tcp).await, Got::Closed), "idle");
        assert!(
            since.elapsed() < bound,
            "closed after {:?}",
            since.elapsed()
        );
    }
    stop.cancel();
}

#[tokio::test]
async fn requests_over_the_in_flight_limit_are_refused_at_once_and_slow_ones_time_out() {
    use crate::serving::{RequestLimit, limit_requests};
    use tower::ServiceExt;
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
    let entered = Arc::new(std::sync::Mutex::new(Some(entered_tx)));
    let app = axum::Router::new()
        .route(
            "/slow",
            axum::routing::post(move || {
                let entered = entered.clone();
                async move {
                    if let Some(tx) = entered.lock().ok().and_then(|mut e| e.take()) {
                        let _ = tx.send(());
                    }
                    std::future::pending::<&str>().await
                }
            }),
        )
        .layer(axum::middleware::from_fn_with_state(
            RequestLimit::new(
                crate::serving::Budget {
                    in_flight: 1,
                    bytes: 8 << 20,
                    pruned: &[],
                    held_per_byte: 0,
                },
                Duration::from_millis(500),
                super::MAX_BODY,
                None,
            ),
            limit_requests,
        ));
    let request = || {
        axum::http::Request::post("/slow")
            .body(axum::body::Body::empty())
            .expect("request")
    };
    // The first request holds the only slot (its handler never finishes).
    let first = tokio::spawn(app.clone().oneshot(request()));
    entered_rx
        .await
        .expect("the first request is in its handler");
    // The second is refused while the first still holds the slot: not queued behind it. Its
    // body (1 MiB, in chunks) is read to the end first, so that a client still sending gets
    // the answer rather than a reset connection.
    let drained = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = drained.clone();
    let chunks = futures::StreamExt::chain(
        futures::stream::iter(
            (0..64)
                .map(|_| Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b'x'; 16 * 1024]))),
        ),
        futures::stream::poll_fn(move |_| {
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
            std::task::Poll::Ready(None)
        }),
    );
    let big = axum::http::Request::post("/slow")
        .body(axum::body::Body::from_stream(chunks))
        .expect("request");
    let refused = app.clone().oneshot(big).await.expect("infallible");
    assert!(!first.is_finished(), "refused before the first one ended");
    assert!(
        drained.load(std::sync::atomic::Ordering::SeqCst),
        "the refused request's body was read to its end"
    );
    unavailable_saying(refused, "in flight").await;
    // The first is answered when its time is up.
    let timed_out = first.await.expect("task").expect("infallible");
    unavailable_saying(timed_out, "timed out").await;
    // Its slot was given back: the next request is handled (and times out in turn).
    let next = app.clone().oneshot(request()).await.expect("infallible");
    unavailable_saying(next, "timed out").await;
}

/// Checks that `response` is a 503 whose JSON `error` mentions `what`.
async fn unavailable_saying(response: axum::response::Response, what: &str) {
    assert_eq!(
        response.status(),
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    );
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .expect("body");
    let json: Value = serde_json::from_slice(&body).expect("a JSON message");
    assert!(
        json["error"].as_str().is_some_and(|e| e.contains(what)),
        "{json}"
    );
}

/// Reads one HTTP/1 response with a `content-length` body; `None` once the server closed.
async fn read_response<S: tokio::io::AsyncRead + Unpin>(stream: &mut S) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse::<usize>().ok())?
            });
            if length.is_some_and(|n| body.len() >= n) {
                return Some(head.to_owned());
            }
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A pod review as one kept-alive HTTP/1.1 request.
fn keep_alive_review() -> Vec<u8> {
    let body = review(pod_request(json!({})));
    let mut request = format!(
        "POST {} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        endpoints::MUTATE_POD,
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    request
}

/// Sends a kept-alive pod review on `stream`; the head of its answer, `None` if the server
/// closed the connection instead.
async fn send_review<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
) -> Option<String> {
    stream.write_all(&keep_alive_review()).await.ok()?;
    read_response(stream).await
}

/// Sends a kept-alive review on `stream` (`which` names it in failures): it is answered 200,
/// saying `connection: close`, and the server then ends the connection within `within`.
async fn closes_with_its_answer<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    within: Duration,
    which: &str,
) {
    let head = send_review(stream).await;
    assert!(
        head.as_deref()
            .is_some_and(|h| h.starts_with("HTTP/1.1 200")
                && h.to_ascii_lowercase().contains("connection: close")),
        "{which}: answered, saying the connection closes: {head:?}"
    );
    let mut rest = Vec::new();
    let read = tokio::time::timeout(within, stream.read_to_end(&mut rest)).await;
    assert!(
        matches!(read, Ok(Ok(0))),
        "{which}: closed after that answer: {read:?}"
    );
}

/// A server with `limits`, and a connection to it kept alive after one review was answered
/// 200 (the answer's head).
async fn one_review_answered(
    limits: Limits,
) -> (Server, tokio_rustls::client::TlsStream<TcpStream>, String) {
    let server = start_with(None, limits).await;
    let mut stream = server.tls(&server.connector).await;
    let head = send_review(&mut stream).await.expect("first answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    (server, stream, head)
}

#[tokio::test]
async fn an_idle_keep_alive_connection_outlasts_the_header_deadline_and_serves_the_next_review() {
    // The API server keeps a webhook's idle connection for 90 s and sends its next review on
    // it without knowing whether this side is closing it.
    let limits = Limits {
        header_timeout: Duration::from_millis(200),
        idle_timeout: Duration::from_secs(5),
        ..TEST_LIMITS
    };
    let (server, mut stream, _) = one_review_answered(limits).await;
    // Idle for five header deadlines, within the idle bound.
    tokio::time::sleep(limits.header_timeout * 5).await;
    let head = send_review(&mut stream).await;
    assert!(
        head.as_deref()
            .is_some_and(|h| h.starts_with("HTTP/1.1 200")),
        "the kept-alive connection serves the next review: {head:?}"
    );
    // Its header deadline still holds once a request starts: headers that stop half-way.
    let start = Instant::now();
    stream
        .write_all(b"POST /mutate-pod HTTP/1.1\r\nhost: loc")
        .await
        .expect("half a request");
    assert!(matches!(read_answer(&mut stream).await, Got::Closed));
    assert!(
        start.elapsed() < limits.idle_timeout,
        "closed by the header deadline, not the idle bound: {:?}",
        start.elapsed()
    );
    server.stop.cancel();
}

#[tokio::test]
async fn a_request_head_sent_with_the_handshake_s_last_flight_is_held_to_the_header_deadline() {
    // The client's Finished and half a request head arrive in one segment: the server reads the
    // head's bytes from the socket within its handshake, before the connection awaits a request.
    let limits = Limits {
        header_timeout: Duration::from_millis(200),
        idle_timeout: Duration::from_secs(5),
        ..TEST_LIMITS
    };
    let server = start_with(None, limits).await;
    let (addr, config) = (server.addr, server.config.clone());
    let closed_after = tokio::task::spawn_blocking(move || {
        use std::io::{Read as _, Write as _};
        let mut socket = std::net::TcpStream::connect(addr).expect("connect");
        socket
            .set_read_timeout(Some(limits.idle_timeout * 4))
            .expect("read timeout");
        let name = ServerName::try_from("localhost").expect("name");
        let mut tls = rustls::ClientConnection::new(config, name).expect("client");
        while tls.is_handshaking() {
            if tls.wants_write() {
                tls.write_tls(&mut socket).expect("the client's hello");
            } else {
                tls.read_tls(&mut socket).expect("the server's flight");
                tls.process_new_packets().expect("the server's flight");
            }
        }
        tls.writer()
            .write_all(b"POST /mutate-pod HTTP/1.1\r\nhost: loc")
            .expect("half a head");
        let mut flight = Vec::new();
        while tls.wants_write() {
            tls.write_tls(&mut flight).expect("the last flight");
        }
        let start = Instant::now();
        socket.write_all(&flight).expect("one write");
        let mut buf = [0u8; 4096];
        while matches!(socket.read(&mut buf), Ok(1..)) {}
        start.elapsed()
    })
    .await
    .expect("the client");
    assert!(
        closed_after < limits.idle_timeout,
        "closed by the header deadline, not the idle bound: {closed_after:?}"
    );
    server.stop.cancel();
}

#[tokio::test]
async fn a_fresh_connection_left_unused_past_the_header_deadline_serves_its_first_review() {
    // The API server's HTTP/1 client dials a connection for a call that another connection
    // then serves, keeps the new one idle, and sends a later review on it; that call is not
    // retried if this side closed the connection meanwhile (seen at 16 concurrent creates).
    let limits = Limits {
        header_timeout: Duration::from_millis(200),
        idle_timeout: Duration::from_secs(2),
        ..TEST_LIMITS
    };
    let server = start_with(None, limits).await;
    let mut fresh = server.tls(&server.connector).await;
    // Unused for five header deadlines, within the idle bound.
    tokio::time::sleep(limits.header_timeout * 5).await;
    let head = send_review(&mut fresh).await;
    assert!(
        head.as_deref()
            .is_some_and(|h| h.starts_with("HTTP/1.1 200")),
        "the fresh connection serves its first review: {head:?}"
    );
    // A connection that never sends anything is still closed, by the idle bound.
    let start = Instant::now();
    let mut silent = server.tls(&server.connector).await;
    assert!(matches!(read_answer(&mut silent).await, Got::Closed));
    assert!(
        start.elapsed() >= limits.idle_timeout,
        "closed by the idle bound: {:?}",
        start.elapsed()
    );
    server.stop.cancel();
}

#[tokio::test]
async fn an_idle_keep_alive_connection_past_its_maximum_age_closes_with_its_next_answer() {
    let limits = Limits {
        header_timeout: Duration::from_millis(200),
        idle_timeout: Duration::from_secs(5),
        max_age: Duration::from_millis(500),
        ..TEST_LIMITS
    };
    let (server, mut stream, head) = one_review_answered(limits).await;
    assert!(!head.contains("connection: close"), "{head}");
    // Idle past its maximum age, within the idle bound: still open, and the next review is
    // answered with `connection: close`, after which the server ends the connection.
    tokio::time::sleep(limits.max_age * 2).await;
    closes_with_its_answer(&mut stream, limits.idle_timeout, "past its maximum age").await;
    server.stop.cancel();
}

#[tokio::test]
async fn once_readiness_is_off_a_kept_alive_connection_closes_with_its_next_answer() {
    // During the shutdown delay the API server still sends reviews on the connections it
    // keeps. Each is answered and then closed, so that the next review goes, through the
    // Service, to a replica that stays, instead of meeting this one's close at the shutdown.
    let limits = Limits {
        idle_timeout: Duration::from_secs(5),
        ..TEST_LIMITS
    };
    let (server, mut kept, head) = one_review_answered(limits).await;
    assert!(
        !head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    server.draining.cancel();
    // A connection opened while readiness is off is served the same way.
    let mut opened = server.tls(&server.connector).await;
    for (which, stream) in [("kept alive", &mut kept), ("opened since", &mut opened)] {
        closes_with_its_answer(stream, limits.idle_timeout, which).await;
    }
    server.stop.cancel();
}

#[tokio::test]
async fn a_busy_keep_alive_connection_is_closed_at_its_maximum_age() {
    let server = start().await;
    let request = keep_alive_review();
    let start = Instant::now();
    let mut stream = server.tls(&server.connector).await;
    let mut answered = 0;
    // Never idle: a request every 100 ms, until the server ends the connection.
    loop {
        if stream.write_all(&request).await.is_err() {
            break;
        }
        match read_response(&mut stream).await {
            Some(head) if head.starts_with("HTTP/1.1 200") => answered += 1,
            _ => break,
        }
        assert!(
            start.elapsed() < TEST_LIMITS.max_age + Duration::from_secs(5),
            "still open after {:?} ({answered} answers)",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        start.elapsed() >= TEST_LIMITS.max_age,
        "closed only at its age"
    );
    assert!(answered >= 10, "it was busy all along: {answered} answers");
    server.stop.cancel();
}

/// A POST to `path` whose body sends its first bytes (calling `started` as they are read), then
/// nothing more.
fn stalled_upload(
    path: &str,
    started: impl FnOnce() + Send + 'static,
) -> axum::http::Request<axum::body::Body> {
    let first = futures::stream::once(async move {
        started();
        Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"{\"request\":"))
    });
    let body =
        axum::body::Body::from_stream(futures::StreamExt::chain(first, futures::stream::pending()));
    axum::http::Request::post(path)
        .header("content-type", "application/json")
        .body(body)
        .expect("request")
}

#[tokio::test(start_paused = true)]
async fn with_a_client_ca_an_upload_without_a_certificate_is_refused_before_its_body_is_read() {
    use tower::ServiceExt;
    let mut state = super::testing::state(true);
    Arc::get_mut(&mut state).expect("unshared").client_auth = true;
    let app = super::router(state);
    for path in [endpoints::MUTATE_POD, endpoints::VALIDATE_PPS] {
        // Its first bytes, then nothing more: never waited for to the body deadline.
        let request = stalled_upload(path, || {});
        let started = tokio::time::Instant::now();
        let response = app.clone().oneshot(request).await.expect("infallible");
        assert_eq!(
            response.status(),
            axum::http::StatusCode::FORBIDDEN,
            "{path}"
        );
        assert!(
            started.elapsed() < super::REQUEST_TIMEOUT,
            "{path}: {:?}",
            started.elapsed()
        );
    }
}

#[tokio::test]
async fn a_request_to_no_route_is_read_before_it_is_answered() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower::ServiceExt;
    let app = super::router(super::testing::state(true));
    for (method, path, status) in [
        ("POST", "/nowhere", axum::http::StatusCode::NOT_FOUND),
        (
            "PUT",
            endpoints::MUTATE_POD,
            axum::http::StatusCode::METHOD_NOT_ALLOWED,
        ),
    ] {
        let read = Arc::new(AtomicUsize::new(0));
        let counted = read.clone();
        let chunks = futures::StreamExt::map(futures::stream::iter(0..16), move |_| {
            counted.fetch_add(1, Ordering::Relaxed);
            Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b' '; 16 << 10]))
        });
        let request = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json")
            .body(axum::body::Body::from_stream(chunks))
            .expect("request");
        let response = app.clone().oneshot(request).await.expect("infallible");
        assert_eq!(response.status(), status, "{method} {path}");
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("body");
        let answer: Value = serde_json::from_slice(&bytes).expect("a JSON message");
        assert!(answer["error"].is_string(), "{answer}");
        assert_eq!(
            read.load(Ordering::Relaxed),
            16,
            "{method} {path}: the whole body read"
        );
    }
}

#[tokio::test]
async fn uploads_stalled_on_other_endpoints_never_shed_pod_reviews() {
    use tower::ServiceExt;
    let state = super::testing::state(true);
    let app = super::router(state);
    // 24 conversions and 24 validations whose bodies stop arriving after their first bytes;
    // each says when the server has started reading it.
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut held = Vec::new();
    for path in [endpoints::CONVERT, endpoints::VALIDATE_PPS] {
        for _ in 0..24 {
            let tx = started_tx.clone();
            let request = stalled_upload(path, move || {
                let _ = tx.send(());
            });
            held.push(tokio::spawn(app.clone().oneshot(request)));
        }
    }
    for _ in 0..48 {
        started
            .recv()
            .await
            .expect("a stalled upload is being read");
    }
    // Pod reviews are each answered, with their uid.
    for i in 0..10 {
        let uid = format!("u-{i}");
        let body = review(pod_request(json!({"uid": uid})));
        let request = axum::http::Request::post(endpoints::MUTATE_POD)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body))
            .expect("request");
        let response = app.clone().oneshot(request).await.expect("infallible");
        assert_eq!(response.status(), axum::http::StatusCode::OK, "review {i}");
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("body");
        let answer: Value = serde_json::from_slice(&bytes).expect("JSON");
        assert_eq!(answer["response"]["uid"], uid.as_str());
    }
    for h in &held {
        assert!(!h.is_finished(), "the stalled uploads are still being read");
    }
    for h in held {
        h.abort();
    }
}

#[test]
fn json_values_counts_every_value_without_decoding() {
    let cases: [(&str, usize); 8] = [
        ("", 0),
        ("0", 1),
        (r#"{"a":1,"b":[true,null,"x"]}"#, 8),
        (r#"[{"":0},{"":0}]"#, 7),
        (r#""a \" [ { , still a string""#, 1),
        (" [ 1 , -2.5e3 ,\n\"\\\\\" ] ", 4),
        ("[[[]]]", 3),
        (r#"{"k":{}}"#, 3),
    ];
    for (text, want) in cases {
        assert_eq!(crate::serving::json_values(text.as_bytes()), want, "{text}");
    }
}

/// The byte-by-byte count `json_values` replaced (it jumps over strings with memchr): both
/// count alike on any input, JSON or not.
fn json_values_byte_by_byte(body: &[u8]) -> usize {
    let (mut values, mut in_string, mut escaped, mut in_scalar) = (0usize, false, false, false);
    for &b in body {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => {
                in_string = true;
                in_scalar = false;
                values += 1;
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

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
    #[test]
    fn json_values_counts_as_the_byte_by_byte_scan(
        body in proptest::collection::vec(proptest::sample::select(
            b"\"\\{}[],: \nab1-x".to_vec()), 0..200),
    ) {
        proptest::prop_assert_eq!(
            crate::serving::json_values(&body),
            json_values_byte_by_byte(&body)
        );
    }
}

/// The server stops reading such a body part-way and answers; the answer must reach the client
/// before the stream ends (hyper then declines the rest of the upload with RST_STREAM(NO_ERROR),
/// as RFC 9113 section 8.1 allows). curl 7.88 reports this exchange as "Stream error in the
/// HTTP/2 framing layer" without printing the answer: its own handling of an early answer.
#[tokio::test]
async fn a_body_far_over_the_limit_sent_over_http2_gets_the_json_413() {
    let server = start().await;
    let tls = server.tls(&server.h2).await;
    let (mut client, connection) = h2::client::handshake(tls).await.expect("h2 handshake");
    tokio::spawn(connection);
    // Twice the limit and more: the server stops reading it part-way.
    let body = vec![b'a'; 2 * MAX_BODY + 1_000_000];
    let request = axum::http::Request::post(format!("https://localhost{}", endpoints::MUTATE_POD))
        .header("content-type", "application/json")
        .header("content-length", body.len())
        .body(())
        .expect("request");
    let (response, mut upload) = client.send_request(request, false).expect("send");
    // Buffered by the client and sent as the server's windows allow: the server ends the
    // stream before all of it is sent (`upload` lives on, so the client does not reset it).
    upload
        .send_data(body.into(), true)
        .expect("the body queued");
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("an answer within 10 s")
        .expect("an answer, not a reset stream");
    assert_eq!(response.status(), 413);
    let mut body = response.into_body();
    let mut text = Vec::new();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(10), body.data())
        .await
        .expect("the answer's body within 10 s")
    {
        text.extend_from_slice(&chunk.expect("the answer's body, not a reset stream"));
    }
    let json: Value = serde_json::from_slice(&text).expect("a JSON answer");
    assert!(json["error"].is_string(), "{json}");
    server.stop.cancel();
}

/// HTTP/2 frame types the tests below read and send.
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;

/// Bounds none of which a test's few seconds reach: what closes a connection there is the
/// server's own doing.
const NO_EARLY_BOUND: Limits = Limits {
    header_timeout: Duration::from_secs(10),
    idle_timeout: Duration::from_secs(10),
    max_age: Duration::from_secs(60),
    ..TEST_LIMITS
};

/// One HTTP/2 frame: type, flags, stream, payload.
type Frame = (u8, u8, u32, Vec<u8>);

/// A hand-made HTTP/2 client over `stream`, to control what it sends and when and to see each
/// frame the server sends. It sends the client preface and empty settings, and acknowledges
/// the server's settings and (unless told not to) pings as it reads, as a client holding a
/// connection does.
struct RawH2<S> {
    stream: S,
    read: Vec<u8>,
    acks_pings: bool,
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> RawH2<S> {
    async fn open(mut stream: S) -> Self {
        stream
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .expect("preface");
        let mut raw = Self {
            stream,
            read: Vec::new(),
            acks_pings: true,
        };
        raw.send(SETTINGS, 0, 0, &[]).await;
        raw
    }

    async fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let length = u32::try_from(payload.len())
            .expect("a small frame")
            .to_be_bytes();
        let mut frame = vec![length[1], length[2], length[3], kind, flags];
        frame.extend_from_slice(&stream.to_be_bytes());
        frame.extend_from_slice(payload);
        // The server may have closed its side already.
        let _ = self.stream.write_all(&frame).await;
    }

    /// A POST of a pod review's headers on stream 1, literal fields only (RFC 7541).
    async fn send_review_headers(&mut self) {
        let mut block = vec![0x83, 0x87]; // :method POST, :scheme https (static table)
        for (name_index, value) in [
            (0x04, endpoints::MUTATE_POD), // :path
            (0x01, "localhost"),           // :authority
            (0x0f, "application/json"),    // content-type (index 31: 15 + 16)
        ] {
            block.push(name_index);
            if name_index == 0x0f {
                block.push(0x10);
            }
            block.push(u8::try_from(value.len()).expect("a short value"));
            block.extend_from_slice(value.as_bytes());
        }
        self.send(HEADERS, 0x4, 1, &block).await;
    }

    /// The server's next frame (settings and pings acknowledged on the way); `None` once it
    /// has closed the connection. Panics past `deadline`.
    async fn next(&mut self, deadline: tokio::time::Instant) -> Option<Frame> {
        loop {
            // A whole frame: a 9-byte header (24-bit length, type, flags, stream), the payload.
            if self.read.len() >= 9 {
                let length = usize::from(self.read[0]) << 16
                    | usize::from(self.read[1]) << 8
                    | usize::from(self.read[2]);
                if self.read.len() >= 9 + length {
                    let frame: Vec<u8> = self.read.drain(..9 + length).collect();
                    let (kind, flags) = (frame[3], frame[4]);
                    let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]);
                    let payload = frame[9..].to_vec();
                    match kind {
                        SETTINGS if flags & 1 == 0 => self.send(SETTINGS, 1, 0, &[]).await,
                        PING if flags & 1 == 0 && self.acks_pings => {
                            self.send(PING, 1, 0, &payload).await;
                        }
                        _ => {}
                    }
                    return Some((kind, flags, stream, payload));
                }
            }
            let mut chunk = [0u8; 4096];
            match tokio::time::timeout_at(deadline, self.stream.read(&mut chunk)).await {
                Ok(Ok(0) | Err(_)) => return None,
                Ok(Ok(n)) => self.read.extend_from_slice(&chunk[..n]),
                Err(_) => panic!("the server neither sent a frame nor closed in time"),
            }
        }
    }

    /// Half a pod review on stream 1: its headers and the first half of its body, the rest
    /// returned, for [`RawH2::finish_review`].
    async fn half_review(&mut self) -> Vec<u8> {
        let body = review(pod_request(json!({})));
        let (first, rest) = body.split_at(body.len() / 2);
        self.send_review_headers().await;
        self.send(DATA, 0, 1, first).await;
        rest.to_vec()
    }

    /// The server's frames up to its GOAWAY; panics if it closes the connection before.
    async fn until_goaway(&mut self, deadline: tokio::time::Instant) -> Vec<Frame> {
        let mut frames = Vec::new();
        while let Some(frame) = self.next(deadline).await {
            let goaway = frame.0 == GOAWAY;
            frames.push(frame);
            if goaway {
                return frames;
            }
        }
        panic!("closed without a GOAWAY: {:?}", kinds(&frames));
    }

    /// Sends the `rest` of the review [`RawH2::half_review`] began and reads until the server
    /// closes: it must have answered the review 200 (`:status: 200` is the static table's
    /// 0x88) and never reset its stream.
    async fn finish_review(&mut self, rest: &[u8], deadline: tokio::time::Instant) {
        self.send(DATA, 1, 1, rest).await;
        let frames = self.until_closed(deadline).await;
        let answered = frames.iter().any(|(kind, _, stream, block)| {
            *kind == HEADERS && *stream == 1 && block.first() == Some(&0x88)
        });
        assert!(answered, "{:?}", kinds(&frames));
        assert!(
            !kinds(&frames).contains(&RST_STREAM),
            "{:?}",
            kinds(&frames)
        );
    }

    /// The server's frames until it closes the connection.
    async fn until_closed(&mut self, deadline: tokio::time::Instant) -> Vec<Frame> {
        let mut frames = Vec::new();
        while let Some(frame) = self.next(deadline).await {
            frames.push(frame);
        }
        frames
    }
}

fn kinds(frames: &[Frame]) -> Vec<u8> {
    frames.iter().map(|f| f.0).collect()
}

#[tokio::test]
async fn an_http2_connection_is_told_the_webhooks_stream_and_head_limits() {
    let server = start_with(None, Limits::WEBHOOK).await;
    let mut h2 = RawH2::open(server.tls(&server.h2).await).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let (kind, _, _, payload) = h2.next(deadline).await.expect("the server's first frame");
    assert_eq!(kind, SETTINGS);
    let settings: Vec<(u16, u32)> = payload
        .chunks_exact(6)
        .map(|s| {
            (
                u16::from_be_bytes([s[0], s[1]]),
                u32::from_be_bytes([s[2], s[3], s[4], s[5]]),
            )
        })
        .collect();
    // SETTINGS_MAX_CONCURRENT_STREAMS (3) and SETTINGS_MAX_HEADER_LIST_SIZE (6): what a stream
    // may hold before its body is counted.
    assert!(settings.contains(&(3, 16)), "{settings:?}");
    assert!(
        settings.contains(&(6, serving::H2_HEADER_LIST_BYTES)),
        "{settings:?}"
    );
    server.stop.cancel();
}

#[tokio::test]
async fn an_http2_connection_whose_first_request_is_late_is_told_goaway_before_it_closes() {
    // A client may dial an HTTP/2 connection ahead of need and hold it unused: closed without
    // a GOAWAY, it could send a request just as the connection goes. So whether it chose
    // HTTP/2 in the TLS handshake or speaks it from its first byte without choosing.
    let limits = Limits {
        header_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_secs(10),
        ..TEST_LIMITS
    };
    let server = start_with(None, limits).await;
    for (how, connector) in [("chosen", &server.h2), ("unchosen", &server.unchosen)] {
        let tls = server.tls(connector).await;
        let start = Instant::now();
        let mut h2 = RawH2::open(tls).await;
        let frames = h2
            .until_closed(tokio::time::Instant::now() + Duration::from_secs(5))
            .await;
        let closed = start.elapsed();
        assert!(
            kinds(&frames).contains(&GOAWAY),
            "{how}: {:?}",
            kinds(&frames)
        );
        assert!(
            closed >= limits.header_timeout && closed < limits.idle_timeout,
            "{how}: closed by the header deadline: after {closed:?}"
        );
    }
    server.stop.cancel();
}

#[tokio::test]
async fn an_http2_client_that_reads_none_of_its_answers_is_closed_within_twice_the_send_timeout() {
    // Its window for the server's data at zero, a client sends a review and keeps the
    // connection busy with pings of its own (answered): the answer cannot be sent, and holds
    // its bytes of the endpoint's share until its connection goes.
    let limits = Limits {
        send_timeout: Duration::from_millis(500),
        ..NO_EARLY_BOUND
    };
    let server = start_with(None, limits).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut h2 = RawH2::open(server.tls(&server.h2).await).await;
    // SETTINGS_INITIAL_WINDOW_SIZE (0x4) = 0.
    h2.send(SETTINGS, 0, 0, &[0, 4, 0, 0, 0, 0]).await;
    h2.send_review_headers().await;
    h2.send(DATA, 1, 1, &review(pod_request(json!({})))).await;
    let sent = Instant::now();
    let beat = Duration::from_millis(100);
    let mut frames = Vec::new();
    'open: loop {
        h2.send(PING, 0, 0, b"busy now").await;
        let next_beat = tokio::time::Instant::now() + beat;
        while let Ok(frame) = tokio::time::timeout_at(next_beat, h2.next(deadline)).await {
            match frame {
                Some(frame) => frames.push(frame.0),
                None => break 'open,
            }
        }
    }
    let closed = sent.elapsed();
    assert!(
        frames.contains(&HEADERS) && !frames.contains(&DATA),
        "answered, its body never sent: {frames:?}"
    );
    assert!(
        closed >= limits.send_timeout && closed < limits.send_timeout * 2 + Duration::from_secs(1),
        "closed by the send timeout, not its age ({:?}): after {closed:?}",
        limits.max_age
    );
    server.stop.cancel();
}

#[tokio::test]
async fn a_graceful_close_whose_ping_is_never_acknowledged_ends_within_the_idle_bound() {
    // Told GOAWAY, a client that never acknowledges the GOAWAY's ping, and keeps the
    // connection busy with pings of its own (which the server answers), would otherwise hold it
    // open for good: no stream ends, and no byte's silence reaches the idle bound.
    let limits = Limits {
        idle_timeout: Duration::from_secs(1),
        ..NO_EARLY_BOUND
    };
    let server = start_with(None, limits).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut h2 = RawH2::open(server.tls(&server.h2).await).await;
    h2.acks_pings = false;
    server.draining.cancel();
    h2.until_goaway(deadline).await;
    let told = Instant::now();
    // A ping of its own every 100 ms, the server's frames read in between (a timeout between
    // two reads loses nothing: each frame is read whole).
    let beat = Duration::from_millis(100);
    'open: loop {
        h2.send(PING, 0, 0, b"busy now").await;
        let next_beat = tokio::time::Instant::now() + beat;
        while let Ok(frame) = tokio::time::timeout_at(next_beat, h2.next(deadline)).await {
            if frame.is_none() {
                break 'open;
            }
        }
    }
    let closed = told.elapsed();
    assert!(
        closed >= limits.idle_timeout / 2 && closed < limits.idle_timeout * 3,
        "closed by the idle bound's limit on a graceful close: {closed:?} after the GOAWAY"
    );
    server.stop.cancel();
}

#[tokio::test]
async fn once_readiness_is_off_an_http2_connection_is_told_goaway_and_its_stream_in_flight_answered()
 {
    // The HTTP/2 counterpart of `connection: close` on the next answer: the client finishes
    // what it sent and opens its next stream on a new connection, which the Service sends to a
    // replica that stays.
    let server = start_with(None, NO_EARLY_BOUND).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);

    // Chosen in the TLS handshake, readiness off before its preface: still told.
    let mut fresh = RawH2::open(server.tls(&server.h2).await).await;
    // Spoken without choosing, its preface read (the server's settings follow it): told too.
    let mut unchosen = RawH2::open(server.tls(&server.unchosen).await).await;
    let settings = unchosen.next(deadline).await;
    assert_eq!(settings.map(|frame| frame.0), Some(SETTINGS));
    // Spoken without choosing, its preface sent after readiness turns off: told once read.
    let late = server.tls(&server.unchosen).await;
    // A review half sent as readiness turns off.
    let mut busy = RawH2::open(server.tls(&server.h2).await).await;
    let rest = busy.half_review().await;
    server.draining.cancel();
    let mut late = RawH2::open(late).await;
    for h2 in [&mut fresh, &mut unchosen, &mut late] {
        let frames = h2.until_closed(deadline).await;
        assert!(kinds(&frames).contains(&GOAWAY), "{:?}", kinds(&frames));
    }
    busy.until_goaway(deadline).await;
    // The rest of the review, after the GOAWAY: answered, then the connection closes.
    busy.finish_review(&rest, deadline).await;
    server.stop.cancel();
}

/// A new connection at the connection cap is served: a review on it answered 200.
async fn served_at_the_cap(server: &Server) {
    let mut new = server.tls(&server.connector).await;
    let head = send_review(&mut new).await;
    assert!(
        head.as_deref()
            .is_some_and(|h| h.starts_with("HTTP/1.1 200")),
        "the new connection is served: {head:?}"
    );
}

#[tokio::test]
async fn at_the_connection_cap_a_connection_closing_already_is_not_evicted_in_place_of_an_idle_one()
{
    let limits = Limits {
        max_connections: 2,
        ..NO_EARLY_BOUND
    };
    let server = start_with(None, limits).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    // Closing: told GOAWAY as readiness turned off, a review half sent on it (so it stays
    // open until the review ends), and idle the longest.
    let mut closing = RawH2::open(server.tls(&server.h2).await).await;
    let rest = closing.half_review().await;
    server.draining.cancel();
    closing.until_goaway(deadline).await;
    // Idle, opened since.
    let mut idle = server.tls(&server.connector).await;
    // At the cap, a new connection: the idle one makes room for it.
    served_at_the_cap(&server).await;
    assert!(matches!(read_answer(&mut idle).await, Got::Closed));
    // The closing one still answers its review.
    closing.finish_review(&rest, deadline).await;
    server.stop.cancel();
}

#[tokio::test]
async fn at_the_connection_cap_a_connection_mid_request_makes_room_within_the_wait() {
    let limits = Limits {
        max_connections: 2,
        ..NO_EARLY_BOUND
    };
    let server = start_with(None, limits).await;
    // Both slots held by connections in the middle of a review's body, the rest never sent
    // (the body's deadline and the idle bound are seconds away).
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut stream = server.tls(&server.connector).await;
        stream
            .write_all(
                format!(
                    "POST {} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{\"kind\"",
                    endpoints::MUTATE_POD
                )
                .as_bytes(),
            )
            .await
            .expect("write");
        held.push(stream);
    }
    // A new connection: the one idle the longest is evicted and ends, its request unfinished,
    // in time for the new one to be served (which `tls` needs: no handshake without a slot).
    let started = Instant::now();
    served_at_the_cap(&server).await;
    assert!(
        matches!(read_answer(&mut held[0]).await, Got::Closed),
        "the evicted connection is closed without an answer"
    );
    assert!(
        started.elapsed() < NO_EARLY_BOUND.idle_timeout,
        "evicted after {:?}",
        started.elapsed()
    );
    server.stop.cancel();
}

#[tokio::test]
async fn at_the_connection_cap_a_handshake_that_never_ends_makes_room() {
    let limits = Limits {
        max_connections: 2,
        handshake_timeout: Duration::from_secs(10),
        ..NO_EARLY_BOUND
    };
    let server = start_with(None, limits).await;
    // Two connections that never send a ClientHello hold both slots.
    let stalled = [
        tokio::net::TcpStream::connect(server.addr)
            .await
            .expect("tcp"),
        tokio::net::TcpStream::connect(server.addr)
            .await
            .expect("tcp"),
    ];
    // Each new connection evicts one of them, within the eviction wait, and is served.
    for _ in 0..2 {
        served_at_the_cap(&server).await;
    }
    drop(stalled);
    server.stop.cancel();
}
