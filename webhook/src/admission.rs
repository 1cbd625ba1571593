//! The in-process admission handler: AdmissionReview v1 bytes in, AdmissionReview v1 out.
//!
//! Protocol rules (Kubernetes "Dynamic Admission Control", admission.k8s.io/v1):
//! - `response.uid` echoes `request.uid`; the answer is always `admission.k8s.io/v1`
//!   `AdmissionReview`, and a review of any other version is refused with a 400.
//! - `patchType` is set only together with a non-empty JSONPatch.
//! - DELETE (null `object`) and CONNECT are answered, allowed.
//! - The handler has no side effects, so `dryRun` requests get the same answer as real ones.
//! - Findings the user should see come back as admission `warnings`; policy audit results as
//!   `auditAnnotations` (the apiserver prefixes them with the webhook name).
//! - A kind the endpoint does not handle (a misconfigured registration) is allowed unchanged, with
//!   an audit annotation saying so: the webhook must never block objects it does not own.

use hearth_crds::{GROUP, InferenceRuntime, LLMAdapter, LLMEndpoint, LLMService};
use hearth_policies::Selection;
use kube::core::DynamicObject;
use kube::core::Status;
use kube::core::admission::{
    AdmissionRequest, AdmissionResponse, AdmissionReview, META_API_VERSION_V1, META_KIND, Operation,
};
use kube::core::response::{StatusCause, StatusDetails};
use serde::de::DeserializeOwned;

use crate::Snapshot;
use crate::validate::{self, Finding, Findings};
use crate::workload;

/// Which webhook path a review came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /validate`: Hearth kinds, and platform policy validations of workloads.
    Validate,
    /// `POST /mutate`: annotated Deployments, StatefulSets and Pods.
    Mutate,
}

impl Endpoint {
    /// The URL path the endpoint is served on.
    pub fn path(self) -> &'static str {
        match self {
            Self::Validate => "/validate",
            Self::Mutate => "/mutate",
        }
    }

    /// A short label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Validate => "validate",
            Self::Mutate => "mutate",
        }
    }
}

/// Why a request body could not be answered with an AdmissionReview at all. The server maps
/// these to 4xx responses; the apiserver then applies the webhook's `failurePolicy`.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// The body is not JSON, or not shaped like an AdmissionReview.
    #[error("the request body is not a valid AdmissionReview: {0}")]
    Malformed(String),
    /// Another `apiVersion`/`kind` than `admission.k8s.io/v1` `AdmissionReview`.
    #[error(
        "the request body is {api_version:?} {kind:?}; this webhook answers only \
         admission.k8s.io/v1 AdmissionReview: set admissionReviewVersions: [v1] in the webhook configuration"
    )]
    WrongVersion {
        /// `apiVersion` as received.
        api_version: String,
        /// `kind` as received.
        kind: String,
    },
    /// No `request` field.
    #[error("the AdmissionReview has no request")]
    NoRequest,
    /// An empty `request.uid`, which the response could not echo.
    #[error("the AdmissionReview request has no uid")]
    NoUid,
}

/// What happened to a review, for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Allowed without changes.
    Allowed,
    /// Allowed with a non-empty patch.
    Patched,
    /// Denied.
    Denied,
    /// The kind is not handled on this endpoint; allowed unchanged.
    Skipped,
}

impl Outcome {
    /// A short label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Patched => "patched",
            Self::Denied => "denied",
            Self::Skipped => "skipped",
        }
    }
}

/// The answer to one review.
#[derive(Clone, Debug)]
pub struct Answer {
    /// The AdmissionReview response to send back.
    pub review: AdmissionReview<DynamicObject>,
    /// What happened, for metrics.
    pub outcome: Outcome,
    /// `request.kind.kind` for the kinds the webhook handles, `other` for the rest (metrics).
    pub kind: String,
}

/// Answers one AdmissionReview body. Never panics on any input (fuzzed by `webhook/fuzz`).
///
/// # Errors
///
/// A body that is not an `admission.k8s.io/v1` AdmissionReview with a request and a uid
/// ([`ReviewError`]).
pub fn handle(endpoint: Endpoint, body: &[u8], snapshot: &Snapshot) -> Result<Answer, ReviewError> {
    Ok(Review::parse(endpoint, body)?.answer(snapshot))
}

/// One AdmissionReview request on an endpoint, parsed and checked, to be answered with a
/// [`Snapshot`].
#[derive(Clone, Debug)]
pub struct Review {
    endpoint: Endpoint,
    req: AdmissionRequest<DynamicObject>,
    /// `request.kind.kind` for the kinds the webhook handles, `other` for the rest (metrics).
    kind: String,
    /// The runtime the object names, when the answer resolves one by name.
    named_runtime: Option<String>,
}

impl Review {
    /// Parses an AdmissionReview body that came in on `endpoint`.
    ///
    /// # Errors
    ///
    /// Not UTF-8 JSON shaped as an AdmissionReview ([`ReviewError::Malformed`]), another
    /// version ([`ReviewError::WrongVersion`]), no request or no uid.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, ReviewError> {
        // JSON is UTF-8 (RFC 8259 §8.1). serde_json skips fields it ignores without checking
        // them, so check the whole body first rather than accept invalid bytes in unknown
        // fields.
        let text = std::str::from_utf8(body)
            .map_err(|e| ReviewError::Malformed(format!("the body is not UTF-8: {e}")))?;
        let review: AdmissionReview<DynamicObject> =
            serde_json::from_str(text).map_err(|e| ReviewError::Malformed(e.to_string()))?;
        if review.types.api_version != META_API_VERSION_V1 || review.types.kind != META_KIND {
            return Err(ReviewError::WrongVersion {
                api_version: review.types.api_version,
                kind: review.types.kind,
            });
        }
        let req: AdmissionRequest<DynamicObject> =
            review.try_into().map_err(|_| ReviewError::NoRequest)?;
        if req.uid.is_empty() {
            return Err(ReviewError::NoUid);
        }
        // Metric label: bounded to the kinds the webhook handles, whatever a client sends.
        let kind = match req.kind.kind.as_str() {
            k @ ("LLMService" | "LLMEndpoint" | "LLMAdapter" | "InferenceRuntime"
            | "Deployment" | "StatefulSet" | "Pod") => k,
            _ => "other",
        }
        .to_owned();
        let named_runtime = named_runtime(endpoint, &req);
        Ok(Self {
            endpoint,
            req,
            kind,
            named_runtime,
        })
    }

    /// The InferenceRuntime the answer resolves by name: an LLMService's `spec.runtime.name`
    /// (on `/validate`), or a Deployment's, StatefulSet's or Pod's `serving.hearth.dev/runtime`
    /// annotation or label (`hearth_policies::Selection`, the rule the answer resolves by), for
    /// a create or update of the object itself. `None` for a vendor selection, another kind,
    /// operation or subresource, or an object that does not parse. An LLMAdapter's base
    /// service's runtime is not included.
    pub fn named_runtime(&self) -> Option<&str> {
        self.named_runtime.as_deref()
    }

    /// Answers the review with `snapshot`'s runtimes and policies.
    pub fn answer(&self, snapshot: &Snapshot) -> Answer {
        let (mut resp, outcome) = answer(self.endpoint, &self.req, snapshot);
        // Do not trust the request's type meta: v1 is the only version we speak.
        resp.types.api_version = META_API_VERSION_V1.to_owned();
        resp.types.kind = META_KIND.to_owned();
        Answer {
            review: resp.into_review(),
            outcome,
            kind: self.kind.clone(),
        }
    }
}

/// [`Review::named_runtime`]: what [`answer`] resolves by name, under the same gates.
fn named_runtime(endpoint: Endpoint, req: &AdmissionRequest<DynamicObject>) -> Option<String> {
    if !matches!(req.operation, Operation::Create | Operation::Update)
        || req.sub_resource.as_deref().is_some_and(|s| !s.is_empty())
    {
        return None;
    }
    let object = req.object.as_ref()?;
    let selection = match (endpoint, (req.kind.group.as_str(), req.kind.kind.as_str())) {
        (Endpoint::Validate, (GROUP, "LLMService")) => {
            Selection::from_service(&typed::<LLMService>(object).ok()?)
        }
        (_, ("apps", "Deployment" | "StatefulSet") | ("", "Pod")) => {
            Selection::from_object(&serde_json::json!({ "metadata": object.metadata }))?
        }
        _ => return None,
    };
    match selection {
        Selection::Pinned(name) => Some(name),
        Selection::Vendors(_) => None,
    }
}

fn answer(
    endpoint: Endpoint,
    req: &AdmissionRequest<DynamicObject>,
    snapshot: &Snapshot,
) -> (AdmissionResponse, Outcome) {
    let base = AdmissionResponse::from(req);
    if matches!(req.operation, Operation::Delete | Operation::Connect) {
        return (base, Outcome::Allowed);
    }
    // Status and scale updates never change what the webhook checks.
    if req.sub_resource.as_deref().is_some_and(|s| !s.is_empty()) {
        return (base, Outcome::Allowed);
    }
    let Some(object) = &req.object else {
        return (
            deny(
                base,
                vec![Finding {
                    field: "request.object".to_owned(),
                    message: format!("is missing for a {:?} request", req.operation),
                }],
            ),
            Outcome::Denied,
        );
    };
    let gk = (req.kind.group.as_str(), req.kind.kind.as_str());
    match (endpoint, gk) {
        (Endpoint::Validate, (GROUP, "LLMService")) => findings_response(
            base,
            typed::<LLMService>(object)
                .map(|svc| validate::llmservice(&svc, snapshot.runtime_list())),
        ),
        (Endpoint::Validate, (GROUP, "LLMEndpoint")) => findings_response(
            base,
            typed::<LLMEndpoint>(object).map(|ep| validate::llmendpoint(&ep)),
        ),
        (Endpoint::Validate, (GROUP, "LLMAdapter")) => {
            // The object before an UPDATE (unreadable: judged as if new).
            let old = match req.operation {
                Operation::Update => req
                    .old_object
                    .as_ref()
                    .and_then(|o| typed::<LLMAdapter>(o).ok()),
                _ => None,
            };
            findings_response(
                base,
                typed::<LLMAdapter>(object)
                    .map(|a| validate::llmadapter(&a, old.as_ref(), snapshot)),
            )
        }
        (Endpoint::Validate, (GROUP, "InferenceRuntime")) => findings_response(
            base,
            typed::<InferenceRuntime>(object).map(|rt| validate::inference_runtime(&rt)),
        ),
        (_, ("apps", "Deployment" | "StatefulSet") | ("", "Pod")) => {
            workload::review(endpoint, req, object, snapshot, base)
        }
        _ => {
            let mut resp = base;
            resp.audit_annotations.insert(
                "skipped".to_owned(),
                format!(
                    "{}/{} is not handled on {}",
                    req.kind.group,
                    req.kind.kind,
                    endpoint.path()
                ),
            );
            (resp, Outcome::Skipped)
        }
    }
}

/// Converts the request's object into a typed Hearth object; a shape error names the field.
fn typed<T: DeserializeOwned>(object: &DynamicObject) -> Result<T, Finding> {
    let value = serde_json::to_value(object).map_err(|e| Finding {
        field: "object".to_owned(),
        message: e.to_string(),
    })?;
    serde_path_to_error::deserialize(value).map_err(|e| Finding {
        field: e.path().to_string(),
        message: format!("{}; fix the field's type or value", e.inner()),
    })
}

fn findings_response(
    base: AdmissionResponse,
    findings: Result<Findings, Finding>,
) -> (AdmissionResponse, Outcome) {
    match findings {
        Err(shape) => (deny(base, vec![shape]), Outcome::Denied),
        Ok(f) => {
            let resp = with_warnings(base, f.warnings.iter().map(ToString::to_string).collect());
            if f.denials.is_empty() {
                (resp, Outcome::Allowed)
            } else {
                (deny(resp, f.denials), Outcome::Denied)
            }
        }
    }
}

/// Adds admission warnings; an empty list leaves the field unset.
pub(crate) fn with_warnings(
    mut resp: AdmissionResponse,
    warnings: Vec<String>,
) -> AdmissionResponse {
    if !warnings.is_empty() {
        resp.warnings.get_or_insert_default().extend(warnings);
    }
    resp
}

/// Denies with `422 Invalid` and one status cause per finding, so clients see field paths.
pub(crate) fn deny(mut resp: AdmissionResponse, findings: Vec<Finding>) -> AdmissionResponse {
    let message = findings
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    resp.allowed = false;
    resp.result = Status::failure(&message, "Invalid")
        .with_code(422)
        .with_details(StatusDetails {
            causes: findings
                .into_iter()
                .map(|f| StatusCause {
                    reason: "FieldValueInvalid".to_owned(),
                    message: f.message,
                    field: f.field,
                })
                .collect(),
            name: String::new(),
            group: String::new(),
            kind: String::new(),
            uid: String::new(),
            retry_after_seconds: 0,
        });
    resp
}
