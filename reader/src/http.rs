//! Reader routes and JSON shapes, and the one mapping of [`ReadError`] to
//! problem documents.
//!
//! - `GET /v1/entities/{id}[?consistent_with=TOKEN,…]` →
//!   `{"id","version","updated","properties"}`
//! - `POST /v1/entities/get` `{"ids": [...], "consistent_with": [...]}` →
//!   `{"items": [...]}`
//! - `POST /v1/query` → `{"items", "index", "next_page_token", "explain"}`
//! - `GET /v1/indexes` → `{"indexes": [...]}`
//! - `DELETE /v1/indexes/{table}` (admin) drops an index
//! - `GET /v1/lag` → per index, events not yet applied and time lag

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use schemas::index::IndexState;
use schemas::query;
use schemas::value::BagJson;
use serde::Serialize;
use serde_json::{json, Value as JsonValue};
use service::http::{parse_id, read_json, Problem, Role, Routes};
use service::kafka;
use std::time::Duration;
use storage::{catalog, IndexMeta, StoreError};

use crate::consistency::Tokens;
use crate::execute::Entity;
use crate::{ReadError, Reader};

/// Query and id-list bodies are small; this bounds them.
const MAX_REQUEST_BYTES: usize = 1 << 20;

/// The reader's routes: reads need a read token, dropping an index an
/// admin token.
pub fn routes(reader: Reader) -> Routes {
    Routes::new()
        .route(Method::GET, "/v1/entities/{id}", Role::Read, get_one)
        .route(Method::POST, "/v1/entities/get", Role::Read, get_many)
        .route(Method::POST, "/v1/query", Role::Read, run_query)
        .route(Method::GET, "/v1/indexes", Role::Read, list_indexes)
        .route(Method::DELETE, "/v1/indexes/{table}", Role::Admin, drop_index)
        .route(Method::GET, "/v1/lag", Role::Read, lag)
        .route(Method::GET, "/v1/shards", Role::Read, list_shards)
        .with_state(reader)
}

impl From<ReadError> for Problem {
    fn from(e: ReadError) -> Problem {
        match e {
            ReadError::Query(q) => Problem::bad_request(q.kind(), q.to_string()),
            ReadError::IndexNotReady { table, state } => Problem::new(
                StatusCode::CONFLICT,
                "index-not-ready",
                "Index not ready",
                format!(
                    "index {table:?} is {state}; its results may be incomplete. Pass \"allow_partial\": true to accept that"
                ),
            )
            .with("index", table)
            .with("state", state),
            ReadError::IndexBehind { table, pending } => Problem::new(
                StatusCode::GATEWAY_TIMEOUT,
                "index-behind",
                "Index behind",
                format!("index {table:?} has not applied these writes yet; retry later"),
            )
            .with("pending", pending),
            ReadError::Timeout { .. } => {
                Problem::new(StatusCode::GATEWAY_TIMEOUT, "query-timeout", "Query timed out", e.to_string())
            }
            ReadError::Store(StoreError::NoSuchIndex { table }) => {
                Problem::not_found(format!("no index named {table:?}"))
            }
            ReadError::Store(ref s) if s.is_transient() => Problem::unavailable(&e),
            ReadError::ReplicaBehind { .. } => Problem::unavailable(&e),
            ReadError::Store(_) | ReadError::Corrupt { .. } => Problem::internal(&e),
        }
    }
}

/// An entity as answered: `{"id","version","updated","properties"}`.
/// `updated` is the commit time in microseconds since the Unix epoch. It is
/// written straight from the decoded bag (no intermediate JSON tree).
#[derive(Debug, Serialize)]
pub struct EntityJson<'a> {
    id: String,
    version: u64,
    updated: i64,
    properties: BagJson<'a>,
}

impl<'a> From<&'a Entity> for EntityJson<'a> {
    fn from(e: &'a Entity) -> Self {
        EntityJson {
            id: e.id.to_hex(),
            version: e.version,
            updated: e.updated_us,
            properties: BagJson(&e.properties),
        }
    }
}

#[derive(Debug, Serialize)]
struct Items<'a> {
    items: Vec<EntityJson<'a>>,
}

/// A query's answer.
#[derive(Debug, Serialize)]
struct QueryAnswer<'a> {
    items: Vec<EntityJson<'a>>,
    index: &'a str,
    next_page_token: Option<&'a str>,
    index_lag_ms: Option<i64>,
    index_applied_through_us: Option<i64>,
    explain: JsonValue,
}

/// `GET /v1/entities/{id}`: the entity with its version as `ETag`; 304
/// when `If-None-Match` names that version (or is `*`).
/// With `?consistent_with=TOKEN` (repeated, or comma-separated), never an
/// older version than a token for this entity names.
async fn get_one(
    State(r): State<Reader>,
    Path(id): Path<String>,
    params: Result<Query<Vec<(String, String)>>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let _admitted = admit(&r)?;
    let id = parse_id(&id)?;
    let Query(params) = params.map_err(|e| Problem::bad_request("bad-request", e.body_text()))?;
    let mut tokens = Vec::new();
    for (key, value) in params {
        if key != "consistent_with" {
            return Err(Problem::bad_request(
                "bad-request",
                format!("unknown query parameter {key:?} (this route takes consistent_with)"),
            ));
        }
        tokens.extend(value.split(',').filter(|t| !t.trim().is_empty()).map(|t| t.trim().to_string()));
    }
    let tokens = parse_tokens(&r, tokens.iter().map(String::as_str))?;
    let Some(e) = r.get(&id, &tokens).await? else {
        return Err(Problem::not_found(format!("no entity {id}")));
    };
    let etag = format!("\"{}\"", e.version);
    let unchanged = headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()).is_some_and(|v| {
        v.split(',').map(|t| t.trim()).any(|t| t == "*" || t.strip_prefix("W/").unwrap_or(t) == etag)
    });
    if unchanged {
        return Ok((StatusCode::NOT_MODIFIED, [(header::ETAG, etag)]).into_response());
    }
    Ok(([(header::ETAG, etag)], Json(EntityJson::from(&e))).into_response())
}

/// Write tokens as a read takes them (as a query's `consistent_with`: at
/// most `reader.max_in`, each a `write_token` of a write response).
fn parse_tokens<'a>(r: &Reader, texts: impl ExactSizeIterator<Item = &'a str>) -> Result<Tokens, Problem> {
    let max = r.settings().reader.max_in;
    if texts.len() > max {
        return Err(Problem::bad_request(
            "bad-request",
            format!("\"consistent_with\" takes at most {max} tokens"),
        ));
    }
    let parsed = texts
        .map(|t| query::parse_write_token(t).ok_or(ReadError::Query(query::QueryError::BadWriteToken)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tokens::new(&parsed))
}

/// A read slot (reader.max_concurrent), or 429.
fn admit(r: &Reader) -> Result<tokio::sync::OwnedSemaphorePermit, Problem> {
    r.admit().ok_or_else(|| Problem::overloaded("reads", r.settings().reader.max_concurrent))
}

async fn get_many(State(r): State<Reader>, body: Body) -> Result<Response, Problem> {
    let _admitted = admit(&r)?;
    let doc = read_json(body, MAX_REQUEST_BYTES, r.settings().http.request_timeout()).await?;
    let Some(JsonValue::Array(raw)) = doc.get("ids") else {
        return Err(Problem::bad_request("bad-request", "the body must be {\"ids\": [\"<id>\", ...]}"));
    };
    let max = r.settings().reader.max_batch_get;
    if raw.len() > max {
        return Err(Problem::bad_request("too-many-ids", format!("at most {max} ids per request")));
    }
    let ids = raw
        .iter()
        .map(|v| {
            v.as_str().ok_or_else(|| Problem::bad_request("bad-id", "ids must be strings")).and_then(parse_id)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tokens = match doc.get("consistent_with") {
        None | Some(JsonValue::Null) => Tokens::default(),
        Some(JsonValue::Array(list)) => {
            let texts = list.iter().map(|t| t.as_str().unwrap_or(""));
            parse_tokens(&r, texts)?
        }
        Some(_) => {
            return Err(Problem::bad_request(
                "bad-request",
                "\"consistent_with\" must be a list of write tokens",
            ))
        }
    };
    let items = r.get_many(&ids, &tokens).await?;
    Ok(Json(Items { items: items.iter().map(EntityJson::from).collect() }).into_response())
}

async fn run_query(State(r): State<Reader>, body: Body) -> Result<Response, Problem> {
    let _admitted = admit(&r)?;
    let doc = read_json(body, MAX_REQUEST_BYTES, r.settings().http.request_timeout()).await?;
    let q = query::parse(doc, &r.settings().reader).map_err(ReadError::from)?;
    let metas = r.index_metas().await.map_err(ReadError::from)?;
    // Registered, not dropped, in a stable order (the planner breaks ties by it).
    let mut live: Vec<&IndexMeta> = metas.values().filter(|m| m.state != IndexState::Dropping).collect();
    live.sort_by(|a, b| a.spec.table.cmp(&b.spec.table));
    let specs: Vec<schemas::IndexSpec> = live.iter().map(|m| m.spec.clone()).collect();
    let plan = query::plan(&q, &specs, &r.settings().reader).map_err(ReadError::from)?;
    let state = metas.get(&plan.spec.table).map(|m| m.state);
    if state != Some(IndexState::Active) && !q.allow_partial {
        let shown = state.map_or("NOT REGISTERED (run bagstore migrate)", |s| s.as_str());
        return Err(ReadError::IndexNotReady { table: plan.spec.table.clone(), state: shown.into() }.into());
    }
    let timeout = Duration::from_millis(r.settings().reader.query_timeout_ms);
    let out = r.run(&plan, &q, tokio::time::Instant::now() + timeout).await?;
    // A unique index is written with each write: never behind.
    let (lag_ms, applied_through_us) = match plan.spec.unique {
        true => (0, None),
        false => {
            let f = r.freshness(&plan.spec.table).await.map_err(ReadError::from)?;
            (f.lag_ms(), f.applied_through_us)
        }
    };
    // Every property of a unique index fixed to one value: one key, so
    // at most one entity.
    let at_most_one =
        plan.spec.unique && plan.prefix_len == plan.spec.properties.len() && plan.prefixes.len() <= 1;
    Ok(Json(QueryAnswer {
        items: out.items.iter().map(EntityJson::from).collect(),
        index: &plan.spec.table,
        next_page_token: out.next_page_token.as_deref(),
        index_lag_ms: Some(lag_ms),
        index_applied_through_us: applied_through_us,
        explain: json!({
            "prefixes": plan.prefixes.len(),
            "range": plan.range.is_some(),
            "order": if plan.descending { "desc" } else { "asc" },
            "shards_touched": out.shards_touched,
            "index_rows_read": out.index_rows,
            "dropped_by_refilter": out.dropped,
            "unique": plan.spec.unique,
            "at_most_one": at_most_one,
        }),
    })
    .into_response())
}

/// The cluster's layout: the same document as `bagstore shards list --json`.
async fn list_shards(State(r): State<Reader>) -> Result<Json<service::cluster::ShardsReport>, Problem> {
    Ok(Json(service::cluster::report(r.shards()).await.map_err(ReadError::from)?))
}

async fn list_indexes(State(r): State<Reader>) -> Result<Json<JsonValue>, Problem> {
    let metas = catalog::list_index_meta(r.shards()).await.map_err(ReadError::from)?;
    let indexes: Vec<JsonValue> = metas
        .iter()
        .map(|m| {
            let fraction = if m.state == IndexState::Active || m.rows_total == 0 {
                1.0
            } else {
                (m.rows_done as f64 / m.rows_total as f64).min(1.0)
            };
            let mut entry = json!({
                "table": m.spec.table,
                "properties": m.spec.properties,
                "shard_on": m.spec.shard_on(),
                "match_on": m.spec.match_on,
                "unique": m.spec.unique,
                "state": m.state.as_str(),
                "backfill": {"fraction": fraction, "rows_done": m.rows_done, "rows_total": m.rows_total},
            });
            if let Some(c) = &m.conflicts {
                entry["conflicts"] = c.clone();
            }
            entry
        })
        .collect();
    Ok(Json(json!({ "indexes": indexes })))
}

/// Stops maintaining an index and drops its table on every shard.
async fn drop_index(State(r): State<Reader>, Path(table): Path<String>) -> Result<Json<JsonValue>, Problem> {
    // Over HTTP, an index already being dropped is not found (as before).
    let metas = catalog::list_index_meta(r.shards()).await.map_err(ReadError::from)?;
    let is_live = metas.iter().any(|m| m.spec.table == table && m.state != IndexState::Dropping);
    if !is_live {
        return Err(ReadError::Store(StoreError::NoSuchIndex { table }).into());
    }
    catalog::drop_index(r.shards(), &table).await.map_err(ReadError::from)?;
    Ok(Json(json!({"table": table, "state": "DROPPING", "shards": r.shards().count()})))
}

/// Per index: events not yet applied (from Kafka, when the reader knows the
/// brokers) and time lag (from MySQL).
async fn lag(State(r): State<Reader>) -> Result<Json<JsonValue>, Problem> {
    let metas = catalog::list_index_meta(r.shards()).await.map_err(ReadError::from)?;
    let k = &r.settings().kafka;
    let mut out = Vec::new();
    for m in metas.iter().filter(|m| m.state != IndexState::Dropping) {
        let table = &m.spec.table;
        if m.spec.unique {
            // Written with each write: no consumer, no lag.
            out.push(json!({"index": table, "state": m.state.as_str(), "lag_ms": 0, "unique": true}));
            continue;
        }
        let fresh = r.freshness(table).await.map_err(ReadError::from)?;
        let events = if k.brokers.is_empty() {
            None
        } else {
            kafka::group_lag(k, &k.group_for(table)).await.ok().map(|parts| {
                let per: Vec<JsonValue> =
                    parts.iter().map(|p| json!({"partition": p.partition, "lag": p.lag()})).collect();
                (parts.iter().map(|p| p.lag()).sum::<i64>(), per)
            })
        };
        out.push(json!({
            "index": table,
            "state": m.state.as_str(),
            "lag_events": events.as_ref().map(|e| e.0),
            "partitions": events.map(|e| e.1),
            "lag_ms": fresh.lag_ms(),
            "applied_through_us": fresh.applied_through_us,
        }));
    }
    let ingest = &r.settings().ingest;
    let ingest = if ingest.enabled {
        let group = k.ingest_group();
        let parts = if k.brokers.is_empty() {
            None
        } else {
            kafka::group_lag_on(k, &group, &ingest.topic).await.ok()
        };
        json!({
            "group": group,
            "topic": ingest.topic,
            "lag_events": parts.as_ref().map(|p| p.iter().map(|p| p.lag()).sum::<i64>()),
            "partitions": parts.map(|p| p.iter().map(|p| json!({"partition": p.partition, "lag": p.lag()})).collect::<Vec<_>>()),
        })
    } else {
        JsonValue::Null
    };
    Ok(Json(json!({ "indexes": out, "ingest": ingest })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::query::Plan;
    use serde_json::Value as Json;

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

    /// A query through the parser and the planner, refusals as the HTTP
    /// edge answers them.
    fn plan_of(q: Json) -> Result<Plan, Problem> {
        let s = settings();
        let parsed = query::parse(q, &s.reader).map_err(ReadError::from)?;
        Ok(query::plan(&parsed, &s.indexes, &s.reader).map_err(ReadError::from)?)
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
