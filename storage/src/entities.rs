//! The `entities` table: the writer's locking read and its writes, reads by
//! id and by location, and the cleaner's sweeps.
//!
//! Every read returns [`EntityRecord`], the one record type of this table.
//! A delete keeps its row as a tombstone (`body` NULL), so an id's version
//! keeps rising across delete and re-create, and its `added_id` (the row's
//! clustered key, its *location*) never changes.

use schemas::EntityId;
use sqlx::mysql::{MySqlArguments, MySqlPool, MySqlRow};
use sqlx::query::Query;
use sqlx::{MySql, MySqlConnection, Row};
use std::collections::HashMap;

use crate::error::{id_column, OnShard, Result};
use crate::rows::{marks, Rows, KEYS_PER_STATEMENT};

/// One row of `entities` as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct EntityRecord {
    pub id: EntityId,
    /// The id's logical shard.
    pub logical: u16,
    /// The row's clustered key on its shard: fixed for the life of the id.
    pub added_id: u64,
    pub version: u64,
    /// Commit time of the row's last write, µs since the Unix epoch.
    pub updated_us: i64,
    /// The encoded body (`schemas::codec`); `None` for a tombstone.
    pub body: Option<Vec<u8>>,
    /// When the entity expires, µs since the Unix epoch (`None`: never, or
    /// expiry is off).
    pub expires_us: Option<i64>,
}

/// One entity row to write (insert or overwrite).
#[derive(Debug, Clone, PartialEq)]
pub struct EntityWrite {
    pub id: EntityId,
    /// The id's logical shard.
    pub logical: u16,
    pub version: u64,
    /// Commit time, µs since the Unix epoch.
    pub updated_us: i64,
    /// `None` writes a tombstone.
    pub body: Option<Vec<u8>>,
    /// See [`EntityRecord::expires_us`].
    pub expires_us: Option<i64>,
}

/// The highest `added_id` on a shard and how many rows are at or below it:
/// a backfill's fixed upper bound (later inserts reach the index through
/// the indexer) and its total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntityBounds {
    pub max_added_id: u64,
    pub count: u64,
}

/// The index hint of a locking read of `entities` by a list of ids.
///
/// While a table is small (a new shard, a new store) the optimizer scans it
/// for an `IN` list longer than the rows it counts, and a locking read that
/// scans locks every row it passes, waiting on each row another
/// transaction holds. The clustered key grows at its end, so such a scan
/// chases the rows that concurrent writers insert, and under a load it
/// waited out the commit timeout (a batch answered 503 `outcome-unknown`).
/// Named, the key is read as a range: only the asked ids are locked. It
/// holds for a key that does not cover the selected columns: with one that
/// does, the optimizer reads the whole key instead (see `unique::many`).
pub(crate) const BY_ID: &str = "FORCE INDEX (entities_id)";

/// The columns every read of [`EntityRecord`]s selects, in its order.
pub(crate) const COLUMNS: &str = "id, logical, added_id, version, \
     TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated) AS updated_us, body, expires_us";

pub(crate) fn record(shard: usize, r: &MySqlRow) -> Result<EntityRecord> {
    Ok(EntityRecord {
        id: id_column(shard, r, "id")?,
        logical: r.try_get("logical").on(shard)?,
        added_id: r.try_get("added_id").on(shard)?,
        version: r.try_get("version").on(shard)?,
        updated_us: r.try_get("updated_us").on(shard)?,
        body: r.try_get("body").on(shard)?,
        expires_us: r.try_get("expires_us").on(shard)?,
    })
}

/// `SELECT … FOR UPDATE` of many ids in one statement: the rows present are
/// locked until the transaction ends, so writes to one id serialize (an
/// absent id locks nothing: see [`insert_entities`]). Ids are sent sorted,
/// so two batches lock in the same order.
///
/// The statement names the `id` key (see [`BY_ID`]).
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn lock_entities(
    shard: usize,
    conn: &mut MySqlConnection,
    ids: &[EntityId],
) -> Result<HashMap<EntityId, EntityRecord>> {
    let mut out = HashMap::with_capacity(ids.len());
    let mut sorted: Vec<&EntityId> = ids.iter().collect();
    sorted.sort();
    sorted.dedup();
    let lock =
        Rows::new(format!("SELECT {COLUMNS} FROM entities {BY_ID} WHERE id IN ("), "?", ") FOR UPDATE")
            .at_most(KEYS_PER_STATEMENT);
    for st in lock.statements(&sorted) {
        let q = st.bind(sqlx::query(&st.sql), |q, id| q.bind(&id.0[..]));
        for r in q.fetch_all(&mut *conn).await.on(shard)? {
            let rec = record(shard, &r)?;
            out.insert(rec.id, rec);
        }
    }
    Ok(out)
}

/// Overwrites entity rows in multi-row statements; each id at most once.
/// The rows were present when [`lock_entities`] ran, so they are this
/// transaction's to overwrite.
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn update_entities(shard: usize, conn: &mut MySqlConnection, rows: &[EntityWrite]) -> Result<()> {
    let upsert = entity_rows(true);
    for st in upsert.statements(rows) {
        st.bind(sqlx::query(&st.sql), bind_entity).execute(&mut *conn).await.on(shard)?;
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
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn insert_entities(
    shard: usize,
    conn: &mut MySqlConnection,
    rows: &[EntityWrite],
    consecutive: bool,
) -> Result<Vec<Option<u64>>> {
    let insert = entity_rows(false);
    // Reads back the rows of one insert statement: as many as it had.
    let read_back = Rows::new("SELECT id, added_id FROM entities WHERE id IN (", "?", ")");
    let mut added = Vec::with_capacity(rows.len());
    for st in insert.statements(rows) {
        let done = st.bind(sqlx::query(&st.sql), bind_entity).execute(&mut *conn).await.on(shard)?;
        let first = done.last_insert_id();
        if st.rows.len() == 1 || consecutive {
            added.extend((0..st.rows.len() as u64).map(|i| Some(first + i)));
            continue;
        }
        let back = read_back.statement(st.rows);
        let q = back.bind(sqlx::query(&back.sql), |q, row| q.bind(&row.id.0[..]));
        let mut at = HashMap::with_capacity(st.rows.len());
        for r in q.fetch_all(&mut *conn).await.on(shard)? {
            at.insert(id_column(shard, &r, "id")?, r.try_get::<u64, _>("added_id").on(shard)?);
        }
        added.extend(st.rows.iter().map(|row| at.get(&row.id).copied()));
    }
    Ok(added)
}

/// The row template of an entity write: `(id, logical, version, updated,
/// body, expires_us)`, bound by [`bind_entity`] (or [`bind_record`]).
const ENTITY_ROW: &str = "(?, ?, ?, TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00'), ?, ?)";

/// `INSERT INTO entities` of [`EntityWrite`]s; `overwrite` makes it an
/// upsert.
fn entity_rows(overwrite: bool) -> Rows {
    let tail = match overwrite {
        true => {
            " ON DUPLICATE KEY UPDATE version = VALUES(version), updated = VALUES(updated), body = VALUES(body), \
             expires_us = VALUES(expires_us)"
        }
        false => "",
    };
    Rows::new(
        "INSERT INTO entities (id, logical, version, updated, body, expires_us) VALUES ",
        ENTITY_ROW,
        tail,
    )
}

/// Binds one [`EntityWrite`] to an [`entity_rows`] statement.
fn bind_entity<'q>(
    q: Query<'q, MySql, MySqlArguments>,
    row: &'q EntityWrite,
) -> Query<'q, MySql, MySqlArguments> {
    q.bind(&row.id.0[..])
        .bind(row.logical)
        .bind(row.version)
        .bind(row.updated_us)
        .bind(row.body.as_deref())
        .bind(row.expires_us)
}

/// Binds one [`EntityRecord`] (a copied row) to a statement of
/// [`ENTITY_ROW`]s.
fn bind_record<'q>(
    q: Query<'q, MySql, MySqlArguments>,
    r: &'q EntityRecord,
) -> Query<'q, MySql, MySqlArguments> {
    q.bind(&r.id.0[..])
        .bind(r.logical)
        .bind(r.version)
        .bind(r.updated_us)
        .bind(r.body.as_deref())
        .bind(r.expires_us)
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

/// Which rows a point read asks for.
enum Lookup<'a> {
    /// By entity id (the unique `id` key, then the clustered key).
    Ids(&'a [EntityId]),
    /// By location (the clustered key alone).
    AddedIds(&'a [u64]),
}

/// Rows a point read found, and the shard's epoch read with them (`None`
/// when no row came back: then nothing vouches for the map, and a reader
/// that must know asks [`crate::topology::shard_epoch`]).
#[derive(Debug, Clone, Default)]
pub struct Fetched {
    pub records: Vec<EntityRecord>,
    pub shard_epoch: Option<u64>,
}

/// The rows `lookup` names (all on this shard), tombstones too unless
/// `live_only`, in no particular order.
async fn select(
    shard: usize,
    conn: impl sqlx::MySqlExecutor<'_>,
    lookup: Lookup<'_>,
    live_only: bool,
) -> Result<Fetched> {
    let (column, n) = match &lookup {
        Lookup::Ids(ids) => ("id", ids.len()),
        Lookup::AddedIds(at) => ("added_id", at.len()),
    };
    if n == 0 {
        return Ok(Fetched::default());
    }
    let live = if live_only { " AND body IS NOT NULL" } else { "" };
    let sql = format!(
        "SELECT {COLUMNS}, {} AS shard_epoch FROM entities WHERE {column} IN ({}){live}",
        crate::topology::SHARD_EPOCH,
        marks(n)
    );
    let mut q = sqlx::query(&sql);
    match lookup {
        Lookup::Ids(ids) => {
            for id in ids {
                q = q.bind(&id.0[..]);
            }
        }
        Lookup::AddedIds(at) => {
            for a in at {
                q = q.bind(*a);
            }
        }
    }
    let rows = q.fetch_all(conn).await.on(shard)?;
    fetched(shard, &rows)
}

/// Live entities among `ids` (all on this shard), in no particular order.
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn get_entities(
    shard: usize,
    conn: impl sqlx::MySqlExecutor<'_>,
    ids: &[EntityId],
) -> Result<Fetched> {
    select(shard, conn, Lookup::Ids(ids), true).await
}

/// The rows at `added_ids` (clustered-key lookups: one B-tree descent each,
/// where a lookup by id descends the unique `id` key first), tombstones
/// included; the caller checks each row's id. Rows absent are left out.
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn get_entities_at(
    shard: usize,
    conn: impl sqlx::MySqlExecutor<'_>,
    added_ids: &[u64],
) -> Result<Fetched> {
    select(shard, conn, Lookup::AddedIds(added_ids), false).await
}

/// Entities among `ids` (all on this shard), tombstones included.
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn read_entities_any(
    shard: usize,
    conn: impl sqlx::MySqlExecutor<'_>,
    ids: &[EntityId],
) -> Result<Fetched> {
    select(shard, conn, Lookup::Ids(ids), false).await
}

/// A position in the `(updated, added_id)` order of a shard's entities:
/// where a sweep by [`scan_entities_by_updated`] stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpdatedCursor {
    pub updated_us: i64,
    pub added_id: u64,
}

impl UpdatedCursor {
    /// The cursor just past `e` in a descending sweep.
    pub fn after(e: &EntityRecord) -> UpdatedCursor {
        UpdatedCursor { updated_us: e.updated_us, added_id: e.added_id }
    }
}

/// Entities (tombstones included) in `(updated, added_id)` descending order,
/// strictly before `before`, updated at or after `since_us`; with the
/// shard's epoch read in the same statement (a sweep judges rows only if
/// the shard still has the epoch its map gives it).
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn scan_entities_by_updated(
    shard: usize,
    pool: &MySqlPool,
    since_us: i64,
    before: Option<UpdatedCursor>,
    limit: usize,
) -> Result<Fetched> {
    let (b_us, b_added) = before.map_or((i64::MAX / 2, u64::MAX), |c| (c.updated_us, c.added_id));
    let sql = format!(
        "SELECT {COLUMNS}, {} AS shard_epoch FROM entities \
         WHERE updated >= TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00') \
           AND (updated < TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00') \
                OR (updated = TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00') AND added_id < ?)) \
         ORDER BY updated DESC, added_id DESC LIMIT ?",
        crate::topology::SHARD_EPOCH
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
    fetched(shard, &rows)
}

/// Rows a scan returned with the epoch they carry (`None` for no row).
fn fetched(shard: usize, rows: &[MySqlRow]) -> Result<Fetched> {
    let shard_epoch = rows.first().map(|r| r.try_get("shard_epoch").on(shard)).transpose()?;
    Ok(Fetched { records: rows.iter().map(|r| record(shard, r)).collect::<Result<_>>()?, shard_epoch })
}

/// Entities (tombstones included) in `added_id` descending order (newest
/// insert first), strictly below `below`, with the shard's epoch (as
/// [`scan_entities_by_updated`]). Order is stable under updates, so a
/// backfill visits every entity that existed when it started exactly once.
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn scan_entities_by_added_id(
    shard: usize,
    pool: &MySqlPool,
    below: Option<u64>,
    limit: usize,
) -> Result<Fetched> {
    let sql = format!(
        "SELECT {COLUMNS}, {} AS shard_epoch FROM entities WHERE added_id < ? ORDER BY added_id DESC LIMIT ?",
        crate::topology::SHARD_EPOCH
    );
    let rows = sqlx::query(&sql)
        .bind(below.unwrap_or(u64::MAX))
        .bind(limit as u64)
        .fetch_all(pool)
        .await
        .on(shard)?;
    fetched(shard, &rows)
}

/// See [`EntityBounds`].
pub async fn entity_bounds(shard: usize, pool: &MySqlPool) -> Result<EntityBounds> {
    let row =
        sqlx::query("SELECT CAST(COALESCE(MAX(added_id), 0) AS UNSIGNED) AS hi, COUNT(*) AS n FROM entities")
            .fetch_one(pool)
            .await
            .on(shard)?;
    Ok(EntityBounds {
        max_added_id: row.try_get::<u64, _>("hi").on(shard)?,
        count: row.try_get::<i64, _>("n").on(shard)? as u64,
    })
}

/// Commit time (µs) of the newest live or deleted entity on the shard.
pub async fn newest_commit_us(shard: usize, pool: &MySqlPool) -> Result<Option<i64>> {
    let row = sqlx::query(
        "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MAX(updated)) AS newest FROM entities",
    )
    .fetch_one(pool)
    .await
    .on(shard)?;
    row.try_get("newest").on(shard)
}

/// Whether the shard holds any entity row (a new index on an empty store
/// needs no backfill).
pub async fn has_entities(shard: usize, pool: &MySqlPool) -> Result<bool> {
    let row = sqlx::query("SELECT EXISTS(SELECT 1 FROM entities) AS e").fetch_one(pool).await.on(shard)?;
    Ok(row.try_get::<i64, _>("e").on(shard)? != 0)
}

/// A position in a move's copy: the `(logical, added_id)` order of the
/// rows of the logical shards it moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LogicalCursor {
    pub logical: u16,
    pub added_id: u64,
}

/// Rows of `logicals` (tombstones included) after `after`, in
/// `(logical, added_id)` order, along the `entities_logical` key, each with
/// its digest ([`crate::checksums::entity_digest`]).
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn scan_logicals(
    shard: usize,
    pool: &MySqlPool,
    logicals: &[u16],
    after: Option<LogicalCursor>,
    limit: usize,
) -> Result<Vec<(EntityRecord, u64)>> {
    if logicals.is_empty() {
        return Ok(Vec::new());
    }
    let (l, a) = after.map_or((0, 0), |c| (c.logical, c.added_id));
    let sql = format!(
        "SELECT {COLUMNS}, {} AS digest FROM entities FORCE INDEX (entities_logical) WHERE logical IN ({}) \
         AND (logical > ? OR (logical = ? AND added_id > ?)) ORDER BY logical, added_id LIMIT ?",
        crate::checksums::entity_digest(),
        marks(logicals.len())
    );
    let mut q = sqlx::query(&sql);
    for k in logicals {
        q = q.bind(*k);
    }
    let first = after.is_none();
    let rows = q
        .bind(if first { -1i32 } else { i32::from(l) })
        .bind(if first { -1i32 } else { i32::from(l) })
        .bind(a)
        .bind(limit as u64)
        .fetch_all(pool)
        .await
        .on(shard)?;
    rows.iter().map(|r| Ok((record(shard, r)?, r.try_get("digest").on(shard)?))).collect()
}

/// Copies rows made on another shard (a move): a row is written unless this
/// shard has the id at a newer version (at the same version it is written
/// too: a copy that differs from its source at the same version, which
/// verification found, is repaired by copying it again). Its `added_id` is this
/// shard's own (locations in index rows then cost a fetch by id until the
/// cleaner rewrites them).
#[tracing::instrument(level = "debug", skip_all, fields(shard))]
pub async fn copy_entities(shard: usize, conn: &mut MySqlConnection, rows: &[EntityRecord]) -> Result<()> {
    // Columns are assigned left to right: `version` last, so the others
    // compare with the row's version before the copy.
    let copy = Rows::new(
        "INSERT INTO entities (id, logical, version, updated, body, expires_us) VALUES ",
        ENTITY_ROW,
        " ON DUPLICATE KEY UPDATE body = IF(VALUES(version) >= version, VALUES(body), body), \
         updated = IF(VALUES(version) >= version, VALUES(updated), updated), \
         expires_us = IF(VALUES(version) >= version, VALUES(expires_us), expires_us), \
         version = GREATEST(version, VALUES(version))",
    );
    for st in copy.statements(rows) {
        st.bind(sqlx::query(&st.sql), bind_record).execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// What a move compares of an entity row: id, version and a digest of
/// the body (computed by the server, so bodies do not cross the network).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Fingerprint {
    pub id: EntityId,
    pub version: u64,
    /// MD5 of the body in hex; `None` for a tombstone.
    pub body_md5: Option<String>,
}

/// Fingerprints of every row of `logicals`, or (with `ids`) of those ids
/// among them, ordered by id.
pub async fn fingerprints(
    shard: usize,
    conn: impl sqlx::MySqlExecutor<'_>,
    logicals: &[u16],
    ids: Option<&[EntityId]>,
) -> Result<Vec<Fingerprint>> {
    if logicals.is_empty() || ids.is_some_and(<[EntityId]>::is_empty) {
        return Ok(Vec::new());
    }
    let only = ids.map_or(String::new(), |ids| format!(" AND id IN ({})", marks(ids.len())));
    let sql = format!(
        "SELECT id, version, MD5(body) AS body_md5 FROM entities WHERE logical IN ({}){only} ORDER BY id",
        marks(logicals.len())
    );
    let mut q = sqlx::query(&sql);
    for k in logicals {
        q = q.bind(*k);
    }
    for id in ids.unwrap_or_default() {
        q = q.bind(&id.0[..]);
    }
    q.fetch_all(conn)
        .await
        .on(shard)?
        .iter()
        .map(|r| {
            Ok(Fingerprint {
                id: id_column(shard, r, "id")?,
                version: r.try_get("version").on(shard)?,
                body_md5: r.try_get("body_md5").on(shard)?,
            })
        })
        .collect()
}

/// InnoDB's estimate of the shard's entity rows (cheap; for metrics).
pub async fn estimated_rows(shard: usize, pool: &MySqlPool) -> Result<u64> {
    let n: Option<u64> = sqlx::query_scalar(
        "SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'entities'",
    )
    .fetch_optional(pool)
    .await
    .on(shard)?
    .flatten();
    Ok(n.unwrap_or(0))
}

/// How many rows of `logicals` a shard has.
pub async fn count_in_logicals(shard: usize, pool: &MySqlPool, logicals: &[u16]) -> Result<u64> {
    if logicals.is_empty() {
        return Ok(0);
    }
    let sql = format!("SELECT COUNT(*) FROM entities WHERE logical IN ({})", marks(logicals.len()));
    let mut q = sqlx::query_as::<_, (i64,)>(&sql);
    for k in logicals {
        q = q.bind(*k);
    }
    Ok(q.fetch_one(pool).await.on(shard)?.0 as u64)
}

/// Deletes up to `limit` rows of `logicals` (a moved-away copy) but never
/// of one the shard owns (see [`crate::ddl::NOT_OWNED`]); returns how
/// many went.
pub async fn delete_logicals(shard: usize, pool: &MySqlPool, logicals: &[u16], limit: usize) -> Result<u64> {
    if logicals.is_empty() {
        return Ok(0);
    }
    let sql = format!(
        "DELETE FROM entities WHERE logical IN ({}) AND {} LIMIT ?",
        marks(logicals.len()),
        crate::ddl::NOT_OWNED
    );
    let mut q = sqlx::query(&sql);
    for k in logicals {
        q = q.bind(*k);
    }
    Ok(q.bind(limit as u64).execute(pool).await.on(shard)?.rows_affected())
}
