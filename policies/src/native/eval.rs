//! Running a native program: the environment of roots, lazily evaluated policy variables and
//! comprehension locals; operators and functions; library calls handed to the interpreter.

use std::{cmp::Ordering, rc::Rc};

use kube_cel::cel::{
    Value as CelValue,
    common::ast::{CallExpr, Expr, IdedExpr},
};

use crate::guard;

use super::compile::{BinOp, Comp, Foreign, Func, Lit, Node, Program, ROOTS};
use super::value::{Quantity, Str, Val, charge_node, compare, equals};
use super::{Failure, R};

/// A policy variable: evaluated on first use, at most once per object (as the apiserver's
/// lazy variables).
pub(super) enum Var<'a> {
    Pending(&'a str, &'a Program),
    Evaluating,
    Done(Val<'a>),
    Failed(Failure),
}

/// The variables of one evaluation: the roots, the policy variables, and the comprehension
/// stack.
pub(crate) struct Env<'a> {
    pub(super) roots: [Val<'a>; ROOTS],
    pub(super) vars: Vec<Var<'a>>,
    pub(super) locals: Vec<Val<'a>>,
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
    pub(super) fn variable(&mut self, i: usize) -> R<'a> {
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

    pub(super) fn eval(&mut self, n: &'a Node) -> R<'a> {
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
                match crate::compile::regex_limited(p.as_str()) {
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
    pub(super) fn logic(&mut self, a: &'a Node, b: &'a Node, or: bool) -> R<'a> {
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

    pub(super) fn comprehension(&mut self, c: &'a Comp) -> R<'a> {
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
pub(super) fn append<'a>(mut l: Rc<Vec<Val<'a>>>, y: &Val<'a>) -> R<'a> {
    let n = y.list_len().ok_or(Failure::Fallback)?;
    let items = Rc::make_mut(&mut l);
    guard::check_list(items.len() + n).map_err(bound)?;
    guard::charge(1 + n as u64).map_err(bound)?;
    for i in 0..n {
        items.push(y.list_item(i).ok_or(Failure::Fallback)?);
    }
    Ok(Val::List(l))
}

pub(super) fn bound(e: kube_cel::cel::ExecutionError) -> Failure {
    Failure::Bound(e.to_string())
}

/// Size check and charge of a built value, as the interpreter's guard does for `+`.
pub(super) fn charge_built(v: &Val) -> Result<(), Failure> {
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

pub(super) fn binary<'a>(op: BinOp, x: Val<'a>, y: Val<'a>) -> R<'a> {
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
pub(super) fn built<'a>(s: String) -> R<'a> {
    guard::check_string(s.len()).map_err(bound)?;
    charge_node(s.len())?;
    Ok(Val::Str(Str::Own(Rc::from(s))))
}

pub(super) fn arg<'a>(args: &[Val<'a>], i: usize) -> R<'a> {
    args.get(i).cloned().ok_or(Failure::Fallback)
}

pub(super) fn call(f: Func, mut args: Vec<Val<'_>>) -> R<'_> {
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
pub(super) fn foreign_call<'a>(name: &str, args: Vec<Val<'a>>) -> R<'a> {
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
    crate::compile::rewrite(&mut expr);
    let f = Foreign {
        expr,
        names,
        args: Vec::new(),
    };
    foreign(&f, args.iter().map(Val::to_cel).collect::<Result<_, _>>()?)
}

pub(super) fn foreign<'a>(f: &Foreign, args: Vec<CelValue>) -> R<'a> {
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
