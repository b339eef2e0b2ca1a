//! Reader series, `bagstore_reader_…`, most labelled by `index`.

use prometheus::{IntCounterVec, Opts, Registry};

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
}

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
        };
        r.register(Box::new(m.stale_map_retries.clone()))?;
        r.register(Box::new(m.index_rows.clone()))?;
        r.register(Box::new(m.dropped.clone()))?;
        r.register(Box::new(m.shard_reads.clone()))?;
        r.register(Box::new(m.fetches.clone()))?;
        Ok(m)
    }
}
