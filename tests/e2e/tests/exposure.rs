//! The exposure examples of `examples/exposure/` (docs/exposure.md): an Ingress for
//! ingress-nginx, and a Gateway API Gateway with HTTPRoutes, in front of an LLMService's and an
//! LLMEndpoint's gateway Service.
//!
//! - `exposure_examples_route_to_the_gateway_services_and_hold_a_cold_start` (no cluster): each
//!   route names the client Service the controller renders (name and port), and the proxy
//!   timeouts outlast what a held cold start needs: above the heartbeat interval and the
//!   activation timeout of the default LLMService and of every upstream example.
//! - `exposure_examples_pass_server_dry_run` (the local cluster): the Gateway API standard CRDs
//!   from the Go module of `sigs.k8s.io/gateway-api` (Go's module cache, outside this
//!   repository) are installed when absent, then `kubectl apply --dry-run=server` must accept
//!   every example object without a warning, in test namespaces standing in for the examples'
//!   own.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use hearth_crds::llmservice::{ColdStartSpec, ScalingSpec};
use hearth_crds::{InferenceRuntime, LLMEndpoint, LLMService};
use hearth_test_support::process::{run, run_stdin};
use hearth_test_support::{Cluster, TestNamespace, upstream_examples};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use serde_json::{Value, json};

/// The Gateway API release whose standard CRDs the dry-run installs when the cluster has none.
const GATEWAY_API_VERSION: &str = "v1.4.1";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn exposure_dir() -> PathBuf {
    repo().join("examples/exposure")
}

/// Every object of the exposure examples, as JSON, file by file in name order.
fn examples() -> Result<Vec<Value>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(exposure_dir())?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "yaml"));
    files.sort();
    ensure!(
        !files.is_empty(),
        "no examples in {}",
        exposure_dir().display()
    );
    let mut docs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f)?;
        docs.extend(
            hearth_e2e_harness::stack::parse_manifests(&text)
                .map_err(|e| anyhow::anyhow!("parsing {}: {e}", f.display()))?,
        );
    }
    Ok(docs)
}

fn kind(doc: &Value) -> &str {
    doc["kind"].as_str().unwrap_or("")
}

fn name(doc: &Value) -> &str {
    doc["metadata"]["name"].as_str().unwrap_or("")
}

fn namespace(doc: &Value) -> &str {
    doc["metadata"]["namespace"].as_str().unwrap_or("")
}

/// A Go/Kubernetes-style duration (`5m`, `0s`, `1h30m`).
fn duration(text: &str) -> Result<Duration> {
    hearth_crds::Duration::new(text)
        .get()
        .map_err(|e| anyhow::anyhow!("{text:?}: {e}"))
}

/// The client Service of the LLMService `name` in `namespace` (the upstream NVIDIA example,
/// renamed), as the controller renders it.
fn service_gateway(name: &str, namespace: &str) -> Result<Service> {
    let read = |file: &str| -> Result<String> {
        Ok(std::fs::read_to_string(
            hearth_test_support::upstream_file(file),
        )?)
    };
    let mut svc: LLMService = serde_yaml::from_str(&read("nvidia-a10-llmservice.yaml")?)?;
    let rt: InferenceRuntime = serde_yaml::from_str(&read("nvidia-a10-inferenceruntime.yaml")?)?;
    svc.metadata.name = Some(name.to_owned());
    svc.metadata.namespace = Some(namespace.to_owned());
    let cfg = hearth_controller::RenderConfig::builtin()?;
    let children = hearth_controller::render(&svc, &rt, &cfg, true)?;
    children
        .gateway_service
        .context("an LLMService with its own gateway renders its client Service")
}

/// The client Service of the LLMEndpoint `name` in `namespace`, as the controller renders it.
fn endpoint_gateway(name: &str, namespace: &str) -> Result<Service> {
    let ep: LLMEndpoint = serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": name, "namespace": namespace, "uid": "u"},
        "spec": {},
    }))?;
    let cfg = hearth_controller::RenderConfig::builtin()?;
    let children =
        hearth_controller::render::render_endpoint(&ep, &Default::default(), false, &cfg)?;
    Ok(children.gateway_service)
}

/// The longest activation timeout and heartbeat interval a route's proxy must hold a cold
/// request for: the defaults, and every upstream example LLMService's.
fn cold_start_bounds() -> Result<(Duration, Duration)> {
    let mut activation = duration(ScalingSpec::default().activation_timeout.as_str())?;
    let mut heartbeat = duration(ColdStartSpec::default().heartbeat_interval.as_str())?;
    for v in upstream_examples("LLMService") {
        let s: LLMService = serde_json::from_value(v)?;
        activation = activation.max(duration(s.spec.scaling.activation_timeout.as_str())?);
        heartbeat = heartbeat.max(duration(
            s.spec.endpoint.cold_start.heartbeat_interval.as_str(),
        )?);
    }
    Ok((activation, heartbeat))
}

/// The client Service a route of the examples names, by (namespace, name).
fn rendered_services() -> Result<BTreeMap<(String, String), Service>> {
    let mut out = BTreeMap::new();
    for (ns, n, svc) in [
        (
            "team-a",
            "qwen2-5-7b-a10",
            service_gateway("qwen2-5-7b-a10", "team-a")?,
        ),
        (
            "ai-platform",
            "models",
            endpoint_gateway("models", "ai-platform")?,
        ),
    ] {
        out.insert((ns.to_owned(), n.to_owned()), svc);
    }
    Ok(out)
}

/// The examples route to the Services the controller renders, and their proxies hold a cold
/// start: no cluster needed.
#[test]
fn exposure_examples_route_to_the_gateway_services_and_hold_a_cold_start() -> Result<()> {
    let docs = examples()?;
    let services = rendered_services()?;
    let (activation, heartbeat) = cold_start_bounds()?;
    let lookup =
        |ns: &str, n: &str| -> Result<&Service> {
            services.get(&(ns.to_owned(), n.to_owned())).with_context(|| {
            format!("{ns}/{n} is not the client Service of the examples' LLMService or LLMEndpoint")
        })
        };
    let ports = |s: &Service| -> Vec<(Option<String>, i32)> {
        s.spec
            .iter()
            .flat_map(|spec| spec.ports.iter().flatten())
            .map(|p| (p.name.clone(), p.port))
            .collect()
    };
    let mut routed = Vec::new();
    for doc in &docs {
        let ns = namespace(doc);
        match kind(doc) {
            "Ingress" => {
                let a = &doc["metadata"]["annotations"];
                let seconds = |key: &str| -> Result<Duration> {
                    let v = a[format!("nginx.ingress.kubernetes.io/{key}")]
                        .as_str()
                        .with_context(|| format!("Ingress {ns}/{}: no {key}", name(doc)))?;
                    Ok(Duration::from_secs(v.parse().with_context(|| {
                        format!("Ingress {ns}/{}: {key} {v:?} is not seconds", name(doc))
                    })?))
                };
                let read = seconds("proxy-read-timeout")?;
                ensure!(
                    read > activation && read > heartbeat,
                    "Ingress {ns}/{}: proxy-read-timeout {read:?} must outlast the activation timeout ({activation:?}) and the heartbeat interval ({heartbeat:?})",
                    name(doc)
                );
                ensure!(seconds("proxy-send-timeout")? >= read, "{doc}");
                ensure!(
                    a["nginx.ingress.kubernetes.io/proxy-buffering"] == "off",
                    "Ingress {ns}/{}: SSE needs proxy-buffering off",
                    name(doc)
                );
                ensure!(
                    doc["spec"]["tls"][0]["secretName"].is_string(),
                    "Ingress {ns}/{}: no TLS Secret",
                    name(doc)
                );
                for rule in doc["spec"]["rules"].as_array().into_iter().flatten() {
                    for path in rule["http"]["paths"].as_array().into_iter().flatten() {
                        let backend = &path["backend"]["service"];
                        let target = backend["name"].as_str().unwrap_or_default();
                        let svc = lookup(ns, target)?;
                        let port = &backend["port"];
                        ensure!(
                            ports(svc).iter().any(|(n, p)| {
                                port["name"].as_str() == n.as_deref()
                                    || port["number"].as_i64() == Some(i64::from(*p))
                            }),
                            "Ingress {ns}/{}: {port} is not a port of Service {target} ({:?})",
                            name(doc),
                            ports(svc)
                        );
                        routed.push(format!("Ingress {ns}/{} -> {target}", name(doc)));
                    }
                }
            }
            "HTTPRoute" => {
                for rule in doc["spec"]["rules"].as_array().into_iter().flatten() {
                    for key in ["request", "backendRequest"] {
                        let t = rule["timeouts"][key].as_str().with_context(|| {
                            format!(
                                "HTTPRoute {ns}/{}: timeouts.{key} unset (the implementation's default, 15 s with Envoy Gateway)",
                                name(doc)
                            )
                        })?;
                        let t = duration(t)?;
                        ensure!(
                            t.is_zero() || t > activation,
                            "HTTPRoute {ns}/{}: timeouts.{key} {t:?} ends a held cold start (activation timeout {activation:?})",
                            name(doc)
                        );
                    }
                    for backend in rule["backendRefs"].as_array().into_iter().flatten() {
                        let target = backend["name"].as_str().unwrap_or_default();
                        let svc = lookup(ns, target)?;
                        ensure!(
                            ports(svc)
                                .iter()
                                .any(|(_, p)| backend["port"].as_i64() == Some(i64::from(*p))),
                            "HTTPRoute {ns}/{}: port {} is not a port of Service {target} ({:?})",
                            name(doc),
                            backend["port"],
                            ports(svc)
                        );
                        routed.push(format!("HTTPRoute {ns}/{} -> {target}", name(doc)));
                    }
                }
            }
            "Gateway" => {
                for l in doc["spec"]["listeners"].as_array().into_iter().flatten() {
                    ensure!(
                        l["protocol"] == "HTTPS"
                            && l["tls"]["certificateRefs"][0]["name"].is_string(),
                        "Gateway {ns}/{}: listener {} is not HTTPS with a certificate",
                        name(doc),
                        l["name"]
                    );
                }
            }
            other => bail!("an unexpected {other} in the exposure examples"),
        }
    }
    // Both kinds of exposure, for both kinds of gateway.
    for want in [
        "Ingress team-a/qwen2-5-7b-a10 -> qwen2-5-7b-a10",
        "Ingress ai-platform/models -> models",
        "HTTPRoute team-a/qwen2-5-7b-a10 -> qwen2-5-7b-a10",
        "HTTPRoute ai-platform/models -> models",
    ] {
        ensure!(
            routed.iter().any(|r| r == want),
            "no {want:?} in {routed:?}"
        );
    }
    Ok(())
}

/// The module directory of `sigs.k8s.io/gateway-api@version` in Go's module cache, downloaded
/// through the Go module proxy when missing.
fn gateway_api_module(version: &str) -> Result<PathBuf> {
    let module = format!("sigs.k8s.io/gateway-api@{version}");
    let out = Command::new("go")
        .args(["mod", "download", "-json", &module])
        // Outside any module: `go mod download` of an explicit version needs none.
        .current_dir(std::env::temp_dir())
        .env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local")
        .output()
        .context("running `go mod download` (Go is needed to fetch the Gateway API CRDs)")?;
    let info: Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "`go mod download -json {module}` printed no JSON: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if let Some(e) = info["Error"].as_str() {
        bail!("go mod download {module}: {e}");
    }
    let dir = PathBuf::from(info["Dir"].as_str().context("no Dir in go's answer")?);
    ensure!(dir.is_dir(), "{} is not a directory", dir.display());
    Ok(dir)
}

/// Installs the Gateway API standard CRDs of [`GATEWAY_API_VERSION`] unless the cluster has
/// them (then those are kept, whatever their version), and waits until they are established.
async fn install_gateway_api(cluster: &Cluster) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(cluster.client());
    let wanted = [
        "gatewayclasses.gateway.networking.k8s.io",
        "gateways.gateway.networking.k8s.io",
        "httproutes.gateway.networking.k8s.io",
    ];
    let mut present = Vec::new();
    for n in wanted {
        if let Some(crd) = crds.get_opt(n).await? {
            let version = crd
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("gateway.networking.k8s.io/bundle-version"))
                .cloned()
                .unwrap_or_else(|| "unknown".into());
            present.push(format!("{n} ({version})"));
        }
    }
    if present.len() == wanted.len() {
        println!("Gateway API CRDs present, kept: {}", present.join(", "));
    } else {
        let dir = gateway_api_module(GATEWAY_API_VERSION)?.join("config/crd/standard");
        println!(
            "installing the Gateway API standard CRDs from {}",
            dir.display()
        );
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        files.retain(|p| {
            p.file_name().and_then(|f| f.to_str()).is_some_and(|f| {
                f.starts_with("gateway.networking.k8s.io_") && f.ends_with(".yaml")
            })
        });
        files.sort();
        ensure!(!files.is_empty(), "no CRDs in {}", dir.display());
        for f in files {
            run(
                cluster
                    .kubectl()?
                    .args([
                        "apply",
                        "--server-side",
                        "--force-conflicts",
                        "--field-manager=hearth-exposure-test",
                        "-f",
                    ])
                    .arg(&f),
                &format!("kubectl apply of {}", f.display()),
            )?;
        }
    }
    let wanted: Vec<String> = wanted.iter().map(|n| (*n).to_owned()).collect();
    hearth_test_support::wait_crds_established(&cluster.client(), &wanted).await?;
    Ok(())
}

/// The apiserver accepts every exposure example (server dry-run), with the Gateway API
/// standard CRDs installed, without a warning.
#[tokio::test]
async fn exposure_examples_pass_server_dry_run() -> Result<()> {
    let cluster = Cluster::connect().await?;
    install_gateway_api(&cluster).await?;
    let mut docs = examples()?;
    // A test namespace for each namespace the examples name.
    let mut named = std::collections::BTreeSet::new();
    for doc in &docs {
        let ns = namespace(doc);
        ensure!(
            !ns.is_empty(),
            "{} {} names no namespace",
            kind(doc),
            name(doc)
        );
        named.insert(ns.to_owned());
    }
    let mut namespaces: BTreeMap<String, TestNamespace> = BTreeMap::new();
    for ns in named {
        let test_ns = cluster.namespace(&format!("exposure-{ns}")).await?;
        namespaces.insert(ns, test_ns);
    }
    let map = |ns: &str| -> Result<String> {
        Ok(namespaces
            .get(ns)
            .with_context(|| format!("namespace {ns} is not one the examples' objects live in"))?
            .name()
            .to_owned())
    };
    for doc in &mut docs {
        let ns = map(namespace(doc))?;
        doc["metadata"]["namespace"] = json!(ns);
        // `get_mut`: indexing would add a null `parentRefs` to a Gateway.
        for parent in doc
            .get_mut("spec")
            .and_then(|s| s.get_mut("parentRefs"))
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            if let Some(p) = parent["namespace"].as_str() {
                parent["namespace"] = json!(map(p)?);
            }
        }
    }
    // As JSON: YAML written here would be read by kubectl as YAML 1.1, where an annotation
    // value such as `off` is a bool.
    let stream =
        serde_json::to_string(&json!({"apiVersion": "v1", "kind": "List", "items": docs}))?;
    let out = run_stdin(
        cluster.kubectl()?.args([
            "apply",
            "--server-side",
            "--field-manager=hearth-exposure-test",
            "--dry-run=server",
            "-o",
            "name",
            "-f",
            "-",
        ]),
        stream.as_bytes(),
        "kubectl apply --dry-run=server of examples/exposure",
    )?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !stderr.contains("Warning"),
        "the apiserver warned: {stderr}"
    );
    let accepted = String::from_utf8_lossy(&out.stdout);
    ensure!(
        accepted.lines().count() == docs.len(),
        "{} objects accepted of {}:\n{accepted}",
        accepted.lines().count(),
        docs.len()
    );
    println!("{accepted}");
    Ok(())
}
