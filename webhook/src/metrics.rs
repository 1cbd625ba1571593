//! Prometheus metrics of the webhook, served on `/metrics` in the OpenMetrics text format.

use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of an answered review.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReviewLabels {
    /// `validate` or `mutate`.
    pub endpoint: &'static str,
    /// `request.kind.kind` for handled kinds, `other` for the rest (bounded cardinality).
    pub kind: String,
    /// `allowed`, `patched`, `denied`, `skipped`.
    pub outcome: &'static str,
}

/// Labels of a refused request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// `validate` or `mutate`.
    pub endpoint: &'static str,
    /// `malformed`, `version`, `too_large`, `timeout`, `content_type`, `internal` (an
    /// evaluation that did not complete).
    pub reason: &'static str,
}

/// Labels of a read of an InferenceRuntime the snapshot lacked.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuntimeReadLabels {
    /// `found`, `not_found`, `invalid_name`, `cached_miss`, `busy`, `error`, `timeout`
    /// ([`crate::readthrough::Read::result`]).
    pub result: &'static str,
}

/// Labels of a policy compile failure.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    /// ServingPolicy name.
    pub policy: String,
}

/// Every metric the webhook exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    /// Metrics of the libraries, under their own names (no `hearth_webhook` prefix):
    /// `hearth_policy_native_fallbacks_total{reason}` (see [`hearth_policies::fallback`]).
    libraries: Registry,
    /// `hearth_webhook_reviews_total`: reviews answered.
    pub reviews: Family<ReviewLabels, Counter>,
    /// `hearth_webhook_request_errors_total`: requests refused before a review could be made.
    pub errors: Family<ErrorLabels, Counter>,
    /// `hearth_webhook_review_duration_seconds`: time to answer a review, body read excluded.
    pub duration: Histogram,
    /// `hearth_webhook_cert_reloads_total`: serving certificate swaps.
    pub cert_reloads: Counter,
    /// `hearth_webhook_cert_reload_errors_total`: failed reloads or renewals.
    pub cert_reload_errors: Counter,
    /// `hearth_webhook_policy_compile_errors_total`: ServingPolicy compile failures by policy.
    pub policy_errors: Family<PolicyLabels, Counter>,
    /// `hearth_webhook_policies`: platform ServingPolicies currently enforced.
    pub policies: Gauge,
    /// `hearth_webhook_runtimes`: InferenceRuntimes currently known.
    pub runtimes: Gauge,
    /// `hearth_webhook_policies_exported`: ServingPolicies the apiserver runs as exported
    /// ValidatingAdmissionPolicies and MutatingAdmissionPolicies, which the webhook leaves out.
    pub exported: Gauge,
    /// `hearth_webhook_snapshot_rebuilds_total`: policy/runtime snapshots swapped in.
    pub rebuilds: Counter,
    /// `hearth_webhook_runtime_reads_total`: reviews naming an InferenceRuntime the snapshot
    /// lacked, by what the read found ([`crate::readthrough`]).
    pub runtime_reads: Family<RuntimeReadLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under the `hearth_webhook` prefix.
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("hearth_webhook");
        let reviews = Family::<ReviewLabels, Counter>::default();
        r.register("reviews", "AdmissionReviews answered", reviews.clone());
        let errors = Family::<ErrorLabels, Counter>::default();
        r.register(
            "request_errors",
            "Requests refused before an AdmissionReview could be answered",
            errors.clone(),
        );
        // 50 µs .. ~1.6 s.
        let duration = Histogram::new(exponential_buckets(0.00005, 2.0, 16));
        r.register(
            "review_duration_seconds",
            "Time to answer one AdmissionReview, excluding the body read",
            duration.clone(),
        );
        let cert_reloads = Counter::default();
        r.register(
            "cert_reloads",
            "Serving certificate swaps",
            cert_reloads.clone(),
        );
        let cert_reload_errors = Counter::default();
        r.register(
            "cert_reload_errors",
            "Failed serving certificate reloads or renewals",
            cert_reload_errors.clone(),
        );
        let policy_errors = Family::<PolicyLabels, Counter>::default();
        r.register(
            "policy_compile_errors",
            "ServingPolicy compile failures",
            policy_errors.clone(),
        );
        let policies = Gauge::default();
        r.register(
            "policies",
            "Platform ServingPolicies currently enforced",
            policies.clone(),
        );
        let runtimes = Gauge::default();
        r.register(
            "runtimes",
            "InferenceRuntimes currently known",
            runtimes.clone(),
        );
        let exported = Gauge::default();
        r.register(
            "policies_exported",
            "ServingPolicies the apiserver runs as exported admission policies, not evaluated here",
            exported.clone(),
        );
        let rebuilds = Counter::default();
        r.register(
            "snapshot_rebuilds",
            "Policy and runtime snapshots swapped in",
            rebuilds.clone(),
        );
        let runtime_reads = Family::<RuntimeReadLabels, Counter>::default();
        r.register(
            "runtime_reads",
            "Reviews naming an InferenceRuntime the snapshot lacked, by what the read from the apiserver found",
            runtime_reads.clone(),
        );
        let mut libraries = Registry::default();
        libraries.register_collector(Box::new(hearth_policies::fallback::Collector));
        Self {
            registry: Mutex::new(r),
            libraries,
            reviews,
            errors,
            duration,
            cert_reloads,
            cert_reload_errors,
            policy_errors,
            policies,
            runtimes,
            exported,
            rebuilds,
            runtime_reads,
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &registry);
        let _ = encode_registry(&mut out, &self.libraries);
        let _ = encode_eof(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use hearth_crds::{ServingPolicy, servingpolicy::Operation};
    use hearth_policies::{EvalInput, PolicySet};
    use serde_json::json;

    use super::Metrics;

    /// The value of `hearth_policy_native_fallbacks_total{reason="unsupported"}` in `text`.
    fn unsupported(text: &str) -> u64 {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(r#"hearth_policy_native_fallbacks_total{reason="unsupported"} "#)
            })
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no unsupported fallback counter in:\n{text}"))
    }

    #[test]
    fn native_fallbacks_are_exported() {
        let metrics = Metrics::new();
        let text = metrics.encode();
        assert!(text.contains("# TYPE hearth_policy_native_fallbacks counter"));
        assert!(text.contains(r#"hearth_policy_native_fallbacks_total{reason="panic"} "#));
        assert!(text.ends_with("# EOF\n"));
        let before = unsupported(&text);

        // A validation that fails on a missing field: the native evaluator hands the policy
        // to the interpreter, which words the error.
        let policy: ServingPolicy = serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "ServingPolicy",
            "metadata": {"name": "falls-back"},
            "spec": {"validations": [{"expression": "object.spec.missing == 1"}]},
        }))
        .expect("policy parses");
        let (set, errors) = PolicySet::compile(&[policy]);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(set.native_policies(), ["falls-back"]);
        // The default matchConstraints: Deployments, StatefulSets and Pods.
        let object = json!({"apiVersion": "apps/v1", "kind": "Deployment",
                            "metadata": {"name": "d", "namespace": "n"}, "spec": {}});
        let on_thread = PolicySet::native_fallbacks();
        let out = set.evaluate(&EvalInput::for_object(object, Operation::Create));
        assert_eq!(out.matched, ["falls-back"]);
        assert_eq!(PolicySet::native_fallbacks(), on_thread + 1);

        assert!(unsupported(&metrics.encode()) > before);
    }
}
