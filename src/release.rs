//! Node-local volumes of a pod that waits for a node that is gone: which pods wait so
//! ([`waiting_on_gone_nodes`]), which of their claims are their own and bound to a volume only
//! that node can mount ([`own_claim`], [`volume_node`]), read for one pod
//! ([`local_claims`]). The controller deletes such claims (and the pod) when a
//! PersistentPodState carries [`RELEASE_LOCAL_VOLUMES_ANNOTATION`]; the `release` command does
//! on an operator's word.
//!
//! Rules for odd input (nothing is deleted, the reason is said):
//! - a volume is node-local only if every term of its required node affinity names the same one
//!   node by a label that names a node (`kubernetes.io/hostname In [name]`, a node-local
//!   driver's node key, [`NODE_IDENTITY_LABELS`]) or `metadata.name In [name]`, and no more than
//!   one known node matches it: a volume pinned to a zone or a rack is not, even where one node
//!   alone carries that label now;
//! - a claim is the pod's own only if its name is `<template>-<pod>` for one of the workload's
//!   `volumeClaimTemplates`, and every owner it names is the workload or the pod;
//! - a claim not bound, or bound to a volume that names another claim, is not released.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, PersistentVolume, PersistentVolumeClaim, Pod,
};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde::Serialize;

#[cfg(doc)]
use crate::api::RELEASE_LOCAL_VOLUMES_ANNOTATION;
use crate::api::{PersistentPodState, PersistentPodStateStatus, PodState};
use crate::placement::{
    DropReason, HOSTNAME_LABEL, Health, Nodes, in_maintenance, selector_matches,
};
use crate::state::trim::CachedPod;

/// A pod that waits unscheduled while the node its state records is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    /// Its name.
    pub pod: String,
    /// Its uid (a delete precondition).
    pub uid: String,
    /// Its resourceVersion (a delete precondition).
    pub resource_version: Option<String>,
    /// The recorded node.
    pub node: String,
    /// The recorded node's uid, when recorded.
    pub node_uid: Option<String>,
    /// The recorded node's `kubernetes.io/hostname`, when recorded.
    pub hostname: Option<String>,
    /// How the node is gone: deleted or replaced (`NodeGone`), lost (`NodeLost`).
    pub reason: DropReason,
}

/// How the node a state records is gone, if it is: deleted, or replaced under its name
/// (another uid than recorded): its local data is gone; lost, as `health` judges.
pub fn node_gone(
    node: Option<&Node>,
    recorded_uid: Option<&str>,
    health: &Health,
) -> Option<DropReason> {
    match node {
        None => Some(DropReason::NodeGone),
        Some(n) if recorded_uid.is_some_and(|uid| n.uid().as_deref() != Some(uid)) => {
            Some(DropReason::NodeGone)
        }
        Some(n) if health.is_lost(n) => Some(DropReason::NodeLost),
        Some(_) => None,
    }
}

/// The pods of `pods` that wait unscheduled (not being deleted, not finished) while the node
/// `status` records for them is gone (as [`node_gone`] judges, `node` looking nodes up).
pub fn waiting_on_gone_nodes(
    pods: &[&CachedPod],
    status: &PersistentPodStateStatus,
    node: &dyn Fn(&str) -> Option<Arc<Node>>,
    health: &Health,
) -> Vec<Waiting> {
    pods.iter()
        .filter(|p| p.node_name.as_deref().is_none_or(str::is_empty))
        .filter(|p| !p.deleting && !p.finished)
        .filter_map(|p| {
            let name = p.name.to_string();
            let state = status.pod_states.get(&name)?;
            let recorded = state.node_name.as_deref().filter(|n| !n.is_empty())?;
            let reason = node_gone(node(recorded).as_deref(), state.node_uid.as_deref(), health)?;
            Some(Waiting {
                pod: name,
                uid: p.uid()?,
                resource_version: p.resource_version(),
                node: recorded.to_owned(),
                node_uid: state.node_uid.as_ref().map(ToString::to_string),
                hostname: state
                    .node_topology_labels
                    .get(HOSTNAME_LABEL)
                    .map(|h| h.to_string()),
                reason,
            })
        })
        .collect()
}

/// Whether `pod` waits unscheduled (not being deleted, not finished), as
/// [`waiting_on_gone_nodes`] judges a cached pod.
pub fn waits_unscheduled(pod: &Pod) -> bool {
    let cached = CachedPod::from(pod.clone());
    cached.node_name.as_deref().is_none_or(str::is_empty) && !cached.deleting && !cached.finished
}

/// Whether `waiting` still waits, read live from the API server right before what cannot be
/// undone (its `claims` deleted): the same pod (uid), unscheduled, not being deleted, and its
/// recorded node still gone as [`node_gone`] judges (lost but cordoned: held for maintenance,
/// [`in_maintenance`]), no other node of that name than the
/// caches held when it was judged (`judged_on`, its uid; none: no node of that name), and that
/// node, if it is where one of the claims' volumes can be mounted, not working. The caches may
/// lag: a node back since and the pod bound to it would leave a running pod on a claim being
/// deleted (the claim protection holds it until the pod ends, then the volume goes with it).
pub async fn still_waiting(
    client: &Client,
    namespace: &str,
    waiting: &Waiting,
    (judged_on, claims): (Option<&str>, &[LocalClaim]),
    health: &Health,
) -> Result<bool, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let Some(pod) = pods.get_opt(&waiting.pod).await? else {
        return Ok(false);
    };
    if pod.uid().as_deref() != Some(waiting.uid.as_str()) || !waits_unscheduled(&pod) {
        return Ok(false);
    }
    // Listed by name: the replicas may list nodes, not get one.
    let nodes: Api<Node> = Api::all(client.clone());
    let by_name = ListParams::default().fields(&format!("metadata.name={}", waiting.node));
    let node = nodes.list(&by_name).await?.items.into_iter().next();
    let uid = node.as_ref().and_then(ResourceExt::uid);
    // Registered again (another uid) and working where a claim's volume can be mounted: its
    // data may be there.
    let works_under_a_claim = node.as_ref().is_some_and(|n| {
        !health.is_lost(n)
            && claims
                .iter()
                .any(|c| c.node_known && n.metadata.name.as_deref() == Some(c.node.as_str()))
    });
    // Lost while cordoned (maintenance): its disks come back with it.
    let gone = match node_gone(node.as_ref(), waiting.node_uid.as_deref(), health) {
        Some(DropReason::NodeLost) => !node.as_ref().is_some_and(in_maintenance),
        gone => gone.is_some(),
    };
    Ok(uid.as_deref() == judged_on && !works_under_a_claim && gone)
}

/// Node labels whose value names one node: the kubelet's hostname label, and the topology
/// keys node-local volume drivers set to the node's name or identity (TopoLVM, old and new,
/// OpenEBS LocalPV LVM and ZFS, the CSI host-path driver). A volume is node-local only when its
/// affinity names one node by one of these, by a key the operator adds ([`NodeKeys`]) or by
/// `metadata.name`: a volume pinned by any other label (a zone, a rack) is not, even when one
/// known node carries that label now.
pub const NODE_IDENTITY_LABELS: [&str; 6] = [
    HOSTNAME_LABEL,
    "topology.topolvm.io/node",
    "topology.topolvm.cybozu.com/node",
    "openebs.io/nodename",
    "openebs.io/nodeid",
    "topology.hostpath.csi/node",
];

/// The node labels that name one node in a volume's affinity: [`NODE_IDENTITY_LABELS`] and the
/// node keys of other node-local drivers an operator names (`--node-local-volume-key`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeKeys(Vec<String>);

impl Default for NodeKeys {
    fn default() -> Self {
        Self::with(&[])
    }
}

impl NodeKeys {
    /// [`NODE_IDENTITY_LABELS`] and `extra` (each once).
    pub fn with(extra: &[String]) -> Self {
        let mut keys: Vec<String> = NODE_IDENTITY_LABELS.map(str::to_owned).to_vec();
        for key in extra {
            if !keys.contains(key) {
                keys.push(key.clone());
            }
        }
        Self(keys)
    }

    /// Whether `key` names one node.
    pub fn names_a_node(&self, key: &str) -> bool {
        self.0.iter().any(|k| k == key)
    }

    /// The keys, comma-separated (for a message).
    pub fn list(&self) -> String {
        self.0.join(", ")
    }
}

/// The one node the volume `pv` can be mounted on, or why it is not node-local: every term of
/// its required node affinity names the same one node by one of `keys` or by `metadata.name`
/// (`In`, one value), and at most one known node matches it. The node's name when a known node
/// matches, else (the node was deleted) the name of the one node seen deleted lately that
/// matches it, else the value named.
pub fn volume_node(
    pv: &PersistentVolume,
    nodes: &dyn Nodes,
    keys: &NodeKeys,
) -> Result<String, String> {
    volume_node_now(pv, nodes, keys).map(|(node, _)| node)
}

/// `pv`'s required node affinity, if it has one with terms.
fn required_affinity(pv: &PersistentVolume) -> Option<&NodeSelector> {
    pv.spec
        .as_ref()
        .and_then(|s| s.node_affinity.as_ref())
        .and_then(|a| a.required.as_ref())
        .filter(|s| !s.node_selector_terms.is_empty())
}

/// [`volume_node`], and whether that node is a known node now (not one seen deleted, nor a value
/// no node carries).
fn volume_node_now(
    pv: &PersistentVolume,
    nodes: &dyn Nodes,
    keys: &NodeKeys,
) -> Result<(String, bool), String> {
    let selector = required_affinity(pv).ok_or_else(|| {
        format!(
            "PersistentVolume {} has no required node affinity",
            pv.name_any()
        )
    })?;
    let named: Option<BTreeSet<&str>> = selector
        .node_selector_terms
        .iter()
        .map(|term| {
            let by_label = term
                .match_expressions
                .iter()
                .flatten()
                .filter(|r| keys.names_a_node(&r.key));
            let by_name = term
                .match_fields
                .iter()
                .flatten()
                .filter(|r| r.key == "metadata.name");
            let mut names = by_label
                .chain(by_name)
                .filter(|r| r.operator == "In")
                .filter_map(|r| match r.values.as_deref() {
                    Some([one]) => Some(one.as_str()),
                    _ => None,
                });
            names.next()
        })
        .collect();
    let named = match named {
        Some(names) if names.len() == 1 => names.into_iter().next().unwrap_or_default(),
        _ => {
            return Err(format!(
                "PersistentVolume {}'s node affinity does not name one node (by {} or \
                 metadata.name)",
                pv.name_any(),
                keys.list()
            ));
        }
    };
    // The names of the nodes of `of` that the affinity selects.
    let selected = |of: Vec<Arc<Node>>| {
        of.iter()
            .filter(|n| selector_matches(selector, &n.name_any(), n.labels()))
            .map(|n| n.name_any())
            .collect::<BTreeSet<String>>()
    };
    let matched = selected(nodes.all());
    let mut names = matched.iter();
    match (names.next(), names.next()) {
        (None, _) => {
            let gone = selected(nodes.gone());
            Ok(match (gone.len(), gone.into_iter().next()) {
                (1, Some(node)) => (node, false),
                _ => (named.to_owned(), false),
            })
        }
        (Some(node), None) => Ok((node.clone(), true)),
        (Some(_), Some(_)) => Err(format!(
            "PersistentVolume {} can be mounted on {} nodes",
            pv.name_any(),
            matched.len()
        )),
    }
}

/// Whether `claim` is the pod's own: named `<template>-<pod>` for one of `templates` (the
/// workload's `volumeClaimTemplates`), and owned by nothing but the workload or the pod.
pub fn own_claim(
    claim: &PersistentVolumeClaim,
    pod: &str,
    pod_uid: &str,
    templates: &[String],
    workload_uid: &str,
) -> Result<(), String> {
    let name = claim.name_any();
    if !templates.iter().any(|t| name == format!("{t}-{pod}")) {
        return Err(format!(
            "claim {name} is not one of pod {pod}'s from its workload's volumeClaimTemplates"
        ));
    }
    if let Some(other) = claim
        .owner_references()
        .iter()
        .find(|o| o.uid != workload_uid && o.uid != pod_uid)
    {
        return Err(format!(
            "claim {name} is owned by {} {}, not by the workload or the pod",
            other.kind, other.name
        ));
    }
    Ok(())
}

/// A claim of the pod's own, bound to a volume only one node can mount.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LocalClaim {
    /// The claim's name.
    pub claim: String,
    /// The claim's uid (a delete precondition).
    pub uid: String,
    /// The claim's resourceVersion as read (a delete precondition: a claim changed since is
    /// judged again).
    #[serde(skip)]
    pub resource_version: Option<String>,
    /// Whether it is being deleted already.
    pub deleting: bool,
    /// The PersistentVolume it is bound to.
    pub volume: String,
    /// The one node that volume can be mounted on.
    pub node: String,
    /// Whether that node is a known node (as the caches hold the nodes when it was judged): not
    /// one seen deleted, nor a value no node carries.
    #[serde(skip)]
    pub node_known: bool,
}

#[cfg(test)]
impl LocalClaim {
    /// `data-web-0`, bound to `pv-1`, which only `node` can mount (a test fixture).
    pub fn fixture(node: &str) -> Self {
        Self {
            claim: "data-web-0".into(),
            uid: "claim-uid".into(),
            resource_version: None,
            deleting: false,
            volume: "pv-1".into(),
            node: node.into(),
            node_known: false,
        }
    }
}

/// A claim of the pod that is not released, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Kept {
    /// The claim's name.
    pub claim: String,
    /// Why it is kept.
    pub why: String,
    /// The one node its volume can be mounted on, when it is another owner's claim on such a
    /// volume: where that is the node the pod waits for, the pod is held there whatever is
    /// released, so the controller releases none of its claims (they would be deleted for
    /// nothing).
    #[serde(skip)]
    pub local_to: Option<String>,
    /// The required node affinity of its volume, when it is the pod's own claim kept because
    /// that affinity names no one node (a zonal disk, a node named by a label not known to
    /// name one): the pod can go only where it is met, so the controller releases none of its
    /// claims while no usable node meets it (they would be deleted for nothing).
    #[serde(skip)]
    pub mountable_on: Option<NodeSelector>,
}

/// Judges one claim of a pod, given the volume it is bound to (if any).
pub fn judge_claim(
    claim: &PersistentVolumeClaim,
    volume: Option<&PersistentVolume>,
    pod: (&str, &str),
    templates: &[String],
    workload_uid: &str,
    nodes: &dyn Nodes,
    keys: &NodeKeys,
) -> Result<LocalClaim, Kept> {
    let kept = |why: String| Kept {
        claim: claim.name_any(),
        why,
        local_to: None,
        mountable_on: None,
    };
    if let Err(why) = own_claim(claim, pod.0, pod.1, templates, workload_uid) {
        // Another owner's: kept, but the node its volume holds the pod to still counts.
        let bound = claim.spec.as_ref().and_then(|s| s.volume_name.as_deref());
        let local_to = volume
            .filter(|pv| Some(pv.name_any().as_str()) == bound)
            .filter(|pv| {
                let claimed_by = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
                claimed_by.and_then(|r| r.uid.as_deref()) == claim.uid().as_deref()
            })
            .and_then(|pv| volume_node(pv, nodes, keys).ok());
        return Err(Kept {
            local_to,
            ..kept(why)
        });
    }
    let uid = claim
        .uid()
        .ok_or_else(|| kept(format!("claim {} has no uid", claim.name_any())))?;
    let bound = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .filter(|v| !v.is_empty());
    let (Some(name), Some(pv)) = (bound, volume) else {
        return Err(kept(format!("claim {} is not bound", claim.name_any())));
    };
    let claimed_by = pv
        .spec
        .as_ref()
        .and_then(|s| s.claim_ref.as_ref())
        .and_then(|r| r.uid.as_deref());
    if pv.name_any() != name || claimed_by != Some(uid.as_str()) {
        return Err(kept(format!(
            "PersistentVolume {name} is not bound to claim {}",
            claim.name_any()
        )));
    }
    let (node, node_known) = volume_node_now(pv, nodes, keys).map_err(|why| Kept {
        mountable_on: required_affinity(pv).cloned(),
        ..kept(why)
    })?;
    Ok(LocalClaim {
        claim: claim.name_any(),
        uid,
        resource_version: claim.resource_version(),
        deleting: claim.metadata.deletion_timestamp.is_some(),
        volume: name.to_owned(),
        node,
        node_known,
    })
}

/// Reads and judges the claims of pod `pod` (name, uid) in `namespace` named after
/// `templates` (missing and unbound ones are skipped): each is a [`LocalClaim`] or [`Kept`].
pub async fn local_claims(
    client: &Client,
    namespace: &str,
    pod: (&str, &str),
    templates: &[String],
    workload_uid: &str,
    nodes: &(dyn Nodes + Sync),
    keys: &NodeKeys,
) -> Result<Vec<Result<LocalClaim, Kept>>, kube::Error> {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let mut out = Vec::new();
    for template in templates {
        let Some(claim) = claims.get_opt(&format!("{template}-{}", pod.0)).await? else {
            continue;
        };
        // A claim not bound yet holds the pod to no node (a new one waits for its pod to be
        // scheduled): nothing to judge.
        let volume = match claim.spec.as_ref().and_then(|s| s.volume_name.as_deref()) {
            Some(name) if !name.is_empty() => volumes.get_opt(name).await?,
            _ => continue,
        };
        out.push(judge_claim(
            &claim,
            volume.as_ref(),
            pod,
            templates,
            workload_uid,
            nodes,
            keys,
        ));
    }
    Ok(out)
}

/// Whether `local` is on the node `waiting` waits for (by name, or by its recorded hostname
/// when the volume names its node by that label).
pub fn on_node(local: &LocalClaim, waiting: &Waiting) -> bool {
    holds_on(&local.node, waiting)
}

/// Whether a volume whose affinity names `node` holds the pod `waiting` to the node it waits
/// for (by name, or by its recorded hostname).
pub fn holds_on(node: &str, waiting: &Waiting) -> bool {
    names_node(&waiting.node, waiting.hostname.as_deref(), node)
}

/// Whether `node` (as a volume's affinity names it) is the node a state records as `recorded`
/// (its name) with `hostname` (its `kubernetes.io/hostname`, when recorded).
pub fn names_node(recorded: &str, hostname: Option<&str>, node: &str) -> bool {
    node == recorded || hostname == Some(node)
}

/// The node a pod's node-local data is on now, as the cache holds it.
#[derive(Clone, Copy, Debug)]
pub struct DataNode<'a> {
    /// Its name (as a volume's affinity names it).
    pub name: &'a str,
    /// Its labels.
    pub labels: &'a BTreeMap<String, String>,
}

/// `state` once the node-local data it was recorded with is released or moved: it names no
/// node any more (`nodeName`, `nodeUID` and the labels that name one node, as `keys` judges,
/// dropped), so that a pod created again is not pinned to the node its data left (its new claim
/// binds where it is scheduled: a pin to the old node, back later, would hold it there for
/// ever). When the data's node is known (`data`), the wider labels (a zone) it lacks are
/// dropped too: a pod pinned to them could never reach its data; and if that node is the one
/// the state names (relabeled since), the state keeps naming it. The other wider labels, the
/// IPs, the annotations and the last restore stay.
pub fn without_node(state: &PodState, keys: &NodeKeys, data: Option<DataNode<'_>>) -> PodState {
    let hostname = state.node_topology_labels.get(HOSTNAME_LABEL).map(|h| &**h);
    let stays = data.is_some_and(|d| {
        let recorded = state.node_name.as_deref();
        recorded.is_some_and(|r| names_node(r, hostname, d.name))
    });
    let mut out = state.clone();
    if !stays {
        out.node_name = None;
        out.node_uid = None;
    }
    out.node_topology_labels.retain(|key, value| {
        let has = |d: DataNode<'_>| d.labels.get(&**key).map(String::as_str) == Some(&**value);
        (stays || !keys.names_a_node(key)) && data.is_none_or(has)
    });
    out
}

/// What a state forgot ([`forget_node`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Forgotten {
    /// The node it named, when it names it no more.
    pub node: Option<String>,
    /// The wider labels (`key=value`, not naming a node as the keys judge) it records no more.
    pub wider: Vec<String>,
}

impl Forgotten {
    /// What `new` forgot of `old`.
    fn of(old: &PodState, new: &PodState, keys: &NodeKeys) -> Self {
        let wider = old
            .node_topology_labels
            .iter()
            .filter(|(k, _)| !keys.names_a_node(k) && !new.node_topology_labels.contains_key(*k))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let node = old
            .node_name
            .as_deref()
            .filter(|_| new.node_name.is_none())
            .map(str::to_owned);
        Self { node, wider }
    }
}

/// The JSON patch that turns pod `pod`'s state `old` into `new` in a PersistentPodState's
/// status, provided it is still `old` on the API server (a `test` first: a state recorded again
/// meanwhile, by any writer, makes the API server refuse the patch with 422, and nothing
/// changes).
pub fn state_patch(
    pod: &str,
    old: &PodState,
    new: &PodState,
) -> serde_json::Result<json_patch::Patch> {
    let path = format!(
        "/status/podStates/{}",
        pod.replace('~', "~0").replace('/', "~1")
    );
    serde_json::from_value(serde_json::json!([
        {"op": "test", "path": path, "value": old},
        {"op": "replace", "path": path, "value": new},
    ]))
}

/// What [`forget_node`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Forgot {
    /// The state forgot what is said.
    Done(Forgotten),
    /// Nothing to do: the state names another node than the one given (recorded again), or has
    /// nothing to forget, or it or its PersistentPodState is gone.
    Nothing,
    /// The API server holds another state than the one given: look again from a fresher view.
    Stale,
}

/// Makes pod `pod`'s state in the PersistentPodState `pps` (in `api`'s namespace) name no
/// node, nor the wider labels its data's node lacks ([`without_node`]), while it names `node`
/// (`None`: whatever it names, if anything), provided the API server holds it as `state` (read
/// live when `None`).
pub async fn forget_node(
    api: &Api<PersistentPodState>,
    pps: &str,
    (pod, node): (&str, Option<&str>),
    state: Option<&PodState>,
    (keys, data): (&NodeKeys, Option<DataNode<'_>>),
) -> Result<Forgot, kube::Error> {
    let state = match state {
        Some(state) => state.clone(),
        None => {
            let live = api.get_opt(pps).await?;
            match live.and_then(|p| p.status?.pod_states.remove(pod)) {
                Some(state) => state,
                None => return Ok(Forgot::Nothing),
            }
        }
    };
    if node.is_some_and(|node| state.node_name.as_deref() != Some(node)) {
        return Ok(Forgot::Nothing);
    }
    let forgotten = without_node(&state, keys, data);
    if forgotten == state {
        return Ok(Forgot::Nothing);
    }
    let patch = state_patch(pod, &state, &forgotten).map_err(kube::Error::SerdeError)?;
    match api
        .patch_status(pps, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
    {
        Ok(_) => Ok(Forgot::Done(Forgotten::of(&state, &forgotten, keys))),
        // The `test` failed (another state than the one read), or a conflict.
        Err(kube::Error::Api(e)) if e.code == 422 || e.code == 409 => Ok(Forgot::Stale),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Forgot::Nothing),
        Err(e) => Err(e),
    }
}

/// Whether a pod's state names the node meant.
type NamesNode<'a> = dyn Fn(&PodState) -> bool + 'a;

/// For `release`: makes pod `pod`'s state name no node ([`forget_node`]) in the
/// PersistentPodState in force for its workload `(apiVersion, kind, name)` (the oldest of those
/// targeting it, as the webhook and the controller choose), when `node` says that state names
/// the node meant: the node a released claim's volume was on, or the node the webhook pinned
/// the pod to. `None` when no such state names it; else what was done, or a warning
/// saying why it was not and what that risks (`risk`: what a pod created again meets).
async fn forget_released_node(
    client: &Client,
    namespace: &str,
    (api_version, kind, name): (&str, &str, &str),
    (pod, node): (&str, &NamesNode<'_>),
    keys: &NodeKeys,
    risk: &str,
) -> Option<Result<String, String>> {
    let api: Api<PersistentPodState> = Api::namespaced(client.clone(), namespace);
    let list = match api.list(&ListParams::default()).await {
        Ok(list) => list,
        Err(e) => {
            return Some(Err(format!(
                "the PersistentPodStates could not be listed ({e}): if one records {pod} on that node, {risk}; edit its state"
            )));
        }
    };
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    let pps = list
        .items
        .iter()
        // One being deleted steers no pod (the webhook and the controller skip it).
        .filter(|p| {
            let t = &p.spec.target_ref;
            p.metadata.deletion_timestamp.is_none()
                && t.group() == group
                && t.kind == kind
                && t.name == name
        })
        .min_by(|a, b| {
            let created = |p: &PersistentPodState| p.metadata.creation_timestamp.clone();
            created(a)
                .cmp(&created(b))
                .then_with(|| a.metadata.name.cmp(&b.metadata.name))
        })?;
    let state = pps.status.as_ref()?.pod_states.get(pod)?;
    let recorded = state.node_name.as_deref();
    let hostname = state.node_topology_labels.get(HOSTNAME_LABEL).map(|h| &**h);
    if !node(state) {
        return None;
    }
    // As the state names it: by name, else by its hostname label alone.
    let recorded = recorded.or(hostname).unwrap_or_default();
    let pps_name = pps.name_any();
    let target = (pod, state.node_name.as_deref());
    // As listed (the patch tests the state is unchanged), then once as read live (it may have
    // changed since the list) where the state names the node by name, which is checked again
    // then (by its hostname label alone, nothing would keep a state recorded since on another
    // node from being cleared).
    let done = match forget_node(&api, &pps_name, target, Some(state), (keys, None)).await {
        Ok(Forgot::Stale) if target.1.is_some() => {
            forget_node(&api, &pps_name, target, None, (keys, None)).await
        }
        done => done,
    };
    Some(match done {
        Ok(Forgot::Done(_) | Forgot::Nothing) => Ok(format!(
            "the state of {pod} in PersistentPodState {pps_name} names node {recorded} no more"
        )),
        Ok(Forgot::Stale) => Err(format!(
            "the state of {pod} in PersistentPodState {pps_name} kept changing and may still name node {recorded}: {risk}; edit the state"
        )),
        Err(e) => Err(format!(
            "the state of {pod} in PersistentPodState {pps_name} could not be made to name no node ({e}): {risk}; edit the state"
        )),
    })
}

/// What a released pod's local claims were, for a message: `claim (PersistentVolume pv)`, ...
pub fn describe(claims: &[LocalClaim]) -> String {
    let by_claim: BTreeMap<&str, &str> = claims
        .iter()
        .map(|c| (c.claim.as_str(), c.volume.as_str()))
        .collect();
    by_claim
        .iter()
        .map(|(c, v)| format!("{c} (PersistentVolume {v})"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What `release` did (or, in a dry run, would do) for one pod.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseReport {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// Whether nothing was deleted (a dry run).
    pub dry_run: bool,
    /// The claims deleted (or to be), each with its volume and node.
    pub claims: Vec<LocalClaim>,
    /// Whether the pod was deleted (or is to be).
    pub pod_deleted: bool,
    /// Why the pod was released: what held it.
    pub because: Vec<String>,
    /// The pod's claims that are kept, and why.
    pub kept: Vec<Kept>,
    /// What became of the pod's state, once its claims are released: it names their node no
    /// more, or a warning why it may still.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
}

impl ReleaseReport {
    /// The human-readable form.
    pub fn text(&self) -> String {
        let verb = if self.dry_run {
            "would delete"
        } else {
            "deleted"
        };
        let namespace = self.pod.split_once('/').map_or("", |(ns, _)| ns);
        let mut t = String::new();
        for c in &self.claims {
            t.push_str(&format!(
                "{verb} persistentvolumeclaim {namespace}/{} (bound to PersistentVolume {}, which only node {} can mount)\n",
                c.claim, c.volume, c.node
            ));
        }
        if self.pod_deleted {
            t.push_str(&format!(
                "{verb} pod {} ({}); its workload creates it again\n",
                self.pod,
                self.because.join("; ")
            ));
        }
        if self.dry_run && !self.claims.is_empty() {
            t.push_str("would make the pod's recorded state name the claims' node no more\n");
        }
        if let Some(state) = &self.state {
            t.push_str(state);
            t.push('\n');
        }
        for k in &self.kept {
            t.push_str(&format!("kept claim {}: {}\n", k.claim, k.why));
        }
        t
    }
}

/// `release POD -n NS`: on an operator's word, deletes what the controller would release for a
/// pod that waits unscheduled: its own claims bound to volumes only a node that is not ready
/// (or deleted) can mount (each by uid and resourceVersion), and the pod when such a claim or a
/// required pin the webhook added holds it (by uid and resourceVersion; by uid alone once its
/// claims are deleted, as it cannot start anywhere then). A scheduled pod, a pod no workload
/// would create again, a claim on a ready node's volume, one of another owner, or a volume whose
/// affinity does not name one node is never touched. `dry_run`: deletes nothing, reports what it would.
pub async fn release_pod(
    client: &Client,
    namespace: &str,
    name: &str,
    dry_run: bool,
    keys: &NodeKeys,
) -> anyhow::Result<ReleaseReport> {
    use anyhow::Context as _;
    use kube::api::{DeleteParams, Preconditions};

    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods
        .get_opt(name)
        .await
        .context("reading the pod")?
        .with_context(|| format!("pod {namespace}/{name} does not exist"))?;
    if let Some(node) = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
    {
        anyhow::bail!(
            "pod {namespace}/{name} is scheduled on node {node}: release deletes only a pod that waits unscheduled"
        );
    }
    if pod.metadata.deletion_timestamp.is_some() {
        anyhow::bail!("pod {namespace}/{name} is being deleted already");
    }
    let uid = pod.uid().context("the pod has no uid")?;
    let caches = crate::state::Caches::with_nodes(client)
        .await
        .context("listing nodes")?;
    let owner = crate::workload::controller_owner(pod.owner_references());
    let workload = match owner {
        Some(o) => {
            crate::workload::read_workload(client, namespace, &o.api_version, &o.kind, &o.name)
                .await
                .with_context(|| format!("reading its controller {} {}", o.kind, o.name))?
        }
        None => None,
    };
    // Released, a pod is created again by its workload: one without (orphaned, its workload
    // deleted) would just be gone.
    let Some(workload) = workload else {
        anyhow::bail!(
            "pod {namespace}/{name} has no workload that would create it again ({}): release deletes only a pod its workload re-creates",
            owner.map_or("no controller owns it".to_owned(), |o| format!(
                "its controller {} {} does not exist",
                o.kind, o.name
            ))
        );
    };
    let crate::workload::WorkloadInfo {
        claim_templates: templates,
        uid: workload_uid,
        ..
    } = crate::workload::WorkloadInfo::from_object(&workload);
    let judged = local_claims(
        client,
        namespace,
        (name, &uid),
        &templates,
        &workload_uid,
        caches.as_ref(),
        keys,
    )
    .await
    .context("reading the pod's claims")?;
    let ready = Health::now(std::time::Duration::ZERO);
    let mut report = ReleaseReport {
        pod: format!("{namespace}/{name}"),
        dry_run,
        claims: Vec::new(),
        pod_deleted: false,
        because: Vec::new(),
        kept: Vec::new(),
        state: None,
    };
    for judged in judged {
        match judged {
            Ok(local) => match caches.node(&local.node) {
                Some(node) if !ready.is_lost(&node) => report.kept.push(Kept {
                    why: format!(
                        "node {} is ready: its volume is kept (only a node that is not ready, deleted or out of service is released)",
                        local.node
                    ),
                    claim: local.claim,
                    local_to: None,
                    mountable_on: None,
                }),
                _ => report.claims.push(local),
            },
            Err(kept) => report.kept.push(kept),
        }
    }
    if !report.claims.is_empty() {
        report.because.push(format!(
            "its claims {} hold it to their node",
            describe(&report.claims)
        ));
    }
    let pinned = pod
        .annotations()
        .get(crate::api::INJECTED_REQUIRED_ANNOTATION)
        .and_then(|v| crate::api::decode_required(v))
        .filter(|v| !v.is_empty());
    if let Some(values) = &pinned {
        report.because.push(format!(
            "the webhook pinned it to {}",
            crate::api::encode_required(values)
        ));
    }
    // Held by the webhook's pin to one node, not by claims: its state still names that node
    // (usable as the webhook judges it: within its grace, full, cordoned), so the pod created
    // again would be pinned there again. Its state is made to name that node no more first.
    // The pinned values that name one node (the hostname first), as the state records them.
    let pinned_node: Option<BTreeMap<String, String>> = pinned
        .as_ref()
        .filter(|_| report.claims.is_empty())
        .map(|values| {
            values
                .iter()
                .filter(|(k, _)| keys.names_a_node(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<BTreeMap<_, _>>()
        })
        .filter(|values| !values.is_empty());
    let pinned_to = |values: &BTreeMap<String, String>| {
        values
            .get(HOSTNAME_LABEL)
            .or_else(|| values.values().next())
            .cloned()
            .unwrap_or_default()
    };
    if report.because.is_empty() {
        let kept: Vec<String> = report
            .kept
            .iter()
            .map(|k| format!("{}: {}", k.claim, k.why))
            .collect();
        anyhow::bail!(
            "nothing of ours holds pod {namespace}/{name}: the webhook pinned it to nothing and no claim of its own is bound to a node-local volume of a node that is not ready{}",
            if kept.is_empty() {
                String::new()
            } else {
                format!(" ({})", kept.join("; "))
            }
        );
    }
    report.pod_deleted = true;
    if dry_run {
        report.state = pinned_node.map(|values| {
            format!(
                "would make the state of {name} name node {} no more first, if it does, so that the pod created again is not pinned there",
                pinned_to(&values)
            )
        });
        return Ok(report);
    }
    if let (Some(values), Some(o)) = (&pinned_node, owner) {
        let owner = (o.api_version.as_str(), o.kind.as_str(), o.name.as_str());
        // Pinned by a value the state records (by any key that names a node), or by the name.
        let names = |state: &PodState| {
            values.iter().any(|(k, v)| {
                state.node_topology_labels.get(k.as_str()).map(|x| &**x) == Some(v.as_str())
                    || state.node_name.as_deref() == Some(v.as_str())
            })
        };
        let risk = "the pod created again would be pinned there again";
        match forget_released_node(client, namespace, owner, (name, &names), keys, risk).await {
            None => {}
            Some(Ok(said)) => report.state = Some(said),
            Some(Err(why)) => anyhow::bail!("pod {namespace}/{name} is not deleted: {why}"),
        }
    }
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    for c in report.claims.iter().filter(|c| !c.deleting) {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(c.uid.clone()),
                resource_version: c.resource_version.clone(),
            }),
            ..DeleteParams::default()
        };
        match claims.delete(&c.claim, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "deleting claim {} (changed since it was read? run release again)",
                        c.claim
                    )
                });
            }
        }
    }
    // With its claims deleted the pod cannot start anywhere: by uid alone (the StatefulSet
    // controller may even have deleted it already). Held by our pin only: as it was read.
    let resource_version = if report.claims.is_empty() {
        pod.resource_version()
    } else {
        None
    };
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid),
            resource_version,
        }),
        ..DeleteParams::default()
    };
    match pods.delete(name, &params).await {
        Ok(_) => {}
        // Its claims deleted, the pod gone or created again since (by uid alone, a conflict
        // is another pod of that name): released all the same.
        Err(kube::Error::Api(e))
            if (e.code == 404 || e.code == 409) && !report.claims.is_empty() => {}
        Err(e) => {
            let forgotten = report
                .state
                .as_deref()
                .map_or(String::new(), |said| format!("; {said}"));
            return Err(e).with_context(|| {
                format!(
                    "deleting pod {namespace}/{name} (changed since it was read? run release again){forgotten}"
                )
            });
        }
    }
    // Its data there gone, its state names that node no more, as the controller's release does.
    if let Some(o) = owner.filter(|_| !report.claims.is_empty()) {
        let owner = (o.api_version.as_str(), o.kind.as_str(), o.name.as_str());
        let claims = &report.claims;
        let names = |state: &PodState| {
            let recorded = state.node_name.as_deref().unwrap_or_default();
            let hostname = state.node_topology_labels.get(HOSTNAME_LABEL).map(|h| &**h);
            claims
                .iter()
                .any(|c| names_node(recorded, hostname, &c.node))
        };
        let risk =
            "a pod created again once that node is back is pinned there, away from its new claim";
        report.state = forget_released_node(client, namespace, owner, (name, &names), keys, risk)
            .await
            .map(|said| said.unwrap_or_else(|warning| format!("warning: {warning}")));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::Nodes;
    use serde_json::{Value, json};
    use std::time::Duration;

    struct Fleet(Vec<Arc<Node>>);

    impl Nodes for Fleet {
        fn visit_with_labels(
            &self,
            _labels: &BTreeMap<&str, &str>,
            _visit: &mut dyn FnMut(&Node) -> bool,
        ) -> bool {
            false
        }
        fn all(&self) -> Vec<Arc<Node>> {
            self.0.clone()
        }
    }

    fn node(name: &str, zone: &str) -> Arc<Node> {
        Arc::new(
            serde_json::from_value(
                json!({"metadata": {"name": name, "uid": format!("uid-{name}"),
                "labels": {HOSTNAME_LABEL: name, "topology.kubernetes.io/zone": zone}}}),
            )
            .expect("node"),
        )
    }

    fn fleet() -> Fleet {
        Fleet(vec![node("n1", "z1"), node("n2", "z1"), node("n3", "z2")])
    }

    fn pv(affinity: Value) -> PersistentVolume {
        serde_json::from_value(json!({"metadata": {"name": "pv-1"},
            "spec": {"nodeAffinity": affinity, "claimRef": {"name": "data-web-0", "uid": "claim-uid"}}}))
        .expect("pv")
    }

    fn terms(terms: Value) -> Value {
        json!({"required": {"nodeSelectorTerms": terms}})
    }

    #[test]
    fn a_volume_is_node_local_only_when_its_affinity_admits_one_node() {
        let host = |n: &str| json!({"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "In", "values": [n]}]});
        let by = |key: &str, n: &str| json!({"matchExpressions": [{"key": key, "operator": "In", "values": [n]}]});
        let cases: [(Value, Result<&str, &str>); 16] = [
            (terms(json!([host("n1")])), Ok("n1")),
            // a node-local driver's node key, the node known or deleted
            (
                terms(json!([by("topology.topolvm.io/node", "n2")])),
                Ok("n2"),
            ),
            (
                terms(json!([by("openebs.io/nodename", "gone")])),
                Ok("gone"),
            ),
            // OpenEBS LocalPV ZFS
            (terms(json!([by("openebs.io/nodeid", "n1")])), Ok("n1")),
            // the node named, and its zone as well
            (
                terms(
                    json!([{"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "In", "values": ["n3"]},
                        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z2"]}]}]),
                ),
                Ok("n3"),
            ),
            // a zonal volume where one known node alone carries the zone (n3 in z2) is not
            // node-local: any node joining z2 can mount it
            (
                terms(json!([by("topology.kubernetes.io/zone", "z2")])),
                Err("does not name one node"),
            ),
            // nor is a volume pinned by a rack or any other label
            (
                terms(json!([by("openebs.io/rack", "n1")])),
                Err("does not name one node"),
            ),
            (
                terms(
                    json!([{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n3"]}]}]),
                ),
                Ok("n3"),
            ),
            // the node was deleted: named alone by every term
            (terms(json!([host("gone"), host("gone")])), Ok("gone")),
            (
                terms(json!([by("topology.kubernetes.io/zone", "z1")])),
                Err("does not name one node"),
            ),
            // one term naming a node and another naming none
            (
                terms(json!([by("topology.kubernetes.io/zone", "z1"), host("n1")])),
                Err("does not name one node"),
            ),
            (Value::Null, Err("has no required node affinity")),
            (terms(json!([])), Err("has no required node affinity")),
            // garbage: an unknown operator matches nothing and names nothing
            (
                terms(
                    json!([{"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "Near", "values": ["n1"]}]}]),
                ),
                Err("does not name one node"),
            ),
            // two deleted nodes named: not one node's
            (
                terms(json!([host("gone"), host("other")])),
                Err("does not name one node"),
            ),
            // a term with no requirement matches nothing
            (terms(json!([{}])), Err("does not name one node")),
        ];
        for (affinity, want) in cases {
            let got = volume_node(&pv(affinity.clone()), &fleet(), &NodeKeys::default());
            match want {
                Ok(n) => assert_eq!(got.as_deref(), Ok(n), "{affinity}"),
                Err(why) => assert!(
                    got.as_ref().is_err_and(|e| e.contains(why)),
                    "{affinity}: {got:?}"
                ),
            }
        }
        // A hostname two known nodes carry (one mislabelled): not one node's.
        let mut twin = (*node("n4", "z1")).clone();
        twin.labels_mut().insert(HOSTNAME_LABEL.into(), "n1".into());
        let twins = Fleet(vec![node("n1", "z1"), Arc::new(twin)]);
        let got = volume_node(
            &pv(terms(json!([host("n1")]))),
            &twins,
            &NodeKeys::default(),
        );
        assert!(
            got.as_ref()
                .is_err_and(|e| e.contains("can be mounted on 2 nodes")),
            "{got:?}"
        );
    }

    #[test]
    fn a_released_state_names_no_node_and_keeps_the_rest() {
        let state: PodState = serde_json::from_value(json!({
            "nodeName": "n1", "nodeUID": "n1-uid", "podIPs": ["10.0.0.7"],
            "annotations": {"a": "b"}, "lastRestore": {"node": "kept", "ip": "kept"},
            "nodeTopologyLabels": {"kubernetes.io/hostname": "n1", "example.com/disk-node": "n1",
                "topology.kubernetes.io/zone": "z1", "topology.topolvm.io/node": "n1"}
        }))
        .expect("state");
        let keys = NodeKeys::with(&["example.com/disk-node".into()]);
        let kept_json = json!({"podIPs": ["10.0.0.7"], "annotations": {"a": "b"},
            "lastRestore": {"node": "kept", "ip": "kept"},
            "nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}});
        let forgotten = without_node(&state, &keys, None);
        assert_eq!(serde_json::to_value(&forgotten).expect("json"), kept_json);
        assert_eq!(
            without_node(&forgotten, &keys, None),
            forgotten,
            "once is enough"
        );
        assert_eq!(
            Forgotten::of(&state, &forgotten, &keys),
            Forgotten {
                node: Some("n1".into()),
                wider: vec![]
            }
        );
        // Its data's new node in the same zone keeps the zone; in another, not (a pod pinned
        // to z1 could never reach it), and what was forgotten says which.
        let labels = |host: &str, zone: &str| -> BTreeMap<String, String> {
            [
                (HOSTNAME_LABEL.to_owned(), host.to_owned()),
                ("topology.kubernetes.io/zone".to_owned(), zone.to_owned()),
            ]
            .into()
        };
        let (z1, z2) = (labels("n2", "z1"), labels("n2", "z2"));
        let on = |name, labels| Some(DataNode { name, labels });
        assert_eq!(without_node(&state, &keys, on("n2", &z1)), forgotten);
        let away = without_node(&state, &keys, on("n2", &z2));
        assert!(away.node_topology_labels.is_empty(), "{away:?}");
        assert_eq!(away.pod_ips, state.pod_ips);
        assert_eq!(
            Forgotten::of(&state, &away, &keys).wider,
            ["topology.kubernetes.io/zone=z1"]
        );
        // Its data on the very node the state names, relabeled into z2: that node stays named
        // (with the labels naming it that it still has), the zone goes.
        let mut relabeled = labels("n1", "z2");
        relabeled.insert("topology.topolvm.io/node".into(), "n1".into());
        let kept = without_node(&state, &keys, on("n1", &relabeled));
        assert_eq!(kept.node_name.as_deref(), Some("n1"));
        assert_eq!(kept.node_uid.as_deref(), Some("n1-uid"));
        let names: Vec<&str> = kept.node_topology_labels.keys().map(|k| &**k).collect();
        assert_eq!(names, [HOSTNAME_LABEL, "topology.topolvm.io/node"]);
        assert_eq!(
            Forgotten::of(&state, &kept, &keys),
            Forgotten {
                node: None,
                wider: vec!["topology.kubernetes.io/zone=z1".into()]
            }
        );
        // A state naming no node any more still forgets the zone its data's node lacks.
        assert!(
            without_node(&forgotten, &keys, on("n2", &z2))
                .node_topology_labels
                .is_empty()
        );
        // Without the operator's key, a label only a driver the operator names stays.
        let default = without_node(&state, &NodeKeys::default(), None);
        assert_eq!(
            default
                .node_topology_labels
                .get("example.com/disk-node")
                .map(|v| &**v),
            Some("n1")
        );

        // Applied as the API server applies it: only to the state as it was read.
        let patch = state_patch("web-0", &state, &forgotten).expect("patch");
        let mut status =
            json!({"status": {"podStates": {"web-0": &state, "web-1": {"nodeName": "n2"}}}});
        json_patch::patch(&mut status, &patch).expect("applies");
        assert_eq!(status["status"]["podStates"]["web-0"], kept_json);
        assert_eq!(
            status["status"]["podStates"]["web-1"],
            json!({"nodeName": "n2"})
        );
        let mut recorded_again = json!({"status": {"podStates": {"web-0": {"nodeName": "n3", "nodeTopologyLabels": {}}}}});
        let before = recorded_again.clone();
        assert!(json_patch::patch(&mut recorded_again, &patch).is_err());
        assert_eq!(
            recorded_again, before,
            "a state recorded again is left alone"
        );
    }

    #[test]
    fn a_drivers_node_key_names_one_node_once_the_operator_adds_it() {
        let by_driver = pv(terms(
            json!([{"matchExpressions": [{"key": "directpv.min.io/node", "operator": "In", "values": ["n2"]}]}]),
        ));
        let built_in = volume_node(&by_driver, &fleet(), &NodeKeys::default());
        assert!(
            built_in
                .as_ref()
                .is_err_and(|e| e.contains("does not name one node")),
            "{built_in:?}"
        );
        let keys = NodeKeys::with(&["directpv.min.io/node".to_owned(), HOSTNAME_LABEL.to_owned()]);
        // the driver's label on node n3 carries the value n2: the node that carries it counts
        let mut carrier = (*node("n3", "z2")).clone();
        carrier
            .labels_mut()
            .insert("directpv.min.io/node".into(), "n2".into());
        let carrying = Fleet(vec![node("n1", "z1"), node("n2", "z1"), Arc::new(carrier)]);
        assert_eq!(
            volume_node(&by_driver, &carrying, &keys).as_deref(),
            Ok("n3")
        );
        // the built-in keys stay, each once; a zone is still no node's
        assert_eq!(keys.list().matches(HOSTNAME_LABEL).count(), 1);
        let zonal = pv(terms(
            json!([{"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z2"]}]}]),
        ));
        assert!(volume_node(&zonal, &fleet(), &keys).is_err());
    }

    fn claim(name: &str, owners: Value, volume: Option<&str>) -> PersistentVolumeClaim {
        serde_json::from_value(json!({"metadata": {"name": name, "uid": "claim-uid",
            "ownerReferences": owners}, "spec": {"volumeName": volume}}))
        .expect("claim")
    }

    #[test]
    fn only_the_pods_own_bound_claims_on_a_local_volume_are_released() {
        let templates = ["data".to_owned(), "logs".to_owned()];
        let local = pv(terms(
            json!([{"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "In", "values": ["n1"]}]}]),
        ));
        let judge = |c: &PersistentVolumeClaim, v: Option<&PersistentVolume>| {
            judge_claim(
                c,
                v,
                ("web-0", "pod-uid"),
                &templates,
                "sts-uid",
                &fleet(),
                &NodeKeys::default(),
            )
        };
        let sts_owned = json!([{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "sts-uid"}]);
        let got = judge(
            &claim("data-web-0", sts_owned.clone(), Some("pv-1")),
            Some(&local),
        );
        assert_eq!(
            got,
            Ok(LocalClaim {
                claim: "data-web-0".into(),
                uid: "claim-uid".into(),
                resource_version: None,
                deleting: false,
                volume: "pv-1".into(),
                node: "n1".into(),
                node_known: true,
            })
        );
        let why = |r: Result<LocalClaim, Kept>| r.expect_err("kept").why;
        assert!(
            why(judge(
                &claim("cache-web-0", Value::Null, Some("pv-1")),
                Some(&local)
            ))
            .contains("not one of pod web-0's")
        );
        assert!(
            why(judge(
                &claim("data-web-1", Value::Null, Some("pv-1")),
                Some(&local)
            ))
            .contains("not one of pod web-0's")
        );
        let foreign = json!([{"apiVersion": "example.com/v1", "kind": "Backup", "name": "b", "uid": "other"}]);
        assert!(
            why(judge(
                &claim("data-web-0", foreign, Some("pv-1")),
                Some(&local)
            ))
            .contains("owned by Backup b")
        );
        assert!(why(judge(&claim("data-web-0", Value::Null, None), None)).contains("not bound"));
        let mut other_claims = local.clone();
        if let Some(spec) = other_claims.spec.as_mut() {
            spec.claim_ref = serde_json::from_value(json!({"name": "x", "uid": "x-uid"})).ok();
        }
        assert!(
            why(judge(
                &claim("data-web-0", Value::Null, Some("pv-1")),
                Some(&other_claims)
            ))
            .contains("not bound to claim")
        );
        let network = pv(Value::Null);
        assert!(
            why(judge(
                &claim("logs-web-0", Value::Null, Some("pv-1")),
                Some(&network)
            ))
            .contains("no required node affinity")
        );
    }

    fn pending(name: &str, node: Option<&str>) -> CachedPod {
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": "ns",
            "uid": format!("uid-{name}"), "resourceVersion": "5"},
            "spec": {"nodeName": node, "containers": []}, "status": {"phase": "Pending"}}))
        .expect("pod")
    }

    #[test]
    fn pods_wait_on_gone_nodes_when_deleted_replaced_or_lost_past_the_grace_period() {
        let not_ready = |name: &str, since: &str| -> Arc<Node> {
            Arc::new(
                serde_json::from_value(json!({"metadata": {"name": name, "uid": format!("uid-{name}")},
                "status": {"conditions": [{"type": "Ready", "status": "Unknown", "lastTransitionTime": since}]}}))
                .expect("node"),
            )
        };
        let now = k8s_openapi::jiff::Timestamp::now();
        let ago = |s: i64| {
            now.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(s))
                .expect("time")
                .to_string()
        };
        let nodes: BTreeMap<&str, Arc<Node>> = BTreeMap::from([
            ("lost", not_ready("lost", &ago(600))),
            ("brief", not_ready("brief", &ago(10))),
            ("fine", node("fine", "z1")),
            ("replaced", node("replaced", "z1")),
            // garbage: a Ready status that is no status, without a time, and a taint without
            // timeAdded: lost at once
            (
                "garbage",
                Arc::new(
                    serde_json::from_value(json!({"metadata": {"name": "garbage", "uid": "uid-garbage"},
                    "status": {"conditions": [{"type": "Ready", "status": "maybe"}]},
                    "spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}]}}))
                    .expect("node"),
                ),
            ),
        ]);
        let state = |node: &str, uid: &str| json!({"nodeName": node, "nodeUID": uid, "nodeTopologyLabels": {HOSTNAME_LABEL: node}});
        let status: PersistentPodStateStatus = serde_json::from_value(json!({"podStates": {
            "web-0": state("lost", "uid-lost"),
            "web-1": state("brief", "uid-brief"),
            "web-2": state("fine", "uid-fine"),
            "web-3": state("replaced", "uid-before"),
            "web-4": state("deleted", "uid-deleted"),
            "web-5": state("deleted", "uid-deleted"),
            "web-6": state("garbage", "uid-garbage"),
        }}))
        .expect("status");
        let pods = [
            pending("web-0", None),
            pending("web-1", None),
            pending("web-2", None),
            pending("web-3", None),
            pending("web-4", None),
            pending("web-5", Some("fine")),
            pending("web-6", None),
            pending("unrecorded", None),
        ];
        let refs: Vec<&CachedPod> = pods.iter().collect();
        let lookup = |name: &str| nodes.get(name).cloned();
        let health = Health::now(Duration::from_secs(300));
        let found: BTreeMap<String, DropReason> =
            waiting_on_gone_nodes(&refs, &status, &lookup, &health)
                .into_iter()
                .map(|w| (w.pod, w.reason))
                .collect();
        assert_eq!(
            found,
            BTreeMap::from([
                ("web-0".to_owned(), DropReason::NodeLost),
                ("web-3".to_owned(), DropReason::NodeGone),
                ("web-4".to_owned(), DropReason::NodeGone),
                ("web-6".to_owned(), DropReason::NodeLost),
            ]),
            "within the grace period (web-1), usable (web-2), scheduled (web-5) or unrecorded: not waiting"
        );
    }

    /// `release`'s word on the state: made to name the node no more in the PersistentPodState
    /// in force (the oldest not being deleted, as the webhook chooses), by name, else by its
    /// hostname label alone (said so, with the node's name).
    #[tokio::test]
    async fn release_forgets_the_node_in_the_persistent_pod_state_in_force() {
        use http::{Request, Response};
        use kube::client::Body;
        let pps = |name: &str, created: &str, deleting: bool, state: Value| {
            json!({"apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
                "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created,
                    "deletionTimestamp": deleting.then_some("2026-01-02T00:00:00Z"),
                    "finalizers": ["example.com/hold"]},
                "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}},
                "status": {"podStates": {"web-0": state}}})
        };
        let by_name = json!({"nodeName": "n1", "nodeTopologyLabels": {HOSTNAME_LABEL: "n1"}});
        let by_label = json!({"nodeTopologyLabels": {HOSTNAME_LABEL: "n1"}});
        for (state, said) in [
            (by_name, "names node n1 no more"),
            (by_label, "names node n1 no more"),
        ] {
            let list = json!({"apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodStateList",
                "metadata": {}, "items": [
                    pps("old", "2026-01-01T00:00:00Z", true, state.clone()),
                    pps("new", "2026-01-01T00:00:01Z", false, state.clone())]});
            let patched = pps("new", "2026-01-01T00:00:01Z", false, json!({}));
            let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let server = tokio::spawn(async move {
                let mut sent = Vec::new();
                for answer in [list, patched] {
                    let (request, respond) = handle.next_request().await.expect("a request");
                    sent.push(format!("{} {}", request.method(), request.uri().path()));
                    respond.send_response(crate::test_api::json_response(200, &answer));
                }
                sent
            });
            let client = Client::new(service, "ns");
            let names = |state: &PodState| {
                let hostname = state.node_topology_labels.get(HOSTNAME_LABEL).map(|h| &**h);
                names_node(
                    state.node_name.as_deref().unwrap_or_default(),
                    hostname,
                    "n1",
                )
            };
            let note = forget_released_node(
                &client,
                "ns",
                ("apps/v1", "StatefulSet", "web"),
                ("web-0", &names),
                &NodeKeys::default(),
                "a risk",
            )
            .await
            .expect("a word on the state")
            .expect("done");
            assert!(
                note.contains("PersistentPodState new") && note.contains(said),
                "{note}"
            );
            let sent = server.await.expect("mock API");
            assert_eq!(
                sent,
                [
                    "GET /apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates",
                    "PATCH /apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates/new/status"
                ]
            );
        }
    }
}
