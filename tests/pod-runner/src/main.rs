//! `hearth-pod-runner`: the test-only kubelet of tests/cluster's fake nodes for pods whose image
//! maps to a local binary (the gateway and the vLLM stub). See tests/pod-runner/README.md.

mod net;
mod pod;
mod probe;
mod services;

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Parser, Subcommand};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Preconditions};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::{Api, Client, Config, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::pod::{Shared, Term};

#[derive(Parser)]
#[command(
    version,
    about = "Test-only kubelet: runs gateway and vllm-stub pods of the local test cluster as processes in their own network namespaces"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run until SIGTERM/SIGINT; needs root (network namespaces, veths, a bridge, /etc/hosts)
    Run {
        /// Admin kubeconfig of the cluster (tests/cluster/.state/kubeconfig)
        #[arg(long, env = "KUBECONFIG")]
        kubeconfig: PathBuf,
        /// Directory for the PID file, the record of made network names and per-pod files
        #[arg(long)]
        state_dir: PathBuf,
        /// `IMAGE=BINARY`: a container (the pod's first, or a native sidecar) with image IMAGE
        /// runs BINARY as its entrypoint. Repeatable
        #[arg(long = "image", value_name = "IMAGE=BINARY", required = true)]
        images: Vec<String>,
        /// Play only pods in namespaces whose name starts with one of these (repeatable); must
        /// match the namespace rule of kwok's pod stages in tests/cluster/kwok/kwok.yaml
        #[arg(long = "namespace-prefix", default_values = ["e2e-", "hearth-e2e"])]
        namespace_prefixes: Vec<String>,
        /// A DNS name in the apiserver's serving certificate, for pods' `tls-server-name`
        #[arg(long, default_value = "kubernetes.default.svc")]
        tls_server_name: String,
    },
    /// Remove the network namespaces, veths, bridge and /etc/hosts block a runner recorded in
    /// STATE_DIR (what `tests/cluster/down` does after a crash)
    Cleanup {
        #[arg(long)]
        state_dir: PathBuf,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube=warn".into()),
        )
        .init();
    match Cli::parse().cmd {
        Cmd::Cleanup { state_dir } => {
            services::write_hosts(&Default::default())?;
            net::cleanup(&state_dir.join("net.record"))
        }
        Cmd::Run {
            kubeconfig,
            state_dir,
            images,
            namespace_prefixes,
            tls_server_name,
        } => {
            run(
                kubeconfig,
                state_dir,
                images,
                namespace_prefixes,
                tls_server_name,
            )
            .await
        }
    }
}

fn parse_images(images: &[String]) -> Result<HashMap<String, PathBuf>> {
    let mut map = HashMap::new();
    for i in images {
        let (img, bin) = i
            .split_once('=')
            .ok_or_else(|| anyhow!("--image {i:?}: expected IMAGE=BINARY, e.g. hearth.dev/vllm-stub:e2e=target/debug/vllm-stub"))?;
        let bin = std::fs::canonicalize(bin).with_context(|| {
            format!("--image {i:?}: binary {bin:?} not found; build it first (cargo build -p ...)")
        })?;
        map.insert(img.to_string(), bin);
    }
    Ok(map)
}

async fn run(
    kubeconfig: PathBuf,
    state_dir: PathBuf,
    images: Vec<String>,
    namespace_prefixes: Vec<String>,
    tls_server_name: String,
) -> Result<()> {
    let images = parse_images(&images)?;
    let kc = Kubeconfig::read_from(&kubeconfig)
        .with_context(|| format!("reading kubeconfig {}", kubeconfig.display()))?;
    let cluster = kc
        .clusters
        .first()
        .and_then(|c| c.cluster.clone())
        .ok_or_else(|| anyhow!("kubeconfig {} has no cluster", kubeconfig.display()))?;
    let ca_data = cluster.certificate_authority_data.clone().ok_or_else(|| {
        anyhow!("kubeconfig cluster needs certificate-authority-data (for pods' kubeconfigs)")
    })?;
    let server = cluster
        .server
        .clone()
        .ok_or_else(|| anyhow!("kubeconfig cluster has no server"))?;
    let hostport = server.trim_start_matches("https://").trim_end_matches('/');
    let apiserver: SocketAddr = hostport
        .to_socket_addrs()
        .with_context(|| format!("resolving the apiserver address {hostport}"))?
        .next()
        .ok_or_else(|| anyhow!("apiserver address {hostport} resolves to nothing"))?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    let client = Client::try_from(config)?;

    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating {}", state_dir.display()))?;
    let record_path = state_dir.join("net.record");
    if let Ok(pid) = std::fs::read_to_string(state_dir.join("runner.pid"))
        && std::fs::read_link(format!("/proc/{}/exe", pid.trim()))
            .is_ok_and(|e| e.to_string_lossy().contains("hearth-pod-runner"))
    {
        bail!(
            "a pod runner (pid {}) already serves state dir {}",
            pid.trim(),
            state_dir.display()
        );
    }
    // Leftovers of a runner that died without cleaning up.
    net::cleanup(&record_path)?;
    let record = Arc::new(net::Record::new(record_path.clone()));
    net::create_bridge(&record)?;
    let pid_path = state_dir.join("runner.pid");
    std::fs::write(&pid_path, format!("{}\n", std::process::id()))?;
    let apiserver_for_pods = SocketAddr::new(net::HOST_IP.into(), apiserver.port());
    let pass = services::passthrough(apiserver_for_pods, apiserver).await?;
    let svc_task = tokio::spawn(services::run(
        client.clone(),
        namespace_prefixes.clone(),
        record.clone(),
    ));

    let shared = Arc::new(Shared {
        client: client.clone(),
        images,
        namespace_prefixes,
        state_dir: state_dir.clone(),
        record,
        next: AtomicU32::new(1),
        ca_data,
        apiserver_for_pods,
        tls_server_name,
    });
    // The readiness marker test harnesses wait for.
    std::fs::write(state_dir.join("ready"), b"")?;
    tracing::info!(bridge = net::BRIDGE, host = %net::HOST_IP, "pod runner ready");

    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let running: Arc<Mutex<HashMap<String, Running>>> = Arc::default();
    let result = tokio::select! {
        r = watch_pods(shared.clone(), running.clone()) => r,
        _ = sigterm.recv() => Ok(()),
        _ = tokio::signal::ctrl_c() => Ok(()),
    };
    tracing::info!("stopping: killing pod processes, removing the pod network");
    // Aborting the pod tasks drops their processes, which kills them (kill_on_drop).
    for (_, r) in running.lock().unwrap_or_else(|e| e.into_inner()).drain() {
        r.task.abort();
    }
    pass.abort();
    svc_task.abort();
    let _ = std::fs::remove_file(state_dir.join("ready"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    services::write_hosts(&Default::default())?;
    net::cleanup(&record_path)?;
    let _ = std::fs::remove_file(&pid_path);
    result
}

struct Running {
    term: watch::Sender<Option<Term>>,
    task: JoinHandle<()>,
}

async fn watch_pods(
    shared: Arc<Shared>,
    running: Arc<Mutex<HashMap<String, Running>>>,
) -> Result<()> {
    let pods: Api<Pod> = Api::all(shared.client.clone());
    let mut stream = watcher(pods, watcher::Config::default()).boxed();
    loop {
        let Some(ev) = stream.next().await else {
            bail!("pod watch ended");
        };
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                tracing::warn!(error = %e, "pod watch");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mut running = running.lock().unwrap_or_else(|e| e.into_inner());
        running.retain(|_, r| !r.task.is_finished());
        match ev {
            watcher::Event::Apply(p) | watcher::Event::InitApply(p) => {
                if !pod::wanted(&p, &shared.images, &shared.namespace_prefixes) {
                    continue;
                }
                let uid = p.uid().unwrap_or_default();
                let deleting = p.metadata.deletion_timestamp.is_some();
                if let Some(r) = running.get(&uid) {
                    if deleting && r.term.borrow().is_none() {
                        let grace = p.metadata.deletion_grace_period_seconds.unwrap_or(30);
                        let _ = r.term.send(Some(Term {
                            grace: Duration::from_secs(grace.max(0) as u64),
                        }));
                    }
                    continue;
                }
                if deleting {
                    // Not ours (any more): nothing runs, so confirm the deletion.
                    let api: Api<Pod> =
                        Api::namespaced(shared.client.clone(), &p.namespace().unwrap_or_default());
                    let dp = DeleteParams {
                        grace_period_seconds: Some(0),
                        preconditions: Some(Preconditions {
                            uid: p.uid(),
                            resource_version: None,
                        }),
                        ..Default::default()
                    };
                    let name = p.name_any();
                    tokio::spawn(async move { api.delete(&name, &dp).await });
                    continue;
                }
                let phase = p.status.as_ref().and_then(|s| s.phase.clone());
                if matches!(phase.as_deref(), Some("Succeeded" | "Failed")) {
                    continue;
                }
                let (tx, rx) = watch::channel(None);
                let task = tokio::spawn(pod::run(shared.clone(), p, rx));
                running.insert(uid, Running { term: tx, task });
            }
            watcher::Event::Delete(p) => {
                if let Some(r) = running.get(&p.uid().unwrap_or_default())
                    && r.term.borrow().is_none()
                {
                    let _ = r.term.send(Some(Term {
                        grace: Duration::ZERO,
                    }));
                }
            }
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
    }
}
