//! Model sources and where the engine finds the weights (`{{ .Model.Path }}`).
//!
//! | source | cache | `.Model.Path` | engine environment |
//! |---|---|---|---|
//! | `hf://org/name` | NodeLocalPVC, HostPath | `org/name` | `HF_HOME=/models/huggingface` (cache mount) |
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

use std::fmt;

/// Where cache volumes are mounted in backend and prewarm containers.
pub const CACHE_MOUNT_PATH: &str = "/models";
/// `HF_HOME` under the cache mount.
pub const HF_HOME: &str = "/models/huggingface";
/// `MODELSCOPE_CACHE` under the cache mount.
pub const MODELSCOPE_CACHE: &str = "/models/modelscope";

/// A parsed `spec.model.source.uri`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// `hf://<org>/<name>`: a Hugging Face Hub repository.
    HuggingFace {
        /// `org/name`.
        repo: String,
    },
    /// `modelscope://<org>/<name>`: a ModelScope repository.
    ModelScope {
        /// `org/name`.
        repo: String,
    },
    /// `pvc://<claim>[/<subpath>]`: pre-staged weights on an existing claim.
    Pvc {
        /// The PersistentVolumeClaim name, in the `LLMService` namespace.
        claim: String,
        /// The directory inside the claim, empty for its root.
        subpath: String,
    },
}

impl fmt::Display for ModelSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelSource::HuggingFace { repo } => write!(f, "hf://{repo}"),
            ModelSource::ModelScope { repo } => write!(f, "modelscope://{repo}"),
            ModelSource::Pvc { claim, subpath } if subpath.is_empty() => write!(f, "pvc://{claim}"),
            ModelSource::Pvc { claim, subpath } => write!(f, "pvc://{claim}/{subpath}"),
        }
    }
}

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
    /// A scheme other than hf, modelscope, pvc.
    #[error(
        "spec.model.source.uri {0:?}: unsupported scheme; use hf://<org>/<name>, modelscope://<org>/<name> or pvc://<claim>[/<path>]"
    )]
    Scheme(String),
    /// A malformed repository id.
    #[error(
        "spec.model.source.uri {0:?}: the repository must be <org>/<name> (letters, digits, '-', '_', '.'), like hf://Qwen/Qwen2.5-0.5B-Instruct"
    )]
    Repo(String),
    /// A malformed claim name or path.
    #[error(
        "spec.model.source.uri {0:?}: write pvc://<claim>[/<path>] with a DNS-1123 claim name and a relative path without '..'"
    )]
    Pvc(String),
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

/// Parses one model URI.
pub fn parse_uri(uri: &str) -> Result<ModelSource, ModelError> {
    if let Some(repo) = uri.strip_prefix("hf://") {
        check_repo(uri, repo)?;
        Ok(ModelSource::HuggingFace {
            repo: repo.to_owned(),
        })
    } else if let Some(repo) = uri.strip_prefix("modelscope://") {
        check_repo(uri, repo)?;
        Ok(ModelSource::ModelScope {
            repo: repo.to_owned(),
        })
    } else if let Some(rest) = uri.strip_prefix("pvc://") {
        let (claim, subpath) = rest.split_once('/').unwrap_or((rest, ""));
        let subpath = subpath.trim_end_matches('/');
        let claim_ok = !claim.is_empty()
            && claim.len() <= 253
            && claim
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && claim.as_bytes()[0].is_ascii_alphanumeric()
            && claim.as_bytes()[claim.len() - 1].is_ascii_alphanumeric();
        let path_ok = subpath
            .split('/')
            .all(|seg| subpath.is_empty() || (!seg.is_empty() && seg != ".." && seg != "."));
        if !claim_ok || !path_ok {
            return Err(ModelError::Pvc(uri.to_owned()));
        }
        Ok(ModelSource::Pvc {
            claim: claim.to_owned(),
            subpath: subpath.to_owned(),
        })
    } else {
        Err(ModelError::Scheme(uri.to_owned()))
    }
}

fn check_repo(uri: &str, repo: &str) -> Result<(), ModelError> {
    let segments: Vec<&str> = repo.split('/').collect();
    let ok = segments.len() == 2
        && segments.iter().all(|s| {
            !s.is_empty()
                && *s != "."
                && *s != ".."
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        });
    if ok {
        Ok(())
    } else {
        Err(ModelError::Repo(uri.to_owned()))
    }
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
                subpath: "qwen/7b".into()
            }
        );
        assert_eq!(
            parse_uri("pvc://weights").unwrap(),
            ModelSource::Pvc {
                claim: "weights".into(),
                subpath: String::new()
            }
        );
    }

    #[test]
    fn rejects_bad_uris_with_the_field_name() {
        for bad in [
            "s3://bucket/model",
            "hf://just-a-name",
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
