//! The cluster's real node (kubelet, containerd + runc, CNI, kube-proxy, kube-router's network
//! policy controller, CoreDNS, the fake device plugin) behaves as the Kubernetes documentation
//! says: volumes, probes, hooks, native sidecars, Service VIPs and DNS names, NetworkPolicies,
//! device plugin allocation and `runAsNonRoot`.
//!
//! Every pod here is pinned to the real node ([`RealNode::place`]) and runs the cluster's
//! busybox image, except the stub test, which runs `hearth.dev/vllm-stub:e2e` built by
//! `build/images`. Containers report from inside to an [`EventSink`] on the host end of the
//! node's link.
//!
//! Needs a running cluster with its real node: `tests/cluster/up` as root, or `tests/run-tests`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hearth_test_support::{Cluster, EventSink, Observed, RealNode, TestNamespace, wait_until};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Api;
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use serde_json::{Value, json};

/// Bounds for the node's work; generous, since tests share 2 cores.
const START_TIMEOUT: Duration = Duration::from_secs(90);
const TERMINATE_TIMEOUT: Duration = Duration::from_secs(60);

/// The stub image `build/images` builds; the node pulls it from the cluster's registry, which
/// serves `hearth.dev/*` (tests/cluster/lib/registry.sh).
const STUB_IMAGE: &str = "hearth.dev/vllm-stub:e2e";

/// The real node and a namespace of the test's own (named `<prefix>-<suffix>`).
async fn on_real_node(prefix: &str) -> Result<(RealNode, TestNamespace)> {
    let node = RealNode::load()?;
    let ns = Cluster::connect().await?.namespace(prefix).await?;
    Ok((node, ns))
}

fn pod(node: &RealNode, name: &str, spec: Value) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "labels": { "app": name } },
        "spec": node.place(spec),
    }))?)
}

/// A shell command for a busybox container: report `event` to the sink. (`timeout`, not
/// wget's own `-T`: Debian's static busybox 1.35 crashes on `wget -T`.)
fn report(sink: &EventSink, event: &str) -> String {
    format!("timeout 5 wget -q -O /dev/null {}/{event}", sink.url())
}

async fn create_pod(ns: &TestNamespace, pod: &Pod) -> Result<()> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    ns.api::<Pod>()
        .create(&PostParams::default(), pod)
        .await
        .with_context(|| format!("creating pod {name}"))?;
    Ok(())
}

fn condition(pod: &Pod, type_: &str) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == type_ && c.status == "True")
}

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// A one-line summary of a pod for timeout messages: phase and each container's state.
fn describe(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let mut out = format!("phase={}", phase(pod));
    let statuses = status
        .and_then(|s| s.init_container_statuses.clone())
        .into_iter()
        .flatten()
        .chain(
            status
                .and_then(|s| s.container_statuses.clone())
                .into_iter()
                .flatten(),
        );
    for c in statuses {
        let state = c.state.as_ref();
        let what = if let Some(w) = state.and_then(|s| s.waiting.as_ref()) {
            format!(
                "waiting {} {}",
                w.reason.as_deref().unwrap_or(""),
                w.message.as_deref().unwrap_or("")
            )
        } else if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
            format!(
                "terminated {} ({})",
                t.exit_code,
                t.reason.as_deref().unwrap_or("")
            )
        } else {
            format!("running ready={}", c.ready)
        };
        out.push_str(&format!(
            "; {}: {what} restarts={}",
            c.name, c.restart_count
        ));
    }
    out
}

/// Waits until the named pod satisfies `done`, and returns it.
async fn wait_pod(
    ns: &TestNamespace,
    name: &str,
    what: &str,
    timeout: Duration,
    done: impl Fn(&Pod) -> bool,
) -> Result<Pod> {
    let pods: Api<Pod> = ns.api();
    wait_until(format!("pod {name}: {what}"), timeout, || async {
        Ok(match pods.get_opt(name).await? {
            Some(p) if done(&p) => Observed::Ready(p),
            Some(p) => Observed::NotYet(describe(&p)),
            None => Observed::NotYet("no such pod".into()),
        })
    })
    .await
}

async fn logs(ns: &TestNamespace, pod: &str, container: Option<&str>) -> Result<String> {
    let params = LogParams {
        container: container.map(str::to_string),
        ..LogParams::default()
    };
    ns.api::<Pod>()
        .logs(pod, &params)
        .await
        .with_context(|| format!("reading the logs of pod {pod} through the apiserver and kubelet"))
}

/// Creates the pod `web` (label `app: web`): busybox httpd serving `body` at `/` on port 8080,
/// ready once the port accepts.
async fn create_web_pod(node: &RealNode, ns: &TestNamespace, body: &str) -> Result<()> {
    let server = format!(
        "mkdir -p /tmp/www && echo {body} >/tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www"
    );
    create_pod(
        ns,
        &pod(
            node,
            "web",
            json!({
                "containers": [{
                    "name": "web",
                    "image": node.tools_image,
                    "command": ["sh", "-c", server],
                    "readinessProbe": { "tcpSocket": { "port": 8080 }, "periodSeconds": 1 },
                }],
            }),
        )?,
    )
    .await
}

/// Index of `name` in `events`, for ordering assertions.
fn position(events: &[String], name: &str) -> Result<usize> {
    events
        .iter()
        .position(|e| e == name)
        .with_context(|| format!("event {name} never arrived; events: {events:?}"))
}

/// Two containers sharing an `emptyDir`, `Secret` and `ConfigMap` volumes, the three probe
/// kinds, an `exec` preStop and a native sidecar, against the documented pod lifecycle:
/// the sidecar starts before the main containers and outlives them; a failing liveness probe
/// restarts its container; the preStop hook completes before the container gets SIGTERM.
#[tokio::test]
async fn pod_lifecycle_volumes_probes_hooks_and_sidecar() -> Result<()> {
    let (node, ns) = on_real_node("node-lifecycle").await?;
    let sink = EventSink::start(&node).await?;

    let config: ConfigMap = serde_json::from_value(json!({
        "metadata": { "name": "settings" }, "data": { "greeting": "from-configmap" },
    }))?;
    ns.api::<ConfigMap>()
        .create(&PostParams::default(), &config)
        .await?;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": { "name": "token" }, "stringData": { "token": "from-secret" },
    }))?;
    ns.api::<Secret>()
        .create(&PostParams::default(), &secret)
        .await?;

    // Its startup probe passes once it has reported, so the kubelet starts the main containers
    // only after that (as it does for a native sidecar with a startup probe).
    let sidecar = format!(
        "trap '{}; exit 0' TERM; {} && touch /tmp/started; while true; do sleep 0.2; done",
        report(&sink, "sidecar-term"),
        report(&sink, "sidecar-start"),
    );
    // Serves /www for the httpGet and tcpSocket probes; checks the volumes; writes the file the
    // second container's exec probe reads.
    let main = format!(
        "trap '{term}; exit 0' TERM; {start}; \
         mkdir -p /tmp/www && echo ok >/tmp/www/index.html && httpd -p 8080 -h /tmp/www; \
         [ \"$(cat /config/greeting)\" = from-configmap ] && [ \"$(cat /secret/token)\" = from-secret ] \
           && {volumes}; \
         echo shared >/shared/from-main; \
         while true; do sleep 0.2; done",
        term = report(&sink, "main-term"),
        start = report(&sink, "main-start"),
        volumes = report(&sink, "volumes-ok"),
    );
    // Its liveness probe (exec) passes while /tmp/healthy exists; the first run removes it after
    // a few seconds, so the kubelet restarts the container; the restarted run keeps it.
    let second = format!(
        "until [ -f /shared/from-main ]; do sleep 0.2; done; {emptydir}; touch /tmp/healthy; \
         if [ ! -f /shared/restarted ]; then touch /shared/restarted; sleep 4; rm /tmp/healthy; \
         else {restarted}; fi; \
         trap 'exit 0' TERM; while true; do sleep 0.2; done",
        emptydir = report(&sink, "emptydir-ok"),
        restarted = report(&sink, "second-restarted"),
    );
    let spec = json!({
        "terminationGracePeriodSeconds": 30,
        "initContainers": [{
            "name": "sidecar",
            "image": node.tools_image,
            "restartPolicy": "Always",
            "command": ["sh", "-c", sidecar],
            "startupProbe": {
                "exec": { "command": ["cat", "/tmp/started"] },
                "periodSeconds": 1,
                "failureThreshold": 30,
            },
        }],
        "containers": [
            {
                "name": "main",
                "image": node.tools_image,
                "command": ["sh", "-c", main],
                "ports": [{ "name": "http", "containerPort": 8080 }],
                "readinessProbe": {
                    "httpGet": { "path": "/index.html", "port": "http" },
                    "periodSeconds": 1,
                },
                "livenessProbe": {
                    "tcpSocket": { "port": 8080 },
                    "initialDelaySeconds": 2,
                    "periodSeconds": 2,
                },
                "lifecycle": {
                    "preStop": { "exec": { "command": ["sh", "-c", format!("{}; sleep 1", report(&sink, "prestop"))] } },
                },
                "volumeMounts": [
                    { "name": "shared", "mountPath": "/shared" },
                    { "name": "config", "mountPath": "/config", "readOnly": true },
                    { "name": "secret", "mountPath": "/secret", "readOnly": true },
                ],
            },
            {
                "name": "second",
                "image": node.tools_image,
                "command": ["sh", "-c", second],
                "livenessProbe": {
                    "exec": { "command": ["cat", "/tmp/healthy"] },
                    "initialDelaySeconds": 2,
                    "periodSeconds": 1,
                    "failureThreshold": 2,
                },
                "volumeMounts": [{ "name": "shared", "mountPath": "/shared" }],
            },
        ],
        "volumes": [
            { "name": "shared", "emptyDir": {} },
            { "name": "config", "configMap": { "name": "settings" } },
            { "name": "secret", "secret": { "secretName": "token" } },
        ],
    });
    create_pod(&ns, &pod(&node, "lifecycle", spec)?).await?;

    let events = sink
        .wait_for(
            &[
                "sidecar-start",
                "main-start",
                "volumes-ok",
                "emptydir-ok",
                "second-restarted",
            ],
            START_TIMEOUT,
        )
        .await?;
    ensure!(
        position(&events, "sidecar-start")? < position(&events, "main-start")?,
        "the native sidecar must start before the main containers: {events:?}"
    );
    let running = wait_pod(
        &ns,
        "lifecycle",
        "Ready, second restarted once",
        START_TIMEOUT,
        |p| {
            condition(p, "Ready")
                && p.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .into_iter()
                    .flatten()
                    .any(|c| c.name == "second" && c.restart_count >= 1)
        },
    )
    .await?;
    let statuses = running
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.clone())
        .unwrap_or_default();
    let main_restarts = statuses
        .iter()
        .find(|c| c.name == "main")
        .map(|c| c.restart_count);
    ensure!(
        main_restarts == Some(0),
        "main must not restart: {}",
        describe(&running)
    );
    // The kubelet says why it restarted the container.
    let kubelet_events: Api<Event> = ns.api();
    let reasons: Vec<String> = kubelet_events
        .list(&ListParams::default().fields("involvedObject.name=lifecycle"))
        .await?
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Unhealthy"))
        .filter_map(|e| e.message)
        .collect();
    ensure!(
        reasons
            .iter()
            .any(|m| m.starts_with("Liveness probe failed")),
        "expected an Unhealthy event for the liveness probe, got {reasons:?}"
    );

    ns.api::<Pod>()
        .delete("lifecycle", &DeleteParams::default())
        .await?;
    let events = sink
        .wait_for(&["prestop", "main-term", "sidecar-term"], TERMINATE_TIMEOUT)
        .await?;
    let (prestop, main_term, sidecar_term) = (
        position(&events, "prestop")?,
        position(&events, "main-term")?,
        position(&events, "sidecar-term")?,
    );
    ensure!(
        prestop < main_term,
        "preStop must complete before SIGTERM: {events:?}"
    );
    ensure!(
        main_term < sidecar_term,
        "the sidecar must outlive the main container: {events:?}"
    );
    Ok(())
}

/// A pod reaches another through a ClusterIP Service by its DNS name (CoreDNS, kube-proxy), and
/// the host reaches the same Service VIP through its route into the node.
#[tokio::test]
async fn pods_reach_a_service_by_its_dns_name() -> Result<()> {
    let (node, ns) = on_real_node("node-dns").await?;
    let token = format!("served-by-{}", ns.name());
    create_web_pod(&node, &ns, &token).await?;
    let service: Service = serde_json::from_value(json!({
        "metadata": { "name": "web" },
        "spec": { "selector": { "app": "web" }, "ports": [{ "port": 80, "targetPort": 8080 }] },
    }))?;
    let service = ns
        .api::<Service>()
        .create(&PostParams::default(), &service)
        .await?;
    wait_pod(&ns, "web", "Ready", START_TIMEOUT, |p| {
        condition(p, "Ready")
    })
    .await?;

    let fqdn = format!("web.{}.svc.cluster.local", ns.name());
    // The short name goes through the pod's DNS search path, the full one straight to CoreDNS.
    // kube-proxy programs the Service a moment after its endpoint is ready: retry for 30 s.
    let fetch = |url: &str| {
        format!(
            "for i in $(seq 30); do timeout 5 wget -q -O- {url} && break; sleep 1; done; [ $i -lt 30 ]"
        )
    };
    let client = format!(
        "{} && {}",
        fetch("http://web/"),
        fetch(&format!("http://{fqdn}/"))
    );
    create_pod(
        &ns,
        &pod(
            &node,
            "client",
            json!({
                "restartPolicy": "Never",
                "containers": [{ "name": "client", "image": node.tools_image, "command": ["sh", "-c", client] }],
            }),
        )?,
    )
    .await?;
    let done = wait_pod(&ns, "client", "finished", START_TIMEOUT, |p| {
        matches!(phase(p), "Succeeded" | "Failed")
    })
    .await?;
    let out = logs(&ns, "client", None).await?;
    ensure!(
        phase(&done) == "Succeeded" && out.matches(&token).count() == 2,
        "the client must fetch the page twice through the Service: {}; logs: {out:?}",
        describe(&done)
    );

    // From the host: the ClusterIP is routed into the node, where kube-proxy translates it.
    let cluster_ip = service
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the Service has no ClusterIP")?;
    let body = http_get(&format!("{cluster_ip}:80")).await?;
    ensure!(
        body.contains(&token),
        "GET http://{cluster_ip}/ from the host: {body:?}"
    );
    Ok(())
}

/// NetworkPolicies are enforced on the node with real packets: with none, the host and every pod
/// reach a web pod; once a policy admits only pods labelled `role: allowed` on its port, the host
/// and a pod labelled otherwise are cut off (their connections time out or are refused) while an
/// allowed pod gets through; with the policy deleted, everyone reaches it again.
#[tokio::test]
async fn network_policies_allow_and_deny_with_real_packets() -> Result<()> {
    let (node, ns) = on_real_node("node-netpol").await?;
    create_web_pod(&node, &ns, "hello").await?;
    let web = wait_pod(&ns, "web", "Ready", START_TIMEOUT, |p| {
        condition(p, "Ready")
    })
    .await?;
    let ip = web
        .status
        .and_then(|s| s.pod_ip)
        .context("the web pod has no IP")?;
    let addr = format!("{ip}:8080");
    // No policy selects the pod: the host gets through.
    let body = http_get(&addr).await?;
    ensure!(
        body.contains("hello"),
        "GET http://{addr}/ from the host before any policy: {body:?}"
    );

    let policy: NetworkPolicy = serde_json::from_value(json!({
        "metadata": { "name": "web-from-allowed" },
        "spec": {
            "podSelector": { "matchLabels": { "app": "web" } },
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [{ "podSelector": { "matchLabels": { "role": "allowed" } } }],
                "ports": [{ "protocol": "TCP", "port": 8080 }],
            }],
        },
    }))?;
    let policies = ns.api::<NetworkPolicy>();
    policies.create(&PostParams::default(), &policy).await?;
    // Enforced once the host, which no peer of the policy matches, is cut off.
    let started = Instant::now();
    wait_until(
        format!("the policy to cut the host off from {addr}"),
        Duration::from_secs(60),
        || async {
            Ok(match http_get(&addr).await {
                Err(e) => Observed::Ready(format!("{e:#}")),
                Ok(body) => Observed::NotYet(format!("still answered: {body:?}")),
            })
        },
    )
    .await?;
    let enforced_after = started.elapsed();

    // Two clients that try once a second and log each outcome.
    let client = format!(
        "i=0; while true; do i=$((i+1)); if timeout 2 wget -q -O /dev/null http://{addr}/; \
         then echo \"attempt $i ok\"; else echo \"attempt $i fail\"; fi; sleep 1; done"
    );
    for (name, role) in [("allowed", "allowed"), ("denied", "other")] {
        let mut client_pod = pod(
            &node,
            name,
            json!({
                "containers": [{ "name": "client", "image": node.tools_image, "command": ["sh", "-c", &client] }],
            }),
        )?;
        client_pod
            .metadata
            .labels
            .get_or_insert_default()
            .insert("role".into(), role.into());
        create_pod(&ns, &client_pod).await?;
    }
    wait_reached(&ns, "allowed").await?;
    let denied = wait_until(
        "the other client to try 5 times",
        Duration::from_secs(60),
        || async {
            let log = logs(&ns, "denied", None).await.unwrap_or_default();
            let (ok, fail) = outcomes(&log);
            Ok(if ok + fail >= 5 {
                Observed::Ready(log)
            } else {
                Observed::NotYet(format!("{} attempts", ok + fail))
            })
        },
    )
    .await?;
    ensure!(
        outcomes(&denied).0 == 0,
        "a pod the policy does not admit reached {addr}: {denied}"
    );

    // Without the policy, the same pod gets through.
    policies
        .delete("web-from-allowed", &DeleteParams::default())
        .await?;
    wait_reached(&ns, "denied").await?;
    println!(
        "network policy enforced {:.1} s after it was created",
        enforced_after.as_secs_f64()
    );
    Ok(())
}

/// The (ok, failed) attempts in a NetworkPolicy client's log (`attempt <n> ok|fail` lines).
fn outcomes(log: &str) -> (usize, usize) {
    let ok = log.lines().filter(|l| l.ends_with(" ok")).count();
    let fail = log.lines().filter(|l| l.ends_with(" fail")).count();
    (ok, fail)
}

/// Waits up to 60 s for the NetworkPolicy client `pod` to log a successful attempt.
async fn wait_reached(ns: &TestNamespace, pod: &str) -> Result<()> {
    wait_until(
        format!("client {pod} to reach the web pod"),
        Duration::from_secs(60),
        || async {
            let log = logs(ns, pod, None).await.unwrap_or_default();
            Ok(match outcomes(&log) {
                (ok, _) if ok > 0 => Observed::Ready(()),
                (_, fail) => Observed::NotYet(format!("{fail} attempts failed")),
            })
        },
    )
    .await
}

/// A plain HTTP/1.0 GET of `/` from the test process; returns the whole response.
async fn http_get(addr: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(b"GET / HTTP/1.0\r\nHost: web\r\n\r\n")
            .await?;
        let mut out = String::new();
        stream.read_to_string(&mut out).await?;
        anyhow::Ok(out)
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .with_context(|| format!("GET http://{addr}/ timed out"))?
}

/// The fake device plugin's devices go through the kubelet's device manager: a pod asking for 2
/// `nvidia.com/gpu` sees 2 distinct devices, an Ascend pod sees its own, and a pod asking for more
/// GPUs than the node has stays Pending.
#[tokio::test]
async fn device_plugin_allocates_distinct_fake_devices() -> Result<()> {
    let (node, ns) = on_real_node("node-devices").await?;
    let asks = [
        ("gpus", "nvidia.com/gpu", 2, "NVIDIA_VISIBLE_DEVICES"),
        ("npus", "huawei.com/Ascend910", 2, "ASCEND_VISIBLE_DEVICES"),
    ];
    for (name, resource, count, env) in asks {
        create_pod(
            &ns,
            &pod(
                &node,
                name,
                json!({
                    "restartPolicy": "Never",
                    "containers": [{
                        "name": "main",
                        "image": node.tools_image,
                        "command": ["sh", "-c", format!("echo \"${env}\"")],
                        "resources": { "limits": { resource: count.to_string() } },
                    }],
                }),
            )?,
        )
        .await?;
    }
    for (name, resource, count, env) in asks {
        let done = wait_pod(&ns, name, "Succeeded", START_TIMEOUT, |p| {
            phase(p) == "Succeeded"
        })
        .await?;
        let out = logs(&ns, name, None).await?;
        let mut devices: Vec<&str> = out.trim().split(',').filter(|d| !d.is_empty()).collect();
        devices.sort_unstable();
        devices.dedup();
        ensure!(
            devices.len() == count,
            "{resource}: {env} must name {count} distinct devices, got {out:?} ({})",
            describe(&done)
        );
    }

    // The device manager hands a device to one container at a time: two pods of 1 GPU each,
    // running at once, get the node's two devices, one each.
    for name in ["one-a", "one-b"] {
        create_pod(
            &ns,
            &pod(
                &node,
                name,
                json!({
                    "restartPolicy": "Never",
                    "containers": [{
                        "name": "main",
                        "image": node.tools_image,
                        "command": ["sh", "-c", "echo \"$NVIDIA_VISIBLE_DEVICES\"; exec sleep 3600"],
                        "resources": { "limits": { "nvidia.com/gpu": "1" } },
                    }],
                }),
            )?,
        )
        .await?;
    }
    let mut singles = Vec::new();
    for name in ["one-a", "one-b"] {
        wait_pod(&ns, name, "Running", START_TIMEOUT, |p| {
            phase(p) == "Running"
        })
        .await?;
    }
    // Both run at once, so each holds its device while the other's is read.
    for name in ["one-a", "one-b"] {
        let devices = wait_until(
            format!("pod {name} to print its device"),
            START_TIMEOUT,
            || async {
                let out = logs(&ns, name, None).await?;
                Ok(match out.trim() {
                    "" => Observed::NotYet("no output yet".into()),
                    d => Observed::Ready(d.to_string()),
                })
            },
        )
        .await?;
        singles.push(devices);
    }
    ensure!(
        singles[0] != singles[1] && singles.iter().all(|d| !d.contains(',')),
        "two 1-GPU pods running at once must get one distinct device each, got {singles:?}"
    );
    for name in ["one-a", "one-b"] {
        ns.api::<Pod>()
            .delete(
                name,
                &DeleteParams {
                    grace_period_seconds: Some(0),
                    ..DeleteParams::default()
                },
            )
            .await?;
    }

    create_pod(
        &ns,
        &pod(
            &node,
            "too-many",
            json!({
                "containers": [{
                    "name": "main",
                    "image": node.tools_image,
                    "command": ["sleep", "3600"],
                    "resources": { "limits": { "nvidia.com/gpu": "3" } },
                }],
            }),
        )?,
    )
    .await?;
    let pending = wait_pod(&ns, "too-many", "unschedulable", START_TIMEOUT, |p| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "PodScheduled" && c.status == "False")
    })
    .await?;
    let message = pending
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled")
        .and_then(|c| c.message.clone())
        .unwrap_or_default();
    ensure!(
        phase(&pending) == "Pending" && message.contains("Insufficient nvidia.com/gpu"),
        "3 GPUs on a 2-GPU node must stay Pending for lack of GPUs: {message:?}"
    );
    Ok(())
}

/// `runAsNonRoot: true` with an image that runs as root: the kubelet refuses to start the
/// container and says why in its status.
#[tokio::test]
async fn run_as_non_root_refuses_an_image_that_runs_as_root() -> Result<()> {
    let (node, ns) = on_real_node("node-nonroot").await?;
    create_pod(
        &ns,
        &pod(
            &node,
            "root-image",
            json!({
                "securityContext": { "runAsNonRoot": true },
                "containers": [{ "name": "main", "image": node.tools_image, "command": ["sleep", "3600"] }],
            }),
        )?,
    )
    .await?;
    let refused = wait_pod(
        &ns,
        "root-image",
        "refused by the kubelet",
        START_TIMEOUT,
        |p| waiting_reason(p).is_some(),
    )
    .await?;
    let (reason, message) = waiting_reason(&refused).unwrap_or_default();
    ensure!(
        reason == "CreateContainerConfigError"
            && message.contains("runAsNonRoot and image will run as root"),
        "expected CreateContainerConfigError naming runAsNonRoot, got {reason}: {message}"
    );
    Ok(())
}

/// The main container's waiting reason and message, once it is a configuration error.
fn waiting_reason(pod: &Pod) -> Option<(String, String)> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .filter_map(|c| c.state.as_ref()?.waiting.as_ref())
        .find(|w| w.reason.as_deref() == Some("CreateContainerConfigError"))
        .map(|w| {
            (
                w.reason.clone().unwrap_or_default(),
                w.message.clone().unwrap_or_default(),
            )
        })
}

/// Twenty pods of the vLLM stub image, one after another, each from create to Ready on the real
/// node; prints p50 and max. (A measurement, not a timed assertion: each pod must get Ready.)
#[tokio::test]
async fn stub_pods_start_on_the_real_node() -> Result<()> {
    const PODS: usize = 20;
    let (node, ns) = on_real_node("node-stub").await?;
    let mut took = Vec::with_capacity(PODS);
    for i in 0..PODS {
        let name = format!("stub-{i}");
        let started = Instant::now();
        create_pod(
            &ns,
            &pod(
                &node,
                &name,
                json!({
                    "terminationGracePeriodSeconds": 1,
                    "securityContext": { "runAsNonRoot": true },
                    "containers": [{
                        "name": "stub",
                        "image": STUB_IMAGE,
                        "args": ["--model=/models/stub", "--served-model-name=stub"],
                        "ports": [{ "name": "http", "containerPort": 8000 }],
                        "readinessProbe": { "httpGet": { "path": "/health", "port": "http" }, "periodSeconds": 1 },
                        "securityContext": {
                            "readOnlyRootFilesystem": true,
                            "allowPrivilegeEscalation": false,
                            "capabilities": { "drop": ["ALL"] },
                        },
                    }],
                }),
            )?,
        )
        .await?;
        wait_pod(&ns, &name, "Ready", START_TIMEOUT, |p| {
            condition(p, "Ready")
        })
        .await?;
        took.push(started.elapsed());
        ns.api::<Pod>()
            .delete(&name, &DeleteParams::default())
            .await?;
    }
    took.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "stub pod create -> Ready on {} over {PODS} pods: p50 {:.0} ms, max {:.0} ms",
        node.name,
        ms(took[PODS / 2]),
        ms(took[PODS - 1])
    );
    Ok(())
}

/// Hearth's images as `tests/cluster/push-images` pushed them to the cluster's registry, pinned
/// to the pushed digest (a tag the node pulled earlier may name an older build), pulled by the
/// node with its own credentials for the registry (these pods name no pull Secret).
fn hearth_images() -> Result<Vec<(&'static str, String)>> {
    ["hearth-webhook", "hearth-controller", "hearth-gateway"]
        .into_iter()
        .map(|name| Ok((name, hearth_test_support::hearth_image(name)?)))
        .collect()
}

/// Hearth's images, pulled from the cluster's registry, start in
/// the most restricted pod a cluster can ask for: non-root (the image's own UID), a read-only
/// root filesystem, no capabilities. `--version` prints the version they were built with
/// (build/version).
#[tokio::test]
async fn hearth_images_run_non_root_on_a_read_only_root() -> Result<()> {
    let (node, ns) = on_real_node("node-images").await?;
    // The version build/binaries gives the images: build/version's rule, or, where it prints
    // nothing (no git checkout), the workspace version.
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../build/version");
    let out = std::process::Command::new(script)
        .output()
        .with_context(|| format!("running {script}"))?;
    ensure!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if version.is_empty() {
        version = env!("CARGO_PKG_VERSION").to_string();
    }
    let images = hearth_images()?;
    for (name, image) in &images {
        create_pod(
            &ns,
            &pod(
                &node,
                name,
                json!({
                    "restartPolicy": "Never",
                    "securityContext": { "runAsNonRoot": true, "seccompProfile": { "type": "RuntimeDefault" } },
                    "containers": [{
                        "name": "main",
                        "image": image,
                        "imagePullPolicy": "IfNotPresent",
                        "args": ["--version"],
                        "securityContext": {
                            "readOnlyRootFilesystem": true,
                            "allowPrivilegeEscalation": false,
                            "capabilities": { "drop": ["ALL"] },
                        },
                    }],
                }),
            )?,
        )
        .await?;
    }
    for (name, image) in &images {
        let done = wait_pod(&ns, name, "finished", START_TIMEOUT, |p| {
            matches!(phase(p), "Succeeded" | "Failed")
        })
        .await?;
        let out = logs(&ns, name, None).await?;
        ensure!(
            phase(&done) == "Succeeded" && out.trim() == format!("{name} {version}"),
            "{image} --version: expected {name:?} {version:?}, got {out:?} ({}); images older \
             than this checkout are rebuilt by build/images and pushed by tests/cluster/push-images \
             (tests/run-tests does both)",
            describe(&done)
        );
    }
    Ok(())
}
