//! "Is the desired object already there?" — compared against the watch cache, so a steady
//! state issues no apply at all (not even a no-op PATCH).
//!
//! The rule is containment: every field the controller sets (everything but `metadata` and
//! `status`, plus `metadata.labels`, `annotations` and `ownerReferences`) is present in the
//! cached object with an equal value; arrays must match element by element with the same
//! length. Fields others add (apiserver defaults, other managers) do not matter, exactly as they
//! do not for server-side apply. A field someone changed or removed fails the check, so drift is
//! still repaired by the next apply. A value the apiserver normalizes differently (a quantity
//! written `0.5` read back as `500m`) only costs a no-op apply. What containment cannot see, a
//! field the controller stopped setting, the [`APPLIED_HASH_ANNOTATION`] catches.

use serde::Serialize;
use serde_json::Value;

/// The annotation carrying [`applied_hash`] of what the controller last applied to a child.
/// Containment cannot see a field the controller stopped setting (a node selector key removed
/// from a runtime): the hash changes with it, so the child is applied again and server-side
/// apply removes the field the controller's manager owned.
pub const APPLIED_HASH_ANNOTATION: &str = "serving.hearth.dev/applied-hash";

/// Sets [`APPLIED_HASH_ANNOTATION`] on `obj` to [`applied_hash`] of `obj` as it is (without
/// that annotation's earlier value): what the controller applies, and what a cached child it
/// applied carries.
pub fn stamp<K: kube::Resource + Serialize>(obj: &mut K) {
    if let Some(a) = obj.meta_mut().annotations.as_mut() {
        a.remove(APPLIED_HASH_ANNOTATION);
    }
    if let Some(hash) = applied_hash(obj) {
        obj.meta_mut()
            .annotations
            .get_or_insert_with(Default::default)
            .insert(APPLIED_HASH_ANNOTATION.to_owned(), hash);
    }
}

/// [`stamp`]ed `obj`, for tests that build the cache from rendered children.
#[cfg(test)]
pub fn stamped<K: kube::Resource + Serialize>(mut obj: K) -> K {
    stamp(&mut obj);
    obj
}

/// The first 16 hex digits of the SHA-256 of `desired`'s JSON (serde's field order, sorted
/// maps: the same object always gives the same hash); `None` when it does not serialize.
pub fn applied_hash<T: Serialize>(desired: &T) -> Option<String> {
    let json = serde_json::to_vec(desired).ok()?;
    let digest = ring::digest::digest(&ring::digest::SHA256, &json);
    Some(
        digest.as_ref()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
    )
}

/// Whether `cached` already contains everything `desired` sets.
pub fn contains<T: Serialize>(cached: &T, desired: &T) -> bool {
    let (Ok(cached), Ok(desired)) = (serde_json::to_value(cached), serde_json::to_value(desired))
    else {
        return false;
    };
    contains_value(&cached, &desired)
}

/// [`contains`] on JSON values.
pub fn contains_value(cached: &Value, desired: &Value) -> bool {
    let (Some(c), Some(d)) = (cached.as_object(), desired.as_object()) else {
        return false;
    };
    for (key, want) in d {
        match key.as_str() {
            "status" | "apiVersion" | "kind" => continue,
            "metadata" => {
                for field in ["labels", "annotations", "ownerReferences"] {
                    if let Some(w) = want.get(field)
                        && !c
                            .get("metadata")
                            .and_then(|m| m.get(field))
                            .is_some_and(|g| subset(w, g))
                    {
                        return false;
                    }
                }
            }
            _ => {
                if !c.get(key).is_some_and(|got| subset(want, got)) {
                    return false;
                }
            }
        }
    }
    true
}

fn subset(want: &Value, got: &Value) -> bool {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => w
            .iter()
            .all(|(k, v)| g.get(k).is_some_and(|gv| subset(v, gv))),
        (Value::Array(w), Value::Array(g)) => {
            w.len() == g.len() && w.iter().zip(g).all(|(a, b)| subset(a, b))
        }
        (w, g) => w == g,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_added_by_others_do_not_matter() {
        let desired = json!({"metadata": {"name": "x", "labels": {"a": "1"}}, "spec": {"ports": [{"port": 80}]}});
        let cached = json!({
            "metadata": {"name": "x", "resourceVersion": "7", "labels": {"a": "1", "b": "2"}},
            "spec": {"ports": [{"port": 80, "protocol": "TCP"}], "clusterIP": "10.0.0.1"},
            "status": {}
        });
        assert!(contains_value(&cached, &desired));
    }

    #[test]
    fn changed_removed_or_extra_list_items_fail() {
        let desired = json!({"metadata": {"labels": {"a": "1"}}, "spec": {"args": ["x", "y"]}});
        for cached in [
            json!({"metadata": {"labels": {"a": "2"}}, "spec": {"args": ["x", "y"]}}),
            json!({"metadata": {}, "spec": {"args": ["x", "y"]}}),
            json!({"metadata": {"labels": {"a": "1"}}, "spec": {"args": ["x"]}}),
            json!({"metadata": {"labels": {"a": "1"}}, "spec": {"args": ["x", "z"]}}),
            json!({"metadata": {"labels": {"a": "1"}}}),
        ] {
            assert!(!contains_value(&cached, &desired), "{cached}");
        }
    }
}
