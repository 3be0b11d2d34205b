//! The vocabulary of IP requests: the PersistentPodState annotation that asks for them, the CNI
//! annotations a re-created pod can carry, and how each encodes addresses. When a request is
//! made is decided in `src/ip_request.rs`, on the floor above.

use std::net::IpAddr;

use super::keys::annotation_key_error;
use super::{INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION};

/// PersistentPodState annotation: which CNI annotation re-created pods request their recorded
/// IPs with.
pub const IP_REQUEST_ANNOTATION: &str = "persistent-pod-state.io/ip-request";
/// Calico (calico-ipam): a JSON array with at most one IPv4 and one IPv6 address.
pub const CALICO_IP_ANNOTATION: &str = "cni.projectcalico.org/ipAddrs";
/// Kube-OVN: a comma list, one address per family.
pub const KUBE_OVN_IP_ANNOTATION: &str = "ovn.kubernetes.io/ip_address";
/// Antrea (AntreaIPAM): a comma list, one address per family; honoured only with a pool.
pub const ANTREA_IP_ANNOTATION: &str = "ipam.antrea.io/pod-ips";
/// Antrea: the IP pools of a pod; without it Antrea ignores `ipam.antrea.io/pod-ips`.
pub const ANTREA_POOLS_ANNOTATION: &str = "ipam.antrea.io/ippools";

/// How a PersistentPodState asks for recorded IPs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IpRequest {
    /// `calico`.
    Calico,
    /// `kube-ovn`.
    KubeOvn,
    /// `antrea`.
    Antrea,
    /// `annotation:<key>`: a comma list in the annotation `key`.
    Annotation(String),
}

impl IpRequest {
    /// Parses the value of [`IP_REQUEST_ANNOTATION`]. The annotations the webhook writes
    /// itself are refused as the request's key: its own value would replace the addresses.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value.trim() {
            "calico" => Ok(Self::Calico),
            "kube-ovn" => Ok(Self::KubeOvn),
            "antrea" => Ok(Self::Antrea),
            other => match other.strip_prefix("annotation:") {
                Some(key) if [INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION].contains(&key) => {
                    Err(format!(
                        "{}: the webhook writes {key} itself, so it cannot carry the request",
                        super::shown(other)
                    ))
                }
                // A preset's own annotation is that preset (its encoding, one address per
                // family, Antrea's pool).
                Some(CALICO_IP_ANNOTATION) => Ok(Self::Calico),
                Some(KUBE_OVN_IP_ANNOTATION) => Ok(Self::KubeOvn),
                Some(ANTREA_IP_ANNOTATION) => Ok(Self::Antrea),
                Some(key) => match annotation_key_error(key) {
                    None => Ok(Self::Annotation(key.to_owned())),
                    Some(e) => Err(format!(
                        "{}: the annotation key is invalid: {e}",
                        super::shown(other)
                    )),
                },
                None => Err(format!(
                    "{} is not one of calico, kube-ovn, antrea, annotation:<key>",
                    super::shown(other)
                )),
            },
        }
    }

    /// The pod annotation that carries the request.
    pub fn annotation(&self) -> &str {
        match self {
            Self::Calico => CALICO_IP_ANNOTATION,
            Self::KubeOvn => KUBE_OVN_IP_ANNOTATION,
            Self::Antrea => ANTREA_IP_ANNOTATION,
            Self::Annotation(key) => key,
        }
    }

    /// Whether the annotation takes at most one address per family.
    pub fn one_per_family(&self) -> bool {
        !matches!(self, Self::Annotation(_))
    }

    /// The annotation's value carrying `ips`.
    pub fn encode(&self, ips: &[IpAddr]) -> String {
        let texts: Vec<String> = ips.iter().map(ToString::to_string).collect();
        match self {
            Self::Calico => serde_json::Value::from(texts).to_string(),
            _ => texts.join(","),
        }
    }
}

/// The IPs a pod requests through a preset's annotation (Calico's, Kube-OVN's or Antrea's),
/// each printed back from its parsed form so that it compares with a status IP; what does not
/// parse is left out.
pub fn requested_ips<'a>(annotation: impl Fn(&str) -> Option<&'a str>) -> Vec<String> {
    let mut ips = Vec::new();
    for preset in [IpRequest::Calico, IpRequest::KubeOvn, IpRequest::Antrea] {
        let Some(value) = annotation(preset.annotation()) else {
            continue;
        };
        let texts: Vec<String> = match preset {
            IpRequest::Calico => serde_json::from_str(value).unwrap_or_default(),
            _ => value.split(',').map(str::to_owned).collect(),
        };
        for ip in texts.iter().filter_map(|t| t.trim().parse::<IpAddr>().ok()) {
            let ip = ip.to_string();
            if !ips.contains(&ip) {
                ips.push(ip);
            }
        }
    }
    ips
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn the_presets_requests_are_read_and_garbage_is_left_out() {
        let annotations = BTreeMap::from([
            (
                CALICO_IP_ANNOTATION.to_owned(),
                r#"["10.0.0.5","fd00::05"]"#.to_owned(),
            ),
            (
                KUBE_OVN_IP_ANNOTATION.to_owned(),
                "10.0.0.6, nonsense".to_owned(),
            ),
            (ANTREA_IP_ANNOTATION.to_owned(), "10.0.0.5".to_owned()),
            ("example.com/ips".to_owned(), "10.0.0.9".to_owned()),
        ]);
        assert_eq!(
            requested_ips(|k| annotations.get(k).map(String::as_str)),
            ["10.0.0.5", "fd00::5", "10.0.0.6"]
        );
        let garbage = BTreeMap::from([(CALICO_IP_ANNOTATION.to_owned(), "not json".to_owned())]);
        assert!(requested_ips(|k| garbage.get(k).map(String::as_str)).is_empty());
    }

    #[test]
    fn a_refused_value_is_quoted_cut() {
        let long = "w".repeat(200 << 10);
        for value in [long.clone(), format!("annotation:{long}")] {
            let refused = IpRequest::parse(&value).expect_err("refused");
            assert!(refused.len() < 300, "{} bytes", refused.len());
            assert!(refused.contains("more characters"), "{refused}");
        }
    }

    #[test]
    fn an_annotation_the_webhook_writes_itself_cannot_carry_the_request() {
        for key in [INJECTED_ANNOTATION, INJECTED_REQUIRED_ANNOTATION] {
            let refused = IpRequest::parse(&format!("annotation:{key}"));
            assert!(
                refused.as_ref().is_err_and(|e| e.contains("writes")),
                "{key}: {refused:?}"
            );
        }
        assert_eq!(
            IpRequest::parse("annotation:example.com/ips"),
            Ok(IpRequest::Annotation("example.com/ips".to_owned()))
        );
    }

    #[test]
    fn a_presets_own_annotation_named_is_that_preset() {
        for (key, preset) in [
            (CALICO_IP_ANNOTATION, IpRequest::Calico),
            (KUBE_OVN_IP_ANNOTATION, IpRequest::KubeOvn),
            (ANTREA_IP_ANNOTATION, IpRequest::Antrea),
        ] {
            assert_eq!(IpRequest::parse(&format!("annotation:{key}")), Ok(preset));
        }
        // So Calico's is written as Calico reads it: a JSON array.
        let ips: Vec<IpAddr> = vec!["10.0.0.5".parse().expect("ip")];
        assert_eq!(
            IpRequest::parse(&format!("annotation:{CALICO_IP_ANNOTATION}")).map(|r| r.encode(&ips)),
            Ok("[\"10.0.0.5\"]".to_owned())
        );
    }
}
