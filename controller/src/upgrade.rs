//! Upgrades restart no model.
//!
//! The backend's pod template carries an image Hearth supplies itself: the drain sidecar's
//! (`settings.drainImage`, by default the gateway image, whose tag follows the release). A new
//! release would change every backend's template and restart every running model server, each
//! reloading its weights. Instead a backend with pods keeps the image it runs until it is at
//! zero replicas (no pod to restart) or its template changes for another reason (the pods roll
//! anyway, and the new image comes along). The same rule as Istio's sidecars: new pods get the
//! new image, running ones are not restarted for it.
//!
//! Only an image the controller put there itself is kept: the Deployment's
//! [`DRAIN_IMAGE_ANNOTATION`] records it, so an edit by someone else is repaired, not kept.

use std::collections::BTreeMap;

use hearth_crds::wellknown::DRAIN_IMAGE_ANNOTATION;
use k8s_openapi::api::apps::v1::Deployment;
use serde_json::Value;

use crate::diff;

const CONTAINER_LISTS: [&str; 2] = ["/spec/containers", "/spec/initContainers"];

/// Records `image` in `backend`'s [`DRAIN_IMAGE_ANNOTATION`] when its pod template runs it
/// (the policy added the drain sidecar).
pub fn mark(mut backend: Deployment, image: Option<&str>) -> Deployment {
    let Some(image) = image else { return backend };
    let runs_it = backend
        .spec
        .as_ref()
        .and_then(|s| serde_json::to_value(&s.template).ok())
        .is_some_and(|t| {
            CONTAINER_LISTS.iter().any(|list| {
                t.pointer(list)
                    .and_then(Value::as_array)
                    .is_some_and(|cs| cs.iter().any(|c| c["image"] == image))
            })
        });
    if runs_it {
        backend
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(DRAIN_IMAGE_ANNOTATION.to_owned(), image.to_owned());
    }
    backend
}

/// The drain image recorded on `backend` by [`mark`].
pub fn recorded(backend: &Deployment) -> Option<&str> {
    backend
        .metadata
        .annotations
        .as_ref()?
        .get(DRAIN_IMAGE_ANNOTATION)
        .map(String::as_str)
}

/// Fields of the backend's pod spec that a release of Hearth began to set, as JSON pointers
/// into the pod template: a live template without one keeps going without it while it has
/// pods, like the drain image ([`keep_live_template`]). `automountServiceAccountToken: false`
/// (the engine never calls the apiserver) is one.
pub const ADDED_BY_RELEASES: [&str; 1] = ["/spec/automountServiceAccountToken"];

/// Takes what a new release of Hearth alone changed in `desired`'s pod template back to what
/// `live` runs, when nothing else differs: the drain image (rendered as `image`, marked by
/// [`mark`]) when `live` still runs the image its annotation records, and each field of
/// [`ADDED_BY_RELEASES`] that `live` does not set. Returns whether it did; otherwise `desired`
/// is left as it is (its template changes anyway, and the new values come along). Call it
/// only for a backend that has or wants pods: at zero, taking the new template costs nothing.
pub fn keep_live_template(
    desired: &mut Deployment,
    live: &Deployment,
    image: Option<&str>,
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
    let kept_image = match image {
        Some(image) => match keep_image(&mut want, &got, recorded(live), image) {
            Some(kept) => kept,
            None => return false,
        },
        None => None,
    };
    let mut kept_fields = false;
    for pointer in ADDED_BY_RELEASES {
        if got.pointer(pointer).is_none() && remove(&mut want, pointer) {
            kept_fields = true;
        }
    }
    if (kept_image.is_none() && !kept_fields) || !diff::contains_value(&got, &want) {
        return false;
    }
    let Ok(template) = serde_json::from_value(want) else {
        return false;
    };
    d.template = template;
    if let Some(recorded) = kept_image {
        desired
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(DRAIN_IMAGE_ANNOTATION.to_owned(), recorded);
    }
    true
}

/// Puts the `recorded` drain image back into the template `want` wherever it runs `image`
/// and `got` (the live template) runs `recorded` in the same container: `Some(Some(recorded))`
/// when it did, `Some(None)` when there was nothing to keep (no record, the same image, or a
/// sidecar the live pods do not have), `None` when a container runs another image than the
/// record (someone else's edit, repaired rather than kept).
fn keep_image(
    want: &mut Value,
    got: &Value,
    recorded: Option<&str>,
    image: &str,
) -> Option<Option<String>> {
    let Some(recorded) = recorded.filter(|r| *r != image) else {
        return Some(None);
    };
    let mut kept = false;
    for list in CONTAINER_LISTS {
        let live_containers = got.pointer(list).and_then(Value::as_array);
        let Some(containers) = want.pointer_mut(list).and_then(Value::as_array_mut) else {
            continue;
        };
        for c in containers.iter_mut().filter(|c| c["image"] == image) {
            let runs_recorded = live_containers
                .and_then(|cs| cs.iter().find(|l| l["name"] == c["name"]))
                .is_some_and(|l| l["image"] == recorded);
            if !runs_recorded {
                return None;
            }
            c["image"] = Value::from(recorded);
            kept = true;
        }
    }
    Some(kept.then(|| recorded.to_owned()))
}

/// Removes the member `pointer` names from `v`; whether it was there.
fn remove(v: &mut Value, pointer: &str) -> bool {
    let Some((parent, key)) = pointer.rsplit_once('/') else {
        return false;
    };
    v.pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .is_some_and(|o| o.remove(key).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A backend as rendered with drain image `drain`, marked.
    fn backend(drain: &str, memory: &str) -> Deployment {
        let d = serde_json::from_value(json!({
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
        .unwrap();
        mark(d, Some(drain))
    }

    fn drain_image(d: &Deployment) -> Option<String> {
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
        assert!(keep_live_template(
            &mut desired,
            &live,
            Some("hearth/gw:v2")
        ));
        assert_eq!(drain_image(&desired).as_deref(), Some("hearth/gw:v1"));
        assert!(diff::contains(&live, &desired), "nothing left to apply");
    }

    #[test]
    fn an_image_someone_else_set_is_repaired_not_kept() {
        // The controller put v1 there; someone edited the sidecar to another image since.
        let mut live = backend("hearth/gw:v1", "1Gi");
        let edited = backend("evil.example.com/drain:1", "1Gi");
        live.spec = edited.spec;
        let mut desired = backend("hearth/gw:v2", "1Gi");
        assert!(!keep_live_template(
            &mut desired,
            &live,
            Some("hearth/gw:v2")
        ));
        assert_eq!(drain_image(&desired).as_deref(), Some("hearth/gw:v2"));
        // Without the controller's record (a backend made before it kept one), nothing is kept.
        let mut live = backend("hearth/gw:v1", "1Gi");
        live.metadata.annotations = None;
        let mut desired = backend("hearth/gw:v2", "1Gi");
        assert!(!keep_live_template(
            &mut desired,
            &live,
            Some("hearth/gw:v2")
        ));
    }

    #[test]
    fn mark_records_only_an_image_the_template_runs() {
        let d = backend("hearth/gw:v1", "1Gi");
        assert_eq!(recorded(&d), Some("hearth/gw:v1"));
        let d = mark(backend("hearth/gw:v1", "1Gi"), Some("other/image:1"));
        assert_eq!(
            recorded(&d),
            Some("hearth/gw:v1"),
            "another image is not recorded"
        );
    }

    #[test]
    fn another_template_change_takes_the_new_image_along() {
        let live = backend("hearth/gw:v1", "1Gi");
        let mut desired = backend("hearth/gw:v2", "2Gi");
        assert!(!keep_live_template(
            &mut desired,
            &live,
            Some("hearth/gw:v2")
        ));
        assert_eq!(drain_image(&desired).as_deref(), Some("hearth/gw:v2"));
    }

    #[test]
    fn nothing_to_keep_when_the_image_is_current_or_new() {
        let live = backend("hearth/gw:v2", "1Gi");
        let mut desired = backend("hearth/gw:v2", "1Gi");
        assert!(!keep_live_template(
            &mut desired,
            &live,
            Some("hearth/gw:v2")
        ));
        // A sidecar the live pods do not have yet is added, with the current image.
        let mut live = backend("x", "1Gi");
        live.metadata.annotations = None;
        if let Some(spec) = live.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
            spec.init_containers = None;
        }
        let mut desired = backend("hearth/gw:v2", "1Gi");
        assert!(!keep_live_template(
            &mut desired,
            &live,
            Some("hearth/gw:v2")
        ));
        assert_eq!(drain_image(&desired).as_deref(), Some("hearth/gw:v2"));
    }

    /// `d` with `automountServiceAccountToken: false` in its pod template, as rendered since
    /// that field came with a release.
    fn without_token(mut d: Deployment) -> Deployment {
        if let Some(spec) = d.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
            spec.automount_service_account_token = Some(false);
        }
        d
    }

    fn automount(d: &Deployment) -> Option<bool> {
        d.spec
            .as_ref()?
            .template
            .spec
            .as_ref()?
            .automount_service_account_token
    }

    #[test]
    fn a_field_a_release_added_waits_like_the_drain_image() {
        // The same drain image, only the new field: the live template is kept.
        let live = backend("hearth/gw:v2", "1Gi");
        let mut desired = without_token(backend("hearth/gw:v2", "1Gi"));
        assert!(keep_live_template(
            &mut desired,
            &live,
            Some("hearth/gw:v2")
        ));
        assert_eq!(automount(&desired), None);
        assert!(diff::contains(&live, &desired), "nothing left to apply");
        // Both at once (an upgrade from a release before either), and without a drain image.
        let live = backend("hearth/gw:v1", "1Gi");
        let mut desired = without_token(backend("hearth/gw:v2", "1Gi"));
        assert!(keep_live_template(
            &mut desired,
            &live,
            Some("hearth/gw:v2")
        ));
        assert_eq!(
            (automount(&desired), drain_image(&desired).as_deref()),
            (None, Some("hearth/gw:v1"))
        );
        let mut desired = without_token(backend("hearth/gw:v1", "1Gi"));
        assert!(keep_live_template(&mut desired, &live, None));
        // Another change rolls the pods anyway: the field comes along.
        let mut desired = without_token(backend("hearth/gw:v2", "2Gi"));
        assert!(!keep_live_template(
            &mut desired,
            &live,
            Some("hearth/gw:v2")
        ));
        assert_eq!(automount(&desired), Some(false));
        // A live template that has it (even set otherwise by someone) is not a release's gap.
        let live = without_token(backend("hearth/gw:v2", "1Gi"));
        let mut desired = without_token(backend("hearth/gw:v2", "1Gi"));
        assert!(!keep_live_template(
            &mut desired,
            &live,
            Some("hearth/gw:v2")
        ));
    }
}
