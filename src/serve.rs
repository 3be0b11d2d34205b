//! `serve`: wires the caches, the controllers, the admission server and the probe server under
//! one shutdown signal.
//!
//! Shutdown (SIGTERM or SIGINT): readiness turns false at once, each kept-alive HTTP/1
//! connection closes with its next answer, and a leader stops its controllers and gives the
//! Lease up (another replica leads while this one still answers admission); after the shutdown
//! delay the listeners stop accepting, requests in flight are answered, and the process exits
//! 0. Without leader election the controllers run until then.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::cli::{Mode, ServeArgs};
use crate::controller;
use crate::discovery;
use crate::events::Events;
use crate::leader::{self, Ended, Fence, LeaseConfig};
use crate::metrics::Metrics;
use crate::probes::{self, Health};
use crate::release::NodeKeys;
use crate::serving::{self, Limits, Server, ServerThreads};
use crate::state::{self, Caches};
use crate::supervise;
use crate::webhook::{self, WebhookState};
use crate::workload::CustomKinds;

/// Runs until SIGTERM/SIGINT.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let tls = webhook::tls::server_config(
        &args.tls_cert,
        &args.tls_key,
        args.client_ca.as_deref(),
        metrics.serving_certificate_expiry.clone(),
    )?;
    let mut config = kube::Config::infer()
        .await
        .context("no Kubernetes client configuration (KUBECONFIG or in-cluster)")?;
    config.read_timeout = Some(API_READ_TIMEOUT);
    config.reset_reader_on_write = true;
    let client = crate::client::client(config.clone()).context("a Kubernetes client")?;
    let watch_client =
        crate::client::client(state::watch_config(config)).context("a Kubernetes client")?;
    // As they sync, what the sync freed is returned to the OS (see `crate::alloc`).
    let caches = Caches::start(&watch_client, crate::alloc::synced);
    let health = Arc::new(Health {
        caches: caches.clone(),
        shutting_down: false.into(),
        metrics: metrics.clone(),
    });
    // Readiness off (kept-alive connections close with their next answer), then, after the
    // shutdown delay, no more connections.
    let (draining, shutdown) = (CancellationToken::new(), CancellationToken::new());
    let drain = Duration::from_secs(args.drain_seconds);

    let webhook_listener =
        crate::serving::listen(args.listen).with_context(|| format!("binding {}", args.listen))?;
    let probe_listener = crate::serving::listen(args.probe_listen)
        .with_context(|| format!("binding {}", args.probe_listen))?;
    let bound = |l: &TcpListener| l.local_addr().map(|a| a.to_string()).unwrap_or_default();
    tracing::info!(webhook = %bound(&webhook_listener), probes = %bound(&probe_listener), "listening");

    let custom_kinds = Arc::new(CustomKinds::new(args.custom_workloads.iter().cloned()));
    let kinds_changed = Arc::new(tokio::sync::watch::channel(0).0);
    // Supervised: started again with backoff whenever they end or panic before shutdown.
    if let Some(file) = args.custom_workload_config.clone() {
        let (flags, custom, changed, stop) = (
            args.custom_workloads
                .iter()
                .cloned()
                .collect::<std::collections::BTreeSet<_>>(),
            custom_kinds.clone(),
            kinds_changed.clone(),
            shutdown.clone(),
        );
        tokio::spawn(supervise::restarting(
            "custom workload configuration",
            shutdown.clone(),
            move || {
                discovery::watch_config(
                    Some(file.clone()),
                    flags.clone(),
                    custom.clone(),
                    changed.clone(),
                    stop.clone(),
                )
            },
        ));
    }
    {
        let (client, caches, custom, changed, stop) = (
            watch_client.clone(),
            caches.clone(),
            custom_kinds.clone(),
            kinds_changed.clone(),
            shutdown.clone(),
        );
        tokio::spawn(supervise::restarting(
            "workload kind discovery",
            shutdown.clone(),
            move || {
                discovery::run(
                    client.clone(),
                    caches.clone(),
                    custom.clone(),
                    changed.subscribe(),
                    stop.clone(),
                )
            },
        ));
    }
    let events = Arc::new(
        Events::new(
            client.clone(),
            std::env::var("POD_NAME")
                .or_else(|_| std::env::var("HOSTNAME"))
                .ok(),
            Duration::from_secs(30),
        )
        .counting_drops(metrics.events_dropped.clone()),
    );
    let webhook_app = webhook::router(Arc::new(WebhookState {
        events: Some(events.clone()),
        caches: caches.clone(),
        metrics: metrics.clone(),
        custom_kinds: custom_kinds.clone(),
        node_lost_after: args.node_lost_after,
        client_auth: args.client_ca.is_some(),
        ip_reservations: Default::default(),
        observe_all: args.mode == Mode::Observe,
        client: Some(client.clone()),
        target_field: Default::default(),
    }));
    // The admission server on threads of its own (never behind a reconcile or a relist); the
    // probe server stays here, so readiness answers even while admission is busy. Built here,
    // on the thread that entered the main runtime (not in a task of it), so the threads keep
    // the process's priority rather than the main runtime's lowered one (`--background-nice`).
    let admission = ServerThreads::new(
        serving::ADMISSION_THREAD,
        usize::from(args.admission_threads),
        (args.admission_slice_micros > 0)
            .then(|| Duration::from_micros(u64::from(args.admission_slice_micros))),
    )
    .context("starting the admission threads")?;
    let mut webhook_server = admission
        .serve(
            webhook_listener,
            Server {
                tls: Some(tokio_rustls::TlsAcceptor::from(tls)),
                app: webhook_app,
                limits: Limits::WEBHOOK,
                draining: draining.clone(),
                shutdown: shutdown.clone(),
                drain,
            },
        )
        .context("serving the webhook on the admission threads")?;
    // The probe server outlives the webhook drain, so /readyz answers 503 throughout it.
    let probes_stop = CancellationToken::new();
    let mut probe_server = tokio::spawn(serving::serve(
        probe_listener,
        Server {
            tls: None,
            app: probes::router(health.clone()),
            limits: Limits::PROBES,
            draining: CancellationToken::new(),
            shutdown: probes_stop.clone(),
            drain,
        },
    ));

    let lease = LeaseConfig::from_args(&args.lease)?;
    let fence = if lease.is_some() {
        Fence::closed()
    } else {
        Fence::open()
    };
    let mut controllers = tokio::spawn({
        let ctx = Arc::new(
            controller::Context::new(
                client.clone(),
                caches.clone(),
                metrics.clone(),
                events.clone(),
                args.node_lost_after,
                fence.clone(),
            )
            .releasing(args.max_releases_per_minute)
            .observing(args.mode == Mode::Observe)
            .naming_nodes_by(NodeKeys::with(&args.node_local_volume_keys)),
        );
        let shutdown = shutdown.clone();
        // The Lease is given up as readiness turns off (SIGTERM), not after the shutdown
        // delay: another replica leads at once while this one still answers admission.
        let stepping_down = draining.clone();
        let client = client.clone();
        let metrics = metrics.clone();
        async move {
            tokio::select! {
                () = waiting_for_sync(&ctx.caches) => {}
                () = shutdown.cancelled() => return Ended::Shutdown,
            }
            tracing::info!("caches synced; ready");
            // What serving frees is returned in batches once the sync has settled.
            tokio::spawn(async {
                tokio::time::sleep(crate::alloc::SYNC_SETTLES).await;
                crate::alloc::purge_batched();
            });
            match lease {
                Some(lease) => {
                    leader::run_when_leading(
                        client,
                        lease,
                        &metrics,
                        fence,
                        stepping_down,
                        |stop| controller::run(ctx.clone(), stop),
                    )
                    .await
                }
                None => {
                    // Without election this replica always leads (what `pps_leader` and the
                    // alerts on it say).
                    metrics.leader.set(1);
                    controller::run(ctx, shutdown.clone()).await;
                    metrics.leader.set(0);
                    if shutdown.is_cancelled() {
                        Ended::Shutdown
                    } else {
                        Ended::Unexpectedly
                    }
                }
            }
        }
    });

    // Supervised: controllers that stop by themselves (an error, a panic) and a server that
    // ends (its listener cannot be had again) end the process with a failure, so the kubelet
    // restarts it; it never serves long with dead controllers or without a port.
    let failed = tokio::select! {
        () = wait_for_signal() => None,
        ended = &mut controllers => Some(match ended {
            Ok(Ended::Shutdown) => "the controllers stopped".to_owned(),
            Ok(Ended::Unexpectedly) => "the controllers stopped by themselves".to_owned(),
            Err(e) => format!("the controllers failed: {e}"),
        }),
        ended = &mut webhook_server => Some(format!("the webhook server stopped: {ended:?}")),
        ended = &mut probe_server => Some(format!("the probe server stopped: {ended:?}")),
    };
    if let Some(why) = failed {
        tracing::error!(%why, "exiting so that the process is restarted");
        health.shutting_down.store(true, Ordering::Release);
        draining.cancel();
        // A webhook server still serving goes on while endpoints notice the failing readiness,
        // as at a SIGTERM.
        if !webhook_server.is_finished() {
            tokio::time::sleep(Duration::from_secs(args.shutdown_delay_seconds)).await;
        }
        shutdown.cancel();
        // A leader gives the Lease up as it stops (draining), so another replica takes over
        // at once.
        if !controllers.is_finished() {
            let _ = tokio::time::timeout(drain, &mut controllers).await;
        }
        if !webhook_server.is_finished() {
            let _ = tokio::time::timeout(drain, webhook_server).await;
        }
        anyhow::bail!("{why}");
    }
    health.shutting_down.store(true, Ordering::Release);
    draining.cancel();
    tracing::info!(
        delay_seconds = args.shutdown_delay_seconds,
        "shutting down: readiness off; kept-alive connections close with their next answer"
    );
    // Keep serving while endpoints and load balancers notice the failing readiness.
    tokio::time::sleep(Duration::from_secs(args.shutdown_delay_seconds)).await;
    tracing::info!("no longer accepting; draining requests in flight");
    shutdown.cancel();
    // One deadline for both (they drain at once): the delay and one drain are what
    // terminationGracePeriodSeconds must cover.
    let deadline = tokio::time::Instant::now() + drain;
    let _ = tokio::time::timeout_at(deadline, webhook_server).await;
    let _ = tokio::time::timeout_at(deadline, controllers).await;
    probes_stop.cancel();
    let _ = probe_server.await;
    tracing::info!("stopped");
    Ok(())
}

async fn wait_for_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(error) => {
            tracing::error!(%error, "cannot listen for SIGTERM; only Ctrl-C stops the server");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// How long a read of an answer from the API server may wait (kube's client waits for ever by
/// default), from the request on (`reset_reader_on_write`: not counting the time its connection
/// sat idle in the pool): a request to an API server that stopped answering fails instead of
/// hanging (a connection whose peer is gone fails sooner: [`crate::client`]; the watches'
/// client waits [`state::WATCH_SILENCE`]).
const API_READ_TIMEOUT: Duration = Duration::from_secs(330);

/// How often a replica whose caches have not synced says what it still waits for.
const SYNC_WAIT_WARNING: Duration = Duration::from_secs(30);

/// Waits until the caches are synced, saying every [`SYNC_WAIT_WARNING`] which watches have not
/// listed yet (a replica that stays unready says why in its log, not only on `/readyz`).
async fn waiting_for_sync(caches: &Caches) {
    let mut waited = Duration::ZERO;
    loop {
        tokio::select! {
            () = caches.wait_synced() => return,
            () = tokio::time::sleep(SYNC_WAIT_WARNING) => {
                waited += SYNC_WAIT_WARNING;
                let waiting = caches.watches.stale_now();
                let seconds = waited.as_secs();
                if waiting.iter().any(|w| w.starts_with("PersistentPodState:")) {
                    tracing::warn!(seconds, waiting_for = %waiting.join("; "),
                        "caches not synced yet, so not ready (PersistentPodStates not listed: \
                         a watch refused with 429 means the API server cannot fill its own \
                         cache of them, often for want of a conversion webhook to reach, see \
                         docs/troubleshooting.md)");
                } else {
                    tracing::warn!(seconds, waiting_for = %waiting.join("; "),
                        "caches not synced yet, so not ready");
                }
            }
        }
    }
}
