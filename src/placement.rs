//! Where a pod can go, pure: whether a node is usable (exists and is not lost), what the pod
//! itself demands of a node (its nodeSelector, required node affinity and taint tolerations),
//! and which recorded required values can be injected without stranding the pod.
//!
//! Rules for odd input (never a crash):
//! - a node without a `Ready` condition has not reported yet and is usable;
//! - a `Ready` status other than `True` (`False`, `Unknown` or anything else) counts as not
//!   ready; without a `lastTransitionTime` it has been so for an unknown time and the node is
//!   lost at once (dropping a pin is safe: the preferred part still steers the pod back);
//! - a `node.kubernetes.io/unreachable` or `not-ready` taint without `timeAdded` (the node
//!   lifecycle controller sets its NoSchedule taints so) dates from its twin of the same key
//!   that has one (the NoExecute taint), else from when the `Ready` condition stopped being
//!   `True`; with neither, it has been there for an unknown time and the node is lost at once;
//! - on a node whose `Ready` is `True`, such a taint with no date, or dated no later than
//!   `Ready` turned `True`, is left from before the node came back and does not count;
//! - a `node.kubernetes.io/out-of-service` taint (non-graceful node shutdown) makes a node lost
//!   at once, whatever its conditions;
//! - a node selector requirement with an unknown operator, or a `Gt`/`Lt` value that is not
//!   one integer, matches no node (as the scheduler does).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Taint, Toleration,
};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use crate::workload::PodView;

/// The label every node carries with its own name.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";
/// Taint of a node whose kubelet stopped reporting (node lifecycle controller).
pub const UNREACHABLE_TAINT: &str = "node.kubernetes.io/unreachable";
/// Taint of a node whose kubelet reports not ready.
pub const NOT_READY_TAINT: &str = "node.kubernetes.io/not-ready";
/// Taint of a cordoned node: maintenance, not loss.
pub const UNSCHEDULABLE_TAINT: &str = "node.kubernetes.io/unschedulable";
/// Taint an operator sets on a node that is shut down for good (non-graceful node shutdown).
pub const OUT_OF_SERVICE_TAINT: &str = "node.kubernetes.io/out-of-service";

/// How node loss is judged.
#[derive(Clone, Copy, Debug)]
pub struct Health {
    /// The time of the judgement.
    pub now: Timestamp,
    /// How long a node may be not ready (or carry an unreachable/not-ready taint) before it
    /// counts as lost.
    pub lost_after: Duration,
}

impl Health {
    /// Judged now, with `lost_after`.
    pub fn now(lost_after: Duration) -> Self {
        Self {
            now: Timestamp::now(),
            lost_after,
        }
    }

    /// When `node` is (or will be) lost: `None` while it is ready and untainted.
    pub fn lost_at(&self, node: &Node) -> Option<Timestamp> {
        let after = i64::try_from(self.lost_after.as_secs()).unwrap_or(i64::MAX);
        unhealthy_since(node).map(|since| {
            if since == Timestamp::MIN {
                // Not ready for an unknown time, or out of service: lost now.
                return Timestamp::MIN;
            }
            Timestamp::from_second(since.as_second().saturating_add(after))
                .unwrap_or(Timestamp::MAX)
        })
    }

    /// How long until `node`, unhealthy now, counts as lost, to the next whole second past it
    /// (when to look again at what its loss changes); `None` for a node healthy or lost
    /// already.
    pub fn until_lost(&self, node: &Node) -> Option<Duration> {
        let at = self.lost_at(node).filter(|at| *at > self.now)?;
        let secs = at.as_second().saturating_sub(self.now.as_second());
        Some(Duration::from_secs(u64::try_from(secs).unwrap_or(0) + 1))
    }

    /// Whether `node` is lost: not ready, or tainted unreachable/not-ready, for longer than
    /// `lost_after`, or tainted out-of-service. A cordoned node is not lost.
    pub fn is_lost(&self, node: &Node) -> bool {
        self.lost_at(node).is_some_and(|t| t <= self.now)
    }
}

/// Since when `node` has been unhealthy: not ready, or tainted unreachable or not-ready
/// (`Timestamp::MIN` for an unknown time, and when tainted out-of-service); `None` while it is
/// ready and untainted. Node loss is judged from this alone, so a change of a node's health
/// fields that leaves it unchanged (the node lifecycle controller's taints, added after the
/// `Ready` condition they follow) changes no judgement. On a node whose `Ready` is `True`, an
/// unreachable or not-ready taint with no date, or dated no later than `Ready` turned `True`
/// (left from before the node came back, until the node lifecycle controller takes it off, some
/// seconds later), does not count: the node is back, not lost since the taint.
pub fn unhealthy_since(node: &Node) -> Option<Timestamp> {
    let mut since: Option<Timestamp> = None;
    let mut earliest = |t: Timestamp| since = Some(since.map_or(t, |s| s.min(t)));
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    let ready_now = ready.is_some_and(|c| c.status == "True");
    // Ready since (`Some(None)`: ready, since when unknown).
    let ready_since = ready
        .filter(|c| c.status == "True")
        .map(|c| c.last_transition_time.as_ref().map(|t| t.0));
    // Not ready since (`Some(None)`: not ready, since when unknown).
    let not_ready_since = ready
        .filter(|c| c.status != "True")
        .map(|c| c.last_transition_time.as_ref().map(|t| t.0));
    if let Some(t) = not_ready_since {
        earliest(t.unwrap_or(Timestamp::MIN));
    }
    let taints = taints(node);
    for taint in taints {
        if taint.key == OUT_OF_SERVICE_TAINT {
            earliest(Timestamp::MIN);
        }
        if taint.key == UNREACHABLE_TAINT || taint.key == NOT_READY_TAINT {
            let added = |t: &Taint| t.time_added.as_ref().map(|t| t.0);
            let dated = added(taint)
                .or_else(|| {
                    taints
                        .iter()
                        .filter(|twin| twin.key == taint.key)
                        .find_map(added)
                })
                .or(not_ready_since.flatten());
            match dated {
                // From before the node came back.
                Some(t) if ready_since.is_some_and(|back| back.is_none_or(|b| t <= b)) => {}
                Some(t) => earliest(t),
                None if ready_now => {}
                None => earliest(Timestamp::MIN),
            }
        }
    }
    since
}

/// Whether `node` is cordoned (`spec.unschedulable`).
pub fn cordoned(node: &Node) -> bool {
    node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
}

/// Whether `node`, lost, is held for maintenance: cordoned and not tainted out-of-service. A
/// node cordoned and then shut down (a drain, a reboot, a disk replaced) may be down for longer
/// than the grace and come back with its disks: its node-local volumes are not released
/// while it is so (an operator says it is gone for good by deleting it or tainting it
/// out-of-service).
pub fn in_maintenance(node: &Node) -> bool {
    cordoned(node) && !taints(node).iter().any(|t| t.key == OUT_OF_SERVICE_TAINT)
}

fn taints(node: &Node) -> &[Taint] {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
}

/// What a pod itself demands of a node.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PodDemands<'a> {
    node_selector: Option<&'a BTreeMap<String, String>>,
    required: Option<&'a NodeSelector>,
    tolerations: &'a [Toleration],
    /// The node the pod names itself (`spec.nodeName`): it goes there, and nowhere else.
    node_name: Option<&'a str>,
    /// Whether every taint is taken as tolerated (the pod is not known).
    any_taint: bool,
}

impl<'a> PodDemands<'a> {
    /// The demands of `pod` as it is created.
    pub fn of(pod: impl Into<PodView<'a>>) -> Self {
        let spec = pod.into().spec.unwrap_or_default();
        Self {
            node_selector: spec.node_selector,
            required: spec.node_affinity.and_then(|na| {
                na.required_during_scheduling_ignored_during_execution
                    .as_ref()
            }),
            tolerations: spec.tolerations,
            node_name: spec.node_name.filter(|n| !n.is_empty()),
            any_taint: false,
        }
    }

    /// Nothing demanded, every taint tolerated: whether a node usable at all has the values
    /// (the controller's judgements, which do not know the pod's tolerations; the webhook
    /// judged those when it admitted the pod).
    pub fn none() -> Self {
        Self {
            any_taint: true,
            ..Self::default()
        }
    }

    /// Whether `node` meets them: the node the pod names itself, if any, the pod's
    /// nodeSelector, its required node affinity, and every NoSchedule/NoExecute taint
    /// tolerated. Taints of node health and cordoning are judged by [`Health`] instead (a
    /// cordoned node is waited for; a not-ready one only once lost).
    pub fn admit(&self, node: &Node) -> bool {
        if self
            .node_name
            .is_some_and(|n| node.metadata.name.as_deref() != Some(n))
        {
            return false;
        }
        let labels = node.labels();
        let selector_ok = self
            .node_selector
            .is_none_or(|sel| sel.iter().all(|(k, v)| labels.get(k) == Some(v)));
        let affinity_ok = self
            .required
            .is_none_or(|sel| selector_matches(sel, &node.name_any(), labels));
        selector_ok && affinity_ok && self.tolerates(taints(node))
    }

    /// At most how many values judging one node against these demands compares (each of the
    /// pod's selector entries, requirements and their values, and tolerations).
    pub fn weight(&self) -> usize {
        let required = self.required.map_or(0, |r| {
            r.node_selector_terms
                .iter()
                .flat_map(|t| {
                    let expressions = t.match_expressions.iter().flatten();
                    let fields = t.match_fields.iter().flatten();
                    expressions
                        .map(|e| e.values.as_ref().map_or(0, Vec::len))
                        .chain(fields.map(|f| f.values.as_ref().map_or(0, Vec::len)))
                        .map(|values| values + 1)
                })
                .sum::<usize>()
        });
        1 + self.node_selector.map_or(0, BTreeMap::len) + required + self.tolerations.len()
    }

    fn tolerates(&self, taints: &[Taint]) -> bool {
        // A pod that names its node is not scheduled: only the kubelet's NoExecute check holds.
        let judged = |t: &&Taint| self.node_name.is_none() || t.effect == "NoExecute";
        self.any_taint
            || judged_taints(taints)
                .filter(judged)
                .all(|t| self.tolerations.iter().any(|tol| tolerates(tol, t)))
    }
}

/// The taints of `node` a pod must tolerate to go there (NoSchedule and NoExecute), but those of
/// node health and cordoning, which [`Health`] judges.
pub fn scheduling_taints(node: &Node) -> impl Iterator<Item = &Taint> {
    judged_taints(taints(node))
}

fn judged_taints(taints: &[Taint]) -> impl Iterator<Item = &Taint> {
    taints
        .iter()
        .filter(|t| matches!(t.effect.as_str(), "NoSchedule" | "NoExecute"))
        .filter(|t| {
            ![UNREACHABLE_TAINT, NOT_READY_TAINT, UNSCHEDULABLE_TAINT].contains(&t.key.as_str())
        })
}

fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    let effect_ok = toleration
        .effect
        .as_deref()
        .is_none_or(|e| e.is_empty() || e == taint.effect);
    let key = toleration.key.as_deref().unwrap_or_default();
    let operator = toleration.operator.as_deref().unwrap_or("Equal");
    let key_ok = key == taint.key || (key.is_empty() && operator == "Exists");
    let value_ok = match operator {
        "Exists" => true,
        "Equal" => {
            toleration.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
        _ => false,
    };
    effect_ok && key_ok && value_ok
}

/// Whether a node (name and labels) matches a required node selector: any of its terms.
pub fn selector_matches(
    selector: &NodeSelector,
    name: &str,
    labels: &BTreeMap<String, String>,
) -> bool {
    selector
        .node_selector_terms
        .iter()
        .any(|term| term_matches(term, name, labels))
}

/// A term matches when it has at least one requirement and all of them hold.
fn term_matches(term: &NodeSelectorTerm, name: &str, labels: &BTreeMap<String, String>) -> bool {
    let expressions = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if expressions.is_empty() && fields.is_empty() {
        return false;
    }
    expressions
        .iter()
        .all(|r| requirement_holds(r, labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| {
            r.key == "metadata.name"
                && matches!(r.operator.as_str(), "In" | "NotIn")
                && requirement_holds(r, Some(name))
        })
}

fn requirement_holds(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    let compare = |ord: std::cmp::Ordering| match (value.and_then(number), values) {
        (Some(have), [want]) => number(want).is_some_and(|want| have.cmp(&want) == ord),
        _ => false,
    };
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => compare(std::cmp::Ordering::Greater),
        "Lt" => compare(std::cmp::Ordering::Less),
        _ => false,
    }
}

/// The nodes a placement decision looks at.
pub trait Nodes {
    /// Shows `visit` each node carrying every `key=value` of `labels` (a small set, from an
    /// index), until it returns true; returns whether it did.
    fn visit_with_labels(
        &self,
        labels: &BTreeMap<&str, &str>,
        visit: &mut dyn FnMut(&Node) -> bool,
    ) -> bool;
    /// Every node.
    fn all(&self) -> Vec<Arc<Node>>;
    /// The nodes seen deleted lately, as last seen (what names one of them, such as a local
    /// volume's affinity, still tells which); none known: empty.
    fn gone(&self) -> Vec<Arc<Node>> {
        Vec::new()
    }
}

/// Why recorded required values were left out.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum DropReason {
    /// No node carries them (node or zone decommissioned).
    NodeGone,
    /// The nodes carrying them are lost (not ready or unreachable for too long).
    NodeLost,
    /// The usable nodes carrying them do not meet the pod's own constraints.
    PodConstraints,
}

impl DropReason {
    /// A short explanation, for Events and logs.
    pub fn describe(self) -> &'static str {
        match self {
            Self::NodeGone => "no node has them",
            Self::NodeLost => "their node is lost (not ready or unreachable for too long)",
            Self::PodConstraints => "no usable node that has them meets the pod's own constraints",
        }
    }
}

/// Recorded required values left out, and why.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Dropped {
    /// The values left out.
    pub values: BTreeMap<String, String>,
    /// Why.
    pub reason: DropReason,
}

/// Which recorded required values can be injected: borrowed from what was recorded as
/// [`required`] answers (the webhook's case), or owned as [`required_owned`] answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Required<S = String> {
    /// Injected: some usable node meeting the pod's demands has them all.
    pub kept: BTreeMap<S, S>,
    /// Left out, if any.
    pub dropped: Option<Dropped>,
}

impl<S> Default for Required<S> {
    fn default() -> Self {
        Self {
            kept: BTreeMap::new(),
            dropped: None,
        }
    }
}

/// `values` as owned strings.
pub fn owned(values: &BTreeMap<&str, &str>) -> BTreeMap<String, String> {
    values
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// `values` borrowed.
pub fn borrowed(values: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    values
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// [`required`] for owned values, answered owned (for callers that keep the answer).
pub fn required_owned(
    recorded: &BTreeMap<String, String>,
    demands: &PodDemands<'_>,
    nodes: &dyn Nodes,
    health: &Health,
) -> Required {
    let placed = required(borrowed(recorded), demands, nodes, health);
    Required {
        kept: owned(&placed.kept),
        dropped: placed.dropped,
    }
}

/// How many values judging nodes against a pod's demands may compare in one decision (a few
/// milliseconds): a pod whose own constraints would cost more, judged on every node, is not
/// degraded to a subset of its values (see [`required`]).
pub const JUDGING_WORK: usize = 4_000_000;

/// Decides which of the `recorded` required values to inject: all of them when a usable node
/// meeting `demands` has them all (the usual case, answered from the label index); otherwise
/// the largest subset some such node has (ties: the subset holding the recorded hostname, the
/// pod's own node, working, where its data and IP are; then the subset more nodes have; then
/// key order), so a lost hostname degrades to its zone, and a node relabeled into another zone
/// keeps its pods. What is left out is reported with its reason.
/// Judging stops past [`JUDGING_WORK`] (a pod with huge constraints of its own, on a large
/// cluster): then every value not found usable by then is left out, injecting less, with the
/// reason known by then.
pub fn required<'a>(
    recorded: BTreeMap<&'a str, &'a str>,
    demands: &PodDemands<'_>,
    nodes: &dyn Nodes,
    health: &Health,
) -> Required<&'a str> {
    if recorded.is_empty() {
        return Required::default();
    }
    let usable = |n: &Node| !health.is_lost(n) && demands.admit(n);
    let weight = demands.weight();
    // The usual case: a carrier of every recorded value is usable (stops at the first).
    let (mut carriers, mut alive, mut over) = (0usize, false, false);
    let found = nodes.visit_with_labels(&recorded, &mut |n| {
        carriers += 1;
        if carriers.saturating_mul(weight) > JUDGING_WORK {
            over = true;
            return true;
        }
        let not_lost = !health.is_lost(n);
        alive |= not_lost;
        not_lost && demands.admit(n)
    });
    if found && !over {
        return Required {
            kept: recorded,
            dropped: None,
        };
    }
    // Judging stopped among the carriers: it is the pod's own constraints that cost too much.
    let reason = if carriers == 0 {
        DropReason::NodeGone
    } else if alive || over {
        DropReason::PodConstraints
    } else {
        DropReason::NodeLost
    };
    let all = nodes.all();
    if over || all.len().saturating_mul(weight) > JUDGING_WORK {
        return Required {
            kept: BTreeMap::new(),
            dropped: Some(Dropped {
                values: owned(&recorded),
                reason,
            }),
        };
    }
    // Degrade: the largest subset of the recorded values some usable node still has.
    let pairs: Vec<(&str, &str)> = recorded.iter().map(|(k, v)| (*k, *v)).collect();
    let host = pairs.iter().position(|(k, _)| *k == HOSTNAME_LABEL);
    let on_host = |m: &[bool]| host.is_some_and(|i| m.get(i).copied().unwrap_or(false));
    let mut subsets: HashMap<Vec<bool>, usize> = HashMap::new();
    for node in all.iter().filter(|n| usable(n)) {
        let labels = node.labels();
        let mask: Vec<bool> = pairs
            .iter()
            .map(|(k, v)| labels.get(*k).map(String::as_str) == Some(*v))
            .collect();
        *subsets.entry(mask).or_default() += 1;
    }
    let best = subsets
        .into_iter()
        .max_by(|(a, na), (b, nb)| {
            let count = |m: &[bool]| m.iter().filter(|x| **x).count();
            count(a)
                .cmp(&count(b))
                .then_with(|| on_host(a).cmp(&on_host(b)))
                .then(na.cmp(nb))
                // Earlier keys first: a mask holding an earlier key ranks higher.
                .then_with(|| a.cmp(b))
        })
        .map(|(mask, _)| mask)
        .unwrap_or_default();
    let mut kept = BTreeMap::new();
    let mut left = BTreeMap::new();
    for (i, (k, v)) in recorded.into_iter().enumerate() {
        let target = if best.get(i).copied().unwrap_or(false) {
            &mut kept
        } else {
            &mut left
        };
        target.insert(k, v);
    }
    Required {
        kept,
        dropped: Some(Dropped {
            values: owned(&left),
            reason,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::{Value, json};

    const HOST: &str = "kubernetes.io/hostname";
    const ZONE: &str = "topology.kubernetes.io/zone";
    const HOUR: Duration = Duration::from_secs(3600);

    fn at(text: &str) -> Timestamp {
        text.parse().expect("timestamp")
    }

    fn health() -> Health {
        Health {
            now: at("2026-11-22T12:00:00Z"),
            lost_after: Duration::from_secs(300),
        }
    }

    fn node(name: &str, zone: &str, extra: Value) -> Node {
        let mut v = json!({"metadata": {"name": name, "labels": {HOST: name, ZONE: zone, "rack": "r1", "gen": "5"}}});
        if let (Some(obj), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
            for (k, val) in extra {
                obj.insert(k.clone(), val.clone());
            }
        }
        serde_json::from_value(v).expect("node")
    }

    fn ready(status: &str, since: Option<&str>) -> Value {
        json!({"status": {"conditions": [{"type": "Ready", "status": status, "lastTransitionTime": since}]}})
    }

    fn tainted(key: &str, effect: &str, added: Option<&str>) -> Value {
        json!({"spec": {"taints": [{"key": key, "effect": effect, "timeAdded": added}]}})
    }

    #[test]
    fn how_long_until_a_node_counts_as_lost_to_the_next_whole_second() {
        let h = health();
        let until = |extra: Value| h.until_lost(&node("n", "z", extra));
        // Not ready for a minute of the five: lost in four, looked at one second past it.
        assert_eq!(
            until(ready("False", Some("2026-11-22T11:59:00Z"))),
            Some(Duration::from_secs(241))
        );
        // Healthy, lost already (exactly now, long ago, out of service): nothing to wait for.
        for extra in [
            ready("True", Some("2026-11-22T11:00:00Z")),
            ready("False", Some("2026-11-22T11:55:00Z")),
            ready("False", Some("2026-11-22T11:00:00Z")),
            tainted(OUT_OF_SERVICE_TAINT, "NoExecute", None),
        ] {
            assert_eq!(until(extra.clone()), None, "{extra}");
        }
    }

    #[test]
    fn a_node_is_lost_only_after_lost_after_and_never_for_being_cordoned() {
        let h = health();
        let cases = [
            ("no Ready condition yet", json!({}), false),
            ("ready", ready("True", Some("2026-11-22T11:00:00Z")), false),
            (
                "not ready for an hour",
                ready("False", Some("2026-11-22T11:00:00Z")),
                true,
            ),
            (
                "unknown for an hour",
                ready("Unknown", Some("2026-11-22T11:00:00Z")),
                true,
            ),
            (
                "not ready for a minute",
                ready("False", Some("2026-11-22T11:59:00Z")),
                false,
            ),
            ("garbage status, no time", ready("Maybe", None), true),
            (
                "unreachable for an hour",
                tainted(UNREACHABLE_TAINT, "NoExecute", Some("2026-11-22T11:00:00Z")),
                true,
            ),
            (
                "not-ready taint for a minute",
                tainted(NOT_READY_TAINT, "NoSchedule", Some("2026-11-22T11:59:00Z")),
                false,
            ),
            (
                "unreachable taint, no time",
                tainted(UNREACHABLE_TAINT, "NoSchedule", None),
                true,
            ),
            (
                "cordoned",
                json!({"spec": {"unschedulable": true, "taints": [{"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}]}}),
                false,
            ),
            (
                "out of service, ready",
                json!({"spec": {"taints": [{"key": OUT_OF_SERVICE_TAINT, "value": "nodeshutdown", "effect": "NoExecute"}]},
                       "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-22T11:00:00Z"}]}}),
                true,
            ),
            (
                "a garbage taint",
                json!({"spec": {"taints": [{"key": "", "effect": "Whatever"}]}}),
                false,
            ),
        ];
        for (what, extra, lost) in cases {
            assert_eq!(h.is_lost(&node("n", "z", extra)), lost, "{what}");
        }

        // As the node lifecycle controller taints an unreachable node: the NoSchedule taint
        // without timeAdded, its NoExecute twin with one, Ready Unknown since the same moment.
        let unreachable = |since: &str| {
            json!({"spec": {"taints": [
                    {"key": UNREACHABLE_TAINT, "effect": "NoSchedule"},
                    {"key": UNREACHABLE_TAINT, "effect": "NoExecute", "timeAdded": since}]},
                   "status": {"conditions": [{"type": "Ready", "status": "Unknown", "lastTransitionTime": since}]}})
        };
        assert!(
            !h.is_lost(&node("n", "z", unreachable("2026-11-22T11:59:59Z"))),
            "a second ago: within the grace period"
        );
        assert_eq!(
            h.lost_at(&node("n", "z", unreachable("2026-11-22T11:59:59Z"))),
            Some(at("2026-11-22T12:04:59Z"))
        );
        assert!(h.is_lost(&node("n", "z", unreachable("2026-11-22T11:00:00Z"))));
        // Back: Ready True again while the undated NoSchedule taint is still on (the node
        // lifecycle controller takes it off next): not lost, and not unhealthy at all.
        let back = json!({"spec": {"taints": [{"key": UNREACHABLE_TAINT, "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-22T11:59:59Z"}]}});
        assert!(!h.is_lost(&node("n", "z", back.clone())));
        assert_eq!(unhealthy_since(&node("n", "z", back)), None);
        // Back with the dated NoExecute twin still on, unreachable for an hour before: the
        // taints are left from before it came back (they come off some seconds later): not
        // lost, and not unhealthy at all.
        let back_dated = |ready_since: &str| {
            json!({"spec": {"taints": [
                {"key": UNREACHABLE_TAINT, "effect": "NoSchedule"},
                {"key": UNREACHABLE_TAINT, "effect": "NoExecute", "timeAdded": "2026-11-22T11:00:00Z"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": ready_since}]}})
        };
        for back_at in ["2026-11-22T11:59:59Z", "2026-11-22T11:00:00Z"] {
            let back = node("n", "z", back_dated(back_at));
            assert!(!h.is_lost(&back), "back at {back_at}");
            assert_eq!(unhealthy_since(&back), None, "back at {back_at}");
        }
        // Tainted after Ready last turned True (no kubelet said it is back since): judged by
        // the taint's date.
        let tainted_since = node("n", "z", back_dated("2026-11-22T10:59:59Z"));
        assert!(h.is_lost(&tainted_since));
        assert_eq!(
            unhealthy_since(&tainted_since),
            Some(at("2026-11-22T11:00:00Z"))
        );
        // Only the NoSchedule taint, Ready False since a minute: dated by the condition.
        let not_ready = json!({"spec": {"taints": [{"key": NOT_READY_TAINT, "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "2026-11-22T11:59:00Z"}]}});
        assert!(!h.is_lost(&node("n", "z", not_ready)));
        let later = Health {
            lost_after: HOUR * 2,
            ..h
        };
        assert!(!later.is_lost(&node(
            "n",
            "z",
            ready("False", Some("2026-11-22T11:00:00Z"))
        )));
        assert_eq!(
            later.lost_at(&node(
                "n",
                "z",
                ready("False", Some("2026-11-22T11:00:00Z"))
            )),
            Some(at("2026-11-22T13:00:00Z"))
        );
    }

    fn pod(spec: Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).expect("pod")
    }

    fn affinity(terms: Value) -> Value {
        json!({"containers": [], "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}})
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> Value {
        json!({"key": key, "operator": op, "values": values})
    }

    #[test]
    fn pod_demands_follow_the_schedulers_rules() {
        let n1 = node("n1", "a", json!({}));
        let cases = [
            ("nothing", json!({"containers": []}), true),
            (
                "bound to it (nodeName)",
                json!({"containers": [], "nodeName": "n1"}),
                true,
            ),
            (
                "bound to another node (nodeName): never scheduled, so never here",
                json!({"containers": [], "nodeName": "n2"}),
                false,
            ),
            (
                "own selector met",
                json!({"containers": [], "nodeSelector": {ZONE: "a"}}),
                true,
            ),
            (
                "own selector not met",
                json!({"containers": [], "nodeSelector": {ZONE: "b"}}),
                false,
            ),
            (
                "In",
                affinity(json!([{"matchExpressions": [expr(ZONE, "In", &["a", "b"])]}])),
                true,
            ),
            (
                "NotIn",
                affinity(json!([{"matchExpressions": [expr(ZONE, "NotIn", &["a"])]}])),
                false,
            ),
            (
                "NotIn an absent key",
                affinity(json!([{"matchExpressions": [expr("x", "NotIn", &["a"])]}])),
                true,
            ),
            (
                "Exists",
                affinity(json!([{"matchExpressions": [expr("rack", "Exists", &[])]}])),
                true,
            ),
            (
                "DoesNotExist",
                affinity(json!([{"matchExpressions": [expr("rack", "DoesNotExist", &[])]}])),
                false,
            ),
            (
                "Gt",
                affinity(json!([{"matchExpressions": [expr("gen", "Gt", &["4"])]}])),
                true,
            ),
            (
                "Lt",
                affinity(json!([{"matchExpressions": [expr("gen", "Lt", &["4"])]}])),
                false,
            ),
            (
                "Gt not a number",
                affinity(json!([{"matchExpressions": [expr("gen", "Gt", &["x"])]}])),
                false,
            ),
            (
                "unknown operator",
                affinity(json!([{"matchExpressions": [expr("gen", "Near", &["5"])]}])),
                false,
            ),
            (
                "terms are ORed",
                affinity(
                    json!([{"matchExpressions": [expr(ZONE, "In", &["b"])]}, {"matchExpressions": [expr(ZONE, "In", &["a"])]}]),
                ),
                true,
            ),
            (
                "an empty term matches nothing",
                affinity(json!([{}])),
                false,
            ),
            (
                "matchFields on the name",
                affinity(json!([{"matchFields": [expr("metadata.name", "In", &["n1"])]}])),
                true,
            ),
            (
                "matchFields NotIn the name",
                affinity(json!([{"matchFields": [expr("metadata.name", "NotIn", &["n1"])]}])),
                false,
            ),
            (
                "matchFields on another field",
                affinity(json!([{"matchFields": [expr("spec.x", "In", &["n1"])]}])),
                false,
            ),
        ];
        for (what, spec, admitted) in cases {
            let p = pod(spec);
            assert_eq!(PodDemands::of(&p).admit(&n1), admitted, "{what}");
        }
    }

    #[test]
    fn untolerated_taints_exclude_a_node_but_health_and_cordon_taints_do_not() {
        let taint = |key: &str, effect: &str| json!({"spec": {"taints": [{"key": key, "value": "v", "effect": effect}]}});
        let tol = |t: Value| pod(json!({"containers": [], "tolerations": [t]}));
        let none = pod(json!({"containers": []}));
        let cases = [
            ("NoSchedule", taint("dedicated", "NoSchedule"), &none, false),
            ("NoExecute", taint("dedicated", "NoExecute"), &none, false),
            (
                "PreferNoSchedule",
                taint("dedicated", "PreferNoSchedule"),
                &none,
                true,
            ),
            (
                "cordoned",
                taint(UNSCHEDULABLE_TAINT, "NoSchedule"),
                &none,
                true,
            ),
            (
                "unreachable (judged by health)",
                taint(UNREACHABLE_TAINT, "NoExecute"),
                &none,
                true,
            ),
        ];
        for (what, extra, p, admitted) in cases {
            assert_eq!(
                PodDemands::of(p).admit(&node("n", "a", extra)),
                admitted,
                "{what}"
            );
        }
        // A pod that names its node is not scheduled: the kubelet refuses it only for a
        // NoExecute taint it does not tolerate.
        let bound = pod(json!({"containers": [], "nodeName": "n"}));
        for (effect, admitted) in [("NoSchedule", true), ("NoExecute", false)] {
            let tainted = node("n", "a", taint("dedicated", effect));
            assert_eq!(PodDemands::of(&bound).admit(&tainted), admitted, "{effect}");
        }
        let tainted = node("n", "a", taint("dedicated", "NoSchedule"));
        for (what, t, admitted) in [
            (
                "Equal",
                json!({"key": "dedicated", "operator": "Equal", "value": "v"}),
                true,
            ),
            (
                "Equal, other value",
                json!({"key": "dedicated", "value": "w"}),
                false,
            ),
            (
                "Exists",
                json!({"key": "dedicated", "operator": "Exists"}),
                true,
            ),
            ("everything", json!({"operator": "Exists"}), true),
            (
                "other effect",
                json!({"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}),
                false,
            ),
        ] {
            assert_eq!(PodDemands::of(&tol(t)).admit(&tainted), admitted, "{what}");
        }
    }

    struct Fleet(Vec<Arc<Node>>);

    impl Nodes for Fleet {
        fn visit_with_labels(
            &self,
            labels: &BTreeMap<&str, &str>,
            visit: &mut dyn FnMut(&Node) -> bool,
        ) -> bool {
            self.0
                .iter()
                .filter(|n| {
                    labels
                        .iter()
                        .all(|(k, v)| n.labels().get(*k).map(String::as_str) == Some(*v))
                })
                .any(|n| visit(n))
        }
        fn all(&self) -> Vec<Arc<Node>> {
            self.0.clone()
        }
    }

    fn recorded(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn required_values_degrade_per_key_and_say_why() {
        let lost = ready("Unknown", Some("2026-11-22T11:00:00Z"));
        let fleet = Fleet(vec![
            Arc::new(node("a1", "a", lost.clone())),
            Arc::new(node("a2", "a", json!({}))),
            Arc::new(node("b1", "b", json!({}))),
            Arc::new(node("c1", "c", lost)),
        ]);
        let h = health();
        let free = pod(json!({"containers": []}));
        let not_a = pod(affinity(
            json!([{"matchExpressions": [expr(ZONE, "NotIn", &["a"])]}]),
        ));
        let choose = |pairs: &[(&str, &str)], p: &Pod| {
            let values = recorded(pairs);
            required_owned(&values, &PodDemands::of(p), &fleet, &h)
        };
        let dropped = |pairs: &[(&str, &str)], reason| {
            Some(Dropped {
                values: recorded(pairs),
                reason,
            })
        };

        let all_kept = choose(&[(HOST, "a2"), (ZONE, "a")], &free);
        assert_eq!(
            (all_kept.kept, all_kept.dropped),
            (recorded(&[(HOST, "a2"), (ZONE, "a")]), None)
        );

        let host_lost = choose(&[(HOST, "a1"), (ZONE, "a")], &free);
        assert_eq!(
            host_lost.kept,
            recorded(&[(ZONE, "a")]),
            "the zone stays required"
        );
        assert_eq!(
            host_lost.dropped,
            dropped(&[(HOST, "a1")], DropReason::NodeLost)
        );

        let zone_lost = choose(&[(ZONE, "c")], &free);
        assert_eq!(
            (zone_lost.kept, zone_lost.dropped),
            (
                BTreeMap::new(),
                dropped(&[(ZONE, "c")], DropReason::NodeLost)
            )
        );

        let gone = choose(&[(HOST, "z9"), (ZONE, "b")], &free);
        assert_eq!(gone.kept, recorded(&[(ZONE, "b")]));
        assert_eq!(gone.dropped, dropped(&[(HOST, "z9")], DropReason::NodeGone));

        let excluded = choose(&[(HOST, "a2"), (ZONE, "a")], &not_a);
        assert_eq!(excluded.kept, BTreeMap::new(), "the pod excludes zone a");
        assert_eq!(
            excluded.dropped,
            dropped(&[(HOST, "a2"), (ZONE, "a")], DropReason::PodConstraints)
        );

        let nothing = choose(&[], &free);
        assert_eq!(nothing, Required::default());
    }

    /// The recorded node works but was relabeled into another zone, where fewer nodes are
    /// than in the recorded zone: the pod goes back to its node (its data, its IP), not to the
    /// old zone's other nodes. With the node lost, the zone is kept.
    #[test]
    fn a_working_node_relabeled_into_another_zone_keeps_its_pods() {
        let fleet = |host_lost: bool| {
            let health = if host_lost {
                ready("Unknown", Some("2026-11-22T11:00:00Z"))
            } else {
                json!({})
            };
            Fleet(vec![
                Arc::new(node("n1", "z2", health)),
                Arc::new(node("n2", "z1", json!({}))),
                Arc::new(node("n3", "z1", json!({}))),
            ])
        };
        let values = recorded(&[(HOST, "n1"), (ZONE, "z1")]);
        let free = pod(json!({"containers": []}));
        let h = health();
        let works = required_owned(&values, &PodDemands::of(&free), &fleet(false), &h);
        assert_eq!(works.kept, recorded(&[(HOST, "n1")]), "back to its node");
        assert_eq!(
            works.dropped.map(|d| d.values),
            Some(recorded(&[(ZONE, "z1")]))
        );
        let lost = required_owned(&values, &PodDemands::of(&free), &fleet(true), &h);
        assert_eq!(lost.kept, recorded(&[(ZONE, "z1")]), "its zone");
    }

    #[test]
    fn a_pod_too_costly_to_judge_on_every_node_is_not_degraded_but_left_without_the_values() {
        // 400 nodes in zone b, the recorded host gone: degrading judges every node.
        let fleet = Fleet(
            (0..400)
                .map(|i| Arc::new(node(&format!("b{i}"), "b", json!({}))))
                .collect(),
        );
        let h = health();
        let values = recorded(&[(HOST, "gone"), (ZONE, "b")]);
        // The pod's own affinity admits every node, with a value list of its own.
        let admitting = |count: usize| {
            let mut listed: Vec<String> = (0..count).map(|i| format!("x{i}")).collect();
            listed.push("b".to_owned());
            let listed: Vec<&str> = listed.iter().map(String::as_str).collect();
            pod(affinity(
                json!([{"matchExpressions": [expr(ZONE, "In", &listed)]}]),
            ))
        };
        let small = required_owned(&values, &PodDemands::of(&admitting(10)), &fleet, &h);
        assert_eq!(small.kept, recorded(&[(ZONE, "b")]), "degraded to the zone");
        // 400 nodes x over 10,000 values: past the work bound, so nothing required is kept.
        let huge = admitting(JUDGING_WORK / 400);
        let placed = required_owned(&values, &PodDemands::of(&huge), &fleet, &h);
        assert_eq!(placed.kept, BTreeMap::new());
        assert_eq!(
            placed.dropped,
            Some(Dropped {
                values,
                reason: DropReason::NodeGone
            })
        );
        // The zone alone recorded, its first 300 carriers lost: judging stops among them, so
        // what stopped it is the pod's own constraints, not the zone being lost.
        let lost = ready("Unknown", Some("2026-11-22T11:00:00Z"));
        let mixed = Fleet(
            (0..400)
                .map(|i| {
                    let health = if i < 300 { lost.clone() } else { json!({}) };
                    Arc::new(node(&format!("b{i}"), "b", health))
                })
                .collect(),
        );
        let zone = recorded(&[(ZONE, "b")]);
        let heavy = admitting(JUDGING_WORK / 200);
        let placed = required_owned(&zone, &PodDemands::of(&heavy), &mixed, &h);
        assert_eq!(
            (placed.kept, placed.dropped),
            (
                BTreeMap::new(),
                Some(Dropped {
                    values: zone,
                    reason: DropReason::PodConstraints
                })
            )
        );
    }
}
