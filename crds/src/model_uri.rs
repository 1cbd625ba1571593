//! Model URIs of `LLMService.spec.model.source.uri`: `hf://<org>/<name>` (or its alias
//! `huggingface://<org>/<name>`),
//! `modelscope://<org>/<name>` and `pvc://<claim>[/<subpath>]`.
//!
//! The subpath of a `pvc://` URI becomes a `volumeMounts[].subPath`, so it must stay inside the
//! claim: absolute paths, `..` and `.` segments, empty segments, backslashes, `%` escapes and
//! control characters are rejected (the kubelet rejects `..` in subPath too, but only when the
//! pod starts, long after the user has left).

use std::fmt;

/// Longest accepted URI, in bytes (the CRD's `maxLength`).
pub const MAX_URI_LEN: usize = 2048;

/// A parsed model location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelUri {
    /// A Hugging Face Hub repository, `<org>/<name>` (or a bare `<name>` for legacy repos).
    HuggingFace {
        /// Repository id as given.
        repo: String,
    },
    /// A ModelScope repository, `<org>/<name>`.
    ModelScope {
        /// Repository id as given.
        repo: String,
    },
    /// Pre-staged weights on an existing PersistentVolumeClaim in the service's namespace.
    Pvc {
        /// The claim name (a DNS-1123 subdomain).
        claim: String,
        /// Directory inside the claim, relative and normalised; `None` for the claim's root.
        subpath: Option<String>,
    },
}

/// Why a model URI was rejected; the message says what is allowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UriError {
    /// The URI is empty.
    #[error(
        "is empty; set it to hf://<org>/<name>, modelscope://<org>/<name> or pvc://<claim>[/<subpath>]"
    )]
    Empty,
    /// Longer than [`MAX_URI_LEN`].
    #[error("is {0} bytes long; at most {MAX_URI_LEN} are allowed")]
    TooLong(usize),
    /// A scheme other than the three supported ones.
    #[error(
        "has unsupported scheme {0:?}; use hf://<org>/<name>, modelscope://<org>/<name> or pvc://<claim>[/<subpath>]"
    )]
    Scheme(String),
    /// No `scheme://` prefix.
    #[error(
        "{0:?} has no scheme; write hf://{0} for a Hugging Face repository, or use modelscope:// or pvc://"
    )]
    NoScheme(String),
    /// A repository id that is not `<org>/<name>`.
    #[error("repository {repo:?} is not a valid {hub} id: {why}")]
    Repo {
        /// Which hub.
        hub: &'static str,
        /// The id as given.
        repo: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// An invalid claim name.
    #[error(
        "claim {0:?} is not a valid PersistentVolumeClaim name (lowercase letters, digits, '-' and '.', at most 253, starting and ending alphanumeric)"
    )]
    Claim(String),
    /// A subpath that could leave the claim or is otherwise unsafe.
    #[error(
        "subpath {path:?} {why}; give a relative directory inside the claim such as pvc://{claim}/models/qwen"
    )]
    Subpath {
        /// The claim name.
        claim: String,
        /// The subpath as given.
        path: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

impl fmt::Display for ModelUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::HuggingFace { repo } => write!(f, "hf://{repo}"),
            Self::ModelScope { repo } => write!(f, "modelscope://{repo}"),
            Self::Pvc {
                claim,
                subpath: None,
            } => write!(f, "pvc://{claim}"),
            Self::Pvc {
                claim,
                subpath: Some(p),
            } => write!(f, "pvc://{claim}/{p}"),
        }
    }
}

/// Parses and checks a model URI. Errors say what is wrong and what to write instead.
pub fn parse_model_uri(uri: &str) -> Result<ModelUri, UriError> {
    if uri.is_empty() {
        return Err(UriError::Empty);
    }
    if uri.len() > MAX_URI_LEN {
        return Err(UriError::TooLong(uri.len()));
    }
    let Some((scheme, rest)) = uri.split_once("://") else {
        return Err(UriError::NoScheme(uri.to_owned()));
    };
    match scheme {
        // huggingface:// is upstream Hearth's alias of hf://.
        "hf" | "huggingface" => {
            repo("Hugging Face", rest, true).map(|repo| ModelUri::HuggingFace { repo })
        }
        "modelscope" => repo("ModelScope", rest, false).map(|repo| ModelUri::ModelScope { repo }),
        "pvc" => pvc(rest),
        other => Err(UriError::Scheme(other.to_owned())),
    }
}

/// Hub ids follow the Hugging Face rules (`huggingface_hub.utils.validate_repo_id`): segments of
/// `[A-Za-z0-9._-]`, no `--` or `..`, not starting or ending with `-` or `.`, at most 96 chars.
fn repo(hub: &'static str, id: &str, bare_name_ok: bool) -> Result<String, UriError> {
    let err = |why| UriError::Repo {
        hub,
        repo: id.to_owned(),
        why,
    };
    let segments: Vec<&str> = id.split('/').collect();
    match segments.len() {
        1 if bare_name_ok => {}
        2 => {}
        _ => return Err(err("write it as <org>/<name>")),
    }
    for s in &segments {
        if s.is_empty() {
            return Err(err("an org or name is empty"));
        }
        if s.len() > 96 {
            return Err(err("an org or name exceeds 96 characters"));
        }
        if !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(err("only letters, digits, '.', '_' and '-' are allowed"));
        }
        if s.contains("..") || s.contains("--") {
            return Err(err("'..' and '--' are not allowed"));
        }
        if s.starts_with(['.', '-']) || s.ends_with(['.', '-']) {
            return Err(err("an org or name starts or ends with '.' or '-'"));
        }
    }
    Ok(id.to_owned())
}

fn pvc(rest: &str) -> Result<ModelUri, UriError> {
    let (claim, path) = match rest.split_once('/') {
        Some((c, p)) => (c, Some(p)),
        None => (rest, None),
    };
    if !is_dns1123_subdomain(claim) {
        return Err(UriError::Claim(claim.to_owned()));
    }
    let Some(path) = path else {
        return Ok(ModelUri::Pvc {
            claim: claim.to_owned(),
            subpath: None,
        });
    };
    let err = |why| UriError::Subpath {
        claim: claim.to_owned(),
        path: path.to_owned(),
        why,
    };
    // A trailing slash is harmless (`pvc://c/models/`); anything else empty is suspicious.
    let trimmed = path.strip_suffix('/').unwrap_or(path);
    if trimmed.is_empty() {
        return if path.is_empty() {
            Ok(ModelUri::Pvc {
                claim: claim.to_owned(),
                subpath: None,
            })
        } else {
            Err(err("is absolute"))
        };
    }
    if trimmed.starts_with('/') {
        return Err(err("is absolute"));
    }
    if trimmed.contains('\\') {
        return Err(err("contains a backslash"));
    }
    if trimmed.contains('%') {
        return Err(err("contains a '%' escape, which could hide '..'"));
    }
    if trimmed.chars().any(char::is_control) {
        return Err(err("contains a control character"));
    }
    for seg in trimmed.split('/') {
        match seg {
            "" => return Err(err("has an empty segment ('//')")),
            "." => return Err(err("has a '.' segment")),
            ".." => return Err(err("has a '..' segment, which would leave the claim")),
            _ => {}
        }
    }
    Ok(ModelUri::Pvc {
        claim: claim.to_owned(),
        subpath: Some(trimmed.to_owned()),
    })
}

/// RFC 1123 subdomain as Kubernetes checks object names; see [`crate::naming`].
pub use crate::naming::is_dns1123_subdomain;

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("hf://Qwen/Qwen2.5-0.5B-Instruct", "hf://Qwen/Qwen2.5-0.5B-Instruct")]
    #[case("hf://gpt2", "hf://gpt2")]
    #[case(
        "huggingface://Qwen/Qwen2.5-0.5B-Instruct",
        "hf://Qwen/Qwen2.5-0.5B-Instruct"
    )]
    #[case(
        "modelscope://Qwen/Qwen2.5-7B-Instruct",
        "modelscope://Qwen/Qwen2.5-7B-Instruct"
    )]
    #[case("pvc://weights", "pvc://weights")]
    #[case("pvc://weights/", "pvc://weights")]
    #[case("pvc://weights/models/qwen", "pvc://weights/models/qwen")]
    #[case("pvc://weights/models/qwen/", "pvc://weights/models/qwen")]
    #[case("pvc://my.claim/a..b", "pvc://my.claim/a..b")]
    fn accepts(#[case] input: &str, #[case] normalised: &str) {
        assert_eq!(parse_model_uri(input).unwrap().to_string(), normalised);
    }

    #[rstest]
    #[case("", "is empty")]
    #[case("s3://bucket/model", "unsupported scheme \"s3\"")]
    #[case("Qwen/Qwen2.5", "has no scheme")]
    #[case("hf://", "is empty")]
    #[case("hf://a/b/c", "<org>/<name>")]
    #[case("hf://../etc", "'..' and '--'")]
    #[case("hf://org/-x", "starts or ends")]
    #[case("hf://org/na me", "only letters")]
    #[case("modelscope://single", "<org>/<name>")]
    #[case("pvc://Weights", "not a valid PersistentVolumeClaim name")]
    #[case("pvc://", "not a valid PersistentVolumeClaim name")]
    #[case("pvc://w/../etc", "'..' segment")]
    #[case("pvc://w/models/../../etc", "'..' segment")]
    #[case("pvc://w/..", "'..' segment")]
    #[case("pvc://w//etc", "is absolute")]
    #[case("pvc://w/a//b", "empty segment")]
    #[case("pvc://w/./a", "'.' segment")]
    #[case("pvc://w/a\\..\\b", "backslash")]
    #[case("pvc://w/%2e%2e/etc", "'%' escape")]
    #[case("pvc://w/a\nb", "control character")]
    fn rejects(#[case] input: &str, #[case] expected: &str) {
        let msg = parse_model_uri(input).unwrap_err().to_string();
        assert!(msg.contains(expected), "{input:?}: {msg}");
    }

    #[test]
    fn rejects_overlong() {
        let uri = format!("hf://org/{}", "a".repeat(MAX_URI_LEN));
        assert_eq!(
            parse_model_uri(&uri),
            Err(UriError::TooLong(MAX_URI_LEN + 9))
        );
    }
}
