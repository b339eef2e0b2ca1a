//! Request bodies and path ids: bounded in size and in time, parsed into
//! the model, or a 4xx problem.

use axum::body::Body;
use axum::http::StatusCode;
use serde_json::Value as Json;
use std::time::Duration;

use super::Problem;

/// An id from a path or body, or a 400 `bad-id` problem.
pub fn parse_id(s: &str) -> Result<schemas::EntityId, Problem> {
    schemas::EntityId::parse(s).map_err(|e| Problem::bad_request("bad-id", e.to_string()))
}

/// Reads at most `limit` bytes within `timeout` and parses them as JSON.
///
/// The handler runs once the headers are in, so `timeout` bounds how long a
/// client may take to send its body: one that sends it too slowly, or
/// declares a `Content-Length` and never finishes, gets a 408 instead of
/// holding a connection and a task forever (`http.request_timeout_ms`).
pub async fn read_json(body: Body, limit: usize, timeout: Duration) -> Result<Json, Problem> {
    let bytes = match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(_)) => {
            return Err(Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "Body too large",
                format!("the request body exceeds the {limit} byte limit"),
            ))
        }
        Err(_) => {
            return Err(Problem::new(
                StatusCode::REQUEST_TIMEOUT,
                "request-timeout",
                "Request timeout",
                format!("the request body did not arrive within {} ms", timeout.as_millis()),
            ))
        }
    };
    serde_json::from_slice(&bytes)
        .map_err(|e| Problem::bad_request("malformed-json", format!("the body is not valid JSON: {e}")))
}
