//! The API surface: both versions through the conversion webhook, and validation.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
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
/// could not read it at the other version at all). Four of them are listed at the other version
/// too: 4.3 MB, more than a conversion request may be (3 MiB), which the API server does not send
/// in one.
#[tokio::test]
async fn an_object_recording_thousands_of_pods_is_read_at_either_version() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-big-status").await;
    let beta = api(c, &ns, "v1beta1");
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
    let names: Vec<String> = (0..4).map(|i| format!("big-{i}")).collect();
    for name in &names {
        // An Advanced StatefulSet, a kind this cluster does not serve: its states are never
        // pruned.
        let spec = json!({
            "targetRef": {"apiVersion": "apps.kruise.io/v1beta1", "kind": "StatefulSet", "name": name},
            "preferredPersistentTopology": [{"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}}]
        });
        beta.create(&PostParams::default(), &object("v1beta1", name, spec))
            .await
            .expect("create");
        beta.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": status })),
        )
        .await
        .expect("status written");
    }
    let alpha = api(c, &ns, "v1alpha1")
        .get(&names[0])
        .await
        .expect("read at v1alpha1, through the conversion webhook");
    // (The leader may have added its count of recorded pods meanwhile.)
    let converted = |o: &DynamicObject| {
        assert_eq!(
            o.data["status"]["podStates"], status["podStates"],
            "every state, whole"
        );
        assert_eq!(
            o.data["spec"]["preferredPersistentTopology"][0]["preference"],
            json!({"nodeTopologyKeys": ["kubernetes.io/hostname"]})
        );
    };
    converted(&alpha);
    let listed = api(c, &ns, "v1alpha1")
        .list(&Default::default())
        .await
        .expect("listed at v1alpha1");
    assert_eq!(listed.items.len(), names.len());
    listed.items.iter().for_each(converted);
    let bytes = |o: &DynamicObject| serde_json::to_vec(o).map_or(0, |b| b.len());
    println!(
        "a PersistentPodState recording {} pods ({} bytes) read at v1alpha1, {} of them listed ({} bytes)",
        states.len(),
        bytes(&alpha),
        listed.items.len(),
        listed.items.iter().map(bytes).sum::<usize>()
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
/// moment after it is deleted, or while it is being deleted (held by a finalizer). Where the API server selects by the CRD's `spec.targetRef.name`
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
    // Being deleted, held by a finalizer, one steers no pod: its replacement is accepted while
    // it is still there.
    let mut held = object("v1beta1", "held", spec("apps/v1", "app"));
    held.metadata.finalizers = Some(vec!["e2e.example.com/hold".into()]);
    pps.create(&PostParams::default(), &held)
        .await
        .expect("held");
    pps.delete("held", &kube::api::DeleteParams::default())
        .await
        .expect("delete held");
    create("replacement", spec("apps/v1", "app"))
        .await
        .expect("the replacement of one being deleted");
    pps.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .expect("its finalizer removed");
    delete_namespace(c, &ns).await;
}

/// The pod cache reads pods as protobuf (src/state/proto.rs, its messages numbered by hand):
/// every pod of a StatefulSet, listed whole (from the watch cache, read as it arrives) and in
/// pages and then watched, is kept exactly as the same pod read as JSON from the same API
/// server.
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
    store_text_outside_utf8(c, &ns, "web-0").await;
    let stored = pods.get("web-0").await.expect("web-0");
    assert_eq!(
        stored
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("example.com/bytes"))
            .map(String::as_str),
        Some("\u{fffd}|\u{fffd}"),
        "the API server stores the bytes and writes each as U+FFFD in JSON"
    );
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

/// Gives pod `ns/name` the annotation `example.com/bytes` with a value that is not UTF-8, as
/// any client allowed to update pods can: the pod read and sent back as protobuf (the API
/// server's protobuf decoder stores text unchecked) with one more `metadata` field after the
/// rest, which protobuf merges into the first.
async fn store_text_outside_utf8(c: &Client, ns: &str, name: &str) {
    use prost::Message as _;
    /// `runtime.Unknown`, the envelope after `k8s\0`.
    #[derive(Clone, PartialEq, prost::Message)]
    struct Unknown {
        #[prost(bytes = "vec", tag = "1")]
        type_meta: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        raw: Vec<u8>,
        #[prost(string, tag = "3")]
        content_encoding: String,
        #[prost(string, tag = "4")]
        content_type: String,
    }
    const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";
    let uri = format!("/api/v1/namespaces/{ns}/pods/{name}");
    let get = http::Request::get(&uri)
        .header(http::header::ACCEPT, PROTOBUF)
        .body(Vec::new())
        .expect("a GET");
    let body = c.request_stream(get).await.expect("the pod as protobuf");
    let mut bytes = Vec::new();
    futures::AsyncReadExt::read_to_end(&mut Box::pin(body), &mut bytes)
        .await
        .expect("read the pod");
    let raw = bytes.strip_prefix(b"k8s\0").expect("the k8s envelope");
    let mut envelope = Unknown::decode(raw).expect("runtime.Unknown");
    // ObjectMeta { annotations (12): { "example.com/bytes": "\xff|\xfe" } } as Pod field 1.
    let (key, value) = (b"example.com/bytes", b"\xff|\xfe");
    let entry = [
        &[0x0a, key.len() as u8][..],
        key,
        &[0x12, value.len() as u8],
        value,
    ]
    .concat();
    let annotations = [&[0x62, entry.len() as u8][..], &entry].concat();
    envelope
        .raw
        .extend_from_slice(&[0x0a, annotations.len() as u8]);
    envelope.raw.extend_from_slice(&annotations);
    let put = http::Request::put(&uri)
        .header(http::header::CONTENT_TYPE, PROTOBUF)
        .header(http::header::ACCEPT, "application/json")
        .body([&b"k8s\0"[..], &envelope.encode_to_vec()].concat())
        .expect("a PUT");
    c.request_text(put)
        .await
        .expect("the pod updated from protobuf");
}

const CRD: &str = "persistentpodstates.apps.kruise.io";

/// The API version `ns/name` is stored at in etcd (read through etcd's JSON gateway), if it
/// is stored.
async fn stored_version(env: &Env, ns: &str, name: &str) -> Option<String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let key = format!("/registry/apps.kruise.io/persistentpodstates/{ns}/{name}");
    let body = json!({"key": b64.encode(key)}).to_string();
    let url = format!("{}/v3/kv/range", env.etcd_url);
    let (code, text) = curl(&[
        "-s",
        "-w",
        "\n%{http_code}",
        "-X",
        "POST",
        &url,
        "-d",
        &body,
    ])
    .await;
    assert_eq!(code, 200, "etcd range: {text}");
    let range: Value = serde_json::from_str(&text).expect("etcd's answer");
    let value = b64
        .decode(range["kvs"][0]["value"].as_str()?)
        .expect("base64");
    let object: Value =
        serde_json::from_slice(&value).expect("a custom resource is stored as JSON");
    object["apiVersion"].as_str().map(str::to_owned)
}

/// Puts the CRD's versions and conversion back as they were, also when the test fails half-way.
struct CrdBack {
    client: Client,
    spec: Value,
    done: bool,
}

impl CrdBack {
    async fn restore(client: Client, spec: Value) {
        let crds: Api<CustomResourceDefinition> = Api::all(client);
        crds.patch(
            CRD,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await
        .expect("the CRD put back");
    }

    async fn finish(mut self) {
        Self::restore(self.client.clone(), self.spec.clone()).await;
        self.done = true;
    }
}

impl Drop for CrdBack {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let spec = self.spec.clone();
        put_back(move |client| CrdBack::restore(client, spec));
    }
}

/// A loopback load balancer in front of `backend` (killed when dropped): with `probe`, it
/// goes to the backend only while its `/readyz` answers 200, as a Service of ready endpoints;
/// without, always, as a Service that publishes not-ready addresses.
/// Its stderr (a line for each connection it had nowhere to send) goes to `log`.
fn service(
    env: &Env,
    listen: u16,
    backend: u16,
    probe: Option<u16>,
    log: &std::path::Path,
) -> tokio::process::Child {
    let target = match probe {
        Some(p) => [
            "--ready-backend".to_owned(),
            format!("127.0.0.1:{backend}=127.0.0.1:{p}"),
        ],
        None => ["--backend".to_owned(), format!("127.0.0.1:{backend}")],
    };
    tokio::process::Command::new(&env.lb_bin)
        .args(["--listen".to_owned(), format!("127.0.0.1:{listen}")])
        .args(target)
        .stderr(std::fs::File::create(log).expect("log file"))
        .kill_on_drop(true)
        .spawn()
        .expect("loopback-lb starts")
}

/// The conversion deadlock, and the chart's way out of it (its conversion Service publishes
/// not-ready addresses, `crd.conversionService`). A PersistentPodState stored as v1alpha1 (as
/// OpenKruise's releases that served only v1alpha1 stored them) is read, by the API server's own
/// cache and by a replica's list, only through this service's conversion webhook. Reached only
/// through ready replicas, as through a plain Service, a replica that is not ready yet cannot
/// list it, and so never becomes ready: with every replica down at once (a first install over
/// OpenKruise's objects, a cluster restart) none ever does. Reached through a Service that also
/// publishes replicas not ready, its own conversion answers and it becomes ready.
#[tokio::test]
async fn a_replica_becomes_ready_only_where_conversion_reaches_unready_replicas() {
    let env = env().await;
    let c = &env.client;
    let ns = namespace(c, "e2e-conversion-ready").await;
    let crds: Api<CustomResourceDefinition> = Api::all(c.clone());
    let ours = crds.get(CRD).await.expect("our CRD");
    let spec = json!({"versions": ours.spec.versions, "conversion": ours.spec.conversion});
    let back = CrdBack {
        client: c.clone(),
        spec: spec.clone(),
        done: false,
    };
    let versions = |storage: &str| {
        let mut versions = spec["versions"].clone();
        for v in versions.as_array_mut().expect("versions") {
            v["storage"] = json!(v["name"] == storage);
        }
        versions
    };
    let conversion_at = |port: u16| {
        let mut conversion = spec["conversion"].clone();
        conversion["webhook"]["clientConfig"]["url"] =
            json!(format!("https://{}:{port}/convert", env.webhook_host()));
        conversion
    };

    // An object stored as v1alpha1: the CRD stores v1alpha1 for a moment (the API server's
    // handler takes up a CRD change a moment later: the object is created again until etcd
    // holds it at v1alpha1).
    crds.patch(
        CRD,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"versions": versions("v1alpha1")}})),
    )
    .await
    .expect("v1alpha1 stored");
    let alpha = api(c, &ns, "v1alpha1");
    let old = object(
        "v1alpha1",
        "stored-old",
        json!({"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
               "requiredPersistentTopology": {"nodeTopologyKeys": ["kubernetes.io/hostname"]}}),
    );
    wait_for("an object stored as v1alpha1", TIMEOUT, || async {
        match alpha.create(&PostParams::default(), &old).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => panic!("create: {e}"),
        }
        if stored_version(&env, &ns, "stored-old").await.as_deref()
            == Some("apps.kruise.io/v1alpha1")
        {
            return Some(());
        }
        let _ = alpha.delete("stored-old", &Default::default()).await;
        None
    })
    .await;

    // v1beta1 stored again, and conversion reached only through ready replicas: a replica
    // (this test's, the only one behind that Service) starts, lists, fails on the conversion
    // and stays unready.
    let (webhook, probe, ready_only, publishing) = (19460, 18096, 19461, 19462);
    let logs = env.cluster_dir.join("logs");
    let refusals = logs.join("conversion-ready-only-lb.log");
    let _ready_only = service(&env, ready_only, webhook, Some(probe), &refusals);
    let _publishing = service(
        &env,
        publishing,
        webhook,
        None,
        &logs.join("conversion-publishing-lb.log"),
    );
    crds.patch(
        CRD,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"versions": versions("v1beta1"), "conversion": conversion_at(ready_only)}})),
    )
    .await
    .expect("v1beta1 stored, conversion through ready replicas");
    let replica_log = logs.join("conversion-ready-replica.log");
    let log = std::fs::File::create(&replica_log).expect("log file");
    let mut command = serve_command(&env, &env.sa_kubeconfig, webhook, probe);
    command
        .env("PPS_LEADER_IDENTITY", "e2e-conversion-ready")
        .env("PPS_LEASE_NAME", "e2e-conversion-ready")
        .env("PPS_SHUTDOWN_DELAY_SECONDS", "0")
        .stderr(log);
    let replica = tokio::process::Command::from(command)
        .kill_on_drop(true)
        .spawn()
        .expect("serve starts");
    let readyz = format!("http://127.0.0.1:{probe}/readyz");
    // The API server finds no ready replica to convert with, again and again (its cache of
    // PersistentPodStates cannot be filled, and the replica's list waits on it): the replica
    // has listed everything else, and stays unready.
    let metrics_url = format!("http://127.0.0.1:{probe}/metrics");
    wait_for(
        "conversions refused for want of a ready replica, the other watches listed",
        TIMEOUT,
        || async {
            let text = std::fs::read_to_string(&refusals).unwrap_or_default();
            let refused = text.lines().filter(|l| l.contains("no backend")).count();
            let (code, metrics) = http_get(&metrics_url).await;
            let only_pps_stale = code == 200
                && metric(&metrics, "pps_stale_watches") == 1.0
                && metric(&metrics, "pps_cached_nodes") > 0.0;
            (refused >= 5 && only_pps_stale).then_some(())
        },
    )
    .await;
    let (code, body) = http_get(&readyz).await;
    assert_eq!(code, 503, "not ready while the API server cannot convert");
    assert!(
        body.starts_with("caches not synced: ") && body.contains("PersistentPodState: "),
        "/readyz names what it waits for: {body}"
    );
    // And so does its log, every 30 s while it waits, with the API server's answer: its cache
    // of PersistentPodStates is not ready (429, passed on at once rather than retried; the
    // first list is a streaming list, a watch, from v1.34: a paginated one gets a 500).
    wait_for("the replica saying what it waits for", TIMEOUT, || async {
        let text = std::fs::read_to_string(&replica_log).unwrap_or_default();
        text.lines()
            .any(|l| l.contains("caches not synced yet") && l.contains("PersistentPodState: "))
            .then_some(())
    })
    .await;
    let text = std::fs::read_to_string(&replica_log).unwrap_or_default();
    assert!(
        text.lines().any(|l| l.contains("watch stopped")
            && l.contains("kind=PersistentPodState")
            && l.contains("429")),
        "the API server's 429 reached the watch"
    );
    assert_eq!(http_get(&readyz).await.0, 503, "still not ready");

    // The same replica behind a Service that publishes it not ready: it converts for the API
    // server, lists, and becomes ready, holding the object.
    crds.patch(
        CRD,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"conversion": conversion_at(publishing)}})),
    )
    .await
    .expect("conversion through every replica");
    wait_for("the replica ready", TIMEOUT, || async {
        (http_get(&readyz).await.0 == 200).then_some(())
    })
    .await;
    let metrics = http_get(&metrics_url).await.1;
    assert!(
        metric(&metrics, "pps_cached_persistent_pod_states") >= 1.0,
        "the replica holds the object stored as v1alpha1"
    );

    drop(replica);
    back.finish().await;
    // The suite's replicas saw the API server's cache of PersistentPodStates fail to fill too,
    // while conversion went to this test's replica alone: their watches failed with it (429,
    // not retried silently inside the request) and were marked stale, so they catch up, and
    // hold an object created after it, within the watch backoff (30 s at most) and a list.
    // (Created as v1beta1, stored so without conversion; tried again while the API server
    // takes up the CRD put back and the suite's replicas, which validate it, catch up.)
    let after = object(
        "v1beta1",
        "after",
        json!({"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "after"},
               "requiredPersistentTopology": {"keys": ["kubernetes.io/hostname"]}}),
    );
    let beta = api(c, &ns, "v1beta1");
    wait_for("an object created after", TIMEOUT, || async {
        match beta.create(&PostParams::default(), &after).await {
            Ok(_) => Some(()),
            Err(kube::Error::Api(e)) if e.code == 409 => Some(()),
            Err(_) => None,
        }
    })
    .await;
    let all = Api::<DynamicObject>::all_with(
        c.clone(),
        &ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
            "apps.kruise.io",
            "v1beta1",
            "PersistentPodState",
        )),
    );
    let want = all
        .list(&Default::default())
        .await
        .expect("list")
        .items
        .len() as f64;
    for r in &env.replicas {
        wait_for(
            &format!("replica {} ready, holding all {want} objects", r.name),
            TIMEOUT,
            || async {
                let ready = http_get(&format!("{}/readyz", r.probe_url())).await.0 == 200;
                let metrics = http_get(&format!("{}/metrics", r.probe_url())).await.1;
                (ready && metric(&metrics, "pps_cached_persistent_pod_states") == want)
                    .then_some(())
            },
        )
        .await;
    }
    delete_namespace(c, &ns).await;
    // The test replica's own Lease (it led its own election, apart from the suite's).
    let _ = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
        c.clone(),
        "persistent-pod-state",
    )
    .delete("e2e-conversion-ready", &Default::default())
    .await;
}
