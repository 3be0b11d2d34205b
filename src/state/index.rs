//! Indexes kept current from watch events, so a hot-path lookup is a hash probe and never a scan.
//!
//! Every index (and CRD discovery) shares one relist mechanism, [`Relisting`]: while a watch
//! relists (`Init`, `InitApply`..., `InitDone`), a fresh index is built aside and replaces the
//! current one only at `InitDone`, exactly like the reflector store it sits next to.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{RwLock, RwLockReadGuard};

use k8s_openapi::api::core::v1::Node;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};

use crate::api::PersistentPodState;
use crate::workload::{GroupKind, WorkloadRef};

/// The indexes' maps, hashed with aHash: keyed at random per process, built to resist
/// collision flooding (not a cryptographic hash), several times faster than the standard
/// library's SipHash on the short names a review looks up, and the hasher the reflector
/// stores already use.
type HashMap<K, V> = std::collections::HashMap<K, V, ahash::RandomState>;

/// An index over objects of kind `K`, updated one object at a time.
pub trait Indexer<K>: Default {
    /// Adds `obj` or replaces its previous version; returns whether the answers changed.
    fn upsert(&mut self, obj: &K) -> bool;
    /// Removes `obj`; returns whether the answers changed.
    fn remove(&mut self, obj: &K) -> bool;
}

/// An index plus, during a relist, the one being rebuilt.
#[derive(Debug, Default)]
pub struct Relisting<S> {
    current: S,
    rebuilding: Option<S>,
}

impl<S> Relisting<S> {
    /// Applies one watch event; returns whether the current answers changed (always at the end
    /// of a relist, which replaces everything).
    pub fn apply<K>(&mut self, event: &watcher::Event<K>) -> bool
    where
        S: Indexer<K>,
    {
        self.apply_replacing(event).0
    }

    /// [`Relisting::apply`], handing back the index a relist's end replaced, for the caller to
    /// free outside its lock.
    fn apply_replacing<K>(&mut self, event: &watcher::Event<K>) -> (bool, Option<S>)
    where
        S: Indexer<K>,
    {
        match event {
            watcher::Event::Apply(obj) => (self.current.upsert(obj), None),
            watcher::Event::Delete(obj) => (self.current.remove(obj), None),
            watcher::Event::Init => {
                self.rebuilding = Some(S::default());
                (false, None)
            }
            watcher::Event::InitApply(obj) => {
                self.rebuilding.get_or_insert_with(S::default).upsert(obj);
                (false, None)
            }
            watcher::Event::InitDone => {
                let rebuilt = self.rebuilding.take().unwrap_or_default();
                (true, Some(std::mem::replace(&mut self.current, rebuilt)))
            }
        }
    }

    /// The index as of the last completed list and the events since.
    pub fn current(&self) -> &S {
        &self.current
    }

    /// Whether a relist is under way (its objects are not answered yet).
    pub fn is_relisting(&self) -> bool {
        self.rebuilding.is_some()
    }
}

/// A [`Relisting`] index shared between the watch (writer) and every reader.
#[derive(Debug, Default)]
pub struct Shared<S>(RwLock<Relisting<S>>);

impl<S> Shared<S> {
    /// Applies one watch event; returns whether the answers changed.
    pub fn apply<K>(&self, event: &watcher::Event<K>) -> bool
    where
        S: Indexer<K>,
    {
        let (changed, replaced) = crate::sync::write(&self.0).apply_replacing(event);
        // Freed once the lock is let go: a large index takes a while, and readers wait on it.
        drop(replaced);
        changed
    }

    /// Runs `change` on the current index and on the one a relist is building, if any.
    pub fn change_each(&self, mut change: impl FnMut(&mut S)) {
        let mut relisting = crate::sync::write(&self.0);
        change(&mut relisting.current);
        if let Some(rebuilding) = relisting.rebuilding.as_mut() {
            change(rebuilding);
        }
    }

    /// Read access to the current index.
    pub fn read(&self) -> ReadIndex<'_, S> {
        ReadIndex(crate::sync::read(&self.0))
    }
}

/// A read lock on a shared index.
pub struct ReadIndex<'a, S>(RwLockReadGuard<'a, Relisting<S>>);

impl<S> std::ops::Deref for ReadIndex<'_, S> {
    type Target = S;
    fn deref(&self) -> &S {
        self.0.current()
    }
}

/// Objects that belong to a workload (a PersistentPodState to its target).
pub trait OfWorkload {
    /// The workload this object belongs to, if any.
    fn workload(&self) -> Option<WorkloadRef>;
}

impl OfWorkload for PersistentPodState {
    fn workload(&self) -> Option<WorkloadRef> {
        pps_target(self)
    }
}

/// The workload a PersistentPodState targets (matched by group, kind and name).
pub fn pps_target(pps: &PersistentPodState) -> Option<WorkloadRef> {
    let target = &pps.spec.target_ref;
    Some(WorkloadRef {
        namespace: pps.namespace()?,
        kind: GroupKind::of_target(target),
        name: target.name.clone(),
    })
}

/// Object names by the workload they belong to (objects share the workload's namespace).
#[derive(Debug, Default)]
pub struct ByWorkload {
    names: HashMap<WorkloadRef, BTreeSet<String>>,
    /// The workload of each object by (namespace, name), to move or drop it on change.
    workload_of: HashMap<(String, String), WorkloadRef>,
}

impl ByWorkload {
    /// Names of the objects that belong to `workload`, sorted.
    pub fn get(&self, workload: &WorkloadRef) -> impl Iterator<Item = &str> {
        self.names
            .get(workload)
            .into_iter()
            .flat_map(|names| names.iter().map(String::as_str))
    }

    /// The workloads that more than one object belongs to, with those objects' names.
    pub fn shared(&self) -> impl Iterator<Item = (&WorkloadRef, &BTreeSet<String>)> {
        self.names.iter().filter(|(_, names)| names.len() > 1)
    }

    fn forget(&mut self, id: &(String, String)) -> bool {
        let Some(old) = self.workload_of.remove(id) else {
            return false;
        };
        if let Some(names) = self.names.get_mut(&old) {
            names.remove(&id.1);
            if names.is_empty() {
                self.names.remove(&old);
            }
        }
        true
    }
}

fn id<K: Resource>(obj: &K) -> (String, String) {
    (obj.namespace().unwrap_or_default(), obj.name_any())
}

impl<K: Resource + OfWorkload> Indexer<K> for ByWorkload {
    fn upsert(&mut self, obj: &K) -> bool {
        let id = id(obj);
        let key = obj.workload();
        if self.workload_of.get(&id) == key.as_ref() {
            return false;
        }
        self.forget(&id);
        if let Some(key) = key {
            self.names
                .entry(key.clone())
                .or_default()
                .insert(id.1.clone());
            self.workload_of.insert(id, key);
        }
        true
    }

    fn remove(&mut self, obj: &K) -> bool {
        self.forget(&id(obj))
    }
}

/// Nodes by label (`key=value`): answers "which nodes carry all these labels" without scanning
/// every node (and without allocating to probe).
#[derive(Debug, Default)]
pub struct NodesByLabel {
    /// Node names by label key, then value.
    nodes: HashMap<String, HashMap<String, BTreeSet<String>>>,
    labels_of: HashMap<String, BTreeMap<String, String>>,
}

impl NodesByLabel {
    /// Names of the nodes that carry every `key=value` of `labels`, in name order, found as
    /// they are asked for (a caller that stops at the first does not pay for the rest); every
    /// node for no labels is not answered: `None`.
    pub fn with_all<'a>(
        &'a self,
        labels: &BTreeMap<&str, &str>,
    ) -> Option<impl Iterator<Item = &'a str> + 'a> {
        if labels.is_empty() {
            return None;
        }
        let mut candidates: Vec<&BTreeSet<String>> = Vec::with_capacity(labels.len());
        for (k, v) in labels {
            match self.nodes.get(*k).and_then(|values| values.get(*v)) {
                Some(nodes) => candidates.push(nodes),
                None => {
                    candidates.clear();
                    break;
                }
            }
        }
        // The smallest set is walked; each of its names is looked up in the others.
        candidates.sort_by_key(|c| c.len());
        let smallest = candidates.first().copied();
        Some(
            smallest
                .into_iter()
                .flatten()
                .filter(move |n| {
                    let others = candidates.get(1..).unwrap_or_default();
                    others.iter().all(|c| c.contains(*n))
                })
                .map(String::as_str),
        )
    }

    /// Whether some node carries every `key=value` of `labels` (true for no labels).
    pub fn any_with(&self, labels: &BTreeMap<&str, &str>) -> bool {
        self.with_all(labels)
            .is_none_or(|mut nodes| nodes.next().is_some())
    }

    fn forget(&mut self, node: &str) -> bool {
        let Some(labels) = self.labels_of.remove(node) else {
            return false;
        };
        for (k, v) in labels {
            if let Some(values) = self.nodes.get_mut(&k) {
                if let Some(nodes) = values.get_mut(&v) {
                    nodes.remove(node);
                    if nodes.is_empty() {
                        values.remove(&v);
                    }
                }
                if values.is_empty() {
                    self.nodes.remove(&k);
                }
            }
        }
        true
    }
}

impl Indexer<Node> for NodesByLabel {
    fn upsert(&mut self, node: &Node) -> bool {
        let name = node.name_any();
        let labels = node.labels();
        if self.labels_of.get(&name) == Some(labels) {
            return false;
        }
        self.forget(&name);
        for (k, v) in labels {
            self.nodes
                .entry(k.clone())
                .or_default()
                .entry(v.clone())
                .or_default()
                .insert(name.clone());
        }
        self.labels_of.insert(name, labels.clone());
        true
    }

    fn remove(&mut self, node: &Node) -> bool {
        self.forget(&node.name_any())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).expect("node")
    }

    fn labels<'a>(pairs: &[(&'a str, &'a str)]) -> BTreeMap<&'a str, &'a str> {
        pairs.iter().copied().collect()
    }

    #[test]
    fn upstream_bug_12_node_label_changes_are_noticed_and_joint_matches_answered() {
        let index = Shared::<NodesByLabel>::default();
        let apply = |n: Node| index.apply(&watcher::Event::Apply(n));
        assert!(apply(node("n1", &[("zone", "a"), ("host", "n1")])));
        assert!(apply(node("n2", &[("zone", "b"), ("host", "n2")])));
        assert!(
            !apply(node("n2", &[("zone", "b"), ("host", "n2")])),
            "heartbeat"
        );
        let any = |pairs: &[(&str, &str)]| index.read().any_with(&labels(pairs));
        assert!(any(&[("zone", "a"), ("host", "n1")]));
        assert!(!any(&[("zone", "a"), ("host", "n2")]), "both on one node");
        assert!(any(&[]));
        assert_eq!(
            index
                .read()
                .with_all(&labels(&[("zone", "b")]))
                .map(Iterator::collect::<Vec<_>>),
            Some(vec!["n2"])
        );
        assert!(apply(node("n1", &[("zone", "c"), ("host", "n1")])));
        assert!(!any(&[("zone", "a")]), "zone a is gone");
        assert!(index.apply(&watcher::Event::Delete(node("n2", &[]))));
        assert!(!any(&[("host", "n2")]));
        index.apply(&watcher::Event::<Node>::Init);
        index.apply(&watcher::Event::InitApply(node("n3", &[("host", "n3")])));
        assert!(any(&[("host", "n1")]), "old state until InitDone");
        assert!(index.apply(&watcher::Event::<Node>::InitDone));
        assert!(!any(&[("host", "n1")]));
        assert!(any(&[("host", "n3")]));
    }
}
