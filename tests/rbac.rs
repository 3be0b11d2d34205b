//! The shipped RBAC, read as an operator's `kubectl apply` sends it.

use serde::Deserialize;
use serde_json::Value;

/// The aggregated ClusterRole carries no `rules`: the controller-manager fills them in, and a
/// manifest that set them (even to `[]`) would empty them on every re-apply, and the running
/// replicas would be refused until they were filled again.
#[test]
fn the_aggregated_cluster_role_leaves_its_rules_to_the_controller_manager() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/base/rbac.yaml");
    let text = std::fs::read_to_string(&path).expect("rbac.yaml");
    let role = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("yaml"))
        .find(|o| o["kind"] == "ClusterRole" && o["metadata"]["name"] == "persistent-pod-state")
        .expect("the aggregated ClusterRole");
    assert!(role["aggregationRule"]["clusterRoleSelectors"].is_array());
    assert!(role.get("rules").is_none(), "{role}");
}
