//! `POST /convert`: the CRD conversion webhook between v1alpha1 and v1beta1. The conversion
//! itself is the pure [`crate::api::conversion::convert`], on each object's JSON text.

use axum::response::Response;

use super::review::{Conversion, conversion_response};
use super::{WebhookState, endpoints};
use crate::api::conversion::convert;
use crate::metrics::AdmissionResult;

/// Keys whose values conversion never decodes (it copies them as text): each counts as one
/// value of what a conversion request may build ([`crate::serving::json_values_pruned`]), so
/// that converting an object that records thousands of pods costs what its spec does.
pub const UNREAD_KEYS: [&str; 2] = ["metadata", "status"];

/// Answers one ConversionReview. Conversion does not need the caches, so it is served from the
/// first moment (the API server needs it to read v1alpha1 objects at all).
pub fn convert_objects(state: &WebhookState, conversion: Conversion) -> Response {
    let Conversion {
        request,
        received: start,
    } = conversion;
    let shown: String = request.desired_api_version.chars().take(64).collect();
    let span = tracing::info_span!("conversion", uid = %request.uid, desired = %shown);
    let _entered = span.enter();
    let desired = &request.desired_api_version;
    let objects = match request.too_complex {
        Some(t) => Err(t.message()),
        None if desired.is_empty() => Err("the request has no desiredAPIVersion".into()),
        None => request.objects(),
    };
    let converted: Result<Vec<_>, String> =
        objects.and_then(|objects| objects.into_iter().map(|o| convert(o, desired)).collect());
    let result = match &converted {
        Ok(_) => AdmissionResult::Allowed,
        Err(message) => {
            tracing::warn!(error = %message, "conversion failed");
            AdmissionResult::InvalidObject
        }
    };
    state.metrics.admission(endpoints::CONVERT, result, start);
    conversion_response(&request.uid, converted)
}
