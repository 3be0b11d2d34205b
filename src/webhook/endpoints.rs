//! The paths the admission server serves: the one list that routing, the handlers and the
//! metrics share.

/// Pod CREATE reviews (`mutate_pod.rs`).
pub const MUTATE_POD: &str = "/mutate-pod";
/// PersistentPodState CREATE and UPDATE reviews (`validate_pps.rs`).
pub const VALIDATE_PPS: &str = "/validate-persistentpodstate";
/// ConversionReviews of PersistentPodStates (`convert.rs`).
pub const CONVERT: &str = "/convert";

/// Every served path.
pub const ALL: [&str; 3] = [MUTATE_POD, VALIDATE_PPS, CONVERT];

/// The metric label of a request path: one of the served paths, or `other`.
pub fn label(path: &str) -> &'static str {
    ALL.into_iter().find(|p| *p == path).unwrap_or("other")
}
