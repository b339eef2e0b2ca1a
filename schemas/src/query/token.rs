//! Page tokens: where a page stopped (the last entity's key and id), bound
//! to the query that made it.
//!
//! Text: `v1.` then lowercase hex of a binary record, so a client sees an
//! opaque string and a change of encoding is a new version prefix, never a
//! silent misreading:
//!
//! | bytes | what |
//! |---|---|
//! | 8 | fingerprint: xxh3-64 of the query's canonical encoding (below) |
//! | 1 | number of key values `n` |
//! | … | `n` key values: a tag (1 uuid, 2 string, 3 int, 4 float, 5 bool) and its bytes |
//! | 16 | the entity id |
//!
//! The fingerprint covers the index, the order and every condition in a
//! fixed byte form of its own (names and values length-prefixed, floats by
//! their bits), never `Debug` output, which may change with any compiler.
//! A token whose fingerprint differs belongs to another query.

use crate::filter::Condition;
use crate::id::{hex, unhex};
use crate::index::{IndexKey, KeyValue};
use crate::value::Value;
use crate::EntityId;

use super::{Plan, Query};

/// The version prefix of the current encoding.
const PREFIX: &str = "v1.";

/// A page's end: the last entity's key in the index and its id.
#[derive(Debug, Clone, PartialEq)]
pub struct PageToken {
    pub key: IndexKey,
    pub id: EntityId,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("the page_token is not one this query returned")]
    Malformed,
    #[error("the page_token was made by another version of bagstore ({0}); start again from the first page")]
    OtherVersion(String),
    #[error("the page_token belongs to another query (other conditions, index or order)")]
    OtherQuery,
}

impl PageToken {
    pub fn encode(&self, plan: &Plan, q: &Query) -> String {
        let mut b = fingerprint(plan, q).to_be_bytes().to_vec();
        b.push(self.key.len() as u8);
        for v in &self.key {
            put_key_value(&mut b, v);
        }
        b.extend_from_slice(self.id.as_bytes());
        format!("{PREFIX}{}", hex(&b))
    }

    /// The token `text` of `q` under `plan`, checked to belong to them.
    pub fn decode(text: &str, plan: &Plan, q: &Query) -> Result<PageToken, TokenError> {
        let Some(body) = text.strip_prefix(PREFIX) else {
            return Err(match text.split_once('.') {
                Some((v, _)) if v.starts_with('v') && v.len() <= 4 => TokenError::OtherVersion(v.to_string()),
                // Before v1, tokens were bare hex (of JSON).
                _ if !text.is_empty() && unhex(text).is_some() => {
                    TokenError::OtherVersion("unversioned".into())
                }
                _ => TokenError::Malformed,
            });
        };
        if body.len() > 16_384 {
            return Err(TokenError::Malformed);
        }
        let bytes = unhex(body).ok_or(TokenError::Malformed)?;
        let mut r = Reader(&bytes);
        let f = u64::from_be_bytes(r.array().ok_or(TokenError::Malformed)?);
        let n = r.take(1).ok_or(TokenError::Malformed)?[0] as usize;
        let key = (0..n).map(|_| r.key_value()).collect::<Option<IndexKey>>().ok_or(TokenError::Malformed)?;
        let id = EntityId(r.array().ok_or(TokenError::Malformed)?);
        if !r.0.is_empty() {
            return Err(TokenError::Malformed);
        }
        if f != fingerprint(plan, q) || key.len() != plan.spec.properties.len() {
            return Err(TokenError::OtherQuery);
        }
        Ok(PageToken { key, id })
    }
}

/// xxh3-64 of the query's canonical encoding (see the module docs).
fn fingerprint(plan: &Plan, q: &Query) -> u64 {
    let mut b = Vec::new();
    put_str(&mut b, &plan.spec.table);
    b.push(u8::from(plan.descending));
    for (name, c) in &q.conditions {
        put_str(&mut b, name);
        match c {
            Condition::Eq(v) => {
                b.push(1);
                put_value(&mut b, v);
            }
            Condition::In(vs) => {
                b.push(2);
                put_len(&mut b, vs.len());
                vs.iter().for_each(|v| put_value(&mut b, v));
            }
            Condition::Range { lower, upper } => {
                b.push(3);
                for bound in [lower, upper] {
                    match bound {
                        None => b.push(0),
                        Some((v, inclusive)) => {
                            b.push(1 + u8::from(*inclusive));
                            put_value(&mut b, v);
                        }
                    }
                }
            }
            Condition::Exists(want) => b.extend([4, u8::from(*want)]),
        }
    }
    xxhash_rust::xxh3::xxh3_64(&b)
}

fn put_len(b: &mut Vec<u8>, n: usize) {
    b.extend_from_slice(&(n as u32).to_be_bytes());
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    put_len(b, s.len());
    b.extend_from_slice(s.as_bytes());
}

fn put_value(b: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Null => b.push(0),
        Value::Bool(x) => b.extend([1, u8::from(*x)]),
        Value::Int(i) => {
            b.push(2);
            b.extend_from_slice(&i.to_be_bytes());
        }
        Value::Float(f) => {
            b.push(3);
            b.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        Value::String(s) => {
            b.push(4);
            put_str(b, s);
        }
        Value::Array(items) => {
            b.push(5);
            put_len(b, items.len());
            items.iter().for_each(|i| put_value(b, i));
        }
        Value::Object(bag) => {
            b.push(6);
            put_len(b, bag.len());
            for (k, v) in bag.iter() {
                put_str(b, k);
                put_value(b, v);
            }
        }
    }
}

fn put_key_value(b: &mut Vec<u8>, v: &KeyValue) {
    match v {
        KeyValue::Uuid(u) => {
            b.push(1);
            b.extend_from_slice(u);
        }
        KeyValue::Str(s) => {
            b.push(2);
            put_str(b, s);
        }
        KeyValue::Int(i) => {
            b.push(3);
            b.extend_from_slice(&i.to_be_bytes());
        }
        KeyValue::Float(f) => {
            b.push(4);
            b.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        KeyValue::Bool(x) => b.extend([5, u8::from(*x)]),
    }
}

/// Reads a token's bytes front to back; `None` past the end.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn key_value(&mut self) -> Option<KeyValue> {
        Some(match self.take(1)?[0] {
            1 => KeyValue::Uuid(self.array()?),
            2 => {
                let n = u32::from_be_bytes(self.array()?) as usize;
                KeyValue::Str(String::from_utf8(self.take(n)?.to_vec()).ok()?)
            }
            3 => KeyValue::Int(i64::from_be_bytes(self.array()?)),
            4 => KeyValue::Float(f64::from_bits(u64::from_be_bytes(self.array()?))),
            5 => KeyValue::Bool(self.take(1)?[0] != 0),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::query::{parse, plan};
    use serde_json::json;

    fn query(doc: serde_json::Value) -> (Plan, Query) {
        let s = crate::Settings::from_toml_and_env(
            r#"
            [[indexes]]
            table = "index_user_published"
            properties = [{ name = "user_id", type = "uuid" }, { name = "published", type = "float" }]
            "#,
            Vec::new(),
        )
        .unwrap();
        let q = parse(doc, &s.reader).unwrap();
        (plan(&q, &s.indexes, &s.reader).unwrap(), q)
    }

    #[test]
    fn a_token_round_trips_for_its_own_query_only() {
        let u = "f48b0440ca0c4f66991c4d5f6a078eaf";
        let (p, q) =
            query(json!({"where": {"user_id": u, "published": {"gte": 1.5}, "t": ["x", {"a": null}]}}));
        let t =
            PageToken { key: vec![KeyValue::Uuid([7; 16]), KeyValue::Float(-0.25)], id: EntityId([9; 16]) };
        let text = t.encode(&p, &q);
        assert!(text.starts_with("v1."), "{text}");
        assert_eq!(PageToken::decode(&text, &p, &q), Ok(t.clone()));
        for other in [
            json!({"where": {"user_id": u, "published": {"gt": 1.5}, "t": ["x", {"a": null}]}}),
            json!({"where": {"user_id": u, "published": {"gte": 1.5}, "t": ["x", {"a": 0}]}}),
            json!({"where": {"user_id": u, "published": {"gte": 1.5}, "t": ["x", {"a": null}]}, "order": "desc"}),
        ] {
            let (p2, q2) = query(other.clone());
            assert_eq!(PageToken::decode(&text, &p2, &q2), Err(TokenError::OtherQuery), "{other}");
        }
    }

    /// The encoding is a contract with clients holding tokens: this vector
    /// is committed, so a change to it must be a new version.
    #[test]
    fn the_v1_encoding_is_stable() {
        let (p, q) = query(json!({"where": {"user_id": "f48b0440ca0c4f66991c4d5f6a078eaf"}}));
        let t = PageToken { key: vec![KeyValue::Uuid([1; 16]), KeyValue::Float(2.0)], id: EntityId([3; 16]) };
        let text = t.encode(&p, &q);
        let f = &text[3..19];
        assert_eq!(
            &text[19..],
            "02010101010101010101010101010101010104400000000000000003030303030303030303030303030303"
        );
        assert_eq!(f.len(), 16);
        assert_eq!(fingerprint(&p, &q), u64::from_str_radix(f, 16).unwrap());
    }

    #[test]
    fn tokens_of_other_versions_and_garbage_get_a_clear_error() {
        let (p, q) = query(json!({"where": {"user_id": "f48b0440ca0c4f66991c4d5f6a078eaf"}}));
        // The encoding before v1: hex of JSON.
        let old = hex(br#"{"f":1,"key":[],"id":[0]}"#);
        assert_eq!(PageToken::decode(&old, &p, &q), Err(TokenError::OtherVersion("unversioned".into())));
        assert_eq!(PageToken::decode("v2.00", &p, &q), Err(TokenError::OtherVersion("v2".into())));
        for bad in ["", "v1.", "v1.zz", "v1.00", "hello", "v1.0000000000000000ff"] {
            assert_eq!(PageToken::decode(bad, &p, &q), Err(TokenError::Malformed), "{bad}");
        }
    }
}
