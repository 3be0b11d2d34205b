//! `POST /convert`: the CRD conversion webhook between v1alpha1 and v1beta1. The conversion
//! itself is the pure [`crate::api::conversion::convert`].

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use kube::core::conversion::ConversionResponse;
use kube::core::response::Status;

use super::WebhookState;
use super::review::Conversion;
use crate::api::conversion::convert;
use crate::metrics::AdmissionResult;

/// The path this handler is mounted on.
pub const PATH: &str = "/convert";

/// Answers one ConversionReview. Conversion does not need the caches, so it is served from the
/// first moment (the API server needs it to read v1alpha1 objects at all).
pub async fn convert_objects(
    State(state): State<Arc<WebhookState>>,
    conversion: Conversion,
) -> Response {
    let Conversion {
        request,
        received: start,
    } = conversion;
    let span = tracing::info_span!("conversion", uid = %request.uid, desired = %request.desired_api_version);
    let _entered = span.enter();
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
            tracing::warn!(error = %message, "conversion failed");
            (
                response.failure(Status::failure(&message, "Invalid")),
                AdmissionResult::InvalidObject,
            )
        }
    };
    state.metrics.admission(PATH, result, start);
    Json(response.into_review()).into_response()
}
