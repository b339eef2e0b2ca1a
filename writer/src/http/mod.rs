//! Writer routes. Parsing and validation happen here, before any database
//! work: a rejected request writes nothing.
//!
//! - `POST /v1/entities` — create or replace (id from the body or generated;
//!   with an `Idempotency-Key` and no id, derived from the key)
//! - `PUT /v1/entities/{id}` — create or replace, with `If-Match` / `If-None-Match: *`
//! - `PATCH /v1/entities/{id}` — a merge patch (`application/merge-patch+json`)
//!   or `$`-operators (any other type), applied in the write transaction;
//!   `?upsert=true` creates a missing entity
//! - `DELETE /v1/entities/{id}`
//! - `POST /v1/entities/batch` — `{"entities": [...]}`, one transaction per shard
//!
//! Every one of them takes an `Idempotency-Key` (a batch's guards each item).
//!
//! Layout: this file, the routes; `parse`, reading a request;
//! `problem`, the answers and the problem documents.

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use schemas::EntityId;
use schemas::{idempotency, patch};
use serde_json::{json, Value as JsonValue};
use service::http::{parse_id, read_json, Problem, Role, Routes};
use storage::write::{Guard, Precondition, WriteError};

use crate::{Admitted, Writer};

mod parse;
mod problem;

pub(crate) use parse::entity_body;
pub use parse::MAX_PROPERTY_NAME_BYTES;
use parse::{guard, idempotency_key, precondition, upsert_param};
pub(crate) use problem::write_problem;
use problem::{answer, outcome_json};

/// A batch body may be this many times the single-entity limit.
pub const BATCH_BODY_FACTOR: usize = 16;

/// The writer's routes; every one needs a write token.
pub fn routes(writer: Writer) -> Routes {
    Routes::new()
        .route(Method::POST, "/v1/entities", Role::Write, create)
        .route(Method::POST, "/v1/entities/batch", Role::Write, batch)
        .route(Method::PUT, "/v1/entities/{id}", Role::Write, replace)
        .route(Method::PATCH, "/v1/entities/{id}", Role::Write, patch)
        .route(Method::DELETE, "/v1/entities/{id}", Role::Write, remove)
        .with_state(writer)
}

/// One admission permit per write, or 429 (see [`Writer::admit`]).
fn admit(w: &Writer, n: usize) -> Result<Admitted, Problem> {
    w.admit(n).ok_or_else(|| Problem::overloaded("writes", w.settings().writer.max_pending_writes))
}

async fn create(State(w): State<Writer>, headers: HeaderMap, body: Body) -> Result<Response, Problem> {
    let _admitted = admit(&w, 1)?;
    let mut pre = precondition(&headers)?;
    let key = idempotency_key(&headers)?;
    let max = w.settings().writer.max_body_bytes;
    let doc = read_json(body, max, w.settings().http.request_timeout()).await?;
    if let Some(k) = &key {
        pre.guard = Some(guard(k, "POST /v1/entities", &doc));
    }
    let (id, bag) = entity_body(doc, None)?;
    // A keyed create without an id gets one derived from the key, so its
    // retry finds the same entity (and the shard holding the key's record).
    let id = id.unwrap_or_else(|| key.as_deref().map_or_else(EntityId::random, idempotency::entity_id_for));
    let o = w.put(id, bag, pre).await.map_err(write_problem)?;
    Ok(answer(o, if o.created { StatusCode::CREATED } else { StatusCode::OK }))
}

async fn replace(
    State(w): State<Writer>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let _admitted = admit(&w, 1)?;
    let id = parse_id(&id)?;
    let mut pre = precondition(&headers)?;
    let key = idempotency_key(&headers)?;
    let max = w.settings().writer.max_body_bytes;
    let doc = read_json(body, max, w.settings().http.request_timeout()).await?;
    if let Some(k) = &key {
        pre.guard = Some(guard(k, &format!("PUT /v1/entities/{}", id.to_hex()), &doc));
    }
    let (body_id, bag) = entity_body(doc, None)?;
    if body_id.is_some_and(|b| b != id) {
        return Err(Problem::bad_request(
            "id-mismatch",
            "the \"id\" in the body differs from the id in the path",
        ));
    }
    let o = w.put(id, bag, pre).await.map_err(write_problem)?;
    Ok(answer(o, if o.created { StatusCode::CREATED } else { StatusCode::OK }))
}

/// `PATCH /v1/entities/{id}`: the document is parsed here (a bad one is a
/// 400 and writes nothing); it is applied to the row the transaction locked.
/// Its form follows `schemas::patch::parse`: `Content-Type:
/// application/merge-patch+json` declares a merge patch, and without it the
/// keys decide.
async fn patch(
    State(w): State<Writer>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let _admitted = admit(&w, 1)?;
    let id = parse_id(&id)?;
    let mut pre = precondition(&headers)?;
    let upsert = upsert_param(query.as_deref())?;
    let key = idempotency_key(&headers)?;
    let max = w.settings().writer.max_body_bytes;
    let doc = read_json(body, max, w.settings().http.request_timeout()).await?;
    let declared = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.trim().to_ascii_lowercase().starts_with("application/merge-patch+json"))
        .then_some(patch::Form::Merge);
    let (form, parsed) =
        patch::parse(&doc, declared).map_err(|e| Problem::bad_request("bad-patch", e.to_string()))?;
    if let Some(k) = &key {
        let merge = form == patch::Form::Merge;
        let route = format!("PATCH /v1/entities/{} merge={merge} upsert={upsert}", id.to_hex());
        pre.guard = Some(guard(k, &route, &doc));
    }
    let o = w.patch(id, parsed, upsert, pre).await.map_err(write_problem)?;
    Ok(answer(o, if o.created { StatusCode::CREATED } else { StatusCode::OK }))
}

async fn remove(
    State(w): State<Writer>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let _admitted = admit(&w, 1)?;
    let id = parse_id(&id)?;
    let mut pre = precondition(&headers)?;
    if pre.if_absent {
        return Err(Problem::bad_request("bad-precondition", "If-None-Match makes no sense on DELETE"));
    }
    if let Some(k) = idempotency_key(&headers)? {
        pre.guard = Some(guard(&k, &format!("DELETE /v1/entities/{}", id.to_hex()), &JsonValue::Null));
    }
    let o = w.delete(id, pre).await.map_err(write_problem)?;
    Ok(answer(o, StatusCode::OK))
}

/// `POST /v1/entities/batch`. With an `Idempotency-Key`, each item is
/// guarded on its own (a key per item, derived from the request's key and
/// the item's place, recorded in the transaction that writes the item), so
/// a retry answers every item as the first attempt did and writes only
/// what that attempt did not; an item without an id gets one derived from
/// the key and its place. The same key with another body is a 422 for the
/// whole batch, and nothing is written.
async fn batch(State(w): State<Writer>, headers: HeaderMap, body: Body) -> Result<Response, Problem> {
    let key = idempotency_key(&headers)?;
    // One permit before the body is read (so a flood of batches holds
    // bounded memory), the others once the entities are counted.
    let _first = admit(&w, 1)?;
    let max = w.settings().writer.max_body_bytes;
    let max_batch = w.settings().writer.max_batch;
    let doc =
        read_json(body, max.saturating_mul(BATCH_BODY_FACTOR), w.settings().http.request_timeout()).await?;
    let Some(JsonValue::Array(items)) = doc.get("entities").cloned() else {
        return Err(Problem::bad_request("bad-batch", "the body must be {\"entities\": [ {...}, ... ]}"));
    };
    if items.len() > max_batch {
        return Err(Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "batch-too-large",
            "Batch too large",
            format!("{} entities in one batch, over the limit of {max_batch}", items.len()),
        ));
    }
    let _rest = admit(&w, items.len().saturating_sub(1))?;
    // Every item's record holds the hash of the whole request.
    let request = key.as_ref().map(|_| {
        idempotency::request_hash("POST /v1/entities/batch", &serde_json::to_vec(&doc).unwrap_or_default())
    });
    // Each item is validated on its own; invalid ones get their problem and
    // are not written, the others are.
    let mut results: Vec<Option<JsonValue>> = vec![None; items.len()];
    let mut valid = Vec::new();
    let mut positions = Vec::new();
    for (i, item) in items.into_iter().enumerate() {
        match entity_body(item, Some(max)) {
            Ok((id, bag)) => {
                let (id, pre) = match (&key, request) {
                    (Some(k), Some(request)) => (
                        id.unwrap_or_else(|| idempotency::item_entity_id(k, i)),
                        Precondition {
                            guard: Some(Guard { key: idempotency::item_key_hash(k, i), request }),
                            ..Precondition::default()
                        },
                    ),
                    _ => (id.unwrap_or_else(EntityId::random), Precondition::default()),
                };
                valid.push((id, bag, pre));
                positions.push(i);
            }
            Err(p) => results[i] = Some(p.to_json()),
        }
    }
    if key.is_some() && w.keys_reused(&valid).await.map_err(|e| write_problem(WriteError::Store(e)))? {
        return Err(write_problem(WriteError::KeyReused));
    }
    for (i, r) in positions.into_iter().zip(w.put_batch(valid).await) {
        results[i] = Some(match r {
            Ok(o) => outcome_json(&o),
            Err(e) => write_problem(e).to_json(),
        });
    }
    let results: Vec<JsonValue> = results.into_iter().map(|r| r.unwrap_or(JsonValue::Null)).collect();
    Ok(Json(json!({ "results": results })).into_response())
}
