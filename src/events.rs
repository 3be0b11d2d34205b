//! Kubernetes Events on PersistentPodStates, published in the background and rate-limited, so a
//! burst (a rollout, a flapping node, a zone of nodes lost under thousands of pods) cannot flood
//! the API server: one per object, reason and related object per interval; per object they are
//! about, 25 and then one per 5 minutes (client-go's spam filter); 20 a second in all, 200 in a
//! burst; 64 being sent at most. What is over a bound is dropped and counted
//! (`pps_events_dropped_total`), never queued.
//! Repeats of an Event that says the same, within 6 minutes, are counted into its series (as
//! client-go's recorder does); one that says something else is an Event of its own (kube's
//! recorder would count it into the first, whose note it keeps).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use kube::{Client, Resource};
use prometheus_client::metrics::counter::Counter;

use crate::api::PersistentPodState;

/// Name of the reporting controller in Events.
pub const REPORTER: &str = "persistent-pod-state";

/// Publishes Events; at most one per PersistentPodState and reason per `min_interval`
/// (repeats within the interval are dropped; identical ones later are counted into a series).
pub struct Events {
    client: Client,
    instance: String,
    min_interval: Duration,
    last: Mutex<LastSent>,
    rate: Mutex<Rate>,
    /// Publications in flight ([`IN_FLIGHT`] at most).
    in_flight: Arc<tokio::sync::Semaphore>,
    /// Events dropped over the rate or the publications in flight.
    dropped: Counter,
    series: Arc<Mutex<HashMap<SeriesKey, Published>>>,
}

/// Events sent per second at most, all objects together, and in a burst.
const ALL_PER_SECOND: f64 = 20.0;
const ALL_BURST: f64 = 200.0;
/// Events about one object in a burst, then one per [`OBJECT_EVERY`] (client-go's spam filter).
const OBJECT_BURST: f64 = 25.0;
const OBJECT_EVERY: Duration = Duration::from_secs(300);
/// Publications in flight at most: an Event beyond is dropped, so an API server that answers
/// slowly or not at all holds no more than these.
const IN_FLIGHT: usize = 64;

/// A token bucket: `tokens` as counted `at`.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(burst: f64, now: Instant) -> Self {
        Self {
            tokens: burst,
            at: now,
        }
    }

    /// Refilled to `now` at `per_second` up to `burst`.
    fn refill(&mut self, now: Instant, per_second: f64, burst: f64) {
        let added = now.saturating_duration_since(self.at).as_secs_f64() * per_second;
        (self.tokens, self.at) = ((self.tokens + added).min(burst), now);
    }
}

/// What the rate lets out: all Events, and those about each object.
struct Rate {
    all: Bucket,
    per_object: HashMap<(String, String), Bucket>,
    /// Objects kept before the full buckets are dropped (amortized as in [`LastSent`]).
    prune_above: usize,
}

impl Rate {
    fn new(now: Instant) -> Self {
        Self {
            all: Bucket::full(ALL_BURST, now),
            per_object: HashMap::new(),
            prune_above: PRUNE_ABOVE,
        }
    }

    /// Whether one more Event about `object` may go out at `now` (taken if so).
    fn take(&mut self, object: (String, String), now: Instant) -> bool {
        let per_object = 1.0 / OBJECT_EVERY.as_secs_f64();
        self.all.refill(now, ALL_PER_SECOND, ALL_BURST);
        if self.all.tokens < 1.0 {
            return false;
        }
        if self.per_object.len() > self.prune_above {
            self.per_object.retain(|_, b| {
                b.refill(now, per_object, OBJECT_BURST);
                b.tokens < OBJECT_BURST
            });
            self.prune_above = (self.per_object.len() * 2).max(PRUNE_ABOVE);
        }
        let bucket = self
            .per_object
            .entry(object)
            .or_insert_with(|| Bucket::full(OBJECT_BURST, now));
        bucket.refill(now, per_object, OBJECT_BURST);
        if bucket.tokens < 1.0 {
            return false;
        }
        bucket.tokens -= 1.0;
        self.all.tokens -= 1.0;
        true
    }
}

/// How long a published Event takes repeats into its series (client-go's and kube's 6 minutes).
const SERIES_TTL: Duration = Duration::from_secs(360);

/// Events kept for their series at most (each at most a note and a few names).
const SERIES_KEPT: usize = 4096;

/// What makes a repeat the same Event: all it says (the references by what names them).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SeriesKey {
    type_: &'static str,
    reason: String,
    action: String,
    regarding: [Option<String>; 5],
    related: Option<[Option<String>; 5]>,
    note: String,
}

/// The identity of an object reference, for [`SeriesKey`].
fn named(r: &ObjectReference) -> [Option<String>; 5] {
    [
        r.api_version.clone(),
        r.kind.clone(),
        r.namespace.clone(),
        r.name.clone(),
        r.uid.clone(),
    ]
}

/// An Event created: where, how many times it was seen, and when last.
struct Published {
    namespace: String,
    name: String,
    count: i32,
    at: Instant,
}

/// When each key last sent an Event; keys out of the window are dropped once there are more
/// than `prune_above` (then twice what is left, at least 4096: amortized, not a pass per call).
#[derive(Default)]
struct LastSent {
    at: HashMap<(String, String, String), Instant>,
    prune_above: usize,
}

/// The fewest keys kept before the window is pruned.
const PRUNE_ABOVE: usize = 4096;

impl LastSent {
    /// Whether `key` sent an Event less than `window` before `now`.
    fn repeat(&self, key: &(String, String, String), now: Instant, window: Duration) -> bool {
        self.at
            .get(key)
            .is_some_and(|t| now.duration_since(*t) < window)
    }

    /// Remembers that `key` sent an Event at `now`.
    fn record(&mut self, key: (String, String, String), now: Instant, window: Duration) {
        if self.at.len() > self.prune_above.max(PRUNE_ABOVE) {
            self.at.retain(|_, t| now.duration_since(*t) < window);
            self.prune_above = self.at.len() * 2;
        }
        self.at.insert(key, now);
    }
}

/// The most bytes an Event's note may hold: the API server refuses a longer one.
const NOTE_MAX: usize = 1024;

/// `note`, cut to at most [`NOTE_MAX`] bytes (at a character's boundary, ending with `…`).
fn capped(mut note: String) -> String {
    if note.len() > NOTE_MAX {
        let mut end = NOTE_MAX - '…'.len_utf8();
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push('…');
    }
    note
}

/// The longest object name the API server takes (a DNS subdomain).
const NAME_MAX: usize = 253;

/// An Event's name: its object's name and the time in nanoseconds (as client-go names them),
/// the object's name cut so the whole stays a DNS subdomain of at most [`NAME_MAX`] bytes.
fn event_name(object: &str, nanos: i128) -> String {
    let suffix = format!(".{nanos:x}");
    let mut end = object.len().min(NAME_MAX - suffix.len());
    while !object.is_char_boundary(end) {
        end -= 1;
    }
    // A subdomain's labels end with a letter or digit: no `-` or `.` before the suffix's dot.
    let prefix = object[..end].trim_end_matches(['-', '.']);
    let prefix = if prefix.is_empty() { REPORTER } else { prefix };
    format!("{prefix}{suffix}")
}

impl Events {
    /// Events reported as `instance` of this controller.
    pub fn new(client: Client, instance: Option<String>, min_interval: Duration) -> Self {
        Self {
            client,
            instance: instance.unwrap_or_else(|| REPORTER.to_owned()),
            min_interval,
            last: Mutex::default(),
            rate: Mutex::new(Rate::new(Instant::now())),
            in_flight: Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT)),
            dropped: Counter::default(),
            series: Arc::default(),
        }
    }

    /// Counts the Events dropped over the rate or the publications in flight into `dropped`.
    pub fn counting_drops(mut self, dropped: Counter) -> Self {
        self.dropped = dropped;
        self
    }

    /// Publishes an Event about `pps` in the background, unless rate-limited (per object and
    /// reason).
    pub fn publish(
        &self,
        pps: &PersistentPodState,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        self.publish_on(pps.object_ref(&()), None, type_, reason, action, note);
    }

    /// Publishes an Event about `pps` concerning its pod `pod` (the Event's related object),
    /// rate-limited per object, reason and pod: Events about different pods are not folded into
    /// one, neither by the limit nor into one series (series are kept per object, reason and
    /// related object).
    pub fn publish_about(
        &self,
        pps: &PersistentPodState,
        pod: &str,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let reference = pps.object_ref(&());
        let related = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(pod.to_owned()),
            namespace: reference.namespace.clone(),
            ..ObjectReference::default()
        };
        self.publish_on(reference, Some(related), type_, reason, action, note);
    }

    /// Publishes an Event about any object (`reference`), concerning `related` if given,
    /// rate-limited per object, reason and related object; a note longer than the API server
    /// takes is cut.
    pub fn publish_on(
        &self,
        reference: ObjectReference,
        related: Option<ObjectReference>,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let subject = related
            .as_ref()
            .and_then(|r| r.name.as_deref())
            .unwrap_or_default();
        let object = (
            reference.namespace.clone().unwrap_or_default(),
            format!(
                "{}/{}",
                reference.kind.as_deref().unwrap_or_default(),
                reference.name.as_deref().unwrap_or_default()
            ),
        );
        // A repeat of an Event sent within the interval is no Event lost: looked at before the
        // bounds that count what they drop. An Event they drop is not remembered as sent, so
        // it goes out when tried again once there is room.
        let key = (
            object.0.clone(),
            object.1.clone(),
            format!("{reason}/{subject}"),
        );
        let mut last = crate::sync::lock(&self.last);
        // Read under the lock, so that the rate's buckets are never refilled back in time.
        let now = Instant::now();
        if last.repeat(&key, now, self.min_interval) {
            return;
        }
        let Ok(sending) = self.in_flight.clone().try_acquire_owned() else {
            drop(last);
            self.dropped.inc();
            return;
        };
        if !crate::sync::lock(&self.rate).take(object, now) {
            drop(last);
            self.dropped.inc();
            return;
        }
        last.record(key, now, self.min_interval);
        drop(last);
        let type_ = match type_ {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        };
        let key = SeriesKey {
            type_,
            reason: reason.to_owned(),
            action: action.to_owned(),
            regarding: named(&reference),
            related: related.as_ref().map(named),
            note: capped(note),
        };
        let now = k8s_openapi::jiff::Timestamp::now();
        let event = K8sEvent {
            action: Some(key.action.clone()),
            reason: Some(key.reason.clone()),
            event_time: Some(MicroTime(now)),
            note: Some(key.note.clone()),
            metadata: ObjectMeta {
                namespace: reference.namespace.clone(),
                name: Some(event_name(
                    reference.name.as_deref().unwrap_or(REPORTER),
                    now.as_nanosecond(),
                )),
                ..ObjectMeta::default()
            },
            regarding: Some(reference),
            related,
            reporting_controller: Some(REPORTER.to_owned()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(type_.to_owned()),
            ..K8sEvent::default()
        };
        let (client, series) = (self.client.clone(), self.series.clone());
        tokio::spawn(async move {
            let _sending = sending;
            let object = event.regarding.as_ref().and_then(|r| r.name.clone());
            if let Err(error) = send(client, &series, key, event).await {
                tracing::warn!(%error, ?object, "could not publish an Event");
            }
        });
    }
}

/// Creates `event`, or counts it into the series of the same Event published within
/// [`SERIES_TTL`].
async fn send(
    client: Client,
    series: &Mutex<HashMap<SeriesKey, Published>>,
    key: SeriesKey,
    event: K8sEvent,
) -> Result<(), kube::Error> {
    let now = Instant::now();
    let repeat = {
        let mut kept = crate::sync::lock(series);
        kept.retain(|_, p| now.duration_since(p.at) < SERIES_TTL);
        kept.get(&key)
            .map(|p| (p.namespace.clone(), p.name.clone(), p.count + 1))
    };
    match repeat {
        Some((namespace, name, count)) => {
            let api: Api<K8sEvent> = Api::namespaced(client, &namespace);
            let change = serde_json::json!({"series": {
                "count": count,
                "lastObservedTime": MicroTime(k8s_openapi::jiff::Timestamp::now()),
            }});
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&change))
                .await?;
            if let Some(p) = crate::sync::lock(series).get_mut(&key) {
                (p.count, p.at) = (count, now);
            }
        }
        None => {
            // Cluster-scoped objects' Events go to `default`, as the recorders put them.
            let namespace = event
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".to_owned());
            let api: Api<K8sEvent> = Api::namespaced(client, &namespace);
            let created = api.create(&PostParams::default(), &event).await?;
            let mut kept = crate::sync::lock(series);
            if kept.len() < SERIES_KEPT {
                let name = created
                    .metadata
                    .name
                    .or(event.metadata.name)
                    .unwrap_or_default();
                let published = Published {
                    namespace,
                    name,
                    count: 1,
                    at: now,
                };
                kept.insert(key, published);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether an Event of `key` would go out now as far as repeats go (remembered as sent if
    /// so), as [`Events::publish_on`] judges it before its bounds.
    fn allow(events: &Events, key: (String, String, String)) -> bool {
        let now = Instant::now();
        let mut last = crate::sync::lock(&events.last);
        if last.repeat(&key, now, events.min_interval) {
            return false;
        }
        last.record(key, now, events.min_interval);
        true
    }

    /// An Event about an object with a long name gets a name the API server takes: at most 253
    /// bytes, no label ending in `-` or `.` where the name was cut.
    #[test]
    fn long_object_names_give_event_names_within_a_subdomain() {
        let nanos = 1_765_000_000_123_456_789_i128;
        assert_eq!(event_name("web", nanos), format!("web.{nanos:x}"));
        for object in [
            "a".repeat(253),
            format!("{}-{}", "a".repeat(235), "b".repeat(17)),
            format!("{}.{}", "a".repeat(235), "b".repeat(17)),
        ] {
            let name = event_name(&object, nanos);
            assert!(name.len() <= NAME_MAX, "{} bytes: {name}", name.len());
            assert!(name.ends_with(&format!(".{nanos:x}")), "{name}");
            assert!(!name.contains("-.") && !name.contains(".."), "{name}");
            assert!(
                object.starts_with(name.split_at(name.len() - 17).0),
                "{name}"
            );
        }
    }

    /// Events with a one-hour window, on a mock API server (kept alive with them).
    fn hourly() -> (
        Events,
        tower_test::mock::Handle<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >,
    ) {
        let (mock, server) = tower_test::mock::pair();
        let events = Events::new(
            Client::new(mock, "default"),
            None,
            Duration::from_secs(3600),
        );
        (events, server)
    }

    #[test]
    fn notes_are_cut_to_what_the_api_server_takes() {
        let short = "recorded web-0 on n1".to_owned();
        assert_eq!(capped(short.clone()), short);
        let exact = "x".repeat(NOTE_MAX);
        assert_eq!(capped(exact.clone()), exact);
        // Two-byte characters across the cut: never split.
        for long in [
            "y".repeat(5000),
            "é".repeat(700),
            format!("z{}", "é".repeat(700)),
        ] {
            let cut = capped(long.clone());
            assert!(cut.len() <= NOTE_MAX, "{}", cut.len());
            assert!(cut.len() >= NOTE_MAX - 4, "{}", cut.len());
            assert!(cut.ends_with('…'));
            assert!(long.starts_with(cut.trim_end_matches('…')));
        }
    }

    /// The method, path and body of the next request to `server`, answered with that body.
    async fn next(
        server: &mut tower_test::mock::Handle<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >,
    ) -> (http::Method, String, serde_json::Value) {
        use http_body_util::BodyExt;
        let (request, respond) =
            tokio::time::timeout(Duration::from_secs(10), server.next_request())
                .await
                .expect("a request within 10 s")
                .expect("the client is alive");
        let (method, path) = (request.method().clone(), request.uri().path().to_owned());
        let bytes = request
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        let mut answer = body.clone();
        if method == http::Method::PATCH {
            answer = serde_json::json!({"apiVersion": "events.k8s.io/v1", "kind": "Event",
                "metadata": {"name": path.rsplit('/').next(), "namespace": "ns"}, "eventTime": null});
        }
        let status = if method == http::Method::POST {
            201
        } else {
            200
        };
        respond.send_response(crate::test_api::json_response(status, &answer));
        (method, path, body)
    }

    #[tokio::test]
    async fn a_repeat_is_counted_into_its_series_and_another_note_is_an_event_of_its_own() {
        let (mock, mut server) = tower_test::mock::pair();
        let events = Events::new(
            Client::new(mock, "default"),
            Some("pod-a".into()),
            Duration::ZERO,
        );
        let pps: PersistentPodState = serde_json::from_value(serde_json::json!({
            "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
            "metadata": {"name": "web", "namespace": "ns", "uid": "pps-uid"},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}}
        }))
        .expect("pps");
        let publish = |note: &str| {
            events.publish_about(
                &pps,
                "web-0",
                EventType::Warning,
                "PodReleased",
                "Release",
                note.into(),
            );
        };
        publish("released from node a");
        let (method, path, first) = next(&mut server).await;
        assert_eq!(method, http::Method::POST);
        assert_eq!(path, "/apis/events.k8s.io/v1/namespaces/ns/events");
        assert_eq!(first["note"], "released from node a");
        assert_eq!(first["reportingInstance"], "pod-a");
        assert_eq!(first["regarding"]["name"], "web");
        assert_eq!(first["related"]["name"], "web-0");
        assert_eq!(first["type"], "Warning");
        // Saying something else: an Event of its own, not a count on the first.
        publish("released from node b");
        let (method, _, second) = next(&mut server).await;
        assert_eq!(method, http::Method::POST);
        assert_eq!(second["note"], "released from node b");
        // Saying the same again: counted into the first's series.
        publish("released from node a");
        let (method, path, repeat) = next(&mut server).await;
        assert_eq!(method, http::Method::PATCH);
        let name = first["metadata"]["name"].as_str().expect("a name");
        assert_eq!(
            path,
            format!("/apis/events.k8s.io/v1/namespaces/ns/events/{name}")
        );
        assert_eq!(repeat["series"]["count"], 2);
    }

    #[tokio::test]
    async fn one_event_per_object_and_reason_per_interval() {
        let (events, _server) = hourly();
        let key =
            |name: &str, reason: &str| ("ns".to_string(), name.to_string(), reason.to_string());
        assert!(allow(&events, key("a", "StatesRecorded")));
        assert!(
            !allow(&events, key("a", "StatesRecorded")),
            "repeat dropped"
        );
        assert!(allow(&events, key("a", "StatesPruned")), "another reason");
        assert!(allow(&events, key("b", "StatesRecorded")), "another object");
    }

    /// Events about one object: 25, then one per 5 minutes; all together: 200, then 20 a
    /// second; the objects whose bucket is full again are forgotten once they double.
    #[test]
    fn events_are_bounded_per_object_and_in_all() {
        let t0 = Instant::now();
        let at = |s: f64| t0 + Duration::from_secs_f64(s);
        let object = |i: usize| ("ns".to_owned(), format!("PersistentPodState/web-{i}"));
        let mut rate = Rate::new(t0);
        let first: Vec<bool> = (0..30).map(|_| rate.take(object(0), t0)).collect();
        assert_eq!(first.iter().filter(|t| **t).count(), 25, "{first:?}");
        assert!(rate.take(object(1), t0), "another object");
        assert!(!rate.take(object(0), at(299.0)));
        assert!(rate.take(object(0), at(301.0)), "one per 5 minutes");
        // In all: the burst, then 20 a second.
        let mut rate = Rate::new(t0);
        let taken = (0..300).filter(|i| rate.take(object(*i), t0)).count();
        assert_eq!(taken, 200);
        let later = (300..400)
            .filter(|i| rate.take(object(*i), at(1.0)))
            .count();
        assert_eq!(later, 20, "20 a second");
        // Pruned once the objects pass the bound, keeping those not full again.
        let mut rate = Rate::new(t0);
        for i in 0..=PRUNE_ABOVE {
            rate.all.tokens = ALL_BURST;
            assert!(rate.take(object(i), t0));
        }
        assert!(rate.take(
            object(PRUNE_ABOVE + 1),
            at(OBJECT_EVERY.as_secs_f64() * 25.0)
        ));
        assert_eq!(
            rate.per_object.len(),
            1,
            "every bucket full again but the new one"
        );
    }

    /// With as many publications in flight as allowed (the API server not answering), more
    /// Events are dropped and counted, not queued; a repeat within the interval is not counted
    /// as lost.
    #[tokio::test]
    async fn events_beyond_those_in_flight_are_dropped_and_counted() {
        let (events, _server) = hourly();
        let dropped = Counter::default();
        let events = events.counting_drops(dropped.clone());
        // Each about a PersistentPodState of its own (the rate lets them all out).
        let publish = |i: usize| {
            let pps: PersistentPodState = serde_json::from_value(serde_json::json!({
                "apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState",
                "metadata": {"name": format!("web-{i}"), "namespace": "ns"},
                "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"}}
            }))
            .expect("pps");
            events.publish(
                &pps,
                EventType::Warning,
                "PodReleased",
                "Release",
                String::new(),
            );
        };
        for i in 0..IN_FLIGHT + 3 {
            publish(i);
        }
        assert_eq!(dropped.get(), 3);
        assert_eq!(events.in_flight.available_permits(), 0);
        // The same Events again, within the interval: those sent are repeats, not counted; the
        // three dropped are tried again, and dropped again while there is no room.
        for i in 0..IN_FLIGHT + 3 {
            publish(i);
        }
        assert_eq!(dropped.get(), 6);
        // Room again: a dropped Event goes out when tried again; a sent one stays a repeat.
        events.in_flight.add_permits(2);
        publish(IN_FLIGHT);
        publish(0);
        assert_eq!(dropped.get(), 6);
        assert_eq!(events.in_flight.available_permits(), 1, "one more sent");
    }

    #[tokio::test]
    async fn the_window_is_pruned_when_the_keys_double_not_on_every_call() {
        let (events, _server) = hourly();
        let key = |i: usize| ("ns".to_string(), format!("pps-{i}"), "Reason/".to_string());
        for i in 0..=PRUNE_ABOVE + 1 {
            assert!(allow(&events, key(i)));
        }
        // One pass when the keys passed PRUNE_ABOVE: all in the window, so kept, and the
        // next pass waits until they have doubled.
        let last = crate::sync::lock(&events.last);
        assert_eq!(last.at.len(), PRUNE_ABOVE + 2);
        assert_eq!(last.prune_above, 2 * (PRUNE_ABOVE + 1));
    }
}
