//! Serving and stopping: the one sequence every bagstore process runs.
//!
//! 1. Bind, print the ready line (the caller's), serve HTTP.
//! 2. On SIGINT or SIGTERM, stop accepting and let requests in flight
//!    finish for at most `http.shutdown_grace_ms`.
//! 3. Run the caller's step between HTTP and the pipeline (`dev` drains
//!    the pipeline there).
//! 4. Stop the pipeline: relays finish the round in hand (draining the
//!    outbox for half the grace), consumers the batch in hand; what outlives
//!    the budget is abandoned and logged.

use anyhow::Context;
use axum::Router;
use schemas::Settings;
use std::future::{Future, IntoFuture};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::health::{Health, Phase};

/// The background work of a process (relays, index consumers, sweeps):
/// its tasks, and the token that asks them to stop.
#[derive(Debug, Clone, Default)]
pub struct Pipeline {
    pub tracker: TaskTracker,
    pub stop: CancellationToken,
}

impl Pipeline {
    pub fn new() -> Pipeline {
        Pipeline::default()
    }

    /// Asks every task to stop and waits for them, abandoning what
    /// outlives the budget: `grace` (relays drain the outbox for half of
    /// it) plus one Kafka message timeout, the longest a relay round already
    /// sent can wait for its acknowledgements. Waiting that long means a
    /// stop never abandons a round whose rows Kafka has acknowledged but the
    /// outbox still holds.
    pub async fn stop(&self, settings: &Settings) {
        let budget = Duration::from_millis(settings.http.shutdown_grace_ms)
            + Duration::from_millis(settings.kafka.message_timeout_ms);
        self.stop.cancel();
        self.tracker.close();
        if tokio::time::timeout(budget, self.tracker.wait()).await.is_err() {
            tracing::warn!(
                tasks = self.tracker.len(),
                "pipeline tasks still running after the grace period; abandoning them"
            );
        }
    }
}

/// Sleeps for `d` unless `stop` comes first; false means "stop now" (a
/// pipeline task's retry pause).
pub async fn sleep_or_stop(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = stop.cancelled() => false,
    }
}

/// Binds `addr`; returns the listener and its `http://` URL.
pub async fn bind(addr: &str) -> anyhow::Result<(tokio::net::TcpListener, String)> {
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let url = format!("http://{}", listener.local_addr()?);
    Ok((listener, url))
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

/// Steps 1–4 of the module docs: serves `router` on `listener` until a
/// signal, stops HTTP, runs `between`, stops `pipeline`.
pub async fn until_signal<F>(
    settings: &Settings,
    listener: tokio::net::TcpListener,
    router: Router,
    pipeline: &Pipeline,
    health: &Health,
    between: F,
) where
    F: Future<Output = ()>,
{
    let http_stop = CancellationToken::new();
    let grace = Duration::from_millis(settings.http.shutdown_grace_ms);
    let server = tokio::spawn(serve(listener, router, http_stop.clone(), grace));
    signal().await;
    // Requests still arriving on open connections learn it first.
    health.set_phase(Phase::Draining);
    http_stop.cancel();
    let _ = server.await;
    between.await;
    pipeline.stop(settings).await;
}
