//! The pod webhook's `matchConditions` (CEL), evaluated here with a CEL interpreter against
//! sample pods (cases no cluster run covers: missing fields, `controller: false`, look-alike
//! groups), for the expression the base manifests ship and for the documented custom-kind
//! variant. The API server's own evaluation is shown by the e2e suite (`recent.rs`).

use cel::{Context, Program, Value as Cel};
use serde::Deserialize;
use serde_json::{Value, json};

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The expression of the pod webhook's only match condition in manifests/base/webhooks.yaml.
fn shipped_expression() -> String {
    let text = repo_file("manifests/base/webhooks.yaml");
    let hook = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("yaml"))
        .find(|o| o["kind"] == "MutatingWebhookConfiguration")
        .expect("the pod webhook configuration");
    let conditions = hook["webhooks"][0]["matchConditions"]
        .as_array()
        .expect("matchConditions");
    assert_eq!(conditions.len(), 1);
    conditions[0]["expression"]
        .as_str()
        .expect("expression")
        .to_owned()
}

/// The expression of docs/install.md's custom-kind example patch.
fn documented_expression() -> String {
    let doc = repo_file("docs/install.md");
    let block = doc
        .split("```yaml\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .find(|block| block.starts_with("# custom-kinds-example"))
        .expect("the custom-kinds example in docs/install.md");
    let patch: Value = serde_yaml_ng::from_str(block).expect("a JSON patch in YAML");
    assert_eq!(patch[0]["path"], "/webhooks/0/matchConditions/0/expression");
    patch[0]["value"].as_str().expect("expression").to_owned()
}

/// A pod with one ownerReference; `controller` null leaves the field out, as the API server
/// does for an unset pointer.
fn owned_by(api_version: &str, kind: &str, controller: Value) -> Value {
    let mut owner = json!({"apiVersion": api_version, "kind": kind, "name": "o", "uid": "u"});
    if !controller.is_null() {
        owner["controller"] = controller;
    }
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns",
        "ownerReferences": [owner]}, "spec": {"containers": [{"name": "c"}]}})
}

fn sent(expression: &str, pod: &Value) -> bool {
    let program = Program::compile(expression).expect("compiles");
    let mut ctx = Context::default();
    ctx.add_variable("object", pod).expect("pod");
    match program.execute(&ctx) {
        Ok(Cel::Bool(b)) => b,
        // An error would make the API server apply failurePolicy (Fail): it must never happen.
        other => panic!("{expression} on {pod} gave {other:?}"),
    }
}

fn cases() -> Vec<(&'static str, Value, bool)> {
    vec![
        (
            "StatefulSet",
            owned_by("apps/v1", "StatefulSet", json!(true)),
            true,
        ),
        (
            "Advanced StatefulSet",
            owned_by("apps.kruise.io/v1beta1", "StatefulSet", json!(true)),
            true,
        ),
        (
            "Advanced StatefulSet v1alpha1",
            owned_by("apps.kruise.io/v1alpha1", "StatefulSet", json!(true)),
            true,
        ),
        (
            "ReplicaSet",
            owned_by("apps/v1", "ReplicaSet", json!(true)),
            false,
        ),
        (
            "DaemonSet",
            owned_by("apps/v1", "DaemonSet", json!(true)),
            false,
        ),
        ("Job", owned_by("batch/v1", "Job", json!(true)), false),
        (
            "a StatefulSet of another group",
            owned_by("example.com/v1", "StatefulSet", json!(true)),
            false,
        ),
        (
            "a group that only starts like apps",
            owned_by("apps.example.com/v1", "StatefulSet", json!(true)),
            false,
        ),
        (
            "StatefulSet, not the controller",
            owned_by("apps/v1", "StatefulSet", json!(false)),
            false,
        ),
        (
            "StatefulSet, controller unset",
            owned_by("apps/v1", "StatefulSet", Value::Null),
            false,
        ),
        (
            "bare pod",
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}),
            false,
        ),
        (
            "empty ownerReferences",
            json!({"metadata": {"name": "p", "ownerReferences": []}}),
            false,
        ),
    ]
}

#[test]
fn the_shipped_condition_sends_statefulset_pods_only() {
    let expression = shipped_expression();
    for (what, pod, want) in cases() {
        assert_eq!(sent(&expression, &pod), want, "{what}");
    }
    assert!(
        !sent(
            &expression,
            &owned_by("example.com/v1", "Ring", json!(true))
        ),
        "custom kinds need the documented patch"
    );
}

#[test]
fn the_documented_custom_kind_variant_adds_that_kind_only() {
    let expression = documented_expression();
    for (what, pod, want) in cases() {
        assert_eq!(sent(&expression, &pod), want, "{what}");
    }
    assert!(
        sent(
            &expression,
            &owned_by("example.com/v1", "Ring", json!(true))
        ),
        "custom kind"
    );
    assert!(!sent(
        &expression,
        &owned_by("example.com/v1", "Other", json!(true))
    ));
}
