//! A pod review read by a reader of its own (issue 22.1). The fields the webhook reads, from
//! the review's envelope down to the pod's owner references and tolerations, are found through
//! a table of where each key leads ([`child`]); everything else is skipped by one loop that checks
//! it is JSON without decoding it. Driven through serde_json's generic reader and skipper (about
//! 115 instructions per skipped string, of about 265 in a StatefulSet pod's review), the same
//! reading took 59,700 instructions per review; this reader takes 51,700 (bench/NOTEBOOK.md,
//! part 2).
//!
//! It reads what the API server sends and nothing else: a value of another type than expected,
//! a field given twice, an owner reference without one of its required fields, a request
//! without a uid, nesting deeper than [`MAX_DEPTH`], JSON it does not accept, anything unusual
//! makes it give up ([`read`] returns `None`), and the review is then read by the derived
//! readers, which decide as they always did (read the field as absent, keep the object raw, or
//! answer 400 with their message). So for any body it gives what they give, or nothing
//! (`it_reads_what_the_derived_readers_read_or_gives_up`); and whatever JSON it accepts,
//! serde_json accepts (`the_skipper_accepts_only_what_serde_json_accepts`).

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeAffinity, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use serde_json::value::RawValue;

use super::{Gvk, RawRequest, RawReview, ReadAffinity, ReadMeta, ReadPod, ReadSpec};

/// Reads `text` as a pod review, as the derived readers would (`RawReview<ReadPod>`), or gives
/// up (`None`) on anything the API server does not send; the caller then reads it with them.
pub(super) fn read(text: &str) -> Option<RawReview<'_, ReadPod>> {
    let mut review = RawReview::default();
    let mut reader = Reader { text, pos: 0 };
    reader.value(
        Node {
            at: At::Review,
            review: &mut review,
        },
        0,
    )?;
    reader.ws();
    (reader.pos == text.len()).then_some(review)
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
    NodeName,
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
        (At::Spec, "nodeName") => N(At::NodeName, 3),
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

/// Where the reader is: the value at `at`, read into `review`.
struct Node<'r, 'de> {
    at: At,
    review: &'r mut RawReview<'de, ReadPod>,
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
            At::NodeName => &mut self.spec().node_name,
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

    /// Sets the integer field at `self.at`; false where an integer does not belong.
    fn set_int(&mut self, value: i64) -> bool {
        match (self.at, self.toleration()) {
            (At::TolSeconds, Some(toleration)) => {
                toleration.toleration_seconds = Some(value);
                true
            }
            _ => false,
        }
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

/// Containers nested deeper than this (the review's own object counted) make the reader give
/// up: far within serde_json's own limit (128), so that what this reader accepts the derived
/// readers never refuse for its depth.
const MAX_DEPTH: u32 = 64;

/// A position in the review's text. The text is UTF-8 already, and the reader only stops at
/// ASCII bytes, so each piece it takes is a `str`.
struct Reader<'de> {
    text: &'de str,
    pos: usize,
}

impl<'de> Reader<'de> {
    fn bytes(&self) -> &'de [u8] {
        self.text.as_bytes()
    }

    fn peek(&self) -> Option<u8> {
        self.bytes().get(self.pos).copied()
    }

    /// Past JSON's whitespace.
    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.bytes().get(self.pos) {
            self.pos += 1;
        }
    }

    /// Past whitespace, `byte`, consumed; `None` if another comes.
    fn eat(&mut self, byte: u8) -> Option<()> {
        self.ws();
        (self.peek()? == byte).then(|| self.pos += 1)
    }

    /// `word` (a literal: `true`, `false`, `null`) at the position, consumed.
    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.pos + word.len();
        (self.bytes().get(self.pos..end)? == word).then(|| self.pos = end)
    }

    /// Past a comma (another member or element follows: true) or `close` (false); `None` for
    /// anything else.
    fn next_or(&mut self, close: u8) -> Option<bool> {
        self.ws();
        let byte = self.peek()?;
        self.pos += 1;
        match byte {
            b',' => Some(true),
            _ if byte == close => Some(false),
            _ => None,
        }
    }

    /// Past the opening bracket at the position and whitespace: whether a member or element
    /// follows (false: `close` came, and is consumed too).
    #[inline(always)]
    fn opened(&mut self, close: u8) -> Option<bool> {
        self.pos += 1;
        self.ws();
        if self.peek()? == close {
            self.pos += 1;
            return Some(false);
        }
        Some(true)
    }

    /// Past an object member's key and its colon: the key.
    #[inline(always)]
    fn key(&mut self) -> Option<Cow<'de, str>> {
        self.ws();
        if self.peek()? != b'"' {
            return None;
        }
        let key = self.string()?;
        self.eat(b':')?;
        Some(key)
    }

    /// Past the string whose opening quote is at the position (it is checked: escapes are
    /// JSON's, no control character); its text, decoded if it holds escapes. `None` for a
    /// string that is not JSON, or whose escapes serde_json would refuse to decode.
    fn string(&mut self) -> Option<Cow<'de, str>> {
        let bytes = self.bytes();
        let start = self.pos + 1;
        let mut i = start;
        let mut escaped = false;
        loop {
            i = to_special(bytes, i);
            match *bytes.get(i)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    i = past_escape(bytes, i)?;
                }
                _ => return None,
            }
        }
        self.pos = i + 1;
        let raw = self.text.get(start..i)?;
        if escaped {
            unescape(raw).map(Cow::Owned)
        } else {
            Some(Cow::Borrowed(raw))
        }
    }

    /// The value at the position read into `node`, the value being inside `depth` containers.
    fn value(&mut self, mut node: Node<'_, 'de>, depth: u32) -> Option<()> {
        self.ws();
        let read = match self.peek()? {
            b'{' => return self.object(node, depth + 1),
            b'[' => return self.array(node, depth + 1),
            b'"' => node.set_str(&self.string()?),
            b't' => {
                self.literal(b"true")?;
                node.set_bool(true)
            }
            b'f' => {
                self.literal(b"false")?;
                node.set_bool(false)
            }
            b'n' => {
                self.literal(b"null")?;
                node.null_allowed()
            }
            _ => node.set_int(self.integer()?),
        };
        read.then_some(())
    }

    /// The object at the position (the `depth`th container) read into `node`, key by key.
    fn object(&mut self, mut node: Node<'_, 'de>, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH || !node.begin_object() {
            return None;
        }
        let mut seen = 0u32;
        let mut more = self.opened(b'}')?;
        while more {
            let key = self.key()?;
            let child = child(node.at, &key);
            let bit = match child {
                Child::Node(_, bit)
                | Child::Annotations(bit)
                | Child::NodeSelector(bit)
                | Child::NodeAffinity(bit)
                | Child::OldObject(bit) => 1u32 << bit,
                Child::Skip => 0,
            };
            if seen & bit != 0 {
                return None;
            }
            seen |= bit;
            match child {
                Child::Node(at, _) => self.value(
                    Node {
                        at,
                        review: &mut *node.review,
                    },
                    depth,
                )?,
                Child::Annotations(_) => node.meta().annotations = self.strings(depth)?,
                Child::NodeSelector(_) => node.spec().node_selector = self.strings(depth)?,
                Child::NodeAffinity(_) => {
                    let text = self.extent(depth)?;
                    let node_affinity = serde_json::from_str::<Option<NodeAffinity>>(text).ok()?;
                    if let Some(affinity) = node.spec().affinity.as_mut() {
                        affinity.node_affinity = node_affinity;
                    }
                }
                Child::OldObject(_) => {
                    let text = self.extent(depth)?;
                    node.request().old_object =
                        serde_json::from_str::<Option<&'de RawValue>>(text).ok()?;
                }
                Child::Skip => self.skip(depth)?,
            }
            more = self.next_or(b'}')?;
        }
        (node.at != At::OwnerRef || seen & OWNER_REF_REQUIRED == OWNER_REF_REQUIRED).then_some(())
    }

    /// The list at the position (the `depth`th container) read into `node`: owner references
    /// or tolerations, each element an object.
    fn array(&mut self, mut node: Node<'_, 'de>, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        let element = match node.at {
            At::OwnerRefs => {
                node.meta().owner_references = Some(Vec::new());
                At::OwnerRef
            }
            At::Tolerations => {
                node.spec().tolerations = Some(Vec::new());
                At::Toleration
            }
            _ => return None,
        };
        let mut more = self.opened(b']')?;
        while more {
            self.value(
                Node {
                    at: element,
                    review: &mut *node.review,
                },
                depth,
            )?;
            more = self.next_or(b']')?;
        }
        Some(())
    }

    /// A map of strings (annotations, a node selector) or null, inside `depth` containers, as
    /// serde reads an `Option<BTreeMap<String, String>>` (a key given twice: the last value).
    fn strings(&mut self, depth: u32) -> Option<Option<BTreeMap<String, String>>> {
        self.ws();
        match self.peek()? {
            b'n' => {
                self.literal(b"null")?;
                return Some(None);
            }
            b'{' if depth < MAX_DEPTH => {}
            _ => return None,
        }
        let mut map = BTreeMap::new();
        let mut more = self.opened(b'}')?;
        while more {
            let key = self.key()?;
            self.ws();
            if self.peek()? != b'"' {
                return None;
            }
            let value = self.string()?;
            map.insert(key.into_owned(), value.into_owned());
            more = self.next_or(b'}')?;
        }
        Some(Some(map))
    }

    /// The text of the value at the position (skipped), inside `depth` containers.
    fn extent(&mut self, depth: u32) -> Option<&'de str> {
        self.ws();
        let start = self.pos;
        self.skip(depth)?;
        self.text.get(start..self.pos)
    }

    /// An integer as serde_json reads one into `i64` (no fraction or exponent, not `-0`, in
    /// range); `None` for any other number, or what is not one.
    fn integer(&mut self) -> Option<i64> {
        let bytes = self.bytes();
        let start = self.pos;
        let digits = start + usize::from(bytes.get(start) == Some(&b'-'));
        let end = digits
            + bytes
                .get(digits..)?
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
        let leading_zero = end - digits > 1 && bytes.get(digits) == Some(&b'0');
        let negative_zero = digits > start && self.text.get(digits..end) == Some("0");
        if end == digits
            || leading_zero
            || negative_zero
            || matches!(bytes.get(end), Some(b'.' | b'e' | b'E'))
        {
            return None;
        }
        let value = self.text.get(start..end)?.parse().ok()?;
        self.pos = end;
        Some(value)
    }

    /// Past the value at the position, checked as JSON and not decoded, inside `depth`
    /// containers.
    fn skip(&mut self, depth: u32) -> Option<()> {
        // One bit per open container, the innermost lowest: set for an object.
        let mut open: u64 = 0;
        let mut inside = 0u32;
        loop {
            // A value starts here.
            self.ws();
            match self.peek()? {
                b'"' => {
                    self.string_skipped()?;
                }
                byte @ (b'{' | b'[') => {
                    let object = byte == b'{';
                    inside += 1;
                    if depth + inside > MAX_DEPTH {
                        return None;
                    }
                    open = (open << 1) | u64::from(object);
                    if self.opened(if object { b'}' } else { b']' })? {
                        if object {
                            self.key_skipped()?;
                        }
                        continue;
                    }
                    open >>= 1;
                    inside -= 1;
                }
                b't' => self.literal(b"true")?,
                b'f' => self.literal(b"false")?,
                b'n' => self.literal(b"null")?,
                _ => self.number_skipped()?,
            }
            // After a value: close what ends here, or go on to the next member or element.
            loop {
                if inside == 0 {
                    return Some(());
                }
                let object = open & 1 == 1;
                if self.next_or(if object { b'}' } else { b']' })? {
                    if object {
                        self.key_skipped()?;
                    }
                    break;
                }
                open >>= 1;
                inside -= 1;
            }
        }
    }

    /// Past a member's key and its colon (in a skipped object).
    #[inline(always)]
    fn key_skipped(&mut self) -> Option<()> {
        self.ws();
        if self.peek()? != b'"' {
            return None;
        }
        self.string_skipped()?;
        self.eat(b':')?;
        self.ws();
        Some(())
    }

    /// Past the string whose opening quote is at the position, checked and not decoded.
    fn string_skipped(&mut self) -> Option<()> {
        let bytes = self.bytes();
        let mut i = self.pos + 1;
        loop {
            i = to_special(bytes, i);
            match *bytes.get(i)? {
                b'"' => break,
                b'\\' => i = past_escape(bytes, i)?,
                _ => return None,
            }
        }
        self.pos = i + 1;
        Some(())
    }

    /// Past a number, checked as JSON's grammar: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]?
    /// [0-9]+)?`.
    fn number_skipped(&mut self) -> Option<()> {
        let bytes = self.bytes();
        let digits = |from: usize| {
            from + bytes.get(from..).map_or(0, |rest| {
                rest.iter().take_while(|b| b.is_ascii_digit()).count()
            })
        };
        let mut i = self.pos + usize::from(bytes.get(self.pos) == Some(&b'-'));
        match bytes.get(i)? {
            b'0' => i += 1,
            b'1'..=b'9' => i = digits(i),
            _ => return None,
        }
        if bytes.get(i) == Some(&b'.') {
            let end = digits(i + 1);
            if end == i + 1 {
                return None;
            }
            i = end;
        }
        if let Some(b'e' | b'E') = bytes.get(i) {
            i += 1;
            if let Some(b'+' | b'-') = bytes.get(i) {
                i += 1;
            }
            let end = digits(i);
            if end == i {
                return None;
            }
            i = end;
        }
        self.pos = i;
        Some(())
    }
}

/// Whether a byte ends a run of a string's plain bytes: a quote, a backslash or a control
/// character (which JSON does not allow raw in a string).
const SPECIAL: [bool; 256] = {
    let mut table = [false; 256];
    let mut byte = 0;
    while byte < 0x20 {
        table[byte] = true;
        byte += 1;
    }
    table[b'"' as usize] = true;
    table[b'\\' as usize] = true;
    table
};

/// The first index from `i` of a [`SPECIAL`] byte (`bytes.len()` if none): eight bytes at a time
/// while none of them is one.
fn to_special(bytes: &[u8], mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    while let Some(chunk) = bytes.get(i..i + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let word = u64::from_le_bytes(word);
        // A byte of `x` is zero where the high bit of `(x - ONES) & !x` is set (the lowest such
        // byte exactly; higher ones may be false alarms, which the byte loop below sorts out).
        let zero = |x: u64| x.wrapping_sub(ONES) & !x;
        let found = (zero(word ^ (ONES * u64::from(b'"')))
            | zero(word ^ (ONES * u64::from(b'\\')))
            | (word.wrapping_sub(ONES * 0x20) & !word))
            & HIGH;
        if found != 0 {
            i += (found.trailing_zeros() / 8) as usize;
            break;
        }
        i += 8;
    }
    while bytes.get(i).is_some_and(|&b| !SPECIAL[usize::from(b)]) {
        i += 1;
    }
    i
}

/// Past the escape whose backslash is at `i`: one of JSON's (`\"`, `\\`, `\/`, `\b`, `\f`,
/// `\n`, `\r`, `\t`, `\u` and four hex digits); `None` for any other.
fn past_escape(bytes: &[u8], i: usize) -> Option<usize> {
    match bytes.get(i + 1)? {
        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(i + 2),
        b'u' if bytes.get(i + 2..i + 6)?.iter().all(u8::is_ascii_hexdigit) => Some(i + 6),
        _ => None,
    }
}

/// The text of a string with escapes (each already checked as JSON's), decoded; `None` for a
/// surrogate not in a pair, which serde_json refuses in a string it decodes.
fn unescape(raw: &str) -> Option<String> {
    let hex = |text: &str| u32::from_str_radix(text.get(..4)?, 16).ok();
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(at) = rest.find('\\') {
        out.push_str(rest.get(..at)?);
        let escape = *rest.as_bytes().get(at + 1)?;
        rest = rest.get(at + 2..)?;
        out.push(match escape {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            _ => {
                let unit = hex(rest)?;
                rest = rest.get(4..)?;
                match unit {
                    0xD800..=0xDBFF => {
                        let low = rest.strip_prefix("\\u").and_then(hex)?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return None;
                        }
                        rest = rest.get(6..)?;
                        char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))?
                    }
                    _ => char::from_u32(unit)?,
                }
            }
        });
    }
    out.push_str(rest);
    Some(out)
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

    /// Whether the skipper takes all of `text` as one JSON value.
    fn skips_whole(text: &str) -> bool {
        let mut reader = Reader { text, pos: 0 };
        reader.skip(0).is_some() && {
            reader.ws();
            reader.pos == text.len()
        }
    }

    /// Whether serde_json reads `text` as one JSON value (skipping it, as the derived readers
    /// skip what they do not read).
    fn serde_skips(text: &str) -> bool {
        serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok()
    }

    /// Pieces of JSON text, valid and not, that the skipper's property test strings together.
    const PIECES: &[&str] = &[
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        " ",
        "\n",
        "\"a\"",
        "\"\"",
        "\"k\":",
        "\"\\u00e9\"",
        "\"\\ud800\"",
        "\"\\u12\"",
        "\"\\x\"",
        "\"\\n\\\"\\/\"",
        "\"\u{1}\"",
        "\"é\"",
        "\"\u{1F600}\"",
        "\"",
        "0",
        "-0",
        "01",
        "1.",
        "1.5",
        "1.5e+3",
        "2E-7",
        "1e",
        "-",
        "123",
        "true",
        "tru",
        "false",
        "null",
        "nul",
        "x",
    ];

    /// Strings with escapes in the fields this reader reads are read, decoded as serde_json
    /// decodes them; a surrogate not in a pair makes it give up.
    #[test]
    fn escapes_are_decoded_as_serde_json_decodes_them() {
        let base = String::from_utf8(synthetic::review_of(synthetic::pod(1), 1)).expect("UTF-8");
        let cases = [
            ("\"uid\":\"", "\"uid\":\"\\u00e9\\ud83d\\ude00\\n\\\"x\\/"),
            ("\"uid\":", "\"u\\u0069d\":"),
            (
                "\"annotations\":{",
                "\"annotations\":{\"a\\\\b\\u003c\":\"\\u0026\\t\",",
            ),
            ("\"name\":\"", "\"name\":\"\\b\\f\\r"),
        ];
        for (find, replace) in cases {
            assert!(base.contains(find), "{find}");
            let text = base.replacen(find, replace, 1);
            let read = read(&text).unwrap_or_else(|| panic!("escapes are read: {text}"));
            let expected = derived(&text).expect("the derived readers read it");
            assert_eq!(fields(&read), fields(&expected), "{text}");
        }
        for lone in ["\\ud800", "\\udc00", "\\ud800\\u0041"] {
            let text = base.replacen("\"uid\":\"", &format!("\"uid\":\"{lone}"), 1);
            assert!(read(&text).is_none(), "{text}");
            agrees(&text);
        }
    }

    /// Nesting past [`MAX_DEPTH`] in a skipped value gives up; within it, the value is skipped.
    #[test]
    fn deep_nesting_gives_up() {
        let base = String::from_utf8(synthetic::review_of(synthetic::pod(1), 1)).expect("UTF-8");
        let nested = |n: usize| format!("\"deep\":{}{},", "[".repeat(n), "]".repeat(n));
        let within = base.replacen("\"spec\":{", &format!("\"spec\":{{{}", nested(20)), 1);
        assert!(read(&within).is_some());
        agrees(&within);
        let past = base.replacen("\"spec\":{", &format!("\"spec\":{{{}", nested(200)), 1);
        assert!(read(&past).is_none());
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

        /// Whatever the skipper takes as a JSON value, serde_json reads as one, and the other
        /// way round: over strings of pieces of JSON, valid and not, and over any JSON value.
        #[test]
        fn the_skipper_accepts_only_what_serde_json_accepts(
            pieces in prop::collection::vec(prop::sample::select(PIECES), 1..12),
            value in any_json(),
        ) {
            let text = pieces.concat();
            prop_assert_eq!(skips_whole(&text), serde_skips(&text), "{}", text);
            let text = value.to_string();
            prop_assert!(skips_whole(&text), "{}", text);
        }
    }
}
