//! Which admission policy APIs the apiserver serves (`admissionregistration.k8s.io`): read by
//! discovery, for the export of ServingPolicies (`hearth_policies::export`), the controller
//! that applies it and the webhook that watches what it applied.

use kube::Client;
use kube::api::ApiResource;

/// What discovery found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AdmissionApis {
    /// The apiserver's Kubernetes minor version (`35` for 1.35).
    pub minor: u32,
    /// ValidatingAdmissionPolicy in `v1`.
    pub validating_v1: bool,
    /// MutatingAdmissionPolicy in `v1`.
    pub mutating_v1: bool,
    /// MutatingAdmissionPolicy in `v1beta1`.
    pub mutating_v1beta1: bool,
}

impl AdmissionApis {
    /// The API version MutatingAdmissionPolicy is served at, newest first.
    pub fn mutating_version(&self) -> Option<&'static str> {
        if self.mutating_v1 {
            Some("v1")
        } else if self.mutating_v1beta1 {
            Some("v1beta1")
        } else {
            None
        }
    }
}

async fn serves(client: &Client, group_version: &str, resource: &str) -> Result<bool, kube::Error> {
    match client.list_api_group_resources(group_version).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == resource)),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Asks the apiserver which admission policy APIs it serves.
///
/// # Errors
///
/// A discovery request that failed other than with 404 (a version not served), or a `/version`
/// without a minor version.
pub async fn discover(client: &Client) -> Result<AdmissionApis, kube::Error> {
    let version = client.apiserver_version().await?;
    let minor: u32 = version
        .minor
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .map_err(|_| {
            kube::Error::Discovery(kube::error::DiscoveryError::MissingResource(format!(
                "a Kubernetes minor version in the apiserver's /version (minor {:?})",
                version.minor
            )))
        })?;
    let v1 = "admissionregistration.k8s.io/v1";
    let v1beta1 = "admissionregistration.k8s.io/v1beta1";
    Ok(AdmissionApis {
        minor,
        validating_v1: serves(client, v1, "validatingadmissionpolicies").await?,
        mutating_v1: serves(client, v1, "mutatingadmissionpolicies").await?,
        mutating_v1beta1: serves(client, v1beta1, "mutatingadmissionpolicies").await?,
    })
}

/// The four kinds a ServingPolicy exports to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// `ValidatingAdmissionPolicy`.
    ValidatingAdmissionPolicy,
    /// `ValidatingAdmissionPolicyBinding`.
    ValidatingAdmissionPolicyBinding,
    /// `MutatingAdmissionPolicy`.
    MutatingAdmissionPolicy,
    /// `MutatingAdmissionPolicyBinding`.
    MutatingAdmissionPolicyBinding,
}

impl Kind {
    /// Every kind, in apply order (each policy before its binding).
    pub const ALL: [Kind; 4] = [
        Kind::ValidatingAdmissionPolicy,
        Kind::ValidatingAdmissionPolicyBinding,
        Kind::MutatingAdmissionPolicy,
        Kind::MutatingAdmissionPolicyBinding,
    ];

    /// The kind's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::ValidatingAdmissionPolicy => "ValidatingAdmissionPolicy",
            Kind::ValidatingAdmissionPolicyBinding => "ValidatingAdmissionPolicyBinding",
            Kind::MutatingAdmissionPolicy => "MutatingAdmissionPolicy",
            Kind::MutatingAdmissionPolicyBinding => "MutatingAdmissionPolicyBinding",
        }
    }

    /// The kind named `name`.
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// The plural resource name.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::ValidatingAdmissionPolicy => "validatingadmissionpolicies",
            Kind::ValidatingAdmissionPolicyBinding => "validatingadmissionpolicybindings",
            Kind::MutatingAdmissionPolicy => "mutatingadmissionpolicies",
            Kind::MutatingAdmissionPolicyBinding => "mutatingadmissionpolicybindings",
        }
    }

    /// Whether this is a MutatingAdmissionPolicy kind.
    pub fn is_mutating(self) -> bool {
        matches!(
            self,
            Kind::MutatingAdmissionPolicy | Kind::MutatingAdmissionPolicyBinding
        )
    }

    /// Whether this is a binding kind.
    pub fn is_binding(self) -> bool {
        matches!(
            self,
            Kind::ValidatingAdmissionPolicyBinding | Kind::MutatingAdmissionPolicyBinding
        )
    }

    /// The policy kind a binding kind binds (itself for a policy kind).
    pub fn policy_kind(self) -> Kind {
        match self {
            Kind::ValidatingAdmissionPolicyBinding => Kind::ValidatingAdmissionPolicy,
            Kind::MutatingAdmissionPolicyBinding => Kind::MutatingAdmissionPolicy,
            k => k,
        }
    }

    /// The resource as `apis` serve it (the newest version), `None` when not served.
    pub fn api_resource(self, apis: &AdmissionApis) -> Option<ApiResource> {
        let version = if self.is_mutating() {
            apis.mutating_version()?
        } else {
            apis.validating_v1.then_some("v1")?
        };
        Some(ApiResource {
            group: "admissionregistration.k8s.io".to_owned(),
            version: version.to_owned(),
            api_version: format!("admissionregistration.k8s.io/{version}"),
            kind: self.as_str().to_owned(),
            plural: self.plural().to_owned(),
        })
    }
}
