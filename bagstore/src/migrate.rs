//! `bagstore migrate`: makes the shards and the topics ready. Safe to run
//! any number of times: every step is "create if missing".

use anyhow::Context;
use schemas::index::IndexState;
use schemas::shard::DEFAULT_LOGICAL_SHARDS;
use schemas::topology::{PhysicalId, PhysicalShard, Topology};
use schemas::Settings;
use service::kafka;
use std::time::Duration;
use storage::{catalog, entities, migrate, topology, Shards};

/// What migrate found and did, per index.
#[derive(Debug, Clone)]
pub struct Report {
    pub indexes: Vec<(String, IndexState)>,
}

/// Creates databases (when the DSN names one we may create), a new
/// cluster's map (or upgrades a cluster from before logical shards), tables
/// on every shard, the index catalog on the metadata shard, and the Kafka
/// topics; returns the shards, connected as every service connects them.
///
/// A new cluster's shards are named `s0`, `s1`, … in configuration order,
/// the first is the metadata shard, and logical shard `k` goes to the
/// `k mod N`-th: an even spread, and for a cluster from before logical
/// shards exactly the placement `hash mod N` gave it, as long as N divides
/// the number of logical shards (4096, or for such a cluster with N not
/// dividing it, the largest multiple of N below it).
///
/// A new index on a system that holds no entities is ACTIVE at once (there
/// is nothing to backfill); otherwise it starts in CREATING and the
/// cleaner's backfill brings it to ACTIVE.
pub async fn migrate(settings: &Settings, kafka: bool) -> anyhow::Result<(Report, Shards)> {
    // Who the configured databases are decides between a new cluster and
    // an existing one; a configuration that disagrees with an existing
    // cluster is refused before anything is written.
    let identities = Shards::identities(&settings.mysql).await.context("asking the shards who they are")?;
    if identities.iter().all(Option::is_none) {
        for (shard, dsn) in settings.mysql.shards.iter().enumerate() {
            migrate::create_database(shard, dsn)
                .await
                .with_context(|| format!("creating the database of shard {shard} ({dsn})"))?;
        }
        let probe = Shards::configured(&settings.mysql)?;
        probe.wait_ready(Duration::from_secs(30)).await.context("waiting for the shards")?;
        create_cluster(settings, &probe).await.context("creating the cluster's map")?;
        probe.close().await;
    }
    let shards =
        Shards::connect(&settings.mysql).await.context("checking the configuration against the cluster")?;
    shards.try_each(migrate::create_base_tables).await.context("creating base tables")?;
    crate::replicas::check_cluster(&shards).await?;
    // What removed features left (the binary-log outbox, bulk backfills),
    // dropped only where that loses nothing; refused otherwise.
    let mut tables: Vec<String> =
        catalog::list_index_meta(&shards).await?.into_iter().map(|m| m.spec.table).collect();
    tables.extend(settings.indexes.iter().map(|s| s.table.clone()));
    let (tables, names) = (&tables, &shards);
    shards.try_each(|shard, pool| migrate::upgrade::check(shard, names.name(shard), pool, tables)).await?;
    shards.try_each(|shard, pool| migrate::upgrade::drop_leftovers(shard, pool, tables)).await?;
    let l = shards.logical_shards();
    shards.try_each(|shard, pool| migrate::fill_logical(shard, pool, None, l)).await?;
    let any_entities = shards.try_each(entities::has_entities).await?.into_iter().any(|has| has);
    let mut report = Report { indexes: Vec::new() };
    for spec in &settings.indexes {
        shards
            .try_each(|shard, pool| migrate::create_index_table(shard, pool, spec))
            .await
            .with_context(|| format!("creating index table {}", spec.table))?;
        shards.try_each(|shard, pool| migrate::fill_logical(shard, pool, Some(spec), l)).await?;
        let initial = if any_entities { IndexState::Creating } else { IndexState::Active };
        let state = catalog::register_index(&shards, spec, initial).await?;
        report.indexes.push((spec.table.clone(), state));
    }
    if kafka {
        let k = &settings.kafka;
        let extra = settings.extra_topics();
        let also: Vec<&str> = extra.iter().map(String::as_str).collect();
        if !kafka::topics_exist(k, &also).await.context("reading the Kafka topics")? {
            // Said here, before any topic is made: brokers may not (Kafka
            // refuses, some Kafka-protocol brokers ignore replicas).
            let brokers = kafka::broker_count(k).await.context("reading the Kafka cluster's brokers")?;
            anyhow::ensure!(
                brokers >= k.replication_factor as usize,
                "the Kafka cluster has {brokers} broker(s), fewer than kafka.replication_factor = {} \
                 (the default, for production); set kafka.replication_factor to the replicas the cluster \
                 can hold (1 for a single broker)",
                k.replication_factor
            );
        }
        kafka::ensure_topics(k, &also).await.context("creating the Kafka topics")?;
    }
    // A CREATING index has not been scanned yet, so its consumer group may
    // start at the end of the topic: the backfill covers everything older.
    for (table, state) in &report.indexes {
        if *state == IndexState::Creating && !settings.kafka.brokers.is_empty() {
            let group = settings.kafka.group_for(table);
            if let Err(e) = kafka::place_group_at_end(
                &settings.kafka,
                &group,
                &settings.kafka.topic,
                kafka::Placing::Uncommitted,
            )
            .await
            {
                tracing::warn!(index = %table, error = %e, "could not start the new consumer group at the topic's end; it will replay the topic");
            }
        }
    }
    Ok((report, shards))
}

/// A new cluster on the configured shards (see [`migrate`]): base tables,
/// each shard's identity and ownership, then the map on the metadata shard
/// (last, so an interrupted creation is redone from the start).
async fn create_cluster(settings: &Settings, probe: &Shards) -> anyhow::Result<()> {
    probe.try_each(migrate::create_base_tables).await?;
    let n = settings.mysql.shards.len();
    let had_entities = probe.try_each(entities::has_entities).await?.into_iter().any(|has| has);
    let default = DEFAULT_LOGICAL_SHARDS;
    let l =
        settings.mysql.logical_shards.unwrap_or(if had_entities && !(default as usize).is_multiple_of(n) {
            default - default % n as u16
        } else {
            default
        });
    anyhow::ensure!(l as usize >= n, "{n} shards need at least {n} logical shards, not {l}");
    let physical: Vec<PhysicalShard> = settings
        .mysql
        .shards
        .iter()
        .enumerate()
        .map(|(i, dsn)| PhysicalShard {
            id: i as PhysicalId,
            name: format!("s{i}"),
            address: storage::dsn::address_of(dsn),
            epoch: 1,
            failovers: 0,
        })
        .collect();
    let t = Topology::even(l, physical);
    for p in &t.shards {
        let shard = p.id as usize;
        topology::claim_identity(shard, probe.pool(shard), &p.name, p.id, t.epoch).await?;
        topology::grant(shard, probe.pool(shard), &t.owned_by(p.id), t.epoch).await?;
    }
    topology::create(probe.meta(), &t).await?;
    tracing::info!(shards = n, logical_shards = l, upgraded = had_entities, "created the cluster's map");
    Ok(())
}
