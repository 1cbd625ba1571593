//! `fmt.format` with cel-go's renderings, and string methods with their arguments checked as
//! cel-go's strings library checks them.

use kube_cel::cel::{
    ExecutionError, FunctionContext, IdedExpr, ResolveResult, Value,
    common::ast::{Expr, LiteralValue},
};

use super::access::type_value_name;
use super::time::duration_text;
use super::{STRING_METHOD, arg};

/// A double as cel-go's `format` writes a non-finite one.
pub(super) fn non_finite(f: f64) -> Option<&'static str> {
    if f.is_nan() {
        Some("NaN")
    } else if f == f64::INFINITY {
        Some("Infinity")
    } else if f == f64::NEG_INFINITY {
        Some("-Infinity")
    } else {
        None
    }
}

/// `%s` of a value as cel-go writes it: strings bare, lists `[a, b]`, maps `{k: v}` in key
/// order, timestamps in RFC 3339, durations in seconds. `None` for what the library renders
/// the same way itself.
pub(super) fn format_text(v: &Value, nested: bool) -> Option<String> {
    Some(match v {
        Value::String(s) if nested => s.as_str().to_owned(),
        Value::Null if nested => "null".into(),
        Value::Bool(b) if nested => b.to_string(),
        Value::Int(i) if nested => i.to_string(),
        Value::UInt(u) if nested => u.to_string(),
        Value::Float(f) => match non_finite(*f) {
            Some(t) => t.to_owned(),
            None if nested => f.to_string(),
            None => return None,
        },
        Value::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
        Value::Timestamp(t) => t
            .with_timezone(&chrono::Utc)
            .to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
        Value::Duration(d) => duration_text(d),
        Value::List(l) => {
            let items: Option<Vec<String>> = l.iter().map(|x| format_text(x, true)).collect();
            format!("[{}]", items?.join(", "))
        }
        Value::Map(m) => {
            let mut entries: Vec<(String, String)> = m
                .map
                .iter()
                .map(|(k, x)| Some((format_text(&Value::from(k), true)?, format_text(x, true)?)))
                .collect::<Option<_>>()?;
            entries.sort();
            let entries: Vec<String> = entries
                .into_iter()
                .map(|(k, x)| format!("{k}: {x}"))
                .collect();
            format!("{{{}}}", entries.join(", "))
        }
        v => match type_value_name(v) {
            Some(name) => name.to_owned(),
            None => return None,
        },
    })
}

pub(super) fn format(ftx: &FunctionContext) -> ResolveResult {
    let (fmt, args) = (arg(ftx, 0)?, arg(ftx, 1)?);
    let (Value::String(f), Value::List(list)) = (&fmt, &args) else {
        return call_method("format", fmt, vec![args], ftx);
    };
    let mut out = String::with_capacity(f.len());
    let mut rendered = Vec::with_capacity(list.len());
    let mut next = 0;
    let mut chars = f.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = String::from('%');
        while let Some(&d) = chars.peek() {
            spec.push(d);
            chars.next();
            if d.is_ascii_alphabetic() || d == '%' {
                break;
            }
        }
        let verb = spec.chars().last().unwrap_or('%');
        if verb == '%' || spec.len() < 2 {
            out.push_str(&spec);
            continue;
        }
        let Some(v) = list.get(next) else {
            out.push_str(&spec);
            continue;
        };
        next += 1;
        let text = match (verb, v) {
            ('s', v) => format_text(v, false),
            ('d' | 'f' | 'e', Value::Float(x)) => non_finite(*x).map(str::to_owned),
            _ => None,
        };
        match text {
            Some(t) => {
                out.push_str("%s");
                rendered.push(Value::String(std::sync::Arc::new(t)));
            }
            None => {
                out.push_str(&spec);
                rendered.push(v.clone());
            }
        }
    }
    rendered.extend(list.iter().skip(next).cloned());
    call_method(
        "format",
        Value::String(std::sync::Arc::new(out)),
        vec![Value::List(std::sync::Arc::new(rendered))],
        ftx,
    )
}

/// Calls the library method `name` on `target` with `args`.
pub(super) fn call_method(
    name: &str,
    target: Value,
    args: Vec<Value>,
    ftx: &FunctionContext,
) -> ResolveResult {
    let mut scope = ftx.ptx.new_inner_scope();
    scope.add_variable_from_value("#target", target);
    let mut idents = Vec::with_capacity(args.len());
    for (i, a) in args.into_iter().enumerate() {
        let n = format!("#arg{i}");
        scope.add_variable_from_value(n.clone(), a);
        idents.push(IdedExpr {
            id: 0,
            expr: Expr::Ident(n),
        });
    }
    let expr = IdedExpr {
        id: 0,
        expr: Expr::Call(kube_cel::cel::common::ast::CallExpr {
            func_name: name.to_owned(),
            target: Some(Box::new(IdedExpr {
                id: 0,
                expr: Expr::Ident("#target".into()),
            })),
            args: idents,
        }),
    };
    Value::resolve(&expr, &scope)
}

pub(super) fn string_method(ftx: &FunctionContext) -> ResolveResult {
    let Some(Expr::Literal(LiteralValue::String(name))) = ftx.args.first().map(|a| &a.expr) else {
        return Err(ExecutionError::function_error(
            STRING_METHOD,
            "needs a name",
        ));
    };
    let name = name.inner();
    let target = arg(ftx, 1)?;
    let args = (2..ftx.args.len())
        .map(|i| arg(ftx, i))
        .collect::<Result<Vec<_>, _>>()?;
    if let Value::String(text) = &target {
        let len = text.chars().count() as i64;
        let bad = |why: &str| Err(ftx.error(format!("{name}: {why}")));
        use Value::{Int, String as Str};
        match (name, args.as_slice()) {
            ("indexOf", [Str(_)]) | ("lastIndexOf", [Str(_)]) => {}
            ("indexOf", [Str(_), Int(o)]) if (0..=len).contains(o) => {}
            ("lastIndexOf", [Str(_), Int(o)]) if *o >= 0 && (*o < len || len == 0) => {}
            ("indexOf" | "lastIndexOf", [Str(_), Int(_)]) => return bad("index out of range"),
            ("replace", [Str(_), Str(_)] | [Str(_), Str(_), Int(_)]) => {}
            ("split", [Str(_)] | [Str(_), Int(_)]) => {}
            ("substring", [Int(_)] | [Int(_), Int(_)]) => {}
            _ => return bad("no such overload for these arguments"),
        }
    }
    call_method(name, target, args, ftx)
}
