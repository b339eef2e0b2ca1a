//! Indexer series, `bagstore_indexer_…`, labelled by `index` (and
//! `partition` where it matters). One set per process, shared by all the
//! index consumers it runs.

use prometheus::{
    GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

#[derive(Debug, Clone)]
pub struct Metrics {
    pub applied: IntCounterVec,
    /// Apply attempts that failed on the database (retried; offsets held).
    pub failed: IntCounterVec,
    /// Apply attempts that found a shard no longer owns a logical shard
    /// (a move cut over): the map is reloaded and the batch applied again.
    pub stale_map_retries: IntCounterVec,
    pub dead_lettered: IntCounterVec,
    pub apply_seconds: HistogramVec,
    /// Per event: from the write's commit to its index rows' commit.
    pub event_lag_seconds: HistogramVec,
    /// Commit time of the newest event applied.
    pub last_applied: GaugeVec,
    pub assigned_partitions: IntGaugeVec,
    /// Events this process took from each partition (`stage="fetched"`)
    /// and applied (`stage="applied"`): who really works on a partition,
    /// whatever the group says it owns.
    pub partition_events: IntCounterVec,
    /// Consumers closed and rebuilt because they had lost their partitions.
    pub rejoins: IntCounterVec,
}

impl Metrics {
    pub fn register(r: &Registry) -> prometheus::Result<Metrics> {
        let m = Metrics {
            applied: IntCounterVec::new(
                Opts::new("bagstore_indexer_events_applied_total", "Change events applied to the index"),
                &["index"],
            )?,
            failed: IntCounterVec::new(
                Opts::new(
                    "bagstore_indexer_apply_failures_total",
                    "Batch applies that failed and were retried",
                ),
                &["index"],
            )?,
            stale_map_retries: IntCounterVec::new(
                Opts::new(
                    "bagstore_indexer_stale_map_retries_total",
                    "Batch applies retried on a reloaded shard map (a move took a logical shard away)",
                ),
                &["index"],
            )?,
            dead_lettered: IntCounterVec::new(
                Opts::new(
                    "bagstore_indexer_events_dead_lettered_total",
                    "Undecodable events sent to the dead-letter topic",
                ),
                &["index"],
            )?,
            apply_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "bagstore_indexer_apply_duration_seconds",
                    "Time to apply one batch to MySQL",
                )
                .buckets(vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]),
                &["index"],
            )?,
            event_lag_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "bagstore_indexer_event_lag_seconds",
                    "Per change event, time from the write's commit to its index rows' commit",
                )
                .buckets(vec![
                    0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0,
                ]),
                &["index"],
            )?,
            last_applied: GaugeVec::new(
                Opts::new(
                    "bagstore_indexer_last_applied_commit_timestamp_seconds",
                    "Commit time of the newest change event applied to the index",
                ),
                &["index"],
            )?,
            assigned_partitions: IntGaugeVec::new(
                Opts::new(
                    "bagstore_indexer_assigned_partitions",
                    "Topic partitions this process consumes for the index",
                ),
                &["index"],
            )?,
            partition_events: IntCounterVec::new(
                Opts::new(
                    "bagstore_indexer_partition_events_total",
                    "Change events this process fetched from, and applied for, each partition",
                ),
                &["index", "partition", "stage"],
            )?,
            rejoins: IntCounterVec::new(
                Opts::new(
                    "bagstore_indexer_consumer_rejoins_total",
                    "Consumers closed and replaced by a new one (taking the lease's share afresh) because they had lost their partitions",
                ),
                &["index"],
            )?,
        };
        r.register(Box::new(m.applied.clone()))?;
        r.register(Box::new(m.failed.clone()))?;
        r.register(Box::new(m.stale_map_retries.clone()))?;
        r.register(Box::new(m.dead_lettered.clone()))?;
        r.register(Box::new(m.apply_seconds.clone()))?;
        r.register(Box::new(m.event_lag_seconds.clone()))?;
        r.register(Box::new(m.last_applied.clone()))?;
        r.register(Box::new(m.assigned_partitions.clone()))?;
        r.register(Box::new(m.partition_events.clone()))?;
        r.register(Box::new(m.rejoins.clone()))?;
        Ok(m)
    }

    /// The per-partition counter of one index and stage, by partition.
    pub fn partition_events<'a>(&'a self, index: &'a str, stage: &'a str) -> impl Fn(i32) -> IntCounter + 'a {
        move |p| self.partition_events.with_label_values(&[index, &p.to_string(), stage])
    }
}
