//! The data plane's NetworkPolicies (`networkPolicy.models`), enforced by kube-router on the
//! real node, with real packets. The local cluster installs Hearth with them on
//! (tests/cluster/install-hearth): clients from the host and from namespaces labelled
//! `tests.hearth.dev/clients: "true"`, scrapers from the host and from namespaces labelled
//! `tests.hearth.dev/monitoring: "true"`. Every end-to-end suite therefore runs under them; this
//! one checks each profile's allowed and denied connections from pods:
//!
//! | probe pod | client port | admin port | scaler port | engine port | controller's metrics | webhook |
//! |---|---|---|---|---|---|---|
//! | listed clients' namespace | allowed | denied | denied | denied | denied | allowed |
//! | listed scrapers' namespace | denied | allowed | denied | allowed | allowed | allowed |
//! | the gateway's own replicas (its labels) | denied | allowed | denied | allowed | denied | allowed |
//! | any other pod, even in the model's namespace | denied | denied | denied | denied | denied | allowed |
//!
//! (the last two are the chart's own policies, `networkPolicy.enabled`: the controller's
//! metrics port admits `metricsFrom`, the webhook's port anyone, since the apiserver calls it
//! from outside the pod network), and KEDA's side through a cold request in push mode (KEDA →
//! the ExternalScaler port, the gateway → the engine). A probe connects with `nc` (a TCP
//! handshake, whatever the protocol); a denied connection times out or is refused.

mod stack;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::client;
use hearth_e2e_harness::stack::{ScalerMode, llm_services};
use hearth_test_support::RealNode;
use hearth_test_support::{Observed, TestNamespace, wait_until};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Api;
use kube::api::{ListParams, LogParams, Patch, PatchParams, PostParams};
use serde_json::json;

use stack::SERVICE;

const CLIENTS_LABEL: &str = "tests.hearth.dev/clients";
const MONITORING_LABEL: &str = "tests.hearth.dev/monitoring";
/// The ports the profiles name: the gateway's client, admin and ExternalScaler ports, the stub
/// runtime's engine port, the controller's metrics port and the webhook's port (the chart's
/// defaults).
const TARGETS: [(&str, Target, u16); 6] = [
    ("client", Target::Gateway, 8080),
    ("admin", Target::Gateway, 9091),
    ("scaler", Target::Gateway, 9090),
    ("engine", Target::Backend, 8000),
    ("controller", Target::Controller, 8080),
    ("webhook", Target::Webhook, 8443),
];
/// The release's namespace (tests/cluster/install-hearth).
const RELEASE_NAMESPACE: &str = "hearth-system";
/// Attempts a denied connection must have failed (each takes its 2 s timeout).
const ROUNDS: usize = 3;
/// How long the probes may take to show what the profiles decide.
const PROBE_TIMEOUT: Duration = Duration::from_secs(90);

/// A probe pod: its name, namespace and labels, and which of [`TARGETS`] it may reach.
type Probe<'a> = (
    &'a str,
    &'a TestNamespace,
    BTreeMap<String, String>,
    [bool; 6],
);

#[derive(Clone, Copy)]
enum Target {
    Gateway,
    Backend,
    Controller,
    Webhook,
}

#[tokio::test]
async fn each_profile_admits_its_peers_and_refuses_the_rest() -> Result<()> {
    // Push mode: KEDA reaches the gateway's ExternalScaler port through the gateway's policy.
    let d = stack::deploy("e2e-netpol", ScalerMode::Push, |_| {}).await?;
    let client = d.cluster.client();
    let policies = d.ns.api::<NetworkPolicy>();
    for name in [format!("{SERVICE}-gateway"), format!("{SERVICE}-backend")] {
        let p = policies
            .get_opt(&name)
            .await?
            .with_context(|| format!("the controller wrote no NetworkPolicy {name}"))?;
        ensure!(
            p.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.kind == "LLMService" && o.name == SERVICE),
            "NetworkPolicy {name} is not owned by the LLMService"
        );
    }

    // A cold request from the host, a listed client: KEDA's push through the scaler port, then
    // the gateway to the engine, both through the policies.
    let t0 = Instant::now();
    let trace = client::chat(&d.url, SERVICE, false, Duration::from_secs(150)).await?;
    ensure!(
        trace.status == 200,
        "cold request under the policies answered {} ({})",
        trace.status,
        d.timeline_text(t0)
    );
    println!(
        "cold request under the policies: 200 after {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    // The engine stays up while it is probed.
    llm_services(&client, d.ns.name())
        .patch(
            SERVICE,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"scaling": {"min": 1}}})),
        )
        .await?;

    let gateway = pod_ip(&d.ns, &format!("serving.hearth.dev/gateway={SERVICE}")).await?;
    let backend = pod_ip(&d.ns, &stack::backend_selector()).await?;
    let release = Api::<Pod>::namespaced(client.clone(), RELEASE_NAMESPACE);
    let controller = release_pod_ip(&release, "controller").await?;
    let webhook = release_pod_ip(&release, "webhook").await?;
    let node = RealNode::load()?;
    let script = probe_script(|t| match t {
        Target::Gateway => gateway.as_str(),
        Target::Backend => backend.as_str(),
        Target::Controller => controller.as_str(),
        Target::Webhook => webhook.as_str(),
    });

    let clients = labelled(&d, "e2e-netpol-clients", CLIENTS_LABEL).await?;
    let monitoring = labelled(&d, "e2e-netpol-scrapers", MONITORING_LABEL).await?;
    let replica_labels: BTreeMap<String, String> =
        d.ns.api::<Pod>()
            .list(&ListParams::default().labels(&format!("serving.hearth.dev/gateway={SERVICE}")))
            .await?
            .items
            .first()
            .and_then(|p| p.metadata.labels.clone())
            .context("no gateway pod")?
            .into_iter()
            // Its selector labels, not the ReplicaSet's pod-template-hash (which would let the
            // ReplicaSet adopt the probe).
            .filter(|(k, _)| k != "pod-template-hash")
            .collect();
    // Four probes; each row: where it runs, its labels, what it may reach.
    let probes: [Probe<'_>; 4] = [
        (
            "clients",
            &clients,
            BTreeMap::new(),
            [true, false, false, false, false, true],
        ),
        (
            "scrapers",
            &monitoring,
            BTreeMap::new(),
            [false, true, false, true, true, true],
        ),
        (
            "replica",
            &d.ns,
            replica_labels,
            [false, true, false, true, false, true],
        ),
        (
            "outsider",
            &d.ns,
            BTreeMap::new(),
            [false, false, false, false, false, true],
        ),
    ];
    for (name, ns, labels, _) in &probes {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("probe-{name}"), "labels": labels},
            "spec": node.place(json!({
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 0,
                "containers": [{
                    "name": "probe",
                    "image": node.tools_image,
                    "command": ["sh", "-c", script],
                }],
            })),
        }))?;
        ns.api::<Pod>().create(&PostParams::default(), &pod).await?;
    }

    // Each probe keeps trying. A connection the profiles allow must get through at its latest
    // attempt (a policy change reaches the node's rules a moment after the pods exist); one
    // they deny must have failed every attempt, at least ROUNDS of them.
    let started = Instant::now();
    let (table, wrong) = loop {
        let mut table = vec![format!(
            "| probe | {} |",
            TARGETS.map(|(name, _, _)| name).join(" | ")
        )];
        let mut wrong = Vec::new();
        for (name, ns, _, want) in &probes {
            let log = ns
                .api::<Pod>()
                .logs(&format!("probe-{name}"), &LogParams::default())
                .await
                .unwrap_or_default();
            let mut row = format!("| {name} |");
            for ((target, _, _), allowed) in TARGETS.iter().zip(want) {
                let attempts = outcomes(&log, target);
                let fail = attempts.iter().filter(|a| !**a).count();
                let got = if attempts.last() == Some(&true) && fail == 0 {
                    "allowed".to_owned()
                } else if attempts.last() == Some(&true) {
                    format!("allowed after {fail} failed")
                } else if fail >= ROUNDS && fail == attempts.len() {
                    "denied".to_owned()
                } else {
                    format!("{} of {} ok", attempts.len() - fail, attempts.len())
                };
                let right = if *allowed {
                    got.starts_with("allowed")
                } else {
                    got == "denied"
                };
                if !right {
                    wrong.push(format!("{name} → {target}: {got}"));
                }
                row.push_str(&format!(" {got} |"));
            }
            table.push(row);
        }
        if wrong.is_empty() || started.elapsed() > PROBE_TIMEOUT {
            break (table, wrong);
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    };
    println!(
        "{}
(decided {:.0} s after the probes were created)",
        table.join("\n"),
        started.elapsed().as_secs_f64()
    );
    ensure!(
        wrong.is_empty(),
        "connections the profiles decide otherwise after {PROBE_TIMEOUT:?}: {wrong:?}\n{}",
        table.join("\n")
    );
    Ok(())
}

/// The IP of the first running pod matching `selector` in `ns`.
async fn pod_ip(ns: &TestNamespace, selector: &str) -> Result<String> {
    let pods = ns.api::<Pod>();
    wait_until(
        format!("a running pod {selector} with an IP"),
        Duration::from_secs(120),
        || async {
            let list = pods.list(&ListParams::default().labels(selector)).await?;
            Ok(
                match list.items.iter().find_map(|p| {
                    let st = p.status.as_ref()?;
                    (st.phase.as_deref() == Some("Running")).then(|| st.pod_ip.clone())?
                }) {
                    Some(ip) => Observed::Ready(ip),
                    None => Observed::NotYet(format!("{} pods", list.items.len())),
                },
            )
        },
    )
    .await
}

/// A namespace for probes, labelled `label: "true"` (as the cluster's values list it).
async fn labelled(d: &stack::Deployed, prefix: &str, label: &str) -> Result<TestNamespace> {
    let ns = d.cluster.namespace(prefix).await?;
    Api::<Namespace>::all(d.cluster.client())
        .patch(
            ns.name(),
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {label: "true"}}})),
        )
        .await?;
    Ok(ns)
}

/// The IP of the running pod of the release's `component` (`controller`, `webhook`).
async fn release_pod_ip(release: &Api<Pod>, component: &str) -> Result<String> {
    let selector = format!("app.kubernetes.io/name=hearth,app.kubernetes.io/component={component}");
    release
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
        .iter()
        .find_map(|p| {
            let st = p.status.as_ref()?;
            (st.phase.as_deref() == Some("Running")).then(|| st.pod_ip.clone())?
        })
        .with_context(|| format!("no running {component} pod in {RELEASE_NAMESPACE}"))
}

/// Tries each target (at the IP `ip_of` gives) over and over (a TCP handshake with a 2 s
/// timeout, a second between rounds) and logs `<target> ok|fail` per attempt.
fn probe_script<'a>(ip_of: impl Fn(Target) -> &'a str) -> String {
    let mut script = "while true; do ".to_owned();
    for (name, target, port) in TARGETS {
        let ip = ip_of(target);
        script.push_str(&format!(
            "if timeout 5 nc -w 2 {ip} {port} -e true; then echo '{name} ok'; else echo '{name} fail'; fi; "
        ));
    }
    script.push_str("sleep 1; done");
    script
}

/// The outcomes of the attempts at `target` in a probe's log, in order (`true`: connected).
fn outcomes(log: &str, target: &str) -> Vec<bool> {
    let (ok, fail) = (format!("{target} ok"), format!("{target} fail"));
    log.lines()
        .filter_map(|l| {
            if l == ok {
                Some(true)
            } else if l == fail {
                Some(false)
            } else {
                None
            }
        })
        .collect()
}
