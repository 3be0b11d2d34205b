//! The vocabulary of IP requests: the PersistentPodState annotation that asks for them, the CNI
//! annotations a re-created pod can carry, and how each encodes addresses. When a request is
//! made is decided in `src/ip_request.rs`, on the floor above.

use std::net::IpAddr;

use super::keys::qualified_name_error;

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
    /// Parses the value of [`IP_REQUEST_ANNOTATION`].
    pub fn parse(value: &str) -> Result<Self, String> {
        match value.trim() {
            "calico" => Ok(Self::Calico),
            "kube-ovn" => Ok(Self::KubeOvn),
            "antrea" => Ok(Self::Antrea),
            other => match other.strip_prefix("annotation:") {
                Some(key) => match qualified_name_error(key) {
                    None => Ok(Self::Annotation(key.to_owned())),
                    Some(e) => Err(format!("{other:?}: the annotation key is invalid: {e}")),
                },
                None => Err(format!(
                    "{other:?} is not one of calico, kube-ovn, antrea, annotation:<key>"
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
