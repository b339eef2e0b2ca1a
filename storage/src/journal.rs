//! A move's journal: while logical shards move, the source records which of
//! their rows change, so the copy can catch up with the writes made
//! meanwhile.
//!
//! The moving logical shards are listed in `bagstore_moving`, each with the
//! move that journals it, and triggers on `entities` and every index table
//! append `(logical, table, entity_id)` to `bagstore_journal` in the same
//! transaction as the change (inserts, updates and deletes alike, so
//! deleted index rows are caught too). The triggers exist only while a move
//! runs, so a cluster that is not moving pays nothing for them. Catching up
//! is then: for each journaled entity, make the target's rows equal to the
//! source's current rows.
//!
//! A journal belongs to its move. A mover run that lost the mover lock
//! without knowing can still be running the cleanup of a move another run
//! finished, when the next move from the same source has started
//! journaling: stopping "the" journal then would switch the next move's
//! off (its triggers dropped, its rows of `bagstore_moving` and its entries
//! deleted), and the writes made after that would never reach its target,
//! whose copy the verification trusts where the journal names no change.
//! So [`stop_journal`] removes only its own move's rows and entries, and
//! drops the triggers only when no move journals on the shard any more;
//! [`start_journal`] refuses a move whose logical shards the source gave up
//! already (the run lost its move: another run cut it over); and both run
//! under a named lock of the shard, so a start and a stop never interleave.

use schemas::index::IndexSpec;
use schemas::names::tables;
use schemas::EntityId;
use sqlx::mysql::MySqlPool;
use sqlx::pool::PoolConnection;
use sqlx::{Executor, MySql, Row};
use std::collections::BTreeMap;

use crate::error::{id_column, OnShard, Result, StoreError};
use crate::rows::{Rows, KEYS_PER_STATEMENT};

/// The name of one of the journal triggers of `table`: short and fixed
/// whatever the table's name (a trigger name has 64 characters at most).
fn trigger_name(op: char, table: &str) -> String {
    format!("bagstore_journal_{op}_{:016x}", xxhash_rust::xxh3::xxh3_64(table.as_bytes()))
}

/// The tables a move journals: entities, then each index table.
fn journaled(indexes: &[IndexSpec]) -> Vec<(&str, &'static str)> {
    let mut out = vec![(tables::ENTITIES, "id")];
    out.extend(indexes.iter().map(|s| (s.table.as_str(), "entity_id")));
    out
}

/// "The journal of this database": held while a journal starts or stops.
const JOURNAL_LOCK: &str = "CONCAT('bagstore.journal.', DATABASE())";

/// How long a start or stop of a journal waits for another one on the
/// same shard (each is a few statements of DDL).
const JOURNAL_LOCK_WAIT_SECS: u32 = 120;

/// A connection of `pool` holding the shard's journal lock. It is closed,
/// not returned to the pool, when dropped, so the lock goes with it
/// whatever happened meanwhile.
async fn journal_lock(shard: usize, pool: &MySqlPool) -> Result<PoolConnection<MySql>> {
    let mut conn = pool.acquire().await.on(shard)?;
    conn.close_on_drop();
    let (got,): (Option<i64>,) = sqlx::query_as(&format!("SELECT GET_LOCK({JOURNAL_LOCK}, ?)"))
        .bind(JOURNAL_LOCK_WAIT_SECS)
        .fetch_one(&mut *conn)
        .await
        .on(shard)?;
    if got != Some(1) {
        return Err(StoreError::BadTopology(format!(
            "physical shard {shard}: another mover run held the journal lock for {JOURNAL_LOCK_WAIT_SECS} s"
        )));
    }
    Ok(conn)
}

/// Starts journaling changes to `logicals` on the source for move
/// `move_id`: lists them in `bagstore_moving` as that move's, then creates
/// the triggers (waiting, as DDL does, for transactions that already
/// touched those tables; every write after it returns is journaled).
/// Idempotent. Fails with [`StoreError::MoveTakenOver`] if the source no
/// longer owns every one of `logicals`: the move was cut over by another
/// run, and journaling them again would outlive its cleanup.
pub async fn start_journal(
    shard: usize,
    pool: &MySqlPool,
    move_id: u64,
    logicals: &[u16],
    indexes: &[IndexSpec],
) -> Result<()> {
    let mut conn = journal_lock(shard, pool).await?;
    let owned = Rows::new("SELECT COUNT(*) FROM bagstore_owned WHERE logical IN (", "?", ")")
        .at_most(KEYS_PER_STATEMENT);
    let mut owns = 0;
    for st in owned.statements(logicals) {
        let q = st.bind(sqlx::query_as::<_, (i64,)>(&st.sql), |q, k| q.bind(*k));
        owns += q.fetch_one(&mut *conn).await.on(shard)?.0 as usize;
    }
    if owns != logicals.len() {
        return Err(StoreError::MoveTakenOver { shard });
    }
    let moving = Rows::new(
        "INSERT INTO bagstore_moving (logical, move_id) VALUES ",
        "(?, ?)",
        " ON DUPLICATE KEY UPDATE move_id = VALUES(move_id)",
    )
    .at_most(KEYS_PER_STATEMENT);
    for st in moving.statements(logicals) {
        st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k).bind(move_id)).execute(&mut *conn).await.on(shard)?;
    }
    for (table, id_col) in journaled(indexes) {
        for (op, event, row) in [('i', "INSERT", "NEW"), ('u', "UPDATE", "NEW"), ('d', "DELETE", "OLD")] {
            // Sent as text (CREATE TRIGGER cannot be prepared); every name in
            // it is a validated identifier.
            let ddl = format!(
                "CREATE TRIGGER IF NOT EXISTS `{name}` AFTER {event} ON `{table}` FOR EACH ROW \
                 INSERT INTO bagstore_journal (logical, tbl, entity_id) \
                 SELECT m.logical, '{table}', {row}.{id_col} FROM bagstore_moving m WHERE m.logical = {row}.logical",
                name = trigger_name(op, table),
            );
            conn.execute(ddl.as_str()).await.on(shard)?;
        }
    }
    Ok(())
}

/// Stops move `move_id`'s journal on a shard: forgets its rows of
/// `bagstore_moving` (and rows of `logicals` from before rows named their
/// move) and the entries of `logicals` no other move journals, then, if no
/// move journals on the shard any more, drops the triggers. Leaves another
/// move's journal as it is. Idempotent.
pub async fn stop_journal(
    shard: usize,
    pool: &MySqlPool,
    move_id: u64,
    logicals: &[u16],
    indexes: &[IndexSpec],
) -> Result<()> {
    let mut conn = journal_lock(shard, pool).await?;
    sqlx::query("DELETE FROM bagstore_moving WHERE move_id = ?")
        .bind(move_id)
        .execute(&mut *conn)
        .await
        .on(shard)?;
    let unnamed = Rows::new("DELETE FROM bagstore_moving WHERE move_id = 0 AND logical IN (", "?", ")")
        .at_most(KEYS_PER_STATEMENT);
    for st in unnamed.statements(logicals) {
        st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k)).execute(&mut *conn).await.on(shard)?;
    }
    let entries = Rows::new(
        "DELETE FROM bagstore_journal WHERE logical IN (",
        "?",
        ") AND logical NOT IN (SELECT logical FROM bagstore_moving)",
    )
    .at_most(KEYS_PER_STATEMENT);
    for st in entries.statements(logicals) {
        st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k)).execute(&mut *conn).await.on(shard)?;
    }
    let (others,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM bagstore_moving").fetch_one(&mut *conn).await.on(shard)?;
    if others > 0 {
        return Ok(());
    }
    for (table, _) in journaled(indexes) {
        for op in ['i', 'u', 'd'] {
            let ddl = format!("DROP TRIGGER IF EXISTS `{}`", trigger_name(op, table));
            conn.execute(ddl.as_str()).await.on(shard)?;
        }
    }
    // Triggers of index tables dropped since (their names are ours).
    let left: Vec<(String,)> = sqlx::query_as(
        "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS \
         WHERE TRIGGER_SCHEMA = DATABASE() AND TRIGGER_NAME LIKE 'bagstore\\_journal\\_%'",
    )
    .fetch_all(&mut *conn)
    .await
    .on(shard)?;
    for (name,) in left {
        conn.execute(format!("DROP TRIGGER IF EXISTS `{name}`").as_str()).await.on(shard)?;
    }
    // Entries no move reads any more (left by a journal stopped before
    // entries were scoped to their move's logical shards).
    sqlx::query("DELETE FROM bagstore_journal").execute(&mut *conn).await.on(shard)?;
    Ok(())
}

/// One journaled change: some row of `table` for `entity` changed, in
/// logical shard `logical` (an index row's own, not its entity's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalEntry {
    pub seq: u64,
    pub table: String,
    pub entity: EntityId,
    pub logical: u16,
}

/// Up to `limit` journal entries, oldest first.
pub async fn read_journal(shard: usize, pool: &MySqlPool, limit: usize) -> Result<Vec<JournalEntry>> {
    let rows = sqlx::query("SELECT seq, tbl, entity_id, logical FROM bagstore_journal ORDER BY seq LIMIT ?")
        .bind(limit as u64)
        .fetch_all(pool)
        .await
        .on(shard)?;
    rows.iter()
        .map(|r| {
            Ok(JournalEntry {
                seq: r.try_get("seq").on(shard)?,
                table: r.try_get("tbl").on(shard)?,
                entity: id_column(shard, r, "entity_id")?,
                logical: r.try_get("logical").on(shard)?,
            })
        })
        .collect()
}

/// Forgets the journal entries `applied`, and only those. Not "every
/// entry up to the last one read": a sequence number is taken when a
/// write's trigger runs, not when the write commits, so a write that
/// commits late adds an entry below entries already read, and trimming by
/// range would drop it unapplied (the verification then found the entity
/// differing, and the move copied it again at the cutover).
pub async fn trim_journal(shard: usize, pool: &MySqlPool, applied: &[JournalEntry]) -> Result<()> {
    let trim = Rows::new("DELETE FROM bagstore_journal WHERE seq IN (", "?", ")").at_most(KEYS_PER_STATEMENT);
    for st in trim.statements(applied) {
        st.bind(sqlx::query(&st.sql), |q, e| q.bind(e.seq)).execute(pool).await.on(shard)?;
    }
    Ok(())
}

/// The `(table, logical shard)`s of the entries waiting in the journal.
pub async fn pending_logicals(shard: usize, pool: &MySqlPool) -> Result<Vec<(String, u16)>> {
    sqlx::query_as("SELECT DISTINCT tbl, logical FROM bagstore_journal").fetch_all(pool).await.on(shard)
}

/// How many journal entries wait.
pub async fn journal_backlog(shard: usize, pool: &MySqlPool) -> Result<u64> {
    let (n,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM bagstore_journal").fetch_one(pool).await.on(shard)?;
    Ok(n as u64)
}

/// Groups entries by table: what one catch-up round applies.
pub fn by_table(entries: &[JournalEntry]) -> BTreeMap<String, Vec<EntityId>> {
    let mut out: BTreeMap<String, Vec<EntityId>> = BTreeMap::new();
    for e in entries {
        out.entry(e.table.clone()).or_default().push(e.entity);
    }
    for ids in out.values_mut() {
        ids.sort_unstable();
        ids.dedup();
    }
    out
}
