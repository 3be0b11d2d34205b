//! Every command in docs/ runs, against the local control plane and the running replicas.
//!
//! The local control plane has no pod network, so `kubectl apply` of the installation (which
//! would register webhooks calling a Service here) runs as a server-side dry run through a
//! `kubectl` shim; everything else runs as written.

use std::path::Path;

use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;

use crate::support::*;

/// The ```sh blocks of a Markdown file.
fn sh_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in markdown.lines() {
        let trimmed = line.trim_start();
        match (&mut current, trimmed) {
            (None, "```sh") => current = Some(Vec::new()),
            (Some(lines), "```") => {
                blocks.push(lines.join("\n"));
                current = None;
            }
            (Some(lines), _) => lines.push(
                line.strip_prefix("   ")
                    .filter(|_| line.starts_with("   "))
                    .unwrap_or(line),
            ),
            (None, _) => {}
        }
    }
    blocks
}

const SHIM: &str = r#"#!/usr/bin/env bash
# kubectl, except that `apply` of manifests becomes a server-side dry run (see docs.rs).
if [[ $1 == apply && " $* " != *" --dry-run"* ]]; then
  shift
  if [[ $1 == -k ]]; then src=$("$REAL_KUBECTL" kustomize "$2"); else src=$(cat "$2"); fi
  if ((SERVER_MINOR >= 28)); then
    printf '%s\n' "$src" | "$REAL_KUBECTL" apply --dry-run=server -f -
    exit "${PIPESTATUS[1]}"
  fi
  # v1.20 serves PodDisruptionBudget as policy/v1beta1 only, and does not know the pod
  # webhook's matchConditions (1.28+): kubectl's client-side schema check is skipped so the
  # server checks the rest and drops that field, as a v1.20 server does.
  printf '%s\n' "$src" | sed 's#^apiVersion: policy/v1$#apiVersion: policy/v1beta1#' |
    "$REAL_KUBECTL" apply --dry-run=server --validate=false -f -
  exit "${PIPESTATUS[2]}"
fi
exec "$REAL_KUBECTL" "$@"
"#;

/// Issue 4.6: the commands of install, migration, failure modes, metrics and troubleshooting.
#[tokio::test]
async fn every_command_in_the_docs_runs() {
    let env = env().await;
    let c = &env.client;
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    stub_cert_manager_crds(&env).await;
    // The manifests' namespace must exist for their dry run; it may exist already.
    let _ = tokio::process::Command::new("kubectl")
        .args(["create", "namespace", "persistent-pod-state"])
        .env("KUBECONFIG", env.cluster_dir.join("kubeconfig"))
        .output()
        .await;

    // A StatefulSet whose scaled-in pod keeps its state, for the troubleshooting dry run.
    let ns = namespace(c, "e2e-docs").await;
    let pps: Api<persistent_pod_state::api::PersistentPodState> = Api::namespaced(c.clone(), &ns);
    pps.create(&PostParams::default(), &serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState", "metadata": {"name": "docs"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "docs"},
                 "preferredPersistentTopology": [{"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}}],
                 "persistentPodStateRetentionPolicy": "WhenDeleted"}
    })).expect("pps"))
    .await
    .expect("create pps");
    let (placed, _) = start_recorded(c, &ns, &statefulset("docs", 2, &[])).await;
    Api::<k8s_openapi::api::apps::v1::StatefulSet>::namespaced(c.clone(), &ns)
        .patch(
            "docs",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await
        .expect("scale in");
    wait_sts_rolled(c, &ns, "docs", 1).await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(c.clone(), &ns);
    wait_for("docs-1 gone", TIMEOUT, || async {
        pods.get_opt("docs-1").await.ok()?.is_none().then_some(())
    })
    .await;

    let shim_dir = env.cluster_dir.join("docs-shim");
    std::fs::create_dir_all(&shim_dir).expect("shim dir");
    let shim = shim_dir.join("kubectl");
    std::fs::write(&shim, SHIM).expect("shim");
    std::process::Command::new("chmod")
        .args(["+x", shim.to_str().expect("path")])
        .status()
        .expect("chmod");
    let real_kubectl = String::from_utf8(
        std::process::Command::new("bash")
            .args(["-c", "command -v kubectl"])
            .output()
            .expect("which")
            .stdout,
    )
    .expect("utf8")
    .trim()
    .to_owned();
    let minor = server_minor(c).await.to_string();
    let bin_dir = env.pps_bin.parent().expect("bin dir").to_owned();
    let path = format!(
        "{}:{}:{}",
        shim_dir.display(),
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );

    let mut files: Vec<_> = std::fs::read_dir(repo.join("docs"))
        .expect("docs")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    files.sort();
    let mut ran = 0;
    for file in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "md"))
    {
        let text = std::fs::read_to_string(file).expect("doc");
        for (i, block) in sh_blocks(&text).into_iter().enumerate() {
            let out = tokio::process::Command::new("bash")
                .args(["-euo", "pipefail", "-c", &block])
                .current_dir(repo)
                .env("KUBECONFIG", env.cluster_dir.join("kubeconfig"))
                .env("PATH", &path)
                .env("REAL_KUBECTL", &real_kubectl)
                .env("SERVER_MINOR", &minor)
                .env("PROBE", env.replicas[0].probe_url())
                .env("NS", &ns)
                .env("STS", "docs")
                .env("POD", "docs-1")
                .output()
                .await
                .expect("bash runs");
            let name = format!(
                "{} block {}",
                file.file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default(),
                i + 1
            );
            assert!(
                out.status.success(),
                "{name} failed:\n{block}\n--- stdout\n{}\n--- stderr\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            if block.contains("create --dry-run=server") {
                let shown = String::from_utf8_lossy(&out.stdout);
                assert!(
                    shown.contains(&placed["docs-1"].node),
                    "the dry run shows the recorded node: {shown}"
                );
            }
            ran += 1;
        }
    }
    println!("{ran} documented command blocks ran");
    assert!(ran >= 10, "only {ran} blocks found");
    delete_namespace(c, &ns).await;
}

#[test]
fn sh_blocks_are_found_with_their_indentation_removed() {
    let md = "text\n```sh\necho a\n```\n1. step\n\n   ```sh\n   echo b\n   echo c\n   ```\n```yaml\nx: 1\n```\n";
    assert_eq!(
        sh_blocks(md),
        vec!["echo a".to_string(), "echo b\necho c".to_string()]
    );
}
