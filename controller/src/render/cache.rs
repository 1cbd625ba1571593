//! The model cache: the volume the engine and the prewarm Job mount, the NodeLocalPVC or
//! SharedPVC claim, and the prewarm Job. Claim and Job are create-once: each records a hash of its immutable part in
//! [`TEMPLATE_HASH_ANNOTATION`], which the reconciler compares to report `ReplaceRequired`.

use std::collections::BTreeMap;

use hearth_crds::{llmservice::CacheStrategy, rules};
use k8s_openapi::api::{
    batch::v1::{Job, JobSpec},
    core::v1::{
        Container, EnvVar, HostPathVolumeSource, ImageVolumeSource, PersistentVolumeClaim,
        PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, PodSpec, PodTemplateSpec,
        Volume, VolumeMount, VolumeResourceRequirements,
    },
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;

use super::{Ctx, RenderError, TEMPLATE_HASH_ANNOTATION};
use crate::{
    labels::{self, Component},
    model::{CACHE_MOUNT_PATH, HF_HOME, MODELSCOPE_CACHE, ModelSource},
    names,
};

impl Ctx<'_> {
    /// The cache volume and whether the prewarm/engine env should point into it.
    pub(super) fn cache_volume(&self) -> Result<Option<Volume>, RenderError> {
        match &self.source {
            ModelSource::Pvc { claim, .. } => {
                return Ok(Some(Volume {
                    name: "model".to_owned(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: claim.clone(),
                        read_only: Some(true),
                    }),
                    ..Default::default()
                }));
            }
            // An image volume: the kubelet pulls the image (with the pod's pull secrets) and
            // mounts its filesystem read-only (Kubernetes ImageVolume; docs/controller.md).
            ModelSource::Oci { reference } => {
                return Ok(Some(Volume {
                    name: "model".to_owned(),
                    image: Some(ImageVolumeSource {
                        reference: Some(reference.clone()),
                        pull_policy: Some("IfNotPresent".to_owned()),
                    }),
                    ..Default::default()
                }));
            }
            ModelSource::HuggingFace { .. } | ModelSource::ModelScope { .. } => {}
        }
        match self.svc.spec.cache.strategy {
            strategy @ (CacheStrategy::NodeLocalPVC | CacheStrategy::SharedPVC) => {
                Ok(Some(Volume {
                    name: "model-cache".to_owned(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: names::cache_claim(&self.name),
                        // The backends only read a shared cache; the prewarm Job writes it.
                        read_only: (strategy == CacheStrategy::SharedPVC).then_some(true),
                    }),
                    ..Default::default()
                }))
            }
            CacheStrategy::HostPath => Ok(Some(Volume {
                name: "model-cache".to_owned(),
                host_path: Some(HostPathVolumeSource {
                    path: self.cfg.host_path_root.clone(),
                    type_: Some("DirectoryOrCreate".to_owned()),
                }),
                ..Default::default()
            })),
            CacheStrategy::None => Ok(None),
            other => Err(RenderError::CacheNotImplemented(other)),
        }
    }

    /// Whether the backends mount the cache volume read-only: a `pvc://` model's claim, an
    /// `oci://` model's image, and a SharedPVC cache (filled by the prewarm Job only).
    pub(super) fn cache_read_only(&self) -> bool {
        self.source.is_staged() || self.svc.spec.cache.strategy == CacheStrategy::SharedPVC
    }

    /// The engine's environment for a read-only cache: `HF_HUB_OFFLINE=1`, so the hub library
    /// resolves the repository id from the prewarmed snapshot without contacting the hub or
    /// writing lock files (`hearth_crds::rules` admits SharedPVC for `hf://` models only).
    pub(super) fn offline_env(&self) -> Option<EnvVar> {
        (self.svc.spec.cache.strategy == CacheStrategy::SharedPVC
            && matches!(self.source, ModelSource::HuggingFace { .. }))
        .then(|| EnvVar {
            name: "HF_HUB_OFFLINE".to_owned(),
            value: Some("1".to_owned()),
            value_from: None,
        })
    }

    /// `.Model.Path` (see the table in [`crate::model`]).
    pub(super) fn model_path(&self) -> String {
        match &self.source {
            ModelSource::HuggingFace { repo } | ModelSource::ModelScope { repo } => repo.clone(),
            ModelSource::Pvc { subpath: None, .. } | ModelSource::Oci { .. } => {
                CACHE_MOUNT_PATH.to_owned()
            }
            ModelSource::Pvc {
                subpath: Some(subpath),
                ..
            } => format!("{CACHE_MOUNT_PATH}/{subpath}"),
        }
    }

    /// The hub environment shared by the engine and the prewarm Job.
    pub(super) fn cache_env(&self, cached: bool) -> Vec<EnvVar> {
        let var = |name: &str, value: &str| EnvVar {
            name: name.to_owned(),
            value: Some(value.to_owned()),
            value_from: None,
        };
        match &self.source {
            ModelSource::HuggingFace { .. } if cached => vec![var("HF_HOME", HF_HOME)],
            ModelSource::ModelScope { .. } if cached => vec![
                var("VLLM_USE_MODELSCOPE", "True"),
                var("MODELSCOPE_CACHE", MODELSCOPE_CACHE),
            ],
            ModelSource::ModelScope { .. } => vec![var("VLLM_USE_MODELSCOPE", "True")],
            _ => Vec::new(),
        }
    }
}

/// FNV-1a over the JSON of the immutable part: stable across builds (unlike `std`'s hasher).
fn stable_hash(value: &impl Serialize) -> String {
    let bytes = serde_json::to_vec(value).unwrap_or_default();
    format!("{:016x}", names::stable_hash(&bytes))
}

fn with_hash(mut meta: ObjectMeta, hash: String) -> ObjectMeta {
    meta.annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(TEMPLATE_HASH_ANNOTATION.to_owned(), hash);
    meta
}

pub(super) fn cache_claim(ctx: &Ctx<'_>) -> Option<PersistentVolumeClaim> {
    let cache = &ctx.svc.spec.cache;
    let access_mode = match cache.strategy {
        CacheStrategy::NodeLocalPVC => "ReadWriteOnce",
        CacheStrategy::SharedPVC => "ReadWriteMany",
        _ => return None,
    };
    if ctx.source.is_staged() {
        return None;
    }
    let size = rules::cache_claim_size(cache);
    let spec = PersistentVolumeClaimSpec {
        access_modes: Some(vec![access_mode.to_owned()]),
        resources: Some(VolumeResourceRequirements {
            requests: Some(BTreeMap::from([("storage".to_owned(), size)])),
            ..Default::default()
        }),
        storage_class_name: cache.storage_class_name.clone(),
        ..Default::default()
    };
    // Only the storage class and the access mode are immutable; size may grow (volume
    // expansion). (A NodeLocalPVC claim's hash predates SharedPVC and stays the class alone.)
    let hash = match cache.strategy {
        CacheStrategy::SharedPVC => stable_hash(&(&cache.storage_class_name, access_mode)),
        _ => stable_hash(&cache.storage_class_name),
    };
    Some(PersistentVolumeClaim {
        metadata: with_hash(
            ctx.meta(names::cache_claim(&ctx.name), Component::Cache),
            hash,
        ),
        spec: Some(spec),
        ..Default::default()
    })
}

/// The download program run by the prewarm Job: the hub library vLLM itself uses, so the cache
/// layout is the one the engine reads.
fn prewarm_program(source: &ModelSource) -> Option<String> {
    match source {
        ModelSource::HuggingFace { repo } => Some(format!(
            "from huggingface_hub import snapshot_download\nprint(snapshot_download(repo_id={repo:?}))\n"
        )),
        ModelSource::ModelScope { repo } => Some(format!(
            "from modelscope import snapshot_download\nprint(snapshot_download({repo:?}))\n"
        )),
        ModelSource::Pvc { .. } | ModelSource::Oci { .. } => None,
    }
}

/// The prewarm container's environment: the engine's hub cache variables, and
/// `TORCH_DEVICE_BACKEND_AUTOLOAD=0` (as upstream): the Job only downloads files and has no
/// device, and vendor images would otherwise load their device backend (and fail without the
/// host driver) when the hub library imports torch.
fn prewarm_env(ctx: &Ctx<'_>) -> Vec<EnvVar> {
    let mut env = ctx.cache_env(true);
    env.push(no_device_backend());
    env
}

/// Adds to the Job's `container` of `pod` the runtime's download settings, then the cluster's
/// model sources, each where the name is not set yet, and the cluster's CA bundle
/// ([`super::sources`]). A runtime whose templates do not render gets no backend either: its
/// error is the render's.
fn download_settings(ctx: &Ctx<'_>, pod: &mut PodSpec, container: &str) {
    let runtime = super::backend::runtime_env(ctx).unwrap_or_default();
    let sources = &ctx.cfg.model_sources;
    if let Some(c) = pod.containers.iter_mut().find(|c| c.name == container) {
        let env = c.env.get_or_insert_with(Vec::new);
        for e in super::sources::runtime_download_env(&runtime) {
            if !env.iter().any(|x| x.name == e.name) {
                env.push(e);
            }
        }
        let cluster = sources.env(|n| env.iter().any(|x| x.name == n));
        env.extend(cluster);
    }
    sources.mount_ca(pod, container);
}

/// `TORCH_DEVICE_BACKEND_AUTOLOAD=0`: a Job that only downloads files loads no device backend.
pub(super) fn no_device_backend() -> EnvVar {
    EnvVar {
        name: "TORCH_DEVICE_BACKEND_AUTOLOAD".to_owned(),
        value: Some("0".to_owned()),
        value_from: None,
    }
}

pub(super) fn prewarm_job(ctx: &Ctx<'_>, volume: Option<Volume>) -> Option<Job> {
    let cache = &ctx.svc.spec.cache;
    let volume = volume?;
    if !cache.prewarm || !fills_cache(cache.strategy) {
        return None;
    }
    let program = prewarm_program(&ctx.source)?;
    Some(cache_job(
        ctx,
        names::prewarm_job(&ctx.name),
        Component::Prewarm,
        volume,
        program,
        prewarm_env(ctx),
        ctx.secret_env(),
    ))
}

/// Whether a Job can fill the cache of `strategy` (a claim or a node directory).
pub(super) fn fills_cache(strategy: CacheStrategy) -> bool {
    matches!(
        strategy,
        CacheStrategy::NodeLocalPVC | CacheStrategy::SharedPVC | CacheStrategy::HostPath
    )
}

/// A Job of `component` that runs `program` with `python3 -c` in the runtime's image, with
/// the cache `volume` mounted read-write at [`CACHE_MOUNT_PATH`] (the one writer of a shared
/// cache the backends mount read-only), on the runtime's nodes; create-once, its template's
/// hash in [`TEMPLATE_HASH_ANNOTATION`].
pub(super) fn cache_job(
    ctx: &Ctx<'_>,
    name: String,
    component: Component,
    mut volume: Volume,
    program: String,
    env: Vec<EnvVar>,
    env_from: Option<Vec<k8s_openapi::api::core::v1::EnvFromSource>>,
) -> Job {
    if let Some(claim) = volume.persistent_volume_claim.as_mut() {
        claim.read_only = None;
    }
    let acc = &ctx.rt.spec.accelerator;
    let mut pod_meta = ObjectMeta {
        labels: Some(labels::labels(&ctx.name, component)),
        ..Default::default()
    };
    if let Some(queue) = acc.scheduler.queue.as_deref().filter(|q| !q.is_empty()) {
        pod_meta.annotations = Some(BTreeMap::from([(
            hearth_crds::wellknown::VOLCANO_QUEUE_ANNOTATION.to_owned(),
            queue.to_owned(),
        )]));
    }
    let container_name = match component {
        Component::AdapterFetch => "fetch",
        _ => "prewarm",
    };
    let mut template = PodTemplateSpec {
        metadata: Some(pod_meta),
        spec: Some(PodSpec {
            restart_policy: Some("OnFailure".to_owned()),
            containers: vec![Container {
                name: container_name.to_owned(),
                image: Some(ctx.rt.spec.container.image.clone()),
                command: Some(vec!["python3".to_owned(), "-c".to_owned(), program]),
                env: Some(env),
                env_from,
                volume_mounts: Some(vec![VolumeMount {
                    name: volume.name.clone(),
                    mount_path: CACHE_MOUNT_PATH.to_owned(),
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            volumes: Some(vec![volume]),
            node_selector: (!acc.node_selector.is_empty()).then(|| acc.node_selector.clone()),
            tolerations: (!acc.tolerations.is_empty()).then(|| acc.tolerations.clone()),
            scheduler_name: acc.scheduler.name.clone().filter(|n| !n.is_empty()),
            image_pull_secrets: ctx.pull_secrets(),
            enable_service_links: Some(false),
            ..Default::default()
        }),
    };
    let hash = stable_hash(&template);
    // Set after the hash: the Job downloads from a hub and never calls the apiserver, and a
    // Job made before this field was set keeps matching its template (no ReplaceRequired).
    if let Some(spec) = template.spec.as_mut() {
        spec.automount_service_account_token = Some(false);
        // Where to fetch from (a mirror, a proxy, a CA): the same files whatever the address,
        // so not part of the hash either (`super::sources`).
        download_settings(ctx, spec, container_name);
        // The engine's security context (the runtime's, else Hearth's default): a namespace
        // that admits the engine admits its Jobs.
        if let Some(c) = spec
            .containers
            .iter_mut()
            .find(|c| c.name == container_name)
        {
            c.security_context = Some(
                ctx.rt
                    .spec
                    .container
                    .security_context
                    .clone()
                    .unwrap_or_else(super::backend::default_backend_security_context),
            );
        }
    }
    Job {
        metadata: with_hash(ctx.meta(name, component), hash),
        spec: Some(JobSpec {
            backoff_limit: Some(4),
            template,
            ..Default::default()
        }),
        ..Default::default()
    }
}
