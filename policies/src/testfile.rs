//! `hearth-policy test`: test files listing resources and expected outcomes, in the spirit of
//! `kyverno test`.
//!
//! A test file is named `hearth-test.yaml` (found recursively under the directory given):
//!
//! ```yaml
//! name: built-in policies on NVIDIA
//! policies: [".."]              # files or directories (their *.yaml files), relative to this file
//! manifests: ["runtimes"]       # InferenceRuntimes / LLMServices to resolve params and service
//! cases:
//!   - name: a GPU is requested
//!     resource: resources/deployment.yaml
//!     operation: CREATE         # default CREATE; UPDATE needs oldResource
//!     oldResource: resources/old.yaml
//!     runtime: vllm-nvidia-a10  # params; default: resolved from the resource's annotations
//!     service: my-service       # the LLMService bound as `service` (optional)
//!     namespaceObject: {metadata: {name: team-a, labels: {tier: gold}}}
//!     settings: {drainImage: registry.example/hearth-gateway:v1}  # bound as `settings`
//!     userInfo: {username: alice, groups: [dev]}
//!     expect:
//!       allowed: true
//!       denied: ["substring of a denial"]
//!       warnings: ["substring of a warning"]
//!       auditAnnotations: {policy/key: value}
//!       patchedResource: expected/deployment.yaml
//!       errors: 0               # evaluation errors expected
//!       idempotent: true        # default: a second mutation pass yields an empty patch
//! ```

use std::path::{Path, PathBuf};

use hearth_crds::servingpolicy::Operation;
use serde::Deserialize;
use serde_json::Value;

use crate::{
    engine::{EvalInput, PolicySet, PolicySettings, UserInfo},
    manifest::{self, Bundle},
    resolve::{Selection, resolve_runtime},
};

/// The file name `hearth-policy test` looks for.
pub const TEST_FILE_NAME: &str = "hearth-test.yaml";

/// A test file.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TestFile {
    /// A title for the table.
    pub name: String,
    /// Policy files or directories.
    pub policies: Vec<PathBuf>,
    /// Runtime / LLMService manifests.
    #[serde(default)]
    pub manifests: Vec<PathBuf>,
    /// The cases.
    pub cases: Vec<TestCase>,
}

/// One resource and what must happen to it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TestCase {
    /// Case name.
    pub name: String,
    /// The object under test (a YAML file with one object).
    pub resource: PathBuf,
    /// The operation; default CREATE.
    #[serde(default)]
    pub operation: Option<Operation>,
    /// The old object (UPDATE, DELETE).
    #[serde(default)]
    pub old_resource: Option<PathBuf>,
    /// The InferenceRuntime bound as params; default resolved from the resource.
    #[serde(default)]
    pub runtime: Option<String>,
    /// The LLMService bound as `service`.
    #[serde(default)]
    pub service: Option<String>,
    /// `namespaceObject`.
    #[serde(default)]
    pub namespace_object: Option<Value>,
    /// The installation's settings (`settings`).
    #[serde(default)]
    pub settings: Option<PolicySettings>,
    /// The requesting user.
    #[serde(default)]
    pub user_info: Option<UserInfo>,
    /// Expected outcome.
    pub expect: Expect,
}

/// The expected outcome of one case; omitted fields are not checked.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Expect {
    /// Admitted or not.
    #[serde(default)]
    pub allowed: Option<bool>,
    /// Substrings that must each appear in a denial message.
    #[serde(default)]
    pub denied: Vec<String>,
    /// Substrings that must each appear in a warning.
    #[serde(default)]
    pub warnings: Vec<String>,
    /// Audit annotations that must be present with these values.
    #[serde(default)]
    pub audit_annotations: std::collections::BTreeMap<String, String>,
    /// The whole expected object after mutation (a YAML file).
    #[serde(default)]
    pub patched_resource: Option<PathBuf>,
    /// The number of evaluation errors.
    #[serde(default)]
    pub errors: Option<usize>,
    /// Whether a second mutation pass must yield an empty patch (default true).
    #[serde(default)]
    pub idempotent: Option<bool>,
    /// A substring of the expected runtime-resolution error (the workload names a runtime or
    /// vendor that does not exist); the case then checks nothing else.
    #[serde(default)]
    pub resolve_error: Option<String>,
}

/// One row of the result table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// The test file.
    pub file: PathBuf,
    /// The test file's name.
    pub suite: String,
    /// The case.
    pub case: String,
    /// Empty when the case passed; otherwise each mismatch.
    pub failures: Vec<String>,
}

impl Row {
    /// Whether the case passed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// A test file that could not be run at all.
#[derive(Debug, thiserror::Error)]
pub enum TestError {
    /// Reading a manifest failed.
    #[error(transparent)]
    Manifest(#[from] manifest::ManifestError),
    /// The test file is malformed.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Finds every [`TEST_FILE_NAME`] under `dir` (sorted).
pub fn find_test_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if dir.is_file() {
        out.push(dir.to_owned());
        return out;
    }
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == TEST_FILE_NAME) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn read_one(path: &Path) -> Result<Value, TestError> {
    let text = std::fs::read_to_string(path).map_err(|source| manifest::ManifestError::Io {
        path: path.to_owned(),
        source,
    })?;
    // Resources may be of any kind, including ours; read them raw.
    let docs: Vec<Value> = serde_yaml::Deserializer::from_str(&text)
        .map(Value::deserialize)
        .collect::<Result<_, _>>()
        .map_err(|e| TestError::Invalid {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    docs.into_iter()
        .find(|d| !d.is_null())
        .ok_or_else(|| TestError::Invalid {
            path: path.to_owned(),
            message: "no object in file".into(),
        })
}

/// Runs one test file and returns a row per case.
pub fn run_test_file(path: &Path) -> Result<Vec<Row>, TestError> {
    let invalid = |message: String| TestError::Invalid {
        path: path.to_owned(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|source| manifest::ManifestError::Io {
        path: path.to_owned(),
        source,
    })?;
    let tf: TestFile = serde_yaml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
    let base = path.parent().unwrap_or(Path::new("."));
    let mut bundle = Bundle::default();
    for p in &tf.policies {
        manifest::read_path(&base.join(p), &mut bundle)?;
    }
    let mut extra = Bundle::default();
    for p in &tf.manifests {
        manifest::read_path(&base.join(p), &mut extra)?;
    }
    let runtimes = [&bundle.runtimes[..], &extra.runtimes[..]].concat();
    let services = [&bundle.services[..], &extra.services[..]].concat();
    let (set, load_errors) = PolicySet::compile(&bundle.policies);
    if !load_errors.is_empty() {
        return Err(invalid(format!(
            "policies failed to load: {}",
            load_errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        )));
    }
    let mut rows = Vec::new();
    for case in &tf.cases {
        let mut failures = Vec::new();
        let object = read_one(&base.join(&case.resource))?;
        let op = case.operation.unwrap_or(Operation::Create);
        let mut input = EvalInput::for_object(object.clone(), op);
        if let Some(old) = &case.old_resource {
            input.old_object = Some(read_one(&base.join(old))?);
        }
        if op == Operation::Delete {
            input.object = None;
        }
        input.namespace_object = case.namespace_object.clone();
        if let Some(settings) = &case.settings {
            if let Err(e) = settings.validate() {
                failures.push(format!("settings: {e}"));
            }
            input.settings = Some(settings.to_value());
        }
        if let Some(u) = &case.user_info {
            input.request.user_info = u.clone();
        }
        let selection = match &case.runtime {
            Some(n) => Some(Selection::Pinned(n.clone())),
            None => Selection::from_object(&object),
        };
        let e = &case.expect;
        if let Some(sel) = selection {
            match (resolve_runtime(&runtimes, &sel), &e.resolve_error) {
                (Ok(rt), None) => input.params = Some(manifest::runtime_params(rt)),
                (Err(err), None) => failures.push(format!("runtime: {err}")),
                (Ok(rt), Some(want)) => failures.push(format!(
                    "resolveError: want an error containing {want:?}, resolved {}",
                    rt.metadata.name.as_deref().unwrap_or_default()
                )),
                (Err(err), Some(want)) => {
                    if !err.to_string().contains(want.as_str()) {
                        failures.push(format!("resolveError: want {want:?}, got {err}"));
                    }
                    rows.push(Row {
                        file: path.to_owned(),
                        suite: tf.name.clone(),
                        case: case.name.clone(),
                        failures,
                    });
                    continue;
                }
            }
        } else if let Some(want) = &e.resolve_error {
            failures.push(format!(
                "resolveError: want {want:?}, but the resource selects no runtime"
            ));
        }
        if let Some(name) = &case.service {
            match services
                .iter()
                .find(|s| s.metadata.name.as_deref() == Some(name))
            {
                Some(s) => input.service = serde_json::to_value(s).ok(),
                None => failures.push(format!("LLMService {name:?} is not in the manifests")),
            }
        }
        let out = set.evaluate(&input);
        if let Some(allowed) = e.allowed
            && out.allowed() != allowed
        {
            failures.push(format!(
                "allowed: want {allowed}, got {} ({})",
                out.allowed(),
                out.rejection_messages().join("; ")
            ));
        }
        for want in &e.denied {
            if !out.denials.iter().any(|d| d.message.contains(want)) {
                failures.push(format!(
                    "denied: no denial contains {want:?}; got {:?}",
                    out.denials.iter().map(|d| &d.message).collect::<Vec<_>>()
                ));
            }
        }
        for want in &e.warnings {
            if !out.warnings.iter().any(|w| w.contains(want)) {
                failures.push(format!(
                    "warnings: none contains {want:?}; got {:?}",
                    out.warnings
                ));
            }
        }
        for (k, v) in &e.audit_annotations {
            if out.audit_annotations.get(k) != Some(v) {
                failures.push(format!(
                    "auditAnnotations[{k}]: want {v:?}, got {:?}",
                    out.audit_annotations.get(k)
                ));
            }
        }
        if let Some(n) = e.errors
            && out.errors.len() != n
        {
            failures.push(format!(
                "errors: want {n}, got {}: {:?}",
                out.errors.len(),
                out.errors
                    .iter()
                    .map(|e| format!("{} {}: {}", e.policy, e.field, e.message))
                    .collect::<Vec<_>>()
            ));
        }
        if let Some(p) = &e.patched_resource {
            let want = read_one(&base.join(p))?;
            let got = out.patched_object.clone().unwrap_or(Value::Null);
            if got != want {
                let diff = json_patch::diff(&want, &got);
                failures.push(format!(
                    "patchedResource differs from {} (patch from expected to actual: {})",
                    p.display(),
                    serde_json::to_string(&diff).unwrap_or_default()
                ));
            }
        }
        if e.idempotent.unwrap_or(true)
            && let Some(obj) = &out.patched_object
        {
            let mut again = input.clone();
            again.object = Some(obj.clone());
            let second = set.evaluate(&again);
            if !second.patch.0.is_empty() {
                failures.push(format!(
                    "not idempotent: a second pass patched {}",
                    serde_json::to_string(&second.patch).unwrap_or_default()
                ));
            }
        }
        rows.push(Row {
            file: path.to_owned(),
            suite: tf.name.clone(),
            case: case.name.clone(),
            failures,
        });
    }
    Ok(rows)
}

/// Runs every test file under `dir`. Files that cannot run become failed rows.
pub fn run_dir(dir: &Path) -> Vec<Row> {
    let mut rows = Vec::new();
    for f in find_test_files(dir) {
        match run_test_file(&f) {
            Ok(r) => rows.extend(r),
            Err(e) => rows.push(Row {
                file: f.clone(),
                suite: f.display().to_string(),
                case: "(load)".into(),
                failures: vec![e.to_string()],
            }),
        }
    }
    rows
}

/// Renders rows as a plain-text table with a summary line.
pub fn render_table(rows: &[Row]) -> String {
    let w_suite = rows.iter().map(|r| r.suite.len()).max().unwrap_or(5).max(5);
    let w_case = rows.iter().map(|r| r.case.len()).max().unwrap_or(4).max(4);
    let mut s = format!("{:<w_suite$}  {:<w_case$}  RESULT\n", "SUITE", "CASE");
    for r in rows {
        s.push_str(&format!(
            "{:<w_suite$}  {:<w_case$}  {}\n",
            r.suite,
            r.case,
            if r.passed() { "PASS" } else { "FAIL" }
        ));
        for f in &r.failures {
            s.push_str(&format!("    - {f}\n"));
        }
    }
    let failed = rows.iter().filter(|r| !r.passed()).count();
    s.push_str(&format!(
        "{} cases, {} passed, {} failed\n",
        rows.len(),
        rows.len() - failed,
        failed
    ));
    s
}
