//! StatefulSet-like workloads: which kinds are handled, how a pod names its workload, and which
//! ordinals of a workload are live. Pure functions over API objects.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{NodeAffinity, Pod, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::Value;

use crate::api::{
    INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION, KRUISE_GROUP, TargetReference, api_group,
};

/// API group of the native StatefulSet.
pub const APPS_GROUP: &str = "apps";
/// Kind of the native StatefulSet (and of Kruise's Advanced StatefulSet).
pub const STATEFULSET: &str = "StatefulSet";

/// A kind of workload, without version (`apps`/`StatefulSet`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupKind {
    /// API group (empty for core).
    pub group: String,
    /// Kind.
    pub kind: String,
}

impl GroupKind {
    /// A group and kind.
    pub fn new(group: &str, kind: &str) -> Self {
        Self {
            group: group.to_owned(),
            kind: kind.to_owned(),
        }
    }

    /// The group and kind a PersistentPodState targets (the version is not matched).
    pub fn of_target(target: &TargetReference) -> Self {
        Self::new(target.group(), &target.kind)
    }

    /// Native `apps/v1` StatefulSet.
    pub fn native_statefulset() -> Self {
        Self::new(APPS_GROUP, STATEFULSET)
    }

    /// Whether this is the native `apps` StatefulSet.
    pub fn is_native_statefulset(&self) -> bool {
        self.kind == STATEFULSET && self.group == APPS_GROUP
    }

    /// Whether pods of this kind are handled: StatefulSets of `apps` and `apps.kruise.io`.
    pub fn is_statefulset(&self) -> bool {
        self.kind == STATEFULSET && (self.group == APPS_GROUP || self.group == KRUISE_GROUP)
    }
}

/// The configured custom StatefulSet-like kinds (replaced as a whole when the configuration
/// changes).
#[derive(Debug, Default)]
pub struct CustomKinds(std::sync::RwLock<BTreeSet<GroupKind>>);

impl CustomKinds {
    /// A set of kinds.
    pub fn new(kinds: impl IntoIterator<Item = GroupKind>) -> Self {
        Self(std::sync::RwLock::new(kinds.into_iter().collect()))
    }

    /// Whether `kind` is configured.
    pub fn contains(&self, kind: &GroupKind) -> bool {
        crate::sync::read(&self.0).contains(kind)
    }

    /// Replaces the set; returns the kinds that were added.
    pub fn replace(&self, kinds: BTreeSet<GroupKind>) -> Vec<GroupKind> {
        let mut current = crate::sync::write(&self.0);
        let added = kinds.difference(&current).cloned().collect();
        *current = kinds;
        added
    }

    /// Whether pods controlled by `kind` are handled: StatefulSets and configured kinds.
    pub fn handles(&self, kind: &GroupKind) -> bool {
        kind.is_statefulset() || self.contains(kind)
    }
}

/// A workload object by namespace, group, kind and name: how a PersistentPodState's target and a
/// pod's controller are matched (the version is ignored).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkloadRef {
    /// Namespace of the workload.
    pub namespace: String,
    /// Group and kind.
    pub kind: GroupKind,
    /// Name.
    pub name: String,
}

/// What the admission decision reads of a pod, by reference: taken from a whole `Pod` (the
/// controller's, `explain`'s) or from the webhook's own reading of a review, which decodes only
/// these fields and never builds a `Pod` (a `Pod` is over 2 KB, most of it absent fields that
/// are written, checked and dropped per review).
#[derive(Clone, Copy, Debug, Default)]
pub struct PodView<'a> {
    /// The pod's name (for a pod created with `generateName` only, the request's).
    pub name: Option<&'a str>,
    /// The namespace the object names.
    pub namespace: Option<&'a str>,
    /// Its annotations.
    pub annotations: Option<&'a BTreeMap<String, String>>,
    /// Its owner references.
    pub owner_references: &'a [OwnerReference],
    /// What its spec demands of a node; absent without a spec.
    pub spec: Option<SpecView<'a>>,
}

/// The spec fields the decision reads: what the pod demands of a node.
#[derive(Clone, Copy, Debug, Default)]
pub struct SpecView<'a> {
    /// `spec.nodeSelector`.
    pub node_selector: Option<&'a BTreeMap<String, String>>,
    /// Whether `spec.affinity` is set (of any kind).
    pub has_affinity: bool,
    /// `spec.affinity.nodeAffinity`.
    pub node_affinity: Option<&'a NodeAffinity>,
    /// `spec.tolerations`.
    pub tolerations: &'a [Toleration],
    /// `spec.nodeName`: the node the pod is bound to as it is created (the scheduler bypassed).
    pub node_name: Option<&'a str>,
}

impl<'a> From<&'a Pod> for PodView<'a> {
    fn from(pod: &'a Pod) -> Self {
        let meta = &pod.metadata;
        Self {
            name: meta.name.as_deref(),
            namespace: meta.namespace.as_deref(),
            annotations: meta.annotations.as_ref(),
            owner_references: meta.owner_references.as_deref().unwrap_or_default(),
            spec: pod.spec.as_ref().map(|s| SpecView {
                node_selector: s.node_selector.as_ref(),
                has_affinity: s.affinity.is_some(),
                node_affinity: s.affinity.as_ref().and_then(|a| a.node_affinity.as_ref()),
                tolerations: s.tolerations.as_deref().unwrap_or_default(),
                node_name: s.node_name.as_deref(),
            }),
        }
    }
}

impl<'a> PodView<'a> {
    /// The annotation `key`, if the pod has it.
    pub fn annotation(&self, key: &str) -> Option<&'a str> {
        self.annotations?.get(key).map(String::as_str)
    }

    /// The StatefulSet-like workload that controls the pod (in `namespace`), if any.
    pub fn workload(&self, namespace: &str) -> Option<WorkloadRef> {
        let owner = controller_owner(self.owner_references)?;
        Some(owner_workload(
            namespace,
            &owner.api_version,
            &owner.kind,
            &owner.name,
        ))
    }
}

/// The controller ownerReference of an object, if any.
pub fn controller_owner(owners: &[OwnerReference]) -> Option<&OwnerReference> {
    owners.iter().find(|o| o.controller == Some(true))
}

/// The workload an owner reference (`apiVersion`, `kind`, `name`) in `namespace` names.
pub fn owner_workload(namespace: &str, api_version: &str, kind: &str, name: &str) -> WorkloadRef {
    WorkloadRef {
        namespace: namespace.to_owned(),
        kind: GroupKind::new(api_group(api_version), kind),
        name: name.to_owned(),
    }
}

/// Whether the pod's Ready condition is True.
pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The pod's IPs, every family (`status.podIPs`, else `status.podIP`).
pub fn pod_ips(pod: &Pod) -> Vec<String> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    match status.pod_ips.as_deref() {
        Some(ips) if !ips.is_empty() => ips.iter().map(|ip| ip.ip.clone()).collect(),
        _ => status.pod_ip.iter().cloned().collect(),
    }
}

/// The ordinal of a pod: the integer after the last `-` of its name.
pub fn pod_ordinal(pod_name: &str) -> Option<i32> {
    let (_, ordinal) = pod_name.rsplit_once('-')?;
    if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    ordinal.parse().ok()
}

/// The facts about a workload that recording and pruning need.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkloadInfo {
    /// UID of the workload object.
    pub uid: String,
    /// `spec.replicas` (1 when unset).
    pub replicas: i32,
    /// `spec.ordinals.start` (0 when unset).
    pub ordinal_start: i32,
    /// Ordinals skipped when counting replicas (Advanced StatefulSet `reserveOrdinals`), as
    /// sorted, disjoint, inclusive ranges (never expanded, whatever their size).
    pub reserved: Vec<(i64, i64)>,
    /// Whether `reserveOrdinals` had more entries than are read ([`MAX_RESERVED_ENTRIES`]).
    pub reserved_truncated: bool,
    /// Whether the workload has a deletionTimestamp.
    pub deleting: bool,
    /// The names of its `volumeClaimTemplates` (its pods' own claims are `<name>-<pod>`).
    pub claim_templates: Vec<String>,
    /// Whether its pod template carries either of the webhook's own annotations (copied from a
    /// pinned pod): its pods then carry them whether the webhook pinned them or not.
    pub template_pinned: bool,
}

/// Why nothing pinned is released on the word of a workload whose pod template carries the
/// webhook's annotations ([`WorkloadInfo::template_pinned`]).
pub const TEMPLATE_PINNED_HOLDS: &str = "the workload's pod template carries the webhook's annotations (copied from a pinned pod): remove kruise.io/injected-persistent-pod-state and persistent-pod-state.io/injected-required from the template";

impl WorkloadInfo {
    /// Reads the facts from a workload object of any StatefulSet-like kind.
    pub fn from_object(obj: &DynamicObject) -> Self {
        let spec = obj.data.get("spec");
        let (reserved, reserved_truncated) = spec
            .and_then(|s| s.get("reserveOrdinals"))
            .map(reserved_ordinals)
            .unwrap_or_default();
        let int = |v: Option<&Value>| {
            v.and_then(Value::as_i64)
                .and_then(|n| i32::try_from(n).ok())
        };
        Self {
            uid: obj.uid().unwrap_or_default(),
            replicas: int(spec.and_then(|s| s.get("replicas")))
                .unwrap_or(1)
                .max(0),
            ordinal_start: int(spec.and_then(|s| s.pointer("/ordinals/start")))
                .unwrap_or(0)
                .max(0),
            reserved,
            reserved_truncated,
            deleting: obj.metadata.deletion_timestamp.is_some(),
            claim_templates: claim_templates(spec),
            template_pinned: spec
                .and_then(|s| s.pointer("/template/metadata/annotations"))
                .and_then(Value::as_object)
                .is_some_and(|a| {
                    a.contains_key(INJECTED_ANNOTATION)
                        || a.contains_key(INJECTED_REQUIRED_ANNOTATION)
                }),
        }
    }

    /// Whether `ordinal` is one the workload currently wants a pod for.
    pub fn is_live(&self, ordinal: i32) -> bool {
        let (ordinal, start) = (i64::from(ordinal), i64::from(self.ordinal_start));
        if ordinal < start
            || self
                .reserved
                .iter()
                .any(|(lo, hi)| (*lo..=*hi).contains(&ordinal))
        {
            return false;
        }
        // Ordinals from the start, skipping reserved ones, until `replicas` are counted.
        let reserved_below: i64 = self
            .reserved
            .iter()
            .map(|(lo, hi)| ((*hi).min(ordinal - 1).saturating_sub((*lo).max(start)) + 1).max(0))
            .sum();
        ordinal - start - reserved_below < i64::from(self.replicas)
    }
}

/// The names of a workload's `volumeClaimTemplates`, from its spec.
fn claim_templates(spec: Option<&Value>) -> Vec<String> {
    spec.and_then(|s| s.get("volumeClaimTemplates"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| t.pointer("/metadata/name")?.as_str())
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Entries of `reserveOrdinals` read at most; the rest is ignored (and reported).
pub const MAX_RESERVED_ENTRIES: usize = 1_000;

/// Parses `reserveOrdinals`: integers, and strings that are integers or ranges `a-b`, into
/// sorted disjoint ranges (entries that are neither are ignored). At most
/// [`MAX_RESERVED_ENTRIES`] entries are read: whether some were left is returned too.
fn reserved_ordinals(value: &Value) -> (Vec<(i64, i64)>, bool) {
    let items = value.as_array().map(Vec::as_slice).unwrap_or_default();
    let mut ranges: Vec<(i64, i64)> = items
        .iter()
        .take(MAX_RESERVED_ENTRIES)
        .filter_map(|item| match item {
            Value::Number(n) => n.as_i64().map(|n| (n, n)),
            Value::String(s) => match s.split_once('-') {
                Some((a, b)) => match (a.trim().parse::<i64>(), b.trim().parse::<i64>()) {
                    (Ok(a), Ok(b)) if a <= b => Some((a, b)),
                    _ => None,
                },
                None => s.trim().parse::<i64>().ok().map(|n| (n, n)),
            },
            _ => None,
        })
        .collect();
    ranges.sort_unstable();
    let mut merged: Vec<(i64, i64)> = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        match merged.last_mut() {
            Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
            _ => merged.push((lo, hi)),
        }
    }
    (merged, items.len() > MAX_RESERVED_ENTRIES)
}

/// Reads the workload `kind` `name` of `api_version` in `namespace` (its resource found by
/// discovery), with its apiVersion and kind set; `None` when it does not exist (nor its kind),
/// an error when it cannot be read (forbidden, the API server failing).
pub async fn read_workload(
    client: &kube::Client,
    namespace: &str,
    api_version: &str,
    kind: &str,
    name: &str,
) -> Result<Option<DynamicObject>, kube::Error> {
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let resource = match kube::discovery::pinned_kind(client, &gvk).await {
        Ok((resource, _)) => resource,
        Err(kube::Error::Discovery(_)) => return Ok(None),
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(None),
        Err(e) => return Err(e),
    };
    let api = kube::Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &resource);
    let Some(mut obj) = api.get_opt(name).await? else {
        return Ok(None);
    };
    obj.types.get_or_insert_with(|| kube::api::TypeMeta {
        api_version: resource.api_version.clone(),
        kind: resource.kind.clone(),
    });
    Ok(Some(obj))
}

/// The API resource of the native `apps/v1` StatefulSet, for a dynamic watcher.
pub fn native_statefulset_resource() -> ApiResource {
    ApiResource {
        group: APPS_GROUP.into(),
        version: "v1".into(),
        api_version: format!("{APPS_GROUP}/v1"),
        kind: STATEFULSET.into(),
        plural: "statefulsets".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `read_workload` against a mock API server answering, in turn, `answers` (status, body):
    /// what it returns (`Some(true)`: the object, `Some(false)`: none, `None`: an error).
    async fn read_with(answers: Vec<(u16, Value)>) -> Option<bool> {
        let (service, mut handle) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let client = kube::Client::new(service, "default");
        let server = tokio::spawn(async move {
            for (status, body) in answers {
                let Some((_, respond)) = handle.next_request().await else {
                    return;
                };
                respond.send_response(crate::test_api::json_response(status, &body));
            }
        });
        let read = read_workload(&client, "ns", "apps/v1", "StatefulSet", "web").await;
        server.abort();
        read.ok().map(|w| w.is_some())
    }

    #[tokio::test]
    async fn a_workload_that_cannot_be_read_is_an_error_and_one_that_is_gone_is_none() {
        let resources = json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "apps/v1",
            "resources": [{"name": "statefulsets", "singularName": "statefulset", "namespaced": true,
                "kind": "StatefulSet", "verbs": ["get", "list", "watch"]}]});
        let status = |code: u16, reason: &str| json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason});
        let sts = json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "web", "namespace": "ns"}});
        assert_eq!(
            read_with(vec![(200, resources.clone()), (200, sts)]).await,
            Some(true)
        );
        assert_eq!(
            read_with(vec![
                (200, resources.clone()),
                (404, status(404, "NotFound"))
            ])
            .await,
            Some(false),
            "gone"
        );
        assert_eq!(
            read_with(vec![(404, status(404, "NotFound"))]).await,
            Some(false),
            "its kind not served"
        );
        assert_eq!(
            read_with(vec![(200, resources), (403, status(403, "Forbidden"))]).await,
            None,
            "forbidden: an error, not gone"
        );
    }

    fn workload(spec: Value) -> WorkloadInfo {
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "web", "namespace": "ns", "uid": "u1"},
            "spec": spec,
        }))
        .expect("valid object");
        WorkloadInfo::from_object(&obj)
    }

    #[test]
    fn ordinal_is_the_number_after_the_last_dash() {
        let cases = [
            ("web-0", Some(0)),
            ("my-web-12", Some(12)),
            ("web", None),
            ("web-", None),
            ("web-x1", None),
            ("web--1", Some(1)),
            ("web-99999999999", None),
        ];
        for (name, want) in cases {
            assert_eq!(pod_ordinal(name), want, "{name}");
        }
    }

    #[test]
    fn live_ordinals_follow_replicas_start_and_reserved() {
        let cases = [
            (json!({"replicas": 3}), vec![0, 1, 2]),
            (json!({}), vec![0]),
            (json!({"replicas": 0}), vec![]),
            (json!({"replicas": 2, "ordinals": {"start": 5}}), vec![5, 6]),
            (
                json!({"replicas": 3, "reserveOrdinals": [1]}),
                vec![0, 2, 3],
            ),
            (
                json!({"replicas": 3, "reserveOrdinals": ["0-1", 3, "x", "9-2"]}),
                vec![2, 4, 5],
            ),
            (
                json!({"replicas": 2, "ordinals": {"start": 2}, "reserveOrdinals": [2]}),
                vec![3, 4],
            ),
            // Reserved below any ordinal, as far as an i64 goes: counts nothing (and does not
            // overflow in the count).
            (
                json!({"replicas": 2, "ordinals": {"start": 2}, "reserveOrdinals": [i64::MIN, "-3"]}),
                vec![2, 3],
            ),
        ];
        for (spec, want) in cases {
            let w = workload(spec.clone());
            let live: Vec<i32> = (0..10).filter(|o| w.is_live(*o)).collect();
            assert_eq!(live, want, "{spec}");
        }
    }

    #[test]
    fn huge_reserved_ranges_cost_nothing_and_too_many_entries_are_cut() {
        let w = workload(json!({"replicas": 2, "reserveOrdinals": ["0-2000000000", 2000000002]}));
        let live: Vec<i32> = [0, 5, 2_000_000_001, 2_000_000_002, 2_000_000_003]
            .into_iter()
            .filter(|o| w.is_live(*o))
            .collect();
        assert_eq!(live, vec![2_000_000_001, 2_000_000_003]);
        assert!(!w.reserved_truncated);
        let many: Vec<i64> = (0..5000).map(|i| i * 2).collect();
        let w = workload(json!({"replicas": 1, "reserveOrdinals": many}));
        assert!(w.reserved_truncated);
        assert_eq!(w.reserved.len(), MAX_RESERVED_ENTRIES);
    }

    #[test]
    fn upstream_bug_6_ordinals_start_is_honoured_for_native_statefulsets() {
        let w = workload(json!({"replicas": 3, "ordinals": {"start": 10}}));
        let live: Vec<i32> = (0..20).filter(|o| w.is_live(*o)).collect();
        assert_eq!(live, vec![10, 11, 12]);
    }

    #[test]
    fn reads_uid_and_deletion() {
        let w = workload(json!({"replicas": 2}));
        assert_eq!(w.uid, "u1");
        assert!(!w.deleting);
    }

    #[test]
    fn handles_statefulsets_of_apps_and_kruise_only() {
        assert!(GroupKind::new("apps", "StatefulSet").is_statefulset());
        assert!(GroupKind::new("apps.kruise.io", "StatefulSet").is_statefulset());
        assert!(!GroupKind::new("apps", "ReplicaSet").is_statefulset());
        assert!(!GroupKind::new("example.com", "StatefulSet").is_statefulset());
    }
}
