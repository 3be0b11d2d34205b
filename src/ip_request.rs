//! Asking the CNI for a re-created pod's recorded IPs, pure: which annotation a PersistentPodState
//! asks for (`persistent-pod-state.io/ip-request` on it), what value carries the recorded IPs,
//! and when no request is made (and why).
//!
//! Safety first: an IP a live pod holds is never requested (the CNI would refuse the sandbox
//! and the pod would loop), a pod that requests an IP itself is never touched, and a state
//! without IPs, or with one that does not parse, asks for nothing.

use std::net::IpAddr;

use crate::api::ip_request::{ANTREA_POOLS_ANNOTATION, IpRequest};
use crate::workload::PodView;

/// Why no IP request was made.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum IpSkipReason {
    /// The PersistentPodState's request annotation is not a known value.
    InvalidRequest,
    /// The recorded state has no IP.
    NoRecordedIp,
    /// A recorded IP does not parse.
    InvalidRecordedIp,
    /// A live pod holds a recorded IP.
    IpHeld,
    /// The pod requests an IP itself through that annotation.
    PodRequestsOwn,
    /// Antrea honours the request only for a pod with `ipam.antrea.io/ippools`.
    AntreaNoPool,
}

impl IpSkipReason {
    /// A short explanation, for Events.
    pub fn describe(self) -> &'static str {
        match self {
            Self::InvalidRequest => "the PersistentPodState's ip-request annotation is not valid",
            Self::NoRecordedIp => "no IP is recorded for it",
            Self::InvalidRecordedIp => "a recorded IP does not parse",
            Self::IpHeld => "a live pod holds the recorded IP",
            Self::PodRequestsOwn => "the pod requests an IP itself",
            Self::AntreaNoPool => "the pod has no ipam.antrea.io/ippools annotation",
        }
    }
}

/// The most IPs a state records: a pod's, one per family.
pub const MAX_RECORDED_IPS: usize = 2;

/// What to do about a re-created pod's IPs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IpDecision {
    /// The PersistentPodState asks for no IP request.
    NotAsked,
    /// Add `annotation: value`.
    Request {
        /// The pod annotation.
        annotation: String,
        /// Its value, carrying the recorded IPs.
        value: String,
    },
    /// The pod already carries exactly this request (the webhook was invoked again).
    AlreadyRequested,
    /// No request, and why (with the detail an Event shows).
    Skip {
        /// Why.
        reason: IpSkipReason,
        /// What exactly, e.g. which pod holds which IP.
        detail: String,
    },
}

fn skip(reason: IpSkipReason, detail: impl Into<String>) -> IpDecision {
    IpDecision::Skip {
        reason,
        detail: detail.into(),
    }
}

/// Decides the IP request for `pod`, re-created with the `recorded` IPs, when its
/// PersistentPodState's request annotation is `request`. `holder` names the live pod (other
/// than this one) that holds an IP, if any: any namespace, a pod being deleted included.
pub fn decide<'a>(
    request: Option<&str>,
    pod: impl Into<PodView<'a>>,
    recorded: &[String],
    holder: &dyn Fn(&str) -> Option<String>,
) -> IpDecision {
    let Some(request) = request else {
        return IpDecision::NotAsked;
    };
    let request = match IpRequest::parse(request) {
        Ok(r) => r,
        Err(e) => return skip(IpSkipReason::InvalidRequest, e),
    };
    if recorded.is_empty() {
        return skip(IpSkipReason::NoRecordedIp, "");
    }
    // What the recorder writes is a pod's `status.podIPs`: one per family. A longer list was
    // written by hand, and would cost each admission its length squared.
    if recorded.len() > MAX_RECORDED_IPS {
        return skip(
            IpSkipReason::InvalidRecordedIp,
            format!(
                "{} IPs recorded, where a pod has at most {MAX_RECORDED_IPS}",
                recorded.len()
            ),
        );
    }
    let mut ips: Vec<IpAddr> = Vec::new();
    for text in recorded {
        match text.trim().parse::<IpAddr>() {
            Ok(ip) => {
                let family_taken = ips.iter().any(|have| have.is_ipv4() == ip.is_ipv4());
                let redundant = ips.contains(&ip) || (request.one_per_family() && family_taken);
                if !redundant {
                    ips.push(ip);
                }
            }
            Err(_) => return skip(IpSkipReason::InvalidRecordedIp, format!("{text:?}")),
        }
    }
    let annotation = request.annotation().to_owned();
    let value = request.encode(&ips);
    let pod = pod.into();
    if let Some(own) = pod.annotation(&annotation) {
        return if own == value {
            IpDecision::AlreadyRequested
        } else {
            // The key only: annotation values never reach logs or Events.
            skip(IpSkipReason::PodRequestsOwn, annotation)
        };
    }
    if request == IpRequest::Antrea && pod.annotation(ANTREA_POOLS_ANNOTATION).is_none() {
        return skip(IpSkipReason::AntreaNoPool, "");
    }
    for ip in &ips {
        if let Some(by) = holder(&ip.to_string()) {
            return skip(IpSkipReason::IpHeld, format!("{ip} is held by {by}"));
        }
    }
    IpDecision::Request { annotation, value }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ip_request::*;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    fn pod(annotations: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "web-0", "annotations": annotations}}))
            .expect("pod")
    }

    fn free(_: &str) -> Option<String> {
        None
    }

    fn ips(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn request(annotation: &str, value: &str) -> IpDecision {
        IpDecision::Request {
            annotation: annotation.into(),
            value: value.into(),
        }
    }

    #[test]
    fn each_cni_gets_its_annotation_and_format() {
        let dual = ips(&["10.0.0.5", "fd00::5"]);
        let cases = [
            (
                "calico",
                json!({}),
                request(CALICO_IP_ANNOTATION, r#"["10.0.0.5","fd00::5"]"#),
            ),
            (
                "kube-ovn",
                json!({}),
                request(KUBE_OVN_IP_ANNOTATION, "10.0.0.5,fd00::5"),
            ),
            (
                "antrea",
                json!({ANTREA_POOLS_ANNOTATION: "pool"}),
                request(ANTREA_IP_ANNOTATION, "10.0.0.5,fd00::5"),
            ),
            (
                "annotation:example.com/ips",
                json!({}),
                request("example.com/ips", "10.0.0.5,fd00::5"),
            ),
        ];
        for (value, annotations, want) in cases {
            assert_eq!(
                decide(Some(value), &pod(annotations), &dual, &free),
                want,
                "{value}"
            );
        }
        assert_eq!(
            decide(
                Some("calico"),
                &pod(json!({})),
                &ips(&["10.0.0.5", "10.0.0.6"]),
                &free
            ),
            request(CALICO_IP_ANNOTATION, r#"["10.0.0.5"]"#),
            "at most one address per family"
        );
        assert_eq!(
            decide(
                Some("annotation:example.com/ips"),
                &pod(json!({})),
                &ips(&["10.0.0.5", "10.0.0.6"]),
                &free
            ),
            request("example.com/ips", "10.0.0.5,10.0.0.6"),
        );
    }

    #[test]
    fn unsafe_or_impossible_requests_are_skipped_with_a_reason() {
        let one = ips(&["10.0.0.5"]);
        let held = |ip: &str| (ip == "10.0.0.5").then(|| "other-ns/squatter".to_string());
        let reason = |d: IpDecision| match d {
            IpDecision::Skip { reason, .. } => Some(reason),
            _ => None,
        };
        assert_eq!(
            decide(None, &pod(json!({})), &one, &free),
            IpDecision::NotAsked
        );
        type Holder<'a> = &'a dyn Fn(&str) -> Option<String>;
        let cases: [(
            &str,
            serde_json::Value,
            Vec<String>,
            Holder<'_>,
            IpSkipReason,
        ); 8] = [
            (
                "weave",
                json!({}),
                one.clone(),
                &free,
                IpSkipReason::InvalidRequest,
            ),
            (
                "annotation:not a key",
                json!({}),
                one.clone(),
                &free,
                IpSkipReason::InvalidRequest,
            ),
            (
                "calico",
                json!({}),
                vec![],
                &free,
                IpSkipReason::NoRecordedIp,
            ),
            (
                "calico",
                json!({}),
                ips(&["10.0.0.300"]),
                &free,
                IpSkipReason::InvalidRecordedIp,
            ),
            (
                // Written by hand: a pod has one IP per family.
                "annotation:example.com/ips",
                json!({}),
                ips(&["10.0.0.5", "10.0.0.6", "10.0.0.7"]),
                &free,
                IpSkipReason::InvalidRecordedIp,
            ),
            (
                "calico",
                json!({}),
                one.clone(),
                &held,
                IpSkipReason::IpHeld,
            ),
            (
                "calico",
                json!({CALICO_IP_ANNOTATION: r#"["10.9.9.9"]"#}),
                one.clone(),
                &free,
                IpSkipReason::PodRequestsOwn,
            ),
            (
                "antrea",
                json!({}),
                one.clone(),
                &free,
                IpSkipReason::AntreaNoPool,
            ),
        ];
        for (value, annotations, recorded, holder, want) in cases {
            assert_eq!(
                reason(decide(Some(value), &pod(annotations), &recorded, holder)),
                Some(want),
                "{value}"
            );
        }
        let IpDecision::Skip { detail, .. } = decide(Some("calico"), &pod(json!({})), &one, &held)
        else {
            panic!("skipped")
        };
        assert_eq!(detail, "10.0.0.5 is held by other-ns/squatter");
    }

    #[test]
    fn a_second_invocation_finds_its_own_request_and_changes_nothing() {
        let one = ips(&["10.0.0.5"]);
        let again = pod(json!({CALICO_IP_ANNOTATION: r#"["10.0.0.5"]"#}));
        assert_eq!(
            decide(Some("calico"), &again, &one, &free),
            IpDecision::AlreadyRequested
        );
    }
}
