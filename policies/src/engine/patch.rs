//! Applying a mutation's result: JSON Patch and apply-configuration merges, with the object's
//! identity kept.

use hearth_crds::servingpolicy::PatchType;
use serde_json::Value;

use crate::merge;

use super::compile::CompiledPolicy;
use super::eval::{Fallback, Pass, PolicyRun};
use super::types::{ErrorKind, EvalError, Phase};

/// Runs a policy's mutation passes over `object`, applying each result in place, until none
/// is left: returns whether anything was applied, the error that stopped the policy, and
/// whether its `matchConditions` held (`false`: nothing ran).
pub(super) fn mutate_passes<'p>(
    p: &'p CompiledPolicy,
    object: &mut Value,
    mut pass: impl FnMut(&mut PolicyRun<'p>, &Value, &mut usize, bool) -> Result<Pass<'p>, Fallback>,
) -> Result<(bool, Option<EvalError>, bool), Fallback> {
    let mut run = PolicyRun::new(p, Phase::Mutation);
    let mut changed = false;
    let mut next = 0;
    let mut first = true;
    while next < p.mutations.len() {
        match pass(&mut run, object, &mut next, first)? {
            Pass::Done => break,
            Pass::Unmatched => return Ok((changed, None, false)),
            Pass::Apply(m, produced) => {
                if let Err((msg, kind)) = apply_mutation(object, m.patch_type, produced) {
                    return Ok((changed, Some(run.error(&m.field, &m.expr, msg, kind)), true));
                }
                changed = true;
            }
            Pass::Failed(e) => return Ok((changed, Some(e), true)),
        }
        first = false;
    }
    Ok((changed, None, true))
}

/// The fields a mutation may not change (MutatingAdmissionPolicy forbids it too).
pub(super) const IDENTITY: [&str; 4] = [
    "/apiVersion",
    "/kind",
    "/metadata/name",
    "/metadata/namespace",
];

/// Whether writing at JSON pointer `path` can change an identity field.
pub(super) fn touches_identity(path: &str) -> bool {
    IDENTITY.iter().any(|id| {
        id.strip_prefix(path)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    })
}

/// Applies one mutation's result to `object` in place. On error `object` is unchanged.
pub(super) fn apply_mutation(
    object: &mut Value,
    patch_type: PatchType,
    produced: Value,
) -> Result<(), (String, ErrorKind)> {
    // Results that may touch the identity are applied to a copy and checked; the rest in place
    // (JSON Patch application is atomic, the merge cannot fail).
    match patch_type {
        PatchType::JsonPatch => {
            let patch = json_patch_of(produced)?;
            let risky = patch.iter().any(|op| {
                use json_patch::PatchOperation::*;
                match op {
                    Move(m) => {
                        touches_identity(m.from.as_str()) || touches_identity(m.path.as_str())
                    }
                    Add(o) => touches_identity(o.path.as_str()),
                    Remove(o) => touches_identity(o.path.as_str()),
                    Replace(o) => touches_identity(o.path.as_str()),
                    Copy(o) => touches_identity(o.path.as_str()),
                    Test(_) => false,
                }
            });
            if risky {
                let next = apply_json_patch(object, patch)?;
                *object = next;
            } else {
                json_patch::patch(object, &patch)
                    .map_err(|e| (format!("JSON Patch does not apply: {e}"), ErrorKind::Patch))?;
            }
        }
        PatchType::ApplyConfiguration => {
            let risky = produced.get("apiVersion").is_some()
                || produced.get("kind").is_some()
                || produced.get("metadata").is_some_and(|m| {
                    !m.is_object() || m.get("name").is_some() || m.get("namespace").is_some()
                });
            if risky {
                let next = apply_configuration(object, &produced)?;
                *object = next;
            } else {
                if !produced.is_object() {
                    return Err(wrong_apply_configuration(&produced));
                }
                merge::apply(object, &produced);
            }
        }
    }
    Ok(())
}

/// The RFC 6902 operations of a JSONPatch mutation's result: a list of
/// `{op, path, value?, from?}` maps, as `JSONPatch{...}` builds them.
pub(super) fn json_patch_of(ops: Value) -> Result<json_patch::Patch, (String, ErrorKind)> {
    let list = match ops {
        Value::Array(a) => a,
        other => {
            return Err((
                format!(
                    "a JSONPatch mutation must return a list of JSONPatch operations, got {other}"
                ),
                ErrorKind::WrongType,
            ));
        }
    };
    Ok(json_patch::Patch(
        list.into_iter()
            .map(patch_operation)
            .collect::<Result<_, _>>()
            .map_err(|e| {
                (
                    format!("invalid JSONPatch operation: {e}"),
                    ErrorKind::WrongType,
                )
            })?,
    ))
}

/// Applies a JSON Patch (atomically) to a copy of `current` and checks the identity.
pub(super) fn apply_json_patch(
    current: &Value,
    patch: json_patch::Patch,
) -> Result<Value, (String, ErrorKind)> {
    let mut next = current.clone();
    json_patch::patch(&mut next, &patch)
        .map_err(|e| (format!("JSON Patch does not apply: {e}"), ErrorKind::Patch))?;
    keep_identity(current, &next)?;
    Ok(next)
}

/// One RFC 6902 operation from the map `JSONPatch{op, path, value?, from?}` builds.
pub(super) fn patch_operation(op: Value) -> Result<json_patch::PatchOperation, String> {
    use json_patch::{jsonptr::PointerBuf, *};
    let Value::Object(mut m) = op else {
        return Err(format!("expected a JSONPatch object, got {op}"));
    };
    fn pointer(m: &mut serde_json::Map<String, Value>, field: &str) -> Result<PointerBuf, String> {
        match m.remove(field) {
            Some(Value::String(s)) => PointerBuf::parse(s).map_err(|e| format!("{field}: {e}")),
            Some(other) => Err(format!("{field} must be a string, got {other}")),
            None => Err(format!("missing field `{field}`")),
        }
    }
    let name = match m.remove("op") {
        Some(Value::String(s)) => s,
        _ => return Err("missing field `op`".into()),
    };
    let path = pointer(&mut m, "path")?;
    let from = (name == "move" || name == "copy")
        .then(|| pointer(&mut m, "from"))
        .transpose()?;
    let mut value = || m.remove("value").ok_or("missing field `value`");
    Ok(match (name.as_str(), from) {
        ("add", _) => PatchOperation::Add(AddOperation {
            path,
            value: value()?,
        }),
        ("remove", _) => PatchOperation::Remove(RemoveOperation { path }),
        ("replace", _) => PatchOperation::Replace(ReplaceOperation {
            path,
            value: value()?,
        }),
        ("test", _) => PatchOperation::Test(TestOperation {
            path,
            value: value()?,
        }),
        ("move", Some(from)) => PatchOperation::Move(MoveOperation { from, path }),
        ("copy", Some(from)) => PatchOperation::Copy(CopyOperation { from, path }),
        (other, _) => {
            return Err(format!(
                "unknown op `{other}`, expected one of add, remove, replace, move, copy, test"
            ));
        }
    })
}

pub(super) fn wrong_apply_configuration(partial: &Value) -> (String, ErrorKind) {
    (
        format!(
            "an ApplyConfiguration mutation must return an object (Object{{...}}), got {partial}"
        ),
        ErrorKind::WrongType,
    )
}

pub(super) fn apply_configuration(
    current: &Value,
    partial: &Value,
) -> Result<Value, (String, ErrorKind)> {
    if !partial.is_object() {
        return Err(wrong_apply_configuration(partial));
    }
    let mut next = current.clone();
    merge::apply(&mut next, partial);
    keep_identity(current, &next)?;
    Ok(next)
}

/// Mutations may not change what the object is (MutatingAdmissionPolicy forbids it too).
pub(super) fn keep_identity(before: &Value, after: &Value) -> Result<(), (String, ErrorKind)> {
    for p in IDENTITY {
        if before.pointer(p) != after.pointer(p) {
            return Err((format!("a mutation may not change {p}"), ErrorKind::Patch));
        }
    }
    Ok(())
}
