//! The pure core of the pod webhook: given a pod being created, the PersistentPodState that
//! targets its workload and the state recorded for its name, the JSON patch that steers it back.

use std::collections::BTreeMap;

use super::patch::{JsonValue, PodPatch, Pointer};
use crate::api::PersistentPodStateSpec;
use crate::api::{
    INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION, PodState, decode_required, encode_required,
};
use crate::placement::{Dropped, Required, owned};
use crate::workload::PodView;
use k8s_openapi::api::core::v1::PreferredSchedulingTerm;

const PREFERRED: &str = "preferredDuringSchedulingIgnoredDuringExecution";

/// The patch's fixed paths, escaped here once (each checked against its tokens in the tests)
/// rather than on every review.
const NODE_SELECTOR: Pointer = Pointer::new("/spec/nodeSelector");
const AFFINITY: Pointer = Pointer::new("/spec/affinity");
const NODE_AFFINITY: Pointer = Pointer::new("/spec/affinity/nodeAffinity");
const PREFERRED_TERMS: Pointer =
    Pointer::new("/spec/affinity/nodeAffinity/preferredDuringSchedulingIgnoredDuringExecution");
const PREFERRED_TERMS_END: Pointer =
    Pointer::new("/spec/affinity/nodeAffinity/preferredDuringSchedulingIgnoredDuringExecution/-");
const ANNOTATIONS: Pointer = Pointer::new("/metadata/annotations");
const INJECTED: Pointer =
    Pointer::new("/metadata/annotations/kruise.io~1injected-persistent-pod-state");
const INJECTED_REQUIRED: Pointer =
    Pointer::new("/metadata/annotations/persistent-pod-state.io~1injected-required");

/// A nodeSelector key the pod already sets to another value than the recorded one; the pod's
/// own value is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    /// The node label key.
    pub key: String,
    /// The pod's value, which stays.
    pub pod_value: String,
    /// The recorded value, which is not injected.
    pub recorded_value: String,
}

/// What the webhook adds to a pod, as a JSON patch, and what it did not add.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Injection {
    /// The patch to return to the API server (may be empty).
    pub patch: PodPatch,
    /// Number of required node labels added to `spec.nodeSelector`.
    pub required: usize,
    /// Number of preferred node affinity terms appended.
    pub preferred: usize,
    /// Number of persistent annotations restored (not counting the injected-state marker).
    pub annotations: usize,
    /// Required keys left as the pod set them.
    pub conflicts: Vec<Conflict>,
    /// Recorded required values left out so the pod is not stranded, and why.
    pub dropped: Option<Dropped>,
    /// When some were left out (for the Event that says so): the recorded required values the
    /// pod is held to (injected now or set by the pod).
    pub kept_required: BTreeMap<String, String>,
}

/// A preferred node affinity term as injected: each recorded value of its keys, `In`. Fields
/// in the order a JSON map has them (as the patch always read).
#[derive(PartialEq)]
struct Term<'a> {
    preference: Preference<'a>,
    weight: i32,
}

#[derive(PartialEq)]
struct Preference<'a> {
    match_expressions: Vec<Expression<'a>>,
}

#[derive(PartialEq)]
struct Expression<'a> {
    key: &'a str,
    operator: &'static str,
    values: [&'a str; 1],
}

impl Term<'_> {
    /// Whether the pod's own `term` is this one (the same JSON once written).
    fn is(&self, term: &PreferredSchedulingTerm) -> bool {
        let wanted = &self.preference.match_expressions;
        term.weight == self.weight
            && term.preference.match_fields.is_none()
            && term
                .preference
                .match_expressions
                .as_ref()
                .is_some_and(|have| {
                    have.len() == wanted.len()
                        && have.iter().zip(wanted).all(|(have, want)| {
                            have.key == want.key
                                && have.operator == want.operator
                                && have
                                    .values
                                    .as_deref()
                                    .is_some_and(|v| v.len() == 1 && v[0] == want.values[0])
                        })
                })
    }
}

impl JsonValue for Term<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"preference\":{\"matchExpressions\":");
        self.preference.match_expressions.write_json(out);
        out.extend_from_slice(b"},\"weight\":");
        self.weight.write_json(out);
        out.push(b'}');
    }
}

impl JsonValue for Expression<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"key\":");
        self.key.write_json(out);
        out.extend_from_slice(b",\"operator\":");
        self.operator.write_json(out);
        out.extend_from_slice(b",\"values\":");
        self.values[..].write_json(out);
        out.push(b'}');
    }
}

/// Preferred terms under their field name (a node affinity), and that under its own (an
/// affinity) when `in_affinity`.
struct Preferred<'t, 'a> {
    terms: &'t [Term<'a>],
    in_affinity: bool,
}

impl JsonValue for Preferred<'_, '_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        if self.in_affinity {
            out.extend_from_slice(b"{\"nodeAffinity\":");
        }
        out.extend_from_slice(b"{\"");
        out.extend_from_slice(PREFERRED.as_bytes());
        out.extend_from_slice(b"\":");
        self.terms.write_json(out);
        out.push(b'}');
        if self.in_affinity {
            out.push(b'}');
        }
    }
}

/// Computes the patch that restores `state` onto `pod` as asked by `spec`, with the IP request
/// annotation `ip_request` (its key, and its value where one is to be made: none, the key is
/// not restored from the persisted annotations either, so a recorded IP the request left out
/// is never asked for another way).
///
/// The patch applies to the pod exactly as the API server sent it: missing maps and lists are
/// created, what the pod already has is kept, and keys are escaped in JSON Pointers. Constraints
/// the pod sets itself are never overridden. Of the recorded required values, only those that
/// `place` keeps are injected (see [`crate::placement::required`]), so a pod is never pinned to
/// nowhere; the preferred part is injected whatever happens to the required one.
pub fn injection_for<'a, 's>(
    pod: impl Into<PodView<'a>>,
    pps_name: &str,
    spec: &'s PersistentPodStateSpec,
    state: &'s PodState,
    place: &dyn Fn(BTreeMap<&'s str, &'s str>) -> Required<&'s str>,
    ip_request: Option<(&str, Option<&str>)>,
) -> Injection {
    // Generic in its caller's type only: the webhook's is always a `PodView`.
    let pod: PodView<'_> = pod.into();
    let mut out = Injection::default();
    let Some(pod_spec) = pod.spec else {
        return out;
    };
    let mut patch = PodPatch::default();

    // a. required keys -> spec.nodeSelector
    let mut required: BTreeMap<&str, &str> = spec.required_pairs(state).collect();
    // A key the pod sets itself to another value keeps the pod's value.
    if let Some(own) = pod_spec.node_selector {
        required.retain(|key, value| match own.get(*key) {
            Some(v) if v != value => {
                out.conflicts.push(Conflict {
                    key: (*key).to_owned(),
                    pod_value: v.clone(),
                    recorded_value: (*value).to_owned(),
                });
                false
            }
            _ => true,
        });
    }
    let placed = place(required);
    let set_by_pod = |key: &str| pod_spec.node_selector.and_then(|own| own.get(key));
    // A value the pod sets itself holds it whatever placement judged: never said to be left
    // out, and said to hold it.
    let mut held_by_pod = BTreeMap::new();
    out.dropped = placed
        .dropped
        .map(|mut dropped| {
            dropped.values.retain(|key, value| {
                let own = set_by_pod(key) == Some(&*value);
                if own {
                    held_by_pod.insert(key.clone(), value.clone());
                }
                !own
            });
            dropped
        })
        .filter(|dropped| !dropped.values.is_empty());
    let kept_required = || {
        let mut kept = owned(&placed.kept);
        kept.extend(held_by_pod.clone());
        kept
    };
    // What this webhook adds (not what the pod sets itself): what it may later release the
    // pod from. A value it added before (a reinvocation with its own result) stays its own.
    let pod_annotations = pod.annotations;
    let added_before = pod_annotations
        .filter(|a| a.get(INJECTED_ANNOTATION).map(String::as_str) == Some(pps_name))
        .and_then(|a| a.get(INJECTED_REQUIRED_ANNOTATION))
        .and_then(|text| decode_required(text))
        .unwrap_or_default();
    let injected: BTreeMap<&str, &str> = placed
        .kept
        .iter()
        .filter(|(key, _)| set_by_pod(key).is_none())
        .map(|(k, v)| (*k, *v))
        .collect();
    out.required = injected.len();
    // In key order (`kept` is sorted), as the annotation is written.
    let ours = placed.kept.iter().filter(|(key, value)| {
        set_by_pod(key).is_none()
            || (set_by_pod(key).map(String::as_str) == Some(*value)
                && added_before.get(**key).map(String::as_str) == Some(*value))
    });
    match pod_spec.node_selector {
        None if !injected.is_empty() => patch.add(&NODE_SELECTOR, &injected),
        None => {}
        Some(_) => {
            for (key, value) in &injected {
                patch.add(&["spec", "nodeSelector", key], value);
            }
        }
    }

    // b. preferred terms -> appended preferred node affinity
    let node_affinity = pod_spec.node_affinity;
    let existing_terms = node_affinity
        .and_then(|na| {
            na.preferred_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default();
    let mut terms: Vec<Term<'_>> = Vec::new();
    for (weight, keys) in spec.preferred_terms() {
        let match_expressions: Vec<Expression<'_>> = keys
            .iter()
            .filter_map(|k| {
                state
                    .node_topology_labels
                    .get(k.as_str())
                    .map(|v| Expression {
                        key: k,
                        operator: "In",
                        values: [v.as_str()],
                    })
            })
            .collect();
        if match_expressions.is_empty() {
            continue;
        }
        let term = Term {
            preference: Preference { match_expressions },
            weight: weight.clamp(1, 100),
        };
        if !existing_terms.iter().any(|t| term.is(t)) && !terms.contains(&term) {
            terms.push(term);
        }
    }
    out.preferred = terms.len();
    if !terms.is_empty() {
        let preferred = |in_affinity| Preferred {
            terms: &terms,
            in_affinity,
        };
        if !pod_spec.has_affinity {
            patch.add(&AFFINITY, &preferred(true));
        } else if node_affinity.is_none() {
            patch.add(&NODE_AFFINITY, &preferred(false));
        } else if node_affinity.is_some_and(|na| {
            na.preferred_during_scheduling_ignored_during_execution
                .is_none()
        }) {
            patch.add(&PREFERRED_TERMS, &terms[..]);
        } else {
            for term in &terms {
                patch.add(&PREFERRED_TERMS_END, term);
            }
        }
    }

    // c. persistent annotations (never over the pod's own, never the webhook's own: those say
    // what this answer did, never the IP request's: that is made as decided) and the
    // injected-state marker
    let mut annotations: BTreeMap<&str, &str> = spec
        .persistent_annotation_keys()
        .filter(|key| ![INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION].contains(key))
        .filter(|key| ip_request.is_none_or(|(ip, _)| ip != *key))
        .filter(|key| pod_annotations.is_none_or(|m| !m.contains_key(*key)))
        .filter_map(|key| state.annotations.get(key).map(|v| (key, v.as_str())))
        .collect();
    out.annotations = annotations.len();
    // The IP request (decided by `ip_request::decide`, which never overrides the pod's own).
    if let Some((key, Some(value))) =
        ip_request.filter(|(k, _)| pod_annotations.is_none_or(|m| !m.contains_key(*k)))
    {
        annotations.insert(key, value);
    }
    // The webhook's own annotations say exactly what it did: which PersistentPodState, and
    // which required values it added (none: the annotation is not there).
    let required_text = Some(encode_required(ours)).filter(|text| !text.is_empty());
    // Nothing to add and no mark of ours to mend: the pod is left alone, unmarked (as upstream
    // does), so a mark always means something was injected.
    let marked_before = pod_annotations.is_some_and(|m| {
        m.contains_key(INJECTED_ANNOTATION) || m.contains_key(INJECTED_REQUIRED_ANNOTATION)
    });
    if patch.is_empty() && annotations.is_empty() && required_text.is_none() && !marked_before {
        if out.dropped.is_some() {
            out.kept_required = kept_required();
        }
        return out;
    }
    let own = [
        (INJECTED_ANNOTATION, INJECTED, Some(pps_name)),
        (
            INJECTED_REQUIRED_ANNOTATION,
            INJECTED_REQUIRED,
            required_text.as_deref(),
        ),
    ];
    match pod_annotations {
        None => {
            for (key, _, value) in own {
                if let Some(value) = value {
                    annotations.insert(key, value);
                }
            }
            patch.add(&ANNOTATIONS, &annotations);
        }
        Some(existing) => {
            for (key, value) in &annotations {
                patch.add(&["metadata", "annotations", key], value);
            }
            for (key, path, value) in own {
                match (existing.get(key), value) {
                    (Some(have), Some(want)) if have == want => {}
                    (Some(_), Some(want)) => patch.replace(&path, want),
                    (None, Some(want)) => patch.add(&path, want),
                    (Some(_), None) => patch.remove(&path),
                    (None, None) => {}
                }
            }
        }
    }

    if out.dropped.is_some() {
        out.kept_required = kept_required();
    }
    out.patch = patch;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{NodeTopologyTerm, PreferredTopologyTerm};
    use crate::api::{PersistentPodAnnotation, TargetReference};
    use crate::placement::DropReason;
    use crate::webhook::patch::PatchPath;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::{Value, json};

    #[test]
    fn each_fixed_path_is_the_pointer_of_its_tokens() {
        let paths: [(Pointer, &[&str]); 8] = [
            (NODE_SELECTOR, &["spec", "nodeSelector"]),
            (AFFINITY, &["spec", "affinity"]),
            (NODE_AFFINITY, &["spec", "affinity", "nodeAffinity"]),
            (
                PREFERRED_TERMS,
                &["spec", "affinity", "nodeAffinity", PREFERRED],
            ),
            (
                PREFERRED_TERMS_END,
                &["spec", "affinity", "nodeAffinity", PREFERRED, "-"],
            ),
            (ANNOTATIONS, &["metadata", "annotations"]),
            (INJECTED, &["metadata", "annotations", INJECTED_ANNOTATION]),
            (
                INJECTED_REQUIRED,
                &["metadata", "annotations", INJECTED_REQUIRED_ANNOTATION],
            ),
        ];
        for (pointer, tokens) in paths {
            let (mut by_pointer, mut by_tokens) = (Vec::new(), Vec::new());
            pointer.write_path(&mut by_pointer);
            tokens.write_path(&mut by_tokens);
            assert_eq!(by_pointer, by_tokens, "{pointer:?}");
        }
    }

    const ZONE: &str = "topology.kubernetes.io/zone";
    const HOST: &str = "kubernetes.io/hostname";

    fn spec(
        required: &[&str],
        preferred: &[(i32, &[&str])],
        annotations: &[&str],
    ) -> PersistentPodStateSpec {
        let keys = |ks: &[&str]| ks.iter().map(|k| k.to_string()).collect::<Vec<_>>();
        PersistentPodStateSpec {
            target_ref: TargetReference {
                api_version: "apps/v1".into(),
                kind: "StatefulSet".into(),
                name: "web".into(),
            },
            required_persistent_topology: (!required.is_empty()).then(|| NodeTopologyTerm {
                keys: keys(required),
            }),
            preferred_persistent_topology: preferred
                .iter()
                .map(|(w, ks)| PreferredTopologyTerm {
                    weight: *w,
                    preference: NodeTopologyTerm { keys: keys(ks) },
                })
                .collect(),
            persistent_pod_annotations: annotations
                .iter()
                .map(|k| PersistentPodAnnotation { key: k.to_string() })
                .collect(),
            persistent_pod_state_retention_policy: None,
        }
    }

    fn state(labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> PodState {
        let map = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        PodState {
            node_name: Some("node-a1".into()),
            node_topology_labels: labels.iter().map(|&(k, v)| (k.into(), v.into())).collect(),
            annotations: map(annotations),
            ..PodState::default()
        }
    }

    fn pod(v: Value) -> (Pod, Value) {
        (serde_json::from_value(v.clone()).expect("valid pod"), v)
    }

    fn anywhere<'x>(recorded: BTreeMap<&'x str, &'x str>) -> Required<&'x str> {
        Required {
            kept: recorded,
            dropped: None,
        }
    }

    /// The injection's patch, as the API server reads it.
    fn ops(inj: &Injection) -> json_patch::Patch {
        let bytes = inj.patch.to_bytes();
        serde_json::from_slice(&bytes).expect("a JSON patch")
    }

    /// Applies the injection to the raw pod and returns the patched JSON.
    fn apply(raw: &Value, inj: &Injection) -> Value {
        let mut doc = raw.clone();
        json_patch::patch(&mut doc, &ops(inj)).expect("patch applies to the pod as sent");
        doc
    }

    fn bare_pod() -> (Pod, Value) {
        pod(json!({"metadata": {"name": "web-0"}, "spec": {"containers": [{"name": "c"}]}}))
    }

    #[test]
    fn creates_every_missing_map_and_escapes_keys() {
        let (p, raw) = bare_pod();
        let s = spec(&[ZONE], &[(100, &[HOST])], &["a~b/c"]);
        let st = state(&[(ZONE, "z1"), (HOST, "node-a1")], &[("a~b/c", "v")]);
        let inj = injection_for(&p, "web", &s, &st, &anywhere, None);
        let out = apply(&raw, &inj);
        assert_eq!(out["spec"]["nodeSelector"], json!({ZONE: "z1"}));
        assert_eq!(
            out["spec"]["affinity"]["nodeAffinity"][PREFERRED],
            json!([{"weight": 100, "preference": {"matchExpressions": [
                {"key": HOST, "operator": "In", "values": ["node-a1"]}]}}])
        );
        assert_eq!(
            out["metadata"]["annotations"],
            json!({"a~b/c": "v", INJECTED_ANNOTATION: "web",
                   INJECTED_REQUIRED_ANNOTATION: format!("{ZONE}=z1")})
        );
        assert_eq!((inj.required, inj.preferred, inj.annotations), (1, 1, 1));
    }

    #[test]
    fn the_webhooks_own_annotations_are_never_restored_as_persistent_ones() {
        // A PersistentPodState that lists them as persistent annotations (so its states record
        // them): they still say only what this answer did. With no required value added, the
        // pod carries no injected-required annotation for the controller to act on.
        let s = spec(
            &[],
            &[(100, &[HOST])],
            &[INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION, "keep"],
        );
        let st = state(
            &[(HOST, "node-a1")],
            &[
                (INJECTED_ANNOTATION, "other"),
                (INJECTED_REQUIRED_ANNOTATION, "zone=z9"),
                ("keep", "v"),
            ],
        );
        let (bare, raw) = bare_pod();
        let with_map = json!({"metadata": {"name": "web-0", "annotations": {"own": "x"}},
            "spec": {"containers": []}});
        let (annotated, annotated_raw) = pod(with_map);
        for (p, raw, own) in [
            (&bare, &raw, json!({})),
            (&annotated, &annotated_raw, json!({"own": "x"})),
        ] {
            let inj = injection_for(p, "web", &s, &st, &anywhere, None);
            let mut want = own;
            want["keep"] = json!("v");
            want[INJECTED_ANNOTATION] = json!("web");
            assert_eq!(apply(raw, &inj)["metadata"]["annotations"], want);
        }
    }

    #[test]
    fn the_required_values_added_are_named_and_only_those() {
        let s = spec(&[ZONE, HOST], &[], &[]);
        let st = state(&[(ZONE, "z1"), (HOST, "node-a1")], &[]);
        // The pod sets the zone itself: only the hostname is the webhook's.
        let (p, raw) = pod(json!({"metadata": {"name": "web-0"},
            "spec": {"nodeSelector": {ZONE: "z1"}, "containers": []}}));
        let out = apply(&raw, &injection_for(&p, "web", &s, &st, &anywhere, None));
        assert_eq!(
            out["metadata"]["annotations"][INJECTED_REQUIRED_ANNOTATION],
            format!("{HOST}=node-a1")
        );
        // Invoked again with its own result: nothing changes.
        let (again, _) = pod(out.clone());
        let inj = injection_for(&again, "web", &s, &st, &anywhere, None);
        assert!(inj.patch.is_empty(), "{:?}", inj.patch);
        // A template that carries the annotation (copied from a steered pod) looks like a
        // reinvocation: what it names and the pod sets as named stays named; the hostname the
        // pod sets itself is not taken for the webhook's.
        let (copied, raw) = pod(json!({"metadata": {"name": "web-0", "annotations": {
                INJECTED_ANNOTATION: "web", INJECTED_REQUIRED_ANNOTATION: format!("{ZONE}=z1")}},
            "spec": {"nodeSelector": {ZONE: "z1", HOST: "node-a1"}, "containers": []}}));
        let out = apply(
            &raw,
            &injection_for(&copied, "web", &s, &st, &anywhere, None),
        );
        assert_eq!(
            out["metadata"]["annotations"][INJECTED_REQUIRED_ANNOTATION],
            format!("{ZONE}=z1"),
            "what it names stays its own; the pod's own hostname is not added"
        );
        assert_eq!(
            decode_required(&encode_required(&BTreeMap::from([
                ("a".to_owned(), "1".to_owned()),
                ("b/c".to_owned(), "2".to_owned())
            ]))),
            Some(BTreeMap::from([
                ("a".to_owned(), "1".to_owned()),
                ("b/c".to_owned(), "2".to_owned())
            ]))
        );
        assert_eq!(decode_required("no-equals"), None);
    }

    #[test]
    fn keeps_what_the_pod_has_and_escapes_pointer_tokens() {
        let (p, raw) = pod(json!({
            "metadata": {"name": "web-0", "annotations": {"own": "1", "a~b/c": "mine"}},
            "spec": {
                "containers": [{"name": "c"}],
                "nodeSelector": {"disk": "ssd"},
                "affinity": {"nodeAffinity": {PREFERRED: [
                    {"weight": 5, "preference": {"matchExpressions": [{"key": "x", "operator": "Exists"}]}}
                ]}}
            }
        }));
        let s = spec(&[ZONE], &[(50, &[HOST])], &["a~b/c", "other/key"]);
        let st = state(
            &[(ZONE, "z1"), (HOST, "n1")],
            &[("a~b/c", "old"), ("other/key", "o")],
        );
        let inj = injection_for(&p, "web", &s, &st, &anywhere, None);
        let paths: Vec<String> = ops(&inj).0.iter().map(|op| op.path().to_string()).collect();
        assert!(paths.contains(&"/spec/nodeSelector/topology.kubernetes.io~1zone".to_string()));
        assert!(paths.contains(&"/metadata/annotations/other~1key".to_string()));
        let out = apply(&raw, &inj);
        assert_eq!(
            out["spec"]["nodeSelector"],
            json!({"disk": "ssd", ZONE: "z1"})
        );
        let terms = out["spec"]["affinity"]["nodeAffinity"][PREFERRED]
            .as_array()
            .expect("list");
        assert_eq!(terms.len(), 2);
        assert_eq!(terms[0]["weight"], 5);
        assert_eq!(terms[1]["weight"], 50);
        assert_eq!(
            out["metadata"]["annotations"]["a~b/c"], "mine",
            "pod's own value stays"
        );
        assert_eq!(out["metadata"]["annotations"]["other/key"], "o");
        assert_eq!(out["metadata"]["annotations"]["own"], "1");
        assert_eq!(out["metadata"]["annotations"][INJECTED_ANNOTATION], "web");
    }

    #[test]
    fn conflicting_node_selector_keeps_the_pods_value() {
        let (p, raw) = pod(json!({"metadata": {"name": "web-0"}, "spec": {
            "containers": [{"name": "c"}], "nodeSelector": {ZONE: "z9", HOST: "n1"}}}));
        let s = spec(&[ZONE, HOST], &[], &[]);
        let st = state(&[(ZONE, "z1"), (HOST, "n1")], &[]);
        let inj = injection_for(&p, "web", &s, &st, &anywhere, None);
        assert_eq!(
            inj.conflicts,
            vec![Conflict {
                key: ZONE.into(),
                pod_value: "z9".into(),
                recorded_value: "z1".into()
            }]
        );
        assert_eq!(inj.required, 0);
        let out = apply(&raw, &inj);
        assert_eq!(out["spec"]["nodeSelector"], json!({ZONE: "z9", HOST: "n1"}));
    }

    #[test]
    fn creates_node_affinity_or_list_under_an_existing_parent() {
        let cases = [
            json!({"podAntiAffinity": {}}),
            json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "Exists"}]}]}}}),
        ];
        for affinity in cases {
            let (p, raw) = pod(json!({"metadata": {"name": "web-0"}, "spec": {
                "containers": [{"name": "c"}], "affinity": affinity.clone()}}));
            let s = spec(&[], &[(100, &[HOST])], &[]);
            let inj = injection_for(&p, "web", &s, &state(&[(HOST, "n1")], &[]), &anywhere, None);
            let out = apply(&raw, &inj);
            assert_eq!(
                out["spec"]["affinity"]["nodeAffinity"][PREFERRED][0]["weight"], 100,
                "{affinity}"
            );
            for (k, v) in affinity.as_object().expect("object") {
                if k != "nodeAffinity" {
                    assert_eq!(&out["spec"]["affinity"][k], v, "kept {k}");
                }
            }
            if affinity.get("nodeAffinity").is_some() {
                assert!(out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"].is_object());
            }
        }
    }

    #[test]
    fn skips_keys_without_a_recorded_value_and_duplicate_terms() {
        let (p, raw) = pod(
            json!({"metadata": {"name": "web-0", "annotations": {}}, "spec": {
            "containers": [{"name": "c"}],
            "affinity": {"nodeAffinity": {PREFERRED: [{"weight": 100, "preference": {
                "matchExpressions": [{"key": HOST, "operator": "In", "values": ["n1"]}]}}]}}}}),
        );
        let s = spec(
            &["missing"],
            &[(100, &[HOST]), (30, &["also-missing"])],
            &["gone"],
        );
        let inj = injection_for(&p, "web", &s, &state(&[(HOST, "n1")], &[]), &anywhere, None);
        let out = apply(&raw, &inj);
        assert!(out["spec"].get("nodeSelector").is_none());
        assert_eq!(
            out["spec"]["affinity"]["nodeAffinity"][PREFERRED]
                .as_array()
                .map(Vec::len),
            Some(1)
        );
        assert_eq!(out["metadata"]["annotations"], json!({}));
        assert!(inj.patch.is_empty());
        assert_eq!((inj.required, inj.preferred, inj.annotations), (0, 0, 0));
        // Once something is added, the pod is marked with the PersistentPodState's name.
        let s = spec(&["missing"], &[(100, &[HOST])], &["gone"]);
        let (p, raw) = pod(json!({"metadata": {"name": "web-0", "annotations": {}},
            "spec": {"containers": [{"name": "c"}]}}));
        let inj = injection_for(&p, "web", &s, &state(&[(HOST, "n1")], &[]), &anywhere, None);
        let out = apply(&raw, &inj);
        assert_eq!(
            out["metadata"]["annotations"],
            json!({INJECTED_ANNOTATION: "web"})
        );
        assert_eq!(inj.preferred, 1);
    }

    #[test]
    fn a_mark_of_ours_is_mended_even_when_nothing_is_added() {
        // A pod marked before (reinvocation, or a template copied from a marked pod) whose
        // recorded value no longer applies: the stale injected-required value is removed.
        let (p, raw) = pod(json!({"metadata": {"name": "web-0", "annotations": {
            INJECTED_ANNOTATION: "web", INJECTED_REQUIRED_ANNOTATION: format!("{HOST}=n1")}},
            "spec": {"containers": [{"name": "c"}]}}));
        let s = spec(&["missing"], &[], &[]);
        let inj = injection_for(&p, "web", &s, &state(&[(HOST, "n1")], &[]), &anywhere, None);
        let out = apply(&raw, &inj);
        assert_eq!(
            out["metadata"]["annotations"],
            json!({INJECTED_ANNOTATION: "web"})
        );
    }

    #[test]
    fn upstream_bug_7_out_of_range_weights_are_clamped_so_the_pod_stays_valid() {
        let (p, raw) = bare_pod();
        let s = spec(&[], &[(0, &[HOST]), (500, &[ZONE])], &[]);
        let inj = injection_for(
            &p,
            "web",
            &s,
            &state(&[(HOST, "n1"), (ZONE, "z")], &[]),
            &anywhere,
            None,
        );
        let out = apply(&raw, &inj);
        let weights: Vec<&Value> = out["spec"]["affinity"]["nodeAffinity"][PREFERRED]
            .as_array()
            .expect("list")
            .iter()
            .map(|t| &t["weight"])
            .collect();
        assert_eq!(weights, vec![&json!(1), &json!(100)]);
    }

    #[test]
    fn a_stale_marker_is_replaced_and_a_current_one_left_alone() {
        for (marker, ops) in [("other", 1), ("web", 0)] {
            let (p, raw) = pod(
                json!({"metadata": {"name": "web-0", "annotations": {INJECTED_ANNOTATION: marker}},
                "spec": {"containers": [{"name": "c"}]}}),
            );
            let inj = injection_for(
                &p,
                "web",
                &spec(&[], &[(1, &[HOST])], &[]),
                &state(&[], &[]),
                &anywhere,
                None,
            );
            assert_eq!(inj.patch.len(), ops);
            assert_eq!(
                apply(&raw, &inj)["metadata"]["annotations"][INJECTED_ANNOTATION],
                "web"
            );
        }
    }

    #[test]
    fn upstream_bug_10_required_values_left_out_are_not_injected_but_preferred_still_is() {
        let (p, raw) = bare_pod();
        let s = spec(&[ZONE], &[(100, &[HOST])], &[]);
        let gone = |recorded| Required {
            kept: BTreeMap::new(),
            dropped: Some(Dropped {
                values: owned(&recorded),
                reason: DropReason::NodeGone,
            }),
        };
        let inj = injection_for(
            &p,
            "web",
            &s,
            &state(&[(ZONE, "z-gone"), (HOST, "n1")], &[]),
            &gone,
            None,
        );
        let out = apply(&raw, &inj);
        assert!(
            out["spec"].get("nodeSelector").is_none(),
            "not pinned to a zone that is gone"
        );
        assert_eq!(
            out["spec"]["affinity"]["nodeAffinity"][PREFERRED][0]["weight"],
            100
        );
        assert_eq!(
            inj.dropped.map(|d| d.values),
            Some([(ZONE.to_string(), "z-gone".to_string())].into())
        );
        assert_eq!(inj.required, 0);
    }

    #[test]
    fn a_value_the_pod_sets_itself_is_never_said_to_be_left_out() {
        let (p, _) = pod(json!({"metadata": {"name": "web-0"}, "spec": {
            "containers": [{"name": "c"}], "nodeSelector": {ZONE: "z1"}}}));
        let s = spec(&[ZONE, HOST], &[], &[]);
        let st = state(&[(ZONE, "z1"), (HOST, "n1")], &[]);
        let lost = |recorded| Required {
            kept: BTreeMap::new(),
            dropped: Some(Dropped {
                values: owned(&recorded),
                reason: DropReason::NodeLost,
            }),
        };
        let inj = injection_for(&p, "web", &s, &st, &lost, None);
        assert_eq!(
            inj.dropped.map(|d| d.values),
            Some([(HOST.to_string(), "n1".to_string())].into()),
            "only what the webhook would have added"
        );
        assert_eq!(
            inj.kept_required,
            [(ZONE.to_string(), "z1".to_string())].into(),
            "the pod's own value holds it"
        );
        // Nothing else left out: nothing said.
        let (p, _) = pod(json!({"metadata": {"name": "web-0"}, "spec": {
            "containers": [{"name": "c"}], "nodeSelector": {ZONE: "z1", HOST: "n1"}}}));
        let inj = injection_for(&p, "web", &s, &st, &lost, None);
        assert_eq!(inj.dropped, None);
    }

    #[test]
    fn only_the_kept_required_values_are_injected_and_conflicts_are_not_placed() {
        let (p, raw) = pod(json!({"metadata": {"name": "web-0"}, "spec": {
            "containers": [{"name": "c"}], "nodeSelector": {"disk": "ssd", "rack": "own"}}}));
        let s = spec(&[ZONE, HOST, "rack"], &[], &[]);
        let st = state(&[(ZONE, "z1"), (HOST, "n1"), ("rack", "r9")], &[]);
        let seen = std::cell::RefCell::new(BTreeMap::new());
        let keep_zone = |recorded| {
            let mut kept: BTreeMap<&str, &str> = recorded;
            *seen.borrow_mut() = kept.clone();
            let host = kept.remove(HOST);
            Required {
                kept,
                dropped: host.map(|v: &str| Dropped {
                    values: [(HOST.to_string(), v.to_string())].into(),
                    reason: DropReason::NodeLost,
                }),
            }
        };
        let inj = injection_for(&p, "web", &s, &st, &keep_zone, None);
        assert_eq!(
            *seen.borrow(),
            BTreeMap::from([(HOST, "n1"), (ZONE, "z1")]),
            "the conflicting key is not offered to placement"
        );
        let out = apply(&raw, &inj);
        assert_eq!(
            out["spec"]["nodeSelector"],
            json!({"disk": "ssd", "rack": "own", ZONE: "z1"})
        );
        assert_eq!(inj.conflicts.len(), 1);
        assert_eq!(inj.dropped.map(|d| d.reason), Some(DropReason::NodeLost));
    }

    #[test]
    fn upstream_bug_1_persisted_annotations_are_reinjected_even_without_topology() {
        let (p, raw) = bare_pod();
        let s = spec(&[], &[], &["example.com/slot"]);
        let inj = injection_for(
            &p,
            "web",
            &s,
            &state(&[], &[("example.com/slot", "s1")]),
            &anywhere,
            None,
        );
        let out = apply(&raw, &inj);
        assert_eq!(out["metadata"]["annotations"]["example.com/slot"], "s1");
        assert_eq!(inj.annotations, 1);
    }

    #[test]
    fn null_fields_are_replaced() {
        let (p, raw) = pod(
            json!({"metadata": {"name": "web-0", "annotations": null}, "spec": {
            "containers": [{"name": "c"}], "nodeSelector": null, "affinity": null}}),
        );
        let s = spec(&[ZONE], &[(100, &[HOST])], &[]);
        let inj = injection_for(
            &p,
            "web",
            &s,
            &state(&[(ZONE, "z"), (HOST, "n")], &[]),
            &anywhere,
            None,
        );
        let out = apply(&raw, &inj);
        assert_eq!(out["spec"]["nodeSelector"][ZONE], "z");
        assert_eq!(out["metadata"]["annotations"][INJECTED_ANNOTATION], "web");
    }
}
