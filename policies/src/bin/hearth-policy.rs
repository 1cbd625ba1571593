//! `hearth-policy`: evaluate and test ServingPolicies (and native ValidatingAdmissionPolicy /
//! MutatingAdmissionPolicy manifests) offline.

use std::{path::PathBuf, process::ExitCode};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use hearth_crds::servingpolicy::Operation;
use hearth_policies::{
    EvalInput, PolicySet, PolicySettings, Selection, export,
    manifest::{self, Bundle},
    resolve_runtime, testfile,
};
use serde_json::{Value, json};

#[derive(Parser)]
#[command(
    name = "hearth-policy",
    version,
    about = "Evaluate and test Hearth ServingPolicies offline",
    after_help = "Exit status: 0 allowed (eval) or every case passed (test); 1 denied, or a case failed; \
2 bad input (a file that does not read or parse, a runtime that does not resolve); \
3 a policy did not load (eval: the verdict then covers only the policies that loaded). \
export: 0 every policy exported, 1 one or more cannot be (the reasons are on stderr)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Yaml,
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
enum Op {
    #[value(name = "CREATE")]
    Create,
    #[value(name = "UPDATE")]
    Update,
    #[value(name = "DELETE")]
    Delete,
}

#[derive(Subcommand)]
enum Command {
    /// Evaluate policies against one resource and print the verdict, warnings, audit
    /// annotations, the JSON Patch and the patched object.
    Eval {
        /// Policy manifests (files or directories): ServingPolicy, ValidatingAdmissionPolicy
        /// (+ binding), MutatingAdmissionPolicy. Repeatable.
        #[arg(long, short = 'p', required = true)]
        policy: Vec<PathBuf>,
        /// The resource under test (YAML or JSON, one object).
        #[arg(long, short = 'r')]
        resource: PathBuf,
        /// InferenceRuntime manifests bound as `params`: a single runtime is used as is; with
        /// several, the one the resource's annotations select.
        #[arg(long)]
        params: Vec<PathBuf>,
        /// The owning LLMService, bound as `service`.
        #[arg(long)]
        service: Option<PathBuf>,
        /// The installation's settings, bound as `settings` (YAML: `drainImage: <image>`).
        #[arg(long)]
        settings: Option<PathBuf>,
        /// The old object (UPDATE, DELETE).
        #[arg(long)]
        old: Option<PathBuf>,
        /// The namespace object (for namespaceSelector and `namespaceObject`).
        #[arg(long)]
        namespace: Option<PathBuf>,
        /// The admission operation.
        #[arg(long, value_enum, default_value = "CREATE")]
        operation: Op,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value = "yaml")]
        output: Format,
    },
    /// Print the ValidatingAdmissionPolicy and MutatingAdmissionPolicy objects (with their
    /// bindings) that run the policies in the apiserver, and on stderr why a policy cannot be
    /// exported.
    Export {
        /// ServingPolicy manifests (files or directories); InferenceRuntimes found there count
        /// as --params. Repeatable.
        #[arg(long, short = 'p', required = true)]
        policy: Vec<PathBuf>,
        /// The cluster's InferenceRuntimes (their vendors and priorities resolve
        /// `serving.hearth.dev/vendor`).
        #[arg(long)]
        params: Vec<PathBuf>,
        /// The apiserver's Kubernetes version (`1.35`): which CEL it accepts and which API
        /// versions it serves.
        #[arg(long, default_value = "1.35", value_parser = parse_minor)]
        kubernetes_version: u32,
        /// Override the MutatingAdmissionPolicy API version (`none`: the apiserver serves none).
        #[arg(long, value_enum)]
        mutating_api: Option<MutatingApi>,
        /// The namespace Hearth runs in (skipped by the bindings, as by the webhook).
        #[arg(long, default_value = "hearth-system")]
        namespace: String,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value = "yaml")]
        output: Format,
    },
    /// Run every hearth-test.yaml under the directories, print a table, fail on any mismatch.
    Test {
        /// Directories (or test files).
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum MutatingApi {
    V1,
    V1beta1,
    None,
}

/// `1.35` (or `v1.35.2`) → 35.
fn parse_minor(s: &str) -> Result<u32, String> {
    let t = s.trim().trim_start_matches('v');
    let mut parts = t.split('.');
    match (parts.next(), parts.next().map(str::parse::<u32>)) {
        (Some("1"), Some(Ok(minor))) => Ok(minor),
        _ => Err(format!("{s:?} is not a Kubernetes version like 1.35")),
    }
}

fn read_object(path: &PathBuf) -> anyhow::Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value =
        serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(v)
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<ExitCode> {
    match Cli::parse().command {
        Command::Test { dirs } => {
            let mut rows = Vec::new();
            for d in &dirs {
                if !d.exists() {
                    bail!("{} does not exist", d.display());
                }
                rows.extend(testfile::run_dir(d));
            }
            if rows.is_empty() {
                bail!("no {} found under {:?}", testfile::TEST_FILE_NAME, dirs);
            }
            print!("{}", testfile::render_table(&rows));
            Ok(if rows.iter().all(|r| r.passed()) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Export {
            policy,
            params,
            kubernetes_version,
            mutating_api,
            namespace,
            output,
        } => {
            let mut bundle = Bundle::default();
            for p in policy.iter().chain(&params) {
                manifest::read_path(p, &mut bundle)?;
            }
            if bundle.policies.is_empty() {
                bail!(
                    "no ServingPolicy in {:?} (a directory is read one level deep, its .yaml and .yml files): name the files or the directory that holds them",
                    policy
                );
            }
            let mut names = std::collections::BTreeSet::new();
            for p in &bundle.policies {
                let name = p.metadata.name.as_deref().unwrap_or_default();
                if !names.insert(name) {
                    bail!(
                        "ServingPolicy {name} is given twice: its exported objects would overwrite each other; pass each policy once"
                    );
                }
            }
            if !hearth_crds::naming::is_dns1123_label(&namespace) {
                bail!("--namespace {namespace:?} is not a namespace name (a DNS label)");
            }
            let (_, errors) = PolicySet::compile(&bundle.policies);
            if !errors.is_empty() {
                for e in &errors {
                    eprintln!("load error: {e}");
                }
                return Ok(ExitCode::from(3));
            }
            if bundle.runtimes.is_empty() {
                eprintln!(
                    "note: no InferenceRuntime given (--params): the exported hearth-runtime condition resolves pinned runtimes only; workloads that select by serving.hearth.dev/vendor match nothing"
                );
            }
            let mut target = export::Target::for_kubernetes(kubernetes_version);
            if let Some(m) = mutating_api {
                target.mutating = match m {
                    MutatingApi::V1 => Some(export::ApiVersion::V1),
                    MutatingApi::V1beta1 => Some(export::ApiVersion::V1beta1),
                    MutatingApi::None => None,
                };
            }
            match (target.mutating, kubernetes_version) {
                (Some(export::ApiVersion::V1beta1), 34 | 35) => eprintln!(
                    "note: MutatingAdmissionPolicy v1beta1 is served on 1.34 and 1.35 only with --feature-gates=MutatingAdmissionPolicy=true and --runtime-config=admissionregistration.k8s.io/v1beta1=true"
                ),
                (Some(export::ApiVersion::V1), 36..) | (None, _) => {}
                (Some(v), minor) => eprintln!(
                    "note: Kubernetes 1.{minor} does not serve MutatingAdmissionPolicy as {}",
                    v.as_str()
                ),
            }
            let skip = export::skipped_namespaces(&namespace);
            let mut objects = Vec::new();
            let mut refused = 0;
            for p in &bundle.policies {
                let name = p.metadata.name.as_deref().unwrap_or_default();
                match export::export(p, &bundle.runtimes, &target, &skip) {
                    Ok(o) => objects.extend(o),
                    Err(reasons) => {
                        refused += 1;
                        eprintln!("{name}: not exported:");
                        for r in reasons {
                            eprintln!("  - {r}");
                        }
                    }
                }
            }
            match output {
                Format::Yaml => {
                    for o in &objects {
                        print!("---\n{}", serde_yaml::to_string(o)?);
                    }
                }
                Format::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &json!({"apiVersion": "v1", "kind": "List", "items": objects})
                    )?
                ),
            }
            Ok(if refused == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Eval {
            policy,
            resource,
            params,
            service,
            settings,
            old,
            namespace,
            operation,
            output,
        } => {
            let mut bundle = Bundle::default();
            for p in &policy {
                manifest::read_path(p, &mut bundle)?;
            }
            let (set, errors) = PolicySet::compile(&bundle.policies);
            for e in &errors {
                eprintln!("load error: {e}");
            }
            let object = read_object(&resource)?;
            let op = match operation {
                Op::Create => Operation::Create,
                Op::Update => Operation::Update,
                Op::Delete => Operation::Delete,
            };
            let mut input = EvalInput::for_object(object.clone(), op);
            if let Some(o) = &old {
                input.old_object = Some(read_object(o)?);
            }
            if op == Operation::Delete {
                input.object = None;
            }
            if let Some(n) = &namespace {
                input.namespace_object = Some(read_object(n)?);
            }
            if let Some(path) = &settings {
                // An empty file is no settings.
                let s: PolicySettings = match read_object(path)? {
                    Value::Null => PolicySettings::default(),
                    v @ Value::Object(_) => serde_json::from_value(v).with_context(|| {
                        format!(
                            "reading the settings in {} (fields: drainImage)",
                            path.display()
                        )
                    })?,
                    _ => anyhow::bail!(
                        "{}: the settings must be a map, such as `drainImage: <image>`",
                        path.display()
                    ),
                };
                s.validate()
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                input.settings = Some(s.to_value());
            }
            let mut runtimes = Bundle::default();
            for p in &params {
                manifest::read_path(p, &mut runtimes)?;
            }
            let selection = Selection::from_object(&object);
            if runtimes.runtimes.len() == 1 {
                if selection.is_none() {
                    eprintln!(
                        "note: the resource has no serving.hearth.dev/runtime or serving.hearth.dev/vendor annotation; \
it is evaluated with the one --params runtime, but admission (and `hearth-policy test`) would bind no runtime"
                    );
                }
                input.params = Some(manifest::runtime_params(&runtimes.runtimes[0]));
            } else if !runtimes.runtimes.is_empty() {
                let sel = selection
                    .context("several runtimes given but the resource names neither serving.hearth.dev/runtime nor serving.hearth.dev/vendor")?;
                input.params = Some(manifest::runtime_params(resolve_runtime(
                    &runtimes.runtimes,
                    &sel,
                )?));
            }
            if let Some(s) = &service {
                let mut b = Bundle::default();
                manifest::read_path(s, &mut b)?;
                let svc = b
                    .services
                    .first()
                    .context("--service holds no LLMService")?;
                input.service = Some(serde_json::to_value(svc)?);
            }
            let out = set.evaluate(&input);
            let report = json!({
                "allowed": out.allowed(),
                "matched": out.matched,
                "denials": out.denials,
                "warnings": out.warnings,
                "auditAnnotations": out.audit_annotations,
                "errors": out.errors,
                "patch": out.patch,
                "patchedObject": out.patched_object,
                "mutationReports": out.mutation_reports,
                // What a background scan reports for this object if it already ran.
                "policyResults": hearth_policies::report::results(&set, &input),
                "loadErrors": errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
            });
            match output {
                Format::Yaml => print!("{}", serde_yaml::to_string(&report)?),
                Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
            }
            Ok(if !errors.is_empty() {
                eprintln!(
                    "error: {} polic{} did not load; the verdict above covers only the policies that loaded",
                    errors.len(),
                    if errors.len() == 1 { "y" } else { "ies" }
                );
                ExitCode::from(3)
            } else if out.allowed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}
