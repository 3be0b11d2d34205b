//! Observe mode (issue 21.6): a PersistentPodState observed only (`persistent-pod-state.io/mode:
//! observe`, copied from its workload by the generator) records as before and injects nothing;
//! what it reports for a re-created pod (the `WouldInject` Event's patch, `explain`) is exactly
//! what the active mode injected into the same pod.

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, ResourceExt};
use persistent_pod_state::api::{
    INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION, MODE_ANNOTATION,
};
use serde_json::{Value, json};

use crate::support::*;

/// What the webhook injects into a pod: nodeSelector, node affinity and its two annotations.
fn injected(pod: &Value) -> Value {
    let annotation = |k: &str| {
        pod.pointer(&format!("/metadata/annotations/{}", k.replace('/', "~1")))
            .cloned()
    };
    json!({
        "nodeSelector": pod.pointer("/spec/nodeSelector"),
        "nodeAffinity": pod.pointer("/spec/affinity/nodeAffinity"),
        "injected": annotation(INJECTED_ANNOTATION),
        "injectedRequired": annotation(INJECTED_REQUIRED_ANNOTATION),
    })
}

#[tokio::test]
async fn observe_mode_reports_exactly_what_the_active_mode_injects() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-observe").await;
    let sts = pinned_statefulset("web", 2);
    let (before, _) = start_recorded(c, &ns, &sts).await;

    // Active: web-0 re-created is steered back.
    let active = recreate_pod(c, &ns, "web-0").await;
    assert_steered_back(&active, "web", &before["web-0"]);
    let active = injected(&serde_json::to_value(&active).expect("pod"));
    assert!(active["injectedRequired"].is_string(), "{active}");

    // Observed only, from the workload's annotation.
    patch_sts(
        c,
        &ns,
        "web",
        json!({"metadata": {"annotations": {MODE_ANNOTATION: "observe"}}}),
    )
    .await;
    wait_for(
        "the mode copied to the generated PersistentPodState",
        TIMEOUT,
        || async {
            let p = pps_api(c, &ns).get("web").await.ok()?;
            (p.annotations().get(MODE_ANNOTATION).map(String::as_str) == Some("observe"))
                .then_some(())
        },
    )
    .await;
    let observed_before = metric(
        &scrape(&env).await,
        "pps_admission_requests_total{endpoint=\"/mutate-pod\",result=\"observed\"}",
    );
    let pod = recreate_pod(c, &ns, "web-0").await;
    assert!(
        pod.annotations().get(INJECTED_ANNOTATION).is_none(),
        "nothing injected when observed only"
    );
    assert!(
        pod.spec
            .as_ref()
            .and_then(|s| s.affinity.as_ref())
            .is_none(),
        "no affinity injected"
    );
    let uid = pod.uid().expect("uid");
    let event =
        wait_event_noting(c, &ns, "web", "WouldInject", &["pod web-0: would inject "]).await;
    let note = event.note.expect("note");
    let patch: json_patch::Patch =
        serde_json::from_str(note.split_once("would inject ").expect("the patch").1)
            .expect("the Event carries the JSON patch");
    // The reported patch, applied to the pod as it was created, gives what active mode injected.
    let mut as_created = serde_json::to_value(&pod).expect("pod");
    json_patch::patch(&mut as_created, &patch).expect("the patch applies to the pod");
    assert_eq!(injected(&as_created), active, "observed == injected");
    assert!(
        metric(
            &scrape(&env).await,
            "pps_admission_requests_total{endpoint=\"/mutate-pod\",result=\"observed\"}"
        ) > observed_before,
        "counted as observed"
    );
    assert!(metric(&scrape(&env).await, "pps_observed_total{kind=\"required\"}") >= 1.0);

    // explain says the same: observed only, and the same patch.
    let explained: Value = serde_json::from_str(
        &pps_command(&env, &["explain", "web-0", "-n", &ns, "-o", "json"]).await,
    )
    .expect("json");
    assert_eq!(explained["outcome"], "would inject (observed only)");
    assert_eq!(
        explained["patch"],
        serde_json::to_value(&patch).expect("patch")
    );
    // Still recorded: the pod, running where the scheduler put it, is in the state.
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    assert_eq!(pods.get("web-0").await.expect("pod").uid(), Some(uid));
    wait_recorded(c, &ns, "web", &pod_names("web", 2), "web").await;

    // An invalid mode is refused by the validation, naming the field.
    let (ok, out) = kubectl(
        &env,
        &[
            "annotate",
            "pps",
            "web",
            "-n",
            &ns,
            &format!("{MODE_ANNOTATION}=watch"),
            "--overwrite",
        ],
        None,
    )
    .await;
    assert!(
        !ok && out.contains(MODE_ANNOTATION) && out.contains("observe"),
        "{out}"
    );
    delete_namespace(c, &ns).await;
}
