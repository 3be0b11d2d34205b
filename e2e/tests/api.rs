//! The API surface: both versions through the conversion webhook, and validation.

use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use kube::{Api, Client};
use serde_json::{Value, json};

use crate::support::*;

fn api(c: &Client, ns: &str, version: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
        "apps.kruise.io",
        version,
        "PersistentPodState",
    ));
    Api::namespaced_with(c.clone(), ns, &ar)
}

fn object(version: &str, name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": format!("apps.kruise.io/{version}"), "kind": "PersistentPodState",
        "metadata": {"name": name}, "spec": spec
    }))
    .expect("object")
}

/// Issue 3.1: create as v1alpha1, read as v1beta1, update as v1beta1, read as v1alpha1.
#[tokio::test]
async fn both_versions_round_trip_through_the_conversion_webhook() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-versions").await;
    let spec = json!({
        "targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
        "requiredPersistentTopology": {"nodeTopologyKeys": ["topology.kubernetes.io/zone"]},
        "preferredPersistentTopology": [{"weight": 40, "preference": {"nodeTopologyKeys": ["kubernetes.io/hostname", "rack"]}}],
        "persistentPodAnnotations": [{"key": "example.com/ip"}],
        "persistentPodStateRetentionPolicy": "WhenDeleted"
    });
    api(c, &ns, "v1alpha1")
        .create(
            &PostParams::default(),
            &object("v1alpha1", "web", spec.clone()),
        )
        .await
        .expect("create v1alpha1");

    let beta = api(c, &ns, "v1beta1")
        .get("web")
        .await
        .expect("read v1beta1");
    assert_eq!(
        beta.data["spec"]["requiredPersistentTopology"],
        json!({"keys": ["topology.kubernetes.io/zone"]})
    );
    assert_eq!(
        beta.data["spec"]["preferredPersistentTopology"][0]["preference"]["keys"],
        json!(["kubernetes.io/hostname", "rack"])
    );
    assert_eq!(
        beta.data["spec"]["persistentPodAnnotations"],
        spec["persistentPodAnnotations"]
    );

    let patch = json!({"spec": {"requiredPersistentTopology": {"keys": ["failure-domain.beta.kubernetes.io/zone"]}}});
    api(c, &ns, "v1beta1")
        .patch("web", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("update v1beta1");

    let alpha = api(c, &ns, "v1alpha1")
        .get("web")
        .await
        .expect("read v1alpha1");
    let mut want = spec.clone();
    want["requiredPersistentTopology"] =
        json!({"nodeTopologyKeys": ["failure-domain.beta.kubernetes.io/zone"]});
    assert_eq!(alpha.data["spec"], want, "nothing lost on the way");
    delete_namespace(c, &ns).await;
}

/// An object recording 8,000 pods (1.1 MB, near the API server's own limit for one object) is
/// read at the other version: the conversion copies its status as text (before, one recording
/// about 6,000 pods with two topology labels each was refused as too complex, and the API server
/// could not read it at the other version at all).
#[tokio::test]
async fn an_object_recording_thousands_of_pods_is_read_at_either_version() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-big-status").await;
    // An Advanced StatefulSet, a kind this cluster does not serve: its states are never pruned.
    let spec = json!({
        "targetRef": {"apiVersion": "apps.kruise.io/v1beta1", "kind": "StatefulSet", "name": "big"},
        "preferredPersistentTopology": [{"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}}]
    });
    let beta = api(c, &ns, "v1beta1");
    beta.create(&PostParams::default(), &object("v1beta1", "big", spec))
        .await
        .expect("create");
    let states: serde_json::Map<String, Value> = (0..8_000)
        .map(|i| {
            let node = format!("node-{i}");
            let labels =
                json!({"kubernetes.io/hostname": node, "topology.kubernetes.io/zone": "zone-a"});
            (
                format!("big-{i}"),
                json!({"nodeName": node, "nodeTopologyLabels": labels}),
            )
        })
        .collect();
    let status = json!({"observedGeneration": 1, "podStates": states});
    beta.patch_status(
        "big",
        &PatchParams::default(),
        &Patch::Merge(&json!({ "status": status })),
    )
    .await
    .expect("status written");
    let alpha = api(c, &ns, "v1alpha1")
        .get("big")
        .await
        .expect("read at v1alpha1, through the conversion webhook");
    // (The leader may have added its count of recorded pods meanwhile.)
    assert_eq!(
        alpha.data["status"]["podStates"], status["podStates"],
        "every state, whole"
    );
    assert_eq!(
        alpha.data["spec"]["preferredPersistentTopology"][0]["preference"],
        json!({"nodeTopologyKeys": ["kubernetes.io/hostname"]})
    );
    let listed = api(c, &ns, "v1alpha1")
        .list(&Default::default())
        .await
        .expect("listed at v1alpha1");
    assert_eq!(listed.items.len(), 1);
    println!(
        "a PersistentPodState recording {} pods ({} bytes) read at v1alpha1",
        states.len(),
        serde_json::to_vec(&alpha.data).map_or(0, |b| b.len())
    );
    delete_namespace(c, &ns).await;
}

async fn rejection(c: &Client, ns: &str, version: &str, name: &str, spec: Value) -> String {
    match api(c, ns, version)
        .create(&PostParams::default(), &object(version, name, spec.clone()))
        .await
    {
        Ok(_) => panic!("{spec} was accepted"),
        Err(kube::Error::Api(e)) => e.message,
        Err(e) => panic!("unexpected error {e}"),
    }
}

/// Issue 3.2: invalid objects are rejected with field paths (by the schema where it can
/// express the rule, by the webhook for the rest), in the client's version.
#[tokio::test]
async fn invalid_pps_are_rejected_with_field_paths() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-validation").await;
    let target = json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"});
    let host = json!({"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}});
    let cases = [
        (
            "v1beta1",
            json!({"targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web"}, "preferredPersistentTopology": [host]}),
            "spec.targetRef",
        ),
        ("v1beta1", json!({"targetRef": target}), "spec"),
        (
            "v1beta1",
            json!({"targetRef": target, "requiredPersistentTopology": {"keys": []}}),
            "spec.requiredPersistentTopology.keys",
        ),
        (
            "v1alpha1",
            json!({"targetRef": target, "requiredPersistentTopology": {"nodeTopologyKeys": ["not a key"]}}),
            "spec.requiredPersistentTopology.nodeTopologyKeys[0]",
        ),
        (
            "v1beta1",
            json!({"targetRef": target, "preferredPersistentTopology": [{"weight": 0, "preference": {"keys": ["a"]}}]}),
            "spec.preferredPersistentTopology[0].weight",
        ),
        (
            "v1beta1",
            json!({"targetRef": target, "preferredPersistentTopology": [{"weight": 101, "preference": {"keys": ["a"]}}]}),
            "spec.preferredPersistentTopology[0].weight",
        ),
        (
            "v1beta1",
            json!({"targetRef": target, "preferredPersistentTopology": [host], "persistentPodAnnotations": [{"key": "bad key!"}]}),
            "spec.persistentPodAnnotations[0].key",
        ),
        (
            "v1beta1",
            json!({"targetRef": target, "preferredPersistentTopology": [host], "persistentPodStateRetentionPolicy": "Sometimes"}),
            "spec.persistentPodStateRetentionPolicy",
        ),
        (
            "v1beta1",
            json!({"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": ""}, "preferredPersistentTopology": [host]}),
            "spec.targetRef.name",
        ),
    ];
    for (i, (version, spec, path)) in cases.into_iter().enumerate() {
        let message = rejection(c, &ns, version, &format!("bad-{i}"), spec.clone()).await;
        // The schema's messages name list fields without an index; the webhook's with one.
        let field = path.split('[').next().unwrap_or(path);
        let leaf = path.rsplit('.').next().unwrap_or(path);
        assert!(
            message.contains(field) && message.contains(leaf),
            "{spec}: {message:?} should name {path}"
        );
    }

    api(c, &ns, "v1beta1")
        .create(
            &PostParams::default(),
            &object(
                "v1beta1",
                "first",
                json!({"targetRef": target, "preferredPersistentTopology": [host]}),
            ),
        )
        .await
        .expect("a valid PPS");
    let message = rejection(
        c,
        &ns,
        "v1beta1",
        "second",
        json!({"targetRef": target, "preferredPersistentTopology": [host]}),
    )
    .await;
    assert!(
        message.contains("spec.targetRef") && message.contains("first"),
        "{message}"
    );

    let moved = json!({"spec": {"targetRef": {"name": "other"}}});
    let err = api(c, &ns, "v1beta1")
        .patch("first", &PatchParams::default(), &Patch::Merge(&moved))
        .await
        .expect_err("targetRef is immutable");
    assert!(
        err.to_string()
            .contains("spec.targetRef: Invalid value: field is immutable"),
        "{err}"
    );
    delete_namespace(c, &ns).await;
}

/// A PersistentPodState CREATE checks uniqueness against the API server, not the cache: a
/// second one for a workload is refused the moment after the first is created, and accepted the
/// moment after it is deleted. Where the API server selects by the CRD's `spec.targetRef.name`
/// (>= 1.31) that read is narrowed to the workload's name; where it does not (v1.20, whose CRD
/// is installed without the field) the webhook reads the namespace's list, with the same answers.
#[tokio::test]
async fn pps_uniqueness_is_read_live_and_narrowed_to_the_target_where_the_server_can() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-unique").await;
    let host = json!({"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}});
    let spec = |api_version: &str, name: &str| {
        json!({"targetRef": {"apiVersion": api_version, "kind": "StatefulSet", "name": name},
               "preferredPersistentTopology": [host]})
    };
    let pps = api(c, &ns, "v1beta1");
    let create = |name: &'static str, spec: Value| {
        let pps = pps.clone();
        async move {
            pps.create(&PostParams::default(), &object("v1beta1", name, spec))
                .await
        }
    };
    create("db", spec("apps/v1", "db")).await.expect("db");
    create("first", spec("apps/v1", "web"))
        .await
        .expect("first");
    // The same name, another kind (an Advanced StatefulSet): not the same workload.
    create("advanced", spec("apps.kruise.io/v1beta1", "web"))
        .await
        .expect("an Advanced StatefulSet of the same name is another workload");

    // What the API server selects by the target's name.
    let selected = pps
        .list(&kube::api::ListParams::default().fields("spec.targetRef.name=web"))
        .await;
    if server_minor(c).await >= 31 {
        let mut names: Vec<String> = selected
            .expect("the CRD's selectable field")
            .items
            .into_iter()
            .filter_map(|o| o.metadata.name)
            .collect();
        names.sort();
        assert_eq!(names, ["advanced", "first"]);
    } else {
        match selected {
            Err(kube::Error::Api(e)) => assert_eq!(e.code, 400, "{e:?}"),
            other => panic!("this API server selects custom resources by spec fields: {other:?}"),
        }
    }

    match create("second", spec("apps/v1", "web")).await {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains("spec.targetRef") && e.message.contains("\"first\""),
            "{e:?}"
        ),
        other => panic!("a second PersistentPodState for web: {other:?}"),
    }
    pps.delete("first", &kube::api::DeleteParams::default())
        .await
        .expect("delete first");
    // Gone from the API server (no finalizer): accepted at once, whatever the cache holds.
    create("second", spec("apps/v1", "web"))
        .await
        .expect("the only PersistentPodState for web once first is deleted");
    delete_namespace(c, &ns).await;
}

/// The pod cache reads pods as protobuf (src/state/proto.rs, its messages numbered by hand):
/// every pod of a StatefulSet, listed streamed and in pages and then watched, is kept exactly
/// as the same pod read as JSON from the same API server.
#[tokio::test]
async fn pods_read_as_protobuf_are_kept_as_pods_read_as_json() {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Pod;
    use kube::runtime::watcher;
    use persistent_pod_state::state::Source;
    use persistent_pod_state::state::proto::PodSource;
    use persistent_pod_state::state::trim::CachedPod;
    use std::collections::BTreeMap;

    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-protobuf").await;
    create_sts(c, &ns, &statefulset("web", 2, &[])).await;
    wait_sts_rolled(c, &ns, "web", 2).await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    pods.patch(
        "web-0",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"example.com/kept": "yes"}}})),
    )
    .await
    .expect("annotate web-0");
    let as_json = |list: Vec<Pod>| -> BTreeMap<String, CachedPod> {
        list.into_iter()
            .map(|p| {
                (
                    p.metadata.name.clone().unwrap_or_default(),
                    CachedPod::from(p),
                )
            })
            .collect()
    };
    let source = PodSource::new(c.clone());
    /// The next event, within [`TIMEOUT`]; none missing, no error.
    async fn next<T>(
        events: &mut (impl futures::Stream<Item = watcher::Result<T>> + Unpin),
        what: &str,
    ) -> T {
        tokio::time::timeout(TIMEOUT, events.next())
            .await
            .unwrap_or_else(|_| panic!("{what} in time"))
            .unwrap_or_else(|| panic!("{what}: the stream ended"))
            .unwrap_or_else(|e| panic!("{what}: {e}"))
    }
    for (round, config) in [
        watcher::Config::default().streaming_lists(),
        watcher::Config::default().page_size(1),
    ]
    .into_iter()
    .enumerate()
    {
        let json_pods = as_json(pods.list(&Default::default()).await.expect("list").items);
        assert_eq!(json_pods.len(), 2, "{json_pods:?}");
        let mut events = source.events(config);
        let mut listed = BTreeMap::new();
        loop {
            match next(&mut events, "the protobuf list").await {
                watcher::Event::InitApply(w) if *w.pod.namespace == *ns => {
                    listed.insert(w.pod.name.to_string(), w.pod);
                }
                watcher::Event::InitDone => break,
                _ => {}
            }
        }
        assert_eq!(listed, json_pods);
        assert!(!source.as_json(), "the API server answered protobuf");
        // A change is watched as JSON sees it.
        pods.patch(
            "web-1",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {"example.com/round": round.to_string()}}}),
            ),
        )
        .await
        .expect("annotate web-1");
        let expected = CachedPod::from(pods.get("web-1").await.expect("web-1"));
        loop {
            if let watcher::Event::Apply(w) = next(&mut events, "the change watched").await
                && w.pod == expected
            {
                break;
            }
        }
    }
    delete_namespace(c, &ns).await;
}
