//! What Kubernetes v1.20 could not run, on the current control plane (issue 17.3): the API
//! server's own evaluation of the pod webhook's matchConditions, a native StatefulSet with a
//! start ordinal and a claim retention policy on node-local volumes, native sidecars, and
//! scheduling gates.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, ReplicaSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use persistent_pod_state::api::{
    AUTO_GENERATE_ANNOTATION, INJECTED_ANNOTATION, PREFERRED_TOPOLOGY_ANNOTATION,
    REQUIRED_TOPOLOGY_ANNOTATION,
};
use serde_json::{Value, json};

use crate::support::*;

async fn create<K>(c: &Client, ns: &str, object: Value) -> K
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned,
    K::DynamicType: Default,
{
    let object: K = serde_json::from_value(object).expect("object");
    Api::<K>::namespaced(c.clone(), ns)
        .create(&PostParams::default(), &object)
        .await
        .expect("create")
}

/// The pods in `ns` whose label `app` is `app`, once there are `count` of them.
async fn pods_of(c: &Client, ns: &str, app: &str, count: usize) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(c.clone(), ns);
    wait_for(
        &format!("{count} pod(s) of {app} in {ns}"),
        TIMEOUT,
        || async {
            let list = pods
                .list(&ListParams::default().labels(&format!("app={app}")))
                .await
                .ok()?;
            (list.items.len() == count).then_some(list.items)
        },
    )
    .await
}

fn template(app: &str, restart: &str) -> Value {
    json!({"metadata": {"labels": {"app": app}},
           "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "c", "image": "cilium/echoserver:latest"}]}})
}

/// The API server evaluates the base's matchConditions: pods of a ReplicaSet, a DaemonSet, a
/// Job and a bare pod never reach the webhook (its own request counter does not move); a
/// StatefulSet's pod and a pod of the custom kind the registration adds (docs/install.md's
/// patch) do, one review each.
#[tokio::test]
async fn the_api_server_sends_only_statefulset_and_custom_kind_pods() {
    let env = env().await;
    let c = &env.client;
    require_minor(c, 28, "matchConditions").await;
    let ns = namespace(c, "e2e-match").await;
    let before = pod_reviews(&env).await;

    let _: ReplicaSet = create(c, &ns, json!({"metadata": {"name": "rs"}, "spec": {
        "replicas": 1, "selector": {"matchLabels": {"app": "rs"}}, "template": template("rs", "Always")}}))
    .await;
    let ds: DaemonSet = create(
        c,
        &ns,
        json!({"metadata": {"name": "ds"}, "spec": {
        "selector": {"matchLabels": {"app": "ds"}}, "template": template("ds", "Always")}}),
    )
    .await;
    let _: Job = create(
        c,
        &ns,
        json!({"metadata": {"name": "job"}, "spec": {
        "template": template("job", "Never")}}),
    )
    .await;
    let _: Pod = create(
        c,
        &ns,
        json!({"metadata": {"name": "bare", "labels": {"app": "bare"}},
        "spec": template("bare", "Always")["spec"]}),
    )
    .await;
    pods_of(c, &ns, "rs", 1).await;
    pods_of(c, &ns, "job", 1).await;
    pods_of(c, &ns, "bare", 1).await;
    // One daemon pod per untainted node.
    let daemons = pods_of(c, &ns, "ds", NODES.len()).await;
    assert!(
        daemons
            .iter()
            .all(|p| p.owner_references()[0].uid == ds.uid().unwrap_or_default())
    );
    assert_eq!(
        pod_reviews(&env).await,
        before,
        "no pod of a ReplicaSet, DaemonSet or Job, nor a bare pod, reached the webhook"
    );

    create_sts(c, &ns, &statefulset("web", 1, &[])).await;
    pods_of(c, &ns, "web", 1).await;
    assert_eq!(
        pod_reviews(&env).await,
        before + 1.0,
        "the StatefulSet's pod reached the webhook"
    );
    let _: Pod = create(
        c,
        &ns,
        json!({"metadata": {"name": "ring-0", "labels": {"app": "ring"},
        "ownerReferences": [{"apiVersion": "example.com/v1", "kind": "Ring", "name": "ring",
                             "uid": "00000000-0000-0000-0000-000000000001", "controller": true}]},
        "spec": template("ring", "Always")["spec"]}),
    )
    .await;
    assert_eq!(
        pod_reviews(&env).await,
        before + 2.0,
        "the custom kind's pod reached the webhook"
    );
    delete_namespace(c, &ns).await;
}

/// The StorageClass `e2e-local` and one local PersistentVolume on each untainted node, named
/// `PREFIX-NODE`.
async fn local_volumes(c: &Client, prefix: &str) {
    local_storage_class(c, "e2e-local").await;
    for node in NODES {
        local_volume(c, "e2e-local", &format!("{prefix}-{node}"), node).await;
    }
}

async fn delete_local_volumes(c: &Client, prefix: &str) {
    for node in NODES {
        delete_volume(c, &format!("{prefix}-{node}")).await;
    }
}

/// A native StatefulSet whose ordinals start at 5, on node-local volumes, with
/// `persistentVolumeClaimRetentionPolicy` (delete claims on scale-down): its pods db-5 and db-6
/// are recorded, a re-created one is steered back, and scaling to one replica prunes db-6's state
/// (its claim deleted by the StatefulSet controller) and keeps db-5's.
#[tokio::test]
async fn a_statefulset_starting_at_ordinal_5_with_claim_retention_keeps_its_live_states() {
    let env = env().await;
    let c = &env.client;
    require_minor(
        c,
        32,
        "spec.ordinals.start and persistentVolumeClaimRetentionPolicy (GA in 1.31 and 1.32)",
    )
    .await;
    let ns = namespace(c, "e2e-ordinals").await;
    local_volumes(c, "e2e-ordinals").await;
    let sts = statefulset_with(
        "db",
        2,
        &[
            (AUTO_GENERATE_ANNOTATION, "true"),
            (PREFERRED_TOPOLOGY_ANNOTATION, HOST),
        ],
        json!({"spec": {
            "ordinals": {"start": 5},
            "persistentVolumeClaimRetentionPolicy": {"whenScaled": "Delete", "whenDeleted": "Delete"},
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                "accessModes": ["ReadWriteOnce"], "storageClassName": "e2e-local",
                "resources": {"requests": {"storage": "1Gi"}}}}]}}),
    );
    let names = sts_pod_names(&sts);
    assert_eq!(names, ["db-5", "db-6"]);
    let (placed, _) = start_recorded(c, &ns, &sts).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.clone(), &ns);
    for pod in &names {
        let claim = claims.get(&format!("data-{pod}")).await.expect("claim");
        let volume = claim.spec.and_then(|s| s.volume_name).expect("bound");
        assert_eq!(
            volume,
            format!("e2e-ordinals-{}", placed[pod].node),
            "{pod}'s claim is bound to its node's volume"
        );
    }

    // Re-created: steered back to its node (where its volume is).
    let pod = recreate_pod(c, &ns, "db-5").await;
    assert_steered_back(&pod, "db", &placed["db-5"]);

    // Scaled to one: db-6 and its claim go, and only db-6's state is pruned (ordinal 5 is live).
    scale(c, &ns, "db", 1).await;
    wait_sts_rolled(c, &ns, "db", 1).await;
    wait_state_names(c, &ns, "db", &["db-5"]).await;
    wait_for("data-db-6 to be deleted", TIMEOUT, || async {
        claims
            .get_opt("data-db-6")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    assert!(
        claims.get_opt("data-db-5").await.expect("get").is_some(),
        "db-5 keeps its claim"
    );
    delete_namespace(c, &ns).await;
    delete_local_volumes(c, "e2e-ordinals").await;
}

/// A pod template with a native sidecar (an init container with `restartPolicy: Always`) and a
/// plain init container: the re-created pod is patched, keeps both exactly as the template has
/// them, and comes back to its node.
#[tokio::test]
async fn a_pod_with_a_native_sidecar_is_patched_and_comes_back() {
    let env = env().await;
    let c = &env.client;
    require_minor(c, 29, "native sidecars (beta and on by default from 1.29)").await;
    let ns = namespace(c, "e2e-sidecar").await;
    let init = json!([
        {"name": "setup", "image": "cilium/echoserver:latest", "imagePullPolicy": "IfNotPresent"},
        {"name": "proxy", "image": "cilium/echoserver:latest", "imagePullPolicy": "IfNotPresent",
         "restartPolicy": "Always"}]);
    let sts = statefulset_with(
        "side",
        2,
        &[
            (AUTO_GENERATE_ANNOTATION, "true"),
            (PREFERRED_TOPOLOGY_ANNOTATION, HOST),
        ],
        json!({"spec": {"template": {"spec": {"initContainers": init}}}}),
    );
    let (placed, _) = start_recorded(c, &ns, &sts).await;
    let pod = recreate_pod(c, &ns, "side-0").await;
    assert_steered_back(&pod, "side", &placed["side-0"]);
    let spec = pod.spec.expect("spec");
    let kept: Vec<(String, Option<String>)> = spec
        .init_containers
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.name, c.restart_policy))
        .collect();
    assert_eq!(
        kept,
        [
            ("setup".to_owned(), None),
            ("proxy".to_owned(), Some("Always".to_owned()))
        ]
    );
    delete_namespace(c, &ns).await;
}

/// Whether `pod` waits for its scheduling gates.
fn gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| !g.is_empty())
        && pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none()
}

/// Lifts every scheduling gate of `name`, as the controller owning the gate would.
async fn lift_gate(c: &Client, ns: &str, name: &str) {
    Api::<Pod>::namespaced(c.clone(), ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"schedulingGates": null}})),
        )
        .await
        .expect("lift the scheduling gate");
}

/// A pod template with `schedulingGates`: the webhook patches the gated pod at CREATE, the pod
/// waits for its gate, and once the gate is lifted it is placed on its recorded node.
#[tokio::test]
async fn a_gated_pod_is_patched_at_creation_and_placed_on_its_node_when_released() {
    let env = env().await;
    let c = &env.client;
    require_minor(c, 30, "scheduling gates (GA in 1.30)").await;
    let ns = namespace(c, "e2e-gates").await;
    let sts = statefulset_with(
        "gated",
        2,
        &[
            (AUTO_GENERATE_ANNOTATION, "true"),
            (REQUIRED_TOPOLOGY_ANNOTATION, HOST),
        ],
        json!({"spec": {"template": {"spec": {"schedulingGates": [{"name": "example.com/hold"}]}}}}),
    );
    create_sts(c, &ns, &sts).await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    // The StatefulSet controller creates one pod at a time, each once the one before is Ready.
    for name in ["gated-0", "gated-1"] {
        wait_for(&format!("{name} to wait at its gate"), TIMEOUT, || async {
            pods.get_opt(name).await.ok()?.filter(gated).map(|_| ())
        })
        .await;
        lift_gate(c, &ns, name).await;
    }
    wait_sts_rolled(c, &ns, "gated", 2).await;
    let placed = placements(c, &ns, &pod_names("gated", 2)).await;
    wait_states(c, &ns, "gated", &placed).await;

    let old_uid = force_delete_pod(c, &ns, "gated-0").await;
    let waiting = wait_for("a new gated-0 at its gate", TIMEOUT, || async {
        pods.get_opt("gated-0")
            .await
            .ok()?
            .filter(|p| p.uid().as_deref() != Some(old_uid.as_str()) && gated(p))
    })
    .await;
    assert_eq!(
        waiting
            .annotations()
            .get(INJECTED_ANNOTATION)
            .map(String::as_str),
        Some("gated")
    );
    let selector: BTreeMap<String, String> = waiting
        .spec
        .as_ref()
        .and_then(|s| s.node_selector.clone())
        .unwrap_or_default();
    assert_eq!(
        selector.get(HOST),
        Some(&placed["gated-0"].node),
        "pinned while it waits"
    );
    lift_gate(c, &ns, "gated-0").await;
    let back = wait_replaced(c, &ns, "gated-0", &old_uid).await;
    assert_eq!(
        placement(&back).map(|p| p.node),
        Some(placed["gated-0"].node.clone())
    );
    delete_namespace(c, &ns).await;
}
