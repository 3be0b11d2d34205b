//! The pure core of the controller: from a PersistentPodState, its workload, the workload's pods
//! and the nodes, the whole change a reconcile makes ([`change`]): the status it should have, the
//! minimal merge patch to it, and which states were recorded, pruned and restored.

use std::collections::{BTreeMap, HashMap};

use litemap::LiteMap;
use serde_json::{Map, Value};

use crate::api::PersistentPodStateSpec;
use crate::api::{
    INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION, IpRestore, NodeRestore,
    PersistentPodStateStatus, PodState, Restore, RetentionPolicy, decode_required, encode_required,
};
use crate::placement::{Dropped, HOSTNAME_LABEL, Required};
use crate::shared::Shared;
use crate::state::trim::CachedPod;
use crate::workload::{WorkloadInfo, pod_ordinal};

/// What is known about the target workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// It exists.
    Live(WorkloadInfo),
    /// It does not exist, or is being deleted: each state goes with its pod.
    Gone,
    /// Its kind is not watched, so whether it exists is unknown: states are recorded but
    /// never pruned.
    Unknown,
}

/// The world as the controller sees it for one PersistentPodState.
pub struct Observed<'a> {
    /// The target workload.
    pub target: Target,
    /// The pods whose controller ownerReference names the target.
    pub pods: &'a [&'a CachedPod],
    /// Whether a pod of that name exists in the namespace (whoever owns it).
    pub pod_exists: &'a dyn Fn(&str) -> bool,
    /// A node, if it is known.
    pub node: &'a dyn Fn(&str) -> Option<NodeSeen>,
    /// Whether the pod of that name and uid is known gone: a pod of that name cached now came
    /// after it ([`crate::state::Caches::pod_is_gone`]).
    pub gone: &'a dyn Fn(&str, &str) -> bool,
}

/// What recording reads of a node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeSeen {
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its uid.
    pub uid: Option<String>,
}

/// A node that was replaced under the name a state recorded (another uid): the pod's local
/// data there is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replaced {
    /// The pod whose state recorded the node.
    pub pod: String,
    /// The node's name.
    pub node: String,
    /// The uid recorded.
    pub recorded_uid: String,
    /// The uid of the node of that name now.
    pub uid: String,
}

/// The state to record for a Ready pod with a node, or `None` if it cannot be recorded yet
/// (not Ready, no node, or the node is not known).
pub fn pod_state(
    spec: &PersistentPodStateSpec,
    pod: &CachedPod,
    nodes: &dyn Fn(&str) -> Option<NodeSeen>,
) -> Option<PodState> {
    if !pod.ready {
        return None;
    }
    let node = pod.node_name.as_ref().filter(|n| !n.is_empty())?;
    let keys = spec.topology_keys();
    let seen = nodes(node);
    let node_topology_labels = if keys.is_empty() {
        LiteMap::new()
    } else {
        let labels = &seen.as_ref()?.labels;
        keys.iter()
            .filter_map(|k| labels.get(*k).map(|v| (Shared::from(*k), Shared::from(v))))
            .collect()
    };
    let pod_annotations = &pod.annotations;
    let annotations = spec
        .persistent_annotation_keys()
        .filter_map(|key| {
            pod_annotations
                .get(key)
                .map(|v| (key.to_owned(), v.to_owned()))
        })
        .collect();
    Some(PodState {
        node_name: Some(node.clone()),
        node_topology_labels,
        annotations,
        pod_ips: pod.ips.iter().map(|ip| ip.to_string()).collect(),
        pod_uid: pod.uid(),
        node_uid: seen.and_then(|n| n.uid).map(Shared::from),
        last_restore: None,
    })
}

/// How a re-created pod (its state `now`) came back compared with the state it was steered back
/// to (`before`).
pub fn compare(before: &PodState, now: &PodState) -> Restore {
    let node = if before.node_name == now.node_name {
        NodeRestore::Kept
    } else {
        NodeRestore::Moved
    };
    let sorted = |ips: &[String]| {
        let mut v = ips.to_vec();
        v.sort();
        v
    };
    let ip = if before.pod_ips.is_empty() || now.pod_ips.is_empty() {
        IpRestore::None
    } else if sorted(&before.pod_ips) == sorted(&now.pod_ips) {
        IpRestore::Kept
    } else {
        IpRestore::Changed
    };
    Restore { node, ip }
}

/// A pod that came back since the last status, and how.
#[derive(Clone, Debug, PartialEq)]
pub struct Restoration {
    /// The pod's name.
    pub pod: String,
    /// The state it was steered back to.
    pub before: PodState,
    /// Its state now.
    pub now: PodState,
    /// How it came back.
    pub restore: Restore,
}

/// What one reconcile changes in a PersistentPodState's status, computed once: the shell
/// writes `patch` and reports the rest.
#[derive(Clone, Debug)]
pub struct StatusChange {
    /// The status it should have.
    pub status: PersistentPodStateStatus,
    /// The merge patch from the current status to it; `None`: nothing to write.
    pub patch: Option<Value>,
    /// States added or changed, by pod name.
    pub recorded: Vec<String>,
    /// States removed, by pod name.
    pub pruned: Vec<String>,
    /// Pods that came back since the current status.
    pub restorations: Vec<Restoration>,
    /// Nodes the current status recorded that were replaced under their name since.
    pub replaced: Vec<Replaced>,
}

/// The whole change a reconcile makes to a PersistentPodState named `pps_name` with `spec` (at
/// `generation`) whose status is `current`, as [`desired_status`] decides it; `bare`: without
/// the extension fields, which the CRD in the cluster does not keep
/// ([`PersistentPodStateStatus::without_extensions`]), so that the status settles.
pub fn change(
    pps_name: &str,
    spec: &PersistentPodStateSpec,
    generation: i64,
    current: Option<&PersistentPodStateStatus>,
    observed: &Observed<'_>,
    bare: bool,
) -> Result<StatusChange, serde_json::Error> {
    let mut status = desired_status(pps_name, spec, generation, current, observed);
    if bare {
        status = status.without_extensions();
    }
    // Equal statuses serialize equal: the usual reconcile (nothing changed) writes nothing
    // without serializing both.
    let patch = if current == Some(&status) {
        None
    } else {
        merge_patch(
            &serde_json::to_value(current)?,
            &serde_json::to_value(&status)?,
        )
    };
    let empty = BTreeMap::new();
    let old = current.map_or(&empty, |s| &s.pod_states);
    let (mut recorded, mut restorations) = (Vec::new(), Vec::new());
    for (pod, now) in &status.pod_states {
        let before = old.get(pod);
        if before == Some(now) {
            continue;
        }
        recorded.push(pod.clone());
        // Another pod of that name (another uid) whose restore was judged: it came back.
        if let (Some(before), Some(restore)) = (before, now.last_restore)
            && before.pod_uid != now.pod_uid
        {
            restorations.push(Restoration {
                pod: pod.clone(),
                before: before.clone(),
                now: now.clone(),
                restore,
            });
        }
    }
    let pruned = old
        .keys()
        .filter(|k| !status.pod_states.contains_key(*k))
        .cloned()
        .collect();
    let replaced = old
        .iter()
        .filter_map(|(pod, state)| {
            let (node, recorded_uid) = (state.node_name.as_ref()?, state.node_uid.as_ref()?);
            let uid = (observed.node)(node)?.uid?;
            (uid != *recorded_uid).then(|| Replaced {
                pod: pod.clone(),
                node: node.to_string(),
                recorded_uid: recorded_uid.to_string(),
                uid,
            })
        })
        .collect();
    Ok(StatusChange {
        status,
        patch,
        recorded,
        pruned,
        restorations,
        replaced,
    })
}

/// The status a PersistentPodState should have.
///
/// Ready pods with a node are (re-)recorded whenever what would be recorded differs from what
/// is; under `WhenScaled`, a state is dropped once its ordinal is not live and its pod is gone;
/// once the workload is gone, each state is dropped once its pod is gone (OpenKruise drops them
/// all at once, which loses the states of the pods of a StatefulSet deleted with
/// `--cascade=orphan` to be created again with other claim templates).
///
/// A pod re-created since its state was recorded (another uid) that the webhook steered back
/// (it carries the injected annotation naming `pps_name`) gets its `lastRestore` judged; the
/// summary fields `recorded` and `restored` follow the states.
pub fn desired_status(
    pps_name: &str,
    spec: &PersistentPodStateSpec,
    generation: i64,
    current: Option<&PersistentPodStateStatus>,
    observed: &Observed<'_>,
) -> PersistentPodStateStatus {
    let mut status = PersistentPodStateStatus {
        observed_generation: generation,
        ..PersistentPodStateStatus::default()
    };
    let workload = match &observed.target {
        Target::Gone => {
            if let Some(current) = current {
                status.pod_states = current
                    .pod_states
                    .iter()
                    .filter(|(name, _)| (observed.pod_exists)(name))
                    .map(|(name, state)| (name.clone(), state.clone()))
                    .collect();
            }
            summarize(&mut status);
            return status;
        }
        Target::Live(w) => Some(w),
        Target::Unknown => None,
    };
    status.pod_states = current.map(|c| c.pod_states.clone()).unwrap_or_default();

    for pod in observed.pods {
        if !of_workload(workload, pod) {
            continue;
        }
        if let Some(mut state) = pod_state(spec, pod, observed.node) {
            // A state recorded for another pod of that name not known to have gone before this
            // one may be newer (a predecessor's cache was ahead of this one): kept until this
            // cache, or a live read, tells.
            if let Some(before) = status.pod_states.get(&*pod.name)
                && superseded_unknown(pod, before, observed.gone)
            {
                continue;
            }
            let steered = pod.annotations.get(INJECTED_ANNOTATION) == Some(pps_name);
            state.last_restore = match status.pod_states.get(&*pod.name) {
                // A new pod of that name: judged if it was steered back to a node, else not
                // known (a state that names no node, its local data released, steers to none).
                Some(before) if before.pod_uid.is_some() && before.pod_uid != state.pod_uid => {
                    (steered && before.node_name.is_some()).then(|| compare(before, &state))
                }
                Some(before) => before.last_restore,
                None => None,
            };
            status.pod_states.insert(pod.name.to_string(), state);
        }
    }

    // Which ordinals are live is unknown where reserveOrdinals was read only in part: nothing
    // is pruned then (a live pod's state must never go).
    if let Some(w) = workload
        && spec.retention() == RetentionPolicy::WhenScaled
        && !w.reserved_truncated
    {
        status.pod_states.retain(|name, _| {
            let live = pod_ordinal(name).is_none_or(|o| w.is_live(o));
            live || (observed.pod_exists)(name)
        });
    }
    summarize(&mut status);
    status
}

/// Whether `before`, recorded for another pod of `pod`'s name, is not known to have gone
/// before `pod` came.
fn superseded_unknown(
    pod: &CachedPod,
    before: &PodState,
    gone: &dyn Fn(&str, &str) -> bool,
) -> bool {
    match (before.pod_uid.as_deref(), pod.uid.as_deref()) {
        (Some(recorded), Some(uid)) => recorded != uid && !gone(&pod.name, recorded),
        _ => false,
    }
}

/// Whether `pod` is the workload's: not left behind by an earlier workload of its name.
fn of_workload(workload: Option<&WorkloadInfo>, pod: &CachedPod) -> bool {
    let owner_uid = pod.controller.as_deref().map(|o| &*o.uid);
    !matches!((workload, owner_uid), (Some(w), Some(uid)) if !w.uid.is_empty() && w.uid != uid)
}

/// The pods [`desired_status`] would record whose recorded state names another pod of their
/// name, not known to have gone before them (`observed.gone`), with the uid it names: read live
/// before their states are written over ([`desired_status`] keeps them until then).
pub fn unsure<'a>(
    spec: &PersistentPodStateSpec,
    current: Option<&PersistentPodStateStatus>,
    observed: &Observed<'a>,
) -> Vec<(&'a CachedPod, String)> {
    let workload = match &observed.target {
        Target::Gone => return Vec::new(),
        Target::Live(w) => Some(w),
        Target::Unknown => None,
    };
    let Some(current) = current else {
        return Vec::new();
    };
    observed
        .pods
        .iter()
        .filter_map(|p| {
            let before = current.pod_states.get(&*p.name)?;
            let recorded = before.pod_uid.clone()?;
            (superseded_unknown(p, before, observed.gone)
                && of_workload(workload, p)
                && pod_state(spec, p, observed.node).is_some())
            .then_some((*p, recorded))
        })
        .collect()
}

/// Sets the summary fields from the states.
fn summarize(status: &mut PersistentPodStateStatus) {
    let judged: Vec<Restore> = status
        .pod_states
        .values()
        .filter_map(|s| s.last_restore)
        .collect();
    status.recorded = Some(i32::try_from(status.pod_states.len()).unwrap_or(i32::MAX));
    status.restored = (!judged.is_empty()).then(|| {
        let restored = judged.iter().filter(|r| r.restored()).count();
        format!("{restored}/{}", judged.len())
    });
}

/// The recorded states whose required values cannot all be injected now (their node or zone is
/// gone or lost, as `place` judges): a re-created pod gets less than was recorded. What is left
/// out, by pod name.
pub fn unplaceable_states(
    spec: &PersistentPodStateSpec,
    status: &PersistentPodStateStatus,
    place: &dyn Fn(&BTreeMap<String, String>) -> Required,
) -> BTreeMap<String, Dropped> {
    // Asked once per distinct set of values: states share them (a zone), and placing values
    // whose nodes are lost looks at every node.
    let mut placed: HashMap<BTreeMap<String, String>, Option<Dropped>> = HashMap::new();
    status
        .pod_states
        .iter()
        .filter_map(|(pod, state)| {
            let values = spec.required_values(state);
            let dropped = match placed.get(&values) {
                Some(dropped) => dropped.clone(),
                None => {
                    let dropped = place(&values).dropped;
                    placed.insert(values, dropped.clone());
                    dropped
                }
            };
            dropped.map(|d| (pod.clone(), d))
        })
        .collect()
}

/// A pod the webhook pinned that no usable node can take any more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stranded {
    /// Its name.
    pub pod: String,
    /// Its uid (a delete precondition: only this pod).
    pub uid: String,
    /// Its resourceVersion (a delete precondition: only as seen).
    pub resource_version: Option<String>,
    /// The node it was pinned to (its hostname value when pinned by one, else the values).
    pub node: String,
    /// The required values the webhook added that no usable node has, and why.
    pub dropped: Dropped,
}

/// The pods of `pods` that the PersistentPodState `pps_name` steered, that wait unscheduled
/// (not being deleted), and whose required values the webhook added (its
/// `persistent-pod-state.io/injected-required` annotation) no usable node has any more, as
/// `place` judges: they wait for nothing, and only because of the webhook. A value the pod set
/// itself is never one of them.
pub fn stranded(
    pps_name: &str,
    pods: &[&CachedPod],
    place: &dyn Fn(&BTreeMap<String, String>) -> Required,
) -> Vec<Stranded> {
    pods.iter()
        .filter_map(|p| Some((p, pinned(pps_name, p)?)))
        .filter_map(|(p, values)| {
            let dropped = place(&values).dropped?;
            let node = values
                .get(HOSTNAME_LABEL)
                .cloned()
                .unwrap_or_else(|| encode_required(&values));
            Some(Stranded {
                pod: p.name.to_string(),
                uid: p.uid()?,
                resource_version: p.resource_version(),
                node,
                dropped,
            })
        })
        .collect()
}

/// The pods of `pods` pinned by a PersistentPodState that `exists` says is gone (deleted, or
/// no longer generated), by that PersistentPodState (namespace, name): each waits where it was
/// steered ([`pinned`]) and is controlled by a workload (which re-creates it). No reconcile of
/// their PersistentPodState releases them.
pub fn orphaned<'a>(
    pods: &[&'a CachedPod],
    exists: &dyn Fn(&str, &str) -> bool,
) -> BTreeMap<(String, String), Vec<&'a CachedPod>> {
    let mut by_pps: BTreeMap<(String, String), Vec<&CachedPod>> = BTreeMap::new();
    for pod in pods.iter().filter(|p| p.controller.is_some()) {
        let Some(pps) = pod.annotations.get(INJECTED_ANNOTATION) else {
            continue;
        };
        if pinned(pps, pod).is_some() && !exists(&pod.namespace, pps) {
            by_pps
                .entry(((*pod.namespace).to_owned(), pps.to_owned()))
                .or_default()
                .push(pod);
        }
    }
    by_pps
}

/// The required values the webhook added to `pod`, while it waits where the
/// PersistentPodState `pps_name` steered it ([`waits_steered`]).
pub fn pinned(pps_name: &str, pod: &CachedPod) -> Option<BTreeMap<String, String>> {
    waits_steered(pps_name, pod)
        .then(|| decode_required(pod.annotations.get(INJECTED_REQUIRED_ANNOTATION)?))
        .flatten()
}

/// Whether `pod` waits unscheduled (not being deleted) where the PersistentPodState `pps_name`
/// steered it.
pub fn waits_steered(pps_name: &str, pod: &CachedPod) -> bool {
    pod.node_name.as_deref().is_none_or(str::is_empty)
        && !pod.deleting
        && !pod.finished
        && pod.annotations.get(INJECTED_ANNOTATION) == Some(pps_name)
}

/// The RFC 7386 merge patch that turns `old` into `new`, or `None` if they are equal. Only
/// changed members are sent, so a concurrent change to other members is kept.
fn merge_patch(old: &Value, new: &Value) -> Option<Value> {
    if old == new {
        return None;
    }
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut patch = Map::new();
            for key in o.keys().filter(|k| !n.contains_key(*k)) {
                patch.insert(key.clone(), Value::Null);
            }
            for (key, value) in n {
                let changed = match o.get(key) {
                    None => Some(value.clone()),
                    Some(old_value) => merge_patch(old_value, value),
                };
                if let Some(v) = changed {
                    patch.insert(key.clone(), v);
                }
            }
            Some(Value::Object(patch))
        }
        _ => Some(new.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{NodeTopologyTerm, PreferredTopologyTerm};
    use crate::api::{PersistentPodAnnotation, TargetReference};
    use crate::placement::DropReason;
    use serde_json::json;

    const HOST: &str = "kubernetes.io/hostname";
    const ZONE: &str = "topology.kubernetes.io/zone";

    fn spec(retention: Option<RetentionPolicy>) -> PersistentPodStateSpec {
        PersistentPodStateSpec {
            target_ref: TargetReference {
                api_version: "apps/v1".into(),
                kind: "StatefulSet".into(),
                name: "web".into(),
            },
            required_persistent_topology: Some(NodeTopologyTerm {
                keys: vec![ZONE.into()],
            }),
            preferred_persistent_topology: vec![PreferredTopologyTerm {
                weight: 100,
                preference: NodeTopologyTerm {
                    keys: vec![HOST.into(), ZONE.into()],
                },
            }],
            persistent_pod_annotations: vec![PersistentPodAnnotation { key: "ip".into() }],
            persistent_pod_state_retention_policy: retention,
        }
    }

    fn pod(name: &str, node: Option<&str>, ready: bool, uid: &str) -> CachedPod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "annotations": {"ip": format!("ip-{name}"), "x": "y"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": uid, "controller": true}]},
            "spec": {"nodeName": node, "containers": []},
            "status": {"conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
        }))
        .expect("pod")
    }

    fn nodes(name: &str) -> Option<NodeSeen> {
        let zone = if name.ends_with('1') { "z1" } else { "z2" };
        (name != "unknown").then(|| NodeSeen {
            labels: [(HOST, name), (ZONE, zone), ("other", "o")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            uid: Some(format!("uid-{name}")),
        })
    }

    fn live(replicas: i32) -> Target {
        Target::Live(WorkloadInfo {
            uid: "u1".into(),
            replicas,
            ..WorkloadInfo::default()
        })
    }

    fn state(node: &str) -> PodState {
        pod_state(&spec(None), &pod("p-0", Some(node), true, "u1"), &nodes).expect("recordable")
    }

    fn run(
        retention: Option<RetentionPolicy>,
        target: Target,
        current: &[(&str, &str)],
        pods: &[CachedPod],
        existing: &[&str],
    ) -> BTreeMap<String, Option<String>> {
        let current = PersistentPodStateStatus {
            observed_generation: 1,
            pod_states: current
                .iter()
                .map(|(p, n)| (p.to_string(), state(n)))
                .collect(),
            ..PersistentPodStateStatus::default()
        };
        let refs: Vec<&CachedPod> = pods.iter().collect();
        let exists = |name: &str| existing.contains(&name);
        let observed = Observed {
            target,
            pods: &refs,
            pod_exists: &exists,
            node: &nodes,
            gone: &|_, _| true,
        };
        let out = desired_status("web", &spec(retention), 7, Some(&current), &observed);
        assert_eq!(out.observed_generation, 7);
        out.pod_states
            .into_iter()
            .map(|(k, v)| (k, v.node_name.map(|n| n.to_string())))
            .collect()
    }

    /// The change a reconcile of one live pod makes when `web-0`'s state is `recorded`.
    fn change_one(recorded: PodState, pod: &CachedPod) -> StatusChange {
        let current = PersistentPodStateStatus {
            observed_generation: 1,
            pod_states: [("web-0".to_owned(), recorded)].into(),
            ..PersistentPodStateStatus::default()
        };
        let refs = [pod];
        let exists = |_: &str| true;
        let observed = Observed {
            target: live(1),
            pods: &refs,
            pod_exists: &exists,
            node: &nodes,
            gone: &|_, _| true,
        };
        change("web", &spec(None), 1, Some(&current), &observed, false).expect("change")
    }

    fn expect(pairs: &[(&str, &str)]) -> BTreeMap<String, Option<String>> {
        pairs
            .iter()
            .map(|(p, n)| (p.to_string(), Some(n.to_string())))
            .collect()
    }

    /// A Ready pod `name` with `uid` on `node` with `ips`, steered back by the PPS "web" or not.
    fn recreated(name: &str, uid: &str, node: &str, ips: &[&str], steered: bool) -> CachedPod {
        let annotations = if steered {
            json!({ crate::api::INJECTED_ANNOTATION: "web" })
        } else {
            json!({})
        };
        let ips: Vec<Value> = ips.iter().map(|ip| json!({ "ip": ip })).collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "annotations": annotations,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "u1", "controller": true}]},
            "spec": {"nodeName": node, "containers": []},
            "status": {"podIPs": ips, "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .expect("pod")
    }

    #[test]
    fn re_created_pods_that_were_steered_back_are_judged_and_summarized() {
        let first = [
            recreated("web-0", "a0", "n1", &["10.0.0.5", "fd00::5"], true),
            recreated("web-1", "a1", "n2", &["10.0.0.6"], true),
            recreated("web-2", "a2", "n1", &["10.0.0.7"], true),
            recreated("web-3", "a3", "n2", &[], true),
        ];
        let refs: Vec<&CachedPod> = first.iter().collect();
        let observed = |pods: &'_ [&'_ CachedPod]| -> StatusChange {
            let exists = |_: &str| true;
            let observed = Observed {
                target: live(4),
                pods,
                pod_exists: &exists,
                node: &nodes,
                gone: &|_, _| true,
            };
            change("web", &spec(None), 1, None, &observed, false).expect("change")
        };
        let first = observed(&refs);
        assert!(first.restorations.is_empty());
        let before = first.status;
        assert_eq!(before.recorded, Some(4));
        assert_eq!(before.restored, None, "nothing re-created yet");

        // Re-created: web-0 back on its node with its IPs (families in another order), web-1
        // on another node with another IP, web-2 not steered by the webhook (not judged), web-3
        // back on its node, with no IP recorded.
        let second = [
            recreated("web-0", "b0", "n1", &["fd00::5", "10.0.0.5"], true),
            recreated("web-1", "b1", "n3", &["10.0.0.9"], true),
            recreated("web-2", "b2", "n3", &["10.0.0.8"], false),
            recreated("web-3", "b3", "n2", &["10.0.0.10"], true),
        ];
        let refs: Vec<&CachedPod> = second.iter().collect();
        let exists = |_: &str| true;
        let second = change(
            "web",
            &spec(None),
            1,
            Some(&before),
            &Observed {
                target: live(4),
                pods: &refs,
                pod_exists: &exists,
                node: &nodes,
                gone: &|_, _| true,
            },
            false,
        )
        .expect("change");
        let judged: Vec<(&str, Option<&str>, Option<&str>, Restore)> = second
            .restorations
            .iter()
            .map(|r| {
                (
                    r.pod.as_str(),
                    r.before.node_name.as_deref(),
                    r.now.node_name.as_deref(),
                    r.restore,
                )
            })
            .collect();
        let after = second.status.clone();
        let restore = |node, ip| Restore { node, ip };
        assert_eq!(
            judged,
            [
                (
                    "web-0",
                    Some("n1"),
                    Some("n1"),
                    restore(NodeRestore::Kept, IpRestore::Kept)
                ),
                (
                    "web-1",
                    Some("n2"),
                    Some("n3"),
                    restore(NodeRestore::Moved, IpRestore::Changed)
                ),
                (
                    "web-3",
                    Some("n2"),
                    Some("n2"),
                    restore(NodeRestore::Kept, IpRestore::None)
                ),
            ]
        );
        assert_eq!(after.recorded, Some(4));
        assert_eq!(after.restored.as_deref(), Some("2/3"));
        // A later status computation of the same pods keeps the judgement and reports nothing new.
        let again = change(
            "web",
            &spec(None),
            1,
            Some(&after),
            &Observed {
                target: live(4),
                pods: &refs,
                pod_exists: &exists,
                node: &nodes,
                gone: &|_, _| true,
            },
            false,
        )
        .expect("change");
        assert!(again.restorations.is_empty());
        assert_eq!(again.status.restored.as_deref(), Some("2/3"));
    }

    #[test]
    fn a_pod_created_again_for_a_state_that_names_no_node_is_not_judged() {
        // Its local data released, the state names no node: the pod created again was steered
        // (an IP, a zone) but not to a node; it is recorded where it runs, not judged moved.
        let forgotten = PodState {
            pod_uid: Some("a0".into()),
            pod_ips: vec!["10.0.0.5".into()],
            ..PodState::default()
        };
        let pod = recreated("web-0", "b0", "n2", &["10.0.0.5"], true);
        let change = change_one(forgotten, &pod);
        let now = &change.status.pod_states["web-0"];
        assert_eq!(now.node_name.as_deref(), Some("n2"));
        assert_eq!(now.last_restore, None);
        assert!(change.restorations.is_empty());
        assert_eq!(change.status.restored, None);
    }

    #[test]
    fn records_node_labels_for_the_union_of_keys_and_persistent_annotations() {
        let s = state("node-1");
        assert_eq!(s.node_name.as_deref(), Some("node-1"));
        assert_eq!(
            s.node_topology_labels,
            [(HOST.into(), "node-1".into()), (ZONE.into(), "z1".into())]
                .into_iter()
                .collect()
        );
        assert_eq!(
            s.annotations,
            [("ip".to_string(), "ip-p-0".to_string())].into()
        );
    }

    #[test]
    fn only_ready_pods_with_a_known_node_are_recorded() {
        let pods = [
            pod("web-0", Some("node-1"), true, "u1"),
            pod("web-1", Some("node-2"), false, "u1"),
            pod("web-2", None, true, "u1"),
            pod("web-3", Some("unknown"), true, "u1"),
        ];
        assert_eq!(
            run(None, live(4), &[], &pods, &[]),
            expect(&[("web-0", "node-1")])
        );
    }

    #[test]
    fn re_records_when_the_node_changes_and_keeps_states_of_pods_not_ready() {
        let pods = [
            pod("web-0", Some("node-2"), true, "u1"),
            pod("web-1", Some("node-2"), false, "u1"),
        ];
        let current = [("web-0", "node-1"), ("web-1", "node-1")];
        assert_eq!(
            run(None, live(2), &current, &pods, &[]),
            expect(&[("web-0", "node-2"), ("web-1", "node-1")])
        );
    }

    #[test]
    fn pods_of_an_older_workload_with_the_same_name_are_ignored() {
        let pods = [pod("web-0", Some("node-1"), true, "old-uid")];
        assert!(run(None, live(1), &[], &pods, &[]).is_empty());
    }

    #[test]
    fn when_scaled_prunes_gone_pods_outside_the_live_ordinals() {
        let current = [
            ("web-0", "node-1"),
            ("web-1", "node-1"),
            ("web-2", "node-2"),
            ("odd", "node-1"),
        ];
        // web-1 is outside the range but its pod still exists (terminating): kept for now.
        assert_eq!(
            run(None, live(1), &current, &[], &["web-1"]),
            expect(&[("odd", "node-1"), ("web-0", "node-1"), ("web-1", "node-1")])
        );
        assert_eq!(
            run(
                Some(RetentionPolicy::Unrecognized),
                live(1),
                &current,
                &[],
                &[]
            ),
            expect(&[("odd", "node-1"), ("web-0", "node-1")])
        );
    }

    #[test]
    fn a_state_recorded_for_a_pod_not_known_gone_is_kept_until_it_is() {
        // Recorded by a predecessor whose pod watch was ahead: web-0 is "b" on n2.
        let newer = recreated("web-0", "b", "n2", &["10.0.0.9"], false);
        let exists = |_: &str| true;
        let observe = |pods: &[&CachedPod],
                       current: Option<&PersistentPodStateStatus>,
                       gone: &dyn Fn(&str, &str) -> bool| {
            let observed = Observed {
                target: live(1),
                pods,
                pod_exists: &exists,
                node: &nodes,
                gone,
            };
            change("web", &spec(None), 1, current, &observed, false).expect("change")
        };
        let never = |_: &str, _: &str| false;
        let recorded = observe(&[&newer], None, &never).status;
        // This cache still holds "a", Ready on n1, and never saw "b" (nor "b" go): the state of
        // "b" is kept, and "a" is to be read live.
        let older = recreated("web-0", "a", "n1", &["10.0.0.5"], false);
        let lagging = observe(&[&older], Some(&recorded), &never);
        assert_eq!(lagging.patch, None, "nothing written over the newer state");
        assert!(lagging.recorded.is_empty());
        let unsure_of = |pods: &[&CachedPod],
                         current: Option<&PersistentPodStateStatus>,
                         target: Target,
                         gone: &dyn Fn(&str, &str) -> bool|
         -> Vec<(String, String)> {
            let observed = Observed {
                target,
                pods,
                pod_exists: &exists,
                node: &nodes,
                gone,
            };
            unsure(&spec(None), current, &observed)
                .into_iter()
                .map(|(p, uid)| (p.name.to_string(), uid))
                .collect()
        };
        let unsure_pods = |gone: &dyn Fn(&str, &str) -> bool| {
            unsure_of(&[&older], Some(&recorded), live(1), gone)
        };
        assert_eq!(unsure_pods(&never), [("web-0".to_owned(), "b".to_owned())]);
        // Once "b" is known gone before "a" (the watch saw it deleted, or a live read found
        // "a"), the state of "a" is recorded.
        let b_gone = |name: &str, uid: &str| name == "web-0" && uid == "b";
        let caught_up = observe(&[&older], Some(&recorded), &b_gone);
        assert_eq!(caught_up.recorded, ["web-0"]);
        let state = &caught_up.status.pod_states["web-0"];
        assert_eq!(state.pod_uid.as_deref(), Some("a"));
        assert_eq!(state.node_name.as_deref(), Some("n1"));
        assert!(unsure_pods(&b_gone).is_empty());
        // Never unsure: the pod recorded; a pod with no state yet; a pod not recorded (not
        // Ready, or left by an earlier workload of that name); any pod of a workload gone.
        assert!(unsure_of(&[&newer], Some(&recorded), live(1), &never).is_empty());
        assert!(unsure_of(&[&older], None, live(1), &never).is_empty());
        let not_ready = CachedPod {
            ready: false,
            ..older.clone()
        };
        assert!(unsure_of(&[&not_ready], Some(&recorded), live(1), &never).is_empty());
        let mut earlier = live(1);
        if let Target::Live(w) = &mut earlier {
            w.uid = "an-earlier-workload".into();
        }
        assert!(unsure_of(&[&older], Some(&recorded), earlier, &never).is_empty());
        assert!(unsure_of(&[&older], Some(&recorded), Target::Gone, &never).is_empty());
    }

    #[test]
    fn upstream_bug_2_an_unchanged_state_with_persisted_annotations_writes_nothing() {
        let pods = [pod("web-0", Some("node-1"), true, "u1")];
        let refs: Vec<&CachedPod> = pods.iter().collect();
        let exists = |_: &str| true;
        let observed = Observed {
            target: live(1),
            pods: &refs,
            pod_exists: &exists,
            node: &nodes,
            gone: &|_, _| true,
        };
        let first = desired_status("web", &spec(None), 1, None, &observed);
        assert_eq!(
            first.pod_states["web-0"].annotations.len(),
            1,
            "an annotation is persisted"
        );
        let again = desired_status("web", &spec(None), 1, Some(&first), &observed);
        let (old, new) = (
            serde_json::to_value(&first).expect("json"),
            serde_json::to_value(&again).expect("json"),
        );
        assert_eq!(merge_patch(&old, &new), None, "nothing to write");
    }

    #[test]
    fn upstream_bug_6_ordinals_start_decides_which_states_are_pruned() {
        let start_at_3 = Target::Live(WorkloadInfo {
            uid: "u1".into(),
            replicas: 2,
            ordinal_start: 3,
            ..WorkloadInfo::default()
        });
        let current = [
            ("web-0", "node-1"),
            ("web-3", "node-1"),
            ("web-4", "node-2"),
        ];
        assert_eq!(
            run(None, start_at_3, &current, &[], &[]),
            expect(&[("web-3", "node-1"), ("web-4", "node-2")])
        );
    }

    #[test]
    fn a_reserve_ordinals_list_read_in_part_prunes_nothing() {
        // 0..=1000 reserved one by one (1,001 entries, the last unread): the live pods are
        // 1001-1002, but read in part the list puts them at 1000-1001.
        let truncated = Target::Live(WorkloadInfo {
            uid: "u1".into(),
            replicas: 2,
            reserved: vec![(0, 999)],
            reserved_truncated: true,
            ..WorkloadInfo::default()
        });
        let current = [("web-1001", "node-1"), ("web-1002", "node-2")];
        assert_eq!(
            run(None, truncated, &current, &[], &[]),
            expect(&current),
            "web-1002's state is kept"
        );
    }

    #[test]
    fn when_deleted_keeps_states_until_the_workload_is_gone() {
        let current = [
            ("web-0", "node-1"),
            ("web-1", "node-1"),
            ("web-2", "node-2"),
        ];
        let keep = Some(RetentionPolicy::WhenDeleted);
        assert_eq!(run(keep, live(1), &current, &[], &[]).len(), 3);
        assert!(run(keep, Target::Gone, &current, &[], &[]).is_empty());
    }

    #[test]
    fn a_gone_workloads_states_go_with_their_pods() {
        // Deleted with --cascade=orphan: web-0 and web-2 still run (owned by nobody now), web-1
        // is gone. Under either retention the running pods keep their states, to be adopted
        // by the workload created again.
        let current = [
            ("web-0", "node-1"),
            ("web-1", "node-1"),
            ("web-2", "node-2"),
        ];
        for retention in [None, Some(RetentionPolicy::WhenDeleted)] {
            assert_eq!(
                run(retention, Target::Gone, &current, &[], &["web-0", "web-2"]),
                expect(&[("web-0", "node-1"), ("web-2", "node-2")]),
                "{retention:?}"
            );
        }
    }

    #[test]
    fn an_unknown_workload_records_but_never_prunes() {
        let current = [("web-5", "node-1")];
        let pods = [pod("web-0", Some("node-2"), true, "u1")];
        assert_eq!(
            run(None, Target::Unknown, &current, &pods, &[]),
            expect(&[("web-0", "node-2"), ("web-5", "node-1")])
        );
    }

    #[test]
    fn states_whose_required_values_no_node_has_are_reported() {
        let status = PersistentPodStateStatus {
            observed_generation: 1,
            pod_states: [
                ("web-0".to_string(), state("node-1")),
                ("web-1".to_string(), state("node-2")),
            ]
            .into(),
            ..PersistentPodStateStatus::default()
        };
        let only_z2 = |l: &BTreeMap<String, String>| {
            let kept = l.get(ZONE).map(String::as_str) == Some("z2");
            Required {
                kept: if kept { l.clone() } else { BTreeMap::new() },
                dropped: (!kept && !l.is_empty()).then(|| Dropped {
                    values: l.clone(),
                    reason: DropReason::NodeGone,
                }),
            }
        };
        let out = unplaceable_states(&spec(None), &status, &only_z2);
        assert_eq!(out.keys().collect::<Vec<_>>(), ["web-0"]);
        assert_eq!(
            out["web-0"].values,
            BTreeMap::from([(ZONE.to_string(), "z1".to_string())])
        );
        let mut no_required = spec(None);
        no_required.required_persistent_topology = None;
        assert!(unplaceable_states(&no_required, &status, &only_z2).is_empty());
    }

    #[test]
    fn states_sharing_their_required_values_are_placed_once() {
        let status = PersistentPodStateStatus {
            observed_generation: 1,
            pod_states: [
                ("web-0".to_string(), state("node-1")),
                ("web-1".to_string(), state("node-2")),
                ("web-2".to_string(), state("node-1")),
            ]
            .into(),
            ..PersistentPodStateStatus::default()
        };
        let asked = std::cell::Cell::new(0);
        let none_usable = |l: &BTreeMap<String, String>| {
            asked.set(asked.get() + 1);
            Required {
                kept: BTreeMap::new(),
                dropped: Some(Dropped {
                    values: l.clone(),
                    reason: DropReason::NodeLost,
                }),
            }
        };
        let out = unplaceable_states(&spec(None), &status, &none_usable);
        assert_eq!(out.len(), 3, "each state is reported");
        assert_eq!(out["web-0"], out["web-2"]);
        assert_eq!(asked.get(), 2, "once per distinct values");
    }

    #[test]
    fn upstream_bug_11_the_status_is_written_as_a_patch_of_what_changed_only() {
        let cases = [
            (json!({"a": 1}), json!({"a": 1}), None),
            (json!(null), json!({"a": 1}), Some(json!({"a": 1}))),
            (
                json!({"s": {"p0": {"n": "x", "l": {"k": "v"}}, "p1": {"n": "y"}}, "g": 1}),
                json!({"s": {"p0": {"n": "x", "l": {"k2": "v"}}, "p2": {"n": "z"}}, "g": 1}),
                Some(
                    json!({"s": {"p0": {"l": {"k": null, "k2": "v"}}, "p1": null, "p2": {"n": "z"}}}),
                ),
            ),
            (
                json!({"a": [1]}),
                json!({"a": [2]}),
                Some(json!({"a": [2]})),
            ),
        ];
        for (old, new, want) in cases {
            let got = merge_patch(&old, &new);
            assert_eq!(got, want, "{old} -> {new}");
            if let Some(p) = got {
                let mut doc = old.clone();
                json_patch::merge(&mut doc, &p);
                assert_eq!(doc, new, "patch applies");
            }
        }
    }

    #[test]
    fn a_node_replaced_under_its_name_is_found_and_the_state_takes_the_new_uid() {
        let mut recorded = state("node-1");
        assert_eq!(recorded.node_uid.as_deref(), Some("uid-node-1"), "recorded");
        recorded.node_uid = Some("uid-before".into());
        let change = change_one(recorded, &pod("web-0", Some("node-1"), true, "u1"));
        assert_eq!(
            change.replaced,
            [Replaced {
                pod: "web-0".into(),
                node: "node-1".into(),
                recorded_uid: "uid-before".into(),
                uid: "uid-node-1".into(),
            }]
        );
        assert_eq!(
            change.status.pod_states["web-0"].node_uid.as_deref(),
            Some("uid-node-1"),
            "the running pod is recorded on the new node"
        );
    }

    #[test]
    fn only_unscheduled_pods_pinned_by_the_webhook_to_unusable_values_are_stranded() {
        use crate::api::{INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION};
        let waiting = |name: &str, annotations: Value, node: Option<&str>| -> CachedPod {
            serde_json::from_value(json!({"metadata": {"name": name, "namespace": "ns",
                "uid": format!("uid-{name}"), "resourceVersion": "9", "annotations": annotations},
                "spec": {"nodeName": node, "containers": []}, "status": {"phase": "Pending"}}))
            .expect("pod")
        };
        let ours = |values: &str| json!({INJECTED_ANNOTATION: "web", INJECTED_REQUIRED_ANNOTATION: values});
        let pods = [
            waiting("lost", ours("kubernetes.io/hostname=dead"), None),
            waiting("usable", ours("kubernetes.io/hostname=alive"), None),
            waiting(
                "scheduled",
                ours("kubernetes.io/hostname=dead"),
                Some("dead"),
            ),
            waiting(
                "other-pps",
                json!({INJECTED_ANNOTATION: "other", INJECTED_REQUIRED_ANNOTATION: "kubernetes.io/hostname=dead"}),
                None,
            ),
            waiting("not-ours", json!({}), None),
            waiting("garbage", ours("no equals sign"), None),
        ];
        let refs: Vec<&CachedPod> = pods.iter().collect();
        let place = |values: &BTreeMap<String, String>| Required {
            kept: BTreeMap::new(),
            dropped: (values.get(HOST).map(String::as_str) == Some("dead")).then(|| Dropped {
                values: values.clone(),
                reason: DropReason::NodeLost,
            }),
        };
        let found = stranded("web", &refs, &place);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(
            (
                found[0].pod.as_str(),
                found[0].uid.as_str(),
                found[0].node.as_str()
            ),
            ("lost", "uid-lost", "dead")
        );
        assert_eq!(found[0].resource_version.as_deref(), Some("9"));
    }
    #[test]
    fn pins_of_persistent_pod_states_that_are_gone_are_found_by_them() {
        use crate::api::{INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION};
        let pod = |name: &str, ns: &str, pps: &str, node: Option<&str>, owned: bool| -> CachedPod {
            let owners = if owned {
                json!([{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "sts", "controller": true}])
            } else {
                json!([])
            };
            serde_json::from_value(json!({"metadata": {"name": name, "namespace": ns,
                "uid": format!("uid-{name}"), "ownerReferences": owners,
                "annotations": {INJECTED_ANNOTATION: pps, INJECTED_REQUIRED_ANNOTATION: "kubernetes.io/hostname=n1"}},
                "spec": {"nodeName": node, "containers": []}, "status": {"phase": "Pending"}}))
            .expect("pod")
        };
        let pods = [
            pod("a-0", "ns", "gone", None, true),
            pod("a-1", "ns", "gone", None, true),
            pod("b-0", "other", "gone", None, true),
            pod("live-0", "ns", "live", None, true),
            // scheduled, or with no workload to re-create it: not looked at
            pod("placed-0", "ns", "gone", Some("n1"), true),
            pod("bare", "ns", "gone", None, false),
        ];
        let refs: Vec<&CachedPod> = pods.iter().collect();
        let exists = |ns: &str, name: &str| (ns, name) == ("ns", "live");
        let found: Vec<((String, String), Vec<&str>)> = orphaned(&refs, &exists)
            .into_iter()
            .map(|(k, v)| (k, v.iter().map(|p| &*p.name).collect()))
            .collect();
        assert_eq!(
            found,
            [
                (("ns".to_owned(), "gone".to_owned()), vec!["a-0", "a-1"]),
                (("other".to_owned(), "gone".to_owned()), vec!["b-0"]),
            ]
        );
    }
}
