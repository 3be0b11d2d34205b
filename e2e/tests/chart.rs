//! The Helm chart (issue 21) on the control plane: what it renders (a read-only, non-root image
//! without capabilities; alerts and a dashboard that name only metrics the binary exposes and
//! link runbooks that exist), and its life cycle: taking over from the kustomize installation,
//! install, the seeds' story, an upgrade while pods are created, and an uninstall whose hook
//! removes the webhook registrations first. Self-signed certificates: a CA made at install and
//! kept, a serving certificate issued anew on upgrade.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use promql_parser::parser::{self, Expr};
use serde_json::{Value, json};

use crate::support::*;

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/persistent-pod-state")
}

/// `helm template` of the chart with `values` (a file of ci/) and `set` flags, as objects.
async fn template(env: &Env, values: &str, set: &[&str]) -> Vec<Value> {
    let chart = chart();
    let file = chart.join("ci").join(values);
    let mut args = vec![
        "template",
        "t",
        chart.to_str().expect("path"),
        "-n",
        "ops",
        "--kube-version",
        "1.37.0",
        "-f",
        file.to_str().expect("path"),
    ];
    for s in set {
        args.extend(["--set", s]);
    }
    let (ok, out) = helm(env, &args).await;
    assert!(ok, "helm template {values}: {out}");
    yaml_documents(&out)
}

/// Issue 21.7: every container the chart runs (the server's and the uninstall hook's), with
/// every example values file, runs read-only, as non-root, without privilege escalation, with
/// every capability dropped and the runtime's default seccomp profile.
#[tokio::test]
async fn the_rendered_chart_runs_read_only_non_root_without_capabilities() {
    let env = env().await;
    let mut checked = 0;
    for entry in std::fs::read_dir(chart().join("ci")).expect("ci/") {
        let name = entry.expect("entry").file_name();
        let name = name.to_str().expect("name");
        for object in template(&env, name, &[]).await {
            let pod = match object["kind"].as_str() {
                Some("Deployment" | "Job") => &object["spec"]["template"]["spec"],
                _ => continue,
            };
            let what = format!("{name}: {} {}", object["kind"], object["metadata"]["name"]);
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{what}");
            assert_eq!(
                pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
                "{what}"
            );
            assert_ne!(pod["securityContext"]["runAsUser"], 0, "{what}");
            for c in pod["containers"].as_array().expect("containers") {
                let sc = &c["securityContext"];
                assert_eq!(sc["readOnlyRootFilesystem"], true, "{what}");
                assert_eq!(sc["runAsNonRoot"], true, "{what}");
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{what}");
                assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{what}");
                assert!(sc["capabilities"]["add"].is_null(), "{what}");
                assert!(sc["privileged"].is_null(), "{what}");
                checked += 1;
            }
        }
    }
    // Every values file has the server; the hook too except where it is off.
    assert!(checked >= 10, "{checked} containers checked");
}

/// The metric names an expression selects.
fn selected(expr: &Expr, out: &mut BTreeSet<String>) {
    match expr {
        Expr::Aggregate(a) => {
            selected(&a.expr, out);
            if let Some(p) = &a.param {
                selected(p, out);
            }
        }
        Expr::Unary(u) => selected(&u.expr, out),
        Expr::Binary(b) => {
            selected(&b.lhs, out);
            selected(&b.rhs, out);
        }
        Expr::Paren(p) => selected(&p.expr, out),
        Expr::Subquery(s) => selected(&s.expr, out),
        Expr::VectorSelector(v) => out.extend(v.name.clone()),
        Expr::MatrixSelector(m) => out.extend(m.vs.name.clone()),
        Expr::Call(c) => c.args.args.iter().for_each(|a| selected(a, out)),
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

/// GitHub's anchor of a Markdown heading.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The metric names the API server exposes once it has counted the series the alert on its
/// failed calls reads (a counter family shows only once counted), each with the labels the
/// alert selects: a call to this service's validating webhook (a PersistentPodState it denies,
/// in a dry run), and calls to throwaway webhooks that no server answers, one failing open
/// (failurePolicy Ignore), one refusing (Fail), on the ConfigMaps of the test's namespace.
async fn apiserver_metric_names(env: &Env) -> BTreeSet<String> {
    let c = &env.client;
    let ns = namespace(c, "e2e-apiserver-metrics").await;
    let pps = |name: &str| -> persistent_pod_state::api::v1alpha1::PersistentPodState {
        serde_json::from_value(json!({
            "apiVersion": "apps.kruise.io/v1alpha1", "kind": "PersistentPodState",
            "metadata": {"name": name},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                     "requiredPersistentTopology": {"nodeTopologyKeys": [HOST]}}
        }))
        .expect("pps")
    };
    let api = pps_api(c, &ns);
    api.create(&PostParams::default(), &pps("first"))
        .await
        .expect("first PersistentPodState");
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let denied = api.create(&dry_run, &pps("second")).await;
    assert!(
        denied.is_err(),
        "a second PersistentPodState for web denied"
    );

    // Two throwaway webhooks no server answers, on the ConfigMaps of this namespace: one that
    // fails open (Ignore) on creates, one that refuses (Fail) updates.
    let hooks: Api<ValidatingWebhookConfiguration> = Api::all(c.clone());
    let name = format!("{ns}-unanswered");
    hooks.delete(&name, &Default::default()).await.ok();
    let hook = |policy: &str, operation: &str| {
        json!({"name": format!("fail-{}.e2e.example.com", policy.to_lowercase()),
            "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": policy,
            "timeoutSeconds": 1, "clientConfig": {"url": "https://127.0.0.1:1/never"},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": [operation],
                       "resources": ["configmaps"]}]})
    };
    let configuration = serde_json::from_value(json!({
        "metadata": {"name": name},
        "webhooks": [hook("Ignore", "CREATE"), hook("Fail", "UPDATE")]
    }))
    .expect("webhook configuration");
    hooks
        .create(&PostParams::default(), &configuration)
        .await
        .expect("throwaway webhooks");
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(c.clone(), &ns);
    let scrape = || async {
        let request = http::Request::get("/metrics")
            .body(Vec::new())
            .expect("request");
        c.request_text(request)
            .await
            .expect("the API server's metrics")
    };
    // A series of `metric` carrying every label of `labels`.
    let has = |text: &str, metric: &str, labels: &[&str]| {
        text.lines().any(|l| {
            l.strip_prefix(metric).is_some_and(|rest| {
                rest.starts_with('{') && labels.iter().all(|x| rest.contains(x))
            })
        })
    };
    let mut made = 0;
    let text = wait_for(
        "the API server to count the webhooks' failed calls",
        TIMEOUT,
        || {
            made += 1;
            let map: k8s_openapi::api::core::v1::ConfigMap =
                serde_json::from_value(json!({"metadata": {"name": format!("m-{made}")}}))
                    .expect("config map");
            let maps = maps.clone();
            async move {
                // Created: the first hook failed open; updated: refused by the second one.
                let created = maps.create(&PostParams::default(), &map).await.ok()?;
                maps.replace(&created.name_any(), &PostParams::default(), &created)
                    .await
                    .ok();
                let text = scrape().await;
                let ours =
                    ["name=\"validate-persistentpodstate.persistent-pod-state.apps.kruise.io\""];
                (has(
                    &text,
                    "apiserver_admission_webhook_fail_open_count",
                    &["name=\"fail-ignore.e2e.example.com\""],
                ) && has(
                    &text,
                    "apiserver_admission_webhook_rejection_count",
                    &[
                        "name=\"fail-fail.e2e.example.com\"",
                        "error_type=\"calling_webhook_error\"",
                    ],
                ) && has(
                    &text,
                    "apiserver_admission_webhook_admission_duration_seconds_count",
                    &ours,
                ))
                .then_some(text)
            }
        },
    )
    .await;
    hooks
        .delete(&name, &Default::default())
        .await
        .expect("throwaway webhooks deleted");
    delete_namespace(c, &ns).await;
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next().map(str::to_owned))
        .collect()
}

/// Issue 21.4: every alert of the PrometheusRule and every panel of the Grafana dashboard is a
/// valid PromQL expression selecting only metrics a running replica exposes (scraped here), and
/// every alert links a section of docs/troubleshooting.md that exists.
#[tokio::test]
async fn alerts_and_dashboard_name_only_exposed_metrics_and_link_existing_runbooks() {
    let env = env().await;
    let objects = template(&env, "full-values.yaml", &[]).await;
    // What a replica really exposes: every sample's metric name.
    let scraped = http_get(&format!("{}/metrics", env.replicas[0].probe_url())).await;
    assert_eq!(scraped.0, 200);
    let exposed: BTreeSet<String> = scraped
        .1
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next().map(str::to_owned))
        .collect();
    assert!(exposed.contains("pps_leader"), "{exposed:?}");
    let docs = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/troubleshooting.md"),
    )
    .expect("docs/troubleshooting.md");
    let anchors: BTreeSet<String> = docs
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect();

    let apiserver = apiserver_metric_names(&env).await;
    let check = |what: &str, expr: &str| {
        let parsed = parser::parse(expr).unwrap_or_else(|e| panic!("{what}: {expr}: {e}"));
        let mut names = BTreeSet::new();
        selected(&parsed, &mut names);
        assert!(!names.is_empty(), "{what} selects no metric");
        for name in names {
            // The API server's own series (its calls to the webhooks) are the API server's.
            let source = if name.starts_with("apiserver_") {
                &apiserver
            } else {
                &exposed
            };
            assert!(source.contains(&name), "{what}: {name} is not exposed");
        }
    };
    let rule = objects
        .iter()
        .find(|o| o["kind"] == "PrometheusRule")
        .expect("PrometheusRule rendered");
    let mut alerts = BTreeSet::new();
    for group in rule["spec"]["groups"].as_array().expect("groups") {
        for r in group["rules"].as_array().expect("rules") {
            let alert = r["alert"].as_str().expect("alert name");
            check(alert, r["expr"].as_str().expect("expr"));
            let url = r["annotations"]["runbook_url"].as_str().expect("runbook");
            let (page, section) = url.split_once('#').expect("a section");
            assert!(page.ends_with("docs/troubleshooting.md"), "{alert}: {url}");
            assert!(anchors.contains(section), "{alert}: no section #{section}");
            alerts.insert(alert.to_owned());
        }
    }
    // The list: errors, latency, caches, leader, unplaceable, released, IPs, certificate.
    for a in [
        "PersistentPodStateWebhookErrors",
        "PersistentPodStateWebhookSlow",
        "PersistentPodStateCachesNotSynced",
        "PersistentPodStateNoLeader",
        "PersistentPodStateUnplaceable",
        "PersistentPodStatePodsReleased",
        "PersistentPodStateIPRequestsSkipped",
        "PersistentPodStateCertificateExpiresSoon",
        "PersistentPodStateWebhookUnreachable",
    ] {
        assert!(alerts.contains(a), "{a} missing from {alerts:?}");
    }

    let dashboard = objects
        .iter()
        .find(|o| {
            o["kind"] == "ConfigMap" && o["metadata"]["name"] == "t-persistent-pod-state-dashboard"
        })
        .expect("dashboard ConfigMap rendered");
    let json: Value = serde_json::from_str(
        dashboard["data"]["persistent-pod-state.json"]
            .as_str()
            .expect("dashboard JSON"),
    )
    .expect("dashboard is JSON");
    let mut targets = 0;
    for panel in json["panels"].as_array().expect("panels") {
        for t in panel["targets"].as_array().expect("targets") {
            // Grafana's variables, as Grafana substitutes them.
            let expr = t["expr"]
                .as_str()
                .expect("expr")
                .replace("$__rate_interval", "5m")
                .replace("$job", ".+");
            check(panel["title"].as_str().unwrap_or("panel"), &expr);
            targets += 1;
        }
    }
    assert!(targets >= 10, "{targets} dashboard queries");
}

/// Each create's phase and result.
type Results = Arc<Mutex<Vec<(&'static str, Result<(), String>)>>>;

/// Pod creates that go through the webhooks (server-side dry runs of a StatefulSet's pod), made
/// continuously in the background, each failure noted with the phase it happened in.
struct Creator {
    stop: Arc<AtomicBool>,
    phase: Arc<Mutex<&'static str>>,
    results: Results,
    task: tokio::task::JoinHandle<()>,
}

impl Creator {
    fn start(env: &Env, ns: &str, sts_uid: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let phase = Arc::new(Mutex::new("before"));
        let results: Results = Arc::default();
        let pods: Api<Pod> = Api::namespaced(env.client.clone(), ns);
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"generateName": "web-probe-", "ownerReferences": [{"apiVersion": "apps/v1",
                "kind": "StatefulSet", "name": "web", "uid": sts_uid, "controller": true}]},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        }))
        .expect("pod");
        let task = tokio::spawn({
            let (stop, phase, results) = (stop.clone(), phase.clone(), results.clone());
            async move {
                let dry = PostParams {
                    dry_run: true,
                    ..PostParams::default()
                };
                while !stop.load(Ordering::Relaxed) {
                    let result = pods
                        .create(&dry, &pod)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string());
                    let now = *phase.lock().expect("phase");
                    results.lock().expect("results").push((now, result));
                    // The pace of the creates (not a synchronisation).
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        Self {
            stop,
            phase,
            results,
            task,
        }
    }

    fn phase(&self, phase: &'static str) {
        *self.phase.lock().expect("phase") = phase;
    }

    /// Stops; per phase: creates answered, and the failures.
    async fn finish(self) -> Vec<(&'static str, usize, Vec<String>)> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("creator");
        let results = self.results.lock().expect("results");
        let mut phases: Vec<(&'static str, usize, Vec<String>)> = Vec::new();
        for (phase, result) in results.iter() {
            if phases.last().is_none_or(|p| p.0 != *phase) {
                phases.push((phase, 0, Vec::new()));
            }
            if let Some(last) = phases.last_mut() {
                last.1 += 1;
                if let Err(e) = result {
                    last.2.push(e.clone());
                }
            }
        }
        phases
    }
}

/// Helm's ownership marks, which let a release take over an object applied before (the
/// documented move from the kustomize manifests).
async fn adopt<K>(api: &Api<K>, name: &str, release: &str, ns: &str)
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
    K::DynamicType: Default,
{
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
            "annotations": {"meta.helm.sh/release-name": release, "meta.helm.sh/release-namespace": ns},
        }})),
    )
    .await
    .expect("adopt");
}

/// The suite's own registration (e2e/lib.sh register_webhook), restored.
async fn register_suite_webhooks() {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/lib.sh");
    let status = tokio::process::Command::new("bash")
        .args([
            "-c",
            &format!("source '{}' && register_webhook", lib.display()),
        ])
        .env("E2E_CUSTOM_KIND", "1")
        .status()
        .await
        .expect("bash");
    assert!(status.success(), "register_webhook");
}

/// Issue 21.3: the chart takes over from the kustomize installation (the stored
/// PersistentPodStates stay readable in both versions), `helm install` registers the webhooks
/// and the seeds' story works through them, `helm upgrade` with changed values while pods are
/// created fails no admission, and `helm uninstall` runs the hook that removes the webhook
/// registrations (pods still create, untouched), keeping the CRD and the PersistentPodStates.
#[tokio::test]
async fn helm_install_upgrade_uninstall_never_fails_an_admission() {
    let env = env().await;
    let c = &env.client;
    let release = "chart-e2e";
    let release_ns = namespace(c, "chart-e2e").await;
    let ns = namespace(c, "e2e-chart").await;
    let name = format!("{release}-persistent-pod-state");
    // The seeds' StatefulSet, recorded under the kustomize installation.
    let sts = pinned_statefulset("web", 2);
    let (before, _) = start_recorded(c, &ns, &sts).await;
    let sts_uid = Api::<k8s_openapi::api::apps::v1::StatefulSet>::namespaced(c.clone(), &ns)
        .get("web")
        .await
        .expect("sts")
        .uid()
        .expect("uid");
    let creator = Creator::start(&env, &ns, &sts_uid);

    // The move: the CRD (holding the stored objects) is adopted; the kustomize registrations are
    // replaced by the chart's.
    let crds: Api<CustomResourceDefinition> = Api::all(c.clone());
    adopt(
        &crds,
        "persistentpodstates.apps.kruise.io",
        release,
        &release_ns,
    )
    .await;
    creator.phase("moving");
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(c.clone());
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(c.clone());
    let ca = base64::engine::general_purpose::STANDARD.encode(
        std::fs::read(env.cluster_dir.join("webhook-certs/ca.crt")).expect("the suite's CA"),
    );
    let url = format!("webhook.url={}", env.webhook_url);
    let ca_set = format!("certificates.external.caBundle={ca}");
    let common = [
        url.as_str(),
        "certificates.mode=external",
        ca_set.as_str(),
        "nodeLostAfter=45s",
        "customWorkloads[0].group=example.com",
        "customWorkloads[0].kind=Ring",
        "customWorkloads[0].resource=rings",
    ];
    let chart = chart();
    let chart = chart.to_str().expect("path");
    // `helm VERB` of the release (the chart after the verb but for uninstall), waiting for its
    // objects.
    let verb = |verb| {
        let mut args = vec![
            verb,
            release,
            chart,
            "-n",
            &release_ns,
            "--wait",
            "--timeout",
            "120s",
        ];
        if verb == "uninstall" {
            args.remove(2);
        }
        args
    };
    let mut install = verb("install");
    for s in &common {
        install.extend(["--set", s]);
    }
    let suite_mutating = mutating.get("persistent-pod-state").await.expect("suite's");
    let (ok, out) = helm(&env, &install).await;
    assert!(ok, "helm install: {out}");
    // Both registrations now send to the same servers; the suite's goes.
    let _ = mutating
        .delete("persistent-pod-state", &Default::default())
        .await;
    let _ = validating
        .delete("persistent-pod-state", &Default::default())
        .await;
    creator.phase("installed");
    let hook = mutating.get(&name).await.expect("the chart's registration");
    let webhook = &hook.webhooks.as_ref().expect("webhooks")[0];
    assert_eq!(
        webhook.client_config.url.as_deref(),
        Some(format!("{}/mutate-pod", env.webhook_url).as_str())
    );
    // The custom kind is in the CEL of the chart's matchConditions, as in the suite's.
    let expression = &webhook.match_conditions.as_ref().expect("matchConditions")[0].expression;
    assert!(
        expression.contains("['example.com', 'Ring']"),
        "{expression}"
    );
    assert_eq!(
        suite_mutating.webhooks.as_ref().map(|w| w.len()),
        Some(1),
        "the suite registered one pod webhook"
    );
    let crd = crds
        .get("persistentpodstates.apps.kruise.io")
        .await
        .expect("crd");
    assert_eq!(
        crd.annotations()
            .get("meta.helm.sh/release-name")
            .map(String::as_str),
        Some(release),
        "the CRD is the release's"
    );

    // The seeds' story through the chart's registration: a re-created pod is steered back.
    let reviews = pod_reviews(&env).await;
    let pod = recreate_pod(c, &ns, "web-1").await;
    assert_steered_back(&pod, "web", &before["web-1"]);
    assert!(pod_reviews(&env).await > reviews, "reviewed by the webhook");
    // Stored objects stay readable in both versions (the conversion webhook, the release's now).
    for version in ["v1alpha1", "v1beta1"] {
        let (ok, out) = kubectl(
            &env,
            &[
                "get",
                &format!("persistentpodstates.{version}.apps.kruise.io"),
                "web",
                "-n",
                &ns,
                "-o",
                "jsonpath={.status.podStates}",
            ],
            None,
        )
        .await;
        assert!(ok && out.contains("web-0"), "{version}: {out}");
    }

    // An upgrade with changed values while pods are created.
    creator.phase("upgrading");
    // `helm upgrade` of the release with `values` set, and the first four common ones.
    let upgrade_setting = |values: &[&'static str]| {
        let mut args = verb("upgrade");
        for s in values.iter().chain(&common[..4]) {
            args.extend(["--set", s]);
        }
        args
    };
    let upgrade = upgrade_setting(&[
        "webhook.timeoutSeconds=7",
        "replicaCount=3",
        "nodeLostAfter=60s",
    ]);
    let (ok, out) = helm(&env, &upgrade).await;
    assert!(ok, "helm upgrade: {out}");
    creator.phase("upgraded");
    let hook = mutating.get(&name).await.expect("the chart's registration");
    assert_eq!(
        hook.webhooks.as_ref().expect("webhooks")[0].timeout_seconds,
        Some(7)
    );
    let reviews = pod_reviews(&env).await;
    wait_for("a pod review after the upgrade", TIMEOUT, || async {
        (pod_reviews(&env).await > reviews).then_some(())
    })
    .await;
    // Down to one replica without leader election: the Deployment goes over to Recreate (two
    // replicas would run the controllers at once in a rolling update), its defaulted
    // rollingUpdate dropped by the upgrade's patch (the API server refuses both together).
    let single = upgrade_setting(&["replicaCount=1", "leaderElection.enabled=false"]);
    let (ok, out) = helm(&env, &single).await;
    assert!(
        ok,
        "helm upgrade to one replica without leader election: {out}"
    );
    let strategy =
        Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(c.clone(), &release_ns)
            .get(&name)
            .await
            .expect("the Deployment")
            .spec
            .and_then(|s| s.strategy);
    assert_eq!(
        strategy.as_ref().and_then(|s| s.type_.as_deref()),
        Some("Recreate"),
        "{strategy:?}"
    );

    // Uninstall: the hook (a Job of the project's image, run by the fake kubelet as its
    // ServiceAccount) removes the registrations first.
    creator.phase("uninstalling");
    let (ok, out) = helm(&env, &verb("uninstall")).await;
    assert!(ok, "helm uninstall: {out}");
    creator.phase("uninstalled");
    assert!(mutating.get_opt(&name).await.expect("get").is_none());
    assert!(validating.get_opt(&name).await.expect("get").is_none());
    // The Job controller's Event: the hook's Job completed (its pod succeeded).
    let job = format!("{name}-unregister");
    let completed = Api::<k8s_openapi::api::core::v1::Event>::namespaced(c.clone(), &release_ns)
        .list(&Default::default())
        .await
        .expect("events")
        .items
        .iter()
        .any(|e| {
            e.involved_object.name.as_deref() == Some(job.as_str())
                && e.reason.as_deref() == Some("Completed")
        });
    assert!(completed, "the uninstall hook's Job completed");
    // Kept: the CRD and the PersistentPodStates (helm.sh/resource-policy: keep).
    assert!(
        crds.get_opt("persistentpodstates.apps.kruise.io")
            .await
            .expect("get")
            .is_some()
    );
    let kept = pps_api(c, &ns).get("web").await.expect("kept");
    assert!(
        kept.status
            .is_some_and(|s| s.pod_states.contains_key("web-0"))
    );
    // Pods still create, untouched: no webhook is registered.
    let reviews = pod_reviews(&env).await;
    let pod = recreate_pod(c, &ns, "web-0").await;
    assert!(
        pod.annotations()
            .get(persistent_pod_state::api::INJECTED_ANNOTATION)
            .is_none(),
        "no webhook left to inject"
    );
    assert_eq!(
        pod_reviews(&env).await,
        reviews,
        "no review after uninstall"
    );

    let phases = creator.finish().await;
    println!("pod creates per phase (answered, failed): {phases:?}");
    for (phase, answered, failed) in &phases {
        assert!(*answered > 0, "{phase}: no create made");
        assert!(failed.is_empty(), "{phase}: failed admissions {failed:?}");
    }
    register_suite_webhooks().await;
    delete_namespace(c, &ns).await;
    delete_namespace(c, &release_ns).await;
}

/// Issue 21.1, self-signed certificates: a CA made at install and read back on upgrade (the CA
/// bundles do not change, so replicas still serving the previous certificate stay trusted), a
/// serving certificate issued anew on every upgrade under it, for both Services' names.
#[tokio::test]
async fn self_signed_certificates_keep_their_ca_and_rotate_on_upgrade() {
    let env = env().await;
    let c = &env.client;
    let release = "chart-certs";
    let ns = namespace(c, "chart-certs").await;
    let chart = chart();
    // Registered but sent nothing: no namespace has the label (the CRD is the other release's).
    let args = |verb: &'static str| {
        vec![
            verb.to_owned(),
            release.to_owned(),
            chart.to_str().expect("path").to_owned(),
            "-n".into(),
            ns.clone(),
            "--set".into(),
            "crd.install=false".into(),
            "--set".into(),
            "crd.conversionService=true".into(),
            "--set".into(),
            "webhook.namespaceSelector[0].key=e2e-never".into(),
            "--set".into(),
            "webhook.namespaceSelector[0].operator=Exists".into(),
        ]
    };
    let secrets: Api<Secret> = Api::namespaced(c.clone(), &ns);
    let read = |name: &'static str, key: &'static str| {
        let secrets = secrets.clone();
        async move {
            let s = secrets
                .get(&format!("{release}-persistent-pod-state-{name}"))
                .await
                .expect("secret");
            s.data.expect("data")[key].0.clone()
        }
    };
    let env = &env;
    let run = |a: Vec<String>| async move {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let (ok, out) = helm(env, &a).await;
        assert!(ok, "helm {a:?}: {out}");
    };
    run(args("install")).await;
    let (ca, ca_key, crt) = (
        read("ca", "ca.crt").await,
        read("ca", "ca.key").await,
        read("tls", "tls.crt").await,
    );
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(c.clone());
    let bundle = |hook: MutatingWebhookConfiguration| {
        hook.webhooks.expect("webhooks")[0]
            .client_config
            .ca_bundle
            .clone()
            .expect("caBundle")
            .0
    };
    let registration = format!("{release}-persistent-pod-state");
    assert_eq!(bundle(mutating.get(&registration).await.expect("hook")), ca);
    run(args("upgrade")).await;
    assert_eq!(read("ca", "ca.crt").await, ca, "the CA is kept");
    assert_eq!(read("ca", "ca.key").await, ca_key, "and its key");
    let renewed = read("tls", "tls.crt").await;
    assert_ne!(renewed, crt, "a new serving certificate");
    assert_eq!(bundle(mutating.get(&registration).await.expect("hook")), ca);
    // Issued by that CA, for the Service.
    let pem = |der: &[u8]| String::from_utf8(der.to_vec()).expect("PEM");
    let (_, ca_der) = x509_parser::pem::parse_x509_pem(pem(&ca).as_bytes()).expect("CA PEM");
    let (_, crt_der) =
        x509_parser::pem::parse_x509_pem(pem(&renewed).as_bytes()).expect("cert PEM");
    let ca_cert = ca_der.parse_x509().expect("CA");
    let cert = crt_der.parse_x509().expect("cert");
    assert_eq!(cert.issuer(), ca_cert.subject());
    let sans = names_of(&cert);
    // Both Services: the webhooks' and the conversion webhook's.
    for host in [
        format!("{release}-persistent-pod-state.{ns}.svc"),
        format!("{release}-persistent-pod-state-conversion.{ns}.svc"),
    ] {
        assert!(sans.iter().any(|n| n.contains(&host)), "{host}: {sans:?}");
    }
    run(vec![
        "uninstall".into(),
        release.into(),
        "-n".into(),
        ns.clone(),
        "--wait".into(),
    ])
    .await;
    assert!(
        mutating
            .get_opt(&registration)
            .await
            .expect("get")
            .is_none()
    );
    delete_namespace(c, &ns).await;
}

/// The names a certificate is for (its subject alternative names).
fn names_of(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
    cert.subject_alternative_name()
        .expect("SAN")
        .expect("SAN present")
        .value
        .general_names
        .iter()
        .map(|n| n.to_string())
        .collect()
}

/// Puts the CRD's `status.storedVersions` back, also when the test fails half-way.
struct StoredVersionsBack(Value);

impl StoredVersionsBack {
    async fn set(client: &kube::Client, versions: &Value) {
        Api::<CustomResourceDefinition>::all(client.clone())
            .patch_status(
                "persistentpodstates.apps.kruise.io",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"storedVersions": versions}})),
            )
            .await
            .expect("storedVersions");
    }
}

impl Drop for StoredVersionsBack {
    fn drop(&mut self) {
        let versions = self.0.clone();
        put_back(move |client| async move { StoredVersionsBack::set(&client, &versions).await });
    }
}

/// The CRD's conversion webhook goes to a Service of its own that publishes replicas not ready
/// yet (`api::a_replica_becomes_ready_only_where_conversion_reaches_unready_replicas` shows
/// why), named by the serving certificate where the chart makes or requests it, whether on or
/// not (an upgrade turning it on needs no new certificate). It is on by default while the
/// cluster's CRD says objects may be stored as v1alpha1 (read with `lookup`: `helm template`
/// reads nothing), or when asked; with an external certificate (which would have to name it)
/// only when asked, and never with `webhook.url`.
#[tokio::test]
async fn conversion_reaches_replicas_not_ready_yet_through_a_service_the_certificate_names() {
    let env = env().await;
    let find = |objects: &[Value], kind: &str, name: &str| {
        objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .cloned()
    };
    let own = "t-persistent-pod-state-conversion";
    let sans = |objects: &[Value]| -> Vec<String> {
        if let Some(certificate) = find(objects, "Certificate", "t-persistent-pod-state") {
            return serde_json::from_value(certificate["spec"]["dnsNames"].clone()).expect("names");
        }
        let secret = find(objects, "Secret", "t-persistent-pod-state-tls").expect("the Secret");
        let pem = base64::engine::general_purpose::STANDARD
            .decode(secret["data"]["tls.crt"].as_str().expect("tls.crt"))
            .expect("base64");
        let (_, der) = x509_parser::pem::parse_x509_pem(&pem).expect("PEM");
        names_of(&der.parse_x509().expect("certificate"))
    };
    // Whether `objects` send conversion to the Service of its own, else to the replicas'
    // Service; either way (unless `external`) the certificate names it, so that turning it on
    // later needs no new certificate.
    let check = |objects: &[Value], on: bool, external: bool, what: &str| {
        if !external {
            let names = sans(objects);
            assert!(
                names
                    .iter()
                    .any(|n| n.contains("t-persistent-pod-state-conversion.ops.svc")),
                "{what}: {names:?}"
            );
        }
        let service = find(objects, "Service", own);
        let client = find(
            objects,
            "CustomResourceDefinition",
            "persistentpodstates.apps.kruise.io",
        )
        .expect("the CRD")["spec"]["conversion"]["webhook"]["clientConfig"]
            .clone();
        if !on {
            assert!(service.is_none(), "{what}");
            assert_eq!(
                client["service"]["name"], "t-persistent-pod-state",
                "{what}"
            );
            return;
        }
        let service = service.unwrap_or_else(|| panic!("{what}: the conversion Service"));
        assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
        assert_eq!(
            service["spec"]["selector"],
            find(objects, "Deployment", "t-persistent-pod-state").expect("the Deployment")["spec"]
                ["selector"]["matchLabels"],
            "it selects the replicas"
        );
        assert_eq!(service["spec"]["ports"][0]["targetPort"], "webhook");
        assert_eq!(client["service"]["name"], own, "{what}");
    };
    let ca = "certificates.external.caBundle=eA==";
    let on = "crd.conversionService=true";
    for (values, set, want) in [
        ("default-values.yaml", vec![], false),
        ("default-values.yaml", vec![on], true),
        ("cert-manager-values.yaml", vec![on], true),
        (
            "default-values.yaml",
            vec!["certificates.mode=external", ca],
            false,
        ),
        (
            "default-values.yaml",
            vec!["certificates.mode=external", ca, on],
            true,
        ),
        (
            "default-values.yaml",
            vec!["crd.conversionService=false"],
            false,
        ),
    ] {
        let objects = template(&env, values, &set).await;
        let external = set.contains(&"certificates.mode=external");
        check(&objects, want, external, &format!("{values} {set:?}"));
    }
    let objects = template(
        &env,
        "default-values.yaml",
        &["webhook.url=https://pps.example:8443", on],
    )
    .await;
    assert!(find(&objects, "Service", own).is_none());

    // auto, reading the cluster's CRD (`--dry-run=server`): on while it lists v1alpha1 as
    // stored, off once only v1beta1 is.
    let crds: Api<CustomResourceDefinition> = Api::all(env.client.clone());
    let stored = serde_json::to_value(
        crds.get("persistentpodstates.apps.kruise.io")
            .await
            .expect("the CRD")
            .status
            .expect("status")
            .stored_versions,
    )
    .expect("versions");
    let _back = StoredVersionsBack(stored);
    let chart = chart();
    for (versions, want) in [
        (json!(["v1beta1"]), false),
        (json!(["v1alpha1", "v1beta1"]), true),
    ] {
        StoredVersionsBack::set(&env.client, &versions).await;
        let (ok, out) = helm(
            &env,
            &[
                "template",
                "t",
                chart.to_str().expect("path"),
                "-n",
                "ops",
                "--dry-run=server",
            ],
        )
        .await;
        assert!(ok, "helm template --dry-run=server: {out}");
        check(
            &yaml_documents(&out),
            want,
            false,
            &format!("stored {versions}"),
        );
    }
}
