//! Index rows: the indexer's upserts and version-guarded removals, the
//! cleaner's reads and repairs. A row is keyed by `(properties…, entity_id)`
//! and carries the version of the event that wrote it and, where known, its
//! entity's location (see [`crate::ddl::index_table`]).
//!
//! A removal leaves a *tombstone*: the row stays, marked with the time it
//! was removed (`removed_us`) and the version of the event that removed
//! it. Without it, an event delivered again after a newer one removed its
//! key (a broker that appends a retried batch twice, a zombie publisher)
//! finds no row and writes the key back: a row no event would ever remove.
//! With it, a row is live only if the newest event that touched its key
//! added it, whatever order the events arrive in. Every read here sees
//! live rows only; the cleaner purges tombstones once the time the index
//! has settled to is `cleaner.index_tombstone_retention_secs` past them.

use schemas::index::{IndexKey, IndexSpec, KeyValue, PropType};
use schemas::EntityId;
use sqlx::mysql::{MySqlArguments, MySqlPool, MySqlRow};
use sqlx::query::Query;
use sqlx::{MySql, MySqlConnection, Row};

use crate::ddl::LIVE;
use crate::error::{id_column, OnShard, Result};
use crate::rows::{marks, Rows};

/// One index row: as stored, or as the indexer and the cleaner write it.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexRow {
    pub key: IndexKey,
    pub entity: EntityId,
    /// The row's logical shard (of its `shard_on` value).
    pub logical: u16,
    /// The version of the entity that produced this row.
    pub version: u64,
    /// The entity's `added_id` on its own shard; `None`: unknown.
    pub entity_added_id: Option<u64>,
    /// A unique index's row still reserved: its token and until when (see
    /// the unique module); a move carries it as it is.
    pub reservation: Option<(Vec<u8>, i64)>,
}

/// A row to remove unless a newer event re-wrote it: removed only if its
/// version is below `below_version`, which the tombstone then carries.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexRowDelete {
    pub key: IndexKey,
    pub entity: EntityId,
    /// The row's logical shard (of its `shard_on` value).
    pub logical: u16,
    pub below_version: u64,
}

/// Where an existing row's entity lives: its `added_id`.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexRowLocation {
    pub key: IndexKey,
    pub entity: EntityId,
    pub entity_added_id: u64,
}

/// Binds a key's values, in order, the way its columns store them.
pub(crate) fn bind_key<'q>(
    mut q: Query<'q, MySql, MySqlArguments>,
    key: &'q [KeyValue],
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

/// `INSERT INTO` the index table of rows of its key columns and then
/// `columns` (`?` each), ending with `tail`.
fn insert_rows(spec: &IndexSpec, columns: &[&str], tail: &str) -> Rows {
    let mut cols: Vec<String> = spec.properties.iter().map(|p| format!("`{}`", p.name)).collect();
    let row = format!("({})", marks(cols.len() + columns.len()));
    cols.extend(columns.iter().map(|c| c.to_string()));
    Rows::new(format!("INSERT INTO `{}` ({}) VALUES ", spec.table, cols.join(", ")), row, tail)
}

/// Binds one [`IndexRow`] to an [`insert_rows`] statement of the columns
/// `entity_id, version, entity_added_id, logical`.
fn bind_row<'q>(q: Query<'q, MySql, MySqlArguments>, row: &'q IndexRow) -> Query<'q, MySql, MySqlArguments> {
    bind_key(q, &row.key)
        .bind(&row.entity.0[..])
        .bind(row.version)
        .bind(row.entity_added_id)
        .bind(row.logical)
}

fn key_equals(spec: &IndexSpec) -> String {
    spec.properties.iter().map(|p| format!("`{}` = ?", p.name)).collect::<Vec<_>>().join(" AND ")
}

/// Writes rows, or raises their versions; never lowers one, so a replayed
/// old event cannot make a row look older than what was already applied.
/// A tombstone comes back to life only for a newer version than the one
/// that removed it. A known entity location is written; an unknown one
/// keeps what the row has (an id's `added_id` never changes, so any known
/// one is the same). Up to 500 rows per statement.
#[tracing::instrument(level = "debug", skip_all, fields(table = %spec.table, shard))]
pub async fn upsert_index_rows(
    shard: usize,
    conn: &mut MySqlConnection,
    spec: &IndexSpec,
    rows: &[IndexRow],
) -> Result<()> {
    let upsert = insert_rows(
        spec,
        &["entity_id", "version", "entity_added_id", "logical"],
        " ON DUPLICATE KEY UPDATE removed_us = IF(VALUES(version) > version, NULL, removed_us), \
         entity_added_id = COALESCE(VALUES(entity_added_id), entity_added_id), \
         version = GREATEST(version, VALUES(version))",
    );
    for st in upsert.statements(rows) {
        st.bind(sqlx::query(&st.sql), bind_row).execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// Sets where each row's entity is, on rows that exist; never creates one.
/// Returns how many rows changed.
#[tracing::instrument(level = "debug", skip_all, fields(table = %spec.table, shard))]
pub async fn set_index_row_locations(
    shard: usize,
    conn: &mut MySqlConnection,
    spec: &IndexSpec,
    rows: &[IndexRowLocation],
) -> Result<u64> {
    let sql = format!(
        "UPDATE `{}` SET entity_added_id = ? WHERE {} AND entity_id = ?",
        spec.table,
        key_equals(spec)
    );
    let mut changed = 0;
    for row in rows {
        let q = bind_key(sqlx::query(&sql).bind(row.entity_added_id), &row.key).bind(&row.entity.0[..]);
        changed += q.execute(&mut *conn).await.on(shard)?.rows_affected();
    }
    Ok(changed)
}

/// Removes rows written by an older version than each row's
/// `below_version`, leaving tombstones at that version (one also where the
/// key has no row yet, so an older event arriving later cannot add it): a
/// row that a newer event already re-wrote stays. Up to 500 rows per
/// statement.
#[tracing::instrument(level = "debug", skip_all, fields(table = %spec.table, shard))]
pub async fn remove_index_rows_before(
    shard: usize,
    conn: &mut MySqlConnection,
    spec: &IndexSpec,
    rows: &[IndexRowDelete],
    now_us: i64,
) -> Result<()> {
    let remove = insert_rows(
        spec,
        &["entity_id", "version", "logical", "removed_us"],
        " ON DUPLICATE KEY UPDATE removed_us = IF(VALUES(version) > version, VALUES(removed_us), removed_us), \
         version = GREATEST(version, VALUES(version))",
    );
    for st in remove.statements(rows) {
        let q = st.bind(sqlx::query(&st.sql), |q, row| {
            bind_key(q, &row.key)
                .bind(&row.entity.0[..])
                .bind(row.below_version)
                .bind(row.logical)
                .bind(now_us)
        });
        q.execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// Removes a live row unless something newer than `version` rewrote it
/// (the cleaner's guard against undoing a concurrent indexer write),
/// leaving a tombstone at `version`; how many rows it removed.
#[tracing::instrument(level = "debug", skip_all, fields(table = %spec.table, shard))]
pub async fn remove_index_row_upto(
    shard: usize,
    conn: &mut MySqlConnection,
    spec: &IndexSpec,
    key: &IndexKey,
    entity: &EntityId,
    version: u64,
    now_us: i64,
) -> Result<u64> {
    let sql = format!(
        "UPDATE `{}` SET removed_us = ?, version = GREATEST(version, ?) \
         WHERE {} AND entity_id = ? AND version <= ? AND {LIVE}",
        spec.table,
        key_equals(spec)
    );
    let q = bind_key(sqlx::query(&sql).bind(now_us).bind(version), key);
    let done = q.bind(&entity.0[..]).bind(version).execute(conn).await.on(shard)?;
    Ok(done.rows_affected())
}

/// Deletes the tombstones of `ids` removed before `before_us`; how many.
pub async fn purge_tombstones_of(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    ids: &[EntityId],
    before_us: i64,
) -> Result<u64> {
    if ids.is_empty() {
        return Ok(0);
    }
    let sql =
        format!("DELETE FROM `{}` WHERE entity_id IN ({}) AND removed_us < ?", spec.table, marks(ids.len()));
    let mut q = sqlx::query(&sql);
    for id in ids {
        q = q.bind(&id.0[..]);
    }
    Ok(q.bind(before_us).execute(pool).await.on(shard)?.rows_affected())
}

/// Decodes one index row's key columns; `None` for bytes no key of ours
/// has (a hand-made row).
pub(crate) fn row_key(shard: usize, spec: &IndexSpec, r: &MySqlRow) -> Result<Option<IndexKey>> {
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

/// Every live row of the listed entities in this shard's copy of the index.
/// Rows whose bytes cannot be decoded (hand-made garbage) are skipped.
#[tracing::instrument(level = "debug", skip_all, fields(table = %spec.table, shard))]
pub async fn index_rows_of(
    shard: usize,
    pool: impl sqlx::MySqlExecutor<'_>,
    spec: &IndexSpec,
    ids: &[EntityId],
) -> Result<Vec<IndexRow>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let sql = format!(
        "SELECT {} FROM `{}` WHERE entity_id IN ({}) AND {LIVE}",
        row_columns(spec),
        spec.table,
        marks(ids.len())
    );
    let mut q = sqlx::query(&sql);
    for id in ids {
        q = q.bind(&id.0[..]);
    }
    index_rows(shard, spec, &q.fetch_all(pool).await.on(shard)?)
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

/// The version of one live index row, if it exists.
pub async fn index_row_version(
    shard: usize,
    conn: impl sqlx::MySqlExecutor<'_>,
    spec: &IndexSpec,
    key: &IndexKey,
    entity: &EntityId,
) -> Result<Option<u64>> {
    let sql = format!(
        "SELECT version FROM `{}` WHERE {} AND entity_id = ? AND {LIVE}",
        spec.table,
        key_equals(spec)
    );
    let row = bind_key(sqlx::query(&sql), key).bind(&entity.0[..]).fetch_optional(conn).await.on(shard)?;
    row.map(|r| r.try_get("version").on(shard)).transpose()
}

/// The columns [`index_rows`] decodes.
fn row_columns(spec: &IndexSpec) -> String {
    let cols: Vec<String> = spec.properties.iter().map(|p| format!("`{}`", p.name)).collect();
    let reservation = if spec.unique { ", token, reserved_until_us" } else { "" };
    format!("{}, entity_id, version, entity_added_id, logical{reservation}", cols.join(", "))
}

/// Decodes rows of [`row_columns`]; rows whose bytes no key of ours has
/// (hand-made garbage) are skipped.
fn index_rows(shard: usize, spec: &IndexSpec, rows: &[MySqlRow]) -> Result<Vec<IndexRow>> {
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let Some(key) = row_key(shard, spec, r)? else { continue };
        let reservation = match spec.unique {
            true => {
                let token: Option<Vec<u8>> = r.try_get("token").on(shard)?;
                let until: Option<i64> = r.try_get("reserved_until_us").on(shard)?;
                token.map(|t| (t, until.unwrap_or(0)))
            }
            false => None,
        };
        out.push(IndexRow {
            key,
            entity: id_column(shard, r, "entity_id")?,
            logical: r.try_get("logical").on(shard)?,
            version: r.try_get("version").on(shard)?,
            entity_added_id: r.try_get("entity_added_id").on(shard)?,
            reservation,
        });
    }
    Ok(out)
}

/// Up to `limit` rows whose `logical` column is `logical` (`migrate` fills
/// in rows made before logical shards).
pub async fn rows_with_logical(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    logical: u16,
    limit: usize,
) -> Result<Vec<IndexRow>> {
    let sql = format!("SELECT {} FROM `{}` WHERE logical = ? LIMIT ?", row_columns(spec), spec.table);
    let rows = sqlx::query(&sql).bind(logical).bind(limit as u64).fetch_all(pool).await.on(shard)?;
    index_rows(shard, spec, &rows)
}

/// Sets one row's `logical` column.
pub async fn set_logical(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    key: &IndexKey,
    entity: &EntityId,
    logical: u16,
) -> Result<()> {
    let sql = format!("UPDATE `{}` SET logical = ? WHERE {} AND entity_id = ?", spec.table, key_equals(spec));
    bind_key(sqlx::query(&sql).bind(logical), key).bind(&entity.0[..]).execute(pool).await.on(shard)?;
    Ok(())
}

/// Every live row of `logicals` in this shard's copy of the index (a
/// move's copy and verification; a logical shard is a small slice of an
/// index). Tombstones stay behind: a move carries live rows only.
#[tracing::instrument(level = "debug", skip_all, fields(table = %spec.table, shard))]
pub async fn rows_in_logicals(
    shard: usize,
    conn: impl sqlx::MySqlExecutor<'_>,
    spec: &IndexSpec,
    logicals: &[u16],
) -> Result<Vec<IndexRow>> {
    Ok(select_in_logicals(shard, conn, spec, logicals, false).await?.into_iter().map(|(r, _)| r).collect())
}

/// [`rows_in_logicals`], each row with its digest
/// ([`crate::checksums::index_digest`]).
pub async fn digested_rows_in_logicals(
    shard: usize,
    conn: impl sqlx::MySqlExecutor<'_>,
    spec: &IndexSpec,
    logicals: &[u16],
) -> Result<Vec<(IndexRow, u64)>> {
    select_in_logicals(shard, conn, spec, logicals, true).await
}

async fn select_in_logicals(
    shard: usize,
    conn: impl sqlx::MySqlExecutor<'_>,
    spec: &IndexSpec,
    logicals: &[u16],
    digest: bool,
) -> Result<Vec<(IndexRow, u64)>> {
    if logicals.is_empty() {
        return Ok(Vec::new());
    }
    // Not computed where not asked for (read as 0).
    let digest_sql = if digest { crate::checksums::index_digest(spec) } else { "NULL".into() };
    let sql = format!(
        "SELECT {}, {digest_sql} AS digest FROM `{}` WHERE logical IN ({}) AND {LIVE}",
        row_columns(spec),
        spec.table,
        marks(logicals.len())
    );
    let mut q = sqlx::query(&sql);
    for k in logicals {
        q = q.bind(*k);
    }
    let rows = q.fetch_all(conn).await.on(shard)?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        // Rows whose bytes no key of ours has (hand-made garbage) are skipped.
        if let Some(row) = index_rows(shard, spec, std::slice::from_ref(r))?.pop() {
            let d: Option<u64> = if digest { r.try_get("digest").on(shard)? } else { None };
            out.push((row, d.unwrap_or(0)));
        }
    }
    Ok(out)
}

/// Writes rows exactly as another shard has them (a move's copy): key,
/// version and location as given, whatever this shard had for the key.
#[tracing::instrument(level = "debug", skip_all, fields(table = %spec.table, shard))]
pub async fn copy_rows(
    shard: usize,
    conn: &mut MySqlConnection,
    spec: &IndexSpec,
    rows: &[IndexRow],
) -> Result<()> {
    if spec.unique {
        // One row per key: the key's row becomes the copied one, whoever
        // it named, with its reservation.
        let copy = insert_rows(
            spec,
            &["entity_id", "version", "entity_added_id", "logical", "token", "reserved_until_us"],
            " ON DUPLICATE KEY UPDATE entity_id = VALUES(entity_id), version = VALUES(version), \
             entity_added_id = VALUES(entity_added_id), token = VALUES(token), \
             reserved_until_us = VALUES(reserved_until_us)",
        );
        for st in copy.statements(rows) {
            let q = st.bind(sqlx::query(&st.sql), |q, row| {
                let (token, until) =
                    row.reservation.as_ref().map_or((None, None), |(t, u)| (Some(t), Some(*u)));
                bind_row(q, row).bind(token).bind(until)
            });
            q.execute(&mut *conn).await.on(shard)?;
        }
        return Ok(());
    }
    let copy = insert_rows(
        spec,
        &["entity_id", "version", "entity_added_id", "logical"],
        " ON DUPLICATE KEY UPDATE version = VALUES(version), entity_added_id = VALUES(entity_added_id), \
         removed_us = NULL",
    );
    for st in copy.statements(rows) {
        st.bind(sqlx::query(&st.sql), bind_row).execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// Makes this shard's rows of `entities` within `logicals` exactly `rows`
/// (a move's catch-up: the source's current rows of entities that changed).
#[tracing::instrument(level = "debug", skip_all, fields(table = %spec.table, shard))]
pub async fn replace_rows_of(
    shard: usize,
    conn: &mut MySqlConnection,
    spec: &IndexSpec,
    logicals: &[u16],
    entities: &[EntityId],
    rows: &[IndexRow],
) -> Result<()> {
    let delete = Rows::new(
        format!("DELETE FROM `{}` WHERE entity_id IN (", spec.table),
        "?",
        format!(") AND logical IN ({})", marks(logicals.len())),
    );
    for st in delete.statements(entities) {
        let q = st.bind(sqlx::query(&st.sql), |q, id| q.bind(&id.0[..]));
        logicals.iter().fold(q, |q, k| q.bind(*k)).execute(&mut *conn).await.on(shard)?;
    }
    copy_rows(shard, conn, spec, rows).await
}

/// How many live rows of `logicals` a shard's copy of the index has.
pub async fn count_in_logicals(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    logicals: &[u16],
) -> Result<u64> {
    if logicals.is_empty() {
        return Ok(0);
    }
    let sql = format!(
        "SELECT COUNT(*) FROM `{}` WHERE logical IN ({}) AND {LIVE}",
        spec.table,
        marks(logicals.len())
    );
    let mut q = sqlx::query_as::<_, (i64,)>(&sql);
    for k in logicals {
        q = q.bind(*k);
    }
    Ok(q.fetch_one(pool).await.on(shard)?.0 as u64)
}

/// Rows compared by value: key bytes, entity, version (a move's verify).
pub fn row_fingerprint(row: &IndexRow) -> (Vec<u8>, EntityId, u64) {
    (key_bytes(&row.key), row.entity, row.version)
}

/// A key as comparable bytes (each value length-prefixed).
pub(crate) fn key_bytes(key: &IndexKey) -> Vec<u8> {
    let mut out = Vec::new();
    for v in key {
        let b = v.canonical_bytes();
        out.extend_from_slice(&(b.len() as u32).to_be_bytes());
        out.push(match v {
            KeyValue::Uuid(_) => 1,
            KeyValue::Str(_) => 2,
            KeyValue::Int(_) => 3,
            KeyValue::Float(_) => 4,
            KeyValue::Bool(_) => 5,
        });
        out.extend_from_slice(&b);
    }
    out
}

/// Deletes up to `limit` rows of `logicals` (a moved-away copy) but never
/// of one the shard owns (see [`crate::ddl::NOT_OWNED`]).
pub async fn delete_logicals(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    logicals: &[u16],
    limit: usize,
) -> Result<u64> {
    if logicals.is_empty() {
        return Ok(0);
    }
    let sql = format!(
        "DELETE FROM `{}` WHERE logical IN ({}) AND {} LIMIT ?",
        spec.table,
        marks(logicals.len()),
        crate::ddl::NOT_OWNED
    );
    let mut q = sqlx::query(&sql);
    for k in logicals {
        q = q.bind(*k);
    }
    Ok(q.bind(limit as u64).execute(pool).await.on(shard)?.rows_affected())
}
