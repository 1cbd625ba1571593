//! What an expression names as it is written (before the engine's own rewrites): the root
//! variables it reads and the functions and constructs it uses. [`crate::export`] decides with
//! it whether the apiserver can run an expression.

use std::collections::BTreeSet;

use kube_cel::cel::common::ast::{EntryExpr, Expr, IdedExpr, operators};

use super::names::{OPERATORS, ROOT_VARIABLES};
use super::{ExprError, parse};

/// The names one expression uses.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Used {
    /// Root variables read (`object`, `params`, `service`, …), not counting names a
    /// comprehension binds.
    pub roots: BTreeSet<String>,
    /// Functions called, qualified as written (`matches`, `lists.range`, `cel.bind`), the
    /// optional operators as `?.` (`a.?b`) and `[?]` (`m[?k]`), and two-variable
    /// comprehensions as `<macro>(k, v, …)` (`all(k, v, …)`), the global `max(a, b)` and
    /// `min(a, b)` as `max(…)` and `min(…)`.
    pub functions: BTreeSet<String>,
    /// Whether a field name is quoted in backticks (`` a.`content-type` ``).
    pub escaped_field: bool,
}

const TWO_VARIABLE: &[&str] = &[
    "all",
    "exists",
    "existsOne",
    "exists_one",
    "transformList",
    "transformMap",
];

/// The names `source` uses.
///
/// # Errors
///
/// The expression's syntax error.
pub fn used(source: &str) -> Result<Used, ExprError> {
    let depth = 4096;
    let expr = stacker::grow(64 << 20, || parse::parse(source, depth))?;
    let mut out = Used {
        escaped_field: source.contains('`') && parse::parse_without_escapes(source, depth).is_err(),
        ..Used::default()
    };
    let mut scope = Vec::new();
    stacker::grow(16 << 20, || walk(&expr, &mut scope, &mut out));
    Ok(out)
}

fn walk(e: &IdedExpr, scope: &mut Vec<String>, out: &mut Used) {
    match &e.expr {
        Expr::Literal(_) | Expr::Unspecified => {}
        Expr::Ident(name) => {
            if !scope.contains(name) && ROOT_VARIABLES.contains(&name.as_str()) {
                out.roots.insert(name.clone());
            }
        }
        Expr::Select(s) => walk(&s.operand, scope, out),
        Expr::Call(c) => {
            let name = c.func_name.as_str();
            let namespace = match c.target.as_deref().map(|t| &t.expr) {
                Some(Expr::Ident(ns))
                    if !scope.contains(ns) && !ROOT_VARIABLES.contains(&ns.as_str()) =>
                {
                    Some(ns.clone())
                }
                _ => None,
            };
            // `cel.bind(x, init, body)` and `range.all(k, v, p)` bind names for their last
            // arguments.
            let binds = if namespace.as_deref() == Some("cel") && name == "bind" {
                out.functions.insert("cel.bind".to_owned());
                1
            } else if namespace.is_none() && TWO_VARIABLE.contains(&name) && c.args.len() >= 3 {
                out.functions.insert(format!("{name}(k, v, …)"));
                2
            } else {
                let written = match name {
                    operators::OPT_SELECT => "?.".to_owned(),
                    operators::OPT_INDEX => "[?]".to_owned(),
                    // The variadic `max(a, b)`, not the list member `l.max()`.
                    "max" | "min" if c.target.is_none() => format!("{name}(…)"),
                    _ => namespace
                        .as_ref()
                        .map_or_else(|| name.to_owned(), |ns| format!("{ns}.{name}")),
                };
                let operator = OPERATORS.contains(&name) || name.starts_with('@');
                if !operator || written == "?." || written == "[?]" {
                    out.functions.insert(written);
                }
                0
            };
            if namespace.is_none()
                && let Some(t) = &c.target
            {
                walk(t, scope, out);
            }
            let mut pushed = 0;
            for (i, a) in c.args.iter().enumerate() {
                if i < binds {
                    if let Expr::Ident(n) = &a.expr {
                        scope.push(n.clone());
                        pushed += 1;
                    }
                    continue;
                }
                walk(a, scope, out);
            }
            scope.truncate(scope.len() - pushed);
        }
        Expr::List(l) => l.elements.iter().for_each(|x| walk(x, scope, out)),
        Expr::Map(m) => m.entries.iter().for_each(|en| match &en.expr {
            EntryExpr::MapEntry(me) => {
                walk(&me.key, scope, out);
                walk(&me.value, scope, out);
            }
            EntryExpr::StructField(f) => walk(&f.value, scope, out),
        }),
        Expr::Struct(s) => s.entries.iter().for_each(|en| match &en.expr {
            EntryExpr::StructField(f) => walk(&f.value, scope, out),
            EntryExpr::MapEntry(me) => walk(&me.value, scope, out),
        }),
        Expr::Comprehension(c) => {
            walk(&c.iter_range, scope, out);
            walk(&c.accu_init, scope, out);
            scope.push(c.iter_var.clone());
            scope.extend(c.iter_var2.clone());
            scope.push(c.accu_var.clone());
            walk(&c.loop_cond, scope, out);
            walk(&c.loop_step, scope, out);
            walk(&c.result, scope, out);
            scope.truncate(scope.len() - 2 - usize::from(c.iter_var2.is_some()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn roots_functions_and_constructs_as_written() {
        let u = used("service != null ? service.spec.x : params.spec.y.matches('a')").unwrap();
        assert_eq!(u.roots, set(&["params", "service"]));
        assert_eq!(u.functions, set(&["matches"]));
        let u =
            used("cel.bind(settings, object.a, settings.b) && lists.range(2).size() > 0").unwrap();
        assert_eq!(
            u.roots,
            set(&["object"]),
            "the bound name is not the root variable"
        );
        assert!(u.functions.contains("cel.bind") && u.functions.contains("lists.range"));
        let u = used("object.m.all(k, v, k == v) && object.?a.orValue(1) == 1").unwrap();
        assert!(u.functions.contains("all(k, v, …)"), "{:?}", u.functions);
        assert!(u.functions.contains("?."), "{:?}", u.functions);
        assert!(!u.roots.contains("v"));
        let u = used("object.spec.containers.all(c, c.name != '')").unwrap();
        assert_eq!(u.roots, set(&["object"]));
        assert!(!u.escaped_field);
        assert!(used("object.`content-type` == 'x'").unwrap().escaped_field);
        assert!(!used("'`' == object.a").unwrap().escaped_field);
    }
}
