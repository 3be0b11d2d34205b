//! Helpers of the e2e suite: the client of the local control plane, namespaces, workloads, and
//! polling with deadlines (never sleeps as synchronisation).

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Namespace, Node, PersistentVolume, Pod, Taint};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use persistent_pod_state::api::PodState;
use persistent_pod_state::api::v1alpha1::PersistentPodState;
use serde_json::{Value, json};

/// The nodes without a taint (the Calico-like ones are tainted).
pub const NODES: [&str; 4] = ["node-a1", "node-a2", "node-b1", "node-b2"];

/// How the suite reaches the system under test; set by e2e/run.sh. Missing settings fail the
/// test (never skip it).
pub struct Env {
    pub client: Client,
    /// The `serve` replicas behind the load balancer.
    pub replicas: Vec<Replica>,
    /// The load balancer's URL, which the API server calls.
    pub webhook_url: String,
    pub pps_bin: PathBuf,
    /// The release build of the binary, linked as shipped (`link/`).
    pub release_bin: PathBuf,
    pub cluster_dir: PathBuf,
    /// Lease duration the replicas run with.
    pub lease_duration: Duration,
    /// A kubeconfig of the manifests' ServiceAccount, which the replicas run with.
    pub sa_kubeconfig: PathBuf,
    /// The replicas' `--node-lost-after`, as they are given it.
    pub node_lost_after: String,
    /// helm, built at its pinned version.
    pub helm: PathBuf,
    /// The loopback load balancer standing in for a Service (e2e/loopback_lb.rs).
    pub lb_bin: PathBuf,
    /// etcd's client URL (its JSON gateway shows how an object is stored).
    pub etcd_url: String,
}

impl Env {
    /// The host the API server calls the webhooks at (0.0.0.0 unless run.sh was told
    /// otherwise: see e2e/lib.sh on the protocol it picks).
    pub fn webhook_host(&self) -> &str {
        let authority = self
            .webhook_url
            .strip_prefix("https://")
            .unwrap_or(&self.webhook_url);
        authority
            .rsplit_once(':')
            .map_or(authority, |(host, _port)| host)
    }
}

/// One `serve` replica started by e2e/run.sh.
#[derive(Clone, Debug)]
pub struct Replica {
    pub name: String,
    pub webhook_port: u16,
    pub probe_port: u16,
}

impl Replica {
    pub fn probe_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.probe_port)
    }

    /// The identity it holds the Lease with.
    pub fn identity(&self) -> String {
        format!("e2e-{}", self.name)
    }
}

fn replicas(spec: &str) -> Vec<Replica> {
    spec.split_whitespace()
        .map(|r| {
            let (name, ports) = r.split_once('=').expect("NAME=WEBHOOK:PROBE");
            let (w, p) = ports.split_once(':').expect("NAME=WEBHOOK:PROBE");
            Replica {
                name: name.to_owned(),
                webhook_port: w.parse().expect("port"),
                probe_port: p.parse().expect("port"),
            }
        })
        .collect()
}

fn setting(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the suite through e2e/run.sh (make test)")
    })
}

pub async fn env() -> Env {
    let _ = rustls::crypto::ring::default_provider().install_default();
    Env {
        client: Client::try_default()
            .await
            .expect("KUBECONFIG of the local control plane"),
        replicas: replicas(&setting("E2E_REPLICAS")),
        webhook_url: setting("E2E_WEBHOOK_URL"),
        pps_bin: setting("E2E_PPS_BIN").into(),
        release_bin: setting("E2E_RELEASE_BIN").into(),
        cluster_dir: setting("E2E_CLUSTER_DIR").into(),
        lease_duration: Duration::from_secs(
            setting("E2E_LEASE_DURATION").parse().expect("seconds"),
        ),
        sa_kubeconfig: setting("E2E_SA_KUBECONFIG").into(),
        node_lost_after: setting("E2E_NODE_LOST_AFTER"),
        helm: setting("E2E_HELM").into(),
        lb_bin: setting("E2E_LB_BIN").into(),
        etcd_url: setting("E2E_ETCD_URL"),
    }
}

pub const TIMEOUT: Duration = Duration::from_secs(90);

/// Polls `probe` every 200 ms until it returns `Some`, failing the test after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A fresh namespace (an old one of the same name is deleted first).
pub async fn namespace(client: &Client, name: &str) -> String {
    let api: Api<Namespace> = Api::all(client.clone());
    if api.get_opt(name).await.expect("get namespace").is_some() {
        let _ = api.delete(name, &DeleteParams::default()).await;
        wait_for(&format!("old namespace {name} to go"), TIMEOUT, || async {
            api.get_opt(name)
                .await
                .ok()
                .and_then(|n| n.is_none().then_some(()))
        })
        .await;
    }
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": name}})).expect("namespace");
    api.create(&PostParams::default(), &ns)
        .await
        .expect("create namespace");
    name.to_owned()
}

/// A StatefulSet whose generated PersistentPodState pins its pods to their node (required and
/// preferred hostname).
pub fn pinned_statefulset(name: &str, replicas: i32) -> StatefulSet {
    statefulset(
        name,
        replicas,
        &[
            ("kruise.io/auto-generate-persistent-pod-state", "true"),
            ("kruise.io/required-persistent-topology", HOST),
            ("kruise.io/preferred-persistent-topology", HOST),
        ],
    )
}

/// A StatefulSet like the seeds' echoserver, with `annotations` on the workload.
pub fn statefulset(name: &str, replicas: i32, annotations: &[(&str, &str)]) -> StatefulSet {
    let annotations: BTreeMap<&str, &str> = annotations.iter().copied().collect();
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "labels": {"app": name}, "annotations": annotations},
        "spec": {
            "serviceName": name, "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name},
                             "annotations": {"io.kubernetes.cri/reserved-ip-duration": "10"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{"name": "echoserver", "image": "cilium/echoserver:latest",
                                    "imagePullPolicy": "IfNotPresent"}]
                }
            }
        }
    }))
    .expect("statefulset")
}

pub async fn create_sts(client: &Client, ns: &str, sts: &StatefulSet) {
    Api::<StatefulSet>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), sts)
        .await
        .expect("create statefulset");
}

/// Whether the StatefulSet `name` has `replicas` Ready pods, all of its current revision.
pub async fn sts_rolled(client: &Client, ns: &str, name: &str, replicas: i32) -> bool {
    let Ok(sts) = Api::<StatefulSet>::namespaced(client.clone(), ns)
        .get(name)
        .await
    else {
        return false;
    };
    let Some(status) = sts.status else {
        return false;
    };
    let generation_seen = status.observed_generation == sts.metadata.generation;
    let rolled =
        status.update_revision.is_some() && status.current_revision == status.update_revision;
    let counts = status.ready_replicas.unwrap_or(0) == replicas
        && status.replicas == replicas
        && status.updated_replicas.unwrap_or(0) == replicas;
    generation_seen && rolled && counts
}

/// Waits until the StatefulSet has `replicas` Ready pods, all of its current revision.
pub async fn wait_sts_rolled(client: &Client, ns: &str, name: &str, replicas: i32) {
    wait_for(
        &format!("statefulset {ns}/{name} to have {replicas} ready pods of its revision"),
        TIMEOUT,
        || async { sts_rolled(client, ns, name, replicas).await.then_some(()) },
    )
    .await;
}

/// The node label the seeds pin pods by.
pub const HOST: &str = "kubernetes.io/hostname";

/// The node label of the nodes' zones (`zone-a`, `zone-b`).
pub const ZONE: &str = "topology.kubernetes.io/zone";

/// The preferred term the webhook injects for a recorded node (weight 100, the seeds').
pub fn preferred_host_term(node: &str) -> Value {
    json!({"weight": 100, "preference": {"matchExpressions": [
        {"key": HOST, "operator": "In", "values": [node]}]}})
}

/// Asserts that `pod` was steered back by the PersistentPodState `pps` (its injection
/// annotation, a preferred term for the recorded node) and runs on the recorded node.
pub fn assert_steered_back(pod: &Pod, pps: &str, recorded: &Placement) {
    let name = pod.name_any();
    assert_eq!(
        pod.annotations()
            .get(persistent_pod_state::api::INJECTED_ANNOTATION)
            .map(String::as_str),
        Some(pps),
        "{name} steered by {pps}"
    );
    assert_eq!(
        preferred_terms(pod),
        vec![preferred_host_term(&recorded.node)],
        "{name}'s preferred node"
    );
    assert_eq!(
        placement(pod).map(|p| p.node),
        Some(recorded.node.clone()),
        "{name} back on its node"
    );
}

/// Placement of a pod: node, IP and uid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub node: String,
    pub ip: String,
    pub uid: String,
}

pub fn placement(pod: &Pod) -> Option<Placement> {
    Some(Placement {
        node: pod.spec.as_ref()?.node_name.clone()?,
        ip: pod.status.as_ref()?.pod_ip.clone()?,
        uid: pod.uid()?,
    })
}

/// Placements of the Running, Ready pods `names`, once all of them are.
pub async fn placements(
    client: &Client,
    ns: &str,
    names: &[String],
) -> BTreeMap<String, Placement> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_for(
        &format!("pods {names:?} in {ns} to run"),
        TIMEOUT,
        || async {
            let mut out = BTreeMap::new();
            for name in names {
                let pod = api.get_opt(name).await.ok()??;
                if pod.metadata.deletion_timestamp.is_some()
                    || !persistent_pod_state::workload::is_ready(&pod)
                {
                    return None;
                }
                out.insert(name.clone(), placement(&pod)?);
            }
            Some(out)
        },
    )
    .await
}

pub fn pod_names(sts: &str, replicas: i32) -> Vec<String> {
    (0..replicas).map(|i| format!("{sts}-{i}")).collect()
}

/// Deletes a pod and waits for its replacement (another uid) to run; returns it.
pub async fn recreate_pod(client: &Client, ns: &str, name: &str) -> Pod {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let old_uid = api.get(name).await.expect("pod").uid().unwrap_or_default();
    api.delete(name, &DeleteParams::default())
        .await
        .expect("delete pod");
    wait_replaced(client, ns, name, &old_uid).await
}

pub fn pps_api(client: &Client, ns: &str) -> Api<PersistentPodState> {
    Api::namespaced(client.clone(), ns)
}

/// Merge-patches the StatefulSet `name`.
pub async fn patch_sts(c: &Client, ns: &str, name: &str, patch: Value) {
    Api::<StatefulSet>::namespaced(c.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .expect("patch the StatefulSet");
}

/// Scales the StatefulSet `name` to `replicas`.
pub async fn scale(c: &Client, ns: &str, name: &str, replicas: i32) {
    patch_sts(c, ns, name, json!({"spec": {"replicas": replicas}})).await;
}

/// The pod names of `sts` (from `spec.ordinals.start`, 0 when unset).
pub fn sts_pod_names(sts: &StatefulSet) -> Vec<String> {
    let spec = sts.spec.as_ref();
    let replicas = spec.and_then(|s| s.replicas).unwrap_or(1);
    let start = spec
        .and_then(|s| s.ordinals.as_ref())
        .and_then(|o| o.start)
        .unwrap_or(0);
    (start..start + replicas)
        .map(|i| format!("{}-{i}", sts.name_any()))
        .collect()
}

/// Creates `sts`, waits until all its pods run and its PersistentPodState records each on its
/// node: their placements and the recorded states.
pub async fn start_recorded(
    client: &Client,
    ns: &str,
    sts: &StatefulSet,
) -> (BTreeMap<String, Placement>, BTreeMap<String, PodState>) {
    start_recorded_by(client, ns, sts, &sts.name_any()).await
}

/// [`start_recorded`], with the states recorded by the PersistentPodState `pps`.
pub async fn start_recorded_by(
    client: &Client,
    ns: &str,
    sts: &StatefulSet,
    pps: &str,
) -> (BTreeMap<String, Placement>, BTreeMap<String, PodState>) {
    create_sts(client, ns, sts).await;
    wait_recorded(client, ns, &sts.name_any(), &sts_pod_names(sts), pps).await
}

/// Waits until the StatefulSet `name` runs exactly the Ready pods `pods`, all of its revision,
/// and the PersistentPodState `pps` records each on its node: their placements and the states.
pub async fn wait_recorded(
    client: &Client,
    ns: &str,
    name: &str,
    pods: &[String],
    pps: &str,
) -> (BTreeMap<String, Placement>, BTreeMap<String, PodState>) {
    let replicas = i32::try_from(pods.len()).expect("replicas");
    wait_sts_rolled(client, ns, name, replicas).await;
    let placed = placements(client, ns, pods).await;
    let states = wait_states(client, ns, pps, &placed).await;
    (placed, states)
}

/// Waits until the PersistentPodState `name` records exactly `expected` pods (by name), each on
/// the node `placements` gives; returns its states.
pub async fn wait_states(
    client: &Client,
    ns: &str,
    name: &str,
    expected: &BTreeMap<String, Placement>,
) -> BTreeMap<String, PodState> {
    let api = pps_api(client, ns);
    wait_for(
        &format!(
            "PersistentPodState {ns}/{name} to record {:?}",
            expected.keys()
        ),
        TIMEOUT,
        || async {
            let pps = api.get_opt(name).await.ok()??;
            let states = pps.status?.pod_states;
            let matches = states.len() == expected.len()
                && expected.iter().all(|(pod, p)| {
                    states.get(pod).and_then(|s| s.node_name.as_deref()) == Some(p.node.as_str())
                });
            matches.then_some(states)
        },
    )
    .await
}

/// Waits until the PersistentPodState `name` has exactly the pod states `names`.
pub async fn wait_state_names(client: &Client, ns: &str, name: &str, names: &[&str]) {
    let api = pps_api(client, ns);
    let want: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    wait_for(
        &format!("PersistentPodState {ns}/{name} to hold states {want:?}"),
        TIMEOUT,
        || async {
            let pps = api.get_opt(name).await.ok()??;
            let have: Vec<String> = pps
                .status
                .map(|s| s.pod_states.into_keys().collect())
                .unwrap_or_default();
            (have == want).then_some(())
        },
    )
    .await;
}

pub async fn node_labels(client: &Client, node: &str) -> BTreeMap<String, String> {
    Api::<Node>::all(client.clone())
        .get(node)
        .await
        .expect("node")
        .labels()
        .clone()
}

pub async fn set_unschedulable(client: &Client, node: &str, unschedulable: bool) {
    Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": unschedulable}})),
        )
        .await
        .expect("cordon/uncordon");
}

/// A node cordoned by [`cordon`]; uncordoned by [`Cordoned::lift`], or when dropped (also when
/// a test fails half-way), so later tests find every node usable.
pub struct Cordoned {
    client: Client,
    node: String,
    lifted: bool,
}

/// Cordons `node` until the returned guard uncordons it.
pub async fn cordon(c: &Client, node: &str) -> Cordoned {
    set_unschedulable(c, node, true).await;
    Cordoned {
        client: c.clone(),
        node: node.to_owned(),
        lifted: false,
    }
}

impl Cordoned {
    /// Uncordons the node.
    pub async fn lift(mut self) {
        set_unschedulable(&self.client, &self.node, false).await;
        self.lifted = true;
    }
}

impl Drop for Cordoned {
    fn drop(&mut self) {
        if self.lifted {
            return;
        }
        let node = self.node.clone();
        put_back(move |client| async move { set_unschedulable(&client, &node, false).await });
    }
}

/// The preferred node affinity terms of a pod, as JSON.
pub fn preferred_terms(pod: &Pod) -> Vec<Value> {
    pod.spec
        .as_ref()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| {
            na.preferred_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .map(|ts| {
            ts.iter()
                .filter_map(|t| serde_json::to_value(t).ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The sum of the Prometheus samples `name{labels} value` in `text` (0 if absent): `text` may
/// hold the scrapes of several replicas.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.trim().parse::<f64>().ok())
        })
        .sum()
}

/// The metrics of every replica, concatenated.
pub async fn scrape(env: &Env) -> String {
    let mut all = String::new();
    for r in &env.replicas {
        all.push_str(&http_get(&format!("{}/metrics", r.probe_url())).await.1);
    }
    all
}

/// A plain HTTP GET through curl: (status, body).
pub async fn http_get(url: &str) -> (u16, String) {
    curl(&["-s", "-w", "\n%{http_code}", url]).await
}

/// Runs curl with `args`, returning the status code (printed last by `-w`) and the body.
pub async fn curl(args: &[&str]) -> (u16, String) {
    let out = tokio::process::Command::new("curl")
        .args(args)
        .output()
        .await
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", text.as_str()));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// Deletes a test's namespace (and so its pods), so later tests schedule onto empty nodes.
pub async fn delete_namespace(client: &Client, name: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    let _ = api.delete(name, &DeleteParams::default()).await;
    wait_for(&format!("namespace {name} to go"), TIMEOUT, || async {
        api.get_opt(name)
            .await
            .ok()
            .and_then(|n| n.is_none().then_some(()))
    })
    .await;
}

/// CRDs standing in for cert-manager's Certificate and Issuer (no cert-manager runs here), so
/// the API server accepts the cert-manager overlay.
pub async fn stub_cert_manager_crds(env: &Env) {
    let api: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> = Api::all(env.client.clone());
    for (kind, plural) in [("Certificate", "certificates"), ("Issuer", "issuers")] {
        let crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition = serde_json::from_value(json!({
            "metadata": {"name": format!("{plural}.cert-manager.io")},
            "spec": {"group": "cert-manager.io", "scope": "Namespaced",
                "names": {"kind": kind, "plural": plural},
                "versions": [{"name": "v1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]}
        }))
        .expect("crd");
        match api.create(&PostParams::default(), &crd).await {
            Ok(_) | Err(kube::Error::Api(_)) => {}
            Err(e) => panic!("{e}"),
        }
    }
    wait_for("cert-manager stub CRDs established", TIMEOUT, || async {
        for name in ["certificates.cert-manager.io", "issuers.cert-manager.io"] {
            let crd = api.get(name).await.ok()?;
            crd.status?
                .conditions?
                .iter()
                .find(|c| c.type_ == "Established" && c.status == "True")?;
        }
        Some(())
    })
    .await;
}

/// Waits for an Event with `reason` about the PersistentPodState `pps` in `ns`.
pub async fn wait_event(client: &Client, ns: &str, pps: &str, reason: &str) {
    let _ = wait_event_noting(client, ns, pps, reason, &[]).await;
}

/// Waits for an Event with `reason` on PersistentPodState `ns/pps` whose note contains every
/// one of `needles`; returns it.
pub async fn wait_event_noting(
    client: &Client,
    ns: &str,
    pps: &str,
    reason: &str,
    needles: &[&str],
) -> k8s_openapi::api::events::v1::Event {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    wait_for(
        &format!("a {reason} Event on PersistentPodState {ns}/{pps} noting {needles:?}"),
        TIMEOUT,
        || async {
            let list = events.list(&Default::default()).await.ok()?;
            list.items.into_iter().find(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pps)
                    && needles
                        .iter()
                        .all(|n| e.note.as_deref().is_some_and(|note| note.contains(n)))
            })
        },
    )
    .await
}

/// A `serve` command for one more replica on loopback ports, with the suite's serving
/// certificate (as the replicas mount it) and `kubeconfig`, its output discarded and its Lease
/// where the replicas hold theirs; callers add what differs.
pub fn serve_command(
    env: &Env,
    kubeconfig: &std::path::Path,
    webhook_port: u16,
    probe_port: u16,
) -> std::process::Command {
    serve_command_of(env, &env.pps_bin, kubeconfig, webhook_port, probe_port)
}

/// [`serve_command`] of the binary `bin`.
pub fn serve_command_of(
    env: &Env,
    bin: &std::path::Path,
    kubeconfig: &std::path::Path,
    webhook_port: u16,
    probe_port: u16,
) -> std::process::Command {
    let certs = env.cluster_dir.join("webhook-tls");
    let mut command = std::process::Command::new(bin);
    command
        .arg("serve")
        .env("KUBECONFIG", kubeconfig)
        .env("PPS_LISTEN", format!("127.0.0.1:{webhook_port}"))
        .env("PPS_PROBE_LISTEN", format!("127.0.0.1:{probe_port}"))
        .env("PPS_TLS_CERT", certs.join("tls.crt"))
        .env("PPS_TLS_KEY", certs.join("tls.key"))
        .env("PPS_LEASE_NAMESPACE", "persistent-pod-state")
        .env("PPS_NODE_LOST_AFTER", &env.node_lost_after)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    command
}

/// Runs `put_back` to its end on a runtime and with a client of its own, as a guard does when a
/// failing test unwinds through it: the test's client runs its connections on the test's
/// runtime, which is blocked there.
pub fn put_back<F, Fut>(put_back: F)
where
    F: FnOnce(Client) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let _ = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Runtime::new() {
            rt.block_on(async {
                if let Ok(client) = Client::try_default().await {
                    put_back(client).await;
                }
            });
        }
    })
    .join();
}

/// A node marked lost by [`mark_node_lost`]; [`LostNode::revive`] brings it back (and so does
/// dropping it, should the test fail first), so later tests find every node Ready.
pub struct LostNode {
    client: Client,
    node: String,
    kubelet: Option<StoppedKubelet>,
    revived: bool,
}

async fn set_node_health(client: &Client, node: &str, lost_since: Option<&str>) {
    let nodes: Api<Node> = Api::all(client.clone());
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let (status, reason, since, taints) = match lost_since {
        Some(since) => (
            "Unknown",
            "NodeStatusUnknown",
            since.to_owned(),
            json!([
                {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule", "timeAdded": since},
                {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": since}
            ]),
        ),
        None => ("True", "KubeletReady", now.clone(), Value::Null),
    };
    let condition = json!({"status": {"conditions": [{"type": "Ready", "status": status,
        "reason": reason, "message": "set by the e2e suite", "lastHeartbeatTime": since,
        "lastTransitionTime": since}]}});
    nodes
        .patch_status(node, &PatchParams::default(), &Patch::Strategic(condition))
        .await
        .expect("node condition");
    nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": taints}})),
        )
        .await
        .expect("node taints");
}

/// Where the fake kubelet learns that a test stopped a node's kubelet (`NODE.stopped`).
fn kubelet_marker(node: &str) -> PathBuf {
    PathBuf::from(setting("E2E_CLUSTER_DIR"))
        .join("kubelet")
        .join(format!("{node}.stopped"))
}

/// A stopped fake kubelet, started again when dropped (also when a test fails half-way).
#[must_use]
pub struct StoppedKubelet(String);

impl Drop for StoppedKubelet {
    fn drop(&mut self) {
        start_kubelet(&self.0);
    }
}

/// Stops the fake kubelet of `node`, as a kubelet dies: it no longer renews the node's Lease,
/// reports its status, or starts or finalizes pods there, until the returned guard is dropped.
pub fn stop_kubelet(node: &str) -> StoppedKubelet {
    let marker = kubelet_marker(node);
    if let Some(dir) = marker.parent() {
        std::fs::create_dir_all(dir).expect("kubelet control dir");
    }
    std::fs::write(&marker, "").expect("kubelet stop marker");
    StoppedKubelet(node.to_owned())
}

/// Starts the fake kubelet of `node` again: it reports the node Ready and catches up.
fn start_kubelet(node: &str) {
    match std::fs::remove_file(kubelet_marker(node)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("kubelet stop marker: {e}"),
    }
}

/// Marks `node` as a node whose kubelet stopped reporting `ago` before now, as the node
/// lifecycle controller would have marked it by now: its kubelet stopped, `Ready` `Unknown`
/// since then, tainted `unreachable` (NoSchedule and NoExecute) since then.
pub async fn mark_node_lost(client: &Client, node: &str, ago: Duration) -> LostNode {
    let secs = i64::try_from(ago.as_secs()).expect("seconds");
    let since = k8s_openapi::jiff::Timestamp::now()
        .checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(secs))
        .expect("time")
        .to_string();
    let kubelet = stop_kubelet(node);
    set_node_health(client, node, Some(&since)).await;
    LostNode {
        client: client.clone(),
        node: node.to_owned(),
        kubelet: Some(kubelet),
        revived: false,
    }
}

impl LostNode {
    /// The kubelet reports again: Ready, untainted.
    pub async fn revive(mut self) {
        drop(self.kubelet.take());
        set_node_health(&self.client, &self.node, None).await;
        self.revived = true;
    }
}

impl Drop for LostNode {
    fn drop(&mut self) {
        if self.revived {
            return;
        }
        let node = self.node.clone();
        drop(self.kubelet.take());
        // A failing test unwinds here: revived, so the next test has the node.
        put_back(move |client| async move { set_node_health(&client, &node, None).await });
    }
}

/// Deletes a pod at once (grace period 0), as an operator does for a pod on a dead node.
pub async fn force_delete_pod(client: &Client, ns: &str, name: &str) -> String {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let uid = api.get(name).await.expect("pod").uid().unwrap_or_default();
    api.delete(name, &DeleteParams::default().grace_period(0))
        .await
        .expect("force delete");
    uid
}

/// Waits until the pod `name` is a new one (not `old_uid`), Ready, and returns it.
pub async fn wait_replaced(client: &Client, ns: &str, name: &str, old_uid: &str) -> Pod {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_for(
        &format!("pod {ns}/{name} to be replaced and Ready"),
        TIMEOUT,
        || async {
            let pod = api.get_opt(name).await.ok()??;
            let fresh =
                pod.uid().as_deref() != Some(old_uid) && pod.metadata.deletion_timestamp.is_none();
            (fresh && persistent_pod_state::workload::is_ready(&pod) && placement(&pod).is_some())
                .then_some(pod)
        },
    )
    .await
}

/// The identity holding the replicas' Lease, if any.
pub async fn holder(c: &Client) -> Option<String> {
    Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(c.clone(), "persistent-pod-state")
        .get_opt("persistent-pod-state")
        .await
        .ok()??
        .spec?
        .holder_identity
}

/// The replica holding the Lease (once one does), and another one.
pub async fn leader_and_follower(env: &Env) -> (Replica, Replica) {
    let leader = wait_for("a Lease holder", TIMEOUT, || holder(&env.client)).await;
    let find = |leads: bool| {
        env.replicas
            .iter()
            .find(|r| (r.identity() == leader) == leads)
            .cloned()
    };
    (
        find(true).expect("a replica leads"),
        find(false).expect("a follower"),
    )
}

/// The API server's minor version (e.g. 37 for v1.37.2).
pub async fn server_minor(client: &Client) -> u32 {
    let info = client.apiserver_version().await.expect("server version");
    info.minor
        .trim_end_matches('+')
        .parse()
        .unwrap_or_else(|e| panic!("minor version {:?}: {e}", info.minor))
}

/// Fails the test, saying why, when the control plane is older than 1.`minor` (the suite's
/// tests of newer features run on the current control plane; `make e2e-v1.20` runs only the
/// smoke subset on the oldest one).
pub async fn require_minor(client: &Client, minor: u32, what: &str) {
    let have = server_minor(client).await;
    assert!(
        have >= minor,
        "{what} needs Kubernetes >= 1.{minor}; this control plane is 1.{have}: run the full suite on the current version (make e2e)"
    );
}

/// The pod reviews the replicas answered so far (every result), from their own request counter.
pub async fn pod_reviews(env: &Env) -> f64 {
    let text = scrape(env).await;
    text.lines()
        .filter(|l| l.starts_with(r#"pps_admission_requests_total{endpoint="/mutate-pod","#))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `statefulset(name, replicas, annotations)` with `extra` merged into its JSON.
pub fn statefulset_with(
    name: &str,
    replicas: i32,
    annotations: &[(&str, &str)],
    extra: Value,
) -> StatefulSet {
    let mut sts = serde_json::to_value(statefulset(name, replicas, annotations)).expect("json");
    json_patch::merge(&mut sts, &extra);
    serde_json::from_value(sts).expect("statefulset")
}

/// A StorageClass `class` of node-local volumes: no provisioner, bound when a pod is scheduled.
pub async fn local_storage_class(c: &Client, class: &str) {
    let classes: Api<StorageClass> = Api::all(c.clone());
    let object: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": class}, "provisioner": "kubernetes.io/no-provisioner",
        "volumeBindingMode": "WaitForFirstConsumer"}))
    .expect("class");
    match classes.create(&PostParams::default(), &object).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("storage class: {e}"),
    }
}

/// A local PersistentVolume `name` of `class` that only `node` can mount (an old one of that
/// name is deleted first); reclaim policy Retain, as a static provisioner's.
pub async fn local_volume(c: &Client, class: &str, name: &str, node: &str) {
    delete_volume(c, name).await;
    let pv: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                 "persistentVolumeReclaimPolicy": "Retain", "storageClassName": class,
                 "local": {"path": "/mnt/e2e"},
                 "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                     {"key": HOST, "operator": "In", "values": [node]}]}]}}}}))
    .expect("pv");
    Api::<PersistentVolume>::all(c.clone())
        .create(&PostParams::default(), &pv)
        .await
        .expect("pv");
}

/// Deletes the PersistentVolume `name`, if any, and waits until it is gone.
pub async fn delete_volume(c: &Client, name: &str) {
    let pvs: Api<PersistentVolume> = Api::all(c.clone());
    let _ = pvs.delete(name, &DeleteParams::default()).await;
    wait_for(&format!("{name} to go"), TIMEOUT, || async {
        pvs.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await;
}

pub const UNREACHABLE: &str = "node.kubernetes.io/unreachable";

pub fn taints(node: &Node) -> Vec<Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
}

/// Stops `node`'s kubelet and waits until the node lifecycle controller has marked the node
/// unreachable: `Ready` `Unknown`, tainted unreachable NoSchedule and NoExecute.
pub async fn kubelet_dies(c: &Client, node: &str) -> StoppedKubelet {
    let kubelet = stop_kubelet(node);
    let nodes: Api<Node> = Api::all(c.clone());
    wait_for(
        &format!("the node lifecycle controller to mark {node} unreachable"),
        TIMEOUT,
        || async {
            let n = nodes.get(node).await.ok()?;
            let unknown = n
                .status
                .as_ref()?
                .conditions
                .as_ref()?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "Unknown");
            let t = taints(&n);
            let no_schedule = t
                .iter()
                .any(|t| t.key == UNREACHABLE && t.effect == "NoSchedule");
            let no_execute = t
                .iter()
                .any(|t| t.key == UNREACHABLE && t.effect == "NoExecute");
            (unknown && no_schedule && no_execute).then_some(())
        },
    )
    .await;
    kubelet
}

/// Starts `node`'s kubelet again and waits until the node is Ready and untainted.
pub async fn kubelet_returns(c: &Client, node: &str, kubelet: StoppedKubelet) {
    drop(kubelet);
    let nodes: Api<Node> = Api::all(c.clone());
    wait_for(&format!("{node} Ready and untainted"), TIMEOUT, || async {
        let n = nodes.get(node).await.ok()?;
        let ready = persistent_pod_state::placement::Health::now(std::time::Duration::ZERO)
            .lost_at(&n)
            .is_none();
        (ready && taints(&n).iter().all(|t| t.key != UNREACHABLE)).then_some(())
    })
    .await;
}

/// Taints `node` `node.kubernetes.io/out-of-service` (an operator's word that it is shut down
/// for good), or takes the taint away.
pub async fn out_of_service(c: &Client, node: &str, on: bool) {
    let nodes: Api<Node> = Api::all(c.clone());
    let mut kept: Vec<Taint> = taints(&nodes.get(node).await.expect("node"))
        .into_iter()
        .filter(|t| t.key != "node.kubernetes.io/out-of-service")
        .collect();
    if on {
        kept.push(
            serde_json::from_value(json!({"key": "node.kubernetes.io/out-of-service",
                "value": "nodeshutdown", "effect": "NoExecute"}))
            .expect("taint"),
        );
    }
    nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": kept}})),
        )
        .await
        .expect("out-of-service taint");
}

/// A node tainted out-of-service by [`taint_out_of_service`]; the taint is taken away by
/// [`OutOfService::restore`], or when dropped (also when a test fails half-way), so later
/// tests find every node usable.
pub struct OutOfService {
    client: Client,
    node: String,
    restored: bool,
}

/// Taints `node` out-of-service until the returned guard restores it.
pub async fn taint_out_of_service(c: &Client, node: &str) -> OutOfService {
    out_of_service(c, node, true).await;
    OutOfService {
        client: c.clone(),
        node: node.to_owned(),
        restored: false,
    }
}

impl OutOfService {
    /// Takes the taint away.
    pub async fn restore(mut self) {
        out_of_service(&self.client, &self.node, false).await;
        self.restored = true;
    }
}

impl Drop for OutOfService {
    fn drop(&mut self) {
        if self.restored {
            return;
        }
        let node = self.node.clone();
        put_back(move |client| async move { out_of_service(&client, &node, false).await });
    }
}

/// The replacement of `name` (another uid than `old_uid`), once created (scheduled or not).
pub async fn created_again(c: &Client, ns: &str, name: &str, old_uid: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(c.clone(), ns);
    wait_for(&format!("{name} to be created again"), TIMEOUT, || async {
        pods.get_opt(name)
            .await
            .ok()?
            .filter(|p| p.uid().as_deref() != Some(old_uid))
    })
    .await
}

/// Runs e2e/restart.sh: stops NAME (killed if `kill`), keeps it down `down`, starts it again.
pub async fn restart_component(env: &Env, name: &str, kill: bool, down: Duration) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/restart.sh");
    let mut args = vec![script.to_string_lossy().into_owned()];
    if kill {
        args.push("--kill".into());
    }
    args.push(name.into());
    args.push(down.as_secs().to_string());
    let status = tokio::process::Command::new("bash")
        .args(&args)
        .env("CLUSTER_DIR", &env.cluster_dir)
        .status()
        .await
        .expect("restart.sh runs");
    assert!(status.success(), "restart.sh {args:?}");
}

/// Whether the process `pid` has exited (gone, or a zombie not yet reaped).
pub fn exited(pid: &str) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
        || std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

pub fn pid_of(env: &Env, name: &str) -> String {
    std::fs::read_to_string(env.cluster_dir.join(format!("{name}.pid")))
        .expect("pid")
        .trim()
        .to_owned()
}

/// Runs the binary's `args` (a command such as `explain` or `release`) against the suite's
/// cluster, with the replicas' `--node-lost-after`; fails the test unless it succeeds. Its
/// standard output.
pub async fn pps_command(env: &Env, args: &[&str]) -> String {
    let out = tokio::process::Command::new(&env.pps_bin)
        .args(args)
        .env("PPS_NODE_LOST_AFTER", &env.node_lost_after)
        .output()
        .await
        .expect("the binary runs");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Installs a CRD whose objects keep any fields (no controller exists for them here).
pub async fn install_crd(
    c: &Client,
    group: &str,
    kind: &str,
    plural: &str,
    versions: &[(&str, bool)],
) {
    let versions: Vec<Value> = versions
        .iter()
        .map(|(name, storage)| json!({"name": name, "served": true, "storage": storage,
            "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
            "subresources": {"status": {}}}))
        .collect();
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": {"name": format!("{plural}.{group}")},
        "spec": {"group": group, "scope": "Namespaced", "versions": versions,
                 "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase()}}
    }))
    .expect("crd");
    let api: Api<CustomResourceDefinition> = Api::all(c.clone());
    match api.create(&PostParams::default(), &crd).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create CRD: {e}"),
    }
    let name = format!("{plural}.{group}");
    wait_for(&format!("CRD {name} established"), TIMEOUT, || async {
        let crd = api.get(&name).await.ok()?;
        crd.status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
            .then_some(())
    })
    .await;
}

/// Runs kubectl (the control plane's, as admin) in the repository with `args`, `stdin` as its
/// input: whether it succeeded, and its output (stdout then stderr).
pub async fn kubectl(env: &Env, args: &[&str], stdin: Option<&str>) -> (bool, String) {
    let mut child = tokio::process::Command::new("kubectl")
        .args(args)
        .env("KUBECONFIG", env.cluster_dir.join("kubeconfig"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl runs");
    let mut input = child.stdin.take().expect("stdin");
    tokio::io::AsyncWriteExt::write_all(&mut input, stdin.unwrap_or_default().as_bytes())
        .await
        .expect("write stdin");
    drop(input);
    combined(&child.wait_with_output().await.expect("kubectl ends"))
}

/// Whether a finished command succeeded, and its output (stdout then stderr).
fn combined(out: &std::process::Output) -> (bool, String) {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Runs helm with `args` against the control plane (as admin): whether it succeeded, and its
/// output (stdout then stderr).
pub async fn helm(env: &Env, args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(&env.helm)
        .args(args)
        .env("KUBECONFIG", env.cluster_dir.join("kubeconfig"))
        .env("HELM_CACHE_HOME", env.cluster_dir.join("helm/cache"))
        .env("HELM_CONFIG_HOME", env.cluster_dir.join("helm/config"))
        .env("HELM_DATA_HOME", env.cluster_dir.join("helm/data"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .await
        .expect("helm runs");
    combined(&out)
}

/// The YAML documents of `text` (a multi-document stream), empty ones left out.
pub fn yaml_documents(text: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).expect("yaml document"))
        .filter(|v| !v.is_null())
        .collect()
}

/// The replicas' `--node-lost-after` (`45s`, `5m`, ...).
pub fn lost_after(env: &Env) -> std::time::Duration {
    let text = env.node_lost_after.trim();
    let (number, unit) = text.split_at(text.len() - 1);
    let n: u64 = number.parse().expect("a duration like 45s or 5m");
    std::time::Duration::from_secs(match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        other => panic!("unit {other}"),
    })
}

/// Waits until pod `name` is gone.
pub async fn wait_pod_gone(c: &Client, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(c.clone(), ns);
    wait_for(&format!("{ns}/{name} to be gone"), TIMEOUT, || async {
        pods.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await;
}
