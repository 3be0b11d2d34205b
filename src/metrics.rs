//! Prometheus metrics (prometheus-client), served as text on the probe port's `/metrics`.

use std::time::Instant;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Outcome of one admission request.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum AdmissionResult {
    /// Allowed with a patch.
    Patched,
    /// Allowed without a patch (nothing to inject or not concerned).
    Allowed,
    /// Denied (invalid object).
    Denied,
    /// The review parsed but its object was unreadable: allowed, logged.
    InvalidObject,
    /// The body was not an AdmissionReview: HTTP 400.
    BadRequest,
    /// Caches not synced yet: HTTP 503.
    Unavailable,
}

/// Labels of the admission request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// Webhook path, e.g. `/mutate-pod`.
    pub endpoint: &'static str,
    /// Outcome.
    pub result: AdmissionResult,
}

/// Labels carrying only the endpoint.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    /// Webhook path.
    pub endpoint: &'static str,
}

/// What part of a recorded state was injected.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum InjectionKind {
    /// `spec.nodeSelector` keys.
    Required,
    /// Preferred node affinity terms.
    Preferred,
    /// Persistent annotations.
    Annotations,
}

/// Labels of the injection counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InjectionLabels {
    /// What was injected.
    pub kind: InjectionKind,
}

/// Why a pod was let through without a patch.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum SkipReason {
    /// Not a Pod CREATE without subresource.
    NotPodCreate,
    /// No controller ownerReference.
    NoController,
    /// The controller is not a handled StatefulSet-like kind.
    NotStatefulSet,
    /// No PersistentPodState targets the workload.
    NoPersistentPodState,
    /// No state is recorded for the pod's name.
    NoState,
}

/// Labels of the skip counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SkipLabels {
    /// Why.
    pub reason: SkipReason,
}

/// Gives a label enum snake_case values (`InvalidObject` -> `invalid_object`).
macro_rules! snake_case_label {
    ($ty:ty { $($variant:ident => $text:literal),* $(,)? }) => {
        impl $ty {
            /// The label value.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),* }
            }
        }
        impl EncodeLabelValue for $ty {
            fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
                self.as_str().encode(encoder)
            }
        }
    };
}

snake_case_label!(AdmissionResult {
    Patched => "patched", Allowed => "allowed", Denied => "denied", InvalidObject => "invalid_object",
    BadRequest => "bad_request", Unavailable => "unavailable",
});
snake_case_label!(InjectionKind { Required => "required", Preferred => "preferred", Annotations => "annotations" });
snake_case_label!(SkipReason {
    NotPodCreate => "not_pod_create", NoController => "no_controller", NotStatefulSet => "not_statefulset",
    NoPersistentPodState => "no_persistent_pod_state", NoState => "no_state",
});

/// Every metric of the process.
pub struct Metrics {
    registry: Registry,
    /// Admission requests by endpoint and result.
    pub admission_requests: Family<AdmissionLabels, Counter>,
    /// Admission handling latency by endpoint.
    pub admission_duration: Family<EndpointLabels, Histogram, fn() -> Histogram>,
    /// Injected items by kind (required keys, preferred terms, annotations).
    pub injections: Family<InjectionLabels, Counter>,
    /// Recorded nodeSelector values not injected because the pod sets another value.
    pub injection_conflicts: Counter,
    /// Required parts not injected because no node has the recorded values (node or zone gone).
    pub required_unplaceable: Counter,
    /// States whose required values no node has, seen by the controller.
    pub states_unplaceable: Gauge,
    /// Pods let through without a patch, by reason.
    pub skipped: Family<SkipLabels, Counter>,
    /// Pod states recorded or re-recorded.
    pub states_recorded: Counter,
    /// Pod states pruned.
    pub states_pruned: Counter,
    /// Reconcile runs that failed.
    pub reconcile_errors: Counter,
    /// Reconcile duration.
    pub reconcile_duration: Histogram,
    /// 1 while this replica holds the Lease and runs the controllers.
    pub leader: Gauge,
    /// Objects in the PersistentPodState cache.
    pub cached_persistent_pod_states: Gauge,
}

fn latency_histogram() -> Histogram {
    // 50 µs .. ~1.6 s
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

impl Metrics {
    /// Registers every metric under the `pps_` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("pps");
        let m = Self {
            admission_requests: Family::default(),
            admission_duration: Family::new_with_constructor(latency_histogram),
            injections: Family::default(),
            injection_conflicts: Counter::default(),
            required_unplaceable: Counter::default(),
            states_unplaceable: Gauge::default(),
            skipped: Family::default(),
            states_recorded: Counter::default(),
            states_pruned: Counter::default(),
            reconcile_errors: Counter::default(),
            reconcile_duration: latency_histogram(),
            cached_persistent_pod_states: Gauge::default(),
            leader: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register(
            "admission_requests",
            "Admission requests by endpoint and result",
            m.admission_requests.clone(),
        );
        registry.register(
            "admission_duration_seconds",
            "Admission handling latency",
            m.admission_duration.clone(),
        );
        registry.register("injections", "Injected items by kind", m.injections.clone());
        registry.register(
            "injection_conflicts",
            "Recorded nodeSelector values not injected because the pod sets its own value",
            m.injection_conflicts.clone(),
        );
        registry.register(
            "required_unplaceable",
            "Required parts not injected because no node has the recorded values",
            m.required_unplaceable.clone(),
        );
        registry.register(
            "states_unplaceable",
            "Recorded states whose required values no existing node has",
            m.states_unplaceable.clone(),
        );
        registry.register(
            "admission_skipped",
            "Pods allowed without a patch, by reason",
            m.skipped.clone(),
        );
        registry.register(
            "states_recorded",
            "Pod states recorded or re-recorded",
            m.states_recorded.clone(),
        );
        registry.register(
            "states_pruned",
            "Pod states pruned",
            m.states_pruned.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciles",
            m.reconcile_errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Reconcile duration",
            m.reconcile_duration.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica runs the controllers",
            m.leader.clone(),
        );
        registry.register(
            "cached_persistent_pod_states",
            "PersistentPodState objects in the cache",
            m.cached_persistent_pod_states.clone(),
        );
        Self { registry, ..m }
    }

    /// Counts one admission request and its latency since `start`.
    pub fn admission(&self, endpoint: &'static str, result: AdmissionResult, start: Instant) {
        self.admission_requests
            .get_or_create(&AdmissionLabels { endpoint, result })
            .inc();
        self.admission_duration
            .get_or_create(&EndpointLabels { endpoint })
            .observe(start.elapsed().as_secs_f64());
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_counts_and_latency_are_exposed() {
        let m = Metrics::new();
        m.admission("/mutate-pod", AdmissionResult::Patched, Instant::now());
        m.admission("/mutate-pod", AdmissionResult::Patched, Instant::now());
        let text = m.encode();
        assert!(
            text.contains(
                r#"pps_admission_requests_total{endpoint="/mutate-pod",result="patched"} 2"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"pps_admission_duration_seconds_count{endpoint="/mutate-pod"} 2"#),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn counters_are_exposed_with_their_total_suffix() {
        let m = Metrics::new();
        m.required_unplaceable.inc();
        m.leader.set(1);
        let text = m.encode();
        assert!(
            text.contains("\npps_required_unplaceable_total 1\n"),
            "{text}"
        );
        assert!(text.contains("\npps_leader 1\n"), "{text}");
    }
}
