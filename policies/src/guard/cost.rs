//! Guards that charge the budget: comprehension iterations, built values, and pre-checks of
//! calls whose output can be much larger than their input.

use kube_cel::cel::{
    ExecutionError, FunctionContext, ResolveResult, Value,
    common::{
        types::{CelList, CelMap, CelString},
        value::Val,
    },
};

use super::{STATE, arg, charge, check_list, check_string};

/// Shallow size check and charge of a value an operation built.
pub(super) fn check_value(v: &Value) -> Result<(), ExecutionError> {
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
pub(super) fn deep_size(v: &Value, cap: usize) -> usize {
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

/// Cost units of copying a value of the interpreter: one per node and per 64 string bytes,
/// nested lists and maps included; stops counting above `cap`.
pub(super) fn val_weight(v: &dyn Val, cap: u64) -> u64 {
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
pub(super) fn tick(ftx: &FunctionContext) -> ResolveResult {
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

pub(super) fn size(ftx: &FunctionContext) -> ResolveResult {
    let v = arg(ftx, 0)?;
    check_value(&v)?;
    Ok(v)
}

pub(super) fn pre_join(ftx: &FunctionContext) -> ResolveResult {
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

pub(super) fn pre_replace(ftx: &FunctionContext) -> ResolveResult {
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

pub(super) fn pre_format(ftx: &FunctionContext) -> ResolveResult {
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

pub(super) fn pre_range(ftx: &FunctionContext) -> ResolveResult {
    let n = arg(ftx, 0)?;
    if let Value::Int(i) = n {
        check_list(i.max(0) as usize)?;
        charge(1 + i.max(0) as u64)?;
    }
    Ok(n)
}
