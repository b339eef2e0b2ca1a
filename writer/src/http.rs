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

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use schemas::value::{bag_from_json_map, Bag};
use schemas::EntityId;
use schemas::{idempotency, patch};
use serde_json::{json, Value as JsonValue};
use service::http::{parse_id, read_json, Problem, Role, Routes};

use crate::write::{Guard, Outcome, Precondition, WriteError};
use crate::Writer;

/// Longest accepted top-level property name, bytes.
pub const MAX_PROPERTY_NAME_BYTES: usize = 255;
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

/// `If-Match: "3"` (or `3`, or `W/"3"`), `If-Match: *` (must exist) and
/// `If-None-Match: *`.
fn precondition(headers: &HeaderMap) -> Result<Precondition, Problem> {
    let mut pre = Precondition::default();
    if let Some(v) = headers.get(header::IF_MATCH) {
        let text = v.to_str().unwrap_or("").trim();
        if text == "*" {
            pre.if_exists = true;
            return if_none_match(headers, pre);
        }
        let text = text.strip_prefix("W/").unwrap_or(text).trim_matches('"');
        pre.if_version = Some(text.parse().map_err(|_| {
            Problem::bad_request("bad-precondition", "If-Match must be a version number such as \"3\", or *")
        })?);
    }
    if_none_match(headers, pre)
}

fn if_none_match(headers: &HeaderMap, mut pre: Precondition) -> Result<Precondition, Problem> {
    if let Some(v) = headers.get(header::IF_NONE_MATCH) {
        if v.to_str().map(str::trim).ok() != Some("*") {
            return Err(Problem::bad_request("bad-precondition", "If-None-Match supports only *"));
        }
        pre.if_absent = true;
    }
    Ok(pre)
}

/// Turns a JSON body into `(id from the body, properties without "id")`.
/// `max_bytes` is the entity limit to check, for a batch item; a single
/// entity's request body was already held to that limit as it was read.
pub(crate) fn entity_body(
    v: JsonValue,
    max_bytes: Option<usize>,
) -> Result<(Option<EntityId>, Bag), Problem> {
    let JsonValue::Object(mut map) = v else {
        return Err(Problem::bad_request("not-an-object", "an entity must be a JSON object of properties"));
    };
    let id = match map.remove("id") {
        None => None,
        Some(JsonValue::String(s)) => Some(parse_id(&s)?),
        Some(_) => {
            return Err(Problem::bad_request("bad-id", "\"id\" must be a string of 32 hex digits or a UUID"))
        }
    };
    for name in map.keys() {
        if name.is_empty() || name.len() > MAX_PROPERTY_NAME_BYTES || name.chars().any(char::is_control) {
            return Err(Problem::bad_request(
                "bad-property-name",
                format!(
                    "property name {:?} must be 1 to {MAX_PROPERTY_NAME_BYTES} bytes without control characters",
                    name.chars().take(80).collect::<String>()
                ),
            ));
        }
    }
    // The single-entity limit also applies inside a batch.
    if let Some(max_bytes) = max_bytes {
        let size = serde_json::to_vec(&map).map(|b| b.len()).unwrap_or(usize::MAX);
        if size > max_bytes {
            return Err(Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "entity-too-large",
                "Entity too large",
                format!("the entity takes {size} bytes of JSON, over the {max_bytes} byte limit"),
            ));
        }
    }
    let bag = bag_from_json_map(&map).map_err(|e| Problem::bad_request("bad-value", e.to_string()))?;
    Ok((id, bag))
}

/// `write_token` is what a query passes in `consistent_with` to see this
/// write through an index (read-your-writes).
fn outcome_json(o: &Outcome) -> JsonValue {
    json!({"id": o.id.to_hex(), "version": o.version, "write_token": format!("{}.{}", o.id.to_hex(), o.version)})
}

/// The answer to a write: `ETag` always, `Location` when it created.
fn answer(o: Outcome, status: StatusCode) -> Response {
    let etag = format!("\"{}\"", o.version);
    let mut r = (status, [(header::ETAG, etag)], Json(outcome_json(&o))).into_response();
    if status == StatusCode::CREATED {
        let location = format!("/v1/entities/{}", o.id.to_hex());
        r.headers_mut().insert(header::LOCATION, location.parse().expect("hex is a valid header value"));
    }
    r
}

pub(crate) fn write_problem(e: WriteError) -> Problem {
    match e {
        WriteError::VersionConflict { expected, actual } => Problem::new(
            StatusCode::PRECONDITION_FAILED,
            "version-conflict",
            "Version conflict",
            format!("If-Match asked for version {expected}"),
        )
        .with("current_version", actual.map_or(JsonValue::Null, JsonValue::from)),
        WriteError::AlreadyExists { current } => Problem::new(
            StatusCode::PRECONDITION_FAILED,
            "already-exists",
            "Entity exists",
            "If-None-Match: * was given and the entity exists",
        )
        .with("current_version", current),
        WriteError::NotFound | WriteError::NotExpired => Problem::not_found("no entity with this id"),
        WriteError::BadExpiry(b) => {
            Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "bad-expiry", "Bad expiry time", b.to_string())
                .with("property", b.property)
        }
        WriteError::KeyReused => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency-key-reused",
            "Idempotency-Key reused",
            "this Idempotency-Key was used within the window for a request with another body",
        ),
        WriteError::PatchClash(c) => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "patch-conflict",
            "The patch does not fit the entity",
            c.to_string(),
        )
        .with("property", c.property),
        WriteError::TooLarge { .. } => {
            Problem::new(StatusCode::PAYLOAD_TOO_LARGE, "entity-too-large", "Entity too large", e.to_string())
        }
        WriteError::Store(ref s) if s.is_transient() => Problem::unavailable(&e),
        WriteError::ShardFailed { ref source, .. } if source.is_transient() => Problem::unavailable(&e),
        WriteError::Store(_) | WriteError::ShardFailed { .. } => Problem::internal(&e),
    }
}

/// One admission permit per write, or 429 (see [`Writer::admit`]).
fn admit(w: &Writer, n: usize) -> Result<crate::Admitted, Problem> {
    w.admit(n).ok_or_else(|| Problem::overloaded("writes", w.settings().writer.max_pending_writes))
}

/// The `Idempotency-Key` header, checked; None when absent.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, Problem> {
    let Some(v) = headers.get("idempotency-key") else { return Ok(None) };
    let key = v
        .to_str()
        .map_err(|_| Problem::bad_request("bad-idempotency-key", "Idempotency-Key must be ASCII"))?;
    idempotency::check_key(key).map_err(|e| Problem::bad_request("bad-idempotency-key", e))?;
    Ok(Some(key.to_string()))
}

/// The guard of a keyed request: the key's hash and the request's (its
/// route and the canonical JSON of its body).
fn guard(key: &str, route: &str, doc: &JsonValue) -> Guard {
    let body = serde_json::to_vec(doc).unwrap_or_default();
    Guard { key: idempotency::key_hash(key), request: idempotency::request_hash(route, &body) }
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
    let pre = precondition(&headers)?;
    let max = w.settings().writer.max_body_bytes;
    let (body_id, bag) = entity_body(read_json(body, max, w.settings().http.request_timeout()).await?, None)?;
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

/// `upsert=true` or `upsert=false` in the query string; nothing else.
fn upsert_param(query: Option<&str>) -> Result<bool, Problem> {
    let mut upsert = false;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair {
            "upsert=true" => upsert = true,
            "upsert=false" => upsert = false,
            _ => {
                return Err(Problem::bad_request(
                    "bad-parameter",
                    format!("unknown query parameter {pair:?}: PATCH takes only upsert=true or upsert=false"),
                ))
            }
        }
    }
    Ok(upsert)
}

async fn remove(
    State(w): State<Writer>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let _admitted = admit(&w, 1)?;
    let id = parse_id(&id)?;
    let pre = precondition(&headers)?;
    if pre.if_absent {
        return Err(Problem::bad_request("bad-precondition", "If-None-Match makes no sense on DELETE"));
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
