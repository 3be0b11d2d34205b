//! Reading AdmissionReviews robustly: a body that is not an AdmissionReview is a 400 with a
//! JSON message; a review that parses always gets an answer carrying its uid, whatever its
//! object holds (the object is split off and parsed separately by the handler).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use serde_json::{Value, json};
use std::time::Instant;

use super::WebhookState;
use crate::metrics::AdmissionResult;

/// A parsed admission request, with its objects kept as raw JSON.
pub struct ParsedReview {
    /// The request (its `object` and `oldObject` removed).
    pub request: AdmissionRequest<DynamicObject>,
    /// `request.object` as sent.
    pub object: Option<Value>,
    /// `request.oldObject` as sent.
    pub old_object: Option<Value>,
}

/// Why a body could not be read as an AdmissionReview (HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// Not JSON.
    #[error("request body is not JSON: {0}")]
    NotJson(serde_json::Error),
    /// JSON, but not an AdmissionReview.
    #[error("request body is not an AdmissionReview: {0}")]
    NotAReview(serde_json::Error),
    /// An AdmissionReview without a request.
    #[error("AdmissionReview has no request")]
    NoRequest,
}

impl IntoResponse for ReviewError {
    fn into_response(self) -> Response {
        error_response(StatusCode::BAD_REQUEST, &self.to_string())
    }
}

/// A JSON error body `{"error": message}` with `status`.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

fn take_object(review: &mut Value, field: &str) -> Option<Value> {
    let slot = review.get_mut("request")?.get_mut(field)?;
    Some(slot.take()).filter(|v| !v.is_null())
}

/// The common start of the admission handlers that answer from the caches: HTTP 503 before
/// the caches have synced (so the API server's failurePolicy decides, rather than a silent
/// "allowed"), HTTP 400 for a body that is not an AdmissionReview; both are counted.
pub fn read_review(
    state: &WebhookState,
    path: &'static str,
    start: Instant,
    body: &[u8],
) -> Result<ParsedReview, Rejection> {
    if !state.caches.is_synced() {
        state
            .metrics
            .admission(path, AdmissionResult::Unavailable, start);
        return Err(Rejection::NotSynced);
    }
    parse(body).map_err(|e| {
        tracing::warn!(error = %e, path, "rejected a malformed admission request");
        state
            .metrics
            .admission(path, AdmissionResult::BadRequest, start);
        Rejection::Malformed(e)
    })
}

/// A request answered without a review: caches not synced (503) or a bad body (400).
#[derive(Debug)]
pub enum Rejection {
    /// The caches have not synced yet.
    NotSynced,
    /// The body is not an AdmissionReview.
    Malformed(ReviewError),
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        match self {
            Self::NotSynced => {
                error_response(StatusCode::SERVICE_UNAVAILABLE, "caches are not synced yet")
            }
            Self::Malformed(e) => e.into_response(),
        }
    }
}

/// Parses a request body as an AdmissionReview.
pub fn parse(body: &[u8]) -> Result<ParsedReview, ReviewError> {
    let mut review: Value = serde_json::from_slice(body).map_err(ReviewError::NotJson)?;
    let object = take_object(&mut review, "object");
    let old_object = take_object(&mut review, "oldObject");
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_value(review).map_err(ReviewError::NotAReview)?;
    let request = review.try_into().map_err(|_| ReviewError::NoRequest)?;
    Ok(ParsedReview {
        request,
        object,
        old_object,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(object: Value) -> Value {
        json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "operation": "CREATE", "userInfo": {}, "namespace": "ns", "name": "web-0",
                "object": object
            }
        })
    }

    #[test]
    fn splits_off_any_object_and_keeps_the_uid() {
        for object in [
            json!({"metadata": {"name": "a"}}),
            json!(5),
            json!("x"),
            json!({"spec": []}),
        ] {
            let body = serde_json::to_vec(&review(object.clone())).expect("json");
            let parsed = parse(&body).expect("parses");
            assert_eq!(parsed.request.uid, "u-1");
            assert_eq!(parsed.object, Some(object));
            assert!(parsed.old_object.is_none());
        }
    }

    #[test]
    fn bad_bodies_are_errors() {
        let cases: [&[u8]; 5] = [
            b"",
            b"not json",
            b"[]",
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":5}}"#,
        ];
        for body in cases {
            assert!(parse(body).is_err(), "{}", String::from_utf8_lossy(body));
        }
    }
}
