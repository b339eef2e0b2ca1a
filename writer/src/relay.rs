//! The outbox relay: per shard, exactly one process publishes the outbox at
//! a time. Leadership is a MySQL named lock held on a dedicated connection;
//! when the holder dies its connection closes, the server frees the lock,
//! and a follower (polling every few hundred ms) takes over.
//!
//! A round: read the oldest rows in `seq` order, enqueue them all on the
//! idempotent producer in that order, await every acknowledgement (up to
//! `kafka.message_timeout_ms`), then delete the acknowledged prefix. Rows
//! after the first failure stay and are sent again next round by a new
//! producer, so an entity's events are never skipped, re-sends always end
//! with the latest version, and no version reaches the topic before an
//! earlier one first does.

use futures::stream::{FuturesOrdered, StreamExt};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer, PurgeConfig};
use schemas::changes;
use schemas::event::ChangeEvent;
use service::kafka;
use sqlx::MySqlConnection;
use std::time::{Duration, Instant};
use storage::outbox::{self, OutboxRow};
use storage::{locks, StoreError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::Writer;

/// How often a leading relay refreshes the outbox backlog gauges.
const BACKLOG_EVERY: Duration = Duration::from_millis(500);

impl Writer {
    /// Starts one relay task per physical shard on `tracker`, and one for
    /// every shard added online later (checked every second); they stop at
    /// `shutdown` after finishing the round in hand.
    pub fn spawn_relays(
        &self,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<(), rdkafka::error::KafkaError> {
        let mut started = std::collections::BTreeSet::new();
        self.spawn_new_relays(tracker, &shutdown, &mut started)?;
        let (writer, tracker2) = (self.clone(), tracker.clone());
        tracker.spawn(async move {
            while !shutdown.is_cancelled() {
                sleep_or_stop(&shutdown, Duration::from_secs(1)).await;
                if let Err(e) = writer.spawn_new_relays(&tracker2, &shutdown, &mut started) {
                    tracing::error!(error = %e, "cannot start a relay");
                }
            }
        });
        Ok(())
    }

    fn spawn_new_relays(
        &self,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        started: &mut std::collections::BTreeSet<usize>,
    ) -> Result<(), rdkafka::error::KafkaError> {
        for shard in self.shards().ids() {
            if started.contains(&shard) || shutdown.is_cancelled() {
                continue;
            }
            // One producer per shard: a fatal idempotence error then costs
            // only that shard a producer rebuild.
            let producer: FutureProducer =
                kafka::create(&kafka::relay_producer_config(&self.settings().kafka))?;
            let writer = self.clone();
            let shutdown = shutdown.clone();
            tracker.spawn(async move { writer.relay(shard, producer, shutdown).await });
            started.insert(shard);
        }
        Ok(())
    }

    async fn relay(&self, shard: usize, mut producer: FutureProducer, shutdown: CancellationToken) {
        let poll = Duration::from_millis(self.settings().writer.relay_poll_ms);
        let label = shard.to_string();
        let leader_gauge = self.inner.metrics.relay_leader.with_label_values(&[&label]);
        let part = format!("relay {}", self.shards().name(shard));
        while !shutdown.is_cancelled() {
            let mut conn = match storage::shards::dedicated_connection(self.shards().dsn(shard)).await {
                Ok(c) => c,
                Err(e) => {
                    self.inner.health.report(&part, Err(format!("cannot reach its shard: {e}")));
                    tracing::warn!(shard, error = %e, "relay cannot reach its shard");
                    sleep_or_stop(&shutdown, poll * 5).await;
                    continue;
                }
            };
            match locks::try_relay_lock(shard, &mut conn).await {
                Ok(true) => {}
                Ok(false) => {
                    // Someone else leads; keep the connection and ask again.
                    sleep_or_stop(&shutdown, poll).await;
                    continue;
                }
                Err(e) => {
                    tracing::warn!(shard, error = %e, "relay lock request failed");
                    sleep_or_stop(&shutdown, poll).await;
                    continue;
                }
            }
            tracing::info!(shard, "relay leader");
            leader_gauge.set(1);
            if let Err(e) = outbox::log_deletes_by_key(shard, &mut conn).await {
                tracing::warn!(
                    shard,
                    error = %e,
                    "the relay's deletes log whole rows to the binary log (grant BINLOG ADMIN to log their keys only)"
                );
            }
            let led = self.lead(shard, &mut conn, &mut producer, &shutdown).await;
            if let Err(e) = led {
                self.inner.health.report(&part, Err(format!("leadership ended: {e}")));
                tracing::warn!(shard, error = %e, "relay leadership ended");
                sleep_or_stop(&shutdown, poll).await;
            }
            leader_gauge.set(0);
            // A follower has nothing to fail at; the next leader reports.
            self.inner.health.report(&part, Ok(()));
            // Only the leader knows the backlog; a follower exports none.
            let _ = self.inner.metrics.outbox_backlog.remove_label_values(&[&label]);
            let _ = self.inner.metrics.outbox_oldest.remove_label_values(&[&label]);
        }
    }

    /// Publishes while the lock is ours. Returns Ok at shutdown (after
    /// draining, see below), Err when the shard fails or the lock is gone.
    async fn lead(
        &self,
        shard: usize,
        lock_conn: &mut MySqlConnection,
        producer: &mut FutureProducer,
        shutdown: &CancellationToken,
    ) -> Result<(), StoreError> {
        let poll = Duration::from_millis(self.settings().writer.relay_poll_ms);
        let mut backoff = poll;
        let part = format!("relay {}", self.shards().name(shard));
        // Set once shutdown is asked for: until then the relay keeps
        // publishing what is committed (HTTP has stopped, so nothing new
        // arrives), so a graceful stop leaves an empty outbox when Kafka is
        // up. A round already sent is always awaited and its acknowledged
        // rows deleted: a stop never leaves a published row behind.
        let mut drain_until: Option<tokio::time::Instant> = None;
        // The backlog gauges cost a statement; refreshed at most this often.
        let mut backlog_at: Option<Instant> = None;
        let mut report = || {
            let due = backlog_at.is_none_or(|t| t.elapsed() >= BACKLOG_EVERY);
            if due {
                backlog_at = Some(Instant::now());
            }
            due
        };
        loop {
            if shutdown.is_cancelled() && drain_until.is_none() {
                let budget = Duration::from_millis(self.settings().http.shutdown_grace_ms) / 2;
                drain_until = Some(tokio::time::Instant::now() + budget);
                tracing::info!(shard, ?budget, "relay draining the outbox before stopping");
            }
            if drain_until.is_some_and(|t| tokio::time::Instant::now() >= t) {
                tracing::warn!(
                    shard,
                    "relay stopping with rows still in the outbox; the next leader sends them"
                );
                return Ok(());
            }
            // Checked every round: if our connection was killed, another
            // relay may already lead, and two publishers would interleave.
            if !locks::holds_relay_lock(shard, lock_conn).await? {
                return Err(StoreError::Shard {
                    shard,
                    source: sqlx::Error::Protocol("relay lock lost".into()),
                });
            }
            let (read, acked) = self.table_round(shard, lock_conn, producer).await?;
            if read == 0 {
                self.inner.health.report(&part, Ok(()));
                if report() {
                    self.report_backlog(shard).await;
                }
                if drain_until.is_some() {
                    tracing::info!(shard, "relay drained the outbox");
                    return Ok(());
                }
                tokio::select! {
                    _ = self.inner.wake[shard].notified() => {}
                    _ = tokio::time::sleep(poll) => {}
                    _ = shutdown.cancelled() => return Ok(()),
                }
                continue;
            }
            if report() {
                self.report_backlog(shard).await;
            }
            if acked < read {
                if drain_until.is_some() {
                    // Kafka refuses now; the rows stay for the next leader.
                    return Ok(());
                }
                // A round Kafka did not fully acknowledge ends this producer
                // session; the next round starts a new one (a new producer
                // id). The rows are still in the outbox, so nothing is lost.
                // Why not keep the producer: its messages never time out
                // inside librdkafka (see `kafka::relay_producer_config`), so the
                // ones still out would be delivered later, after the ones
                // the next round sends again. Dropped, it sends nothing
                // more: what it had in flight lands or not, and the broker's
                // sequence check for its producer id lets it land only as a
                // prefix of what it was given, so an entity's first
                // occurrences on the topic stay in version order. And after
                // a fatal idempotence error a producer cannot go on at all.
                let reason = producer.client().fatal_error().map(|(_, why)| why);
                let unsent = read - acked;
                self.inner
                    .health
                    .report(&part, Err(format!("Kafka did not acknowledge {unsent} change events")));
                tracing::warn!(shard, ?reason, "round not acknowledged; starting a new producer");
                // Nothing the old producer still holds may reach the topic
                // after what the next one sends (an older version landing
                // after a newer one's resend): its queue is purged now,
                // before the next producer exists, not when it is dropped.
                // What it had already written to a broker's socket was
                // written before this.
                self.replace_producer(shard, producer);
                sleep_or_stop(shutdown, backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            } else {
                self.inner.health.report(&part, Ok(()));
                backoff = poll;
            }
        }
    }

    /// Purges `producer` and puts a new one in its place (see `lead` for
    /// why a round Kafka refused ends its producer).
    fn replace_producer(&self, shard: usize, producer: &mut FutureProducer) {
        // Purging waits for librdkafka's broker threads: briefly, but not
        // on a runtime thread as is.
        tokio::task::block_in_place(|| producer.purge(PurgeConfig::default().queue().inflight()));
        match kafka::create(&kafka::relay_producer_config(&self.settings().kafka)) {
            Ok(p) => {
                let old = std::mem::replace(producer, p);
                // Dropping purges its queue and waits up to 500 ms: not on
                // a runtime thread.
                tokio::task::spawn_blocking(move || drop(old));
            }
            Err(e) => tracing::error!(shard, error = %e, "cannot create a producer"),
        }
    }

    /// One round of the outbox table: reads up to `writer.relay_batch` rows
    /// in order, publishes them and deletes the acknowledged prefix.
    /// Returns how many rows it read and how many Kafka acknowledged.
    async fn table_round(
        &self,
        shard: usize,
        conn: &mut MySqlConnection,
        producer: &FutureProducer,
    ) -> Result<(usize, usize), StoreError> {
        let rows = outbox::read_outbox(shard, conn, self.settings().writer.relay_batch).await?;
        if rows.is_empty() {
            return Ok((0, 0));
        }
        let acked = self.publish(shard, producer, &rows).await;
        if acked > 0 {
            let seqs: Vec<u64> = rows[..acked].iter().map(|r| r.seq).collect();
            outbox::delete_outbox(shard, conn, &seqs).await?;
            self.inner.metrics.published.with_label_values(&[&shard.to_string()]).inc_by(acked as u64);
        }
        Ok((rows.len(), acked))
    }

    /// Sends the rows in order, each to the change topic and (when on) as
    /// its envelope to the public change stream, and returns how many
    /// leading rows Kafka acknowledged on both.
    async fn publish(&self, shard: usize, producer: &FutureProducer, rows: &[OutboxRow]) -> usize {
        let topic = &self.settings().kafka.topic;
        let changes = &self.settings().changes;
        let mut pending = Vec::with_capacity(rows.len() * 2);
        // Messages enqueued per row, for the rows enqueued whole.
        let mut per_row: Vec<usize> = Vec::with_capacity(rows.len());
        'rows: for row in rows {
            let record = FutureRecord::to(topic).key(&row.entity_id.0[..]).payload(&row.event[..]);
            match producer.send_result(record) {
                Ok(f) => pending.push(f),
                Err((e, _)) => {
                    tracing::warn!(shard, error = %e, "cannot enqueue change event");
                    break;
                }
            }
            let mut sent = 1;
            if let Some(m) = changes.enabled.then(|| self.public_message(shard, row)).flatten() {
                let headers = OwnedHeaders::new()
                    .insert(Header { key: changes::HEADER_VERSION, value: Some(&m.version) })
                    .insert(Header { key: changes::HEADER_OP, value: Some(m.op.as_str()) });
                let record = FutureRecord::to(&changes.topic).key(&m.key).payload(&m.value).headers(headers);
                match producer.send_result(record) {
                    Ok(f) => pending.push(f),
                    Err((e, _)) => {
                        tracing::warn!(shard, error = %e, "cannot enqueue a change stream message");
                        break 'rows;
                    }
                }
                sent += 1;
            }
            per_row.push(sent);
        }
        // Acknowledgements in send order, up to the relay's deadline; those
        // still out then count as failed (the caller replaces the producer).
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(self.settings().kafka.message_timeout_ms);
        let mut in_order: FuturesOrdered<_> = pending.into_iter().collect();
        let mut results = Vec::with_capacity(in_order.len());
        while let Ok(Some(r)) = tokio::time::timeout_at(deadline, in_order.next()).await {
            results.push(r);
        }
        // A row counts once every message it was sent as is acknowledged.
        let (mut at, mut acked) = (0, 0);
        for n in per_row {
            if results.len() < at + n || !results[at..at + n].iter().all(|r| matches!(r, Ok(Ok(_)))) {
                break;
            }
            at += n;
            acked += 1;
        }
        if acked < rows.len() {
            let failed = rows.len() - acked;
            self.inner
                .metrics
                .publish_failures
                .with_label_values(&[&shard.to_string()])
                .inc_by(failed as u64);
            match results.iter().find(|r| !matches!(r, Ok(Ok(_)))) {
                Some(Ok(Err((e, _)))) => {
                    tracing::warn!(shard, error = %e, failed, "Kafka did not acknowledge change events; will retry")
                }
                _ => tracing::warn!(
                    shard,
                    failed,
                    "Kafka did not acknowledge change events in time; will retry"
                ),
            }
        }
        acked
    }

    /// A row's message on the public change stream; None (logged) for an
    /// event that does not decode, which the change topic still carries
    /// (its consumers dead-letter it).
    fn public_message(&self, shard: usize, row: &OutboxRow) -> Option<changes::ChangeMessage> {
        match ChangeEvent::decode(&row.event) {
            Ok(event) => {
                let logical = self.shards().logical_of_id(&event.id);
                Some(changes::change_message(&event, logical, self.shards().name(shard)))
            }
            Err(e) => {
                tracing::error!(shard, id = %row.entity_id, error = %e, "an outbox event does not decode; left out of the change stream");
                None
            }
        }
    }

    async fn report_backlog(&self, shard: usize) {
        let label = shard.to_string();
        match outbox::outbox_backlog(shard, self.shards().pool(shard)).await {
            Ok(backlog) => {
                self.inner.metrics.outbox_backlog.with_label_values(&[&label]).set(backlog.rows as i64);
                let oldest = backlog.oldest_commit_us.map_or(0.0, |us| us as f64 / 1e6);
                self.inner.metrics.outbox_oldest.with_label_values(&[&label]).set(oldest);
            }
            Err(e) => tracing::debug!(shard, error = %e, "backlog query failed"),
        }
    }
}

async fn sleep_or_stop(shutdown: &CancellationToken, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = shutdown.cancelled() => {}
    }
}
