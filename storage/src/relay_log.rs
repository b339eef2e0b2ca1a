//! The outbox in the binary log (`writer.outbox = "binlog"`): the writer
//! inserts a write's change events into `outbox_log`, a `BLACKHOLE` table,
//! in the write's transaction. MariaDB writes the insert to the binary log
//! with the rest of the transaction, atomically with its commit, and
//! stores nothing; a rolled-back transaction leaves nothing in the log.
//! The shard's relay streams the binary log over the replication protocol
//! from its saved position and publishes the `outbox_log` rows of its own
//! database, in log order, which for one entity is version order (its
//! writes serialize on the row lock and are logged at commit).
//!
//! Per shard, the table `bagstore_relay_log` holds one row: where the relay
//! is in the log (every event before it is acknowledged by Kafka) and
//! `through_us`, a time on the shard's clock before which every committed
//! write's events are published. The relay writes it with its session's
//! `sql_log_bin` off, so its own bookkeeping never moves the log it reads.
//! `through_us` answers what the outbox table's rows answer in table mode:
//! the cleaner's lag probe, `bagstore dev`'s drain, the tests' "caught
//! up". A move's fence waits by place instead ([`published_through`]).

use schemas::settings::{Dsn, Outbox};
use sqlx::mysql::MySqlPool;
use sqlx::{MySqlConnection, Row};

use crate::error::{OnShard, Result, StoreError};
use crate::outbox::{Backlog, OutboxProbe};

/// A place in a server's binary log: a file name and a byte offset in it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct LogPosition {
    /// The log's file name (`<basename>.000042`: names sort as the files
    /// follow each other).
    pub file: String,
    pub pos: u64,
}

/// The relay's saved place, and the time before which every write is
/// published (µs since the epoch, shard clock; 0 until the relay first
/// caught up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub at: LogPosition,
    pub through_us: i64,
}

/// The end of the server's binary log now, and a time before which every
/// write is logged before `end`: the server's clock read just before it,
/// or the start of the oldest transaction then open on the database if
/// that is earlier. A write's timestamp is read inside its transaction,
/// before its commit (see `crate::outbox::OutboxProbe`): one stamped before
/// the clock reading can commit after `end` was read, and a `through_us`
/// set from the clock alone then claimed it published while it was not.
pub async fn log_end(shard: usize, conn: &mut MySqlConnection) -> Result<(i64, LogPosition)> {
    let (now_us, open_since_us) = crate::outbox::open_transactions(shard, conn).await?;
    let now_us = now_us.min(open_since_us.unwrap_or(i64::MAX));
    Ok((now_us, log_position(shard, conn).await?))
}

/// The end of the server's binary log now.
pub async fn log_position(shard: usize, conn: &mut MySqlConnection) -> Result<LogPosition> {
    let row = sqlx::query("SHOW MASTER STATUS").fetch_optional(&mut *conn).await.on(shard)?;
    let Some(row) = row else {
        return Err(StoreError::BadTopology(format!(
            "shard {shard}: writer.outbox = \"binlog\" needs the binary log on (log_bin, binlog_format = ROW)"
        )));
    };
    let file: String = row.try_get("File").on(shard)?;
    let pos: u64 = row.try_get("Position").on(shard)?;
    Ok(LogPosition { file, pos })
}

/// Checks the server logs what the relay needs: ROW format with full row
/// images (the relay reads the event column of each insert).
pub async fn check_server(shard: usize, conn: &mut MySqlConnection) -> Result<()> {
    // The server's values, which the writers' sessions log with: the
    // table-mode relay's own session logs with a MINIMAL row image
    // (`crate::outbox::log_deletes_by_key`), and it is the one that checks
    // before it publishes what binlog mode left.
    let (log_bin, format, image): (i64, String, String) = sqlx::query_as(
        "SELECT CAST(@@GLOBAL.log_bin AS SIGNED), CAST(@@GLOBAL.binlog_format AS CHAR), \
         CAST(@@GLOBAL.binlog_row_image AS CHAR)",
    )
    .fetch_one(&mut *conn)
    .await
    .on(shard)?;
    if log_bin != 1 || format != "ROW" || image != "FULL" {
        return Err(StoreError::BadTopology(format!(
            "shard {shard}: writer.outbox = \"binlog\" needs log_bin = ON, binlog_format = ROW and \
             binlog_row_image = FULL; the server has log_bin = {log_bin}, binlog_format = {format}, \
             binlog_row_image = {image}"
        )));
    }
    Ok(())
}

/// Records the log's end as the relay's starting place unless a place is
/// saved already. Called before a process writes in binlog mode (by
/// `migrate` and at a writer's and a relay's start), so the earliest call
/// is before any event in the log: none is skipped.
pub async fn ensure_start(shard: usize, conn: &mut MySqlConnection) -> Result<()> {
    let end = log_position(shard, conn).await?;
    sqlx::query("INSERT IGNORE INTO bagstore_relay_log (id, file, pos, through_us) VALUES (1, ?, ?, 0)")
        .bind(&end.file)
        .bind(end.pos)
        .execute(&mut *conn)
        .await
        .on(shard)?;
    Ok(())
}

/// The relay's saved place, if binlog mode ever started on this shard.
pub async fn saved(shard: usize, conn: &mut MySqlConnection) -> Result<Option<Saved>> {
    let row = sqlx::query("SELECT file, pos, through_us FROM bagstore_relay_log WHERE id = 1")
        .fetch_optional(&mut *conn)
        .await
        .on(shard)?;
    row.map(|r| {
        Ok(Saved {
            at: LogPosition { file: r.try_get("file").on(shard)?, pos: r.try_get("pos").on(shard)? },
            through_us: r.try_get("through_us").on(shard)?,
        })
    })
    .transpose()
}

/// Turns the binary log off (or back on) for this session's writes: off
/// for the relay's bookkeeping. Needs `BINLOG ADMIN`; the error says so.
pub async fn log_session(shard: usize, conn: &mut MySqlConnection, on: bool) -> Result<()> {
    let sql = if on { "SET SESSION sql_log_bin = 1" } else { "SET SESSION sql_log_bin = 0" };
    sqlx::query(sql).execute(&mut *conn).await.map_err(|e| {
        StoreError::BadTopology(format!(
            "shard {shard}: the binlog relay cannot turn sql_log_bin off for its bookkeeping \
             (grant BINLOG ADMIN to the shards' user): {e}"
        ))
    })?;
    Ok(())
}

/// Saves the relay's place after Kafka acknowledged everything before it.
/// `through_us` never goes back.
pub async fn save(shard: usize, conn: &mut MySqlConnection, saved: &Saved) -> Result<()> {
    sqlx::query(
        "UPDATE bagstore_relay_log SET file = ?, pos = ?, through_us = GREATEST(through_us, ?) WHERE id = 1",
    )
    .bind(&saved.at.file)
    .bind(saved.at.pos)
    .bind(saved.through_us)
    .execute(&mut *conn)
    .await
    .on(shard)?;
    Ok(())
}

/// A replication client id for a stream from the server behind `conn`,
/// unique among its replicas while `conn` lives: its connection id, in the
/// upper half of the range (replicas' configured ids are small).
pub async fn stream_id(shard: usize, conn: &mut MySqlConnection) -> Result<u32> {
    let (id,): (u64,) = sqlx::query_as("SELECT CONNECTION_ID()").fetch_one(&mut *conn).await.on(shard)?;
    Ok(0x8000_0000 | (id as u32 & 0x7fff_ffff))
}

/// Forgets the relay's place (after a table-mode relay published what the
/// log still held), so a later switch to binlog mode starts afresh.
pub async fn forget(shard: usize, conn: &mut MySqlConnection) -> Result<()> {
    sqlx::query("DELETE FROM bagstore_relay_log WHERE id = 1").execute(&mut *conn).await.on(shard)?;
    Ok(())
}

/// The shard's clock, and `through_us` when in binlog mode with a place.
async fn clock_and_through(shard: usize, pool: &MySqlPool) -> Result<(i64, Option<i64>)> {
    let row = sqlx::query(
        "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', NOW(6)) AS SIGNED) AS now_us, \
         (SELECT through_us FROM bagstore_relay_log WHERE id = 1) AS through_us",
    )
    .fetch_one(pool)
    .await
    .on(shard)?;
    Ok((row.try_get("now_us").on(shard)?, row.try_get("through_us").on(shard)?))
}

/// What waits to be published on the shard, whichever the outbox: the
/// table's rows (what a switch left there counts in binlog mode too) and,
/// in binlog mode, whether the relay's saved place is short of the log's
/// end. That is exact: every committed write is before the end, and the
/// place is saved only once Kafka acknowledged everything before it. The
/// count is the entity rows written since `through_us` (at least 1 when
/// the place is short), so a write whose clock reading came before a
/// round and its commit after it still counts as waiting.
pub async fn backlog(shard: usize, pool: &MySqlPool, outbox: Outbox) -> Result<Backlog> {
    let table = crate::outbox::outbox_backlog(shard, pool).await?;
    if outbox == Outbox::Table {
        return Ok(table);
    }
    let mut conn = pool.acquire().await.on(shard)?;
    let end = log_position(shard, &mut conn).await?;
    let Some(saved) = saved(shard, &mut conn).await? else {
        return Err(StoreError::BadTopology(format!("shard {shard}: no binlog relay place (run migrate)")));
    };
    if saved.at >= end {
        return Ok(table);
    }
    let row = sqlx::query(
        "SELECT COUNT(*) AS n, \
         TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(updated)) AS oldest \
         FROM entities WHERE updated >= TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00')",
    )
    .bind(saved.through_us)
    .fetch_one(&mut *conn)
    .await
    .on(shard)?;
    let n: i64 = row.try_get("n").on(shard)?;
    let oldest: Option<i64> = row.try_get("oldest").on(shard)?;
    Ok(Backlog {
        rows: table.rows + (n as u64).max(1),
        oldest_commit_us: match (table.oldest_commit_us, oldest) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b).or(Some(saved.through_us)),
        },
    })
}

/// The lag probe's question (see [`OutboxProbe`]) whichever the outbox:
/// in binlog mode every event committed before `through_us` is published.
pub async fn probe(shard: usize, pool: &MySqlPool, outbox: Outbox) -> Result<OutboxProbe> {
    let table = crate::outbox::outbox_probe(shard, pool).await?;
    if outbox == Outbox::Table {
        return Ok(table);
    }
    let (_, through) = clock_and_through(shard, pool).await?;
    let through = through.unwrap_or(0);
    Ok(OutboxProbe {
        oldest_commit_us: Some(table.oldest_commit_us.map_or(through, |t| t.min(through))),
        ..table
    })
}

/// Whether the relay has published everything logged before `end`: a
/// move's fence waits for the log's end read under it
/// (`moves::Fence::log_end`). By place in the log, not by `through_us`:
/// writes waiting on the fence's locks are open transactions, which hold
/// `through_us` back until the fence opens.
pub async fn published_through(shard: usize, pool: &MySqlPool, end: &LogPosition) -> Result<bool> {
    let mut conn = pool.acquire().await.on(shard)?;
    Ok(saved(shard, &mut conn).await?.is_some_and(|s| s.at >= *end))
}

/// One change event read from the binary log: an `outbox_log` insert of
/// the reader's database, in a committed transaction.
#[derive(Debug, Clone)]
pub struct LoggedEvent {
    pub entity_id: schemas::EntityId,
    /// The encoded `schemas::ChangeEvent`.
    pub event: Vec<u8>,
}

/// How long the log may stay silent while the reader knows it has more to
/// send (it is reading towards a position the server reported).
const SILENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// `LOG_EVENT_ARTIFICIAL_F`: an event the server made up for the stream
/// (not in the log), such as the rotate that opens it.
const ARTIFICIAL: u16 = 0x0020;

/// A replication connection streaming one server's binary log from a
/// place, keeping the `outbox_log` inserts of one database.
pub struct LogReader {
    shard: usize,
    stream: mysql_async::BinlogStream,
    database: String,
    /// The end of the last whole transaction read (or of the last event
    /// outside one): where a reader restarts without losing or splitting
    /// a transaction.
    at: LogPosition,
    /// The log file being read (positions in events are within it).
    file: String,
    /// Events of the transaction being read, kept until its commit.
    open: Vec<LoggedEvent>,
    /// Whether the transaction being read has begun (rows or a table map
    /// seen since the last commit).
    in_transaction: bool,
}

impl std::fmt::Debug for LogReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogReader").field("shard", &self.shard).field("at", &self.at).finish()
    }
}

impl LogReader {
    /// Opens a replication stream of the server behind `dsn` (its user
    /// needs `REPLICATION SLAVE`) at `from`, keeping the `outbox_log`
    /// inserts of `database`. `server_id` must differ from every other
    /// replica's of that server (MariaDB ends a stream when another with
    /// its id registers).
    pub async fn open(shard: usize, dsn: &Dsn, from: &LogPosition, server_id: u32) -> Result<LogReader> {
        let bad =
            |e: String| StoreError::BadTopology(format!("shard {shard}: the binlog relay's stream: {e}"));
        let (database, _) = crate::shards::split_database(dsn)
            .ok_or_else(|| bad("the shard's DSN names no database".into()))?;
        let opts = mysql_async::Opts::from_url(dsn.expose())
            .map_err(|e| bad(format!("cannot use the shard's DSN: {e}")))?;
        let conn = mysql_async::Conn::new(opts).await.map_err(|e| bad(format!("cannot connect: {e}")))?;
        let request = mysql_async::BinlogStreamRequest::new(server_id)
            .with_filename(from.file.as_bytes())
            .with_pos(from.pos);
        let stream = conn.get_binlog_stream(request).await.map_err(|e| {
            bad(format!(
                "cannot stream the binary log from {}:{} (grant REPLICATION SLAVE; a place older than the \
                 server keeps is an error too): {e}",
                from.file, from.pos
            ))
        })?;
        Ok(LogReader {
            shard,
            stream,
            database,
            at: from.clone(),
            file: from.file.clone(),
            open: Vec::new(),
            in_transaction: false,
        })
    }

    /// Where the reader stands: every whole transaction before it is read.
    pub fn position(&self) -> &LogPosition {
        &self.at
    }

    /// Reads whole transactions into `out` until the reader stands at or
    /// past `until`, or `out` holds at least `max` events (it stops only
    /// at a transaction's end, so a large transaction may overshoot).
    pub async fn read_to(
        &mut self,
        until: &LogPosition,
        max: usize,
        out: &mut Vec<LoggedEvent>,
    ) -> Result<()> {
        use futures::StreamExt;
        use mysql_async::binlog::events::{EventData, RowsEventData};
        let shard = self.shard;
        let broken =
            |e: String| StoreError::BadTopology(format!("shard {shard}: the binary log stream: {e}"));
        while self.at < *until && out.len() < max {
            let next = tokio::time::timeout(SILENCE, self.stream.next())
                .await
                .map_err(|_| broken(format!("silent for {SILENCE:?} before {}:{}", until.file, until.pos)))?;
            let event = match next {
                Some(Ok(e)) => e,
                Some(Err(e)) => return Err(broken(e.to_string())),
                None => return Err(broken("ended".into())),
            };
            let end = u64::from(event.header().log_pos());
            let artificial = event.header().flags_raw() & ARTIFICIAL != 0;
            let data = event.read_data().map_err(|e| broken(format!("an event does not parse: {e}")))?;
            match data {
                Some(EventData::RotateEvent(_)) if artificial => {
                    // The server's first event names the file asked for, and
                    // before the stream's format is known its name is read
                    // with the event's checksum trailing: not a place.
                    continue;
                }
                Some(EventData::RotateEvent(r)) => {
                    let name = r.name().into_owned();
                    // Places compare by name: a name of another log would
                    // put the reader past (or before) everything.
                    if basename(&name) != basename(&until.file) {
                        return Err(broken(format!(
                            "rotated to {name:?}, not a file of {:?}'s log",
                            until.file
                        )));
                    }
                    self.file = name;
                    if !self.in_transaction {
                        self.at = LogPosition { file: self.file.clone(), pos: r.position() };
                    }
                    continue;
                }
                Some(EventData::TableMapEvent(_)) => self.in_transaction = true,
                Some(EventData::RowsEvent(rows)) => {
                    self.in_transaction = true;
                    if !matches!(rows, RowsEventData::WriteRowsEventV1(_) | RowsEventData::WriteRowsEvent(_))
                    {
                        continue;
                    }
                    let Some(table) = self.stream.get_tme(rows.table_id()) else {
                        return Err(broken(format!(
                            "rows of table {} without its table map",
                            rows.table_id()
                        )));
                    };
                    if table.database_name() != self.database
                        || table.table_name() != schemas::names::tables::OUTBOX_LOG
                    {
                        continue;
                    }
                    for row in rows.rows(table) {
                        let (_, after) =
                            row.map_err(|e| broken(format!("an outbox_log row does not parse: {e}")))?;
                        let after =
                            after.ok_or_else(|| broken("an outbox_log insert without its row".into()))?;
                        self.open.push(logged(&after).map_err(broken)?);
                    }
                }
                Some(EventData::XidEvent(_)) => {
                    out.append(&mut self.open);
                    self.in_transaction = false;
                    if end > 0 {
                        self.at = LogPosition { file: self.file.clone(), pos: end };
                    }
                }
                Some(EventData::QueryEvent(q)) if !self.in_transaction => {
                    // A statement outside a transaction (DDL, BEGIN): past it
                    // nothing of a transaction is lost.
                    let _ = q;
                    if end > 0 {
                        self.at = LogPosition { file: self.file.clone(), pos: end };
                    }
                }
                Some(EventData::QueryEvent(q)) => {
                    // A transaction of non-transactional tables ends with a
                    // COMMIT statement; one that rolled back, with ROLLBACK
                    // (its outbox_log rows are not events).
                    let sql = q.query();
                    if sql.eq_ignore_ascii_case("COMMIT") {
                        out.append(&mut self.open);
                    } else if sql.eq_ignore_ascii_case("ROLLBACK") {
                        self.open.clear();
                    } else {
                        continue;
                    }
                    self.in_transaction = false;
                    if end > 0 {
                        self.at = LogPosition { file: self.file.clone(), pos: end };
                    }
                }
                _ => {
                    if !self.in_transaction && end > 0 {
                        self.at = LogPosition { file: self.file.clone(), pos: end };
                    }
                }
            }
        }
        Ok(())
    }
}

/// A log file's name without its sequence number (`binlog.000042` →
/// `binlog`).
fn basename(file: &str) -> &str {
    file.rsplit_once('.').map_or(file, |(base, _)| base)
}

/// An `outbox_log` row's event: its `entity_id` (column 1) and `event`
/// (column 4), as `ddl::outbox_log` orders them.
fn logged(row: &mysql_async::binlog::row::BinlogRow) -> std::result::Result<LoggedEvent, String> {
    use mysql_async::binlog::value::BinlogValue;
    let bytes = |i: usize| match row.as_ref(i) {
        Some(BinlogValue::Value(mysql_async::Value::Bytes(b))) => Ok(b.clone()),
        other => Err(format!("outbox_log column {i} is not bytes: {other:?}")),
    };
    // The log packs a BINARY(16) without its trailing zero bytes.
    let packed = bytes(1)?;
    if packed.len() > 16 {
        return Err(format!("outbox_log entity_id has {} bytes", packed.len()));
    }
    let mut id = [0u8; 16];
    id[..packed.len()].copy_from_slice(&packed);
    Ok(LoggedEvent { entity_id: schemas::EntityId(id), event: bytes(4)? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_order_by_file_then_offset() {
        let at = |file: &str, pos| LogPosition { file: file.into(), pos };
        assert!(at("binlog.000001", 900) < at("binlog.000002", 4));
        assert!(at("binlog.000002", 4) < at("binlog.000002", 5));
        assert_eq!(basename("binlog.000002"), "binlog");
        assert_eq!(basename("mysql-bin.a.000002"), "mysql-bin.a");
    }
}
