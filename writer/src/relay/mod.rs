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
//!
//! Layout: this file, the relays and their leadership; [`publish`], one
//! round; [`backlog`], the backlog gauges (the leader's).

use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer, PurgeConfig};
use schemas::Settings;
use service::health::Health;
use service::kafka;
use sqlx::MySqlConnection;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use storage::shards::MAX_PHYSICAL;
use storage::{locks, outbox, Shards, StoreError};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics::Metrics;

mod backlog;
mod publish;

/// By physical id: a commit wakes that shard's relay at once instead of
/// waiting for the next poll.
#[derive(Debug)]
pub(crate) struct Wake {
    shards: Vec<Notify>,
}

impl Wake {
    pub(crate) fn new() -> Wake {
        Wake { shards: (0..MAX_PHYSICAL).map(|_| Notify::new()).collect() }
    }

    /// Wakes `shard`'s relay (or, if it is busy, its next wait ends at once).
    pub(crate) fn wake(&self, shard: usize) {
        self.shards[shard].notify_one();
    }

    async fn woken(&self, shard: usize) {
        self.shards[shard].notified().await
    }
}

/// Every shard's relay: what each needs, shared.
#[derive(Debug)]
pub(crate) struct Relays {
    settings: Settings,
    shards: Shards,
    metrics: Metrics,
    /// Where each relay reports how it is doing (`/health/ready`).
    health: Health,
    wake: Arc<Wake>,
}

/// Why a relay let go of its shard's server.
const MOVED: &str = "the shard moved to another server";

impl Relays {
    pub(crate) fn new(
        settings: Settings,
        shards: Shards,
        metrics: Metrics,
        health: Health,
        wake: Arc<Wake>,
    ) -> Relays {
        Relays { settings, shards, metrics, health, wake }
    }

    /// Starts one relay task per physical shard on `tracker`, and one for
    /// every shard added online later (checked every second); they stop at
    /// `shutdown` after finishing the round in hand.
    pub(crate) fn spawn(
        self: &Arc<Relays>,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<(), KafkaError> {
        let mut started = BTreeSet::new();
        self.spawn_new(tracker, &shutdown, &mut started)?;
        let (relays, tracker2) = (self.clone(), tracker.clone());
        tracker.spawn(async move {
            while !shutdown.is_cancelled() {
                sleep_or_stop(&shutdown, Duration::from_secs(1)).await;
                if let Err(e) = relays.spawn_new(&tracker2, &shutdown, &mut started) {
                    tracing::error!(error = %e, "cannot start a relay");
                }
            }
        });
        Ok(())
    }

    fn spawn_new(
        self: &Arc<Relays>,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        started: &mut BTreeSet<usize>,
    ) -> Result<(), KafkaError> {
        for shard in self.shards.ids() {
            if started.contains(&shard) || shutdown.is_cancelled() {
                continue;
            }
            // One producer per shard: a fatal idempotence error then costs
            // only that shard a producer rebuild.
            let producer: FutureProducer =
                kafka::create(&kafka::relay_producer_config(&self.settings.kafka))?;
            let relays = self.clone();
            let shutdown = shutdown.clone();
            tracker.spawn(async move { relays.relay(shard, producer, shutdown).await });
            started.insert(shard);
        }
        Ok(())
    }

    /// One shard's relay until `shutdown`: tries to lead, publishes while
    /// it leads, and tries again when leadership ends.
    async fn relay(&self, shard: usize, mut producer: FutureProducer, shutdown: CancellationToken) {
        let poll = Duration::from_millis(self.settings.writer.relay_poll_ms);
        let label = shard.to_string();
        let leader_gauge = self.metrics.relay_leader.with_label_values(&[&label]);
        let part = format!("relay {}", self.shards.name(shard));
        while !shutdown.is_cancelled() {
            // Everything below is tied to the server the shard is on now;
            // should the shard leave it (a failover, a switchover), what is
            // still waiting on it is let go (a frozen old primary answers
            // nothing, and a commit there never completes).
            let generation = self.shards.generation(shard);
            let connect = storage::dsn::dedicated_connection(self.shards.dsn(shard));
            let connected = tokio::select! {
                c = connect => c.map_err(|e| e.to_string()),
                _ = self.shards.moved(shard, generation) => Err(MOVED.to_string()),
            };
            let mut conn = match connected {
                Ok(c) => c,
                Err(e) => {
                    self.health.report(&part, Err(format!("cannot reach its shard: {e}")));
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
            let led = tokio::select! {
                led = self.lead(shard, &mut conn, &mut producer, &shutdown) => led,
                _ = self.shards.moved(shard, generation) => {
                    // A round let go of may have events in flight: they
                    // must not land after the next leader's resends.
                    self.replace_producer(shard, &mut producer, MOVED);
                    Err(StoreError::Shard { shard, source: sqlx::Error::Protocol(MOVED.into()) })
                }
            };
            if let Err(e) = led {
                self.health.report(&part, Err(format!("leadership ended: {e}")));
                tracing::warn!(shard, error = %e, "relay leadership ended");
                sleep_or_stop(&shutdown, poll).await;
            }
            leader_gauge.set(0);
            // A follower has nothing to fail at; the next leader reports.
            self.health.report(&part, Ok(()));
            backlog::forget(self, shard);
        }
    }

    /// Publishes while the lock is ours. Returns Ok at shutdown (after
    /// draining, see [`Drain`]), Err when the shard fails or the lock is gone.
    async fn lead(
        &self,
        shard: usize,
        lock_conn: &mut MySqlConnection,
        producer: &mut FutureProducer,
        shutdown: &CancellationToken,
    ) -> Result<(), StoreError> {
        let poll = Duration::from_millis(self.settings.writer.relay_poll_ms);
        let mut backoff = poll;
        let part = format!("relay {}", self.shards.name(shard));
        let mut drain = Drain::default();
        let mut backlog_due = backlog::Every::default();
        loop {
            if drain.over(shard, shutdown, Duration::from_millis(self.settings.http.shutdown_grace_ms) / 2) {
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
            let (read, acked) = publish::round(self, shard, lock_conn, producer).await?;
            if read == 0 {
                self.health.report(&part, Ok(()));
                if backlog_due.due() {
                    backlog::report(self, shard).await;
                }
                if drain.draining() {
                    tracing::info!(shard, "relay drained the outbox");
                    return Ok(());
                }
                tokio::select! {
                    _ = self.wake.woken(shard) => {}
                    _ = tokio::time::sleep(poll) => {}
                    _ = shutdown.cancelled() => return Ok(()),
                }
                continue;
            }
            if backlog_due.due() {
                backlog::report(self, shard).await;
            }
            if acked < read {
                if drain.draining() {
                    // Kafka refuses now; the rows stay for the next leader.
                    return Ok(());
                }
                // A round Kafka did not fully acknowledge ends this
                // producer session (see `replace_producer`).
                self.replace_producer(
                    shard,
                    producer,
                    &format!("Kafka did not acknowledge {} change events", read - acked),
                );
                sleep_or_stop(shutdown, backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            } else {
                self.health.report(&part, Ok(()));
                backoff = poll;
            }
        }
    }

    /// Ends the session of `producer` (a round it sent was not fully
    /// acknowledged, or was let go of, see `why`): it is purged and a new
    /// one takes its place.
    ///
    /// Why not keep the producer: its messages never time out inside
    /// librdkafka (see `kafka::relay_producer_config`), so the ones still
    /// out would be delivered later, after the ones the next round sends
    /// again (the rows are still in the outbox, so nothing is lost). The
    /// next round starts a new producer session (a new producer id).
    /// Dropped, the old one sends nothing more: what it had in flight lands
    /// or not, and the broker's sequence check for its producer id lets it
    /// land only as a prefix of what it was given, so an entity's first
    /// occurrences on the topic stay in version order. And after a fatal
    /// idempotence error a producer cannot go on at all.
    fn replace_producer(&self, shard: usize, producer: &mut FutureProducer, why: &str) {
        let reason = producer.client().fatal_error().map(|(_, why)| why);
        let part = format!("relay {}", self.shards.name(shard));
        self.health.report(&part, Err(why.to_string()));
        tracing::warn!(shard, why, ?reason, "round not completed; starting a new producer");
        // Nothing the old producer still holds may reach the topic after
        // what the next one sends (an older version landing after a newer
        // one's resend): its queue is purged now, before the next producer
        // exists, not when it is dropped. What it had already written to a
        // broker's socket was written before this.
        //
        // Purging waits for librdkafka's broker threads: briefly, but not
        // on a runtime thread as is.
        tokio::task::block_in_place(|| producer.purge(PurgeConfig::default().queue().inflight()));
        match kafka::create(&kafka::relay_producer_config(&self.settings.kafka)) {
            Ok(p) => {
                let old = std::mem::replace(producer, p);
                // Dropping purges its queue and waits up to 500 ms: not on
                // a runtime thread.
                tokio::task::spawn_blocking(move || drop(old));
            }
            Err(e) => tracing::error!(shard, error = %e, "cannot create a producer"),
        }
    }
}

/// A relay's stop. Set once shutdown is asked for: until then the relay
/// keeps publishing what is committed (HTTP has stopped, so nothing new
/// arrives), so a graceful stop leaves an empty outbox when Kafka is up. A
/// round already sent is always awaited and its acknowledged rows deleted:
/// a stop never leaves a published row behind.
#[derive(Debug, Default)]
struct Drain {
    until: Option<tokio::time::Instant>,
}

impl Drain {
    /// Starts draining (for `budget`) once `shutdown` is asked for; true
    /// once the budget is spent.
    fn over(&mut self, shard: usize, shutdown: &CancellationToken, budget: Duration) -> bool {
        if shutdown.is_cancelled() && self.until.is_none() {
            self.until = Some(tokio::time::Instant::now() + budget);
            tracing::info!(shard, ?budget, "relay draining the outbox before stopping");
        }
        let over = self.until.is_some_and(|t| tokio::time::Instant::now() >= t);
        if over {
            tracing::warn!(shard, "relay stopping with rows still in the outbox; the next leader sends them");
        }
        over
    }

    fn draining(&self) -> bool {
        self.until.is_some()
    }
}

async fn sleep_or_stop(shutdown: &CancellationToken, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = shutdown.cancelled() => {}
    }
}
