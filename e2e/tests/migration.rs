//! Migration from OpenKruise (issue 8.3, 8.4): objects that upstream's CRD and webhook accepted
//! keep working once this service's CRD and validating webhook replace upstream's.

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaPropsOrBool,
};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use persistent_pod_state::api::INJECTED_ANNOTATION;
use serde_json::{Value, json};

use crate::support::*;

const CRD: &str = "persistentpodstates.apps.kruise.io";

/// Upstream's CRD as it differs from ours: no printer columns, a status that requires
/// `observedGeneration` and declares none of this service's fields (`recorded`, `restored`,
/// each state's `podIPs`, `podUID`, `nodeUID`, `lastRestore`: the API server prunes them), and
/// in v1beta1 a minimum weight of 0 and an enum on the retention
/// policy (ours has neither: an object created through v1alpha1 with an empty retention policy
/// is stored as v1beta1 and could not be written again under that enum). The conversion
/// webhook stays: OpenKruise's own converts the same way.
fn upstream_shaped(ours: &CustomResourceDefinition) -> CustomResourceDefinition {
    let mut crd = ours.clone();
    crd.metadata.managed_fields = None;
    for version in &mut crd.spec.versions {
        version.additional_printer_columns = None;
        let v1beta1 = version.name == "v1beta1";
        let Some(props) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
            .and_then(|root| root.properties.as_mut())
        else {
            continue;
        };
        if let Some(status) = props.get_mut("status") {
            status.required = Some(vec!["observedGeneration".into()]);
            if let Some(fields) = status.properties.as_mut() {
                fields.remove("recorded");
                fields.remove("restored");
                let state = fields
                    .get_mut("podStates")
                    .and_then(|p| p.additional_properties.as_mut());
                if let Some(JSONSchemaPropsOrBool::Schema(state)) = state
                    && let Some(state) = state.properties.as_mut()
                {
                    for field in ["podIPs", "podUID", "nodeUID", "lastRestore"] {
                        state.remove(field);
                    }
                }
            }
        }
        let spec = props.get_mut("spec").and_then(|s| s.properties.as_mut());
        if let (true, Some(spec)) = (v1beta1, spec) {
            if let Some(retention) = spec.get_mut("persistentPodStateRetentionPolicy") {
                retention.enum_ = Some(vec![
                    k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON(
                        json!("WhenScaled"),
                    ),
                    k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON(
                        json!("WhenDeleted"),
                    ),
                ]);
            }
            if let Some(weight) = spec
                .get_mut("preferredPersistentTopology")
                .and_then(|p| p.items.as_mut())
                .and_then(|items| match items {
                    k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrArray::Schema(s) => s.properties.as_mut(),
                    _ => None,
                })
                .and_then(|p| p.get_mut("weight"))
            {
                weight.minimum = Some(0.0);
            }
        }
    }
    crd
}

/// Puts our CRD and validating webhook back, also when the test fails half-way.
struct Switch {
    client: Client,
    ours: CustomResourceDefinition,
    hook: ValidatingWebhookConfiguration,
    done: bool,
}

impl Switch {
    async fn to_ours(
        client: Client,
        ours: CustomResourceDefinition,
        mut hook: ValidatingWebhookConfiguration,
    ) {
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        let mut crd = ours;
        crd.metadata.resource_version = crds.get(CRD).await.ok().and_then(|c| c.resource_version());
        crds.replace(CRD, &PostParams::default(), &crd)
            .await
            .expect("our CRD back");
        hook.metadata.resource_version = None;
        hook.metadata.uid = None;
        hook.metadata.managed_fields = None;
        let hooks: Api<ValidatingWebhookConfiguration> = Api::all(client);
        match hooks.create(&PostParams::default(), &hook).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => panic!("registering the validating webhook again: {e}"),
        }
    }

    async fn finish(mut self) {
        Self::to_ours(self.client.clone(), self.ours.clone(), self.hook.clone()).await;
        self.done = true;
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let (ours, hook) = (self.ours.clone(), self.hook.clone());
        put_back(move |client| Switch::to_ours(client, ours, hook));
    }
}

#[tokio::test]
async fn objects_upstream_accepted_keep_working_after_switching() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-migration").await;
    let crds: Api<CustomResourceDefinition> = Api::all(c.clone());
    let hooks: Api<ValidatingWebhookConfiguration> = Api::all(c.clone());
    let ours = crds.get(CRD).await.expect("our CRD");
    let hook = hooks
        .get("persistent-pod-state")
        .await
        .expect("our validating webhook");

    // The OpenKruise era: upstream's CRD, and upstream's (laxer) validation instead of ours.
    crds.replace(CRD, &PostParams::default(), &upstream_shaped(&ours))
        .await
        .expect("upstream-shaped CRD");
    let switch = Switch {
        client: c.clone(),
        ours,
        hook,
        done: false,
    };
    hooks
        .delete("persistent-pod-state", &DeleteParams::default())
        .await
        .expect("unregister validation");
    let dynamic = |version: &str| {
        let ar = kube::api::ApiResource {
            group: "apps.kruise.io".into(),
            version: version.into(),
            api_version: format!("apps.kruise.io/{version}"),
            kind: "PersistentPodState".into(),
            plural: "persistentpodstates".into(),
        };
        Api::<kube::api::DynamicObject>::namespaced_with(c.clone(), &ns, &ar)
    };
    // The API server drops a deleted webhook configuration from its own cache a moment later:
    // until then a create is still sent to our validation, and denied (nothing is stored).
    let create = |version: &'static str, object: Value| {
        let api = dynamic(version);
        async move {
            let obj: kube::api::DynamicObject = serde_json::from_value(object).expect("object");
            wait_for(
                "the API server to stop calling our validation",
                TIMEOUT,
                || async {
                    match api.create(&PostParams::default(), &obj).await {
                        Ok(_) => Some(()),
                        Err(kube::Error::Api(e))
                            if e.code == 422
                                && e.message.contains(
                                    "admission webhook \"validate-persistentpodstate.",
                                ) =>
                        {
                            None
                        }
                        Err(e) => panic!("upstream accepted it: {e}"),
                    }
                },
            )
            .await;
        }
    };
    // Weight 0, an empty required key list, an empty retention policy (v1alpha1 has no enum).
    create("v1alpha1", json!({
        "apiVersion": "apps.kruise.io/v1alpha1", "kind": "PersistentPodState",
        "metadata": {"name": "web-a"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                 "requiredPersistentTopology": {"nodeTopologyKeys": []},
                 "preferredPersistentTopology": [{"weight": 0, "preference": {"nodeTopologyKeys": [HOST]}}],
                 "persistentPodStateRetentionPolicy": ""}
    }))
    .await;
    // A second PPS for the same workload, weight above 100.
    create("v1beta1", json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
        "metadata": {"name": "web-b"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                 "preferredPersistentTopology": [{"weight": 200, "preference": {"keys": [HOST]}}]}
    }))
    .await;

    // Under upstream's CRD, web-a (stored as v1beta1) holds a retention policy its v1beta1
    // enum does not allow. From 1.30 the API server ratchets its schema validation (an unchanged
    // invalid field does not block an update); before, the object could not be written again.
    let (ok, out) = kubectl(
        &env,
        &["-n", &ns, "label", "pps", "web-a", "era=openkruise"],
        None,
    )
    .await;
    if server_minor(c).await >= 30 {
        assert!(ok, "the API server ratchets the unchanged enum: {out}");
    } else {
        assert!(
            !ok && out.contains("persistentPodStateRetentionPolicy"),
            "{out}"
        );
    }

    // Recorded under upstream's CRD, which keeps none of this service's status fields: the
    // first write shows it, and the status settles (before, every look at web-a wrote the
    // pruned fields again, for ever).
    let (placed, _) = start_recorded_by(c, &ns, &statefulset("web", 2, &[]), "web-a").await;
    let status = pps_api(c, &ns).get("web-a").await.expect("web-a").status;
    assert!(
        status.as_ref().is_some_and(
            |s| s.recorded.is_none() && s.pod_states.values().all(|p| p.pod_uid.is_none())
        ),
        "upstream's schema prunes them: {status:?}"
    );
    // web-a's status writes, as the replicas log them (the metric counts every PPS's).
    let writes_of_web_a = || {
        let mut writes = 0;
        for entry in std::fs::read_dir(env.cluster_dir.join("logs")).expect("logs") {
            let path = entry.expect("a log").path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if name.starts_with("persistent-pod-state-") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                writes += text
                    .lines()
                    .filter(|l| l.contains(&format!("namespace=\"{ns}\" name=web-a ")))
                    .filter(|l| l.contains("status updated"))
                    .count();
            }
        }
        writes
    };
    let looks_now = || async {
        metric(
            &scrape(&env).await,
            "pps_reconcile_duration_seconds_count{controller=\"status\"}",
        )
    };
    let mut looks = looks_now().await;
    let mut writes = None;
    // Looked at again and again for 3 s, longer than a change is held back to gather those
    // that follow it (0.5 s): each look wrote the pruned fields again, at once or after that.
    let started = std::time::Instant::now();
    let mut round = 0;
    while round < 4 || started.elapsed() < std::time::Duration::from_secs(3) {
        // A label changed: web-a looked at again.
        let label = format!("settled={round}");
        let (ok, out) = kubectl(
            &env,
            &["-n", &ns, "label", "pps", "web-a", "--overwrite", &label],
            None,
        )
        .await;
        assert!(ok, "{out}");
        looks = wait_for("web-a looked at again", TIMEOUT, || async {
            let now = looks_now().await;
            (now > looks).then_some(now)
        })
        .await;
        // Counted from the first look on: the write that recorded web-a's pods is logged by
        // then (its reconcile ended before the next began).
        let now = writes_of_web_a();
        let before = *writes.get_or_insert(now);
        assert_eq!(now, before, "written again after {} looks", round + 1);
        round += 1;
    }
    println!(
        "under upstream's CRD: web-a recorded, then looked at {round} times more in {:.1} s, with no write",
        started.elapsed().as_secs_f64()
    );

    // The switch: our CRD and webhook again.
    switch.finish().await;
    crate::support::wait_for("our validating webhook to take effect", TIMEOUT, || async {
        // A new invalid object is refused again (as soon as the registration is in force).
        let bad: kube::api::DynamicObject = serde_json::from_value(json!({
            "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": "probe"},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "probe"},
                     "preferredPersistentTopology": [{"weight": 0, "preference": {"keys": [HOST]}}]}
        }))
        .expect("object");
        match dynamic("v1beta1")
            .create(&PostParams::default(), &bad)
            .await
        {
            Err(kube::Error::Api(e)) if e.message.contains("weight") => Some(()),
            Ok(_) => {
                let _ = dynamic("v1beta1")
                    .delete("probe", &DeleteParams::default())
                    .await;
                None
            }
            Err(_) => None,
        }
    })
    .await;

    // The oldest records; the other records nothing and says why.
    wait_event(c, &ns, "web-b", "DuplicateTarget").await;
    let b = pps_api(c, &ns).get("web-b").await.expect("web-b");
    assert!(
        b.status.is_none_or(|s| s.pod_states.is_empty()),
        "the newer PPS records nothing"
    );
    assert!(
        metric(&scrape(&env).await, "pps_shadowed_persistent_pod_states") >= 1.0,
        "counted as shadowed"
    );

    // Metadata updates pass (ratcheting); a change of a field to an invalid value does not.
    for name in ["web-a", "web-b"] {
        let (ok, out) = kubectl(
            &env,
            &["-n", &ns, "label", "pps", name, "team=storage"],
            None,
        )
        .await;
        assert!(ok, "kubectl label pps {name}: {out}");
    }
    // A spec change that leaves the out-of-range fields (weight 0, an empty key list, an empty
    // retention policy) as they are passes: only what changes is checked.
    let annotate = json!({"spec": {"persistentPodAnnotations": [{"key": "example.com/rack"}]}});
    dynamic("v1beta1")
        .patch("web-a", &PatchParams::default(), &Patch::Merge(&annotate))
        .await
        .expect("an update of the migrated object through ratcheting");
    let reweigh = json!({"spec": {"preferredPersistentTopology": [{"weight": 500, "preference": {"keys": [HOST]}}]}});
    let refused = dynamic("v1beta1")
        .patch("web-a", &PatchParams::default(), &Patch::Merge(&reweigh))
        .await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(e)) if e.message.contains("weight")),
        "an invalid new weight is refused: {refused:?}"
    );

    // Replacing the CRD ended the replicas' PersistentPodState watches (the API server answers
    // 410 Gone once it serves the resource anew): a replica is not ready until it has listed
    // again, and a pod created meanwhile would be admitted without it. Wait for both.
    for r in &env.replicas {
        wait_for(&format!("replica {} ready", r.name), TIMEOUT, || async {
            (http_get(&format!("{}/readyz", r.probe_url())).await.0 == 200).then_some(())
        })
        .await;
    }
    // Our CRD again, the replicas not restarted: web-a's status is written with this
    // service's fields again.
    wait_for(
        "web-a's status with this service's fields again",
        TIMEOUT,
        || async {
            let status = pps_api(c, &ns).get("web-a").await.ok()?.status?;
            status.recorded.map(|_| ())
        },
    )
    .await;
    // A re-created pod runs, steered by the PPS in force.
    let pod: Pod = recreate_pod(c, &ns, "web-0").await;
    assert_eq!(
        pod.annotations()
            .get(INJECTED_ANNOTATION)
            .map(String::as_str),
        Some("web-a")
    );
    println!(
        "web-0 re-created on {} (recorded {}), injected from web-a",
        placement(&pod).map(|p| p.node).unwrap_or_default(),
        placed["web-0"].node
    );
    delete_namespace(c, &ns).await;
}
