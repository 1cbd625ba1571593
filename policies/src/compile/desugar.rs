//! Rewriting what the apiserver's CEL has and the interpreter does not into what it has:
//! `dyn(x)`, `cel.bind` and two-variable comprehensions.

use kube_cel::cel::common::ast::{
    CallExpr, ComprehensionExpr, EntryExpr, Expr, IdedExpr, LiteralValue, MapExpr, operators,
};

use kube_cel::cel::common::types::CelString;

use crate::guard;

/// The guard and predicate of an `all` or `exists` comprehension as the parser's macros
/// (and [`two_variable`]) build them: `@result && p` from `true`, `@result || p` from `false`.
pub(super) fn quantifier(c: &mut ComprehensionExpr) -> Option<(&'static str, IdedExpr)> {
    if c.accu_var != RESULT || !matches!(&c.result.expr, Expr::Ident(r) if r == RESULT) {
        return None;
    }
    let Expr::Literal(LiteralValue::Boolean(init)) = &c.accu_init.expr else {
        return None;
    };
    let (guard, op) = if *init.inner() {
        (guard::ALL, operators::LOGICAL_AND)
    } else {
        (guard::EXISTS, operators::LOGICAL_OR)
    };
    let Expr::Call(step) = &mut c.loop_step.expr else {
        return None;
    };
    if step.func_name != op
        || step.args.len() != 2
        || !matches!(&step.args[0].expr, Expr::Ident(r) if r == RESULT)
    {
        return None;
    }
    Some((guard, take(&mut step.args[1])))
}

/// The iteration variable of the comprehension `cel.bind` becomes (it never iterates).
pub(crate) const BIND_ITER: &str = "#bind";

pub(super) fn ident(name: &str) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::Ident(name.to_owned()),
    }
}

pub(super) fn lit(l: LiteralValue) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::Literal(l),
    }
}

pub(super) fn list_of(elements: Vec<IdedExpr>) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::List(kube_cel::cel::common::ast::ListExpr {
            elements,
            optional_indices: Vec::new(),
        }),
    }
}

pub(super) fn comprehension(c: ComprehensionExpr) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::Comprehension(Box::new(c)),
    }
}

/// `cel.bind(var, init, body)` as cel-go expands it: a comprehension over nothing whose
/// accumulator `var` holds `init` and whose result is `body`.
pub(super) fn bind(var: &str, init: IdedExpr, body: IdedExpr) -> IdedExpr {
    comprehension(ComprehensionExpr {
        iter_range: list_of(Vec::new()),
        iter_var: BIND_ITER.to_owned(),
        iter_var2: None,
        accu_var: var.to_owned(),
        accu_init: init,
        loop_cond: lit(LiteralValue::Boolean(false.into())),
        loop_step: ident(var),
        result: body,
    })
}

/// Type denotations: identifiers that stand for a type value.
pub(super) const TYPE_NAMES: &[&str] = &[
    "optional_type",
    "int",
    "uint",
    "double",
    "bool",
    "string",
    "bytes",
    "list",
    "map",
    "null_type",
    "type",
];

/// The optional `optMap` and `optFlatMap` look into.
pub(super) const OPT: &str = "#opt";

/// The iteration variable of a two-variable comprehension: a `[key, value]` pair.
pub(super) const PAIR: &str = "#pair";
/// The accumulator, named as the parser's macros name it.
pub(super) const RESULT: &str = "@result";

/// A two-variable comprehension (`range.all(k, v, p)`, `exists`, `existsOne`,
/// `transformList`, `transformMap`) over the `[key, value]` pairs of `range`, with `k` and `v`
/// bound in each step. `None` when `func` is not one.
pub(super) fn two_variable(
    func: &str,
    range: IdedExpr,
    k: &str,
    v: &str,
    mut rest: Vec<IdedExpr>,
) -> Option<IdedExpr> {
    let at = |i: i64| {
        call(
            operators::INDEX,
            None,
            vec![ident(PAIR), lit(LiteralValue::Int(i.into()))],
        )
    };
    let bound = |body: IdedExpr| bind(k, at(0), bind(v, at(1), body));
    let acc = || ident(RESULT);
    let (init, cond, step, result) = match (func, rest.len()) {
        ("all", 1) => (
            lit(LiteralValue::Boolean(true.into())),
            call(operators::NOT_STRICTLY_FALSE, None, vec![acc()]),
            call(
                operators::LOGICAL_AND,
                None,
                vec![acc(), bound(rest.remove(0))],
            ),
            acc(),
        ),
        ("exists", 1) => (
            lit(LiteralValue::Boolean(false.into())),
            call(
                operators::NOT_STRICTLY_FALSE,
                None,
                vec![call(operators::LOGICAL_NOT, None, vec![acc()])],
            ),
            call(
                operators::LOGICAL_OR,
                None,
                vec![acc(), bound(rest.remove(0))],
            ),
            acc(),
        ),
        ("existsOne" | "exists_one", 1) => (
            lit(LiteralValue::Int(0.into())),
            lit(LiteralValue::Boolean(true.into())),
            bound(call(
                operators::CONDITIONAL,
                None,
                vec![
                    rest.remove(0),
                    call(
                        operators::ADD,
                        None,
                        vec![acc(), lit(LiteralValue::Int(1.into()))],
                    ),
                    acc(),
                ],
            )),
            call(
                operators::EQUALS,
                None,
                vec![acc(), lit(LiteralValue::Int(1.into()))],
            ),
        ),
        ("transformList", 1 | 2) => {
            let value = rest.pop()?;
            let add = call(operators::ADD, None, vec![acc(), list_of(vec![value])]);
            let step = match rest.pop() {
                Some(filter) => call(operators::CONDITIONAL, None, vec![filter, add, acc()]),
                None => add,
            };
            (
                list_of(Vec::new()),
                lit(LiteralValue::Boolean(true.into())),
                bound(step),
                acc(),
            )
        }
        ("transformMap", 1 | 2) => {
            let value = rest.pop()?;
            let add = call(guard::PUT, None, vec![acc(), ident(k), value]);
            let step = match rest.pop() {
                Some(filter) => call(operators::CONDITIONAL, None, vec![filter, add, acc()]),
                None => add,
            };
            (
                IdedExpr {
                    id: 0,
                    expr: Expr::Map(MapExpr {
                        entries: Vec::new(),
                    }),
                },
                lit(LiteralValue::Boolean(true.into())),
                bound(step),
                acc(),
            )
        }
        _ => return None,
    };
    Some(comprehension(ComprehensionExpr {
        iter_range: call(guard::ENTRIES, None, vec![range]),
        iter_var: PAIR.to_owned(),
        iter_var2: None,
        accu_var: RESULT.to_owned(),
        accu_init: init,
        loop_cond: cond,
        loop_step: step,
        result,
    }))
}

/// Rewrites what the apiserver's CEL has and the interpreter does not into what it has:
/// `dyn(x)` (a type-checker hint) is `x`; `cel.bind(v, init, body)` is the comprehension
/// cel-go expands it to; two-variable comprehensions iterate `[key, value]` pairs with both
/// variables bound. Errors with the name of an engine function written in the source.
pub(super) fn desugar(
    e: &mut IdedExpr,
    scope: &mut Vec<String>,
    depth: usize,
) -> Result<(), String> {
    // Deeper than any expression may be: the checker rejects it.
    let Some(depth) = depth.checked_sub(1) else {
        return Ok(());
    };
    match &mut e.expr {
        Expr::Call(c) => {
            if c.func_name.starts_with("__hearth") {
                return Err(c.func_name.clone());
            }
            // `ns.fn(...)`'s namespace is not an identifier to rewrite.
            if let Some(t) = c.target.as_deref_mut()
                && !matches!(&t.expr, Expr::Ident(n) if !scope.contains(n))
            {
                desugar(t, scope, depth)?;
            }
            c.args
                .iter_mut()
                .try_for_each(|a| desugar(a, scope, depth))?;
        }
        Expr::Select(s) => {
            // `net.IP` and `net.CIDR` denote the IP library's types.
            if matches!(&s.operand.expr, Expr::Ident(n) if n == "net" && !scope.contains(n))
                && matches!(s.field.as_str(), "IP" | "CIDR")
                && !s.test
            {
                let name = format!("net.{}", s.field);
                *e = call(
                    guard::TYPE_NAMED,
                    None,
                    vec![lit(LiteralValue::String(CelString::from(name)))],
                );
                return Ok(());
            }
            desugar(&mut s.operand, scope, depth)?
        }
        Expr::List(l) => l
            .elements
            .iter_mut()
            .try_for_each(|x| desugar(x, scope, depth))?,
        Expr::Map(m) => m.entries.iter_mut().try_for_each(|en| match &mut en.expr {
            EntryExpr::MapEntry(me) => {
                desugar(&mut me.key, scope, depth)?;
                desugar(&mut me.value, scope, depth)
            }
            EntryExpr::StructField(f) => desugar(&mut f.value, scope, depth),
        })?,
        Expr::Struct(s) => s.entries.iter_mut().try_for_each(|en| match &mut en.expr {
            EntryExpr::MapEntry(me) => {
                desugar(&mut me.key, scope, depth)?;
                desugar(&mut me.value, scope, depth)
            }
            EntryExpr::StructField(f) => desugar(&mut f.value, scope, depth),
        })?,
        Expr::Comprehension(c) => {
            desugar(&mut c.iter_range, scope, depth)?;
            desugar(&mut c.accu_init, scope, depth)?;
            let mark = scope.len();
            scope.push(c.iter_var.clone());
            scope.push(c.accu_var.clone());
            let inner = desugar(&mut c.loop_cond, scope, depth)
                .and_then(|_| desugar(&mut c.loop_step, scope, depth))
                .and_then(|_| desugar(&mut c.result, scope, depth));
            scope.truncate(mark);
            inner?;
        }
        Expr::Ident(name) => {
            // A type denotation (`type(x) == string`) is a value.
            if TYPE_NAMES.contains(&name.as_str()) && !scope.contains(name) {
                let name = name.clone();
                *e = call(
                    guard::TYPE_NAMED,
                    None,
                    vec![lit(LiteralValue::String(CelString::from(name)))],
                );
            }
            return Ok(());
        }
        Expr::Literal(_) | Expr::Unspecified => {}
    }
    let Expr::Call(c) = &mut e.expr else {
        return Ok(());
    };
    if c.func_name == "dyn" && c.target.is_none() && c.args.len() == 1 {
        *e = take(&mut c.args[0]);
        return Ok(());
    }
    let is_cel =
        matches!(c.target.as_deref().map(|t| &t.expr), Some(Expr::Ident(ns)) if ns == "cel");
    if is_cel
        && c.func_name == "bind"
        && c.args.len() == 3
        && let Expr::Ident(var) = &c.args[0].expr
    {
        let var = var.clone();
        let body = take(&mut c.args[2]);
        let init = take(&mut c.args[1]);
        *e = bind(&var, init, body);
        return Ok(());
    }
    // `o.optMap(v, e)`: `optional.of(e)` with `v` bound to the value, none when `o` is none;
    // `optFlatMap` returns `e` itself.
    if matches!(c.func_name.as_str(), "optMap" | "optFlatMap")
        && c.args.len() == 2
        && c.target.is_some()
        && let Expr::Ident(var) = &c.args[0].expr
    {
        let var = var.clone();
        let flat = c.func_name == "optFlatMap";
        let body = take(&mut c.args[1]);
        let target = c.target.as_deref_mut().map(take).unwrap_or_default();
        let method = |name: &str, on: IdedExpr, args: Vec<IdedExpr>| IdedExpr {
            id: 0,
            expr: Expr::Call(CallExpr {
                func_name: name.to_owned(),
                target: Some(Box::new(on)),
                args,
            }),
        };
        let mapped = bind(&var, method("value", ident(OPT), Vec::new()), body);
        let some = if flat {
            mapped
        } else {
            method("of", ident("optional"), vec![mapped])
        };
        *e = bind(
            OPT,
            target,
            call(
                operators::CONDITIONAL,
                None,
                vec![
                    method("hasValue", ident(OPT), Vec::new()),
                    some,
                    method("none", ident("optional"), Vec::new()),
                ],
            ),
        );
        return Ok(());
    }
    let two_variable_form = matches!(
        (c.func_name.as_str(), c.args.len()),
        ("all" | "exists" | "existsOne" | "exists_one", 3)
            | ("transformList" | "transformMap", 3 | 4)
    );
    if two_variable_form
        && let (Some(_), Expr::Ident(k), Expr::Ident(v)) =
            (c.target.as_deref(), &c.args[0].expr, &c.args[1].expr)
    {
        let (k, v) = (k.clone(), v.clone());
        let rest: Vec<IdedExpr> = c.args.drain(2..).collect();
        let range = c.target.as_deref_mut().map(take).unwrap_or_default();
        let func = c.func_name.clone();
        if let Some(desugared) = two_variable(&func, range, &k, &v, rest) {
            *e = desugared;
        }
    }
    Ok(())
}

pub(super) fn call(name: &str, target: Option<IdedExpr>, args: Vec<IdedExpr>) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::Call(CallExpr {
            func_name: name.to_owned(),
            target: target.map(Box::new),
            args,
        }),
    }
}

pub(super) fn take(e: &mut IdedExpr) -> IdedExpr {
    std::mem::take(e)
}
