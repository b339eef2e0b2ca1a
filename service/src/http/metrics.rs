//! Request counts and latency per route and status.

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use std::time::Instant;

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
