//! Node-local volumes of a lost node (issue 19.3, 19.4): two StatefulSets whose claims are
//! bound to static local PersistentVolumes of one node, which is then lost (its kubelet dies and
//! it is tainted out-of-service). With `persistent-pod-state.io/release-local-volumes: "true"`
//! the controller deletes the claim and the waiting pod and the pod runs elsewhere on a new
//! claim; without it nothing is deleted and a Warning says how to release, which `release`
//! then does on the operator's word.

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use persistent_pod_state::api::{
    AUTO_GENERATE_ANNOTATION, PREFERRED_TOPOLOGY_ANNOTATION, RELEASE_LOCAL_VOLUMES_ANNOTATION,
    REQUIRED_TOPOLOGY_ANNOTATION,
};
use serde_json::json;

use crate::support::*;

const CLASS: &str = "e2e-lost-local";

/// A one-replica StatefulSet with the claim template `data` of the local class, generating a
/// PersistentPodState (preferred hostname) with `extra` annotations.
fn on_local_disk(name: &str, extra: &[(&str, &str)]) -> k8s_openapi::api::apps::v1::StatefulSet {
    let mut annotations = vec![
        (AUTO_GENERATE_ANNOTATION, "true"),
        (PREFERRED_TOPOLOGY_ANNOTATION, HOST),
    ];
    annotations.extend_from_slice(extra);
    statefulset_with(
        name,
        1,
        &annotations,
        json!({"spec": {"volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
            "accessModes": ["ReadWriteOnce"], "storageClassName": CLASS,
            "resources": {"requests": {"storage": "1Gi"}}}}]}}),
    )
}

/// The claim `name`: its uid and the volume it is bound to, once bound.
async fn bound(c: &Client, ns: &str, name: &str) -> (String, String) {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.clone(), ns);
    wait_for(&format!("{name} bound"), TIMEOUT, || async {
        let claim = claims.get_opt(name).await.ok()??;
        let volume = claim.spec.as_ref()?.volume_name.clone()?;
        Some((claim.uid()?, volume))
    })
    .await
}

/// Deletes the bound claim `name` as an operator would, and waits until that claim (by uid) is
/// gone.
async fn delete_claim_by_hand(c: &Client, ns: &str, name: &str) {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.clone(), ns);
    let (uid, _) = bound(c, ns, name).await;
    claims
        .delete(name, &Default::default())
        .await
        .expect("claim deleted by hand");
    wait_for(
        &format!("{name}, deleted by hand, to be gone"),
        TIMEOUT,
        || async {
            let claim = claims.get_opt(name).await.ok()?;
            (claim.and_then(|c| c.uid()) != Some(uid.clone())).then_some(())
        },
    )
    .await;
}

/// Runs the binary's `release` command; its standard output.
async fn release(env: &Env, ns: &str, pod: &str, dry_run: bool) -> String {
    let mut args = vec!["release", pod, "-n", ns];
    if dry_run {
        args.push("--dry-run");
    }
    pps_command(env, &args).await
}

#[tokio::test]
async fn a_lost_nodes_local_claims_are_released_with_the_annotation_and_kept_without() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-local-release").await;
    // Every volume of the class is on one node at first, so both pods land there.
    let lost = NODES[3];
    local_storage_class(c, CLASS).await;
    let volumes: Vec<String> = ["one", "two"]
        .iter()
        .map(|v| format!("{CLASS}-{v}-{lost}"))
        .collect();
    for v in &volumes {
        local_volume(c, CLASS, v, lost).await;
    }
    let freed = on_local_disk("freed", &[(RELEASE_LOCAL_VOLUMES_ANNOTATION, "true")]);
    let kept = on_local_disk("kept", &[]);
    let (placed_freed, _) = start_recorded(c, &ns, &freed).await;
    let (placed_kept, _) = start_recorded(c, &ns, &kept).await;
    assert_eq!(placed_freed["freed-0"].node, lost);
    assert_eq!(placed_kept["kept-0"].node, lost);
    let (freed_claim, freed_volume) = bound(c, &ns, "data-freed-0").await;
    let (kept_claim, kept_volume) = bound(c, &ns, "data-kept-0").await;
    // Room elsewhere for the claims made again.
    let spares: Vec<(String, &str)> = NODES[..2]
        .iter()
        .map(|n| (format!("{CLASS}-spare-{n}"), *n))
        .collect();
    for (v, n) in &spares {
        local_volume(c, CLASS, v, n).await;
    }

    let before = scrape(&env).await;
    let kubelet = kubelet_dies(c, lost).await;
    let tainted = taint_out_of_service(c, lost).await;
    // The pod GC force-deletes pods of an out-of-service node that is not ready; an operator
    // may do it first.
    let freed_first = force_delete_pod(c, &ns, "freed-0").await;
    let kept_first = force_delete_pod(c, &ns, "kept-0").await;

    // With the annotation: claim and pod released, the pod runs elsewhere on a new claim.
    let running = wait_replaced(c, &ns, "freed-0", &freed_first).await;
    let elsewhere = placement(&running).map(|p| p.node).unwrap_or_default();
    assert_ne!(elsewhere, lost);
    let (new_claim, new_volume) = bound(c, &ns, "data-freed-0").await;
    assert_ne!(new_claim, freed_claim, "a new claim");
    assert_eq!(new_volume, format!("{CLASS}-spare-{elsewhere}"));
    wait_event_noting(
        c,
        &ns,
        "freed",
        "LocalVolumeReleased",
        &["data-freed-0", &freed_volume, lost],
    )
    .await;
    wait_event_noting(c, &ns, "freed", "PodReleased", &["freed-0", "data-freed-0"]).await;
    let series = "pps_local_volumes_released_total{reason=\"node_lost\"}";
    assert!(
        metric(&scrape(&env).await, series) > metric(&before, series),
        "{series} counted"
    );

    // Without it: a Warning naming the claim and how to release; nothing deleted.
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    let waiting = created_again(c, &ns, "kept-0", &kept_first).await;
    wait_event_noting(
        c,
        &ns,
        "kept",
        "LocalVolumeBlocking",
        &[
            "kept-0",
            "data-kept-0",
            lost,
            "persistent-pod-state release kept-0",
        ],
    )
    .await;
    let still = pods.get("kept-0").await.expect("kept-0");
    assert_eq!(still.uid(), waiting.uid(), "the waiting pod is not deleted");
    assert!(placement(&still).is_none(), "it waits unscheduled");
    assert_eq!(
        bound(c, &ns, "data-kept-0").await,
        (kept_claim.clone(), kept_volume.clone()),
        "the claim is not deleted"
    );
    let outlook = explained(&env, &ns, "kept-0").await;
    assert!(
        outlook.contains("held by claims data-kept-0") && outlook.contains("release kept-0"),
        "{outlook}"
    );
    // As replicas that release nothing, and as replicas that only observe, judge it.
    let outlook = pps_command(
        &env,
        &[
            "explain",
            "kept-0",
            "-n",
            &ns,
            "--max-releases-per-minute",
            "0",
        ],
    )
    .await;
    assert!(
        outlook.contains("held by claims data-kept-0 (")
            && outlook.contains(&format!(
                "on node {lost}: node {lost} is gone; the controller releases nothing (--max-releases-per-minute 0): run `persistent-pod-state release kept-0"
            )),
        "{outlook}"
    );
    let outlook = pps_command(&env, &["explain", "kept-0", "-n", &ns, "--mode", "observe"]).await;
    assert!(
        outlook.contains("held by claims data-kept-0 (")
            && outlook.contains(&format!(
                "on node {lost}: never released by the controller while the PersistentPodState is observed only"
            )),
        "{outlook}"
    );

    // The operator's word: a dry run deletes nothing, then `release` does it.
    let said = release(&env, &ns, "kept-0", true).await;
    assert!(
        said.contains(&format!(
            "would delete persistentvolumeclaim {ns}/data-kept-0"
        )) && said.contains(&format!("would delete pod {ns}/kept-0")),
        "{said}"
    );
    assert_eq!(bound(c, &ns, "data-kept-0").await.0, kept_claim);
    let said = release(&env, &ns, "kept-0", false).await;
    assert!(
        said.contains(&format!("deleted persistentvolumeclaim {ns}/data-kept-0"))
            && said.contains(&kept_volume)
            && said.contains(&format!("deleted pod {ns}/kept-0"))
            && said.contains(&format!(
                "the state of kept-0 in PersistentPodState kept names node {lost} no more"
            )),
        "{said}"
    );
    let running = wait_replaced(c, &ns, "kept-0", &waiting.uid().unwrap_or_default()).await;
    assert_ne!(placement(&running).map(|p| p.node).as_deref(), Some(lost));
    assert_ne!(
        bound(c, &ns, "data-kept-0").await.0,
        kept_claim,
        "a new claim"
    );
    println!(
        "freed-0: released by the controller, runs on {elsewhere}; kept-0: released by `release`"
    );

    tainted.restore().await;
    kubelet_returns(c, lost, kubelet).await;
    delete_namespace(c, &ns).await;
    for v in volumes.iter().chain(spares.iter().map(|(v, _)| v)) {
        delete_volume(c, v).await;
    }
}

/// A node cordoned and then down past `--node-lost-after` (a drain, then a reboot or a disk
/// replaced) is maintenance: its disks come back with it. The pod waiting for it keeps its
/// node-local claim, even with `release-local-volumes`, and a `LocalVolumeKept` Warning and
/// `explain` say why and how to let go. Uncordoned while still down, the claim and the pod are
/// released and the pod runs elsewhere on a new claim.
#[tokio::test]
async fn a_cordoned_nodes_local_claims_are_kept_until_it_is_uncordoned() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-local-cordoned").await;
    let (down, spare) = (NODES[3], NODES[0]);
    local_storage_class(c, CLASS).await;
    let volume = format!("{CLASS}-serviced-{down}");
    local_volume(c, CLASS, &volume, down).await;
    let sts = on_local_disk("serviced", &[(RELEASE_LOCAL_VOLUMES_ANNOTATION, "true")]);
    let (placed, _) = start_recorded(c, &ns, &sts).await;
    assert_eq!(placed["serviced-0"].node, down);
    let (claim, bound_to) = bound(c, &ns, "data-serviced-0").await;
    assert_eq!(bound_to, volume);
    let spare_volume = format!("{CLASS}-serviced-{spare}");
    local_volume(c, CLASS, &spare_volume, spare).await;

    // Cordoned and drained (the pod deleted), then down.
    let cordoned = cordon(c, down).await;
    let first = force_delete_pod(c, &ns, "serviced-0").await;
    let waiting = created_again(c, &ns, "serviced-0", &first).await;
    let kubelet = kubelet_dies(c, down).await;
    let down_at = std::time::Instant::now();
    wait_event_noting(
        c,
        &ns,
        "serviced",
        "LocalVolumeKept",
        &[
            "serviced-0",
            "data-serviced-0",
            &volume,
            &format!("node {down} is cordoned"),
            "out-of-service",
        ],
    )
    .await;
    assert!(
        down_at.elapsed() >= lost_after(&env),
        "said once the node counts as lost"
    );
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    let still = pods.get("serviced-0").await.expect("serviced-0");
    assert_eq!(still.uid(), waiting.uid(), "the waiting pod is not deleted");
    assert!(placement(&still).is_none(), "it waits unscheduled");
    assert_eq!(
        bound(c, &ns, "data-serviced-0").await,
        (claim.clone(), volume.clone()),
        "the claim is not deleted"
    );
    let outlook = explained(&env, &ns, "serviced-0").await;
    assert!(
        outlook.contains(&format!(
            "held by claims data-serviced-0 (PersistentVolume {volume}) on node {down}, which is cordoned and down"
        )),
        "{outlook}"
    );

    // Uncordoned while still down: released, and the pod runs elsewhere on a new claim.
    cordoned.lift().await;
    let running = wait_replaced(c, &ns, "serviced-0", &waiting.uid().unwrap_or_default()).await;
    assert_eq!(placement(&running).map(|p| p.node).as_deref(), Some(spare));
    let (new_claim, new_volume) = bound(c, &ns, "data-serviced-0").await;
    assert_ne!(new_claim, claim, "a new claim");
    assert_eq!(new_volume, spare_volume);
    wait_event_noting(
        c,
        &ns,
        "serviced",
        "LocalVolumeReleased",
        &["data-serviced-0", &volume, down],
    )
    .await;

    kubelet_returns(c, down, kubelet).await;
    delete_namespace(c, &ns).await;
    for v in [&volume, &spare_volume] {
        delete_volume(c, v).await;
    }
}

/// `explain` of `pod`, as text.
async fn explained(env: &Env, ns: &str, pod: &str) -> String {
    pps_command(env, &["explain", pod, "-n", ns]).await
}

/// The readiness gate of [`a_pod_released_before_it_was_ready_elsewhere_is_not_pinned_back`]'s
/// pods: a pod is Ready only once the test opens it.
const GATE: &str = "e2e.persistent-pod-state.io/ready";

/// Opens the readiness gate of pod `name` (as the controller a gate stands for would).
async fn open_gate(c: &Client, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(c.clone(), ns);
    let condition = json!({"status": {"conditions": [{"type": GATE, "status": "True"}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Strategic(condition))
        .await
        .expect("gate opened");
}

/// The pod `name` once scheduled (Ready or not), another one than `old_uid`.
async fn scheduled_again(c: &Client, ns: &str, name: &str, old_uid: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(c.clone(), ns);
    wait_for(
        &format!("{name} to be created again and scheduled"),
        TIMEOUT,
        || async {
            let pod = pods.get_opt(name).await.ok()??;
            let scheduled = pod.spec.as_ref()?.node_name.is_some();
            (pod.uid().as_deref() != Some(old_uid) && scheduled).then_some(pod)
        },
    )
    .await
}

#[tokio::test]
async fn a_pod_released_before_it_was_ready_elsewhere_is_not_pinned_back() {
    released_before_ready(Release::ByTheController).await;
}

/// The same, released by hand: the operator deletes the claim and the pod. The controller has
/// no memory of that release (as after a leader change or a crash following its own): the state
/// stops naming the old node from what the cluster shows (the pod on another node, its claim
/// bound to a volume only that node can mount).
#[tokio::test]
async fn a_pod_released_by_hand_before_it_was_ready_elsewhere_is_not_pinned_back() {
    released_before_ready(Release::ByHand).await;
}

/// Who releases the claim and the pod in [`released_before_ready`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Release {
    /// The controller, on `persistent-pod-state.io/release-local-volumes: "true"`.
    ByTheController,
    /// An operator, deleting the claim and then the pod.
    ByHand,
}

/// A required-hostname StatefulSet pod on a local disk is released from its lost node (by
/// `by`), created again on a spare node's volume and never turns Ready there: its state must
/// name no node, and once the node is back the pod created again must go where its claim is.
async fn released_before_ready(by: Release) {
    let env = env().await;
    let c = &env.client;
    let (ns, class) = match by {
        Release::ByTheController => ("e2e-local-back", "e2e-back-local"),
        Release::ByHand => ("e2e-local-hand", "e2e-hand-local"),
    };
    let ns = namespace(c, ns).await;
    let (lost, spare) = (NODES[3], NODES[0]);
    local_storage_class(c, class).await;
    let first = format!("{class}-{lost}");
    local_volume(c, class, &first, lost).await;
    // Pinned to its host; Ready only once its gate is opened.
    let mut annotations = vec![
        (AUTO_GENERATE_ANNOTATION, "true"),
        (REQUIRED_TOPOLOGY_ANNOTATION, HOST),
    ];
    if by == Release::ByTheController {
        annotations.push((RELEASE_LOCAL_VOLUMES_ANNOTATION, "true"));
    }
    let sts = statefulset_with(
        "back",
        1,
        &annotations,
        json!({"spec": {
            "template": {"spec": {"readinessGates": [{"conditionType": GATE}]}},
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                "accessModes": ["ReadWriteOnce"], "storageClassName": class,
                "resources": {"requests": {"storage": "1Gi"}}}}]}}),
    );
    create_sts(c, &ns, &sts).await;
    let pod = scheduled_again(c, &ns, "back-0", "").await;
    open_gate(c, &ns, "back-0").await;
    let placed = placements(c, &ns, &["back-0".to_owned()]).await;
    assert_eq!(placed["back-0"].node, lost);
    wait_states(c, &ns, "back", &placed).await;
    let second = format!("{class}-{spare}");
    local_volume(c, class, &second, spare).await;

    // The node is lost: the claim and the pod are released, the pod is created again on the
    // spare node's volume, and never turns Ready there (its gate stays shut).
    let kubelet = kubelet_dies(c, lost).await;
    let tainted = taint_out_of_service(c, lost).await;
    let mut last = force_delete_pod(c, &ns, "back-0").await;
    match by {
        Release::ByTheController => {
            wait_event_noting(c, &ns, "back", "PodReleased", &["back-0", "data-back-0"]).await;
        }
        Release::ByHand => {
            // The pod created again waits for its claim's node: the operator deletes the claim
            // (no scheduled pod uses it, so it goes at once), then the pod.
            wait_event_noting(
                c,
                &ns,
                "back",
                "LocalVolumeBlocking",
                &["back-0", "data-back-0"],
            )
            .await;
            delete_claim_by_hand(c, &ns, "data-back-0").await;
            last = force_delete_pod(c, &ns, "back-0").await;
        }
    }
    let elsewhere = scheduled_again(c, &ns, "back-0", &last).await;
    assert_eq!(
        elsewhere.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some(spare)
    );
    assert_ne!(elsewhere.uid(), pod.uid());
    assert_eq!(bound(c, &ns, "data-back-0").await.1, second);
    assert!(!persistent_pod_state::workload::is_ready(&elsewhere));
    // Its state names the lost node no more.
    let pps = pps_api(c, &ns);
    let state = wait_for("the state to name no node", TIMEOUT, || async {
        let state = pps
            .get("back")
            .await
            .ok()?
            .status?
            .pod_states
            .remove("back-0")?;
        state.node_name.is_none().then_some(state)
    })
    .await;
    assert!(!state.node_topology_labels.contains_key(HOST), "{state:?}");
    if by == Release::ByHand {
        // Found from the pod and its new claim, and said so.
        wait_event_noting(
            c,
            &ns,
            "back",
            "NodeForgotten",
            &["back-0", lost, &second, spare],
        )
        .await;
    }

    // The node is back; the pod, never Ready, is created again: it goes where its claim is,
    // not pinned to the node its data left.
    tainted.restore().await;
    kubelet_returns(c, lost, kubelet).await;
    let old = force_delete_pod(c, &ns, "back-0").await;
    let again = scheduled_again(c, &ns, "back-0", &old).await;
    assert_eq!(
        again.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some(spare),
        "scheduled where its claim is"
    );
    // Once Ready there, it is recorded there.
    open_gate(c, &ns, "back-0").await;
    let placed = placements(c, &ns, &["back-0".to_owned()]).await;
    wait_states(c, &ns, "back", &placed).await;
    let how = match by {
        Release::ByTheController => "by the controller",
        Release::ByHand => "by hand",
    };
    println!(
        "back-0: released {how} from {lost}, created again after it came back, runs on {spare}"
    );

    delete_namespace(c, &ns).await;
    for v in [&first, &second] {
        delete_volume(c, v).await;
    }
}

/// A pod pinned to its recorded zone whose claim is bound, by the operator's hand, to a node-local
/// volume in another zone can never be scheduled: once it has waited pinned for
/// `--node-lost-after` and been found so for another, the controller makes its state name
/// neither its node nor its zone (a `NodeForgotten` Event names both) and releases it; created
/// again, it runs where its claim is, and is recorded there.
#[tokio::test]
async fn a_pod_pinned_to_a_zone_its_claims_node_lacks_is_released_to_its_claim() {
    let env = env().await;
    let c = &env.client;
    let lost_after = lost_after(&env);
    let ns = namespace(c, "e2e-local-zone").await;
    let class = "e2e-zone-local";
    let (first_node, other_zone) = (NODES[0], NODES[2]);
    local_storage_class(c, class).await;
    let (first, second) = (
        format!("{class}-{first_node}"),
        format!("{class}-{other_zone}"),
    );
    local_volume(c, class, &first, first_node).await;
    // Its zone required, its host preferred; states kept while the StatefulSet lives (it is
    // scaled to none and back).
    let pps = serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1alpha1", "kind": "PersistentPodState",
        "metadata": {"name": "zoned"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "zoned"},
                 "requiredPersistentTopology": {"nodeTopologyKeys": [ZONE]},
                 "preferredPersistentTopology": [{"weight": 100, "preference": {"nodeTopologyKeys": [HOST]}}],
                 "persistentPodStateRetentionPolicy": "WhenDeleted"}
    }))
    .expect("pps");
    pps_api(c, &ns)
        .create(&Default::default(), &pps)
        .await
        .expect("create pps");
    let sts = statefulset_with(
        "zoned",
        1,
        &[],
        json!({"spec": {"volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
            "accessModes": ["ReadWriteOnce"], "storageClassName": class,
            "resources": {"requests": {"storage": "1Gi"}}}}]}}),
    );
    let (placed, states) = start_recorded(c, &ns, &sts).await;
    assert_eq!(placed["zoned-0"].node, first_node);
    assert_eq!(
        states["zoned-0"]
            .node_topology_labels
            .get(ZONE)
            .map(|z| &**z),
        Some("zone-a")
    );

    // The operator moves its data to a volume of a node in zone-b: the pod stopped, its claim
    // deleted and made again bound to that volume.
    scale(c, &ns, "zoned", 0).await;
    wait_pod_gone(c, &ns, "zoned-0").await;
    delete_claim_by_hand(c, &ns, "data-zoned-0").await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.clone(), &ns);
    local_volume(c, class, &second, other_zone).await;
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "data-zoned-0"},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": class,
                 "volumeName": second, "resources": {"requests": {"storage": "1Gi"}}}}))
    .expect("claim");
    let uid = claims
        .create(&Default::default(), &claim)
        .await
        .expect("claim made again")
        .uid();
    let volumes: Api<k8s_openapi::api::core::v1::PersistentVolume> = Api::all(c.clone());
    wait_for(
        "the volume in zone-b bound to the claim",
        TIMEOUT,
        || async {
            let pv = volumes.get_opt(&second).await.ok()??;
            let by = pv.spec?.claim_ref?.uid;
            (by.is_some() && by == uid).then_some(())
        },
    )
    .await;

    // Created again, it is pinned to zone-a, where its volume is not: it waits.
    scale(c, &ns, "zoned", 1).await;
    let pinned = scheduled_or_waiting(c, &ns, "zoned-0").await;
    let selector = pinned.spec.as_ref().and_then(|s| s.node_selector.clone());
    assert_eq!(
        selector
            .as_ref()
            .and_then(|s| s.get(ZONE))
            .map(String::as_str),
        Some("zone-a"),
        "pinned to its zone: {selector:?}"
    );
    let pinned_uid = pinned.uid().unwrap_or_default();
    let created_at = std::time::Instant::now();
    wait_for(
        "the pinned pod to be released",
        lost_after * 2 + std::time::Duration::from_secs(90),
        || async {
            let pod = Api::<Pod>::namespaced(c.clone(), &ns)
                .get_opt("zoned-0")
                .await
                .ok()?;
            (pod.and_then(|p| p.uid()).as_deref() != Some(pinned_uid.as_str())).then_some(())
        },
    )
    .await;
    let took = created_at.elapsed();
    let running = wait_replaced(c, &ns, "zoned-0", &pinned_uid).await;
    assert_eq!(
        placement(&running).map(|p| p.node).as_deref(),
        Some(other_zone)
    );
    let zone = format!("{ZONE}=zone-a");
    wait_event_noting(
        c,
        &ns,
        "zoned",
        "NodeForgotten",
        &["zoned-0", first_node, &zone, &second, other_zone],
    )
    .await;
    let why = format!(
        "its claim data-zoned-0 is bound to PersistentVolume {second}, which only node {other_zone} can mount"
    );
    wait_event_noting(c, &ns, "zoned", "PodReleased", &["zoned-0", &zone, &why]).await;
    // Recorded where it runs now, in zone-b.
    let placed = placements(c, &ns, &["zoned-0".to_owned()]).await;
    let states = wait_states(c, &ns, "zoned", &placed).await;
    assert_eq!(
        states["zoned-0"]
            .node_topology_labels
            .get(ZONE)
            .map(|z| &**z),
        Some("zone-b")
    );
    println!(
        "zoned-0: pinned to zone-a with its claim bound in zone-b; released {took:?} after it was created, runs on {other_zone}"
    );

    delete_namespace(c, &ns).await;
    for v in [&first, &second] {
        delete_volume(c, v).await;
    }
}

/// The pod `name` once it exists and is not being deleted.
async fn scheduled_or_waiting(c: &Client, ns: &str, name: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(c.clone(), ns);
    wait_for(&format!("{name} to be created"), TIMEOUT, || async {
        pods.get_opt(name)
            .await
            .ok()?
            .filter(|p| p.metadata.deletion_timestamp.is_none())
    })
    .await
}
