//! Pods the webhook pinned to values whose nodes no longer admit them: a NoSchedule or
//! NoExecute taint they do not tolerate, or a relabel against their own node selector or
//! affinity, came to every usable node with those values after the pod was admitted (at
//! admission the webhook would have left the values out). Such a pod waits only because of the
//! pin; once it has waited so for `--node-lost-after` (a pressure taint that comes and goes
//! holds no pod back), it is released as a pod pinned to a lost node is, and the webhook injects
//! what is still usable when it is created again. A pod is read live when a usable node with
//! its values carries such a taint, or once it has waited pinned for `--node-lost-after` (what
//! else holds it, a relabel, can only be judged from the pod itself); what it demands of a node
//! is then judged again at each look, on the nodes as they are, from that read, and it is read
//! again only right before its release (or, held by a scheduling gate when read, once it
//! changed, at most once a minute).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Affinity, Node, Pod, PodSpec};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tokio::time::Instant;

use super::delete::{Deleted, delete_waiting_pod, go_on};
use super::record::{self, Stranded};
use super::{Context, Error, report};
use crate::api::{PersistentPodState, encode_required};
use crate::placement::{self, DropReason, Dropped, HOSTNAME_LABEL, Health, Nodes, PodDemands};
use crate::release::{self, Forgot, LocalClaim, NodeKeys};
use crate::state::trim::CachedPod;
use crate::workload::WorkloadInfo;

/// When waiting pods whose pin was judged must be read again if their read failed.
const UNREAD_RETRY: Duration = Duration::from_secs(30);

/// At most how many pinned waiting pods one look reads live (the others are read at the next
/// look, in a moment).
const READS_PER_LOOK: usize = 16;

/// How soon a look that left pods unread looks again.
const MORE_TO_READ: Duration = Duration::from_secs(5);

/// How long the judgement of a pod no look has seen (its PersistentPodState gone, or it no
/// longer waits pinned) is kept.
const FORGOTTEN_AFTER: Duration = Duration::from_secs(600);

/// What was judged of a pinned waiting pod, by PersistentPodState and pod uid.
pub(super) type Judged =
    std::collections::HashMap<(ObjectRef<PersistentPodState>, String), Judgement>;

/// How often at most a pinned waiting pod held back by a scheduling gate when read is read
/// again while it keeps changing (its gate may be gone).
const REREAD_EVERY: Duration = Duration::from_secs(60);

/// What was judged of one pinned waiting pod.
#[derive(Clone, Debug)]
pub(super) struct Judgement {
    /// Since when a look has seen it waiting pinned.
    waiting_since: Instant,
    /// Since when its pin alone has held it (`None`: it does not, or it was not read).
    held_since: Option<Instant>,
    /// The pod as last read live, if it was.
    read: Option<Read>,
    /// Not read again before then (its last read failed, or found it no longer waiting while
    /// the cache still had it so).
    retry_at: Option<Instant>,
    /// When a look last saw it.
    seen: Instant,
}

/// A pinned waiting pod as read live: what it demands of a node (its own nodeSelector,
/// affinity, tolerations and scheduling gates, which change only by a gate removed or a
/// toleration added), judged again on the nodes as they are at each look without another read.
#[derive(Clone, Debug)]
struct Read {
    pod: Arc<Pod>,
    /// Its own claims bound to node-local volumes, read with it (they hold it to their node).
    claims: Arc<[LocalClaim]>,
    /// Its resourceVersion (hashed).
    stamp: u64,
    at: Instant,
}

impl Read {
    /// What `pod` demands of a node, kept (not the rest of the pod), with its node-local
    /// `claims`.
    fn of(pod: &Pod, claims: Vec<LocalClaim>, at: Instant) -> Self {
        let spec = pod.spec.as_ref();
        let demands = Pod {
            spec: Some(PodSpec {
                node_selector: spec.and_then(|s| s.node_selector.clone()),
                affinity: spec
                    .and_then(|s| s.affinity.as_ref())
                    .and_then(|a| a.node_affinity.clone())
                    .map(|node_affinity| Affinity {
                        node_affinity: Some(node_affinity),
                        ..Affinity::default()
                    }),
                tolerations: spec.and_then(|s| s.tolerations.clone()),
                scheduling_gates: spec.and_then(|s| s.scheduling_gates.clone()),
                ..PodSpec::default()
            }),
            ..Pod::default()
        };
        Self {
            stamp: stamp(pod.resource_version().as_deref()),
            pod: Arc::new(demands),
            claims: claims.into(),
            at,
        }
    }

    /// Whether it still tells what the pod cached at `stamp` demands: the same version, or no
    /// gate then (a toleration added since is found by the read before a release), or a gated
    /// one read within [`REREAD_EVERY`].
    fn current(&self, stamp: u64, now: Instant) -> bool {
        self.stamp == stamp || !gated(&self.pod) || self.at + REREAD_EVERY > now
    }
}

/// Whether a scheduling gate holds `pod`.
fn gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| !g.is_empty())
}

/// Whether `pod` (read live, waiting), pinned by the webhook to `values`, is held by that pin
/// alone: no usable node with the values meets the pod's own demands (its nodeSelector without
/// the values added, its required node affinity, its tolerations), while some usable node that
/// is not cordoned meets them, and no scheduling gate holds it. The values left out then, as
/// the webhook would leave them out.
pub fn held_by_pin(
    pod: &Pod,
    values: &BTreeMap<String, String>,
    nodes: &dyn Nodes,
    every_node: &[std::sync::Arc<Node>],
    health: &Health,
) -> Option<Dropped> {
    if gated(pod) {
        return None;
    }
    // The pod as it was created: without the values the webhook added to its nodeSelector.
    let mut own = pod.clone();
    if let Some(selector) = own.spec.as_mut().and_then(|s| s.node_selector.as_mut()) {
        selector.retain(|k, v| values.get(k) != Some(v));
    }
    let demands = PodDemands::of(&own);
    let dropped = placement::required_owned(values, &demands, nodes, health).dropped?;
    if dropped.reason != DropReason::PodConstraints {
        // Gone or lost: the stranded pods' release judges those.
        return None;
    }
    // Judged whole: a judgement the webhook's budget cut short (left out there, to answer in
    // time) holds no release.
    let (weight, mut work) = (demands.weight(), 0usize);
    let admitted = nodes.visit_with_labels(&placement::borrowed(values), &mut |n| {
        work = work.saturating_add(weight);
        work > placement::JUDGING_WORK || (!health.is_lost(n) && demands.admit(n))
    });
    if admitted {
        return None;
    }
    every_node
        .iter()
        .any(|n| !health.is_lost(n) && !placement::cordoned(n) && demands.admit(n))
        .then_some(dropped)
}

/// What holds a pinned waiting pod, read as `pod` with its node-local `claims`, that a
/// release would free: its pin alone ([`held_by_pin`]), or its own claims, all bound to volumes
/// of one usable node that lacks some of the values: the pin and its volumes exclude each
/// other, it can never be scheduled, and once its state names neither its node nor the wider
/// values (a zone) that node lacks, the pod created again goes there. Held to a node with the
/// values (its room), by claims on several nodes or on a node that is gone or lost, nothing a
/// release does frees it: not held. Neither is a pod whose claims' node is one its values
/// name (by any key), lacking another value: no node has them all, the stranded pods' release
/// judges it. The values left out, and a claim on that other node if that is what holds it.
pub fn held(
    pod: &Pod,
    claims: &[LocalClaim],
    (values, keys): (&BTreeMap<String, String>, &NodeKeys),
    nodes: &dyn Nodes,
    every_node: &[Arc<Node>],
    health: &Health,
) -> Option<(Dropped, Option<LocalClaim>)> {
    let Some(first) = claims.first() else {
        return held_by_pin(pod, values, nodes, every_node, health).map(|d| (d, None));
    };
    if gated(pod) || claims.iter().any(|c| c.node != first.node) {
        return None;
    }
    let node = every_node
        .iter()
        .find(|n| n.name_any() == first.node)
        .filter(|n| !health.is_lost(n))?;
    let has = |(k, v): &(&String, &String)| node.labels().get(*k) == Some(*v);
    let naming: Vec<_> = values
        .iter()
        .filter(|(k, _)| keys.names_a_node(k))
        .collect();
    if values.iter().all(|kv| has(&kv)) || naming.iter().any(has) {
        return None;
    }
    // What the pod created again is pinned to no more: the node, and what that node lacks.
    let left_out = values
        .iter()
        .filter(|kv| keys.names_a_node(kv.0) || !has(kv))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let dropped = Dropped {
        values: left_out,
        reason: DropReason::PodConstraints,
    };
    Some((dropped, Some(first.clone())))
}

/// Whether a usable node with `values` carries a taint pods must tolerate: a pod pinned there
/// is read at once (any other only once it has waited for the grace: the usual pinned pod,
/// waiting for its node's room, is not read).
fn tainted_carrier(values: &BTreeMap<String, String>, nodes: &dyn Nodes, health: &Health) -> bool {
    let labels: BTreeMap<&str, &str> = values
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    nodes.visit_with_labels(&labels, &mut |n| {
        !health.is_lost(n) && placement::scheduling_taints(n).next().is_some()
    })
}

/// Releases the pods of `pods` that the PersistentPodState `pps` pinned and that its pin alone
/// holds ([`held_by_pin`], read live) for `--node-lost-after` or longer, each by uid and
/// resourceVersion within the release rate, with a `PodReleased` Event; `skip`: pods released
/// otherwise in this look. A pod is read live only when a usable node with its values carries
/// a taint or once it has waited pinned for `--node-lost-after`, then judged from that read
/// ([`Read::current`]) and read again right before its release, within the rate; at most
/// [`READS_PER_LOOK`] first reads a look. When to look again: the end of a wait, the rate,
/// reads left.
pub(super) async fn release_held_by_pin(
    ctx: &Context,
    pps: &PersistentPodState,
    namespace: &str,
    pods: &[&CachedPod],
    health: &Health,
    (skip, workload): (&BTreeSet<String>, Option<&WorkloadInfo>),
) -> Result<Option<Duration>, Error> {
    let name = pps.name_any();
    let key = ObjectRef::from_obj(pps);
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let (mut seen, mut next, mut reads) = (BTreeSet::new(), None::<Duration>, 0usize);
    // A pod's delete failing holds back none of the others: the first failure is returned
    // once each was looked at.
    let mut failed = None;
    let mut sooner = |d: Duration| next = Some(next.map_or(d, |n| n.min(d)));
    // Once the rate is spent, the others are still judged (their waits are kept).
    let mut rate_spent = false;
    let every_node = ctx.caches.nodes.state();
    for pod in pods.iter().filter(|p| !skip.contains(&*p.name)) {
        let Some(values) = record::pinned(&name, pod) else {
            continue;
        };
        let Some(uid) = pod.uid() else {
            continue;
        };
        seen.insert(uid.clone());
        let id = (key.clone(), uid.clone());
        let known = crate::sync::lock(&ctx.judged).get(&id).cloned();
        let now = Instant::now();
        let grace_over = |since: Instant| since + ctx.node_lost_after <= now;
        let waiting_since = known.as_ref().map_or(now, |j| j.waiting_since);
        // Not held (or not read) yet: what was read stays, its judgement starts again.
        let unheld = Judgement {
            waiting_since,
            held_since: None,
            read: known.as_ref().and_then(|j| j.read.clone()),
            retry_at: known.as_ref().and_then(|j| j.retry_at),
            seen: now,
        };
        if !grace_over(waiting_since) && !tainted_carrier(&values, ctx.caches.as_ref(), health) {
            // Waiting as pinned pods do, for their node's room (a taint gone within the grace
            // with it): looked at again once it has waited for the grace.
            remember(ctx, &id, unheld);
            sooner(waiting_since + ctx.node_lost_after - now + Duration::from_secs(1));
            continue;
        }
        let cached = stamp(pod.resource_version().as_deref());
        let last = known.as_ref().and_then(|j| j.read.clone());
        if let Some(read) = last.as_ref().filter(|r| r.stamp != cached && gated(&r.pod)) {
            // Its gate may be gone: read again once that is allowed.
            sooner(read.at + REREAD_EVERY - now + Duration::from_secs(1));
        }
        let retry_at = known.as_ref().and_then(|j| j.retry_at);
        // The pod's resourceVersion as read now, if it is.
        let (read, read_now) = match last.filter(|r| r.current(cached, now)) {
            Some(read) => (read, None),
            // Not read again yet, or no reads left in this look: what was judged stays.
            None if retry_at.is_some_and(|at| at > now) || reads == READS_PER_LOOK => {
                let retry_in = retry_at.filter(|at| *at > now).map(|at| at - now);
                sooner(retry_in.unwrap_or(MORE_TO_READ));
                remember(
                    ctx,
                    &id,
                    Judgement {
                        seen: now,
                        ..known.unwrap_or(unheld)
                    },
                );
                continue;
            }
            None => {
                reads += 1;
                let wait = match read_waiting(ctx, &api, (namespace, &pod.name, &uid), workload)
                    .await
                {
                    Ok(Some(live)) => Ok(live),
                    // The cache is behind: it is looked at again from a fresher one.
                    Ok(None) => Err(MORE_TO_READ),
                    Err(e) => {
                        tracing::warn!(pod = %pod.name, error = %e, "a pinned waiting pod could not be read");
                        Err(UNREAD_RETRY)
                    }
                };
                match wait {
                    Ok((live, claims)) => {
                        let rv = live.resource_version();
                        (Read::of(&live, claims, now), Some(rv))
                    }
                    Err(wait) => {
                        sooner(wait);
                        let retry_at = Some(now + wait);
                        let j = known.unwrap_or(unheld);
                        remember(
                            ctx,
                            &id,
                            Judgement {
                                retry_at,
                                seen: now,
                                ..j
                            },
                        );
                        continue;
                    }
                }
            }
        };
        let judge = |pod: &Pod, claims: &[LocalClaim]| {
            let pinned = (&values, &ctx.node_keys);
            held(
                pod,
                claims,
                pinned,
                ctx.caches.as_ref(),
                &every_node,
                health,
            )
        };
        let dropped = judge(&read.pod, &read.claims);
        let held_since = dropped
            .as_ref()
            .map(|_| known.as_ref().and_then(|j| j.held_since).unwrap_or(now));
        remember(
            ctx,
            &id,
            Judgement {
                waiting_since,
                held_since,
                read: Some(read.clone()),
                retry_at: None,
                seen: now,
            },
        );
        let (Some(dropped), Some(since)) = (dropped, held_since) else {
            continue;
        };
        if !grace_over(since) {
            sooner(since + ctx.node_lost_after - now + Duration::from_secs(1));
            continue;
        }
        if rate_spent {
            continue;
        }
        if let Err(later) = ctx.releases.take(&key) {
            tracing::info!(pod = %pod.name, ?later, "release rate reached; the pod waits for the next");
            sooner(later);
            rate_spent = true;
            continue;
        }
        // What cannot be undone is judged on the pod and its claims as they are now.
        let (rv, (dropped, elsewhere), claims) = if let Some(rv) = read_now {
            (rv, dropped, read.claims.clone())
        } else {
            let live = match read_waiting(ctx, &api, (namespace, &pod.name, &uid), workload).await {
                Ok(live) => live,
                Err(e) => {
                    tracing::warn!(pod = %pod.name, error = %e, "a pinned waiting pod could not be read");
                    sooner(UNREAD_RETRY);
                    None
                }
            };
            let judged = live.map(|(live, claims)| {
                let rv = live.resource_version();
                let read = Read::of(&live, claims, now);
                let dropped = judge(&read.pod, &read.claims);
                remember(
                    ctx,
                    &id,
                    Judgement {
                        waiting_since,
                        held_since: dropped.as_ref().map(|_| since),
                        read: Some(read.clone()),
                        retry_at: None,
                        seen: now,
                    },
                );
                (rv, dropped, read.claims)
            });
            match judged {
                Some((rv, Some(dropped), claims)) => (rv, dropped, claims),
                _ => {
                    ctx.releases.give_back(&key);
                    continue;
                }
            }
        };
        // Held by a claim of its own elsewhere: its state must name the node it was pinned to
        // (and the values that node lacks) no more first, or it would be pinned there again;
        // released at a later look, once this replica's cache holds the state so (the webhooks
        // admit the pod created again from theirs).
        if let Some(claim) = &elsewhere {
            let wait = match forget_pinned_node(ctx, pps, namespace, &pod.name, claim).await {
                Ok(Forgot::Stale | Forgot::Done(_)) => Some(MORE_TO_READ),
                Ok(Forgot::Nothing) => None,
                Err(Error::Fenced(e)) => return Err(Error::Fenced(e)),
                Err(e) => {
                    tracing::warn!(pod = %pod.name, error = %e, "the state of a pod whose claim is bound elsewhere could not be made to name no node; not released yet");
                    Some(UNREAD_RETRY)
                }
            };
            if let Some(wait) = wait {
                ctx.releases.give_back(&key);
                sooner(wait);
                continue;
            }
        }
        let target = (namespace, &*pod.name);
        let still = |live: &Pod| judge(live, &claims).is_some();
        let deleted =
            delete_waiting_pod(&api, &ctx.fence, target, (&uid, rv.clone()), &still).await;
        let deleted = go_on(deleted, &mut failed)?;
        if deleted != Some(Deleted::Now) {
            // Nothing released by this call: the token goes back.
            ctx.releases.give_back(&key);
        } else {
            let node = values
                .get(HOSTNAME_LABEL)
                .cloned()
                .unwrap_or_else(|| encode_required(&values));
            let stranded = Stranded {
                pod: pod.name.to_string(),
                uid,
                resource_version: rv,
                node,
                dropped,
            };
            report::released(
                ctx,
                report::PinnedBy::Live(pps),
                &stranded,
                elsewhere.as_ref(),
            );
        }
    }
    let now = Instant::now();
    crate::sync::lock(&ctx.judged).retain(|(k, uid), j| {
        if *k == key {
            seen.contains(uid)
        } else {
            now.duration_since(j.seen) < FORGOTTEN_AFTER
        }
    });
    failed.map_or(Ok(next), Err)
}

/// Pod `name` read live, while it is the pod `uid`, waits unscheduled and is not being deleted,
/// with its own claims bound to node-local volumes (named after `workload`'s templates).
async fn read_waiting(
    ctx: &Context,
    api: &Api<Pod>,
    (namespace, name, uid): (&str, &str, &str),
    workload: Option<&WorkloadInfo>,
) -> Result<Option<(Pod, Vec<LocalClaim>)>, kube::Error> {
    let Some(live) = api.get_opt(name).await?.filter(|live| {
        let scheduled = live
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .is_some_and(|n| !n.is_empty());
        live.uid().as_deref() == Some(uid)
            && live.metadata.deletion_timestamp.is_none()
            && !scheduled
    }) else {
        return Ok(None);
    };
    let claims = match workload.filter(|w| !w.claim_templates.is_empty()) {
        Some(w) => ctx
            .own_claims(namespace, (name, uid), w)
            .await?
            .into_iter()
            .filter_map(Result::ok)
            .collect(),
        None => Vec::new(),
    };
    Ok(Some((live, claims)))
}

/// Makes pod `pod`'s state in `pps` name no node, nor the wider values the node `claim` (a claim
/// of its own that its pin keeps it from) is on lacks, unless that node is the one it names
/// ([`release::forget_node`]), with a `NodeForgotten` Event when done. `Nothing` when the state
/// (as cached) has nothing left that keeps a pod created again from that node, or when nothing
/// of ours pins it (no state, or the PersistentPodState observed only).
async fn forget_pinned_node(
    ctx: &Context,
    pps: &PersistentPodState,
    namespace: &str,
    pod: &str,
    claim: &LocalClaim,
) -> Result<Forgot, Error> {
    // Observed only: the states are another injector's to act on.
    if crate::api::observed_only(pps, ctx.observe_all) {
        return Ok(Forgot::Nothing);
    }
    let Some(state) = pps.status.as_ref().and_then(|s| s.pod_states.get(pod)) else {
        return Ok(Forgot::Nothing);
    };
    // Judged on that node as held judged it; gone since, the next look judges again.
    let Some(node) = ctx.caches.node(&claim.node) else {
        return Ok(Forgot::Stale);
    };
    let data = release::DataNode {
        name: &claim.node,
        labels: node.labels(),
    };
    ctx.fence.before_write(namespace).await?;
    let api: Api<PersistentPodState> = Api::namespaced(ctx.client.clone(), namespace);
    let keys = (&ctx.node_keys, Some(data));
    let target = (pod, None);
    let forgot = release::forget_node(&api, &pps.name_any(), target, Some(state), keys).await?;
    if let Forgot::Done(forgotten) = &forgot {
        report::node_forgotten(ctx, pps, pod, claim, forgotten);
    }
    Ok(forgot)
}

/// Forgets what was judged of the pods of `pps` (none of them is released on its word now).
pub(super) fn forget(ctx: &Context, pps: &PersistentPodState) {
    let key = ObjectRef::from_obj(pps);
    crate::sync::lock(&ctx.judged).retain(|(k, _), _| *k != key);
}

fn remember(ctx: &Context, id: &(ObjectRef<PersistentPodState>, String), judgement: Judgement) {
    crate::sync::lock(&ctx.judged).insert(id.clone(), judgement);
}

/// A resourceVersion, hashed (it is only compared).
fn stamp(resource_version: Option<&str>) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
        .hash_one(resource_version)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Caches;
    use kube::runtime::watcher;
    use serde_json::{Value, json};

    fn node(name: &str, taints: Value, cordoned: bool) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name,
            "labels": {"kubernetes.io/hostname": name, "disk": "ssd"}},
            "spec": {"taints": taints, "unschedulable": cordoned}}))
        .expect("node")
    }

    fn maintenance() -> Value {
        json!([{"key": "example.com/maintenance", "effect": "NoSchedule"}])
    }

    /// A pod the webhook pinned to n1, with `spec` of its own merged in.
    fn pod(spec: Value) -> Pod {
        let mut pod = json!({"metadata": {"name": "web-0"},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": "n1"}, "containers": []}});
        json_patch::merge(&mut pod, &json!({"spec": spec}));
        serde_json::from_value(pod).expect("pod")
    }

    fn judge(nodes: Vec<Node>, pod: &Pod) -> Option<DropReason> {
        let caches = Caches::new();
        for n in nodes {
            caches.apply_node(watcher::Event::Apply(n));
        }
        let values = [("kubernetes.io/hostname".to_owned(), "n1".to_owned())].into();
        let health = Health::now(Duration::from_secs(300));
        held_by_pin(
            pod,
            &values,
            caches.as_ref(),
            &caches.nodes.state(),
            &health,
        )
        .map(|d| d.reason)
    }

    #[test]
    fn a_pod_is_held_by_its_pin_alone_when_its_node_took_a_taint_it_does_not_tolerate() {
        let fine = || node("n2", json!([]), false);
        assert_eq!(
            judge(
                vec![node("n1", maintenance(), false), fine()],
                &pod(json!({}))
            ),
            Some(DropReason::PodConstraints)
        );
        // Tolerated: it waits for its node's room, not because of the pin.
        let tolerating = pod(json!({"tolerations": [{"key": "example.com/maintenance",
            "operator": "Exists", "effect": "NoSchedule"}]}));
        assert_eq!(
            judge(vec![node("n1", maintenance(), false), fine()], &tolerating),
            None
        );
        // Untainted, or only cordoned (maintenance it waits for), or a PreferNoSchedule taint.
        assert_eq!(
            judge(vec![node("n1", json!([]), false), fine()], &pod(json!({}))),
            None
        );
        assert_eq!(
            judge(vec![node("n1", json!([]), true), fine()], &pod(json!({}))),
            None
        );
        let prefer = json!([{"key": "example.com/busy", "effect": "PreferNoSchedule"}]);
        assert_eq!(
            judge(vec![node("n1", prefer, false), fine()], &pod(json!({}))),
            None
        );
        // No other node would take it either: not the pin that holds it.
        assert_eq!(
            judge(
                vec![
                    node("n1", maintenance(), false),
                    node("n2", maintenance(), false)
                ],
                &pod(json!({}))
            ),
            None
        );
        assert_eq!(
            judge(
                vec![
                    node("n1", maintenance(), false),
                    node("n2", json!([]), true)
                ],
                &pod(json!({}))
            ),
            None,
            "the only other node is cordoned"
        );
        // The pod's own selector, without the value the webhook added, is still its own.
        let own = pod(json!({"nodeSelector": {"kubernetes.io/hostname": "n1", "disk": "hdd"}}));
        assert_eq!(
            judge(vec![node("n1", maintenance(), false), fine()], &own),
            None
        );
        // A scheduling gate holds it, whatever the pin.
        let gated = pod(json!({"schedulingGates": [{"name": "example.com/queue"}]}));
        assert_eq!(
            judge(vec![node("n1", maintenance(), false), fine()], &gated),
            None
        );
        // Lost or gone: the stranded pods' release judges those.
        let lost = json!([{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}]);
        assert_eq!(
            judge(vec![node("n1", lost, false), fine()], &pod(json!({}))),
            None
        );
        assert_eq!(judge(vec![fine()], &pod(json!({}))), None);
    }

    #[test]
    fn a_claim_of_its_own_holds_a_pod_where_it_is_bound() {
        let claim = LocalClaim::fixture;
        let lost = json!([{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}]);
        let caches = Caches::new();
        for n in [
            node("n1", maintenance(), false),
            node("n2", json!([]), false),
            node("n3", lost, false),
        ] {
            caches.apply_node(watcher::Event::Apply(n));
        }
        let values = [("kubernetes.io/hostname".to_owned(), "n1".to_owned())].into();
        let health = Health::now(Duration::from_secs(300));
        let every_node = caches.nodes.state();
        let keys = NodeKeys::default();
        let held_with = |values: &BTreeMap<String, String>, pod: &Pod, claims: &[LocalClaim]| {
            held(
                pod,
                claims,
                (values, &keys),
                caches.as_ref(),
                &every_node,
                &health,
            )
        };
        let judge_with = |values: &BTreeMap<String, String>, pod: &Pod, claims: &[LocalClaim]| {
            held_with(values, pod, claims)
                .map(|(d, elsewhere)| (d.reason, elsewhere.map(|c| c.node)))
        };
        let judge = |pod: &Pod, claims: &[LocalClaim]| judge_with(&values, pod, claims);
        // No node-local claim: the pin alone (n1 tainted, n2 would take it).
        assert_eq!(
            judge(&pod(json!({})), &[]),
            Some((DropReason::PodConstraints, None))
        );
        // Its volume on n1 holds it there too: releasing it would free nothing.
        assert_eq!(judge(&pod(json!({})), &[claim("n1")]), None);
        // On n2, away from its pin: neither node takes it, ever.
        assert_eq!(
            judge(&pod(json!({})), &[claim("n2")]),
            Some((DropReason::PodConstraints, Some("n2".into())))
        );
        // On a lost node: the local-volume release's, not this one's.
        assert_eq!(judge(&pod(json!({})), &[claim("n3")]), None);
        let gated = pod(json!({"schedulingGates": [{"name": "example.com/queue"}]}));
        assert_eq!(judge(&gated, &[claim("n2")]), None);
        // Claims on two nodes: released, it could go to neither.
        assert_eq!(judge(&pod(json!({})), &[claim("n2"), claim("n1")]), None);
        // Pinned to a rack as well, which n2 lacks: the rack is left out with the node (the
        // pod created again would be pinned away from its volume by the rack alone).
        let mut racked = values.clone();
        racked.insert("example.com/rack".into(), "r1".into());
        let rack = |pod: &Pod, claims: &[LocalClaim]| {
            held_with(&racked, pod, claims)
                .map(|(d, elsewhere)| (d.values, elsewhere.map(|c| c.node)))
        };
        assert_eq!(
            rack(&pod(json!({})), &[claim("n2")]),
            Some((racked.clone(), Some("n2".into())))
        );
        // Pinned to a rack alone (no node): on n2, which lacks it, the rack is left out.
        let rack_alone: BTreeMap<String, String> =
            [("example.com/rack".to_owned(), "r1".to_owned())].into();
        assert_eq!(
            judge_with(&rack_alone, &pod(json!({})), &[claim("n2")]),
            Some((DropReason::PodConstraints, Some("n2".into())))
        );
        // A wider value n2 has as well (its disk): only the node is left out, the disk kept.
        let mut disk = values.clone();
        disk.insert("disk".into(), "ssd".into());
        let left_out = held_with(&disk, &pod(json!({})), &[claim("n2")]).map(|(d, _)| d.values);
        assert_eq!(left_out, Some(values.clone()));
        // Its claims on the node its values name, lacking a wider one: no node has them all,
        // the stranded pods' release judges it, not this one.
        assert_eq!(rack(&pod(json!({})), &[claim("n1")]), None);
        // On n1 by its hostname, lacking a driver's node value its state records (relabeled):
        // no node has them all, the stranded pods' release judges it, not this one.
        let mut driver = values.clone();
        driver.insert("topology.topolvm.io/node".into(), "n1".into());
        assert_eq!(judge_with(&driver, &pod(json!({})), &[claim("n1")]), None);
        // On n1, which has them all: waiting for its room.
        assert_eq!(
            judge_with(&disk, &pod(json!({})), &[claim("n1")]),
            None,
            "n1 has them all: its room"
        );
    }
}
