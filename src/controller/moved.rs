//! Pods whose node-local data lives on another node than their state names: their claims were
//! released (by the controller, by `release`, or by an operator's hand) and bound again on the
//! node they were scheduled to next, where they are not Ready yet. Pinned back to the recorded
//! node when created again (that node back by then), such a pod would wait there for ever, away
//! from its claim: its state is made to name no node ([`release::forget_node`]), and it is
//! recorded where it is once Ready. This is judged from what the cluster holds (the pod's node,
//! its claims' volumes), never from a memory of the release, so a release followed by a leader
//! change or a crash is covered as well.

use std::time::Duration;

use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tokio::time::Instant;

use super::record::Target;
use super::{Context, Error, report};
use crate::api::{PersistentPodState, PersistentPodStateStatus};
use crate::placement::HOSTNAME_LABEL;
use crate::release::{self, Forgot, LocalClaim};
use crate::state::trim::CachedPod;

/// At most how many pods one look reads the claims of (the others are read at the next look).
const READS_PER_LOOK: usize = 16;

/// How soon a look that left pods unread, or whose patch met another state, looks again.
const SOON: Duration = Duration::from_secs(2);

/// How soon a pod whose claims could not be read, or are not all bound, is read again.
const UNREAD_RETRY: Duration = Duration::from_secs(30);

/// What was judged of a pod scheduled elsewhere than recorded whose data did not show as moved:
/// the recorded node judged against, and until when (`None`: while the pod and its state stay;
/// a read that failed or found a claim missing or unbound is tried again after a while).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct InPlace {
    recorded: String,
    until: Option<Instant>,
}

/// A pod scheduled, and not Ready, on another node than its state names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Elsewhere {
    /// Its name.
    pub(super) pod: String,
    /// Its uid.
    pub(super) uid: String,
    /// The node its state names.
    pub(super) recorded: String,
    /// That node's recorded `kubernetes.io/hostname`, when recorded.
    pub(super) hostname: Option<String>,
}

/// The pods of `pods` scheduled to another node than `status` records for them and not Ready (a
/// Ready one is recorded where it is). Being deleted or finished counts too: its claims still
/// show where its data is, for the pod created next.
pub(super) fn elsewhere(pods: &[&CachedPod], status: &PersistentPodStateStatus) -> Vec<Elsewhere> {
    pods.iter()
        .filter(|p| !p.ready)
        .filter_map(|p| {
            let on = p.node_name.as_deref().filter(|n| !n.is_empty())?;
            let state = status.pod_states.get(&*p.name)?;
            let recorded = state.node_name.as_deref().filter(|n| !n.is_empty())?;
            (recorded != on).then_some(())?;
            Some(Elsewhere {
                pod: p.name.to_string(),
                uid: p.uid()?,
                recorded: recorded.to_owned(),
                hostname: state
                    .node_topology_labels
                    .get(HOSTNAME_LABEL)
                    .map(|h| h.to_string()),
            })
        })
        .collect()
}

/// The claim of `claims` (the pod's own, on node-local volumes) that shows the pod's data moved:
/// bound to a volume only another node than the recorded one can mount.
pub(super) fn moved<'a>(pod: &Elsewhere, claims: &'a [LocalClaim]) -> Option<&'a LocalClaim> {
    claims
        .iter()
        .find(|c| !release::names_node(&pod.recorded, pod.hostname.as_deref(), &c.node))
}

/// Makes the states of `pps`'s pods whose node-local data moved name no node, reading the
/// claims of each pod scheduled elsewhere than recorded once (again only once its uid or its
/// recorded node changes, or a while after a read that failed or was incomplete). Not for a
/// PersistentPodState observed only (the states are another injector's to act on). When to look
/// again, if some are left.
pub(super) async fn forget_moved(
    ctx: &Context,
    pps: &PersistentPodState,
    namespace: &str,
    pods: &[&CachedPod],
    target: &Target,
) -> Result<Option<Duration>, Error> {
    let Target::Live(info) = target else {
        return Ok(None);
    };
    let Some(status) = pps.status.as_ref() else {
        return Ok(None);
    };
    if info.claim_templates.is_empty() || crate::api::observed_only(pps, ctx.observe_all) {
        return Ok(None);
    }
    let key = ObjectRef::from_obj(pps);
    let found = elsewhere(pods, status);
    let now = Instant::now();
    let mut later: Option<Duration> = None;
    let mut again = |wait: Duration| later = Some(later.map_or(wait, |l| l.min(wait)));
    let unjudged: Vec<Elsewhere> = {
        let (mut judged, _) = ctx.data_in_place.lock(&ctx.caches);
        if found.is_empty() {
            judged.by_pps.remove(&key);
            return Ok(None);
        }
        let in_place = judged.by_pps.entry(key).or_default();
        in_place.retain(|uid, j| {
            found
                .iter()
                .any(|p| &p.uid == uid && p.recorded == j.recorded)
        });
        let mut unjudged = Vec::new();
        for pod in found {
            match in_place.get(&pod.uid).map(|j| j.until) {
                Some(None) => {}
                Some(Some(until)) if until > now => again(until - now),
                _ => unjudged.push(pod),
            }
        }
        unjudged
    };
    if unjudged.len() > READS_PER_LOOK {
        again(SOON);
    }
    let judge = |pod: &Elsewhere, until: Option<Instant>| {
        let (mut judged, _) = ctx.data_in_place.lock(&ctx.caches);
        let recorded = pod.recorded.clone();
        judged
            .by_pps
            .entry(ObjectRef::from_obj(pps))
            .or_default()
            .insert(pod.uid.clone(), InPlace { recorded, until });
    };
    let api: Api<PersistentPodState> = Api::namespaced(ctx.client.clone(), namespace);
    for pod in unjudged.into_iter().take(READS_PER_LOOK) {
        let judged = match ctx.own_claims(namespace, (&pod.pod, &pod.uid), info).await {
            Ok(judged) => judged,
            Err(e) => {
                tracing::warn!(pod = %pod.pod, error = %e, "the claims of a pod scheduled elsewhere than recorded could not be read");
                judge(&pod, Some(now + UNREAD_RETRY));
                again(UNREAD_RETRY);
                continue;
            }
        };
        // Every claim found and bound (a scheduled pod's are): what they show holds while the
        // pod and its state stay.
        let complete = judged.len() == info.claim_templates.len();
        let local: Vec<LocalClaim> = judged.into_iter().filter_map(Result::ok).collect();
        let Some(claim) = moved(&pod, &local) else {
            if complete {
                judge(&pod, None);
            } else {
                judge(&pod, Some(now + UNREAD_RETRY));
                again(UNREAD_RETRY);
            }
            continue;
        };
        ctx.fence.before_write(namespace).await?;
        let state = status.pod_states.get(&pod.pod);
        let target = (pod.pod.as_str(), Some(pod.recorded.as_str()));
        // Its node not in the cache (gone), the wider labels stay: nothing tells what it had.
        let data = ctx.caches.node(&claim.node);
        let on = data.as_ref().map(|n| release::DataNode {
            name: &claim.node,
            labels: n.labels(),
        });
        match release::forget_node(&api, &pps.name_any(), target, state, (&ctx.node_keys, on)).await
        {
            Ok(Forgot::Done(forgotten)) => {
                report::node_forgotten(ctx, pps, &pod.pod, claim, &forgotten);
            }
            Ok(Forgot::Nothing) => {}
            // Recorded meanwhile (the cache is behind): judged again from the next look's.
            Ok(Forgot::Stale) => again(SOON),
            Err(e) => {
                tracing::warn!(pod = %pod.pod, node = %pod.recorded, error = %e, "the state of a pod whose node-local data moved could not be made to name no node yet; tried again in a while");
                judge(&pod, Some(now + UNREAD_RETRY));
                again(UNREAD_RETRY);
            }
        }
    }
    Ok(later)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::trim::CachedPod;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    fn pod(name: &str, node: Option<&str>, ready: bool) -> CachedPod {
        deleting_pod(name, node, ready, None)
    }

    fn deleting_pod(
        name: &str,
        node: Option<&str>,
        ready: bool,
        deleted_at: Option<&str>,
    ) -> CachedPod {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("{name}-uid"),
                "deletionTimestamp": deleted_at},
            "spec": {"containers": [], "nodeName": node},
            "status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": if ready { "True" } else { "False" }}]}
        }))
        .expect("pod");
        CachedPod::from(pod)
    }

    use crate::release::LocalClaim;

    fn claim(node: &str) -> LocalClaim {
        LocalClaim::fixture(node)
    }

    #[test]
    fn only_pods_scheduled_not_ready_elsewhere_than_recorded_are_looked_at() {
        let status: PersistentPodStateStatus = serde_json::from_value(json!({"podStates": {
            "web-0": {"nodeName": "n1", "nodeTopologyLabels": {"kubernetes.io/hostname": "h1"}},
            "web-1": {"nodeName": "n1"},
            "web-2": {"nodeName": "n1"},
            "web-3": {"nodeName": "n1"},
            "web-4": {"nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}},
            "web-6": {"nodeName": "n1"},
        }}))
        .expect("status");
        let pods = [
            pod("web-0", Some("n2"), false),
            // Where its state says.
            pod("web-1", Some("n1"), false),
            // Ready: recorded where it is.
            pod("web-2", Some("n2"), true),
            // Not scheduled.
            pod("web-3", None, false),
            // Its state names no node.
            pod("web-4", Some("n2"), false),
            // No state.
            pod("web-5", Some("n2"), false),
            // Being deleted: its claims still show where its data is, for the pod created next.
            deleting_pod("web-6", Some("n2"), false, Some("2026-12-06T14:00:00Z")),
        ];
        let pods: Vec<&CachedPod> = pods.iter().collect();
        assert!(pods[6].deleting);
        assert_eq!(
            elsewhere(&pods, &status),
            [
                Elsewhere {
                    pod: "web-0".into(),
                    uid: "web-0-uid".into(),
                    recorded: "n1".into(),
                    hostname: Some("h1".into()),
                },
                Elsewhere {
                    pod: "web-6".into(),
                    uid: "web-6-uid".into(),
                    recorded: "n1".into(),
                    hostname: None,
                },
            ]
        );
    }

    #[test]
    fn data_moved_only_when_a_local_claim_is_on_another_node_than_recorded() {
        let pod = Elsewhere {
            pod: "web-0".into(),
            uid: "web-0-uid".into(),
            recorded: "n1".into(),
            hostname: Some("h1".into()),
        };
        assert_eq!(moved(&pod, &[]), None, "no node-local claim");
        assert_eq!(moved(&pod, &[claim("n1")]), None, "on the recorded node");
        assert_eq!(
            moved(&pod, &[claim("h1")]),
            None,
            "on the recorded node, named by its hostname"
        );
        assert_eq!(moved(&pod, &[claim("n1"), claim("n2")]), Some(&claim("n2")));
    }
}
