//! bench-floor: the true floor of an HTTPS admission endpoint on this machine (issue 22.1), the
//! least any webhook server must spend per review: axum 0.8 with one route, hyper-util's auto
//! connection builder, tokio-rustls with rustls' default server settings (ring provider),
//! mimalloc with its defaults, and a handler that deserializes only `request.uid` (serde skips
//! the rest without building it) and answers a fixed review with a one-operation base64 patch.
//! No limits, no logging, no metrics, no decision.
//!
//! `bench-floor --listen ADDR --cert-dir DIR [--cert-host HOST] [--with LAYER,...] [--patch-file
//! FILE]` writes a certificate for 127.0.0.1 (and HOST, the address a client calls it at, if
//! another) into DIR (`ca.crt` for clients) and serves until killed; with `--patch-file`, it
//! answers with the JSON patch in FILE instead of its one label. `--with` swaps in the
//! webhook's own layers one at a time, so that a benchmark can say what each costs: `loop` (the
//! serving loop of `serve`: connection cap, idle and age bounds, header deadline, activity
//! tracking), `tls` (the webhook's TLS configuration: the reloading certificate resolver),
//! `limits` (the per-endpoint request limits: body read within a deadline, byte share, slots),
//! `review` (the review read as the webhook reads it, instead of its uid alone).

use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use persistent_pod_state::benchkit::{flag, floor};
use persistent_pod_state::serving;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// What `--with` may swap in, in the order a benchmark adds them.
const LAYERS: [&str; 4] = ["loop", "tls", "limits", "review"];

/// The `review` layer: the body read as the webhook reads a review.
async fn answer_review(body: Bytes) -> axum::response::Response {
    match persistent_pod_state::webhook::review::parse(body) {
        Ok(request) => floor::fixed(&request.uid),
        Err(_) => (StatusCode::BAD_REQUEST, "{}").into_response(),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let listen = flag(&args, "--listen").context("--listen ADDR")?;
    let dir = std::path::PathBuf::from(flag(&args, "--cert-dir").context("--cert-dir DIR")?);
    let mut hosts = vec!["127.0.0.1".to_owned()];
    hosts.extend(flag(&args, "--cert-host").filter(|host| host != "127.0.0.1"));
    let bundle = persistent_pod_state::certs::generate(&hosts, None)?;
    persistent_pod_state::certs::write(&bundle, &dir)?;
    let with: Vec<String> = flag(&args, "--with")
        .map(|w| w.split(',').map(str::to_owned).collect())
        .unwrap_or_default();
    for layer in &with {
        anyhow::ensure!(
            LAYERS.contains(&layer.as_str()),
            "--with: {layer} is not one of {LAYERS:?}"
        );
    }
    let patch = match flag(&args, "--patch-file") {
        Some(file) => {
            let text = std::fs::read(&file).with_context(|| format!("--patch-file {file}"))?;
            let ops: Vec<serde_json::Value> = serde_json::from_slice(&text)
                .with_context(|| format!("{file}: a JSON patch (an array of operations)"))?;
            anyhow::ensure!(!ops.is_empty(), "{file}: an empty patch");
            text
        }
        None => floor::ONE_LABEL.to_vec(),
    };
    floor::set_patch(&patch);
    let has = |layer: &str| with.iter().any(|w| w == layer);
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let tls = if has("tls") {
        persistent_pod_state::webhook::tls::server_config(&cert, &key, None, Default::default())?
    } else {
        let chain = CertificateDer::pem_file_iter(&cert)?.collect::<Result<_, _>>()?;
        let key = PrivateKeyDer::from_pem_file(&key)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(chain, key)?;
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(tls)
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let review = has("review");
    let app = if has("limits") {
        // Called by the route's handler itself, as the webhook's routes call it (not as a
        // middleware layer, which would box the route and its future for every request).
        use persistent_pod_state::webhook::{MAX_BODY, POD_BUDGET, REQUEST_TIMEOUT};
        let limit = serving::RequestLimit::new(POD_BUDGET, REQUEST_TIMEOUT, MAX_BODY, None)
            .endpoint("/mutate-pod", POD_BUDGET);
        Router::new().route(
            "/mutate-pod",
            post(move |request: axum::extract::Request| {
                let limit = limit.clone();
                async move {
                    limit
                        .run(request, |request, _| async move {
                            if review {
                                answer_review(request.into_body()).await
                            } else {
                                floor::answer(request.into_body()).await
                            }
                        })
                        .await
                }
            }),
        )
    } else if review {
        Router::new().route("/mutate-pod", post(answer_review))
    } else {
        Router::new().route("/mutate-pod", post(floor::answer))
    };
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    eprintln!("bench-floor: listening on {listen} with {with:?}");
    if has("loop") {
        serving::serve(
            listener,
            serving::Server {
                tls: Some(acceptor),
                app,
                limits: serving::Limits::WEBHOOK,
                draining: tokio_util::sync::CancellationToken::new(),
                shutdown: tokio_util::sync::CancellationToken::new(),
                drain: std::time::Duration::from_secs(1),
            },
        )
        .await;
        return Ok(());
    }
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
