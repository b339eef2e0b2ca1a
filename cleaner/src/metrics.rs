//! The series the cleaner exports: drift, sweeps, backfills, and the index
//! lag and state series it measures for every index (so lag is reported
//! even when an index has no live consumer).

use prometheus::{GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

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
    /// The backfill's pace now, rows per second (0: none): what the pacer
    /// lets it write.
    pub backfill_pace: GaugeVec,
    /// A pace following health: the latest window's 90th-percentile probe latency
    /// (`what="probe"`) on the shard furthest over its baseline, and that
    /// shard's limit (`what="limit"`: its baseline plus the slack).
    pub backfill_health: GaugeVec,
    /// 0 CREATING, 1 BACKFILLING, 2 ACTIVE, 3 DROPPING.
    pub index_state: IntGaugeVec,
    /// Events on the topic the index's group has not committed, per
    /// partition. Labelled like kafka_exporter's `kafka_consumergroup_lag`
    /// too (`consumergroup`, `topic`, `partition`), so the two join.
    pub partition_lag: IntGaugeVec,
    /// The same, summed over partitions (`index`, `consumergroup`, `topic`).
    pub lag_events: IntGaugeVec,
    /// Newest commit on any shard minus the newest commit the index applied.
    pub lag_seconds: GaugeVec,
    /// Commit time of the newest event the index applied (from MySQL).
    pub applied_through: GaugeVec,
    /// Live members of the index's consumer group.
    pub consumers: IntGaugeVec,
    /// When the group's offsets were last read from Kafka: the lag gauges
    /// keep their last values while the probe fails, this one shows it.
    pub lag_probe: GaugeVec,
    /// The index's settled time (see `crate::lag`): every change event
    /// committed before it is applied; the sweep judges drift only for
    /// entities last written before it.
    pub settled: GaugeVec,
    /// Entities deleted because they expired, per shard.
    pub expired: IntCounterVec,
    /// How long after its expiry instant each expired entity was deleted.
    pub expiry_delay: HistogramVec,
    /// Tombstones purged (older than `cleaner.tombstone_retention_secs`), per shard.
    pub tombstones_purged: IntCounterVec,
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
            backfill_pace: GaugeVec::new(
                Opts::new(
                    "bagstore_cleaner_backfill_pace_rows_per_second",
                    "Rows per second the backfill may write now (0: no limit)",
                ),
                &["index"],
            )?,
            backfill_health: GaugeVec::new(
                Opts::new(
                    "bagstore_cleaner_backfill_probe_seconds",
                    "Backfill following health: 90th-percentile probe latency on the busiest shard (probe) and its limit (limit)",
                ),
                &["index", "what"],
            )?,
            index_state: IntGaugeVec::new(
                Opts::new(
                    "bagstore_index_state",
                    "Index lifecycle: 0 CREATING, 1 BACKFILLING, 2 ACTIVE, 3 DROPPING, 4 CONFLICTED",
                ),
                &["index"],
            )?,
            partition_lag: IntGaugeVec::new(
                Opts::new(
                    "bagstore_index_partition_lag_events",
                    "Change events not yet applied, per partition",
                ),
                &["index", "consumergroup", "topic", "partition"],
            )?,
            lag_events: IntGaugeVec::new(
                Opts::new("bagstore_index_lag_events", "Change events not yet applied, all partitions"),
                &["index", "consumergroup", "topic"],
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
                Opts::new(
                    "bagstore_index_consumers",
                    "Live indexers of the index: its consumer group's members, or the member leases held",
                ),
                &["index"],
            )?,
            lag_probe: GaugeVec::new(
                Opts::new(
                    "bagstore_index_lag_probe_timestamp_seconds",
                    "When the index's consumer-group lag was last read from Kafka",
                ),
                &["index"],
            )?,
            settled: GaugeVec::new(
                Opts::new(
                    "bagstore_index_settled_timestamp_seconds",
                    "Every change event committed before this time is applied to the index (the cleaner judges drift before it)",
                ),
                &["index"],
            )?,
            expired: IntCounterVec::new(
                Opts::new(
                    "bagstore_cleaner_expired_total",
                    "Entities deleted because their expiry time passed",
                ),
                &["shard"],
            )?,
            expiry_delay: HistogramVec::new(
                HistogramOpts::new(
                    "bagstore_cleaner_expiry_delay_seconds",
                    "Time from an entity's expiry to its delete (hidden from reads throughout)",
                )
                .buckets(vec![0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0]),
                &["shard"],
            )?,
            tombstones_purged: IntCounterVec::new(
                Opts::new(
                    "bagstore_cleaner_tombstones_purged_total",
                    "Rows of deleted entities removed after the retention",
                ),
                &["shard"],
            )?,
        };
        r.register(Box::new(m.drift_found.clone()))?;
        r.register(Box::new(m.drift_fixed.clone()))?;
        r.register(Box::new(m.rows_scanned.clone()))?;
        r.register(Box::new(m.sweeps.clone()))?;
        r.register(Box::new(m.sweep_seconds.clone()))?;
        r.register(Box::new(m.backfill_progress.clone()))?;
        r.register(Box::new(m.backfill_rows.clone()))?;
        r.register(Box::new(m.backfill_pace.clone()))?;
        r.register(Box::new(m.backfill_health.clone()))?;
        r.register(Box::new(m.index_state.clone()))?;
        r.register(Box::new(m.partition_lag.clone()))?;
        r.register(Box::new(m.lag_events.clone()))?;
        r.register(Box::new(m.lag_seconds.clone()))?;
        r.register(Box::new(m.applied_through.clone()))?;
        r.register(Box::new(m.consumers.clone()))?;
        r.register(Box::new(m.lag_probe.clone()))?;
        r.register(Box::new(m.settled.clone()))?;
        r.register(Box::new(m.expired.clone()))?;
        r.register(Box::new(m.expiry_delay.clone()))?;
        r.register(Box::new(m.tombstones_purged.clone()))?;
        Ok(m)
    }
}
