//! Hard bounds on what a policy may cost.
//!
//! The `cel` crate has no cost model of its own (cel-go's is what the apiserver uses, see
//! KEP-2876 "CRD validation expression language", section "Resource constraints"), so the
//! engine enforces these: at load time on the expression's text and tree, at evaluation time
//! with a cost budget charged by comprehension iterations and by the size of values that
//! string/list building functions produce. An exceeded bound is an evaluation error, handled
//! by the policy's `failurePolicy`.

/// The bounds one [`crate::PolicySet`] enforces. [`Limits::default`] suits admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Longest expression source, in bytes (the CRD allows 10240 for mutations).
    pub max_expression_bytes: usize,
    /// Deepest bracket nesting in the source text (`(`, `[`, `{`).
    pub max_nesting: usize,
    /// Deepest expression tree after parsing (operators, calls, selections).
    pub max_ast_depth: usize,
    /// Most comprehensions (`all`, `exists`, `map`, `filter`, …) nested inside each other.
    pub max_comprehension_nesting: usize,
    /// Cost units one expression may spend: one per comprehension iteration, plus the size of
    /// values built by `+`, `join`, `replace`, `format`, `lists.range` and friends (one unit per
    /// list element, one per 64 string bytes). `map`/`filter` over n elements cost about 2n
    /// natively, and about n²/2 on the interpreter, which copies the accumulator each step
    /// (100,000 allows ~450 elements there).
    pub max_expression_cost: u64,
    /// Cost units one request may spend over all policies and expressions.
    pub max_request_cost: u64,
    /// Longest string an evaluation may build, in bytes.
    pub max_string_bytes: usize,
    /// Longest list an evaluation may build, in elements.
    pub max_list_len: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_expression_bytes: 10 * 1024,
            max_nesting: 32,
            max_ast_depth: 96,
            max_comprehension_nesting: 3,
            max_expression_cost: 100_000,
            max_request_cost: 1_000_000,
            max_string_bytes: 1 << 20,
            max_list_len: 10_000,
        }
    }
}
