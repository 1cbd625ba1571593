//! Adopting children another controller wrote: an upstream Hearth installation's (same names,
//! same selectors, see [`crate::labels`]), so replacing upstream Hearth by this one keeps the
//! running model's Deployment, its cache claim and its ScaledObject instead of creating second
//! ones.
//!
//! Server-side apply only removes fields that the applier owned before. A child written by
//! another field manager keeps every field this controller does not set (upstream's serving
//! container next to ours, its environment, its volumes) unless ownership moves first. So before
//! the first apply, [`transfer`] rewrites `metadata.managedFields` the way client-go's
//! `csaupgrade` does: every field the other managers own (outside subresources) becomes owned by
//! [`FIELD_MANAGER`] with operation `Apply`; the apply that follows then prunes what it leaves
//! out. Two things stay with their owners: `spec.replicas` (KEDA's HPA sets it through the scale
//! subresource; a running model keeps its replica count) and whatever a subresource (`status`,
//! `scale`) wrote.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    FieldsV1, ManagedFieldsEntry, ObjectMeta, Time,
};
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, Patch, PatchParams},
};
use serde_json::{Map, Value, json};

use hearth_crds::wellknown::FIELD_MANAGER;

use crate::labels::INSTANCE_LABEL;

/// Whether `meta` belongs to a child this controller has never applied: every child it writes
/// carries `app.kubernetes.io/instance`, upstream Hearth's do not.
pub fn foreign(meta: &ObjectMeta) -> bool {
    !meta
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(INSTANCE_LABEL))
}

/// `managedFields` with the top-level fields of other managers moved to [`FIELD_MANAGER`]
/// (operation `Apply`), except `spec.replicas`, which stays with its owner. `None` when nothing
/// moves (this controller already owns everything outside subresources).
pub fn transfer(entries: &[ManagedFieldsEntry], now: Time) -> Option<Vec<ManagedFieldsEntry>> {
    let mut ours = Value::Object(Map::new());
    let mut kept = Vec::new();
    let mut api_version = None;
    let mut moved = false;
    for e in entries {
        let top_level = e.subresource.as_deref().is_none_or(str::is_empty);
        let is_ours =
            e.manager.as_deref() == Some(FIELD_MANAGER) && e.operation.as_deref() == Some("Apply");
        if !top_level {
            kept.push(e.clone());
            continue;
        }
        let mut fields = e
            .fields_v1
            .as_ref()
            .map(|f| f.0.clone())
            .unwrap_or(Value::Null);
        // spec.replicas stays with whoever set it.
        if let Some(r) = take_replicas(&mut fields) {
            let mut entry = e.clone();
            entry.fields_v1 = Some(FieldsV1(json!({"f:spec": {"f:replicas": r}})));
            kept.push(entry);
        }
        let empty = fields.as_object().is_none_or(Map::is_empty);
        moved |= !is_ours && !empty;
        merge(&mut ours, fields);
        api_version = api_version.or_else(|| e.api_version.clone());
    }
    if !moved {
        return None;
    }
    kept.insert(
        0,
        ManagedFieldsEntry {
            api_version,
            fields_type: Some("FieldsV1".to_owned()),
            fields_v1: Some(FieldsV1(ours)),
            manager: Some(FIELD_MANAGER.to_owned()),
            operation: Some("Apply".to_owned()),
            subresource: None,
            time: Some(now),
        },
    );
    Some(kept)
}

/// Removes `f:spec.f:replicas` from a fieldsV1 set, returning it.
fn take_replicas(fields: &mut Value) -> Option<Value> {
    let spec = fields.get_mut("f:spec")?.as_object_mut()?;
    let r = spec.remove("f:replicas");
    if spec.is_empty() {
        fields.as_object_mut()?.remove("f:spec");
    }
    r
}

/// Union of two fieldsV1 sets (nested objects of `f:`/`k:`/`v:`/`i:` keys, `.` for the node
/// itself).
fn merge(into: &mut Value, from: Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Object(Map::new())), v);
            }
        }
        (a, b) if !b.is_null() && a.as_object().is_none_or(Map::is_empty) => *a = b,
        _ => {}
    }
}

/// Moves ownership of the child `name` (of `resource`, in `namespace`) to this controller when
/// another manager wrote it (see [`transfer`]): one GET, and one PATCH when something moves.
/// The PATCH is guarded by the `resourceVersion` read, so a concurrent write fails it (409) and
/// the reconcile retries.
pub async fn adopt(
    client: &Client,
    resource: &ApiResource,
    namespace: &str,
    name: &str,
) -> Result<bool, kube::Error> {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, resource);
    let Some(live) = api.get_opt(name).await? else {
        return Ok(false);
    };
    let entries = live.metadata.managed_fields.clone().unwrap_or_default();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let Some(entries) = transfer(&entries, now) else {
        return Ok(false);
    };
    let patch = json!({
        "metadata": {
            "resourceVersion": live.metadata.resource_version,
            "managedFields": entries,
        }
    });
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    tracing::info!(%namespace, %name, kind = %resource.kind, "adopted a child another controller wrote");
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(manager: &str, op: &str, sub: Option<&str>, fields: Value) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            api_version: Some("apps/v1".to_owned()),
            fields_type: Some("FieldsV1".to_owned()),
            fields_v1: Some(FieldsV1(fields)),
            manager: Some(manager.to_owned()),
            operation: Some(op.to_owned()),
            subresource: sub.map(str::to_owned),
            time: None,
        }
    }

    fn now() -> Time {
        Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)
    }

    #[test]
    fn other_managers_fields_move_to_ours_but_replicas_and_subresources_stay() {
        let upstream = entry(
            "manager",
            "Update",
            None,
            json!({"f:metadata": {"f:labels": {"f:app": {}}},
                   "f:spec": {"f:replicas": {}, "f:template": {"f:spec": {"f:containers": {"k:{\"name\":\"serving\"}": {".": {}}}}}}}),
        );
        let status = entry(
            "kube-controller-manager",
            "Update",
            Some("status"),
            json!({"f:status": {}}),
        );
        let out = transfer(&[upstream, status.clone()], now()).unwrap();
        assert_eq!(out.len(), 3, "{out:#?}");
        assert_eq!(out[0].manager.as_deref(), Some(FIELD_MANAGER));
        assert_eq!(out[0].operation.as_deref(), Some("Apply"));
        let ours = &out[0].fields_v1.as_ref().unwrap().0;
        assert!(
            ours["f:spec"]["f:template"]["f:spec"]["f:containers"]["k:{\"name\":\"serving\"}"]
                .is_object()
        );
        assert!(ours["f:spec"].get("f:replicas").is_none(), "{ours}");
        assert_eq!(out[1].manager.as_deref(), Some("manager"));
        assert_eq!(
            out[1].fields_v1.as_ref().unwrap().0,
            json!({"f:spec": {"f:replicas": {}}})
        );
        assert_eq!(out[2], status);
    }

    #[test]
    fn nothing_moves_when_everything_is_ours() {
        let ours = entry(
            FIELD_MANAGER,
            "Apply",
            None,
            json!({"f:spec": {"f:template": {}}}),
        );
        // The plain create of a backend leaves replicas with an Update entry of ours.
        let create = entry(
            FIELD_MANAGER,
            "Update",
            None,
            json!({"f:spec": {"f:replicas": {}}}),
        );
        let scale = entry(
            "keda",
            "Update",
            Some("scale"),
            json!({"f:spec": {"f:replicas": {}}}),
        );
        assert!(transfer(&[ours, create, scale], now()).is_none());
    }

    #[test]
    fn our_earlier_entry_is_merged_with_the_moved_fields() {
        let ours = entry(FIELD_MANAGER, "Apply", None, json!({"f:spec": {"f:a": {}}}));
        let create = entry(
            FIELD_MANAGER,
            "Update",
            None,
            json!({"f:spec": {"f:replicas": {}, "f:b": {}}}),
        );
        let out = transfer(&[ours, create], now()).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(
            out[0].fields_v1.as_ref().unwrap().0,
            json!({"f:spec": {"f:a": {}, "f:b": {}}})
        );
        assert_eq!(out[1].operation.as_deref(), Some("Update"));
        assert_eq!(
            out[1].fields_v1.as_ref().unwrap().0,
            json!({"f:spec": {"f:replicas": {}}})
        );
    }
}
