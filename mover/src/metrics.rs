//! The series a process running moves exports (`bagstore_move_…`).

use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

#[derive(Debug, Clone)]
pub struct MoverMetrics {
    /// 1 while this process runs a move.
    pub in_flight: IntGauge,
    /// Phase of the move this process runs: 0 none, 1 copy, 2 cutover,
    /// 3 cleanup, 4 rolling back.
    pub phase: IntGauge,
    /// Entity and index rows copied to targets (first copy and catch-up).
    pub rows_copied: IntCounter,
    /// Copy speed of the running move, rows per second.
    pub rows_per_second: Gauge,
    /// Rows of the running move still to copy (first copy).
    pub rows_remaining: IntGauge,
    /// Changes on the source waiting to be copied again.
    pub journal_backlog: IntGauge,
    /// When the running move last made progress (Unix seconds): a move whose
    /// value stops rising is stuck.
    pub progress_time: Gauge,
    /// How long writes to the moving logical shards waited in a cutover.
    pub cutover_pause: Histogram,
    /// Cutover attempts by kind of result: `ok`, `busy` (writes in flight did not
    /// finish in time), `outbox` (events did not reach Kafka in time),
    /// `differs` (verification found the copy different).
    pub cutover_attempts: IntCounterVec,
    /// Seconds the copy paused because the source was busy.
    pub throttled_seconds: Gauge,
}

impl MoverMetrics {
    pub fn register(r: &Registry) -> prometheus::Result<MoverMetrics> {
        let m = MoverMetrics {
            in_flight: IntGauge::new("bagstore_move_in_flight", "1 while this process runs a shard move")?,
            phase: IntGauge::new(
                "bagstore_move_phase",
                "Phase of the running move: 0 none, 1 copy, 2 cutover, 3 cleanup, 4 rolling back",
            )?,
            rows_copied: IntCounter::new(
                "bagstore_move_rows_copied_total",
                "Entity and index rows copied to move targets (first copy and catch-up)",
            )?,
            rows_per_second: Gauge::new("bagstore_move_rows_per_second", "Copy speed of the running move")?,
            rows_remaining: IntGauge::new(
                "bagstore_move_rows_remaining",
                "Rows of the running move not yet copied once",
            )?,
            journal_backlog: IntGauge::new(
                "bagstore_move_journal_backlog",
                "Changes on the move's source waiting to be copied again",
            )?,
            progress_time: Gauge::new(
                "bagstore_move_progress_timestamp_seconds",
                "When the running move last made progress (Unix time)",
            )?,
            cutover_pause: Histogram::with_opts(
                HistogramOpts::new(
                    "bagstore_move_cutover_pause_seconds",
                    "How long writes to the moving logical shards waited during a cutover",
                )
                .buckets(vec![0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            )?,
            cutover_attempts: IntCounterVec::new(
                Opts::new("bagstore_move_cutover_attempts_total", "Cutover attempts by result (kind)"),
                &["kind"],
            )?,
            throttled_seconds: Gauge::new(
                "bagstore_move_throttled_seconds_total",
                "Seconds the copy paused because the source was busy",
            )?,
        };
        for kind in ["ok", "busy", "outbox", "differs"] {
            m.cutover_attempts.with_label_values(&[kind]);
        }
        r.register(Box::new(m.in_flight.clone()))?;
        r.register(Box::new(m.phase.clone()))?;
        r.register(Box::new(m.rows_copied.clone()))?;
        r.register(Box::new(m.rows_per_second.clone()))?;
        r.register(Box::new(m.rows_remaining.clone()))?;
        r.register(Box::new(m.journal_backlog.clone()))?;
        r.register(Box::new(m.progress_time.clone()))?;
        r.register(Box::new(m.cutover_pause.clone()))?;
        r.register(Box::new(m.cutover_attempts.clone()))?;
        r.register(Box::new(m.throttled_seconds.clone()))?;
        Ok(m)
    }

    /// Unregistered series, for a command-line run nobody scrapes.
    pub fn unregistered() -> MoverMetrics {
        MoverMetrics::register(&Registry::new()).expect("fresh registry")
    }

    pub(crate) fn progressed(&self) {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        self.progress_time.set(now.as_secs_f64());
    }
}
