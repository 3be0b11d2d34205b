//! A fake kubelet for the e2e control plane, where no real kubelet can run.
//!
//! - registers Ready nodes (`--node NAME=ZONE`, repeatable) with hostname and zone labels, and
//!   removes the `not-ready` taint the API server adds on registration;
//! - marks every pod bound to one of its nodes Running and Ready, with a pod IP given the way
//!   the seeds' patched host-local does: the same pod name on the same node gets the same IP
//!   back; another node gives another IP;
//! - deletes pods that have a deletionTimestamp (there are no containers to stop);
//! - does nothing for a node whose `Ready` condition is not `True`: a test marks a node dead as
//!   the node lifecycle controller would (`Unknown`, tainted unreachable), and like a dead
//!   kubelet this one then neither starts nor finalizes pods there, until the node is Ready
//!   again (then it catches up with every pod bound to it).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

/// host-local's allocation: per node a /24, per (namespace/pod name) one address, kept forever.
struct Ipam {
    subnets: HashMap<String, u8>,
    allocated: HashMap<String, BTreeMap<String, u8>>,
}

impl Ipam {
    fn ip_for(&mut self, node: &str, pod_key: &str) -> Option<String> {
        let subnet = *self.subnets.get(node)?;
        let table = self.allocated.entry(node.to_owned()).or_default();
        let host = match table.get(pod_key) {
            Some(h) => *h,
            None => {
                let used: Vec<u8> = table.values().copied().collect();
                let free = (2..=254).find(|h| !used.contains(h))?;
                table.insert(pod_key.to_owned(), free);
                free
            }
        };
        Some(format!("10.244.{subnet}.{host}"))
    }
}

async fn register(nodes: &Api<Node>, name: &str, zone: &str) -> anyhow::Result<()> {
    let node = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "topology.kubernetes.io/zone": zone,
            "failure-domain.beta.kubernetes.io/zone": zone,
        }},
    });
    match nodes
        .create(&PostParams::default(), &serde_json::from_value(node)?)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e).context("creating node"),
    }
    let resources = json!({"cpu": "8", "memory": "32Gi", "pods": "110"});
    let now = chrono_now();
    let status = json!({"status": {
        "capacity": resources, "allocatable": resources,
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "fake kubelet", "lastHeartbeatTime": now, "lastTransitionTime": now}],
        "nodeInfo": {"kubeletVersion": "v1.20.2-fake", "machineID": "", "systemUUID": "", "bootID": "",
            "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "", "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": "amd64"},
    }});
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .context("marking node Ready")?;
    // The API server taints new nodes not-ready; the node lifecycle controller that would lift
    // it does not run here.
    nodes
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": null}})),
        )
        .await
        .context("removing taints")?;
    Ok(())
}

fn chrono_now() -> String {
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

async fn handle(
    pods: &Client,
    ipam: &Mutex<Ipam>,
    nodes: &Store<Node>,
    pod: &Pod,
) -> anyhow::Result<()> {
    let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
        return Ok(());
    };
    let ours = lock(ipam).subnets.contains_key(&node);
    let alive = nodes
        .get(&ObjectRef::new(&node))
        .is_some_and(|n| is_ready(&n));
    if !ours || !alive {
        return Ok(());
    }
    let ns = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let api: Api<Pod> = Api::namespaced(pods.clone(), &ns);
    if pod.metadata.deletion_timestamp.is_some() {
        match api
            .delete(&name, &DeleteParams::default().grace_period(0))
            .await
        {
            Ok(_) | Err(kube::Error::Api(_)) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
    let running = pod
        .status
        .as_ref()
        .is_some_and(|s| s.phase.as_deref() == Some("Running") && s.pod_ip.is_some());
    if running {
        return Ok(());
    }
    let Some(ip) = lock(ipam).ip_for(&node, &format!("{ns}/{name}")) else {
        anyhow::bail!("no free address on {node}");
    };
    let now = chrono_now();
    let cond = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": now});
    let containers: Vec<_> =
        pod.spec
            .as_ref()
            .map(|s| {
                s.containers.iter().map(|c| json!({
            "name": c.name, "image": c.image.clone().unwrap_or_default(), "imageID": "",
            "ready": true, "started": true, "restartCount": 0,
            "state": {"running": {"startedAt": now}},
        })).collect()
            })
            .unwrap_or_default();
    let status = json!({"status": {
        "phase": "Running", "hostIP": "127.0.0.1", "podIP": ip, "podIPs": [{"ip": ip}],
        "startTime": now,
        "conditions": [cond("Initialized"), cond("Ready"), cond("ContainersReady"), cond("PodScheduled")],
        "containerStatuses": containers,
    }});
    match api
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
    {
        Ok(_) | Err(kube::Error::Api(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let mut node_args = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--node" => {
                let spec = args.next().context("--node needs NAME=ZONE")?;
                let (name, zone) = spec.split_once('=').context("--node needs NAME=ZONE")?;
                node_args.push((name.to_owned(), zone.to_owned()));
            }
            other => {
                anyhow::bail!("unknown argument {other}; usage: fake-kubelet --node NAME=ZONE...")
            }
        }
    }
    anyhow::ensure!(!node_args.is_empty(), "give at least one --node NAME=ZONE");
    let client = Client::try_default().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let mut ipam = Ipam {
        subnets: HashMap::new(),
        allocated: HashMap::new(),
    };
    for (i, (name, zone)) in node_args.iter().enumerate() {
        register(&nodes, name, zone).await?;
        ipam.subnets.insert(name.clone(), u8::try_from(i + 1)?);
        tracing::info!(node = %name, %zone, "node registered");
    }
    let ipam = Arc::new(Mutex::new(ipam));
    let (store, writer) = reflector::store::<Node>();
    let node_events = reflector::reflector(writer, watcher(nodes, watcher::Config::default()))
        .default_backoff()
        .applied_objects();
    // A node that comes back to Ready: catch up with every pod bound to it.
    let revived = tokio::spawn({
        let (client, ipam, store) = (client.clone(), ipam.clone(), store.clone());
        async move {
            futures::pin_mut!(node_events);
            let mut ready: HashMap<String, bool> = HashMap::new();
            loop {
                match node_events.try_next().await {
                    Ok(Some(node)) => {
                        let name = node.name_any();
                        let now = is_ready(&node);
                        if ready.insert(name.clone(), now) == Some(false) && now {
                            catch_up(&client, &ipam, &store, &name).await;
                        }
                    }
                    Ok(None) => return,
                    Err(error) => tracing::warn!(%error, "node watch failed; retrying"),
                }
            }
        }
    });
    store.wait_until_ready().await?;
    let pods: Api<Pod> = Api::all(client.clone());
    let events = watcher(pods, watcher::Config::default())
        .default_backoff()
        .applied_objects();
    futures::pin_mut!(events);
    loop {
        match events.try_next().await {
            Ok(Some(pod)) => {
                if let Err(error) = handle(&client, &ipam, &store, &pod).await {
                    tracing::warn!(pod = %pod.name_any(), %error, "pod not handled");
                }
            }
            Ok(None) => break,
            Err(error) => tracing::warn!(%error, "pod watch failed; retrying"),
        }
    }
    revived.abort();
    Ok(())
}

fn lock(ipam: &Mutex<Ipam>) -> std::sync::MutexGuard<'_, Ipam> {
    ipam.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Handles every pod bound to `node` (after it came back).
async fn catch_up(client: &Client, ipam: &Mutex<Ipam>, nodes: &Store<Node>, node: &str) {
    let pods: Api<Pod> = Api::all(client.clone());
    let bound = kube::api::ListParams::default().fields(&format!("spec.nodeName={node}"));
    match pods.list(&bound).await {
        Ok(list) => {
            for pod in list.items {
                if let Err(error) = handle(client, ipam, nodes, &pod).await {
                    tracing::warn!(pod = %pod.name_any(), %error, "pod not handled");
                }
            }
        }
        Err(error) => tracing::warn!(%node, %error, "cannot list the pods of a revived node"),
    }
}
