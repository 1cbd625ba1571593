//! Timestamps, durations and bytes as cel-go has them: conversions, ranges, arithmetic and
//! string forms.

use kube_cel::cel::{
    ExecutionError, FunctionContext, IdedExpr, ResolveResult, Value,
    common::{ast::Expr, value::Val},
};

use super::access::operand;
use super::arg;
use super::cost::check_value;
use super::format::call_method;

/// Timestamps from year 1 to 9999 and durations of at most 2^63-1 nanoseconds, as cel-go.
pub(super) fn in_range(v: Value, ftx: &FunctionContext) -> ResolveResult {
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

pub(super) fn timestamp_of(ftx: &FunctionContext) -> ResolveResult {
    let v = match arg(ftx, 0)? {
        v @ Value::Timestamp(_) => v,
        Value::Int(secs) => chrono::DateTime::from_timestamp(secs, 0)
            .map(|t| Value::Timestamp(t.fixed_offset()))
            .ok_or_else(|| ftx.error("timestamp out of range"))?,
        v => call_library("timestamp", v, ftx)?,
    };
    in_range(v, ftx)
}

pub(super) fn duration_of(ftx: &FunctionContext) -> ResolveResult {
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
pub(super) fn time_or_bytes(v: &dyn Val) -> bool {
    use kube_cel::cel::common::types::{BYTES_TYPE, DURATION_TYPE, TIMESTAMP_TYPE};
    let t = v.get_type();
    t == DURATION_TYPE || t == TIMESTAMP_TYPE || t == BYTES_TYPE
}

/// `a + b`: the interpreter's addition over its own values (no copy of the operands), by
/// value for timestamps, durations and bytes; the result is size-checked and charged.
pub(super) fn add(ftx: &FunctionContext) -> ResolveResult {
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
pub(super) fn sub(ftx: &FunctionContext) -> ResolveResult {
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
pub(super) fn millis(ftx: &FunctionContext) -> ResolveResult {
    let target = arg(ftx, 0)?;
    if let (Value::Duration(d), 1) = (&target, ftx.args.len()) {
        return Ok(Value::Int(i64::from(d.subsec_nanos() / 1_000_000)));
    }
    let args = (1..ftx.args.len())
        .map(|i| arg(ftx, i))
        .collect::<Result<Vec<_>, _>>()?;
    call_method("getMilliseconds", target, args, ftx)
}

pub(super) fn bytes_of(ftx: &FunctionContext) -> ResolveResult {
    match arg(ftx, 0)? {
        v @ Value::Bytes(_) => Ok(v),
        v => call_library("bytes", v, ftx),
    }
}

/// A duration as cel-go prints it: seconds, with the fraction when there is one (`90s`,
/// `1.5s`).
pub(super) fn duration_text(d: &chrono::Duration) -> String {
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
pub(super) fn string_of(ftx: &FunctionContext) -> ResolveResult {
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
pub(super) fn int_of(ftx: &FunctionContext) -> ResolveResult {
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
pub(super) fn call_library(name: &str, v: Value, ftx: &FunctionContext) -> ResolveResult {
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
