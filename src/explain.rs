//! `explain POD -n NS`: what a re-created pod would get now, and why. It reads the cluster once
//! (the pod, its workload's template, the PersistentPodStates of the namespace, every node and
//! pod), feeds the same caches the server uses, and runs the webhook's own decision ([`decide`])
//! on the pod as its workload would create it.

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DynamicObject, ListParams};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde::Serialize;
use serde_json::{Value, json};

use crate::api::{
    INJECTED_REQUIRED_ANNOTATION, MODE_ANNOTATION, PersistentPodState, PodState,
    RELEASE_LOCAL_VOLUMES_ANNOTATION, decode_required, encode_required, json_error_summary,
};
use crate::placement::{self, DropReason, HOSTNAME_LABEL, Health, Nodes, PodDemands};
use crate::release::{self, LocalClaim, NodeKeys};
use crate::state::Caches;
use crate::webhook::admit::{CacheLookup, Kinds, LeftOut, Verdict, decide};
use crate::workload::{WorkloadInfo, controller_owner, read_workload};

/// What a re-created pod would get, and what is left out and why.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The workload, `group/Kind name`.
    pub workload: Option<String>,
    /// Where the pod was taken from: the workload's template, or the current pod.
    pub pod_source: String,
    /// The PersistentPodState in force for the workload.
    pub persistent_pod_state: Option<String>,
    /// Other PersistentPodStates targeting the workload (they record nothing).
    pub shadowed: Vec<String>,
    /// The state recorded for the pod's name.
    pub recorded: Option<PodState>,
    /// What the webhook decides: `inject`, `nothing to inject` (a state is recorded but none of
    /// it can be added), `would inject (observed only)` (the PersistentPodState
    /// carries `persistent-pod-state.io/mode: observe`: the patch is reported in a `WouldInject`
    /// Event, not applied; `serve --mode observe` does the same for every one), or why the pod
    /// is left alone.
    pub outcome: String,
    /// The JSON patch the webhook would answer with (empty when none).
    pub patch: Value,
    /// What is left out, and why.
    pub left_out: Vec<LeftOut>,
    /// When the controller releases the current pod, if it waits unscheduled: what holds it
    /// (a pin the webhook added, claims on a node's local volumes) and when it lets go.
    pub release: Vec<String>,
    /// What the caller may not read, and what the answer does not see for it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unread: Vec<String>,
}

/// The pod its workload would create now: the template's metadata and spec, the name, and a
/// controller reference to the workload.
pub fn pod_from_template(name: &str, namespace: &str, workload: &DynamicObject) -> Option<Value> {
    let template = workload.data.pointer("/spec/template")?;
    let types = workload.types.as_ref()?;
    Some(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": namespace,
            "labels": template.pointer("/metadata/labels"),
            "annotations": template.pointer("/metadata/annotations"),
            "ownerReferences": [{"apiVersion": types.api_version, "kind": types.kind,
                "name": workload.name_any(), "uid": workload.uid().unwrap_or_default(),
                "controller": true, "blockOwnerDeletion": true}],
        },
        "spec": template.get("spec"),
    }))
}

/// What the serving replicas are run with, as `explain` judges by it.
#[derive(Clone, Debug, Default)]
pub struct AsServed {
    /// `serve --node-lost-after`.
    pub node_lost_after: Duration,
    /// `serve --node-local-volume-key` (with the built-in keys).
    pub node_keys: NodeKeys,
    /// `serve --mode observe`: every PersistentPodState observed only.
    pub observe_all: bool,
    /// `serve --max-releases-per-minute` (0: the controller releases nothing).
    pub max_releases_per_minute: u32,
}

/// What `explain` says of a pin's release (`said`, and whether the controller releases it) as
/// the replicas release ([`unless_releases_off`]).
fn as_released(
    served: &AsServed,
    (said, releases): (String, bool),
    (pod, namespace): (&str, &str),
    held: Option<&str>,
) -> String {
    match held {
        Some(why) if releases => format!(
            "{said}; but the controller releases nothing for it: {why}; or run `persistent-pod-state release {pod} -n {namespace}`"
        ),
        _ if releases => unless_releases_off(served, said, pod, namespace),
        _ => said,
    }
}

/// What a release `explain` foresees becomes when the replicas release nothing
/// (`--max-releases-per-minute 0`): what would happen, and how to do it by hand.
fn unless_releases_off(served: &AsServed, said: String, pod: &str, namespace: &str) -> String {
    if served.max_releases_per_minute == 0 {
        format!(
            "{said}; but the controller releases nothing (--max-releases-per-minute 0): run `persistent-pod-state release {pod} -n {namespace}`"
        )
    } else {
        said
    }
}

/// Runs the webhook's decision for `object` (a pod being created in `namespace`) and says what
/// it gives and leaves out. Pure over the caches.
pub fn explain_with(
    caches: &Caches,
    served: &AsServed,
    namespace: &str,
    object: Value,
    pod_source: &str,
) -> Explanation {
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let mut out = Explanation {
        pod: format!("{namespace}/{name}"),
        workload: None,
        pod_source: pod_source.to_owned(),
        persistent_pod_state: None,
        shadowed: Vec::new(),
        recorded: None,
        outcome: String::new(),
        patch: json!([]),
        left_out: Vec::new(),
        release: Vec::new(),
        unread: Vec::new(),
    };
    let pod: Pod = match serde_json::from_value(object) {
        Ok(pod) => pod,
        Err(e) => {
            out.outcome = format!("invalid: {}", json_error_summary(&e));
            return out;
        }
    };
    let lookup = CacheLookup {
        caches,
        kinds: Kinds::Any,
        node_lost_after: served.node_lost_after,
        reservations: None,
    };
    let decision = decide(&pod, namespace, &lookup);
    if let Some(w) = &decision.workload {
        out.workload = Some(format!("{}/{} {}", w.kind.group, w.kind.kind, w.name));
        out.persistent_pod_state = decision.pps.as_ref().map(|p| p.name_any());
        out.shadowed = caches
            .pps_names_for(w)
            .into_iter()
            .filter(|n| Some(n) != out.persistent_pod_state.as_ref())
            .collect();
        out.recorded = decision
            .pps
            .as_ref()
            .and_then(|p| p.status.as_ref())
            .and_then(|s| s.pod_states.get(&name))
            .cloned();
    }
    out.left_out = decision.left_out();
    match &decision.verdict {
        Verdict::Skip(reason) => out.outcome = format!("left alone: {}", reason.as_str()),
        Verdict::Inject { injection, .. } => {
            let observed = decision
                .pps
                .as_ref()
                .is_some_and(|p| crate::api::observed_only(p, served.observe_all));
            out.outcome = match (injection.patch.is_empty(), observed) {
                (true, _) => "nothing to inject".into(),
                (false, true) => "would inject (observed only)".into(),
                (false, false) => "inject".into(),
            };
            out.patch = injection.patch.to_value();
        }
    }
    out
}

impl Explanation {
    /// The human-readable form.
    pub fn text(&self) -> String {
        let mut t = format!("pod {}", self.pod);
        if let Some(w) = &self.workload {
            t.push_str(&format!(" of {w}"));
        }
        t.push_str(&format!(" (as created from {})\n", self.pod_source));
        match &self.persistent_pod_state {
            Some(p) => t.push_str(&format!("PersistentPodState: {p}\n")),
            None => t.push_str("PersistentPodState: none targets the workload\n"),
        }
        if !self.shadowed.is_empty() {
            t.push_str(&format!(
                "also targeting it (older one wins, these record nothing): {}\n",
                self.shadowed.join(", ")
            ));
        }
        match &self.recorded {
            Some(s) => t.push_str(&format!(
                "recorded: node {}, labels {:?}, IPs [{}]\n",
                s.node_name.as_deref().unwrap_or(
                    "none (its node-local data released, say): recorded again once Ready"
                ),
                s.node_topology_labels
                    .iter()
                    .collect::<std::collections::BTreeMap<_, _>>(),
                s.pod_ips.join(", ")
            )),
            None => t.push_str("recorded: nothing for this pod name\n"),
        }
        t.push_str(&format!("decision: {}\n", self.outcome));
        t.push_str(&format!(
            "patch:\n{}\n",
            serde_json::to_string_pretty(&self.patch).unwrap_or_default()
        ));
        if self.left_out.is_empty() {
            t.push_str("left out: nothing\n");
        } else {
            t.push_str("left out:\n");
            for l in &self.left_out {
                t.push_str(&format!("  - {}: {}\n", l.what, l.why));
            }
        }
        if !self.release.is_empty() {
            t.push_str("release (the pod waits unscheduled):\n");
            for r in &self.release {
                t.push_str(&format!("  - {r}\n"));
            }
        }
        for u in &self.unread {
            t.push_str(&format!("not read: {u}\n"));
        }
        t
    }
}

/// Reads the cluster in `$KUBECONFIG` and explains `pod` in `namespace`.
pub async fn explain(
    client: &Client,
    namespace: &str,
    pod: &str,
    served: &AsServed,
) -> anyhow::Result<Explanation> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let current = pods.get_opt(pod).await.context("reading the pod")?;
    let pps_list = Api::<PersistentPodState>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
        .context("listing PersistentPodStates")?;
    // The workload: the pod's controller, or (pod gone) the PPS that recorded its name.
    let owner = match &current {
        Some(p) => controller_owner(p.owner_references())
            .map(|o| (o.api_version.clone(), o.kind.clone(), o.name.clone())),
        None => pps_list
            .items
            .iter()
            .find(|p| {
                p.status
                    .as_ref()
                    .is_some_and(|s| s.pod_states.contains_key(pod))
            })
            .map(|p| {
                let t = &p.spec.target_ref;
                (t.api_version.clone(), t.kind.clone(), t.name.clone())
            }),
    };
    // Not read (forbidden, say): the current pod stands in for its template, and the reason is
    // said.
    let (workload, unread) = match &owner {
        Some((api_version, kind, name)) => {
            match read_workload(client, namespace, api_version, kind, name).await {
                Ok(workload) => (workload, None),
                Err(error) => (None, Some(format!("{kind} {name}: {error}"))),
            }
        }
        None => (None, None),
    };
    let (object, source) = match (
        workload
            .as_ref()
            .and_then(|w| pod_from_template(pod, namespace, w)),
        &current,
    ) {
        (Some(o), _) => (o, "the workload's template"),
        (None, Some(p)) => {
            // Created again, the pod names no node: the scheduler's choice is no demand of it.
            let mut object = serde_json::to_value(p)?;
            if let Some(spec) = object.get_mut("spec").and_then(|s| s.as_object_mut()) {
                spec.remove("nodeName");
            }
            (
                object,
                "the current pod (the workload's template could not be read)",
            )
        }
        (None, None) => match (&owner, unread) {
            (Some(_), Some(why)) => anyhow::bail!(
                "pod {namespace}/{pod} does not exist, and the workload that would create it again could not be read ({why})"
            ),
            (Some((_, kind, name)), None) if workload.is_some() => anyhow::bail!(
                "pod {namespace}/{pod} does not exist, and the workload that would create it again, {kind} {name}, has no pod template at spec.template"
            ),
            (Some((_, kind, name)), None) => anyhow::bail!(
                "pod {namespace}/{pod} does not exist, and the workload that would create it again, {kind} {name}, does not exist either"
            ),
            (None, _) => anyhow::bail!(
                "pod {namespace}/{pod} does not exist and no PersistentPodState in {namespace} records it"
            ),
        },
    };
    if let Some(why) = &unread {
        tracing::warn!(
            "the workload's template could not be read ({why}): the current pod stands in for it"
        );
    }

    let caches = Caches::with_nodes(client)
        .await
        .context("listing nodes (what would be injected is judged against them)")?;
    caches.apply_pps(watcher::Event::Init);
    for p in pps_list.items {
        caches.apply_pps(watcher::Event::InitApply(p));
    }
    caches.apply_pps(watcher::Event::InitDone);
    // Every pod of the cluster: which one holds which IP. Page by page (each trimmed as it is
    // cached), never one answer of every pod of a large cluster. A caller who may list only
    // the namespace's pods gets the answer for them, and is told what it does not see.
    let mut apply = |p| caches.apply_pod(watcher::Event::InitApply(p));
    let every = Api::<Pod>::all(client.clone());
    let unread = match crate::state::list_each(&every, &ListParams::default(), &mut apply).await {
        Ok(()) => None,
        Err(kube::Error::Api(e)) if e.code == 403 => {
            crate::state::list_each(&pods, &ListParams::default(), &mut apply)
                .await
                .context("listing the namespace's pods")?;
            Some(format!(
                "pods in every namespace ({}): a recorded IP held by a pod of another namespace is not seen, so an IP this answer injects may be one the webhook leaves out",
                e.message
            ))
        }
        Err(e) => return Err(e).context("listing pods"),
    };
    caches.apply_pod(watcher::Event::InitDone);
    let mut out = explain_with(&caches, served, namespace, object, source);
    // Only a recorded IP is judged by which pod holds it.
    if out.recorded.as_ref().is_some_and(|s| !s.pod_ips.is_empty()) {
        out.unread.extend(unread);
    }
    if let Some(current) = current.filter(release::waits_unscheduled) {
        let health = Health::now(served.node_lost_after);
        let pod = current.name_any();
        // As the controller: nothing pinned is released on the word of a workload whose
        // template carries the webhook's annotations.
        let held = workload
            .as_ref()
            .filter(|w| WorkloadInfo::from_object(w).template_pinned)
            .map(|_| crate::workload::TEMPLATE_PINNED_HOLDS);
        out.release = pinned_release(&current, caches.as_ref(), &health)
            .map(|judged| as_released(served, judged, (&pod, namespace), held))
            .into_iter()
            .collect();
        let pps = out
            .persistent_pod_state
            .as_deref()
            .and_then(|p| caches.pps.get(&ObjectRef::new(p).within(namespace)));
        if let (Some(pps), Some(workload)) = (pps, &workload) {
            out.release.extend(
                volume_release(client, &caches, &pps, &current, workload, &health, served).await?,
            );
        }
    }
    Ok(out)
}

/// When the controller releases a waiting pod the webhook pinned: now when no usable node has
/// the values it added, else when the last node that has them comes to count as lost (and
/// whether it is released at all, then).
fn pinned_release(pod: &Pod, nodes: &dyn Nodes, health: &Health) -> Option<(String, bool)> {
    let values = decode_required(pod.annotations().get(INJECTED_REQUIRED_ANNOTATION)?)?;
    if values.is_empty() {
        return None;
    }
    let pinned = encode_required(&values);
    let values = placement::borrowed(&values);
    if let Some(dropped) =
        placement::required(values.clone(), &PodDemands::none(), nodes, health).dropped
    {
        let said = format!(
            "pinned by the webhook to {pinned}: released now ({})",
            LeftOut::list(&LeftOut::required(&dropped).collect::<Vec<_>>())
        );
        return Some((said, true));
    }
    let mut last: Option<k8s_openapi::jiff::Timestamp> = None;
    let mut usable: Option<String> = None;
    nodes.visit_with_labels(&values, &mut |n| {
        match health.lost_at(n) {
            Some(at) => last = Some(last.map_or(at, |l| l.max(at))),
            None => usable = Some(n.name_any()),
        }
        usable.is_some()
    });
    Some(match (usable, last) {
        (Some(node), _) => (
            format!(
                "pinned by the webhook to {pinned}: not released while node {node} is usable (the pod waits for something else)"
            ),
            false,
        ),
        (None, Some(at)) => (
            format!(
                "pinned by the webhook to {pinned}: released at {at} if no node that has them is ready by then (--node-lost-after {})",
                humantime(health.lost_after)
            ),
            true,
        ),
        (None, None) => (
            format!("pinned by the webhook to {pinned}: released now"),
            true,
        ),
    })
}

/// Whether and when the waiting pod's claims on node-local volumes of its recorded node are
/// released with it.
async fn volume_release(
    client: &Client,
    caches: &Caches,
    pps: &PersistentPodState,
    pod: &Pod,
    workload: &DynamicObject,
    health: &Health,
    served: &AsServed,
) -> anyhow::Result<Vec<String>> {
    let info = WorkloadInfo::from_object(workload);
    let name = pod.name_any();
    let (Some(uid), Some(state)) = (
        pod.uid(),
        pps.status.as_ref().and_then(|s| s.pod_states.get(&name)),
    ) else {
        return Ok(Vec::new());
    };
    let Some(recorded) = state.node_name.as_deref() else {
        return Ok(Vec::new());
    };
    let namespace = pps.namespace().unwrap_or_default();
    let judged = match release::local_claims(
        client,
        &namespace,
        (&name, &uid),
        &info.claim_templates,
        &info.uid,
        caches,
        &served.node_keys,
    )
    .await
    {
        Ok(judged) => judged,
        // A user who may not read the claims, or the PersistentVolumes (cluster-wide), still
        // gets the rest of the answer.
        Err(kube::Error::Api(e)) if e.code == 403 => {
            return Ok(vec![format!(
                "whether claims on node {recorded}'s local volumes hold it is not judged: reading its claims or their PersistentVolumes was refused ({})",
                e.message
            )]);
        }
        Err(e) => return Err(e).context("reading the pod's claims"),
    };
    let local: Vec<LocalClaim> = judged
        .into_iter()
        .flatten()
        .filter(|c| {
            c.node == recorded
                || state
                    .node_topology_labels
                    .get(HOSTNAME_LABEL)
                    .is_some_and(|h| *h == c.node)
        })
        .collect();
    if local.is_empty() {
        return Ok(Vec::new());
    }
    let node = caches.node(recorded);
    let gone = release::node_gone(node.as_deref(), state.node_uid.as_deref(), health);
    let allowed = pps
        .annotations()
        .get(RELEASE_LOCAL_VOLUMES_ANNOTATION)
        .map(String::as_str)
        == Some("true");
    let claims = release::describe(&local);
    // As the controller: what is observed only is another injector's, its claims never released.
    if crate::api::observed_only(pps, served.observe_all) {
        return Ok(vec![format!(
            "held by claims {claims} on node {recorded}: never released by the controller while the PersistentPodState is observed only (serve --mode observe, or its {MODE_ANNOTATION} annotation)"
        )]);
    }
    // Registered again under another uid and working: kept while it is so (its data may be
    // there), as the controller judges.
    if gone.is_some()
        && node.as_deref().is_some_and(|n| !health.is_lost(n))
        && local.iter().any(|c| c.node_known)
    {
        return Ok(vec![format!(
            "held by claims {claims} on node {recorded}, which is there again (another uid) and works: not released while it is so"
        )]);
    }
    // Lost (or to be) while cordoned: held for maintenance, as the controller judges.
    if !matches!(gone, Some(DropReason::NodeGone))
        && node
            .as_deref()
            .is_some_and(|n| placement::in_maintenance(n) && health.lost_at(n).is_some())
    {
        return Ok(vec![format!(
            "held by claims {claims} on node {recorded}, which is cordoned and down: kept while it is cordoned (maintenance; its disks come back with it); uncordon it, or delete it or taint it {} once it is gone for good, or run `persistent-pod-state release {name} -n {namespace}`",
            placement::OUT_OF_SERVICE_TAINT
        )]);
    }
    let when = match (gone, node.as_deref().and_then(|n| health.lost_at(n))) {
        (Some(_), _) => format!("node {recorded} is gone"),
        (None, Some(at)) => format!("node {recorded} counts as lost at {at}"),
        (None, None) => {
            return Ok(vec![format!(
                "held by claims {claims} on node {recorded}, which is usable: not released"
            )]);
        }
    };
    Ok(vec![if allowed {
        let said = format!(
            "held by claims {claims} on node {recorded}: {when}; then the controller releases them with the pod ({RELEASE_LOCAL_VOLUMES_ANNOTATION} is true)"
        );
        unless_releases_off(served, said, &name, &namespace)
    } else if served.max_releases_per_minute == 0 {
        format!(
            "held by claims {claims} on node {recorded}: {when}; the controller releases nothing (--max-releases-per-minute 0): run `persistent-pod-state release {name} -n {namespace}`"
        )
    } else {
        format!(
            "held by claims {claims} on node {recorded}: {when}; the controller releases them only with {RELEASE_LOCAL_VOLUMES_ANNOTATION}=true on the PersistentPodState, or run `persistent-pod-state release {name} -n {namespace}`"
        )
    }])
}

/// A duration as the flags take it (`90s`, `5m`).
fn humantime(d: Duration) -> String {
    let secs = d.as_secs();
    if secs.is_multiple_of(60) && secs > 0 {
        format!("{}m", secs / 60)
    } else {
        format!("{secs}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explains_the_patch_and_what_is_left_out() {
        let caches = Caches::new();
        let pps = |preferred: Value| -> PersistentPodState {
            serde_json::from_value(json!({
            "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": "web", "namespace": "ns",
                "annotations": {"persistent-pod-state.io/ip-request": "calico"}},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                     "requiredPersistentTopology": {"keys": ["kubernetes.io/hostname"]},
                     "preferredPersistentTopology": preferred},
            "status": {"observedGeneration": 1, "podStates": {"web-0": {"nodeName": "gone",
                "nodeTopologyLabels": {"kubernetes.io/hostname": "gone",
                    "topology.kubernetes.io/zone": "z1"}, "podIPs": ["10.0.0.5"]}}}
            }))
            .expect("pps")
        };
        caches.apply_pps(watcher::Event::Apply(pps(json!([{"weight": 50,
            "preference": {"keys": ["topology.kubernetes.io/zone"]}}]))));
        caches.apply_pod(watcher::Event::Apply(
            serde_json::from_value(json!({"metadata": {"name": "other", "namespace": "x"},
                "status": {"phase": "Running", "podIP": "10.0.0.5"}}))
            .expect("pod"),
        ));
        let sts: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "web", "namespace": "ns", "uid": "u1"},
            "spec": {"template": {"metadata": {"labels": {"app": "web"}},
                                  "spec": {"containers": [{"name": "c", "image": "i"}]}}}
        }))
        .expect("sts");
        let object = pod_from_template("web-0", "ns", &sts).expect("template");
        let served = AsServed {
            node_lost_after: Duration::from_secs(300),
            ..AsServed::default()
        };
        let e = explain_with(
            &caches,
            &served,
            "ns",
            object.clone(),
            "the workload's template",
        );
        assert_eq!(e.outcome, "inject");
        // As replicas run with `--mode observe` would answer.
        let observing = AsServed {
            observe_all: true,
            ..served.clone()
        };
        let observed = explain_with(&caches, &observing, "ns", object.clone(), "the template");
        assert_eq!(observed.outcome, "would inject (observed only)");
        assert_eq!(e.persistent_pod_state.as_deref(), Some("web"));
        let whats: Vec<&str> = e.left_out.iter().map(|l| l.what.as_str()).collect();
        assert_eq!(
            whats,
            ["required kubernetes.io/hostname=gone", "IP request"]
        );
        assert!(
            e.left_out[1].why.contains("10.0.0.5 is held by x/other"),
            "{:?}",
            e.left_out
        );
        let text = e.text();
        assert!(
            text.contains("kruise.io~1injected-persistent-pod-state")
                || text.contains("kruise.io/injected-persistent-pod-state"),
            "{text}"
        );
        assert!(text.contains("left out:"), "{text}");
        // Without the preferred term nothing can be added: no patch, the pod left unmarked.
        caches.apply_pps(watcher::Event::Apply(pps(json!([]))));
        let e = explain_with(&caches, &served, "ns", object, "the template");
        assert_eq!(e.outcome, "nothing to inject");
        assert_eq!(e.patch, json!([]));
        assert_eq!(e.left_out.len(), 2, "{:?}", e.left_out);
    }

    #[test]
    fn a_pinned_waiting_pod_is_released_when_the_last_node_with_its_values_is_lost() {
        let pod: Pod =
            serde_json::from_value(json!({"metadata": {"name": "web-0", "namespace": "ns",
            "annotations": {INJECTED_REQUIRED_ANNOTATION: "kubernetes.io/hostname=n1"}}}))
            .expect("pod");
        let with_ready = |status: &str, since: &str| {
            let caches = Caches::new();
            caches.apply_node(watcher::Event::Apply(
                serde_json::from_value(json!({"metadata": {"name": "n1",
                    "labels": {HOSTNAME_LABEL: "n1"}},
                    "status": {"conditions": [{"type": "Ready", "status": status, "lastTransitionTime": since}]}}))
                .expect("node"),
            ));
            caches
        };
        let now = k8s_openapi::jiff::Timestamp::now();
        let ago = |s: i64| {
            now.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(s))
                .expect("time")
                .to_string()
        };
        let health = Health::now(Duration::from_secs(300));
        let said = |caches: &Caches| pinned_release(&pod, caches, &health).expect("pinned").0;
        let brief = said(&with_ready("Unknown", &ago(10)));
        assert!(
            brief.contains("released at") && brief.contains("--node-lost-after 5m"),
            "{brief}"
        );
        assert!(said(&with_ready("Unknown", &ago(600))).contains("released now"));
        assert!(
            said(&with_ready("True", &ago(600))).contains("not released while node n1 is usable")
        );
        assert!(
            said(Caches::new().as_ref()).contains("released now"),
            "node gone"
        );
        // Released or not, and with the replicas run with `--max-releases-per-minute 0` never.
        let off = AsServed {
            max_releases_per_minute: 0,
            ..AsServed::default()
        };
        let on = AsServed {
            max_releases_per_minute: 10,
            ..AsServed::default()
        };
        for (caches, releases) in [
            (with_ready("True", &ago(600)), false),
            (Caches::new(), true),
        ] {
            let judged = pinned_release(&pod, caches.as_ref(), &health).expect("pinned");
            let said = judged.0.clone();
            assert_eq!(judged.1, releases, "{said}");
            let at = ("web-0", "ns");
            let as_run = as_released(&off, judged.clone(), at, None);
            // A workload whose template carries the webhook's annotations: never.
            let held = as_released(&on, judged.clone(), at, Some("held so"));
            if releases {
                assert!(
                    as_run.contains("--max-releases-per-minute 0")
                        && as_run.contains("persistent-pod-state release web-0 -n ns"),
                    "{as_run}"
                );
                assert!(
                    held.contains("the controller releases nothing for it: held so")
                        && held.contains("persistent-pod-state release web-0 -n ns"),
                    "{held}"
                );
            } else {
                assert_eq!(as_run, said, "not released either way: nothing to add");
                assert_eq!(held, said, "not released either way: nothing to add");
            }
            assert_eq!(as_released(&on, judged, at, None), said);
        }
        let unpinned: Pod =
            serde_json::from_value(json!({"metadata": {"name": "x"}})).expect("pod");
        assert_eq!(
            pinned_release(&unpinned, Caches::new().as_ref(), &health),
            None
        );
    }
}
