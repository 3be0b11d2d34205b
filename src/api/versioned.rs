//! One definition of the versioned part of the schema. The served versions differ only in the
//! name of a topology term's key list, so both are generated from this macro and cannot drift.

/// Generates a version's `PersistentPodState` root type (through kube-derive), its spec, and
/// its topology term types, with the key list named `$keys`.
///
/// The schema constrains only what upstream's requires of every version (the fields listed as
/// required): no range on `weight`, no enum on the retention policy. Upstream's v1beta1 has
/// both, but an object created through v1alpha1 (which has neither) is stored as v1beta1, and
/// the API server validates every later write against the stored version's schema, status
/// writes included: with those constraints such an object could never be recorded again. The
/// rules live in the validating webhook, which applies them to what changes.
macro_rules! versioned_types {
    ($version:tt, $keys:ident) => {
        use kube::CustomResource;
        use schemars::JsonSchema;
        use serde::{Deserialize, Serialize};
        use std::collections::BTreeMap;

        use super::{
            PersistentPodAnnotation, PersistentPodStateStatus, PodState, RetentionPolicy,
            TargetReference,
        };

        /// Desired behaviour of a PersistentPodState.
        #[derive(
            CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema,
        )]
        #[kube(
            group = "apps.kruise.io",
            version = $version,
            kind = "PersistentPodState",
            namespaced,
            status = "PersistentPodStateStatus",
            shortname = "pps",
            printcolumn = r#"{"name":"Kind","type":"string","jsonPath":".spec.targetRef.kind"}"#,
            printcolumn = r#"{"name":"Target","type":"string","jsonPath":".spec.targetRef.name"}"#,
            printcolumn = r#"{"name":"Retention","type":"string","jsonPath":".spec.persistentPodStateRetentionPolicy"}"#,
            printcolumn = r#"{"name":"Recorded","type":"integer","description":"Pods with a recorded state","jsonPath":".status.recorded"}"#,
            printcolumn = r#"{"name":"Restored","type":"string","description":"Of the last re-created pods steered back, those that kept node and IP","jsonPath":".status.restored"}"#,
            printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
        )]
        #[serde(rename_all = "camelCase")]
        pub struct PersistentPodStateSpec {
            /// The workload (StatefulSet or a configured StatefulSet-like kind) whose pods are kept.
            pub target_ref: TargetReference,
            /// Node labels a re-created pod must keep: injected into `spec.nodeSelector`.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub required_persistent_topology: Option<NodeTopologyTerm>,
            /// Node labels a re-created pod should keep: injected as preferred node affinity.
            #[serde(default, skip_serializing_if = "Vec::is_empty")]
            pub preferred_persistent_topology: Vec<PreferredTopologyTerm>,
            /// Pod annotations recorded and given back to the re-created pod.
            #[serde(default, skip_serializing_if = "Vec::is_empty")]
            pub persistent_pod_annotations: Vec<PersistentPodAnnotation>,
            /// When recorded states are dropped; `WhenScaled` by default.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schemars(with = "Option<String>")]
            pub persistent_pod_state_retention_policy: Option<RetentionPolicy>,
        }

        /// A list of node label keys.
        #[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
        #[serde(rename_all = "camelCase")]
        pub struct NodeTopologyTerm {
            /// Node label keys, e.g. `kubernetes.io/hostname`.
            pub $keys: Vec<String>,
        }

        /// A weighted preferred topology term.
        #[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
        pub struct PreferredTopologyTerm {
            /// Weight of the injected preferred node affinity term, 1 to 100 (validated by the
            /// webhook; out-of-range values stored earlier are clamped when injected).
            pub weight: i32,
            /// The node label keys of this term.
            pub preference: NodeTopologyTerm,
        }

        impl PersistentPodStateSpec {
            /// The retention policy in force (`WhenScaled` unless `WhenDeleted` is set).
            pub fn retention(&self) -> RetentionPolicy {
                match self.persistent_pod_state_retention_policy {
                    Some(RetentionPolicy::WhenDeleted) => RetentionPolicy::WhenDeleted,
                    _ => RetentionPolicy::WhenScaled,
                }
            }

            /// The required keys (empty when there is no required term).
            pub fn required_keys(&self) -> &[String] {
                self.required_persistent_topology
                    .as_ref()
                    .map_or(&[], |t| t.$keys.as_slice())
            }

            /// The preferred terms' weights and keys.
            pub fn preferred_terms(&self) -> impl Iterator<Item = (i32, &[String])> {
                self.preferred_persistent_topology
                    .iter()
                    .map(|t| (t.weight, t.preference.$keys.as_slice()))
            }

            /// The union of required and preferred keys, in first-seen order, without repeats.
            pub fn topology_keys(&self) -> Vec<&str> {
                let mut keys: Vec<&str> = Vec::new();
                let preferred = self.preferred_terms().flat_map(|(_, keys)| keys.iter());
                for key in self.required_keys().iter().chain(preferred) {
                    if !keys.contains(&key.as_str()) {
                        keys.push(key);
                    }
                }
                keys
            }

            /// The recorded values of the required keys in `state`: what a re-created pod must
            /// match (keys without a recorded value are left out).
            pub fn required_values(&self, state: &PodState) -> BTreeMap<String, String> {
                self.required_keys()
                    .iter()
                    .filter_map(|k| {
                        state
                            .node_topology_labels
                            .get(k)
                            .map(|v| (k.clone(), v.clone()))
                    })
                    .collect()
            }
        }
    };
}

pub(crate) use versioned_types;
