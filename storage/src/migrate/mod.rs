//! Creating what a cluster needs: databases, the base tables, index tables;
//! every step "if missing", so migrating twice is harmless. [`upgrade`]
//! removes what earlier releases left, once that loses nothing.

use schemas::index::IndexSpec;
use schemas::settings::Dsn;
use sqlx::mysql::MySqlPool;

use crate::ddl;
use crate::dsn::{dedicated_connection, split_database};
use crate::error::{OnShard, Result};
use crate::topology::META_SHARD;

pub mod upgrade;

/// Creates the shard's database if the DSN names one that is missing.
pub async fn create_database(shard: usize, dsn: &Dsn) -> Result<()> {
    let Some((db, server)) = split_database(dsn) else { return Ok(()) };
    if !schemas::names::is_valid_identifier(&db) {
        // Not ours to name (e.g. upper case): assume the operator created it.
        return Ok(());
    }
    let mut conn = dedicated_connection(&server).await.on(shard)?;
    sqlx::query(&format!("CREATE DATABASE IF NOT EXISTS `{db}`")).execute(&mut conn).await.on(shard)?;
    Ok(())
}

/// The tables every shard has, and on the metadata shard the cluster's own.
/// An `entities` table made before logical shards gets its `logical`
/// column and key (rows read [`ddl::LOGICAL_UNKNOWN`] until
/// [`fill_logical`] runs); tables made before expiry and tombstone purge
/// get `entities.expires_us` (NULL: an entity written before expiry was on
/// is found by the cleaner once rewritten), `bagstore_owned.version_floor`
/// (0) and the idempotency records' key by logical shard; `bagstore_moving`
/// gets the move each row belongs to (0: unknown); partition claims made
/// before generations get theirs (0, older than any new claim).
pub async fn create_base_tables(shard: usize, pool: &MySqlPool) -> Result<()> {
    for stmt in ddl::shard_tables() {
        sqlx::query(&stmt).execute(pool).await.on(shard)?;
    }
    add_column(shard, pool, "entities", "logical", &logical_with_placeholder()).await?;
    add_key(shard, pool, "entities", "entities_logical", "logical, added_id").await?;
    add_column(shard, pool, "entities", "expires_us", ddl::EXPIRES_COLUMN).await?;
    add_key(shard, pool, "entities", "entities_expires", "expires_us").await?;
    add_column(shard, pool, "bagstore_owned", "version_floor", ddl::FLOOR_COLUMN).await?;
    add_key(shard, pool, "bagstore_idempotency", "idempotency_logical", "logical, recorded_us").await?;
    add_column(shard, pool, "bagstore_idempotency", "refusal", ddl::REFUSAL_COLUMN).await?;
    add_column(shard, pool, "bagstore_moving", "move_id", ddl::MOVE_ID_COLUMN).await?;
    if shard == META_SHARD {
        for stmt in ddl::meta_tables() {
            sqlx::query(&stmt).execute(pool).await.on(shard)?;
        }
        add_column(shard, pool, "bagstore_partition_claims", "gen", ddl::CLAIM_GEN_COLUMN).await?;
        add_column(shard, pool, "bagstore_physical", "failovers", ddl::FAILOVERS_COLUMN).await?;
        add_column(shard, pool, "bagstore_indexes", "conflicts", ddl::CONFLICTS_COLUMN).await?;
    }
    Ok(())
}

/// Creates the index table, or brings an older one up to date: a table
/// made before `entity_added_id` existed gets the column (an instant
/// `ALTER` on MariaDB ≥ 10.3 and MySQL ≥ 8.0; its rows read NULL, "location
/// unknown", until the indexer or the cleaner rewrites them), and one made
/// before logical shards gets `logical` and its key ([`fill_logical`]
/// fills it in), and one made before tombstones gets `removed_us` (its
/// rows read NULL: live).
pub async fn create_index_table(shard: usize, pool: &MySqlPool, spec: &IndexSpec) -> Result<()> {
    sqlx::query(&ddl::index_table(spec)).execute(pool).await.on(shard)?;
    add_column(shard, pool, &spec.table, "entity_added_id", ddl::LOCATION_COLUMN).await?;
    add_column(shard, pool, &spec.table, "removed_us", ddl::REMOVED_COLUMN).await?;
    add_column(shard, pool, &spec.table, "logical", &logical_with_placeholder()).await?;
    add_key(shard, pool, &spec.table, &format!("{}_logical", spec.table), "logical").await?;
    Ok(())
}

/// Adds key `key` on `columns` to `table` unless a key of that name exists.
async fn add_key(shard: usize, pool: &MySqlPool, table: &str, key: &str, columns: &str) -> Result<()> {
    let (has,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.STATISTICS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND INDEX_NAME = ?",
    )
    .bind(table)
    .bind(key)
    .fetch_one(pool)
    .await
    .on(shard)?;
    if has == 0 {
        let sql = format!("ALTER TABLE `{table}` ADD KEY `{key}` ({columns})");
        sqlx::query(&sql).execute(pool).await.on(shard)?;
    }
    Ok(())
}

fn logical_with_placeholder() -> String {
    format!("{} DEFAULT {}", ddl::LOGICAL_COLUMN, ddl::LOGICAL_UNKNOWN)
}

/// Adds `column` (defined by `definition`) to `table` unless it has it;
/// true if it was added.
async fn add_column(
    shard: usize,
    pool: &MySqlPool,
    table: &str,
    column: &str,
    definition: &str,
) -> Result<bool> {
    let (has,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = ?",
    )
    .bind(table)
    .bind(column)
    .fetch_one(pool)
    .await
    .on(shard)?;
    if has > 0 {
        return Ok(false);
    }
    sqlx::query(&format!("ALTER TABLE `{table}` ADD COLUMN {definition}")).execute(pool).await.on(shard)?;
    Ok(true)
}

/// Fills in the `logical` column of rows made before logical shards, in
/// batches: `entities` from the id, an index table (when `spec` is given)
/// from the `shard_on` value. Returns how many rows it filled.
pub async fn fill_logical(
    shard: usize,
    pool: &MySqlPool,
    spec: Option<&IndexSpec>,
    logical_shards: u16,
) -> Result<u64> {
    let mut filled = 0;
    loop {
        let n = match spec {
            None => fill_entities_batch(shard, pool, logical_shards).await?,
            Some(spec) => fill_index_batch(shard, pool, spec, logical_shards).await?,
        };
        filled += n;
        if n == 0 {
            return Ok(filled);
        }
    }
}

async fn fill_entities_batch(shard: usize, pool: &MySqlPool, l: u16) -> Result<u64> {
    let rows: Vec<(u64, Vec<u8>)> =
        sqlx::query_as("SELECT added_id, id FROM entities WHERE logical = ? LIMIT 1000")
            .bind(ddl::LOGICAL_UNKNOWN)
            .fetch_all(pool)
            .await
            .on(shard)?;
    for (added_id, id) in &rows {
        sqlx::query("UPDATE entities SET logical = ? WHERE added_id = ?")
            .bind(schemas::logical_of(id, l))
            .bind(added_id)
            .execute(pool)
            .await
            .on(shard)?;
    }
    Ok(rows.len() as u64)
}

async fn fill_index_batch(shard: usize, pool: &MySqlPool, spec: &IndexSpec, l: u16) -> Result<u64> {
    let rows = crate::index_rows::rows_with_logical(shard, pool, spec, ddl::LOGICAL_UNKNOWN, 1000).await?;
    for row in &rows {
        let logical = spec.logical_of_key(&row.key, l);
        crate::index_rows::set_logical(shard, pool, spec, &row.key, &row.entity, logical).await?;
    }
    Ok(rows.len() as u64)
}

/// Drops an index table.
pub async fn drop_index_table(shard: usize, pool: &MySqlPool, table: &str) -> Result<()> {
    debug_assert!(schemas::names::is_valid_identifier(table));
    sqlx::query(&format!("DROP TABLE IF EXISTS `{table}`")).execute(pool).await.on(shard)?;
    Ok(())
}
