//! Timestamps, durations and bytes as cel-go has them: conversions, ranges, arithmetic and
//! string forms.

use kube_cel::cel::{
    ExecutionError, FunctionContext, IdedExpr, ResolveResult, Value,
    common::{ast::Expr, value::Val},
};

use super::access::operand;
use super::arg;
use super::cost::check_value;

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

/// What a timestamp or duration getter reads.
#[derive(Clone, Copy)]
enum Field {
    FullYear,
    Month,
    DayOfYear,
    DayOfMonth,
    Date,
    DayOfWeek,
    Hours,
    Minutes,
    Seconds,
    Milliseconds,
}

/// A getter as cel-go has it: of a timestamp, the field in UTC or in the time zone its one
/// argument names (see [`local_time`]), days of the year and of the month and months counted
/// from 0 (but `getDate`, from 1), Sunday being day 0 of the week; of a duration
/// (no argument), its whole hours, minutes or seconds, truncated to 32 bits as the `cel`
/// library does, or its milliseconds part. Called as a method, or with the receiver as the
/// first argument as the library also accepts. Other receivers or arguments are no overload.
fn getter(field: Field, ftx: &FunctionContext) -> ResolveResult {
    let (target, first) = match &ftx.this {
        Some(t) => (t.clone(), 0),
        None => (arg(ftx, 0)?, 1),
    };
    let zone = match ftx.args.len().saturating_sub(first) {
        0 => None,
        1 => Some(arg(ftx, first)?),
        _ => {
            return Err(ExecutionError::invalid_argument_count(
                first + 1,
                ftx.args.len(),
            ));
        }
    };
    let n = match (&target, zone) {
        (Value::Timestamp(t), None) => timestamp_field(field, &t.naive_utc()),
        (Value::Timestamp(t), Some(Value::String(zone))) => {
            timestamp_field(field, &local_time(t, &zone, ftx)?)
        }
        (Value::Duration(d), None) => match field {
            Field::Hours => i64::from(d.num_hours() as i32),
            Field::Minutes => i64::from(d.num_minutes() as i32),
            Field::Seconds => i64::from(d.num_seconds() as i32),
            Field::Milliseconds => i64::from(d.subsec_nanos() / 1_000_000),
            _ => return Err(ExecutionError::NoSuchOverload),
        },
        _ => return Err(ExecutionError::NoSuchOverload),
    };
    Ok(Value::Int(n))
}

fn timestamp_field(field: Field, t: &chrono::NaiveDateTime) -> i64 {
    use chrono::{Datelike, Timelike};
    i64::from(match field {
        Field::FullYear => return i64::from(t.year()),
        Field::Month => t.month0(),
        Field::DayOfYear => t.ordinal0(),
        Field::DayOfMonth => t.day0(),
        Field::Date => t.day(),
        Field::DayOfWeek => t.weekday().num_days_from_sunday(),
        Field::Hours => t.hour(),
        Field::Minutes => t.minute(),
        Field::Seconds => t.second(),
        // A leap second's nanoseconds run past 10^9.
        Field::Milliseconds => t.nanosecond() % 1_000_000_000 / 1_000_000,
    })
}

/// The wall-clock time of `t` in `zone`, read as cel-go reads a getter's argument: with a
/// `:`, a fixed offset from UTC, `[+|-]HH:MM`, each side an integer (`-02:30` is two and a
/// half hours west; `02:00` two hours east); without, an IANA time zone name (`UTC`,
/// `America/St_Johns`, `US/Central`) from the compiled-in database, `""` and `Local` being
/// UTC (the apiserver's `Local` is its process's zone, UTC in its container image).
///
/// # Errors
///
/// An unknown zone name (`unknown time zone …`, as cel-go), an offset that is not two
/// integers, or one that moves the time out of range.
fn local_time(
    t: &chrono::DateTime<chrono::FixedOffset>,
    zone: &str,
    ftx: &FunctionContext,
) -> Result<chrono::NaiveDateTime, ExecutionError> {
    let Some((hours, minutes)) = zone.split_once(':') else {
        let tz = match zone {
            "" | "UTC" | "Local" => chrono_tz::UTC,
            name => name
                .parse::<chrono_tz::Tz>()
                .map_err(|_| ftx.error(format!("unknown time zone {zone}")))?,
        };
        return Ok(t.with_timezone(&tz).naive_local());
    };
    let invalid = || ftx.error(format!("invalid time zone offset {zone}"));
    let (hours, minutes) = (
        hours.parse::<i64>().map_err(|_| invalid())?,
        minutes.parse::<i64>().map_err(|_| invalid())?,
    );
    // As cel-go: the sign of the zone applies to the minutes too.
    let offset = if zone.starts_with('-') {
        hours.checked_mul(60).and_then(|h| h.checked_sub(minutes))
    } else {
        hours.checked_mul(60).and_then(|h| h.checked_add(minutes))
    };
    offset
        .and_then(chrono::TimeDelta::try_minutes)
        .and_then(|d| t.naive_utc().checked_add_signed(d))
        .ok_or_else(|| ftx.error(format!("time zone offset {zone} out of range")))
}

pub(super) fn get_full_year(ftx: &FunctionContext) -> ResolveResult {
    getter(Field::FullYear, ftx)
}

pub(super) fn get_month(ftx: &FunctionContext) -> ResolveResult {
    getter(Field::Month, ftx)
}

pub(super) fn get_day_of_year(ftx: &FunctionContext) -> ResolveResult {
    getter(Field::DayOfYear, ftx)
}

pub(super) fn get_day_of_month(ftx: &FunctionContext) -> ResolveResult {
    getter(Field::DayOfMonth, ftx)
}

pub(super) fn get_date(ftx: &FunctionContext) -> ResolveResult {
    getter(Field::Date, ftx)
}

pub(super) fn get_day_of_week(ftx: &FunctionContext) -> ResolveResult {
    getter(Field::DayOfWeek, ftx)
}

pub(super) fn get_hours(ftx: &FunctionContext) -> ResolveResult {
    getter(Field::Hours, ftx)
}

pub(super) fn get_minutes(ftx: &FunctionContext) -> ResolveResult {
    getter(Field::Minutes, ftx)
}

pub(super) fn get_seconds(ftx: &FunctionContext) -> ResolveResult {
    getter(Field::Seconds, ftx)
}

pub(super) fn get_milliseconds(ftx: &FunctionContext) -> ResolveResult {
    getter(Field::Milliseconds, ftx)
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

#[cfg(test)]
mod tests {
    use crate::expression::{Expression, Path};
    use kube_cel::cel::Value;

    /// `expr` on both evaluators: the same result, which is `want` (a value, or an error
    /// whose message contains the text).
    fn check(expr: &str, want: Result<i64, &str>) {
        let compiled = Expression::compile(expr, &[]).unwrap();
        let engine = compiled.evaluate(&[], Path::Engine).result;
        let interpreter = compiled.evaluate(&[], Path::Interpreter).result;
        assert_eq!(engine, interpreter, "{expr}");
        match (want, engine) {
            (Ok(n), Ok(v)) => assert_eq!(v, Value::Int(n), "{expr}"),
            (Err(text), Err(e)) => assert!(e.contains(text), "{expr}: {e}"),
            (want, got) => panic!("{expr}: want {want:?}, got {got:?}"),
        }
    }

    const T: &str = "timestamp('2009-02-13T23:31:30.123Z')";

    #[test]
    fn timestamp_getters_read_utc_without_a_zone() {
        check(&format!("{T}.getFullYear()"), Ok(2009));
        check(&format!("{T}.getMonth()"), Ok(1));
        check(&format!("{T}.getDayOfYear()"), Ok(43));
        check(&format!("{T}.getDayOfMonth()"), Ok(12));
        check(&format!("{T}.getDate()"), Ok(13));
        check(&format!("{T}.getDayOfWeek()"), Ok(5));
        check(&format!("{T}.getHours()"), Ok(23));
        check(&format!("{T}.getMinutes()"), Ok(31));
        check(&format!("{T}.getSeconds()"), Ok(30));
        check(&format!("{T}.getMilliseconds()"), Ok(123));
        // Written with an offset, still read in UTC (the library read it in its offset).
        check("timestamp('2009-02-14T00:31:30+01:00').getHours()", Ok(23));
        check("timestamp('2009-02-14T00:31:30+01:00').getDate()", Ok(13));
    }

    #[test]
    fn named_zones_come_from_the_time_zone_database() {
        check(&format!("{T}.getHours('America/Los_Angeles')"), Ok(15));
        check(&format!("{T}.getDate('Australia/Sydney')"), Ok(14));
        check(&format!("{T}.getMinutes('Asia/Kathmandu')"), Ok(16));
        check(&format!("{T}.getDayOfYear('US/Central')"), Ok(43));
        check(&format!("{T}.getDayOfWeek('Pacific/Kiritimati')"), Ok(6));
        check(&format!("{T}.getHours('UTC')"), Ok(23));
        check(&format!("{T}.getHours('')"), Ok(23));
        // Daylight saving time: Paris is UTC+2 in July, UTC+1 in February.
        check(
            "timestamp('2024-07-01T12:00:00Z').getHours('Europe/Paris')",
            Ok(14),
        );
        check(&format!("{T}.getHours('Europe/Paris')"), Ok(0));
        check(
            "timestamp('2009-02-13T02:00:00Z').getDayOfMonth('America/St_Johns')",
            Ok(11),
        );
        check(
            "timestamp('2009-12-31T23:00:00Z').getFullYear('Asia/Tokyo')",
            Ok(2010),
        );
    }

    #[test]
    fn fixed_offsets_are_signed_hours_and_minutes() {
        check(&format!("{T}.getHours('02:00')"), Ok(1));
        check(&format!("{T}.getHours('+02:00')"), Ok(1));
        check(&format!("{T}.getDayOfMonth('+11:00')"), Ok(13));
        check(
            "timestamp('2009-02-13T02:00:00Z').getDayOfMonth('-02:30')",
            Ok(11),
        );
        check(
            "timestamp('2009-02-13T02:00:00Z').getMinutes('-02:30')",
            Ok(30),
        );
        check(&format!("{T}.getSeconds('-00:00')"), Ok(30));
        check(
            "timestamp('2009-12-31T23:31:30Z').getDayOfYear('+01:00')",
            Ok(0),
        );
    }

    #[test]
    fn bad_zones_are_errors() {
        check(
            &format!("{T}.getHours('Mars/Olympus')"),
            Err("unknown time zone Mars/Olympus"),
        );
        check(
            &format!("{T}.getHours('america/los_angeles')"),
            Err("unknown time zone"),
        );
        check(
            &format!("{T}.getHours('+x:00')"),
            Err("invalid time zone offset"),
        );
        check(&format!("{T}.getHours('1:2:3')"), Err("invalid time zone"));
        check(
            &format!("{T}.getHours('99999999999999999:00')"),
            Err("out of range"),
        );
        check(&format!("{T}.getHours(1)"), Err("overload"));
    }

    #[test]
    fn duration_getters_keep_their_totals() {
        check("duration('25h30m').getHours()", Ok(25));
        check("duration('25h30m').getMinutes()", Ok(1530));
        check("duration('1h0m1.5s').getSeconds()", Ok(3601));
        check("duration('1.5s').getMilliseconds()", Ok(500));
        check("duration('-1.5s').getMilliseconds()", Ok(-500));
        check("duration('1h').getHours('UTC')", Err("overload"));
        check("duration('1h').getFullYear()", Err("overload"));
    }
}
