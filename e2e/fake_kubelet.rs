//! A fake kubelet for the e2e control plane, where no real kubelet can run.
//!
//! - registers Ready nodes (`--node NAME=ZONE`, repeatable) with hostname and zone labels, plus
//!   `--node-label K=V` and `--node-taint K=V:EFFECT` on each;
//! - marks every pod bound to one of its nodes Running and Ready (again, if something marked it
//!   not ready; Ready only once the condition of each of its `readinessGates` is True, as the
//!   kubelet computes it, keeping those conditions), with a pod IP from its IPAM
//!   (`--ipam`):
//!   - `host-local` (default) as the seeds' patched host-local: per node a /24, the same pod
//!     name on the same node gets the same IP back, another node another IP;
//!   - `calico` as calico-ipam: per node a block of a cluster-wide pool (10.245.0.0/16); a pod
//!     annotated `cni.projectcalico.org/ipAddrs` (a JSON array) gets the requested IPv4 address
//!     on any node, provided it is in the pool and no running pod holds it; otherwise the
//!     sandbox fails, as Calico's CNI ADD does ("resource already exists"): a
//!     `FailedCreatePodSandBox` Event, and a retry every second until it can be honoured. An
//!     address is released when its pod is gone;
//! - reports what a real kubelet of the control plane's version reports: its version in
//!   `nodeInfo`, a node Lease in `kube-node-lease` (`--lease-seconds`, default 40 as the
//!   kubelet's; renewed every quarter of it: the heartbeat the node lifecycle controller reads),
//!   the node `Ready` again at once whenever it finds it otherwise (as a live kubelet's status
//!   update does) and every 5 minutes in any case, and per pod
//!   `observedGeneration`, `hostIPs`, `PodReadyToStartContainers`, and init
//!   containers as run (a native sidecar, `restartPolicy: Always`, running and ready; any other
//!   init container terminated with exit code 0);
//! - runs the containers of run-to-completion pods (`restartPolicy` Never or OnFailure, a Job's)
//!   whose image is one given by `--run-image REPOSITORY=BINARY`: the binary with the
//!   container's `args` and literal `env`, as the pod's ServiceAccount (a token from the
//!   TokenRequest API in a kubeconfig, where a kubelet would mount a projected token), then
//!   reports the pod Succeeded or Failed with the exit code, as a kubelet does; other pods'
//!   containers are only reported running;
//! - deletes pods that have a deletionTimestamp (there are no containers to stop);
//! - registers a node again (a new Node object, another uid) when its Node object is deleted
//!   while the kubelet runs, as a kubelet does;
//! - stops being the kubelet of a node while the file `NODE.stopped` exists in `--control-dir`
//!   (a test's way to kill a kubelet): like a dead kubelet it then neither renews the node's
//!   Lease nor reports its status, nor starts or finalizes pods there (the node lifecycle
//!   controller, where it runs, marks the node `Unknown` and taints it unreachable); once the
//!   file is gone it reports the node Ready again and catches up with every pod bound to it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::TryStreamExt;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Container, Node, Pod, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use persistent_pod_state::sync::lock;
use serde_json::{Value, json};

const CALICO_IP_ANNOTATION: &str = "cni.projectcalico.org/ipAddrs";

/// How pod addresses are given.
enum Ipam {
    /// Per node a /24 (10.244.N.0/24), per namespace/pod name one address, kept forever.
    HostLocal {
        subnets: HashMap<String, u8>,
        allocated: HashMap<String, BTreeMap<String, u8>>,
    },
    /// Per node a block (10.245.N.0/24) of the pool 10.245.0.0/16; requested addresses
    /// anywhere in the pool; an address is held by one pod uid until that pod is gone.
    Calico {
        blocks: HashMap<String, u8>,
        held: HashMap<Ipv4Addr, String>,
    },
}

/// Why a sandbox could not be created.
struct SandboxError(String);

impl Ipam {
    fn knows(&self, node: &str) -> bool {
        match self {
            Self::HostLocal { subnets, .. } => subnets.contains_key(node),
            Self::Calico { blocks, .. } => blocks.contains_key(node),
        }
    }

    fn add_node(&mut self, node: &str, index: u8) {
        match self {
            Self::HostLocal { subnets, .. } => subnets.insert(node.to_owned(), index),
            Self::Calico { blocks, .. } => blocks.insert(node.to_owned(), index),
        };
    }

    /// The address of `pod` on `node` (already allocated to it, or newly).
    fn address(&mut self, node: &str, pod: &Pod) -> Result<String, SandboxError> {
        let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        match self {
            Self::HostLocal { subnets, allocated } => {
                let subnet = *subnets
                    .get(node)
                    .ok_or_else(|| SandboxError("unknown node".into()))?;
                let table = allocated.entry(node.to_owned()).or_default();
                let host = match table.get(&key) {
                    Some(h) => *h,
                    None => {
                        let used: Vec<u8> = table.values().copied().collect();
                        let free = (2..=254)
                            .find(|h| !used.contains(h))
                            .ok_or_else(|| SandboxError("no free address".into()))?;
                        table.insert(key, free);
                        free
                    }
                };
                Ok(format!("10.244.{subnet}.{host}"))
            }
            Self::Calico { blocks, held } => {
                let uid = pod.uid().unwrap_or_default();
                if let Some((ip, _)) = held.iter().find(|(_, u)| **u == uid) {
                    return Ok(ip.to_string());
                }
                let requested = pod.annotations().get(CALICO_IP_ANNOTATION);
                let ip = match requested {
                    Some(text) => {
                        let list: Vec<String> = serde_json::from_str(text).map_err(|e| {
                            SandboxError(format!("{CALICO_IP_ANNOTATION} is not a JSON list: {e}"))
                        })?;
                        let ip = list
                            .iter()
                            .find_map(|s| s.parse::<Ipv4Addr>().ok())
                            .ok_or_else(|| SandboxError("no IPv4 address requested".into()))?;
                        if ip.octets()[..2] != [10, 245] {
                            return Err(SandboxError(format!("{ip} is not in any pool")));
                        }
                        if let Some(other) = held.get(&ip) {
                            return Err(SandboxError(format!(
                                "failed to request IP {ip}: resource already exists (held by pod uid {other})"
                            )));
                        }
                        ip
                    }
                    None => {
                        let block = *blocks
                            .get(node)
                            .ok_or_else(|| SandboxError("unknown node".into()))?;
                        (2..=254)
                            .map(|h| Ipv4Addr::new(10, 245, block, h))
                            .find(|ip| !held.contains_key(ip))
                            .ok_or_else(|| SandboxError("block exhausted".into()))?
                    }
                };
                held.insert(ip, uid);
                Ok(ip.to_string())
            }
        }
    }

    /// Releases what `uid` holds (its pod is gone).
    fn release(&mut self, uid: &str) {
        if let Self::Calico { held, .. } = self {
            held.retain(|_, u| u != uid);
        }
    }
}

/// The kubelet's state shared by its loops.
struct Kubelet {
    client: Client,
    ipam: Mutex<Ipam>,
    nodes: Store<Node>,
    /// Pods to look at again every second (a failed sandbox, or a start or finalization the API
    /// server did not take): (namespace, name).
    retry: Mutex<BTreeSet<(String, String)>>,
    /// Where a test stops a node's kubelet (`NODE.stopped`).
    control_dir: Option<PathBuf>,
    /// The nodes whose kubelet is stopped now.
    stopped: Mutex<BTreeSet<String>>,
    /// How long the node Lease lasts.
    lease: Duration,
    /// How each node is registered: its zone, and the labels, taints and version of all.
    registration: Registration,
    /// Images whose containers run for real: repository -> the binary standing for it.
    run_images: HashMap<String, PathBuf>,
    /// Run-to-completion pods started (by uid): each runs once.
    started: Mutex<BTreeSet<String>>,
}

/// The repository of an image reference (`repo:tag`, `repo@digest`, `host:port/repo:tag`).
fn repository(image: &str) -> &str {
    let image = image.split('@').next().unwrap_or(image);
    match image.rfind(':') {
        Some(i) if !image[i..].contains('/') => &image[..i],
        _ => image,
    }
}

/// What a node is registered with.
struct Registration {
    zones: HashMap<String, String>,
    labels: Vec<(String, String)>,
    taints: Vec<Value>,
    version: String,
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

fn is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The Ready condition a live kubelet reports.
fn ready_condition() -> Value {
    json!({"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fake kubelet",
           "lastHeartbeatTime": now(), "lastTransitionTime": now()})
}

async fn register(
    nodes: &Api<Node>,
    name: &str,
    zone: &str,
    version: &str,
    labels: &[(String, String)],
    taints: &[Value],
) -> anyhow::Result<()> {
    let mut all = json!({
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "topology.kubernetes.io/zone": zone,
        "failure-domain.beta.kubernetes.io/zone": zone,
    });
    for (k, v) in labels {
        all[k] = json!(v);
    }
    let node =
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": all}});
    match nodes
        .create(&PostParams::default(), &serde_json::from_value(node)?)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e).context("creating node"),
    }
    let resources = json!({"cpu": "8", "memory": "32Gi", "pods": "110"});
    let status = json!({"status": {
        "capacity": resources, "allocatable": resources,
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
        "conditions": [ready_condition()],
        "nodeInfo": {"kubeletVersion": version, "machineID": "", "systemUUID": "", "bootID": "",
            "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "", "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": "amd64"},
    }});
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .context("marking node Ready")?;
    // The taints asked for, and none else (the node lifecycle controller that would lift a
    // registration taint does not run here).
    let taints = if taints.is_empty() {
        Value::Null
    } else {
        json!(taints)
    };
    nodes
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": taints}})),
        )
        .await
        .context("setting taints")?;
    Ok(())
}

impl Kubelet {
    /// Starts `pod` if it is bound to a live node of ours, finalizes it if it is being deleted.
    async fn handle(&self, pod: &Pod) -> anyhow::Result<()> {
        let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            return Ok(());
        };
        let ours = lock(&self.ipam).knows(&node);
        if !ours || lock(&self.stopped).contains(&node) {
            return Ok(());
        }
        let ns = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        // Writes name this very pod (its uid): an event of an older pod of the same name must
        // not act on its successor.
        let uid = pod.uid().unwrap_or_default();
        if pod.metadata.deletion_timestamp.is_some() {
            lock(&self.retry).remove(&(ns.clone(), name.clone()));
            let params = DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: Some(uid),
                    resource_version: None,
                }),
                ..DeleteParams::default().grace_period(0)
            };
            return match api.delete(&name, &params).await {
                // Gone, or (409: uid precondition) already replaced by a new pod.
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(()),
                // As a kubelet's periodic sync would: try again.
                Err(e) => {
                    lock(&self.retry).insert((ns, name));
                    Err(e.into())
                }
            };
        }
        if let Some(binary) = self.runs_for_real(pod) {
            if lock(&self.started).insert(uid.clone()) {
                self.run_to_completion(pod.clone(), node, binary).await;
            }
            return Ok(());
        }
        // Running and Ready as it should be reported: nothing to do. A pod the node lifecycle
        // controller marked not ready (its node was unknown for a while) is reported Ready
        // again, as the kubelet's status manager does. Ready also needs the condition of each
        // readiness gate True, as the kubelet computes it: others set those, and they are kept.
        let conditions = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        let gates: Vec<String> = pod
            .spec
            .as_ref()
            .and_then(|s| s.readiness_gates.as_ref())
            .map(|g| g.iter().map(|g| g.condition_type.clone()).collect())
            .unwrap_or_default();
        let gate_open = |gate: &String| {
            conditions
                .iter()
                .any(|c| &c.type_ == gate && c.status == "True")
        };
        let closed = gates.iter().find(|g| !gate_open(g));
        let running = pod
            .status
            .as_ref()
            .is_some_and(|s| s.phase.as_deref() == Some("Running") && s.pod_ip.is_some())
            && conditions
                .iter()
                .any(|c| c.type_ == "ContainersReady" && c.status == "True")
            && persistent_pod_state::workload::is_ready(pod) == closed.is_none();
        if running {
            return Ok(());
        }
        let address = lock(&self.ipam).address(&node, pod);
        let ip = match address {
            Ok(ip) => {
                lock(&self.retry).remove(&(ns.clone(), name.clone()));
                ip
            }
            Err(SandboxError(message)) => {
                let first = lock(&self.retry).insert((ns.clone(), name.clone()));
                if first {
                    self.sandbox_failed(pod, &node, &message).await;
                }
                return Ok(());
            }
        };
        let now = now();
        let cond = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": now});
        let running = |c: &Container| {
            json!({
                "name": c.name, "image": c.image.clone().unwrap_or_default(), "imageID": "",
                "ready": true, "started": true, "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            })
        };
        let spec = pod.spec.as_ref();
        let containers: Vec<_> = spec
            .map(|s| s.containers.iter().map(running).collect())
            .unwrap_or_default();
        // Init containers have run: a native sidecar keeps running, any other one has completed.
        let init: Vec<_> = spec
            .and_then(|s| s.init_containers.as_ref())
            .map(|cs| {
                cs.iter()
                    .map(|c| {
                        if c.restart_policy.as_deref() == Some("Always") {
                            running(c)
                        } else {
                            json!({
                                "name": c.name, "image": c.image.clone().unwrap_or_default(), "imageID": "",
                                "ready": true, "started": false, "restartCount": 0,
                                "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                    "startedAt": now, "finishedAt": now}},
                            })
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let ready = match closed {
            None => cond("Ready"),
            Some(gate) => json!({"type": "Ready", "status": "False",
                "reason": "ReadinessGatesNotReady", "lastTransitionTime": now,
                "message": format!("the condition of pod readiness gate \"{gate}\" is not True")}),
        };
        let mut reported = vec![
            cond("PodReadyToStartContainers"),
            cond("Initialized"),
            ready,
            cond("ContainersReady"),
            cond("PodScheduled"),
        ];
        // The gates' conditions, as others set them (the list is written whole).
        reported.extend(
            conditions
                .iter()
                .filter(|c| gates.contains(&c.type_))
                .filter_map(|c| serde_json::to_value(c).ok()),
        );
        // On the version read: a gate's condition set meanwhile is not written over (the
        // conflict is left to the event that brings it).
        let status = json!({"metadata": {"uid": uid, "resourceVersion": pod.resource_version()}, "status": {
            "observedGeneration": pod.metadata.generation,
            "phase": "Running", "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": ip, "podIPs": [{"ip": ip}], "startTime": now,
            "conditions": reported,
            "initContainerStatuses": init,
            "containerStatuses": containers,
        }});
        match api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await
        {
            Ok(_) => Ok(()),
            // Gone, or (uid) replaced meanwhile.
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 || e.code == 422 => Ok(()),
            Err(e) => {
                lock(&self.retry).insert((ns, name));
                Err(e.into())
            }
        }
    }

    /// The binary standing for `pod`'s single container when the pod runs to completion and
    /// its image is one of `--run-image`, unless it has finished already.
    fn runs_for_real(&self, pod: &Pod) -> Option<PathBuf> {
        let spec = pod.spec.as_ref()?;
        let finished = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| p == "Succeeded" || p == "Failed");
        let to_completion = matches!(spec.restart_policy.as_deref(), Some("Never" | "OnFailure"));
        let [container] = spec.containers.as_slice() else {
            return None;
        };
        let image = repository(container.image.as_deref()?);
        let binary = self.run_images.get(image)?;
        (to_completion && !finished).then(|| binary.clone())
    }

    /// Runs `pod`'s container (its `args`, its literal `env`) with `binary` as the pod's
    /// ServiceAccount, then reports the pod Succeeded or Failed with the exit code. In the
    /// background: the kubelet's other pods do not wait for it.
    async fn run_to_completion(&self, pod: Pod, node: String, binary: PathBuf) {
        let client = self.client.clone();
        tokio::spawn(async move {
            let name = pod.name_any();
            let (code, message) = match run_container(&client, &pod, &binary).await {
                Ok((code, output)) => (code, output),
                Err(error) => (128, format!("{error:#}")),
            };
            tracing::info!(pod = %name, %node, code, %message, "container ran");
            let now = now();
            let spec = pod.spec.as_ref();
            let container = spec.and_then(|s| s.containers.first());
            let phase = if code == 0 { "Succeeded" } else { "Failed" };
            let status = json!({"metadata": {"uid": pod.uid()}, "status": {
                "phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
                "startTime": now,
                "conditions": [
                    {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                    {"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now},
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": now}],
                "containerStatuses": [{
                    "name": container.map(|c| c.name.clone()).unwrap_or_default(),
                    "image": container.and_then(|c| c.image.clone()).unwrap_or_default(),
                    "imageID": "", "ready": false, "started": false, "restartCount": 0,
                    "state": {"terminated": {"exitCode": code,
                        "reason": if code == 0 { "Completed" } else { "Error" },
                        "message": message, "startedAt": now, "finishedAt": now}}}],
            }});
            let api: Api<Pod> = Api::namespaced(client, &pod.namespace().unwrap_or_default());
            if let Err(error) = api
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                .await
            {
                tracing::warn!(pod = %name, %error, "completion not reported");
            }
        });
    }

    /// The kubelet's Event for a sandbox that could not be created.
    async fn sandbox_failed(&self, pod: &Pod, node: &str, message: &str) {
        tracing::warn!(pod = %pod.name_any(), %message, "sandbox not created; retrying");
        let ns = pod.namespace().unwrap_or_default();
        let events: Api<k8s_openapi::api::core::v1::Event> =
            Api::namespaced(self.client.clone(), &ns);
        let event = json!({
            "metadata": {"generateName": format!("{}.", pod.name_any())},
            "involvedObject": pod.object_ref(&()),
            "reason": "FailedCreatePodSandBox", "type": "Warning",
            "message": format!("Failed to create pod sandbox: {message}"),
            "source": {"component": "kubelet", "host": node},
            "firstTimestamp": now(), "lastTimestamp": now(), "count": 1,
        });
        if let Ok(event) = serde_json::from_value(event)
            && let Err(error) = events.create(&PostParams::default(), &event).await
        {
            tracing::warn!(%error, "could not publish the sandbox Event");
        }
    }

    /// Handles every pod bound to `node` (after it came back).
    async fn catch_up(&self, node: &str) {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let bound = ListParams::default().fields(&format!("spec.nodeName={node}"));
        match pods.list(&bound).await {
            Ok(list) => {
                for pod in list.items {
                    if let Err(error) = self.handle(&pod).await {
                        tracing::warn!(pod = %pod.name_any(), %error, "pod not handled");
                    }
                }
            }
            Err(error) => tracing::warn!(%node, %error, "cannot list the pods of a revived node"),
        }
    }

    /// Whether a test has stopped `node`'s kubelet.
    fn stopped_by_test(&self, node: &str) -> bool {
        self.control_dir
            .as_ref()
            .is_some_and(|dir| dir.join(format!("{node}.stopped")).exists())
    }

    /// The kubelets' heartbeat, every second: which are stopped; for each live one the node
    /// Lease renewed every quarter of its duration, the node reported Ready whenever it is found
    /// otherwise and every 5 minutes (the kubelet's `nodeStatusReportFrequency`); a kubelet
    /// started again catches up with its pods.
    async fn heartbeat(&self, names: Vec<String>) {
        const REPORT_EVERY: Duration = Duration::from_secs(300);
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), "kube-node-lease");
        let nodes: Api<Node> = Api::all(self.client.clone());
        let (mut renewed, mut reported): (HashMap<String, Instant>, HashMap<String, Instant>) =
            (HashMap::new(), HashMap::new());
        let renew_every = self.lease / 4;
        loop {
            for name in &names {
                if self.stopped_by_test(name) {
                    if lock(&self.stopped).insert(name.clone()) {
                        tracing::info!(node = %name, "kubelet stopped by the test");
                    }
                    continue;
                }
                let Some(node) = self.nodes.get(&ObjectRef::new(name)) else {
                    // Its Node object was deleted: a kubelet registers its node again (a new
                    // object, another uid).
                    let r = &self.registration;
                    let zone = r.zones.get(name).map(String::as_str).unwrap_or_default();
                    match register(&nodes, name, zone, &r.version, &r.labels, &r.taints).await {
                        Ok(()) => {
                            tracing::info!(node = %name, "node object gone; registered again")
                        }
                        Err(error) => {
                            tracing::warn!(node = %name, %error, "cannot register the node again")
                        }
                    }
                    continue;
                };
                let revived = lock(&self.stopped).remove(name);
                if renewed
                    .get(name)
                    .is_none_or(|at| at.elapsed() >= renew_every)
                {
                    let lease = json!({
                        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": name, "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                            "name": name, "uid": node.uid().unwrap_or_default()}]},
                        "spec": {"holderIdentity": name, "leaseDurationSeconds": self.lease.as_secs(),
                            "renewTime": MicroTime(k8s_openapi::jiff::Timestamp::now())},
                    });
                    let params = PatchParams::apply("fake-kubelet").force();
                    match leases.patch(name, &params, &Patch::Apply(&lease)).await {
                        Ok(_) => {
                            renewed.insert(name.clone(), Instant::now());
                        }
                        Err(error) => {
                            tracing::warn!(node = %name, %error, "node lease not renewed")
                        }
                    }
                }
                let due = !is_ready(&node)
                    || reported
                        .get(name)
                        .is_none_or(|at| at.elapsed() >= REPORT_EVERY);
                if due {
                    // Conditional on the node as just seen: a test that marked it dead in the
                    // meantime (after stopping this kubelet) is not overwritten.
                    let status = json!({
                        "metadata": {"resourceVersion": node.resource_version()},
                        "status": {"conditions": [ready_condition()]},
                    });
                    match nodes
                        .patch_status(name, &PatchParams::default(), &Patch::Strategic(&status))
                        .await
                    {
                        Ok(_) => {
                            reported.insert(name.clone(), Instant::now());
                        }
                        Err(kube::Error::Api(e)) if e.code == 409 => {}
                        Err(error) => {
                            tracing::warn!(node = %name, %error, "node status not reported")
                        }
                    }
                }
                if revived {
                    tracing::info!(node = %name, "kubelet started again; catching up");
                    self.catch_up(name).await;
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Retries the pods to look at again, every second.
    async fn retry_sandboxes(&self) {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let pending: Vec<(String, String)> = lock(&self.retry).iter().cloned().collect();
            for (ns, name) in pending {
                let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
                match api.get_opt(&name).await {
                    Ok(Some(pod)) => {
                        if let Err(error) = self.handle(&pod).await {
                            tracing::warn!(pod = %name, %error, "pod not handled");
                        }
                    }
                    Ok(None) => {
                        lock(&self.retry).remove(&(ns, name));
                    }
                    Err(error) => tracing::warn!(pod = %name, %error, "cannot read pod"),
                }
            }
        }
    }
}

/// Runs `pod`'s container with `binary` as its ServiceAccount: the exit code and the last
/// lines of its output.
async fn run_container(
    client: &Client,
    pod: &Pod,
    binary: &PathBuf,
) -> anyhow::Result<(i32, String)> {
    let ns = pod.namespace().unwrap_or_default();
    let spec = pod.spec.as_ref().context("no spec")?;
    let container = spec.containers.first().context("no container")?;
    anyhow::ensure!(
        container.command.is_none(),
        "only the image's entrypoint runs here (no `command`)"
    );
    let account = spec.service_account_name.as_deref().unwrap_or("default");
    let request = TokenRequest {
        spec: TokenRequestSpec {
            expiration_seconds: Some(600),
            ..TokenRequestSpec::default()
        },
        ..TokenRequest::default()
    };
    let token = Api::<ServiceAccount>::namespaced(client.clone(), &ns)
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .context("token for the pod's ServiceAccount")?
        .status
        .context("no token issued")?
        .token;
    // The kubelet's own kubeconfig with the pod's token as its only credentials.
    let mut config = kube::config::Kubeconfig::read().context("reading the kubeconfig")?;
    for user in &mut config.auth_infos {
        user.auth_info = Some(kube::config::AuthInfo {
            token: Some(token.clone().into()),
            ..kube::config::AuthInfo::default()
        });
    }
    let dir = std::env::temp_dir().join(format!("fake-kubelet-{}", pod.uid().unwrap_or_default()));
    std::fs::create_dir_all(&dir)?;
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, serde_yaml_ng::to_string(&config)?)?;
    let mut command = tokio::process::Command::new(binary);
    command
        .args(container.args.clone().unwrap_or_default())
        .env_clear()
        .env("KUBECONFIG", &kubeconfig)
        .kill_on_drop(true);
    for var in container.env.iter().flatten() {
        if let Some(value) = &var.value {
            command.env(&var.name, value);
        }
    }
    let out = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .context("ran past 120 s")??;
    std::fs::remove_dir_all(&dir).ok();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let tail: Vec<&str> = text.lines().rev().take(20).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    Ok((out.status.code().unwrap_or(128), tail.join("\n")))
}

fn parse_taint(spec: &str) -> anyhow::Result<Value> {
    let (kv, effect) = spec
        .rsplit_once(':')
        .context("--node-taint needs K=V:EFFECT")?;
    let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
    Ok(json!({"key": key, "value": value, "effect": effect}))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let usage = "usage: fake-kubelet [--ipam host-local|calico] [--node-label K=V]... [--node-taint K=V:EFFECT]... [--control-dir DIR] [--lease-seconds N] [--run-image REPOSITORY=BINARY]... --node NAME=ZONE...";
    let mut run_images = HashMap::new();
    let (mut control_dir, mut lease) = (None, Duration::from_secs(40));
    let (mut node_args, mut labels, mut taints) = (Vec::new(), Vec::new(), Vec::new());
    let mut ipam = Ipam::HostLocal {
        subnets: HashMap::new(),
        allocated: HashMap::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .with_context(|| format!("{arg} needs a value; {usage}"))
        };
        match arg.as_str() {
            "--node" => {
                let spec = value()?;
                let (name, zone) = spec.split_once('=').context("--node needs NAME=ZONE")?;
                node_args.push((name.to_owned(), zone.to_owned()));
            }
            "--node-label" => {
                let spec = value()?;
                let (k, v) = spec.split_once('=').context("--node-label needs K=V")?;
                labels.push((k.to_owned(), v.to_owned()));
            }
            "--node-taint" => taints.push(parse_taint(&value()?)?),
            "--control-dir" => control_dir = Some(PathBuf::from(value()?)),
            "--run-image" => {
                let spec = value()?;
                let (repo, binary) = spec
                    .split_once('=')
                    .context("--run-image needs REPOSITORY=BINARY")?;
                run_images.insert(repo.to_owned(), PathBuf::from(binary));
            }
            "--lease-seconds" => {
                let secs: u64 = value()?.parse().context("--lease-seconds needs a number")?;
                anyhow::ensure!(secs >= 4, "--lease-seconds must be at least 4");
                lease = Duration::from_secs(secs);
            }
            "--ipam" => {
                ipam = match value()?.as_str() {
                    "host-local" => Ipam::HostLocal {
                        subnets: HashMap::new(),
                        allocated: HashMap::new(),
                    },
                    "calico" => Ipam::Calico {
                        blocks: HashMap::new(),
                        held: HashMap::new(),
                    },
                    other => anyhow::bail!("unknown IPAM {other}; {usage}"),
                }
            }
            other => anyhow::bail!("unknown argument {other}; {usage}"),
        }
    }
    anyhow::ensure!(!node_args.is_empty(), "give at least one --node NAME=ZONE");
    let config = kube::Config::infer().await?;
    let client = Client::try_from(config.clone())?;
    // Watches without the client's own retries of 429, 503 and 504 (as the replicas' run): a
    // watch refused for the moment (after an API server restart) would wait inside them for
    // minutes, missing pod deletions a kubelet (client-go watches again at once) would see.
    let watch_client = Client::try_from(persistent_pod_state::state::watch_config(config))?;
    let version = client.apiserver_version().await?.git_version;
    let nodes: Api<Node> = Api::all(client.clone());
    for (i, (name, zone)) in node_args.iter().enumerate() {
        register(&nodes, name, zone, &version, &labels, &taints).await?;
        ipam.add_node(name, u8::try_from(i + 1)?);
        tracing::info!(node = %name, %zone, "node registered");
    }
    let (store, writer) = reflector::store::<Node>();
    let kubelet = Arc::new(Kubelet {
        client: client.clone(),
        ipam: Mutex::new(ipam),
        nodes: store.clone(),
        retry: Mutex::default(),
        control_dir,
        stopped: Mutex::default(),
        lease,
        run_images,
        started: Mutex::default(),
        registration: Registration {
            zones: node_args.iter().cloned().collect(),
            labels,
            taints,
            version,
        },
    });
    let watched_nodes: Api<Node> = Api::all(watch_client.clone());
    let node_events =
        reflector::reflector(writer, watcher(watched_nodes, watcher::Config::default()))
            .default_backoff()
            .applied_objects();
    // The node store is fed for the kubelet's loops.
    let node_feed = tokio::spawn(async move {
        futures::pin_mut!(node_events);
        loop {
            match node_events.try_next().await {
                Ok(Some(_)) => {}
                Ok(None) => return,
                Err(error) => tracing::warn!(%error, "node watch failed; retrying"),
            }
        }
    });
    let retries = tokio::spawn({
        let kubelet = kubelet.clone();
        async move { kubelet.retry_sandboxes().await }
    });
    store.wait_until_ready().await?;
    let leases = tokio::spawn({
        let kubelet = kubelet.clone();
        let names = node_args.iter().map(|(n, _)| n.clone()).collect();
        async move { kubelet.heartbeat(names).await }
    });
    let pods: Api<Pod> = Api::all(watch_client);
    let events = watcher(pods, watcher::Config::default()).default_backoff();
    futures::pin_mut!(events);
    loop {
        match events.try_next().await {
            Ok(Some(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod))) => {
                if let Err(error) = kubelet.handle(&pod).await {
                    tracing::warn!(pod = %pod.name_any(), %error, "pod not handled");
                }
            }
            Ok(Some(watcher::Event::Delete(pod))) => {
                lock(&kubelet.ipam).release(&pod.uid().unwrap_or_default());
            }
            Ok(Some(watcher::Event::Init | watcher::Event::InitDone)) => {}
            Ok(None) => break,
            Err(error) => tracing::warn!(%error, "pod watch failed; retrying"),
        }
    }
    node_feed.abort();
    retries.abort();
    leases.abort();
    Ok(())
}
