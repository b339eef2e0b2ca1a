//! Reading a write request: its preconditions, its body, its
//! `Idempotency-Key`. Everything here runs before any database work, so a
//! rejected request writes nothing.

use axum::http::{header, HeaderMap, StatusCode};
use schemas::value::{bag_from_json_map, Bag};
use schemas::{idempotency, EntityId};
use serde_json::Value as JsonValue;
use service::http::{parse_id, Problem};
use storage::write::{Guard, Precondition};

/// Longest accepted top-level property name, bytes.
pub const MAX_PROPERTY_NAME_BYTES: usize = 255;

/// `If-Match: "3"` (or `3`, or `W/"3"`), `If-Match: *` (must exist) and
/// `If-None-Match: *`.
pub(super) fn precondition(headers: &HeaderMap) -> Result<Precondition, Problem> {
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

/// The `Idempotency-Key` header, checked; None when absent.
pub(super) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, Problem> {
    let Some(v) = headers.get("idempotency-key") else { return Ok(None) };
    let key = v
        .to_str()
        .map_err(|_| Problem::bad_request("bad-idempotency-key", "Idempotency-Key must be ASCII"))?;
    idempotency::check_key(key).map_err(|e| Problem::bad_request("bad-idempotency-key", e))?;
    Ok(Some(key.to_string()))
}

/// The guard of a keyed request: the key's hash and the request's (its
/// route and the canonical JSON of its body).
pub(super) fn guard(key: &str, route: &str, doc: &JsonValue) -> Guard {
    let body = serde_json::to_vec(doc).unwrap_or_default();
    Guard { key: idempotency::key_hash(key), request: idempotency::request_hash(route, &body) }
}

/// `upsert=true` or `upsert=false` in the query string; nothing else.
pub(super) fn upsert_param(query: Option<&str>) -> Result<bool, Problem> {
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
