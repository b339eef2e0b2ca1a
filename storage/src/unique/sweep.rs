//! The cleaner's side of unique key rows: reservations that ran out (their
//! writer died or stalled) resolved, and held rows whose entity no longer
//! holds the key (a write whose settling failed) removed. Each removal is
//! checked on the entity's own shard first, so a live holder's row is
//! never removed.

use schemas::index::{IndexKey, IndexSpec};
use schemas::EntityId;
use sqlx::{MySqlPool, Row};

use super::{confirm, free, holds, key_equals, revoke};
use crate::error::{id_column, OnShard, Result};
use crate::index_rows::row_key;
use crate::Shards;

/// A key row the sweep looks at.
#[derive(Debug, Clone)]
pub struct KeyRow {
    pub key: IndexKey,
    pub owner: EntityId,
    /// Its reservation's token; None once held.
    pub token: Option<Vec<u8>>,
}

/// What the sweep did to one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// The entity holds the key: the row stays (now held).
    Kept,
    /// The entity does not hold it: the row is gone.
    Removed,
}

fn columns(spec: &IndexSpec) -> String {
    spec.properties.iter().map(|p| format!("`{}`", p.name)).collect::<Vec<_>>().join(", ")
}

fn key_rows(shard: usize, spec: &IndexSpec, rows: &[sqlx::mysql::MySqlRow]) -> Result<Vec<KeyRow>> {
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let Some(key) = row_key(shard, spec, r)? else { continue };
        out.push(KeyRow {
            key,
            owner: id_column(shard, r, "entity_id")?,
            token: r.try_get("token").on(shard)?,
        });
    }
    Ok(out)
}

/// Up to `limit` rows of this shard whose reservation ran out before `now_us`.
pub async fn ran_out(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    now_us: i64,
    limit: usize,
) -> Result<Vec<KeyRow>> {
    let sql = format!(
        "SELECT {}, entity_id, token FROM `{}` WHERE token IS NOT NULL AND reserved_until_us < ? LIMIT ?",
        columns(spec),
        spec.table
    );
    let rows = sqlx::query(&sql).bind(now_us).bind(limit as u64).fetch_all(pool).await.on(shard)?;
    key_rows(shard, spec, &rows)
}

/// Up to `limit` held rows of this shard, by entity id after `after`.
pub async fn held_after(
    shard: usize,
    pool: &MySqlPool,
    spec: &IndexSpec,
    after: Option<EntityId>,
    limit: usize,
) -> Result<Vec<KeyRow>> {
    let sql = format!(
        "SELECT {}, entity_id, token FROM `{}` WHERE token IS NULL AND entity_id > ? ORDER BY entity_id LIMIT ?",
        columns(spec),
        spec.table
    );
    let after = after.map_or([0u8; 16], |id| id.0);
    let rows = sqlx::query(&sql).bind(&after[..]).bind(limit as u64).fetch_all(pool).await.on(shard)?;
    key_rows(shard, spec, &rows)
}

/// Resolves a row whose reservation ran out (its token revoked first, so
/// its write can no longer commit), or a held row: kept (held) when its
/// entity holds the key, else removed.
pub async fn resolve(
    shards: &Shards,
    expiry: Option<&str>,
    spec: &IndexSpec,
    row: &KeyRow,
) -> Result<Resolved> {
    if let Some(t) = &row.token {
        revoke(shards, row.owner, t).await?;
    }
    if holds(shards, expiry, row.owner, spec, &row.key).await? {
        if let Some(t) = &row.token {
            confirm(shards, spec, &row.key, row.owner, t).await?;
        }
        return Ok(Resolved::Kept);
    }
    match &row.token {
        Some(t) => {
            let sql = format!(
                "DELETE FROM `{}` WHERE {} AND entity_id = ? AND token = ?",
                spec.table,
                key_equals(spec)
            );
            super::on_key_shard(shards, spec, &row.key, &sql, &[Some(&row.owner.0[..]), Some(t)]).await?;
        }
        None => free(shards, spec, &row.key, row.owner).await?,
    }
    Ok(Resolved::Removed)
}

/// Deletes claims older than `claims_before_us` and revocations older
/// than `revoked_before_us`. A claim only spares a contender the wait for a
/// write that is done: once it is gone, a revocation of its token is
/// harmless, as the contender then reads whether the entity holds the key.
/// A revocation stops a write that may still be running; by the time it
/// goes no write under its token is (a write gives up its try once its
/// reservation ran out: `Keys::until_us` in the write path).
pub async fn purge_claims(
    shard: usize,
    pool: &MySqlPool,
    claims_before_us: i64,
    revoked_before_us: i64,
    limit: usize,
) -> Result<u64> {
    sqlx::query(
        "DELETE FROM bagstore_unique_claims WHERE (claimed AND recorded_us < ?) OR (NOT claimed AND recorded_us < ?) \
         LIMIT ?",
    )
    .bind(claims_before_us)
    .bind(revoked_before_us)
    .bind(limit as u64)
    .execute(pool)
    .await
    .on(shard)
    .map(|r| r.rows_affected())
}
