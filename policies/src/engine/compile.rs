//! Compiling one ServingPolicy: every expression of its spec, with the field it came from.

use hearth_crds::servingpolicy::{
    FailurePolicy, MatchResources, MutationAction, PatchType, ReinvocationPolicy, ServingPolicy,
    StatusReason, ValidationAction,
};

use crate::{
    compile::{CompiledExpr, ExprError, compile_expr},
    limits::Limits,
};

use super::types::PolicyLoadError;

pub(super) struct Named {
    pub(super) name: String,
    pub(super) field: String,
    pub(super) expr: CompiledExpr,
}

pub(super) struct CompiledValidation {
    pub(super) field: String,
    pub(super) expr: CompiledExpr,
    pub(super) message: Option<String>,
    pub(super) message_expr: Option<(String, CompiledExpr)>,
    pub(super) reason: StatusReason,
}

pub(super) struct CompiledMutation {
    pub(super) field: String,
    pub(super) patch_type: PatchType,
    pub(super) expr: CompiledExpr,
}

pub(super) struct CompiledPolicy {
    pub(super) name: String,
    pub(super) failure_policy: FailurePolicy,
    pub(super) match_constraints: Option<MatchResources>,
    pub(super) match_conditions: Vec<Named>,
    pub(super) variables: Vec<Named>,
    pub(super) validations: Vec<CompiledValidation>,
    pub(super) actions: Vec<ValidationAction>,
    pub(super) audit_annotations: Vec<Named>,
    pub(super) mutations: Vec<CompiledMutation>,
    pub(super) reinvocation: ReinvocationPolicy,
    /// `spec.mutationActions`.
    pub(super) mutation_actions: Vec<MutationAction>,
    /// Every expression has a native program.
    pub(super) native: bool,
    /// Root variables the native programs read (see [`native::REQUEST_ROOT`]).
    pub(super) roots: u8,
}

pub(super) fn compile_policy(
    p: &ServingPolicy,
    limits: &Limits,
) -> Result<CompiledPolicy, PolicyLoadError> {
    let name = p.metadata.name.clone().unwrap_or_default();
    let spec = &p.spec;
    let err = |field: String, error: ExprError| PolicyLoadError {
        policy: name.clone(),
        field,
        error,
    };
    let mut declared: Vec<String> = Vec::new();
    let mut variables = Vec::new();
    for (i, v) in spec.variables.iter().enumerate() {
        let field = format!("spec.variables[{i}].expression");
        let expr =
            compile_expr(&v.expression, limits, &declared).map_err(|e| err(field.clone(), e))?;
        declared.push(v.name.clone());
        variables.push(Named {
            name: v.name.clone(),
            field,
            expr,
        });
    }
    if spec.match_conditions.len() > 64 {
        return Err(err(
            "spec.matchConditions".into(),
            ExprError {
                message: "at most 64 matchConditions are allowed".into(),
                position: None,
            },
        ));
    }
    // matchConditions run before variables (as in the apiserver), so they cannot use them.
    let named = |list: &mut Vec<Named>,
                 items: Vec<(String, String, &str)>,
                 vars: &[String]|
     -> Result<(), PolicyLoadError> {
        for (n, field, src) in items {
            let expr = compile_expr(src, limits, vars).map_err(|e| err(field.clone(), e))?;
            list.push(Named {
                name: n,
                field,
                expr,
            });
        }
        Ok(())
    };
    let mut match_conditions = Vec::new();
    named(
        &mut match_conditions,
        spec.match_conditions
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (
                    c.name.clone(),
                    format!("spec.matchConditions[{i}].expression"),
                    c.expression.as_str(),
                )
            })
            .collect(),
        &[],
    )?;
    let mut audit_annotations = Vec::new();
    named(
        &mut audit_annotations,
        spec.audit_annotations
            .iter()
            .enumerate()
            .map(|(i, a)| {
                (
                    a.key.clone(),
                    format!("spec.auditAnnotations[{i}].valueExpression"),
                    a.value_expression.as_str(),
                )
            })
            .collect(),
        &declared,
    )?;
    let mut validations = Vec::new();
    for (i, v) in spec.validations.iter().enumerate() {
        let field = format!("spec.validations[{i}].expression");
        let expr =
            compile_expr(&v.expression, limits, &declared).map_err(|e| err(field.clone(), e))?;
        let message_expr = match &v.message_expression {
            Some(src) => {
                let f = format!("spec.validations[{i}].messageExpression");
                Some((
                    f.clone(),
                    compile_expr(src, limits, &declared).map_err(|e| err(f, e))?,
                ))
            }
            None => None,
        };
        validations.push(CompiledValidation {
            field,
            expr,
            message: v.message.clone(),
            message_expr,
            reason: v.reason.unwrap_or(StatusReason::Forbidden),
        });
    }
    if spec.validation_actions.contains(&ValidationAction::Deny)
        && spec.validation_actions.contains(&ValidationAction::Warn)
    {
        return Err(err(
            "spec.validationActions".into(),
            ExprError {
                message: "Deny and Warn are exclusive: pick one (Audit combines with either)"
                    .into(),
                position: None,
            },
        ));
    }
    if spec.mutation_actions.is_empty() {
        return Err(err(
            "spec.mutationActions".into(),
            ExprError {
                message: "needs at least one of Patch, Warn, Audit (omit it for [Patch])".into(),
                position: None,
            },
        ));
    }
    let mut mutations = Vec::new();
    for (i, m) in spec.mutations.iter().enumerate() {
        let (holder, sub) = match m.patch_type {
            PatchType::JsonPatch => (&m.json_patch, "jsonPatch"),
            PatchType::ApplyConfiguration => (&m.apply_configuration, "applyConfiguration"),
        };
        let field = format!("spec.mutations[{i}].{sub}.expression");
        let Some(holder) = holder else {
            return Err(err(
                field,
                ExprError {
                    message: format!("patchType {:?} needs {sub}.expression", m.patch_type),
                    position: None,
                },
            ));
        };
        let expr = compile_expr(&holder.expression, limits, &declared)
            .map_err(|e| err(field.clone(), e))?;
        mutations.push(CompiledMutation {
            field,
            patch_type: m.patch_type,
            expr,
        });
    }
    let exprs: Vec<&CompiledExpr> =
        match_conditions
            .iter()
            .chain(&variables)
            .chain(&audit_annotations)
            .map(|n| &n.expr)
            .chain(validations.iter().flat_map(|v| {
                std::iter::once(&v.expr).chain(v.message_expr.as_ref().map(|(_, e)| e))
            }))
            .chain(mutations.iter().map(|m| &m.expr))
            .collect();
    let native = exprs.iter().all(|e| e.native.is_some());
    let roots = exprs
        .iter()
        .filter_map(|e| e.native.as_ref())
        .fold(0, |acc, p| acc | p.roots);
    Ok(CompiledPolicy {
        native,
        roots,
        name,
        failure_policy: spec.failure_policy,
        match_constraints: spec.match_constraints.clone(),
        match_conditions,
        variables,
        validations,
        actions: spec.validation_actions.clone(),
        audit_annotations,
        mutations,
        reinvocation: spec.reinvocation_policy,
        mutation_actions: spec.mutation_actions.clone(),
    })
}

impl CompiledPolicy {
    /// Whether the mutations change the object (`Patch` among `spec.mutationActions`); `false`:
    /// report-only.
    pub(super) fn patches(&self) -> bool {
        self.mutation_actions.contains(&MutationAction::Patch)
    }

    /// Whether the mutations are reported (`Warn` or `Audit` among `spec.mutationActions`).
    pub(super) fn reports_mutations(&self) -> bool {
        self.mutation_actions
            .iter()
            .any(|a| matches!(a, MutationAction::Warn | MutationAction::Audit))
    }
}
