//! What a gateway replica reports for metering, at [`METERING_PATH`]: per service it routes,
//! per tenant the requests, tokens and cold arrivals so far, and per backend endpoint whether
//! it serves and how long it has had a request in flight. The controller reads it from every
//! gateway replica to share the backend pods' accelerator-seconds among tenants and phases
//! (docs/tenants.md, "The bill").
//!
//! Every count is cumulative since the replica started (`instance` changes on a restart): a
//! reader keeps the last report of each instance and charges the difference.

use serde::{Deserialize, Serialize};

/// `GET` this path on a gateway replica's HTTP port: a [`MeteringReport`] as JSON.
pub const METERING_PATH: &str = "/hearth/metering";

/// One gateway replica's metering report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MeteringReport {
    /// The replica's instance (random at start, in hex): counts restart from 0 with a new one.
    pub instance: String,
    /// The services the replica routes to, each once.
    pub services: Vec<ServiceMetering>,
}

/// One service's counts at one gateway replica.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceMetering {
    /// `<namespace>/<name>` of the LLMService (or member Deployment) on a shared endpoint's
    /// gateway; empty on a service's own gateway.
    pub service: String,
    /// Per tenant that sent a request.
    pub tenants: Vec<TenantMetering>,
    /// Every backend endpoint the replica discovered (Ready pods).
    pub endpoints: Vec<EndpointMetering>,
}

/// One tenant's counts for one service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TenantMetering {
    /// The tenant's name (`default` without API keys).
    pub tenant: String,
    /// Requests dispatched to a backend.
    pub requests: u64,
    /// Tokens served (prompt and completion): the answers' `usage`, else the estimate.
    pub tokens: u64,
    /// Requests that arrived while no backend engine was ready and awake (held or rejected):
    /// the tenants who waited for a cold start or a wake-up.
    pub cold_requests: u64,
}

/// One backend endpoint as one gateway replica sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointMetering {
    /// `ip:port` (`[ip]:port` for IPv6) of the backend pod.
    pub address: String,
    /// Whether requests go to it: ready and, with the sleeping tier, awake. `false`: asleep,
    /// or being put to sleep, woken or probed.
    pub serving: bool,
    /// Seconds during which at least one request of this replica was in flight to it, since it
    /// last started serving here (restarts from 0 when it leaves the serving set and returns).
    pub busy_seconds: f64,
}
