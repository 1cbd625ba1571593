//! The gateway: its Deployment (flags, replicas, security, API keys), the client-facing and
//! scaler Services, its ServiceAccount, Role and RoleBinding, its PodDisruptionBudget, and the
//! gateway container's resources (`--gateway-resources`).

use std::collections::BTreeMap;

use hearth_crds::{
    LLMService,
    llmservice::ColdStartMode,
    quantity::{compare_quantities, is_quantity},
};
use k8s_openapi::{
    api::{
        apps::v1::{Deployment, DeploymentSpec},
        core::v1::{
            Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, KeyToPath,
            Lifecycle, LifecycleHandler, ObjectFieldSelector, PodSecurityContext, PodSpec,
            PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile, SecretVolumeSource,
            SecurityContext, Service, SleepAction, TopologySpreadConstraint, Volume, VolumeMount,
        },
        policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec},
        rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject},
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{LabelSelector, ObjectMeta},
        util::intstr::IntOrString,
    },
};

use super::{BACKEND_SERVICE_PORT, Ctx, RenderError, ScalerMode, duration_secs};
use crate::{
    labels::{self, Component},
    names,
};

/// The gateway container's default resources: requests `cpu: 50m`, `memory: 64Mi`; limit
/// `memory: 512Mi`. The limit keeps the pod admissible where a policy or a `ResourceQuota` on
/// `limits.memory` requires one, and the gateway bounds the request bodies it holds to half of it
/// (`--body-memory-limit`, 256 MiB here); the rest covers ~9 KiB per open connection. No CPU
/// limit: throttling a proxy adds latency to every request.
pub fn default_gateway_resources() -> ResourceRequirements {
    let q = |v: &str| Quantity(v.to_owned());
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), q("50m")),
            ("memory".to_owned(), q("64Mi")),
        ])),
        limits: Some(BTreeMap::from([("memory".to_owned(), q("512Mi"))])),
        ..Default::default()
    }
}

/// The least memory limit a gateway container may have: the gateway keeps half of it for request
/// bodies, which must hold one body of `--body-limit` (8 MiB; the controller sets no other).
const GATEWAY_MIN_MEMORY_LIMIT: &str = "16Mi";

/// Gateway container resources from JSON, a Kubernetes `ResourceRequirements` such as
/// `{"requests":{"cpu":"50m","memory":"64Mi"},"limits":{"memory":"512Mi"}}`.
///
/// # Errors
/// A message naming the field, so that a value the apiserver would refuse for every gateway
/// Deployment stops the controller at start instead:
/// - not JSON, not a `ResourceRequirements`, a field other than `requests` and `limits`;
/// - a resource other than `cpu`, `memory` and `ephemeral-storage` (the gateway uses no device);
/// - a value that is not a non-negative quantity (apimachinery's `ParseQuantity` syntax);
/// - a request above its limit, or a memory limit below 16Mi (compared
///   when both are in the plain form, `500m` or `1.5Gi`).
pub fn parse_gateway_resources(json: &str) -> Result<ResourceRequirements, String> {
    use std::cmp::Ordering::{Greater, Less};
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
    let serde_json::Value::Object(fields) = &value else {
        return Err("must be a JSON object with requests and limits".to_owned());
    };
    if let Some(other) = fields.keys().find(|k| *k != "requests" && *k != "limits") {
        return Err(format!(
            "unknown field {other:?}: only requests and limits are set on the gateway"
        ));
    }
    let r: ResourceRequirements = serde_json::from_value(value).map_err(|e| {
        format!("not a ResourceRequirements ({e}), like {{\"limits\":{{\"memory\":\"512Mi\"}}}}")
    })?;
    for (kind, list) in [("requests", &r.requests), ("limits", &r.limits)] {
        for (name, Quantity(v)) in list.iter().flatten() {
            if !matches!(name.as_str(), "cpu" | "memory" | "ephemeral-storage") {
                return Err(format!(
                    "{kind}.{name}: the gateway takes cpu, memory and ephemeral-storage only"
                ));
            }
            if v.starts_with('-') {
                return Err(format!("{kind}.{name}: {v:?} must not be negative"));
            }
            if !is_quantity(v) {
                return Err(format!(
                    "{kind}.{name}: {v:?} is not a quantity; write it like \"500m\", \"256Mi\" or \"1.5\""
                ));
            }
        }
    }
    let limit_of = |name: &str| r.limits.as_ref().and_then(|l| l.get(name));
    for (name, Quantity(request)) in r.requests.iter().flatten() {
        if let Some(Quantity(limit)) = limit_of(name)
            && compare_quantities(request, limit) == Some(Greater)
        {
            return Err(format!(
                "requests.{name} ({request}) is above limits.{name} ({limit}); a request must not exceed its limit"
            ));
        }
    }
    if let Some(Quantity(limit)) = limit_of("memory")
        && compare_quantities(limit, GATEWAY_MIN_MEMORY_LIMIT) == Some(Less)
    {
        return Err(format!(
            "limits.memory ({limit}) is below {GATEWAY_MIN_MEMORY_LIMIT}: the gateway keeps half its memory limit for request bodies of up to 8Mi each"
        ));
    }
    Ok(r)
}

pub(super) fn gateway_service(ctx: &Ctx<'_>) -> Service {
    let name = names::gateway_service(&ctx.name);
    ctx.service(name, Component::Gateway, "http", 80)
}

pub(super) fn scaler_service(ctx: &Ctx<'_>) -> Service {
    let name = names::scaler_service(&ctx.name);
    let mut service = ctx.service(name, Component::Gateway, "grpc-scaler", ctx.cfg.scaler_port);
    if let Some(spec) = service.spec.as_mut() {
        spec.type_ = Some("ClusterIP".to_owned());
    }
    service
}

pub(super) fn gateway_role(ctx: &Ctx<'_>) -> Role {
    let mut rules = vec![PolicyRule {
        api_groups: Some(vec!["discovery.k8s.io".to_owned()]),
        resources: Some(vec!["endpointslices".to_owned()]),
        verbs: vec!["get".to_owned(), "list".to_owned(), "watch".to_owned()],
        ..Default::default()
    }];
    // The sleeping tier reports engines put to sleep and woken as Events on the LLMService,
    // and the last wake in its `status.lastWake` (server-side apply on this one object).
    if ctx.sleep_tier().is_some() {
        rules.push(PolicyRule {
            api_groups: Some(vec!["events.k8s.io".to_owned()]),
            resources: Some(vec!["events".to_owned()]),
            verbs: vec!["create".to_owned(), "patch".to_owned()],
            ..Default::default()
        });
        rules.push(PolicyRule {
            api_groups: Some(vec![
                <LLMService as kube::Resource>::group(&()).into_owned(),
            ]),
            resources: Some(vec!["llmservices/status".to_owned()]),
            resource_names: Some(vec![ctx.name.clone()]),
            verbs: vec!["patch".to_owned()],
            ..Default::default()
        });
    }
    Role {
        metadata: ctx.meta(names::gateway(&ctx.name), Component::Gateway),
        rules: Some(rules),
    }
}

pub(super) fn gateway_role_binding(ctx: &Ctx<'_>) -> RoleBinding {
    RoleBinding {
        metadata: ctx.meta(names::gateway(&ctx.name), Component::Gateway),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".to_owned(),
            kind: "Role".to_owned(),
            name: names::gateway(&ctx.name),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_owned(),
            name: names::gateway(&ctx.name),
            namespace: Some(ctx.namespace.clone()),
            ..Default::default()
        }]),
    }
}

/// The gateway queue bound: enough for every replica at its target, ten times over, and never
/// below 100 (the API has no field for it yet).
pub fn max_queue(service: &LLMService) -> i64 {
    let s = &service.spec.scaling;
    (i64::from(s.target) * i64::from(s.max) * 10).max(100)
}

fn http_probe(path: &str, period: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String("http".to_owned()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        ..Default::default()
    }
}

/// Seconds a terminating gateway keeps serving before it is signalled (its preStop `sleep`):
/// the window in which its endpoint leaves every node's Service rules (kube-proxy syncs at most
/// once a second by default, later under load). Without it a rollout of the gateway (a Hearth
/// upgrade re-renders its image) refuses the connections kube-proxy still sends to the old pod.
pub const GATEWAY_SHUTDOWN_DELAY_SECONDS: i64 = 5;

pub(super) fn gateway_deployment(ctx: &Ctx<'_>) -> Result<Deployment, RenderError> {
    let s = &ctx.svc.spec.scaling;
    let cold = &ctx.svc.spec.endpoint.cold_start;
    let drain = duration_secs(&s.drain_timeout, "spec.scaling.drainTimeout")?;
    duration_secs(&s.activation_timeout, "spec.scaling.activationTimeout")?;
    duration_secs(
        &cold.heartbeat_interval,
        "spec.endpoint.coldStart.heartbeatInterval",
    )?;
    let backend_port = &ctx.rt.spec.container.port;
    // Flags of `hearth-gateway` (docs/gateway.md); the namespace comes from POD_NAMESPACE.
    let mut args = vec![
        format!("--listen=[::]:{}", ctx.cfg.gateway_port),
        format!("--backend-service={}", names::backend_service(&ctx.name)),
        format!("--backend-port={BACKEND_SERVICE_PORT}"),
        format!("--backend-port-name={}", backend_port.name),
        // The runtime templates serve the model under the service name.
        format!("--served-model-name={}", ctx.name),
        format!("--max-queue={}", max_queue(ctx.svc)),
        format!(
            "--cold-start={}",
            match cold.mode {
                ColdStartMode::Keepalive => "keepalive",
                ColdStartMode::Reject => "reject",
            }
        ),
        format!("--heartbeat-interval={}", cold.heartbeat_interval),
        format!("--activation-timeout={}", s.activation_timeout),
        format!("--drain-timeout={}", s.drain_timeout),
        format!("--metric-target={}", s.target),
    ];
    let mut ports = vec![ContainerPort {
        name: Some("http".to_owned()),
        container_port: ctx.cfg.gateway_port,
        protocol: Some("TCP".to_owned()),
        ..Default::default()
    }];
    if ctx.scaler == ScalerMode::Push {
        args.push(format!("--scaler-listen=[::]:{}", ctx.cfg.scaler_port));
        ports.push(ContainerPort {
            name: Some("grpc-scaler".to_owned()),
            container_port: ctx.cfg.scaler_port,
            protocol: Some("TCP".to_owned()),
            ..Default::default()
        });
    }
    if ctx.gateway_peers() {
        args.push(format!(
            "--peer-service={}",
            names::gateway_service(&ctx.name)
        ));
    }
    if let (Some(tier), Some(sleep)) = (ctx.sleep_tier(), &s.sleep) {
        args.push(format!("--sleep-after={}", sleep.after));
        args.push(format!("--sleep-level={}", tier.level));
        args.push(format!("--sleep-path={}", tier.mode.sleep_path));
        args.push(format!("--is-sleeping-path={}", tier.mode.is_sleeping_path));
        for call in &tier.wake_up {
            args.push(match &call.body {
                Some(body) => format!("--wake-up-call={} {body}", call.path),
                None => format!("--wake-up-call={}", call.path),
            });
        }
        args.push(format!("--llmservice={}", ctx.name));
        if let Some(uid) = &ctx.svc.metadata.uid {
            args.push(format!("--llmservice-uid={uid}"));
        }
    }
    let field_env = |name: &str, path: &str| EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_owned(),
                api_version: None,
            }),
            ..Default::default()
        }),
    };
    let container = Container {
        name: "gateway".to_owned(),
        image: Some(ctx.cfg.gateway_image.clone()),
        args: Some(args),
        env: Some(vec![
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            field_env("POD_IPS", "status.podIPs"),
        ]),
        ports: Some(ports),
        readiness_probe: Some(http_probe("/readyz", 5)),
        liveness_probe: Some(http_probe("/healthz", 10)),
        resources: Some(ctx.cfg.gateway_resources.clone()),
        // Keeps serving while its endpoint is withdrawn; SIGTERM (the drain) comes after.
        lifecycle: Some(Lifecycle {
            pre_stop: Some(LifecycleHandler {
                sleep: Some(SleepAction {
                    seconds: GATEWAY_SHUTDOWN_DELAY_SECONDS,
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    Ok(Deployment {
        metadata: ctx.meta(names::gateway(&ctx.name), Component::Gateway),
        spec: Some(DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(labels::selector(&ctx.name, Component::Gateway)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels::labels(&ctx.name, Component::Gateway)),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(names::gateway(&ctx.name)),
                    containers: vec![container],
                    image_pull_secrets: ctx.pull_secrets(),
                    // The shutdown delay, then held and streaming requests finish within
                    // the drain window.
                    termination_grace_period_seconds: Some(
                        i64::try_from(drain).unwrap_or(i64::MAX / 2)
                            + GATEWAY_SHUTDOWN_DELAY_SECONDS
                            + 5,
                    ),
                    enable_service_links: Some(false),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// Gateway replicas: `spec.endpoint.replicas`, default 1.
pub fn gateway_replicas(service: &LLMService) -> i32 {
    service.spec.endpoint.replicas.unwrap_or(1).max(1)
}

/// UID and GID the gateway runs as: the image's `USER 65532:65532` (distroless "nonroot"),
/// stated in the pod so `runAsNonRoot` can be checked without reading the image.
pub const GATEWAY_UID: i64 = 65532;

/// Directory the API key Secret is mounted at, and the file (the Secret key's projection) the
/// gateway reads with `--api-key-file`.
pub const API_KEY_DIR: &str = "/etc/hearth/api-keys";
/// File name of the API keys under [`API_KEY_DIR`].
pub const API_KEY_FILE: &str = "keys";

/// Pod Security `restricted` for the gateway pod: non-root, RuntimeDefault seccomp, no
/// privilege escalation, no capabilities, read-only root filesystem (the gateway writes no file).
fn gateway_security(pod: &mut PodSpec) {
    pod.security_context = Some(PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(GATEWAY_UID),
        run_as_group: Some(GATEWAY_UID),
        // Group owner of the mounted API key file, which is then readable by the group only.
        fs_group: Some(GATEWAY_UID),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            localhost_profile: None,
        }),
        ..Default::default()
    });
    for c in &mut pod.containers {
        c.security_context = Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                add: None,
            }),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            ..Default::default()
        });
    }
}

/// What the gateway Deployment gets beyond its flags: `spec.endpoint.replicas` spread over
/// nodes, the restricted security context, the push-mode peer port name, and the API key
/// Secret (`spec.endpoint.apiKeySecretRef`) mounted as a file for `--api-key-file`.
///
/// The Secret is a volume, never `subPath` (the kubelet does not update those) and never env:
/// editing the Secret rotates the keys in every replica without a restart (the kubelet swaps
/// the file, the gateway re-reads it). The volume is not optional, so a missing Secret or key
/// keeps the pods in `ContainerCreating` with a `FailedMount` event naming it, rather than
/// starting a gateway without authentication.
pub(super) fn gateway_extensions(ctx: &Ctx<'_>, mut d: Deployment) -> Deployment {
    let replicas = gateway_replicas(ctx.svc);
    let Some(spec) = d.spec.as_mut() else {
        return d;
    };
    spec.replicas = Some(replicas);
    let Some(pod) = spec.template.spec.as_mut() else {
        return d;
    };
    pod.topology_spread_constraints = Some(vec![TopologySpreadConstraint {
        max_skew: 1,
        topology_key: "kubernetes.io/hostname".to_owned(),
        when_unsatisfiable: "ScheduleAnyway".to_owned(),
        label_selector: Some(LabelSelector {
            match_labels: Some(labels::selector(&ctx.name, Component::Gateway)),
            ..Default::default()
        }),
        // Only the pods of the same rollout count, so a rollout does not skew the spread.
        match_label_keys: Some(vec!["pod-template-hash".to_owned()]),
        ..Default::default()
    }]);
    gateway_security(pod);
    let key_ref = ctx.svc.spec.endpoint.api_key_secret_ref.as_ref();
    if let Some(r) = key_ref {
        pod.volumes.get_or_insert_with(Vec::new).push(Volume {
            name: "api-keys".to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(r.name.clone()),
                items: Some(vec![KeyToPath {
                    key: r.key.clone(),
                    path: API_KEY_FILE.to_owned(),
                    mode: None,
                }]),
                default_mode: Some(0o440),
                optional: Some(false),
            }),
            ..Default::default()
        });
    }
    if let Some(c) = pod.containers.first_mut() {
        let args = c.args.get_or_insert_with(Vec::new);
        if ctx.gateway_peers() {
            args.push("--peer-port-name=http".to_owned());
        }
        if key_ref.is_some() {
            args.push(format!("--api-key-file={API_KEY_DIR}/{API_KEY_FILE}"));
            c.volume_mounts
                .get_or_insert_with(Vec::new)
                .push(VolumeMount {
                    name: "api-keys".to_owned(),
                    mount_path: API_KEY_DIR.to_owned(),
                    read_only: Some(true),
                    ..Default::default()
                });
        }
    }
    d
}

/// The gateway's PodDisruptionBudget: at most one replica down at a time through voluntary
/// disruptions, so with two or more replicas a node drain never takes the endpoint away, and
/// with one it never blocks a drain.
pub(super) fn gateway_pdb(ctx: &Ctx<'_>) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: ctx.meta(names::gateway(&ctx.name), Component::Gateway),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(labels::selector(&ctx.name, Component::Gateway)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}
