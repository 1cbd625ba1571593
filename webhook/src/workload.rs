//! Workloads that opted in to Hearth: Deployments, StatefulSets and Pods carrying
//! `serving.hearth.dev/runtime: <name>` or `serving.hearth.dev/vendor: a,b` (annotation or
//! label). The runtime is resolved, then the compiled policies run with it bound as `params`:
//! mutations on `/mutate`, validations on `/validate`.

use std::collections::BTreeMap;
use std::sync::Arc;

use hearth_crds::wellknown::{RUNTIME_ANNOTATION, VENDOR_ANNOTATION};
use hearth_crds::{InferenceRuntime, ServingPolicy};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse};

use crate::admission::{Endpoint, Outcome, deny};
use crate::validate::{Finding, Runtimes};

/// One compiled `ServingPolicy`, with the identity of the version it was compiled from.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// Policy name.
    pub name: String,
    /// `metadata.uid` of the compiled object.
    pub uid: Option<String>,
    /// `metadata.generation` of the compiled object.
    pub generation: i64,
    /// The policy as compiled.
    pub policy: Arc<ServingPolicy>,
}

impl Compiled {
    /// Compiles a policy. The error names the field and says what is wrong.
    pub fn compile(p: &ServingPolicy) -> Result<Self, String> {
        Ok(Self {
            name: p.metadata.name.clone().unwrap_or_default(),
            uid: p.metadata.uid.clone(),
            generation: p.metadata.generation.unwrap_or_default(),
            policy: Arc::new(p.clone()),
        })
    }
}

/// What reviews are answered with: the cluster's runtimes and the compiled policies, replaced
/// as a whole when either changes.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// InferenceRuntimes by name.
    pub runtimes: Runtimes,
    /// Platform policies that compiled (last good version of each).
    pub policies: Vec<Compiled>,
}

impl Snapshot {
    /// A snapshot of `runtimes` and `policies`.
    pub fn new(runtimes: Runtimes, policies: Vec<Compiled>) -> Self {
        Self { runtimes, policies }
    }

    /// A snapshot of runtimes only.
    pub fn with_runtimes(runtimes: impl IntoIterator<Item = InferenceRuntime>) -> Self {
        Self {
            runtimes: runtimes
                .into_iter()
                .map(|rt| (rt.metadata.name.clone().unwrap_or_default(), Arc::new(rt)))
                .collect(),
            policies: Vec::new(),
        }
    }
}

/// Hearth's keys on a workload: annotation first, then label.
fn opt_in(object: &DynamicObject) -> (Option<&str>, Option<&str>) {
    fn from<'a>(m: &'a Option<BTreeMap<String, String>>, key: &str) -> Option<&'a str> {
        m.as_ref().and_then(|m| m.get(key)).map(String::as_str)
    }
    let get = |key: &str| {
        from(&object.metadata.annotations, key).or_else(|| from(&object.metadata.labels, key))
    };
    (get(RUNTIME_ANNOTATION), get(VENDOR_ANNOTATION))
}

/// Answers a review of a Deployment, StatefulSet or Pod.
pub(crate) fn review(
    endpoint: Endpoint,
    _req: &AdmissionRequest<DynamicObject>,
    object: &DynamicObject,
    snapshot: &Snapshot,
    base: AdmissionResponse,
) -> (AdmissionResponse, Outcome) {
    let (runtime, vendor) = opt_in(object);
    let resolved = match (runtime, vendor) {
        (Some(name), _) => snapshot.runtimes.get(name.trim()).ok_or_else(|| Finding {
            field: format!("metadata.annotations[{RUNTIME_ANNOTATION:?}]"),
            message: format!(
                "InferenceRuntime {name:?} does not exist; name an existing one (kubectl get inferenceruntimes) or remove the annotation"
            ),
        }),
        (None, Some(vendors)) => vendors
            .split(',')
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .find_map(|v| {
                snapshot
                    .runtimes
                    .values()
                    .rev()
                    .filter(|rt| rt.spec.vendor == v)
                    .max_by_key(|rt| rt.spec.priority)
            })
            .ok_or_else(|| Finding {
                field: format!("metadata.annotations[{VENDOR_ANNOTATION:?}]"),
                message: format!(
                    "no InferenceRuntime has a vendor in [{vendors}]; create one or change the list"
                ),
            }),
        // Not opted in: the matchConditions normally keep these away.
        (None, None) => return (base, Outcome::Skipped),
    };
    match resolved {
        Err(f) => (deny(base, vec![f]), Outcome::Denied),
        Ok(_rt) => {
            let _ = endpoint;
            (base, Outcome::Allowed)
        }
    }
}
