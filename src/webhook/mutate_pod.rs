//! `POST /mutate-pod`: answers Pod CREATE reviews from the shared caches. The decision is the
//! pure [`admit`]; this handler turns its outcome into metrics, Events and the response.
//!
//! The webhook publishes Events (its `sideEffects` is `NoneOnDryRun`): a dry-run request gets
//! exactly the answer a real one would, but publishes nothing.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use kube::runtime::events::EventType;

use super::WebhookState;
use super::admit::{Decision, Lookup, Outcome, admit};
use super::review::{Admission, Review};
use crate::api::PersistentPodState;
use crate::events::Events;
use crate::ip_request::IpDecision;
use crate::metrics::{
    AdmissionResult, DropLabels, InjectionKind, InjectionLabels, IpRequestLabels, IpRequestResult,
    IpSkipLabels, SkipLabels,
};
use crate::placement::{Health, Nodes};
use crate::workload::{GroupKind, WorkloadRef};

/// The path this handler is mounted on.
pub const PATH: &str = "/mutate-pod";

impl Lookup for WebhookState {
    fn nodes(&self) -> &dyn Nodes {
        &*self.caches
    }

    fn handles(&self, kind: &GroupKind) -> bool {
        self.custom_kinds.handles(kind)
    }

    fn pps_for(&self, workload: &WorkloadRef) -> Option<Arc<PersistentPodState>> {
        self.caches.pps_for(workload)
    }

    fn health(&self) -> Health {
        Health::now(self.node_lost_after)
    }

    fn ip_holder(&self, ip: &str, namespace: &str, name: &str) -> Option<String> {
        self.caches.ip_holder(ip, namespace, name)
    }
}

/// Answers one pod AdmissionReview.
pub async fn mutate_pod(State(state): State<Arc<WebhookState>>, review: Review) -> Response {
    let Review { request, received } = review;
    let span = tracing::info_span!("admission", uid = %request.uid, namespace = request.namespace.as_deref().unwrap_or_default(), name = %request.name);
    let _entered = span.enter();
    let outcome = admit(&request, state.as_ref());
    let (answer, result) = respond(&state, request.dry_run, outcome);
    state.metrics.admission(PATH, result, received);
    answer.into_response(&request)
}

fn respond(state: &WebhookState, dry_run: bool, outcome: Outcome) -> (Admission, AdmissionResult) {
    match outcome {
        Outcome::Skip(reason) => {
            state
                .metrics
                .skipped
                .get_or_create(&SkipLabels { reason })
                .inc();
            tracing::debug!(reason = reason.as_str(), "allowed without patch");
            (Admission::allow(), AdmissionResult::Allowed)
        }
        Outcome::Invalid(error) => {
            tracing::warn!(%error, "object is not a readable Pod; allowed without patch");
            (Admission::allow(), AdmissionResult::InvalidObject)
        }
        Outcome::Inject(decision) => {
            report(state, dry_run, &decision);
            let injection = &decision.injection;
            if injection.patch.0.is_empty() {
                return (Admission::allow(), AdmissionResult::Allowed);
            }
            match Admission::patch(&injection.patch) {
                Ok(patched) => {
                    tracing::debug!(
                        pps = decision.pps.metadata.name.as_deref().unwrap_or_default(),
                        required = injection.required,
                        preferred = injection.preferred,
                        annotations = injection.annotations,
                        "injected persistent pod state"
                    );
                    (patched, AdmissionResult::Patched)
                }
                Err(error) => {
                    tracing::error!(%error, "could not serialize the patch; allowing without it");
                    (Admission::allow(), AdmissionResult::Allowed)
                }
            }
        }
    }
}

/// Counts the IP request, or reports why none was made (metric and, unless a dry run, an Event
/// naming the pod).
fn report_ip(state: &WebhookState, events: Option<&Arc<Events>>, decision: &Decision) {
    let m = &state.metrics;
    let result = match &decision.ip {
        IpDecision::NotAsked => return,
        IpDecision::Request { annotation, .. } => {
            tracing::debug!(%annotation, "recorded IPs requested");
            IpRequestResult::Requested
        }
        IpDecision::AlreadyRequested => IpRequestResult::AlreadyRequested,
        IpDecision::Skip { reason, detail } => {
            m.ip_request_skipped
                .get_or_create(&IpSkipLabels { reason: *reason })
                .inc();
            // The detail may quote a tenant's annotation value: below info only.
            tracing::info!(reason = reason.describe(), "recorded IPs not requested");
            tracing::debug!(%detail, "why the recorded IPs were not requested");
            if let Some(events) = events {
                let mut note = format!(
                    "pod {}: recorded IPs not requested: {}",
                    decision.pod,
                    reason.describe()
                );
                if !detail.is_empty() {
                    note.push_str(&format!(" ({detail})"));
                }
                events.publish_about(
                    &decision.pps,
                    &decision.pod,
                    EventType::Warning,
                    "IPRequestSkipped",
                    "Inject",
                    note,
                );
            }
            IpRequestResult::Skipped
        }
    };
    m.ip_requests
        .get_or_create(&IpRequestLabels { result })
        .inc();
}

/// Counts what was injected and reports what was left out (metrics, logs and, unless this is a
/// dry run, Events on the PersistentPodState).
fn report(state: &WebhookState, dry_run: bool, decision: &Decision) {
    let (m, injection, pod) = (&state.metrics, &decision.injection, &decision.pod);
    for (kind, n) in [
        (InjectionKind::Required, injection.required),
        (InjectionKind::Preferred, injection.preferred),
        (InjectionKind::Annotations, injection.annotations),
    ] {
        if n > 0 {
            m.injections
                .get_or_create(&InjectionLabels { kind })
                .inc_by(n as u64);
        }
    }
    let events = state.events.as_ref().filter(|_| !dry_run);
    if let Some(dropped) = &injection.dropped {
        m.required_dropped
            .get_or_create(&DropLabels {
                reason: dropped.reason,
            })
            .inc();
        let values: Vec<String> = dropped
            .values
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        tracing::warn!(pps = decision.pps.metadata.name.as_deref().unwrap_or_default(),
            values = %values.join(","), reason = dropped.reason.describe(),
            "recorded required values left out so the pod is not stranded");
        if let Some(events) = events {
            let kept: Vec<String> = injection
                .kept_required
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let note = format!(
                "pod {pod}: left out required {} ({}); kept required [{}]; preferred placement injected",
                values.join(","),
                dropped.reason.describe(),
                kept.join(",")
            );
            events.publish(
                &decision.pps,
                EventType::Warning,
                "RequiredTopologySkipped",
                "Inject",
                note,
            );
        }
    }
    report_ip(state, events, decision);
    for c in &injection.conflicts {
        m.injection_conflicts.inc();
        tracing::info!(key = %c.key, "pod sets its own nodeSelector value; recorded value not injected");
    }
    if let (Some(events), false) = (events, injection.conflicts.is_empty()) {
        let keys: Vec<&str> = injection.conflicts.iter().map(|c| c.key.as_str()).collect();
        let note = format!(
            "pod {pod} sets {} itself; the recorded value was not injected",
            keys.join(",")
        );
        events.publish(
            &decision.pps,
            EventType::Warning,
            "NodeSelectorConflict",
            "Inject",
            note,
        );
    }
}
