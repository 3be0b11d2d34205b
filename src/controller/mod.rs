//! The controllers, reading the shared caches: one records pod states into each
//! PersistentPodState's status, one per workload kind generates PersistentPodStates from
//! workload annotations. Decisions are made by the pure functions of [`record`] and
//! [`generate`]; the shells in `reconcile` only read caches and write to the API, `report`
//! turns what happened into Events and metrics, `retry` paces writes and backs off failures;
//! this module holds what they share and runs them.

mod constrained;
mod delete;
pub mod generate;
mod moved;
mod reconcile;
pub mod record;
mod report;
mod retry;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt, stream};
use kube::Client;
use kube::api::DynamicObject;
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

use crate::api::PersistentPodState;
use crate::events::Events;
use crate::leader::{Fence, Fenced};
use crate::metrics::Metrics;
use crate::placement::{self, Health, PodDemands, Required};
use crate::release::NodeKeys;
use crate::state::trim::CachedPod;
use crate::state::{Caches, NodeHealthChange, WorkloadStore, pps_target};
use crate::workload::GroupKind;
pub use reconcile::{WorkloadContext, reconcile_pps, reconcile_workload};
use retry::{Backoff, Pacing, Releases, pps_error_policy, workload_error_policy};

/// Field manager name for server-side apply.
pub const FIELD_MANAGER: &str = "persistent-pod-state";

/// How often every object is reconciled even without a change.
const RESYNC: Duration = Duration::from_secs(300);

/// How long a placement of recorded required values is reused while no node changes (a node
/// also becomes lost by time alone, at most this late).
const PLACEMENT_TTL: Duration = Duration::from_millis(500);
/// The most placements kept (distinct sets of recorded values; all dropped beyond).
const MAX_PLACEMENTS: usize = 65_536;

/// Placements of recorded required values with no pod's own demands, shared by reconciles:
/// during a zone outage every PersistentPodState places the same few zones, and placing
/// values whose nodes are lost looks at every node.
#[derive(Default)]
struct Placements {
    nodes_changed: u64,
    at: Option<Instant>,
    by_values: HashMap<BTreeMap<String, String>, Required>,
}

impl Context {
    /// Where `values` can still be required of a pod with no demands of its own: placed again
    /// only when a node changed or the last placements are older than [`PLACEMENT_TTL`].
    fn place_required(&self, values: &BTreeMap<String, String>, health: &Health) -> Required {
        let nodes_changed = self.caches.nodes_changed();
        {
            let mut memo = crate::sync::lock(&self.placements);
            let fresh = memo.nodes_changed == nodes_changed
                && memo.at.is_some_and(|at| at.elapsed() < PLACEMENT_TTL);
            if !fresh {
                memo.by_values.clear();
                memo.nodes_changed = nodes_changed;
                memo.at = Some(Instant::now());
            } else if let Some(placed) = memo.by_values.get(values) {
                return placed.clone();
            }
        }
        let placed =
            placement::required_owned(values, &PodDemands::none(), self.caches.as_ref(), health);
        let mut memo = crate::sync::lock(&self.placements);
        if memo.nodes_changed == nodes_changed {
            if memo.by_values.len() >= MAX_PLACEMENTS {
                memo.by_values.clear();
            }
            memo.by_values.insert(values.clone(), placed.clone());
        }
        placed
    }
}

impl Context {
    /// The PersistentPodStates a batch of node health changes concerns: those with a state
    /// recorded on one of the nodes (what they record, when to look again, what to release),
    /// those with a pod waiting where they steered it (it may be stranded now), and those with
    /// a state whose required values the nodes carry and whose unplaceable states differ from
    /// what was last reported of them. The others would reconcile to nothing new: during a zone
    /// outage, each of its nodes would otherwise reconcile every PersistentPodState.
    fn concerned_by(&self, changes: &[NodeHealthChange]) -> Vec<ObjectRef<PersistentPodState>> {
        let (tainted, changes): (Vec<&NodeHealthChange>, Vec<&NodeHealthChange>) =
            changes.iter().partition(|c| c.taints_only);
        let mut concerned = self.pinned_on(&tainted);
        if !changes.is_empty() {
            concerned.extend(self.concerned_by_health(&changes));
        }
        concerned.into_iter().collect()
    }

    /// The PersistentPodStates with a pod waiting where they steered it, pinned to values one
    /// of `nodes` carries (their taints changed: such a pod may be held there now, or no more).
    fn pinned_on(&self, nodes: &[&NodeHealthChange]) -> HashSet<ObjectRef<PersistentPodState>> {
        if nodes.is_empty() {
            return HashSet::new();
        }
        let carried = |values: &BTreeMap<String, String>| {
            nodes
                .iter()
                .any(|n| values.iter().all(|(k, v)| n.labels.get(k) == Some(v)))
        };
        let waiting = self.waiting_pinned();
        let concerned: HashSet<ObjectRef<PersistentPodState>> = waiting
            .iter()
            .filter_map(|p| {
                let pps = p.annotations.get(crate::api::INJECTED_ANNOTATION)?;
                let values = record::pinned(pps, p)?;
                carried(&values).then(|| ObjectRef::new(pps).within(&p.namespace))
            })
            .collect();
        tracing::debug!(
            nodes = nodes.len(),
            concerned = concerned.len(),
            "taints pods must tolerate changed"
        );
        concerned
    }

    /// The cached pods that wait unscheduled with required values the webhook added.
    fn waiting_pinned(&self) -> Vec<Arc<CachedPod>> {
        self.caches.pods_where(|p| {
            p.node_name.as_deref().is_none_or(str::is_empty)
                && p.annotations
                    .get(crate::api::INJECTED_REQUIRED_ANNOTATION)
                    .is_some()
        })
    }

    /// [`Self::concerned_by`] for changes of health.
    fn concerned_by_health(
        &self,
        changes: &[&NodeHealthChange],
    ) -> Vec<ObjectRef<PersistentPodState>> {
        let names: HashSet<&str> = changes.iter().map(|c| c.name.as_str()).collect();
        let labels: HashSet<(&str, &str)> = changes
            .iter()
            .flat_map(|c| c.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .collect();
        let health = Health::now(self.node_lost_after);
        let all = self.caches.pps.state();
        let mut placed = report::Placed::default();
        let concerned: Vec<_> = all
            .iter()
            .filter(|pps| {
                let Some(status) = pps.status.as_ref() else {
                    return false;
                };
                let states = || status.pod_states.values();
                let on_nodes =
                    || states().any(|s| s.node_name.as_deref().is_some_and(|n| names.contains(n)));
                let keys = pps.spec.required_keys();
                let carried = || {
                    states().any(|s| {
                        keys.iter().any(|k| {
                            s.node_topology_labels
                                .get(k.as_str())
                                .is_some_and(|v| labels.contains(&(k.as_str(), v.as_str())))
                        })
                    })
                };
                let waiting = || {
                    let name = pps.metadata.name.as_deref().unwrap_or_default();
                    pps_target(pps).is_some_and(|target| {
                        let pods = self.caches.pods_of(&target);
                        pods.iter().any(|p| record::waits_steered(name, p))
                    })
                };
                on_nodes()
                    || waiting()
                    || (carried() && report::unplaceable_changed(self, pps, &health, &mut placed))
            })
            .map(|pps| ObjectRef::from_obj(pps.as_ref()))
            .collect();
        tracing::debug!(
            nodes = changes.len(),
            concerned = concerned.len(),
            "node health changed"
        );
        concerned
    }
}

/// How often the entries of PersistentPodStates gone from the cache are dropped from what was
/// reported.
const FORGET_EVERY: Duration = Duration::from_secs(10);

/// What was last reported about each PersistentPodState (so a report goes out once).
#[derive(Default)]
struct Reported<T>(Mutex<ReportedMap<T>>);

/// The entries of a [`Reported`], locked.
struct ReportedMap<T> {
    by_pps: HashMap<ObjectRef<PersistentPodState>, T>,
    forgotten_at: Option<Instant>,
}

impl<T> Default for ReportedMap<T> {
    fn default() -> Self {
        Self {
            by_pps: HashMap::new(),
            forgotten_at: None,
        }
    }
}

impl<T> Reported<T> {
    /// The entries, and whether those of PersistentPodStates gone from `caches` were dropped
    /// just now: at most once per [`FORGET_EVERY`], since it looks at every entry (on every
    /// reconcile, that made a pass over 10,000 PersistentPodStates quadratic).
    fn lock(&self, caches: &Caches) -> (std::sync::MutexGuard<'_, ReportedMap<T>>, bool) {
        let mut map = crate::sync::lock(&self.0);
        let due = map
            .forgotten_at
            .is_none_or(|at| at.elapsed() >= FORGET_EVERY);
        if due {
            map.by_pps.retain(|k, _| caches.pps.get(k).is_some());
            map.forgotten_at = Some(Instant::now());
        }
        (map, due)
    }
}

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
    reported_unplaceable: Reported<report::Unplaceable>,
    /// What each PersistentPodState over the limits was reported for.
    reported_limits: Reported<Vec<String>>,
    /// Replaced nodes already reported, by PersistentPodState: (pod, the node's new uid).
    reported_replaced: Reported<BTreeSet<(String, String)>>,
    /// Waiting pods whose node-local volumes were reported (kept or blocking), by
    /// PersistentPodState: their uids.
    reported_local: Reported<BTreeSet<String>>,
    /// Placements of recorded required values, shared by reconciles.
    placements: Mutex<Placements>,
    /// Consecutive failures by object, for the retry backoff.
    failures: Backoff,
    /// When each PersistentPodState's status was last written.
    pacing: Pacing,
    /// `serve --mode observe`.
    observe_all: bool,
    /// The node labels that name one node in a node-local volume's affinity.
    node_keys: NodeKeys,
    /// Releases of waiting pods allowed, by PersistentPodState.
    releases: Releases,
    /// Pods scheduled elsewhere than their state records whose claims were read and showed no
    /// data moved (not read again while so, or for a while after a failed read), by
    /// PersistentPodState and pod uid.
    data_in_place: Reported<HashMap<String, moved::InPlace>>,
    /// What was judged of pinned waiting pods whose node took a taint (held by the pin alone?).
    judged: Mutex<constrained::Judged>,
    /// Since when this term has seen each recorded node (by name and the uid recorded)
    /// deleted or replaced as it is now: its pods' node-local claims wait for the grace from
    /// then ([`Context::gone_for_the_grace`]).
    gone_seen: Mutex<HashMap<(String, Option<String>), GoneSeen>>,
    /// The waiting pods (by uid) whose node-local claims a look deleted, each with those
    /// claims, until the pod is deleted too: a delete of the pod that failed after its claims
    /// went is made by the next look, which finds no claim of it left to judge.
    claims_deleted: Mutex<HashMap<String, (tokio::time::Instant, Vec<crate::release::LocalClaim>)>>,
}

/// How long a pod whose claims were deleted is remembered so, its own delete failing (the
/// pod replaced or gone meanwhile: never looked at again).
const CLAIMS_DELETED_FORGOTTEN_AFTER: Duration = Duration::from_secs(3600);

/// A recorded node seen deleted or replaced under its name.
struct GoneSeen {
    /// The uid of the node of that name when last seen so (none: deleted).
    now_there: Option<String>,
    /// When first seen so.
    since: tokio::time::Instant,
    /// When last seen so.
    seen: tokio::time::Instant,
}

/// How long a node no look has seen deleted or replaced is remembered as such.
const GONE_FORGOTTEN_AFTER: Duration = Duration::from_secs(600);

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
            reported_unplaceable: Reported::default(),
            reported_limits: Reported::default(),
            reported_replaced: Reported::default(),
            reported_local: Reported::default(),
            placements: Mutex::default(),
            failures: Backoff::default(),
            pacing: Pacing::default(),
            releases: Releases::new(Releases::DEFAULT_PER_MINUTE),
            data_in_place: Reported::default(),
            judged: Mutex::default(),
            gone_seen: Mutex::default(),
            claims_deleted: Mutex::default(),
            observe_all: false,
            node_keys: NodeKeys::default(),
        }
    }

    /// `serve --mode observe`: every PersistentPodState observed only, so nothing is released
    /// (a waiting pod pinned by this service is still released: the pin was its own).
    pub fn observing(mut self, observe_all: bool) -> Self {
        self.observe_all = observe_all;
        self
    }

    /// The claims of pod `pod` (name, uid) in `namespace` named after `workload`'s
    /// `volumeClaimTemplates`, read and judged ([`crate::release::local_claims`]).
    async fn own_claims(
        &self,
        namespace: &str,
        pod: (&str, &str),
        workload: &crate::workload::WorkloadInfo,
    ) -> Result<Vec<Result<crate::release::LocalClaim, crate::release::Kept>>, kube::Error> {
        crate::release::local_claims(
            &self.client,
            namespace,
            pod,
            &workload.claim_templates,
            &workload.uid,
            self.caches.as_ref(),
            &self.node_keys,
        )
        .await
    }

    /// Whether a node in the cache that is not lost meets `selector` (a volume's affinity).
    fn usable_node_meets(
        &self,
        selector: &k8s_openapi::api::core::v1::NodeSelector,
        health: &Health,
    ) -> bool {
        use kube::ResourceExt;
        self.caches.nodes.state().iter().any(|node| {
            !health.is_lost(node)
                && placement::selector_matches(selector, &node.name_any(), node.labels())
        })
    }

    /// The context with `keys` as the labels that name one node in a volume's affinity.
    pub fn naming_nodes_by(mut self, keys: NodeKeys) -> Self {
        self.node_keys = keys;
        self
    }

    /// This replica's controllers stopped (its term as leader ended, or the process stops):
    /// what only the leader keeps current is dropped, so that its gauges say nothing stale
    /// beside the new leader's (the alerts take the largest over the replicas), and a next
    /// term reports afresh; and what was judged of pinned waiting pods and of nodes seen
    /// deleted, which nothing kept current meanwhile (a taint gone and back, a node back,
    /// unseen), so that a next term judges them afresh, each for a whole grace, as a new
    /// leader does.
    fn term_ended(&self) {
        crate::sync::lock(&self.judged).clear();
        crate::sync::lock(&self.gone_seen).clear();
        crate::sync::lock(&self.reported_unplaceable.0)
            .by_pps
            .clear();
        self.metrics.states_unplaceable.set(0);
        crate::sync::lock(&self.reported_limits.0).by_pps.clear();
        self.metrics.over_limits.set(0);
    }

    /// How much of the grace is left for the node `name` (recorded with `uid`), deleted or
    /// replaced under its name, before its pods' node-local claims may be deleted: the grace
    /// (`--node-lost-after`) runs from when this term first saw it so, as it is now (a node
    /// of that name back, under another uid, or deleted again, starts it anew). A node deleted
    /// by mistake, or by a kubelet that registers it again, comes back within it with its
    /// disks; what cannot be undone waits for that. `None`: the grace is over.
    pub(super) fn gone_for_the_grace(&self, name: &str, uid: Option<&str>) -> Option<Duration> {
        let now = tokio::time::Instant::now();
        let now_there = self.caches.node(name).and_then(|n| n.metadata.uid.clone());
        let mut seen = crate::sync::lock(&self.gone_seen);
        seen.retain(|_, g| g.seen + GONE_FORGOTTEN_AFTER > now);
        let entry = seen
            .entry((name.to_owned(), uid.map(str::to_owned)))
            .or_insert_with(|| GoneSeen {
                now_there: now_there.clone(),
                since: now,
                seen: now,
            });
        if entry.now_there != now_there {
            entry.now_there = now_there;
            entry.since = now;
        }
        entry.seen = now;
        let over = entry.since + self.node_lost_after;
        (over > now).then(|| over - now)
    }

    /// Drops what was reported of PersistentPodStates deleted since (when due, as
    /// [`Reported::lock`] does) and sets the gauges counting it again: no reconcile of a deleted
    /// one does, and the last one deleted would leave them up for ever.
    pub(super) fn forget_gone_reports(&self) {
        let (unplaceable, forgot) = self.reported_unplaceable.lock(&self.caches);
        if forgot {
            let states = unplaceable
                .by_pps
                .values()
                .map(BTreeMap::len)
                .sum::<usize>();
            self.metrics.states_unplaceable.set(states as i64);
        }
        drop(unplaceable);
        let (limits, forgot) = self.reported_limits.lock(&self.caches);
        if forgot {
            self.metrics.over_limits.set(limits.by_pps.len() as i64);
        }
    }

    /// The node-local claims of the waiting pod `uid` are being deleted: remembered until
    /// [`Context::pod_released`], so that the pod's own delete is made even if it fails now.
    pub(super) fn claims_deleting(&self, uid: &str, claims: &[crate::release::LocalClaim]) {
        let now = tokio::time::Instant::now();
        let mut deleted = crate::sync::lock(&self.claims_deleted);
        deleted.retain(|_, (at, _)| *at + CLAIMS_DELETED_FORGOTTEN_AFTER > now);
        deleted.insert(uid.to_owned(), (now, claims.to_vec()));
    }

    /// The node-local claims deleted for the waiting pod `uid` whose own delete is still to
    /// be made, if any.
    pub(super) fn claims_deleted_of(&self, uid: &str) -> Option<Vec<crate::release::LocalClaim>> {
        crate::sync::lock(&self.claims_deleted)
            .get(uid)
            .map(|(_, claims)| claims.clone())
    }

    /// The waiting pod `uid` was deleted (or is gone, or changed) after its claims.
    pub(super) fn pod_released(&self, uid: &str) {
        crate::sync::lock(&self.claims_deleted).remove(uid);
    }

    /// At most `per_minute` waiting pods released per PersistentPodState per minute (0: none).
    pub fn releasing(mut self, per_minute: u32) -> Self {
        self.releases = Releases::new(per_minute);
        self
    }
}

/// Reconciles run at once per controller: bounded, so a burst of changes cannot open
/// unbounded concurrent requests to the API server.
const CONCURRENCY: u16 = 4;

/// Node health changes looked at together, at most.
const NODE_CHANGES_AT_ONCE: usize = 256;

/// How long the node health changes that follow a first one are gathered before the
/// PersistentPodStates they concern are looked for: a pass looks at every PersistentPodState,
/// and while the node lifecycle controller marks a lost zone's nodes one by one (several a
/// second), a pass per change cost the leader most of a core at 10,000 PersistentPodStates.
/// Small beside the node monitor's grace period (tens of seconds) before any node counts as
/// lost.
const NODE_CHANGES_GATHERED_FOR: Duration = Duration::from_secs(1);

/// The node health changes of `changes` in batches: each one the first change to come and those
/// that follow within [`NODE_CHANGES_GATHERED_FOR`], at most [`NODE_CHANGES_AT_ONCE`].
fn gathered(
    changes: impl futures::Stream<Item = NodeHealthChange> + Unpin,
) -> impl futures::Stream<Item = Vec<NodeHealthChange>> {
    stream::unfold(changes.peekable(), |mut changes| async move {
        std::pin::Pin::new(&mut changes).peek().await?;
        let window = tokio::time::sleep(NODE_CHANGES_GATHERED_FOR);
        let batch: Vec<_> = std::pin::Pin::new(&mut changes)
            .take_until(window)
            .take(NODE_CHANGES_AT_ONCE)
            .collect()
            .await;
        Some((batch, changes))
    })
}

/// How often every cached node is looked at for a loss to come that no change announced (nodes
/// unhealthy already when a term starts, or changed while a watch was cut, or that joined
/// unhealthy: the trigger asks for every PersistentPodState then, not for a node).
const LOSSES_SCANNED_EVERY: Duration = Duration::from_secs(30);

/// The node health changes of `changes`, and each again just after its node counts as lost
/// (`lost_at`, judged when the change comes: `None` for a node healthy, lost already or not
/// cached): no event comes then, and what a loss changes (a zone's last usable node lost, what
/// the states concerned report) would otherwise wait for each PersistentPodState's resync. One
/// timer per node, the latest change's; `unhealthy` (the nodes unhealthy and not lost yet, as
/// changes, with how long until each is lost) gives a timer to those without one at the start
/// and every [`LOSSES_SCANNED_EVERY`].
fn with_losses(
    changes: impl futures::Stream<Item = NodeHealthChange> + Unpin,
    lost_at: impl Fn(&str) -> Option<Duration>,
    unhealthy: impl Fn() -> Vec<(NodeHealthChange, Duration)>,
) -> impl futures::Stream<Item = NodeHealthChange> {
    use tokio::time::Instant as TokioInstant;
    /// The changes to deliver again, by when, and when each node's is due (one per node).
    #[derive(Default)]
    struct Due {
        by_time: BTreeMap<(TokioInstant, String), NodeHealthChange>,
        by_node: HashMap<String, TokioInstant>,
    }
    impl Due {
        fn arm(&mut self, change: NodeHealthChange, after: Option<Duration>) {
            if let Some(at) = self.by_node.remove(&change.name) {
                self.by_time.remove(&(at, change.name.clone()));
            }
            if let Some(after) = after {
                let at = TokioInstant::now() + after;
                self.by_node.insert(change.name.clone(), at);
                self.by_time.insert((at, change.name.clone()), change);
            }
        }
    }
    let mut scan = tokio::time::interval(LOSSES_SCANNED_EVERY);
    scan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    stream::unfold(
        (changes, Due::default(), scan, (lost_at, unhealthy)),
        |(mut changes, mut due, mut scan, judge)| async move {
            loop {
                let next_due = due.by_time.keys().next().map(|(at, _)| *at);
                let timer = async {
                    match next_due {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                let change = tokio::select! {
                    change = changes.next() => {
                        let change = change?;
                        // What the timer delivers is the node's loss, whatever armed it.
                        let loss = NodeHealthChange { taints_only: false, ..change.clone() };
                        due.arm(loss, (judge.0)(&change.name));
                        change
                    }
                    () = timer => {
                        let ((_, name), change) = due.by_time.pop_first()?;
                        due.by_node.remove(&name);
                        change
                    }
                    _ = scan.tick() => {
                        for (change, after) in (judge.1)() {
                            if !due.by_node.contains_key(&change.name) {
                                due.arm(change, Some(after));
                            }
                        }
                        continue;
                    }
                };
                return Some((change, (changes, due, scan, judge)));
            }
        },
    )
}

/// How often pods pinned by a PersistentPodState that is gone are looked for (a pass over every
/// cached pod; under a millisecond at 100,000).
const ORPHANED_PINS_EVERY: Duration = Duration::from_secs(10);

/// Until `shutdown`, releases every [`ORPHANED_PINS_EVERY`] the pods pinned by
/// PersistentPodStates that are gone, once their pins are unusable
/// ([`reconcile::release_orphaned_pins`]), and forgets what was reported of them
/// ([`Context::forget_gone_reports`]): no reconcile of theirs does.
async fn sweep_orphaned_pins(ctx: Arc<Context>, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(ORPHANED_PINS_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            () = shutdown.cancelled() => return,
        }
        ctx.forget_gone_reports();
        if let Err(e) = reconcile::release_orphaned_pins(&ctx).await {
            tracing::warn!(error = %e, "releasing pods pinned by PersistentPodStates that are gone failed; tried again at the next look");
        }
    }
}

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
    run_controllers(&ctx, shutdown).await;
    ctx.term_ended();
}

/// [`run`], but for what ends with it.
async fn run_controllers(ctx: &Arc<Context>, shutdown: CancellationToken) {
    let caches = ctx.caches.clone();
    let pps_requests = caches.triggers.subscribe_pps();
    let from_nodes = {
        let ctx = ctx.clone();
        let from_nodes = caches.triggers.subscribe_nodes();
        let lost_after = ctx.node_lost_after;
        let (nodes, every_node) = (caches.clone(), caches.clone());
        let lost_at = move |name: &str| {
            let node = nodes.node(name)?;
            Health::now(lost_after).until_lost(&node)
        };
        let unhealthy = move || {
            let health = Health::now(lost_after);
            every_node
                .nodes
                .state()
                .iter()
                .filter_map(|node| {
                    let after = health.until_lost(node)?;
                    let change = NodeHealthChange {
                        name: node.metadata.name.clone()?,
                        labels: node.metadata.labels.clone().unwrap_or_default(),
                        taints_only: false,
                    };
                    Some((change, after))
                })
                .collect()
        };
        let from_nodes = Box::pin(with_losses(from_nodes, lost_at, unhealthy));
        gathered(from_nodes).flat_map(move |changes| stream::iter(ctx.concerned_by(&changes)))
    };
    let pps = Controller::for_stream(
        stream::empty::<Result<PersistentPodState, watcher::Error>>(),
        caches.pps.clone(),
    )
    .with_config(controller::Config::default().concurrency(CONCURRENCY))
    .reconcile_on(stream::select(pps_requests, from_nodes))
    .graceful_shutdown_on(shutdown.clone().cancelled_owned())
    .run(reconcile_pps, pps_error_policy, ctx.clone())
    .for_each(|_| async {})
    .map(|()| None)
    .boxed();

    // Each run ends with the token that was meant to stop it (`None`: the PersistentPodState
    // controller and the sweep of orphaned pins, stopped by `shutdown`).
    let runs = FuturesUnordered::new();
    runs.push(pps);
    runs.push(
        sweep_orphaned_pins(ctx.clone(), shutdown.clone())
            .map(|()| None)
            .boxed(),
    );
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

#[cfg(test)]
mod tests;
