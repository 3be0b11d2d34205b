//! The admission decision in process (issue 11.2), at 1, 1,000 and 100,000 PersistentPodStates:
//! microseconds per pod for reading the review (one pass over the body), decoding the fields of
//! the pod the decision reads (beside, for comparison, decoding the whole Pod, as before), and
//! the whole decision with its patch; and, for comparison, upstream's way of finding the
//! PersistentPodState (listing the namespace's and scanning for the target, bug 11). Prints a
//! table; asserts nothing about time (machines vary).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use persistent_pod_state::api::PersistentPodState;
use persistent_pod_state::placement::{Health, Nodes};
use persistent_pod_state::state::{Caches, pps_target};
use persistent_pod_state::synthetic;
use persistent_pod_state::webhook::WebhookState;
use persistent_pod_state::webhook::admit::{CacheLookup, Lookup, Verdict};
use persistent_pod_state::webhook::mutate_pod::{Outcome, admit, decode_pod};
use persistent_pod_state::webhook::review::{Admission, parse};
use persistent_pod_state::workload::{GroupKind, WorkloadRef, pod_workload};

const NODES: usize = 100;
const BODIES: usize = 256;

/// Runs `f` over the bodies for about `budget`; nanoseconds per call.
fn per_call(budget: Duration, mut f: impl FnMut(usize)) -> f64 {
    for k in 0..BODIES {
        f(k);
    }
    let start = Instant::now();
    let mut n = 0usize;
    while start.elapsed() < budget {
        for k in 0..BODIES {
            f(k);
        }
        n += BODIES;
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

/// Upstream's lookup: every PPS of the namespace, scanned for the target (the rest as the
/// server's).
struct Scan<'a> {
    server: CacheLookup<'a>,
    by_namespace: &'a BTreeMap<String, Vec<Arc<PersistentPodState>>>,
}

impl Lookup for Scan<'_> {
    fn nodes(&self) -> &dyn Nodes {
        self.server.nodes()
    }
    fn handles(&self, kind: &GroupKind) -> bool {
        self.server.handles(kind)
    }
    fn pps_for(&self, workload: &WorkloadRef) -> Option<Arc<PersistentPodState>> {
        self.by_namespace
            .get(&workload.namespace)?
            .iter()
            .find(|p| pps_target(p).as_ref() == Some(workload))
            .cloned()
    }
    fn health(&self) -> Health {
        self.server.health()
    }
    fn ip_holder(&self, ip: &str, namespace: &str, name: &str) -> Option<String> {
        self.server.ip_holder(ip, namespace, name)
    }
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let short = std::env::args().any(|a| a == "--short");
    let budget = Duration::from_millis(if short { 100 } else { 1000 });
    let sizes: &[usize] = if short {
        &[1, 1_000]
    } else {
        &[1, 1_000, 100_000]
    };
    println!(
        "| PPS | read review (µs) | decode pod, read fields (µs) | decode whole Pod (µs, not done) | decision + patch, all in (µs) | upstream's namespace scan, all in (µs) |"
    );
    println!("|---|---|---|---|---|---|");
    for &total in sizes {
        let caches = Caches::new();
        caches.apply_pps(watcher::Event::Init);
        let mut by_namespace: BTreeMap<String, Vec<Arc<PersistentPodState>>> = BTreeMap::new();
        for i in 0..total {
            let pps: PersistentPodState =
                serde_json::from_value(synthetic::pps(i, 1, NODES)).expect("pps");
            by_namespace
                .entry(pps.metadata.namespace.clone().unwrap_or_default())
                .or_default()
                .push(Arc::new(pps.clone()));
            caches.apply_pps(watcher::Event::InitApply(pps));
        }
        caches.apply_pps(watcher::Event::InitDone);
        for j in 0..NODES {
            caches.apply_node(watcher::Event::Apply(
                serde_json::from_value(synthetic::node(j)).expect("node"),
            ));
        }
        let state = WebhookState::over(caches);
        let bodies: Vec<axum::body::Bytes> = (0..BODIES)
            .map(|k| synthetic::review((k * 7919) % total).into())
            .collect();
        let read = per_call(budget, |k| {
            black_box(parse(bodies[k].clone()).expect("review"));
        });
        let requests: Vec<_> = bodies
            .iter()
            .map(|b| parse(b.clone()).expect("review"))
            .collect();
        let decode = per_call(budget, |k| {
            let pod: Pod = decode_pod(requests[k].object().expect("object")).expect("pod");
            black_box(pod_workload(&pod, "ns"));
        });
        let full_decode = per_call(budget, |k| {
            let pod: Pod =
                serde_json::from_str(requests[k].object().expect("object")).expect("pod");
            black_box(pod_workload(&pod, "ns"));
        });
        let whole = |lookup: &dyn Lookup| {
            per_call(budget, |k| {
                let request = parse(bodies[k].clone()).expect("review");
                let Outcome::Decided(decision) = admit(&request, lookup) else {
                    panic!("the synthetic review is a pod CREATE")
                };
                let Verdict::Inject { injection, .. } = &decision.verdict else {
                    panic!("the synthetic pod gets a patch")
                };
                black_box(Admission::patch(&injection.patch).expect("patch"));
            })
        };
        let indexed = whole(&state.lookup());
        let scanned = whole(&Scan {
            server: state.lookup(),
            by_namespace: &by_namespace,
        });
        println!(
            "| {total} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            read / 1e3,
            decode / 1e3,
            full_decode / 1e3,
            indexed / 1e3,
            scanned / 1e3
        );
    }
}
