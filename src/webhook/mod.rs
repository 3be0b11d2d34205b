//! The HTTPS admission server: routes, the TLS serving loop, and the handlers. The decision
//! of what to inject is the pure [`inject`] module.

pub mod convert;
pub mod inject;
pub mod mutate_pod;
pub mod review;
pub mod server;
pub mod tls;
pub mod validate_pps;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::post;

use crate::cache::Caches;
use crate::events::Events;
use crate::metrics::Metrics;
use crate::workload::CustomKinds;

/// Largest accepted request body (the API server sends at most a few MiB per object).
const MAX_BODY: usize = 8 * 1024 * 1024;

/// What the admission handlers share.
pub struct WebhookState {
    /// The shared caches.
    pub caches: Arc<Caches>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Publishes Events about conflicts and skipped injections (not for dry runs).
    pub events: Option<Arc<Events>>,
    /// Configured custom StatefulSet-like kinds.
    pub custom_kinds: Arc<CustomKinds>,
}

/// The admission routes.
pub fn router(state: Arc<WebhookState>) -> Router {
    Router::new()
        .route(mutate_pod::PATH, post(mutate_pod::mutate_pod))
        .route(convert::PATH, post(convert::convert_objects))
        .route(validate_pps::PATH, post(validate_pps::validate_pps))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}
