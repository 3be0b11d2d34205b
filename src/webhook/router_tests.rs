//! In-process tests of the admission routes: each request goes through the real router (the
//! request limits, the review read, the sync refusal, the handlers) with `Router::oneshot`,
//! over caches fed by hand.

use axum::http::StatusCode;
use kube::runtime::watcher;
use serde_json::{Value, json};

use super::endpoints;
use super::testing::{post, state};
use crate::api::PersistentPodState;

fn review(kind: (&str, &str, &str), operation: &str, object: Value, old: Option<Value>) -> Value {
    let (group, version, kind) = kind;
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "uid-1", "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": "x"},
            "operation": operation, "userInfo": {}, "namespace": "ns", "name": "web-0",
            "object": object, "oldObject": old
        }
    })
}

const POD: (&str, &str, &str) = ("", "v1", "Pod");

fn pod(owner: Option<&str>) -> Value {
    let owners = owner.map(|o| {
        json!([{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": o, "uid": "u", "controller": true}])
    });
    json!({"metadata": {"name": format!("{}-0", owner.unwrap_or("bare")), "namespace": "ns", "ownerReferences": owners},
           "spec": {"containers": [{"name": "c"}]}})
}

fn pps(name: &str, target: &str, states: Value) -> PersistentPodState {
    serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": target},
                 "requiredPersistentTopology": {"keys": ["zone"]}},
        "status": {"observedGeneration": 1, "podStates": states}
    }))
    .expect("pps")
}

fn node(name: &str, zone: &str) -> k8s_openapi::api::core::v1::Node {
    serde_json::from_value(json!({"metadata": {"name": name, "labels": {"zone": zone}}}))
        .expect("node")
}

/// What a test expects of an admission answer.
#[derive(Debug, PartialEq)]
enum Answer {
    /// HTTP 200, the uid echoed, allowed, no patch.
    Allowed,
    /// HTTP 200, the uid echoed, allowed with a JSONPatch.
    Patched,
    /// HTTP 200, the uid echoed, denied with this code and a message containing the text.
    Denied(u16, &'static str),
    /// No review: this HTTP status with a JSON `error` message.
    Error(u16),
}

fn answer(status: StatusCode, body: &Value) -> Answer {
    if status != StatusCode::OK {
        assert!(body["error"].is_string(), "JSON error message: {body}");
        return Answer::Error(status.as_u16());
    }
    let response = &body["response"];
    assert_eq!(response["uid"], "uid-1", "uid echoed: {body}");
    if response["allowed"] == json!(true) {
        if response["patchType"] == "JSONPatch" {
            Answer::Patched
        } else {
            assert!(response.get("patch").is_none_or(Value::is_null), "{body}");
            Answer::Allowed
        }
    } else {
        let code = response["status"]["code"].as_u64().unwrap_or_default() as u16;
        let message = response["status"]["message"].as_str().unwrap_or_default();
        // The expected text is checked by the caller; here the shape.
        assert!(!message.is_empty(), "denial has a message: {body}");
        let text = ["weight", "already targets", "targetRef"]
            .into_iter()
            .find(|t| message.contains(t))
            .unwrap_or("other");
        Answer::Denied(code, text)
    }
}

#[tokio::test]
async fn mutate_pod_answers_every_case_with_the_uid_or_a_json_error() {
    let synced = state(true);
    let caches = &synced.caches;
    caches.apply_pps(watcher::Event::Apply(pps(
        "web",
        "web",
        json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"}}}),
    )));
    caches.apply_pps(watcher::Event::Apply(pps("nostate", "nostate", json!({}))));
    caches.apply_node(watcher::Event::Apply(node("n1", "z1")));
    let body = |v: Value| serde_json::to_vec(&v).expect("json");
    let cases: Vec<(&str, Vec<u8>, Answer)> = vec![
        (
            "injects the recorded zone",
            body(review(POD, "CREATE", pod(Some("web")), None)),
            Answer::Patched,
        ),
        (
            "not a pod",
            body(review(
                ("", "v1", "Service"),
                "CREATE",
                pod(Some("web")),
                None,
            )),
            Answer::Allowed,
        ),
        (
            "not a create",
            body(review(POD, "UPDATE", pod(Some("web")), None)),
            Answer::Allowed,
        ),
        (
            "no owner",
            body(review(POD, "CREATE", pod(None), None)),
            Answer::Allowed,
        ),
        (
            "no PPS",
            body(review(POD, "CREATE", pod(Some("other")), None)),
            Answer::Allowed,
        ),
        (
            "no state",
            body(review(POD, "CREATE", pod(Some("nostate")), None)),
            Answer::Allowed,
        ),
        (
            "unreadable object",
            body(review(POD, "CREATE", json!({"spec": []}), None)),
            Answer::Allowed,
        ),
        (
            "no object",
            body(review(POD, "CREATE", Value::Null, None)),
            Answer::Allowed,
        ),
        ("not JSON", b"{not json".to_vec(), Answer::Error(400)),
        // Bodies the API server never sends, whose uid still reads alone: denied, with it.
        (
            "a field repeated",
            br#"{"apiVersion":"admission.k8s.io/v1","request":{"uid":"uid-1","name":"a","name":"b","operation":"CREATE","object":{}}}"#.to_vec(),
            Answer::Denied(400, "other"),
        ),
        (
            "the uid repeated",
            br#"{"request":{"uid":"uid-1","uid":"uid-2"}}"#.to_vec(),
            Answer::Error(400),
        ),
        (
            "not a review",
            body(json!({"kind": "Pod"})),
            Answer::Error(400),
        ),
        (
            "no request",
            body(json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"})),
            Answer::Error(400),
        ),
    ];
    for (what, request, want) in cases {
        let (status, json) = post(&synced, endpoints::MUTATE_POD, request).await;
        assert_eq!(answer(status, &json), want, "{what}: {json}");
        if want == Answer::Patched {
            let patch: json_patch::Patch =
                serde_json::from_slice(&patch_bytes(&json["response"]["patch"]))
                    .expect("a JSON patch");
            let mut object = pod(Some("web"));
            json_patch::patch(&mut object, &patch).expect("applies");
            assert_eq!(
                object["spec"]["nodeSelector"],
                json!({"zone": "z1"}),
                "{what}"
            );
        }
    }
    let metrics = synced.metrics.encode();
    for reason in [
        "not_pod_create",
        "no_controller",
        "no_persistent_pod_state",
        "no_state",
    ] {
        assert!(
            metrics.contains(&format!(
                "pps_admission_skipped_total{{reason=\"{reason}\"}}"
            )),
            "{reason} counted: {metrics}"
        );
    }
    assert!(
        metrics.contains(
            r#"pps_admission_requests_total{endpoint="/mutate-pod",result="invalid_object"} 2"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            r#"pps_admission_requests_total{endpoint="/mutate-pod",result="bad_request"} 5"#
        ),
        "{metrics}"
    );

    let unsynced = state(false);
    let (status, json) = post(
        &unsynced,
        endpoints::MUTATE_POD,
        body(review(POD, "CREATE", pod(Some("web")), None)),
    )
    .await;
    assert_eq!(
        answer(status, &json),
        Answer::Error(503),
        "before the caches synced"
    );
}

/// The bytes of a response's `patch` (base64, as the API documents, or kube-core's array of
/// byte values).
fn patch_bytes(patch: &Value) -> Vec<u8> {
    use base64::Engine;
    match patch {
        Value::String(text) => base64::engine::general_purpose::STANDARD
            .decode(text)
            .expect("base64"),
        other => serde_json::from_value(other.clone()).expect("bytes"),
    }
}

fn pps_object(version: &str, name: &str, target: &str, weight: i64) -> Value {
    let keys = crate::api::keys_field(version).expect("served version");
    json!({
        "apiVersion": format!("apps.kruise.io/{version}"), "kind": "PersistentPodState",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": target},
                 "preferredPersistentTopology": [{"weight": weight, "preference": {keys: ["kubernetes.io/hostname"]}}]}
    })
}

#[tokio::test]
async fn validate_pps_allows_denies_and_rejects_bad_bodies() {
    let synced = state(true);
    synced
        .caches
        .apply_pps(watcher::Event::Apply(pps("taken", "busy", json!({}))));
    let kind = |v| ("apps.kruise.io", v, "PersistentPodState");
    let body = |v: Value| serde_json::to_vec(&v).expect("json");
    let cases: Vec<(&str, Vec<u8>, Answer)> = vec![
        (
            "valid v1beta1",
            body(review(
                kind("v1beta1"),
                "CREATE",
                pps_object("v1beta1", "a", "a", 50),
                None,
            )),
            Answer::Allowed,
        ),
        (
            "valid v1alpha1",
            body(review(
                kind("v1alpha1"),
                "CREATE",
                pps_object("v1alpha1", "a", "a", 50),
                None,
            )),
            Answer::Allowed,
        ),
        (
            "weight 0",
            body(review(
                kind("v1beta1"),
                "CREATE",
                pps_object("v1beta1", "a", "a", 0),
                None,
            )),
            Answer::Denied(422, "weight"),
        ),
        (
            "second PPS for a workload",
            body(review(
                kind("v1beta1"),
                "CREATE",
                pps_object("v1beta1", "b", "busy", 5),
                None,
            )),
            Answer::Denied(422, "already targets"),
        ),
        (
            "changed target",
            body(review(
                kind("v1beta1"),
                "UPDATE",
                pps_object("v1beta1", "a", "x", 5),
                Some(pps_object("v1beta1", "a", "a", 5)),
            )),
            Answer::Denied(422, "targetRef"),
        ),
        (
            "a delete is not looked at",
            body(review(
                kind("v1beta1"),
                "DELETE",
                Value::Null,
                Some(pps_object("v1beta1", "a", "a", 0)),
            )),
            Answer::Allowed,
        ),
        ("not JSON", b"\xff\xfe".to_vec(), Answer::Error(400)),
        // Bodies the API server never sends, whose uid still reads alone: denied, with it, in
        // the version the review came in.
        (
            "a number out of range",
            br#"{"apiVersion":"admission.k8s.io/v1beta1","request":{"uid":"uid-1","dryRun":1e400}}"#.to_vec(),
            Answer::Denied(400, "other"),
        ),
        (
            "a field repeated",
            br#"{"request":{"uid":"uid-1","operation":"CREATE","operation":"UPDATE"}}"#.to_vec(),
            Answer::Denied(400, "other"),
        ),
    ];
    for (what, request, want) in cases {
        let (status, json) = post(&synced, endpoints::VALIDATE_PPS, request).await;
        assert_eq!(answer(status, &json), want, "{what}: {json}");
        if what == "a number out of range" {
            assert_eq!(json["apiVersion"], "admission.k8s.io/v1beta1", "{json}");
        }
    }
    let (status, json) = post(
        &state(false),
        endpoints::VALIDATE_PPS,
        body(review(
            kind("v1beta1"),
            "CREATE",
            pps_object("v1beta1", "a", "a", 50),
            None,
        )),
    )
    .await;
    assert_eq!(
        answer(status, &json),
        Answer::Error(503),
        "uniqueness needs the caches"
    );
    // An update of the main resource of one recording 3,000 pods (the API server copies the
    // stored status and managed fields into both objects): judged on its spec, not refused as
    // too large to decode.
    let mut recorded = pps_object("v1beta1", "a", "a", 50);
    let states: serde_json::Map<String, Value> = (0..3_000)
        .map(|i| {
            let state = json!({"nodeName": format!("n-{i}"), "podUID": format!("u-{i}"),
                "nodeTopologyLabels": {"kubernetes.io/hostname": format!("n-{i}")}});
            (format!("a-{i}"), state)
        })
        .collect();
    let fields: serde_json::Map<String, Value> = states
        .keys()
        .map(|k| (format!("f:{k}"), json!({".": {}})))
        .collect();
    recorded["status"] = json!({"observedGeneration": 1, "podStates": states});
    recorded["metadata"]["managedFields"] = json!([{"manager": "persistent-pod-state",
        "operation": "Update", "subresource": "status",
        "fieldsV1": {"f:status": {"f:podStates": fields}}}]);
    let mut labelled = recorded.clone();
    labelled["metadata"]["labels"] = json!({"team": "db"});
    let update = body(review(kind("v1beta1"), "UPDATE", labelled, Some(recorded)));
    assert!(update.len() < super::MAX_BODY, "{}", update.len());
    let (status, json) = post(&synced, endpoints::VALIDATE_PPS, update).await;
    assert_eq!(answer(status, &json), Answer::Allowed, "{json}");
}

fn conversion(desired: &str, objects: Vec<Value>) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
        "request": {"uid": "conv-1", "desiredAPIVersion": desired, "objects": objects}
    }))
    .expect("json")
}

#[tokio::test]
async fn convert_works_both_ways_before_sync_and_rejects_bad_bodies() {
    // Conversion needs no cache: served before the caches synced.
    let unsynced = state(false);
    let alpha = pps_object("v1alpha1", "a", "a", 50);
    let beta = pps_object("v1beta1", "a", "a", 50);
    for (from, to, want) in [
        (&alpha, "apps.kruise.io/v1beta1", &beta),
        (&beta, "apps.kruise.io/v1alpha1", &alpha),
    ] {
        let (status, json) = post(
            &unsynced,
            endpoints::CONVERT,
            conversion(to, vec![from.clone()]),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{json}");
        assert_eq!(json["response"]["uid"], "conv-1");
        assert_eq!(json["response"]["result"]["status"], "Success", "{json}");
        assert_eq!(&json["response"]["convertedObjects"][0], want);
    }
    let (status, json) = post(
        &unsynced,
        endpoints::CONVERT,
        conversion("apps.kruise.io/v9", vec![alpha.clone()]),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(json["response"]["uid"], "conv-1");
    assert_eq!(json["response"]["result"]["status"], "Failure", "{json}");
    for bad in [
        &b"nope"[..],
        br#"{"kind": "ConversionReview"}"#,
        br#"{"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview"}"#,
    ] {
        let (status, json) = post(&unsynced, endpoints::CONVERT, bad.to_vec()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{json}");
        assert!(json["error"].is_string());
    }
    // A field repeated, or objects that do not all decode: a failure carrying the uid, never
    // fewer objects converted than were sent.
    for bad in [
        &br#"{"request":{"uid":"conv-1","desiredAPIVersion":"a","desiredAPIVersion":"b","objects":[]}}"#[..],
        br#"{"request":{"uid":"conv-1","desiredAPIVersion":"apps.kruise.io/v1beta1","objects":[{"n":1e400}]}}"#,
    ] {
        let (status, json) = post(&unsynced, endpoints::CONVERT, bad.to_vec()).await;
        assert_eq!(status, StatusCode::OK, "{json}");
        assert_eq!(json["response"]["uid"], "conv-1");
        assert_eq!(json["response"]["result"]["status"], "Failure", "{json}");
        assert!(json["response"].get("convertedObjects").is_none(), "{json}");
    }
}

/// An object recording 15,000 pods (about 2 MB, as the API server would store a PersistentPodState
/// of a StatefulSet that large) converts both ways: its status and metadata are copied as text,
/// never decoded, so it costs what its spec does (before, it was refused as too complex).
#[tokio::test]
async fn an_object_recording_thousands_of_pods_converts_both_ways() {
    let unsynced = state(false);
    let states: serde_json::Map<String, Value> = (0..15_000)
        .map(|i| {
            let node = format!("node-{i}");
            let labels =
                json!({"kubernetes.io/hostname": node, "topology.kubernetes.io/zone": "zone-a"});
            (
                format!("a-{i}"),
                json!({"nodeName": node, "nodeTopologyLabels": labels}),
            )
        })
        .collect();
    let status = json!({"observedGeneration": 1, "podStates": states});
    let mut alpha = pps_object("v1alpha1", "a", "a", 50);
    alpha["status"] = status.clone();
    let mut beta = pps_object("v1beta1", "a", "a", 50);
    beta["status"] = status;
    for (from, to, want) in [
        (&alpha, "apps.kruise.io/v1beta1", &beta),
        (&beta, "apps.kruise.io/v1alpha1", &alpha),
    ] {
        let body = conversion(to, vec![from.clone()]);
        assert!(
            body.len() > 1 << 20 && body.len() <= super::MAX_BODY,
            "{}",
            body.len()
        );
        let (status, json) = post(&unsynced, endpoints::CONVERT, body).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            json["response"]["result"]["status"], "Success",
            "{}",
            json["response"]["result"]
        );
        assert!(&json["response"]["convertedObjects"][0] == want, "{to}");
    }
}

/// A list read in the version not stored comes to `/convert` in one request, whatever its
/// size (the API server's own 3 MiB request limit does not bound it): 500 objects of about
/// 9 KB each, a page of `kubectl get` in `v1alpha1`, about 4.5 MB, convert, in order.
#[tokio::test]
async fn a_page_of_a_list_over_the_request_limit_converts() {
    let unsynced = state(false);
    let states: serde_json::Map<String, Value> = (0..100)
        .map(|i| {
            let node = format!("node-{i}");
            (
                format!("a-{i}"),
                json!({"nodeName": node, "nodeTopologyLabels": {"kubernetes.io/hostname": node}}),
            )
        })
        .collect();
    let objects: Vec<Value> = (0..500)
        .map(|i| {
            let mut alpha = pps_object("v1alpha1", &format!("pps-{i}"), "a", 50);
            alpha["status"] = json!({"observedGeneration": 1, "podStates": states});
            alpha
        })
        .collect();
    let body = conversion("apps.kruise.io/v1beta1", objects);
    assert!(
        body.len() > super::MAX_BODY && body.len() <= super::MAX_CONVERT_BODY,
        "{}",
        body.len()
    );
    let (status, json) = post(&unsynced, endpoints::CONVERT, body).await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["response"]["result"]["status"], "Success");
    let converted = json["response"]["convertedObjects"]
        .as_array()
        .expect("objects");
    assert_eq!(converted.len(), 500);
    assert_eq!(converted[499]["metadata"]["name"], "pps-499");
    assert_eq!(converted[0]["apiVersion"], "apps.kruise.io/v1beta1");
}

#[tokio::test]
async fn mutate_pod_requests_the_recorded_ip_unless_a_live_pod_holds_it() {
    let synced = state(true);
    let caches = &synced.caches;
    let mut with_ip = pps(
        "web",
        "web",
        json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"}, "podIPs": ["10.0.0.5"]}}),
    );
    with_ip.metadata.annotations = Some(
        [(
            crate::api::ip_request::IP_REQUEST_ANNOTATION.to_string(),
            "calico".to_string(),
        )]
        .into(),
    );
    caches.apply_pps(watcher::Event::Apply(with_ip));
    caches.apply_node(watcher::Event::Apply(node("n1", "z1")));
    let body = || serde_json::to_vec(&review(POD, "CREATE", pod(Some("web")), None)).expect("json");

    let (status, json) = post(&synced, endpoints::MUTATE_POD, body()).await;
    assert_eq!(answer(status, &json), Answer::Patched);
    let patch: json_patch::Patch =
        serde_json::from_slice(&patch_bytes(&json["response"]["patch"])).expect("patch");
    let mut object = pod(Some("web"));
    json_patch::patch(&mut object, &patch).expect("applies");
    assert_eq!(
        object["metadata"]["annotations"]["cni.projectcalico.org/ipAddrs"],
        r#"["10.0.0.5"]"#
    );
    // Invoked again with its own result (reinvocation): nothing more to do.
    let again = serde_json::to_vec(&review(POD, "CREATE", object, None)).expect("json");
    let (status, json) = post(&synced, endpoints::MUTATE_POD, again).await;
    assert_eq!(answer(status, &json), Answer::Allowed, "idempotent: {json}");
    assert!(
        synced
            .metrics
            .encode()
            .contains(r#"pps_ip_requests_total{result="already_requested"} 1"#)
    );

    // Another namespace's pod, being deleted, still holds the IP: not requested.
    caches.apply_pod(watcher::Event::Apply(
        serde_json::from_value(
            json!({"metadata": {"name": "squatter", "namespace": "other",
            "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Running", "podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}]}}),
        )
        .expect("pod"),
    ));
    let (status, json) = post(&synced, endpoints::MUTATE_POD, body()).await;
    assert_eq!(
        answer(status, &json),
        Answer::Patched,
        "the placement is still injected"
    );
    let patch: json_patch::Patch =
        serde_json::from_slice(&patch_bytes(&json["response"]["patch"])).expect("patch");
    let mut object = pod(Some("web"));
    json_patch::patch(&mut object, &patch).expect("applies");
    assert!(
        object["metadata"]["annotations"]
            .get("cni.projectcalico.org/ipAddrs")
            .is_none()
    );
    let metrics = synced.metrics.encode();
    assert!(
        metrics.contains(r#"pps_ip_request_skipped_total{reason="ip_held"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"pps_ip_requests_total{result="requested"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn an_ip_request_or_recorded_ip_that_does_not_parse_is_never_injected() {
    // (request annotation on the PPS, recorded IPs, the skip reason counted)
    let cases = [
        ("flannel", json!(["10.0.0.5"]), "invalid_request"),
        (
            "annotation:bad key!",
            json!(["10.0.0.5"]),
            "invalid_request",
        ),
        ("calico", json!(["10.0.0.500"]), "invalid_recorded_ip"),
        ("kube-ovn", json!(["not-an-ip"]), "invalid_recorded_ip"),
    ];
    for (request, ips, reason) in cases {
        let synced = state(true);
        let mut with_ip = pps(
            "web",
            "web",
            json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"}, "podIPs": ips}}),
        );
        with_ip.metadata.annotations = Some(
            [(
                crate::api::ip_request::IP_REQUEST_ANNOTATION.to_string(),
                request.to_string(),
            )]
            .into(),
        );
        synced.caches.apply_pps(watcher::Event::Apply(with_ip));
        synced
            .caches
            .apply_node(watcher::Event::Apply(node("n1", "z1")));
        let body =
            serde_json::to_vec(&review(POD, "CREATE", pod(Some("web")), None)).expect("json");
        let (status, json) = post(&synced, endpoints::MUTATE_POD, body).await;
        assert_eq!(
            answer(status, &json),
            Answer::Patched,
            "{request}: the placement is still injected"
        );
        let patch: json_patch::Patch =
            serde_json::from_slice(&patch_bytes(&json["response"]["patch"])).expect("patch");
        let mut object = pod(Some("web"));
        json_patch::patch(&mut object, &patch).expect("applies");
        let annotations = object["metadata"]["annotations"].clone();
        assert!(
            annotations.as_object().is_none_or(|a| !a.values().any(|v| v
                .as_str()
                .is_some_and(|v| v.contains("10.0.0") || v.contains("not-an-ip")))),
            "{request}: no IP annotation injected: {annotations}"
        );
        let metrics = synced.metrics.encode();
        assert!(
            metrics.contains(&format!(
                r#"pps_ip_request_skipped_total{{reason="{reason}"}} 1"#
            )),
            "{request}: {metrics}"
        );
    }
}

/// A `Write` into a shared buffer, for capturing logs.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        crate::sync::lock(&self.0).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn logs_below_debug_carry_no_annotation_value_or_pod_spec() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let synced = state(true);
    let mut with_ip = pps(
        "web",
        "web",
        json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"}, "podIPs": ["10.0.0.5"]}}),
    );
    with_ip.metadata.annotations = Some(
        [(
            crate::api::ip_request::IP_REQUEST_ANNOTATION.to_string(),
            "calico".to_string(),
        )]
        .into(),
    );
    synced.caches.apply_pps(watcher::Event::Apply(with_ip));
    let mut own = pod(Some("web"));
    own["metadata"]["annotations"] =
        json!({"cni.projectcalico.org/ipAddrs": "SECRET-ANNOTATION-VALUE"});
    let unreadable =
        json!({"metadata": {"name": "web-0"}, "spec": {"nodeSelector": "SECRET-SPEC-VALUE"}});
    for object in [own, unreadable] {
        let body = serde_json::to_vec(&review(POD, "CREATE", object, None)).expect("json");
        let (status, _) = post(&synced, endpoints::MUTATE_POD, body).await;
        assert_eq!(status, StatusCode::OK);
    }
    let logs = String::from_utf8_lossy(&crate::sync::lock(&captured.0)).into_owned();
    assert!(logs.contains("recorded IPs not requested"), "{logs}");
    assert!(logs.contains("not a readable Pod"), "{logs}");
    assert!(!logs.contains("SECRET"), "{logs}");
}

/// A PersistentPodState CREATE checks uniqueness against the API server: one created a moment
/// ago and not yet in the cache is found (and one the cache still holds but the API server no
/// longer does is not); when the read fails, the cache answers. One being deleted counts in
/// neither.
#[tokio::test]
async fn a_create_checks_uniqueness_live_and_falls_back_to_the_cache() {
    use http::{Request, Response};
    use kube::client::Body;

    let create = |name: &str, target: &str| {
        serde_json::to_vec(&review(
            ("apps.kruise.io", "v1beta1", "PersistentPodState"),
            "CREATE",
            pps_object("v1beta1", name, target, 5),
            None,
        ))
        .expect("json")
    };
    // The cache holds `stale` for `gone`, and nothing for `fresh`.
    let cached = state(true);
    cached
        .caches
        .apply_pps(watcher::Event::Apply(pps("stale", "gone", json!({}))));
    let with_api = |answer: Option<Value>| {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let state = super::WebhookState {
            client: Some(kube::Client::new(service, "default")),
            ..super::WebhookState::over(cached.caches.clone())
        };
        let server = tokio::spawn(async move {
            let (request, send) = handle.next_request().await.expect("a live read");
            assert_eq!(request.method(), http::Method::GET);
            assert!(
                request
                    .uri()
                    .path()
                    .ends_with("/namespaces/ns/persistentpodstates"),
                "{}",
                request.uri()
            );
            let response = match answer {
                Some(list) => Response::builder()
                    .status(200)
                    .body(Body::from(serde_json::to_vec(&list).expect("json"))),
                None => Response::builder().status(500).body(Body::from(
                    br#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"etcd down","code":500}"#.to_vec(),
                )),
            };
            send.send_response(response.expect("response"));
        });
        (std::sync::Arc::new(state), server)
    };
    let list = |items: Vec<PersistentPodState>| {
        json!({"apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodStateList",
               "metadata": {"resourceVersion": "1"}, "items": items})
    };
    // Creates `name` for `target` while the API server answers its list with `answer`.
    let validate = |answer: Option<Value>, name: &'static str, target: &'static str| {
        let (state, server) = with_api(answer);
        async move {
            let answered = post(&state, endpoints::VALIDATE_PPS, create(name, target)).await;
            drop(state);
            server.await.expect("mock API");
            answered
        }
    };

    // Created a moment ago, not cached yet: refused.
    let listed = list(vec![pps("first", "fresh", json!({}))]);
    let (status, body) = validate(Some(listed), "second", "fresh").await;
    assert_eq!(
        answer(status, &body),
        Answer::Denied(422, "already targets")
    );
    assert!(
        body["response"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("\"first\"")),
        "{body}"
    );
    // Deleted a moment ago, still cached: allowed.
    let (status, body) = validate(Some(list(vec![])), "next", "gone").await;
    assert_eq!(answer(status, &body), Answer::Allowed);
    // The API server fails: the cache answers.
    let (status, body) = validate(None, "next", "gone").await;
    assert_eq!(
        answer(status, &body),
        Answer::Denied(422, "already targets")
    );
    assert!(
        body["response"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("\"stale\"")),
        "{body}"
    );
    // One being deleted (held by a finalizer) steers no pod: it does not block its
    // replacement, listed live or, the API server failing, in the cache.
    let mut deleting = pps("old", "moving", json!({}));
    deleting.metadata.deletion_timestamp =
        Some(serde_json::from_value(json!("2026-01-01T00:00:00Z")).expect("time"));
    deleting.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    let (status, body) = validate(Some(list(vec![deleting.clone()])), "new", "moving").await;
    assert_eq!(answer(status, &body), Answer::Allowed, "{body}");
    cached.caches.apply_pps(watcher::Event::Apply(deleting));
    let (status, body) = validate(None, "new", "moving").await;
    assert_eq!(answer(status, &body), Answer::Allowed, "{body}");
}

/// Two pods whose states recorded the same IP (it was reused over time), reviewed back to back
/// or at once, before the cache shows either: only one is sent the IP; a dry run reserves
/// nothing.
#[tokio::test]
async fn two_reviews_are_never_sent_one_ip() {
    let with_ip = |name: &str| {
        let mut p = pps(
            name,
            name,
            json!({ format!("{name}-0"): {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"},
                    "podIPs": ["10.0.0.5"]}}),
        );
        p.metadata.annotations = Some(
            [(
                crate::api::ip_request::IP_REQUEST_ANNOTATION.to_string(),
                "calico".to_string(),
            )]
            .into(),
        );
        p
    };
    let requested = |json: &Value| -> bool {
        let Some(patch) = json["response"]["patch"].as_str() else {
            return false;
        };
        String::from_utf8_lossy(&patch_bytes(&json!(patch))).contains("ipAddrs")
    };
    let body = |owner: &str, dry_run: bool| {
        let mut r = review(POD, "CREATE", pod(Some(owner)), None);
        r["request"]["name"] = json!(format!("{owner}-0"));
        r["request"]["dryRun"] = json!(dry_run);
        serde_json::to_vec(&r).expect("json")
    };
    for together in [false, true] {
        let synced = state(true);
        for name in ["web", "db"] {
            synced
                .caches
                .apply_pps(watcher::Event::Apply(with_ip(name)));
        }
        synced
            .caches
            .apply_node(watcher::Event::Apply(node("n1", "z1")));
        // A dry run of one reserves nothing, and counts nothing but the review.
        let (_, dry) = post(&synced, endpoints::MUTATE_POD, body("db", true)).await;
        assert!(requested(&dry), "a dry run shows the request: {dry}");
        let metrics = synced.metrics.encode();
        let counted: Vec<&str> = metrics
            .lines()
            .filter(|l| {
                l.starts_with("pps_injections_total{") || l.starts_with("pps_ip_requests_total{")
            })
            .filter(|l| !l.ends_with(" 0"))
            .collect();
        assert!(counted.is_empty(), "{counted:?}");
        assert!(
            metrics.contains(r#"pps_ip_requests_total{result="requested"} 0"#),
            "{metrics}"
        );
        assert!(
            metrics.contains(
                r#"pps_admission_requests_total{endpoint="/mutate-pod",result="patched"} 1"#
            ),
            "{metrics}"
        );
        let ((_, web), (_, db)) = if together {
            tokio::join!(
                post(&synced, endpoints::MUTATE_POD, body("web", false)),
                post(&synced, endpoints::MUTATE_POD, body("db", false)),
            )
        } else {
            (
                post(&synced, endpoints::MUTATE_POD, body("web", false)).await,
                post(&synced, endpoints::MUTATE_POD, body("db", false)).await,
            )
        };
        assert_eq!(
            [requested(&web), requested(&db)]
                .iter()
                .filter(|r| **r)
                .count(),
            1,
            "together: {together}; web: {web}; db: {db}"
        );
        if !together {
            assert!(requested(&web), "the first one gets it");
            // The first pod's review again (the API server's reinvocation): still its own.
            let (_, again) = post(&synced, endpoints::MUTATE_POD, body("web", false)).await;
            assert!(requested(&again), "{again}");
        }
    }
}

/// `RequiredTopologySkipped` is reported per pod: two pods of one PersistentPodState left
/// without their lost node within the rate-limit interval each get their Event.
#[tokio::test]
async fn required_values_left_out_are_reported_per_pod() {
    use http::{Request, Response};
    use kube::client::Body;

    let (service, mut api) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let synced = state(true);
    let with_events = std::sync::Arc::new(super::WebhookState {
        events: Some(std::sync::Arc::new(crate::events::Events::new(
            kube::Client::new(service, "default"),
            None,
            std::time::Duration::from_secs(3600),
        ))),
        ..super::WebhookState::over(synced.caches.clone())
    });
    // Zone z9 is recorded; no node has it.
    with_events.caches.apply_pps(watcher::Event::Apply(pps(
        "web",
        "web",
        json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z9"}},
               "web-1": {"nodeName": "n2", "nodeTopologyLabels": {"zone": "z9"}}}),
    )));
    let mut notes = Vec::new();
    for name in ["web-0", "web-1"] {
        let mut object = pod(Some("web"));
        object["metadata"]["name"] = json!(name);
        let body = serde_json::to_vec(&review(POD, "CREATE", object, None)).expect("json");
        let (status, json) = post(&with_events, endpoints::MUTATE_POD, body).await;
        assert!(
            matches!(answer(status, &json), Answer::Allowed | Answer::Patched),
            "{json}"
        );
        let (request, send) =
            tokio::time::timeout(std::time::Duration::from_secs(5), api.next_request())
                .await
                .expect("an Event in time")
                .expect("an Event");
        let bytes = http_body_util::BodyExt::collect(request.into_body())
            .await
            .expect("body")
            .to_bytes();
        let event: Value = serde_json::from_slice(&bytes).expect("event");
        assert_eq!(event["reason"], "RequiredTopologySkipped");
        assert_eq!(
            event["related"]["name"], name,
            "the pod is the related object"
        );
        notes.push(event["note"].as_str().unwrap_or_default().to_owned());
        send.send_response(
            Response::builder()
                .status(201)
                .body(Body::from(bytes.to_vec()))
                .expect("response"),
        );
    }
    assert!(notes[0].starts_with("pod web-0:"), "{notes:?}");
    assert!(notes[1].starts_with("pod web-1:"), "{notes:?}");
    // The PersistentPodState records no preferred topology: none is said to be injected.
    assert!(
        notes
            .iter()
            .all(|n| n.ends_with("; no preferred placement to inject")),
        "{notes:?}"
    );
}
