//! Pacing and retry: how often a PersistentPodState's status may be written, and when a failed
//! reconcile is tried again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;

use super::{Context, Error, WorkloadContext};
use crate::api::PersistentPodState;
use crate::metrics::Reconciler;
use crate::sync::lock;

/// Retry delays of failed reconciles: exponential by consecutive failures of an object
/// (0.5 s, 1 s, 2 s ... up to 5 min), with jitter (each delay is between half and all of it),
/// so many objects failing together do not retry in step.
#[derive(Default)]
pub(super) struct Backoff(Mutex<HashMap<String, u32>>);

impl Backoff {
    pub(super) const BASE: Duration = Duration::from_millis(500);
    pub(super) const MAX: Duration = Duration::from_secs(300);
    /// Objects tracked at most (failures of objects gone since are forgotten beyond it).
    const TRACKED: usize = 10_000;

    /// Counts a failure of `key`; the delay before its next try.
    pub(super) fn failed(&self, key: String) -> Duration {
        let mut failures = lock(&self.0);
        if failures.len() >= Self::TRACKED {
            failures.clear();
        }
        let n = failures.entry(key.clone()).or_insert(0);
        *n = n.saturating_add(1);
        let exponential = Self::BASE
            .saturating_mul(2u32.saturating_pow((*n).saturating_sub(1).min(16)))
            .min(Self::MAX);
        let random = std::hash::BuildHasher::hash_one(
            &std::hash::RandomState::new(),
            (&key, *n, std::time::SystemTime::now()),
        );
        // Between half and all of the exponential delay.
        exponential.mul_f64(0.5 + (random % 1000) as f64 / 2000.0)
    }

    /// Forgets the failures of `key`.
    pub(super) fn succeeded(&self, key: &str) {
        lock(&self.0).remove(key);
    }
}

/// Status writes are paced per PersistentPodState. The first change after a quiet spell is
/// written at once. During a rollout (a write in the last [`Pacing::ROLLOUT`]), a change waits
/// until it is [`Pacing::GATHER`] old and the last write [`Pacing::INTERVAL`] old, so the pods
/// that turn Ready together (a large StatefulSet comes up in bursts) go out in one write, not
/// one per pod or two per burst; each pod is still recorded within about the longer of the two
/// (plus a reconcile). The wait also lets the cache catch up with the last write, so the next is
/// rarely computed from a stale copy (which would be a conflict and a retry). A write that failed
/// (not a conflict) is not tried again before its backoff is over, however many events arrive
/// meanwhile: an API server or a policy refusing it is not sent the same write on every event.
#[derive(Default)]
pub(super) struct Pacing(pub(super) Mutex<HashMap<ObjectRef<PersistentPodState>, Paced>>);

/// A PersistentPodState's last write (or failed try), since when a change has been waiting for
/// the next, and when a failed write may be tried again.
#[derive(Clone, Copy, Debug)]
pub(super) struct Paced {
    pub(super) wrote: Instant,
    pub(super) waiting_since: Option<Instant>,
    pub(super) retry_at: Option<Instant>,
}

impl Pacing {
    /// The least time between two writes of one PersistentPodState.
    pub(super) const INTERVAL: Duration = Duration::from_millis(300);
    /// How long a change waits during a rollout for those that follow it.
    pub(super) const GATHER: Duration = Duration::from_millis(500);
    /// How long after a write a PersistentPodState counts as rolling out.
    pub(super) const ROLLOUT: Duration = Duration::from_secs(10);

    /// How long a pending change of `pps` must still wait, if at all.
    pub(super) fn wait(&self, pps: &ObjectRef<PersistentPodState>) -> Option<Duration> {
        let mut paced = lock(&self.0);
        let p = paced.get_mut(pps)?;
        let backoff = p.retry_at.map_or(Duration::ZERO, |at| {
            at.saturating_duration_since(Instant::now())
        });
        let since_write = p.wrote.elapsed();
        let wait = if since_write >= Self::ROLLOUT {
            backoff
        } else {
            let waiting = p.waiting_since.get_or_insert_with(Instant::now).elapsed();
            Self::INTERVAL
                .saturating_sub(since_write)
                .max(Self::GATHER.saturating_sub(waiting))
                .max(backoff)
        };
        (!wait.is_zero()).then_some(wait)
    }

    /// Notes that nothing of `pps` waits to be written (what waited was undone meanwhile, or
    /// what failed to be written is no longer needed).
    pub(super) fn settled(&self, pps: &ObjectRef<PersistentPodState>) {
        if let Some(p) = lock(&self.0).get_mut(pps) {
            p.waiting_since = None;
            p.retry_at = None;
        }
    }

    /// Notes a write to `pps` now.
    pub(super) fn wrote(&self, pps: ObjectRef<PersistentPodState>) {
        let now = Instant::now();
        let paced = Paced {
            wrote: now,
            waiting_since: None,
            retry_at: None,
        };
        self.recent(now).insert(pps, paced);
    }

    /// Notes a failed write to `pps` now, not to be tried again for `backoff` (and then at
    /// once: what failed has waited since now).
    pub(super) fn failed(&self, pps: ObjectRef<PersistentPodState>, backoff: Duration) {
        let now = Instant::now();
        let mut paced = self.recent(now);
        let wrote = paced.get(&pps).map_or(now, |p| p.wrote);
        let failed = Paced {
            wrote,
            waiting_since: Some(now),
            retry_at: now.checked_add(backoff),
        };
        paced.insert(pps, failed);
    }

    /// The map, without the PersistentPodStates written over a rollout ago whose backoff is
    /// over: it holds only those written in the last [`Pacing::ROLLOUT`] or waiting to be
    /// tried again.
    fn recent(
        &self,
        now: Instant,
    ) -> std::sync::MutexGuard<'_, HashMap<ObjectRef<PersistentPodState>, Paced>> {
        let mut paced = lock(&self.0);
        paced.retain(|_, p| {
            now.duration_since(p.wrote) < Self::ROLLOUT || p.retry_at.is_some_and(|at| at > now)
        });
        paced
    }
}

/// Releases of waiting pods, per PersistentPodState: a token bucket of `per_minute` tokens,
/// refilled at that rate, so that a burst of stranded pods is released at once up to it and
/// the rest at the rate.
pub(super) struct Releases {
    per_minute: u32,
    buckets: Mutex<HashMap<ObjectRef<PersistentPodState>, (f64, Instant)>>,
}

impl Releases {
    /// The default of `--max-releases-per-minute`.
    pub(super) const DEFAULT_PER_MINUTE: u32 = 10;

    pub(super) fn new(per_minute: u32) -> Self {
        Self {
            per_minute,
            buckets: Mutex::default(),
        }
    }

    /// Takes a release for `pps` if one is left; else how long until one is.
    pub(super) fn take(&self, pps: &ObjectRef<PersistentPodState>) -> Result<(), Duration> {
        if self.per_minute == 0 {
            return Err(Duration::from_secs(60));
        }
        let full = f64::from(self.per_minute);
        let per_second = full / 60.0;
        let mut buckets = lock(&self.buckets);
        let now = Instant::now();
        // Buckets refilled full are forgotten (the map holds only recent releasers).
        buckets.retain(|_, (tokens, at)| {
            *tokens + now.duration_since(*at).as_secs_f64() * per_second < full
        });
        let (tokens, at) = buckets.entry(pps.clone()).or_insert((full, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * per_second).min(full);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / per_second))
        }
    }
}

impl Releases {
    /// Gives back a release taken for `pps` that released nothing.
    pub(super) fn give_back(&self, pps: &ObjectRef<PersistentPodState>) {
        let full = f64::from(self.per_minute);
        if let Some((tokens, _)) = lock(&self.buckets).get_mut(pps) {
            *tokens = (*tokens + 1.0).min(full);
        }
    }
}

/// The key a failure of `obj` is counted under, per controller.
pub(super) fn failure_key<K: ResourceExt>(controller: &str, obj: &K) -> String {
    format!(
        "{controller}/{}/{}",
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    )
}

/// Whether an error is a conflict (a write conditional on an older version).
pub(super) fn is_conflict(error: &Error) -> bool {
    matches!(error, Error::Kube(kube::Error::Api(e)) if e.code == 409)
}

/// The PersistentPodState controller's retry: counted, backed off per object.
pub(super) fn pps_error_policy(
    pps: Arc<PersistentPodState>,
    error: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.metrics.reconcile_error(Reconciler::Status);
    let delay = ctx.failures.failed(failure_key("pps", pps.as_ref()));
    if is_conflict(error) {
        tracing::info!(pps = %pps.name_any(), namespace = ?pps.namespace(), "status changed meanwhile; computing again");
    } else {
        tracing::warn!(pps = %pps.name_any(), namespace = ?pps.namespace(), %error, ?delay, "reconcile failed; retrying");
    }
    Action::requeue(delay)
}

/// A generator's retry: counted, backed off per object.
pub(super) fn workload_error_policy(
    obj: Arc<DynamicObject>,
    error: &Error,
    wctx: Arc<WorkloadContext>,
) -> Action {
    let ctx = &wctx.ctx;
    ctx.metrics.reconcile_error(Reconciler::Generator);
    let delay = ctx.failures.failed(failure_key("generator", obj.as_ref()));
    tracing::warn!(workload = %obj.name_any(), namespace = ?obj.namespace(), %error, ?delay, "generation failed; retrying");
    Action::requeue(delay)
}
