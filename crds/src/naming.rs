//! Kubernetes name grammars, as `k8s.io/apimachinery/pkg/util/validation` defines them: the one
//! home of these checks for the API's own rules ([`crate::rules`], [`crate::model_uri`]), the
//! admission webhook and the controller.
//!
//! | function | apimachinery | used for |
//! |---|---|---|
//! | [`is_dns1123_label`] | `IsDNS1123Label` | vendor names, label-like names |
//! | [`is_dns1123_subdomain`] | `IsDNS1123Subdomain` | object names (Secrets, claims, runtimes) |
//! | [`is_dns1035_label`] | `IsDNS1035Label` | Service names (an `LLMService`'s children) |
//! | [`is_iana_svc_name`] | `IsValidPortName` | container port names |
//! | [`check_qualified_name`] | `IsQualifiedName` | label keys |
//! | [`is_label_value`] | `IsValidLabelValue` | label values |
//! | [`check_extended_resource`] | `IsExtendedResourceName` (k8s.io/kubernetes) | device-plugin resources |

/// Longest DNS-1123 / RFC 1035 label.
pub const DNS1123_LABEL_MAX_LEN: usize = 63;
/// Longest DNS-1123 subdomain.
pub const DNS1123_SUBDOMAIN_MAX_LEN: usize = 253;

fn label_chars(b: &[u8], first_ok: impl Fn(&u8) -> bool) -> bool {
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    match (b.first(), b.last()) {
        (Some(first), Some(last)) => {
            b.len() <= DNS1123_LABEL_MAX_LEN
                && first_ok(first)
                && alnum(last)
                && b.iter().all(|c| alnum(c) || *c == b'-')
        }
        _ => false,
    }
}

/// `IsDNS1123Label`: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_dns1123_label(s: &str) -> bool {
    label_chars(s.as_bytes(), |c| {
        c.is_ascii_lowercase() || c.is_ascii_digit()
    })
}

/// `IsDNS1123Subdomain`: dot-separated DNS-1123 labels, at most 253 characters (object names).
pub fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= DNS1123_SUBDOMAIN_MAX_LEN && s.split('.').all(is_dns1123_label)
}

/// `IsDNS1035Label`: `[a-z]([-a-z0-9]*[a-z0-9])?`, at most 63 characters (Service names: they
/// become DNS names, so they must start with a letter and have no dot).
pub fn is_dns1035_label(s: &str) -> bool {
    label_chars(s.as_bytes(), u8::is_ascii_lowercase)
}

/// `IsValidPortName` (an IANA service name, RFC 6335): at most 15 lowercase letters, digits and
/// `-`, at least one letter, no leading, trailing or double `-`.
pub fn is_iana_svc_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 15
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b.iter().any(u8::is_ascii_lowercase)
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
        && !s.contains("--")
}

/// `IsQualifiedName`: `[prefix/]name`, the prefix a DNS subdomain, the name at most 63 of
/// `[A-Za-z0-9._-]` starting and ending alphanumeric. The error says which part is wrong.
pub fn check_qualified_name(s: &str) -> Result<(), &'static str> {
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    if let Some(p) = prefix
        && !is_dns1123_subdomain(p)
    {
        return Err("has a prefix that is not a DNS subdomain");
    }
    let b = name.as_bytes();
    if b.is_empty() || b.len() > DNS1123_LABEL_MAX_LEN {
        return Err("must have a name part of 1 to 63 characters");
    }
    if !b
        .iter()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        || !b[0].is_ascii_alphanumeric()
        || !b[b.len() - 1].is_ascii_alphanumeric()
    {
        return Err("has a name part that is not alphanumeric with '-', '_' or '.' inside");
    }
    Ok(())
}

/// `IsValidLabelValue`: empty, or at most 63 of `[A-Za-z0-9._-]` starting and ending
/// alphanumeric.
pub fn is_label_value(s: &str) -> bool {
    s.is_empty() || !s.contains('/') && check_qualified_name(s).is_ok()
}

/// Extended resources are domain-qualified names outside `kubernetes.io`
/// (`IsExtendedResourceName` of k8s.io/kubernetes `pkg/apis/core/helper`).
pub fn check_extended_resource(s: &str) -> Result<(), &'static str> {
    let Some((prefix, _)) = s.split_once('/') else {
        return Err("has no domain prefix");
    };
    if prefix == "kubernetes.io" || prefix.ends_with(".kubernetes.io") {
        return Err("is in the kubernetes.io namespace, which is reserved for native resources");
    }
    check_qualified_name(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("qwen", true, true, true)]
    #[case("qwen-7b", true, true, true)]
    #[case("7b", true, true, false)]
    #[case("a.b", false, true, false)]
    #[case("Qwen", false, false, false)]
    #[case("-a", false, false, false)]
    #[case("a-", false, false, false)]
    #[case("a_b", false, false, false)]
    #[case("", false, false, false)]
    fn dns_names(
        #[case] s: &str,
        #[case] label: bool,
        #[case] subdomain: bool,
        #[case] rfc1035: bool,
    ) {
        assert_eq!(is_dns1123_label(s), label, "label {s:?}");
        assert_eq!(is_dns1123_subdomain(s), subdomain, "subdomain {s:?}");
        assert_eq!(is_dns1035_label(s), rfc1035, "rfc1035 {s:?}");
    }

    #[test]
    fn lengths() {
        assert!(is_dns1123_label(&"a".repeat(63)));
        assert!(!is_dns1123_label(&"a".repeat(64)));
        assert!(!is_dns1035_label(&"a".repeat(64)));
        let sub = vec!["a".repeat(63); 4].join(".");
        assert_eq!(sub.len(), 255);
        assert!(!is_dns1123_subdomain(&sub));
        assert!(is_dns1123_subdomain(&sub[2..]));
    }

    #[rstest]
    #[case("http", true)]
    #[case("h2c-8000", true)]
    #[case("8000", false)]
    #[case("HTTP", false)]
    #[case("a--b", false)]
    #[case("-http", false)]
    #[case("sixteen-chars-xx", false)]
    fn port_names(#[case] name: &str, #[case] ok: bool) {
        assert_eq!(is_iana_svc_name(name), ok, "{name}");
    }

    #[rstest]
    #[case("nvidia.com/gpu", true)]
    #[case("huawei.com/Ascend910", true)]
    #[case("gpu", false)]
    #[case("kubernetes.io/gpu", false)]
    #[case("nvidia.com/", false)]
    #[case("Nvidia.com/gpu", false)]
    fn extended_resources(#[case] name: &str, #[case] ok: bool) {
        assert_eq!(check_extended_resource(name).is_ok(), ok, "{name}");
    }

    #[rstest]
    #[case("", true)]
    #[case("NVIDIA-A10", true)]
    #[case("a.b_c", true)]
    #[case("a/b", false)]
    #[case("-a", false)]
    fn label_values(#[case] v: &str, #[case] ok: bool) {
        assert_eq!(is_label_value(v), ok, "{v}");
    }
}
