//! Runtime image pre-pull (`InferenceRuntime.spec.prePull`): one DaemonSet per runtime in the
//! controller's namespace (`--pre-pull-namespace`) keeps the runtime's image on every node the
//! runtime can schedule to, so a model's first start on a node does not wait for the pull.
//!
//! The DaemonSet's pods take the runtime's `accelerator.nodeSelector` and `tolerations` (the
//! nodes its backends can land on), run the image once as an init container
//! (`python3 -c ''`, the entry the prewarm Job relies on too), then hold a pause container of a
//! few MiB; they request no accelerator. The kubelet keeps an image a running pod uses, so its
//! image garbage collection never removes it. The runtime's condition `ImagePrePulled` says on
//! how many of those nodes the image is present. Turning `prePull` off (or deleting the
//! runtime: the DaemonSet's owner) removes the DaemonSet.
//!
//! Pure parts ([`daemon_set`], [`condition`], and the name, [`crate::names::pre_pull`]) are
//! unit-tested; [`run`] is the loop.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use futures::StreamExt;
use hearth_crds::{
    InferenceRuntime,
    wellknown::{COMPONENT_LABEL, FIELD_MANAGER, MANAGED_BY},
};
use k8s_openapi::{
    api::{
        apps::v1::{DaemonSet, DaemonSetSpec, DaemonSetUpdateStrategy, RollingUpdateDaemonSet},
        core::v1::{
            Capabilities, Container, PodSecurityContext, PodSpec, PodTemplateSpec,
            ResourceRequirements, SeccompProfile, SecurityContext,
        },
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{Condition, LabelSelector, ObjectMeta, Time},
        util::intstr::IntOrString,
    },
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DeleteParams, Patch, PatchParams},
    runtime::{
        Controller,
        controller::Action,
        watcher::{self},
    },
};

use crate::labels::MANAGED_BY_LABEL;
use crate::names;
use crate::reconcile::{Error, kube_err};

/// The runtime's condition type.
pub const CONDITION: &str = "ImagePrePulled";
/// `app.kubernetes.io/component` of the pre-pull DaemonSets and their pods.
pub const COMPONENT: &str = "pre-pull";
/// The label naming the runtime a pre-pull DaemonSet and its pods belong to.
pub const RUNTIME_LABEL: &str = "serving.hearth.dev/inferenceruntime";

/// Where and with what the pre-pull DaemonSets run.
#[derive(Clone, Debug)]
pub struct PrePullConfig {
    /// Namespace of the DaemonSets (the controller's own).
    pub namespace: String,
    /// Image of the container that holds each pod after the pull (`registry.k8s.io/pause`).
    pub pause_image: String,
}

/// The label value naming `rt` (a runtime name longer than a label value is cut at 63).
fn runtime_label(rt: &str) -> String {
    rt.chars().take(63).collect()
}

fn selector_labels(rt: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (COMPONENT_LABEL.to_owned(), COMPONENT.to_owned()),
        (RUNTIME_LABEL.to_owned(), runtime_label(rt)),
    ])
}

/// The label selector of the pre-pull DaemonSets' watch.
pub fn selector() -> String {
    format!("{MANAGED_BY_LABEL}={MANAGED_BY},{COMPONENT_LABEL}={COMPONENT}")
}

fn quantity(q: &str) -> Quantity {
    Quantity(q.to_owned())
}

/// The pre-pull DaemonSet of `rt`, owned by it; `None` when `spec.prePull` is off.
pub fn daemon_set(rt: &InferenceRuntime, cfg: &PrePullConfig) -> Option<DaemonSet> {
    if !rt.spec.pre_pull {
        return None;
    }
    let rt_name = rt.name_any();
    let mut labels = selector_labels(&rt_name);
    labels.insert(MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned());
    labels.insert(
        "app.kubernetes.io/name".to_owned(),
        "hearth-pre-pull".to_owned(),
    );
    let acc = &rt.spec.accelerator;
    let restricted = SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            ..Default::default()
        }),
        read_only_root_filesystem: Some(true),
        ..Default::default()
    };
    let resources = |cpu: &str, memory: &str, limit: &str| ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), quantity(cpu)),
            ("memory".to_owned(), quantity(memory)),
        ])),
        limits: Some(BTreeMap::from([("memory".to_owned(), quantity(limit))])),
        ..Default::default()
    };
    let template = PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels.clone()),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            init_containers: Some(vec![Container {
                name: "pull".to_owned(),
                image: Some(rt.spec.container.image.clone()),
                image_pull_policy: Some("IfNotPresent".to_owned()),
                command: Some(vec!["python3".to_owned(), "-c".to_owned(), String::new()]),
                resources: Some(resources("10m", "32Mi", "256Mi")),
                security_context: Some(restricted.clone()),
                ..Default::default()
            }]),
            containers: vec![Container {
                name: "pause".to_owned(),
                image: Some(cfg.pause_image.clone()),
                image_pull_policy: Some("IfNotPresent".to_owned()),
                resources: Some(resources("1m", "8Mi", "16Mi")),
                security_context: Some(restricted),
                ..Default::default()
            }],
            node_selector: (!acc.node_selector.is_empty()).then(|| acc.node_selector.clone()),
            tolerations: (!acc.tolerations.is_empty()).then(|| acc.tolerations.clone()),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(65532),
                run_as_group: Some(65532),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".to_owned(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(1),
            ..Default::default()
        }),
    };
    Some(DaemonSet {
        metadata: ObjectMeta {
            name: Some(names::pre_pull(&rt_name)),
            namespace: Some(cfg.namespace.clone()),
            labels: Some(labels),
            owner_references: rt.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(selector_labels(&rt_name)),
                ..Default::default()
            },
            // An image change pulls on a quarter of the nodes at a time, not one by one.
            update_strategy: Some(DaemonSetUpdateStrategy {
                type_: Some("RollingUpdate".to_owned()),
                rolling_update: Some(RollingUpdateDaemonSet {
                    max_unavailable: Some(IntOrString::String("25%".to_owned())),
                    ..Default::default()
                }),
            }),
            template,
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// `ImagePrePulled` from the DaemonSet's status: `True` (`Pulled`) once its current pods are
/// running on every node it schedules to; `False` with `Pulling` meanwhile (and while the
/// DaemonSet controller has not seen the latest spec), or `NoNodes` when no node matches.
pub fn condition(image: &str, ds: Option<&DaemonSet>, now: Time) -> Condition {
    let cond = |status: bool, reason: &str, message: String| Condition {
        type_: CONDITION.to_owned(),
        status: if status { "True" } else { "False" }.to_owned(),
        reason: reason.to_owned(),
        message,
        last_transition_time: now.clone(),
        observed_generation: None,
    };
    let ds_name = ds.and_then(|d| d.metadata.name.clone()).unwrap_or_default();
    let Some(status) = ds.and_then(|d| d.status.as_ref()) else {
        return cond(
            false,
            "Pulling",
            format!("DaemonSet {ds_name} is being created"),
        );
    };
    let current = ds.and_then(|d| d.metadata.generation) == status.observed_generation;
    let desired = status.desired_number_scheduled;
    let ready = status.number_ready;
    let updated = status.updated_number_scheduled.unwrap_or(0);
    if current && desired == 0 {
        return cond(
            false,
            "NoNodes",
            "no node matches the runtime's accelerator.nodeSelector and tolerations".to_owned(),
        );
    }
    if current && ready >= desired && updated >= desired {
        return cond(
            true,
            "Pulled",
            format!("{image} is present on all {desired} node(s) the runtime schedules to"),
        );
    }
    cond(
        false,
        "Pulling",
        format!(
            "{image} is present on {ready} of {desired} node(s) the runtime schedules to (DaemonSet {ds_name})"
        ),
    )
}

struct Ctx {
    client: Client,
    cfg: PrePullConfig,
}

/// Runs the pre-pull loop until `shutdown` resolves. Each runtime is reconciled on its changes
/// and its DaemonSet's, and every 5 minutes.
pub async fn run(
    client: Client,
    cfg: PrePullConfig,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let runtimes: Api<InferenceRuntime> = Api::all(client.clone());
    let daemon_sets: Api<DaemonSet> = Api::namespaced(client.clone(), &cfg.namespace);
    tracing::info!(namespace = %cfg.namespace, "pre-pulling the images of runtimes with spec.prePull");
    Controller::new(runtimes, watcher::Config::default())
        .owns(daemon_sets, watcher::Config::default().labels(&selector()))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, Arc::new(Ctx { client, cfg }))
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "pre-pull controller event");
            }
        })
        .await;
}

async fn reconcile(rt: Arc<InferenceRuntime>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let rt_name = rt.name_any();
    let ds_name = names::pre_pull(&rt_name);
    let api: Api<DaemonSet> = Api::namespaced(ctx.client.clone(), &ctx.cfg.namespace);
    let ns = &ctx.cfg.namespace;
    let Some(desired) = daemon_set(&rt, &ctx.cfg) else {
        // Off: remove ours, and our condition.
        if api
            .get_opt(&ds_name)
            .await
            .map_err(kube_err(format!("get DaemonSet {ns}/{ds_name}")))?
            .is_some_and(|d| d.labels().get(RUNTIME_LABEL) == Some(&runtime_label(&rt_name)))
        {
            api.delete(&ds_name, &DeleteParams::background())
                .await
                .map_err(kube_err(format!("delete DaemonSet {ns}/{ds_name}")))?;
            tracing::info!(runtime = %rt_name, daemonset = %ds_name, "pre-pull off: DaemonSet deleted");
        }
        if has_condition(&rt) {
            write_conditions(&ctx.client, &rt_name, &[]).await?;
        }
        return Ok(Action::await_change());
    };
    let applied = api
        .patch(
            &ds_name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&desired),
        )
        .await
        .map_err(kube_err(format!("apply DaemonSet {ns}/{ds_name}")))?;
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let mut cond = condition(&rt.spec.container.image, Some(&applied), now);
    let previous = rt
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == CONDITION));
    if let Some(p) = previous {
        if (&p.status, &p.reason, &p.message) == (&cond.status, &cond.reason, &cond.message) {
            return Ok(Action::requeue(Duration::from_secs(300)));
        }
        if p.status == cond.status {
            cond.last_transition_time = p.last_transition_time.clone();
        }
    }
    write_conditions(&ctx.client, &rt_name, &[cond]).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

fn has_condition(rt: &InferenceRuntime) -> bool {
    rt.status
        .as_ref()
        .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == CONDITION))
}

/// Server-side applies the conditions this controller owns on the runtime's status (an empty
/// list removes them; conditions of other managers stay).
async fn write_conditions(
    client: &Client,
    rt_name: &str,
    conditions: &[Condition],
) -> Result<(), Error> {
    let api: Api<InferenceRuntime> = Api::all(client.clone());
    let patch = serde_json::json!({
        "apiVersion": InferenceRuntime::api_version(&()),
        "kind": InferenceRuntime::kind(&()),
        "status": {"conditions": conditions},
    });
    api.patch_status(
        rt_name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(kube_err(format!(
        "apply status of InferenceRuntime {rt_name}"
    )))?;
    Ok(())
}

fn error_policy(_rt: Arc<InferenceRuntime>, error: &Error, _ctx: Arc<Ctx>) -> Action {
    tracing::warn!(error = %error, "pre-pull reconcile failed");
    Action::requeue(Duration::from_secs(10))
}

#[cfg(test)]
mod tests;
