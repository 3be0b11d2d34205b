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
    let names = prop_oneof![
        Just("metadata".to_string()),
        Just("spec".to_string()),
        Just("name".to_string()),
        Just("annotations".to_string()),
        Just("ownerReferences".to_string()),
        Just("nodeSelector".to_string()),
        Just("affinity".to_string()),
        Just("targetRef".to_string()),
        Just("keys".to_string()),
        Just("weight".to_string()),
        Just("preferredPersistentTopology".to_string()),
        Just("requiredPersistentTopology".to_string()),
        "[a-z]{1,8}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(names.clone(), inner, 0..6)
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
        let object = json!({"apiVersion": "apps.kruise.io/v1alpha1", "kind": "PersistentPodState", "spec": spec});
        if let Ok(beta) = conversion::convert(object.clone(), "apps.kruise.io/v1beta1") {
            let back = conversion::convert(beta, "apps.kruise.io/v1alpha1");
            prop_assert!(back.is_ok());
        }
        let _ = conversion::convert(spec, "apps.kruise.io/v1beta1");
    }
}
