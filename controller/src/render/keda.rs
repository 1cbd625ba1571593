//! The KEDA `ScaledObject` that scales the backend Deployment on the gateway's demand, and keeps
//! a minimum during the service's warm windows.

use hearth_crds::llmservice::WarmWindow;
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
                // KEDA sums over the replicas: each serves its own demand (with peers, the
                // plain URL would serve the total, counted once per replica).
                "url": format!(
                    "http://{}.{}.svc:{}/hearth/queue{}",
                    names::gateway_service(&ctx.name),
                    ctx.namespace,
                    ctx.cfg.gateway_port,
                    if ctx.gateway_peers() { "?scope=local" } else { "" }
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
    // The demand trigger stays first: KEDA names each trigger's metric after its index
    // (`s0-...`), so a warm window added or removed never renames the demand metric.
    let triggers: Vec<_> = std::iter::once(trigger)
        .chain(s.warm_windows.iter().map(warm_window_trigger))
        .collect();
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
