//! The native evaluator: the CEL that policies use most, evaluated over the request's JSON by
//! reference.
//!
//! The `cel` interpreter copies every map it selects from, converts every function argument
//! and result between its two value representations, and copies a comprehension's
//! accumulator on every step; a policy set over a Deployment spends nearly all its time there.
//! This evaluator reads `object`, `params` and the other roots in place, shares built values,
//! appends to a comprehension's accumulator in place, and calls into the `cel` interpreter
//! only for library functions it does not implement itself (quantities, URLs, IPs, …).
//!
//! It is exact where it answers, and only answers on success: any error, unexpected type or
//! construct it does not implement makes it return [`Failure::Fallback`], and the engine
//! evaluates the whole policy again with the interpreter, which is the reference and produces
//! the error message. Exceeded bounds are reported directly ([`Failure::Bound`]). Equality,
//! ordering, `size` and the functions below follow the interpreter (`cel` 0.13 with kube-cel
//! 0.8), which the differential tests in `tests/native.rs` check.

use std::{cmp::Ordering, rc::Rc};

use hearth_crds::quantity::Plain;
use kube_cel::cel::{
    Value as CelValue,
    common::ast::{CallExpr, EntryExpr, Expr, IdedExpr, LiteralValue, operators},
    objects::{Key, Map},
};
use serde_json::Value;

use crate::{
    compile::{self, ROOT_VARIABLES},
    guard,
    value::{Number, cel_to_json, json_to_cel, number},
};

/// Why the native evaluator gave no value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Let the interpreter evaluate the policy (an error, or something not implemented here).
    Fallback,
    /// A bound of [`crate::Limits`] was exceeded: the message for the policy's error.
    Bound(String),
}

type R<'a> = Result<Val<'a>, Failure>;

/// A string: borrowed from the input or the program, or built.
#[derive(Clone, Debug)]
pub(crate) enum Str<'a> {
    Ref(&'a str),
    Own(Rc<str>),
}

impl Str<'_> {
    fn as_str(&self) -> &str {
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
    value: Plain,
    /// The source text, to hand the value to the interpreter when a foreign call needs it.
    text: Str<'a>,
}

impl<'a> Quantity<'a> {
    fn parse(text: Str<'a>) -> Option<Self> {
        Some(Quantity {
            value: Plain::parse(text.as_str())?,
            text,
        })
    }

    /// Exact comparison; `None` when scaling would overflow.
    fn compare(&self, other: &Quantity) -> Option<Ordering> {
        self.value.compare(&other.value)
    }

    /// The interpreter's value for the same text.
    fn to_cel(&self) -> CelValue {
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
    fn str(&self) -> Option<&str> {
        match self {
            Val::Str(s) => Some(s.as_str()),
            _ => None,
        }
    }

    fn list_len(&self) -> Option<usize> {
        match self {
            Val::JList(l) => Some(l.len()),
            Val::List(l) => Some(l.len()),
            _ => None,
        }
    }

    fn list_item(&self, i: usize) -> Option<Val<'a>> {
        match self {
            Val::JList(l) => l.get(i).map(from_json),
            Val::List(l) => l.get(i).cloned(),
            _ => None,
        }
    }

    fn is_map(&self) -> bool {
        matches!(self, Val::JMap(_) | Val::Map(_))
    }

    fn map_get(&self, key: &str) -> Option<Val<'a>> {
        match self {
            Val::JMap(m) => m.get(key).map(from_json),
            Val::Map(m) => m
                .iter()
                .find(|(k, _)| k.as_str() == key)
                .map(|(_, v)| v.clone()),
            _ => None,
        }
    }

    fn map_len(&self) -> Option<usize> {
        match self {
            Val::JMap(m) => Some(m.len()),
            Val::Map(m) => Some(m.len()),
            _ => None,
        }
    }

    /// What a comprehension iterates: list elements, or map keys.
    fn iter_items(&self) -> Option<Vec<Val<'a>>> {
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
fn charge_node(bytes: usize) -> Result<(), Failure> {
    guard::charge(1 + bytes as u64 / 64).map_err(bound)
}

/// Charges every node of a JSON value (before copying or converting it).
fn charge_json(v: &Value) -> Result<(), Failure> {
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
fn equals(a: &Val, b: &Val) -> Result<bool, Failure> {
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

fn compare(a: &Val, b: &Val) -> Result<Ordering, Failure> {
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

#[derive(Clone, Copy, Debug)]
enum BinOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    In,
    Add,
    Sub,
    Mul,
    Div,
    Mod,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Func {
    Size,
    Contains,
    StartsWith,
    EndsWith,
    String,
    Int,
    ListsRange,
    EscapeKey,
    Greatest,
    Least,
    Join,
    LowerAscii,
    UpperAscii,
    Duration,
    GetSeconds,
    Quantity,
    CompareTo,
    IsLessThan,
    IsGreaterThan,
}

#[derive(Debug)]
enum Lit {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Double(f64),
    Str(Box<str>),
}

#[derive(Debug)]
enum Node {
    Lit(Lit),
    /// `object`, `oldObject`, `request`, `namespaceObject`, `params`, `service`, `settings`.
    Root(usize),
    /// A policy variable, by declaration index.
    Var(usize),
    /// A comprehension variable, by stack slot.
    Local(usize),
    Select(Box<Node>, Box<str>),
    Has(Box<Node>, Box<str>),
    Index(Box<Node>, Box<Node>),
    And(Box<Node>, Box<Node>),
    Or(Box<Node>, Box<Node>),
    Not(Box<Node>),
    NotStrictlyFalse(Box<Node>),
    Cond(Box<(Node, Node, Node)>),
    Bin(BinOp, Box<Node>, Box<Node>),
    Neg(Box<Node>),
    /// `@result + [x]` in a macro's step: appends to the accumulator in place.
    Append(usize, Box<Node>),
    List(Vec<Node>),
    Map(Vec<(Node, Node)>),
    Comp(Box<Comp>),
    Call(Func, Vec<Node>),
    Matches(Box<Node>, regex::Regex),
    /// `matches` with a pattern computed at run time.
    MatchesDynamic(Box<Node>, Box<Node>),
    Foreign(Box<Foreign>),
}

#[derive(Debug)]
struct Comp {
    range: Node,
    init: Node,
    cond: Node,
    step: Node,
    result: Node,
    /// Slot of the iteration variable; the accumulator is the next one.
    slot: usize,
}

/// A library call the interpreter evaluates: the guarded call over bound arguments.
#[derive(Debug)]
struct Foreign {
    expr: IdedExpr,
    names: Vec<String>,
    args: Vec<Node>,
}

/// A compiled native program for one expression.
#[derive(Debug)]
pub(crate) struct Program {
    root: Node,
    /// Bit `i` is set when the program reads root variable `i` (see [`root_index`]).
    pub(crate) roots: u8,
}

/// The bit of `request` in [`Program::roots`].
pub(crate) const REQUEST_ROOT: u8 = 1 << 2;

/// Index of a root variable in [`Roots`].
fn root_index(name: &str) -> Option<usize> {
    ROOT_VARIABLES
        .iter()
        .filter(|n| **n != "variables")
        .position(|n| *n == name)
}

/// Number of root variables (all of [`ROOT_VARIABLES`] but `variables`).
pub(crate) const ROOTS: usize = 7;

/// Compiles a parsed (unguarded) expression, or `None` when it uses something this evaluator
/// does not implement (optional syntax, bytes, non-string map keys); the interpreter then
/// evaluates it. `declared` are the policy variables in declaration order.
pub(crate) fn compile(e: &IdedExpr, declared: &[String], bindings: &[String]) -> Option<Program> {
    let mut c = Compiler {
        declared,
        // Bindings of a standalone expression occupy the first local slots.
        scope: bindings.to_vec(),
        roots: 0,
    };
    let root = c.node(e)?;
    Some(Program {
        root,
        roots: c.roots,
    })
}

struct Compiler<'d> {
    declared: &'d [String],
    scope: Vec<String>,
    roots: u8,
}

impl Compiler<'_> {
    fn local(&self, name: &str) -> Option<usize> {
        self.scope.iter().rposition(|s| s == name)
    }

    fn boxed(&mut self, e: &IdedExpr) -> Option<Box<Node>> {
        self.node(e).map(Box::new)
    }

    fn node(&mut self, e: &IdedExpr) -> Option<Node> {
        Some(match &e.expr {
            Expr::Literal(l) => Node::Lit(match l {
                LiteralValue::Null => Lit::Null,
                LiteralValue::Boolean(b) => Lit::Bool(*b.inner()),
                LiteralValue::Int(i) => Lit::Int(*i.inner()),
                LiteralValue::UInt(u) => Lit::UInt(*u.inner()),
                LiteralValue::Double(d) => Lit::Double(*d.inner()),
                LiteralValue::String(s) => Lit::Str(s.inner().into()),
                LiteralValue::Bytes(_) => return None,
            }),
            Expr::Ident(name) => match self.local(name) {
                Some(slot) => Node::Local(slot),
                None => {
                    let i = root_index(name)?;
                    self.roots |= 1 << i;
                    Node::Root(i)
                }
            },
            Expr::Select(s) => {
                if let Expr::Ident(root) = &s.operand.expr
                    && root == "variables"
                    && self.local(root).is_none()
                {
                    if s.test {
                        return None;
                    }
                    return Some(Node::Var(self.declared.iter().position(|d| *d == s.field)?));
                }
                let operand = self.boxed(&s.operand)?;
                let field = s.field.as_str().into();
                if s.test {
                    Node::Has(operand, field)
                } else {
                    Node::Select(operand, field)
                }
            }
            Expr::Call(call) => self.call(call)?,
            Expr::List(l) => {
                if !l.optional_indices.is_empty() {
                    return None;
                }
                Node::List(
                    l.elements
                        .iter()
                        .map(|x| self.node(x))
                        .collect::<Option<_>>()?,
                )
            }
            Expr::Map(m) => {
                let mut entries = Vec::with_capacity(m.entries.len());
                for en in &m.entries {
                    let EntryExpr::MapEntry(me) = &en.expr else {
                        return None;
                    };
                    if me.optional {
                        return None;
                    }
                    entries.push((self.node(&me.key)?, self.node(&me.value)?));
                }
                Node::Map(entries)
            }
            // `JSONPatch{...}` and `Object{...}` build maps, as the interpreter's rewrite does.
            Expr::Struct(s) => {
                let mut entries = Vec::with_capacity(s.entries.len());
                for en in &s.entries {
                    let EntryExpr::StructField(f) = &en.expr else {
                        return None;
                    };
                    if f.optional {
                        return None;
                    }
                    entries.push((
                        Node::Lit(Lit::Str(f.field.as_str().into())),
                        self.node(&f.value)?,
                    ));
                }
                Node::Map(entries)
            }
            Expr::Comprehension(c) => {
                if c.iter_var2.is_some() {
                    return None;
                }
                let range = self.node(&c.iter_range)?;
                let init = self.node(&c.accu_init)?;
                let slot = self.scope.len();
                self.scope.push(c.iter_var.clone());
                self.scope.push(c.accu_var.clone());
                let body = (|| {
                    Some((
                        self.node(&c.loop_cond)?,
                        self.node(&c.loop_step)?,
                        self.node(&c.result)?,
                    ))
                })();
                self.scope.truncate(slot);
                let (cond, step, result) = body?;
                Node::Comp(Box::new(Comp {
                    range,
                    init,
                    cond,
                    step,
                    result,
                    slot,
                }))
            }
            Expr::Unspecified => return None,
        })
    }

    fn call(&mut self, call: &CallExpr) -> Option<Node> {
        let name = call.func_name.as_str();
        let args = &call.args;
        let two = |c: &mut Self| Some((c.boxed(&args[0])?, c.boxed(&args[1])?));
        match (name, args.len(), call.target.is_some()) {
            (operators::CONDITIONAL, 3, false) => {
                return Some(Node::Cond(Box::new((
                    self.node(&args[0])?,
                    self.node(&args[1])?,
                    self.node(&args[2])?,
                ))));
            }
            (operators::LOGICAL_AND, 2, false) => {
                let (a, b) = two(self)?;
                return Some(Node::And(a, b));
            }
            (operators::LOGICAL_OR, 2, false) => {
                let (a, b) = two(self)?;
                return Some(Node::Or(a, b));
            }
            (operators::LOGICAL_NOT, 1, false) => return Some(Node::Not(self.boxed(&args[0])?)),
            (operators::NOT_STRICTLY_FALSE, 1, false) => {
                return Some(Node::NotStrictlyFalse(self.boxed(&args[0])?));
            }
            (operators::NEGATE, 1, false) => return Some(Node::Neg(self.boxed(&args[0])?)),
            (operators::INDEX, 2, false) => {
                let (a, b) = two(self)?;
                return Some(Node::Index(a, b));
            }
            (operators::ADD, 2, false) => {
                if let Expr::Ident(acc) = &args[0].expr
                    && acc.starts_with('@')
                    && let Some(slot) = self.local(acc)
                {
                    return Some(Node::Append(slot, self.boxed(&args[1])?));
                }
            }
            (operators::OPT_INDEX | operators::OPT_SELECT, _, _) => return None,
            _ => {}
        }
        let op = match name {
            operators::EQUALS => Some(BinOp::Eq),
            operators::NOT_EQUALS => Some(BinOp::Ne),
            operators::LESS => Some(BinOp::Lt),
            operators::LESS_EQUALS => Some(BinOp::Le),
            operators::GREATER => Some(BinOp::Gt),
            operators::GREATER_EQUALS => Some(BinOp::Ge),
            operators::IN => Some(BinOp::In),
            operators::ADD => Some(BinOp::Add),
            operators::SUBSTRACT => Some(BinOp::Sub),
            operators::MULTIPLY => Some(BinOp::Mul),
            operators::DIVIDE => Some(BinOp::Div),
            operators::MODULO => Some(BinOp::Mod),
            _ => None,
        };
        if let Some(op) = op
            && args.len() == 2
            && call.target.is_none()
        {
            let (a, b) = two(self)?;
            return Some(Node::Bin(op, a, b));
        }
        // `ns.fn(...)` parses as a call of `fn` on the identifier `ns`.
        let namespace = match call.target.as_deref().map(|t| &t.expr) {
            Some(Expr::Ident(ns)) if self.local(ns).is_none() && root_index(ns).is_none() => {
                Some(ns.as_str())
            }
            _ => None,
        };
        let qualified = namespace.map(|ns| format!("{ns}.{name}"));
        let full = qualified.as_deref().unwrap_or(name);
        let target = if namespace.is_some() {
            None
        } else {
            call.target.as_deref()
        };
        let func = match (full, target.is_some(), args.len()) {
            ("size", false, 1) | ("size", true, 0) => Some(Func::Size),
            ("contains", true, 1) => Some(Func::Contains),
            ("startsWith", true, 1) => Some(Func::StartsWith),
            ("endsWith", true, 1) => Some(Func::EndsWith),
            ("string", false, 1) => Some(Func::String),
            ("int", false, 1) => Some(Func::Int),
            ("lists.range", false, 1) => Some(Func::ListsRange),
            ("jsonpatch.escapeKey", false, 1) => Some(Func::EscapeKey),
            ("math.greatest", false, _) => Some(Func::Greatest),
            ("math.least", false, _) => Some(Func::Least),
            ("join", true, 0 | 1) => Some(Func::Join),
            ("lowerAscii", true, 0) => Some(Func::LowerAscii),
            ("upperAscii", true, 0) => Some(Func::UpperAscii),
            ("duration", false, 1) => Some(Func::Duration),
            ("getSeconds", true, 0) => Some(Func::GetSeconds),
            ("quantity", false, 1) => Some(Func::Quantity),
            ("compareTo", true, 1) => Some(Func::CompareTo),
            ("isLessThan", true, 1) => Some(Func::IsLessThan),
            ("isGreaterThan", true, 1) => Some(Func::IsGreaterThan),
            _ => None,
        };
        let mut operands = Vec::with_capacity(args.len() + 1);
        if let Some(t) = target {
            operands.push(self.node(t)?);
        }
        for a in args {
            operands.push(self.node(a)?);
        }
        if let Some(f) = func {
            return Some(Node::Call(f, operands));
        }
        if full == "matches" && target.is_some() && args.len() == 1 {
            let mut operands = operands.into_iter();
            let target = Box::new(operands.next()?);
            return Some(match &args[0].expr {
                Expr::Literal(LiteralValue::String(p)) => {
                    Node::Matches(target, compile::regex_limited(p.inner()).ok()?)
                }
                _ => Node::MatchesDynamic(target, Box::new(operands.next()?)),
            });
        }
        // Anything else the interpreter knows: a foreign call over bound arguments, with the
        // interpreter's own guards spliced in.
        let names: Vec<String> = (0..operands.len())
            .map(|i| format!("__hearth_arg{i}"))
            .collect();
        let ident = |n: &String| IdedExpr {
            id: 0,
            expr: Expr::Ident(n.clone()),
        };
        let mut bound = names.iter().map(ident);
        let new_target = match (namespace, target) {
            (Some(ns), _) => Some(Box::new(IdedExpr {
                id: 0,
                expr: Expr::Ident(ns.to_owned()),
            })),
            (None, Some(_)) => bound.next().map(Box::new),
            (None, None) => None,
        };
        let mut expr = IdedExpr {
            id: 0,
            expr: Expr::Call(CallExpr {
                func_name: name.to_owned(),
                target: new_target,
                args: bound.collect(),
            }),
        };
        compile::rewrite(&mut expr);
        Some(Node::Foreign(Box::new(Foreign {
            expr,
            names,
            args: operands,
        })))
    }
}

/// A policy variable: evaluated on first use, at most once per object (as the apiserver's
/// lazy variables).
enum Var<'a> {
    Pending(&'a str, &'a Program),
    Evaluating,
    Done(Val<'a>),
    Failed(Failure),
}

/// The variables of one evaluation: the roots, the policy variables, and the comprehension
/// stack.
pub(crate) struct Env<'a> {
    roots: [Val<'a>; ROOTS],
    vars: Vec<Var<'a>>,
    locals: Vec<Val<'a>>,
}

impl<'a> Env<'a> {
    /// An environment over the roots, in [`ROOT_VARIABLES`] order without `variables`, and
    /// the policy's variables (name and program) in declaration order.
    pub(crate) fn new(
        roots: [Val<'a>; ROOTS],
        variables: impl Iterator<Item = (&'a str, &'a Program)>,
    ) -> Self {
        Env {
            roots,
            vars: variables.map(|(n, p)| Var::Pending(n, p)).collect(),
            locals: Vec::new(),
        }
    }

    /// Policy variable `i`, evaluated on first use. A failure is kept: every expression that
    /// uses the variable fails the same way.
    fn variable(&mut self, i: usize) -> R<'a> {
        let slot = self.vars.get_mut(i).ok_or(Failure::Fallback)?;
        match std::mem::replace(slot, Var::Evaluating) {
            Var::Done(v) => {
                *slot = Var::Done(v.clone());
                Ok(v)
            }
            Var::Failed(f) => {
                *slot = Var::Failed(f.clone());
                Err(f)
            }
            Var::Evaluating => Err(Failure::Fallback),
            Var::Pending(name, program) => {
                // A variable is compiled at the top level: its comprehensions start their own
                // stack. It has an expression budget of its own, as when evaluated in order.
                let outer = std::mem::take(&mut self.locals);
                let budget = guard::save_expression();
                guard::start_expression();
                let result = self.eval(&program.root).map_err(|f| match f {
                    Failure::Bound(m) => Failure::Bound(format!("variables.{name} failed: {m}")),
                    f => f,
                });
                guard::restore_expression(budget);
                self.locals = outer;
                self.vars[i] = match &result {
                    Ok(v) => Var::Done(v.clone()),
                    Err(f) => Var::Failed(f.clone()),
                };
                result
            }
        }
    }

    /// Evaluates a standalone expression whose bindings are the first local slots.
    pub(crate) fn run_bound(&mut self, program: &'a Program, bindings: Vec<Val<'a>>) -> R<'a> {
        guard::start_expression();
        self.locals = bindings;
        self.eval(&program.root)
    }

    /// Evaluates one expression under a fresh per-expression budget.
    pub(crate) fn run(&mut self, program: &'a Program) -> R<'a> {
        guard::start_expression();
        self.locals.clear();
        self.eval(&program.root)
    }

    fn eval(&mut self, n: &'a Node) -> R<'a> {
        match n {
            Node::Lit(l) => Ok(match l {
                Lit::Null => Val::Null,
                Lit::Bool(b) => Val::Bool(*b),
                Lit::Int(i) => Val::Int(*i),
                Lit::UInt(u) => Val::UInt(*u),
                Lit::Double(d) => Val::Double(*d),
                Lit::Str(s) => Val::Str(Str::Ref(s)),
            }),
            Node::Root(i) => Ok(self.roots[*i].clone()),
            Node::Var(i) => self.variable(*i),
            Node::Local(i) => self.locals.get(*i).cloned().ok_or(Failure::Fallback),
            Node::Select(operand, field) => {
                let v = self.eval(operand)?;
                v.map_get(field).ok_or(Failure::Fallback)
            }
            Node::Has(operand, field) => {
                let v = self.eval(operand)?;
                if !v.is_map() {
                    return Err(Failure::Fallback);
                }
                Ok(Val::Bool(v.map_get(field).is_some()))
            }
            Node::Index(operand, index) => {
                let v = self.eval(operand)?;
                let i = self.eval(index)?;
                match (&v, &i) {
                    (_, Val::Int(i)) if v.list_len().is_some() => usize::try_from(*i)
                        .ok()
                        .and_then(|i| v.list_item(i))
                        .ok_or(Failure::Fallback),
                    (_, Val::Str(k)) if v.is_map() => {
                        v.map_get(k.as_str()).ok_or(Failure::Fallback)
                    }
                    _ => Err(Failure::Fallback),
                }
            }
            Node::And(a, b) => self.logic(a, b, false),
            Node::Or(a, b) => self.logic(a, b, true),
            Node::Not(a) => match self.eval(a)? {
                Val::Bool(b) => Ok(Val::Bool(!b)),
                _ => Err(Failure::Fallback),
            },
            Node::NotStrictlyFalse(a) => match self.eval(a) {
                Ok(Val::Bool(false)) => Ok(Val::Bool(false)),
                Err(Failure::Bound(m)) => Err(Failure::Bound(m)),
                _ => Ok(Val::Bool(true)),
            },
            Node::Cond(c) => match self.eval(&c.0)? {
                Val::Bool(true) => self.eval(&c.1),
                Val::Bool(false) => self.eval(&c.2),
                _ => Err(Failure::Fallback),
            },
            Node::Bin(op, a, b) => {
                let x = self.eval(a)?;
                let y = self.eval(b)?;
                match (op, x) {
                    // A list just built here (`[...] + [...]`) is extended in place.
                    (BinOp::Add, Val::List(l)) if Rc::strong_count(&l) == 1 => append(l, &y),
                    (_, x) => binary(*op, x, y),
                }
            }
            Node::Neg(a) => match self.eval(a)? {
                Val::Int(i) => i.checked_neg().map(Val::Int).ok_or(Failure::Fallback),
                Val::Double(d) => Ok(Val::Double(-d)),
                _ => Err(Failure::Fallback),
            },
            Node::Append(slot, rhs) => {
                let y = self.eval(rhs)?;
                let x = std::mem::replace(
                    self.locals.get_mut(*slot).ok_or(Failure::Fallback)?,
                    Val::Null,
                );
                match x {
                    Val::List(l) => append(l, &y),
                    x => binary(BinOp::Add, x, y),
                }
            }
            Node::List(items) => {
                let mut out = Vec::with_capacity(items.len());
                for x in items {
                    out.push(self.eval(x)?);
                }
                Ok(Val::List(Rc::new(out)))
            }
            Node::Map(entries) => {
                let mut out: Vec<(Str, Val)> = Vec::with_capacity(entries.len());
                for (k, v) in entries {
                    let Val::Str(key) = self.eval(k)? else {
                        return Err(Failure::Fallback);
                    };
                    if out.iter().any(|(e, _)| e.as_str() == key.as_str()) {
                        return Err(Failure::Fallback);
                    }
                    let value = self.eval(v)?;
                    out.push((key, value));
                }
                Ok(Val::Map(Rc::new(out)))
            }
            Node::Comp(c) => self.comprehension(c),
            Node::Call(f, args) => {
                let mut vals = Vec::with_capacity(args.len());
                for a in args {
                    vals.push(self.eval(a)?);
                }
                call(*f, vals)
            }
            Node::Matches(target, re) => match self.eval(target)? {
                Val::Str(s) => Ok(Val::Bool(re.is_match(s.as_str()))),
                _ => Err(Failure::Fallback),
            },
            Node::MatchesDynamic(target, pattern) => {
                let (Val::Str(s), Val::Str(p)) = (self.eval(target)?, self.eval(pattern)?) else {
                    return Err(Failure::Fallback);
                };
                // Compiling is charged by the pattern's length; a pattern over the size limit
                // is a bound, not something to hand to the interpreter's unlimited compile.
                charge_node(p.as_str().len() * 64)?;
                match compile::regex_limited(p.as_str()) {
                    Ok(re) => Ok(Val::Bool(re.is_match(s.as_str()))),
                    Err(regex::Error::CompiledTooBig(limit)) => Err(bound(guard::bound_error(
                        format!("regular expression compiles to more than {limit} bytes"),
                    ))),
                    Err(_) => Err(Failure::Fallback),
                }
            }
            Node::Foreign(f) => {
                let mut vals = Vec::with_capacity(f.args.len());
                for a in &f.args {
                    vals.push(self.eval(a)?.to_cel()?);
                }
                foreign(f, vals)
            }
        }
    }

    /// `&&` (`or == false`) and `||`, commutative over errors as CEL's logic is.
    fn logic(&mut self, a: &'a Node, b: &'a Node, or: bool) -> R<'a> {
        let left = self.eval(a);
        if let Ok(Val::Bool(x)) = left
            && x == or
        {
            return Ok(Val::Bool(or));
        }
        if let Err(Failure::Bound(m)) = left {
            return Err(Failure::Bound(m));
        }
        let right = self.eval(b)?;
        match (left, right) {
            (Ok(Val::Bool(_)), Val::Bool(y)) => Ok(Val::Bool(y)),
            (Err(_), Val::Bool(y)) if y == or => Ok(Val::Bool(or)),
            _ => Err(Failure::Fallback),
        }
    }

    fn comprehension(&mut self, c: &'a Comp) -> R<'a> {
        let init = self.eval(&c.init)?;
        let range = self.eval(&c.range)?;
        // Lists are walked in place; map keys are collected.
        let keys = match range.list_len() {
            Some(_) => None,
            None => Some(range.iter_items().ok_or(Failure::Fallback)?),
        };
        let n = keys
            .as_ref()
            .map_or_else(|| range.list_len().unwrap_or(0), Vec::len);
        self.locals.truncate(c.slot);
        self.locals.push(Val::Null);
        self.locals.push(init);
        for i in 0..n {
            let item = match &keys {
                Some(k) => k[i].clone(),
                None => range.list_item(i).ok_or(Failure::Fallback)?,
            };
            guard::charge(1).map_err(bound)?;
            match self.eval(&c.cond)? {
                Val::Bool(true) => {}
                Val::Bool(false) => break,
                _ => return Err(Failure::Fallback),
            }
            self.locals[c.slot] = item;
            let accu = self.eval(&c.step)?;
            self.locals[c.slot + 1] = accu;
        }
        let result = self.eval(&c.result);
        self.locals.truncate(c.slot);
        result
    }
}

/// `l + y` for a list `l` no one else holds (or a copy of it): appends in place.
fn append<'a>(mut l: Rc<Vec<Val<'a>>>, y: &Val<'a>) -> R<'a> {
    let n = y.list_len().ok_or(Failure::Fallback)?;
    let items = Rc::make_mut(&mut l);
    guard::check_list(items.len() + n).map_err(bound)?;
    guard::charge(1 + n as u64).map_err(bound)?;
    for i in 0..n {
        items.push(y.list_item(i).ok_or(Failure::Fallback)?);
    }
    Ok(Val::List(l))
}

fn bound(e: kube_cel::cel::ExecutionError) -> Failure {
    Failure::Bound(e.to_string())
}

/// Size check and charge of a built value, as the interpreter's guard does for `+`.
fn charge_built(v: &Val) -> Result<(), Failure> {
    match v {
        Val::Str(s) => {
            guard::check_string(s.as_str().len()).map_err(bound)?;
            guard::charge(1 + s.as_str().len() as u64 / 64).map_err(bound)
        }
        Val::List(l) => {
            guard::check_list(l.len()).map_err(bound)?;
            guard::charge(1 + l.len() as u64).map_err(bound)
        }
        _ => guard::charge(1).map_err(bound),
    }
}

fn binary<'a>(op: BinOp, x: Val<'a>, y: Val<'a>) -> R<'a> {
    use Val::*;
    let bool_of = |b: bool| Ok(Bool(b));
    match op {
        BinOp::Eq => bool_of(equals(&x, &y)?),
        BinOp::Ne => bool_of(!equals(&x, &y)?),
        BinOp::Lt => bool_of(compare(&x, &y)? == Ordering::Less),
        BinOp::Le => bool_of(compare(&x, &y)? != Ordering::Greater),
        BinOp::Gt => bool_of(compare(&x, &y)? == Ordering::Greater),
        BinOp::Ge => bool_of(compare(&x, &y)? != Ordering::Less),
        BinOp::In => {
            if let Some(n) = y.list_len() {
                for i in 0..n {
                    if equals(&x, &y.list_item(i).ok_or(Failure::Fallback)?)? {
                        return bool_of(true);
                    }
                }
                bool_of(false)
            } else if y.is_map() {
                let key = x.str().ok_or(Failure::Fallback)?;
                bool_of(y.map_get(key).is_some())
            } else {
                Err(Failure::Fallback)
            }
        }
        BinOp::Add => {
            let v = match (&x, &y) {
                (Int(a), Int(b)) => Int(a.checked_add(*b).ok_or(Failure::Fallback)?),
                (UInt(a), UInt(b)) => UInt(a.checked_add(*b).ok_or(Failure::Fallback)?),
                (Double(a), Double(b)) => Double(a + b),
                (Str(a), Str(b)) => {
                    guard::check_string(a.as_str().len() + b.as_str().len()).map_err(bound)?;
                    let mut s = String::with_capacity(a.as_str().len() + b.as_str().len());
                    s.push_str(a.as_str());
                    s.push_str(b.as_str());
                    Str(self::Str::Own(Rc::from(s)))
                }
                _ => match (x.list_len(), y.list_len()) {
                    (Some(n), Some(m)) => {
                        guard::check_list(n + m).map_err(bound)?;
                        let mut out = Vec::with_capacity(n + m);
                        for (v, len) in [(&x, n), (&y, m)] {
                            for i in 0..len {
                                out.push(v.list_item(i).ok_or(Failure::Fallback)?);
                            }
                        }
                        List(Rc::new(out))
                    }
                    _ => return Err(Failure::Fallback),
                },
            };
            charge_built(&v)?;
            Ok(v)
        }
        BinOp::Sub | BinOp::Mul | BinOp::Div | BinOp::Mod => match (x, y) {
            (Int(a), Int(b)) => match op {
                BinOp::Sub => a.checked_sub(b),
                BinOp::Mul => a.checked_mul(b),
                BinOp::Div => a.checked_div(b),
                _ => a.checked_rem(b),
            }
            .map(Int)
            .ok_or(Failure::Fallback),
            (UInt(a), UInt(b)) => match op {
                BinOp::Sub => a.checked_sub(b),
                BinOp::Mul => a.checked_mul(b),
                BinOp::Div => a.checked_div(b),
                _ => a.checked_rem(b),
            }
            .map(UInt)
            .ok_or(Failure::Fallback),
            _ => Err(Failure::Fallback),
        },
    }
}

/// A string a function built: size-checked and charged.
fn built<'a>(s: String) -> R<'a> {
    guard::check_string(s.len()).map_err(bound)?;
    charge_node(s.len())?;
    Ok(Val::Str(Str::Own(Rc::from(s))))
}

fn arg<'a>(args: &[Val<'a>], i: usize) -> R<'a> {
    args.get(i).cloned().ok_or(Failure::Fallback)
}

fn call(f: Func, mut args: Vec<Val<'_>>) -> R<'_> {
    let s = |s: String| Val::Str(Str::Own(Rc::from(s)));
    let text = |args: &[Val], i: usize| {
        args.get(i)
            .and_then(Val::str)
            .map(str::to_owned)
            .ok_or(Failure::Fallback)
    };
    Ok(match f {
        // `size` of a string counts code points.
        Func::Size => match arg(&args, 0)? {
            Val::Str(x) => Val::Int(x.as_str().chars().count() as i64),
            v => Val::Int(
                v.list_len()
                    .or_else(|| v.map_len())
                    .ok_or(Failure::Fallback)? as i64,
            ),
        },
        Func::Contains | Func::StartsWith | Func::EndsWith => {
            let (Some(t), Some(x)) = (args[0].str(), args.get(1).and_then(Val::str)) else {
                return Err(Failure::Fallback);
            };
            Val::Bool(match f {
                Func::Contains => t.contains(x),
                Func::StartsWith => t.starts_with(x),
                _ => t.ends_with(x),
            })
        }
        Func::String => match args.swap_remove(0) {
            v @ Val::Str(_) => v,
            Val::Int(i) => s(i.to_string()),
            Val::UInt(u) => s(u.to_string()),
            _ => return Err(Failure::Fallback),
        },
        Func::Int => match arg(&args, 0)? {
            Val::Int(i) => Val::Int(i),
            Val::Str(x) => Val::Int(x.as_str().parse().map_err(|_| Failure::Fallback)?),
            _ => return Err(Failure::Fallback),
        },
        Func::ListsRange => match arg(&args, 0)? {
            Val::Int(n) if n >= 0 => {
                guard::check_list(n as usize).map_err(bound)?;
                guard::charge(1 + n as u64).map_err(bound)?;
                Val::List(Rc::new((0..n).map(Val::Int).collect()))
            }
            _ => return Err(Failure::Fallback),
        },
        Func::EscapeKey => built(text(&args, 0)?.replace('~', "~0").replace('/', "~1"))?,
        Func::Greatest | Func::Least => {
            let items: Vec<Val> = match args.as_slice() {
                [one] if one.list_len().is_some() => one.iter_items().ok_or(Failure::Fallback)?,
                _ => args,
            };
            let mut best: Option<i64> = None;
            for v in items {
                let Val::Int(i) = v else {
                    return Err(Failure::Fallback);
                };
                best = Some(match best {
                    None => i,
                    Some(b) if f == Func::Greatest => b.max(i),
                    Some(b) => b.min(i),
                });
            }
            Val::Int(best.ok_or(Failure::Fallback)?)
        }
        Func::Join => {
            let list = &args[0];
            let sep = match args.get(1) {
                Some(v) => v.str().ok_or(Failure::Fallback)?.to_owned(),
                None => String::new(),
            };
            let n = list.list_len().ok_or(Failure::Fallback)?;
            let mut parts = Vec::with_capacity(n);
            let mut total = sep.len().saturating_mul(n);
            for i in 0..n {
                let item = list.list_item(i).ok_or(Failure::Fallback)?;
                let t = item.str().ok_or(Failure::Fallback)?.to_owned();
                total = total.saturating_add(t.len());
                parts.push(t);
            }
            guard::check_string(total).map_err(bound)?;
            guard::charge(1 + total as u64 / 64).map_err(bound)?;
            s(parts.join(&sep))
        }
        Func::LowerAscii => built(text(&args, 0)?.to_ascii_lowercase())?,
        // The interpreter's own parser, so both accept the same strings.
        Func::Duration => {
            match kube_cel::cel::functions::time::duration(std::sync::Arc::new(text(&args, 0)?)) {
                // At or beyond 2^63-1 nanoseconds is an error the interpreter words.
                Ok(CelValue::Duration(d)) if !guard::saturated(&d) => {
                    Val::Foreign(CelValue::Duration(d))
                }
                _ => return Err(Failure::Fallback),
            }
        }
        // Plain quantities here; the rest (exponents, signs, errors) by the interpreter.
        Func::Quantity => match args.swap_remove(0) {
            Val::Str(t) => match Quantity::parse(t.clone()) {
                Some(q) => Val::Quantity(q),
                None => return foreign_call("quantity", vec![Val::Str(t)]),
            },
            _ => return Err(Failure::Fallback),
        },
        Func::CompareTo | Func::IsLessThan | Func::IsGreaterThan => {
            let (Val::Quantity(a), Some(Val::Quantity(b))) = (&args[0], args.get(1)) else {
                return Err(Failure::Fallback);
            };
            let o = a.compare(b).ok_or(Failure::Fallback)?;
            match f {
                Func::CompareTo => Val::Int(o as i64),
                Func::IsLessThan => Val::Bool(o == Ordering::Less),
                _ => Val::Bool(o == Ordering::Greater),
            }
        }
        // As the interpreter: whole seconds, truncated to 32 bits.
        Func::GetSeconds => match arg(&args, 0)? {
            Val::Foreign(CelValue::Duration(d)) => Val::Int(i64::from(d.num_seconds() as i32)),
            _ => return Err(Failure::Fallback),
        },
        Func::UpperAscii => built(text(&args, 0)?.to_ascii_uppercase())?,
    })
}

/// A global function call by the interpreter, over native arguments.
fn foreign_call<'a>(name: &str, args: Vec<Val<'a>>) -> R<'a> {
    let names: Vec<String> = (0..args.len())
        .map(|i| format!("__hearth_arg{i}"))
        .collect();
    let mut expr = IdedExpr {
        id: 0,
        expr: Expr::Call(CallExpr {
            func_name: name.into(),
            target: None,
            args: names
                .iter()
                .map(|n| IdedExpr {
                    id: 0,
                    expr: Expr::Ident(n.clone()),
                })
                .collect(),
        }),
    };
    compile::rewrite(&mut expr);
    let f = Foreign {
        expr,
        names,
        args: Vec::new(),
    };
    foreign(&f, args.iter().map(Val::to_cel).collect::<Result<_, _>>()?)
}

fn foreign<'a>(f: &Foreign, args: Vec<CelValue>) -> R<'a> {
    let result = guard::with_base(|base| {
        let mut ctx = base.new_inner_scope();
        for (name, v) in f.names.iter().zip(args) {
            ctx.add_variable_from_value(name.clone(), v);
        }
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            CelValue::resolve(&f.expr, &ctx)
        }))
    });
    match result {
        Ok(Ok(v)) => Val::from_cel(v),
        Ok(Err(e)) if guard::exceeded() => Err(Failure::Bound(e.to_string())),
        _ => Err(Failure::Fallback),
    }
}
