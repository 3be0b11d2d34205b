//! `POST /validate-persistentpodstate`: admission of PersistentPodState CREATE and UPDATE in
//! either version. The rules are the pure [`crate::api::validation`].

use std::time::Duration;

use axum::response::Response;
use kube::Resource;
use kube::api::{ListParams, ObjectList};
use serde::Deserialize;
use serde_json::Value;
use tracing::Instrument;

use super::review::{Admission, AdmissionRequest, Review};
use super::{WebhookState, endpoints};
use crate::api::validation::{Context, validate};
use crate::api::{KRUISE_GROUP, PersistentPodState, TargetReference, api_group, keys_field};
use crate::metrics::AdmissionResult;
use crate::workload::{GroupKind, WorkloadRef};

/// How long the live read of a namespace's PersistentPodStates may take before the cache answers
/// (the API server gives the whole review `timeoutSeconds`, 5 in the manifests).
const LIVE_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Answers one PersistentPodState AdmissionReview. Uniqueness is checked live on CREATE, else
/// against the cache, so this route waits for the caches to sync.
pub async fn validate_pps(state: &WebhookState, review: Review) -> Response {
    let Review {
        request: req,
        received: start,
    } = review;
    let metrics = &state.metrics;
    let span = tracing::info_span!("admission", uid = %req.uid, namespace = req.namespace.as_deref().unwrap_or_default(), name = %req.name);
    // Attached to the future, not entered: a guard held across the await would stay entered on
    // the worker thread while this review waits, and wrap whatever else runs there.
    let (answer, result) = decide(state, &req).instrument(span).await;
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
            match tokio::time::timeout(LIVE_READ_TIMEOUT, list_targets(client, &workload.namespace))
                .await
            {
                Ok(Ok(list)) => Some(
                    list.items
                        .into_iter()
                        .filter(|pps| pps.targets(workload))
                        .filter_map(|pps| pps.metadata.name)
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

/// What the uniqueness check reads of a listed PersistentPodState: its name and target. The
/// rest of each object (its status above all) is skipped while parsing, not decoded: the
/// namespace's list is read on every CREATE.
#[derive(Clone, Debug, Deserialize)]
struct Targeting {
    metadata: Named,
    #[serde(default)]
    spec: TargetingSpec,
}

/// A listed object's name.
#[derive(Clone, Debug, Deserialize)]
struct Named {
    name: Option<String>,
}

/// A listed PersistentPodState's target, if it has one.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct TargetingSpec {
    target_ref: Option<TargetReference>,
}

impl Targeting {
    /// Whether it targets `workload` (matched by group, kind and name, in its namespace).
    fn targets(&self, workload: &WorkloadRef) -> bool {
        self.spec
            .target_ref
            .as_ref()
            .is_some_and(|t| t.name == workload.name && GroupKind::of_target(t) == workload.kind)
    }
}

/// The PersistentPodStates of `namespace`, read live, as [`Targeting`]s.
async fn list_targets(
    client: &kube::Client,
    namespace: &str,
) -> Result<ObjectList<Targeting>, kube::Error> {
    let url = PersistentPodState::url_path(&(), Some(namespace));
    let request = kube::core::Request::new(url)
        .list(&ListParams::default())
        .map_err(kube::Error::BuildRequest)?;
    client.request(request).await
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_listed_pps_is_read_for_its_name_and_target_only() {
        let list: ObjectList<Targeting> = serde_json::from_value(json!({
            "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodStateList",
            "metadata": {"resourceVersion": "9"},
            "items": [
                {"metadata": {"name": "native", "namespace": "ns"},
                 "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}},
                 "status": {"podStates": {"web-0": {"nodeName": "n1"}}, "observedGeneration": 1}},
                {"metadata": {"name": "advanced", "namespace": "ns"},
                 "spec": {"targetRef": {"apiVersion": "apps.kruise.io/v1beta1", "kind": "StatefulSet", "name": "web"}},
                 "status": "a status of another shape is skipped, not decoded"},
                {"metadata": {"name": "other", "namespace": "ns"},
                 "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "db"}}},
                {"metadata": {"name": "no-spec", "namespace": "ns"}}
            ]
        }))
        .expect("list");
        let web = WorkloadRef {
            namespace: "ns".into(),
            kind: GroupKind::native_statefulset(),
            name: "web".into(),
        };
        let named: Vec<_> = list
            .items
            .iter()
            .filter(|pps| pps.targets(&web))
            .filter_map(|pps| pps.metadata.name.as_deref())
            .collect();
        assert_eq!(named, ["native"]);
    }
}
