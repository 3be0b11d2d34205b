//! What the caches keep of each object: only the fields the code reads, so memory follows the
//! number of objects, not their size.

use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeStatus, Pod, PodSpec, PodStatus};
use kube::Resource;
use kube::api::DynamicObject;

/// Drops `managedFields` (often the largest part of an object, never read).
pub fn meta<K: Resource>(obj: &mut K) {
    obj.meta_mut().managed_fields = None;
}

/// Keeps of a pod only what recording and IP requests need: metadata, node name, phase,
/// conditions, IPs.
pub fn pod(pod: &mut Pod) {
    meta(pod);
    let node_name = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    pod.spec = Some(PodSpec {
        node_name,
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|s| PodStatus {
        phase: s.phase,
        conditions: s.conditions,
        pod_ip: s.pod_ip,
        pod_ips: s.pod_ips,
        ..PodStatus::default()
    });
}

/// Keeps of a node its name, labels, spec (taints, unschedulable) and the status and transition
/// time of its `Ready` condition: what placement reads.
pub fn node(node: &mut Node) {
    meta(node);
    node.metadata.annotations = None;
    node.status = node.status.take().map(|s| NodeStatus {
        conditions: s.conditions.map(|cs| {
            cs.into_iter()
                .filter(|c| c.type_ == "Ready")
                .map(|c| NodeCondition {
                    type_: c.type_,
                    status: c.status,
                    last_transition_time: c.last_transition_time,
                    ..NodeCondition::default()
                })
                .collect()
        }),
        ..NodeStatus::default()
    });
}

/// Keeps of a workload its metadata and the spec fields that decide its live ordinals.
pub fn workload(obj: &mut DynamicObject) {
    meta(obj);
    let spec = obj.data.get("spec").map(|spec| {
        let mut kept = serde_json::Map::new();
        for field in ["replicas", "ordinals", "reserveOrdinals"] {
            if let Some(v) = spec.get(field) {
                kept.insert(field.to_owned(), v.clone());
            }
        }
        serde_json::Value::Object(kept)
    });
    obj.data = serde_json::json!({ "spec": spec });
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keeps_what_recording_needs() {
        let mut p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "a-0", "managedFields": [{"manager": "x"}]},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 0}]}
        }))
        .expect("pod");
        pod(&mut p);
        assert!(p.metadata.managed_fields.is_none());
        let spec = p.spec.as_ref().expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert!(spec.containers.is_empty());
        let status = p.status.as_ref().expect("status");
        assert_eq!(status.pod_ip.as_deref(), Some("10.0.0.1"));
        assert!(status.container_statuses.is_none());
        assert_eq!(status.conditions.as_ref().map(Vec::len), Some(1));

        let mut w: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "a"},
            "spec": {"replicas": 3, "ordinals": {"start": 1}, "template": {"spec": {}}}
        }))
        .expect("workload");
        workload(&mut w);
        assert_eq!(
            w.data,
            json!({"spec": {"replicas": 3, "ordinals": {"start": 1}}})
        );
    }
}
