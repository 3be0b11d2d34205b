//! Node loss as a real cluster shows it (issue 19.2): the node lifecycle controller runs on the
//! current control plane and marks a node whose kubelet stopped `Unknown` and unreachable,
//! tainting it as it does on any cluster. A short outage keeps the pin (`--node-lost-after`
//! holds); an out-of-service taint lets the pod go at once. (The controller of v1.37 dates both
//! its taints; a NoSchedule taint without `timeAdded` is dated by its NoExecute twin, shown in
//! process in `placement.rs`.)

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::DeleteParams;
use kube::{Api, Client, ResourceExt};

use crate::support::*;

fn pinned_to(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()?
        .node_selector
        .as_ref()?
        .get(HOST)
        .cloned()
}

/// A pod re-created a moment after its node went unreachable stays pinned to it (the grace
/// period `--node-lost-after` holds with the controller's taints and conditions), waits, and
/// comes back to its node when the kubelet returns.
#[tokio::test]
async fn a_short_outage_keeps_the_pin_and_the_pod_returns_to_its_node() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-short-outage").await;
    let (placed, _) = start_recorded(c, &ns, &pinned_statefulset("brief", 1)).await;
    let node = placed["brief-0"].node.clone();
    let kubelet = kubelet_dies(c, &node).await;
    // As an operator does for a pod on a node that does not answer.
    let old_uid = force_delete_pod(c, &ns, "brief-0").await;
    let waiting = created_again(c, &ns, "brief-0", &old_uid).await;
    assert_eq!(
        pinned_to(&waiting).as_deref(),
        Some(node.as_str()),
        "within --node-lost-after the pin stays"
    );
    assert!(
        waiting
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "it waits for its node"
    );
    kubelet_returns(c, &node, kubelet).await;
    let back = wait_replaced(c, &ns, "brief-0", &old_uid).await;
    assert_eq!(placement(&back).map(|p| p.node), Some(node.clone()));
    println!("brief-0: re-created while {node} was unreachable, waited, back on {node}");
    delete_namespace(c, &ns).await;
}

/// A node tainted `node.kubernetes.io/out-of-service` (non-graceful shutdown) is lost at once:
/// the re-created pod is not pinned to it and runs elsewhere.
#[tokio::test]
async fn an_out_of_service_node_is_lost_at_once() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-out-of-service").await;
    let (placed, _) = start_recorded(c, &ns, &pinned_statefulset("oos", 1)).await;
    let node = placed["oos-0"].node.clone();
    let kubelet = kubelet_dies(c, &node).await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    let old_uid = pods
        .get("oos-0")
        .await
        .expect("pod")
        .uid()
        .unwrap_or_default();
    let tainted = taint_out_of_service(c, &node).await;
    // The taint evicts the pod and the pod GC controller force-deletes it (the node is not
    // ready and out of service); an operator may do it first (only that pod: uid precondition).
    let params = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: Some(old_uid.clone()),
            resource_version: None,
        }),
        ..DeleteParams::default().grace_period(0)
    };
    let _ = pods.delete("oos-0", &params).await;
    let pod = wait_replaced(c, &ns, "oos-0", &old_uid).await;
    assert_ne!(
        pinned_to(&pod).as_deref(),
        Some(node.as_str()),
        "no pin to an out-of-service node"
    );
    assert_ne!(placement(&pod).map(|p| p.node), Some(node.clone()));
    wait_event(c, &ns, "oos", "RequiredTopologySkipped").await;
    tainted.restore().await;
    kubelet_returns(c, &node, kubelet).await;
    delete_namespace(c, &ns).await;
}

/// A node deleted and registered again under its name (a machine replaced) is reported: each
/// state records its node's uid, a Node of that name with another uid is a `NodeReplaced`
/// Event naming the pod and the node (its local data there is gone), and the pod running there
/// is recorded on the new node.
#[tokio::test]
async fn a_node_replaced_under_its_name_is_reported() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-node-replaced").await;
    let (placed, states) = start_recorded(c, &ns, &pinned_statefulset("repl", 1)).await;
    let node = placed["repl-0"].node.clone();
    let nodes: Api<Node> = Api::all(c.clone());
    let old_uid = nodes.get(&node).await.expect("node").uid();
    assert!(old_uid.is_some());
    assert_eq!(
        states["repl-0"].node_uid.as_deref(),
        old_uid.as_deref(),
        "the node's uid is recorded"
    );
    nodes
        .delete(&node, &DeleteParams::default())
        .await
        .expect("delete the node");
    let new_uid = wait_for(&format!("{node} registered again"), TIMEOUT, || async {
        nodes
            .get_opt(&node)
            .await
            .ok()??
            .uid()
            .filter(|uid| Some(uid) != old_uid.as_ref())
    })
    .await;
    wait_event_noting(c, &ns, "repl", "NodeReplaced", &["repl-0", &node]).await;
    let pps = pps_api(c, &ns);
    wait_for("repl-0 recorded on the new node", TIMEOUT, || async {
        let state = pps
            .get("repl")
            .await
            .ok()?
            .status?
            .pod_states
            .remove("repl-0")?;
        (state.node_uid.as_deref() == Some(new_uid.as_str())).then_some(())
    })
    .await;
    delete_namespace(c, &ns).await;
}

/// A pod re-created while its node was unreachable is pinned to it (the grace period); when
/// the node stays away past `--node-lost-after`, the controller releases the waiting pod (it
/// runs nothing: deleted by uid and resourceVersion), its StatefulSet re-creates it, and the
/// webhook injects what is still usable: it runs elsewhere. It waited because of the pin no
/// longer than `--node-lost-after` plus 30 s.
#[tokio::test]
async fn a_pod_stranded_after_admission_is_released_and_runs_elsewhere() {
    let env = env().await;
    let c = &env.client;
    let lost_after = lost_after(&env);
    let ns = namespace(c, "e2e-release").await;
    let (placed, _) = start_recorded(c, &ns, &pinned_statefulset("stuck", 1)).await;
    let node = placed["stuck-0"].node.clone();
    let before = scrape(&env).await;
    let kubelet = kubelet_dies(c, &node).await;
    let first_uid = force_delete_pod(c, &ns, "stuck-0").await;
    let waiting = created_again(c, &ns, "stuck-0", &first_uid).await;
    assert_eq!(
        pinned_to(&waiting).as_deref(),
        Some(node.as_str()),
        "admitted within the grace period: pinned"
    );
    let pinned_uid = waiting.uid().unwrap_or_default();
    let pinned_at = waiting
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .expect("created");
    let released = wait_for(
        "the pinned pod to be released and created again",
        lost_after + std::time::Duration::from_secs(90),
        || async {
            let pod = Api::<Pod>::namespaced(c.clone(), &ns)
                .get_opt("stuck-0")
                .await
                .ok()??;
            (pod.uid().as_deref() != Some(pinned_uid.as_str())
                && pod.uid().as_deref() != Some(first_uid.as_str()))
            .then_some(pod)
        },
    )
    .await;
    let waited = released
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .expect("created")
        .duration_since(pinned_at);
    let bound = k8s_openapi::jiff::SignedDuration::try_from(lost_after).expect("duration")
        + k8s_openapi::jiff::SignedDuration::from_secs(30);
    assert!(
        waited <= bound,
        "pending because of the pin for {waited:?}, more than --node-lost-after + 30 s"
    );
    assert_ne!(pinned_to(&released).as_deref(), Some(node.as_str()));
    let running = wait_replaced(c, &ns, "stuck-0", &pinned_uid).await;
    assert_ne!(placement(&running).map(|p| p.node), Some(node.clone()));
    wait_event_noting(c, &ns, "stuck", "PodReleased", &["stuck-0", &node]).await;
    let series = "pps_pods_released_total{reason=\"node_lost\"}";
    assert!(
        metric(&scrape(&env).await, series) > metric(&before, series),
        "{series} counted"
    );
    println!(
        "stuck-0: pinned to unreachable {node}, released after {waited:?} (--node-lost-after {}), now runs on {}",
        env.node_lost_after,
        placement(&running).map(|p| p.node).unwrap_or_default()
    );
    kubelet_returns(c, &node, kubelet).await;
    delete_namespace(c, &ns).await;
}

/// `explain -o json` of `pod`: its release outlook.
async fn explained_release(env: &Env, ns: &str, pod: &str) -> Vec<String> {
    let out = pps_command(env, &["explain", pod, "-n", ns, "-o", "json"]).await;
    let explained: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    serde_json::from_value(explained["release"].clone()).expect("release lines")
}

/// The pinned StatefulSet `name` (one pod, recorded) in `ns`, its node's kubelet stopped and its
/// pod force-deleted: re-created within the grace period, the pod is pinned to that node. The
/// node, its stopped kubelet and the pinned pod's uid.
async fn pinned_while_unreachable(
    c: &Client,
    ns: &str,
    name: &str,
) -> (String, StoppedKubelet, String) {
    let pod = format!("{name}-0");
    let (placed, _) = start_recorded(c, ns, &pinned_statefulset(name, 1)).await;
    let node = placed[&pod].node.clone();
    let kubelet = kubelet_dies(c, &node).await;
    let first_uid = force_delete_pod(c, ns, &pod).await;
    let waiting = created_again(c, ns, &pod, &first_uid).await;
    assert_eq!(pinned_to(&waiting).as_deref(), Some(node.as_str()));
    (node, kubelet, waiting.uid().unwrap_or_default())
}

/// A pod admitted pinned while its node was unreachable (within the grace period) is released
/// at once when the Node object is deleted (a deleted node is lost at once, long before
/// `--node-lost-after`), and runs elsewhere; `explain` said beforehand when it would go.
#[tokio::test]
async fn a_pod_pinned_to_a_node_deleted_after_admission_is_released_at_once() {
    let env = env().await;
    let c = &env.client;
    let lost_after = lost_after(&env);
    let ns = namespace(c, "e2e-release-deleted").await;
    let (node, kubelet, pinned_uid) = pinned_while_unreachable(c, &ns, "del").await;
    let outlook = explained_release(&env, &ns, "del-0").await;
    assert!(
        outlook.iter().any(|l| l.contains("released at")),
        "within the grace period explain says when: {outlook:?}"
    );
    let nodes: Api<Node> = Api::all(c.clone());
    nodes
        .delete(&node, &DeleteParams::default())
        .await
        .expect("delete the node");
    let deleted_at = std::time::Instant::now();
    let running = wait_replaced(c, &ns, "del-0", &pinned_uid).await;
    let took = deleted_at.elapsed();
    assert!(
        took < lost_after,
        "released {took:?} after the deletion: a deleted node is lost at once"
    );
    assert_ne!(placement(&running).map(|p| p.node), Some(node.clone()));
    wait_event_noting(c, &ns, "del", "PodReleased", &["del-0", &node]).await;
    println!("del-0: its node {node} deleted, released and running elsewhere {took:?} later");
    kubelet_returns(c, &node, kubelet).await;
    delete_namespace(c, &ns).await;
}

/// A pod pinned by a PersistentPodState that is gone by the time its node goes (here: no
/// longer generated, its workload's annotation removed) is released all the same: no
/// reconcile of that PersistentPodState can do it, so the controller's sweep of orphaned pins
/// does, with a `PodReleased` Event on the pod. Re-created with no PersistentPodState, it runs
/// elsewhere.
#[tokio::test]
async fn a_pod_pinned_by_a_persistent_pod_state_since_gone_is_released_when_its_node_goes() {
    let env = env().await;
    let c = &env.client;
    let lost_after = lost_after(&env);
    let ns = namespace(c, "e2e-release-orphan").await;
    let (node, kubelet, pinned_uid) = pinned_while_unreachable(c, &ns, "orph").await;
    patch_sts(
        c,
        &ns,
        "orph",
        serde_json::json!({"metadata": {"annotations": {"kruise.io/auto-generate-persistent-pod-state": null}}}),
    )
    .await;
    let pps = pps_api(c, &ns);
    wait_for(
        "the generated PersistentPodState to go",
        TIMEOUT,
        || async { pps.get_opt("orph").await.ok()?.is_none().then_some(()) },
    )
    .await;
    let before = scrape(&env).await;
    Api::<Node>::all(c.clone())
        .delete(&node, &DeleteParams::default())
        .await
        .expect("delete the node");
    let deleted_at = std::time::Instant::now();
    let running = wait_replaced(c, &ns, "orph-0", &pinned_uid).await;
    let took = deleted_at.elapsed();
    assert!(
        took < lost_after,
        "released {took:?} after the deletion: a deleted node is lost at once"
    );
    assert_eq!(pinned_to(&running), None, "no PersistentPodState: no pin");
    assert_ne!(placement(&running).map(|p| p.node), Some(node.clone()));
    wait_event_noting(c, &ns, "orph-0", "PodReleased", &[&node, "orph", "is gone"]).await;
    let series = "pps_pods_released_total{reason=\"node_gone\"}";
    assert!(
        metric(&scrape(&env).await, series) > metric(&before, series),
        "{series} counted"
    );
    println!(
        "orph-0: pinned by a PersistentPodState since gone; its node {node} deleted, released and running elsewhere {took:?} later"
    );
    kubelet_returns(c, &node, kubelet).await;
    delete_namespace(c, &ns).await;
}

const MAINTENANCE: &str = "e2e.persistent-pod-state.io/maintenance";

/// Taints `node` `MAINTENANCE:NoSchedule` (kept beside its other taints), or takes it away.
async fn maintenance_taint(c: &Client, node: &str, on: bool) {
    let nodes: Api<Node> = Api::all(c.clone());
    let mut kept: Vec<k8s_openapi::api::core::v1::Taint> =
        taints(&nodes.get(node).await.expect("node"))
            .into_iter()
            .filter(|t| t.key != MAINTENANCE)
            .collect();
    if on {
        kept.push(
            serde_json::from_value(serde_json::json!({"key": MAINTENANCE, "effect": "NoSchedule"}))
                .expect("taint"),
        );
    }
    nodes
        .patch(
            node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"taints": kept}})),
        )
        .await
        .expect("maintenance taint");
}

/// A node cordoned and tainted for maintenance by a test; both taken away when dropped (also
/// when the test fails half-way), so later tests find every node usable.
struct Maintenance(String);

impl Drop for Maintenance {
    fn drop(&mut self) {
        let node = self.0.clone();
        put_back(move |client| async move {
            maintenance_taint(&client, &node, false).await;
            set_unschedulable(&client, &node, false).await;
        });
    }
}

/// A pod pinned to its node while the node is cordoned waits for it (maintenance, as asked).
/// The node then takes a taint the pod does not tolerate: at admission the webhook would have
/// left the pin out, so once the pod has waited so for `--node-lost-after` the controller
/// releases it (by uid and resourceVersion), and re-created, it runs elsewhere.
#[tokio::test]
async fn a_pod_held_by_a_taint_its_node_took_after_admission_is_released_after_the_grace() {
    let env = env().await;
    let c = &env.client;
    let lost_after = lost_after(&env);
    let ns = namespace(c, "e2e-tainted").await;
    let (placed, _) = start_recorded(c, &ns, &pinned_statefulset("tainted", 1)).await;
    let node = placed["tainted-0"].node.clone();
    let before = scrape(&env).await;
    set_unschedulable(c, &node, true).await;
    let maintenance = Maintenance(node.clone());
    let first_uid = force_delete_pod(c, &ns, "tainted-0").await;
    let waiting = created_again(c, &ns, "tainted-0", &first_uid).await;
    assert_eq!(
        pinned_to(&waiting).as_deref(),
        Some(node.as_str()),
        "a cordoned node is waited for: pinned"
    );
    let pinned_uid = waiting.uid().unwrap_or_default();
    maintenance_taint(c, &node, true).await;
    let tainted_at = std::time::Instant::now();
    let released = wait_for(
        "the pinned pod to be released and created again",
        lost_after + std::time::Duration::from_secs(90),
        || async {
            let pod = Api::<Pod>::namespaced(c.clone(), &ns)
                .get_opt("tainted-0")
                .await
                .ok()??;
            (pod.uid().as_deref() != Some(pinned_uid.as_str())).then_some(pod)
        },
    )
    .await;
    let took = tainted_at.elapsed();
    assert!(
        took >= lost_after,
        "released {took:?} after the taint: not before --node-lost-after ({lost_after:?})"
    );
    assert_ne!(pinned_to(&released).as_deref(), Some(node.as_str()));
    let running = wait_replaced(c, &ns, "tainted-0", &pinned_uid).await;
    assert_ne!(placement(&running).map(|p| p.node), Some(node.clone()));
    wait_event_noting(c, &ns, "tainted", "PodReleased", &["tainted-0", &node]).await;
    let series = "pps_pods_released_total{reason=\"pod_constraints\"}";
    assert!(
        metric(&scrape(&env).await, series) > metric(&before, series),
        "{series} counted"
    );
    println!(
        "tainted-0: pinned to cordoned {node}, which took a taint it does not tolerate; released {took:?} later, now runs on {}",
        placement(&running).map(|p| p.node).unwrap_or_default()
    );
    drop(maintenance);
    delete_namespace(c, &ns).await;
}

/// The node label a relabeled test's pods select by.
const DISK: &str = "e2e.persistent-pod-state.io/disk";

/// Sets (or, with `None`, removes) the label [`DISK`] on `node`.
async fn disk_label(c: &Client, node: &str, value: Option<&str>) {
    Api::<Node>::all(c.clone())
        .patch(
            node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"metadata": {"labels": {DISK: value}}})),
        )
        .await
        .expect("node labelled");
}

/// The kubelet nodes labelled [`DISK`] by a test, and the one of them it cordoned: the labels
/// are removed and the node uncordoned when dropped (also when the test fails half-way).
struct DiskLabels(String);

impl Drop for DiskLabels {
    fn drop(&mut self) {
        let cordoned = self.0.clone();
        put_back(move |client| async move {
            for node in NODES {
                disk_label(&client, node, None).await;
            }
            if !cordoned.is_empty() {
                set_unschedulable(&client, &cordoned, false).await;
            }
        });
    }
}

/// A pod pinned to its node while the node is cordoned waits for it (maintenance, as asked).
/// The node is then relabeled so that the pod's own nodeSelector excludes it, and uncordoned:
/// no taint, so only the wait tells. Once the pod has waited pinned for `--node-lost-after`
/// the controller reads it, finds it held by its pin alone, and releases it once it has been so
/// for another `--node-lost-after`; re-created, it runs elsewhere.
#[tokio::test]
async fn a_pod_held_by_a_relabel_against_its_own_selector_after_admission_is_released() {
    let env = env().await;
    let c = &env.client;
    let lost_after = lost_after(&env);
    let ns = namespace(c, "e2e-relabeled").await;
    let mut guard = DiskLabels(String::new());
    for node in NODES {
        disk_label(c, node, Some("ssd")).await;
    }
    let mut sts = pinned_statefulset("relabeled", 1);
    if let Some(pod) = sts.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
        pod.node_selector = Some([(DISK.to_owned(), "ssd".to_owned())].into());
    }
    let (placed, _) = start_recorded(c, &ns, &sts).await;
    let node = placed["relabeled-0"].node.clone();
    guard.0 = node.clone();
    let before = scrape(&env).await;
    set_unschedulable(c, &node, true).await;
    let first_uid = force_delete_pod(c, &ns, "relabeled-0").await;
    let waiting = created_again(c, &ns, "relabeled-0", &first_uid).await;
    assert_eq!(
        pinned_to(&waiting).as_deref(),
        Some(node.as_str()),
        "a cordoned node is waited for: pinned"
    );
    let pinned_uid = waiting.uid().unwrap_or_default();
    disk_label(c, &node, Some("hdd")).await;
    set_unschedulable(c, &node, false).await;
    let relabeled_at = std::time::Instant::now();
    let released = wait_for(
        "the pinned pod to be released and created again",
        lost_after * 2 + std::time::Duration::from_secs(90),
        || async {
            let pod = Api::<Pod>::namespaced(c.clone(), &ns)
                .get_opt("relabeled-0")
                .await
                .ok()??;
            (pod.uid().as_deref() != Some(pinned_uid.as_str())).then_some(pod)
        },
    )
    .await;
    // Read once it has waited pinned for the grace (it was created just before the relabel),
    // found held by its pin alone then, and released after another grace.
    let took = relabeled_at.elapsed();
    let least = lost_after * 2 - std::time::Duration::from_secs(15);
    assert!(
        took >= least,
        "released {took:?} after the relabel: not before about twice --node-lost-after ({lost_after:?})"
    );
    assert_ne!(pinned_to(&released).as_deref(), Some(node.as_str()));
    let running = wait_replaced(c, &ns, "relabeled-0", &pinned_uid).await;
    assert_ne!(placement(&running).map(|p| p.node), Some(node.clone()));
    wait_event_noting(c, &ns, "relabeled", "PodReleased", &["relabeled-0", &node]).await;
    let series = "pps_pods_released_total{reason=\"pod_constraints\"}";
    assert!(
        metric(&scrape(&env).await, series) > metric(&before, series),
        "{series} counted"
    );
    println!(
        "relabeled-0: pinned to cordoned {node}, relabeled against its own nodeSelector and uncordoned; released {took:?} later, now runs on {}",
        placement(&running).map(|p| p.node).unwrap_or_default()
    );
    drop(guard);
    delete_namespace(c, &ns).await;
}
