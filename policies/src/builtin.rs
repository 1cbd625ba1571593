//! Hearth's built-in ServingPolicies (`policies/builtin/*.yaml`), embedded at build time: the
//! default accelerator request, probes, drain and scheduling, written as policies. The webhook
//! and the controller both take them from here.

use std::path::Path;

use hearth_crds::ServingPolicy;

use crate::manifest::{Bundle, ManifestError, read_str};

include!(concat!(env!("OUT_DIR"), "/builtin.rs"));

/// The built-in policies in file order (the order they are evaluated in).
///
/// Errors only if an embedded file is not a valid manifest, which this crate's tests rule out.
pub fn policies() -> Result<Vec<ServingPolicy>, ManifestError> {
    let mut bundle = Bundle::default();
    for (name, text) in MANIFESTS {
        read_str(text, Path::new(name), &mut bundle)?;
    }
    Ok(bundle.policies)
}

#[cfg(test)]
mod tests {
    #[test]
    fn builtins_parse_and_compile() {
        let policies = super::policies().unwrap();
        assert!(!policies.is_empty());
        let (_, errors) = crate::PolicySet::compile(&policies);
        assert!(errors.is_empty(), "{errors:?}");
    }
}
