//! Pods the webhook pinned to values whose nodes no longer admit them: a NoSchedule or
//! NoExecute taint they do not tolerate came to every usable node with those values after the
//! pod was admitted (at admission the webhook would have left the values out). Such a pod waits
//! only because of the pin; once it has waited so for `--node-lost-after` (a pressure taint that
//! comes and goes holds no pod back), it is released as a pod pinned to a lost node is, and the
//! webhook injects what is still usable when it is created again. A pod is read live only when
//! every usable node with its values carries such a taint: a relabel against the pod's own
//! affinity alone is not looked for.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tokio::time::Instant;

use super::delete::{Deleted, delete_waiting_pod};
use super::record::{self, Stranded};
use super::{Context, Error, report};
use crate::api::{PersistentPodState, encode_required};
use crate::placement::{self, DropReason, Dropped, HOSTNAME_LABEL, Health, Nodes, PodDemands};
use crate::state::trim::CachedPod;

/// When waiting pods whose pin was judged must be read again if their read failed.
const UNREAD_RETRY: Duration = Duration::from_secs(30);

/// Since when each pinned pod has been seen held by its own constraints, by PersistentPodState
/// and pod uid.
pub(super) type HeldSince =
    std::collections::HashMap<(ObjectRef<PersistentPodState>, String), Instant>;

/// Whether `pod` (read live, waiting), pinned by the webhook to `values`, is held by that pin
/// alone: no usable node with the values meets the pod's own demands (its nodeSelector without
/// the values added, its required node affinity, its tolerations), while some usable node that
/// is not cordoned meets them. The values left out then, as the webhook would leave them out.
pub fn held_by_pin(
    pod: &Pod,
    values: &BTreeMap<String, String>,
    nodes: &dyn Nodes,
    every_node: &[std::sync::Arc<Node>],
    health: &Health,
) -> Option<Dropped> {
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
    let cordoned = |n: &Node| n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
    every_node
        .iter()
        .any(|n| !health.is_lost(n) && !cordoned(n) && demands.admit(n))
        .then_some(dropped)
}

/// Releases the pods of `pods` that the PersistentPodState `pps` pinned and that its pin alone
/// holds ([`held_by_pin`], read live) for `--node-lost-after` or longer, each by uid and
/// resourceVersion within the release rate, with a `PodReleased` Event; `skip`: pods released
/// otherwise in this look. When to look again: the end of a wait, the rate, a failed read.
pub(super) async fn release_held_by_pin(
    ctx: &Context,
    pps: &PersistentPodState,
    namespace: &str,
    pods: &[&CachedPod],
    health: &Health,
    skip: &BTreeSet<String>,
) -> Result<Option<Duration>, Error> {
    let name = pps.name_any();
    let key = ObjectRef::from_obj(pps);
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let (mut held_now, mut next) = (BTreeSet::new(), None::<Duration>);
    let mut sooner = |d: Duration| next = Some(next.map_or(d, |n| n.min(d)));
    // Once the rate is spent, the others are still judged (their waits are kept).
    let mut rate_spent = false;
    for pod in pods.iter().filter(|p| !skip.contains(&*p.name)) {
        let Some(values) = record::pinned(&name, pod) else {
            continue;
        };
        // Read live only when no usable node with the values is free of a taint that could
        // hold the pod (the usual pinned pod, waiting for its node's room, is not read).
        let strict =
            placement::required_owned(&values, &PodDemands::default(), ctx.caches.as_ref(), health);
        let Some(uid) = pod.uid().filter(|_| strict.dropped.is_some()) else {
            continue;
        };
        let live = match api.get_opt(&pod.name).await {
            Ok(Some(live)) => live,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(pod = %pod.name, error = %e, "a pinned waiting pod could not be read");
                sooner(UNREAD_RETRY);
                continue;
            }
        };
        let scheduled = live
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .is_some_and(|n| !n.is_empty());
        if live.uid().as_deref() != Some(&uid)
            || live.metadata.deletion_timestamp.is_some()
            || scheduled
        {
            continue;
        }
        let every_node = ctx.caches.nodes.state();
        let Some(dropped) = held_by_pin(&live, &values, ctx.caches.as_ref(), &every_node, health)
        else {
            continue;
        };
        held_now.insert(uid.clone());
        let since = *crate::sync::lock(&ctx.held_since)
            .entry((key.clone(), uid.clone()))
            .or_insert_with(Instant::now);
        let waited = since.elapsed();
        if waited < ctx.node_lost_after {
            sooner(ctx.node_lost_after - waited + Duration::from_secs(1));
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
        let target = (namespace, &*pod.name);
        let rv = live.resource_version();
        if delete_waiting_pod(&api, &ctx.fence, target, &uid, rv.clone()).await? == Deleted::Now {
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
            report::released(ctx, report::PinnedBy::Live(pps), &stranded);
        }
    }
    crate::sync::lock(&ctx.held_since).retain(|(k, uid), _| *k != key || held_now.contains(uid));
    Ok(next)
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
        // Lost or gone: the stranded pods' release judges those.
        let lost = json!([{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}]);
        assert_eq!(
            judge(vec![node("n1", lost, false), fine()], &pod(json!({}))),
            None
        );
        assert_eq!(judge(vec![fine()], &pod(json!({}))), None);
    }
}
