//! The controllers' shells: read the caches, call the pure [`super::record`] and
//! [`super::generate`], write the result, and hand what happened to [`super::report`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    Preconditions,
};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use serde_json::json;

use super::delete::{Deleted, delete_waiting_pod, go_on};
use super::generate::{self, Leave, Plan};
use super::record::{self, Observed, Target};
use super::retry::failure_key;
use super::{Context, Error, FIELD_MANAGER, RESYNC, constrained, moved, report};
use crate::api::{
    INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION, PersistentPodState,
    PersistentPodStateStatus, RELEASE_LOCAL_VOLUMES_ANNOTATION, decode_required,
};
use crate::metrics::{GeneratorAction, PodRead, Reconciler};
use crate::placement::{self, DropReason, Health, Nodes as _};
use crate::release::{self, Kept, LocalClaim, Waiting};
use crate::state::trim::CachedPod;
use crate::state::{Caches, WorkloadLookup, pps_target};
use crate::workload::{GroupKind, WorkloadInfo, WorkloadRef};

fn target_of(caches: &Caches, workload: &WorkloadRef) -> Target {
    match caches.workload(workload) {
        WorkloadLookup::Found(obj) => {
            let info = WorkloadInfo::from_object(&obj);
            if info.deleting {
                Target::Gone
            } else {
                Target::Live(info)
            }
        }
        WorkloadLookup::Absent => Target::Gone,
        WorkloadLookup::Unknown => Target::Unknown,
    }
}

/// Calls `view` with the world as `caches` show it to a PersistentPodState in `namespace`
/// targeting `target`, whose pods are `pods`.
fn observing<R>(
    caches: &Caches,
    namespace: &str,
    target: &Target,
    pods: &[&CachedPod],
    view: impl FnOnce(&Observed<'_>) -> R,
) -> R {
    let pod_exists = |name: &str| caches.pod_exists(namespace, name);
    let node = |name: &str| {
        caches.node(name).map(|n| record::NodeSeen {
            labels: n.labels().clone(),
            uid: n.uid(),
        })
    };
    let gone = |name: &str, uid: &str| caches.pod_is_gone(namespace, name, uid);
    view(&Observed {
        target: target.clone(),
        pods,
        pod_exists: &pod_exists,
        node: &node,
        gone: &gone,
    })
}

/// Records the states of the target's Ready pods and prunes states no longer needed, writing
/// only what changed.
#[tracing::instrument(skip_all, fields(namespace = pps.namespace().unwrap_or_default(), name = %pps.name_any(), uid = pps.uid().unwrap_or_default()))]
pub async fn reconcile_pps(
    pps: Arc<PersistentPodState>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_timer(Reconciler::Status);
    let (Some(namespace), Some(target)) = (pps.namespace(), pps_target(&pps)) else {
        return Ok(Action::await_change());
    };
    // One being deleted is in force for nothing, and shadows none: it records and releases
    // its own pods until it is gone.
    if pps.metadata.deletion_timestamp.is_none()
        && let Some(in_force) = ctx.caches.pps_for(&target)
        && in_force.metadata.name != pps.metadata.name
    {
        report::duplicate(&ctx, &pps, &in_force.name_any(), &target);
        return Ok(Action::requeue(RESYNC));
    }
    // Before the pods are read: a pod annotation named for the first time is not read yet
    // (the pods are listed again to read it), and nothing is recorded without it. (Once true it
    // stays true, so the pods read next carry it.)
    let annotations_read = ctx.caches.kept.cover(pps.spec.persistent_annotation_keys());
    let workload_target = target_of(&ctx.caches, &target);
    let pods = ctx.caches.pods_of(&target);
    let pods: Vec<&CachedPod> = pods.iter().map(Arc::as_ref).collect();
    // Pods to read live before their states are written over; none from a cache known to be
    // stale (nothing is written from it).
    let unsure = if crate::state::recording_from_stale(&ctx.caches.watches, &target.kind) {
        Vec::new()
    } else {
        observing(
            &ctx.caches,
            &namespace,
            &workload_target,
            &pods,
            |observed| {
                record::unsure(&pps.spec, pps.status.as_ref(), observed)
                    .into_iter()
                    .map(|(pod, recorded)| (pod.name.to_string(), pod.uid(), recorded))
                    .collect()
            },
        )
    };
    let held = confirm_unsure(&ctx, &namespace, &unsure).await;
    let change = observing(
        &ctx.caches,
        &namespace,
        &workload_target,
        &pods,
        |observed| {
            record::change(
                &pps.name_any(),
                &pps.spec,
                pps.metadata.generation.unwrap_or_default(),
                pps.status.as_ref(),
                observed,
                ctx.caches.bare_status(),
            )
        },
    )?;

    let key = ObjectRef::from_obj(pps.as_ref());
    // A change during a rollout waits (what changes meanwhile joins it); what is
    // reported below from the computed status is not held back with it.
    let paced = match &change.patch {
        Some(_) if !annotations_read => Some(ANNOTATIONS_UNREAD_RETRY),
        // A cache it is computed from known to be stale (its watch failed, and is being
        // listed again): a leader elected meanwhile would write an older pod's state back.
        Some(_) if crate::state::recording_from_stale(&ctx.caches.watches, &target.kind) => {
            Some(STALE_CACHES_RETRY)
        }
        Some(_) => ctx.pacing.wait(&key),
        None => {
            ctx.pacing.settled(&key);
            None
        }
    };
    // When a failed write may be tried again.
    let mut write_backoff = None;
    // Nothing to write, or written: a failure before is over (once the releases succeed too).
    let mut settled = change.patch.is_none();
    if let (Some(patch), None) = (&change.patch, paced) {
        // Conditional on the version the status was computed from: a stale writer (a replica
        // that lost the Lease, or a reconcile of an older copy) gets a conflict, never
        // overwrites newer states; the next reconcile computes again from the cache.
        let mut body = json!({ "status": patch });
        if let Some(version) = pps.resource_version() {
            body["metadata"] = json!({ "resourceVersion": version });
        }
        ctx.fence.before_write(&namespace).await?;
        let api: Api<PersistentPodState> = Api::namespaced(ctx.client.clone(), &namespace);
        match api
            .patch_status(
                &pps.name_any(),
                &PatchParams::default(),
                &Patch::Merge(body),
            )
            .await
        {
            Ok(written) => {
                // The extension fields sent and not kept: the CRD does not declare them.
                let kept = written.status.as_ref().and_then(|s| s.recorded);
                if change.status.recorded.is_some()
                    && kept.is_none()
                    && ctx.caches.status_came_back_bare()
                {
                    tracing::info!(
                        "the API server keeps none of this service's status fields (recorded, restored, podIPs, podUID, nodeUID, lastRestore): the PersistentPodState CRD does not declare them (OpenKruise's?); statuses are written without them until that CRD changes"
                    );
                }
                ctx.pacing.wrote(key.clone());
                let gone = matches!(workload_target, Target::Gone);
                report::written(&ctx, &pps, &change, gone);
                settled = true;
            }
            // Stale: the next reconcile computes again from newer data, soon.
            Err(kube::Error::Api(e)) if e.code == 409 => return Err(kube::Error::Api(e).into()),
            // Refused for good or failing (a policy, a quota, the API server): counted and
            // backed off as a failed reconcile is, and not tried again before the backoff is
            // over, whatever events come meanwhile. The pods this PersistentPodState strands
            // are still released below, and looked at again as they need.
            Err(error) => {
                ctx.metrics.reconcile_error(Reconciler::Status);
                let delay = ctx.failures.failed(failure_key("pps", pps.as_ref()));
                ctx.pacing.failed(key, delay);
                tracing::warn!(pps = %pps.name_any(), namespace = %namespace, %error, ?delay, "status write failed; tried again after the delay (releases still run)");
                write_backoff = Some(delay);
            }
        }
    }
    let health = Health::now(ctx.node_lost_after);
    report::unplaceable(&ctx, &pps, &change.status, &health);
    report::replaced(&ctx, &pps, &change);
    report::limits(&ctx, &pps, &workload_target);
    let next = next_look(
        &ctx.caches,
        &change.status,
        (&pps.name_any(), &pods),
        &health,
    );
    let paced = paced.map_or(next, |wait| wait.min(next));
    let paced = if held { paced.min(UNSURE_RETRY) } else { paced };
    // Releases judge nodes lost and pods stranded from the caches: none while one of them is
    // known to be stale (a node that came back would still look lost, and its pods' claims or
    // pins be released).
    let released = if crate::state::recording_from_stale(&ctx.caches.watches, &target.kind) {
        tracing::info!(pps = %pps.name_any(), %namespace, "releases wait: a cache they are judged from is stale (its watch failed, and is being listed again)");
        Ok(Some(STALE_RELEASES_RETRY))
    } else {
        releases(
            &ctx,
            &pps,
            &namespace,
            &pods,
            &change.status,
            &workload_target,
            &health,
        )
        .await
    };
    let wait = match (released, write_backoff) {
        (Ok(later), _) => later.map_or(paced, |later| later.min(paced)),
        // The failed write counted this reconcile's failure and backed it off already: a
        // release failing after it is logged, not counted (or backed off) a second time.
        (Err(error), Some(delay)) => {
            tracing::warn!(pps = %pps.name_any(), namespace = %namespace, %error, ?delay, "a release failed after the failed status write; both tried again after the delay");
            delay
        }
        (Err(error), None) => return Err(error),
    };
    // The releases' own next look (the release rate, a grace ending) is kept when it comes
    // sooner than the write's backoff.
    let wait = write_backoff.map_or(wait, |delay| wait.min(delay));
    if settled {
        ctx.failures.succeeded(&failure_key("pps", pps.as_ref()));
    }
    Ok(Action::requeue(wait))
}

/// The releases a reconcile runs after its status write (claims on volumes only a lost node can
/// mount, pods moved, pods stranded on pins): when any of them wants a look again, the soonest.
async fn releases(
    ctx: &Context,
    pps: &PersistentPodState,
    namespace: &str,
    pods: &[&CachedPod],
    status: &PersistentPodStateStatus,
    workload_target: &Target,
    health: &Health,
) -> Result<Option<Duration>, Error> {
    let mut wait: Option<Duration> = None;
    let mut sooner = |later: Duration| wait = Some(wait.map_or(later, |w| w.min(later)));
    // One release failing (a policy refusing a claim's delete, say) holds back none of the
    // others: each runs, and the first failure is returned once they have.
    let mut local =
        release_local_volumes(ctx, pps, namespace, pods, status, workload_target, health).await?;
    let mut failed = local.failed.take();
    if let Some(later) = local.later {
        sooner(later);
    }
    let moved = moved::forget_moved(ctx, pps, namespace, pods, workload_target).await;
    if let Some(Some(later)) = go_on(moved, &mut failed)? {
        sooner(later);
    }
    let stranded = release_stranded(
        ctx,
        pps,
        (namespace, workload_target),
        pods,
        health,
        &local.released,
    )
    .await;
    if let Some(Some(later)) = go_on(stranded, &mut failed)? {
        sooner(later);
    }
    failed.map_or(Ok(wait), Err)
}

/// How soon a PersistentPodState waiting for the pods to be listed again with an annotation it
/// names is looked at again (the list's end also starts a look).
const ANNOTATIONS_UNREAD_RETRY: Duration = Duration::from_secs(2);

/// How soon a PersistentPodState whose status is computed from a cache known to be stale is
/// looked at again (its write waits until every such cache is current).
const STALE_CACHES_RETRY: Duration = Duration::from_secs(2);

/// How soon a PersistentPodState is looked at again when a state it records names a pod its
/// cache has not seen go, and a live read did not show the cached pod holding that name now.
const UNSURE_RETRY: Duration = Duration::from_secs(5);

/// How long a live read of a pod ([`confirm_unsure`]) may take: one throttled by the API server
/// (the client tries a 429 again for minutes) holds back the reconcile's other pods, writes and
/// releases; given up, it is tried again at the next look.
const UNSURE_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// How many pods one reconcile reads live at once ([`confirm_unsure`]).
const UNSURE_READS_AT_ONCE: usize = 8;

/// Reads live each pod `unsure` names (by name, uid, and the uid its recorded state names:
/// [`record::unsure`]): where the cached pod holds the name now, the other one
/// is known gone, and the cached pod's state is written over it. Elsewhere (the cache lags: a
/// predecessor recorded a newer pod than it holds, or the read failed), the recorded state is
/// kept; `true` then, to look again soon (the watch catching up also starts a look).
async fn confirm_unsure(
    ctx: &Context,
    namespace: &str,
    unsure: &[(String, Option<String>, String)],
) -> bool {
    if unsure.is_empty() {
        return false;
    }
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let mut reads = Vec::with_capacity(unsure.len());
    for (name, uid, recorded) in unsure {
        reads.push(confirm_one(ctx, &api, name, uid.as_deref(), recorded));
    }
    let reads: Vec<bool> = futures::stream::iter(reads)
        .buffer_unordered(UNSURE_READS_AT_ONCE)
        .collect()
        .await;
    reads.contains(&false)
}

/// Reads the pod `name` live: `true` if it is the cached one (of `uid`), the pod `recorded`
/// then known gone.
async fn confirm_one(
    ctx: &Context,
    api: &Api<Pod>,
    name: &str,
    uid: Option<&str>,
    recorded: &str,
) -> bool {
    let namespace = api.namespace().unwrap_or_default();
    let read = tokio::time::timeout(UNSURE_READ_TIMEOUT, api.get_metadata_opt(name)).await;
    match read.unwrap_or_else(|_| Err(kube::Error::Service("timed out".into()))) {
        Ok(Some(live)) if live.metadata.uid.as_deref() == uid => {
            ctx.metrics.pod_read(PodRead::Current);
            ctx.caches.pod_gone(namespace, name, recorded);
            true
        }
        Ok(live) => {
            ctx.metrics.pod_read(PodRead::Lagging);
            let holder = live.and_then(|l| l.metadata.uid);
            tracing::info!(pod = %name, %namespace, %recorded, cached = ?uid, live = ?holder, "state kept: it records a pod this cache has not seen go, and the pod cached is not the one of that name now (the cache lags)");
            false
        }
        Err(error) => {
            ctx.metrics.pod_read(PodRead::Failed);
            tracing::warn!(pod = %name, %namespace, %error, "state kept: reading the pod live failed (it records a pod this cache has not seen go)");
            false
        }
    }
}

/// How soon the releases of a PersistentPodState held back by a stale cache are looked at
/// again (releases come after graces of minutes; a watch refused for good keeps a cache stale,
/// and each PersistentPodState would otherwise be looked at every few seconds).
const STALE_RELEASES_RETRY: Duration = Duration::from_secs(30);

/// What [`release_local_volumes`] did: the pods it released (or whose release failed: not
/// released as pinned pods in the same look), and when to look again if the rate, a failed
/// read, a claim changed meanwhile or a claim kept held some back.
#[derive(Default)]
pub(super) struct LocalReleases {
    released: BTreeSet<String>,
    pub(super) later: Option<Duration>,
    /// The first failure (each pod is still looked at past it).
    failed: Option<Error>,
}

impl LocalReleases {
    /// Looks again within `wait` (or sooner, as asked before).
    fn again_within(&mut self, wait: Duration) {
        self.later = Some(self.later.map_or(wait, |later| later.min(wait)));
    }
}

/// How soon pods whose claims could not be read, or whose release another owner's claim on
/// their node holds back (claims and volumes are not watched: what is done about it wakes
/// nothing), are looked at again.
const UNREAD_CLAIMS_RETRY: Duration = Duration::from_secs(30);

/// How soon a pod is looked at again when one of its claims changed between its read and its
/// delete.
const CHANGED_CLAIM_RETRY: Duration = Duration::from_secs(2);

/// Pods that wait while the node their state records is gone, held by claims of their own on
/// volumes only that node can mount: with the PersistentPodState's
/// `persistent-pod-state.io/release-local-volumes: "true"`, each such claim (by uid) and the pod
/// (by uid: its claims deleted, it cannot start anywhere) are deleted, within the release rate,
/// so that the workload re-creates both and the new claim binds elsewhere; without it, a
/// Warning Event says what blocks the pod and how to release it. Never while the node is only
/// within the grace period, lost or seen deleted or replaced.
async fn release_local_volumes(
    ctx: &Context,
    pps: &PersistentPodState,
    namespace: &str,
    pods: &[&CachedPod],
    status: &PersistentPodStateStatus,
    target: &Target,
    health: &Health,
) -> Result<LocalReleases, Error> {
    let mut out = LocalReleases::default();
    let Target::Live(info) = target else {
        return Ok(out);
    };
    // Observed only: this service acts on nothing it did not pin (beside another injector,
    // the claims are that one's business).
    if crate::api::observed_only(pps, ctx.observe_all) {
        return Ok(out);
    }
    if info.claim_templates.is_empty() {
        return Ok(out);
    }
    let node = |name: &str| ctx.caches.node(name);
    let mut waiting = release::waiting_on_gone_nodes(pods, status, &node, health);
    // Being deleted beside the one in force for its workload (its replacement): the pods that
    // one records too are that one's to release (once, within its rate), not this one's.
    if pps.metadata.deletion_timestamp.is_some()
        && let Some(in_force) = pps_target(pps).and_then(|t| ctx.caches.pps_for(&t))
        && let Some(recorded) = in_force.status.as_ref().map(|s| &s.pod_states)
    {
        waiting.retain(|w| !recorded.contains_key(&w.pod));
    }
    let uids: BTreeSet<String> = waiting.iter().map(|w| w.uid.clone()).collect();
    let allowed = pps
        .annotations()
        .get(RELEASE_LOCAL_VOLUMES_ANNOTATION)
        .map(String::as_str)
        == Some("true");
    let key = ObjectRef::from_obj(pps);
    let claim_api: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), namespace);
    for w in &waiting {
        // Not allowed, a pod's claims are read until once read (a failed read is tried again):
        // what blocks it is said once.
        if !allowed && report::local_reported(ctx, pps, &w.uid, &uids) {
            continue;
        }
        // Its node deleted or replaced: nothing is read or deleted for it before the grace
        // from then is over (lost, the node's own grace is over already; out of service, an
        // operator said it is shut down).
        if allowed
            && w.reason == DropReason::NodeGone
            && let Some(left) = ctx.gone_for_the_grace(&w.node, w.node_uid.as_deref())
        {
            out.again_within(left + Duration::from_secs(1));
            continue;
        }
        // Held for maintenance (below) and said so already: nothing to read until the node is
        // uncordoned, deleted or taken out of service.
        if allowed
            && w.reason == DropReason::NodeLost
            && ctx
                .caches
                .node(&w.node)
                .is_some_and(|n| placement::in_maintenance(&n))
            && report::local_reported(ctx, pps, &w.uid, &uids)
        {
            out.again_within(UNREAD_CLAIMS_RETRY);
            continue;
        }
        let judged = match ctx.own_claims(namespace, (&w.pod, &w.uid), info).await {
            Ok(judged) => judged,
            Err(e) => {
                tracing::warn!(pod = %w.pod, error = %e, "the waiting pod's claims could not be read");
                out.again_within(UNREAD_CLAIMS_RETRY);
                continue;
            }
        };
        if !allowed {
            report::first_local_report(ctx, pps, &w.uid, &uids);
        }
        let (local, kept): (Vec<_>, Vec<_>) = judged.into_iter().partition(Result::is_ok);
        let local: Vec<LocalClaim> = local
            .into_iter()
            .flatten()
            .filter(|c| release::on_node(c, w))
            .collect();
        let kept: Vec<Kept> = kept.into_iter().filter_map(Result::err).collect();
        // Its claims deleted by an earlier look (or being deleted still), whose delete of the pod
        // failed: the pod now, spending no new token.
        if local.iter().all(|c| c.deleting)
            && allowed
            && let Some(claims) = ctx.claims_deleted_of(&w.uid)
        {
            tracing::info!(pod = %w.pod, "its node-local claims were deleted before; deleting the pod now");
            let released = release_after_claims(ctx, pps, namespace, w, &claims, &mut out).await;
            if go_on(released, &mut out.failed)?.is_none() {
                out.released.insert(w.pod.clone());
            }
            continue;
        }
        if local.is_empty() {
            if allowed && !kept.is_empty() && report::first_local_report(ctx, pps, &w.uid, &uids) {
                report::local_volume_kept(ctx, pps, w, &kept);
            }
            // Held by another owner's claim on a node-local volume: read again soon (see below).
            if allowed && kept.iter().any(|k| k.local_to.is_some()) {
                out.again_within(UNREAD_CLAIMS_RETRY);
            }
            continue;
        }
        if !allowed {
            report::local_volume_blocking(ctx, pps, w, &local);
            continue;
        }
        // Another owner's claim on a volume of that node holds the pod there as well: deleting
        // the others would lose their data and leave the pod waiting.
        if kept.iter().any(|k| {
            k.local_to
                .as_deref()
                .is_some_and(|n| release::holds_on(n, w))
        }) {
            if report::first_local_report(ctx, pps, &w.uid, &uids) {
                report::local_volume_kept(ctx, pps, w, &kept);
            }
            // Another owner's claim holds the pod on its node: read again soon, since what its
            // owner or an operator does about it wakes nothing.
            out.again_within(UNREAD_CLAIMS_RETRY);
            continue;
        }
        // One of its own claims kept (a zonal disk, a volume whose node no label known to
        // name one names) can be mounted on no usable node: the pod would still wait with the
        // others released, so none is deleted for nothing. Read again soon (a node meeting it
        // may come, or come back, and claims wake nothing).
        let unmountable: Vec<Kept> = kept
            .iter()
            .filter(|k| {
                k.mountable_on
                    .as_ref()
                    .is_some_and(|s| !ctx.usable_node_meets(s, health))
            })
            .map(|k| Kept {
                why: format!(
                    "claim {} is kept ({}), and no usable node can mount it, so the pod would still wait with its other claims released",
                    k.claim, k.why
                ),
                ..k.clone()
            })
            .collect();
        if !unmountable.is_empty() {
            if report::first_local_report(ctx, pps, &w.uid, &uids) {
                report::local_volume_kept(ctx, pps, w, &unmountable);
            }
            out.again_within(UNREAD_CLAIMS_RETRY);
            continue;
        }
        // A node one of its volumes can be mounted on is there and works: the node deleted and
        // registered again (another uid) by its kubelet, with its disks. Its data may be there:
        // nothing is deleted while it is so (cordoned or full, it is waited for, as any node).
        let back: Vec<Kept> = local
            .iter()
            .filter(|c| c.node_known)
            .filter(|c| ctx.caches.node(&c.node).is_some_and(|n| !health.is_lost(&n)))
            .map(|c| Kept {
                claim: c.claim.clone(),
                why: format!(
                    "claim {} is kept: node {}, where its volume {} can be mounted, is there again and works (registered again by its kubelet?), so its data may still be there",
                    c.claim, c.node, c.volume
                ),
                local_to: None,
                mountable_on: None,
            })
            .collect();
        if !back.is_empty() {
            if report::first_local_report(ctx, pps, &w.uid, &uids) {
                report::local_volume_kept(ctx, pps, w, &back);
            }
            continue;
        }
        // Lost while cordoned and not out of service: maintenance (a drain, a reboot, a disk
        // replaced) that may outlast the grace, its disks back with it. Nothing is deleted
        // while it is so; read again soon, since a cordon lifted wakes nothing.
        if w.reason == DropReason::NodeLost
            && ctx
                .caches
                .node(&w.node)
                .is_some_and(|n| placement::in_maintenance(&n))
        {
            if report::first_local_report(ctx, pps, &w.uid, &uids) {
                let held: Vec<Kept> = local
                    .iter()
                    .map(|c| Kept {
                        claim: c.claim.clone(),
                        why: format!(
                            "claim {} is kept: node {} is cordoned (maintenance), and its volume {} comes back with it; uncordon the node, or delete it or taint it {} once it is gone for good, or run `persistent-pod-state release {} -n {namespace}`",
                            c.claim,
                            w.node,
                            c.volume,
                            placement::OUT_OF_SERVICE_TAINT,
                            w.pod
                        ),
                        local_to: None,
                        mountable_on: None,
                    })
                    .collect();
                report::local_volume_kept(ctx, pps, w, &held);
            }
            out.again_within(UNREAD_CLAIMS_RETRY);
            continue;
        }
        // What cannot be undone is judged on the API server's word, not the caches' alone.
        let judged_on = ctx.caches.node(&w.node).and_then(|n| n.uid());
        let judged = (judged_on.as_deref(), local.as_slice());
        match release::still_waiting(&ctx.client, namespace, w, judged, health).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(pod = %w.pod, node = %w.node, "the pod or its node changed since the caches' view; its claims are kept, judged again at the next look");
                continue;
            }
            Err(e) => {
                tracing::warn!(pod = %w.pod, error = %e, "the waiting pod or its node could not be read");
                out.again_within(UNREAD_CLAIMS_RETRY);
                continue;
            }
        }
        if let Err(later) = ctx.releases.take(&key) {
            tracing::info!(pod = %w.pod, ?later, "release rate reached; the pod waits for the next");
            out.again_within(later);
            return Ok(out);
        }
        let (mut claims_gone, mut deleted_any, mut failed) = (true, false, None);
        // The claims deleted (by this look, gone already, or being deleted).
        let mut gone: Vec<LocalClaim> = local.iter().filter(|c| c.deleting).cloned().collect();
        for claim in local.iter().filter(|c| !c.deleting) {
            // Each delete passes the fence right before it is sent (a hold lost between two
            // of them must stop the next), by uid and the resourceVersion read.
            ctx.fence.before_write(namespace).await?;
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(claim.uid.clone()),
                    resource_version: claim.resource_version.clone(),
                }),
                ..DeleteParams::default()
            };
            match claim_api.delete(&claim.claim, &params).await {
                Ok(_) => {
                    deleted_any = true;
                    gone.push(claim.clone());
                    report::local_volume_released(ctx, pps, w, claim);
                }
                Err(kube::Error::Api(e)) if e.code == 404 => gone.push(claim.clone()),
                // Another claim of that name now: judged again from the next look.
                Err(kube::Error::Api(e)) if e.code == 409 => claims_gone = false,
                // Refused or failing: none more of this pod's is deleted now.
                Err(e) => {
                    claims_gone = false;
                    failed = Some(e);
                    break;
                }
            }
        }
        // Once a claim is deleted (by this look, an earlier one, or being deleted already),
        // the pod is deleted even if that fails now, or the others' deletes fail: remembered
        // until it is. (Noted only now: a look stopped by the fence before any delete leaves
        // nothing new to remember.)
        if !gone.is_empty() {
            let mut remembered = ctx.claims_deleted_of(&w.uid).unwrap_or_default();
            remembered.retain(|c| !gone.iter().any(|g| g.claim == c.claim));
            remembered.extend(gone);
            ctx.claims_deleting(&w.uid, &remembered);
        }
        if !claims_gone {
            // Nothing deleted: the token goes back, for the look in a moment (a claim deleted
            // spends it: the rate bounds what is deleted).
            if !deleted_any {
                ctx.releases.give_back(&key);
            }
            out.again_within(CHANGED_CLAIM_RETRY);
            if let Some(e) = failed {
                // Not released as a pinned pod in this look either (its claims hold it).
                out.released.insert(w.pod.clone());
                go_on(Err::<(), _>(e.into()), &mut out.failed)?;
            }
            continue;
        }
        let released = release_after_claims(ctx, pps, namespace, w, &local, &mut out).await;
        if go_on(released, &mut out.failed)?.is_none() {
            out.released.insert(w.pod.clone());
        }
    }
    Ok(out)
}

/// Deletes the waiting pod `w`, its node-local `claims` deleted (remembered until it is,
/// whatever fails: [`Context::claims_deleting`]), and makes its state name its node no more.
async fn release_after_claims(
    ctx: &Context,
    pps: &PersistentPodState,
    namespace: &str,
    w: &Waiting,
    claims: &[LocalClaim],
    out: &mut LocalReleases,
) -> Result<(), Error> {
    // By uid alone: with its claims deleted the pod cannot start anywhere, whatever
    // changed since (the StatefulSet controller and the scheduler write it often now).
    // Gone already counts: the StatefulSet controller may delete it itself, to create
    // both again.
    let pod_api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let target = (namespace, w.pod.as_str());
    if delete_waiting_pod(&pod_api, &ctx.fence, target, (&w.uid, None), &|_| true).await?
        != Deleted::Kept
    {
        report::released_with_volumes(ctx, pps, w, claims);
        out.released.insert(w.pod.clone());
    }
    ctx.pod_released(&w.uid);
    // Its data on that node gone, its state names the node no more, so that a pod created
    // again once the node is back is not pinned there. Tried once here; whatever fails, and
    // a release this replica forgets (a leader change, a crash), is found again from the
    // pod created again and its new claims ([`moved`]).
    forget_released(ctx, pps, namespace, w).await
}

/// Makes the state of `w`, released with its node-local claims, name its node no more
/// ([`release::forget_node`]), once, as the cache holds it: a failure is only logged.
async fn forget_released(
    ctx: &Context,
    pps: &PersistentPodState,
    namespace: &str,
    w: &Waiting,
) -> Result<(), Error> {
    let cached = pps.status.as_ref().and_then(|s| s.pod_states.get(&w.pod));
    let api: Api<PersistentPodState> = Api::namespaced(ctx.client.clone(), namespace);
    let target = (w.pod.as_str(), Some(w.node.as_str()));
    ctx.fence.before_write(namespace).await?;
    let keys = (&ctx.node_keys, None);
    let error = match release::forget_node(&api, &pps.name_any(), target, cached, keys).await {
        Ok(release::Forgot::Done(_) | release::Forgot::Nothing) => return Ok(()),
        Ok(release::Forgot::Stale) => "the state changed since it was read".to_owned(),
        Err(e) => e.to_string(),
    };
    tracing::info!(pod = %w.pod, node = %w.node, %error, "the released pod's state still names its node: made to name none once the pod created again is scheduled where its new claims bind");
    Ok(())
}

/// Why no pod pinned on a PersistentPodState's word is released while its workload is
/// `target`, if none is: pods are released only on the word of a workload in the cache whose
/// pod template does not carry the webhook's annotations. A template copied from a pinned pod
/// gives every pod those annotations, pinned or not (each would be released again and again);
/// a workload not in the cache may be such a one.
fn release_held(target: &Target) -> Option<&'static str> {
    match target {
        Target::Live(w) if !w.template_pinned => None,
        Target::Live(_) => Some(crate::workload::TEMPLATE_PINNED_HOLDS),
        Target::Gone => Some("the workload is gone"),
        Target::Unknown => Some(
            "whether the workload exists is not known (its kind is not watched, or not listed yet)",
        ),
    }
}

/// Deletes the pods the webhook pinned to required values no usable node has any more (only
/// unscheduled ones, each by uid and resourceVersion), as many as the rate allows, so that
/// their workload re-creates them and the webhook injects what is still usable; none while
/// `held` ([`release_held`]). When the rate holds some back, how long until the next may go.
async fn release_stranded(
    ctx: &Context,
    pps: &PersistentPodState,
    (namespace, target): (&str, &Target),
    pods: &[&CachedPod],
    health: &Health,
    handled: &BTreeSet<String>,
) -> Result<Option<Duration>, Error> {
    let place = |values: &BTreeMap<String, String>| ctx.place_required(values, health);
    let stranded = record::stranded(&pps.name_any(), pods, &place);
    if let Some(why) = release_held(target) {
        if !stranded.is_empty() {
            tracing::warn!(pps = %pps.name_any(), waiting = stranded.len(), "pods wait pinned to values no usable node has; none is released: {why}");
            // Only the template's case is said by an Event: a workload gone re-creates no
            // pod, and one not listed yet is a moment of a start.
            if matches!(target, Target::Live(_)) {
                let held: Vec<&str> = stranded
                    .iter()
                    .map(|s| s.pod.as_str())
                    .filter(|p| !handled.contains(*p))
                    .collect();
                report::release_held(ctx, pps, &held, why);
            }
        }
        constrained::forget(ctx, pps);
        return Ok(None);
    }
    let key = ObjectRef::from_obj(pps);
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let (mut rate, mut failed) = (None, None);
    for pod in stranded.iter().filter(|p| !handled.contains(&p.pod)) {
        if let Err(later) = ctx.releases.take(&key) {
            tracing::info!(pod = %pod.pod, ?later, "release rate reached; the pod waits for the next");
            rate = Some(later);
            break;
        }
        let (target, rv) = ((namespace, pod.pod.as_str()), pod.resource_version.clone());
        let deleted = delete_waiting_pod(
            &api,
            &ctx.fence,
            target,
            (&pod.uid, rv),
            &still_stranded(&place),
        )
        .await;
        match go_on(deleted, &mut failed)? {
            Some(Deleted::Now) => report::released(ctx, report::PinnedBy::Live(pps), pod, None),
            // Not released after all: the token goes back.
            Some(Deleted::Kept) | None => ctx.releases.give_back(&key),
            Some(Deleted::Already) => {}
        }
    }
    // Held by a taint or relabel that came after admission instead.
    let mut skip = handled.clone();
    skip.extend(stranded.into_iter().map(|p| p.pod));
    let workload = match target {
        Target::Live(info) => Some(info),
        _ => None,
    };
    let held =
        constrained::release_held_by_pin(ctx, pps, namespace, pods, health, (&skip, workload))
            .await;
    let held = go_on(held, &mut failed)?.flatten();
    failed.map_or(
        Ok(match (rate, held) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }),
        Err,
    )
}

/// Releases the pods pinned by PersistentPodStates that are gone ([`record::orphaned`]) once no
/// usable node has the values the webhook added, as [`release_stranded`] does for a
/// PersistentPodState's own: each by uid and resourceVersion, within the release rate of the
/// PersistentPodState that pinned it, with a `PodReleased` Event on the pod. A failure with one
/// PersistentPodState's pods is logged and the others are still looked at; only a fenced write
/// ends the pass.
pub(super) async fn release_orphaned_pins(ctx: &Context) -> Result<(), Error> {
    let mut waiting = ctx.waiting_pinned();
    if waiting.is_empty() {
        return Ok(());
    }
    // As a PersistentPodState's own releases: none judged from a cache known to be stale.
    let [pps, pods, nodes] = crate::state::SERVING_WATCHES;
    if ctx.caches.watches.any_stale(&[pps, pods, nodes]) {
        tracing::info!(
            "releases of pods pinned by PersistentPodStates that are gone wait: a cache they are judged from is stale"
        );
        return Ok(());
    }
    waiting.sort_by(|a, b| (&*a.namespace, &a.name).cmp(&(&*b.namespace, &b.name)));
    let waiting: Vec<&CachedPod> = waiting.iter().map(Arc::as_ref).collect();
    let exists = |namespace: &str, name: &str| {
        let key = ObjectRef::<PersistentPodState>::new(name).within(namespace);
        ctx.caches.pps.get(&key).is_some()
    };
    let health = Health::now(ctx.node_lost_after);
    let place = |values: &BTreeMap<String, String>| ctx.place_required(values, &health);
    for ((namespace, pps), pods) in record::orphaned(&waiting, &exists) {
        let stranded = record::stranded(&pps, &pods, &place);
        if stranded.is_empty() {
            continue;
        }
        match release_orphans_of(ctx, &namespace, &pps, &pods, stranded, &place).await {
            Err(Error::Fenced(fenced)) => return Err(fenced.into()),
            Err(e) => tracing::warn!(%namespace, %pps, error = %e,
                "releasing pods pinned by a PersistentPodState that is gone failed; tried again at the next look"),
            Ok(()) => {}
        }
    }
    Ok(())
}

/// Releases `stranded`, pods of `pods` pinned by the PersistentPodState `namespace/pps`, which
/// the cache does not hold: only once the API server says it is gone (the cache may lag, and
/// holds no copy of one it cannot read), and only pods whose workload exists and creates them
/// without the webhook's annotations (a template copied from a pinned pod would make every pod
/// it creates look pinned, and each would be released again).
async fn release_orphans_of(
    ctx: &Context,
    namespace: &str,
    pps: &str,
    pods: &[&CachedPod],
    stranded: Vec<record::Stranded>,
    place: &(dyn Fn(&BTreeMap<String, String>) -> placement::Required + Sync),
) -> Result<(), Error> {
    let pps_api: Api<PersistentPodState> = Api::namespaced(ctx.client.clone(), namespace);
    if pps_api.get_metadata_opt(pps).await?.is_some() {
        return Ok(());
    }
    let key = ObjectRef::<PersistentPodState>::new(pps).within(namespace);
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    // Each workload read once a look, however many of its pods wait.
    let mut unpinned: HashMap<WorkloadRef, bool> = HashMap::new();
    for pod in stranded {
        let workload = pods
            .iter()
            .find(|p| *p.name == *pod.pod)
            .and_then(|p| p.workload());
        let Some(workload) = workload else {
            continue;
        };
        let creates = match unpinned.get(&workload) {
            Some(known) => *known,
            None => {
                let known = creates_unpinned(ctx, &workload).await?;
                unpinned.insert(workload.clone(), known);
                known
            }
        };
        if !creates {
            tracing::info!(pod = %pod.pod, workload = %workload.name, "a pod pinned by a PersistentPodState that is gone is not released: its workload is gone, not watched, or its template carries the webhook's annotations");
            continue;
        }
        if ctx.releases.take(&key).is_err() {
            tracing::info!(pod = %pod.pod, "release rate reached; the pod waits for the next look");
            break;
        }
        let (target, rv) = ((namespace, pod.pod.as_str()), pod.resource_version.clone());
        match delete_waiting_pod(
            &api,
            &ctx.fence,
            target,
            (&pod.uid, rv),
            &still_stranded(place),
        )
        .await?
        {
            Deleted::Now => {
                report::released(ctx, report::PinnedBy::Gone(namespace, pps), &pod, None);
            }
            Deleted::Kept => ctx.releases.give_back(&key),
            Deleted::Already => {}
        }
    }
    Ok(())
}

/// Whether a pod read again after its release's delete conflicted (the scheduler writes a
/// waiting pod often) is still stranded: the values the webhook added to it, as it is now, on
/// no usable node as `place` judges from the caches now.
fn still_stranded<'a>(
    place: &'a (dyn Fn(&BTreeMap<String, String>) -> placement::Required + Sync),
) -> impl Fn(&Pod) -> bool + Sync + 'a {
    move |pod: &Pod| {
        pod.annotations()
            .get(INJECTED_REQUIRED_ANNOTATION)
            .and_then(|text| decode_required(text))
            .is_some_and(|values| place(&values).dropped.is_some())
    }
}

/// Whether `workload`, read live (listed by name: the rights to its kind are list and watch),
/// exists, is of a kind this service watches, and carries neither of the webhook's own
/// annotations in its pod template: then the pods it creates are pinned by the webhook alone.
async fn creates_unpinned(ctx: &Context, workload: &WorkloadRef) -> Result<bool, Error> {
    let Some(ws) = ctx.caches.workload_store(&workload.kind) else {
        return Ok(false);
    };
    let api: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &workload.namespace, &ws.resource);
    let by_name = ListParams::default().fields(&format!("metadata.name={}", workload.name));
    let Some(obj) = api.list(&by_name).await?.items.into_iter().next() else {
        return Ok(false);
    };
    let annotations = obj.data.pointer("/spec/template/metadata/annotations");
    Ok(![INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION]
        .iter()
        .any(|key| annotations.and_then(|a| a.get(key)).is_some()))
}

/// When to look at a PersistentPodState again without a change: at the resync period, or just
/// after a node that is not ready now would count as lost: a recorded node (so the report
/// follows), or a node a pod waiting where `pps_name` steered it can still go to (so a pin
/// whose last such node is lost is released then, not at the resync).
fn next_look(
    caches: &Caches,
    status: &PersistentPodStateStatus,
    (pps_name, pods): (&str, &[&CachedPod]),
    health: &Health,
) -> Duration {
    let mut until_lost: Vec<Duration> = status
        .pod_states
        .values()
        .filter_map(|s| s.node_name.as_deref())
        .filter_map(|name| caches.node(name))
        .filter_map(|node| health.until_lost(&node))
        .collect();
    // Each distinct pin once (many pods wait for one zone in an outage); an empty one names
    // no node.
    let pins: BTreeSet<BTreeMap<String, String>> = pods
        .iter()
        .filter_map(|p| record::pinned(pps_name, p))
        .filter(|values| !values.is_empty())
        .collect();
    for values in &pins {
        caches.visit_with_labels(&placement::borrowed(values), &mut |node| {
            until_lost.extend(health.until_lost(node));
            false
        });
    }
    until_lost.into_iter().fold(RESYNC, Duration::min)
}

/// The context of one workload kind's generator.
pub struct WorkloadContext {
    pub(super) ctx: Arc<Context>,
    /// The kind's resource (objects from a list carry no apiVersion/kind of their own).
    resource: ApiResource,
}

impl WorkloadContext {
    /// The generator context of the workload kind `resource`.
    pub fn new(ctx: Arc<Context>, resource: ApiResource) -> Self {
        Self { ctx, resource }
    }
}

/// Creates, updates or deletes the PersistentPodState generated from a workload's annotations,
/// as [`generate::plan`] decides.
#[tracing::instrument(skip_all, fields(namespace = obj.namespace().unwrap_or_default(), name = %obj.name_any(), uid = obj.uid().unwrap_or_default()))]
pub async fn reconcile_workload(
    obj: Arc<DynamicObject>,
    wctx: Arc<WorkloadContext>,
) -> Result<Action, Error> {
    let ctx = &wctx.ctx;
    let _timer = ctx.metrics.reconcile_timer(Reconciler::Generator);
    let types = &wctx.resource;
    let (Some(namespace), Some(uid)) = (obj.namespace(), obj.uid()) else {
        return Ok(Action::await_change());
    };
    let name = obj.name_any();
    let workload = generate::Workload {
        api_version: &types.api_version,
        kind: &types.kind,
        namespace: &namespace,
        name: &name,
        uid: &uid,
        annotations: obj.annotations(),
        deleting: obj.metadata.deletion_timestamp.is_some(),
    };
    let existing = ctx
        .caches
        .pps
        .get(&ObjectRef::new(&name).within(&namespace));
    let targeting = ctx.caches.pps_names_for(&WorkloadRef {
        namespace: namespace.clone(),
        kind: GroupKind::new(crate::api::api_group(&types.api_version), &types.kind),
        name: name.clone(),
    });
    let api: Api<PersistentPodState> = Api::namespaced(ctx.client.clone(), &namespace);
    let planned = generate::plan(&workload, existing.as_deref(), &targeting);
    if let Some(error) = &planned.invalid_ip_request {
        report::invalid_ip_request(ctx, obj.as_ref(), types, error);
    }
    let plan = planned.plan;
    if !matches!(plan, Plan::Leave(_)) {
        ctx.fence.before_write(&namespace).await?;
    }
    let (post, patch) = (
        PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PostParams::default()
        },
        PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        },
    );
    // A new one is created (fails if one appeared meanwhile: looked at again from the cache);
    // an existing one is merge-patched, conditionally on the version planned from.
    let written = match plan {
        Plan::Create(pps) => Some(api.create(&post, &pps).await.map(drop)),
        Plan::Update(body) => Some(
            api.patch(&name, &patch, &Patch::Merge(body))
                .await
                .map(drop),
        ),
        Plan::Delete {
            uid,
            resource_version,
        } => {
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(uid),
                    resource_version,
                }),
                ..DeleteParams::default()
            };
            let deleted = api.delete(&name, &params).await;
            ctx.metrics.generator_write(GeneratorAction::Delete);
            match deleted {
                Ok(_) => tracing::info!("generated PersistentPodState deleted"),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
            None
        }
        Plan::Leave(reason @ (Leave::HandMade | Leave::OtherTargets)) => {
            tracing::warn!(
                reason = reason.as_str(),
                "not generating a PersistentPodState"
            );
            None
        }
        Plan::Leave(reason) => {
            tracing::debug!(reason = reason.as_str(), "nothing to generate");
            None
        }
    };
    if let Some(written) = written {
        match written {
            // The namespace is going away with the workload: nothing to generate.
            Err(kube::Error::Api(e)) if e.code == 403 && e.message.contains("being terminated") => {
                tracing::debug!("namespace terminating; not generating");
                return Ok(Action::await_change());
            }
            other => other?,
        }
        ctx.metrics.generator_write(GeneratorAction::Apply);
        tracing::info!("generated PersistentPodState written");
    }
    ctx.failures
        .succeeded(&failure_key("generator", obj.as_ref()));
    Ok(Action::await_change())
}

#[cfg(test)]
mod release_tests {
    use super::*;
    use crate::workload::WorkloadInfo;

    #[test]
    fn pods_are_released_only_on_the_word_of_a_workload_in_the_cache_whose_template_is_not_pinned()
    {
        let live = |template_pinned| {
            Target::Live(WorkloadInfo {
                template_pinned,
                ..WorkloadInfo::default()
            })
        };
        assert_eq!(release_held(&live(false)), None);
        let held = [live(true), Target::Gone, Target::Unknown].map(|t| release_held(&t));
        let [Some(pinned), Some(gone), Some(unknown)] = held else {
            panic!("held: {held:?}");
        };
        assert!(pinned.contains("pod template carries"), "{pinned}");
        // Neither names a template it has not seen.
        for why in [gone, unknown] {
            assert!(!why.contains("template carries"), "{why}");
        }
        assert!(unknown.contains("not known"), "{unknown}");
    }
}
