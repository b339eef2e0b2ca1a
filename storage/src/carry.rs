//! What a move carries besides entity and index rows: the per-logical-shard
//! state a new owner needs to answer as the old one would. The `mover`
//! crate decides when; this module holds the SQL.
//!
//! - **Version floors** (`bagstore_owned.version_floor`, see
//!   [`crate::ddl::FLOOR_COLUMN`]): read on the source while the cutover's
//!   fence holds its owned rows (a tombstone purge, which raises a floor,
//!   takes the same rows exclusively, so a floor cannot rise meanwhile),
//!   written on the target in the transaction that makes it own the
//!   logical shards (the cutover's take-over), so an owner always has its
//!   floor.
//! - **Idempotency records** (`bagstore_idempotency`, see
//!   [`crate::idempotency`]): they live on the shard of the entity they
//!   guard, so they move with its logical shard. Records are only inserted
//!   or replaced whole, each stamped with the time of its write, so a copy
//!   upserts keeping the newer stamp, and a later copy of the records
//!   stamped since some time brings every change made after it.
//! - **Deleted entities**: a catch-up makes the target's row of a journaled
//!   entity the source's, and when the source has none (a purged
//!   tombstone) that is a delete ([`delete_entities`]).

use schemas::EntityId;
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlRow};
use sqlx::Row;
use std::collections::BTreeMap;

use crate::error::{id_column, OnShard, Result};
use crate::idempotency::Record;
use crate::rows::{marks, Rows, KEYS_PER_STATEMENT};

/// The version floors of `logicals` this shard owns (a logical shard it
/// does not own is absent). A plain read: the cutover calls it with the
/// fence held, which keeps the floors still.
pub async fn version_floors(shard: usize, pool: &MySqlPool, logicals: &[u16]) -> Result<BTreeMap<u16, u64>> {
    let mut out = BTreeMap::new();
    let floors = Rows::new("SELECT logical, version_floor FROM bagstore_owned WHERE logical IN (", "?", ")")
        .at_most(KEYS_PER_STATEMENT);
    for st in floors.statements(logicals) {
        let q = st.bind(sqlx::query_as::<_, (u16, u64)>(&st.sql), |q, k| q.bind(*k));
        out.extend(q.fetch_all(pool).await.on(shard)?);
    }
    Ok(out)
}

/// One row of `bagstore_idempotency`, as a move copies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyRow {
    pub key_hash: [u8; 16],
    /// The logical shard of the entity the record guards: where it lives.
    pub logical: u16,
    pub record: Record,
}

/// A position in the `(logical, recorded_us, key_hash)` order of
/// [`idempotency_records_in`]: the last row of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordCursor {
    pub logical: u16,
    pub recorded_us: i64,
    pub key_hash: [u8; 16],
}

impl RecordCursor {
    pub fn after(r: &IdempotencyRow) -> RecordCursor {
        RecordCursor { logical: r.logical, recorded_us: r.record.recorded_us, key_hash: r.key_hash }
    }
}

fn idempotency_row(shard: usize, r: &MySqlRow) -> Result<IdempotencyRow> {
    // BINARY(16) NOT NULL, like the id columns: read the same way.
    let hash = |col: &str| id_column(shard, r, col).map(|id| id.0);
    Ok(IdempotencyRow {
        key_hash: hash("key_hash")?,
        logical: r.try_get("logical").on(shard)?,
        record: Record {
            request_hash: hash("request_hash")?,
            entity_id: id_column(shard, r, "entity_id")?,
            version: r.try_get("version").on(shard)?,
            created: r.try_get("created").on(shard)?,
            refusal: r.try_get("refusal").on(shard)?,
            recorded_us: r.try_get("recorded_us").on(shard)?,
        },
    })
}

/// Up to `limit` idempotency records of `logicals` recorded at or after
/// `since_us`, after `after`, in `(logical, recorded_us, key_hash)` order
/// (along the key `idempotency_logical`, whose rows end with the primary
/// key).
pub async fn idempotency_records_in(
    shard: usize,
    pool: &MySqlPool,
    logicals: &[u16],
    since_us: i64,
    after: Option<RecordCursor>,
    limit: usize,
) -> Result<Vec<IdempotencyRow>> {
    if logicals.is_empty() {
        return Ok(Vec::new());
    }
    let resume = match after {
        Some(_) => {
            " AND (logical > ? OR (logical = ? AND (recorded_us > ? OR (recorded_us = ? AND key_hash > ?))))"
        }
        None => "",
    };
    let sql = format!(
        "SELECT key_hash, logical, request_hash, entity_id, version, created, refusal, recorded_us \
         FROM bagstore_idempotency WHERE logical IN ({}) AND recorded_us >= ?{resume} \
         ORDER BY logical, recorded_us, key_hash LIMIT ?",
        marks(logicals.len())
    );
    let mut q = sqlx::query(&sql);
    for k in logicals {
        q = q.bind(*k);
    }
    q = q.bind(since_us);
    if let Some(c) = &after {
        q = q.bind(c.logical).bind(c.logical).bind(c.recorded_us).bind(c.recorded_us).bind(&c.key_hash[..]);
    }
    let rows = q.bind(limit as u64).fetch_all(pool).await.on(shard)?;
    rows.iter().map(|r| idempotency_row(shard, r)).collect()
}

/// How many idempotency records of `logicals` a shard has.
pub async fn count_idempotency_records(shard: usize, pool: &MySqlPool, logicals: &[u16]) -> Result<u64> {
    let mut n = 0;
    let count = Rows::new("SELECT COUNT(*) FROM bagstore_idempotency WHERE logical IN (", "?", ")")
        .at_most(KEYS_PER_STATEMENT);
    for st in count.statements(logicals) {
        let q = st.bind(sqlx::query_as::<_, (i64,)>(&st.sql), |q, k| q.bind(*k));
        n += q.fetch_one(pool).await.on(shard)?.0 as u64;
    }
    Ok(n)
}

/// Writes copied records into a target shard, inside the caller's
/// transaction (a move's copy transaction, which proves the run still may
/// write there). A record the target has already is replaced only by a
/// newer one (a copy that comes late never undoes a later one). Columns
/// are assigned left to right: `recorded_us` last, so the others compare
/// with the old stamp.
pub async fn copy_idempotency_records(
    shard: usize,
    conn: &mut MySqlConnection,
    rows: &[IdempotencyRow],
) -> Result<()> {
    let newer = |col: &str| format!("{col} = IF(VALUES(recorded_us) > recorded_us, VALUES({col}), {col})");
    let copy = crate::idempotency::record_rows(&format!(
        " ON DUPLICATE KEY UPDATE {}, {}, {}, {}, {}, {}, recorded_us = GREATEST(recorded_us, VALUES(recorded_us))",
        newer("logical"),
        newer("request_hash"),
        newer("entity_id"),
        newer("version"),
        newer("created"),
        newer("refusal"),
    ));
    for st in copy.statements(rows) {
        let q = st.bind(sqlx::query(&st.sql), |q, row| {
            crate::idempotency::bind_record(q, &row.key_hash, row.logical, &row.record)
        });
        q.execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// Deletes up to `limit` idempotency records of `logicals` (a shard that
/// no longer owns them, or never took them over), never of one the shard
/// owns (see [`crate::ddl::NOT_OWNED`]); how many.
pub async fn delete_idempotency_records(
    shard: usize,
    pool: &MySqlPool,
    logicals: &[u16],
    limit: usize,
) -> Result<u64> {
    if logicals.is_empty() {
        return Ok(0);
    }
    let sql = format!(
        "DELETE FROM bagstore_idempotency WHERE logical IN ({}) AND {} LIMIT ?",
        marks(logicals.len()),
        crate::ddl::NOT_OWNED
    );
    let mut q = sqlx::query(&sql);
    for k in logicals {
        q = q.bind(*k);
    }
    Ok(q.bind(limit as u64).execute(pool).await.on(shard)?.rows_affected())
}

/// Deletes the entity rows of `ids`, inside the caller's transaction (a
/// move's catch-up, for entities the source no longer has); how many.
pub async fn delete_entities(shard: usize, conn: &mut MySqlConnection, ids: &[EntityId]) -> Result<u64> {
    let mut n = 0;
    let delete = Rows::new("DELETE FROM entities WHERE id IN (", "?", ")");
    for st in delete.statements(ids) {
        let q = st.bind(sqlx::query(&st.sql), |q, id| q.bind(&id.0[..]));
        n += q.execute(&mut *conn).await.on(shard)?.rows_affected();
    }
    Ok(n)
}
