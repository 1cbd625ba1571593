//! `ApplyConfiguration` mutations: merging a partial object into the object.
//!
//! This approximates server-side apply's structured merge (sigs.k8s.io/structured-merge-diff)
//! without OpenAPI schemas:
//! - maps merge key by key, recursively;
//! - lists that Kubernetes declares as `listType: map` merge by their key for the well-known
//!   pod fields below (`containers`, `volumes`, `env`, … by `name`; `ports` by `containerPort`;
//!   `volumeMounts` by `mountPath`); new entries are appended in order;
//! - every other list is atomic and replaced whole (as SMD does for `listType: atomic`, e.g.
//!   `tolerations`, `args`);
//! - a `null` value removes the field (SMD apply cannot remove fields another manager owns;
//!   there is only one manager here).

use serde_json::{Map, Value};

/// The merge key of list fields Kubernetes types declare as `listType: map`.
fn list_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "imagePullSecrets"
        | "resourceClaims"
        | "readinessGates"
        | "schedulingGates" => {
            if field == "readinessGates" {
                "conditionType"
            } else {
                "name"
            }
        }
        "ports" => "containerPort",
        "volumeMounts" => "mountPath",
        "volumeDevices" => "devicePath",
        "hostAliases" => "ip",
        "conditions" => "type",
        _ => return None,
    })
}

/// Merges `patch` into `target` in place (see the module docs for the rules).
pub fn apply(target: &mut Value, patch: &Value) {
    stacker::maybe_grow(256 * 1024, 4 << 20, || merge_value(target, patch, None));
}

fn merge_value(target: &mut Value, patch: &Value, field: Option<&str>) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => merge_map(t, p),
        (Value::Array(t), Value::Array(p)) => match field.and_then(list_key) {
            Some(key) if keyed(t, key) && keyed(p, key) => merge_list(t, p, key),
            _ => *t = p.clone(),
        },
        (t, p) => *t = p.clone(),
    }
}

fn keyed(list: &[Value], key: &str) -> bool {
    list.iter().all(|x| x.get(key).is_some())
}

fn merge_map(t: &mut Map<String, Value>, p: &Map<String, Value>) {
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
            continue;
        }
        match t.get_mut(k) {
            Some(existing) => merge_value(existing, v, Some(k)),
            None => {
                let mut fresh = v.clone();
                strip_nulls(&mut fresh);
                t.insert(k.clone(), fresh);
            }
        }
    }
}

fn strip_nulls(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|_, x| !x.is_null());
            m.values_mut().for_each(strip_nulls);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

fn merge_list(t: &mut Vec<Value>, p: &[Value], key: &str) {
    for item in p {
        let k = item.get(key);
        match t.iter_mut().find(|x| x.get(key) == k) {
            Some(existing) => merge_value(existing, item, None),
            None => {
                let mut fresh = item.clone();
                strip_nulls(&mut fresh);
                t.push(fresh);
            }
        }
    }
}
