//! Conditions on property values and how they are evaluated against a bag.
//!
//! This is the re-filter of Invariant R: the reader applies it to every
//! fetched entity, whatever the index said. The same equality decides
//! `match_on` in the indexer, so both agree on what a partial index holds.

use std::cmp::Ordering;

use crate::index::{IndexProperty, KeyValue};
use crate::value::{generic_cmp, value_eq, Value};

/// A condition on one property.
#[derive(Debug, Clone, PartialEq)]
pub enum Condition {
    /// Equal to the value (for an array property: one element is equal).
    Eq(Value),
    /// Equal to one of the values.
    In(Vec<Value>),
    /// Within bounds: `(value, inclusive)`; numbers compare with numbers,
    /// strings with strings (byte order), booleans with booleans. For an
    /// array property one element must be within.
    Range { lower: Option<(Value, bool)>, upper: Option<(Value, bool)> },
    /// Present and not null (`true`), or missing or null (`false`).
    Exists(bool),
}

impl Condition {
    /// The values an equality-like condition admits (empty for others).
    pub fn values(&self) -> &[Value] {
        match self {
            Condition::Eq(v) => std::slice::from_ref(v),
            Condition::In(vs) => vs,
            Condition::Range { .. } | Condition::Exists(_) => &[],
        }
    }

    pub fn is_equality(&self) -> bool {
        matches!(self, Condition::Eq(_) | Condition::In(_))
    }

    /// Generic evaluation for a property no index types.
    pub fn matches(&self, actual: Option<&Value>) -> bool {
        match self {
            Condition::Eq(_) | Condition::In(_) => self.values().iter().any(|want| value_eq(actual, want)),
            Condition::Range { lower, upper } => scalars(actual).any(|v| {
                lower.as_ref().is_none_or(|(b, inc)| bound_ok(generic_cmp(v, b), *inc, Ordering::Greater))
                    && upper.as_ref().is_none_or(|(b, inc)| bound_ok(generic_cmp(v, b), *inc, Ordering::Less))
            }),
            Condition::Exists(want) => !matches!(actual, None | Some(Value::Null)) == *want,
        }
    }

    /// Typed evaluation for a property of the index in use: the entity's
    /// value goes through the same conversion as the indexer's, so a row is
    /// accepted exactly when the entity really produces that key.
    pub fn matches_typed(&self, prop: &IndexProperty, actual: Option<&Value>) -> bool {
        let have = prop.typed_all(actual);
        match self {
            Condition::Eq(_) | Condition::In(_) => {
                self.values().iter().filter_map(|w| prop.typed(w)).any(|w: KeyValue| have.contains(&w))
            }
            Condition::Range { .. } => match self.typed_range(prop) {
                Some(r) => have.iter().any(|k| r.contains(k)),
                None => false,
            },
            Condition::Exists(_) => self.matches(actual),
        }
    }

    /// The range converted to an index column's type; `None` if a bound
    /// does not fit the column (or this is not a range).
    pub fn typed_range(&self, prop: &IndexProperty) -> Option<KeyRange> {
        let Condition::Range { lower, upper } = self else { return None };
        let conv = |b: &Option<(Value, bool)>| -> Option<Option<(KeyValue, bool)>> {
            match b {
                None => Some(None),
                Some((v, inc)) => prop.typed(v).map(|k| Some((k, *inc))),
            }
        };
        Some(KeyRange { lower: conv(lower)?, upper: conv(upper)? })
    }
}

/// A range over one typed index column.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRange {
    pub lower: Option<(KeyValue, bool)>,
    pub upper: Option<(KeyValue, bool)>,
}

impl KeyRange {
    pub fn contains(&self, k: &KeyValue) -> bool {
        self.lower.as_ref().is_none_or(|(b, inc)| bound_ok(k.partial_cmp(b), *inc, Ordering::Greater))
            && self.upper.as_ref().is_none_or(|(b, inc)| bound_ok(k.partial_cmp(b), *inc, Ordering::Less))
    }
}

fn bound_ok(ord: Option<Ordering>, inclusive: bool, want: Ordering) -> bool {
    match ord {
        Some(o) if o == want => true,
        Some(Ordering::Equal) => inclusive,
        _ => false,
    }
}

/// The scalars a property value offers to a comparison: itself, or each
/// element of an array.
fn scalars(actual: Option<&Value>) -> Box<dyn Iterator<Item = &Value> + '_> {
    match actual {
        None | Some(Value::Null) => Box::new(std::iter::empty()),
        Some(Value::Array(items)) => Box::new(items.iter()),
        Some(v) => Box::new(std::iter::once(v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{IndexProperty, PropType};

    #[test]
    fn equality_follows_the_documented_rules() {
        assert!(value_eq(Some(&Value::Int(1)), &Value::Float(1.0)));
        assert!(!value_eq(Some(&Value::Int(1)), &Value::String("1".into())));
        let arr = Value::Array(vec![Value::String("a".into()), Value::String("b".into())]);
        assert!(value_eq(Some(&arr), &Value::String("b".into())));
        assert!(!value_eq(Some(&arr), &Value::String("c".into())));
        assert!(value_eq(Some(&arr), &arr.clone()));
        assert!(value_eq(None, &Value::Null));
        assert!(!value_eq(None, &Value::Int(0)));
    }

    #[test]
    fn ranges_compare_like_kinds_and_any_array_element() {
        let r =
            Condition::Range { lower: Some((Value::Int(2), true)), upper: Some((Value::Float(5.5), false)) };
        assert!(r.matches(Some(&Value::Int(2))));
        assert!(r.matches(Some(&Value::Float(5.4))));
        assert!(!r.matches(Some(&Value::Float(5.5))));
        assert!(!r.matches(Some(&Value::String("3".into()))));
        assert!(!r.matches(None));
        assert!(r.matches(Some(&Value::Array(vec![Value::Int(9), Value::Int(3)]))));
        let s = Condition::Range { lower: Some((Value::String("b".into()), false)), upper: None };
        assert!(s.matches(Some(&Value::String("ba".into()))));
        assert!(!s.matches(Some(&Value::String("b".into()))));
        assert!(Condition::Exists(true).matches(Some(&Value::Int(0))));
        assert!(Condition::Exists(false).matches(Some(&Value::Null)));
        assert!(!Condition::Exists(false).matches(Some(&Value::Bool(false))));
    }

    #[test]
    fn typed_matching_compares_uuid_bytes_not_spelling() {
        let prop = IndexProperty { name: "user_id".into(), ty: PropType::Uuid, max_len: None };
        let stored = Value::String("F48B0440-CA0C-4F66-991C-4D5F6A078EAF".into());
        let c = Condition::Eq(Value::String("f48b0440ca0c4f66991c4d5f6a078eaf".into()));
        assert!(c.matches_typed(&prop, Some(&stored)));
        assert!(!c.matches(Some(&stored)), "untyped comparison is by string");
        let other = Condition::In(vec![Value::String("00000000000000000000000000000000".into())]);
        assert!(!other.matches_typed(&prop, Some(&stored)));
    }
}
