//! Following one ConfigMap the controller writes for the gateway: a shared gateway's route
//! table ([`crate::routes::watch_routes`]), a single-service gateway's adapter table
//! ([`crate::adapters::watch_adapters`]).
//!
//! A watch on that one object (a field selector on `metadata.name`), each version handed to
//! the caller as it comes. Until the ConfigMap exists, and after it is deleted, the caller is
//! told it is missing. Watch errors (the apiserver unreachable, RBAC forbidding the watch) are
//! logged and the watch retried with kube's backoff; what the caller applied last stays
//! meanwhile. RBAC: `get`, `list`, `watch` on `configmaps` in the namespace.

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::{WatchStreamExt, watcher};

/// Parses a table the controller writes as JSON into `T`; on failure the JSON path of the
/// value that does not fit and what is wrong with it.
pub(crate) fn parse_table<T: serde::de::DeserializeOwned>(
    json: &str,
) -> Result<T, (String, String)> {
    let de = &mut serde_json::Deserializer::from_str(json);
    serde_path_to_error::deserialize(de).map_err(|e| (e.path().to_string(), e.inner().to_string()))
}

/// What the followed object is, for the logs: `routes ConfigMap`, what a missing one means
/// (`no models are served`), the rights its watch needs, and what stays while it fails.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Followed {
    pub(crate) what: &'static str,
    pub(crate) nothing: &'static str,
    pub(crate) rbac: &'static str,
    pub(crate) kept: &'static str,
}

impl Followed {
    /// A ConfigMap the controller writes for the gateway (`routes`, `adapters`).
    pub(crate) const fn config_map(what: &'static str, nothing: &'static str) -> Self {
        Self {
            what,
            nothing,
            rbac: "get/list/watch on configmaps in the gateway's namespace",
            kept: "the table in force stays",
        }
    }
}

/// A change of the followed object.
#[derive(Debug)]
pub(crate) enum Change<'a, K = ConfigMap> {
    /// Its current version.
    Object(&'a K),
    /// It does not exist (yet, or any more).
    Missing,
}

/// Follows the object `name` of kind `K` in `namespace` (a ConfigMap, an LLMService), calling
/// `on` with `<namespace>/<name>` and each change, until the task is dropped.
pub(crate) async fn follow<K>(
    client: kube::Client,
    namespace: &str,
    name: &str,
    followed: Followed,
    mut on: impl FnMut(&str, Change<'_, K>),
) where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + 'static,
    K::DynamicType: Default,
{
    let Followed {
        what,
        nothing,
        rbac,
        kept,
    } = followed;
    let api: kube::Api<K> = kube::Api::namespaced(client, namespace);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let stream = watcher(api, cfg).default_backoff();
    futures::pin_mut!(stream);
    let object = format!("{namespace}/{name}");
    let mut listed = false;
    let mut applied_once = false;
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(watcher::Event::Init) => listed = false,
            Ok(watcher::Event::InitApply(o) | watcher::Event::Apply(o)) => {
                listed = true;
                on(&object, Change::Object(&o));
                applied_once = true;
            }
            Ok(watcher::Event::InitDone) => {
                if !listed {
                    if applied_once {
                        tracing::warn!(%object, "the {what} is gone: {nothing} until it is back");
                    } else {
                        tracing::info!(%object, "the {what} does not exist yet: {nothing} until it appears");
                    }
                    on(&object, Change::Missing);
                }
            }
            Ok(watcher::Event::Delete(_)) => {
                tracing::warn!(%object, "the {what} was deleted: {nothing} until it is back");
                on(&object, Change::Missing);
            }
            Err(e) => {
                if forbidden(&e) {
                    tracing::error!(%object, error = %e, "forbidden to watch the {what} (grant {rbac}); retrying, {kept}");
                } else {
                    tracing::warn!(%object, error = %e, "{what} watch error; retrying, {kept}");
                }
            }
        }
    }
}

/// Whether a watch error is the apiserver's `403 Forbidden` (RBAC does not allow the watch).
fn forbidden(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::InitialListFailed(kube::Error::Api(s)) | watcher::Error::WatchStartFailed(kube::Error::Api(s)) | watcher::Error::WatchFailed(kube::Error::Api(s)) if s.is_forbidden())
}
