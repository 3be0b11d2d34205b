//! The admission decision in process (issue 11.2), at 1, 1,000 and 100,000 PersistentPodStates:
//! microseconds per pod for reading the review (one pass over the body), decoding the fields of
//! the pod the decision reads (beside, for comparison, decoding the whole Pod, as before), and
//! the whole decision with its patch; and, for comparison, upstream's way of finding the
//! PersistentPodState (listing the namespace's and scanning for the target, bug 11). Then the
//! webhook's whole router against the floor's handler (`bench-floor`'s, issue 22.1), both in
//! process, warm and with the CPU's caches flushed between reviews: over HTTPS a review runs
//! between the kernel's and TLS's work, which evicts what the review left in the caches.
//! Prints tables; asserts nothing about time (machines vary). With `--route floor|router N`,
//! only N flushed reviews through one of the two, nothing printed: the run a cache simulator
//! counts (`valgrind --tool=callgrind --cache-sim=yes`, BENCHMARKS.md part 2).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use persistent_pod_state::api::PersistentPodState;
use persistent_pod_state::benchkit::{floor, median};
use persistent_pod_state::placement::{Health, Nodes};
use persistent_pod_state::state::{Caches, pps_target};
use persistent_pod_state::synthetic;
use persistent_pod_state::webhook::admit::{CacheLookup, Lookup, Verdict};
use persistent_pod_state::webhook::mutate_pod::{Outcome, admit, decode_pod};
use persistent_pod_state::webhook::review::{Admission, parse};
use persistent_pod_state::webhook::{WebhookState, router};
use persistent_pod_state::workload::{GroupKind, PodView, WorkloadRef};

// The allocator of the shipped binary and of the floor (src/main.rs, bench/floor.rs): what is
// timed and counted here allocates as they do.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const NODES: usize = 100;
const BODIES: usize = 256;
/// What a flush passes over between reviews: more than a core's own caches hold.
const FLUSH: usize = 4 << 20;

/// The pod webhook's request carrying the review `body`.
fn review_request(body: &axum::body::Bytes) -> axum::http::Request<axum::body::Body> {
    axum::http::Request::post("/mutate-pod")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.clone()))
        .expect("request")
}

/// Each of `bodies` POSTed through `app` in process, one at a time on `runtime`, until
/// `enough(reviews, time)`: nanoseconds per review, timed around the call alone. With `flush`, a
/// pass over that many bytes between reviews evicts what each left in the CPU's caches.
fn routed(
    runtime: &tokio::runtime::Runtime,
    app: &axum::Router,
    bodies: &[axum::body::Bytes],
    enough: &dyn Fn(u32, Duration) -> bool,
    flush: usize,
) -> f64 {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let mut junk = vec![0u8; flush];
    let (mut spent, mut n) = (Duration::ZERO, 0u32);
    let start = Instant::now();
    runtime.block_on(async {
        for body in bodies.iter().cycle() {
            if enough(n, start.elapsed()) {
                break;
            }
            let request = review_request(body);
            let at = Instant::now();
            let response = app.clone().oneshot(request).await.expect("infallible");
            let answer = response.into_body().collect().await.expect("body");
            spent += at.elapsed();
            black_box(answer);
            for i in (0..junk.len()).step_by(64) {
                junk[i] = junk[i].wrapping_add(1);
            }
            n += 1;
        }
    });
    black_box(&junk);
    spent.as_nanos() as f64 / f64::from(n.max(1))
}

/// Which handler `--route` sends reviews through.
#[derive(Clone, Copy)]
enum Route {
    Floor,
    Router,
}

/// `--route floor|router N`: N reviews through the floor's handler or the webhook's router,
/// each after a flush, and nothing else run or printed: what a cache simulator counts
/// (BENCHMARKS.md, part 2).
fn route_arg() -> Option<(Route, u32)> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == "--route")?;
    let usage = "--route floor|router N";
    let which = match args.get(at + 1).map(String::as_str) {
        Some("floor") => Route::Floor,
        Some("router") => Route::Router,
        _ => panic!("{usage}"),
    };
    let n = args.get(at + 2).and_then(|n| n.parse().ok()).expect(usage);
    Some((which, n))
}

/// The webhook's router (over `state`) against the floor's handler, each review of `bodies`
/// in process, warm and flushed ([`FLUSH`]): a table, medians of 3 alternated rounds; with
/// `route`, only that many reviews through one of them.
fn against_the_floor(
    state: Arc<WebhookState>,
    bodies: &[axum::body::Bytes],
    budget: Duration,
    route: Option<(Route, u32)>,
) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    floor::set_patch(floor::ONE_LABEL);
    let floor_app = axum::Router::new().route("/mutate-pod", axum::routing::post(floor::answer));
    let ours = router(state);
    // Before anything else runs, so that a cache simulator counts these reviews alone (the
    // table's run checks that each of these bodies is answered with a patch).
    if let Some((which, n)) = route {
        let app = match which {
            Route::Floor => &floor_app,
            Route::Router => &ours,
        };
        routed(&runtime, app, bodies, &|done, _| done >= n, FLUSH);
        return;
    }
    // Every answer of ours carries a patch, or the comparison says nothing.
    runtime.block_on(async {
        use http_body_util::BodyExt;
        use tower::ServiceExt;
        for body in bodies {
            let response = ours
                .clone()
                .oneshot(review_request(body))
                .await
                .expect("infallible");
            assert_eq!(response.status(), 200);
            let answer = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            let answer: serde_json::Value = serde_json::from_slice(&answer).expect("JSON");
            assert!(answer["response"]["patch"].is_string(), "{answer}");
        }
    });
    println!();
    println!(
        "| caches between reviews | the floor's handler (µs) | the webhook's router (µs) | router over floor |"
    );
    println!("|---|---|---|---|");
    for (label, flush) in [("warm", 0), ("flushed (4 MiB pass)", FLUSH)] {
        let (mut floors, mut ours_) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let enough = |_: u32, spent: Duration| spent >= budget;
            floors.push(routed(&runtime, &floor_app, bodies, &enough, flush));
            ours_.push(routed(&runtime, &ours, bodies, &enough, flush));
        }
        let (f, o) = (median(&floors), median(&ours_));
        println!(
            "| {label} | {:.1} | {:.1} | {:.2} |",
            f / 1e3,
            o / 1e3,
            o / f
        );
    }
}

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

/// The server's state over `total` PersistentPodStates (one recorded state each) and the
/// bench's nodes, synced; and the PersistentPodStates by namespace, for upstream's scan.
fn server_state(
    total: usize,
) -> (
    Arc<WebhookState>,
    BTreeMap<String, Vec<Arc<PersistentPodState>>>,
) {
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
    caches.apply_node(watcher::Event::Init);
    for j in 0..NODES {
        caches.apply_node(watcher::Event::InitApply(
            serde_json::from_value(synthetic::node(j)).expect("node"),
        ));
    }
    // Every store synced, as the server's are once it answers reviews.
    caches.apply_node(watcher::Event::InitDone);
    caches.apply_pod(watcher::Event::InitDone);
    caches.apply_workload(&GroupKind::native_statefulset(), watcher::Event::InitDone);
    assert!(caches.is_synced(), "the caches are synced");
    (Arc::new(WebhookState::over(caches)), by_namespace)
}

/// One row of the decision's table: `total` PersistentPodStates, each figure for `budget`.
fn decision_row(
    total: usize,
    state: &WebhookState,
    by_namespace: &BTreeMap<String, Vec<Arc<PersistentPodState>>>,
    bodies: &[axum::body::Bytes],
    budget: Duration,
) {
    let read = per_call(budget, |k| {
        black_box(parse(bodies[k].clone()).expect("review"));
    });
    let requests: Vec<_> = bodies
        .iter()
        .map(|b| parse(b.clone()).expect("review"))
        .collect();
    let decode = per_call(budget, |k| {
        let pod = decode_pod(requests[k].object().expect("object")).expect("pod");
        black_box(pod.view().workload("ns"));
    });
    let full_decode = per_call(budget, |k| {
        let pod: Pod = serde_json::from_str(requests[k].object().expect("object")).expect("pod");
        black_box(PodView::from(&pod).workload("ns"));
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
            black_box(Admission::patch(&injection.patch));
        })
    };
    let indexed = whole(&state.lookup());
    let scanned = whole(&Scan {
        server: state.lookup(),
        by_namespace,
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

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let short = std::env::args().any(|a| a == "--short");
    let route = route_arg();
    let budget = Duration::from_millis(if short { 100 } else { 1000 });
    let sizes: &[usize] = if route.is_some() {
        &[1_000]
    } else if short {
        &[1, 1_000]
    } else {
        &[1, 1_000, 100_000]
    };
    if route.is_none() {
        println!(
            "| PPS | read review (µs) | decode pod, read fields (µs) | decode whole Pod (µs, not done) | decision + patch, all in (µs) | upstream's namespace scan, all in (µs) |"
        );
        println!("|---|---|---|---|---|---|");
    }
    let mut compared = None;
    for &total in sizes {
        let (state, by_namespace) = server_state(total);
        let bodies: Vec<axum::body::Bytes> = (0..BODIES)
            .map(|k| synthetic::review((k * 7919) % total).into())
            .collect();
        if route.is_none() {
            decision_row(total, &state, &by_namespace, &bodies, budget);
        }
        if total == 1_000 {
            compared = Some((state, bodies));
        }
    }
    if let Some((state, bodies)) = compared {
        against_the_floor(state, &bodies, budget, route);
    }
}
