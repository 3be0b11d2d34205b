//! The admission decision for a pod, pure and free of the wire format: from a pod being created,
//! its namespace and what the caches know, whether it is left alone (and why) or steered back
//! by a recorded state, and what of that state it does not get (and why). The pod webhook
//! (`mutate_pod.rs`), `explain` and the controller's reports all describe a decision
//! through [`Decision::left_out`] and [`LeftOut`].

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use serde::Serialize;

use super::inject::{Conflict, Injection, injection_for};
use crate::api::PersistentPodState;
use crate::api::ip_request::{IP_REQUEST_ANNOTATION, IpRequest};
use crate::ip_request::{self, IpDecision, IpSkipReason};
use crate::placement::{self, Dropped, Health, Nodes, PodDemands};
use crate::state::Caches;
use crate::workload::{CustomKinds, GroupKind, PodView, WorkloadRef};

/// Why a pod was let through without a patch.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum SkipReason {
    /// Not a Pod CREATE without subresource.
    NotPodCreate,
    /// No controller ownerReference.
    NoController,
    /// The controller is not a handled StatefulSet-like kind.
    NotStatefulSet,
    /// No PersistentPodState targets the workload.
    NoPersistentPodState,
    /// No state is recorded for the pod's name.
    NoState,
}

/// What the decision reads from the caches.
pub trait Lookup {
    /// The nodes a placement is checked against.
    fn nodes(&self) -> &dyn Nodes;
    /// Whether pods controlled by `kind` are handled (StatefulSets and configured kinds).
    fn handles(&self, kind: &GroupKind) -> bool;
    /// The PersistentPodState that targets `workload`.
    fn pps_for(&self, workload: &WorkloadRef) -> Option<Arc<PersistentPodState>>;
    /// How node loss is judged now.
    fn health(&self) -> Health;
    /// A live pod other than `namespace/name` that holds `ip`, as `namespace/name`.
    fn ip_holder(&self, ip: &str, namespace: &str, name: &str) -> Option<String>;
}

/// Which workload kinds' pods are handled.
#[derive(Clone, Copy)]
pub enum Kinds<'a> {
    /// StatefulSets and the configured custom kinds (the server).
    Configured(&'a CustomKinds),
    /// Any kind a PersistentPodState targets (`explain`, which does not know the server's
    /// configuration).
    Any,
}

/// IPs this server has just asked the CNI for, for pods its cache does not show yet: until
/// the cache shows the pod holding the IP (its IP index speaks for it from then on), or
/// [`IpReservations::HOLD`] has passed, another pod is not sent them, so two reviews back to
/// back never ask for one IP.
#[derive(Debug, Default)]
pub struct IpReservations(Mutex<HashMap<String, (String, Instant)>>);

impl IpReservations {
    /// How long a reservation holds at most: far longer than the cache takes to see a created
    /// pod, and short, so that a pod created and deleted meanwhile does not keep its IP from
    /// another for long.
    pub const HOLD: Duration = Duration::from_secs(5);

    /// The pod (`namespace/name`) other than `who` that reserved `ip`, if any.
    pub fn holder(&self, ip: &str, who: &str, caches: &Caches) -> Option<String> {
        let mut reserved = crate::sync::lock(&self.0);
        current(&mut reserved, caches);
        reserved
            .get(&normalized(ip))
            .filter(|(by, _)| by != who)
            .map(|(by, _)| by.clone())
    }

    /// Reserves `ips` for `who` (`namespace/name`), unless another pod holds a reservation of
    /// one of them: then nothing is reserved, and that pod is returned.
    pub fn reserve(&self, ips: &[String], who: &str, caches: &Caches) -> Result<(), String> {
        let mut reserved = crate::sync::lock(&self.0);
        current(&mut reserved, caches);
        let ips: Vec<String> = ips.iter().map(|ip| normalized(ip)).collect();
        if let Some((by, _)) = ips
            .iter()
            .filter_map(|ip| reserved.get(ip))
            .find(|(by, _)| by != who)
        {
            return Err(by.clone());
        }
        for ip in ips {
            reserved.insert(ip, (who.to_owned(), Instant::now()));
        }
        Ok(())
    }
}

/// Drops the reservations past [`IpReservations::HOLD`] and those of pods `caches` shows
/// holding their IP.
fn current(reserved: &mut HashMap<String, (String, Instant)>, caches: &Caches) {
    reserved.retain(|ip, (by, at)| {
        at.elapsed() < IpReservations::HOLD && !shown_holding(caches, ip, by)
    });
}

/// Whether `caches` shows the pod `who` (`namespace/name`) holding `ip`.
fn shown_holding(caches: &Caches, ip: &str, who: &str) -> bool {
    who.split_once('/')
        .is_some_and(|(namespace, name)| caches.ip_held_by(ip, namespace, name))
}

/// `ip` as its parsed form prints (as status IPs are written), or as given.
fn normalized(ip: &str) -> String {
    ip.trim()
        .parse::<IpAddr>()
        .map_or_else(|_| ip.to_owned(), |ip| ip.to_string())
}

/// The decision's view of the shared caches: the one [`Lookup`] the server and `explain` use.
pub struct CacheLookup<'a> {
    /// The caches.
    pub caches: &'a Caches,
    /// Which kinds are handled.
    pub kinds: Kinds<'a>,
    /// How long a node may be not ready before it counts as lost.
    pub node_lost_after: Duration,
    /// IPs just asked for, not in the cache yet (the server's; `explain` has none).
    pub reservations: Option<&'a IpReservations>,
}

impl Lookup for CacheLookup<'_> {
    fn nodes(&self) -> &dyn Nodes {
        self.caches
    }

    fn handles(&self, kind: &GroupKind) -> bool {
        match self.kinds {
            Kinds::Configured(kinds) => kinds.handles(kind),
            Kinds::Any => true,
        }
    }

    fn pps_for(&self, workload: &WorkloadRef) -> Option<Arc<PersistentPodState>> {
        self.caches.pps_for(workload)
    }

    fn health(&self) -> Health {
        Health::now(self.node_lost_after)
    }

    fn ip_holder(&self, ip: &str, namespace: &str, name: &str) -> Option<String> {
        self.caches.ip_holder(ip, namespace, name).or_else(|| {
            self.reservations?
                .holder(ip, &format!("{namespace}/{name}"), self.caches)
        })
    }
}

/// What happens to a pod being created, with what the decision found on the way.
#[derive(Debug)]
pub struct Decision {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The workload that controls the pod, if any.
    pub workload: Option<WorkloadRef>,
    /// The PersistentPodState in force for that workload, if any.
    pub pps: Option<Arc<PersistentPodState>>,
    /// Left alone, or steered.
    pub verdict: Verdict,
}

/// Whether a pod is left alone or steered back.
#[derive(Debug)]
pub enum Verdict {
    /// Allowed untouched, and why.
    Skip(SkipReason),
    /// A recorded state applies.
    Inject {
        /// What is injected, and what was left out.
        injection: Box<Injection>,
        /// Whether the recorded IPs are requested, and if not why.
        ip: IpDecision,
    },
}

/// Which part of a recorded state a [`LeftOut`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Part {
    /// A required value, left out so the pod is not stranded.
    Required,
    /// A required value the pod sets otherwise itself.
    Conflict,
    /// The request for the recorded IPs.
    IpRequest,
}

/// One part of a recorded state a pod does not get, and why: the one description the webhook's
/// Events, `explain` and the controller's reports share.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LeftOut {
    /// Which part.
    #[serde(skip)]
    pub part: Part,
    /// What, e.g. `required kubernetes.io/hostname=node-a1` or `IP request`.
    pub what: String,
    /// Why.
    pub why: String,
}

impl LeftOut {
    /// The required values of `dropped`, one each.
    pub fn required(dropped: &Dropped) -> impl Iterator<Item = Self> + '_ {
        dropped.values.iter().map(|(k, v)| Self {
            part: Part::Required,
            what: format!("required {k}={v}"),
            why: dropped.reason.describe().to_owned(),
        })
    }

    /// A recorded required value the pod sets otherwise.
    pub fn conflict(c: &Conflict) -> Self {
        Self {
            part: Part::Conflict,
            what: format!("required {}={}", c.key, c.recorded_value),
            why: format!(
                "conflicts with the pod's own nodeSelector {}={}",
                c.key, c.pod_value
            ),
        }
    }

    /// The IP request, not made for `reason` (`detail` says what exactly).
    pub fn ip_request(reason: IpSkipReason, detail: &str) -> Self {
        let why = if detail.is_empty() {
            reason.describe().to_owned()
        } else {
            format!("{} ({detail})", reason.describe())
        };
        Self {
            part: Part::IpRequest,
            what: "IP request".into(),
            why,
        }
    }

    /// `items` as one line: `what: why; what: why`.
    pub fn list(items: &[Self]) -> String {
        items
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    }
}

impl fmt::Display for LeftOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.why)
    }
}

impl Decision {
    /// What of the recorded state the pod does not get, and why (nothing when left alone).
    pub fn left_out(&self) -> Vec<LeftOut> {
        let Verdict::Inject { injection, ip } = &self.verdict else {
            return Vec::new();
        };
        let mut out: Vec<LeftOut> = injection
            .dropped
            .iter()
            .flat_map(LeftOut::required)
            .collect();
        out.extend(injection.conflicts.iter().map(LeftOut::conflict));
        if let IpDecision::Skip { reason, detail } = ip {
            out.push(LeftOut::ip_request(*reason, detail));
        }
        out
    }
}

/// Decides what happens to `pod`, being created in `namespace` (its name set, from the request
/// when the pod has only a `generateName`).
pub fn decide<'a>(pod: impl Into<PodView<'a>>, namespace: &str, lookup: &dyn Lookup) -> Decision {
    decide_view(pod.into(), namespace, lookup)
}

fn decide_view(pod: PodView<'_>, namespace: &str, lookup: &dyn Lookup) -> Decision {
    let name = pod.name.unwrap_or_default().to_owned();
    let workload = pod.workload(namespace);
    let (pps, verdict) = match &workload {
        None => (None, Verdict::Skip(SkipReason::NoController)),
        Some(workload) => judge(pod, namespace, &name, workload, lookup),
    };
    Decision {
        namespace: namespace.to_owned(),
        pod: name,
        workload,
        pps,
        verdict,
    }
}

/// The PersistentPodState in force for pod `name`, controlled by `workload`, and what it gets.
fn judge(
    pod: PodView<'_>,
    namespace: &str,
    name: &str,
    workload: &WorkloadRef,
    lookup: &dyn Lookup,
) -> (Option<Arc<PersistentPodState>>, Verdict) {
    if !lookup.handles(&workload.kind) {
        return (None, Verdict::Skip(SkipReason::NotStatefulSet));
    }
    let Some(pps) = lookup.pps_for(workload) else {
        return (None, Verdict::Skip(SkipReason::NoPersistentPodState));
    };
    let Some(state) = pps.status.as_ref().and_then(|s| s.pod_states.get(name)) else {
        return (Some(pps), Verdict::Skip(SkipReason::NoState));
    };
    let pps_name = pps.metadata.name.as_deref().unwrap_or_default();
    let (demands, health) = (PodDemands::of(pod), lookup.health());
    let holder = |ip: &str| lookup.ip_holder(ip, namespace, name);
    let ip = ip_request::decide(
        pps.annotations()
            .get(IP_REQUEST_ANNOTATION)
            .map(String::as_str),
        pod,
        &state.pod_ips,
        &holder,
    );
    // Not made (an IP held by another pod, none recorded, ...): the request's key is not
    // restored from the persisted annotations either.
    let withheld = match &ip {
        IpDecision::Skip { .. } => pps
            .annotations()
            .get(IP_REQUEST_ANNOTATION)
            .and_then(|r| IpRequest::parse(r).ok()),
        _ => None,
    };
    let request = match &ip {
        IpDecision::Request { annotation, value } => {
            Some((annotation.as_str(), Some(value.as_str())))
        }
        _ => withheld.as_ref().map(|r| (r.annotation(), None)),
    };
    let injection = injection_for(
        pod,
        pps_name,
        &pps.spec,
        state,
        &|recorded| placement::required(recorded, &demands, lookup.nodes(), &health),
        request,
    );
    let verdict = Verdict::Inject {
        injection: Box::new(injection),
        ip,
    };
    (Some(pps), verdict)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Node, Pod};
    use serde_json::{Value, json};
    use std::collections::BTreeMap;

    #[test]
    fn an_ip_reservation_holds_until_the_cache_shows_its_pod_holding_the_ip() {
        let reservations = IpReservations::default();
        let empty = Caches::new();
        let ip = "10.0.0.5".to_string();
        assert_eq!(
            reservations.reserve(std::slice::from_ref(&ip), "ns/a", &empty),
            Ok(())
        );
        assert_eq!(
            reservations.holder(&ip, "ns/b", &empty).as_deref(),
            Some("ns/a"),
            "another pod is not sent it"
        );
        assert_eq!(reservations.holder(&ip, "ns/a", &empty), None, "its own");
        assert_eq!(
            reservations.reserve(std::slice::from_ref(&ip), "ns/b", &empty),
            Err("ns/a".to_string())
        );
        // The cache shows ns/a holding it: the IP index speaks for it, and the reservation goes.
        let caches = Caches::new();
        caches.apply_pod(kube::runtime::watcher::Event::Apply(
            serde_json::from_value(json!({"metadata": {"name": "a", "namespace": "ns"},
                "status": {"podIPs": [{"ip": "10.0.0.5"}]}}))
            .expect("pod"),
        ));
        assert!(shown_holding(&caches, &ip, "ns/a"));
        assert!(!shown_holding(&caches, &ip, "ns/b"));
        assert!(!shown_holding(&caches, "10.0.0.6", "ns/a"));
        assert!(!shown_holding(&caches, &ip, "no-slash"));
        assert_eq!(reservations.holder(&ip, "ns/b", &caches), None);
        assert_eq!(
            reservations.holder(&ip, "ns/b", &empty),
            None,
            "dropped, not only hidden"
        );
        assert_eq!(
            reservations.reserve(std::slice::from_ref(&ip), "ns/b", &empty),
            Ok(())
        );
    }

    /// A lookup over one PersistentPodState (or none) and one node `n1` with any labels asked
    /// for (or no node).
    pub struct Fake {
        pub pps: Option<Arc<PersistentPodState>>,
        pub nodes: bool,
    }

    impl Nodes for Fake {
        fn visit_with_labels(
            &self,
            labels: &BTreeMap<&str, &str>,
            visit: &mut dyn FnMut(&Node) -> bool,
        ) -> bool {
            let node: Node =
                serde_json::from_value(json!({"metadata": {"name": "n1", "labels": labels}}))
                    .expect("node");
            self.nodes && visit(&node)
        }
        fn all(&self) -> Vec<Arc<Node>> {
            Vec::new()
        }
    }

    impl Lookup for Fake {
        fn nodes(&self) -> &dyn Nodes {
            self
        }
        fn handles(&self, kind: &GroupKind) -> bool {
            kind.is_statefulset()
        }
        fn pps_for(&self, _: &WorkloadRef) -> Option<Arc<PersistentPodState>> {
            self.pps.clone()
        }
        fn health(&self) -> Health {
            Health::now(std::time::Duration::from_secs(300))
        }
        fn ip_holder(&self, _: &str, _: &str, _: &str) -> Option<String> {
            None
        }
    }

    fn pod(owner_kind: Option<&str>) -> Pod {
        let owners = owner_kind.map(|kind| {
            json!([{"apiVersion": "apps/v1", "kind": kind, "name": "web", "uid": "u", "controller": true}])
        });
        serde_json::from_value(
            json!({"metadata": {"name": "web-0", "ownerReferences": owners},
            "spec": {"containers": [{"name": "c"}]}}),
        )
        .expect("pod")
    }

    /// The PersistentPodState `web` (requiring `zone`) with `states`.
    pub fn pps(states: Value) -> Arc<PersistentPodState> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
                "metadata": {"name": "web", "namespace": "ns"},
                "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                         "requiredPersistentTopology": {"keys": ["zone"]}},
                "status": {"observedGeneration": 1, "podStates": states}
            }))
            .expect("pps"),
        )
    }

    fn skipped(decision: &Decision) -> Option<SkipReason> {
        match decision.verdict {
            Verdict::Skip(r) => Some(r),
            Verdict::Inject { .. } => None,
        }
    }

    #[test]
    fn decides_skip_or_inject() {
        let state = json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"}}});
        let with = Fake {
            pps: Some(pps(state)),
            nodes: true,
        };
        assert_eq!(
            skipped(&decide(&pod(None), "ns", &with)),
            Some(SkipReason::NoController)
        );
        assert_eq!(
            skipped(&decide(&pod(Some("ReplicaSet")), "ns", &with)),
            Some(SkipReason::NotStatefulSet)
        );
        let without = Fake {
            pps: None,
            nodes: true,
        };
        assert_eq!(
            skipped(&decide(&pod(Some("StatefulSet")), "ns", &without)),
            Some(SkipReason::NoPersistentPodState)
        );
        let no_state = Fake {
            pps: Some(pps(json!({}))),
            nodes: true,
        };
        let decision = decide(&pod(Some("StatefulSet")), "ns", &no_state);
        assert_eq!(skipped(&decision), Some(SkipReason::NoState));
        assert!(decision.pps.is_some(), "the PPS in force is known");
        let decision = decide(&pod(Some("StatefulSet")), "ns", &with);
        assert_eq!(
            (decision.namespace.as_str(), decision.pod.as_str()),
            ("ns", "web-0")
        );
        let Verdict::Inject { injection, .. } = &decision.verdict else {
            panic!("injects")
        };
        assert_eq!(injection.required, 1);
        assert!(decision.left_out().is_empty());
    }

    /// A recorded IP the request leaves out (another pod holds it) is not asked for through a
    /// persisted annotation of the request's key either; made, the request carries its value.
    #[test]
    fn a_persisted_annotation_never_asks_for_an_ip_the_request_left_out() {
        const CALICO: &str = "cni.projectcalico.org/ipAddrs";
        struct Held(Fake, bool);
        impl Lookup for Held {
            fn nodes(&self) -> &dyn Nodes {
                &self.0
            }
            fn handles(&self, kind: &GroupKind) -> bool {
                self.0.handles(kind)
            }
            fn pps_for(&self, workload: &WorkloadRef) -> Option<Arc<PersistentPodState>> {
                self.0.pps_for(workload)
            }
            fn health(&self) -> Health {
                self.0.health()
            }
            fn ip_holder(&self, _: &str, _: &str, _: &str) -> Option<String> {
                self.1.then(|| "ns/other-0".to_owned())
            }
        }
        let pps: PersistentPodState = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns", "annotations": {
                "persistent-pod-state.io/ip-request": "calico"}},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                     "persistentPodAnnotations": [{"key": CALICO}, {"key": "slot"}]},
            "status": {"podStates": {"web-0": {"nodeName": "n1", "podIPs": ["10.0.0.5"],
                "annotations": {CALICO: "[\"10.0.0.5\"]", "slot": "a"}}}}
        }))
        .expect("pps");
        let pps = Arc::new(pps);
        let annotations = |held: bool| {
            let lookup = Held(
                Fake {
                    pps: Some(pps.clone()),
                    nodes: true,
                },
                held,
            );
            let decision = decide(&pod(Some("StatefulSet")), "ns", &lookup);
            let Verdict::Inject { injection, ip } = &decision.verdict else {
                panic!("injects")
            };
            let held_so = matches!(
                ip,
                IpDecision::Skip {
                    reason: IpSkipReason::IpHeld,
                    ..
                }
            );
            assert_eq!(held_so, held, "{ip:?}");
            let patch = injection.patch.to_value();
            let added = patch
                .as_array()
                .and_then(|ops| {
                    ops.iter()
                        .find(|op| op["path"] == "/metadata/annotations")
                        .map(|op| op["value"].clone())
                })
                .expect("annotations added");
            (added.get(CALICO).cloned(), added["slot"].clone())
        };
        assert_eq!(annotations(true), (None, json!("a")), "held: not asked for");
        assert_eq!(
            annotations(false),
            (Some(json!("[\"10.0.0.5\"]")), json!("a")),
            "free: requested"
        );
    }

    #[test]
    fn what_is_left_out_is_described_once() {
        let pps: PersistentPodState = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns", "annotations": {
                "persistent-pod-state.io/ip-request": "calico"}},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                     "requiredPersistentTopology": {"keys": ["zone", "disk"]}},
            "status": {"podStates": {"web-0": {"nodeName": "n1",
                "nodeTopologyLabels": {"zone": "z1", "disk": "ssd"}}}}
        }))
        .expect("pps");
        let lookup = Fake {
            pps: Some(Arc::new(pps)),
            nodes: false,
        };
        let mut pod = pod(Some("StatefulSet"));
        if let Some(spec) = pod.spec.as_mut() {
            spec.node_selector = Some(BTreeMap::from([("disk".into(), "hdd".into())]));
        }
        let left_out = decide(&pod, "ns", &lookup).left_out();
        let described: Vec<String> = left_out.iter().map(ToString::to_string).collect();
        assert_eq!(
            described,
            [
                "required zone=z1: no node has them",
                "required disk=ssd: conflicts with the pod's own nodeSelector disk=hdd",
                "IP request: no IP is recorded for it",
            ]
        );
        assert_eq!(
            left_out.iter().map(|l| l.part).collect::<Vec<_>>(),
            [Part::Required, Part::Conflict, Part::IpRequest]
        );
    }
}
