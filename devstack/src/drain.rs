//! Waiting until nothing is in flight: every outbox empty and every index's
//! consumer group committed up to the end of the topic. `bagstore dev`
//! drains before it stops, because its embedded Kafka keeps nothing.

use schemas::Settings;
use service::kafka;
use std::time::{Duration, Instant};
use storage::{outbox, Shards};

/// Waits until the pipeline has drained; false at the deadline.
pub async fn drain(settings: &Settings, shards: &Shards, deadline: Duration) -> bool {
    let until = Instant::now() + deadline;
    loop {
        let mut pending = 0u64;
        for backlog in shards.each(outbox::outbox_backlog).await {
            // A shard that cannot answer counts as not drained.
            pending += backlog.map_or(1, |b| b.rows);
        }
        if pending == 0 {
            for spec in &settings.indexes {
                match kafka::group_lag(&settings.kafka, &settings.kafka.group_for(&spec.table)).await {
                    Ok(parts) => pending += parts.iter().map(|p| p.lag() as u64).sum::<u64>(),
                    Err(_) => pending += 1,
                }
            }
        }
        if pending == 0 {
            return true;
        }
        if Instant::now() >= until {
            tracing::warn!(
                pending,
                "stopping before the pipeline drained; the cleaner will repair the indexes"
            );
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
