//! Compiling one CEL expression: text bounds, parsing, checks for what this engine cannot
//! evaluate, and the rewrite that splices in the run-time guards of [`crate::guard`].
//!
//! The steps live in submodules: `parse`, `names` (what an expression may call), `check`,
//! `desugar` and `rewrite`; [`compile_expr`] runs them in that order.

mod check;
mod desugar;
mod names;
mod parse;
mod rewrite;
mod used;

use std::{collections::BTreeSet, sync::Arc};

use kube_cel::cel::common::ast::IdedExpr;

use crate::{limits::Limits, native};

pub use names::ROOT_VARIABLES;
pub(crate) use rewrite::rewrite;
pub use used::{Used, used};

use check::Checker;
use desugar::desugar;

/// Why an expression did not compile. `Display` names the problem and, where known, the
/// position (`line:column`, 1-based) in the expression.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ExprError {
    /// What is wrong and how to fix it.
    pub message: String,
    /// 1-based line and column of the problem in the expression, when known.
    pub position: Option<(usize, usize)>,
}

/// A compiled expression: the guarded tree, ready to evaluate many times.
#[derive(Debug, Clone)]
pub struct CompiledExpr {
    /// The CEL source as written.
    pub source: String,
    pub(crate) expr: IdedExpr,
    /// Names of policy variables the expression reads (`variables.<name>`).
    pub(crate) uses_variables: BTreeSet<String>,
    /// The native program, when the expression uses only what [`crate::native`] implements.
    pub(crate) native: Option<Arc<native::Program>>,
}

fn error_at(source: &str, needle: &str, message: String) -> ExprError {
    ExprError {
        position: source.find(needle).map(|i| line_col(source, i)),
        message,
    }
}

fn line_col(source: &str, byte: usize) -> (usize, usize) {
    let before = &source[..byte];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// Deepest `(`/`[`/`{` nesting in the source text, outside string literals, with the byte
/// offset where it first exceeds `limit`.
fn text_nesting(source: &str, limit: usize) -> Option<usize> {
    let bytes = source.as_bytes();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'"' | b'\'' => {
                // Skip a string literal (single, or triple quoted), honouring backslashes.
                let triple = bytes.get(i + 1) == Some(&c) && bytes.get(i + 2) == Some(&c);
                i += if triple { 3 } else { 1 };
                while i < bytes.len() {
                    if bytes[i] == b'\\' {
                        i += 2;
                        continue;
                    }
                    if bytes[i] == c
                        && (!triple
                            || (bytes.get(i + 1) == Some(&c) && bytes.get(i + 2) == Some(&c)))
                    {
                        i += if triple { 3 } else { 1 };
                        break;
                    }
                    i += 1;
                }
                continue;
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return Some(i);
                }
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    None
}

/// Compiled size limit of a regular expression (the `regex` crate's default is 10 MiB): large
/// enough for any realistic pattern, small enough that compiling a hostile one fails fast.
pub(crate) const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// Compiles a regular expression under [`REGEX_SIZE_LIMIT`].
pub(crate) fn regex_limited(pattern: &str) -> Result<regex::Regex, regex::Error> {
    regex::RegexBuilder::new(pattern)
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
}

/// Compiles one expression under `limits`. `declared` are the policy variables defined before
/// this expression (in order), which `variables.<name>` may name.
pub fn compile_expr(
    source: &str,
    limits: &Limits,
    declared: &[String],
) -> Result<CompiledExpr, ExprError> {
    compile_with_bindings(source, limits, declared, &[])
}

/// [`compile_expr`] where `bindings` are extra identifiers in scope (a standalone expression's
/// variables, see [`crate::expression`]).
pub(crate) fn compile_with_bindings(
    source: &str,
    limits: &Limits,
    declared: &[String],
    bindings: &[String],
) -> Result<CompiledExpr, ExprError> {
    if source.len() > limits.max_expression_bytes {
        return Err(ExprError {
            message: format!(
                "expression is {} bytes, more than the limit of {}: split it into policy variables",
                source.len(),
                limits.max_expression_bytes
            ),
            position: None,
        });
    }
    if source.trim().is_empty() {
        return Err(ExprError {
            message: "expression is empty".into(),
            position: None,
        });
    }
    if let Some(at) = text_nesting(source, limits.max_nesting) {
        return Err(ExprError {
            message: format!(
                "expression nests brackets more than {} deep: flatten it or use policy variables",
                limits.max_nesting
            ),
            position: Some(line_col(source, at)),
        });
    }
    // Parsing recurses per grammar rule; a long operator chain is deep even without brackets,
    // so parse on a stack sized for the longest allowed source.
    let depth_budget = (limits.max_nesting * 12).min(u16::MAX as usize - 1) as u16;
    let mut expr = stacker::grow(64 << 20, || parse::parse(source, depth_budget))?;
    stacker::grow(16 << 20, || {
        desugar(&mut expr, &mut bindings.to_vec(), limits.max_ast_depth + 1)
    })
    .map_err(|name| error_at(source, &name, format!("{name} is reserved for the engine")))?;
    let mut checker = Checker {
        source,
        limits,
        declared,
        scope: bindings.to_vec(),
        uses: BTreeSet::new(),
    };
    stacker::grow(16 << 20, || checker.check(&expr, 1, 0))?;
    let uses_variables = checker.uses;
    let native =
        stacker::grow(16 << 20, || native::compile(&expr, declared, bindings)).map(Arc::new);
    stacker::grow(16 << 20, || rewrite(&mut expr));
    Ok(CompiledExpr {
        source: source.to_owned(),
        expr,
        uses_variables,
        native,
    })
}

/// The context identifier holding policy variable `name` (`variables.<name>` is rewritten to
/// it, so each variable is converted into the interpreter's representation once).
pub(crate) fn variable_ident(name: &str) -> String {
    format!("__hearth_var_{name}")
}
