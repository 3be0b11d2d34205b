//! Long-lived tasks that must not die silently: [`restarting`] runs one in a task of its own
//! and starts it again, with backoff, whenever it ends or panics before shutdown. (The watches
//! of the caches are supervised the same way in `state`, where a restart also marks the cache
//! stale; a task that cannot be started again, a server holding its listener, ends the process
//! from `serve`.)

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// First delay before a task is started again; doubled each time up to [`BACKOFF_MAX`], and
/// back to the first once a run lasted [`STEADY`].
const BACKOFF: Duration = Duration::from_secs(1);
/// Longest delay before a task is started again.
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A run this long resets the backoff.
const STEADY: Duration = Duration::from_secs(60);

/// Runs the task `make` makes until `shutdown` (the task itself stops on it); when it ends or
/// panics before then, logs why and starts a new one after a backoff. Returns the number of
/// restarts once `shutdown` is cancelled.
pub async fn restarting<F, Fut>(name: &'static str, shutdown: CancellationToken, make: F) -> u32
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (mut backoff, mut restarts) = (BACKOFF, 0u32);
    loop {
        let started = tokio::time::Instant::now();
        let ended = AbortOnDropHandle::new(tokio::spawn(make())).await;
        if shutdown.is_cancelled() {
            return restarts;
        }
        let why = match ended {
            Ok(()) => "it ended by itself".to_owned(),
            Err(e) if e.is_panic() => "it panicked".to_owned(),
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= STEADY {
            backoff = BACKOFF;
        }
        tracing::error!(task = name, %why, delay = ?backoff, "a long-lived task stopped; starting it again");
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = shutdown.cancelled() => return restarts,
        }
        restarts += 1;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(start_paused = true)]
    async fn a_task_that_panics_or_ends_is_started_again_until_shutdown() {
        let shutdown = CancellationToken::new();
        let runs = Arc::new(AtomicU32::new(0));
        let (counted, stop) = (runs.clone(), shutdown.clone());
        let supervised = tokio::spawn(restarting("test", shutdown.clone(), move || {
            let (runs, stop) = (counted.clone(), stop.clone());
            async move {
                match runs.fetch_add(1, Ordering::SeqCst) {
                    0 => panic!("a bug"),
                    1 => {}
                    // The third run is the good one: it runs until shutdown.
                    _ => stop.cancelled().await,
                }
            }
        }));
        while runs.load(Ordering::SeqCst) < 3 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!supervised.is_finished(), "the third run lives");
        shutdown.cancel();
        let restarts = supervised.await.expect("supervisor");
        assert_eq!(
            restarts, 2,
            "started again after the panic and after the end"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 3);
    }
}
