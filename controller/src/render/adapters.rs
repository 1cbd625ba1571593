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
//!   - `hf://` and `modelscope://` adapters are not rendered yet: fetching them through the
//!     model cache is not implemented, and [`unserved`] says so for their status.
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
use k8s_openapi::api::core::v1::{
    ConfigMap, EnvVar, ImageVolumeSource, PersistentVolumeClaimVolumeSource, Volume, VolumeMount,
};
use kube::ResourceExt;

use super::{Ctx, RenderError};
use crate::{
    labels::Component,
    model::{ModelSource, parse_uri},
    names,
};

/// Where adapter volumes are mounted in the engine's container.
pub const ADAPTERS_MOUNT_ROOT: &str = "/adapters";

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

/// Why an accepted adapter is not served yet: its source is not one the engines can read
/// (see the module docs), `None` when it is.
pub fn unserved(adapter: &LLMAdapter) -> Option<String> {
    match parse_uri(&adapter.spec.source.uri) {
        Ok(ModelSource::Pvc { .. } | ModelSource::Oci { .. }) => None,
        Ok(ModelSource::HuggingFace { .. } | ModelSource::ModelScope { .. }) => Some(
            "spec.source.uri: hub sources (hf://, modelscope://) are not fetched into the model \
             cache yet; stage the adapter on a PersistentVolumeClaim (pvc://<claim>/<dir>) or \
             in an image (oci://)"
                .to_owned(),
        ),
        Err(e) => Some(e.to_string()),
    }
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
        rendered(self.rt, self.adapters)
    }
}

/// What `adapters` (accepted on a service served by `rt`, sorted by served name) add to the
/// service's children, or `None` without any (or when `rt` has no `spec.adapters`).
pub fn rendered(rt: &InferenceRuntime, adapters: &[LLMAdapter]) -> Option<RenderedAdapters> {
    let spec: &RuntimeAdapters = rt.spec.adapters.as_ref()?;
    if adapters.is_empty() {
        return None;
    }
    let mut volumes: BTreeMap<String, (Volume, String)> = BTreeMap::new();
    let mut routes = Vec::new();
    for a in adapters {
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
            // Not served yet (`unserved`).
            _ => continue,
        };
        routes.push(AdapterRoute {
            name: a.served_name().to_owned(),
            path,
            adapter: format!("{}/{}", a.namespace().unwrap_or_default(), a.name_any()),
            unavailable: None,
        });
    }
    // Only hub adapters (not served yet): nothing for the engine to load, so no flags either.
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
