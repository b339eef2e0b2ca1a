//! How far behind an index is: the one freshness rule, used by query
//! answers (`index_lag_ms`), `/v1/lag`, the lag metrics and `dev`'s drain.
//!
//! Indexers record, per index, the commit time of the newest event they
//! applied (`storage::catalog::index_progress`). The lag is the newest
//! commit on any shard minus that, never negative.

use storage::{catalog, entities, Shards, StoreError};

/// How current an index is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freshness {
    /// The commit time (µs) of the newest event the index applied, if any.
    pub applied_through_us: Option<i64>,
    /// The newest commit (µs) on any shard, if any.
    pub newest_commit_us: Option<i64>,
}

impl Freshness {
    /// The lag in µs at `now_us`: 0 when the index applied the newest
    /// commit, when nothing was ever committed, or when Kafka says the
    /// index's consumer group has no event left (`events_behind == Some(0)`:
    /// the newest commit may be a write whose event another index got);
    /// the time since the newest commit when nothing was applied yet.
    pub fn lag_us(&self, events_behind: Option<i64>, now_us: i64) -> i64 {
        match (self.newest_commit_us, self.applied_through_us) {
            _ if events_behind == Some(0) => 0,
            (Some(n), Some(a)) => (n - a).max(0),
            (Some(n), None) => (now_us - n).max(0),
            (None, _) => 0,
        }
    }

    /// [`Freshness::lag_us`] in whole milliseconds, without Kafka's view.
    pub fn lag_ms(&self) -> i64 {
        self.lag_us(None, schemas::clock::now_micros()) / 1000
    }
}

/// Measures `table`'s freshness: the newest commit of every shard (in
/// parallel) and the index's applied-through time.
pub async fn measure(shards: &Shards, table: &str) -> Result<Freshness, StoreError> {
    let (applied, newest) =
        tokio::join!(catalog::index_progress(shards, table), shards.try_each(entities::newest_commit_us));
    Ok(Freshness { applied_through_us: applied?, newest_commit_us: newest?.into_iter().flatten().max() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_is_newest_commit_minus_applied_and_never_negative() {
        let f = |newest, applied| Freshness { newest_commit_us: newest, applied_through_us: applied };
        assert_eq!(f(Some(5_000), Some(2_000)).lag_us(None, 9_000), 3_000);
        assert_eq!(f(Some(2_000), Some(5_000)).lag_us(None, 9_000), 0);
        assert_eq!(
            f(Some(5_000), None).lag_us(None, 9_000),
            4_000,
            "nothing applied: since the newest commit"
        );
        assert_eq!(f(None, None).lag_us(None, 9_000), 0, "nothing committed");
        assert_eq!(f(Some(5_000), Some(2_000)).lag_us(Some(0), 9_000), 0, "the group has nothing left");
        assert_eq!(f(Some(5_000), Some(2_000)).lag_us(Some(3), 9_000), 3_000);
    }
}
