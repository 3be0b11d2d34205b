//! The HTTPS admission server: routes, the TLS serving loop, and the handlers. What a pod gets
//! is decided by the pure [`admit`] and [`inject`]; handlers only map outcomes to responses.

pub mod admit;
pub mod convert;
pub mod endpoints;
pub mod inject;
pub mod mutate_pod;
pub mod patch;
pub mod review;
pub mod tls;
pub mod validate_pps;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use axum::routing::{MethodRouter, post};

use crate::events::Events;
use crate::metrics::{AdmissionResult, Metrics};
use crate::serving::{Budget, RequestLimit, TooComplex, VerifiedClient, error_response};
use crate::state::Caches;
use crate::workload::CustomKinds;
use admit::IpReservations;

/// Largest accepted request body: the API server's own request limit (3 MiB). Over it: 413.
pub const MAX_BODY: usize = 3 * 1024 * 1024;
/// What pod reviews may hold at once: 16 handled (beyond, a fast 503: the API server retries
/// or applies its failurePolicy) and 64 MiB of bodies and what decoding them may build.
pub const POD_BUDGET: Budget = Budget {
    in_flight: 16,
    bytes: 64 << 20,
    pruned: &[],
    held_per_byte: 0,
};
/// What PersistentPodState validations may hold at once (a share of their own; creates come in
/// bursts: an apply of many objects, the generator). Their objects' status and managed fields
/// are never decoded (an update of one recording thousands of pods builds what its spec does).
/// Each is charged twice its length beyond its body, what it may hold at most: the strings
/// decoded from the object and the old object (parts of the body that never overlap), and a
/// refusal's message, which quotes them (so three updates of 3 MiB fill the share).
pub const VALIDATE_BUDGET: Budget = Budget {
    in_flight: 16,
    bytes: 32 << 20,
    pruned: &validate_pps::UNREAD_KEYS,
    held_per_byte: 2,
};
/// What conversions may hold at once (a share of their own). Only the objects' specs and
/// their own keys are decoded; what a request holds beyond its body is at most twice its
/// length: the strings decoded from it (keys, the uid, versions: parts of the body that never
/// overlap) and the answer, as long as the objects sent (plus a few bytes per renamed key list,
/// within what its counted values are charged).
pub const CONVERT_BUDGET: Budget = Budget {
    in_flight: 16,
    bytes: 64 << 20,
    pruned: &convert::UNREAD_KEYS,
    held_per_byte: 2,
};
/// The largest conversion request read: what [`CONVERT_BUDGET`] can hold alone (about 21 MiB;
/// one whose specs also count many values may still be too complex, a `Failure` with its uid).
/// The API server converts a list read in another version than the one stored (a `v1alpha1`
/// client's LIST, a page of 500 objects) in one request, which is not bound by its own request
/// limit ([`MAX_BODY`]).
pub const MAX_CONVERT_BODY: usize = CONVERT_BUDGET.bytes / (1 + CONVERT_BUDGET.held_per_byte);
/// What requests to any other path may hold (answered 404 or 405).
const OTHER_BUDGET: Budget = Budget {
    in_flight: 4,
    bytes: 4 << 20,
    pruned: &[],
    held_per_byte: 0,
};
/// How long one admission may take (the API server gives up after the configured
/// `timeoutSeconds`, at most 30 s, anyway).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// How long a node may be not ready before a required pin to it is dropped.
    pub node_lost_after: Duration,
    /// Whether admission requests must come with a verified client certificate (`--client-ca`).
    pub client_auth: bool,
    /// IPs just asked for on behalf of pods the cache does not show yet.
    pub ip_reservations: IpReservations,
    /// `serve --mode observe`: every PersistentPodState observed only (nothing injected).
    pub observe_all: bool,
    /// The API server, for the one live read admission makes: on a PersistentPodState CREATE,
    /// the others in its namespace (the cache may not hold one created or deleted a moment
    /// ago). Without it, the cache answers.
    pub client: Option<kube::Client>,
    /// Whether that read can be narrowed to the workload's name by the API server.
    pub target_field: validate_pps::TargetField,
}

impl WebhookState {
    /// A state over `caches` alone, as tests and benchmarks serve: fresh metrics, no Events, no
    /// custom kinds, nodes lost after the default 5 minutes, no client certificate required, no
    /// API server.
    pub fn over(caches: Arc<Caches>) -> Self {
        Self {
            caches,
            metrics: Arc::new(Metrics::new()),
            events: None,
            custom_kinds: Arc::new(CustomKinds::default()),
            node_lost_after: Duration::from_secs(300),
            client_auth: false,
            ip_reservations: IpReservations::default(),
            observe_all: false,
            client: None,
            target_field: validate_pps::TargetField::default(),
        }
    }
}

/// The answer refusing a request to a route that answers from the caches, if it is refused:
/// 403 to an admission request without a verified client certificate when `--client-ca` is set
/// (checked first: an unauthenticated client learns nothing, not even whether we synced), then
/// 503 until the caches have synced, so the API server's failurePolicy decides rather than a
/// silent "allowed" from empty caches. Checked by [`review::Review::read`]
/// before the body is read as a review.
pub(crate) fn refusal<B>(state: &WebhookState, request: &Request<B>) -> Option<Response> {
    let (status, result, message) =
        if state.client_auth && request.extensions().get::<VerifiedClient>().is_none() {
            (
                StatusCode::FORBIDDEN,
                AdmissionResult::Forbidden,
                "a client certificate signed by the configured CA is required",
            )
        } else if !state.caches.is_synced() {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                AdmissionResult::Unavailable,
                "caches are not synced yet",
            )
        } else {
            return None;
        };
    state.metrics.refused(request.uri().path(), result);
    Some(error_response(status, message))
}

/// The admission routes. Conversion needs no cache, so it is served from the first moment (the
/// API server needs it to read v1alpha1 objects at all); the others read their review with
/// [`review::Review::read`], which waits for the caches ([`refusal`]). Each route's requests go
/// through its endpoint's [`RequestLimit`] share first, called by the route's handler itself
/// (not as a layer: a review runs no more code than it needs).
pub fn router(state: Arc<WebhookState>) -> Router {
    let limit = RequestLimit::new(
        OTHER_BUDGET,
        REQUEST_TIMEOUT,
        MAX_BODY,
        Some(state.metrics.clone()),
    )
    .endpoint(endpoints::MUTATE_POD, POD_BUDGET)
    .endpoint(endpoints::VALIDATE_PPS, VALIDATE_BUDGET)
    .endpoint_taking(endpoints::CONVERT, CONVERT_BUDGET, Some(MAX_CONVERT_BODY));
    Router::new()
        .route(
            endpoints::MUTATE_POD,
            limited(&limit, GATED, |state, request, too_complex| async move {
                match review::Review::read(request, too_complex, &state) {
                    Ok(review) => mutate_pod::mutate_pod(&state, review),
                    Err(refused) => *refused,
                }
            }),
        )
        .route(
            endpoints::VALIDATE_PPS,
            limited(&limit, GATED, |state, request, too_complex| async move {
                match review::Review::read(request, too_complex, &state) {
                    Ok(review) => validate_pps::validate_pps(&state, review).await,
                    Err(refused) => *refused,
                }
            }),
        )
        .route(
            endpoints::CONVERT,
            limited(&limit, !GATED, |state, request, too_complex| async move {
                match review::Conversion::read(request, too_complex, &state) {
                    Ok(conversion) => convert::convert_objects(&state, conversion),
                    Err(refused) => *refused,
                }
            }),
        )
        .fallback(answered_within(
            &limit,
            StatusCode::NOT_FOUND,
            "no such path",
        ))
        .method_not_allowed_fallback(answered_within(
            &limit,
            StatusCode::METHOD_NOT_ALLOWED,
            "reviews are POSTed",
        ))
        .with_state(state)
}

/// Whether a route answers from the caches, refused ([`refusal`]) before its body is read.
const GATED: bool = true;

/// A handler answering every request `status` with `message`, within `limit`'s share of other
/// paths (its body read and dropped first, so the client gets the answer).
fn answered_within(
    limit: &RequestLimit,
    status: StatusCode,
    message: &'static str,
) -> MethodRouter<Arc<WebhookState>> {
    let limit = limit.clone();
    axum::routing::any(move |request: axum::extract::Request| {
        let limit = limit.clone();
        async move {
            limit
                .run_as_other(
                    request,
                    |_, _| async move { error_response(status, message) },
                )
                .await
        }
    })
}

/// A POST route whose requests `limit` bounds ([`RequestLimit::run`]) before `handler` answers
/// them, given the body whole. `gated`: a request [`refusal`] refuses (no verified client, the
/// caches not synced) is answered before its body is read or takes any of the share.
fn limited<F, Fut>(limit: &RequestLimit, gated: bool, handler: F) -> MethodRouter<Arc<WebhookState>>
where
    F: Fn(Arc<WebhookState>, Request<Bytes>, Option<TooComplex>) -> Fut
        + Clone
        + Send
        + Sync
        + 'static,
    Fut: Future<Output = Response> + Send,
{
    let limit = limit.clone();
    post(
        move |State(state): State<Arc<WebhookState>>, request: axum::extract::Request| {
            let (limit, handler) = (limit.clone(), handler.clone());
            async move {
                if gated && let Some(refused) = refusal(&state, &request) {
                    return limit.refuse(request, refused).await;
                }
                limit
                    .run(request, |request, too_complex| {
                        handler(state, request, too_complex)
                    })
                    .await
            }
        },
    )
}

#[cfg(test)]
pub(crate) mod testing {
    //! Building the webhook's state without a cluster, for in-process tests of the handlers.

    use super::*;
    use axum::body::Body;
    use http_body_util::BodyExt;
    use kube::runtime::watcher;
    use tower::ServiceExt;

    /// A webhook state over caches fed by hand; `synced` feeds every base store's first list.
    pub fn state(synced: bool) -> Arc<WebhookState> {
        let caches = Caches::new();
        if synced {
            caches.apply_pps(watcher::Event::InitDone);
            caches.apply_pod(watcher::Event::InitDone);
            caches.apply_node(watcher::Event::InitDone);
            caches.apply_workload(
                &crate::workload::GroupKind::native_statefulset(),
                watcher::Event::InitDone,
            );
        }
        Arc::new(WebhookState::over(caches))
    }

    /// POSTs `body` to `path` through the router; returns the status and the JSON answer.
    pub async fn post(
        state: &Arc<WebhookState>,
        path: &str,
        body: impl Into<Body>,
    ) -> (StatusCode, serde_json::Value) {
        let request = axum::http::Request::post(path)
            .header("content-type", "application/json")
            .body(body.into())
            .expect("request");
        let response = router(state.clone())
            .oneshot(request)
            .await
            .expect("infallible");
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!(
                "{path} answered {status} with a body that is not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        (status, json)
    }
}
#[cfg(test)]
mod abuse_tests;
#[cfg(test)]
mod property_tests;
#[cfg(test)]
mod router_tests;
