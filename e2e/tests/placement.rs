//! Pods come back on their recorded node (with their IP), or in their recorded zone.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::StatefulSet;
use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use kube::{Api, ResourceExt};
use serde_json::json;

use crate::support::*;

/// 7a: the seeds' echoserver (as an apps/v1 StatefulSet, same annotations and template).
#[tokio::test]
async fn echoserver_from_the_seeds_comes_back_on_its_node_with_its_ip() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-echoserver").await;
    let sts = statefulset(
        "echoserver",
        2,
        &[
            ("kruise.io/auto-generate-persistent-pod-state", "true"),
            ("kruise.io/preferred-persistent-topology", HOST),
        ],
    );
    let (before, states) = start_recorded(c, &ns, &sts).await;
    for (pod, p) in &before {
        assert_eq!(
            states[pod]
                .node_topology_labels
                .get(HOST)
                .map(|h| h.as_str()),
            Some(p.node.as_str()),
            "{pod} recorded with its node"
        );
    }
    let pps = pps_api(c, &ns)
        .get("echoserver")
        .await
        .expect("generated pps");
    let owner = pps
        .owner_references()
        .first()
        .cloned()
        .expect("owner reference");
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("StatefulSet", "echoserver", Some(true))
    );

    for name in before.keys() {
        let pod = recreate_pod(c, &ns, name).await;
        let after = placement(&pod).expect("placed");
        assert_steered_back(&pod, "echoserver", &before[name]);
        assert_eq!(after.ip, before[name].ip, "{name} kept its IP");
        println!(
            "{name}: node {} ip {} kept after re-creation",
            after.node, after.ip
        );
    }
    delete_namespace(c, &ns).await;
}

async fn roll(c: &kube::Client, ns: &str, name: &str, round: usize) {
    let patch = json!({"spec": {"template": {"metadata": {"annotations": {"e2e/rollout": round.to_string()}}}}});
    Api::<StatefulSet>::namespaced(c.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("template change");
}

fn kept(before: &BTreeMap<String, Placement>, after: &BTreeMap<String, Placement>) -> usize {
    before
        .iter()
        .filter(|(pod, p)| {
            after
                .get(*pod)
                .is_some_and(|a| a.node == p.node && a.ip == p.ip)
        })
        .count()
}

/// Rolls `name` (`REPLICAS` pods) `ROUNDS` times; returns (pods that kept node and IP, pods
/// re-created), then deletes it so the next measurement runs on the same empty nodes.
async fn measure_rollouts(
    c: &kube::Client,
    ns: &str,
    name: &str,
    with_pps: bool,
) -> (usize, usize) {
    const ROUNDS: usize = 3;
    const REPLICAS: i32 = 2;
    let annotations: &[(&str, &str)] = if with_pps {
        &[
            ("kruise.io/auto-generate-persistent-pod-state", "true"),
            ("kruise.io/preferred-persistent-topology", HOST),
        ]
    } else {
        &[]
    };
    create_sts(c, ns, &statefulset(name, REPLICAS, annotations)).await;
    wait_sts_rolled(c, ns, name, REPLICAS).await;
    let names = pod_names(name, REPLICAS);
    let mut before = placements(c, ns, &names).await;
    if with_pps {
        wait_states(c, ns, name, &before).await;
    }
    let (mut kept_total, mut total) = (0, 0);
    for round in 1..=ROUNDS {
        roll(c, ns, name, round).await;
        wait_sts_rolled(c, ns, name, REPLICAS).await;
        let after = placements(c, ns, &names).await;
        for (pod, p) in &after {
            assert_ne!(
                p.uid, before[pod].uid,
                "{pod} was re-created by rollout {round}"
            );
        }
        let k = kept(&before, &after);
        if with_pps {
            assert_eq!(
                k,
                names.len(),
                "rollout {round}: every pod of {name} kept node and IP: {before:?} -> {after:?}"
            );
        }
        kept_total += k;
        total += names.len();
        before = after;
    }
    Api::<StatefulSet>::namespaced(c.clone(), ns)
        .delete(name, &kube::api::DeleteParams::default())
        .await
        .expect("delete statefulset");
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(c.clone(), ns);
    for pod in &names {
        wait_for(&format!("{pod} to be gone"), TIMEOUT, || async {
            pods.get_opt(pod).await.ok()?.is_none().then_some(())
        })
        .await;
    }
    (kept_total, total)
}

/// 7b: rolling updates of a StatefulSet with fewer replicas than nodes keep every pod's node
/// and IP; the same rollouts of a twin without PPS, on the same nodes, are measured.
#[tokio::test]
async fn rolling_updates_keep_node_and_ip_and_the_twin_without_pps_is_measured() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-rollout").await;
    let (pinned, total) = measure_rollouts(c, &ns, "pinned", true).await;
    let (twin, twin_total) = measure_rollouts(c, &ns, "twin", false).await;
    println!(
        "rolling updates (2 replicas, 3 rollouts, 4 nodes): with PersistentPodState {pinned}/{total} pods kept node and IP ({:.0}%); twin without it {twin}/{twin_total} ({:.0}%)",
        100.0 * pinned as f64 / total as f64,
        100.0 * twin as f64 / twin_total as f64
    );
    delete_namespace(c, &ns).await;
}

/// 7c: a required zone moves a pod within its zone when its node is cordoned.
#[tokio::test]
async fn required_zone_keeps_the_zone_when_the_node_is_cordoned() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-zone").await;
    let sts = statefulset(
        "zoned",
        1,
        &[
            ("kruise.io/auto-generate-persistent-pod-state", "true"),
            ("kruise.io/required-persistent-topology", ZONE),
            ("kruise.io/preferred-persistent-topology", HOST),
        ],
    );
    let (before, states) = start_recorded(c, &ns, &sts).await;
    let node = before["zoned-0"].node.clone();
    let zone = states["zoned-0"]
        .node_topology_labels
        .get(ZONE)
        .map(|z| z.to_string())
        .expect("the zone recorded");

    set_unschedulable(c, &node, true).await;
    let pod = recreate_pod(c, &ns, "zoned-0").await;
    set_unschedulable(c, &node, false).await;

    let after = placement(&pod).expect("placed");
    let selector = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_selector.clone())
        .unwrap_or_default();
    assert_eq!(selector.get(ZONE), Some(&zone), "required zone injected");
    assert_ne!(after.node, node, "the cordoned node was not used");
    assert_eq!(
        node_labels(c, &after.node).await.get(ZONE),
        Some(&zone),
        "landed in the same zone"
    );
    println!(
        "zoned-0: {node} cordoned; re-created on {} in {zone}",
        after.node
    );
    delete_namespace(c, &ns).await;
}

/// 7d: the seeds' explicit PersistentPodState YAML (v1alpha1, nodeTopologyKeys), with its
/// target switched to an apps/v1 StatefulSet and its placeholder keys made real.
#[tokio::test]
async fn explicit_v1alpha1_pps_from_the_seeds_yaml_targets_an_apps_v1_statefulset() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-seed-pps").await;
    let yaml = format!(
        r#"
apiVersion: apps.kruise.io/v1alpha1
kind: PersistentPodState
metadata:
  name: echoserver
  namespace: {ns}
spec:
  targetRef:
    apiVersion: apps/v1
    kind: StatefulSet
    name: echoserver
  requiredPersistentTopology:
    nodeTopologyKeys:
      - failure-domain.beta.kubernetes.io/zone
  preferredPersistentTopology:
    - preference:
        nodeTopologyKeys:
          - kubernetes.io/hostname
      # int, [1 - 100]
      weight: 100
"#
    );
    let obj: DynamicObject = serde_yaml_ng::from_str(&yaml).expect("seed yaml");
    let ar = ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
        "apps.kruise.io",
        "v1alpha1",
        "PersistentPodState",
    ));
    Api::<DynamicObject>::namespaced_with(c.clone(), &ns, &ar)
        .create(&PostParams::default(), &obj)
        .await
        .expect("the seed's PersistentPodState is accepted");

    let (before, states) = start_recorded(c, &ns, &statefulset("echoserver", 2, &[])).await;
    for state in states.values() {
        let keys: Vec<&str> = state
            .node_topology_labels
            .keys()
            .map(|k| k.as_str())
            .collect();
        assert_eq!(keys, ["failure-domain.beta.kubernetes.io/zone", HOST]);
    }
    let pod = recreate_pod(c, &ns, "echoserver-1").await;
    let after = placement(&pod).expect("placed");
    let selector = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_selector.clone())
        .unwrap_or_default();
    assert_eq!(
        selector
            .get("failure-domain.beta.kubernetes.io/zone")
            .map(|z| z.as_str()),
        states["echoserver-1"]
            .node_topology_labels
            .get("failure-domain.beta.kubernetes.io/zone")
            .map(|z| z.as_str())
    );
    assert_eq!(
        preferred_terms(&pod),
        vec![preferred_host_term(&before["echoserver-1"].node)]
    );
    assert_eq!(
        (after.node.as_str(), after.ip.as_str()),
        (
            before["echoserver-1"].node.as_str(),
            before["echoserver-1"].ip.as_str()
        )
    );
    delete_namespace(c, &ns).await;
}
