//! bench-baseline: the floor of an HTTPS admission endpoint on this machine. A bare axum
//! router over rustls with the same TLS settings as `serve` (ring, TLS 1.2/1.3, h2 and
//! http/1.1), TCP_NODELAY and hyper's auto connection builder: it reads the body, parses it as
//! JSON, and answers a fixed AdmissionReview with a fixed one-operation patch (a label, so the
//! API-server benchmark can see its answers applied).
//!
//! `bench-baseline --listen ADDR --cert-dir DIR` writes a certificate for 127.0.0.1 into DIR.

use anyhow::Context;
use axum::Router;
use axum::body::Bytes;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use persistent_pod_state::benchkit::flag;

/// The fixed patch, base64 as the API documents it.
static PATCH: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .encode(br#"[{"op":"add","path":"/metadata/labels/bench-baseline","value":"answered"}]"#)
});

async fn answer(body: Bytes) -> impl IntoResponse {
    match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(review) => {
            let uid = review["request"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let answer = serde_json::json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": *PATCH}});
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                serde_json::to_vec(&answer).unwrap_or_default(),
            )
        }
        Err(_) => (
            StatusCode::BAD_REQUEST,
            [(header::CONTENT_TYPE, "application/json")],
            b"{}".to_vec(),
        ),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().collect();
    let listen = flag(&args, "--listen").context("--listen ADDR")?;
    let dir = std::path::PathBuf::from(flag(&args, "--cert-dir").context("--cert-dir DIR")?);
    let bundle = persistent_pod_state::certs::generate(&["127.0.0.1".into()], None)?;
    persistent_pod_state::certs::write(&bundle, &dir)?;
    let tls = persistent_pod_state::webhook::tls::server_config(
        &dir.join("tls.crt"),
        &dir.join("tls.key"),
        None,
        prometheus_client::metrics::gauge::Gauge::default(),
    )?;
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let app = Router::new().route("/mutate-pod", post(answer));
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    eprintln!("bench-baseline: listening on {listen}");
    loop {
        let (tcp, _) = listener.accept().await?;
        tcp.set_nodelay(true)?;
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(tcp).await else {
                return;
            };
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), TowerToHyperService::new(app))
                .await;
        });
    }
}
