//! The pods of workloads PersistentPodStates target that the pod watch saw deleted lately, by
//! namespace and name: the pod of that name cached now came after each of them (a name is held by one pod at a time, and the
//! watch brings a name's changes in order). A state recorded for one of them is older than the
//! cached pod; a state recorded for a pod this cache never saw go may be newer (recorded by a
//! predecessor whose cache was ahead), and is read live before it is written over.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::trim::CachedPod;
use crate::shared::Shared;

/// How long a pod seen deleted is remembered: a pod re-created later than that (or one a relist
/// missed) is read live once instead.
const KEPT_FOR: Duration = Duration::from_secs(3600);

/// How many uids are remembered per name (a pod deleted again before it was recorded).
const UIDS_PER_NAME: usize = 4;

/// How often what is older than [`KEPT_FOR`] is swept.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Pods seen deleted, by namespace and name: their uids, newest last.
#[derive(Debug)]
pub struct GonePods {
    by_namespace: HashMap<Shared, HashMap<Box<str>, Gone>>,
    swept: Instant,
}

#[derive(Debug)]
struct Gone {
    uids: Vec<Box<str>>,
    at: Instant,
}

impl Default for GonePods {
    fn default() -> Self {
        Self {
            by_namespace: HashMap::new(),
            swept: Instant::now(),
        }
    }
}

impl GonePods {
    /// `pod` was deleted at `now`.
    pub fn went(&mut self, pod: &CachedPod, now: Instant) {
        if let Some(uid) = pod.uid.as_deref() {
            self.remember(&pod.namespace, &pod.name, uid, now);
        }
    }

    /// The pod `namespace/name` of `uid` is known gone at `now` (read live: another pod holds
    /// the name).
    pub fn remember(&mut self, namespace: &str, name: &str, uid: &str, now: Instant) {
        if now.saturating_duration_since(self.swept) >= SWEEP_EVERY {
            self.by_namespace.retain(|_, names| {
                names.retain(|_, gone| now.saturating_duration_since(gone.at) < KEPT_FOR);
                !names.is_empty()
            });
            self.swept = now;
        }
        let gone = self
            .by_namespace
            .entry(Shared::from(namespace))
            .or_default()
            .entry(name.into())
            .or_insert_with(|| Gone {
                uids: Vec::new(),
                at: now,
            });
        gone.at = now;
        if !gone.uids.iter().any(|u| &**u == uid) {
            if gone.uids.len() == UIDS_PER_NAME {
                gone.uids.remove(0);
            }
            gone.uids.push(uid.into());
        }
    }

    /// Whether the pod `namespace/name` of `uid` is known gone at `now` (remembered for less
    /// than [`KEPT_FOR`]: what a sweep drops is not told one way before it and the other after).
    pub fn is_gone(&self, namespace: &str, name: &str, uid: &str, now: Instant) -> bool {
        self.by_namespace
            .get(namespace)
            .and_then(|names| names.get(name))
            .is_some_and(|gone| {
                now.saturating_duration_since(gone.at) < KEPT_FOR
                    && gone.uids.iter().any(|u| &**u == uid)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, uid: &str) -> CachedPod {
        CachedPod {
            name: name.into(),
            namespace: Shared::from("ns"),
            uid: Some(uid.into()),
            ..CachedPod::default()
        }
    }

    #[test]
    fn pods_seen_deleted_are_known_gone_by_namespace_name_and_uid() {
        let mut gone = GonePods::default();
        let now = Instant::now();
        gone.went(&pod("web-0", "a"), now);
        gone.remember("ns", "web-1", "r", now);
        gone.went(
            &CachedPod {
                uid: None,
                ..pod("web-2", "")
            },
            now,
        );
        assert!(gone.is_gone("ns", "web-0", "a", now));
        assert!(
            gone.is_gone("ns", "web-1", "r", now),
            "known gone from a live read"
        );
        assert!(!gone.is_gone("ns", "web-0", "b", now), "another uid");
        assert!(!gone.is_gone("ns", "web-3", "a", now), "another name");
        assert!(
            !gone.is_gone("other", "web-0", "a", now),
            "another namespace"
        );
        assert_eq!(
            gone.by_namespace["ns"].len(),
            2,
            "a pod with no uid is not kept"
        );
    }

    #[test]
    fn a_name_keeps_its_last_uids_and_is_forgotten_after_a_while() {
        let mut gone = GonePods::default();
        let start = Instant::now();
        for uid in ["a", "b", "c", "d", "e"] {
            gone.went(&pod("web-0", uid), start);
        }
        assert!(
            !gone.is_gone("ns", "web-0", "a", start),
            "the oldest uid goes first"
        );
        assert!(
            ["b", "c", "d", "e"]
                .iter()
                .all(|u| gone.is_gone("ns", "web-0", u, start))
        );
        // Seen again later: a name remembered is kept from its last delete on; one older than
        // kept is told gone by no one, swept or not.
        gone.went(&pod("web-1", "x"), start);
        gone.went(&pod("web-0", "e"), start + KEPT_FOR / 2);
        assert!(
            !gone.is_gone("ns", "web-1", "x", start + KEPT_FOR),
            "not swept yet, too old"
        );
        gone.went(&pod("web-2", "y"), start + KEPT_FOR + SWEEP_EVERY);
        let later = start + KEPT_FOR + SWEEP_EVERY;
        assert!(!gone.is_gone("ns", "web-1", "x", later));
        assert!(gone.is_gone("ns", "web-0", "e", later));
        assert!(gone.is_gone("ns", "web-2", "y", later));
        assert_eq!(gone.by_namespace["ns"].len(), 2, "swept");
    }
}
