//! Splicing the run-time guards of [`crate::guard`] into a checked expression.

use kube_cel::cel::common::ast::{
    EntryExpr, Expr, IdedEntryExpr, IdedExpr, LiteralValue, MapEntryExpr, MapExpr, operators,
};

use kube_cel::cel::common::types::CelString;

use crate::guard;

use super::desugar::{BIND_ITER, call, lit, quantifier, take};
use super::names::GROWING;
use super::variable_ident;

/// A chain of field selections on an identifier (`object.spec.template.spec`) becomes one
/// call of [`guard::PATH`], which walks the fields by reference instead of copying every
/// intermediate object as the interpreter's selection does. `variables.<name>` becomes the
/// variable's identifier. `None` when `e` is not such a chain.
pub(super) fn select_path(e: &IdedExpr, shadowed: bool) -> Option<IdedExpr> {
    let mut fields = Vec::new();
    let mut cur = e;
    while let Expr::Select(s) = &cur.expr {
        if s.test {
            return None;
        }
        fields.push(s.field.clone());
        cur = &s.operand;
    }
    let Expr::Ident(root) = &cur.expr else {
        return None;
    };
    fields.reverse();
    let mut root = root.clone();
    if root == "variables" && !shadowed {
        root = variable_ident(&fields.remove(0));
    }
    let ident = IdedExpr {
        id: 0,
        expr: Expr::Ident(root),
    };
    if fields.is_empty() {
        return Some(ident);
    }
    let mut args = vec![ident];
    args.extend(fields.into_iter().map(|f| IdedExpr {
        id: 0,
        expr: Expr::Literal(kube_cel::cel::common::ast::LiteralValue::String(
            CelString::from(f),
        )),
    }));
    Some(call(guard::PATH, None, args))
}

/// Splices in guards: comprehension ticks, size checks on growing calls, pre-checks on
/// amplifying calls; binds `variables.<name>` to its own identifier; turns `Object{...}`/`JSONPatch{...}`
/// message construction (which the interpreter cannot evaluate) into maps.
pub(crate) fn rewrite(e: &mut IdedExpr) {
    rewrite_in(e, false)
}

/// [`rewrite`] inside a comprehension whose variable is named `variables` when `shadowed`:
/// there `variables.x` is a field of that variable, not a policy variable.
pub(super) fn rewrite_in(e: &mut IdedExpr, shadowed: bool) {
    if matches!(&e.expr, Expr::Select(s) if !s.test)
        && let Some(path) = select_path(e, shadowed)
    {
        *e = path;
        return;
    }
    let rewrite = |e: &mut IdedExpr| rewrite_in(e, shadowed);
    // Children first.
    match &mut e.expr {
        Expr::Call(c) => {
            if let Some(t) = c.target.as_deref_mut() {
                rewrite(t);
            }
            c.args.iter_mut().for_each(rewrite);
        }
        Expr::Select(s) => rewrite(&mut s.operand),
        Expr::List(l) => l.elements.iter_mut().for_each(rewrite),
        Expr::Map(m) => m.entries.iter_mut().for_each(|en| {
            if let EntryExpr::MapEntry(me) = &mut en.expr {
                rewrite(&mut me.key);
                rewrite(&mut me.value);
            }
        }),
        Expr::Struct(s) => s.entries.iter_mut().for_each(|en| match &mut en.expr {
            EntryExpr::StructField(f) => rewrite(&mut f.value),
            EntryExpr::MapEntry(me) => rewrite(&mut me.value),
        }),
        Expr::Comprehension(c) if c.iter_var == BIND_ITER => {
            // `cel.bind`: the interpreter binds the value in a scope of its own (its
            // comprehension accumulator would unwrap an optional value).
            rewrite(&mut c.accu_init);
            let inner = shadowed || c.accu_var == "variables";
            rewrite_in(&mut c.result, inner);
            let var = lit(LiteralValue::String(CelString::from(c.accu_var.clone())));
            let init = take(&mut c.accu_init);
            let body = take(&mut c.result);
            *e = call(guard::BIND, None, vec![var, init, body]);
            return;
        }
        Expr::Comprehension(c) => {
            rewrite(&mut c.iter_range);
            rewrite(&mut c.accu_init);
            let inner = shadowed || c.iter_var == "variables" || c.accu_var == "variables";
            // `all` and `exists`: a guard iterates, so an element's error is absorbed when
            // another element decides the result (the interpreter's loop stops at the error).
            if let Some((guard, predicate)) = quantifier(c) {
                let mut predicate = predicate;
                rewrite_in(&mut predicate, inner);
                let range = take(&mut c.iter_range);
                let var = lit(LiteralValue::String(CelString::from(c.iter_var.clone())));
                *e = call(guard, None, vec![range, var, predicate]);
                return;
            }
            rewrite_in(&mut c.loop_cond, inner);
            rewrite_in(&mut c.loop_step, inner);
            rewrite_in(&mut c.result, inner);
            let cond = take(&mut c.loop_cond);
            c.loop_cond = call(guard::TICK, None, vec![cond]);
        }
        Expr::Literal(_) | Expr::Ident(_) | Expr::Unspecified => {}
    }
    // Then this node.
    match &mut e.expr {
        // What the path rewrite left: selections on computed values, and `has()`.
        Expr::Select(s) => {
            let field = IdedExpr {
                id: 0,
                expr: Expr::Literal(LiteralValue::String(CelString::from(s.field.clone()))),
            };
            let guard = if s.test { guard::HAS } else { guard::SELECT };
            let operand = take(&mut s.operand);
            *e = call(guard, None, vec![operand, field]);
        }
        // A map literal may not repeat a key (numbers of equal value are the same key).
        Expr::Map(m) if m.entries.len() >= 2 => {
            let n = m
                .entries
                .iter()
                .filter(|en| matches!(&en.expr, EntryExpr::MapEntry(me) if !me.optional))
                .count() as i64;
            let literal = take(e);
            *e = call(
                guard::MAP_LITERAL,
                None,
                vec![literal, lit(LiteralValue::Int(n.into()))],
            );
        }
        Expr::Struct(s) => {
            let entries = std::mem::take(&mut s.entries)
                .into_iter()
                .map(|en| match en.expr {
                    EntryExpr::StructField(f) => IdedEntryExpr {
                        id: en.id,
                        expr: EntryExpr::MapEntry(MapEntryExpr {
                            key: IdedExpr {
                                id: 0,
                                expr: Expr::Literal(
                                    kube_cel::cel::common::ast::LiteralValue::String(
                                        CelString::from(f.field),
                                    ),
                                ),
                            },
                            value: f.value,
                            optional: f.optional,
                        }),
                    },
                    other => IdedEntryExpr {
                        id: en.id,
                        expr: other,
                    },
                })
                .collect();
            e.expr = Expr::Map(MapExpr { entries });
        }
        Expr::Call(c) => {
            let qualified = match c.target.as_deref().map(|t| &t.expr) {
                Some(Expr::Ident(ns)) if ns == "lists" => format!("lists.{}", c.func_name),
                _ => c.func_name.clone(),
            };
            match qualified.as_str() {
                "join" => {
                    if let Some(t) = c.target.as_deref_mut() {
                        let mut args = vec![take(t)];
                        args.extend(c.args.first().cloned());
                        *t = call(guard::PRE_JOIN, None, args);
                    }
                }
                "replace" if c.args.len() >= 2 => {
                    if let Some(t) = c.target.as_deref_mut() {
                        let args = vec![take(t), c.args[0].clone(), c.args[1].clone()];
                        *t = call(guard::PRE_REPLACE, None, args);
                    }
                }
                "format" if c.args.len() == 1 => {
                    if let Some(t) = c.target.as_deref_mut() {
                        let args = vec![take(t), c.args[0].clone()];
                        *t = call(guard::PRE_FORMAT, None, args);
                    }
                }
                "lists.range" if c.args.len() == 1 => {
                    let n = take(&mut c.args[0]);
                    c.args[0] = call(guard::PRE_RANGE, None, vec![n]);
                }
                _ => {}
            }
            // Equality, ordering and `in` follow CEL across numeric types (`1 == 1.0`,
            // `1 < 2u`), and comparing walks both operands, which is charged.
            if c.target.is_none() && c.args.len() == 2 {
                let guarded = match c.func_name.as_str() {
                    operators::EQUALS => Some(guard::EQ),
                    operators::NOT_EQUALS => Some(guard::NE),
                    operators::IN => Some(guard::IN),
                    operators::LESS => Some(guard::LT),
                    operators::LESS_EQUALS => Some(guard::LE),
                    operators::GREATER => Some(guard::GT),
                    operators::GREATER_EQUALS => Some(guard::GE),
                    _ => None,
                };
                if let Some(g) = guarded {
                    c.func_name = g.to_owned();
                }
            }
            // Indexing and optional selection with CEL's semantics (see `guard::SELECT`).
            let renamed = match c.func_name.as_str() {
                "string" if c.args.len() == 1 => Some(guard::STRING),
                "int" if c.args.len() == 1 => Some(guard::INT),
                "timestamp" if c.args.len() == 1 => Some(guard::TIMESTAMP),
                "duration" if c.args.len() == 1 => Some(guard::DURATION),
                "bytes" if c.args.len() == 1 => Some(guard::BYTES),
                operators::NEGATE if c.args.len() == 1 => Some(guard::NEG),
                operators::INDEX => Some(guard::INDEX),
                operators::OPT_INDEX => Some(guard::OPT_INDEX),
                operators::OPT_SELECT => Some(guard::OPT_SELECT),
                _ => None,
            };
            if let (Some(g), None) = (renamed, &c.target) {
                c.func_name = g.to_owned();
            }
            // `+` and `-` with timestamps and durations as cel-go; a comprehension's
            // accumulator step stays the interpreter's (it appends in place).
            let accumulator = matches!(c.args.first().map(|a| &a.expr), Some(Expr::Ident(n)) if n.starts_with('@'));
            if c.target.is_none() && c.args.len() == 2 && !accumulator {
                if c.func_name == operators::ADD {
                    c.func_name = guard::ADD.to_owned();
                } else if c.func_name == operators::SUBSTRACT {
                    c.func_name = guard::SUB.to_owned();
                }
            }
            // `format` with cel-go's renderings (see `guard::FORMAT`).
            if c.func_name == "format"
                && c.args.len() == 1
                && let Some(target) = c.target.take()
            {
                c.args.insert(0, *target);
                c.func_name = guard::FORMAT.to_owned();
            }
            // String methods whose arguments cel-go checks (see `guard::STRING_METHOD`; none
            // of them has a namespaced form, so the target is the receiver).
            if guard::CHECKED_STRING_METHODS.contains(&c.func_name.as_str())
                && let Some(target) = c.target.take()
            {
                let name = lit(LiteralValue::String(CelString::from(c.func_name.clone())));
                let mut args = vec![name, *target];
                args.append(&mut c.args);
                c.func_name = guard::STRING_METHOD.to_owned();
                c.args = args;
            }
            // The accumulator step of a comprehension (`@result + [x]`) is charged by the tick
            // guard instead, without converting the accumulator.
            let accumulates = matches!(c.args.first().map(|a| &a.expr), Some(Expr::Ident(n)) if n.starts_with('@'));
            // `guard::ADD` checks and charges its result itself.
            if GROWING.contains(&qualified.as_str()) && !accumulates && c.func_name != guard::ADD {
                let inner = take(e);
                *e = call(guard::SIZE, None, vec![inner]);
            }
        }
        _ => {}
    }
}
