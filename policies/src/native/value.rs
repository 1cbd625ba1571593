//! The native evaluator's values: JSON read in place, built lists and maps shared, quantities
//! exact; equality and ordering as the interpreter has them.

use std::{cmp::Ordering, rc::Rc};

use hearth_crds::quantity::Plain;
use kube_cel::cel::{
    Value as CelValue,
    common::ast::{CallExpr, Expr, IdedExpr},
    objects::{Key, Map},
};
use serde_json::Value;

use crate::{
    guard,
    value::{Number, cel_to_json, json_to_cel, number},
};

use super::Failure;
use super::eval::bound;

/// A string: borrowed from the input or the program, or built.
#[derive(Clone, Debug)]
pub(crate) enum Str<'a> {
    Ref(&'a str),
    Own(Rc<str>),
}

impl Str<'_> {
    pub(super) fn as_str(&self) -> &str {
        match self {
            Str::Ref(s) => s,
            Str::Own(s) => s,
        }
    }
}

/// A CEL value. JSON lists and maps are read in place; built ones are shared.
#[derive(Clone, Debug)]
pub(crate) enum Val<'a> {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Double(f64),
    Str(Str<'a>),
    JList(&'a [Value]),
    JMap(&'a serde_json::Map<String, Value>),
    List(Rc<Vec<Val<'a>>>),
    Map(Rc<Vec<(Str<'a>, Val<'a>)>>),
    /// A Kubernetes quantity in its plain form (see [`Quantity`]).
    Quantity(Quantity<'a>),
    /// A value only the interpreter knows (duration, timestamp, bytes, other quantities, …).
    Foreign(CelValue),
}

/// A Kubernetes quantity (`resource.Quantity`) in its plain form (`500m`, `1.5Gi`, `32`), exact,
/// as kube-cel keeps it ([`hearth_crds::quantity::Plain`]); exponents and signs go to the
/// interpreter.
#[derive(Clone, Debug)]
pub(crate) struct Quantity<'a> {
    pub(super) value: Plain,
    /// The source text, to hand the value to the interpreter when a foreign call needs it.
    pub(super) text: Str<'a>,
}

impl<'a> Quantity<'a> {
    pub(super) fn parse(text: Str<'a>) -> Option<Self> {
        Some(Quantity {
            value: Plain::parse(text.as_str())?,
            text,
        })
    }

    /// Exact comparison; `None` when scaling would overflow.
    pub(super) fn compare(&self, other: &Quantity) -> Option<Ordering> {
        self.value.compare(&other.value)
    }

    /// The interpreter's value for the same text.
    pub(super) fn to_cel(&self) -> CelValue {
        let expr = IdedExpr {
            id: 0,
            expr: Expr::Call(CallExpr {
                func_name: "quantity".into(),
                target: None,
                args: vec![IdedExpr {
                    id: 0,
                    expr: Expr::Ident("__hearth_quantity".into()),
                }],
            }),
        };
        guard::with_base(|base| {
            let mut ctx = base.new_inner_scope();
            ctx.add_variable_from_value(
                "__hearth_quantity",
                CelValue::String(std::sync::Arc::new(self.text.as_str().to_owned())),
            );
            CelValue::resolve(&expr, &ctx).unwrap_or(CelValue::Null)
        })
    }
}

/// JSON as CEL binds it (see [`json_to_cel`]): integers are `int`, or `uint` above `i64::MAX`.
pub(crate) fn from_json(v: &Value) -> Val<'_> {
    match v {
        Value::Null => Val::Null,
        Value::Bool(b) => Val::Bool(*b),
        Value::Number(n) => match number(n) {
            Number::Int(i) => Val::Int(i),
            Number::UInt(u) => Val::UInt(u),
            Number::Double(f) => Val::Double(f),
        },
        Value::String(s) => Val::Str(Str::Ref(s)),
        Value::Array(a) => Val::JList(a),
        Value::Object(o) => Val::JMap(o),
    }
}

impl<'a> Val<'a> {
    pub(super) fn str(&self) -> Option<&str> {
        match self {
            Val::Str(s) => Some(s.as_str()),
            _ => None,
        }
    }

    pub(super) fn list_len(&self) -> Option<usize> {
        match self {
            Val::JList(l) => Some(l.len()),
            Val::List(l) => Some(l.len()),
            _ => None,
        }
    }

    pub(super) fn list_item(&self, i: usize) -> Option<Val<'a>> {
        match self {
            Val::JList(l) => l.get(i).map(from_json),
            Val::List(l) => l.get(i).cloned(),
            _ => None,
        }
    }

    pub(super) fn is_map(&self) -> bool {
        matches!(self, Val::JMap(_) | Val::Map(_))
    }

    pub(super) fn map_get(&self, key: &str) -> Option<Val<'a>> {
        match self {
            Val::JMap(m) => m.get(key).map(from_json),
            Val::Map(m) => m
                .iter()
                .find(|(k, _)| k.as_str() == key)
                .map(|(_, v)| v.clone()),
            _ => None,
        }
    }

    pub(super) fn map_len(&self) -> Option<usize> {
        match self {
            Val::JMap(m) => Some(m.len()),
            Val::Map(m) => Some(m.len()),
            _ => None,
        }
    }

    /// What a comprehension iterates: list elements, or map keys.
    pub(super) fn iter_items(&self) -> Option<Vec<Val<'a>>> {
        Some(match self {
            Val::JList(l) => l.iter().map(from_json).collect(),
            Val::List(l) => l.as_ref().clone(),
            Val::JMap(m) => m.keys().map(|k| Val::Str(Str::Ref(k))).collect(),
            Val::Map(m) => m.iter().map(|(k, _)| Val::Str(k.clone())).collect(),
            _ => return None,
        })
    }

    /// The JSON form (mutation results), charged per node: a value built by sharing (a list
    /// holding one big list many times) costs what its copy costs. Values without a JSON form
    /// fall back, so the interpreter reports the error.
    pub(crate) fn to_json(&self) -> Result<Value, Failure> {
        charge_node(0)?;
        Ok(match self {
            Val::Null => Value::Null,
            Val::Bool(b) => Value::Bool(*b),
            Val::Int(i) => Value::from(*i),
            Val::UInt(u) => Value::from(*u),
            Val::Double(f) => serde_json::Number::from_f64(*f)
                .map(Value::Number)
                .ok_or(Failure::Fallback)?,
            Val::Str(s) => {
                charge_node(s.as_str().len())?;
                Value::String(s.as_str().to_owned())
            }
            Val::JList(_) | Val::JMap(_) => {
                let json = match self {
                    Val::JList(l) => Value::Array(l.to_vec()),
                    Val::JMap(m) => Value::Object((*m).clone()),
                    _ => Value::Null,
                };
                charge_json(&json)?;
                json
            }
            Val::List(l) => Value::Array(l.iter().map(Val::to_json).collect::<Result<_, _>>()?),
            Val::Map(m) => {
                let mut out = serde_json::Map::with_capacity(m.len());
                for (k, v) in m.iter() {
                    out.insert(k.as_str().to_owned(), v.to_json()?);
                }
                out.sort_keys();
                Value::Object(out)
            }
            Val::Foreign(v) => cel_to_json(v).map_err(|_| Failure::Fallback)?,
            Val::Quantity(_) => return Err(Failure::Fallback),
        })
    }

    /// The interpreter's form (arguments of foreign calls), charged per node like
    /// [`Val::to_json`].
    pub(crate) fn to_cel(&self) -> Result<CelValue, Failure> {
        charge_node(0)?;
        Ok(match self {
            Val::Null => CelValue::Null,
            Val::Bool(b) => CelValue::Bool(*b),
            Val::Int(i) => CelValue::Int(*i),
            Val::UInt(u) => CelValue::UInt(*u),
            Val::Double(f) => CelValue::Float(*f),
            Val::Str(s) => {
                charge_node(s.as_str().len())?;
                CelValue::String(std::sync::Arc::new(s.as_str().to_owned()))
            }
            Val::JList(l) => {
                l.iter().try_for_each(charge_json)?;
                CelValue::List(std::sync::Arc::new(l.iter().map(json_to_cel).collect()))
            }
            Val::JMap(m) => {
                m.values().try_for_each(charge_json)?;
                CelValue::Map(Map {
                    map: std::sync::Arc::new(
                        m.iter()
                            .map(|(k, v)| {
                                (Key::String(std::sync::Arc::new(k.clone())), json_to_cel(v))
                            })
                            .collect(),
                    ),
                })
            }
            Val::List(l) => CelValue::List(std::sync::Arc::new(
                l.iter().map(Val::to_cel).collect::<Result<_, _>>()?,
            )),
            Val::Map(m) => {
                let mut out = std::collections::HashMap::with_capacity(m.len());
                for (k, v) in m.iter() {
                    out.insert(
                        Key::String(std::sync::Arc::new(k.as_str().to_owned())),
                        v.to_cel()?,
                    );
                }
                CelValue::Map(Map {
                    map: std::sync::Arc::new(out),
                })
            }
            Val::Foreign(v) => v.clone(),
            Val::Quantity(q) => q.to_cel(),
        })
    }

    /// A foreign call's result, charged per node.
    pub(crate) fn from_cel(v: CelValue) -> Result<Val<'a>, Failure> {
        charge_node(0)?;
        Ok(match v {
            CelValue::Null => Val::Null,
            CelValue::Bool(b) => Val::Bool(b),
            CelValue::Int(i) => Val::Int(i),
            CelValue::UInt(u) => Val::UInt(u),
            CelValue::Float(f) => Val::Double(f),
            CelValue::String(s) => {
                charge_node(s.len())?;
                Val::Str(Str::Own(Rc::from(s.as_str())))
            }
            CelValue::List(l) => Val::List(Rc::new(
                l.iter()
                    .cloned()
                    .map(Val::from_cel)
                    .collect::<Result<_, _>>()?,
            )),
            CelValue::Map(m) => {
                let mut out = Vec::with_capacity(m.map.len());
                for (k, v) in m.map.iter() {
                    let Key::String(k) = k else {
                        return Err(Failure::Fallback);
                    };
                    out.push((Str::Own(Rc::from(k.as_str())), Val::from_cel(v.clone())?));
                }
                Val::Map(Rc::new(out))
            }
            other => Val::Foreign(other),
        })
    }
}

/// Charges one node of a walk over a value (a copy, a conversion, a comparison), plus its
/// string bytes.
pub(super) fn charge_node(bytes: usize) -> Result<(), Failure> {
    guard::charge(1 + bytes as u64 / 64).map_err(bound)
}

/// Charges every node of a JSON value (before copying or converting it).
pub(super) fn charge_json(v: &Value) -> Result<(), Failure> {
    match v {
        Value::String(s) => charge_node(s.len()),
        Value::Array(a) => {
            charge_node(0)?;
            a.iter().try_for_each(charge_json)
        }
        Value::Object(m) => {
            charge_node(0)?;
            m.iter().try_for_each(|(k, x)| {
                charge_node(k.len())?;
                charge_json(x)
            })
        }
        _ => charge_node(0),
    }
}

/// Equality as the interpreter has it: same type and value, lists element-wise, maps by key.
/// Numbers compare by value across types; foreign values fall back.
pub(super) fn equals(a: &Val, b: &Val) -> Result<bool, Failure> {
    // Each node compared is charged: comparing shared values must not be free.
    charge_node(0)?;
    Ok(match (a, b) {
        (Val::Null, Val::Null) => true,
        (Val::Bool(x), Val::Bool(y)) => x == y,
        (Val::Int(x), Val::Int(y)) => x == y,
        (Val::UInt(x), Val::UInt(y)) => x == y,
        (Val::Double(x), Val::Double(y)) => x == y,
        (Val::Str(x), Val::Str(y)) => x.as_str() == y.as_str(),
        // Numbers compare by value across types, as CEL's heterogeneous equality.
        (Val::Int(x), Val::UInt(y)) | (Val::UInt(y), Val::Int(x)) => {
            u64::try_from(*x).is_ok_and(|x| x == *y)
        }
        (Val::Int(x), Val::Double(y)) | (Val::Double(y), Val::Int(x)) => *x as f64 == *y,
        (Val::UInt(x), Val::Double(y)) | (Val::Double(y), Val::UInt(x)) => *x as f64 == *y,
        (Val::Foreign(_) | Val::Quantity(_), _) | (_, Val::Foreign(_) | Val::Quantity(_)) => {
            return Err(Failure::Fallback);
        }
        (x, y) if x.list_len().is_some() && y.list_len().is_some() => {
            let n = x.list_len().unwrap_or(0);
            if n != y.list_len().unwrap_or(0) {
                return Ok(false);
            }
            for i in 0..n {
                let (Some(p), Some(q)) = (x.list_item(i), y.list_item(i)) else {
                    return Err(Failure::Fallback);
                };
                if !equals(&p, &q)? {
                    return Ok(false);
                }
            }
            true
        }
        (x, y) if x.is_map() && y.is_map() => {
            if x.map_len() != y.map_len() {
                return Ok(false);
            }
            let keys = x.iter_items().ok_or(Failure::Fallback)?;
            for k in keys {
                let key = k.str().ok_or(Failure::Fallback)?;
                let (Some(p), Some(q)) = (x.map_get(key), y.map_get(key)) else {
                    return Ok(false);
                };
                if !equals(&p, &q)? {
                    return Ok(false);
                }
            }
            true
        }
        _ => false,
    })
}

pub(super) fn compare(a: &Val, b: &Val) -> Result<Ordering, Failure> {
    match (a, b) {
        (Val::Int(x), Val::Int(y)) => Ok(x.cmp(y)),
        (Val::UInt(x), Val::UInt(y)) => Ok(x.cmp(y)),
        (Val::Double(x), Val::Double(y)) => x.partial_cmp(y).ok_or(Failure::Fallback),
        (Val::Str(x), Val::Str(y)) => Ok(x.as_str().cmp(y.as_str())),
        (Val::Bool(x), Val::Bool(y)) => Ok(x.cmp(y)),
        // Numbers of different types by value.
        (Val::Int(x), Val::UInt(y)) => Ok(u64::try_from(*x).map_or(Ordering::Less, |x| x.cmp(y))),
        (Val::UInt(x), Val::Int(y)) => {
            Ok(u64::try_from(*y).map_or(Ordering::Greater, |y| x.cmp(&y)))
        }
        (Val::Int(x), Val::Double(y)) => (*x as f64).partial_cmp(y).ok_or(Failure::Fallback),
        (Val::UInt(x), Val::Double(y)) => (*x as f64).partial_cmp(y).ok_or(Failure::Fallback),
        (Val::Double(x), Val::Int(y)) => x.partial_cmp(&(*y as f64)).ok_or(Failure::Fallback),
        (Val::Double(x), Val::UInt(y)) => x.partial_cmp(&(*y as f64)).ok_or(Failure::Fallback),
        _ => Err(Failure::Fallback),
    }
}
