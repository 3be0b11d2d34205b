//! Prometheus metrics (prometheus-client), served as text on the probe port's `/metrics`.

use std::time::Instant;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::api::{IpRestore, NodeRestore};
use crate::ip_request::IpSkipReason;
use crate::placement::DropReason;
use crate::webhook::admit::SkipReason;
use crate::webhook::endpoints;

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
    /// Too many requests in flight: HTTP 503 at once.
    Overloaded,
    /// Not answered within the request timeout: HTTP 503.
    TimedOut,
    /// No verified client certificate while `--client-ca` is set: HTTP 403.
    Forbidden,
    /// Allowed without the patch computed for it: its PersistentPodState is observed only.
    Observed,
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

/// Labels of the skip counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SkipLabels {
    /// Why.
    pub reason: SkipReason,
}

/// Labels of the counter of required values left out.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabels {
    /// Why they were left out.
    pub reason: DropReason,
}

/// What became of an IP request a PersistentPodState asks for.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum IpRequestResult {
    /// The recorded IPs were requested.
    Requested,
    /// The pod already carried the same request (the webhook was invoked again).
    AlreadyRequested,
    /// Not requested (see `pps_ip_request_skipped_total`).
    Skipped,
}

/// Labels of the IP request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IpRequestLabels {
    /// What became of it.
    pub result: IpRequestResult,
}

/// Labels of the skipped IP request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IpSkipLabels {
    /// Why no request was made.
    pub reason: IpSkipReason,
}

/// Labels of the restoration counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RestoreLabels {
    /// `kept` or `moved`.
    pub node: NodeRestore,
    /// `kept`, `changed` or `none`.
    pub ip: IpRestore,
}

/// A write of the PersistentPodState generator.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum GeneratorAction {
    /// Server-side apply of a generated PersistentPodState.
    Apply,
    /// Deletion of a generated PersistentPodState.
    Delete,
}

/// Labels of the generator write counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GeneratorLabels {
    /// What was written.
    pub action: GeneratorAction,
}

/// What a live read of a pod showed, read because a recorded state names another pod of its
/// name that the cache has not seen go.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum PodRead {
    /// The cached pod holds the name: its state is written over the recorded one.
    Current,
    /// Another pod, or none, holds it (the cache lags): the recorded state is kept.
    Lagging,
    /// The read failed: the recorded state is kept.
    Failed,
}

/// Labels of the pod read counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodReadLabels {
    /// What the read showed.
    pub result: PodRead,
}

/// Which controller a reconcile belongs to.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Reconciler {
    /// Records pod states into PersistentPodState status.
    Status,
    /// Generates PersistentPodStates from workload annotations.
    Generator,
}

/// Labels of the reconcile metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcilerLabels {
    /// Which controller.
    pub controller: Reconciler,
}

/// Observes the time from its creation to its drop into a histogram, so a reconcile is timed
/// on every way out (success, error, early return).
pub struct DropTimer {
    histogram: Histogram,
    start: Instant,
}

impl Drop for DropTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

/// Gives a label enum snake_case values (`InvalidObject` -> `invalid_object`).
macro_rules! snake_case_label {
    ($ty:ty { $($variant:ident => $text:literal),* $(,)? }) => {
        impl $ty {
            /// Every value, so each label set can be exposed (at 0) from the start.
            pub const ALL: &'static [Self] = &[$(Self::$variant),*];

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
    BadRequest => "bad_request", Unavailable => "unavailable", Overloaded => "overloaded",
    TimedOut => "timed_out", Forbidden => "forbidden", Observed => "observed",
});
snake_case_label!(DropReason {
    NodeGone => "node_gone", NodeLost => "node_lost", PodConstraints => "pod_constraints",
});

snake_case_label!(IpRequestResult {
    Requested => "requested", AlreadyRequested => "already_requested", Skipped => "skipped",
});
snake_case_label!(IpSkipReason {
    InvalidRequest => "invalid_request", NoRecordedIp => "no_recorded_ip",
    InvalidRecordedIp => "invalid_recorded_ip", IpHeld => "ip_held",
    PodRequestsOwn => "pod_requests_own", AntreaNoPool => "antrea_no_pool",
});
snake_case_label!(NodeRestore { Kept => "kept", Moved => "moved" });
snake_case_label!(IpRestore { Kept => "kept", Changed => "changed", None => "none" });
snake_case_label!(GeneratorAction { Apply => "apply", Delete => "delete" });
snake_case_label!(PodRead { Current => "current", Lagging => "lagging", Failed => "failed" });
snake_case_label!(Reconciler { Status => "status", Generator => "generator" });
snake_case_label!(InjectionKind { Required => "required", Preferred => "preferred", Annotations => "annotations" });
snake_case_label!(SkipReason {
    NotPodCreate => "not_pod_create", NoController => "no_controller", NotStatefulSet => "not_statefulset",
    NoPersistentPodState => "no_persistent_pod_state", NoState => "no_state",
});

/// The standard `process_*` metrics, read from `/proc/self` (Linux) at each scrape.
#[derive(Default)]
pub struct ProcessMetrics {
    cpu_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    resident_memory_bytes: Gauge,
    virtual_memory_bytes: Gauge,
    open_fds: Gauge,
    threads: Gauge,
    start_time_seconds: Gauge,
}

/// Figures read from `/proc/self/stat` (clock ticks assumed at Linux's USER_HZ of 100).
#[derive(Debug, PartialEq)]
pub struct ProcStat {
    /// User plus system CPU seconds.
    pub cpu_seconds: f64,
    /// User CPU seconds.
    pub user_seconds: f64,
    /// System CPU seconds.
    pub system_seconds: f64,
    /// Number of threads.
    pub threads: i64,
    /// Start time in seconds after boot.
    pub start_after_boot_seconds: f64,
    /// Virtual memory size in bytes.
    pub virtual_bytes: i64,
    /// Resident set size in pages.
    pub resident_pages: i64,
}

/// Parses `/proc/<pid>/stat` (fields after the parenthesised command name).
pub fn parse_proc_stat(text: &str) -> Option<ProcStat> {
    const TICKS: f64 = 100.0;
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state): field n is f[n - 3].
    let num = |n: usize| f.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    let (user, system) = (num(14)? / TICKS, num(15)? / TICKS);
    Some(ProcStat {
        cpu_seconds: user + system,
        user_seconds: user,
        system_seconds: system,
        threads: num(20)? as i64,
        start_after_boot_seconds: num(22)? / TICKS,
        virtual_bytes: num(23)? as i64,
        resident_pages: num(24)? as i64,
    })
}

impl ProcessMetrics {
    fn register(&self, root: &mut Registry) {
        root.register(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            self.cpu_seconds.clone(),
        );
        root.register(
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            self.resident_memory_bytes.clone(),
        );
        root.register(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            self.virtual_memory_bytes.clone(),
        );
        root.register(
            "process_open_fds",
            "Number of open file descriptors",
            self.open_fds.clone(),
        );
        root.register(
            "process_threads",
            "Number of OS threads",
            self.threads.clone(),
        );
        root.register(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            self.start_time_seconds.clone(),
        );
    }

    /// Reads `/proc/self`; leaves the values as they were where it cannot.
    pub fn refresh(&self) {
        if let Some(stat) = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .as_deref()
            .and_then(parse_proc_stat)
        {
            // A counter: add what was spent since the last scrape.
            let spent = stat.cpu_seconds - self.cpu_seconds.get();
            if spent > 0.0 {
                self.cpu_seconds.inc_by(spent);
            }
            self.threads.set(stat.threads);
            self.virtual_memory_bytes.set(stat.virtual_bytes);
            // In the kernel's pages: 4 KiB on x86, 4, 16 or 64 KiB on arm64.
            let page = i64::try_from(rustix::param::page_size()).unwrap_or(4096);
            self.resident_memory_bytes
                .set(stat.resident_pages.saturating_mul(page));
            let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|t| {
                t.lines().find_map(|l| {
                    l.strip_prefix("btime ")
                        .and_then(|v| v.trim().parse::<f64>().ok())
                })
            });
            if let Some(boot) = boot {
                self.start_time_seconds
                    .set((boot + stat.start_after_boot_seconds) as i64);
            }
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            self.open_fds.set(fds.count() as i64);
        }
    }
}

/// Every metric of the process.
pub struct Metrics {
    registry: Registry,
    /// Admission requests by endpoint and result.
    pub admission_requests: Family<AdmissionLabels, Counter>,
    /// Admission handling latency by endpoint.
    pub admission_duration: Family<EndpointLabels, Histogram, fn() -> Histogram>,
    /// Injected items by kind (required keys, preferred terms, annotations).
    pub injections: Family<InjectionLabels, Counter>,
    /// Items that would have been injected into pods of observed-only PersistentPodStates.
    pub observed: Family<InjectionLabels, Counter>,
    /// Recorded nodeSelector values not injected because the pod sets another value.
    pub injection_conflicts: Counter,
    /// Recorded required values left out of an injection so the pod is not stranded, by reason.
    pub required_dropped: Family<DropLabels, Counter>,
    /// States whose required values no node has, seen by the controller.
    pub states_unplaceable: Gauge,
    /// Waiting pods released (deleted, to be re-created) because no usable node has the
    /// required values the webhook added, by reason.
    pub pods_released: Family<DropLabels, Counter>,
    /// Claims on node-local volumes of a node that is gone released (deleted, with their waiting
    /// pod, to be re-created elsewhere), by how the node is gone.
    pub local_volumes_released: Family<DropLabels, Counter>,
    /// Pod states made to name no node, or to record no label the node of the pod's node-local
    /// claims lacks, because those claims are bound there.
    pub state_nodes_forgotten: Counter,
    /// Pods let through without a patch, by reason.
    pub skipped: Family<SkipLabels, Counter>,
    /// Pod states recorded or re-recorded.
    pub states_recorded: Counter,
    /// Pod states pruned.
    pub states_pruned: Counter,
    /// Status writes sent (each batches every change of its PersistentPodState since the last).
    pub status_writes: Counter,
    /// Reconcile runs that failed, by controller.
    pub reconcile_errors: Family<ReconcilerLabels, Counter>,
    /// Reconcile duration, by controller.
    pub reconcile_duration: Family<ReconcilerLabels, Histogram, fn() -> Histogram>,
    /// IP requests asked for by PersistentPodStates, by what became of them.
    pub ip_requests: Family<IpRequestLabels, Counter>,
    /// IP requests not made, by reason.
    pub ip_request_skipped: Family<IpSkipLabels, Counter>,
    /// Re-created pods that were steered back, by whether they kept their node and IP.
    pub restored: Family<RestoreLabels, Counter>,
    /// Requests sent by the PersistentPodState generator, by action.
    pub generator_writes: Family<GeneratorLabels, Counter>,
    /// Pods read live before a recorded state naming another pod of their name (one the cache
    /// has not seen go) is written over, by what the read showed.
    pub pod_reads: Family<PodReadLabels, Counter>,
    /// Workloads whose `persistent-pod-state.io/ip-request` the generator could not copy.
    pub invalid_workload_ip_requests: Counter,
    /// Events not published: over the rate, or with as many being sent as allowed.
    pub events_dropped: Counter,
    /// PersistentPodStates over a limit (what is beyond is ignored).
    pub over_limits: Gauge,
    /// PersistentPodStates shadowed by an older one targeting the same workload.
    pub shadowed_persistent_pod_states: Gauge,
    /// 1 while this replica holds the Lease and runs the controllers.
    pub leader: Gauge,
    /// Process metrics (`process_*`), refreshed at each scrape.
    pub process: ProcessMetrics,
    /// Pods in the cache.
    pub cached_pods: Gauge,
    /// Nodes in the cache.
    pub cached_nodes: Gauge,
    /// Watches that are stale now (failed, ended or restarted, and not relisted yet).
    pub stale_watches: Gauge,
    /// Workloads in the cache, all kinds.
    pub cached_workloads: Gauge,
    /// Workload kinds watched (native StatefulSet, Advanced StatefulSet, custom kinds).
    pub watched_workload_kinds: Gauge,
    /// Objects in the PersistentPodState cache.
    pub cached_persistent_pod_states: Gauge,
    /// When the serving certificate in use expires (Unix seconds).
    pub serving_certificate_expiry: Gauge,
    /// The series an admission counts in, resolved once.
    series: AdmissionSeries,
}

/// The series of the admission families, resolved once for every label set they expose (all
/// made at start): counting a review then neither hashes its labels nor takes the families'
/// locks.
#[derive(Default)]
struct AdmissionSeries {
    /// Per served endpoint: the request counter per result (in [`AdmissionResult::ALL`]'s
    /// order), and the latency histogram.
    endpoints: Vec<(&'static str, Vec<Counter>, Histogram)>,
    /// The injection counter per kind (in [`InjectionKind::ALL`]'s order).
    injections: Vec<Counter>,
}

impl AdmissionSeries {
    fn of(m: &Metrics) -> Self {
        Self {
            endpoints: endpoints::ALL
                .into_iter()
                .map(|endpoint| {
                    let requests = AdmissionResult::ALL
                        .iter()
                        .map(|&result| {
                            m.admission_requests
                                .get_or_create(&AdmissionLabels { endpoint, result })
                                .clone()
                        })
                        .collect();
                    let duration = m
                        .admission_duration
                        .get_or_create(&EndpointLabels { endpoint })
                        .clone();
                    (endpoint, requests, duration)
                })
                .collect(),
            injections: InjectionKind::ALL
                .iter()
                .map(|&kind| {
                    m.injections
                        .get_or_create(&InjectionLabels { kind })
                        .clone()
                })
                .collect(),
        }
    }
}

fn latency_histogram() -> Histogram {
    // 50 µs .. ~1.6 s
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

impl Metrics {
    /// Registers every metric under the `pps_` prefix.
    pub fn new() -> Self {
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("pps");
        let m = Self {
            admission_requests: Family::default(),
            admission_duration: Family::new_with_constructor(latency_histogram),
            injections: Family::default(),
            observed: Family::default(),
            injection_conflicts: Counter::default(),
            required_dropped: Family::default(),
            states_unplaceable: Gauge::default(),
            pods_released: Family::default(),
            local_volumes_released: Family::default(),
            state_nodes_forgotten: Counter::default(),
            skipped: Family::default(),
            states_recorded: Counter::default(),
            states_pruned: Counter::default(),
            status_writes: Counter::default(),
            reconcile_errors: Family::default(),
            reconcile_duration: Family::new_with_constructor(latency_histogram),
            cached_persistent_pod_states: Gauge::default(),
            leader: Gauge::default(),
            generator_writes: Family::default(),
            pod_reads: Family::default(),
            invalid_workload_ip_requests: Counter::default(),
            events_dropped: Counter::default(),
            restored: Family::default(),
            ip_requests: Family::default(),
            ip_request_skipped: Family::default(),
            shadowed_persistent_pod_states: Gauge::default(),
            over_limits: Gauge::default(),
            registry: Registry::default(),
            process: ProcessMetrics::default(),
            cached_pods: Gauge::default(),
            cached_nodes: Gauge::default(),
            stale_watches: Gauge::default(),
            cached_workloads: Gauge::default(),
            watched_workload_kinds: Gauge::default(),
            serving_certificate_expiry: Gauge::default(),
            series: AdmissionSeries::default(),
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
            "observed",
            "Items that would have been injected, by kind, for observed-only PersistentPodStates",
            m.observed.clone(),
        );
        registry.register(
            "injection_conflicts",
            "Recorded nodeSelector values not injected because the pod sets its own value",
            m.injection_conflicts.clone(),
        );
        registry.register(
            "required_dropped",
            "Admissions whose recorded required values were partly or wholly left out, by reason",
            m.required_dropped.clone(),
        );
        registry.register(
            "pods_released",
            "Waiting pods released because no usable node has the required values the webhook added, or their node-local volumes' node is gone, by reason",
            m.pods_released.clone(),
        );
        registry.register(
            "local_volumes_released",
            "Claims on node-local volumes of a node that is gone released with their waiting pod, by reason",
            m.local_volumes_released.clone(),
        );
        registry.register(
            "state_nodes_forgotten",
            "Pod states made to name no node, or to record no label the node of the pod's node-local claims lacks, because those claims are bound there",
            m.state_nodes_forgotten.clone(),
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
            "status_writes",
            "PersistentPodState status writes sent",
            m.status_writes.clone(),
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
            "ip_requests",
            "IP requests asked for by PersistentPodStates, by result",
            m.ip_requests.clone(),
        );
        registry.register(
            "ip_request_skipped",
            "IP requests not made, by reason",
            m.ip_request_skipped.clone(),
        );
        registry.register(
            "restored",
            "Re-created pods steered back by the webhook, by whether they kept their node and IP",
            m.restored.clone(),
        );
        registry.register(
            "generator_writes",
            "Requests sent by the PersistentPodState generator, by action",
            m.generator_writes.clone(),
        );
        registry.register(
            "pod_reads",
            "Pods read live before a recorded state naming another pod of their name, one this replica's cache has not seen go, is written over, by result: current (the cached pod holds the name: written over), lagging (another pod or none does: kept), failed (kept)",
            m.pod_reads.clone(),
        );
        registry.register(
            "events_dropped",
            "Events not published: over the rate (20 a second in all; per object 25, then one per 5 minutes) or with 64 being sent already",
            m.events_dropped.clone(),
        );
        registry.register(
            "invalid_workload_ip_requests",
            "Reconciles of workloads whose ip-request annotation is not valid (not copied)",
            m.invalid_workload_ip_requests.clone(),
        );
        registry.register(
            "over_limits",
            "PersistentPodStates asking for more than the limits (what is beyond is ignored)",
            m.over_limits.clone(),
        );
        registry.register(
            "shadowed_persistent_pod_states",
            "PersistentPodStates that record nothing because an older one targets the same workload",
            m.shadowed_persistent_pod_states.clone(),
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
        registry.register("cached_pods", "Pods in the cache", m.cached_pods.clone());
        registry.register("cached_nodes", "Nodes in the cache", m.cached_nodes.clone());
        registry.register(
            "stale_watches",
            "Watches that failed, ended or were restarted and are not relisted yet (readiness is false meanwhile when one is the PersistentPodState, Pod or Node watch)",
            m.stale_watches.clone(),
        );
        registry.register(
            "cached_workloads",
            "Workloads (all watched kinds) in the cache",
            m.cached_workloads.clone(),
        );
        registry.register(
            "watched_workload_kinds",
            "Workload kinds watched",
            m.watched_workload_kinds.clone(),
        );
        registry.register(
            "serving_certificate_expiry_timestamp_seconds",
            "When the serving certificate in use expires (Unix seconds; its files are looked at every 10 s and on handshakes)",
            m.serving_certificate_expiry.clone(),
        );
        m.process.register(&mut root);
        m.expose_every_label_set();
        Self {
            registry: root,
            series: AdmissionSeries::of(&m),
            ..m
        }
    }

    /// Counts a request answered before its handler (refused, timed out, not synced, not
    /// authenticated), by its path.
    pub fn refused(&self, path: &str, result: AdmissionResult) {
        self.admission(endpoints::label(path), result, Instant::now());
    }

    /// Creates every label set of every family (they are all small enums), so each series is
    /// exposed from the start at 0: `rate()` and absence alerts work, and a scrape lists every
    /// metric the process has.
    fn expose_every_label_set(&self) {
        for endpoint in endpoints::ALL {
            for &result in AdmissionResult::ALL {
                let _ = self
                    .admission_requests
                    .get_or_create(&AdmissionLabels { endpoint, result });
            }
            let _ = self
                .admission_duration
                .get_or_create(&EndpointLabels { endpoint });
        }
        for &kind in InjectionKind::ALL {
            let _ = self.injections.get_or_create(&InjectionLabels { kind });
            let _ = self.observed.get_or_create(&InjectionLabels { kind });
        }
        for &reason in SkipReason::ALL {
            let _ = self.skipped.get_or_create(&SkipLabels { reason });
        }
        for &reason in DropReason::ALL {
            let _ = self.required_dropped.get_or_create(&DropLabels { reason });
            let _ = self.pods_released.get_or_create(&DropLabels { reason });
            let _ = self
                .local_volumes_released
                .get_or_create(&DropLabels { reason });
        }
        for &controller in Reconciler::ALL {
            let _ = self
                .reconcile_errors
                .get_or_create(&ReconcilerLabels { controller });
            let _ = self
                .reconcile_duration
                .get_or_create(&ReconcilerLabels { controller });
        }
        for &action in GeneratorAction::ALL {
            let _ = self
                .generator_writes
                .get_or_create(&GeneratorLabels { action });
        }
        for &result in PodRead::ALL {
            let _ = self.pod_reads.get_or_create(&PodReadLabels { result });
        }
        for &result in IpRequestResult::ALL {
            let _ = self.ip_requests.get_or_create(&IpRequestLabels { result });
        }
        for &reason in IpSkipReason::ALL {
            let _ = self
                .ip_request_skipped
                .get_or_create(&IpSkipLabels { reason });
        }
        for &node in NodeRestore::ALL {
            for &ip in IpRestore::ALL {
                let _ = self.restored.get_or_create(&RestoreLabels { node, ip });
            }
        }
    }

    /// Counts one admission request and its latency since `start`.
    pub fn admission(&self, endpoint: &'static str, result: AdmissionResult, start: Instant) {
        let elapsed = start.elapsed().as_secs_f64();
        let resolved = self
            .series
            .endpoints
            .iter()
            .find(|(e, _, _)| *e == endpoint)
            .and_then(|(_, requests, duration)| {
                let at = AdmissionResult::ALL.iter().position(|r| *r == result)?;
                Some((requests.get(at)?, duration))
            });
        match resolved {
            Some((requests, duration)) => {
                requests.inc();
                duration.observe(elapsed);
            }
            None => {
                self.admission_requests
                    .get_or_create(&AdmissionLabels { endpoint, result })
                    .inc();
                self.admission_duration
                    .get_or_create(&EndpointLabels { endpoint })
                    .observe(elapsed);
            }
        }
    }

    /// Counts `n` items of `kind` injected.
    pub fn injected(&self, kind: InjectionKind, n: u64) {
        match InjectionKind::ALL
            .iter()
            .position(|k| *k == kind)
            .and_then(|at| self.series.injections.get(at))
        {
            Some(counter) => counter.inc_by(n),
            None => self
                .injections
                .get_or_create(&InjectionLabels { kind })
                .inc_by(n),
        };
    }

    /// Times one reconcile of `controller` until the timer is dropped.
    pub fn reconcile_timer(&self, controller: Reconciler) -> DropTimer {
        DropTimer {
            histogram: self
                .reconcile_duration
                .get_or_create(&ReconcilerLabels { controller })
                .clone(),
            start: Instant::now(),
        }
    }

    /// Counts one request of the generator.
    pub fn generator_write(&self, action: GeneratorAction) {
        self.generator_writes
            .get_or_create(&GeneratorLabels { action })
            .inc();
    }

    /// Counts one live read of a pod, by what it showed.
    pub fn pod_read(&self, result: PodRead) {
        self.pod_reads
            .get_or_create(&PodReadLabels { result })
            .inc();
    }

    /// Counts one failed reconcile of `controller`.
    pub fn reconcile_error(&self, controller: Reconciler) {
        self.reconcile_errors
            .get_or_create(&ReconcilerLabels { controller })
            .inc();
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
    fn every_resolved_series_counts_in_its_own_exposed_label_set() {
        let m = Metrics::new();
        let paths = endpoints::ALL.into_iter().chain(["other"]);
        let mut n = 0;
        let mut want = Vec::new();
        for endpoint in paths {
            for &result in AdmissionResult::ALL {
                n += 1;
                for _ in 0..n {
                    m.admission(endpoint, result, Instant::now());
                }
                want.push(format!(
                    r#"pps_admission_requests_total{{endpoint="{endpoint}",result="{}"}} {n}"#,
                    result.as_str()
                ));
            }
            let per_endpoint =
                AdmissionResult::ALL.len() * (2 * n + 1 - AdmissionResult::ALL.len()) / 2;
            want.push(format!(
                r#"pps_admission_duration_seconds_count{{endpoint="{endpoint}"}} {per_endpoint}"#
            ));
        }
        for (i, &kind) in InjectionKind::ALL.iter().enumerate() {
            m.injected(kind, i as u64 + 2);
            want.push(format!(
                r#"pps_injections_total{{kind="{}"}} {}"#,
                kind.as_str(),
                i + 2
            ));
        }
        let text = m.encode();
        for line in want {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
    }

    #[test]
    fn proc_stat_parses_including_names_with_spaces_and_parens() {
        let line = "4242 (persistent (pod) state) S 1 2 3 4 5 6 7 8 9 10 250 150 0 0 20 0 12 0 5000 104857600 2560 rest";
        let s = parse_proc_stat(line).expect("parses");
        assert_eq!(s.cpu_seconds, 4.0);
        assert_eq!((s.user_seconds, s.system_seconds), (2.5, 1.5));
        assert_eq!(s.threads, 12);
        assert_eq!(s.start_after_boot_seconds, 50.0);
        assert_eq!((s.virtual_bytes, s.resident_pages), (104_857_600, 2560));
        assert_eq!(parse_proc_stat("garbage"), None);
    }

    #[test]
    fn process_metrics_are_exposed_without_prefix() {
        let m = Metrics::new();
        m.process.refresh();
        let text = m.encode();
        assert!(text.contains("\nprocess_resident_memory_bytes "), "{text}");
        assert!(text.contains("\nprocess_open_fds "), "{text}");
        assert!(text.contains("\npps_cached_pods 0\n"), "{text}");
    }

    #[test]
    fn counters_are_exposed_with_their_total_suffix() {
        let m = Metrics::new();
        m.required_dropped
            .get_or_create(&DropLabels {
                reason: DropReason::NodeLost,
            })
            .inc();
        m.leader.set(1);
        let text = m.encode();
        assert!(
            text.contains("\npps_required_dropped_total{reason=\"node_lost\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("\npps_leader 1\n"), "{text}");
    }
}
