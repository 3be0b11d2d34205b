//! bench-server: the webhook's HTTPS serving path (the same router, serving loop, TLS and
//! decision as `serve`) over caches filled with a synthetic cluster, without a cluster.
//!
//! `bench-server --listen ADDR --cert-dir DIR [--pps N] [--states N] [--nodes N] [--kruise]
//! [--admission-threads N]` writes a certificate for 127.0.0.1 into DIR (ca.crt for clients)
//! and serves until SIGTERM/SIGINT; with `--kruise` the PersistentPodStates target Advanced
//! StatefulSets. It serves on N threads of its own (`serve`'s default), as `serve` does.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kube::runtime::watcher;
use persistent_pod_state::benchkit::flag;
use persistent_pod_state::serving::{
    ADMISSION_SLICE, ADMISSION_THREAD, ADMISSION_THREADS, Limits, Server, ServerThreads,
};
use persistent_pod_state::state::Caches;
use persistent_pod_state::webhook::{WebhookState, router, tls};
use tokio_util::sync::CancellationToken;

// The allocator the shipped binary uses, set up alike (src/main.rs, src/alloc.rs).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().collect();
    let listen = flag(&args, "--listen").context("--listen ADDR")?;
    let dir = std::path::PathBuf::from(flag(&args, "--cert-dir").context("--cert-dir DIR")?);
    let number = |name: &str, default: usize| -> anyhow::Result<usize> {
        flag(&args, name).map_or(Ok(default), |v| v.parse().context(name.to_owned()))
    };
    let kruise = args.iter().any(|a| a == "--kruise");
    let (pps, states, nodes) = (
        number("--pps", 10_000)?,
        number("--states", 100_000)?,
        number("--nodes", 100)?,
    );

    let bundle = persistent_pod_state::certs::generate(&["127.0.0.1".into()], None)?;
    persistent_pod_state::certs::write(&bundle, &dir)?;
    let tls = tls::server_config(
        &dir.join("tls.crt"),
        &dir.join("tls.key"),
        None,
        prometheus_client::metrics::gauge::Gauge::default(),
    )?;

    let caches = Caches::new();
    let per_pps = (states / pps.max(1)).max(1);
    caches.apply_pps(watcher::Event::Init);
    for i in 0..pps {
        let pps = if kruise {
            persistent_pod_state::synthetic::kruise_pps(i, per_pps, nodes)
        } else {
            persistent_pod_state::synthetic::pps(i, per_pps, nodes)
        };
        caches.apply_pps(watcher::Event::InitApply(serde_json::from_value(pps)?));
    }
    caches.apply_pps(watcher::Event::InitDone);
    caches.apply_node(watcher::Event::Init);
    for j in 0..nodes {
        caches.apply_node(watcher::Event::InitApply(serde_json::from_value(
            persistent_pod_state::synthetic::node(j),
        )?));
    }
    caches.apply_node(watcher::Event::InitDone);
    caches.apply_pod(watcher::Event::InitDone);
    caches.apply_workload(
        &persistent_pod_state::workload::GroupKind::native_statefulset(),
        watcher::Event::InitDone,
    );
    anyhow::ensure!(caches.is_synced(), "the synthetic caches are synced");
    // As `serve` does once synced, and once that has settled.
    persistent_pod_state::alloc::synced();
    persistent_pod_state::alloc::purge_batched();

    let state = Arc::new(WebhookState::over(caches));
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    eprintln!(
        "bench-server: {pps} PPS, {} recorded states, {nodes} nodes; listening on {listen}",
        pps * per_pps
    );
    let shutdown = CancellationToken::new();
    // As `serve` runs it: on threads of its own (`--admission-threads`, `serve`'s default),
    // asking for `serve`'s slice.
    let threads = number("--admission-threads", usize::from(ADMISSION_THREADS))?;
    let admission = ServerThreads::new(ADMISSION_THREAD, threads, Some(ADMISSION_SLICE))?;
    let server = admission.serve(
        listener,
        Server {
            tls: Some(tokio_rustls::TlsAcceptor::from(tls)),
            app: router(state),
            limits: Limits::WEBHOOK,
            draining: CancellationToken::new(),
            shutdown: shutdown.clone(),
            drain: Duration::from_secs(2),
        },
    )?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    shutdown.cancel();
    let _ = server.await;
    Ok(())
}
