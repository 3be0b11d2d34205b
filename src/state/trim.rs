//! What the caches keep of each object: only the fields the code reads, so memory follows the
//! number of objects, not their size. Pods are kept as [`CachedPod`] and nodes watched as
//! [`Read`] nodes, both decoded with only those fields: the rest of each object (containers,
//! volumes, images, managed fields) is skipped while decoding, never built, so a page of a
//! list costs its bytes, not the full objects.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::api::{INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION, PersistentPodState};
use crate::shared::{Shared, intern};

use k8s_openapi::api::core::v1::{
    Node, NodeCondition, NodeSpec, NodeStatus, Pod, PodCondition, PodIP, PodSpec, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::Resource;
use kube::api::DynamicObject;
use kube::runtime::watcher;
use serde::{Deserialize, Deserializer};

/// An object of kind `K` decoded with only the fields the caches keep (see [`pod`], [`node`]);
/// watched in place of `K`.
#[derive(Clone, Debug)]
pub struct Read<K>(pub K);

impl<K: k8s_openapi::Resource> k8s_openapi::Resource for Read<K> {
    const API_VERSION: &'static str = K::API_VERSION;
    const GROUP: &'static str = K::GROUP;
    const KIND: &'static str = K::KIND;
    const VERSION: &'static str = K::VERSION;
    const URL_PATH_SEGMENT: &'static str = K::URL_PATH_SEGMENT;
    type Scope = K::Scope;
}

impl<K: k8s_openapi::Metadata<Ty = ObjectMeta>> k8s_openapi::Metadata for Read<K> {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        self.0.metadata()
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        self.0.metadata_mut()
    }
}

/// The same event, of each object mapped by `f`.
pub fn map_event<A, B>(event: watcher::Event<A>, f: impl Fn(A) -> B) -> watcher::Event<B> {
    match event {
        watcher::Event::Apply(o) => watcher::Event::Apply(f(o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(f(o)),
        watcher::Event::InitApply(o) => watcher::Event::InitApply(f(o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// The metadata kept: what names, versions and owns an object, and its annotations and labels
/// where read.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReadMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    creation_timestamp: Option<Time>,
    deletion_timestamp: Option<Time>,
    annotations: Option<BTreeMap<String, String>>,
    labels: Option<BTreeMap<String, String>>,
    owner_references: Option<Vec<OwnerReference>>,
}

impl From<ReadMeta> for ObjectMeta {
    fn from(m: ReadMeta) -> Self {
        ObjectMeta {
            name: m.name,
            namespace: m.namespace,
            uid: m.uid,
            resource_version: m.resource_version,
            creation_timestamp: m.creation_timestamp,
            deletion_timestamp: m.deletion_timestamp,
            annotations: m.annotations,
            labels: m.labels,
            owner_references: m.owner_references,
            ..ObjectMeta::default()
        }
    }
}

/// A pod as the caches keep it: what recording, the IP index and the triggers read (its name,
/// namespace, uid, resourceVersion, controller, the annotations read (`kept.rs`) and
/// deletion mark; its node,
/// whether it finished, readiness and IPs), in boxes, with the strings many pods share
/// (namespace, node, controller) interned: a few hundred bytes a pod.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CachedPod {
    /// Its name.
    pub name: Box<str>,
    /// Its namespace.
    pub namespace: Shared,
    /// Its uid.
    pub uid: Option<Box<str>>,
    /// Its resourceVersion.
    pub resource_version: Option<Box<str>>,
    /// Whether it is being deleted (`deletionTimestamp` set).
    pub deleting: bool,
    /// Its annotations, once cached only those read (`kept.rs`).
    pub annotations: Annotations,
    /// Its controlling owner reference.
    pub controller: Option<Box<Owner>>,
    /// The node it is bound to.
    pub node_name: Option<Shared>,
    /// Whether it has finished (phase Succeeded or Failed): it holds no IP any more.
    pub finished: bool,
    /// Whether its Ready condition is True.
    pub ready: bool,
    /// Its IPs, every family (`status.podIPs`, else `status.podIP`).
    pub ips: Box<[Box<str>]>,
}

/// A pod's controlling owner reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Owner {
    /// Its apiVersion.
    pub api_version: Shared,
    /// Its kind.
    pub kind: Shared,
    /// Its name.
    pub name: Shared,
    /// Its uid.
    pub uid: Box<str>,
}

/// Annotations as a slice of pairs sorted by key: no tree nodes per pod.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Annotations(Box<[(Box<str>, Box<str>)]>);

impl Annotations {
    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        let i = self.0.binary_search_by(|(k, _)| (**k).cmp(key)).ok()?;
        Some(&self.0[i].1)
    }
}

impl Annotations {
    /// Only the annotations whose key `keep` accepts; `None` when that is all of them.
    pub fn only(&self, keep: impl Fn(&str) -> bool) -> Option<Annotations> {
        if self.0.iter().all(|(k, _)| keep(k)) {
            return None;
        }
        Some(Annotations(
            self.0.iter().filter(|(k, _)| keep(k)).cloned().collect(),
        ))
    }
}

impl From<BTreeMap<String, String>> for Annotations {
    fn from(map: BTreeMap<String, String>) -> Self {
        Annotations(map.into_iter().map(|(k, v)| (k.into(), v.into())).collect())
    }
}

impl CachedPod {
    /// Its uid, owned.
    pub fn uid(&self) -> Option<String> {
        self.uid.as_deref().map(str::to_owned)
    }

    /// Its resourceVersion, owned.
    pub fn resource_version(&self) -> Option<String> {
        self.resource_version.as_deref().map(str::to_owned)
    }

    /// The pod keeping only the annotations whose key `keep` accepts; the same `Arc` when it
    /// has no other.
    pub fn keeping_annotations(self: Arc<Self>, keep: impl Fn(&str) -> bool) -> Arc<Self> {
        match self.annotations.only(keep) {
            None => self,
            Some(annotations) => Arc::new(CachedPod {
                annotations,
                ..Arc::unwrap_or_clone(self)
            }),
        }
    }

    /// The StatefulSet-like workload that controls it, if any.
    pub fn workload(&self) -> Option<crate::workload::WorkloadRef> {
        let owner = self.controller.as_deref()?;
        Some(crate::workload::owner_workload(
            &self.namespace,
            &owner.api_version,
            &owner.kind,
            &owner.name,
        ))
    }
}

impl From<Pod> for CachedPod {
    fn from(pod: Pod) -> Self {
        let ready = crate::workload::is_ready(&pod);
        let ips = crate::workload::pod_ips(&pod)
            .into_iter()
            .map(String::into_boxed_str)
            .collect();
        let finished = matches!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        );
        let m = pod.metadata;
        let controller = m
            .owner_references
            .as_deref()
            .and_then(crate::workload::controller_owner)
            .map(|o| {
                Box::new(Owner {
                    api_version: intern(&o.api_version),
                    kind: intern(&o.kind),
                    name: intern(&o.name),
                    uid: o.uid.as_str().into(),
                })
            });
        CachedPod {
            name: m.name.unwrap_or_default().into(),
            namespace: intern(m.namespace.as_deref().unwrap_or_default()),
            uid: m.uid.map(String::into_boxed_str),
            resource_version: m.resource_version.map(String::into_boxed_str),
            deleting: m.deletion_timestamp.is_some(),
            annotations: m.annotations.unwrap_or_default().into(),
            controller,
            node_name: pod.spec.and_then(|s| s.node_name).map(|n| intern(&n)),
            finished,
            ready,
            ips,
        }
    }
}

/// A pod as a watch delivers it: what is kept, plus the metadata the watch itself reads (its
/// name, namespace and resourceVersion), dropped once the event is applied.
#[derive(Clone, Debug)]
pub struct WatchedPod {
    metadata: ObjectMeta,
    /// What is kept.
    pub pod: CachedPod,
}

impl k8s_openapi::Resource for WatchedPod {
    const API_VERSION: &'static str = Pod::API_VERSION;
    const GROUP: &'static str = Pod::GROUP;
    const KIND: &'static str = Pod::KIND;
    const VERSION: &'static str = Pod::VERSION;
    const URL_PATH_SEGMENT: &'static str = Pod::URL_PATH_SEGMENT;
    type Scope = <Pod as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::Metadata for WatchedPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl From<Pod> for WatchedPod {
    fn from(pod: Pod) -> Self {
        let metadata = ObjectMeta {
            name: pod.metadata.name.clone(),
            namespace: pod.metadata.namespace.clone(),
            resource_version: pod.metadata.resource_version.clone(),
            ..ObjectMeta::default()
        };
        WatchedPod {
            metadata,
            pod: CachedPod::from(pod),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReadPodSpec {
    node_name: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReadPodStatus {
    phase: Option<String>,
    conditions: Option<Vec<PodCondition>>,
    #[serde(rename = "podIP")]
    pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pod_ips: Option<Vec<PodIP>>,
}

#[derive(Deserialize)]
struct ReadPod {
    metadata: Option<ReadMeta>,
    spec: Option<ReadPodSpec>,
    status: Option<ReadPodStatus>,
}

/// Decodes a listed or watched pod straight into what is kept.
impl<'de> Deserialize<'de> for WatchedPod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let read = ReadPod::deserialize(d)?;
        // Through the same conversion as a whole Pod, so both keep exactly the same.
        Ok(WatchedPod::from(Pod {
            metadata: read.metadata.map(ObjectMeta::from).unwrap_or_default(),
            spec: read.spec.map(|s| PodSpec {
                node_name: s.node_name,
                ..PodSpec::default()
            }),
            status: read.status.map(|s| PodStatus {
                phase: s.phase,
                conditions: s.conditions,
                pod_ip: s.pod_ip,
                pod_ips: s.pod_ips,
                ..PodStatus::default()
            }),
        }))
    }
}

/// Decodes a pod straight into what is kept (as [`WatchedPod`] does).
impl<'de> Deserialize<'de> for CachedPod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        WatchedPod::deserialize(d).map(|w| w.pod)
    }
}

#[derive(Deserialize)]
struct ReadNodeStatus {
    conditions: Option<Vec<NodeCondition>>,
}

#[derive(Deserialize)]
struct ReadNode {
    metadata: Option<ReadMeta>,
    spec: Option<NodeSpec>,
    status: Option<ReadNodeStatus>,
}

impl<'de> Deserialize<'de> for Read<Node> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let read = ReadNode::deserialize(d)?;
        let mut node = Node {
            metadata: read.metadata.map(ObjectMeta::from).unwrap_or_default(),
            spec: read.spec,
            status: read.status.map(|s| NodeStatus {
                conditions: s.conditions,
                ..NodeStatus::default()
            }),
        };
        self::node(&mut node);
        Ok(Read(node))
    }
}

/// Drops `managedFields` (often the largest part of an object, never read).
pub fn meta<K: Resource>(obj: &mut K) {
    obj.meta_mut().managed_fields = None;
}

/// Keeps of a node its name, labels, spec (taints, unschedulable) and the status and transition
/// time of its `Ready` condition: what placement reads.
pub fn node(node: &mut Node) {
    meta(node);
    node.metadata.annotations = None;
    node.status = node.status.take().map(|s| NodeStatus {
        conditions: s.conditions.map(|cs| {
            cs.into_iter()
                .filter(|c| c.type_ == "Ready")
                .map(|c| NodeCondition {
                    type_: c.type_,
                    status: c.status,
                    last_transition_time: c.last_transition_time,
                    ..NodeCondition::default()
                })
                .collect()
        }),
        ..NodeStatus::default()
    });
}

/// Keeps of a workload its metadata, the spec fields that decide its live ordinals, and the
/// names of its claim templates.
pub fn workload(obj: &mut DynamicObject) {
    meta(obj);
    let spec = obj.data.get("spec").map(|spec| {
        let mut kept = serde_json::Map::new();
        for field in ["replicas", "ordinals", "reserveOrdinals"] {
            if let Some(v) = spec.get(field) {
                kept.insert(field.to_owned(), v.clone());
            }
        }
        // Of the claim templates, their names only.
        if let Some(templates) = spec.get("volumeClaimTemplates").and_then(|t| t.as_array()) {
            let names: Vec<serde_json::Value> = templates
                .iter()
                .map(|t| serde_json::json!({"metadata": {"name": t.pointer("/metadata/name")}}))
                .collect();
            kept.insert("volumeClaimTemplates".to_owned(), names.into());
        }
        // Of the pod template, whether it carries the webhook's own annotations (a template
        // copied from a pinned pod: its pods carry them whether the webhook pinned them or not).
        let ours: serde_json::Map<String, serde_json::Value> = spec
            .pointer("/template/metadata/annotations")
            .and_then(|a| a.as_object())
            .into_iter()
            .flatten()
            .filter(|(k, _)| {
                [INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION].contains(&k.as_str())
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if !ours.is_empty() {
            kept.insert(
                "template".to_owned(),
                serde_json::json!({"metadata": {"annotations": ours}}),
            );
        }
        serde_json::Value::Object(kept)
    });
    obj.data = serde_json::json!({ "spec": spec });
}

/// A PersistentPodState as its watch reads it: decoded from the JSON tree of the list's item or
/// the event's object, once (about 40 % less CPU than reading it as a `DynamicObject` and
/// decoding that again, bench/NOTEBOOK.md part 5). One that does not decode (stored by an older schema, say) keeps its metadata
/// and why, so that it is skipped rather than failing every list of the kind.
#[derive(Clone, Debug)]
pub enum ReadPps {
    /// Decoded.
    Readable(PersistentPodState),
    /// Not a readable PersistentPodState: its metadata, and why (without the object's values).
    Unreadable(ObjectMeta, String),
}

impl<'de> Deserialize<'de> for ReadPps {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let object = serde_json::Value::deserialize(d)?;
        match PersistentPodState::deserialize(&object) {
            Ok(pps) => Ok(Self::Readable(pps)),
            // An object whose metadata does not read cannot be told apart: an error.
            Err(error) => match object.get("metadata").map(ObjectMeta::deserialize) {
                Some(Ok(metadata)) => Ok(Self::Unreadable(
                    metadata,
                    crate::api::json_error_summary(&error),
                )),
                Some(Err(e)) => Err(serde::de::Error::custom(crate::api::json_error_summary(&e))),
                None => Err(serde::de::Error::missing_field("metadata")),
            },
        }
    }
}

impl Resource for ReadPps {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(dt: &()) -> Cow<'_, str> {
        PersistentPodState::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        PersistentPodState::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        PersistentPodState::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        PersistentPodState::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        match self {
            Self::Readable(pps) => &pps.metadata,
            Self::Unreadable(metadata, _) => metadata,
        }
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Self::Readable(pps) => &mut pps.metadata,
            Self::Unreadable(metadata, _) => metadata,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;
    use serde_json::json;

    #[test]
    fn keeps_what_recording_needs() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "a-0", "managedFields": [{"manager": "x"}], "labels": {"app": "a"},
                         "annotations": {"k": "v"}, "uid": "u", "finalizers": ["f"]},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True", "message": "m"},
                                      {"type": "PodScheduled", "status": "True"}],
                       "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 0}]}
        }))
        .expect("pod");
        let p = CachedPod::from(p);
        assert_eq!(&*p.name, "a-0");
        assert_eq!(p.uid.as_deref(), Some("u"));
        assert_eq!(p.annotations.get("k"), Some("v"));
        assert_eq!(p.annotations.get("app"), None, "labels are not kept");
        assert_eq!(p.node_name.as_deref(), Some("n1"));
        assert!(p.ready && !p.finished && !p.deleting);
        assert_eq!(&*p.ips, [Box::from("10.0.0.1")]);
        assert!(p.controller.is_none());

        let mut w: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "a"},
            "spec": {"replicas": 3, "ordinals": {"start": 1}, "template": {"spec": {}}}
        }))
        .expect("workload");
        workload(&mut w);
        assert_eq!(
            w.data,
            json!({"spec": {"replicas": 3, "ordinals": {"start": 1}}})
        );
    }

    #[test]
    fn reading_only_the_kept_fields_equals_trimming_the_whole_object() {
        let pods = [
            json!({"metadata": {"name": "a-0", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                    "deletionTimestamp": "2026-01-01T00:00:00Z", "labels": {"a": "b"},
                    "annotations": {"k": "v"}, "finalizers": ["f"],
                    "managedFields": [{"manager": "m", "fieldsV1": {"f:spec": {}}}],
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "a", "uid": "s", "controller": true}]},
                   "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
                   "status": {"phase": "Running", "podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}],
                              "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                                             {"type": "Initialized", "status": "True"}],
                              "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 0}]}}),
            json!({"metadata": {"name": "b-0"}}),
        ];
        for object in pods {
            let whole: Pod = serde_json::from_value(object.clone()).expect("pod");
            let read: CachedPod = serde_json::from_value(object.clone()).expect("read pod");
            assert_eq!(read, CachedPod::from(whole), "{object}");
        }
        let watched: WatchedPod = serde_json::from_value(json!({"metadata": {"name": "a-0",
            "namespace": "ns", "resourceVersion": "7", "uid": "u", "annotations": {"k": "v"}},
            "spec": {"nodeName": "n1"}}))
        .expect("watched pod");
        assert_eq!(
            watched.resource_version().as_deref(),
            Some("7"),
            "the watch resumes from it"
        );
        assert_eq!(watched.metadata.annotations, None, "kept once, in the pod");
        let other: CachedPod = serde_json::from_value(json!({"metadata": {"name": "a-1",
            "namespace": "ns"}, "spec": {"nodeName": "n1"}}))
        .expect("pod");
        assert!(
            std::ptr::eq(watched.pod.namespace.as_str(), other.namespace.as_str()),
            "interned"
        );
        let (a, b) = (
            watched.pod.node_name.expect("node"),
            other.node_name.expect("node"),
        );
        assert!(std::ptr::eq(a.as_str(), b.as_str()), "interned");
        let node_object = json!({"metadata": {"name": "n1", "resourceVersion": "3",
                "labels": {"topology.kubernetes.io/zone": "z1"}, "annotations": {"a": "b"},
                "managedFields": [{"manager": "m"}]},
            "spec": {"unschedulable": true, "taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T00:00:00Z", "reason": "r"},
                                      {"type": "DiskPressure", "status": "False"}],
                       "images": [{"names": ["big/image:1"], "sizeBytes": 1}],
                       "addresses": [{"type": "InternalIP", "address": "10.1.1.1"}]}});
        let mut whole: Node = serde_json::from_value(node_object.clone()).expect("node");
        node(&mut whole);
        let read: Read<Node> = serde_json::from_value(node_object).expect("read node");
        assert_eq!(read.0, whole);
        assert!(read.0.status.as_ref().is_some_and(|s| s.images.is_none()));
    }
}
