//! Conversion between the served versions, on the JSON text as sent: only what differs
//! between the versions is decoded (the object's own keys, its spec's and its topology
//! terms'), and every other value (metadata, status, fields this version does not know) is
//! copied byte for byte as the answer is written, so that nothing the schema of one version
//! holds is lost on the way through the other (`nodeTopologyKeys` <-> `keys`), and an object
//! recording thousands of pods costs what its spec does.

use std::collections::BTreeMap;

use serde::{Serialize, Serializer};
use serde_json::value::RawValue;

use super::{KRUISE_GROUP, VERSIONS, keys_field, shown};

/// A converted object, written out as it is serialized: every value is copied from the text
/// sent, except what differs between the versions.
#[derive(Debug)]
pub enum Converted<'a> {
    /// A value as it was sent.
    Sent(&'a RawValue),
    /// An object some of whose values differ.
    Object(BTreeMap<String, Converted<'a>>),
    /// An array some of whose elements differ.
    Array(Vec<Converted<'a>>),
    /// A string (the apiVersion converted to).
    Text(&'a str),
}

impl Serialize for Converted<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Converted::Sent(raw) => raw.serialize(serializer),
            Converted::Object(fields) => fields.serialize(serializer),
            Converted::Array(items) => items.serialize(serializer),
            Converted::Text(text) => text.serialize(serializer),
        }
    }
}

/// An object's fields, their values kept as text.
type Fields<'a> = BTreeMap<String, &'a RawValue>;

/// The fields of `raw` if it is an object (`None` if it is not); an error if its keys do not
/// read (a lone surrogate, say), rather than leaving a key list unrenamed.
fn fields(raw: &RawValue) -> Result<Option<Fields<'_>>, String> {
    if !raw.get().starts_with('{') {
        return Ok(None);
    }
    serde_json::from_str(raw.get())
        .map(Some)
        .map_err(|e| format!("an object's keys do not read: {e}"))
}

/// `fields` with some values rewritten.
fn rewritten<'a>(fields: Fields<'a>, changed: Vec<(&str, Converted<'a>)>) -> Converted<'a> {
    let mut all: BTreeMap<String, Converted<'a>> = fields
        .into_iter()
        .map(|(k, v)| (k, Converted::Sent(v)))
        .collect();
    for (key, value) in changed {
        all.insert(key.to_owned(), value);
    }
    Converted::Object(all)
}

/// `term` with its key list under `to` instead of `from`, if it is an object holding `from`.
fn renamed<'a>(term: &'a RawValue, from: &str, to: &str) -> Result<Option<Converted<'a>>, String> {
    let Some(mut term) = fields(term)? else {
        return Ok(None);
    };
    let Some(keys) = term.remove(from) else {
        return Ok(None);
    };
    term.insert(to.to_owned(), keys);
    Ok(Some(rewritten(term, Vec::new())))
}

/// `spec` with its topology terms' key lists under `to` instead of `from`, if anything changed.
fn spec_renamed<'a>(
    spec: &'a RawValue,
    from: &str,
    to: &str,
) -> Result<Option<Converted<'a>>, String> {
    let Some(spec) = fields(spec)? else {
        return Ok(None);
    };
    let mut changed = Vec::new();
    if let Some(required) = spec.get("requiredPersistentTopology")
        && let Some(required) = renamed(required, from, to)?
    {
        changed.push(("requiredPersistentTopology", required));
    }
    if let Some(preferred) = spec.get("preferredPersistentTopology")
        && preferred.get().starts_with('[')
    {
        let terms: Vec<&RawValue> = serde_json::from_str(preferred.get())
            .map_err(|e| format!("preferredPersistentTopology does not read: {e}"))?;
        let mut any = false;
        let mut converted = Vec::with_capacity(terms.len());
        for term in terms {
            let preference = match fields(term)? {
                Some(fields) => match fields.get("preference") {
                    Some(preference) => renamed(preference, from, to)?
                        .map(|p| rewritten(fields, vec![("preference", p)])),
                    None => None,
                },
                None => None,
            };
            any |= preference.is_some();
            converted.push(preference.unwrap_or(Converted::Sent(term)));
        }
        if any {
            changed.push(("preferredPersistentTopology", Converted::Array(converted)));
        }
    }
    if changed.is_empty() {
        return Ok(None);
    }
    Ok(Some(rewritten(spec, changed)))
}

/// Converts one PersistentPodState object (its JSON text) to `desired_api_version`.
pub fn convert<'a>(
    object: &'a RawValue,
    desired_api_version: &'a str,
) -> Result<Converted<'a>, String> {
    let top = fields(object)?.ok_or("the object is not a JSON object")?;
    let from: String = top
        .get("apiVersion")
        .and_then(|v| serde_json::from_str(v.get()).ok())
        .ok_or("object has no apiVersion")?;
    let version_of = |api_version: &str| -> Result<&'static str, String> {
        let not_ours = || format!("{} is not a {KRUISE_GROUP} version", shown(api_version));
        let (group, version) = api_version.split_once('/').ok_or_else(not_ours)?;
        if group != KRUISE_GROUP {
            return Err(not_ours());
        }
        VERSIONS.into_iter().find(|v| *v == version).ok_or_else(|| {
            format!(
                "unknown version {}; served: {VERSIONS:?}",
                shown(api_version)
            )
        })
    };
    let (from_field, to_field) = (
        keys_field(version_of(&from)?).unwrap_or_default(),
        keys_field(version_of(desired_api_version)?).unwrap_or_default(),
    );
    let mut changed = vec![("apiVersion", Converted::Text(desired_api_version))];
    if from_field != to_field
        && let Some(spec) = top.get("spec")
        && let Some(spec) = spec_renamed(spec, from_field, to_field)?
    {
        changed.push(("spec", spec));
    }
    Ok(rewritten(top, changed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// [`super::convert`] of `object`'s text, as text.
    fn text(object: &RawValue, desired_api_version: &str) -> Result<String, String> {
        super::convert(object, desired_api_version)
            .map(|converted| serde_json::to_string(&converted).expect("json"))
    }

    /// [`super::convert`] of `object` as text, read back.
    fn convert(object: Value, desired_api_version: &str) -> Result<Value, String> {
        let sent = serde_json::value::to_raw_value(&object).expect("text");
        text(&sent, desired_api_version).map(|t| serde_json::from_str(&t).expect("json"))
    }

    fn alpha() -> Value {
        json!({
            "apiVersion": "apps.kruise.io/v1alpha1", "kind": "PersistentPodState",
            "metadata": {"name": "a", "namespace": "ns", "labels": {"x": "y"}},
            "spec": {
                "targetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "a"},
                "requiredPersistentTopology": {"nodeTopologyKeys": ["zone"]},
                "preferredPersistentTopology": [
                    {"weight": 100, "preference": {"nodeTopologyKeys": ["host", "rack"]}},
                    {"weight": 5, "preference": {"nodeTopologyKeys": ["other"]}}
                ],
                "persistentPodAnnotations": [{"key": "k"}],
                "persistentPodStateRetentionPolicy": "WhenDeleted",
                "someFutureField": {"kept": true}
            },
            "status": {"observedGeneration": 3, "podStates": {"a-0": {"nodeName": "n",
                "nodeTopologyLabels": {"zone": "z"}, "annotations": {"k": "v"}}}}
        })
    }

    #[test]
    fn renames_every_key_list_and_nothing_else() {
        let beta = convert(alpha(), "apps.kruise.io/v1beta1").expect("converts");
        assert_eq!(beta["apiVersion"], "apps.kruise.io/v1beta1");
        assert_eq!(
            beta["spec"]["requiredPersistentTopology"],
            json!({"keys": ["zone"]})
        );
        assert_eq!(
            beta["spec"]["preferredPersistentTopology"][0]["preference"],
            json!({"keys": ["host", "rack"]})
        );
        assert_eq!(beta["spec"]["preferredPersistentTopology"][1]["weight"], 5);
        assert_eq!(
            beta["spec"]["someFutureField"],
            alpha()["spec"]["someFutureField"]
        );
        assert_eq!(beta["status"], alpha()["status"]);
        assert_eq!(beta["metadata"], alpha()["metadata"]);
    }

    #[test]
    fn a_round_trip_loses_nothing() {
        let beta = convert(alpha(), "apps.kruise.io/v1beta1").expect("to beta");
        assert_eq!(
            convert(beta, "apps.kruise.io/v1alpha1").expect("back"),
            alpha()
        );
        let same = convert(alpha(), "apps.kruise.io/v1alpha1").expect("same version");
        assert_eq!(same, alpha());
    }

    #[test]
    fn minimal_and_odd_objects_convert_or_fail_clearly() {
        let bare = json!({"apiVersion": "apps.kruise.io/v1beta1", "kind": "PersistentPodState", "metadata": {"name": "a"}});
        assert_eq!(
            convert(bare.clone(), "apps.kruise.io/v1alpha1").expect("converts")["metadata"],
            bare["metadata"]
        );
        let odd = json!({"apiVersion": "apps.kruise.io/v1beta1", "spec": {"requiredPersistentTopology": 5, "preferredPersistentTopology": [1, {"preference": null}]}});
        assert!(convert(odd, "apps.kruise.io/v1alpha1").is_ok());
        for (obj, to) in [
            (json!({"kind": "X"}), "apps.kruise.io/v1beta1"),
            (alpha(), "apps.kruise.io/v2"),
            (alpha(), "apps/v1"),
            (json!({"apiVersion": "v1"}), "apps.kruise.io/v1beta1"),
        ] {
            assert!(convert(obj, to).is_err(), "{to}");
        }
    }

    /// The status, the metadata and fields this server does not know come back as they were
    /// sent, byte for byte: even what serde_json would not decode (a lone surrogate, a number
    /// out of range), which the API server's own decoder reads.
    #[test]
    fn only_what_differs_between_versions_is_rewritten() {
        let status = r#""status":{"podStates":{"a-0":{"nodeName":"n 1.0"}},"big":123456789012345678901234567890}"#;
        let metadata = r#""metadata":{"name":"a","annotations":{"x":"\ud800"}}"#;
        let sent = format!(
            r#"{{"apiVersion":"apps.kruise.io/v1alpha1","kind":"PersistentPodState",{metadata},"spec":{{"requiredPersistentTopology":{{"nodeTopologyKeys":["zone"]}},"n":1e400,"preferredPersistentTopology":[7,{{"weight":1,"preference":{{"nodeTopologyKeys":["host"]}}}}]}},{status}}}"#
        );
        let object = RawValue::from_string(sent).expect("raw");
        let beta = text(&object, "apps.kruise.io/v1beta1").expect("converts");
        for kept in [
            status,
            metadata,
            r#""n":1e400"#,
            r#""requiredPersistentTopology":{"keys":["zone"]}"#,
            r#""preferredPersistentTopology":[7,{"preference":{"keys":["host"]},"weight":1}]"#,
            r#""apiVersion":"apps.kruise.io/v1beta1""#,
        ] {
            assert!(beta.contains(kept), "{kept} in {beta}");
        }
        let beta = RawValue::from_string(beta).expect("raw");
        let back = text(&beta, "apps.kruise.io/v1alpha1").expect("back");
        assert!(back.contains(r#""requiredPersistentTopology":{"nodeTopologyKeys":["zone"]}"#));
        assert!(back.contains(status) && back.contains(metadata));
        for not_an_object in ["7", "[]", "null", r#""x""#] {
            let raw = RawValue::from_string(not_an_object.to_owned()).expect("raw");
            assert!(super::convert(&raw, "apps.kruise.io/v1beta1").is_err());
        }
        // A key list is never left unrenamed: keys that do not read fail the conversion.
        let unreadable = r#"{"apiVersion":"apps.kruise.io/v1alpha1","spec":{"requiredPersistentTopology":{"\ud800":1,"nodeTopologyKeys":["zone"]}}}"#;
        let raw = RawValue::from_string(unreadable.to_owned()).expect("raw");
        let error = super::convert(&raw, "apps.kruise.io/v1beta1").expect_err("unreadable key");
        assert!(error.contains("keys do not read"), "{error}");
        // An echoed version is cut short in the message.
        let long = format!("apps.kruise.io/{}", "v".repeat(100_000));
        let error = super::convert(&object, &long).expect_err("unknown version");
        assert!(error.len() < 200, "{error}");
    }
}
