//! The `apps.kruise.io` PersistentPodState API: the version-independent parts of the schema,
//! the workload annotations, and the CustomResourceDefinition built from the Rust types.
//!
//! The versions differ only in the field that lists a topology term's label keys: every other
//! type lives here, and both versions' spec types come from one definition ([`versioned`]).

pub mod conversion;
pub mod ip_request;
pub mod keys;
pub mod v1alpha1;
pub mod v1beta1;
pub mod validation;
mod versioned;

/// The version the caches, controllers and webhooks work with: the storage version.
pub use v1beta1::{
    NodeTopologyTerm, PersistentPodState, PersistentPodStateSpec, PreferredTopologyTerm,
};

use std::collections::BTreeMap;

use crate::shared::Shared;
use k8s_openapi::ByteString;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceConversion, CustomResourceDefinition, SelectableField, ServiceReference,
    WebhookClientConfig, WebhookConversion,
};
use kube::CustomResourceExt;
use litemap::LiteMap;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of PersistentPodState and of Kruise's Advanced StatefulSet.
pub const KRUISE_GROUP: &str = "apps.kruise.io";

/// Workload annotation: `"true"` asks for a generated PersistentPodState.
pub const AUTO_GENERATE_ANNOTATION: &str = "kruise.io/auto-generate-persistent-pod-state";
/// Workload annotation: comma list of node label keys the pod must keep (required affinity).
pub const REQUIRED_TOPOLOGY_ANNOTATION: &str = "kruise.io/required-persistent-topology";
/// Workload annotation: comma list of node label keys the pod should keep (preferred, weight 100).
pub const PREFERRED_TOPOLOGY_ANNOTATION: &str = "kruise.io/preferred-persistent-topology";
/// Workload annotation: comma list of pod annotation keys to record and restore.
pub const PERSISTENT_ANNOTATIONS_ANNOTATION: &str = "kruise.io/persistent-pod-annotations";
/// Pod annotation set by the webhook: the name of the PersistentPodState that was injected.
pub const INJECTED_ANNOTATION: &str = "kruise.io/injected-persistent-pod-state";
/// Pod annotation set by the webhook: the required values it added to `spec.nodeSelector`
/// (`key=value,...`), so the controller knows which of a waiting pod's constraints are its own
/// to release.
pub const INJECTED_REQUIRED_ANNOTATION: &str = "persistent-pod-state.io/injected-required";

/// PersistentPodState (or workload, copied by the generator) annotation: `"true"` lets the
/// controller delete a waiting pod's claims bound to node-local volumes of a node that is gone.
pub const RELEASE_LOCAL_VOLUMES_ANNOTATION: &str = "persistent-pod-state.io/release-local-volumes";

/// PersistentPodState (or workload, copied by the generator) annotation: `observe` records and
/// computes everything and injects nothing, reporting what it would have injected (a
/// `WouldInject` Event, `pps_observed_total`, `explain`); `active` (the default) injects. For
/// running beside OpenKruise before switching (`serve --mode observe` observes every one).
pub const MODE_ANNOTATION: &str = "persistent-pod-state.io/mode";

/// Whether `pps` is observed only: every one under `serve --mode observe`, else by its own
/// [`MODE_ANNOTATION`].
pub fn observed_only(pps: &PersistentPodState, observe_all: bool) -> bool {
    observe_all
        || pps
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(MODE_ANNOTATION))
            .is_some_and(|m| m == "observe")
}

/// The value of [`INJECTED_REQUIRED_ANNOTATION`] for `values` (key, value pairs in key order,
/// as a map gives them); empty for none.
pub fn encode_required<K: AsRef<str>, V: AsRef<str>>(
    values: impl IntoIterator<Item = (K, V), IntoIter: Clone>,
) -> String {
    let values = values.into_iter();
    let size = values
        .clone()
        .map(|(k, v)| k.as_ref().len() + v.as_ref().len() + 2)
        .sum();
    let mut out = String::with_capacity(size);
    for (k, v) in values {
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(k.as_ref());
        out.push('=');
        out.push_str(v.as_ref());
    }
    out
}

/// The values an [`INJECTED_REQUIRED_ANNOTATION`] names; `None` if it does not parse (then no
/// value is taken for the webhook's).
pub fn decode_required(text: &str) -> Option<BTreeMap<String, String>> {
    text.split(',')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=')?;
            (!k.is_empty()).then(|| (k.to_owned(), v.to_owned()))
        })
        .collect()
}

/// The workload whose pods a PersistentPodState keeps in place.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TargetReference {
    /// API version of the workload, e.g. `apps/v1`; only its group is matched.
    pub api_version: String,
    /// Kind of the workload, e.g. `StatefulSet`.
    pub kind: String,
    /// Name of the workload, in the PersistentPodState's namespace.
    pub name: String,
}

impl TargetReference {
    /// The API group of `api_version` (empty for the core group).
    pub fn group(&self) -> &str {
        api_group(&self.api_version)
    }
}

/// Keys read of a key list (required, or one preferred term); the validating webhook refuses
/// more, and more stored earlier are ignored (and reported).
pub const MAX_KEYS: usize = 16;
/// Preferred terms read of a PersistentPodState.
pub const MAX_PREFERRED_TERMS: usize = 16;
/// Persistent annotations read of a PersistentPodState.
pub const MAX_PERSISTENT_ANNOTATIONS: usize = 32;

/// The versions served, oldest first.
pub const VERSIONS: [&str; 2] = ["v1alpha1", "v1beta1"];

/// The field that lists a topology term's keys in `version` (`None` for a version not served).
pub fn keys_field(version: &str) -> Option<&'static str> {
    match version {
        "v1alpha1" => Some("nodeTopologyKeys"),
        "v1beta1" => Some("keys"),
        _ => None,
    }
}

/// The group part of an `apiVersion` (`apps/v1` -> `apps`, `v1` -> ``).
pub fn api_group(api_version: &str) -> &str {
    api_version.rsplit_once('/').map_or("", |(group, _)| group)
}

/// A pod annotation whose value is recorded and given back to the re-created pod.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct PersistentPodAnnotation {
    /// The annotation key.
    pub key: String,
}

/// When recorded states are dropped.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RetentionPolicy {
    /// Drop the state of a pod once it is gone and its ordinal is no longer live (scale-in).
    #[default]
    WhenScaled,
    /// Keep every state until the workload is deleted and the state's pod is gone.
    WhenDeleted,
    /// A value this version does not know (stored by an older schema); treated as `WhenScaled`.
    #[serde(other)]
    #[schemars(skip)]
    Unrecognized,
}

/// Status of a PersistentPodState: the recorded placement of each pod.
///
/// `recorded` and `restored` extend the upstream API (additive, optional; upstream's schema
/// prunes them): they back the printer columns of `kubectl get pps`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PersistentPodStateStatus {
    /// The `metadata.generation` the status was computed from.
    #[serde(default)]
    pub observed_generation: i64,
    /// Recorded state by pod name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_states: BTreeMap<String, PodState>,
    /// Extension: how many pod states are recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded: Option<i32>,
    /// Extension: of the recorded pods whose last re-creation was steered back, how many came
    /// back to their node without losing their IP, as `restored/re-created` (e.g. `3/4`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored: Option<String>,
}

impl PersistentPodStateStatus {
    /// The status without this service's extension fields (`recorded`, `restored`, and each
    /// state's `podIPs`, `podUID`, `nodeUID` and `lastRestore`): what a CRD that does not
    /// declare them (OpenKruise's) keeps of it.
    #[must_use]
    pub fn without_extensions(mut self) -> Self {
        self.recorded = None;
        self.restored = None;
        for state in self.pod_states.values_mut() {
            state.pod_ips.clear();
            state.pod_uid = None;
            state.node_uid = None;
            state.last_restore = None;
        }
        self
    }
}

/// Where a pod ran the last time it was Ready, and its persisted annotations.
///
/// `podIPs`, `podUID`, `nodeUID` and `lastRestore` extend the upstream API (additive, optional).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodState {
    /// The node the pod ran on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<Shared>,
    // A sorted vector, not a tree map: a state is cached for every pod, and a tree map's
    // first node alone is over 500 bytes. Keys and values are shared: every state repeats them.
    /// That node's values of the required and preferred topology keys.
    #[serde(default, skip_serializing_if = "LiteMap::is_empty")]
    #[schemars(with = "BTreeMap<String, String>")]
    pub node_topology_labels: LiteMap<Shared, Shared>,
    /// The pod's values of the persistent annotation keys.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Extension: the pod's IPs (`status.podIPs`, every family) when it was Ready.
    #[serde(default, rename = "podIPs", skip_serializing_if = "Vec::is_empty")]
    pub pod_ips: Vec<String>,
    /// Extension: the uid of the pod recorded, to tell a re-created pod from the same one.
    #[serde(default, rename = "podUID", skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// Extension: the uid of the node the pod ran on, to tell a node replaced under the same
    /// name (its local data gone) from the same node.
    #[serde(default, rename = "nodeUID", skip_serializing_if = "Option::is_none")]
    pub node_uid: Option<Shared>,
    /// Extension: how the last re-created pod of this name came back, compared with what it
    /// was steered back to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_restore: Option<Restore>,
}

/// How a re-created pod came back, compared with its recorded state.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Restore {
    /// `kept` (same node) or `moved`.
    pub node: NodeRestore,
    /// `kept` (same IPs), `changed`, or `none` (no recorded IP to compare).
    pub ip: IpRestore,
}

impl Restore {
    /// Whether the pod came back to its node without losing its IP.
    pub fn restored(&self) -> bool {
        self.node == NodeRestore::Kept && self.ip != IpRestore::Changed
    }
}

/// Whether a re-created pod is on its recorded node.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum NodeRestore {
    /// On the recorded node.
    Kept,
    /// On another node.
    Moved,
}

/// Whether a re-created pod has its recorded IPs.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum IpRestore {
    /// The recorded IPs.
    Kept,
    /// Other IPs.
    Changed,
    /// No IP was recorded (or the pod has none), so nothing to compare.
    None,
}

/// Where the API server reaches the `/convert` webhook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConversionEndpoint {
    /// A Service in the cluster (the installed Deployment), on port 443.
    Service {
        /// Namespace of the Service.
        namespace: String,
        /// Name of the Service.
        name: String,
    },
    /// A URL (`https://host:port/convert`), e.g. a process outside the cluster.
    Url(String),
}

impl Default for ConversionEndpoint {
    fn default() -> Self {
        Self::Service {
            namespace: "persistent-pod-state".into(),
            name: "persistent-pod-state".into(),
        }
    }
}

/// The stored version's selectable field: the validating webhook's live read on CREATE filters
/// by it.
pub const TARGET_NAME_FIELD: &str = "spec.targetRef.name";

/// The CustomResourceDefinition: v1alpha1 and v1beta1 served, v1beta1 stored, converted by the
/// webhook at `endpoint` (trusted through `ca_bundle`, PEM, when given), v1beta1's
/// `spec.targetRef.name` a selectable field (for the validating webhook's live read) unless
/// `selectable_fields` is false (API servers before 1.30 do not know the field, and a strict
/// client refuses it).
pub fn crd(
    endpoint: &ConversionEndpoint,
    ca_bundle: Option<&[u8]>,
    selectable_fields: bool,
) -> CustomResourceDefinition {
    let mut crd = kube::core::crd::merge_crds(
        vec![
            v1alpha1::PersistentPodState::crd(),
            v1beta1::PersistentPodState::crd(),
        ],
        "v1beta1",
    )
    .unwrap_or_else(|e| unreachable!("both versions derive from one definition: {e}"));
    // Upstream's schema does not require `spec` (kube-derive's does): no stricter than upstream.
    for version in &mut crd.spec.versions {
        if let Some(root) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            root.required = None;
        }
        // On the stored version only, which the webhook lists through: the API server refuses
        // the same selectable fields on versions whose schemas differ (it hoists them alone to
        // the CRD's top level, where they need a shared schema: kubernetes/kubernetes#140689).
        version.selectable_fields = (selectable_fields && version.name == "v1beta1").then(|| {
            vec![SelectableField {
                json_path: format!(".{}", TARGET_NAME_FIELD),
            }]
        });
    }
    let (url, service) = match endpoint {
        ConversionEndpoint::Url(url) => (Some(url.clone()), None),
        ConversionEndpoint::Service { namespace, name } => (
            None,
            Some(ServiceReference {
                namespace: namespace.clone(),
                name: name.clone(),
                path: Some("/convert".into()),
                port: Some(443),
            }),
        ),
    };
    crd.spec.conversion = Some(CustomResourceConversion {
        strategy: "Webhook".into(),
        webhook: Some(WebhookConversion {
            conversion_review_versions: vec!["v1".into()],
            client_config: Some(WebhookClientConfig {
                url,
                service,
                ca_bundle: ca_bundle.map(|b| ByteString(b.to_vec())),
            }),
        }),
    });
    crd
}

/// The CustomResourceDefinition as YAML; with the default endpoint, no CA bundle and the
/// selectable fields it is what the chart's `files/crd.yaml` holds (the chart sets the endpoint
/// and CA bundle per release, and leaves the selectable fields out on older clusters).
pub fn crd_yaml(
    endpoint: &ConversionEndpoint,
    ca_bundle: Option<&[u8]>,
    selectable_fields: bool,
) -> Result<String, serde_yaml_ng::Error> {
    serde_yaml_ng::to_string(&crd(endpoint, ca_bundle, selectable_fields))
}

/// Characters of an offending value shown in a message.
const MAX_SHOWN: usize = 64;

/// An offending value as a message shows it: quoted, and cut after [`MAX_SHOWN`] characters
/// (a value echoed from a request may be as large as the request).
pub fn shown(value: &str) -> String {
    match value.char_indices().nth(MAX_SHOWN) {
        None => format!("{value:?}"),
        Some((cut, _)) => format!(
            "{:?}... ({} more characters)",
            &value[..cut],
            value.chars().count() - MAX_SHOWN
        ),
    }
}

/// A name from a request as a log line shows it: at most its first 253 bytes (the longest
/// name Kubernetes allows), then `...`; written without being copied first.
pub struct Cut<'a>(pub &'a str);

impl std::fmt::Display for Cut<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const MAX: usize = 253;
        if self.0.len() <= MAX {
            return f.write_str(self.0);
        }
        let mut at = MAX;
        while !self.0.is_char_boundary(at) {
            at -= 1;
        }
        write!(f, "{}...", &self.0[..at])
    }
}

/// What is wrong with JSON, without quoting it (a parse error may quote part of a pod spec,
/// which stays out of logs): the kind of error and where.
pub fn json_error_summary(e: &serde_json::Error) -> String {
    let kind = match e.classify() {
        serde_json::error::Category::Io => "unreadable",
        serde_json::error::Category::Syntax => "not valid JSON",
        serde_json::error::Category::Data => "not of the expected shape",
        serde_json::error::Category::Eof => "truncated",
    };
    format!("{kind} (line {}, column {})", e.line(), e.column())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_logged_cut_after_the_longest_kubernetes_allows() {
        assert_eq!(Cut("web-0").to_string(), "web-0");
        let at_most = "n".repeat(253);
        assert_eq!(Cut(&at_most).to_string(), at_most);
        // 2-byte characters: cut on a character's boundary, never inside one.
        let long = "é".repeat(1_000_000);
        let logged = Cut(&long).to_string();
        assert!(
            logged.len() <= 256 && logged.ends_with("..."),
            "{}",
            logged.len()
        );
        assert!(long.starts_with(logged.trim_end_matches("...")));
        assert!(shown(&long).len() < 200);
    }

    #[test]
    fn the_chart_holds_the_generated_crd() {
        let committed = include_str!("../../charts/persistent-pod-state/files/crd.yaml");
        let generated = crd_yaml(&ConversionEndpoint::default(), None, true).expect("serializes");
        assert!(
            committed == generated,
            "charts/persistent-pod-state/files/crd.yaml differs from `persistent-pod-state crd`; regenerate it with `make manifests`"
        );
    }

    #[test]
    fn the_seeds_pps_yaml_parses() {
        let seed = r#"
apiVersion: apps.kruise.io/v1alpha1
kind: PersistentPodState
metadata:
  name: echoserver
  namespace: echoserver
spec:
  targetRef:
    apiVersion: apps.kruise.io/v1beta1
    kind: StatefulSet
    name: echoserver
  requiredPersistentTopology:
    nodeTopologyKeys:
      - failure-domain.beta.kubernetes.io/zone
  preferredPersistentTopology:
    - preference:
        nodeTopologyKeys:
          - kubernetes.io/hostname
      weight: 100
status:
  podStates:
    configserver-0:
      nodeName: worker2
      nodeTopologyLabels:
        kubernetes.io/hostname: worker2
"#;
        let pps: v1alpha1::PersistentPodState = serde_yaml_ng::from_str(seed).expect("parses");
        assert_eq!(pps.spec.target_ref.group(), "apps.kruise.io");
        let required = pps
            .spec
            .required_persistent_topology
            .as_ref()
            .expect("required");
        assert_eq!(
            required.node_topology_keys,
            ["failure-domain.beta.kubernetes.io/zone"]
        );
        assert_eq!(pps.spec.persistent_pod_state_retention_policy, None);
        let status = pps.status.expect("status");
        assert_eq!(
            status.pod_states["configserver-0"].node_name.as_deref(),
            Some("worker2")
        );
    }

    #[test]
    fn unknown_retention_values_do_not_break_reading() {
        let spec: PersistentPodStateSpec = serde_json::from_value(serde_json::json!({
            "targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "a"},
            "persistentPodStateRetentionPolicy": "Sometimes"
        }))
        .expect("parses");
        assert_eq!(spec.retention(), RetentionPolicy::WhenScaled);
    }
}

#[cfg(test)]
mod crd_tests {
    use super::*;

    #[test]
    fn serves_both_versions_stores_v1beta1_and_converts_by_webhook() {
        let crd = crd(
            &ConversionEndpoint::Url("https://127.0.0.1:9443/convert".into()),
            Some(b"PEM"),
            true,
        );
        let mut versions: Vec<(&str, bool, bool)> = crd
            .spec
            .versions
            .iter()
            .map(|v| (v.name.as_str(), v.served, v.storage))
            .collect();
        versions.sort();
        assert_eq!(
            versions,
            [("v1alpha1", true, false), ("v1beta1", true, true)]
        );
        let conversion = crd.spec.conversion.expect("conversion");
        assert_eq!(conversion.strategy, "Webhook");
        let client = conversion
            .webhook
            .and_then(|w| w.client_config)
            .expect("client config");
        assert_eq!(
            client.url.as_deref(),
            Some("https://127.0.0.1:9443/convert")
        );
        assert_eq!(client.ca_bundle.map(|b| b.0), Some(b"PEM".to_vec()));
    }

    /// v1beta1, through which the validating webhook lists, selects by the target's name;
    /// v1alpha1 selects by nothing (the same fields on both would be refused, see `crd`);
    /// neither when left out for older API servers.
    #[test]
    fn the_stored_version_selects_by_the_target_name_unless_left_out() {
        let endpoint = ConversionEndpoint::default();
        let mut selecting: Vec<(String, Vec<String>)> = crd(&endpoint, None, true)
            .spec
            .versions
            .into_iter()
            .map(|v| {
                let paths = v.selectable_fields.into_iter().flatten();
                (v.name, paths.map(|f| f.json_path).collect())
            })
            .collect();
        selecting.sort();
        assert_eq!(
            selecting,
            [
                ("v1alpha1".to_owned(), vec![]),
                (
                    "v1beta1".to_owned(),
                    vec![".spec.targetRef.name".to_owned()]
                )
            ]
        );
        assert!(
            crd(&endpoint, None, false)
                .spec
                .versions
                .iter()
                .all(|v| v.selectable_fields.is_none())
        );
    }
}

#[cfg(test)]
mod upstream_schema_tests {
    use super::*;
    use serde_json::{Value, json};

    /// Every constraint in a schema, as `(path, keyword, value)`.
    fn constraints(schema: &Value, path: &str, out: &mut Vec<(String, String, Value)>) {
        let Some(obj) = schema.as_object() else {
            return;
        };
        for (key, value) in obj {
            match key.as_str() {
                "properties" => {
                    for (name, sub) in value.as_object().into_iter().flatten() {
                        constraints(sub, &format!("{path}.{name}"), out);
                    }
                }
                "items" => constraints(value, &format!("{path}[]"), out),
                "additionalProperties" => constraints(value, &format!("{path}{{}}"), out),
                "description" | "title" | "type" | "format" | "nullable" | "default" => {}
                _ => out.push((path.to_owned(), key.clone(), value.clone())),
            }
        }
    }

    /// Issue 8.3: an object upstream's CRD accepts is accepted by ours. Upstream's constraints,
    /// per version: the required fields below; v1beta1 adds `weight >= 0` and the retention
    /// enum (ours leaves those two out: see `versioned.rs`). Anything else (a length, a range,
    /// a pattern) would be stricter.
    #[test]
    fn the_crd_schema_is_no_stricter_than_upstreams() {
        let crd =
            serde_json::to_value(crd(&ConversionEndpoint::default(), None, true)).expect("json");
        for version in crd["spec"]["versions"].as_array().expect("versions") {
            let name = version["name"].as_str().expect("name");
            let keys = keys_field(name).expect("served");
            let mut allowed: Vec<(String, String, Value)> = vec![
                (".spec".into(), "required".into(), json!(["targetRef"])),
                (
                    ".spec.targetRef".into(),
                    "required".into(),
                    json!(["apiVersion", "kind", "name"]),
                ),
                (
                    ".spec.requiredPersistentTopology".into(),
                    "required".into(),
                    json!([keys]),
                ),
                (
                    ".spec.preferredPersistentTopology[]".into(),
                    "required".into(),
                    json!(["preference", "weight"]),
                ),
                (
                    ".spec.preferredPersistentTopology[].preference".into(),
                    "required".into(),
                    json!([keys]),
                ),
                (
                    ".spec.persistentPodAnnotations[]".into(),
                    "required".into(),
                    json!(["key"]),
                ),
            ];
            if name == "v1beta1" {
                allowed.push((
                    ".spec.preferredPersistentTopology[].weight".into(),
                    "minimum".into(),
                    json!(0.0),
                ));
                allowed.push((
                    ".spec.persistentPodStateRetentionPolicy".into(),
                    "enum".into(),
                    json!(["WhenScaled", "WhenDeleted"]),
                ));
            }
            let mut found = Vec::new();
            constraints(&version["schema"]["openAPIV3Schema"], "", &mut found);
            // Our own status extension (absent from upstream's objects) may have a shape.
            found.retain(|(path, _, _)| !path.starts_with(".status.podStates{}.lastRestore"));
            for (path, keyword, value) in found {
                // A required list may name fewer fields than upstream's, never more.
                let ok = allowed.iter().any(|(p, k, v)| {
                    *p == path
                        && *k == keyword
                        && (*v == value
                            || (keyword == "required"
                                && value.as_array().is_some_and(|fields| {
                                    fields
                                        .iter()
                                        .all(|f| v.as_array().is_some_and(|a| a.contains(f)))
                                })))
                });
                assert!(
                    ok,
                    "{name}: {path} has {keyword}: {value}, which upstream's schema does not"
                );
            }
        }
    }
}
