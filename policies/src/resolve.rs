//! Which `InferenceRuntime` applies to a workload: one rule for the webhook (annotated plain
//! workloads) and the controller (LLMServices).
//!
//! Rule: a pinned name must exist; otherwise runtimes whose vendor is in the preference list
//! win in list order, then by higher `priority`. Two or more runtimes left equal (same place in
//! the list, same priority) are refused as ambiguous, as upstream Hearth does since 0.2.0: its
//! Ascend profiles share one priority on purpose, so a cluster with several must pin one (by
//! name) instead of getting whichever sorts first. An empty preference list accepts every
//! vendor.

use hearth_crds::{InferenceRuntime, LLMService, wellknown};
use serde_json::Value;

/// How a workload asks for a runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// `serving.hearth.dev/runtime: <name>` or `spec.runtime.name`.
    Pinned(String),
    /// `serving.hearth.dev/vendor: nvidia,ascend` or `spec.runtime.selector.vendor`, in
    /// preference order; empty accepts any vendor.
    Vendors(Vec<String>),
}

impl Selection {
    /// The selection an annotated object asks for: the runtime annotation (or label) wins over
    /// the vendor annotation (or label); `None` when the object asks for neither.
    pub fn from_object(object: &Value) -> Option<Selection> {
        let meta = object.get("metadata")?;
        let find = |key: &str| {
            ["annotations", "labels"].iter().find_map(|m| {
                meta.get(m)?
                    .get(key)?
                    .as_str()
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
            })
        };
        if let Some(name) = find(wellknown::RUNTIME_ANNOTATION) {
            return Some(Selection::Pinned(name.to_owned()));
        }
        find(wellknown::VENDOR_ANNOTATION).map(|v| Selection::Vendors(split_vendors(v)))
    }

    /// The selection of an LLMService: `spec.runtime.name`, else its vendor selector.
    pub fn from_service(service: &LLMService) -> Selection {
        let rt = &service.spec.runtime;
        match rt.name.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
            Some(name) => Selection::Pinned(name.to_owned()),
            None => Selection::Vendors(
                rt.selector
                    .as_ref()
                    .map(|s| s.vendor.clone())
                    .unwrap_or_default(),
            ),
        }
    }
}

fn split_vendors(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Why no runtime could be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The pinned runtime does not exist.
    #[error("InferenceRuntime {name:?} does not exist; available: [{}]. Create it or fix the name", .available.join(", "))]
    NotFound {
        /// The pinned name.
        name: String,
        /// Names that do exist.
        available: Vec<String>,
    },
    /// No runtime has one of the preferred vendors.
    #[error("no InferenceRuntime has vendor {}; runtimes exist for [{}]. Add a vendor to the preference list or create a runtime", .wanted.join(" or "), .available.join(", "))]
    NoVendorMatch {
        /// The preference list.
        wanted: Vec<String>,
        /// Vendors that have runtimes.
        available: Vec<String>,
    },
    /// Several runtimes are equally preferred.
    #[error("InferenceRuntimes [{}] are equally preferred (vendor {vendor}, priority {priority}); pin one by name, or give one a higher spec.priority", .candidates.join(", "))]
    Ambiguous {
        /// The vendor of the best place in the preference list.
        vendor: String,
        /// Their priority.
        priority: i32,
        /// The tied runtimes' names, sorted.
        candidates: Vec<String>,
    },
}

/// Picks the runtime for `selection` from `runtimes` (see the module docs for the rule).
pub fn resolve_runtime<'a>(
    runtimes: &'a [InferenceRuntime],
    selection: &Selection,
) -> Result<&'a InferenceRuntime, ResolveError> {
    let name = |r: &InferenceRuntime| r.metadata.name.clone().unwrap_or_default();
    match selection {
        Selection::Pinned(wanted) => runtimes
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some(wanted.as_str()))
            .ok_or_else(|| {
                let mut available: Vec<String> = runtimes.iter().map(name).collect();
                available.sort();
                ResolveError::NotFound {
                    name: wanted.clone(),
                    available,
                }
            }),
        Selection::Vendors(prefs) => {
            let rank = |r: &InferenceRuntime| {
                if prefs.is_empty() {
                    Some(0)
                } else {
                    prefs.iter().position(|v| *v == r.spec.vendor)
                }
            };
            let key =
                |r: &InferenceRuntime| rank(r).map(|k| (k, std::cmp::Reverse(r.spec.priority)));
            let best = runtimes.iter().filter_map(key).min();
            let tied: Vec<&InferenceRuntime> = runtimes
                .iter()
                .filter(|r| best.is_some() && key(r) == best)
                .collect();
            let mut candidates: Vec<String> = tied.iter().map(|r| name(r)).collect();
            candidates.sort();
            // A list read from several files may hold one runtime twice: that is no tie.
            candidates.dedup();
            if let (Some(first), true) = (tied.first(), candidates.len() > 1) {
                return Err(ResolveError::Ambiguous {
                    vendor: first.spec.vendor.clone(),
                    priority: first.spec.priority,
                    candidates,
                });
            }
            tied.first().copied().ok_or_else(|| {
                let mut available: Vec<String> =
                    runtimes.iter().map(|r| r.spec.vendor.clone()).collect();
                available.sort();
                available.dedup();
                ResolveError::NoVendorMatch {
                    wanted: prefs.clone(),
                    available,
                }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rt(name: &str, vendor: &str, priority: i32) -> InferenceRuntime {
        serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "InferenceRuntime",
            "metadata": {"name": name},
            "spec": {"vendor": vendor, "priority": priority,
                     "container": {"image": "img"}, "accelerator": {"resourceName": "x/y"}}
        }))
        .unwrap()
    }

    /// A selection by vendor, in order of preference.
    fn vendors(names: &[&str]) -> Selection {
        Selection::Vendors(names.iter().map(|v| (*v).to_owned()).collect())
    }

    fn pick(rts: &[InferenceRuntime], sel: Selection) -> Result<String, ResolveError> {
        resolve_runtime(rts, &sel).map(|r| r.metadata.name.clone().unwrap())
    }

    #[test]
    fn pinned_name_must_exist() {
        let rts = [rt("a", "nvidia", 1), rt("b", "ascend", 1)];
        assert_eq!(pick(&rts, Selection::Pinned("b".into())).unwrap(), "b");
        let err = pick(&rts, Selection::Pinned("zz".into())).unwrap_err();
        assert_eq!(
            err,
            ResolveError::NotFound {
                name: "zz".into(),
                available: vec!["a".into(), "b".into()]
            }
        );
        assert!(err.to_string().contains("does not exist"));
    }

    #[test]
    fn vendor_order_beats_priority() {
        let rts = [rt("n", "nvidia", 1000), rt("a", "ascend", 1)];
        assert_eq!(pick(&rts, vendors(&["ascend", "nvidia"])).unwrap(), "a");
        assert_eq!(pick(&rts, vendors(&["nvidia", "ascend"])).unwrap(), "n");
    }

    #[test]
    fn priority_decides_and_equal_priorities_are_refused() {
        let rts = [
            rt("z", "nvidia", 5),
            rt("b", "nvidia", 10),
            rt("a", "ascend", 1),
        ];
        assert_eq!(pick(&rts, vendors(&["nvidia"])).unwrap(), "b");
        let rts = [
            rt("z", "nvidia", 5),
            rt("b", "nvidia", 10),
            rt("a", "nvidia", 10),
        ];
        let err = pick(&rts, vendors(&["nvidia"])).unwrap_err();
        assert_eq!(
            err,
            ResolveError::Ambiguous {
                vendor: "nvidia".into(),
                priority: 10,
                candidates: vec!["a".into(), "b".into()]
            }
        );
        assert!(err.to_string().contains("pin one by name"), "{err}");
        assert!(pick(&rts, vendors(&[])).is_err());
        // A runtime earlier in the preference list is not a tie, whatever its priority.
        let rts = [
            rt("n1", "nvidia", 1),
            rt("n2", "nvidia", 1),
            rt("a", "ascend", 1),
        ];
        assert_eq!(pick(&rts, vendors(&["ascend", "nvidia"])).unwrap(), "a");
        // Pinning resolves the tie.
        assert_eq!(pick(&rts, Selection::Pinned("n2".into())).unwrap(), "n2");
    }

    #[test]
    fn no_vendor_match_names_what_exists() {
        let rts = [rt("n", "nvidia", 1), rt("m", "nvidia", 2)];
        let err = pick(&rts, vendors(&["cambricon"])).unwrap_err();
        assert_eq!(
            err,
            ResolveError::NoVendorMatch {
                wanted: vec!["cambricon".into()],
                available: vec!["nvidia".into()]
            }
        );
        assert!(pick(&[], vendors(&[])).is_err());
    }

    #[test]
    fn selection_from_annotations_and_labels() {
        let o = json!({"metadata": {"annotations": {"serving.hearth.dev/runtime": "rt", "serving.hearth.dev/vendor": "x"}}});
        assert_eq!(
            Selection::from_object(&o),
            Some(Selection::Pinned("rt".into()))
        );
        let o = json!({"metadata": {"labels": {"serving.hearth.dev/vendor": "nvidia, ascend"}}});
        assert_eq!(
            Selection::from_object(&o),
            Some(Selection::Vendors(vec!["nvidia".into(), "ascend".into()]))
        );
        assert_eq!(Selection::from_object(&json!({"metadata": {}})), None);
        let o = json!({"metadata": {"annotations": {"serving.hearth.dev/runtime": "  "}}});
        assert_eq!(Selection::from_object(&o), None);
    }
}
