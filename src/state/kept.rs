//! Which pod annotations the pod cache keeps: the webhook's own marks, the IP requests of the
//! CNI presets, and every key a PersistentPodState names in `persistentPodAnnotations`. The
//! rest (a service mesh's sidecar status, a scraper's settings, a tool's last applied
//! configuration) is dropped as a pod is cached, so what a pod costs does not grow with what
//! other components write on it.
//!
//! Until the PersistentPodStates have first listed, every annotation is kept (the keys they
//! name are not known yet); once they have, the pods cached by then are trimmed. A key named
//! for the first time later is missing from the pods cached before: the pods are listed again
//! (the pod watch is told by a generation that rises), and until that list is done
//! [`KeptAnnotations::cover`] says so, so that a PersistentPodState naming the key records no
//! state without it. A key stays kept once named (until the process restarts).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use tokio::sync::watch;

use super::trim::CachedPod;
use crate::api::ip_request::{ANTREA_IP_ANNOTATION, CALICO_IP_ANNOTATION, KUBE_OVN_IP_ANNOTATION};
use crate::api::{INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION};

/// The annotations every cached pod keeps, whatever the PersistentPodStates name: the
/// webhook's marks (read to tell a pinned pod) and the presets' IP requests (read to tell who
/// holds an IP before its status says so).
const ALWAYS_KEPT: [&str; 5] = [
    INJECTED_ANNOTATION,
    INJECTED_REQUIRED_ANNOTATION,
    CALICO_IP_ANNOTATION,
    KUBE_OVN_IP_ANNOTATION,
    ANTREA_IP_ANNOTATION,
];

/// Which pod annotations are kept, and whether the cached pods carry every key named so far.
pub struct KeptAnnotations {
    keys: RwLock<Keys>,
    /// The generation of the named keys, for the pod watch: it rises when a key is named for
    /// the first time after the first list of PersistentPodStates.
    generation: watch::Sender<u64>,
    /// The generation of the keys when the pods' list under way began.
    listing: AtomicU64,
    /// The generation the cached pods cover: that of the keys when their last completed list
    /// began.
    covered: AtomicU64,
}

/// The keys named so far.
struct Keys {
    /// Every annotation is kept: the PersistentPodStates have not listed yet.
    all: bool,
    /// Each key named, with the generation that first named it.
    named: HashMap<Box<str>, u64>,
}

impl Keys {
    fn keeps(&self, key: &str) -> bool {
        self.all || ALWAYS_KEPT.contains(&key) || self.named.contains_key(key)
    }
}

impl Default for KeptAnnotations {
    fn default() -> Self {
        Self {
            keys: RwLock::new(Keys {
                all: true,
                named: HashMap::new(),
            }),
            generation: watch::channel(0).0,
            listing: AtomicU64::new(0),
            covered: AtomicU64::new(0),
        }
    }
}

/// A read of the keys kept, held while a pod event is applied: the keys cannot change between
/// trimming a pod and caching it.
pub struct Keeping<'a>(RwLockReadGuard<'a, Keys>);

impl Keeping<'_> {
    /// `pod` with only the annotations kept.
    pub fn trim(&self, pod: Arc<CachedPod>) -> Arc<CachedPod> {
        if self.0.all {
            return pod;
        }
        pod.keeping_annotations(|key| self.0.keeps(key))
    }
}

impl KeptAnnotations {
    /// The keys kept, read until the guard is dropped.
    pub fn keeping(&self) -> Keeping<'_> {
        Keeping(crate::sync::read(&self.keys))
    }

    /// The pods' list begins (its `Init`; the keys read with [`KeptAnnotations::keeping`]).
    pub fn pods_listing(&self, _keeping: &Keeping<'_>) {
        self.listing
            .store(*self.generation.borrow(), Ordering::Release);
    }

    /// The pods' list is done (its `InitDone`): the cached pods carry every key named before
    /// it began.
    pub fn pods_listed(&self, _keeping: &Keeping<'_>) {
        self.covered
            .store(self.listing.load(Ordering::Acquire), Ordering::Release);
    }

    /// Names `keys` (a PersistentPodState's `persistentPodAnnotations`); returns whether one
    /// is named for the first time after the first list (the pods are to be listed again).
    pub fn name<'k>(&self, keys: impl IntoIterator<Item = &'k str>) -> bool {
        let keys: Vec<&str> = keys.into_iter().collect();
        let known = |k: &Keys, key: &str| ALWAYS_KEPT.contains(&key) || k.named.contains_key(key);
        {
            let k = crate::sync::read(&self.keys);
            if keys.iter().all(|key| known(&k, key)) {
                return false;
            }
        }
        let mut k = crate::sync::write(&self.keys);
        let new: Vec<&str> = keys.into_iter().filter(|key| !known(&k, key)).collect();
        if new.is_empty() {
            return false;
        }
        let later = !k.all;
        let generation = *self.generation.borrow() + u64::from(later);
        for key in new {
            k.named.insert(key.into(), generation);
        }
        if later {
            self.generation.send_replace(generation);
        }
        later
    }

    /// The PersistentPodStates have listed: from now on only the keys named are kept.
    /// `trim_cached` is called, the keys locked, to trim the pods cached so far; returns whether
    /// this was the first list.
    pub fn pps_listed(&self, trim_cached: impl FnOnce(&dyn Fn(&str) -> bool)) -> bool {
        let mut k = crate::sync::write(&self.keys);
        if !k.all {
            return false;
        }
        k.all = false;
        trim_cached(&|key| k.keeps(key));
        true
    }

    /// Whether the cached pods carry every one of `keys` they have: every annotation is kept
    /// still, or each of `keys` is kept always or was named before the pods' last completed
    /// list began (a key never named: false). Once true for a key, true for good.
    pub fn cover<'k>(&self, mut keys: impl Iterator<Item = &'k str>) -> bool {
        let k = crate::sync::read(&self.keys);
        let covered = self.covered.load(Ordering::Acquire);
        keys.all(|key| {
            k.all
                || ALWAYS_KEPT.contains(&key)
                || k.named.get(key).is_some_and(|named| *named <= covered)
        })
    }

    /// The generation of the named keys, for the pod watch to list again as it rises.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Arc<CachedPod> {
        let pod: k8s_openapi::api::core::v1::Pod =
            serde_json::from_value(serde_json::json!({"metadata": {
            "name": "web-0", "namespace": "ns",
            "annotations": {"example.com/slot": "3", "sidecar.istio.io/status": "{...}",
                INJECTED_ANNOTATION: "web", CALICO_IP_ANNOTATION: "[\"10.0.0.5\"]"}}}))
            .expect("pod");
        Arc::new(CachedPod::from(pod))
    }

    fn keys(pod: &CachedPod) -> Vec<&str> {
        let all = ["example.com/slot", "sidecar.istio.io/status"];
        all.into_iter()
            .chain(ALWAYS_KEPT)
            .filter(|k| pod.annotations.get(k).is_some())
            .collect()
    }

    #[test]
    fn every_annotation_is_kept_until_the_pps_have_listed_then_only_those_read() {
        let kept = KeptAnnotations::default();
        assert!(!kept.name(["example.com/slot"]), "before the first list");
        let before = kept.keeping().trim(pod());
        assert_eq!(keys(&before).len(), 4, "all kept: {:?}", keys(&before));
        let mut trimmed = None;
        assert!(kept.pps_listed(|keep| trimmed = before.annotations.only(keep)));
        let trimmed = trimmed.expect("the cached pod trimmed");
        let expected = [
            "example.com/slot",
            INJECTED_ANNOTATION,
            CALICO_IP_ANNOTATION,
        ];
        let mut got: Vec<&str> = expected
            .into_iter()
            .filter(|k| trimmed.get(k).is_some())
            .collect();
        got.sort_unstable();
        let mut want = expected.to_vec();
        want.sort_unstable();
        assert_eq!(got, want);
        assert_eq!(trimmed.get("sidecar.istio.io/status"), None);
        assert_eq!(
            kept.keeping().trim(pod()).annotations,
            trimmed,
            "a pod cached later"
        );
        assert!(
            !kept.pps_listed(|_| panic!("trimmed once")),
            "a relist trims nothing"
        );
        assert!(kept.cover(["example.com/slot", INJECTED_ANNOTATION].into_iter()));
    }

    #[test]
    fn a_key_named_after_the_first_list_is_covered_once_a_pods_list_begun_after_it_is_done() {
        let kept = KeptAnnotations::default();
        kept.pps_listed(|_| {});
        kept.pods_listing(&kept.keeping());
        kept.pods_listed(&kept.keeping());
        let told = kept.subscribe();
        assert!(
            kept.name(["example.com/rack"]),
            "named for the first time: list again"
        );
        assert!(told.has_changed().expect("sender alive"));
        assert!(!kept.name(["example.com/rack"]), "named already");
        assert!(!kept.cover(["example.com/rack"].into_iter()));
        assert_eq!(
            kept.keeping()
                .trim(pod())
                .annotations
                .get("example.com/slot"),
            None,
            "not named"
        );
        // A list begun before a key is named does not cover it.
        kept.pods_listing(&kept.keeping());
        assert!(kept.name(["example.com/slot"]));
        kept.pods_listed(&kept.keeping());
        assert!(kept.cover(["example.com/rack"].into_iter()));
        assert!(!kept.cover(["example.com/rack", "example.com/slot"].into_iter()));
        assert_eq!(
            kept.keeping()
                .trim(pod())
                .annotations
                .get("example.com/slot"),
            Some("3")
        );
        kept.pods_listing(&kept.keeping());
        kept.pods_listed(&kept.keeping());
        assert!(kept.cover(["example.com/rack", "example.com/slot"].into_iter()));
        assert!(!kept.cover(["example.com/never-named"].into_iter()));
    }
}
