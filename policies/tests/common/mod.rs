//! Helpers shared by the integration tests.
#![allow(dead_code)]

use hearth_crds::{ServingPolicy, servingpolicy::Operation};
use hearth_policies::{EvalInput, Outcome, PolicySet};
use serde_json::{Value, json};

/// A ServingPolicy from its spec as JSON.
pub fn policy(name: &str, spec: Value) -> ServingPolicy {
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "ServingPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("valid ServingPolicy")
}

/// Compiles policies that must all load.
pub fn set(policies: Vec<ServingPolicy>) -> PolicySet {
    let (set, errors) = PolicySet::compile(&policies);
    assert!(errors.is_empty(), "load errors: {errors:?}");
    set
}

/// A small annotated Deployment.
pub fn deployment() -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llm", "namespace": "team-a",
                     "labels": {"app": "llm"},
                     "annotations": {"serving.hearth.dev/runtime": "vllm-nvidia-a10"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "llm"}},
            "template": {
                "metadata": {"labels": {"app": "llm"}},
                "spec": {"containers": [
                    {"name": "vllm", "image": "vllm/vllm-openai:v0.25.1",
                     "ports": [{"name": "http", "containerPort": 8000}]}
                ]}
            }
        }
    })
}

/// Evaluates one object on CREATE.
pub fn eval(set: &PolicySet, object: Value) -> Outcome {
    set.evaluate(&EvalInput::for_object(object, Operation::Create))
}
