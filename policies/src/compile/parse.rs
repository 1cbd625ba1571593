//! Parsing: the newest `cel` crate's parser (renamed `cel_parser`), whose AST is converted
//! node by node into the AST of the `cel` 0.13 interpreter `kube-cel` pins, which every later
//! step (desugar, check, native compile, rewrite, evaluation) consumes.
//!
//! The newer parser fixes string and bytes escapes, triple-quoted and raw literals, repeated
//! unary operators, negative hex integers and reserved words as receiver function names.
//! Both crates share one AST shape, and expand the standard macros (`has`, `all`, `exists`,
//! `exists_one`/`existsOne`, `map`, `filter`) into the same comprehensions (accumulator
//! `@result`, same calls), so the conversion is one-to-one: ids, optional markers
//! (`?.` as `_?._` calls, `[?` as `optional_indices`, `{?` as `optional` entries) and
//! literal values are carried over unchanged.

use cel_parser::common::ast as new;
use kube_cel::cel::common::ast as old;

use super::ExprError;

/// Parses `source` with optional syntax (`?.`, `[?`, `{?`) and backtick-quoted field names
/// (``m.`content-type` ``, cel-spec's escaped identifiers) on and the parser's recursion depth
/// capped at `depth_budget` grammar rules, into the 0.13 AST.
///
/// # Errors
///
/// The parser's first syntax error (`syntax error: ...`, with its 1-based `line:column`), or
/// an unspecified node in a parsed tree (which no successful parse should leave). A node kind
/// added by a newer parser fails to compile here: every match is exhaustive.
pub(super) fn parse(source: &str, depth_budget: u16) -> Result<old::IdedExpr, ExprError> {
    parse_with(source, depth_budget, true)
}

/// [`parse`] without backtick-quoted field names, which CEL before cel-go 0.23 does not read.
pub(super) fn parse_without_escapes(
    source: &str,
    depth_budget: u16,
) -> Result<old::IdedExpr, ExprError> {
    parse_with(source, depth_budget, false)
}

fn parse_with(source: &str, depth_budget: u16, escapes: bool) -> Result<old::IdedExpr, ExprError> {
    let parsed = cel_parser::parser::Parser::new()
        .enable_optional_syntax(true)
        .enable_ident_escape_syntax(escapes)
        .max_recursion_depth(depth_budget)
        .parse(source);
    match parsed {
        Ok(e) => expr(e),
        Err(errs) => {
            let first = errs.errors.first();
            let position = first.and_then(|e| {
                let (l, c) = e.pos;
                (l > 0).then_some((l as usize, c.max(0) as usize + 1))
            });
            let message = first.map_or_else(|| errs.to_string(), |e| e.msg.clone());
            Err(ExprError {
                message: format!("syntax error: {message}"),
                position,
            })
        }
    }
}

/// One expression node, its id kept.
fn expr(e: new::IdedExpr) -> Result<old::IdedExpr, ExprError> {
    let expr = match e.expr {
        // Only a failed parse leaves a node unspecified; a successful one never should.
        new::Expr::Unspecified => {
            return Err(ExprError {
                message: "syntax error: the parser left an unspecified expression node".into(),
                position: None,
            });
        }
        new::Expr::Call(c) => old::Expr::Call(call(c)?),
        new::Expr::Comprehension(c) => old::Expr::Comprehension(Box::new(comprehension(*c)?)),
        new::Expr::Ident(name) => old::Expr::Ident(name),
        new::Expr::List(l) => old::Expr::List(list(l)?),
        new::Expr::Literal(v) => old::Expr::Literal(literal(v)),
        new::Expr::Map(m) => old::Expr::Map(map(m)?),
        new::Expr::Select(s) => old::Expr::Select(select(s)?),
        new::Expr::Struct(s) => old::Expr::Struct(structure(s)?),
    };
    Ok(old::IdedExpr { id: e.id, expr })
}

fn boxed(e: new::IdedExpr) -> Result<Box<old::IdedExpr>, ExprError> {
    expr(e).map(Box::new)
}

fn exprs(es: Vec<new::IdedExpr>) -> Result<Vec<old::IdedExpr>, ExprError> {
    es.into_iter().map(expr).collect()
}

/// A function call, global or on a receiver (`?.` is the call `_?._`, as in 0.13).
fn call(c: new::CallExpr) -> Result<old::CallExpr, ExprError> {
    Ok(old::CallExpr {
        func_name: c.func_name,
        target: c.target.map(|t| boxed(*t)).transpose()?,
        args: exprs(c.args)?,
    })
}

/// A macro expansion (or any comprehension), all seven parts and both variables kept.
fn comprehension(c: new::ComprehensionExpr) -> Result<old::ComprehensionExpr, ExprError> {
    Ok(old::ComprehensionExpr {
        iter_range: expr(c.iter_range)?,
        iter_var: c.iter_var,
        iter_var2: c.iter_var2,
        accu_var: c.accu_var,
        accu_init: expr(c.accu_init)?,
        loop_cond: expr(c.loop_cond)?,
        loop_step: expr(c.loop_step)?,
        result: expr(c.result)?,
    })
}

/// A list literal; `optional_indices` are the `[?e]` elements.
fn list(l: new::ListExpr) -> Result<old::ListExpr, ExprError> {
    Ok(old::ListExpr {
        elements: exprs(l.elements)?,
        optional_indices: l.optional_indices,
    })
}

/// A literal, value for value.
fn literal(v: new::LiteralValue) -> old::LiteralValue {
    match v {
        new::LiteralValue::Boolean(b) => old::LiteralValue::Boolean((*b.inner()).into()),
        new::LiteralValue::Bytes(b) => old::LiteralValue::Bytes(b.inner().to_vec().into()),
        new::LiteralValue::Double(d) => old::LiteralValue::Double((*d.inner()).into()),
        new::LiteralValue::Int(i) => old::LiteralValue::Int((*i.inner()).into()),
        new::LiteralValue::Null => old::LiteralValue::Null,
        new::LiteralValue::String(s) => old::LiteralValue::String(s.inner().into()),
        new::LiteralValue::UInt(u) => old::LiteralValue::UInt((*u.inner()).into()),
    }
}

/// A map literal; an entry of a map is always a key-value entry.
fn map(m: new::MapExpr) -> Result<old::MapExpr, ExprError> {
    Ok(old::MapExpr {
        entries: entries(m.entries)?,
    })
}

/// A field selection, or the presence test `has(e.f)` (`test`).
fn select(s: new::SelectExpr) -> Result<old::SelectExpr, ExprError> {
    Ok(old::SelectExpr {
        operand: boxed(*s.operand)?,
        field: s.field,
        test: s.test,
    })
}

/// A message literal `T{f: v}`.
fn structure(s: new::StructExpr) -> Result<old::StructExpr, ExprError> {
    Ok(old::StructExpr {
        type_name: s.type_name,
        entries: entries(s.entries)?,
    })
}

fn entries(es: Vec<new::IdedEntryExpr>) -> Result<Vec<old::IdedEntryExpr>, ExprError> {
    es.into_iter().map(entry).collect()
}

/// A map entry or struct field, its id and `{?` marker (`optional`) kept.
fn entry(e: new::IdedEntryExpr) -> Result<old::IdedEntryExpr, ExprError> {
    let expr = match e.expr {
        new::EntryExpr::StructField(f) => old::EntryExpr::StructField(old::StructFieldExpr {
            field: f.field,
            value: expr(f.value)?,
            optional: f.optional,
        }),
        new::EntryExpr::MapEntry(m) => old::EntryExpr::MapEntry(old::MapEntryExpr {
            key: expr(m.key)?,
            value: expr(m.value)?,
            optional: m.optional,
        }),
    };
    Ok(old::IdedEntryExpr { id: e.id, expr })
}

#[cfg(test)]
mod tests {
    use kube_cel::cel::common::ast::{Expr, LiteralValue};
    use kube_cel::cel::parser::Parser as OldParser;

    use super::parse;

    /// Where the 0.13 parser reads an expression right, the converted tree is the one it
    /// builds: same ids, macros expanded into the same comprehensions, same optional markers.
    #[test]
    fn converted_trees_equal_the_old_parsers() {
        for source in [
            "object.spec.replicas > 1 && has(object.metadata.labels)",
            "object.items.all(i, i.x > 0) || [1, 2].exists(x, x == 2)",
            "[1, 2, 3].exists_one(x, x > 2) && [1].existsOne(y, y == 1)",
            "[1, 2].map(x, x * 2) == [1, 2].map(x, x > 1, x + 1).filter(y, y != 0)",
            "{'a': 1, ?'b': optional.none()}.?a.orValue(0) + [?optional.of(1), 2][0]",
            "m.all(k, v, v > 0) && m.exists(k, v, k == 'a')",
            "cel.bind(x, 1u, x + 2u) == 3u && 1.5e3 != -2.0 && b'ab' != bytes('') && null == null",
            "a ? b.c[d] : !e",
        ] {
            let old = OldParser::new()
                .enable_optional_syntax(true)
                .parse(source)
                .unwrap_or_else(|e| panic!("{source}: {e}"));
            let new = parse(source, 96).unwrap_or_else(|e| panic!("{source}: {e}"));
            assert_eq!(new, old, "{source}");
        }
    }

    fn literal(source: &str) -> LiteralValue {
        match parse(source, 96).map(|e| e.expr) {
            Ok(Expr::Literal(v)) => v,
            other => panic!("{source}: {other:?}"),
        }
    }

    /// The literals the 0.13 parser read wrong.
    #[test]
    fn literals_are_read_as_cel_spec_defines_them() {
        let s = |v: &str| LiteralValue::String(v.into());
        let b = |v: &[u8]| LiteralValue::Bytes(v.to_vec().into());
        assert_eq!(literal(r#""\'\"\?\a\x41\101\u00e9""#), s("'\"?\x07AAé"));
        assert_eq!(literal(r"'\`\\\n'"), s("`\\\n"));
        assert_eq!(literal(r#"'''a'b'''"#), s("a'b"));
        assert_eq!(literal(r#"r'\n'"#), s("\\n"));
        assert_eq!(literal(r#"b"\n\a\\\xff\377""#), b(b"\n\x07\\\xff\xff"));
        assert_eq!(literal(r#"b'''x"y'''"#), b(b"x\"y"));
        assert_eq!(literal("-0x55"), LiteralValue::Int((-0x55).into()));
        assert_eq!(literal("0xFFu"), LiteralValue::UInt(255u64.into()));
        assert_eq!(
            literal("-9223372036854775808"),
            LiteralValue::Int(i64::MIN.into())
        );
        assert_eq!(literal("true"), LiteralValue::Boolean(true.into()));
    }

    /// As in cel-go, an even run of `!` or `-` cancels out and an odd one is a single call.
    #[test]
    fn repeated_unary_operators_cancel_in_pairs() {
        assert_eq!(literal("!!!!true"), LiteralValue::Boolean(true.into()));
        assert_eq!(literal("----19"), LiteralValue::Int(19.into()));
        for (source, op) in [("!!!true", "!_"), ("---x", "-_")] {
            match parse(source, 96).map(|e| e.expr) {
                Ok(Expr::Call(c)) => {
                    assert_eq!(c.func_name, op, "{source}");
                    assert!(
                        matches!(c.args.as_slice(), [a] if !matches!(a.expr, Expr::Call(_))),
                        "{source}: {:?}",
                        c.args
                    );
                }
                other => panic!("{source}: {other:?}"),
            }
        }
    }

    /// Syntax errors keep the position the 0.13 parser reported for the same mistake.
    #[test]
    fn syntax_errors_name_the_line_and_column() {
        for source in ["1 +\n  * 2", "a.b(", "{'a': }", "x[?1"] {
            let old = OldParser::new()
                .enable_optional_syntax(true)
                .parse(source)
                .err()
                .and_then(|e| e.errors.first().map(|e| e.pos))
                .map(|(l, c)| (l as usize, c.max(0) as usize + 1));
            let err = parse(source, 96)
                .err()
                .unwrap_or_else(|| panic!("{source} parsed"));
            assert!(err.message.starts_with("syntax error: "), "{err:?}");
            assert!(err.position.is_some(), "{source}: {err:?}");
            assert_eq!(err.position, old, "{source}: {err:?}");
        }
        let deep = format!("{}1{}", "(".repeat(200), ")".repeat(200));
        // As in `compile_expr`, the parser recurses per grammar rule: parse on a large stack.
        assert!(stacker::grow(64 << 20, || parse(&deep, 96)).is_err());
    }
}
