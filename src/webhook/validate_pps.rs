//! `POST /validate-persistentpodstate`: admission of PersistentPodState CREATE and UPDATE in
//! either version. The rules are the pure [`crate::api::validation`].

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::Response;
use kube::api::{Api, ListParams};
use serde_json::Value;
use tracing::Instrument;

use super::review::{Admission, AdmissionRequest, Review};
use super::{WebhookState, endpoints};
use crate::api::validation::{Context, validate};
use crate::api::{KRUISE_GROUP, PersistentPodState, api_group, keys_field};
use crate::metrics::AdmissionResult;
use crate::state::index::pps_target;
use crate::workload::{GroupKind, WorkloadRef};

/// How long the live read of a namespace's PersistentPodStates may take before the cache answers
/// (the API server gives the whole review `timeoutSeconds`, 5 in the manifests).
const LIVE_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Answers one PersistentPodState AdmissionReview. Uniqueness is checked live on CREATE, else
/// against the cache, so this route waits for the caches to sync.
pub async fn validate_pps(State(state): State<Arc<WebhookState>>, review: Review) -> Response {
    let Review {
        request: req,
        received: start,
    } = review;
    let metrics = &state.metrics;
    let span = tracing::info_span!("admission", uid = %req.uid, namespace = req.namespace.as_deref().unwrap_or_default(), name = %req.name);
    // Attached to the future, not entered: a guard held across the await would stay entered on
    // the worker thread while this review waits, and wrap whatever else runs there.
    let (answer, result) = decide(&state, &req).instrument(span).await;
    metrics.admission(endpoints::VALIDATE_PPS, result, start);
    answer.into_response(&req)
}

/// The other PersistentPodStates that target `workload`, but `name`, sorted. On CREATE they are
/// read live when an API server is at hand: a PersistentPodState created a moment ago may not be
/// in the cache yet (a second one for the workload would slip through), one deleted a moment ago
/// may still be there (a valid one would be refused). If that read fails or is slow, the cache
/// answers. On UPDATE (`targetRef` is immutable), the cache.
async fn others_for(
    state: &WebhookState,
    workload: &WorkloadRef,
    name: &str,
    create: bool,
) -> Vec<String> {
    let live = match (&state.client, create) {
        (Some(client), true) => {
            let api: Api<PersistentPodState> = Api::namespaced(client.clone(), &workload.namespace);
            match tokio::time::timeout(LIVE_READ_TIMEOUT, api.list(&ListParams::default())).await {
                Ok(Ok(list)) => Some(
                    list.items
                        .iter()
                        .filter(|pps| pps_target(pps).as_ref() == Some(workload))
                        .filter_map(|pps| pps.metadata.name.clone())
                        .collect::<Vec<_>>(),
                ),
                Ok(Err(error)) => {
                    tracing::warn!(%error, "cannot list the namespace's PersistentPodStates; the cache answers");
                    None
                }
                Err(_) => {
                    tracing::warn!(
                        "listing the namespace's PersistentPodStates timed out; the cache answers"
                    );
                    None
                }
            }
        }
        _ => None,
    };
    let mut others: Vec<String> = live
        .unwrap_or_else(|| state.caches.pps_names_for(workload))
        .into_iter()
        .filter(|other| other != name)
        .collect();
    others.sort();
    others
}

async fn decide(state: &WebhookState, req: &AdmissionRequest) -> (Admission, AdmissionResult) {
    let update = req.operation == "UPDATE";
    let concerned =
        req.kind.is(KRUISE_GROUP, "PersistentPodState") && (update || req.operation == "CREATE");
    let keys_field = keys_field(req.kind.version.as_deref().unwrap_or_default());
    let (Some(text), Some(keys_field), true) = (req.object(), keys_field, concerned) else {
        return (Admission::allow(), AdmissionResult::Allowed);
    };
    // Not decoded: refused with the reason (an object this large is not a PersistentPodState
    // anyone wrote by hand, and an unchecked one could break the rules).
    if let Some(t) = req.too_complex {
        return (
            Admission::deny(413, "RequestEntityTooLarge", t.message()),
            AdmissionResult::InvalidObject,
        );
    }
    let decode = |text: &str| serde_json::from_str::<Value>(text);
    let object = match decode(text) {
        Ok(object) => object,
        Err(e) => {
            let message = format!("the object cannot be read: {e}");
            return (
                Admission::deny(422, "Invalid", message),
                AdmissionResult::InvalidObject,
            );
        }
    };
    let namespace = req.namespace.clone().unwrap_or_default();
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or(req.name.as_str())
        .to_owned();
    let target = |field: &str| {
        object
            .pointer(&format!("/spec/targetRef/{field}"))
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    let workload = WorkloadRef {
        namespace,
        kind: GroupKind::new(api_group(target("apiVersion")), target("kind")),
        name: target("name").to_owned(),
    };
    let others = others_for(state, &workload, &name, !update).await;
    let is_custom_kind =
        |group: &str, kind: &str| state.custom_kinds.contains(&GroupKind::new(group, kind));
    let ctx = Context {
        keys_field,
        is_custom_kind: &is_custom_kind,
        others_for_target: &others,
    };
    // An old object that cannot be read ratchets nothing: every rule applies.
    let old = req
        .old_object()
        .filter(|_| update)
        .and_then(|text| decode(text).ok());
    let errors = validate(&object, old.as_ref(), &ctx);
    if errors.is_empty() {
        return (Admission::allow(), AdmissionResult::Allowed);
    }
    let message = format!(
        "PersistentPodState {name:?} is invalid: {}",
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    );
    tracing::info!(%message, "denied");
    (
        Admission::deny(422, "Invalid", message),
        AdmissionResult::Denied,
    )
}
