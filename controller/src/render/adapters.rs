//! LoRA adapters on the backend: what a service with accepted `LLMAdapter`s renders beyond a
//! plain one, from its runtime's `spec.adapters`.
//!
//! - The engine gets the runtime's adapter `args` and `env` (vLLM: `--enable-lora`, ...,
//!   `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`), once each.
//! - Each adapter's files are mounted read-only where the engine can load them:
//!   - `pvc://<claim>[/<subpath>]`: one volume per claim (however many adapters it holds), at
//!     `/adapters/pvc/<claim>`; the adapter's path is `<that>/<subpath>`. An adapter added on a
//!     claim already mounted changes nothing in the pod, so no engine restarts for it.
//!   - `oci://<reference>`: one image volume per reference, at `/adapters/oci/<hash>`.
//!   - `hf://` and `modelscope://`: fetched into the base's model cache by a Job per source
//!     ([`names::adapter_fetch_job`], create-once, in the runtime's image, as the prewarm Job:
//!     the hub library's `snapshot_download(..., local_dir=...)`), into
//!     [`ADAPTERS_CACHE_DIR`]`/<hf|modelscope>/<org>/<name>` on the cache the engines mount
//!     already (the rules admit hub adapters only on a base with such a cache), so no volume is
//!     added and a wake never downloads from the hub. Until the Job has succeeded the adapter's
//!     route carries `unavailable` (fetching, or the Job's failure), and the gateway answers its
//!     requests `503` without loading it. A Job whose adapter went is deleted; its files stay
//!     in the cache.
//! - The adapters the engines can load make the [`AdapterTable`] in the ConfigMap
//!   `<service>-adapters` (key [`ADAPTERS_KEY`]) that the service's own gateway reads
//!   (`--adapters-configmap`), or the route its endpoint's gateway reads (`ModelRoute.adapters`).
//!
//! With no adapter the engines can load, or a runtime without `spec.adapters`, nothing of this
//! is rendered. The engines' pod template changes (and so they restart) when the first such
//! adapter comes or the last one goes (the flags), and when an adapter brings a claim or an
//! image not mounted yet or the last adapter of one goes (the volumes); an adapter on a claim
//! already mounted changes nothing. The service's own gateway follows the ConfigMap whenever
//! the runtime serves adapters (flag and Role), present or not (absent: no adapters), so it
//! never rolls for them.

use std::collections::BTreeMap;

use hearth_crds::{
    InferenceRuntime, LLMAdapter,
    inferenceruntime::RuntimeAdapters,
    llmadapter::{ADAPTERS_KEY, AdapterRoute, AdapterTable},
};
use k8s_openapi::api::{
    batch::v1::Job,
    core::v1::{
        ConfigMap, EnvFromSource, EnvVar, ImageVolumeSource, PersistentVolumeClaimVolumeSource,
        SecretEnvSource, Volume, VolumeMount,
    },
};
use kube::ResourceExt;

use super::{Ctx, RenderError};
use crate::{
    labels::Component,
    model::{ModelSource, parse_uri},
    names,
    status::JobState,
};

/// Where adapter volumes are mounted in the engine's container.
pub const ADAPTERS_MOUNT_ROOT: &str = "/adapters";

/// Where hub adapters are fetched to in the model cache (mounted at [`crate::model::CACHE_MOUNT_PATH`] by
/// the engines and the fetch Jobs): `<this>/hf/<org>/<name>`, `<this>/modelscope/<org>/<name>`.
pub const ADAPTERS_CACHE_DIR: &str = "/models/adapters";

/// A service's accepted adapters and what the controller's cache holds of their fetch Jobs:
/// what its adapters render from.
#[derive(Clone, Debug, Default)]
pub struct ServiceAdapters {
    /// The accepted LLMAdapters, sorted by served name.
    pub accepted: Vec<LLMAdapter>,
    /// The state of each hub adapter's fetch Job, by Job name ([`names::adapter_fetch_job`]);
    /// a Job not here has not been created yet.
    pub fetches: BTreeMap<String, JobState>,
}

/// A hub adapter's source: which library fetches it, and its repository id.
fn hub_source(source: &ModelSource) -> Option<(&'static str, &str)> {
    match source {
        ModelSource::HuggingFace { repo } => Some(("hf", repo)),
        ModelSource::ModelScope { repo } => Some(("modelscope", repo)),
        ModelSource::Pvc { .. } | ModelSource::Oci { .. } => None,
    }
}

/// The fetch Job's environment for `hub`: the hub library's cache in the model cache (its
/// lock and metadata files; the adapter's own go to `local_dir`), and no device backend.
fn fetch_env(hub: &str) -> Vec<EnvVar> {
    let (name, value) = match hub {
        "hf" => ("HF_HOME", crate::model::HF_HOME),
        _ => ("MODELSCOPE_CACHE", crate::model::MODELSCOPE_CACHE),
    };
    vec![
        EnvVar {
            name: name.to_owned(),
            value: Some(value.to_owned()),
            value_from: None,
        },
        super::cache::no_device_backend(),
    ]
}

/// The fetch Job of hub adapter `a` on service `service`: one per hub, repository and Secret
/// (`hf://` and `huggingface://` are one), [`names::adapter_fetch_job`]; `None` for a source
/// that is not a hub's.
pub fn fetch_job_name(service: &str, a: &LLMAdapter) -> Option<String> {
    let source = parse_uri(&a.spec.source.uri).ok()?;
    let (hub, repo) = hub_source(&source)?;
    let secret = a
        .spec
        .source
        .secret_ref
        .as_ref()
        .map_or("", |s| s.name.as_str());
    Some(names::adapter_fetch_job(
        service,
        &format!("{hub}://{repo} {secret}"),
    ))
}

/// The directory a hub adapter is fetched to: [`ADAPTERS_CACHE_DIR`]`/<hub>/<repo>`.
fn hub_dir(hub: &str, repo: &str) -> String {
    format!("{ADAPTERS_CACHE_DIR}/{hub}/{repo}")
}

/// Why a hub adapter fetched by Job `job` in state `state` cannot be loaded yet, for the
/// client (the route's `unavailable`) and the adapter's status; `None` once fetched.
pub fn fetch_pending(job: &str, state: Option<&JobState>) -> Option<String> {
    match state {
        Some(JobState::Succeeded) => None,
        Some(JobState::Failed(why)) => Some(format!(
            "fetching it into the model cache failed (Job {job}: {why}); see `kubectl logs \
             job/{job}`, fix the cause (source, credentials, disk) and delete the Job to fetch \
             it again"
        )),
        Some(JobState::Running) | None => Some(format!(
            "it is being fetched into the model cache (Job {job})"
        )),
    }
}

/// What a service's adapters add to its children.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RenderedAdapters {
    /// The engine's extra arguments.
    pub args: Vec<String>,
    /// The engine's extra environment.
    pub env: Vec<EnvVar>,
    /// The adapter volumes, sorted by name.
    pub volumes: Vec<Volume>,
    /// Their mounts in the engine's container.
    pub mounts: Vec<VolumeMount>,
    /// The adapters the engines can load, for the gateway.
    pub table: AdapterTable,
}

/// Why an accepted adapter is not served: its source does not parse (the rules refuse that
/// first), `None` when it is.
pub fn unserved(adapter: &LLMAdapter) -> Option<String> {
    parse_uri(&adapter.spec.source.uri)
        .err()
        .map(|e| e.to_string())
}

/// The volume name of a claim's or an image's adapters: `adapters-<16 hex>` (a DNS label
/// whatever the source's length).
fn volume_name(kind: &str, source: &str) -> String {
    format!(
        "adapters-{:016x}",
        names::stable_hash(format!("{kind}:{source}").as_bytes())
    )
}

impl Ctx<'_> {
    /// The adapters this service renders, or `None` without any (or without runtime support).
    pub(super) fn adapters(&self) -> Option<RenderedAdapters> {
        rendered(self.rt, &self.name, self.adapters)
    }
}

/// What `adapters` (accepted on service `service` served by `rt`) add to the service's
/// children, or `None` without any (or when `rt` has no `spec.adapters`).
pub fn rendered(
    rt: &InferenceRuntime,
    service: &str,
    adapters: &ServiceAdapters,
) -> Option<RenderedAdapters> {
    let spec: &RuntimeAdapters = rt.spec.adapters.as_ref()?;
    if adapters.accepted.is_empty() {
        return None;
    }
    let mut volumes: BTreeMap<String, (Volume, String)> = BTreeMap::new();
    let mut routes = Vec::new();
    for a in &adapters.accepted {
        let mut unavailable = None;
        let path = match parse_uri(&a.spec.source.uri) {
            Ok(ModelSource::Pvc { claim, subpath }) => {
                let name = volume_name("pvc", &claim);
                let mount = format!("{ADAPTERS_MOUNT_ROOT}/pvc/{claim}");
                let path = match &subpath {
                    Some(s) => format!("{mount}/{s}"),
                    None => mount.clone(),
                };
                let volume = Volume {
                    name: name.clone(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: claim,
                        read_only: Some(true),
                    }),
                    ..Default::default()
                };
                volumes.entry(name).or_insert((volume, mount));
                path
            }
            Ok(ModelSource::Oci { reference }) => {
                let name = volume_name("oci", &reference);
                let mount = format!("{ADAPTERS_MOUNT_ROOT}/oci/{}", &name["adapters-".len()..]);
                let volume = Volume {
                    name: name.clone(),
                    image: Some(ImageVolumeSource {
                        reference: Some(reference),
                        pull_policy: Some("IfNotPresent".to_owned()),
                    }),
                    ..Default::default()
                };
                volumes.entry(name).or_insert((volume, mount.clone()));
                mount
            }
            Ok(source) => {
                let Some((hub, repo)) = hub_source(&source) else {
                    continue;
                };
                let job = fetch_job_name(service, a).unwrap_or_default();
                unavailable = fetch_pending(&job, adapters.fetches.get(&job));
                hub_dir(hub, repo)
            }
            // Refused by the rules (`unserved`).
            Err(_) => continue,
        };
        routes.push(AdapterRoute {
            name: a.served_name().to_owned(),
            path,
            adapter: format!("{}/{}", a.namespace().unwrap_or_default(), a.name_any()),
            unavailable,
        });
    }
    if routes.is_empty() {
        return None;
    }
    routes.sort_by(|a, b| a.name.cmp(&b.name));
    routes.dedup_by(|a, b| a.name == b.name);
    let (volumes, mounts) = volumes
        .into_values()
        .map(|(v, mount_path)| {
            let mount = VolumeMount {
                name: v.name.clone(),
                mount_path,
                read_only: Some(true),
                ..Default::default()
            };
            (v, mount)
        })
        .unzip();
    Some(RenderedAdapters {
        args: spec.args.clone(),
        env: spec.env.clone(),
        volumes,
        mounts,
        table: AdapterTable {
            load_path: spec.load_path.clone(),
            unload_path: spec.unload_path.clone(),
            max_loaded: u32::try_from(spec.max_loaded).unwrap_or(1).max(1),
            adapters: routes,
        },
    })
}

impl Ctx<'_> {
    /// The ConfigMap `<service>-adapters` holding `table` for the service's own gateway.
    ///
    /// # Errors
    /// [`RenderError::Serialize`] if the table does not serialize (it always does).
    pub(super) fn adapters_config_map(
        &self,
        table: &AdapterTable,
    ) -> Result<ConfigMap, RenderError> {
        let json =
            serde_json::to_string(table).map_err(|e| RenderError::Serialize(e.to_string()))?;
        Ok(ConfigMap {
            metadata: self.meta(names::adapters(&self.name), Component::Gateway),
            data: Some(BTreeMap::from([(ADAPTERS_KEY.to_owned(), json)])),
            ..Default::default()
        })
    }
}

impl Ctx<'_> {
    /// The fetch Jobs of the service's hub adapters, one per source, sorted by name; none
    /// without a cache a Job can fill (the rules admit no hub adapter then) or without
    /// runtime support for adapters.
    pub(super) fn adapter_fetch_jobs(&self, cache: Option<&Volume>) -> Vec<Job> {
        let Some(cache) = cache else {
            return Vec::new();
        };
        if self.rt.spec.adapters.is_none()
            || self.source.is_staged()
            || !super::cache::fills_cache(self.svc.spec.cache.strategy)
        {
            return Vec::new();
        }
        let mut jobs: BTreeMap<String, Job> = BTreeMap::new();
        for a in &self.adapters.accepted {
            let Ok(source) = parse_uri(&a.spec.source.uri) else {
                continue;
            };
            let Some((hub, repo)) = hub_source(&source) else {
                continue;
            };
            let Some(name) = fetch_job_name(&self.name, a) else {
                continue;
            };
            if jobs.contains_key(&name) {
                continue;
            }
            let dir = hub_dir(hub, repo);
            let program = match hub {
                "hf" => format!(
                    "from huggingface_hub import snapshot_download\nprint(snapshot_download(repo_id={repo:?}, local_dir={dir:?}))\n"
                ),
                _ => format!(
                    "from modelscope import snapshot_download\nprint(snapshot_download({repo:?}, local_dir={dir:?}))\n"
                ),
            };
            // The adapter's own credentials (the rules admit a secretRef only from the base's
            // namespace, where this Job runs).
            let env_from = a.spec.source.secret_ref.as_ref().map(|s| {
                vec![EnvFromSource {
                    secret_ref: Some(SecretEnvSource {
                        name: s.name.clone(),
                        optional: None,
                    }),
                    ..Default::default()
                }]
            });
            let job = super::cache::cache_job(
                self,
                name.clone(),
                Component::AdapterFetch,
                cache.clone(),
                program,
                fetch_env(hub),
                env_from,
            );
            jobs.insert(name, job);
        }
        jobs.into_values().collect()
    }
}
