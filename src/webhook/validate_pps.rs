//! `POST /validate-persistentpodstate`: admission of PersistentPodState CREATE and UPDATE in
//! either version. The rules are the pure [`crate::api::validation`].

use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::response::Response;
use kube::Resource;
use kube::api::{ListParams, ObjectList};
use serde::Deserialize;
use serde_json::Value;
use tracing::Instrument;

use super::review::{Admission, AdmissionRequest, Review};
use super::{WebhookState, endpoints};
use crate::api::validation::{Context, validate};
use crate::api::{
    Cut, KRUISE_GROUP, PersistentPodState, TARGET_NAME_FIELD, TargetReference, api_group,
    keys_field,
};
use crate::metrics::AdmissionResult;
use crate::workload::{GroupKind, WorkloadRef};

/// Keys whose values validation never reads, skipped wherever they are when an object is
/// decoded ([`Unread`]): the status (the API server copies the stored one into an update of the
/// main resource) and the managed fields (which name every recorded pod).
pub const UNREAD_KEYS: [&str; 2] = ["status", "managedFields"];

/// A JSON document decoded without the values of [`UNREAD_KEYS`], wherever they are.
struct Unread(Value);

impl<'de> Deserialize<'de> for Unread {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(UnreadVisitor).map(Unread)
    }
}

struct UnreadVisitor;

impl<'de> serde::de::Visitor<'de> for UnreadVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Unread(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if UNREAD_KEYS.contains(&key.as_str()) {
                map.next_value::<serde::de::IgnoredAny>()?;
            } else {
                let Unread(value) = map.next_value()?;
                object.insert(key, value);
            }
        }
        Ok(Value::Object(object))
    }
}

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
    let span = tracing::info_span!("admission", uid = %req.uid, namespace = %Cut(req.namespace.as_deref().unwrap_or_default()), name = %Cut(&req.name));
    // Attached to the future, not entered: a guard held across the await would stay entered on
    // the worker thread while this review waits, and wrap whatever else runs there.
    let (answer, result) = decide(state, &req).instrument(span).await;
    metrics.admission(endpoints::VALIDATE_PPS, result, start);
    answer.into_response(&req)
}

/// The other PersistentPodStates that target `workload`, but `name` and those being deleted
/// (held by a finalizer, they steer no pod: their replacement may be created), sorted. On
/// CREATE they are
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
            match tokio::time::timeout(
                LIVE_READ_TIMEOUT,
                read_live(client, &state.target_field, workload),
            )
            .await
            {
                Ok(Ok(names)) => Some(names),
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
        .unwrap_or_else(|| state.caches.pps_names_not_deleting_for(workload))
        .into_iter()
        .filter(|other| other != name)
        .collect();
    others.sort();
    others
}

/// How long the namespace's whole list is read after the API server refused to filter by
/// `spec.targetRef.name`, before the filter is asked for again (the CustomResourceDefinition or
/// the API server may have been upgraded meanwhile).
const FIELD_REFUSED_FOR: Duration = Duration::from_secs(600);

/// Whether the API server filters PersistentPodStates by `spec.targetRef.name`, the
/// CustomResourceDefinition's selectable field (Kubernetes >= 1.31, or 1.30 with the
/// `CustomResourceFieldSelectors` gate on, and a CustomResourceDefinition that declares it).
/// Where it does, a CREATE's live read returns the PersistentPodStates of the workload's name
/// alone instead of the namespace's every one.
#[derive(Debug, Default)]
pub struct TargetField {
    /// When the API server last refused the filter.
    refused_at: Mutex<Option<Instant>>,
}

impl TargetField {
    /// Whether to ask the API server for the filter now.
    fn worth_asking(&self) -> bool {
        let refused_at = *self
            .refused_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        refused_at.is_none_or(|at| at.elapsed() >= FIELD_REFUSED_FOR)
    }

    /// Notes a refusal: the namespace's whole list is read for [`FIELD_REFUSED_FOR`].
    fn refused(&self, message: &str) {
        let mut refused_at = self
            .refused_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if refused_at.is_none() {
            tracing::info!(
                reason = message,
                "the API server does not filter PersistentPodStates by spec.targetRef.name \
                 (Kubernetes before 1.31, or the CustomResourceDefinition without its selectable \
                 field); a CREATE reads its namespace's whole list"
            );
        }
        *refused_at = Some(Instant::now());
    }
}

/// The names of the PersistentPodStates that target `workload`, read live: only those of the
/// workload's name where the API server filters by it, else the namespace's whole list.
async fn read_live(
    client: &kube::Client,
    field: &TargetField,
    workload: &WorkloadRef,
) -> Result<Vec<String>, kube::Error> {
    let names = |list: ObjectList<Targeting>| {
        list.items
            .into_iter()
            .filter(|pps| pps.targets(workload) && pps.metadata.deletion_timestamp.is_none())
            .filter_map(|pps| pps.metadata.name)
            .collect()
    };
    if field.worth_asking() {
        let selector = format!("{TARGET_NAME_FIELD}={}", escape_field_value(&workload.name));
        let params = ListParams::default().fields(&selector);
        match list_targets(client, &workload.namespace, &params).await {
            Ok(list) => return Ok(names(list)),
            // What an API server answers a field it does not select by.
            Err(kube::Error::Api(refusal)) if refusal.code == 400 => {
                field.refused(&refusal.message);
            }
            Err(error) => return Err(error),
        }
    }
    list_targets(client, &workload.namespace, &ListParams::default())
        .await
        .map(names)
}

/// `value` escaped for a field selector (as apimachinery's `fields.EscapeValue`: `\`, `,` and
/// `=` are preceded by a backslash).
fn escape_field_value(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        if matches!(c, '\\' | ',' | '=') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// What the uniqueness check reads of a listed PersistentPodState: its name and target. The
/// rest of each object (its status above all) is skipped while parsing, not decoded.
#[derive(Clone, Debug, Deserialize)]
struct Targeting {
    metadata: Named,
    #[serde(default)]
    spec: TargetingSpec,
}

/// A listed object's name, and whether it is being deleted.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Named {
    name: Option<String>,
    deletion_timestamp: Option<String>,
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

/// The PersistentPodStates of `namespace` that `params` select, read live, as [`Targeting`]s.
async fn list_targets(
    client: &kube::Client,
    namespace: &str,
    params: &ListParams,
) -> Result<ObjectList<Targeting>, kube::Error> {
    let url = PersistentPodState::url_path(&(), Some(namespace));
    let request = kube::core::Request::new(url)
        .list(params)
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
    let decode = |text: &str| serde_json::from_str::<Unread>(text).map(|Unread(v)| v);
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
    // The answer says it all; the log line at most its first KiB.
    let logged: String = message.chars().take(1024).collect();
    tracing::info!(message = %logged, "denied");
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

    #[test]
    fn field_selector_values_are_escaped_as_apimachinery_does() {
        assert_eq!(escape_field_value("web"), "web");
        assert_eq!(escape_field_value(r"a,b=c\d"), r"a\,b\=c\\d");
    }

    /// The live read asks the API server for the workload's name alone; refused (an API server
    /// or CRD without the selectable field), it reads the namespace's list, and keeps doing so
    /// without asking again; either way only PersistentPodStates of the workload's kind count.
    #[tokio::test]
    async fn the_live_read_is_narrowed_by_the_target_field_or_falls_back_to_the_namespace() {
        use http::{Request, Response};
        use kube::client::Body;

        let (service, mut api) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "default");
        let field = TargetField::default();
        let web = WorkloadRef {
            namespace: "ns".into(),
            kind: GroupKind::native_statefulset(),
            name: "web".into(),
        };
        let list = json!({
            "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodStateList",
            "metadata": {"resourceVersion": "9"},
            "items": [
                {"metadata": {"name": "native"},
                 "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}}},
                {"metadata": {"name": "advanced"},
                 "spec": {"targetRef": {"apiVersion": "apps.kruise.io/v1beta1", "kind": "StatefulSet", "name": "web"}}}
            ]
        });
        let refusal = json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "BadRequest",
            "code": 400, "message": "field label not supported: spec.targetRef.name"
        });
        let respond = |status: u16, body: &Value| {
            Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(body).expect("json")))
                .expect("response")
        };
        let path = "/apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates";

        // Served: one request, with the field selector.
        let read = tokio::spawn({
            let (client, web) = (client.clone(), web.clone());
            async move { read_live(&client, &TargetField::default(), &web).await }
        });
        let (request, send) = api.next_request().await.expect("a list");
        assert_eq!(request.uri().path(), path);
        assert_eq!(
            request.uri().query(),
            Some("&fieldSelector=spec.targetRef.name%3Dweb")
        );
        send.send_response(respond(200, &list));
        let names = read.await.expect("joined").expect("read");
        assert_eq!(names, ["native"]);

        // Refused: the namespace's list, then no selector until the refusal has aged.
        let answer = {
            let (client, web) = (client.clone(), web.clone());
            let read = async move {
                let first = read_live(&client, &field, &web).await;
                let second = read_live(&client, &field, &web).await;
                (first, second)
            };
            let serve = async move {
                let mut queries = Vec::new();
                for status in [400, 200, 200] {
                    let (request, send) = api.next_request().await.expect("a list");
                    assert_eq!(request.uri().path(), path);
                    queries.push(request.uri().query().map(str::to_owned));
                    send.send_response(respond(
                        status,
                        if status == 400 { &refusal } else { &list },
                    ));
                }
                queries
            };
            tokio::join!(read, serve)
        };
        let ((first, second), queries) = answer;
        assert_eq!(first.expect("fell back"), ["native"]);
        assert_eq!(second.expect("namespace list"), ["native"]);
        assert_eq!(
            queries,
            [
                Some("&fieldSelector=spec.targetRef.name%3Dweb".to_owned()),
                Some(String::new()),
                Some(String::new())
            ]
        );
    }

    /// The values and keys of a decoded document.
    fn nodes(value: &Value) -> usize {
        1 + match value {
            Value::Array(items) => items.iter().map(nodes).sum(),
            Value::Object(map) => map.values().map(|v| 1 + nodes(v)).sum(),
            _ => 0,
        }
    }

    fn documents() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i32>().prop_map(Value::from),
            "[a-z\\\\\"{}:, ]{0,6}".prop_map(Value::String),
        ];
        leaf.prop_recursive(5, 64, 6, |inner| {
            let key = prop_oneof![
                Just("status".to_owned()),
                Just("managedFields".to_owned()),
                "[a-z:\"]{0,4}",
            ];
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec((key, inner), 0..6)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
        /// What the request limit charges a validation for is never less than what decoding
        /// its object builds.
        #[test]
        fn the_pruned_count_bounds_what_the_decoder_builds(doc in documents(), pretty: bool) {
            let text = if pretty {
                serde_json::to_string_pretty(&doc)
            } else {
                serde_json::to_string(&doc)
            }
            .expect("json");
            let Unread(decoded) = serde_json::from_str(&text).expect("decodes");
            let counted = crate::serving::json_values_pruned(text.as_bytes(), &UNREAD_KEYS);
            proptest::prop_assert!(counted >= nodes(&decoded), "{counted} < {}: {text}", nodes(&decoded));
            proptest::prop_assert!(counted <= crate::serving::json_values(text.as_bytes()));
        }

        #[test]
        fn the_pruned_count_takes_any_bytes(
            body in proptest::collection::vec(proptest::sample::select(
                b"\"\\{}[],: \nstaus1".to_vec()), 0..200),
        ) {
            let counted = crate::serving::json_values_pruned(&body, &["status"]);
            proptest::prop_assert!(counted <= crate::serving::json_values(&body));
        }
    }

    #[test]
    fn an_update_recording_thousands_of_pods_costs_what_its_spec_does() {
        let states: serde_json::Map<String, Value> = (0..5_000)
            .map(|i| {
                (
                    format!("web-{i}"),
                    json!({"nodeName": format!("node-{i}"), "nodeTopologyLabels": {"kubernetes.io/hostname": format!("node-{i}")}}),
                )
            })
            .collect();
        let object = json!({
            "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": "web", "namespace": "ns", "managedFields": [{"manager": "m", "fieldsV1": {"f:status": {"f:podStates": states.keys().map(|k| (format!("f:{k}"), json!({}))).collect::<serde_json::Map<_, _>>()}}}]},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}},
            "status": {"podStates": states}
        });
        let review =
            serde_json::to_vec(&json!({"request": {"object": object, "oldObject": object}}))
                .expect("json");
        let full = crate::serving::json_values(&review);
        let pruned = crate::serving::json_values_pruned(&review, &UNREAD_KEYS);
        assert!(
            full * crate::serving::VALUE_COST > super::super::VALIDATE_BUDGET.bytes,
            "{full}"
        );
        assert!(pruned < 100, "{pruned}");
        let Unread(decoded) = serde_json::from_slice(&review).expect("decodes");
        assert!(decoded.pointer("/request/object/status").is_none());
        assert_eq!(
            decoded.pointer("/request/object/spec/targetRef/name"),
            Some(&json!("web"))
        );
    }
}
