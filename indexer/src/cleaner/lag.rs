//! Index lag, measured from outside the indexers: the cleaner always runs,
//! so lag is reported even when an index has no live consumer at all.
//!
//! Offset lag comes from Kafka (the topic's high watermarks against the
//! group's committed offsets); time lag from MySQL (the newest commit on
//! any shard against the newest commit the index applied).

use schemas::store::{self, IndexState};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use super::{Cleaner, CleanerError};

/// How often lag is measured.
pub const LAG_INTERVAL: Duration = Duration::from_secs(2);

impl Cleaner {
    /// Measures and publishes lag every [`LAG_INTERVAL`] until `shutdown`.
    pub async fn report_lag(&self, shutdown: CancellationToken) {
        while !shutdown.is_cancelled() {
            if let Err(e) = self.measure_lag().await {
                tracing::debug!(error = %e, "lag measurement failed");
            }
            tokio::select! {
                _ = tokio::time::sleep(LAG_INTERVAL) => {}
                _ = shutdown.cancelled() => break,
            }
        }
    }

    pub async fn measure_lag(&self) -> Result<(), CleanerError> {
        let shards = self.shards();
        let mut newest = None;
        for shard in 0..shards.count() {
            newest = newest.max(store::newest_commit_us(shard, shards.pool(shard)).await?);
        }
        let k = &self.settings().kafka;
        let m = self.metrics();
        for meta in self.index_metas().await? {
            let table = meta.spec.table.as_str();
            if meta.state == IndexState::Dropping {
                // A dropped index has no lag; stop exporting its last values.
                let _ = m.lag_seconds.remove_label_values(&[table]);
                let _ = m.lag_events.remove_label_values(&[table]);
                let _ = m.applied_through.remove_label_values(&[table]);
                let _ = m.consumers.remove_label_values(&[table]);
                continue;
            }
            let applied = store::index_progress(shards.pool(0), table).await?;
            if let Some(a) = applied {
                m.applied_through.with_label_values(&[table]).set(a as f64 / 1e6);
            }
            let mut events_behind = None;
            if !k.brokers.is_empty() {
                match schemas::kafka::group_lag(k, &k.group_for(table)).await {
                    Ok(parts) => {
                        let mut sum = 0;
                        for p in parts {
                            m.partition_lag
                                .with_label_values(&[table, &p.partition.to_string()])
                                .set(p.lag());
                            sum += p.lag();
                        }
                        m.lag_events.with_label_values(&[table]).set(sum);
                        events_behind = Some(sum);
                    }
                    Err(e) => tracing::debug!(index = table, error = %e, "cannot read consumer-group lag"),
                }
            }
            let lag_us = match (newest, applied) {
                _ if events_behind == Some(0) => 0,
                (Some(n), Some(a)) => (n - a).max(0),
                // Nothing applied yet while events wait: behind since the newest commit at least.
                (Some(n), None) => (schemas::web::now_micros() - n).max(0),
                (None, _) => 0,
            };
            m.lag_seconds.with_label_values(&[table]).set(lag_us as f64 / 1e6);
            let group = k.group_for(table);
            if k.brokers.is_empty() {
                continue;
            }
            match schemas::kafka::group_members(k, &group).await {
                Ok(n) => m.consumers.with_label_values(&[table]).set(n as i64),
                Err(e) => tracing::debug!(index = table, error = %e, "cannot list consumer-group members"),
            }
        }
        Ok(())
    }
}
