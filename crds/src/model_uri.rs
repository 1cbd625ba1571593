//! Model URIs of `LLMService.spec.model.source.uri`: `hf://<org>/<name>` (or its alias
//! `huggingface://<org>/<name>`),
//! `modelscope://<org>/<name>`, `pvc://<claim>[/<subpath>]` and `oci://<image reference>` (a
//! Hearth extension: weights packaged as an OCI image, mounted as a Kubernetes image volume).
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
    /// Weights packaged as an OCI image (or artifact), mounted read-only as an image volume.
    Oci {
        /// The image reference, `[registry/]repository(:tag|@digest)`, as given.
        reference: String,
    },
}

/// Why a model URI was rejected; the message says what is allowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UriError {
    /// The URI is empty.
    #[error(
        "is empty; set it to hf://<org>/<name>, modelscope://<org>/<name>, pvc://<claim>[/<subpath>] or oci://<registry>/<repository>:<tag>"
    )]
    Empty,
    /// Longer than [`MAX_URI_LEN`].
    #[error("is {0} bytes long; at most {MAX_URI_LEN} are allowed")]
    TooLong(usize),
    /// A scheme other than the four supported ones.
    #[error(
        "has unsupported scheme {0:?}; use hf://<org>/<name>, modelscope://<org>/<name>, pvc://<claim>[/<subpath>] or oci://<registry>/<repository>:<tag>"
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
    /// An `oci://` image reference that is not one.
    #[error(
        "image reference {reference:?} {why}; write oci://<registry>/<repository>:<tag> or oci://<registry>/<repository>@sha256:<digest>, e.g. oci://registry.example.com/models/qwen2.5-7b:v1"
    )]
    Image {
        /// The reference as given.
        reference: String,
        /// What is wrong with it.
        why: &'static str,
    },
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

impl ModelUri {
    /// Whether the weights are read as they are, from a volume of the user's (`pvc://`) or an
    /// image (`oci://`): no cache claim, no prewarm, mounted read-only at the cache path.
    pub fn is_staged(&self) -> bool {
        matches!(self, Self::Pvc { .. } | Self::Oci { .. })
    }
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
            Self::Oci { reference } => write!(f, "oci://{reference}"),
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
        "oci" => image_reference(rest).map(|reference| ModelUri::Oci { reference }),
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

/// An image reference by the grammar of the distribution project (`distribution/reference`,
/// which containerd and CRI-O parse image volume references with):
/// `[domain[:port]/]path-component(/path-component)*[:tag][@algorithm:hex]`, the name at most
/// 255 characters. A tag or a digest is required here: the weights of a running service must not
/// move with `latest`.
fn image_reference(reference: &str) -> Result<String, UriError> {
    let err = |why| UriError::Image {
        reference: reference.to_owned(),
        why,
    };
    if reference
        .chars()
        .any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(err("contains whitespace or a control character"));
    }
    let (name_tag, digest) = match reference.split_once('@') {
        Some((n, d)) => (n, Some(d)),
        None => (reference, None),
    };
    if let Some(d) = digest {
        let Some((algorithm, hex)) = d.split_once(':') else {
            return Err(err(
                "has a digest without an algorithm (write @sha256:<hex>)",
            ));
        };
        let alg_ok = !algorithm.is_empty()
            && algorithm
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b))
            && algorithm.as_bytes()[0].is_ascii_alphanumeric();
        if !alg_ok || hex.len() < 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(err(
                "has a malformed digest (an algorithm, ':' and at least 32 hex digits)",
            ));
        }
    }
    // A tag follows the last ':' after the last '/' (a ':' before it is the registry's port).
    let (name, tag) = match name_tag.rfind(':') {
        Some(i) if !name_tag[i..].contains('/') => (&name_tag[..i], Some(&name_tag[i + 1..])),
        _ => (name_tag, None),
    };
    if let Some(t) = tag {
        let ok = (1..=128).contains(&t.len())
            && (t.as_bytes()[0].is_ascii_alphanumeric() || t.as_bytes()[0] == b'_')
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !ok {
            return Err(err(
                "has an invalid tag (1 to 128 of letters, digits, '_', '.' and '-', not starting with '.' or '-')",
            ));
        }
    }
    if tag.is_none() && digest.is_none() {
        return Err(err(
            "has neither a tag nor a digest, so the weights could change under running replicas",
        ));
    }
    if name.is_empty() || name.len() > 255 {
        return Err(err(
            "has a repository name that is empty or longer than 255 characters",
        ));
    }
    let mut components = name.split('/').peekable();
    // The first component is a registry when more follow and it looks like a host
    // (distribution's rule: it contains '.' or ':', or is `localhost`).
    if let Some(first) = components.peek().copied()
        && name.contains('/')
        && (first.contains(['.', ':']) || first == "localhost")
    {
        components.next();
        let host_ok = !first.is_empty()
            && first
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
            && !first.starts_with(['.', '-', ':']);
        if !host_ok {
            return Err(err("has an invalid registry host"));
        }
    }
    for c in components {
        if !path_component(c) {
            return Err(err(
                "has an invalid repository path (lowercase letters and digits, separated by '.', '_', '__' or dashes)",
            ));
        }
    }
    Ok(reference.to_owned())
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`: a repository path component.
fn path_component(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        if !(sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|x| x == b'-')) {
            return false;
        }
    }
    true
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
    #[case(
        "oci://registry.example.com/models/qwen2.5-7b:v1",
        "oci://registry.example.com/models/qwen2.5-7b:v1"
    )]
    #[case(
        "oci://localhost:5000/weights:2024_01",
        "oci://localhost:5000/weights:2024_01"
    )]
    #[case(
        "oci://ghcr.io/org/my__model@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        "oci://ghcr.io/org/my__model@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    )]
    #[case(
        "oci://hearth.dev/stub-weights:e2e",
        "oci://hearth.dev/stub-weights:e2e"
    )]
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
    #[case("oci://registry.example.com/models/qwen", "neither a tag nor a digest")]
    #[case("oci://registry.example.com/Models/qwen:v1", "invalid repository path")]
    #[case(
        "oci://registry.example.com/models//qwen:v1",
        "invalid repository path"
    )]
    #[case("oci://registry.example.com/models/qwen:.v1", "invalid tag")]
    #[case(
        "oci://registry.example.com/models/qwen@sha256:abc",
        "malformed digest"
    )]
    #[case("oci://registry.example.com/models/qwen@abc", "without an algorithm")]
    #[case("oci://registry.example.com/a b:v1", "whitespace")]
    #[case("oci://:v1", "empty")]
    #[case("oci://", "neither a tag nor a digest")]
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
