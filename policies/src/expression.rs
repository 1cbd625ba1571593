//! One expression outside a policy, with named bindings: what the CEL conformance suites and
//! the Kubernetes library table evaluate, through the same two evaluators and the same checks
//! and bounds as policy expressions.

use kube_cel::cel::Value;

use crate::{
    compile::{CompiledExpr, ExprError, compile_with_bindings},
    engine::{ExprFailure, run, with_stack},
    guard,
    limits::Limits,
    native,
};

/// Which evaluator runs an [`Expression`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// What policies use: the native evaluator, handing over to the interpreter whenever it
    /// does not answer (an error, a construct it does not implement).
    Engine,
    /// The `cel` interpreter alone (`PolicySet::interpreted`).
    Interpreter,
}

/// The result of one evaluation.
#[derive(Debug, Clone)]
pub struct Evaluation {
    /// The value, or the error message.
    pub result: Result<Value, String>,
    /// Whether the native evaluator answered without handing over to the interpreter.
    pub native: bool,
}

/// A compiled standalone expression.
#[derive(Debug, Clone)]
pub struct Expression {
    compiled: CompiledExpr,
    bindings: Vec<String>,
    limits: Limits,
}

impl Expression {
    /// Compiles `source` with `bindings` as its variables, under the checks policy
    /// expressions get (functions outside the supported libraries are load errors).
    ///
    /// # Errors
    /// What a policy load error would say.
    pub fn compile(source: &str, bindings: &[String]) -> Result<Self, ExprError> {
        let limits = Limits::default();
        let compiled = compile_with_bindings(source, &limits, &[], bindings)?;
        Ok(Expression {
            compiled,
            bindings: bindings.to_vec(),
            limits,
        })
    }

    /// Whether the native evaluator compiled the expression.
    pub fn has_native(&self) -> bool {
        self.compiled.native.is_some()
    }

    /// Evaluates with `values`, in the order of the bindings given to [`Expression::compile`].
    pub fn evaluate(&self, values: &[Value], path: Path) -> Evaluation {
        let _budget = guard::Budget::enter(&self.limits);
        with_stack(|| {
            if path == Path::Engine
                && let Some(program) = self.compiled.native.as_deref()
            {
                let mut env = native::Env::new(
                    std::array::from_fn(|_| native::Val::Null),
                    std::iter::empty(),
                );
                let answered = values
                    .iter()
                    .map(|v| native::Val::from_cel(v.clone()))
                    .collect::<Result<Vec<_>, _>>()
                    .and_then(|locals| {
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            env.run_bound(program, locals)
                        }))
                        .unwrap_or(Err(native::Failure::Fallback))
                    })
                    .and_then(|v| v.to_cel());
                match answered {
                    Ok(v) => {
                        return Evaluation {
                            result: Ok(v),
                            native: true,
                        };
                    }
                    Err(native::Failure::Bound(m)) => {
                        return Evaluation {
                            result: Err(m),
                            native: true,
                        };
                    }
                    Err(native::Failure::Fallback) => {}
                }
            }
            guard::with_base(|base| {
                let mut ctx = base.new_inner_scope();
                for (name, v) in self.bindings.iter().zip(values) {
                    ctx.add_variable_from_value(name.clone(), v.clone());
                }
                Evaluation {
                    result: run(&ctx, &self.compiled).map_err(|ExprFailure::Error(m, _)| m),
                    native: false,
                }
            })
        })
    }
}

/// The type value `type(x)` returns for a value of type `name` (`int`, `map`,
/// `google.protobuf.Timestamp`, …).
pub fn type_value(name: &str) -> Value {
    Value::Opaque(std::sync::Arc::new(guard::TypeValue(name.to_owned())))
}

/// The name of the type `v` denotes, when `v` is a type value.
pub fn type_name(v: &Value) -> Option<&str> {
    guard::type_value_name(v)
}
