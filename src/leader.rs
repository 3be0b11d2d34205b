//! Leader election over a `coordination.k8s.io` Lease, fenced: every replica serves the
//! webhooks from its own caches; only the Lease holder runs the controllers, and only while its
//! hold is certain.
//!
//! As client-go's leader election: a candidate takes the Lease when it is free, or when its
//! record has not changed for the lease duration (measured on the candidate's own clock from
//! when it observed the record); the holder renews every retry period and steps down when it has
//! not renewed within the renew deadline, which is shorter than the lease duration. So a holder
//! that is cut off from the API server, or paused, stops before anyone else may take over. The
//! [`Fence`] carries the same deadline to every write of the controllers: a write is refused
//! once the last renewal is older than the renew deadline (monotonic clock: a paused process
//! wakes up fenced), and every write is conditional on the resourceVersion it was computed
//! from, so even a write already under way when the hold was lost cannot overwrite newer data.
//! One kind of write is not: a pod deleted once its claims on a lost node's volumes are
//! deleted goes by uid alone (it cannot start anywhere then, whatever changed on it since).

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, PostParams};
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
    /// How long a record must stay unchanged before another replica may take the Lease.
    pub duration: Duration,
    /// The holder steps down when it has not renewed for this long (shorter than `duration`).
    pub renew_deadline: Duration,
    /// How often the holder renews and candidates look.
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// The Lease to hold as the flags say, or `None` without leader election. The renew
    /// deadline must be shorter than the lease duration, and the retry period than the deadline.
    pub fn from_args(args: &LeaseArgs) -> anyhow::Result<Option<Self>> {
        if !args.leader_elect {
            return Ok(None);
        }
        anyhow::ensure!(
            args.lease_retry_period_seconds > 0
                && args.lease_retry_period_seconds < args.lease_renew_deadline_seconds
                && args.lease_renew_deadline_seconds < args.lease_duration_seconds,
            "the Lease needs 0 < retry period ({}s) < renew deadline ({}s) < duration ({}s)",
            args.lease_retry_period_seconds,
            args.lease_renew_deadline_seconds,
            args.lease_duration_seconds
        );
        Ok(Some(Self {
            name: args.lease_name.clone(),
            namespace: args.lease_namespace.clone().unwrap_or_else(own_namespace),
            identity: args
                .leader_identity
                .clone()
                .unwrap_or_else(default_identity),
            duration: Duration::from_secs(args.lease_duration_seconds),
            renew_deadline: Duration::from_secs(args.lease_renew_deadline_seconds),
            retry_period: Duration::from_secs(args.lease_retry_period_seconds),
        }))
    }
}

/// Whether the controllers may write now. Cloned into every writer.
#[derive(Clone, Debug)]
pub struct Fence(Arc<Mutex<Option<Instant>>>);

/// A write refused because this replica's hold on the Lease is not certain.
#[derive(Debug, thiserror::Error)]
#[error("not writing: this replica's hold on the Lease is not certain (renew deadline passed)")]
pub struct Fenced;

impl Fence {
    /// A fence that never opens until a Lease is held.
    pub fn closed() -> Self {
        Self(Arc::new(Mutex::new(None)))
    }

    /// A fence that is always open (no leader election: a single replica).
    pub fn open() -> Self {
        Self(Arc::new(Mutex::new(Some(far_future()))))
    }

    fn set(&self, until: Option<Instant>) {
        *crate::sync::lock(&self.0) = until;
    }

    /// Closes the fence (as a lost hold does).
    #[cfg(test)]
    pub fn close(&self) {
        self.set(None);
    }

    /// Right before a write to an object in `namespace`: `Ok` while writes are allowed.
    /// Built with the `e2e` feature (the suite's binaries, never the image), two test hooks
    /// act here first: `PPS_E2E_HOLD_WRITES_IN=NS` with `PPS_E2E_HOLD_FILE=PATH` holds each
    /// write to NS while PATH exists (writing `PATH.held` when one is held), so that a test
    /// can stop the process in the middle of a write; `PPS_E2E_NO_FENCE` lets every write
    /// through, the negative control that shows the fencing test fails without the fence.
    pub async fn before_write(&self, namespace: &str) -> Result<(), Fenced> {
        #[cfg(feature = "e2e")]
        {
            let held_ns = std::env::var("PPS_E2E_HOLD_WRITES_IN").ok();
            if let (Some(ns), Some(path)) = (held_ns, std::env::var_os("PPS_E2E_HOLD_FILE"))
                && ns == namespace
            {
                let path = std::path::PathBuf::from(path);
                if path.exists() {
                    tracing::warn!(%namespace, "e2e hook: holding a write");
                    let _ = std::fs::write(path.with_extension("held"), "");
                    while path.exists() {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            if std::env::var_os("PPS_E2E_NO_FENCE").is_some() {
                return Ok(());
            }
        }
        #[cfg(not(feature = "e2e"))]
        let _ = namespace;
        self.check()
    }

    /// `Ok` while writes are allowed.
    pub fn check(&self) -> Result<(), Fenced> {
        let until = *crate::sync::lock(&self.0);
        match until {
            Some(until) if Instant::now() < until => Ok(()),
            _ => Err(Fenced),
        }
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)
}

/// What a candidate or holder does next, from the Lease as read now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// No Lease: create it, holding it.
    Create,
    /// We hold it: renew.
    Renew,
    /// Free, or unchanged for the lease duration: take it over.
    TakeOver,
    /// Someone else holds it.
    Wait {
        /// Who.
        holder: String,
    },
}

/// The longest lease duration a holder's record is taken at (a holder that wrote more is
/// taken over after this long without a renewal).
const LONGEST_LEASE_HONOURED: Duration = Duration::from_secs(3600);

/// Decides the next step; remembers when each record of another holder was first observed, on
/// the local clock.
#[derive(Debug, Default)]
pub struct Elector {
    observed: Option<Observed>,
}

/// Another holder's record as last observed.
#[derive(Debug)]
struct Observed {
    /// Its leader election record: holder, duration, acquire and renew times, transitions (a
    /// renewal changes it; a write of the Lease's labels or annotations does not).
    record: String,
    /// When it was first observed.
    at: Instant,
    /// Who held it.
    holder: String,
    /// How long it holds without a renewal.
    held_for: Duration,
}

impl Elector {
    /// How long, from `now`, until the other holder's record last observed may be taken over
    /// (none observed: `None`).
    pub fn expires_in(&self, now: Instant) -> Option<Duration> {
        self.observed
            .as_ref()
            .map(|seen| seen.held_for.saturating_sub(now.duration_since(seen.at)))
    }

    /// The step for `lease` (as read at `now`) and this replica's `identity`.
    pub fn step(
        &mut self,
        lease: Option<&Lease>,
        identity: &str,
        duration: Duration,
        now: Instant,
    ) -> Step {
        let Some(lease) = lease else {
            // Deleted under a live holder (`kubectl delete lease`): its fence stays open until
            // its hold expires, so the Lease is created again only then, not at once.
            return match self.observed.take() {
                Some(seen) if now.duration_since(seen.at) < seen.held_for => {
                    let holder = seen.holder.clone();
                    self.observed = Some(seen);
                    Step::Wait { holder }
                }
                _ => Step::Create,
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.unwrap_or_default();
        if holder == identity {
            self.observed = None;
            return Step::Renew;
        }
        if holder.is_empty() {
            self.observed = None;
            return Step::TakeOver;
        }
        // The holder's own duration, as it wrote it, when longer than ours (as client-go
        // judges): a holder configured with a longer lease keeps its fence open that long.
        let held_for = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(duration, |s| {
                duration.max(Duration::from_secs(s).min(LONGEST_LEASE_HONOURED))
            });
        // The record as client-go compares it: what a holder writes, not the Lease's metadata
        // (another tool labelling it must not hold a dead leader's Lease for ever).
        let record = format!(
            "{holder}/{:?}/{:?}/{:?}/{:?}",
            spec.lease_duration_seconds,
            spec.acquire_time.as_ref().map(|t| t.0),
            spec.renew_time.as_ref().map(|t| t.0),
            spec.lease_transitions
        );
        let since = match &self.observed {
            Some(seen) if seen.record == record => seen.at,
            _ => {
                self.observed = Some(Observed {
                    record,
                    at: now,
                    holder: holder.clone(),
                    held_for,
                });
                now
            }
        };
        if now.duration_since(since) >= held_for {
            Step::TakeOver
        } else {
            Step::Wait { holder }
        }
    }
}

/// The Lease as this replica would write it for `step`, from `current`.
fn written(config: &LeaseConfig, step: &Step, current: Option<&Lease>) -> Lease {
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let mut lease = current.cloned().unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(config.name.clone()),
            namespace: Some(config.namespace.clone()),
            ..ObjectMeta::default()
        },
        spec: None,
    });
    lease.metadata.managed_fields = None;
    let mut spec = lease.spec.take().unwrap_or_else(LeaseSpec::default);
    if *step != Step::Renew {
        spec.acquire_time = Some(now.clone());
        spec.lease_transitions = Some(
            spec.lease_transitions
                .unwrap_or(0)
                .saturating_add(i32::from(current.is_some())),
        );
    }
    spec.holder_identity = Some(config.identity.clone());
    spec.lease_duration_seconds =
        Some(i32::try_from(config.duration.as_secs()).unwrap_or(i32::MAX));
    spec.renew_time = Some(now);
    lease.spec = Some(spec);
    lease
}

/// One attempt to take or keep the Lease: whether this replica holds it now.
async fn acquire_or_renew(
    api: &Api<Lease>,
    config: &LeaseConfig,
    elector: &mut Elector,
) -> Result<bool, kube::Error> {
    let current = api.get_opt(&config.name).await?;
    let step = elector.step(
        current.as_ref(),
        &config.identity,
        config.duration,
        Instant::now(),
    );
    let lease = written(config, &step, current.as_ref());
    let renewing = step == Step::Renew;
    // Conditional writes: a create fails if someone created it first; a replace carries the
    // resourceVersion read, so it fails if anyone wrote in between.
    let result = match step {
        Step::Wait { .. } => return Ok(false),
        Step::Create => api.create(&PostParams::default(), &lease).await,
        Step::Renew | Step::TakeOver => {
            api.replace(&config.name, &PostParams::default(), &lease)
                .await
        }
    };
    match result {
        Ok(_) => Ok(true),
        // Another replica created or took it first. A renewal's conflict is a failed renewal
        // (tried again until the renew deadline): anyone may have written the Lease in
        // between (a label, `kubectl edit`), and a replica that took it over is seen so by the
        // next attempt.
        Err(kube::Error::Api(e)) if e.code == 409 && !renewing => Ok(false),
        Err(e) => Err(e),
    }
}

/// Gives the Lease up (at shutdown), so another replica takes over at once: read and written
/// again on a conflict (a renewal sent just before may land first), within [`RELEASE_WITHIN`].
async fn release(api: &Api<Lease>, config: &LeaseConfig) {
    let once = || async {
        let Some(mut lease) = api.get_opt(&config.name).await? else {
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        lease.metadata.managed_fields = None;
        api.replace(&config.name, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    };
    let tries = async {
        loop {
            match once().await {
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                other => break other,
            }
        }
    };
    match tokio::time::timeout(RELEASE_WITHIN, tries).await {
        Ok(Ok(())) => tracing::info!(lease = %config.name, "Lease released"),
        Ok(Err(error)) => {
            tracing::warn!(%error, "releasing the Lease failed; it expires by itself")
        }
        Err(_) => tracing::warn!("releasing the Lease took too long; it expires by itself"),
    }
}

/// How long giving the Lease up may take at shutdown.
const RELEASE_WITHIN: Duration = Duration::from_secs(2);

/// A watch of the Lease that wakes a candidate whenever it changes (renewed: its record is
/// timed from then, not from the candidate's next look; released or deleted: taken at once);
/// stopped when dropped.
struct Released {
    notify: Arc<tokio::sync::Notify>,
    watch: tokio::task::JoinHandle<()>,
}

impl Drop for Released {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

/// Starts watching the Lease for its changes.
fn watch_released(api: &Api<Lease>, config: &LeaseConfig) -> Released {
    use futures::StreamExt as _;
    use kube::runtime::{WatchStreamExt as _, watcher};
    let notify = Arc::new(tokio::sync::Notify::new());
    let events = watcher(
        api.clone(),
        watcher::Config::default().fields(&format!("metadata.name={}", config.name)),
    )
    .default_backoff();
    let wake = notify.clone();
    let watch = tokio::spawn(async move {
        tokio::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(
                    watcher::Event::Apply(_)
                    | watcher::Event::InitApply(_)
                    | watcher::Event::Delete(_),
                ) => wake.notify_one(),
                Ok(_) => {}
                Err(error) => tracing::debug!(%error, "watching the Lease; retrying"),
            }
        }
    });
    Released { notify, watch }
}

/// How the controllers ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// At shutdown.
    Shutdown,
    /// By themselves, while they should have been running: the process must not go on
    /// serving without them.
    Unexpectedly,
}

/// Runs `lead(stop)` whenever this replica holds the Lease, with `fence` open exactly while
/// the hold is certain. `stop` is cancelled when the hold is lost or uncertain, or at
/// `shutdown`; `lead` must then return. Returns when `shutdown` is cancelled (releasing the
/// Lease), or when `lead` returned by itself.
pub async fn run_when_leading<F, Fut>(
    client: Client,
    config: LeaseConfig,
    metrics: &Metrics,
    fence: Fence,
    shutdown: CancellationToken,
    lead: F,
) -> Ended
where
    F: Fn(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let mut elector = Elector::default();
    let mut released: Option<Released> = None;
    // An API call may take at most this long: a hung call cannot outlive the renew deadline.
    let call_timeout = config
        .renew_deadline
        .saturating_sub(config.retry_period)
        .max(Duration::from_secs(1));
    loop {
        // Candidate: look every retry period.
        let attempt_at = Instant::now();
        let held = tokio::select! {
            r = tokio::time::timeout(call_timeout, acquire_or_renew(&api, &config, &mut elector)) => r,
            () = shutdown.cancelled() => return Ended::Shutdown,
        };
        match held {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                // Someone else holds it: besides looking every retry period, watch the Lease,
                // so that a release (a holder shutting down) is taken at once.
                let released = released.get_or_insert_with(|| watch_released(&api, &config));
                // Looked at again when the record may be taken over, if sooner.
                let next = elector
                    .expires_in(Instant::now())
                    .map_or(config.retry_period, |left| left.min(config.retry_period));
                tokio::select! {
                    () = tokio::time::sleep(next) => continue,
                    () = released.notify.notified() => continue,
                    () = shutdown.cancelled() => return Ended::Shutdown,
                }
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, lease = %config.name, "cannot read or take the Lease; retrying");
                tokio::select! {
                    () = tokio::time::sleep(config.retry_period) => continue,
                    () = shutdown.cancelled() => return Ended::Shutdown,
                }
            }
            Err(_) => continue,
        }

        // Holder.
        let mut renewed_at = attempt_at;
        fence.set(Some(renewed_at + config.renew_deadline));
        tracing::info!(identity = %config.identity, lease = %config.name, "leading: controllers start");
        metrics.leader.set(1);
        let stop = shutdown.child_token();
        let run = lead(stop.clone());
        tokio::pin!(run);
        let mut finished = false;
        // The renewal in progress, polled beside the controllers: a slow renewal never pauses
        // them (the fence alone decides whether they may write).
        let mut renewal = None;
        let mut next_renewal = tokio::time::Instant::now() + config.retry_period;
        let why = loop {
            let deadline = tokio::time::Instant::from_std(renewed_at + config.renew_deadline);
            tokio::select! {
                () = &mut run => {
                    finished = true;
                    break if shutdown.is_cancelled() { StepDown::Shutdown } else { StepDown::Ended };
                }
                () = shutdown.cancelled() => break StepDown::Shutdown,
                () = tokio::time::sleep_until(deadline) => break StepDown::DeadlinePassed,
                () = tokio::time::sleep_until(next_renewal), if renewal.is_none() => {
                    let attempt = Instant::now();
                    // The elector goes with the call and comes back with its answer (a renewal
                    // dropped half-way leaves a fresh one: it judges others' Leases afresh).
                    let mut with = std::mem::take(&mut elector);
                    let (api, config) = (&api, &config);
                    renewal = Some(Box::pin(async move {
                        let renewed = tokio::time::timeout(call_timeout, acquire_or_renew(api, config, &mut with)).await;
                        (attempt, renewed, with)
                    }));
                }
                Some((attempt, renewed, with)) = futures::future::OptionFuture::from(renewal.as_mut()), if renewal.is_some() => {
                    renewal = None;
                    elector = with;
                    next_renewal = tokio::time::Instant::now() + config.retry_period;
                    match renewed {
                        Ok(Ok(true)) => {
                            renewed_at = attempt;
                            fence.set(Some(renewed_at + config.renew_deadline));
                        }
                        Ok(Ok(false)) => break StepDown::Lost,
                        Ok(Err(error)) => tracing::warn!(%error, "renewing the Lease failed; retrying until the renew deadline"),
                        Err(_) => tracing::warn!("renewing the Lease timed out; retrying until the renew deadline"),
                    }
                }
            }
        };
        drop(renewal);
        fence.set(None);
        stop.cancel();
        if !finished {
            run.await;
        }
        metrics.leader.set(0);
        match why {
            StepDown::Shutdown => {
                release(&api, &config).await;
                return Ended::Shutdown;
            }
            StepDown::Ended => {
                tracing::error!("the controllers stopped by themselves");
                // The process exits: another replica takes over at once.
                release(&api, &config).await;
                return Ended::Unexpectedly;
            }
            StepDown::DeadlinePassed | StepDown::Lost => {
                tracing::warn!(identity = %config.identity, reason = why.as_str(), "stepped down: controllers stopped");
            }
        }
    }
}

/// Why a holder stops its controllers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StepDown {
    Shutdown,
    Ended,
    DeadlinePassed,
    Lost,
}

impl StepDown {
    fn as_str(self) -> &'static str {
        match self {
            Self::Shutdown => "shutdown",
            Self::Ended => "the controllers ended",
            Self::DeadlinePassed => "not renewed within the renew deadline",
            Self::Lost => "another replica holds the Lease",
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

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;
    use serde_json::json;

    /// The Lease held by `holder` as renewed for the `version`th time (its renew time).
    fn lease(holder: Option<&str>, version: &str) -> Lease {
        serde_json::from_value(json!({
            "metadata": {"name": "l", "namespace": "ns", "resourceVersion": version},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                "renewTime": format!("2026-12-07T00:00:{version:0>2}.000000Z")}
        }))
        .expect("lease")
    }

    /// Waiting for the holder "other".
    fn wait() -> Step {
        Step::Wait {
            holder: "other".into(),
        }
    }

    /// An elector (of a 15 s Lease) that saw "other" hold the Lease at the instant returned.
    fn seeing_other() -> (Elector, Duration, Instant) {
        let (d, t0, mut e) = (Duration::from_secs(15), Instant::now(), Elector::default());
        assert_eq!(
            e.step(Some(&lease(Some("other"), "5")), "me", d, t0),
            wait()
        );
        (e, d, t0)
    }

    #[test]
    fn a_write_of_the_leases_metadata_is_no_renewal() {
        let (mut e, d, t0) = seeing_other();
        let wait = wait();
        // Labelled every 10 s by another tool: a new resourceVersion, the same record.
        for (version, at) in [("6", 10), ("7", 14)] {
            let mut labelled = lease(Some("other"), "5");
            labelled.metadata.resource_version = Some(version.into());
            labelled.metadata.labels = Some([("team".to_owned(), version.to_owned())].into());
            let step = e.step(Some(&labelled), "me", d, t0 + Duration::from_secs(at));
            assert_eq!(step, wait, "{version}");
        }
        let mut labelled = lease(Some("other"), "5");
        labelled.metadata.resource_version = Some("8".into());
        assert_eq!(
            e.step(Some(&labelled), "me", d, t0 + Duration::from_secs(15)),
            Step::TakeOver,
            "not renewed for the lease duration"
        );
    }

    #[test]
    fn takes_a_free_or_stale_lease_and_waits_for_a_live_one() {
        let d = Duration::from_secs(15);
        let t0 = Instant::now();
        let mut e = Elector::default();
        assert_eq!(e.step(None, "me", d, t0), Step::Create);
        assert_eq!(
            e.step(Some(&lease(Some("me"), "1")), "me", d, t0),
            Step::Renew
        );
        assert_eq!(e.step(Some(&lease(None, "1")), "me", d, t0), Step::TakeOver);
        let other = |v: &str| lease(Some("other"), v);
        let wait = wait();
        assert_eq!(e.step(Some(&other("5")), "me", d, t0), wait);
        assert_eq!(
            e.step(Some(&other("5")), "me", d, t0 + Duration::from_secs(10)),
            wait
        );
        // Renewed meanwhile: the clock starts again from this observation.
        assert_eq!(
            e.step(Some(&other("6")), "me", d, t0 + Duration::from_secs(14)),
            wait
        );
        assert_eq!(
            e.step(Some(&other("6")), "me", d, t0 + Duration::from_secs(28)),
            wait
        );
        assert_eq!(
            e.step(Some(&other("6")), "me", d, t0 + Duration::from_secs(29)),
            Step::TakeOver,
            "unchanged for the lease duration"
        );
    }

    #[test]
    fn a_lease_deleted_under_a_live_holder_is_created_again_only_once_its_hold_expired() {
        let (mut e, d, t0) = seeing_other();
        let wait = wait();
        // Deleted 3 s after the holder's last renewal seen: its fence may be open for 12 s more.
        assert_eq!(
            e.expires_in(t0 + Duration::from_secs(3)),
            Some(Duration::from_secs(12))
        );
        assert_eq!(e.step(None, "me", d, t0 + Duration::from_secs(3)), wait);
        assert_eq!(e.step(None, "me", d, t0 + Duration::from_secs(14)), wait);
        assert_eq!(
            e.step(None, "me", d, t0 + Duration::from_secs(15)),
            Step::Create
        );
        // Held by this replica, then deleted: created again at once (its own fence).
        let mut held = Elector::default();
        assert_eq!(
            held.step(Some(&lease(Some("other"), "5")), "me", d, t0),
            wait
        );
        assert_eq!(
            held.step(Some(&lease(None, "6")), "me", d, t0),
            Step::TakeOver
        );
        assert_eq!(
            held.step(Some(&lease(Some("me"), "7")), "me", d, t0),
            Step::Renew
        );
        assert_eq!(held.step(None, "me", d, t0), Step::Create);
    }

    #[test]
    fn a_holder_is_waited_for_as_long_as_the_lease_it_wrote() {
        let d = Duration::from_secs(15);
        let t0 = Instant::now();
        let mut e = Elector::default();
        let mut longer = lease(Some("other"), "7");
        if let Some(spec) = longer.spec.as_mut() {
            spec.lease_duration_seconds = Some(60);
        }
        let wait = wait();
        assert_eq!(e.step(Some(&longer), "me", d, t0), wait);
        assert_eq!(
            e.step(Some(&longer), "me", d, t0 + Duration::from_secs(30)),
            wait,
            "past our 15 s, within its 60"
        );
        assert_eq!(
            e.step(Some(&longer), "me", d, t0 + Duration::from_secs(60)),
            Step::TakeOver
        );
    }

    #[test]
    fn the_fence_closes_at_the_deadline() {
        let fence = Fence::closed();
        assert!(fence.check().is_err());
        fence.set(Some(Instant::now() + Duration::from_secs(60)));
        assert!(fence.check().is_ok());
        fence.set(Some(Instant::now()));
        assert!(
            fence.check().is_err(),
            "a passed deadline (a paused process) fences"
        );
        assert!(Fence::open().check().is_ok());
    }

    #[test]
    fn a_take_over_counts_a_transition_and_a_renewal_does_not() {
        let config = LeaseConfig {
            name: "l".into(),
            namespace: "ns".into(),
            identity: "me".into(),
            duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        };
        let mut held = lease(Some("other"), "3");
        held.spec.as_mut().expect("spec").lease_transitions = Some(4);
        let taken = written(&config, &Step::TakeOver, Some(&held));
        let spec = taken.spec.as_ref().expect("spec");
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(spec.lease_transitions, Some(5));
        assert_eq!(
            taken.resource_version().as_deref(),
            Some("3"),
            "conditional on what was read"
        );
        let renewed = written(&config, &Step::Renew, Some(&taken));
        assert_eq!(
            renewed.spec.as_ref().and_then(|s| s.lease_transitions),
            Some(5)
        );
        let created = written(&config, &Step::Create, None);
        assert_eq!(
            created.spec.as_ref().and_then(|s| s.lease_transitions),
            Some(0)
        );
    }
}

#[cfg(test)]
mod supervision_tests {
    use super::*;
    use http::{Request, Response};
    use kube::client::Body;

    /// Answers the Lease calls of one election: not found, then created.
    async fn grant(handle: &mut tower_test::mock::Handle<Request<Body>, Response<Body>>) {
        let not_found = serde_json::json!({"kind": "Status", "apiVersion": "v1",
            "status": "Failure", "reason": "NotFound", "code": 404});
        answer(handle, http::Method::GET, 404, not_found).await;
        let lease = written(&config(), &Step::Create, None);
        let created = serde_json::to_value(lease).expect("json");
        answer(handle, http::Method::POST, 201, created).await;
    }

    fn config() -> LeaseConfig {
        LeaseConfig {
            name: "l".into(),
            namespace: "ns".into(),
            identity: "me".into(),
            duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    #[tokio::test]
    async fn controllers_that_stop_by_themselves_end_the_election_as_a_failure() {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let metrics = Metrics::new();
        let fence = Fence::closed();
        let run = run_when_leading(
            client,
            config(),
            &metrics,
            fence.clone(),
            CancellationToken::new(),
            |_stop| async {},
        );
        tokio::pin!(run);
        let ended = tokio::select! {
            ended = &mut run => ended,
            () = grant(&mut handle) => run.await,
        };
        assert_eq!(ended, Ended::Unexpectedly);
        assert!(
            fence.check().is_err(),
            "fenced again once the controllers stopped"
        );
    }

    /// Answers the next Lease call with `status` and `body`, checking its method.
    async fn answer(
        handle: &mut tower_test::mock::Handle<Request<Body>, Response<Body>>,
        method: http::Method,
        status: u16,
        body: serde_json::Value,
    ) {
        let (request, respond) = handle.next_request().await.expect("a Lease call");
        assert_eq!(request.method(), method);
        respond.send_response(crate::test_api::json_response(status, &body));
    }

    /// Someone writes the Lease (a label, `kubectl edit`) between a renewal's read and its
    /// write: the renewal conflicts, and is tried again, the term going on.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_conflicts_is_tried_again_without_ending_the_term() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let metrics = Metrics::new();
        let (stopped, seen) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let stopped_here = stopped.clone();
        let run = run_when_leading(
            client,
            config(),
            &metrics,
            Fence::closed(),
            CancellationToken::new(),
            move |stop| {
                let stopped = stopped_here.clone();
                async move {
                    stop.cancelled().await;
                    stopped.store(true, Ordering::Relaxed);
                }
            },
        );
        tokio::pin!(run);
        let held = |version: &str| {
            let mut lease = written(&config(), &Step::Create, None);
            lease.metadata.resource_version = Some(version.to_owned());
            serde_json::to_value(lease).expect("json")
        };
        let conflict = serde_json::json!({"kind": "Status", "apiVersion": "v1",
            "status": "Failure", "reason": "Conflict", "code": 409});
        let calls = async {
            grant(&mut handle).await;
            answer(&mut handle, http::Method::GET, 200, held("1")).await;
            answer(&mut handle, http::Method::PUT, 409, conflict).await;
            answer(&mut handle, http::Method::GET, 200, held("2")).await;
            answer(&mut handle, http::Method::PUT, 200, held("3")).await;
            seen.store(true, Ordering::Relaxed);
        };
        tokio::select! {
            _ = &mut run => panic!("the election ended"),
            () = calls => {}
        }
        assert!(seen.load(Ordering::Relaxed));
        assert!(!stopped.load(Ordering::Relaxed), "the term went on");
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_renewal_never_pauses_the_controllers() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let metrics = Metrics::new();
        let ticks = Arc::new(AtomicU64::new(0));
        let counted = ticks.clone();
        let run = run_when_leading(
            client,
            config(),
            &metrics,
            Fence::closed(),
            CancellationToken::new(),
            move |stop| {
                let ticks = counted.clone();
                async move {
                    // A controller at work: a step every 100 ms.
                    loop {
                        tokio::select! {
                            () = stop.cancelled() => return,
                            () = tokio::time::sleep(Duration::from_millis(100)) => {
                                ticks.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
            },
        );
        tokio::pin!(run);
        tokio::select! {
            _ = &mut run => panic!("the election ended"),
            () = grant(&mut handle) => {}
        }
        // The first renewal is sent and left unanswered for 5 s.
        let (renewal, _respond) = tokio::select! {
            _ = &mut run => panic!("the election ended"),
            r = handle.next_request() => r.expect("a renewal"),
        };
        assert_eq!(renewal.method(), http::Method::GET);
        let before = ticks.load(Ordering::Relaxed);
        tokio::select! {
            _ = &mut run => panic!("the election ended"),
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
        let during = ticks.load(Ordering::Relaxed) - before;
        assert!(
            during >= 40,
            "the controllers made {during} steps while the renewal hung for 5 s"
        );
    }
}
