//! Creating what a cluster needs: databases, the base tables, index tables;
//! every step "if missing", so migrating twice is harmless.

use schemas::index::IndexSpec;
use schemas::settings::Dsn;
use sqlx::mysql::MySqlPool;

use crate::ddl;
use crate::error::{OnShard, Result};
use crate::shards::{dedicated_connection, split_database, META_SHARD};

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
pub async fn create_base_tables(shard: usize, pool: &MySqlPool) -> Result<()> {
    for stmt in [ddl::entities(), ddl::outbox()] {
        sqlx::query(&stmt).execute(pool).await.on(shard)?;
    }
    if shard == META_SHARD {
        for stmt in [ddl::index_catalog(), ddl::index_progress()] {
            sqlx::query(&stmt).execute(pool).await.on(shard)?;
        }
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
    debug_assert!(schemas::names::is_valid_identifier(table));
    sqlx::query(&format!("DROP TABLE IF EXISTS `{table}`")).execute(pool).await.on(shard)?;
    Ok(())
}
