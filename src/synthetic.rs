//! The synthetic cluster the benchmarks share (feature `bench`): PersistentPodStates with
//! recorded states, nodes, and the AdmissionReview of a re-created StatefulSet pod (a realistic
//! pod, ~4 KB of JSON).

use serde_json::{Value, json};

/// Namespaces the PersistentPodStates are spread over.
pub const NAMESPACES: usize = 10;

/// PersistentPodState `i` (targeting StatefulSet `web-i` in `ns-(i % 10)`) with `states`
/// recorded pods, spread over `nodes` nodes.
pub fn pps(i: usize, states: usize, nodes: usize) -> Value {
    let pod_states: serde_json::Map<String, Value> = (0..states)
        .map(|k| {
            let node = (i * 7 + k) % nodes.max(1);
            (
                format!("web-{i}-{k}"),
                json!({"nodeName": format!("node-{node}"),
                       "nodeTopologyLabels": {"kubernetes.io/hostname": format!("node-{node}"),
                                              "topology.kubernetes.io/zone": format!("zone-{}", node % 3)},
                       "podIPs": [format!("10.{}.{}.{}", (i / 250) % 250, i % 250, k % 250 + 2)],
                       "podUID": format!("uid-{i}-{k}")}),
            )
        })
        .collect();
    json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
        "metadata": {"name": format!("web-{i}"), "namespace": format!("ns-{}", i % NAMESPACES),
                     "uid": format!("pps-{i}"), "resourceVersion": "1",
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": format!("web-{i}")},
                 "requiredPersistentTopology": {"keys": ["topology.kubernetes.io/zone"]},
                 "preferredPersistentTopology": [{"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}}]},
        "status": {"observedGeneration": 1, "podStates": pod_states}
    })
}

/// Node `j`: Ready, labelled with its hostname and one of 3 zones.
pub fn node(j: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": format!("node-{j}"), "labels": {
               "kubernetes.io/hostname": format!("node-{j}"),
               "topology.kubernetes.io/zone": format!("zone-{}", j % 3),
               "kubernetes.io/os": "linux"}},
           "status": {"conditions": [{"type": "Ready", "status": "True",
                                      "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})
}

/// The pod an Advanced StatefulSet (`apps.kruise.io/v1beta1`) `web-i` creates for ordinal 0.
pub fn kruise_pod(i: usize) -> Value {
    let mut pod = pod(i);
    pod["metadata"]["ownerReferences"][0]["apiVersion"] = json!("apps.kruise.io/v1beta1");
    pod
}

/// PersistentPodState `i` of [`pps`] for the Advanced StatefulSet `web-i`.
pub fn kruise_pps(i: usize, states: usize, nodes: usize) -> Value {
    let mut object = pps(i, states, nodes);
    object["spec"]["targetRef"]["apiVersion"] = json!("apps.kruise.io/v1beta1");
    object
}

/// The pod StatefulSet `web-i` creates for ordinal 0, as the API server sends it to a webhook.
pub fn pod(i: usize) -> Value {
    let ns = format!("ns-{}", i % NAMESPACES);
    let env: Vec<Value> = (0..12)
        .map(|e| json!({"name": format!("SETTING_{e}"), "value": format!("value-{e}-of-the-service")}))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("web-{i}-0"), "generateName": format!("web-{i}-"),
            "namespace": ns,
            "labels": {"app": format!("web-{i}"), "controller-revision-hash": format!("web-{i}-6d4cf56db6"),
                       "statefulset.kubernetes.io/pod-name": format!("web-{i}-0")},
            "annotations": {"io.kubernetes.cri/reserved-ip-duration": "10",
                            "prometheus.io/scrape": "true", "prometheus.io/port": "9090"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": format!("web-{i}"),
                                 "uid": format!("sts-{i}"), "controller": true, "blockOwnerDeletion": true}]},
        "spec": {
            "containers": [{
                "name": "server", "image": "registry.example.com/team/server:1.27.3",
                "args": ["--config=/etc/server/config.yaml", "--data=/var/lib/server"],
                "ports": [{"name": "client", "containerPort": 2379}, {"name": "peer", "containerPort": 2380}],
                "env": env,
                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                "volumeMounts": [{"name": "data", "mountPath": "/var/lib/server"},
                                 {"name": "config", "mountPath": "/etc/server"},
                                 {"name": "kube-api-access-x7k2p", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": 2379}, "periodSeconds": 5},
                "livenessProbe": {"tcpSocket": {"port": 2379}, "periodSeconds": 10},
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent"
            }],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": format!("data-web-{i}-0")}},
                        {"name": "config", "configMap": {"name": format!("web-{i}-config")}},
                        {"name": "kube-api-access-x7k2p", "projected": {"sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}],
            "hostname": format!("web-{i}-0"), "subdomain": format!("web-{i}"),
            "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default", "schedulerName": "default-scheduler",
            "securityContext": {"runAsNonRoot": true, "fsGroup": 1000},
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
            "priority": 0, "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority"
        },
        "status": {"phase": "Pending", "qosClass": "Burstable"}
    })
}

/// The AdmissionReview of pod `i`'s creation, as the API server sends it.
pub fn review(i: usize) -> Vec<u8> {
    review_of(pod(i), i)
}

/// The AdmissionReview of `pod`'s creation (the `i`th review: its uid).
pub fn review_of(pod: Value, i: usize) -> Vec<u8> {
    let ns = pod["metadata"]["namespace"].clone();
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": format!("705ab4f5-6393-11e8-b7cc-42010a80{i:04x}"),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"].clone(), "namespace": ns, "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:statefulset-controller",
                         "uid": "a5f2f0a1-0b8e-4c1f-9a61-2c5b0a7e1d20",
                         "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"]},
            "object": pod, "oldObject": null, "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    }))
    .expect("json")
}
