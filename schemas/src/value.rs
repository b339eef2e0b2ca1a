//! Property values and property bags.
//!
//! A bag is what a producer sends: a JSON object of any shape. It is kept in
//! our own [`Value`] type rather than `serde_json::Value` because bincode (the
//! body encoding) cannot decode self-describing formats, and because integers
//! and floats must stay distinct for typed index columns.
//!
//! Two rules hold for every `Value`, however it was made: floats are finite,
//! and arrays and objects nest at most [`MAX_DEPTH`] levels. JSON input is
//! checked by [`Value::from_json`]; blobs by the hand-written `Deserialize`
//! below, because a stored body or a Kafka event may be hostile and bincode
//! has no recursion limit of its own: a blob nests one more array in two
//! bytes, so a few kilobytes of lz4 could otherwise overflow the stack while
//! decoding, dropping or printing the value.

use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;

/// The properties of one entity, ordered by name so encodings are canonical.
pub type Bag = BTreeMap<String, Value>;

/// Deepest nesting of arrays and objects inside one property value: `[1]`
/// nests one level, `{"a": [[1]]}` three. The writer never gets near it
/// (serde_json refuses request bodies nested 128 deep, the entity object
/// itself included, so a property value nests at most 126 levels there),
/// and it leaves ample stack for the recursive code that walks values
/// (drop, `to_json`, the filter).
pub const MAX_DEPTH: usize = 128;

/// `Serialize` is derived and defines the stored format (bincode: the
/// variant index as a varint, then the payload). `Deserialize` is written by
/// hand to read exactly that format while counting depth.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
    #[error("arrays and objects nest deeper than {MAX_DEPTH} levels")]
    TooDeep,
}

/// The nesting level of a container whose parent sits inside `levels`
/// containers, or `None` past [`MAX_DEPTH`].
fn deeper(levels: usize) -> Option<usize> {
    (levels < MAX_DEPTH).then_some(levels + 1)
}

impl Value {
    pub fn from_json(v: &serde_json::Value) -> Result<Value, BadValue> {
        Value::from_json_inside(v, 0)
    }

    /// `v` sits inside `levels` arrays or objects.
    fn from_json_inside(v: &serde_json::Value, levels: usize) -> Result<Value, BadValue> {
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
                let inner = deeper(levels).ok_or(BadValue::TooDeep)?;
                Value::Array(a.iter().map(|x| Value::from_json_inside(x, inner)).collect::<Result<_, _>>()?)
            }
            serde_json::Value::Object(o) => {
                let inner = deeper(levels).ok_or(BadValue::TooDeep)?;
                Value::Object(
                    o.iter()
                        .map(|(k, x)| Ok((k.clone(), Value::from_json_inside(x, inner)?)))
                        .collect::<Result<_, _>>()?,
                )
            }
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

/// A value written as plain JSON straight from the stored form: the same
/// text as serializing [`Value::to_json`], without building that tree first
/// (a response of 20 entities would otherwise copy every string once more).
#[derive(Debug, Clone, Copy)]
pub struct JsonView<'a>(pub &'a Value);

/// A bag written as a JSON object, like [`JsonView`].
#[derive(Debug, Clone, Copy)]
pub struct BagJson<'a>(pub &'a Bag);

impl Serialize for JsonView<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Value::Null => s.serialize_unit(),
            Value::Bool(b) => s.serialize_bool(*b),
            Value::Int(i) => s.serialize_i64(*i),
            Value::Float(f) if f.is_finite() => s.serialize_f64(*f),
            Value::Float(_) => s.serialize_unit(),
            Value::String(text) => s.serialize_str(text),
            Value::Array(a) => s.collect_seq(a.iter().map(JsonView)),
            Value::Object(o) => BagJson(o).serialize(s),
        }
    }
}

impl Serialize for BagJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, JsonView(v))))
    }
}

// ---- Decoding with a depth limit -------------------------------------------
//
// The derived `Deserialize` would call `Value::deserialize` for every nested
// value with no memory of how deep it is. Here every nested value is read
// through a `ValueSeed` that carries its depth, so a too-deep blob fails
// with an error after at most `MAX_DEPTH` nested calls, whatever its length.

/// Variant names in declaration order: the index is the stored tag.
const VARIANTS: &[&str] = &["Null", "Bool", "Int", "Float", "String", "Array", "Object"];

#[derive(Debug, Clone, Copy)]
enum Tag {
    Null,
    Bool,
    Int,
    Float,
    String,
    Array,
    Object,
}

/// Same order as [`VARIANTS`] and as the enum's variants.
const TAGS: [Tag; 7] = [Tag::Null, Tag::Bool, Tag::Int, Tag::Float, Tag::String, Tag::Array, Tag::Object];

impl<'de> Deserialize<'de> for Tag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Tag, D::Error> {
        d.deserialize_identifier(TagVisitor)
    }
}

/// Accepts the variant index (bincode) or its name (self-describing formats).
struct TagVisitor;

impl Visitor<'_> for TagVisitor {
    type Value = Tag;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Value variant")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Tag, E> {
        usize::try_from(v)
            .ok()
            .and_then(|i| TAGS.get(i).copied())
            .ok_or_else(|| E::invalid_value(de::Unexpected::Unsigned(v), &"a variant index from 0 to 6"))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Tag, E> {
        VARIANTS.iter().position(|n| *n == v).map(|i| TAGS[i]).ok_or_else(|| E::unknown_variant(v, VARIANTS))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Tag, E> {
        match std::str::from_utf8(v) {
            Ok(s) => self.visit_str(s),
            Err(_) => Err(E::invalid_value(de::Unexpected::Bytes(v), &self)),
        }
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
        // A top-level value (a bag's property) sits inside no container.
        ValueSeed { levels: 0 }.deserialize(d)
    }
}

/// Reads one value that sits inside `levels` arrays or objects.
#[derive(Debug, Clone, Copy)]
struct ValueSeed {
    levels: usize,
}

impl ValueSeed {
    fn inner<E: de::Error>(self) -> Result<usize, E> {
        deeper(self.levels).ok_or_else(|| E::custom(BadValue::TooDeep))
    }
}

impl<'de> DeserializeSeed<'de> for ValueSeed {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_enum("Value", VARIANTS, self)
    }
}

impl<'de> Visitor<'de> for ValueSeed {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a property value")
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Value, A::Error> {
        let (tag, variant) = data.variant::<Tag>()?;
        Ok(match tag {
            Tag::Null => {
                variant.unit_variant()?;
                Value::Null
            }
            Tag::Bool => Value::Bool(variant.newtype_variant()?),
            Tag::Int => Value::Int(variant.newtype_variant()?),
            Tag::Float => {
                // The writer never stores NaN or infinities (JSON has none);
                // one in a blob is corruption, and would otherwise reach an
                // index column that MySQL refuses, wedging the indexer.
                let f: f64 = variant.newtype_variant()?;
                if !f.is_finite() {
                    return Err(de::Error::invalid_value(de::Unexpected::Float(f), &"a finite float"));
                }
                Value::Float(f)
            }
            Tag::String => Value::String(variant.newtype_variant()?),
            Tag::Array => Value::Array(variant.newtype_variant_seed(ArraySeed { levels: self.inner()? })?),
            Tag::Object => Value::Object(variant.newtype_variant_seed(BagSeed { levels: self.inner()? })?),
        })
    }
}

/// The elements of an array that is itself `levels` deep.
#[derive(Debug, Clone, Copy)]
struct ArraySeed {
    levels: usize,
}

/// Preallocate at most this many elements: a hostile length prefix must not
/// reserve memory the input cannot fill.
const MAX_PREALLOC: usize = 4096;

impl<'de> DeserializeSeed<'de> for ArraySeed {
    type Value = Vec<Value>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<Value>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for ArraySeed {
    type Value = Vec<Value>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of values")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Value>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_PREALLOC));
        while let Some(v) = seq.next_element_seed(ValueSeed { levels: self.levels })? {
            out.push(v);
        }
        Ok(out)
    }
}

/// The members of an object that is itself `levels` deep.
#[derive(Debug, Clone, Copy)]
struct BagSeed {
    levels: usize,
}

impl<'de> DeserializeSeed<'de> for BagSeed {
    type Value = Bag;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Bag, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BagSeed {
    type Value = Bag;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object of values")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Bag, A::Error> {
        // A repeated key keeps the last value, as the derived decoder did.
        let mut bag = Bag::new();
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(ValueSeed { levels: self.levels })?;
            bag.insert(k, v);
        }
        Ok(bag)
    }
}

/// Order between two scalars of comparable kinds, else `None`.
pub fn generic_cmp(a: &Value, b: &Value) -> Option<Ordering> {
    match (a, b) {
        (Value::Int(x), Value::Int(y)) => Some(x.cmp(y)),
        (Value::Int(_) | Value::Float(_), Value::Int(_) | Value::Float(_)) => {
            a.as_f64()?.partial_cmp(&b.as_f64()?)
        }
        (Value::String(x), Value::String(y)) => Some(x.as_bytes().cmp(y.as_bytes())),
        (Value::Bool(x), Value::Bool(y)) => Some(x.cmp(y)),
        _ => None,
    }
}

/// Equality with the documented semantics: numbers compare by value (`1 ==
/// 1.0`); an array property equals a scalar when one element does; `null`
/// matches a missing property; objects and arrays compare deeply.
pub fn value_eq(actual: Option<&Value>, want: &Value) -> bool {
    match actual {
        None => matches!(want, Value::Null),
        Some(a) => {
            deep_eq(a, want)
                || matches!((a, want), (Value::Array(items), w) if !matches!(w, Value::Array(_))
                    && items.iter().any(|i| deep_eq(i, w)))
        }
    }
}

fn deep_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Int(x), Value::Int(y)) => x == y,
        (Value::Int(_) | Value::Float(_), Value::Int(_) | Value::Float(_)) => a.as_f64() == b.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| deep_eq(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|((k1, v1), (k2, v2))| k1 == k2 && deep_eq(v1, v2))
        }
        _ => a == b,
    }
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
        assert_eq!(
            serde_json::to_string(&BagJson(&bag)).unwrap(),
            serde_json::to_string(&bag_to_json_map(&bag)).unwrap(),
            "the direct JSON view writes the same text as the tree"
        );
    }

    #[test]
    fn integers_beyond_i64_are_refused_not_rounded() {
        assert!(bag_from_json(&json!({"big": u64::MAX})).is_err());
        assert!(bag_from_json(&json!([1])).is_err());
    }

    /// `levels` arrays around `null`, alternating arrays and objects when `mixed`.
    fn nested_json(levels: usize, mixed: bool) -> serde_json::Value {
        let mut v = serde_json::Value::Null;
        for i in 0..levels {
            v = if mixed && i % 2 == 1 { json!({"k": v}) } else { json!([v]) };
        }
        v
    }

    #[test]
    fn json_nested_to_the_limit_is_accepted_and_one_more_level_is_refused() {
        for mixed in [false, true] {
            let ok = Value::from_json(&nested_json(MAX_DEPTH, mixed)).unwrap();
            assert_eq!(ok.to_json(), nested_json(MAX_DEPTH, mixed));
            assert_eq!(
                serde_json::to_string(&JsonView(&ok)).unwrap(),
                nested_json(MAX_DEPTH, mixed).to_string()
            );
            assert_eq!(Value::from_json(&nested_json(MAX_DEPTH + 1, mixed)), Err(BadValue::TooDeep));
            let bag = json!({"a": 1, "b": nested_json(MAX_DEPTH + 1, mixed)});
            assert_eq!(bag_from_json(&bag), Err(BadValue::TooDeep));
        }
    }

    #[test]
    fn every_request_body_serde_json_accepts_nests_within_the_limit() {
        // The writer parses bodies with serde_json, whose recursion limit
        // counts the entity object too. The deepest body it accepts must be
        // storable; this fails if that limit is ever lifted or raised past ours.
        let body = |levels: usize| format!("{{\"p\": {}null{}}}", "[".repeat(levels), "]".repeat(levels));
        let deepest = (1..=MAX_DEPTH + 8)
            .take_while(|l| serde_json::from_str::<serde_json::Value>(&body(*l)).is_ok())
            .last()
            .unwrap();
        assert!(deepest <= MAX_DEPTH, "serde_json accepts {deepest} levels inside an entity");
        let doc: serde_json::Value = serde_json::from_str(&body(deepest)).unwrap();
        assert!(bag_from_json(&doc).is_ok());
    }

    #[test]
    fn floats_survive_a_json_round_trip_exactly() {
        // Found by fuzz/body_codec: serde_json's default float parser read
        // this float's shortest text back one unit in the last place off,
        // so a stored value changed when a client wrote back what it read.
        for bits in [0x00ee_4000_0800_0000_u64, 0x0000_f83f_0000_0001, 0x7fef_ffff_ffff_ffff, 1] {
            let v = Value::Float(f64::from_bits(bits));
            let text = serde_json::to_string(&v.to_json()).unwrap();
            assert_eq!(serde_json::to_string(&JsonView(&v)).unwrap(), text);
            let back = Value::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
            assert_eq!(back, v, "{text}");
        }
    }

    #[test]
    fn values_decode_from_a_self_describing_format_too() {
        let v = Value::from_json(&json!({"a": [1, 2.5, "s", null, true]})).unwrap();
        let text = serde_json::to_string(&v).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), v);
        assert!(serde_json::from_str::<Value>(r#"{"Nope": 1}"#).is_err());
    }
}
