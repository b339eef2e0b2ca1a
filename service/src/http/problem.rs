//! Problem documents (RFC 9457 style): the one shape of every HTTP error
//! answer. Domain errors become problems here, at the edge, and nowhere else.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value as Json};

/// An error answer: `application/problem+json` with `type`, `title`,
/// `status`, `detail`, plus any extra members (e.g. `current_version`).
#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    /// Short slug; the `type` member is `/problems/<kind>`.
    pub kind: &'static str,
    pub title: &'static str,
    pub detail: String,
    pub extra: Map<String, Json>,
    /// Seconds for a `Retry-After` header (429, 503).
    pub retry_after: Option<u32>,
}

impl Problem {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Problem { status, kind, title, detail: detail.into(), extra: Map::new(), retry_after: None }
    }

    /// Adds `Retry-After: <secs>`.
    pub fn retry_after(mut self, secs: u32) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// 429: more requests are in hand than this process takes at once.
    pub fn overloaded(what: &str, bound: usize) -> Self {
        Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            "overloaded",
            "Too many requests",
            format!("{bound} {what} are already in hand; retry after the time in Retry-After"),
        )
        .with("limit", bound)
        .retry_after(1)
    }

    pub fn with(mut self, key: &str, value: impl Into<Json>) -> Self {
        self.extra.insert(key.to_string(), value.into());
        self
    }

    pub fn bad_request(kind: &'static str, detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::BAD_REQUEST, kind, "Bad request", detail)
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::NOT_FOUND, "not-found", "Not found", detail)
    }

    /// A storage failure that may pass (a shard unreachable, a connection
    /// lost, a lock wait): 503 with `Retry-After`. The cause chain is
    /// logged here, once; the caller gets a generic sentence.
    pub fn unavailable(err: &(dyn std::error::Error + 'static)) -> Self {
        tracing::error!(error = %chain(err), "request failed");
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "Storage unavailable",
            "a shard could not complete the request: a read may simply be retried; a write may or may \
             not have been committed, so read it back before retrying one with If-Match or If-None-Match",
        )
        .retry_after(1)
    }

    /// A failure that is ours and will not pass by retrying (a statement
    /// refused, stored data unreadable): 500, logged with its cause chain.
    pub fn internal(err: &(dyn std::error::Error + 'static)) -> Self {
        tracing::error!(error = %chain(err), "request failed");
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            "the request failed on our side; the failure is logged",
        )
    }

    pub fn to_json(&self) -> Json {
        let mut m = Map::new();
        m.insert("type".into(), json!(format!("/problems/{}", self.kind)));
        m.insert("title".into(), json!(self.title));
        m.insert("status".into(), json!(self.status.as_u16()));
        m.insert("detail".into(), json!(self.detail));
        for (k, v) in &self.extra {
            m.insert(k.clone(), v.clone());
        }
        Json::Object(m)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.to_json())).into_response();
        resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(secs) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::REQUEST_TIMEOUT {
            // The rest of the body may still be on its way; the connection
            // cannot carry another request (RFC 9110 §15.5.9).
            resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// An error and its sources, `: `-joined.
fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut chain = err.to_string();
    let mut src = err.source();
    while let Some(s) = src {
        chain.push_str(": ");
        chain.push_str(&s.to_string());
        src = s.source();
    }
    chain
}

/// Answers 405 problems for a known route with another method.
pub async fn method_not_allowed() -> Problem {
    Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        "this route does not take this HTTP method; see /v1/openapi.json",
    )
}

/// Answers 404 problems for unknown routes instead of an empty body.
pub async fn not_found() -> Problem {
    Problem::not_found("no such route")
}
