//! `bagstore changes snapshot --group G`: brings a new consumer group of
//! the public change stream up to date (Debezium's initial snapshot). The
//! group's offsets go to the topic's end, then every live entity is
//! emitted as an `r` message; tailing from those offsets then misses
//! nothing, and a consumer that keeps a message only when its version is
//! above the last it applied per id never goes back (see
//! `storage::snapshots`). Resumable (progress saved per batch on the
//! metadata shard), throttled (`--rate`), with progress on stderr.

use anyhow::Context;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use schemas::changes::{self, ChangeMessage};
use schemas::event::{ChangeEvent, Op};
use schemas::{codec, expiry, Settings};
use std::time::{Duration, Instant};
use storage::{migrate, snapshots, Shards, META_SHARD};
use tokio_util::sync::CancellationToken;

use crate::progress::Printer;

/// Entities read and emitted per batch (progress is saved after each).
const BATCH: usize = 500;
/// Scans started over at most, when moves keep changing the map.
const MAX_RESTARTS: u32 = 5;

pub async fn snapshot(settings: Settings, group: &str, rate: u64, restart: bool) -> anyhow::Result<()> {
    anyhow::ensure!(
        !group.is_empty()
            && group.len() <= 200
            && group.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)),
        "--group {group:?}: use 1 to 200 of the characters a-z, A-Z, 0-9, '.', '_' and '-'"
    );
    let changes = &settings.changes;
    anyhow::ensure!(
        changes.enabled,
        "the change stream is off (changes.enabled = false): nothing to snapshot"
    );
    let shards = Shards::connect(&settings.mysql).await?;
    migrate::create_base_tables(META_SHARD, shards.meta()).await?;
    let meta = shards.meta().clone();
    if restart {
        snapshots::forget(&meta, group).await?;
    }
    let mut snap = match snapshots::get(&meta, group).await? {
        Some(s) if s.finished => {
            println!(
                "snapshot of group {group} already done ({} entities emitted); --restart to take it again",
                s.rows_emitted
            );
            shards.close().await;
            return Ok(());
        }
        Some(s) => {
            eprintln!("snapshot of group {group}: resuming ({} entities emitted so far)", s.rows_emitted);
            s
        }
        None => {
            // The offsets first: every read below happens after them.
            let offsets = service::kafka::place_group_at_end(
                &settings.kafka,
                group,
                &changes.topic,
                service::kafka::Placing::Every,
            )
            .await
            .with_context(|| {
                format!(
                    "placing group {group} at the end of {}; a group with live consumers cannot be placed: \
                         stop them first",
                    changes.topic
                )
            })?;
            eprintln!("snapshot of group {group}: its offsets on {} are now {offsets:?}", changes.topic);
            snapshots::start(&meta, group, &changes.topic, shards.epoch()).await?;
            snapshots::get(&meta, group).await?.context("the snapshot record just written")?
        }
    };
    let producer: FutureProducer = service::kafka::create(&service::kafka::producer_config(&settings.kafka))
        .context("a Kafka producer")?;
    let stop = CancellationToken::new();
    let on_signal = stop.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_signal.cancel();
    });
    let started = Instant::now();
    let mut restarts = 0;
    loop {
        if snap.epoch != shards.epoch() {
            // A move changed the map since the scan began (entities may have
            // changed shards under the cursors): the scan starts over. The
            // group's offsets stay: reading again emits nothing stale.
            anyhow::ensure!(
                restarts < MAX_RESTARTS,
                "the shard map kept changing; run the snapshot again later"
            );
            restarts += 1;
            eprintln!("snapshot of group {group}: the shard map changed; scanning again");
            snapshots::start(&meta, group, &changes.topic, shards.epoch()).await?;
            snap = snapshots::get(&meta, group).await?.context("the snapshot record")?;
        }
        scan(&settings, &shards, &producer, &mut snap, rate, started, &stop).await?;
        shards.reload().await?;
        if snap.epoch == shards.epoch() {
            break;
        }
    }
    snapshots::finish(&meta, group).await?;
    println!(
        "snapshot of group {group} done: {} entities emitted to {} as op r; the group's consumers read on from there",
        snap.rows_emitted, changes.topic
    );
    shards.close().await;
    Ok(())
}

/// Emits every live entity after the cursors, shard by shard.
async fn scan(
    settings: &Settings,
    shards: &Shards,
    producer: &FutureProducer,
    snap: &mut snapshots::Snapshot,
    rate: u64,
    started: Instant,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let printer = Printer::stderr();
    let meta = shards.meta();
    let ids = shards.ids();
    let mut total = 0u64;
    for &shard in &ids {
        total += storage::entities::entity_bounds(shard, shards.pool(shard)).await?.count;
    }
    let emitted_before = snap.rows_emitted;
    for &shard in &ids {
        let pool = shards.pool(shard);
        loop {
            if stop.is_cancelled() {
                printer.finish();
                anyhow::bail!("stopped; run the same command again to resume");
            }
            if rate > 0 {
                let due = Duration::from_secs_f64((snap.rows_emitted - emitted_before) as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
            }
            let after = snap.cursors.get(&shard).copied().unwrap_or(0);
            let rows = snapshots::live_after(shard, pool, after, BATCH).await?;
            let Some(last) = rows.last().map(|r| r.added_id) else { break };
            let now = schemas::clock::now_micros();
            let mut messages = Vec::with_capacity(rows.len());
            for r in &rows {
                let Some(bag) = r.body.as_deref().and_then(|b| codec::decode_body(b).ok()) else {
                    tracing::error!(id = %r.id, shard, "an entity body does not decode; left out of the snapshot");
                    continue;
                };
                if expiry::bag_is_expired(&bag, settings.expiry.property.as_deref(), now) {
                    continue; // Absent to every read.
                }
                let event = ChangeEvent {
                    id: r.id,
                    version: r.version,
                    op: Op::Put,
                    committed_at_us: r.updated_us,
                    shard: shard as u32,
                    before: None,
                    after: Some(bag),
                    added_id: Some(r.added_id),
                };
                messages.push(changes::snapshot_message(&event, r.logical, shards.name(shard)));
            }
            send_all(producer, &settings.changes.topic, &messages).await?;
            snap.rows_emitted += messages.len() as u64;
            snap.cursors.insert(shard, last);
            snapshots::save(meta, snap).await?;
            let done = snap.rows_emitted - emitted_before;
            printer.show(
                &format!("snapshot {}", snap.group),
                done as f64 / total.max(1) as f64,
                &format!(
                    "{} emitted, shard {} at added_id {last}, {:.0} entities/s",
                    snap.rows_emitted,
                    shards.name(shard),
                    done as f64 / started.elapsed().as_secs_f64().max(1e-3)
                ),
            );
        }
    }
    printer.finish();
    Ok(())
}

/// Sends `messages` and waits until Kafka acknowledged every one.
async fn send_all(producer: &FutureProducer, topic: &str, messages: &[ChangeMessage]) -> anyhow::Result<()> {
    let mut pending = Vec::with_capacity(messages.len());
    for m in messages {
        let headers = OwnedHeaders::new()
            .insert(Header { key: changes::HEADER_VERSION, value: Some(&m.version) })
            .insert(Header { key: changes::HEADER_OP, value: Some(m.op.as_str()) });
        let record = FutureRecord::to(topic).key(&m.key).payload(&m.value).headers(headers);
        let sent = producer
            .send_result(record)
            .map_err(|(e, _)| anyhow::anyhow!("cannot enqueue a snapshot message: {e}"))?;
        pending.push(sent);
    }
    for r in futures::future::join_all(pending).await {
        match r {
            Ok(Ok(_)) => {}
            Ok(Err((e, _))) => anyhow::bail!("Kafka did not take a snapshot message: {e}"),
            Err(_) => anyhow::bail!("a snapshot message was dropped before Kafka answered"),
        }
    }
    Ok(())
}
