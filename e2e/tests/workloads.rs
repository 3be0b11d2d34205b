//! Workloads beyond apps/v1: Kruise's Advanced StatefulSet (its CRD installed after start) and
//! custom StatefulSet-like kinds from a configuration file re-read without restart; persistent
//! annotations.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use kube::{Api, Client, ResourceExt};
use persistent_pod_state::api::INJECTED_ANNOTATION;
use serde_json::json;

use crate::support::*;

const SLOT: &str = "e2e.example.com/slot";
/// An annotation named by no PersistentPodState until the custom-workload test names it.
const OTHER: &str = "e2e.example.com/other";

fn dynamic(
    c: &Client,
    ns: &str,
    api_version: &str,
    kind: &str,
    plural: &str,
) -> Api<DynamicObject> {
    let (group, version) = api_version.split_once('/').expect("group/version");
    let ar = ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: api_version.into(),
        kind: kind.into(),
        plural: plural.into(),
    };
    Api::namespaced_with(c.clone(), ns, &ar)
}

/// Creates a workload pod the way its controller would: named `<workload>-<ordinal>`, with a
/// controller ownerReference.
async fn create_owned_pod(
    c: &Client,
    ns: &str,
    owner: &DynamicObject,
    name: &str,
    annotations: &[(&str, &str)],
) -> Pod {
    let types = owner.types.as_ref().expect("types");
    let annotations: BTreeMap<&str, &str> = annotations.iter().copied().collect();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations, "ownerReferences": [{
            "apiVersion": types.api_version, "kind": types.kind, "name": owner.name_any(),
            "uid": owner.uid().expect("uid"), "controller": true}]},
        "spec": {"terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "c", "image": "cilium/echoserver:latest"}]}
    }))
    .expect("pod");
    Api::<Pod>::namespaced(c.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .expect("create pod")
}

async fn delete_pod_and_wait(c: &Client, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(c.clone(), ns);
    pods.delete(name, &DeleteParams::default())
        .await
        .expect("delete pod");
    wait_for(&format!("{name} gone"), TIMEOUT, || async {
        pods.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await;
}

/// Issue 3.3: an Advanced StatefulSet whose CRD appears after start; reserveOrdinals and
/// ordinals.start decide which states are kept.
#[tokio::test]
async fn advanced_statefulset_after_its_crd_appears_with_reserved_ordinals_and_start() {
    let env = env().await;
    let c = &env.client;
    install_crd(
        c,
        "apps.kruise.io",
        "StatefulSet",
        "statefulsets",
        &[("v1beta1", true), ("v1alpha1", false)],
    )
    .await;
    let ns = namespace(c, "e2e-asts").await;
    let api = dynamic(
        c,
        &ns,
        "apps.kruise.io/v1beta1",
        "StatefulSet",
        "statefulsets",
    );
    let asts: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "StatefulSet",
        "metadata": {"name": "asts", "annotations": {
            "kruise.io/auto-generate-persistent-pod-state": "true",
            "kruise.io/preferred-persistent-topology": HOST}},
        "spec": {"replicas": 3, "reserveOrdinals": [1], "selector": {"matchLabels": {"app": "asts"}},
                 "template": {"metadata": {"labels": {"app": "asts"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}
    }))
    .expect("asts");
    let asts = api
        .create(&PostParams::default(), &asts)
        .await
        .expect("create asts");
    wait_for(
        "the PPS generated for the Advanced StatefulSet",
        TIMEOUT,
        || async { pps_api(c, &ns).get_opt("asts").await.ok()? },
    )
    .await;

    // A replica started without a custom-workload file discovers the kind too.
    let kubeconfig = env.cluster_dir.join("kubeconfig");
    let mut plain = tokio::process::Command::from(serve_command(&env, &kubeconfig, 19448, 18085))
        .kill_on_drop(true)
        .spawn()
        .expect("serve");
    wait_for(
        "a replica without a config file to watch the Advanced StatefulSet",
        TIMEOUT,
        || async {
            let (code, text) = http_get("http://127.0.0.1:18085/metrics").await;
            (code == 200 && metric(&text, "pps_watched_workload_kinds ") == 2.0).then_some(())
        },
    )
    .await;
    plain.kill().await.expect("stop");

    let names: Vec<String> = ["asts-0", "asts-2", "asts-3"].map(String::from).to_vec();
    for name in &names {
        create_owned_pod(c, &ns, &asts, name, &[]).await;
    }
    let before = placements(c, &ns, &names).await;
    wait_states(c, &ns, "asts", &before).await;

    delete_pod_and_wait(c, &ns, "asts-2").await;
    create_owned_pod(c, &ns, &asts, "asts-2", &[]).await;
    let after = placements(c, &ns, &["asts-2".to_string()]).await;
    let pod = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("asts-2")
        .await
        .expect("pod");
    assert_eq!(
        pod.annotations()
            .get(INJECTED_ANNOTATION)
            .map(String::as_str),
        Some("asts")
    );
    assert_eq!(
        (&after["asts-2"].node, &after["asts-2"].ip),
        (&before["asts-2"].node, &before["asts-2"].ip)
    );

    // replicas 2 with ordinal 1 reserved: live ordinals are 0 and 2; asts-3 goes.
    api.patch(
        "asts",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 2}})),
    )
    .await
    .expect("scale");
    delete_pod_and_wait(c, &ns, "asts-3").await;
    wait_state_names(c, &ns, "asts", &["asts-0", "asts-2"]).await;

    // ordinals.start 2, nothing reserved: live ordinals are 2 and 3; asts-0 goes.
    let patch = json!({"spec": {"reserveOrdinals": null, "ordinals": {"start": 2}}});
    api.patch("asts", &PatchParams::default(), &Patch::Merge(patch))
        .await
        .expect("start ordinal");
    delete_pod_and_wait(c, &ns, "asts-0").await;
    wait_state_names(c, &ns, "asts", &["asts-2"]).await;
    delete_namespace(c, &ns).await;
}

/// Issues 3.4 and 3.5: a custom kind handled once the configuration file lists it (no restart);
/// persistent annotations recorded and given back, never over the pod's own; changing the
/// workload's annotation list updates its PPS.
#[tokio::test]
async fn custom_workload_from_the_config_file_and_persistent_annotations() {
    let env = env().await;
    let c = &env.client;
    install_crd(c, "example.com", "Ring", "rings", &[("v1", true)]).await;
    let ns = namespace(c, "e2e-custom").await;
    // As docs/install.md says: the replicas (the manifests' ServiceAccount) may list and watch
    // the custom kind once a ClusterRole labelled for aggregation grants it.
    let rbac: k8s_openapi::api::rbac::v1::ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": "e2e-rings", "labels": {
            "persistent-pod-state.apps.kruise.io/aggregate-to-controller": "true"}},
        "rules": [{"apiGroups": ["example.com"], "resources": ["rings"], "verbs": ["list", "watch"]}]
    }))
    .expect("cluster role");
    match Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(c.clone())
        .create(&PostParams::default(), &rbac)
        .await
    {
        Ok(_) | Err(kube::Error::Api(_)) => {}
        Err(e) => panic!("{e}"),
    }
    // The controller-manager aggregates it (after the soak's API server restarts its watches
    // may take a while): the replicas are told of the kind only once they may watch it, so
    // that none is refused (the suite checks the replicas' logs for refusals).
    let sa = "--as=system:serviceaccount:persistent-pod-state:persistent-pod-state";
    wait_for(
        "the aggregated ClusterRole to grant rings",
        TIMEOUT,
        || async {
            let (_, answer) = kubectl(
                &env,
                &["auth", "can-i", "watch", "rings.example.com", sa, "-A"],
                None,
            )
            .await;
            (answer.lines().next().unwrap_or_default().trim() == "yes").then_some(())
        },
    )
    .await;
    let config = env.cluster_dir.join("custom-workloads.yaml");
    std::fs::write(&config, "customWorkloads: []\n").expect("config");

    // Not configured: a PPS targeting a Ring is refused.
    let target = json!({"apiVersion": "example.com/v1", "kind": "Ring", "name": "probe"});
    let probe = |name: &str| -> persistent_pod_state::api::PersistentPodState {
        serde_json::from_value(
            json!({"apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": name}, "spec": {"targetRef": target,
            "preferredPersistentTopology": [{"weight": 1, "preference": {"keys": [HOST]}}]}}),
        )
        .expect("pps")
    };
    let pps: Api<persistent_pod_state::api::PersistentPodState> = Api::namespaced(c.clone(), &ns);
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let refused = pps
        .create(&dry, &probe("probe"))
        .await
        .expect_err("Ring is not configured");
    assert!(
        refused.to_string().contains("Unsupported value"),
        "{refused}"
    );

    std::fs::write(&config, "customWorkloads:\n- example.com/Ring\n").expect("config");
    // Both replicas re-read the file: a few dry runs in a row (spread over them) succeed.
    wait_for("every replica to accept Ring targets", TIMEOUT, || async {
        for _ in 0..4 {
            pps.create(&dry, &probe("probe")).await.ok()?;
        }
        Some(())
    })
    .await;

    let rings = dynamic(c, &ns, "example.com/v1", "Ring", "rings");
    let ring: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "example.com/v1", "kind": "Ring",
        "metadata": {"name": "ring", "annotations": {
            "kruise.io/auto-generate-persistent-pod-state": "true",
            "kruise.io/preferred-persistent-topology": HOST,
            "kruise.io/persistent-pod-annotations": SLOT}},
        "spec": {"replicas": 2}
    }))
    .expect("ring");
    let ring = rings
        .create(&PostParams::default(), &ring)
        .await
        .expect("create ring");
    wait_for("the PPS generated for the Ring", TIMEOUT, || async {
        pps.get_opt("ring").await.ok()?
    })
    .await;
    create_owned_pod(c, &ns, &ring, "ring-0", &[(SLOT, "s0")]).await;
    create_owned_pod(c, &ns, &ring, "ring-1", &[(SLOT, "s1")]).await;
    let names = pod_names("ring", 2);
    let before = placements(c, &ns, &names).await;
    let states = wait_states(c, &ns, "ring", &before).await;
    assert_eq!(
        states["ring-1"].annotations.get(SLOT).map(String::as_str),
        Some("s1")
    );

    // Re-created without the annotation: it is given back. With its own value: that stays.
    delete_pod_and_wait(c, &ns, "ring-1").await;
    let created = create_owned_pod(c, &ns, &ring, "ring-1", &[]).await;
    assert_eq!(
        created.annotations().get(SLOT).map(String::as_str),
        Some("s1"),
        "annotation re-injected"
    );
    delete_pod_and_wait(c, &ns, "ring-0").await;
    // Also carrying an annotation no PersistentPodState names yet (so not cached).
    let created = create_owned_pod(c, &ns, &ring, "ring-0", &[(SLOT, "mine"), (OTHER, "o0")]).await;
    assert_eq!(
        created.annotations().get(SLOT).map(String::as_str),
        Some("mine"),
        "the pod's own value stays"
    );
    let after = placements(c, &ns, &names).await;
    for pod in &names {
        assert_eq!(
            (&after[pod].node, &after[pod].ip),
            (&before[pod].node, &before[pod].ip),
            "{pod} kept node and IP"
        );
    }

    let more = json!({"metadata": {"annotations": {"kruise.io/persistent-pod-annotations": format!("{SLOT},{OTHER}")}}});
    rings
        .patch("ring", &PatchParams::default(), &Patch::Merge(more))
        .await
        .expect("annotate");
    wait_for(
        "the PPS to follow the new annotation list",
        TIMEOUT,
        || async {
            (pps.get_opt("ring")
                .await
                .ok()??
                .spec
                .persistent_pod_annotations
                .len()
                == 2)
                .then_some(())
        },
    )
    .await;
    // The pods are listed again to read the newly named annotation, and it is recorded.
    wait_for("the newly named annotation recorded", TIMEOUT, || async {
        let status = pps.get_opt("ring").await.ok()??.status?;
        (status.pod_states.get("ring-0")?.annotations.get(OTHER)? == "o0").then_some(())
    })
    .await;
    std::fs::write(&config, "customWorkloads: []\n").expect("config");
    delete_namespace(c, &ns).await;
}

/// Issue 3.5: a PPS that persists only annotations works (upstream bug 1).
#[tokio::test]
async fn upstream_bug_1_a_pps_persisting_only_annotations_gives_them_back() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-annotations").await;
    let pps: Api<persistent_pod_state::api::PersistentPodState> = Api::namespaced(c.clone(), &ns);
    pps.create(&PostParams::default(), &serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState", "metadata": {"name": "web"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                 "persistentPodAnnotations": [{"key": SLOT}]}
    })).expect("pps"))
    .await
    .expect("an annotations-only PPS is valid");
    let mut sts = statefulset("web", 1, &[]);
    let template = sts
        .spec
        .as_mut()
        .and_then(|s| s.template.metadata.as_mut())
        .expect("template metadata");
    template
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(SLOT.into(), "from-template".into());
    let (_, states) = start_recorded(c, &ns, &sts).await;
    assert_eq!(
        states["web-0"].annotations.get(SLOT).map(String::as_str),
        Some("from-template")
    );
    // The annotation changes on the live pod (as an operator or a sidecar would)...
    let recorded = |value: &'static str| {
        let pps = pps.clone();
        async move {
            wait_for(&format!("{value} recorded"), TIMEOUT, || async {
                let s = pps.get_opt("web").await.ok()??.status?;
                (s.pod_states.get("web-0")?.annotations.get(SLOT)? == value).then_some(())
            })
            .await;
        }
    };
    let annotate = || async {
        Api::<Pod>::namespaced(c.clone(), &ns)
            .patch(
                "web-0",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {SLOT: "runtime"}}})),
            )
            .await
            .expect("annotate pod");
    };
    annotate().await;
    recorded("runtime").await;
    // ...and the template's value is what a re-created pod asks for: the pod's own value wins,
    // so nothing is added and the pod is not marked as injected.
    let pod = recreate_pod(c, &ns, "web-0").await;
    assert_eq!(
        pod.annotations().get(SLOT).map(String::as_str),
        Some("from-template")
    );
    assert_eq!(pod.annotations().get(INJECTED_ANNOTATION), None);
    // Once the template no longer sets it, the rolled pod gets the recorded value back (the
    // one its predecessor ran with), and is marked.
    recorded("from-template").await;
    annotate().await;
    recorded("runtime").await;
    let before = pod.uid();
    Api::<k8s_openapi::api::apps::v1::StatefulSet>::namespaced(c.clone(), &ns)
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"template": {"metadata": {"annotations": {SLOT: null}}}}}),
            ),
        )
        .await
        .expect("drop the annotation from the template");
    let rolled = wait_for("web-0 rolled to the new template", TIMEOUT, || async {
        let pod = Api::<Pod>::namespaced(c.clone(), &ns)
            .get_opt("web-0")
            .await
            .ok()??;
        (pod.uid() != before).then_some(pod)
    })
    .await;
    assert_eq!(
        rolled.annotations().get(SLOT).map(String::as_str),
        Some("runtime"),
        "given back"
    );
    assert_eq!(
        rolled
            .annotations()
            .get(INJECTED_ANNOTATION)
            .map(String::as_str),
        Some("web")
    );
    delete_namespace(c, &ns).await;
}
