//! Assembling services in one process. `bagstore writer|indexer|reader`
//! each start one role; `bagstore dev` starts them all behind one listener.

use anyhow::Context;
use axum::Router;
use prometheus::Registry;
use schemas::store::Shards;
use schemas::web::{self, HttpMetrics};
use schemas::{IndexSpec, Settings};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Which services this process runs.
#[derive(Debug, Clone, Default)]
pub struct Roles {
    pub writer: bool,
    pub reader: bool,
    /// One consumer group each.
    pub indexes: Vec<IndexSpec>,
    /// The continuous cleaner (drift repair and backfills).
    pub cleaner: bool,
}

/// Services started in this process.
#[derive(Debug)]
pub struct Running {
    pub router: Router,
    pub shards: Shards,
    /// Relays and index consumers live here.
    pub tracker: TaskTracker,
    /// Stops relays and consumers (each finishes the batch in hand).
    pub pipeline: CancellationToken,
}

pub async fn start(settings: &Settings, roles: Roles) -> anyhow::Result<Running> {
    let shards = Shards::connect_lazy(&settings.mysql)?;
    let registry = Registry::new();
    let tracker = TaskTracker::new();
    let pipeline = CancellationToken::new();
    let http_metrics = HttpMetrics::register(&registry, "http")?;
    let mut router = Router::new();
    if roles.writer {
        let w = writer::Writer::new(settings.clone(), shards.clone(), &registry)?;
        w.spawn_relays(&tracker, pipeline.clone()).context("starting the outbox relays")?;
        router = router.merge(writer::http::router(w));
    }
    if roles.reader {
        let r = reader::Reader::new(settings.clone(), shards.clone(), &registry)?;
        router = router.merge(reader::http::router(r));
    }
    if !roles.indexes.is_empty() {
        let metrics = indexer::Metrics::register(&registry)?;
        for spec in roles.indexes {
            let c = indexer::IndexConsumer::new(settings.clone(), spec, shards.clone(), metrics.clone());
            let stop = pipeline.clone();
            tracker.spawn(async move {
                if let Err(e) = c.run(stop).await {
                    tracing::error!(error = %e, "index consumer failed to start");
                }
            });
        }
    }
    if roles.cleaner {
        let c = indexer::Cleaner::new(
            settings.clone(),
            shards.clone(),
            indexer::CleanerMetrics::register(&registry)?,
        );
        let stop = pipeline.clone();
        let backfills = tracker.clone();
        let lag = c.clone();
        let lag_stop = stop.clone();
        tracker.spawn(async move { c.run(&backfills, stop).await });
        tracker.spawn(async move { lag.report_lag(lag_stop).await });
    }
    let router = router
        .merge(web::ops_router(registry))
        .fallback(web::not_found)
        .method_not_allowed_fallback(web::method_not_allowed)
        .route_layer(axum::middleware::from_fn_with_state(
            std::sync::Arc::new(settings.auth.clone()),
            web::authorize,
        ))
        .layer(axum::middleware::from_fn_with_state(http_metrics, web::track));
    Ok(Running { router, shards, tracker, pipeline })
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
        _ = term => tracing::info!("SIGTERM: stopping"),
    }
}

pub async fn bind(addr: &str) -> anyhow::Result<(tokio::net::TcpListener, String)> {
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let url = format!("http://{}", listener.local_addr()?);
    Ok((listener, url))
}

/// Stops the pipeline and waits for its tasks, abandoning what outlives the
/// budget: `grace` (relays drain the outbox for half of it) plus one Kafka
/// message timeout, the longest a relay round already sent can wait for its
/// acknowledgements. Waiting that long means a stop never abandons a round
/// whose rows Kafka has acknowledged but the outbox still holds.
pub async fn stop_pipeline(running: &Running, settings: &Settings) {
    let grace = Duration::from_millis(settings.http.shutdown_grace_ms)
        + Duration::from_millis(settings.kafka.message_timeout_ms);
    running.pipeline.cancel();
    running.tracker.close();
    if tokio::time::timeout(grace, running.tracker.wait()).await.is_err() {
        tracing::warn!(
            tasks = running.tracker.len(),
            "pipeline tasks still running after the grace period; abandoning them"
        );
    }
}

/// Runs one role set as a standalone service: serve until a signal, then
/// stop HTTP (bounded), then the pipeline.
pub async fn serve(settings: Settings, roles: Roles, name: &str, http: Option<String>) -> anyhow::Result<()> {
    settings.require_external()?;
    let running = start(&settings, roles).await?;
    let addr = http.unwrap_or_else(|| settings.http.addr.clone());
    let (listener, url) = bind(&addr).await?;
    println!("bagstore {name} ready: http={url}");
    let http_stop = CancellationToken::new();
    let grace = Duration::from_millis(settings.http.shutdown_grace_ms);
    let server = tokio::spawn(web::serve(listener, running.router.clone(), http_stop.clone(), grace));
    signal().await;
    http_stop.cancel();
    let _ = server.await;
    stop_pipeline(&running, &settings).await;
    running.shards.close().await;
    tracing::info!("{name} stopped");
    Ok(())
}
