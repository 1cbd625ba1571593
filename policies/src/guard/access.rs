//! Field selection, `has()`, indexing and their optional forms; field paths by reference; type
//! values, `size` and `bool`.

use std::borrow::Cow;

use kube_cel::cel::{
    ExecutionError, FunctionContext, IdedExpr, ResolveResult, Value,
    common::{
        ast::{Expr, LiteralValue},
        types::{CelList, CelString, MAP_TYPE},
        value::Val,
    },
    extractors::This,
};

use super::compare::keys_of;
use super::{PATH, SELECT, TYPE_NAMED, arg};

/// `size`: strings count code points (as cel-go), bytes bytes, lists and maps entries.
pub(super) fn size_of(
    ftx: &FunctionContext,
    This(this): This<Value>,
) -> Result<i64, ExecutionError> {
    Ok(match this {
        Value::String(s) => s.chars().count() as i64,
        Value::Bytes(b) => b.len() as i64,
        Value::List(l) => l.len() as i64,
        Value::Map(m) => m.map.len() as i64,
        other => return Err(ftx.error(format!("cannot determine the size of {other:?}"))),
    })
}

/// `bool(x)`: a bool, or a string spelling one as Go's `strconv.ParseBool` reads it.
pub(super) fn to_bool(
    ftx: &FunctionContext,
    This(this): This<Value>,
) -> Result<bool, ExecutionError> {
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

/// `__hearth_path(root, 'f1', 'f2', ...)`: `root.f1.f2...` without copying the intermediate
/// maps (the interpreter's selection copies each one).
pub(super) fn path(ftx: &FunctionContext) -> ResolveResult {
    let Some(Expr::Ident(name)) = ftx.args.first().map(|a| &a.expr) else {
        return Err(ExecutionError::function_error(PATH, "needs an identifier"));
    };
    let root = ftx
        .ptx
        .get_variable(name)
        .ok_or_else(|| ExecutionError::undeclared_reference(name))?;
    walk(root.as_ref(), &ftx.args[1..])
}

pub(super) fn walk(cur: &dyn Val, keys: &[IdedExpr]) -> ResolveResult {
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

pub(super) fn optional(v: Option<Value>) -> Value {
    use kube_cel::cel::objects::OptionalValue;
    Value::Opaque(std::sync::Arc::new(match v {
        Some(v) => OptionalValue::of(v),
        None => OptionalValue::none(),
    }))
}

/// The value inside an optional: `Some(None)` for `optional.none()`, `None` when `v` is not
/// an optional.
pub(super) fn optional_inner(v: &Value) -> Option<Option<Value>> {
    use kube_cel::cel::objects::OptionalValue;
    match v {
        Value::Opaque(o) => o
            .downcast_ref::<OptionalValue>()
            .map(|o| o.value().cloned()),
        _ => None,
    }
}

pub(super) fn map_key_error(k: &Value) -> ExecutionError {
    match k {
        Value::String(s) => ExecutionError::no_such_key(s),
        other => ExecutionError::NoSuchKey(std::sync::Arc::new(format!("{other:?}"))),
    }
}

/// `v.field`: a map's entry; on an optional, the optional of the entry (none when absent).
pub(super) fn select_value(v: Value, field: &str) -> ResolveResult {
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
pub(super) fn index_value(v: Value, k: &Value, opt: bool) -> ResolveResult {
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

pub(super) fn field_name(ftx: &FunctionContext) -> Result<std::sync::Arc<String>, ExecutionError> {
    match arg(ftx, 1)? {
        Value::String(s) => Ok(s),
        _ => Err(ExecutionError::function_error(
            SELECT,
            "field names are strings",
        )),
    }
}

pub(super) fn select(ftx: &FunctionContext) -> ResolveResult {
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
pub(super) fn operand<'a>(ftx: &'a FunctionContext) -> Result<Cow<'a, dyn Val>, ExecutionError> {
    let e = ftx
        .args
        .first()
        .ok_or_else(|| ExecutionError::invalid_argument_count(1, 0))?;
    Value::resolve_val(e, ftx.ptx)
}

pub(super) fn opt_select(ftx: &FunctionContext) -> ResolveResult {
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
pub(super) fn has(ftx: &FunctionContext) -> ResolveResult {
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

pub(super) fn index(ftx: &FunctionContext) -> ResolveResult {
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

pub(super) fn opt_index(ftx: &FunctionContext) -> ResolveResult {
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

pub(super) fn type_value(name: &str) -> Value {
    Value::Opaque(std::sync::Arc::new(TypeValue(name.to_owned())))
}

/// `type(x)`.
pub(super) fn type_of(ftx: &FunctionContext) -> ResolveResult {
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

/// `__hearth_type('int')`: the type denotation `int`.
pub(super) fn type_named(ftx: &FunctionContext) -> ResolveResult {
    match arg(ftx, 0)? {
        Value::String(s) => Ok(type_value(&s)),
        _ => Err(ExecutionError::function_error(TYPE_NAMED, "needs a name")),
    }
}
