//! The writer: accepts entity writes over HTTP (and from the Kafka ingest
//! topic), commits each to its shard together with a change event in the
//! same InnoDB transaction (the transactional outbox), and relays outbox
//! rows to Kafka.
//!
//! In: `POST/PUT/PATCH/DELETE /v1/entities…` requests, ingest commands.
//! Out: rows in `entities` and `outbox` (through `storage::write`, the one
//! write transaction), then events on the change topic (key = entity id).
//!
//! A write goes one way down, stage by stage:
//!
//! ```text
//! http, ingest (parse, validate)
//!   ├─▶ Writer::put/patch/delete ─▶ group (per-shard queue) ─┐
//!   └─▶ Writer::put_batch ───────────────────────────────────┤
//!                                                            ▼
//!              commit (storage::write, then count, wake the relay)
//!                                                            │
//!              relay (one leader per shard) ◀── woken ───────┘
//! ```
//!
//! Layout:
//! - this file: the [`Writer`] (what the routes, the ingest and the binary
//!   hold) and admission.
//! - [`http`]: routes, request parsing and validation, problem documents.
//! - `group`: group commit, concurrent single writes share a transaction.
//! - `commit`: runs `storage::write` transactions and does what follows a
//!   commit here (writes counted, the relay woken); batches by shard.
//! - `relay`: one publisher per shard, elected by a MySQL named lock; its
//!   publish round and its backlog gauges.
//! - [`ingest`]: Kafka ingest, commands from a topic through the write path.
//! - [`metrics`]: the series this crate exports.
//!
//! Invariant W (every committed write reaches Kafka at least once, one
//! entity's events in version order) rests on two facts: the event commits
//! atomically with the write, and a row leaves the outbox only after Kafka
//! acknowledged it.

mod acks;
mod commit;
mod group;
pub mod http;
pub mod ingest;
pub mod metrics;
mod relay;
mod unique;

use prometheus::Registry;
use schemas::patch::Patch;
use schemas::{Bag, EntityId, Settings};
use service::health::Health;
use std::sync::Arc;
use storage::write::{Rules, WriteContext};
use storage::{Shards, StoreError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use storage::write::{Change, Guard, Outcome, Precondition, WriteError};

/// The writer service: cheap to clone, shared by the HTTP handlers, the
/// ingest and the relays.
#[derive(Debug, Clone)]
pub struct Writer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    settings: Settings,
    shards: Shards,
    metrics: metrics::Metrics,
    /// Where the relays and the ingest report how they are doing
    /// (`/health/ready`).
    health: Health,
    /// Admission: one permit per write in hand (writer.max_pending_writes).
    admission: Arc<Semaphore>,
    /// Single writes: each shard's queue and its group commit.
    group: group::Group,
    /// Transactions: what the group and a batch commit through.
    commit: Arc<commit::Commit>,
    /// The outbox relays, woken by `commit`.
    relays: Arc<relay::Relays>,
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

impl Writer {
    /// The writer of `shards`: its series go in `registry`, how its relays
    /// and ingest are doing in `health`. Nothing starts yet: a shard's group
    /// commit task starts (on the Tokio runtime of the write) with the
    /// first write there, the relays with [`Writer::spawn_relays`].
    pub fn new(
        settings: Settings,
        shards: Shards,
        registry: &Registry,
        health: Health,
    ) -> prometheus::Result<Writer> {
        let metrics = metrics::Metrics::register(registry)?;
        metrics.start_at_zero(&shards.ids());
        let wake = Arc::new(relay::Wake::new());
        let ctx = WriteContext::new(shards.clone(), Rules::from_settings(&settings));
        let commit = Arc::new(commit::Commit::new(ctx, &settings, metrics.clone(), wake.clone()));
        let group = group::Group::new(&settings, commit.clone(), metrics.clone());
        let relays = Arc::new(relay::Relays::new(
            settings.clone(),
            shards.clone(),
            metrics.clone(),
            health.clone(),
            wake,
        ));
        let admission = Arc::new(Semaphore::new(settings.writer.max_pending_writes));
        let inner = Inner { settings, shards, metrics, health, admission, group, commit, relays };
        Ok(Writer { inner: Arc::new(inner) })
    }

    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    pub fn shards(&self) -> &Shards {
        &self.inner.shards
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

    pub async fn put(&self, id: EntityId, bag: Bag, pre: Precondition) -> Result<Outcome, WriteError> {
        self.write_one(id, Change::Put(bag), pre).await
    }

    pub async fn delete(&self, id: EntityId, pre: Precondition) -> Result<Outcome, WriteError> {
        self.write_one(id, Change::Delete, pre).await
    }

    /// Applies `patch` to the entity inside the write transaction (the
    /// same group commit as a put), so concurrent patches never lose each
    /// other's changes.
    pub async fn patch(
        &self,
        id: EntityId,
        patch: Patch,
        upsert: bool,
        pre: Precondition,
    ) -> Result<Outcome, WriteError> {
        self.write_one(id, Change::Patch { patch: Arc::new(patch), upsert }, pre).await
    }

    /// One write through its shard's group commit (see `group`); it waits
    /// through a move's cutover rather than failing.
    pub(crate) async fn write_one(
        &self,
        id: EntityId,
        change: Change,
        pre: Precondition,
    ) -> Result<Outcome, WriteError> {
        self.inner.group.write(id, change, pre).await
    }

    /// Puts many entities; those on one shard commit in one transaction.
    /// Results come back in input order. Items whose shard turned out not to
    /// own them (a stale map) go again to the new owner.
    pub async fn put_batch(
        &self,
        items: Vec<(EntityId, Bag, Precondition)>,
    ) -> Vec<Result<Outcome, WriteError>> {
        let items: Vec<_> = items
            .into_iter()
            .map(|(id, bag, pre)| storage::write::Item { id, change: Change::Put(bag), pre })
            .collect();
        let n = items.len();
        // Its own task, so that past the timeout the client is answered and
        // the commits go on.
        let commit = self.inner.commit.clone();
        let committing = tokio::spawn(async move { commit.batch(items).await });
        let waited = self.settings().writer.commit_timeout_ms;
        match tokio::time::timeout(std::time::Duration::from_millis(waited), committing).await {
            Ok(answers) => answers.expect("a batch's commits do not panic"),
            Err(_) => {
                self.inner.metrics.outcome_unknown.inc_by(n as u64);
                (0..n).map(|_| Err(WriteError::OutcomeUnknown { waited_ms: waited })).collect()
            }
        }
    }

    /// Whether a keyed item's key was used within the window for another
    /// request: a keyed batch that would be a 422 is refused whole before
    /// anything is written (its transactions check each key again, locked).
    pub async fn keys_reused(&self, items: &[(EntityId, Bag, Precondition)]) -> Result<bool, StoreError> {
        let guarded: Vec<(EntityId, Guard)> =
            items.iter().filter_map(|(id, _, pre)| pre.guard.map(|g| (*id, g))).collect();
        storage::write::keys_reused(self.inner.commit.context(), &guarded).await
    }

    /// Starts one relay task per physical shard on `tracker`, and one for
    /// every shard added online later (checked every second); they stop at
    /// `shutdown` after finishing the round in hand.
    pub fn spawn_relays(
        &self,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<(), rdkafka::error::KafkaError> {
        self.inner.relays.spawn(tracker, shutdown)
    }
}
