//! The executor: sends a [`Plan`]'s writes in order, and turns what the API answers into
//! conditions ([`plan::recovery`] decides how). Each write is one request (an adoption one or
//! two, see [`adopt::adopt`]) and counts once in `hearth_controller_writes_total`.

use hearth_crds::wellknown::FIELD_MANAGER;
use k8s_openapi::api::{
    apps::v1::Deployment,
    batch::v1::Job,
    core::v1::{ConfigMap, PersistentVolumeClaim, Service, ServiceAccount},
    networking::v1::NetworkPolicy,
    policy::v1::PodDisruptionBudget,
    rbac::v1::{Role, RoleBinding},
};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};

use super::{
    Context, Error, kube_err,
    plan::{self, Plan, Recovery},
    write::{Kind, Write},
};
use crate::adopt;

/// Sends `plan`'s writes in order. An API error the plan expects becomes a condition of `plan`
/// (or the recovery writes of a backend create that met an existing Deployment); any other
/// stops the reconcile.
pub async fn execute(ctx: &Context, namespace: &str, plan: &mut Plan) -> Result<(), Error> {
    let writes = std::mem::take(&mut plan.writes);
    for write in &writes {
        let Err(error) = send(ctx, namespace, write).await else {
            continue;
        };
        let kube::Error::Api(response) = &error else {
            return Err(kube_err(write.action(namespace))(error));
        };
        match plan::recovery(write, response) {
            Recovery::Fail => return Err(kube_err(write.action(namespace))(error)),
            Recovery::Done => {}
            Recovery::Report(cond) => plan.set_condition(cond),
            Recovery::ReadBackend(backend) => {
                let name = backend.metadata.name.clone().unwrap_or_default();
                let api: Api<Deployment> = Api::namespaced(ctx.client.clone(), namespace);
                let live = api
                    .get(&name)
                    .await
                    .map_err(kube_err(format!("get Deployment {namespace}/{name}")))?;
                let drain_image = ctx.render.drain_image.as_deref();
                for w in plan::after_conflict(backend, &live, drain_image) {
                    send(ctx, namespace, &w)
                        .await
                        .map_err(kube_err(w.action(namespace)))?;
                }
            }
        }
    }
    plan.writes = writes;
    Ok(())
}

/// One write as one API call (an adoption: a GET and, when something moves, a PATCH).
pub(super) async fn send(ctx: &Context, namespace: &str, write: &Write) -> Result<(), kube::Error> {
    ctx.metrics.writes.inc();
    match write {
        Write::Apply(object) => {
            let target = object.target();
            dynamic(ctx, namespace, target.kind)
                .patch(
                    &target.name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(object),
                )
                .await?;
        }
        Write::Adopt(target) => {
            let resource = resource(target.kind, &ctx.render.keda_api);
            adopt::adopt(&ctx.client, &resource, namespace, &target.name).await?;
        }
        Write::Create(backend) => {
            let api: Api<Deployment> = Api::namespaced(ctx.client.clone(), namespace);
            let pp = PostParams {
                field_manager: Some(FIELD_MANAGER.to_owned()),
                ..Default::default()
            };
            api.create(&pp, backend).await?;
        }
        // Background propagation: a Job's pods go with it (batch/v1's default is to orphan them).
        Write::Delete(target) => {
            dynamic(ctx, namespace, target.kind)
                .delete(&target.name, &kube::api::DeleteParams::background())
                .await?;
        }
    }
    Ok(())
}

/// Applies `status` to `obj` (the status subresource, server-side apply under the controller's
/// field manager): an LLMService's or an LLMEndpoint's.
///
/// # Errors
/// The API call's, naming the kind and object.
pub async fn write_status<K>(
    ctx: &Context,
    obj: &K,
    status: &impl serde::Serialize,
) -> Result<(), Error>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    use kube::ResourceExt;
    let name = obj.name_any();
    let namespace = obj.namespace().unwrap_or_default();
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &namespace);
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    ctx.metrics.writes.inc();
    api.patch_status(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(kube_err(format!(
        "apply status of {} {namespace}/{name}",
        K::kind(&())
    )))?;
    Ok(())
}

fn dynamic(ctx: &Context, namespace: &str, kind: Kind) -> Api<DynamicObject> {
    Api::namespaced_with(
        ctx.client.clone(),
        namespace,
        &resource(kind, &ctx.render.keda_api),
    )
}

/// The API of `kind`; `keda` is the ScaledObject's.
fn resource(kind: Kind, keda: &ApiResource) -> ApiResource {
    match kind {
        Kind::ServiceAccount => ApiResource::erase::<ServiceAccount>(&()),
        Kind::Role => ApiResource::erase::<Role>(&()),
        Kind::RoleBinding => ApiResource::erase::<RoleBinding>(&()),
        Kind::PersistentVolumeClaim => ApiResource::erase::<PersistentVolumeClaim>(&()),
        Kind::Job => ApiResource::erase::<Job>(&()),
        Kind::Service => ApiResource::erase::<Service>(&()),
        Kind::Deployment => ApiResource::erase::<Deployment>(&()),
        Kind::PodDisruptionBudget => ApiResource::erase::<PodDisruptionBudget>(&()),
        Kind::ScaledObject => keda.clone(),
        Kind::ConfigMap => ApiResource::erase::<ConfigMap>(&()),
        Kind::NetworkPolicy => ApiResource::erase::<NetworkPolicy>(&()),
    }
}
