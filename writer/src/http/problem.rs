//! What a write answers: the success document, and the problem document
//! of each [`WriteError`] (the one place a write's failure becomes HTTP).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value as JsonValue};
use service::http::Problem;
use storage::write::{Outcome, WriteError};
use storage::StoreError;

/// `write_token` is what a query passes in `consistent_with` to see this
/// write through an index (read-your-writes).
pub(super) fn outcome_json(o: &Outcome) -> JsonValue {
    json!({"id": o.id.to_hex(), "version": o.version, "write_token": format!("{}.{}", o.id.to_hex(), o.version)})
}

/// The answer to a write: `ETag` always, `Location` when it created.
pub(super) fn answer(o: Outcome, status: StatusCode) -> Response {
    let etag = format!("\"{}\"", o.version);
    let mut r = (status, [(header::ETAG, etag)], Json(outcome_json(&o))).into_response();
    if status == StatusCode::CREATED {
        let location = format!("/v1/entities/{}", o.id.to_hex());
        r.headers_mut().insert(header::LOCATION, location.parse().expect("hex is a valid header value"));
    }
    r
}

/// The problem document of a write that failed: a refusal is a 4xx its
/// caller can act on; a storage failure is a 503 when trying again later
/// may pass, else a 500.
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
        WriteError::UniqueViolation { index, existing_id } => Problem::new(
            StatusCode::CONFLICT,
            "unique-violation",
            "Unique key taken",
            format!("another entity holds this key of unique index {index}"),
        )
        .with("index", index)
        .with("existing_id", existing_id.to_hex()),
        WriteError::TooLarge { .. } => {
            Problem::new(StatusCode::PAYLOAD_TOO_LARGE, "entity-too-large", "Entity too large", e.to_string())
        }
        WriteError::Store(StoreError::NoAcknowledgingReplica { .. }) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no-acknowledging-replica",
            "No replica acknowledges writes",
            e.to_string(),
        )
        .retry_after(1),
        WriteError::OutcomeUnknown { .. } => {
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, "outcome-unknown", "Outcome unknown", e.to_string())
                .retry_after(1)
        }
        WriteError::Store(_) | WriteError::ShardFailed { .. } if e.is_transient() => Problem::unavailable(&e),
        WriteError::Store(_) | WriteError::ShardFailed { .. } => Problem::internal(&e),
    }
}
