//! The cluster's catalog of indexes, on the metadata shard: each index's
//! definition, lifecycle state and backfill progress (`bagstore_indexes`),
//! and the commit time of the newest event its indexers applied
//! (`bagstore_index_progress`, the source of index freshness).

use schemas::index::{IndexSpec, IndexState};
use sqlx::mysql::MySqlPool;
use sqlx::Row;

use crate::error::{OnShard, Result, StoreError};
use crate::shards::Shards;
use crate::topology::META_SHARD;

/// One index as the catalog holds it.
#[derive(Debug, Clone)]
pub struct IndexMeta {
    pub spec: IndexSpec,
    pub state: IndexState,
    pub rows_done: u64,
    pub rows_total: u64,
    /// A CONFLICTED unique index's clashes (see [`set_conflicted`]).
    pub conflicts: Option<serde_json::Value>,
}

pub async fn list_index_meta(shards: &Shards) -> Result<Vec<IndexMeta>> {
    let pool = shards.meta();
    let rows = sqlx::query(
        "SELECT name, spec, state, rows_done, rows_total, conflicts FROM bagstore_indexes ORDER BY name",
    )
    .fetch_all(pool)
    .await
    .on(META_SHARD)?;
    rows.iter()
        .map(|r| {
            let table: String = r.try_get("name").on(META_SHARD)?;
            let spec_text: String = r.try_get("spec").on(META_SHARD)?;
            let spec = serde_json::from_str(&spec_text)
                .map_err(|source| StoreError::BadMeta { table: table.clone(), source })?;
            let state: String = r.try_get("state").on(META_SHARD)?;
            Ok(IndexMeta {
                spec,
                state: IndexState::parse(&state).unwrap_or(IndexState::Creating),
                rows_done: r.try_get("rows_done").on(META_SHARD)?,
                rows_total: r.try_get("rows_total").on(META_SHARD)?,
                conflicts: r
                    .try_get::<Option<String>, _>("conflicts")
                    .on(META_SHARD)?
                    .and_then(|t| serde_json::from_str(&t).ok()),
            })
        })
        .collect()
}

/// Registers an index if it is new; refuses a changed definition. Returns
/// the state it has afterwards.
pub async fn register_index(shards: &Shards, spec: &IndexSpec, initial: IndexState) -> Result<IndexState> {
    let pool = shards.meta();
    let spec_text = serde_json::to_string(spec).expect("index specs serialize");
    sqlx::query("INSERT IGNORE INTO bagstore_indexes (name, spec, state) VALUES (?, ?, ?)")
        .bind(&spec.table)
        .bind(&spec_text)
        .bind(initial.as_str())
        .execute(pool)
        .await
        .on(META_SHARD)?;
    let existing = list_index_meta(shards).await?;
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

/// A unique index's backfill found clashes: CONFLICTED with them, and
/// its next backfill starts over (no cursor).
pub async fn set_conflicted(shards: &Shards, table: &str, conflicts: &serde_json::Value) -> Result<()> {
    sqlx::query(
        "UPDATE bagstore_indexes SET state = ?, conflicts = ?, backfill_cursor = NULL, rows_done = 0, \
         changed = NOW(6) WHERE name = ?",
    )
    .bind(IndexState::Conflicted.as_str())
    .bind(conflicts.to_string())
    .bind(table)
    .execute(shards.meta())
    .await
    .on(META_SHARD)?;
    Ok(())
}

/// Sets an index's state (and forgets any conflicts).
pub async fn set_index_state(shards: &Shards, table: &str, state: IndexState) -> Result<()> {
    let pool = shards.meta();
    sqlx::query("UPDATE bagstore_indexes SET state = ?, conflicts = NULL, changed = NOW(6) WHERE name = ?")
        .bind(state.as_str())
        .bind(table)
        .execute(pool)
        .await
        .on(META_SHARD)?;
    Ok(())
}

/// Backfill progress: an opaque cursor (JSON) and row counts, written in
/// one statement so the cursor and `rows_done` always agree.
pub async fn set_backfill_progress(
    shards: &Shards,
    table: &str,
    cursor: Option<&str>,
    rows_done: u64,
    rows_total: u64,
) -> Result<()> {
    let pool = shards.meta();
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
    .on(META_SHARD)?;
    Ok(())
}

pub async fn backfill_cursor(shards: &Shards, table: &str) -> Result<Option<String>> {
    let pool = shards.meta();
    let row = sqlx::query("SELECT backfill_cursor FROM bagstore_indexes WHERE name = ?")
        .bind(table)
        .fetch_optional(pool)
        .await
        .on(META_SHARD)?;
    match row {
        Some(r) => Ok(r.try_get("backfill_cursor").on(META_SHARD)?),
        None => Ok(None),
    }
}

/// Replaces a dropped index's metadata with a new definition.
async fn reregister_dropped_index(pool: &MySqlPool, spec: &IndexSpec, initial: IndexState) -> Result<()> {
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
    .on(META_SHARD)?;
    Ok(())
}

/// What [`drop_index`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// The index was live and is dropped now.
    Now,
    /// It was `DROPPING` already; its tables are dropped (again).
    Already,
}

/// Stops maintaining an index: marks it `DROPPING` in the catalog (indexers
/// skip its events, readers and the cleaner ignore it), then drops its
/// table on every shard. Dropping again is harmless.
pub async fn drop_index(shards: &Shards, table: &str) -> Result<Dropped> {
    let known = list_index_meta(shards).await?;
    let Some(meta) = known.iter().find(|m| m.spec.table == table) else {
        return Err(StoreError::NoSuchIndex { table: table.to_string() });
    };
    let was = if meta.state == IndexState::Dropping { Dropped::Already } else { Dropped::Now };
    set_index_state(shards, table, IndexState::Dropping).await?;
    shards.try_each(|shard, pool| crate::migrate::drop_index_table(shard, pool, table)).await?;
    Ok(was)
}

/// Records that an index applied events committed up to `commit_us`.
pub async fn record_index_progress(shards: &Shards, table: &str, commit_us: i64) -> Result<()> {
    sqlx::query(
        "INSERT INTO bagstore_index_progress (name, last_applied_commit_us) VALUES (?, ?) \
         ON DUPLICATE KEY UPDATE last_applied_commit_us = GREATEST(last_applied_commit_us, \
         VALUES(last_applied_commit_us)), changed = NOW(6)",
    )
    .bind(table)
    .bind(commit_us)
    .execute(shards.meta())
    .await
    .on(META_SHARD)?;
    Ok(())
}

/// The commit time of the newest event an index applied, if any.
pub async fn index_progress(shards: &Shards, table: &str) -> Result<Option<i64>> {
    let row = sqlx::query("SELECT last_applied_commit_us FROM bagstore_index_progress WHERE name = ?")
        .bind(table)
        .fetch_optional(shards.meta())
        .await
        .on(META_SHARD)?;
    row.map(|r| r.try_get("last_applied_commit_us").on(META_SHARD)).transpose()
}
