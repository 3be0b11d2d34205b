//! Kubernetes Events on PersistentPodStates, published in the background and rate-limited per
//! object and reason, so a burst (a rollout, a flapping node) cannot flood the API server.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource};

use crate::api::PersistentPodState;

/// Name of the reporting controller in Events.
pub const REPORTER: &str = "persistent-pod-state";

/// Publishes Events; at most one per PersistentPodState and reason per `min_interval`
/// (repeats within the interval are dropped; the Recorder also folds identical ones into series).
pub struct Events {
    recorder: Recorder,
    min_interval: Duration,
    last: Mutex<LastSent>,
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

impl Events {
    /// Events reported as `instance` of this controller.
    pub fn new(client: Client, instance: Option<String>, min_interval: Duration) -> Self {
        let reporter = Reporter {
            controller: REPORTER.into(),
            instance,
        };
        Self {
            recorder: Recorder::new(client, reporter),
            min_interval,
            last: Mutex::default(),
        }
    }

    /// Whether an Event with `reason` on `key` may go out now (and remembers that it did).
    fn allow(&self, key: (String, String, String)) -> bool {
        let now = Instant::now();
        let mut last = crate::sync::lock(&self.last);
        if last
            .at
            .get(&key)
            .is_some_and(|t| now.duration_since(*t) < self.min_interval)
        {
            return false;
        }
        if last.at.len() > last.prune_above.max(PRUNE_ABOVE) {
            let window = self.min_interval;
            last.at.retain(|_, t| now.duration_since(*t) < window);
            last.prune_above = last.at.len() * 2;
        }
        last.at.insert(key, now);
        true
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
        let key = (
            reference.namespace.clone().unwrap_or_default(),
            format!(
                "{}/{}",
                reference.kind.as_deref().unwrap_or_default(),
                reference.name.as_deref().unwrap_or_default()
            ),
            format!("{reason}/{subject}"),
        );
        if !self.allow(key) {
            return;
        }
        let event = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(capped(note)),
            action: action.to_owned(),
            secondary: related,
        };
        let recorder = self.recorder.clone();
        tokio::spawn(async move {
            if let Err(error) = recorder.publish(&event, &reference).await {
                tracing::warn!(%error, object = ?reference.name, "could not publish an Event");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[tokio::test]
    async fn one_event_per_object_and_reason_per_interval() {
        let (events, _server) = hourly();
        let key =
            |name: &str, reason: &str| ("ns".to_string(), name.to_string(), reason.to_string());
        assert!(events.allow(key("a", "StatesRecorded")));
        assert!(!events.allow(key("a", "StatesRecorded")), "repeat dropped");
        assert!(events.allow(key("a", "StatesPruned")), "another reason");
        assert!(events.allow(key("b", "StatesRecorded")), "another object");
    }

    #[tokio::test]
    async fn the_window_is_pruned_when_the_keys_double_not_on_every_call() {
        let (events, _server) = hourly();
        let key = |i: usize| ("ns".to_string(), format!("pps-{i}"), "Reason/".to_string());
        for i in 0..=PRUNE_ABOVE + 1 {
            assert!(events.allow(key(i)));
        }
        // One pass when the keys passed PRUNE_ABOVE: all in the window, so kept, and the
        // next pass waits until they have doubled.
        let last = crate::sync::lock(&events.last);
        assert_eq!(last.at.len(), PRUNE_ABOVE + 2);
        assert_eq!(last.prune_above, 2 * (PRUNE_ABOVE + 1));
    }
}
