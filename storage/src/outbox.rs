//! The `outbox` table: change events committed with their write and not yet
//! acknowledged by Kafka. The writer inserts in the write transaction; the
//! shard's relay reads them in `seq` order and deletes what Kafka
//! acknowledged.

use schemas::EntityId;
use sqlx::mysql::MySqlPool;
use sqlx::{MySqlConnection, Row};

use crate::error::{id_column, OnShard, Result};
use crate::rows::{Rows, KEYS_PER_STATEMENT};

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

/// The server's clock, the start of the oldest transaction open on the
/// shard's database, and the commit time of the oldest unpublished event,
/// read in that order: every write stamped before all three is committed
/// and published. µs since the epoch.
///
/// The open transactions count because a write's timestamp (`updated`,
/// its event's `committed_at_us`) is taken inside its transaction, before
/// its commit: a write stamped at t and still open is in no outbox yet,
/// and on a busy machine its commit can come seconds after t. A transaction
/// open now began before any stamp it will commit, so a time before its
/// start is one no such write can fall behind. Seeing other sessions'
/// transactions needs the `PROCESS` privilege; without it `open_since_us`
/// is `None` and only the lag probe's margin covers a late commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxProbe {
    pub now_us: i64,
    /// Start of the oldest transaction open on the database (whole seconds,
    /// rounded down, as InnoDB reports it; another session's, not ours), or
    /// the clock less the age InnoDB's list of them can have, if earlier.
    pub open_since_us: Option<i64>,
    pub oldest_commit_us: Option<i64>,
}

impl OutboxProbe {
    /// Every write stamped before this is committed and published.
    pub fn settled_before_us(&self) -> i64 {
        self.now_us.min(self.open_since_us.unwrap_or(i64::MAX)).min(self.oldest_commit_us.unwrap_or(i64::MAX))
    }
}

/// Change events into the outbox in multi-row statements, in the given
/// order (so `seq` follows it).
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn insert_outbox_rows(
    shard: usize,
    conn: &mut MySqlConnection,
    rows: &[OutboxInsert],
) -> Result<()> {
    let table = schemas::names::tables::OUTBOX;
    let insert = Rows::new(
        format!("INSERT INTO {table} (entity_id, version, committed, event) VALUES "),
        "(?, ?, TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00'), ?)",
        "",
    );
    // One statement after another, rows in order within each: `seq`
    // follows the order given.
    for st in insert.statements(rows) {
        let q = st.bind(sqlx::query(&st.sql), |q, row| {
            q.bind(&row.entity_id.0[..]).bind(row.version).bind(row.committed_us).bind(&row.event[..])
        });
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
    let delete = Rows::new("DELETE FROM outbox WHERE seq IN (", "?", ")").at_most(KEYS_PER_STATEMENT);
    for st in delete.statements(seqs) {
        st.bind(sqlx::query(&st.sql), |q, s| q.bind(*s)).execute(&mut *conn).await.on(shard)?;
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

/// See [`OutboxProbe`]. Two statements, in this order: a transaction
/// that commits between them is either still open at the first or in the
/// outbox (or published) at the second.
pub async fn outbox_probe(shard: usize, pool: &MySqlPool) -> Result<OutboxProbe> {
    let mut conn = pool.acquire().await.on(shard)?;
    let (now_us, open_since_us) = open_transactions(shard, &mut conn).await?;
    let oldest_commit_us: Option<i64> = sqlx::query_scalar(
        "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(committed)) FROM outbox",
    )
    .fetch_one(&mut *conn)
    .await
    .on(shard)?;
    Ok(OutboxProbe { now_us, open_since_us, oldest_commit_us })
}

/// The server's clock and a time before which no other session's
/// transaction on this connection's database is open but the oldest one
/// reported (`None`: no `PROCESS` privilege to see them, said once per
/// process).
/// How stale `information_schema.INNODB_TRX` can be (InnoDB refreshes its
/// cache at most every 100 ms), with room to spare.
const TRX_CACHE_AGE_US: i64 = 200_000;

async fn open_transactions(shard: usize, conn: &mut MySqlConnection) -> Result<(i64, Option<i64>)> {
    let with_open = sqlx::query_as::<_, (i64, Option<i64>)>(
        "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', NOW(6)) AS SIGNED), \
         (SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(t.trx_started)) AS SIGNED) \
            FROM information_schema.INNODB_TRX t \
            JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id \
           WHERE p.DB = DATABASE() AND p.ID <> CONNECTION_ID())",
    )
    .fetch_one(&mut *conn)
    .await;
    match with_open {
        // InnoDB fills INNODB_TRX from a cache it refreshes at most every
        // 100 ms: a transaction younger than that may be missing, so the
        // answer vouches only for transactions begun before `now` less the
        // cache's age (seen failing: a relay round 6 ms after a
        // transaction began did not see it).
        Ok((now, open)) => {
            let seen_before = now - TRX_CACHE_AGE_US;
            Ok((now, Some(open.map_or(seen_before, |o| o.min(seen_before)))))
        }
        // ER_SPECIFIC_ACCESS_DENIED_ERROR: INNODB_TRX needs PROCESS.
        Err(sqlx::Error::Database(e))
            if e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                .is_some_and(|m| m.number() == 1227) =>
        {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!(shard, error = %e, "cannot see other sessions' open transactions (grant PROCESS): \
                    the lag probe's settled time then relies on its margin alone for writes that commit late");
            });
            let now: i64 = sqlx::query_scalar(
                "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', NOW(6)) AS SIGNED)",
            )
            .fetch_one(&mut *conn)
            .await
            .on(shard)?;
            Ok((now, None))
        }
        Err(e) => Err(e).on(shard),
    }
}
