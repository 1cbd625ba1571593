//! `make demo` under test: the demo's own steps (`hearth_e2e_harness::demo::run`, which the
//! `hearth-demo` binary of `tests/demo` runs and prints) on the suites' cluster, in the demo's
//! own namespaces (`hearth-demo`, `hearth-demo-push`), and what the demo promises checked in
//! both KEDA scaler modes: the cold streaming request is answered `200` after SSE heartbeats,
//! with every token of the quickstart runtime and `[DONE]`; the backend went 0 → 1 and back to
//! 0; its pod went away; the printed timeline and table have every milestone; and the printed
//! `curl` line's address is the gateway Service's ClusterIP. What the demo made here (its
//! namespaces, the quickstart runtime) is deleted at the end; what was there before (a
//! `make demo` on this cluster) is kept, and the demo reuses it as it would.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::client::Event;
use hearth_e2e_harness::demo::{self, DemoReport, ModeReport};
use hearth_e2e_harness::stack::{self as hstack, ScalerMode};
use hearth_e2e_harness::timeline::Sample;
use hearth_test_support::{Cluster, KEEP_NAMESPACES_ENV, Observed, wait_until};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::api::{DeleteParams, DynamicObject, ListParams};
use kube::{Api, Client};

/// The demo's namespaces, one per scaler mode, as `make demo` uses them.
const NAMESPACES: [(ScalerMode, &str); 2] = [
    (ScalerMode::Poll, "hearth-demo"),
    (ScalerMode::Push, "hearth-demo-push"),
];
/// The quickstart LLMService (examples/quickstart/llmservice.yaml).
const SERVICE: &str = "quickstart";
/// The quickstart InferenceRuntime (examples/quickstart/runtime.yaml), cluster-scoped.
const RUNTIME: &str = "quickstart-stub";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_wakes_the_quickstart_model_in_both_modes_and_prints_a_working_curl_line() -> Result<()>
{
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    let found = Found::before(&client).await?;
    let outcome = run_and_check(&cluster).await;
    found.clean_up(&client).await;
    outcome
}

async fn run_and_check(cluster: &Cluster) -> Result<()> {
    let client = cluster.client();
    let quickstart = demo::quickstart_dir();
    let example = hstack::first_manifest(&quickstart.join("llmservice.yaml"))?;
    ensure!(
        example["metadata"]["namespace"] == NAMESPACES[0].1
            && example["metadata"]["name"] == SERVICE,
        "examples/quickstart/llmservice.yaml is no longer {}/{SERVICE}: {}",
        NAMESPACES[0].1,
        example["metadata"]
    );
    let tokens = stub_token_count(&quickstart.join("runtime.yaml"))?;

    // What the binary prints, gathered in the same order.
    let mut printed = String::new();
    let ran = demo::run(&client, cluster.kubeconfig(), |mode| {
        printed.push_str(&mode.timeline_text());
    })
    .await;
    let report = ran.inspect_err(|_| print!("{printed}"))?;
    printed.push_str(&report.summary_text());
    print!("{printed}");

    let modes: Vec<_> = report.modes.iter().map(|m| (m.mode, m.namespace)).collect();
    ensure!(
        modes == NAMESPACES,
        "the demo ran {modes:?}, not {NAMESPACES:?}"
    );
    for m in &report.modes {
        check_mode(&client, m, tokens, &printed)
            .await
            .with_context(|| format!("[{} mode]{}", m.mode.annotation(), m.timeline_text()))?;
    }
    check_curl_line(&client, &report, &printed).await
}

/// One mode's cold request, replicas, pod, printed timeline and table row.
async fn check_mode(client: &Client, m: &ModeReport, tokens: usize, printed: &str) -> Result<()> {
    let ns = m.namespace;
    // The request went to the gateway Service's ClusterIP.
    let gateway = cluster_ip_url(client, ns).await?;
    ensure!(
        m.url == gateway,
        "the cold request went to {}, the gateway Service {ns}/{SERVICE} is {gateway}",
        m.url
    );
    // KEDA's trigger is the mode's.
    let so = hstack::scaled_objects(client, ns);
    let trigger = so.get(SERVICE).await?.data["spec"]["triggers"][0]["type"].clone();
    ensure!(
        trigger == m.mode.trigger(),
        "ScaledObject {ns}/{SERVICE} has trigger {trigger}, not {}",
        m.mode.trigger()
    );

    // Answered 200, after SSE heartbeats, with every token and [DONE].
    let trace = &m.trace;
    ensure!(trace.status == 200, "answered {}", trace.status);
    ensure!(
        trace.complete(),
        "the stream did not end with [DONE] (or had an error event): {:?}",
        trace.events
    );
    let got = trace.tokens(None);
    ensure!(
        got == tokens,
        "{got} tokens, the quickstart runtime sends {tokens}"
    );
    let heartbeats = trace
        .events
        .iter()
        .take_while(|(_, e)| *e == Event::Heartbeat)
        .count();
    ensure!(
        heartbeats >= 1,
        "no SSE heartbeat before the first token: {:?}",
        trace.events
    );
    let first_token = trace.first_token().context("no token")?;
    let last_token = trace.last_token().context("no token")?;

    // The backend went 0 → 1 → 0.
    let samples = &m.samples;
    let replicas = |s: &Sample| (s.desired, s.ready);
    let scaled = m.scaled.context("the backend never scaled 0 → 1")?;
    ensure!(
        samples
            .iter()
            .any(|s| s.at < scaled && replicas(s) == (0, 0))
            && samples
                .iter()
                .filter(|s| s.at <= m.sent())
                .all(|s| replicas(s) == (0, 0)),
        "the backend was not at 0 when the request was sent: {samples:?}"
    );
    ensure!(
        scaled < first_token,
        "the first token came before the backend scaled 0 → 1"
    );
    m.ready
        .context("the backend Deployment never had a ready replica")?;
    let max = samples.iter().map(|s| s.desired).max().unwrap_or(0);
    ensure!(max == 1, "one request at target 1 scaled to {max} replicas");
    let zero = m.zero.context("the backend never went back to 0")?;
    ensure!(zero > last_token, "back to 0 before the last token");
    ensure!(
        samples.last().map(replicas) == Some((0, 0)),
        "the backend did not stay at 0: {samples:?}"
    );
    wait_phase(client, ns, "ScaledToZero").await?;

    // Its pod was scheduled, started, Ready, and went away.
    let pod = &m.pod;
    ensure!(!pod.name.is_empty(), "no backend pod was seen");
    let scheduled = pod
        .scheduled
        .context("the backend pod was never scheduled")?;
    let started = pod.started.context("the backend pod never started")?;
    let ready = pod.ready.context("the backend pod was never Ready")?;
    ensure!(
        scheduled <= started && started <= ready,
        "the backend pod's milestones are out of order"
    );
    let gone = m.gone.context("the backend pod never went away")?;
    ensure!(
        gone >= zero,
        "the pod went before the backend went back to 0"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    ensure!(
        pods.get_opt(&pod.name).await?.is_none(),
        "backend pod {ns}/{} still exists",
        pod.name
    );
    let left = pods
        .list(&ListParams::default().labels(&hstack::backend_pods(SERVICE)))
        .await?
        .items;
    ensure!(left.is_empty(), "{} backend pods left in {ns}", left.len());

    // The timeline and the table row were printed, with every milestone.
    let timeline = m.timeline_text();
    ensure!(
        printed.contains(&timeline),
        "the timeline was not printed: {printed}"
    );
    ensure!(
        timeline.contains(&format!("backend pod {} scheduled", pod.name))
            && timeline.contains("last token; 200, [DONE]"),
        "the timeline misses the pod or the answer"
    );
    let row = m.table_row();
    ensure!(
        printed.lines().any(|l| l == row),
        "the table row was not printed: {row}"
    );
    let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
    ensure!(
        cells.len() == 9 && cells[0] == m.mode.annotation() && !cells.contains(&"-"),
        "the table row misses a milestone: {row}"
    );
    Ok(())
}

/// The printed `curl` line talks to the poll mode's gateway Service through its ClusterIP.
async fn check_curl_line(client: &Client, report: &DemoReport, printed: &str) -> Result<()> {
    let gateway = cluster_ip_url(client, NAMESPACES[0].1).await?;
    ensure!(
        report.url == gateway,
        "the curl line's address is {}, the gateway Service's ClusterIP is {gateway}",
        report.url
    );
    let curl = format!(
        "  curl -N {gateway}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{SERVICE}\","
    );
    ensure!(
        printed.contains(&curl),
        "no curl line to {gateway} was printed: {printed}"
    );
    ensure!(
        printed.contains(&format!(
            "export KUBECONFIG={} ",
            report.kubeconfig.display()
        )),
        "the printed kubectl line names another kubeconfig: {printed}"
    );
    Ok(())
}

/// `http://<ClusterIP>:<port>` of the quickstart's gateway Service in `ns`, read here (not
/// through the demo's helpers).
async fn cluster_ip_url(client: &Client, ns: &str) -> Result<String> {
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get(SERVICE)
        .await
        .with_context(|| format!("reading Service {ns}/{SERVICE}"))?;
    let spec = svc.spec.unwrap_or_default();
    ensure!(
        spec.type_.as_deref().unwrap_or("ClusterIP") == "ClusterIP",
        "Service {ns}/{SERVICE} is of type {:?}",
        spec.type_
    );
    let ip: std::net::IpAddr = spec
        .cluster_ip
        .as_deref()
        .unwrap_or_default()
        .parse()
        .with_context(|| format!("Service {ns}/{SERVICE} has no ClusterIP"))?;
    let port = spec
        .ports
        .unwrap_or_default()
        .first()
        .map(|p| p.port)
        .context("the gateway Service has no port")?;
    Ok(format!("http://{ip}:{port}"))
}

/// The quickstart runtime's `STUB_TOKEN_COUNT`: how many tokens each answer has.
fn stub_token_count(runtime: &std::path::Path) -> Result<usize> {
    let rt = hstack::first_manifest(runtime)?;
    rt["spec"]["container"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == "STUB_TOKEN_COUNT")
        .and_then(|e| e["value"].as_str())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("{} sets no STUB_TOKEN_COUNT", runtime.display()))
}

async fn wait_phase(client: &Client, ns: &str, want: &str) -> Result<()> {
    wait_until(
        format!("LLMService {ns}/{SERVICE} phase {want}"),
        Duration::from_secs(60),
        || async {
            let p = hstack::phase(client, ns, SERVICE).await?;
            Ok(if p.as_deref() == Some(want) {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("phase {p:?}"))
            })
        },
    )
    .await
}

/// Which of the demo's objects existed before the test (a namespace being deleted does not
/// count): those are kept, the others deleted at the end.
struct Found {
    namespaces: Vec<&'static str>,
    runtime: bool,
}

fn runtimes(client: &Client) -> Api<DynamicObject> {
    hstack::inference_runtimes(client)
}

impl Found {
    async fn before(client: &Client) -> Result<Found> {
        let api: Api<Namespace> = Api::all(client.clone());
        let mut namespaces = Vec::new();
        for (_, ns) in NAMESPACES {
            if api
                .get_opt(ns)
                .await?
                .is_some_and(|n| n.metadata.deletion_timestamp.is_none())
            {
                namespaces.push(ns);
            }
        }
        let runtime = runtimes(client).get_opt(RUNTIME).await?.is_some();
        if !namespaces.is_empty() || runtime {
            println!(
                "keeping what the demo finds here (a make demo on this cluster): namespaces {namespaces:?}, runtime {RUNTIME}: {runtime}"
            );
        }
        Ok(Found {
            namespaces,
            runtime,
        })
    }

    /// Deletes the namespaces the demo made (and waits until they are gone, so that the next
    /// run starts from nothing), then the runtime if it made it. Failures are warnings.
    async fn clean_up(&self, client: &Client) {
        if std::env::var(KEEP_NAMESPACES_ENV).as_deref() == Ok("1") {
            eprintln!("keeping the demo's namespaces and runtime ({KEEP_NAMESPACES_ENV}=1)");
            return;
        }
        let api: Api<Namespace> = Api::all(client.clone());
        let made: Vec<&str> = NAMESPACES
            .iter()
            .map(|(_, ns)| *ns)
            .filter(|ns| !self.namespaces.contains(ns))
            .collect();
        for ns in &made {
            match api.delete(ns, &DeleteParams::background()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => eprintln!("warning: deleting namespace {ns}: {e}"),
            }
        }
        let start = Instant::now();
        let gone = wait_until(
            format!("namespaces {made:?} gone"),
            Duration::from_secs(120),
            || async {
                let mut left = Vec::new();
                for ns in &made {
                    if api.get_opt(ns).await?.is_some() {
                        left.push(*ns);
                    }
                }
                Ok(if left.is_empty() {
                    Observed::Ready(())
                } else {
                    Observed::NotYet(format!("{left:?} still terminating"))
                })
            },
        )
        .await;
        match gone {
            Ok(()) => println!(
                "deleted the demo's namespaces {made:?} in {:.1}s",
                start.elapsed().as_secs_f64()
            ),
            Err(e) => eprintln!("warning: {e:#}"),
        }
        // Only when the demo made everything here: services found here use the runtime.
        if !self.runtime && self.namespaces.is_empty() {
            match runtimes(client)
                .delete(RUNTIME, &DeleteParams::background())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => eprintln!("warning: deleting InferenceRuntime {RUNTIME}: {e}"),
            }
        }
    }
}
