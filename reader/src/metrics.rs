//! Reader series, `bagstore_reader_…`, most labelled by `index`.

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};

#[derive(Debug, Clone)]
pub struct Metrics {
    /// Candidate rows read from index tables.
    pub index_rows: IntCounterVec,
    /// Candidates the re-filter dropped: stale, dangling or wrong index rows.
    pub dropped: IntCounterVec,
    /// Index-table queries sent to shards (one per key and page).
    pub shard_reads: IntCounterVec,
    /// Entities fetched, `by`: `location` (a remembered row key), `id`
    /// (none remembered) or `stale` (the remembered row was not theirs).
    pub fetches: IntCounterVec,
    /// Reads run again after a shard's epoch showed the map was stale.
    pub stale_map_retries: prometheus::IntCounter,
    /// Reads sent to shards, by `target`: `replica`, `primary` (as
    /// `reader.read_from` says) or `primary_fallback` (meant for a replica).
    pub routed: IntCounterVec,
    /// Reads meant for a replica that went to the primary, by `reason`
    /// (see `routing::Fallback`).
    pub fallbacks: IntCounterVec,
    /// Reads carrying a write token that found their replica behind it, by
    /// `outcome`: `caught_up` (it caught up within the wait) or `primary`
    /// (read from the primary instead).
    pub token_waits: IntCounterVec,
    /// Per shard, its replicas that reads may use now (up, and within
    /// `reader.max_replica_lag_ms`).
    pub usable_replicas: IntGaugeVec,
}

/// `target` values of [`Metrics::routed`].
pub const TARGETS: [&str; 3] = ["replica", "primary", "primary_fallback"];
/// `reason` values of [`Metrics::fallbacks`].
pub const REASONS: [&str; 4] = ["no_replica", "failed", "behind_cutover", "write_token"];
/// `outcome` values of [`Metrics::token_waits`].
pub const OUTCOMES: [&str; 2] = ["caught_up", "primary"];

impl Metrics {
    pub fn register(r: &Registry) -> prometheus::Result<Metrics> {
        let m = Metrics {
            stale_map_retries: prometheus::IntCounter::new(
                "bagstore_reader_stale_map_retries_total",
                "Reads run again after a shard's epoch showed the shard map was stale",
            )?,
            index_rows: IntCounterVec::new(
                Opts::new("bagstore_reader_index_rows_read_total", "Candidate rows read from index tables"),
                &["index"],
            )?,
            dropped: IntCounterVec::new(
                Opts::new(
                    "bagstore_reader_refilter_dropped_total",
                    "Candidates dropped because the entity is gone or no longer matches",
                ),
                &["index"],
            )?,
            shard_reads: IntCounterVec::new(
                Opts::new("bagstore_reader_index_reads_total", "Index-table reads sent to shards"),
                &["index", "shard"],
            )?,
            fetches: IntCounterVec::new(
                Opts::new(
                    "bagstore_reader_entity_fetches_total",
                    "Entities fetched from their shards, by remembered location or by id",
                ),
                &["by"],
            )?,
            routed: IntCounterVec::new(
                Opts::new("bagstore_reader_routed_total", "Reads sent to shards, by the server they went to"),
                &["target"],
            )?,
            fallbacks: IntCounterVec::new(
                Opts::new(
                    "bagstore_reader_replica_fallbacks_total",
                    "Reads meant for a replica that went to the shard's primary, by reason",
                ),
                &["reason"],
            )?,
            token_waits: IntCounterVec::new(
                Opts::new(
                    "bagstore_reader_token_waits_total",
                    "Reads with a write token that found their replica behind it, by how they ended",
                ),
                &["outcome"],
            )?,
            usable_replicas: IntGaugeVec::new(
                Opts::new(
                    "bagstore_reader_replicas_usable",
                    "Replicas of each shard that reads may use now (up, within the lag bound)",
                ),
                &["shard"],
            )?,
        };
        // Every label value exists from the start: a rate over a series
        // that appears only with its first event misses that event.
        for (vec, values) in
            [(&m.routed, &TARGETS[..]), (&m.fallbacks, &REASONS[..]), (&m.token_waits, &OUTCOMES[..])]
        {
            for v in values {
                vec.with_label_values(&[v]);
            }
        }
        r.register(Box::new(m.stale_map_retries.clone()))?;
        r.register(Box::new(m.index_rows.clone()))?;
        r.register(Box::new(m.dropped.clone()))?;
        r.register(Box::new(m.shard_reads.clone()))?;
        r.register(Box::new(m.fetches.clone()))?;
        r.register(Box::new(m.routed.clone()))?;
        r.register(Box::new(m.fallbacks.clone()))?;
        r.register(Box::new(m.token_waits.clone()))?;
        r.register(Box::new(m.usable_replicas.clone()))?;
        Ok(m)
    }
}
