//! The shared caches: one watch per resource kind feeds a reflector store, the indexes the hot
//! paths need, and the controllers' triggers. The webhook and the controllers read the same
//! stores; nothing here is rebuilt per request.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use futures::TryStreamExt;
use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use k8s_openapi::api::core::v1::{Node, NodeStatus, Pod, PodSpec, PodStatus};
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::watch;

use crate::api::PersistentPodState;
use crate::workload::{GroupKind, WorkloadRef, native_statefulset_resource, pod_workload};

/// A secondary index of a store: objects grouped by the workload they belong to (a
/// PersistentPodState by its target, a Pod by its controller). Kept current from the watch
/// events, so a lookup is one hash probe.
pub struct Index<K> {
    key_of_object: fn(&K) -> Option<WorkloadRef>,
    state: RwLock<IndexState>,
}

#[derive(Default)]
struct IndexState {
    /// Object names by workload (objects share the workload's namespace).
    by_workload: HashMap<WorkloadRef, BTreeSet<String>>,
    /// The workload of each object, keyed by (namespace, name), to move or drop it on change.
    workload_of: HashMap<(String, String), WorkloadRef>,
    /// The index being rebuilt during a relist.
    relist: Option<Box<IndexState>>,
}

impl IndexState {
    fn insert(&mut self, id: (String, String), key: Option<WorkloadRef>) {
        self.remove(&id);
        if let Some(key) = key {
            self.by_workload
                .entry(key.clone())
                .or_default()
                .insert(id.1.clone());
            self.workload_of.insert(id, key);
        }
    }

    fn remove(&mut self, id: &(String, String)) {
        if let Some(old) = self.workload_of.remove(id)
            && let Some(names) = self.by_workload.get_mut(&old)
        {
            names.remove(&id.1);
            if names.is_empty() {
                self.by_workload.remove(&old);
            }
        }
    }
}

fn lock_read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

fn lock_write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

impl<K: Resource> Index<K> {
    /// An empty index grouping objects by `key_of_object`.
    pub fn new(key_of_object: fn(&K) -> Option<WorkloadRef>) -> Self {
        Self {
            key_of_object,
            state: RwLock::default(),
        }
    }

    fn id(obj: &K) -> (String, String) {
        (obj.namespace().unwrap_or_default(), obj.name_any())
    }

    /// Applies one watch event.
    pub fn apply(&self, event: &watcher::Event<K>) {
        let mut state = lock_write(&self.state);
        match event {
            watcher::Event::Apply(obj) => state.insert(Self::id(obj), (self.key_of_object)(obj)),
            watcher::Event::Delete(obj) => state.remove(&Self::id(obj)),
            watcher::Event::Init => state.relist = Some(Box::default()),
            watcher::Event::InitApply(obj) => {
                let key = (self.key_of_object)(obj);
                state
                    .relist
                    .get_or_insert_with(Box::default)
                    .insert(Self::id(obj), key);
            }
            watcher::Event::InitDone => {
                let fresh = state.relist.take().unwrap_or_default();
                *state = *fresh;
            }
        }
    }

    /// Names of the objects that belong to `workload`, sorted.
    pub fn get(&self, workload: &WorkloadRef) -> Vec<String> {
        lock_read(&self.state)
            .by_workload
            .get(workload)
            .map(|names| names.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// Nodes by label (`key=value`), kept current from the node watch: answers "does any node have
/// all these labels" without scanning every node.
#[derive(Default)]
pub struct NodeLabelIndex {
    state: RwLock<NodeLabelState>,
}

#[derive(Default)]
struct NodeLabelState {
    by_label: HashMap<(String, String), BTreeSet<String>>,
    labels_of: HashMap<String, BTreeMap<String, String>>,
    relist: Option<Box<NodeLabelState>>,
}

impl NodeLabelState {
    /// Records `node`'s labels; returns whether they differ from before.
    fn set(&mut self, node: &str, labels: &BTreeMap<String, String>) -> bool {
        if self.labels_of.get(node) == Some(labels) {
            return false;
        }
        self.remove(node);
        for (k, v) in labels {
            self.by_label
                .entry((k.clone(), v.clone()))
                .or_default()
                .insert(node.to_owned());
        }
        self.labels_of.insert(node.to_owned(), labels.clone());
        true
    }

    fn remove(&mut self, node: &str) {
        for (k, v) in self.labels_of.remove(node).unwrap_or_default() {
            let key = (k, v);
            if let Some(nodes) = self.by_label.get_mut(&key) {
                nodes.remove(node);
                if nodes.is_empty() {
                    self.by_label.remove(&key);
                }
            }
        }
    }
}

impl NodeLabelIndex {
    /// Applies one node watch event; returns whether a node's labels changed (or it went).
    pub fn apply(&self, event: &watcher::Event<Node>) -> bool {
        let mut state = lock_write(&self.state);
        match event {
            watcher::Event::Apply(n) => state.set(&n.name_any(), n.labels()),
            watcher::Event::Delete(n) => {
                state.remove(&n.name_any());
                true
            }
            watcher::Event::Init => {
                state.relist = Some(Box::default());
                false
            }
            watcher::Event::InitApply(n) => {
                state
                    .relist
                    .get_or_insert_with(Box::default)
                    .set(&n.name_any(), n.labels());
                false
            }
            watcher::Event::InitDone => {
                let fresh = state.relist.take().unwrap_or_default();
                *state = *fresh;
                true
            }
        }
    }

    /// Whether some node carries every `key=value` of `labels` (true for no labels).
    pub fn any_node_with(&self, labels: &BTreeMap<String, String>) -> bool {
        let state = lock_read(&self.state);
        let mut candidates: Vec<&BTreeSet<String>> = Vec::with_capacity(labels.len());
        for (k, v) in labels {
            match state.by_label.get(&(k.clone(), v.clone())) {
                Some(nodes) => candidates.push(nodes),
                None => return false,
            }
        }
        candidates.sort_by_key(|c| c.len());
        let Some((smallest, rest)) = candidates.split_first() else {
            return true;
        };
        smallest.iter().any(|n| rest.iter().all(|c| c.contains(n)))
    }
}

/// The workload a PersistentPodState targets.
pub fn pps_target(pps: &PersistentPodState) -> Option<WorkloadRef> {
    let target = &pps.spec.target_ref;
    Some(WorkloadRef {
        namespace: pps.namespace()?,
        kind: GroupKind::new(target.group(), &target.kind),
        name: target.name.clone(),
    })
}

fn pod_owner(pod: &Pod) -> Option<WorkloadRef> {
    pod_workload(pod, &pod.namespace()?)
}

/// Where watch events send reconcile requests while a controller runs (only on the leader).
#[derive(Default)]
pub struct Triggers {
    pps: Mutex<Option<UnboundedSender<ObjectRef<PersistentPodState>>>>,
    workloads: Mutex<HashMap<GroupKind, UnboundedSender<ObjectRef<DynamicObject>>>>,
}

impl Triggers {
    /// Starts delivering PersistentPodState reconcile requests to the returned stream.
    pub fn subscribe_pps(&self) -> UnboundedReceiver<ObjectRef<PersistentPodState>> {
        let (tx, rx) = unbounded();
        *self.pps.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
        rx
    }

    /// Starts delivering reconcile requests for workloads of `kind` to the returned stream.
    pub fn subscribe_workloads(
        &self,
        kind: &GroupKind,
    ) -> UnboundedReceiver<ObjectRef<DynamicObject>> {
        let (tx, rx) = unbounded();
        self.workloads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(kind.clone(), tx);
        rx
    }

    fn pps(&self, refs: impl IntoIterator<Item = ObjectRef<PersistentPodState>>) {
        if let Some(tx) = self
            .pps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            for r in refs {
                // A closed channel means the controller stopped; nothing is waiting for it.
                let _ = tx.unbounded_send(r);
            }
        }
    }

    fn workload(&self, kind: &GroupKind, r: ObjectRef<DynamicObject>) {
        if let Some(tx) = self
            .workloads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(kind)
        {
            let _ = tx.unbounded_send(r);
        }
    }
}

/// A workload kind's cache.
#[derive(Clone)]
pub struct WorkloadStore {
    /// The resource watched.
    pub resource: ApiResource,
    /// Its objects (spec reduced to what recording needs).
    pub store: Store<DynamicObject>,
    /// Whether the first full list has arrived (until then, absence proves nothing).
    synced: Arc<AtomicBool>,
    /// The watch feeding the store.
    task: Arc<tokio::task::AbortHandle>,
}

impl WorkloadStore {
    /// Whether both are the same watch (a kind removed and added again is another watch).
    pub fn same_watch(&self, other: &WorkloadStore) -> bool {
        Arc::ptr_eq(&self.task, &other.task)
    }
}

/// What is known about a workload.
pub enum WorkloadLookup {
    /// The kind is watched and the object is in the cache.
    Found(Arc<DynamicObject>),
    /// The kind is watched and the object does not exist.
    Absent,
    /// The kind is not watched: whether it exists is unknown.
    Unknown,
}

/// All caches of the process, shared by the webhook and the controllers.
pub struct Caches {
    client: Client,
    /// PersistentPodState objects.
    pub pps: Store<PersistentPodState>,
    /// PersistentPodStates by target workload.
    pub pps_by_target: Index<PersistentPodState>,
    /// Pods (spec and status reduced to what recording needs).
    pub pods: Store<Pod>,
    /// Pods by controlling workload.
    pub pods_by_workload: Index<Pod>,
    /// Nodes (labels and spec).
    pub nodes: Store<Node>,
    /// Nodes by label.
    pub node_labels: NodeLabelIndex,
    /// Workload stores by kind.
    workloads: RwLock<HashMap<GroupKind, WorkloadStore>>,
    kinds_changed: watch::Sender<u64>,
    /// Reconcile requests to the controllers.
    pub triggers: Triggers,
    synced: AtomicBool,
}

impl Caches {
    /// Starts the watches of PersistentPodStates, Pods, Nodes and native StatefulSets, and
    /// returns the caches; more workload kinds can be added with [`Caches::add_workload_kind`].
    pub fn start(client: &Client) -> Arc<Self> {
        let (pps, pps_writer) = reflector::store();
        let (pods, pods_writer) = reflector::store();
        let (nodes, nodes_writer) = reflector::store();
        let (kinds_changed, _) = watch::channel(0);
        let caches = Arc::new(Self {
            client: client.clone(),
            pps,
            pps_by_target: Index::new(pps_target),
            pods,
            pods_by_workload: Index::new(pod_owner),
            nodes,
            node_labels: NodeLabelIndex::default(),
            workloads: RwLock::default(),
            kinds_changed,
            triggers: Triggers::default(),
            synced: AtomicBool::new(false),
        });
        let c = caches.clone();
        tokio::spawn(reflect(
            "PersistentPodState".into(),
            Api::<PersistentPodState>::all(client.clone()),
            pps_writer,
            strip_meta,
            move |ev| c.on_pps_event(ev),
        ));
        let c = caches.clone();
        tokio::spawn(reflect(
            "Pod".into(),
            Api::<Pod>::all(client.clone()),
            pods_writer,
            strip_pod,
            move |ev| c.on_pod_event(ev),
        ));
        let c = caches.clone();
        tokio::spawn(reflect(
            "Node".into(),
            Api::<Node>::all(client.clone()),
            nodes_writer,
            strip_node,
            move |ev| c.on_node_event(ev),
        ));
        caches.add_workload_kind(native_statefulset_resource());
        caches
    }

    /// Starts watching a workload kind (replacing the watch of another version of it).
    /// Returns false if exactly this resource is watched already.
    pub fn add_workload_kind(self: &Arc<Self>, ar: ApiResource) -> bool {
        let kind = GroupKind::new(&ar.group, &ar.kind);
        let mut workloads = lock_write(&self.workloads);
        if workloads.get(&kind).is_some_and(|w| w.resource == ar) {
            return false;
        }
        let writer = reflector::store::Writer::new(ar.clone());
        let store = writer.as_reader();
        let synced = Arc::new(AtomicBool::new(false));
        let (c, k, flag) = (self.clone(), kind.clone(), synced.clone());
        let task = tokio::spawn(reflect(
            ar.kind.clone(),
            Api::<DynamicObject>::all_with(self.client.clone(), &ar),
            writer,
            strip_workload,
            move |ev| {
                if matches!(ev, watcher::Event::InitDone) {
                    flag.store(true, Ordering::Release);
                }
                c.on_workload_event(&k, ev);
            },
        ));
        tracing::info!(group = %ar.group, version = %ar.version, kind = %ar.kind, "watching workload kind");
        let entry = WorkloadStore {
            resource: ar,
            store,
            synced,
            task: Arc::new(task.abort_handle()),
        };
        if let Some(old) = workloads.insert(kind, entry) {
            old.task.abort();
        }
        drop(workloads);
        self.kinds_changed.send_modify(|n| *n += 1);
        true
    }

    /// Stops watching a workload kind (its CRD is gone); its workloads become unknown.
    pub fn remove_workload_kind(&self, kind: &GroupKind) {
        if let Some(old) = lock_write(&self.workloads).remove(kind) {
            old.task.abort();
            tracing::info!(group = %kind.group, kind = %kind.kind, "no longer watching workload kind");
            self.kinds_changed.send_modify(|n| *n += 1);
        }
    }

    /// The watched workload kinds.
    pub fn workload_kinds(&self) -> Vec<(GroupKind, WorkloadStore)> {
        lock_read(&self.workloads)
            .iter()
            .map(|(k, w)| (k.clone(), w.clone()))
            .collect()
    }

    /// Notified whenever a workload kind is added or removed.
    pub fn subscribe_workload_kinds(&self) -> watch::Receiver<u64> {
        self.kinds_changed.subscribe()
    }

    /// Waits until the PersistentPodState, Pod, Node and native StatefulSet stores have their
    /// first full list, then marks the caches synced. (Kinds added later are consulted only once
    /// their own list has arrived.)
    pub async fn wait_synced(&self) {
        let workload_stores: Vec<Store<DynamicObject>> = lock_read(&self.workloads)
            .values()
            .map(|w| w.store.clone())
            .collect();
        // A dropped writer means its task ended; the process is shutting down then.
        let _ = self.pps.wait_until_ready().await;
        let _ = self.pods.wait_until_ready().await;
        let _ = self.nodes.wait_until_ready().await;
        for store in workload_stores {
            let _ = store.wait_until_ready().await;
        }
        self.synced.store(true, Ordering::Release);
    }

    /// Whether every cache has synced.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// The PersistentPodState that targets `workload` (the first by name if several do).
    pub fn pps_for(&self, workload: &WorkloadRef) -> Option<Arc<PersistentPodState>> {
        self.pps_by_target
            .get(workload)
            .into_iter()
            .find_map(|name| {
                self.pps
                    .get(&ObjectRef::new(&name).within(&workload.namespace))
            })
    }

    /// The cached pods whose controller is `workload`.
    pub fn pods_of(&self, workload: &WorkloadRef) -> Vec<Arc<Pod>> {
        self.pods_by_workload
            .get(workload)
            .into_iter()
            .filter_map(|name| {
                self.pods
                    .get(&ObjectRef::new(&name).within(&workload.namespace))
            })
            .collect()
    }

    /// Whether a pod of that name exists in `namespace`.
    pub fn pod_exists(&self, namespace: &str, name: &str) -> bool {
        self.pods
            .get(&ObjectRef::new(name).within(namespace))
            .is_some()
    }

    /// The cached node named `name`.
    pub fn node(&self, name: &str) -> Option<Arc<Node>> {
        self.nodes.get(&ObjectRef::new(name))
    }

    /// The store and resource of a workload kind, if it is watched.
    pub fn workload_store(&self, kind: &GroupKind) -> Option<WorkloadStore> {
        lock_read(&self.workloads).get(kind).cloned()
    }

    /// Looks a workload up in its kind's cache.
    pub fn workload(&self, workload: &WorkloadRef) -> WorkloadLookup {
        let Some(ws) = self
            .workload_store(&workload.kind)
            .filter(|ws| ws.synced.load(Ordering::Acquire))
        else {
            return WorkloadLookup::Unknown;
        };
        let key =
            ObjectRef::new_with(&workload.name, ws.resource.clone()).within(&workload.namespace);
        match ws.store.get(&key) {
            Some(obj) => WorkloadLookup::Found(obj),
            None => WorkloadLookup::Absent,
        }
    }

    /// Asks the running controllers to reconcile every PersistentPodState and workload.
    pub fn resync(&self) {
        self.triggers.pps(self.all_pps());
        for (kind, _) in self.workload_kinds() {
            self.resync_kind(&kind);
        }
    }

    /// Asks the generator of `kind` to reconcile every workload of that kind.
    pub fn resync_kind(&self, kind: &GroupKind) {
        if let Some(ws) = self.workload_store(kind) {
            for obj in ws.store.state() {
                let r = ObjectRef::from_obj_with(obj.as_ref(), ws.resource.clone());
                self.triggers.workload(kind, r);
            }
        }
    }

    /// Every cached PersistentPodState, as reconcile requests.
    pub fn all_pps(&self) -> Vec<ObjectRef<PersistentPodState>> {
        self.pps
            .state()
            .iter()
            .map(|p| ObjectRef::from_obj(p.as_ref()))
            .collect()
    }

    fn pps_targeting(&self, workload: Option<WorkloadRef>) -> Vec<ObjectRef<PersistentPodState>> {
        workload.map_or_else(Vec::new, |w| {
            self.pps_by_target
                .get(&w)
                .into_iter()
                .map(|name| ObjectRef::new(&name).within(&w.namespace))
                .collect()
        })
    }

    fn on_pps_event(&self, ev: &watcher::Event<PersistentPodState>) {
        self.pps_by_target.apply(ev);
        match ev {
            watcher::Event::Apply(p) => self.triggers.pps([ObjectRef::from_obj(p)]),
            // A workload may have waited for its generated PPS to go away.
            watcher::Event::Delete(p) => {
                if let Some(target) = pps_target(p) {
                    self.trigger_workload(&target);
                }
            }
            // A relist reaches the store only at its end: reconcile everything then (a
            // request for an object not yet in the store would be dropped).
            watcher::Event::InitDone => self.triggers.pps(self.all_pps()),
            watcher::Event::Init | watcher::Event::InitApply(_) => {}
        }
    }

    fn on_pod_event(&self, ev: &watcher::Event<Pod>) {
        self.pods_by_workload.apply(ev);
        match ev {
            watcher::Event::Apply(p) | watcher::Event::Delete(p) => {
                self.triggers.pps(self.pps_targeting(pod_owner(p)));
            }
            watcher::Event::InitDone => self.triggers.pps(self.all_pps()),
            watcher::Event::Init | watcher::Event::InitApply(_) => {}
        }
    }

    fn on_node_event(&self, ev: &watcher::Event<Node>) {
        // Label changes are rare (operator actions): every PPS re-records what it must.
        if self.node_labels.apply(ev) {
            self.triggers.pps(self.all_pps());
        }
    }

    fn trigger_workload(&self, workload: &WorkloadRef) {
        if let Some(ws) = self.workload_store(&workload.kind) {
            self.triggers.workload(
                &workload.kind,
                ObjectRef::new_with(&workload.name, ws.resource).within(&workload.namespace),
            );
        }
    }

    fn on_workload_event(&self, kind: &GroupKind, ev: &watcher::Event<DynamicObject>) {
        let key = |obj: &DynamicObject| {
            Some(WorkloadRef {
                namespace: obj.namespace()?,
                kind: kind.clone(),
                name: obj.name_any(),
            })
        };
        match ev {
            watcher::Event::Apply(w) => {
                self.triggers.pps(self.pps_targeting(key(w)));
                if let Some(k) = key(w) {
                    self.trigger_workload(&k);
                }
            }
            watcher::Event::Delete(w) => self.triggers.pps(self.pps_targeting(key(w))),
            // After a relist (its objects reach the store only now): every PPS and every
            // workload of the kind, so nothing created or changed during a watch gap is missed.
            watcher::Event::InitDone => {
                self.triggers.pps(self.all_pps());
                self.resync_kind(kind);
            }
            watcher::Event::Init | watcher::Event::InitApply(_) => {}
        }
    }
}

/// Runs one watch forever: each event updates the store first, then `on_event` (indexes and
/// triggers). Watch errors are retried with backoff and logged.
async fn reflect<K>(
    kind: String,
    api: Api<K>,
    mut writer: reflector::store::Writer<K>,
    strip: fn(&mut K),
    on_event: impl Fn(&watcher::Event<K>),
) where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    let events = watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .modify(strip);
    futures::pin_mut!(events);
    loop {
        match events.try_next().await {
            Ok(Some(ev)) => {
                writer.apply_watcher_event(&ev);
                on_event(&ev);
            }
            Ok(None) => return,
            Err(error) => tracing::warn!(%error, %kind, "watch failed; retrying"),
        }
    }
}

fn strip_meta<K: Resource>(obj: &mut K) {
    obj.meta_mut().managed_fields = None;
}

/// Keeps of a pod only what recording needs: metadata, node name, phase, conditions, IPs.
fn strip_pod(pod: &mut Pod) {
    strip_meta(pod);
    let node_name = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    pod.spec = Some(PodSpec {
        node_name,
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|s| PodStatus {
        phase: s.phase,
        conditions: s.conditions,
        pod_ip: s.pod_ip,
        ..PodStatus::default()
    });
}

/// Keeps of a node its metadata and spec (labels, taints, unschedulable) and its conditions.
fn strip_node(node: &mut Node) {
    strip_meta(node);
    node.status = node.status.take().map(|s| NodeStatus {
        conditions: s.conditions,
        ..NodeStatus::default()
    });
}

/// Keeps of a workload its metadata and the spec fields that decide its live ordinals.
fn strip_workload(obj: &mut DynamicObject) {
    strip_meta(obj);
    let spec = obj.data.get("spec").map(|spec| {
        let mut kept = serde_json::Map::new();
        for field in ["replicas", "ordinals", "reserveOrdinals"] {
            if let Some(v) = spec.get(field) {
                kept.insert(field.to_owned(), v.clone());
            }
        }
        serde_json::Value::Object(kept)
    });
    obj.data = serde_json::json!({ "spec": spec });
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, owner: Option<&str>) -> Pod {
        let owners = owner.map(|o| {
            json!([{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": o, "uid": "u", "controller": true}])
        });
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "ownerReferences": owners},
        }))
        .expect("pod")
    }

    fn sts(name: &str) -> WorkloadRef {
        WorkloadRef {
            namespace: "ns".into(),
            kind: GroupKind::native_statefulset(),
            name: name.into(),
        }
    }

    #[test]
    fn upstream_bug_11_lookups_use_an_index_that_follows_applies_moves_deletes_and_relists() {
        let index = Index::new(pod_owner);
        index.apply(&watcher::Event::Apply(pod("a-0", Some("a"))));
        index.apply(&watcher::Event::Apply(pod("a-1", Some("a"))));
        index.apply(&watcher::Event::Apply(pod("bare", None)));
        assert_eq!(index.get(&sts("a")), vec!["a-0", "a-1"]);

        // the owner changes: the pod moves
        index.apply(&watcher::Event::Apply(pod("a-1", Some("b"))));
        assert_eq!(index.get(&sts("a")), vec!["a-0"]);
        assert_eq!(index.get(&sts("b")), vec!["a-1"]);

        index.apply(&watcher::Event::Delete(pod("a-0", Some("a"))));
        assert!(index.get(&sts("a")).is_empty());

        // a relist replaces everything at InitDone, not before
        index.apply(&watcher::Event::Init);
        index.apply(&watcher::Event::InitApply(pod("c-0", Some("c"))));
        assert_eq!(index.get(&sts("b")), vec!["a-1"]);
        index.apply(&watcher::Event::InitDone);
        assert!(index.get(&sts("b")).is_empty());
        assert_eq!(index.get(&sts("c")), vec!["c-0"]);
    }

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).expect("node")
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn upstream_bug_12_node_label_changes_are_noticed_and_joint_matches_answered() {
        let index = NodeLabelIndex::default();
        assert!(index.apply(&watcher::Event::Apply(node(
            "n1",
            &[("zone", "a"), ("host", "n1")]
        ))));
        assert!(index.apply(&watcher::Event::Apply(node(
            "n2",
            &[("zone", "b"), ("host", "n2")]
        ))));
        assert!(
            !index.apply(&watcher::Event::Apply(node(
                "n2",
                &[("zone", "b"), ("host", "n2")]
            ))),
            "heartbeat"
        );
        assert!(index.any_node_with(&labels(&[("zone", "a"), ("host", "n1")])));
        assert!(
            !index.any_node_with(&labels(&[("zone", "a"), ("host", "n2")])),
            "both labels on one node"
        );
        assert!(index.any_node_with(&labels(&[])));
        assert!(index.apply(&watcher::Event::Apply(node(
            "n1",
            &[("zone", "c"), ("host", "n1")]
        ))));
        assert!(
            !index.any_node_with(&labels(&[("zone", "a")])),
            "zone a is gone"
        );
        assert!(index.apply(&watcher::Event::Delete(node("n2", &[]))));
        assert!(!index.any_node_with(&labels(&[("host", "n2")])));
        index.apply(&watcher::Event::Init);
        index.apply(&watcher::Event::InitApply(node("n3", &[("host", "n3")])));
        assert!(
            index.any_node_with(&labels(&[("host", "n1")])),
            "old state until InitDone"
        );
        assert!(index.apply(&watcher::Event::InitDone));
        assert!(!index.any_node_with(&labels(&[("host", "n1")])));
        assert!(index.any_node_with(&labels(&[("host", "n3")])));
    }

    #[tokio::test]
    async fn upstream_bug_4_deleting_a_native_statefulset_reconciles_its_pps() {
        use futures::StreamExt;
        let (mock, _api_server) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let caches = Caches::start(&Client::new(mock, "default"));
        let mut requests = caches.triggers.subscribe_pps();
        let pps: PersistentPodState = serde_json::from_value(json!({
            "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}}
        }))
        .expect("pps");
        caches.on_pps_event(&watcher::Event::Apply(pps));
        let web = ObjectRef::<PersistentPodState>::new("web").within("ns");
        assert_eq!(requests.next().await, Some(web.clone()), "the PPS itself");
        let sts: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "web", "namespace": "ns"}
        }))
        .expect("sts");
        caches.on_workload_event(
            &GroupKind::native_statefulset(),
            &watcher::Event::Delete(sts),
        );
        assert_eq!(
            requests.next().await,
            Some(web),
            "the PPS of the deleted StatefulSet"
        );
    }

    #[test]
    fn stripping_keeps_what_recording_needs() {
        let mut p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "a-0", "managedFields": [{"manager": "x"}]},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 0}]}
        }))
        .expect("pod");
        strip_pod(&mut p);
        assert!(p.metadata.managed_fields.is_none());
        let spec = p.spec.as_ref().expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert!(spec.containers.is_empty());
        let status = p.status.as_ref().expect("status");
        assert_eq!(status.pod_ip.as_deref(), Some("10.0.0.1"));
        assert!(status.container_statuses.is_none());
        assert_eq!(status.conditions.as_ref().map(Vec::len), Some(1));

        let mut w: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "a"},
            "spec": {"replicas": 3, "ordinals": {"start": 1}, "template": {"spec": {}}}
        }))
        .expect("workload");
        strip_workload(&mut w);
        assert_eq!(
            w.data,
            json!({"spec": {"replicas": 3, "ordinals": {"start": 1}}})
        );
    }
}
