//! Retention of states on scale-in and workload deletion; generated versus hand-made
//! PersistentPodStates.

use k8s_openapi::api::apps::v1::StatefulSet;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use persistent_pod_state::api::v1alpha1::PersistentPodState;
use serde_json::json;

use crate::support::*;

const GENERATE: [(&str, &str); 2] = [
    ("kruise.io/auto-generate-persistent-pod-state", "true"),
    ("kruise.io/preferred-persistent-topology", HOST),
];

fn hand_made(name: &str, target: &str, retention: Option<&str>) -> PersistentPodState {
    serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1alpha1", "kind": "PersistentPodState",
        "metadata": {"name": name},
        "spec": {
            "targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": target},
            "preferredPersistentTopology": [{"weight": 100, "preference": {"nodeTopologyKeys": [HOST]}}],
            "persistentPodStateRetentionPolicy": retention,
        }
    }))
    .expect("pps")
}

async fn set_annotations(c: &Client, ns: &str, name: &str, annotations: serde_json::Value) {
    patch_sts(
        c,
        ns,
        name,
        json!({"metadata": {"annotations": annotations}}),
    )
    .await;
}

async fn wait_gone(c: &Client, ns: &str, name: &str) {
    let api = pps_api(c, ns);
    wait_for(
        &format!("PersistentPodState {ns}/{name} to be deleted"),
        TIMEOUT,
        || async { api.get_opt(name).await.ok()?.is_none().then_some(()) },
    )
    .await;
}

/// 7e: scale 3 -> 1 leaves 1 state under WhenScaled and 3 under WhenDeleted; deleting the
/// StatefulSets removes the generated PPS and leaves the hand-made one (its status cleared).
#[tokio::test]
async fn scale_in_prunes_under_when_scaled_only_and_deletion_removes_generated_pps_only() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-retention").await;
    start_recorded(c, &ns, &statefulset("scaled", 3, &GENERATE)).await;
    pps_api(c, &ns)
        .create(
            &PostParams::default(),
            &hand_made("kept", "kept", Some("WhenDeleted")),
        )
        .await
        .expect("hand-made pps");
    start_recorded(c, &ns, &statefulset("kept", 3, &[])).await;

    scale(c, &ns, "scaled", 1).await;
    scale(c, &ns, "kept", 1).await;
    wait_sts_rolled(c, &ns, "scaled", 1).await;
    wait_sts_rolled(c, &ns, "kept", 1).await;
    wait_state_names(c, &ns, "scaled", &["scaled-0"]).await;
    // Both pod sets are gone and "scaled" was pruned from the same events: "kept" must not be.
    wait_event(c, &ns, "scaled", "StatesRecorded").await;
    wait_event(c, &ns, "scaled", "StatesPruned").await;
    let kept = pps_api(c, &ns).get("kept").await.expect("kept");
    assert_eq!(
        kept.status.expect("status").pod_states.len(),
        3,
        "WhenDeleted keeps every state"
    );

    let sts_api: Api<StatefulSet> = Api::namespaced(c.clone(), &ns);
    sts_api
        .delete("scaled", &DeleteParams::background())
        .await
        .expect("delete scaled");
    sts_api
        .delete("kept", &DeleteParams::background())
        .await
        .expect("delete kept");
    wait_gone(c, &ns, "scaled").await;
    wait_state_names(c, &ns, "kept", &[]).await;
    assert!(
        pps_api(c, &ns)
            .get_opt("kept")
            .await
            .expect("get")
            .is_some(),
        "hand-made PPS stays"
    );
    delete_namespace(c, &ns).await;
}

/// A StatefulSet deleted with `--cascade=orphan` (to be created again with other claim
/// templates) leaves its pods running: each keeps its state until it is gone (OpenKruise clears
/// them all), and the StatefulSet created again steers a re-created pod back to its node.
#[tokio::test]
async fn a_statefulset_deleted_leaving_its_pods_keeps_their_states_for_the_one_created_again() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-orphan").await;
    pps_api(c, &ns)
        .create(&PostParams::default(), &hand_made("orphan", "orphan", None))
        .await
        .expect("hand-made pps");
    let sts = statefulset("orphan", 3, &[]);
    let (placed, _) = start_recorded(c, &ns, &sts).await;

    let sts_api: Api<StatefulSet> = Api::namespaced(c.clone(), &ns);
    sts_api
        .delete("orphan", &DeleteParams::orphan())
        .await
        .expect("delete leaving the pods");
    wait_for("the StatefulSet to be gone", TIMEOUT, || async {
        sts_api
            .get_opt("orphan")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    // One of the pods left behind goes: its state goes with it, the others' stay.
    force_delete_pod(c, &ns, "orphan-2").await;
    wait_state_names(c, &ns, "orphan", &["orphan-0", "orphan-1"]).await;

    create_sts(c, &ns, &sts).await;
    wait_sts_rolled(c, &ns, "orphan", 3).await;
    let pod = recreate_pod(c, &ns, "orphan-1").await;
    assert_steered_back(&pod, "orphan", &placed["orphan-1"]);
    delete_namespace(c, &ns).await;
}

/// Auto-generation follows the annotations; a hand-made PPS with the workload's name is never
/// overwritten nor deleted.
#[tokio::test]
async fn generation_follows_annotations_and_never_touches_hand_made_pps() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-generation").await;
    let api = pps_api(c, &ns);

    create_sts(c, &ns, &statefulset("auto", 1, &GENERATE)).await;
    wait_for("generated PPS", TIMEOUT, || async {
        api.get_opt("auto").await.ok()?
    })
    .await;
    set_annotations(
        c,
        &ns,
        "auto",
        json!({"kruise.io/required-persistent-topology": "topology.kubernetes.io/zone",
        "kruise.io/persistent-pod-annotations": "io.kubernetes.cri/reserved-ip-duration"}),
    )
    .await;
    wait_for(
        "generated PPS to follow the new annotations",
        TIMEOUT,
        || async {
            let spec = api.get_opt("auto").await.ok()??.spec;
            let required = spec.required_persistent_topology?.node_topology_keys;
            (required == ["topology.kubernetes.io/zone"]
                && spec.persistent_pod_annotations.len() == 1)
                .then_some(())
        },
    )
    .await;
    set_annotations(
        c,
        &ns,
        "auto",
        json!({"kruise.io/auto-generate-persistent-pod-state": null}),
    )
    .await;
    wait_gone(c, &ns, "auto").await;

    let manual = hand_made("manual", "manual", None);
    api.create(&PostParams::default(), &manual)
        .await
        .expect("hand-made pps");
    // The controller has processed the workload once the hand-made PPS recorded its pod.
    start_recorded(
        c,
        &ns,
        &statefulset(
            "manual",
            1,
            &[
                ("kruise.io/auto-generate-persistent-pod-state", "true"),
                (
                    "kruise.io/required-persistent-topology",
                    "topology.kubernetes.io/zone",
                ),
            ],
        ),
    )
    .await;
    set_annotations(
        c,
        &ns,
        "manual",
        json!({"kruise.io/auto-generate-persistent-pod-state": null}),
    )
    .await;
    // Another workload's generation round trip shows the controller has caught up.
    create_sts(c, &ns, &statefulset("probe", 1, &GENERATE)).await;
    wait_for("probe PPS", TIMEOUT, || async {
        api.get_opt("probe").await.ok()?
    })
    .await;
    let now = api.get("manual").await.expect("hand-made PPS still exists");
    assert_eq!(now.spec, manual.spec, "hand-made spec untouched");
    assert!(now.metadata.owner_references.unwrap_or_default().is_empty());
    delete_namespace(c, &ns).await;
}

/// Issue 8.5: a user's edit of what the annotations cannot express (the retention policy) is
/// kept, and once the generated PPS is as asked the generator sends nothing at all: its
/// reconciles go on (an unrelated annotation triggers one) without a request or a new
/// generation.
#[tokio::test]
async fn a_users_edit_of_a_generated_pps_stays_and_the_steady_state_writes_nothing() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-generator-steady").await;
    let api = pps_api(c, &ns);
    create_sts(c, &ns, &statefulset("steady", 1, &GENERATE)).await;
    wait_for("generated PPS", TIMEOUT, || async {
        api.get_opt("steady").await.ok()?
    })
    .await;
    api.patch(
        "steady",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"persistentPodStateRetentionPolicy": "WhenDeleted"}})),
    )
    .await
    .expect("the user's edit");
    let generation = api.get("steady").await.expect("pps").metadata.generation;
    let sent = generator_writes_over_reconciles(&env, &ns, "steady", 3).await;
    let now = api.get("steady").await.expect("pps");
    assert_eq!(
        now.spec
            .persistent_pod_state_retention_policy
            .map(|r| format!("{r:?}")),
        Some("WhenDeleted".to_string()),
        "the user's retention policy stays"
    );
    assert_eq!(now.metadata.generation, generation, "no new generation");
    assert_eq!(sent, 0.0, "the generator sent nothing");
    println!(
        "3 generator reconciles of an up-to-date PPS: {sent} requests, generation {generation:?} unchanged"
    );
    delete_namespace(c, &ns).await;
}

/// Writes the generator sent while the workload `sts` was annotated `rounds` times with an
/// unrelated annotation, each time once a generator reconcile followed.
async fn generator_writes_over_reconciles(env: &Env, ns: &str, sts: &str, rounds: usize) -> f64 {
    let reconciles = "pps_reconcile_duration_seconds_count{controller=\"generator\"}";
    let writes = |text: &str| {
        metric(text, "pps_generator_writes_total{action=\"apply\"}")
            + metric(text, "pps_generator_writes_total{action=\"delete\"}")
    };
    let before = scrape(env).await;
    for round in 0..rounds {
        let seen = metric(&scrape(env).await, reconciles);
        set_annotations(
            &env.client,
            ns,
            sts,
            json!({"example.com/unrelated": round.to_string()}),
        )
        .await;
        wait_for(
            "a generator reconcile of the annotated workload",
            TIMEOUT,
            || async { (metric(&scrape(env).await, reconciles) > seen).then_some(()) },
        )
        .await;
    }
    writes(&scrape(env).await) - writes(&before)
}

/// Issue 19.5: every annotation removed from a workload is removed from its generated PPS
/// (whoever wrote the field first), and then later workload events send nothing.
#[tokio::test]
async fn an_annotation_removed_from_the_workload_leaves_the_pps_and_then_nothing_is_sent() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-generator-follow").await;
    let api = pps_api(c, &ns);
    const REQUIRED: &str = "kruise.io/required-persistent-topology";
    const PREFERRED: &str = "kruise.io/preferred-persistent-topology";
    const ANNOTATIONS: &str = "kruise.io/persistent-pod-annotations";
    const IP: &str = "persistent-pod-state.io/ip-request";
    create_sts(
        c,
        &ns,
        &statefulset(
            "follow",
            1,
            &[
                ("kruise.io/auto-generate-persistent-pod-state", "true"),
                (REQUIRED, "topology.kubernetes.io/zone"),
                (PREFERRED, HOST),
                (ANNOTATIONS, "example.com/slot"),
                (IP, "calico"),
            ],
        ),
    )
    .await;
    // What the generated PPS holds of each annotation.
    let holds = |pps: &PersistentPodState, annotation: &str| -> bool {
        let spec = &pps.spec;
        match annotation {
            REQUIRED => spec.required_persistent_topology.is_some(),
            PREFERRED => !spec.preferred_persistent_topology.is_empty(),
            ANNOTATIONS => !spec.persistent_pod_annotations.is_empty(),
            _ => pps
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(IP)),
        }
    };
    let all = [PREFERRED, ANNOTATIONS, IP, REQUIRED];
    wait_for("the generated PPS with every field", TIMEOUT, || async {
        let pps = api.get_opt("follow").await.ok()??;
        all.iter().all(|a| holds(&pps, a)).then_some(())
    })
    .await;
    for removed in all {
        if removed == REQUIRED {
            // A PPS needs a topology: the preferred one comes back before the required goes.
            set_annotations(c, &ns, "follow", json!({ PREFERRED: HOST })).await;
        }
        set_annotations(c, &ns, "follow", json!({ removed: null })).await;
        wait_for(&format!("{removed} to leave the PPS"), TIMEOUT, || async {
            let pps = api.get_opt("follow").await.ok()??;
            (!holds(&pps, removed)).then_some(())
        })
        .await;
    }
    let pps = api.get("follow").await.expect("pps");
    assert!(
        holds(&pps, PREFERRED) && !holds(&pps, REQUIRED),
        "{:?}",
        pps.spec
    );
    let sent = generator_writes_over_reconciles(&env, &ns, "follow", 3).await;
    assert_eq!(
        sent, 0.0,
        "nothing sent once the PPS follows the annotations"
    );
    delete_namespace(c, &ns).await;
}
