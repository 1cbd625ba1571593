//! The KEDA `ScaledObject` that scales the backend Deployment on the gateway's demand, and keeps
//! a minimum during the service's warm windows; the same for a plain Deployment joined to an
//! endpoint (`member.rs`), with `restoreToOriginalReplicaCount`.

use hearth_crds::llmservice::{ScalingSpec, WarmWindow};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ApiResource, DynamicObject};
use serde_json::json;

use super::{Ctx, Placement, RenderConfig, RenderError, ScalerMode, SharedGateway, duration_secs};
use crate::{labels::Component, names};

/// The KEDA `ScaledObject` API (keda.sh/v1alpha1), the default of [`super::RenderConfig::keda_api`].
pub fn scaled_object_resource() -> ApiResource {
    ApiResource {
        group: "keda.sh".to_owned(),
        version: "v1alpha1".to_owned(),
        api_version: "keda.sh/v1alpha1".to_owned(),
        kind: "ScaledObject".to_owned(),
        plural: "scaledobjects".to_owned(),
    }
}

/// Where KEDA asks for one model's demand: a gateway's Services, and on a shared gateway the
/// model's key there.
pub(super) struct Demand {
    /// `<admin Service>.<namespace>` of the gateway (poll).
    host: String,
    /// `<scaler Service>.<namespace>` of the gateway (push).
    scaler_host: String,
    /// Whether the gateway's replicas sum their demand over each other: KEDA's poll then asks
    /// each replica for its own (`/local`).
    peers: bool,
    /// `<namespace>/<name>`, the model's key on a shared gateway (`/hearth/queue/<key>` of the
    /// poll, `service` of the push trigger); `None` on a service's own gateway.
    model: Option<String>,
    /// The push trigger's `authenticationRef` (mutual TLS): the service's own
    /// TriggerAuthentication ([`trigger_authentication`]), or on a shared gateway the
    /// ClusterTriggerAuthentication of [`RenderConfig::shared_scaler_auth`]; `None`: plain gRPC.
    authentication: Option<serde_json::Value>,
}

impl Demand {
    /// The demand of model `model` (`<namespace>/<name>`) on the shared gateway `shared`;
    /// `peers` as for the model's own gateway, or'ed with the shared replicas being peers.
    pub(super) fn shared(
        shared: &SharedGateway,
        model: String,
        peers: bool,
        cfg: &RenderConfig,
    ) -> Self {
        Self {
            host: format!(
                "{}.{}",
                names::gateway_admin(&shared.endpoint),
                shared.namespace
            ),
            scaler_host: format!(
                "{}.{}",
                names::scaler_service(&shared.endpoint),
                shared.namespace
            ),
            peers: peers || shared.peers,
            model: Some(model),
            authentication: cfg
                .shared_scaler_auth
                .as_ref()
                .filter(|_| cfg.shared_scaler_tls())
                .map(|name| json!({"name": name, "kind": "ClusterTriggerAuthentication"})),
        }
    }
}

/// A ScaledObject: its metadata, the Deployment it scales, the scaling settings (an LLMService's
/// `spec.scaling`, or a joined Deployment's annotations as one), and where the demand is read.
pub(super) struct Scaling<'a> {
    /// The ScaledObject's metadata (name, namespace, labels, owner).
    pub metadata: ObjectMeta,
    /// The Deployment scaled (`scaleTargetRef.name`).
    pub target: String,
    /// min, max, target, activation timeout, scale-down stabilization, warm windows.
    pub spec: &'a ScalingSpec,
    /// How KEDA reads the demand.
    pub scaler: ScalerMode,
    /// Where.
    pub demand: Demand,
    /// `advanced.restoreToOriginalReplicaCount`: when the ScaledObject is deleted, KEDA sets
    /// the target back to the replicas it had before (a Deployment leaving an endpoint).
    pub restore_to_original: bool,
}

pub(super) fn scaled_object(ctx: &Ctx<'_>) -> Result<DynamicObject, RenderError> {
    // Where the demand is asked for: the service's own gateway, or the shared gateway of the
    // endpoint it is attached to, which keys each model's demand by `<namespace>/<service>`;
    // either way in the service's own scaler mode (a shared gateway serves both).
    let demand = match ctx.placement {
        Placement::Own => Demand {
            host: format!("{}.{}", names::gateway_admin(&ctx.name), ctx.namespace),
            scaler_host: format!("{}.{}", names::scaler_service(&ctx.name), ctx.namespace),
            peers: ctx.gateway_peers(),
            model: None,
            authentication: (ctx.scaler == ScalerMode::Push && ctx.cfg.scaler_tls)
                .then(|| json!({"name": names::scaler_service(&ctx.name)})),
        },
        // As for the service's own gateway, and whenever the shared replicas are peers.
        Placement::Shared(shared) => Demand::shared(
            shared,
            format!("{}/{}", ctx.namespace, ctx.name),
            ctx.gateway_peers(),
            ctx.cfg,
        ),
    };
    scaled_object_of(
        &Scaling {
            metadata: ctx.meta(names::scaled_object(&ctx.name), Component::Autoscaler),
            target: names::backend(&ctx.name),
            spec: &ctx.svc.spec.scaling,
            scaler: ctx.scaler,
            demand,
            restore_to_original: false,
        },
        ctx.cfg,
    )
}

/// The ScaledObject of `s`.
pub(super) fn scaled_object_of(
    s: &Scaling<'_>,
    cfg: &RenderConfig,
) -> Result<DynamicObject, RenderError> {
    let sc = s.spec;
    let stabilization = duration_secs(
        &sc.scale_down_stabilization,
        "spec.scaling.scaleDownStabilization",
    )?;
    let activation = duration_secs(&sc.activation_timeout, "spec.scaling.activationTimeout")?;
    let Demand {
        host,
        scaler_host,
        peers,
        model,
        authentication,
    } = &s.demand;
    let trigger = match s.scaler {
        // KEDA resolves `<service>.<namespace>` from the host (the admin Service) and polls
        // each endpoint on the URL's port, which must therefore be the gateway's container
        // port (KEDA >= 2.19), with the bearer token of the ClusterTriggerAuthentication.
        ScalerMode::Poll => {
            // KEDA sums over the replicas: each serves its own demand (with peers, the plain
            // path would serve the total, counted once per replica). In the path: KEDA asks
            // each endpoint for the URL's path and drops its query. A KEDA older than 2.19
            // cannot sum: it asks the (headless) Service's one address it resolves, and that
            // replica answers the total over its peers (the plain path).
            let aggregate = cfg.keda_version.aggregates_endpoints();
            let mut path = "/hearth/queue".to_owned();
            if let Some(m) = model {
                path.push('/');
                path.push_str(m);
            }
            if *peers && aggregate {
                path.push_str("/local");
            }
            let mut trigger = json!({
                "type": "metrics-api",
                "metricType": "AverageValue",
                "metadata": {
                    "url": format!(
                        "http://{host}.svc:{}{path}",
                        cfg.admin_port,
                    ),
                    "format": "json",
                    "valueLocation": "pending",
                    "targetValue": sc.target.to_string(),
                }
            });
            if aggregate {
                trigger["metadata"]["aggregateFromKubeServiceEndpoints"] = json!("true");
                trigger["metadata"]["aggregationType"] = json!("sum");
            }
            if let Some(cta) = &cfg.admin_auth {
                // KEDA before 2.18 reads only the singular key.
                let key = if cfg.keda_version.reads_auth_modes() {
                    "authModes"
                } else {
                    "authMode"
                };
                trigger["metadata"][key] = json!("bearer");
                trigger["authenticationRef"] =
                    json!({"name": cta, "kind": "ClusterTriggerAuthentication"});
            }
            trigger
        }
        ScalerMode::Push => {
            let mut metadata = json!({
                "scalerAddress": format!("{scaler_host}.svc:{}", cfg.scaler_port),
                // The gateway's ExternalScaler reads the per-replica target from `targetSize`.
                "targetSize": sc.target.to_string(),
            });
            if let Some(m) = model {
                // A shared gateway's ExternalScaler answers for the model KEDA names.
                metadata["service"] = json!(m);
            }
            let mut trigger = json!({
                "type": "external-push",
                "metricType": "AverageValue",
                "metadata": metadata,
            });
            if let Some(r) = authentication {
                trigger["authenticationRef"] = r.clone();
            }
            trigger
        }
    };
    // The demand trigger stays first: KEDA names each trigger's metric after its index
    // (`s0-...`), so a warm window added or removed never renames the demand metric.
    let triggers: Vec<_> = std::iter::once(trigger)
        .chain(sc.warm_windows.iter().map(warm_window_trigger))
        .collect();
    let name = s.metadata.name.clone().unwrap_or_default();
    let mut obj = DynamicObject::new(&name, &cfg.keda_api);
    obj.metadata = s.metadata.clone();
    let mut advanced = json!({
        "horizontalPodAutoscalerConfig": {
            "behavior": {
                "scaleDown": {"stabilizationWindowSeconds": stabilization}
            }
        }
    });
    if s.restore_to_original {
        advanced["restoreToOriginalReplicaCount"] = json!(true);
    }
    obj.data = json!({
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": s.target,
            },
            "minReplicaCount": sc.min,
            "maxReplicaCount": sc.max,
            // Activation (0 -> 1) is decided by KEDA's own poll; keep cold starts short.
            "pollingInterval": 5,
            "cooldownPeriod": stabilization,
            // A fresh service is loading its model: do not scale it to zero before it could
            // have served (the activation timeout bounds a load).
            "initialCooldownPeriod": activation,
            "advanced": advanced,
            "triggers": triggers,
        }
    });
    Ok(obj)
}

/// A warm window as KEDA's `cron` trigger: while the window is open it reports `replicas` as
/// its metric (target 1 per replica, so the HPA asks for that many) and is active, which wakes
/// a service at zero; closed, it reports 0 and is inactive, so the service may go back to zero
/// after `cooldownPeriod`. The HPA takes the largest of the triggers' counts, so demand still
/// scales above the window's minimum. `minReplicaCount` stays `scaling.min`.
fn warm_window_trigger(w: &WarmWindow) -> serde_json::Value {
    json!({
        "type": "cron",
        "metadata": {
            "timezone": w.timezone,
            "start": w.start,
            "end": w.end,
            "desiredReplicas": w.replicas.to_string(),
        }
    })
}

/// The TriggerAuthentication API: KEDA's `keda.sh/v1alpha1`.
pub fn trigger_authentication_resource() -> ApiResource {
    ApiResource {
        group: "keda.sh".to_owned(),
        version: "v1alpha1".to_owned(),
        api_version: "keda.sh/v1alpha1".to_owned(),
        kind: "TriggerAuthentication".to_owned(),
        plural: "triggerauthentications".to_owned(),
    }
}

/// Trigger metadata key carrying a digest of the client TLS material
/// ([`crate::scaler_tls::ClientMaterial::digest`]): a rotation changes the ScaledObject's spec,
/// which is what makes KEDA rebuild its scaler and read the TriggerAuthentication's Secret again
/// (KEDA caches scalers by the ScaledObject's generation). The gateway ignores it.
pub const TLS_DIGEST_KEY: &str = "tlsDigest";

/// The TriggerAuthentication `N-scaler` of a push-mode service's own gateway: KEDA's
/// ExternalScaler parameters `caCert`, `tlsClientCert` and `tlsClientKey` from the
/// `kubernetes.io/tls` Secret `N-scaler-client-tls` (`ca.crt`, `tls.crt`, `tls.key`) that the
/// controller issues ([`crate::scaler_tls`]).
pub(super) fn trigger_authentication(ctx: &Ctx<'_>) -> DynamicObject {
    let name = names::scaler_service(&ctx.name);
    let secret = names::scaler_client_tls(&ctx.name);
    let mut obj = DynamicObject::new(&name, &trigger_authentication_resource());
    obj.metadata = ctx.meta(name, Component::Autoscaler);
    let target =
        |parameter: &str, key: &str| json!({"parameter": parameter, "name": secret, "key": key});
    obj.data = json!({
        "spec": {
            "secretTargetRef": [
                target("caCert", "ca.crt"),
                target("tlsClientCert", "tls.crt"),
                target("tlsClientKey", "tls.key"),
            ]
        }
    });
    obj
}

/// Sets [`TLS_DIGEST_KEY`] in the demand trigger (the first) of a rendered ScaledObject.
pub fn set_tls_digest(scaled_object: &mut DynamicObject, digest: &str) {
    if let Some(meta) = scaled_object
        .data
        .pointer_mut("/spec/triggers/0/metadata")
        .and_then(|m| m.as_object_mut())
    {
        meta.insert(TLS_DIGEST_KEY.to_owned(), json!(digest));
    }
}
