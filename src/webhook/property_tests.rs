//! Property tests (issue 10.6): no input makes admission, validation or conversion panic, and
//! every request whose uid can be read is answered with it.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::endpoints;
use super::testing::{post, state};
use crate::api::conversion;
use crate::api::validation::{Context, validate};

/// Arbitrary JSON values, a few levels deep, with the field names the code looks for mixed in.
fn json_value() -> impl Strategy<Value = Value> {
    json_with_keys(&[
        "metadata",
        "spec",
        "name",
        "annotations",
        "ownerReferences",
        "nodeSelector",
        "affinity",
        "targetRef",
        "keys",
        "weight",
        "preferredPersistentTopology",
        "requiredPersistentTopology",
    ])
}

/// Arbitrary JSON values, a few levels deep, their objects' keys mostly `names`.
pub(super) fn json_with_keys(names: &'static [&'static str]) -> impl Strategy<Value = Value> {
    let keys = prop_oneof![
        12 => prop::sample::select(names).prop_map(str::to_string),
        1 => "[a-z]{1,8}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(keys.clone(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn admission_answers_any_request_with_its_uid(object in json_value(), operation in "[A-Z]{0,8}", kind in json_value()) {
        let body = serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "prop", "kind": kind, "operation": operation, "namespace": "ns",
                        "name": "p", "object": object, "oldObject": object}
        })).expect("json");
        let synced = state(true);
        for path in [endpoints::MUTATE_POD, endpoints::VALIDATE_PPS] {
            let (status, answer) = runtime().block_on(post(&synced, path, body.clone()));
            prop_assert_eq!(status.as_u16(), 200, "{} {}", path, answer);
            prop_assert_eq!(&answer["response"]["uid"], "prop");
        }
    }

    #[test]
    fn conversion_answers_any_request_with_its_uid(objects in prop::collection::vec(json_value(), 0..4), spec in json_value(), desired in json_value()) {
        let mut objects = objects;
        objects.push(json!({"apiVersion": "apps.kruise.io/v1alpha1", "kind": "PersistentPodState",
                            "metadata": {"name": "p", "namespace": "ns"}, "spec": spec}));
        let body = serde_json::to_vec(&json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
            "request": {"uid": "prop", "desiredAPIVersion": desired, "objects": objects}
        })).expect("json");
        let (status, answer) = runtime().block_on(post(&state(false), endpoints::CONVERT, body));
        prop_assert_eq!(status.as_u16(), 200, "{}", answer);
        prop_assert_eq!(&answer["response"]["uid"], "prop");
        let result = answer["response"]["result"]["status"].as_str();
        prop_assert!(result == Some("Success") || result == Some("Failure"), "{}", answer);
    }

    #[test]
    fn arbitrary_bytes_get_a_review_or_a_json_error(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let synced = state(true);
        for path in [endpoints::MUTATE_POD, endpoints::VALIDATE_PPS, endpoints::CONVERT] {
            let (status, answer) = runtime().block_on(post(&synced, path, bytes.clone()));
            prop_assert!(status.as_u16() == 200 || (answer["error"].is_string() && status.is_client_error()), "{} {}", status, answer);
        }
    }

    #[test]
    fn validation_never_panics(object in json_value(), old in json_value()) {
        let is_custom = |_: &str, _: &str| false;
        for keys_field in ["keys", "nodeTopologyKeys"] {
            let ctx = Context { keys_field, is_custom_kind: &is_custom, others_for_target: &[] };
            let _ = validate(&object, None, &ctx);
            let _ = validate(&object, Some(&old), &ctx);
        }
    }

    #[test]
    fn conversion_never_panics_and_round_trips(spec in json_value()) {
        let raw = |v: &Value| serde_json::value::to_raw_value(v).expect("text");
        let text = |c: conversion::Converted<'_>| serde_json::to_string(&c).expect("json");
        let object = raw(&json!({"apiVersion": "apps.kruise.io/v1alpha1", "kind": "PersistentPodState", "spec": spec}));
        let beta = conversion::convert(&object, "apps.kruise.io/v1beta1").map(text);
        prop_assert!(beta.is_ok(), "{:?}", beta);
        if let Ok(beta) = beta {
            let beta = serde_json::value::RawValue::from_string(beta).expect("raw");
            let back = conversion::convert(&beta, "apps.kruise.io/v1alpha1").map(text);
            prop_assert!(back.is_ok(), "{:?}", back);
            // Exact, unless v1alpha1's object holds v1beta1's key list too (which the API
            // server's schema prunes before any conversion).
            if !object.get().contains(r#""keys""#) {
                prop_assert_eq!(back.as_deref(), Ok(object.get()), "a round trip loses nothing");
            }
        }
        let _ = conversion::convert(&raw(&spec), "apps.kruise.io/v1beta1");
    }
}

/// A cluster, a PersistentPodState and a pod for [`injection_holds_its_promises`].
#[derive(Clone, Debug)]
struct World {
    /// Per node: (zone, ready, tainted `e2e/dedicated:NoSchedule`).
    nodes: Vec<(u8, bool, bool)>,
    /// Required and preferred keys: 0 none, 1 hostname, 2 zone, 3 both.
    required: u8,
    preferred: u8,
    /// Whether the PersistentPodState asks for the recorded IP (calico).
    ip_request: bool,
    /// The pod's ordinal, and per recorded ordinal the node index (beyond the nodes: gone).
    ordinal: u8,
    recorded: Vec<u8>,
    /// Other live pods holding `10.0.0.N`.
    holders: Vec<u8>,
    /// The pod's own nodeSelector zone, required-affinity zones (NotIn when `not_in`),
    /// toleration of the dedicated taint, and an annotation of its own.
    own_zone: Option<u8>,
    affinity_zones: Vec<u8>,
    not_in: bool,
    tolerates: bool,
    own_ip: bool,
}

fn world() -> impl Strategy<Value = World> {
    (
        prop::collection::vec((0u8..2, any::<bool>(), prop::bool::weighted(0.3)), 1..5),
        (0u8..4, 0u8..4, any::<bool>()),
        (0u8..3, prop::collection::vec(0u8..6, 3)),
        prop::collection::vec(0u8..4, 0..3),
        (
            prop::option::of(0u8..2),
            prop::collection::vec(0u8..3, 0..3),
            any::<bool>(),
            any::<bool>(),
            prop::bool::weighted(0.2),
        ),
    )
        .prop_map(
            |(nodes, (required, preferred, ip_request), (ordinal, recorded), holders, own)| World {
                nodes,
                required,
                preferred,
                ip_request,
                ordinal,
                recorded,
                holders,
                own_zone: own.0,
                affinity_zones: own.1,
                not_in: own.2,
                tolerates: own.3,
                own_ip: own.4,
            },
        )
}

const HOST: &str = "kubernetes.io/hostname";
const ZONE: &str = "topology.kubernetes.io/zone";

fn keys(which: u8) -> Vec<&'static str> {
    match which {
        1 => vec![HOST],
        2 => vec![ZONE],
        3 => vec![HOST, ZONE],
        _ => vec![],
    }
}

impl World {
    fn node_json(&self, i: usize) -> Value {
        let (zone, ready, tainted) = self.nodes[i];
        let since = if ready {
            "2020-01-01T00:00:00Z"
        } else {
            "2000-01-01T00:00:00Z"
        };
        json!({"metadata": {"name": format!("n{i}"), "uid": format!("uid-n{i}"),
            "labels": {HOST: format!("n{i}"), ZONE: format!("z{zone}")}},
            "spec": {"taints": if tainted { json!([{"key": "e2e/dedicated", "effect": "NoSchedule"}]) } else { json!([]) }},
            "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
                "lastTransitionTime": since}]}})
    }

    fn pps_json(&self) -> Value {
        let states: serde_json::Map<String, Value> = self
            .recorded
            .iter()
            .enumerate()
            .map(|(ordinal, &n)| {
                let n = usize::from(n);
                let (host, zone) = match self.nodes.get(n) {
                    Some((zone, _, _)) => (format!("n{n}"), format!("z{zone}")),
                    None => (format!("gone{n}"), "z9".to_owned()),
                };
                (
                    format!("web-{ordinal}"),
                    json!({"nodeName": host, "nodeTopologyLabels": {HOST: host, ZONE: zone},
                        "podIPs": [format!("10.0.0.{ordinal}")]}),
                )
            })
            .collect();
        let mut spec =
            json!({"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}});
        if self.required > 0 {
            spec["requiredPersistentTopology"] = json!({"keys": keys(self.required)});
        }
        if self.preferred > 0 {
            spec["preferredPersistentTopology"] =
                json!([{"weight": 50, "preference": {"keys": keys(self.preferred)}}]);
        }
        let mut annotations = json!({});
        if self.ip_request {
            annotations["persistent-pod-state.io/ip-request"] = json!("calico");
        }
        json!({"apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": "web", "namespace": "ns", "uid": "pps-uid", "annotations": annotations},
            "spec": spec, "status": {"podStates": states}})
    }

    fn pod_json(&self) -> Value {
        let mut spec = json!({"containers": [{"name": "c", "image": "i"}]});
        if let Some(z) = self.own_zone {
            spec["nodeSelector"] = json!({ZONE: format!("z{z}")});
        }
        if !self.affinity_zones.is_empty() {
            let zones: Vec<String> = self
                .affinity_zones
                .iter()
                .map(|z| format!("z{z}"))
                .collect();
            let op = if self.not_in { "NotIn" } else { "In" };
            spec["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                {"nodeSelectorTerms": [{"matchExpressions": [{"key": ZONE, "operator": op, "values": zones}]}]}}});
        }
        if self.tolerates {
            spec["tolerations"] =
                json!([{"key": "e2e/dedicated", "operator": "Exists", "effect": "NoSchedule"}]);
        }
        let mut annotations = json!({"own": "kept"});
        if self.own_ip {
            annotations["cni.projectcalico.org/ipAddrs"] = json!("[\"10.9.9.9\"]");
        }
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("web-{}", self.ordinal), "namespace": "ns",
                "annotations": annotations,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web",
                    "uid": "sts-uid", "controller": true}]},
            "spec": spec})
    }

    /// Whether node `i` can take `pod`: ready, its taints tolerated, its nodeSelector and
    /// required node affinity met (evaluated here, independently of the code under test).
    fn takes(&self, i: usize, pod: &Value) -> bool {
        let (zone, ready, tainted) = self.nodes[i];
        let labels = [(HOST, format!("n{i}")), (ZONE, format!("z{zone}"))];
        let label = |k: &str| {
            labels
                .iter()
                .find(|(key, _)| *key == k)
                .map(|(_, v)| v.as_str())
        };
        let selector_ok = pod["spec"]["nodeSelector"]
            .as_object()
            .is_none_or(|m| m.iter().all(|(k, v)| label(k) == v.as_str()));
        let terms = &pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        let affinity_ok = terms.as_array().is_none_or(|terms| {
            terms.iter().any(|t| {
                t["matchExpressions"].as_array().is_some_and(|es| {
                    es.iter().all(|e| {
                        let values: Vec<&str> = e["values"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(Value::as_str)
                            .collect();
                        let has = label(e["key"].as_str().unwrap_or_default());
                        match e["operator"].as_str() {
                            Some("In") => has.is_some_and(|h| values.contains(&h)),
                            Some("NotIn") => has.is_none_or(|h| !values.contains(&h)),
                            _ => false,
                        }
                    })
                })
            })
        });
        let tolerated = !tainted
            || pod["spec"]["tolerations"]
                .as_array()
                .is_some_and(|t| !t.is_empty());
        ready && tolerated && selector_ok && affinity_ok
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A StatefulSet pod against generated nodes, states and live pods: answered with its uid;
    /// the patch applies to the pod; the pod's own constraints (nodeSelector values, required
    /// affinity, annotations) are kept; what is injected as required leaves a node that can
    /// take the pod when one could before (never strands it); no IP a live pod holds is asked.
    #[test]
    fn injection_holds_its_promises(w in world()) {
        let synced = state(true);
        let caches = &synced.caches;
        for i in 0..w.nodes.len() {
            caches.apply_node(kube::runtime::watcher::Event::Apply(serde_json::from_value(w.node_json(i)).expect("node")));
        }
        caches.apply_pps(kube::runtime::watcher::Event::Apply(serde_json::from_value(w.pps_json()).expect("pps")));
        caches.apply_workload(
            &crate::workload::GroupKind::native_statefulset(),
            kube::runtime::watcher::Event::Apply(serde_json::from_value(json!({
                "apiVersion": "apps/v1", "kind": "StatefulSet",
                "metadata": {"name": "web", "namespace": "ns", "uid": "sts-uid"}, "spec": {"replicas": 3}})).expect("sts")),
        );
        for (i, &ip) in w.holders.iter().enumerate() {
            caches.apply_pod(kube::runtime::watcher::Event::Apply(serde_json::from_value(json!({
                "metadata": {"name": format!("other-{i}"), "namespace": "x", "uid": format!("o{i}")},
                "spec": {"nodeName": "n0", "containers": []},
                "status": {"phase": "Running", "podIP": format!("10.0.0.{ip}")}})).expect("pod")));
        }
        let pod = w.pod_json();
        let body = serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "prop-uid", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "operation": "CREATE", "namespace": "ns", "name": pod["metadata"]["name"], "object": pod}
        })).expect("json");
        let (status, answer) = runtime().block_on(post(&synced, endpoints::MUTATE_POD, body));
        prop_assert_eq!(status.as_u16(), 200);
        prop_assert_eq!(&answer["response"]["uid"], "prop-uid");
        prop_assert_eq!(&answer["response"]["allowed"], true);
        let Some(encoded) = answer["response"]["patch"].as_str() else {
            return Ok(());
        };
        use base64::Engine as _;
        let bytes = base64::engine::general_purpose::STANDARD.decode(encoded).expect("base64");
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
        let mut patched = pod.clone();
        prop_assert!(json_patch::patch(&mut patched, &patch).is_ok(), "the patch applies: {}", String::from_utf8_lossy(&bytes));
        // The pod's own constraints are kept.
        if let Some(own) = pod["spec"]["nodeSelector"].as_object() {
            for (k, v) in own {
                prop_assert_eq!(&patched["spec"]["nodeSelector"][k], v, "own nodeSelector {} kept", k);
            }
        }
        let required = "requiredDuringSchedulingIgnoredDuringExecution";
        prop_assert_eq!(&patched["spec"]["affinity"]["nodeAffinity"][required], &pod["spec"]["affinity"]["nodeAffinity"][required]);
        prop_assert_eq!(&patched["spec"]["tolerations"], &pod["spec"]["tolerations"]);
        prop_assert_eq!(&patched["metadata"]["annotations"]["own"], "kept");
        // Never strands: if a node could take the pod before, one can take it patched.
        let before = (0..w.nodes.len()).any(|i| w.takes(i, &pod));
        let after = (0..w.nodes.len()).any(|i| w.takes(i, &patched));
        prop_assert!(!before || after, "stranded by {}", String::from_utf8_lossy(&bytes));
        // Never an IP a live pod holds; the pod's own request is kept.
        let asked = patched["metadata"]["annotations"]["cni.projectcalico.org/ipAddrs"].as_str().unwrap_or_default();
        if w.own_ip {
            prop_assert_eq!(asked, "[\"10.9.9.9\"]");
        }
        for ip in serde_json::from_str::<Vec<String>>(asked).unwrap_or_default() {
            let held = w.holders.iter().any(|h| format!("10.0.0.{h}") == ip);
            prop_assert!(!held, "asked for {} which a live pod holds", ip);
        }
    }
}
