//! Reader routes and JSON shapes.
//!
//! - `GET /v1/entities/{id}` → `{"id","version","updated","properties"}`
//! - `POST /v1/entities/get` `{"ids": [...]}` → `{"items": [...]}`
//! - `POST /v1/query` → `{"items", "index", "next_page_token", "explain"}`
//! - `GET /v1/indexes` → `{"indexes": [...]}`

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use schemas::store::IndexState;
use schemas::value::BagJson;
use schemas::web::{parse_id, read_json, Problem};
use serde::Serialize;
use serde_json::{json, Value as JsonValue};
use std::time::Duration;

use crate::execute::{Entity, ReadError};
use crate::query;
use crate::Reader;

/// Query and id-list bodies are small; this bounds them.
const MAX_REQUEST_BYTES: usize = 1 << 20;

pub fn router(reader: Reader) -> Router {
    Router::new()
        .route("/v1/entities/{id}", get(get_one))
        .route("/v1/entities/get", post(get_many))
        .route("/v1/query", post(run_query))
        .route("/v1/indexes", get(list_indexes))
        .route("/v1/indexes/{table}", axum::routing::delete(drop_index))
        .route("/v1/lag", get(lag))
        .with_state(reader)
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

fn read_problem(e: ReadError) -> Problem {
    Problem::internal(&e)
}

async fn get_one(State(r): State<Reader>, Path(id): Path<String>) -> Result<Response, Problem> {
    let id = parse_id(&id)?;
    match r.get(&id).await.map_err(read_problem)? {
        Some(e) => Ok(Json(EntityJson::from(&e)).into_response()),
        None => Err(Problem::not_found(format!("no entity {id}"))),
    }
}

async fn get_many(State(r): State<Reader>, body: Body) -> Result<Response, Problem> {
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
    let items = r.get_many(&ids).await.map_err(read_problem)?;
    Ok(Json(Items { items: items.iter().map(EntityJson::from).collect() }).into_response())
}

async fn run_query(State(r): State<Reader>, body: Body) -> Result<Response, Problem> {
    let doc = read_json(body, MAX_REQUEST_BYTES, r.settings().http.request_timeout()).await?;
    let q = query::parse(doc, &r.settings().reader)?;
    let metas = r.index_metas().await.map_err(|e| Problem::internal(&e))?;
    // Registered, not dropped, in a stable order (the planner breaks ties by it).
    let mut live: Vec<&schemas::store::IndexMeta> =
        metas.values().filter(|m| m.state != IndexState::Dropping).collect();
    live.sort_by(|a, b| a.spec.table.cmp(&b.spec.table));
    let specs: Vec<schemas::IndexSpec> = live.iter().map(|m| m.spec.clone()).collect();
    let plan = query::plan(&q, &specs, &r.settings().reader)?;
    let state = metas.get(&plan.spec.table).map(|m| m.state);
    if state != Some(IndexState::Active) && !q.allow_partial {
        let shown = state.map_or("NOT REGISTERED (run bagstore migrate)", |s| s.as_str());
        return Err(Problem::new(
            StatusCode::CONFLICT,
            "index-not-ready",
            "Index not ready",
            format!(
                "index {:?} is {shown}; its results may be incomplete. Pass \"allow_partial\": true to accept that",
                plan.spec.table
            ),
        )
        .with("index", plan.spec.table.clone())
        .with("state", shown));
    }
    let timeout = Duration::from_millis(r.settings().reader.query_timeout_ms);
    let deadline = tokio::time::Instant::now() + timeout;
    if !q.consistent_with.is_empty() {
        r.wait_applied(&plan.spec, &q.consistent_with, deadline).await?;
    }
    let out = tokio::time::timeout_at(deadline, r.run(&plan, &q)).await.map_err(|_| {
        Problem::new(
            StatusCode::GATEWAY_TIMEOUT,
            "query-timeout",
            "Query timed out",
            format!(
                "the query did not finish within {} ms; narrow it or lower its limit",
                timeout.as_millis()
            ),
        )
    })??;
    let freshness = r.freshness(&plan.spec.table).await.map_err(|e| Problem::internal(&e))?;
    Ok(Json(QueryAnswer {
        items: out.items.iter().map(EntityJson::from).collect(),
        index: &plan.spec.table,
        next_page_token: out.next_page_token.as_deref(),
        index_lag_ms: freshness.lag_ms,
        index_applied_through_us: freshness.applied_through_us,
        explain: json!({
            "prefixes": plan.prefixes.len(),
            "range": plan.range.is_some(),
            "order": if plan.descending { "desc" } else { "asc" },
            "shards_touched": out.shards_touched,
            "index_rows_read": out.index_rows,
            "dropped_by_refilter": out.dropped,
        }),
    })
    .into_response())
}

async fn list_indexes(State(r): State<Reader>) -> Result<Json<JsonValue>, Problem> {
    let metas =
        schemas::store::list_index_meta(r.shards().pool(0)).await.map_err(|e| Problem::internal(&e))?;
    let indexes: Vec<JsonValue> = metas
        .iter()
        .map(|m| {
            let fraction = if m.state == IndexState::Active || m.rows_total == 0 {
                1.0
            } else {
                (m.rows_done as f64 / m.rows_total as f64).min(1.0)
            };
            json!({
                "table": m.spec.table,
                "properties": m.spec.properties,
                "shard_on": m.spec.shard_on(),
                "match_on": m.spec.match_on,
                "state": m.state.as_str(),
                "backfill": {"fraction": fraction, "rows_done": m.rows_done, "rows_total": m.rows_total},
            })
        })
        .collect();
    Ok(Json(json!({ "indexes": indexes })))
}

/// Stops maintaining an index and drops its table on every shard.
async fn drop_index(State(r): State<Reader>, Path(table): Path<String>) -> Result<Json<JsonValue>, Problem> {
    let shards = r.shards();
    let metas = schemas::store::list_index_meta(shards.pool(0)).await.map_err(|e| Problem::internal(&e))?;
    if !metas.iter().any(|m| m.spec.table == table && m.state != IndexState::Dropping) {
        return Err(Problem::not_found(format!("no index named {table:?}")));
    }
    schemas::store::set_index_state(shards.pool(0), &table, IndexState::Dropping)
        .await
        .map_err(|e| Problem::internal(&e))?;
    for shard in 0..shards.count() {
        schemas::store::drop_index_table(shard, shards.pool(shard), &table)
            .await
            .map_err(|e| Problem::internal(&e))?;
    }
    Ok(Json(json!({"table": table, "state": "DROPPING", "shards": shards.count()})))
}

/// Per index: events not yet applied (from Kafka, when the reader knows the
/// brokers) and time lag (from MySQL).
async fn lag(State(r): State<Reader>) -> Result<Json<JsonValue>, Problem> {
    let metas =
        schemas::store::list_index_meta(r.shards().pool(0)).await.map_err(|e| Problem::internal(&e))?;
    let k = &r.settings().kafka;
    let mut out = Vec::new();
    for m in metas.iter().filter(|m| m.state != IndexState::Dropping) {
        let table = &m.spec.table;
        let fresh = r.freshness(table).await.map_err(|e| Problem::internal(&e))?;
        let events = if k.brokers.is_empty() {
            None
        } else {
            schemas::kafka::group_lag(k, &k.group_for(table)).await.ok().map(|parts| {
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
            "lag_ms": fresh.lag_ms,
            "applied_through_us": fresh.applied_through_us,
        }));
    }
    Ok(Json(json!({ "indexes": out })))
}
