//! The backend: the engine's Deployment (skeleton, then the policy step in [`super::render`])
//! and the Service the gateway finds its pods through.

use std::collections::BTreeMap;

use hearth_crds::InferenceRuntime;
use k8s_openapi::{
    api::{
        apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment},
        core::v1::{
            Capabilities, Container, ContainerPort, EnvVar, PodSpec, PodTemplateSpec,
            ResourceRequirements, SeccompProfile, SecurityContext, Service, Volume, VolumeMount,
        },
    },
    apimachinery::pkg::{
        apis::meta::v1::{LabelSelector, ObjectMeta},
        util::intstr::IntOrString,
    },
};
use kube::ResourceExt;

use super::{Ctx, RenderError};
use crate::{
    labels::{self, Component},
    model::CACHE_MOUNT_PATH,
    names,
    template::{self, TemplateValues},
};

/// The serving container's name: the runtime family (`vllm`), which is how the built-in
/// policies find the model container.
pub fn serving_container(runtime: &InferenceRuntime) -> String {
    match serde_json::to_value(runtime.spec.family) {
        Ok(serde_json::Value::String(s)) => s,
        _ => "server".to_owned(),
    }
}

/// The runtime's `container.env` with the templates of its values rendered (`.Model.Path`,
/// `.Service.Name`, `.Service.Namespace`), as the engine gets it.
///
/// # Errors
/// [`RenderError::Template`] naming the runtime and the entry.
pub(super) fn runtime_env(ctx: &Ctx<'_>) -> Result<Vec<EnvVar>, RenderError> {
    let model_path = ctx.model_path();
    let values = TemplateValues {
        model_path: &model_path,
        service_name: &ctx.name,
        service_namespace: &ctx.namespace,
    };
    ctx.rt
        .spec
        .container
        .env
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let mut e = e.clone();
            if let Some(v) = &e.value {
                e.value = Some(
                    template::render(v, &values, &format!("spec.container.env[{i}].value"))
                        .map_err(|source| RenderError::Template {
                            runtime: ctx.rt.name_any(),
                            source,
                        })?,
                );
            }
            Ok(e)
        })
        .collect()
}

/// The plain backend Deployment before the policy step.
pub(super) fn backend_skeleton(
    ctx: &Ctx<'_>,
    volume: Option<Volume>,
    adapters: Option<&super::RenderedAdapters>,
    create: bool,
) -> Result<Deployment, RenderError> {
    let rt = &ctx.rt.spec;
    let runtime_name = ctx.rt.name_any();
    let model_path = ctx.model_path();
    let values = TemplateValues {
        model_path: &model_path,
        service_name: &ctx.name,
        service_namespace: &ctx.namespace,
    };
    let terr = |source| RenderError::Template {
        runtime: runtime_name.clone(),
        source,
    };
    let mut args = rt
        .container
        .args
        .iter()
        .enumerate()
        .map(|(i, a)| template::render(a, &values, &format!("spec.container.args[{i}]")))
        .collect::<Result<Vec<_>, _>>()
        .map_err(terr)?;
    // argsOverride entries are templates too, rendered with the same values (as upstream).
    for (i, a) in ctx.svc.spec.runtime.args_override.iter().enumerate() {
        args.push(
            template::render(a, &values, &format!("spec.runtime.argsOverride[{i}]")).map_err(
                |source| RenderError::Template {
                    runtime: runtime_name.clone(),
                    source,
                },
            )?,
        );
    }

    // The sleeping tier: the runtime's sleep-mode arguments and environment (once each).
    let sleep = ctx.sleep_tier();
    if let Some(tier) = &sleep {
        for a in &tier.mode.args {
            if !args.contains(a) {
                args.push(a.clone());
            }
        }
    }

    // LoRA adapters: the runtime's adapter arguments and environment (once each).
    if let Some(a) = adapters {
        for arg in &a.args {
            if !args.contains(arg) {
                args.push(arg.clone());
            }
        }
    }

    let cached = volume.is_some() && !ctx.source.is_staged();
    let mut env = runtime_env(ctx)?;
    let sleep_env = sleep.iter().flat_map(|t| t.mode.env.iter().cloned());
    let adapter_env = adapters.iter().flat_map(|a| a.env.iter().cloned());
    for e in ctx
        .cache_env(cached)
        .into_iter()
        .chain(ctx.offline_env())
        .chain(sleep_env)
        .chain(adapter_env)
    {
        if !env.iter().any(|x| x.name == e.name) {
            env.push(e);
        }
    }
    // The cluster's model sources, where the runtime did not set the name.
    let cluster = ctx
        .cfg
        .model_sources
        .env(|n| env.iter().any(|x| x.name == n));
    env.extend(cluster);

    let mut requests = BTreeMap::new();
    let mut limits = BTreeMap::new();
    if let Some(cpu) = &ctx.svc.spec.resources.cpu {
        requests.insert("cpu".to_owned(), cpu.clone());
    }
    if let Some(mem) = &ctx.svc.spec.resources.memory {
        // Memory is request and limit: an engine over its request is the first OOM victim.
        requests.insert("memory".to_owned(), mem.clone());
        limits.insert("memory".to_owned(), mem.clone());
    }
    let mount = volume.as_ref().map(|v| VolumeMount {
        name: v.name.clone(),
        mount_path: CACHE_MOUNT_PATH.to_owned(),
        read_only: ctx.cache_read_only().then_some(true),
        ..Default::default()
    });

    let container = Container {
        name: serving_container(ctx.rt),
        image: Some(rt.container.image.clone()),
        args: (!args.is_empty()).then_some(args),
        env: (!env.is_empty()).then_some(env),
        env_from: ctx.secret_env(),
        ports: Some(vec![ContainerPort {
            name: Some(rt.container.port.name.clone()),
            container_port: rt.container.port.container_port,
            protocol: Some("TCP".to_owned()),
            ..Default::default()
        }]),
        resources: Some(ResourceRequirements {
            requests: (!requests.is_empty()).then_some(requests),
            limits: (!limits.is_empty()).then_some(limits),
            ..Default::default()
        }),
        volume_mounts: Some(
            mount
                .into_iter()
                .chain(adapters.iter().flat_map(|a| a.mounts.iter().cloned()))
                .collect::<Vec<_>>(),
        )
        .filter(|m| !m.is_empty()),
        ..Default::default()
    };
    let selector = labels::selector(&ctx.name, Component::Backend);
    let mut pod = PodSpec {
        containers: vec![container],
        volumes: Some(
            volume
                .into_iter()
                .chain(adapters.iter().flat_map(|a| a.volumes.iter().cloned()))
                .collect::<Vec<_>>(),
        )
        .filter(|v| !v.is_empty()),
        image_pull_secrets: ctx.pull_secrets(),
        enable_service_links: Some(false),
        // The engine never calls the apiserver: no token in the pod (a platform
        // ServingPolicy that needs one sets it back to true).
        automount_service_account_token: Some(false),
        ..Default::default()
    };
    ctx.cfg
        .model_sources
        .mount_ca(&mut pod, &serving_container(ctx.rt));
    Ok(Deployment {
        metadata: ctx.meta(names::backend(&ctx.name), Component::Backend),
        spec: Some(DeploymentSpec {
            replicas: create.then_some(ctx.svc.spec.scaling.min),
            selector: LabelSelector {
                match_labels: Some(selector),
                ..Default::default()
            },
            // A template change replaces each pod in place (old one first): a surge pod would
            // need a second set of accelerators, which a cluster sized for the model lacks, so
            // the rollout would wait forever. The gateway holds requests meanwhile.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".to_owned()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(0)),
                    max_unavailable: Some(IntOrString::Int(1)),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels::labels(&ctx.name, Component::Backend)),
                    ..Default::default()
                }),
                spec: Some(pod),
            },
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The backend Service's port (upstream Hearth's); it targets the runtime's named port.
pub const BACKEND_SERVICE_PORT: i32 = 80;

pub(super) fn backend_service(ctx: &Ctx<'_>) -> Service {
    // Port 80 as upstream Hearth (clients of http://N-backend keep working); the gateway reads
    // the pods' own port from the EndpointSlices.
    let port = &ctx.rt.spec.container.port.name;
    ctx.service(
        names::backend_service(&ctx.name),
        Component::Backend,
        port,
        BACKEND_SERVICE_PORT,
    )
}

/// The serving container's default security context: as much of Pod Security `restricted` as
/// upstream engine images allow. No privilege escalation, every capability dropped, the
/// RuntimeDefault seccomp profile; not `runAsNonRoot` (vLLM's images run as root) and not a
/// read-only root filesystem (vLLM, torch and triton write caches under the home directory and
/// `/tmp`). Devices come from the device plugin, which needs no capability.
pub fn default_backend_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            add: None,
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            localhost_profile: None,
        }),
        ..Default::default()
    }
}

/// Sets the serving container's security context: the runtime's
/// `spec.container.securityContext` when it has one (it replaces the default whole), else
/// [`default_backend_security_context`].
pub(super) fn set_backend_security(backend: &mut Deployment, runtime: &InferenceRuntime) {
    let sc = runtime
        .spec
        .container
        .security_context
        .clone()
        .unwrap_or_else(default_backend_security_context);
    let name = serving_container(runtime);
    if let Some(c) = backend
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
        .and_then(|p| p.containers.iter_mut().find(|c| c.name == name))
    {
        c.security_context = Some(sc);
    }
}
