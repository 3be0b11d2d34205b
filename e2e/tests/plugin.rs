//! `kubectl pps` (issue 21.5): installed from the krew manifest and archive that
//! plugins/krew/package.sh makes (checked as krew checks them), found by kubectl on PATH, and
//! each command with kubectl's flags against the control plane: `status` (`-n`, `-A`,
//! `-o json|yaml|wide`, `--context`), `explain`, and `release` of a pod waiting for a dead node
//! (and its refusal of a scheduled pod, and of a pod no workload would create again); and as a
//! user who may read only its namespace (`--as`), the answers it can still give.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::ResourceExt;
use kube::api::Api;
use serde_json::Value;

use crate::support::*;

/// Installs the plugin as krew does from the packaged archive: the manifest's sha256 must be
/// the archive's; the manifest's `bin` is put on PATH. Returns the directory to put on PATH.
async fn install_from_krew_package(env: &Env) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = env.cluster_dir.join("krew");
    let made = tokio::process::Command::new("bash")
        .arg(root.join("plugins/krew/package.sh"))
        .arg(&out)
        .arg(&env.pps_bin)
        .output()
        .await
        .expect("package.sh");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let archive = PathBuf::from(String::from_utf8_lossy(&made.stdout).trim());
    let manifest = yaml_documents(
        &std::fs::read_to_string(out.join("pps.yaml")).expect("the packaged manifest"),
    )
    .remove(0);
    assert_eq!(manifest["kind"], "Plugin");
    let platforms = manifest["spec"]["platforms"].as_array().expect("platforms");
    assert_eq!(platforms.len(), 1, "one platform per binary packaged");
    let platform = &platforms[0];
    let arch = match std::env::consts::ARCH {
        "aarch64" => "arm64",
        _ => "amd64",
    };
    assert_eq!(
        platform["selector"]["matchLabels"],
        serde_json::json!({"os": "linux", "arch": arch}),
        "the platform is the binary's own"
    );
    let sum = tokio::process::Command::new("sha256sum")
        .arg(&archive)
        .output()
        .await
        .expect("sha256sum");
    let sum = String::from_utf8_lossy(&sum.stdout);
    assert_eq!(
        platform["sha256"].as_str(),
        sum.split_whitespace().next(),
        "the manifest's sha256 is the archive's"
    );
    assert!(
        platform["uri"]
            .as_str()
            .is_some_and(|u| u.ends_with(&*archive.file_name().expect("name").to_string_lossy())),
        "the manifest names the archive"
    );
    let bin_dir = out.join("bin");
    std::fs::create_dir_all(&bin_dir).expect("bin dir");
    let unpacked = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(&bin_dir)
        .status()
        .expect("tar");
    assert!(unpacked.success());
    let bin = platform["bin"].as_str().expect("bin");
    assert!(bin_dir.join(bin).exists(), "{bin} in the archive");
    bin_dir
}

/// `kubectl ARGS` with the plugin's directory first on PATH: success, stdout, stderr.
async fn kubectl_pps(env: &Env, path: &Path, args: &[&str]) -> (bool, String, String) {
    let search = format!(
        "{}:{}",
        path.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = tokio::process::Command::new("kubectl")
        .args(args)
        .env("PATH", search)
        .env("KUBECONFIG", env.cluster_dir.join("kubeconfig"))
        .env_remove("PPS_NODE_LOST_AFTER")
        .output()
        .await
        .expect("kubectl runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The row of PersistentPodState `name` in `kubectl pps status ... -o json`.
fn row<'a>(rows: &'a Value, ns: &str, name: &str) -> Option<&'a Value> {
    rows.as_array()?
        .iter()
        .find(|r| r["namespace"] == ns && r["name"] == name)
}

#[tokio::test]
async fn kubectl_pps_status_explain_release_with_kubectls_flags() {
    let env = env().await;
    let c = &env.client;
    let path = install_from_krew_package(&env).await;
    let (ok, out, err) = kubectl_pps(&env, &path, &["plugin", "list"]).await;
    assert!(
        ok && out.contains("kubectl-pps"),
        "kubectl finds the plugin: {out}{err}"
    );

    let ns = namespace(c, "e2e-plugin").await;
    let sts = pinned_statefulset("web", 2);
    let (before, _) = start_recorded(c, &ns, &sts).await;

    // status: -n, -o json|yaml|wide, -A, --context.
    let rows = status_json(&env, &path, &ns, &[]).await;
    let web = row(&rows, &ns, "web").expect("web's row");
    assert_eq!(web["target"], "StatefulSet/web");
    assert_eq!(web["recorded"], 2);
    assert_eq!(web["unplaceable"], serde_json::json!([]));
    let yaml = yaml_documents(&pps(&env, &path, &["status", "-n", &ns, "-o", "yaml"]).await);
    assert_eq!(yaml[0][0]["name"], "web", "{yaml:?}");
    let table = pps(&env, &path, &["status", "-n", &ns]).await;
    let header = table.lines().next().expect("header");
    assert!(
        header.starts_with("NAMESPACE") && header.contains("RECORDED"),
        "{table}"
    );
    let cells = [ns.as_str(), "web", "StatefulSet/web", "2"];
    assert!(
        table
            .lines()
            .any(|l| l.split_whitespace().take(4).eq(cells)),
        "{table}"
    );
    let wide = pps(&env, &path, &["status", "-n", &ns, "-o", "wide"]).await;
    let wide_header = wide.lines().next().unwrap_or_default();
    assert!(wide_header.contains("RELEASED-PODS"), "{wide}");
    let all: Value = serde_json::from_str(&pps(&env, &path, &["status", "-A", "-o", "json"]).await)
        .expect("json");
    assert!(row(&all, &ns, "web").is_some(), "-A lists every namespace");
    let context = status_json(&env, &path, &ns, &["--context", "local"]).await;
    assert!(row(&context, &ns, "web").is_some(), "--context");
    let (ok, _, err) = kubectl_pps(&env, &path, &["pps", "status", "--context", "nope"]).await;
    assert!(
        !ok && err.contains("nope"),
        "an unknown context is named: {err}"
    );

    // explain: text and -o json.
    let text = pps(&env, &path, &["explain", "web-0", "-n", &ns]).await;
    assert!(text.contains("web"), "{text}");
    let json = pps(&env, &path, &["explain", "web-0", "-n", &ns, "-o", "json"]).await;
    let explained: Value = serde_json::from_str(&json).expect("json");
    assert_eq!(explained["persistentPodState"], "web", "{explained}");
    assert!(explained.get("unread").is_none(), "{explained}");

    // An application team's user (`--as`), who may read its namespace only: status answers
    // without the columns it cannot judge; with nodes listable too, explain answers as for the
    // admin and names the pods of other namespaces it did not see.
    let (ok, out) = kubectl(&env, &["apply", "-f", "-"], Some(&team_rbac(&ns))).await;
    let rbac = ClusterRbac;
    assert!(ok, "{out}");
    let team = ["--as", "e2e-plugin-team"];
    let args = [&["pps", "status", "-n", &ns, "-o", "json"][..], &team].concat();
    let (ok, out, err) = kubectl_pps(&env, &path, &args).await;
    assert!(ok, "{err}");
    let rows: Value = serde_json::from_str(&out).expect("json");
    let web = row(&rows, &ns, "web").expect("web's row");
    assert_eq!(
        (&web["recorded"], &web["unplaceable"], &web["released"]),
        (&serde_json::json!(2), &Value::Null, &Value::Null),
        "{web}"
    );
    assert!(
        err.contains("could not list nodes") && err.contains("could not list Events"),
        "{err}"
    );
    let args = [&["pps", "status", "-n", &ns, "-o", "wide"][..], &team].concat();
    let (ok, wide, err) = kubectl_pps(&env, &path, &args).await;
    let line = wide.lines().find(|l| l.contains("StatefulSet/web"));
    let judged: Option<Vec<&str>> = line.map(|l| l.split_whitespace().skip(5).collect());
    assert!(ok && judged == Some(vec!["?"; 4]), "{wide}{err}");
    let args = [
        &["pps", "explain", "web-0", "-n", &ns, "-o", "json"][..],
        &team,
    ]
    .concat();
    let (ok, _, err) = kubectl_pps(&env, &path, &args).await;
    assert!(!ok && err.contains("listing nodes"), "{err}");
    let team_nodes = ["--as", "e2e-plugin-team", "--as-group", "e2e-plugin-nodes"];
    let args = [
        &["pps", "explain", "web-0", "-n", &ns, "-o", "json"][..],
        &team_nodes,
    ]
    .concat();
    let (ok, out, err) = kubectl_pps(&env, &path, &args).await;
    assert!(ok, "{err}");
    let partial: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(
        (&partial["outcome"], &partial["patch"]),
        (&explained["outcome"], &explained["patch"]),
        "{partial}"
    );
    assert!(
        partial["unread"][0]
            .as_str()
            .is_some_and(|u| u.starts_with("pods in every namespace")),
        "{partial}"
    );
    drop(rbac);

    // A dead node: with the plugin's --node-lost-after below the time it has been down, web-0's
    // state is unplaceable; with the default (5m) it is not yet.
    let node = before["web-0"].node.clone();
    let kubelet = kubelet_dies(c, &node).await;
    // The node counts as lost 1 s after its Ready condition turned Unknown (a moment ago, to
    // the second): polled until then.
    wait_for(
        "web-0 unplaceable with --node-lost-after 1s",
        TIMEOUT,
        || async {
            let lost = status_json(&env, &path, &ns, &["--node-lost-after", "1s"]).await;
            (row(&lost, &ns, "web").expect("row")["unplaceable"] == serde_json::json!(["web-0"]))
                .then_some(())
        },
    )
    .await;
    let not_yet = status_json(&env, &path, &ns, &[]).await;
    assert_eq!(
        row(&not_yet, &ns, "web").expect("row")["unplaceable"],
        serde_json::json!([])
    );

    // release: a scheduled pod is refused; the re-created pod, pinned to the dead node and
    // waiting, is released on the operator's word (a dry run first deletes nothing).
    let (ok, _, err) = kubectl_pps(&env, &path, &["pps", "release", "web-1", "-n", &ns]).await;
    assert!(!ok && err.contains("scheduled"), "{err}");
    // A waiting pod that no workload would create again (no controller owns it) is refused,
    // and kept.
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(c.clone(), &ns);
    let orphan: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "orphan"},
        "spec": {"nodeSelector": {"no-node-has": "this"},
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.9"}]},
    }))
    .expect("pod");
    let orphan = pods
        .create(&kube::api::PostParams::default(), &orphan)
        .await
        .expect("the orphan created");
    let (ok, _, err) = kubectl_pps(&env, &path, &["pps", "release", "orphan", "-n", &ns]).await;
    assert!(
        !ok && err.contains("no workload that would create it again"),
        "{err}"
    );
    assert_eq!(
        pods.get("orphan").await.expect("kept").uid(),
        orphan.uid(),
        "the orphan is kept"
    );
    let old = force_delete_pod(c, &ns, "web-0").await;
    let waiting = wait_for("web-0 re-created and waiting", TIMEOUT, || async {
        let p = pods.get_opt("web-0").await.ok()??;
        let unscheduled = p.spec.as_ref()?.node_name.is_none();
        (p.uid()? != old && unscheduled).then(|| p.uid())?
    })
    .await;
    let said = pps(&env, &path, &["release", "web-0", "-n", &ns, "--dry-run"]).await;
    assert!(
        said.contains(&format!(
            "would make the state of web-0 name node {node} no more first"
        )),
        "{said}"
    );
    assert_eq!(
        pods.get("web-0").await.expect("pod").uid(),
        Some(waiting.clone())
    );
    // Once the node counts as lost for the replicas (45 s), the controller releases the pod:
    // status counts it from the PodReleased Event. Created again, it runs elsewhere.
    let released = wait_for(
        "the controller's release in kubectl pps status",
        TIMEOUT + Duration::from_secs(60),
        || async {
            let rows = status_json(&env, &path, &ns, &[]).await;
            let r = row(&rows, &ns, "web")?;
            (r["released"] == serde_json::json!(["web-0"])).then(|| r.clone())
        },
    )
    .await;
    println!("kubectl pps status after the release: {released}");
    let moved = wait_replaced(c, &ns, "web-0", &waiting).await;
    let elsewhere = placement(&moved).map(|p| p.node).unwrap_or_default();
    assert_ne!(elsewhere, node);
    let states = pps_api(c, &ns);
    wait_for(
        &format!("web-0 recorded on {elsewhere}"),
        TIMEOUT,
        || async {
            let pps = states.get_opt("web").await.ok()??;
            let state = pps.status?.pod_states.remove("web-0")?;
            (state.node_name.as_deref() == Some(elsewhere.as_str())).then_some(())
        },
    )
    .await;

    // Pinned to a node that is there and works but is cordoned: on the operator's word,
    // release makes its state name that node no more first, so the pod created again is not
    // pinned back there and runs elsewhere.
    let cordoned = cordon(c, &elsewhere).await;
    let old = force_delete_pod(c, &ns, "web-0").await;
    let held = created_again(c, &ns, "web-0", &old).await;
    let pin = held
        .spec
        .as_ref()
        .and_then(|s| s.node_selector.as_ref())
        .and_then(|s| s.get(HOST).cloned());
    assert_eq!(pin.as_deref(), Some(elsewhere.as_str()), "pinned there");
    let said = pps(&env, &path, &["release", "web-0", "-n", &ns, "-o", "json"]).await;
    let report: Value = serde_json::from_str(&said).expect("json");
    assert!(
        report["podDeleted"] == true
            && report["state"]
                .as_str()
                .is_some_and(|s| s.contains(&format!("names node {elsewhere} no more"))),
        "{report}"
    );
    let freed = wait_replaced(c, &ns, "web-0", &held.uid().unwrap_or_default()).await;
    let now_on = placement(&freed).map(|p| p.node).unwrap_or_default();
    assert!(
        now_on != elsewhere && now_on != node,
        "runs on {now_on}, neither the cordoned {elsewhere} nor the dead {node}"
    );
    cordoned.lift().await;
    kubelet_returns(c, &node, kubelet).await;
    delete_namespace(c, &ns).await;
}

/// The rights of an application team in `ns` (user `e2e-plugin-team`): its namespace's
/// PersistentPodStates, pods and StatefulSets; group `e2e-plugin-nodes` may list nodes.
fn team_rbac(ns: &str) -> String {
    format!(
        r#"apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: e2e-plugin-team, namespace: {ns}}}
rules:
- {{apiGroups: [""], resources: [pods], verbs: [get, list]}}
- {{apiGroups: [apps], resources: [statefulsets], verbs: [get, list]}}
- {{apiGroups: [apps.kruise.io], resources: [persistentpodstates], verbs: [get, list]}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: e2e-plugin-team, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: e2e-plugin-team}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: e2e-plugin-team}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: e2e-plugin-nodes}}
rules: [{{apiGroups: [""], resources: [nodes], verbs: [list]}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: e2e-plugin-nodes}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: e2e-plugin-nodes}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: Group, name: e2e-plugin-nodes}}]
"#
    )
}

/// The cluster-wide objects of [`team_rbac`], deleted when dropped (at the test's end, or as a
/// failing test unwinds), so no later test finds them.
struct ClusterRbac;

impl Drop for ClusterRbac {
    fn drop(&mut self) {
        put_back(|c| async move {
            use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
            let params = kube::api::DeleteParams::default();
            let binding = Api::<ClusterRoleBinding>::all(c.clone())
                .delete("e2e-plugin-nodes", &params)
                .await
                .map(|_| ());
            let role = Api::<ClusterRole>::all(c)
                .delete("e2e-plugin-nodes", &params)
                .await
                .map(|_| ());
            for deleted in [binding, role] {
                if let Err(e) = deleted {
                    eprintln!("e2e-plugin-nodes left behind: {e}");
                }
            }
        });
    }
}

/// `kubectl pps ARGS`, which must succeed: its standard output.
async fn pps(env: &Env, path: &Path, args: &[&str]) -> String {
    let args: Vec<&str> = ["pps"].iter().chain(args).copied().collect();
    let (ok, out, err) = kubectl_pps(env, path, &args).await;
    assert!(ok, "kubectl {args:?}: {err}");
    out
}

/// `kubectl pps status -n NS -o json EXTRA...`, parsed.
async fn status_json(env: &Env, path: &Path, ns: &str, extra: &[&str]) -> Value {
    let mut args = vec!["status", "-n", ns, "-o", "json"];
    args.extend(extra);
    serde_json::from_str(&pps(env, path, &args).await).expect("json")
}
