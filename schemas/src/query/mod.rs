//! Queries: parsing (this module), choosing the index and the scan
//! ([`plan`]), the re-filter ([`Plan::admits`]) and page tokens ([`token`]).
//! Pure: the reader executes plans against the shards.
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

use serde_json::Value as Json;
use std::collections::BTreeMap;

use crate::filter::Condition;
use crate::settings::ReaderSettings;
use crate::{EntityId, Value};

mod plan;
mod token;

pub use plan::{cmp_keys, plan, Plan};
pub use token::{PageToken, TokenError};

/// Why a query is refused. Every variant is the caller's mistake (an HTTP
/// edge answers 400); [`QueryError::kind`] is its stable slug.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    /// Malformed: not the documented shape, a bad value or operator.
    #[error("{0}")]
    Malformed(String),
    #[error("there is no index named {0:?}")]
    UnknownIndex(String),
    #[error(
        "no index starts with any of {properties:?}; add an index whose first property is one of them, \
         or name one with \"index\""
    )]
    NoUsableIndex { properties: Vec<String> },
    #[error("consistent_with takes write_token strings from write responses")]
    BadWriteToken,
    #[error(transparent)]
    PageToken(#[from] TokenError),
}

impl QueryError {
    /// The problem type slug: `bad-query`, `unknown-index`, …
    pub fn kind(&self) -> &'static str {
        match self {
            QueryError::Malformed(_) => "bad-query",
            QueryError::UnknownIndex(_) => "unknown-index",
            QueryError::NoUsableIndex { .. } => "no-usable-index",
            QueryError::BadWriteToken => "bad-write-token",
            QueryError::PageToken(_) => "bad-page-token",
        }
    }
}

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

fn bad(detail: impl Into<String>) -> QueryError {
    QueryError::Malformed(detail.into())
}

/// `<32 hex id>.<version>`, as the writer returns it.
pub fn parse_write_token(s: &str) -> Option<(EntityId, u64)> {
    let (id, v) = s.split_once('.')?;
    Some((EntityId::parse(id).ok()?, v.parse().ok()?))
}

pub fn parse(doc: Json, settings: &ReaderSettings) -> Result<Query, QueryError> {
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
            .map(|t| t.as_str().and_then(parse_write_token).ok_or(QueryError::BadWriteToken))
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
            .collect::<Result<BTreeMap<_, _>, QueryError>>()?,
        None => BTreeMap::new(),
        Some(_) => return Err(bad("\"where\" must be an object of conditions")),
    };
    if let Some(k) = top.keys().next() {
        return Err(bad(format!("unknown query member {k:?}")));
    }
    Ok(Query { index, conditions, limit, descending, page_token, allow_partial, consistent_with })
}

fn value(name: &str, v: &Json) -> Result<Value, QueryError> {
    Value::from_json(v).map_err(|e| bad(format!("condition on {name:?}: {e}")))
}

fn condition(name: &str, v: Json, max_in: usize) -> Result<Condition, QueryError> {
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
