//! Comprehension helpers, `cel.bind`, map literals, unary minus, `format.named`, the `math`
//! bit functions and a bounded `matches`.

use kube_cel::cel::{
    ExecutionError, FunctionContext, IdedExpr, ResolveResult, Value,
    common::{
        ast::{Expr, LiteralValue},
        types::CelList,
        value::Val,
    },
    extractors::This,
};

use super::access::{operand, optional};
use super::compare::keys_of;
use super::{ALL, BIND, arg, bound_error, charge, check_list, exceeded};

/// `__hearth_entries(range)`: what a two-variable comprehension iterates, as `[key, value]`
/// pairs: `[index, element]` for a list, `[key, value]` for a map.
pub(super) fn entries(ftx: &FunctionContext) -> ResolveResult {
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
pub(super) fn put(ftx: &FunctionContext) -> ResolveResult {
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

/// `__hearth_map_literal({...}, n)`: the map, or an error when its `n` entries repeat a key.
pub(super) fn map_literal(ftx: &FunctionContext) -> ResolveResult {
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
pub(super) fn quantify(ftx: &FunctionContext, decides: bool) -> ResolveResult {
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

pub(super) fn all(ftx: &FunctionContext) -> ResolveResult {
    quantify(ftx, false)
}

pub(super) fn exists(ftx: &FunctionContext) -> ResolveResult {
    quantify(ftx, true)
}

pub(super) fn neg(ftx: &FunctionContext) -> ResolveResult {
    match arg(ftx, 0)? {
        Value::Int(i) => i
            .checked_neg()
            .map(Value::Int)
            .ok_or_else(|| ftx.error("integer overflow")),
        Value::Float(f) => Ok(Value::Float(-f)),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

/// `__hearth_bind('v', init, body)`.
pub(super) fn bind(ftx: &FunctionContext) -> ResolveResult {
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
pub(super) fn format_named(ftx: &FunctionContext) -> ResolveResult {
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

pub(super) fn int_operands(ftx: &FunctionContext, n: usize) -> Result<Vec<Value>, ExecutionError> {
    (0..n).map(|i| arg(ftx, i)).collect()
}

/// `math.bitAnd`, `bitOr`, `bitXor` over two ints or two uints.
pub(super) fn bit_binary(ftx: &FunctionContext, op: fn(u64, u64) -> u64) -> ResolveResult {
    match int_operands(ftx, 2)?.as_slice() {
        [Value::Int(a), Value::Int(b)] => Ok(Value::Int(op(*a as u64, *b as u64) as i64)),
        [Value::UInt(a), Value::UInt(b)] => Ok(Value::UInt(op(*a, *b))),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

pub(super) fn bit_and(ftx: &FunctionContext) -> ResolveResult {
    bit_binary(ftx, |a, b| a & b)
}

pub(super) fn bit_or(ftx: &FunctionContext) -> ResolveResult {
    bit_binary(ftx, |a, b| a | b)
}

pub(super) fn bit_xor(ftx: &FunctionContext) -> ResolveResult {
    bit_binary(ftx, |a, b| a ^ b)
}

pub(super) fn bit_not(ftx: &FunctionContext) -> ResolveResult {
    match arg(ftx, 0)? {
        Value::Int(a) => Ok(Value::Int(!a)),
        Value::UInt(a) => Ok(Value::UInt(!a)),
        _ => Err(ExecutionError::NoSuchOverload),
    }
}

/// Shifts: a negative amount is an error, 64 or more gives 0; right shifts are logical (the
/// bits of a negative int move as unsigned), as cel-go's.
pub(super) fn bit_shift(ftx: &FunctionContext, left: bool) -> ResolveResult {
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

pub(super) fn bit_shift_left(ftx: &FunctionContext) -> ResolveResult {
    bit_shift(ftx, true)
}

pub(super) fn bit_shift_right(ftx: &FunctionContext) -> ResolveResult {
    bit_shift(ftx, false)
}

/// The standard `matches`, with the compiled size of the pattern bounded
/// ([`crate::compile::REGEX_SIZE_LIMIT`]), so a hostile pattern from the request fails fast.
pub(super) fn matches(
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
