//! bench-cluster (issues 11.3 to 11.5): through the API server of the local control plane that
//! `bench/run.sh` brings up (fake-kubelet nodes, one `serve` replica registered as the webhook
//! exactly as the manifests ship it, legacy variant):
//!
//! 3. pod CREATE latency (dry-run creates of a re-created StatefulSet pod with a recorded state,
//!    so ours patches each) with no mutating webhook, with `bench-floor` registered in the
//!    same way (what calling any webhook costs the API server), with `bench-floor` answering
//!    our patch and its twin (what the method alone gives), and with ours; all registered at
//!    once, each selecting the pods of its own column by a label, the columns taking turns
//!    create by create in shuffled order;
//! 4. the controller: a StatefulSet becoming Ready, per-pod lag from Ready to recorded (both as
//!    this client's watches see them), status writes during the rollout and in steady state;
//! 5. memory at scale: RSS of a fresh `serve` after syncing (and its peak during the sync), the
//!    heap the caches hold per pod, recorded state and node (counted in this process by a
//!    counting allocator), and the projection to 100,000 pods.
//!
//! `bench-cluster [--short] [--only api|controller|memory] --probe HOST:PORT --serve-pid PID
//! --serve-bin PATH --cluster-dir DIR --baseline-addr HOST:PORT --baseline-ca FILE`
//! (`--probe` and `--serve-pid`: the registered replica; `--baseline-*`: a running
//! `bench-floor`, and the address the API server calls it at; the other bare webhooks are
//! called at the same host). Uses `$KUBECONFIG` (admin). Prints
//! tables; fails if a figure is missing, never on a figure's value.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use persistent_pod_state::api::PersistentPodState;
use persistent_pod_state::benchkit::{
    cpu_seconds, flag, http_get, median, metric, minor_faults, quantile,
};
use persistent_pod_state::state::Caches;
use persistent_pod_state::state::trim::{CachedPod, Read, WatchedPod};
use persistent_pod_state::synthetic;
use serde_json::{Value, json};

/// The registration the manifests ship (and `bench/run.sh` applied).
const WEBHOOK_CONFIGURATION: &str = "persistent-pod-state";

struct Opts {
    short: bool,
    baseline_addr: String,
    baseline_ca: PathBuf,
    probe: String,
    serve_pid: u32,
    serve_bin: PathBuf,
    cluster_dir: PathBuf,
}

/// Polls `check` every 200 ms until it holds, for at most `limit`.
async fn until<F, Fut>(what: &str, limit: Duration, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match check().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) if Instant::now() >= deadline => return Err(e.context(what.to_owned())),
            Err(_) => {}
        }
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn pps_resource() -> ApiResource {
    ApiResource::erase::<PersistentPodState>(&())
}

async fn create_namespace(client: &Client, name: &str) -> anyhow::Result<()> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A StatefulSet of `replicas` minimal pods (Parallel: all at once).
fn statefulset(name: &str, replicas: usize) -> anyhow::Result<StatefulSet> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}},
                              "spec": {"terminationGracePeriodSeconds": 0,
                                       "containers": [{"name": "server", "image": "registry.example.com/server:1"}]}}}
    }))?)
}

/// A PersistentPodState for StatefulSet `name`: zone required, hostname preferred.
fn pps_for(name: &str, namespace: &str, retention: &str) -> anyhow::Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name},
                 "requiredPersistentTopology": {"keys": ["topology.kubernetes.io/zone"]},
                 "preferredPersistentTopology": [{"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}}],
                 "persistentPodStateRetentionPolicy": retention}
    }))?)
}

async fn recorded_states(api: &Api<DynamicObject>, name: &str) -> anyhow::Result<usize> {
    let pps = api.get(name).await?;
    Ok(pps
        .data
        .pointer("/status/podStates")
        .and_then(Value::as_object)
        .map_or(0, serde_json::Map::len))
}

/// Which webhook answers the pod creates of 11.3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answered {
    /// No mutating webhook registered.
    Nobody,
    /// `bench-floor` (a fixed answer with a one-label patch): what calling any webhook costs.
    Bare,
    /// `serve`, as the manifests register it.
    Ours,
    /// `bench-floor` answering at once with the patch ours answers (and its label): what the
    /// API server's work on our answer costs, without our server.
    BareOurPatch,
    /// A second `bench-floor` answering as `BareOurPatch` does, registered as a fourth
    /// webhook: nothing but its place sets it apart, so what it comes out over `BareOurPatch`
    /// is what the method alone gives (an A/A comparison, the resolution of the figures).
    Twin,
}

/// The columns that also send a block of creates of their own, for the API server's metrics
/// (the twin would only repeat its sibling's).
const BLOCKS: [Answered; 4] = [
    Answered::Nobody,
    Answered::Bare,
    Answered::BareOurPatch,
    Answered::Ours,
];

/// 11.3: dry-run pod create latencies (ms) by who answered.
struct ApiFigures {
    creates: usize,
    rounds: usize,
    /// Each column's creates, the columns taking turns create by create: `rounds` runs of
    /// `creates / rounds` per column.
    samples: HashMap<&'static str, Vec<f64>>,
    /// Creates per column sent in a block of their own, and each column's as this client timed
    /// them.
    block: (usize, HashMap<&'static str, Vec<f64>>),
    /// Where the time of a create went in those blocks, by who answered (from the servers' own
    /// metrics).
    spent: HashMap<&'static str, Spent>,
    /// Creates sent at 100 a second with ours registered, and the share of the API server's
    /// calls of ours it timed at 5 ms or less.
    paced: (usize, f64),
    /// CPU seconds each process answering a column spent over the rounds, whole (ours: `serve`,
    /// its controllers idle meanwhile), for ours, the bare webhook with our patch and its twin.
    cpu: Vec<(Answered, f64)>,
}

/// Seconds spent and calls counted (a summary's or histogram's `_sum` and `_count`), summed over
/// a column's creates: means per create, as the API server and the webhook server timed them.
#[derive(Clone, Copy, Default)]
struct Spent {
    /// The API server's whole mutating admission step (every plugin; in v1.20 an object that
    /// a webhook changed goes through all of them twice).
    step: (f64, f64),
    /// The API server's MutatingAdmissionWebhook plugin (every mutating webhook, and the
    /// conversions around them).
    plugin: (f64, f64),
    /// The API server's call of the webhook (request built and sent, answer read, patch applied).
    call: (f64, f64),
    /// Our server's handling of the review (nothing for the other columns).
    server: (f64, f64),
}

impl Spent {
    /// The counters now: the API server's `/metrics` and our replica's.
    async fn read(client: &Client, webhook: &str, probe: &str) -> anyhow::Result<Spent> {
        let request = axum::http::Request::get("/metrics").body(Vec::new())?;
        let apiserver = client.request_text(request).await?;
        let ours = scrape(probe).await?;
        let pair = |exposition: &str, name: &str, labels: &str| {
            let value = |suffix: &str| metric(exposition, &format!("{name}_{suffix}{labels}"));
            (value("sum").unwrap_or(0.0), value("count").unwrap_or(0.0))
        };
        let admit = r#"operation="CREATE",rejected="false",type="admit"}"#;
        Ok(Spent {
            step: pair(
                &apiserver,
                "apiserver_admission_step_admission_duration_seconds_summary",
                &format!("{{{admit}"),
            ),
            plugin: pair(
                &apiserver,
                "apiserver_admission_controller_admission_duration_seconds",
                &format!(r#"{{name="MutatingAdmissionWebhook",{admit}"#),
            ),
            call: pair(
                &apiserver,
                "apiserver_admission_webhook_admission_duration_seconds",
                &format!(r#"{{name="{webhook}",{admit}"#),
            ),
            server: pair(
                &ours,
                "pps_admission_duration_seconds",
                r#"{endpoint="/mutate-pod"}"#,
            ),
        })
    }

    /// What was counted between `before` and `self`, added to `total`.
    fn add_since(self, before: Spent, total: &mut Spent) {
        for (now, then, sum) in [
            (self.step, before.step, &mut total.step),
            (self.plugin, before.plugin, &mut total.plugin),
            (self.call, before.call, &mut total.call),
            (self.server, before.server, &mut total.server),
        ] {
            sum.0 += now.0 - then.0;
            sum.1 += now.1 - then.1;
        }
    }
}

/// The orders the columns take turns in, one per cycle: a Fisher-Yates shuffle driven by
/// xorshift64*, seeded by the round (so a run can be repeated). In a fixed order each column
/// would always follow the same other one: a bare webhook answering our patch, put in ours'
/// place, came out 0.59 ms slower at p99 than the same webhook it always followed, and 0.19 ms
/// in shuffled turns (bench/NOTEBOOK.md, part 3).
struct Shuffled(u64);

impl Shuffled {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next<const N: usize>(&mut self, mut columns: [Answered; N]) -> [Answered; N] {
        for i in (1..N).rev() {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let draw = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32;
            columns.swap(i, (draw % (i as u64 + 1)) as usize);
        }
        columns
    }
}

/// Which webhook patched a created pod.
fn answered_by(pod: Pod) -> anyhow::Result<Answered> {
    let ours = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_selector.as_ref())
        .is_some_and(|s| s.contains_key("topology.kubernetes.io/zone"));
    match (ours, pod.labels().get("bench-floor").map(String::as_str)) {
        (true, None) => Ok(Answered::Ours),
        (false, Some("answered")) => Ok(Answered::Bare),
        (true, Some(OUR_PATCH_LABEL)) => Ok(Answered::BareOurPatch),
        (true, Some(TWIN_LABEL)) => Ok(Answered::Twin),
        (false, None) => Ok(Answered::Nobody),
        (ours, bare) => {
            anyhow::bail!("answered by ours: {ours}, the bare webhook's label: {bare:?}")
        }
    }
}

/// The pod label each registration selects its column's pods by (its `objectSelector`).
const COLUMN_LABEL: &str = "bench-column";

impl Answered {
    /// The value of [`COLUMN_LABEL`] on this column's pods (of one length for every column, so
    /// that no column's pods are larger).
    fn tag(self) -> &'static str {
        match self {
            Answered::Nobody => "none",
            Answered::Bare => "bare",
            Answered::Ours => "ours",
            Answered::BareOurPatch => "same",
            Answered::Twin => "twin",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Answered::Nobody => "no webhook",
            Answered::Bare => "bare webhook",
            Answered::Ours => "ours",
            Answered::BareOurPatch => "bare webhook, our patch",
            Answered::Twin => "its twin",
        }
    }
}

/// Registers each of `present` (replacing what is registered under its name) and deletes the
/// registrations named `absent`.
async fn install(
    configurations: &Api<MutatingWebhookConfiguration>,
    present: &[&MutatingWebhookConfiguration],
    absent: &[&str],
) -> anyhow::Result<()> {
    for name in absent {
        if configurations.get_opt(name).await?.is_some() {
            configurations
                .delete(name, &DeleteParams::default())
                .await?;
        }
    }
    for config in present {
        let name = config.name_any();
        match configurations.get_opt(&name).await? {
            Some(old) => {
                let mut config = (*config).clone();
                config.metadata.resource_version = old.metadata.resource_version;
                configurations
                    .replace(&name, &PostParams::default(), &config)
                    .await?;
            }
            None => {
                configurations
                    .create(&PostParams::default(), config)
                    .await?;
            }
        }
    }
    Ok(())
}

/// A server-side dry run (`?dryRun=All`): the create is admitted, but nothing is stored, so the
/// same pod can be sent again.
fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
        ..PostParams::default()
    }
}

/// Waits until the API server has the registrations installed: a dry-run create of each
/// `(probe, answered)` is answered as `answered` (it picks registrations up from its own watch).
async fn answering(pods: &Api<Pod>, probes: &[(Pod, Answered)]) -> anyhow::Result<()> {
    let dry_run = dry_run();
    until(
        "the API server to call the webhooks registered",
        Duration::from_secs(60),
        || async {
            for (probe, wanted) in probes {
                if answered_by(pods.create(&dry_run, probe).await?)? != *wanted {
                    return Ok(false);
                }
            }
            Ok(true)
        },
    )
    .await
}

/// A dry-run create of `pod`, checked to have been answered by `column`: how long it took (ms).
async fn timed_create(pods: &Api<Pod>, pod: &Pod, column: Answered) -> anyhow::Result<f64> {
    let dry_run = dry_run();
    let start = Instant::now();
    let created = pods.create(&dry_run, pod).await?;
    let took = start.elapsed().as_secs_f64() * 1e3;
    let by = answered_by(created)?;
    anyhow::ensure!(
        by == column,
        "{} answered by {by:?}, not {column:?}",
        pod.name_any()
    );
    Ok(took)
}

/// `registration` with each of its webhooks selecting only the pods of `column`.
fn selecting(
    registration: &MutatingWebhookConfiguration,
    column: Answered,
) -> MutatingWebhookConfiguration {
    let mut config = registration.clone();
    for webhook in config.webhooks.iter_mut().flatten() {
        webhook.object_selector = Some(LabelSelector {
            match_labels: Some([(COLUMN_LABEL.to_owned(), column.tag().to_owned())].into()),
            ..LabelSelector::default()
        });
    }
    config
}

/// `registration` renamed `name`, its webhooks sent to `url` (trusting `ca`).
fn pointed_at(
    registration: &MutatingWebhookConfiguration,
    name: &str,
    url: &str,
    ca: Vec<u8>,
) -> MutatingWebhookConfiguration {
    let mut config = registration.clone();
    config.metadata.name = Some(name.into());
    for webhook in config.webhooks.iter_mut().flatten() {
        webhook.client_config.url = Some(url.into());
        webhook.client_config.service = None;
        webhook.client_config.ca_bundle = Some(k8s_openapi::ByteString(ca.clone()));
    }
    config
}

/// The label the bare webhook adds when it answers with our patch.
const OUR_PATCH_LABEL: &str = "our-patch";

/// The label its twin adds instead (of the same length: the two patches are of one size).
const TWIN_LABEL: &str = "twin-copy";

/// The JSON patch ours answers for `pod` (created in `namespace`), asked of it directly at
/// `url` (its registration's, trusting `ca`).
async fn our_patch(url: &str, ca: &[u8], namespace: &str, pod: &Pod) -> anyhow::Result<Vec<Value>> {
    use base64::Engine as _;
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let base = url.trim_end_matches("/mutate-pod");
    let mut config = kube::Config::new(base.parse()?);
    config.root_cert = Some(
        CertificateDer::pem_slice_iter(ca)
            .map(|c| c.map(|c| c.to_vec()))
            .collect::<Result<_, _>>()?,
    );
    let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "bench-our-patch",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace, "name": pod.name_any(), "operation": "CREATE",
            "userInfo": {"username": "bench"}, "object": pod}});
    let request = axum::http::Request::post("/mutate-pod")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&review)?)?;
    let answer: Value =
        serde_json::from_str(&Client::try_from(config)?.request_text(request).await?)?;
    let patch = answer["response"]["patch"]
        .as_str()
        .context("ours answered without a patch")?;
    Ok(serde_json::from_slice(
        &base64::engine::general_purpose::STANDARD.decode(patch)?,
    )?)
}

/// Starts `bench-floor` (a sibling of this binary) on 127.0.0.1:`port`, its certificate also
/// naming `host` (the address the API server calls it at), answering with the patch in
/// `patch_file`; waits until it listens.
async fn start_floor(
    dir: &std::path::Path,
    host: &str,
    port: u16,
    patch_file: &std::path::Path,
) -> anyhow::Result<Stopped> {
    let exe = std::env::current_exe()?
        .parent()
        .context("the directory of bench-cluster")?
        .join("bench-floor");
    let addr = format!("127.0.0.1:{port}");
    let child = std::process::Command::new(&exe)
        .args(["--listen", &addr, "--cert-dir"])
        .arg(dir)
        .args(["--cert-host", host])
        .arg("--patch-file")
        .arg(patch_file)
        .stdout(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    let floor = Stopped(child);
    until(
        "the bare webhook with our patch to listen",
        Duration::from_secs(60),
        || async { Ok(tokio::net::TcpStream::connect(&addr).await.is_ok()) },
    )
    .await?;
    Ok(floor)
}

async fn api_path(client: &Client, opts: &Opts) -> anyhow::Result<ApiFigures> {
    // A namespace of this run's own: the API server looks every create in a namespace deleted
    // in the last 30 s up live (NamespaceLifecycle), which would time that lookup instead.
    let ns = &format!("bench-api-{}", std::process::id());
    create_namespace(client, ns).await?;
    let ppss: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &pps_resource());
    ppss.create(&PostParams::default(), &pps_for("db", ns, "WhenDeleted")?)
        .await?;
    let sts: Api<StatefulSet> = Api::namespaced(client.clone(), ns);
    let db = sts
        .create(&PostParams::default(), &statefulset("db", 3)?)
        .await?;
    until("3 recorded states", Duration::from_secs(180), || async {
        Ok(recorded_states(&ppss, "db").await? == 3)
    })
    .await?;
    // Scaled to zero: the pods are gone, their states kept (WhenDeleted), as before a rebuild.
    sts.patch(
        "db",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 0}})),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    until("the pods gone", Duration::from_secs(180), || async {
        Ok(pods.list(&ListParams::default()).await?.items.is_empty())
    })
    .await?;
    anyhow::ensure!(recorded_states(&ppss, "db").await? == 3, "states kept");

    let uid = db.uid().context("StatefulSet uid")?;
    // The k-th create's pod, labelled for `column`'s registration.
    let pod = |k: usize, column: Answered| -> anyhow::Result<Pod> {
        Ok(serde_json::from_value(json!({
            "metadata": {"name": format!("db-{}", k % 3),
                "labels": {"app": "db", COLUMN_LABEL: column.tag()},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "db",
                                     "uid": uid, "controller": true, "blockOwnerDeletion": true}]},
            "spec": {"terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "server", "image": "registry.example.com/server:1"}]}
        }))?)
    };
    let dry_run = dry_run();

    // Ours as registered, and the same registration sending to the bare endpoint; each selects
    // the pods of its own column, so all are registered at once and the columns can alternate
    // create by create.
    let configurations: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let mut shipped = configurations.get(WEBHOOK_CONFIGURATION).await?;
    shipped.metadata = kube::api::ObjectMeta {
        name: shipped.metadata.name.clone(),
        labels: shipped.metadata.labels.clone(),
        ..kube::api::ObjectMeta::default()
    };
    let ours = selecting(&shipped, Answered::Ours);
    let bare = selecting(
        &pointed_at(
            &shipped,
            "bench-floor",
            &format!("https://{}/mutate-pod", opts.baseline_addr),
            std::fs::read(&opts.baseline_ca)?,
        ),
        Answered::Bare,
    );
    const BARE_NAMES: [&str; 3] = ["bench-floor", "bench-floor-our-patch", "bench-floor-twin"];
    install(&configurations, &[&ours], &BARE_NAMES).await?;
    answering(
        &pods,
        &[
            (pod(0, Answered::Nobody)?, Answered::Nobody),
            (pod(0, Answered::Ours)?, Answered::Ours),
        ],
    )
    .await?;
    // The bare webhook once more, answering with the very patch ours answers for this pod (asked
    // of ours directly, for the pod as the API server sends it): what the API server's work on
    // our answer costs, apart from our server.
    let defaulted = pods.create(&dry_run, &pod(0, Answered::Nobody)?).await?;
    let ours_at = ours
        .webhooks
        .iter()
        .flatten()
        .map(|w| &w.client_config)
        .find_map(|c| Some((c.url.as_deref()?, &c.ca_bundle.as_ref()?.0)))
        .context("ours is registered by URL, with a CA bundle")?;
    let ops = our_patch(ours_at.0, ours_at.1, ns, &defaulted).await?;
    // Our patch with a bare webhook's label added to it, written for `bench-floor --patch-file`.
    let labelled = |file: &str, label: &str| {
        let mut ops = ops.clone();
        ops.push(json!({"op": "add", "path": "/metadata/labels/bench-floor", "value": label}));
        let path = opts.cluster_dir.join(file);
        std::fs::write(&path, serde_json::to_vec(&ops)?)?;
        anyhow::Ok(path)
    };
    // The pod and the bare webhook's own patch beside ours, for bench/run.sh's `patchcost`
    // (the API server's steps on each answer, timed apart from any webhook).
    std::fs::write(
        opts.cluster_dir.join("pod-as-sent.json"),
        serde_json::to_vec(&defaulted)?,
    )?;
    std::fs::write(
        opts.cluster_dir.join("bare-patch.json"),
        persistent_pod_state::benchkit::floor::ONE_LABEL,
    )?;
    // Called at the same host as the first bare webhook (`WEBHOOK_HOST` in e2e/lib.sh: the
    // protocol the API server picks follows from it).
    let host = opts
        .baseline_addr
        .rsplit_once(':')
        .map_or("127.0.0.1", |(host, _)| host);
    // The bare webhook answering our patch, and its twin: each a `bench-floor` of its own,
    // registered as `shipped` is but for its name and URL.
    let (mut floors, mut registered) = (Vec::new(), vec![bare]);
    for (name, column, label, port) in [
        (
            BARE_NAMES[1],
            Answered::BareOurPatch,
            OUR_PATCH_LABEL,
            29501,
        ),
        (BARE_NAMES[2], Answered::Twin, TWIN_LABEL, 29502),
    ] {
        let dir = opts.cluster_dir.join(format!("{name}-certs"));
        let patch_file = labelled(&format!("{label}.json"), label)?;
        floors.push(start_floor(&dir, host, port, &patch_file).await?);
        registered.push(selecting(
            &pointed_at(
                &shipped,
                name,
                &format!("https://{host}:{port}/mutate-pod"),
                std::fs::read(dir.join("ca.crt"))?,
            ),
            column,
        ));
    }
    install(&configurations, &registered.iter().collect::<Vec<_>>(), &[]).await?;
    let modes = [
        Answered::Ours,
        Answered::Nobody,
        Answered::Bare,
        Answered::BareOurPatch,
        Answered::Twin,
    ];
    let probes = modes
        .iter()
        .map(|m| Ok((pod(0, *m)?, *m)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    answering(&pods, &probes).await?;
    // Many rounds, and in each the columns take turns create by create, in an order shuffled
    // every cycle ([`Shuffled`]): the API server shares the 2 cores, and its speed drifts with
    // what else runs (its own garbage collections, the host's other guests) by more than what
    // is compared; taking turns puts that drift on every column alike. Issue 22.2: at least 5
    // rounds of at least 1,000 creates per column (short: 2 of 100); 11 of 3,000 in the full
    // mode: a round's p99 is then its 30th slowest create, not its 10th.
    let (rounds, per_round) = if opts.short { (2, 100) } else { (11, 3000) };
    let mut samples: HashMap<&'static str, Vec<f64>> = HashMap::new();
    let floor_columns = [Answered::BareOurPatch, Answered::Twin];
    let processes: Vec<(Answered, u32)> = std::iter::once((Answered::Ours, opts.serve_pid))
        .chain(
            floor_columns
                .into_iter()
                .zip(floors.iter().map(|f| f.0.id())),
        )
        .collect();
    let cpu_before = processes
        .iter()
        .map(|(_, pid)| cpu_seconds(*pid))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for round in 0..rounds {
        let mut order = Shuffled::new(round as u64);
        for cycle in 0..per_round {
            for mode in order.next(modes) {
                let took = timed_create(&pods, &pod(cycle, mode)?, mode).await?;
                samples.entry(mode.label()).or_default().push(took);
            }
        }
    }
    let cpu = processes
        .iter()
        .zip(cpu_before)
        .map(|((column, pid), before)| Ok((*column, cpu_seconds(*pid)? - before)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Where the time of a create goes, from the API server's metrics and ours: those are not
    // by column, so each column's creates go in a block of their own (one round's worth), its
    // metrics read before and after.
    let webhook = shipped
        .webhooks
        .iter()
        .flatten()
        .next()
        .context("the registration's webhook")?
        .name
        .clone();
    let mut spent: HashMap<&'static str, Spent> = HashMap::new();
    let mut timed: HashMap<&'static str, Vec<f64>> = HashMap::new();
    for mode in BLOCKS {
        let before = Spent::read(client, &webhook, &opts.probe).await?;
        for k in 0..per_round {
            let took = timed_create(&pods, &pod(k, mode)?, mode).await?;
            timed.entry(mode.label()).or_default().push(took);
        }
        Spent::read(client, &webhook, &opts.probe)
            .await?
            .add_since(before, spent.entry(mode.label()).or_default());
    }
    // At a steady 100 creates a second (open loop: each create starts when due), the share of
    // the API server's calls of ours that its own histogram puts at or under 5 ms.
    let paced_creates = if opts.short { 300 } else { 3000 };
    let buckets = || async {
        let request = axum::http::Request::get("/metrics").body(Vec::new())?;
        anyhow::Ok(webhook_buckets(
            &client.request_text(request).await?,
            &webhook,
        ))
    };
    let before = buckets().await?;
    let mut ticks = tokio::time::interval(Duration::from_millis(10));
    let mut creates = Vec::with_capacity(paced_creates);
    for k in 0..paced_creates {
        ticks.tick().await;
        let (pods, body) = (pods.clone(), pod(k, Answered::Ours)?);
        let dry_run = dry_run.clone();
        creates.push(tokio::spawn(async move {
            answered_by(pods.create(&dry_run, &body).await?)
        }));
    }
    for created in creates {
        let by = created.await??;
        anyhow::ensure!(by == Answered::Ours, "a paced create answered by {by:?}");
    }
    let after = buckets().await?;
    let calls = after.1 - before.1;
    anyhow::ensure!(
        calls >= paced_creates as f64,
        "{calls} webhook calls counted for {paced_creates} paced creates"
    );
    // Ours registered as shipped again (every pod), the bare webhooks gone: as the parts after
    // this one expect.
    install(&configurations, &[&shipped], &BARE_NAMES).await?;
    answering(&pods, &[(pod(0, Answered::Nobody)?, Answered::Ours)]).await?;
    Ok(ApiFigures {
        creates: rounds * per_round,
        rounds,
        samples,
        block: (per_round, timed),
        spent,
        paced: (paced_creates, (after.0 - before.0) / calls),
        cpu,
    })
}

/// Of the API server's calls of `webhook` (admitting CREATEs), how many its histogram put at
/// or under 5 ms, and how many there were.
fn webhook_buckets(exposition: &str, webhook: &str) -> (f64, f64) {
    let (mut within, mut all) = (0.0, 0.0);
    for line in exposition.lines().filter(|l| {
        l.starts_with("apiserver_admission_webhook_admission_duration_seconds_bucket{")
            && l.contains(&format!(r#"name="{webhook}""#))
            && l.contains(r#"operation="CREATE""#)
            && l.contains(r#"type="admit""#)
    }) {
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        if line.contains(r#"le="0.005""#) {
            within += value;
        } else if line.contains(r#"le="+Inf""#) {
            all += value;
        }
    }
    (within, all)
}

/// 11.4 and 22.5: the controller while `sets` StatefulSets (`pods` in all) become Ready at
/// once, and at rest after.
struct ControllerFigures {
    sets: usize,
    pods: usize,
    lags_ms: Vec<f64>,
    rollout_seconds: f64,
    rollout_writes: f64,
    steady_seconds: u64,
    steady_status_writes: f64,
    steady_generator_writes: f64,
    leader_rss_mb: f64,
}

async fn scrape(addr: &str) -> anyhow::Result<String> {
    let (status, body) = http_get(addr, "/metrics").await?;
    anyhow::ensure!(status == 200, "metrics: HTTP {status}");
    Ok(body)
}

fn status_writes(metrics: &str) -> anyhow::Result<f64> {
    metric(metrics, "pps_status_writes_total").context("pps_status_writes_total")
}

fn generator_writes(metrics: &str) -> f64 {
    ["apply", "delete"]
        .iter()
        .filter_map(|a| {
            metric(
                metrics,
                &format!("pps_generator_writes_total{{action=\"{a}\"}}"),
            )
        })
        .sum()
}

/// `VmRSS` and `VmHWM` of a process, MB.
fn memory_of(pid: u32) -> anyhow::Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = |key: &str| -> anyhow::Result<f64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(key))
            .with_context(|| format!("{key} of {pid}"))?;
        let value: f64 = line.split_whitespace().nth(1).context("value")?.parse()?;
        Ok(value)
    };
    Ok((kb("VmRSS:")? / 1024.0, kb("VmHWM:")? / 1024.0))
}

async fn controller(client: &Client, opts: &Opts) -> anyhow::Result<ControllerFigures> {
    let ns = "bench-controller";
    // Issue 22.5: 20 StatefulSets of 100 pods, all created at once (short: 4 of 15).
    let (sets, per) = if opts.short { (4, 15) } else { (20, 100) };
    let n = sets * per;
    create_namespace(client, ns).await?;
    let ppss: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &pps_resource());
    for k in 0..sets {
        ppss.create(
            &PostParams::default(),
            &pps_for(&format!("big-{k}"), ns, "WhenScaled")?,
        )
        .await?;
    }

    // When this client first sees each pod Ready, and its state recorded (pod names are
    // unique across the StatefulSets).
    let ready: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let recorded: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let seen_ready = ready.clone();
    let pod_watch = tokio::spawn(
        watcher(pods, watcher::Config::default())
            .default_backoff()
            .applied_objects()
            .try_for_each(move |pod| {
                if persistent_pod_state::workload::is_ready(&pod) {
                    let mut seen = seen_ready.lock().unwrap_or_else(|e| e.into_inner());
                    seen.entry(pod.name_any()).or_insert_with(Instant::now);
                }
                futures::future::ready(Ok(()))
            }),
    );
    let seen_recorded = recorded.clone();
    let pps_watch = tokio::spawn(
        watcher(ppss.clone(), watcher::Config::default())
            .default_backoff()
            .applied_objects()
            .try_for_each(move |pps| {
                let now = Instant::now();
                if let Some(states) = pps
                    .data
                    .pointer("/status/podStates")
                    .and_then(Value::as_object)
                {
                    let mut seen = seen_recorded.lock().unwrap_or_else(|e| e.into_inner());
                    for name in states.keys() {
                        seen.entry(name.clone()).or_insert(now);
                    }
                }
                futures::future::ready(Ok(()))
            }),
    );

    let before = status_writes(&scrape(&opts.probe).await?)?;
    let start = Instant::now();
    let statefulsets = Api::<StatefulSet>::namespaced(client.clone(), ns);
    futures::future::try_join_all((0..sets).map(|k| {
        let statefulsets = statefulsets.clone();
        async move {
            statefulsets
                .create(
                    &PostParams::default(),
                    &statefulset(&format!("big-{k}"), per)?,
                )
                .await?;
            anyhow::Ok(())
        }
    }))
    .await?;
    let count = |m: &Arc<Mutex<HashMap<String, Instant>>>| {
        m.lock().unwrap_or_else(|e| e.into_inner()).len()
    };
    until(
        &format!("{n} pods Ready and recorded"),
        Duration::from_secs(if opts.short { 300 } else { 1800 }),
        || async { Ok(count(&ready) >= n && count(&recorded) >= n) },
    )
    .await?;
    let rollout_seconds = start.elapsed().as_secs_f64();
    // The last write may still be on its way to the metrics: settle on the count that made
    // every state visible (the PPS watch saw them all, so that write is done).
    let rollout_writes = status_writes(&scrape(&opts.probe).await?)? - before;
    pod_watch.abort();
    pps_watch.abort();
    let lags_ms: Vec<f64> = {
        let ready = ready.lock().unwrap_or_else(|e| e.into_inner());
        let recorded = recorded.lock().unwrap_or_else(|e| e.into_inner());
        ready
            .iter()
            .filter_map(|(pod, at)| {
                let rec = recorded.get(pod)?;
                Some(rec.saturating_duration_since(*at).as_secs_f64() * 1e3)
            })
            .collect()
    };

    // Steady state: a window with nothing changing (a measurement window, not a wait for
    // something to happen).
    let steady_seconds = if opts.short { 10 } else { 60 };
    let at_rest = scrape(&opts.probe).await?;
    tokio::time::sleep(Duration::from_secs(steady_seconds)).await;
    let after_rest = scrape(&opts.probe).await?;
    let leader_rss_mb = memory_of(opts.serve_pid)?.0;
    // The pods go, so that the parts after run on a quiet cluster (a kubelet busy with 2,000
    // pods takes CPU from what they measure).
    Api::<Namespace>::all(client.clone())
        .delete(ns, &DeleteParams::default())
        .await?;
    until(
        "the controller part's pods gone",
        Duration::from_secs(600),
        || async {
            Ok(Api::<Pod>::namespaced(client.clone(), ns)
                .list(&ListParams::default().limit(1))
                .await?
                .items
                .is_empty())
        },
    )
    .await?;
    Ok(ControllerFigures {
        sets,
        pods: n,
        lags_ms,
        rollout_seconds,
        rollout_writes,
        steady_seconds,
        steady_status_writes: status_writes(&after_rest)? - status_writes(&at_rest)?,
        steady_generator_writes: generator_writes(&after_rest) - generator_writes(&at_rest),
        leader_rss_mb,
    })
}

/// 11.5: a fresh `serve` after its initial sync, with half and with all of the pods.
struct MemoryFigures {
    pods: usize,
    pps: usize,
    states: usize,
    nodes: usize,
    /// A replica started once the control plane was at rest: the figures judged.
    synced: Synced,
    /// A replica started right after the last pod was created.
    busy: Synced,
    /// How the control plane came to rest between the two.
    rest: Rest,
    /// The starts after the judged one (`BENCH_RESTARTS`).
    restarts: Vec<Restart>,
    heap: Heap,
    /// Seconds to create the PersistentPodStates (16 at a time, each through the validating
    /// webhook, which reads the others of its target live) and write their statuses.
    pps_seconds: f64,
}

/// Heap bytes the caches hold per object, counted in this process.
struct Heap {
    per_pod: f64,
    per_state: f64,
    per_node: f64,
    /// Per cached pod carrying a service mesh's and a scraper's annotations ([`MESH`]): every
    /// annotation kept (as before the PersistentPodStates have listed), and only those read.
    per_mesh_pod: [f64; 2],
}

/// What Istio's injection and a Prometheus scrape write on a pod (no PersistentPodState here
/// names one of them).
const MESH: [(&str, &str); 8] = [
    (
        "sidecar.istio.io/status",
        r#"{"initContainers":["istio-init"],"containers":["istio-proxy"],"volumes":["workload-socket","credential-socket","workload-certs","istio-envoy","istio-data","istio-podinfo","istio-token","istiod-ca-cert"],"imagePullSecrets":null,"revision":"default"}"#,
    ),
    ("istio.io/rev", "default"),
    ("kubectl.kubernetes.io/default-container", "server"),
    ("kubectl.kubernetes.io/default-logs-container", "server"),
    ("kubectl.kubernetes.io/restartedAt", "2026-01-01T00:00:00Z"),
    ("prometheus.io/path", "/stats/prometheus"),
    ("prometheus.io/port", "15020"),
    ("prometheus.io/scrape", "true"),
];

/// [`Heap::per_mesh_pod`]: pods as [`listed_pod`] plus [`MESH`], applied to fresh caches
/// before and after their PersistentPodStates (none) have listed.
fn heap_per_mesh_pod(pods: usize, nodes: usize) -> anyhow::Result<[f64; 2]> {
    let bodies: Vec<Vec<u8>> = (0..pods)
        .map(|i| {
            let mut pod: serde_json::Value = serde_json::from_slice(&listed_pod(i, nodes)?)?;
            pod["metadata"]["annotations"] = MESH
                .iter()
                .map(|(k, v)| (k.to_string(), json!(v)))
                .collect();
            Ok(serde_json::to_vec(&pod)?)
        })
        .collect::<anyhow::Result<_>>()?;
    let mut per_pod = [0.0; 2];
    for (listed_first, per_pod) in [false, true].into_iter().zip(&mut per_pod) {
        let caches = Caches::new();
        if listed_first {
            caches.apply_pps(watcher::Event::Init);
            caches.apply_pps(watcher::Event::InitDone);
        }
        *per_pod = heap_per_pod_listed(&caches, &bodies)?;
    }
    Ok(per_pod)
}

/// Heap bytes per pod of `bodies` (listed pods) decoded as the pod watch decodes them and
/// applied to `caches` as one list, the live heap counted before and after.
fn heap_per_pod_listed(caches: &Caches, bodies: &[Vec<u8>]) -> anyhow::Result<f64> {
    let before = LIVE.load(Ordering::Relaxed);
    caches.apply_cached_pod(watcher::Event::Init);
    for body in bodies {
        let pod: WatchedPod = serde_json::from_slice(body)?;
        caches.apply_cached_pod(watcher::Event::InitApply(Arc::new(pod.pod)));
    }
    caches.apply_cached_pod(watcher::Event::InitDone);
    Ok((LIVE.load(Ordering::Relaxed) - before) as f64 / bodies.len() as f64)
}

/// Live heap bytes of this process (the counting allocator below).
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// The system allocator, counting live bytes (for [`Heap`]).
struct Counting;

// SAFETY: every call is forwarded to the system allocator unchanged; only a counter is kept.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's pointer, layout and size.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A Running, Ready pod as the API server lists it (the memory test's pod, with a status).
fn listed_pod(i: usize, nodes: usize) -> anyhow::Result<Vec<u8>> {
    let mut pod = serde_json::to_value(memory_pod(i, nodes)?)?;
    pod["metadata"]["uid"] = json!(format!("00000000-0000-0000-0000-{i:012}"));
    pod["metadata"]["resourceVersion"] = json!(format!("{}", 1000 + i));
    pod["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
    let ip = format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255);
    let condition = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"});
    pod["status"] = json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "hostIP": "192.168.0.1", "startTime": "2026-01-01T00:00:00Z", "qosClass": "Burstable",
        "conditions": [condition("Initialized"), condition("Ready"), condition("ContainersReady"), condition("PodScheduled")],
        "containerStatuses": [{"name": "server", "image": "registry.example.com/team/server:1.27.3",
            "imageID": "registry.example.com/team/server@sha256:0123456789abcdef", "ready": true,
            "restartCount": 0, "started": true, "containerID": format!("containerd://{i:064}"),
            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]});
    Ok(serde_json::to_vec(&pod)?)
}

/// Heap bytes per cached pod, recorded state and node: objects decoded as the watches decode
/// them and applied to fresh caches, the live heap counted before and after.
fn heap_per_object(pods: usize, pps: usize, states: usize, nodes: usize) -> anyhow::Result<Heap> {
    let caches = Caches::new();
    let bodies: Vec<Vec<u8>> = (0..pods)
        .map(|i| listed_pod(i, nodes))
        .collect::<anyhow::Result<_>>()?;
    let per_pod = heap_per_pod_listed(&caches, &bodies)?;
    drop(bodies);
    eprintln!(
        "bench-cluster: a Pod is {} bytes before its heap fields, a cached pod {}",
        std::mem::size_of::<Pod>(),
        std::mem::size_of::<CachedPod>()
    );

    let listed: Vec<Vec<u8>> = (0..pps)
        .map(|i| serde_json::to_vec(&synthetic::pps(i, states, nodes)))
        .collect::<Result<_, _>>()?;
    let before = LIVE.load(Ordering::Relaxed);
    caches.apply_pps(watcher::Event::Init);
    for body in &listed {
        let object: PersistentPodState = serde_json::from_slice(body)?;
        caches.apply_pps(watcher::Event::InitApply(object));
    }
    caches.apply_pps(watcher::Event::InitDone);
    let per_state = (LIVE.load(Ordering::Relaxed) - before) as f64 / (pps * states) as f64;
    drop(listed);

    let listed: Vec<Vec<u8>> = (0..nodes)
        .map(|j| serde_json::to_vec(&synthetic::node(j)))
        .collect::<Result<_, _>>()?;
    let before = LIVE.load(Ordering::Relaxed);
    caches.apply_node(watcher::Event::Init);
    for body in &listed {
        let node: Read<Node> = serde_json::from_slice(body)?;
        caches.apply_node(watcher::Event::InitApply(node.0));
    }
    caches.apply_node(watcher::Event::InitDone);
    let per_node = (LIVE.load(Ordering::Relaxed) - before) as f64 / nodes as f64;
    Ok(Heap {
        per_pod,
        per_state,
        per_node,
        per_mesh_pod: heap_per_mesh_pod(pods, nodes)?,
    })
}

/// What a fresh replica showed once synced.
struct Synced {
    rss_mb: f64,
    peak_mb: f64,
    cached_pods: f64,
    seconds: f64,
    /// CPU seconds (user + system) the replica spent from its start to Ready.
    replica_cpu: f64,
    /// Minor page faults the replica took from its start to Ready.
    replica_faults: f64,
    /// CPU seconds the API server spent meanwhile (serving the lists, and whatever else).
    apiserver_cpu: f64,
    /// The API server's garbage collector around the start.
    gc: ApiServerGc,
}

/// The API server's garbage collector around a start (its Go runtime's metrics): a collection
/// that runs through the start marks the whole heap, 100,000 pods in the watch cache, on the
/// cores the lists are served from (bench/NOTEBOOK.md, part 5).
struct ApiServerGc {
    /// Collections completed from the start to Ready.
    collections: f64,
    /// The heap in use as the start began (GB).
    heap_gb: f64,
    /// The heap at which the next collection was due then (GB).
    goal_gb: f64,
    /// What the API server allocated from the start to Ready (GB): the start's lists, and
    /// whatever else it served meanwhile.
    allocated_gb: f64,
    /// The API server's own cache consistency checks (each lists a resource from etcd)
    /// completed from the start to Ready.
    consistency_checks: f64,
}

/// The API server's Go runtime, as its `/metrics` reads.
struct GoRuntime {
    /// Collections completed so far.
    collections: f64,
    /// The heap in use (bytes).
    heap: f64,
    /// The heap at which the next collection is due (bytes).
    goal: f64,
    /// Bytes allocated since it started.
    allocated: f64,
    /// Its cache consistency checks completed so far, every resource and outcome together
    /// (none before v1.34, or with `DetectCacheInconsistency` off).
    consistency_checks: f64,
}

/// The API server's Go runtime now: collections so far, heap in use, the next collection's goal,
/// what it allocated since it started, and its cache consistency checks so far.
async fn apiserver_runtime(client: &Client) -> anyhow::Result<GoRuntime> {
    let request = axum::http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(request).await?;
    let read = |name: &str| metric(&text, name).with_context(|| format!("the API server's {name}"));
    Ok(GoRuntime {
        collections: read("go_gc_duration_seconds_count")?,
        heap: read("go_memstats_heap_alloc_bytes")?,
        goal: read("go_memstats_next_gc_bytes")?,
        allocated: read("go_memstats_alloc_bytes_total")?,
        consistency_checks: summed(&text, "apiserver_storage_consistency_checks_total"),
    })
}

/// The sum of a counter's series, whatever their labels (0 when it has none).
fn summed(exposition: &str, name: &str) -> f64 {
    exposition
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.rsplit_once('}')?.1,
                None => rest,
            };
            value.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

/// With `BENCH_APISERVER_ALLOCS=DIR`, saves the API server's allocation profile
/// (`/debug/pprof/allocs`) as `DIR/NAME.pb.gz`: two of them around a start tell which of the API
/// server's code allocated through it (`go tool pprof -sample_index=alloc_space -base A B`).
async fn save_apiserver_allocs(client: &Client, name: &str) -> anyhow::Result<()> {
    let Some(dir) = std::env::var_os("BENCH_APISERVER_ALLOCS") else {
        return Ok(());
    };
    let request = axum::http::Request::get("/debug/pprof/allocs").body(Vec::new())?;
    let response = client.send(request.map(kube::client::Body::from)).await?;
    anyhow::ensure!(
        response.status().is_success(),
        "the API server's allocation profile: {}",
        response.status()
    );
    let bytes = http_body_util::BodyExt::collect(response.into_body())
        .await?
        .to_bytes();
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(format!("{name}.pb.gz")), bytes)?;
    Ok(())
}

/// A pod of the memory test: the synthetic StatefulSet pod, bare (no owner) and bound to a node.
/// The benchmark's nodes have no kubelet, so the node lifecycle controller marks them
/// unreachable and taints them: the pods tolerate that for good (as a DaemonSet's do), so none
/// is evicted while the rest are created.
fn memory_pod(i: usize, nodes: usize) -> anyhow::Result<Pod> {
    let mut pod = synthetic::pod(i);
    pod["metadata"]["name"] = json!(format!("mem-{i}"));
    if let Some(meta) = pod["metadata"].as_object_mut() {
        meta.remove("generateName");
        meta.remove("ownerReferences");
    }
    pod["spec"]["nodeName"] = json!(format!("node-{}", i % nodes.max(1)));
    pod["spec"]["tolerations"] = json!([
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"}
    ]);
    if let Some(obj) = pod.as_object_mut() {
        obj.remove("status");
    }
    Ok(serde_json::from_value(pod)?)
}

/// A child process, killed when dropped.
struct Stopped(std::process::Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a standby replica of `bin` (the registered one holds the Lease), waits until its
/// caches have synced (`/readyz`), and reads its memory.
async fn fresh_replica(
    client: &Client,
    opts: &Opts,
    bin: &Path,
    name: &str,
    port: u16,
) -> anyhow::Result<Synced> {
    let dir = &opts.cluster_dir;
    let log = std::fs::File::create(dir.join("logs").join(format!("{name}.log")))?;
    let probe = format!("127.0.0.1:{}", port + 1);
    let child = std::process::Command::new(bin)
        .arg("serve")
        .env("KUBECONFIG", dir.join("sa-kubeconfig"))
        .env("PPS_LISTEN", format!("127.0.0.1:{port}"))
        .env("PPS_PROBE_LISTEN", &probe)
        .env("PPS_TLS_CERT", dir.join("webhook-tls/tls.crt"))
        .env("PPS_TLS_KEY", dir.join("webhook-tls/tls.key"))
        .env("PPS_SHUTDOWN_DELAY_SECONDS", "0")
        .env("PPS_LEADER_IDENTITY", name)
        .env("PPS_LEASE_NAMESPACE", "persistent-pod-state")
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    let replica = Stopped(child);
    let pid = replica.0.id();
    let apiserver = pid_file(dir, "kube-apiserver")?;
    save_apiserver_allocs(client, &format!("{name}-start")).await?;
    let before = apiserver_runtime(client).await?;
    let apiserver_before = cpu_seconds(apiserver)?;
    let start = Instant::now();
    until(
        &format!("{name} to sync"),
        Duration::from_secs(600),
        || async { Ok(http_get(&probe, "/readyz").await?.0 == 200) },
    )
    .await?;
    let seconds = start.elapsed().as_secs_f64();
    let replica_cpu = cpu_seconds(pid)?;
    let replica_faults = minor_faults(pid)? as f64;
    let apiserver_cpu = cpu_seconds(apiserver)? - apiserver_before;
    let after = apiserver_runtime(client).await?;
    save_apiserver_allocs(client, &format!("{name}-ready")).await?;
    let gc = ApiServerGc {
        collections: after.collections - before.collections,
        heap_gb: before.heap / 1e9,
        goal_gb: before.goal / 1e9,
        allocated_gb: (after.allocated - before.allocated) / 1e9,
        consistency_checks: after.consistency_checks - before.consistency_checks,
    };
    let (rss_mb, peak_mb) = memory_of(pid)?;
    let cached_pods = metric(&scrape(&probe).await?, "pps_cached_pods").context("cached pods")?;
    drop(replica);
    Ok(Synced {
        rss_mb,
        peak_mb,
        cached_pods,
        seconds,
        replica_cpu,
        replica_faults,
        apiserver_cpu,
        gc,
    })
}

/// The pid of the control plane's process `name` (its pid file, written by `e2e/lib.sh`).
fn pid_file(dir: &std::path::Path, name: &str) -> anyhow::Result<u32> {
    std::fs::read_to_string(dir.join(format!("{name}.pid")))
        .with_context(|| format!("{name}.pid"))?
        .trim()
        .parse()
        .with_context(|| format!("{name}.pid"))
}

/// The control plane's processes whose CPU says whether it is at rest (pid files of
/// `e2e/lib.sh`); the registered replica is added by its pid.
const CONTROL_PLANE: [&str; 4] = [
    "kube-apiserver",
    "etcd",
    "kube-controller-manager",
    "kube-scheduler",
];
/// At rest: the control plane and the registered replica together under this many cores over
/// one window of `REST_WINDOW`.
const REST_CORES: f64 = 0.3;
/// The window over which the control plane's cores are read.
const REST_WINDOW: Duration = Duration::from_secs(5);

/// How the control plane came to rest before the judged start.
struct Rest {
    /// Seconds from the call until at rest (or until the deadline).
    waited: f64,
    /// Cores the control plane and the registered replica used in the last window.
    cores: f64,
    /// Of which the API server.
    apiserver_cores: f64,
    /// Of which the registered replica (the leader, its nodes lost one by one meanwhile).
    leader_cores: f64,
    /// The leader's cores over the whole wait.
    leader_mean_cores: f64,
    /// False when the deadline passed first (the start is then measured anyway, and says so).
    settled: bool,
}

/// Waits until the registered replica caches `pods` pods and the control plane is at rest
/// (`REST_CORES` over a `REST_WINDOW`), for at most 10 minutes (2 in the short mode); prints
/// each window's cores per process to stderr.
async fn at_rest(opts: &Opts, pods: usize) -> anyhow::Result<Rest> {
    let start = Instant::now();
    let limit = Duration::from_secs(if opts.short { 120 } else { 600 });
    let mut pids = Vec::new();
    for name in CONTROL_PLANE {
        pids.push((name, pid_file(&opts.cluster_dir, name)?));
    }
    pids.push(("registered replica", opts.serve_pid));
    let leader_before = cpu_seconds(opts.serve_pid)?;
    loop {
        let before = pids
            .iter()
            .map(|(_, pid)| cpu_seconds(*pid))
            .collect::<anyhow::Result<Vec<_>>>()?;
        tokio::time::sleep(REST_WINDOW).await;
        let mut cores = Vec::with_capacity(pids.len());
        for ((_, pid), was) in pids.iter().zip(&before) {
            cores.push((cpu_seconds(*pid)? - was) / REST_WINDOW.as_secs_f64());
        }
        let total: f64 = cores.iter().sum();
        let cached = metric(&scrape(&opts.probe).await?, "pps_cached_pods").unwrap_or(0.0);
        let line: Vec<String> = pids
            .iter()
            .zip(&cores)
            .map(|((name, _), c)| format!("{name} {c:.2}"))
            .collect();
        eprintln!(
            "bench-cluster: at {:.0} s, cores over {} s: {} (total {total:.2}); the registered replica caches {cached} pods",
            start.elapsed().as_secs_f64(),
            REST_WINDOW.as_secs(),
            line.join(", ")
        );
        let settled = total < REST_CORES && cached >= pods as f64;
        if settled || start.elapsed() >= limit {
            return Ok(Rest {
                waited: start.elapsed().as_secs_f64(),
                cores: total,
                apiserver_cores: cores[0],
                leader_cores: cores[CONTROL_PLANE.len()],
                leader_mean_cores: (cpu_seconds(opts.serve_pid)? - leader_before)
                    / start.elapsed().as_secs_f64(),
                settled,
            });
        }
    }
}

/// One of the starts after the judged one.
struct Restart {
    /// Whether it started `BENCH_RESTART_OTHER_BIN` (build B) rather than `--serve-bin` (A).
    other: bool,
    /// Whether the control plane was at rest before it (see [`at_rest`]).
    settled: bool,
    start: Synced,
}

/// With `BENCH_RESTARTS=N`, N more starts after the judged one, each once the control plane is
/// at rest again: the spread of the start over one cluster. With `BENCH_RESTART_OTHER_BIN=PATH`
/// the second and third of every four start that binary instead (A B B A), so two builds are
/// compared on the same objects and API server.
async fn restarts(client: &Client, opts: &Opts, pods: usize) -> anyhow::Result<Vec<Restart>> {
    let n: usize = match std::env::var("BENCH_RESTARTS") {
        Ok(v) => v.parse().context("BENCH_RESTARTS")?,
        Err(_) => 0,
    };
    let other = std::env::var_os("BENCH_RESTART_OTHER_BIN").map(PathBuf::from);
    let mut done = Vec::with_capacity(n);
    for i in 0..n {
        let rest = at_rest(opts, pods).await?;
        let (bin, is_other) = match (&other, i % 4) {
            (Some(bin), 1 | 2) => (bin.as_path(), true),
            _ => (opts.serve_bin.as_path(), false),
        };
        let port = 19670 + 2 * u16::try_from(i % 100)?;
        let name = format!("bench-memory-restart-{i}");
        let start = fresh_replica(client, opts, bin, &name, port).await?;
        done.push(Restart {
            other: is_other,
            settled: rest.settled,
            start,
        });
    }
    Ok(done)
}

/// One way of reading every object of a kind, as a replica's first list does.
#[derive(Clone, Copy)]
enum ListWay {
    /// A streaming list: a watch that sends every object, ended by a bookmark.
    Streaming,
    /// One whole list from the watch cache (`resourceVersion=0`, with a limit it ignores).
    Whole,
}

/// Reads every object at `path` (`accept` for the whole list, `accept_watch` for the
/// streaming list's events) the `way` given; the bytes read.
async fn read_every(
    client: &Client,
    path: &str,
    accept: &str,
    accept_watch: &str,
    way: ListWay,
) -> anyhow::Result<u64> {
    use http_body_util::BodyExt;
    let (uri, accept) = match way {
        ListWay::Streaming => (
            format!(
                "{path}?watch=true&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&resourceVersion=0&timeoutSeconds=600"
            ),
            accept_watch,
        ),
        // As a replica asks (src/state/proto.rs): the watch cache ignores the limit.
        ListWay::Whole => (format!("{path}?limit=500&resourceVersion=0"), accept),
    };
    let request = axum::http::Request::get(uri)
        .header(axum::http::header::ACCEPT, accept)
        .body(kube::client::Body::empty())?;
    let response = client.send(request).await?;
    anyhow::ensure!(
        response.status().is_success(),
        "{path}: {}",
        response.status()
    );
    // The streaming list ends with a bookmark annotated `k8s.io/initial-events-end`.
    const END: &[u8] = b"k8s.io/initial-events-end";
    let mut body = response.into_body();
    let (mut read, mut tail) = (0u64, Vec::new());
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        read += data.len() as u64;
        if matches!(way, ListWay::Streaming) {
            tail.extend_from_slice(&data);
            if tail.windows(END.len()).any(|w| w == END) {
                return Ok(read);
            }
            tail.drain(..tail.len().saturating_sub(END.len()));
        }
    }
    anyhow::ensure!(
        matches!(way, ListWay::Whole),
        "{path}: the streaming list ended before its initial events did"
    );
    Ok(read)
}

/// With `BENCH_LIST_COST=N` (after the starts): what the API server spends serving one read of
/// every pod (protobuf) and of every PersistentPodState (JSON), as a streaming list and as one
/// whole list from its watch cache, in N rounds alternated (A B, then B A), each once the
/// control plane is at rest: its CPU and what it allocated (the garbage that brings its
/// collector into a replica's start), with the medians. Why a replica reads pods whole and the
/// rest streamed.
async fn list_costs(client: &Client, opts: &Opts, pods: usize) -> anyhow::Result<()> {
    let rounds: usize = match std::env::var("BENCH_LIST_COST") {
        Ok(v) => v.parse().context("BENCH_LIST_COST")?,
        Err(_) => return Ok(()),
    };
    let apiserver = pid_file(&opts.cluster_dir, "kube-apiserver")?;
    let kinds = [
        (
            "pods",
            "/api/v1/pods",
            "application/vnd.kubernetes.protobuf",
            "application/vnd.kubernetes.protobuf;stream=watch",
        ),
        (
            "PersistentPodStates",
            "/apis/apps.kruise.io/v1beta1/persistentpodstates",
            "application/json",
            "application/json",
        ),
    ];
    /// One read's cost: seconds, the API server's CPU, what it allocated (GB), its collections.
    struct Cost([f64; 4]);
    let mut rows: HashMap<(&str, &str), Vec<Cost>> = HashMap::new();
    println!(
        "\nReading every object of a kind (BENCH_LIST_COST): the API server's CPU and allocation per read, each once the control plane was at rest\n\n| round | kind | way | seconds | the API server's CPU (s) | it allocated (GB) | its collections | MB read |\n|---|---|---|---|---|---|---|---|"
    );
    for round in 0..rounds {
        for (kind, path, accept, accept_watch) in kinds {
            let mut ways = [
                ("streaming list", ListWay::Streaming),
                ("whole list", ListWay::Whole),
            ];
            if round % 2 == 1 {
                ways.reverse();
            }
            for (name, way) in ways {
                at_rest(opts, pods).await?;
                let before = apiserver_runtime(client).await?;
                let cpu = cpu_seconds(apiserver)?;
                let started = Instant::now();
                let read = read_every(client, path, accept, accept_watch, way).await?;
                let seconds = started.elapsed().as_secs_f64();
                let cpu = cpu_seconds(apiserver)? - cpu;
                let after = apiserver_runtime(client).await?;
                let allocated = (after.allocated - before.allocated) / 1e9;
                let collections = after.collections - before.collections;
                println!(
                    "| {round} | {kind} | {name} | {seconds:.2} | {cpu:.2} | {allocated:.3} | {collections:.0} | {:.1} |",
                    read as f64 / 1e6
                );
                rows.entry((kind, name)).or_default().push(Cost([
                    seconds,
                    cpu,
                    allocated,
                    collections,
                ]));
            }
        }
    }
    println!(
        "\n| kind | way | reads | seconds | the API server's CPU (s) | it allocated (GB) | its collections |\n|---|---|---|---|---|---|---|"
    );
    let mut keys: Vec<_> = rows.keys().copied().collect();
    keys.sort_unstable();
    for key in keys {
        let r = &rows[&key];
        let col = |i: usize| median(&r.iter().map(|c| c.0[i]).collect::<Vec<_>>());
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.3} | {:.0} in all |",
            key.0,
            key.1,
            r.len(),
            col(0),
            col(1),
            col(2),
            r.iter().map(|c| c.0[3]).sum::<f64>()
        );
    }
    Ok(())
}

/// Runs `make` for each of `0..n`, 16 at a time.
async fn create_all<K, F>(api: &Api<K>, n: std::ops::Range<usize>, make: F) -> anyhow::Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
    F: Fn(usize) -> anyhow::Result<K>,
{
    futures::stream::iter(n)
        .map(|i| {
            let object = make(i);
            async move {
                api.create(&PostParams::default(), &object?).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(16)
        .try_for_each(|()| async { Ok(()) })
        .await
}

async fn memory(client: &Client, opts: &Opts) -> anyhow::Result<MemoryFigures> {
    let (pods, pps, states, nodes) = if opts.short {
        (1_000, 100, 10, 20)
    } else {
        (100_000, 10_000, 10, 1_000)
    };
    for k in 0..synthetic::NAMESPACES {
        create_namespace(client, &format!("ns-{k}")).await?;
    }
    create_all(&Api::<Node>::all(client.clone()), 0..nodes, |j| {
        Ok(serde_json::from_value(synthetic::node(j))?)
    })
    .await?;
    // PersistentPodStates of Advanced StatefulSets (not installed here: the controller records
    // nothing for them and prunes nothing), each with `states` recorded states.
    let resource = pps_resource();
    let statuses: Vec<Value> = (0..pps)
        .map(|i| synthetic::kruise_pps(i, states, nodes))
        .collect();
    let pps_start = Instant::now();
    futures::stream::iter(statuses)
        .map(|mut object| {
            let resource = resource.clone();
            async move {
                let status = object.as_object_mut().and_then(|o| o.remove("status"));
                if let Some(meta) = object["metadata"].as_object_mut() {
                    for field in ["uid", "resourceVersion", "creationTimestamp"] {
                        meta.remove(field);
                    }
                }
                let namespace = object["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                let name = object["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                let api: Api<DynamicObject> =
                    Api::namespaced_with(client.clone(), &namespace, &resource);
                api.create(&PostParams::default(), &serde_json::from_value(object)?)
                    .await?;
                api.patch_status(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "status": status })),
                )
                .await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(16)
        .try_for_each(|()| async { Ok(()) })
        .await?;
    let pps_seconds = pps_start.elapsed().as_secs_f64();

    // Pod i is in namespace ns-(i % 10): created namespace by namespace.
    let per_namespace = pods / synthetic::NAMESPACES;
    let batch = |range: std::ops::Range<usize>| {
        let client = client.clone();
        async move {
            for k in 0..synthetic::NAMESPACES {
                let api: Api<Pod> = Api::namespaced(client.clone(), &format!("ns-{k}"));
                create_all(&api, range.clone(), |j| {
                    memory_pod(j * synthetic::NAMESPACES + k, nodes)
                })
                .await?;
            }
            anyhow::Ok(())
        }
    };
    batch(0..per_namespace).await?;
    // As every run before the tenth session measured it: the moment the last pod is created,
    // with the control plane still absorbing 100,000 creations.
    let busy = fresh_replica(client, opts, &opts.serve_bin, "bench-memory-busy", 19650).await?;
    // The figure judged: a restart into a cluster at rest (the registered replica caching every
    // pod, the control plane's own work done), as a replica restarts in production.
    let rest = at_rest(opts, pods).await?;
    let synced = fresh_replica(client, opts, &opts.serve_bin, "bench-memory", 19660).await?;
    let restarts = restarts(client, opts, pods).await?;
    list_costs(client, opts, pods).await?;
    for s in [&busy, &synced]
        .into_iter()
        .chain(restarts.iter().map(|r| &r.start))
    {
        anyhow::ensure!(
            s.cached_pods >= pods as f64,
            "the replica cached {} pods",
            s.cached_pods
        );
    }
    Ok(MemoryFigures {
        pods,
        pps,
        states,
        nodes,
        synced,
        busy,
        rest,
        restarts,
        heap: heap_per_object(pods, pps, states, nodes)?,
        pps_seconds,
    })
}

fn figure(value: f64) -> anyhow::Result<f64> {
    anyhow::ensure!(value.is_finite(), "a figure was not produced");
    Ok(value)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().collect();
    let opts = Opts {
        short: args.iter().any(|a| a == "--short"),
        baseline_addr: flag(&args, "--baseline-addr").context("--baseline-addr HOST:PORT")?,
        baseline_ca: flag(&args, "--baseline-ca")
            .context("--baseline-ca FILE")?
            .into(),
        probe: flag(&args, "--probe").context("--probe HOST:PORT")?,
        serve_pid: flag(&args, "--serve-pid")
            .context("--serve-pid PID")?
            .parse()?,
        serve_bin: flag(&args, "--serve-bin")
            .context("--serve-bin PATH")?
            .into(),
        cluster_dir: flag(&args, "--cluster-dir")
            .context("--cluster-dir DIR")?
            .into(),
    };
    let client = Client::try_default().await?;

    let only = flag(&args, "--only");
    let part = |name: &str| only.as_deref().is_none_or(|o| o == name);
    if part("api") {
        eprintln!("bench-cluster: pod CREATE latency through the API server");
        print_api(&api_path(&client, &opts).await?)?;
    }
    if part("controller") {
        eprintln!("bench-cluster: a StatefulSet becoming Ready");
        print_controller(&controller(&client, &opts).await?)?;
    }
    if part("memory") {
        eprintln!("bench-cluster: memory at scale");
        print_memory(&memory(&client, &opts).await?)?;
    }
    Ok(())
}

fn print_api(api: &ApiFigures) -> anyhow::Result<()> {
    println!(
        "\nPod CREATE through the API server (issue 11.3): {} dry-run creates of a re-created StatefulSet pod per column, in {} round(s), the columns taking turns create by create\n",
        api.creates, api.rounds
    );
    println!(
        "| figure (ms) | no webhook | bare webhook | bare webhook, our patch | ours | added by ours | ours over bare | ours over bare with our patch | target |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let of = |mode: Answered| -> anyhow::Result<&Vec<f64>> {
        let samples = api.samples.get(mode.label()).context("samples")?;
        anyhow::ensure!(samples.len() >= api.creates, "{} samples", samples.len());
        Ok(samples)
    };
    for (name, q, target) in [("p50", 0.5, "added <= 1"), ("p99", 0.99, "")] {
        let none = figure(quantile(of(Answered::Nobody)?, q))?;
        let bare = figure(quantile(of(Answered::Bare)?, q))?;
        let patched = figure(quantile(of(Answered::BareOurPatch)?, q))?;
        let ours = figure(quantile(of(Answered::Ours)?, q))?;
        println!(
            "| {name} | {none:.2} | {bare:.2} | {patched:.2} | {ours:.2} | {:.2} | {:.2} | {:.2} | {target} |",
            ours - none,
            ours - bare,
            ours - patched
        );
    }
    // The same figure per round (each column's creates of that round): how much it drifts.
    let per_round = api.creates / api.rounds.max(1);
    let added: Vec<f64> = of(Answered::Ours)?
        .chunks(per_round)
        .zip(of(Answered::Nobody)?.chunks(per_round))
        .map(|(ours, none)| quantile(ours, 0.5) - quantile(none, 0.5))
        .collect();
    println!(
        "\np50 added by ours in each round (ms), min / median / max: {:.2} / {:.2} / {:.2}",
        quantile(&added, 0.0),
        median(&added),
        quantile(&added, 1.0)
    );
    // Issue 22.2: what ours adds over the bare webhook, round by round (each round's column of
    // creates), and the median over the rounds.
    // Split by the bare webhook answering our patch: what the API server's work on our answer
    // costs, and what our server adds beyond it.
    println!("\n| over (ms), each round's | rounds | min | median | max | target |");
    println!("|---|---|---|---|---|---|");
    for (name, q, target, top, under) in [
        (
            "ours over bare, p50",
            0.5,
            "<= 0.1",
            Answered::Ours,
            Answered::Bare,
        ),
        (
            "ours over bare, p99",
            0.99,
            "<= 0.3",
            Answered::Ours,
            Answered::Bare,
        ),
        (
            "our patch on the bare webhook over bare, p50",
            0.5,
            "",
            Answered::BareOurPatch,
            Answered::Bare,
        ),
        (
            "our patch on the bare webhook over bare, p99",
            0.99,
            "",
            Answered::BareOurPatch,
            Answered::Bare,
        ),
        (
            "ours over the bare webhook with our patch, p50",
            0.5,
            "",
            Answered::Ours,
            Answered::BareOurPatch,
        ),
        (
            "ours over the bare webhook with our patch, p99",
            0.99,
            "",
            Answered::Ours,
            Answered::BareOurPatch,
        ),
        (
            "its twin over the bare webhook with our patch (the method alone), p50",
            0.5,
            "",
            Answered::Twin,
            Answered::BareOurPatch,
        ),
        (
            "its twin over the bare webhook with our patch (the method alone), p99",
            0.99,
            "",
            Answered::Twin,
            Answered::BareOurPatch,
        ),
    ] {
        let over: Vec<f64> = of(top)?
            .chunks(per_round)
            .zip(of(under)?.chunks(per_round))
            .map(|(top, under)| quantile(top, q) - quantile(under, q))
            .collect();
        println!(
            "| {name} | {} | {:.2} | {:.2} | {:.2} | {target} |",
            over.len(),
            quantile(&over, 0.0),
            figure(median(&over))?,
            quantile(&over, 1.0)
        );
    }
    // CPU per review: each column's process answered one review per create of the rounds.
    let reviews = api.creates as f64;
    let per_review = |column: Answered| {
        api.cpu
            .iter()
            .find(|(c, _)| *c == column)
            .map(|(_, seconds)| seconds / reviews * 1e6)
            .context("the column's CPU")
    };
    println!(
        "\nCPU per review over the rounds (each process whole, µs): ours {:.1}, the bare webhook with our patch {:.1}, its twin {:.1}; ours over the bare webhook with our patch {:.2} x",
        figure(per_review(Answered::Ours)?)?,
        figure(per_review(Answered::BareOurPatch)?)?,
        figure(per_review(Answered::Twin)?)?,
        per_review(Answered::Ours)? / per_review(Answered::BareOurPatch)?,
    );
    let (paced, within) = api.paced;
    println!(
        "\nAt 100 creates a second ({paced} creates, ours registered): {:.1} % of the API server's calls of ours within its 5 ms bucket (target >= 99 %)",
        figure(within * 100.0)?
    );
    // Where the time went, by the servers' own clocks (means: the API server's histograms have
    // buckets far coarser than a millisecond, so only their sums and counts tell).
    println!(
        "\nWhere a create's time went, mean ms per create (the API server's and our server's own metrics; {} creates per column, in a block of their own)\n",
        api.block.0
    );
    println!("| mean (ms) | no webhook | bare webhook | bare webhook, our patch | ours |");
    println!("|---|---|---|---|---|");
    let row = |name: &str, value: &dyn Fn(Answered) -> anyhow::Result<String>| {
        let cells: Vec<String> = BLOCKS.iter().map(|m| value(*m)).collect::<Result<_, _>>()?;
        println!("| {name} | {} |", cells.join(" | "));
        anyhow::Ok(())
    };
    let creates = api.block.0 as f64;
    let mean = |m: Answered| -> anyhow::Result<f64> {
        let samples = api.block.1.get(m.label()).context("a block's samples")?;
        anyhow::ensure!(samples.len() == api.block.0, "{} samples", samples.len());
        Ok(samples.iter().sum::<f64>() / samples.len() as f64)
    };
    let spent = |m: Answered| api.spent.get(m.label()).copied().unwrap_or_default();
    // Every create was counted where it went through (a metric renamed would leave zeros).
    for (m, what, counted) in [
        (
            Answered::Nobody,
            "admission",
            spent(Answered::Nobody).step.1,
        ),
        (
            Answered::Bare,
            "webhook calls",
            spent(Answered::Bare).call.1,
        ),
        (
            Answered::BareOurPatch,
            "webhook calls",
            spent(Answered::BareOurPatch).call.1,
        ),
        (
            Answered::Ours,
            "webhook calls",
            spent(Answered::Ours).call.1,
        ),
        (Answered::Ours, "reviews", spent(Answered::Ours).server.1),
    ] {
        anyhow::ensure!(
            counted >= creates,
            "{}: {counted} {what} counted for {creates} creates",
            m.label()
        );
    }
    let ms = |(sum, _count): (f64, f64)| sum * 1e3 / creates;
    let per_create = |spent: (f64, f64)| format!("{:.3}", ms(spent));
    row("create, as this client timed it", &|m| {
        Ok(format!("{:.2}", mean(m)?))
    })?;
    row("outside the API server's mutating admission", &|m| {
        Ok(format!("{:.2}", mean(m)? - ms(spent(m).step)))
    })?;
    row(
        "the API server's mutating admission (all plugins; twice after a patch)",
        &|m| Ok(per_create(spent(m).step)),
    )?;
    row("of it, the mutating webhook plugin", &|m| {
        Ok(per_create(spent(m).plugin))
    })?;
    row(
        "of that, its call of the webhook (sent, answered, patch applied)",
        &|m| {
            Ok(match spent(m).call {
                (_, 0.0) => "-".to_owned(),
                call => per_create(call),
            })
        },
    )?;
    row("of the call, our server's handling of the review", &|m| {
        Ok(match (m, spent(m).server) {
            (Answered::Ours, server) => per_create(server),
            _ => "-".to_owned(),
        })
    })?;
    Ok(())
}

fn print_controller(ctl: &ControllerFigures) -> anyhow::Result<()> {
    println!(
        "\nThe controller (issues 11.4, 22.5): {} StatefulSets of {} pods (Parallel, each with its PersistentPodState), created at once, all Ready in {:.1} s\n",
        ctl.sets,
        ctl.pods / ctl.sets.max(1),
        ctl.rollout_seconds
    );
    println!("| figure | value | target |");
    println!("|---|---|---|");
    anyhow::ensure!(ctl.lags_ms.len() == ctl.pods, "a lag per pod");
    println!(
        "| lag Ready -> recorded, p50 (ms) | {:.0} | |",
        figure(quantile(&ctl.lags_ms, 0.5))?
    );
    println!(
        "| lag Ready -> recorded, p99 (ms) | {:.0} | <= 1000 |",
        figure(quantile(&ctl.lags_ms, 0.99))?
    );
    println!(
        "| lag Ready -> recorded, max (ms) | {:.0} | |",
        figure(quantile(&ctl.lags_ms, 1.0))?
    );
    println!(
        "| status writes during the rollout | {} | <= {} (pods / 5) |",
        figure(ctl.rollout_writes)?,
        ctl.pods / 5
    );
    println!(
        "| status writes at rest, {} s | {} | 0 |",
        ctl.steady_seconds,
        figure(ctl.steady_status_writes)?
    );
    println!(
        "| generator writes at rest, {} s | {} | 0 |",
        ctl.steady_seconds,
        figure(ctl.steady_generator_writes)?
    );
    println!(
        "| leader RSS after (MB) | {:.1} | |",
        figure(ctl.leader_rss_mb)?
    );
    Ok(())
}

fn print_memory(mem: &MemoryFigures) -> anyhow::Result<()> {
    println!(
        "\nMemory (issues 11.5, 22.3): a fresh standby replica after its initial sync (pods: one whole list from the watch cache, read as it arrives; the other kinds: a streaming list from v1.34, else paginated 500 a page) of {} pods (StatefulSet-like, ~4 KB each), {} PPS x {} states, {} nodes; heap per object counted in process\n",
        mem.pods, mem.pps, mem.states, mem.nodes
    );
    println!("| figure | value | target |");
    println!("|---|---|---|");
    // The targets are those of the full size (issue 22.3).
    let at_scale = |target: &'static str| if mem.pods >= 100_000 { target } else { "" };
    let s = &mem.synced;
    println!(
        "| RSS after the sync (MB) | {:.1} | {} |",
        figure(s.rss_mb)?,
        at_scale("<= 160")
    );
    println!(
        "| peak RSS during the sync (MB) | {:.1} | {} |",
        figure(s.peak_mb)?,
        at_scale("<= 200")
    );
    println!(
        "| start to Ready, the control plane at rest (s) | {:.1} | {} |",
        figure(s.seconds)?,
        at_scale("<= 10")
    );
    println!(
        "| CPU until Ready: the replica, the API server (s) | {:.1}, {:.1} | |",
        figure(s.replica_cpu)?,
        figure(s.apiserver_cpu)?
    );
    println!(
        "| the replica's minor page faults until Ready (thousands): that start; the start right after the creation | {:.0}; {:.0} | |",
        figure(s.replica_faults / 1e3)?,
        figure(mem.busy.replica_faults / 1e3)?
    );
    for (when, start) in [
        ("that start", s),
        ("the start right after the creation", &mem.busy),
    ] {
        println!(
            "| the API server's garbage collector in {when}: collections completed until Ready; its heap in use as it began, and the heap its next collection was due at (GB) | {:.0}; {:.2}, {:.2} | |",
            figure(start.gc.collections)?,
            figure(start.gc.heap_gb)?,
            figure(start.gc.goal_gb)?
        );
        println!(
            "| what the API server allocated in {when}, until Ready (GB); its own cache consistency checks completed meanwhile | {:.2}; {:.0} | |",
            figure(start.gc.allocated_gb)?,
            figure(start.gc.consistency_checks)?
        );
    }
    let r = &mem.rest;
    println!(
        "| the control plane before that start: cores over {} s (the API server's), waited (s) | {:.2} ({:.2}), {:.0}{} | at rest: < {REST_CORES} |",
        REST_WINDOW.as_secs(),
        figure(r.cores)?,
        figure(r.apiserver_cores)?,
        figure(r.waited)?,
        if r.settled {
            ""
        } else {
            " (**not at rest**: the deadline passed)"
        }
    );
    println!(
        "| the registered replica meanwhile (the leader; the nodes lost one by one): cores in that window, over the whole wait | {:.2}, {:.2} | |",
        figure(r.leader_cores)?,
        figure(r.leader_mean_cores)?
    );
    let b = &mem.busy;
    println!(
        "| started right after the last pod's creation instead (as before the tenth session): start to Ready (s); CPU until Ready, the replica, the API server (s); RSS after the sync, peak (MB) | {:.1}; {:.1}, {:.1}; {:.1}, {:.1} | |",
        figure(b.seconds)?,
        figure(b.replica_cpu)?,
        figure(b.apiserver_cpu)?,
        figure(b.rss_mb)?,
        figure(b.peak_mb)?
    );
    println!(
        "| heap per cached pod (bytes) | {:.0} | <= 1024 |",
        figure(mem.heap.per_pod)?
    );
    println!(
        "| heap per cached pod carrying Istio's and a scraper's 8 annotations (bytes): every annotation kept, only those read | {:.0}, {:.0} | |",
        figure(mem.heap.per_mesh_pod[0])?,
        figure(mem.heap.per_mesh_pod[1])?
    );
    println!(
        "| heap per recorded state, PPS included (bytes) | {:.0} | |",
        figure(mem.heap.per_state)?
    );
    println!(
        "| heap per cached node (bytes) | {:.0} | |",
        figure(mem.heap.per_node)?
    );
    println!(
        "| PersistentPodStates created, status written (per second; {} per namespace at the end) | {:.0} | |",
        mem.pps / synthetic::NAMESPACES,
        figure(mem.pps as f64 / mem.pps_seconds)?
    );
    if mem.pods < 100_000 {
        println!(
            "| projected RSS at 100,000 pods (MB) | {:.0} | |",
            figure(s.rss_mb + (100_000 - mem.pods) as f64 * mem.heap.per_pod / 1024.0 / 1024.0)?
        );
    }
    print_restarts(&mem.restarts)
}

/// The starts after the judged one, each, and the medians of each build.
fn print_restarts(restarts: &[Restart]) -> anyhow::Result<()> {
    if restarts.is_empty() {
        return Ok(());
    }
    println!(
        "\nRestarts (BENCH_RESTARTS), each once the control plane was at rest again; build A is the one measured above, B is BENCH_RESTART_OTHER_BIN\n"
    );
    println!(
        "| start | build | start to Ready (s) | CPU until Ready: the replica, the API server (s) | the replica's minor faults (thousands) | RSS after the sync, peak (MB) | the API server's collections; allocated (GB) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let build = |other: bool| if other { "B" } else { "A" };
    for (i, r) in restarts.iter().enumerate() {
        let s = &r.start;
        println!(
            "| {}{} | {} | {:.1} | {:.2}, {:.1} | {:.0} | {:.1}, {:.1} | {:.0}; {:.2} |",
            i + 1,
            if r.settled { "" } else { " (not at rest)" },
            build(r.other),
            figure(s.seconds)?,
            figure(s.replica_cpu)?,
            figure(s.apiserver_cpu)?,
            figure(s.replica_faults / 1e3)?,
            figure(s.rss_mb)?,
            figure(s.peak_mb)?,
            figure(s.gc.collections)?,
            figure(s.gc.allocated_gb)?
        );
    }
    for other in [false, true] {
        let of: Vec<&Synced> = restarts
            .iter()
            .filter(|r| r.other == other)
            .map(|r| &r.start)
            .collect();
        if of.is_empty() {
            continue;
        }
        let med = |f: fn(&Synced) -> f64| median(&of.iter().map(|s| f(s)).collect::<Vec<_>>());
        println!(
            "| median of {} | {} | {:.1} | {:.2}, {:.1} | {:.0} | {:.1}, {:.1} | {:.0}; {:.2} |",
            of.len(),
            build(other),
            figure(med(|s| s.seconds))?,
            figure(med(|s| s.replica_cpu))?,
            figure(med(|s| s.apiserver_cpu))?,
            figure(med(|s| s.replica_faults / 1e3))?,
            figure(med(|s| s.rss_mb))?,
            figure(med(|s| s.peak_mb))?,
            figure(med(|s| s.gc.collections))?,
            figure(med(|s| s.gc.allocated_gb))?
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_is_summed_over_its_series_and_only_its_own() {
        let exposition = "\
# HELP apiserver_storage_consistency_checks_total Counter for status of consistency checks
# TYPE apiserver_storage_consistency_checks_total counter
apiserver_storage_consistency_checks_total{resource=\"pods\",status=\"success\"} 3
apiserver_storage_consistency_checks_total{resource=\"nodes\",status=\"success\"} 2
apiserver_storage_consistency_checks_total_other{resource=\"pods\"} 100
apiserver_storage_consistency_checks 7
";
        assert_eq!(
            summed(exposition, "apiserver_storage_consistency_checks_total"),
            5.0
        );
        assert_eq!(summed(exposition, "go_gc_duration_seconds_count"), 0.0);
        assert_eq!(summed("plain 4\n", "plain"), 4.0);
    }
}
