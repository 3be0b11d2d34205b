//! The controllers, reading the shared caches: one records pod states into each
//! PersistentPodState's status, one per workload kind generates PersistentPodStates from
//! workload annotations. Decisions are made by the pure functions of [`record`] and
//! [`generate`]; this module only reads caches and writes to the API.

pub mod generate;
pub mod record;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt, stream};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams, Preconditions,
};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::api::PersistentPodState;
use crate::api::{IpRestore, NodeRestore, PersistentPodStateStatus, PodState};
use crate::events::Events;
use crate::leader::{Fence, Fenced};
use crate::metrics::{GeneratorAction, Metrics, Reconciler, RestoreLabels};
use crate::placement::{self, Dropped, Health, PodDemands};
use crate::state::trim::CachedPod;
use crate::state::{Caches, WorkloadLookup, WorkloadStore, pps_target};
use crate::webhook::admit::LeftOut;
use crate::workload::{GroupKind, MAX_RESERVED_ENTRIES, WorkloadInfo, WorkloadRef};
use generate::{Leave, Plan};
use record::{Observed, Target};

/// Field manager name for server-side apply.
pub const FIELD_MANAGER: &str = "persistent-pod-state";

/// The node label a moved pod's Event reports the zone of, when recorded.
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// How often every object is reconciled even without a change.
const RESYNC: Duration = Duration::from_secs(300);

/// What the controllers share.
pub struct Context {
    /// API client.
    pub client: Client,
    /// The shared caches.
    pub caches: Arc<Caches>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Publishes Events on PersistentPodStates.
    pub events: Arc<Events>,
    /// How long a node may be not ready before a required pin to it is left out.
    pub node_lost_after: Duration,
    /// Open while this replica may write (its hold on the Lease is certain).
    pub fence: Fence,
    /// Unplaceable states already reported, by PersistentPodState.
    reported_unplaceable: Mutex<HashMap<ObjectRef<PersistentPodState>, BTreeSet<String>>>,
    /// What each PersistentPodState over the limits was reported for.
    reported_limits: Mutex<HashMap<ObjectRef<PersistentPodState>, Vec<String>>>,
    /// Consecutive failures by object, for the retry backoff.
    failures: Backoff,
    /// When each PersistentPodState's status was last written.
    pacing: Pacing,
}

impl Context {
    /// A controller context.
    pub fn new(
        client: Client,
        caches: Arc<Caches>,
        metrics: Arc<Metrics>,
        events: Arc<Events>,
        node_lost_after: Duration,
        fence: Fence,
    ) -> Self {
        Self {
            client,
            caches,
            metrics,
            events,
            node_lost_after,
            fence,
            reported_unplaceable: Mutex::default(),
            reported_limits: Mutex::default(),
            failures: Backoff::default(),
            pacing: Pacing::default(),
        }
    }
}

/// Retry delays of failed reconciles: exponential by consecutive failures of an object
/// (0.5 s, 1 s, 2 s ... up to 5 min), with jitter (each delay is between half and all of it),
/// so many objects failing together do not retry in step.
#[derive(Default)]
struct Backoff(Mutex<HashMap<String, u32>>);

impl Backoff {
    const BASE: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(300);
    /// Objects tracked at most (failures of objects gone since are forgotten beyond it).
    const TRACKED: usize = 10_000;

    fn failed(&self, key: String) -> Duration {
        let mut failures = crate::sync::lock(&self.0);
        if failures.len() >= Self::TRACKED {
            failures.clear();
        }
        let n = failures.entry(key.clone()).or_insert(0);
        *n = n.saturating_add(1);
        let exponential = Self::BASE
            .saturating_mul(2u32.saturating_pow((*n).saturating_sub(1).min(16)))
            .min(Self::MAX);
        let random = std::hash::BuildHasher::hash_one(
            &std::hash::RandomState::new(),
            (&key, *n, std::time::SystemTime::now()),
        );
        // Between half and all of the exponential delay.
        exponential.mul_f64(0.5 + (random % 1000) as f64 / 2000.0)
    }

    fn succeeded(&self, key: &str) {
        crate::sync::lock(&self.0).remove(key);
    }
}

/// Status writes are paced: at most one per PersistentPodState per [`Pacing::INTERVAL`]. The
/// first change after a quiet spell is written at once; changes that follow within the interval
/// (a large StatefulSet becoming Ready pod after pod) wait for its end and are written together,
/// so a rollout costs a few writes, not one per pod, and each pod is recorded within the
/// interval (plus a reconcile). The wait also lets the cache catch up with the last write, so
/// the next is rarely computed from a stale copy (which would be a conflict and a retry).
#[derive(Default)]
struct Pacing(Mutex<HashMap<ObjectRef<PersistentPodState>, Instant>>);

impl Pacing {
    const INTERVAL: Duration = Duration::from_millis(300);

    /// How long a write to `pps` must still wait, if at all.
    fn wait(&self, pps: &ObjectRef<PersistentPodState>) -> Option<Duration> {
        let last = crate::sync::lock(&self.0);
        let since = last.get(pps)?.elapsed();
        Self::INTERVAL.checked_sub(since).filter(|d| !d.is_zero())
    }

    /// Notes a write to `pps` now (and forgets writes older than the interval: the map holds
    /// only the PersistentPodStates written in the last interval).
    fn wrote(&self, pps: ObjectRef<PersistentPodState>) {
        let mut last = crate::sync::lock(&self.0);
        last.retain(|_, at| at.elapsed() < Self::INTERVAL);
        last.insert(pps, Instant::now());
    }
}

/// Reconciles run at once per controller: bounded, so a burst of changes cannot open
/// unbounded concurrent requests to the API server.
const CONCURRENCY: u16 = 4;

/// A failed reconcile; retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed a write.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A value could not be serialized.
    #[error("serialization: {0}")]
    Json(#[from] serde_json::Error),
    /// This replica may not write now (its hold on the Lease is not certain).
    #[error(transparent)]
    Fenced(#[from] Fenced),
}

/// Runs every controller until `shutdown`; reconciles in flight finish first.
pub async fn run(ctx: Arc<Context>, shutdown: CancellationToken) {
    let caches = ctx.caches.clone();
    let pps_requests = caches.triggers.subscribe_pps();
    let pps = Controller::for_stream(
        stream::empty::<Result<PersistentPodState, watcher::Error>>(),
        caches.pps.clone(),
    )
    .with_config(controller::Config::default().concurrency(CONCURRENCY))
    .reconcile_on(pps_requests)
    .graceful_shutdown_on(shutdown.clone().cancelled_owned())
    .run(reconcile_pps, pps_error_policy, ctx.clone())
    .for_each(|_| async {})
    .map(|()| None)
    .boxed();

    // Each run ends with the token that was meant to stop it (`None`: the PersistentPodState
    // controller, stopped by `shutdown`).
    let runs = FuturesUnordered::new();
    runs.push(pps);
    // One generator per watched workload kind; kinds come and go with their CRDs.
    let mut generators: HashMap<GroupKind, (WorkloadStore, CancellationToken)> = HashMap::new();
    let mut kinds_changed = caches.subscribe_workload_kinds();
    let mut first = true;
    futures::pin_mut!(runs);
    loop {
        let watched = caches.workload_kinds();
        generators.retain(|kind, (store, stop)| {
            let current = watched
                .iter()
                .any(|(k, ws)| k == kind && ws.same_watch(store));
            if !current {
                stop.cancel();
            }
            current
        });
        for (kind, ws) in watched {
            if generators.contains_key(&kind) {
                continue;
            }
            let stop = shutdown.child_token();
            let requests = caches.triggers.subscribe_workloads(&kind);
            runs.push(
                Controller::for_stream_with(
                    stream::empty::<Result<DynamicObject, watcher::Error>>(),
                    ws.store.clone(),
                    ws.resource.clone(),
                )
                .with_config(controller::Config::default().concurrency(CONCURRENCY))
                .reconcile_on(requests)
                .graceful_shutdown_on(stop.clone().cancelled_owned())
                .run(
                    reconcile_workload,
                    workload_error_policy,
                    Arc::new(WorkloadContext::new(ctx.clone(), ws.resource.clone())),
                )
                .for_each(|_| async {})
                .map({
                    let stop = stop.clone();
                    move |()| Some(stop)
                })
                .boxed(),
            );
            caches.resync_kind(&kind);
            generators.insert(kind, (ws, stop));
        }
        if first {
            caches.resync();
            first = false;
        }
        // Drive the controllers until the watched kinds change or shutdown.
        tokio::select! {
            Some(ended) = runs.next() => {
                // A generator whose kind went away was stopped on purpose; any other end is a
                // failure: return, so that the process exits and is restarted.
                if !ended.as_ref().unwrap_or(&shutdown).is_cancelled() {
                    tracing::error!("a controller stopped by itself");
                    return;
                }
            }
            changed = kinds_changed.changed() => if changed.is_err() { break },
            () = shutdown.cancelled() => break,
        }
    }
    // Every controller stops on `shutdown`; let the reconciles in flight finish.
    while runs.next().await.is_some() {}
}

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
    if let Some(in_force) = ctx.caches.pps_for(&target)
        && in_force.metadata.name != pps.metadata.name
    {
        let older = in_force.name_any();
        tracing::warn!(%older, "another PersistentPodState targets the workload and is older; recording nothing");
        let note = format!(
            "PersistentPodState {older} targets {}/{} {} too and is older: it is the one in force; this one records nothing",
            target.kind.group, target.kind.kind, target.name
        );
        ctx.events
            .publish(&pps, EventType::Warning, "DuplicateTarget", "Record", note);
        return Ok(Action::requeue(RESYNC));
    }
    let workload_target = target_of(&ctx.caches, &target);
    let desired = {
        let caches = &ctx.caches;
        let pods = caches.pods_of(&target);
        let pods: Vec<&CachedPod> = pods.iter().map(Arc::as_ref).collect();
        let pod_exists = |name: &str| caches.pod_exists(&namespace, name);
        let node_labels = |name: &str| caches.node(name).map(|n| n.labels().clone());
        let observed = Observed {
            target: workload_target.clone(),
            pods: &pods,
            pod_exists: &pod_exists,
            node_labels: &node_labels,
        };
        let generation = pps.metadata.generation.unwrap_or_default();
        record::desired_status(
            &pps.name_any(),
            &pps.spec,
            generation,
            pps.status.as_ref(),
            &observed,
        )
    };

    let old = serde_json::to_value(&pps.status)?;
    let new = serde_json::to_value(&desired)?;
    let key = ObjectRef::from_obj(pps.as_ref());
    // A write within the pacing interval waits (what changes meanwhile joins it); what is
    // reported below from the computed status is not held back with it.
    let patch = record::merge_patch(&old, &new);
    let paced = patch.as_ref().and_then(|_| ctx.pacing.wait(&key));
    if let (Some(patch), None) = (patch, paced) {
        // Conditional on the version the status was computed from: a stale writer (a replica
        // that lost the Lease, or a reconcile of an older copy) gets a conflict, never
        // overwrites newer states; the next reconcile computes again from the cache.
        let mut body = json!({ "status": patch });
        if let Some(version) = pps.resource_version() {
            body["metadata"] = json!({ "resourceVersion": version });
        }
        ctx.fence.check()?;
        let api: Api<PersistentPodState> = Api::namespaced(ctx.client.clone(), &namespace);
        api.patch_status(
            &pps.name_any(),
            &PatchParams::default(),
            &Patch::Merge(body),
        )
        .await?;
        ctx.pacing.wrote(key);
        ctx.metrics.status_writes.inc();
        let (recorded, pruned) = changes(pps.status.as_ref(), &desired);
        ctx.metrics.states_recorded.inc_by(recorded.len() as u64);
        ctx.metrics.states_pruned.inc_by(pruned.len() as u64);
        tracing::info!(
            recorded = recorded.len(),
            pruned = pruned.len(),
            states = desired.pod_states.len(),
            "status updated"
        );
        if !recorded.is_empty() {
            let placed: Vec<String> = recorded
                .iter()
                .map(|pod| {
                    let node = desired
                        .pod_states
                        .get(pod)
                        .and_then(|s| s.node_name.as_deref());
                    format!("{pod} on {}", node.unwrap_or("?"))
                })
                .collect();
            let note = format!("recorded {}", placed.join(", "));
            ctx.events
                .publish(&pps, EventType::Normal, "StatesRecorded", "Record", note);
        }
        report_restorations(&ctx, &pps, &desired);
        if !pruned.is_empty() {
            let note = format!(
                "pruned {} (pods gone, ordinals no longer live)",
                pruned.join(", ")
            );
            ctx.events
                .publish(&pps, EventType::Normal, "StatesPruned", "Prune", note);
        }
    }
    ctx.failures.succeeded(&failure_key("pps", pps.as_ref()));
    let health = Health::now(ctx.node_lost_after);
    report_unplaceable(&ctx, &pps, &desired, &health);
    report_limits(&ctx, &pps, &workload_target);
    let next = next_look(&ctx.caches, &desired, &health);
    Ok(Action::requeue(paced.map_or(next, |wait| wait.min(next))))
}

/// Counts the pods that came back since the last status, by whether they kept their node and
/// IP; one that moved or changed IP gets a Warning Event naming it, the old and the new value.
fn report_restorations(
    ctx: &Context,
    pps: &PersistentPodState,
    desired: &PersistentPodStateStatus,
) {
    for (pod, before, now, restore) in record::restorations(pps.status.as_ref(), desired) {
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
fn report_limits(ctx: &Context, pps: &PersistentPodState, target: &Target) {
    let mut over = pps.spec.over_limits();
    if let Target::Live(w) = target
        && w.reserved_truncated
    {
        over.push(format!(
            "the workload's reserveOrdinals has more than {MAX_RESERVED_ENTRIES} entries (only the first are read)"
        ));
    }
    let key = ObjectRef::from_obj(pps);
    let newly = {
        let mut reported = crate::sync::lock(&ctx.reported_limits);
        let newly = !over.is_empty() && reported.get(&key) != Some(&over);
        if over.is_empty() {
            reported.remove(&key);
        } else {
            reported.insert(key, over.clone());
        }
        reported.retain(|k, _| ctx.caches.pps.get(k).is_some());
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

/// When to look at a PersistentPodState again without a change: at the resync period, or just
/// after a recorded node that is not ready now would count as lost (so the report follows).
fn next_look(caches: &Caches, status: &PersistentPodStateStatus, health: &Health) -> Duration {
    status
        .pod_states
        .values()
        .filter_map(|s| s.node_name.as_deref())
        .filter_map(|name| caches.node(name))
        .filter_map(|node| health.lost_at(&node))
        .filter(|at| *at > health.now)
        .map(|at| {
            let secs = at.as_second().saturating_sub(health.now.as_second());
            Duration::from_secs(u64::try_from(secs).unwrap_or(0) + 1)
        })
        .fold(RESYNC, Duration::min)
}

/// Publishes a Warning Event for each state that newly became unplaceable (its required node or
/// zone is gone or lost), and keeps the gauge of such states current.
fn report_unplaceable(
    ctx: &Context,
    pps: &PersistentPodState,
    status: &PersistentPodStateStatus,
    health: &Health,
) {
    let demands = PodDemands::default();
    let place = |recorded: &BTreeMap<String, String>| {
        placement::required(recorded, &demands, ctx.caches.as_ref(), health)
    };
    let unplaceable = record::unplaceable_states(&pps.spec, status, &place);
    let key = ObjectRef::from_obj(pps);
    let newly: Vec<(String, Dropped)> = {
        let mut reported = crate::sync::lock(&ctx.reported_unplaceable);
        let before = reported.remove(&key).unwrap_or_default();
        let newly = unplaceable
            .iter()
            .filter(|(pod, _)| !before.contains(*pod))
            .map(|(p, v)| (p.clone(), v.clone()))
            .collect();
        if !unplaceable.is_empty() {
            reported.insert(key, unplaceable.keys().cloned().collect());
        }
        // PPS deleted since they were reported are forgotten.
        reported.retain(|k, _| ctx.caches.pps.get(k).is_some());
        let total: usize = reported.values().map(BTreeSet::len).sum();
        ctx.metrics.states_unplaceable.set(total as i64);
        newly
    };
    for (pod, dropped) in newly {
        let left_out: Vec<LeftOut> = LeftOut::required(&dropped).collect();
        let note = format!(
            "a re-created pod {pod} would be left without {}",
            LeftOut::list(&left_out)
        );
        ctx.events.publish(
            pps,
            EventType::Warning,
            "RequiredTopologyUnavailable",
            "Inject",
            note,
        );
    }
}

/// Names of the states added or changed, and of the states removed, from `old` to `new`.
fn changes(
    old: Option<&PersistentPodStateStatus>,
    new: &PersistentPodStateStatus,
) -> (Vec<String>, Vec<String>) {
    let empty = BTreeMap::new();
    let old = old.map_or(&empty, |s| &s.pod_states);
    let recorded = new
        .pod_states
        .iter()
        .filter(|(k, v)| old.get(*k) != Some(v))
        .map(|(k, _)| k.clone())
        .collect();
    let pruned = old
        .keys()
        .filter(|k| !new.pod_states.contains_key(*k))
        .cloned()
        .collect();
    (recorded, pruned)
}

fn failure_key<K: ResourceExt>(controller: &str, obj: &K) -> String {
    format!(
        "{controller}/{}/{}",
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    )
}

/// Whether an error is a conflict (a write conditional on an older version).
fn is_conflict(error: &Error) -> bool {
    matches!(error, Error::Kube(kube::Error::Api(e)) if e.code == 409)
}

fn pps_error_policy(pps: Arc<PersistentPodState>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_error(Reconciler::Status);
    let delay = ctx.failures.failed(failure_key("pps", pps.as_ref()));
    if is_conflict(error) {
        tracing::info!(pps = %pps.name_any(), namespace = ?pps.namespace(), "status changed meanwhile; computing again");
    } else {
        tracing::warn!(pps = %pps.name_any(), namespace = ?pps.namespace(), %error, ?delay, "reconcile failed; retrying");
    }
    Action::requeue(delay)
}

/// The context of one workload kind's generator.
pub struct WorkloadContext {
    ctx: Arc<Context>,
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
    let plan = generate::plan(&workload, existing.as_deref(), &targeting);
    if let Some(error) = generate::invalid_ip_request(&workload)
        && !workload.deleting
    {
        ctx.metrics.invalid_workload_ip_requests.inc();
        // The value is the tenant's: in the Event on its own workload, not in the logs.
        tracing::warn!("the workload's ip-request annotation is not valid; not copied");
        ctx.events.publish_on(
            kube::Resource::object_ref(obj.as_ref(), types),
            "",
            EventType::Warning,
            "InvalidIPRequest",
            "Generate",
            format!(
                "{}: {error}; not copied to the generated PersistentPodState, so its pods request no IP",
                crate::api::ip_request::IP_REQUEST_ANNOTATION
            ),
        );
    }
    if !matches!(plan, Plan::Leave(_)) {
        ctx.fence.check()?;
    }
    match plan {
        Plan::Apply(pps) => {
            // A new one is created (fails if one appeared meanwhile: looked at again from the
            // cache); an existing one is applied conditionally on the version planned from.
            let applied = if pps.resource_version().is_none() {
                api.create(&PostParams::default(), &pps).await
            } else {
                api.patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&pps),
                )
                .await
            };
            match applied {
                // The namespace is going away with the workload: nothing to generate.
                Err(kube::Error::Api(e))
                    if e.code == 403 && e.message.contains("being terminated") =>
                {
                    tracing::debug!("namespace terminating; not generating");
                    return Ok(Action::await_change());
                }
                other => other?,
            };
            ctx.metrics.generator_write(GeneratorAction::Apply);
            tracing::info!("generated PersistentPodState applied");
        }
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
        }
        Plan::Leave(reason @ (Leave::HandMade | Leave::OtherTargets)) => {
            tracing::warn!(
                reason = reason.as_str(),
                "not generating a PersistentPodState"
            );
        }
        Plan::Leave(reason) => tracing::debug!(reason = reason.as_str(), "nothing to generate"),
    }
    ctx.failures
        .succeeded(&failure_key("generator", obj.as_ref()));
    Ok(Action::await_change())
}

fn workload_error_policy(
    obj: Arc<DynamicObject>,
    error: &Error,
    wctx: Arc<WorkloadContext>,
) -> Action {
    let ctx = &wctx.ctx;
    ctx.metrics.reconcile_error(Reconciler::Generator);
    let delay = ctx.failures.failed(failure_key("generator", obj.as_ref()));
    tracing::warn!(workload = %obj.name_any(), namespace = ?obj.namespace(), %error, ?delay, "generation failed; retrying");
    Action::requeue(delay)
}

#[cfg(test)]
mod tests;
