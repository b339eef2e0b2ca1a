//! A request id per HTTP request, so one request can be followed through
//! the logs: the caller's `x-request-id` when it sent a sane one (so ids
//! can span services), a new one otherwise. It is returned in the response
//! header, and every log line written while the request runs, in handlers
//! and in storage calls, is inside a span carrying it.

use axum::extract::{MatchedPath, Request};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

pub const HEADER: &str = "x-request-id";

/// Middleware: see the module docs.
pub async fn request_id(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| schemas::id::hex(&rand_bytes()));
    let value = HeaderValue::from_str(&id).expect("visible ASCII");
    req.headers_mut().insert(HEADER, value.clone());
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_string();
    let span = tracing::info_span!("http", request_id = %id, method = %req.method(), route);
    let started = std::time::Instant::now();
    let mut resp = next.run(req).instrument(span.clone()).await;
    span.in_scope(|| {
        tracing::debug!(
            status = resp.status().as_u16(),
            elapsed_us = started.elapsed().as_micros() as u64,
            "answered"
        )
    });
    resp.headers_mut().insert(HEADER, value);
    resp
}

/// 8 random bytes: ids need to be unique, not secret.
fn rand_bytes() -> [u8; 8] {
    *schemas::EntityId::random().as_bytes().first_chunk().expect("16 bytes")
}
