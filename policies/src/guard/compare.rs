//! Equality, ordering and membership with CEL's numeric semantics, charged by the size of what
//! they compare.

use kube_cel::cel::{ExecutionError, FunctionContext, ResolveResult, Value, common::ast::Expr};

use super::{STATE, arg, charge};

/// Charges the size of a compared operand, which equality walks node by node.
pub(super) fn weigh_value(v: &Value) -> Result<(), ExecutionError> {
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
pub(super) fn operands(ftx: &FunctionContext) -> Result<(Value, Value), ExecutionError> {
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

pub(super) fn eq(ftx: &FunctionContext) -> ResolveResult {
    let (a, b) = operands(ftx)?;
    Ok(Value::Bool(cel_equals(&a, &b)))
}

pub(super) fn ne(ftx: &FunctionContext) -> ResolveResult {
    let (a, b) = operands(ftx)?;
    Ok(Value::Bool(!cel_equals(&a, &b)))
}

pub(super) fn ordering(ftx: &FunctionContext) -> Result<std::cmp::Ordering, ExecutionError> {
    let (a, b) = operands(ftx)?;
    match (&a, &b) {
        (Value::Bytes(x), Value::Bytes(y)) => Ok(x.cmp(y)),
        // null, lists and maps have no order.
        (Value::Null | Value::List(_) | Value::Map(_), _) => Err(ExecutionError::NoSuchOverload),
        _ => a.partial_cmp(&b).ok_or(ExecutionError::NoSuchOverload),
    }
}

pub(super) fn lt(ftx: &FunctionContext) -> ResolveResult {
    Ok(Value::Bool(ordering(ftx)?.is_lt()))
}

pub(super) fn le(ftx: &FunctionContext) -> ResolveResult {
    Ok(Value::Bool(ordering(ftx)?.is_le()))
}

pub(super) fn gt(ftx: &FunctionContext) -> ResolveResult {
    Ok(Value::Bool(ordering(ftx)?.is_gt()))
}

pub(super) fn ge(ftx: &FunctionContext) -> ResolveResult {
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

pub(super) fn in_(ftx: &FunctionContext) -> ResolveResult {
    let (x, container) = operands(ftx)?;
    match &container {
        Value::List(l) => Ok(Value::Bool(l.iter().any(|y| cel_equals(&x, y)))),
        Value::Map(m) => Ok(Value::Bool(
            keys_of(&x).iter().any(|k| m.map.contains_key(k)),
        )),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}
