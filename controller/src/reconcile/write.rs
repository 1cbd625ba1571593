//! The writes a [`super::Plan`] decides, as data: what the executor sends, in order, and what
//! the plan's table tests read.

use std::fmt;

use k8s_openapi::api::{
    apps::v1::Deployment,
    batch::v1::Job,
    core::v1::{ConfigMap, PersistentVolumeClaim, Service, ServiceAccount},
    networking::v1::NetworkPolicy,
    policy::v1::PodDisruptionBudget,
    rbac::v1::{Role, RoleBinding},
};
use kube::api::DynamicObject;
use serde::Serialize;

/// The kinds of children the controller writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `v1` ServiceAccount (the gateway's).
    ServiceAccount,
    /// `rbac.authorization.k8s.io/v1` Role (the gateway's).
    Role,
    /// `rbac.authorization.k8s.io/v1` RoleBinding (the gateway's).
    RoleBinding,
    /// `v1` PersistentVolumeClaim (the model cache).
    PersistentVolumeClaim,
    /// `batch/v1` Job (the prewarm).
    Job,
    /// `v1` Service (backend, gateway, scaler).
    Service,
    /// `apps/v1` Deployment (backend, gateway).
    Deployment,
    /// `policy/v1` PodDisruptionBudget (the gateway's).
    PodDisruptionBudget,
    /// KEDA's ScaledObject (its API is [`crate::RenderConfig::keda_api`]).
    ScaledObject,
    /// `v1` ConfigMap (an endpoint's routing table).
    ConfigMap,
    /// `networking.k8s.io/v1` NetworkPolicy (the gateway's and the backend's).
    NetworkPolicy,
}

impl Kind {
    /// The kind's name, as the API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::ServiceAccount => "ServiceAccount",
            Kind::Role => "Role",
            Kind::RoleBinding => "RoleBinding",
            Kind::PersistentVolumeClaim => "PersistentVolumeClaim",
            Kind::Job => "Job",
            Kind::Service => "Service",
            Kind::Deployment => "Deployment",
            Kind::PodDisruptionBudget => "PodDisruptionBudget",
            Kind::ScaledObject => "ScaledObject",
            Kind::ConfigMap => "ConfigMap",
            Kind::NetworkPolicy => "NetworkPolicy",
        }
    }
}

/// One child, by kind and name, in the namespace of the object written for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// Its kind.
    pub kind: Kind,
    /// Its name.
    pub name: String,
}

impl Target {
    /// A child of `kind` named `name`.
    pub fn new(kind: Kind, name: impl Into<String>) -> Self {
        Self {
            kind,
            name: name.into(),
        }
    }
}

/// A rendered child to apply; serializes as the object itself.
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
#[allow(missing_docs)] // each variant is the child of its kind
pub enum Object {
    ServiceAccount(Box<ServiceAccount>),
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    PersistentVolumeClaim(Box<PersistentVolumeClaim>),
    Job(Box<Job>),
    Service(Box<Service>),
    Deployment(Box<Deployment>),
    PodDisruptionBudget(Box<PodDisruptionBudget>),
    ScaledObject(Box<DynamicObject>),
    ConfigMap(Box<ConfigMap>),
    NetworkPolicy(Box<NetworkPolicy>),
}

impl Object {
    /// Its kind and name.
    pub fn target(&self) -> Target {
        let (kind, meta) = match self {
            Object::ServiceAccount(o) => (Kind::ServiceAccount, &o.metadata),
            Object::Role(o) => (Kind::Role, &o.metadata),
            Object::RoleBinding(o) => (Kind::RoleBinding, &o.metadata),
            Object::PersistentVolumeClaim(o) => (Kind::PersistentVolumeClaim, &o.metadata),
            Object::Job(o) => (Kind::Job, &o.metadata),
            Object::Service(o) => (Kind::Service, &o.metadata),
            Object::Deployment(o) => (Kind::Deployment, &o.metadata),
            Object::PodDisruptionBudget(o) => (Kind::PodDisruptionBudget, &o.metadata),
            Object::ScaledObject(o) => (Kind::ScaledObject, &o.metadata),
            Object::ConfigMap(o) => (Kind::ConfigMap, &o.metadata),
            Object::NetworkPolicy(o) => (Kind::NetworkPolicy, &o.metadata),
        };
        Target::new(kind, meta.name.clone().unwrap_or_default())
    }
}

macro_rules! object_from {
    ($($variant:ident: $ty:ty),* $(,)?) => {$(
        impl From<$ty> for Object {
            fn from(o: $ty) -> Self {
                Object::$variant(Box::new(o))
            }
        }
    )*};
}

object_from! {
    ServiceAccount: ServiceAccount,
    Role: Role,
    RoleBinding: RoleBinding,
    PersistentVolumeClaim: PersistentVolumeClaim,
    Job: Job,
    Service: Service,
    Deployment: Deployment,
    PodDisruptionBudget: PodDisruptionBudget,
    ScaledObject: DynamicObject,
    ConfigMap: ConfigMap,
    NetworkPolicy: NetworkPolicy,
}

/// One API write, in the namespace of the service (or endpoint) it is planned for. A replace is a [`Write::Delete`] followed by the
/// child's [`Write::Apply`]; a child the caches already hold as desired has no write at all.
#[derive(Clone, Debug)]
pub enum Write {
    /// Server-side apply, forced, under the controller's field manager.
    Apply(Object),
    /// Move the fields other managers own to the controller's field manager before the child's
    /// first apply ([`crate::adopt::adopt`]).
    Adopt(Target),
    /// The backend Deployment's plain create, with `spec.replicas`, so that field stays with the
    /// create entry of `managedFields`. A 409 (the cache was behind) is recovered by reading
    /// it and writing what [`super::after_conflict`] says.
    Create(Box<Deployment>),
    /// Delete a child this service controls (planned only for those); gone already is done.
    Delete(Target),
}

impl Write {
    /// The verb and the child it writes.
    pub fn parts(&self) -> (&'static str, Target) {
        match self {
            Write::Apply(o) => ("apply", o.target()),
            Write::Adopt(t) => ("adopt", t.clone()),
            Write::Create(d) => (
                "create",
                Target::new(
                    Kind::Deployment,
                    d.metadata.name.clone().unwrap_or_default(),
                ),
            ),
            Write::Delete(t) => ("delete", t.clone()),
        }
    }

    /// What is being done, for errors: `apply Deployment team-a/chat`.
    pub fn action(&self, namespace: &str) -> String {
        let (verb, t) = self.parts();
        format!("{verb} {} {namespace}/{}", t.kind.as_str(), t.name)
    }
}

/// `apply Deployment chat`.
impl fmt::Display for Write {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (verb, t) = self.parts();
        write!(f, "{verb} {} {}", t.kind.as_str(), t.name)
    }
}
