//! Expiry (TTL): an opt-in setting (`expiry.property`) names the property
//! that holds an entity's expiry time, in Unix seconds (an integer, or a
//! float for a fraction of a second). From that instant on the entity is
//! invisible to reads, and writes treat it as absent; the cleaner then
//! deletes it through the write path.
//!
//! The instant is kept in microseconds: `expires_us` on the entity's row,
//! where the cleaner finds it along a key.

use crate::value::{Bag, Value};

/// Why a bag's expiry property cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("property {property:?} holds the expiry time and must be a number of Unix seconds (0 to 253402300799), not {found}")]
pub struct BadExpiry {
    pub property: String,
    /// What the property held, described (e.g. `a string`).
    pub found: String,
}

/// The last second a timestamp may name (9999-12-31T23:59:59Z).
const MAX_SECS: f64 = 253_402_300_799.0;

/// The bag's expiry instant in µs since the Unix epoch: `None` when expiry
/// is off (`property` is `None`) or the bag lacks the property. A property
/// that is present but not a number of seconds in range is an error (a
/// write carrying it is refused); `null` counts as absent.
pub fn expires_us(bag: &Bag, property: Option<&str>) -> Result<Option<i64>, BadExpiry> {
    let Some(property) = property else { return Ok(None) };
    let secs = match bag.get(property) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Int(n)) => *n as f64,
        Some(Value::Float(f)) => *f,
        Some(other) => {
            return Err(BadExpiry { property: property.to_string(), found: describe(other).to_string() })
        }
    };
    if !(0.0..=MAX_SECS).contains(&secs) {
        return Err(BadExpiry { property: property.to_string(), found: format!("{secs}") });
    }
    // Rounded up: an entity is never hidden before the instant it names.
    Ok(Some((secs * 1e6).ceil() as i64))
}

/// Whether an entity that expires at `expires_us` is expired at `now_us`.
pub fn is_expired(expires_us: Option<i64>, now_us: i64) -> bool {
    expires_us.is_some_and(|at| now_us >= at)
}

/// Whether `bag` is expired at `now_us` under `property` (a bag whose
/// property is malformed never expires: it was stored before expiry was on).
pub fn bag_is_expired(bag: &Bag, property: Option<&str>, now_us: i64) -> bool {
    is_expired(expires_us(bag, property).unwrap_or(None), now_us)
}

fn describe(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Int(_) | Value::Float(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bag(v: Value) -> Bag {
        Bag::from([("expires_at".to_string(), v)])
    }

    #[test]
    fn seconds_become_microseconds_rounded_up() {
        let p = Some("expires_at");
        assert_eq!(expires_us(&bag(Value::Int(100)), p), Ok(Some(100_000_000)));
        assert_eq!(expires_us(&bag(Value::Float(100.25)), p), Ok(Some(100_250_000)));
        assert_eq!(expires_us(&bag(Value::Float(1.000_000_1)), p), Ok(Some(1_000_001)));
        assert_eq!(expires_us(&bag(Value::Null), p), Ok(None));
        assert_eq!(expires_us(&Bag::new(), p), Ok(None));
        // Off: the property is an ordinary one.
        assert_eq!(expires_us(&bag(Value::String("soon".into())), None), Ok(None));
    }

    #[test]
    fn a_malformed_expiry_names_the_property() {
        let p = Some("expires_at");
        let e = expires_us(&bag(Value::String("2026-11-24".into())), p).unwrap_err();
        assert_eq!(e.property, "expires_at");
        assert!(e.to_string().contains("not a string"), "{e}");
        assert!(expires_us(&bag(Value::Int(-1)), p).is_err());
        assert!(expires_us(&bag(Value::Float(1e13)), p).is_err());
        assert!(!bag_is_expired(&bag(Value::Bool(true)), p, i64::MAX));
    }

    #[test]
    fn expired_from_that_instant_on() {
        assert!(!is_expired(Some(100), 99));
        assert!(is_expired(Some(100), 100));
        assert!(is_expired(Some(100), 101));
        assert!(!is_expired(None, i64::MAX));
        assert!(bag_is_expired(&bag(Value::Int(100)), Some("expires_at"), 100_000_000));
        assert!(!bag_is_expired(&bag(Value::Int(100)), Some("expires_at"), 99_999_999));
    }
}
