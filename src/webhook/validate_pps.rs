//! `POST /validate-persistentpodstate`: admission of PersistentPodState CREATE and UPDATE in
//! either version. The rules are the pure [`crate::api::validation`].

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use kube::core::admission::{AdmissionResponse, Operation};
use kube::core::response::Status;
use serde_json::Value;

use super::WebhookState;
use super::review::Review;
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
        parsed,
        received: start,
    } = review;
    let metrics = &state.metrics;
    let req = &parsed.request;
    let span = tracing::info_span!("admission", uid = %req.uid, namespace = req.namespace.as_deref().unwrap_or_default(), name = %req.name);
    let _entered = span.enter();
    let response = AdmissionResponse::from(req);
    let concerned = req.kind.group == KRUISE_GROUP
        && req.kind.kind == "PersistentPodState"
        && matches!(req.operation, Operation::Create | Operation::Update);
    let keys_field = keys_field(&req.kind.version);
    let (Some(object), Some(keys_field)) = (parsed.object.filter(|_| concerned), keys_field) else {
        metrics.admission(PATH, AdmissionResult::Allowed, start);
        return Json(response.into_review()).into_response();
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
    let old = parsed
        .old_object
        .filter(|_| req.operation == Operation::Update);
    let errors = validate(&object, old.as_ref(), &ctx);
    let (response, result) = if errors.is_empty() {
        (response, AdmissionResult::Allowed)
    } else {
        let message = format!(
            "PersistentPodState {name:?} is invalid: {}",
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        );
        tracing::info!(%message, "denied");
        let mut denied = response.deny(&message);
        denied.result = Status::failure(&message, "Invalid").with_code(422);
        (denied, AdmissionResult::Denied)
    };
    metrics.admission(PATH, result, start);
    Json(response.into_review()).into_response()
}
