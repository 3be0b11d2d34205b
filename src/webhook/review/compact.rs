//! A pod review read by one visitor for every level of its JSON (issue 22.1). The fields the
//! webhook reads, from the review's envelope down to the pod's owner references and
//! tolerations, are found through a table of where each key leads ([`child`]), so the JSON
//! reader's code runs as one copy for all of them. The derived readers of [`super`]
//! instantiate that code once per type and field, and a review fetches all of those copies
//! cold over HTTPS (`bench/cold-code.sh` counts them).
//!
//! It reads what the API server sends and nothing else: a value of another type than expected,
//! a field given twice, an owner reference without one of its required fields, a request
//! without a uid, anything unusual makes it give up ([`read`] returns `None`), and the review is
//! then read by the derived readers, which decide as they always did (read the field as absent,
//! keep the object raw, or answer 400 with their message). So for any body it gives what they
//! give, or nothing (`it_reads_what_the_derived_readers_read_or_gives_up`).

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{NodeAffinity, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::{Gvk, RawRequest, RawReview, ReadAffinity, ReadMeta, ReadPod, ReadSpec};

/// Reads `text` as a pod review, as the derived readers would (`RawReview<ReadPod>`), or gives
/// up (`None`) on anything the API server does not send; the caller then reads it with them.
pub(super) fn read(text: &str) -> Option<RawReview<'_, ReadPod>> {
    let mut review = RawReview::default();
    let mut de = serde_json::Deserializer::from_str(text);
    Node {
        at: At::Review,
        review: &mut review,
    }
    .deserialize(&mut de)
    .ok()?;
    de.end().ok()?;
    Some(review)
}

/// Where a JSON value sits in a pod review: an object or array read field by field, or a field
/// read as a string, a boolean or an integer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum At {
    Review,
    Request,
    Kind,
    Pod,
    Meta,
    Spec,
    Affinity,
    OwnerRefs,
    OwnerRef,
    Tolerations,
    Toleration,
    ApiVersion,
    Uid,
    SubResource,
    Name,
    Namespace,
    Operation,
    DryRun,
    Group,
    Version,
    KindName,
    PodName,
    PodNamespace,
    RefApiVersion,
    RefKind,
    RefName,
    RefUid,
    RefController,
    RefBlockOwnerDeletion,
    TolKey,
    TolOperator,
    TolValue,
    TolEffect,
    TolSeconds,
}

/// Where a key of an object leads: a value this reader reads, one read by its own type, or one
/// skipped. The `u8` is the key's bit among its object's (a key seen twice gives up).
#[derive(Clone, Copy)]
enum Child {
    Node(At, u8),
    Annotations(u8),
    NodeSelector(u8),
    NodeAffinity(u8),
    OldObject(u8),
    Skip,
}

/// The table: where `key` of the object at `at` leads.
fn child(at: At, key: &str) -> Child {
    use Child::Node as N;
    match (at, key) {
        (At::Review, "apiVersion") => N(At::ApiVersion, 0),
        (At::Review, "request") => N(At::Request, 1),
        (At::Request, "uid") => N(At::Uid, 0),
        (At::Request, "kind") => N(At::Kind, 1),
        (At::Request, "subResource") => N(At::SubResource, 2),
        (At::Request, "name") => N(At::Name, 3),
        (At::Request, "namespace") => N(At::Namespace, 4),
        (At::Request, "operation") => N(At::Operation, 5),
        (At::Request, "dryRun") => N(At::DryRun, 6),
        (At::Request, "object") => N(At::Pod, 7),
        (At::Request, "oldObject") => Child::OldObject(8),
        (At::Kind, "group") => N(At::Group, 0),
        (At::Kind, "version") => N(At::Version, 1),
        (At::Kind, "kind") => N(At::KindName, 2),
        (At::Pod, "metadata") => N(At::Meta, 0),
        (At::Pod, "spec") => N(At::Spec, 1),
        (At::Meta, "name") => N(At::PodName, 0),
        (At::Meta, "namespace") => N(At::PodNamespace, 1),
        (At::Meta, "annotations") => Child::Annotations(2),
        (At::Meta, "ownerReferences") => N(At::OwnerRefs, 3),
        (At::Spec, "nodeSelector") => Child::NodeSelector(0),
        (At::Spec, "affinity") => N(At::Affinity, 1),
        (At::Spec, "tolerations") => N(At::Tolerations, 2),
        (At::Affinity, "nodeAffinity") => Child::NodeAffinity(0),
        (At::OwnerRef, "apiVersion") => N(At::RefApiVersion, 0),
        (At::OwnerRef, "kind") => N(At::RefKind, 1),
        (At::OwnerRef, "name") => N(At::RefName, 2),
        (At::OwnerRef, "uid") => N(At::RefUid, 3),
        (At::OwnerRef, "controller") => N(At::RefController, 4),
        (At::OwnerRef, "blockOwnerDeletion") => N(At::RefBlockOwnerDeletion, 5),
        (At::Toleration, "key") => N(At::TolKey, 0),
        (At::Toleration, "operator") => N(At::TolOperator, 1),
        (At::Toleration, "value") => N(At::TolValue, 2),
        (At::Toleration, "effect") => N(At::TolEffect, 3),
        (At::Toleration, "tolerationSeconds") => N(At::TolSeconds, 4),
        _ => Child::Skip,
    }
}

/// The bits of an owner reference's required fields (`apiVersion`, `kind`, `name`, `uid`).
const OWNER_REF_REQUIRED: u32 = 0b1111;

/// Gives up on this review (the derived readers read it instead).
fn give_up<E: serde::de::Error>() -> E {
    E::custom("not read by the compact reader")
}

/// The one visitor: reads the value at `at` into `review`.
struct Node<'r, 'de> {
    at: At,
    review: &'r mut RawReview<'de, ReadPod>,
}

impl<'de> DeserializeSeed<'de> for Node<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// A key of the object at its `At`, looked up in the table without being copied.
struct Key(At);

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Child;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Child, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for Key {
    type Value = Child;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }
    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Child, E> {
        Ok(child(self.0, key))
    }
}

impl<'de> Node<'_, 'de> {
    /// The request read so far (its object began).
    fn request(&mut self) -> &mut RawRequest<'de, ReadPod> {
        self.review.request.get_or_insert_with(RawRequest::default)
    }
    /// The pod read so far (its object began).
    fn pod(&mut self) -> &mut ReadPod {
        self.request().object.get_or_insert_with(ReadPod::default)
    }
    /// The request's kind read so far (its object began).
    fn kind(&mut self) -> &mut Gvk {
        self.request().kind.get_or_insert_with(Gvk::default)
    }
    fn meta(&mut self) -> &mut ReadMeta {
        self.pod().metadata.get_or_insert_with(ReadMeta::default)
    }
    fn spec(&mut self) -> &mut ReadSpec {
        self.pod().spec.get_or_insert_with(ReadSpec::default)
    }
    fn owner_ref(&mut self) -> Option<&mut OwnerReference> {
        self.meta().owner_references.as_mut()?.last_mut()
    }
    fn toleration(&mut self) -> Option<&mut Toleration> {
        self.spec().tolerations.as_mut()?.last_mut()
    }

    /// Begins the object at `self.at` (it is present, even if empty).
    fn begin_object(&mut self) -> bool {
        match self.at {
            At::Review => {}
            At::Request => self.review.request = Some(RawRequest::default()),
            At::Kind => self.request().kind = Some(Gvk::default()),
            At::Pod => self.request().object = Some(ReadPod::default()),
            At::Meta => self.pod().metadata = Some(ReadMeta::default()),
            At::Spec => self.pod().spec = Some(ReadSpec::default()),
            At::Affinity => self.spec().affinity = Some(ReadAffinity::default()),
            At::OwnerRef => match self.meta().owner_references.as_mut() {
                Some(refs) => refs.push(OwnerReference::default()),
                None => return false,
            },
            At::Toleration => match self.spec().tolerations.as_mut() {
                Some(tolerations) => tolerations.push(Toleration::default()),
                None => return false,
            },
            _ => return false,
        }
        true
    }

    /// Sets the string field at `self.at`; false where a string does not belong.
    fn set_str(&mut self, value: &str) -> bool {
        let value = value.to_owned();
        let field = match self.at {
            At::ApiVersion => &mut self.review.api_version,
            At::Uid => &mut self.request().uid,
            At::SubResource => &mut self.request().sub_resource,
            At::Name => &mut self.request().name,
            At::Namespace => &mut self.request().namespace,
            At::Operation => &mut self.request().operation,
            At::Group => &mut self.kind().group,
            At::Version => &mut self.kind().version,
            At::KindName => &mut self.kind().kind,
            At::PodName => &mut self.meta().name,
            At::PodNamespace => &mut self.meta().namespace,
            At::TolKey | At::TolOperator | At::TolValue | At::TolEffect => {
                let at = self.at;
                let Some(toleration) = self.toleration() else {
                    return false;
                };
                match at {
                    At::TolKey => &mut toleration.key,
                    At::TolOperator => &mut toleration.operator,
                    At::TolValue => &mut toleration.value,
                    _ => &mut toleration.effect,
                }
            }
            At::RefApiVersion | At::RefKind | At::RefName | At::RefUid => {
                let at = self.at;
                let Some(owner) = self.owner_ref() else {
                    return false;
                };
                *match at {
                    At::RefApiVersion => &mut owner.api_version,
                    At::RefKind => &mut owner.kind,
                    At::RefName => &mut owner.name,
                    _ => &mut owner.uid,
                } = value;
                return true;
            }
            _ => return false,
        };
        *field = Some(value);
        true
    }

    /// Sets the boolean field at `self.at`; false where a boolean does not belong.
    fn set_bool(&mut self, value: bool) -> bool {
        match self.at {
            At::DryRun => self.request().dry_run = Some(value),
            At::RefController | At::RefBlockOwnerDeletion => {
                let at = self.at;
                let Some(owner) = self.owner_ref() else {
                    return false;
                };
                *if at == At::RefController {
                    &mut owner.controller
                } else {
                    &mut owner.block_owner_deletion
                } = Some(value);
            }
            _ => return false,
        }
        true
    }

    /// Whether null belongs at `self.at` (read as absent, as the derived readers read it):
    /// everywhere but the envelope, the elements of a list and an owner reference's required
    /// fields.
    fn null_allowed(&self) -> bool {
        !matches!(
            self.at,
            At::Review
                | At::Request
                | At::OwnerRef
                | At::Toleration
                | At::RefApiVersion
                | At::RefKind
                | At::RefName
                | At::RefUid
        )
    }
}

impl<'de> Visitor<'de> for Node<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a pod review")
    }

    fn visit_str<E: serde::de::Error>(mut self, value: &str) -> Result<(), E> {
        if self.set_str(value) {
            Ok(())
        } else {
            Err(give_up())
        }
    }

    fn visit_bool<E: serde::de::Error>(mut self, value: bool) -> Result<(), E> {
        if self.set_bool(value) {
            Ok(())
        } else {
            Err(give_up())
        }
    }

    fn visit_i64<E: serde::de::Error>(mut self, value: i64) -> Result<(), E> {
        match (self.at, self.toleration()) {
            (At::TolSeconds, Some(toleration)) => {
                toleration.toleration_seconds = Some(value);
                Ok(())
            }
            _ => Err(give_up()),
        }
    }

    fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<(), E> {
        self.visit_i64(i64::try_from(value).map_err(|_| give_up::<E>())?)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        if self.null_allowed() {
            Ok(())
        } else {
            Err(give_up())
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        let element = match self.at {
            At::OwnerRefs => {
                self.meta().owner_references = Some(Vec::new());
                At::OwnerRef
            }
            At::Tolerations => {
                self.spec().tolerations = Some(Vec::new());
                At::Toleration
            }
            _ => return Err(give_up()),
        };
        while seq
            .next_element_seed(Node {
                at: element,
                review: self.review,
            })?
            .is_some()
        {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        if !self.begin_object() {
            return Err(give_up());
        }
        let mut seen = 0u32;
        while let Some(child) = map.next_key_seed(Key(self.at))? {
            let bit = match child {
                Child::Node(_, bit)
                | Child::Annotations(bit)
                | Child::NodeSelector(bit)
                | Child::NodeAffinity(bit)
                | Child::OldObject(bit) => 1u32 << bit,
                Child::Skip => 0,
            };
            if seen & bit != 0 {
                return Err(give_up());
            }
            seen |= bit;
            match child {
                Child::Node(at, _) => map.next_value_seed(Node {
                    at,
                    review: self.review,
                })?,
                Child::Annotations(_) => {
                    self.meta().annotations =
                        map.next_value::<Option<BTreeMap<String, String>>>()?
                }
                Child::NodeSelector(_) => {
                    self.spec().node_selector =
                        map.next_value::<Option<BTreeMap<String, String>>>()?
                }
                Child::NodeAffinity(_) => {
                    let node_affinity = map.next_value::<Option<NodeAffinity>>()?;
                    if let Some(affinity) = self.spec().affinity.as_mut() {
                        affinity.node_affinity = node_affinity;
                    }
                }
                Child::OldObject(_) => {
                    self.request().old_object = map.next_value::<Option<&'de RawValue>>()?
                }
                Child::Skip => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if self.at == At::OwnerRef && seen & OWNER_REF_REQUIRED != OWNER_REF_REQUIRED {
            return Err(give_up());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    /// What `parse_pod` read before this reader: the derived readers' review, or `None` where
    /// they fail.
    fn derived(text: &str) -> Option<RawReview<'_, ReadPod>> {
        serde_json::from_str(text).ok()
    }

    /// A review's fields, comparable (the old object as its text).
    fn fields(review: &RawReview<'_, ReadPod>) -> String {
        let request = review.request.as_ref().map(|r| {
            (
                &r.uid,
                &r.kind,
                &r.sub_resource,
                &r.name,
                &r.namespace,
                &r.operation,
                r.dry_run,
                &r.object,
                r.old_object.map(RawValue::get),
            )
        });
        format!("{:?} {request:?}", review.api_version)
    }

    /// Reviews as the API server sends them: every one is read, as the derived readers read it.
    #[test]
    fn it_reads_every_review_the_api_server_sends() {
        let affinity = json!({"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "preference": {"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}}]},
            "podAntiAffinity": {}});
        let mut pods = vec![synthetic::pod(1), synthetic::kruise_pod(2)];
        let mut pinned = synthetic::pod(3);
        pinned["spec"]["affinity"] = affinity;
        pinned["spec"]["nodeSelector"] = json!({"zone": "z1", "zone\"quoted": "é\n"});
        pinned["metadata"]["annotations"]["a\\b"] = json!("\u{1F600}");
        pods.push(pinned);
        let mut bare = synthetic::pod(4);
        bare["metadata"]["ownerReferences"] = Value::Null;
        bare["spec"] = json!({});
        pods.push(bare);
        for (i, pod) in pods.into_iter().enumerate() {
            let mut review: Value =
                serde_json::from_slice(&synthetic::review_of(pod, i)).expect("review");
            if i == 1 {
                review["request"]["oldObject"] = json!({"metadata": {"name": "old"}});
                review["request"]["dryRun"] = json!(true);
                review["request"]["subResource"] = json!("status");
            }
            let text = review.to_string();
            let read = read(&text).expect("an API server's review is read");
            let expected = derived(&text).expect("the derived readers read it");
            assert_eq!(fields(&read), fields(&expected), "{text}");
            assert!(
                read.request
                    .as_ref()
                    .and_then(|r| r.object.as_ref())
                    .is_some()
            );
        }
    }

    /// Where the tests change a review: the fields this reader reads, and their parents.
    const PATHS: &[&str] = &[
        "/apiVersion",
        "/request",
        "/request/uid",
        "/request/kind",
        "/request/kind/group",
        "/request/kind/kind",
        "/request/subResource",
        "/request/name",
        "/request/namespace",
        "/request/operation",
        "/request/dryRun",
        "/request/object",
        "/request/oldObject",
        "/request/object/metadata",
        "/request/object/metadata/name",
        "/request/object/metadata/namespace",
        "/request/object/metadata/annotations",
        "/request/object/metadata/ownerReferences",
        "/request/object/metadata/ownerReferences/0",
        "/request/object/metadata/ownerReferences/0/uid",
        "/request/object/metadata/ownerReferences/0/controller",
        "/request/object/spec",
        "/request/object/spec/nodeSelector",
        "/request/object/spec/affinity",
        "/request/object/spec/affinity/nodeAffinity",
        "/request/object/spec/tolerations",
        "/request/object/spec/tolerations/0",
        "/request/object/spec/tolerations/0/tolerationSeconds",
        "/request/object/spec/tolerations/0/key",
    ];

    /// Checks `text` both ways: what this reader reads, the derived readers read alike.
    fn agrees(text: &str) {
        if let Some(read) = read(text) {
            let expected = derived(text)
                .unwrap_or_else(|| panic!("read what the derived readers reject: {text}"));
            assert_eq!(fields(&read), fields(&expected), "{text}");
        }
    }

    /// Each field set to a value of each JSON type, removed, or given twice: this reader gives
    /// what the derived readers give, or gives up.
    #[test]
    fn each_field_of_each_type_reads_as_the_derived_readers_read_it() {
        let values = [
            Value::Null,
            json!(true),
            json!(-7),
            json!(300),
            json!(u64::MAX),
            json!(1.5),
            json!("text"),
            json!([]),
            json!([{"key": "k"}]),
            json!({}),
            json!({"name": "n", "uid": "u", "kind": "K", "apiVersion": "v"}),
        ];
        let mut pod = synthetic::pod(1);
        pod["spec"]["affinity"] = json!({"podAntiAffinity": {}});
        let base: Value = serde_json::from_slice(&synthetic::review_of(pod, 1)).expect("review");
        let mut read_some = 0;
        for path in PATHS {
            let (parent, key) = path.rsplit_once('/').expect("a path");
            for value in values.iter().map(Some).chain([None]) {
                let mut review = base.clone();
                match (review.pointer_mut(parent), value) {
                    (Some(Value::Object(map)), Some(value)) => {
                        map.insert(key.to_string(), value.clone());
                    }
                    (Some(Value::Object(map)), None) => {
                        map.remove(key);
                    }
                    (Some(Value::Array(list)), Some(value)) => list[0] = value.clone(),
                    (Some(Value::Array(list)), None) => {
                        list.remove(0);
                    }
                    _ => panic!("{path} is not in the review"),
                }
                let text = review.to_string();
                agrees(&text);
                read_some += usize::from(read(&text).is_some());
                let quoted = format!("\"{key}\":");
                if let (Some(at), Some(value)) = (text.find(&quoted), value) {
                    let mut twice = text.clone();
                    twice.insert_str(at, &format!("{quoted}{value},"));
                    agrees(&twice);
                }
            }
        }
        // Most of these changes are what the API server could send (nulls, removals, strings
        // where strings belong): they are read, not given up on.
        assert!(read_some > PATHS.len() * 2, "{read_some} read");
    }

    /// Any JSON value, with the keys this reader looks for mixed in.
    fn any_json() -> impl Strategy<Value = Value> {
        crate::webhook::property_tests::json_with_keys(&[
            "uid",
            "name",
            "kind",
            "apiVersion",
            "metadata",
            "spec",
            "nodeAffinity",
            "key",
            "tolerationSeconds",
        ])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any review, however changed: this reader gives what the derived readers give, or
        /// gives up (never a value they would not give).
        #[test]
        fn it_reads_what_the_derived_readers_read_or_gives_up(
            changes in prop::collection::vec((0..PATHS.len(), prop::option::of(any_json())), 1..4),
            repeated in prop::option::of((0..PATHS.len(), any_json())),
            kruise in any::<bool>(),
        ) {
            let pod = if kruise { synthetic::kruise_pod(1) } else { synthetic::pod(1) };
            let mut review: Value = serde_json::from_slice(&synthetic::review_of(pod, 1)).expect("review");
            for (path, value) in changes {
                let (parent, key) = PATHS[path].rsplit_once('/').expect("a path");
                match (review.pointer_mut(parent), value) {
                    (Some(Value::Object(map)), Some(value)) => { map.insert(key.to_string(), value); }
                    (Some(Value::Object(map)), None) => { map.remove(key); }
                    (Some(Value::Array(list)), Some(value)) if !list.is_empty() => list[0] = value,
                    _ => {}
                }
            }
            let mut text = review.to_string();
            // A key given twice (serde_json's values cannot hold that): the first occurrence of
            // the path's last key gets another value before it.
            if let Some((path, value)) = repeated {
                let key = PATHS[path].rsplit('/').next().expect("a key");
                let quoted = format!("\"{key}\":");
                if let Some(at) = text.find(&quoted) {
                    text.insert_str(at, &format!("{quoted}{value},"));
                }
            }
            if let Some(read) = read(&text) {
                let expected = derived(&text);
                prop_assert!(expected.is_some(), "read what the derived readers reject: {}", text);
                prop_assert_eq!(fields(&read), fields(&expected.expect("read")), "{}", text);
            }
        }
    }
}
