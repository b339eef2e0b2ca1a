//! `bagstore migrate`: makes the shards and the topics ready. Safe to run
//! any number of times: every step is "create if missing".

use anyhow::Context;
use schemas::index::IndexState;
use schemas::Settings;
use service::kafka;
use std::time::Duration;
use storage::{catalog, entities, migrate, Shards};

/// What migrate found and did, per index.
#[derive(Debug, Clone)]
pub struct Report {
    pub indexes: Vec<(String, IndexState)>,
}

/// Creates databases (when the DSN names one we may create), tables on every
/// shard, the index catalog on the metadata shard, and the Kafka topics.
///
/// A new index on a system that holds no entities is ACTIVE at once (there
/// is nothing to backfill); otherwise it starts in CREATING and the
/// cleaner's backfill brings it to ACTIVE.
pub async fn migrate(settings: &Settings, shards: &Shards, kafka: bool) -> anyhow::Result<Report> {
    for (shard, dsn) in settings.mysql.shards.iter().enumerate() {
        migrate::create_database(shard, dsn)
            .await
            .with_context(|| format!("creating the database of shard {shard} ({dsn})"))?;
    }
    shards.wait_ready(Duration::from_secs(30)).await.context("waiting for the shards")?;
    shards.try_each(migrate::create_base_tables).await.context("creating base tables")?;
    let any_entities = shards.try_each(entities::has_entities).await?.into_iter().any(|has| has);
    let mut report = Report { indexes: Vec::new() };
    for spec in &settings.indexes {
        shards
            .try_each(|shard, pool| migrate::create_index_table(shard, pool, spec))
            .await
            .with_context(|| format!("creating index table {}", spec.table))?;
        let initial = if any_entities { IndexState::Creating } else { IndexState::Active };
        let state = catalog::register_index(shards, spec, initial).await?;
        report.indexes.push((spec.table.clone(), state));
    }
    if kafka {
        kafka::ensure_topics(&settings.kafka).await.context("creating the Kafka topics")?;
    }
    // A CREATING index has not been scanned yet, so its consumer group may
    // start at the end of the topic: the backfill covers everything older.
    for (table, state) in &report.indexes {
        if *state == IndexState::Creating && !settings.kafka.brokers.is_empty() {
            let group = settings.kafka.group_for(table);
            if let Err(e) = kafka::start_group_at_end(&settings.kafka, &group).await {
                tracing::warn!(index = %table, error = %e, "could not start the new consumer group at the topic's end; it will replay the topic");
            }
        }
    }
    Ok(report)
}
