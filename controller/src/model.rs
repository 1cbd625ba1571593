//! Model sources and where the engine finds the weights (`{{ .Model.Path }}`).
//!
//! | source | cache | `.Model.Path` | engine environment |
//! |---|---|---|---|
//! | `hf://org/name` | NodeLocalPVC, HostPath | `org/name` | `HF_HOME=/models/hf` (cache mount; upstream Hearth's layout inside the claim) |
//! | `hf://org/name` | None | `org/name` | image default (`~/.cache/huggingface`, not kept) |
//! | `modelscope://org/name` | NodeLocalPVC, HostPath | `org/name` | `VLLM_USE_MODELSCOPE=True`, `MODELSCOPE_CACHE=/models/modelscope` |
//! | `modelscope://org/name` | None | `org/name` | `VLLM_USE_MODELSCOPE=True` |
//! | `pvc://claim[/sub]` | (ignored) | `/models/sub` (claim mounted read-only at `/models`) | — |
//!
//! Why the repository id rather than a directory: vLLM resolves a repository id through the hub
//! library's cache (`HF_HOME`, or ModelScope's `MODELSCOPE_CACHE`). The prewarm Job runs that same
//! library (`snapshot_download`) in the runtime image with the same environment and the same
//! mount, so the engine finds exactly the files the Job wrote, and a backend that starts before
//! (or without) a prewarm still works: it downloads into the cache itself.

use hearth_crds::model_uri::{UriError, parse_model_uri};

/// Where cache volumes are mounted in backend and prewarm containers.
pub const CACHE_MOUNT_PATH: &str = "/models";
/// `HF_HOME` under the cache mount: the `hf` directory of the cache, where upstream Hearth puts
/// it too, so an adopted upstream cache claim is read as it is.
pub const HF_HOME: &str = "/models/hf";
/// `MODELSCOPE_CACHE` under the cache mount.
pub const MODELSCOPE_CACHE: &str = "/models/modelscope";

/// A parsed `spec.model.source.uri`: the shared type of `hearth_crds::model_uri`, so the
/// webhook's and the controller's reading of a URI cannot drift.
pub use hearth_crds::model_uri::ModelUri as ModelSource;

/// Why a model URI was rejected. Messages name `spec.model.source.uri` and say what to write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// Only `catalogRef` was set.
    #[error(
        "spec.model.catalogRef: model catalogs are not implemented; set spec.model.source.uri (for example hf://Qwen/Qwen2.5-0.5B-Instruct)"
    )]
    CatalogNotImplemented,
    /// Neither source nor catalogRef.
    #[error("spec.model.source.uri is required (for example hf://Qwen/Qwen2.5-0.5B-Instruct)")]
    Missing,
    /// A URI the shared parser (`hearth_crds::model_uri`) rejects.
    #[error("spec.model.source.uri {uri:?} {source}")]
    Uri {
        /// The URI as written.
        uri: String,
        /// What is wrong and what to write instead.
        source: UriError,
    },
}

/// Parses `spec.model.source.uri` (or reports the catalog/missing cases).
pub fn parse_source(model: &hearth_crds::llmservice::ModelSpec) -> Result<ModelSource, ModelError> {
    let Some(source) = &model.source else {
        return Err(if model.catalog_ref.is_some() {
            ModelError::CatalogNotImplemented
        } else {
            ModelError::Missing
        });
    };
    parse_uri(&source.uri)
}

/// Parses one model URI with the rules the admission webhook applies
/// (`hearth_crds::model_uri`), into where the controller mounts and finds the weights.
pub fn parse_uri(uri: &str) -> Result<ModelSource, ModelError> {
    parse_model_uri(uri).map_err(|source| ModelError::Uri {
        uri: uri.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_scheme() {
        assert_eq!(
            parse_uri("hf://Qwen/Qwen2.5-0.5B-Instruct").unwrap(),
            ModelSource::HuggingFace {
                repo: "Qwen/Qwen2.5-0.5B-Instruct".into()
            }
        );
        assert_eq!(
            parse_uri("modelscope://Qwen/Qwen2.5-7B-Instruct").unwrap(),
            ModelSource::ModelScope {
                repo: "Qwen/Qwen2.5-7B-Instruct".into()
            }
        );
        assert_eq!(
            parse_uri("pvc://weights/qwen/7b").unwrap(),
            ModelSource::Pvc {
                claim: "weights".into(),
                subpath: Some("qwen/7b".into())
            }
        );
        assert_eq!(
            parse_uri("pvc://weights").unwrap(),
            ModelSource::Pvc {
                claim: "weights".into(),
                subpath: None
            }
        );
    }

    #[test]
    fn rejects_bad_uris_with_the_field_name() {
        for bad in [
            "s3://bucket/model",
            "hf://a/b/c",
            "hf://../etc",
            "pvc://Weights",
            "pvc://w/../../etc",
            "pvc:///x",
            "modelscope://a/b c",
        ] {
            let err = parse_uri(bad).unwrap_err();
            assert!(
                err.to_string().starts_with("spec.model.source.uri"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn display_round_trips() {
        for uri in ["hf://a/b", "modelscope://a/b", "pvc://c", "pvc://c/d/e"] {
            assert_eq!(parse_uri(uri).unwrap().to_string(), uri);
        }
    }
}
