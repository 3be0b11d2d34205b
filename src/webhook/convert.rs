//! `POST /convert`: the CRD conversion webhook between v1alpha1 and v1beta1. The conversion
//! itself is the pure [`crate::api::conversion::convert`].

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kube::core::conversion::{ConversionRequest, ConversionResponse, ConversionReview};
use kube::core::response::Status;

use super::WebhookState;
use super::review::error_response;
use crate::api::conversion::convert;
use crate::metrics::AdmissionResult;

/// The path this handler is mounted on.
pub const PATH: &str = "/convert";

/// Answers one ConversionReview. Conversion does not need the caches, so it is served from the
/// first moment (the API server needs it to read v1alpha1 objects at all).
pub async fn convert_objects(State(state): State<Arc<WebhookState>>, body: Bytes) -> Response {
    let start = Instant::now();
    let request = serde_json::from_slice::<ConversionReview>(&body)
        .map_err(|e| format!("request body is not a ConversionReview: {e}"))
        .and_then(|review| {
            ConversionRequest::from_review(review)
                .map_err(|_| "ConversionReview has no request".to_owned())
        });
    let request = match request {
        Ok(r) => r,
        Err(message) => {
            tracing::warn!(error = %message, "rejected a malformed conversion request");
            state
                .metrics
                .admission(PATH, AdmissionResult::BadRequest, start);
            return error_response(StatusCode::BAD_REQUEST, &message);
        }
    };
    let desired = request.desired_api_version.clone();
    let converted: Result<Vec<_>, String> = request
        .objects
        .iter()
        .cloned()
        .map(|o| convert(o, &desired))
        .collect();
    let response = ConversionResponse::for_request(request);
    let (response, result) = match converted {
        Ok(objects) => (response.success(objects), AdmissionResult::Allowed),
        Err(message) => {
            tracing::warn!(error = %message, desired = %desired, "conversion failed");
            (
                response.failure(Status::failure(&message, "Invalid")),
                AdmissionResult::InvalidObject,
            )
        }
    };
    state.metrics.admission(PATH, result, start);
    Json(response.into_review()).into_response()
}
