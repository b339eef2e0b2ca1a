//! Property values and property bags.
//!
//! A bag is what a producer sends: a JSON object of any shape. It is kept in
//! our own [`Value`] type rather than `serde_json::Value` because bincode (the
//! body encoding) cannot decode self-describing formats, and because integers
//! and floats must stay distinct for typed index columns.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The properties of one entity, ordered by name so encodings are canonical.
pub type Bag = BTreeMap<String, Value>;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    String(String),
    Array(Vec<Value>),
    Object(Bag),
}

/// Why a JSON document cannot be stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadValue {
    #[error("the number {0} does not fit a 64-bit signed integer or a finite float")]
    Number(String),
    #[error("the body must be a JSON object of properties")]
    NotAnObject,
}

impl Value {
    pub fn from_json(v: &serde_json::Value) -> Result<Value, BadValue> {
        Ok(match v {
            serde_json::Value::Null => Value::Null,
            serde_json::Value::Bool(b) => Value::Bool(*b),
            serde_json::Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Value::Int(i)
                } else if n.is_u64() {
                    // Larger than i64::MAX: storing it as a float would lose digits silently.
                    return Err(BadValue::Number(n.to_string()));
                } else {
                    match n.as_f64() {
                        Some(f) if f.is_finite() => Value::Float(f),
                        _ => return Err(BadValue::Number(n.to_string())),
                    }
                }
            }
            serde_json::Value::String(s) => Value::String(s.clone()),
            serde_json::Value::Array(a) => {
                Value::Array(a.iter().map(Value::from_json).collect::<Result<_, _>>()?)
            }
            serde_json::Value::Object(o) => Value::Object(bag_from_json_map(o)?),
        })
    }

    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => serde_json::Value::Bool(*b),
            Value::Int(i) => serde_json::Value::from(*i),
            Value::Float(f) => serde_json::Number::from_f64(*f)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null),
            Value::String(s) => serde_json::Value::String(s.clone()),
            Value::Array(a) => serde_json::Value::Array(a.iter().map(Value::to_json).collect()),
            Value::Object(o) => serde_json::Value::Object(bag_to_json_map(o)),
        }
    }

    /// Numeric view used by equality: `1` and `1.0` are the same number.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(i) => Some(*i as f64),
            Value::Float(f) => Some(*f),
            _ => None,
        }
    }
}

pub fn bag_from_json_map(o: &serde_json::Map<String, serde_json::Value>) -> Result<Bag, BadValue> {
    o.iter().map(|(k, v)| Ok((k.clone(), Value::from_json(v)?))).collect()
}

pub fn bag_from_json(v: &serde_json::Value) -> Result<Bag, BadValue> {
    match v {
        serde_json::Value::Object(o) => bag_from_json_map(o),
        _ => Err(BadValue::NotAnObject),
    }
}

pub fn bag_to_json_map(bag: &Bag) -> serde_json::Map<String, serde_json::Value> {
    bag.iter().map(|(k, v)| (k.clone(), v.to_json())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_round_trips_every_shape() {
        let doc = json!({"n": null, "b": true, "i": -7, "f": 1.5, "s": "x",
                         "a": [1, "two", [3.0]], "o": {"deep": {"k": [false]}}});
        let bag = bag_from_json(&doc).unwrap();
        assert_eq!(bag["i"], Value::Int(-7));
        assert_eq!(bag["f"], Value::Float(1.5));
        assert_eq!(serde_json::Value::Object(bag_to_json_map(&bag)), doc);
    }

    #[test]
    fn integers_beyond_i64_are_refused_not_rounded() {
        assert!(bag_from_json(&json!({"big": u64::MAX})).is_err());
        assert!(bag_from_json(&json!([1])).is_err());
    }
}
