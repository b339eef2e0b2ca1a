//! Index specifications and index keys.
//!
//! An index is a table per shard whose rows are `(property columns…,
//! entity_id, version)`. [`IndexSpec::keys`] turns a property bag into the
//! set of keys it produces; the indexer, the cleaner and the reader's
//! re-filter all use it, so "is this row right?" has one answer.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::id::EntityId;
use crate::names::{is_valid_identifier, RESERVED_COLUMNS, RESERVED_TABLES};
use crate::value::{Bag, Value};

/// InnoDB's limit on the length of one index key.
pub const MAX_KEY_BYTES: usize = 3072;
/// An entity may produce at most this many rows in one index (the product of
/// its array lengths); beyond it the extra keys are not indexed and a warning
/// is logged by the indexer.
pub const MAX_KEYS_PER_ENTITY: usize = 1024;
/// `string` without `max_len`.
pub const DEFAULT_STRING_LEN: u32 = 255;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PropType {
    Uuid,
    String,
    Int,
    Float,
    Bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexProperty {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: PropType,
    /// Characters, for `string` only (stored as `VARBINARY(4 × max_len)` so
    /// comparisons and order are exact bytes, like Rust's `str`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_len: Option<u32>,
}

impl IndexProperty {
    pub fn string_len(&self) -> u32 {
        self.max_len.unwrap_or(DEFAULT_STRING_LEN)
    }

    /// Bytes this column takes in the index key.
    pub fn key_bytes(&self) -> usize {
        match self.ty {
            PropType::Uuid => 16,
            PropType::String => 4 * self.string_len() as usize,
            PropType::Int | PropType::Float => 8,
            PropType::Bool => 1,
        }
    }

    /// Converts one scalar into this column's type; `None` when the value
    /// cannot be stored in it (wrong type, string too long, bad uuid). Such
    /// an element produces no index row.
    pub fn typed(&self, v: &Value) -> Option<KeyValue> {
        match (self.ty, v) {
            (PropType::Uuid, Value::String(s)) => EntityId::parse(s).ok().map(|id| KeyValue::Uuid(id.0)),
            (PropType::String, Value::String(s)) => {
                (s.chars().count() <= self.string_len() as usize).then(|| KeyValue::Str(s.clone()))
            }
            (PropType::Int, Value::Int(i)) => Some(KeyValue::Int(*i)),
            (PropType::Float, Value::Float(f)) => Some(KeyValue::float(*f)),
            (PropType::Float, Value::Int(i)) => Some(KeyValue::float(*i as f64)),
            (PropType::Bool, Value::Bool(b)) => Some(KeyValue::Bool(*b)),
            _ => None,
        }
    }

    /// Every typed value a property value yields: one for a scalar, one per
    /// distinct convertible element for an array (multi-valued index).
    pub fn typed_all(&self, v: Option<&Value>) -> Vec<KeyValue> {
        let mut out = Vec::new();
        match v {
            None | Some(Value::Null) => {}
            Some(Value::Array(items)) => {
                // Deduplicated through a set of canonical bytes (one column
                // has one type, and equal keys have equal bytes): a 1 MiB
                // body holds 100 000+ distinct elements, and comparing each
                // with all the others would stall the indexer and the
                // re-filter on a single write.
                let mut seen = std::collections::HashSet::new();
                for item in items {
                    if let Some(k) = self.typed(item) {
                        if seen.insert(k.canonical_bytes()) {
                            out.push(k);
                        }
                    }
                }
            }
            Some(other) => out.extend(self.typed(other)),
        }
        out
    }
}

/// One typed column value of an index key.
#[derive(Debug, Clone, PartialEq, PartialOrd, Serialize, Deserialize)]
pub enum KeyValue {
    Uuid([u8; 16]),
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl KeyValue {
    /// -0.0 and 0.0 are one key.
    pub fn float(f: f64) -> KeyValue {
        KeyValue::Float(if f == 0.0 { 0.0 } else { f })
    }

    /// The bytes `logical_of` hashes when this value is an index's `shard_on`.
    /// A uuid hashes exactly like an entity id, so an index on `user_id`
    /// keeps a user's rows on the same shard as the user entity.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        match self {
            KeyValue::Uuid(b) => b.to_vec(),
            KeyValue::Str(s) => s.as_bytes().to_vec(),
            KeyValue::Int(i) => i.to_be_bytes().to_vec(),
            KeyValue::Float(f) => f.to_bits().to_be_bytes().to_vec(),
            KeyValue::Bool(b) => vec![u8::from(*b)],
        }
    }
}

/// The property values of one index row, in the index's property order.
pub type IndexKey = Vec<KeyValue>;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexSpec {
    pub table: String,
    pub properties: Vec<IndexProperty>,
    /// The property whose value picks the shard of a row; defaults to the first.
    #[serde(default)]
    pub shard_on: Option<String>,
    /// Equality conditions an entity must meet to be in the index (partial index).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_on: BTreeMap<String, serde_json::Value>,
    /// At most one live entity may hold each key (all properties
    /// together; each element of an array property). Its rows are written
    /// by the write path, not by the indexer (`storage::unique`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unique: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("index {table:?}: {reason}")]
pub struct BadIndexSpec {
    pub table: String,
    pub reason: String,
}

impl IndexSpec {
    pub fn validate(&self) -> Result<(), BadIndexSpec> {
        let bad = |reason: String| BadIndexSpec { table: self.table.clone(), reason };
        if !is_valid_identifier(&self.table) {
            return Err(bad("table names must match [a-z][a-z0-9_]{0,63}".into()));
        }
        if RESERVED_TABLES.contains(&self.table.as_str()) {
            return Err(bad(format!("{} is a reserved table name", self.table)));
        }
        if self.properties.is_empty() {
            return Err(bad("an index needs at least one property".into()));
        }
        for (i, p) in self.properties.iter().enumerate() {
            if !is_valid_identifier(&p.name) {
                return Err(bad(format!("property {:?} must match [a-z][a-z0-9_]{{0,63}}", p.name)));
            }
            if RESERVED_COLUMNS.contains(&p.name.as_str()) {
                return Err(bad(format!("{:?} is a reserved column name", p.name)));
            }
            if self.properties[..i].iter().any(|q| q.name == p.name) {
                return Err(bad(format!("property {:?} is listed twice", p.name)));
            }
            if p.max_len.is_some() && p.ty != PropType::String {
                return Err(bad(format!("max_len applies to string properties only ({:?})", p.name)));
            }
            if p.ty == PropType::String && p.string_len() == 0 {
                return Err(bad(format!("max_len of {:?} must be at least 1", p.name)));
            }
        }
        let key_bytes: usize = self.properties.iter().map(IndexProperty::key_bytes).sum::<usize>() + 16;
        if key_bytes > MAX_KEY_BYTES {
            return Err(bad(format!(
                "the key would take {key_bytes} bytes, over InnoDB's {MAX_KEY_BYTES}; lower max_len"
            )));
        }
        if let Some(s) = &self.shard_on {
            if !self.properties.iter().any(|p| &p.name == s) {
                return Err(bad(format!("shard_on {s:?} is not one of the index properties")));
            }
        }
        for (name, v) in &self.match_on {
            if name.is_empty() {
                return Err(bad("match_on has an empty property name".into()));
            }
            Value::from_json(v).map_err(|e| bad(format!("match_on {name:?}: {e}")))?;
        }
        Ok(())
    }

    pub fn shard_on(&self) -> &str {
        self.shard_on.as_deref().unwrap_or(&self.properties[0].name)
    }

    pub fn shard_on_position(&self) -> usize {
        let s = self.shard_on();
        self.properties.iter().position(|p| p.name == s).unwrap_or(0)
    }

    pub fn property(&self, name: &str) -> Option<&IndexProperty> {
        self.properties.iter().find(|p| p.name == name)
    }

    /// Whether a bag meets every `match_on` condition.
    pub fn matches_partial(&self, bag: &Bag) -> bool {
        self.match_on.iter().all(|(name, want)| match Value::from_json(want) {
            Ok(want) => crate::value::value_eq(bag.get(name), &want),
            Err(_) => false,
        })
    }

    /// The keys a bag produces: none when it fails `match_on` or lacks any
    /// indexed property; the cartesian product of array elements otherwise
    /// (capped at [`MAX_KEYS_PER_ENTITY`]).
    pub fn keys(&self, bag: &Bag) -> Vec<IndexKey> {
        if !self.matches_partial(bag) {
            return Vec::new();
        }
        let mut keys: Vec<IndexKey> = vec![Vec::with_capacity(self.properties.len())];
        for p in &self.properties {
            let values = p.typed_all(bag.get(&p.name));
            if values.is_empty() {
                return Vec::new();
            }
            let mut next = Vec::with_capacity(keys.len() * values.len());
            'outer: for k in &keys {
                for v in &values {
                    if next.len() == MAX_KEYS_PER_ENTITY {
                        break 'outer;
                    }
                    let mut nk = k.clone();
                    nk.push(v.clone());
                    next.push(nk);
                }
            }
            keys = next;
        }
        keys
    }

    /// The logical shard (of `logical_shards`) holding rows with this key.
    pub fn logical_of_key(&self, key: &IndexKey, logical_shards: u16) -> u16 {
        crate::shard::logical_of(&key[self.shard_on_position()].canonical_bytes(), logical_shards)
    }
}

/// Lifecycle of an index (DESIGN §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum IndexState {
    Creating,
    Backfilling,
    Active,
    Dropping,
    /// A unique index whose backfill found entities sharing a key: not
    /// enforced, not queried, until the data is fixed and the backfill
    /// runs again.
    Conflicted,
}

impl IndexState {
    pub fn as_str(&self) -> &'static str {
        match self {
            IndexState::Creating => "CREATING",
            IndexState::Backfilling => "BACKFILLING",
            IndexState::Active => "ACTIVE",
            IndexState::Dropping => "DROPPING",
            IndexState::Conflicted => "CONFLICTED",
        }
    }

    pub fn parse(s: &str) -> Option<IndexState> {
        [
            IndexState::Creating,
            IndexState::Backfilling,
            IndexState::Active,
            IndexState::Dropping,
            IndexState::Conflicted,
        ]
        .into_iter()
        .find(|st| st.as_str() == s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::bag_from_json;
    use serde_json::json;

    fn spec(toml_text: &str) -> IndexSpec {
        let s: IndexSpec = toml::from_str(toml_text).unwrap();
        s.validate().unwrap();
        s
    }

    #[test]
    fn compound_index_needs_every_property() {
        let s = spec(
            r#"table = "index_user_name"
               properties = [{ name = "first_name", type = "string" }, { name = "last_name", type = "string" }]"#,
        );
        let both = bag_from_json(&json!({"first_name": "Bret", "last_name": "Taylor"})).unwrap();
        let one = bag_from_json(&json!({"first_name": "Bret"})).unwrap();
        assert_eq!(s.keys(&both), vec![vec![KeyValue::Str("Bret".into()), KeyValue::Str("Taylor".into())]]);
        assert!(s.keys(&one).is_empty());
    }

    #[test]
    fn arrays_produce_one_key_per_distinct_element() {
        let s = spec(
            r#"table = "t"
                        properties = [{ name = "tag", type = "string" }]"#,
        );
        let bag = bag_from_json(&json!({"tag": ["a", "b", "a", 5]})).unwrap();
        assert_eq!(s.keys(&bag), vec![vec![KeyValue::Str("a".into())], vec![KeyValue::Str("b".into())]]);
    }

    #[test]
    fn a_huge_array_of_distinct_elements_is_deduplicated_in_linear_time() {
        let s = spec("table = 'index_tag'\nproperties = [{ name = 'tags', type = 'string', max_len = 64 }]");
        let mut tags: Vec<Value> = (0..200_000).map(|i| Value::String(format!("t{i}"))).collect();
        tags.push(Value::String("t7".into()));
        tags.push(Value::Int(3));
        let bag = Bag::from([("tags".into(), Value::Array(tags))]);
        let started = std::time::Instant::now();
        let all = s.properties[0].typed_all(bag.get("tags"));
        // Pairwise comparison (2·10¹⁰ string compares) took minutes here; the
        // set takes a second or two in a debug build on a loaded machine.
        assert!(started.elapsed() < std::time::Duration::from_secs(30), "{:?}", started.elapsed());
        assert_eq!(all.len(), 200_000, "the repeated t7 and the int are not keys");
        assert_eq!(all[7], KeyValue::Str("t7".into()), "first occurrence order is kept");
        assert_eq!(s.keys(&bag).len(), MAX_KEYS_PER_ENTITY);
    }

    #[test]
    fn match_on_makes_a_partial_index() {
        let s = spec(
            r#"table = "index_foo"
                        properties = [{ name = "bar", type = "int" }]
                        match_on = { m = "right" }"#,
        );
        let yes = bag_from_json(&json!({"bar": 1, "m": "right"})).unwrap();
        let no = bag_from_json(&json!({"bar": 1, "m": "left"})).unwrap();
        assert_eq!(s.keys(&yes).len(), 1);
        assert!(s.keys(&no).is_empty());
    }

    #[test]
    fn values_that_do_not_fit_the_column_are_not_indexed() {
        let s = spec(
            r#"table = "t"
                        properties = [{ name = "u", type = "uuid" }, { name = "s", type = "string", max_len = 3 }]"#,
        );
        let bad_uuid = bag_from_json(&json!({"u": "nope", "s": "abc"})).unwrap();
        let long = bag_from_json(&json!({"u": "f48b0440ca0c4f66991c4d5f6a078eaf", "s": "abcd"})).unwrap();
        let ok = bag_from_json(&json!({"u": "F48B0440-CA0C-4F66-991C-4D5F6A078EAF", "s": "héé"})).unwrap();
        assert!(s.keys(&bad_uuid).is_empty());
        assert!(s.keys(&long).is_empty());
        assert_eq!(s.keys(&ok).len(), 1);
    }

    #[test]
    fn invalid_specs_are_refused_with_a_reason() {
        for bad in [
            r#"table = "Bad"
               properties = [{ name = "a", type = "int" }]"#,
            r#"table = "entities"
               properties = [{ name = "a", type = "int" }]"#,
            r#"table = "t"
               properties = [{ name = "version", type = "int" }]"#,
            r#"table = "t"
               properties = [{ name = "a", type = "string", max_len = 800 }]"#,
            r#"table = "t"
               properties = [{ name = "a", type = "int" }]
               shard_on = "b""#,
            r#"table = "t"
               properties = []"#,
        ] {
            let s: IndexSpec = toml::from_str(bad).unwrap();
            assert!(s.validate().is_err(), "accepted {bad}");
        }
        // The issue's index_link: string(735) fits InnoDB's key limit exactly enough.
        spec(
            r#"table = "index_link"
                properties = [{ name = "link", type = "string", max_len = 735 }]"#,
        );
    }
}
