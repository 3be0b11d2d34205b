//! What the controllers report: Events on PersistentPodStates and workloads, and the metrics
//! that follow what was written or found.

use std::collections::BTreeSet;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::ResourceExt;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;

use super::Context;
use super::record::{self, Replaced, Restoration, StatusChange, Stranded, Target};
use crate::api::RELEASE_LOCAL_VOLUMES_ANNOTATION;
use crate::api::ip_request::IP_REQUEST_ANNOTATION;
use crate::api::{IpRestore, NodeRestore, PersistentPodState, PersistentPodStateStatus, PodState};
use crate::metrics::{DropLabels, RestoreLabels};
use crate::placement::{self, Dropped, Health};
use crate::release::{self, Forgotten, Kept, LocalClaim, Waiting};
use crate::webhook::admit::LeftOut;
use crate::workload::{MAX_RESERVED_ENTRIES, WorkloadRef};

/// The node label a moved pod's Event reports the zone of, when recorded.
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// A PersistentPodState that records nothing because an older one targets its workload.
pub(super) fn duplicate(
    ctx: &Context,
    pps: &PersistentPodState,
    older: &str,
    target: &WorkloadRef,
) {
    tracing::warn!(%older, "another PersistentPodState targets the workload and is older; recording nothing");
    let note = format!(
        "PersistentPodState {older} targets {}/{} {} too and is older: it is the one in force; this one records nothing",
        target.kind.group, target.kind.kind, target.name
    );
    ctx.events
        .publish(pps, EventType::Warning, "DuplicateTarget", "Record", note);
    // Shadowed, it reports nothing: what it reported before comes off the gauges.
    let key = ObjectRef::from_obj(pps);
    {
        let (mut reported, forgot) = ctx.reported_unplaceable.lock(&ctx.caches);
        if reported.by_pps.remove(&key).is_some() || forgot {
            let left = reported.by_pps.values().map(BTreeMap::len).sum::<usize>();
            ctx.metrics.states_unplaceable.set(left as i64);
        }
    }
    let (mut reported, forgot) = ctx.reported_limits.lock(&ctx.caches);
    if reported.by_pps.remove(&key).is_some() || forgot {
        ctx.metrics.over_limits.set(reported.by_pps.len() as i64);
    }
}

/// A status written: counted, logged, and the states recorded, restored and pruned reported.
pub(super) fn written(
    ctx: &Context,
    pps: &PersistentPodState,
    change: &StatusChange,
    workload_gone: bool,
) {
    ctx.metrics.status_writes.inc();
    ctx.metrics
        .states_recorded
        .inc_by(change.recorded.len() as u64);
    ctx.metrics.states_pruned.inc_by(change.pruned.len() as u64);
    tracing::info!(
        recorded = change.recorded.len(),
        pruned = change.pruned.len(),
        states = change.status.pod_states.len(),
        "status updated"
    );
    if !change.recorded.is_empty() {
        let placed: Vec<String> = change
            .recorded
            .iter()
            .map(|pod| {
                let node = change
                    .status
                    .pod_states
                    .get(pod)
                    .and_then(|s| s.node_name.as_deref());
                format!("{pod} on {}", node.unwrap_or("?"))
            })
            .collect();
        let note = format!("recorded {}", placed.join(", "));
        ctx.events
            .publish(pps, EventType::Normal, "StatesRecorded", "Record", note);
    }
    restorations(ctx, pps, change);
    if !change.pruned.is_empty() {
        let why = if workload_gone {
            "pods gone, their workload gone or being deleted"
        } else {
            "pods gone, ordinals no longer live"
        };
        let note = format!("pruned {} ({why})", change.pruned.join(", "));
        ctx.events
            .publish(pps, EventType::Normal, "StatesPruned", "Prune", note);
    }
}

/// Counts the pods that came back since the last status, by whether they kept their node and
/// IP; one that moved or changed IP gets a Warning Event naming it, the old and the new value.
fn restorations(ctx: &Context, pps: &PersistentPodState, change: &StatusChange) {
    for Restoration {
        pod,
        before,
        now,
        restore,
    } in &change.restorations
    {
        ctx.metrics
            .restored
            .get_or_create(&RestoreLabels {
                node: restore.node,
                ip: restore.ip,
            })
            .inc();
        if restore.restored() {
            continue;
        }
        let node = |s: &PodState| s.node_name.clone().unwrap_or_else(|| "?".into());
        let zone = |s: &PodState| s.node_topology_labels.get(ZONE_LABEL).cloned();
        let mut what = Vec::new();
        if restore.node == NodeRestore::Moved {
            what.push(format!("node {} -> {}", node(before), node(now)));
            if let (Some(a), Some(b)) = (zone(before), zone(now))
                && a != b
            {
                what.push(format!("zone {a} -> {b}"));
            }
        }
        if restore.ip == IpRestore::Changed {
            what.push(format!(
                "IP {} -> {}",
                before.pod_ips.join(","),
                now.pod_ips.join(",")
            ));
        }
        let note = format!("pod {pod} came back changed: {}", what.join("; "));
        tracing::warn!(%pod, changes = %what.join("; "), "re-created pod not fully restored");
        ctx.events.publish_about(
            pps,
            pod,
            EventType::Warning,
            "PodNotRestored",
            "Restore",
            note,
        );
    }
}

/// Reports (Warning Event when newly over, and the gauge of such objects) a PersistentPodState
/// that asks for more than the limits, or whose workload reserves more ordinals entries than
/// are read: what is beyond is ignored, never allocated.
pub(super) fn limits(ctx: &Context, pps: &PersistentPodState, target: &Target) {
    let mut over = pps.spec.over_limits();
    if let Target::Live(w) = target
        && w.reserved_truncated
    {
        over.push(format!(
            "the workload's reserveOrdinals has more than {MAX_RESERVED_ENTRIES} entries (only the first are read; no state is pruned on scale-down meanwhile)"
        ));
    }
    let key = ObjectRef::from_obj(pps);
    let newly = {
        let (mut reported, _) = ctx.reported_limits.lock(&ctx.caches);
        let reported = &mut reported.by_pps;
        let newly = !over.is_empty() && reported.get(&key) != Some(&over);
        if over.is_empty() {
            reported.remove(&key);
        } else {
            reported.insert(key, over.clone());
        }
        ctx.metrics.over_limits.set(reported.len() as i64);
        newly
    };
    if newly {
        let note = format!("over the limits, ignored beyond them: {}", over.join("; "));
        tracing::warn!(%note, "PersistentPodState over the limits");
        ctx.events
            .publish(pps, EventType::Warning, "LimitExceeded", "Record", note);
    }
}

/// What was last reported unplaceable of one PersistentPodState: each such state's pod, with a
/// fingerprint of what it left out (so that a change of what is left out is seen too, at 8
/// bytes a state).
pub(super) type Unplaceable = BTreeMap<String, u64>;

/// The states of `status` whose required values cannot all be injected now, with the
/// fingerprints of what they leave out.
fn unplaceable_now(
    ctx: &Context,
    pps: &PersistentPodState,
    status: &PersistentPodStateStatus,
    health: &Health,
) -> BTreeMap<String, (Dropped, u64)> {
    let place = |recorded: &BTreeMap<String, String>| ctx.place_required(recorded, health);
    record::unplaceable_states(&pps.spec, status, &place)
        .into_iter()
        .map(|(pod, dropped)| {
            let print = print_of(&dropped);
            (pod, (dropped, print))
        })
        .collect()
}

/// What each distinct set of required values leaves out now, as the print [`unplaceable_now`]
/// reports it (none when placeable): asked once per set across the PersistentPodStates one
/// node change concerns, keyed by values borrowed from their states.
pub(super) type Placed<'a> = HashMap<Vec<(&'a str, &'a str)>, Option<u64>>;

/// The print of what a state leaves out, as reported.
fn print_of(dropped: &Dropped) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    dropped.hash(&mut hasher);
    hasher.finish()
}

/// Whether what `pps`'s recorded states leave out now differs from what its last reconcile
/// reported. Compared state by state, without building the report: a node change asks this of
/// every PersistentPodState with a state in its zone, so the placements are shared in `placed`.
pub(super) fn unplaceable_changed<'a>(
    ctx: &Context,
    pps: &'a PersistentPodState,
    health: &Health,
    placed: &mut Placed<'a>,
) -> bool {
    let Some(status) = pps.status.as_ref() else {
        return false;
    };
    let now: Vec<(&str, u64)> = status
        .pod_states
        .iter()
        .filter_map(|(pod, state)| {
            let values: Vec<(&str, &str)> = pps.spec.required_pairs(state).collect();
            let print = *placed.entry(values).or_insert_with_key(|values| {
                let owned = values
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect();
                ctx.place_required(&owned, health)
                    .dropped
                    .as_ref()
                    .map(print_of)
            });
            Some((pod.as_str(), print?))
        })
        .collect();
    let (reported, forgot) = ctx.reported_unplaceable.lock(&ctx.caches);
    if forgot {
        // PersistentPodStates deleted since were forgotten in this look: counted again.
        let left = reported.by_pps.values().map(BTreeMap::len).sum::<usize>();
        ctx.metrics.states_unplaceable.set(left as i64);
    }
    let before = reported.by_pps.get(&ObjectRef::from_obj(pps));
    before.map_or(0, BTreeMap::len) != now.len()
        || now
            .iter()
            .any(|(pod, print)| before.and_then(|b| b.get(*pod)) != Some(print))
}

/// Publishes a Warning Event for each state that newly became unplaceable (its required node or
/// zone is gone or lost), and keeps the gauge of such states current.
pub(super) fn unplaceable(
    ctx: &Context,
    pps: &PersistentPodState,
    status: &PersistentPodStateStatus,
    health: &Health,
) {
    let unplaceable = unplaceable_now(ctx, pps, status, health);
    let key = ObjectRef::from_obj(pps);
    let newly: Vec<(String, Dropped)> = {
        // PPS deleted since they were reported are forgotten (now and then); the gauge is
        // counted again when they were, else moved by this PPS's change.
        let (mut reported, forgot) = ctx.reported_unplaceable.lock(&ctx.caches);
        let reported = &mut reported.by_pps;
        let before = reported.remove(&key).unwrap_or_default();
        let newly = unplaceable
            .iter()
            .filter(|(pod, _)| !before.contains_key(*pod))
            .map(|(p, (dropped, _))| (p.clone(), dropped.clone()))
            .collect();
        let (now, before) = (unplaceable.len(), before.len());
        if !unplaceable.is_empty() {
            let prints = unplaceable.into_iter().map(|(p, (_, print))| (p, print));
            reported.insert(key, prints.collect());
        }
        let gauge = &ctx.metrics.states_unplaceable;
        if forgot {
            gauge.set(reported.values().map(BTreeMap::len).sum::<usize>() as i64);
        } else {
            gauge.inc_by(now as i64 - before as i64);
        }
        newly
    };
    for (pod, dropped) in newly {
        let left_out: Vec<LeftOut> = LeftOut::required(&dropped).collect();
        let note = format!(
            "a re-created pod {pod} would be left without {}",
            LeftOut::list(&left_out)
        );
        ctx.events.publish_about(
            pps,
            &pod,
            EventType::Warning,
            "RequiredTopologyUnavailable",
            "Inject",
            note,
        );
    }
}

/// Publishes a Warning Event for each recorded node newly found replaced under its name (the
/// pod's local data there is gone), once per pod and new node.
pub(super) fn replaced(ctx: &Context, pps: &PersistentPodState, change: &StatusChange) {
    let key = ObjectRef::from_obj(pps);
    let now: BTreeSet<(String, String)> = change
        .replaced
        .iter()
        .map(|r| (r.pod.clone(), r.uid.clone()))
        .collect();
    let newly: Vec<&Replaced> = {
        let (mut reported, _) = ctx.reported_replaced.lock(&ctx.caches);
        let reported = &mut reported.by_pps;
        let before = reported.remove(&key).unwrap_or_default();
        if !now.is_empty() {
            reported.insert(key, now.clone());
        }
        change
            .replaced
            .iter()
            .filter(|r| !before.contains(&(r.pod.clone(), r.uid.clone())))
            .collect()
    };
    for r in newly {
        tracing::warn!(pod = %r.pod, node = %r.node, "the recorded node was replaced under its name");
        let note = format!(
            "node {} of pod {} was replaced (uid {} -> {}): the pod's local data there is gone",
            r.node, r.pod, r.recorded_uid, r.uid
        );
        ctx.events.publish_about(
            pps,
            &r.pod,
            EventType::Warning,
            "NodeReplaced",
            "Record",
            note,
        );
    }
}

/// What pinned a released pod: a PersistentPodState, or one that is gone (namespace, name).
pub(super) enum PinnedBy<'a> {
    /// The PersistentPodState, reconciled.
    Live(&'a PersistentPodState),
    /// A PersistentPodState no longer there (the sweep of orphaned pins released the pod).
    Gone(&'a str, &'a str),
}

/// A waiting pod released: counted, and a Warning Event naming the pod, the node and why (a
/// claim of its own `held_by`, bound on a node without the values, when that is what held it);
/// on the PersistentPodState, or on the pod when that is gone.
pub(super) fn released(
    ctx: &Context,
    by: PinnedBy<'_>,
    stranded: &Stranded,
    held_by: Option<&LocalClaim>,
) {
    let reason = stranded.dropped.reason;
    ctx.metrics
        .pods_released
        .get_or_create(&DropLabels { reason })
        .inc();
    let mut left_out: Vec<LeftOut> = LeftOut::required(&stranded.dropped).collect();
    if let Some(claim) = held_by {
        let why = format!(
            "its claim {} is bound to PersistentVolume {}, which only node {} can mount, and that node lacks them",
            claim.claim, claim.volume, claim.node
        );
        for l in &mut left_out {
            l.why.clone_from(&why);
        }
    }
    let gone = match by {
        PinnedBy::Gone(_, pps) => format!("; the PersistentPodState {pps} that pinned it is gone"),
        PinnedBy::Live(_) => String::new(),
    };
    tracing::warn!(pod = %stranded.pod, node = %stranded.node, reason = reason.describe(),
        pps_gone = matches!(by, PinnedBy::Gone(..)),
        "released a pod waiting for a node that is no longer usable");
    let note = format!(
        "pod {} released: it waited for node {}, but {}{gone}; re-created, it gets what is still usable",
        stranded.pod,
        stranded.node,
        LeftOut::list(&left_out)
    );
    let (warning, reason, action) = (EventType::Warning, "PodReleased", "Release");
    match by {
        PinnedBy::Live(pps) => {
            ctx.events
                .publish_about(pps, &stranded.pod, warning, reason, action, note);
        }
        PinnedBy::Gone(namespace, _) => {
            let pod = ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(stranded.pod.clone()),
                namespace: Some(namespace.to_owned()),
                uid: Some(stranded.uid.clone()),
                ..ObjectReference::default()
            };
            ctx.events
                .publish_on(pod, None, warning, reason, action, note);
        }
    }
}

/// A workload whose ip-request annotation is not valid, so it is not copied: counted, and a
/// Warning Event on the workload (the value is the tenant's: in the Event, not in the logs).
pub(super) fn invalid_ip_request(
    ctx: &Context,
    obj: &DynamicObject,
    types: &ApiResource,
    error: &str,
) {
    ctx.metrics.invalid_workload_ip_requests.inc();
    tracing::warn!("the workload's ip-request annotation is not valid; not copied");
    ctx.events.publish_on(
        kube::Resource::object_ref(obj, types),
        None,
        EventType::Warning,
        "InvalidIPRequest",
        "Generate",
        format!(
            "{IP_REQUEST_ANNOTATION}: {error}; not copied to the generated PersistentPodState, so its pods request no IP"
        ),
    );
}

/// Whether a note about waiting pod `uid` of `pps` was made already (uids of pods no longer
/// `waiting` are forgotten).
pub(super) fn local_reported(
    ctx: &Context,
    pps: &PersistentPodState,
    uid: &str,
    waiting: &BTreeSet<String>,
) -> bool {
    with_local_notes(ctx, pps, waiting, |seen| seen.contains(uid))
}

/// Whether a note about waiting pod `uid` of `pps` is new (then it is remembered; uids of pods
/// no longer `waiting` are forgotten).
pub(super) fn first_local_report(
    ctx: &Context,
    pps: &PersistentPodState,
    uid: &str,
    waiting: &BTreeSet<String>,
) -> bool {
    with_local_notes(ctx, pps, waiting, |seen| seen.insert(uid.to_owned()))
}

/// `f` of the uids of `pps`'s waiting pods noted, those no longer `waiting` forgotten first.
fn with_local_notes<T>(
    ctx: &Context,
    pps: &PersistentPodState,
    waiting: &BTreeSet<String>,
    f: impl FnOnce(&mut BTreeSet<String>) -> T,
) -> T {
    let key = ObjectRef::from_obj(pps);
    let (mut reported, _) = ctx.reported_local.lock(&ctx.caches);
    let seen = reported.by_pps.entry(key).or_default();
    seen.retain(|u| waiting.contains(u));
    f(seen)
}

/// Pods that wait pinned to values no usable node has, which the controller does not release
/// (`why`): a Warning naming them and why, so that an operator can act (`release`).
pub(super) fn release_held(ctx: &Context, pps: &PersistentPodState, pods: &[&str], why: &str) {
    const NAMED: usize = 10;
    if pods.is_empty() {
        return;
    }
    let mut names = pods.to_vec();
    names.sort_unstable();
    names.truncate(NAMED);
    let more = pods.len().saturating_sub(NAMED);
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    let first = names.first().copied().unwrap_or_default();
    ctx.events.publish(
        pps,
        EventType::Warning,
        "ReleaseHeld",
        "Release",
        format!(
            "pods {}{more} wait pinned to values no usable node has, and none is released: {why}; or release one by hand: `persistent-pod-state release {first} -n {}`",
            names.join(", "),
            pps.namespace().unwrap_or_default()
        ),
    );
}

/// A waiting pod held by claims on node-local volumes of a node that is gone, while the
/// PersistentPodState does not allow releasing them: a Warning saying what blocks it and how
/// to release it.
pub(super) fn local_volume_blocking(
    ctx: &Context,
    pps: &PersistentPodState,
    waiting: &Waiting,
    claims: &[LocalClaim],
) {
    tracing::warn!(pod = %waiting.pod, node = %waiting.node, "a waiting pod is held by node-local volumes of a node that is gone");
    let note = format!(
        "pod {} waits for claim {}, which only node {} can mount, and {}: annotate the PersistentPodState (or its workload, if generated) {RELEASE_LOCAL_VOLUMES_ANNOTATION}=true to let the controller delete the claim and the pod (the workload re-creates both, the claim binds elsewhere, the data on {} is not used), or run `persistent-pod-state release {} -n {}`",
        waiting.pod,
        release::describe(claims),
        waiting.node,
        gone_reason(waiting),
        waiting.node,
        waiting.pod,
        pps.namespace().unwrap_or_default(),
    );
    ctx.events.publish_about(
        pps,
        &waiting.pod,
        EventType::Warning,
        "LocalVolumeBlocking",
        "Release",
        note,
    );
}

/// Claims of a waiting pod kept although the PersistentPodState allows releasing its
/// node-local volumes: a Warning saying why each is kept.
pub(super) fn local_volume_kept(
    ctx: &Context,
    pps: &PersistentPodState,
    waiting: &Waiting,
    kept: &[Kept],
) {
    let why: Vec<&str> = kept.iter().map(|k| k.why.as_str()).collect();
    tracing::warn!(pod = %waiting.pod, node = %waiting.node, ?why, "claims of a waiting pod are not released");
    let note = format!(
        "pod {} waits and node {} is gone ({}), but nothing is released: {}",
        waiting.pod,
        waiting.node,
        gone_reason(waiting),
        why.join("; ")
    );
    ctx.events.publish_about(
        pps,
        &waiting.pod,
        EventType::Warning,
        "LocalVolumeKept",
        "Release",
        note,
    );
}

/// A claim on a node-local volume released: counted, and an Event naming claim, volume and node.
pub(super) fn local_volume_released(
    ctx: &Context,
    pps: &PersistentPodState,
    waiting: &Waiting,
    claim: &LocalClaim,
) {
    ctx.metrics
        .local_volumes_released
        .get_or_create(&DropLabels {
            reason: waiting.reason,
        })
        .inc();
    tracing::warn!(pod = %waiting.pod, claim = %claim.claim, volume = %claim.volume, node = %claim.node, "released a claim on a node-local volume of a node that is gone");
    let note = format!(
        "claim {} of pod {} deleted: PersistentVolume {} can be mounted only on node {}, and {}; the workload re-creates the claim, which binds elsewhere (the volume is left as its reclaim policy says)",
        claim.claim,
        waiting.pod,
        claim.volume,
        claim.node,
        gone_reason(waiting)
    );
    // About the claim: each of a pod's claims released in one look has its own Event.
    let reference = kube::Resource::object_ref(pps, &());
    let related = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolumeClaim".into()),
        name: Some(claim.claim.clone()),
        namespace: reference.namespace.clone(),
        uid: Some(claim.uid.clone()),
        ..Default::default()
    };
    ctx.events.publish_on(
        reference,
        Some(related),
        EventType::Warning,
        "LocalVolumeReleased",
        "Release",
        note,
    );
}

/// A waiting pod released with its node-local claims: counted, and a `PodReleased` Event.
pub(super) fn released_with_volumes(
    ctx: &Context,
    pps: &PersistentPodState,
    waiting: &Waiting,
    claims: &[LocalClaim],
) {
    ctx.metrics
        .pods_released
        .get_or_create(&DropLabels {
            reason: waiting.reason,
        })
        .inc();
    let note = format!(
        "pod {} released: it waited for node {}, but {}; its claims {} were released with it, and its state is made to name that node no more, so that a pod created again once the node is back is not pinned there (it is recorded where its new claims bind once Ready)",
        waiting.pod,
        waiting.node,
        gone_reason(waiting),
        release::describe(claims)
    );
    ctx.events.publish_about(
        pps,
        &waiting.pod,
        EventType::Warning,
        "PodReleased",
        "Release",
        note,
    );
}

/// A pod's state made to name no node, nor the wider labels the node its node-local data is on
/// lacks (`forgotten`; `claim` shows where that data is): counted, and a `NodeForgotten` Event.
pub(super) fn node_forgotten(
    ctx: &Context,
    pps: &PersistentPodState,
    pod: &str,
    claim: &LocalClaim,
    forgotten: &Forgotten,
) {
    ctx.metrics.state_nodes_forgotten.inc();
    let Forgotten { node, wider } = forgotten;
    tracing::info!(%pod, forgotten = ?node, ?wider, claim = %claim.claim, node = %claim.node, "the pod's node-local data is on another node than its state names, or one without the labels it records: its state names them no more");
    let (data, volume, on) = (&claim.claim, &claim.volume, &claim.node);
    let labels = wider.join(", ");
    let note = match (node, wider.is_empty()) {
        (Some(old), true) => format!(
            "the state of pod {pod} names node {old} no more: its claim {data} is bound to PersistentVolume {volume}, which only node {on} can mount; it is recorded there once Ready, and a pod created again meanwhile is not pinned to {old}"
        ),
        (Some(old), false) => format!(
            "the state of pod {pod} names node {old} no more, nor {labels}, which node {on} lacks: its claim {data} is bound to PersistentVolume {volume}, which only node {on} can mount; it is recorded there once Ready, and a pod created again meanwhile is not pinned to {old} nor to {labels}"
        ),
        (None, false) => format!(
            "the state of pod {pod} records {labels} no more, which node {on} lacks: its claim {data} is bound to PersistentVolume {volume}, which only node {on} can mount; a pod created again is not pinned to {labels}"
        ),
        (None, true) => format!(
            "the state of pod {pod} records no label naming another node than {on} any more: its claim {data} is bound to PersistentVolume {volume}, which only node {on} can mount; a pod created again is not pinned away from it"
        ),
    };
    ctx.events
        .publish_about(pps, pod, EventType::Normal, "NodeForgotten", "Record", note);
}

/// How a waiting pod's node is gone, for a note.
fn gone_reason(waiting: &Waiting) -> &'static str {
    match waiting.reason {
        placement::DropReason::NodeLost => {
            "it is lost (not ready or unreachable past --node-lost-after, or out of service)"
        }
        _ => "it was deleted or replaced under its name (its local data is gone)",
    }
}
