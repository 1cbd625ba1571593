//! Run-time bounds: a per-thread cost budget charged by guard functions the compiler splices
//! into the expression tree (see [`crate::compile`]), and stack growth for deep trees.
//!
//! Evaluation is synchronous on one thread, so the budget lives in a thread-local set up by
//! [`Budget::enter`] for one request and reset per expression by [`start_expression`].

use std::{borrow::Cow, cell::Cell};

use kube_cel::{
    KubeCelExt,
    cel::{
        Context, ExecutionError, FunctionContext, IdedExpr, ResolveResult, Value,
        common::{
            ast::{Expr, LiteralValue},
            types::{CelList, CelMap, CelString, MAP_TYPE},
            value::Val,
        },
        extractors::This,
    },
};

use crate::limits::Limits;

/// Guard that charges one unit per comprehension iteration (wraps `loop_cond`).
pub(crate) const TICK: &str = "__hearth_tick";
/// Guard that checks and charges the size of a built value (wraps `+` and growing calls).
pub(crate) const SIZE: &str = "__hearth_size";
/// Field-path selection by reference (see `compile::select_path`).
pub(crate) const PATH: &str = "__hearth_path";
/// Equality, ordering and membership with CEL's numeric semantics (`1 == 1.0`, `1 < 2u`,
/// `1u in [1]`), charging the size of what they compare (`==`, `!=`, `<`, `<=`, `>`, `>=`,
/// `in` are rewritten to these).
pub(crate) const EQ: &str = "__hearth_eq";
pub(crate) const NE: &str = "__hearth_ne";
pub(crate) const IN: &str = "__hearth_in";
pub(crate) const LT: &str = "__hearth_lt";
pub(crate) const LE: &str = "__hearth_le";
pub(crate) const GT: &str = "__hearth_gt";
pub(crate) const GE: &str = "__hearth_ge";
/// The `[key, value]` pairs a two-variable comprehension iterates, and the step that adds an
/// entry to a `transformMap` result (see `compile::desugar`).
pub(crate) const ENTRIES: &str = "__hearth_entries";
pub(crate) const PUT: &str = "__hearth_put";
/// Field selection, `has()`, indexing and their optional forms (`x.f`, `has(x.f)`, `x[k]`,
/// `x.?f`, `x[?k]`) with CEL's semantics: an error on a value without fields, numeric keys
/// across types, and optional values propagated through a chain.
pub(crate) const SELECT: &str = "__hearth_select";
pub(crate) const HAS: &str = "__hearth_has";
pub(crate) const INDEX: &str = "__hearth_index";
pub(crate) const OPT_SELECT: &str = "__hearth_opt_select";
pub(crate) const OPT_INDEX: &str = "__hearth_opt_index";
/// A type denotation (`int`, `string`, `list`, …) as a value, as `type(x)` returns it.
pub(crate) const TYPE_NAMED: &str = "__hearth_type";
/// `string(x)` and `int(x)` with cel-go's forms for timestamps and durations.
pub(crate) const STRING: &str = "__hearth_string";
pub(crate) const INT: &str = "__hearth_int";
/// `all` and `exists` on the interpreter: `(range, 'var', predicate)`.
pub(crate) const ALL: &str = "__hearth_all";
pub(crate) const EXISTS: &str = "__hearth_exists";
/// Unary minus: ints (an error on overflow) and doubles.
pub(crate) const NEG: &str = "__hearth_neg";
/// `timestamp`, `duration` and `bytes` conversions: identity on their own type, and
/// `timestamp(int)` (Unix seconds).
pub(crate) const TIMESTAMP: &str = "__hearth_timestamp";
pub(crate) const DURATION: &str = "__hearth_duration";
pub(crate) const BYTES: &str = "__hearth_bytes";
/// String methods with their arguments checked as cel-go's strings library checks them
/// (`'s'.indexOf('a', 30)` is an error, not -1): `('name', target, args...)`.
pub(crate) const STRING_METHOD: &str = "__hearth_string_method";
/// The methods [`STRING_METHOD`] checks.
pub(crate) const CHECKED_STRING_METHODS: &[&str] =
    &["indexOf", "lastIndexOf", "replace", "split", "substring"];
/// `fmt.format(args)` with cel-go's renderings of non-finite doubles and of `%s` of lists,
/// maps, bytes, timestamps, durations and types.
pub(crate) const FORMAT: &str = "__hearth_format";
/// `+` and `-` (but a comprehension's accumulator step): timestamps and durations as
/// cel-go (`duration + timestamp`, results out of range are errors); other operands by the
/// interpreter's own operators.
pub(crate) const ADD: &str = "__hearth_add";
pub(crate) const SUB: &str = "__hearth_sub";
/// `getMilliseconds()` of a duration: its milliseconds part, as cel-go.
pub(crate) const MILLIS: &str = "__hearth_millis";
/// `cel.bind(v, init, body)` on the interpreter: `body` in a scope where `v` is `init`.
pub(crate) const BIND: &str = "__hearth_bind";
/// A map literal with `n` entries, checked for a repeated key.
pub(crate) const MAP_LITERAL: &str = "__hearth_map_literal";
/// Pre-checks for functions whose output can be much larger than their input.
pub(crate) const PRE_JOIN: &str = "__hearth_pre_join";
pub(crate) const PRE_REPLACE: &str = "__hearth_pre_replace";
pub(crate) const PRE_FORMAT: &str = "__hearth_pre_format";
pub(crate) const PRE_RANGE: &str = "__hearth_pre_range";

#[derive(Clone, Copy, Default)]
struct State {
    active: bool,
    expr_left: u64,
    expr_max: u64,
    request_left: u64,
    max_string: usize,
    max_list: usize,
    exceeded: bool,
}

thread_local! {
    static STATE: Cell<State> = Cell::new(State::default());
    /// The message of the last exceeded bound on this thread.
    static LAST_BOUND: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
    static BASE: Context<'static> = base_context();
}

/// The budget of one request on this thread; restores the previous state when dropped.
pub(crate) struct Budget {
    previous: State,
}

impl Budget {
    /// Starts a request's budget on the current thread.
    pub(crate) fn enter(limits: &Limits) -> Self {
        let previous = STATE.get();
        STATE.set(State {
            active: true,
            expr_left: limits.max_expression_cost,
            expr_max: limits.max_expression_cost,
            request_left: limits.max_request_cost,
            max_string: limits.max_string_bytes,
            max_list: limits.max_list_len,
            exceeded: false,
        });
        Budget { previous }
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        STATE.set(self.previous);
    }
}

/// Resets the per-expression budget and the exceeded flag before one expression runs.
pub(crate) fn start_expression() {
    let mut s = STATE.get();
    s.expr_left = s.expr_max;
    s.exceeded = false;
    STATE.set(s);
}

/// Whether the last expression failed because it exceeded a bound.
pub(crate) fn exceeded() -> bool {
    STATE.get().exceeded
}

/// The message of the bound the last expression exceeded.
pub(crate) fn last_bound() -> String {
    LAST_BOUND.with_borrow(Clone::clone)
}

/// The current expression's remaining budget and exceeded flag, to evaluate something else
/// (a lazily evaluated variable) under a fresh budget and come back.
pub(crate) fn save_expression() -> (u64, bool) {
    let s = STATE.get();
    (s.expr_left, s.exceeded)
}

/// Restores what [`save_expression`] saved.
pub(crate) fn restore_expression((left, exceeded): (u64, bool)) {
    let mut s = STATE.get();
    s.expr_left = left;
    s.exceeded = exceeded;
    STATE.set(s);
}

/// The request's remaining budget.
pub(crate) fn request_left() -> u64 {
    STATE.get().request_left
}

/// Gives back what an abandoned attempt spent (the native evaluator handing a policy to the
/// interpreter, which evaluates it again): the request budget returns to `left`.
pub(crate) fn refund_request(left: u64) {
    let mut s = STATE.get();
    s.request_left = s.request_left.max(left);
    STATE.set(s);
}

pub(crate) fn bound_error(what: String) -> ExecutionError {
    let mut s = STATE.get();
    s.exceeded = true;
    STATE.set(s);
    LAST_BOUND.with_borrow_mut(|m| m.clone_from(&what));
    ExecutionError::function_error("bounds", what)
}

pub(crate) fn charge(units: u64) -> Result<(), ExecutionError> {
    let mut s = STATE.get();
    if !s.active {
        return Ok(());
    }
    if s.expr_left < units {
        s.expr_left = 0;
        STATE.set(s);
        return Err(bound_error(format!(
            "expression cost budget of {} units exceeded",
            s.expr_max
        )));
    }
    if s.request_left < units {
        s.request_left = 0;
        STATE.set(s);
        return Err(bound_error("request cost budget exceeded".into()));
    }
    s.expr_left -= units;
    s.request_left -= units;
    STATE.set(s);
    Ok(())
}

pub(crate) fn check_string(len: usize) -> Result<(), ExecutionError> {
    let s = STATE.get();
    if s.active && len > s.max_string {
        return Err(bound_error(format!(
            "string of {len} bytes exceeds the limit of {} bytes",
            s.max_string
        )));
    }
    Ok(())
}

pub(crate) fn check_list(len: usize) -> Result<(), ExecutionError> {
    let s = STATE.get();
    if s.active && len > s.max_list {
        return Err(bound_error(format!(
            "list of {len} elements exceeds the limit of {} elements",
            s.max_list
        )));
    }
    Ok(())
}

/// Shallow size check and charge of a value an operation built.
fn check_value(v: &Value) -> Result<(), ExecutionError> {
    match v {
        Value::String(s) => {
            check_string(s.len())?;
            charge(1 + s.len() as u64 / 64)
        }
        Value::Bytes(b) => {
            check_string(b.len())?;
            charge(1 + b.len() as u64 / 64)
        }
        // Building a list copies its elements (string bytes included).
        Value::List(l) => {
            check_list(l.len())?;
            let bytes: usize = l
                .iter()
                .map(|x| match x {
                    Value::String(s) => s.len(),
                    _ => 0,
                })
                .sum();
            charge(1 + l.len() as u64 + bytes as u64 / 64)
        }
        Value::Map(m) => {
            check_list(m.map.len())?;
            charge(1 + m.map.len() as u64)
        }
        _ => charge(1),
    }
}

/// Size of a value's rendering, counting string bytes and one per element, stopping at `cap`.
fn deep_size(v: &Value, cap: usize) -> usize {
    fn walk(v: &Value, acc: &mut usize, cap: usize) {
        if *acc > cap {
            return;
        }
        match v {
            Value::String(s) => *acc += s.len() + 2,
            Value::Bytes(b) => *acc += b.len() * 2,
            Value::List(l) => {
                *acc += 2;
                for x in l.iter() {
                    walk(x, acc, cap);
                    *acc += 2;
                }
            }
            Value::Map(m) => {
                *acc += 2;
                for (k, x) in m.map.iter() {
                    *acc += match k {
                        kube_cel::cel::objects::Key::String(s) => s.len() + 4,
                        _ => 24,
                    };
                    walk(x, acc, cap);
                }
            }
            _ => *acc += 24,
        }
    }
    let mut acc = 0;
    stacker::maybe_grow(256 * 1024, 4 << 20, || walk(v, &mut acc, cap));
    acc
}

fn arg(ftx: &FunctionContext, i: usize) -> ResolveResult {
    match ftx.args.get(i) {
        Some(e) => Value::resolve(e, ftx.ptx),
        None => Err(ExecutionError::invalid_argument_count(
            i + 1,
            ftx.args.len(),
        )),
    }
}

/// Cost units of copying a value of the interpreter: one per node and per 64 string bytes,
/// nested lists and maps included; stops counting above `cap`.
fn val_weight(v: &dyn Val, cap: u64) -> u64 {
    fn walk(v: &dyn Val, acc: &mut u64, cap: u64) {
        if *acc > cap {
            return;
        }
        *acc += 1;
        if let Some(s) = v.downcast_ref::<CelString>() {
            *acc += s.inner().len() as u64 / 64;
        } else if let Some(l) = v.downcast_ref::<CelList>() {
            l.inner().iter().for_each(|x| walk(x.as_ref(), acc, cap));
        } else if let Some(m) = v.downcast_ref::<CelMap>() {
            m.inner().values().for_each(|x| walk(x.as_ref(), acc, cap));
        }
    }
    let mut acc = 0;
    stacker::maybe_grow(256 * 1024, 4 << 20, || walk(v, &mut acc, cap));
    acc
}

/// One comprehension iteration. The interpreter copies the accumulator on every step, so a
/// list accumulator (`map`, `filter`) costs its whole size each time, nested values included:
/// about n²/2 for n small elements.
fn tick(ftx: &FunctionContext) -> ResolveResult {
    let cap = STATE.get().expr_left;
    let (len, weight) = ftx
        .ptx
        .get_variable("@result")
        .and_then(|v| {
            v.downcast_ref::<CelList>()
                .map(|l| (l.inner().len(), val_weight(v.as_ref(), cap)))
        })
        .unwrap_or((0, 0));
    check_list(len)?;
    charge(1 + weight)?;
    arg(ftx, 0)
}

/// Charges the size of a compared operand, which equality walks node by node.
fn weigh_value(v: &Value) -> Result<(), ExecutionError> {
    fn walk(v: &Value, acc: &mut u64, cap: u64) {
        if *acc > cap {
            return;
        }
        *acc += 1;
        match v {
            Value::String(s) => *acc += s.len() as u64 / 64,
            Value::List(l) => l.iter().for_each(|x| walk(x, acc, cap)),
            Value::Map(m) => m.map.values().for_each(|x| walk(x, acc, cap)),
            _ => {}
        }
    }
    let cap = STATE.get().expr_left;
    let mut weight = 0;
    stacker::maybe_grow(256 * 1024, 4 << 20, || walk(v, &mut weight, cap));
    charge(weight)
}

/// Both operands of a comparison, charged by size (literals are small and not charged).
fn operands(ftx: &FunctionContext) -> Result<(Value, Value), ExecutionError> {
    let weighed = |i: usize| -> ResolveResult {
        let v = arg(ftx, i)?;
        if !matches!(ftx.args[i].expr, Expr::Literal(_)) {
            weigh_value(&v)?;
        }
        Ok(v)
    };
    Ok((weighed(0)?, weighed(1)?))
}

/// CEL equality: numbers compare by value across `int`, `uint` and `double`, lists element
/// by element, maps by key; values of different types are not equal.
pub(crate) fn cel_equals(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::List(x), Value::List(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| cel_equals(p, q))
        }
        // Keys match across numeric types too (`{1: 'a'} == {1u: 'a'}`).
        (Value::Map(x), Value::Map(y)) => {
            x.map.len() == y.map.len()
                && x.map.iter().all(|(k, v)| {
                    keys_of(&Value::from(k))
                        .iter()
                        .find_map(|k| y.map.get(k))
                        .is_some_and(|w| cel_equals(v, w))
                })
        }
        _ => a == b,
    }
}

fn eq(ftx: &FunctionContext) -> ResolveResult {
    let (a, b) = operands(ftx)?;
    Ok(Value::Bool(cel_equals(&a, &b)))
}

fn ne(ftx: &FunctionContext) -> ResolveResult {
    let (a, b) = operands(ftx)?;
    Ok(Value::Bool(!cel_equals(&a, &b)))
}

fn ordering(ftx: &FunctionContext) -> Result<std::cmp::Ordering, ExecutionError> {
    let (a, b) = operands(ftx)?;
    match (&a, &b) {
        (Value::Bytes(x), Value::Bytes(y)) => Ok(x.cmp(y)),
        // null, lists and maps have no order.
        (Value::Null | Value::List(_) | Value::Map(_), _) => Err(ExecutionError::NoSuchOverload),
        _ => a.partial_cmp(&b).ok_or(ExecutionError::NoSuchOverload),
    }
}

/// `__hearth_entries(range)`: what a two-variable comprehension iterates, as `[key, value]`
/// pairs: `[index, element]` for a list, `[key, value]` for a map.
fn entries(ftx: &FunctionContext) -> ResolveResult {
    let range = arg(ftx, 0)?;
    let pairs: Vec<Value> = match &range {
        Value::List(l) => l
            .iter()
            .enumerate()
            .map(|(i, x)| Value::List(std::sync::Arc::new(vec![Value::Int(i as i64), x.clone()])))
            .collect(),
        Value::Map(m) => m
            .map
            .iter()
            .map(|(k, v)| Value::List(std::sync::Arc::new(vec![Value::from(k), v.clone()])))
            .collect(),
        _ => return Err(ExecutionError::NoSuchOverload),
    };
    check_list(pairs.len())?;
    charge(1 + pairs.len() as u64)?;
    Ok(Value::List(std::sync::Arc::new(pairs)))
}

/// `__hearth_put(map, key, value)`: `map` with `key` set (what `transformMap` accumulates).
fn put(ftx: &FunctionContext) -> ResolveResult {
    let (Value::Map(m), key, value) = (arg(ftx, 0)?, arg(ftx, 1)?, arg(ftx, 2)?) else {
        return Err(ExecutionError::NoSuchOverload);
    };
    let key = keys_of(&key)
        .into_iter()
        .next()
        .filter(|_| !matches!(key, Value::Float(_)))
        .ok_or(ExecutionError::NoSuchOverload)?;
    let mut map = m.map.as_ref().clone();
    map.insert(key, value);
    check_list(map.len())?;
    charge(1 + map.len() as u64)?;
    Ok(Value::Map(kube_cel::cel::objects::Map {
        map: std::sync::Arc::new(map),
    }))
}

fn lt(ftx: &FunctionContext) -> ResolveResult {
    Ok(Value::Bool(ordering(ftx)?.is_lt()))
}

fn le(ftx: &FunctionContext) -> ResolveResult {
    Ok(Value::Bool(ordering(ftx)?.is_le()))
}

fn gt(ftx: &FunctionContext) -> ResolveResult {
    Ok(Value::Bool(ordering(ftx)?.is_gt()))
}

fn ge(ftx: &FunctionContext) -> ResolveResult {
    Ok(Value::Bool(ordering(ftx)?.is_ge()))
}

/// The map keys a value may be found under: a number under any numeric key of the same value.
pub(crate) fn keys_of(v: &Value) -> Vec<kube_cel::cel::objects::Key> {
    use kube_cel::cel::objects::Key;
    match v {
        Value::String(s) => vec![Key::String(s.clone())],
        Value::Bool(b) => vec![Key::Bool(*b)],
        Value::Int(i) => {
            let mut k = vec![Key::Int(*i)];
            k.extend(u64::try_from(*i).ok().map(Key::Uint));
            k
        }
        Value::UInt(u) => {
            let mut k = vec![Key::Uint(*u)];
            k.extend(i64::try_from(*u).ok().map(Key::Int));
            k
        }
        Value::Float(f) if f.fract() == 0.0 && f.is_finite() => {
            let mut k = Vec::new();
            if *f >= i64::MIN as f64 && *f < i64::MAX as f64 {
                k.push(Key::Int(*f as i64));
            }
            if *f >= 0.0 && *f < u64::MAX as f64 {
                k.push(Key::Uint(*f as u64));
            }
            k
        }
        _ => Vec::new(),
    }
}

fn in_(ftx: &FunctionContext) -> ResolveResult {
    let (x, container) = operands(ftx)?;
    match &container {
        Value::List(l) => Ok(Value::Bool(l.iter().any(|y| cel_equals(&x, y)))),
        Value::Map(m) => Ok(Value::Bool(
            keys_of(&x).iter().any(|k| m.map.contains_key(k)),
        )),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

/// `size`: strings count code points (as cel-go), bytes bytes, lists and maps entries.
fn size_of(ftx: &FunctionContext, This(this): This<Value>) -> Result<i64, ExecutionError> {
    Ok(match this {
        Value::String(s) => s.chars().count() as i64,
        Value::Bytes(b) => b.len() as i64,
        Value::List(l) => l.len() as i64,
        Value::Map(m) => m.map.len() as i64,
        other => return Err(ftx.error(format!("cannot determine the size of {other:?}"))),
    })
}

/// `bool(x)`: a bool, or a string spelling one as Go's `strconv.ParseBool` reads it.
fn to_bool(ftx: &FunctionContext, This(this): This<Value>) -> Result<bool, ExecutionError> {
    match this {
        Value::Bool(b) => Ok(b),
        Value::String(s) => match s.as_str() {
            "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
            "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
            other => Err(ftx.error(format!("cannot convert '{other}' to bool"))),
        },
        other => Err(ftx.error(format!("cannot convert {other:?} to bool"))),
    }
}

fn size(ftx: &FunctionContext) -> ResolveResult {
    let v = arg(ftx, 0)?;
    check_value(&v)?;
    Ok(v)
}

fn pre_join(ftx: &FunctionContext) -> ResolveResult {
    let list = arg(ftx, 0)?;
    let sep_len = match ftx.args.len() {
        2 => match arg(ftx, 1)? {
            Value::String(s) => s.len(),
            _ => 0,
        },
        _ => 0,
    };
    if let Value::List(l) = &list {
        let mut total = sep_len.saturating_mul(l.len());
        for x in l.iter() {
            if let Value::String(s) = x {
                total = total.saturating_add(s.len());
            }
        }
        check_string(total)?;
        charge(1 + total as u64 / 64)?;
    }
    Ok(list)
}

fn pre_replace(ftx: &FunctionContext) -> ResolveResult {
    let target = arg(ftx, 0)?;
    if let (Value::String(s), Value::String(old), Value::String(new)) =
        (&target, arg(ftx, 1)?, arg(ftx, 2)?)
    {
        let matches = if old.is_empty() {
            s.chars().count() + 1
        } else {
            s.matches(old.as_str()).count()
        };
        let grown = s.len().saturating_add(matches.saturating_mul(new.len()));
        check_string(grown)?;
        charge(1 + grown as u64 / 64)?;
    }
    Ok(target)
}

fn pre_format(ftx: &FunctionContext) -> ResolveResult {
    let fmt = arg(ftx, 0)?;
    let args = arg(ftx, 1)?;
    let s = STATE.get();
    let fmt_len = match &fmt {
        Value::String(f) => f.len(),
        _ => 0,
    };
    let total = fmt_len.saturating_add(deep_size(&args, s.max_string.saturating_add(1)));
    check_string(total)?;
    charge(1 + total as u64 / 64)?;
    Ok(fmt)
}

fn pre_range(ftx: &FunctionContext) -> ResolveResult {
    let n = arg(ftx, 0)?;
    if let Value::Int(i) = n {
        check_list(i.max(0) as usize)?;
        charge(1 + i.max(0) as u64)?;
    }
    Ok(n)
}

/// `__hearth_path(root, 'f1', 'f2', ...)`: `root.f1.f2...` without copying the intermediate
/// maps (the interpreter's selection copies each one).
fn path(ftx: &FunctionContext) -> ResolveResult {
    let Some(Expr::Ident(name)) = ftx.args.first().map(|a| &a.expr) else {
        return Err(ExecutionError::function_error(PATH, "needs an identifier"));
    };
    let root = ftx
        .ptx
        .get_variable(name)
        .ok_or_else(|| ExecutionError::undeclared_reference(name))?;
    walk(root.as_ref(), &ftx.args[1..])
}

fn walk(cur: &dyn Val, keys: &[IdedExpr]) -> ResolveResult {
    let Some((first, rest)) = keys.split_first() else {
        return cur.try_into();
    };
    let Expr::Literal(LiteralValue::String(key)) = &first.expr else {
        return Err(ExecutionError::function_error(
            PATH,
            "field names are strings",
        ));
    };
    if cur.get_type() == MAP_TYPE
        && let Some(indexer) = cur.as_indexer()
    {
        return match indexer.get(key)? {
            Cow::Borrowed(next) => walk(next, rest),
            Cow::Owned(next) => walk(next.as_ref(), rest),
        };
    }
    // Not a map: an optional value, or an error.
    let mut v: Value = cur.try_into()?;
    for k in keys {
        let Expr::Literal(LiteralValue::String(k)) = &k.expr else {
            return Err(ExecutionError::function_error(
                PATH,
                "field names are strings",
            ));
        };
        v = select_value(v, k.inner())?;
    }
    Ok(v)
}

fn optional(v: Option<Value>) -> Value {
    use kube_cel::cel::objects::OptionalValue;
    Value::Opaque(std::sync::Arc::new(match v {
        Some(v) => OptionalValue::of(v),
        None => OptionalValue::none(),
    }))
}

/// The value inside an optional: `Some(None)` for `optional.none()`, `None` when `v` is not
/// an optional.
fn optional_inner(v: &Value) -> Option<Option<Value>> {
    use kube_cel::cel::objects::OptionalValue;
    match v {
        Value::Opaque(o) => o
            .downcast_ref::<OptionalValue>()
            .map(|o| o.value().cloned()),
        _ => None,
    }
}

fn map_key_error(k: &Value) -> ExecutionError {
    match k {
        Value::String(s) => ExecutionError::no_such_key(s),
        other => ExecutionError::NoSuchKey(std::sync::Arc::new(format!("{other:?}"))),
    }
}

/// `v.field`: a map's entry; on an optional, the optional of the entry (none when absent).
fn select_value(v: Value, field: &str) -> ResolveResult {
    if let Some(inner) = optional_inner(&v) {
        return match inner {
            None => Ok(optional(None)),
            // A map without the entry gives none; a value without fields is an error.
            Some(Value::Map(m)) => Ok(optional(
                m.map
                    .get(&kube_cel::cel::objects::Key::String(std::sync::Arc::new(
                        field.to_owned(),
                    )))
                    .cloned(),
            )),
            Some(x) => Ok(optional(Some(select_value(x, field)?))),
        };
    }
    match v {
        Value::Map(m) => m
            .map
            .get(&kube_cel::cel::objects::Key::String(std::sync::Arc::new(
                field.to_owned(),
            )))
            .cloned()
            .ok_or_else(|| ExecutionError::no_such_key(field)),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

/// `v[k]` (`optional` for `v[?k]`): list elements by any integral number, map entries by
/// key with numbers equal across types; on an optional, the optional of the element.
fn index_value(v: Value, k: &Value, opt: bool) -> ResolveResult {
    if let Some(inner) = optional_inner(&v) {
        return match inner {
            None => Ok(optional(None)),
            Some(x) => index_value(x, k, true),
        };
    }
    let found = match &v {
        Value::List(l) => {
            let i = match k {
                Value::Int(i) => Some(*i),
                Value::UInt(u) => i64::try_from(*u).ok(),
                Value::Float(f) if f.fract() == 0.0 && f.is_finite() => Some(*f as i64),
                _ => return Err(ExecutionError::NoSuchOverload),
            };
            match i
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| l.get(i))
            {
                Some(x) => Some(x.clone()),
                None if opt => None,
                None => return Err(ExecutionError::IndexOutOfBounds(k.clone())),
            }
        }
        Value::Map(m) => match keys_of(k).iter().find_map(|key| m.map.get(key)) {
            Some(x) => Some(x.clone()),
            None if opt => None,
            None if matches!(
                k,
                Value::String(_)
                    | Value::Int(_)
                    | Value::UInt(_)
                    | Value::Bool(_)
                    | Value::Float(_)
            ) =>
            {
                return Err(map_key_error(k));
            }
            None => return Err(ExecutionError::NoSuchOverload),
        },
        _ => return Err(ExecutionError::NoSuchOverload),
    };
    Ok(if opt {
        optional(found)
    } else {
        found.unwrap_or(Value::Null)
    })
}

fn field_name(ftx: &FunctionContext) -> Result<std::sync::Arc<String>, ExecutionError> {
    match arg(ftx, 1)? {
        Value::String(s) => Ok(s),
        _ => Err(ExecutionError::function_error(
            SELECT,
            "field names are strings",
        )),
    }
}

fn select(ftx: &FunctionContext) -> ResolveResult {
    let operand = operand(ftx)?;
    let field = field_name(ftx)?;
    // A map's entry by reference, without copying the map.
    if operand.get_type() == MAP_TYPE
        && let Some(indexer) = operand.as_indexer()
        && let Ok(v) = indexer.get(&CelString::from(field.as_str()))
    {
        return v.as_ref().try_into();
    }
    select_value(operand.as_ref().try_into()?, &field)
}

/// The first argument as the interpreter holds it (not converted).
fn operand<'a>(ftx: &'a FunctionContext) -> Result<Cow<'a, dyn Val>, ExecutionError> {
    let e = ftx
        .args
        .first()
        .ok_or_else(|| ExecutionError::invalid_argument_count(1, 0))?;
    Value::resolve_val(e, ftx.ptx)
}

fn opt_select(ftx: &FunctionContext) -> ResolveResult {
    let v = arg(ftx, 0)?;
    let field = field_name(ftx)?;
    let inner = match optional_inner(&v) {
        Some(None) => return Ok(optional(None)),
        Some(Some(x)) => x,
        None => v,
    };
    match inner {
        Value::Map(_) => Ok(optional(select_value(inner, &field).ok())),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

/// `has(v.field)`: whether a map has the entry; on an optional, whether it holds a value
/// that has it.
fn has(ftx: &FunctionContext) -> ResolveResult {
    let v = arg(ftx, 0)?;
    let field = field_name(ftx)?;
    let v = match optional_inner(&v) {
        Some(None) => return Ok(Value::Bool(false)),
        Some(Some(x)) => x,
        None => v,
    };
    match v {
        Value::Map(m) => Ok(Value::Bool(
            m.map
                .contains_key(&kube_cel::cel::objects::Key::String(field)),
        )),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

fn index(ftx: &FunctionContext) -> ResolveResult {
    let container = operand(ftx)?;
    let key = arg(ftx, 1)?;
    // A list element or a map entry by reference, without copying the container.
    if let Some(l) = container.downcast_ref::<CelList>() {
        if let Value::Int(i) = key
            && let Some(x) = usize::try_from(i).ok().and_then(|i| l.inner().get(i))
        {
            return x.as_ref().try_into();
        }
    } else if container.get_type() == MAP_TYPE
        && let Value::String(k) = &key
        && let Some(indexer) = container.as_indexer()
        && let Ok(v) = indexer.get(&CelString::from(k.as_str()))
    {
        return v.as_ref().try_into();
    }
    index_value(container.as_ref().try_into()?, &key, false)
}

fn opt_index(ftx: &FunctionContext) -> ResolveResult {
    index_value(arg(ftx, 0)?, &arg(ftx, 1)?, true)
}

/// A CEL type as a value (`type(x)`, `int`, `string`, …), compared by name.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TypeValue(pub(crate) String);

impl kube_cel::cel::objects::Opaque for TypeValue {
    fn runtime_type_name(&self) -> &str {
        "type"
    }
}

/// The name of the type a type value stands for, when `v` is one.
pub(crate) fn type_value_name(v: &Value) -> Option<&str> {
    match v {
        Value::Opaque(o) => o.downcast_ref::<TypeValue>().map(|t| t.0.as_str()),
        _ => None,
    }
}

fn type_value(name: &str) -> Value {
    Value::Opaque(std::sync::Arc::new(TypeValue(name.to_owned())))
}

/// `type(x)`.
fn type_of(ftx: &FunctionContext) -> ResolveResult {
    let v = arg(ftx, 0)?;
    let name = match &v {
        Value::Null => "null_type",
        Value::Bool(_) => "bool",
        Value::Int(_) => "int",
        Value::UInt(_) => "uint",
        Value::Float(_) => "double",
        Value::String(_) => "string",
        Value::Bytes(_) => "bytes",
        Value::List(_) => "list",
        Value::Map(_) => "map",
        Value::Duration(_) => "google.protobuf.Duration",
        Value::Timestamp(_) => "google.protobuf.Timestamp",
        Value::Function(..) => "function",
        Value::Opaque(o) => match o.runtime_type_name() {
            "optional_type" => "optional_type",
            n => n,
        },
    };
    Ok(type_value(name))
}

/// `__hearth_map_literal({...}, n)`: the map, or an error when its `n` entries repeat a key.
fn map_literal(ftx: &FunctionContext) -> ResolveResult {
    use kube_cel::cel::objects::Key;
    let (map, n) = (arg(ftx, 0)?, arg(ftx, 1)?);
    if let (Value::Map(m), Value::Int(n)) = (&map, n) {
        let numeric_twins = m.map.keys().any(|k| match k {
            Key::Int(i) => u64::try_from(*i).is_ok_and(|u| m.map.contains_key(&Key::Uint(u))),
            _ => false,
        });
        if (m.map.len() as i64) < n || numeric_twins {
            return Err(ftx.error("repeated key in a map literal"));
        }
    }
    Ok(map)
}

/// `all` (`decides` false) or `exists` (`decides` true): the first element whose predicate
/// gives `decides` decides; otherwise an element's error is the result, else `!decides`.
fn quantify(ftx: &FunctionContext, decides: bool) -> ResolveResult {
    let range = operand(ftx)?;
    let Some(Expr::Literal(LiteralValue::String(var))) = ftx.args.get(1).map(|a| &a.expr) else {
        return Err(ExecutionError::function_error(ALL, "needs a variable name"));
    };
    let predicate = ftx
        .args
        .get(2)
        .ok_or_else(|| ExecutionError::invalid_argument_count(3, ftx.args.len()))?;
    // A list's elements are converted one at a time, not the whole list at once.
    let items: Vec<&dyn Val> = match range.downcast_ref::<CelList>() {
        Some(l) => l.inner().iter().map(|x| x.as_ref()).collect(),
        None => Vec::new(),
    };
    let keys: Vec<Value> = if range.downcast_ref::<CelList>().is_some() {
        Vec::new()
    } else {
        match range.as_ref().try_into()? {
            Value::Map(m) => m.map.keys().map(Value::from).collect(),
            _ => return Err(ExecutionError::NoSuchOverload),
        }
    };
    let mut error = None;
    let values = items
        .into_iter()
        .map(|x| x.try_into())
        .chain(keys.into_iter().map(Ok));
    for item in values {
        let item: Value = item?;
        charge(1)?;
        let mut scope = ftx.ptx.new_inner_scope();
        scope.add_variable_from_value(var.inner(), item);
        match Value::resolve(predicate, &scope) {
            Ok(Value::Bool(b)) if b == decides => return Ok(Value::Bool(decides)),
            Ok(Value::Bool(_)) => {}
            // A bound stops the whole expression.
            Err(e) if exceeded() => return Err(e),
            Err(e) => {
                error.get_or_insert(e);
            }
            Ok(_) => {
                error.get_or_insert(ExecutionError::NoSuchOverload);
            }
        }
    }
    match error {
        Some(e) => Err(e),
        None => Ok(Value::Bool(!decides)),
    }
}

fn all(ftx: &FunctionContext) -> ResolveResult {
    quantify(ftx, false)
}

fn exists(ftx: &FunctionContext) -> ResolveResult {
    quantify(ftx, true)
}

fn neg(ftx: &FunctionContext) -> ResolveResult {
    match arg(ftx, 0)? {
        Value::Int(i) => i
            .checked_neg()
            .map(Value::Int)
            .ok_or_else(|| ftx.error("integer overflow")),
        Value::Float(f) => Ok(Value::Float(-f)),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

/// Timestamps from year 1 to 9999 and durations of at most 2^63-1 nanoseconds, as cel-go.
fn in_range(v: Value, ftx: &FunctionContext) -> ResolveResult {
    match &v {
        Value::Timestamp(t) if !(-62_135_596_800..=253_402_300_799).contains(&t.timestamp()) => {
            Err(ftx.error("timestamp out of range"))
        }
        Value::Duration(d) if d.num_nanoseconds().is_none() => {
            Err(ftx.error("duration out of range"))
        }
        _ => Ok(v),
    }
}

fn timestamp_of(ftx: &FunctionContext) -> ResolveResult {
    let v = match arg(ftx, 0)? {
        v @ Value::Timestamp(_) => v,
        Value::Int(secs) => chrono::DateTime::from_timestamp(secs, 0)
            .map(|t| Value::Timestamp(t.fixed_offset()))
            .ok_or_else(|| ftx.error("timestamp out of range"))?,
        v => call_library("timestamp", v, ftx)?,
    };
    in_range(v, ftx)
}

fn duration_of(ftx: &FunctionContext) -> ResolveResult {
    let v = match arg(ftx, 0)? {
        v @ Value::Duration(_) => v,
        v => match call_library("duration", v, ftx)? {
            // The library's parser saturates at the limit instead of failing.
            Value::Duration(d) if saturated(&d) => {
                return Err(ftx.error("duration out of range"));
            }
            v => v,
        },
    };
    in_range(v, ftx)
}

/// Whether a parsed duration sits at the limit the parser saturates to.
pub(crate) fn saturated(d: &chrono::Duration) -> bool {
    d.num_nanoseconds()
        .is_none_or(|n| n == i64::MAX || n == -i64::MAX || n == i64::MIN)
}

/// Whether `v` is a timestamp, duration or bytes, which the interpreter's own `+` and `-`
/// get wrong (`duration + timestamp`, ranges, bytes).
fn time_or_bytes(v: &dyn Val) -> bool {
    use kube_cel::cel::common::types::{BYTES_TYPE, DURATION_TYPE, TIMESTAMP_TYPE};
    let t = v.get_type();
    t == DURATION_TYPE || t == TIMESTAMP_TYPE || t == BYTES_TYPE
}

/// `a + b`: the interpreter's addition over its own values (no copy of the operands), by
/// value for timestamps, durations and bytes; the result is size-checked and charged.
fn add(ftx: &FunctionContext) -> ResolveResult {
    let a = operand(ftx)?;
    let b = Value::resolve_val(
        ftx.args
            .get(1)
            .ok_or_else(|| ExecutionError::invalid_argument_count(2, ftx.args.len()))?,
        ftx.ptx,
    )?;
    let sum = if time_or_bytes(a.as_ref()) || time_or_bytes(b.as_ref()) {
        match (a.as_ref().try_into()?, b.as_ref().try_into()?) {
            (Value::Bytes(x), Value::Bytes(y)) => {
                let mut out = Vec::with_capacity(x.len() + y.len());
                out.extend_from_slice(&x);
                out.extend_from_slice(&y);
                Value::Bytes(std::sync::Arc::new(out))
            }
            (x, y) => in_range((x + y)?, ftx)?,
        }
    } else {
        let adder = a.as_adder().ok_or(ExecutionError::NoSuchOverload)?;
        adder.add(b.as_ref())?.as_ref().try_into()?
    };
    check_value(&sum)?;
    Ok(sum)
}

/// `a - b`, as [`add`].
fn sub(ftx: &FunctionContext) -> ResolveResult {
    let a = operand(ftx)?;
    let b = Value::resolve_val(
        ftx.args
            .get(1)
            .ok_or_else(|| ExecutionError::invalid_argument_count(2, ftx.args.len()))?,
        ftx.ptx,
    )?;
    if time_or_bytes(a.as_ref()) || time_or_bytes(b.as_ref()) {
        let (x, y): (Value, Value) = (a.as_ref().try_into()?, b.as_ref().try_into()?);
        return in_range((x - y)?, ftx);
    }
    let subtractor = a.as_subtractor().ok_or(ExecutionError::NoSuchOverload)?;
    subtractor.sub(b.as_ref())?.as_ref().try_into()
}

/// `getMilliseconds()`: of a duration, its milliseconds part; of a timestamp, the library's.
fn millis(ftx: &FunctionContext) -> ResolveResult {
    let target = arg(ftx, 0)?;
    if let (Value::Duration(d), 1) = (&target, ftx.args.len()) {
        return Ok(Value::Int(i64::from(d.subsec_nanos() / 1_000_000)));
    }
    let args = (1..ftx.args.len())
        .map(|i| arg(ftx, i))
        .collect::<Result<Vec<_>, _>>()?;
    call_method("getMilliseconds", target, args, ftx)
}

fn bytes_of(ftx: &FunctionContext) -> ResolveResult {
    match arg(ftx, 0)? {
        v @ Value::Bytes(_) => Ok(v),
        v => call_library("bytes", v, ftx),
    }
}

/// A double as cel-go's `format` writes a non-finite one.
fn non_finite(f: f64) -> Option<&'static str> {
    if f.is_nan() {
        Some("NaN")
    } else if f == f64::INFINITY {
        Some("Infinity")
    } else if f == f64::NEG_INFINITY {
        Some("-Infinity")
    } else {
        None
    }
}

/// `%s` of a value as cel-go writes it: strings bare, lists `[a, b]`, maps `{k: v}` in key
/// order, timestamps in RFC 3339, durations in seconds. `None` for what the library renders
/// the same way itself.
fn format_text(v: &Value, nested: bool) -> Option<String> {
    Some(match v {
        Value::String(s) if nested => s.as_str().to_owned(),
        Value::Null if nested => "null".into(),
        Value::Bool(b) if nested => b.to_string(),
        Value::Int(i) if nested => i.to_string(),
        Value::UInt(u) if nested => u.to_string(),
        Value::Float(f) => match non_finite(*f) {
            Some(t) => t.to_owned(),
            None if nested => f.to_string(),
            None => return None,
        },
        Value::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
        Value::Timestamp(t) => t
            .with_timezone(&chrono::Utc)
            .to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
        Value::Duration(d) => duration_text(d),
        Value::List(l) => {
            let items: Option<Vec<String>> = l.iter().map(|x| format_text(x, true)).collect();
            format!("[{}]", items?.join(", "))
        }
        Value::Map(m) => {
            let mut entries: Vec<(String, String)> = m
                .map
                .iter()
                .map(|(k, x)| Some((format_text(&Value::from(k), true)?, format_text(x, true)?)))
                .collect::<Option<_>>()?;
            entries.sort();
            let entries: Vec<String> = entries
                .into_iter()
                .map(|(k, x)| format!("{k}: {x}"))
                .collect();
            format!("{{{}}}", entries.join(", "))
        }
        v => match type_value_name(v) {
            Some(name) => name.to_owned(),
            None => return None,
        },
    })
}

fn format(ftx: &FunctionContext) -> ResolveResult {
    let (fmt, args) = (arg(ftx, 0)?, arg(ftx, 1)?);
    let (Value::String(f), Value::List(list)) = (&fmt, &args) else {
        return call_method("format", fmt, vec![args], ftx);
    };
    let mut out = String::with_capacity(f.len());
    let mut rendered = Vec::with_capacity(list.len());
    let mut next = 0;
    let mut chars = f.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = String::from('%');
        while let Some(&d) = chars.peek() {
            spec.push(d);
            chars.next();
            if d.is_ascii_alphabetic() || d == '%' {
                break;
            }
        }
        let verb = spec.chars().last().unwrap_or('%');
        if verb == '%' || spec.len() < 2 {
            out.push_str(&spec);
            continue;
        }
        let Some(v) = list.get(next) else {
            out.push_str(&spec);
            continue;
        };
        next += 1;
        let text = match (verb, v) {
            ('s', v) => format_text(v, false),
            ('d' | 'f' | 'e', Value::Float(x)) => non_finite(*x).map(str::to_owned),
            _ => None,
        };
        match text {
            Some(t) => {
                out.push_str("%s");
                rendered.push(Value::String(std::sync::Arc::new(t)));
            }
            None => {
                out.push_str(&spec);
                rendered.push(v.clone());
            }
        }
    }
    rendered.extend(list.iter().skip(next).cloned());
    call_method(
        "format",
        Value::String(std::sync::Arc::new(out)),
        vec![Value::List(std::sync::Arc::new(rendered))],
        ftx,
    )
}

/// Calls the library method `name` on `target` with `args`.
fn call_method(
    name: &str,
    target: Value,
    args: Vec<Value>,
    ftx: &FunctionContext,
) -> ResolveResult {
    let mut scope = ftx.ptx.new_inner_scope();
    scope.add_variable_from_value("#target", target);
    let mut idents = Vec::with_capacity(args.len());
    for (i, a) in args.into_iter().enumerate() {
        let n = format!("#arg{i}");
        scope.add_variable_from_value(n.clone(), a);
        idents.push(IdedExpr {
            id: 0,
            expr: Expr::Ident(n),
        });
    }
    let expr = IdedExpr {
        id: 0,
        expr: Expr::Call(kube_cel::cel::common::ast::CallExpr {
            func_name: name.to_owned(),
            target: Some(Box::new(IdedExpr {
                id: 0,
                expr: Expr::Ident("#target".into()),
            })),
            args: idents,
        }),
    };
    Value::resolve(&expr, &scope)
}

fn string_method(ftx: &FunctionContext) -> ResolveResult {
    let Some(Expr::Literal(LiteralValue::String(name))) = ftx.args.first().map(|a| &a.expr) else {
        return Err(ExecutionError::function_error(
            STRING_METHOD,
            "needs a name",
        ));
    };
    let name = name.inner();
    let target = arg(ftx, 1)?;
    let args = (2..ftx.args.len())
        .map(|i| arg(ftx, i))
        .collect::<Result<Vec<_>, _>>()?;
    if let Value::String(text) = &target {
        let len = text.chars().count() as i64;
        let bad = |why: &str| Err(ftx.error(format!("{name}: {why}")));
        use Value::{Int, String as Str};
        match (name, args.as_slice()) {
            ("indexOf", [Str(_)]) | ("lastIndexOf", [Str(_)]) => {}
            ("indexOf", [Str(_), Int(o)]) if (0..=len).contains(o) => {}
            ("lastIndexOf", [Str(_), Int(o)]) if *o >= 0 && (*o < len || len == 0) => {}
            ("indexOf" | "lastIndexOf", [Str(_), Int(_)]) => return bad("index out of range"),
            ("replace", [Str(_), Str(_)] | [Str(_), Str(_), Int(_)]) => {}
            ("split", [Str(_)] | [Str(_), Int(_)]) => {}
            ("substring", [Int(_)] | [Int(_), Int(_)]) => {}
            _ => return bad("no such overload for these arguments"),
        }
    }
    call_method(name, target, args, ftx)
}

/// `__hearth_bind('v', init, body)`.
fn bind(ftx: &FunctionContext) -> ResolveResult {
    let Some(Expr::Literal(LiteralValue::String(name))) = ftx.args.first().map(|a| &a.expr) else {
        return Err(ExecutionError::function_error(
            BIND,
            "needs a variable name",
        ));
    };
    let init = arg(ftx, 1)?;
    let body = ftx
        .args
        .get(2)
        .ok_or_else(|| ExecutionError::invalid_argument_count(3, ftx.args.len()))?;
    let mut scope = ftx.ptx.new_inner_scope();
    scope.add_variable_from_value(name.inner(), init);
    Value::resolve(body, &scope)
}

/// `format.named(name)`: the named format as an optional (none for an unknown name), as the
/// apiserver's library returns it.
fn format_named(ftx: &FunctionContext) -> ResolveResult {
    let Value::String(name) = arg(ftx, 0)? else {
        return Err(ExecutionError::NoSuchOverload);
    };
    let lookup = IdedExpr {
        id: 0,
        expr: Expr::Call(kube_cel::cel::common::ast::CallExpr {
            func_name: name.as_str().to_owned(),
            target: Some(Box::new(IdedExpr {
                id: 0,
                expr: Expr::Ident("format".into()),
            })),
            args: Vec::new(),
        }),
    };
    let known = name.chars().all(|c| c.is_ascii_alphanumeric()) && name.as_str() != "named";
    Ok(optional(if known {
        Value::resolve(&lookup, ftx.ptx).ok()
    } else {
        None
    }))
}

fn int_operands(ftx: &FunctionContext, n: usize) -> Result<Vec<Value>, ExecutionError> {
    (0..n).map(|i| arg(ftx, i)).collect()
}

/// `math.bitAnd`, `bitOr`, `bitXor` over two ints or two uints.
fn bit_binary(ftx: &FunctionContext, op: fn(u64, u64) -> u64) -> ResolveResult {
    match int_operands(ftx, 2)?.as_slice() {
        [Value::Int(a), Value::Int(b)] => Ok(Value::Int(op(*a as u64, *b as u64) as i64)),
        [Value::UInt(a), Value::UInt(b)] => Ok(Value::UInt(op(*a, *b))),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

fn bit_and(ftx: &FunctionContext) -> ResolveResult {
    bit_binary(ftx, |a, b| a & b)
}

fn bit_or(ftx: &FunctionContext) -> ResolveResult {
    bit_binary(ftx, |a, b| a | b)
}

fn bit_xor(ftx: &FunctionContext) -> ResolveResult {
    bit_binary(ftx, |a, b| a ^ b)
}

fn bit_not(ftx: &FunctionContext) -> ResolveResult {
    match arg(ftx, 0)? {
        Value::Int(a) => Ok(Value::Int(!a)),
        Value::UInt(a) => Ok(Value::UInt(!a)),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

/// Shifts: a negative amount is an error, 64 or more gives 0; right shifts are logical (the
/// bits of a negative int move as unsigned), as cel-go's.
fn bit_shift(ftx: &FunctionContext, left: bool) -> ResolveResult {
    let ops = int_operands(ftx, 2)?;
    let Value::Int(by) = ops[1] else {
        return Err(ExecutionError::NoSuchOverload);
    };
    if by < 0 {
        return Err(ftx.error(format!("negative offset: {by}")));
    }
    let shift = |x: u64| -> u64 {
        if by >= 64 {
            0
        } else if left {
            x << by
        } else {
            x >> by
        }
    };
    match ops[0] {
        Value::Int(x) => Ok(Value::Int(shift(x as u64) as i64)),
        Value::UInt(x) => Ok(Value::UInt(shift(x))),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

fn bit_shift_left(ftx: &FunctionContext) -> ResolveResult {
    bit_shift(ftx, true)
}

fn bit_shift_right(ftx: &FunctionContext) -> ResolveResult {
    bit_shift(ftx, false)
}

/// A duration as cel-go prints it: seconds, with the fraction when there is one (`90s`,
/// `1.5s`).
fn duration_text(d: &chrono::Duration) -> String {
    let nanos = d.num_nanoseconds().map(i128::from).unwrap_or_else(|| {
        i128::from(d.num_seconds()) * 1_000_000_000 + i128::from(d.subsec_nanos())
    });
    let (sign, nanos) = if nanos < 0 {
        ("-", -nanos)
    } else {
        ("", nanos)
    };
    let (secs, frac) = (nanos / 1_000_000_000, nanos % 1_000_000_000);
    if frac == 0 {
        format!("{sign}{secs}s")
    } else {
        let frac = format!("{frac:09}");
        format!("{sign}{secs}.{}s", frac.trim_end_matches('0'))
    }
}

/// `string(x)` for timestamps (RFC 3339 in UTC, `Z`), durations (seconds) and bytes (an
/// error unless UTF-8), as cel-go; other values by the libraries' `string`.
fn string_of(ftx: &FunctionContext) -> ResolveResult {
    let v = arg(ftx, 0)?;
    let text = match &v {
        Value::Timestamp(t) => t
            .with_timezone(&chrono::Utc)
            .to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
        Value::Duration(d) => duration_text(d),
        Value::Bytes(b) => std::str::from_utf8(b)
            .map_err(|e| ftx.error(format!("invalid UTF-8 in bytes: {e}")))?
            .to_owned(),
        _ => return call_library("string", v, ftx),
    };
    Ok(Value::String(std::sync::Arc::new(text)))
}

/// `int(x)` for timestamps (Unix seconds) and doubles (an error out of range), as cel-go;
/// other values by the libraries' `int`.
fn int_of(ftx: &FunctionContext) -> ResolveResult {
    let v = arg(ftx, 0)?;
    match &v {
        Value::Timestamp(t) => Ok(Value::Int(t.timestamp())),
        Value::Float(f) if !(-9.223_372_036_854_775e18..9.223_372_036_854_775e18).contains(f) => {
            Err(ftx.error(format!("{f} is out of the int range")))
        }
        _ => call_library("int", v, ftx),
    }
}

/// Calls the library function `name` with `v`.
fn call_library(name: &str, v: Value, ftx: &FunctionContext) -> ResolveResult {
    let mut scope = ftx.ptx.new_inner_scope();
    scope.add_variable_from_value("#v", v);
    let expr = IdedExpr {
        id: 0,
        expr: Expr::Call(kube_cel::cel::common::ast::CallExpr {
            func_name: name.to_owned(),
            target: None,
            args: vec![IdedExpr {
                id: 0,
                expr: Expr::Ident("#v".into()),
            }],
        }),
    };
    Value::resolve(&expr, &scope)
}

/// `__hearth_type('int')`: the type denotation `int`.
fn type_named(ftx: &FunctionContext) -> ResolveResult {
    match arg(ftx, 0)? {
        Value::String(s) => Ok(type_value(&s)),
        _ => Err(ExecutionError::function_error(TYPE_NAMED, "needs a name")),
    }
}

/// The standard `matches`, with the compiled size of the pattern bounded
/// ([`crate::compile::REGEX_SIZE_LIMIT`]), so a hostile pattern from the request fails fast.
fn matches(
    ftx: &FunctionContext,
    This(this): This<std::sync::Arc<String>>,
    pattern: std::sync::Arc<String>,
) -> Result<bool, ExecutionError> {
    charge(1 + pattern.len() as u64)?;
    match crate::compile::regex_limited(&pattern) {
        Ok(re) => Ok(re.is_match(&this)),
        Err(regex::Error::CompiledTooBig(limit)) => Err(bound_error(format!(
            "regular expression compiles to more than {limit} bytes"
        ))),
        Err(err) => Err(ftx.error(format!("'{pattern}' not a valid regex:\n{err}"))),
    }
}

fn base_context() -> Context<'static> {
    let mut ctx = Context::default();
    ctx.register_all();
    ctx.add_function(TICK, tick);
    ctx.add_function(SIZE, size);
    ctx.add_function(PRE_JOIN, pre_join);
    ctx.add_function(PRE_REPLACE, pre_replace);
    ctx.add_function(PRE_FORMAT, pre_format);
    ctx.add_function(PRE_RANGE, pre_range);
    ctx.add_function(PATH, path);
    ctx.add_function(EQ, eq);
    ctx.add_function(NE, ne);
    ctx.add_function(IN, in_);
    ctx.add_function(LT, lt);
    ctx.add_function(LE, le);
    ctx.add_function(GT, gt);
    ctx.add_function(GE, ge);
    ctx.add_function(ENTRIES, entries);
    ctx.add_function(PUT, put);
    ctx.add_function(SELECT, select);
    ctx.add_function(HAS, has);
    ctx.add_function(INDEX, index);
    ctx.add_function(OPT_SELECT, opt_select);
    ctx.add_function(OPT_INDEX, opt_index);
    ctx.add_function(TYPE_NAMED, type_named);
    ctx.add_function(MAP_LITERAL, map_literal);
    ctx.add_function(BIND, bind);
    ctx.add_function(STRING, string_of);
    ctx.add_function(ALL, all);
    ctx.add_function(STRING_METHOD, string_method);
    ctx.add_function(ADD, add);
    ctx.add_function(SUB, sub);
    ctx.add_function(MILLIS, millis);
    ctx.add_function(FORMAT, format);
    ctx.add_function(EXISTS, exists);
    ctx.add_function(NEG, neg);
    ctx.add_function(TIMESTAMP, timestamp_of);
    ctx.add_function(DURATION, duration_of);
    ctx.add_function(BYTES, bytes_of);
    ctx.add_function(INT, int_of);
    ctx.add_function("format.named", format_named);
    ctx.add_function("math.bitAnd", bit_and);
    ctx.add_function("math.bitOr", bit_or);
    ctx.add_function("math.bitXor", bit_xor);
    ctx.add_function("math.bitNot", bit_not);
    ctx.add_function("math.bitShiftLeft", bit_shift_left);
    ctx.add_function("math.bitShiftRight", bit_shift_right);
    ctx.add_function("type", type_of);
    ctx.add_function("size", size_of);
    ctx.add_function("bool", to_bool);
    ctx.add_function("matches", matches);
    ctx
}

/// Runs `f` with this thread's base context: every standard and Kubernetes CEL function plus
/// the guards, built once per thread.
pub(crate) fn with_base<R>(f: impl FnOnce(&Context<'static>) -> R) -> R {
    BASE.with(|b| f(b))
}
