//! Reading policies and runtimes from YAML manifests: `ServingPolicy`, and the apiserver's own
//! `ValidatingAdmissionPolicy` (+ `…Binding` for its `validationActions`) and
//! `MutatingAdmissionPolicy`, converted field for field into ServingPolicies so they can be
//! tested offline.

use std::path::{Path, PathBuf};

use hearth_crds::{InferenceRuntime, LLMService, ServingPolicy, servingpolicy::ServingPolicySpec};
use serde::Deserialize;
use serde_json::Value;

/// A manifest that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A document is not valid YAML or not a valid object of its kind.
    #[error("{path}: document {index}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// 0-based document index in the file.
        index: usize,
        /// What is wrong.
        message: String,
    },
}

/// Everything read from a set of manifests.
#[derive(Debug, Default, Clone)]
pub struct Bundle {
    /// ServingPolicies, and converted admission policies, in file order.
    pub policies: Vec<ServingPolicy>,
    /// InferenceRuntimes.
    pub runtimes: Vec<InferenceRuntime>,
    /// LLMServices.
    pub services: Vec<LLMService>,
    /// Every other object (the resources under test).
    pub objects: Vec<Value>,
}

/// Reads every YAML document of `text` (from `path`, for messages) into `bundle`.
pub fn read_str(text: &str, path: &Path, bundle: &mut Bundle) -> Result<(), ManifestError> {
    let invalid = |index: usize, message: String| ManifestError::Invalid {
        path: path.to_owned(),
        index,
        message,
    };
    let mut bindings: Vec<(String, Vec<Value>)> = Vec::new();
    for (index, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let v = Value::deserialize(doc).map_err(|e| invalid(index, e.to_string()))?;
        if v.is_null() {
            continue;
        }
        let kind = v
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let kind = kind.as_str();
        match kind {
            "ServingPolicy" => bundle
                .policies
                .push(strict(v, kind).map_err(|m| invalid(index, m))?),
            "InferenceRuntime" => bundle
                .runtimes
                .push(strict(v, kind).map_err(|m| invalid(index, m))?),
            "LLMService" => bundle
                .services
                .push(strict(v, kind).map_err(|m| invalid(index, m))?),
            "ValidatingAdmissionPolicy" | "MutatingAdmissionPolicy" => bundle
                .policies
                .push(from_admission_policy(&v).map_err(|m| invalid(index, m))?),
            "ValidatingAdmissionPolicyBinding" => {
                let policy = v
                    .pointer("/spec/policyName")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let actions = v
                    .pointer("/spec/validationActions")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                bindings.push((policy, actions));
            }
            "MutatingAdmissionPolicyBinding" => {}
            _ => bundle.objects.push(v),
        }
    }
    for (policy, actions) in bindings {
        if let Some(p) = bundle
            .policies
            .iter_mut()
            .find(|p| p.metadata.name.as_deref() == Some(&policy))
            && !actions.is_empty()
        {
            p.spec.validation_actions =
                serde_json::from_value(Value::Array(actions)).map_err(|e| {
                    invalid(
                        0,
                        format!("binding of {policy}: invalid validationActions: {e}"),
                    )
                })?;
        }
    }
    Ok(())
}

/// A Hearth object from its manifest, refusing fields the type does not have: offline there is
/// no apiserver to reject a misspelled `validation:` (kubectl's strict field validation), and
/// a policy that silently lost its validations would pass its tests.
fn strict<T: serde::de::DeserializeOwned>(v: Value, kind: &str) -> Result<T, String> {
    let mut unknown = Vec::new();
    let typed = serde_ignored::deserialize(v, |path| unknown.push(path.to_string()))
        .map_err(|e| format!("invalid {kind}: {e}"))?;
    // The type carries apiVersion and kind in its own impl, not as fields.
    unknown.retain(|p| p != "apiVersion" && p != "kind");
    if unknown.is_empty() {
        Ok(typed)
    } else {
        Err(format!(
            "invalid {kind}: unknown field{} {}: check the spelling against the {kind} fields (docs/policies.md, or `kubectl explain {}`)",
            if unknown.len() == 1 { "" } else { "s" },
            unknown.join(", "),
            kind.to_lowercase()
        ))
    }
}

/// Converts a `ValidatingAdmissionPolicy` or `MutatingAdmissionPolicy` into a ServingPolicy:
/// the shared fields carry over unchanged; `paramKind`/`paramRef` are dropped because
/// `params` is always the resolved InferenceRuntime here.
pub fn from_admission_policy(v: &Value) -> Result<ServingPolicy, String> {
    let kind = v.get("kind").and_then(Value::as_str).unwrap_or_default();
    let mut spec = v
        .get("spec")
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    if let Some(m) = spec.as_object_mut() {
        m.remove("paramKind");
        m.remove("paramRef");
    }
    let spec: ServingPolicySpec =
        serde_json::from_value(spec).map_err(|e| format!("invalid {kind} spec: {e}"))?;
    let mut p = ServingPolicy::new(
        v.pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default(),
        spec,
    );
    p.metadata.labels = v
        .pointer("/metadata/labels")
        .and_then(|l| serde_json::from_value(l.clone()).ok());
    Ok(p)
}

/// Reads a file, or every `*.yaml`/`*.yml` file directly in a directory (sorted; not
/// recursive, so test fixtures in sub-directories stay out of a policy directory).
pub fn read_path(path: &Path, bundle: &mut Bundle) -> Result<(), ManifestError> {
    let io = |source| ManifestError::Io {
        path: path.to_owned(),
        source,
    };
    if path.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for p in entries {
            let yaml = p.extension().is_some_and(|e| e == "yaml" || e == "yml");
            if p.is_file() && yaml {
                read_path(&p, bundle)?;
            }
        }
        Ok(())
    } else {
        let text = std::fs::read_to_string(path).map_err(io)?;
        read_str(&text, path, bundle)
    }
}

/// The JSON `params` binding of a runtime: the typed object re-serialized, so defaulted
/// fields (`family`, `port`, `priority`) are present.
pub fn runtime_params(rt: &InferenceRuntime) -> Value {
    serde_json::to_value(rt).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Bundle, ManifestError> {
        let mut b = Bundle::default();
        read_str(text, Path::new("t.yaml"), &mut b).map(|()| b)
    }

    #[test]
    fn a_misspelled_field_is_an_error_naming_it() {
        let e = read(
            "apiVersion: serving.hearth.dev/v1alpha1\nkind: ServingPolicy\nmetadata: {name: p}\n\
             spec:\n  validation:\n    - expression: 'true'\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("unknown field spec.validation"), "{e}");
        let e = read(
            "apiVersion: serving.hearth.dev/v1alpha1\nkind: ServingPolicy\nmetadata: {name: p}\n\
             spec:\n  validations:\n    - expression: 'false'\n      mesage: no\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("spec.validations.0.mesage"), "{e}");
    }

    #[test]
    fn known_fields_load() {
        let b = read(
            "apiVersion: serving.hearth.dev/v1alpha1\nkind: ServingPolicy\nmetadata: {name: p, labels: {a: b}}\n\
             spec:\n  failurePolicy: Ignore\n  validations:\n    - expression: 'true'\n      message: m\n",
        )
        .unwrap();
        assert_eq!(b.policies.len(), 1);
    }
}
