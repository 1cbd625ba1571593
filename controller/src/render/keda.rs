//! The KEDA `ScaledObject` that scales the backend Deployment on the gateway's demand.

use kube::api::{ApiResource, DynamicObject};
use serde_json::json;

use super::{Ctx, RenderError, ScalerMode, duration_secs};
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

pub(super) fn scaled_object(ctx: &Ctx<'_>) -> Result<DynamicObject, RenderError> {
    let s = &ctx.svc.spec.scaling;
    let stabilization = duration_secs(
        &s.scale_down_stabilization,
        "spec.scaling.scaleDownStabilization",
    )?;
    let activation = duration_secs(&s.activation_timeout, "spec.scaling.activationTimeout")?;
    let trigger = match ctx.scaler {
        // KEDA resolves `<service>.<namespace>` from the host and polls each endpoint on the
        // URL's port, which must therefore be the gateway's container port (KEDA >= 2.18).
        ScalerMode::Poll => json!({
            "type": "metrics-api",
            "metricType": "AverageValue",
            "metadata": {
                "url": format!(
                    "http://{}.{}.svc:{}/hearth/queue",
                    names::gateway_service(&ctx.name),
                    ctx.namespace,
                    ctx.cfg.gateway_port
                ),
                "format": "json",
                "valueLocation": "pending",
                "targetValue": s.target.to_string(),
                "aggregateFromKubeServiceEndpoints": "true",
                "aggregationType": "sum",
            }
        }),
        ScalerMode::Push => json!({
            "type": "external-push",
            "metricType": "AverageValue",
            "metadata": {
                "scalerAddress": format!(
                    "{}.{}.svc:{}",
                    names::scaler_service(&ctx.name),
                    ctx.namespace,
                    ctx.cfg.scaler_port
                ),
                // The gateway's ExternalScaler reads the per-replica target from `targetSize`.
                "targetSize": s.target.to_string(),
            }
        }),
    };
    let mut obj = DynamicObject::new(&names::scaled_object(&ctx.name), &ctx.cfg.keda_api);
    obj.metadata = ctx.meta(names::scaled_object(&ctx.name), Component::Autoscaler);
    obj.data = json!({
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": names::backend(&ctx.name),
            },
            "minReplicaCount": s.min,
            "maxReplicaCount": s.max,
            // Activation (0 -> 1) is decided by KEDA's own poll; keep cold starts short.
            "pollingInterval": 5,
            "cooldownPeriod": stabilization,
            // A fresh service is loading its model: do not scale it to zero before it could
            // have served (the activation timeout bounds a load).
            "initialCooldownPeriod": activation,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {"stabilizationWindowSeconds": stabilization}
                    }
                }
            },
            "triggers": [trigger],
        }
    });
    Ok(obj)
}
