//! The ServingPolicies the apiserver runs itself: the ValidatingAdmissionPolicies,
//! MutatingAdmissionPolicies and bindings the controller's export mode applied (label
//! `serving.hearth.dev/exported-from`), watched as metadata. A policy whose exported objects
//! are all in place, for its current generation and the current runtimes
//! ([`hearth_policies::export::is_exported`]), is left out of the snapshot: the apiserver
//! enforces it, and evaluating it here too would report its warnings twice. When one of them
//! goes, the next rebuild evaluates it here again.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use hearth_crds::admission_apis::AdmissionApis;
use hearth_policies::export::{EXPORTED_FROM, Kind};
use kube::api::DynamicObject;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::Notify;

type Entries = BTreeMap<(Kind, String), BTreeMap<String, String>>;

/// The exported objects seen, by kind and name: their annotations. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Exported(Arc<RwLock<Entries>>);

impl Exported {
    /// The annotations of the exported `kind` named `name`, when it exists.
    pub fn get(&self, kind: Kind, name: &str) -> Option<BTreeMap<String, String>> {
        let entries = match self.0.read() {
            Ok(e) => e,
            Err(poisoned) => poisoned.into_inner(),
        };
        entries.get(&(kind, name.to_owned())).cloned()
    }

    fn update(&self, f: impl FnOnce(&mut Entries)) {
        let mut entries = match self.0.write() {
            Ok(e) => e,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut entries);
    }
}

/// Watches the exported objects of every kind `apis` serves into `exported`, notifying
/// `changed` on each change. Returns the watch tasks (one per kind).
pub fn watch(
    client: &Client,
    apis: &AdmissionApis,
    exported: &Exported,
    changed: &Arc<Notify>,
) -> Vec<tokio::task::JoinHandle<()>> {
    Kind::ALL
        .into_iter()
        .filter_map(|kind| {
            let ar = kind.api_resource(apis)?;
            let api: Api<PartialObjectMeta<DynamicObject>> = Api::all_with(client.clone(), &ar);
            let stream = watcher(api, watcher::Config::default().labels(EXPORTED_FROM))
                .default_backoff();
            let exported = exported.clone();
            let changed = changed.clone();
            Some(tokio::spawn(async move {
                let mut stream = std::pin::pin!(stream);
                // Names listed since the last (re)list began.
                let mut listing: Vec<(String, BTreeMap<String, String>)> = Vec::new();
                while let Some(ev) = stream.next().await {
                    match ev {
                        Ok(watcher::Event::Init) => listing.clear(),
                        Ok(watcher::Event::InitApply(o)) => {
                            listing.push((o.name_any(), o.annotations().clone()));
                        }
                        Ok(watcher::Event::InitDone) => exported.update(|e| {
                            e.retain(|(k, _), _| *k != kind);
                            for (name, a) in listing.drain(..) {
                                e.insert((kind, name), a);
                            }
                        }),
                        Ok(watcher::Event::Apply(o)) => exported.update(|e| {
                            e.insert((kind, o.name_any()), o.annotations().clone());
                        }),
                        Ok(watcher::Event::Delete(o)) => exported.update(|e| {
                            e.remove(&(kind, o.name_any()));
                        }),
                        Err(e) => {
                            // What can no longer be seen is not trusted: the policies this kind
                            // held are evaluated here again until the watch lists anew.
                            tracing::warn!(kind = kind.as_str(), error = %e, "watch error; retrying");
                            exported.update(|e| e.retain(|(k, _), _| *k != kind));
                        }
                    }
                    changed.notify_one();
                }
            }))
        })
        .collect()
}
