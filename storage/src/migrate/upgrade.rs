//! What `migrate` removes of earlier releases' tables, once it is safe.
//!
//! Releases before this one could keep the outbox in the binary log (a
//! `BLACKHOLE` table `outbox_log` written with each write, read back from
//! the log by the relay, whose place in the log was saved in
//! `bagstore_relay_log`) and could backfill by bulk loads into copies of
//! an index table (`<index>__bulk`, swapped in through `<index>__live`).
//! Both are gone. A shard whose relay place is short of its binary log's
//! end may hold change events that exist only in that log: dropping the
//! place would lose them, so [`check`] refuses until they are
//! published (the previous release, run with the table outbox, publishes
//! what the log still holds and then forgets the place).

use sqlx::mysql::MySqlPool;
use sqlx::Row;

use crate::error::{OnShard, Result, StoreError};

/// The old relay's place, one row; the log it pointed into.
const RELAY_PLACE: &str = "bagstore_relay_log";
/// The old binary-log outbox, a `BLACKHOLE` table.
const LOG_OUTBOX: &str = "outbox_log";

/// Refuses (naming the shard, both places and what to run) while the old
/// binary-log relay's saved place is short of the binary log's end, or a
/// bulk backfill's swap is half done. Changes nothing: `migrate` checks
/// every shard before [`drop_leftovers`] drops anything on any of them.
/// `indexes` are the catalog's index tables.
pub async fn check(shard: usize, name: &str, pool: &MySqlPool, indexes: &[String]) -> Result<()> {
    if has_old_relay_place(shard, pool).await? {
        if let Some(place) = saved_place(shard, pool).await? {
            let end = log_end(shard, pool).await?;
            let behind = match &end {
                Some(end) => place < *end,
                // No binary log to read: nothing can say what it held.
                None => true,
            };
            if behind {
                let end =
                    end.map_or("unknown (the binary log is off)".to_string(), |(f, p)| format!("{f}:{p}"));
                return Err(StoreError::BadTopology(format!(
                    "shard {name}: the binary-log outbox's relay stopped at {}:{} and the binary log ends \
                     at {end}: change events written there may exist only in the binary log. Drain it \
                     first: run the previous release's writers with writer.outbox = \"table\" until \
                     {RELAY_PLACE} is empty on every shard (their relays publish what the log holds, then \
                     forget the place), then run `bagstore migrate` again (docs/operations.md, \
                     \"Upgrading\")",
                    place.0, place.1
                )));
            }
        }
    }
    for table in indexes {
        let live = format!("{table}__live");
        if !indexes.contains(&live) && engine_of(shard, pool, &live).await?.is_some() {
            return Err(StoreError::BadTopology(format!(
                "shard {name}: a bulk backfill of {table} stopped half way through its swap ({live} \
                 holds rows not yet merged); finish it with the previous release (`bagstore cleaner \
                 --index {table}` with cleaner.backfill_method = \"upsert\"), then run `bagstore migrate` \
                 again"
            )));
        }
    }
    Ok(())
}

/// Drops what the removed features left on the shard, once [`check`]
/// passed on every shard: `bagstore_relay_log`, `outbox_log` and
/// `<index>__bulk` copies (unswapped loads, which the backfill's cursor
/// never counted). Nothing happens on a shard that never ran them.
pub async fn drop_leftovers(shard: usize, pool: &MySqlPool, indexes: &[String]) -> Result<()> {
    if has_old_relay_place(shard, pool).await? {
        drop_table(shard, pool, RELAY_PLACE).await?;
    }
    if engine_of(shard, pool, LOG_OUTBOX).await?.is_some_and(|e| e.eq_ignore_ascii_case("BLACKHOLE")) {
        drop_table(shard, pool, LOG_OUTBOX).await?;
    }
    for table in indexes {
        let copy = format!("{table}__bulk");
        if !indexes.contains(&copy) && engine_of(shard, pool, &copy).await?.is_some() {
            drop_table(shard, pool, &copy).await?;
        }
    }
    Ok(())
}

/// `bagstore_relay_log` as the old release made it (its `through_us`
/// column tells it from an index table that happens to share the name).
async fn has_old_relay_place(shard: usize, pool: &MySqlPool) -> Result<bool> {
    let (n,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = 'through_us'",
    )
    .bind(RELAY_PLACE)
    .fetch_one(pool)
    .await
    .on(shard)?;
    Ok(n > 0)
}

/// The saved (file, offset), if the relay ever saved one and has not
/// forgotten it.
async fn saved_place(shard: usize, pool: &MySqlPool) -> Result<Option<(String, u64)>> {
    let row = sqlx::query("SELECT file, pos FROM bagstore_relay_log WHERE id = 1")
        .fetch_optional(pool)
        .await
        .on(shard)?;
    row.map(|r| Ok((r.try_get("file").on(shard)?, r.try_get("pos").on(shard)?))).transpose()
}

/// The binary log's end (file names sort as the files follow each other),
/// or None when the server logs nothing.
async fn log_end(shard: usize, pool: &MySqlPool) -> Result<Option<(String, u64)>> {
    let row = sqlx::query("SHOW MASTER STATUS").fetch_optional(pool).await.on(shard)?;
    row.map(|r| Ok((r.try_get("File").on(shard)?, r.try_get("Position").on(shard)?))).transpose()
}

async fn engine_of(shard: usize, pool: &MySqlPool, table: &str) -> Result<Option<String>> {
    let engine: Option<Option<String>> = sqlx::query_scalar(
        "SELECT CAST(ENGINE AS CHAR) FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(table)
    .fetch_optional(pool)
    .await
    .on(shard)?;
    Ok(engine.map(Option::unwrap_or_default))
}

async fn drop_table(shard: usize, pool: &MySqlPool, table: &str) -> Result<()> {
    tracing::info!(shard, table, "dropping a table of a removed feature");
    sqlx::query(&format!("DROP TABLE IF EXISTS `{table}`")).execute(pool).await.on(shard)?;
    Ok(())
}
