//! One publish round of a shard's outbox: read the oldest rows in `seq`
//! order, enqueue them all on the idempotent producer in that order, await
//! every acknowledgement (up to `kafka.message_timeout_ms`), then delete
//! the acknowledged prefix (on the leader's connection, whose deletes log
//! their keys only, see `outbox::log_deletes_by_key`).

use futures::stream::{FuturesOrdered, StreamExt};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use schemas::changes;
use schemas::event::ChangeEvent;
use sqlx::MySqlConnection;
use std::time::Duration;
use storage::outbox::{self, OutboxRow};
use storage::StoreError;

use crate::relay::Relays;

/// One round of the outbox table: reads up to `writer.relay_batch` rows
/// in order, publishes them and deletes the acknowledged prefix.
/// Returns how many rows it read and how many Kafka acknowledged.
pub(super) async fn round(
    relays: &Relays,
    shard: usize,
    conn: &mut MySqlConnection,
    producer: &FutureProducer,
) -> Result<(usize, usize), StoreError> {
    let rows = outbox::read_outbox(shard, conn, relays.settings.writer.relay_batch).await?;
    if rows.is_empty() {
        return Ok((0, 0));
    }
    let acked = publish(relays, shard, producer, &rows).await;
    if acked > 0 {
        let seqs: Vec<u64> = rows[..acked].iter().map(|row| row.seq).collect();
        outbox::delete_outbox(shard, conn, &seqs).await?;
        relays.metrics.published.with_label_values(&[&shard.to_string()]).inc_by(acked as u64);
    }
    Ok((rows.len(), acked))
}

/// Sends the rows in order, each to the change topic and (when on) as
/// its envelope to the public change stream, and returns how many
/// leading rows Kafka acknowledged on both.
async fn publish(relays: &Relays, shard: usize, producer: &FutureProducer, rows: &[OutboxRow]) -> usize {
    let topic = &relays.settings.kafka.topic;
    let changes = &relays.settings.changes;
    let mut pending = Vec::with_capacity(rows.len() * 2);
    // Messages enqueued per row, for the rows enqueued whole.
    let mut per_row: Vec<usize> = Vec::with_capacity(rows.len());
    'rows: for row in rows {
        let record = FutureRecord::to(topic).key(&row.entity_id.0[..]).payload(&row.event[..]);
        match producer.send_result(record) {
            Ok(f) => pending.push(f),
            Err((e, _)) => {
                tracing::warn!(shard, error = %e, "cannot enqueue change event");
                break;
            }
        }
        let mut sent = 1;
        if let Some(m) = changes.enabled.then(|| public_message(relays, shard, row)).flatten() {
            let headers = OwnedHeaders::new()
                .insert(Header { key: changes::HEADER_VERSION, value: Some(&m.version) })
                .insert(Header { key: changes::HEADER_OP, value: Some(m.op.as_str()) });
            let record = FutureRecord::to(&changes.topic).key(&m.key).payload(&m.value).headers(headers);
            match producer.send_result(record) {
                Ok(f) => pending.push(f),
                Err((e, _)) => {
                    tracing::warn!(shard, error = %e, "cannot enqueue a change stream message");
                    break 'rows;
                }
            }
            sent += 1;
        }
        per_row.push(sent);
    }
    // Acknowledgements in send order, up to the relay's deadline; those
    // still out then count as failed (the caller replaces the producer).
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(relays.settings.kafka.message_timeout_ms);
    let mut in_order: FuturesOrdered<_> = pending.into_iter().collect();
    let mut results = Vec::with_capacity(in_order.len());
    while let Ok(Some(r)) = tokio::time::timeout_at(deadline, in_order.next()).await {
        results.push(r);
    }
    // A row counts once every message it was sent as is acknowledged.
    let (mut at, mut acked) = (0, 0);
    for n in per_row {
        if results.len() < at + n || !results[at..at + n].iter().all(|r| matches!(r, Ok(Ok(_)))) {
            break;
        }
        at += n;
        acked += 1;
    }
    if acked < rows.len() {
        let failed = rows.len() - acked;
        relays.metrics.publish_failures.with_label_values(&[&shard.to_string()]).inc_by(failed as u64);
        match results.iter().find(|r| !matches!(r, Ok(Ok(_)))) {
            Some(Ok(Err((e, _)))) => {
                tracing::warn!(shard, error = %e, failed, "Kafka did not acknowledge change events; will retry")
            }
            _ => tracing::warn!(shard, failed, "Kafka did not acknowledge change events in time; will retry"),
        }
    }
    acked
}

/// A row's message on the public change stream; None (logged) for an
/// event that does not decode, which the change topic still carries
/// (its consumers dead-letter it).
fn public_message(relays: &Relays, shard: usize, row: &OutboxRow) -> Option<changes::ChangeMessage> {
    match ChangeEvent::decode(&row.event) {
        Ok(event) => {
            let logical = relays.shards.logical_of_id(&event.id);
            Some(changes::change_message(&event, logical, relays.shards.name(shard)))
        }
        Err(e) => {
            tracing::error!(shard, id = %row.entity_id, error = %e, "an outbox event does not decode; left out of the change stream");
            None
        }
    }
}
