//! The versions Hearth runs against, learned rather than assumed: Kubernetes from the
//! apiserver's `/version` (read at start), KEDA from the `app.kubernetes.io/version` label that
//! KEDA's release manifests and its Helm chart put on the ScaledObject CRD (followed by the
//! CRD's watch). Where a feature needs more than the version found, a mode that works is
//! rendered instead (docs/versioning.md, "Compatibility").

use std::{
    fmt,
    str::FromStr,
    sync::{Arc, RwLock},
};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

/// A `major.minor.patch` version; a leading `v` and anything after the patch (`-gke.100`,
/// `+k3s1`) are ignored, a missing patch is 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
}

impl Version {
    /// `major.minor.patch`.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl FromStr for Version {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let core = s.trim().trim_start_matches('v');
        let core = core.split(['-', '+']).next().unwrap_or_default();
        let mut parts = core.split('.');
        let mut next = |what: &str, required: bool| -> Result<u32, String> {
            match parts.next() {
                Some(p) => p
                    .parse()
                    .map_err(|_| format!("{s:?}: the {what} version {p:?} is not a number")),
                None if required => Err(format!("{s:?} is not a version like 1.30.2")),
                None => Ok(0),
            }
        };
        Ok(Self {
            major: next("major", true)?,
            minor: next("minor", true)?,
            patch: next("patch", false)?,
        })
    }
}

/// The oldest Kubernetes Hearth supports: `matchConditions` on admission webhooks (GA in 1.30),
/// native sidecars for the backend's drain (on by default since 1.29), the `sleep` preStop
/// action (on by default since 1.30). The chart's `kubeVersion` says the same.
pub const OLDEST_KUBERNETES: Version = Version::new(1, 30, 0);

/// The KEDA that sums a `metrics-api` trigger over a Service's endpoints
/// (`aggregateFromKubeServiceEndpoints`, in `pkg/scalers/metrics_api_scaler.go` from v2.19.0,
/// though KEDA's changelog lists it under 2.18), which the poll trigger uses to read each
/// gateway replica's own demand.
pub const KEDA_ENDPOINT_AGGREGATION: Version = Version::new(2, 19, 0);

/// The KEDA whose `metrics-api` trigger reads `authModes` (and `authMode`); before it, only
/// `authMode` (v2.17's `parseMetricsAPIMetadata`), so the bearer token would not be sent.
pub const KEDA_AUTH_MODES: Version = Version::new(2, 18, 0);

/// The oldest KEDA Hearth is tested with (docs/versioning.md).
pub const OLDEST_KEDA: Version = Version::new(2, 17, 0);

/// The version label KEDA puts on its objects.
pub const VERSION_LABEL: &str = "app.kubernetes.io/version";

/// KEDA's version as its ScaledObject CRD's `app.kubernetes.io/version` label says; `None`
/// without one, or with one that is not a release (`main`, `latest`).
pub fn keda_version_of(crd: &CustomResourceDefinition) -> Option<Version> {
    crd.metadata
        .labels
        .as_ref()?
        .get(VERSION_LABEL)?
        .parse()
        .ok()
}

/// KEDA's version, shared by the CRD's watch (which sets it) and every render (which reads it).
/// Unknown counts as current: a KEDA installed without the label is assumed to be new enough.
#[derive(Clone, Debug, Default)]
pub struct KedaVersion(Arc<RwLock<Option<Version>>>);

impl KedaVersion {
    /// A handle already holding `version` (tests, `render`).
    pub fn known(version: Option<Version>) -> Self {
        Self(Arc::new(RwLock::new(version)))
    }

    /// The version last seen.
    pub fn get(&self) -> Option<Version> {
        self.0.read().ok().and_then(|v| *v)
    }

    /// Records `version`; whether what KEDA can do changed ([`Self::aggregates_endpoints`],
    /// [`Self::reads_auth_modes`]), so that the ScaledObjects are rendered again.
    pub fn set(&self, version: Option<Version>) -> bool {
        let before = (self.aggregates_endpoints(), self.reads_auth_modes());
        if let Ok(mut v) = self.0.write() {
            *v = version;
        }
        before != (self.aggregates_endpoints(), self.reads_auth_modes())
    }

    /// Whether the `metrics-api` trigger reads `authModes` ([`KEDA_AUTH_MODES`]); if not, it
    /// is given `authMode`.
    pub fn reads_auth_modes(&self) -> bool {
        self.get().is_none_or(|v| v >= KEDA_AUTH_MODES)
    }

    /// Whether KEDA sums a `metrics-api` trigger over the Service's endpoints itself
    /// ([`KEDA_ENDPOINT_AGGREGATION`]); if not, the poll trigger asks one gateway replica for
    /// the total over its peers.
    pub fn aggregates_endpoints(&self) -> bool {
        self.get().is_none_or(|v| v >= KEDA_ENDPOINT_AGGREGATION)
    }
}

impl PartialEq for KedaVersion {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_as_releases_write_them() {
        for (s, want) in [
            ("v1.35.5", Version::new(1, 35, 5)),
            ("1.30.14-gke.1200", Version::new(1, 30, 14)),
            ("v1.33.1+k3s1", Version::new(1, 33, 1)),
            ("2.17", Version::new(2, 17, 0)),
            ("2.20.2", Version::new(2, 20, 2)),
        ] {
            assert_eq!(s.parse::<Version>(), Ok(want), "{s}");
        }
        for s in ["main", "latest", "", "2", "2.x.1"] {
            assert!(s.parse::<Version>().is_err(), "{s}");
        }
        assert!(Version::new(2, 18, 3) < KEDA_ENDPOINT_AGGREGATION);
        assert!(Version::new(1, 30, 0) >= OLDEST_KUBERNETES);
    }

    #[test]
    fn an_older_keda_changes_the_poll_trigger_and_an_unknown_one_does_not() {
        let v = KedaVersion::default();
        assert!(v.aggregates_endpoints());
        assert!(v.set(Some(Version::new(2, 17, 0))));
        assert!(!v.aggregates_endpoints() && !v.reads_auth_modes());
        assert!(!v.set(Some(Version::new(2, 17, 1))));
        assert!(v.set(Some(Version::new(2, 18, 0))));
        assert!(!v.aggregates_endpoints() && v.reads_auth_modes());
        assert!(v.set(Some(Version::new(2, 19, 0))));
        assert!(!v.set(None));
        let crd: CustomResourceDefinition = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "scaledobjects.keda.sh", "labels": {"app.kubernetes.io/version": "2.17.2"}},
            "spec": {"group": "keda.sh", "names": {"kind": "ScaledObject", "plural": "scaledobjects"}, "scope": "Namespaced", "versions": []},
        }))
        .unwrap();
        assert_eq!(keda_version_of(&crd), Some(Version::new(2, 17, 2)));
    }
}
