//! The pure core of PersistentPodState generation: what a workload's annotations ask for, and
//! what the generator does about it ([`plan`]).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;
use serde_json::{Value, json};

use crate::api::ip_request::{IP_REQUEST_ANNOTATION, IpRequest};
use crate::api::{
    AUTO_GENERATE_ANNOTATION, PERSISTENT_ANNOTATIONS_ANNOTATION, PREFERRED_TOPOLOGY_ANNOTATION,
    PersistentPodAnnotation, REQUIRED_TOPOLOGY_ANNOTATION, TargetReference,
};
use crate::api::{MODE_ANNOTATION, RELEASE_LOCAL_VOLUMES_ANNOTATION};
use crate::api::{
    NodeTopologyTerm, PersistentPodState, PersistentPodStateSpec, PreferredTopologyTerm,
};

/// Weight of the preferred term generated from `kruise.io/preferred-persistent-topology`.
pub const GENERATED_PREFERRED_WEIGHT: i32 = 100;

/// The most distinct items read from one comma list: more than any list may hold (the
/// validation refuses the spec, and says so), and few enough that reading an annotation of
/// any length costs little.
const MOST_ITEMS: usize = 64;

/// The items of a comma list: trimmed, empty ones and repeats left out, at most [`MOST_ITEMS`].
fn items(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for item in list.split(',') {
        let item = item.trim();
        if !item.is_empty() && !out.iter().any(|o| o == item) {
            if out.len() == MOST_ITEMS {
                break;
            }
            out.push(item.to_owned());
        }
    }
    out
}

fn comma_list(annotations: &BTreeMap<String, String>, key: &str) -> Vec<String> {
    annotations.get(key).map(|v| items(v)).unwrap_or_default()
}

/// The spec a workload's annotations ask for, or `None` if they ask for no PersistentPodState
/// (auto-generation off, or neither required nor preferred topology given: see [`plan`]).
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

/// A workload as the generator sees it.
#[derive(Clone, Debug)]
pub struct Workload<'a> {
    /// Its `apiVersion` (as watched).
    pub api_version: &'a str,
    /// Its kind.
    pub kind: &'a str,
    /// Its namespace.
    pub namespace: &'a str,
    /// Its name (a generated PersistentPodState has the same).
    pub name: &'a str,
    /// Its uid (the generated PersistentPodState's controller ownerReference).
    pub uid: &'a str,
    /// Its annotations.
    pub annotations: &'a BTreeMap<String, String>,
    /// Whether it is being deleted.
    pub deleting: bool,
}

/// Why the generator leaves things as they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leave {
    /// The workload is being deleted (the garbage collector removes what it owns).
    WorkloadDeleting,
    /// The annotations ask for nothing, and no generated PersistentPodState exists.
    NotAsked,
    /// A PersistentPodState named like the workload exists and was not generated for it.
    HandMade,
    /// Another PersistentPodState targets the workload.
    OtherTargets,
    /// The generated PersistentPodState is as the annotations ask (fields they cannot express,
    /// such as the retention policy, are the user's).
    UpToDate,
    /// Generation is asked for with neither required nor preferred topology (the annotations
    /// being edited, one removed before the other is added): the generated PersistentPodState
    /// and its recorded states are kept, as upstream keeps them.
    Incomplete,
}

impl Leave {
    /// A short explanation, for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::WorkloadDeleting => "workload being deleted",
            Self::NotAsked => "not asked for",
            Self::HandMade => {
                "a PersistentPodState named like the workload was not generated for it"
            }
            Self::OtherTargets => "another PersistentPodState targets the workload",
            Self::UpToDate => "up to date",
            Self::Incomplete => "generation asked for with neither required nor preferred topology",
        }
    }
}

/// What the generator does for one workload.
#[derive(Clone, Debug)]
pub enum Plan {
    /// Create this PersistentPodState (fails if one of that name appeared meanwhile).
    Create(Box<PersistentPodState>),
    /// Merge-patch the generated PersistentPodState (conditional on the version planned from).
    Update(Value),
    /// Delete the generated PersistentPodState with this uid.
    Delete {
        /// Precondition: only this object is deleted.
        uid: String,
        /// Precondition: only as planned from (not changed meanwhile).
        resource_version: Option<String>,
    },
    /// Send nothing.
    Leave(Leave),
}

/// What the generator does for one workload, and what it reports about it.
#[derive(Clone, Debug)]
pub struct Planned {
    /// What is sent to the API server.
    pub plan: Plan,
    /// Why the workload's `persistent-pod-state.io/ip-request` is not copied, when it asks for
    /// generation and carries a value that is not valid.
    pub invalid_ip_request: Option<String>,
}

/// Decides what the generator does for `workload`, given the PersistentPodState named like it
/// (`existing`) and the names of the PersistentPodStates that target it (`targeting`). A
/// PersistentPodState not generated for the workload is never changed or deleted.
pub fn plan(
    workload: &Workload<'_>,
    existing: Option<&PersistentPodState>,
    targeting: &[String],
) -> Planned {
    if workload.deleting {
        return Planned {
            plan: Plan::Leave(Leave::WorkloadDeleting),
            invalid_ip_request: None,
        };
    }
    let desired = desired_spec(
        workload.api_version,
        workload.kind,
        workload.name,
        workload.annotations,
    );
    // Copied onto the generated PersistentPodState when valid; an invalid one is left out (so
    // it never reaches a pod) and reported.
    let (ip_request, invalid_ip_request) =
        match (&desired, workload.annotations.get(IP_REQUEST_ANNOTATION)) {
            (Some(_), Some(value)) => match IpRequest::parse(value) {
                Ok(_) => (Some(value.as_str()), None),
                Err(e) => (None, Some(e)),
            },
            _ => (None, None),
        };
    // Copied as given (the controller acts on `"true"` only).
    let release_local = desired
        .as_ref()
        .and_then(|_| workload.annotations.get(RELEASE_LOCAL_VOLUMES_ANNOTATION))
        .map(String::as_str);
    // Copied when it is a value the validation accepts (an invalid one would make every write
    // of the generated object refused).
    let mode = desired
        .as_ref()
        .and_then(|_| workload.annotations.get(MODE_ANNOTATION))
        .map(String::as_str)
        .filter(|m| matches!(*m, "observe" | "active"));
    let copied = [
        (IP_REQUEST_ANNOTATION, ip_request),
        (RELEASE_LOCAL_VOLUMES_ANNOTATION, release_local),
        (MODE_ANNOTATION, mode),
    ];
    Planned {
        plan: plan_spec(workload, existing, targeting, desired, &copied),
        invalid_ip_request,
    }
}

/// [`plan`], once the desired spec and the valid IP request are known.
fn plan_spec(
    workload: &Workload<'_>,
    existing: Option<&PersistentPodState>,
    targeting: &[String],
    desired: Option<PersistentPodStateSpec>,
    copied: &[(&str, Option<&str>)],
) -> Plan {
    let generated = existing.is_some_and(|p| generated_for(p.owner_references(), workload.uid));
    let asked = workload
        .annotations
        .get(AUTO_GENERATE_ANNOTATION)
        .is_some_and(|v| v == "true");
    let Some(mut spec) = desired else {
        return match existing {
            Some(_) if generated && asked => Plan::Leave(Leave::Incomplete),
            Some(p) if generated => Plan::Delete {
                uid: p.uid().unwrap_or_default(),
                resource_version: p.resource_version(),
            },
            _ => Plan::Leave(Leave::NotAsked),
        };
    };
    if existing.is_some() && !generated {
        return Plan::Leave(Leave::HandMade);
    }
    if targeting.iter().any(|other| other != workload.name) {
        return Plan::Leave(Leave::OtherTargets);
    }
    let Some(current) = existing else {
        return Plan::Create(Box::new(PersistentPodState {
            metadata: ObjectMeta {
                name: Some(workload.name.to_owned()),
                namespace: Some(workload.namespace.to_owned()),
                owner_references: Some(vec![OwnerReference {
                    api_version: workload.api_version.to_owned(),
                    kind: workload.kind.to_owned(),
                    name: workload.name.to_owned(),
                    uid: workload.uid.to_owned(),
                    controller: Some(true),
                    block_owner_deletion: None,
                }]),
                annotations: Some(
                    copied
                        .iter()
                        .filter_map(|(k, v)| Some(((*k).to_owned(), (*v)?.to_owned())))
                        .collect::<BTreeMap<_, _>>(),
                )
                .filter(|a| !a.is_empty()),
                ..ObjectMeta::default()
            },
            spec,
            status: None,
        }));
    };
    // The target is matched by group and kind: keep the version already written (the watched
    // version can change, and targetRef is immutable).
    let written = &current.spec.target_ref;
    if written.group() == spec.target_ref.group() && written.kind == spec.target_ref.kind {
        spec.target_ref.api_version = written.api_version.clone();
    }
    // What the annotations express follows them exactly, a field they no longer give included;
    // the rest (the retention policy, labels, other annotations) is the user's and stays. The
    // steady state sends nothing.
    let mut expressed = current.spec.clone();
    expressed.persistent_pod_state_retention_policy = None;
    let written = current.annotations();
    let copied_as_written = copied
        .iter()
        .all(|(k, v)| written.get(*k).map(String::as_str) == *v);
    if expressed == spec && copied_as_written {
        return Plan::Leave(Leave::UpToDate);
    }
    Plan::Update(expressed_patch(&spec, copied, current.resource_version()))
}

/// The JSON merge patch that sets every field the annotations express to `spec` and
/// the `copied` annotations (a field or annotation they do not give is removed), conditional on
/// `resource_version`.
fn expressed_patch(
    spec: &PersistentPodStateSpec,
    copied: &[(&str, Option<&str>)],
    resource_version: Option<String>,
) -> Value {
    // An empty list is no list: removed, as the annotations give none.
    let value = |v: serde_json::Result<Value>| match v {
        Ok(Value::Array(a)) if a.is_empty() => Value::Null,
        Ok(v) => v,
        Err(_) => Value::Null,
    };
    json!({
        "metadata": {
            "resourceVersion": resource_version,
            "annotations": copied.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect::<serde_json::Map<_, _>>(),
        },
        "spec": {
            "targetRef": value(serde_json::to_value(&spec.target_ref)),
            "requiredPersistentTopology": value(serde_json::to_value(&spec.required_persistent_topology)),
            "preferredPersistentTopology": value(serde_json::to_value(&spec.preferred_persistent_topology)),
            "persistentPodAnnotations": value(serde_json::to_value(&spec.persistent_pod_annotations)),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
    fn persistent_pod_annotations_are_part_of_the_wanted_spec() {
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

    fn asking(required: &str) -> BTreeMap<String, String> {
        ann(&[
            (AUTO_GENERATE_ANNOTATION, "true"),
            (REQUIRED_TOPOLOGY_ANNOTATION, required),
        ])
    }

    fn workload(annotations: &BTreeMap<String, String>) -> Workload<'_> {
        Workload {
            api_version: "apps/v1",
            kind: "StatefulSet",
            namespace: "ns",
            name: "web",
            uid: "u1",
            annotations,
            deleting: false,
        }
    }

    fn existing(owner_uid: Option<&str>, api_version: &str, keys: &[&str]) -> PersistentPodState {
        let owners = owner_uid.map(|uid| {
            json!([{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": uid, "controller": true}])
        });
        serde_json::from_value(json!({
            "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": "web", "namespace": "ns", "uid": "pps-uid", "ownerReferences": owners},
            "spec": {"targetRef": {"apiVersion": api_version, "kind": "StatefulSet", "name": "web"},
                     "requiredPersistentTopology": {"keys": keys}}
        }))
        .expect("pps")
    }

    /// The required keys a create or an update writes.
    fn applied_keys(plan: &Plan) -> Option<Vec<String>> {
        match plan {
            Plan::Create(p) => Some(p.spec.required_keys().to_vec()),
            Plan::Update(patch) => {
                serde_json::from_value(patch["spec"]["requiredPersistentTopology"]["keys"].clone())
                    .ok()
            }
            _ => None,
        }
    }

    #[test]
    fn plans_create_update_delete_or_leave() {
        let zone = asking("zone");
        let nothing = ann(&[]);
        let deleting = Workload {
            deleting: true,
            ..workload(&zone)
        };
        let mine = existing(Some("u1"), "apps/v1", &["zone"]);
        let mine_old = existing(Some("u1"), "apps/v1", &["host"]);
        let hand_made = existing(None, "apps/v1", &["host"]);
        let other_uid = existing(Some("u0"), "apps/v1", &["host"]);

        let create = plan(&workload(&zone), None, &[]).plan;
        assert_eq!(applied_keys(&create), Some(vec!["zone".to_string()]));
        let Plan::Create(created) = &create else {
            unreachable!()
        };
        assert_eq!(created.owner_references()[0].uid, "u1");
        assert_eq!(created.owner_references()[0].controller, Some(true));

        assert_eq!(
            applied_keys(&plan(&workload(&zone), Some(&mine_old), &["web".into()]).plan),
            Some(vec!["zone".to_string()]),
            "update"
        );
        let cases = [
            (
                plan(&workload(&zone), Some(&mine), &["web".into()]).plan,
                "Leave(UpToDate)",
            ),
            (
                plan(&deleting, Some(&mine), &[]).plan,
                "Leave(WorkloadDeleting)",
            ),
            (
                plan(&workload(&zone), Some(&hand_made), &["web".into()]).plan,
                "Leave(HandMade)",
            ),
            (
                plan(&workload(&zone), Some(&other_uid), &[]).plan,
                "Leave(HandMade)",
            ),
            (
                plan(&workload(&zone), None, &["other".into()]).plan,
                "Leave(OtherTargets)",
            ),
            (
                plan(&workload(&nothing), Some(&mine), &[]).plan,
                r#"Delete { uid: "pps-uid", resource_version: None }"#,
            ),
            (
                plan(&workload(&nothing), Some(&hand_made), &[]).plan,
                "Leave(NotAsked)",
            ),
            (plan(&workload(&nothing), None, &[]).plan, "Leave(NotAsked)"),
            // Asked for, with no topology yet (one annotation removed before the other is
            // added): what was generated and recorded stays.
            (
                plan(&workload(&asking("")), Some(&mine), &["web".into()]).plan,
                "Leave(Incomplete)",
            ),
            (
                plan(&workload(&asking(" , ")), None, &[]).plan,
                "Leave(NotAsked)",
            ),
        ];
        for (i, (got, want)) in cases.into_iter().enumerate() {
            assert_eq!(format!("{got:?}"), want, "case {i}");
        }
    }

    #[test]
    fn keys_written_untrimmed_or_repeated_are_rewritten_as_the_annotations_read() {
        // As OpenKruise's generator writes "zone, zone": " zone" would match no node label.
        let untrimmed = existing(Some("u1"), "apps/v1", &["zone", " zone"]);
        let planned = plan(
            &workload(&asking("zone, zone")),
            Some(&untrimmed),
            &["web".into()],
        );
        assert_eq!(applied_keys(&planned.plan), Some(vec!["zone".to_string()]));
    }

    #[test]
    fn a_comma_list_of_any_length_is_read_to_a_bound() {
        let long: Vec<String> = (0..100_000).map(|i| format!("k{i}")).collect();
        let keys = items(&long.join(","));
        assert_eq!(keys.len(), MOST_ITEMS);
        assert_eq!(keys.first().map(String::as_str), Some("k0"));
        assert_eq!(items(" a, ,b,a ,"), ["a", "b"]);
    }

    #[test]
    fn a_users_retention_policy_on_a_generated_pps_is_kept() {
        let zone = asking("zone");
        let mut edited = existing(Some("u1"), "apps/v1", &["zone"]);
        edited.spec.persistent_pod_state_retention_policy =
            Some(crate::api::RetentionPolicy::WhenDeleted);
        assert!(matches!(
            plan(&workload(&zone), Some(&edited), &["web".into()]).plan,
            Plan::Leave(Leave::UpToDate)
        ));
        let Plan::Update(patch) =
            plan(&workload(&asking("host")), Some(&edited), &["web".into()]).plan
        else {
            panic!("the required keys changed")
        };
        assert!(
            patch["spec"]
                .get("persistentPodStateRetentionPolicy")
                .is_none(),
            "the merge patch leaves the user's field alone because it is not sent: {patch}"
        );
    }

    #[test]
    fn an_annotation_removed_from_the_workload_is_removed_from_the_pps() {
        let mut full = asking("zone");
        full.insert(PREFERRED_TOPOLOGY_ANNOTATION.into(), "host".into());
        full.insert(PERSISTENT_ANNOTATIONS_ANNOTATION.into(), "a".into());
        full.insert(IP_REQUEST_ANNOTATION.into(), "calico".into());
        full.insert(RELEASE_LOCAL_VOLUMES_ANNOTATION.into(), "true".into());
        let Plan::Create(written) = plan(&workload(&full), None, &[]).plan else {
            panic!("created")
        };
        assert_eq!(
            written
                .annotations()
                .get(RELEASE_LOCAL_VOLUMES_ANNOTATION)
                .map(String::as_str),
            Some("true"),
            "copied from the workload"
        );
        let mut written = *written;
        written.metadata.uid = Some("pps-uid".into());
        written.metadata.resource_version = Some("7".into());
        let removed = |key: &str| {
            let mut less = full.clone();
            less.remove(key);
            let Plan::Update(patch) = plan(&workload(&less), Some(&written), &["web".into()]).plan
            else {
                panic!("{key} removed: an update")
            };
            patch
        };
        let patch = removed(PREFERRED_TOPOLOGY_ANNOTATION);
        assert_eq!(patch["spec"]["preferredPersistentTopology"], Value::Null);
        assert_eq!(patch["metadata"]["resourceVersion"], "7", "conditional");
        assert_eq!(
            removed(REQUIRED_TOPOLOGY_ANNOTATION)["spec"]["requiredPersistentTopology"],
            Value::Null
        );
        assert_eq!(
            removed(PERSISTENT_ANNOTATIONS_ANNOTATION)["spec"]["persistentPodAnnotations"],
            Value::Null
        );
        assert_eq!(
            removed(IP_REQUEST_ANNOTATION)["metadata"]["annotations"][IP_REQUEST_ANNOTATION],
            Value::Null
        );
        assert_eq!(
            removed(RELEASE_LOCAL_VOLUMES_ANNOTATION)["metadata"]["annotations"]
                [RELEASE_LOCAL_VOLUMES_ANNOTATION],
            Value::Null
        );
        // Applied, the patch gives exactly what the workload asks for: the next plan sends
        // nothing.
        let mut less = full.clone();
        less.remove(PREFERRED_TOPOLOGY_ANNOTATION);
        less.remove(IP_REQUEST_ANNOTATION);
        less.remove(RELEASE_LOCAL_VOLUMES_ANNOTATION);
        let Plan::Update(patch) = plan(&workload(&less), Some(&written), &["web".into()]).plan
        else {
            panic!("an update")
        };
        let mut after = serde_json::to_value(&written).expect("json");
        json_patch::merge(&mut after, &patch);
        let after: PersistentPodState = serde_json::from_value(after).expect("pps");
        assert!(after.annotations().get(IP_REQUEST_ANNOTATION).is_none());
        assert!(
            after
                .annotations()
                .get(RELEASE_LOCAL_VOLUMES_ANNOTATION)
                .is_none()
        );
        assert!(after.spec.preferred_persistent_topology.is_empty());
        assert!(
            matches!(
                plan(&workload(&less), Some(&after), &["web".into()]).plan,
                Plan::Leave(Leave::UpToDate)
            ),
            "steady"
        );
    }

    #[test]
    fn the_workloads_ip_request_is_copied_when_valid() {
        let mut with_ip = asking("zone");
        with_ip.insert(IP_REQUEST_ANNOTATION.into(), "calico".into());
        let Plan::Create(created) = plan(&workload(&with_ip), None, &[]).plan else {
            panic!("created")
        };
        assert_eq!(
            created
                .annotations()
                .get(IP_REQUEST_ANNOTATION)
                .map(String::as_str),
            Some("calico")
        );
        let mine = existing(Some("u1"), "apps/v1", &["zone"]);
        assert!(
            matches!(
                plan(&workload(&with_ip), Some(&mine), &["web".into()]).plan,
                Plan::Update(_)
            ),
            "the existing PPS lacks it: updated"
        );
        let mut has_it = mine.clone();
        has_it.metadata.annotations = Some(BTreeMap::from([(
            IP_REQUEST_ANNOTATION.into(),
            "calico".into(),
        )]));
        assert!(matches!(
            plan(&workload(&with_ip), Some(&has_it), &["web".into()]).plan,
            Plan::Leave(Leave::UpToDate)
        ));
        let mut invalid = asking("zone");
        invalid.insert(IP_REQUEST_ANNOTATION.into(), "weave".into());
        let Plan::Create(created) = plan(&workload(&invalid), None, &[]).plan else {
            panic!("created")
        };
        assert!(
            created.annotations().get(IP_REQUEST_ANNOTATION).is_none(),
            "never copied"
        );
        assert!(
            plan(&workload(&invalid), None, &[])
                .invalid_ip_request
                .is_some_and(|e| e.contains("weave")),
            "reported"
        );
        assert_eq!(
            plan(&workload(&with_ip), None, &[]).invalid_ip_request,
            None,
            "valid"
        );
        let mut not_generating = invalid.clone();
        not_generating.insert(AUTO_GENERATE_ANNOTATION.into(), "false".into());
        assert_eq!(
            plan(&workload(&not_generating), None, &[]).invalid_ip_request,
            None,
            "nothing to copy it to"
        );
    }

    #[test]
    fn the_written_target_version_is_kept() {
        let zone = asking("zone");
        let written_v1beta1 = existing(Some("u1"), "apps/v1beta1", &["zone"]);
        assert!(
            matches!(
                plan(&workload(&zone), Some(&written_v1beta1), &[]).plan,
                Plan::Leave(Leave::UpToDate)
            ),
            "targetRef is immutable: only group and kind are compared"
        );
    }
}
