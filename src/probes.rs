//! The plain-HTTP probe server: `/healthz` (the process serves), `/readyz` (caches synced and
//! not shutting down) and `/metrics` (Prometheus text).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::metrics::Metrics;
use crate::serving::{Budget, RequestLimit, limit_requests};
use crate::state::Caches;

/// What the probes report on.
pub struct Health {
    /// The shared caches (ready once synced).
    pub caches: Arc<Caches>,
    /// Set at the start of shutdown: readiness fails from then on.
    pub shutting_down: AtomicBool,
    /// Metrics to expose.
    pub metrics: Arc<Metrics>,
}

impl Health {
    /// Whether the process should receive traffic: its caches synced and every watch its
    /// answers read current (none failed, ended or restarted without being relisted since),
    /// and not shutting down.
    pub fn is_ready(&self) -> bool {
        self.caches.is_synced()
            && self.caches.watches.stale_serving().is_empty()
            && !self.shutting_down.load(Ordering::Acquire)
    }
}

/// The probe routes (a few requests at once, each within 5 s; `/metrics` within a share of its
/// own, so scrapes never take the slots the kubelet's probes answer in).
pub fn router(health: Arc<Health>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(limit(), limit_requests))
        .with_state(health)
}

/// The probe server's bounds: GETs (no body is expected), a few at once, a small share of bytes;
/// `/metrics` in a share of its own.
fn limit() -> RequestLimit {
    let budget = |in_flight| Budget {
        in_flight,
        bytes: 64 << 10,
        pruned: &[],
        held_per_byte: 0,
    };
    RequestLimit::new(budget(8), Duration::from_secs(5), 64 << 10, None)
        .endpoint("/metrics", budget(4))
}

async fn readyz(State(health): State<Arc<Health>>) -> Response {
    if health.is_ready() {
        (StatusCode::OK, "ok").into_response()
    } else if health.shutting_down.load(Ordering::Acquire) {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response()
    } else if !health.caches.is_synced() {
        let waiting = health.caches.watches.stale_now();
        let body = if waiting.is_empty() {
            "caches not synced".to_owned()
        } else {
            format!("caches not synced: {}", waiting.join("; "))
        };
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    } else {
        let stale = health.caches.watches.stale_serving().join("; ");
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("caches not current: {stale}"),
        )
            .into_response()
    }
}

async fn metrics(State(health): State<Arc<Health>>) -> Response {
    let (m, c) = (&health.metrics, &health.caches);
    m.cached_persistent_pod_states.set(c.pps.len() as i64);
    m.cached_pods.set(c.pods.read().len() as i64);
    m.cached_nodes.set(c.nodes.len() as i64);
    m.stale_watches.set(c.watches.stale_now().len() as i64);
    m.shadowed_persistent_pod_states
        .set(c.shadowed_pps() as i64);
    let kinds = c.workload_kinds();
    m.watched_workload_kinds.set(kinds.len() as i64);
    m.cached_workloads
        .set(kinds.iter().map(|(_, w)| w.store.len() as i64).sum());
    m.process.refresh();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        health.metrics.encode(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    /// Metric names and their label names, from the exposition of a scrape: each `# TYPE`
    /// line declares a family (counters are sampled as `NAME_total`), each sample carries labels.
    fn scraped(text: &str) -> BTreeMap<String, BTreeSet<String>> {
        let mut families = BTreeMap::new();
        for line in text.lines() {
            if let Some(decl) = line.strip_prefix("# TYPE ") {
                let (name, kind) = decl.split_once(' ').expect("name and type");
                let name = if kind == "counter" {
                    format!("{name}_total")
                } else {
                    name.to_owned()
                };
                families.insert(name, BTreeSet::new());
            }
        }
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, labels) = match line.split_once('{') {
                Some((name, rest)) => (name, rest.split_once('}').expect("closed").0),
                None => (line.split_once(' ').expect("value").0, ""),
            };
            let family = families
                .keys()
                .filter(|f| {
                    name == f.as_str()
                        || ["_bucket", "_sum", "_count", "_created"]
                            .iter()
                            .any(|s| name == format!("{f}{s}"))
                })
                .max_by_key(|f| f.len())
                .cloned()
                .unwrap_or_else(|| panic!("sample {name} belongs to no declared family"));
            let keys = families.get_mut(&family).expect("family");
            for pair in labels.split(',').filter(|p| !p.is_empty()) {
                let key = pair.split_once('=').expect("key=value").0;
                if key != "le" {
                    keys.insert(key.to_owned());
                }
            }
        }
        families
    }

    /// Metric names and label names from the table of docs/metrics.md: the first column lists
    /// names, the third the labels (value lists in parentheses are not label names).
    fn documented() -> BTreeMap<String, BTreeSet<String>> {
        let doc = include_str!("../docs/metrics.md");
        let backticked = |cell: &str| -> Vec<String> {
            let mut depth = 0;
            let mut out = Vec::new();
            let mut parts = cell.split('`');
            let mut outside = true;
            let mut current = parts.next().unwrap_or_default().to_owned();
            for part in parts {
                if outside {
                    depth +=
                        current.matches('(').count() as i32 - current.matches(')').count() as i32;
                    if depth == 0 {
                        out.push(part.to_owned());
                    }
                }
                outside = !outside;
                current = part.to_owned();
            }
            out
        };
        let mut families = BTreeMap::new();
        for row in doc.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let labels: BTreeSet<String> = backticked(cells[3]).into_iter().collect();
            for name in backticked(cells[1]) {
                families.insert(name, labels.clone());
            }
        }
        families
    }

    // Paused time: the handlers' 5 s bound never runs out on a host slowed by other tests.
    #[tokio::test(start_paused = true)]
    async fn scrapes_in_flight_never_take_the_probes_slots() {
        let limit = super::limit();
        let get = |path: &str| {
            axum::http::Request::get(path)
                .body(Body::empty())
                .expect("request")
        };
        let release = Arc::new(tokio::sync::Notify::new());
        let mut held = tokio::task::JoinSet::new();
        // Scrapes that do not finish, until the next one is refused.
        let refused = loop {
            let (limit, release, request) = (limit.clone(), release.clone(), get("/metrics"));
            let (taken, answered) = tokio::sync::oneshot::channel();
            held.spawn(async move {
                limit
                    .run(request, |_, _| async move {
                        let released = release.notified();
                        let _ = taken.send(());
                        released.await;
                        StatusCode::OK.into_response()
                    })
                    .await
                    .status()
            });
            // Either the handler runs (the scrape holds a slot) or it is refused at once (its
            // handler dropped unrun).
            if answered.await.is_err() {
                break held.join_next().await.expect("a task").expect("joined");
            }
            assert!(held.len() <= 16, "scrapes are never refused");
        };
        assert_eq!(refused, StatusCode::SERVICE_UNAVAILABLE);
        // The kubelet's probes are still answered.
        for path in ["/readyz", "/healthz"] {
            let status = limit
                .run(get(path), |_, _| async { StatusCode::OK.into_response() })
                .await
                .status();
            assert_eq!(
                status,
                StatusCode::OK,
                "{path} with the scrapes' share full"
            );
        }
        release.notify_waiters();
        while let Some(done) = held.join_next().await {
            assert_eq!(done.expect("joined"), StatusCode::OK);
        }
    }

    #[tokio::test]
    async fn docs_metrics_lists_exactly_the_names_and_labels_a_scrape_exposes() {
        // Every label set is exposed from the start: a fresh registry lists every metric.
        let metrics = Arc::new(Metrics::new());
        let health = Arc::new(Health {
            caches: Caches::new(),
            shutting_down: false.into(),
            metrics,
        });
        let response = router(health)
            .oneshot(
                axum::http::Request::get("/metrics")
                    .body(Body::empty())
                    .expect("request"),
            )
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::OK);
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        let text = String::from_utf8(bytes.to_vec()).expect("utf-8");
        assert_eq!(
            documented(),
            scraped(&text),
            "docs/metrics.md (left) and a scrape of /metrics (right) differ"
        );
    }
}
