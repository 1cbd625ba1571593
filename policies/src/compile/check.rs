//! Static checks of a parsed expression: its shape against [`Limits`], the identifiers and
//! functions it names, and the literals it holds.

use std::collections::BTreeSet;

use kube_cel::cel::common::ast::{
    CallExpr, ComprehensionExpr, EntryExpr, Expr, IdedExpr, LiteralValue,
};

use crate::{guard, limits::Limits};

use super::desugar::BIND_ITER;
use super::names::{CEL_FUNCTIONS, KUBE_FUNCTIONS, OPERATORS, ROOT_VARIABLES, UNSUPPORTED};
use super::{ExprError, error_at, regex_limited};

pub(super) struct Checker<'a> {
    pub(super) source: &'a str,
    pub(super) limits: &'a Limits,
    pub(super) declared: &'a [String],
    pub(super) scope: Vec<String>,
    pub(super) uses: BTreeSet<String>,
}

impl Checker<'_> {
    pub(super) fn check(
        &mut self,
        e: &IdedExpr,
        depth: usize,
        comps: usize,
    ) -> Result<(), ExprError> {
        if depth > self.limits.max_ast_depth {
            return Err(ExprError {
                message: format!(
                    "expression is more than {} levels deep: split it into policy variables",
                    self.limits.max_ast_depth
                ),
                position: None,
            });
        }
        let d = depth + 1;
        match &e.expr {
            Expr::Literal(_) | Expr::Unspecified => Ok(()),
            Expr::Ident(name) => self.ident(name),
            Expr::Select(sel) => {
                if let Expr::Ident(root) = &sel.operand.expr
                    && root == "variables"
                    && !self.scope.iter().any(|s| s == "variables")
                {
                    if !self.declared.iter().any(|v| v == &sel.field) {
                        return Err(error_at(
                            self.source,
                            &format!("variables.{}", sel.field),
                            format!(
                                "variables.{} is not declared before this expression: add it to spec.variables above its first use",
                                sel.field
                            ),
                        ));
                    }
                    self.uses.insert(sel.field.clone());
                    return Ok(());
                }
                self.check(&sel.operand, d, comps)
            }
            Expr::Call(call) => self.call(call, d, comps),
            Expr::List(l) => l.elements.iter().try_for_each(|x| self.check(x, d, comps)),
            Expr::Map(m) => m.entries.iter().try_for_each(|en| match &en.expr {
                EntryExpr::MapEntry(me) => {
                    self.check(&me.key, d, comps)?;
                    self.check(&me.value, d, comps)
                }
                EntryExpr::StructField(f) => self.check(&f.value, d, comps),
            }),
            Expr::Struct(s) => {
                if s.type_name != "JSONPatch"
                    && s.type_name != "Object"
                    && !s.type_name.starts_with("Object.")
                {
                    return Err(error_at(
                        self.source,
                        &s.type_name,
                        format!(
                            "message type {} is not supported: build a map, Object{{...}} (ApplyConfiguration) or JSONPatch{{...}}",
                            s.type_name
                        ),
                    ));
                }
                s.entries.iter().try_for_each(|en| match &en.expr {
                    EntryExpr::StructField(f) => self.check(&f.value, d, comps),
                    EntryExpr::MapEntry(me) => self.check(&me.value, d, comps),
                })
            }
            Expr::Comprehension(c) => self.comprehension(c, d, comps),
        }
    }

    pub(super) fn ident(&mut self, name: &str) -> Result<(), ExprError> {
        if self.scope.iter().any(|s| s == name) {
            return Ok(());
        }
        if name == "variables" {
            return Err(error_at(
                self.source,
                name,
                "use a policy variable by name: variables.<name>".into(),
            ));
        }
        if ROOT_VARIABLES.contains(&name) {
            return Ok(());
        }
        let message = if name == "authorizer" {
            "authorizer is not supported: it needs the apiserver's authorization check; enforce it with RBAC or a ValidatingAdmissionPolicy".to_owned()
        } else {
            format!(
                "undeclared reference to '{name}': expressions may use {}",
                ROOT_VARIABLES.join(", ")
            )
        };
        Err(error_at(self.source, name, message))
    }

    pub(super) fn comprehension(
        &mut self,
        c: &ComprehensionExpr,
        d: usize,
        comps: usize,
    ) -> Result<(), ExprError> {
        if c.iter_var2.is_some() {
            return Err(error_at(
                self.source,
                &c.iter_var,
                "two-variable comprehensions are not supported: use the one-variable form".into(),
            ));
        }
        // `cel.bind` only names a value: it does not iterate.
        let comps = if c.iter_var == BIND_ITER {
            comps.saturating_sub(1)
        } else {
            comps
        };
        if comps + 1 > self.limits.max_comprehension_nesting {
            return Err(error_at(
                self.source,
                &format!("({}", c.iter_var),
                format!(
                    "comprehensions nest more than {} deep: compute inner results in policy variables",
                    self.limits.max_comprehension_nesting
                ),
            ));
        }
        self.check(&c.iter_range, d, comps)?;
        self.check(&c.accu_init, d, comps)?;
        self.scope.push(c.iter_var.clone());
        self.scope.push(c.accu_var.clone());
        let r = self
            .check(&c.loop_cond, d, comps + 1)
            .and_then(|_| self.check(&c.loop_step, d, comps + 1))
            .and_then(|_| self.check(&c.result, d, comps + 1));
        self.scope.pop();
        self.scope.pop();
        r
    }

    pub(super) fn call(
        &mut self,
        call: &CallExpr,
        d: usize,
        comps: usize,
    ) -> Result<(), ExprError> {
        let name = call.func_name.as_str();
        // `ns.fn(...)` parses as a call of `fn` on the identifier `ns`.
        let qualified = match call.target.as_deref().map(|t| &t.expr) {
            Some(Expr::Ident(ns))
                if !self.scope.contains(ns) && !ROOT_VARIABLES.contains(&ns.as_str()) =>
            {
                Some(format!("{ns}.{name}"))
            }
            _ => None,
        };
        let full = qualified.as_deref().unwrap_or(name);
        if let Some((_, why)) = UNSUPPORTED.iter().find(|(n, _)| *n == full) {
            return Err(error_at(self.source, full, format!("{full}: {why}")));
        }
        // Operands next, so the innermost problem is reported.
        if qualified.is_none()
            && let Some(t) = &call.target
        {
            self.check(t, d, comps)?;
        }
        call.args.iter().try_for_each(|a| self.check(a, d, comps))?;
        // The engine's own functions only come from `desugar`, which rejects them in the source.
        let known = |n: &str| {
            OPERATORS.contains(&n)
                || CEL_FUNCTIONS.contains(&n)
                || KUBE_FUNCTIONS.contains(&n)
                || n == guard::ENTRIES
                || n == guard::PUT
                || n == guard::TYPE_NAMED
                || n == guard::MAP_LITERAL
        };
        // A literal pattern that does not compile is a load error, not a per-request one.
        if matches!(full, "matches" | "find" | "findAll")
            && let Some(Expr::Literal(LiteralValue::String(p))) = call.args.first().map(|a| &a.expr)
            && let Err(e) = regex_limited(p.inner())
        {
            return Err(error_at(
                self.source,
                p.inner(),
                format!("{full}: invalid regular expression: {e}"),
            ));
        }
        if !known(full) {
            return Err(error_at(
                self.source,
                full,
                format!(
                    "unknown function '{full}': it is not in the standard or Kubernetes CEL libraries"
                ),
            ));
        }
        Ok(())
    }
}
