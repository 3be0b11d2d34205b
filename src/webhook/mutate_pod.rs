//! `POST /mutate-pod`: answers Pod CREATE reviews from the shared caches. The handler filters
//! the review (a Pod CREATE without subresource) and decodes the pod; the decision is the pure
//! [`decide`]; the handler turns it into metrics, Events and the response.
//!
//! The webhook publishes Events (its `sideEffects` is `NoneOnDryRun`): a dry-run request gets
//! exactly the answer a real one would, but publishes nothing.

use axum::response::Response;
use kube::runtime::events::EventType;

use super::admit::{
    CacheLookup, Decision, Kinds, LeftOut, Lookup, Part, SkipReason, Verdict, decide,
};
use super::inject::Injection;
use super::patch::PodPatch;
pub use super::review::decode_pod;
use super::review::{Admission, AdmissionRequest, Review};
use super::{WebhookState, endpoints};
use crate::api::{Cut, PersistentPodState, json_error_summary};
use crate::ip_request::IpDecision;
use crate::metrics::{
    AdmissionResult, DropLabels, InjectionKind, InjectionLabels, IpRequestLabels, IpRequestResult,
    IpSkipLabels, SkipLabels,
};

impl WebhookState {
    /// The decision's view of this server's caches and configuration.
    pub fn lookup(&self) -> CacheLookup<'_> {
        CacheLookup {
            caches: &self.caches,
            kinds: Kinds::Configured(&self.custom_kinds),
            node_lost_after: self.node_lost_after,
            reservations: Some(&self.ip_reservations),
        }
    }
}

/// What the handler makes of a review.
#[derive(Debug)]
pub enum Outcome {
    /// Not a Pod CREATE without subresource: allowed untouched.
    NotPodCreate,
    /// The review's object is not a readable Pod: allowed untouched, reported.
    Invalid(String),
    /// The pod's decision.
    Decided(Box<Decision>),
}

/// Filters the review (a Pod CREATE without subresource), decodes the pod (once, from the
/// request body) and decides.
pub fn admit(request: &AdmissionRequest, lookup: &dyn Lookup) -> Outcome {
    if !request.kind.is("", "Pod")
        || request.operation != "CREATE"
        || request.sub_resource.is_some()
    {
        return Outcome::NotPodCreate;
    }
    if let Some(t) = request.too_complex {
        return Outcome::Invalid(t.message());
    }
    // Decoded with the review as a rule (borrowed, not copied); else from the object's text.
    let decoded;
    let read = match request.pod() {
        Some(pod) => pod,
        None => match request.object().map(decode_pod) {
            Some(Ok(pod)) => {
                decoded = pod;
                &decoded
            }
            Some(Err(e)) => return Outcome::Invalid(json_error_summary(&e)),
            None => return Outcome::Invalid("the request carries no object".into()),
        },
    };
    let mut pod = read.view();
    let namespace = request
        .namespace
        .as_deref()
        .or(pod.namespace)
        .unwrap_or_default();
    // A pod created with generateName has no name in the object; the request may carry it.
    if pod.name.is_none_or(str::is_empty) {
        pod.name = Some(&request.name);
    }
    Outcome::Decided(Box::new(decide(pod, namespace, lookup)))
}

/// Answers one pod AdmissionReview.
pub fn mutate_pod(state: &WebhookState, review: Review) -> Response {
    let Review { request, received } = review;
    // At debug only: an info span costs every review its fields' formatting; the few events
    // above debug on this path name the review themselves.
    let span = tracing::debug_span!("admission", uid = %request.uid, namespace = %Cut(request.namespace.as_deref().unwrap_or_default()), name = %Cut(&request.name));
    let _entered = span.enter();
    let lookup = state.lookup();
    let mut outcome = admit(&request, &lookup);
    // The IPs asked for are reserved until the cache shows the pod; a review that lost the race
    // for one to another (a reservation made since it decided) decides again, and is not sent
    // it.
    if !request.dry_run
        && let Some((ips, who)) = requested(&outcome, state.observe_all)
        && state
            .ip_reservations
            .reserve(&ips, &who, &state.caches)
            .is_err()
    {
        outcome = admit(&request, &lookup);
    }
    let (answer, result) = respond(state, &request, outcome);
    state
        .metrics
        .admission(endpoints::MUTATE_POD, result, received);
    answer.into_response(&request)
}

/// The recorded IPs a decision asks for, and for whom (`namespace/name`); none when its
/// PersistentPodState is observed only (nothing is asked for).
fn requested(outcome: &Outcome, observe_all: bool) -> Option<(Vec<String>, String)> {
    let Outcome::Decided(decision) = outcome else {
        return None;
    };
    if decision
        .pps
        .as_ref()
        .is_some_and(|p| crate::api::observed_only(p, observe_all))
    {
        return None;
    }
    let Verdict::Inject {
        ip: IpDecision::Request { .. },
        ..
    } = &decision.verdict
    else {
        return None;
    };
    let state = decision
        .pps
        .as_ref()?
        .status
        .as_ref()?
        .pod_states
        .get(&decision.pod)?;
    Some((
        state.pod_ips.clone(),
        format!("{}/{}", decision.namespace, decision.pod),
    ))
}

fn skipped(state: &WebhookState, reason: SkipReason) -> (Admission, AdmissionResult) {
    state
        .metrics
        .skipped
        .get_or_create(&SkipLabels { reason })
        .inc();
    tracing::debug!(reason = reason.as_str(), "allowed without patch");
    (Admission::allow(), AdmissionResult::Allowed)
}

fn respond(
    state: &WebhookState,
    request: &AdmissionRequest,
    outcome: Outcome,
) -> (Admission, AdmissionResult) {
    let dry_run = request.dry_run;
    let decision = match outcome {
        Outcome::NotPodCreate => return skipped(state, SkipReason::NotPodCreate),
        Outcome::Invalid(error) => {
            tracing::warn!(uid = %request.uid, namespace = %Cut(request.namespace.as_deref().unwrap_or_default()),
                name = %Cut(&request.name), %error, "object is not a readable Pod; allowed without patch");
            return (Admission::allow(), AdmissionResult::InvalidObject);
        }
        Outcome::Decided(decision) => decision,
    };
    let (Verdict::Inject { injection, ip }, Some(pps)) = (&decision.verdict, &decision.pps) else {
        return match &decision.verdict {
            Verdict::Skip(reason) => skipped(state, *reason),
            Verdict::Inject { .. } => (Admission::allow(), AdmissionResult::Allowed),
        };
    };
    if crate::api::observed_only(pps, state.observe_all) {
        observed(state, dry_run, &decision.pod, pps, injection);
        return (Admission::allow(), AdmissionResult::Observed);
    }
    report(state, dry_run, &decision, pps, injection, ip);
    if injection.patch.is_empty() {
        return (Admission::allow(), AdmissionResult::Allowed);
    }
    tracing::debug!(
        pps = pps.metadata.name.as_deref().unwrap_or_default(),
        required = injection.required,
        preferred = injection.preferred,
        annotations = injection.annotations,
        "injected persistent pod state"
    );
    (Admission::patch(&injection.patch), AdmissionResult::Patched)
}

/// The longest `WouldInject` Event note (the API server takes 1 kB).
const NOTE_MAX: usize = 1000;

/// The note of a `WouldInject` Event: the exact patch, or (too long for an Event) its size
/// and where to see it.
fn would_inject_note(pod: &str, patch: &PodPatch) -> String {
    let text = patch.to_value().to_string();
    let note = format!("pod {pod}: would inject {text}");
    if note.len() <= NOTE_MAX {
        return note;
    }
    format!(
        "pod {pod}: would inject a patch of {} operations ({} bytes; `explain {pod}` shows it)",
        patch.len(),
        text.len()
    )
}

/// What an observed-only PersistentPodState would have injected: counted, and (unless this is
/// a dry run) a `WouldInject` Event carrying the patch.
fn observed(
    state: &WebhookState,
    dry_run: bool,
    pod: &str,
    pps: &PersistentPodState,
    injection: &Injection,
) {
    for (kind, n) in [
        (InjectionKind::Required, injection.required),
        (InjectionKind::Preferred, injection.preferred),
        (InjectionKind::Annotations, injection.annotations),
    ] {
        // A dry run creates no pod: counted only in the admission figures.
        if n > 0 && !dry_run {
            state
                .metrics
                .observed
                .get_or_create(&InjectionLabels { kind })
                .inc_by(n as u64);
        }
    }
    tracing::debug!(
        pps = pps.metadata.name.as_deref().unwrap_or_default(),
        "observed only: patch computed, not applied"
    );
    if let Some(events) = state.events.as_ref().filter(|_| !dry_run)
        && !injection.patch.is_empty()
    {
        events.publish_about(
            pps,
            pod,
            EventType::Normal,
            "WouldInject",
            "Observe",
            would_inject_note(pod, &injection.patch),
        );
    }
}

/// Counts the IP request, or why none was made (a dry run only logs it).
fn count_ip(state: &WebhookState, dry_run: bool, decision: &Decision, ip: &IpDecision) {
    let m = &state.metrics;
    let result = match ip {
        IpDecision::NotAsked => return,
        IpDecision::Request { annotation, .. } => {
            tracing::debug!(%annotation, "recorded IPs requested");
            IpRequestResult::Requested
        }
        IpDecision::AlreadyRequested => IpRequestResult::AlreadyRequested,
        IpDecision::Skip { reason, detail } => {
            if !dry_run {
                m.ip_request_skipped
                    .get_or_create(&IpSkipLabels { reason: *reason })
                    .inc();
            }
            // The detail may quote a tenant's annotation value: below info only.
            tracing::info!(namespace = %Cut(&decision.namespace), pod = %Cut(&decision.pod),
                reason = reason.describe(), "recorded IPs not requested");
            tracing::debug!(%detail, "why the recorded IPs were not requested");
            IpRequestResult::Skipped
        }
    };
    if !dry_run {
        m.ip_requests
            .get_or_create(&IpRequestLabels { result })
            .inc();
    }
}

/// Counts what was injected and reports what was left out (logs and, unless this is a dry run,
/// which creates no pod, metrics and Events on the PersistentPodState, one per pod, described by
/// [`Decision::left_out`]).
fn report(
    state: &WebhookState,
    dry_run: bool,
    decision: &Decision,
    pps: &PersistentPodState,
    injection: &Injection,
    ip: &IpDecision,
) {
    let m = &state.metrics;
    for (kind, n) in [
        (InjectionKind::Required, injection.required),
        (InjectionKind::Preferred, injection.preferred),
        (InjectionKind::Annotations, injection.annotations),
    ] {
        if n > 0 && !dry_run {
            m.injected(kind, n as u64);
        }
    }
    if let Some(dropped) = &injection.dropped {
        if !dry_run {
            m.required_dropped
                .get_or_create(&DropLabels {
                    reason: dropped.reason,
                })
                .inc();
        }
        let values: Vec<String> = dropped
            .values
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        tracing::warn!(namespace = %Cut(&decision.namespace), pod = %Cut(&decision.pod),
            pps = pps.metadata.name.as_deref().unwrap_or_default(),
            values = %values.join(","), reason = dropped.reason.describe(),
            "recorded required values left out so the pod is not stranded");
    }
    count_ip(state, dry_run, decision, ip);
    for c in &injection.conflicts {
        if !dry_run {
            m.injection_conflicts.inc();
        }
        tracing::info!(namespace = %Cut(&decision.namespace), pod = %Cut(&decision.pod), key = %c.key,
            "pod sets its own nodeSelector value; recorded value not injected");
    }
    let Some(events) = state.events.as_ref().filter(|_| !dry_run) else {
        return;
    };
    let left_out = decision.left_out();
    let of = |part: Part| -> Vec<LeftOut> {
        left_out
            .iter()
            .filter(|l| l.part == part)
            .cloned()
            .collect()
    };
    let pod = &decision.pod;
    let required = of(Part::Required);
    if !required.is_empty() {
        let kept: Vec<String> = injection
            .kept_required
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let preferred = if injection.preferred > 0 {
            "preferred placement injected"
        } else {
            "no preferred placement to inject"
        };
        let note = format!(
            "pod {pod}: left out {}; kept required [{}]; {preferred}",
            LeftOut::list(&required),
            kept.join(",")
        );
        events.publish_about(
            pps,
            pod,
            EventType::Warning,
            "RequiredTopologySkipped",
            "Inject",
            note,
        );
    }
    let ip_request = of(Part::IpRequest);
    if !ip_request.is_empty() {
        let note = format!("pod {pod}: left out {}", LeftOut::list(&ip_request));
        events.publish_about(
            pps,
            pod,
            EventType::Warning,
            "IPRequestSkipped",
            "Inject",
            note,
        );
    }
    let conflicts = of(Part::Conflict);
    if !conflicts.is_empty() {
        let note = format!(
            "pod {pod}: left out {}; the pod's own values stay",
            LeftOut::list(&conflicts)
        );
        events.publish_about(
            pps,
            pod,
            EventType::Warning,
            "NodeSelectorConflict",
            "Inject",
            note,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::admit::tests::{Fake, pps};
    use super::super::review::parse;
    use super::*;
    use crate::placement::{self, PodDemands};
    use crate::workload::PodView;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::{Value, json};

    /// A parsed request for `object` (absent when `None`).
    fn request(
        kind: &str,
        operation: &str,
        sub: Option<&str>,
        object: Option<Value>,
    ) -> AdmissionRequest {
        let body = serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u", "kind": {"group": "", "version": "v1", "kind": kind},
                "resource": {"group": "", "version": "v1", "resource": "pods"}, "subResource": sub,
                "operation": operation, "userInfo": {}, "namespace": "ns", "name": "web-0",
                "object": object}
        }))
        .expect("json");
        parse(body.into()).expect("request")
    }

    fn pod(owner_kind: &str) -> Value {
        json!({"metadata": {"name": "web-0", "ownerReferences": [{"apiVersion": "apps/v1",
            "kind": owner_kind, "name": "web", "uid": "u", "controller": true}]},
            "spec": {"containers": [{"name": "c"}]}})
    }

    #[test]
    fn filters_pod_creates_and_reports_unreadable_pods() {
        let state = json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"}}});
        let with = Fake {
            pps: Some(pps(state)),
            nodes: true,
        };
        for req in [
            request("Pod", "UPDATE", None, Some(pod("StatefulSet"))),
            request("Pod", "CREATE", Some("binding"), Some(pod("StatefulSet"))),
            request("Service", "CREATE", None, Some(pod("StatefulSet"))),
        ] {
            assert!(matches!(admit(&req, &with), Outcome::NotPodCreate));
        }
        let create = |object: Option<Value>| request("Pod", "CREATE", None, object);
        assert!(matches!(
            admit(&create(Some(json!({"spec": []}))), &with),
            Outcome::Invalid(_)
        ));
        assert!(matches!(admit(&create(None), &with), Outcome::Invalid(_)));
        let Outcome::Decided(decision) = admit(&create(Some(pod("StatefulSet"))), &with) else {
            panic!("decided")
        };
        assert_eq!(
            (decision.namespace.as_str(), decision.pod.as_str()),
            ("ns", "web-0")
        );
        assert!(matches!(decision.verdict, Verdict::Inject { .. }));
    }

    #[test]
    fn an_observed_only_pps_is_answered_without_its_patch_and_counted() {
        let state = json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"}}});
        let create = request("Pod", "CREATE", None, Some(pod("StatefulSet")));
        let server = WebhookState::over(crate::state::Caches::new());
        let mut observed = (*pps(state.clone())).clone();
        observed.metadata.annotations =
            Some([(crate::api::MODE_ANNOTATION.to_owned(), "observe".to_owned())].into());
        for (p, observe_all, want) in [
            (pps(state.clone()), false, AdmissionResult::Patched),
            (
                std::sync::Arc::new(observed),
                false,
                AdmissionResult::Observed,
            ),
            (pps(state.clone()), true, AdmissionResult::Observed),
        ] {
            let lookup = Fake {
                pps: Some(p),
                nodes: true,
            };
            let server = WebhookState {
                observe_all,
                metrics: std::sync::Arc::new(crate::metrics::Metrics::new()),
                ..WebhookState::over(server.caches.clone())
            };
            let outcome = admit(&create, &lookup);
            let (answer, result) = respond(&server, &create, outcome);
            assert_eq!(result, want);
            assert!(answer.allowed);
            let observed = server
                .metrics
                .observed
                .get_or_create(&InjectionLabels {
                    kind: InjectionKind::Required,
                })
                .get();
            let injected = server
                .metrics
                .injections
                .get_or_create(&InjectionLabels {
                    kind: InjectionKind::Required,
                })
                .get();
            if want == AdmissionResult::Observed {
                assert!(answer.patch.is_none(), "nothing injected");
                assert_eq!((observed, injected), (1, 0));
            } else {
                assert!(answer.patch.is_some());
                assert_eq!((observed, injected), (0, 1));
            }
        }
    }

    #[test]
    fn the_request_name_stands_in_for_a_generated_name() {
        let state = json!({"web-0": {"nodeName": "n1", "nodeTopologyLabels": {"zone": "z1"}}});
        let lookup = Fake {
            pps: Some(pps(state)),
            nodes: false,
        };
        let mut object = pod("StatefulSet");
        object["metadata"]["name"] = json!("");
        let Outcome::Decided(decision) =
            admit(&request("Pod", "CREATE", None, Some(object)), &lookup)
        else {
            panic!("decided")
        };
        assert_eq!(decision.pod, "web-0");
        let Verdict::Inject { injection, .. } = &decision.verdict else {
            panic!("injects")
        };
        assert!(injection.dropped.is_some(), "no node has zone=z1");
    }

    #[test]
    fn the_partial_decode_injects_exactly_what_the_full_pod_would() {
        let pps: PersistentPodState = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns", "annotations": {
                "persistent-pod-state.io/ip-request": "calico"}},
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web"},
                     "requiredPersistentTopology": {"keys": ["zone"]},
                     "preferredPersistentTopology": [{"weight": 50, "preference": {"keys": ["host"]}}],
                     "persistentPodAnnotations": [{"key": "a"}]}
        }))
        .expect("pps");
        let state: crate::api::PodState = serde_json::from_value(json!({
            "nodeName": "n1", "nodeTopologyLabels": {"zone": "z1", "host": "n1"},
            "annotations": {"a": "1"}, "podIPs": ["10.0.0.1"]}))
        .expect("state");
        let owner = json!([{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "u", "controller": true}]);
        let pods = [
            json!({"metadata": {"name": "web-0", "ownerReferences": owner}, "spec": {"containers": [{"name": "c"}]}}),
            json!({"metadata": {"name": "web-0", "ownerReferences": owner, "annotations": {"a": "0"},
                    "managedFields": [{"manager": "m", "fieldsV1": {"f:spec": {}}}]},
                   "spec": {"nodeSelector": {"zone": "z2", "disk": "ssd"},
                            "tolerations": [{"key": "t", "operator": "Exists"}],
                            "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}},
                            "containers": [{"name": "c", "env": [{"name": "X", "value": "y"}]}],
                            "volumes": [{"name": "v", "emptyDir": {}}]}}),
            json!({"metadata": {"name": "web-0", "ownerReferences": owner},
                   "spec": {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                       {"weight": 1, "preference": {"matchExpressions": [{"key": "k", "operator": "Exists"}]}}],
                       "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                           {"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["z9"]}]}]}}}}}),
            json!({"metadata": {"name": "web-0", "ownerReferences": owner}}),
            json!({"metadata": {"name": "web-0", "ownerReferences": owner}, "spec": {"affinity": {}}}),
            json!({"metadata": {"name": "web-0", "ownerReferences": owner}, "spec": {"nodeName": "n2"}}),
        ];
        let keep = |recorded| placement::Required {
            kept: recorded,
            dropped: None,
        };
        for object in pods {
            let full: Pod = serde_json::from_value(object.clone()).expect("full pod");
            let read = decode_pod(&object.to_string()).expect("partial pod");
            let partial = read.view();
            assert_eq!(PodDemands::of(&full), PodDemands::of(partial));
            assert_eq!(PodView::from(&full).workload("ns"), partial.workload("ns"));
            let request = Some(("cni.projectcalico.org/ipAddrs", Some("[\"10.0.0.1\"]")));
            let inject = |pod: PodView<'_>| {
                super::super::inject::injection_for(pod, "web", &pps.spec, &state, &keep, request)
                    .patch
            };
            assert_eq!(inject((&full).into()), inject(partial), "{object}");
        }
    }
}
