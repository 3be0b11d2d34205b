//! The kustomize installation: every overlay renders, carries what an operator expects, and is
//! accepted by the API server; the ServiceAccount's RBAC is enough to run the service.

use std::path::Path;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::support::*;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `kubectl kustomize DIR` as a list of objects.
async fn render(env: &Env, dir: &str) -> Vec<Value> {
    let (ok, yaml) = kubectl(env, &["kustomize", dir], None).await;
    assert!(ok, "kustomize {dir}: {yaml}");
    serde_yaml_ng::Deserializer::from_str(&yaml)
        .map(|doc| Value::deserialize(doc).expect("yaml document"))
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {name} rendered"))
}

/// Issue 4.1: base and every overlay render; the pre-1.28 overlays are accepted by this v1.20
/// API server (server-side dry run: applied for real, the webhook configurations would send
/// this cluster's pods to a Service with no backend here).
#[tokio::test]
async fn kustomize_overlays_render_and_are_accepted_by_the_api_server() {
    let env = env().await;
    let certs = repo().join("manifests/overlays/self-signed/certs");
    let status = std::process::Command::new(&env.pps_bin)
        .args([
            "certs",
            "--out-dir",
            certs.to_str().expect("path"),
            "--host",
            "persistent-pod-state.persistent-pod-state.svc",
            "--host",
            "persistent-pod-state-conversion.persistent-pod-state.svc",
        ])
        .status()
        .expect("certs");
    assert!(status.success());

    let base = render(&env, "manifests/base").await;
    let deploy = find(&base, "Deployment", "persistent-pod-state");
    let pod = &deploy["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(deploy["spec"]["replicas"], 2);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert!(container["resources"]["requests"]["memory"].is_string());
    assert!(pod["affinity"]["podAntiAffinity"].is_object());
    find(&base, "PodDisruptionBudget", "persistent-pod-state");
    find(&base, "Service", "persistent-pod-state");
    // Conversion through a Service of its own, which publishes replicas not ready yet.
    let conversion = find(&base, "Service", "persistent-pod-state-conversion");
    assert_eq!(conversion["spec"]["publishNotReadyAddresses"], true);
    assert_eq!(
        find(
            &base,
            "CustomResourceDefinition",
            "persistentpodstates.apps.kruise.io"
        )["spec"]["conversion"]["webhook"]["clientConfig"]["service"]["name"],
        "persistent-pod-state-conversion"
    );
    // Issue 10.7: ingress limited to the webhook and metrics ports.
    let policy = find(&base, "NetworkPolicy", "persistent-pod-state");
    let ports: Vec<i64> = policy["spec"]["ingress"]
        .as_array()
        .expect("ingress rules")
        .iter()
        .flat_map(|rule| rule["ports"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["port"].as_i64())
        .collect();
    assert_eq!(ports, [9443, 8080]);
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress"]));
    find(&base, "Role", "persistent-pod-state-leader-election");
    // The Lease's requests in the API server's leader-election priority level (the chart's
    // FlowSchema, in the version 1.29 on serve; its effect: ha.rs).
    let schema = find(&base, "FlowSchema", "persistent-pod-state-leader-election");
    assert_eq!(schema["apiVersion"], "flowcontrol.apiserver.k8s.io/v1");
    assert_eq!(
        schema["spec"]["priorityLevelConfiguration"]["name"],
        "leader-election"
    );
    for kind in [
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    ] {
        let hook = &find(&base, kind, "persistent-pod-state")["webhooks"][0];
        assert_eq!(hook["failurePolicy"], "Fail", "{kind}");
        assert!(
            hook["timeoutSeconds"].as_i64().is_some_and(|t| t <= 10),
            "{kind}"
        );
        let excluded = &hook["namespaceSelector"]["matchExpressions"][0]["values"];
        assert_eq!(
            excluded,
            &json!(["persistent-pod-state", "kube-system"]),
            "{kind}"
        );
    }

    let self_signed = render(&env, "manifests/overlays/self-signed").await;
    let ca = std::fs::read(certs.join("ca.crt")).expect("ca");
    let bundle = |v: &Value| -> Vec<u8> {
        use base64::Engine as _;
        let text: String = v.as_str().expect("caBundle").split_whitespace().collect();
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .expect("base64")
    };
    for kind in [
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    ] {
        assert_eq!(
            bundle(
                &find(&self_signed, kind, "persistent-pod-state")["webhooks"][0]["clientConfig"]["caBundle"]
            ),
            ca,
            "{kind}"
        );
    }
    let crd = find(
        &self_signed,
        "CustomResourceDefinition",
        "persistentpodstates.apps.kruise.io",
    );
    assert_eq!(
        bundle(&crd["spec"]["conversion"]["webhook"]["clientConfig"]["caBundle"]),
        ca
    );
    find(&self_signed, "Secret", "persistent-pod-state-tls");

    let cert_manager = render(&env, "manifests/overlays/cert-manager").await;
    for (kind, name) in [
        ("MutatingWebhookConfiguration", "persistent-pod-state"),
        ("ValidatingWebhookConfiguration", "persistent-pod-state"),
        (
            "CustomResourceDefinition",
            "persistentpodstates.apps.kruise.io",
        ),
    ] {
        let annotation = &find(&cert_manager, kind, name)["metadata"]["annotations"]["cert-manager.io/inject-ca-from"];
        assert_eq!(
            annotation, "persistent-pod-state/persistent-pod-state",
            "{kind}"
        );
    }
    // The serving certificate names both Services.
    let names = &find(&cert_manager, "Certificate", "persistent-pod-state")["spec"]["dnsNames"];
    for host in [
        "persistent-pod-state.persistent-pod-state.svc",
        "persistent-pod-state-conversion.persistent-pod-state.svc",
    ] {
        assert!(
            names
                .as_array()
                .is_some_and(|n| n.iter().any(|n| n == host)),
            "{host} in {names}"
        );
    }
    find(&cert_manager, "Certificate", "persistent-pod-state");

    // Issue 8.2: the pod webhook gets only StatefulSet pods where matchConditions exist (the
    // expression itself is evaluated by tests/match_conditions.rs); the pre-1.28 overlays
    // register it without them.
    let pod_hook = |objects: &[Value]| {
        find(
            objects,
            "MutatingWebhookConfiguration",
            "persistent-pod-state",
        )["webhooks"][0]
            .clone()
    };
    for overlay in [
        "manifests/base",
        "manifests/overlays/cert-manager",
        "manifests/overlays/self-signed",
    ] {
        let hook = pod_hook(&render(&env, overlay).await);
        assert!(
            hook["matchConditions"][0]["expression"]
                .as_str()
                .is_some_and(|e| e.contains("'StatefulSet'")),
            "{overlay}: {hook}"
        );
    }
    for overlay in [
        "manifests/overlays/cert-manager-pre-1.28",
        "manifests/overlays/self-signed-pre-1.28",
    ] {
        let objects = render(&env, overlay).await;
        let hook = pod_hook(&objects);
        assert!(hook.get("matchConditions").is_none(), "{overlay}: {hook}");
        assert_eq!(hook["sideEffects"], "NoneOnDryRun", "{overlay}");
        find(&objects, "Deployment", "persistent-pod-state");
        // No version of the FlowSchema is served by every release before 1.29.
        assert!(
            objects.iter().all(|o| o["kind"] != "FlowSchema"),
            "{overlay} has a FlowSchema"
        );
    }

    stub_cert_manager_crds(&env).await;
    let (ok, out) = kubectl(&env, &["create", "namespace", "persistent-pod-state"], None).await;
    assert!(ok || out.contains("AlreadyExists"), "{out}");
    // Accepted by this API server: every overlay its version can take (server-side dry run).
    let minor = server_minor(&env.client).await;
    let overlays: &[&str] = if minor >= 28 {
        &[
            "manifests/overlays/self-signed",
            "manifests/overlays/cert-manager",
            "manifests/overlays/self-signed-pre-1.28",
            "manifests/overlays/cert-manager-pre-1.28",
        ]
    } else {
        &[
            "manifests/overlays/self-signed-pre-1.28",
            "manifests/overlays/cert-manager-pre-1.28",
        ]
    };
    for overlay in overlays {
        let (ok, yaml) = kubectl(&env, &["kustomize", overlay], None).await;
        assert!(ok, "{yaml}");
        // v1.20 serves PodDisruptionBudget as policy/v1beta1 only (same fields as the
        // policy/v1 the manifests use).
        let yaml = if minor < 21 {
            yaml.replace("apiVersion: policy/v1\n", "apiVersion: policy/v1beta1\n")
        } else {
            yaml
        };
        let (ok, out) = kubectl(&env, &["apply", "--dry-run=server", "-f", "-"], Some(&yaml)).await;
        assert!(ok, "{overlay} rejected: {out}");
        println!(
            "{overlay}: {} objects accepted by the API server",
            out.lines().count()
        );
    }

    // The selectable-fields component (>= 1.31) on an overlay: the stored version selects by
    // the target's name, and the API server takes the CRD so (it refuses the same field on
    // both versions, kubernetes/kubernetes#140689).
    let dir = "target/e2e-kustomize/selectable-fields";
    std::fs::create_dir_all(repo().join(dir)).expect("kustomization directory");
    std::fs::write(
        repo().join(dir).join("kustomization.yaml"),
        "resources: [../../../manifests/overlays/self-signed]\n\
         components: [../../../manifests/components/selectable-fields]\n",
    )
    .expect("kustomization");
    let objects = render(&env, dir).await;
    let crd = find(
        &objects,
        "CustomResourceDefinition",
        "persistentpodstates.apps.kruise.io",
    );
    let selecting: Vec<(&Value, &Value)> = crd["spec"]["versions"]
        .as_array()
        .expect("versions")
        .iter()
        .map(|v| (&v["name"], &v["selectableFields"]))
        .collect();
    assert_eq!(
        selecting,
        [
            (
                &json!("v1beta1"),
                &json!([{"jsonPath": ".spec.targetRef.name"}])
            ),
            (&json!("v1alpha1"), &Value::Null)
        ]
    );
    if minor >= 31 {
        let (ok, out) = kubectl(
            &env,
            &["apply", "--dry-run=server", "-f", "-"],
            Some(&crd.to_string()),
        )
        .await;
        assert!(ok, "the CRD with its selectable field rejected: {out}");
    }

    // The base's policy/v1 PodDisruptionBudget, applied for real: the disruption controller
    // takes it up (no pod of the service runs here, so none may be disrupted).
    if minor >= 21 {
        let pdb = find(&base, "PodDisruptionBudget", "persistent-pod-state");
        assert_eq!(pdb["apiVersion"], "policy/v1");
        let (ok, out) = kubectl(&env, &["apply", "-f", "-"], Some(&pdb.to_string())).await;
        assert!(ok, "{out}");
        let budgets: kube::Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
            kube::Api::namespaced(env.client.clone(), "persistent-pod-state");
        let status = wait_for(
            "the disruption controller to observe the PDB",
            TIMEOUT,
            || async {
                let pdb = budgets.get("persistent-pod-state").await.ok()?;
                let status = pdb.status?;
                (status.observed_generation.is_some()
                    && status.observed_generation == pdb.metadata.generation)
                    .then_some(status)
            },
        )
        .await;
        assert_eq!(status.disruptions_allowed, 0, "{status:?}");
        assert_eq!(status.expected_pods, 0, "{status:?}");
        let _ = budgets
            .delete("persistent-pod-state", &Default::default())
            .await;
    }
}

/// Issue 4.1: the ServiceAccount with the base's RBAC (and nothing else) runs the service:
/// caches sync, it takes a Lease in its namespace; it may not do what it does not need.
#[tokio::test]
async fn the_service_account_rbac_is_enough_to_run_and_no_more() {
    let env = env().await;
    let base = render(&env, "manifests/base").await;
    let rbac: Vec<String> = base
        .iter()
        .filter(|o| {
            [
                "Namespace",
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "Role",
                "RoleBinding",
            ]
            .contains(&o["kind"].as_str().unwrap_or_default())
        })
        .map(|o| serde_yaml_ng::to_string(o).expect("yaml"))
        .collect();
    let (ok, out) = kubectl(&env, &["apply", "-f", "-"], Some(&rbac.join("---\n"))).await;
    assert!(ok, "{out}");
    let (ok, token) = kubectl(
        &env,
        &[
            "create",
            "token",
            "persistent-pod-state",
            "-n",
            "persistent-pod-state",
        ],
        None,
    )
    .await;
    assert!(ok, "{token}");
    let server = format!(
        "https://127.0.0.1:{}",
        std::fs::read_to_string(env.cluster_dir.join("kubeconfig"))
            .expect("kubeconfig")
            .lines()
            .find_map(|l| l.trim().strip_prefix("server: https://127.0.0.1:"))
            .expect("server line")
    );
    let kubeconfig = env.cluster_dir.join("sa-kubeconfig");
    std::fs::write(&kubeconfig, format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: '{server}', certificate-authority: '{}'}}\nusers:\n- name: sa\n  user: {{token: '{}'}}\ncontexts:\n- name: c\n  context: {{cluster: c, user: sa}}\ncurrent-context: c\n",
        env.cluster_dir.join("pki/ca.crt").display(), token.trim()
    )).expect("write kubeconfig");

    let sa = "--as=system:serviceaccount:persistent-pod-state:persistent-pod-state";
    // The aggregated ClusterRole is filled in by the controller-manager.
    wait_for(
        "the aggregated ClusterRole to grant the core rules",
        TIMEOUT,
        || async {
            let (_, answer) =
                kubectl(&env, &["auth", "can-i", "list", "pods", sa, "-A"], None).await;
            (answer.lines().next().unwrap_or_default().trim() == "yes").then_some(())
        },
    )
    .await;
    for (verb, resource, allowed) in [
        ("list", "pods", "yes"),
        ("patch", "persistentpodstates.apps.kruise.io/status", "yes"),
        ("create", "events.events.k8s.io", "yes"),
        // Releasing a waiting pod the webhook pinned to a node no longer usable.
        ("delete", "pods", "yes"),
        // Releasing a waiting pod's claim on a node-local volume of a node that is gone.
        ("delete", "persistentvolumeclaims", "yes"),
        ("get", "persistentvolumes", "yes"),
        ("delete", "persistentvolumes", "no"),
        ("delete", "nodes", "no"),
        ("update", "statefulsets.apps", "no"),
        ("get", "secrets", "no"),
    ] {
        let (_, answer) = kubectl(&env, &["auth", "can-i", verb, resource, sa, "-A"], None).await;
        assert_eq!(
            answer.lines().next().unwrap_or_default().trim(),
            allowed,
            "{verb} {resource}"
        );
    }
    let log = env.cluster_dir.join("logs/persistent-pod-state-rbac.log");
    let mut child = tokio::process::Command::from(serve_command(&env, &kubeconfig, 19447, 18084))
        .env("PPS_LEASE_NAMESPACE", "persistent-pod-state")
        .env("PPS_LEASE_NAME", "e2e-rbac")
        .env("PPS_LEADER_IDENTITY", "e2e-rbac")
        .stderr(std::fs::File::create(&log).expect("log"))
        .kill_on_drop(true)
        .spawn()
        .expect("serve");
    wait_for(
        "the ServiceAccount-run instance to be ready and leading",
        TIMEOUT,
        || async {
            let (code, text) = http_get("http://127.0.0.1:18084/metrics").await;
            (code == 200 && metric(&text, "pps_leader ") == 1.0).then_some(())
        },
    )
    .await;
    child.kill().await.expect("stop");
    let log = std::fs::read_to_string(&log).expect("log");
    assert!(
        !log.to_lowercase().contains("forbidden"),
        "the ServiceAccount was refused something:\n{log}"
    );
}
