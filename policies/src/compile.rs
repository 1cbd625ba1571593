//! Compiling one CEL expression: text bounds, parsing, checks for what this engine cannot
//! evaluate, and the rewrite that splices in the run-time guards of [`crate::guard`].

use std::{collections::BTreeSet, sync::Arc};

use kube_cel::cel::{
    common::ast::{
        CallExpr, ComprehensionExpr, EntryExpr, Expr, IdedEntryExpr, IdedExpr, LiteralValue,
        MapEntryExpr, MapExpr, operators,
    },
    parser::Parser,
};

use kube_cel::cel::common::types::CelString;

use crate::{guard, limits::Limits, native};

/// Variables a policy expression may use (KEP-3488 plus Hearth's `params`, `service` and
/// `settings`).
pub const ROOT_VARIABLES: &[&str] = &[
    "object",
    "oldObject",
    "request",
    "namespaceObject",
    "params",
    "service",
    "settings",
    "variables",
];

/// Functions of the `cel` crate's standard library.
const CEL_FUNCTIONS: &[&str] = &[
    "contains",
    "size",
    "max",
    "min",
    "startsWith",
    "endsWith",
    "string",
    "bool",
    "type",
    "bytes",
    "double",
    "int",
    "uint",
    "optional.none",
    "optional.of",
    "optional.ofNonZeroValue",
    "value",
    "hasValue",
    "or",
    "orValue",
    "matches",
    "duration",
    "timestamp",
    "getFullYear",
    "getMonth",
    "getDayOfYear",
    "getDayOfMonth",
    "getDate",
    "getDayOfWeek",
    "getHours",
    "getMinutes",
    "getSeconds",
    "getMilliseconds",
];

/// Functions kube-cel 0.8 registers (`KubeCelExt::register_all`): the Kubernetes CEL
/// libraries (k8s.io/apiserver/pkg/cel/library) and cel-go extensions.
const KUBE_FUNCTIONS: &[&str] = &[
    "add",
    "asApproximateFloat",
    "asInteger",
    "base64.decode",
    "base64.encode",
    "charAt",
    "cidr",
    "compareTo",
    "containsCIDR",
    "containsIP",
    "distinct",
    "family",
    "find",
    "findAll",
    "first",
    "flatten",
    "format",
    "format.byte",
    "format.date",
    "format.datetime",
    "format.dns1035Label",
    "format.dns1035LabelPrefix",
    "format.dns1123Label",
    "format.dns1123LabelPrefix",
    "format.dns1123Subdomain",
    "format.dns1123SubdomainPrefix",
    "format.labelValue",
    "format.named",
    "format.qualifiedName",
    "format.uri",
    "format.uuid",
    "getEscapedPath",
    "getHost",
    "getHostname",
    "getPort",
    "getQuery",
    "getScheme",
    "indexOf",
    "ip",
    "ip.isCanonical",
    "isCIDR",
    "isCIDRv4",
    "isCIDRv6",
    "isGlobalUnicast",
    "isGreaterThan",
    "isIP",
    "isIPv4",
    "isIPv6",
    "isInteger",
    "isLessThan",
    "isLinkLocalMulticast",
    "isLinkLocalUnicast",
    "isLoopback",
    "isQuantity",
    "isSemver",
    "isSorted",
    "isURL",
    "isUnspecified",
    "join",
    "jsonpatch.escapeKey",
    "last",
    "lastIndexOf",
    "lists.range",
    "lowerAscii",
    "major",
    "masked",
    "math.abs",
    "math.bitAnd",
    "math.bitNot",
    "math.bitOr",
    "math.bitShiftLeft",
    "math.bitShiftRight",
    "math.bitXor",
    "math.ceil",
    "math.floor",
    "math.greatest",
    "math.isFinite",
    "math.isInf",
    "math.isNaN",
    "math.least",
    "math.round",
    "math.sign",
    "math.sqrt",
    "math.trunc",
    "minor",
    "patch",
    "prefixLength",
    "quantity",
    "replace",
    "reverse",
    "semver",
    "sets.contains",
    "sets.equivalent",
    "sets.intersects",
    "sign",
    "slice",
    "sort",
    "split",
    "strings.quote",
    "sub",
    "substring",
    "sum",
    "trim",
    "upperAscii",
    "url",
    "validate",
];

/// Operators the interpreter evaluates itself.
const OPERATORS: &[&str] = &[
    operators::CONDITIONAL,
    operators::LOGICAL_AND,
    operators::LOGICAL_OR,
    operators::LOGICAL_NOT,
    operators::SUBSTRACT,
    operators::ADD,
    operators::MULTIPLY,
    operators::DIVIDE,
    operators::MODULO,
    operators::EQUALS,
    operators::NOT_EQUALS,
    operators::GREATER_EQUALS,
    operators::LESS_EQUALS,
    operators::GREATER,
    operators::LESS,
    operators::NEGATE,
    operators::INDEX,
    operators::OPT_INDEX,
    operators::OPT_SELECT,
    operators::NOT_STRICTLY_FALSE,
    operators::IN,
];

/// Calls whose result can outgrow their inputs: their result is size-checked and charged.
const GROWING: &[&str] = &[
    operators::ADD,
    "join",
    "replace",
    "format",
    "lists.range",
    "flatten",
    "strings.quote",
    "base64.encode",
    "base64.decode",
    "upperAscii",
    "lowerAscii",
    "split",
    "findAll",
    "sort",
    "distinct",
    "reverse",
    "string",
];

/// Macros in a form the engine does not expand, and functions it does not have, rejected with
/// a reason.
const UNSUPPORTED: &[(&str, &str)] = &[
    (
        "all",
        "write list.all(x, predicate) or, with two variables, map.all(k, v, predicate)",
    ),
    (
        "exists",
        "write list.exists(x, predicate) or, with two variables, map.exists(k, v, predicate)",
    ),
    (
        "existsOne",
        "write list.existsOne(x, predicate) or list.existsOne(i, x, predicate)",
    ),
    (
        "exists_one",
        "write list.exists_one(x, predicate) or list.exists_one(i, x, predicate)",
    ),
    (
        "transformList",
        "write list.transformList(i, x, [filter,] value)",
    ),
    (
        "transformMap",
        "write map.transformMap(k, v, [filter,] value)",
    ),
    ("transformMapEntry", "transformMapEntry is not supported"),
];

/// Why an expression did not compile. `Display` names the problem and, where known, the
/// position (`line:column`, 1-based) in the expression.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ExprError {
    /// What is wrong and how to fix it.
    pub message: String,
    /// 1-based line and column of the problem in the expression, when known.
    pub position: Option<(usize, usize)>,
}

/// A compiled expression: the guarded tree, ready to evaluate many times.
#[derive(Debug, Clone)]
pub struct CompiledExpr {
    /// The CEL source as written.
    pub source: String,
    pub(crate) expr: IdedExpr,
    /// Names of policy variables the expression reads (`variables.<name>`).
    pub(crate) uses_variables: BTreeSet<String>,
    /// The native program, when the expression uses only what [`crate::native`] implements.
    pub(crate) native: Option<Arc<native::Program>>,
}

fn error_at(source: &str, needle: &str, message: String) -> ExprError {
    ExprError {
        position: source.find(needle).map(|i| line_col(source, i)),
        message,
    }
}

fn line_col(source: &str, byte: usize) -> (usize, usize) {
    let before = &source[..byte];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// Deepest `(`/`[`/`{` nesting in the source text, outside string literals, with the byte
/// offset where it first exceeds `limit`.
fn text_nesting(source: &str, limit: usize) -> Option<usize> {
    let bytes = source.as_bytes();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'"' | b'\'' => {
                // Skip a string literal (single, or triple quoted), honouring backslashes.
                let triple = bytes.get(i + 1) == Some(&c) && bytes.get(i + 2) == Some(&c);
                i += if triple { 3 } else { 1 };
                while i < bytes.len() {
                    if bytes[i] == b'\\' {
                        i += 2;
                        continue;
                    }
                    if bytes[i] == c
                        && (!triple
                            || (bytes.get(i + 1) == Some(&c) && bytes.get(i + 2) == Some(&c)))
                    {
                        i += if triple { 3 } else { 1 };
                        break;
                    }
                    i += 1;
                }
                continue;
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return Some(i);
                }
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    None
}

/// Compiled size limit of a regular expression (the `regex` crate's default is 10 MiB): large
/// enough for any realistic pattern, small enough that compiling a hostile one fails fast.
pub(crate) const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// Compiles a regular expression under [`REGEX_SIZE_LIMIT`].
pub(crate) fn regex_limited(pattern: &str) -> Result<regex::Regex, regex::Error> {
    regex::RegexBuilder::new(pattern)
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
}

/// Compiles one expression under `limits`. `declared` are the policy variables defined before
/// this expression (in order), which `variables.<name>` may name.
pub fn compile_expr(
    source: &str,
    limits: &Limits,
    declared: &[String],
) -> Result<CompiledExpr, ExprError> {
    compile_with_bindings(source, limits, declared, &[])
}

/// [`compile_expr`] where `bindings` are extra identifiers in scope (a standalone expression's
/// variables, see [`crate::expression`]).
pub(crate) fn compile_with_bindings(
    source: &str,
    limits: &Limits,
    declared: &[String],
    bindings: &[String],
) -> Result<CompiledExpr, ExprError> {
    if source.len() > limits.max_expression_bytes {
        return Err(ExprError {
            message: format!(
                "expression is {} bytes, more than the limit of {}: split it into policy variables",
                source.len(),
                limits.max_expression_bytes
            ),
            position: None,
        });
    }
    if source.trim().is_empty() {
        return Err(ExprError {
            message: "expression is empty".into(),
            position: None,
        });
    }
    if let Some(at) = text_nesting(source, limits.max_nesting) {
        return Err(ExprError {
            message: format!(
                "expression nests brackets more than {} deep: flatten it or use policy variables",
                limits.max_nesting
            ),
            position: Some(line_col(source, at)),
        });
    }
    // Parsing recurses per grammar rule; a long operator chain is deep even without brackets,
    // so parse on a stack sized for the longest allowed source.
    let depth_budget = (limits.max_nesting * 12).min(u16::MAX as usize - 1) as u16;
    let parsed = stacker::grow(64 << 20, || {
        Parser::new()
            .enable_optional_syntax(true)
            .max_recursion_depth(depth_budget)
            .parse(source)
    });
    let mut expr = match parsed {
        Ok(e) => e,
        Err(errs) => {
            let first = errs.errors.first();
            let position = first.and_then(|e| {
                let (l, c) = e.pos;
                (l > 0).then_some((l as usize, c.max(0) as usize + 1))
            });
            let message = first.map_or_else(|| errs.to_string(), |e| e.msg.clone());
            return Err(ExprError {
                message: format!("syntax error: {message}"),
                position,
            });
        }
    };
    stacker::grow(16 << 20, || {
        desugar(&mut expr, &mut bindings.to_vec(), limits.max_ast_depth + 1)
    })
    .map_err(|name| error_at(source, &name, format!("{name} is reserved for the engine")))?;
    let mut checker = Checker {
        source,
        limits,
        declared,
        scope: bindings.to_vec(),
        uses: BTreeSet::new(),
    };
    stacker::grow(16 << 20, || checker.check(&expr, 1, 0))?;
    let uses_variables = checker.uses;
    let native =
        stacker::grow(16 << 20, || native::compile(&expr, declared, bindings)).map(Arc::new);
    stacker::grow(16 << 20, || rewrite(&mut expr));
    Ok(CompiledExpr {
        source: source.to_owned(),
        expr,
        uses_variables,
        native,
    })
}

struct Checker<'a> {
    source: &'a str,
    limits: &'a Limits,
    declared: &'a [String],
    scope: Vec<String>,
    uses: BTreeSet<String>,
}

impl Checker<'_> {
    fn check(&mut self, e: &IdedExpr, depth: usize, comps: usize) -> Result<(), ExprError> {
        if depth > self.limits.max_ast_depth {
            return Err(ExprError {
                message: format!(
                    "expression is more than {} levels deep: split it into policy variables",
                    self.limits.max_ast_depth
                ),
                position: None,
            });
        }
        let d = depth + 1;
        match &e.expr {
            Expr::Literal(_) | Expr::Unspecified => Ok(()),
            Expr::Ident(name) => self.ident(name),
            Expr::Select(sel) => {
                if let Expr::Ident(root) = &sel.operand.expr
                    && root == "variables"
                    && !self.scope.iter().any(|s| s == "variables")
                {
                    if !self.declared.iter().any(|v| v == &sel.field) {
                        return Err(error_at(
                            self.source,
                            &format!("variables.{}", sel.field),
                            format!(
                                "variables.{} is not declared before this expression: add it to spec.variables above its first use",
                                sel.field
                            ),
                        ));
                    }
                    self.uses.insert(sel.field.clone());
                    return Ok(());
                }
                self.check(&sel.operand, d, comps)
            }
            Expr::Call(call) => self.call(call, d, comps),
            Expr::List(l) => l.elements.iter().try_for_each(|x| self.check(x, d, comps)),
            Expr::Map(m) => m.entries.iter().try_for_each(|en| match &en.expr {
                EntryExpr::MapEntry(me) => {
                    self.check(&me.key, d, comps)?;
                    self.check(&me.value, d, comps)
                }
                EntryExpr::StructField(f) => self.check(&f.value, d, comps),
            }),
            Expr::Struct(s) => {
                if s.type_name != "JSONPatch"
                    && s.type_name != "Object"
                    && !s.type_name.starts_with("Object.")
                {
                    return Err(error_at(
                        self.source,
                        &s.type_name,
                        format!(
                            "message type {} is not supported: build a map, Object{{...}} (ApplyConfiguration) or JSONPatch{{...}}",
                            s.type_name
                        ),
                    ));
                }
                s.entries.iter().try_for_each(|en| match &en.expr {
                    EntryExpr::StructField(f) => self.check(&f.value, d, comps),
                    EntryExpr::MapEntry(me) => self.check(&me.value, d, comps),
                })
            }
            Expr::Comprehension(c) => self.comprehension(c, d, comps),
        }
    }

    fn ident(&mut self, name: &str) -> Result<(), ExprError> {
        if self.scope.iter().any(|s| s == name) {
            return Ok(());
        }
        if name == "variables" {
            return Err(error_at(
                self.source,
                name,
                "use a policy variable by name: variables.<name>".into(),
            ));
        }
        if ROOT_VARIABLES.contains(&name) {
            return Ok(());
        }
        let message = if name == "authorizer" {
            "authorizer is not supported: it needs the apiserver's authorization check; enforce it with RBAC or a ValidatingAdmissionPolicy".to_owned()
        } else {
            format!(
                "undeclared reference to '{name}': expressions may use {}",
                ROOT_VARIABLES.join(", ")
            )
        };
        Err(error_at(self.source, name, message))
    }

    fn comprehension(
        &mut self,
        c: &ComprehensionExpr,
        d: usize,
        comps: usize,
    ) -> Result<(), ExprError> {
        if c.iter_var2.is_some() {
            return Err(error_at(
                self.source,
                &c.iter_var,
                "two-variable comprehensions are not supported: use the one-variable form".into(),
            ));
        }
        // `cel.bind` only names a value: it does not iterate.
        let comps = if c.iter_var == BIND_ITER {
            comps.saturating_sub(1)
        } else {
            comps
        };
        if comps + 1 > self.limits.max_comprehension_nesting {
            return Err(error_at(
                self.source,
                &format!("({}", c.iter_var),
                format!(
                    "comprehensions nest more than {} deep: compute inner results in policy variables",
                    self.limits.max_comprehension_nesting
                ),
            ));
        }
        self.check(&c.iter_range, d, comps)?;
        self.check(&c.accu_init, d, comps)?;
        self.scope.push(c.iter_var.clone());
        self.scope.push(c.accu_var.clone());
        let r = self
            .check(&c.loop_cond, d, comps + 1)
            .and_then(|_| self.check(&c.loop_step, d, comps + 1))
            .and_then(|_| self.check(&c.result, d, comps + 1));
        self.scope.pop();
        self.scope.pop();
        r
    }

    fn call(&mut self, call: &CallExpr, d: usize, comps: usize) -> Result<(), ExprError> {
        let name = call.func_name.as_str();
        // `ns.fn(...)` parses as a call of `fn` on the identifier `ns`.
        let qualified = match call.target.as_deref().map(|t| &t.expr) {
            Some(Expr::Ident(ns))
                if !self.scope.contains(ns) && !ROOT_VARIABLES.contains(&ns.as_str()) =>
            {
                Some(format!("{ns}.{name}"))
            }
            _ => None,
        };
        let full = qualified.as_deref().unwrap_or(name);
        if let Some((_, why)) = UNSUPPORTED.iter().find(|(n, _)| *n == full) {
            return Err(error_at(self.source, full, format!("{full}: {why}")));
        }
        // Operands next, so the innermost problem is reported.
        if qualified.is_none()
            && let Some(t) = &call.target
        {
            self.check(t, d, comps)?;
        }
        call.args.iter().try_for_each(|a| self.check(a, d, comps))?;
        // The engine's own functions only come from `desugar`, which rejects them in the source.
        let known = |n: &str| {
            OPERATORS.contains(&n)
                || CEL_FUNCTIONS.contains(&n)
                || KUBE_FUNCTIONS.contains(&n)
                || n == guard::ENTRIES
                || n == guard::PUT
                || n == guard::TYPE_NAMED
                || n == guard::MAP_LITERAL
        };
        // A literal pattern that does not compile is a load error, not a per-request one.
        if matches!(full, "matches" | "find" | "findAll")
            && let Some(Expr::Literal(LiteralValue::String(p))) = call.args.first().map(|a| &a.expr)
            && let Err(e) = regex_limited(p.inner())
        {
            return Err(error_at(
                self.source,
                p.inner(),
                format!("{full}: invalid regular expression: {e}"),
            ));
        }
        if !known(full) {
            return Err(error_at(
                self.source,
                full,
                format!(
                    "unknown function '{full}': it is not in the standard or Kubernetes CEL libraries"
                ),
            ));
        }
        Ok(())
    }
}

/// The guard and predicate of an `all` or `exists` comprehension as the parser's macros
/// (and [`two_variable`]) build them: `@result && p` from `true`, `@result || p` from `false`.
fn quantifier(c: &mut ComprehensionExpr) -> Option<(&'static str, IdedExpr)> {
    if c.accu_var != RESULT || !matches!(&c.result.expr, Expr::Ident(r) if r == RESULT) {
        return None;
    }
    let Expr::Literal(LiteralValue::Boolean(init)) = &c.accu_init.expr else {
        return None;
    };
    let (guard, op) = if *init.inner() {
        (guard::ALL, operators::LOGICAL_AND)
    } else {
        (guard::EXISTS, operators::LOGICAL_OR)
    };
    let Expr::Call(step) = &mut c.loop_step.expr else {
        return None;
    };
    if step.func_name != op
        || step.args.len() != 2
        || !matches!(&step.args[0].expr, Expr::Ident(r) if r == RESULT)
    {
        return None;
    }
    Some((guard, take(&mut step.args[1])))
}

/// The iteration variable of the comprehension `cel.bind` becomes (it never iterates).
pub(crate) const BIND_ITER: &str = "#bind";

fn ident(name: &str) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::Ident(name.to_owned()),
    }
}

fn lit(l: LiteralValue) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::Literal(l),
    }
}

fn list_of(elements: Vec<IdedExpr>) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::List(kube_cel::cel::common::ast::ListExpr {
            elements,
            optional_indices: Vec::new(),
        }),
    }
}

fn comprehension(c: ComprehensionExpr) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::Comprehension(Box::new(c)),
    }
}

/// `cel.bind(var, init, body)` as cel-go expands it: a comprehension over nothing whose
/// accumulator `var` holds `init` and whose result is `body`.
fn bind(var: &str, init: IdedExpr, body: IdedExpr) -> IdedExpr {
    comprehension(ComprehensionExpr {
        iter_range: list_of(Vec::new()),
        iter_var: BIND_ITER.to_owned(),
        iter_var2: None,
        accu_var: var.to_owned(),
        accu_init: init,
        loop_cond: lit(LiteralValue::Boolean(false.into())),
        loop_step: ident(var),
        result: body,
    })
}

/// Type denotations: identifiers that stand for a type value.
const TYPE_NAMES: &[&str] = &[
    "optional_type",
    "int",
    "uint",
    "double",
    "bool",
    "string",
    "bytes",
    "list",
    "map",
    "null_type",
    "type",
];

/// The optional `optMap` and `optFlatMap` look into.
const OPT: &str = "#opt";

/// The iteration variable of a two-variable comprehension: a `[key, value]` pair.
const PAIR: &str = "#pair";
/// The accumulator, named as the parser's macros name it.
const RESULT: &str = "@result";

/// A two-variable comprehension (`range.all(k, v, p)`, `exists`, `existsOne`,
/// `transformList`, `transformMap`) over the `[key, value]` pairs of `range`, with `k` and `v`
/// bound in each step. `None` when `func` is not one.
fn two_variable(
    func: &str,
    range: IdedExpr,
    k: &str,
    v: &str,
    mut rest: Vec<IdedExpr>,
) -> Option<IdedExpr> {
    let at = |i: i64| {
        call(
            operators::INDEX,
            None,
            vec![ident(PAIR), lit(LiteralValue::Int(i.into()))],
        )
    };
    let bound = |body: IdedExpr| bind(k, at(0), bind(v, at(1), body));
    let acc = || ident(RESULT);
    let (init, cond, step, result) = match (func, rest.len()) {
        ("all", 1) => (
            lit(LiteralValue::Boolean(true.into())),
            call(operators::NOT_STRICTLY_FALSE, None, vec![acc()]),
            call(
                operators::LOGICAL_AND,
                None,
                vec![acc(), bound(rest.remove(0))],
            ),
            acc(),
        ),
        ("exists", 1) => (
            lit(LiteralValue::Boolean(false.into())),
            call(
                operators::NOT_STRICTLY_FALSE,
                None,
                vec![call(operators::LOGICAL_NOT, None, vec![acc()])],
            ),
            call(
                operators::LOGICAL_OR,
                None,
                vec![acc(), bound(rest.remove(0))],
            ),
            acc(),
        ),
        ("existsOne" | "exists_one", 1) => (
            lit(LiteralValue::Int(0.into())),
            lit(LiteralValue::Boolean(true.into())),
            bound(call(
                operators::CONDITIONAL,
                None,
                vec![
                    rest.remove(0),
                    call(
                        operators::ADD,
                        None,
                        vec![acc(), lit(LiteralValue::Int(1.into()))],
                    ),
                    acc(),
                ],
            )),
            call(
                operators::EQUALS,
                None,
                vec![acc(), lit(LiteralValue::Int(1.into()))],
            ),
        ),
        ("transformList", 1 | 2) => {
            let value = rest.pop()?;
            let add = call(operators::ADD, None, vec![acc(), list_of(vec![value])]);
            let step = match rest.pop() {
                Some(filter) => call(operators::CONDITIONAL, None, vec![filter, add, acc()]),
                None => add,
            };
            (
                list_of(Vec::new()),
                lit(LiteralValue::Boolean(true.into())),
                bound(step),
                acc(),
            )
        }
        ("transformMap", 1 | 2) => {
            let value = rest.pop()?;
            let add = call(guard::PUT, None, vec![acc(), ident(k), value]);
            let step = match rest.pop() {
                Some(filter) => call(operators::CONDITIONAL, None, vec![filter, add, acc()]),
                None => add,
            };
            (
                IdedExpr {
                    id: 0,
                    expr: Expr::Map(MapExpr {
                        entries: Vec::new(),
                    }),
                },
                lit(LiteralValue::Boolean(true.into())),
                bound(step),
                acc(),
            )
        }
        _ => return None,
    };
    Some(comprehension(ComprehensionExpr {
        iter_range: call(guard::ENTRIES, None, vec![range]),
        iter_var: PAIR.to_owned(),
        iter_var2: None,
        accu_var: RESULT.to_owned(),
        accu_init: init,
        loop_cond: cond,
        loop_step: step,
        result,
    }))
}

/// Rewrites what the apiserver's CEL has and the interpreter does not into what it has:
/// `dyn(x)` (a type-checker hint) is `x`; `cel.bind(v, init, body)` is the comprehension
/// cel-go expands it to; two-variable comprehensions iterate `[key, value]` pairs with both
/// variables bound. Errors with the name of an engine function written in the source.
fn desugar(e: &mut IdedExpr, scope: &mut Vec<String>, depth: usize) -> Result<(), String> {
    // Deeper than any expression may be: the checker rejects it.
    let Some(depth) = depth.checked_sub(1) else {
        return Ok(());
    };
    match &mut e.expr {
        Expr::Call(c) => {
            if c.func_name.starts_with("__hearth") {
                return Err(c.func_name.clone());
            }
            // `ns.fn(...)`'s namespace is not an identifier to rewrite.
            if let Some(t) = c.target.as_deref_mut()
                && !matches!(&t.expr, Expr::Ident(n) if !scope.contains(n))
            {
                desugar(t, scope, depth)?;
            }
            c.args
                .iter_mut()
                .try_for_each(|a| desugar(a, scope, depth))?;
        }
        Expr::Select(s) => {
            // `net.IP` and `net.CIDR` denote the IP library's types.
            if matches!(&s.operand.expr, Expr::Ident(n) if n == "net" && !scope.contains(n))
                && matches!(s.field.as_str(), "IP" | "CIDR")
                && !s.test
            {
                let name = format!("net.{}", s.field);
                *e = call(
                    guard::TYPE_NAMED,
                    None,
                    vec![lit(LiteralValue::String(CelString::from(name)))],
                );
                return Ok(());
            }
            desugar(&mut s.operand, scope, depth)?
        }
        Expr::List(l) => l
            .elements
            .iter_mut()
            .try_for_each(|x| desugar(x, scope, depth))?,
        Expr::Map(m) => m.entries.iter_mut().try_for_each(|en| match &mut en.expr {
            EntryExpr::MapEntry(me) => {
                desugar(&mut me.key, scope, depth)?;
                desugar(&mut me.value, scope, depth)
            }
            EntryExpr::StructField(f) => desugar(&mut f.value, scope, depth),
        })?,
        Expr::Struct(s) => s.entries.iter_mut().try_for_each(|en| match &mut en.expr {
            EntryExpr::MapEntry(me) => {
                desugar(&mut me.key, scope, depth)?;
                desugar(&mut me.value, scope, depth)
            }
            EntryExpr::StructField(f) => desugar(&mut f.value, scope, depth),
        })?,
        Expr::Comprehension(c) => {
            desugar(&mut c.iter_range, scope, depth)?;
            desugar(&mut c.accu_init, scope, depth)?;
            let mark = scope.len();
            scope.push(c.iter_var.clone());
            scope.push(c.accu_var.clone());
            let inner = desugar(&mut c.loop_cond, scope, depth)
                .and_then(|_| desugar(&mut c.loop_step, scope, depth))
                .and_then(|_| desugar(&mut c.result, scope, depth));
            scope.truncate(mark);
            inner?;
        }
        Expr::Ident(name) => {
            // A type denotation (`type(x) == string`) is a value.
            if TYPE_NAMES.contains(&name.as_str()) && !scope.contains(name) {
                let name = name.clone();
                *e = call(
                    guard::TYPE_NAMED,
                    None,
                    vec![lit(LiteralValue::String(CelString::from(name)))],
                );
            }
            return Ok(());
        }
        Expr::Literal(_) | Expr::Unspecified => {}
    }
    let Expr::Call(c) = &mut e.expr else {
        return Ok(());
    };
    if c.func_name == "dyn" && c.target.is_none() && c.args.len() == 1 {
        *e = take(&mut c.args[0]);
        return Ok(());
    }
    let is_cel =
        matches!(c.target.as_deref().map(|t| &t.expr), Some(Expr::Ident(ns)) if ns == "cel");
    if is_cel
        && c.func_name == "bind"
        && c.args.len() == 3
        && let Expr::Ident(var) = &c.args[0].expr
    {
        let var = var.clone();
        let body = take(&mut c.args[2]);
        let init = take(&mut c.args[1]);
        *e = bind(&var, init, body);
        return Ok(());
    }
    // `o.optMap(v, e)`: `optional.of(e)` with `v` bound to the value, none when `o` is none;
    // `optFlatMap` returns `e` itself.
    if matches!(c.func_name.as_str(), "optMap" | "optFlatMap")
        && c.args.len() == 2
        && c.target.is_some()
        && let Expr::Ident(var) = &c.args[0].expr
    {
        let var = var.clone();
        let flat = c.func_name == "optFlatMap";
        let body = take(&mut c.args[1]);
        let target = c.target.as_deref_mut().map(take).unwrap_or_default();
        let method = |name: &str, on: IdedExpr, args: Vec<IdedExpr>| IdedExpr {
            id: 0,
            expr: Expr::Call(CallExpr {
                func_name: name.to_owned(),
                target: Some(Box::new(on)),
                args,
            }),
        };
        let mapped = bind(&var, method("value", ident(OPT), Vec::new()), body);
        let some = if flat {
            mapped
        } else {
            method("of", ident("optional"), vec![mapped])
        };
        *e = bind(
            OPT,
            target,
            call(
                operators::CONDITIONAL,
                None,
                vec![
                    method("hasValue", ident(OPT), Vec::new()),
                    some,
                    method("none", ident("optional"), Vec::new()),
                ],
            ),
        );
        return Ok(());
    }
    let two_variable_form = matches!(
        (c.func_name.as_str(), c.args.len()),
        ("all" | "exists" | "existsOne" | "exists_one", 3)
            | ("transformList" | "transformMap", 3 | 4)
    );
    if two_variable_form
        && let (Some(_), Expr::Ident(k), Expr::Ident(v)) =
            (c.target.as_deref(), &c.args[0].expr, &c.args[1].expr)
    {
        let (k, v) = (k.clone(), v.clone());
        let rest: Vec<IdedExpr> = c.args.drain(2..).collect();
        let range = c.target.as_deref_mut().map(take).unwrap_or_default();
        let func = c.func_name.clone();
        if let Some(desugared) = two_variable(&func, range, &k, &v, rest) {
            *e = desugared;
        }
    }
    Ok(())
}

fn call(name: &str, target: Option<IdedExpr>, args: Vec<IdedExpr>) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::Call(CallExpr {
            func_name: name.to_owned(),
            target: target.map(Box::new),
            args,
        }),
    }
}

fn take(e: &mut IdedExpr) -> IdedExpr {
    std::mem::take(e)
}

/// The context identifier holding policy variable `name` (`variables.<name>` is rewritten to
/// it, so each variable is converted into the interpreter's representation once).
pub(crate) fn variable_ident(name: &str) -> String {
    format!("__hearth_var_{name}")
}

/// A chain of field selections on an identifier (`object.spec.template.spec`) becomes one
/// call of [`guard::PATH`], which walks the fields by reference instead of copying every
/// intermediate object as the interpreter's selection does. `variables.<name>` becomes the
/// variable's identifier. `None` when `e` is not such a chain.
fn select_path(e: &IdedExpr, shadowed: bool) -> Option<IdedExpr> {
    let mut fields = Vec::new();
    let mut cur = e;
    while let Expr::Select(s) = &cur.expr {
        if s.test {
            return None;
        }
        fields.push(s.field.clone());
        cur = &s.operand;
    }
    let Expr::Ident(root) = &cur.expr else {
        return None;
    };
    fields.reverse();
    let mut root = root.clone();
    if root == "variables" && !shadowed {
        root = variable_ident(&fields.remove(0));
    }
    let ident = IdedExpr {
        id: 0,
        expr: Expr::Ident(root),
    };
    if fields.is_empty() {
        return Some(ident);
    }
    let mut args = vec![ident];
    args.extend(fields.into_iter().map(|f| IdedExpr {
        id: 0,
        expr: Expr::Literal(kube_cel::cel::common::ast::LiteralValue::String(
            CelString::from(f),
        )),
    }));
    Some(call(guard::PATH, None, args))
}

/// Splices in guards: comprehension ticks, size checks on growing calls, pre-checks on
/// amplifying calls; binds `variables.<name>` to its own identifier; turns `Object{...}`/`JSONPatch{...}`
/// message construction (which the interpreter cannot evaluate) into maps.
pub(crate) fn rewrite(e: &mut IdedExpr) {
    rewrite_in(e, false)
}

/// [`rewrite`] inside a comprehension whose variable is named `variables` when `shadowed`:
/// there `variables.x` is a field of that variable, not a policy variable.
fn rewrite_in(e: &mut IdedExpr, shadowed: bool) {
    if matches!(&e.expr, Expr::Select(s) if !s.test)
        && let Some(path) = select_path(e, shadowed)
    {
        *e = path;
        return;
    }
    let rewrite = |e: &mut IdedExpr| rewrite_in(e, shadowed);
    // Children first.
    match &mut e.expr {
        Expr::Call(c) => {
            if let Some(t) = c.target.as_deref_mut() {
                rewrite(t);
            }
            c.args.iter_mut().for_each(rewrite);
        }
        Expr::Select(s) => rewrite(&mut s.operand),
        Expr::List(l) => l.elements.iter_mut().for_each(rewrite),
        Expr::Map(m) => m.entries.iter_mut().for_each(|en| {
            if let EntryExpr::MapEntry(me) = &mut en.expr {
                rewrite(&mut me.key);
                rewrite(&mut me.value);
            }
        }),
        Expr::Struct(s) => s.entries.iter_mut().for_each(|en| match &mut en.expr {
            EntryExpr::StructField(f) => rewrite(&mut f.value),
            EntryExpr::MapEntry(me) => rewrite(&mut me.value),
        }),
        Expr::Comprehension(c) if c.iter_var == BIND_ITER => {
            // `cel.bind`: the interpreter binds the value in a scope of its own (its
            // comprehension accumulator would unwrap an optional value).
            rewrite(&mut c.accu_init);
            let inner = shadowed || c.accu_var == "variables";
            rewrite_in(&mut c.result, inner);
            let var = lit(LiteralValue::String(CelString::from(c.accu_var.clone())));
            let init = take(&mut c.accu_init);
            let body = take(&mut c.result);
            *e = call(guard::BIND, None, vec![var, init, body]);
            return;
        }
        Expr::Comprehension(c) => {
            rewrite(&mut c.iter_range);
            rewrite(&mut c.accu_init);
            let inner = shadowed || c.iter_var == "variables" || c.accu_var == "variables";
            // `all` and `exists`: a guard iterates, so an element's error is absorbed when
            // another element decides the result (the interpreter's loop stops at the error).
            if let Some((guard, predicate)) = quantifier(c) {
                let mut predicate = predicate;
                rewrite_in(&mut predicate, inner);
                let range = take(&mut c.iter_range);
                let var = lit(LiteralValue::String(CelString::from(c.iter_var.clone())));
                *e = call(guard, None, vec![range, var, predicate]);
                return;
            }
            rewrite_in(&mut c.loop_cond, inner);
            rewrite_in(&mut c.loop_step, inner);
            rewrite_in(&mut c.result, inner);
            let cond = take(&mut c.loop_cond);
            c.loop_cond = call(guard::TICK, None, vec![cond]);
        }
        Expr::Literal(_) | Expr::Ident(_) | Expr::Unspecified => {}
    }
    // Then this node.
    match &mut e.expr {
        // What the path rewrite left: selections on computed values, and `has()`.
        Expr::Select(s) => {
            let field = IdedExpr {
                id: 0,
                expr: Expr::Literal(LiteralValue::String(CelString::from(s.field.clone()))),
            };
            let guard = if s.test { guard::HAS } else { guard::SELECT };
            let operand = take(&mut s.operand);
            *e = call(guard, None, vec![operand, field]);
        }
        // A map literal may not repeat a key (numbers of equal value are the same key).
        Expr::Map(m) if m.entries.len() >= 2 => {
            let n = m
                .entries
                .iter()
                .filter(|en| matches!(&en.expr, EntryExpr::MapEntry(me) if !me.optional))
                .count() as i64;
            let literal = take(e);
            *e = call(
                guard::MAP_LITERAL,
                None,
                vec![literal, lit(LiteralValue::Int(n.into()))],
            );
        }
        Expr::Struct(s) => {
            let entries = std::mem::take(&mut s.entries)
                .into_iter()
                .map(|en| match en.expr {
                    EntryExpr::StructField(f) => IdedEntryExpr {
                        id: en.id,
                        expr: EntryExpr::MapEntry(MapEntryExpr {
                            key: IdedExpr {
                                id: 0,
                                expr: Expr::Literal(
                                    kube_cel::cel::common::ast::LiteralValue::String(
                                        CelString::from(f.field),
                                    ),
                                ),
                            },
                            value: f.value,
                            optional: f.optional,
                        }),
                    },
                    other => IdedEntryExpr {
                        id: en.id,
                        expr: other,
                    },
                })
                .collect();
            e.expr = Expr::Map(MapExpr { entries });
        }
        Expr::Call(c) => {
            let qualified = match c.target.as_deref().map(|t| &t.expr) {
                Some(Expr::Ident(ns)) if ns == "lists" => format!("lists.{}", c.func_name),
                _ => c.func_name.clone(),
            };
            match qualified.as_str() {
                "join" => {
                    if let Some(t) = c.target.as_deref_mut() {
                        let mut args = vec![take(t)];
                        args.extend(c.args.first().cloned());
                        *t = call(guard::PRE_JOIN, None, args);
                    }
                }
                "replace" if c.args.len() >= 2 => {
                    if let Some(t) = c.target.as_deref_mut() {
                        let args = vec![take(t), c.args[0].clone(), c.args[1].clone()];
                        *t = call(guard::PRE_REPLACE, None, args);
                    }
                }
                "format" if c.args.len() == 1 => {
                    if let Some(t) = c.target.as_deref_mut() {
                        let args = vec![take(t), c.args[0].clone()];
                        *t = call(guard::PRE_FORMAT, None, args);
                    }
                }
                "lists.range" if c.args.len() == 1 => {
                    let n = take(&mut c.args[0]);
                    c.args[0] = call(guard::PRE_RANGE, None, vec![n]);
                }
                _ => {}
            }
            // Equality, ordering and `in` follow CEL across numeric types (`1 == 1.0`,
            // `1 < 2u`), and comparing walks both operands, which is charged.
            if c.target.is_none() && c.args.len() == 2 {
                let guarded = match c.func_name.as_str() {
                    operators::EQUALS => Some(guard::EQ),
                    operators::NOT_EQUALS => Some(guard::NE),
                    operators::IN => Some(guard::IN),
                    operators::LESS => Some(guard::LT),
                    operators::LESS_EQUALS => Some(guard::LE),
                    operators::GREATER => Some(guard::GT),
                    operators::GREATER_EQUALS => Some(guard::GE),
                    _ => None,
                };
                if let Some(g) = guarded {
                    c.func_name = g.to_owned();
                }
            }
            // Indexing and optional selection with CEL's semantics (see `guard::SELECT`).
            let renamed = match c.func_name.as_str() {
                "string" if c.args.len() == 1 => Some(guard::STRING),
                "int" if c.args.len() == 1 => Some(guard::INT),
                "timestamp" if c.args.len() == 1 => Some(guard::TIMESTAMP),
                "duration" if c.args.len() == 1 => Some(guard::DURATION),
                "bytes" if c.args.len() == 1 => Some(guard::BYTES),
                operators::NEGATE if c.args.len() == 1 => Some(guard::NEG),
                operators::INDEX => Some(guard::INDEX),
                operators::OPT_INDEX => Some(guard::OPT_INDEX),
                operators::OPT_SELECT => Some(guard::OPT_SELECT),
                _ => None,
            };
            if let (Some(g), None) = (renamed, &c.target) {
                c.func_name = g.to_owned();
            }
            // `+` and `-` with timestamps and durations as cel-go; a comprehension's
            // accumulator step stays the interpreter's (it appends in place).
            let accumulator = matches!(c.args.first().map(|a| &a.expr), Some(Expr::Ident(n)) if n.starts_with('@'));
            if c.target.is_none() && c.args.len() == 2 && !accumulator {
                if c.func_name == operators::ADD {
                    c.func_name = guard::ADD.to_owned();
                } else if c.func_name == operators::SUBSTRACT {
                    c.func_name = guard::SUB.to_owned();
                }
            }
            if c.func_name == "getMilliseconds"
                && let Some(target) = c.target.take()
            {
                c.args.insert(0, *target);
                c.func_name = guard::MILLIS.to_owned();
            }
            // `format` with cel-go's renderings (see `guard::FORMAT`).
            if c.func_name == "format"
                && c.args.len() == 1
                && let Some(target) = c.target.take()
            {
                c.args.insert(0, *target);
                c.func_name = guard::FORMAT.to_owned();
            }
            // String methods whose arguments cel-go checks (see `guard::STRING_METHOD`; none
            // of them has a namespaced form, so the target is the receiver).
            if guard::CHECKED_STRING_METHODS.contains(&c.func_name.as_str())
                && let Some(target) = c.target.take()
            {
                let name = lit(LiteralValue::String(CelString::from(c.func_name.clone())));
                let mut args = vec![name, *target];
                args.append(&mut c.args);
                c.func_name = guard::STRING_METHOD.to_owned();
                c.args = args;
            }
            // The accumulator step of a comprehension (`@result + [x]`) is charged by the tick
            // guard instead, without converting the accumulator.
            let accumulates = matches!(c.args.first().map(|a| &a.expr), Some(Expr::Ident(n)) if n.starts_with('@'));
            // `guard::ADD` checks and charges its result itself.
            if GROWING.contains(&qualified.as_str()) && !accumulates && c.func_name != guard::ADD {
                let inner = take(e);
                *e = call(guard::SIZE, None, vec![inner]);
            }
        }
        _ => {}
    }
}
