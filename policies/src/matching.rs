//! `matchConstraints`: which requests a policy looks at, with the semantics of
//! `admissionregistration.k8s.io/v1` `MatchResources` (resource rules, exclusions, namespace and
//! object label selectors).

use hearth_crds::servingpolicy::{MatchPolicy, MatchResources, NamedRuleWithOperations, Operation};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::Value;

use crate::engine::RequestInfo;

/// The rules used when a policy omits `matchConstraints.resourceRules`: the workloads Hearth
/// handles (Deployments, StatefulSets, Pods) on CREATE and UPDATE.
pub fn default_rules() -> Vec<NamedRuleWithOperations> {
    vec![
        NamedRuleWithOperations {
            api_groups: vec!["apps".into()],
            api_versions: vec!["*".into()],
            resources: vec!["deployments".into(), "statefulsets".into()],
            operations: vec![Operation::Create, Operation::Update],
            ..Default::default()
        },
        NamedRuleWithOperations {
            api_groups: vec!["".into()],
            api_versions: vec!["*".into()],
            resources: vec!["pods".into()],
            operations: vec![Operation::Create, Operation::Update],
            ..Default::default()
        },
    ]
}

fn any_or(list: &[String], value: &str) -> bool {
    list.iter().any(|x| x == "*" || x == value)
}

fn resource_matches(pattern: &str, resource: &str, sub: &str) -> bool {
    let (p_res, p_sub) = pattern.split_once('/').unwrap_or((pattern, ""));
    let res_ok = p_res == "*" || p_res == resource;
    let sub_ok = if pattern.contains('/') {
        p_sub == "*" || p_sub == sub
    } else {
        sub.is_empty()
    };
    // "*" alone matches every resource but no subresource; "*/*" matches all.
    res_ok && sub_ok
}

fn rule_matches(rule: &NamedRuleWithOperations, req: &RequestInfo, exact: bool) -> bool {
    let op_ok = rule
        .operations
        .iter()
        .any(|o| *o == Operation::All || *o == req.operation);
    let group_ok = any_or(&rule.api_groups, &req.resource.group);
    // Equivalent matchPolicy: another version of the same resource also matches.
    let version_ok = !exact || any_or(&rule.api_versions, &req.resource.version);
    let res_ok = rule
        .resources
        .iter()
        .any(|r| resource_matches(r, &req.resource.resource, &req.sub_resource));
    let name_ok = rule.resource_names.is_empty() || rule.resource_names.contains(&req.name);
    let scope_ok = match rule.scope.as_deref() {
        Some("Cluster") => req.namespace.is_empty(),
        Some("Namespaced") => !req.namespace.is_empty(),
        _ => true,
    };
    op_ok && group_ok && version_ok && res_ok && name_ok && scope_ok
}

fn labels(obj: Option<&Value>) -> Option<&serde_json::Map<String, Value>> {
    obj?.get("metadata")?.get("labels")?.as_object()
}

/// Whether labels satisfy a `metav1.LabelSelector` (matchLabels and matchExpressions with
/// In, NotIn, Exists, DoesNotExist). An empty selector matches everything. The rule is
/// `hearth_crds::rules::selector_matches`; this reads the labels from a JSON object.
pub fn selector_matches(
    sel: &LabelSelector,
    labels: Option<&serde_json::Map<String, Value>>,
) -> bool {
    hearth_crds::rules::selector_matches(sel, |k| {
        labels.and_then(|l| l.get(k)).and_then(Value::as_str)
    })
}

/// Whether a policy with these constraints applies to the request.
pub fn matches(
    mc: Option<&MatchResources>,
    req: &RequestInfo,
    object: Option<&Value>,
    old_object: Option<&Value>,
    namespace_object: Option<&Value>,
) -> bool {
    let default = MatchResources::default();
    let mc = mc.unwrap_or(&default);
    let exact = mc.match_policy == Some(MatchPolicy::Exact);
    let included = if mc.resource_rules.is_empty() {
        static DEFAULT: std::sync::LazyLock<Vec<NamedRuleWithOperations>> =
            std::sync::LazyLock::new(default_rules);
        DEFAULT.iter().any(|r| rule_matches(r, req, false))
    } else {
        mc.resource_rules
            .iter()
            .any(|r| rule_matches(r, req, exact))
    };
    if !included
        || mc
            .exclude_resource_rules
            .iter()
            .any(|r| rule_matches(r, req, exact))
    {
        return false;
    }
    if let Some(ns) = &mc.namespace_selector
        && !req.namespace.is_empty()
        && !selector_matches(ns, labels(namespace_object))
    {
        return false;
    }
    if let Some(os) = &mc.object_selector {
        let new_ok = object.is_some() && selector_matches(os, labels(object));
        let old_ok = old_object.is_some() && selector_matches(os, labels(old_object));
        if !new_ok && !old_ok {
            return false;
        }
    }
    true
}
