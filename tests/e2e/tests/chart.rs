//! The Helm chart `charts/hearth`.
//!
//! - Sources stay single: the chart's CRDs and built-in policies are links to the files of
//!   `crds/` and `policies/builtin/` (Helm packages the linked content), the
//!   webhook configurations are what `hearth_webhook::registration` generates, the args use flags
//!   the binaries define, the dashboard uses metric names the crates register.
//! - `helm lint`, and `helm template` for several value sets, applied with
//!   `kubectl apply --dry-run=server` to the local control plane (the chart's CRDs applied for
//!   real first; minimal cert-manager and Prometheus Operator CRDs stand in for the real ones),
//!   in namespaces that warn on Pod Security "restricted" violations.
//! - An RBAC matrix: the chart's RBAC installed for real, then `kubectl auth can-i --as=...`
//!   for what each service account needs and what it must not do, the full rule list of each
//!   account compared with the expected one, and the writes that RBAC escalation prevention
//!   checks (the controller granting the gateway's Role) done for real.
//!
//! Needs `helm` and `kubectl` from `tests/cluster/up` (linked into its state dir), and for most
//! tests a running cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use hearth_test_support::process::{run, run_stdin};
use hearth_test_support::{Cluster, Observed, TestNamespace, state_dir, wait_until};
use hearth_webhook::registration::Registration;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::PostParams;
use serde_json::{Value, json};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn chart_dir() -> PathBuf {
    repo().join("charts/hearth")
}

/// `helm` as `tests/cluster/up` links it (Helm 4, built from the pinned module).
fn helm() -> Result<Command> {
    let bin = state_dir().join("bin").join("helm");
    ensure!(
        bin.is_file(),
        "no helm at {}: run `tests/cluster/up` (it builds helm and links it there)",
        bin.display()
    );
    Ok(Command::new(bin))
}

/// `helm template <release> charts/hearth -n <namespace> -f <values>`: the manifest text.
fn template(release: &str, namespace: &str, values: &Value) -> Result<String> {
    // Tests run in parallel: one file per call.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!(
        "hearth-chart-values-{}-{n}.json",
        std::process::id()
    ));
    std::fs::write(&file, serde_json::to_vec(values)?)?;
    let out = run(
        helm()?
            .args(["template", release])
            .arg(chart_dir())
            .args(["--namespace", namespace, "--values"])
            .arg(&file),
        &format!("helm template with {values}"),
    );
    let _ = std::fs::remove_file(&file);
    Ok(String::from_utf8(out?.stdout)?)
}

/// The documents of a multi-document YAML stream, as JSON; empty documents dropped.
fn documents(yaml: &str) -> Result<Vec<Value>> {
    let mut docs = Vec::new();
    for de in serde_yaml::Deserializer::from_str(yaml) {
        let v: Value = serde::Deserialize::deserialize(de)?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

fn kind(doc: &Value) -> &str {
    doc["kind"].as_str().unwrap_or("")
}

fn name(doc: &Value) -> &str {
    doc["metadata"]["name"].as_str().unwrap_or("")
}

fn find<'a>(docs: &'a [Value], k: &str, n: &str) -> Result<&'a Value> {
    docs.iter()
        .find(|d| kind(d) == k && name(d) == n)
        .with_context(|| format!("the chart rendered no {k} {n}"))
}

fn of_kind<'a>(docs: &'a [Value], k: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    docs.iter().filter(move |d| kind(d) == k)
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

fn yaml_files(dir: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let name = path
                .file_name()
                .context("file name")?
                .to_string_lossy()
                .into_owned();
            out.insert(name, std::fs::read(&path)?);
        }
    }
    Ok(out)
}

/// Fails unless `linked` holds, for exactly the YAML files of `source`, symbolic links to them:
/// the chart reads its CRDs and built-in policies from the one source, and Helm copies the
/// linked content into a packaged chart.
fn linked_files(source: &Path, linked: &Path, fix: &str) -> Result<()> {
    let want = yaml_files(source)?;
    let got = yaml_files(linked)?;
    let names = |m: &BTreeMap<String, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
    ensure!(
        names(&want) == names(&got),
        "{} has {:?} but {} has {:?}; {fix}",
        linked.display(),
        names(&got),
        source.display(),
        names(&want)
    );
    for file in want.keys() {
        let link = linked.join(file);
        ensure!(
            std::fs::symlink_metadata(&link)?.file_type().is_symlink(),
            "{} is a copy, not a link; {fix}",
            link.display()
        );
        ensure!(
            std::fs::canonicalize(&link)? == std::fs::canonicalize(source.join(file))?,
            "{} does not point at {}; {fix}",
            link.display(),
            source.join(file).display()
        );
    }
    Ok(())
}

#[test]
fn chart_crds_are_links_to_the_generated_crds() -> Result<()> {
    linked_files(
        &repo().join("crds"),
        &chart_dir().join("crds"),
        "link each: cd charts/hearth/crds && ln -sf ../../../crds/<file>.yaml .",
    )
}

#[test]
fn chart_builtin_policies_are_links_to_policies_builtin() -> Result<()> {
    linked_files(
        &repo().join("policies/builtin"),
        &chart_dir().join("files/builtin-policies"),
        "link each: cd charts/hearth/files/builtin-policies && ln -sf ../../../../policies/builtin/<file>.yaml .",
    )?;
    // Rendered as ServingPolicy objects whose spec is the file's, in file order.
    let docs = documents(&template("hearth", "hearth-system", &json!({}))?)?;
    let rendered: Vec<&Value> = of_kind(&docs, "ServingPolicy").collect();
    let files = yaml_files(&repo().join("policies/builtin"))?;
    ensure!(
        rendered.len() == files.len(),
        "{} ServingPolicies rendered for {} files",
        rendered.len(),
        files.len()
    );
    for (doc, (file, text)) in rendered.iter().zip(&files) {
        let source: Value = serde_yaml::from_slice(text)?;
        ensure!(
            doc["spec"] == source["spec"] && name(doc) == name(&source),
            "ServingPolicy {} does not match policies/builtin/{file}",
            name(doc)
        );
        ensure!(
            doc["metadata"]["labels"]["serving.hearth.dev/builtin"] == "true",
            "{file}: the builtin label was lost"
        );
    }
    Ok(())
}

#[test]
fn helm_lint_passes_strict() -> Result<()> {
    for set in [
        vec![],
        vec!["--set", "certificates.mode=certManager"],
        vec![
            "--set",
            "networkPolicy.enabled=true,serviceMonitor.enabled=true,dashboards.enabled=true,prometheusRule.enabled=true",
        ],
    ] {
        run(
            helm()?
                .args(["lint", "--strict"])
                .arg(chart_dir())
                .args(&set),
            &format!("helm lint --strict {set:?}"),
        )?;
    }
    Ok(())
}

/// The packaged chart (what a registry serves) carries the CRDs and policy files and renders
/// exactly like the source directory.
#[test]
fn packaged_chart_carries_crds_and_renders_the_same() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("hearth-chart-package-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = (|| -> Result<()> {
        run(
            helm()?
                .arg("package")
                .arg(chart_dir())
                .arg("--destination")
                .arg(&dir),
            "helm package",
        )?;
        let tgz = dir.join("hearth-0.1.0.tgz");
        let crds = run(helm()?.args(["show", "crds"]).arg(&tgz), "helm show crds")?;
        let shown = documents(&String::from_utf8(crds.stdout)?)?;
        let mut names: Vec<&str> = shown.iter().map(name).collect();
        names.sort_unstable();
        ensure!(
            names
                == [
                    "inferenceruntimes.serving.hearth.dev",
                    "llmadapters.serving.hearth.dev",
                    "llmendpoints.serving.hearth.dev",
                    "llmservices.serving.hearth.dev",
                    "servingpolicies.serving.hearth.dev"
                ],
            "packaged CRDs: {names:?}"
        );
        let render = |chart: &Path| -> Result<Vec<u8>> {
            Ok(run(
                helm()?.args(["template", "hearth"]).arg(chart).args([
                    "-n",
                    "hearth-system",
                    "--set",
                    "dashboards.enabled=true",
                ]),
                "helm template",
            )?
            .stdout)
        };
        ensure!(
            render(&tgz)? == render(&chart_dir())?,
            "the packaged chart renders differently from charts/hearth"
        );
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// GitOps tools render the chart again on every refresh (Argo CD with `helm template`, CRDs
/// included) and compare the result with the cluster: a value that changes from one render to
/// the next (a random string, a generated certificate, a timestamp) would leave the
/// application out of sync for ever (docs/gitops.md). Every value set, rendered twice with the
/// same values, gives the same bytes.
#[test]
fn chart_renders_byte_identical_twice() -> Result<()> {
    let namespace = "hearth-system";
    for set in value_sets() {
        let file = std::env::temp_dir().join(format!(
            "hearth-chart-twice-{}-{}.json",
            std::process::id(),
            set.name
        ));
        std::fs::write(&file, serde_json::to_vec(&(set.values)(namespace))?)?;
        let render = || -> Result<Vec<u8>> {
            Ok(run(
                helm()?
                    .args(["template", "hearth"])
                    .arg(chart_dir())
                    .args(["--namespace", namespace, "--include-crds", "--values"])
                    .arg(&file),
                &format!("helm template (value set {})", set.name),
            )?
            .stdout)
        };
        let (first, second) = (render(), render());
        let _ = std::fs::remove_file(&file);
        let (first, second) = (first?, second?);
        ensure!(
            !first.is_empty(),
            "value set {}: nothing rendered",
            set.name
        );
        if first != second {
            let (a, b) = (
                String::from_utf8_lossy(&first),
                String::from_utf8_lossy(&second),
            );
            let line = a
                .lines()
                .zip(b.lines())
                .position(|(x, y)| x != y)
                .unwrap_or_else(|| a.lines().count().min(b.lines().count()));
            bail!(
                "value set {}: two renders differ at line {}:\n  first:  {:?}\n  second: {:?}",
                set.name,
                line + 1,
                a.lines().nth(line),
                b.lines().nth(line)
            );
        }
    }
    Ok(())
}

#[test]
fn schema_rejects_bad_values_naming_the_field() -> Result<()> {
    for (set, field) in [
        ("webhook.timeoutSeconds=30", "timeoutSeconds"),
        ("certificates.mode=vault", "mode"),
        ("webhok.replicas=2", "webhok"),
        ("webhook.replicas=0", "replicas"),
        ("controller.hostPathRoot=relative", "hostPathRoot"),
        ("webhook.certValidity=90d", "certValidity"),
        (
            "controller.replicas=2,controller.leaderElection.enabled=false",
            "leaderElection",
        ),
        ("webhook.podDisruptionBudget.minAvailable=2", "minAvailable"),
        ("drain.image=a b", "drain/image"),
        ("drain.sidecar=maybe", "sidecar"),
        ("gateway.resources=null", "resources"),
        ("gateway.resources.limits.memory=512MB", "limits/memory"),
        ("gateway.resources.requests.cpu=-1", "requests/cpu"),
        ("controller.resources.limits.memory=lots", "limits/memory"),
        ("controller.resources.request.cpu=1", "request"),
        ("webhook.resources.limit.memory=1Gi", "limit"),
        ("rbac.platformAdmins[0].kind=Robot", "kind"),
        ("modelSources.env.HF_HOME=/x", "HF_HOME"),
        (
            "modelSources.env.HF_HUB_DOWNLOAD_TIMEOUT=1000000",
            "HF_HUB_DOWNLOAD_TIMEOUT",
        ),
        ("modelSources.caBundle.configMap=Corp_CA", "configMap"),
        (
            "metricsReader.subjects[0].kind=ServiceAccount,metricsReader.subjects[0].name=prom",
            "namespace",
        ),
        (
            "networkPolicy.models.clientsFrom[0].namespaceSelectr.x=y",
            "namespaceSelectr",
        ),
        ("networkPolicy.metricsFrom[0].ipBlock.except[0]=x", "cidr"),
        ("controller.scalerTLS.caValidity=10y", "caValidity"),
    ] {
        let out = helm()?
            .args(["template", "hearth"])
            .arg(chart_dir())
            .args(["--set", set])
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "--set {set} was accepted");
        ensure!(
            err.contains(field),
            "--set {set}: the error does not name {field}: {err}"
        );
    }
    Ok(())
}

/// The chart's webhook configurations are exactly `Registration::in_cluster` (apart from the
/// chart's labels and cert-manager's injection annotation).
#[test]
fn webhook_configurations_are_what_the_webhook_crate_generates() -> Result<()> {
    for (namespace, values, timeout) in [
        ("hearth-system", json!({}), 5),
        ("platform", json!({"webhook": {"timeoutSeconds": 10}}), 10),
        ("kube-system", json!({"webhook": {"timeoutSeconds": 1}}), 1),
        (
            "hearth-system",
            json!({"certificates": {"mode": "certManager"}}),
            5,
        ),
    ] {
        let docs = documents(&template("hearth", namespace, &values)?)?;
        let reg = Registration {
            timeout_seconds: timeout,
            ..Registration::in_cluster(namespace)
        };
        let m: MutatingWebhookConfiguration =
            serde_json::from_value(find(&docs, "MutatingWebhookConfiguration", "hearth")?.clone())?;
        let v: ValidatingWebhookConfiguration = serde_json::from_value(
            find(&docs, "ValidatingWebhookConfiguration", "hearth")?.clone(),
        )?;
        let want_m = reg.mutating();
        let want_v = reg.validating();
        ensure!(
            m.metadata.name == want_m.metadata.name && m.webhooks == want_m.webhooks,
            "MutatingWebhookConfiguration ({namespace}, {values}) differs from the crate's:\nchart: {}\ncrate: {}",
            serde_json::to_string_pretty(&m.webhooks)?,
            serde_json::to_string_pretty(&want_m.webhooks)?
        );
        ensure!(
            v.metadata.name == want_v.metadata.name && v.webhooks == want_v.webhooks,
            "ValidatingWebhookConfiguration ({namespace}, {values}) differs from the crate's:\nchart: {}\ncrate: {}",
            serde_json::to_string_pretty(&v.webhooks)?,
            serde_json::to_string_pretty(&want_v.webhooks)?
        );
        for (k, labels) in [
            ("mutating", &m.metadata.labels),
            ("validating", &v.metadata.labels),
        ] {
            for (key, value) in want_m.metadata.labels.iter().flatten() {
                ensure!(
                    labels.as_ref().and_then(|l| l.get(key)) == Some(value),
                    "{k} configuration lacks the crate's label {key}={value}"
                );
            }
        }
        let inject = m
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("cert-manager.io/inject-ca-from"));
        if values["certificates"]["mode"] == "certManager" {
            ensure!(
                inject == Some(&format!("{namespace}/hearth-webhook")),
                "cert-manager mode needs the CA injector annotation, got {inject:?}"
            );
        } else {
            ensure!(
                inject.is_none(),
                "self-managed mode must not ask cert-manager"
            );
        }
    }
    Ok(())
}

/// Long flags a binary's `main.rs` defines: clap derives `--foo-bar` from a field `foo_bar` and
/// takes `long = "..."` verbatim.
fn clap_flags(main_rs: &Path) -> Result<BTreeSet<String>> {
    let src = std::fs::read_to_string(main_rs)?;
    let mut flags = BTreeSet::new();
    let mut pending_long = None;
    for line in src.lines().map(str::trim) {
        if line.starts_with("#[arg(") {
            if let Some(i) = line.find("long = \"") {
                let rest = &line[i + 8..];
                pending_long = rest.split('"').next().map(str::to_owned);
            }
            continue;
        }
        if let Some((field, _)) = line.split_once(':')
            && let Some(field) = field.strip_prefix("pub ").or(Some(field))
            && !field.is_empty()
            && field.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            && line.ends_with(',')
        {
            flags.insert(
                pending_long
                    .take()
                    .unwrap_or_else(|| field.replace('_', "-")),
            );
        }
    }
    Ok(flags)
}

fn container_args(deployment: &Value) -> Vec<String> {
    strings(&deployment["spec"]["template"]["spec"]["containers"][0]["args"])
}

#[test]
fn container_args_are_flags_the_binaries_define() -> Result<()> {
    let webhook_flags = clap_flags(&repo().join("webhook/src/main.rs"))?;
    let controller_flags = clap_flags(&repo().join("controller/src/main.rs"))?;
    for values in [
        json!({}),
        json!({"certificates": {"mode": "certManager"}, "webhook": {"extraSANs": ["a.example"]},
               "controller": {"watchNamespace": "team-a", "leaderElection": {"enabled": false}}}),
    ] {
        let docs = documents(&template("hearth", "hearth-system", &values)?)?;
        for (deploy, flags) in [
            ("hearth-webhook", &webhook_flags),
            ("hearth-controller", &controller_flags),
        ] {
            let args = container_args(find(&docs, "Deployment", deploy)?);
            for arg in args.iter().filter(|a| a.starts_with("--")) {
                let flag = arg.trim_start_matches("--");
                let flag = flag.split_once('=').map_or(flag, |(f, _)| f);
                ensure!(
                    flags.contains(flag),
                    "{deploy}: --{flag} is not a flag of its binary (known: {flags:?})"
                );
            }
        }
    }
    Ok(())
}

/// `drain.*` reaches both binaries as `--drain-image`: the gateway image by default, the
/// override when set, empty (the `sleep` fallback) with `drain.sidecar=false`.
#[test]
fn drain_values_reach_the_controller_and_the_webhook() -> Result<()> {
    let gateway = "ghcr.io/hearth-rs/hearth-gateway:v";
    for (values, want) in [
        (json!({}), None),
        (
            json!({"drain": {"image": "mirror.example/hearth-gateway@sha256:0123"}}),
            Some("mirror.example/hearth-gateway@sha256:0123"),
        ),
        (json!({"drain": {"sidecar": false}}), Some("")),
    ] {
        let docs = documents(&template("hearth", "hearth-system", &values)?)?;
        for deploy in ["hearth-webhook", "hearth-controller"] {
            let args = container_args(find(&docs, "Deployment", deploy)?);
            let got = args
                .iter()
                .find_map(|a| a.strip_prefix("--drain-image="))
                .with_context(|| format!("{deploy}: no --drain-image in {args:?}"))?;
            match want {
                None => ensure!(
                    got.starts_with(gateway),
                    "{deploy} ({values}): --drain-image={got}, want the gateway image"
                ),
                Some(w) => ensure!(
                    got == w,
                    "{deploy} ({values}): --drain-image={got}, want {w:?}"
                ),
            }
        }
    }
    Ok(())
}

/// Metric names a crate's metrics module registers, with its registry prefix.
fn registered_metrics(file: &str) -> Result<BTreeSet<String>> {
    let src = std::fs::read_to_string(repo().join(file))?;
    let prefix = src
        .split_once("with_prefix(\"")
        .and_then(|(_, rest)| rest.split('"').next())
        .map(|p| format!("{p}_"))
        .unwrap_or_default();
    let mut names = BTreeSet::new();
    for chunk in src.split(".register(").skip(1) {
        if let Some(name) = chunk
            .trim_start()
            .strip_prefix('"')
            .and_then(|s| s.split('"').next())
        {
            // A name that is already whole (`hearth_...`) is registered without the prefix.
            if name.starts_with("hearth_") {
                names.insert(name.to_owned());
            } else {
                names.insert(format!("{prefix}{name}"));
            }
        }
    }
    ensure!(!names.is_empty(), "{file} registers no metrics?");
    Ok(names)
}

/// Every metric name the gateway, the controller and the webhook register.
fn all_registered_metrics() -> Result<BTreeSet<String>> {
    let mut known = BTreeSet::new();
    for f in [
        "gateway/src/metrics.rs",
        "controller/src/metrics.rs",
        "webhook/src/metrics.rs",
    ] {
        known.extend(registered_metrics(f)?);
    }
    Ok(known)
}

/// The registered metric a queried series name belongs to: prometheus-client adds `_total`
/// to counters and `_bucket`/`_sum`/`_count` to histograms.
fn registered_base<'a>(name: &'a str, known: &BTreeSet<String>) -> Option<&'a str> {
    if known.contains(name) {
        return Some(name);
    }
    ["_total", "_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s).filter(|b| known.contains(*b)))
}

#[test]
fn dashboard_queries_use_registered_metric_names() -> Result<()> {
    let known = all_registered_metrics()?;
    let dashboard: Value =
        serde_json::from_slice(&std::fs::read(chart_dir().join("dashboards/hearth.json"))?)?;
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(target["expr"].as_str().unwrap_or_default().to_owned());
        }
    }
    let mut used = BTreeSet::new();
    for expr in &exprs {
        for (i, _) in expr.match_indices("hearth_") {
            let name: String = expr[i..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            used.insert(name);
        }
    }
    ensure!(used.len() >= 20, "the dashboard queries only {used:?}");
    for name in &used {
        ensure!(
            registered_base(name, &known).is_some(),
            "the dashboard queries {name}, which no metrics module registers (known: {known:?})"
        );
    }
    // Every registered metric is on the dashboard.
    for name in &known {
        ensure!(
            used.iter().any(|u| u.starts_with(name.as_str())),
            "{name} is registered but not on the dashboard"
        );
    }
    // The ConfigMap carries the same JSON.
    let docs = documents(&template(
        "hearth",
        "hearth-system",
        &json!({"dashboards": {"enabled": true}}),
    )?)?;
    let cm = find(&docs, "ConfigMap", "hearth-dashboards")?;
    let embedded: Value =
        serde_json::from_str(cm["data"]["hearth.json"].as_str().unwrap_or_default())?;
    ensure!(embedded == dashboard, "the ConfigMap's dashboard differs");
    ensure!(cm["metadata"]["labels"]["grafana_dashboard"] == "1");
    Ok(())
}

/// The metric names an expression selects (a PromQL parse, not a text search).
fn selected_metrics(expr: &promql_parser::parser::Expr) -> Vec<String> {
    use promql_parser::parser::Expr;
    use promql_parser::util::{ExprVisitor, walk_expr};
    struct Names(Vec<String>);
    impl ExprVisitor for Names {
        type Error = std::convert::Infallible;
        fn pre_visit(&mut self, e: &Expr) -> Result<bool, Self::Error> {
            let vs = match e {
                Expr::VectorSelector(vs) => Some(vs),
                Expr::MatrixSelector(m) => Some(&m.vs),
                _ => None,
            };
            if let Some(name) = vs.and_then(|vs| vs.name.clone()) {
                self.0.push(name);
            }
            Ok(true)
        }
    }
    let mut names = Names(Vec::new());
    let _ = walk_expr(&mut names, expr);
    names.0
}

/// The GitHub anchors of a Markdown file's headings (lowercased, spaces to `-`, punctuation
/// other than `-` and `_` dropped).
fn heading_anchors(markdown: &str) -> BTreeSet<String> {
    markdown
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|h| {
            h.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

#[test]
fn prometheus_rules_parse_and_query_registered_metrics() -> Result<()> {
    let off = documents(&template("hearth", "hearth-system", &json!({}))?)?;
    ensure!(
        of_kind(&off, "PrometheusRule").next().is_none(),
        "a PrometheusRule without prometheusRule.enabled"
    );
    let docs = documents(&template(
        "hearth",
        "hearth-system",
        &json!({"prometheusRule": {"enabled": true, "labels": {"release": "prom"},
            "runbookBaseURL": "https://docs.example/operations.md/"}}),
    )?)?;
    let rule = find(&docs, "PrometheusRule", "hearth")?;
    ensure!(rule["metadata"]["labels"]["release"] == "prom");
    ensure!(rule["metadata"]["namespace"] == "hearth-system");
    let known = all_registered_metrics()?;
    let anchors = heading_anchors(&std::fs::read_to_string(repo().join("docs/operations.md"))?);
    let mut alerts = BTreeSet::new();
    for group in rule["spec"]["groups"].as_array().into_iter().flatten() {
        for r in group["rules"].as_array().into_iter().flatten() {
            let alert = r["alert"]
                .as_str()
                .context("a rule without an alert name")?;
            ensure!(alerts.insert(alert.to_owned()), "{alert} twice");
            let expr = r["expr"].as_str().unwrap_or_default();
            let parsed = promql_parser::parser::parse(expr)
                .map_err(|e| anyhow::anyhow!("{alert}: {e}: {expr}"))?;
            let metrics = selected_metrics(&parsed);
            ensure!(!metrics.is_empty(), "{alert} selects no metric: {expr}");
            for m in &metrics {
                ensure!(
                    registered_base(m, &known).is_some(),
                    "{alert} queries {m}, which no metrics module registers"
                );
            }
            if let Some(f) = r["for"].as_str() {
                ensure!(
                    promql_parser::util::duration::parse_duration(f).is_ok(),
                    "{alert}: for {f:?}"
                );
            }
            ensure!(
                ["info", "warning", "critical"]
                    .contains(&r["labels"]["severity"].as_str().unwrap_or_default()),
                "{alert}: severity {}",
                r["labels"]["severity"]
            );
            for a in ["summary", "description"] {
                ensure!(
                    r["annotations"][a].as_str().is_some_and(|s| !s.is_empty()),
                    "{alert}: no {a}"
                );
            }
            let anchor = alert.to_lowercase();
            ensure!(
                r["annotations"]["runbook_url"]
                    == format!("https://docs.example/operations.md#{anchor}").as_str(),
                "{alert}: runbook_url {}",
                r["annotations"]["runbook_url"]
            );
            ensure!(
                anchors.contains(&anchor),
                "{alert}: docs/operations.md has no heading {alert} (its runbook)"
            );
        }
    }
    ensure!(alerts.len() >= 9, "only {alerts:?}");
    Ok(())
}

/// Checks every Deployment's pod against the secure defaults.
fn assert_secure_pods(docs: &[Value]) -> Result<()> {
    let mut n = 0;
    for d in of_kind(docs, "Deployment") {
        n += 1;
        let pod = &d["spec"]["template"]["spec"];
        let who = name(d);
        ensure!(
            pod["securityContext"]["runAsNonRoot"] == true,
            "{who}: runAsNonRoot"
        );
        ensure!(
            pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault",
            "{who}: seccomp"
        );
        for c in pod["containers"].as_array().into_iter().flatten() {
            let sc = &c["securityContext"];
            ensure!(
                sc["readOnlyRootFilesystem"] == true,
                "{who}: readOnlyRootFilesystem"
            );
            ensure!(
                sc["allowPrivilegeEscalation"] == false,
                "{who}: allowPrivilegeEscalation"
            );
            ensure!(
                strings(&sc["capabilities"]["drop"]) == ["ALL"],
                "{who}: drop ALL"
            );
            ensure!(
                sc["seccompProfile"]["type"] == "RuntimeDefault",
                "{who}: container seccomp"
            );
            let req = &c["resources"]["requests"];
            ensure!(
                req["cpu"].is_string() && req["memory"].is_string(),
                "{who}: requests"
            );
        }
    }
    ensure!(
        n == 2,
        "expected the webhook and controller Deployments, saw {n}"
    );
    Ok(())
}

/// No ClusterRole lets anyone read Secrets (get, list, watch, or a wildcard), and none grants
/// anything on them but the controller's writes (create, patch, delete: the ExternalScaler
/// certificates, the gateways' admin Secrets, the token Secrets).
fn assert_no_cluster_secret_access(docs: &[Value]) -> Result<()> {
    for cr in of_kind(docs, "ClusterRole") {
        for rule in cr["rules"].as_array().into_iter().flatten() {
            let res = strings(&rule["resources"]);
            if !res.iter().any(|r| r == "secrets" || r == "*") {
                continue;
            }
            let verbs = strings(&rule["verbs"]);
            ensure!(
                name(cr).ends_with("-controller")
                    && res == ["secrets"]
                    && verbs
                        .iter()
                        .all(|v| ["create", "patch", "delete"].contains(&v.as_str())),
                "ClusterRole {} grants {verbs:?} on {res:?}",
                name(cr)
            );
        }
    }
    Ok(())
}

/// Minimal CRDs for kinds the chart can render whose operators are not on the local cluster:
/// enough for the apiserver to accept (dry-run) objects of those kinds.
fn stand_in_crd(group: &str, kind: &str, plural: &str) -> Result<CustomResourceDefinition> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": format!("{plural}.{group}"),
            "labels": {"tests.hearth.dev/stand-in": "chart"},
        },
        "spec": {
            "group": group,
            "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(),
                      "listKind": format!("{kind}List")},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": true,
                }},
            }],
        },
    }))?)
}

/// Applies the chart's CRDs for real (server-side, same content as `crds/`), and creates the
/// stand-in CRDs unless the real ones are installed; waits until all are established.
async fn install_crds(cluster: &Cluster) -> Result<()> {
    run(
        cluster
            .kubectl()?
            .args([
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=hearth-chart-test",
                "-f",
            ])
            .arg(chart_dir().join("crds")),
        "kubectl apply of the chart's CRDs",
    )?;
    let crds: Api<CustomResourceDefinition> = Api::all(cluster.client());
    let stand_ins = [
        stand_in_crd("cert-manager.io", "Certificate", "certificates")?,
        stand_in_crd("cert-manager.io", "Issuer", "issuers")?,
        stand_in_crd("monitoring.coreos.com", "ServiceMonitor", "servicemonitors")?,
        stand_in_crd("monitoring.coreos.com", "PodMonitor", "podmonitors")?,
        stand_in_crd("monitoring.coreos.com", "PrometheusRule", "prometheusrules")?,
    ];
    let mut names: Vec<String> = yaml_files(&chart_dir().join("crds"))?
        .values()
        .map(|y| Ok(name(&serde_yaml::from_slice::<Value>(y)?).to_owned()))
        .collect::<Result<_>>()?;
    for crd in &stand_ins {
        let n = crd.metadata.name.clone().unwrap_or_default();
        if crds.get_opt(&n).await?.is_none() {
            match crds.create(&PostParams::default(), crd).await {
                Ok(_) => {}
                // A parallel test made it first.
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e).context(format!("creating stand-in CRD {n}")),
            }
        }
        names.push(n);
    }
    hearth_test_support::wait_crds_established(&cluster.client(), &names).await?;
    Ok(())
}

/// A test namespace whose Pod Security admission warns on "restricted" violations, so a
/// dry-run of the chart's Deployments reports any insecure default.
async fn restricted_namespace(cluster: &Cluster, prefix: &str) -> Result<TestNamespace> {
    let ns = cluster.namespace(prefix).await?;
    run(
        cluster.kubectl()?.args([
            "label",
            "namespace",
            ns.name(),
            "pod-security.kubernetes.io/warn=restricted",
            "pod-security.kubernetes.io/enforce=restricted",
        ]),
        "labelling the namespace for Pod Security",
    )?;
    Ok(ns)
}

struct ValueSet {
    name: &'static str,
    /// The values, given the namespace the set is rendered into.
    values: fn(&str) -> Value,
    /// (kind, name) the set must render.
    renders: Vec<(&'static str, &'static str)>,
    /// Extra checks of the rendered documents.
    check: fn(&[Value], &str) -> Result<()>,
}

fn value_sets() -> Vec<ValueSet> {
    vec![
        ValueSet {
            name: "default",
            values: |_| json!({}),
            renders: vec![
                ("Deployment", "hearth-webhook"),
                ("Deployment", "hearth-controller"),
                ("PodDisruptionBudget", "hearth-webhook"),
                ("Service", "hearth-webhook"),
                ("Service", "hearth-controller-metrics"),
                ("Role", "hearth-webhook"),
                ("Role", "hearth-controller-leader-election"),
                ("MutatingWebhookConfiguration", "hearth"),
                ("ValidatingWebhookConfiguration", "hearth"),
                ("ServingPolicy", "hearth-serving-defaults"),
                ("ClusterRole", "chart-metrics-reader"),
                ("Secret", "hearth-controller-keys"),
                ("Secret", "hearth-gateway-metrics"),
                ("Secret", "hearth-gateway-keda"),
                ("ClusterTriggerAuthentication", "chart-gateway-admin"),
                ("Role", "hearth-controller-keys"),
                ("Secret", "hearth-scaler-keda"),
                ("ClusterTriggerAuthentication", "chart-scaler"),
                ("ClusterRole", "chart-view"),
                ("ClusterRole", "chart-edit"),
                ("ClusterRole", "chart-admin"),
                ("ClusterRole", "chart-runtime-viewer"),
                ("ClusterRole", "chart-platform-admin"),
            ],
            check: |docs, _| {
                // The gateways' admin tokens: Secrets made empty (the controller writes their
                // data), KEDA's in KEDA's namespace, read through the ClusterTriggerAuthentication
                // the controller names in its metrics-api triggers; the key's Secret readable by
                // name only.
                for name in [
                    "hearth-controller-keys",
                    "hearth-gateway-metrics",
                    "hearth-gateway-keda",
                    "hearth-scaler-keda",
                ] {
                    let secret = find(docs, "Secret", name)?;
                    ensure!(secret.get("data").is_none(), "{name} is rendered empty");
                }
                for keda in ["hearth-gateway-keda", "hearth-scaler-keda"] {
                    ensure!(find(docs, "Secret", keda)?["metadata"]["namespace"] == "keda");
                }
                // KEDA's client certificate for the shared gateways' ExternalScalers.
                let scaler = find(docs, "ClusterTriggerAuthentication", "chart-scaler")?;
                ensure!(
                    scaler["spec"]["secretTargetRef"]
                        == json!([
                            {"parameter": "caCert", "name": "hearth-scaler-keda", "key": "ca.crt"},
                            {"parameter": "tlsClientCert", "name": "hearth-scaler-keda", "key": "tls.crt"},
                            {"parameter": "tlsClientKey", "name": "hearth-scaler-keda", "key": "tls.key"},
                        ]),
                    "{scaler}"
                );
                let cta = find(docs, "ClusterTriggerAuthentication", "chart-gateway-admin")?;
                ensure!(
                    cta["spec"]["secretTargetRef"]
                        == json!([{"parameter": "token", "name": "hearth-gateway-keda",
                                   "key": "token"}]),
                    "{cta}"
                );
                let keys = find(docs, "Role", "hearth-controller-keys")?;
                ensure!(
                    keys["rules"]
                        == json!([{"apiGroups": [""], "resources": ["secrets"],
                                   "resourceNames": ["hearth-controller-keys"],
                                   "verbs": ["get", "update"]}]),
                    "{keys}"
                );
                let args = container_args(find(docs, "Deployment", "hearth-controller")?);
                for flag in [
                    "--gateway-admin-auth=true",
                    "--admin-keys-secret=hearth-controller-keys",
                    "--keda-token-secret=keda/hearth-gateway-keda",
                    "--metrics-token-secret=hearth-gateway-metrics",
                    "--gateway-admin-trigger-auth=chart-gateway-admin",
                    "--keda-scaler-secret=keda/hearth-scaler-keda",
                    "--shared-scaler-trigger-auth=chart-scaler",
                ] {
                    ensure!(args.contains(&flag.to_owned()), "{flag} not in {args:?}");
                }
                // Roles for users: the namespace roles aggregate into the built-in ones, the
                // platform roles into none, and nobody is bound to those by default.
                for (role, into) in [
                    // Sorted, as the labels are.
                    ("view", &["admin", "edit", "view"][..]),
                    ("edit", &["admin", "edit"][..]),
                    ("admin", &["admin"][..]),
                    ("runtime-viewer", &[][..]),
                    ("platform-admin", &[][..]),
                ] {
                    let cr = find(docs, "ClusterRole", &format!("chart-{role}"))?;
                    let labels = cr["metadata"]["labels"]
                        .as_object()
                        .cloned()
                        .unwrap_or_default();
                    let aggregated: Vec<&str> = labels
                        .iter()
                        .filter(|(_, v)| *v == "true")
                        .filter_map(|(k, _)| {
                            k.strip_prefix("rbac.authorization.k8s.io/aggregate-to-")
                        })
                        .collect();
                    ensure!(
                        aggregated == into,
                        "chart-{role} aggregates into {aggregated:?}, not {into:?}"
                    );
                    ensure!(
                        !docs.iter().any(|d| kind(d) == "ClusterRoleBinding"
                            && name(d) == format!("chart-{role}")),
                        "chart-{role} is bound by default"
                    );
                }
                ensure!(
                    !find(docs, "ClusterRole", "chart-edit")?
                        .to_string()
                        .contains("inferenceruntimes"),
                    "namespace editors get no InferenceRuntime rights"
                );
                let reader = find(docs, "ClusterRole", "chart-metrics-reader")?;
                ensure!(
                    reader["rules"] == json!([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]),
                    "the metrics reader may get /metrics and nothing else: {reader}"
                );
                ensure!(
                    !docs
                        .iter()
                        .any(|d| kind(d) == "ClusterRoleBinding"
                            && name(d) == "chart-metrics-reader"),
                    "nobody is bound to the metrics reader by default"
                );
                for component in ["webhook", "controller"] {
                    let rules = find(docs, "ClusterRole", &format!("chart-{component}"))?;
                    for (group, resource) in [
                        ("authentication.k8s.io", "tokenreviews"),
                        ("authorization.k8s.io", "subjectaccessreviews"),
                    ] {
                        ensure!(
                            rules["rules"].as_array().into_iter().flatten().any(|r| {
                                strings(&r["apiGroups"]) == [group]
                                    && strings(&r["resources"]) == [resource]
                                    && strings(&r["verbs"]) == ["create"]
                            }),
                            "{component} may create {resource}"
                        );
                    }
                }
                let probes = &find(docs, "Deployment", "hearth-controller")?["spec"]["template"]["spec"]
                    ["containers"][0];
                for probe in ["livenessProbe", "readinessProbe"] {
                    ensure!(
                        probes[probe]["httpGet"]["scheme"] == "HTTPS",
                        "the controller's {probe} speaks HTTPS: {}",
                        probes[probe]
                    );
                }
                let webhook = find(docs, "Deployment", "hearth-webhook")?;
                ensure!(webhook["spec"]["replicas"] == 2, "two webhook replicas");
                let spread = &webhook["spec"]["template"]["spec"]["topologySpreadConstraints"];
                ensure!(
                    spread.as_array().is_some_and(|a| !a.is_empty()),
                    "webhook pods spread"
                );
                ensure!(container_args(webhook).contains(&"--self-managed".to_owned()));
                let ctrl = container_args(find(docs, "Deployment", "hearth-controller")?);
                ensure!(ctrl.contains(&"--leader-elect=true".to_owned()), "{ctrl:?}");
                ensure!(
                    ctrl.contains(
                        &"--gateway-image=ghcr.io/hearth-rs/hearth-gateway:v0.1.0".into()
                    ),
                    "{ctrl:?}"
                );
                ensure!(
                    gateway_resources(&ctrl)?
                        == json!({"requests": {"cpu": "50m", "memory": "64Mi"},
                                  "limits": {"memory": "512Mi"}}),
                    "gateway containers get a memory limit by default: {ctrl:?}"
                );
                ensure!(
                    of_kind(docs, "NetworkPolicy").count() == 0
                        && of_kind(docs, "ServiceMonitor").count() == 0
                        && of_kind(docs, "PodMonitor").count() == 0
                        && of_kind(docs, "Certificate").count() == 0,
                    "optional kinds are off by default"
                );
                Ok(())
            },
        },
        ValueSet {
            name: "cert-manager",
            values: |_| json!({"certificates": {"mode": "certManager"}}),
            renders: vec![
                ("Issuer", "hearth-webhook-selfsigned"),
                ("Certificate", "hearth-webhook-ca"),
                ("Issuer", "hearth-webhook-ca"),
                ("Certificate", "hearth-webhook"),
            ],
            check: |docs, ns| {
                let cert = find(docs, "Certificate", "hearth-webhook")?;
                ensure!(
                    strings(&cert["spec"]["dnsNames"])
                        .contains(&format!("hearth-webhook.{ns}.svc")),
                    "serving certificate names the Service"
                );
                let args = container_args(find(docs, "Deployment", "hearth-webhook")?);
                ensure!(
                    args.iter().any(|a| a.starts_with("--tls-cert-file=")),
                    "{args:?}"
                );
                ensure!(!args.contains(&"--self-managed".to_owned()), "{args:?}");
                // cert-manager writes the Secret and the caBundle: no Secret Role, no write
                // access to the webhook configurations.
                ensure!(
                    !docs
                        .iter()
                        .any(|d| kind(d) == "Role" && name(d) == "hearth-webhook"),
                    "no Secret Role in cert-manager mode"
                );
                let cr = find(docs, "ClusterRole", "chart-webhook")?;
                ensure!(
                    !cr.to_string().contains("webhookconfigurations"),
                    "no webhook configuration access in cert-manager mode"
                );
                Ok(())
            },
        },
        ValueSet {
            name: "policy-reports-crd",
            values: |_| json!({"policyReports": {"installCRD": true}}),
            renders: vec![("CustomResourceDefinition", "policyreports.wgpolicyk8s.io")],
            check: |docs, _| {
                let crd = find(
                    docs,
                    "CustomResourceDefinition",
                    "policyreports.wgpolicyk8s.io",
                )?;
                ensure!(
                    crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep",
                    "the PolicyReport CRD is not kept on uninstall: {}",
                    crd["metadata"]
                );
                ensure!(crd["spec"]["versions"][0]["name"] == "v1alpha2");
                // The controller is told to scan, and may write the reports.
                let controller = find(docs, "Deployment", "hearth-controller")?;
                let args = container_args(controller);
                ensure!(
                    args.iter().any(|a| a == "--policy-scan=true"),
                    "controller args {args:?}"
                );
                Ok(())
            },
        },
        ValueSet {
            name: "policy-export",
            values: |_| {
                json!({"controller": {
                    "policyExport": {"enabled": true, "interval": "2m", "selector": "export=true"},
                    "policyScan": {"enabled": false},
                }})
            },
            renders: vec![],
            check: |docs, _| {
                let controller = find(docs, "Deployment", "hearth-controller")?;
                let args = container_args(controller);
                for want in [
                    "--policy-export=true",
                    "--policy-export-interval=2m",
                    "--policy-export-selector=export=true",
                ] {
                    ensure!(args.iter().any(|a| a == want), "no {want} in {args:?}");
                }
                // The admission policy kinds it writes, and status.export without the scan's
                // grant.
                let cr = find(docs, "ClusterRole", "chart-controller")?.to_string();
                for want in [
                    "mutatingadmissionpolicybindings",
                    "servingpolicies/status",
                    "\"delete\"",
                ] {
                    ensure!(
                        cr.contains(want),
                        "the controller's ClusterRole lacks {want}"
                    );
                }
                Ok(())
            },
        },
        ValueSet {
            name: "cert-manager-issuer",
            values: |_| {
                json!({"certificates": {"mode": "certManager",
                "certManager": {"issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}})
            },
            renders: vec![("Certificate", "hearth-webhook")],
            check: |docs, _| {
                ensure!(of_kind(docs, "Issuer").count() == 0, "no chart issuers");
                let cert = find(docs, "Certificate", "hearth-webhook")?;
                ensure!(cert["spec"]["issuerRef"]["name"] == "corp-ca");
                ensure!(cert["spec"]["issuerRef"]["kind"] == "ClusterIssuer");
                Ok(())
            },
        },
        ValueSet {
            name: "network-policies",
            values: |_| {
                json!({"networkPolicy": {"enabled": true, "metricsFrom": [
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
                ], "models": {"enabled": true, "clientsFrom": [
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}
                ]}}})
            },
            renders: vec![
                ("NetworkPolicy", "hearth-webhook"),
                ("NetworkPolicy", "hearth-controller"),
            ],
            check: |docs, ns| {
                for np in of_kind(docs, "NetworkPolicy") {
                    ensure!(strings(&np["spec"]["policyTypes"]) == ["Ingress", "Egress"]);
                }
                let ctrl = find(docs, "NetworkPolicy", "hearth-controller")?;
                ensure!(
                    ctrl["spec"]["ingress"][0]["from"][0]["namespaceSelector"].is_object(),
                    "metricsFrom is used"
                );
                // An egress rule to Hearth's pods of `component` (and `port`, when given).
                let egress_to =
                    |component: &str, port: Option<u16>| {
                        ctrl["spec"]["egress"].as_array().into_iter().flatten().any(|e| {
                        e["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                            == component
                            && port.is_none_or(|p| e["ports"][0]["port"] == p)
                    })
                    };
                // The device handover, metering and the adapters' observer ask the gateways on
                // their admin port (with or without the handover); the observer asks the
                // engines for their /v1/models.
                for (component, port) in [("gateway", Some(9091)), ("backend", None)] {
                    ensure!(
                        egress_to(component, port),
                        "no egress to the {component} pods: {}",
                        ctrl["spec"]["egress"]
                    );
                }
                // The models' policies: the controller's flag names its own pods, KEDA and
                // the peers of the values.
                let deployment = find(docs, "Deployment", "hearth-controller")?;
                let flag =
                    strings(&deployment["spec"]["template"]["spec"]["containers"][0]["args"])
                        .into_iter()
                        .find_map(|a| {
                            a.strip_prefix("--model-network-policies=")
                                .map(str::to_owned)
                        })
                        .context("no --model-network-policies flag")?;
                let flag: Value = serde_json::from_str(&flag)?;
                ensure!(flag["controllerNamespace"] == ns, "{flag}");
                ensure!(flag["kedaNamespace"] == "keda", "{flag}");
                ensure!(
                    flag["controllerPodLabels"] == deployment["spec"]["selector"]["matchLabels"],
                    "{flag}"
                );
                ensure!(
                    flag["clientsFrom"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                        == "ingress",
                    "{flag}"
                );
                ensure!(
                    flag["metricsFrom"] == ctrl["spec"]["ingress"][0]["from"],
                    "{flag}"
                );
                Ok(())
            },
        },
        ValueSet {
            name: "service-monitor",
            values: |_| {
                json!({"serviceMonitor": {"enabled": true, "labels": {"release": "prom"}},
                           "prometheusRule": {"enabled": true, "labels": {"release": "prom"}},
                           "dashboards": {"enabled": true},
                           "metricsReader": {"subjects": [{"kind": "ServiceAccount",
                               "name": "prometheus", "namespace": "monitoring"}]}})
            },
            renders: vec![
                ("ServiceMonitor", "hearth-webhook"),
                ("ServiceMonitor", "hearth-controller"),
                ("PodMonitor", "hearth-gateways"),
                ("PodMonitor", "hearth-backends"),
                ("ConfigMap", "hearth-dashboards"),
                ("PrometheusRule", "hearth"),
                ("ClusterRoleBinding", "chart-metrics-reader"),
            ],
            check: |docs, ns| {
                let sm = find(docs, "ServiceMonitor", "hearth-webhook")?;
                ensure!(sm["metadata"]["labels"]["release"] == "prom");
                ensure!(
                    sm["spec"]["endpoints"][0]["tlsConfig"]["serverName"]
                        == format!("hearth-webhook.{ns}.svc").as_str()
                );
                // The controller's certificate is verified against the CA it publishes.
                let tls = &find(docs, "ServiceMonitor", "hearth-controller")?["spec"]["endpoints"]
                    [0]["tlsConfig"];
                ensure!(
                    tls["serverName"] == format!("hearth-controller-metrics.{ns}.svc").as_str()
                        && tls["ca"]["configMap"]["name"] == "hearth-controller-metrics-ca"
                        && tls["ca"]["configMap"]["key"] == "ca.crt"
                        && tls.get("insecureSkipVerify").is_none(),
                    "the controller's ServiceMonitor TLS: {tls}"
                );
                find(docs, "ConfigMap", "hearth-controller-metrics-ca")?;
                const TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
                for name in ["hearth-webhook", "hearth-controller"] {
                    let ep = &find(docs, "ServiceMonitor", name)?["spec"]["endpoints"][0];
                    ensure!(ep["scheme"] == "https", "{name}: {ep}");
                    ensure!(ep["bearerTokenFile"] == TOKEN, "{name}: {ep}");
                }
                // The gateways and backends in every namespace, selected by labels that do not
                // name the controller (app.kubernetes.io/managed-by changes value).
                for (name, component, port) in [
                    ("hearth-gateways", "gateway", "admin"),
                    ("hearth-backends", "backend", "http"),
                ] {
                    let pm = &find(docs, "PodMonitor", name)?["spec"];
                    // Every series says its LLMService: a backend's label, and a service's own
                    // gateway's gateway label (an endpoint's gateway says its endpoint).
                    let targets: Vec<&str> = pm["podMetricsEndpoints"][0]["relabelings"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|r| r["targetLabel"].as_str())
                        .collect();
                    let want: &[&str] = if component == "gateway" {
                        &["llmservice", "llmendpoint", "llmservice"]
                    } else {
                        &["llmservice", "llmendpoint"]
                    };
                    ensure!(targets == want, "{name}: relabelings {targets:?}");
                    ensure!(
                        pm["namespaceSelector"] == json!({"any": true}),
                        "{name}: {pm}"
                    );
                    ensure!(
                        pm["selector"]["matchLabels"]
                            == json!({"app.kubernetes.io/part-of": "hearth",
                                      "app.kubernetes.io/component": component}),
                        "{name}: {pm}"
                    );
                    ensure!(pm["podMetricsEndpoints"][0]["port"] == port, "{name}: {pm}");
                    // The gateway's admin port wants the scrapers' token.
                    let auth = &pm["podMetricsEndpoints"][0]["authorization"];
                    ensure!(
                        (component == "gateway")
                            == (*auth
                                == json!({"type": "Bearer", "credentials":
                                    {"name": "hearth-gateway-metrics", "key": "token"}})),
                        "{name}: {pm}"
                    );
                    ensure!(
                        pm["podMetricsEndpoints"][0]["path"] == "/metrics",
                        "{name}: {pm}"
                    );
                }
                let binding = find(docs, "ClusterRoleBinding", "chart-metrics-reader")?;
                ensure!(binding["roleRef"]["name"] == "chart-metrics-reader");
                ensure!(binding["subjects"][0]["name"] == "prometheus");
                Ok(())
            },
        },
        ValueSet {
            name: "user-roles",
            // No aggregation into the built-in roles; the platform roles bound to their teams.
            values: |_| {
                json!({"rbac": {
                    "aggregate": false,
                    "runtimeViewers": [{"kind": "Group", "name": "system:authenticated",
                                        "apiGroup": "rbac.authorization.k8s.io"}],
                    "platformAdmins": [{"kind": "Group", "name": "platform-team",
                                        "apiGroup": "rbac.authorization.k8s.io"}],
                }})
            },
            renders: vec![
                ("ClusterRole", "chart-runtime-viewer"),
                ("ClusterRoleBinding", "chart-runtime-viewer"),
                ("ClusterRole", "chart-platform-admin"),
                ("ClusterRoleBinding", "chart-platform-admin"),
            ],
            check: |docs, _| {
                for role in ["view", "edit", "admin"] {
                    ensure!(
                        !docs.iter().any(|d| kind(d) == "ClusterRole"
                            && name(d) == format!("chart-{role}")),
                        "chart-{role} rendered with rbac.aggregate false"
                    );
                }
                let admins = find(docs, "ClusterRoleBinding", "chart-platform-admin")?;
                ensure!(
                    admins["roleRef"]["name"] == "chart-platform-admin"
                        && admins["subjects"][0]["name"] == "platform-team",
                    "{admins}"
                );
                Ok(())
            },
        },
        ValueSet {
            name: "custom-images",
            // The controller watches the release namespace only (so its Role can be made there).
            values: |ns| {
                json!({
                    "image": {"registry": "registry.example.internal/platform", "tag": "v9.9.9",
                              "pullSecrets": ["regcred"], "pullPolicy": "Always"},
                    "controller": {"image": {"repository": "hearth-controller",
                        "override": "mirror.example.internal/hearth/controller@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"},
                        "replicas": 2, "watchNamespace": ns},
                    "webhook": {"replicas": 3, "timeoutSeconds": 8},
                    "gateway": {"resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                                              "limits": {"cpu": "2", "memory": "1Gi"}}},
                    "commonLabels": {"team": "platform"},
                })
            },
            renders: vec![
                ("Deployment", "hearth-webhook"),
                ("Role", "hearth-controller"),
                // KEDA's Secrets, by name, in KEDA's namespace.
                ("Role", "hearth-controller-keda"),
            ],
            check: |docs, ns| {
                let image = |d: &str| -> Result<String> {
                    Ok(find(docs, "Deployment", d)?["spec"]["template"]["spec"]["containers"][0]
                        ["image"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned())
                };
                ensure!(
                    image("hearth-webhook")?
                        == "registry.example.internal/platform/hearth-webhook:v9.9.9"
                );
                ensure!(image("hearth-controller")?.starts_with("mirror.example.internal/"));
                let ctrl = container_args(find(docs, "Deployment", "hearth-controller")?);
                ensure!(
                    ctrl.contains(
                        &"--gateway-image=registry.example.internal/platform/hearth-gateway:v9.9.9"
                            .into()
                    )
                );
                ensure!(ctrl.contains(&format!("--namespace={ns}")), "{ctrl:?}");
                ensure!(
                    gateway_resources(&ctrl)?
                        == json!({"requests": {"cpu": "100m", "memory": "128Mi"},
                                  "limits": {"cpu": "2", "memory": "1Gi"}}),
                    "{ctrl:?}"
                );
                let cr = find(docs, "ClusterRole", "chart-controller")?;
                ensure!(
                    !cr.to_string().contains("deployments"),
                    "with watchNamespace the ClusterRole holds no namespaced rights: {cr}"
                );
                let w = find(docs, "Deployment", "hearth-webhook")?;
                ensure!(w["spec"]["replicas"] == 3);
                ensure!(w["spec"]["template"]["spec"]["imagePullSecrets"][0]["name"] == "regcred");
                ensure!(w["metadata"]["labels"]["team"] == "platform");
                Ok(())
            },
        },
    ]
}

/// The JSON of the controller's `--gateway-resources` argument.
fn gateway_resources(args: &[String]) -> Result<Value> {
    let arg = args
        .iter()
        .find_map(|a| a.strip_prefix("--gateway-resources="))
        .context("no --gateway-resources argument")?;
    serde_json::from_str(arg).with_context(|| format!("--gateway-resources={arg}"))
}

/// Every value set renders what it should and is accepted by the apiserver (server dry-run)
/// in a namespace enforcing Pod Security "restricted", without warnings.
#[tokio::test]
async fn value_sets_render_and_pass_server_dry_run() -> Result<()> {
    let cluster = Cluster::connect().await?;
    install_crds(&cluster).await?;
    let mut table = Vec::new();
    for set in value_sets() {
        let ns = restricted_namespace(&cluster, &format!("chart-{}", set.name)).await?;
        let manifest = template("chart", ns.name(), &(set.values)(ns.name()))?;
        let docs = documents(&manifest)?;
        for (k, n) in &set.renders {
            find(&docs, k, n).with_context(|| format!("value set {}", set.name))?;
        }
        assert_secure_pods(&docs).with_context(|| format!("value set {}", set.name))?;
        assert_no_cluster_secret_access(&docs)?;
        (set.check)(&docs, ns.name()).with_context(|| format!("value set {}", set.name))?;
        let out = run_stdin(
            cluster
                .kubectl()?
                // Server-side apply: the cluster-wide objects may exist already (the release
                // the end-to-end suites install), which a client-side apply would warn about.
                .args([
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    "--field-manager=chart-dry-run",
                    "--dry-run=server",
                    "-o",
                    "name",
                    "-f",
                    "-",
                ]),
            manifest.as_bytes(),
            &format!("kubectl apply --dry-run=server (value set {})", set.name),
        )?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !stderr.contains("Warning"),
            "value set {}: the apiserver warned: {stderr}",
            set.name
        );
        let applied = String::from_utf8_lossy(&out.stdout).lines().count();
        ensure!(
            applied == docs.len(),
            "value set {}: {applied} objects accepted of {} rendered",
            set.name,
            docs.len()
        );
        table.push(format!("{:<22} {:>3} objects accepted", set.name, applied));
    }
    // Helm's own install path against the cluster (release storage, hooks, CRD handling). The
    // webhook configurations have one name per cluster, so where the end-to-end suites'
    // release is installed, its upgrade path is the one to check.
    let installed = helm()?
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .args(["status", "hearth", "--namespace", "hearth-system"])
        .output()
        .context("running helm status")?
        .status
        .success();
    let ns = restricted_namespace(&cluster, "chart-install").await?;
    let (verb, namespace) = if installed {
        ("upgrade", "hearth-system")
    } else {
        ("install", ns.name())
    };
    run(
        helm()?
            .arg("--kubeconfig")
            .arg(cluster.kubeconfig())
            .args([verb, "hearth"])
            .arg(chart_dir())
            .args(["--namespace", namespace, "--dry-run=server"]),
        &format!("helm {verb} --dry-run=server"),
    )?;
    table.push(format!("{:<22} helm {verb} --dry-run=server ok", "default"));
    eprintln!("server dry-run:\n{}", table.join("\n"));
    Ok(())
}

/// Rendered RBAC objects of a release, installed for real; cluster-scoped ones are deleted on
/// drop (the namespace takes the rest).
struct InstalledRbac {
    kubectl: PathBuf,
    kubeconfig: PathBuf,
    cluster_scoped: Vec<String>,
}

impl InstalledRbac {
    fn install(cluster: &Cluster, release: &str, namespace: &str, values: &Value) -> Result<Self> {
        let docs = documents(&template(release, namespace, values)?)?;
        let rbac: Vec<&Value> = docs
            .iter()
            .filter(|d| {
                matches!(
                    kind(d),
                    "ServiceAccount"
                        | "Role"
                        | "RoleBinding"
                        | "ClusterRole"
                        | "ClusterRoleBinding"
                )
            })
            .collect();
        let cluster_scoped = rbac
            .iter()
            .filter(|d| kind(d).starts_with("Cluster"))
            .map(|d| format!("{}/{}", kind(d).to_lowercase(), name(d)))
            .collect();
        let kubectl = cluster
            .kubeconfig()
            .parent()
            .context("state dir")?
            .join("bin/kubectl");
        let this = Self {
            kubectl,
            kubeconfig: cluster.kubeconfig().to_owned(),
            cluster_scoped,
        };
        let list = json!({"apiVersion": "v1", "kind": "List", "items": rbac});
        run_stdin(
            cluster.kubectl()?.args(["apply", "-f", "-"]),
            list.to_string().as_bytes(),
            "installing the chart's RBAC",
        )?;
        Ok(this)
    }
}

impl Drop for InstalledRbac {
    fn drop(&mut self) {
        let _ = Command::new(&self.kubectl)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["delete", "--ignore-not-found", "--wait=false"])
            .args(&self.cluster_scoped)
            .output();
    }
}

/// The rules of the gateway Role the controller renders, read from `fn member_rules` in
/// controller/src/render/gateway.rs (a service's own gateway's Role, the member Role an attached
/// service or a joined Deployment grants an endpoint's gateway): its string literals must be
/// exactly those of its rules (EndpointSlices read, its LLMService followed; with the sleeping
/// tier Events and its LLMService's status), so a change there fails here (and the controller's ClusterRole must
/// then hold the new rights).
fn gateway_role_rules() -> Result<Value> {
    let src = std::fs::read_to_string(repo().join("controller/src/render/gateway.rs"))?;
    let body = src
        .split_once("fn member_rules(")
        .and_then(|(_, rest)| rest.split_once("\n}\n"))
        .map(|(body, _)| body)
        .context("controller/src/render/gateway.rs has no fn member_rules")?;
    let literals: BTreeSet<&str> = body.split('"').skip(1).step_by(2).collect();
    let want = BTreeSet::from([
        "discovery.k8s.io",
        "endpointslices",
        "get",
        "list",
        "watch",
        // With the sleeping tier: the gateway's Events on its LLMService, and its
        // status.lastWake (the group is the LLMService's, not a literal).
        "events.k8s.io",
        "events",
        "create",
        "patch",
        "llmservices/status",
        // Its LLMService, followed for activation failures.
        "llmservices",
    ]);
    ensure!(
        literals == want,
        "the controller's gateway Role changed (its literals: {literals:?}); update the \
         controller ClusterRole in charts/hearth/templates/controller-rbac.yaml so it holds what \
         it grants, then this check"
    );
    // The largest Role it renders (a service with the sleeping tier).
    Ok(json!([
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["serving.hearth.dev"], "resources": ["llmservices"],
         "resourceNames": ["stub-svc"], "verbs": ["list", "watch"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": ["serving.hearth.dev"], "resources": ["llmservices/status"],
         "resourceNames": ["stub-svc"], "verbs": ["patch"]},
    ]))
}

/// One `kubectl auth can-i` question.
struct Check {
    account: &'static str,
    verb: &'static str,
    /// `resource.group[/name]`.
    resource: String,
    subresource: Option<&'static str>,
    /// `None`: all namespaces (or a cluster-scoped resource).
    namespace: Option<String>,
    allowed: bool,
}

fn can_i(cluster: &Cluster, sa_namespace: &str, c: &Check) -> Result<bool> {
    let mut cmd = cluster.kubectl()?;
    cmd.args(["auth", "can-i", c.verb, &c.resource])
        .arg(format!(
            "--as=system:serviceaccount:{sa_namespace}:{}",
            c.account
        ));
    match &c.namespace {
        Some(ns) => cmd.args(["-n", ns]),
        None => cmd.arg("--all-namespaces"),
    };
    if let Some(sub) = c.subresource {
        cmd.arg(format!("--subresource={sub}"));
    }
    let out = cmd.output()?;
    match out.status.code() {
        Some(0) => Ok(true),
        Some(1) => Ok(false),
        _ => bail!(
            "kubectl auth can-i {} {}: {}",
            c.verb,
            c.resource,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

fn matrix(release_ns: &str) -> Vec<Check> {
    let team = || Some("team-a".to_owned());
    let own = || Some(release_ns.to_owned());
    let mut checks = Vec::new();
    let mut add = |account,
                   verbs: &[&'static str],
                   resource: &str,
                   sub,
                   namespace: Option<String>,
                   allowed| {
        for verb in verbs {
            checks.push(Check {
                account,
                verb,
                resource: resource.to_owned(),
                subresource: sub,
                namespace: namespace.clone(),
                allowed,
            });
        }
    };
    let c = "hearth-controller";
    // What the controller needs.
    add(
        c,
        &["list", "watch"],
        "llmservices.serving.hearth.dev",
        None,
        None,
        true,
    );
    add(
        c,
        &["patch"],
        "llmservices.serving.hearth.dev",
        Some("status"),
        team(),
        true,
    );
    add(
        c,
        &["list", "watch"],
        "inferenceruntimes.serving.hearth.dev",
        None,
        None,
        true,
    );
    add(
        c,
        &["get", "list", "watch"],
        "servingpolicies.serving.hearth.dev",
        None,
        None,
        true,
    );
    // Shared endpoints: the endpoints, their status, the namespaces' labels, the routing
    // tables; an attached service's own gateway is deleted.
    add(
        c,
        &["list", "watch"],
        "llmendpoints.serving.hearth.dev",
        None,
        None,
        true,
    );
    add(
        c,
        &["patch"],
        "llmendpoints.serving.hearth.dev",
        Some("status"),
        team(),
        true,
    );
    // Adapters: read, and their status written.
    add(
        c,
        &["list", "watch"],
        "llmadapters.serving.hearth.dev",
        None,
        None,
        true,
    );
    add(
        c,
        &["patch"],
        "llmadapters.serving.hearth.dev",
        Some("status"),
        team(),
        true,
    );
    add(c, &["get", "list", "watch"], "namespaces", None, None, true);
    add(c, &["list", "watch"], "configmaps", None, None, true);
    add(
        c,
        &["create", "patch", "get", "delete"],
        "configmaps",
        None,
        team(),
        true,
    );
    add(c, &["delete"], "serviceaccounts", None, team(), true);
    // A plain Deployment leaving its endpoint: what was rendered for it goes (its ScaledObject
    // first, so KEDA gives it back its replicas).
    for r in [
        "roles.rbac.authorization.k8s.io",
        "rolebindings.rbac.authorization.k8s.io",
        "scaledobjects.keda.sh",
    ] {
        add(c, &["delete"], r, None, team(), true);
    }
    add(c, &["list", "watch"], "deployments.apps", None, None, true);
    add(
        c,
        &["create", "patch", "delete"],
        "poddisruptionbudgets.policy",
        None,
        team(),
        true,
    );
    add(
        c,
        &["list", "watch", "create", "patch", "get", "delete"],
        "networkpolicies.networking.k8s.io",
        None,
        team(),
        true,
    );
    add(
        c,
        &["create", "patch", "get", "delete"],
        "deployments.apps",
        None,
        team(),
        true,
    );
    // Adoption reads a child another manager wrote before moving its managedFields.
    for resource in [
        "serviceaccounts",
        "persistentvolumeclaims",
        "roles.rbac.authorization.k8s.io",
        "rolebindings.rbac.authorization.k8s.io",
        "poddisruptionbudgets.policy",
        "scaledobjects.keda.sh",
    ] {
        add(c, &["get"], resource, None, team(), true);
    }
    add(c, &["list", "watch"], "services", None, None, true);
    add(
        c,
        &["create", "patch", "get", "delete"],
        "services",
        None,
        team(),
        true,
    );
    for r in [
        "serviceaccounts",
        "persistentvolumeclaims",
        "jobs.batch",
        "roles.rbac.authorization.k8s.io",
        "rolebindings.rbac.authorization.k8s.io",
        "scaledobjects.keda.sh",
    ] {
        add(c, &["list", "watch"], r, None, None, true);
        add(c, &["create", "patch"], r, None, team(), true);
    }
    add(
        c,
        &["get", "list", "watch"],
        "endpointslices.discovery.k8s.io",
        None,
        team(),
        true,
    );
    add(
        c,
        &["get"],
        "customresourcedefinitions.apiextensions.k8s.io/scaledobjects.keda.sh",
        None,
        None,
        true,
    );
    add(
        c,
        &["create", "patch"],
        "events.events.k8s.io",
        None,
        team(),
        true,
    );
    // Activations: backend pods turning Ready, their kubelet's Events and KEDA's; the
    // kubelet's Warning Events of failed image pulls, watched in every namespace.
    add(c, &["list", "watch"], "pods", None, None, true);
    add(c, &["list", "watch"], "events", None, None, true);
    // Device handover: the nodes its victims run on; nothing more of them.
    add(c, &["get"], "nodes", None, None, true);
    add(
        c,
        &["list", "watch", "patch", "update"],
        "nodes",
        None,
        None,
        false,
    );
    add(
        c,
        &["create"],
        "leases.coordination.k8s.io",
        None,
        own(),
        true,
    );
    add(
        c,
        &["get", "update"],
        "leases.coordination.k8s.io/hearth-controller",
        None,
        own(),
        true,
    );
    add(
        c,
        &["get", "update"],
        "secrets/hearth-controller-keys",
        None,
        own(),
        true,
    );
    // And nothing like this.
    add(
        c,
        &["get", "update"],
        "secrets/hearth-webhook-tls",
        None,
        own(),
        false,
    );
    add(
        c,
        &["get"],
        "secrets/hearth-controller-keys",
        None,
        team(),
        false,
    );
    add(c, &["get", "list", "watch"], "secrets", None, None, false);
    add(c, &["get", "list"], "secrets", None, team(), false);
    add(c, &["get", "list"], "secrets", None, own(), false);
    add(c, &["update"], "deployments.apps", None, team(), false);
    // A cache claim holds the model: never deleted by the controller.
    add(
        c,
        &["delete"],
        "persistentvolumeclaims",
        None,
        team(),
        false,
    );
    add(c, &["create"], "pods", None, team(), false);
    add(c, &["get", "delete"], "pods", None, team(), false);
    add(c, &["create", "delete"], "events", None, team(), false);
    add(
        c,
        &["escalate", "bind"],
        "roles.rbac.authorization.k8s.io",
        None,
        team(),
        false,
    );
    add(
        c,
        &["create"],
        "clusterroles.rbac.authorization.k8s.io",
        None,
        None,
        false,
    );
    add(
        c,
        &["create"],
        "clusterrolebindings.rbac.authorization.k8s.io",
        None,
        None,
        false,
    );
    add(
        c,
        &["get"],
        "customresourcedefinitions.apiextensions.k8s.io/llmservices.serving.hearth.dev",
        None,
        None,
        false,
    );
    add(
        c,
        &["list"],
        "customresourcedefinitions.apiextensions.k8s.io",
        None,
        None,
        false,
    );
    add(
        c,
        &["update"],
        "leases.coordination.k8s.io/kube-scheduler",
        None,
        own(),
        false,
    );
    add(
        c,
        &["get"],
        "leases.coordination.k8s.io",
        None,
        team(),
        false,
    );
    add(
        c,
        &["patch", "create", "delete"],
        "inferenceruntimes.serving.hearth.dev",
        None,
        None,
        false,
    );
    add(
        c,
        &["create"],
        "servingpolicies.serving.hearth.dev",
        None,
        None,
        false,
    );
    add(
        c,
        &["update", "delete"],
        "llmservices.serving.hearth.dev",
        None,
        team(),
        false,
    );
    add(
        c,
        &["update"],
        "mutatingwebhookconfigurations.admissionregistration.k8s.io/hearth",
        None,
        None,
        false,
    );
    add(c, &["create"], "pods", Some("exec"), team(), false);

    // Both check who scrapes their /metrics.
    for account in [c, "hearth-webhook"] {
        add(
            account,
            &["create"],
            "tokenreviews.authentication.k8s.io",
            None,
            None,
            true,
        );
        add(
            account,
            &["create"],
            "subjectaccessreviews.authorization.k8s.io",
            None,
            None,
            true,
        );
    }

    let w = "hearth-webhook";
    // What the webhook needs.
    for r in [
        "inferenceruntimes.serving.hearth.dev",
        "servingpolicies.serving.hearth.dev",
        "namespaces",
        "llmservices.serving.hearth.dev",
        "llmadapters.serving.hearth.dev",
        "llmendpoints.serving.hearth.dev",
    ] {
        add(w, &["list", "watch"], r, None, None, true);
    }
    // A runtime a review names that the watch has not delivered yet.
    add(
        w,
        &["get"],
        "inferenceruntimes.serving.hearth.dev",
        None,
        None,
        true,
    );
    add(
        w,
        &["patch"],
        "servingpolicies.serving.hearth.dev",
        Some("status"),
        None,
        true,
    );
    add(
        w,
        &["get", "update"],
        "mutatingwebhookconfigurations.admissionregistration.k8s.io/hearth",
        None,
        None,
        true,
    );
    add(
        w,
        &["get", "update"],
        "validatingwebhookconfigurations.admissionregistration.k8s.io/hearth",
        None,
        None,
        true,
    );
    add(
        w,
        &["get", "update"],
        "secrets/hearth-webhook-tls",
        None,
        own(),
        true,
    );
    add(w, &["create"], "secrets", None, own(), true);
    // And nothing like this.
    add(
        w,
        &["create", "patch"],
        "deployments.apps",
        None,
        team(),
        false,
    );
    add(w, &["create"], "deployments.apps", None, own(), false);
    add(w, &["get", "list"], "secrets", None, None, false);
    add(w, &["get", "create"], "secrets", None, team(), false);
    add(
        w,
        &["get", "update", "delete"],
        "secrets/hearth-controller-token",
        None,
        own(),
        false,
    );
    add(
        w,
        &["get", "update"],
        "secrets/hearth-controller-keys",
        None,
        own(),
        false,
    );
    add(
        w,
        &["list", "watch", "delete"],
        "secrets",
        None,
        own(),
        false,
    );
    add(
        w,
        &["update", "delete"],
        "mutatingwebhookconfigurations.admissionregistration.k8s.io/other",
        None,
        None,
        false,
    );
    add(
        w,
        &["delete", "create"],
        "mutatingwebhookconfigurations.admissionregistration.k8s.io",
        None,
        None,
        false,
    );
    add(
        w,
        &["patch", "update", "delete"],
        "servingpolicies.serving.hearth.dev",
        None,
        None,
        false,
    );
    add(
        w,
        &["create"],
        "llmservices.serving.hearth.dev",
        None,
        team(),
        false,
    );
    add(
        w,
        &["patch"],
        "llmservices.serving.hearth.dev",
        Some("status"),
        team(),
        false,
    );
    add(
        w,
        &["get"],
        "leases.coordination.k8s.io",
        None,
        own(),
        false,
    );
    add(w, &["get"], "pods", None, team(), false);
    add(w, &["create"], "events.events.k8s.io", None, team(), false);
    checks
}

/// Resource rules of `kubectl auth can-i --list` for one account in one namespace, without
/// the rules every authenticated user has (self reviews, discovery URLs).
fn listed_rules(
    cluster: &Cluster,
    account: &str,
    sa_ns: &str,
    ns: &str,
) -> Result<BTreeSet<String>> {
    let out = run(
        cluster
            .kubectl()?
            .args(["auth", "can-i", "--list", "-n", ns])
            .arg(format!("--as=system:serviceaccount:{sa_ns}:{account}")),
        "kubectl auth can-i --list",
    )?;
    let mut rules = BTreeSet::new();
    for line in String::from_utf8_lossy(&out.stdout).lines().skip(1) {
        let resource = line.split_whitespace().next().unwrap_or_default();
        // Rows of nonResourceURLs (discovery, health) have no resource; the self reviews are
        // every authenticated user's.
        if resource.is_empty() || resource.starts_with('[') || resource.starts_with("selfsubject") {
            continue;
        }
        let rest = &line[resource.len()..];
        let lists: Vec<&str> = rest
            .split('[')
            .skip(1)
            .map(|s| s.split(']').next().unwrap_or_default())
            .collect();
        let (names, verbs) = (
            lists.get(1).copied().unwrap_or(""),
            lists.get(2).copied().unwrap_or(""),
        );
        let mut verbs: Vec<&str> = verbs.split_whitespace().collect();
        verbs.sort_unstable();
        rules.insert(format!("{resource} [{names}] [{}]", verbs.join(" ")));
    }
    Ok(rules)
}

fn set(lines: &[&str]) -> BTreeSet<String> {
    lines.iter().map(|s| (*s).to_owned()).collect()
}

/// Waits until `check` is allowed: the authorizer sees new RBAC objects through an informer.
async fn wait_for_grant(cluster: &Cluster, sa_namespace: &str, check: &Check) -> Result<()> {
    wait_until(
        format!("{} may {} {}", check.account, check.verb, check.resource),
        Duration::from_secs(30),
        || async {
            Ok(if can_i(cluster, sa_namespace, check)? {
                Observed::Ready(())
            } else {
                Observed::NotYet("not yet allowed".into())
            })
        },
    )
    .await
}

/// Asks every check and fails with the table of mismatches.
fn assert_checks(cluster: &Cluster, sa_namespace: &str, checks: &[Check]) -> Result<Vec<String>> {
    let mut rows = Vec::new();
    let mut wrong = Vec::new();
    for chunk in checks.chunks(8) {
        let answers: Vec<Result<bool>> = std::thread::scope(|s| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|c| s.spawn(|| can_i(cluster, sa_namespace, c)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("panicked")))
                })
                .collect()
        });
        for (c, got) in chunk.iter().zip(answers) {
            let got = got?;
            let where_ = match &c.namespace {
                Some(n) if n == sa_namespace => "release ns".to_owned(),
                Some(n) => n.clone(),
                None => "cluster".to_owned(),
            };
            let what = match c.subresource {
                Some(s) => format!("{}/{s}", c.resource),
                None => c.resource.clone(),
            };
            let row = format!(
                "{:<18} {:<7} {:<72} {:<10} {}",
                c.account,
                c.verb,
                what,
                where_,
                if got { "yes" } else { "no" }
            );
            if got != c.allowed {
                wrong.push(format!(
                    "{row} (expected {})",
                    if c.allowed { "yes" } else { "no" }
                ));
            }
            rows.push(row);
        }
    }
    ensure!(wrong.is_empty(), "RBAC mismatches:\n{}", wrong.join("\n"));
    Ok(rows)
}

/// `controller.watchNamespace`: the controller's rights on namespaced objects are a Role in
/// that namespace only.
#[tokio::test]
async fn rbac_watch_namespace_confines_the_controller() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let ns = cluster.namespace("chart-rbac-ns").await?;
    let watched = cluster.namespace("chart-rbac-watched").await?;
    let release = ns.name().to_owned();
    let _rbac = InstalledRbac::install(
        &cluster,
        &release,
        ns.name(),
        &json!({"controller": {"watchNamespace": watched.name()}}),
    )?;
    let check = |verb: &'static str, resource: &str, namespace: Option<&str>, allowed| Check {
        account: "hearth-controller",
        verb,
        resource: resource.to_owned(),
        subresource: None,
        namespace: namespace.map(str::to_owned),
        allowed,
    };
    wait_for_grant(
        &cluster,
        ns.name(),
        &check("create", "deployments.apps", Some(watched.name()), true),
    )
    .await?;
    let checks = vec![
        check("create", "deployments.apps", Some(watched.name()), true),
        check(
            "list",
            "llmservices.serving.hearth.dev",
            Some(watched.name()),
            true,
        ),
        check(
            "get",
            "endpointslices.discovery.k8s.io",
            Some(watched.name()),
            true,
        ),
        check("list", "inferenceruntimes.serving.hearth.dev", None, true),
        check(
            "create",
            "leases.coordination.k8s.io",
            Some(ns.name()),
            true,
        ),
        check("create", "deployments.apps", Some("team-a"), false),
        check("list", "deployments.apps", None, false),
        check("list", "llmservices.serving.hearth.dev", None, false),
        check(
            "get",
            "endpointslices.discovery.k8s.io",
            Some("team-a"),
            false,
        ),
        check("create", "events.events.k8s.io", Some("team-a"), false),
        check("get", "secrets", Some(watched.name()), false),
    ];
    let rows = assert_checks(&cluster, ns.name(), &checks)?;
    eprintln!(
        "watchNamespace RBAC ({} checks):\n{}",
        rows.len(),
        rows.join("\n")
    );
    Ok(())
}

#[tokio::test]
async fn rbac_matrix_each_account_can_do_what_it_needs_and_nothing_more() -> Result<()> {
    let cluster = Cluster::connect().await?;
    install_crds(&cluster).await?;
    let ns = cluster.namespace("chart-rbac").await?;
    let release = ns.name().to_owned();
    let _rbac = InstalledRbac::install(&cluster, &release, ns.name(), &json!({}))?;

    // RBAC is cached by the authorizer only briefly; wait until the grant is visible.
    let probe = Check {
        account: "hearth-webhook",
        verb: "create",
        resource: "secrets".into(),
        subresource: None,
        namespace: Some(ns.name().to_owned()),
        allowed: true,
    };
    wait_until(
        "the chart's RBAC in effect",
        Duration::from_secs(30),
        || async {
            Ok(if can_i(&cluster, ns.name(), &probe)? {
                Observed::Ready(())
            } else {
                Observed::NotYet("webhook cannot create its Secret yet".into())
            })
        },
    )
    .await?;

    let rows = assert_checks(&cluster, ns.name(), &matrix(ns.name()))?;
    eprintln!("RBAC matrix ({} checks):\n{}", rows.len(), rows.join("\n"));

    // Nothing more: every rule each account holds, as the apiserver lists them.
    let controller_cluster = [
        "deployments.apps [] [create delete get list patch watch]",
        "services [] [create delete get list patch watch]",
        "serviceaccounts [] [create delete get list patch watch]",
        "persistentvolumeclaims [] [create get list patch watch]",
        "configmaps [] [create delete get list patch watch]",
        "jobs.batch [] [create list patch watch]",
        "roles.rbac.authorization.k8s.io [] [create delete get list patch watch]",
        "rolebindings.rbac.authorization.k8s.io [] [create delete get list patch watch]",
        "scaledobjects.keda.sh [] [create delete get list patch watch]",
        "poddisruptionbudgets.policy [] [create delete get list patch watch]",
        "networkpolicies.networking.k8s.io [] [create delete get list patch watch]",
        "endpointslices.discovery.k8s.io [] [get list watch]",
        "customresourcedefinitions.apiextensions.k8s.io [scaledobjects.keda.sh] [get list watch]",
        "namespaces [] [get list watch]",
        "events.events.k8s.io [] [create patch]",
        "pods [] [list watch]",
        "events [] [list watch]",
        "secrets [] [create delete patch]",
        "triggerauthentications.keda.sh [] [create delete patch]",
        "nodes [] [get]",
        "llmservices.serving.hearth.dev [] [list watch]",
        "llmendpoints.serving.hearth.dev [] [list watch]",
        "llmadapters.serving.hearth.dev [] [list watch]",
        "inferenceruntimes.serving.hearth.dev [] [list watch]",
        "servingpolicies.serving.hearth.dev [] [get list watch]",
        "llmservices.serving.hearth.dev/status [] [patch]",
        "llmendpoints.serving.hearth.dev/status [] [patch]",
        "llmadapters.serving.hearth.dev/status [] [patch]",
        "inferenceruntimes.serving.hearth.dev/status [] [patch]",
        "tokenreviews.authentication.k8s.io [] [create]",
        "subjectaccessreviews.authorization.k8s.io [] [create]",
        // Policy scans: the StatefulSets annotated for Hearth, one PolicyReport each, the
        // policies' status.scan, and whether the PolicyReport CRD is installed.
        "statefulsets.apps [] [list]",
        "policyreports.wgpolicyk8s.io [] [create delete list patch]",
        "servingpolicies.serving.hearth.dev/status [] [patch]",
        "customresourcedefinitions.apiextensions.k8s.io [policyreports.wgpolicyk8s.io] [get]",
    ];
    let controller_own = [
        "leases.coordination.k8s.io [hearth-controller] [get update]",
        // The key of the gateways' admin tokens: the one Secret it reads.
        "secrets [hearth-controller-keys] [get update]",
        "leases.coordination.k8s.io [] [create]",
        // The runtime image pre-pull DaemonSets, in the release namespace only.
        "daemonsets.apps [] [create delete get list patch watch]",
    ];
    let webhook_cluster = [
        // get: a runtime a review names that the watch has not delivered yet.
        "inferenceruntimes.serving.hearth.dev [] [get list watch]",
        "servingpolicies.serving.hearth.dev [] [list watch]",
        "llmservices.serving.hearth.dev [] [list watch]",
        "llmadapters.serving.hearth.dev [] [list watch]",
        "llmendpoints.serving.hearth.dev [] [list watch]",
        "servingpolicies.serving.hearth.dev/status [] [patch]",
        "namespaces [] [list watch]",
        // The policies the apiserver runs as exported (metadata only).
        "validatingadmissionpolicies.admissionregistration.k8s.io [] [list watch]",
        "validatingadmissionpolicybindings.admissionregistration.k8s.io [] [list watch]",
        "mutatingadmissionpolicies.admissionregistration.k8s.io [] [list watch]",
        "mutatingadmissionpolicybindings.admissionregistration.k8s.io [] [list watch]",
        "mutatingwebhookconfigurations.admissionregistration.k8s.io [hearth] [get update]",
        "validatingwebhookconfigurations.admissionregistration.k8s.io [hearth] [get update]",
        "tokenreviews.authentication.k8s.io [] [create]",
        "subjectaccessreviews.authorization.k8s.io [] [create]",
    ];
    let webhook_own = [
        "secrets [hearth-webhook-tls] [get update]",
        "secrets [] [create]",
    ];
    let with = |a: &[&str], b: &[&str]| set(&[a, b].concat());
    for (account, in_ns, want) in [
        (
            "hearth-controller",
            "team-a".to_owned(),
            set(&controller_cluster),
        ),
        (
            "hearth-controller",
            ns.name().to_owned(),
            with(&controller_cluster, &controller_own),
        ),
        ("hearth-webhook", "team-a".to_owned(), set(&webhook_cluster)),
        (
            "hearth-webhook",
            ns.name().to_owned(),
            with(&webhook_cluster, &webhook_own),
        ),
    ] {
        let got = listed_rules(&cluster, account, ns.name(), &in_ns)?;
        ensure!(
            got == want,
            "{account} in {in_ns}: rules differ\nextra: {:?}\nmissing: {:?}",
            got.difference(&want).collect::<Vec<_>>(),
            want.difference(&got).collect::<Vec<_>>()
        );
    }

    // Escalation prevention is checked on writes, not by can-i: the controller must be able
    // to grant each gateway its Role (the rules of controller/src/render/gateway.rs) ...
    let team = cluster.namespace("chart-rbac-team").await?;
    let controller_as = format!("--as=system:serviceaccount:{}:hearth-controller", ns.name());
    let gateway = "stub-svc-gateway";
    let meta = |n: &str| json!({"name": n, "namespace": team.name()});
    let grant = vec![
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(gateway)}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": meta(gateway), "rules": gateway_role_rules()?}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": meta(gateway),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": gateway},
               "subjects": [{"kind": "ServiceAccount", "name": gateway, "namespace": team.name()}]}),
        json!({"apiVersion": "v1", "kind": "Service", "metadata": meta(gateway),
               "spec": {"ports": [{"name": "http", "port": 80, "targetPort": "http"}],
                        "selector": {"app": gateway}}}),
        // An LLMEndpoint's gateway reads its routing table (controller/src/render/gateway.rs).
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": meta("shared-gateway"), "rules": [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]},
        ]}),
    ];
    let list = json!({"apiVersion": "v1", "kind": "List", "items": grant});
    run_stdin(
        cluster
            .kubectl()?
            .args([
                "apply",
                "--server-side",
                "--field-manager=hearth-controller",
                "-f",
                "-",
            ])
            .arg(&controller_as),
        list.to_string().as_bytes(),
        "server-side apply of the gateway's ServiceAccount, Role, RoleBinding and Service as the controller",
    )?;
    // ... but not to grant anything it does not hold (here: reading Secrets).
    let escalate = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "escalate", "namespace": team.name()},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}],
    });
    let out = cluster
        .kubectl()?
        .args([
            "apply",
            "--server-side",
            "--field-manager=hearth-controller",
            "-f",
            "-",
        ])
        .arg(&controller_as)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            if let Some(mut stdin) = child.stdin.take() {
                stdin.write_all(escalate.to_string().as_bytes())?;
            }
            child.wait_with_output()
        })?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains("escalat"),
        "the controller could create a Role granting Secrets: {err}"
    );

    // The webhook makes its own Secret, and reads no other.
    let webhook_as = format!("--as=system:serviceaccount:{}:hearth-webhook", ns.name());
    run(
        cluster
            .kubectl()?
            .args([
                "create",
                "secret",
                "generic",
                "hearth-webhook-tls",
                "-n",
                ns.name(),
                "--from-literal=probe=1",
            ])
            .arg(&webhook_as),
        "the webhook creating its Secret",
    )?;
    run(
        cluster
            .kubectl()?
            .args(["get", "secret", "hearth-webhook-tls", "-n", ns.name()])
            .arg(&webhook_as),
        "the webhook reading its Secret",
    )?;
    run(
        cluster.kubectl()?.args([
            "create",
            "secret",
            "generic",
            "other",
            "-n",
            ns.name(),
            "--from-literal=a=b",
        ]),
        "creating another Secret as admin",
    )?;
    let out = cluster
        .kubectl()?
        .args(["get", "secret", "other", "-n", ns.name()])
        .arg(&webhook_as)
        .output()?;
    ensure!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("forbidden"),
        "the webhook could read another Secret"
    );
    Ok(())
}
