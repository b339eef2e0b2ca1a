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
//! - [`metrics`]: the series this crate exports.
//!
//! Invariant W (every committed write reaches Kafka at least once, one
//! entity's events in version order) rests on two facts: the event commits
//! atomically with the write, and a row leaves the outbox only after Kafka
//! acknowledged it.

mod group;
pub mod http;
pub mod metrics;
pub mod relay;
pub mod write;

use prometheus::Registry;
use schemas::Settings;
use std::sync::Arc;
use storage::Shards;
use tokio::sync::Notify;

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
    /// One per shard: a commit wakes that shard's relay at once instead of
    /// waiting for the next poll.
    wake: Vec<Notify>,
    /// One per shard: single writes waiting for a commit slot.
    queues: Vec<group::Queue>,
    /// One per shard, asked once: whether a multi-row insert's new rows are
    /// numbered consecutively (see `storage::entities::autoinc_is_consecutive`).
    consecutive: Vec<tokio::sync::OnceCell<bool>>,
}

impl Writer {
    /// Must be called inside a Tokio runtime: it starts each shard's group
    /// commit task.
    pub fn new(settings: Settings, shards: Shards, registry: &Registry) -> prometheus::Result<Writer> {
        let metrics = metrics::Metrics::register(registry)?;
        // Every shard's series exist from the start (at 0), so dashboards and
        // increase() see the first failure.
        for shard in 0..shards.count() {
            let s = shard.to_string();
            metrics.published.with_label_values(&[&s]);
            metrics.publish_failures.with_label_values(&[&s]);
            metrics.relay_leader.with_label_values(&[&s]);
            metrics.queued.with_label_values(&[&s]);
            for kind in ["put", "delete"] {
                metrics.writes.with_label_values(&[&s, kind]);
            }
        }
        let wake = (0..shards.count()).map(|_| Notify::new()).collect();
        let (queues, receivers) = group::queues(shards.count());
        let consecutive = (0..shards.count()).map(|_| tokio::sync::OnceCell::new()).collect();
        let inner = Arc::new(Inner { settings, shards, metrics, wake, queues, consecutive });
        group::spawn_dispatchers(&inner, receivers);
        Ok(Writer { inner })
    }

    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    pub fn shards(&self) -> &Shards {
        &self.inner.shards
    }
}
