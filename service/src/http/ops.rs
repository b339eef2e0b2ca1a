//! The routes every process serves besides its API: the operator console
//! at `/` (`console.html`, built in), `/metrics`
//! (Prometheus text), `/health/live`, `/health/ready` (see
//! [`crate::health`]), `/health` (the same as live, for older probes) and
//! `/v1/openapi.json`.

use axum::http::{header, Method, StatusCode};
use axum::response::IntoResponse;
use prometheus::{Registry, TextEncoder};
use serde_json::json;

use super::auth::{Role, Routes};
use super::Problem;
use crate::health::Health;

/// The OpenAPI description of the v1 HTTP API.
pub const OPENAPI: &str = include_str!("../openapi.json");

/// The operator console served at `/` (one self-contained page).
pub const CONSOLE: &str = include_str!("console.html");

/// The console's scripts and styles are inline and it talks only to its
/// own origin; nothing else may load.
const CONSOLE_CSP: &str =
    "default-src 'none'; connect-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self'";

pub fn routes(registry: Registry, health: Health) -> Routes {
    let live = || async { axum::Json(json!({"status": "ok"})) };
    Routes::new()
        .route(Method::GET, "/", Role::Open, || async {
            (
                [
                    (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                    (header::CONTENT_SECURITY_POLICY, CONSOLE_CSP),
                    (header::CACHE_CONTROL, "no-cache"),
                ],
                CONSOLE,
            )
        })
        .route(Method::GET, "/health", Role::Open, live)
        .route(Method::GET, "/health/live", Role::Open, live)
        .route(Method::GET, "/health/ready", Role::Open, move || {
            let health = health.clone();
            async move {
                let (code, body) = health.ready().await;
                let code = StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
                (code, [(header::CACHE_CONTROL, "no-store")], axum::Json(body)).into_response()
            }
        })
        .route(Method::GET, "/v1/openapi.json", Role::Open, || async {
            ([(header::CONTENT_TYPE, "application/json")], OPENAPI)
        })
        .route(Method::GET, "/metrics", Role::Metrics, move || {
            let registry = registry.clone();
            async move {
                match TextEncoder::new().encode_to_string(&registry.gather()) {
                    Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
                    Err(e) => Problem::internal(&e).into_response(),
                }
            }
        })
}
