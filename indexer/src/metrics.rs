//! Indexer series, `bagstore_indexer_…`, labelled by `index` (and
//! `partition` where it matters). One set per process, shared by all the
//! index consumers it runs.

use prometheus::{GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

#[derive(Debug, Clone)]
pub struct Metrics {
    pub applied: IntCounterVec,
    /// Apply attempts that failed on the database (retried; offsets held).
    pub failed: IntCounterVec,
    pub dead_lettered: IntCounterVec,
    pub apply_seconds: HistogramVec,
    /// Per event: from the write's commit to its index rows' commit.
    pub event_lag_seconds: HistogramVec,
    /// Commit time of the newest event applied.
    pub last_applied: GaugeVec,
    pub assigned_partitions: IntGaugeVec,
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
        };
        r.register(Box::new(m.applied.clone()))?;
        r.register(Box::new(m.failed.clone()))?;
        r.register(Box::new(m.dead_lettered.clone()))?;
        r.register(Box::new(m.apply_seconds.clone()))?;
        r.register(Box::new(m.event_lag_seconds.clone()))?;
        r.register(Box::new(m.last_applied.clone()))?;
        r.register(Box::new(m.assigned_partitions.clone()))?;
        Ok(m)
    }
}

/// Cleaner series, `bagstore_cleaner_…` (and `bagstore_index_state`).
#[derive(Debug, Clone)]
pub struct CleanerMetrics {
    /// Drift found, by index and kind (`missing`, `dangling`).
    pub drift_found: IntCounterVec,
    /// Drift repaired, by index and kind.
    pub drift_fixed: IntCounterVec,
    /// Entities (and index entity ids) examined, per index.
    pub rows_scanned: IntCounterVec,
    /// Completed full sweeps (every shard's entities and index tables).
    pub sweeps: prometheus::IntCounter,
    /// Duration of the last completed sweep.
    pub sweep_seconds: prometheus::Gauge,
    pub backfill_progress: GaugeVec,
    pub backfill_rows: IntCounterVec,
    /// 0 CREATING, 1 BACKFILLING, 2 ACTIVE, 3 DROPPING.
    pub index_state: IntGaugeVec,
    /// Events on the topic the index's group has not committed, per partition.
    pub partition_lag: IntGaugeVec,
    /// The same, summed over partitions.
    pub lag_events: IntGaugeVec,
    /// Newest commit on any shard minus the newest commit the index applied.
    pub lag_seconds: GaugeVec,
    /// Commit time of the newest event the index applied (from MySQL).
    pub applied_through: GaugeVec,
    /// Live members of the index's consumer group.
    pub consumers: IntGaugeVec,
}

impl CleanerMetrics {
    pub fn register(r: &Registry) -> prometheus::Result<CleanerMetrics> {
        let m = CleanerMetrics {
            drift_found: IntCounterVec::new(
                Opts::new(
                    "bagstore_cleaner_drift_found_total",
                    "Index rows found missing, dangling, or not saying where their entity is (kind location)",
                ),
                &["index", "kind"],
            )?,
            drift_fixed: IntCounterVec::new(
                Opts::new(
                    "bagstore_cleaner_drift_fixed_total",
                    "Missing rows written, dangling rows deleted, entity locations written into rows",
                ),
                &["index", "kind"],
            )?,
            rows_scanned: IntCounterVec::new(
                Opts::new("bagstore_cleaner_rows_scanned_total", "Entities checked against the index"),
                &["index"],
            )?,
            sweeps: prometheus::IntCounter::new("bagstore_cleaner_sweeps_total", "Completed full sweeps")?,
            sweep_seconds: prometheus::Gauge::new(
                "bagstore_cleaner_sweep_duration_seconds",
                "Duration of the last completed full sweep",
            )?,
            backfill_progress: GaugeVec::new(
                Opts::new(
                    "bagstore_cleaner_backfill_progress_ratio",
                    "Fraction of entities the backfill has scanned",
                ),
                &["index"],
            )?,
            backfill_rows: IntCounterVec::new(
                Opts::new("bagstore_cleaner_backfill_rows_total", "Entities scanned by backfills"),
                &["index"],
            )?,
            index_state: IntGaugeVec::new(
                Opts::new(
                    "bagstore_index_state",
                    "Index lifecycle: 0 CREATING, 1 BACKFILLING, 2 ACTIVE, 3 DROPPING",
                ),
                &["index"],
            )?,
            partition_lag: IntGaugeVec::new(
                Opts::new(
                    "bagstore_index_partition_lag_events",
                    "Change events not yet applied, per partition",
                ),
                &["index", "partition"],
            )?,
            lag_events: IntGaugeVec::new(
                Opts::new("bagstore_index_lag_events", "Change events not yet applied, all partitions"),
                &["index"],
            )?,
            lag_seconds: GaugeVec::new(
                Opts::new(
                    "bagstore_index_lag_seconds",
                    "Newest commit minus the newest commit the index applied",
                ),
                &["index"],
            )?,
            applied_through: GaugeVec::new(
                Opts::new(
                    "bagstore_index_applied_through_timestamp_seconds",
                    "Commit time of the newest change event the index applied",
                ),
                &["index"],
            )?,
            consumers: IntGaugeVec::new(
                Opts::new("bagstore_index_consumers", "Live members of the index's consumer group"),
                &["index"],
            )?,
        };
        r.register(Box::new(m.drift_found.clone()))?;
        r.register(Box::new(m.drift_fixed.clone()))?;
        r.register(Box::new(m.rows_scanned.clone()))?;
        r.register(Box::new(m.sweeps.clone()))?;
        r.register(Box::new(m.sweep_seconds.clone()))?;
        r.register(Box::new(m.backfill_progress.clone()))?;
        r.register(Box::new(m.backfill_rows.clone()))?;
        r.register(Box::new(m.index_state.clone()))?;
        r.register(Box::new(m.partition_lag.clone()))?;
        r.register(Box::new(m.lag_events.clone()))?;
        r.register(Box::new(m.lag_seconds.clone()))?;
        r.register(Box::new(m.applied_through.clone()))?;
        r.register(Box::new(m.consumers.clone()))?;
        Ok(m)
    }
}
