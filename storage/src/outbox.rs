//! The `outbox` table: change events committed with their write and not yet
//! acknowledged by Kafka. The writer inserts in the write transaction; the
//! shard's relay reads them in `seq` order and deletes what Kafka
//! acknowledged.

use schemas::settings::Outbox;
use schemas::EntityId;
use sqlx::mysql::MySqlPool;
use sqlx::{MySqlConnection, Row};

use crate::entities::marks;
use crate::error::{id_column, OnShard, Result};

/// One change event to insert, committed with its write.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxInsert {
    pub entity_id: EntityId,
    pub version: u64,
    /// The write's commit time, µs since the Unix epoch.
    pub committed_us: i64,
    /// The encoded `schemas::ChangeEvent`.
    pub event: Vec<u8>,
}

/// One event waiting for Kafka.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub seq: u64,
    pub entity_id: EntityId,
    pub event: Vec<u8>,
}

/// What waits in a shard's outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    pub rows: u64,
    /// Commit time (µs) of the oldest waiting event, if any.
    pub oldest_commit_us: Option<i64>,
}

/// The server's clock and the commit time of the oldest unpublished event,
/// read together: every event committed before the oldest one still in the
/// outbox (and before now) has been published. µs since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxProbe {
    pub now_us: i64,
    pub oldest_commit_us: Option<i64>,
}

/// Change events into the configured outbox (the table, or `outbox_log`
/// in binlog mode: see `relay_log`) in multi-row statements, in the given
/// order (so `seq`, or the log, follows it).
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn insert_outbox_rows(
    shard: usize,
    conn: &mut MySqlConnection,
    rows: &[OutboxInsert],
    outbox: Outbox,
) -> Result<()> {
    let table = match outbox {
        Outbox::Table => schemas::names::tables::OUTBOX,
        Outbox::Binlog => schemas::names::tables::OUTBOX_LOG,
    };
    for chunk in rows.chunks(500) {
        let sql = format!(
            "INSERT INTO {table} (entity_id, version, committed, event) VALUES {}",
            vec!["(?, ?, TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00'), ?)"; chunk.len()].join(", ")
        );
        let mut q = sqlx::query(&sql);
        for row in chunk {
            q = q.bind(&row.entity_id.0[..]).bind(row.version).bind(row.committed_us).bind(&row.event[..]);
        }
        q.execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// The oldest unpublished events, in `seq` order (which, for one entity, is
/// version order: its writes serialize on the row lock).
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn read_outbox(shard: usize, conn: &mut MySqlConnection, limit: usize) -> Result<Vec<OutboxRow>> {
    let rows = sqlx::query("SELECT seq, entity_id, event FROM outbox ORDER BY seq LIMIT ?")
        .bind(limit as u64)
        .fetch_all(&mut *conn)
        .await
        .on(shard)?;
    rows.iter()
        .map(|r| {
            Ok(OutboxRow {
                seq: r.try_get("seq").on(shard)?,
                entity_id: id_column(shard, r, "entity_id")?,
                event: r.try_get("event").on(shard)?,
            })
        })
        .collect()
}

/// Deletes exactly the listed rows: a row with a lower `seq` that committed
/// late is not in the list and so survives to be published next round.
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn delete_outbox(shard: usize, conn: &mut MySqlConnection, seqs: &[u64]) -> Result<()> {
    for chunk in seqs.chunks(1000) {
        let sql = format!("DELETE FROM outbox WHERE seq IN ({})", marks(chunk.len()));
        let mut q = sqlx::query(&sql);
        for s in chunk {
            q = q.bind(*s);
        }
        q.execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// Makes the binary log record this session's row deletes by primary key
/// only (`binlog_row_image = MINIMAL` for the session): a published row's
/// delete then logs its `seq`, not its event a second time. The server's
/// own setting (FULL, as Debezium and the writers' updates need) is left
/// alone. Needs the privilege to set the variable; without it the deletes
/// log full rows, as before.
pub async fn log_deletes_by_key(shard: usize, conn: &mut MySqlConnection) -> Result<()> {
    sqlx::query("SET SESSION binlog_row_image = 'MINIMAL'").execute(&mut *conn).await.on(shard)?;
    Ok(())
}

/// See [`Backlog`].
pub async fn outbox_backlog(shard: usize, pool: &MySqlPool) -> Result<Backlog> {
    let row = sqlx::query(
        "SELECT COUNT(*) AS n, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(committed)) AS oldest FROM outbox",
    )
    .fetch_one(pool)
    .await
    .on(shard)?;
    Ok(Backlog {
        rows: row.try_get::<i64, _>("n").on(shard)? as u64,
        oldest_commit_us: row.try_get("oldest").on(shard)?,
    })
}

/// See [`OutboxProbe`].
pub async fn outbox_probe(shard: usize, pool: &MySqlPool) -> Result<OutboxProbe> {
    let row = sqlx::query(
        "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', NOW(6)) AS now_us, \
         TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(committed)) AS oldest FROM outbox",
    )
    .fetch_one(pool)
    .await
    .on(shard)?;
    Ok(OutboxProbe {
        now_us: row.try_get("now_us").on(shard)?,
        oldest_commit_us: row.try_get("oldest").on(shard)?,
    })
}
