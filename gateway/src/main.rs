//! `hearth-gateway`: the thin binary over the `hearth_gateway` library.
//!
//! `hearth-gateway [flags]` serves; `hearth-gateway drain --url … --timeout …` is the backend
//! pods' preStop drain (`--listen` serves it to an `httpGet` hook from a native sidecar). Flags
//! and environment variables: `--help` and `docs/gateway.md`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use hearth_gateway::{
    Gateway, GatewayConfig, KubeBackends,
    adapters::watch_adapters,
    admin::AdminAuth,
    apikeys::ApiKeys,
    cli::{Cli, Command, DrainArgs, ServeArgs},
    discovery::{SliceSource, watch_endpoints},
    drain::{serve_drain, wait_backend_idle},
    endpoints::EndpointSet,
    peers::{PeerSet, other_replicas},
    routes::watch_routes,
};
use hearth_net::ListenOptions;
use hearth_net::process::{self, LogFormat, Setup, Signals};

/// jemalloc instead of glibc's malloc: its metadata lives outside the allocations, so the
/// unwritten parts of each connection's 8 KiB hyper buffers stay out of resident memory
/// (measured by the gateway bench's held-connections section).
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let setup = Setup {
        log_format: LogFormat::Json,
        default_filter: "info",
    };
    match cli.command {
        Some(Command::Drain(args)) => process::main(setup, drain(args)),
        None => process::main(setup, serve(cli.serve)),
    }
}

async fn drain(args: DrainArgs) -> anyhow::Result<()> {
    let spec = args.spec();
    let Some(listen) = args.listen else {
        wait_backend_idle(&spec).await.log();
        return Ok(());
    };
    let listener = hearth_net::listen(listen, ListenOptions::default()).context("--listen")?;
    tracing::info!(%listen, url = %spec.url, timeout_s = spec.timeout.as_secs(), "serving GET /drain");
    let mut signals = Signals::install()?;
    serve_drain(listener, spec, async move {
        signals.recv().await;
    })
    .await
    .context("serving the drain")
}

async fn kube_client() -> anyhow::Result<kube::Client> {
    kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let cfg = args.gateway_config()?;
    let cfg_has_quota = cfg.tenants.any_quota();
    let mut signals = Signals::install()?;
    let body_memory_limit = cfg.body_memory_limit;
    let keys = ApiKeys::load_tenants(args.api_key_file.as_deref(), &cfg.tenants)?;
    let needs_kube = args.routes_configmap.is_some()
        || args.adapters_configmap.is_some()
        || args.backend_service.is_some()
        || args.peer_service.is_some()
        || (args.llmservice.is_some() && args.sleep_after.is_some());
    let client = if needs_kube {
        Some(kube_client().await?)
    } else {
        None
    };
    let gateway = match (&args.routes_configmap, &client) {
        (Some(configmap), Some(client)) => {
            shared_gateway(&args, cfg, keys, client.clone(), configmap)?
        }
        _ => single_gateway(&args, cfg, keys, client.as_ref())?,
    };
    if let (Some(configmap), Some(client)) = (&args.adapters_configmap, &client) {
        tracing::info!(namespace = %args.namespace, configmap, key = hearth_crds::llmadapter::ADAPTERS_KEY, "following the adapter table");
        tokio::spawn(watch_adapters(
            client.clone(),
            args.namespace.clone(),
            configmap.clone(),
            gateway.clone(),
        ));
    }

    let admin_auth = match &args.admin_auth_dir {
        Some(dir) => AdminAuth::load(dir).context("--admin-auth-dir")?,
        None => {
            tracing::warn!(admin = %args.admin_listen, "no --admin-auth-dir: the admin port (demand, metrics, metering) is open to anyone who reaches it");
            AdminAuth::open()
        }
    };
    tokio::spawn(admin_auth.clone().watch());
    if let (Some(service), Some(client)) = (&args.peer_service, client) {
        let peers = PeerSet::new(gateway.peer_sink()).authenticated(admin_auth.clone());
        let source = SliceSource {
            namespace: args.namespace.clone(),
            service: service.clone(),
            port_name: args.peer_port_name.clone(),
        };
        let me = args.pod_ips.clone();
        // The tenants' quotas are shared with the same peers (see hearth_gateway::quota).
        let (quota_peers, quota_rx) = tokio::sync::watch::channel(Vec::new());
        if cfg_has_quota {
            tokio::spawn(hearth_gateway::quota::sync_peers(
                gateway.quotas(),
                quota_rx,
                gateway.instance(),
                admin_auth.clone(),
            ));
        }
        let g = gateway.clone();
        tokio::spawn(async move {
            let feed = peers.clone();
            let e = watch_endpoints(client, source, move |eps| {
                let others = other_replicas(eps, &me);
                g.set_peer_count(others.len());
                quota_peers.send_replace(others.clone());
                feed.update(others);
            })
            .await;
            tracing::error!(error = %e, "peer discovery stopped; total demand is unknown");
            peers.discovery_failed(e.to_string());
        });
    }

    let grpc = hearth_net::listen(args.scaler_listen, ListenOptions::default())
        .context("--scaler-listen")?;
    let scaler_tls = args
        .scaler_tls_dir
        .as_deref()
        .map(|dir| {
            hearth_gateway::scaler_tls::ScalerTls::load(dir, args.scaler_client_name.as_deref())
        })
        .transpose()
        .context("--scaler-tls-dir")?;
    if let Some(tls) = &scaler_tls {
        tokio::spawn(tls.clone().watch());
    }
    // Background work (the activation lease, key reloads) runs before the first request.
    gateway.spawn_background(args.api_key_reload_interval);
    // Every port is bound before the first answers: a port that cannot be bound ends the process
    // before readiness is ever 200.
    let admin = hearth_net::listen(args.admin_listen, ListenOptions::default())
        .context("--admin-listen")?;
    let workers = args
        .http_workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let http_workers = gateway
        .serve_http_workers(args.listen, workers)
        .context("--listen")?;
    let g = gateway.clone();
    let admin_authenticated = admin_auth.enabled();
    let admin_task = tokio::spawn(async move { g.serve_admin(admin, admin_auth).await });
    tracing::info!(
        http = %args.listen,
        scaler = %args.scaler_listen,
        scaler_tls = args.scaler_tls_dir.is_some(),
        admin = %args.admin_listen,
        admin_authenticated,
        workers,
        body_memory_limit,
        shared = gateway.is_shared(),
        "hearth-gateway serving"
    );
    let g = gateway.clone();
    let grpc_task = tokio::spawn(async move {
        match scaler_tls {
            Some(tls) => g.serve_grpc_tls(grpc, tls).await,
            None => g.serve_grpc(grpc).await,
        }
    });

    signals.recv().await;
    tracing::info!(
        pending = gateway.demand().state().pending(),
        "draining: readiness is 503, new requests get 503, in-flight requests continue"
    );
    let g = gateway.clone();
    let left = tokio::select! {
        left = g.drain() => left,
        _ = signals.recv() => { gateway.stop(); gateway.demand().state().pending() }
    };
    if left > 0 {
        tracing::warn!(
            pending = left,
            "drain timeout passed with requests in flight"
        );
    } else {
        tracing::info!("drained");
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = grpc_task.await;
        let _ = admin_task.await;
        let _ = tokio::task::spawn_blocking(move || {
            for w in http_workers {
                let _ = w.join();
            }
        })
        .await;
    })
    .await;
    Ok(())
}

/// A shared gateway: the models of the route table in ConfigMap `configmap`, which it
/// follows from now on.
fn shared_gateway(
    args: &ServeArgs,
    cfg: GatewayConfig,
    keys: ApiKeys,
    client: kube::Client,
    configmap: &str,
) -> anyhow::Result<Gateway> {
    let source = Arc::new(KubeBackends::new(
        client.clone(),
        std::env::var("POD_NAME").ok(),
    ));
    let gateway = Gateway::new_shared(cfg, keys, source).context("starting the gateway")?;
    tracing::info!(namespace = %args.namespace, configmap, key = hearth_crds::llmendpoint::ROUTES_KEY, "shared gateway: following the route table");
    tokio::spawn(watch_routes(
        client,
        args.namespace.clone(),
        configmap.to_owned(),
        gateway.clone(),
    ));
    Ok(gateway)
}

/// A single-service gateway: its backends discovered from --backend-service, or
/// --backend-url.
fn single_gateway(
    args: &ServeArgs,
    cfg: GatewayConfig,
    keys: ApiKeys,
    client: Option<&kube::Client>,
) -> anyhow::Result<Gateway> {
    let fallback = args.fallback_authority()?;
    let backends = EndpointSet::new();
    match (&args.backend_service, client) {
        (Some(service), Some(client)) => {
            let source = SliceSource {
                namespace: args.namespace.clone(),
                service: service.clone(),
                port_name: args.backend_port_name.clone(),
            };
            let set = backends.clone();
            let client = client.clone();
            tokio::spawn(async move {
                let feed = set.clone();
                let e = watch_endpoints(client, source, move |eps| feed.replace(eps)).await;
                match fallback {
                    Some(auth) => {
                        tracing::warn!(error = %e, fallback = %auth, "backend discovery stopped; forwarding to the Service URL");
                        set.replace([auth]);
                    }
                    None => tracing::error!(error = %e, "backend discovery stopped"),
                }
            });
        }
        _ => {
            let auth = fallback.context("no backend: set --backend-service or --backend-url")?;
            tracing::info!(backend = %auth, "fixed backend (no discovery)");
            backends.replace([auth]);
        }
    }

    // The LLMService's activation failures end the requests held for it.
    if let (Some(service), Some(client), Some(_)) =
        (&args.llmservice, client, &args.backend_service)
    {
        tokio::spawn(hearth_gateway::diagnosis::follow(
            client.clone(),
            args.namespace.clone(),
            service.clone(),
            backends.clone(),
        ));
    }
    let gateway = Gateway::new(cfg, backends, keys).context("starting the gateway")?;
    if let (Some(service), Some(client)) = (&args.llmservice, client) {
        gateway.report_to(hearth_gateway::sleep::ServiceReporter::new(
            client.clone(),
            &args.namespace,
            service,
            args.llmservice_uid.clone(),
            std::env::var("POD_NAME").ok(),
        ));
    }
    Ok(gateway)
}
