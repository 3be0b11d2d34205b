//! The admission decision for a pod, pure: from the request, the pod and what the caches know,
//! whether the pod is left alone (and why), unreadable, or gets an injection. The handler in
//! [`super::mutate_pod`] only turns the outcome into metrics, Events and the response.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Affinity, NodeAffinity, Pod, PodSpec, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;
use serde::Deserialize;

use super::inject::{Injection, injection_for};
use super::review::{AdmissionRequest, json_error_summary};
use crate::api::PersistentPodState;
use crate::ip_request::{self, IP_REQUEST_ANNOTATION, IpDecision};
use crate::metrics::SkipReason;
use crate::placement::{self, Health, Nodes, PodDemands};
use crate::workload::{GroupKind, WorkloadRef, pod_workload};

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

/// An injection decided for a pod.
#[derive(Debug)]
pub struct Decision {
    /// The PersistentPodState whose recorded state is injected.
    pub pps: Arc<PersistentPodState>,
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// What is injected, and what was left out.
    pub injection: Injection,
    /// Whether the recorded IPs are requested, and if not why.
    pub ip: IpDecision,
}

/// The outcome of one pod admission.
#[derive(Debug)]
pub enum Outcome {
    /// Allowed untouched.
    Skip(SkipReason),
    /// The review's object is not a readable Pod: allowed untouched, reported.
    Invalid(String),
    /// A recorded state applies.
    Inject(Box<Decision>),
}

/// The metadata the decision reads.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReadMeta {
    name: Option<String>,
    generate_name: Option<String>,
    namespace: Option<String>,
    annotations: Option<BTreeMap<String, String>>,
    owner_references: Option<Vec<OwnerReference>>,
}

/// The affinity the decision reads: node affinity (the rest is only noticed as present).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReadAffinity {
    node_affinity: Option<NodeAffinity>,
}

/// The spec fields the decision reads: what the pod demands of a node.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReadSpec {
    node_selector: Option<BTreeMap<String, String>>,
    affinity: Option<ReadAffinity>,
    tolerations: Option<Vec<Toleration>>,
}

#[derive(Deserialize)]
struct ReadPod {
    metadata: Option<ReadMeta>,
    spec: Option<ReadSpec>,
}

/// Decodes of a pod only what the decision reads (metadata naming it and its owner, its
/// annotations, and its node selector, node affinity and tolerations), skipping the rest of
/// the object (containers, volumes, managed fields) without building it: the decode is most of
/// an admission's cost. The patch only adds to what the pod has, so nothing skipped is lost.
pub fn decode_pod(object: &str) -> Result<Pod, serde_json::Error> {
    let read: ReadPod = serde_json::from_str(object)?;
    let metadata = read
        .metadata
        .map_or_else(ObjectMeta::default, |m| ObjectMeta {
            name: m.name,
            generate_name: m.generate_name,
            namespace: m.namespace,
            annotations: m.annotations,
            owner_references: m.owner_references,
            ..ObjectMeta::default()
        });
    Ok(Pod {
        metadata,
        spec: read.spec.map(|s| PodSpec {
            node_selector: s.node_selector,
            affinity: s.affinity.map(|a| Affinity {
                node_affinity: a.node_affinity,
                ..Affinity::default()
            }),
            tolerations: s.tolerations,
            ..PodSpec::default()
        }),
        status: None,
    })
}

/// Decides what happens to the pod in `request` (decoded from the request body, once).
pub fn admit(request: &AdmissionRequest, lookup: &dyn Lookup) -> Outcome {
    if !request.kind.is("", "Pod")
        || request.operation != "CREATE"
        || request.sub_resource.is_some()
    {
        return Outcome::Skip(SkipReason::NotPodCreate);
    }
    let pod = match request.object().map(decode_pod) {
        Some(Ok(pod)) => pod,
        Some(Err(e)) => return Outcome::Invalid(json_error_summary(&e)),
        None => return Outcome::Invalid("the request carries no object".into()),
    };
    let namespace = request
        .namespace
        .clone()
        .or_else(|| pod.metadata.namespace.clone())
        .unwrap_or_default();
    // A pod created with generateName has no name in the object; the request may carry it.
    let name = pod
        .metadata
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| request.name.clone());

    let Some(workload) = pod_workload(&pod, &namespace) else {
        return Outcome::Skip(SkipReason::NoController);
    };
    if !lookup.handles(&workload.kind) {
        return Outcome::Skip(SkipReason::NotStatefulSet);
    }
    let Some(pps) = lookup.pps_for(&workload) else {
        return Outcome::Skip(SkipReason::NoPersistentPodState);
    };
    let Some(state) = pps.status.as_ref().and_then(|s| s.pod_states.get(&name)) else {
        return Outcome::Skip(SkipReason::NoState);
    };
    let pps_name = pps.metadata.name.as_deref().unwrap_or_default();
    let (demands, health) = (PodDemands::of(&pod), lookup.health());
    let place = |recorded: &BTreeMap<String, String>| {
        placement::required(recorded, &demands, lookup.nodes(), &health)
    };
    let holder = |ip: &str| lookup.ip_holder(ip, &namespace, &name);
    let ip = ip_request::decide(
        pps.annotations()
            .get(IP_REQUEST_ANNOTATION)
            .map(String::as_str),
        &pod,
        &state.pod_ips,
        &holder,
    );
    let request = match &ip {
        IpDecision::Request { annotation, value } => Some((annotation.as_str(), value.as_str())),
        _ => None,
    };
    let injection = injection_for(&pod, pps_name, &pps.spec, state, &place, request);
    Outcome::Inject(Box::new(Decision {
        pps: pps.clone(),
        namespace,
        pod: name,
        injection,
        ip,
    }))
}

#[cfg(test)]
mod tests {
    use super::super::review::parse;
    use super::*;
    use k8s_openapi::api::core::v1::Node;
    use serde_json::{Value, json};

    struct Fake {
        pps: Option<Arc<PersistentPodState>>,
        nodes: bool,
    }

    impl Nodes for Fake {
        fn visit_with_labels(
            &self,
            labels: &BTreeMap<String, String>,
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

    /// A parsed request for `object` (absent when `None`).
    fn request(
        kind: &str,
        operation: &str,
        sub: Option<&str>,
        object: Option<Value>,
    ) -> AdmissionRequest {
        let body = serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u", "kind": {"group": "", "version": "v1", "kind": kind},
                "resource": {"group": "", "version": "v1", "resource": "pods"}, "subResource": sub,
                "operation": operation, "userInfo": {}, "namespace": "ns", "name": "web-0",
                "object": object}
        }))
        .expect("json");
        parse(body.into()).expect("request")
    }

    fn pod(owner_kind: &str) -> Value {
        json!({"metadata": {"name": "web-0", "ownerReferences": [{"apiVersion": "apps/v1",
            "kind": owner_kind, "name": "web", "uid": "u", "controller": true}]},
            "spec": {"containers": [{"name": "c"}]}})
    }

    fn pps(states: Value) -> Arc<PersistentPodState> {
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

    fn skipped(outcome: Outcome) -> Option<SkipReason> {
        match outcome {
            Outcome::Skip(r) => Some(r),
            _ => None,
        }
    }

    #[test]
    fn decides_skip_invalid_or_inject() {
        let state = json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"}}});
        let with = Fake {
            pps: Some(pps(state)),
            nodes: true,
        };
        let create = |object: Option<Value>| request("Pod", "CREATE", None, object);
        let cases = [
            (
                request("Pod", "UPDATE", None, Some(pod("StatefulSet"))),
                SkipReason::NotPodCreate,
            ),
            (
                request("Pod", "CREATE", Some("binding"), Some(pod("StatefulSet"))),
                SkipReason::NotPodCreate,
            ),
            (
                request("Service", "CREATE", None, Some(pod("StatefulSet"))),
                SkipReason::NotPodCreate,
            ),
            (
                create(Some(json!({"metadata": {"name": "web-0"}}))),
                SkipReason::NoController,
            ),
            (create(Some(pod("ReplicaSet"))), SkipReason::NotStatefulSet),
        ];
        for (req, want) in cases {
            assert_eq!(skipped(admit(&req, &with)), Some(want));
        }
        let without = Fake {
            pps: None,
            nodes: true,
        };
        assert_eq!(
            skipped(admit(&create(Some(pod("StatefulSet"))), &without)),
            Some(SkipReason::NoPersistentPodState)
        );
        let no_state = Fake {
            pps: Some(pps(json!({}))),
            nodes: true,
        };
        assert_eq!(
            skipped(admit(&create(Some(pod("StatefulSet"))), &no_state)),
            Some(SkipReason::NoState)
        );
        assert!(matches!(
            admit(&create(Some(json!({"spec": []}))), &with),
            Outcome::Invalid(_)
        ));
        assert!(matches!(admit(&create(None), &with), Outcome::Invalid(_)));
        let Outcome::Inject(decision) = admit(&create(Some(pod("StatefulSet"))), &with) else {
            panic!("injects")
        };
        assert_eq!(
            (decision.namespace.as_str(), decision.pod.as_str()),
            ("ns", "web-0")
        );
        assert_eq!(decision.injection.required, 1);
    }

    #[test]
    fn the_request_name_stands_in_for_a_generated_name() {
        let state = json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"}}});
        let lookup = Fake {
            pps: Some(pps(state)),
            nodes: false,
        };
        let mut object = pod("StatefulSet");
        object["metadata"]["name"] = json!("");
        let Outcome::Inject(decision) =
            admit(&request("Pod", "CREATE", None, Some(object)), &lookup)
        else {
            panic!("injects")
        };
        assert_eq!(decision.pod, "web-0");
        assert!(decision.injection.dropped.is_some(), "no node has zone=z1");
    }

    #[test]
    fn the_partial_decode_injects_exactly_what_the_full_pod_would() {
        let pps: PersistentPodState = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns", "annotations": {
                "persistent-pod-state.io/ip-request": "calico"}},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                     "requiredPersistentTopology": {"keys": ["zone"]},
                     "preferredPersistentTopology": [{"weight": 50, "preference": {"keys": ["host"]}}],
                     "persistentPodAnnotations": [{"key": "a"}]}
        }))
        .expect("pps");
        let state: crate::api::PodState = serde_json::from_value(json!({
            "nodeName": "n1", "nodeTopologyLabels": {"zone": "z1", "host": "n1"},
            "annotations": {"a": "1"}, "podIPs": ["10.0.0.1"]}))
        .expect("state");
        let owner = json!([{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "u", "controller": true}]);
        let pods = [
            json!({"metadata": {"name": "web-0", "ownerReferences": owner}, "spec": {"containers": [{"name": "c"}]}}),
            json!({"metadata": {"name": "web-0", "ownerReferences": owner, "annotations": {"a": "0"},
                    "managedFields": [{"manager": "m", "fieldsV1": {"f:spec": {}}}]},
                   "spec": {"nodeSelector": {"zone": "z2", "disk": "ssd"},
                            "tolerations": [{"key": "t", "operator": "Exists"}],
                            "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}},
                            "containers": [{"name": "c", "env": [{"name": "X", "value": "y"}]}],
                            "volumes": [{"name": "v", "emptyDir": {}}]}}),
            json!({"metadata": {"name": "web-0", "ownerReferences": owner},
                   "spec": {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                       {"weight": 1, "preference": {"matchExpressions": [{"key": "k", "operator": "Exists"}]}}],
                       "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                           {"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["z9"]}]}]}}}}}),
            json!({"metadata": {"name": "web-0", "ownerReferences": owner}}),
            json!({"metadata": {"name": "web-0", "ownerReferences": owner}, "spec": {"affinity": {}}}),
        ];
        let keep = |recorded: &BTreeMap<String, String>| placement::Required {
            kept: recorded.clone(),
            dropped: None,
        };
        for object in pods {
            let full: Pod = serde_json::from_value(object.clone()).expect("full pod");
            let partial = decode_pod(&object.to_string()).expect("partial pod");
            assert_eq!(PodDemands::of(&full), PodDemands::of(&partial));
            assert_eq!(pod_workload(&full, "ns"), pod_workload(&partial, "ns"));
            let request = Some(("cni.projectcalico.org/ipAddrs", "[\"10.0.0.1\"]"));
            let inject =
                |pod: &Pod| injection_for(pod, "web", &pps.spec, &state, &keep, request).patch;
            assert_eq!(inject(&full), inject(&partial), "{object}");
        }
    }
}
