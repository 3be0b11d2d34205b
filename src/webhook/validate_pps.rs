//! `POST /validate-persistentpodstate`: admission of PersistentPodState CREATE and UPDATE in
//! either version. The rules are the pure [`crate::api::validation`].

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use serde_json::Value;

use super::WebhookState;
use super::review::{Admission, AdmissionRequest, Review};
use crate::api::validation::{Context, validate};
use crate::api::{KRUISE_GROUP, api_group, keys_field};
use crate::metrics::AdmissionResult;
use crate::workload::{GroupKind, WorkloadRef};

/// The path this handler is mounted on.
pub const PATH: &str = "/validate-persistentpodstate";

/// Answers one PersistentPodState AdmissionReview. Uniqueness is checked against the cache, so
/// this route waits for the caches to sync.
pub async fn validate_pps(State(state): State<Arc<WebhookState>>, review: Review) -> Response {
    let Review {
        request: req,
        received: start,
    } = review;
    let metrics = &state.metrics;
    let span = tracing::info_span!("admission", uid = %req.uid, namespace = req.namespace.as_deref().unwrap_or_default(), name = %req.name);
    let _entered = span.enter();
    let (answer, result) = decide(&state, &req);
    metrics.admission(PATH, result, start);
    answer.into_response(&req)
}

fn decide(state: &WebhookState, req: &AdmissionRequest) -> (Admission, AdmissionResult) {
    let update = req.operation == "UPDATE";
    let concerned =
        req.kind.is(KRUISE_GROUP, "PersistentPodState") && (update || req.operation == "CREATE");
    let keys_field = keys_field(req.kind.version.as_deref().unwrap_or_default());
    let (Some(text), Some(keys_field), true) = (req.object(), keys_field, concerned) else {
        return (Admission::allow(), AdmissionResult::Allowed);
    };
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
    let others: Vec<String> = state
        .caches
        .pps_names_for(&workload)
        .into_iter()
        .filter(|other| *other != name)
        .collect();
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
