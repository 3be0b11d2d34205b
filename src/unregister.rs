//! `unregister`: the Helm chart's pre-delete hook. Removes the release's webhook registrations
//! before its server goes away, so an uninstall never leaves the API server calling a webhook
//! that no longer answers (failurePolicy Fail would then refuse every StatefulSet pod).
//! Deletes only what is provably the release's: a configuration whose Helm ownership
//! annotations name the release and its namespace, by uid.

use anyhow::Context;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, Preconditions};
use kube::{Api, Client, Resource};

/// Helm's annotation naming the release that owns an object.
pub const RELEASE_NAME: &str = "meta.helm.sh/release-name";
/// Helm's annotation naming the owning release's namespace.
pub const RELEASE_NAMESPACE: &str = "meta.helm.sh/release-namespace";

/// Why an object found under the registration's name is not the release's (`None`: it is).
pub fn not_ours(meta: &ObjectMeta, release: &str, namespace: &str) -> Option<String> {
    let annotations = meta.annotations.as_ref();
    let get = |k: &str| annotations.and_then(|a| a.get(k)).map(String::as_str);
    match (get(RELEASE_NAME), get(RELEASE_NAMESPACE)) {
        (Some(r), Some(n)) if r == release && n == namespace => None,
        (None, _) | (_, None) => Some("it carries no Helm release annotations".into()),
        (Some(r), Some(n)) => Some(format!("it belongs to release {r} in {n}")),
    }
}

/// What `unregister` did with one configuration.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Deleted (by uid).
    Deleted,
    /// There was none.
    Absent,
    /// Kept: not the release's, and why.
    Kept(String),
}

async fn unregister_one<K>(
    api: Api<K>,
    name: &str,
    release: &str,
    namespace: &str,
) -> anyhow::Result<Outcome>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let Some(found) = api
        .get_opt(name)
        .await
        .context("reading the registration")?
    else {
        return Ok(Outcome::Absent);
    };
    if let Some(why) = not_ours(found.meta(), release, namespace) {
        return Ok(Outcome::Kept(why));
    }
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: found.meta().uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(Outcome::Deleted),
        // Gone meanwhile.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Outcome::Absent),
        // Replaced meanwhile by another object under the same name: not the one judged.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(Outcome::Kept(format!(
            "it was replaced while being removed: {}",
            e.message
        ))),
        Err(e) => Err(e).context("deleting the registration"),
    }
}

/// Removes the Mutating and Validating webhook configurations named `name` when they belong to
/// Helm release `release` of `namespace`; returns a line per configuration saying what was done.
pub async fn unregister(
    client: &Client,
    name: &str,
    release: &str,
    namespace: &str,
) -> anyhow::Result<Vec<String>> {
    let mutating = unregister_one(
        Api::<MutatingWebhookConfiguration>::all(client.clone()),
        name,
        release,
        namespace,
    )
    .await?;
    let validating = unregister_one(
        Api::<ValidatingWebhookConfiguration>::all(client.clone()),
        name,
        release,
        namespace,
    )
    .await?;
    Ok([
        ("MutatingWebhookConfiguration", mutating),
        ("ValidatingWebhookConfiguration", validating),
    ]
    .into_iter()
    .map(|(kind, outcome)| match outcome {
        Outcome::Deleted => format!("{kind} {name}: deleted"),
        Outcome::Absent => format!("{kind} {name}: none"),
        Outcome::Kept(why) => format!("{kind} {name}: kept, {why}"),
    })
    .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(pairs: &[(&str, &str)]) -> ObjectMeta {
        ObjectMeta {
            annotations: Some(
                pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn only_the_named_release_of_the_named_namespace_is_ours() {
        let ours = meta(&[(RELEASE_NAME, "pps"), (RELEASE_NAMESPACE, "ops")]);
        assert_eq!(not_ours(&ours, "pps", "ops"), None);
        assert!(not_ours(&ours, "pps", "other").is_some());
        assert!(not_ours(&ours, "other", "ops").is_some());
        // Applied by kustomize or by hand: never deleted by the hook.
        assert!(not_ours(&ObjectMeta::default(), "pps", "ops").is_some());
        assert!(not_ours(&meta(&[(RELEASE_NAME, "pps")]), "pps", "ops").is_some());
    }
}
