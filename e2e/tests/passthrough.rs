//! What the webhook must leave alone, and what a server-side dry run shows.

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use persistent_pod_state::api::INJECTED_ANNOTATION;
use serde_json::json;

use crate::support::*;

fn owned_pod(name: &str, sts_uid: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet",
            "name": "web", "uid": sts_uid, "controller": true}]},
        "spec": {"containers": [{"name": "c", "image": "cilium/echoserver:latest"}]}
    }))
    .expect("pod")
}

/// 7f, and the dry run: a Deployment's pods and a bare pod named like a recorded pod are not
/// touched; a dry-run create shows the injection a real create would get.
#[tokio::test]
async fn deployments_and_bare_pods_pass_through_and_dry_run_shows_the_injection() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-passthrough").await;

    // A state for web-0 whose pod is gone (WhenDeleted keeps it after scaling to 0).
    pps_api(c, &ns)
        .create(&PostParams::default(), &serde_json::from_value(json!({
            "apiVersion": "apps.kruise.io/v1alpha1", "kind": "PersistentPodState",
            "metadata": {"name": "web"},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                     "preferredPersistentTopology": [{"weight": 60, "preference": {"nodeTopologyKeys": [HOST]}}],
                     "persistentPodStateRetentionPolicy": "WhenDeleted"}
        })).expect("pps"))
        .await
        .expect("create pps");
    let (before, _) = start_recorded(c, &ns, &statefulset("web", 1, &[])).await;
    let sts_api: Api<StatefulSet> = Api::namespaced(c.clone(), &ns);
    sts_api
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 0}})),
        )
        .await
        .expect("scale to 0");
    wait_sts_rolled(c, &ns, "web", 0).await;
    let sts_uid = sts_api.get("web").await.expect("sts").uid().expect("uid");
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    wait_for("web-0 to be gone", TIMEOUT, || async {
        pods.get_opt("web-0").await.ok()?.is_none().then_some(())
    })
    .await;

    // Dry run: the response shows the injection; nothing is created.
    let dry = pods
        .create(
            &PostParams {
                dry_run: true,
                ..PostParams::default()
            },
            &owned_pod("web-0", &sts_uid),
        )
        .await
        .expect("dry-run create");
    assert_eq!(
        dry.annotations()
            .get(INJECTED_ANNOTATION)
            .map(String::as_str),
        Some("web")
    );
    let terms = preferred_terms(&dry);
    assert_eq!(terms.len(), 1);
    assert_eq!(terms[0]["weight"], 60);
    assert_eq!(
        terms[0]["preference"]["matchExpressions"][0]["values"][0],
        before["web-0"].node.as_str()
    );
    assert!(
        pods.get_opt("web-0").await.expect("get").is_none(),
        "dry run created nothing"
    );

    // A bare pod with the recorded name, and a Deployment's pods: untouched.
    let metrics_before = scrape(&env).await;
    let reviews_before = pod_reviews(&env).await;
    let bare: Pod = serde_json::from_value(json!({"metadata": {"name": "web-0"},
        "spec": {"containers": [{"name": "c", "image": "cilium/echoserver:latest"}]}}))
    .expect("pod");
    let bare = pods
        .create(&PostParams::default(), &bare)
        .await
        .expect("bare pod");
    assert!(bare.annotations().get(INJECTED_ANNOTATION).is_none());
    assert!(preferred_terms(&bare).is_empty());

    let deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "stateless"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "stateless"}},
                 "template": {"metadata": {"labels": {"app": "stateless"}},
                              "spec": {"containers": [{"name": "c", "image": "cilium/echoserver:latest"}]}}}
    }))
    .expect("deployment");
    Api::<Deployment>::namespaced(c.clone(), &ns)
        .create(&PostParams::default(), &deploy)
        .await
        .expect("deployment");
    let deploy_pods = wait_for("the Deployment's 2 pods", TIMEOUT, || async {
        let list = pods
            .list(&kube::api::ListParams::default().labels("app=stateless"))
            .await
            .ok()?;
        (list.items.len() == 2).then_some(list.items)
    })
    .await;
    for pod in &deploy_pods {
        assert!(
            pod.annotations().get(INJECTED_ANNOTATION).is_none(),
            "{}",
            pod.name_any()
        );
        assert!(preferred_terms(pod).is_empty());
    }
    if server_minor(c).await >= 28 {
        // The registration's matchConditions keep them away from the webhook.
        assert_eq!(pod_reviews(&env).await, reviews_before, "no review sent");
    } else {
        // Registered without matchConditions (pre-1.28): sent, looked at, and skipped.
        let metrics_after = scrape(&env).await;
        for series in [
            r#"pps_admission_skipped_total{reason="no_controller"}"#,
            r#"pps_admission_skipped_total{reason="not_statefulset"}"#,
        ] {
            assert!(
                metric(&metrics_after, series) > metric(&metrics_before, series),
                "{series} counted"
            );
        }
    }
    delete_namespace(c, &ns).await;
}
