//! Shared storage access: every SQL statement bagstore runs, one function
//! each. Services call these; nothing here knows about HTTP or Kafka.
//!
//! Timestamps cross the wire as integer microseconds since the Unix epoch;
//! sqlx sets each session's `time_zone` to UTC, so `TIMESTAMPADD` /
//! `TIMESTAMPDIFF` against the epoch are exact.

use sqlx::mysql::{MySqlArguments, MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::query::Query;
use sqlx::{Connection, MySql, MySqlConnection, Row};
use std::str::FromStr;
use std::time::Duration;

use crate::ddl;
use crate::id::EntityId;
use crate::index::{IndexKey, IndexSpec, KeyValue};
use crate::settings::{Dsn, MysqlSettings};
use crate::shard::shard_of;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("shard {shard} is unavailable or failed a statement")]
    Shard {
        shard: usize,
        #[source]
        source: sqlx::Error,
    },
    #[error("{dsn} is not a valid MySQL URL")]
    BadDsn {
        dsn: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("index {table:?} already exists with another definition; drop it or pick a new table name")]
    SpecChanged { table: String },
    #[error("stored index metadata for {table:?} is unreadable")]
    BadMeta {
        table: String,
        #[source]
        source: serde_json::Error,
    },
}

impl StoreError {
    /// The MySQL error number, when the server answered with an error.
    fn mysql_number(&self) -> Option<u16> {
        match self {
            StoreError::Shard { source: sqlx::Error::Database(db), .. } => {
                db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().map(|e| e.number())
            }
            _ => None,
        }
    }

    /// Deadlocks, lock wait timeouts and a lost race to insert the same new
    /// id: the transaction was rolled back and may simply be run again.
    pub fn is_retryable_conflict(&self) -> bool {
        matches!(self.mysql_number(), Some(1213 | 1205 | 1062))
    }

    /// The connection is gone, not the statement refused: I/O and protocol
    /// errors, and the server's "connection was killed" (1927), "server
    /// shutdown in progress" (1053) and lost-connection (2006, 2013).
    pub fn is_dead_connection(&self) -> bool {
        matches!(
            self,
            StoreError::Shard {
                source: sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_),
                ..
            }
        ) || matches!(self.mysql_number(), Some(1927 | 1053 | 2006 | 2013))
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Attaches the shard number to a sqlx error.
pub trait OnShard<T> {
    fn on(self, shard: usize) -> Result<T>;
}

impl<T> OnShard<T> for std::result::Result<T, sqlx::Error> {
    fn on(self, shard: usize) -> Result<T> {
        self.map_err(|source| StoreError::Shard { shard, source })
    }
}

/// Reads a `BINARY(16)` id column. Every id column is `BINARY(16) NOT
/// NULL`, so a wrong length cannot come from our own writes; it reads as
/// the all-zero id rather than failing a whole scan.
fn id_column(shard: usize, r: &sqlx::mysql::MySqlRow, col: &str) -> Result<EntityId> {
    let bytes: Vec<u8> = r.try_get(col).on(shard)?;
    Ok(EntityId::from_slice(&bytes).unwrap_or(EntityId([0; 16])))
}

/// Per shard, in shard order: a sqlx pool, and the ping-free connections
/// of the hot paths ([`crate::conns`]).
#[derive(Debug, Clone)]
pub struct Shards {
    pools: Vec<MySqlPool>,
    conns: Vec<std::sync::Arc<crate::conns::Conns>>,
    dsns: Vec<Dsn>,
}

pub fn connect_options(dsn: &Dsn) -> Result<MySqlConnectOptions> {
    MySqlConnectOptions::from_str(dsn.expose())
        .map_err(|source| StoreError::BadDsn { dsn: dsn.redacted(), source })
}

impl Shards {
    /// Pools connect lazily, so a service can start before MySQL is up and
    /// report the outage per request instead of refusing to start.
    pub fn connect_lazy(settings: &MysqlSettings) -> Result<Shards> {
        let mut pools = Vec::new();
        let mut conns = Vec::new();
        for (shard, dsn) in settings.shards.iter().enumerate() {
            let opts = connect_options(dsn)?;
            conns.push(std::sync::Arc::new(crate::conns::Conns::new(
                shard,
                opts.clone(),
                settings.max_connections,
            )));
            pools.push(
                MySqlPoolOptions::new()
                    .max_connections(settings.max_connections)
                    .acquire_timeout(Duration::from_millis(settings.connect_timeout_ms))
                    // READ COMMITTED: a locking read of an absent id takes no
                    // gap lock, so concurrent inserts of different new ids do
                    // not deadlock; two inserts of the same new id collide on
                    // the unique key instead, and the loser retries.
                    .after_connect(|conn, _| {
                        Box::pin(async move {
                            sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                                .execute(&mut *conn)
                                .await
                                .map(|_| ())
                        })
                    })
                    .connect_lazy_with(opts),
            );
        }
        Ok(Shards { pools, conns, dsns: settings.shards.clone() })
    }

    pub fn count(&self) -> usize {
        self.pools.len()
    }

    pub fn pool(&self, shard: usize) -> &MySqlPool {
        &self.pools[shard]
    }

    /// Ping-free connections for the hot paths (see [`crate::conns`]).
    pub fn conns(&self, shard: usize) -> &crate::conns::Conns {
        &self.conns[shard]
    }

    pub fn dsn(&self, shard: usize) -> &Dsn {
        &self.dsns[shard]
    }

    pub fn of_id(&self, id: &EntityId) -> usize {
        shard_of(id.as_bytes(), self.count())
    }

    /// Waits until every shard answers, up to `deadline`.
    pub async fn wait_ready(&self, deadline: Duration) -> Result<()> {
        let until = tokio::time::Instant::now() + deadline;
        for (shard, pool) in self.pools.iter().enumerate() {
            loop {
                match sqlx::query("SELECT 1").execute(pool).await {
                    Ok(_) => break,
                    Err(e) if tokio::time::Instant::now() >= until => return Err(e).on(shard),
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        }
        Ok(())
    }

    pub async fn close(&self) {
        for p in &self.pools {
            p.close().await;
        }
    }
}

/// A dedicated connection outside any pool (relay leadership lives on one).
pub async fn dedicated_connection(dsn: &Dsn) -> Result<MySqlConnection, sqlx::Error> {
    MySqlConnection::connect_with(&MySqlConnectOptions::from_str(dsn.expose())?).await
}

/// The database named by a DSN, and the DSN without it (for `CREATE DATABASE`).
pub fn split_database(dsn: &Dsn) -> Option<(String, Dsn)> {
    let s = dsn.expose();
    let (base, query) = match s.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (s, None),
    };
    let after_scheme = base.find("://")? + 3;
    let slash = base[after_scheme..].find('/')? + after_scheme;
    let db = &base[slash + 1..];
    if db.is_empty() {
        return None;
    }
    let server = match query {
        Some(q) => format!("{}?{}", &base[..slash], q),
        None => base[..slash].to_string(),
    };
    Some((db.to_string(), Dsn(server)))
}

// ---------------------------------------------------------------- migrate

/// Creates the shard's database if the DSN names one that is missing.
pub async fn create_database(shard: usize, dsn: &Dsn) -> Result<()> {
    let Some((db, server)) = split_database(dsn) else { return Ok(()) };
    if !crate::names::is_valid_identifier(&db) {
        // Not ours to name (e.g. upper case): assume the operator created it.
        return Ok(());
    }
    let mut conn = dedicated_connection(&server).await.on(shard)?;
    sqlx::query(&format!("CREATE DATABASE IF NOT EXISTS `{db}`")).execute(&mut conn).await.on(shard)?;
    Ok(())
}

pub async fn create_base_tables(shard: usize, pool: &MySqlPool) -> Result<()> {
    for stmt in [ddl::ENTITIES, ddl::OUTBOX] {
        sqlx::query(stmt).execute(pool).await.on(shard)?;
    }
    if shard == 0 {
        sqlx::query(ddl::INDEX_META).execute(pool).await.on(shard)?;
        sqlx::query(ddl::INDEX_PROGRESS).execute(pool).await.on(shard)?;
    }
    Ok(())
}

/// Creates the index table, or brings an older one up to date: a table
/// made before `entity_added_id` existed gets the column (an instant
/// `ALTER` on MariaDB ≥ 10.3 and MySQL ≥ 8.0; its rows read NULL, "location
/// unknown", until the indexer or the cleaner rewrites them).
pub async fn create_index_table(shard: usize, pool: &MySqlPool, spec: &IndexSpec) -> Result<()> {
    sqlx::query(&ddl::index_table(spec)).execute(pool).await.on(shard)?;
    let (has,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = 'entity_added_id'",
    )
    .bind(&spec.table)
    .fetch_one(pool)
    .await
    .on(shard)?;
    if has == 0 {
        let sql = format!("ALTER TABLE `{}` ADD COLUMN {}", spec.table, ddl::LOCATION_COLUMN);
        sqlx::query(&sql).execute(pool).await.on(shard)?;
    }
    Ok(())
}

pub async fn drop_index_table(shard: usize, pool: &MySqlPool, table: &str) -> Result<()> {
    debug_assert!(crate::names::is_valid_identifier(table));
    sqlx::query(&format!("DROP TABLE IF EXISTS `{table}`")).execute(pool).await.on(shard)?;
    Ok(())
}

pub async fn has_entities(shard: usize, pool: &MySqlPool) -> Result<bool> {
    let row = sqlx::query("SELECT EXISTS(SELECT 1 FROM entities) AS e").fetch_one(pool).await.on(shard)?;
    Ok(row.try_get::<i64, _>("e").on(shard)? != 0)
}

// ---------------------------------------------------------------- entities

/// What the writer finds under its row lock.
#[derive(Debug, Clone)]
pub struct Current {
    pub version: u64,
    /// `None` for a tombstone (a deleted entity).
    pub body: Option<Vec<u8>>,
    /// The row's clustered key, fixed for the life of the id.
    pub added_id: u64,
}

/// `SELECT … FOR UPDATE` of many ids in one statement: the rows present (id
/// → current) are locked, and so are the gaps where absent ones would go,
/// until the transaction ends, so writes to one id serialize. Ids are sent sorted, so two batches lock in the same order.
pub async fn lock_entities(
    shard: usize,
    conn: &mut MySqlConnection,
    ids: &[EntityId],
) -> Result<std::collections::HashMap<EntityId, Current>> {
    let mut out = std::collections::HashMap::with_capacity(ids.len());
    let mut sorted: Vec<&EntityId> = ids.iter().collect();
    sorted.sort();
    sorted.dedup();
    for chunk in sorted.chunks(1000) {
        let sql = format!(
            "SELECT id, version, body, added_id FROM entities WHERE id IN ({}) FOR UPDATE",
            vec!["?"; chunk.len()].join(", ")
        );
        let mut q = sqlx::query(&sql);
        for id in chunk {
            q = q.bind(&id.0[..]);
        }
        for r in q.fetch_all(&mut *conn).await.on(shard)? {
            let id = id_column(shard, &r, "id")?;
            out.insert(
                id,
                Current {
                    version: r.try_get("version").on(shard)?,
                    body: r.try_get("body").on(shard)?,
                    added_id: r.try_get("added_id").on(shard)?,
                },
            );
        }
    }
    Ok(out)
}

/// One entity row to write: id, version, `updated` (µs), body (`None`: a
/// tombstone).
pub type EntityRow = (EntityId, u64, i64, Option<Vec<u8>>);

/// Overwrites entity rows in multi-row statements; each id at most once.
/// The rows were present when [`lock_entities`] ran, so they are this
/// transaction's to overwrite.
pub async fn update_entities(shard: usize, conn: &mut MySqlConnection, rows: &[EntityRow]) -> Result<()> {
    for chunk in rows.chunks(500) {
        let sql = entities_sql(chunk.len(), true);
        bind_entities(sqlx::query(&sql), chunk).execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// Inserts new entity rows in multi-row statements (each id at most once)
/// and returns each one's `added_id`, in order (`None` only if a row the
/// transaction just inserted could not be read back, which cannot happen).
///
/// They are plain inserts: a locking read of an absent id (READ COMMITTED)
/// locks nothing, so a concurrent writer may create the same id first; the
/// insert then fails on the unique key (1062, a retryable conflict) instead
/// of silently overwriting that write with the same version.
///
/// The server reports the first `added_id` of a statement
/// (`LAST_INSERT_ID`), the only one of a one-row statement; the others
/// follow it one by one when `consecutive` (see [`autoinc_is_consecutive`]),
/// and are read back otherwise (one more statement).
pub async fn insert_entities(
    shard: usize,
    conn: &mut MySqlConnection,
    rows: &[EntityRow],
    consecutive: bool,
) -> Result<Vec<Option<u64>>> {
    let mut added = Vec::with_capacity(rows.len());
    for chunk in rows.chunks(500) {
        let sql = entities_sql(chunk.len(), false);
        let done = bind_entities(sqlx::query(&sql), chunk).execute(&mut *conn).await.on(shard)?;
        let first = done.last_insert_id();
        if chunk.len() == 1 || consecutive {
            added.extend((0..chunk.len() as u64).map(|i| Some(first + i)));
            continue;
        }
        let sql =
            format!("SELECT id, added_id FROM entities WHERE id IN ({})", vec!["?"; chunk.len()].join(", "));
        let mut q = sqlx::query(&sql);
        for (id, ..) in chunk {
            q = q.bind(&id.0[..]);
        }
        let mut at = std::collections::HashMap::with_capacity(chunk.len());
        for r in q.fetch_all(&mut *conn).await.on(shard)? {
            at.insert(id_column(shard, &r, "id")?, r.try_get::<u64, _>("added_id").on(shard)?);
        }
        added.extend(chunk.iter().map(|(id, ..)| at.get(id).copied()));
    }
    Ok(added)
}

/// `INSERT INTO entities` of `n` rows; `overwrite` makes it an upsert.
fn entities_sql(n: usize, overwrite: bool) -> String {
    let tuple = "(?, ?, TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00'), ?)";
    let tail = match overwrite {
        true => " ON DUPLICATE KEY UPDATE version = VALUES(version), updated = VALUES(updated), body = VALUES(body)",
        false => "",
    };
    format!("INSERT INTO entities (id, version, updated, body) VALUES {}{tail}", vec![tuple; n].join(", "))
}

/// Binds `rows` to an [`entities_sql`] statement.
fn bind_entities<'q>(
    mut q: Query<'q, MySql, MySqlArguments>,
    rows: &'q [EntityRow],
) -> Query<'q, MySql, MySqlArguments> {
    for (id, version, updated_us, body) in rows {
        q = q.bind(&id.0[..]).bind(*version).bind(*updated_us).bind(body.as_deref());
    }
    q
}

/// Whether a multi-row `INSERT` on this server numbers its rows one after
/// another from `LAST_INSERT_ID()`: InnoDB guarantees it for such "simple
/// inserts" in auto-increment lock modes 0 and 1 (MariaDB's default), not
/// in mode 2 (MySQL 8's default), and only with an increment of 1.
pub async fn autoinc_is_consecutive(shard: usize, conn: &mut MySqlConnection) -> Result<bool> {
    let (mode, step): (i64, i64) = sqlx::query_as(
        "SELECT CAST(@@innodb_autoinc_lock_mode AS SIGNED), CAST(@@auto_increment_increment AS SIGNED)",
    )
    .fetch_one(&mut *conn)
    .await
    .on(shard)?;
    Ok(mode <= 1 && step == 1)
}

/// Change events into the outbox in multi-row statements, in the given
/// order (so `seq` follows it).
pub async fn insert_outbox_rows(
    shard: usize,
    conn: &mut MySqlConnection,
    rows: &[(EntityId, u64, i64, Vec<u8>)],
) -> Result<()> {
    for chunk in rows.chunks(500) {
        let sql = format!(
            "INSERT INTO outbox (entity_id, version, committed, event) VALUES {}",
            vec!["(?, ?, TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00'), ?)"; chunk.len()].join(", ")
        );
        let mut q = sqlx::query(&sql);
        for (id, version, committed_us, event) in chunk {
            q = q.bind(&id.0[..]).bind(*version).bind(*committed_us).bind(&event[..]);
        }
        q.execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// A live entity as stored. `added_id` is its row's clustered key on its
/// shard: fixed for the life of the id (updates and deletes keep the row).
#[derive(Debug, Clone)]
pub struct StoredEntity {
    pub id: EntityId,
    pub added_id: u64,
    pub version: u64,
    pub updated_us: i64,
    pub body: Vec<u8>,
}

const ENTITY_COLUMNS: &str =
    "id, added_id, version, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated) AS updated_us, body";

/// The entity of a row of `ENTITY_COLUMNS`; `None` for a tombstone.
fn stored_entity(shard: usize, r: &sqlx::mysql::MySqlRow) -> Result<Option<StoredEntity>> {
    let body: Option<Vec<u8>> = r.try_get("body").on(shard)?;
    let Some(body) = body else { return Ok(None) };
    Ok(Some(StoredEntity {
        id: id_column(shard, r, "id")?,
        added_id: r.try_get("added_id").on(shard)?,
        version: r.try_get("version").on(shard)?,
        updated_us: r.try_get("updated_us").on(shard)?,
        body,
    }))
}

/// Live entities among `ids` (all on this shard), in no particular order.
pub async fn get_entities(
    shard: usize,
    pool: impl sqlx::MySqlExecutor<'_>,
    ids: &[EntityId],
) -> Result<Vec<StoredEntity>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let marks = vec!["?"; ids.len()].join(",");
    let sql = format!("SELECT {ENTITY_COLUMNS} FROM entities WHERE id IN ({marks}) AND body IS NOT NULL");
    let mut q = sqlx::query(&sql);
    for id in ids {
        q = q.bind(&id.0[..]);
    }
    let rows = q.fetch_all(pool).await.on(shard)?;
    rows.iter().filter_map(|r| stored_entity(shard, r).transpose()).collect()
}

/// The rows at `added_ids` (clustered-key lookups: one B-tree descent each,
/// where a lookup by id descends the unique `id` key first): each row's id
/// and its entity, `None` for a tombstone. Rows absent are left out.
pub async fn get_entities_at(
    shard: usize,
    pool: impl sqlx::MySqlExecutor<'_>,
    added_ids: &[u64],
) -> Result<Vec<(EntityId, Option<StoredEntity>)>> {
    if added_ids.is_empty() {
        return Ok(Vec::new());
    }
    let marks = vec!["?"; added_ids.len()].join(",");
    let sql = format!("SELECT {ENTITY_COLUMNS} FROM entities WHERE added_id IN ({marks})");
    let mut q = sqlx::query(&sql);
    for a in added_ids {
        q = q.bind(*a);
    }
    let rows = q.fetch_all(pool).await.on(shard)?;
    rows.iter().map(|r| Ok((id_column(shard, r, "id")?, stored_entity(shard, r)?))).collect()
}

// ---------------------------------------------------------------- sweeps

/// An entity as the cleaner sees it: live or tombstone (`body` None).
#[derive(Debug, Clone)]
pub struct ScannedEntity {
    pub added_id: u64,
    pub id: EntityId,
    pub version: u64,
    pub updated_us: i64,
    pub body: Option<Vec<u8>>,
}

const SCAN_COLUMNS: &str = "added_id, id, version, \
     TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated) AS updated_us, body";

fn scanned(shard: usize, r: &sqlx::mysql::MySqlRow) -> Result<ScannedEntity> {
    Ok(ScannedEntity {
        added_id: r.try_get("added_id").on(shard)?,
        id: id_column(shard, r, "id")?,
        version: r.try_get("version").on(shard)?,
        updated_us: r.try_get("updated_us").on(shard)?,
        body: r.try_get("body").on(shard)?,
    })
}

/// Entities (tombstones included) in `(updated, added_id)` descending order,
/// strictly before `before`, updated at or after `since_us`.
pub async fn scan_entities_by_updated(
    shard: usize,
    pool: &MySqlPool,
    since_us: i64,
    before: Option<(i64, u64)>,
    limit: usize,
) -> Result<Vec<ScannedEntity>> {
    let (b_us, b_added) = before.unwrap_or((i64::MAX / 2, u64::MAX));
    let sql = format!(
        "SELECT {SCAN_COLUMNS} FROM entities \
         WHERE updated >= TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00') \
           AND (updated < TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00') \
                OR (updated = TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00') AND added_id < ?)) \
         ORDER BY updated DESC, added_id DESC LIMIT ?"
    );
    let b_us = b_us.min(253_402_300_799_000_000); // TIMESTAMPADD's ceiling: year 9999
    let rows = sqlx::query(&sql)
        .bind(since_us.max(0))
        .bind(b_us)
        .bind(b_us)
        .bind(b_added)
        .bind(limit as u64)
        .fetch_all(pool)
        .await
        .on(shard)?;
    rows.iter().map(|r| scanned(shard, r)).collect()
}

/// Entities (tombstones included) in `added_id` descending order (newest
/// insert first), strictly below `below`. Order is stable under updates, so
/// a backfill visits every entity that existed when it started exactly once.
pub async fn scan_entities_by_added_id(
    shard: usize,
    pool: &MySqlPool,
    below: Option<u64>,
    limit: usize,
) -> Result<Vec<ScannedEntity>> {
    let sql =
        format!("SELECT {SCAN_COLUMNS} FROM entities WHERE added_id < ? ORDER BY added_id DESC LIMIT ?");
    let rows = sqlx::query(&sql)
        .bind(below.unwrap_or(u64::MAX))
        .bind(limit as u64)
        .fetch_all(pool)
        .await
        .on(shard)?;
    rows.iter().map(|r| scanned(shard, r)).collect()
}

/// Entities among `ids` (all on this shard), tombstones included.
pub async fn read_entities_any(
    shard: usize,
    pool: &MySqlPool,
    ids: &[EntityId],
) -> Result<Vec<ScannedEntity>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let marks = vec!["?"; ids.len()].join(",");
    let sql = format!("SELECT {SCAN_COLUMNS} FROM entities WHERE id IN ({marks})");
    let mut q = sqlx::query(&sql);
    for id in ids {
        q = q.bind(&id.0[..]);
    }
    let rows = q.fetch_all(pool).await.on(shard)?;
    rows.iter().map(|r| scanned(shard, r)).collect()
}

/// The highest `added_id` on the shard and how many rows are at or below it:
/// a backfill's fixed upper bound (later inserts reach the index through
/// the indexer) and its total.
pub async fn entity_bounds(shard: usize, pool: &MySqlPool) -> Result<(u64, u64)> {
    let row =
        sqlx::query("SELECT CAST(COALESCE(MAX(added_id), 0) AS UNSIGNED) AS hi, COUNT(*) AS n FROM entities")
            .fetch_one(pool)
            .await
            .on(shard)?;
    Ok((row.try_get::<u64, _>("hi").on(shard)?, row.try_get::<i64, _>("n").on(shard)? as u64))
}

// ---------------------------------------------------------------- outbox

#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub seq: u64,
    pub entity_id: EntityId,
    pub event: Vec<u8>,
}

/// The oldest unpublished events, in `seq` order (which, for one entity, is
/// version order: its writes serialize on the row lock).
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
pub async fn delete_outbox(shard: usize, conn: &mut MySqlConnection, seqs: &[u64]) -> Result<()> {
    for chunk in seqs.chunks(1000) {
        let marks = vec!["?"; chunk.len()].join(",");
        let sql = format!("DELETE FROM outbox WHERE seq IN ({marks})");
        let mut q = sqlx::query(&sql);
        for s in chunk {
            q = q.bind(*s);
        }
        q.execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// Rows waiting, and the commit time (µs) of the oldest, if any.
pub async fn outbox_backlog(shard: usize, pool: &MySqlPool) -> Result<(u64, Option<i64>)> {
    let row = sqlx::query(
        "SELECT COUNT(*) AS n, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(committed)) AS oldest FROM outbox",
    )
    .fetch_one(pool)
    .await
    .on(shard)?;
    Ok((row.try_get::<i64, _>("n").on(shard)? as u64, row.try_get("oldest").on(shard)?))
}

/// The server's clock and the commit time of the oldest unpublished event,
/// read together: every event committed before the oldest one still in the
/// outbox (and before now) has been published. Microseconds since the epoch.
pub async fn outbox_probe(shard: usize, pool: &MySqlPool) -> Result<(i64, Option<i64>)> {
    let row = sqlx::query(
        "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', NOW(6)) AS now_us, \
         TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(committed)) AS oldest FROM outbox",
    )
    .fetch_one(pool)
    .await
    .on(shard)?;
    Ok((row.try_get("now_us").on(shard)?, row.try_get("oldest").on(shard)?))
}

/// Named lock for "the relay of this database": server-wide names, so the
/// database name is part of it (two shards may share one server).
const RELAY_LOCK: &str = "CONCAT('bagstore.relay.', DATABASE())";

/// Tries to become the shard's relay leader; the lock lives as long as `conn`.
pub async fn try_relay_lock(shard: usize, conn: &mut MySqlConnection) -> Result<bool> {
    let row =
        sqlx::query(&format!("SELECT GET_LOCK({RELAY_LOCK}, 0) AS got")).fetch_one(conn).await.on(shard)?;
    Ok(row.try_get::<Option<i64>, _>("got").on(shard)? == Some(1))
}

/// Whether `conn` still holds the relay lock (false if it was killed and
/// someone else took over).
pub async fn holds_relay_lock(shard: usize, conn: &mut MySqlConnection) -> Result<bool> {
    let row = sqlx::query(&format!("SELECT IS_USED_LOCK({RELAY_LOCK}) = CONNECTION_ID() AS mine"))
        .fetch_one(conn)
        .await
        .on(shard)?;
    Ok(row.try_get::<Option<i64>, _>("mine").on(shard)? == Some(1))
}

// ---------------------------------------------------------------- index rows

fn bind_key<'q>(
    mut q: Query<'q, MySql, MySqlArguments>,
    key: &'q IndexKey,
) -> Query<'q, MySql, MySqlArguments> {
    for v in key {
        q = match v {
            KeyValue::Uuid(b) => q.bind(&b[..]),
            KeyValue::Str(s) => q.bind(s.as_bytes()),
            KeyValue::Int(i) => q.bind(*i),
            KeyValue::Float(f) => q.bind(*f),
            KeyValue::Bool(b) => q.bind(*b),
        };
    }
    q
}

fn key_equals(spec: &IndexSpec) -> String {
    spec.properties.iter().map(|p| format!("`{}` = ?", p.name)).collect::<Vec<_>>().join(" AND ")
}

/// One index row to write: its key, its entity, the version writing it, and
/// the entity's `added_id` (see [`crate::ddl::index_table`]) where known.
pub type UpsertRow = (IndexKey, EntityId, u64, Option<u64>);

/// Writes rows, or raises their versions; never lowers one, so a replayed
/// old event cannot make a row look older than what was already applied.
/// A known entity location is written; an unknown one keeps what the row
/// has (an id's `added_id` never changes, so any known one is the same).
/// Up to 500 rows per statement.
pub async fn upsert_index_rows(
    shard: usize,
    conn: &mut MySqlConnection,
    spec: &IndexSpec,
    rows: &[UpsertRow],
) -> Result<()> {
    let cols: Vec<String> = spec.properties.iter().map(|p| format!("`{}`", p.name)).collect();
    let tuple = format!("({}, ?, ?, ?)", vec!["?"; cols.len()].join(", "));
    for chunk in rows.chunks(500) {
        let sql = format!(
            "INSERT INTO `{}` ({}, entity_id, version, entity_added_id) VALUES {} \
             ON DUPLICATE KEY UPDATE entity_added_id = COALESCE(VALUES(entity_added_id), entity_added_id), \
             version = GREATEST(version, VALUES(version))",
            spec.table,
            cols.join(", "),
            vec![tuple.as_str(); chunk.len()].join(", ")
        );
        let mut q = sqlx::query(&sql);
        for (key, entity, version, at) in chunk {
            q = bind_key(q, key).bind(&entity.0[..]).bind(*version).bind(*at);
        }
        q.execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// Sets where each row's entity is (key, entity, its `added_id`), on rows
/// that exist; never creates one. Returns how many rows changed.
pub async fn set_index_row_locations(
    shard: usize,
    conn: &mut MySqlConnection,
    spec: &IndexSpec,
    rows: &[(IndexKey, EntityId, u64)],
) -> Result<u64> {
    let sql = format!(
        "UPDATE `{}` SET entity_added_id = ? WHERE {} AND entity_id = ?",
        spec.table,
        key_equals(spec)
    );
    let mut changed = 0;
    for (key, entity, at) in rows {
        let q = bind_key(sqlx::query(&sql).bind(*at), key).bind(&entity.0[..]);
        changed += q.execute(&mut *conn).await.on(shard)?.rows_affected();
    }
    Ok(changed)
}

/// Deletes rows written by an older version than each row's `version`: a
/// row that a newer event already re-wrote stays. Up to 200 rows per
/// statement (primary-key lookups joined by OR).
pub async fn delete_index_rows_before(
    shard: usize,
    conn: &mut MySqlConnection,
    spec: &IndexSpec,
    rows: &[(IndexKey, EntityId, u64)],
) -> Result<()> {
    let one = format!("({} AND entity_id = ? AND version < ?)", key_equals(spec));
    for chunk in rows.chunks(200) {
        let sql =
            format!("DELETE FROM `{}` WHERE {}", spec.table, vec![one.as_str(); chunk.len()].join(" OR "));
        let mut q = sqlx::query(&sql);
        for (key, entity, version) in chunk {
            q = bind_key(q, key).bind(&entity.0[..]).bind(*version);
        }
        q.execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// Deletes a row unless something newer than `version` rewrote it: the
/// cleaner's guard against undoing a concurrent indexer write.
pub async fn delete_index_row_upto(
    shard: usize,
    conn: &mut MySqlConnection,
    spec: &IndexSpec,
    key: &IndexKey,
    entity: &EntityId,
    version: u64,
) -> Result<u64> {
    let sql =
        format!("DELETE FROM `{}` WHERE {} AND entity_id = ? AND version <= ?", spec.table, key_equals(spec));
    let done =
        bind_key(sqlx::query(&sql), key).bind(&entity.0[..]).bind(version).execute(conn).await.on(shard)?;
    Ok(done.rows_affected())
}

/// Decodes one index row's key columns.
fn row_key(shard: usize, spec: &IndexSpec, r: &sqlx::mysql::MySqlRow) -> Result<Option<IndexKey>> {
    use crate::index::PropType;
    let mut key = Vec::with_capacity(spec.properties.len());
    for p in &spec.properties {
        let name = p.name.as_str();
        let v = match p.ty {
            PropType::Uuid => {
                let b: Vec<u8> = r.try_get(name).on(shard)?;
                match <[u8; 16]>::try_from(b.as_slice()) {
                    Ok(a) => KeyValue::Uuid(a),
                    Err(_) => return Ok(None),
                }
            }
            PropType::String => {
                let b: Vec<u8> = r.try_get(name).on(shard)?;
                match String::from_utf8(b) {
                    Ok(s) => KeyValue::Str(s),
                    Err(_) => return Ok(None),
                }
            }
            PropType::Int => KeyValue::Int(r.try_get(name).on(shard)?),
            PropType::Float => KeyValue::Float(r.try_get(name).on(shard)?),
            PropType::Bool => KeyValue::Bool(r.try_get(name).on(shard)?),
        };
        key.push(v);
    }
    Ok(Some(key))
}

/// One index row as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexRow {
    pub key: IndexKey,
    pub entity: EntityId,
    pub version: u64,
    /// The entity's `added_id` as the row has it (NULL: unknown).
    pub entity_added_id: Option<u64>,
}

/// Every row of the listed entities in this shard's copy of the index.
/// Rows whose bytes cannot be decoded (hand-made garbage) are skipped.
pub async fn index_rows_of(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    ids: &[EntityId],
) -> Result<Vec<IndexRow>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let cols: Vec<String> = spec.properties.iter().map(|p| format!("`{}`", p.name)).collect();
    let marks = vec!["?"; ids.len()].join(",");
    let sql = format!(
        "SELECT {}, entity_id, version, entity_added_id FROM `{}` WHERE entity_id IN ({marks})",
        cols.join(", "),
        spec.table
    );
    let mut q = sqlx::query(&sql);
    for id in ids {
        q = q.bind(&id.0[..]);
    }
    let rows = q.fetch_all(pool).await.on(shard)?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let Some(key) = row_key(shard, spec, r)? else { continue };
        out.push(IndexRow {
            key,
            entity: id_column(shard, r, "entity_id")?,
            version: r.try_get("version").on(shard)?,
            entity_added_id: r.try_get("entity_added_id").on(shard)?,
        });
    }
    Ok(out)
}

/// Distinct entity ids in an index table after `after`, in id order: the
/// index-side sweep walks these to find rows of entities that are gone.
pub async fn index_entity_ids(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    after: Option<&EntityId>,
    limit: usize,
) -> Result<Vec<EntityId>> {
    let sql = format!(
        "SELECT DISTINCT entity_id FROM `{}` WHERE entity_id > ? ORDER BY entity_id LIMIT ?",
        spec.table
    );
    let start = after.map(|a| a.0.to_vec()).unwrap_or_default();
    let rows = sqlx::query(&sql).bind(start).bind(limit as u64).fetch_all(pool).await.on(shard)?;
    rows.iter().map(|r| id_column(shard, r, "entity_id")).collect()
}

/// How an index scan is bounded and ordered: equality on a prefix of the
/// index's properties, an optional range on the next one, and a keyset
/// position (the remaining columns and the entity id) to continue after.
#[derive(Debug, Clone)]
pub struct IndexScan<'a> {
    pub prefix: &'a [KeyValue],
    pub range: Option<&'a crate::filter::KeyRange>,
    /// Continue strictly after (before, when descending) this position:
    /// the values of the properties after the prefix, then the entity id.
    pub after: Option<(&'a [KeyValue], EntityId)>,
    pub descending: bool,
    pub limit: usize,
    /// Also read, in the same statement, each row's entity where it is
    /// stored on this shard (a join on the primary key): the reader then
    /// fetches only the entities that live on other shards.
    pub with_entities: bool,
}

/// One row of an index scan: its full key, its entity id, where the row
/// says its entity is, and (with [`IndexScan::with_entities`]) what this
/// shard holds there.
#[derive(Debug, Clone)]
pub struct ScannedRow {
    pub key: IndexKey,
    pub entity: EntityId,
    /// The entity's `added_id` on its own shard, as the index row has it.
    pub entity_added_id: Option<u64>,
    pub local: Local,
}

/// The joined entity of a scanned index row.
#[derive(Debug, Clone)]
pub enum Local {
    /// The row's entity, stored on this shard at the row's location.
    Live(StoredEntity),
    /// The row's entity is a tombstone there: deleted.
    Deleted,
    /// Nothing of the entity's at that location here: it lives on another
    /// shard, the row's location is unknown or wrong, or the scan did not
    /// join. The caller fetches it by id.
    Unknown,
}

/// Rows of one shard's index table in index order: full keys and entity ids.
pub async fn scan_index(
    shard: usize,
    pool: impl sqlx::MySqlExecutor<'_>,
    spec: &IndexSpec,
    scan: &IndexScan<'_>,
) -> Result<Vec<ScannedRow>> {
    // Columns are qualified by the index table's alias, as the entities
    // table joined in may have columns of the same names.
    let cols: Vec<String> = spec.properties.iter().map(|p| format!("i.`{}`", p.name)).collect();
    let k = scan.prefix.len();
    let mut wheres: Vec<String> = cols[..k].iter().map(|c| format!("{c} = ?")).collect();
    let mut binds: Vec<KeyValue> = scan.prefix.to_vec();
    if let Some(r) = scan.range {
        if let Some((v, inc)) = &r.lower {
            wheres.push(format!("{} {} ?", cols[k], if *inc { ">=" } else { ">" }));
            binds.push(v.clone());
        }
        if let Some((v, inc)) = &r.upper {
            wheres.push(format!("{} {} ?", cols[k], if *inc { "<=" } else { "<" }));
            binds.push(v.clone());
        }
    }
    let mut id_bind: Vec<Vec<u8>> = Vec::new();
    if let Some((rest, id)) = &scan.after {
        // (r1, …, rm, entity_id) > (a1, …, am, id), spelled out so every
        // MySQL dialect can use the primary key for it.
        let op = if scan.descending { "<" } else { ">" };
        let rest_cols = &cols[k..];
        let mut ors = Vec::new();
        for i in 0..=rest.len() {
            let mut parts: Vec<String> = rest_cols[..i].iter().map(|c| format!("{c} = ?")).collect();
            binds.extend(rest[..i].iter().cloned());
            if i < rest.len() {
                parts.push(format!("{} {op} ?", rest_cols[i]));
                binds.push(rest[i].clone());
            } else {
                parts.push(format!("i.entity_id {op} ?"));
            }
            ors.push(format!("({})", parts.join(" AND ")));
        }
        wheres.push(format!("({})", ors.join(" OR ")));
        id_bind.push(id.0.to_vec());
    }
    let dir = if scan.descending { " DESC" } else { "" };
    let order: Vec<String> =
        cols[k..].iter().map(|c| format!("{c}{dir}")).chain([format!("i.entity_id{dir}")]).collect();
    // Entity columns get aliases no property name can take (names have no
    // dots). The join is on the entities table's clustered key, checked
    // against the id, so a wrong or unknown location joins nothing.
    let (entity_cols, join) = if scan.with_entities {
        (
            ", e.added_id AS `e.added_id`, e.version AS `e.version`, \
             TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', e.updated) AS `e.updated_us`, e.body AS `e.body`",
            " LEFT JOIN entities AS e FORCE INDEX (PRIMARY) \
             ON e.added_id = i.entity_added_id AND e.id = i.entity_id",
        )
    } else {
        ("", "")
    };
    let sql = format!(
        "SELECT {}, i.entity_id, i.entity_added_id{entity_cols} FROM `{}` AS i{join} {} ORDER BY {} LIMIT ?",
        cols.join(", "),
        spec.table,
        if wheres.is_empty() { String::new() } else { format!("WHERE {}", wheres.join(" AND ")) },
        order.join(", ")
    );
    // Placeholders in SQL order: prefix, range bounds, the keyset terms
    // (whose very last placeholder is the entity id), then the limit.
    let mut q = sqlx::query(&sql);
    for v in &binds {
        q = bind_one(q, v);
    }
    if let Some(id) = id_bind.pop() {
        q = q.bind(id);
    }
    let rows = q.bind(scan.limit as u64).fetch_all(pool).await.on(shard)?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let Some(key) = row_key(shard, spec, r)? else { continue };
        let id = id_column(shard, r, "entity_id")?;
        let joined: Option<u64> = match scan.with_entities {
            true => r.try_get("e.added_id").on(shard)?,
            false => None,
        };
        let local = match joined {
            None => Local::Unknown,
            Some(added_id) => match r.try_get::<Option<Vec<u8>>, _>("e.body").on(shard)? {
                None => Local::Deleted,
                Some(body) => Local::Live(StoredEntity {
                    id,
                    added_id,
                    version: r.try_get("e.version").on(shard)?,
                    updated_us: r.try_get("e.updated_us").on(shard)?,
                    body,
                }),
            },
        };
        out.push(ScannedRow {
            key,
            entity: id,
            entity_added_id: r.try_get("entity_added_id").on(shard)?,
            local,
        });
    }
    Ok(out)
}

fn bind_one<'q>(q: Query<'q, MySql, MySqlArguments>, v: &KeyValue) -> Query<'q, MySql, MySqlArguments> {
    match v {
        KeyValue::Uuid(b) => q.bind(b.to_vec()),
        KeyValue::Str(s) => q.bind(s.as_bytes().to_vec()),
        KeyValue::Int(i) => q.bind(*i),
        KeyValue::Float(f) => q.bind(*f),
        KeyValue::Bool(b) => q.bind(*b),
    }
}

/// The version of one index row, if it exists.
pub async fn index_row_version(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    key: &IndexKey,
    entity: &EntityId,
) -> Result<Option<u64>> {
    let sql = format!("SELECT version FROM `{}` WHERE {} AND entity_id = ?", spec.table, key_equals(spec));
    let row = bind_key(sqlx::query(&sql), key).bind(&entity.0[..]).fetch_optional(pool).await.on(shard)?;
    row.map(|r| r.try_get("version").on(shard)).transpose()
}

/// Records that an index applied events committed up to `commit_us`.
pub async fn record_index_progress(pool: &MySqlPool, table: &str, commit_us: i64) -> Result<()> {
    sqlx::query(
        "INSERT INTO bagstore_index_progress (name, last_applied_commit_us) VALUES (?, ?)          ON DUPLICATE KEY UPDATE last_applied_commit_us = GREATEST(last_applied_commit_us,          VALUES(last_applied_commit_us)), changed = NOW(6)",
    )
    .bind(table)
    .bind(commit_us)
    .execute(pool)
    .await
    .on(0)?;
    Ok(())
}

pub async fn index_progress(pool: &MySqlPool, table: &str) -> Result<Option<i64>> {
    let row = sqlx::query("SELECT last_applied_commit_us FROM bagstore_index_progress WHERE name = ?")
        .bind(table)
        .fetch_optional(pool)
        .await
        .on(0)?;
    row.map(|r| r.try_get("last_applied_commit_us").on(0)).transpose()
}

/// Commit time of the newest live or deleted entity on the shard.
pub async fn newest_commit_us(shard: usize, pool: &MySqlPool) -> Result<Option<i64>> {
    let row = sqlx::query(
        "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MAX(updated)) AS newest FROM entities",
    )
    .fetch_one(pool)
    .await
    .on(shard)?;
    row.try_get("newest").on(shard)
}

/// Entity ids under one exact key, in id order, after `after` (keyset paging).
pub async fn lookup_index(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    key: &IndexKey,
    after: Option<&EntityId>,
    limit: usize,
) -> Result<Vec<EntityId>> {
    let sql = format!(
        "SELECT entity_id FROM `{}` WHERE {} AND entity_id > ? ORDER BY entity_id LIMIT ?",
        spec.table,
        key_equals(spec)
    );
    let start = after.map(|a| a.0.to_vec()).unwrap_or_default();
    let rows =
        bind_key(sqlx::query(&sql), key).bind(start).bind(limit as u64).fetch_all(pool).await.on(shard)?;
    rows.iter().map(|r| id_column(shard, r, "entity_id")).collect()
}

// ---------------------------------------------------------------- index metadata

/// Lifecycle of an index (DESIGN §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum IndexState {
    Creating,
    Backfilling,
    Active,
    Dropping,
}

impl IndexState {
    pub fn as_str(&self) -> &'static str {
        match self {
            IndexState::Creating => "CREATING",
            IndexState::Backfilling => "BACKFILLING",
            IndexState::Active => "ACTIVE",
            IndexState::Dropping => "DROPPING",
        }
    }

    pub fn parse(s: &str) -> Option<IndexState> {
        [IndexState::Creating, IndexState::Backfilling, IndexState::Active, IndexState::Dropping]
            .into_iter()
            .find(|st| st.as_str() == s)
    }
}

#[derive(Debug, Clone)]
pub struct IndexMeta {
    pub spec: IndexSpec,
    pub state: IndexState,
    pub rows_done: u64,
    pub rows_total: u64,
}

pub async fn list_index_meta(pool: &MySqlPool) -> Result<Vec<IndexMeta>> {
    let rows =
        sqlx::query("SELECT name, spec, state, rows_done, rows_total FROM bagstore_indexes ORDER BY name")
            .fetch_all(pool)
            .await
            .on(0)?;
    rows.iter()
        .map(|r| {
            let table: String = r.try_get("name").on(0)?;
            let spec_text: String = r.try_get("spec").on(0)?;
            let spec = serde_json::from_str(&spec_text)
                .map_err(|source| StoreError::BadMeta { table: table.clone(), source })?;
            let state: String = r.try_get("state").on(0)?;
            Ok(IndexMeta {
                spec,
                state: IndexState::parse(&state).unwrap_or(IndexState::Creating),
                rows_done: r.try_get("rows_done").on(0)?,
                rows_total: r.try_get("rows_total").on(0)?,
            })
        })
        .collect()
}

/// Registers an index if it is new; refuses a changed definition. Returns
/// the state it has afterwards.
pub async fn register_index(pool: &MySqlPool, spec: &IndexSpec, initial: IndexState) -> Result<IndexState> {
    let spec_text = serde_json::to_string(spec).expect("index specs serialize");
    sqlx::query("INSERT IGNORE INTO bagstore_indexes (name, spec, state) VALUES (?, ?, ?)")
        .bind(&spec.table)
        .bind(&spec_text)
        .bind(initial.as_str())
        .execute(pool)
        .await
        .on(0)?;
    let existing = list_index_meta(pool).await?;
    let meta = existing.into_iter().find(|m| m.spec.table == spec.table).expect("row just ensured");
    if meta.state == IndexState::Dropping {
        // A dropped index added again starts over with its new definition.
        reregister_dropped_index(pool, spec, initial).await?;
        return Ok(initial);
    }
    if &meta.spec != spec {
        return Err(StoreError::SpecChanged { table: spec.table.clone() });
    }
    Ok(meta.state)
}

pub async fn set_index_state(pool: &MySqlPool, table: &str, state: IndexState) -> Result<()> {
    sqlx::query("UPDATE bagstore_indexes SET state = ?, changed = NOW(6) WHERE name = ?")
        .bind(state.as_str())
        .bind(table)
        .execute(pool)
        .await
        .on(0)?;
    Ok(())
}

/// Backfill progress: an opaque cursor (JSON) and row counts, written in
/// one statement so the cursor and `rows_done` always agree.
pub async fn set_backfill_progress(
    pool: &MySqlPool,
    table: &str,
    cursor: Option<&str>,
    rows_done: u64,
    rows_total: u64,
) -> Result<()> {
    sqlx::query(
        "UPDATE bagstore_indexes SET backfill_cursor = ?, rows_done = ?, rows_total = ?, changed = NOW(6) \
         WHERE name = ?",
    )
    .bind(cursor)
    .bind(rows_done)
    .bind(rows_total)
    .bind(table)
    .execute(pool)
    .await
    .on(0)?;
    Ok(())
}

pub async fn backfill_cursor(pool: &MySqlPool, table: &str) -> Result<Option<String>> {
    let row = sqlx::query("SELECT backfill_cursor FROM bagstore_indexes WHERE name = ?")
        .bind(table)
        .fetch_optional(pool)
        .await
        .on(0)?;
    match row {
        Some(r) => Ok(r.try_get("backfill_cursor").on(0)?),
        None => Ok(None),
    }
}

/// Replaces a dropped index's metadata with a new definition.
pub async fn reregister_dropped_index(pool: &MySqlPool, spec: &IndexSpec, initial: IndexState) -> Result<()> {
    let spec_text = serde_json::to_string(spec).expect("index specs serialize");
    sqlx::query(
        "UPDATE bagstore_indexes SET spec = ?, state = ?, backfill_cursor = NULL, rows_done = 0, rows_total = 0, \
         changed = NOW(6) WHERE name = ? AND state = 'DROPPING'",
    )
    .bind(spec_text)
    .bind(initial.as_str())
    .bind(&spec.table)
    .execute(pool)
    .await
    .on(0)?;
    Ok(())
}

/// Named lock making one process the backfiller of an index; held as long as `conn`.
pub async fn try_backfill_lock(conn: &mut MySqlConnection, table: &str) -> Result<bool> {
    let row = sqlx::query("SELECT GET_LOCK(CONCAT('bagstore.backfill.', DATABASE(), '.', ?), 0) AS got")
        .bind(table)
        .fetch_one(conn)
        .await
        .on(0)?;
    Ok(row.try_get::<Option<i64>, _>("got").on(0)? == Some(1))
}

pub async fn delete_index_meta(pool: &MySqlPool, table: &str) -> Result<()> {
    sqlx::query("DELETE FROM bagstore_indexes WHERE name = ?").bind(table).execute(pool).await.on(0)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_names_split_off_dsns() {
        let (db, server) =
            split_database(&Dsn("mysql://root:pw@127.0.0.1:3307/bagstore?ssl-mode=disabled".into())).unwrap();
        assert_eq!(db, "bagstore");
        assert_eq!(server.expose(), "mysql://root:pw@127.0.0.1:3307?ssl-mode=disabled");
        assert!(split_database(&Dsn("mysql://root@host:1".into())).is_none());
    }
}
