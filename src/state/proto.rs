//! Pods listed and watched as Protocol Buffers.
//!
//! The API server encodes built-in objects as protobuf several times cheaper than as JSON, and
//! the first list of every pod in the cluster is most of what a replica's start costs it. The
//! messages here hold only the fields [`CachedPod`](super::trim::CachedPod) keeps, numbered as in
//! `k8s.io/api/core/v1/generated.proto` and `k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto`;
//! every other field is skipped by its length while decoding, never read.
//!
//! The list and watch follow kube-runtime's watcher (the same [`watcher::Event`]s, the same
//! requests built by kube): a first list, then a watch from the listed resourceVersion, resumed
//! from the last one seen when it ends. Any error ends the stream; the supervisor starts it
//! again. Where an answer is not protobuf (a proxy that only speaks JSON), the pods are watched
//! as JSON from then on.
//!
//! Where the other kinds' first list is a streaming list, the pods' is one whole list from the
//! API server's watch cache (`resourceVersion=0` with a limit, as client-go's reflector asks
//! without WatchList: the cache ignores the limit and answers whole), read pod by pod as it
//! arrives ([`ListDecoder`]): from v1.33 the API server streams its encoding, and it allocated
//! about a seventh of what the same pods cost it as a streaming list's events (0.17 against
//! 1.19 GB for 100,000 pods, BENCHMARKS.md part 5), the garbage that brings its collector into
//! a replica's start (before v1.33 it encodes the whole list first, as for any informer's
//! list). Where the list goes to etcd instead (the cache not ready yet, or off), it comes in
//! pages, which are followed. A whole list cut short after it began (the API server ends a list
//! at its request timeout, 60 s by default) makes every later first list paginated; a relist
//! after a failed watch is paginated, as for every kind.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodIP, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
use kube::api::{ListParams, WatchParams};
use kube::core::Status;
use kube::runtime::watcher::{self, InitialListStrategy};
use kube::{Api, Client};
use prost::Message;
use prost::bytes::{Buf, Bytes, BytesMut};
use tokio_util::codec::{Decoder, FramedRead, LengthDelimitedCodec};

use super::trim::WatchedPod;

/// What is asked for: protobuf (and JSON only where protobuf cannot be had).
const ACCEPT: &str = "application/vnd.kubernetes.protobuf, application/json;q=0.5";
/// What is asked for a watch: length-prefixed protobuf events.
const ACCEPT_WATCH: &str =
    "application/vnd.kubernetes.protobuf;stream=watch, application/json;q=0.5";
/// The media type of protobuf answers (a watch's carries `;stream=watch`).
const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";
/// What starts every enveloped protobuf object.
const MAGIC: &[u8] = b"k8s\0";
/// The largest watch event or listed pod read (etcd keeps objects up to 1.5 MiB by default).
const MAX_EVENT: usize = 16 << 20;

/// `runtime.Unknown`: the envelope of an encoded object.
#[derive(Clone, PartialEq, Message)]
struct Unknown {
    #[prost(bytes = "bytes", tag = "2")]
    raw: Bytes,
}

/// `meta.v1.ListMeta`.
#[derive(Clone, PartialEq, Message)]
struct ListMeta {
    #[prost(string, optional, tag = "2")]
    resource_version: Option<String>,
    #[prost(string, optional, tag = "3")]
    continue_token: Option<String>,
}

/// `core.v1.PodList`.
#[derive(Clone, PartialEq, Message)]
struct PodList {
    #[prost(message, optional, tag = "1")]
    metadata: Option<ListMeta>,
    #[prost(message, repeated, tag = "2")]
    items: Vec<ProtoPod>,
}

/// `core.v1.Pod`. Its text fields are read as bytes and made text as the API server's JSON
/// makes them ([`text`]): its protobuf decoder stores them unchecked, so one pod created with
/// invalid UTF-8 (in an annotation's value, say) is read as JSON clients read it instead of
/// failing every list and watch of pods.
#[derive(Clone, PartialEq, Message)]
struct ProtoPod {
    #[prost(message, optional, tag = "1")]
    metadata: Option<ObjectMeta>,
    #[prost(message, optional, tag = "2")]
    spec: Option<ProtoPodSpec>,
    #[prost(message, optional, tag = "3")]
    status: Option<ProtoPodStatus>,
}

/// `meta.v1.ObjectMeta`.
#[derive(Clone, PartialEq, Message)]
struct ObjectMeta {
    #[prost(bytes = "vec", optional, tag = "1")]
    name: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "3")]
    namespace: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "5")]
    uid: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "6")]
    resource_version: Option<Vec<u8>>,
    #[prost(message, optional, tag = "9")]
    deletion_timestamp: Option<Time>,
    #[prost(btree_map = "string, bytes", tag = "12")]
    annotations: BTreeMap<String, Vec<u8>>,
    #[prost(message, repeated, tag = "13")]
    owner_references: Vec<OwnerReference>,
}

/// `meta.v1.Time`.
#[derive(Clone, PartialEq, Message)]
struct Time {
    #[prost(int64, optional, tag = "1")]
    seconds: Option<i64>,
    #[prost(int32, optional, tag = "2")]
    nanos: Option<i32>,
}

/// `meta.v1.OwnerReference`.
#[derive(Clone, PartialEq, Message)]
struct OwnerReference {
    #[prost(bytes = "vec", optional, tag = "1")]
    kind: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "3")]
    name: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "4")]
    uid: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "5")]
    api_version: Option<Vec<u8>>,
    #[prost(bool, optional, tag = "6")]
    controller: Option<bool>,
}

/// `core.v1.PodSpec`.
#[derive(Clone, PartialEq, Message)]
struct ProtoPodSpec {
    #[prost(bytes = "vec", optional, tag = "10")]
    node_name: Option<Vec<u8>>,
}

/// `core.v1.PodStatus`.
#[derive(Clone, PartialEq, Message)]
struct ProtoPodStatus {
    #[prost(bytes = "vec", optional, tag = "1")]
    phase: Option<Vec<u8>>,
    #[prost(message, repeated, tag = "2")]
    conditions: Vec<ProtoPodCondition>,
    #[prost(bytes = "vec", optional, tag = "6")]
    pod_ip: Option<Vec<u8>>,
    #[prost(message, repeated, tag = "12")]
    pod_ips: Vec<ProtoPodIp>,
}

/// `core.v1.PodCondition`.
#[derive(Clone, PartialEq, Message)]
struct ProtoPodCondition {
    #[prost(bytes = "vec", optional, tag = "1")]
    type_: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "2")]
    status: Option<Vec<u8>>,
}

/// `core.v1.PodIP`.
#[derive(Clone, PartialEq, Message)]
struct ProtoPodIp {
    #[prost(bytes = "vec", optional, tag = "1")]
    ip: Option<Vec<u8>>,
}

/// `meta.v1.WatchEvent`.
#[derive(Clone, PartialEq, Message)]
struct WatchEvent {
    #[prost(string, optional, tag = "1")]
    type_: Option<String>,
    #[prost(message, optional, tag = "2")]
    object: Option<RawExtension>,
}

/// `runtime.RawExtension`.
#[derive(Clone, PartialEq, Message)]
struct RawExtension {
    #[prost(bytes = "bytes", tag = "1")]
    raw: Bytes,
}

/// `meta.v1.Status`.
#[derive(Clone, PartialEq, Message)]
struct ProtoStatus {
    #[prost(string, optional, tag = "3")]
    message: Option<String>,
    #[prost(string, optional, tag = "4")]
    reason: Option<String>,
    #[prost(int32, optional, tag = "6")]
    code: Option<i32>,
}

impl From<ProtoPod> for Pod {
    /// The pod with only the fields read, as the JSON watch decodes it: both go through the
    /// same conversion into what is kept.
    fn from(p: ProtoPod) -> Self {
        let m = p.metadata.unwrap_or_default();
        let opt = |b: Option<Vec<u8>>| b.map(text);
        let req = |b: Option<Vec<u8>>| b.map(text).unwrap_or_default();
        Pod {
            metadata: meta::ObjectMeta {
                name: opt(m.name),
                namespace: opt(m.namespace),
                uid: opt(m.uid),
                resource_version: opt(m.resource_version),
                deletion_timestamp: m.deletion_timestamp.map(|t| {
                    meta::Time(
                        k8s_openapi::jiff::Timestamp::new(
                            t.seconds.unwrap_or_default(),
                            t.nanos.unwrap_or_default(),
                        )
                        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
                    )
                }),
                annotations: (!m.annotations.is_empty()).then(|| {
                    m.annotations
                        .into_iter()
                        .map(|(k, v)| (k, text(v)))
                        .collect()
                }),
                owner_references: (!m.owner_references.is_empty()).then(|| {
                    m.owner_references
                        .into_iter()
                        .map(|o| meta::OwnerReference {
                            api_version: req(o.api_version),
                            kind: req(o.kind),
                            name: req(o.name),
                            uid: req(o.uid),
                            controller: o.controller,
                            block_owner_deletion: None,
                        })
                        .collect()
                }),
                ..meta::ObjectMeta::default()
            },
            spec: p.spec.map(|s| PodSpec {
                node_name: opt(s.node_name),
                ..PodSpec::default()
            }),
            status: p.status.map(|s| PodStatus {
                phase: opt(s.phase),
                conditions: (!s.conditions.is_empty()).then(|| {
                    s.conditions
                        .into_iter()
                        .map(|c| PodCondition {
                            type_: req(c.type_),
                            status: req(c.status),
                            ..PodCondition::default()
                        })
                        .collect()
                }),
                pod_ip: opt(s.pod_ip),
                pod_ips: (!s.pod_ips.is_empty()).then(|| {
                    s.pod_ips
                        .into_iter()
                        .map(|ip| PodIP { ip: req(ip.ip) })
                        .collect()
                }),
                ..PodStatus::default()
            }),
        }
    }
}

/// `bytes` as text, as the API server's JSON encoder (Go's) writes a string: each byte that is
/// not part of valid UTF-8 becomes U+FFFD (without a copy when the bytes are valid).
fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| {
        let bytes = e.into_bytes();
        let mut out = String::with_capacity(bytes.len() + 8);
        for chunk in bytes.utf8_chunks() {
            out.push_str(chunk.valid());
            out.extend(chunk.invalid().iter().map(|_| char::REPLACEMENT_CHARACTER));
        }
        out
    })
}

/// An answer that cannot be read.
fn unreadable(what: impl std::fmt::Display) -> kube::Error {
    kube::Error::ReadEvents(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        what.to_string(),
    ))
}

/// The object inside an enveloped encoding (`k8s\0` and a `runtime.Unknown`), a view of
/// `bytes` (not a copy).
fn unwrap_envelope(bytes: Bytes) -> Result<Bytes, kube::Error> {
    if !bytes.starts_with(MAGIC) {
        return Err(unreadable("a protobuf object without its k8s envelope"));
    }
    Ok(Unknown::decode(bytes.slice(MAGIC.len()..))
        .map_err(|e| unreadable(format!("the protobuf envelope: {e}")))?
        .raw)
}

/// A pod from its enveloped encoding.
fn decode_pod(bytes: Bytes) -> Result<WatchedPod, kube::Error> {
    let pod = ProtoPod::decode(unwrap_envelope(bytes)?)
        .map_err(|e| unreadable(format!("a protobuf pod: {e}")))?;
    Ok(WatchedPod::from(Pod::from(pod)))
}

/// A `Status` from an error answer or event: protobuf, or JSON, or else its text; with `code`
/// (the answer's HTTP status) where it carries none (or 0: a proxy's own JSON error, say).
fn decode_status(bytes: Bytes, code: u16) -> Status {
    if let Ok(s) = unwrap_envelope(bytes.clone()).and_then(|raw| {
        ProtoStatus::decode(raw).map_err(|e| unreadable(format!("a protobuf Status: {e}")))
    }) {
        let status = Status::failure(
            s.message.as_deref().unwrap_or_default(),
            s.reason.as_deref().unwrap_or_default(),
        );
        let code = s
            .code
            .and_then(|c| u16::try_from(c).ok())
            .filter(|c| *c != 0)
            .unwrap_or(code);
        return status.with_code(code);
    }
    match serde_json::from_slice::<Status>(&bytes) {
        Ok(status) if status.code == 0 => status.with_code(code),
        Ok(status) => status,
        Err(_) => Status::failure(String::from_utf8_lossy(&bytes).trim(), "").with_code(code),
    }
}

/// Pods listed and watched as protobuf, or as JSON once an answer was not protobuf.
#[derive(Clone)]
pub struct PodSource {
    client: Client,
    /// Set once an answer came as JSON: kube-runtime's watcher is used from then on.
    json: Arc<AtomicBool>,
    /// Set once a whole list failed after it began: first lists are paginated from then on.
    whole_failed: Arc<AtomicBool>,
}

impl PodSource {
    /// Pods of the whole cluster, through `client`.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            json: Arc::new(AtomicBool::new(false)),
            whole_failed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether the pods are watched as JSON (an answer was not protobuf).
    pub fn as_json(&self) -> bool {
        self.json.load(Ordering::Relaxed)
    }
}

impl super::Source<WatchedPod> for PodSource {
    fn events(
        &self,
        config: watcher::Config,
    ) -> BoxStream<'static, watcher::Result<watcher::Event<WatchedPod>>> {
        if self.as_json() {
            return watcher::watcher(Api::<WatchedPod>::all(self.client.clone()), config).boxed();
        }
        futures::stream::unfold(
            (self.clone(), config, State::Empty),
            |(source, config, state)| async move {
                let (event, next) = source.step(&config, state).await;
                event.map(|event| (event, (source, config, next)))
            },
        )
        .flat_map(futures::stream::iter)
        .boxed()
    }
}

/// Length-prefixed watch events, as read from the answer's body.
type Frames = BoxStream<'static, std::io::Result<BytesMut>>;

/// Where the list and watch are.
enum State {
    /// Nothing listed yet.
    Empty,
    /// Listing in pages: the objects of the last page not yet handed on, the next page's token
    /// and the list's resourceVersion.
    Pages {
        objects: VecDeque<WatchedPod>,
        continue_token: Option<String>,
        resource_version: Option<String>,
    },
    /// One whole list, read as it arrives: its parts not read yet, and its resourceVersion and
    /// next page's token once read.
    Whole {
        parts: ListParts,
        resource_version: Option<String>,
        continue_token: Option<String>,
    },
    /// Listed; the watch is (re)started from `resource_version`.
    Listed(String),
    /// Watching, from the last resourceVersion seen.
    Watching(String, Frames),
    /// After an error: the stream ends.
    Done,
}

/// What one step hands on (nothing, one event, or one error), and whether the stream goes on.
type Step = (
    Option<Vec<watcher::Result<watcher::Event<WatchedPod>>>>,
    State,
);

impl PodSource {
    /// Sends `request` for a protobuf answer; its body, or the error it answered with.
    async fn send(
        &self,
        request: Result<http::Request<Vec<u8>>, kube::core::request::Error>,
        accept: &'static str,
    ) -> Result<kube::client::Body, kube::Error> {
        let (mut parts, body) = request.map_err(kube::Error::BuildRequest)?.into_parts();
        parts
            .headers
            .insert(http::header::ACCEPT, http::HeaderValue::from_static(accept));
        let response = self
            .client
            .send(http::Request::from_parts(parts, body.into()))
            .await?;
        let status = response.status();
        if status.is_client_error() || status.is_server_error() {
            let body = response.into_body().collect().await?.to_bytes();
            return Err(kube::Error::Api(
                decode_status(body, status.as_u16()).boxed(),
            ));
        }
        let protobuf = response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with(PROTOBUF));
        if !protobuf {
            self.json.store(true, Ordering::Relaxed);
            tracing::warn!(content_type = ?response.headers().get(http::header::CONTENT_TYPE), "the API server answered the pod watch without protobuf; pods are watched as JSON from now on");
            return Err(unreadable(
                "an answer that is not protobuf (pods are watched as JSON from now on)",
            ));
        }
        Ok(response.into_body())
    }

    /// A watch from `resource_version`, as length-prefixed frames.
    async fn watch(
        &self,
        config: &watcher::Config,
        resource_version: &str,
    ) -> Result<Frames, kube::Error> {
        let params = WatchParams {
            label_selector: config.label_selector.clone(),
            field_selector: config.field_selector.clone(),
            timeout: config.timeout,
            bookmarks: config.bookmarks,
            send_initial_events: false,
        };
        let request = request().watch(&params, resource_version);
        let body = self.send(request, ACCEPT_WATCH).await?;
        let reader = tokio_util::io::StreamReader::new(
            http_body_util::BodyDataStream::new(body).map_err(std::io::Error::other),
        );
        let codec = LengthDelimitedCodec::builder()
            .length_field_length(4)
            .big_endian()
            .max_frame_length(MAX_EVENT)
            .new_codec();
        Ok(FramedRead::new(reader, codec).boxed())
    }

    /// The whole list from the API server's watch cache, as its parts arrive.
    async fn whole_list(&self, config: &watcher::Config) -> Result<ListParts, kube::Error> {
        let params = ListParams {
            label_selector: config.label_selector.clone(),
            field_selector: config.field_selector.clone(),
            limit: config.page_size,
            ..ListParams::default()
        };
        let mut request = request().list(&params).map_err(kube::Error::BuildRequest)?;
        // kube leaves `resourceVersion=0` out beside a limit; client-go's reflector sends both.
        let joint = if request.uri().query().is_some() {
            '&'
        } else {
            '?'
        };
        let uri = format!("{}{joint}resourceVersion=0", request.uri());
        *request.uri_mut() = uri
            .parse()
            .map_err(|e| unreadable(format!("the list's URI {uri}: {e}")))?;
        let body = self.send(Ok(request), ACCEPT).await?;
        let reader = tokio_util::io::StreamReader::new(
            http_body_util::BodyDataStream::new(body).map_err(std::io::Error::other),
        );
        Ok(FramedRead::new(reader, ListDecoder::default()).boxed())
    }

    /// One page of the list.
    async fn list(
        &self,
        config: &watcher::Config,
        continue_token: Option<String>,
    ) -> Result<PodList, kube::Error> {
        let params = ListParams {
            label_selector: config.label_selector.clone(),
            field_selector: config.field_selector.clone(),
            limit: config.page_size,
            continue_token,
            ..ListParams::default()
        };
        let body = self.send(request().list(&params), ACCEPT).await?;
        let bytes = body.collect().await?.to_bytes();
        PodList::decode(unwrap_envelope(bytes)?)
            .map_err(|e| unreadable(format!("a protobuf pod list: {e}")))
    }

    /// The next step from `state`.
    async fn step(&self, config: &watcher::Config, state: State) -> Step {
        use watcher::Event;
        let one = |e| Some(vec![e]);
        match state {
            State::Empty => match config.initial_list_strategy {
                // Where the other kinds stream, the pods' first list is one whole list.
                InitialListStrategy::StreamingList
                    if !self.whole_failed.load(Ordering::Relaxed) =>
                {
                    match self.whole_list(config).await {
                        Ok(parts) => (
                            one(Ok(Event::Init)),
                            State::Whole {
                                parts,
                                resource_version: None,
                                continue_token: None,
                            },
                        ),
                        Err(e) => (one(Err(watcher::Error::InitialListFailed(e))), State::Done),
                    }
                }
                _ => (
                    one(Ok(Event::Init)),
                    State::Pages {
                        objects: VecDeque::new(),
                        continue_token: None,
                        resource_version: None,
                    },
                ),
            },
            State::Pages {
                mut objects,
                continue_token,
                resource_version,
            } => {
                if !objects.is_empty() {
                    let events = objects.drain(..).map(|o| Ok(Event::InitApply(o))).collect();
                    return (
                        Some(events),
                        State::Pages {
                            objects,
                            continue_token,
                            resource_version,
                        },
                    );
                }
                if let (None, Some(rv)) = (&continue_token, &resource_version) {
                    return (one(Ok(Event::InitDone)), State::Listed(rv.clone()));
                }
                match self.list(config, continue_token).await {
                    Ok(list) => {
                        let meta = list.metadata.unwrap_or_default();
                        let resource_version = meta.resource_version.filter(|s| !s.is_empty());
                        let continue_token = meta.continue_token.filter(|s| !s.is_empty());
                        if resource_version.is_none() && continue_token.is_none() {
                            return (one(Err(watcher::Error::NoResourceVersion)), State::Done);
                        }
                        let objects = list
                            .items
                            .into_iter()
                            .map(|p| WatchedPod::from(Pod::from(p)))
                            .collect();
                        (
                            Some(Vec::new()),
                            State::Pages {
                                objects,
                                continue_token,
                                resource_version,
                            },
                        )
                    }
                    Err(e) => (one(Err(watcher::Error::InitialListFailed(e))), State::Done),
                }
            }
            State::Whole {
                parts,
                resource_version,
                continue_token,
            } => {
                let (events, next) = whole_step(parts, resource_version, continue_token).await;
                if matches!(next, State::Done) && !self.whole_failed.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "the whole list of pods failed after it began; the first lists of pods are paginated from now on"
                    );
                }
                (events, next)
            }
            // A watch refused for the moment, or whose connection failed, may be asked again
            // from the same version (as kube-runtime's); any other failure ends the stream.
            State::Listed(rv) => match self.watch(config, &rv).await {
                Ok(frames) => (Some(Vec::new()), State::Watching(rv, frames)),
                Err(e) => {
                    let for_now = super::transport_failed(&e)
                        || matches!(&e, kube::Error::Api(s) if matches!(s.code, 429 | 503 | 504));
                    let next = if for_now {
                        State::Listed(rv)
                    } else {
                        State::Done
                    };
                    (one(Err(watcher::Error::WatchStartFailed(e))), next)
                }
            },
            State::Watching(rv, mut frames) => match next_event(config, &mut frames).await {
                Ok(Some(Read::Object(rv, object))) => {
                    (one(Ok(Event::Apply(object))), State::Watching(rv, frames))
                }
                Ok(Some(Read::Deleted(rv, object))) => {
                    (one(Ok(Event::Delete(object))), State::Watching(rv, frames))
                }
                Ok(Some(Read::Bookmark(rv))) => (Some(Vec::new()), State::Watching(rv, frames)),
                Ok(None) => (Some(Vec::new()), State::Listed(rv)),
                // Its connection cut: watched again from the last version seen.
                Err(watcher::Error::WatchFailed(e)) if super::transport_failed(&e) => {
                    (one(Err(watcher::Error::WatchFailed(e))), State::Listed(rv))
                }
                Err(e) => (one(Err(e)), State::Done),
            },
            State::Done => (None, State::Done),
        }
    }
}

/// The next event of a watch; `None` when it ended. A connection that brings nothing for the
/// watch's timeout and [`super::WATCH_SILENCE_MARGIN`] is cut: an API server that stopped
/// answering.
async fn next_event(
    config: &watcher::Config,
    frames: &mut Frames,
) -> watcher::Result<Option<Read>> {
    let idle =
        Duration::from_secs(u64::from(config.timeout.unwrap_or(290))) + super::WATCH_SILENCE_MARGIN;
    let frame = match tokio::time::timeout(idle, frames.next()).await {
        // A frame too long to read is unreadable; any other error is the connection's.
        Ok(Some(frame)) => frame.map_err(|e| {
            watcher::Error::WatchFailed(if e.kind() == std::io::ErrorKind::InvalidData {
                unreadable(e)
            } else {
                kube::Error::ReadEvents(e)
            })
        })?,
        Ok(None) => return Ok(None),
        Err(_) => {
            return Err(watcher::Error::WatchFailed(kube::Error::ReadEvents(
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("nothing from the API server for {} s", idle.as_secs()),
                ),
            )));
        }
    };
    read_event(frame.freeze())
}

/// One watch event, read.
#[derive(Debug)]
enum Read {
    /// Added or modified, with its resourceVersion.
    Object(String, WatchedPod),
    /// Deleted, with its resourceVersion.
    Deleted(String, WatchedPod),
    /// A bookmark: the resourceVersion reached.
    Bookmark(String),
}

/// A watch event from its frame (the object in it is decoded from a view of the frame).
fn read_event(frame: Bytes) -> watcher::Result<Option<Read>> {
    let failed = |e| watcher::Error::WatchFailed(e);
    let event = WatchEvent::decode(frame)
        .map_err(|e| failed(unreadable(format!("a protobuf watch event: {e}"))))?;
    let raw = event.object.map(|o| o.raw).unwrap_or_default();
    let object = || decode_pod(raw.clone()).map_err(failed);
    let resource_version = |pod: &WatchedPod| {
        pod.pod
            .resource_version()
            .filter(|rv| !rv.is_empty())
            .ok_or(watcher::Error::NoResourceVersion)
    };
    match event.type_.as_deref().unwrap_or_default() {
        "ADDED" | "MODIFIED" => {
            let pod = object()?;
            Ok(Some(Read::Object(resource_version(&pod)?, pod)))
        }
        "DELETED" => {
            let pod = object()?;
            Ok(Some(Read::Deleted(resource_version(&pod)?, pod)))
        }
        "BOOKMARK" => {
            let pod = object()?;
            Ok(Some(Read::Bookmark(resource_version(&pod)?)))
        }
        "ERROR" => Err(watcher::Error::WatchError(decode_status(raw, 500).boxed())),
        other => Err(failed(unreadable(format!(
            "a watch event of unknown type {other:?}"
        )))),
    }
}

/// The parts of a whole list, as read from the answer's body.
type ListParts = BoxStream<'static, std::io::Result<ListPart>>;

/// A part of a whole protobuf pod list.
#[derive(Debug, PartialEq)]
enum ListPart {
    /// The list's metadata (its resourceVersion).
    Meta(Bytes),
    /// One pod's encoding (without an envelope).
    Pod(Bytes),
    /// The list's last byte was read.
    End,
}

/// Reads a whole pod list (`k8s\0`, a `runtime.Unknown` whose `raw` is a `PodList`) as it
/// arrives: the list's metadata and its pods one at a time, so that only one pod's bytes are
/// held however many the list holds. Every other field is skipped by its wire type.
#[derive(Debug, Default)]
struct ListDecoder {
    stage: ListStage,
}

/// Where a [`ListDecoder`] is.
#[derive(Debug, Default, PartialEq)]
enum ListStage {
    /// Before the four bytes that start an enveloped object.
    #[default]
    Magic,
    /// In the envelope, before its `raw` field (and after it, once the list was read).
    Envelope { listed: bool },
    /// In the list, with this many of its bytes not read yet (at 0, its end is handed on next).
    List(u64),
}

/// A field's key and how much it takes: the key's and length's bytes, and the payload's.
struct FieldHead {
    field: u64,
    wire: u64,
    head: usize,
    payload: u64,
}

/// A varint at the start of `buf`, and its length; `None` while it is incomplete.
fn read_varint(buf: &[u8]) -> std::io::Result<Option<(u64, usize)>> {
    let mut value = 0u64;
    for (i, byte) in buf.iter().take(10).enumerate() {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok(Some((value, i + 1)));
        }
    }
    if buf.len() >= 10 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a protobuf varint longer than 10 bytes",
        ));
    }
    Ok(None)
}

/// The field that starts `buf`; `None` while its key or length is incomplete.
fn read_field_head(buf: &[u8]) -> std::io::Result<Option<FieldHead>> {
    let Some((key, n)) = read_varint(buf)? else {
        return Ok(None);
    };
    let (field, wire) = (key >> 3, key & 7);
    let (head, payload) = match wire {
        0 => match read_varint(&buf[n..])? {
            Some((_, m)) => (n, m as u64),
            None => return Ok(None),
        },
        1 => (n, 8),
        2 => match read_varint(&buf[n..])? {
            Some((len, m)) => (n + m, len),
            None => return Ok(None),
        },
        5 => (n, 4),
        other => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a protobuf field of wire type {other}"),
            ));
        }
    };
    Ok(Some(FieldHead {
        field,
        wire,
        head,
        payload,
    }))
}

impl Decoder for ListDecoder {
    type Item = ListPart;
    type Error = std::io::Error;

    fn decode(&mut self, src: &mut BytesMut) -> std::io::Result<Option<ListPart>> {
        let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
        loop {
            match self.stage {
                ListStage::Magic => {
                    if src.len() < MAGIC.len() {
                        return Ok(None);
                    }
                    if !src.starts_with(MAGIC) {
                        return Err(invalid("a protobuf list without its k8s envelope"));
                    }
                    src.advance(MAGIC.len());
                    self.stage = ListStage::Envelope { listed: false };
                }
                ListStage::Envelope { listed } => {
                    let Some(f) = read_field_head(src)? else {
                        return Ok(None);
                    };
                    if f.field == 2 && f.wire == 2 && !listed {
                        src.advance(f.head);
                        self.stage = ListStage::List(f.payload);
                        continue;
                    }
                    // The envelope's other fields (type, encodings) are small.
                    let size = usize::try_from(f.payload)
                        .ok()
                        .filter(|n| *n <= MAX_EVENT)
                        .ok_or_else(|| invalid("an envelope field larger than 16 MiB"))?;
                    if src.len() < f.head + size {
                        src.reserve(f.head + size - src.len());
                        return Ok(None);
                    }
                    src.advance(f.head + size);
                }
                ListStage::List(0) => {
                    self.stage = ListStage::Envelope { listed: true };
                    return Ok(Some(ListPart::End));
                }
                ListStage::List(left) => {
                    let Some(f) = read_field_head(src)? else {
                        return Ok(None);
                    };
                    let size = usize::try_from(f.payload)
                        .ok()
                        .filter(|n| *n <= MAX_EVENT)
                        .ok_or_else(|| invalid("a listed pod larger than 16 MiB"))?;
                    let taken = (f.head + size) as u64;
                    if taken > left {
                        return Err(invalid("a protobuf field past the list's end"));
                    }
                    if src.len() < f.head + size {
                        src.reserve(f.head + size - src.len());
                        return Ok(None);
                    }
                    src.advance(f.head);
                    let payload = src.split_to(size).freeze();
                    self.stage = ListStage::List(left - taken);
                    match (f.field, f.wire) {
                        (1, 2) => return Ok(Some(ListPart::Meta(payload))),
                        (2, 2) => return Ok(Some(ListPart::Pod(payload))),
                        _ => {}
                    }
                }
            }
        }
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> std::io::Result<Option<ListPart>> {
        match self.decode(src)? {
            Some(part) => Ok(Some(part)),
            None if src.is_empty() && self.stage == (ListStage::Envelope { listed: true }) => {
                Ok(None)
            }
            None => Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the pod list ended before its last byte",
            )),
        }
    }
}

/// The next step of a whole list: its next pod (one at a time, as a streaming list's events
/// come: a batch of decoded pods held at once left the cache's records spread over more of the
/// allocator's pages), and once its last byte is read, the end of the list and the watch from
/// its resourceVersion, or the pages that follow (a list that went to etcd comes in pages).
async fn whole_step(
    mut parts: ListParts,
    mut resource_version: Option<String>,
    mut continue_token: Option<String>,
) -> Step {
    use watcher::Event;
    let failed = |e: kube::Error| Some(vec![Err(watcher::Error::InitialListFailed(e))]);
    loop {
        match parts.next().await {
            Some(Ok(ListPart::Pod(bytes))) => {
                return match ProtoPod::decode(bytes) {
                    Ok(pod) => (
                        Some(vec![Ok(Event::InitApply(WatchedPod::from(Pod::from(pod))))]),
                        State::Whole {
                            parts,
                            resource_version,
                            continue_token,
                        },
                    ),
                    Err(e) => (
                        failed(unreadable(format!("a listed pod: {e}"))),
                        State::Done,
                    ),
                };
            }
            Some(Ok(ListPart::Meta(bytes))) => match ListMeta::decode(bytes) {
                Ok(meta) => {
                    resource_version = meta.resource_version.filter(|v| !v.is_empty());
                    continue_token = meta.continue_token.filter(|t| !t.is_empty());
                }
                Err(e) => {
                    return (
                        failed(unreadable(format!("a list's metadata: {e}"))),
                        State::Done,
                    );
                }
            },
            Some(Ok(ListPart::End)) => {
                // The envelope's last fields: read, so that the connection can serve the watch.
                while let Some(Ok(_)) = parts.next().await {}
                return match (continue_token, resource_version) {
                    (Some(token), rv) => (
                        Some(Vec::new()),
                        State::Pages {
                            objects: VecDeque::new(),
                            continue_token: Some(token),
                            resource_version: rv,
                        },
                    ),
                    (None, Some(rv)) => (Some(vec![Ok(Event::InitDone)]), State::Listed(rv)),
                    (None, None) => (
                        Some(vec![Err(watcher::Error::NoResourceVersion)]),
                        State::Done,
                    ),
                };
            }
            Some(Err(e)) => return (failed(unreadable(e)), State::Done),
            None => {
                return (
                    failed(unreadable("the pod list ended before its last byte")),
                    State::Done,
                );
            }
        }
    }
}

/// The request builder for pods of every namespace.
fn request() -> kube::core::Request {
    kube::core::Request::new(<Pod as kube::Resource>::url_path(&(), None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Source;
    use http::{Request, Response};
    use kube::client::Body;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn source() -> (PodSource, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        (PodSource::new(Client::new(service, "default")), handle)
    }

    /// `message` in its k8s envelope.
    fn envelope(message: &impl Message) -> Vec<u8> {
        let raw = Bytes::from(message.encode_to_vec());
        [MAGIC, &Unknown { raw }.encode_to_vec()].concat()
    }

    fn pod(name: &str, rv: &str) -> ProtoPod {
        ProtoPod {
            metadata: Some(ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(format!("uid-{name}").into()),
                resource_version: Some(rv.into()),
                deletion_timestamp: None,
                annotations: BTreeMap::new(),
                owner_references: Vec::new(),
            }),
            spec: None,
            status: None,
        }
    }

    /// A length-prefixed watch event of `type_` carrying `object` (enveloped).
    fn frame(type_: &str, object: &impl Message) -> Vec<u8> {
        let event = WatchEvent {
            type_: Some(type_.to_owned()),
            object: Some(RawExtension {
                raw: envelope(object).into(),
            }),
        }
        .encode_to_vec();
        let length = u32::try_from(event.len()).expect("a small event");
        [&length.to_be_bytes()[..], &event].concat()
    }

    fn bookmark(rv: &str) -> ProtoPod {
        let mut pod = pod("", rv);
        if let Some(m) = pod.metadata.as_mut() {
            m.name = None;
        }
        pod
    }

    /// A failure `Status` with `code`, `reason` and `message`.
    fn failure(code: i32, reason: &str, message: &str) -> ProtoStatus {
        ProtoStatus {
            message: Some(message.to_owned()),
            reason: Some(reason.to_owned()),
            code: Some(code),
        }
    }

    /// `status` as the API server refuses a request with it.
    fn refusal(status: ProtoStatus) -> Response<Body> {
        let code = u16::try_from(status.code.unwrap_or(500)).unwrap_or(500);
        Response::builder()
            .status(code)
            .header(http::header::CONTENT_TYPE, PROTOBUF)
            .body(Body::from(envelope(&status)))
            .expect("a response")
    }

    fn answer(content_type: &str, body: Vec<u8>) -> Response<Body> {
        Response::builder()
            .header(http::header::CONTENT_TYPE, content_type)
            .body(Body::from(body))
            .expect("a response")
    }

    fn query(request: &Request<Body>) -> String {
        request.uri().query().unwrap_or_default().to_owned()
    }

    fn accept(request: &Request<Body>) -> String {
        request
            .headers()
            .get(http::header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    }

    /// What the stream hands on, as short text: `apply a@1`, `init`, `error 410`, ...
    fn describe(event: &watcher::Result<watcher::Event<WatchedPod>>) -> String {
        let pod = |w: &WatchedPod| {
            format!(
                "{}@{}",
                w.pod.name,
                w.pod.resource_version().unwrap_or_default()
            )
        };
        match event {
            Ok(watcher::Event::Init) => "init".into(),
            Ok(watcher::Event::InitApply(w)) => format!("init-apply {}", pod(w)),
            Ok(watcher::Event::InitDone) => "init-done".into(),
            Ok(watcher::Event::Apply(w)) => format!("apply {}", pod(w)),
            Ok(watcher::Event::Delete(w)) => format!("delete {}", pod(w)),
            Err(watcher::Error::WatchError(s)) => format!("watch-error {}", s.code),
            Err(watcher::Error::WatchStartFailed(kube::Error::Api(s))) => {
                format!("start-failed {} {}", s.code, s.reason)
            }
            Err(e) => format!("error {e}"),
        }
    }

    /// `list` enveloped as the API server sends it: its type first, then the list, then the
    /// (empty) encoding fields.
    fn go_envelope(list: &PodList) -> Vec<u8> {
        enveloped(&[list.encode_to_vec()]).0
    }

    fn pod_list(rv: Option<&str>, token: Option<&str>, items: Vec<ProtoPod>) -> PodList {
        PodList {
            metadata: Some(ListMeta {
                resource_version: rv.map(str::to_owned),
                continue_token: token.map(str::to_owned),
            }),
            items,
        }
    }

    #[tokio::test]
    async fn the_first_list_is_read_whole_from_the_cache_then_watched_from_its_version() {
        let (source, mut handle) = source();
        let events = source.events(watcher::Config::default().streaming_lists());
        let server = tokio::spawn(async move {
            let (request, respond) = handle.next_request().await.expect("the whole list");
            let q = query(&request);
            // As client-go's reflector asks: the watch cache ignores the limit.
            assert!(
                q.contains("resourceVersion=0") && q.contains("limit=500"),
                "{q}"
            );
            assert!(!q.contains("watch="), "{q}");
            assert!(accept(&request).starts_with("application/vnd.kubernetes.protobuf,"));
            // Many pods, in order, then the list's end.
            let items = (0..600)
                .map(|i| pod(&format!("p{i}"), &i.to_string()))
                .collect();
            let list = pod_list(Some("800"), None, items);
            respond.send_response(answer(PROTOBUF, go_envelope(&list)));
            let (request, respond) = handle.next_request().await.expect("the watch");
            let q = query(&request);
            assert!(
                q.contains("watch=true") && q.contains("resourceVersion=800"),
                "{q}"
            );
            assert!(!q.contains("sendInitialEvents"), "{q}");
            let body = [
                frame("MODIFIED", &pod("p0", "801")),
                frame("DELETED", &pod("p1", "802")),
                frame("BOOKMARK", &bookmark("803")),
            ]
            .concat();
            respond.send_response(answer(
                "application/vnd.kubernetes.protobuf;stream=watch",
                body,
            ));
            // The watch ended: resumed from the last resourceVersion seen.
            let (request, respond) = handle.next_request().await.expect("the resumed watch");
            let q = query(&request);
            assert!(q.contains("resourceVersion=803"), "{q}");
            let gone = failure(410, "Expired", "too old resource version");
            respond.send_response(answer(
                "application/vnd.kubernetes.protobuf;stream=watch",
                frame("ERROR", &gone),
            ));
        });
        let seen: Vec<String> = events.map(|e| describe(&e)).collect().await;
        // Without a client the mock's requests end, so a stream that stops early fails here.
        drop(source);
        server.await.expect("the mock API server");
        let mut want = vec!["init".to_owned()];
        want.extend((0..600).map(|i| format!("init-apply p{i}@{i}")));
        want.extend(
            [
                "init-done",
                "apply p0@801",
                "delete p1@802",
                "watch-error 410",
            ]
            .map(str::to_owned),
        );
        assert_eq!(seen, want);
    }

    #[tokio::test]
    async fn a_whole_list_without_its_version_or_cut_short_fails_and_first_lists_are_paged_after() {
        let no_version = go_envelope(&pod_list(None, None, vec![pod("a", "1")]));
        let mut cut = go_envelope(&pod_list(Some("5"), None, vec![pod("a", "1")]));
        cut.truncate(cut.len() - 8);
        for (body, want) in [
            (no_version, "no metadata.resourceVersion"),
            (cut, "before its last byte"),
        ] {
            let (source, mut handle) = source();
            let events = source.events(watcher::Config::default().streaming_lists());
            let server = tokio::spawn(async move {
                let (_, respond) = handle.next_request().await.expect("the whole list");
                respond.send_response(answer(PROTOBUF, body));
                handle
            });
            let seen: Vec<String> = events.map(|e| describe(&e)).collect().await;
            let mut handle = server.await.expect("the mock API server");
            assert!(!seen.iter().any(|e| e == "init-done"), "{seen:?}");
            let last = seen.last().expect("an error");
            assert!(last.contains(want), "{want}: {seen:?}");
            // The next first list is paginated and consistent.
            let events = source.events(watcher::Config::default().streaming_lists());
            let next = tokio::spawn(events.take(2).collect::<Vec<_>>());
            let (request, _) = handle.next_request().await.expect("the next list");
            let q = query(&request);
            assert!(
                q.contains("limit=500") && !q.contains("resourceVersion"),
                "{q}"
            );
            next.abort();
        }
    }

    #[tokio::test]
    async fn a_whole_list_answered_in_pages_is_followed_page_by_page() {
        let (source, mut handle) = source();
        let events = source.events(watcher::Config::default().streaming_lists());
        let server = tokio::spawn(async move {
            // Served from etcd (the watch cache not ready): the first page, with a token.
            let (_, respond) = handle.next_request().await.expect("the whole list");
            let first = pod_list(Some("5"), Some("next"), vec![pod("a", "1")]);
            respond.send_response(answer(PROTOBUF, go_envelope(&first)));
            let (request, respond) = handle.next_request().await.expect("the next page");
            let q = query(&request);
            assert!(
                q.contains("continue=next") && q.contains("limit=500"),
                "{q}"
            );
            let last = pod_list(Some("6"), None, vec![pod("b", "2")]);
            respond.send_response(answer(PROTOBUF, envelope(&last)));
            let (request, respond) = handle.next_request().await.expect("the watch");
            let q = query(&request);
            assert!(
                q.contains("watch=true") && q.contains("resourceVersion=6"),
                "{q}"
            );
            let gone = failure(410, "Expired", "too old resource version");
            respond.send_response(answer(
                "application/vnd.kubernetes.protobuf;stream=watch",
                frame("ERROR", &gone),
            ));
        });
        let seen: Vec<String> = events.take(5).map(|e| describe(&e)).collect().await;
        assert_eq!(
            seen,
            [
                "init",
                "init-apply a@1",
                "init-apply b@2",
                "init-done",
                "watch-error 410"
            ]
        );
        drop(source);
        server.await.expect("the mock API server");
    }

    /// Every part a decoder reads from `chunks` fed one by one, then the end of the body, and
    /// how reading ended.
    fn feed(chunks: &[&[u8]]) -> (Vec<ListPart>, std::io::Result<()>) {
        let mut decoder = ListDecoder::default();
        let mut buf = BytesMut::new();
        let mut parts = Vec::new();
        for chunk in chunks {
            buf.extend_from_slice(chunk);
            loop {
                match decoder.decode(&mut buf) {
                    Ok(Some(part)) => parts.push(part),
                    Ok(None) => break,
                    Err(e) => return (parts, Err(e)),
                }
            }
        }
        loop {
            match decoder.decode_eof(&mut buf) {
                Ok(Some(part)) => parts.push(part),
                Ok(None) => return (parts, Ok(())),
                Err(e) => return (parts, Err(e)),
            }
        }
    }

    /// `fields` (already encoded) as a list in the API server's envelope; where the list ends.
    fn enveloped(fields: &[Vec<u8>]) -> (Vec<u8>, usize) {
        let raw = fields.concat();
        let mut body = MAGIC.to_vec();
        body.extend_from_slice(b"\x0a\x0d\x0a\x02v1\x12\x07PodList");
        body.push(0x12);
        prost::encoding::encode_varint(raw.len() as u64, &mut body);
        body.extend_from_slice(&raw);
        let list_end = body.len();
        body.extend_from_slice(b"\x1a\x00\x22\x00");
        (body, list_end)
    }

    /// `message` as field `tag` of its parent (length-delimited).
    fn field(tag: u32, message: &impl Message) -> Vec<u8> {
        let mut out = Vec::new();
        prost::encoding::encode_key(tag, prost::encoding::WireType::LengthDelimited, &mut out);
        prost::encoding::encode_varint(message.encoded_len() as u64, &mut out);
        message.encode(&mut out).expect("encoded");
        out
    }

    proptest::proptest! {
        /// However the body arrives in chunks, the same parts come out (pods small and large,
        /// the list's metadata first or last, fields of every other wire type skipped); cut
        /// anywhere before the list's end, it is an error and never an end.
        #[test]
        fn a_whole_list_reads_the_same_however_it_arrives(
            sizes in proptest::collection::vec(proptest::prop_oneof![0usize..64, 100usize..300, 9000usize..30000], 0..8),
            meta_last in proptest::bool::ANY,
            cuts in proptest::collection::vec(0usize..1 << 17, 0..16),
            cut_at in 0usize..1 << 17,
        ) {
            let items: Vec<ProtoPod> = sizes
                .iter()
                .enumerate()
                .map(|(i, size)| {
                    let mut p = pod(&format!("p{i}"), "1");
                    if let Some(m) = p.metadata.as_mut() {
                        m.annotations.insert("a".into(), "x".repeat(*size).into());
                    }
                    p
                })
                .collect();
            let meta = ListMeta { resource_version: Some("9".into()), continue_token: None };
            let mut fields: Vec<Vec<u8>> = items.iter().map(|p| field(2, p)).collect();
            // Unknown fields (7, 8, 9) of wire types 0, 1 and 5.
            fields.insert(fields.len() / 2, b"\x38\x96\x01\x41\x01\x02\x03\x04\x05\x06\x07\x08\x4d\x01\x02\x03\x04".to_vec());
            if meta_last {
                fields.push(field(1, &meta));
            } else {
                fields.insert(0, field(1, &meta));
            }
            let (body, list_end) = enveloped(&fields);
            let mut points: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
            points.sort_unstable();
            let mut chunks = Vec::new();
            let mut from = 0;
            for p in points {
                chunks.push(&body[from..p]);
                from = p;
            }
            chunks.push(&body[from..]);
            let (parts, read) = feed(&chunks);
            proptest::prop_assert!(read.is_ok(), "{:?}", read);
            let pods = items.iter().map(|p| ListPart::Pod(p.encode_to_vec().into()));
            let meta = ListPart::Meta(meta.encode_to_vec().into());
            let mut want: Vec<ListPart> = Vec::new();
            if !meta_last {
                want.push(meta);
                want.extend(pods);
            } else {
                want.extend(pods);
                want.push(meta);
            }
            want.push(ListPart::End);
            proptest::prop_assert_eq!(parts, want);

            let cut = cut_at % list_end;
            let (parts, read) = feed(&[&body[..cut]]);
            proptest::prop_assert!(!parts.contains(&ListPart::End), "cut at {}: {:?}", cut, parts);
            match read {
                Ok(()) => proptest::prop_assert!(false, "cut at {}: no error", cut),
                Err(e) => proptest::prop_assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof),
            }
        }
    }

    #[test]
    fn a_malformed_list_is_an_error_before_anything_large_is_held() {
        let read = |body: &[u8]| feed(&[body]).1.expect_err("an error").to_string();
        assert!(read(b"{\"kind\":").contains("envelope"));
        // A pod that says it is 20 MiB: refused on its length alone.
        let mut big = MAGIC.to_vec();
        big.extend_from_slice(b"\x12\x80\x80\x80\x10\x12");
        prost::encoding::encode_varint(20 << 20, &mut big);
        assert!(read(&big).contains("larger than 16 MiB"));
        // An envelope field (before the list) that says it is 20 MiB.
        let mut big = MAGIC.to_vec();
        big.push(0x0a);
        prost::encoding::encode_varint(20 << 20, &mut big);
        assert!(read(&big).contains("larger than 16 MiB"));
        // A field that runs past the list's end.
        assert!(read(b"k8s\0\x12\x02\x12\x05abcde").contains("past the list's end"));
        // Wire types 3 and 4 (groups) and an endless varint.
        assert!(read(b"k8s\0\x12\x02\x13\x00").contains("wire type 3"));
        assert!(
            read(b"k8s\0\x12\x0c\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
                .contains("longer than 10")
        );
    }

    #[tokio::test]
    async fn pages_are_listed_then_watched_from_the_lists_resource_version() {
        let (source, mut handle) = source();
        let events = source.events(watcher::Config::default().page_size(1));
        let server = tokio::spawn(async move {
            let (request, respond) = handle.next_request().await.expect("page 1");
            assert!(query(&request).contains("limit=1"));
            assert!(accept(&request).starts_with("application/vnd.kubernetes.protobuf,"));
            let page = |items, rv: Option<&str>, token: Option<&str>| PodList {
                metadata: Some(ListMeta {
                    resource_version: rv.map(str::to_owned),
                    continue_token: token.map(str::to_owned),
                }),
                items,
            };
            respond.send_response(answer(
                PROTOBUF,
                envelope(&page(vec![pod("a", "3")], Some("20"), Some("next"))),
            ));
            let (request, respond) = handle.next_request().await.expect("page 2");
            assert!(query(&request).contains("continue=next"));
            respond.send_response(answer(
                PROTOBUF,
                envelope(&page(vec![pod("b", "4")], Some("21"), None)),
            ));
            let (request, respond) = handle.next_request().await.expect("the watch");
            let q = query(&request);
            assert!(
                q.contains("watch=true") && q.contains("resourceVersion=21"),
                "{q}"
            );
            // Refused for the moment: asked again from the same version.
            let refused = failure(429, "TooManyRequests", "storage is (re)initializing");
            respond.send_response(
                Response::builder()
                    .status(429)
                    .header(http::header::CONTENT_TYPE, PROTOBUF)
                    .body(Body::from(envelope(&refused)))
                    .expect("a response"),
            );
            let (request, respond) = handle.next_request().await.expect("the watch again");
            let q = query(&request);
            assert!(
                q.contains("watch=true") && q.contains("resourceVersion=21"),
                "{q}"
            );
            respond.send_response(refusal(failure(403, "Forbidden", "pods is forbidden")));
        });
        let seen: Vec<String> = events.map(|e| describe(&e)).collect().await;
        server.await.expect("the mock API server");
        assert_eq!(
            seen,
            [
                "init",
                "init-apply a@3",
                "init-apply b@4",
                "init-done",
                "start-failed 429 TooManyRequests",
                "start-failed 403 Forbidden",
            ]
        );
    }

    /// A watch whose connection fails (not made, or cut mid-event) is asked again from the
    /// last version seen, as kube-runtime's does, rather than ending the stream (a relist).
    #[tokio::test]
    async fn a_watch_cut_off_is_watched_again_from_the_last_version_seen() {
        let (source, mut handle) = source();
        let events = source.events(watcher::Config::default().page_size(10));
        let server = tokio::spawn(async move {
            let (_, respond) = handle.next_request().await.expect("the list");
            respond.send_response(answer(
                PROTOBUF,
                envelope(&pod_list(Some("20"), None, Vec::new())),
            ));
            let (request, respond) = handle.next_request().await.expect("the watch");
            assert!(query(&request).contains("resourceVersion=20"));
            respond.send_error(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
            let (request, respond) = handle.next_request().await.expect("the watch again");
            assert!(query(&request).contains("resourceVersion=20"));
            // One event, then the connection cut in the middle of the next.
            let whole = frame("ADDED", &pod("a", "25"));
            let cut = frame("MODIFIED", &pod("a", "26"));
            let body = [&whole[..], &cut[..cut.len() / 2]].concat();
            respond.send_response(answer(PROTOBUF, body));
            let (request, respond) = handle.next_request().await.expect("resumed");
            let q = query(&request);
            assert!(
                q.contains("watch=true") && q.contains("resourceVersion=25"),
                "{q}"
            );
            respond.send_response(refusal(failure(403, "Forbidden", "pods is forbidden")));
        });
        let seen: Vec<String> = events.map(|e| describe(&e)).collect().await;
        server.await.expect("the mock API server");
        assert_eq!(seen.len(), 6, "{seen:?}");
        assert_eq!(seen[..2], ["init", "init-done"]);
        assert!(seen[2].starts_with("error "), "{seen:?}");
        assert_eq!(seen[3], "apply a@25");
        assert!(seen[4].starts_with("error "), "{seen:?}");
        assert_eq!(seen[5], "start-failed 403 Forbidden");
    }

    /// A watch whose connection stays open and brings nothing past the watch's timeout (an
    /// API server process that hangs while its kernel still answers) is taken as cut, and
    /// asked again from the last version seen; every watch asks the API server to end it after
    /// [`crate::state::WATCH_TIMEOUT_SECONDS`].
    #[tokio::test(start_paused = true)]
    async fn a_watch_silent_past_its_timeout_is_cut_and_asked_again() {
        use http_body_util::{StreamBody, combinators::BoxBody};
        type Open = BoxBody<Bytes, std::io::Error>;
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Open>>();
        let source = PodSource::new(Client::new(service, "default"));
        // `body`, then the end of the answer if `ends`, else nothing more.
        let answer = |body: Vec<u8>, ends: bool| {
            let frames = futures::stream::iter([Ok(http_body::Frame::data(Bytes::from(body)))])
                .chain(futures::stream::pending().take(usize::from(!ends)));
            Response::builder()
                .header(http::header::CONTENT_TYPE, PROTOBUF)
                .body(BoxBody::new(StreamBody::new(frames)))
                .expect("a response")
        };
        let events = source.events(
            watcher::Config::default()
                .page_size(10)
                .timeout(crate::state::WATCH_TIMEOUT_SECONDS),
        );
        let server = tokio::spawn(async move {
            let (_, respond) = handle.next_request().await.expect("the list");
            let list = envelope(&pod_list(Some("20"), None, Vec::new()));
            respond.send_response(answer(list, true));
            let (request, respond) = handle.next_request().await.expect("the watch");
            let q = query(&request);
            assert!(
                q.contains("resourceVersion=20") && q.contains("timeoutSeconds=60"),
                "{q}"
            );
            // One event, then nothing, the connection open.
            respond.send_response(answer(frame("ADDED", &pod("a", "25")), false));
            let (request, respond) = handle.next_request().await.expect("asked again");
            let asked = tokio::time::Instant::now();
            assert!(query(&request).contains("resourceVersion=25"));
            respond.send_error(std::io::Error::from(std::io::ErrorKind::PermissionDenied));
            asked
        });
        let started = tokio::time::Instant::now();
        let seen = events.take(5).map(|e| describe(&e)).collect::<Vec<_>>();
        let seen = tokio::time::timeout(Duration::from_secs(600), seen)
            .await
            .expect("five events within 600 s");
        let asked = server.await.expect("the mock API server");
        assert_eq!(seen[..3], ["init", "init-done", "apply a@25"], "{seen:?}");
        assert!(
            seen[3].contains("nothing from the API server for 75 s"),
            "{seen:?}"
        );
        assert!(seen[4].starts_with("error "), "{seen:?}");
        let after = asked.duration_since(started);
        assert!(
            (crate::state::WATCH_SILENCE..crate::state::WATCH_SILENCE * 2).contains(&after),
            "asked again after {after:?}"
        );
    }

    #[tokio::test]
    async fn an_answer_in_json_switches_the_pods_to_the_json_watch() {
        let (source, mut handle) = source();
        let events = source.events(watcher::Config::default().page_size(10));
        let server = tokio::spawn(async move {
            let (_, respond) = handle.next_request().await.expect("the list");
            respond.send_response(answer(
                "application/json",
                br#"{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"1"},"items":[]}"#.to_vec(),
            ));
            handle
        });
        let seen: Vec<String> = events.map(|e| describe(&e)).collect().await;
        let mut handle = server.await.expect("the mock API server");
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(seen[1].contains("not protobuf"), "{seen:?}");
        assert!(source.as_json());
        // The next list is kube-runtime's, in JSON.
        let events = source.events(watcher::Config::default().page_size(10));
        let listed = tokio::spawn(events.take(2).map(|e| describe(&e)).collect::<Vec<_>>());
        let (request, respond) = handle.next_request().await.expect("the JSON list");
        assert!(
            !accept(&request).contains("protobuf"),
            "{}",
            accept(&request)
        );
        respond.send_response(answer(
            "application/json",
            br#"{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"1"},"items":[]}"#.to_vec(),
        ));
        assert_eq!(listed.await.expect("joined"), ["init", "init-done"]);
    }

    #[test]
    fn a_pod_keeps_what_the_json_watch_keeps() {
        let mut p = pod("web-0", "7");
        if let Some(m) = p.metadata.as_mut() {
            m.deletion_timestamp = Some(Time {
                seconds: Some(1_700_000_000),
                nanos: None,
            });
            m.annotations.insert("k".into(), "v".into());
            m.owner_references = vec![
                OwnerReference {
                    kind: Some("ReplicaSet".into()),
                    name: Some("other".into()),
                    uid: Some("u1".into()),
                    api_version: Some("apps/v1".into()),
                    controller: Some(false),
                },
                OwnerReference {
                    kind: Some("StatefulSet".into()),
                    name: Some("web".into()),
                    uid: Some("u2".into()),
                    api_version: Some("apps/v1".into()),
                    controller: Some(true),
                },
            ];
        }
        p.spec = Some(ProtoPodSpec {
            node_name: Some("n1".into()),
        });
        p.status = Some(ProtoPodStatus {
            phase: Some("Running".into()),
            conditions: vec![ProtoPodCondition {
                type_: Some("Ready".into()),
                status: Some("True".into()),
            }],
            pod_ip: Some("10.0.0.1".into()),
            pod_ips: vec![
                ProtoPodIp {
                    ip: Some("10.0.0.1".into()),
                },
                ProtoPodIp {
                    ip: Some("fd00::1".into()),
                },
            ],
        });
        let decoded = decode_pod(envelope(&p).into()).expect("decoded").pod;
        let json: WatchedPod = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "web-0", "namespace": "ns", "uid": "uid-web-0", "resourceVersion": "7",
                "deletionTimestamp": "2023-11-14T22:13:20Z",
                "annotations": {"k": "v"},
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "other", "uid": "u1", "controller": false},
                    {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "u2", "controller": true}
                ]
            },
            "spec": {"nodeName": "n1", "containers": []},
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
                "podIP": "10.0.0.1",
                "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]
            }
        }))
        .expect("a JSON pod");
        assert_eq!(decoded, json.pod);
        assert!(decoded.deleting && decoded.ready);
        assert_eq!(&*decoded.ips, [Box::from("10.0.0.1"), Box::from("fd00::1")]);
        assert_eq!(decoded.controller.as_ref().map(|o| &*o.name), Some("web"));
    }

    #[test]
    fn text_outside_utf8_is_read_as_the_api_servers_json_writes_it() {
        // The API server's protobuf decoder stores text unchecked: a pod created with these
        // bytes is served so, and must not fail the list or watch that carries it.
        let mut p = pod("web-0", "7");
        if let Some(m) = p.metadata.as_mut() {
            m.annotations
                .insert("note".into(), b"caf\xc3\xa9 \xff|\xf0\x9f\x98".to_vec());
            m.owner_references = vec![OwnerReference {
                kind: Some("StatefulSet".into()),
                name: Some(b"w\xfeb".to_vec()),
                uid: Some("u".into()),
                api_version: Some("apps/v1".into()),
                controller: Some(true),
            }];
        }
        let decoded = decode_pod(envelope(&p).into())
            .expect("read, not refused")
            .pod;
        // Go's encoding/json writes one U+FFFD per byte outside valid UTF-8.
        let json: WatchedPod = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "web-0", "namespace": "ns", "uid": "uid-web-0", "resourceVersion": "7",
                "annotations": {"note": "caf\u{e9} \u{fffd}|\u{fffd}\u{fffd}\u{fffd}"},
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "w\u{fffd}b", "uid": "u", "controller": true}
                ]
            },
            "spec": {"containers": []}
        }))
        .expect("a JSON pod");
        assert_eq!(decoded, json.pod);
        assert_eq!(text(b"valid \xe2\x9c\x93".to_vec()), "valid \u{2713}");
    }

    #[test]
    fn unreadable_frames_and_envelopes_are_errors_not_panics() {
        assert!(decode_pod(Bytes::new()).is_err());
        assert!(decode_pod(Bytes::from_static(b"k8s\0\xff\xff")).is_err());
        assert!(read_event(Bytes::from_static(b"\x0a\x05ADDED\x12\x03\x0a\x01x")).is_err());
        let unknown = WatchEvent {
            type_: Some("SURPRISE".into()),
            object: None,
        };
        assert!(read_event(unknown.encode_to_vec().into()).is_err());
        // A Status that is not protobuf is read as JSON, or else kept as text.
        let status = decode_status(
            Bytes::from_static(
                br#"{"code": 429, "message": "slow down", "reason": "TooManyRequests"}"#,
            ),
            500,
        );
        assert_eq!(
            (status.code, status.reason.as_str()),
            (429, "TooManyRequests")
        );
        let status = decode_status(Bytes::from_static(b"bad gateway\n"), 502);
        assert_eq!((status.code, status.message.as_str()), (502, "bad gateway"));
        // JSON with no code (a proxy's own): the answer's, so that a refusal for the moment
        // is still told as one.
        let status = decode_status(Bytes::from_static(br#"{"message": "overloaded"}"#), 503);
        assert_eq!((status.code, status.message.as_str()), (503, "overloaded"));
    }
}
