//! Run-time bounds: a per-thread cost budget charged by guard functions the compiler splices
//! into the expression tree (see [`crate::compile`]), and stack growth for deep trees.
//!
//! Evaluation is synchronous on one thread, so the budget lives in a thread-local set up by
//! [`Budget::enter`] for one request and reset per expression by [`start_expression`].
//!
//! The guard functions are grouped by what they do: `cost` (charges and pre-checks),
//! `compare`, `access` (selection, indexing, types), `library` (comprehensions, bits, …),
//! `time` and `format`; [`with_base`] registers them all.

mod access;
mod compare;
mod cost;
mod format;
mod library;
mod time;

use std::cell::Cell;

use kube_cel::{
    KubeCelExt,
    cel::{Context, ExecutionError, FunctionContext, ResolveResult, Value},
};

use crate::limits::Limits;

pub(crate) use access::{TypeValue, type_value_name};
pub(crate) use time::saturated;

use access::{
    has, index, opt_index, opt_select, path, select, size_of, to_bool, type_named, type_of,
};
use compare::{eq, ge, gt, in_, le, lt, ne};
use cost::{pre_format, pre_join, pre_range, pre_replace, size, tick};
use format::{format, string_method};
use library::{
    all, bind, bit_and, bit_not, bit_or, bit_shift_left, bit_shift_right, bit_xor, entries, exists,
    format_named, map_literal, matches, neg, put,
};
use time::{
    add, bytes_of, duration_of, get_date, get_day_of_month, get_day_of_week, get_day_of_year,
    get_full_year, get_hours, get_milliseconds, get_minutes, get_month, get_seconds, int_of,
    string_of, sub, timestamp_of,
};

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

fn arg(ftx: &FunctionContext, i: usize) -> ResolveResult {
    match ftx.args.get(i) {
        Some(e) => Value::resolve(e, ftx.ptx),
        None => Err(ExecutionError::invalid_argument_count(
            i + 1,
            ftx.args.len(),
        )),
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
    ctx.add_function(FORMAT, format);
    ctx.add_function(EXISTS, exists);
    ctx.add_function(NEG, neg);
    ctx.add_function(TIMESTAMP, timestamp_of);
    ctx.add_function(DURATION, duration_of);
    ctx.add_function(BYTES, bytes_of);
    ctx.add_function(INT, int_of);
    // The timestamp and duration getters as cel-go: in UTC or a named or fixed time zone (the
    // library's ignore the zone and read a timestamp in the offset it was written with).
    ctx.add_function("getFullYear", get_full_year);
    ctx.add_function("getMonth", get_month);
    ctx.add_function("getDayOfYear", get_day_of_year);
    ctx.add_function("getDayOfMonth", get_day_of_month);
    ctx.add_function("getDate", get_date);
    ctx.add_function("getDayOfWeek", get_day_of_week);
    ctx.add_function("getHours", get_hours);
    ctx.add_function("getMinutes", get_minutes);
    ctx.add_function("getSeconds", get_seconds);
    ctx.add_function("getMilliseconds", get_milliseconds);
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
