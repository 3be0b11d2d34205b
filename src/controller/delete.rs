//! Deleting a pod that waits where the webhook pinned it, so that its workload creates it
//! again: conditionally on the pod the decision saw, read once more when only its version moved.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Preconditions};
use kube::{Api, ResourceExt};

use super::Error;
use crate::leader::Fence;

/// Deletes the waiting pod `name` (`uid`), conditionally on `resource_version` (the pod as the
/// decision saw it). When that version is stale (the scheduler writes an unschedulable pod's
/// conditions, say), reads the pod once more and deletes it at its current version if it is
/// still that pod, unscheduled, not being deleted, and `still` released as it is now. That pod
/// gone meanwhile (another of its name now, or it is being deleted: the StatefulSet controller
/// deletes a pod whose claim is being deleted, to create both again) is [`Deleted::Already`];
/// scheduled, or no longer to be released, [`Deleted::Kept`].
pub(super) async fn delete_waiting_pod(
    api: &Api<Pod>,
    fence: &Fence,
    (namespace, name): (&str, &str),
    (uid, resource_version): (&str, Option<String>),
    still: &(dyn Fn(&Pod) -> bool + Sync),
) -> Result<Deleted, Error> {
    // Each delete passes the fence right before it is sent, the second as the first.
    let delete = |resource_version: Option<String>| {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version,
            }),
            ..DeleteParams::default()
        };
        async move {
            fence.before_write(namespace).await?;
            api.delete(name, &params).await.map_err(Error::from)
        }
    };
    match delete(resource_version).await {
        Ok(_) => return Ok(Deleted::Now),
        Err(Error::Kube(kube::Error::Api(e))) if e.code == 404 => {
            tracing::info!(pod = name, "the waiting pod is gone already");
            return Ok(Deleted::Already);
        }
        Err(Error::Kube(kube::Error::Api(e))) if e.code == 409 => {
            tracing::info!(pod = name, message = %e.message, "the waiting pod changed since it was seen; reading it again");
        }
        Err(e) => return Err(e),
    }
    let Some(pod) = api.get_opt(name).await? else {
        return Ok(Deleted::Already);
    };
    if pod.uid().as_deref() != Some(uid) || pod.metadata.deletion_timestamp.is_some() {
        tracing::info!(
            pod = name,
            "the waiting pod was deleted by another meanwhile (re-created or being deleted)"
        );
        return Ok(Deleted::Already);
    }
    if pod
        .spec
        .as_ref()
        .is_some_and(|s| s.node_name.as_deref().is_some_and(|n| !n.is_empty()))
    {
        tracing::info!(
            pod = name,
            "the pod no longer waits (scheduled); not released"
        );
        return Ok(Deleted::Kept);
    }
    if !still(&pod) {
        tracing::info!(
            pod = name,
            "the pod as it is now is not to be released; not released"
        );
        return Ok(Deleted::Kept);
    }
    match delete(pod.resource_version()).await {
        Ok(_) => Ok(Deleted::Now),
        Err(Error::Kube(kube::Error::Api(e))) if e.code == 404 => Ok(Deleted::Already),
        // Changed again: looked at again from the cache.
        Err(Error::Kube(kube::Error::Api(e))) if e.code == 409 => Ok(Deleted::Kept),
        Err(e) => Err(e),
    }
}

/// What became of a waiting pod to be released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Deleted {
    /// Deleted by this call.
    Now,
    /// Gone before it (deleted by another).
    Already,
    /// Not deleted: it no longer waits, or changed again.
    Kept,
}

/// `result`'s value, or `None` with its failure kept in `failed` (the first one kept, each
/// logged) where the work goes on past it; a fenced write's stops it at once.
pub(super) fn go_on<T>(
    result: Result<T, Error>,
    failed: &mut Option<Error>,
) -> Result<Option<T>, Error> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(Error::Fenced(fenced)) => Err(fenced.into()),
        Err(error) => {
            tracing::warn!(%error, "a release failed; the others still run, and it is tried again");
            failed.get_or_insert(error);
            Ok(None)
        }
    }
}
