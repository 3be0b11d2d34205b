//! The pure core of PersistentPodState generation: what a workload's annotations ask for.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::api::{
    AUTO_GENERATE_ANNOTATION, PERSISTENT_ANNOTATIONS_ANNOTATION, PREFERRED_TOPOLOGY_ANNOTATION,
    PersistentPodAnnotation, REQUIRED_TOPOLOGY_ANNOTATION, TargetReference,
};
use crate::api::{NodeTopologyTerm, PersistentPodStateSpec, PreferredTopologyTerm};

/// Weight of the preferred term generated from `kruise.io/preferred-persistent-topology`.
pub const GENERATED_PREFERRED_WEIGHT: i32 = 100;

fn comma_list(annotations: &BTreeMap<String, String>, key: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for item in annotations.get(key).into_iter().flat_map(|v| v.split(',')) {
        let item = item.trim();
        if !item.is_empty() && !out.iter().any(|o| o == item) {
            out.push(item.to_owned());
        }
    }
    out
}

/// The spec a workload's annotations ask for, or `None` if they ask for no PersistentPodState
/// (auto-generation off, or neither required nor preferred topology given).
pub fn desired_spec(
    api_version: &str,
    kind: &str,
    name: &str,
    annotations: &BTreeMap<String, String>,
) -> Option<PersistentPodStateSpec> {
    if annotations
        .get(AUTO_GENERATE_ANNOTATION)
        .map(String::as_str)
        != Some("true")
    {
        return None;
    }
    let required = comma_list(annotations, REQUIRED_TOPOLOGY_ANNOTATION);
    let preferred = comma_list(annotations, PREFERRED_TOPOLOGY_ANNOTATION);
    if required.is_empty() && preferred.is_empty() {
        return None;
    }
    Some(PersistentPodStateSpec {
        target_ref: TargetReference {
            api_version: api_version.to_owned(),
            kind: kind.to_owned(),
            name: name.to_owned(),
        },
        required_persistent_topology: (!required.is_empty())
            .then_some(NodeTopologyTerm { keys: required }),
        preferred_persistent_topology: if preferred.is_empty() {
            Vec::new()
        } else {
            vec![PreferredTopologyTerm {
                weight: GENERATED_PREFERRED_WEIGHT,
                preference: NodeTopologyTerm { keys: preferred },
            }]
        },
        persistent_pod_annotations: comma_list(annotations, PERSISTENT_ANNOTATIONS_ANNOTATION)
            .into_iter()
            .map(|key| PersistentPodAnnotation { key })
            .collect(),
        persistent_pod_state_retention_policy: None,
    })
}

/// Whether `owners` holds a controller reference to the workload with `uid`: such a
/// PersistentPodState was generated for it and may be updated or deleted by the generator.
pub fn generated_for(owners: &[OwnerReference], uid: &str) -> bool {
    !uid.is_empty()
        && owners
            .iter()
            .any(|o| o.controller == Some(true) && o.uid == uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn needs_true_and_a_topology() {
        let cases = [
            ann(&[]),
            ann(&[(AUTO_GENERATE_ANNOTATION, "true")]),
            ann(&[
                (AUTO_GENERATE_ANNOTATION, "false"),
                (PREFERRED_TOPOLOGY_ANNOTATION, "kubernetes.io/hostname"),
            ]),
            ann(&[
                (AUTO_GENERATE_ANNOTATION, "true"),
                (PREFERRED_TOPOLOGY_ANNOTATION, " , "),
            ]),
        ];
        for a in cases {
            assert_eq!(
                desired_spec("apps/v1", "StatefulSet", "web", &a),
                None,
                "{a:?}"
            );
        }
    }

    #[test]
    fn upstream_bug_3_changing_persistent_pod_annotations_changes_the_wanted_spec() {
        let mut a = ann(&[
            (AUTO_GENERATE_ANNOTATION, "true"),
            (PREFERRED_TOPOLOGY_ANNOTATION, "kubernetes.io/hostname"),
            (PERSISTENT_ANNOTATIONS_ANNOTATION, "a"),
        ]);
        let before = desired_spec("apps/v1", "StatefulSet", "web", &a);
        a.insert(PERSISTENT_ANNOTATIONS_ANNOTATION.into(), "a,b".into());
        let after = desired_spec("apps/v1", "StatefulSet", "web", &a);
        assert_ne!(
            before, after,
            "the generator sees a different spec and updates the PPS"
        );
        assert_eq!(after.map(|s| s.persistent_pod_annotations.len()), Some(2));
    }

    #[test]
    fn builds_the_spec_from_comma_lists() {
        let a = ann(&[
            (AUTO_GENERATE_ANNOTATION, "true"),
            (REQUIRED_TOPOLOGY_ANNOTATION, "topology.kubernetes.io/zone"),
            (
                PREFERRED_TOPOLOGY_ANNOTATION,
                "kubernetes.io/hostname, rack ,kubernetes.io/hostname",
            ),
            (PERSISTENT_ANNOTATIONS_ANNOTATION, "a/b,c"),
        ]);
        let s = desired_spec("apps/v1", "StatefulSet", "web", &a).expect("wanted");
        assert_eq!(s.target_ref.api_version, "apps/v1");
        assert_eq!(s.target_ref.name, "web");
        assert_eq!(s.required_keys(), ["topology.kubernetes.io/zone"]);
        assert_eq!(s.preferred_persistent_topology.len(), 1);
        assert_eq!(s.preferred_persistent_topology[0].weight, 100);
        assert_eq!(
            s.preferred_persistent_topology[0].preference.keys,
            ["kubernetes.io/hostname", "rack"]
        );
        let keys: Vec<&str> = s
            .persistent_pod_annotations
            .iter()
            .map(|a| a.key.as_str())
            .collect();
        assert_eq!(keys, ["a/b", "c"]);
    }

    #[test]
    fn upstream_bug_5_only_a_pps_generated_for_the_workload_counts_as_generated() {
        let owner = |uid: &str, controller: Option<bool>| OwnerReference {
            api_version: "apps/v1".into(),
            kind: "StatefulSet".into(),
            name: "web".into(),
            uid: uid.into(),
            controller,
            block_owner_deletion: None,
        };
        assert!(generated_for(&[owner("u1", Some(true))], "u1"));
        assert!(!generated_for(&[owner("u1", None)], "u1"));
        assert!(!generated_for(&[owner("u2", Some(true))], "u1"));
        assert!(!generated_for(&[], "u1"));
        assert!(!generated_for(&[owner("", Some(true))], ""));
    }
}
