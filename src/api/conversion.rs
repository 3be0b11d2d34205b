//! Conversion between the served versions, on raw JSON so that nothing the schema of one
//! version holds is lost on the way through the other (`nodeTopologyKeys` <-> `keys`).

use serde_json::Value;

use super::{KRUISE_GROUP, VERSIONS, keys_field};

fn rename(term: Option<&mut Value>, from: &str, to: &str) {
    if let Some(Value::Object(map)) = term
        && let Some(keys) = map.remove(from)
    {
        map.insert(to.to_owned(), keys);
    }
}

/// Converts one PersistentPodState object to `desired_api_version`.
pub fn convert(mut object: Value, desired_api_version: &str) -> Result<Value, String> {
    let from = object
        .get("apiVersion")
        .and_then(Value::as_str)
        .ok_or("object has no apiVersion")?
        .to_owned();
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
    if from_field != to_field
        && let Some(spec) = object.get_mut("spec")
    {
        rename(
            spec.get_mut("requiredPersistentTopology"),
            from_field,
            to_field,
        );
        if let Some(Value::Array(terms)) = spec.get_mut("preferredPersistentTopology") {
            for term in terms {
                rename(term.get_mut("preference"), from_field, to_field);
            }
        }
    }
    if let Value::Object(map) = &mut object {
        map.insert(
            "apiVersion".into(),
            Value::String(desired_api_version.to_owned()),
        );
    }
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
}
