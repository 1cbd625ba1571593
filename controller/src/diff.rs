//! "Is the desired object already there?" — compared against the watch cache, so a steady
//! state issues no apply at all (not even a no-op PATCH).
//!
//! The rule is containment: every field the controller sets (everything but `metadata` and
//! `status`, plus `metadata.labels`, `annotations` and `ownerReferences`) is present in the
//! cached object with an equal value; arrays must match element by element with the same
//! length. Fields others add (apiserver defaults, other managers) do not matter, exactly as they
//! do not for server-side apply. A field someone changed or removed fails the check, so drift is
//! still repaired by the next apply. A value the apiserver normalizes differently (a quantity
//! written `0.5` read back as `500m`) only costs a no-op apply.

use serde::Serialize;
use serde_json::Value;

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

/// Upgrading Hearth changes an image it puts into backend pods itself, `image` (the drain
/// sidecar's, `settings.drainImage`, which follows the release). Restarting a model server
/// reloads its weights, so that alone should not roll the pods: when `live`'s pod template
/// contains `desired`'s with `live`'s own value for each container whose image is `image`,
/// those values are put into `desired` and `true` is returned. Any other template change rolls
/// the pods anyway, and the new image comes along with it (`false`, `desired` unchanged). The
/// same rule as Istio's sidecars: new pods get the new image, running ones are not restarted
/// for it.
pub fn keep_live_images(
    desired: &mut k8s_openapi::api::apps::v1::Deployment,
    live: &k8s_openapi::api::apps::v1::Deployment,
    image: &str,
) -> bool {
    let (Some(d), Some(l)) = (desired.spec.as_mut(), live.spec.as_ref()) else {
        return false;
    };
    let (Ok(mut want), Ok(got)) = (
        serde_json::to_value(&d.template),
        serde_json::to_value(&l.template),
    ) else {
        return false;
    };
    let mut kept = false;
    for list in ["/spec/containers", "/spec/initContainers"] {
        let live_containers = got.pointer(list).and_then(Value::as_array);
        let Some(containers) = want.pointer_mut(list).and_then(Value::as_array_mut) else {
            continue;
        };
        for c in containers.iter_mut().filter(|c| c["image"] == image) {
            let live_image = live_containers
                .and_then(|cs| cs.iter().find(|l| l["name"] == c["name"]))
                .and_then(|l| l["image"].as_str());
            if let Some(live_image) = live_image
                && live_image != image
            {
                c["image"] = Value::from(live_image);
                kept = true;
            }
        }
    }
    if !kept || !subset(&want, &got) {
        return false;
    }
    match serde_json::from_value(want) {
        Ok(template) => {
            d.template = template;
            true
        }
        Err(_) => false,
    }
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

    fn backend(drain: &str, memory: &str) -> k8s_openapi::api::apps::v1::Deployment {
        serde_json::from_value(json!({
            "metadata": {"name": "m-backend"},
            "spec": {
                "selector": {"matchLabels": {"app": "m"}},
                "template": {
                    "metadata": {"labels": {"app": "m"}},
                    "spec": {
                        "initContainers": [
                            {"name": "hearth-drain", "image": drain, "restartPolicy": "Always"},
                            {"name": "fetch", "image": "busybox"}
                        ],
                        "containers": [{"name": "model", "image": "vllm/vllm-openai:v0.11",
                            "resources": {"limits": {"memory": memory}}}]
                    }
                }
            }
        }))
        .unwrap()
    }

    fn drain_image(d: &k8s_openapi::api::apps::v1::Deployment) -> Option<String> {
        d.spec
            .as_ref()?
            .template
            .spec
            .as_ref()?
            .init_containers
            .as_ref()?[0]
            .image
            .clone()
    }

    #[test]
    fn an_upgrade_alone_keeps_the_running_drain_image() {
        let live = backend("hearth/gw:v1", "1Gi");
        let mut desired = backend("hearth/gw:v2", "1Gi");
        assert!(keep_live_images(&mut desired, &live, "hearth/gw:v2"));
        assert_eq!(drain_image(&desired).as_deref(), Some("hearth/gw:v1"));
        assert!(contains(&live, &desired), "nothing left to apply");
    }

    #[test]
    fn another_template_change_takes_the_new_image_along() {
        let live = backend("hearth/gw:v1", "1Gi");
        let mut desired = backend("hearth/gw:v2", "2Gi");
        assert!(!keep_live_images(&mut desired, &live, "hearth/gw:v2"));
        assert_eq!(drain_image(&desired).as_deref(), Some("hearth/gw:v2"));
    }

    #[test]
    fn nothing_to_keep_when_the_image_is_current_or_new() {
        let live = backend("hearth/gw:v2", "1Gi");
        let mut desired = backend("hearth/gw:v2", "1Gi");
        assert!(!keep_live_images(&mut desired, &live, "hearth/gw:v2"));
        // A sidecar the live pods do not have yet is added, with the current image.
        let mut live = backend("x", "1Gi");
        if let Some(spec) = live.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
            spec.init_containers = None;
        }
        let mut desired = backend("hearth/gw:v2", "1Gi");
        assert!(!keep_live_images(&mut desired, &live, "hearth/gw:v2"));
        assert_eq!(drain_image(&desired).as_deref(), Some("hearth/gw:v2"));
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
