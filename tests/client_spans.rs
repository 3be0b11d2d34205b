//! The client `serve` runs with traces each request as kube's own client does. In a process of
//! its own: a subscriber set for one thread is not seen reliably while other tests' threads
//! use the same callsites.

use tokio::io::AsyncReadExt;

/// What a subscriber wrote.
#[derive(Clone, Default)]
struct Written(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Written {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .expect("not poisoned")
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Each request runs in a debug span named and filled in as kube's own client's, the
/// answer's status recorded in it.
#[tokio::test]
async fn each_request_has_a_debug_span_with_its_status() {
    let written = Written::default();
    let into = written.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer(move || into.clone())
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("address").port();
    let server = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        let (mut stream, _) = listener.accept().await.expect("the client connects");
        let mut head = [0u8; 1024];
        let _ = stream.read(&mut head).await.expect("a request");
        let answer = "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        stream.write_all(answer.as_bytes()).await.expect("answer");
        stream
    });
    let mut config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().expect("URL"));
    config.default_retry = false;
    let client = persistent_pod_state::client::client(config).expect("client");
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(client, "x");
    assert!(pods.get("y").await.is_err(), "a 404");
    drop(server.await.expect("the server"));
    let text = String::from_utf8_lossy(&written.0.lock().expect("not poisoned")).into_owned();
    let closed = text
        .lines()
        .find(|l| l.contains("HTTP{") && l.contains("close"))
        .unwrap_or_else(|| panic!("no HTTP span closed: {text}"));
    for field in [
        "http.method=GET",
        "/api/v1/namespaces/x/pods/y",
        "http.status_code=404",
        "otel.name=\"get\"",
        "otel.status_code=\"ERROR\"",
    ] {
        assert!(closed.contains(field), "{field} in {closed}");
    }
}
