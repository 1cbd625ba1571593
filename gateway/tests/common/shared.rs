//! Shared gateways (one replica, many models, routed by `model`) against in-process stubs.

use std::{collections::HashMap, sync::Arc};

use hearth_crds::llmendpoint::{ModelRoute, RouteTable};
use hearth_gateway::{
    EndpointSet, Gateway, GatewayConfig, RunningGateway, apikeys::ApiKeys, routes::default_route,
};

/// A route for model `name` of service `ns/<name>` (backend Service `<name>`), with the test
/// config's cold-start timings.
pub fn route(name: &str) -> ModelRoute {
    ModelRoute {
        heartbeat_interval: hearth_crds::Duration::new("50ms"),
        activation_timeout: hearth_crds::Duration::new("30s"),
        ..default_route("ns", name, name)
    }
}

/// The backends of a shared test gateway: backend Service name → endpoints, filled into each
/// model's set when it starts. Change a model's endpoints later through
/// `gateway.model(key).discovered()`.
pub type Backends = HashMap<String, Vec<http::uri::Authority>>;

/// A shared gateway serving `routes`, each model's backends from `backends` (by backend
/// Service; none: cold), API keys `keys`.
pub async fn shared_gateway_with_keys(
    cfg: GatewayConfig,
    routes: Vec<ModelRoute>,
    backends: Backends,
    keys: ApiKeys,
) -> RunningGateway {
    let backends = Arc::new(backends);
    let gw = Gateway::new_shared(
        cfg,
        keys,
        Arc::new(move |route: &ModelRoute, endpoints: &EndpointSet| {
            if let Some(eps) = backends.get(&route.backend_service) {
                endpoints.replace(eps.iter().cloned());
            }
        }),
    )
    .unwrap();
    gw.apply_routes(&RouteTable { models: routes }).unwrap();
    hearth_gateway::spawn(gw, "127.0.0.1".parse().unwrap())
        .await
        .unwrap()
}

/// [`shared_gateway_with_keys`] without API keys.
pub async fn shared_gateway(
    cfg: GatewayConfig,
    routes: Vec<ModelRoute>,
    backends: Backends,
) -> RunningGateway {
    shared_gateway_with_keys(cfg, routes, backends, ApiKeys::disabled()).await
}

/// A chat request body for model `model`.
pub fn chat_for(model: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "Hello there"}],
    })
}

/// Waits until `pred` holds for the demand of the model of service `key`.
pub async fn wait_model_demand(
    g: &RunningGateway,
    key: &str,
    pred: impl Fn(&hearth_gateway::demand::DemandState) -> bool,
) {
    let mut rx = g.gateway.model(key).unwrap().demand().subscribe();
    rx.wait_for(|s| pred(s)).await.unwrap();
}

/// A ScaledObject's reference naming `service` in its trigger metadata.
pub fn so_for(service: &str) -> hearth_gateway::scaler::pb::ScaledObjectRef {
    super::so_ref(&[(hearth_gateway::scaler::SERVICE_KEY, service)])
}
