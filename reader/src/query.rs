//! Query parsing and planning.
//!
//! Shape:
//!
//! ```json
//! {"index": "…"?, "where": {"prop": value | {"eq"|"in"|"gt"|"gte"|"lt"|"lte"|"exists": …}},
//!  "order": "asc" | "desc", "limit": n, "page_token": "…", "allow_partial": false,
//!  "consistent_with": ["<write_token>", …]}
//! ```
//!
//! A bare value means equality; an object is always an operator object
//! (`gt`/`gte` and `lt`/`lte` combine into one range). On the chosen index:
//! equality or `in` on a prefix of its properties, then at most one range on
//! the next one; every other condition is a filter on the fetched entities.

use schemas::filter::{Condition, KeyRange};
use schemas::index::{IndexKey, IndexSpec, KeyValue, PropType};
use schemas::settings::ReaderSettings;
use schemas::web::Problem;
use schemas::{EntityId, Value};
use serde_json::Value as Json;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
pub struct Query {
    pub index: Option<String>,
    pub conditions: BTreeMap<String, Condition>,
    pub limit: usize,
    pub descending: bool,
    pub page_token: Option<String>,
    pub allow_partial: bool,
    /// `(entity, version)` writes the index must reflect before the query runs.
    pub consistent_with: Vec<(EntityId, u64)>,
}

/// The index chosen for a query and how to scan it.
#[derive(Debug, Clone)]
pub struct Plan {
    pub spec: IndexSpec,
    /// Leading properties fixed by equality or `in`.
    pub prefix_len: usize,
    /// Every combination of the prefix values, in scan order.
    pub prefixes: Vec<IndexKey>,
    /// Range on property `prefix_len`, if any.
    pub range: Option<KeyRange>,
    pub descending: bool,
    /// The prefix fixes `shard_on`: each prefix lives on one shard.
    pub shard_fixed: bool,
}

fn bad(detail: impl Into<String>) -> Problem {
    Problem::bad_request("bad-query", detail)
}

/// `<32 hex id>.<version>`, as the writer returns it.
pub fn parse_write_token(s: &str) -> Option<(EntityId, u64)> {
    let (id, v) = s.split_once('.')?;
    Some((EntityId::parse(id).ok()?, v.parse().ok()?))
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
    let descending = match top.remove("order") {
        None | Some(Json::Null) => false,
        Some(Json::String(s)) if s == "asc" => false,
        Some(Json::String(s)) if s == "desc" => true,
        Some(_) => return Err(bad("\"order\" must be \"asc\" or \"desc\"")),
    };
    let allow_partial = match top.remove("allow_partial") {
        None | Some(Json::Null) => false,
        Some(Json::Bool(b)) => b,
        Some(_) => return Err(bad("\"allow_partial\" must be true or false")),
    };
    let page_token = match top.remove("page_token") {
        None | Some(Json::Null) => None,
        Some(Json::String(s)) => Some(s),
        Some(_) => return Err(bad("\"page_token\" must be a string from a previous response")),
    };
    let consistent_with = match top.remove("consistent_with") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Array(items)) if items.len() <= settings.max_in => items
            .iter()
            .map(|t| {
                t.as_str().and_then(parse_write_token).ok_or_else(|| {
                    Problem::bad_request(
                        "bad-write-token",
                        "consistent_with takes write_token strings from write responses",
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(bad(format!(
                "\"consistent_with\" must be a list of at most {} tokens",
                settings.max_in
            )))
        }
    };
    let conditions = match top.remove("where") {
        Some(Json::Object(w)) => w
            .into_iter()
            .map(|(name, v)| Ok((name.clone(), condition(&name, v, settings.max_in)?)))
            .collect::<Result<BTreeMap<_, _>, Problem>>()?,
        None => BTreeMap::new(),
        Some(_) => return Err(bad("\"where\" must be an object of conditions")),
    };
    if let Some(k) = top.keys().next() {
        return Err(bad(format!("unknown query member {k:?}")));
    }
    Ok(Query { index, conditions, limit, descending, page_token, allow_partial, consistent_with })
}

fn value(name: &str, v: &Json) -> Result<Value, Problem> {
    Value::from_json(v).map_err(|e| bad(format!("condition on {name:?}: {e}")))
}

fn condition(name: &str, v: Json, max_in: usize) -> Result<Condition, Problem> {
    let Json::Object(ops) = v else { return Ok(Condition::Eq(value(name, &v)?)) };
    let mut lower = None;
    let mut upper = None;
    let mut single = None;
    for (op, arg) in ops {
        match op.as_str() {
            "eq" => single = Some(Condition::Eq(value(name, &arg)?)),
            "in" => {
                let Json::Array(items) = arg else {
                    return Err(bad(format!("\"in\" on {name:?} takes a list")));
                };
                if items.is_empty() || items.len() > max_in {
                    return Err(bad(format!("\"in\" on {name:?} needs 1 to {max_in} values")));
                }
                single = Some(Condition::In(items.iter().map(|i| value(name, i)).collect::<Result<_, _>>()?));
            }
            "exists" => match arg {
                Json::Bool(b) => single = Some(Condition::Exists(b)),
                _ => return Err(bad(format!("\"exists\" on {name:?} takes true or false"))),
            },
            "gt" | "gte" if lower.is_none() => lower = Some((value(name, &arg)?, op == "gte")),
            "lt" | "lte" if upper.is_none() => upper = Some((value(name, &arg)?, op == "lte")),
            "gt" | "gte" | "lt" | "lte" => {
                return Err(bad(format!("two lower or two upper bounds on {name:?}")))
            }
            other => {
                return Err(bad(format!(
                    "unknown operator {other:?} on {name:?}; supported: eq, in, gt, gte, lt, lte, exists"
                )))
            }
        }
    }
    match (single, lower.is_some() || upper.is_some()) {
        (Some(_), true) => Err(bad(format!("{name:?} mixes equality or exists with a range"))),
        (Some(c), false) => Ok(c),
        (None, true) => Ok(Condition::Range { lower, upper }),
        (None, false) => Err(bad(format!("condition on {name:?} has no operator"))),
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

/// How much of an index a query's conditions pin down: the equality prefix
/// length and whether a range follows it.
fn fit(q: &Query, spec: &IndexSpec) -> (usize, bool) {
    let prefix = spec
        .properties
        .iter()
        .take_while(|p| q.conditions.get(&p.name).is_some_and(Condition::is_equality))
        .count();
    let range = spec
        .properties
        .get(prefix)
        .is_some_and(|p| matches!(q.conditions.get(&p.name), Some(Condition::Range { .. })));
    (prefix, range)
}

/// Picks the index among `indexes` (in a stable order) and builds the scan.
pub fn plan(q: &Query, indexes: &[IndexSpec], settings: &ReaderSettings) -> Result<Plan, Problem> {
    let spec = match &q.index {
        Some(name) => indexes.iter().find(|s| &s.table == name).ok_or_else(|| {
            Problem::bad_request("unknown-index", format!("there is no index named {name:?}"))
        })?,
        None => {
            // Most constrained leading properties first; ties: fewer shards.
            let score = |s: &IndexSpec| {
                let (prefix, range) = fit(q, s);
                let fixed = s.properties[..prefix].iter().any(|p| p.name == s.shard_on());
                (prefix + range as usize, fixed)
            };
            let best = indexes.iter().filter(|s| score(s).0 > 0).max_by(|a, b| {
                score(a).cmp(&score(b)).then_with(|| {
                    // Earlier in the list wins a full tie.
                    let pa = indexes.iter().position(|o| o == *a);
                    let pb = indexes.iter().position(|o| o == *b);
                    pb.cmp(&pa)
                })
            });
            best.ok_or_else(|| {
                let names: Vec<&String> = q.conditions.keys().collect();
                Problem::bad_request(
                    "no-usable-index",
                    format!(
                        "no index starts with any of {names:?}; add an index whose first property is one of \
                         them, or name one with \"index\""
                    ),
                )
            })?
        }
    };
    let (prefix_len, has_range) = fit(q, spec);
    let mut prefixes: Vec<IndexKey> = vec![Vec::new()];
    for p in &spec.properties[..prefix_len] {
        let mut typed = Vec::new();
        for v in q.conditions[&p.name].values() {
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
        for k in &prefixes {
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
        prefixes = next;
    }
    prefixes.sort_by(|a, b| cmp_keys(a, b));
    if q.descending {
        prefixes.reverse();
    }
    let range = if has_range {
        let p = &spec.properties[prefix_len];
        let r = q.conditions[&p.name].typed_range(p).ok_or_else(|| {
            bad(format!("the range on {:?} must use values of its index type, {}", p.name, type_name(p)))
        })?;
        Some(r)
    } else {
        None
    };
    let shard_fixed = spec.properties[..prefix_len].iter().any(|p| p.name == spec.shard_on());
    Ok(Plan { spec: spec.clone(), prefix_len, prefixes, range, descending: q.descending, shard_fixed })
}

/// Index order of two keys (all columns of one index have one type each).
pub fn cmp_keys(a: &[KeyValue], b: &[KeyValue]) -> std::cmp::Ordering {
    a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal)
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
            table = "index_user_published"
            properties = [{ name = "user_id", type = "uuid" }, { name = "published", type = "int" }]
            shard_on = "user_id"
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
    fn the_index_constraining_the_most_leading_properties_wins() {
        let p = plan_of(json!({"where": {"first_name": "a", "last_name": {"in": ["b", "c"]}}})).unwrap();
        assert_eq!((p.spec.table.as_str(), p.prefixes.len()), ("index_user_name", 2));
        let p = plan_of(json!({"where": {"first_name": "a", "title": "x"}})).unwrap();
        assert_eq!(p.spec.table, "index_user_name", "ties go to the earlier index");
        let u = "f48b0440ca0c4f66991c4d5f6a078eaf";
        let p = plan_of(json!({"where": {"user_id": u, "published": {"gte": 5}}})).unwrap();
        assert_eq!(
            (p.spec.table.as_str(), p.prefix_len, p.range.is_some()),
            ("index_user_published", 1, true)
        );
        assert!(p.shard_fixed);
        let p = plan_of(json!({"where": {"user_id": u}, "order": "desc"})).unwrap();
        assert_eq!(p.spec.table, "index_user_id", "a full tie goes to the earlier index");
        let p = plan_of(json!({"index": "index_user_published", "where": {"published": {"lt": 9}}})).unwrap();
        assert_eq!((p.prefix_len, p.range.is_none(), p.shard_fixed), (0, true, false));
    }

    #[test]
    fn in_lists_expand_in_scan_order() {
        let p = plan_of(json!({"where": {"first_name": {"in": ["b", "a", "c"]}}, "order": "desc"})).unwrap();
        let firsts: Vec<&KeyValue> = p.prefixes.iter().map(|k| &k[0]).collect();
        assert_eq!(
            firsts,
            vec![&KeyValue::Str("c".into()), &KeyValue::Str("b".into()), &KeyValue::Str("a".into())]
        );
    }

    #[test]
    fn bad_queries_get_a_reason() {
        for (q, kind) in [
            (json!({"where": {"title": "x"}}), "no-usable-index"),
            (json!({"index": "nope", "where": {"title": "x"}}), "unknown-index"),
            (json!({"where": {"user_id": "not-a-uuid"}}), "bad-query"),
            (json!({"where": {"user_id": {"between": 1}}}), "bad-query"),
            (json!({"where": {"user_id": {"in": []}}}), "bad-query"),
            (json!({"where": {"user_id": {"eq": 1, "gt": 0}}}), "bad-query"),
            (json!({"where": {"first_name": {"gt": 1}}}), "bad-query"),
            (json!({"where": {"first_name": "a"}, "limit": 0}), "bad-query"),
            (json!({"where": {"first_name": "a"}, "limit": 100000}), "bad-query"),
            (json!({"where": {"first_name": "a"}, "order": "up"}), "bad-query"),
            (json!({"where": {"first_name": "a"}, "consistent_with": ["x"]}), "bad-write-token"),
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
