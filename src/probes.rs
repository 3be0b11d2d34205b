//! The plain-HTTP probe server: `/healthz` (the process serves), `/readyz` (caches synced and
//! not shutting down) and `/metrics` (Prometheus text).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::cache::Caches;
use crate::metrics::Metrics;

/// What the probes report on.
pub struct Health {
    /// The shared caches (ready once synced).
    pub caches: Arc<Caches>,
    /// Set at the start of shutdown: readiness fails from then on.
    pub shutting_down: AtomicBool,
    /// Metrics to expose.
    pub metrics: Arc<Metrics>,
}

impl Health {
    /// Whether the process should receive traffic.
    pub fn is_ready(&self) -> bool {
        self.caches.is_synced() && !self.shutting_down.load(Ordering::Acquire)
    }
}

/// The probe routes.
pub fn router(health: Arc<Health>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(health)
}

async fn readyz(State(health): State<Arc<Health>>) -> Response {
    if health.is_ready() {
        (StatusCode::OK, "ok").into_response()
    } else if health.shutting_down.load(Ordering::Acquire) {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced").into_response()
    }
}

async fn metrics(State(health): State<Arc<Health>>) -> Response {
    let (m, c) = (&health.metrics, &health.caches);
    m.cached_persistent_pod_states.set(c.pps.len() as i64);
    m.cached_pods.set(c.pods.len() as i64);
    m.cached_nodes.set(c.nodes.len() as i64);
    let kinds = c.workload_kinds();
    m.watched_workload_kinds.set(kinds.len() as i64);
    m.cached_workloads
        .set(kinds.iter().map(|(_, w)| w.store.len() as i64).sum());
    m.process.refresh();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        health.metrics.encode(),
    )
        .into_response()
}
