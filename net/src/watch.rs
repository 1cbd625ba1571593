//! Watch settings shared by every Hearth component that watches the Kubernetes API (the
//! controller's caches, the webhook's ServingPolicy watch, the gateway's EndpointSlices).

use kube::runtime::watcher;

/// Server-side timeout of every watch request (`timeoutSeconds`), in seconds: 60 instead of
/// kube-runtime's 290. A watch opened while a kube-apiserver is still starting (right after a
/// restart) can stay open without delivering a single event until its timeout: on the local
/// cluster an LLMService edit went unseen for about four minutes after an apiserver and etcd
/// restart (docs/operations.md). Ending each watch after a minute bounds that window; the cost
/// is one new watch request per minute per watched kind, from the last `resourceVersion` (no
/// re-list).
pub const WATCH_TIMEOUT_SECS: u32 = 60;

/// kube-runtime's default watcher settings with [`WATCH_TIMEOUT_SECS`].
pub fn config() -> watcher::Config {
    watcher::Config::default().timeout(WATCH_TIMEOUT_SECS)
}
