//! `apps.kruise.io/v1alpha1` PersistentPodState (served; converted to and from v1beta1 by the
//! `/convert` webhook): topology terms list `nodeTopologyKeys`.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{PersistentPodAnnotation, PersistentPodStateStatus, RetentionPolicy, TargetReference};

/// Desired behaviour of a PersistentPodState.
#[derive(
    CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema,
)]
#[kube(
    group = "apps.kruise.io",
    version = "v1alpha1",
    kind = "PersistentPodState",
    namespaced,
    status = "PersistentPodStateStatus",
    shortname = "pps",
    printcolumn = r#"{"name":"Kind","type":"string","jsonPath":".spec.targetRef.kind"}"#,
    printcolumn = r#"{"name":"Target","type":"string","jsonPath":".spec.targetRef.name"}"#,
    printcolumn = r#"{"name":"Retention","type":"string","jsonPath":".spec.persistentPodStateRetentionPolicy"}"#,
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
    pub persistent_pod_state_retention_policy: Option<RetentionPolicy>,
}

/// A list of node label keys.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeTopologyTerm {
    /// Node label keys, e.g. `kubernetes.io/hostname`.
    #[schemars(length(min = 1))]
    pub node_topology_keys: Vec<String>,
}

/// A weighted preferred topology term.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct PreferredTopologyTerm {
    /// Weight of the injected preferred node affinity term, 1 to 100.
    #[schemars(range(min = 1, max = 100))]
    pub weight: i32,
    /// The node label keys of this term.
    pub preference: NodeTopologyTerm,
}
