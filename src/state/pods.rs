//! The pod cache: every pod once, as a compact [`CachedPod`] behind an `Arc`, found by name, by
//! controlling workload and by IP from the same table. Unlike a reflector store it keeps no
//! owned key per pod (the name table hashes the pods' own names) and the indexes hold the same
//! `Arc`s, so a pod costs its record and three pointers.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use hashbrown::HashTable;

use super::index::Indexer;
use super::trim::CachedPod;
use crate::api::ip_request::requested_ips;
use crate::workload::WorkloadRef;

/// Pods by namespace and name, by controlling workload and by held IP.
#[derive(Default)]
pub struct PodTable {
    hasher: RandomState,
    by_name: HashTable<Arc<CachedPod>>,
    by_workload: HashMap<WorkloadRef, Vec<Arc<CachedPod>>>,
    by_ip: HashMap<Box<str>, Vec<Arc<CachedPod>>>,
}

impl std::fmt::Debug for PodTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodTable")
            .field("pods", &self.by_name.len())
            .finish()
    }
}

impl PodTable {
    fn hash(&self, namespace: &str, name: &str) -> u64 {
        self.hasher.hash_one((namespace, name))
    }

    /// The pod `namespace/name`.
    pub fn get(&self, namespace: &str, name: &str) -> Option<&Arc<CachedPod>> {
        self.by_name.find(self.hash(namespace, name), |p| {
            &*p.name == name && &*p.namespace == namespace
        })
    }

    /// How many pods are cached.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether no pod is cached.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// The pods whose controller is `workload`, by name.
    pub fn of_workload(&self, workload: &WorkloadRef) -> Vec<Arc<CachedPod>> {
        let mut pods = self.by_workload.get(workload).cloned().unwrap_or_default();
        pods.sort_by(|a, b| a.name.cmp(&b.name));
        pods
    }

    /// Every cached pod, in no order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<CachedPod>> {
        self.by_name.iter()
    }

    /// Drops from every cached pod the annotations whose key `keep` refuses; how many pods
    /// changed.
    pub fn keep_annotations(&mut self, keep: impl Fn(&str) -> bool) -> usize {
        let changed: Vec<Arc<CachedPod>> = self
            .by_name
            .iter()
            .filter_map(|p| p.annotations.only(&keep).map(|a| (p, a)))
            .map(|(p, annotations)| {
                Arc::new(CachedPod {
                    annotations,
                    ..CachedPod::clone(p)
                })
            })
            .collect();
        for pod in &changed {
            self.upsert(pod);
        }
        changed.len()
    }

    /// The cached pod of `listed`'s uid and resourceVersion, if any, takes `listed`'s
    /// annotations.
    pub fn fill_annotations(&mut self, listed: &Arc<CachedPod>) {
        let Some(cached) = self.get(&listed.namespace, &listed.name) else {
            return;
        };
        let same = cached.uid == listed.uid
            && cached.resource_version.is_some()
            && cached.resource_version == listed.resource_version;
        if !same || cached.annotations == listed.annotations {
            return;
        }
        let filled = Arc::new(CachedPod {
            annotations: listed.annotations.clone(),
            ..CachedPod::clone(cached)
        });
        self.upsert(&filled);
    }

    /// The live pods holding `ip`.
    pub fn holders(&self, ip: &str) -> impl Iterator<Item = &Arc<CachedPod>> {
        self.by_ip.get(ip).into_iter().flatten()
    }

    fn take(&mut self, namespace: &str, name: &str) -> Option<Arc<CachedPod>> {
        let hash = self.hash(namespace, name);
        let old = self
            .by_name
            .find_entry(hash, |p| &*p.name == name && &*p.namespace == namespace)
            .ok()?
            .remove()
            .0;
        let same = |p: &Arc<CachedPod>| Arc::ptr_eq(p, &old);
        if let Some(w) = old.workload()
            && let Some(pods) = self.by_workload.get_mut(&w)
        {
            pods.retain(|p| !same(p));
            if pods.is_empty() {
                self.by_workload.remove(&w);
            }
        }
        for ip in held_ips(&old) {
            if let Some(pods) = self.by_ip.get_mut(ip.as_str()) {
                pods.retain(|p| !same(p));
                if pods.is_empty() {
                    self.by_ip.remove(ip.as_str());
                }
            }
        }
        Some(old)
    }
}

impl Indexer<Arc<CachedPod>> for PodTable {
    fn upsert(&mut self, pod: &Arc<CachedPod>) -> bool {
        let hash = self.hash(&pod.namespace, &pod.name);
        let (workload, ips) = (pod.workload(), held_ips(pod));
        if let Ok(mut entry) = self
            .by_name
            .find_entry(hash, |p| p.name == pod.name && p.namespace == pod.namespace)
            && entry.get().workload() == workload
            && held_ips(entry.get()) == ips
        {
            // Same workload and IPs (most updates): the new record takes the old one's place
            // in each list, which keeps its order and moves nothing.
            let old = std::mem::replace(entry.get_mut(), pod.clone());
            let swap = |pods: &mut Vec<Arc<CachedPod>>| {
                if let Some(slot) = pods.iter_mut().find(|p| Arc::ptr_eq(p, &old)) {
                    *slot = pod.clone();
                }
            };
            if let Some(pods) = workload.and_then(|w| self.by_workload.get_mut(&w)) {
                swap(pods);
            }
            for ip in &ips {
                if let Some(pods) = self.by_ip.get_mut(ip.as_str()) {
                    swap(pods);
                }
            }
            return *old != **pod;
        }
        let old = self.take(&pod.namespace, &pod.name);
        let changed = old.as_deref() != Some(&**pod);
        let pod = pod.clone();
        if let Some(w) = workload {
            self.by_workload.entry(w).or_default().push(pod.clone());
        }
        for ip in ips {
            self.by_ip
                .entry(ip.into_boxed_str())
                .or_default()
                .push(pod.clone());
        }
        let hasher = &self.hasher;
        self.by_name
            .insert_unique(hash, pod, |p| hasher.hash_one((&*p.namespace, &*p.name)));
        changed
    }

    fn remove(&mut self, pod: &Arc<CachedPod>) -> bool {
        self.take(&pod.namespace, &pod.name).is_some()
    }
}

/// The IPs a pod holds: none once it has finished; else its status IPs and, from its creation
/// on, those it requests through a preset's annotation (before its status reports them).
fn held_ips(pod: &CachedPod) -> Vec<String> {
    if pod.finished {
        return Vec::new();
    }
    let mut ips: Vec<String> = pod.ips.iter().map(|ip| ip.to_string()).collect();
    for ip in requested_ips(|key| pod.annotations.get(key)) {
        if !ips.contains(&ip) {
            ips.push(ip);
        }
    }
    ips
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::index::Shared;
    use crate::state::trim::WatchedPod;
    use crate::workload::GroupKind;
    use kube::runtime::watcher;
    use serde_json::{Value, json};

    fn decode(object: Value) -> Arc<CachedPod> {
        Arc::new(
            serde_json::from_value::<WatchedPod>(object)
                .expect("pod")
                .pod,
        )
    }

    fn pod(name: &str, owner: Option<&str>) -> Arc<CachedPod> {
        let owners = owner.map(|o| {
            json!([{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": o, "uid": "u", "controller": true}])
        });
        decode(json!({"metadata": {"name": name, "namespace": "ns", "ownerReferences": owners}}))
    }

    fn sts(name: &str) -> WorkloadRef {
        WorkloadRef {
            namespace: "ns".into(),
            kind: GroupKind::native_statefulset(),
            name: name.into(),
        }
    }

    fn names(table: &Shared<PodTable>, workload: &str) -> Vec<String> {
        let pods = table.read().of_workload(&sts(workload));
        pods.iter().map(|p| p.name.to_string()).collect()
    }

    #[test]
    fn upstream_bug_11_lookups_use_an_index_that_follows_applies_moves_deletes_and_relists() {
        let table = Shared::<PodTable>::default();
        table.apply(&watcher::Event::Apply(pod("a-1", Some("a"))));
        table.apply(&watcher::Event::Apply(pod("a-0", Some("a"))));
        table.apply(&watcher::Event::Apply(pod("bare", None)));
        assert_eq!(names(&table, "a"), vec!["a-0", "a-1"], "by name");
        assert_eq!(table.read().len(), 3);
        assert!(table.read().get("ns", "bare").is_some());
        assert!(table.read().get("other", "bare").is_none());

        // the owner changes: the pod moves
        table.apply(&watcher::Event::Apply(pod("a-1", Some("b"))));
        assert_eq!(names(&table, "a"), vec!["a-0"]);
        assert_eq!(names(&table, "b"), vec!["a-1"]);
        assert_eq!(table.read().len(), 3, "replaced, not added");

        table.apply(&watcher::Event::Delete(pod("a-0", Some("a"))));
        assert!(names(&table, "a").is_empty());
        assert!(table.read().get("ns", "a-0").is_none());

        // a relist replaces everything at InitDone, not before
        table.apply(&watcher::Event::<Arc<CachedPod>>::Init);
        table.apply(&watcher::Event::InitApply(pod("c-0", Some("c"))));
        assert_eq!(names(&table, "b"), vec!["a-1"]);
        table.apply(&watcher::Event::<Arc<CachedPod>>::InitDone);
        assert!(names(&table, "b").is_empty());
        assert_eq!(names(&table, "c"), vec!["c-0"]);
        assert_eq!(table.read().len(), 1);
    }

    #[test]
    fn an_update_that_keeps_workload_and_ips_is_seen_through_every_index() {
        let table = Shared::<PodTable>::default();
        let running = decode(json!({"metadata": {"name": "a-0", "namespace": "ns",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "a",
                "uid": "u", "controller": true}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}]}}));
        table.apply(&watcher::Event::Apply(running.clone()));
        table.apply(&watcher::Event::Apply(pod("a-1", Some("a"))));
        let mut ready = (*running).clone();
        ready.ready = true;
        let ready = Arc::new(ready);
        table.apply(&watcher::Event::Apply(ready.clone()));

        let read = table.read();
        assert_eq!(read.len(), 2);
        let by_workload = read.of_workload(&sts("a"));
        assert_eq!(by_workload.len(), 2, "{by_workload:?}");
        assert!(
            Arc::ptr_eq(&by_workload[0], &ready),
            "by workload: the new record"
        );
        let by_ip: Vec<_> = read.holders("10.0.0.1").collect();
        assert_eq!(by_ip.len(), 1);
        assert!(Arc::ptr_eq(by_ip[0], &ready), "by IP: the new record");
        assert!(
            read.get("ns", "a-0")
                .is_some_and(|p| Arc::ptr_eq(p, &ready))
        );
    }

    fn pod_with_ip(name: &str, ip: &str, phase: &str) -> Arc<CachedPod> {
        decode(json!({"metadata": {"name": name, "namespace": "ns"},
            "status": {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}]}}))
    }

    fn holders(table: &Shared<PodTable>, ip: &str) -> Vec<String> {
        table
            .read()
            .holders(ip)
            .map(|p| p.name.to_string())
            .collect()
    }

    #[test]
    fn ip_holders_follow_pods_until_they_are_gone_or_finished() {
        let table = Shared::<PodTable>::default();
        table.apply(&watcher::Event::Apply(pod_with_ip(
            "a", "10.0.0.1", "Running",
        )));
        assert_eq!(holders(&table, "10.0.0.1"), ["a"]);
        table.apply(&watcher::Event::Apply(pod_with_ip(
            "a", "10.0.0.2", "Running",
        )));
        assert!(holders(&table, "10.0.0.1").is_empty(), "the IP moved");
        table.apply(&watcher::Event::Apply(pod_with_ip(
            "a",
            "10.0.0.2",
            "Succeeded",
        )));
        assert!(
            holders(&table, "10.0.0.2").is_empty(),
            "a finished pod holds nothing"
        );
        table.apply(&watcher::Event::Apply(pod_with_ip(
            "b", "10.0.0.3", "Running",
        )));
        table.apply(&watcher::Event::Apply(pod_with_ip(
            "c", "10.0.0.3", "Running",
        )));
        assert_eq!(holders(&table, "10.0.0.3"), ["b", "c"]);
        table.apply(&watcher::Event::Delete(pod_with_ip(
            "b", "10.0.0.3", "Running",
        )));
        assert_eq!(holders(&table, "10.0.0.3"), ["c"]);
    }

    #[test]
    fn a_pod_holds_the_ip_it_requests_from_its_creation() {
        let table = Shared::<PodTable>::default();
        // Just created: no status yet, a Calico request.
        let created = decode(json!({"metadata": {"name": "c", "namespace": "ns",
            "annotations": {"cni.projectcalico.org/ipAddrs": "[\"10.0.0.7\"]"}}}));
        table.apply(&watcher::Event::Apply(created.clone()));
        assert_eq!(holders(&table, "10.0.0.7"), ["c"]);
        let mut finished = (*created).clone();
        finished.finished = true;
        table.apply(&watcher::Event::Apply(Arc::new(finished)));
        assert!(
            holders(&table, "10.0.0.7").is_empty(),
            "a finished pod holds nothing"
        );
    }
}
