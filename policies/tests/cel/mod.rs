//! CEL conformance of the policy engine: the cel-spec "simple" suite and a table of the
//! Kubernetes CEL libraries, each case evaluated through both evaluators policies use (the
//! native evaluator with its hand-over to the interpreter, and the interpreter alone).
//!
//! Shared by `tests/cel_conformance.rs` (which fails when a case of the baseline stops
//! passing) and `examples/cel_conformance.rs` (which prints the table).
//!
//! The cel-spec data is not part of the repository: it is read from
//! `$HEARTH_CEL_SPEC_DIR`, else `../shared/conformance/cel-spec` next to the checkout, and both
//! the test and the example fail when it is not there ([`require_spec_dir`]).

#![allow(dead_code)]

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt::Write as _,
    path::{Path, PathBuf},
    sync::Arc,
};

use hearth_policies::expression::{Expression, Path as EvalPath};
use kube_cel::cel::{
    Value,
    objects::{Key, Map},
};
use prost_reflect::{DescriptorPool, DynamicMessage, MapKey, Value as Pv};

/// The environment variable naming the cel-spec conformance directory.
pub const SPEC_DIR_VAR: &str = "HEARTH_CEL_SPEC_DIR";

/// Where the cel-spec data is: `$HEARTH_CEL_SPEC_DIR`, else next to the checkout.
pub fn spec_dir() -> PathBuf {
    match std::env::var_os(SPEC_DIR_VAR) {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/conformance/cel-spec"),
    }
}

/// The cel-spec directory of [`spec_dir`] when it holds the conformance data (`proto/` and
/// `testdata/*.textproto`); else an error that says what is missing, where it looked (and
/// whether through `$HEARTH_CEL_SPEC_DIR`) and how to provide it.
pub fn require_spec_dir() -> Result<PathBuf, String> {
    let dir = spec_dir();
    let source = if std::env::var_os(SPEC_DIR_VAR).is_some() {
        format!("{SPEC_DIR_VAR} names it")
    } else {
        format!("{SPEC_DIR_VAR} is unset, so the default beside the checkout was used")
    };
    let fix = format!(
        "put the public cel-spec conformance data (the cel-spec repository's `proto/` and \
         `tests/simple/testdata/`, as `proto/` and `testdata/`) at \
         ../shared/conformance/cel-spec beside the checkout, or set {SPEC_DIR_VAR} to a \
         directory holding it"
    );
    let missing = if !dir.is_dir() {
        "no such directory".to_owned()
    } else if !dir.join("proto").is_dir() {
        "it has no proto/ directory".to_owned()
    } else {
        match std::fs::read_dir(dir.join("testdata")) {
            Err(e) => format!("its testdata/ directory cannot be read ({e})"),
            Ok(entries) => {
                let textprotos = entries
                    .filter_map(|e| e.ok())
                    .filter(|e| e.path().extension().is_some_and(|x| x == "textproto"))
                    .count();
                if textprotos > 0 {
                    return Ok(dir);
                }
                "its testdata/ directory has no .textproto files".to_owned()
            }
        }
    };
    Err(format!(
        "the cel-spec conformance data is missing at {} ({missing}; {source}): {fix}",
        dir.display()
    ))
}

/// The directory of this module's data (baseline, Kubernetes table).
pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cel")
}

/// What a case expects.
#[derive(Debug, Clone)]
pub enum Expect {
    Value(Value),
    /// Any evaluation error (messages are implementation-specific).
    Error,
}

/// One case to run.
#[derive(Debug, Clone)]
pub struct Case {
    /// `file/section/name`, unique.
    pub id: String,
    pub expr: String,
    pub bindings: Vec<(String, Value)>,
    pub expect: Expect,
}

/// A case, or why it does not apply.
#[derive(Debug, Clone)]
pub enum Item {
    Run(Case),
    Skip { id: String, reason: String },
}

/// The items of one file (or one library of the Kubernetes table).
#[derive(Debug, Clone)]
pub struct Group {
    pub name: String,
    pub items: Vec<Item>,
}

/// The outcome of one case.
#[derive(Debug, Clone)]
pub enum Status {
    /// Both evaluators gave the expected result; `native` when the native evaluator answered
    /// without handing over.
    Passed {
        native: bool,
    },
    Failed(String),
    Skipped(String),
}

#[derive(Debug, Clone)]
pub struct Result1 {
    pub id: String,
    pub status: Status,
}

#[derive(Debug, Clone)]
pub struct GroupResult {
    pub name: String,
    pub results: Vec<Result1>,
}

// ---------------------------------------------------------------------------------------------
// cel-spec

/// Files about protobuf messages and features outside admission, with the reason.
const NOT_APPLICABLE: &[(&str, &str)] = &[
    ("proto2", "protobuf message types (not in Kubernetes CEL)"),
    (
        "proto2_ext",
        "protobuf message types (not in Kubernetes CEL)",
    ),
    ("proto3", "protobuf message types (not in Kubernetes CEL)"),
    ("wrappers", "protobuf message types (not in Kubernetes CEL)"),
    ("enums", "protobuf message types (not in Kubernetes CEL)"),
    (
        "namespace",
        "containers and qualified message names (not in Kubernetes CEL)",
    ),
    (
        "type_deduction",
        "type-checker deductions (check only, no evaluation)",
    ),
    ("unknowns", "unknown values (partial evaluation)"),
    (
        "block_ext",
        "cel.@block (an optimizer's internal form, not written by hand)",
    ),
];

const MESSAGE_TYPES: &str = "protobuf message types (not in Kubernetes CEL)";

fn descriptor_pool(dir: &Path) -> Result<DescriptorPool, String> {
    let proto = dir.join("proto");
    let mut c = protox::Compiler::new([&proto]).map_err(|e| e.to_string())?;
    c.include_imports(true);
    c.open_files([
        "cel/expr/conformance/test/simple.proto",
        "cel/expr/conformance/proto2/test_all_types.proto",
        "cel/expr/conformance/proto2/test_all_types_extensions.proto",
        "cel/expr/conformance/proto3/test_all_types.proto",
    ])
    .map_err(|e| e.to_string())?;
    Ok(c.descriptor_pool())
}

fn field<'m>(m: &'m DynamicMessage, name: &str) -> Option<std::borrow::Cow<'m, Pv>> {
    m.has_field_by_name(name)
        .then(|| m.get_field_by_name(name))
        .flatten()
}

fn str_field(m: &DynamicMessage, name: &str) -> String {
    m.get_field_by_name(name)
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn bool_field(m: &DynamicMessage, name: &str) -> bool {
    m.get_field_by_name(name)
        .and_then(|v| v.as_bool())
        .unwrap_or(false)
}

fn messages(v: &Pv) -> Vec<DynamicMessage> {
    v.as_list()
        .map(|l| l.iter().filter_map(|x| x.as_message().cloned()).collect())
        .unwrap_or_default()
}

/// Why a value cannot be given to the engine.
#[derive(Debug)]
enum Unusable {
    /// A protobuf message other than the JSON-shaped well-known types.
    Message,
    /// Something the engine has no value for (a type value), with a description.
    Other(String),
}

/// A `cel.expr.Value` as the interpreter's value.
fn cel_value(pool: &DescriptorPool, v: &DynamicMessage) -> Result<Value, Unusable> {
    let f = |n: &str| field(v, n);
    if f("null_value").is_some() {
        return Ok(Value::Null);
    }
    if let Some(b) = f("bool_value") {
        return Ok(Value::Bool(b.as_bool().unwrap_or_default()));
    }
    if let Some(i) = f("int64_value") {
        return Ok(Value::Int(i.as_i64().unwrap_or_default()));
    }
    if let Some(u) = f("uint64_value") {
        return Ok(Value::UInt(u.as_u64().unwrap_or_default()));
    }
    if let Some(d) = f("double_value") {
        return Ok(Value::Float(d.as_f64().unwrap_or_default()));
    }
    if let Some(s) = f("string_value") {
        return Ok(Value::String(Arc::new(
            s.as_str().unwrap_or_default().to_owned(),
        )));
    }
    if let Some(b) = f("bytes_value") {
        return Ok(Value::Bytes(Arc::new(
            b.as_bytes().map(|b| b.to_vec()).unwrap_or_default(),
        )));
    }
    if let Some(e) = f("enum_value") {
        let m = e.as_message().ok_or(Unusable::Message)?;
        return Ok(Value::Int(
            m.get_field_by_name("value")
                .and_then(|v| v.as_i32())
                .unwrap_or_default()
                .into(),
        ));
    }
    if let Some(l) = f("list_value") {
        let m = l.as_message().ok_or(Unusable::Message)?;
        let items = m
            .get_field_by_name("values")
            .map(|v| messages(&v))
            .unwrap_or_default();
        return Ok(Value::List(Arc::new(
            items
                .iter()
                .map(|x| cel_value(pool, x))
                .collect::<Result<_, _>>()?,
        )));
    }
    if let Some(mv) = f("map_value") {
        let m = mv.as_message().ok_or(Unusable::Message)?;
        let mut out = HashMap::new();
        for e in m
            .get_field_by_name("entries")
            .map(|v| messages(&v))
            .unwrap_or_default()
        {
            let k = e
                .get_field_by_name("key")
                .and_then(|k| k.as_message().cloned())
                .ok_or(Unusable::Message)?;
            let key = match cel_value(pool, &k)? {
                Value::String(s) => Key::String(s),
                Value::Int(i) => Key::Int(i),
                Value::UInt(u) => Key::Uint(u),
                Value::Bool(b) => Key::Bool(b),
                other => return Err(Unusable::Other(format!("map key {other:?}"))),
            };
            let val = e
                .get_field_by_name("value")
                .and_then(|k| k.as_message().cloned())
                .ok_or(Unusable::Message)?;
            out.insert(key, cel_value(pool, &val)?);
        }
        return Ok(Value::Map(Map { map: Arc::new(out) }));
    }
    if let Some(t) = f("type_value") {
        return Ok(hearth_policies::expression::type_value(
            t.as_str().unwrap_or_default(),
        ));
    }
    if let Some(o) = f("object_value") {
        let any = o.as_message().ok_or(Unusable::Message)?;
        return any_value(pool, any);
    }
    Err(Unusable::Other("an empty value".into()))
}

/// A `google.protobuf.Any`: the JSON-shaped well-known types become values, other messages
/// are not applicable.
fn any_value(pool: &DescriptorPool, any: &DynamicMessage) -> Result<Value, Unusable> {
    let url = str_field(any, "type_url");
    let name = url.rsplit('/').next().unwrap_or_default();
    let bytes = any
        .get_field_by_name("value")
        .and_then(|v| v.as_bytes().cloned())
        .unwrap_or_default();
    let desc = pool.get_message_by_name(name).ok_or(Unusable::Message)?;
    let msg = DynamicMessage::decode(desc, bytes).map_err(|_| Unusable::Message)?;
    well_known(name, &msg)
}

fn well_known(name: &str, msg: &DynamicMessage) -> Result<Value, Unusable> {
    let get = |n: &str| msg.get_field_by_name(n).map(|v| v.into_owned());
    Ok(match name {
        "google.protobuf.Struct" => {
            let mut out = HashMap::new();
            if let Some(Pv::Map(m)) = get("fields") {
                for (k, v) in m {
                    let MapKey::String(k) = k else {
                        return Err(Unusable::Message);
                    };
                    let v = v.as_message().ok_or(Unusable::Message)?;
                    out.insert(
                        Key::String(Arc::new(k)),
                        well_known("google.protobuf.Value", v)?,
                    );
                }
            }
            Value::Map(Map { map: Arc::new(out) })
        }
        "google.protobuf.ListValue" => Value::List(Arc::new(
            get("values")
                .map(|v| messages(&v))
                .unwrap_or_default()
                .iter()
                .map(|x| well_known("google.protobuf.Value", x))
                .collect::<Result<_, _>>()?,
        )),
        "google.protobuf.Value" => {
            let f = |n: &str| field(msg, n).map(|v| v.into_owned());
            if let Some(v) = f("bool_value") {
                Value::Bool(v.as_bool().unwrap_or_default())
            } else if let Some(v) = f("number_value") {
                Value::Float(v.as_f64().unwrap_or_default())
            } else if let Some(v) = f("string_value") {
                Value::String(Arc::new(v.as_str().unwrap_or_default().to_owned()))
            } else if let Some(Pv::Message(m)) = f("struct_value") {
                well_known("google.protobuf.Struct", &m)?
            } else if let Some(Pv::Message(m)) = f("list_value") {
                well_known("google.protobuf.ListValue", &m)?
            } else {
                Value::Null
            }
        }
        "google.protobuf.Duration" | "google.protobuf.Timestamp" => {
            let secs = get("seconds").and_then(|v| v.as_i64()).unwrap_or_default();
            let nanos = get("nanos").and_then(|v| v.as_i32()).unwrap_or_default();
            if name.ends_with("Duration") {
                Value::Duration(chrono::Duration::new(secs, nanos as u32).ok_or(Unusable::Message)?)
            } else {
                Value::Timestamp(
                    chrono::DateTime::from_timestamp(secs, nanos as u32)
                        .ok_or(Unusable::Message)?
                        .fixed_offset(),
                )
            }
        }
        "google.protobuf.Int64Value" | "google.protobuf.Int32Value" => Value::Int(
            get("value")
                .and_then(|v| v.as_i64().or(v.as_i32().map(i64::from)))
                .unwrap_or_default(),
        ),
        "google.protobuf.UInt64Value" | "google.protobuf.UInt32Value" => Value::UInt(
            get("value")
                .and_then(|v| v.as_u64().or(v.as_u32().map(u64::from)))
                .unwrap_or_default(),
        ),
        "google.protobuf.DoubleValue" | "google.protobuf.FloatValue" => Value::Float(
            get("value")
                .and_then(|v| v.as_f64().or(v.as_f32().map(f64::from)))
                .unwrap_or_default(),
        ),
        "google.protobuf.BoolValue" => {
            Value::Bool(get("value").and_then(|v| v.as_bool()).unwrap_or_default())
        }
        "google.protobuf.StringValue" => Value::String(Arc::new(
            get("value")
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
        )),
        _ => return Err(Unusable::Message),
    })
}

/// Expressions naming protobuf messages, enums or well-known wrapper types.
fn names_messages(expr: &str) -> bool {
    [
        "TestAllTypes",
        "NestedMessage",
        "NestedEnum",
        "GlobalEnum",
        "TestRequired",
        "google.protobuf.",
        "cel.expr.",
        "proto2.",
        "proto3.",
    ]
    .iter()
    .any(|n| expr.contains(n))
}

/// Whether an expression constructs a message (`Name{...}`, a capitalized type name).
fn builds_message(expr: &str) -> bool {
    expr.contains("NullValue")
        || expr.match_indices('{').any(|(i, _)| {
            expr[..i]
                .trim_end()
                .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
                .next()
                .is_some_and(|name| name.starts_with(|c: char| c.is_ascii_uppercase()))
        })
}

fn prepare_test(pool: &DescriptorPool, file: &str, section: &str, t: &DynamicMessage) -> Item {
    let name = str_field(t, "name");
    let id = format!("{file}/{section}/{name}");
    let skip = |reason: &str| Item::Skip {
        id: id.clone(),
        reason: reason.to_owned(),
    };
    let expr = str_field(t, "expr");
    if bool_field(t, "check_only") {
        return skip("type check only (no evaluation)");
    }
    if field(t, "unknown").is_some() || field(t, "any_unknowns").is_some() {
        return skip("unknown values (partial evaluation)");
    }
    // A container resolves message names: `Value{...}` in `google.protobuf`.
    if names_messages(&expr) || (!str_field(t, "container").is_empty() && builds_message(&expr)) {
        return skip(MESSAGE_TYPES);
    }
    let mut bindings = Vec::new();
    if let Some(Pv::Map(b)) = t.get_field_by_name("bindings").map(|v| v.into_owned()) {
        let mut b: Vec<_> = b.into_iter().collect();
        b.sort_by(|x, y| format!("{:?}", x.0).cmp(&format!("{:?}", y.0)));
        for (k, v) in b {
            let MapKey::String(k) = k else { continue };
            let Some(ev) = v.as_message() else { continue };
            let Some(val) = field(ev, "value").and_then(|v| v.as_message().cloned()) else {
                return skip("error or unknown values as bindings");
            };
            match cel_value(pool, &val) {
                Ok(v) => bindings.push((k, v)),
                Err(Unusable::Message) => return skip(MESSAGE_TYPES),
                Err(Unusable::Other(_)) => return skip("type values as bindings"),
            }
        }
    }
    let expect = if let Some(v) = field(t, "value") {
        match v.as_message().map(|m| cel_value(pool, m)) {
            Some(Ok(v)) => Expect::Value(v),
            Some(Err(Unusable::Message)) => return skip(MESSAGE_TYPES),
            Some(Err(Unusable::Other(what))) => {
                // Kept as a case: the engine has no type values, which is a gap.
                return Item::Run(Case {
                    id,
                    expr,
                    bindings,
                    expect: Expect::Value(Value::String(Arc::new(format!("<{what}>")))),
                });
            }
            None => return skip("malformed"),
        }
    } else if let Some(tr) = field(t, "typed_result") {
        let Some(r) = tr
            .as_message()
            .and_then(|m| m.get_field_by_name("result").map(|v| v.into_owned()))
            .and_then(|v| v.as_message().cloned())
        else {
            return skip("malformed");
        };
        match cel_value(pool, &r) {
            Ok(v) => Expect::Value(v),
            Err(Unusable::Message) => return skip(MESSAGE_TYPES),
            Err(Unusable::Other(_)) => return skip("type values"),
        }
    } else if field(t, "eval_error").is_some() || field(t, "any_eval_errors").is_some() {
        Expect::Error
    } else {
        Expect::Value(Value::Bool(true))
    };
    Item::Run(Case {
        id,
        expr,
        bindings,
        expect,
    })
}

/// Reads every `testdata/*.textproto` under `dir`, in name order.
pub fn load_spec(dir: &Path) -> Result<Vec<Group>, String> {
    let pool = descriptor_pool(dir)?;
    let desc = pool
        .get_message_by_name("cel.expr.conformance.test.SimpleTestFile")
        .ok_or("SimpleTestFile is not in the .proto files")?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("testdata"))
        .map_err(|e| format!("{}: {e}", dir.join("testdata").display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "textproto"))
        .collect();
    files.sort();
    let mut groups = Vec::new();
    for path in files {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_owned();
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let file = DynamicMessage::parse_text_format(desc.clone(), &text)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let not_applicable = NOT_APPLICABLE.iter().find(|(n, _)| *n == name);
        let mut items = Vec::new();
        for s in file
            .get_field_by_name("section")
            .map(|v| messages(&v))
            .unwrap_or_default()
        {
            let section = str_field(&s, "name");
            for t in s
                .get_field_by_name("test")
                .map(|v| messages(&v))
                .unwrap_or_default()
            {
                items.push(match not_applicable {
                    Some((_, reason)) => Item::Skip {
                        id: format!("{name}/{section}/{}", str_field(&t, "name")),
                        reason: (*reason).to_owned(),
                    },
                    None => prepare_test(&pool, &name, &section, &t),
                });
            }
        }
        groups.push(Group { name, items });
    }
    Ok(groups)
}

// ---------------------------------------------------------------------------------------------
// Kubernetes libraries

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Library {
    library: String,
    cases: Vec<LibraryCase>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LibraryCase {
    expr: String,
    #[serde(default)]
    value: Option<serde_json::Value>,
    #[serde(default)]
    error: bool,
}

/// The Kubernetes library table (`tests/cel/kubernetes.yaml`), one group per library.
pub fn load_kubernetes() -> Result<Vec<Group>, String> {
    let path = data_dir().join("kubernetes.yaml");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let libs: Vec<Library> =
        serde_yaml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(libs
        .into_iter()
        .map(|l| Group {
            name: format!("k8s {}", l.library),
            items: l
                .cases
                .into_iter()
                .map(|c| {
                    Item::Run(Case {
                        id: format!("kubernetes/{}/{}", l.library, c.expr),
                        expect: if c.error {
                            Expect::Error
                        } else {
                            Expect::Value(hearth_policies::value::json_to_cel(
                                &c.value.unwrap_or(serde_json::Value::Bool(true)),
                            ))
                        },
                        expr: c.expr,
                        bindings: Vec::new(),
                    })
                })
                .collect(),
        })
        .collect())
}

// ---------------------------------------------------------------------------------------------
// Running

/// Exact equality of results: same type, NaN matches NaN, maps in any order.
fn same(want: &Value, got: &Value) -> bool {
    match (want, got) {
        (Value::Float(a), Value::Float(b)) => a == b || (a.is_nan() && b.is_nan()),
        (Value::List(a), Value::List(b)) => {
            a.len() == b.len() && a.iter().zip(b.iter()).all(|(x, y)| same(x, y))
        }
        (Value::Map(a), Value::Map(b)) => {
            a.map.len() == b.map.len()
                && a.map
                    .iter()
                    .all(|(k, v)| b.map.get(k).is_some_and(|w| same(v, w)))
        }
        (Value::String(a), Value::String(b)) => a == b,
        (Value::Bytes(a), Value::Bytes(b)) => a == b,
        (Value::Int(a), Value::Int(b)) => a == b,
        (Value::UInt(a), Value::UInt(b)) => a == b,
        (Value::Bool(a), Value::Bool(b)) => a == b,
        (Value::Null, Value::Null) => true,
        (Value::Duration(a), Value::Duration(b)) => a == b,
        (Value::Timestamp(a), Value::Timestamp(b)) => a == b,
        (Value::Opaque(_), Value::Opaque(_)) => want == got,
        _ => false,
    }
}

fn short(v: &Value) -> String {
    let s = format!("{v:?}");
    if s.len() > 120 {
        format!(
            "{}…",
            &s[..s.char_indices().nth(118).map_or(s.len(), |(i, _)| i)]
        )
    } else {
        s
    }
}

fn check(expect: &Expect, got: &Result<Value, String>) -> Result<(), String> {
    match (expect, got) {
        (Expect::Error, Err(_)) => Ok(()),
        (Expect::Error, Ok(v)) => Err(format!("expected an error, got {}", short(v))),
        (Expect::Value(w), Ok(v)) if same(w, v) => Ok(()),
        (Expect::Value(w), Ok(v)) => Err(format!("expected {}, got {}", short(w), short(v))),
        (Expect::Value(w), Err(e)) => Err(format!("expected {}, got error: {e}", short(w))),
    }
}

/// Runs one case through both evaluators.
pub fn run_case(c: &Case) -> Status {
    let names: Vec<String> = c.bindings.iter().map(|(n, _)| n.clone()).collect();
    let values: Vec<Value> = c.bindings.iter().map(|(_, v)| v.clone()).collect();
    let compiled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Expression::compile(&c.expr, &names)
    }));
    let expr = match compiled {
        Err(_) => return Status::Failed("the parser panicked".into()),
        // The apiserver also rejects expressions that do not check when they are created.
        Ok(Err(_)) if matches!(c.expect, Expect::Error) => return Status::Passed { native: false },
        Ok(Err(e)) => return Status::Failed(format!("load error: {e}")),
        Ok(Ok(e)) => e,
    };
    let mut native = false;
    for path in [EvalPath::Engine, EvalPath::Interpreter] {
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            expr.evaluate(&values, path)
        }));
        let Ok(got) = got else {
            return Status::Failed(format!("{path:?}: panicked"));
        };
        if path == EvalPath::Engine {
            native = got.native;
        }
        if let Err(why) = check(&c.expect, &got.result) {
            return Status::Failed(format!("{path:?}: {why}"));
        }
    }
    Status::Passed { native }
}

/// Runs every case of the groups.
pub fn run_groups(groups: &[Group]) -> Vec<GroupResult> {
    groups
        .iter()
        .map(|g| GroupResult {
            name: g.name.clone(),
            results: g
                .items
                .iter()
                .map(|i| match i {
                    Item::Run(c) => Result1 {
                        id: c.id.clone(),
                        status: run_case(c),
                    },
                    Item::Skip { id, reason } => Result1 {
                        id: id.clone(),
                        status: Status::Skipped(reason.clone()),
                    },
                })
                .collect(),
        })
        .collect()
}

/// Runs everything on a thread with a large stack (the parser recurses per grammar rule).
pub fn run_all(groups: Vec<Group>) -> Vec<GroupResult> {
    // Panics inside the evaluators are caught and counted as failures; keep them quiet.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let results = std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(move || run_groups(&groups))
        .expect("thread starts")
        .join()
        .expect("runner thread");
    std::panic::set_hook(hook);
    results
}

#[derive(Default, Clone, Copy)]
struct Counts {
    run: usize,
    passed: usize,
    native: usize,
    failed: usize,
    skipped: usize,
}

impl Counts {
    fn add(&mut self, s: &Status) {
        match s {
            Status::Passed { native } => {
                self.run += 1;
                self.passed += 1;
                self.native += usize::from(*native);
            }
            Status::Failed(_) => {
                self.run += 1;
                self.failed += 1;
            }
            Status::Skipped(_) => self.skipped += 1,
        }
    }
}

/// The table: per group and in total, run, passed, failed, skipped (with the reasons); with
/// `failures`, every failed case and why.
pub fn render(results: &[GroupResult], failures: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| file | run | passed | failed | skipped | pass rate | answered natively |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    let mut total = Counts::default();
    let mut reasons: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for g in results {
        let mut c = Counts::default();
        for r in &g.results {
            c.add(&r.status);
            total.add(&r.status);
            if let Status::Skipped(why) = &r.status {
                *reasons
                    .entry(why.clone())
                    .or_default()
                    .entry(g.name.clone())
                    .or_default() += 1;
            }
        }
        row(&mut out, &g.name, c);
    }
    row(&mut out, "**total**", total);
    if !reasons.is_empty() {
        let _ = writeln!(out, "\nSkipped:");
        for (why, groups) in &reasons {
            let list: Vec<String> = groups.iter().map(|(g, n)| format!("{g} {n}")).collect();
            let _ = writeln!(out, "- {why}: {}", list.join(", "));
        }
    }
    if failures {
        let _ = writeln!(out, "\nFailed:");
        for g in results {
            for r in &g.results {
                if let Status::Failed(why) = &r.status {
                    let _ = writeln!(out, "- {}: {why}", r.id);
                }
            }
        }
    }
    out
}

fn row(out: &mut String, name: &str, c: Counts) {
    let rate = if c.run == 0 {
        "–".to_owned()
    } else {
        format!("{:.1} %", 100.0 * c.passed as f64 / c.run as f64)
    };
    let _ = writeln!(
        out,
        "| {name} | {} | {} | {} | {} | {rate} | {} |",
        c.run, c.passed, c.failed, c.skipped, c.native
    );
}

/// Names of the passing cases.
pub fn passing(results: &[GroupResult]) -> BTreeSet<String> {
    results
        .iter()
        .flat_map(|g| &g.results)
        .filter(|r| matches!(r.status, Status::Passed { .. }))
        .map(|r| r.id.clone())
        .collect()
}
