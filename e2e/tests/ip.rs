//! Keeping the pod IP through the CNI (issue 9): on the Calico-like nodes (the fake kubelet
//! honours `cni.projectcalico.org/ipAddrs` as calico-ipam does), a re-created pod asks for its
//! recorded IP and gets it on another node; an IP another pod took meanwhile is not asked for;
//! a scaled-down ordinal gets its IP back when it returns; what was restored is counted and
//! reported; `explain` prints the patch the next pod gets.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

use crate::support::*;

const CALICO_MARK: &str = "e2e.persistent-pod-state.io/cni";
const IP_REQUEST: &str = "persistent-pod-state.io/ip-request";
const CALICO_IP: &str = "cni.projectcalico.org/ipAddrs";

/// The Calico-like nodes' address pool is one for the whole suite: these tests take it in turn,
/// or one test's pod could take an address another test's pod recorded (the webhook then rightly
/// does not ask for it, and the other test fails on a race of the suite, not of the product).
static CALICO_POOL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A StatefulSet like the seeds', running on the Calico-like nodes only.
fn calico_sts(name: &str, replicas: i32, annotations: &[(&str, &str)]) -> StatefulSet {
    let mut sts = statefulset(name, replicas, annotations);
    let spec = sts
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
        .expect("pod spec");
    spec.node_selector = Some([(CALICO_MARK.to_string(), "calico".to_string())].into());
    spec.tolerations = Some(vec![
        serde_json::from_value(
            json!({"key": CALICO_MARK, "operator": "Exists", "effect": "NoSchedule"}),
        )
        .expect("toleration"),
    ]);
    sts
}

/// A hand-made PPS keeping states until the workload is deleted, asking for Calico IP requests.
async fn when_deleted_pps(c: &Client, ns: &str, name: &str) {
    let pps = serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1alpha1", "kind": "PersistentPodState",
        "metadata": {"name": name, "annotations": {IP_REQUEST: "calico"}},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name},
                 "preferredPersistentTopology": [{"weight": 100, "preference": {"nodeTopologyKeys": [HOST]}}],
                 "persistentPodStateRetentionPolicy": "WhenDeleted"}
    }))
    .expect("pps");
    pps_api(c, ns)
        .create(&PostParams::default(), &pps)
        .await
        .expect("create pps");
}

/// Waits until the PPS `name` records `pod` with the IP `ip`.
async fn wait_recorded_ip(c: &Client, ns: &str, name: &str, pod: &str, ip: &str) {
    let api = pps_api(c, ns);
    wait_for(
        &format!("{ns}/{name} to record {pod} with IP {ip}"),
        TIMEOUT,
        || async {
            let pps = api.get_opt(name).await.ok()??;
            let state = pps.status?.pod_states.remove(pod)?;
            (state.pod_ips == [ip.to_string()]).then_some(())
        },
    )
    .await;
}

fn restored(text: &str, node: &str, ip: &str) -> f64 {
    metric(
        text,
        &format!("pps_restored_total{{node=\"{node}\",ip=\"{ip}\"}}"),
    )
}

/// Issue 9.7: the recorded node cordoned, the re-created pod runs on another node with its old
/// IP; counted as node moved, IP kept, and a Warning Event names the move.
#[tokio::test]
async fn a_pod_re_created_on_another_node_gets_its_old_ip() {
    let _pool = CALICO_POOL.lock().await;
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-ip-move").await;
    create_sts(
        c,
        &ns,
        &calico_sts(
            "db",
            1,
            &[
                ("kruise.io/auto-generate-persistent-pod-state", "true"),
                ("kruise.io/preferred-persistent-topology", HOST),
                (IP_REQUEST, "calico"),
            ],
        ),
    )
    .await;
    wait_sts_rolled(c, &ns, "db", 1).await;
    let before = placements(c, &ns, &pod_names("db", 1)).await;
    let old = before["db-0"].clone();
    wait_recorded_ip(c, &ns, "db", "db-0", &old.ip).await;
    let scraped = scrape(&env).await;

    set_unschedulable(c, &old.node, true).await;
    let pod = recreate_pod(c, &ns, "db-0").await;
    set_unschedulable(c, &old.node, false).await;
    let now = placement(&pod).expect("placed");
    assert_ne!(now.node, old.node, "the recorded node is cordoned");
    assert_eq!(now.ip, old.ip, "the IP followed the pod to {}", now.node);
    assert_eq!(
        pod.annotations().get(CALICO_IP).map(String::as_str),
        Some(format!("[\"{}\"]", old.ip).as_str())
    );
    println!(
        "db-0: {} on {} -> {} on {}: IP kept across nodes",
        old.ip, old.node, now.ip, now.node
    );
    wait_for("the restoration counted", TIMEOUT, || async {
        (restored(&scrape(&env).await, "moved", "kept") > restored(&scraped, "moved", "kept"))
            .then_some(())
    })
    .await;
    let moved = format!("node {} -> {}", old.node, now.node);
    wait_event_noting(c, &ns, "db", "PodNotRestored", &["pod db-0 ", &moved]).await;
    delete_namespace(c, &ns).await;
}

/// Issue 9.3/9.7: an IP another pod took meanwhile is not requested (a skipped request is
/// reported) and the pod runs with a new IP; counted as IP changed.
#[tokio::test]
async fn an_ip_taken_meanwhile_is_not_requested_and_the_pod_gets_a_new_one() {
    let _pool = CALICO_POOL.lock().await;
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-ip-taken").await;
    when_deleted_pps(c, &ns, "db").await;
    create_sts(c, &ns, &calico_sts("db", 1, &[])).await;
    wait_sts_rolled(c, &ns, "db", 1).await;
    let old = placements(c, &ns, &pod_names("db", 1)).await["db-0"].clone();
    wait_recorded_ip(c, &ns, "db", "db-0", &old.ip).await;
    scale(c, &ns, "db", 0).await;
    wait_pod_gone(c, &ns, "db-0").await;

    // Another pod takes the address meanwhile.
    let squatter: Pod = serde_json::from_value(json!({
        "metadata": {"name": "squatter", "annotations": {CALICO_IP: format!("[\"{}\"]", old.ip)}},
        "spec": {"nodeSelector": {CALICO_MARK: "calico"},
                 "tolerations": [{"key": CALICO_MARK, "operator": "Exists", "effect": "NoSchedule"}],
                 "containers": [{"name": "c", "image": "busybox"}]}
    }))
    .expect("pod");
    Api::<Pod>::namespaced(c.clone(), &ns)
        .create(&PostParams::default(), &squatter)
        .await
        .expect("squatter");
    let taken = placements(c, &ns, &["squatter".to_string()]).await;
    assert_eq!(taken["squatter"].ip, old.ip);
    let scraped = scrape(&env).await;

    scale(c, &ns, "db", 1).await;
    let back = placements(c, &ns, &pod_names("db", 1)).await["db-0"].clone();
    assert_ne!(back.ip, old.ip, "the held IP was not requested");
    let pod = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("db-0")
        .await
        .expect("pod");
    assert!(
        pod.annotations().get(CALICO_IP).is_none(),
        "no request made"
    );
    println!(
        "db-0: {} held by squatter; came back with {}",
        old.ip, back.ip
    );
    let series = "pps_ip_request_skipped_total{reason=\"ip_held\"}";
    assert!(
        metric(&scrape(&env).await, series) > metric(&scraped, series),
        "{series}"
    );
    wait_event(c, &ns, "db", "IPRequestSkipped").await;
    wait_for("the changed IP counted", TIMEOUT, || async {
        let text = scrape(&env).await;
        let changed = |t: &str| restored(t, "kept", "changed") + restored(t, "moved", "changed");
        (changed(&text) > changed(&scraped)).then_some(())
    })
    .await;
    let changed = format!("IP {} -> {}", old.ip, back.ip);
    wait_event_noting(c, &ns, "db", "PodNotRestored", &["pod db-0 ", &changed]).await;
    delete_namespace(c, &ns).await;
}

/// Patch operations that set annotations, as (key, value).
fn annotations_in(patch: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for op in patch.as_array().into_iter().flatten() {
        let path = op["path"].as_str().unwrap_or_default();
        if path == "/metadata/annotations" {
            for (k, v) in op["value"].as_object().into_iter().flatten() {
                out.push((k.clone(), v.as_str().unwrap_or_default().to_owned()));
            }
        } else if let Some(key) = path.strip_prefix("/metadata/annotations/") {
            let key = key.replace("~1", "/").replace("~0", "~");
            out.push((key, op["value"].as_str().unwrap_or_default().to_owned()));
        }
    }
    out
}

/// Issue 9.4/9.6/9.7: scale 3 -> 2 -> 3 under WhenDeleted with the old node cordoned: the
/// returning ordinal gets its old IP on another node; `explain` prints the patch the next
/// re-created pod then gets; `kubectl get pps` shows recorded and restored pods.
#[tokio::test]
async fn scale_down_and_up_gives_the_returning_ordinal_its_old_ip_and_explain_shows_the_patch() {
    let _pool = CALICO_POOL.lock().await;
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-ip-scale").await;
    when_deleted_pps(c, &ns, "db").await;
    create_sts(c, &ns, &calico_sts("db", 3, &[])).await;
    wait_sts_rolled(c, &ns, "db", 3).await;
    let before = placements(c, &ns, &pod_names("db", 3)).await;
    let third = before["db-2"].clone();
    wait_recorded_ip(c, &ns, "db", "db-2", &third.ip).await;
    scale(c, &ns, "db", 2).await;
    wait_pod_gone(c, &ns, "db-2").await;
    wait_sts_rolled(c, &ns, "db", 2).await;
    let scraped = scrape(&env).await;

    set_unschedulable(c, &third.node, true).await;
    scale(c, &ns, "db", 3).await;
    let back = placements(c, &ns, &pod_names("db", 3)).await["db-2"].clone();
    set_unschedulable(c, &third.node, false).await;
    assert_ne!(back.node, third.node, "its node is cordoned");
    assert_eq!(back.ip, third.ip, "the returning ordinal has its old IP");
    // Issue 9.4: both halves came back with the ordinal: its IP request and its recorded node,
    // preferred (the pod waits for no cordoned node), as the PPS asks.
    let returned = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("db-2")
        .await
        .expect("db-2");
    assert_eq!(
        returned.annotations().get(CALICO_IP).map(String::as_str),
        Some(format!("[\"{}\"]", third.ip).as_str()),
        "the returning ordinal asked for its recorded IP"
    );
    assert_eq!(
        preferred_terms(&returned),
        vec![preferred_host_term(&third.node)],
        "the returning ordinal prefers its recorded node"
    );
    println!(
        "db-2: scaled down and up: {} on {} -> {} on {}",
        third.ip, third.node, back.ip, back.node
    );
    wait_for("the restoration counted", TIMEOUT, || async {
        (restored(&scrape(&env).await, "moved", "kept") > restored(&scraped, "moved", "kept"))
            .then_some(())
    })
    .await;
    let moved = format!("node {} -> {}", third.node, back.node);
    wait_event_noting(c, &ns, "db", "PodNotRestored", &["pod db-2 ", &moved]).await;

    // explain, then the pod it describes.
    let out = pps_command(&env, &["explain", "db-1", "-n", &ns, "-o", "json"]).await;
    let explained: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(explained["persistentPodState"], "db");
    assert_eq!(explained["outcome"], "inject");
    let promised = annotations_in(&explained["patch"]);
    assert!(
        promised
            .iter()
            .any(|(k, v)| k == CALICO_IP && v.contains(&before["db-1"].ip)),
        "{explained}"
    );
    println!(
        "{}",
        pps_command(&env, &["explain", "db-1", "-n", &ns]).await
    );
    let pod = recreate_pod(c, &ns, "db-1").await;
    for (k, v) in &promised {
        assert_eq!(pod.annotations().get(k), Some(v), "{k} as explain said");
    }
    let promised_terms: Vec<Value> = explained["patch"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|op| {
            op["path"]
                .as_str()
                .is_some_and(|p| p.starts_with("/spec/affinity"))
        })
        .map(|op| op["value"].clone())
        .collect();
    assert!(!promised_terms.is_empty(), "{explained}");
    let terms = serde_json::to_value(preferred_terms(&pod)).expect("json");
    for term in promised_terms {
        let wanted = term
            .pointer("/nodeAffinity/preferredDuringSchedulingIgnoredDuringExecution")
            .cloned()
            .unwrap_or(term);
        assert_eq!(terms, wanted, "the pod has the affinity explain printed");
    }

    let (_, table) = kubectl_get_pps(&ns).await;
    println!("{table}");
    let header = table.lines().next().unwrap_or_default();
    assert!(
        header.contains("RECORDED") && header.contains("RESTORED"),
        "{table}"
    );
    delete_namespace(c, &ns).await;
}

async fn kubectl_get_pps(ns: &str) -> (bool, String) {
    let out = tokio::process::Command::new("kubectl")
        .args(["-n", ns, "get", "pps"])
        .output()
        .await
        .expect("kubectl runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}
