//! Conversion between the served versions, on the JSON text as sent: only what differs
//! between the versions is decoded (the object's own keys, its spec's and its topology
//! terms'), and every other value (metadata, status, fields this version does not know) is
//! copied byte for byte, so that nothing the schema of one version holds is lost on the way
//! through the other (`nodeTopologyKeys` <-> `keys`), and an object recording thousands of
//! pods costs what its spec does.

use std::collections::BTreeMap;

use serde_json::value::{RawValue, to_raw_value};

use super::{KRUISE_GROUP, VERSIONS, keys_field};

/// An object's fields, their values kept as text.
type Fields<'a> = BTreeMap<String, &'a RawValue>;

/// The fields of `raw`, if it is an object.
fn fields(raw: &RawValue) -> Option<Fields<'_>> {
    serde_json::from_str(raw.get()).ok()
}

/// `fields` as JSON text, with the values of `changed` in place of theirs.
fn written(
    fields: &Fields<'_>,
    changed: &[(&str, Box<RawValue>)],
) -> Result<Box<RawValue>, String> {
    let mut all: BTreeMap<&str, &RawValue> = fields.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    for (key, value) in changed {
        all.insert(key, value);
    }
    to_raw_value(&all).map_err(|e| e.to_string())
}

/// `term` with its key list under `to` instead of `from`, if it is an object holding `from`.
fn renamed(term: &RawValue, from: &str, to: &str) -> Result<Option<Box<RawValue>>, String> {
    let Some(mut term) = fields(term) else {
        return Ok(None);
    };
    let Some(keys) = term.remove(from) else {
        return Ok(None);
    };
    term.insert(to.to_owned(), keys);
    written(&term, &[]).map(Some)
}

/// `spec` with its topology terms' key lists under `to` instead of `from`, if anything changed.
fn spec_renamed(spec: &RawValue, from: &str, to: &str) -> Result<Option<Box<RawValue>>, String> {
    let Some(spec) = fields(spec) else {
        return Ok(None);
    };
    let mut changed = Vec::new();
    if let Some(required) = spec.get("requiredPersistentTopology")
        && let Some(required) = renamed(required, from, to)?
    {
        changed.push(("requiredPersistentTopology", required));
    }
    if let Some(preferred) = spec.get("preferredPersistentTopology")
        && let Ok(terms) = serde_json::from_str::<Vec<&RawValue>>(preferred.get())
    {
        let mut any = false;
        let terms = terms
            .into_iter()
            .map(|term| {
                let Some(fields) = fields(term) else {
                    return Ok(term.to_owned());
                };
                let Some(preference) = fields.get("preference") else {
                    return Ok(term.to_owned());
                };
                match renamed(preference, from, to)? {
                    Some(preference) => {
                        any = true;
                        written(&fields, &[("preference", preference)])
                    }
                    None => Ok(term.to_owned()),
                }
            })
            .collect::<Result<Vec<_>, String>>()?;
        if any {
            let terms = to_raw_value(&terms).map_err(|e| e.to_string())?;
            changed.push(("preferredPersistentTopology", terms));
        }
    }
    if changed.is_empty() {
        return Ok(None);
    }
    written(&spec, &changed).map(Some)
}

/// Converts one PersistentPodState object (its JSON text) to `desired_api_version`.
pub fn convert(object: &RawValue, desired_api_version: &str) -> Result<Box<RawValue>, String> {
    let top = fields(object).ok_or("the object is not a JSON object")?;
    let from: String = top
        .get("apiVersion")
        .and_then(|v| serde_json::from_str(v.get()).ok())
        .ok_or("object has no apiVersion")?;
    let version_of = |api_version: &str| -> Result<&'static str, String> {
        let (group, version) = api_version
            .split_once('/')
            .ok_or_else(|| format!("{api_version:?} is not a {KRUISE_GROUP} version"))?;
        if group != KRUISE_GROUP {
            return Err(format!("{api_version:?} is not a {KRUISE_GROUP} version"));
        }
        VERSIONS
            .into_iter()
            .find(|v| *v == version)
            .ok_or_else(|| format!("unknown version {api_version:?}; served: {VERSIONS:?}"))
    };
    let (from_field, to_field) = (
        keys_field(version_of(&from)?).unwrap_or_default(),
        keys_field(version_of(desired_api_version)?).unwrap_or_default(),
    );
    let api_version = to_raw_value(desired_api_version).map_err(|e| e.to_string())?;
    let mut changed = vec![("apiVersion", api_version)];
    if from_field != to_field
        && let Some(spec) = top.get("spec")
        && let Some(spec) = spec_renamed(spec, from_field, to_field)?
    {
        changed.push(("spec", spec));
    }
    written(&top, &changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// [`super::convert`] of `object` as text, read back.
    fn convert(object: Value, desired_api_version: &str) -> Result<Value, String> {
        let text = to_raw_value(&object).expect("text");
        super::convert(&text, desired_api_version)
            .map(|converted| serde_json::from_str(converted.get()).expect("json"))
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
        let text = format!(
            r#"{{"apiVersion":"apps.kruise.io/v1alpha1","kind":"PersistentPodState",{metadata},"spec":{{"requiredPersistentTopology":{{"nodeTopologyKeys":["zone"]}},"n":1e400,"preferredPersistentTopology":[7,{{"weight":1,"preference":{{"nodeTopologyKeys":["host"]}}}}]}},{status}}}"#
        );
        let object = RawValue::from_string(text).expect("raw");
        let beta = super::convert(&object, "apps.kruise.io/v1beta1").expect("converts");
        for kept in [
            status,
            metadata,
            r#""n":1e400"#,
            r#""requiredPersistentTopology":{"keys":["zone"]}"#,
            r#""preferredPersistentTopology":[7,{"preference":{"keys":["host"]},"weight":1}]"#,
            r#""apiVersion":"apps.kruise.io/v1beta1""#,
        ] {
            assert!(beta.get().contains(kept), "{kept} in {}", beta.get());
        }
        let back = super::convert(&beta, "apps.kruise.io/v1alpha1").expect("back");
        assert!(
            back.get()
                .contains(r#""requiredPersistentTopology":{"nodeTopologyKeys":["zone"]}"#)
        );
        assert!(back.get().contains(status) && back.get().contains(metadata));
        for not_an_object in ["7", "[]", "null", r#""x""#] {
            let raw = RawValue::from_string(not_an_object.to_owned()).expect("raw");
            assert!(super::convert(&raw, "apps.kruise.io/v1beta1").is_err());
        }
    }
}
