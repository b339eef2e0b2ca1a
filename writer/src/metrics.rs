//! Writer series. All names `bagstore_writer_…`, labels only `shard`/`kind`.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

#[derive(Debug, Clone)]
pub struct Metrics {
    /// Committed writes by kind (`put`, `delete`, `patch`).
    pub writes: IntCounterVec,
    /// Events acknowledged by Kafka and removed from the outbox.
    pub published: IntCounterVec,
    /// Publish attempts Kafka did not acknowledge (the rows stay and are retried).
    pub publish_failures: IntCounterVec,
    /// Rows waiting in the outbox, as seen by the shard's relay leader.
    pub outbox_backlog: IntGaugeVec,
    /// Commit time of the oldest waiting row (0 when the outbox is empty).
    pub outbox_oldest: prometheus::GaugeVec,
    /// 1 while this process is the shard's relay leader.
    pub relay_leader: IntGaugeVec,
    /// Single writes committed together by one group commit.
    pub group_size: HistogramVec,
    /// Single writes waiting for a free commit slot.
    pub queued: IntGaugeVec,
    /// Writes sent again after their shard turned out not to own them (a
    /// stale map: a move's cutover, or one completed since the map loaded).
    pub stale_map_retries: prometheus::IntCounter,
    /// Writes admitted and not yet answered (at most writer.max_pending_writes).
    pub pending: prometheus::IntGauge,
    /// Writes refused with 429 because the bound was reached.
    pub refused: prometheus::IntCounter,
    /// Writes answered 503 `outcome-unknown`: their commit did not answer
    /// within `writer.commit_timeout_ms` (and may still commit).
    pub outcome_unknown: prometheus::IntCounter,
    /// Kafka ingest commands by outcome: `applied`, `duplicate` (a replay
    /// under its guard: nothing written), `refused` (the write path said
    /// no), `malformed` (not a command).
    pub ingest_commands: IntCounterVec,
    /// Commands on the ingest topic the writers' group has not committed.
    pub ingest_lag: prometheus::IntGauge,
    /// Ingest topic partitions this writer holds now.
    pub ingest_partitions: prometheus::IntGauge,
    /// Semi-sync replicas the shard's primary has connected (-1: the shard
    /// has no replicas, or replication is asynchronous by choice); at 0
    /// the shard refuses writes.
    pub acknowledging: IntGaugeVec,
}

impl Metrics {
    pub fn register(r: &Registry) -> prometheus::Result<Metrics> {
        let m = Metrics::new()?;
        for outcome in ["applied", "duplicate", "refused", "malformed"] {
            m.ingest_commands.with_label_values(&[outcome]);
        }
        let all: [Box<dyn prometheus::core::Collector>; 16] = [
            Box::new(m.outcome_unknown.clone()),
            Box::new(m.ingest_commands.clone()),
            Box::new(m.ingest_lag.clone()),
            Box::new(m.ingest_partitions.clone()),
            Box::new(m.acknowledging.clone()),
            Box::new(m.pending.clone()),
            Box::new(m.refused.clone()),
            Box::new(m.stale_map_retries.clone()),
            Box::new(m.writes.clone()),
            Box::new(m.published.clone()),
            Box::new(m.publish_failures.clone()),
            Box::new(m.outbox_backlog.clone()),
            Box::new(m.outbox_oldest.clone()),
            Box::new(m.relay_leader.clone()),
            Box::new(m.group_size.clone()),
            Box::new(m.queued.clone()),
        ];
        for c in all {
            r.register(c)?;
        }
        Ok(m)
    }

    fn new() -> prometheus::Result<Metrics> {
        Ok(Metrics {
            writes: IntCounterVec::new(
                Opts::new("bagstore_writer_writes_total", "Committed entity writes"),
                &["shard", "kind"],
            )?,
            published: IntCounterVec::new(
                Opts::new("bagstore_writer_events_published_total", "Change events acknowledged by Kafka"),
                &["shard"],
            )?,
            publish_failures: IntCounterVec::new(
                Opts::new(
                    "bagstore_writer_publish_failures_total",
                    "Change events Kafka did not acknowledge",
                ),
                &["shard"],
            )?,
            outbox_backlog: IntGaugeVec::new(
                Opts::new("bagstore_writer_outbox_backlog_rows", "Change events waiting in the outbox"),
                &["shard"],
            )?,
            outbox_oldest: prometheus::GaugeVec::new(
                Opts::new(
                    "bagstore_writer_outbox_oldest_commit_timestamp_seconds",
                    "Commit time of the oldest unpublished change event (0 when none)",
                ),
                &["shard"],
            )?,
            relay_leader: IntGaugeVec::new(
                Opts::new("bagstore_writer_relay_leader", "1 while this process relays the shard's outbox"),
                &["shard"],
            )?,
            group_size: HistogramVec::new(
                HistogramOpts::new(
                    "bagstore_writer_commit_group_writes",
                    "Single writes committed together in one transaction (group commit)",
                )
                .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]),
                &["shard"],
            )?,
            queued: IntGaugeVec::new(
                Opts::new(
                    "bagstore_writer_commit_queue_writes",
                    "Single writes waiting for a free commit slot (group commit)",
                ),
                &["shard"],
            )?,
            stale_map_retries: prometheus::IntCounter::new(
                "bagstore_writer_stale_map_retries_total",
                "Writes sent again after their shard turned out not to own them (the map was stale)",
            )?,
            pending: prometheus::IntGauge::new(
                "bagstore_writer_pending_writes",
                "Writes admitted and not yet answered (bounded by writer.max_pending_writes)",
            )?,
            refused: prometheus::IntCounter::new(
                "bagstore_writer_overload_refusals_total",
                "Writes answered 429 because writer.max_pending_writes were in hand",
            )?,
            outcome_unknown: prometheus::IntCounter::new(
                "bagstore_writer_outcome_unknown_total",
                "Writes answered 503 outcome-unknown: the commit did not answer within writer.commit_timeout_ms",
            )?,
            ingest_commands: IntCounterVec::new(
                Opts::new(
                    "bagstore_ingest_commands_total",
                    "Kafka ingest commands by outcome (applied, duplicate, refused, malformed)",
                ),
                &["outcome"],
            )?,
            ingest_lag: prometheus::IntGauge::new(
                "bagstore_ingest_lag_messages",
                "Commands on the ingest topic not yet committed by the writers' consumer group",
            )?,
            ingest_partitions: prometheus::IntGauge::new(
                "bagstore_ingest_assigned_partitions",
                "Ingest topic partitions this writer consumes",
            )?,
            acknowledging: IntGaugeVec::new(
                Opts::new(
                    "bagstore_writer_acknowledging_replicas",
                    "Semi-sync replicas connected to the shard's primary (-1: none expected); at 0 its writes are refused",
                ),
                &["shard"],
            )?,
        })
    }

    /// Every shard's series at 0 from the start, so dashboards and
    /// increase() see the first failure.
    pub fn start_at_zero(&self, shards: &[usize]) {
        for shard in shards {
            let s = shard.to_string();
            self.published.with_label_values(&[&s]);
            self.publish_failures.with_label_values(&[&s]);
            self.relay_leader.with_label_values(&[&s]);
            self.queued.with_label_values(&[&s]);
            for kind in ["put", "delete", "patch"] {
                self.writes.with_label_values(&[&s, kind]);
            }
        }
    }
}
