//! Never strand a pod: recorded required values that no usable node meeting the pod's own
//! constraints has are not injected (node gone, node lost, pod's own affinity); node label
//! changes re-record the affected states.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use persistent_pod_state::api::INJECTED_ANNOTATION;
use serde_json::json;

use std::time::Duration;

use crate::support::*;

/// Issue 3.6: a state pinned to a zone that no longer exists gets only its preferred part, so
/// the pod runs; a Warning Event on the PPS and a metric say so.
#[tokio::test]
async fn a_required_zone_that_is_gone_is_not_injected_and_the_pod_runs() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-stranded").await;
    let pps = serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
        "metadata": {"name": "web"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                 "requiredPersistentTopology": {"keys": [ZONE]},
                 "preferredPersistentTopology": [{"weight": 100, "preference": {"keys": [HOST]}}],
                 "persistentPodStateRetentionPolicy": "WhenDeleted"}
    }))
    .expect("pps");
    let api: Api<persistent_pod_state::api::PersistentPodState> = Api::namespaced(c.clone(), &ns);
    api.create(&PostParams::default(), &pps)
        .await
        .expect("create pps");
    create_sts(c, &ns, &statefulset("web", 0, &[])).await;
    // A placement recorded on a node and in a zone that are gone (decommissioned).
    let gone = json!({"status": {"podStates": {"web-0": {"nodeName": "node-gone",
        "nodeTopologyLabels": {ZONE: "zone-gone", HOST: "node-gone"}}}}});
    api.patch_status("web", &PatchParams::default(), &Patch::Merge(&gone))
        .await
        .expect("status");
    let before = scrape(&env).await;

    Api::<StatefulSet>::namespaced(c.clone(), &ns)
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await
        .expect("scale to 1");
    let placed = placements(c, &ns, &pod_names("web", 1)).await;
    let pod = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("web-0")
        .await
        .expect("pod");
    assert_eq!(
        pod.annotations()
            .get(INJECTED_ANNOTATION)
            .map(String::as_str),
        Some("web")
    );
    let selector = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_selector.clone())
        .unwrap_or_default();
    assert!(
        !selector.contains_key(ZONE),
        "the gone zone was not required: {selector:?}"
    );
    assert_eq!(
        preferred_terms(&pod).len(),
        1,
        "the preferred part is still injected"
    );
    println!(
        "web-0 runs on {} although its recorded zone is gone",
        placed["web-0"].node
    );

    let after = scrape(&env).await;
    let series = "pps_required_dropped_total{reason=\"node_gone\"}";
    assert!(
        metric(&after, series) > metric(&before, series),
        "{series} counted"
    );
    wait_event(c, &ns, "web", "RequiredTopologyUnavailable").await;
    // Once Ready, the pod's new placement replaces the stranded one.
    wait_states(c, &ns, "web", &placed).await;
    delete_namespace(c, &ns).await;
}

/// Issue 3.6: a node label change re-records the states of pods on that node.
#[tokio::test]
async fn node_label_changes_re_record_the_states() {
    const RACK: &str = "e2e.example.com/rack";
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-relabel").await;
    create_sts(
        c,
        &ns,
        &statefulset(
            "racked",
            1,
            &[
                ("kruise.io/auto-generate-persistent-pod-state", "true"),
                ("kruise.io/preferred-persistent-topology", RACK),
            ],
        ),
    )
    .await;
    wait_sts_rolled(c, &ns, "racked", 1).await;
    let placed = placements(c, &ns, &pod_names("racked", 1)).await;
    let node = placed["racked-0"].node.clone();
    let nodes: Api<Node> = Api::all(c.clone());
    let label = |v: Option<&str>| json!({"metadata": {"labels": {RACK: v}}});
    nodes
        .patch(
            &node,
            &PatchParams::default(),
            &Patch::Merge(label(Some("r1"))),
        )
        .await
        .expect("label");
    let pps = pps_api(c, &ns);
    let rack_of = || async {
        let pps = pps.get_opt("racked").await.ok()??;
        pps.status?
            .pod_states
            .get("racked-0")?
            .node_topology_labels
            .get(RACK)
            .cloned()
    };
    wait_for("rack r1 recorded", TIMEOUT, || async {
        rack_of().await.filter(|r| r == "r1")
    })
    .await;
    nodes
        .patch(
            &node,
            &PatchParams::default(),
            &Patch::Merge(label(Some("r2"))),
        )
        .await
        .expect("relabel");
    wait_for("rack r2 re-recorded", TIMEOUT, || async {
        rack_of().await.filter(|r| r == "r2")
    })
    .await;
    nodes
        .patch(&node, &PatchParams::default(), &Patch::Merge(label(None)))
        .await
        .expect("unlabel");
    delete_namespace(c, &ns).await;
}

/// Issue 2.3 and 4.5: a nodeSelector the pod sets itself is never overridden: moving a
/// StatefulSet to another zone by its template works even with a recorded required zone; the
/// conflict is counted and an Event on the PPS says so.
#[tokio::test]
async fn a_pods_own_node_selector_wins_over_the_recorded_value() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-conflict").await;
    let mut sts = statefulset(
        "moving",
        1,
        &[
            ("kruise.io/auto-generate-persistent-pod-state", "true"),
            ("kruise.io/required-persistent-topology", ZONE),
        ],
    );
    let spec = sts
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
        .expect("pod spec");
    spec.node_selector = Some([(ZONE.to_string(), "zone-a".to_string())].into());
    start_recorded(c, &ns, &sts).await;
    let before = scrape(&env).await;

    let to_b = json!({"spec": {"template": {"spec": {"nodeSelector": {ZONE: "zone-b"}}}}});
    Api::<StatefulSet>::namespaced(c.clone(), &ns)
        .patch("moving", &PatchParams::default(), &Patch::Merge(&to_b))
        .await
        .expect("move to zone-b");
    wait_sts_rolled(c, &ns, "moving", 1).await;
    let after = placements(c, &ns, &pod_names("moving", 1)).await;
    assert_eq!(
        node_labels(c, &after["moving-0"].node)
            .await
            .get(ZONE)
            .map(String::as_str),
        Some("zone-b")
    );
    let series = "pps_injection_conflicts_total";
    assert!(
        metric(&scrape(&env).await, series) > metric(&before, series),
        "{series} counted"
    );
    wait_event(c, &ns, "moving", "NodeSelectorConflict").await;
    delete_namespace(c, &ns).await;
}

/// Issue 8.1: the recorded node of a hostname-required PPS has been NotReady for an hour and is
/// tainted unreachable: the re-created pod is not pinned to it and runs on another node.
#[tokio::test]
async fn a_pod_pinned_to_a_lost_node_runs_on_another_node() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-lost-node").await;
    let (placed, _) = start_recorded(
        c,
        &ns,
        &statefulset(
            "pinned",
            1,
            &[
                ("kruise.io/auto-generate-persistent-pod-state", "true"),
                ("kruise.io/required-persistent-topology", HOST),
            ],
        ),
    )
    .await;
    let dead = placed["pinned-0"].node.clone();
    let before = scrape(&env).await;

    let lost = mark_node_lost(c, &dead, Duration::from_secs(3600)).await;
    let old_uid = force_delete_pod(c, &ns, "pinned-0").await;
    let pod = wait_replaced(c, &ns, "pinned-0", &old_uid).await;
    let now = placement(&pod).expect("placed");
    assert_ne!(now.node, dead, "not stranded on the lost node");
    let selector = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_selector.clone())
        .unwrap_or_default();
    assert!(
        !selector.contains_key(HOST),
        "no pin to the lost node: {selector:?}"
    );
    println!(
        "pinned-0: recorded on {dead} (NotReady for an hour), now runs on {}",
        now.node
    );
    let series = "pps_required_dropped_total{reason=\"node_lost\"}";
    assert!(
        metric(&scrape(&env).await, series) > metric(&before, series),
        "{series} counted"
    );
    wait_event(c, &ns, "pinned", "RequiredTopologySkipped").await;
    lost.revive().await;
    delete_namespace(c, &ns).await;
}

/// Issue 8.1: a StatefulSet rolled to a template whose required node affinity excludes the
/// recorded zone: the recorded zone is left out and the new pod runs in another zone.
#[tokio::test]
async fn a_template_excluding_the_recorded_zone_moves_the_pod_to_another_zone() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-own-affinity").await;
    let (placed, _) = start_recorded(
        c,
        &ns,
        &statefulset(
            "zoned",
            1,
            &[
                ("kruise.io/auto-generate-persistent-pod-state", "true"),
                ("kruise.io/required-persistent-topology", ZONE),
            ],
        ),
    )
    .await;
    let zone = node_labels(c, &placed["zoned-0"].node)
        .await
        .get(ZONE)
        .cloned()
        .expect("zone label");
    let before = scrape(&env).await;

    let exclude = json!({"spec": {"template": {"spec": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": ZONE, "operator": "NotIn", "values": [zone]}]}]}}}}}}});
    Api::<StatefulSet>::namespaced(c.clone(), &ns)
        .patch("zoned", &PatchParams::default(), &Patch::Merge(&exclude))
        .await
        .expect("exclude the zone");
    wait_sts_rolled(c, &ns, "zoned", 1).await;
    let after = placements(c, &ns, &pod_names("zoned", 1)).await;
    let new_zone = node_labels(c, &after["zoned-0"].node)
        .await
        .get(ZONE)
        .cloned()
        .expect("zone label");
    assert_ne!(new_zone, zone, "runs outside the excluded zone");
    println!("zoned-0: recorded in {zone}, the new template excludes it, now runs in {new_zone}");
    let series = "pps_required_dropped_total{reason=\"pod_constraints\"}";
    assert!(
        metric(&scrape(&env).await, series) > metric(&before, series),
        "{series} counted"
    );
    wait_event(c, &ns, "zoned", "RequiredTopologySkipped").await;
    delete_namespace(c, &ns).await;
}
