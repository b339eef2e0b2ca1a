//! What the cleaner removes from `entities`: expired entities (found here,
//! deleted through the write transaction, [`crate::write`]) and old
//! tombstones (purged here).
//!
//! A tombstone keeps a deleted id's version, so a re-created entity
//! continues above it. Purging one would lose that, so the purge raises
//! the version floor of the tombstone's logical shard (its
//! `bagstore_owned` row, see [`crate::ddl::FLOOR_COLUMN`]) to at least the
//! tombstone's version in the same transaction, with that row locked
//! exclusively: a write locks it shared ([`crate::topology::check_owned`])
//! and starts an id that has no row above the floor. Versions of a live
//! entity are untouched (they still go up by exactly one per write), and
//! a move carries the floor with the logical shard.

use schemas::EntityId;
use sqlx::mysql::MySqlPool;
use sqlx::Row;
use std::collections::BTreeMap;

use crate::error::{id_column, OnShard, Result};
use crate::rows::marks;

/// A position in a shard's `(expires_us, added_id)` order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpiryCursor {
    pub expires_us: i64,
    pub added_id: u64,
}

/// An entity found expired: its id, and where the search stood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expired {
    pub id: EntityId,
    pub at: ExpiryCursor,
}

/// Live entities of logical shards this shard owns whose expiry is at or
/// before `now_us`, in `(expires_us, added_id)` order after `after`, along
/// the `entities_expires` key.
pub async fn expired_entities(
    shard: usize,
    pool: &MySqlPool,
    now_us: i64,
    after: Option<ExpiryCursor>,
    limit: usize,
) -> Result<Vec<Expired>> {
    let (e, a) = after.map_or((i64::MIN, 0), |c| (c.expires_us, c.added_id));
    let rows = sqlx::query(
        "SELECT e.id, e.expires_us, e.added_id FROM entities AS e FORCE INDEX (entities_expires) \
         JOIN bagstore_owned AS o ON o.logical = e.logical \
         WHERE e.expires_us <= ? AND e.body IS NOT NULL \
           AND (e.expires_us > ? OR (e.expires_us = ? AND e.added_id > ?)) \
         ORDER BY e.expires_us, e.added_id LIMIT ?",
    )
    .bind(now_us)
    .bind(e)
    .bind(e)
    .bind(a)
    .bind(limit as u64)
    .fetch_all(pool)
    .await
    .on(shard)?;
    rows.iter()
        .map(|r| {
            Ok(Expired {
                id: id_column(shard, r, "id")?,
                at: ExpiryCursor {
                    expires_us: r.try_get("expires_us").on(shard)?,
                    added_id: r.try_get("added_id").on(shard)?,
                },
            })
        })
        .collect()
}

/// A position in a shard's `(updated, added_id)` order, ascending: where
/// the tombstone purge stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PurgeCursor {
    pub updated_us: i64,
    pub added_id: u64,
}

/// One step of the purge's walk: the tombstones among the next `limit`
/// rows updated before `cutoff_us`, and where the walk stands after them.
#[derive(Debug, Clone, Default)]
pub struct PurgeStep {
    /// `(id, logical shard)` of the tombstones seen.
    pub tombstones: Vec<(EntityId, u16)>,
    /// Rows looked at (a step of fewer than `limit` reached the cutoff).
    pub seen: usize,
    pub next: PurgeCursor,
}

/// The next rows (live or not) updated before `cutoff_us`, after `after`,
/// in `(updated, added_id)` order along `entities_updated`. An entity
/// updated later moves past the cursor, so one walk sees each row once per
/// update, and a tombstone becomes old enough only after its last update.
pub async fn walk_for_tombstones(
    shard: usize,
    pool: &MySqlPool,
    after: PurgeCursor,
    cutoff_us: i64,
    limit: usize,
) -> Result<PurgeStep> {
    let rows = sqlx::query(
        "SELECT id, logical, added_id, body IS NULL AS dead, \
         TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated) AS updated_us \
         FROM entities FORCE INDEX (entities_updated) \
         WHERE updated < TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00') \
           AND (updated > TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00') \
                OR (updated = TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00') AND added_id > ?)) \
         ORDER BY updated, added_id LIMIT ?",
    )
    .bind(cutoff_us.max(0))
    .bind(after.updated_us.max(0))
    .bind(after.updated_us.max(0))
    .bind(after.added_id)
    .bind(limit as u64)
    .fetch_all(pool)
    .await
    .on(shard)?;
    let mut step = PurgeStep { seen: rows.len(), next: after, ..PurgeStep::default() };
    for r in &rows {
        if r.try_get::<i64, _>("dead").on(shard)? != 0 {
            step.tombstones.push((id_column(shard, r, "id")?, r.try_get("logical").on(shard)?));
        }
        step.next = PurgeCursor {
            updated_us: r.try_get("updated_us").on(shard)?,
            added_id: r.try_get("added_id").on(shard)?,
        };
    }
    Ok(step)
}

/// What one purge transaction did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Purged {
    /// Tombstones deleted.
    pub deleted: u64,
    /// Logical shards skipped: not owned here (moved away; their rows are
    /// the move's to remove).
    pub not_owned: Vec<u16>,
}

/// Purges `tombstones` (ids with their logical shards) in one transaction:
/// locks the logical shards' ownership rows exclusively (skipping those not
/// owned), then the rows, which must still be tombstones updated before
/// `cutoff_us` (a re-created or newer one stays); raises each logical
/// shard's floor to the highest version deleted; deletes them.
pub async fn purge_tombstones(
    shard: usize,
    pool: &MySqlPool,
    tombstones: &[(EntityId, u16)],
    cutoff_us: i64,
) -> Result<Purged> {
    let mut out = Purged::default();
    if tombstones.is_empty() {
        return Ok(out);
    }
    let mut logicals: Vec<u16> = tombstones.iter().map(|(_, k)| *k).collect();
    logicals.sort_unstable();
    logicals.dedup();
    let mut tx = pool.begin().await.on(shard)?;
    let sql =
        format!("SELECT logical FROM bagstore_owned WHERE logical IN ({}) FOR UPDATE", marks(logicals.len()));
    let mut q = sqlx::query_as::<_, (u16,)>(&sql);
    for k in &logicals {
        q = q.bind(*k);
    }
    let owned: Vec<u16> = q.fetch_all(&mut *tx).await.on(shard)?.into_iter().map(|r| r.0).collect();
    out.not_owned = logicals.iter().copied().filter(|k| !owned.contains(k)).collect();
    let mut ids: Vec<&EntityId> =
        tombstones.iter().filter(|(_, k)| owned.contains(k)).map(|(id, _)| id).collect();
    ids.sort();
    ids.dedup();
    if ids.is_empty() {
        tx.rollback().await.on(shard)?;
        return Ok(out);
    }
    let sql = format!(
        "SELECT id, logical, version FROM entities {} WHERE id IN ({}) AND body IS NULL \
         AND updated < TIMESTAMPADD(MICROSECOND, ?, '1970-01-01 00:00:00') FOR UPDATE",
        crate::entities::BY_ID,
        marks(ids.len())
    );
    let mut q = sqlx::query(&sql);
    for id in &ids {
        q = q.bind(&id.0[..]);
    }
    let dead = q.bind(cutoff_us.max(0)).fetch_all(&mut *tx).await.on(shard)?;
    let mut floors: BTreeMap<u16, u64> = BTreeMap::new();
    let mut gone = Vec::with_capacity(dead.len());
    for r in &dead {
        let logical: u16 = r.try_get("logical").on(shard)?;
        let version: u64 = r.try_get("version").on(shard)?;
        let floor = floors.entry(logical).or_default();
        *floor = (*floor).max(version);
        gone.push(id_column(shard, r, "id")?);
    }
    for (logical, floor) in &floors {
        sqlx::query("UPDATE bagstore_owned SET version_floor = GREATEST(version_floor, ?) WHERE logical = ?")
            .bind(floor)
            .bind(logical)
            .execute(&mut *tx)
            .await
            .on(shard)?;
    }
    if !gone.is_empty() {
        let sql = format!("DELETE FROM entities WHERE id IN ({}) AND body IS NULL", marks(gone.len()));
        let mut q = sqlx::query(&sql);
        for id in &gone {
            q = q.bind(&id.0[..]);
        }
        out.deleted = q.execute(&mut *tx).await.on(shard)?.rows_affected();
    }
    tx.commit().await.on(shard)?;
    Ok(out)
}
