//! Model sources without the public hubs: what reaches whatever fetches weights (the engine, the
//! prewarm Job, the LoRA adapters' fetch Jobs), set once per cluster, per runtime and per
//! service (docs/controller.md, "Model sources").
//!
//! | level | where | what |
//! |---|---|---|
//! | cluster | `--model-sources` (chart value `modelSources`) | `env` (a hub mirror, a proxy) on every engine and Job; `caBundle`, a ConfigMap of that name in each model's namespace (trust-manager distributes one), mounted at [`CA_MOUNT_DIR`] with `SSL_CERT_FILE` and `REQUESTS_CA_BUNDLE` naming its key |
//! | runtime | `InferenceRuntime.spec.container.env` | on the engine, as always; its download settings ([`is_download_setting`]) on the Jobs too |
//! | service | `LLMService.spec.model.source.secretRef` | every key of the Secret as a variable (`envFrom`), engine and prewarm Job (a token, a mirror of its own) |
//!
//! A name the runtime sets wins over the cluster's; both win over the service's Secret, since
//! Kubernetes gives `env` precedence over `envFrom`. On the Jobs these settings are left out of
//! the template hash: a new mirror address does not make a finished prewarm Job
//! `ReplaceRequired` (the files it fetched are the same).

use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, EnvVar, KeyToPath, PodSpec, Volume, VolumeMount,
};
use serde::{Deserialize, Serialize};

/// Where the cluster's CA bundle for model sources is mounted (read-only).
pub const CA_MOUNT_DIR: &str = "/etc/hearth/model-source-ca";
/// The file name of the bundle under [`CA_MOUNT_DIR`].
pub const CA_FILE: &str = "ca.crt";
/// The variables that point Python's HTTP clients (requests, httpx, urllib) at the bundle.
pub const CA_ENV: [&str; 2] = ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"];
/// The volume's name in the pod.
const CA_VOLUME: &str = "model-source-ca";

/// The cluster's model-source settings (`--model-sources`, JSON; the chart writes it from
/// `modelSources`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelSources {
    /// Variables for everything that fetches weights, by value only (a token belongs in a
    /// service's Secret): `HF_ENDPOINT`, `HTTPS_PROXY`, `NO_PROXY`, ...
    #[serde(default)]
    pub env: Vec<SourceVar>,
    /// A CA bundle the fetches trust: a ConfigMap present in every model namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<CaBundle>,
}

/// One variable of [`ModelSources::env`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceVar {
    /// The variable's name (a C identifier).
    pub name: String,
    /// Its value.
    pub value: String,
}

/// A ConfigMap key holding PEM certificates ([`ModelSources::ca_bundle`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CaBundle {
    /// The ConfigMap's name, the same in every model namespace.
    pub config_map: String,
    /// The key holding the bundle (default `ca.crt`).
    #[serde(default = "default_ca_key")]
    pub key: String,
}

fn default_ca_key() -> String {
    CA_FILE.to_owned()
}

impl ModelSources {
    /// Parses and checks `--model-sources`.
    ///
    /// # Errors
    /// The JSON path or field at fault and the fix: a variable name that is not a C identifier,
    /// or one Hearth sets itself (the hub caches' locations, `HF_HUB_OFFLINE`), a ConfigMap name
    /// or key that cannot be one.
    pub fn parse(json: &str) -> Result<Self, String> {
        let s: Self = serde_json::from_str(json).map_err(|e| {
            format!(
                "{e}; expected {{\"env\": [{{\"name\": \"HF_ENDPOINT\", \"value\": \"https://hf-mirror.example\"}}], \"caBundle\": {{\"configMap\": \"corp-ca\", \"key\": \"ca.crt\"}}}}"
            )
        })?;
        for (i, v) in s.env.iter().enumerate() {
            if !is_c_identifier(&v.name) {
                return Err(format!(
                    "env[{i}].name {:?} is not a variable name (letters, digits and '_', not starting with a digit)",
                    v.name
                ));
            }
            if HEARTH_OWNED.contains(&v.name.as_str()) {
                return Err(format!(
                    "env[{i}].name {:?} is set by Hearth (where the model cache is, whether it is read offline); leave it out",
                    v.name
                ));
            }
            if s.env[..i].iter().any(|w| w.name == v.name) {
                return Err(format!("env[{i}].name {:?} is listed twice", v.name));
            }
        }
        if let Some(ca) = &s.ca_bundle {
            if !hearth_crds::naming::is_dns1123_subdomain(&ca.config_map) {
                return Err(format!(
                    "caBundle.configMap {:?} is not a ConfigMap name",
                    ca.config_map
                ));
            }
            if ca.key.is_empty()
                || !ca
                    .key
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            {
                return Err(format!(
                    "caBundle.key {:?} is not a ConfigMap key (letters, digits, '-', '_', '.')",
                    ca.key
                ));
            }
        }
        Ok(s)
    }

    /// The variables for a fetch: [`ModelSources::env`], then the CA variables when a bundle is
    /// set, each unless `taken` (a name set already, by the runtime) says otherwise.
    pub fn env(&self, taken: impl Fn(&str) -> bool) -> Vec<EnvVar> {
        let ca = self.ca_bundle.iter().flat_map(|_| {
            CA_ENV.iter().map(|name| SourceVar {
                name: (*name).to_owned(),
                value: format!("{CA_MOUNT_DIR}/{CA_FILE}"),
            })
        });
        self.env
            .iter()
            .cloned()
            .chain(ca)
            .filter(|v| !taken(&v.name))
            .map(|v| EnvVar {
                name: v.name,
                value: Some(v.value),
                value_from: None,
            })
            .collect()
    }

    /// The CA bundle's volume and its mount, when one is set. The ConfigMap is optional: a
    /// namespace without it starts the pod, and a fetch over TLS then names the missing file.
    pub fn ca_volume(&self) -> Option<(Volume, VolumeMount)> {
        let ca = self.ca_bundle.as_ref()?;
        Some((
            Volume {
                name: CA_VOLUME.to_owned(),
                config_map: Some(ConfigMapVolumeSource {
                    name: ca.config_map.clone(),
                    items: Some(vec![KeyToPath {
                        key: ca.key.clone(),
                        path: CA_FILE.to_owned(),
                        mode: None,
                    }]),
                    optional: Some(true),
                    default_mode: None,
                }),
                ..Default::default()
            },
            VolumeMount {
                name: CA_VOLUME.to_owned(),
                mount_path: CA_MOUNT_DIR.to_owned(),
                read_only: Some(true),
                ..Default::default()
            },
        ))
    }

    /// Adds the CA bundle's volume to `pod` and its mount to the container `container` of it.
    pub fn mount_ca(&self, pod: &mut PodSpec, container: &str) {
        let Some((volume, mount)) = self.ca_volume() else {
            return;
        };
        let Some(c) = pod.containers.iter_mut().find(|c| c.name == container) else {
            return;
        };
        c.volume_mounts.get_or_insert_with(Vec::new).push(mount);
        pod.volumes.get_or_insert_with(Vec::new).push(volume);
    }
}

/// Names Hearth sets on a fetch itself: the hub caches' locations and offline mode.
const HEARTH_OWNED: &[&str] = &[
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "MODELSCOPE_CACHE",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
];

fn is_c_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Whether a runtime's variable `name` concerns fetching weights, and so reaches the prewarm and
/// adapter fetch Jobs as well as the engine: the hubs' settings (`HF_*`, `HUGGING_FACE_*`,
/// `MODELSCOPE_*`: endpoint, token, timeouts), proxies (`HTTP_PROXY`, `HTTPS_PROXY`,
/// `NO_PROXY`, `ALL_PROXY`, any case) and CA bundles (`SSL_CERT_FILE`, `SSL_CERT_DIR`,
/// `REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE`); never a name Hearth sets on the Jobs itself (the
/// caches' locations, `HF_HUB_OFFLINE`).
pub fn is_download_setting(name: &str) -> bool {
    if HEARTH_OWNED.contains(&name) {
        return false;
    }
    let upper = name.to_ascii_uppercase();
    ["HF_", "HUGGING_FACE_", "MODELSCOPE_"]
        .iter()
        .any(|p| name.starts_with(p))
        || matches!(
            upper.as_str(),
            "HTTP_PROXY" | "HTTPS_PROXY" | "NO_PROXY" | "ALL_PROXY"
        )
        || matches!(
            name,
            "SSL_CERT_FILE" | "SSL_CERT_DIR" | "REQUESTS_CA_BUNDLE" | "CURL_CA_BUNDLE"
        )
}

/// The runtime's download settings for a Job: its variables [`is_download_setting`] names,
/// as the engine gets them (`rendered`: the runtime's `container.env` with its templates
/// rendered), without those read from the serving container's resources (a Job has none).
pub fn runtime_download_env(rendered: &[EnvVar]) -> Vec<EnvVar> {
    rendered
        .iter()
        .filter(|e| is_download_setting(&e.name))
        .filter(|e| {
            e.value_from
                .as_ref()
                .is_none_or(|f| f.resource_field_ref.is_none())
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn download_settings_are_the_hubs_proxies_and_ca_bundles() {
        for name in [
            "HF_ENDPOINT",
            "HF_TOKEN",
            "HUGGING_FACE_HUB_TOKEN",
            "HF_HUB_ETAG_TIMEOUT",
            "MODELSCOPE_DOMAIN",
            "HTTPS_PROXY",
            "https_proxy",
            "no_proxy",
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
        ] {
            assert!(is_download_setting(name), "{name}");
        }
        for name in [
            "HF_HOME",
            "HF_HUB_OFFLINE",
            "MODELSCOPE_CACHE",
            "VLLM_USE_V1",
            "ASCEND_RT_VISIBLE_DEVICES",
            "PYTORCH_CUDA_ALLOC_CONF",
        ] {
            assert!(!is_download_setting(name), "{name}");
        }
    }

    #[test]
    fn the_flag_names_the_field_at_fault() {
        let ok = ModelSources::parse(
            r#"{"env": [{"name": "HF_ENDPOINT", "value": "http://mirror"}], "caBundle": {"configMap": "corp-ca"}}"#,
        )
        .unwrap();
        assert_eq!(ok.ca_bundle.as_ref().unwrap().key, "ca.crt");
        let env = ok.env(|n| n == "REQUESTS_CA_BUNDLE");
        let names: Vec<&str> = env.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["HF_ENDPOINT", "SSL_CERT_FILE"]);
        assert_eq!(
            env[1].value.as_deref(),
            Some("/etc/hearth/model-source-ca/ca.crt")
        );
        for (json, want) in [
            (r#"{"env": [{"name": "1X", "value": ""}]}"#, "env[0].name"),
            (
                r#"{"env": [{"name": "HF_HOME", "value": "/x"}]}"#,
                "env[0].name",
            ),
            (
                r#"{"env": [{"name": "A", "value": ""}, {"name": "A", "value": ""}]}"#,
                "env[1].name",
            ),
            (
                r#"{"caBundle": {"configMap": "Corp CA"}}"#,
                "caBundle.configMap",
            ),
            (
                r#"{"caBundle": {"configMap": "ca", "key": "a/b"}}"#,
                "caBundle.key",
            ),
            (r#"{"proxy": "x"}"#, "unknown field `proxy`"),
        ] {
            let e = ModelSources::parse(json).unwrap_err();
            assert!(e.contains(want), "{json}: {e}");
        }
    }

    #[test]
    fn resource_references_stay_on_the_engine() {
        let env: Vec<EnvVar> = serde_json::from_value(serde_json::json!([
            {"name": "HF_ENDPOINT", "value": "http://mirror"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "HF_HUB_DOWNLOAD_TIMEOUT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
        ]))
        .unwrap();
        let names: Vec<String> = runtime_download_env(&env)
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, ["HF_ENDPOINT", "HF_TOKEN"]);
    }
}
