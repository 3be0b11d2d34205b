//! The webhook's JSON patch (RFC 6902), written as JSON text while it is built: the answer
//! carries it as bytes, so no tree of values is built, serialized and dropped per review.

use serde::Serialize;

/// A JSON patch as its operations' JSON text, built one operation at a time.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PodPatch {
    /// The operations, each a JSON object, comma-separated (without the enclosing brackets).
    text: Vec<u8>,
    /// How many operations `text` holds.
    ops: usize,
    /// Why a value could not be written, if one could not (the patch is then not answered).
    failed: Option<String>,
}

impl PodPatch {
    /// Adds `value` at the JSON Pointer of `path`'s tokens (escaped here).
    pub fn add(&mut self, path: &[&str], value: &(impl Serialize + ?Sized)) {
        self.push("add", path, Some(value));
    }

    /// Replaces the value at `path` with `value`.
    pub fn replace(&mut self, path: &[&str], value: &(impl Serialize + ?Sized)) {
        self.push("replace", path, Some(value));
    }

    /// Removes the value at `path`.
    pub fn remove(&mut self, path: &[&str]) {
        self.push::<()>("remove", path, None);
    }

    fn push<V: Serialize + ?Sized>(&mut self, op: &str, path: &[&str], value: Option<&V>) {
        let start = self.text.len();
        if self.ops > 0 {
            self.text.push(b',');
        } else {
            // Room for a usual patch (a few operations) at once.
            self.text.reserve(512);
        }
        self.text.extend_from_slice(b"{\"op\":\"");
        self.text.extend_from_slice(op.as_bytes());
        self.text.extend_from_slice(b"\",\"path\":");
        self.write_pointer(path);
        let written = value.map_or(Ok(()), |value| {
            self.text.extend_from_slice(b",\"value\":");
            serde_json::to_writer(&mut self.text, value)
        });
        match written {
            Ok(()) => {
                self.text.push(b'}');
                self.ops += 1;
            }
            Err(error) => {
                self.text.truncate(start);
                self.failed.get_or_insert_with(|| error.to_string());
            }
        }
    }

    /// Writes the JSON string of the pointer of `tokens` in one pass: each token prefixed with
    /// `/`, its `~` and `/` escaped as a pointer's (`~0`, `~1`) and its `"`, `\\` and control
    /// characters as JSON's; runs of other bytes (as a rule, whole tokens) are copied as they are.
    fn write_pointer(&mut self, tokens: &[&str]) {
        self.text.push(b'"');
        for token in tokens {
            self.text.push(b'/');
            let bytes = token.as_bytes();
            let mut plain = 0;
            for (i, &b) in bytes.iter().enumerate() {
                let escaped: &[u8] = match b {
                    b'~' => b"~0",
                    b'/' => b"~1",
                    b'"' => b"\\\"",
                    b'\\' => b"\\\\",
                    0..0x20 => &CONTROL[usize::from(b)],
                    _ => continue,
                };
                self.text.extend_from_slice(&bytes[plain..i]);
                self.text.extend_from_slice(escaped);
                plain = i + 1;
            }
            self.text.extend_from_slice(&bytes[plain..]);
        }
        self.text.push(b'"');
    }

    /// Whether the patch has no operation.
    pub fn is_empty(&self) -> bool {
        self.ops == 0 && self.failed.is_none()
    }

    /// The number of operations.
    pub fn len(&self) -> usize {
        self.ops
    }

    /// The patch as JSON text; an error if one of its values could not be written.
    pub fn to_bytes(&self) -> Result<Vec<u8>, String> {
        match &self.failed {
            Some(failed) => Err(failed.clone()),
            None => Ok(self.written()),
        }
    }

    /// The patch as a JSON value (for `explain` and Event notes): the operations written so
    /// far, whether or not one failed.
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::from_slice(&self.written()).unwrap_or_default()
    }

    /// The operations written, as a JSON array.
    fn written(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(self.text.len() + 2);
        bytes.push(b'[');
        bytes.extend_from_slice(&self.text);
        bytes.push(b']');
        bytes
    }
}

impl std::fmt::Debug for PodPatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}]", String::from_utf8_lossy(&self.text))?;
        match &self.failed {
            Some(failed) => write!(f, " (a value could not be written: {failed})"),
            None => Ok(()),
        }
    }
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
    use std::collections::BTreeMap;

    #[test]
    fn writes_the_operations_as_a_json_patch_with_escaped_pointers() {
        let mut patch = PodPatch::default();
        assert!(patch.is_empty());
        assert_eq!(patch.to_bytes().as_deref(), Ok(&b"[]"[..]));
        let map = BTreeMap::from([("a/b", "v\"1"), ("c~d", "v2")]);
        patch.add(&["spec", "nodeSelector"], &map);
        patch.replace(&["metadata", "annotations", "x/y~z"], "new");
        patch.remove(&["metadata", "annotations", "gone"]);
        patch.add(
            &["spec", "affinity", "nodeAffinity", "terms", "-"],
            &json!({"w": 1}),
        );
        // Characters JSON escapes (not a pointer's): written escaped, read back as sent.
        patch.add(&["metadata", "annotations", "q\"b\\s\u{1}é"], "odd");
        assert_eq!(patch.len(), 5);
        let bytes = patch.to_bytes().expect("written");
        let parsed: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
        assert_eq!(
            serde_json::to_value(&parsed).expect("json"),
            json!([
                {"op": "add", "path": "/spec/nodeSelector", "value": {"a/b": "v\"1", "c~d": "v2"}},
                {"op": "replace", "path": "/metadata/annotations/x~1y~0z", "value": "new"},
                {"op": "remove", "path": "/metadata/annotations/gone"},
                {"op": "add", "path": "/spec/affinity/nodeAffinity/terms/-", "value": {"w": 1}},
                {"op": "add", "path": "/metadata/annotations/q\"b\\s\u{1}é", "value": "odd"},
            ])
        );
        assert_eq!(
            patch.to_value(),
            serde_json::from_slice::<serde_json::Value>(&bytes).expect("json")
        );
        // Applied as the API server would: the escaped key is the key.
        let mut doc =
            json!({"spec": {}, "metadata": {"annotations": {"x/y~z": "old", "gone": "1"}}});
        let mut patch = PodPatch::default();
        patch.replace(&["metadata", "annotations", "x/y~z"], "new");
        patch.remove(&["metadata", "annotations", "gone"]);
        let ops: json_patch::Patch =
            serde_json::from_slice(&patch.to_bytes().expect("written")).expect("a JSON patch");
        json_patch::patch(&mut doc, &ops).expect("applies");
        assert_eq!(doc["metadata"]["annotations"], json!({"x/y~z": "new"}));
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
            patch.write_pointer(&refs);
            let written: String = serde_json::from_slice(&patch.text).expect("a JSON string");
            let expected: String = tokens
                .iter()
                .map(|t| format!("/{}", t.replace('~', "~0").replace('/', "~1")))
                .collect();
            proptest::prop_assert_eq!(written, expected);
        }
    }

    #[test]
    fn a_value_that_cannot_be_written_fails_the_patch_and_leaves_the_rest_whole() {
        let mut patch = PodPatch::default();
        patch.add(&["a"], "kept");
        // A map with non-string keys is no JSON object.
        patch.add(&["b"], &BTreeMap::from([((1, 2), "v")]));
        assert_eq!(patch.len(), 1);
        assert!(!patch.is_empty());
        assert!(patch.to_bytes().is_err());
        assert!(
            format!("{patch:?}").starts_with(
                r#"[{"op":"add","path":"/a","value":"kept"}] (a value could not be written"#
            ),
            "{patch:?}"
        );
        assert_eq!(
            patch.to_value(),
            json!([{"op": "add", "path": "/a", "value": "kept"}])
        );
    }
}
