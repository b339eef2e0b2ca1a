//! `bagstore migrate`: makes the shards and the topics ready. Safe to run
//! any number of times: every step is "create if missing".

use anyhow::Context;
use schemas::store::{self, IndexState, Shards};
use schemas::Settings;
use std::time::Duration;

/// What migrate found and did, per index.
#[derive(Debug, Clone)]
pub struct Report {
    pub indexes: Vec<(String, IndexState)>,
}

/// Creates databases (when the DSN names one we may create), tables on every
/// shard, index metadata on shard 0, and the Kafka topics.
///
/// A new index on a system that holds no entities is ACTIVE at once (there
/// is nothing to backfill); otherwise it starts in CREATING and the
/// cleaner's backfill brings it to ACTIVE.
pub async fn migrate(settings: &Settings, shards: &Shards, kafka: bool) -> anyhow::Result<Report> {
    for (shard, dsn) in settings.mysql.shards.iter().enumerate() {
        store::create_database(shard, dsn)
            .await
            .with_context(|| format!("creating the database of shard {shard} ({dsn})"))?;
    }
    shards.wait_ready(Duration::from_secs(30)).await.context("waiting for the shards")?;
    let mut any_entities = false;
    for shard in 0..shards.count() {
        store::create_base_tables(shard, shards.pool(shard)).await.context("creating base tables")?;
        any_entities |= store::has_entities(shard, shards.pool(shard)).await?;
    }
    let mut report = Report { indexes: Vec::new() };
    for spec in &settings.indexes {
        for shard in 0..shards.count() {
            store::create_index_table(shard, shards.pool(shard), spec)
                .await
                .with_context(|| format!("creating index table {} on shard {shard}", spec.table))?;
        }
        let initial = if any_entities { IndexState::Creating } else { IndexState::Active };
        let state = store::register_index(shards.pool(0), spec, initial).await?;
        report.indexes.push((spec.table.clone(), state));
    }
    if kafka {
        schemas::kafka::ensure_topics(&settings.kafka).await.context("creating the Kafka topics")?;
    }
    // A CREATING index has not been scanned yet, so its consumer group may
    // start at the end of the topic: the backfill covers everything older.
    for (table, state) in &report.indexes {
        if *state == IndexState::Creating && !settings.kafka.brokers.is_empty() {
            let group = settings.kafka.group_for(table);
            if let Err(e) = schemas::kafka::start_group_at_end(&settings.kafka, &group).await {
                tracing::warn!(index = %table, error = %e, "could not start the new consumer group at the topic's end; it will replay the topic");
            }
        }
    }
    Ok(report)
}
