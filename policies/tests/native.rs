//! Differential tests: the native evaluator and the `cel` interpreter give the same outcome.
//!
//! Every shipped policy (built-ins, examples, the benchmark's platform policies) over the
//! shipped resources and randomly damaged variants of them, and a table of expressions that
//! reach each native operator and function, including their error and edge cases.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};

use common::{deployment, policy, set};
use hearth_crds::servingpolicy::Operation;
use hearth_policies::{EvalInput, Outcome, PolicySet, manifest};
use proptest::prelude::*;
use serde_json::{Value, json};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn load(paths: &[PathBuf]) -> manifest::Bundle {
    let mut b = manifest::Bundle::default();
    for p in paths {
        manifest::read_path(p, &mut b).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
    b
}

/// Every shipped policy and runtime, and the shipped resources.
struct Shipped {
    set: PolicySet,
    params: Vec<Option<Value>>,
    resources: Vec<Value>,
}

fn shipped() -> Shipped {
    let r = root();
    let examples = r.join("../examples");
    let dirs = ["ascend", "cambricon", "hami", "native", "runtimes"];
    let mut paths = vec![r.join("builtin"), r.join("benches/platform-policies.yaml")];
    paths.extend(dirs.iter().map(|d| examples.join(d)));
    let policies = load(&paths);
    let mut runtime_paths = vec![r.join("builtin/tests/runtimes")];
    runtime_paths.extend(dirs.iter().map(|d| examples.join(d)));
    let runtimes = load(&runtime_paths).runtimes;
    let mut resource_paths = vec![r.join("builtin/tests/resources")];
    resource_paths.extend(dirs.iter().map(|d| examples.join(d).join("resources")));
    let resources = load(&resource_paths);
    let (set, errors) = PolicySet::compile(&policies.policies);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(
        set.native_policies().len() == set.names().len(),
        "every shipped policy runs natively: {:?} of {:?}",
        set.native_policies(),
        set.names()
    );
    let mut params: Vec<Option<Value>> = runtimes
        .iter()
        .map(|rt| Some(manifest::runtime_params(rt)))
        .collect();
    params.push(None);
    let resources: Vec<Value> = resources
        .objects
        .into_iter()
        .chain(
            resources
                .services
                .iter()
                .map(|s| serde_json::to_value(s).unwrap()),
        )
        .collect();
    assert!(resources.len() >= 10, "{} resources", resources.len());
    Shipped {
        set,
        params,
        resources,
    }
}

/// The outcome as JSON, with the interpreter's renderings of maps in messages put in key
/// order: they follow hash order, which changes from run to run.
fn outcome_json(o: &Outcome) -> Value {
    let mut v = serde_json::to_value(o).expect("outcome serializes");
    canonical_strings(&mut v);
    v
}

fn canonical_strings(v: &mut Value) {
    match v {
        Value::String(s) => *s = canonical_maps(s),
        Value::Array(a) => a.iter_mut().for_each(canonical_strings),
        Value::Object(m) => m.values_mut().for_each(canonical_strings),
        _ => {}
    }
}

/// Sorts the entries of every `map: {k: v, ...}` in a `Debug` rendering.
fn canonical_maps(s: &str) -> String {
    const OPEN: &str = "map: {";
    let Some(start) = s.find(OPEN) else {
        return s.to_owned();
    };
    let body_start = start + OPEN.len();
    let bytes = s.as_bytes();
    let (mut depth, mut end, mut cuts) = (0i32, None, vec![body_start]);
    let mut quoted = false;
    for (i, &c) in bytes.iter().enumerate().skip(body_start) {
        match c {
            b'"' if i == 0 || bytes[i - 1] != b'\\' => quoted = !quoted,
            _ if quoted => {}
            b'{' | b'(' | b'[' => depth += 1,
            b'}' | b')' | b']' if depth == 0 => {
                end = Some(i);
                break;
            }
            b'}' | b')' | b']' => depth -= 1,
            b',' if depth == 0 => cuts.push(i + 1),
            _ => {}
        }
    }
    let Some(end) = end else {
        return s.to_owned();
    };
    cuts.push(end + 1);
    let mut entries: Vec<String> = cuts
        .windows(2)
        .map(|w| canonical_maps(s[w[0]..w[1] - 1].trim()))
        .collect();
    entries.sort();
    format!(
        "{}{}{}",
        &s[..body_start],
        entries.join(", "),
        canonical_maps(&s[end..])
    )
}

/// Whether the interpreter can produce `native`'s outcome for `input`. Its renderings of maps
/// in messages (kube-cel's `join` of non-strings, for one) follow hash order, which changes
/// from run to run, so a difference is retried before it counts.
fn interpreter_agrees(set: &PolicySet, input: &EvalInput, native: &Value) -> Result<(), Value> {
    let interpreted = set.interpreted();
    let mut last = Value::Null;
    for _ in 0..24 {
        last = outcome_json(&interpreted.evaluate(input));
        if &last == native {
            return Ok(());
        }
    }
    Err(last)
}

/// Evaluates `input` natively and with the interpreter only; panics on any difference.
fn agree(set: &PolicySet, input: &EvalInput) -> Outcome {
    let native = set.evaluate(input);
    let json = outcome_json(&native);
    if let Err(interpreted) = interpreter_agrees(set, input, &json) {
        assert_eq!(
            json,
            interpreted,
            "native and interpreter disagree on {}",
            serde_json::to_string(&input.object).unwrap()
        );
    }
    native
}

fn inputs(object: &Value, params: &Option<Value>) -> Vec<EvalInput> {
    let mut create = EvalInput::for_object(object.clone(), Operation::Create);
    create.params = params.clone();
    let mut update = EvalInput::for_object(object.clone(), Operation::Update);
    update.params = params.clone();
    update.old_object = Some(object.clone());
    let mut delete = EvalInput::for_object(object.clone(), Operation::Delete);
    delete.old_object = delete.object.take();
    delete.params = params.clone();
    // Each once without settings and once with the drain image (the sidecar branch).
    let with_settings: Vec<EvalInput> = [&create, &update, &delete]
        .into_iter()
        .map(|i| {
            let mut i = i.clone();
            i.settings =
                Some(serde_json::json!({"drainImage": "registry.example/hearth-gateway:v1"}));
            i
        })
        .collect();
    let mut all = vec![create, update, delete];
    all.extend(with_settings);
    all
}

#[test]
fn shipped_policies_agree_on_shipped_resources() {
    let s = shipped();
    let before = PolicySet::native_fallbacks();
    let mut evaluated = 0u64;
    for object in &s.resources {
        for params in &s.params {
            for input in inputs(object, params) {
                agree(&s.set, &input);
                evaluated += 1;
            }
        }
    }
    assert!(evaluated > 100, "{evaluated}");
    // Most policies ran natively end to end. The rest failed for real and were evaluated again
    // by the interpreter for its error: the platform policies read `spec.template` and
    // `spec.replicas`, which Pods and LLMServices lack, and some resources carry bad
    // annotations on purpose.
    let fallbacks = PolicySet::native_fallbacks() - before;
    let policy_runs = evaluated * s.set.names().len() as u64;
    assert!(
        fallbacks * 8 < policy_runs,
        "{fallbacks} fallbacks in {policy_runs} policy evaluations"
    );
}

#[test]
fn a_well_formed_workload_never_falls_back() {
    let s = shipped();
    let rt = s.params[0].clone();
    let before = PolicySet::native_fallbacks();
    for input in inputs(&deployment(), &rt) {
        agree(&s.set, &input);
    }
    assert_eq!(PolicySet::native_fallbacks(), before);
}

/// The value of `hearth_policy_native_fallbacks_total{reason="<reason>"}` in `text`.
fn rendered_fallbacks(text: &str, reason: &str) -> u64 {
    let prefix = format!("hearth_policy_native_fallbacks_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {reason} counter in:\n{text}"))
}

#[test]
fn a_fallback_is_counted_for_the_process_and_rendered() {
    use hearth_policies::fallback::{self, Reason};
    use prometheus_client::{encoding::text::encode, registry::Registry};

    let mut registry = Registry::default();
    registry.register_collector(Box::new(fallback::Collector));
    let render = || {
        let mut text = String::new();
        encode(&mut text, &registry).expect("renders");
        text
    };
    let text = render();
    assert!(
        text.contains("# TYPE hearth_policy_native_fallbacks counter"),
        "{text}"
    );
    let before = rendered_fallbacks(&text, "unsupported");
    let panics = rendered_fallbacks(&text, "panic");

    // A missing field is an error: the native evaluator hands the policy to the interpreter,
    // which words it.
    let s = set(vec![policy(
        "falls-back",
        json!({"validations": [{"expression": "object.spec.missing == 1"}]}),
    )]);
    assert_eq!(s.native_policies(), ["falls-back"]);
    let on_thread = PolicySet::native_fallbacks();
    let out = s.evaluate(&EvalInput::for_object(deployment(), Operation::Create));
    assert_eq!(out.errors.len(), 1, "{out:?}");
    assert_eq!(PolicySet::native_fallbacks(), on_thread + 1);
    assert!(fallback::total(Reason::Unsupported) > before);

    let text = render();
    assert!(rendered_fallbacks(&text, "unsupported") > before, "{text}");
    assert!(rendered_fallbacks(&text, "panic") >= panics, "{text}");
}

/// Damage to apply to a resource: (JSON pointer of an existing field, replacement).
fn damage() -> impl Strategy<Value = Vec<(usize, Value)>> {
    let values = prop_oneof![
        Just(Value::Null),
        Just(json!("")),
        Just(json!("abc")),
        Just(json!("90s")),
        Just(json!("1.5h")),
        Just(json!("-3")),
        Just(json!("2")),
        Just(json!("500m")),
        Just(json!("1.5Gi")),
        Just(json!("1e3")),
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(3)),
        Just(json!(1.5)),
        Just(json!(true)),
        Just(json!([])),
        Just(json!({})),
        Just(json!([{"name": "x"}])),
        Just(
            json!({"serving.hearth.dev/accelerators": "2", "serving.hearth.dev/drain-timeout": "45s"})
        ),
        Just(json!({"serving.hearth.dev/container": "nope"})),
    ];
    proptest::collection::vec((0usize..10_000, values), 1..4)
}

fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    out.push(at.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                pointers(
                    x,
                    format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, .. ProptestConfig::default() })]

    /// Damaged workloads (fields of the wrong type, removed, odd annotation values) get the
    /// same outcome both ways, whether the native evaluator answers or falls back.
    #[test]
    fn shipped_policies_agree_on_damaged_resources(
        which in 0usize..1000,
        rt in 0usize..100,
        changes in damage(),
    ) {
        thread_local! {
            static SHIPPED: Shipped = shipped();
        }
        SHIPPED.with(|s| {
            let mut object = s.resources[which % s.resources.len()].clone();
            for (at, value) in changes {
                let mut all = Vec::new();
                pointers(&object, String::new(), &mut all);
                // Keep the identity so the resource still reaches the policies.
                all.retain(|p| !p.is_empty() && !["/apiVersion", "/kind", "/metadata", "/metadata/name", "/metadata/namespace"].contains(&p.as_str()));
                if all.is_empty() {
                    continue;
                }
                let p = &all[at % all.len()];
                if let Some(slot) = object.pointer_mut(p) {
                    *slot = value;
                }
            }
            let params = &s.params[rt % s.params.len()];
            for input in inputs(&object, params) {
                agree(&s.set, &input);
            }
        });
    }
}

/// Every native operator and function, on values and on the edge cases where it must give
/// the interpreter's error or hand over to it.
const EXPRESSIONS: &[&str] = &[
    // literals, arithmetic, overflow and division errors
    "1 + 2 * 3 - 4 / 2 % 3",
    "9223372036854775807 + 1",
    "-9223372036854775807 - 2",
    "1 / 0",
    "1 % 0",
    "5u + 3u",
    "3u - 5u",
    "1.5 + 2.25",
    "1 + 1u",
    "-(1)",
    "-(1.5)",
    "-'a'",
    // strings and lists
    "'ab' + 'cd'",
    "size('héllo')",
    "size([1, 2]) + size({'a': 1})",
    "size(object.metadata.labels)",
    "object.metadata.name.size()",
    "[1, 2] + [3]",
    "[1] + 'a'",
    "'abc'.contains('b') && 'abc'.startsWith('ab') && 'abc'.endsWith('bc')",
    "'ABC'.lowerAscii() + 'def'.upperAscii()",
    "['a', 'b'].join('/')",
    "['a', 'b'].join()",
    "['a', 1].join(',')",
    "jsonpatch.escapeKey('a/b~c')",
    "string(1) + string(2u) + string('x')",
    "string(1.5)",
    "string(true)",
    "int('42') + int(7)",
    "int('4x')",
    "int(2.5)",
    "'abc'.matches('^a.c$')",
    "'abc'.matches(object.metadata.name)",
    // equality, ordering, membership
    "1 == 1 && 1 != 2 && 'a' == 'a' && null == null",
    "1 == 1u",
    "1 == 1.0",
    "1 == 'a'",
    "[1, 2] == [1, 2] && {'a': 1} == {'a': 1} && [1] != [2]",
    "object.metadata.labels == {'app': 'llm'}",
    "object.spec.template.spec.containers[0].ports == [{'name': 'http', 'containerPort': 8000}]",
    "1 < 2 && 2 <= 2 && 3 > 2 && 3 >= 3 && 'a' < 'b'",
    "1 < 2u",
    "1.0 < 2",
    "true < false",
    "'app' in object.metadata.labels && 2 in [1, 2] && !(3 in [1, 2])",
    "1 in ['1']",
    "1u in [1]",
    "'x' in 'xyz'",
    // selection, presence, indexing
    "object.spec.replicas",
    "object.spec.missing",
    "has(object.spec.replicas) && !has(object.spec.missing)",
    "has(object.spec.replicas.x)",
    "object.spec.replicas.x",
    "object.spec.template.spec.containers[0].name",
    "object.spec.template.spec.containers[5]",
    "object.spec.template.spec.containers[-1]",
    "object.spec.template.spec.containers[0u]",
    "object.metadata.labels['app']",
    "object.metadata.labels['missing']",
    "params.spec.accelerator.resourceName",
    "params == null",
    "request.operation + '/' + request.kind.kind",
    "oldObject == null && namespaceObject == null && service == null",
    // logic and its error absorption
    "true && false || true",
    "1 / 0 == 1 || true",
    "true || 1 / 0 == 1",
    "false && 1 / 0 == 1",
    "1 / 0 == 1 && false",
    "1 / 0 == 1 && true",
    "1 && true",
    "!true || !false",
    "!1",
    "true ? 'a' : 'b'",
    "1 ? 'a' : 'b'",
    // comprehensions
    "[1, 2, 3].all(x, x > 0) && [1, 2, 3].exists(x, x == 2) && [1, 2, 3].exists_one(x, x > 2)",
    "[1, 2, 3].map(x, x * 2)",
    "[1, 2, 3].map(x, x > 1, x * 10)",
    "[1, 2, 3].filter(x, x % 2 == 1)",
    "{'a': 1, 'b': 2}.filter(k, k != 'a')",
    "object.metadata.labels.all(k, k.size() > 0)",
    "[[1, 2], [3]].map(l, l.map(x, x + 1))",
    "[1, 2].all(x, x / 0 == 1)",
    "[1, 0].exists(x, 1 / x == 1)",
    "[0, 1].exists(x, 1 / x == 1)",
    "lists.range(4).filter(i, i > 1)",
    "lists.range(-1)",
    "math.greatest([3, 9, 2]) + math.least(4, 1, 7)",
    "math.greatest(1, 2.5)",
    "math.greatest([])",
    // maps and messages
    "{'a': 1, 'b': [true, null]}",
    "{'a': 1, 'a': 2}",
    "{1: 'a'}",
    "JSONPatch{op: 'add', path: '/x', value: 1}",
    "Object{metadata: Object.metadata{labels: {'a': 'b'}}}",
    // durations and quantities
    "duration('1h30m').getSeconds()",
    "duration('1.5s').getSeconds()",
    "duration('bogus')",
    "string(duration('90s'))",
    "quantity('1.5Gi').compareTo(quantity('1536Mi'))",
    "quantity('500m').isLessThan(quantity('1')) && quantity('2k').isGreaterThan(quantity('1999'))",
    "quantity('1e3').compareTo(quantity('1k'))",
    "quantity('-1').isLessThan(quantity('0'))",
    "quantity('.5').compareTo(quantity('500m'))",
    "quantity('bogus')",
    "quantity('1').compareTo(2)",
    "quantity('100000000000000000000000000000Ei').compareTo(quantity('1'))",
    "quantity('1Gi').asInteger()",
    "quantity('1.5').add(quantity('500m')).isInteger()",
    "quantity('1') == quantity('1')",
    // foreign calls: functions the native evaluator leaves to the interpreter
    "'a,b'.split(',')",
    "'  x '.trim()",
    "url('https://example.com/a').getHost()",
    "'%s-%d'.format(['a', 1])",
    "ip('10.0.0.1').family()",
    "[3, 1, 2].sort()",
    "'abc'.indexOf('c')",
    "'abc'.reverse()",
    "sets.contains([1, 2], [1])",
    "[1, 2].sum()",
    "optional.of(1).hasValue()",
    "object.?spec.?missing.orValue('d')",
    "timestamp('2024-01-02T03:04:05Z').getHours()",
    "b'abc'",
    // numbers across types, sizes in code points
    "1 == 1.0 && 1u == 1 && 2.0 != 3u && [1, 2u] == [1.0, 2]",
    "{'a': 1} == {'a': 1.0}",
    "1 < 2u && 2.5 > 2 && 3u >= 3.0 && -1 < 0u && 18446744073709551615u > 1",
    "1 in [1.0, 2u] && !(3u in [1, 2])",
    "'a' < 1",
    "null < null",
    "true > false",
    "object.spec.replicas == 1.0",
    "'héllo'.size() + size('日本')",
    "bool('true') && !bool('f')",
    "bool('maybe')",
    "dyn(1) == 1u",
    // cel.bind and two-variable comprehensions
    "cel.bind(n, object.metadata.name, n + '-' + n)",
    "cel.bind(a, 1, cel.bind(b, a + 1, [a, b]))",
    "cel.bind(x, 1 / 0, true)",
    "object.metadata.labels.all(k, v, k != v)",
    "[1, 2, 3].exists(i, x, i == 1 && x == 2)",
    "[1, 2, 3].existsOne(i, x, x > i)",
    "[1, 2, 3].transformList(i, x, i + x)",
    "[1, 2, 3].transformList(i, x, i > 0, x * 10)",
    "{'a': 1, 'b': 2}.transformMap(k, v, v * 2)",
    "{'a': 1, 'b': 2}.transformMap(k, v, k != 'a', k + string(v))",
    "object.spec.template.spec.containers.transformList(i, c, c.name + string(i))",
    // types, optional chains, indexing and selection
    "type(object) == map && type(1) == int && type('a') != int && type(type(1)) == type",
    "object.metadata.?labels.?app.orValue('none') + object.?spec.?missing.orValue('-')",
    "optional.of(object.metadata).name.orValue('')",
    "has(object.metadata.?labels.app) && !has(object.?status.phase)",
    "{'a': 1}[?'b'].hasValue() || {'a': 1}[?'a'].value() == 1",
    "optional.of(2).optMap(x, x + 1).value() + optional.none().optFlatMap(x, optional.of(x)).orValue(0)",
    "[1, 2][1.0] + [1, 2][0u] + {1: 10}[1u] + {1u: 5}[1.0]",
    "[1, 2][2]",
    "{'a': 1}['b']",
    "object.spec.replicas.x",
    "has(object.spec.replicas.x)",
    "{1: 'a', 1u: 'b'}",
    "{'a': 1, 'b': 2}",
    // cel-go's forms of conversions, bit operations, named formats
    "string(timestamp('2024-01-02T03:04:05Z')) + ' ' + string(duration('1h1m'))",
    "int(timestamp('2024-01-02T03:04:05Z'))",
    "int(1e19)",
    "string(b'\\xff')",
    "math.bitShiftRight(-1024, 3) + math.bitShiftLeft(1, 64)",
    "math.bitAnd(6u, 3u) == 2u && math.bitNot(0) == -1",
    "format.named('dns1123Label').hasValue() && !format.named('nope').hasValue()",
    // errors absorbed by the element that decides; negation; conversions
    "[1, 2, 3].all(e, 6 / (2 - e) == 6)",
    "[3, 2, 1].exists(e, 6 / (2 - e) == -6)",
    "[1, 2, 3].all(i, v, 6 / (2 - v) == i)",
    "[2, 2].all(e, 6 / (2 - e) == 6)",
    "-false",
    "-(-9223372036854775807 - 1)",
    "timestamp(0) < timestamp(1) && duration(duration('1s')) == duration('1s')",
    "{1: 1.0, 2u: 3u} == {1u: 1, 2: 3.0}",
    // string methods' arguments checked
    "'tacocat'.indexOf('a', 30)",
    "'tacocat'.lastIndexOf('a', 3) + 'tacocat'.indexOf('a', 2)",
    "'42'.replace('2', '1', '1')",
    "'a,b,c'.split(',', 2).size() + 'hello'.substring(1, 3).size()",
    "[1, 2, 1].lastIndexOf(1)",
    "'%s %s %d %.1f'.format([[1, 'a'], {'b': duration('90s')}, double('NaN'), 2.25])",
    // time arithmetic and ranges
    "duration('120s') + timestamp('2009-02-13T23:01:00Z') == timestamp('2009-02-13T23:03:00Z')",
    "timestamp('9999-12-31T23:59:59Z') - timestamp('0001-01-01T00:00:00Z')",
    "duration('320000000000s')",
    "duration('1.5s').getMilliseconds() + timestamp('2024-01-02T03:04:05.678Z').getMilliseconds()",
    // timestamp getters in UTC, a named time zone or a fixed offset
    "timestamp('2009-02-13T23:31:30Z').getHours('America/Los_Angeles') + timestamp('2009-02-13T23:31:30Z').getDate('Australia/Sydney')",
    "timestamp('2009-02-13T02:00:00Z').getDayOfMonth('-02:30') * 100 + timestamp('2009-02-13T23:31:30Z').getHours('02:00')",
    "[timestamp('2024-07-01T12:00:00Z').getHours('Europe/Paris'), timestamp('2009-02-14T00:31:30+01:00').getDayOfWeek(), duration('25h').getHours()]",
    "timestamp('2009-02-13T23:31:30Z').getMinutes('Mars/Olympus')",
    "timestamp('2009-02-13T23:31:30Z').getMinutes('+x:00')",
    "duration('25h').getHours('UTC')",
    "type(ip('10.0.0.1')) == net.IP && type(optional.none()) == optional_type",
    "3 - 1 + 2.5 - 0.5",
];

#[test]
fn expressions_agree() {
    let rt = shipped().params[0].clone();
    let mut differences = Vec::new();
    let mut native = 0;
    for (i, e) in EXPRESSIONS.iter().enumerate() {
        // The value, through a mutation (errors and JSON form compared), and the
        // expression as a validation (booleans, wrong-type errors compared).
        let p = policy(
            &format!("e{i}"),
            json!({
                "failurePolicy": "Fail",
                "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression":
                    format!("[JSONPatch{{op: 'add', path: '/metadata/labels/v', value: {e}}}]")}}],
                "validations": [{"expression": e}],
            }),
        );
        let s = set(vec![p]);
        native += s.native_policies().len();
        let mut input = EvalInput::for_object(deployment(), Operation::Create);
        input.params = rt.clone();
        let a = outcome_json(&s.evaluate(&input));
        if let Err(b) = interpreter_agrees(&s, &input, &a) {
            differences.push(format!("{e}\n  native:      {a}\n  interpreter: {b}"));
        }
    }
    assert!(differences.is_empty(), "{}", differences.join("\n"));
    // Most of the table compiles natively (optional syntax and bytes do not).
    assert!(native > EXPRESSIONS.len() * 9 / 10, "{native}");
}

#[test]
fn a_bound_is_enforced_natively_too() {
    // The native evaluator charges the same budget: a quadratic blow-up stops.
    let s = set(vec![policy(
        "big",
        json!({"validations": [{"expression":
            "lists.range(1000).map(a, lists.range(1000).map(b, a + b)).size() > 0"}]}),
    )]);
    assert_eq!(s.native_policies(), ["big"]);
    let out = common::eval(&s, deployment());
    assert_eq!(out.errors.len(), 1, "{:?}", out.errors);
    assert_eq!(
        out.errors[0].kind,
        hearth_policies::ErrorKind::BoundExceeded
    );
}

/// Outcomes of one policy (spec as JSON) natively and on the interpreter, which must agree.
fn both(spec: Value) -> Outcome {
    let s = set(vec![policy("p", spec)]);
    let mut input = EvalInput::for_object(deployment(), Operation::Create);
    input.params = shipped().params[0].clone();
    agree(&s, &input)
}

#[test]
fn malformed_quantities_are_the_interpreters_errors() {
    for q in ["1.5.5", "1..5", "1.2.", "0.0.0Gi", "", "Gi", "1.5Gi"] {
        both(json!({"validations": [{"expression":
            format!("quantity('{q}').isLessThan(quantity('2'))")}]}));
    }
}

#[test]
fn a_comprehension_variable_named_variables_shadows_the_policy_variables() {
    let out = both(json!({
        "variables": [{"name": "a", "expression": "1"}],
        "validations": [{"expression": "[{'a': 2}].all(variables, variables.a == 2)"}],
    }));
    assert!(out.allowed(), "{out:?}");
}

#[test]
fn a_failed_variable_passed_to_a_function_reports_the_variable() {
    let out = both(json!({
        "variables": [{"name": "bad", "expression": "1 / 0"}],
        "validations": [
            {"expression": "size(string(variables.bad)) > 0"},
            {"expression": "variables.bad > 0"},
        ],
    }));
    assert_eq!(out.errors.len(), 2, "{:?}", out.errors);
    for e in &out.errors {
        assert!(
            e.message.starts_with("variables.bad failed: "),
            "{}",
            e.message
        );
    }
}

#[test]
fn an_exceeded_bound_is_not_absorbed_by_logic() {
    for e in [
        "lists.range(20000).size() > 0 || true",
        "lists.range(20000).size() > 0 && false",
    ] {
        let out = both(json!({"failurePolicy": "Ignore", "validations": [{"expression": e}]}));
        assert_eq!(out.errors.len(), 1, "{e}: {:?}", out.errors);
        assert_eq!(
            out.errors[0].kind,
            hearth_policies::ErrorKind::BoundExceeded,
            "{e}"
        );
    }
}

#[test]
fn regular_expressions_are_bounded() {
    // A literal pattern that does not compile (or compiles too big) is a load error.
    for p in ["(", "x{1000}{1000}"] {
        let (_, errors) = PolicySet::compile(&[policy(
            "re",
            json!({"validations": [{"expression": format!("'abc'.matches('{p}')")}]}),
        )]);
        assert_eq!(errors.len(), 1, "{p}");
        assert!(
            errors[0].to_string().contains("invalid regular expression"),
            "{}",
            errors[0]
        );
    }
    // From the request, a pattern too big to compile is a bound.
    let mut d = deployment();
    d["metadata"]["annotations"]["re"] = json!("x{1000}{1000}");
    let s = set(vec![policy(
        "re",
        json!({"validations": [{"expression":
            "'abc'.matches(object.metadata.annotations['re'])"}]}),
    )]);
    let input = EvalInput::for_object(d, Operation::Create);
    let out = agree(&s, &input);
    assert_eq!(out.errors.len(), 1, "{:?}", out.errors);
    assert_eq!(
        out.errors[0].kind,
        hearth_policies::ErrorKind::BoundExceeded
    );
}
