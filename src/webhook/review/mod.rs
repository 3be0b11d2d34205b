//! Reading and answering review bodies, robustly and in one pass.
//!
//! A review is parsed once, straight from the request bytes: the request's small fields are
//! read leniently (a missing, null or ill-typed field reads as absent), and its `object` and
//! `oldObject` are kept as borrowed raw JSON, decoded later by the handler into exactly the type
//! it needs. So a review costs one copy of its object, and once its `uid` can be read every
//! answer carries it, whatever else the request holds. A body that is not a review, or whose
//! uid cannot be read, is answered with a 4xx and a JSON message (413 when too large).
//!
//! Answers are written here too: the AdmissionReview response with its patch base64-encoded (as
//! the API documents), and the ConversionReview response.

use std::marker::PhantomData;
use std::time::Instant;

use crate::serving::{TooComplex, error_response};
use axum::body::Bytes;
use axum::http::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};

mod compact;

use super::patch::PodPatch;
use super::{WebhookState, endpoints};
use crate::api::conversion::Converted;
use crate::api::json_error_summary;
use crate::metrics::AdmissionResult;
use crate::workload::{PodView, SpecView};
use k8s_openapi::api::core::v1::{NodeAffinity, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use std::collections::BTreeMap;

/// The AdmissionReview versions answered (the request's is echoed).
const ADMISSION_VERSIONS: [&str; 2] = ["admission.k8s.io/v1", "admission.k8s.io/v1beta1"];

/// Reads a field leniently: a value of another JSON type than `T` takes reads as absent, and is
/// skipped without being built (a tree of any size where a string belongs is walked once).
fn lenient<'de, D: Deserializer<'de>, T: Lenient>(d: D) -> Result<Option<T>, D::Error> {
    Loose::<T>::deserialize(d).map(|loose| loose.0)
}

/// A value that reads leniently ([`lenient`]): from the JSON types it takes, and as absent
/// from any other.
trait Lenient: Sized {
    /// From a JSON string.
    fn from_text(_: &str) -> Option<Self> {
        None
    }
    /// From a JSON boolean.
    fn from_bool(_: bool) -> Option<Self> {
        None
    }
    /// From a JSON object (skipped by default).
    fn from_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<Option<Self>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(None)
    }
}

impl Lenient for String {
    fn from_text(text: &str) -> Option<Self> {
        Some(text.to_owned())
    }
}

impl Lenient for bool {
    fn from_bool(value: bool) -> Option<Self> {
        Some(value)
    }
}

/// `T` read leniently: absent when the JSON value is not of a type `T` takes.
struct Loose<T>(Option<T>);

impl<'de, T: Lenient> Deserialize<'de> for Loose<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Any<T>(PhantomData<T>);
        impl<'de, T: Lenient> Visitor<'de> for Any<T> {
            type Value = Option<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(T::from_text(v))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
                Ok(T::from_bool(v))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(None)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                T::from_map(map)
            }
        }
        d.deserialize_any(Any(PhantomData)).map(Loose)
    }
}

/// A group, version and kind, as a review names them (each part lenient).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gvk {
    /// API group (empty for core).
    pub group: Option<String>,
    /// Version.
    pub version: Option<String>,
    /// Kind.
    pub kind: Option<String>,
}

impl Lenient for Gvk {
    /// Each part leniently; other fields skipped; a repeated field's last value is kept (as the
    /// API server's own JSON reader does).
    fn from_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<Option<Self>, A::Error> {
        #[derive(Deserialize)]
        #[serde(field_identifier, rename_all = "lowercase")]
        enum Field {
            Group,
            Version,
            Kind,
            #[serde(other)]
            Other,
        }
        let mut gvk = Gvk::default();
        while let Some(field) = map.next_key::<Field>()? {
            let part = match field {
                Field::Group => &mut gvk.group,
                Field::Version => &mut gvk.version,
                Field::Kind => &mut gvk.kind,
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            *part = map.next_value::<Loose<String>>()?.0;
        }
        Ok(Some(gvk))
    }
}

impl Gvk {
    /// Whether this is `group`/`kind`.
    pub fn is(&self, group: &str, kind: &str) -> bool {
        self.group.as_deref().unwrap_or_default() == group && self.kind.as_deref() == Some(kind)
    }
}

/// A request as read: the object as `O` (raw, or decoded in the same pass).
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase", bound(deserialize = "O: Deserialize<'de>"))]
struct RawRequest<'a, O> {
    #[serde(default, deserialize_with = "lenient")]
    uid: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    kind: Option<Gvk>,
    #[serde(default, deserialize_with = "lenient")]
    sub_resource: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    name: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    namespace: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    operation: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    dry_run: Option<bool>,
    #[serde(default)]
    object: Option<O>,
    #[serde(default, borrow)]
    old_object: Option<&'a RawValue>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase", bound(deserialize = "O: Deserialize<'de>"))]
struct RawReview<'a, O> {
    #[serde(default, deserialize_with = "lenient")]
    api_version: Option<String>,
    #[serde(default, borrow)]
    request: Option<RawRequest<'a, O>>,
}

/// An admission request: what the handlers read of it. The request body is kept, and the
/// object and old object are ranges of it, so nothing is copied before a handler decodes them.
#[derive(Clone, Debug, Default)]
pub struct AdmissionRequest {
    /// The review version to answer with.
    pub api_version: &'static str,
    /// The request uid, echoed in every answer.
    pub uid: String,
    /// The kind of the object.
    pub kind: Gvk,
    /// The subresource, if any.
    pub sub_resource: Option<String>,
    /// The object's name (may be empty for `generateName`).
    pub name: String,
    /// The object's namespace.
    pub namespace: Option<String>,
    /// `CREATE`, `UPDATE`, `DELETE`, `CONNECT`, or whatever else was sent.
    pub operation: String,
    /// Whether this is a dry run (no side effects).
    pub dry_run: bool,
    /// Set when the body holds more than its endpoint decodes ([`TooComplex`]): the object is
    /// not decoded, and the answer says why.
    pub too_complex: Option<TooComplex>,
    body: Bytes,
    object: Option<std::ops::Range<usize>>,
    old_object: Option<std::ops::Range<usize>>,
    /// The object, when it was decoded as a pod in the review's own pass ([`parse_pod`]).
    pod: Option<ReadPod>,
}

impl AdmissionRequest {
    fn slice(&self, range: Option<&std::ops::Range<usize>>) -> Option<&str> {
        // The ranges are those of JSON values of the body, which parsed as UTF-8 JSON.
        std::str::from_utf8(self.body.get(range?.clone())?).ok()
    }

    /// The object as sent (absent when missing or null), as JSON text.
    pub fn object(&self) -> Option<&str> {
        self.slice(self.object.as_ref())
    }

    /// The object decoded as a pod in the review's pass ([`parse_pod`]); otherwise absent, and
    /// [`Self::object`] holds it raw.
    pub fn pod(&self) -> Option<&ReadPod> {
        self.pod.as_ref()
    }

    /// The old object as sent (absent when missing or null), as JSON text.
    pub fn old_object(&self) -> Option<&str> {
        self.slice(self.old_object.as_ref())
    }
}

/// The metadata the decision reads.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReadMeta {
    name: Option<String>,
    namespace: Option<String>,
    annotations: Option<BTreeMap<String, String>>,
    owner_references: Option<Vec<OwnerReference>>,
}

/// The affinity the decision reads: node affinity (the rest is only noticed as present).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReadAffinity {
    node_affinity: Option<NodeAffinity>,
}

/// The spec fields the decision reads: what the pod demands of a node.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReadSpec {
    node_selector: Option<BTreeMap<String, String>>,
    affinity: Option<ReadAffinity>,
    tolerations: Option<Vec<Toleration>>,
    node_name: Option<String>,
}

/// What the decision reads of a pod, as decoded ([`decode_pod`], or in the review's own pass):
/// the fields of a [`PodView`], owned, and nothing else (no `Pod` is built).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ReadPod {
    metadata: Option<ReadMeta>,
    spec: Option<ReadSpec>,
}

impl ReadPod {
    /// The decision's view of the pod read.
    pub fn view(&self) -> PodView<'_> {
        let meta = self.metadata.as_ref();
        PodView {
            name: meta.and_then(|m| m.name.as_deref()),
            namespace: meta.and_then(|m| m.namespace.as_deref()),
            annotations: meta.and_then(|m| m.annotations.as_ref()),
            owner_references: meta
                .and_then(|m| m.owner_references.as_deref())
                .unwrap_or_default(),
            spec: self.spec.as_ref().map(|s| SpecView {
                node_selector: s.node_selector.as_ref(),
                has_affinity: s.affinity.is_some(),
                node_affinity: s.affinity.as_ref().and_then(|a| a.node_affinity.as_ref()),
                tolerations: s.tolerations.as_deref().unwrap_or_default(),
                node_name: s.node_name.as_deref(),
            }),
        }
    }
}

/// Decodes of a pod only what the decision reads (metadata naming it and its owner, its
/// annotations, and its node selector, node affinity and tolerations), skipping the rest of
/// the object (containers, volumes, managed fields) without building it: the decode is most of
/// an admission's cost. The patch only adds to what the pod has, so nothing skipped is lost.
pub fn decode_pod(object: &str) -> Result<ReadPod, serde_json::Error> {
    serde_json::from_str::<ReadPod>(object)
}

/// Why a body could not be read as a review (HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// Not JSON, or not JSON of the review's shape.
    #[error("request body is not {kind}: {error}")]
    NotAReview {
        /// The kind of review expected.
        kind: &'static str,
        /// What did not fit.
        error: serde_json::Error,
        /// The review's version and uid, when they read alone ([`uid_alone`]): the answer
        /// carries them.
        alone: Option<(Option<String>, String)>,
    },
    /// A review without a request.
    #[error("{0} has no request")]
    NoRequest(&'static str),
    /// A request without a readable uid: no answer could carry it.
    #[error("{0} request has no uid (a string of 1 to 1024 bytes)")]
    NoUid(&'static str),
}

/// Longest uid read as one (the API server's are UUIDs, 36 bytes): a longer one would be copied
/// into the answer and every log line about the request, so the request is refused (HTTP 400)
/// as one without a uid.
const MAX_UID: usize = 1024;

/// The request's uid, if it reads as one ([`MAX_UID`]).
fn uid_of(uid: Option<String>) -> Option<String> {
    uid.filter(|u| !u.is_empty() && u.len() <= MAX_UID)
}

impl ReviewError {
    /// The error without anything the client sent (serde's messages quote input values): for
    /// logs, where a tenant's strings must not appear.
    pub fn log_summary(&self) -> String {
        match self {
            Self::NotAReview { kind, error, .. } => {
                format!("request body is not {kind}: {}", json_error_summary(error))
            }
            other => other.to_string(),
        }
    }
}

/// The range of a present (not null) raw value within `body`.
fn range_in(body: &[u8], raw: Option<&RawValue>) -> Option<std::ops::Range<usize>> {
    let text = raw?.get();
    if text.trim() == "null" {
        return None;
    }
    let start = (text.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let range = start..start + text.len();
    (range.end <= body.len()).then_some(range)
}

/// Reads `body` as JSON: as text once it is checked to be UTF-8 in one go (each string is
/// then not checked again as it is read); a body that is not UTF-8 as bytes, as before (serde
/// checks the strings it reads, and says where one is not UTF-8).
fn from_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> serde_json::Result<T> {
    match std::str::from_utf8(body) {
        Ok(text) => serde_json::from_str(text),
        Err(_) => serde_json::from_slice(body),
    }
}

/// The uid (and review version) of a body not read as a review, read alone with every other
/// field skipped, as far as the body reads: a body the API server would never send (a field
/// repeated, a number out of range where a field is read, garbage after the review, a body cut
/// short after the uid) still gets an answer carrying its uid. `None` when even that does not
/// read (not JSON, no request, its uid missing, given twice or not a string). Keys are read as
/// bytes and `apiVersion` raw, so a key or a version that does not decode (a lone surrogate, a
/// number out of range; not bytes that are not UTF-8) before the uid does not hide it.
fn uid_alone(body: &[u8]) -> Option<(Option<String>, String)> {
    let mut alone = Alone::default();
    // What was read before an error still counts.
    let _ = serde::de::DeserializeSeed::deserialize(
        ReviewSeed(&mut alone),
        &mut serde_json::Deserializer::from_slice(body),
    );
    if alone.ambiguous {
        return None;
    }
    let uid = uid_of(alone.uid.flatten())?;
    Some((alone.api_version.flatten(), uid))
}

/// What [`uid_alone`] has read so far: the first `apiVersion`, and the request's uid.
#[derive(Default)]
struct Alone {
    api_version: Option<Option<String>>,
    /// Whether a `request` was read (or begun).
    request: bool,
    uid: Option<Option<String>>,
    /// A second `request`, or a second uid in it: which uid is meant is not known.
    ambiguous: bool,
}

/// Reads a review's top-level object into an [`Alone`], field by field.
struct ReviewSeed<'a>(&'a mut Alone);

/// Reads a review's `request` object into an [`Alone`], field by field.
struct RequestSeed<'a>(&'a mut Alone);

impl<'de> serde::de::DeserializeSeed<'de> for ReviewSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ReviewSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a review object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(KeyBytes(key)) = map.next_key()? {
            match key.as_slice() {
                b"apiVersion" if self.0.api_version.is_none() => {
                    let raw = map.next_value::<&RawValue>()?;
                    let version = serde_json::from_str::<Loose<String>>(raw.get()).ok();
                    self.0.api_version = Some(version.and_then(|v| v.0));
                }
                b"request" if self.0.request => {
                    self.0.ambiguous = true;
                    map.next_value::<IgnoredAny>()?;
                }
                b"request" => {
                    self.0.request = true;
                    map.next_value_seed(RequestSeed(&mut *self.0))?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// An object's key as bytes, its escapes decoded (a lone surrogate, which a `String` refuses,
/// taken as WTF-8): matched against the few keys [`uid_alone`] reads.
struct KeyBytes(Vec<u8>);

impl<'de> Deserialize<'de> for KeyBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Bytes;
        impl Visitor<'_> for Bytes {
            type Value = KeyBytes;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object key")
            }
            fn visit_bytes<E>(self, v: &[u8]) -> Result<KeyBytes, E> {
                Ok(KeyBytes(v.to_vec()))
            }
            fn visit_str<E>(self, v: &str) -> Result<KeyBytes, E> {
                Ok(KeyBytes(v.as_bytes().to_vec()))
            }
        }
        d.deserialize_bytes(Bytes)
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for RequestSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for RequestSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a request object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(KeyBytes(key)) = map.next_key()? {
            if key == b"uid" {
                if self.0.uid.is_some() {
                    self.0.ambiguous = true;
                }
                self.0.uid = Some(map.next_value::<Loose<String>>()?.0);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// Parses a request body as an AdmissionReview, in one pass.
pub fn parse(body: Bytes) -> Result<AdmissionRequest, ReviewError> {
    let review: RawReview<'_, &RawValue> =
        from_body(&body).map_err(|error| ReviewError::NotAReview {
            kind: KIND,
            error,
            alone: uid_alone(&body),
        })?;
    let (request, api_version) = checked(review)?;
    let object = range_in(&body, request.object);
    let old_object = range_in(&body, request.old_object);
    Ok(AdmissionRequest {
        object,
        old_object,
        ..request_of(request, api_version, body.clone())?
    })
}

/// Parses a pod review in one pass, its object decoded straight into what the decision reads
/// (never kept raw and read twice): by the compact reader ([`compact`]), or, for a body it gives
/// up on, by the derived readers. A review whose object does not decode so is parsed by
/// [`parse`] instead (the handler then says why the object is not a pod).
pub fn parse_pod(body: Bytes) -> Result<AdmissionRequest, ReviewError> {
    let compact = std::str::from_utf8(&body).ok().and_then(compact::read);
    let Some(review) = compact.or_else(|| derived_pod_review(&body)) else {
        return parse(body);
    };
    let (mut request, api_version) = checked(review)?;
    let pod = request.object.take();
    let old_object = range_in(&body, request.old_object);
    Ok(AdmissionRequest {
        old_object,
        pod,
        ..request_of(request, api_version, body.clone())?
    })
}

/// A pod review as the derived readers read it (the compact reader gave up on it: rare, so
/// kept out of the way of the usual path's code).
#[cold]
#[inline(never)]
fn derived_pod_review(body: &[u8]) -> Option<RawReview<'_, ReadPod>> {
    from_body(body).ok()
}

const KIND: &str = "an AdmissionReview";

/// The request of a review, and the version to answer with; an error without a request or uid.
fn checked<O>(review: RawReview<'_, O>) -> Result<(RawRequest<'_, O>, &'static str), ReviewError> {
    let request = review
        .request
        .ok_or(ReviewError::NoRequest("AdmissionReview"))?;
    let api_version = ADMISSION_VERSIONS
        .into_iter()
        .find(|v| review.api_version.as_deref() == Some(*v))
        .unwrap_or(ADMISSION_VERSIONS[0]);
    Ok((request, api_version))
}

/// The request's fields (no object), keeping `body`.
fn request_of<O>(
    request: RawRequest<'_, O>,
    api_version: &'static str,
    body: Bytes,
) -> Result<AdmissionRequest, ReviewError> {
    let uid = uid_of(request.uid).ok_or(ReviewError::NoUid("AdmissionReview"))?;
    Ok(AdmissionRequest {
        api_version,
        uid,
        kind: request.kind.unwrap_or_default(),
        sub_resource: request.sub_resource.filter(|s| !s.is_empty()),
        name: request.name.unwrap_or_default(),
        namespace: request.namespace.filter(|s| !s.is_empty()),
        operation: request.operation.unwrap_or_default(),
        dry_run: request.dry_run.unwrap_or(false),
        too_complex: None,
        body,
        object: None,
        old_object: None,
        pod: None,
    })
}

/// The answer to an AdmissionReview.
#[derive(Debug)]
pub struct Admission {
    /// Whether the request is allowed.
    pub allowed: bool,
    /// For a denial: HTTP-like code, reason and message.
    pub denial: Option<(u16, &'static str, String)>,
    /// A JSON patch to apply (serialized), for a mutation.
    pub patch: Option<Vec<u8>>,
}

impl Admission {
    /// Allowed as is.
    pub fn allow() -> Self {
        Self {
            allowed: true,
            denial: None,
            patch: None,
        }
    }

    /// Allowed with `patch` (left out when it holds no operation).
    pub fn patch(patch: &PodPatch) -> Self {
        Self {
            patch: (!patch.is_empty()).then(|| patch.to_bytes()),
            ..Self::allow()
        }
    }

    /// Denied with `code`, `reason` and `message`.
    pub fn deny(code: u16, reason: &'static str, message: String) -> Self {
        Self {
            allowed: false,
            denial: Some((code, reason, message)),
            patch: None,
        }
    }

    /// The AdmissionReview response for `request`, as JSON. Written as text around the one
    /// field that needs escaping (the uid) and the rare denial, with the patch base64-encoded
    /// straight into it: no string of the encoded patch is built and then scanned for escapes.
    pub fn into_response(self, request: &AdmissionRequest) -> Response {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Status<'a> {
            status: &'a str,
            code: u16,
            reason: &'a str,
            message: &'a str,
        }
        // The fields around the patch take under 256 bytes but a denial's message.
        let size = 256
            + self
                .patch
                .as_ref()
                .map_or(0, |p| p.len().saturating_mul(4) / 3)
            + self.denial.as_ref().map_or(0, |(_, _, m)| m.len());
        let mut out = Vec::with_capacity(size);
        out.extend_from_slice(b"{\"apiVersion\":\"");
        out.extend_from_slice(request.api_version.as_bytes());
        out.extend_from_slice(b"\",\"kind\":\"AdmissionReview\",\"response\":{\"uid\":");
        let written = serde_json::to_writer(&mut out, &request.uid).and_then(|()| {
            out.extend_from_slice(if self.allowed {
                b",\"allowed\":true"
            } else {
                b",\"allowed\":false"
            });
            if let Some((code, reason, message)) = &self.denial {
                out.extend_from_slice(b",\"status\":");
                serde_json::to_writer(
                    &mut out,
                    &Status {
                        status: "Failure",
                        code: *code,
                        reason,
                        message,
                    },
                )?;
            }
            Ok(())
        });
        if let Err(e) = written {
            return error_response(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string());
        }
        if let Some(patch) = &self.patch {
            out.extend_from_slice(b",\"patchType\":\"JSONPatch\",\"patch\":\"");
            let start = out.len();
            let end = base64::encoded_len(patch.len(), true).and_then(|n| start.checked_add(n));
            let Some(end) = end else {
                return error_response(StatusCode::INTERNAL_SERVER_ERROR, "the patch is too large");
            };
            out.resize(end, 0);
            // `encoded_len` (padded) is the length this encoder writes, so it fits exactly.
            let _ = base64_simd::STANDARD
                .encode(patch, base64_simd::Out::from_slice(&mut out[start..]));
            out.push(b'"');
        }
        out.extend_from_slice(b"}}");
        json_bytes(StatusCode::OK, out)
    }
}

/// `bytes` as a JSON response, built directly (one header set, the body taken as it is).
fn json_bytes(status: StatusCode, bytes: Vec<u8>) -> Response {
    let mut response = Response::new(axum::body::Body::from(bytes));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, JSON);
    response
}

/// The answers' content type (static: not copied per answer).
const JSON: HeaderValue = HeaderValue::from_static("application/json");

/// `body` as a JSON response; `size` is the room to start with (the body's usual length).
fn json_response(status: StatusCode, body: &impl Serialize, size: usize) -> Response {
    let mut bytes = Vec::with_capacity(size);
    match serde_json::to_writer(&mut bytes, body) {
        Ok(()) => json_bytes(status, bytes),
        Err(e) => error_response(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

/// A conversion request: what the conversion handler reads of it. The objects stay raw text,
/// split into objects by [`ConversionRequest::objects`].
#[derive(Debug)]
pub struct ConversionRequest {
    /// The request uid, echoed in every answer.
    pub uid: String,
    /// The version to convert to (empty when missing: the answer is a failure).
    pub desired_api_version: String,
    /// Set when the body holds more than conversions decode ([`TooComplex`]).
    pub too_complex: Option<TooComplex>,
    body: Bytes,
    objects: Option<std::ops::Range<usize>>,
}

impl ConversionRequest {
    /// The objects to convert, each as its JSON text (none when `objects` is missing or null),
    /// or why they cannot be told apart (not an array): never fewer objects than were sent.
    pub fn objects(&self) -> Result<Vec<&RawValue>, String> {
        let Some(bytes) = self.objects.clone().and_then(|r| self.body.get(r)) else {
            return Ok(Vec::new());
        };
        serde_json::from_slice(bytes).map_err(|e| {
            format!(
                "the request's objects are not an array of readable objects: {}",
                json_error_summary(&e)
            )
        })
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawConversionRequest<'a> {
    #[serde(default, deserialize_with = "lenient")]
    uid: Option<String>,
    #[serde(default, rename = "desiredAPIVersion", deserialize_with = "lenient")]
    desired_api_version: Option<String>,
    #[serde(default, borrow)]
    objects: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct RawConversionReview<'a> {
    #[serde(default, borrow)]
    request: Option<RawConversionRequest<'a>>,
}

/// Parses a request body as a ConversionReview (its objects kept raw).
pub fn parse_conversion(body: Bytes) -> Result<ConversionRequest, ReviewError> {
    let review: RawConversionReview<'_> =
        from_body(&body).map_err(|error| ReviewError::NotAReview {
            kind: "a ConversionReview",
            error,
            alone: uid_alone(&body),
        })?;
    let request = review
        .request
        .ok_or(ReviewError::NoRequest("ConversionReview"))?;
    let uid = uid_of(request.uid).ok_or(ReviewError::NoUid("ConversionReview"))?;
    let objects = range_in(&body, request.objects);
    Ok(ConversionRequest {
        uid,
        desired_api_version: request.desired_api_version.unwrap_or_default(),
        too_complex: None,
        objects,
        body,
    })
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ConversionReviewAnswer<'a> {
    api_version: &'static str,
    kind: &'static str,
    response: ConversionResponse<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ConversionResponse<'a> {
    uid: &'a str,
    result: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    converted_objects: Option<Vec<Converted<'a>>>,
}

/// Counts the bytes written to it.
struct Counted(usize);

impl std::io::Write for Counted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The ConversionReview response: the converted objects (each value copied once from the
/// request, straight into the answer), or a failure with a message. The answer is measured
/// before it is written, so its buffer is exactly as long as it (the share counts its length).
pub fn conversion_response<'a>(
    uid: &'a str,
    result: Result<Vec<Converted<'a>>, String>,
) -> Response {
    let (result, converted_objects) = match result {
        Ok(objects) => (json!({"status": "Success"}), Some(objects)),
        Err(message) => (json!({"status": "Failure", "message": message}), None),
    };
    let answer = ConversionReviewAnswer {
        api_version: "apiextensions.k8s.io/v1",
        kind: "ConversionReview",
        response: ConversionResponse {
            uid,
            result,
            converted_objects,
        },
    };
    let mut counted = Counted(0);
    let size = serde_json::to_writer(&mut counted, &answer).map_or(0, |()| counted.0);
    json_response(StatusCode::OK, &answer, size)
}

/// The 415 answer (counted) to a request that does not say its body is JSON.
fn not_json(
    request: &Request<Bytes>,
    state: &WebhookState,
    path: &'static str,
    received: Instant,
) -> Option<Response> {
    // The API server sends exactly `application/json`: compared as bytes first, and only
    // otherwise read for parameters and spaces.
    let json = request
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| {
            v.as_bytes().eq_ignore_ascii_case(b"application/json")
                || v.to_str()
                    .ok()
                    .and_then(|v| v.split(';').next())
                    .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
        });
    if json {
        return None;
    }
    state
        .metrics
        .admission(path, AdmissionResult::BadRequest, received);
    Some(error_response(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "reviews are sent as Content-Type: application/json",
    ))
}

/// Logs and counts a review rejected as malformed (its uid, when read alone).
fn rejected(
    state: &WebhookState,
    path: &'static str,
    start: Instant,
    e: &ReviewError,
    uid: Option<&str>,
) {
    tracing::warn!(error = %e.log_summary(), path, uid, "rejected a malformed review");
    state
        .metrics
        .admission(path, AdmissionResult::BadRequest, start);
}

fn bad_request(
    state: &WebhookState,
    path: &'static str,
    start: Instant,
    e: &ReviewError,
) -> Response {
    rejected(state, path, start, e, None);
    error_response(StatusCode::BAD_REQUEST, &e.to_string())
}

/// A parsed AdmissionReview (its uid readable), and when it arrived.
pub struct Review {
    /// The parsed request.
    pub request: AdmissionRequest,
    /// When the request arrived (for the latency metric).
    pub received: Instant,
}

impl Review {
    /// Reads `request` (its body whole, within the serving limits) as an AdmissionReview, or
    /// gives the JSON 4xx answering it (boxed: the rare path). First, a request the caches may
    /// not answer yet, or from a client without the required certificate, is answered 503 or
    /// 403 without its body being read as a review ([`super::refusal`]). A pod review's object
    /// is decoded in the same pass, unless it is `too_complex` (then it is kept raw, and
    /// answered without being decoded).
    pub fn read(
        request: Request<Bytes>,
        too_complex: Option<TooComplex>,
        state: &WebhookState,
    ) -> Result<Self, Box<Response>> {
        if let Some(refused) = super::refusal(state, &request) {
            return Err(Box::new(refused));
        }
        let received = Instant::now();
        let path = endpoints::label(request.uri().path());
        if let Some(refused) = not_json(&request, state, path, received) {
            return Err(Box::new(refused));
        }
        let body = request.into_body();
        let parsed = if path == endpoints::MUTATE_POD && too_complex.is_none() {
            parse_pod(body)
        } else {
            parse(body)
        };
        match parsed {
            Ok(mut request) => {
                request.too_complex = too_complex;
                Ok(Self { request, received })
            }
            Err(e) => Err(Box::new(match &e {
                ReviewError::NotAReview {
                    alone: Some((version, uid)),
                    ..
                } => unreadable_review(state, path, received, &e, version.as_deref(), uid),
                _ => bad_request(state, path, received, &e),
            })),
        }
    }
}

/// The answer to a review whose uid reads alone but whose body does not read as a review
/// ([`uid_alone`]): denied (400) with why, carrying the uid.
#[cold]
fn unreadable_review(
    state: &WebhookState,
    path: &'static str,
    start: Instant,
    e: &ReviewError,
    version: Option<&str>,
    uid: &str,
) -> Response {
    rejected(state, path, start, e, Some(uid));
    let request = AdmissionRequest {
        api_version: ADMISSION_VERSIONS
            .into_iter()
            .find(|v| version == Some(*v))
            .unwrap_or(ADMISSION_VERSIONS[0]),
        uid: uid.to_owned(),
        ..AdmissionRequest::default()
    };
    Admission::deny(400, "BadRequest", e.log_summary()).into_response(&request)
}

/// A parsed ConversionReview, and when it arrived.
pub struct Conversion {
    /// The parsed request.
    pub request: ConversionRequest,
    /// When the request arrived (for the latency metric).
    pub received: Instant,
}

impl Conversion {
    /// Reads `request` (its body whole, within the serving limits) as a ConversionReview, or
    /// gives the JSON 4xx answering it (boxed: the rare path).
    pub fn read(
        request: Request<Bytes>,
        too_complex: Option<TooComplex>,
        state: &WebhookState,
    ) -> Result<Self, Box<Response>> {
        let received = Instant::now();
        let path = endpoints::label(request.uri().path());
        if let Some(refused) = not_json(&request, state, path, received) {
            return Err(Box::new(refused));
        }
        match parse_conversion(request.into_body()) {
            Ok(mut request) => {
                request.too_complex = too_complex;
                Ok(Self { request, received })
            }
            Err(e) => Err(Box::new(match &e {
                ReviewError::NotAReview {
                    alone: Some((_, uid)),
                    ..
                } => {
                    rejected(state, path, received, &e, Some(uid));
                    conversion_response(uid, Err(e.log_summary()))
                }
                _ => bad_request(state, path, received, &e),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    #[test]
    fn json_is_told_by_the_media_type_whatever_its_case_spaces_and_parameters() {
        let state = crate::webhook::testing::state(true);
        let refused = |content_type: Option<&str>| {
            let mut request = Request::post("/mutate-pod");
            if let Some(value) = content_type {
                request = request.header(header::CONTENT_TYPE, value);
            }
            let request = request.body(Bytes::new()).expect("request");
            not_json(&request, &state, "/mutate-pod", Instant::now()).map(|r| r.status().as_u16())
        };
        for accepted in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            " application/json ;charset=UTF-8",
        ] {
            assert_eq!(refused(Some(accepted)), None, "{accepted}");
        }
        for other in [
            "text/plain",
            "application/jsonx",
            "application/json-patch+json",
            "",
        ] {
            assert_eq!(refused(Some(other)), Some(415), "{other}");
        }
        assert_eq!(refused(None), Some(415), "no content type");
    }

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
    fn a_pod_review_decodes_its_object_in_the_same_pass_or_keeps_it_raw() {
        let pod = json!({"metadata": {"name": "web-0", "annotations": {"a": "b"}},
                         "spec": {"nodeSelector": {"zone": "z1"}, "containers": [{"name": "c"}]}});
        let body = serde_json::to_vec(&review(pod)).expect("json");
        let parsed = parse_pod(body.into()).expect("parses");
        assert_eq!(parsed.uid, "u-1");
        let decoded = parsed.pod().expect("decoded in the pass").view();
        assert_eq!(decoded.name, Some("web-0"));
        assert_eq!(
            decoded.spec.and_then(|s| s.node_selector),
            Some(&[("zone".to_owned(), "z1".to_owned())].into())
        );
        assert!(parsed.object().is_none(), "not kept raw as well");
        // An object that is not a pod: the review is still read (its uid answers), the object
        // kept raw for the handler to say why.
        for object in [json!(5), json!({"metadata": []})] {
            let body = serde_json::to_vec(&review(object.clone())).expect("json");
            let parsed = parse_pod(body.into()).expect("parses");
            assert_eq!(parsed.uid, "u-1");
            assert!(parsed.pod().is_none());
            assert_eq!(parsed.object(), Some(object.to_string().as_str()));
        }
    }

    #[test]
    fn keeps_any_object_raw_and_the_uid() {
        for object in [
            json!({"metadata": {"name": "a"}}),
            json!(5),
            json!("x"),
            json!({"spec": []}),
        ] {
            let body = serde_json::to_vec(&review(object.clone())).expect("json");
            let parsed = parse(body.into()).expect("parses");
            assert_eq!(parsed.uid, "u-1");
            let raw: Value = serde_json::from_str(parsed.object().expect("object")).expect("raw");
            assert_eq!(raw, object);
            assert!(parsed.old_object().is_none());
        }
    }

    #[test]
    fn a_uid_longer_than_any_the_api_server_sends_is_not_read() {
        for (len, read) in [(MAX_UID, true), (MAX_UID + 1, false), (3 << 20, false)] {
            let uid = "u".repeat(len);
            let admission = format!(
                r#"{{"apiVersion":"admission.k8s.io/v1","request":{{"uid":"{uid}","object":{{}}}}}}"#
            );
            let conversion = format!(r#"{{"request":{{"uid":"{uid}","objects":[]}}}}"#);
            let parsed = [
                parse(Bytes::from(admission.clone())).map(|r| r.uid),
                parse_pod(Bytes::from(admission.clone())).map(|r| r.uid),
                parse_conversion(Bytes::from(conversion)).map(|r| r.uid),
            ];
            for got in parsed {
                match got {
                    Ok(got) => assert!(read && got == uid, "{len}"),
                    Err(e) => assert!(!read && matches!(e, ReviewError::NoUid(_)), "{len}: {e}"),
                }
            }
            // Nor is it read alone from a body that is not a review.
            let broken = admission.replacen(r#""object":{}"#, r#""object":{},"kind":1e400"#, 1);
            assert_eq!(uid_alone(broken.as_bytes()).is_some(), read, "{len}");
        }
    }

    #[test]
    fn the_uid_is_read_alone_from_bodies_that_are_not_reviews_as_far_as_they_read() {
        let review =
            r#"{"apiVersion":"admission.k8s.io/v1beta1","request":{"uid":"u-9","object":{}}}"#;
        let read = |body: &str| uid_alone(body.as_bytes());
        let with_uid = Some((
            Some("admission.k8s.io/v1beta1".to_owned()),
            "u-9".to_owned(),
        ));
        for (what, body) in [
            ("garbage after it", format!("{review}xyz")),
            ("a second document after it", format!("{review} {review}")),
            (
                "cut short after the uid",
                review[..review.len() - 5].to_owned(),
            ),
            (
                "apiVersion given twice (the first counts)",
                review.replacen(r#""request""#, r#""apiVersion":"x","request""#, 1),
            ),
        ] {
            assert_eq!(read(&body), with_uid, "{what}: {body}");
            assert!(
                parse(Bytes::from(body.clone())).is_err(),
                "{what}: not a review"
            );
        }
        for (what, body) in [
            (
                "the uid given twice",
                review.replacen(r#""uid":"u-9""#, r#""uid":"u-9","uid":"u-8""#, 1),
            ),
            (
                "the request given twice",
                format!(
                    r#"{},"request":{{"uid":"u-8"}}}}"#,
                    &review[..review.len() - 1]
                ),
            ),
            (
                "cut short within the uid",
                review[..review.find("u-9").unwrap_or_default() + 2].to_owned(),
            ),
            ("not JSON", "uid: u-9".to_owned()),
        ] {
            assert_eq!(read(&body), None, "{what}: {body}");
        }
    }

    #[test]
    fn odd_fields_read_as_absent_and_the_uid_is_kept() {
        let body =
            br#"{"apiVersion":"admission.k8s.io/v1","request":{"uid":"u-2","operation":"TELEPORT",
            "resource":null,"kind":5,"name":["x"],"dryRun":"yes","object":null}}"#;
        let parsed = parse(Bytes::from_static(body)).expect("parses");
        assert_eq!(parsed.uid, "u-2");
        assert_eq!(parsed.operation, "TELEPORT");
        assert_eq!(parsed.kind, Gvk::default());
        assert_eq!(parsed.name, "");
        assert!(!parsed.dry_run);
        assert!(parsed.object().is_none());
    }

    #[test]
    fn each_field_reads_as_absent_unless_of_its_type_and_is_skipped_whole() {
        let odd = [
            json!(null),
            json!(7),
            json!(-1.5),
            json!(true),
            json!([["deep", {"a": [1, 2]}], "x"]),
            json!({"group": "", "kind": "Pod"}),
        ];
        for value in odd.iter().chain([&json!("text")]) {
            let field = |name: &str| {
                let mut request =
                    json!({"uid": "u", "name": value, "dryRun": value, "kind": value});
                request[name] = value.clone();
                serde_json::to_vec(&json!({"request": request})).expect("json")
            };
            let parsed = parse(field("name").into()).expect("parses");
            assert_eq!(
                (parsed.uid.as_str(), parsed.name.as_str()),
                ("u", value.as_str().unwrap_or_default()),
                "{value}"
            );
            assert_eq!(parsed.dry_run, value.as_bool().unwrap_or(false), "{value}");
            let is_pod = value.get("kind").is_some();
            assert_eq!(parsed.kind.is("", "Pod"), is_pod, "{value}");
        }
        let kind = |text: &str| {
            let body = format!(r#"{{"request":{{"uid":"u","kind":{text}}}}}"#);
            parse(body.into_bytes().into()).expect("parses").kind
        };
        let gvk = |group: Option<&str>, version: Option<&str>, kind: Option<&str>| Gvk {
            group: group.map(str::to_owned),
            version: version.map(str::to_owned),
            kind: kind.map(str::to_owned),
        };
        assert_eq!(
            kind(r#"{"group":5,"version":"v1","kind":"Node","kind":"Pod","extra":{"x":[1]}}"#),
            gvk(None, Some("v1"), Some("Pod")),
            "parts lenient, others skipped, the last repeat kept"
        );
        assert_eq!(kind(r#"{"kind":"\u0050od"}"#), gvk(None, None, Some("Pod")));
        assert_eq!(kind(r#"["Pod"]"#), Gvk::default());
    }

    #[test]
    fn bad_bodies_are_errors() {
        let cases: [&[u8]; 6] = [
            b"",
            b"not json",
            b"[]",
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":5}}"#,
            br#"{"request":{"uid":""}}"#,
        ];
        for body in cases {
            assert!(
                parse(Bytes::from_static(body)).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(parse_conversion(Bytes::from_static(b"{")).is_err());
        assert!(
            parse_conversion(Bytes::from_static(
                br#"{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview"}"#
            ))
            .is_err()
        );
        // Objects that are not an array: the uid is read, and the objects are a failure to
        // say, never fewer objects converted than were sent.
        for objects in ["7", r#"{"a":[1]}"#] {
            let body = format!(r#"{{"request":{{"uid":"c","objects":{objects}}}}}"#);
            let request = parse_conversion(Bytes::from(body)).expect("uid read");
            assert_eq!(request.uid, "c");
            let why = request.objects().expect_err(objects);
            assert!(why.contains("not an array of readable objects"), "{why}");
        }
        // What serde_json would not decode is kept as text, each object as it was sent.
        let deep = format!("{}{}", "[".repeat(130), "]".repeat(130));
        let kept = [
            r#"{"spec":{"s":"\ud800"}}"#.to_owned(),
            r#"{"spec":{"n":1e400}}"#.to_owned(),
            format!(r#"{{"spec":{{"d":{deep}}}}}"#),
        ];
        let body = format!(
            r#"{{"request":{{"uid":"c","objects":[{}]}}}}"#,
            kept.join(",")
        );
        let request = parse_conversion(Bytes::from(body)).expect("uid read");
        let objects = request.objects().expect("split");
        assert_eq!(objects.iter().map(|o| o.get()).collect::<Vec<_>>(), kept);
        for objects in ["", r#","objects":null"#] {
            let body = format!(r#"{{"request":{{"uid":"c"{objects}}}}}"#);
            let request = parse_conversion(Bytes::from(body)).expect("uid read");
            assert!(request.objects().is_ok_and(|o| o.is_empty()), "{objects}");
        }
    }

    #[test]
    fn the_patch_is_base64_and_the_version_echoed() {
        let request = parse(Bytes::from_static(
            br#"{"apiVersion":"admission.k8s.io/v1beta1","request":{"uid":"u"}}"#,
        ))
        .expect("parses");
        assert_eq!(request.api_version, "admission.k8s.io/v1beta1");
        let mut patch = PodPatch::default();
        patch.add(&["a"], &1);
        let admission = Admission::patch(&patch);
        assert_eq!(
            base64::engine::general_purpose::STANDARD
                .encode(admission.patch.as_deref().expect("patch")),
            base64::engine::general_purpose::STANDARD
                .encode(br#"[{"op":"add","path":"/a","value":1}]"#)
        );
    }

    #[tokio::test]
    async fn answers_are_written_as_the_review_json_with_the_uid_escaped() {
        let request = parse(Bytes::from_static(
            br#"{"apiVersion":"admission.k8s.io/v1beta1","request":{"uid":"u\"1\\\n"}}"#,
        ))
        .expect("parses");
        assert_eq!(request.uid, "u\"1\\\n");
        let mut patch = PodPatch::default();
        patch.add(&["metadata", "labels"], &BTreeMap::from([("a", "b")]));
        let bytes = patch.to_bytes();
        let cases = [
            (
                Admission::allow(),
                json!({"uid": request.uid, "allowed": true}),
            ),
            (
                Admission::patch(&patch),
                json!({"uid": request.uid, "allowed": true, "patchType": "JSONPatch",
                       "patch": base64::engine::general_purpose::STANDARD.encode(&bytes)}),
            ),
            (
                Admission::patch(&PodPatch::default()),
                json!({"uid": request.uid, "allowed": true}),
            ),
            (
                Admission::deny(422, "Invalid", "a \"quoted\" message".into()),
                json!({"uid": request.uid, "allowed": false, "status": {"status": "Failure",
                       "code": 422, "reason": "Invalid", "message": "a \"quoted\" message"}}),
            ),
        ];
        for (admission, expected) in cases {
            let response = admission.into_response(&request);
            assert_eq!(response.status(), StatusCode::OK);
            assert_eq!(
                response
                    .headers()
                    .get(header::CONTENT_TYPE)
                    .map(|v| v.as_bytes()),
                Some(&b"application/json"[..])
            );
            let body = axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .expect("body");
            let answer: Value = serde_json::from_slice(&body).expect("JSON");
            assert_eq!(
                answer,
                json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview",
                       "response": expected})
            );
        }
    }
}
