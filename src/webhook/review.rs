//! Reading review bodies robustly, as axum extractors: a body that is not a review is answered
//! with a 4xx and a JSON message (and counted) before any handler runs; an AdmissionReview
//! that parses always gets an answer carrying its uid, whatever its object holds (the object is
//! split off and read by the handler).

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use kube::core::conversion::{ConversionRequest, ConversionReview};
use serde_json::{Value, json};

use super::{WebhookState, endpoint};
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

/// Why a body could not be read as a review (HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// Not JSON.
    #[error("request body is not JSON: {0}")]
    NotJson(serde_json::Error),
    /// JSON, but not a review of the expected kind.
    #[error("request body is not {kind}: {error}")]
    NotAReview {
        /// The kind of review expected.
        kind: &'static str,
        /// What did not fit.
        error: serde_json::Error,
    },
    /// A review without a request.
    #[error("{0} has no request")]
    NoRequest(&'static str),
}

/// A JSON error body `{"error": message}` with `status`.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

fn take_object(review: &mut Value, field: &str) -> Option<Value> {
    let slot = review.get_mut("request")?.get_mut(field)?;
    Some(slot.take()).filter(|v| !v.is_null())
}

/// Parses a request body as an AdmissionReview.
pub fn parse(body: &[u8]) -> Result<ParsedReview, ReviewError> {
    let mut review: Value = serde_json::from_slice(body).map_err(ReviewError::NotJson)?;
    let object = take_object(&mut review, "object");
    let old_object = take_object(&mut review, "oldObject");
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_value(review).map_err(|error| ReviewError::NotAReview {
            kind: "an AdmissionReview",
            error,
        })?;
    let request = review
        .try_into()
        .map_err(|_| ReviewError::NoRequest("AdmissionReview"))?;
    Ok(ParsedReview {
        request,
        object,
        old_object,
    })
}

/// Parses a request body as a ConversionReview.
pub fn parse_conversion(body: &[u8]) -> Result<ConversionRequest, ReviewError> {
    let review: ConversionReview = serde_json::from_slice(body).map_err(|error| {
        if error.is_data() {
            ReviewError::NotAReview {
                kind: "a ConversionReview",
                error,
            }
        } else {
            ReviewError::NotJson(error)
        }
    })?;
    ConversionRequest::from_review(review).map_err(|_| ReviewError::NoRequest("ConversionReview"))
}

/// Reads the body (within the router's body limit); a body that cannot be read is answered
/// with its status (413 when too large) and a JSON message.
async fn body(req: Request, state: &Arc<WebhookState>) -> Result<(Bytes, &'static str), Response> {
    let path = endpoint(req.uri().path());
    let start = Instant::now();
    Bytes::from_request(req, state)
        .await
        .map(|b| (b, path))
        .map_err(|rejection| {
            state
                .metrics
                .admission(path, AdmissionResult::BadRequest, start);
            error_response(rejection.status(), &rejection.body_text())
        })
}

fn bad_request(
    state: &WebhookState,
    path: &'static str,
    start: Instant,
    e: &ReviewError,
) -> Response {
    tracing::warn!(error = %e, path, "rejected a malformed review");
    state
        .metrics
        .admission(path, AdmissionResult::BadRequest, start);
    error_response(StatusCode::BAD_REQUEST, &e.to_string())
}

/// Extracts a parsed AdmissionReview, or answers a JSON 4xx.
pub struct Review {
    /// The parsed review.
    pub parsed: ParsedReview,
    /// When the request arrived (for the latency metric).
    pub received: Instant,
}

impl FromRequest<Arc<WebhookState>> for Review {
    type Rejection = Response;

    async fn from_request(req: Request, state: &Arc<WebhookState>) -> Result<Self, Response> {
        let received = Instant::now();
        let (bytes, path) = body(req, state).await?;
        match parse(&bytes) {
            Ok(parsed) => Ok(Self { parsed, received }),
            Err(e) => Err(bad_request(state, path, received, &e)),
        }
    }
}

/// Extracts a parsed ConversionReview, or answers a JSON 4xx.
pub struct Conversion {
    /// The parsed request.
    pub request: ConversionRequest,
    /// When the request arrived (for the latency metric).
    pub received: Instant,
}

impl FromRequest<Arc<WebhookState>> for Conversion {
    type Rejection = Response;

    async fn from_request(req: Request, state: &Arc<WebhookState>) -> Result<Self, Response> {
        let received = Instant::now();
        let (bytes, path) = body(req, state).await?;
        match parse_conversion(&bytes) {
            Ok(request) => Ok(Self { request, received }),
            Err(e) => Err(bad_request(state, path, received, &e)),
        }
    }
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
        assert!(parse_conversion(b"{").is_err());
        assert!(
            parse_conversion(
                br#"{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview"}"#
            )
            .is_err()
        );
    }
}
