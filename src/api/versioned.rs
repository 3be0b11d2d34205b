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

            /// The required keys (empty when there is no required term), at most
            /// [`MAX_KEYS`](super::MAX_KEYS).
            pub fn required_keys(&self) -> &[String] {
                let keys = self
                    .required_persistent_topology
                    .as_ref()
                    .map_or(&[][..], |t| t.$keys.as_slice());
                &keys[..keys.len().min(super::MAX_KEYS)]
            }

            /// The preferred terms' weights and keys: at most
            /// [`MAX_PREFERRED_TERMS`](super::MAX_PREFERRED_TERMS) terms of at most
            /// [`MAX_KEYS`](super::MAX_KEYS) keys.
            pub fn preferred_terms(&self) -> impl Iterator<Item = (i32, &[String])> {
                self.preferred_persistent_topology
                    .iter()
                    .take(super::MAX_PREFERRED_TERMS)
                    .map(|t| {
                        let keys = t.preference.$keys.as_slice();
                        (t.weight, &keys[..keys.len().min(super::MAX_KEYS)])
                    })
            }

            /// The persistent annotation keys, at most
            /// [`MAX_PERSISTENT_ANNOTATIONS`](super::MAX_PERSISTENT_ANNOTATIONS).
            pub fn persistent_annotation_keys(&self) -> impl Iterator<Item = &str> {
                self.persistent_pod_annotations
                    .iter()
                    .take(super::MAX_PERSISTENT_ANNOTATIONS)
                    .map(|a| a.key.as_str())
            }

            /// What this spec asks for beyond the limits (ignored when recording and
            /// injecting), described for a report; empty when within them.
            pub fn over_limits(&self) -> Vec<String> {
                let mut over = Vec::new();
                let required = self
                    .required_persistent_topology
                    .as_ref()
                    .map_or(0, |t| t.$keys.len());
                if required > super::MAX_KEYS {
                    over.push(format!("{required} required keys (at most {})", super::MAX_KEYS));
                }
                let terms = self.preferred_persistent_topology.len();
                if terms > super::MAX_PREFERRED_TERMS {
                    over.push(format!("{terms} preferred terms (at most {})", super::MAX_PREFERRED_TERMS));
                }
                if let Some(t) = self
                    .preferred_persistent_topology
                    .iter()
                    .find(|t| t.preference.$keys.len() > super::MAX_KEYS)
                {
                    over.push(format!(
                        "a preferred term with {} keys (at most {})",
                        t.preference.$keys.len(),
                        super::MAX_KEYS
                    ));
                }
                let annotations = self.persistent_pod_annotations.len();
                if annotations > super::MAX_PERSISTENT_ANNOTATIONS {
                    over.push(format!(
                        "{annotations} persistent annotations (at most {})",
                        super::MAX_PERSISTENT_ANNOTATIONS
                    ));
                }
                over
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
                self.required_pairs(state)
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect()
            }

            /// [`Self::required_values`], borrowed from the spec and `state`, in the keys'
            /// order.
            pub fn required_pairs<'a>(
                &'a self,
                state: &'a PodState,
            ) -> impl Iterator<Item = (&'a str, &'a str)> {
                self.required_keys().iter().filter_map(|k| {
                    let v = state.node_topology_labels.get(k.as_str())?;
                    Some((k.as_str(), v.as_str()))
                })
            }
        }
    };
}

pub(crate) use versioned_types;
