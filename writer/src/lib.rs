//! The writer: accepts entity writes over HTTP, commits each to its shard
//! together with a change event in the same InnoDB transaction (the
//! transactional outbox), and relays outbox rows to Kafka.
//!
//! In: `POST/PUT/DELETE /v1/entities…` requests. Out: rows in `entities` and
//! `outbox`, then events on the change topic (key = entity id).
//!
//! Layout:
//! - [`http`]: routes, request parsing and validation, status codes.
//! - [`write`]: the write transaction (lock, check, version+1, outbox row).
//! - [`group`]: group commit, concurrent single writes share a transaction.
//! - [`relay`]: one publisher per shard, elected by a MySQL named lock.
//! - [`ingest`]: Kafka ingest, commands from a topic through the write path.
//! - [`metrics`]: the series this crate exports.
//!
//! Invariant W (every committed write reaches Kafka at least once, one
//! entity's events in version order) rests on two facts: the event commits
//! atomically with the write, and a row leaves the outbox only after Kafka
//! acknowledged it.

mod group;
pub mod http;
pub mod ingest;
pub mod metrics;
pub mod relay;
pub mod write;

use prometheus::Registry;
use schemas::Settings;
use service::health::Health;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use storage::shards::MAX_PHYSICAL;
use storage::Shards;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

pub use write::{Outcome, Precondition, WriteError};

/// The writer service: cheap to clone, shared by the HTTP handlers and the relays.
#[derive(Debug, Clone)]
pub struct Writer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    settings: Settings,
    shards: Shards,
    metrics: metrics::Metrics,
    /// By physical id: a commit wakes that shard's relay at once instead of
    /// waiting for the next poll.
    wake: Vec<Notify>,
    /// By physical id: single writes waiting for a commit slot (made when
    /// first used, see `group::queue`).
    queues: Vec<OnceLock<group::Queue>>,
    /// By physical id, asked once: whether a multi-row insert's new rows are
    /// numbered consecutively (see `storage::entities::autoinc_is_consecutive`).
    consecutive: Vec<tokio::sync::OnceCell<bool>>,
    /// Where the relays report how they are doing (`/health/ready`).
    health: Health,
    /// Admission: one permit per write in hand (writer.max_pending_writes).
    admission: Arc<Semaphore>,
}

/// Writes admitted by [`Writer::admit`]; the permits go back on drop.
#[derive(Debug)]
pub struct Admitted {
    _permits: OwnedSemaphorePermit,
    gauge: prometheus::IntGauge,
    n: i64,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.gauge.sub(self.n);
    }
}

/// How long a write keeps going after its map turned out stale (a move's
/// cutover in progress, or completed since the map was loaded) before it
/// fails: a cutover pauses a logical shard's writes for much less.
const STALE_MAP_WAIT: Duration = Duration::from_secs(10);

/// The retry loop of a write whose map was stale: reload, wait a little
/// (longer each time), and go again until [`STALE_MAP_WAIT`].
#[derive(Debug)]
pub(crate) struct StaleMapRetry {
    until: Instant,
    pause: Duration,
}

impl StaleMapRetry {
    pub(crate) fn new() -> StaleMapRetry {
        StaleMapRetry { until: Instant::now() + STALE_MAP_WAIT, pause: Duration::from_millis(5) }
    }

    /// Reloads the map and waits; false once the time is up.
    pub(crate) async fn again(&mut self, shards: &Shards, metrics: &metrics::Metrics) -> bool {
        if Instant::now() >= self.until {
            return false;
        }
        metrics.stale_map_retries.inc();
        if let Err(e) = shards.reload().await {
            tracing::warn!(error = %e, "cannot reload the shard map");
        }
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(Duration::from_millis(200));
        true
    }
}

impl Writer {
    /// Must be called inside a Tokio runtime: it starts each shard's group
    /// commit task.
    pub fn new(
        settings: Settings,
        shards: Shards,
        registry: &Registry,
        health: Health,
    ) -> prometheus::Result<Writer> {
        let metrics = metrics::Metrics::register(registry)?;
        // Every shard's series exist from the start (at 0), so dashboards and
        // increase() see the first failure.
        for shard in shards.ids() {
            let s = shard.to_string();
            metrics.published.with_label_values(&[&s]);
            metrics.publish_failures.with_label_values(&[&s]);
            metrics.relay_leader.with_label_values(&[&s]);
            metrics.queued.with_label_values(&[&s]);
            for kind in ["put", "delete", "patch", "expire"] {
                metrics.writes.with_label_values(&[&s, kind]);
            }
        }
        let wake = (0..MAX_PHYSICAL).map(|_| Notify::new()).collect();
        let queues = (0..MAX_PHYSICAL).map(|_| OnceLock::new()).collect();
        let consecutive = (0..MAX_PHYSICAL).map(|_| tokio::sync::OnceCell::new()).collect();
        let admission = Arc::new(Semaphore::new(settings.writer.max_pending_writes));
        let inner =
            Arc::new(Inner { settings, shards, metrics, wake, queues, consecutive, health, admission });
        Ok(Writer { inner })
    }

    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    /// Takes `n` of the writer.max_pending_writes permits, or None when
    /// they are not free now (the caller answers 429). Never waits: a
    /// flood is refused, not queued.
    pub fn admit(&self, n: usize) -> Option<Admitted> {
        let permits = self.inner.admission.clone().try_acquire_many_owned(n as u32).ok();
        let Some(permits) = permits else {
            self.inner.metrics.refused.inc();
            return None;
        };
        let gauge = self.inner.metrics.pending.clone();
        gauge.add(n as i64);
        Some(Admitted { _permits: permits, gauge, n: n as i64 })
    }

    pub fn shards(&self) -> &Shards {
        &self.inner.shards
    }
}
