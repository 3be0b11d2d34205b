//! From watch events to reconcile requests: which PersistentPodStates and workloads must be
//! looked at again when an object changes. Requests go only to running controllers (on the
//! leader); elsewhere they are dropped.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

use super::{Caches, lock, pps_target};
use crate::api::PersistentPodState;
use crate::workload::{GroupKind, WorkloadRef};

/// Where watch events send reconcile requests while a controller runs.
#[derive(Default)]
pub struct Triggers {
    pps: Mutex<Option<UnboundedSender<ObjectRef<PersistentPodState>>>>,
    nodes: Mutex<Option<UnboundedSender<NodeHealthChange>>>,
    workloads: Mutex<HashMap<GroupKind, UnboundedSender<ObjectRef<DynamicObject>>>>,
}

/// A known node that became unhealthy, or healthy, or unhealthy since another time (what node
/// loss is judged from: [`crate::placement::unhealthy_since`]) or that was deleted, with
/// the labels it carries or carried: the controller reconciles only the PersistentPodStates
/// this can change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeHealthChange {
    /// The node's name.
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Only the taints pods must tolerate changed (its health did not): it concerns only the
    /// pods waiting pinned to values the node carries.
    pub taints_only: bool,
}

impl Triggers {
    /// Starts delivering PersistentPodState reconcile requests to the returned stream.
    pub fn subscribe_pps(&self) -> UnboundedReceiver<ObjectRef<PersistentPodState>> {
        let (tx, rx) = unbounded();
        *lock(&self.pps) = Some(tx);
        rx
    }

    /// Starts delivering node health changes to the returned stream (until then, each one asks
    /// for every PersistentPodState).
    pub fn subscribe_nodes(&self) -> UnboundedReceiver<NodeHealthChange> {
        let (tx, rx) = unbounded();
        *lock(&self.nodes) = Some(tx);
        rx
    }

    /// Starts delivering reconcile requests for workloads of `kind` to the returned stream.
    pub fn subscribe_workloads(
        &self,
        kind: &GroupKind,
    ) -> UnboundedReceiver<ObjectRef<DynamicObject>> {
        let (tx, rx) = unbounded();
        lock(&self.workloads).insert(kind.clone(), tx);
        rx
    }

    pub(super) fn pps(&self, refs: impl IntoIterator<Item = ObjectRef<PersistentPodState>>) {
        if let Some(tx) = lock(&self.pps).as_ref() {
            for r in refs {
                // A closed channel means the controller stopped; nothing is waiting for it.
                let _ = tx.unbounded_send(r);
            }
        }
    }

    fn workload(&self, kind: &GroupKind, r: ObjectRef<DynamicObject>) {
        if let Some(tx) = lock(&self.workloads).get(kind) {
            let _ = tx.unbounded_send(r);
        }
    }
}

impl Caches {
    /// A PersistentPodState changed: reconcile it; one went (deleted, `went_from` the target of
    /// its cached copy, or missing from a relist that ended, `before` holding the targets of
    /// those cached until then): its workload may have waited for it (a generated PPS is
    /// re-created), and another one targeting the same workload takes over.
    pub(super) fn trigger_for_pps(
        &self,
        event: &watcher::Event<PersistentPodState>,
        before: Option<HashMap<ObjectRef<PersistentPodState>, WorkloadRef>>,
        went_from: Option<WorkloadRef>,
    ) {
        match event {
            watcher::Event::Apply(p) => {
                self.triggers.pps([ObjectRef::from_obj(p)]);
                // Being deleted (held by a finalizer), it is in force no more: another one
                // targeting the same workload takes over now, not at its next resync.
                if p.metadata.deletion_timestamp.is_some()
                    && let Some(target) = pps_target(p)
                {
                    self.triggers.pps(self.pps_targeting(Some(target)));
                }
            }
            watcher::Event::Delete(p) => {
                if let Some(target) = went_from.or_else(|| pps_target(p)) {
                    self.gone(&target);
                }
                // Named as a workload's generated one would be, it may have kept that
                // workload's generator from making it, whatever it targeted.
                self.same_named_generators(&p.name_any(), p.namespace().as_deref());
            }
            // A relist reaches the store only at its end: reconcile everything then (a request
            // for an object not yet in the store would be dropped).
            watcher::Event::InitDone => {
                let now = self.pps_targets();
                let before = before.unwrap_or_default();
                let missing: Vec<ObjectRef<PersistentPodState>> = before
                    .keys()
                    .filter(|key| !now.contains_key(*key))
                    .cloned()
                    .collect();
                let went: HashSet<WorkloadRef> = before
                    .into_iter()
                    .filter(|(key, target)| now.get(key) != Some(target))
                    .map(|(_, target)| target)
                    .collect();
                for target in &went {
                    self.trigger_workload(target);
                }
                for key in &missing {
                    self.same_named_generators(&key.name, key.namespace.as_deref());
                }
                self.triggers.pps(self.all_pps());
            }
            watcher::Event::Init | watcher::Event::InitApply(_) => {}
        }
    }

    /// The generators of the workloads (of every watched kind) named `name` in `namespace`
    /// (a PersistentPodState's).
    fn same_named_generators(&self, name: &str, namespace: Option<&str>) {
        let Some(namespace) = namespace else {
            return;
        };
        for (kind, _) in self.workload_kinds() {
            self.trigger_workload(&WorkloadRef {
                namespace: namespace.to_owned(),
                kind,
                name: name.to_owned(),
            });
        }
    }

    /// A PersistentPodState targeting `target` went: the workload's generator, and those left
    /// targeting it, look again.
    fn gone(&self, target: &WorkloadRef) {
        self.trigger_workload(target);
        self.triggers.pps(self.pps_targeting(Some(target.clone())));
    }

    /// Every cached PersistentPodState's target.
    pub(super) fn pps_targets(&self) -> HashMap<ObjectRef<PersistentPodState>, WorkloadRef> {
        self.pps
            .state()
            .iter()
            .filter_map(|p| Some((ObjectRef::from_obj(p.as_ref()), pps_target(p)?)))
            .collect()
    }

    /// A pod changed or went: the PersistentPodStates of its workload; for a pod no workload
    /// controls, those that may hold its state ([`Caches::pps_of_ownerless`]).
    pub(super) fn trigger_for_pod(
        &self,
        event: &watcher::Event<std::sync::Arc<super::trim::CachedPod>>,
    ) {
        match event {
            watcher::Event::Apply(p) | watcher::Event::Delete(p) => match p.workload() {
                Some(workload) => self.triggers.pps(self.pps_targeting(Some(workload))),
                None => self.triggers.pps(self.pps_of_ownerless(p)),
            },
            watcher::Event::InitDone => self.triggers.pps(self.all_pps()),
            watcher::Event::Init | watcher::Event::InitApply(_) => {}
        }
    }

    /// A node came, or a label some PersistentPodState reads changed on it (rare: operator
    /// actions, autoscaling), or a list ended: every PersistentPodState re-records what it must
    /// and reports what cannot be injected. A known node's health or the taints pods must
    /// tolerate changed, or it went (every node of a failing zone, one by one): the controller
    /// is told which, and picks the PersistentPodStates it concerns.
    pub(super) fn trigger_for_node(&self, change: NodeTrigger) {
        match change {
            NodeTrigger::None => {}
            NodeTrigger::Every => self.triggers.pps(self.all_pps()),
            NodeTrigger::Health(change) => {
                let unsent = lock(&self.triggers.nodes)
                    .as_ref()
                    .is_none_or(|tx| tx.unbounded_send(change).is_err());
                if unsent {
                    self.triggers.pps(self.all_pps());
                }
            }
        }
    }

    /// A workload changed: its PersistentPodStates and its generator (any annotation may have
    /// changed); one went: its PersistentPodStates.
    pub(super) fn trigger_for_workload(
        &self,
        kind: &GroupKind,
        event: &watcher::Event<DynamicObject>,
    ) {
        let key = |obj: &DynamicObject| {
            Some(WorkloadRef {
                namespace: obj.namespace()?,
                kind: kind.clone(),
                name: obj.name_any(),
            })
        };
        match event {
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

    /// The pods were listed aside to read annotations named since they were cached: the
    /// PersistentPodStates naming any pod annotation record what they held back for it.
    pub(super) fn trigger_for_annotations_read(&self) {
        let naming: Vec<_> = self
            .pps
            .state()
            .iter()
            .filter(|p| !p.spec.persistent_pod_annotations.is_empty())
            .map(|p| ObjectRef::from_obj(p.as_ref()))
            .collect();
        self.triggers.pps(naming);
    }

    pub(super) fn all_pps(&self) -> Vec<ObjectRef<PersistentPodState>> {
        self.pps
            .state()
            .iter()
            .map(|p| ObjectRef::from_obj(p.as_ref()))
            .collect()
    }

    fn pps_targeting(&self, workload: Option<WorkloadRef>) -> Vec<ObjectRef<PersistentPodState>> {
        workload.map_or_else(Vec::new, |w| {
            self.pps_by_target
                .read()
                .get(&w)
                .map(|name| ObjectRef::new(name).within(&w.namespace))
                .collect()
        })
    }

    /// The PersistentPodStates that may hold the state of `pod`, which no workload controls:
    /// those targeting a workload of a watched kind named as its pods would be
    /// (`NAME-ORDINAL`). A workload deleted with `--cascade=orphan` leaves its pods so, and
    /// each keeps its state until it goes.
    fn pps_of_ownerless(&self, pod: &super::trim::CachedPod) -> Vec<ObjectRef<PersistentPodState>> {
        let Some((name, _)) = pod
            .name
            .rsplit_once('-')
            .filter(|_| crate::workload::pod_ordinal(&pod.name).is_some())
        else {
            return Vec::new();
        };
        self.workload_kinds()
            .into_iter()
            .flat_map(|(kind, _)| {
                self.pps_targeting(Some(WorkloadRef {
                    namespace: pod.namespace.to_string(),
                    kind,
                    name: name.to_owned(),
                }))
            })
            .collect()
    }

    /// Asks the generator of `workload`'s kind to look at it.
    pub(super) fn trigger_workload(&self, workload: &WorkloadRef) {
        if let Some(ws) = self.workload_store(&workload.kind) {
            self.triggers.workload(
                &workload.kind,
                ObjectRef::new_with(&workload.name, ws.resource).within(&workload.namespace),
            );
        }
    }
}

/// What a node event asks of the controller.
pub(super) enum NodeTrigger {
    /// Nothing it reads changed.
    None,
    /// Every PersistentPodState.
    Every,
    /// Those a known node's health change concerns.
    Health(NodeHealthChange),
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pps() -> PersistentPodState {
        serde_json::from_value(json!({
            "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}}
        }))
        .expect("pps")
    }

    /// [`pps`] requiring the zone and preferring the host.
    fn zoned_pps() -> PersistentPodState {
        let mut zoned = pps();
        zoned.spec.required_persistent_topology =
            serde_json::from_value(json!({"keys": ["topology.kubernetes.io/zone"]}))
                .expect("required");
        zoned.spec.preferred_persistent_topology = serde_json::from_value(json!([
            {"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}}
        ]))
        .expect("preferred");
        zoned
    }

    fn sts(annotations: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "web", "namespace": "ns", "annotations": annotations}
        }))
        .expect("sts")
    }

    #[test]
    fn upstream_bug_4_deleting_a_native_statefulset_reconciles_its_pps() {
        let caches = Caches::new();
        let mut requests = caches.triggers.subscribe_pps();
        caches.apply_pps(watcher::Event::Apply(pps()));
        let web = ObjectRef::<PersistentPodState>::new("web").within("ns");
        assert_eq!(
            requests.try_recv().ok(),
            Some(web.clone()),
            "the PPS itself"
        );
        caches.apply_workload(
            &GroupKind::native_statefulset(),
            watcher::Event::Delete(sts(json!({}))),
        );
        assert_eq!(
            requests.try_recv().ok(),
            Some(web),
            "the PPS of the deleted StatefulSet"
        );
    }

    /// A generated PersistentPodState (controlled by its workload) edited in its spec or
    /// annotations wakes its workload's generator, so that what the workload's annotations
    /// express follows them; its status written, or a hand-made one edited, does not.
    #[test]
    fn an_edit_of_a_generated_pps_wakes_its_workloads_generator() {
        let caches = Caches::new();
        let kind = GroupKind::native_statefulset();
        caches.apply_workload(&kind, watcher::Event::Apply(sts(json!({}))));
        let mut generated = pps();
        generated.metadata.generation = Some(1);
        generated.metadata.owner_references = Some(vec![
            serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "sts-uid",
            "controller": true}))
            .expect("owner"),
        ]);
        caches.apply_pps(watcher::Event::Apply(generated.clone()));
        let mut generator = caches.triggers.subscribe_workloads(&kind);
        // Its status written: the generator is not woken.
        let mut written = generated.clone();
        written.status = serde_json::from_value(json!({"observedGeneration": 1})).ok();
        caches.apply_pps(watcher::Event::Apply(written.clone()));
        assert!(generator.try_recv().is_err(), "a status write");
        // An annotation set on it, then its spec changed: woken each time.
        let mut annotated = written.clone();
        annotated.metadata.annotations = Some(
            [(
                "persistent-pod-state.io/release-local-volumes".to_owned(),
                "true".to_owned(),
            )]
            .into(),
        );
        caches.apply_pps(watcher::Event::Apply(annotated.clone()));
        assert_eq!(
            generator.try_recv().ok().map(|r| r.name),
            Some("web".into())
        );
        let mut respecified = annotated.clone();
        respecified.metadata.generation = Some(2);
        caches.apply_pps(watcher::Event::Apply(respecified));
        assert_eq!(
            generator.try_recv().ok().map(|r| r.name),
            Some("web".into())
        );
        // A hand-made one edited: not.
        let mut hand_made = pps();
        hand_made.metadata.name = Some("mine".into());
        caches.apply_pps(watcher::Event::Apply(hand_made.clone()));
        hand_made.metadata.generation = Some(2);
        caches.apply_pps(watcher::Event::Apply(hand_made));
        assert!(generator.try_recv().is_err(), "a hand-made one");
    }

    #[test]
    fn a_pps_gone_by_delete_or_missing_from_a_relist_wakes_its_workloads_generator_and_siblings() {
        let caches = Caches::new();
        let kind = GroupKind::native_statefulset();
        caches.apply_workload(&kind, watcher::Event::Apply(sts(json!({}))));
        let named = |name: &str| {
            let mut p = pps();
            p.metadata.name = Some(name.to_owned());
            p
        };
        caches.apply_pps(watcher::Event::Apply(named("web")));
        caches.apply_pps(watcher::Event::Apply(named("twin")));
        let mut pps_requests = caches.triggers.subscribe_pps();
        let mut generator = caches.triggers.subscribe_workloads(&kind);
        // Deleted: the generator, and the one left targeting the same StatefulSet; and the
        // generator of a StatefulSet named as it is (it may have kept that one from making its
        // own PersistentPodState).
        caches.apply_pps(watcher::Event::Delete(named("twin")));
        assert_eq!(
            generator.try_recv().ok().map(|r| r.name),
            Some("web".into())
        );
        assert_eq!(
            generator.try_recv().ok().map(|r| r.name),
            Some("twin".into())
        );
        assert_eq!(
            pps_requests.try_recv().ok(),
            Some(ObjectRef::new("web").within("ns"))
        );
        // Changed to a spec that no longer reads: it comes as a Delete of its metadata alone,
        // and still wakes what its cached copy targeted.
        caches.apply_pps(watcher::Event::Apply(named("twin")));
        let _ = pps_requests.try_recv();
        let mut unreadable = named("twin");
        unreadable.spec = Default::default();
        caches.apply_pps(watcher::Event::Delete(unreadable));
        assert_eq!(
            generator.try_recv().ok().map(|r| r.name),
            Some("web".into())
        );
        assert_eq!(
            generator.try_recv().ok().map(|r| r.name),
            Some("twin".into())
        );
        assert_eq!(
            pps_requests.try_recv().ok(),
            Some(ObjectRef::new("web").within("ns"))
        );
        // Being deleted, held by a finalizer: the one left targeting the same StatefulSet
        // looks again at once (it is in force from now).
        caches.apply_pps(watcher::Event::Apply(named("twin")));
        while pps_requests.try_recv().is_ok() {}
        let mut deleting = named("twin");
        deleting.metadata.deletion_timestamp =
            serde_json::from_value(json!("2026-12-07T00:00:00Z")).ok();
        deleting.metadata.finalizers = Some(vec!["example.com/hold".into()]);
        caches.apply_pps(watcher::Event::Apply(deleting));
        let mut woken = Vec::new();
        while let Ok(r) = pps_requests.try_recv() {
            woken.push(r.name);
        }
        assert!(woken.contains(&"web".to_owned()), "{woken:?}");
        // Gone while the watch was down: the relist that ends without it says so.
        caches.apply_pps(watcher::Event::Init);
        assert!(
            generator.try_recv().is_err(),
            "nothing until the relist ends"
        );
        // (Both went: the relist found neither.) Their target's generator, and those of the
        // StatefulSets named as they are.
        caches.apply_pps(watcher::Event::InitDone);
        let mut woken = std::collections::BTreeSet::new();
        while let Ok(r) = generator.try_recv() {
            woken.insert(r.name);
        }
        assert_eq!(woken, ["twin".to_owned(), "web".to_owned()].into());
        // A relist that finds every object again wakes no generator.
        caches.apply_pps(watcher::Event::Init);
        caches.apply_pps(watcher::Event::InitDone);
        assert!(generator.try_recv().is_err(), "nothing went");
    }

    #[test]
    fn a_pod_event_reconciles_the_pps_of_its_workload_only() {
        let caches = Caches::new();
        caches.apply_pps(watcher::Event::Apply(pps()));
        let mut requests = caches.triggers.subscribe_pps();
        let pod = |owner: &str| {
            serde_json::from_value(json!({"metadata": {"name": format!("{owner}-0"), "namespace": "ns",
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": owner, "uid": "u", "controller": true}]}}))
            .expect("pod")
        };
        caches.apply_pod(watcher::Event::Apply(pod("other")));
        caches.apply_pod(watcher::Event::Apply(pod("web")));
        assert_eq!(
            requests.try_recv().ok(),
            Some(ObjectRef::new("web").within("ns")),
            "the other workload has no PPS: nothing was sent for it"
        );
        assert!(requests.try_recv().is_err(), "nothing more queued");

        // Pods no workload controls (left by a StatefulSet deleted with --cascade=orphan): the
        // PPS of a workload named as their pods would be, in their namespace.
        let ownerless = |name: &str, namespace: &str| -> k8s_openapi::api::core::v1::Pod {
            serde_json::from_value(json!({"metadata": {"name": name, "namespace": namespace}}))
                .expect("pod")
        };
        caches.apply_pod(watcher::Event::Delete(ownerless("web-2", "ns")));
        assert_eq!(
            requests.try_recv().ok(),
            Some(ObjectRef::new("web").within("ns"))
        );
        for (name, namespace) in [("web-2", "elsewhere"), ("web", "ns"), ("other-0", "ns")] {
            caches.apply_pod(watcher::Event::Delete(ownerless(name, namespace)));
        }
        assert!(requests.try_recv().is_err(), "nothing more queued");
    }

    #[test]
    fn a_known_nodes_health_change_is_handed_over_and_other_node_events_ask_for_every_pps() {
        let caches = Caches::new();
        caches.apply_pps(watcher::Event::Apply(zoned_pps()));
        let mut requests = caches.triggers.subscribe_pps();
        let mut nodes = caches.triggers.subscribe_nodes();
        let node = |zone: &str, ready: &str| {
            serde_json::from_value::<k8s_openapi::api::core::v1::Node>(json!({
                "metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": zone}},
                "status": {"conditions": [{"type": "Ready", "status": ready}]}}))
            .expect("node")
        };
        let web = ObjectRef::<PersistentPodState>::new("web").within("ns");
        caches.apply_node(watcher::Event::Apply(node("z1", "True")));
        assert_eq!(requests.try_recv().ok(), Some(web.clone()), "a new node");
        caches.apply_node(watcher::Event::Apply(node("z1", "True")));
        assert!(requests.try_recv().is_err(), "nothing read changed");
        assert!(nodes.try_recv().is_err());
        caches.apply_node(watcher::Event::Apply(node("z1", "False")));
        let change = NodeHealthChange {
            name: "n1".into(),
            labels: BTreeMap::from([("topology.kubernetes.io/zone".into(), "z1".into())]),
            taints_only: false,
        };
        assert_eq!(nodes.try_recv().ok(), Some(change.clone()), "its health");
        assert!(requests.try_recv().is_err(), "handed over, not every PPS");
        caches.apply_node(watcher::Event::Apply(node("z2", "False")));
        assert_eq!(requests.try_recv().ok(), Some(web.clone()), "relabelled");
        caches.apply_node(watcher::Event::Delete(node("z1", "False")));
        assert_eq!(
            nodes.try_recv().ok().map(|c| c.name),
            Some("n1".into()),
            "deleted"
        );
        drop(nodes);
        caches.apply_node(watcher::Event::Apply(node("z1", "True")));
        caches.apply_node(watcher::Event::Apply(node("z1", "False")));
        assert_eq!(requests.try_recv().ok(), Some(web.clone()), "a new node");
        assert_eq!(
            requests.try_recv().ok(),
            Some(web),
            "with nobody to hand it to, a health change asks for every PPS"
        );
    }

    /// The node lifecycle controller marks a lost node in steps: the `Ready` condition
    /// `Unknown`, then an unreachable NoSchedule taint, later its NoExecute twin. Loss is judged
    /// from the earliest of them, so only the first step is a health change: at 10,000
    /// PersistentPodStates each later step reconciled every one with a state on the node. A
    /// taint pods must tolerate, come or gone, is one too (a pod pinned there may be held).
    #[test]
    fn only_a_change_of_since_when_a_node_is_unhealthy_or_of_the_taints_pods_tolerate_is_a_health_change()
     {
        let caches = Caches::new();
        let mut nodes = caches.triggers.subscribe_nodes();
        let node = |version: &str, ready: &str, taints: serde_json::Value| {
            serde_json::from_value::<k8s_openapi::api::core::v1::Node>(json!({
                "metadata": {"name": "n1", "resourceVersion": version},
                "spec": {"taints": taints},
                "status": {"conditions": [{"type": "Ready", "status": ready,
                    "lastTransitionTime": "2026-11-28T10:00:00Z"}]}}))
            .expect("node")
        };
        let unreachable = |effect: &str, added: &str| json!({"key": "node.kubernetes.io/unreachable", "effect": effect, "timeAdded": added});
        let mut steps = vec![
            ("ready", node("1", "True", json!([])), None),
            ("unknown", node("2", "Unknown", json!([])), Some(true)),
            (
                "the NoSchedule taint, added after",
                node(
                    "3",
                    "Unknown",
                    json!([unreachable("NoSchedule", "2026-11-28T10:00:40Z")]),
                ),
                Some(false),
            ),
            (
                "its NoExecute twin",
                node(
                    "4",
                    "Unknown",
                    json!([
                        unreachable("NoSchedule", "2026-11-28T10:00:40Z"),
                        unreachable("NoExecute", "2026-11-28T10:05:00Z")
                    ]),
                ),
                Some(false),
            ),
            (
                "cordoned too (loss is not judged from it)",
                node(
                    "5",
                    "Unknown",
                    json!([
                        unreachable("NoSchedule", "2026-11-28T10:00:40Z"),
                        unreachable("NoExecute", "2026-11-28T10:05:00Z"),
                        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
                    ]),
                ),
                Some(false),
            ),
            (
                "out of service: lost at once",
                node(
                    "6",
                    "Unknown",
                    json!([{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}]),
                ),
                Some(true),
            ),
            (
                "ready again, its unreachable taint not removed yet",
                node(
                    "7",
                    "True",
                    json!([unreachable("NoSchedule", "2026-11-28T10:30:00Z")]),
                ),
                Some(true),
            ),
            ("ready, untainted", node("8", "True", json!([])), Some(true)),
            (
                "a taint pods must tolerate (it may hold a pinned pod)",
                node(
                    "9",
                    "True",
                    json!([{"key": "example.com/maintenance", "effect": "NoSchedule"}]),
                ),
                Some(true),
            ),
            (
                "a PreferNoSchedule taint beside it (holds no pod)",
                node(
                    "10",
                    "True",
                    json!([{"key": "example.com/maintenance", "effect": "NoSchedule"},
                        {"key": "example.com/busy", "effect": "PreferNoSchedule"}]),
                ),
                Some(false),
            ),
            ("untainted again", node("11", "True", json!([])), Some(true)),
        ];
        for (what, node, health_change) in steps.drain(..) {
            caches.apply_node(watcher::Event::Apply(node));
            if let Some(expected) = health_change {
                let change = nodes.try_recv().ok();
                assert_eq!(change.is_some(), expected, "{what}");
                let taints_only =
                    what.starts_with("a taint") || what.starts_with("untainted again");
                if let Some(change) = change {
                    assert_eq!(change.taints_only, taints_only, "{what}");
                }
            }
            assert!(nodes.try_recv().is_err(), "{what}: one change at most");
        }
    }

    /// A relabel asks for every PersistentPodState only when it changes a key one of them reads
    /// (its required or preferred topology keys). The node lifecycle controller adds
    /// `beta.kubernetes.io/os` to every node without it as it marks the node lost: at 10,000
    /// PersistentPodStates and 1,000 nodes that reconciled every one per node, 15,000 a second.
    #[test]
    fn a_relabel_of_keys_no_pps_reads_asks_for_nothing() {
        let caches = Caches::new();
        caches.apply_pps(watcher::Event::Apply(zoned_pps()));
        let mut requests = caches.triggers.subscribe_pps();
        let mut nodes = caches.triggers.subscribe_nodes();
        let node = |labels: serde_json::Value, ready: &str| {
            serde_json::from_value::<k8s_openapi::api::core::v1::Node>(json!({
                "metadata": {"name": "n1", "labels": labels},
                "status": {"conditions": [{"type": "Ready", "status": ready,
                    "lastTransitionTime": "2026-11-28T10:00:00Z"}]}}))
            .expect("node")
        };
        let web = ObjectRef::<PersistentPodState>::new("web").within("ns");
        let zone = "topology.kubernetes.io/zone";
        caches.apply_node(watcher::Event::Apply(node(json!({zone: "z1"}), "True")));
        assert_eq!(requests.try_recv().ok(), Some(web.clone()), "a new node");
        caches.apply_node(watcher::Event::Apply(node(
            json!({zone: "z1", "beta.kubernetes.io/os": "linux"}),
            "True",
        )));
        assert!(requests.try_recv().is_err(), "a key no PPS reads added");
        assert!(nodes.try_recv().is_err(), "and its health unchanged");
        caches.apply_node(watcher::Event::Apply(node(
            json!({zone: "z1", "beta.kubernetes.io/os": "linux", "team": "a"}),
            "Unknown",
        )));
        assert!(requests.try_recv().is_err(), "another unread key");
        assert_eq!(
            nodes.try_recv().ok().map(|c| c.name),
            Some("n1".into()),
            "with its health changed: a health change"
        );
        caches.apply_node(watcher::Event::Apply(node(
            json!({zone: "z1", "kubernetes.io/hostname": "n1"}),
            "Unknown",
        )));
        assert_eq!(
            requests.try_recv().ok(),
            Some(web.clone()),
            "a preferred key added"
        );
        caches.apply_node(watcher::Event::Apply(node(
            json!({zone: "z2", "kubernetes.io/hostname": "n1"}),
            "Unknown",
        )));
        assert_eq!(
            requests.try_recv().ok(),
            Some(web),
            "a required key changed"
        );
        assert!(nodes.try_recv().is_err());
    }
}
