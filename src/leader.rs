//! Leader election over a `coordination.k8s.io` Lease (kube-lease-manager): every replica
//! serves the webhooks from its own caches; only the Lease holder runs the controllers.

use std::future::Future;
use std::time::Duration;

use kube::Client;
use kube_lease_manager::LeaseManagerBuilder;
use tokio_util::sync::CancellationToken;

use crate::cli::LeaseArgs;
use crate::metrics::Metrics;

/// The Lease and how this replica holds it.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// Lease name.
    pub name: String,
    /// Lease namespace.
    pub namespace: String,
    /// This replica's identity (holderIdentity when leading).
    pub identity: String,
    /// Seconds a lock stays valid after its last renewal; a dead leader is replaced after this.
    pub duration_seconds: u64,
    /// Seconds before expiry at which the holder renews.
    pub grace_seconds: u64,
}

impl LeaseConfig {
    /// The Lease to hold as the flags say, or `None` without leader election.
    pub fn from_args(args: &LeaseArgs) -> Option<Self> {
        args.leader_elect.then(|| Self {
            name: args.lease_name.clone(),
            namespace: args.lease_namespace.clone().unwrap_or_else(own_namespace),
            identity: args
                .leader_identity
                .clone()
                .unwrap_or_else(default_identity),
            duration_seconds: args.lease_duration_seconds,
            grace_seconds: args.lease_grace_seconds,
        })
    }
}

/// Runs `lead(stop)` whenever this replica holds the Lease. `stop` is cancelled when the Lease
/// is lost or at `shutdown`; `lead` must then return. At shutdown the Lease is released so
/// another replica takes over at once.
pub async fn run_when_leading<F, Fut>(
    client: Client,
    config: LeaseConfig,
    metrics: &Metrics,
    shutdown: CancellationToken,
    lead: F,
) where
    F: Fn(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    let manager = loop {
        let built = LeaseManagerBuilder::new(client.clone(), &config.name)
            .with_namespace(&config.namespace)
            .with_identity(&config.identity)
            .with_duration(config.duration_seconds)
            .with_grace(config.grace_seconds)
            .build()
            .await;
        match built {
            Ok(m) => break m,
            Err(error) => {
                tracing::warn!(%error, lease = %config.name, namespace = %config.namespace, "cannot use the Lease; retrying");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(5)) => {}
                    () = shutdown.cancelled() => return,
                }
            }
        }
    };
    let (mut leading, lease_task) = manager.watch().await;
    'elections: loop {
        // Wait for the Lease.
        while !*leading.borrow_and_update() {
            tokio::select! {
                changed = leading.changed() => if changed.is_err() { break 'elections },
                () = shutdown.cancelled() => break 'elections,
            }
        }
        tracing::info!(identity = %config.identity, lease = %config.name, "leading: controllers start");
        metrics.leader.set(1);
        let stop = shutdown.child_token();
        let run = lead(stop.clone());
        tokio::pin!(run);
        tokio::select! {
            () = &mut run => {}
            () = lost(&mut leading) => {
                tracing::warn!(identity = %config.identity, "lost the Lease: controllers stop");
                stop.cancel();
                run.await;
            }
        }
        metrics.leader.set(0);
        if shutdown.is_cancelled() {
            break;
        }
    }
    // Dropping the receiver makes the lease task release the Lease and end.
    drop(leading);
    match lease_task.await {
        Ok(Ok(_)) => tracing::info!(lease = %config.name, "Lease released"),
        Ok(Err(error)) => {
            tracing::warn!(%error, "releasing the Lease failed; it expires by itself")
        }
        Err(error) => tracing::warn!(%error, "lease task failed"),
    }
}

async fn lost(leading: &mut tokio::sync::watch::Receiver<bool>) {
    loop {
        if leading.changed().await.is_err() || !*leading.borrow_and_update() {
            return;
        }
    }
}

/// The namespace this process runs in: `POD_NAMESPACE`, else the service account's, else
/// `default`.
pub fn own_namespace() -> String {
    std::env::var("POD_NAMESPACE")
        .ok()
        .or_else(|| {
            std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace").ok()
        })
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".to_owned())
}

/// A default identity: the pod (host) name and the process id.
pub fn default_identity() -> String {
    let host = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "persistent-pod-state".to_owned());
    format!("{host}-{}", std::process::id())
}
