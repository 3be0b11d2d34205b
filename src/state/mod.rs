//! The shared state of the process: one watch per resource kind feeds a reflector store and the
//! indexes the hot paths need ([`index`]), and is mapped to reconcile requests ([`triggers`]);
//! what is kept of each object is decided in [`trim`], and which pod annotations in [`kept`]. The webhook and the controllers read the
//! same stores; nothing here is rebuilt per request.
//!
//! Every watch event enters through one `apply_*` method, whether it comes from a real watch
//! ([`Caches::start`]) or from a test ([`Caches::new`] starts no watch), so in-process tests
//! exercise exactly the path a cluster does. The state owns its readiness: it is synced once
//! every base store has had its first full list.

pub mod gone;
pub mod index;
pub mod kept;
pub mod pods;
pub mod proto;
pub mod triggers;
pub mod trim;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::watch;

pub use index::pps_target;
use index::{ByWorkload, NodesByLabel, Shared};
use pods::PodTable;
use triggers::NodeTrigger;
pub use triggers::{NodeHealthChange, Triggers};
use trim::{CachedPod, Read, ReadPps};

use crate::api::PersistentPodState;
use crate::placement::{Nodes, unhealthy_since};
use crate::sync::lock;
use crate::workload::{GroupKind, WorkloadRef, native_statefulset_resource};

/// A watched workload kind: its store, and the feed that writes it.
#[derive(Clone)]
pub struct WorkloadStore {
    /// The resource watched.
    pub resource: ApiResource,
    /// Its objects (spec reduced to what recording needs).
    pub store: Store<DynamicObject>,
    feed: Arc<WorkloadFeed>,
}

struct WorkloadFeed {
    writer: Mutex<Writer<DynamicObject>>,
    /// Whether the first full list has arrived (until then, absence proves nothing).
    synced: AtomicBool,
    /// The watch task, when one runs, and its entry in [`Watches`].
    task: Mutex<Option<(tokio::task::AbortHandle, WatchId)>>,
}

impl WorkloadStore {
    /// Whether both are the same feed (a kind removed and added again is another one).
    pub fn same_watch(&self, other: &WorkloadStore) -> bool {
        Arc::ptr_eq(&self.feed, &other.feed)
    }

    fn synced(&self) -> bool {
        self.feed.synced.load(Ordering::Acquire)
    }

    /// Stops the watch task, if one runs; returns its entry in [`Watches`].
    fn stop(&self) -> Option<WatchId> {
        lock(&self.feed.task).take().map(|(task, id)| {
            task.abort();
            id
        })
    }
}

/// What is known about a workload.
pub enum WorkloadLookup {
    /// The kind is watched and the object is in the cache.
    Found(Arc<DynamicObject>),
    /// The kind is watched and the object does not exist.
    Absent,
    /// The kind is not watched (or not listed yet): whether it exists is unknown.
    Unknown,
}

/// Which base stores have had their first full list.
#[derive(Default)]
struct Listed {
    pps: AtomicBool,
    pods: AtomicBool,
    nodes: AtomicBool,
}

/// All caches of the process, shared by the webhook and the controllers.
pub struct Caches {
    /// Starts the watches; `None` when events are fed by hand (tests, benchmarks).
    client: Option<Client>,
    /// PersistentPodState objects.
    pub pps: Store<PersistentPodState>,
    pps_writer: Mutex<Writer<PersistentPodState>>,
    /// PersistentPodStates by target workload.
    pub pps_by_target: Shared<ByWorkload>,
    /// Pods, as [`CachedPod`]s, by name, controlling workload and IP.
    pub pods: Shared<PodTable>,
    /// Which pod annotations the pods cached keep.
    pub kept: kept::KeptAnnotations,
    /// Nodes (labels, spec and conditions).
    pub nodes: Store<Node>,
    nodes_writer: Mutex<Writer<Node>>,
    /// Nodes by label.
    pub node_labels: Shared<NodesByLabel>,
    /// Node watch events applied (any node changed when it moved).
    nodes_changed: AtomicU64,
    /// The nodes seen deleted lately, as last seen, oldest first ([`Nodes::gone`]).
    gone_nodes: Mutex<std::collections::VecDeque<(std::time::Instant, Arc<Node>)>>,
    /// The nodes cached as a relist of them began: those it does not list were deleted
    /// meanwhile.
    nodes_before_relist: Mutex<Option<Vec<Arc<Node>>>>,
    /// Targeted workloads' pods seen deleted lately ([`gone`]).
    gone_pods: Mutex<gone::GonePods>,
    workloads: RwLock<HashMap<GroupKind, WorkloadStore>>,
    kinds_changed: watch::Sender<u64>,
    /// Reconcile requests to the controllers.
    pub triggers: Triggers,
    listed: Listed,
    synced: watch::Sender<bool>,
    /// Whether each watch is current.
    pub watches: Arc<Watches>,
    /// Called as the caches become synced, before [`Caches::is_synced`] says so.
    on_synced: fn(),
    /// Whether the PersistentPodState CRD keeps none of the status's extension fields, as a
    /// status written showed, until that CRD changes ([`Caches::bare_status`]).
    bare_status: AtomicBool,
    /// Whether the PersistentPodState CRD as last seen declares the extension fields in every
    /// version it serves ([`Caches::pps_crd_declares_extensions`]).
    crd_declares_extensions: AtomicBool,
}

/// Objects listed per page by the commands ([`list_each`]), as kubectl lists them.
pub const COMMAND_PAGE: u32 = 500;

/// Hands `each` every object `api` lists under `params`, read page by page ([`COMMAND_PAGE`]
/// each), so that no one answer holds a whole large cluster's objects.
pub async fn list_each<K>(
    api: &kube::Api<K>,
    params: &kube::api::ListParams,
    mut each: impl FnMut(K),
) -> Result<(), kube::Error>
where
    K: Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let mut page = params.clone().limit(COMMAND_PAGE);
    loop {
        let list = api.list(&page).await?;
        list.items.into_iter().for_each(&mut each);
        match list.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => page = page.continue_token(&token),
            None => return Ok(()),
        }
    }
}

impl Caches {
    fn build(client: Option<Client>, on_synced: fn()) -> Arc<Self> {
        let (pps, pps_writer) = reflector::store();
        let (nodes, nodes_writer) = reflector::store();
        let caches = Arc::new(Self {
            client,
            pps,
            pps_writer: Mutex::new(pps_writer),
            pps_by_target: Shared::default(),
            pods: Shared::default(),
            kept: kept::KeptAnnotations::default(),
            nodes,
            nodes_writer: Mutex::new(nodes_writer),
            node_labels: Shared::default(),
            nodes_changed: AtomicU64::new(0),
            gone_nodes: Mutex::default(),
            nodes_before_relist: Mutex::default(),
            gone_pods: Mutex::default(),
            workloads: RwLock::default(),
            kinds_changed: watch::channel(0).0,
            triggers: Triggers::default(),
            listed: Listed::default(),
            synced: watch::channel(false).0,
            watches: Arc::default(),
            on_synced,
            bare_status: AtomicBool::new(false),
            crd_declares_extensions: AtomicBool::new(false),
        });
        caches.add_workload_kind(native_statefulset_resource());
        caches
    }

    /// Caches that start no watch: events are fed with the `apply_*` methods (tests,
    /// benchmarks). The native StatefulSet kind is registered, as in [`Caches::start`].
    pub fn new() -> Arc<Self> {
        Self::build(None, || {})
    }

    /// Caches holding the cluster's nodes as listed once now (the commands that judge nodes
    /// without watching: `explain`, `release`, `kubectl pps status`).
    pub async fn with_nodes(client: &Client) -> Result<Arc<Self>, kube::Error> {
        let caches = Self::new();
        let nodes = Api::<Node>::all(client.clone());
        list_each(&nodes, &kube::api::ListParams::default(), |n| {
            caches.apply_node(watcher::Event::InitApply(n));
        })
        .await?;
        caches.apply_node(watcher::Event::InitDone);
        Ok(caches)
    }

    /// Starts the watches of PersistentPodStates, Pods, Nodes and native StatefulSets, and
    /// returns the caches; more workload kinds can be added with [`Caches::add_workload_kind`].
    /// `on_synced` is called as they become synced: at least once, twice if two watches end
    /// their first lists at the same instant.
    pub fn start(client: &Client, on_synced: fn()) -> Arc<Self> {
        let caches = Self::build(Some(client.clone()), on_synced);
        let c = caches.clone();
        // Decoded one by one, so one unreadable object (stored by an older schema, say) is
        // skipped instead of failing every list of the kind.
        let watches = caches.watches.clone();
        let [pps_watch, pod_watch, node_watch] = SERVING_WATCHES;
        spawn_watch(
            pps_watch,
            Api::<ReadPps>::all(client.clone()),
            move |ev| {
                if let Some(ev) = decode_pps(ev) {
                    c.apply_pps(ev);
                }
            },
            watches.clone(),
            None,
        );
        let (c, filled) = (caches.clone(), caches.clone());
        spawn_watch(
            pod_watch,
            proto::PodSource::new(client.clone()),
            move |ev| c.apply_cached_pod(trim::map_event(ev, |w| Arc::new(w.pod))),
            watches.clone(),
            Some(Relist {
                told: caches.kept.subscribe(),
                fill: Arc::new(move |ev| {
                    filled.fill_pod_annotations(trim::map_event(ev, |w| Arc::new(w.pod)));
                }),
            }),
        );
        let c = caches.clone();
        spawn_watch(
            node_watch,
            Api::<Read<Node>>::all(client.clone()),
            move |ev| c.apply_node(trim::map_event(ev, |node| node.0)),
            watches,
            None,
        );
        caches
    }

    /// Applies one PersistentPodState watch event: store, index, reconcile requests.
    pub fn apply_pps(&self, event: watcher::Event<PersistentPodState>) {
        let event = event.modify(trim::meta);
        // A relist replaces the store at its end, with no Delete for what went meanwhile: the
        // targets of the objects held before it are kept to tell which went.
        let before = matches!(event, watcher::Event::InitDone).then(|| self.pps_targets());
        // What one that went targeted, from its cached copy: the event's may not read (an
        // object whose spec no longer decodes comes as a Delete of its metadata alone).
        let went_from = match &event {
            watcher::Event::Delete(p) => self
                .pps
                .get(&ObjectRef::from_obj(p))
                .and_then(|cached| pps_target(&cached)),
            _ => None,
        };
        // A controlled one (generated for its workload) whose spec or annotations changed:
        // its generator looks again, so that what the workload's annotations express follows
        // them whoever edited it (not only at the workload's next change). Its status writes
        // change neither.
        let edited = match &event {
            watcher::Event::Apply(p)
                if p.owner_references()
                    .iter()
                    .any(|o| o.controller == Some(true)) =>
            {
                self.pps
                    .get(&ObjectRef::from_obj(p))
                    .filter(|cached| {
                        cached.metadata.generation != p.metadata.generation
                            || cached.metadata.annotations != p.metadata.annotations
                    })
                    .and_then(|_| pps_target(p))
            }
            _ => None,
        };
        if let watcher::Event::Apply(p) | watcher::Event::InitApply(p) = &event
            && self.kept.name(p.spec.persistent_annotation_keys())
        {
            tracing::info!(pps = %p.name_any(), namespace = %p.namespace().unwrap_or_default(),
                "a pod annotation no PersistentPodState named before is to be recorded; listing the pods again to read it");
        }
        if matches!(event, watcher::Event::InitDone) {
            self.kept.pps_listed(|keep| {
                self.pods.change_each(|table| {
                    table.keep_annotations(keep);
                });
            });
        }
        lock(&self.pps_writer).apply_watcher_event(&event);
        self.pps_by_target.apply(&event);
        self.listed_if_done(&event, &self.listed.pps);
        self.trigger_for_pps(&event, before, went_from);
        if let Some(workload) = edited {
            self.trigger_workload(&workload);
        }
    }

    /// Applies one Pod watch event (the pods kept as [`CachedPod`]).
    pub fn apply_pod(&self, event: watcher::Event<Pod>) {
        self.apply_cached_pod(trim::map_event(event, |p| Arc::new(CachedPod::from(p))));
    }

    /// Applies one watch event of pods decoded as they are kept, with only the annotations
    /// kept ([`kept`]).
    pub fn apply_cached_pod(&self, event: watcher::Event<Arc<CachedPod>>) {
        let keeping = self.kept.keeping();
        let event = trim::map_event(event, |pod| keeping.trim(pod));
        if let watcher::Event::Init = event {
            self.kept.pods_listing(&keeping);
        }
        self.pods.apply(&event);
        // Only once the listed pods are the table: a reconcile told the annotations are read
        // must find them on the pods it reads.
        if let watcher::Event::InitDone = event {
            self.kept.pods_listed(&keeping);
        }
        drop(keeping);
        // A targeted workload's pod (its state may name it) seen deleted: the next of its name
        // came after it (before the event wakes a reconcile).
        if let watcher::Event::Delete(pod) = &event
            && pod
                .workload()
                .is_some_and(|w| self.pps_by_target.read().get(&w).next().is_some())
        {
            lock(&self.gone_pods).went(pod, std::time::Instant::now());
        }
        self.listed_if_done(&event, &self.listed.pods);
        self.trigger_for_pod(&event);
    }

    /// An event of a list of pods made to read annotations named since they were cached
    /// ([`kept`]): a cached pod of the same uid and resourceVersion as a listed one takes its
    /// annotations (nothing else changes, so the cache never goes back: a pod changed since is
    /// brought by the watch, with them); at the list's end the pods cover what was named
    /// before it began, and the PersistentPodStates naming pod annotations are looked at.
    pub fn fill_pod_annotations(&self, event: watcher::Event<Arc<CachedPod>>) {
        let keeping = self.kept.keeping();
        match event {
            watcher::Event::Init => self.kept.pods_listing(&keeping),
            watcher::Event::InitApply(pod) => {
                let pod = keeping.trim(pod);
                self.pods.change_each(|table| table.fill_annotations(&pod));
            }
            watcher::Event::InitDone => {
                self.kept.pods_listed(&keeping);
                drop(keeping);
                self.trigger_for_annotations_read();
            }
            watcher::Event::Apply(_) | watcher::Event::Delete(_) => {}
        }
    }

    /// Whether statuses are written without this service's extension fields
    /// ([`crate::api::PersistentPodStateStatus::without_extensions`]): a status written came
    /// back without them (OpenKruise's CRD, which does not declare them, prunes them), and the
    /// CRD has not changed since.
    pub fn bare_status(&self) -> bool {
        self.bare_status.load(Ordering::Relaxed)
    }

    /// A status written came back without the extension fields; `true` the first time they
    /// are then left out. Not while the CRD as seen declares them: that answer came from an API
    /// server that had not loaded the CRD's change yet (each loads it on its own), and the
    /// fields it pruned are written again at the next look, once it has.
    pub fn status_came_back_bare(&self) -> bool {
        !self.crd_declares_extensions.load(Ordering::Relaxed)
            && !self.bare_status.swap(true, Ordering::Relaxed)
    }

    /// Notes whether the PersistentPodState CRD as seen declares the extension fields.
    pub fn pps_crd_declares_extensions(&self, declares: bool) {
        self.crd_declares_extensions
            .store(declares, Ordering::Relaxed);
    }

    /// The PersistentPodState CRD changed: statuses are written whole again (the next write
    /// shows whether the new definition keeps the extension fields); `true` if they were not,
    /// and then every PersistentPodState is looked at again at once (a CRD's change brings no
    /// event of its objects).
    pub fn pps_crd_changed(&self) -> bool {
        let was_bare = self.bare_status.swap(false, Ordering::Relaxed);
        if was_bare {
            self.triggers.pps(self.all_pps());
        }
        was_bare
    }

    /// Keeps a node deleted by `event` (applied), or that a relist ending with it no longer
    /// lists, as last seen, for [`GONE_NODE_KEPT_FOR`] (at most [`GONE_NODES_KEPT`] of them); a
    /// node of that name seen again is forgotten so.
    fn remember_gone_node(&self, event: &watcher::Event<Node>) {
        let (node, deleted) = match event {
            watcher::Event::Delete(node) => (Arc::new(node.clone()), true),
            watcher::Event::Apply(node) | watcher::Event::InitApply(node) => {
                if lock(&self.gone_nodes).is_empty() {
                    return;
                }
                (Arc::new(node.clone()), false)
            }
            // The cache still holds what it held before (the relist is swapped in at its end).
            watcher::Event::Init => {
                *lock(&self.nodes_before_relist) = Some(self.nodes.state());
                return;
            }
            watcher::Event::InitDone => {
                let before = lock(&self.nodes_before_relist).take().unwrap_or_default();
                for node in before {
                    if self.node(&node.name_any()).is_none() {
                        self.node_gone(node, true);
                    }
                }
                return;
            }
        };
        self.node_gone(node, deleted);
    }

    /// `node` is gone (`deleted`), or a node of its name is seen (not).
    fn node_gone(&self, node: Arc<Node>, deleted: bool) {
        let now = std::time::Instant::now();
        let mut gone = lock(&self.gone_nodes);
        let name = node.metadata.name.as_deref();
        gone.retain(|(at, n)| {
            n.metadata.name.as_deref() != name && now.duration_since(*at) < GONE_NODE_KEPT_FOR
        });
        if deleted {
            gone.push_back((now, node));
            while gone.len() > GONE_NODES_KEPT {
                gone.pop_front();
            }
        }
    }

    /// How many node watch events were applied that changed a node as kept (what placement
    /// reads): equal counts mean no node changed between.
    pub fn nodes_changed(&self) -> u64 {
        self.nodes_changed.load(Ordering::Acquire)
    }

    /// Applies one Node watch event.
    pub fn apply_node(&self, event: watcher::Event<Node>) {
        let event = event.modify(trim::node);
        let health_change = |node: &Node| NodeHealthChange {
            name: node.name_any(),
            labels: node.labels().clone(),
            taints_only: false,
        };
        let known = match &event {
            watcher::Event::Apply(node) => self.node(&node.name_any()),
            _ => None,
        };
        lock(&self.nodes_writer).apply_watcher_event(&event);
        self.remember_gone_node(&event);
        let labels_changed = self.node_labels.apply(&event);
        // A known node kept as it was but for its version (a status update of what is not
        // kept: a heartbeat, another condition) changes no placement: the shared ones stay.
        let unchanged = match (&event, &known) {
            (watcher::Event::Apply(node), Some(old)) => same_but_version(old, node),
            _ => false,
        };
        if !unchanged {
            self.nodes_changed.fetch_add(1, Ordering::Release);
        }
        self.listed_if_done(&event, &self.listed.nodes);
        let trigger = match (&event, known) {
            (watcher::Event::Delete(node), _) => NodeTrigger::Health(health_change(node)),
            // Relabelled only in keys no PersistentPodState reads (the node lifecycle
            // controller adds `beta.kubernetes.io/os` to a node without it, a labeller its
            // own): as if not relabelled.
            (watcher::Event::Apply(node), Some(old))
                if !labels_changed || !self.pps_read_any(&changed_keys(&old, node)) =>
            {
                // A taint pods must tolerate, come or gone, may hold pods pinned there.
                let taints_same = crate::placement::scheduling_taints(&old)
                    .eq(crate::placement::scheduling_taints(node));
                match (unhealthy_since(&old) == unhealthy_since(node), taints_same) {
                    (true, true) => NodeTrigger::None,
                    (true, false) => NodeTrigger::Health(NodeHealthChange {
                        taints_only: true,
                        ..health_change(node)
                    }),
                    (false, _) => NodeTrigger::Health(health_change(node)),
                }
            }
            // A new node, a known one relabelled, or the end of a list.
            (watcher::Event::Apply(_), _) | (watcher::Event::InitDone, _) => NodeTrigger::Every,
            (watcher::Event::Init | watcher::Event::InitApply(_), _) => NodeTrigger::None,
        };
        self.trigger_for_node(trigger);
    }

    /// Applies one watch event of a workload kind (ignored if the kind is not registered).
    pub fn apply_workload(&self, kind: &GroupKind, event: watcher::Event<DynamicObject>) {
        let Some(ws) = self.workload_store(kind) else {
            return;
        };
        self.apply_workload_to(&ws, kind, event);
    }

    fn apply_workload_to(
        &self,
        ws: &WorkloadStore,
        kind: &GroupKind,
        event: watcher::Event<DynamicObject>,
    ) {
        let event = event.modify(trim::workload);
        lock(&ws.feed.writer).apply_watcher_event(&event);
        if matches!(event, watcher::Event::InitDone) {
            ws.feed.synced.store(true, Ordering::Release);
            self.update_synced();
        }
        self.trigger_for_workload(kind, &event);
    }

    fn listed_if_done<K>(&self, event: &watcher::Event<K>, flag: &AtomicBool) {
        if matches!(event, watcher::Event::InitDone) {
            flag.store(true, Ordering::Release);
            self.update_synced();
        }
    }

    fn update_synced(&self) {
        let native = self
            .workload_store(&GroupKind::native_statefulset())
            .is_some_and(|ws| ws.synced());
        let all = native
            && [&self.listed.pps, &self.listed.pods, &self.listed.nodes]
                .iter()
                .all(|f| f.load(Ordering::Acquire));
        if all && !self.is_synced() {
            (self.on_synced)();
        }
        // Once synced, always synced: a relist keeps answering from the previous list.
        self.synced.send_if_modified(|s| {
            let changed = all && !*s;
            *s |= all;
            changed
        });
    }

    /// Whether the PersistentPodState, Pod, Node and native StatefulSet stores have had their
    /// first full list. (Kinds added later are consulted only once their own list arrived.)
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Waits until [`Caches::is_synced`].
    pub async fn wait_synced(&self) {
        let mut rx = self.synced.subscribe();
        // The sender lives as long as `self`.
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Starts watching a workload kind (replacing the watch of another version of it).
    /// Returns false if exactly this resource is watched already.
    pub fn add_workload_kind(self: &Arc<Self>, ar: ApiResource) -> bool {
        let kind = GroupKind::new(&ar.group, &ar.kind);
        let mut workloads = crate::sync::write(&self.workloads);
        if workloads.get(&kind).is_some_and(|w| w.resource == ar) {
            return false;
        }
        let writer = Writer::new(ar.clone());
        let ws = WorkloadStore {
            resource: ar.clone(),
            store: writer.as_reader(),
            feed: Arc::new(WorkloadFeed {
                writer: Mutex::new(writer),
                synced: AtomicBool::new(false),
                task: Mutex::new(None),
            }),
        };
        if let Some(client) = &self.client {
            let (c, k, target) = (self.clone(), kind.clone(), ws.clone());
            let (task, id) = spawn_watch(
                &watch_key(&kind),
                Api::<DynamicObject>::all_with(client.clone(), &ar),
                move |ev| c.apply_workload_to(&target, &k, ev),
                self.watches.clone(),
                None,
            );
            *lock(&ws.feed.task) = Some((task.abort_handle(), id));
            tracing::info!(group = %ar.group, version = %ar.version, kind = %ar.kind, "watching workload kind");
        }
        if let Some(old) = workloads.insert(kind, ws) {
            old.stop();
        }
        drop(workloads);
        self.kinds_changed.send_modify(|n| *n += 1);
        true
    }

    /// Stops watching a workload kind (its CRD is gone); its workloads become unknown.
    pub fn remove_workload_kind(&self, kind: &GroupKind) {
        let removed = crate::sync::write(&self.workloads).remove(kind);
        if let Some(old) = removed {
            if let Some(id) = old.stop() {
                self.watches.forget(&watch_key(kind), id);
            }
            tracing::info!(group = %kind.group, kind = %kind.kind, "no longer watching workload kind");
            self.kinds_changed.send_modify(|n| *n += 1);
        }
    }

    /// The watched workload kinds.
    pub fn workload_kinds(&self) -> Vec<(GroupKind, WorkloadStore)> {
        crate::sync::read(&self.workloads)
            .iter()
            .map(|(k, w)| (k.clone(), w.clone()))
            .collect()
    }

    /// Notified whenever a workload kind is added or removed.
    pub fn subscribe_workload_kinds(&self) -> watch::Receiver<u64> {
        self.kinds_changed.subscribe()
    }

    /// The store and resource of a workload kind, if it is watched.
    pub fn workload_store(&self, kind: &GroupKind) -> Option<WorkloadStore> {
        crate::sync::read(&self.workloads).get(kind).cloned()
    }

    /// The PersistentPodState in force for `workload`: when several target it (made before
    /// validation, or in a race), the oldest by creation time, then by name; one being deleted
    /// (held by a finalizer) is never in force, as upstream's webhook skips it. The webhook
    /// and the controller both use this one; the others record nothing.
    pub fn pps_for(&self, workload: &WorkloadRef) -> Option<Arc<PersistentPodState>> {
        // Read in place under the index's lock (no list of names copied per review); the
        // writer takes the store's lock and the index's one after the other, never both.
        self.pps_by_target
            .read()
            .get(workload)
            .filter_map(|name| {
                self.pps
                    .get(&ObjectRef::new(name).within(&workload.namespace))
            })
            .filter(|pps| pps.metadata.deletion_timestamp.is_none())
            .min_by(|a, b| {
                let created = |p: &PersistentPodState| p.metadata.creation_timestamp.clone();
                created(a)
                    .cmp(&created(b))
                    .then_with(|| a.metadata.name.cmp(&b.metadata.name))
            })
    }

    /// How many PersistentPodStates are shadowed by an older one targeting the same workload.
    pub fn shadowed_pps(&self) -> usize {
        // Read in place under the index's lock, as `pps_for`: one being deleted is in force
        // for nothing, so it shadows nothing and is not shadowed (its replacement beside it
        // is the one in force).
        self.pps_by_target
            .read()
            .shared()
            .map(|(workload, names)| {
                names
                    .iter()
                    .filter(|name| {
                        self.pps
                            .get(&ObjectRef::new(name).within(&workload.namespace))
                            .is_some_and(|pps| pps.metadata.deletion_timestamp.is_none())
                    })
                    .count()
                    .saturating_sub(1)
            })
            .sum()
    }

    /// Names of the PersistentPodStates that target `workload`, sorted.
    pub fn pps_names_for(&self, workload: &WorkloadRef) -> Vec<String> {
        self.pps_by_target
            .read()
            .get(workload)
            .map(str::to_owned)
            .collect()
    }

    /// Names of the PersistentPodStates that target `workload` and are not being deleted,
    /// sorted.
    pub fn pps_names_not_deleting_for(&self, workload: &WorkloadRef) -> Vec<String> {
        let mut names = self.pps_names_for(workload);
        names.retain(|name| {
            self.pps
                .get(&ObjectRef::new(name).within(&workload.namespace))
                .is_some_and(|pps| pps.metadata.deletion_timestamp.is_none())
        });
        names
    }

    /// The cached pods whose controller is `workload`.
    pub fn pods_of(&self, workload: &WorkloadRef) -> Vec<Arc<CachedPod>> {
        self.pods.read().of_workload(workload)
    }

    /// A live pod other than `namespace/name` that holds `ip`, as `namespace/name`.
    pub fn ip_holder(&self, ip: &str, namespace: &str, name: &str) -> Option<String> {
        self.pods
            .read()
            .holders(ip)
            .find(|p| !(&*p.namespace == namespace && &*p.name == name))
            .map(|p| format!("{}/{}", p.namespace, p.name))
    }

    /// Whether the cache shows the pod `namespace/name` holding `ip` (by its status, or by its
    /// request through a preset's annotation).
    pub fn ip_held_by(&self, ip: &str, namespace: &str, name: &str) -> bool {
        self.pods
            .read()
            .holders(ip)
            .any(|p| &*p.namespace == namespace && &*p.name == name)
    }

    /// The cached pods `keep` keeps (a pass over every pod: for sweeps now and then, never
    /// per review).
    pub fn pods_where(&self, mut keep: impl FnMut(&CachedPod) -> bool) -> Vec<Arc<CachedPod>> {
        self.pods
            .read()
            .iter()
            .filter(|p| keep(p))
            .cloned()
            .collect()
    }

    /// Whether the pod `namespace/name` of `uid` is known gone: the pod watch saw it deleted
    /// lately (a pod of a workload a PersistentPodState targets), or [`Caches::pod_gone`] said
    /// so. The pod of that name cached now came after it.
    pub fn pod_is_gone(&self, namespace: &str, name: &str, uid: &str) -> bool {
        lock(&self.gone_pods).is_gone(namespace, name, uid, std::time::Instant::now())
    }

    /// The pod `namespace/name` of `uid` is known gone (a live read found another pod of that
    /// name, or none).
    pub fn pod_gone(&self, namespace: &str, name: &str, uid: &str) {
        lock(&self.gone_pods).remember(namespace, name, uid, std::time::Instant::now());
    }

    /// Whether a pod of that name exists in `namespace`.
    pub fn pod_exists(&self, namespace: &str, name: &str) -> bool {
        self.pods.read().get(namespace, name).is_some()
    }

    /// Whether a cached PersistentPodState reads any of the node label `keys` (its required and
    /// preferred topology keys are all it records of a node, and all the controllers place
    /// by).
    fn pps_read_any(&self, keys: &BTreeSet<&str>) -> bool {
        self.pps.state().iter().any(|pps| {
            let preferred = pps.spec.preferred_terms().flat_map(|(_, keys)| keys.iter());
            pps.spec
                .required_keys()
                .iter()
                .chain(preferred)
                .any(|k| keys.contains(k.as_str()))
        })
    }

    /// The cached node named `name`.
    pub fn node(&self, name: &str) -> Option<Arc<Node>> {
        self.nodes.get(&ObjectRef::new(name))
    }

    /// Looks a workload up in its kind's cache.
    pub fn workload(&self, workload: &WorkloadRef) -> WorkloadLookup {
        let Some(ws) = self
            .workload_store(&workload.kind)
            .filter(WorkloadStore::synced)
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
}

impl Nodes for Caches {
    fn visit_with_labels(
        &self,
        labels: &BTreeMap<&str, &str>,
        visit: &mut dyn FnMut(&Node) -> bool,
    ) -> bool {
        let index = self.node_labels.read();
        match index.with_all(labels) {
            // The node as stored is checked again: a relabel reaches the store before the
            // index, and a review between the two would otherwise see a node carrying values
            // it no longer has.
            Some(names) => names
                .filter_map(|name| self.node(name))
                .filter(|n| {
                    let have = n.labels();
                    labels
                        .iter()
                        .all(|(k, v)| have.get(*k).is_some_and(|h| h == v))
                })
                .any(|n| visit(&n)),
            None => self.nodes.state().iter().any(|n| visit(n)),
        }
    }

    fn all(&self) -> Vec<Arc<Node>> {
        self.nodes.state()
    }

    fn gone(&self) -> Vec<Arc<Node>> {
        lock(&self.gone_nodes)
            .iter()
            .map(|(_, node)| node.clone())
            .collect()
    }
}

/// How long a deleted node is remembered as last seen: what names it (a local volume's
/// affinity by a label of its own) is still told apart for a day after.
const GONE_NODE_KEPT_FOR: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// The most deleted nodes remembered so (the latest).
const GONE_NODES_KEPT: usize = 1024;

/// The label keys whose values differ between two versions of a node (added, removed or
/// changed).
fn changed_keys<'a>(old: &'a Node, new: &'a Node) -> BTreeSet<&'a str> {
    let (old, new) = (old.labels(), new.labels());
    old.keys()
        .chain(new.keys())
        .filter(|k| old.get(*k) != new.get(*k))
        .map(String::as_str)
        .collect()
}

/// Whether two nodes as kept ([`trim::node`]) differ at most in their resource version.
fn same_but_version(a: &Node, b: &Node) -> bool {
    let unversioned = |n: &Node| ObjectMeta {
        resource_version: None,
        ..n.metadata.clone()
    };
    a.spec == b.spec && a.status == b.status && unversioned(a) == unversioned(b)
}

/// A PersistentPodState watch event as the caches take it. An object that does not decode is
/// logged and treated as absent (an `Apply` of it removes what was cached under its name).
fn decode_pps(event: watcher::Event<ReadPps>) -> Option<watcher::Event<PersistentPodState>> {
    // The object, and whether it read: one that did not stands for itself with its metadata
    // alone (when it has to be removed from the cache).
    let read = |obj: ReadPps| match obj {
        ReadPps::Readable(pps) => (pps, true),
        ReadPps::Unreadable(metadata, error) => {
            let (namespace, name) = (metadata.namespace.as_deref(), metadata.name.as_deref());
            tracing::warn!(namespace = namespace.unwrap_or_default(),
                name = name.unwrap_or_default(), %error,
                "PersistentPodState cannot be read; ignored until it changes");
            let unreadable = PersistentPodState {
                metadata,
                spec: Default::default(),
                status: None,
            };
            (unreadable, false)
        }
    };
    Some(match event {
        watcher::Event::Apply(obj) => match read(obj) {
            (pps, true) => watcher::Event::Apply(pps),
            (unreadable, false) => watcher::Event::Delete(unreadable),
        },
        watcher::Event::Delete(obj) => watcher::Event::Delete(read(obj).0),
        watcher::Event::InitApply(obj) => match read(obj) {
            (pps, true) => watcher::Event::InitApply(pps),
            (_, false) => return None,
        },
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
    })
}

/// Objects per page of a paginated list (where streaming lists are refused).
const PAGE_SIZE: u32 = 500;

/// The watches whose caches the webhook's answers read (readiness waits for them to be
/// current).
pub const SERVING_WATCHES: [&str; 3] = ["PersistentPodState", "Pod", "Node"];

/// Whether each watch is current: listed since it last failed. A watch that fails, ends or
/// is restarted is stale until its relist is done; readiness is false while any of
/// [`SERVING_WATCHES`] is stale.
#[derive(Default)]
pub struct Watches {
    states: Mutex<BTreeMap<String, WatchState>>,
    /// The last [`WatchId`] handed out.
    last_id: AtomicU64,
    /// Set once the API server refused a streaming list (before v1.34, or its `WatchList`
    /// feature gate off): every list is paginated from then on.
    paginate: AtomicBool,
}

/// Which watch task owns a kind's entry in [`Watches`]: only the task started last for a kind
/// changes it, so one stopped (its kind removed, or replaced by another version's watch) that
/// still reports as it is aborted neither marks its successor stale nor brings back a
/// forgotten kind.
pub(crate) type WatchId = u64;

/// The state of one watch.
#[derive(Clone, Debug, Default)]
struct WatchState {
    owner: WatchId,
    current: bool,
    restarts: u64,
    why: Option<String>,
}

impl Watches {
    /// A watch of `kind` is starting: it owns the kind's entry from now on (not current until
    /// it has listed; restarts counted before are kept).
    fn start(&self, kind: &str) -> WatchId {
        let id = self.last_id.fetch_add(1, Ordering::Relaxed) + 1;
        let mut all = lock(&self.states);
        let state = all.entry(kind.to_owned()).or_default();
        state.owner = id;
        state.current = false;
        state.why = None;
        id
    }

    /// Runs `change` on `kind`'s entry if the watch `id` still owns it.
    fn owned(&self, kind: &str, id: WatchId, change: impl FnOnce(&mut WatchState)) {
        if let Some(state) = lock(&self.states).get_mut(kind)
            && state.owner == id
        {
            change(state);
        }
    }

    fn current(&self, kind: &str, id: WatchId) {
        self.owned(kind, id, |state| {
            state.current = true;
            state.why = None;
        });
    }

    fn stale(&self, kind: &str, id: WatchId, why: String) {
        self.owned(kind, id, |state| {
            state.current = false;
            state.restarts += 1;
            state.why = Some(why);
        });
    }

    /// The watch `id` of `kind` stopped for good: its entry goes, unless another watch of the
    /// kind owns it by now.
    fn forget(&self, kind: &str, id: WatchId) {
        let mut all = lock(&self.states);
        if all.get(kind).is_some_and(|state| state.owner == id) {
            all.remove(kind);
        }
    }

    /// The watches of [`SERVING_WATCHES`] that are stale now, and why: what holds readiness
    /// back. A workload kind's watch is not among them: the webhook's answers never read it,
    /// so one refused for good (a custom kind whose plural or RBAC is wrong, say) holds up only
    /// the controller's work for that kind, and is reported ([`Watches::stale_now`]).
    pub fn stale_serving(&self) -> Vec<String> {
        self.stale_where(|kind| SERVING_WATCHES.contains(&kind))
    }

    /// Marks the watch of `kind` stale, as one that failed (`stale`: true) or listed again.
    #[cfg(test)]
    pub(crate) fn set_stale_for_tests(&self, kind: &str, stale: bool) {
        let id = self.start(kind);
        if stale {
            self.stale(kind, id, "failed (a test)".to_owned());
        } else {
            self.current(kind, id);
        }
    }

    /// Whether a watch of one of `kinds` is known to be stale now (one never started is not).
    pub fn any_stale(&self, kinds: &[&str]) -> bool {
        let all = lock(&self.states);
        kinds
            .iter()
            .any(|kind| all.get(*kind).is_some_and(|s| !s.current))
    }

    /// The watches that are stale now, and why (empty: every cache is current).
    pub fn stale_now(&self) -> Vec<String> {
        self.stale_where(|_| true)
    }

    fn stale_where(&self, of: impl Fn(&str) -> bool) -> Vec<String> {
        lock(&self.states)
            .iter()
            .filter(|(k, s)| !s.current && of(k))
            .map(|(k, s)| match &s.why {
                Some(why) => format!("{k}: {why}"),
                None => format!("{k}: not listed yet"),
            })
            .collect()
    }

    /// How often each watch was restarted.
    pub fn restarts(&self) -> Vec<(String, u64)> {
        lock(&self.states)
            .iter()
            .map(|(k, s)| (k.clone(), s.restarts))
            .collect()
    }
}

/// Whether a cache that states of `kind`'s workloads are recorded from is known to be stale
/// now: the PersistentPodStates', the pods', the nodes' or that kind's.
pub fn recording_from_stale(watches: &Watches, kind: &GroupKind) -> bool {
    let workloads = watch_key(kind);
    let [pps, pods, nodes] = SERVING_WATCHES;
    watches.any_stale(&[pps, pods, nodes, workloads.as_str()])
}

/// How a workload kind's watch is named in [`Watches`].
fn watch_key(kind: &GroupKind) -> String {
    format!("{}/{}", kind.group, kind.kind)
}

/// The client configuration watches run with: `config` without the client's own retries of
/// 429, 503 and 504 answers, and with a read timeout of [`WATCH_SILENCE`].
///
/// kube's client retries those answers inside one request, up to 15 times over minutes: a
/// watch resumed while the API server's cache of its kind is not ready (429) then waited
/// silently, its cache behind while it still counted as current. Unretried, the answer reaches
/// the watch's supervisor: a listed watch is asked again from where it was for
/// [`WATCH_REFUSED_GRACE`], then its cache is marked stale (the replica unready for a
/// PersistentPodState, pod or node watch) and listed again after the backoff.
pub fn watch_config(mut config: kube::Config) -> kube::Config {
    config.default_retry = false;
    config.read_timeout = Some(WATCH_SILENCE);
    config
}

/// How long the API server keeps one watch open (`timeoutSeconds`): it sends a bookmark 2 s
/// before and ends it then, and the watch is asked again from where it was (on the same
/// connection). So a healthy API server sends something on every watch at least this often,
/// and one that sends nothing for longer has stopped answering, even where its kernel still
/// answers (TCP keepalive sees nothing wrong): the pods' watch ([`proto`]) is cut after
/// [`WATCH_SILENCE`]; kube-runtime's (the other kinds') is asked again after 65 s of silence
/// (its own bound: the timeout and 5 s), and that request fails as a cut at the connect (30 s)
/// or read ([`WATCH_SILENCE`]) timeout. A watch cut and asked again into an API server that
/// holds it marks its cache stale (the replica unready) after [`WATCH_RESUMED_SILENCE`]: about
/// 80 s after the API server hung (kube-runtime and client-go ask for 290 s and 5-10 minutes:
/// 330 s before). A streaming list not done within the timeout is listed in pages instead.
pub const WATCH_TIMEOUT_SECONDS: u32 = 60;

/// How long a watch's connection may bring nothing before the pods' watch is taken as cut, and
/// a read of the watches' client fails: the watch's timeout and [`WATCH_SILENCE_MARGIN`].
pub const WATCH_SILENCE: Duration =
    Duration::from_secs(WATCH_TIMEOUT_SECONDS as u64 + WATCH_SILENCE_MARGIN.as_secs());

/// Beyond a watch's timeout, how long its connection may stay silent: a loaded API server's
/// end of the watch may come late.
pub const WATCH_SILENCE_MARGIN: Duration = Duration::from_secs(15);

/// The options of every watch made through the client of [`watch_config`]: each watch ended by
/// the API server after [`WATCH_TIMEOUT_SECONDS`], well within that client's read timeout.
pub fn watcher_config() -> watcher::Config {
    watcher::Config::default().timeout(WATCH_TIMEOUT_SECONDS)
}

/// The options every watch of the caches is made with: [`watcher_config`], lists paginated
/// (`streaming`: a streaming list).
fn watch_options(streaming: bool) -> watcher::Config {
    let config = watcher_config();
    if streaming {
        config.streaming_lists()
    } else {
        config.page_size(PAGE_SIZE)
    }
}

/// First delay before a failed or ended watch is started again; doubled each time up to
/// [`WATCH_BACKOFF_MAX`], back to the first after a watch ran well for a minute.
const WATCH_BACKOFF: Duration = Duration::from_secs(1);
/// Longest delay before a watch is started again.
const WATCH_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Runs one watch for the life of the process (until the returned task is aborted; the
/// [`WatchId`] returned owns the kind's entry in `watches` from the call on), handing
/// each event to `apply`, supervised: when the watch fails (beyond a listed watch refused for
/// the moment or cut off, asked again from where it was for a grace: [`run_watch`]), ends, or
/// its task panics, it is marked stale in `watches` and started again (a full relist) after a backoff with jitter, or
/// at once when it expired after listing (410 Gone; once per [`WATCH_BACKOFF_MAX`]); it is
/// current again once relisted. A silent connection: [`WATCH_TIMEOUT_SECONDS`].
fn spawn_watch<K: Send + 'static>(
    kind: &str,
    source: impl Source<K>,
    apply: impl Fn(watcher::Event<K>) + Send + Sync + 'static,
    watches: Arc<Watches>,
    relist: Option<Relist<K>>,
) -> (tokio::task::JoinHandle<()>, WatchId) {
    let id = watches.start(kind);
    let kind = kind.to_owned();
    let apply = Arc::new(apply);
    let task = tokio::spawn(async move {
        let mut backoff = WATCH_BACKOFF;
        let listed = Arc::new(AtomicBool::new(false));
        let mut relisted_at_once: Option<tokio::time::Instant> = None;
        loop {
            let started = tokio::time::Instant::now();
            // Its own task, so that a panic while applying an event is a restart too; aborted
            // with this one.
            let run = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(run_watch(
                kind.clone(),
                source.clone(),
                apply.clone(),
                watches.clone(),
                id,
                listed.clone(),
                relist.clone(),
            )));
            let Stopped { why, relist_now } = match run.await {
                Ok(stopped) => stopped,
                Err(e) if e.is_panic() => Stopped::after("panicked".to_owned()),
                Err(e) => Stopped::after(e.to_string()),
            };
            watches.stale(&kind, id, why.clone());
            if started.elapsed() > Duration::from_secs(60) {
                backoff = WATCH_BACKOFF;
            }
            // At once at most once a backoff's length: a server that answers every watch 410
            // right after its list is not listed from back to back.
            if relist_now && relisted_at_once.is_none_or(|t| t.elapsed() >= WATCH_BACKOFF_MAX) {
                relisted_at_once = Some(tokio::time::Instant::now());
                tracing::info!(%kind, %why, "watch expired; listing again at once (the cache is stale until relisted)");
                continue;
            }
            let jittered = backoff.mul_f64(0.5 + jitter() / 2.0);
            tracing::warn!(%kind, %why, delay = ?jittered, "watch stopped; starting it again (the cache is stale until relisted)");
            tokio::time::sleep(jittered).await;
            backoff = (backoff * 2).min(WATCH_BACKOFF_MAX);
        }
    });
    (task, id)
}

/// A number in [0, 1), different each call.
fn jitter() -> f64 {
    let random = std::hash::BuildHasher::hash_one(
        &std::hash::RandomState::new(),
        std::time::SystemTime::now(),
    );
    (random % 1000) as f64 / 1000.0
}

/// Why a watch stopped, and whether to list again without the backoff.
struct Stopped {
    why: String,
    /// The watch had listed and then expired (410 Gone: its resource version is no longer
    /// served, after a compaction or the resource's storage replaced, as by a CRD update).
    /// Nothing is wrong with the API server: the relist starts at once instead of leaving the
    /// cache stale (and the replica unready) for a backoff. (A list that fails 410, its
    /// continue token expired, is a failure like any other: it waits for the backoff.)
    relist_now: bool,
}

impl Stopped {
    /// Stopped for `why`; started again after the backoff.
    fn after(why: String) -> Self {
        Self {
            why,
            relist_now: false,
        }
    }
}

/// Where a watch's events come from: kube-runtime's watcher of an [`Api`], or the pods' own
/// protobuf watch ([`proto::PodSource`]).
pub trait Source<K>: Clone + Send + Sync + 'static {
    /// The events of one list and watch under `config`. After an error, the stream goes on
    /// where it can (a listed watch refused for the moment or cut off is asked again from where
    /// it was) and ends where it cannot.
    fn events(
        &self,
        config: watcher::Config,
    ) -> futures::stream::BoxStream<'static, watcher::Result<watcher::Event<K>>>;
}

impl<K> Source<K> for Api<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    fn events(
        &self,
        config: watcher::Config,
    ) -> futures::stream::BoxStream<'static, watcher::Result<watcher::Event<K>>> {
        futures::StreamExt::boxed(watcher(self.clone(), config))
    }
}

/// Whether `error` says the watch's resource version is gone (HTTP 410).
fn expired(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

/// One watch, from its first list until it fails or ends; why it stopped. Told by `relist`
/// (the pods' watch: [`kept`]), it lists again aside for `relist.fill`, its watch running on.
///
/// Until the watch has once been listed (`listed`), its list is a streaming list: a watch that
/// first sends every object from the API server's watch cache, decoded as it arrives, and ends
/// them with a bookmark (the pods' source reads one whole list from that cache instead, pod
/// by pod as it arrives: `proto.rs`). Where the API server refuses that, and for every relist
/// once the cache holds objects, the list is paginated (500 objects a page) and consistent: a
/// streaming list (or the pods' whole list) is served at whatever version the API server's
/// watch cache has (kube-runtime asks from resourceVersion 0), which after a failure could be
/// older than what the cache already holds.
async fn run_watch<K>(
    kind: String,
    source: impl Source<K>,
    apply: Arc<impl Fn(watcher::Event<K>) + Send + Sync + 'static>,
    watches: Arc<Watches>,
    id: WatchId,
    listed: Arc<AtomicBool>,
    mut relist: Option<Relist<K>>,
) -> Stopped {
    // When the next list made aside may begin ([`aside_pause`] after the last one ended).
    let mut aside_next: Option<tokio::time::Instant> = None;
    loop {
        let streaming =
            !listed.load(Ordering::Relaxed) && !watches.paginate.load(Ordering::Relaxed);
        let config = watch_options(streaming);
        // What the watch was told to read when this list began (the pods' watch: the
        // generation of the annotations kept, [`kept`]).
        let mut asked = relist.as_mut().map_or(0, |r| *r.told.borrow_and_update());
        let mut events = source.events(config);
        // A list made aside, once told to list again: the watch runs on meanwhile.
        let mut aside: Option<Aside<K>> = None;
        let (mut started, mut objects) = (tokio::time::Instant::now(), 0u64);
        let mut listed_here = false;
        // Whether this list has begun (a streaming list begun again: see below).
        let mut began = false;
        let (mut refused, mut cut) = (Refused::default(), Refused::default());
        // When the watch was last asked again after a cut, until it brings an event.
        let mut resumed: Option<tokio::time::Instant> = None;
        loop {
            let listing_aside = aside.is_some();
            let next = tokio::select! {
                biased;
                // Told to list again once listed (a list under way when told is listed again
                // once done, and lists aside are [`aside_pause`] apart): listed aside, for
                // `relist.fill`, the watch running on as it was.
                now = asked_again(
                    relist.as_mut().map(|r| &mut r.told),
                    asked,
                    listed_here && !listing_aside,
                    aside_next,
                ) => {
                    tracing::info!(%kind, "listing again aside, to read what is kept now");
                    aside = Some(Aside {
                        events: source.events(watch_options(false)),
                        started: tokio::time::Instant::now(),
                        objects: 0,
                        generation: now,
                    });
                    continue;
                }
                next = events.try_next() => next,
                next = next_aside(aside.as_mut()) => {
                    match next {
                        Ok(Some(ev)) => {
                            let done = matches!(ev, watcher::Event::InitDone);
                            if let (watcher::Event::InitApply(_), Some(a)) = (&ev, aside.as_mut()) {
                                a.objects += 1;
                            }
                            if let Some(r) = &relist {
                                (r.fill)(ev);
                            }
                            // Its list done, the list made aside is dropped (its watch unused).
                            if let Some(a) = aside.take_if(|_| done) {
                                tracing::info!(%kind, objects = a.objects, seconds = a.started.elapsed().as_secs_f64(), "listed aside");
                                asked = a.generation;
                                aside_next = Some(tokio::time::Instant::now() + aside_pause(Some(a.started.elapsed())));
                            }
                        }
                        // Failed or ended before its end: dropped, made again after the pause;
                        // the watch runs on.
                        failed => {
                            let why = failed.err().map_or("it ended".to_owned(), |e| e.to_string());
                            tracing::warn!(%kind, %why, "the list made aside failed; listing again aside after a pause");
                            aside = None;
                            aside_next = Some(tokio::time::Instant::now() + aside_pause(None));
                        }
                    }
                    continue;
                }
                // A watch asked again after a cut must show it runs: an API server still
                // starting has been seen to hold a pod watch from an older version for a
                // minute, the cache meanwhile counting as current. Silent past the bound, it
                // is listed again (as before the cut was resumed at all).
                () = until(resumed.map(|at| at + WATCH_RESUMED_SILENCE)) => {
                    return Stopped::after(format!(
                        "the watch asked again after a cut brought nothing for {} s",
                        WATCH_RESUMED_SILENCE.as_secs()
                    ));
                }
            };
            match next {
                Ok(Some(ev)) => {
                    // An event: the watch runs.
                    resumed = None;
                    refused.ran();
                    cut.ran();
                    match ev {
                        // A streaming list begun again before its end: the API server ended
                        // it at the watch's timeout (or it expired), and kube-runtime starts
                        // it over without a word, as often. Pages are not bound by that
                        // timeout.
                        watcher::Event::Init if streaming && began && !listed_here => {
                            tracing::warn!(%kind, objects, seconds = started.elapsed().as_secs_f64(), "the streaming list began again before its end (not done within the watch's timeout, {WATCH_TIMEOUT_SECONDS} s); lists are paginated from now on");
                            watches.paginate.store(true, Ordering::Relaxed);
                            break;
                        }
                        watcher::Event::Init => {
                            began = true;
                            (started, objects) = (tokio::time::Instant::now(), 0)
                        }
                        watcher::Event::InitApply(_) => objects += 1,
                        _ => {}
                    }
                    let done = matches!(ev, watcher::Event::InitDone);
                    apply(ev);
                    if done {
                        tracing::info!(%kind, objects, seconds = started.elapsed().as_secs_f64(), paginated = !streaming, "listed");
                        listed.store(true, Ordering::Relaxed);
                        listed_here = true;
                        watches.current(&kind, id);
                    }
                }
                Ok(None) => return Stopped::after("the watch ended".to_owned()),
                // The streaming list's request refused as invalid (not a later watch's: this
                // one has not listed yet).
                Err(watcher::Error::WatchStartFailed(kube::Error::Api(status)))
                    if streaming && !listed.load(Ordering::Relaxed) && status.is_invalid() =>
                {
                    // Its message is not logged: it names the refused options as "Forbidden",
                    // which reads as an RBAC refusal.
                    tracing::info!(%kind, code = status.code, reason = %status.reason, "the API server does not serve streaming lists (before v1.34, or its WatchList feature gate off); lists are paginated from now on");
                    watches.paginate.store(true, Ordering::Relaxed);
                    break;
                }
                // Refused for the moment after listing: asked again from where it was.
                Err(error)
                    if listed_here
                        && refused_for_now(&error)
                        && refused.again(WATCH_REFUSED_GRACE) =>
                {
                    tracing::info!(%kind, why = %error, "watch refused for the moment; resuming it from where it was");
                    tokio::time::sleep(WATCH_REFUSED_PAUSE).await;
                    // Refused after a cut: the watch asked again next is held to the bound too.
                    if resumed.is_some() {
                        resumed = Some(tokio::time::Instant::now());
                    }
                }
                // Its connection cut after listing (an API server going away behind a load
                // balancer, a connection reset): asked again from where it was, as client-go's
                // reflector does, rather than listed again (seconds at 100,000 pods).
                Err(error) if listed_here && cut_off(&error) && cut.again(WATCH_CUT_GRACE) => {
                    if cut.first() {
                        tracing::info!(%kind, why = %error, "watch cut; resuming it from where it was");
                    } else {
                        tracing::debug!(%kind, why = %error, "watch still cut; asking again");
                    }
                    tokio::time::sleep(WATCH_CUT_PAUSE).await;
                    resumed = Some(tokio::time::Instant::now());
                }
                Err(error) => {
                    return Stopped {
                        relist_now: listed_here && expired(&error),
                        why: format!("the watch failed: {error}"),
                    };
                }
            }
        }
    }
}

/// Resolves at `deadline`, never without one.
async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Resolves, with its value, once `relist` has risen past `asked`, while `ready`, not before
/// `not_before`.
async fn asked_again(
    relist: Option<&mut watch::Receiver<u64>>,
    asked: u64,
    ready: bool,
    not_before: Option<tokio::time::Instant>,
) -> u64 {
    let Some(rx) = relist.filter(|_| ready) else {
        return std::future::pending().await;
    };
    loop {
        let now = *rx.borrow_and_update();
        if now > asked {
            if let Some(at) = not_before {
                tokio::time::sleep_until(at).await;
            }
            return now;
        }
        if rx.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// What tells a watch to list again aside, and what is done with the events of that list
/// (`Init`, `InitApply`..., `InitDone`): the pods', to read annotations named since they were
/// cached ([`Caches::fill_pod_annotations`]).
pub struct Relist<K> {
    told: watch::Receiver<u64>,
    fill: Arc<dyn Fn(watcher::Event<K>) + Send + Sync>,
}

impl<K> Clone for Relist<K> {
    fn clone(&self) -> Self {
        Self {
            told: self.told.clone(),
            fill: self.fill.clone(),
        }
    }
}

/// A list made aside while the watch runs on ([`run_watch`]).
struct Aside<K> {
    events: futures::stream::BoxStream<'static, watcher::Result<watcher::Event<K>>>,
    started: tokio::time::Instant,
    objects: u64,
    /// What the watch was told when it began.
    generation: u64,
}

/// The next event of the list made aside; never without one.
async fn next_aside<K>(aside: Option<&mut Aside<K>>) -> watcher::Result<Option<watcher::Event<K>>> {
    match aside {
        Some(a) => a.events.try_next().await,
        None => std::future::pending().await,
    }
}

/// The most time between the end of a list made aside and the start of the next
/// ([`aside_pause`]: lists that take three seconds or more are this far apart), and the time
/// after one that failed.
const ASIDE_PAUSE: Duration = Duration::from_secs(30);

/// The least time between the end of a list made aside and the start of the next.
const ASIDE_PAUSE_MIN: Duration = Duration::from_secs(1);

/// The pause after a list made aside that `took` this long (`None`: it failed): ten times it,
/// from [`ASIDE_PAUSE_MIN`] to [`ASIDE_PAUSE`]. Lists made one after another so take at most
/// about a tenth of the time, and a small cluster's next new annotation is read within a
/// second or so, a large one's (100,000 pods listed in seconds) within the whole pause.
fn aside_pause(took: Option<Duration>) -> Duration {
    took.map_or(ASIDE_PAUSE, |took| {
        took.saturating_mul(10).clamp(ASIDE_PAUSE_MIN, ASIDE_PAUSE)
    })
}

/// How long a listed watch refused for the moment (429, 503, 504: the API server's cache of its
/// kind being filled again, after a change of its CRD or a restart) is asked again from where it
/// was, before its cache is taken as stale and listed again: meanwhile the cache may be this
/// much behind, and still counts as current.
const WATCH_REFUSED_GRACE: Duration = Duration::from_secs(10);
/// The pause before such a watch is asked again.
const WATCH_REFUSED_PAUSE: Duration = Duration::from_secs(1);

/// Whether `error` is a watch's request refused for the moment.
fn refused_for_now(error: &watcher::Error) -> bool {
    matches!(error, watcher::Error::WatchStartFailed(kube::Error::Api(status))
        if matches!(status.code, 429 | 503 | 504))
}

/// How long a listed watch whose connection is cut, or cannot be made, is asked again from
/// where it was before its cache is taken as stale (the replica unready) and listed again:
/// long enough for a load balancer to send it to another API server, short enough that an
/// API server that is down makes the replica unready within seconds.
const WATCH_CUT_GRACE: Duration = Duration::from_secs(3);
/// The pause before such a watch is asked again.
const WATCH_CUT_PAUSE: Duration = Duration::from_millis(250);
/// How long a watch asked again after a cut may bring nothing (no event, no error) before it
/// is listed again: a quiet kind is listed again after a cut, as it was before cuts were
/// resumed; pods, which change all the time in a cluster, are not.
const WATCH_RESUMED_SILENCE: Duration = Duration::from_secs(5);

/// Whether `error` is a watch's connection failing (not an answer of the API server, nor
/// something unreadable in what it sent).
fn cut_off(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => transport_failed(e),
        _ => false,
    }
}

/// Whether `error` is a request's connection failing: not made, reset, or its body cut.
pub(crate) fn transport_failed(error: &kube::Error) -> bool {
    match error {
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        kube::Error::ReadEvents(e) => e.kind() != std::io::ErrorKind::InvalidData,
        _ => false,
    }
}

/// The failures of one kind of a watch: an episode starts with the first failure after an
/// event, or after a minute without one (a watch runs until its timeout, a minute: failures
/// closer together left no watch running between them, however slowly each came).
#[derive(Default)]
struct Refused {
    since: Option<tokio::time::Instant>,
    last: Option<tokio::time::Instant>,
}

/// Failures further apart than this are two episodes: a watch may have run between them.
const WATCH_EPISODE_GAP: Duration = Duration::from_secs(WATCH_TIMEOUT_SECONDS as u64);

impl Refused {
    /// The watch brought an event: it runs; the next failure begins an episode.
    fn ran(&mut self) {
        *self = Self::default();
    }

    /// Counts one more failure; whether its episode is still within `grace`.
    fn again(&mut self, grace: Duration) -> bool {
        let now = tokio::time::Instant::now();
        if self
            .last
            .is_none_or(|last| now.duration_since(last) > WATCH_EPISODE_GAP)
        {
            self.since = Some(now);
        }
        self.last = Some(now);
        self.since
            .is_some_and(|since| now.duration_since(since) < grace)
    }

    /// Whether the failure last counted began its episode.
    fn first(&self) -> bool {
        self.since == self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Waits (a bounded number of scheduler turns) until `done` holds.
    async fn until(what: &str, done: impl Fn() -> bool) {
        for _ in 0..10_000 {
            if done() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("{what} never happened");
    }

    /// Answers `respond` with an internal error saying `message`.
    fn respond_500(
        respond: tower_test::mock::SendResponse<http::Response<kube::client::Body>>,
        message: &str,
    ) {
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": message, "code": 500});
        self::respond(respond, 500, status);
    }

    fn respond(
        respond: tower_test::mock::SendResponse<http::Response<kube::client::Body>>,
        status: u16,
        body: serde_json::Value,
    ) {
        respond.send_response(crate::test_api::json_response(status, &body));
    }

    type MockHandle = tower_test::mock::Handle<
        http::Request<kube::client::Body>,
        http::Response<kube::client::Body>,
    >;

    /// A client talking to a mock API server, and fresh watch states.
    fn mock_watch() -> (Client, MockHandle, Arc<Watches>) {
        let (service, handle) = tower_test::mock::pair();
        (Client::new(service, "default"), handle, Arc::default())
    }

    /// A watch answered 429 (the API server's cache of its kind not ready) fails at that first
    /// answer, so its cache is marked stale at once. kube's client, left to retry, would send
    /// it again up to 15 times over minutes, the cache counting as current meanwhile. (The
    /// API server here is a socket answering every request 429: the client's retries live in
    /// the layers a real connection goes through, which a mock service bypasses.)
    #[tokio::test]
    async fn a_watch_answered_429_is_stale_at_the_first_answer() {
        use std::sync::atomic::AtomicUsize;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let requests = Arc::new(AtomicUsize::new(0));
        let answered = requests.clone();
        let server = tokio::spawn(async move {
            let body = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": "storage is (re)initializing", "reason": "TooManyRequests",
                "code": 429})
            .to_string();
            let answer = format!(
                "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\n\r\n{body}",
                body.len()
            );
            while let Ok((mut stream, _)) = listener.accept().await {
                let (answered, answer) = (answered.clone(), answer.clone());
                tokio::spawn(async move {
                    let (mut head, mut buf) = (Vec::new(), [0u8; 4096]);
                    // Requests without a body (GETs), one after another on the connection.
                    while let Ok(n @ 1..) = stream.read(&mut buf).await {
                        head.extend_from_slice(&buf[..n]);
                        while let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                            head.drain(..end + 4);
                            answered.fetch_add(1, Ordering::SeqCst);
                            if stream.write_all(answer.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        let url = format!("http://{address}").parse().expect("URL");
        let client = Client::try_from(watch_config(kube::Config::new(url))).expect("client");
        let watches = Arc::<Watches>::default();
        let (task, _) = spawn_watch(
            "Node",
            Api::<Node>::all(client),
            |_| {},
            watches.clone(),
            None,
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !watches.stale_now().iter().any(|w| w.contains("429")) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no failure reached the watch after {} requests: {:?}",
                requests.load(Ordering::SeqCst),
                watches.stale_now()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The next attempt waits for the supervisor's backoff (at least 0.5 s).
        assert_eq!(requests.load(Ordering::SeqCst), 1, "not retried");
        task.abort();
        server.abort();
    }

    /// As [`mock_watch`], for an API server known to refuse streaming lists.
    fn mock_paginated_watch() -> (Client, MockHandle, Arc<Watches>) {
        let (client, handle, watches) = mock_watch();
        watches.paginate.store(true, Ordering::Relaxed);
        (client, handle, watches)
    }

    /// Waits until every watch in `watches` is current (listed again).
    async fn current_again(watches: &Watches) {
        until("the watch to be current again", || {
            watches.stale_now().is_empty()
        })
        .await;
    }

    /// An empty node list at resourceVersion 1.
    fn node_list() -> serde_json::Value {
        json!({"kind": "NodeList", "apiVersion": "v1",
            "metadata": {"resourceVersion": "1"}, "items": []})
    }

    /// A node watch on a mock API server, past its first list ([`node_list`]).
    async fn listed_node_watch() -> (MockHandle, Arc<Watches>, tokio::task::JoinHandle<()>) {
        let (client, mut handle, watches) = mock_paginated_watch();
        let (task, _) = spawn_watch(
            "Node",
            Api::<Node>::all(client),
            |_| {},
            watches.clone(),
            None,
        );
        let (_, answer) = handle.next_request().await.expect("the first list");
        respond(answer, 200, node_list());
        (handle, watches, task)
    }

    #[test]
    fn deleted_nodes_are_remembered_as_last_seen_until_seen_again_and_at_most_so_many() {
        let caches = Caches::new();
        let node = |name: &str| -> Node {
            serde_json::from_value(json!({"metadata": {"name": name, "labels": {"id": name}}}))
                .expect("node")
        };
        let gone = |caches: &Caches| -> Vec<String> {
            caches.gone().iter().map(|n| n.name_any()).collect()
        };
        caches.apply_node(watcher::Event::Apply(node("n1")));
        assert!(gone(&caches).is_empty());
        caches.apply_node(watcher::Event::Delete(node("n1")));
        assert_eq!(gone(&caches), ["n1"]);
        assert_eq!(
            caches.gone()[0].labels().get("id").map(String::as_str),
            Some("n1")
        );
        // Registered again: not gone.
        caches.apply_node(watcher::Event::InitApply(node("n1")));
        assert!(gone(&caches).is_empty());
        // Deleted while the watch was down: the relist that no longer lists it tells.
        caches.apply_node(watcher::Event::Apply(node("n2")));
        caches.apply_node(watcher::Event::Init);
        caches.apply_node(watcher::Event::InitApply(node("n1")));
        caches.apply_node(watcher::Event::InitDone);
        assert_eq!(gone(&caches), ["n2"]);
        assert!(caches.node("n2").is_none() && caches.node("n1").is_some());
        caches.apply_node(watcher::Event::Apply(node("n2")));
        for i in 0..GONE_NODES_KEPT + 5 {
            caches.apply_node(watcher::Event::Delete(node(&format!("d{i}"))));
        }
        let kept = gone(&caches);
        assert_eq!(kept.len(), GONE_NODES_KEPT);
        assert_eq!(
            kept.first().map(String::as_str),
            Some("d5"),
            "the oldest let go"
        );
    }

    #[test]
    fn lists_aside_pause_ten_times_what_the_last_took_within_bounds() {
        let pause = |ms: u64| aside_pause(Some(Duration::from_millis(ms)));
        assert_eq!(pause(0), ASIDE_PAUSE_MIN);
        assert_eq!(pause(40), ASIDE_PAUSE_MIN);
        assert_eq!(pause(500), Duration::from_secs(5));
        assert_eq!(pause(2_000), Duration::from_secs(20));
        assert_eq!(pause(6_000), ASIDE_PAUSE);
        assert_eq!(aside_pause(Some(Duration::MAX)), ASIDE_PAUSE);
        assert_eq!(aside_pause(None), ASIDE_PAUSE);
    }

    /// A listed watch told to list again (the pods', a PersistentPodState having named an
    /// annotation not kept before) lists aside for its `fill`, its watch running on as it was
    /// (its events applied meanwhile, the cache current throughout). Told again while that list
    /// is under way, it lists once more, [`aside_pause`] after it (ten times what the list took);
    /// a list aside that fails is made again after the whole [`ASIDE_PAUSE`], the watch
    /// untouched.
    #[tokio::test(start_paused = true)]
    async fn a_listed_watch_told_to_list_again_lists_aside_and_runs_on() {
        let (client, mut handle, watches) = mock_paginated_watch();
        let (tell, told) = watch::channel(0u64);
        let (applied, filled) = (
            Arc::new(Mutex::new(Vec::new())),
            Arc::new(Mutex::new(Vec::new())),
        );
        let (seen, listed) = (applied.clone(), filled.clone());
        let name = |ev: &watcher::Event<Node>| match ev {
            watcher::Event::Apply(n) | watcher::Event::InitApply(n) => n.name_any(),
            watcher::Event::Delete(_) => "deleted".to_owned(),
            watcher::Event::Init => "init".to_owned(),
            watcher::Event::InitDone => "done".to_owned(),
        };
        let (task, _) = spawn_watch(
            "Node",
            Api::<Node>::all(client),
            move |ev| lock(&seen).push(name(&ev)),
            watches.clone(),
            Some(Relist {
                told,
                fill: Arc::new(move |ev| lock(&listed).push(name(&ev))),
            }),
        );
        // The next request, within a bound (a watch never told would hang the test).
        async fn next(
            handle: &mut MockHandle,
        ) -> (
            http::Request<kube::client::Body>,
            tower_test::mock::SendResponse<http::Response<kube::client::Body>>,
        ) {
            tokio::time::timeout(Duration::from_secs(120), handle.next_request())
                .await
                .expect("a request in time")
                .expect("the client is alive")
        }
        let is_watch = |r: &http::Request<kube::client::Body>| {
            r.uri().query().unwrap_or_default().contains("watch=true")
        };
        let (request, answer) = next(&mut handle).await;
        assert!(!is_watch(&request));
        respond(answer, 200, node_list());
        let (request, first_watch) = next(&mut handle).await;
        assert!(is_watch(&request), "{}", request.uri());
        current_again(&watches).await;

        tell.send_replace(1);
        let (request, aside_list) = next(&mut handle).await;
        assert!(!is_watch(&request), "a list: {}", request.uri());
        // The watch brings an event while the list is under way: applied (its stream ended,
        // it is watched again from where it was).
        watch_event(
            first_watch,
            &json!({"type": "ADDED", "object": {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "n1", "resourceVersion": "2"}}}),
        );
        let (request, _rewatch) = next(&mut handle).await;
        assert!(is_watch(&request), "{}", request.uri());
        assert!(
            request
                .uri()
                .query()
                .unwrap_or_default()
                .contains("resourceVersion=2"),
            "{}",
            request.uri()
        );
        // Told again while that list is under way.
        tell.send_replace(2);
        let mut n1 = node_list();
        n1["metadata"]["resourceVersion"] = json!("2");
        n1["items"] = json!([{"metadata": {"name": "n1", "resourceVersion": "2"}}]);
        // The list took 2 s.
        tokio::time::advance(Duration::from_secs(2)).await;
        respond(aside_list, 200, n1.clone());
        let ended = tokio::time::Instant::now();
        // No watch of its own: the next request is the next list, 20 s after (ten times what
        // the list took). It fails: made again after the whole pause, the watch untouched.
        let (request, again) = next(&mut handle).await;
        assert!(!is_watch(&request), "listed again: {}", request.uri());
        let waited = ended.elapsed();
        assert!(
            waited >= Duration::from_secs(20) && waited < ASIDE_PAUSE,
            "{waited:?}"
        );
        respond_500(again, "etcd is slow");
        let failed = tokio::time::Instant::now();
        let (request, again) = next(&mut handle).await;
        assert!(!is_watch(&request), "listed again: {}", request.uri());
        assert!(failed.elapsed() >= ASIDE_PAUSE, "{:?}", failed.elapsed());
        respond(again, 200, n1);
        until("the third list aside to end", || lock(&filled).len() >= 7).await;
        assert_eq!(
            *lock(&applied),
            ["init", "done", "n1"],
            "the watch's own events"
        );
        assert_eq!(
            *lock(&filled),
            ["init", "n1", "done", "init", "init", "n1", "done"],
            "each list aside's (the failed one's start too)"
        );
        assert!(watches.stale_now().is_empty(), "current throughout");
        assert_eq!(
            watches.restarts(),
            vec![("Node".to_owned(), 0)],
            "never restarted"
        );
        task.abort();
    }

    /// The next request, once the watch asked again (just now) has been silent: a list (not a
    /// watch), no sooner than [`WATCH_RESUMED_SILENCE`]; its answer.
    async fn relisted_once_silent(
        handle: &mut MockHandle,
    ) -> tower_test::mock::SendResponse<http::Response<kube::client::Body>> {
        let asked = tokio::time::Instant::now();
        let (request, answer) = handle.next_request().await.expect("the relist");
        assert!(
            !request.uri().to_string().contains("watch=true"),
            "{}",
            request.uri()
        );
        assert!(
            asked.elapsed() >= WATCH_RESUMED_SILENCE,
            "{:?}",
            asked.elapsed()
        );
        answer
    }

    /// A connection reset, as a watch's request fails when cut.
    fn cut() -> std::io::Error {
        std::io::Error::from(std::io::ErrorKind::ConnectionReset)
    }

    /// The answer of an API server whose cache of the kind is being filled again.
    fn storage_initializing() -> serde_json::Value {
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": "storage is (re)initializing", "reason": "TooManyRequests", "code": 429})
    }

    /// The end of a streaming list: a bookmark carrying `initial-events-end`.
    fn initial_events_end(
        respond: tower_test::mock::SendResponse<http::Response<kube::client::Body>>,
    ) {
        let event = json!({"type": "BOOKMARK", "object": {"kind": "Node", "apiVersion": "v1",
            "metadata": {"resourceVersion": "7",
                "annotations": {"k8s.io/initial-events-end": "true"}}}});
        watch_event(respond, &event);
    }

    /// A watch answered with one `event`, its stream left open.
    fn watch_event(
        respond: tower_test::mock::SendResponse<http::Response<kube::client::Body>>,
        event: &serde_json::Value,
    ) {
        respond.send_response(
            http::Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .body(kube::client::Body::from(format!("{event}\n").into_bytes()))
                .expect("response"),
        );
    }

    /// A watch of Nodes, and whether its list is done.
    fn watch_nodes(
        client: Client,
        watches: &Arc<Watches>,
    ) -> (Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
        let listed = Arc::new(AtomicBool::new(false));
        let done = listed.clone();
        let (task, _) = spawn_watch(
            "Node",
            Api::<Node>::all(client),
            move |ev| {
                if matches!(ev, watcher::Event::InitDone) {
                    done.store(true, Ordering::SeqCst);
                }
            },
            watches.clone(),
            None,
        );
        (listed, task)
    }

    #[test]
    fn only_the_watches_the_webhook_reads_hold_readiness_back() {
        let watches = Watches::default();
        let mut ids = BTreeMap::new();
        for kind in SERVING_WATCHES {
            let id = watches.start(kind);
            watches.current(kind, id);
            ids.insert(kind, id);
        }
        let custom = watch_key(&GroupKind::new("example.com", "Proxy"));
        let id = watches.start(&custom);
        watches.stale(&custom, id, "the list failed: 403 Forbidden".into());
        assert!(
            watches.stale_serving().is_empty(),
            "a workload kind's watch"
        );
        assert_eq!(watches.stale_now().len(), 1, "reported all the same");
        watches.stale("Pod", ids["Pod"], "the watch failed".into());
        assert_eq!(watches.stale_serving(), ["Pod: the watch failed"]);
    }

    /// A kind's watch replaced (another version of it) or removed (its CRD gone) may still
    /// report as it is aborted: neither its successor's entry nor a forgotten kind's changes.
    #[test]
    fn a_stopped_watch_changes_neither_its_successor_nor_a_forgotten_kind() {
        let watches = Watches::default();
        let kind = watch_key(&GroupKind::new("example.com", "Proxy"));
        let old = watches.start(&kind);
        assert_eq!(watches.stale_now(), [format!("{kind}: not listed yet")]);
        watches.current(&kind, old);
        assert!(watches.stale_now().is_empty());
        // Replaced: the new watch lists; the old one, aborted, reports its end late.
        let new = watches.start(&kind);
        watches.current(&kind, new);
        watches.stale(&kind, old, "the watch ended".into());
        assert!(watches.stale_now().is_empty(), "{:?}", watches.stale_now());
        // The old one's forgetting leaves the new one's entry.
        watches.forget(&kind, old);
        watches.stale(&kind, new, "the watch failed".into());
        assert_eq!(watches.stale_now(), [format!("{kind}: the watch failed")]);
        // Removed: forgotten, and a late report of its end does not bring it back.
        watches.forget(&kind, new);
        watches.stale(&kind, new, "the watch ended".into());
        watches.current(&kind, new);
        assert!(watches.stale_now().is_empty(), "{:?}", watches.stale_now());
        assert!(watches.restarts().is_empty());
    }

    #[test]
    fn a_node_event_that_changes_nothing_kept_leaves_the_node_change_count() {
        let caches = Caches::new();
        let node = |version: &str, ready: &str, memory: &str| {
            serde_json::from_value::<Node>(json!({
                "metadata": {"name": "n1", "resourceVersion": version, "labels": {"zone": "z1"}},
                "status": {"conditions": [{"type": "Ready", "status": ready},
                    {"type": "MemoryPressure", "status": memory}]}}))
            .expect("node")
        };
        caches.apply_node(watcher::Event::Apply(node("1", "True", "False")));
        let first = caches.nodes_changed();
        assert!(first > 0, "a new node");
        caches.apply_node(watcher::Event::Apply(node("2", "True", "True")));
        assert_eq!(
            caches.nodes_changed(),
            first,
            "a new version, and a condition placement does not read"
        );
        caches.apply_node(watcher::Event::Apply(node("3", "False", "True")));
        assert_eq!(caches.nodes_changed(), first + 1, "Ready changed");
        let mut tainted = node("4", "False", "True");
        tainted.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
            unschedulable: Some(true),
            ..Default::default()
        });
        caches.apply_node(watcher::Event::Apply(tainted));
        assert_eq!(caches.nodes_changed(), first + 2, "cordoned");
        caches.apply_node(watcher::Event::Delete(node("5", "False", "True")));
        assert_eq!(caches.nodes_changed(), first + 3, "deleted");
    }

    /// A streaming list the API server ends before its end (not done within the watch's
    /// timeout) is begun again by kube-runtime without a word, for ever at that size: it is
    /// listed in pages instead, which that timeout does not bound.
    #[tokio::test(start_paused = true)]
    async fn a_streaming_list_ended_before_its_end_is_listed_in_pages() {
        let (client, mut handle, watches) = mock_watch();
        let (listed, task) = watch_nodes(client, &watches);
        let node = json!({"type": "ADDED", "object": {"kind": "Node", "apiVersion": "v1",
            "metadata": {"name": "a", "resourceVersion": "5"}}});
        for _ in 0..2 {
            let (request, answer) = handle.next_request().await.expect("the streaming list");
            let uri = request.uri().to_string();
            assert!(uri.contains("sendInitialEvents=true"), "{uri}");
            // One object, then the end of the answer, no end of the list.
            watch_event(answer, &node);
        }
        let (request, _answer) = handle.next_request().await.expect("the list in pages");
        let uri = request.uri().to_string();
        assert!(
            !uri.contains("watch=true") && uri.contains("limit=500"),
            "{uri}"
        );
        assert!(watches.paginate.load(Ordering::Relaxed));
        assert!(!listed.load(Ordering::SeqCst));
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_list_is_streamed_and_a_relist_after_a_failure_is_paginated_and_consistent() {
        let (client, mut handle, watches) = mock_watch();
        let (listed, task) = watch_nodes(client, &watches);
        let (request, answer) = handle.next_request().await.expect("the streaming list");
        let uri = request.uri().to_string();
        // Every watch is ended by the API server within a minute (`WATCH_TIMEOUT_SECONDS`).
        assert!(
            uri.contains("watch=true")
                && uri.contains("sendInitialEvents=true")
                && uri.contains("timeoutSeconds=60"),
            "{uri}"
        );
        initial_events_end(answer);
        until("the list to be done", || listed.load(Ordering::SeqCst)).await;
        assert!(watches.stale_now().is_empty(), "{:?}", watches.stale_now());
        // The stream ended after the bookmark; the watch resumed from it fails.
        let (request, answer) = handle.next_request().await.expect("the resumed watch");
        let uri = request.uri().to_string();
        assert!(
            uri.contains("watch=true")
                && !uri.contains("sendInitialEvents")
                && uri.contains("timeoutSeconds=60"),
            "{uri}"
        );
        respond_500(answer, "etcd is gone");
        // The relist after the backoff: consistent and paginated, not from the watch cache.
        let (request, _answer) = handle.next_request().await.expect("the relist");
        let uri = request.uri().to_string();
        assert!(
            !uri.contains("watch=true") && uri.contains("limit=500"),
            "{uri}"
        );
        assert!(!uri.contains("resourceVersion=0"), "{uri}");
        assert!(
            !watches.paginate.load(Ordering::Relaxed),
            "streaming is not refused"
        );
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_streaming_list_is_paginated_at_once_and_from_then_on() {
        let (client, mut handle, watches) = mock_watch();
        let (listed, task) = watch_nodes(client, &watches);
        let (request, answer) = handle.next_request().await.expect("the streaming list");
        assert!(request.uri().to_string().contains("sendInitialEvents=true"));
        // v1.20-v1.33 (or the WatchList gate off) answer 422 Invalid.
        respond(
            answer,
            422,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid",
            "message": "ListOptions.meta.k8s.io \"\" is invalid: sendInitialEvents: Forbidden",
            "code": 422}),
        );
        // No backoff, no restart counted: the paginated list comes next.
        let (request, answer) = handle.next_request().await.expect("a paginated list");
        let uri = request.uri().to_string();
        assert!(
            !uri.contains("watch=true") && uri.contains("limit=500"),
            "{uri}"
        );
        respond(
            answer,
            200,
            json!({"kind": "NodeList", "apiVersion": "v1",
                "metadata": {"resourceVersion": "1"}, "items": []}),
        );
        until("the list to be done", || listed.load(Ordering::SeqCst)).await;
        assert_eq!(watches.restarts(), [("Node".to_owned(), 0)]);
        assert!(
            watches.paginate.load(Ordering::Relaxed),
            "remembered for relists"
        );
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_watch_goes_stale_and_is_current_again_once_relisted() {
        let (client, mut handle, watches) = mock_paginated_watch();
        let (task, _) = spawn_watch(
            "Node",
            Api::<Node>::all(client),
            |_| {},
            watches.clone(),
            None,
        );
        let list = json!({"kind": "NodeList", "apiVersion": "v1",
            "metadata": {"resourceVersion": "1"}, "items": []});
        let (request, answer) = handle.next_request().await.expect("the first list");
        assert!(
            !request.uri().to_string().contains("watch=true"),
            "{}",
            request.uri()
        );
        respond(answer, 200, list.clone());
        // The watch after the list fails.
        let (request, answer) = handle.next_request().await.expect("the watch");
        assert!(
            request.uri().to_string().contains("watch=true"),
            "{}",
            request.uri()
        );
        assert!(watches.stale_now().is_empty(), "current once listed");
        respond_500(answer, "etcd is gone");
        until("the watch to go stale", || !watches.stale_now().is_empty()).await;
        assert!(
            watches.stale_now()[0].starts_with("Node: the watch failed"),
            "{:?}",
            watches.stale_now()
        );
        // Started again after the backoff: a full list, then current again.
        let (request, answer) = handle.next_request().await.expect("a new list");
        assert!(
            !request.uri().to_string().contains("watch=true"),
            "{}",
            request.uri()
        );
        respond(answer, 200, list);
        current_again(&watches).await;
        assert_eq!(watches.restarts(), [("Node".to_owned(), 1)]);
        task.abort();
    }

    /// Answers every watch of [`listed_node_watch`] 429, each `slowly` after it was asked,
    /// until it is listed again (each asked from its version, current within the grace); then
    /// current again. How many times it was asked.
    async fn refused_until_relisted(
        handle: &mut MockHandle,
        watches: &Watches,
        slowly: Duration,
    ) -> usize {
        let (list, refused) = (node_list(), storage_initializing());
        let first = tokio::time::Instant::now();
        let mut watches_asked = 0;
        loop {
            let (request, answer) = handle.next_request().await.expect("a request");
            let uri = request.uri().to_string();
            if !uri.contains("watch=true") {
                // Listed again: only once the refusals outlasted the grace.
                assert!(
                    first.elapsed() >= WATCH_REFUSED_GRACE,
                    "relisted after {:?}",
                    first.elapsed()
                );
                respond(answer, 200, list);
                break;
            }
            assert!(uri.contains("resourceVersion=1"), "{uri}");
            if first.elapsed() < WATCH_REFUSED_GRACE {
                assert!(watches.stale_now().is_empty(), "current within the grace");
            }
            watches_asked += 1;
            assert!(
                watches_asked <= 100,
                "asked again {watches_asked} times, never relisted"
            );
            tokio::time::sleep(slowly).await;
            respond(answer, 429, refused.clone());
        }
        current_again(watches).await;
        assert_eq!(watches.restarts(), [("Node".to_owned(), 1)]);
        watches_asked
    }

    /// A listed watch refused for the moment (the API server's cache of the kind being filled
    /// again) is asked again from its version, without a list and without going stale, for
    /// the grace; refused beyond it, its cache goes stale and is listed again.
    #[tokio::test(start_paused = true)]
    async fn a_listed_watch_refused_for_the_moment_resumes_and_goes_stale_only_after_the_grace() {
        let (mut handle, watches, task) = listed_node_watch().await;
        let asked = refused_until_relisted(&mut handle, &watches, Duration::ZERO).await;
        assert!(asked >= 10, "{asked}");
        // A later refusal is a new episode: asked again, not relisted.
        let (request, answer) = handle.next_request().await.expect("the watch");
        assert!(request.uri().to_string().contains("watch=true"));
        respond(answer, 429, storage_initializing());
        let (request, _answer) = handle.next_request().await.expect("asked again");
        let uri = request.uri().to_string();
        assert!(
            uri.contains("watch=true") && uri.contains("resourceVersion=1"),
            "{uri}"
        );
        assert!(watches.stale_now().is_empty());
        task.abort();
    }

    /// Refusals that each come slowly (an API server's flow control holding the request for
    /// 15 s, a load balancer's 504 after its own timeout) are one episode: no watch ran between
    /// them. Its cache goes stale once they outlast the grace, and is listed again.
    #[tokio::test(start_paused = true)]
    async fn slow_refusals_one_after_another_go_stale_after_the_grace() {
        let (mut handle, watches, task) = listed_node_watch().await;
        let slowly = WATCH_REFUSED_GRACE + Duration::from_secs(5);
        let asked = refused_until_relisted(&mut handle, &watches, slowly).await;
        assert!(
            asked <= 2,
            "asked again {asked} times before it was relisted"
        );
        task.abort();
    }

    /// A listed watch whose connection cannot be made (its API server gone) is asked again from
    /// its version, without a list and without going stale, for the grace; beyond it, its
    /// cache goes stale and is listed again. A watch cut once is resumed, not relisted.
    #[tokio::test(start_paused = true)]
    async fn a_listed_watch_cut_off_resumes_and_goes_stale_only_after_the_grace() {
        let (mut handle, watches, task) = listed_node_watch().await;
        // Cut once: resumed at once from the same version, still current.
        let (request, answer) = handle.next_request().await.expect("the watch");
        assert!(request.uri().to_string().contains("watch=true"));
        answer.send_error(cut());
        let (request, answer) = handle.next_request().await.expect("resumed");
        let uri = request.uri().to_string();
        assert!(
            uri.contains("watch=true") && uri.contains("resourceVersion=1"),
            "{uri}"
        );
        assert!(watches.stale_now().is_empty(), "{:?}", watches.stale_now());
        assert_eq!(watches.restarts(), [("Node".to_owned(), 0)]);
        // Cut for good: asked again for the grace, then stale and listed again.
        let first = tokio::time::Instant::now();
        answer.send_error(cut());
        let mut watches_asked = 0;
        loop {
            let (request, answer) = handle.next_request().await.expect("a request");
            let uri = request.uri().to_string();
            if !uri.contains("watch=true") {
                assert!(
                    first.elapsed() >= WATCH_CUT_GRACE,
                    "relisted after {:?}",
                    first.elapsed()
                );
                assert!(watches_asked >= 5, "{watches_asked}");
                assert!(!watches.stale_now().is_empty(), "stale until relisted");
                respond(answer, 200, node_list());
                break;
            }
            assert!(uri.contains("resourceVersion=1"), "{uri}");
            if first.elapsed() < WATCH_CUT_GRACE {
                assert!(watches.stale_now().is_empty(), "current within the grace");
            }
            watches_asked += 1;
            answer.send_error(cut());
        }
        current_again(&watches).await;
        assert_eq!(watches.restarts(), [("Node".to_owned(), 1)]);
        task.abort();
    }

    /// A watch asked again after a cut that brings nothing (held by an API server still
    /// starting) is listed again once silent past the bound; one that brings events runs on.
    #[tokio::test(start_paused = true)]
    async fn a_watch_asked_again_after_a_cut_is_listed_again_when_it_stays_silent() {
        let (mut handle, watches, task) = listed_node_watch().await;
        let (_, answer) = handle.next_request().await.expect("the watch");
        answer.send_error(cut());
        // Asked again; the answer is held (never sent).
        let (request, held) = handle.next_request().await.expect("asked again");
        assert!(request.uri().to_string().contains("resourceVersion=1"));
        let answer = relisted_once_silent(&mut handle).await;
        assert!(
            watches.stale_now()[0].contains("brought nothing"),
            "{:?}",
            watches.stale_now()
        );
        drop(held);
        respond(answer, 200, node_list());
        current_again(&watches).await;
        // Cut again, asked again, and it brings an event: no relist after the bound.
        let (_, answer) = handle.next_request().await.expect("the watch");
        answer.send_error(cut());
        let (_, answer) = handle.next_request().await.expect("asked again");
        watch_event(
            answer,
            &json!({"type": "ADDED", "object": {"kind": "Node", "apiVersion": "v1",
                "metadata": {"name": "n1", "resourceVersion": "2"}}}),
        );
        let (request, _held) = handle.next_request().await.expect("the watch goes on");
        let uri = request.uri().to_string();
        assert!(
            uri.contains("watch=true") && uri.contains("resourceVersion=2"),
            "{uri}"
        );
        tokio::time::sleep(WATCH_RESUMED_SILENCE * 2).await;
        assert!(watches.stale_now().is_empty(), "{:?}", watches.stale_now());
        assert_eq!(watches.restarts(), [("Node".to_owned(), 1)]);
        task.abort();
    }

    /// Refused for the moment after a cut (an API server still starting answers 429 or 504),
    /// then held: the watch asked again is still held to the bound.
    #[tokio::test(start_paused = true)]
    async fn a_watch_refused_after_a_cut_then_held_is_listed_again() {
        let (mut handle, _watches, task) = listed_node_watch().await;
        let (_, answer) = handle.next_request().await.expect("the watch");
        answer.send_error(cut());
        let (_, answer) = handle.next_request().await.expect("asked again");
        respond(answer, 429, storage_initializing());
        let (request, _held) = handle.next_request().await.expect("asked again");
        assert!(request.uri().to_string().contains("watch=true"));
        let _answer = relisted_once_silent(&mut handle).await;
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_expired_after_listing_is_relisted_at_once_once_per_longest_backoff() {
        let (client, mut handle, watches) = mock_paginated_watch();
        let (task, _) = spawn_watch(
            "Node",
            Api::<Node>::all(client),
            |_| {},
            watches.clone(),
            None,
        );
        let list = json!({"kind": "NodeList", "apiVersion": "v1",
            "metadata": {"resourceVersion": "1"}, "items": []});
        let gone = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "Expired", "code": 410, "message": "too old resource version: 1 (7)"});
        // Time is paused and moves only when every task waits for it: a backoff would show.
        let relisted_after =
            |at: tokio::time::Instant, request: http::Request<kube::client::Body>| {
                assert!(
                    !request.uri().to_string().contains("watch=true"),
                    "{}",
                    request.uri()
                );
                at.elapsed()
            };
        let (_, answer) = handle.next_request().await.expect("the first list");
        respond(answer, 200, list.clone());
        // The watch after the list: its resource version is gone (as after a CRD update), in
        // an ERROR event.
        let (_, answer) = handle.next_request().await.expect("the watch");
        watch_event(answer, &json!({"type": "ERROR", "object": gone}));
        let at = tokio::time::Instant::now();
        let (request, answer) = handle.next_request().await.expect("the relist");
        assert_eq!(relisted_after(at, request), Duration::ZERO, "at once");
        assert!(!watches.stale_now().is_empty(), "stale until relisted");
        respond(answer, 200, list.clone());
        // Gone again at once (the watch refused 410): not twice in a row, the backoff applies.
        let (_, answer) = handle.next_request().await.expect("the watch");
        respond(answer, 410, gone.clone());
        let at = tokio::time::Instant::now();
        let (request, answer) = handle.next_request().await.expect("the relist");
        assert!(relisted_after(at, request) >= WATCH_BACKOFF / 2);
        respond(answer, 200, list.clone());
        // Gone once more, a longest backoff later: at once again.
        let (_, answer) = handle.next_request().await.expect("the watch");
        tokio::time::advance(WATCH_BACKOFF_MAX).await;
        respond(answer, 410, gone);
        let at = tokio::time::Instant::now();
        let (request, answer) = handle.next_request().await.expect("the relist");
        assert_eq!(relisted_after(at, request), Duration::ZERO, "at once");
        respond(answer, 200, list);
        // A failure that is no expiry waits for the backoff.
        let (_, answer) = handle.next_request().await.expect("the watch");
        respond_500(answer, "etcd is gone");
        let at = tokio::time::Instant::now();
        let (request, _answer) = handle.next_request().await.expect("the relist");
        assert!(relisted_after(at, request) >= WATCH_BACKOFF / 2);
        assert_eq!(watches.restarts(), [("Node".to_owned(), 4)]);
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_whose_task_panics_is_started_again() {
        let (client, mut handle, watches) = mock_paginated_watch();
        let applied = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = applied.clone();
        // Applying the first event panics; later ones do not.
        let (task, _) = spawn_watch(
            "Node",
            Api::<Node>::all(client),
            move |_| {
                if count.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("a bug while applying an event");
                }
            },
            watches.clone(),
            None,
        );
        let list = json!({"kind": "NodeList", "apiVersion": "v1",
            "metadata": {"resourceVersion": "1"}, "items": []});
        let (_, answer) = handle.next_request().await.expect("the first list");
        respond(answer, 200, list.clone());
        until("the panic to make the watch stale", || {
            !watches.stale_now().is_empty()
        })
        .await;
        assert!(
            watches.stale_now()[0].contains("panicked"),
            "{:?}",
            watches.stale_now()
        );
        let (_, answer) = handle.next_request().await.expect("a new list");
        respond(answer, 200, list);
        current_again(&watches).await;
        task.abort();
    }

    fn pps() -> PersistentPodState {
        serde_json::from_value(json!({
            "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}}
        }))
        .expect("pps")
    }

    /// A pod of StatefulSet `web` with a slot annotation, a sidecar's status, and a requested IP.
    fn annotated_pod(name: &str) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": "ns",
            "uid": format!("uid-{name}"), "resourceVersion": "1",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web",
                "uid": "u", "controller": true}],
            "annotations": {"example.com/slot": "3", "sidecar.istio.io/status": "x".repeat(900),
                "cni.projectcalico.org/ipAddrs": format!("[\"10.0.0.{}\"]", name.len())}}}))
        .expect("pod")
    }

    /// `pps` naming `keys` in `persistentPodAnnotations`.
    fn pps_naming(name: &str, keys: &[&str]) -> PersistentPodState {
        let mut p = pps();
        p.metadata.name = Some(name.into());
        p.spec.persistent_pod_annotations = keys
            .iter()
            .map(|k| serde_json::from_value(json!({"key": k})).expect("key"))
            .collect();
        p
    }

    fn annotation(caches: &Caches, pod: &str, key: &str) -> Option<String> {
        let pods = caches.pods.read();
        pods.get("ns", pod)?.annotations.get(key).map(str::to_owned)
    }

    /// Pods keep the annotations something reads: those cached before the PersistentPodStates
    /// listed are trimmed then (in the list under way too), and a key named later is read by
    /// listing the pods again, the PersistentPodStates naming it not covered until then.
    #[test]
    fn pods_keep_only_the_annotations_read_and_a_key_named_later_is_listed_again() {
        let caches = Caches::new();
        let told = caches.kept.subscribe();
        caches.apply_pod(watcher::Event::Init);
        caches.apply_pod(watcher::Event::InitApply(annotated_pod("web-0")));
        caches.apply_pps(watcher::Event::Init);
        caches.apply_pps(watcher::Event::InitApply(pps_naming(
            "web",
            &["example.com/slot"],
        )));
        caches.apply_pps(watcher::Event::InitDone);
        caches.apply_pod(watcher::Event::InitApply(annotated_pod("web-10")));
        caches.apply_pod(watcher::Event::InitDone);
        for pod in ["web-0", "web-10"] {
            assert_eq!(
                annotation(&caches, pod, "example.com/slot").as_deref(),
                Some("3")
            );
            assert_eq!(
                annotation(&caches, pod, "sidecar.istio.io/status"),
                None,
                "{pod}"
            );
            assert!(annotation(&caches, pod, "cni.projectcalico.org/ipAddrs").is_some());
        }
        assert_eq!(
            caches.ip_holder("10.0.0.5", "ns", "other").as_deref(),
            Some("ns/web-0")
        );
        assert!(
            !told.has_changed().expect("sender alive"),
            "nothing new named"
        );

        // A PersistentPodState names a key not kept so far: the pods are listed again.
        let rack = ["example.com/rack"];
        caches.apply_pps(watcher::Event::Apply(pps_naming("db", &rack)));
        assert!(
            told.has_changed().expect("sender alive"),
            "the pod watch told"
        );
        assert!(!caches.kept.cover(rack.into_iter()));
        let with_rack = |name: &str, version: &str| {
            let mut pod = annotated_pod(name);
            pod.metadata.resource_version = Some(version.into());
            pod.metadata
                .annotations
                .get_or_insert_default()
                .insert(rack[0].into(), format!("r{version}"));
            Arc::new(CachedPod::from(pod))
        };
        // A pod cached from now on keeps it.
        caches.apply_pod(watcher::Event::Apply(annotated_pod("web-2")));
        caches.apply_cached_pod(watcher::Event::Apply(with_rack("web-2", "1")));
        assert_eq!(annotation(&caches, "web-2", rack[0]).as_deref(), Some("r1"));
        // The list made aside: web-0 (unchanged since cached) takes the annotation; web-10,
        // listed at a newer version than cached, keeps what it had (the watch brings that
        // version); a pod the watch deleted meanwhile does not come back.
        caches.apply_pod(watcher::Event::Delete(annotated_pod("web-2")));
        let mut requests = caches.triggers.subscribe_pps();
        caches.fill_pod_annotations(watcher::Event::Init);
        caches.fill_pod_annotations(watcher::Event::InitApply(with_rack("web-0", "1")));
        caches.fill_pod_annotations(watcher::Event::InitApply(with_rack("web-10", "2")));
        caches.fill_pod_annotations(watcher::Event::InitApply(with_rack("web-2", "1")));
        assert!(
            !caches.kept.cover(rack.into_iter()),
            "until the list is done"
        );
        assert!(
            requests.try_recv().is_err(),
            "nothing asked during the list"
        );
        caches.fill_pod_annotations(watcher::Event::InitDone);
        assert!(caches.kept.cover(rack.into_iter()));
        // The PersistentPodStates naming pod annotations are looked at (what they held back).
        let mut asked = Vec::new();
        while let Ok(r) = requests.try_recv() {
            asked.push(r.name);
        }
        asked.sort();
        assert_eq!(asked, ["db", "web"]);
        assert_eq!(annotation(&caches, "web-0", rack[0]).as_deref(), Some("r1"));
        assert_eq!(
            annotation(&caches, "web-0", "sidecar.istio.io/status"),
            None
        );
        assert_eq!(annotation(&caches, "web-10", rack[0]), None);
        assert!(!caches.pod_exists("ns", "web-2"), "not brought back");
        assert_eq!(
            caches.ip_holder("10.0.0.5", "ns", "other").as_deref(),
            Some("ns/web-0")
        );
    }

    #[test]
    fn synced_once_every_base_store_has_listed_and_stays_synced() {
        static TOLD: AtomicU64 = AtomicU64::new(0);
        let caches = Caches::build(None, || {
            TOLD.fetch_add(1, Ordering::Relaxed);
        });
        let told = || TOLD.load(Ordering::Relaxed);
        let sts = GroupKind::native_statefulset();
        caches.apply_pps(watcher::Event::Init);
        caches.apply_pps(watcher::Event::InitApply(pps()));
        caches.apply_pps(watcher::Event::InitDone);
        caches.apply_pod(watcher::Event::InitDone);
        caches.apply_node(watcher::Event::InitDone);
        assert!(!caches.is_synced(), "StatefulSets not listed yet");
        assert_eq!(told(), 0, "not told before synced");
        caches.apply_workload(&sts, watcher::Event::InitDone);
        assert!(caches.is_synced());
        assert_eq!(told(), 1, "told as the caches became synced");
        caches.apply_pps(watcher::Event::Init);
        caches.apply_pps(watcher::Event::InitApply(pps()));
        caches.apply_pps(watcher::Event::InitDone);
        assert!(
            caches.is_synced(),
            "a relist answers from the previous list"
        );
        assert_eq!(told(), 1, "a relist does not tell again");
        assert!(
            caches
                .pps
                .get(&ObjectRef::new("web").within("ns"))
                .is_some()
        );
    }

    #[test]
    fn an_unreadable_pps_is_skipped_and_the_others_kept() {
        // Read from its text, as a list or watch event hands it over.
        let object = |name: &str, spec: serde_json::Value| -> ReadPps {
            let text = json!({
                "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
                "metadata": {"name": name, "namespace": "ns"}, "spec": spec
            });
            serde_json::from_str(&text.to_string()).expect("object")
        };
        let good = || {
            object(
                "good",
                json!({"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}}),
            )
        };
        let caches = Caches::new();
        for ev in [
            watcher::Event::Init,
            watcher::Event::InitApply(object("no-target", json!({}))),
            watcher::Event::InitApply(good()),
            watcher::Event::InitDone,
        ] {
            if let Some(ev) = decode_pps(ev) {
                caches.apply_pps(ev);
            }
        }
        let get = |name: &str| caches.pps.get(&ObjectRef::new(name).within("ns"));
        assert!(get("good").is_some());
        assert!(get("no-target").is_none());
        // A readable object that turns unreadable is dropped from the cache.
        let bad = object("good", json!({"targetRef": 5}));
        caches.apply_pps(decode_pps(watcher::Event::Apply(bad)).expect("an event"));
        assert!(get("good").is_none());
    }

    #[test]
    fn pps_are_read_from_lists_and_events_as_from_a_plain_object_and_bad_ones_kept_apart() {
        use kube::core::{ObjectList, WatchEvent};
        let good = crate::synthetic::pps(3, 10, 20);
        let bad = json!({"apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": "bad", "namespace": "ns-1", "resourceVersion": "7"},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "secret-value"},
                     "requiredPersistentTopology": {"nodeTopologyKeys": "not-a-list"}}});
        // As it was read before: a plain object, then decoded from a JSON tree.
        let plain: DynamicObject = serde_json::from_value(good.clone()).expect("object");
        let before: PersistentPodState =
            serde_json::from_value(serde_json::to_value(plain).expect("tree")).expect("pps");
        let list = json!({"apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodStateList",
            "metadata": {"resourceVersion": "9"}, "items": [good, bad]});
        let list: ObjectList<ReadPps> =
            serde_json::from_str(&list.to_string()).expect("one bad item does not fail the list");
        let [ReadPps::Readable(read), ReadPps::Unreadable(metadata, why)] = &list.items[..] else {
            panic!("{:?}", list.items);
        };
        let tree = |p: &PersistentPodState| serde_json::to_value(p).expect("tree");
        assert_eq!(tree(read), tree(&before));
        assert_eq!(metadata.name.as_deref(), Some("bad"));
        assert_eq!(list.items[1].resource_version().as_deref(), Some("7"));
        assert!(why.contains("not of the expected shape"), "{why}");
        assert!(
            !why.contains("not-a-list"),
            "the reason quotes no value: {why}"
        );
        // A watch event (whichever of its fields comes first).
        let event = json!({"object": tree(&before), "type": "MODIFIED"});
        let event: WatchEvent<ReadPps> = serde_json::from_str(&event.to_string()).expect("event");
        let WatchEvent::Modified(ReadPps::Readable(read)) = event else {
            panic!("{event:?}");
        };
        assert_eq!(tree(&read), tree(&before));
        // Not even metadata: the object cannot be told apart, an error.
        assert!(serde_json::from_str::<ReadPps>(r#"{"metadata": 5}"#).is_err());
    }

    #[test]
    fn the_oldest_pps_of_a_workload_not_being_deleted_is_in_force() {
        let caches = Caches::new();
        let named = |name: &str, created: &str| {
            let mut p = pps();
            p.metadata.name = Some(name.into());
            p.metadata.creation_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    created.parse().expect("time"),
                ));
            p
        };
        let web = WorkloadRef {
            namespace: "ns".into(),
            kind: GroupKind::native_statefulset(),
            name: "web".into(),
        };
        caches.apply_pps(watcher::Event::Apply(named(
            "b-newer",
            "2026-01-02T00:00:00Z",
        )));
        caches.apply_pps(watcher::Event::Apply(named(
            "z-oldest",
            "2026-01-01T00:00:00Z",
        )));
        caches.apply_pps(watcher::Event::Apply(named(
            "a-newer",
            "2026-01-02T00:00:00Z",
        )));
        let in_force = |c: &Caches| c.pps_for(&web).and_then(|p| p.metadata.name.clone());
        assert_eq!(in_force(&caches).as_deref(), Some("z-oldest"));
        assert_eq!(caches.shadowed_pps(), 2);
        caches.apply_pps(watcher::Event::Delete(named(
            "z-oldest",
            "2026-01-01T00:00:00Z",
        )));
        assert_eq!(
            in_force(&caches).as_deref(),
            Some("a-newer"),
            "then by name"
        );
        assert_eq!(caches.shadowed_pps(), 1);
        // One being deleted (a finalizer holds it) is never in force.
        let mut deleting = named("a-newer", "2026-01-02T00:00:00Z");
        deleting.metadata.deletion_timestamp = deleting.metadata.creation_timestamp.clone();
        caches.apply_pps(watcher::Event::Apply(deleting));
        assert_eq!(in_force(&caches).as_deref(), Some("b-newer"));
        assert_eq!(
            caches.shadowed_pps(),
            0,
            "one being deleted beside the one in force: neither is shadowed"
        );
        let mut deleting = named("b-newer", "2026-01-02T00:00:00Z");
        deleting.metadata.deletion_timestamp = deleting.metadata.creation_timestamp.clone();
        caches.apply_pps(watcher::Event::Apply(deleting));
        assert_eq!(in_force(&caches), None, "none: nothing steers its pods");
    }

    #[test]
    fn a_node_relabeled_in_the_store_before_the_index_is_not_shown_for_its_old_values() {
        let caches = Caches::new();
        let node = |zone: &str| -> Node {
            serde_json::from_value(json!({"metadata": {"name": "n1",
                "labels": {"topology.kubernetes.io/zone": zone}}}))
            .expect("node")
        };
        caches.apply_node(watcher::Event::Apply(node("z1")));
        let z1 = BTreeMap::from([("topology.kubernetes.io/zone", "z1")]);
        let shown = |c: &Caches| c.visit_with_labels(&z1, &mut |_| true);
        assert!(shown(&caches));
        // The relabel as `apply_node` makes it, caught between its two writes: in the store,
        // not in the index yet.
        let mut relabeled = node("z2");
        trim::node(&mut relabeled);
        lock(&caches.nodes_writer).apply_watcher_event(&watcher::Event::Apply(relabeled));
        assert!(!shown(&caches), "n1 carries z1 no more");
    }

    #[test]
    fn workloads_are_unknown_until_their_kind_has_listed() {
        let caches = Caches::new();
        let web = WorkloadRef {
            namespace: "ns".into(),
            kind: GroupKind::native_statefulset(),
            name: "web".into(),
        };
        assert!(matches!(caches.workload(&web), WorkloadLookup::Unknown));
        caches.apply_workload(&web.kind, watcher::Event::InitDone);
        assert!(matches!(caches.workload(&web), WorkloadLookup::Absent));
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "web", "namespace": "ns"}, "spec": {"replicas": 2}
        }))
        .expect("sts");
        caches.apply_workload(&web.kind, watcher::Event::Apply(obj));
        assert!(matches!(caches.workload(&web), WorkloadLookup::Found(_)));
        let other = GroupKind::new("example.com", "Ring");
        assert!(matches!(
            caches.workload(&WorkloadRef { kind: other, ..web }),
            WorkloadLookup::Unknown
        ));
    }
}
