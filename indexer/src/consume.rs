//! The consumer loop of one index: batches of change events applied to
//! the index's rows, with retries, dead letters and the freshness record.
//! Assignment, partition claims, loss and rebuilds are the shared fenced
//! consumer's (`service::consumer`).
//!
//! Offsets: librdkafka auto-commits only offsets we *stored*, and we store
//! a partition's offset only after every event up to it was applied and the
//! MySQL transactions committed (or the event was dead-lettered). A crash
//! replays at most the batch in hand; replays are harmless.
//!
//! Failures are sorted by type: a [`CodecError`] (the event cannot be
//! decoded) is poison: dead-letter it and move on; a [`StoreError`] is
//! transient: retry the batch with backoff and hold the offsets.

use rdkafka::message::{Header, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use schemas::codec::CodecError;
use schemas::event::ChangeEvent;
use schemas::{IndexSpec, Settings};
use service::consumer::{Batch, FencedConsumer, Next, Observer, Options};
use service::health::Health;
use service::kafka;
use service::serve::sleep_or_stop;
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage::{catalog, Shards, StoreError};
use tokio_util::sync::CancellationToken;

use crate::apply::Fence;
use crate::metrics::Metrics;
use crate::plan::{plan, RowOp};

/// Consumes the change topic for one index.
#[derive(Debug)]
pub struct IndexConsumer {
    index: Index,
    /// The fenced group member that hands out the batches (made with the
    /// consumer, so the process is not ready from the start until it
    /// holds its partitions).
    consumer: FencedConsumer,
}

/// The work on the batches: the index's rows, dead letters, freshness.
#[derive(Debug)]
struct Index {
    settings: Settings,
    spec: IndexSpec,
    shards: Shards,
    metrics: Metrics,
    /// The applied-through time readers report, written to shard 0 at most
    /// every PROGRESS_EVERY (a commit per batch would cost a busy index an
    /// fsync per batch), and on the idle tick when a newer one waits.
    progress: std::sync::Mutex<Progress>,
}

#[derive(Debug, Default)]
struct Progress {
    written_at: Option<Instant>,
    pending: Option<i64>,
}

const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// What became of a batch in [`IndexConsumer::process`].
#[derive(Debug)]
enum Applied {
    /// Applied (or dead-lettered, or moot because the index was dropped):
    /// its offsets may be stored.
    Yes,
    Stopped,
    Lost(String),
}

#[derive(Debug)]
struct DropCheck {
    checked: Option<Instant>,
    dropped: bool,
}

/// A batch decoded: its row operations, the commit times of its events,
/// and the messages that hold no event.
#[derive(Debug, Default)]
struct Planned {
    ops: Vec<RowOp>,
    commits: Vec<i64>,
    poison: Vec<Poison>,
}

/// A message that cannot be applied, and why.
#[derive(Debug)]
struct Poison {
    message: OwnedMessage,
    reason: String,
}

/// The index's series the shared consumer feeds.
#[derive(Debug)]
struct Counted {
    metrics: Metrics,
    table: String,
}

impl Observer for Counted {
    fn fetched(&self, partition: i32) {
        self.metrics.partition_events(&self.table, "fetched")(partition).inc();
    }

    fn holds(&self, partitions: usize) {
        self.metrics.assigned_partitions.with_label_values(&[&self.table]).set(partitions as i64);
    }

    fn rebuilt(&self) {
        self.metrics.rejoins.with_label_values(&[&self.table]).inc();
    }
}

impl IndexConsumer {
    /// The process is not ready from now until this consumer holds its
    /// partitions (see `service::consumer`).
    pub fn new(
        settings: Settings,
        spec: IndexSpec,
        shards: Shards,
        metrics: Metrics,
        health: Health,
    ) -> IndexConsumer {
        // The index's series exist from the start (at 0), so increase() sees the first event.
        let t = [spec.table.as_str()];
        metrics.applied.with_label_values(&t);
        metrics.failed.with_label_values(&t);
        metrics.stale_map_retries.with_label_values(&t);
        metrics.dead_lettered.with_label_values(&t);
        metrics.assigned_partitions.with_label_values(&t);
        metrics.rejoins.with_label_values(&t);
        metrics.event_lag_seconds.with_label_values(&t);
        let i = &settings.indexer;
        let options = Options {
            part: format!("consumer {}", spec.table),
            group: settings.kafka.group_for(&spec.table),
            topic: settings.kafka.topic.clone(),
            fetch_wait_ms: i.fetch_wait_ms(),
            member: i.member.clone(),
            member_setting: "indexer.member",
            batch_max: i.batch_max,
            batch_wait: Duration::from_millis(i.batch_wait_ms),
            gates_readiness: true,
        };
        let counted = Arc::new(Counted { metrics: metrics.clone(), table: spec.table.clone() });
        let consumer = FencedConsumer::new(settings.kafka.clone(), shards.clone(), health, options, counted);
        IndexConsumer {
            index: Index { settings, spec, shards, metrics, progress: Default::default() },
            consumer,
        }
    }

    /// Runs until `shutdown`; then finishes the batch in hand, commits the
    /// stored offsets synchronously and leaves the group (or its lease).
    /// An error when no consumer can be made, or (with member leases) when
    /// another process took this one's member name.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let IndexConsumer { index, mut consumer } = self;
        let dlq: FutureProducer = match kafka::create(&kafka::producer_config(&index.settings.kafka)) {
            Ok(p) => p,
            Err(e) => {
                consumer.report(Err(format!("cannot make the dead-letter producer: {e}")));
                consumer.close().await;
                return Err(e.into());
            }
        };
        let table = index.spec.table.clone();
        let mut dropped = DropCheck { checked: None, dropped: false };
        loop {
            match consumer.next(&shutdown).await? {
                Next::Batch(batch) => {
                    if !index.work(&mut consumer, batch, &dlq, &shutdown, &mut dropped).await {
                        break;
                    }
                }
                Next::Idle => index.write_progress(None, true).await,
                Next::Stop => break,
                Next::Taken(why) => anyhow::bail!("index {table}: {why}"),
            }
        }
        index.write_progress(None, true).await;
        consumer.close().await;
        tracing::info!(index = %table, "index consumer stopped");
        Ok(())
    }
}

impl Index {
    /// Applies a batch (unless the index was dropped) and stores its
    /// offsets; false when stopped before it was done (its offsets were
    /// not earned). A batch whose partitions turned out lost is not
    /// stored: the consumer is rebuilt and its successor replays it.
    async fn work(
        &self,
        consumer: &mut FencedConsumer,
        batch: Batch,
        dlq: &FutureProducer,
        shutdown: &CancellationToken,
        dropped: &mut DropCheck,
    ) -> bool {
        let table = &self.spec.table;
        if self.is_dropped(dropped).await {
            // `bagstore index drop` ran: consume and forget, nothing to maintain.
            tracing::debug!(index = %table, events = batch.messages.len(), "index dropped; skipping events");
        } else {
            match self.process(&batch, consumer, dlq, shutdown, dropped).await {
                // Stopped while retrying: these offsets were not earned.
                Applied::Yes => {
                    consumer.report(Ok(()));
                    let applied = self.metrics.partition_events(table, "applied");
                    for m in &batch.messages {
                        applied(m.partition()).inc();
                    }
                }
                Applied::Stopped => return false,
                // Not stored: the successor replays the batch.
                Applied::Lost(why) => {
                    consumer.lose(why);
                    return true;
                }
            }
        }
        consumer.store(&batch.next_offsets());
        true
    }

    /// Whether the index was dropped (checked at most once a second; an
    /// unreadable state counts as "not dropped", so events are kept).
    async fn is_dropped(&self, check: &mut DropCheck) -> bool {
        if check.checked.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
            check.checked = Some(Instant::now());
            if let Ok(metas) = catalog::list_index_meta(&self.shards).await {
                check.dropped = metas.iter().any(|m| {
                    m.spec.table == self.spec.table && m.state == schemas::index::IndexState::Dropping
                });
            }
        }
        check.dropped
    }

    /// Applies a batch, unless shutdown interrupts the retries or the
    /// consumer turns out to have lost its partitions; then dead-letters
    /// what cannot be decoded, and counts.
    async fn process(
        &self,
        batch: &Batch,
        consumer: &FencedConsumer,
        dlq: &FutureProducer,
        shutdown: &CancellationToken,
        dropped: &mut DropCheck,
    ) -> Applied {
        let table = &self.spec.table;
        let planned = self.plan(&batch.messages);
        match self.apply(&planned.ops, batch, consumer, shutdown, dropped).await {
            Applied::Yes => {}
            other => return other,
        }
        for p in &planned.poison {
            if !self.dead_letter(dlq, p, shutdown).await {
                return Applied::Stopped;
            }
        }
        self.metrics.applied.with_label_values(&[table]).inc_by(planned.commits.len() as u64);
        let now = schemas::clock::now_micros();
        let lag = self.metrics.event_lag_seconds.with_label_values(&[table]);
        for c in &planned.commits {
            lag.observe((now - c).max(0) as f64 / 1e6);
        }
        if let Some(us) = planned.commits.iter().copied().max() {
            self.write_progress(Some(us), false).await;
            let g = self.metrics.last_applied.with_label_values(&[table]);
            g.set(g.get().max(us as f64 / 1e6));
        }
        Applied::Yes
    }

    /// The batch's row operations, and what cannot be decoded.
    fn plan(&self, messages: &[OwnedMessage]) -> Planned {
        let mut planned = Planned::default();
        for m in messages {
            match decode(m) {
                Ok(event) => {
                    planned.ops.extend(plan(&self.spec, &event, self.shards.logical_shards()));
                    planned.commits.push(event.committed_at_us);
                }
                Err(reason) => planned.poison.push(Poison { message: m.clone(), reason }),
            }
        }
        planned
    }

    /// Applies `ops` under the batch's claims, retrying transient failures
    /// with backoff. The consumer's loss is checked before each attempt (a
    /// member that lost its partitions must not apply them), and every
    /// transaction proves the claims, so a write the new owner's fence
    /// refuses ends the batch as lost.
    async fn apply(
        &self,
        ops: &[RowOp],
        batch: &Batch,
        consumer: &FencedConsumer,
        shutdown: &CancellationToken,
        dropped: &mut DropCheck,
    ) -> Applied {
        let table = &self.spec.table;
        let group = self.settings.kafka.group_for(table);
        let fence = Fence { group: &group, claims: &batch.claims };
        let retry_max = Duration::from_millis(self.settings.indexer.retry_max_ms);
        let mut backoff = Duration::from_millis(50);
        loop {
            if let Some(why) = consumer.lost() {
                return Applied::Lost(why);
            }
            let start = Instant::now();
            match crate::apply::apply(&self.shards, &self.spec, ops, &fence).await {
                Ok(()) => {
                    let took = start.elapsed().as_secs_f64();
                    self.metrics.apply_seconds.with_label_values(&[table]).observe(took);
                    return Applied::Yes;
                }
                Err(StoreError::Fenced { partitions, shard, .. }) => {
                    return Applied::Lost(format!(
                        "shard {shard} refused a write: partitions {partitions:?} were claimed by another consumer"
                    ));
                }
                Err(e) if e.is_stale_map() => {
                    // A move took a logical shard away (or is cutting it
                    // over): reload the map and apply again, at once.
                    tracing::debug!(index = %table, error = %e, "stale shard map; reloading");
                    self.metrics.stale_map_retries.with_label_values(&[table]).inc();
                    if let Err(e) = self.shards.reload().await {
                        tracing::warn!(error = %e, "cannot reload the shard map");
                    }
                    backoff = Duration::from_millis(5);
                }
                Err(e) => {
                    self.metrics.failed.with_label_values(&[table]).inc();
                    consumer.report(Err(format!("applying a batch failed: {e}")));
                    tracing::warn!(index = %table, error = %e, source = ?std::error::Error::source(&e).map(|s| s.to_string()),
                        "applying a batch failed; retrying");
                }
            }
            if self.is_dropped(dropped).await {
                // Dropped while we retried (its tables are gone): nothing to apply.
                tracing::info!(index = %table, "index dropped; abandoning the batch");
                return Applied::Yes;
            }
            if !sleep_or_stop(shutdown, backoff).await {
                return Applied::Stopped;
            }
            backoff = (backoff * 2).min(retry_max);
        }
    }

    /// Records the commit time of the newest event applied (freshness for
    /// readers; losing one update only delays it), unless one was written
    /// less than PROGRESS_EVERY ago and `flush` is not asked.
    async fn write_progress(&self, applied_us: Option<i64>, flush: bool) {
        let due = {
            let mut p = self.progress.lock().expect("not poisoned");
            if let Some(us) = applied_us {
                p.pending = p.pending.max(Some(us));
            }
            let recent = p.written_at.is_some_and(|t| t.elapsed() < PROGRESS_EVERY);
            match p.pending {
                Some(us) if flush || !recent => {
                    p.pending = None;
                    p.written_at = Some(Instant::now());
                    Some(us)
                }
                _ => None,
            }
        };
        if let Some(us) = due {
            let table = &self.spec.table;
            if let Err(e) = catalog::record_index_progress(&self.shards, table, us).await {
                tracing::debug!(index = %table, error = %e, "cannot record index progress");
            }
        }
    }

    /// Sends a poison message to `<topic>.dlq` with the reason in headers.
    /// The offset may move only once the dead letter is acknowledged.
    async fn dead_letter(&self, dlq: &FutureProducer, p: &Poison, shutdown: &CancellationToken) -> bool {
        let table = &self.spec.table;
        let topic = self.settings.kafka.dlq_topic();
        let origin = format!("{}/{}/{}", p.message.topic(), p.message.partition(), p.message.offset());
        tracing::error!(index = %table, %origin, reason = %p.reason, "dead-lettering an undecodable event");
        loop {
            let headers = OwnedHeaders::new()
                .insert(Header { key: "bagstore-reason", value: Some(p.reason.as_str()) })
                .insert(Header { key: "bagstore-origin", value: Some(origin.as_str()) })
                .insert(Header { key: "bagstore-index", value: Some(table.as_str()) });
            let mut record = FutureRecord::to(&topic).headers(headers);
            if let Some(k) = p.message.key() {
                record = record.key(k);
            }
            if let Some(v) = p.message.payload() {
                record = record.payload(v);
            }
            match dlq.send(record, Duration::from_secs(10)).await {
                Ok(_) => {
                    self.metrics.dead_lettered.with_label_values(&[table]).inc();
                    return true;
                }
                Err((e, _)) => {
                    tracing::warn!(index = %table, error = %e, "dead-letter send failed; retrying")
                }
            }
            if !sleep_or_stop(shutdown, Duration::from_millis(500)).await {
                return false;
            }
        }
    }
}

/// The change event a message holds, or why it holds none.
fn decode(m: &OwnedMessage) -> Result<ChangeEvent, String> {
    let payload = m.payload().ok_or_else(|| "the message has no payload".to_string())?;
    ChangeEvent::decode(payload).map_err(|e: CodecError| {
        let mut s = e.to_string();
        if let Some(src) = std::error::Error::source(&e) {
            s.push_str(&format!(": {src}"));
        }
        s
    })
}
