//! Validation of PersistentPodState objects (the pure core of `/validate-persistentpodstate`).
//! Errors carry field paths, spelled in the version the client used.

use std::fmt;

use serde_json::Value;

use super::ip_request::{IP_REQUEST_ANNOTATION, IpRequest};
use super::keys::{annotation_key_error, qualified_name_error};
use super::{
    KRUISE_GROUP, MAX_KEYS, MAX_PERSISTENT_ANNOTATIONS, MAX_PREFERRED_TERMS, api_group, shown,
};
use crate::workload::GroupKind;

/// One invalid field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the field, e.g. `spec.preferredPersistentTopology[0].weight`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// What validation needs besides the object.
pub struct Context<'a> {
    /// The key-list field name of the client's version (`keys` or `nodeTopologyKeys`).
    pub keys_field: &'a str,
    /// Whether `group`/`kind` is a configured custom StatefulSet-like workload.
    pub is_custom_kind: &'a dyn Fn(&str, &str) -> bool,
    /// Names of other PersistentPodStates that target the same workload.
    pub others_for_target: &'a [String],
}

/// Errors listed at most (a message stays readable and bounded); the rest are counted.
const MAX_ERRORS: usize = 20;

struct Errors<'a> {
    list: Vec<FieldError>,
    more: usize,
    /// Whether an error at a path counts (on UPDATE: only in what changed), decided before
    /// the list is cut at [`MAX_ERRORS`].
    counts: &'a dyn Fn(&str) -> bool,
}

impl<'a> Errors<'a> {
    fn new(counts: &'a dyn Fn(&str) -> bool) -> Self {
        Self {
            list: Vec::new(),
            more: 0,
            counts,
        }
    }

    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        let path = path.into();
        if !(self.counts)(&path) {
            return;
        }
        if self.list.len() >= MAX_ERRORS {
            self.more += 1;
            return;
        }
        self.list.push(FieldError {
            path,
            message: message.into(),
        });
    }

    fn too_many(&mut self, path: &str, len: usize, max: usize) {
        if len > max {
            self.push(
                path,
                format!("Too many: {len}: must have at most {max} items"),
            );
        }
    }

    fn done(mut self) -> Vec<FieldError> {
        if self.more > 0 {
            self.list.push(FieldError {
                path: "...".into(),
                message: format!("and {} more errors", self.more),
            });
        }
        self.list
    }
}

fn keys<'a>(term: &'a Value, field: &str) -> Option<&'a Vec<Value>> {
    term.get(field).and_then(Value::as_array)
}

fn check_keys(errors: &mut Errors, path: &str, list: Option<&Vec<Value>>) {
    match list {
        None => errors.push(path, "Required value: at least one node label key"),
        Some(l) if l.is_empty() => errors.push(path, "Required value: at least one node label key"),
        Some(l) => {
            errors.too_many(path, l.len(), MAX_KEYS);
            for (i, key) in l.iter().enumerate() {
                match key.as_str() {
                    Some(k) => {
                        if let Some(e) = qualified_name_error(k) {
                            errors.push(
                                format!("{path}[{i}]"),
                                format!("Invalid value: {}: {e}", shown(k)),
                            );
                        }
                    }
                    None => errors.push(format!("{path}[{i}]"), "Invalid value: must be a string"),
                }
            }
        }
    }
}

/// Validates `object` (raw JSON of the client's version) on CREATE (`old` is `None`) or UPDATE.
///
/// On UPDATE the rules apply only to the spec fields that changed (ratcheting, as the API server
/// does for CRD schemas): an object stored before these rules (by upstream OpenKruise, say) keeps
/// accepting metadata changes, finalizers and ownerReferences, and edits of its other fields.
/// `targetRef` stays immutable.
pub fn validate(object: &Value, old: Option<&Value>, ctx: &Context<'_>) -> Vec<FieldError> {
    // Whether a field changed, looked at once per field (errors may be many).
    let seen = std::cell::RefCell::new(std::collections::HashMap::<&'static str, bool>::new());
    let counts = |path: &str| {
        old.is_none_or(|old| match field_of(path) {
            Some(field) => *seen
                .borrow_mut()
                .entry(field)
                .or_insert_with(|| changed(path, object, old)),
            None => changed(path, object, old),
        })
    };
    let mut errors = rules(object, ctx, &counts);
    if let Some(old) = old {
        // The target is its group, kind and name (the version in apiVersion may differ).
        let identity = |o: &Value| {
            let part = |name: &str| {
                o.pointer(&format!("/spec/targetRef/{name}"))
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            (
                api_group(&part("apiVersion")).to_owned(),
                part("kind"),
                part("name"),
            )
        };
        if identity(old) != identity(object) {
            errors.insert(
                0,
                FieldError {
                    path: "spec.targetRef".into(),
                    message: "Invalid value: field is immutable".into(),
                },
            );
        }
    }
    errors
}

/// Whether the spec field an error at `path` belongs to differs between `new` and `old`. The
/// error for "no topology at all" (path `spec`) belongs to the three topology fields together.
/// What [`changed`] compares for an error at `path`, when it is one of a few: errors of one
/// field share the answer.
fn field_of(path: &str) -> Option<&'static str> {
    const SPEC: [&str; 5] = [
        "requiredPersistentTopology",
        "preferredPersistentTopology",
        "persistentPodAnnotations",
        "persistentPodStateRetentionPolicy",
        "targetRef",
    ];
    if path.starts_with("metadata.annotations") {
        return Some(if path.contains(super::MODE_ANNOTATION) {
            super::MODE_ANNOTATION
        } else {
            IP_REQUEST_ANNOTATION
        });
    }
    let rest = path.strip_prefix("spec.")?;
    let first = rest.split(['.', '[']).next().unwrap_or(rest);
    SPEC.into_iter().find(|s| *s == first)
}

fn changed(path: &str, new: &Value, old: &Value) -> bool {
    if path.starts_with("metadata.annotations") {
        let key = if path.contains(super::MODE_ANNOTATION) {
            super::MODE_ANNOTATION
        } else {
            IP_REQUEST_ANNOTATION
        };
        let pointer = |o: &'_ Value| {
            o.pointer("/metadata/annotations")
                .and_then(|a| a.get(key))
                .cloned()
        };
        return pointer(new) != pointer(old);
    }
    let fields: &[&str] = match path.strip_prefix("spec.") {
        Some(rest) => &[rest.split(['.', '[']).next().unwrap_or(rest)],
        None => &[
            "requiredPersistentTopology",
            "preferredPersistentTopology",
            "persistentPodAnnotations",
        ],
    };
    fields.iter().any(|f| {
        let pointer = format!("/spec/{f}");
        new.pointer(&pointer) != old.pointer(&pointer)
    })
}

/// Every rule, on the object alone.
fn rules(object: &Value, ctx: &Context<'_>, counts: &dyn Fn(&str) -> bool) -> Vec<FieldError> {
    let mut errors = Errors::new(counts);
    let null = Value::Null;
    let spec = object.get("spec").unwrap_or(&null);
    let kf = ctx.keys_field;

    // targetRef: every part set, a handled kind (immutability: see `validate`).
    let target = spec.get("targetRef").unwrap_or(&null);
    let part = |name: &str| target.get(name).and_then(Value::as_str).unwrap_or_default();
    for name in ["apiVersion", "kind", "name"] {
        if part(name).is_empty() {
            errors.push(format!("spec.targetRef.{name}"), "Required value");
        }
    }
    let (group, kind) = (api_group(part("apiVersion")), part("kind"));
    let statefulset = GroupKind::new(group, kind).is_statefulset();
    if !kind.is_empty() && !statefulset && !(ctx.is_custom_kind)(group, kind) {
        errors.push(
            "spec.targetRef",
            format!(
                "Unsupported value: {}: only StatefulSets (apps, {KRUISE_GROUP}) and configured custom workloads",
                shown(&format!("{group}/{kind}"))
            ),
        );
    }

    // topology: at least one term; every key list non-empty and of label keys; weights 1..100.
    let required = spec
        .get("requiredPersistentTopology")
        .filter(|v| !v.is_null());
    let preferred = spec
        .get("preferredPersistentTopology")
        .and_then(Value::as_array)
        .filter(|a| !a.is_empty());
    let annotations = spec
        .get("persistentPodAnnotations")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty());
    if required.is_none() && preferred.is_none() && !annotations {
        // A PPS that only persists annotations is useful; one that persists nothing is not.
        errors.push(
            "spec",
            "Required value: requiredPersistentTopology or preferredPersistentTopology (or persistentPodAnnotations)",
        );
    }
    if let Some(r) = required {
        check_keys(
            &mut errors,
            &format!("spec.requiredPersistentTopology.{kf}"),
            keys(r, kf),
        );
    }
    if let Some(terms) = preferred {
        errors.too_many(
            "spec.preferredPersistentTopology",
            terms.len(),
            MAX_PREFERRED_TERMS,
        );
    }
    if let Some(list) = spec
        .get("persistentPodAnnotations")
        .and_then(Value::as_array)
    {
        errors.too_many(
            "spec.persistentPodAnnotations",
            list.len(),
            MAX_PERSISTENT_ANNOTATIONS,
        );
    }
    for (i, term) in preferred.into_iter().flatten().enumerate() {
        let path = format!("spec.preferredPersistentTopology[{i}]");
        match term.get("weight").and_then(Value::as_i64) {
            Some(w) if (1..=100).contains(&w) => {}
            Some(w) => errors.push(
                format!("{path}.weight"),
                format!("Invalid value: {w}: must be in the range 1-100"),
            ),
            None => errors.push(
                format!("{path}.weight"),
                "Required value: an integer in the range 1-100",
            ),
        }
        let preference = term.get("preference").unwrap_or(&null);
        check_keys(
            &mut errors,
            &format!("{path}.preference.{kf}"),
            keys(preference, kf),
        );
    }

    for (i, a) in spec
        .get("persistentPodAnnotations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let path = format!("spec.persistentPodAnnotations[{i}].key");
        match a.get("key").and_then(Value::as_str) {
            Some(k) => {
                if let Some(e) = annotation_key_error(k) {
                    errors.push(path, format!("Invalid value: {}: {e}", shown(k)));
                }
            }
            None => errors.push(path, "Required value"),
        }
    }

    match spec.get("persistentPodStateRetentionPolicy") {
        None | Some(Value::Null) => {}
        Some(Value::String(p)) if p == "WhenScaled" || p == "WhenDeleted" => {}
        Some(other) => errors.push(
            "spec.persistentPodStateRetentionPolicy",
            format!(
                "Unsupported value: {}: supported values: \"WhenScaled\", \"WhenDeleted\"",
                match other {
                    Value::String(text) => shown(text),
                    other => shown(&other.to_string()),
                }
            ),
        ),
    }

    if let Some(value) = object
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(IP_REQUEST_ANNOTATION))
    {
        let path = format!("metadata.annotations[{IP_REQUEST_ANNOTATION}]");
        match value.as_str().map(IpRequest::parse) {
            Some(Ok(_)) => {}
            Some(Err(e)) => errors.push(path, format!("Unsupported value: {e}")),
            None => errors.push(path, "Invalid value: must be a string"),
        }
    }

    if let Some(value) = object
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(super::MODE_ANNOTATION))
    {
        let path = format!("metadata.annotations[{}]", super::MODE_ANNOTATION);
        match value.as_str() {
            Some("observe" | "active") => {}
            Some(other) => errors.push(
                path,
                format!(
                    "Unsupported value: {}: supported values: \"observe\", \"active\"",
                    shown(other)
                ),
            ),
            None => errors.push(path, "Invalid value: must be a string"),
        }
    }

    if let Some(first) = ctx.others_for_target.first() {
        errors.push(
            "spec.targetRef",
            format!(
                "Duplicate value: PersistentPodState {first:?} already targets {group}/{kind} {}",
                shown(part("name"))
            ),
        );
    }
    errors.done()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn valid() -> Value {
        json!({"spec": {
            "targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
            "requiredPersistentTopology": {"keys": ["topology.kubernetes.io/zone"]},
            "preferredPersistentTopology": [{"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}}],
            "persistentPodAnnotations": [{"key": "example.com/ip"}],
            "persistentPodStateRetentionPolicy": "WhenDeleted"
        }})
    }

    fn check(object: &Value, old: Option<&Value>, others: &[String]) -> Vec<String> {
        let custom = |g: &str, k: &str| g == "example.com" && k == "Ring";
        let ctx = Context {
            keys_field: "keys",
            is_custom_kind: &custom,
            others_for_target: others,
        };
        validate(object, old, &ctx)
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    fn with(patch: Value) -> Value {
        let mut v = valid();
        json_patch::merge(&mut v, &patch);
        v
    }

    #[test]
    fn upstream_bug_7_weights_outside_1_to_100_are_rejected() {
        for w in [0, -1, 101, 1000] {
            let bad = with(
                json!({"spec": {"preferredPersistentTopology": [{"weight": w, "preference": {"keys": ["a"]}}]}}),
            );
            assert!(
                check(&bad, None, &[]).iter().any(|e| e.contains("weight")),
                "{w}"
            );
        }
        for w in [1, 100] {
            let ok = with(
                json!({"spec": {"preferredPersistentTopology": [{"weight": w, "preference": {"keys": ["a"]}}]}}),
            );
            assert!(check(&ok, None, &[]).is_empty(), "{w}");
        }
    }

    #[test]
    fn upstream_bug_8_empty_key_lists_and_malformed_keys_are_rejected() {
        let cases = [
            json!({"spec": {"requiredPersistentTopology": {"keys": []}}}),
            json!({"spec": {"requiredPersistentTopology": {"keys": ["a b"]}}}),
            json!({"spec": {"preferredPersistentTopology": [{"weight": 1, "preference": {"keys": []}}]}}),
            json!({"spec": {"persistentPodAnnotations": [{"key": "/x"}]}}),
        ];
        for patch in cases {
            assert!(
                !check(&with(patch.clone()), None, &[]).is_empty(),
                "{patch}"
            );
        }
    }

    #[test]
    fn a_valid_object_passes() {
        assert!(check(&valid(), None, &[]).is_empty());
        assert!(check(&valid(), Some(&valid()), &[]).is_empty());
    }

    #[test]
    fn each_rule_names_its_field() {
        let cases = [
            (
                json!({"spec": {"targetRef": {"name": ""}}}),
                "spec.targetRef.name: Required value",
            ),
            (
                json!({"spec": {"targetRef": {"kind": "Deployment"}}}),
                "spec.targetRef: Unsupported value: \"apps/Deployment\"",
            ),
            (
                json!({"spec": {"targetRef": {"apiVersion": "example.com/v1", "kind": "StatefulSet"}}}),
                "spec.targetRef: Unsupported value",
            ),
            (
                json!({"spec": {"requiredPersistentTopology": null, "preferredPersistentTopology": [], "persistentPodAnnotations": []}}),
                "spec: Required value",
            ),
            (
                json!({"spec": {"requiredPersistentTopology": {"keys": []}}}),
                "spec.requiredPersistentTopology.keys: Required value",
            ),
            (
                json!({"spec": {"requiredPersistentTopology": {"keys": ["bad key"]}}}),
                "spec.requiredPersistentTopology.keys[0]: Invalid value: \"bad key\"",
            ),
            (
                json!({"spec": {"requiredPersistentTopology": {"keys": ["UPPER.com/x"]}}}),
                "prefix part",
            ),
            (
                json!({"spec": {"preferredPersistentTopology": [{"weight": 0, "preference": {"keys": ["a"]}}]}}),
                "spec.preferredPersistentTopology[0].weight: Invalid value: 0",
            ),
            (
                json!({"spec": {"preferredPersistentTopology": [{"weight": 101, "preference": {"keys": ["a"]}}]}}),
                "spec.preferredPersistentTopology[0].weight: Invalid value: 101",
            ),
            (
                json!({"spec": {"preferredPersistentTopology": [{"weight": 5, "preference": {"keys": []}}]}}),
                "spec.preferredPersistentTopology[0].preference.keys: Required value",
            ),
            (
                json!({"spec": {"persistentPodAnnotations": [{"key": "-x"}]}}),
                "spec.persistentPodAnnotations[0].key: Invalid value: \"-x\"",
            ),
            (
                json!({"spec": {"persistentPodStateRetentionPolicy": "Sometimes"}}),
                "spec.persistentPodStateRetentionPolicy: Unsupported value: \"Sometimes\"",
            ),
        ];
        for (patch, want) in cases {
            let errors = check(&with(patch.clone()), None, &[]);
            assert!(
                errors
                    .iter()
                    .any(|e| e.starts_with(want) || e.contains(want)),
                "{patch}: {errors:?}"
            );
        }
    }

    #[test]
    fn a_pps_that_only_persists_annotations_is_valid() {
        let only = with(
            json!({"spec": {"requiredPersistentTopology": null, "preferredPersistentTopology": null}}),
        );
        assert!(check(&only, None, &[]).is_empty());
    }

    #[test]
    fn custom_kinds_and_kruise_statefulsets_are_accepted() {
        for target in [
            json!({"apiVersion": "example.com/v1", "kind": "Ring", "name": "r"}),
            json!({"apiVersion": "apps.kruise.io/v1beta1", "kind": "StatefulSet", "name": "s"}),
        ] {
            assert!(check(&with(json!({"spec": {"targetRef": target}})), None, &[]).is_empty());
        }
    }

    #[test]
    fn target_is_immutable_and_unique() {
        let moved = with(json!({"spec": {"targetRef": {"name": "other"}}}));
        assert_eq!(
            check(&moved, Some(&valid()), &[]),
            ["spec.targetRef: Invalid value: field is immutable"]
        );
        let other_version = with(json!({"spec": {"targetRef": {"apiVersion": "apps/v1beta2"}}}));
        assert!(
            check(&other_version, Some(&valid()), &[]).is_empty(),
            "the version may change"
        );
        let dup = check(&valid(), None, &["first".to_string()]);
        assert_eq!(dup.len(), 1);
        assert!(
            dup[0].contains("Duplicate value") && dup[0].contains("first"),
            "{dup:?}"
        );
    }

    #[test]
    fn updates_are_checked_only_where_the_spec_changed() {
        // Stored before these rules (upstream accepted it): weight 0, an empty key list, an
        // empty retention policy, and a second PPS for the workload.
        let legacy = with(json!({"spec": {
            "requiredPersistentTopology": {"keys": []},
            "preferredPersistentTopology": [{"weight": 0, "preference": {"keys": ["kubernetes.io/hostname"]}}],
            "persistentPodStateRetentionPolicy": ""
        }}));
        assert_eq!(
            check(&legacy, None, &["first".into()]).len(),
            4,
            "all rules apply on CREATE"
        );
        let mut labelled = legacy.clone();
        labelled["metadata"]["labels"] = json!({"team": "a"});
        labelled["metadata"]["finalizers"] = json!(["example.com/keep"]);
        assert!(
            check(&labelled, Some(&legacy), &["first".into()]).is_empty(),
            "metadata changes pass"
        );
        let mut reweighted = legacy.clone();
        reweighted["spec"]["preferredPersistentTopology"][0]["weight"] = json!(500);
        let errors = check(&reweighted, Some(&legacy), &["first".into()]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("spec.preferredPersistentTopology[0].weight"),
            "{errors:?}"
        );
        let mut retained = legacy.clone();
        retained["spec"]["persistentPodStateRetentionPolicy"] = json!("WhenDeleted");
        assert!(
            check(&retained, Some(&legacy), &["first".into()]).is_empty(),
            "fixing one field does not require fixing the others"
        );
        // More old errors than are listed: still none of them counts against a valid change.
        let bad_keys: Vec<String> = (0..25).map(|i| format!("Bad Key {i}")).collect();
        let crowded = with(json!({"spec": {"requiredPersistentTopology": {"keys": bad_keys}}}));
        assert!(check(&crowded, None, &[]).len() > MAX_ERRORS);
        let mut annotated = crowded.clone();
        annotated["spec"]["persistentPodAnnotations"] = json!([{"key": "example.com/other"}]);
        let errors = check(&annotated, Some(&crowded), &[]);
        assert!(errors.is_empty(), "{errors:?}");
    }

    #[test]
    fn lists_over_the_limits_are_refused_and_messages_stay_short() {
        let many: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
        let object = with(json!({"spec": {
            "requiredPersistentTopology": {"keys": many},
            "persistentPodAnnotations": (0..40).map(|i| json!({"key": format!("a{i}")})).collect::<Vec<_>>()
        }}));
        let errors = check(&object, None, &[]);
        assert!(
            errors
                .iter()
                .any(|e| e.starts_with("spec.requiredPersistentTopology.keys: Too many: 40")),
            "{errors:?}"
        );
        assert!(
            errors
                .iter()
                .any(|e| e.starts_with("spec.persistentPodAnnotations: Too many: 40")),
            "{errors:?}"
        );
        let bad_keys: Vec<String> = (0..100)
            .map(|i| format!("{}-{i}", "x".repeat(10_000)))
            .collect();
        let object = with(json!({"spec": {"requiredPersistentTopology": {"keys": bad_keys}}}));
        let errors = check(&object, None, &[]);
        assert_eq!(errors.len(), 21, "20 errors and a count of the rest");
        assert!(errors.last().is_some_and(|e| e.contains("more errors")));
        assert!(
            errors.iter().all(|e| e.len() < 400),
            "values are cut: {}",
            errors[1]
        );
    }

    #[test]
    fn an_unknown_ip_request_is_rejected_with_a_clear_message() {
        let mut object = valid();
        for ok in ["calico", "kube-ovn", "antrea", "annotation:example.com/ips"] {
            object["metadata"]["annotations"] = json!({"persistent-pod-state.io/ip-request": ok});
            assert!(check(&object, None, &[]).is_empty(), "{ok}");
        }
        object["metadata"]["annotations"] = json!({"persistent-pod-state.io/ip-request": "weave"});
        let errors = check(&object, None, &[]);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].starts_with("metadata.annotations[persistent-pod-state.io/ip-request]: Unsupported value: \"weave\" is not one of calico, kube-ovn, antrea, annotation:<key>"),
            "{errors:?}"
        );
        let mut labelled = object.clone();
        labelled["metadata"]["labels"] = json!({"a": "b"});
        assert!(
            check(&labelled, Some(&object), &[]).is_empty(),
            "ratcheted when unchanged"
        );
    }

    #[test]
    fn only_observe_or_active_is_a_mode() {
        let mut object = valid();
        for ok in ["observe", "active"] {
            object["metadata"]["annotations"] = json!({"persistent-pod-state.io/mode": ok});
            assert!(check(&object, None, &[]).is_empty(), "{ok}");
        }
        object["metadata"]["annotations"] = json!({"persistent-pod-state.io/mode": "watch"});
        let errors = check(&object, None, &[]);
        assert_eq!(
            errors,
            [
                "metadata.annotations[persistent-pod-state.io/mode]: Unsupported value: \"watch\": supported values: \"observe\", \"active\""
            ]
        );
        let mut labelled = object.clone();
        labelled["metadata"]["labels"] = json!({"a": "b"});
        assert!(
            check(&labelled, Some(&object), &[]).is_empty(),
            "ratcheted when unchanged"
        );
        // An invalid ip-request beside it is still judged on its own.
        let mut both = valid();
        both["metadata"]["annotations"] = json!({"persistent-pod-state.io/mode": "observe",
            "persistent-pod-state.io/ip-request": "weave"});
        assert_eq!(check(&both, None, &[]).len(), 1);
    }

    #[test]
    fn paths_use_the_clients_version() {
        let alpha = json!({"spec": {
            "targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
            "requiredPersistentTopology": {"nodeTopologyKeys": []}}});
        let custom = |_: &str, _: &str| false;
        let ctx = Context {
            keys_field: "nodeTopologyKeys",
            is_custom_kind: &custom,
            others_for_target: &[],
        };
        let errors: Vec<String> = validate(&alpha, None, &ctx)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            errors,
            [
                "spec.requiredPersistentTopology.nodeTopologyKeys: Required value: at least one node label key"
            ]
        );
    }
}
