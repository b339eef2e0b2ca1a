//! The consumer loop of one index.
//!
//! Offsets: librdkafka auto-commits only offsets we *stored*, and we store
//! a partition's offset only after every event up to it was applied and the
//! MySQL transactions committed (or the event was dead-lettered). A crash
//! replays at most the batch in hand; replays are harmless.
//!
//! Failures are sorted by type: a [`CodecError`] (the event cannot be
//! decoded) is poison: dead-letter it and move on; a [`StoreError`] is
//! transient: retry the batch with backoff and hold the offsets.

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use schemas::codec::CodecError;
use schemas::event::ChangeEvent;
use schemas::{IndexSpec, Settings};
use service::health::Health;
use service::kafka;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use storage::{catalog, Shards, StoreError};
use tokio_util::sync::CancellationToken;

use crate::apply::Fence;
use crate::metrics::Metrics;
use crate::plan::{plan, RowOp};
use schemas::settings::Assignment;
use service::leases::Lease;
use service::membership::Membership;

/// Consumes the change topic for one index.
#[derive(Debug)]
pub struct IndexConsumer {
    settings: Settings,
    spec: IndexSpec,
    shards: Shards,
    metrics: Metrics,
    /// Where the consumer reports how it is doing (`/health/ready`).
    health: Health,
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

/// How often an idle consumer checks its membership and reports.
const IDLE_TICK: Duration = Duration::from_millis(250);

/// How often an idle consumer compares its partitions' claims (a busy one
/// compares them before every batch it applies).
const CLAIMS_EVERY: Duration = Duration::from_secs(1);

/// How long a consumer may keep receiving events of partitions it does not
/// hold before it is taken as confused and rebuilt.
const STRAYS_FOR: Duration = Duration::from_secs(2);

/// How long a consumer error keeps the consumer reported failing when no
/// event has been applied since (errors come every few hundred ms while
/// the broker is away, idle ticks in between).
const ERRORS_STAND_FOR: Duration = Duration::from_secs(5);

/// Why [`IndexConsumer::consume`] returned.
#[derive(Debug)]
enum Exit {
    Shutdown,
    /// The partitions are no longer this consumer's; why.
    Lost(String),
    /// With leases: another process took this member's name.
    Taken(String),
    /// With leases: this member's share changed; a new consumer takes it.
    Reshared,
}

/// With `indexer.assignment = "leases"`: the member lease and the topic's
/// partition count the share is computed over.
struct Leased {
    lease: Lease,
    partitions: usize,
}

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

/// A message that cannot be applied, and why.
#[derive(Debug)]
struct Poison {
    message: OwnedMessage,
    reason: String,
}

impl IndexConsumer {
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
        IndexConsumer { settings, spec, shards, metrics, health, progress: Default::default() }
    }

    /// This consumer's name in `/health/ready`.
    fn part(&self) -> String {
        format!("consumer {}", self.spec.table)
    }

    pub fn group(&self) -> String {
        self.settings.kafka.group_for(&self.spec.table)
    }

    /// Runs until `shutdown`; then finishes the batch in hand, commits the
    /// stored offsets synchronously and leaves the group. A consumer that
    /// lost its partitions (see [`service::membership`]) is closed, and a new
    /// one joins in its place.
    ///
    /// With `indexer.assignment = "leases"` the consumer never joins the
    /// broker's group: it keeps a member lease (`service::leases`) and
    /// assigns itself its share of the partitions, committing offsets
    /// under the same group id.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let k = &self.settings.kafka;
        let dlq: FutureProducer = kafka::create(&kafka::producer_config(k))?;
        let table = self.spec.table.clone();
        let session = Duration::from_millis(k.session_timeout_ms);
        let mut leased = match self.settings.indexer.assignment {
            Assignment::Group => None,
            Assignment::Leases => {
                let member =
                    self.settings.indexer.member.clone().unwrap_or_else(service::cluster::process_id);
                let Some(partitions) = self.partition_count(&shutdown).await else { return Ok(()) };
                let lease = Lease::start(self.shards.clone(), self.group(), member, session);
                Some(Leased { lease, partitions })
            }
        };
        loop {
            let mut config = kafka::consumer_config(k, &self.group(), self.settings.indexer.fetch_wait_ms());
            if leased.is_none() {
                // The statistics feed the membership watch (service::membership).
                config.set("statistics.interval.ms", "1000");
            }
            let watch = Membership::new(session, &k.topic);
            let consumer: StreamConsumer<Membership> = kafka::create_with(&config, watch)?;
            match &leased {
                None => {
                    consumer.subscribe(&[&k.topic])?;
                    tracing::info!(index = %table, group = %self.group(), fetch_wait_ms = self.settings.indexer.fetch_wait_ms(),
                        "index consumer joining its group");
                }
                Some(l) => tracing::info!(index = %table, group = %self.group(), member = %l.lease.member(),
                    partitions = l.partitions, "index consumer assigning its partitions by member leases"),
            }
            match self.consume(&consumer, &dlq, leased.as_ref(), &shutdown).await {
                Exit::Shutdown => {
                    self.write_progress(None, true).await;
                    if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
                        tracing::debug!(index = %table, error = %e, "final commit had nothing to commit or failed");
                    }
                    consumer.unsubscribe();
                    if let Some(l) = leased.take() {
                        l.lease.leave().await;
                    }
                    self.metrics.assigned_partitions.with_label_values(&[&table]).set(0);
                    tracing::info!(index = %table, "index consumer stopped");
                    return Ok(());
                }
                Exit::Taken(why) => {
                    self.health.report(&self.part(), Err(why.clone()));
                    self.metrics.assigned_partitions.with_label_values(&[&table]).set(0);
                    // Its stored offsets are the new holder's to replay.
                    tokio::task::spawn_blocking(move || drop(consumer));
                    anyhow::bail!("index {table}: {why}");
                }
                Exit::Reshared => {
                    tracing::info!(index = %table, "the member lease's share changed; a new consumer takes it");
                    self.metrics.assigned_partitions.with_label_values(&[&table]).set(0);
                    // Closing commits the offsets stored; not waited for.
                    tokio::task::spawn_blocking(move || drop(consumer));
                }
                Exit::Lost(why) => {
                    self.health.report(&self.part(), Err(format!("rejoining its group: {why}")));
                    tracing::warn!(index = %table, %why,
                        "this consumer no longer owns its partitions; it stops applying them and rejoins as a new member");
                    self.metrics.rejoins.with_label_values(&[&table]).inc();
                    self.metrics.assigned_partitions.with_label_values(&[&table]).set(0);
                    // Closing stops its fetchers, then leaves the group, which
                    // may wait on a broker: not on a runtime thread, and
                    // not waited for.
                    tokio::task::spawn_blocking(move || drop(consumer));
                }
            }
        }
    }

    /// The consumer loop proper, until shutdown or until `consumer` is
    /// found to have lost its partitions.
    async fn consume(
        &self,
        consumer: &StreamConsumer<Membership>,
        dlq: &FutureProducer,
        leased: Option<&Leased>,
        shutdown: &CancellationToken,
    ) -> Exit {
        let k = &self.settings.kafka;
        let table = &self.spec.table;
        let batch_max = self.settings.indexer.batch_max;
        let batch_wait = Duration::from_millis(self.settings.indexer.batch_wait_ms);
        let mut dropped = DropCheck { checked: None, dropped: false };
        let part = self.part();
        let mut last_error: Option<Instant> = None;
        let mut strays_since: Option<Instant> = None;
        let mut claims_checked: Option<Instant> = None;
        let mut lease_changes = leased.map(|l| l.lease.changes());
        loop {
            if let Some(l) = leased {
                match self.follow_lease(consumer, l) {
                    Ok(false) => {}
                    Ok(true) => return Exit::Reshared,
                    Err(why) => return Exit::Taken(why),
                }
            }
            let first = tokio::select! {
                m = consumer.recv() => m,
                _ = shutdown.cancelled() => return Exit::Shutdown,
                Some(Ok(())) = async { match lease_changes.as_mut() {
                    Some(c) => Some(c.changed().await),
                    None => None,
                } } => continue,
                _ = tokio::time::sleep(IDLE_TICK) => {
                    if let Some(why) = consumer.context().lost(consumer) {
                        return Exit::Lost(why);
                    }
                    let held = consumer.context().held(consumer);
                    if let Some(why) = self.fence(consumer, &held, &mut claims_checked, false).await {
                        return Exit::Lost(why);
                    }
                    // Idle, and no consumer error for a while: well.
                    if last_error.is_none_or(|t| t.elapsed() > ERRORS_STAND_FOR) {
                        self.health.report(&part, Ok(()));
                    }
                    self.report_assignment(consumer);
                    self.write_progress(None, true).await;
                    continue;
                }
            };
            let mut batch = match first {
                Ok(m) => vec![m.detach()],
                Err(e) => {
                    tracing::warn!(index = %table, error = %e, "consumer error");
                    self.health.report(&part, Err(format!("consumer error: {e}")));
                    last_error = Some(Instant::now());
                    continue;
                }
            };
            let until = tokio::time::Instant::now() + batch_wait;
            while batch.len() < batch_max {
                match tokio::time::timeout_at(until, consumer.recv()).await {
                    Ok(Ok(m)) => batch.push(m.detach()),
                    Ok(Err(e)) => {
                        tracing::warn!(index = %table, error = %e, "consumer error");
                        break;
                    }
                    Err(_) => break,
                }
            }
            let fetched = self.metrics.partition_events(table, "fetched");
            for m in &batch {
                fetched(m.partition()).inc();
            }
            // Never apply a partition this consumer does not hold. A batch
            // can straddle a revocation (those events are the new owner's
            // now); strays that keep coming mean the consumer fetches what
            // it no longer owns, and it is rebuilt.
            let held = consumer.context().held(consumer);
            let before = batch.len();
            batch.retain(|m| held.contains(&m.partition()));
            if batch.len() < before {
                let since = *strays_since.get_or_insert_with(Instant::now);
                tracing::debug!(index = %table, dropped = before - batch.len(), ?held, "events of partitions not held; not applied");
                if since.elapsed() > STRAYS_FOR {
                    return Exit::Lost(format!(
                        "it has been given events of partitions it does not hold for {STRAYS_FOR:?} (it holds {held:?})"
                    ));
                }
                if batch.is_empty() {
                    continue;
                }
            } else {
                strays_since = None;
            }
            // Before every batch: a consumer replaced by another stops
            // within one batch, so a stale consumer cannot apply old events
            // after the new owner applied newer ones (which would bring
            // back an index row a newer event deleted) for longer than a
            // batch takes.
            if let Some(why) = self.fence(consumer, &held, &mut claims_checked, true).await {
                return Exit::Lost(why);
            }
            if self.is_dropped(&mut dropped).await {
                // `bagstore index drop` ran: consume and forget, nothing to maintain.
                tracing::debug!(index = %table, events = batch.len(), "index dropped; skipping events");
            } else {
                match self.process(&batch, consumer, dlq, shutdown, &mut dropped).await {
                    Applied::Yes => {
                        self.health.report(&part, Ok(()));
                        let applied = self.metrics.partition_events(table, "applied");
                        for m in &batch {
                            applied(m.partition()).inc();
                        }
                    }
                    // Stopped while retrying: these offsets were not earned.
                    Applied::Stopped => return Exit::Shutdown,
                    Applied::Lost(why) => return Exit::Lost(why),
                }
            }
            let mut next: BTreeMap<i32, i64> = BTreeMap::new();
            for m in &batch {
                let e = next.entry(m.partition()).or_insert(0);
                *e = (*e).max(m.offset() + 1);
            }
            let mut tpl = TopicPartitionList::new();
            for (p, o) in next {
                let _ = tpl.add_partition_offset(&k.topic, p, Offset::Offset(o));
            }
            if let Err(e) = consumer.store_offsets(&tpl) {
                // A partition revoked meanwhile: its new owner replays from
                // the committed offset, which is safe.
                tracing::debug!(index = %table, error = %e, "offset store refused");
            }
            self.report_assignment(consumer);
        }
    }

    /// The change topic's partition count, asked of the broker until it
    /// answers (None: shutdown came first). The leases split this many.
    async fn partition_count(&self, shutdown: &CancellationToken) -> Option<usize> {
        let mut backoff = Duration::from_millis(100);
        loop {
            let k = self.settings.kafka.clone();
            let topic = k.topic.clone();
            let why = match tokio::task::spawn_blocking(move || kafka::partition_count(&k, &topic)).await {
                Ok(Ok(n)) if n > 0 => return Some(n),
                Ok(Ok(_)) => "the change topic has no partitions yet".to_string(),
                Ok(Err(e)) => format!("cannot read the change topic's partitions: {e}"),
                Err(e) => format!("cannot read the change topic's partitions: {e}"),
            };
            tracing::warn!(index = %self.spec.table, %why, "retrying");
            self.health.report(&self.part(), Err(why));
            if !sleep_or_stop(shutdown, backoff).await {
                return None;
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// With leases: gives a consumer that holds nothing this member's
    /// share (see [`service::leases`]), from the group's committed offsets;
    /// each partition is claimed before anything of it is applied. Ok(true)
    /// when the consumer holds partitions and the share is no longer what
    /// it holds: then a new consumer takes the new share (changing a live
    /// consumer's assignment piecemeal, `incremental_assign` and
    /// `incremental_unassign` around a broker outage, once left a consumer
    /// fetching nothing for good). An error once another process took the
    /// member name.
    fn follow_lease(&self, consumer: &StreamConsumer<Membership>, l: &Leased) -> Result<bool, String> {
        let want = l.lease.share(l.partitions)?;
        let held = consumer.context().held(consumer);
        if want == held {
            return Ok(false);
        }
        if !held.is_empty() {
            return Ok(true);
        }
        let mut tpl = TopicPartitionList::new();
        for p in &want {
            let _ = tpl.add_partition_offset(&self.settings.kafka.topic, *p, Offset::Stored);
        }
        if let Err(e) = consumer.assign(&tpl) {
            tracing::warn!(index = %self.spec.table, error = %e, "cannot take the lease's partitions; retrying");
            return Ok(false);
        }
        consumer.context().assigned(want.iter().copied().collect());
        tracing::info!(index = %self.spec.table, member = %l.lease.member(), partitions = ?want,
            "applying the member lease's share");
        self.report_assignment(consumer);
        Ok(false)
    }

    /// The partition claims (see [`service::membership`]): records this
    /// consumer's new assignments, then (every time when `always`, else at
    /// most once per CLAIMS_EVERY) whether another consumer has claimed one
    /// of `held` since. A
    /// metadata shard that does not answer decides nothing: the claims are
    /// written and compared at the next chance.
    async fn fence(
        &self,
        consumer: &StreamConsumer<Membership>,
        held: &std::collections::BTreeSet<i32>,
        checked: &mut Option<Instant>,
        always: bool,
    ) -> Option<String> {
        let watch = consumer.context();
        if !self.record_claims(consumer).await {
            return None;
        }
        if (!always && checked.is_some_and(|t| t.elapsed() < CLAIMS_EVERY)) || held.is_empty() {
            return None;
        }
        match watch.claimed_by_others(&self.shards, &self.group(), held).await {
            Ok(Some(why)) => Some(why),
            Ok(None) => {
                *checked = Some(Instant::now());
                None
            }
            Err(e) => {
                tracing::debug!(index = %self.spec.table, error = %e, "cannot compare partition claims");
                None
            }
        }
    }

    /// Records claims on the partitions assigned since the last call;
    /// false if the metadata shard did not take them (tried again later).
    async fn record_claims(&self, consumer: &StreamConsumer<Membership>) -> bool {
        match consumer.context().record_claims(&self.shards, &self.group()).await {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!(index = %self.spec.table, error = %e, "cannot record partition claims yet");
                false
            }
        }
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

    fn report_assignment(&self, consumer: &StreamConsumer<Membership>) {
        if let Ok(a) = consumer.assignment() {
            self.metrics.assigned_partitions.with_label_values(&[&self.spec.table]).set(a.count() as i64);
        }
    }

    /// Applies a batch, unless shutdown interrupts the retries or the
    /// consumer turns out to have lost its partitions (checked before each
    /// attempt: a member that lost them must not apply them).
    async fn process(
        &self,
        batch: &[OwnedMessage],
        consumer: &StreamConsumer<Membership>,
        dlq: &FutureProducer,
        shutdown: &CancellationToken,
        dropped: &mut DropCheck,
    ) -> Applied {
        let table = &self.spec.table;
        let mut ops: Vec<RowOp> = Vec::new();
        let mut poison = Vec::new();
        let mut newest_commit = None;
        let mut commits = Vec::with_capacity(batch.len());
        let mut applied = 0u64;
        for m in batch {
            match decode(m) {
                Ok(event) => {
                    ops.extend(plan(&self.spec, &event, self.shards.logical_shards()));
                    newest_commit = newest_commit.max(Some(event.committed_at_us));
                    commits.push(event.committed_at_us);
                    applied += 1;
                }
                Err(reason) => poison.push(Poison { message: m.clone(), reason }),
            }
        }
        let partitions: BTreeSet<i32> = batch.iter().map(|m| m.partition()).collect();
        let group = self.group();
        let retry_max = Duration::from_millis(self.settings.indexer.retry_max_ms);
        let mut backoff = Duration::from_millis(50);
        loop {
            if let Some(why) = consumer.context().lost(consumer) {
                return Applied::Lost(why);
            }
            // Nothing is written without this consumer's claims on the
            // batch's partitions (the metadata shard may be out of reach).
            self.record_claims(consumer).await;
            let Some(claims) = consumer.context().claims_for(&partitions) else {
                self.health.report(&self.part(), Err("cannot record partition claims".into()));
                if !sleep_or_stop(shutdown, backoff).await {
                    return Applied::Stopped;
                }
                backoff = (backoff * 2).min(retry_max);
                continue;
            };
            let start = Instant::now();
            let fence = Fence { group: &group, claims: &claims };
            match crate::apply::apply(&self.shards, &self.spec, &ops, &fence).await {
                Ok(()) => {
                    self.metrics
                        .apply_seconds
                        .with_label_values(&[table])
                        .observe(start.elapsed().as_secs_f64());
                    break;
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
                    self.health.report(&self.part(), Err(format!("applying a batch failed: {e}")));
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
        for p in poison {
            if !self.dead_letter(dlq, &p, shutdown).await {
                return Applied::Stopped;
            }
        }
        self.metrics.applied.with_label_values(&[table]).inc_by(applied);
        let now = schemas::clock::now_micros();
        let lag = self.metrics.event_lag_seconds.with_label_values(&[table]);
        for c in commits {
            lag.observe((now - c).max(0) as f64 / 1e6);
        }
        if let Some(us) = newest_commit {
            self.write_progress(Some(us), false).await;
            let g = self.metrics.last_applied.with_label_values(&[table]);
            g.set(g.get().max(us as f64 / 1e6));
        }
        Applied::Yes
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

/// The partitions of `topic` the consumer holds (its assignment).
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

/// Sleeps unless shutdown comes first; false means "stop now".
async fn sleep_or_stop(shutdown: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = shutdown.cancelled() => false,
    }
}
