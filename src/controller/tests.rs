//! In-process scenarios of the reconcilers against a mock API server (tower-test): the exact
//! requests a reconcile sends, that it sends none when nothing changed, and how a failed one is
//! timed, counted and retried.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::DynamicObject;
use kube::client::Body;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use super::{Context, Error, WorkloadContext, reconcile_pps, reconcile_workload};
use crate::api::{
    AUTO_GENERATE_ANNOTATION, PERSISTENT_ANNOTATIONS_ANNOTATION, PREFERRED_TOPOLOGY_ANNOTATION,
    PersistentPodState,
};
use crate::events::Events;
use crate::metrics::Metrics;
use crate::state::Caches;
use crate::workload::{GroupKind, native_statefulset_resource};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn mock_client() -> (Client, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, "default"), handle)
}

/// A controller context over `caches`, talking to a mock API server. Events go to a mock nobody
/// answers (publishing them fails in the background, as with a broken Event API).
fn context(caches: Arc<Caches>) -> (Arc<Context>, Handle) {
    let (ctx, handle, _) = context_with_events(caches);
    (ctx, handle)
}

/// [`context`], and the mock the Events are sent to.
fn context_with_events(caches: Arc<Caches>) -> (Arc<Context>, Handle, Handle) {
    context_lost_after(caches, Duration::from_secs(300))
}

/// [`context_with_events`], with `--node-lost-after` at `lost_after`.
fn context_lost_after(caches: Arc<Caches>, lost_after: Duration) -> (Arc<Context>, Handle, Handle) {
    let (client, handle) = mock_client();
    let (events_client, events_handle) = mock_client();
    let events = Arc::new(Events::new(events_client, None, Duration::from_secs(30)));
    let ctx = Context::new(
        client,
        caches,
        Arc::new(Metrics::new()),
        events,
        lost_after,
        crate::leader::Fence::open(),
    );
    (Arc::new(ctx), handle, events_handle)
}

/// The note of the next Event with `reason` published (others are skipped), within 10 s each.
async fn event_note(events: &mut Handle, reason: &str) -> String {
    loop {
        let (got, note) = next_event(events).await;
        if got == reason {
            return note;
        }
    }
}

/// The reason and note of the next Event published, within 10 s.
async fn next_event(events: &mut Handle) -> (String, String) {
    let (request, respond) = tokio::time::timeout(Duration::from_secs(10), events.next_request())
        .await
        .expect("an Event within 10 s")
        .expect("the events client is alive");
    let bytes = request
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let event: Value = serde_json::from_slice(&bytes).expect("JSON");
    respond.send_response(
        Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .body(Body::from(bytes))
            .expect("response"),
    );
    let text = |k: &str| event[k].as_str().unwrap_or_default().to_owned();
    (text("reason"), text("note"))
}

/// When `action` has the object looked at again (`Action` has no getter: read from its Debug
/// form, `Action { requeue_after: Some(1.5s) }`).
fn requeue_after(action: &kube::runtime::controller::Action) -> Option<Duration> {
    let text = format!("{action:?}");
    let inner = text.split_once("Some(")?.1.split_once(')')?.0;
    let (number, unit) = inner.split_at(inner.find(|c: char| c.is_ascii_alphabetic())?);
    let number: f64 = number.parse().ok()?;
    let seconds = match unit {
        "s" => number,
        "ms" => number / 1e3,
        "µs" => number / 1e6,
        "ns" => number / 1e9,
        _ => return None,
    };
    Some(Duration::from_secs_f64(seconds))
}

/// What `sent` asked, `METHOD path?query` each.
fn calls_of(sent: &[Sent]) -> Vec<String> {
    sent.iter()
        .map(|s| format!("{} {}", s.method, s.path_and_query))
        .collect()
}

/// The paths (and queries) of the DELETEs in `sent`, in order.
fn deletes_of(sent: &[Sent]) -> Vec<&str> {
    sent.iter()
        .filter(|s| s.method == Method::DELETE)
        .map(|s| s.path_and_query.as_str())
        .collect()
}

/// A request the reconcile sent.
#[derive(Debug)]
struct Sent {
    method: Method,
    path_and_query: String,
    content_type: String,
    body: Value,
}

/// Drives `reconcile` to its end, answering each request it sends with the next of `answers`
/// (HTTP 200 with that JSON); returns what was sent.
async fn drive(
    reconcile: impl Future<Output = Result<kube::runtime::controller::Action, Error>>,
    handle: &mut Handle,
    answers: Vec<Value>,
) -> Vec<Sent> {
    drive_to_action(reconcile, handle, answers).await.0
}

/// [`drive`], and the reconcile's verdict.
async fn drive_to_action(
    reconcile: impl Future<Output = Result<kube::runtime::controller::Action, Error>>,
    handle: &mut Handle,
    answers: Vec<Value>,
) -> (Vec<Sent>, kube::runtime::controller::Action) {
    let (sent, result) = drive_to_result(reconcile, handle, answers).await;
    (sent, result.expect("reconcile succeeds"))
}

/// [`drive`], and the reconcile's result, success or not.
async fn drive_to_result(
    reconcile: impl Future<Output = Result<kube::runtime::controller::Action, Error>>,
    handle: &mut Handle,
    answers: Vec<Value>,
) -> (Vec<Sent>, Result<kube::runtime::controller::Action, Error>) {
    let mut answers = answers.into_iter();
    let mut sent = Vec::new();
    tokio::pin!(reconcile);
    loop {
        tokio::select! {
            result = &mut reconcile => {
                return (sent, result);
            }
            request = handle.next_request() => {
                let (request, respond) = request.expect("the client is alive");
                let (parts, body) = request.into_parts();
                let bytes = body.collect().await.expect("body").to_bytes();
                sent.push(Sent {
                    method: parts.method,
                    path_and_query: parts.uri.path_and_query().map(ToString::to_string).unwrap_or_default(),
                    content_type: parts
                        .headers
                        .get(http::header::CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned(),
                    body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                });
                let Some(answer) = answers.next() else {
                    panic!("no more requests than answers; sent {sent:?}");
                };
                // A failure Status is answered with its code, anything else with 200.
                let status = match (answer["kind"].as_str(), answer["status"].as_str()) {
                    (Some("Status"), Some("Failure")) => {
                        answer["code"].as_u64().and_then(|c| u16::try_from(c).ok()).unwrap_or(500)
                    }
                    _ => 200,
                };
                respond.send_response(
                    Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(Body::from(serde_json::to_vec(&answer).expect("json")))
                        .expect("response"),
                );
            }
        }
    }
}

fn pps(status: Value) -> PersistentPodState {
    serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
        "metadata": {"name": "web", "namespace": "ns", "generation": 2, "uid": "pps-uid",
                     "resourceVersion": "41"},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                 "requiredPersistentTopology": {"keys": ["topology.kubernetes.io/zone"]}},
        "status": status
    }))
    .expect("pps")
}

fn statefulset(annotations: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "web", "namespace": "ns", "uid": "sts-uid", "annotations": annotations},
        "spec": {"replicas": 2}
    }))
    .expect("statefulset")
}

/// Caches holding the StatefulSet `web` (listed), its Ready pod `web-0` on `n1` (zone z1).
fn world() -> Arc<Caches> {
    let caches = Caches::new();
    let sts = GroupKind::native_statefulset();
    caches.apply_workload(&sts, watcher::Event::InitApply(statefulset(json!({}))));
    caches.apply_workload(&sts, watcher::Event::InitDone);
    caches.apply_node(watcher::Event::Apply(
        serde_json::from_value(json!({"metadata": {"name": "n1",
            "labels": {"topology.kubernetes.io/zone": "z1", "kubernetes.io/hostname": "n1"}}}))
        .expect("node"),
    ));
    caches.apply_pod(watcher::Event::Apply(
        serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "ns", "ownerReferences": [{"apiVersion": "apps/v1",
                "kind": "StatefulSet", "name": "web", "uid": "sts-uid", "controller": true}]},
            "spec": {"nodeName": "n1", "containers": []},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .expect("pod"),
    ));
    caches
}

const RECORDED: &str =
    r#"{"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}}}"#;

#[tokio::test]
async fn status_reconcile_sends_exactly_the_changed_states_as_a_merge_patch() {
    let caches = world();
    let (ctx, mut handle) = context(caches);
    let pps = Arc::new(pps(json!({"observedGeneration": 2})));
    let recorded: Value = serde_json::from_str(RECORDED).expect("json");
    let sent = drive(
        reconcile_pps(pps.clone(), ctx.clone()),
        &mut handle,
        vec![serde_json::to_value(pps.as_ref()).expect("json")],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    let patch = &sent[0];
    assert_eq!(patch.method, Method::PATCH);
    assert_eq!(
        patch.path_and_query,
        "/apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates/web/status?"
    );
    assert_eq!(patch.content_type, "application/merge-patch+json");
    assert_eq!(
        patch.body,
        json!({"metadata": {"resourceVersion": "41"}, "status": {"podStates": recorded, "recorded": 1}}),
        "only what changed, conditional on the version computed from"
    );
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_reconcile_duration_seconds_count{controller=\"status\"} 1"),
        "timed"
    );
}

/// A status computed while a cache it reads is known to be stale (its watch failed and is
/// listed again: a leader elected meanwhile sees older pods) is not written until every one
/// is current.
#[tokio::test]
async fn no_status_is_written_from_a_cache_known_to_be_stale() {
    let caches = world();
    let (ctx, mut handle) = context(caches.clone());
    let pps = Arc::new(pps(json!({"observedGeneration": 2})));
    for kind in ["Pod", "Node", "PersistentPodState", "apps/StatefulSet"] {
        caches.watches.set_stale_for_tests(kind, true);
        let (sent, action) =
            drive_to_action(reconcile_pps(pps.clone(), ctx.clone()), &mut handle, vec![]).await;
        assert!(sent.is_empty(), "{kind} stale: {sent:?}");
        assert_eq!(
            requeue_after(&action),
            Some(Duration::from_secs(2)),
            "{kind} stale: looked at again soon"
        );
        caches.watches.set_stale_for_tests(kind, false);
    }
    // Every one current again: written.
    first_write(&ctx, &mut handle).await;
}

/// The pod `name` of the StatefulSet `web` of `uid`, Ready on `n1`, as the watch brings it.
fn web_pod(name: &str, uid: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ns", "uid": uid, "ownerReferences": [{"apiVersion": "apps/v1",
            "kind": "StatefulSet", "name": "web", "uid": "sts-uid", "controller": true}]},
        "spec": {"nodeName": "n1", "containers": []},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]}
    }))
    .expect("pod")
}

/// A new leader whose pod watch lags behind its predecessor's: the status records `web-0` as
/// the pod "b" (newer), while this cache still holds "a". The state of "a" is not written over
/// it until the pod is read live and "a" is the one of that name now; a pod the watch saw
/// deleted needs no read.
#[tokio::test]
async fn a_state_recorded_for_a_pod_this_cache_never_saw_is_not_written_over_from_a_lagging_cache()
{
    let caches = world();
    caches.apply_pod(watcher::Event::Apply(web_pod("web-0", "a")));
    let (ctx, mut handle) = context(caches.clone());
    let status = json!({"observedGeneration": 2, "recorded": 1, "podStates": {"web-0": {"nodeName": "n1",
        "nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}, "podUID": "b"}}});
    let pps = Arc::new(pps(status));
    let live = |uid: &str| {
        json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": "web-0", "namespace": "ns", "uid": uid}})
    };
    let read = "GET /api/v1/namespaces/ns/pods/web-0";
    // Live, web-0 is "b" (or there is none): the cache lags, its state is kept; looked at
    // again soon.
    let not_found =
        json!({"kind": "Status", "status": "Failure", "code": 404, "reason": "NotFound"});
    for answer in [live("b"), not_found] {
        let (sent, action) = drive_to_action(
            reconcile_pps(pps.clone(), ctx.clone()),
            &mut handle,
            vec![answer],
        )
        .await;
        assert_eq!(calls_of(&sent), [read], "read live, nothing written");
        assert!(
            requeue_after(&action).is_some_and(|after| after <= Duration::from_secs(5)),
            "{action:?}"
        );
    }
    // Live, web-0 is "a": "b" went before it, and the state of "a" is written.
    let written = pps_written(json!({"observedGeneration": 2}));
    let sent = drive(
        reconcile_pps(pps.clone(), ctx.clone()),
        &mut handle,
        vec![live("a"), written],
    )
    .await;
    assert_eq!(calls_of(&sent)[0], read);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(sent[1].method, Method::PATCH);
    assert_eq!(sent[1].body["status"]["podStates"]["web-0"]["podUID"], "a");
    assert!(caches.pod_is_gone("ns", "web-0", "b"), "not read again");
    let metrics = ctx.metrics.encode();
    for counted in [
        "pps_pod_reads_total{result=\"lagging\"} 2",
        "pps_pod_reads_total{result=\"current\"} 1",
        "pps_pod_reads_total{result=\"failed\"} 0",
    ] {
        assert!(metrics.contains(counted), "{counted}");
    }

    // A pod of a workload a PersistentPodState targets that the watch saw deleted before the
    // one cached came is known gone with no read; one of another workload is not remembered.
    // A read that fails holds back only its own pod's state.
    let caches = world();
    let both = Arc::new(self::pps(
        json!({"observedGeneration": 2, "recorded": 2, "podStates": {
        "web-0": {"nodeName": "n1", "nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}, "podUID": "b"},
        "web-1": {"nodeName": "n1", "nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}, "podUID": "d"}}}),
    ));
    caches.apply_pps(watcher::Event::Apply(both.as_ref().clone()));
    caches.apply_pod(watcher::Event::Delete(web_pod("web-0", "b")));
    let mut other = web_pod("other-0", "o");
    if let Some(owner) = other
        .metadata
        .owner_references
        .as_mut()
        .and_then(|o| o.first_mut())
    {
        owner.name = "other".into();
    }
    caches.apply_pod(watcher::Event::Delete(other));
    assert!(
        !caches.pod_is_gone("ns", "other-0", "o"),
        "not a targeted workload's pod"
    );
    caches.apply_pod(watcher::Event::Apply(web_pod("web-0", "a")));
    caches.apply_pod(watcher::Event::Apply(web_pod("web-1", "c")));
    let (ctx, mut handle) = context(caches);
    let failed = json!({"kind": "Status", "status": "Failure", "code": 500, "message": "etcd"});
    let (sent, action) = drive_to_action(
        reconcile_pps(both, ctx.clone()),
        &mut handle,
        vec![failed, pps_written(json!({}))],
    )
    .await;
    assert_eq!(
        calls_of(&sent),
        [
            "GET /api/v1/namespaces/ns/pods/web-1",
            "PATCH /apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates/web/status?"
        ],
        "web-0 written with no live read"
    );
    let states = &sent[1].body["status"]["podStates"];
    assert_eq!(states["web-0"]["podUID"], "a");
    assert!(states.get("web-1").is_none(), "web-1 kept: {states}");
    assert!(
        requeue_after(&action).is_some_and(|after| after <= Duration::from_secs(5)),
        "{action:?}"
    );
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_pod_reads_total{result=\"failed\"} 1")
    );
}

/// States pruned because their workload is gone say so (not that their ordinals are no
/// longer live: none was looked at).
#[tokio::test]
async fn states_pruned_with_their_workload_gone_say_so() {
    let caches = Caches::new();
    let sts = GroupKind::native_statefulset();
    caches.apply_workload(&sts, watcher::Event::InitDone);
    let (ctx, mut handle, mut events) = context_with_events(caches);
    let pps = Arc::new(pps(json!({"observedGeneration": 2, "recorded": 1,
        "podStates": {"web-0": {"nodeName": "n1"}}})));
    let written = pps_written(json!({"observedGeneration": 2, "podStates": {}, "recorded": 0}));
    let sent = drive(reconcile_pps(pps, ctx), &mut handle, vec![written]).await;
    assert_eq!(calls_of(&sent).len(), 1, "{sent:?}");
    let note = event_note(&mut events, "StatesPruned").await;
    assert_eq!(
        note,
        "pruned web-0 (pods gone, their workload gone or being deleted)"
    );
}

/// The PPS `web` as written with `status`.
fn pps_written(status: Value) -> Value {
    serde_json::to_value(pps(status)).expect("json")
}

/// The first status write of the PPS `web` (its next write then waits for the pacing interval).
async fn first_write(ctx: &Arc<Context>, handle: &mut Handle) {
    let first = Arc::new(pps(json!({"observedGeneration": 2})));
    let recorded: Value = serde_json::from_str(RECORDED).expect("json");
    let written = pps(json!({"observedGeneration": 2, "podStates": recorded, "recorded": 1}));
    let sent = drive(
        reconcile_pps(first.clone(), ctx.clone()),
        handle,
        vec![serde_json::to_value(&written).expect("json")],
    )
    .await;
    assert_eq!(sent.len(), 1, "the first change is written at once");
}

#[tokio::test]
async fn under_a_crd_that_keeps_no_extension_field_the_status_settles_after_one_write() {
    let caches = world();
    // web-0 with its uid and IP: its state carries podUID and podIPs, beside `recorded`.
    caches.apply_pod(watcher::Event::Apply(
        serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "ns", "uid": "pod-0", "ownerReferences": [{"apiVersion": "apps/v1",
                "kind": "StatefulSet", "name": "web", "uid": "sts-uid", "controller": true}]},
            "spec": {"nodeName": "n1", "containers": []},
            "status": {"podIPs": [{"ip": "10.0.0.5"}], "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .expect("pod"),
    ));
    let (ctx, mut handle) = context(caches);
    let first = Arc::new(pps(json!({"observedGeneration": 2})));
    // Stored as OpenKruise's schema keeps it: every extension field pruned.
    let recorded: Value = serde_json::from_str(RECORDED).expect("json");
    let mut stored = pps(json!({"observedGeneration": 2, "podStates": recorded}));
    stored.metadata.resource_version = Some("42".into());
    let sent = drive(
        reconcile_pps(first, ctx.clone()),
        &mut handle,
        vec![serde_json::to_value(&stored).expect("json")],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    let web0 = &sent[0].body["status"]["podStates"]["web-0"];
    assert_eq!(
        web0["podUID"], "pod-0",
        "sent with its extension fields: {web0}"
    );
    // Looked at again past the pacing interval, as stored: nothing is written again (each
    // look wrote the pruned fields again before, for ever).
    ctx.pacing.0.lock().expect("pacing").clear();
    let sent = drive(
        reconcile_pps(Arc::new(stored), ctx.clone()),
        &mut handle,
        vec![],
    )
    .await;
    assert!(sent.is_empty(), "{sent:?}");
    assert!(ctx.metrics.encode().contains("pps_status_writes_total 1"));
}

#[tokio::test]
async fn status_writes_are_paced_and_a_change_within_the_interval_waits_for_the_next() {
    let caches = world();
    let (ctx, mut handle) = context(caches.clone());
    first_write(&ctx, &mut handle).await;

    // web-1 becomes Ready right after: its state waits for the end of the interval.
    caches.apply_pod(watcher::Event::Apply(
        serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "ns", "ownerReferences": [{"apiVersion": "apps/v1",
                "kind": "StatefulSet", "name": "web", "uid": "sts-uid", "controller": true}]},
            "spec": {"nodeName": "n1"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .expect("pod"),
    ));
    let recorded: Value = serde_json::from_str(RECORDED).expect("json");
    let written = Arc::new(pps(
        json!({"observedGeneration": 2, "podStates": recorded, "recorded": 1}),
    ));
    let (sent, action) = drive_to_action(
        reconcile_pps(written.clone(), ctx.clone()),
        &mut handle,
        vec![],
    )
    .await;
    assert!(sent.is_empty(), "{sent:?}");
    // Looked at again when the change has waited long enough (the Action exposes no getter:
    // compared with the longest wait, which it is not longer than).
    let longest = super::retry::Pacing::INTERVAL.max(super::retry::Pacing::GATHER);
    let paced = kube::runtime::controller::Action::requeue(longest);
    assert!(
        action != kube::runtime::controller::Action::await_change()
            && (action == paced || format!("{action:?}").ends_with("ms) }")),
        "{action:?}"
    );

    // Once the interval is over, both changes go out in one write.
    ctx.pacing.0.lock().expect("pacing").clear();
    let sent = drive(
        reconcile_pps(written.clone(), ctx.clone()),
        &mut handle,
        vec![serde_json::to_value(written.as_ref()).expect("json")],
    )
    .await;
    assert_eq!(sent.len(), 1);
    assert!(
        sent[0].body["status"]["podStates"]["web-1"].is_object(),
        "{:?}",
        sent[0].body
    );
    assert!(ctx.metrics.encode().contains("pps_status_writes_total 2"));
}

#[test]
fn during_a_rollout_a_change_waits_to_gather_those_that_follow_it() {
    use super::retry::{Paced, Pacing};
    use std::time::Instant;
    let pacing = Pacing::default();
    let key = kube::runtime::reflector::ObjectRef::new("web").within("ns");
    assert_eq!(pacing.wait(&key), None, "after a quiet spell: at once");

    // Written a second ago (past the interval, within a rollout): a new change waits GATHER.
    let ago = |d: Duration| Instant::now().checked_sub(d).expect("uptime");
    let set = |p: Paced| {
        pacing.0.lock().expect("pacing").insert(key.clone(), p);
    };
    set(Paced {
        wrote: ago(Duration::from_secs(1)),
        waiting_since: None,
        retry_at: None,
    });
    let wait = pacing.wait(&key).expect("waits");
    assert!(
        wait > Pacing::GATHER / 2 && wait <= Pacing::GATHER,
        "{wait:?}"
    );
    // Looked at again meanwhile: it keeps waiting from when it was first seen, not anew.
    let waiting_since = pacing.0.lock().expect("pacing")[&key].waiting_since;
    assert!(waiting_since.is_some());
    set(Paced {
        wrote: ago(Duration::from_secs(1)),
        waiting_since: Some(ago(Pacing::GATHER)),
        retry_at: None,
    });
    assert_eq!(pacing.wait(&key), None, "gathered: written now");

    // Undone before it was written: the next change waits its own full GATHER.
    pacing.settled(&key);
    assert!(pacing.wait(&key).is_some_and(|w| w > Pacing::GATHER / 2));

    // Right after a write the interval holds even for a change that waited long.
    pacing.wrote(key.clone());
    let written = pacing.0.lock().expect("pacing")[&key];
    set(Paced {
        waiting_since: Some(ago(Duration::from_secs(5))),
        ..written
    });
    assert!(pacing.wait(&key).is_some_and(|w| w > Pacing::INTERVAL / 2));

    // A rollout long over: at once again.
    set(Paced {
        wrote: ago(Pacing::ROLLOUT),
        waiting_since: None,
        retry_at: None,
    });
    assert_eq!(pacing.wait(&key), None);
}

#[test]
fn a_failed_write_waits_for_its_backoff_even_past_a_rollout_and_is_kept_until_then() {
    use super::retry::{Paced, Pacing};
    use std::time::Instant;
    let pacing = Pacing::default();
    let key = kube::runtime::reflector::ObjectRef::new("web").within("ns");
    let other = kube::runtime::reflector::ObjectRef::new("other").within("ns");
    let ago = |d: Duration| Instant::now().checked_sub(d).expect("uptime");
    pacing.wrote(key.clone());
    let written = pacing.0.lock().expect("pacing")[&key];
    pacing.failed(key.clone(), Duration::from_secs(60));
    let failed = pacing.0.lock().expect("pacing")[&key];
    assert_eq!(failed.wrote, written.wrote, "the last write is kept");
    // Past a rollout since the last write, the backoff still holds.
    let failed = Paced {
        wrote: ago(Pacing::ROLLOUT * 2),
        ..failed
    };
    pacing.0.lock().expect("pacing").insert(key.clone(), failed);
    let wait = pacing.wait(&key).expect("waits");
    assert!(wait > Duration::from_secs(59), "{wait:?}");
    // Another write (of another PersistentPodState) forgets the rollouts long over, not a
    // backoff still running.
    pacing.wrote(other.clone());
    assert!(pacing.0.lock().expect("pacing").contains_key(&key));
    // The backoff over: at once (what failed has waited since the failure).
    pacing.0.lock().expect("pacing").insert(
        key.clone(),
        Paced {
            retry_at: Some(Instant::now()),
            waiting_since: Some(ago(Pacing::GATHER)),
            ..failed
        },
    );
    assert_eq!(pacing.wait(&key), None);
    pacing.wrote(other);
    assert!(
        !pacing.0.lock().expect("pacing").contains_key(&key),
        "forgotten once its backoff is over"
    );
    // Nothing left to write: the backoff no longer holds the next change.
    pacing.failed(key.clone(), Duration::from_secs(60));
    pacing.settled(&key);
    assert!(pacing.wait(&key).is_none_or(|w| w <= Pacing::GATHER));
}

#[tokio::test]
async fn status_reconcile_sends_nothing_when_nothing_changed() {
    let caches = world();
    let (ctx, mut handle) = context(caches);
    let recorded: Value = serde_json::from_str(RECORDED).expect("json");
    let pps = Arc::new(pps(
        json!({"observedGeneration": 2, "podStates": recorded, "recorded": 1}),
    ));
    let sent = drive(reconcile_pps(pps, ctx), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");
}

#[tokio::test]
async fn a_pps_shadowed_by_an_older_one_records_nothing() {
    let caches = world();
    let mut older = pps(json!({"observedGeneration": 2}));
    older.metadata.name = Some("older".into());
    older.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2026-01-01T00:00:00Z".parse().expect("time"),
    ));
    caches.apply_pps(watcher::Event::Apply(older));
    let mut newer = pps(json!({"observedGeneration": 2}));
    newer.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2026-01-02T00:00:00Z".parse().expect("time"),
    ));
    caches.apply_pps(watcher::Event::Apply(newer.clone()));
    let (ctx, mut handle) = context(caches);
    let sent = drive(
        reconcile_pps(Arc::new(newer), ctx.clone()),
        &mut handle,
        vec![],
    )
    .await;
    assert!(sent.is_empty(), "the newer one writes no status: {sent:?}");
}

#[tokio::test]
async fn a_fenced_replica_writes_nothing() {
    let caches = world();
    let (client, mut handle) = mock_client();
    let (events_client, _) = mock_client();
    let events = Arc::new(Events::new(events_client, None, Duration::from_secs(30)));
    let ctx = Arc::new(Context::new(
        client,
        caches,
        Arc::new(Metrics::new()),
        events,
        Duration::from_secs(300),
        crate::leader::Fence::closed(),
    ));
    let pps = Arc::new(pps(json!({"observedGeneration": 2})));
    let reconcile = reconcile_pps(pps, ctx);
    tokio::pin!(reconcile);
    tokio::select! {
        result = &mut reconcile => assert!(matches!(result, Err(Error::Fenced(_))), "{result:?}"),
        request = handle.next_request() => panic!("a fenced replica sent {:?}", request.map(|(r, _)| r.uri().clone())),
    }
}

fn generator(caches: &Arc<Caches>) -> (Arc<WorkloadContext>, Handle) {
    let (ctx, handle) = context(caches.clone());
    (
        Arc::new(WorkloadContext::new(ctx, native_statefulset_resource())),
        handle,
    )
}

fn asking(persistent: &str) -> Value {
    json!({
        AUTO_GENERATE_ANNOTATION: "true",
        PREFERRED_TOPOLOGY_ANNOTATION: "kubernetes.io/hostname",
        PERSISTENT_ANNOTATIONS_ANNOTATION: persistent,
    })
}

fn generated(annotation_keys: &[&str], owner_uid: Option<&str>) -> PersistentPodState {
    let owners = owner_uid.map(|uid| {
        json!([{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": uid, "controller": true}])
    });
    let annotations: Vec<Value> = annotation_keys.iter().map(|k| json!({"key": k})).collect();
    serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
        "metadata": {"name": "web", "namespace": "ns", "uid": "pps-uid", "resourceVersion": "7",
                     "ownerReferences": owners},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                 "preferredPersistentTopology": [{"weight": 100, "preference": {"keys": ["kubernetes.io/hostname"]}}],
                 "persistentPodAnnotations": annotations}
    }))
    .expect("pps")
}

#[tokio::test]
async fn generator_creates_the_pps_and_never_merges_into_one_made_meanwhile() {
    let caches = world();
    let (wctx, mut handle) = generator(&caches);
    let sts = Arc::new(statefulset(asking("a")));
    let sent = drive(
        reconcile_workload(sts, wctx),
        &mut handle,
        vec![serde_json::to_value(generated(&["a"], Some("sts-uid"))).expect("json")],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    let create = &sent[0];
    // A create (POST), which fails if a PPS of that name appeared meanwhile, where an apply
    // would merge into it.
    assert_eq!(create.method, Method::POST);
    assert_eq!(
        create.path_and_query,
        "/apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates?&fieldManager=persistent-pod-state"
    );
    assert_eq!(
        create.body["metadata"]["ownerReferences"][0]["uid"], "sts-uid",
        "owned by the workload"
    );
    assert_eq!(
        create.body["spec"]["persistentPodAnnotations"],
        json!([{"key": "a"}])
    );
}

#[tokio::test]
async fn upstream_bug_3_changing_persistent_pod_annotations_reaches_the_generator_and_updates_the_pps()
 {
    let caches = world();
    caches.apply_pps(watcher::Event::Apply(generated(&["a"], Some("sts-uid"))));
    let (wctx, mut handle) = generator(&caches);
    let kind = GroupKind::native_statefulset();
    let mut requests = caches.triggers.subscribe_workloads(&kind);
    // Upstream's workload handler ignores this annotation: no reconcile, no update.
    caches.apply_workload(&kind, watcher::Event::Apply(statefulset(asking("a,b"))));
    // The request is queued synchronously by the watch event: nothing to wait for.
    let request = requests.try_recv().expect("a reconcile request was queued");
    assert_eq!(request.name, "web");
    let store = caches.workload_store(&kind).expect("watched");
    let sts = store.store.get(&request).expect("cached");
    let sent = drive(
        reconcile_workload(sts, wctx),
        &mut handle,
        vec![serde_json::to_value(generated(&["a", "b"], Some("sts-uid"))).expect("json")],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    let apply = &sent[0];
    assert_eq!(apply.method, Method::PATCH);
    assert_eq!(
        apply.path_and_query,
        "/apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates/web?&fieldManager=persistent-pod-state"
    );
    // A merge patch of what the annotations express: a field they no longer give is removed
    // whoever wrote it (an apply would leave one another field manager owns).
    assert_eq!(apply.content_type, "application/merge-patch+json");
    assert_eq!(
        apply.body["metadata"]["resourceVersion"], "7",
        "conditional on the version planned from"
    );
    assert_eq!(
        apply.body["spec"]["persistentPodAnnotations"],
        json!([{"key": "a"}, {"key": "b"}])
    );
}

#[tokio::test]
async fn generator_leaves_hand_made_pps_alone_and_deletes_only_its_own() {
    // A hand-made PPS named like the workload: neither updated nor deleted.
    for annotations in [asking("a"), json!({})] {
        let caches = world();
        caches.apply_pps(watcher::Event::Apply(generated(&["x"], None)));
        let (wctx, mut handle) = generator(&caches);
        let sent = drive(
            reconcile_workload(Arc::new(statefulset(annotations)), wctx),
            &mut handle,
            vec![],
        )
        .await;
        assert!(sent.is_empty(), "{sent:?}");
    }
    // Its own, no longer asked for: deleted, with the uid as precondition.
    let caches = world();
    caches.apply_pps(watcher::Event::Apply(generated(&["a"], Some("sts-uid"))));
    let (wctx, mut handle) = generator(&caches);
    let sent = drive(
        reconcile_workload(Arc::new(statefulset(json!({}))), wctx),
        &mut handle,
        vec![json!({"kind": "Status", "apiVersion": "v1", "status": "Success"})],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].method, Method::DELETE);
    assert_eq!(
        sent[0].path_and_query,
        "/apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates/web?"
    );
    assert_eq!(sent[0].body["preconditions"]["uid"], "pps-uid");
    assert_eq!(sent[0].body["preconditions"]["resourceVersion"], "7");
    let existing = caches
        .pps
        .get(&kube::runtime::reflector::ObjectRef::new("web").within("ns"))
        .expect("cached");
    assert_eq!(existing.uid().as_deref(), Some("pps-uid"));
}

#[tokio::test]
async fn a_pps_over_the_limits_is_reported_and_only_the_limits_are_read() {
    let caches = world();
    let many: Vec<String> = (0..40).map(|i| format!("key-{i}")).collect();
    let mut over = pps(json!({"observedGeneration": 2}));
    over.spec.required_persistent_topology = Some(crate::api::NodeTopologyTerm { keys: many });
    over.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2026-01-02T00:00:00Z".parse().expect("time"),
    ));
    caches.apply_pps(watcher::Event::Apply(over.clone()));
    let (ctx, mut handle) = context(caches);
    let sent = drive(
        reconcile_pps(Arc::new(over.clone()), ctx.clone()),
        &mut handle,
        vec![serde_json::to_value(&over).expect("json")],
    )
    .await;
    assert_eq!(sent.len(), 1, "the state is still recorded: {sent:?}");
    assert!(
        ctx.metrics.encode().contains("\npps_over_limits 1\n"),
        "reported as over the limits"
    );
    // An older one targeting the workload shadows it: it reports nothing any more, and what
    // it reported comes off the gauges.
    let mut older = pps(json!({"observedGeneration": 2}));
    older.metadata.name = Some("older".into());
    older.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2026-01-01T00:00:00Z".parse().expect("time"),
    ));
    ctx.caches.apply_pps(watcher::Event::Apply(older));
    let sent = drive(
        reconcile_pps(Arc::new(over), ctx.clone()),
        &mut handle,
        vec![],
    )
    .await;
    assert!(sent.is_empty(), "{sent:?}");
    assert!(
        ctx.metrics.encode().contains("\npps_over_limits 0\n"),
        "{}",
        ctx.metrics.encode()
    );
}

#[test]
fn retries_back_off_exponentially_with_jitter_per_object_until_a_success() {
    let backoff = super::retry::Backoff::default();
    let delays: Vec<Duration> = (0..12).map(|_| backoff.failed("a".into())).collect();
    for (n, delay) in delays.iter().enumerate() {
        let full = super::retry::Backoff::BASE
            .saturating_mul(2u32.pow(n as u32))
            .min(super::retry::Backoff::MAX);
        assert!(
            *delay >= full / 2 && *delay <= full,
            "failure {}: {delay:?} not within half and all of {full:?}",
            n + 1
        );
    }
    assert!(
        delays[11] >= super::retry::Backoff::MAX / 2,
        "capped, not reset"
    );
    // Another object starts from the base; a success starts this one over.
    assert!(backoff.failed("b".into()) <= super::retry::Backoff::BASE);
    backoff.succeeded("a");
    assert!(backoff.failed("a".into()) <= super::retry::Backoff::BASE);
    // Jitter: objects failing together do not all get the same delay.
    let together: std::collections::BTreeSet<Duration> = (0..20)
        .map(|i| backoff.failed(format!("together-{i}")))
        .collect();
    assert!(together.len() > 1, "{together:?}");
}

#[tokio::test]
async fn a_conflicting_status_write_fails_the_reconcile_timed_and_counted_for_a_recompute() {
    let caches = world();
    let (ctx, mut handle) = context(caches);
    let pps = Arc::new(pps(json!({"observedGeneration": 2})));
    let reconcile = reconcile_pps(pps.clone(), ctx.clone());
    tokio::pin!(reconcile);
    let result = loop {
        tokio::select! {
            result = &mut reconcile => break result,
            request = handle.next_request() => {
                let (request, respond) = request.expect("the client is alive");
                assert_eq!(request.method(), Method::PATCH, "the status write");
                let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "Conflict", "code": 409,
                    "message": "the object has been modified; please apply your changes to the latest version"});
                respond.send_response(
                    Response::builder()
                        .status(409)
                        .header("content-type", "application/json")
                        .body(Body::from(serde_json::to_vec(&status).expect("json")))
                        .expect("response"),
                );
            }
        }
    };
    let error = result.expect_err("a conflict fails the reconcile");
    assert!(super::retry::is_conflict(&error), "{error}");
    let action = super::pps_error_policy(pps, &error, ctx.clone());
    assert!(
        format!("{action:?}").contains("requeue_after: Some"),
        "computed again later: {action:?}"
    );
    let metrics = ctx.metrics.encode();
    assert!(
        metrics.contains("pps_reconcile_duration_seconds_count{controller=\"status\"} 1"),
        "timed on failure too: {metrics}"
    );
    assert!(
        metrics.contains("pps_reconcile_errors_total{controller=\"status\"} 1"),
        "counted: {metrics}"
    );
}

#[tokio::test]
async fn a_failed_status_write_is_not_sent_again_before_its_backoff_however_many_events_come() {
    let caches = world();
    let (ctx, mut handle) = context(caches);
    let web = Arc::new(pps(json!({"observedGeneration": 2})));
    let refused = || {
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "reason": "InternalError", "code": 500, "message": "etcd timed out"})
    };
    let sent = drive(
        reconcile_pps(web.clone(), ctx.clone()),
        &mut handle,
        vec![refused()],
    )
    .await;
    assert_eq!(sent.len(), 1, "the first write: {sent:?}");
    // Its backoff (0.25-0.5 s), made long so that this test does not race it.
    for p in ctx.pacing.0.lock().expect("pacing").values_mut() {
        assert!(p.retry_at.is_some(), "{p:?}");
        p.retry_at = std::time::Instant::now().checked_add(Duration::from_secs(60));
    }
    // Events right after (a pod's status, a node's heartbeat): the write waits for its backoff
    // (`drive` fails on any request sent).
    for _ in 0..3 {
        let (sent, action) =
            drive_to_action(reconcile_pps(web.clone(), ctx.clone()), &mut handle, vec![]).await;
        assert!(sent.is_empty(), "{sent:?}");
        let after = requeue_after(&action).expect("requeued");
        assert!(
            after > Duration::from_secs(30) && after <= Duration::from_secs(60),
            "looked at again when the backoff is over: {action:?}"
        );
    }
    // The backoff over: tried again, refused again; the waits before counted both failures
    // as one run (the third failure's delay is 1-2 s; after a reset it would be under 1 s).
    ctx.pacing.0.lock().expect("pacing").clear();
    let sent = drive(
        reconcile_pps(web.clone(), ctx.clone()),
        &mut handle,
        vec![refused()],
    )
    .await;
    assert_eq!(sent.len(), 1, "tried again: {sent:?}");
    let key = super::retry::failure_key("pps", web.as_ref());
    assert!(ctx.failures.failed(key.clone()) >= Duration::from_secs(1));
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_reconcile_errors_total{controller=\"status\"} 2"),
        "each failed write counted once"
    );
    // Written at last: the next change goes out as paced again, not backed off.
    ctx.pacing.0.lock().expect("pacing").clear();
    let recorded: Value = serde_json::from_str(RECORDED).expect("json");
    let written = pps(json!({"observedGeneration": 2, "podStates": recorded, "recorded": 1}));
    let sent = drive(
        reconcile_pps(web, ctx.clone()),
        &mut handle,
        vec![serde_json::to_value(&written).expect("json")],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(ctx.failures.failed(key) < Duration::from_secs(1), "reset");
    let paced = ctx.pacing.0.lock().expect("pacing");
    assert!(paced.values().all(|p| p.retry_at.is_none()), "{paced:?}");
}

#[tokio::test]
async fn a_workloads_invalid_ip_request_is_not_copied_and_is_counted() {
    let caches = world();
    let (wctx, mut handle) = generator(&caches);
    let mut annotations = asking("a");
    annotations[crate::api::ip_request::IP_REQUEST_ANNOTATION] = json!("calcio");
    let sts = Arc::new(statefulset(annotations));
    let sent = drive(
        reconcile_workload(sts, wctx.clone()),
        &mut handle,
        vec![serde_json::to_value(generated(&["a"], Some("sts-uid"))).expect("json")],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].method, Method::POST, "the PPS is still generated");
    assert!(
        sent[0].body["metadata"]["annotations"]
            .get(crate::api::ip_request::IP_REQUEST_ANNOTATION)
            .is_none(),
        "without the invalid value: {}",
        sent[0].body
    );
    let metrics = wctx.ctx.metrics.encode();
    assert!(
        metrics.contains("pps_invalid_workload_ip_requests_total 1"),
        "{metrics}"
    );
}

/// After a first write, a state recorded in a zone no node has (decommissioned), within the
/// pacing interval, and looked at: the caches, the context, and that PersistentPodState, with
/// what the look sent.
async fn a_state_in_a_zone_gone() -> (
    Arc<Caches>,
    Arc<Context>,
    Arc<PersistentPodState>,
    Vec<Sent>,
) {
    let caches = world();
    let (ctx, mut handle) = context(caches.clone());
    first_write(&ctx, &mut handle).await;
    let gone = Arc::new(pps(
        json!({"observedGeneration": 2, "podStates": {"web-1": {
        "nodeName": "gone", "nodeTopologyLabels": {"topology.kubernetes.io/zone": "zone-gone"}}}}),
    ));
    caches.apply_pps(watcher::Event::Apply(gone.as_ref().clone()));
    let (sent, _) = drive_to_action(
        reconcile_pps(gone.clone(), ctx.clone()),
        &mut handle,
        vec![],
    )
    .await;
    (caches, ctx, gone, sent)
}

#[tokio::test]
async fn a_paced_reconcile_still_reports_a_state_whose_zone_is_gone() {
    let (_, ctx, _, sent) = a_state_in_a_zone_gone().await;
    assert!(sent.is_empty(), "paced: {sent:?}");
    let metrics = ctx.metrics.encode();
    assert!(
        metrics.contains("pps_states_unplaceable 1"),
        "reported although the write waits: {metrics}"
    );
    // The term ends (leadership lost, or the process stops: what `run` does as it returns):
    // nothing stale is left beside the new leader's figure.
    ctx.term_ended();
    let metrics = ctx.metrics.encode();
    assert!(metrics.contains("pps_states_unplaceable 0"), "{metrics}");
}

/// The last PersistentPodState with an unplaceable state deleted: no reconcile of it runs, and
/// the periodic look forgets it (once `FORGET_EVERY` passed since the last), the gauge at 0.
#[tokio::test]
async fn a_deleted_pps_leaves_the_unplaceable_gauge() {
    let (caches, ctx, gone, _) = a_state_in_a_zone_gone().await;
    assert!(ctx.metrics.encode().contains("pps_states_unplaceable 1"));
    caches.apply_pps(watcher::Event::Delete(gone.as_ref().clone()));
    ctx.forget_gone_reports();
    assert!(
        ctx.metrics.encode().contains("pps_states_unplaceable 1"),
        "not before FORGET_EVERY"
    );
    crate::sync::lock(&ctx.reported_unplaceable.0).forgotten_at = None;
    ctx.forget_gone_reports();
    let metrics = ctx.metrics.encode();
    assert!(metrics.contains("pps_states_unplaceable 0"), "{metrics}");
}

#[test]
fn releases_are_limited_per_pps_and_refill() {
    let releases = super::retry::Releases::new(2);
    let a = kube::runtime::reflector::ObjectRef::<PersistentPodState>::new("a").within("ns");
    let b = kube::runtime::reflector::ObjectRef::<PersistentPodState>::new("b").within("ns");
    assert!(releases.take(&a).is_ok());
    assert!(releases.take(&a).is_ok());
    let wait = releases.take(&a).expect_err("the burst is spent");
    assert!(
        wait > Duration::ZERO && wait <= Duration::from_secs(30),
        "one back within 30 s at 2 a minute: {wait:?}"
    );
    assert!(releases.take(&b).is_ok(), "per PersistentPodState");
    assert!(
        super::retry::Releases::new(0).take(&a).is_err(),
        "0: none released"
    );
}

/// Caches for node-local volumes: the StatefulSet `web` with the claim template `data`, its
/// pod `web-0` waiting unscheduled (uid `pod-uid`), recorded on node `n1`, which was deleted
/// (only `n2` is left).
fn waiting_world() -> Arc<Caches> {
    let caches = Caches::new();
    let sts = GroupKind::native_statefulset();
    let mut workload = statefulset(json!({}));
    workload.data["spec"]["volumeClaimTemplates"] = json!([{"metadata": {"name": "data"}}]);
    caches.apply_workload(&sts, watcher::Event::InitApply(workload));
    caches.apply_workload(&sts, watcher::Event::InitDone);
    caches.apply_node(watcher::Event::Apply(
        serde_json::from_value(json!({"metadata": {"name": "n2", "uid": "n2-uid",
            "labels": {"kubernetes.io/hostname": "n2"}}}))
        .expect("node"),
    ));
    caches.apply_pod(watcher::Event::Apply(
        serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "7",
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web",
                    "uid": "sts-uid", "controller": true}]},
            "spec": {"containers": []},
            "status": {"phase": "Pending"}
        }))
        .expect("pod"),
    ));
    caches
}

/// The PersistentPodState of `waiting_world`, with `annotations`.
fn waiting_pps(annotations: Value) -> Arc<PersistentPodState> {
    let mut p = pps(
        json!({"observedGeneration": 2, "recorded": 1, "podStates": {"web-0": {
        "nodeName": "n1", "nodeUID": "n1-uid",
        "nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1", "kubernetes.io/hostname": "n1"}}}}),
    );
    p.metadata.annotations = serde_json::from_value(annotations).ok();
    Arc::new(p)
}

/// `data-web-0`, bound to `pv-1`, and `pv-1` with `affinity`.
fn claim_and_volume(affinity: Value) -> Vec<Value> {
    vec![
        json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "data-web-0", "namespace": "ns", "uid": "claim-uid",
                "resourceVersion": "3"},
            "spec": {"volumeName": "pv-1"}}),
        json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pv-1"},
            "spec": {"claimRef": {"name": "data-web-0", "namespace": "ns", "uid": "claim-uid"},
                     "nodeAffinity": affinity}}),
    ]
}

/// The answers to the live reads right before a release ([`crate::release::still_waiting`]):
/// `web-0` as the caches hold it, and no node `n1` listed.
fn still_waiting() -> Vec<Value> {
    vec![
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-0", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "7"},
            "spec": {"containers": []}, "status": {"phase": "Pending"}}),
        json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": []}),
    ]
}

/// The answers to a release's deletes (the claim, the pod), then to the patch that makes the
/// pod's state name no node ([`crate::release::forget_node`]).
fn released() -> Vec<Value> {
    let mut forgotten = serde_json::to_value(waiting_pps(json!({})).as_ref()).expect("pps");
    forgotten["status"]["podStates"]["web-0"] =
        json!({"nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}});
    let deleted = json!({"apiVersion": "v1", "kind": "Status", "status": "Success"});
    vec![deleted.clone(), deleted, forgotten]
}

fn on_host(node: &str) -> Value {
    json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}})
}

/// Lets the grace after `n1`'s deletion pass as `ctx` sees it (its pods' node-local claims
/// wait for it): seen gone now, then `--node-lost-after` later.
async fn after_n1s_deletion_grace(ctx: &Context) {
    assert!(
        ctx.gone_for_the_grace("n1", Some("n1-uid")).is_some(),
        "first seen gone now"
    );
    tokio::time::advance(Duration::from_secs(301)).await;
}

/// Nothing is released while a cache the releases judge from is known to be stale (its watch
/// failed, and is being listed again): a node that came back meanwhile would still look gone,
/// and its pods' claims and pins be released. Once every cache is current, they are.
#[tokio::test(start_paused = true)]
async fn nothing_is_released_from_a_cache_known_to_be_stale() {
    let (ctx, mut handle, _events) = context_with_events(waiting_world());
    after_n1s_deletion_grace(&ctx).await;
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    for kind in ["Node", "Pod", "PersistentPodState", "apps/StatefulSet"] {
        ctx.caches.watches.set_stale_for_tests(kind, true);
        let (sent, action) =
            drive_to_action(reconcile_pps(pps.clone(), ctx.clone()), &mut handle, vec![]).await;
        assert!(
            sent.is_empty(),
            "{kind} stale: nothing read or released: {sent:?}"
        );
        assert_eq!(
            requeue_after(&action),
            Some(Duration::from_secs(30)),
            "{kind} stale: looked at again"
        );
        ctx.caches.watches.set_stale_for_tests(kind, false);
    }
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(still_waiting());
    answers.extend(released());
    let sent = drive(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
    assert_eq!(
        calls_of(&sent)[4..6],
        [
            "DELETE /api/v1/namespaces/ns/persistentvolumeclaims/data-web-0?",
            "DELETE /api/v1/namespaces/ns/pods/web-0?",
        ],
        "every cache current: released"
    );
}

#[tokio::test(start_paused = true)]
async fn a_claim_on_a_gone_nodes_local_volume_is_released_with_its_pod_when_allowed() {
    let (ctx, mut handle, mut events) = context_with_events(waiting_world());
    after_n1s_deletion_grace(&ctx).await;
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(still_waiting());
    answers.extend(released());
    let sent = drive(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
    let calls: Vec<(String, &str)> = sent
        .iter()
        .map(|s| (s.method.to_string(), s.path_and_query.as_str()))
        .collect();
    assert_eq!(
        calls,
        [
            (
                "GET".into(),
                "/api/v1/namespaces/ns/persistentvolumeclaims/data-web-0"
            ),
            ("GET".into(), "/api/v1/persistentvolumes/pv-1"),
            // Read live right before: the same pod, unscheduled; its node still gone.
            ("GET".into(), "/api/v1/namespaces/ns/pods/web-0"),
            (
                "GET".into(),
                "/api/v1/nodes?&fieldSelector=metadata.name%3Dn1"
            ),
            (
                "DELETE".into(),
                "/api/v1/namespaces/ns/persistentvolumeclaims/data-web-0?"
            ),
            ("DELETE".into(), "/api/v1/namespaces/ns/pods/web-0?"),
            // Then the state names the node no more, provided it is still the one read.
            (
                "PATCH".into(),
                "/apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates/web/status?"
            ),
        ]
    );
    assert_eq!(
        sent[6].body,
        json!([
            {"op": "test", "path": "/status/podStates/web-0", "value": {
                "nodeName": "n1", "nodeUID": "n1-uid", "nodeTopologyLabels":
                {"topology.kubernetes.io/zone": "z1", "kubernetes.io/hostname": "n1"}}},
            {"op": "replace", "path": "/status/podStates/web-0", "value": {
                "nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}}},
        ])
    );
    assert_eq!(
        sent[4].body["preconditions"],
        json!({"uid": "claim-uid", "resourceVersion": "3"})
    );
    // The pod by uid alone: its claims deleted, it cannot start anywhere.
    assert_eq!(sent[5].body["preconditions"], json!({"uid": "pod-uid"}));
    let metrics = ctx.metrics.encode();
    for series in [
        "pps_local_volumes_released_total{reason=\"node_gone\"} 1",
        "pps_pods_released_total{reason=\"node_gone\"} 1",
    ] {
        assert!(metrics.contains(series), "{series}: {metrics}");
    }
    let note = event_note(&mut events, "LocalVolumeReleased").await;
    for named in ["data-web-0", "pv-1", "node n1"] {
        assert!(note.contains(named), "{named}: {note}");
    }
    let note = event_note(&mut events, "PodReleased").await;
    assert!(
        note.contains("web-0") && note.contains("data-web-0"),
        "{note}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_deleted_nodes_local_claims_wait_for_the_grace_from_when_it_was_seen_gone() {
    // n1 is deleted (a node deleted by mistake comes back, registered again by its kubelet,
    // with its disks): nothing is read or deleted before `--node-lost-after` from the first
    // look that saw it gone.
    let (ctx, mut handle) = context(waiting_world());
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let (sent, action) =
        drive_to_action(reconcile_pps(pps.clone(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");
    let after = requeue_after(&action).expect("requeued");
    assert!(
        (Duration::from_secs(300)..=Duration::from_secs(301)).contains(&after),
        "looked at again once the grace is over: {action:?}"
    );
    tokio::time::advance(Duration::from_secs(150)).await;
    let sent = drive(reconcile_pps(pps.clone(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "half the grace: {sent:?}");
    tokio::time::advance(Duration::from_secs(151)).await;
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(still_waiting());
    answers.extend(released());
    let sent = drive(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
    assert_eq!(
        sent.iter().filter(|s| s.method == Method::DELETE).count(),
        2,
        "the claim, then the pod: {sent:?}"
    );
    // Another uid recorded for n1 since (a state recorded again on a node of that name): its
    // grace starts anew, and looking at it starts nothing anew for the first (the states of
    // two pods recorded on n1 under two uids, looked at in turn, never end each other's).
    assert!(ctx.gone_for_the_grace("n1", Some("n1-uid")).is_none());
    assert_eq!(
        ctx.gone_for_the_grace("n1", Some("n1-uid-2")),
        Some(Duration::from_secs(300))
    );
    assert!(ctx.gone_for_the_grace("n1", Some("n1-uid")).is_none());
    assert!(ctx.gone_for_the_grace("n1", None).is_some());
    assert!(ctx.gone_for_the_grace("n1", Some("n1-uid")).is_none());
}

/// The pod's delete fails after its claims were deleted (the API server failing, the Lease
/// lost between the two): the next look, which finds no claim of it left, or its claim still
/// being deleted (held by `kubernetes.io/pvc-protection` while the pod is there), deletes the
/// pod, with no new read and no new token.
#[tokio::test(start_paused = true)]
async fn a_pod_whose_delete_failed_after_its_claims_is_deleted_at_the_next_look() {
    for still_listed in [false, true] {
        let (ctx, mut handle) = context(waiting_world());
        after_n1s_deletion_grace(&ctx).await;
        let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
        let mut answers = claim_and_volume(on_host("n1"));
        answers.extend(still_waiting());
        answers.push(json!({"apiVersion": "v1", "kind": "Status", "status": "Success"}));
        answers.push(
            json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "InternalError", "code": 500, "message": "etcd is slow"}),
        );
        let (sent, result) = drive_to_result(
            reconcile_pps(pps.clone(), ctx.clone()),
            &mut handle,
            answers,
        )
        .await;
        assert!(result.is_err(), "the failed delete fails the look");
        let deletes = |sent: &[Sent]| -> Vec<String> {
            sent.iter()
                .filter(|s| s.method == Method::DELETE)
                .map(|s| s.path_and_query.trim_end_matches('?').to_owned())
                .collect()
        };
        assert_eq!(
            deletes(&sent),
            [
                "/api/v1/namespaces/ns/persistentvolumeclaims/data-web-0",
                "/api/v1/namespaces/ns/pods/web-0"
            ]
        );
        // The next look: the claim is gone, or being deleted; the pod is deleted (by its uid), its
        // state forgotten.
        let mut answers = if still_listed {
            let mut listed = claim_and_volume(on_host("n1"));
            listed[0]["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            listed[0]["metadata"]["finalizers"] = json!(["kubernetes.io/pvc-protection"]);
            listed
        } else {
            vec![
                json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
            "reason": "NotFound", "code": 404, "message": "not found"}),
            ]
        };
        answers.extend(released().into_iter().skip(1));
        let sent = drive(
            reconcile_pps(pps.clone(), ctx.clone()),
            &mut handle,
            answers,
        )
        .await;
        assert_eq!(deletes(&sent), ["/api/v1/namespaces/ns/pods/web-0"]);
        let pod_delete = sent
            .iter()
            .find(|s| s.method == Method::DELETE)
            .expect("the pod's delete");
        assert_eq!(pod_delete.body["preconditions"]["uid"], "pod-uid");
        assert!(
            ctx.metrics
                .encode()
                .contains("pps_local_volumes_released_total{reason=\"node_gone\"} 1"),
            "{}",
            ctx.metrics.encode()
        );
        // Done: a look after that finds nothing to do for it.
        let answers = vec![
            json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "NotFound", "code": 404, "message": "not found"}),
        ];
        let sent = drive(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
        assert!(deletes(&sent).is_empty(), "{sent:?}");
    }
}

/// A volume whose affinity names its node by a label of the node's own (OpenEBS ZFS's
/// `openebs.io/nodeid`, not the node's name): once the node is deleted, it is told apart by
/// the node as last seen, and released with its pod; a node never seen so is not guessed at.
#[tokio::test(start_paused = true)]
async fn a_deleted_nodes_volume_named_by_a_label_of_its_own_is_released() {
    let by_node_id = json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "openebs.io/nodeid", "operator": "In", "values": ["zfs-7"]}]}]}});
    for seen in [true, false] {
        let caches = waiting_world();
        if seen {
            let n1: Node =
                serde_json::from_value(json!({"metadata": {"name": "n1", "uid": "n1-uid",
                "labels": {"kubernetes.io/hostname": "n1", "openebs.io/nodeid": "zfs-7"}}}))
                .expect("node");
            caches.apply_node(watcher::Event::Apply(n1.clone()));
            caches.apply_node(watcher::Event::Delete(n1));
        }
        let (ctx, mut handle) = context(caches);
        after_n1s_deletion_grace(&ctx).await;
        let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
        let mut answers = claim_and_volume(by_node_id.clone());
        if seen {
            answers.extend(still_waiting());
            answers.extend(released());
        }
        let sent = drive(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
        let deletes = sent.iter().filter(|s| s.method == Method::DELETE).count();
        assert_eq!(
            deletes,
            if seen { 2 } else { 0 },
            "seen deleted: {seen}; {sent:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_node_back_under_its_name_and_gone_again_starts_the_grace_anew() {
    let (ctx, _handle) = context(waiting_world());
    after_n1s_deletion_grace(&ctx).await;
    assert!(ctx.gone_for_the_grace("n1", Some("n1-uid")).is_none());
    // n1 registered again by its kubelet (another uid: still replaced for the state recorded
    // on the first): the grace runs from now.
    let again: Node = serde_json::from_value(json!({"metadata": {"name": "n1", "uid": "n1-uid-2",
        "labels": {"kubernetes.io/hostname": "n1"}}}))
    .expect("node");
    ctx.caches.apply_node(watcher::Event::Apply(again.clone()));
    assert_eq!(
        ctx.gone_for_the_grace("n1", Some("n1-uid")),
        Some(Duration::from_secs(300))
    );
    tokio::time::advance(Duration::from_secs(200)).await;
    // Deleted again: from now again.
    ctx.caches.apply_node(watcher::Event::Delete(again));
    assert_eq!(
        ctx.gone_for_the_grace("n1", Some("n1-uid")),
        Some(Duration::from_secs(300))
    );
    tokio::time::advance(Duration::from_secs(301)).await;
    assert!(ctx.gone_for_the_grace("n1", Some("n1-uid")).is_none());
}

/// n1 deleted and registered again under its name (another uid), as its kubelet does with its
/// disks: while it is there and works (cordoned, or full, the pod waits), the claim its volume
/// holds is kept, whatever the grace; once that node is lost too, the claim is released.
#[tokio::test(start_paused = true)]
async fn a_claim_whose_node_is_back_under_another_uid_and_works_is_kept() {
    let again = |ready: Value| -> Node {
        serde_json::from_value(json!({"metadata": {"name": "n1", "uid": "n1-uid-2",
            "labels": {"kubernetes.io/hostname": "n1"}},
            "spec": {"unschedulable": true},
            "status": {"conditions": [ready]}}))
        .expect("node")
    };
    let works = json!({"type": "Ready", "status": "True"});
    let lost = json!({"type": "Ready", "status": "False",
        "lastTransitionTime": "2020-01-01T00:00:00Z"});
    let pps = || waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let caches = waiting_world();
    caches.apply_node(watcher::Event::Apply(again(works.clone())));
    let (ctx, mut handle, mut events) = context_with_events(caches);
    after_n1s_deletion_grace(&ctx).await;
    let sent = drive(
        reconcile_pps(pps(), ctx.clone()),
        &mut handle,
        claim_and_volume(on_host("n1")),
    )
    .await;
    assert!(sent.iter().all(|s| s.method == Method::GET), "{sent:?}");
    let note = event_note(&mut events, "LocalVolumeKept").await;
    for named in ["data-web-0", "node n1", "pv-1", "registered again"] {
        assert!(note.contains(named), "{named}: {note}");
    }
    // Lost as the caches hold it, working as the API server shows it (the caches lag): kept.
    // The control: lost in both, the claim and the pod are released.
    let listed = |node: Node| {
        json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {},
            "items": [serde_json::to_value(node).expect("node")]})
    };
    for (live, released_now) in [(works, false), (lost.clone(), true)] {
        let caches = waiting_world();
        caches.apply_node(watcher::Event::Apply(again(lost.clone())));
        let (ctx, mut handle) = context(caches);
        after_n1s_deletion_grace(&ctx).await;
        let mut answers = claim_and_volume(on_host("n1"));
        answers.extend([still_waiting()[0].clone(), listed(again(live))]);
        if released_now {
            answers.extend(released());
        }
        let sent = drive(reconcile_pps(pps(), ctx), &mut handle, answers).await;
        let deletes = sent.iter().filter(|s| s.method == Method::DELETE).count();
        assert_eq!(deletes, if released_now { 2 } else { 0 }, "{sent:?}");
    }
}

/// A node cordoned and then down (a drain and a reboot, a disk replaced) past the grace is
/// maintenance: its disks come back with it, so its pods' node-local claims are kept, said
/// once, and looked at again soon; lost as the caches hold it but cordoned as the API server
/// shows it, the same. Uncordoned, or tainted out-of-service (an operator's word that it is
/// gone for good), they are released.
#[tokio::test(start_paused = true)]
async fn a_cordoned_nodes_local_claims_are_kept_while_it_is_down_for_maintenance() {
    let n1 = |cordoned: bool, taints: Value| -> Node {
        serde_json::from_value(json!({"metadata": {"name": "n1", "uid": "n1-uid",
            "labels": {"kubernetes.io/hostname": "n1"}},
            "spec": {"unschedulable": cordoned, "taints": taints},
            "status": {"conditions": [{"type": "Ready", "status": "Unknown",
                "lastTransitionTime": "2020-01-01T00:00:00Z"}]}}))
        .expect("node")
    };
    let out_of_service =
        json!([{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}]);
    let listed = |node: Node| {
        json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {},
            "items": [serde_json::to_value(node).expect("node")]})
    };
    let pps = || waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    // Cordoned in the caches: nothing deleted, nor read live; said once, looked at again.
    let caches = waiting_world();
    caches.apply_node(watcher::Event::Apply(n1(true, json!([]))));
    let (ctx, mut handle, mut events) = context_with_events(caches);
    let (sent, action) = drive_to_action(
        reconcile_pps(pps(), ctx.clone()),
        &mut handle,
        claim_and_volume(on_host("n1")),
    )
    .await;
    assert_eq!(
        calls_of(&sent),
        [
            "GET /api/v1/namespaces/ns/persistentvolumeclaims/data-web-0",
            "GET /api/v1/persistentvolumes/pv-1",
        ]
    );
    let note = event_note(&mut events, "LocalVolumeKept").await;
    for named in [
        "data-web-0",
        "node n1 is cordoned",
        "pv-1",
        "out-of-service",
        "release web-0",
    ] {
        assert!(note.contains(named), "{named}: {note}");
    }
    assert!(
        requeue_after(&action).is_some_and(|d| d <= Duration::from_secs(30)),
        "looked at again soon: {action:?}"
    );
    let metrics = ctx.metrics.encode();
    assert!(
        metrics.contains("pps_local_volumes_released_total{reason=\"node_lost\"} 0"),
        "{metrics}"
    );
    // Said already: the next looks read nothing while the node stays so.
    let (sent, action) =
        drive_to_action(reconcile_pps(pps(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");
    assert!(
        requeue_after(&action).is_some_and(|d| d <= Duration::from_secs(30)),
        "{action:?}"
    );
    // Judged from the caches (not cordoned there) and from the API server's word.
    for (live, released_now) in [
        (n1(true, json!([])), false),
        (n1(false, json!([])), true),
        (n1(true, out_of_service.clone()), true),
    ] {
        let caches = waiting_world();
        caches.apply_node(watcher::Event::Apply(n1(false, json!([]))));
        let (ctx, mut handle) = context(caches);
        let mut answers = claim_and_volume(on_host("n1"));
        answers.extend([still_waiting()[0].clone(), listed(live.clone())]);
        if released_now {
            answers.extend(released());
        }
        let sent = drive(reconcile_pps(pps(), ctx), &mut handle, answers).await;
        let deletes = sent.iter().filter(|s| s.method == Method::DELETE).count();
        assert_eq!(
            deletes,
            if released_now { 2 } else { 0 },
            "{live:?}: {sent:?}"
        );
    }
    // Cordoned and tainted out-of-service in the caches: released.
    let caches = waiting_world();
    caches.apply_node(watcher::Event::Apply(n1(true, out_of_service.clone())));
    let (ctx, mut handle) = context(caches);
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend([still_waiting()[0].clone(), listed(n1(true, out_of_service))]);
    answers.extend(released());
    let sent = drive(reconcile_pps(pps(), ctx), &mut handle, answers).await;
    assert_eq!(
        sent.iter().filter(|s| s.method == Method::DELETE).count(),
        2,
        "{sent:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_claim_is_kept_when_the_api_server_shows_the_pod_or_its_node_changed_since_the_caches() {
    let scheduled = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "9"},
        "spec": {"nodeName": "n1", "containers": []}, "status": {"phase": "Pending"}});
    let recreated = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "ns", "uid": "other-uid", "resourceVersion": "9"},
        "spec": {"containers": []}, "status": {"phase": "Pending"}});
    let back = json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": [{
        "metadata": {"name": "n1", "uid": "n1-uid", "labels": {"kubernetes.io/hostname": "n1"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]});
    let registered_again = json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": [{
        "metadata": {"name": "n1", "uid": "n1-uid-2", "labels": {"kubernetes.io/hostname": "n1"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]});
    let pod = still_waiting()[0].clone();
    let refused = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "Forbidden", "code": 403, "message": "nodes is forbidden"});
    let cases = [
        ("bound to the node back since", vec![scheduled]),
        ("re-created since", vec![recreated]),
        ("its node back since, ready", vec![pod.clone(), back]),
        (
            "registered again since, under another uid",
            vec![pod.clone(), registered_again],
        ),
        ("its node not read", vec![pod, refused]),
    ];
    for (case, live) in cases {
        let (ctx, mut handle) = context(waiting_world());
        after_n1s_deletion_grace(&ctx).await;
        let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
        let mut answers = claim_and_volume(on_host("n1"));
        answers.extend(live);
        let sent = drive(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
        assert!(
            sent.iter().all(|s| s.method == Method::GET),
            "{case}: {sent:?}"
        );
        assert!(
            ctx.metrics
                .encode()
                .contains("pps_local_volumes_released_total{reason=\"node_gone\"} 0"),
            "{case}"
        );
    }
    // The control: the same pod, its node still gone, is released.
    let (ctx, mut handle) = context(waiting_world());
    after_n1s_deletion_grace(&ctx).await;
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(still_waiting());
    answers.extend(released());
    let sent = drive(reconcile_pps(pps, ctx), &mut handle, answers).await;
    assert_eq!(
        sent.iter().filter(|s| s.method == Method::DELETE).count(),
        2,
        "{sent:?}"
    );
}

#[tokio::test]
async fn without_the_annotation_a_blocking_local_volume_is_reported_once_and_nothing_deleted() {
    let (ctx, mut handle, mut events) = context_with_events(waiting_world());
    let pps = waiting_pps(json!({}));
    ctx.caches
        .apply_pps(watcher::Event::Apply(pps.as_ref().clone()));
    let sent = drive(
        reconcile_pps(pps.clone(), ctx.clone()),
        &mut handle,
        claim_and_volume(on_host("n1")),
    )
    .await;
    assert!(sent.iter().all(|s| s.method == Method::GET), "{sent:?}");
    assert_eq!(sent.len(), 2);
    let note = event_note(&mut events, "LocalVolumeBlocking").await;
    for said in [
        "data-web-0 (PersistentVolume pv-1)",
        "node n1",
        "persistent-pod-state.io/release-local-volumes=true",
        "persistent-pod-state release web-0 -n ns",
    ] {
        assert!(note.contains(said), "{said}: {note}");
    }
    // Reported: the next look reads nothing again and deletes nothing.
    let sent = drive(reconcile_pps(pps, ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_local_volumes_released_total{reason=\"node_gone\"} 0")
    );
}

#[tokio::test]
async fn a_blocking_local_volume_is_still_reported_after_its_claims_could_not_be_read() {
    let (ctx, mut handle, mut events) = context_with_events(waiting_world());
    let pps = waiting_pps(json!({}));
    ctx.caches
        .apply_pps(watcher::Event::Apply(pps.as_ref().clone()));
    let failed = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "reason": "InternalError", "code": 500, "message": "etcd timed out"});
    let sent = drive(
        reconcile_pps(pps.clone(), ctx.clone()),
        &mut handle,
        vec![failed],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    // The next look reads the claims again, and says what blocks the pod.
    let sent = drive(
        reconcile_pps(pps, ctx.clone()),
        &mut handle,
        claim_and_volume(on_host("n1")),
    )
    .await;
    assert_eq!(sent.len(), 2, "{sent:?}");
    let note = event_note(&mut events, "LocalVolumeBlocking").await;
    assert!(
        note.contains("data-web-0 (PersistentVolume pv-1)"),
        "{note}"
    );
}

#[tokio::test(start_paused = true)]
async fn odd_volumes_and_claims_of_other_owners_are_never_released() {
    let zone = json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1", "z2"]}]}]}});
    let mut foreign = claim_and_volume(on_host("n1"));
    foreign[0]["metadata"]["ownerReferences"] =
        json!([{"apiVersion": "example.com/v1", "kind": "Backup", "name": "b", "uid": "b-uid"}]);
    // Each kept with a Warning saying why; a volume of another (usable) node blocks nothing.
    let cases = [
        (
            "no node affinity",
            claim_and_volume(Value::Null),
            Some("has no required node affinity"),
        ),
        (
            "another node's volume",
            claim_and_volume(on_host("n2")),
            None,
        ),
        (
            "garbage affinity",
            claim_and_volume(json!({"required": {"nodeSelectorTerms": [{}]}})),
            Some("does not name one node"),
        ),
        (
            "a zone's volume",
            claim_and_volume(zone),
            Some("does not name one node"),
        ),
        (
            "a claim of another owner",
            foreign,
            Some("owned by Backup b"),
        ),
    ];
    for (case, answers, why) in cases {
        let (ctx, mut handle, mut events) = context_with_events(waiting_world());
        after_n1s_deletion_grace(&ctx).await;
        let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
        let (sent, action) = drive_to_action(reconcile_pps(pps, ctx), &mut handle, answers).await;
        assert!(
            sent.iter().all(|s| s.method == Method::GET),
            "{case}: {sent:?}"
        );
        // Claims are not watched: another owner's claim holding the pod on its node is read
        // again soon; what nobody will change is not read again before the resync.
        let after = requeue_after(&action).expect("requeued");
        if case == "a claim of another owner" {
            assert!(after <= Duration::from_secs(30), "{case}: {action:?}");
        } else {
            assert!(after > Duration::from_secs(30), "{case}: {action:?}");
        }
        if let Some(why) = why {
            let note = event_note(&mut events, "LocalVolumeKept").await;
            assert!(
                note.contains(why) && note.contains("web-0"),
                "{case}: {note}"
            );
        }
    }
}

/// Caches as [`waiting_world`], the StatefulSet with the claim templates `data` and `logs`.
fn two_claims_world() -> Arc<Caches> {
    let caches = waiting_world();
    let mut workload = statefulset(json!({}));
    workload.data["spec"]["volumeClaimTemplates"] =
        json!([{"metadata": {"name": "data"}}, {"metadata": {"name": "logs"}}]);
    caches.apply_workload(
        &GroupKind::native_statefulset(),
        watcher::Event::Apply(workload),
    );
    caches
}

/// `logs-web-0`, another owner's claim, bound to `pv-2` with `affinity`.
fn foreign_logs_claim(affinity: Value) -> Vec<Value> {
    vec![
        json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "logs-web-0", "namespace": "ns", "uid": "logs-uid",
                "ownerReferences": [{"apiVersion": "example.com/v1", "kind": "Backup", "name": "b", "uid": "b-uid"}]},
            "spec": {"volumeName": "pv-2"}}),
        json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pv-2"},
            "spec": {"claimRef": {"name": "logs-web-0", "namespace": "ns", "uid": "logs-uid"},
                     "nodeAffinity": affinity}}),
    ]
}

/// `logs-web-0`, the pod's own claim, bound to `pv-2` with `affinity`.
fn own_logs_claim(affinity: Value) -> Vec<Value> {
    vec![
        json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "logs-web-0", "namespace": "ns", "uid": "logs-uid",
                "resourceVersion": "4"},
            "spec": {"volumeName": "pv-2"}}),
        json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pv-2"},
            "spec": {"claimRef": {"name": "logs-web-0", "namespace": "ns", "uid": "logs-uid"},
                     "nodeAffinity": affinity}}),
    ]
}

/// The pod's own claim on a zonal disk (its volume's affinity names no one node) holds it to
/// a zone whose only node is gone: its claim on that node's local volume is not deleted for
/// nothing (the pod would still wait). Once a usable node of that zone is there, it is.
#[tokio::test(start_paused = true)]
async fn a_local_claim_beside_an_own_claim_no_usable_node_can_mount_is_not_released_for_nothing() {
    let in_z1 = json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}]}]}});
    let caches = two_claims_world();
    let (ctx, mut handle, mut events) = context_with_events(caches.clone());
    after_n1s_deletion_grace(&ctx).await;
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(own_logs_claim(in_z1.clone()));
    let sent = drive(
        reconcile_pps(pps.clone(), ctx.clone()),
        &mut handle,
        answers,
    )
    .await;
    kept_for_nothing(
        &sent,
        &mut events,
        &ctx,
        &["logs-web-0", "no usable node can mount it"],
    )
    .await;

    // A node of z1 joins: the pod can go there, so its claim on n1's volume is released.
    caches.apply_node(watcher::Event::Apply(
        serde_json::from_value(json!({"metadata": {"name": "n3", "uid": "n3-uid",
            "labels": {"kubernetes.io/hostname": "n3", "topology.kubernetes.io/zone": "z1"}}}))
        .expect("node"),
    ));
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(own_logs_claim(in_z1));
    answers.extend(still_waiting());
    answers.extend(released());
    let sent = drive(reconcile_pps(pps, ctx), &mut handle, answers).await;
    let deleted = deletes_of(&sent);
    assert_eq!(
        deleted,
        [
            "/api/v1/namespaces/ns/persistentvolumeclaims/data-web-0?",
            "/api/v1/namespaces/ns/pods/web-0?"
        ],
        "{sent:?}"
    );
}

/// A PersistentPodState being deleted beside its replacement (in force, recording the same
/// pod) leaves that pod's release to the replacement: one release, within one rate.
#[tokio::test(start_paused = true)]
async fn a_pps_being_deleted_leaves_the_pods_its_replacement_records_to_it() {
    let (ctx, mut handle) = context(waiting_world());
    after_n1s_deletion_grace(&ctx).await;
    let annotations = json!({"persistent-pod-state.io/release-local-volumes": "true"});
    let mut deleting = (*waiting_pps(annotations.clone())).clone();
    deleting.metadata.deletion_timestamp =
        serde_json::from_value(json!("2026-01-01T00:00:00Z")).ok();
    deleting.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    let mut replacement = (*waiting_pps(annotations)).clone();
    replacement.metadata.name = Some("replacement".into());
    ctx.caches
        .apply_pps(watcher::Event::Apply(deleting.clone()));
    ctx.caches.apply_pps(watcher::Event::Apply(replacement));
    let sent = drive(
        reconcile_pps(Arc::new(deleting), ctx.clone()),
        &mut handle,
        vec![],
    )
    .await;
    assert!(
        sent.is_empty(),
        "nothing read or released by the one being deleted: {sent:?}"
    );
}

/// A pod's second claim refused after its first was deleted: the rate's token stays spent (a
/// claim was deleted: the rate bounds what is deleted), the failure is returned, and the claim
/// deleted is remembered, also through a later look that deletes nothing (the second claim
/// changed): once the second is gone too, the pod is deleted.
#[tokio::test(start_paused = true)]
async fn a_claim_refused_after_another_was_deleted_is_remembered_until_the_pod_goes() {
    let (ctx, mut handle) = context(two_claims_world());
    let ctx = Arc::new(Arc::into_inner(ctx).expect("one owner").releasing(2));
    after_n1s_deletion_grace(&ctx).await;
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let status = |code: u16, reason: &str| {
        json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": reason,
            "code": code, "message": reason})
    };
    let deletes = |sent: &[Sent]| -> Vec<String> {
        sent.iter()
            .filter(|s| s.method == Method::DELETE)
            .map(|s| s.path_and_query.clone())
            .collect()
    };
    // data-web-0 deleted, logs-web-0 refused.
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(own_logs_claim(on_host("n1")));
    answers.extend(still_waiting());
    answers.push(json!({"apiVersion": "v1", "kind": "Status", "status": "Success"}));
    answers.push(status(403, "Forbidden"));
    let (sent, result) = drive_to_result(
        reconcile_pps(pps.clone(), ctx.clone()),
        &mut handle,
        answers,
    )
    .await;
    assert_eq!(
        deletes(&sent),
        [
            "/api/v1/namespaces/ns/persistentvolumeclaims/data-web-0?",
            "/api/v1/namespaces/ns/persistentvolumeclaims/logs-web-0?"
        ]
    );
    assert!(
        matches!(&result, Err(Error::Kube(kube::Error::Api(e))) if e.code == 403),
        "{result:?}"
    );
    assert!(ctx.claims_deleted_of("pod-uid").is_some(), "remembered");
    // The next look: data-web-0 gone, logs-web-0 changed since (a conflict): nothing deleted,
    // its token back, and data-web-0 still remembered.
    let mut answers = vec![status(404, "NotFound")];
    answers.extend(own_logs_claim(on_host("n1")));
    answers.extend(still_waiting());
    answers.push(status(409, "Conflict"));
    let sent = drive(
        reconcile_pps(pps.clone(), ctx.clone()),
        &mut handle,
        answers,
    )
    .await;
    assert_eq!(
        deletes(&sent),
        ["/api/v1/namespaces/ns/persistentvolumeclaims/logs-web-0?"]
    );
    let remembered = ctx.claims_deleted_of("pod-uid").expect("still remembered");
    assert_eq!(
        remembered
            .iter()
            .map(|c| c.claim.as_str())
            .collect::<Vec<_>>(),
        ["data-web-0"],
        "only the claim deleted"
    );
    // logs-web-0 gone too (deleted by hand): the pod is deleted now.
    let mut answers = vec![status(404, "NotFound"), status(404, "NotFound")];
    answers.extend(released().into_iter().skip(1));
    let sent = drive(
        reconcile_pps(pps.clone(), ctx.clone()),
        &mut handle,
        answers,
    )
    .await;
    assert_eq!(deletes(&sent), ["/api/v1/namespaces/ns/pods/web-0?"]);
    // One release spent in all: the first look's.
    let key = kube::runtime::reflector::ObjectRef::from_obj(pps.as_ref());
    assert!(ctx.releases.take(&key).is_ok(), "one token left");
    assert!(
        ctx.releases.take(&key).is_err(),
        "the first look's token stays spent"
    );
}

#[tokio::test(start_paused = true)]
async fn a_local_claim_beside_another_owners_on_a_network_volume_is_released() {
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(foreign_logs_claim(Value::Null));
    answers.extend(still_waiting());
    answers.extend(released());
    let (ctx, mut handle) = context(two_claims_world());
    after_n1s_deletion_grace(&ctx).await;
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let sent = drive(reconcile_pps(pps, ctx), &mut handle, answers).await;
    let deleted = deletes_of(&sent);
    assert_eq!(
        deleted,
        [
            "/api/v1/namespaces/ns/persistentvolumeclaims/data-web-0?",
            "/api/v1/namespaces/ns/pods/web-0?"
        ],
        "the other owner's claim holds the pod to no node: {sent:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_local_claim_beside_another_owners_on_the_same_node_is_not_released_for_nothing() {
    let caches = two_claims_world();
    // data-web-0 is the pod's own, on n1's local volume; logs-web-0, on another of n1's, is
    // another owner's: it would hold the re-created pod to n1 still.
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(foreign_logs_claim(on_host("n1")));
    let (ctx, mut handle, mut events) = context_with_events(caches);
    after_n1s_deletion_grace(&ctx).await;
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let sent = drive(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
    kept_for_nothing(&sent, &mut events, &ctx, &["owned by Backup b", "web-0"]).await;
}

/// Asserts a look that read the waiting pod's two claims (and their volumes) and released
/// nothing: its `LocalVolumeKept` Warning names each of `words`, and no claim is counted.
async fn kept_for_nothing(sent: &[Sent], events: &mut Handle, ctx: &Context, words: &[&str]) {
    assert!(sent.iter().all(|s| s.method == Method::GET), "{sent:?}");
    assert_eq!(sent.len(), 4, "{sent:?}");
    let note = event_note(events, "LocalVolumeKept").await;
    assert!(words.iter().all(|w| note.contains(w)), "{note}");
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_local_volumes_released_total{reason=\"node_gone\"} 0")
    );
}

#[tokio::test]
async fn a_node_within_its_grace_period_releases_nothing_and_reads_nothing() {
    let caches = waiting_world();
    let since = k8s_openapi::jiff::Timestamp::now().to_string();
    caches.apply_node(watcher::Event::Apply(
        serde_json::from_value(json!({"metadata": {"name": "n1", "uid": "n1-uid",
            "labels": {"kubernetes.io/hostname": "n1"}},
            "status": {"conditions": [{"type": "Ready", "status": "Unknown", "lastTransitionTime": since}]}}))
        .expect("node"),
    ));
    let (ctx, mut handle) = context(caches);
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let sent = drive(reconcile_pps(pps, ctx), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");
}

/// `web-0` of `web`, pinned by the webhook to `n1` (`kubernetes.io/hostname`), waiting.
fn pinned_waiting_pod() -> k8s_openapi::api::core::v1::Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "web-0", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "7",
            "annotations": {crate::api::INJECTED_ANNOTATION: "web",
                crate::api::INJECTED_REQUIRED_ANNOTATION: "kubernetes.io/hostname=n1"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web",
                "uid": "sts-uid", "controller": true}]},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": "n1"}, "containers": []},
        "status": {"phase": "Pending"}
    }))
    .expect("pod")
}

#[tokio::test]
async fn a_pinned_pod_is_released_unless_its_workloads_template_carries_the_webhooks_annotations() {
    // web-0 waits pinned by the webhook to n1, deleted since; its StatefulSet's template plain,
    // or copied from a pinned pod.
    let world = |template: Value| {
        let caches = Caches::new();
        let sts = GroupKind::native_statefulset();
        let mut workload = statefulset(json!({}));
        workload.data["spec"]["template"] = template;
        caches.apply_workload(&sts, watcher::Event::InitApply(workload));
        caches.apply_workload(&sts, watcher::Event::InitDone);
        caches.apply_node(watcher::Event::Apply(zone_node("n2", "z1", false)));
        caches.apply_pod(watcher::Event::Apply(pinned_waiting_pod()));
        caches
    };
    let plain = json!({"metadata": {"labels": {"app": "web"}}});
    let (ctx, mut handle) = context(world(plain));
    let deleted = json!({"apiVersion": "v1", "kind": "Status", "status": "Success"});
    let sent = drive(
        reconcile_pps(waiting_pps(json!({})), ctx),
        &mut handle,
        vec![deleted],
    )
    .await;
    let calls = calls_of(&sent);
    assert_eq!(calls, ["DELETE /api/v1/namespaces/ns/pods/web-0?"]);

    let copied = json!({"metadata": {"annotations": {
        crate::api::INJECTED_ANNOTATION: "web",
        crate::api::INJECTED_REQUIRED_ANNOTATION: "kubernetes.io/hostname=n1"}}});
    let (ctx, mut handle, mut events) = context_with_events(world(copied));
    let sent = drive(
        reconcile_pps(waiting_pps(json!({})), ctx),
        &mut handle,
        vec![],
    )
    .await;
    assert!(sent.is_empty(), "{sent:?}");
    // Said, with what to do.
    let note = event_note(&mut events, "ReleaseHeld").await;
    for named in [
        "pods web-0 wait pinned",
        "pod template carries the webhook's annotations",
        "persistent-pod-state release web-0 -n ns",
    ] {
        assert!(note.contains(named), "{named}: {note}");
    }
}

/// One pod's release refused (a policy forbidding the delete, say) holds back none of the
/// others: each is still released, its token given back, and the failure is returned once all
/// were looked at (the reconcile backs off as a failed one).
#[tokio::test]
async fn one_release_refused_holds_back_none_of_the_others() {
    let caches = Caches::new();
    let sts = GroupKind::native_statefulset();
    let mut workload = statefulset(json!({}));
    workload.data["spec"]["template"] = json!({"metadata": {"labels": {"app": "web"}}});
    caches.apply_workload(&sts, watcher::Event::InitApply(workload));
    caches.apply_workload(&sts, watcher::Event::InitDone);
    caches.apply_node(watcher::Event::Apply(zone_node("n2", "z1", false)));
    for name in ["web-0", "web-1"] {
        let mut pod = pinned_waiting_pod();
        pod.metadata.name = Some(name.into());
        pod.metadata.uid = Some(format!("{name}-uid"));
        caches.apply_pod(watcher::Event::Apply(pod));
    }
    let (ctx, mut handle) = context(caches);
    // Two releases a minute: the refused one's token comes back for the next look.
    let ctx = Arc::new(Arc::into_inner(ctx).expect("one owner").releasing(2));
    let forbidden = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "Forbidden", "code": 403, "message": "denied by a policy"});
    let deleted = json!({"apiVersion": "v1", "kind": "Status", "status": "Success"});
    let (sent, result) = drive_to_result(
        reconcile_pps(waiting_pps(json!({})), ctx.clone()),
        &mut handle,
        vec![forbidden, deleted],
    )
    .await;
    assert_eq!(
        calls_of(&sent),
        [
            "DELETE /api/v1/namespaces/ns/pods/web-0?",
            "DELETE /api/v1/namespaces/ns/pods/web-1?"
        ]
    );
    assert!(
        matches!(&result, Err(Error::Kube(kube::Error::Api(e))) if e.code == 403),
        "{result:?}"
    );
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_pods_released_total{reason=\"node_gone\"} 1"),
        "{}",
        ctx.metrics.encode()
    );
    let key = kube::runtime::reflector::ObjectRef::from_obj(waiting_pps(json!({})).as_ref());
    assert!(
        ctx.releases.take(&key).is_ok(),
        "the refused one's token is back"
    );
}

/// A stranded pod changed since it was seen (the release's delete conflicts) is read again,
/// and released only if its values are still on no usable node: its node back meanwhile, it
/// is kept.
#[tokio::test]
async fn a_stranded_pod_changed_since_is_released_only_if_still_stranded() {
    for back in [false, true] {
        let caches = Caches::new();
        let sts = GroupKind::native_statefulset();
        let mut workload = statefulset(json!({}));
        workload.data["spec"]["template"] = json!({"metadata": {"labels": {"app": "web"}}});
        caches.apply_workload(&sts, watcher::Event::InitApply(workload));
        caches.apply_workload(&sts, watcher::Event::InitDone);
        caches.apply_node(watcher::Event::Apply(zone_node("n2", "z1", false)));
        caches.apply_pod(watcher::Event::Apply(pinned_waiting_pod()));
        let (ctx, mut handle) = context(caches.clone());
        // One release a minute: one kept gives its token back.
        let ctx = Arc::new(Arc::into_inner(ctx).expect("one owner").releasing(1));
        let reconcile = reconcile_pps(waiting_pps(json!({})), ctx.clone());
        tokio::pin!(reconcile);
        let mut calls = Vec::new();
        let result = loop {
            tokio::select! {
                result = &mut reconcile => break result,
                request = handle.next_request() => {
                    let (request, respond) = request.expect("the client is alive");
                    calls.push(format!("{} {}", request.method(), request.uri().path()));
                    let (status, body) = match (request.method().as_str(), calls.len()) {
                        ("DELETE", 1) => (409, json!({"apiVersion": "v1", "kind": "Status",
                            "status": "Failure", "reason": "Conflict", "code": 409})),
                        ("GET", _) => {
                            if back {
                                caches.apply_node(watcher::Event::Apply(zone_node("n1", "z1", false)));
                            }
                            let mut pod = serde_json::to_value(pinned_waiting_pod()).expect("pod");
                            pod["metadata"]["resourceVersion"] = json!("8");
                            (200, pod)
                        }
                        _ => (200, json!({"apiVersion": "v1", "kind": "Status", "status": "Success"})),
                    };
                    respond.send_response(
                        Response::builder()
                            .status(status)
                            .header("content-type", "application/json")
                            .body(Body::from(serde_json::to_vec(&body).expect("json")))
                            .expect("response"),
                    );
                }
            }
        };
        assert!(result.is_ok(), "{result:?}");
        let deletes = calls.iter().filter(|c| c.starts_with("DELETE")).count();
        assert_eq!(
            deletes,
            if back { 1 } else { 2 },
            "node back: {back}; {calls:?}"
        );
        let key = kube::runtime::reflector::ObjectRef::new("web").within("ns");
        assert_eq!(
            ctx.releases.take(&key).is_ok(),
            back,
            "the token given back: {back}"
        );
    }
}

/// web-0 waits pinned by the webhook to n1, deleted since; the status has a generation to
/// record.
fn stranded_with_a_generation_to_record() -> (Arc<Caches>, PersistentPodState) {
    let caches = waiting_world();
    caches.apply_pod(watcher::Event::Apply(pinned_waiting_pod()));
    let mut pps = (*waiting_pps(json!({}))).clone();
    if let Some(status) = pps.status.as_mut() {
        status.observed_generation = 1;
    }
    (caches, pps)
}

#[tokio::test]
async fn a_status_write_refused_for_good_does_not_keep_a_stranded_pod_waiting() {
    // Every status write is refused (say, by a policy).
    let (caches, pps) = stranded_with_a_generation_to_record();
    let refused = |code: u16| {
        json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "Forbidden", "code": code, "message": "denied by policy"})
    };
    let deleted = json!({"apiVersion": "v1", "kind": "Status", "status": "Success"});
    let no_claim = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "NotFound", "code": 404, "message": "not found"});
    let (ctx, mut handle) = context(caches.clone());
    let (sent, result) = drive_to_result(
        reconcile_pps(Arc::new(pps.clone()), ctx.clone()),
        &mut handle,
        vec![refused(403), no_claim, deleted],
    )
    .await;
    let calls = calls_of(&sent);
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert!(calls[0].starts_with("PATCH "), "{calls:?}");
    assert_eq!(calls[2], "DELETE /api/v1/namespaces/ns/pods/web-0?");
    assert!(result.is_ok(), "the releases' next look is kept");
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_reconcile_errors_total{controller=\"status\"} 1"),
        "the failed write is counted"
    );
    // A conflict is stale data: nothing else is done, the next reconcile computes again.
    let (ctx, mut handle) = context(caches);
    let (sent, result) = drive_to_result(
        reconcile_pps(Arc::new(pps), ctx),
        &mut handle,
        vec![refused(409)],
    )
    .await;
    assert_eq!(sent.len(), 1);
    assert!(result.is_err());
}

#[tokio::test]
async fn a_release_failing_after_a_failed_status_write_is_one_failure_not_two() {
    // As above, and the stranded pod's delete fails too (the API server at fault).
    let (caches, pps) = stranded_with_a_generation_to_record();
    let refused = |code: u16, reason: &str| {
        json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": reason, "code": code, "message": "refused"})
    };
    let (ctx, mut handle) = context(caches);
    let (sent, result) = drive_to_result(
        reconcile_pps(Arc::new(pps.clone()), ctx.clone()),
        &mut handle,
        vec![
            refused(403, "Forbidden"),
            refused(404, "NotFound"),
            refused(500, "InternalError"),
        ],
    )
    .await;
    let calls = calls_of(&sent);
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert_eq!(calls[2], "DELETE /api/v1/namespaces/ns/pods/web-0?");
    // As the controller runs it: a failure goes to the error policy, which counts it again.
    let action = match result {
        Ok(action) => action,
        Err(error) => super::pps_error_policy(Arc::new(pps.clone()), &error, ctx.clone()),
    };
    let after = requeue_after(&action).expect("requeued");
    assert!(
        after <= Duration::from_secs(1),
        "looked at again after the write's backoff: {action:?}"
    );
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_reconcile_errors_total{controller=\"status\"} 1"),
        "one failed reconcile, counted once"
    );
    // Counted once in the backoff too: the next failure's delay is the second step's (0.5-1 s),
    // not the third's (1-2 s).
    let key = super::retry::failure_key("pps", &pps);
    assert!(ctx.failures.failed(key) < Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn a_claim_changed_before_its_delete_keeps_the_pod_and_is_read_again_soon() {
    let (ctx, mut handle) = context(waiting_world());
    after_n1s_deletion_grace(&ctx).await;
    // One release a minute: the look in a moment must not find the rate spent.
    let ctx = Arc::new(Arc::into_inner(ctx).expect("one owner").releasing(1));
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(still_waiting());
    answers.push(
        json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "Conflict", "code": 409, "message": "the object has been modified"}),
    );
    let (sent, action) =
        drive_to_action(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
    assert_eq!(
        sent.last()
            .map(|s| (s.method.clone(), s.path_and_query.clone())),
        Some((
            Method::DELETE,
            "/api/v1/namespaces/ns/persistentvolumeclaims/data-web-0?".into()
        )),
        "the pod is not deleted after its claim's refused delete: {sent:?}"
    );
    // Claims are not watched: nothing else would bring the pod back before the resync.
    let after = requeue_after(&action).expect("requeued");
    assert!(after <= Duration::from_secs(2), "{action:?}");
    // Nothing was released: the release taken for it is given back (at 1 a minute, the next
    // look would otherwise wait for the rate).
    let key = kube::runtime::reflector::ObjectRef::new("web").within("ns");
    assert!(
        ctx.releases.take(&key).is_ok(),
        "the release was given back"
    );
    // No claim of it deleted here: a look that finds none left (another's of that name, not
    // on the node) deletes nothing.
    assert_eq!(ctx.claims_deleted_of("pod-uid"), None);
}

/// `waiting_world`'s pod `web-0` scheduled to `n2` and not Ready, as the caches hold it.
fn scheduled_elsewhere(caches: &Caches) {
    caches.apply_pod(watcher::Event::Apply(
        serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "9",
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web",
                    "uid": "sts-uid", "controller": true}]},
            "spec": {"containers": [], "nodeName": "n2"},
            "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]}
        }))
        .expect("pod"),
    ));
}

#[tokio::test]
async fn a_pod_whose_node_local_data_moved_has_its_state_name_no_node_with_no_memory_of_a_release()
{
    // Nothing in the context knows of a release (another replica made it, or an operator by
    // hand): web-0 runs on n2, not Ready, its state names n1, and its claim is bound to a
    // volume only n2 can mount. n2 is in the recorded zone, which stays.
    data_moved_to("z1").await;
}

#[tokio::test]
async fn a_pod_whose_node_local_data_moved_to_another_zone_has_its_state_forget_the_zone_too() {
    // The same, n2 in another zone: a pod created again pinned to z1 could never reach its
    // data, so the zone goes with the node.
    data_moved_to("z2").await;
}

/// `web-0` scheduled, not Ready, on `n2` in `zone`, its claim bound to a volume only `n2` can
/// mount, its state naming `n1` in `z1`: the state names no node, nor `z1` unless `n2` is there.
async fn data_moved_to(zone: &str) {
    let caches = waiting_world();
    caches.apply_node(watcher::Event::Apply(zone_node("n2", zone, false)));
    scheduled_elsewhere(&caches);
    let (ctx, mut handle, mut events) = context_with_events(caches);
    let pps = waiting_pps(json!({}));
    let kept = if zone == "z1" {
        json!({"nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}})
    } else {
        json!({})
    };
    let mut forgotten = serde_json::to_value(pps.as_ref()).expect("pps");
    forgotten["status"]["podStates"]["web-0"] = kept.clone();
    let mut answers = claim_and_volume(on_host("n2"));
    answers.push(forgotten);
    let sent = drive(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
    let calls: Vec<(String, &str)> = sent
        .iter()
        .map(|s| (s.method.to_string(), s.path_and_query.as_str()))
        .collect();
    assert_eq!(
        calls,
        [
            (
                "GET".into(),
                "/api/v1/namespaces/ns/persistentvolumeclaims/data-web-0"
            ),
            ("GET".into(), "/api/v1/persistentvolumes/pv-1"),
            (
                "PATCH".into(),
                "/apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates/web/status?"
            ),
        ]
    );
    // Provided the state is still the one read.
    assert_eq!(
        sent[2].body,
        json!([
            {"op": "test", "path": "/status/podStates/web-0", "value": {
                "nodeName": "n1", "nodeUID": "n1-uid", "nodeTopologyLabels":
                {"topology.kubernetes.io/zone": "z1", "kubernetes.io/hostname": "n1"}}},
            {"op": "replace", "path": "/status/podStates/web-0", "value": kept},
        ])
    );
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_state_nodes_forgotten_total 1"),
        "counted"
    );
    let note = event_note(&mut events, "NodeForgotten").await;
    for named in ["web-0", "node n1", "data-web-0", "pv-1", "node n2"] {
        assert!(note.contains(named), "{named}: {note}");
    }
    assert_eq!(
        note.contains("nor topology.kubernetes.io/zone=z1"),
        zone != "z1",
        "{note}"
    );
}

#[tokio::test]
async fn a_pod_scheduled_elsewhere_with_its_data_in_place_keeps_its_state_and_is_read_once() {
    let failed = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "Invalid", "code": 422, "message": "testing value /status/podStates/web-0 failed"});
    let caches = waiting_world();
    scheduled_elsewhere(&caches);
    let (ctx, mut handle) = context(caches);
    let pps = waiting_pps(json!({}));
    // Its claim on a volume only n1 can mount (a pod held there would not run on n2; here the
    // read is what counts): nothing moved, and nothing written.
    let sent = drive(
        reconcile_pps(pps.clone(), ctx.clone()),
        &mut handle,
        claim_and_volume(on_host("n1")),
    )
    .await;
    assert_eq!(sent.len(), 2, "the claim and its volume read: {sent:?}");
    // Judged once: not read again while the pod and its state stay.
    let sent = drive(reconcile_pps(pps.clone(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");

    // A read that fails is tried again after a while, not at every look meanwhile.
    let unavailable = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "ServiceUnavailable", "code": 503, "message": "try later"});
    let caches = waiting_world();
    scheduled_elsewhere(&caches);
    let (ctx, mut handle) = context(caches);
    let (sent, action) = drive_to_action(
        reconcile_pps(pps.clone(), ctx.clone()),
        &mut handle,
        vec![unavailable],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    let after = requeue_after(&action).expect("requeued");
    assert!(
        after > Duration::from_secs(2) && after <= Duration::from_secs(30),
        "{action:?}"
    );
    let sent = drive(reconcile_pps(pps.clone(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "not read again at once: {sent:?}");

    // Observed only: the states are another injector's to act on; nothing is read.
    let caches = waiting_world();
    scheduled_elsewhere(&caches);
    let (ctx, mut handle) = context(caches);
    let observed = waiting_pps(json!({"persistent-pod-state.io/mode": "observe"}));
    let sent = drive(reconcile_pps(observed, ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");

    // Its state recorded again meanwhile (the cache behind): the patch's `test` fails, nothing
    // changes, and the pod is looked at again soon.
    let caches = waiting_world();
    scheduled_elsewhere(&caches);
    let (ctx, mut handle) = context(caches);
    let mut answers = claim_and_volume(on_host("n2"));
    answers.push(failed);
    let (sent, action) =
        drive_to_action(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
    assert_eq!(sent.len(), 3, "{sent:?}");
    let after = requeue_after(&action).expect("requeued");
    assert!(after <= Duration::from_secs(2), "{action:?}");
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_state_nodes_forgotten_total 0"),
        "not counted"
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiting_pod_refused_as_changed_is_read_again_before_it_is_released() {
    let (ctx, mut handle) = context(waiting_world());
    after_n1s_deletion_grace(&ctx).await;
    let pps = waiting_pps(json!({"persistent-pod-state.io/release-local-volumes": "true"}));
    let mut answers = claim_and_volume(on_host("n1"));
    answers.extend(still_waiting());
    let conflict = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "Conflict", "code": 409, "message": "the object has been modified"});
    answers.push(json!({"apiVersion": "v1", "kind": "Status", "status": "Success"}));
    // Refused as changed (version 8 now): read again, still waiting, deleted at version 8.
    answers.push(conflict);
    answers.push(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "8"},
        "spec": {"containers": []}, "status": {"phase": "Pending"}}));
    answers.push(json!({"apiVersion": "v1", "kind": "Status", "status": "Success"}));
    answers.extend(released().pop());
    let sent = drive(reconcile_pps(pps, ctx.clone()), &mut handle, answers).await;
    let calls = calls_of(&sent);
    assert_eq!(calls.len(), 9, "{calls:?}");
    assert_eq!(calls[6], "GET /api/v1/namespaces/ns/pods/web-0");
    assert!(calls[8].starts_with("PATCH "), "{calls:?}");
    assert_eq!(
        sent[7].body["preconditions"],
        json!({"uid": "pod-uid", "resourceVersion": "8"})
    );
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_pods_released_total{reason=\"node_gone\"} 1")
    );
}

#[test]
fn what_was_reported_forgets_deleted_pps_now_and_then_not_on_every_look() {
    use super::{FORGET_EVERY, Reported};
    use kube::runtime::reflector::ObjectRef;
    let caches = Caches::new();
    caches.apply_pps(watcher::Event::Apply(pps(json!({}))));
    let kept = ObjectRef::<PersistentPodState>::new("web").within("ns");
    let gone = ObjectRef::<PersistentPodState>::new("deleted").within("ns");
    let reported = Reported::<u32>::default();
    {
        let (mut map, forgot) = reported.lock(&caches);
        assert!(forgot, "the first look forgets");
        map.by_pps.insert(kept.clone(), 1);
        map.by_pps.insert(gone.clone(), 2);
    }
    let (map, forgot) = reported.lock(&caches);
    assert!(!forgot, "not again within {FORGET_EVERY:?}");
    assert_eq!(map.by_pps.len(), 2);
    drop(map);
    if let Some(long_ago) = std::time::Instant::now().checked_sub(FORGET_EVERY) {
        crate::sync::lock(&reported.0).forgotten_at = Some(long_ago);
        let (map, forgot) = reported.lock(&caches);
        assert!(forgot);
        assert_eq!(
            map.by_pps.keys().collect::<Vec<_>>(),
            [&kept],
            "the deleted one is forgotten"
        );
    }
}

#[tokio::test]
async fn a_shared_placement_is_placed_again_as_soon_as_a_node_changes() {
    use crate::placement::Health;
    use std::collections::BTreeMap;
    let caches = world();
    let (ctx, _server) = context(caches.clone());
    let zone = BTreeMap::from([("topology.kubernetes.io/zone".to_string(), "z1".to_string())]);
    let health = Health::now(ctx.node_lost_after);
    assert!(
        ctx.place_required(&zone, &health).dropped.is_none(),
        "n1 is usable"
    );
    assert!(
        ctx.place_required(&zone, &health).dropped.is_none(),
        "reused"
    );
    // n1 is taken out of service: seen by the next placement, not after the memo's time.
    caches.apply_node(watcher::Event::Apply(
        serde_json::from_value(json!({"metadata": {"name": "n1",
            "labels": {"topology.kubernetes.io/zone": "z1", "kubernetes.io/hostname": "n1"}},
            "spec": {"taints": [{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}]}}))
        .expect("node"),
    ));
    assert!(
        ctx.place_required(&zone, &health).dropped.is_some(),
        "the only node of z1 is lost"
    );
}

/// Node `name` in `zone`, taken out of service when `lost` (lost at once).
fn zone_node(name: &str, zone: &str, lost: bool) -> k8s_openapi::api::core::v1::Node {
    let taints = if lost {
        json!([{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}])
    } else {
        json!([])
    };
    serde_json::from_value(json!({"metadata": {"name": name,
        "labels": {"topology.kubernetes.io/zone": zone, "kubernetes.io/hostname": name}},
        "spec": {"taints": taints}}))
    .expect("node")
}

/// PersistentPodState `name` of StatefulSet `name`, its pod `name-0` recorded on `node` in
/// `zone` (the zone required).
fn pps_on(name: &str, node: &str, zone: &str) -> PersistentPodState {
    serde_json::from_value(json!({
        "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
        "metadata": {"name": name, "namespace": "ns", "uid": format!("{name}-uid")},
        "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name},
                 "requiredPersistentTopology": {"keys": ["topology.kubernetes.io/zone"]}},
        "status": {"podStates": {format!("{name}-0"): {"nodeName": node,
            "nodeTopologyLabels": {"topology.kubernetes.io/zone": zone, "kubernetes.io/hostname": node}}}}
    }))
    .expect("pps")
}

#[tokio::test]
async fn a_node_health_change_reconciles_only_the_pps_it_concerns() {
    use crate::placement::Health;
    use crate::state::NodeHealthChange;
    use kube::runtime::reflector::ObjectRef;
    let caches = Caches::new();
    for node in [
        zone_node("a1", "za", false),
        zone_node("a2", "za", false),
        zone_node("b1", "zb", false),
    ] {
        caches.apply_node(watcher::Event::Apply(node));
    }
    // on-a1 records a1; elsewhere-in-za records a node gone since (za has others); on-b1
    // records b1; waiting has its re-created pod waiting, steered to a zone no node has.
    let all = [
        pps_on("on-a1", "a1", "za"),
        pps_on("elsewhere-in-za", "old-a", "za"),
        pps_on("on-b1", "b1", "zb"),
        pps_on("waiting", "old-c", "zc"),
    ];
    for p in &all {
        caches.apply_pps(watcher::Event::Apply(p.clone()));
    }
    caches.apply_pod(watcher::Event::Apply(
        serde_json::from_value(json!({
            "metadata": {"name": "waiting-0", "namespace": "ns", "uid": "w0",
                "annotations": {crate::api::INJECTED_ANNOTATION: "waiting",
                                crate::api::INJECTED_REQUIRED_ANNOTATION: "topology.kubernetes.io/zone=zc"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "waiting",
                                     "uid": "waiting-sts", "controller": true}]},
            "spec": {"containers": []}
        }))
        .expect("pod"),
    ));
    let (ctx, _server) = context(caches.clone());
    let health = Health::now(ctx.node_lost_after);
    for p in &all {
        let status = p.status.clone().unwrap_or_default();
        super::report::unplaceable(&ctx, p, &status, &health);
    }
    let lose = |name: &str, zone: &str| {
        let node = zone_node(name, zone, true);
        caches.apply_node(watcher::Event::Apply(node));
        let labels = std::collections::BTreeMap::from([
            ("topology.kubernetes.io/zone".to_string(), zone.to_string()),
            ("kubernetes.io/hostname".to_string(), name.to_string()),
        ]);
        let mut concerned: Vec<String> = ctx
            .concerned_by(&[NodeHealthChange {
                name: name.into(),
                labels,
                taints_only: false,
            }])
            .iter()
            .map(|r: &ObjectRef<PersistentPodState>| r.name.clone())
            .collect();
        concerned.sort();
        concerned
    };
    assert_eq!(
        lose("a2", "za"),
        ["waiting"],
        "za keeps a1: nothing recorded in it changes"
    );
    assert_eq!(
        lose("a1", "za"),
        ["elsewhere-in-za", "on-a1", "waiting"],
        "a1 was recorded by on-a1, and za is lost for elsewhere-in-za; on-b1 is not concerned"
    );
    assert_eq!(lose("b1", "zb"), ["on-b1", "waiting"]);

    // Only the taints pods must tolerate changed: what is recorded on the node is not
    // concerned, only a pod waiting pinned to values the node carries.
    let tainted = |name: &str, zone: &str| {
        let labels = std::collections::BTreeMap::from([
            ("topology.kubernetes.io/zone".to_string(), zone.to_string()),
            ("kubernetes.io/hostname".to_string(), name.to_string()),
        ]);
        ctx.concerned_by(&[NodeHealthChange {
            name: name.into(),
            labels,
            taints_only: true,
        }])
        .iter()
        .map(|r: &ObjectRef<PersistentPodState>| r.name.clone())
        .collect::<Vec<_>>()
    };
    assert_eq!(tainted("c1", "zc"), ["waiting"]);
    assert!(tainted("a1", "za").is_empty(), "on-a1 is not concerned");
}

mod waiting_pod_deletes {
    //! What deleting a waiting pod makes of a pod that changed since it was seen.

    use super::*;
    use crate::controller::delete::{Deleted, delete_waiting_pod};
    use crate::leader::Fence;
    use k8s_openapi::api::core::v1::Pod;
    use kube::Api;

    /// A JSON response with `status`.
    fn answer(status: u16, body: &Value) -> Response<Body> {
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(body).expect("json")))
            .expect("response")
    }

    /// Deletes `web-0` (uid `old`, at resourceVersion 1) against a mock that refuses the delete
    /// with a conflict and then shows `now` under that name (and accepts a second delete):
    /// what it made of it, and the methods of the requests sent.
    async fn delete_after_a_conflict(now: Value) -> (Deleted, Vec<Method>) {
        let (result, methods) = delete_after_a_conflict_fenced(now, false, &|_| true).await;
        (result.expect("no API error"), methods)
    }

    /// As [`delete_after_a_conflict`]; with `close`, this replica's hold on the Lease ends as
    /// the conflict arrives; `still` judges the pod read again.
    async fn delete_after_a_conflict_fenced(
        now: Value,
        close: bool,
        still: &(dyn Fn(&Pod) -> bool + Sync),
    ) -> (Result<Deleted, Error>, Vec<Method>) {
        let (client, mut handle) = mock_client();
        let api: Api<Pod> = Api::namespaced(client, "ns");
        let fence = Fence::open();
        let delete = delete_waiting_pod(
            &api,
            &fence,
            ("ns", "web-0"),
            ("old", Some("1".into())),
            still,
        );
        tokio::pin!(delete);
        let mut methods = Vec::new();
        loop {
            tokio::select! {
                result = &mut delete => return (result, methods),
                request = handle.next_request() => {
                    let (request, respond) = request.expect("the client is alive");
                    let method = request.method().clone();
                    let first_delete = method == Method::DELETE && !methods.contains(&Method::DELETE);
                    let response = if first_delete {
                        if close {
                            fence.close();
                        }
                        answer(409, &json!({"kind": "Status", "apiVersion": "v1",
                            "status": "Failure", "reason": "Conflict", "code": 409,
                            "message": "Precondition failed"}))
                    } else {
                        answer(200, &now)
                    };
                    methods.push(method);
                    respond.send_response(response);
                }
            }
        }
    }

    #[tokio::test]
    async fn a_hold_on_the_lease_lost_between_the_two_deletes_stops_the_second() {
        let (result, methods) =
            delete_after_a_conflict_fenced(pod("old", json!({})), true, &|_| true).await;
        assert!(matches!(result, Err(Error::Fenced(_))), "{result:?}");
        assert_eq!(methods, [Method::DELETE, Method::GET], "no second DELETE");
    }

    fn pod(uid: &str, extra: Value) -> Value {
        let mut pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0",
            "namespace": "ns", "uid": uid, "resourceVersion": "2"}, "spec": {"containers": []}});
        json_patch::merge(&mut pod, &extra);
        pod
    }

    #[tokio::test]
    async fn a_pod_re_created_meanwhile_counts_as_deleted_by_another_and_is_not_deleted() {
        // The StatefulSet controller deletes a pod whose claim is being deleted and creates
        // both again: the waiting pod is gone, released all the same.
        let (deleted, methods) = delete_after_a_conflict(pod("new", json!({}))).await;
        assert_eq!(deleted, Deleted::Already);
        assert_eq!(
            methods,
            [Method::DELETE, Method::GET],
            "the new pod is left alone"
        );
    }

    #[tokio::test]
    async fn a_pod_being_deleted_meanwhile_counts_as_deleted_by_another() {
        let being_deleted = json!({"metadata": {"deletionTimestamp": "2026-11-27T00:00:00Z"}});
        let (deleted, methods) = delete_after_a_conflict(pod("old", being_deleted)).await;
        assert_eq!(deleted, Deleted::Already);
        assert_eq!(methods, [Method::DELETE, Method::GET]);
    }

    #[tokio::test]
    async fn a_pod_scheduled_meanwhile_is_kept_and_one_still_waiting_is_deleted_at_its_version() {
        let scheduled = json!({"spec": {"nodeName": "node-a"}});
        let (deleted, methods) = delete_after_a_conflict(pod("old", scheduled)).await;
        assert_eq!(deleted, Deleted::Kept);
        assert_eq!(methods, [Method::DELETE, Method::GET]);
        let (deleted, methods) = delete_after_a_conflict(pod("old", json!({}))).await;
        assert_eq!(deleted, Deleted::Now);
        assert_eq!(methods, [Method::DELETE, Method::GET, Method::DELETE]);
    }

    #[tokio::test]
    async fn a_pod_no_longer_to_be_released_as_read_again_is_kept() {
        // A toleration added between the decision and the delete, say.
        let tolerating = json!({"spec": {"tolerations": [{"operator": "Exists"}]}});
        let untolerating = |p: &Pod| {
            p.spec
                .as_ref()
                .and_then(|s| s.tolerations.as_ref())
                .is_none_or(Vec::is_empty)
        };
        let (deleted, methods) =
            delete_after_a_conflict_fenced(pod("old", tolerating), false, &untolerating).await;
        assert_eq!(deleted.expect("no API error"), Deleted::Kept);
        assert_eq!(methods, [Method::DELETE, Method::GET], "no second DELETE");
    }
}

/// A node that is unhealthy but not lost yet is handed over again just after it counts as lost
/// (no event comes then), at the time its latest change gives; one unhealthy already, with no
/// change (a term's start, a relist), is found by the scan of every node.
#[tokio::test(start_paused = true)]
async fn a_node_unhealthy_now_is_looked_at_again_once_it_counts_as_lost() {
    use futures::StreamExt;

    let change = |name: &str| crate::state::NodeHealthChange {
        name: name.to_owned(),
        labels: Default::default(),
        taints_only: false,
    };
    // How long until each node counts as lost, as judged when its change comes.
    let lost_at = |name: &str| match name {
        "dying" => Some(Duration::from_secs(300)),
        "soon" => Some(Duration::from_secs(60)),
        _ => None,
    };
    // "seeded" is unhealthy from the start, lost at 120 s; no change of it ever comes.
    let started = tokio::time::Instant::now();
    let unhealthy = move || {
        Duration::from_secs(120)
            .checked_sub(started.elapsed())
            .filter(|left| !left.is_zero())
            .map(|left| (change("seeded"), left))
            .into_iter()
            .collect()
    };
    let (tx, rx) = futures::channel::mpsc::unbounded();
    let mut changes = Box::pin(super::with_losses(rx, lost_at, unhealthy));
    // Within 10 min (of the paused clock): none of this may wait for ever.
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(600), changes.next())
            .await
            .expect("within 10 min")
    };
    for name in ["healthy", "dying", "soon"] {
        tx.unbounded_send(change(name)).expect("open");
        assert_eq!(next().await.map(|c| c.name), Some(name.to_owned()));
    }
    assert!(started.elapsed() < Duration::from_secs(1), "at once");
    // "soon" changes again 30 s later: its timer is the latest change's (one per node).
    tokio::time::sleep(Duration::from_secs(30)).await;
    tx.unbounded_send(change("soon")).expect("open");
    assert_eq!(next().await.map(|c| c.name), Some("soon".to_owned()));
    for (name, at) in [("soon", 90), ("seeded", 120), ("dying", 300)] {
        let again = next().await.expect("delivered again");
        assert_eq!(again.name, name);
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_secs(at) && elapsed < Duration::from_secs(at + 1),
            "{name}: {elapsed:?}"
        );
    }
    // Nothing else is due (the scans go on, finding nothing new); the stream ends with the
    // changes.
    let quiet = tokio::time::timeout(Duration::from_secs(3600), changes.next()).await;
    assert!(quiet.is_err(), "{quiet:?}");
    drop(tx);
    assert!(changes.next().await.is_none());
}

/// Node health changes arriving within the window after a first one are looked at in one pass
/// (at most `NODE_CHANGES_AT_ONCE`), a later one in the next; the batches end with the channel.
#[tokio::test(start_paused = true)]
async fn node_health_changes_are_gathered_for_a_window_then_looked_at_together() {
    use futures::StreamExt;

    let change = |i: usize| crate::state::NodeHealthChange {
        name: format!("node-{i}"),
        labels: Default::default(),
        taints_only: false,
    };
    let (tx, rx) = futures::channel::mpsc::unbounded();
    let mut batches = Box::pin(super::gathered(rx));
    tx.unbounded_send(change(0)).expect("open");
    let sender = {
        let tx = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(super::NODE_CHANGES_GATHERED_FOR / 2).await;
            for i in 1..300 {
                tx.unbounded_send(change(i)).expect("open");
            }
            tokio::time::sleep(super::NODE_CHANGES_GATHERED_FOR * 2).await;
            tx.unbounded_send(change(300)).expect("open");
        })
    };
    let started = tokio::time::Instant::now();
    let first = batches.next().await.expect("a batch");
    let names = |batch: &[crate::state::NodeHealthChange]| -> Vec<String> {
        batch.iter().map(|c| c.name.clone()).collect()
    };
    assert_eq!(first.len(), super::NODE_CHANGES_AT_ONCE);
    assert_eq!(
        names(&first),
        (0..super::NODE_CHANGES_AT_ONCE)
            .map(|i| format!("node-{i}"))
            .collect::<Vec<_>>()
    );
    // Full before the window ended: not held back until it does.
    assert!(started.elapsed() < super::NODE_CHANGES_GATHERED_FOR);
    let second = batches.next().await.expect("a batch");
    assert_eq!(names(&second).first().map(String::as_str), Some("node-256"));
    assert_eq!(second.len(), 300 - super::NODE_CHANGES_AT_ONCE);
    let third = batches.next().await.expect("a batch");
    assert_eq!(names(&third), vec!["node-300".to_owned()]);
    sender.await.expect("sender");
    drop(tx);
    assert!(batches.next().await.is_none());
}

/// Node `name` in zone z1, not ready for the last `for_secs` seconds.
fn not_ready_node(name: &str, for_secs: i64) -> k8s_openapi::api::core::v1::Node {
    let since = k8s_openapi::jiff::Timestamp::now()
        - k8s_openapi::jiff::SignedDuration::from_secs(for_secs);
    serde_json::from_value(
        json!({"metadata": {"name": name, "uid": format!("{name}-uid"),
        "labels": {"topology.kubernetes.io/zone": "z1", "kubernetes.io/hostname": name}},
        "status": {"conditions": [{"type": "Ready", "status": "False",
            "lastTransitionTime": since.to_string()}]}}),
    )
    .expect("node")
}

#[tokio::test]
async fn a_pin_is_looked_at_again_when_the_last_node_it_can_go_to_would_count_as_lost() {
    // web-0 waits pinned to zone z1, recorded on n1, lost already (not ready for 400 s, lost
    // after 300); n2, the zone's other node, has been not ready for 100 s: the pin is
    // released when n2 counts as lost too, in 200 s, so the reconcile asks to be called then
    // (not at the 300 s resync, since n1's own time has passed).
    let caches = Caches::new();
    let sts = GroupKind::native_statefulset();
    caches.apply_workload(&sts, watcher::Event::InitApply(statefulset(json!({}))));
    caches.apply_workload(&sts, watcher::Event::InitDone);
    caches.apply_node(watcher::Event::Apply(not_ready_node("n1", 400)));
    caches.apply_node(watcher::Event::Apply(not_ready_node("n2", 100)));
    let pinned = crate::api::encode_required([("topology.kubernetes.io/zone", "z1")]);
    caches.apply_pod(watcher::Event::Apply(
        serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "7",
                "annotations": {crate::api::INJECTED_ANNOTATION: "web",
                    crate::api::INJECTED_REQUIRED_ANNOTATION: pinned},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web",
                    "uid": "sts-uid", "controller": true}]},
            "spec": {"nodeSelector": {"topology.kubernetes.io/zone": "z1"}, "containers": []},
            "status": {"phase": "Pending"}
        }))
        .expect("pod"),
    ));
    let (ctx, mut handle) = context(caches);
    let (sent, action) = drive_to_action(
        reconcile_pps(waiting_pps(json!({})), ctx),
        &mut handle,
        vec![],
    )
    .await;
    assert!(sent.is_empty(), "nothing released yet: {sent:?}");
    let at = |secs| kube::runtime::controller::Action::requeue(Duration::from_secs(secs));
    assert!(
        (199..=201).any(|secs| action == at(secs)),
        "looked at again when n2 counts as lost: {action:?}"
    );
}

/// The workload of pods pinned by a PersistentPodState that is gone is read once a look,
/// however many of its pods wait.
#[tokio::test]
async fn pods_pinned_by_a_pps_that_is_gone_read_their_workload_once_a_look() {
    let caches = Caches::new();
    let sts = GroupKind::native_statefulset();
    caches.apply_workload(&sts, watcher::Event::InitApply(statefulset(json!({}))));
    caches.apply_workload(&sts, watcher::Event::InitDone);
    caches.apply_node(watcher::Event::Apply(zone_node("n2", "z1", false)));
    for name in ["web-0", "web-1"] {
        caches.apply_pod(watcher::Event::Apply(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                    "resourceVersion": "7",
                    "annotations": {crate::api::INJECTED_ANNOTATION: "gone",
                        crate::api::INJECTED_REQUIRED_ANNOTATION: "kubernetes.io/hostname=n9"},
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet",
                        "name": "web", "uid": "sts-uid", "controller": true}]},
                "spec": {"nodeSelector": {"kubernetes.io/hostname": "n9"}, "containers": []},
                "status": {"phase": "Pending"}
            }))
            .expect("pod"),
        ));
    }
    let (ctx, mut handle) = context(caches);
    let not_found = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "NotFound", "code": 404, "message": "not found"});
    let web = serde_json::to_value(statefulset(json!({}))).expect("json");
    let deleted = json!({"apiVersion": "v1", "kind": "Status", "status": "Success"});
    let sweep = async {
        super::reconcile::release_orphaned_pins(&ctx)
            .await
            .map(|()| kube::runtime::controller::Action::await_change())
    };
    let sent = drive(
        sweep,
        &mut handle,
        vec![
            not_found,
            json!({"apiVersion": "apps/v1", "kind": "StatefulSetList", "metadata": {}, "items": [web]}),
            deleted.clone(),
            deleted,
        ],
    )
    .await;
    assert_eq!(
        calls_of(&sent),
        [
            "GET /apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates/gone",
            "GET /apis/apps/v1/namespaces/ns/statefulsets?&fieldSelector=metadata.name%3Dweb",
            "DELETE /api/v1/namespaces/ns/pods/web-0?",
            "DELETE /api/v1/namespaces/ns/pods/web-1?",
        ]
    );
}

#[tokio::test]
async fn a_pod_pinned_by_a_pps_that_is_gone_is_released_once_its_pin_is_unusable() {
    // No PersistentPodState cached: web-0 is pinned to n9 (deleted), web-1 to n2 (ready), and
    // copied-0 to n9 by a StatefulSet whose template carries the webhook's annotations.
    let pinned = |name: &str, owner: &str, node: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": "7",
                "annotations": {crate::api::INJECTED_ANNOTATION: "gone",
                    crate::api::INJECTED_REQUIRED_ANNOTATION: format!("kubernetes.io/hostname={node}")},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": owner,
                    "uid": format!("{owner}-uid"), "controller": true}]},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "containers": []},
            "status": {"phase": "Pending"}
        }))
        .expect("pod")
    };
    let world = || {
        let caches = Caches::new();
        let sts = GroupKind::native_statefulset();
        caches.apply_workload(&sts, watcher::Event::InitApply(statefulset(json!({}))));
        caches.apply_workload(&sts, watcher::Event::InitDone);
        caches.apply_node(watcher::Event::Apply(zone_node("n2", "z1", false)));
        caches.apply_pod(watcher::Event::Apply(pinned("web-0", "web", "n9")));
        caches.apply_pod(watcher::Event::Apply(pinned("web-1", "web", "n2")));
        caches.apply_pod(watcher::Event::Apply(pinned("copied-0", "copied", "n9")));
        caches
    };
    let sweep = |ctx: Arc<Context>| async move {
        super::reconcile::release_orphaned_pins(&ctx)
            .await
            .map(|()| kube::runtime::controller::Action::await_change())
    };
    let not_found = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
        "reason": "NotFound", "code": 404, "message": "not found"});
    let mut copied = serde_json::to_value(statefulset(json!({}))).expect("json");
    copied["metadata"]["name"] = json!("copied");
    copied["spec"]["template"] = json!({"metadata": {"annotations": {
        crate::api::INJECTED_ANNOTATION: "gone",
        crate::api::INJECTED_REQUIRED_ANNOTATION: "kubernetes.io/hostname=n9"}}});
    let web = serde_json::to_value(statefulset(json!({}))).expect("json");

    let (ctx, mut handle, mut events) = context_with_events(world());
    // A cache the sweep judges from known to be stale: nothing read or released.
    for kind in ["Node", "Pod", "PersistentPodState"] {
        ctx.caches.watches.set_stale_for_tests(kind, true);
        let sent = drive(sweep(ctx.clone()), &mut handle, vec![]).await;
        assert!(sent.is_empty(), "{kind} stale: {sent:?}");
        ctx.caches.watches.set_stale_for_tests(kind, false);
    }
    let sent = drive(
        sweep(ctx.clone()),
        &mut handle,
        vec![
            not_found.clone(),
            json!({"apiVersion": "apps/v1", "kind": "StatefulSetList", "metadata": {}, "items": [copied]}),
            json!({"apiVersion": "apps/v1", "kind": "StatefulSetList", "metadata": {}, "items": [web]}),
            json!({"apiVersion": "v1", "kind": "Status", "status": "Success"}),
        ],
    )
    .await;
    let calls = calls_of(&sent);
    assert_eq!(
        calls,
        [
            "GET /apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates/gone",
            "GET /apis/apps/v1/namespaces/ns/statefulsets?&fieldSelector=metadata.name%3Dcopied",
            "GET /apis/apps/v1/namespaces/ns/statefulsets?&fieldSelector=metadata.name%3Dweb",
            "DELETE /api/v1/namespaces/ns/pods/web-0?",
        ],
        "only web-0 is released"
    );
    assert_eq!(
        sent[3].body["preconditions"],
        json!({"uid": "uid-web-0", "resourceVersion": "7"})
    );
    let note = event_note(&mut events, "PodReleased").await;
    assert!(
        ["web-0", "n9", "PersistentPodState gone", "is gone"]
            .iter()
            .all(|n| note.contains(n)),
        "{note}"
    );
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_pods_released_total{reason=\"node_gone\"} 1")
    );

    // The cache lags, or cannot read the PersistentPodState: the API server has it, so
    // nothing is released.
    let (ctx, mut handle) = context(world());
    let pps_meta = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
        "metadata": {"name": "gone", "namespace": "ns", "uid": "pps-uid"}});
    let sent = drive(sweep(ctx), &mut handle, vec![pps_meta]).await;
    assert_eq!(sent.len(), 1, "{sent:?}");
}

/// A PersistentPodState naming a pod annotation no other named before records nothing until
/// the pods are listed again with it (the cache had dropped it), then records it.
#[tokio::test]
async fn a_pod_annotation_named_for_the_first_time_is_recorded_once_the_pods_are_listed_again() {
    let caches = world();
    let (ctx, mut handle) = context(caches.clone());
    let mut named = pps(json!({"observedGeneration": 2}));
    named.spec.persistent_pod_annotations =
        vec![serde_json::from_value(json!({"key": "example.com/slot"})).expect("key")];
    caches.apply_pps(watcher::Event::InitDone);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web-0", "namespace": "ns", "ownerReferences": [{"apiVersion": "apps/v1",
            "kind": "StatefulSet", "name": "web", "uid": "sts-uid", "controller": true}],
            "annotations": {"example.com/slot": "3"}},
        "spec": {"nodeName": "n1", "containers": []},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]}
    }))
    .expect("pod");
    caches.apply_pod(watcher::Event::Apply(pod.clone()));
    caches.apply_pps(watcher::Event::Apply(named.clone()));
    let named = Arc::new(named);
    let (sent, action) = drive_to_action(
        reconcile_pps(named.clone(), ctx.clone()),
        &mut handle,
        vec![],
    )
    .await;
    assert!(
        sent.is_empty(),
        "nothing recorded without the annotation: {sent:?}"
    );
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(Duration::from_secs(2))
    );

    caches.apply_pod(watcher::Event::Init);
    caches.apply_pod(watcher::Event::InitApply(pod));
    caches.apply_pod(watcher::Event::InitDone);
    let sent = drive(
        reconcile_pps(named.clone(), ctx.clone()),
        &mut handle,
        vec![serde_json::to_value(named.as_ref()).expect("json")],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        sent[0].body["status"]["podStates"]["web-0"]["annotations"],
        json!({"example.com/slot": "3"})
    );
}

/// A look at [`pinned_pps`] whose pin release is due: `web-0` read again (answered with `live`)
/// and deleted by uid and resourceVersion, counted as `pod_constraints`, with a `PodReleased`
/// Event naming it and `n1`.
async fn released_held_by_pin(
    ctx: &Arc<Context>,
    handle: &mut Handle,
    events: &mut Handle,
    live: Value,
) {
    let deleted = json!({"apiVersion": "v1", "kind": "Status", "status": "Success"});
    let sent = drive(
        reconcile_pps(pinned_pps(), ctx.clone()),
        handle,
        vec![live, deleted],
    )
    .await;
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(sent[1].method, Method::DELETE);
    assert_eq!(
        sent[1].body["preconditions"],
        json!({"uid": "pod-uid", "resourceVersion": "7"})
    );
    assert!(
        ctx.metrics
            .encode()
            .contains("pps_pods_released_total{reason=\"pod_constraints\"} 1")
    );
    let note = event_note(events, "PodReleased").await;
    assert!(note.contains("web-0") && note.contains("n1"), "{note}");
}

/// `web-0`, pinned by the webhook to `n1` (`kubernetes.io/hostname`) and waiting unscheduled,
/// with `spec` merged into its own, among `nodes`: the caches, and the pod as a read of it
/// answers.
fn pinned_waiting(
    nodes: Vec<k8s_openapi::api::core::v1::Node>,
    spec: Value,
) -> (Arc<Caches>, Value) {
    let caches = Caches::new();
    let sts = GroupKind::native_statefulset();
    caches.apply_workload(&sts, watcher::Event::InitApply(statefulset(json!({}))));
    caches.apply_workload(&sts, watcher::Event::InitDone);
    for node in nodes {
        caches.apply_node(watcher::Event::Apply(node));
    }
    let mut pod = json!({
        "metadata": {"name": "web-0", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "7",
            "annotations": {crate::api::INJECTED_ANNOTATION: "web",
                crate::api::INJECTED_REQUIRED_ANNOTATION: "kubernetes.io/hostname=n1"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web",
                "uid": "sts-uid", "controller": true}]},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": "n1"}, "containers": []},
        "status": {"phase": "Pending"}
    });
    json_patch::merge(&mut pod["spec"], &spec);
    let pod: Pod = serde_json::from_value(pod).expect("pod");
    caches.apply_pod(watcher::Event::Apply(pod.clone()));
    (caches, serde_json::to_value(pod).expect("json"))
}

/// The PersistentPodState of [`pinned_waiting`]'s pod, recorded on `n1`.
fn pinned_pps() -> Arc<PersistentPodState> {
    Arc::new(pps(
        json!({"observedGeneration": 2, "recorded": 1, "podStates": {"web-0": {
        "nodeName": "n1", "nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}}}}),
    ))
}

/// web-0 waits pinned to n1, which took a NoSchedule taint since (web-0 has `tolerations`);
/// n2, in the same zone, would take it.
fn pinned_to_a_tainted_node(tolerations: Value) -> (Arc<Caches>, Value) {
    let mut n1 = zone_node("n1", "z1", false);
    n1.spec = serde_json::from_value(
        json!({"taints": [{"key": "example.com/maintenance", "effect": "NoSchedule"}]}),
    )
    .expect("spec");
    pinned_waiting(
        vec![n1, zone_node("n2", "z1", false)],
        json!({"tolerations": tolerations}),
    )
}

#[tokio::test(start_paused = true)]
async fn a_pod_pinned_to_a_node_that_took_a_taint_it_does_not_tolerate_is_released_after_the_grace()
{
    // web-0 waits pinned to n1, which took a taint web-0 does not tolerate after it was
    // admitted; n2 would take it.
    let world = pinned_to_a_tainted_node;
    let pps = pinned_pps;

    let (caches, live) = world(json!([]));
    let (ctx, mut handle, mut events) = context_with_events(caches);
    let (sent, action) = drive_to_action(
        reconcile_pps(pps(), ctx.clone()),
        &mut handle,
        vec![live.clone()],
    )
    .await;
    let calls = calls_of(&sent);
    assert_eq!(
        calls,
        ["GET /api/v1/namespaces/ns/pods/web-0"],
        "read, not released yet"
    );
    let after = requeue_after(&action).expect("requeued");
    assert!(
        (Duration::from_secs(300)..=Duration::from_secs(301)).contains(&after),
        "looked at again once the grace is over: {action:?}"
    );
    tokio::time::advance(after).await;
    released_held_by_pin(&ctx, &mut handle, &mut events, live).await;

    // Tolerated: it waits for its node's room; read, never released.
    let tolerating = json!([{"key": "example.com/maintenance", "operator": "Exists"}]);
    let (caches, live) = world(tolerating);
    let (ctx, mut handle) = context(caches);
    let sent = drive(
        reconcile_pps(pps(), ctx.clone()),
        &mut handle,
        vec![live.clone()],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    tokio::time::advance(Duration::from_secs(301)).await;
    let sent = drive(reconcile_pps(pps(), ctx.clone()), &mut handle, vec![live]).await;
    assert!(
        sent.is_empty(),
        "judged already, neither it nor a node changed: not read again: {sent:?}"
    );
    assert!(
        crate::sync::lock(&ctx.judged)
            .values()
            .all(|j| format!("{j:?}").contains("held_since: None"))
    );

    // A taint gone within the grace releases nothing: when it comes back, the grace starts
    // again.
    let lost_after = Duration::from_secs(120);
    let (caches, live) = world(json!([]));
    let (ctx, mut handle, _) = context_lost_after(caches.clone(), lost_after);
    let sent = drive(
        reconcile_pps(pps(), ctx.clone()),
        &mut handle,
        vec![live.clone()],
    )
    .await;
    assert_eq!(sent.len(), 1, "read, held: {sent:?}");
    let n1 = |taints: Value| {
        let mut n1 = zone_node("n1", "z1", false);
        n1.spec = serde_json::from_value(json!({"taints": taints})).expect("spec");
        watcher::Event::Apply(n1)
    };
    tokio::time::advance(Duration::from_secs(10)).await;
    caches.apply_node(n1(json!([])));
    let sent = drive(reconcile_pps(pps(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");
    tokio::time::advance(Duration::from_secs(105)).await;
    caches.apply_node(n1(
        json!([{"key": "example.com/maintenance", "effect": "NoSchedule"}]),
    ));
    let (sent, action) =
        drive_to_action(reconcile_pps(pps(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "judged from the first read: {sent:?}");
    let after = requeue_after(&action).expect("requeued");
    assert!(
        after > Duration::from_secs(110),
        "the grace starts again: {action:?}"
    );
    tokio::time::advance(Duration::from_secs(10)).await;
    let sent = drive(reconcile_pps(pps(), ctx.clone()), &mut handle, vec![]).await;
    assert!(
        sent.is_empty(),
        "past the first read's grace, not released: {sent:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_term_that_ends_forgets_what_it_judged_of_waiting_pods() {
    let (caches, live) = pinned_to_a_tainted_node(json!([]));
    let (ctx, mut handle) = context(caches);
    let sent = drive(
        reconcile_pps(pinned_pps(), ctx.clone()),
        &mut handle,
        vec![live.clone()],
    )
    .await;
    assert_eq!(
        calls_of(&sent),
        ["GET /api/v1/namespaces/ns/pods/web-0"],
        "read: held by its pin from now"
    );
    // The term ends (the Lease lost); the replica leads again after the grace. Meanwhile the
    // taint may have gone and come back unseen: what was judged is not taken as held since.
    ctx.term_ended();
    assert!(crate::sync::lock(&ctx.judged).is_empty());
    tokio::time::advance(Duration::from_secs(301)).await;
    let (sent, action) = drive_to_action(
        reconcile_pps(pinned_pps(), ctx.clone()),
        &mut handle,
        vec![live],
    )
    .await;
    assert!(
        calls_of(&sent).iter().all(|c| !c.starts_with("DELETE")),
        "not released at the new term's first look: {sent:?}"
    );
    let after = requeue_after(&action).expect("requeued");
    assert!(
        after >= Duration::from_secs(300),
        "its grace starts again: {action:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_pod_pinned_to_a_node_relabeled_against_its_own_selector_is_released_after_waiting_twice_the_grace()
 {
    // web-0 waits pinned to n1, whose `disk` label no longer matches web-0's own nodeSelector
    // (relabeled after it was admitted); n2 would take it. No taint: only the wait tells.
    let disk_node = |name: &str, disk: &str| -> k8s_openapi::api::core::v1::Node {
        serde_json::from_value(
            json!({"metadata": {"name": name, "uid": format!("{name}-uid"),
            "labels": {"kubernetes.io/hostname": name, "topology.kubernetes.io/zone": "z1",
                "disk": disk}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
        )
        .expect("node")
    };
    let world = |n1_disk: &str| {
        pinned_waiting(
            vec![disk_node("n1", n1_disk), disk_node("n2", "ssd")],
            json!({"nodeSelector": {"disk": "ssd"}}),
        )
    };
    let pps = pinned_pps;
    // Another grace than the resync's 300 s, so the looks below are the grace's.
    let lost_after = Duration::from_secs(120);
    let grace = lost_after..=lost_after + Duration::from_secs(1);

    let (caches, live) = world("hdd");
    let (ctx, mut handle, mut events) = context_lost_after(caches, lost_after);
    // Just seen waiting: not read (pinned pods wait for their node's room), looked at again
    // once it has waited for the grace.
    let (sent, action) =
        drive_to_action(reconcile_pps(pps(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");
    let after = requeue_after(&action).expect("requeued");
    assert!(grace.contains(&after), "{action:?}");
    tokio::time::advance(after).await;
    // Waited for the grace: read, held by its pin alone since now, not released yet.
    let (sent, action) = drive_to_action(
        reconcile_pps(pps(), ctx.clone()),
        &mut handle,
        vec![live.clone()],
    )
    .await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].method, Method::GET);
    let after = requeue_after(&action).expect("requeued");
    assert!(grace.contains(&after), "{action:?}");
    tokio::time::advance(after).await;
    released_held_by_pin(&ctx, &mut handle, &mut events, live).await;

    // Its node still matches: it waits for the node's room; read once it has waited for the
    // grace, never released, and not read again while neither it nor a node changes.
    let (caches, live) = world("ssd");
    let (ctx, mut handle, _) = context_lost_after(caches.clone(), lost_after);
    let sent = drive(reconcile_pps(pps(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");
    tokio::time::advance(lost_after + Duration::from_secs(1)).await;
    let sent = drive(reconcile_pps(pps(), ctx.clone()), &mut handle, vec![live]).await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    // Judged again from that read as the nodes change, not read again: n1 relabeled now, the
    // pin alone holds it from this look on, and it is read again only right before its release.
    tokio::time::advance(lost_after).await;
    let sent = drive(reconcile_pps(pps(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");
    caches.apply_node(watcher::Event::Apply(disk_node("n1", "hdd")));
    let (sent, action) =
        drive_to_action(reconcile_pps(pps(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "{sent:?}");
    let after = requeue_after(&action).expect("requeued");
    assert!(grace.contains(&after), "{action:?}");
}

#[tokio::test(start_paused = true)]
async fn a_pod_pinned_away_from_its_own_claims_node_is_released_and_its_state_names_no_node() {
    // web-0 waits pinned to n1 (its state names n1), but its claim is bound to a volume only n2
    // can mount (released and bound again there, and the pod on n2 gone before any look saw it
    // scheduled): neither node can take it, for ever. n2 is in n1's zone, which stays recorded.
    pinned_away_from_its_claim(Zone::Same).await;
}

#[tokio::test(start_paused = true)]
async fn a_pod_pinned_to_a_zone_its_own_claims_node_lacks_is_released_and_its_state_names_neither()
{
    // The same, pinned to n1's zone as well, and n2 in another (its claim bound there by hand,
    // or by a class that binds at once): the zone is left out with the node, and said so.
    pinned_away_from_its_claim(Zone::Other).await;
}

#[tokio::test(start_paused = true)]
async fn a_pod_pinned_to_a_zone_alone_its_claims_node_lacks_is_released_and_its_state_forgets_it() {
    // Its state names no node any more (its claims were released once), only z1, and its new
    // claim is bound on n2 in z2: the zone is forgotten, then the pod released (not released
    // for nothing, again and again, with the zone kept).
    pinned_away_from_its_claim(Zone::NoNode).await;
}

/// Where the node a pinned pod's claim is bound on is, in [`pinned_away_from_its_claim`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Zone {
    /// In the zone its state records (`z1`), the pod pinned to its node alone.
    Same,
    /// In another (`z2`), the pod pinned to its node and to `z1`.
    Other,
    /// In another (`z2`), the pod pinned to `z1` alone, its state naming no node.
    NoNode,
}

/// `web-0`, pinned to `n1` (and to `z1` when `zone` is [`Zone::Other`]; to `z1` alone when it
/// is [`Zone::NoNode`]), waits with its claim bound on `n2`: after the grace its state is made
/// to name neither what `n2` lacks, and the pod is released.
async fn pinned_away_from_its_claim(zone: Zone) {
    let n2_zone = match zone {
        Zone::Same => "z1",
        Zone::Other | Zone::NoNode => "z2",
    };
    let the_pps = || {
        let pps = pinned_pps();
        if zone != Zone::NoNode {
            return pps;
        }
        let mut pps = (*pps).clone();
        if let Some(status) = pps.status.as_mut() {
            status.pod_states.insert(
                "web-0".into(),
                serde_json::from_value(json!({
                    "nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}}))
                .expect("state"),
            );
        }
        Arc::new(pps)
    };
    let (caches, mut live) = pinned_waiting(
        vec![
            zone_node("n1", "z1", false),
            zone_node("n2", n2_zone, false),
        ],
        json!({}),
    );
    let pinned = match zone {
        Zone::Same => None,
        Zone::Other => Some((
            "kubernetes.io/hostname=n1,topology.kubernetes.io/zone=z1",
            json!({"kubernetes.io/hostname": "n1", "topology.kubernetes.io/zone": "z1"}),
        )),
        Zone::NoNode => Some((
            "topology.kubernetes.io/zone=z1",
            json!({"topology.kubernetes.io/zone": "z1"}),
        )),
    };
    if let Some((annotation, selector)) = pinned {
        live["metadata"]["annotations"][crate::api::INJECTED_REQUIRED_ANNOTATION] =
            json!(annotation);
        live["spec"]["nodeSelector"] = selector;
        caches.apply_pod(watcher::Event::Apply(
            serde_json::from_value(live.clone()).expect("pod"),
        ));
    }
    let kept = match zone {
        Zone::Same => json!({"nodeTopologyLabels": {"topology.kubernetes.io/zone": "z1"}}),
        Zone::Other | Zone::NoNode => json!({}),
    };
    let sts = GroupKind::native_statefulset();
    let mut workload = statefulset(json!({}));
    workload.data["spec"]["volumeClaimTemplates"] = json!([{"metadata": {"name": "data"}}]);
    caches.apply_workload(&sts, watcher::Event::Apply(workload));
    let lost_after = Duration::from_secs(120);
    let (ctx, mut handle, mut events) = context_lost_after(caches, lost_after);
    let mut claim = claim_and_volume(on_host("n2"));
    claim[0]["metadata"]["ownerReferences"] = json!([{"apiVersion": "apps/v1",
        "kind": "StatefulSet", "name": "web", "uid": "sts-uid"}]);
    let read = || {
        let mut answers = vec![live.clone()];
        answers.extend(claim.clone());
        answers
    };
    let sent = drive(reconcile_pps(the_pps(), ctx.clone()), &mut handle, vec![]).await;
    assert!(sent.is_empty(), "just seen waiting: {sent:?}");
    tokio::time::advance(lost_after + Duration::from_secs(1)).await;
    // Read with its claims: held there, not released yet.
    let sent = drive(reconcile_pps(the_pps(), ctx.clone()), &mut handle, read()).await;
    let paths: Vec<&str> = sent.iter().map(|s| s.path_and_query.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/api/v1/namespaces/ns/pods/web-0",
            "/api/v1/namespaces/ns/persistentvolumeclaims/data-web-0",
            "/api/v1/persistentvolumes/pv-1",
        ]
    );
    tokio::time::advance(lost_after + Duration::from_secs(1)).await;
    // Read again right before: its state names no node first; the pod is not deleted yet.
    let mut forgotten = serde_json::to_value(the_pps().as_ref()).expect("pps");
    forgotten["status"]["podStates"]["web-0"] = kept.clone();
    let mut answers = read();
    answers.push(forgotten.clone());
    let (sent, action) =
        drive_to_action(reconcile_pps(the_pps(), ctx.clone()), &mut handle, answers).await;
    let calls = calls_of(&sent);
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert!(
        calls[3].starts_with(
            "PATCH /apis/apps.kruise.io/v1beta1/namespaces/ns/persistentpodstates/web/status"
        ),
        "{calls:?}"
    );
    assert_eq!(
        sent[3].body[1],
        json!({"op": "replace", "path": "/status/podStates/web-0", "value": kept})
    );
    let soon = requeue_after(&action).expect("requeued");
    assert!(soon <= Duration::from_secs(5), "{action:?}");
    // Once this replica's cache holds the state so (the webhooks admit the pod created again
    // from theirs): read again, nothing more to forget, released.
    let cached: PersistentPodState = serde_json::from_value(forgotten).expect("pps");
    let mut answers = read();
    answers.push(json!({"apiVersion": "v1", "kind": "Status", "status": "Success"}));
    let sent = drive(
        reconcile_pps(Arc::new(cached), ctx.clone()),
        &mut handle,
        answers,
    )
    .await;
    let calls = calls_of(&sent);
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert_eq!(calls[3], "DELETE /api/v1/namespaces/ns/pods/web-0?");
    assert_eq!(
        sent[3].body["preconditions"],
        json!({"uid": "pod-uid", "resourceVersion": "7"})
    );
    let metrics = ctx.metrics.encode();
    for series in [
        "pps_state_nodes_forgotten_total 1",
        "pps_pods_released_total{reason=\"pod_constraints\"} 1",
    ] {
        assert!(metrics.contains(series), "{series}: {metrics}");
    }
    let note = event_note(&mut events, "NodeForgotten").await;
    assert!(note.contains("data-web-0") && note.contains("n2"), "{note}");
    let said = match zone {
        Zone::Same => "names node n1 no more:",
        Zone::Other => {
            "names node n1 no more, nor topology.kubernetes.io/zone=z1, which node n2 lacks"
        }
        Zone::NoNode => "records topology.kubernetes.io/zone=z1 no more, which node n2 lacks",
    };
    assert!(note.contains(said), "{said}: {note}");
    let note = event_note(&mut events, "PodReleased").await;
    assert!(note.contains("web-0"), "{note}");
    assert_eq!(note.contains("zone"), zone != Zone::Same, "{note}");
    let why = "its claim data-web-0 is bound to PersistentVolume pv-1, which only node n2 can mount, and that node lacks them";
    assert!(note.contains(why), "{note}");
}
