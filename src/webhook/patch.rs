//! The webhook's JSON patch (RFC 6902), written as JSON text while it is built: the answer
//! carries it as bytes, so no tree of values is built, serialized and dropped per review. Its
//! values (strings, maps of strings, node affinity terms) write themselves ([`JsonValue`]):
//! a few loops over one string escaper, where a serializer per value type would each be code
//! a review fetches (BENCHMARKS.md, part 2).

use std::collections::BTreeMap;

/// A value a patch operation carries, written as JSON text.
pub trait JsonValue {
    /// Appends the value's JSON text to `out`.
    fn write_json(&self, out: &mut Vec<u8>);
}

impl JsonValue for str {
    fn write_json(&self, out: &mut Vec<u8>) {
        out.push(b'"');
        escape(out, self, false);
        out.push(b'"');
    }
}

impl JsonValue for String {
    fn write_json(&self, out: &mut Vec<u8>) {
        self.as_str().write_json(out);
    }
}

impl<T: JsonValue + ?Sized> JsonValue for &T {
    fn write_json(&self, out: &mut Vec<u8>) {
        (**self).write_json(out);
    }
}

impl<T: JsonValue> JsonValue for [T] {
    fn write_json(&self, out: &mut Vec<u8>) {
        out.push(b'[');
        for (i, item) in self.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            item.write_json(out);
        }
        out.push(b']');
    }
}

impl<K: AsRef<str>, V: AsRef<str>> JsonValue for BTreeMap<K, V> {
    fn write_json(&self, out: &mut Vec<u8>) {
        out.push(b'{');
        for (i, (key, value)) in self.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            key.as_ref().write_json(out);
            out.push(b':');
            value.as_ref().write_json(out);
        }
        out.push(b'}');
    }
}

impl JsonValue for i32 {
    fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(itoa::Buffer::new().format(*self).as_bytes());
    }
}

/// Where a patch operation applies: a JSON Pointer (RFC 6901), written as a JSON string.
pub trait PatchPath {
    /// Appends the pointer's JSON string (quoted) to `out`.
    fn write_path(&self, out: &mut Vec<u8>);
}

/// A path as its tokens, each escaped as a pointer's (`~0`, `~1`) and a JSON string's as it is
/// written.
impl PatchPath for [&str] {
    fn write_path(&self, out: &mut Vec<u8>) {
        out.push(b'"');
        for token in self {
            out.push(b'/');
            escape(out, token, true);
        }
        out.push(b'"');
    }
}

impl<const N: usize> PatchPath for [&str; N] {
    fn write_path(&self, out: &mut Vec<u8>) {
        self[..].write_path(out);
    }
}

/// A pointer known when the code is written, already escaped: copied as it is, where a path of
/// tokens is escaped byte by byte on every review. Made only by [`Pointer::new`], which checks
/// it when compiled.
#[derive(Clone, Copy, Debug)]
pub struct Pointer(&'static str);

impl Pointer {
    /// `text` as a pointer. Refused (a compile error, in a constant) unless it starts with `/`,
    /// every `~` in it is followed by `0` or `1`, and it holds nothing a JSON string escapes.
    pub const fn new(text: &'static str) -> Self {
        let bytes = text.as_bytes();
        assert!(
            !bytes.is_empty() && bytes[0] == b'/',
            "a pointer starts with /"
        );
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            assert!(
                b >= 0x20 && b != b'"' && b != b'\\',
                "nothing a JSON string escapes"
            );
            assert!(
                b != b'~'
                    || (i + 1 < bytes.len() && (bytes[i + 1] == b'0' || bytes[i + 1] == b'1')),
                "~ only as ~0 or ~1"
            );
            i += 1;
        }
        Self(text)
    }
}

impl PatchPath for Pointer {
    fn write_path(&self, out: &mut Vec<u8>) {
        out.push(b'"');
        out.extend_from_slice(self.0.as_bytes());
        out.push(b'"');
    }
}

/// A JSON patch as its operations' JSON text, built one operation at a time.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PodPatch {
    /// The operations, each a JSON object, comma-separated (without the enclosing brackets).
    text: Vec<u8>,
    /// How many operations `text` holds.
    ops: usize,
}

impl PodPatch {
    /// Adds `value` at `path` (its tokens, escaped here, or a [`Pointer`]).
    pub fn add(&mut self, path: &impl PatchPath, value: &(impl JsonValue + ?Sized)) {
        self.push("add", path, Some(&value));
    }

    /// Replaces the value at `path` with `value`.
    pub fn replace(&mut self, path: &impl PatchPath, value: &(impl JsonValue + ?Sized)) {
        self.push("replace", path, Some(&value));
    }

    /// Removes the value at `path`.
    pub fn remove(&mut self, path: &impl PatchPath) {
        self.push("remove", path, None);
    }

    fn push(&mut self, op: &str, path: &dyn PatchPath, value: Option<&dyn JsonValue>) {
        if self.ops > 0 {
            self.text.push(b',');
        } else {
            // Room for a usual patch (a few operations) at once.
            self.text.reserve(512);
        }
        self.text.extend_from_slice(b"{\"op\":\"");
        self.text.extend_from_slice(op.as_bytes());
        self.text.extend_from_slice(b"\",\"path\":");
        path.write_path(&mut self.text);
        if let Some(value) = value {
            self.text.extend_from_slice(b",\"value\":");
            value.write_json(&mut self.text);
        }
        self.text.push(b'}');
        self.ops += 1;
    }

    /// Whether the patch has no operation.
    pub fn is_empty(&self) -> bool {
        self.ops == 0
    }

    /// The number of operations.
    pub fn len(&self) -> usize {
        self.ops
    }

    /// The patch as JSON text (a JSON array).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(self.text.len() + 2);
        bytes.push(b'[');
        bytes.extend_from_slice(&self.text);
        bytes.push(b']');
        bytes
    }

    /// The patch as a JSON value (for `explain` and Event notes).
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::from_slice(&self.to_bytes()).unwrap_or_default()
    }
}

impl std::fmt::Debug for PodPatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}]", String::from_utf8_lossy(&self.text))
    }
}

/// Appends `text` escaped as within a JSON string (`"`, `\\` and control characters; with
/// `pointer`, first `~` and `/` as a JSON Pointer's token, `~0` and `~1`), in one pass: runs of
/// other bytes (as a rule, the whole text) are copied as they are.
fn escape(out: &mut Vec<u8>, text: &str, pointer: bool) {
    let bytes = text.as_bytes();
    // As a rule nothing is to be escaped: one pass without a branch per byte (the compiler
    // makes it a vector loop) tells, and the text is copied whole.
    let special =
        |b: u8| b < 0x20 || b == b'"' || b == b'\\' || (pointer && (b == b'~' || b == b'/'));
    if !bytes.iter().fold(false, |any, &b| any | special(b)) {
        out.extend_from_slice(bytes);
        return;
    }
    let mut plain = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escaped: &[u8] = match b {
            b'~' if pointer => b"~0",
            b'/' if pointer => b"~1",
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0..0x20 => &CONTROL[usize::from(b)],
            _ => continue,
        };
        out.extend_from_slice(&bytes[plain..i]);
        out.extend_from_slice(escaped);
        plain = i + 1;
    }
    out.extend_from_slice(&bytes[plain..]);
}

/// The JSON escapes of the control characters (U+0000 to U+001F), by code.
const CONTROL: [[u8; 6]; 0x20] = {
    let mut table = [*b"\\u0000"; 0x20];
    let hex = b"0123456789abcdef";
    let mut c = 0;
    while c < 0x20 {
        table[c][4] = hex[c >> 4];
        table[c][5] = hex[c & 0xf];
        c += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn writes_the_operations_as_a_json_patch_with_escaped_pointers() {
        let mut patch = PodPatch::default();
        assert!(patch.is_empty());
        assert_eq!(patch.to_bytes(), b"[]");
        let map = BTreeMap::from([("a/b", "v\"1"), ("c~d", "v2")]);
        patch.add(&["spec", "nodeSelector"], &map);
        patch.replace(&["metadata", "annotations", "x/y~z"], "new");
        patch.remove(&["metadata", "annotations", "gone"]);
        patch.add(
            &["spec", "affinity", "nodeAffinity", "terms", "-"],
            &[1, -20][..],
        );
        // Characters JSON escapes (not a pointer's): written escaped, read back as sent.
        patch.add(&["metadata", "annotations", "q\"b\\s\u{1}é"], "odd\n\u{1f}");
        assert_eq!(patch.len(), 5);
        let bytes = patch.to_bytes();
        let parsed: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
        assert_eq!(
            serde_json::to_value(&parsed).expect("json"),
            json!([
                {"op": "add", "path": "/spec/nodeSelector", "value": {"a/b": "v\"1", "c~d": "v2"}},
                {"op": "replace", "path": "/metadata/annotations/x~1y~0z", "value": "new"},
                {"op": "remove", "path": "/metadata/annotations/gone"},
                {"op": "add", "path": "/spec/affinity/nodeAffinity/terms/-", "value": [1, -20]},
                {"op": "add", "path": "/metadata/annotations/q\"b\\s\u{1}é", "value": "odd\n\u{1f}"},
            ])
        );
        assert_eq!(
            patch.to_value(),
            serde_json::from_slice::<serde_json::Value>(&bytes).expect("json")
        );
        assert_eq!(
            format!("{patch:?}"),
            String::from_utf8_lossy(&bytes),
            "debug shows the text"
        );
        // Applied as the API server would: the escaped key is the key.
        let mut doc =
            json!({"spec": {}, "metadata": {"annotations": {"x/y~z": "old", "gone": "1"}}});
        let mut patch = PodPatch::default();
        patch.replace(&["metadata", "annotations", "x/y~z"], "new");
        patch.remove(&["metadata", "annotations", "gone"]);
        let ops: json_patch::Patch =
            serde_json::from_slice(&patch.to_bytes()).expect("a JSON patch");
        json_patch::patch(&mut doc, &ops).expect("applies");
        assert_eq!(doc["metadata"]["annotations"], json!({"x/y~z": "new"}));
    }

    #[test]
    fn a_pointer_that_is_not_one_already_escaped_is_refused() {
        for (text, why) in [
            ("spec/x", "a pointer starts with /"),
            ("/a~2b", "~ only as ~0 or ~1"),
            ("/a~", "~ only as ~0 or ~1"),
            ("/a\"b", "nothing a JSON string escapes"),
            ("/a\nb", "nothing a JSON string escapes"),
        ] {
            let refused = std::panic::catch_unwind(|| Pointer::new(text)).expect_err(text);
            assert_eq!(refused.downcast_ref::<&str>(), Some(&why), "{text:?}");
        }
    }

    #[test]
    fn a_pointer_is_written_as_the_path_of_its_tokens() {
        let (mut by_tokens, mut by_pointer) = (PodPatch::default(), PodPatch::default());
        by_tokens.remove(&["metadata", "annotations", "a/b~c"]);
        by_pointer.remove(&Pointer::new("/metadata/annotations/a~1b~0c"));
        assert_eq!(by_pointer, by_tokens);
    }

    proptest::proptest! {
        /// Any tokens (any characters JSON or a pointer escapes) are written as the JSON string
        /// of their RFC 6901 pointer.
        #[test]
        fn any_tokens_are_written_as_the_json_string_of_their_pointer(
            tokens in proptest::collection::vec(".*", 0..4)
        ) {
            let mut patch = PodPatch::default();
            let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
            refs[..].write_path(&mut patch.text);
            let written: String = serde_json::from_slice(&patch.text).expect("a JSON string");
            let expected: String = tokens
                .iter()
                .map(|t| format!("/{}", t.replace('~', "~0").replace('/', "~1")))
                .collect();
            proptest::prop_assert_eq!(written, expected);
        }

        /// Any map of any strings is written as a JSON object that reads back as that map, and
        /// any weight as serde_json writes it.
        #[test]
        fn any_map_of_strings_and_any_weight_read_back_as_written(
            map in proptest::collection::btree_map(".*", ".*", 0..4),
            weight in proptest::num::i32::ANY,
        ) {
            let mut out = Vec::new();
            map.write_json(&mut out);
            let read: BTreeMap<String, String> = serde_json::from_slice(&out).expect("a JSON object");
            proptest::prop_assert_eq!(read, map);
            let mut out = Vec::new();
            [weight][..].write_json(&mut out);
            proptest::prop_assert_eq!(out, serde_json::to_vec(&[weight]).expect("json"));
        }
    }
}
