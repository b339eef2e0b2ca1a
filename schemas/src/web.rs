//! HTTP plumbing every service shares: problem documents (RFC 9457 style),
//! bounded JSON bodies, request metrics, `/metrics`, `/health`, and serving
//! with a graceful, bounded stop.

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder};
use serde_json::{json, Map, Value as Json};
use std::future::IntoFuture;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

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
}

impl Problem {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Problem { status, kind, title, detail: detail.into(), extra: Map::new() }
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

    /// A failure that is ours, not the caller's. The cause chain is logged
    /// here, once; the caller gets a generic sentence.
    pub fn internal(err: &(dyn std::error::Error + 'static)) -> Self {
        let mut chain = err.to_string();
        let mut src = err.source();
        while let Some(s) = src {
            chain.push_str(": ");
            chain.push_str(&s.to_string());
            src = s.source();
        }
        tracing::error!(error = %chain, "request failed");
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "Storage unavailable",
            "a shard could not complete the request: a read may simply be retried; a write may or may \
             not have been committed, so read it back before retrying one with If-Match or If-None-Match",
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
        if self.status == StatusCode::REQUEST_TIMEOUT {
            // The rest of the body may still be on its way; the connection
            // cannot carry another request (RFC 9110 §15.5.9).
            resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// An id from a path or body, or a 400 `bad-id` problem.
pub fn parse_id(s: &str) -> Result<crate::EntityId, Problem> {
    crate::EntityId::parse(s).map_err(|e| Problem::bad_request("bad-id", e.to_string()))
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

/// Request counters and latency per route and status.
#[derive(Debug, Clone)]
pub struct HttpMetrics {
    requests: IntCounterVec,
    seconds: HistogramVec,
}

impl HttpMetrics {
    /// Registers `bagstore_<component>_requests_total` and
    /// `…_request_duration_seconds` (the services use `http`: one family,
    /// told apart by the `route` label).
    pub fn register(registry: &Registry, component: &str) -> prometheus::Result<HttpMetrics> {
        let requests = IntCounterVec::new(
            Opts::new(format!("bagstore_{component}_requests_total"), "HTTP requests answered"),
            &["route", "status"],
        )?;
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                format!("bagstore_{component}_request_duration_seconds"),
                "HTTP request latency",
            )
            .buckets(vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]),
            &["route", "status"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(seconds.clone()))?;
        Ok(HttpMetrics { requests, seconds })
    }
}

/// Middleware: label by the matched route template, never the raw path
/// (which would put entity ids into label values).
pub async fn track(State(m): State<HttpMetrics>, req: Request, next: Next) -> Response {
    let route = match req.extensions().get::<MatchedPath>() {
        Some(p) => format!("{} {}", req.method(), p.as_str()),
        None => "unmatched".to_string(),
    };
    let start = Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16().to_string();
    m.requests.with_label_values(&[&route, &status]).inc();
    m.seconds.with_label_values(&[&route, &status]).observe(start.elapsed().as_secs_f64());
    resp
}

/// The OpenAPI description of the v1 HTTP API.
pub const OPENAPI: &str = include_str!("openapi.json");

/// `/metrics` (Prometheus text), `/health` and `/v1/openapi.json`.
pub fn ops_router(registry: Registry) -> Router {
    Router::new()
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/v1/openapi.json", get(|| async { ([(header::CONTENT_TYPE, "application/json")], OPENAPI) }))
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    match TextEncoder::new().encode_to_string(&registry.gather()) {
                        Ok(text) => {
                            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
                        }
                        Err(e) => Problem::internal(&e).into_response(),
                    }
                }
            }),
        )
}

/// Which token a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Open,
    Read,
    Write,
    Admin,
}

/// The role a request needs, by method and matched route.
pub fn role_of(method: &axum::http::Method, route: &str, protect_metrics: bool) -> Role {
    use axum::http::Method;
    match (method, route) {
        (_, "/health" | "/v1/openapi.json") => Role::Open,
        (_, "/metrics") if protect_metrics => Role::Read,
        (_, "/metrics") => Role::Open,
        (&Method::DELETE, "/v1/indexes/{table}") => Role::Admin,
        (&Method::POST, "/v1/entities" | "/v1/entities/batch")
        | (&Method::PUT | &Method::DELETE, "/v1/entities/{id}") => Role::Write,
        (_, r) if r.starts_with("/v1/") => Role::Read,
        _ => Role::Open,
    }
}

/// Middleware: bearer tokens per role (see `AuthSettings`). Missing or
/// unknown token → 401; a valid token of another role → 403. Runs before
/// the handler, so a refused request writes nothing.
pub async fn authorize(
    State(auth): State<std::sync::Arc<crate::settings::AuthSettings>>,
    req: Request,
    next: Next,
) -> Response {
    let route = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_default();
    let role = role_of(req.method(), &route, auth.protect_metrics);
    let needed = match role {
        Role::Open => None,
        Role::Read => Some(&auth.read_tokens),
        Role::Write => Some(&auth.write_tokens),
        Role::Admin => Some(&auth.admin_tokens),
    };
    let Some(needed) = needed.filter(|t| !t.is_empty()) else {
        return next.run(req).await;
    };
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(token) = presented else {
        return unauthorized("this route needs a bearer token (Authorization: Bearer <token>)");
    };
    if needed.iter().chain(&auth.admin_tokens).any(|s| s.matches(token)) {
        return next.run(req).await;
    }
    let known = [&auth.read_tokens, &auth.write_tokens, &auth.admin_tokens]
        .iter()
        .any(|l| l.iter().any(|s| s.matches(token)));
    if known {
        Problem::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "Forbidden",
            "this token's role may not use this route",
        )
        .into_response()
    } else {
        unauthorized("the bearer token is not valid")
    }
}

fn unauthorized(detail: &str) -> Response {
    let mut resp =
        Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized", detail).into_response();
    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
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

/// Serves until `shutdown` fires, then lets requests in flight finish for at
/// most `grace`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: CancellationToken,
    grace: Duration,
) -> std::io::Result<()> {
    let stop = shutdown.clone();
    let server = axum::serve(listener, router).with_graceful_shutdown(async move { stop.cancelled().await });
    let server = std::pin::pin!(server.into_future());
    tokio::select! {
        r = server => r,
        _ = async { shutdown.cancelled().await; tokio::time::sleep(grace).await } => {
            tracing::warn!("HTTP requests still running after the grace period were dropped");
            Ok(())
        }
    }
}

/// Microseconds since the Unix epoch.
pub fn now_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}
