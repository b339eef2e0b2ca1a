//! The routes every process serves besides its API: `/metrics`
//! (Prometheus text), `/health` and `/v1/openapi.json`.

use axum::http::{header, Method};
use axum::response::IntoResponse;
use prometheus::{Registry, TextEncoder};
use serde_json::json;

use super::auth::{Role, Routes};
use super::Problem;

/// The OpenAPI description of the v1 HTTP API.
pub const OPENAPI: &str = include_str!("../openapi.json");

pub fn routes(registry: Registry) -> Routes {
    Routes::new()
        .route(Method::GET, "/health", Role::Open, || async { axum::Json(json!({"status": "ok"})) })
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
