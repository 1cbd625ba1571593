//! Conversions between JSON (what Kubernetes objects are) and CEL values.

use std::{collections::HashMap, sync::Arc};

use kube_cel::cel::{
    Value,
    objects::{Key, Map},
};

/// A JSON number as the apiserver binds it: `int`, `uint` above `i64::MAX`, else `double`.
pub(crate) enum Number {
    Int(i64),
    UInt(u64),
    Double(f64),
}

pub(crate) fn number(n: &serde_json::Number) -> Number {
    if let Some(i) = n.as_i64() {
        Number::Int(i)
    } else if let Some(u) = n.as_u64() {
        Number::UInt(u)
    } else {
        Number::Double(n.as_f64().unwrap_or(f64::NAN))
    }
}

/// JSON to CEL, the way the apiserver binds unstructured objects: integers are `int` (or `uint`
/// above `i64::MAX`), other numbers `double`, objects maps with string keys.
pub fn json_to_cel(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => match number(n) {
            Number::Int(i) => Value::Int(i),
            Number::UInt(u) => Value::UInt(u),
            Number::Double(f) => Value::Float(f),
        },
        serde_json::Value::String(s) => Value::String(Arc::new(s.clone())),
        serde_json::Value::Array(a) => Value::List(Arc::new(a.iter().map(json_to_cel).collect())),
        serde_json::Value::Object(o) => {
            let map: HashMap<Key, Value> = o
                .iter()
                .map(|(k, v)| (Key::String(Arc::new(k.clone())), json_to_cel(v)))
                .collect();
            Value::Map(Map { map: Arc::new(map) })
        }
    }
}

/// CEL to JSON, for mutation results, messages and audit annotations.
///
/// Errors name the CEL type that has no JSON form (bytes, functions, opaque values such as a
/// `quantity`; convert them with `string(...)` first) or a non-finite double.
pub fn cel_to_json(v: &Value) -> Result<serde_json::Value, String> {
    Ok(match v {
        Value::Null => serde_json::Value::Null,
        Value::Bool(b) => serde_json::Value::Bool(*b),
        Value::Int(i) => serde_json::Value::from(*i),
        Value::UInt(u) => serde_json::Value::from(*u),
        Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(serde_json::Value::Number)
            .ok_or_else(|| format!("the double {f} has no JSON form"))?,
        Value::String(s) => serde_json::Value::String(s.as_str().to_owned()),
        Value::List(l) => {
            serde_json::Value::Array(l.iter().map(cel_to_json).collect::<Result<_, _>>()?)
        }
        Value::Map(m) => {
            let mut out = serde_json::Map::with_capacity(m.map.len());
            for (k, v) in m.map.iter() {
                let key = match k {
                    Key::String(s) => s.as_str().to_owned(),
                    Key::Int(i) => i.to_string(),
                    Key::Uint(u) => u.to_string(),
                    Key::Bool(b) => b.to_string(),
                };
                out.insert(key, cel_to_json(v)?);
            }
            // Sort keys so output is stable whatever the hash order.
            out.sort_keys();
            serde_json::Value::Object(out)
        }
        Value::Duration(d) => {
            serde_json::Value::String(go_duration(d.num_seconds(), d.subsec_nanos()))
        }
        Value::Timestamp(t) => serde_json::Value::String(t.to_rfc3339()),
        Value::Bytes(_) => return Err("a bytes value has no JSON form; use string(...)".into()),
        Value::Function(name, _) => return Err(format!("the function {name} is not a value")),
        Value::Opaque(_) => {
            return Err("an opaque value (quantity, ip, cidr, url, semver) has no JSON form; use string(...)".into());
        }
    })
}

/// A duration as a Go duration string in seconds (`"90s"`, `"1.5s"`), which
/// `time.ParseDuration` and `hearth_crds::parse_duration` read back.
fn go_duration(secs: i64, nanos: i32) -> String {
    if nanos == 0 {
        format!("{secs}s")
    } else {
        let frac = format!("{:09}", nanos.unsigned_abs());
        format!("{secs}.{}s", frac.trim_end_matches('0'))
    }
}
