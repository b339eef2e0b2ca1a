//! Query parsing and planning.
//!
//! Shape: `{"index"?: T, "where": {prop: value | {"eq": v} | {"in": [..]}},
//! "limit"?: n, "allow_partial"?: bool}`. A bare value means equality; an
//! object is always an operator object. Issue-2 scope: the chosen index
//! must have an equality (or `in`) condition on every one of its
//! properties; other conditions are filters.

use schemas::filter::Condition;
use schemas::index::{IndexKey, IndexSpec, PropType};
use schemas::settings::ReaderSettings;
use schemas::web::Problem;
use schemas::Value;
use serde_json::Value as Json;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
pub struct Query {
    pub index: Option<String>,
    pub conditions: BTreeMap<String, Condition>,
    pub limit: usize,
    pub allow_partial: bool,
}

/// The index chosen for a query and the exact keys to look up.
#[derive(Debug, Clone)]
pub struct Plan {
    pub spec: IndexSpec,
    pub keys: Vec<IndexKey>,
}

fn bad(detail: impl Into<String>) -> Problem {
    Problem::bad_request("bad-query", detail)
}

pub fn parse(doc: Json, settings: &ReaderSettings) -> Result<Query, Problem> {
    let Json::Object(mut top) = doc else { return Err(bad("the query must be a JSON object")) };
    let index = match top.remove("index") {
        None | Some(Json::Null) => None,
        Some(Json::String(s)) => Some(s),
        Some(_) => return Err(bad("\"index\" must be a string")),
    };
    let limit = match top.remove("limit") {
        None | Some(Json::Null) => settings.default_limit,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 && n as usize <= settings.max_limit => n as usize,
            _ => return Err(bad(format!("\"limit\" must be an integer from 1 to {}", settings.max_limit))),
        },
    };
    let allow_partial = match top.remove("allow_partial") {
        None | Some(Json::Null) => false,
        Some(Json::Bool(b)) => b,
        Some(_) => return Err(bad("\"allow_partial\" must be true or false")),
    };
    if let Some(Json::String(_)) = top.get("page_token") {
        return Err(bad("page tokens are not supported yet"));
    }
    top.remove("page_token");
    let conditions = match top.remove("where") {
        Some(Json::Object(w)) => w
            .into_iter()
            .map(|(name, v)| Ok((name.clone(), condition(&name, v, settings.max_in)?)))
            .collect::<Result<BTreeMap<_, _>, Problem>>()?,
        None => return Err(bad("\"where\" is required: an object of conditions")),
        Some(_) => return Err(bad("\"where\" must be an object of conditions")),
    };
    if let Some(k) = top.keys().next() {
        return Err(bad(format!("unknown query member {k:?}")));
    }
    Ok(Query { index, conditions, limit, allow_partial })
}

fn value(name: &str, v: &Json) -> Result<Value, Problem> {
    Value::from_json(v).map_err(|e| bad(format!("condition on {name:?}: {e}")))
}

fn condition(name: &str, v: Json, max_in: usize) -> Result<Condition, Problem> {
    match v {
        Json::Object(ops) => {
            if ops.len() != 1 {
                return Err(bad(format!("condition on {name:?} must have exactly one operator (eq, in)")));
            }
            let (op, arg) = ops.into_iter().next().expect("one entry");
            match op.as_str() {
                "eq" => Ok(Condition::Eq(value(name, &arg)?)),
                "in" => {
                    let Json::Array(items) = arg else {
                        return Err(bad(format!("\"in\" on {name:?} takes a list")));
                    };
                    if items.is_empty() || items.len() > max_in {
                        return Err(bad(format!("\"in\" on {name:?} needs 1 to {max_in} values")));
                    }
                    Ok(Condition::In(items.iter().map(|i| value(name, i)).collect::<Result<_, _>>()?))
                }
                other => Err(bad(format!("unknown operator {other:?} on {name:?}; supported: eq, in"))),
            }
        }
        scalar => Ok(Condition::Eq(value(name, &scalar)?)),
    }
}

fn type_name(p: &schemas::index::IndexProperty) -> String {
    match p.ty {
        PropType::Uuid => "uuid (32 hex digits or a dashed UUID)".into(),
        PropType::String => format!("string of at most {} characters", p.string_len()),
        PropType::Int => "integer".into(),
        PropType::Float => "number".into(),
        PropType::Bool => "boolean".into(),
    }
}

/// Picks the index among `indexes` (in registration order) and expands the
/// conditions on its properties into keys.
pub fn plan(q: &Query, indexes: &[IndexSpec], settings: &ReaderSettings) -> Result<Plan, Problem> {
    let usable = |s: &IndexSpec| s.properties.iter().all(|p| q.conditions.contains_key(&p.name));
    let spec = match &q.index {
        Some(name) => {
            let spec = indexes.iter().find(|s| &s.table == name).ok_or_else(|| {
                Problem::bad_request("unknown-index", format!("there is no index named {name:?}"))
            })?;
            if !usable(spec) {
                let need: Vec<&str> = spec.properties.iter().map(|p| p.name.as_str()).collect();
                return Err(bad(format!("index {name:?} needs an equality or in condition on each of {need:?}")));
            }
            spec
        }
        None => indexes
            .iter()
            .filter(|s| usable(s))
            // Most specific first: the index fixing the most properties.
            .max_by_key(|s| (s.properties.len(), std::cmp::Reverse(indexes.iter().position(|o| o == *s))))
            .ok_or_else(|| {
                let names: Vec<&String> = q.conditions.keys().collect();
                Problem::bad_request(
                    "no-usable-index",
                    format!(
                        "no index has all of its properties among {names:?}; add an index on these properties \
                         or name one with \"index\""
                    ),
                )
            })?,
    };
    let mut keys: Vec<IndexKey> = vec![Vec::new()];
    for p in &spec.properties {
        let cond = &q.conditions[&p.name];
        let mut typed = Vec::new();
        for v in cond.values() {
            let k = p.typed(v).ok_or_else(|| {
                bad(format!(
                    "{:?} is an index property of type {}; {} does not fit",
                    p.name,
                    type_name(p),
                    v.to_json()
                ))
            })?;
            if !typed.contains(&k) {
                typed.push(k);
            }
        }
        let mut next = Vec::new();
        for k in &keys {
            for t in &typed {
                let mut nk = k.clone();
                nk.push(t.clone());
                next.push(nk);
            }
        }
        if next.len() > settings.max_in {
            return Err(bad(format!(
                "the in lists expand to {} index keys, over the limit of {}",
                next.len(),
                settings.max_in
            )));
        }
        keys = next;
    }
    keys.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    Ok(Plan { spec: spec.clone(), keys })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn settings() -> schemas::Settings {
        schemas::Settings::from_toml_and_env(
            r#"
            [[indexes]]
            table = "index_user_id"
            properties = [{ name = "user_id", type = "uuid" }]
            [[indexes]]
            table = "index_user_name"
            properties = [{ name = "first_name", type = "string" }, { name = "last_name", type = "string" }]
            [[indexes]]
            table = "index_first"
            properties = [{ name = "first_name", type = "string" }]
            "#,
            Vec::new(),
        )
        .unwrap()
    }

    fn plan_of(q: Json) -> Result<Plan, Problem> {
        let s = settings();
        plan(&parse(q, &s.reader)?, &s.indexes, &s.reader)
    }

    #[test]
    fn the_most_specific_usable_index_wins() {
        let p = plan_of(json!({"where": {"first_name": "a", "last_name": {"in": ["b", "c"]}}})).unwrap();
        assert_eq!(p.spec.table, "index_user_name");
        assert_eq!(p.keys.len(), 2);
        let p = plan_of(json!({"where": {"first_name": "a", "title": "x"}})).unwrap();
        assert_eq!(p.spec.table, "index_first");
    }

    #[test]
    fn bad_queries_get_a_reason() {
        for (q, kind) in [
            (json!({"where": {"title": "x"}}), "no-usable-index"),
            (json!({"index": "nope", "where": {"title": "x"}}), "unknown-index"),
            (json!({"where": {"user_id": "not-a-uuid"}}), "bad-query"),
            (json!({"where": {"user_id": {"gt": 1}}}), "bad-query"),
            (json!({"where": {"user_id": {"in": []}}}), "bad-query"),
            (json!({"where": {"first_name": "a"}, "limit": 0}), "bad-query"),
            (json!({"where": {"first_name": "a"}, "limit": 100000}), "bad-query"),
            (json!({"where": {"first_name": "a"}, "colour": 1}), "bad-query"),
            (json!({"where": "first_name"}), "bad-query"),
            (json!([1]), "bad-query"),
        ] {
            let e = plan_of(q.clone()).unwrap_err();
            assert_eq!(e.kind, kind, "{q}: {}", e.detail);
            assert_eq!(e.status.as_u16(), 400);
        }
    }
}
