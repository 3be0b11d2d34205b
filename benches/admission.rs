//! Admission hot path: finding the PersistentPodState of a pod's workload and computing the
//! patch, as the number of PersistentPodStates grows. Upstream lists every PPS of the namespace
//! per admission (reference bug 11); this service reads an index kept current from the watch.
//! Prints nanoseconds per admission; no assertion on time (CI machines vary).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use persistent_pod_state::api::PersistentPodState;
use persistent_pod_state::placement::Required;
use persistent_pod_state::state::index::{ByWorkload, Shared, pps_target};
use persistent_pod_state::webhook::inject::injection_for;
use persistent_pod_state::workload::pod_workload;
use serde_json::json;

fn pps(ns: usize, i: usize) -> PersistentPodState {
    serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
        "metadata": {"name": format!("web-{i}"), "namespace": format!("ns-{ns}")},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": format!("web-{i}")},
                 "requiredPersistentTopology": {"keys": ["topology.kubernetes.io/zone"]},
                 "preferredPersistentTopology": [{"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}}]},
        "status": {"observedGeneration": 1, "podStates": {format!("web-{i}-0"): {"nodeName": "n1",
            "nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1", "kubernetes.io/hostname": "n1"}}}}
    }))
    .expect("pps")
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    const NAMESPACES: usize = 10;
    const ADMISSIONS: usize = 20_000;
    println!(
        "{:>10} {:>22} {:>26}",
        "PPS", "indexed ns/admission", "namespace scan ns/admission"
    );
    for total in [100, 1_000, 10_000, 100_000] {
        let per_ns = total / NAMESPACES;
        let index = Shared::<ByWorkload>::default();
        let mut by_name: BTreeMap<(String, String), PersistentPodState> = BTreeMap::new();
        for ns in 0..NAMESPACES {
            for i in 0..per_ns {
                let p = pps(ns, i);
                index.apply(&watcher::Event::Apply(p.clone()));
                by_name.insert((format!("ns-{ns}"), format!("web-{i}")), p);
            }
        }
        let pods: Vec<Pod> = (0..64)
            .map(|k| {
                let i = (k * 7919) % per_ns;
                serde_json::from_value(json!({
                    "metadata": {"name": format!("web-{i}-0"), "namespace": "ns-3", "ownerReferences": [{
                        "apiVersion": "apps/v1", "kind": "StatefulSet", "name": format!("web-{i}"), "uid": "u", "controller": true}]},
                    "spec": {"containers": [{"name": "c"}]}
                }))
                .expect("pod")
            })
            .collect();
        let anywhere = |recorded: &BTreeMap<String, String>| Required {
            kept: recorded.clone(),
            dropped: None,
        };

        let start = Instant::now();
        for n in 0..ADMISSIONS {
            let pod = &pods[n % pods.len()];
            let workload = pod_workload(pod, "ns-3").expect("owned");
            let name = index
                .read()
                .get(&workload)
                .next()
                .expect("indexed")
                .to_owned();
            let p = &by_name[&("ns-3".to_string(), name)];
            let state = &p.status.as_ref().expect("status").pod_states
                [pod.metadata.name.as_deref().expect("name")];
            black_box(injection_for(pod, "web", &p.spec, state, &anywhere, None));
        }
        let indexed = start.elapsed().as_nanos() / ADMISSIONS as u128;

        // Upstream's way: list the namespace's PPS and scan for the target.
        let namespace: Vec<&PersistentPodState> = by_name
            .range(("ns-3".to_string(), String::new())..("ns-4".to_string(), String::new()))
            .map(|(_, p)| p)
            .collect();
        let scans = ADMISSIONS.min(2_000);
        let start = Instant::now();
        for n in 0..scans {
            let pod = &pods[n % pods.len()];
            let workload = pod_workload(pod, "ns-3").expect("owned");
            let p = namespace
                .iter()
                .find(|p| pps_target(p).as_ref() == Some(&workload))
                .expect("found");
            let state = &p.status.as_ref().expect("status").pod_states
                [pod.metadata.name.as_deref().expect("name")];
            black_box(injection_for(pod, "web", &p.spec, state, &anywhere, None));
        }
        let scanned = start.elapsed().as_nanos() / scans as u128;
        println!("{total:>10} {indexed:>22} {scanned:>26}");
    }
}
