//! `POST /mutate-pod`: answers Pod CREATE reviews from the shared caches. The webhook has no
//! side effects, so a dry-run request is answered exactly like a real one.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use kube::runtime::events::EventType;
use serde_json::Value;

use super::WebhookState;
use super::inject::injection_for;
use super::review;
use crate::metrics::{AdmissionResult, InjectionKind, InjectionLabels, SkipLabels, SkipReason};
use crate::workload::pod_workload;

/// The path this handler is mounted on.
pub const PATH: &str = "/mutate-pod";

/// Answers one pod AdmissionReview.
pub async fn mutate_pod(State(state): State<Arc<WebhookState>>, body: Bytes) -> Response {
    let start = Instant::now();
    let metrics = &state.metrics;
    let parsed = match review::read_review(&state, PATH, start, &body) {
        Ok(p) => p,
        Err(rejection) => return rejection.into_response(),
    };
    let (response, result) = decide(&state, &parsed.request, parsed.object);
    metrics.admission(PATH, result, start);
    Json(response.into_review()).into_response()
}

fn skip(
    state: &WebhookState,
    req: &AdmissionRequest<DynamicObject>,
    reason: SkipReason,
) -> (AdmissionResponse, AdmissionResult) {
    state
        .metrics
        .skipped
        .get_or_create(&SkipLabels { reason })
        .inc();
    tracing::debug!(uid = %req.uid, namespace = ?req.namespace, name = %req.name, reason = reason.as_str(), "allowed without patch");
    (AdmissionResponse::from(req), AdmissionResult::Allowed)
}

fn decide(
    state: &WebhookState,
    req: &AdmissionRequest<DynamicObject>,
    object: Option<Value>,
) -> (AdmissionResponse, AdmissionResult) {
    let is_pod = req.kind.group.is_empty() && req.kind.kind == "Pod";
    if !is_pod
        || req.operation != Operation::Create
        || req.sub_resource.as_deref().is_some_and(|s| !s.is_empty())
    {
        return skip(state, req, SkipReason::NotPodCreate);
    }
    let pod: Pod = match object.map(serde_json::from_value) {
        Some(Ok(pod)) => pod,
        Some(Err(e)) => return invalid_object(req, &e.to_string()),
        None => return invalid_object(req, "the request carries no object"),
    };
    let namespace = req
        .namespace
        .clone()
        .or_else(|| pod.metadata.namespace.clone())
        .unwrap_or_default();
    let name = pod
        .metadata
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| req.name.clone());

    let Some(workload) = pod_workload(&pod, &namespace) else {
        return skip(state, req, SkipReason::NoController);
    };
    if !state.custom_kinds.handles(&workload.kind) {
        return skip(state, req, SkipReason::NotStatefulSet);
    }
    let Some(pps) = state.caches.pps_for(&workload) else {
        return skip(state, req, SkipReason::NoPersistentPodState);
    };
    let Some(pod_state) = pps.status.as_ref().and_then(|s| s.pod_states.get(&name)) else {
        return skip(state, req, SkipReason::NoState);
    };
    let pps_name = pps.metadata.name.as_deref().unwrap_or_default();
    let any_node_with = |labels: &_| state.caches.node_labels.any_node_with(labels);
    let injection = injection_for(&pod, pps_name, &pps.spec, pod_state, &any_node_with);

    let m = &state.metrics;
    for (kind, n) in [
        (InjectionKind::Required, injection.required),
        (InjectionKind::Preferred, injection.preferred),
        (InjectionKind::Annotations, injection.annotations),
    ] {
        if n > 0 {
            m.injections
                .get_or_create(&InjectionLabels { kind })
                .inc_by(n as u64);
        }
    }
    // Events are side effects: a dry run gets the same answer but publishes nothing.
    let events = state.events.as_ref().filter(|_| !req.dry_run);
    if let (Some(events), Some(values)) = (events, &injection.unplaceable) {
        let wanted: Vec<String> = values.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let note = format!(
            "pod {name}: no node has {}; injected only the preferred placement",
            wanted.join(",")
        );
        events.publish(
            &pps,
            EventType::Warning,
            "RequiredTopologySkipped",
            "Inject",
            note,
        );
    }
    if let (Some(events), false) = (events, injection.conflicts.is_empty()) {
        let keys: Vec<&str> = injection.conflicts.iter().map(|c| c.key.as_str()).collect();
        let note = format!(
            "pod {name} sets {} itself; the recorded value was not injected",
            keys.join(",")
        );
        events.publish(
            &pps,
            EventType::Warning,
            "NodeSelectorConflict",
            "Inject",
            note,
        );
    }
    if let Some(values) = &injection.unplaceable {
        m.required_unplaceable.inc();
        tracing::warn!(uid = %req.uid, %namespace, pod = %name, pps = pps_name, ?values,
            "no node has the recorded required values; injecting only the preferred part");
    }
    for c in &injection.conflicts {
        m.injection_conflicts.inc();
        tracing::info!(uid = %req.uid, %namespace, pod = %name, key = %c.key, "pod sets its own nodeSelector value; recorded value not injected");
    }
    if injection.patch.0.is_empty() {
        return (AdmissionResponse::from(req), AdmissionResult::Allowed);
    }
    match AdmissionResponse::from(req).with_patch(injection.patch) {
        Ok(resp) => {
            tracing::info!(uid = %req.uid, %namespace, pod = %name, pps = pps_name,
                required = injection.required, preferred = injection.preferred,
                annotations = injection.annotations, dry_run = req.dry_run, "injected persistent pod state");
            (resp, AdmissionResult::Patched)
        }
        Err(e) => {
            tracing::error!(uid = %req.uid, error = %e, "could not serialize the patch; allowing without it");
            (AdmissionResponse::from(req), AdmissionResult::Allowed)
        }
    }
}

fn invalid_object(
    req: &AdmissionRequest<DynamicObject>,
    error: &str,
) -> (AdmissionResponse, AdmissionResult) {
    tracing::warn!(uid = %req.uid, namespace = ?req.namespace, name = %req.name, %error, "object is not a readable Pod; allowed without patch");
    (AdmissionResponse::from(req), AdmissionResult::InvalidObject)
}
