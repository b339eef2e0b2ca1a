//! Many keys of one unique index on one shard at once: what a write of many
//! entities (a batch, a group commit) reserves and settles in one statement
//! or transaction per index and key shard, instead of one per key. A key
//! whose row another entity has goes the one-key way ([`super::reserve`]).

use schemas::index::{IndexKey, IndexSpec};
use schemas::EntityId;
use sqlx::mysql::MySqlArguments;
use sqlx::query::Query;
use sqlx::{MySql, Row};
use std::collections::HashMap;

use super::{key_id, Reserved};
use crate::error::{id_column, OnShard, Result};
use crate::index_rows::{bind_key, row_key};
use crate::rows::marks;
use crate::topology::begin_owned;
use crate::Shards;

/// `(p1, p2, …)` of the index's key columns.
fn key_tuple(spec: &IndexSpec) -> String {
    let cols: Vec<String> = spec.properties.iter().map(|p| format!("`{}`", p.name)).collect();
    format!("({})", cols.join(", "))
}

/// `(k1), (k2), …` placeholders for `n` keys, each `width` values wide.
fn tuples(n: usize, width: usize) -> String {
    vec![format!("({})", marks(width)); n].join(", ")
}

fn bind_keys<'q>(
    mut q: Query<'q, MySql, MySqlArguments>,
    keys: &'q [&IndexKey],
) -> Query<'q, MySql, MySqlArguments> {
    for k in keys {
        q = bind_key(q, k);
    }
    q
}

/// What [`reserve_many`] made of each wanted key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Look {
    /// Settled here: the row is the asker's, or another key of this call
    /// (an earlier owner of the same key) has it.
    Answered(Reserved),
    /// Another entity's row: for the one-key way.
    Contended,
}

/// Reserves `wants` (keys of `spec` whose logical shards `shard` owns,
/// each with the entity asking) under `token` until `until` in one
/// transaction: absent rows inserted, the askers' own rows re-tokened. A
/// key asked twice in `wants` goes to its first asker.
pub async fn reserve_many(
    shards: &Shards,
    shard: usize,
    spec: &IndexSpec,
    wants: &[(IndexKey, EntityId)],
    token: [u8; 16],
    until: i64,
) -> Result<Vec<Look>> {
    let l = shards.logical_shards();
    let mut logicals: Vec<u16> = wants.iter().map(|(k, _)| spec.logical_of_key(k, l)).collect();
    logicals.sort_unstable();
    logicals.dedup();
    let mut tx = begin_owned(shard, shards.pool(shard), &logicals).await?;
    let width = spec.properties.len();
    let keys: Vec<&IndexKey> = wants.iter().map(|(k, _)| k).collect();
    // The unique key named, as `entities::BY_ID` says why; `version`, which
    // that key does not hold, keeps the optimizer from reading the whole
    // key instead of the asked ones.
    let select = format!(
        "SELECT {cols}, entity_id, version FROM `{table}` FORCE INDEX (`{table}_unique`) \
         WHERE {tuple} IN ({list}) FOR UPDATE",
        cols = spec.properties.iter().map(|p| format!("`{}`", p.name)).collect::<Vec<_>>().join(", "),
        table = spec.table,
        tuple = key_tuple(spec),
        list = tuples(keys.len(), width),
    );
    let mut found: HashMap<Vec<u8>, EntityId> = HashMap::new();
    for r in bind_keys(sqlx::query(&select), &keys).fetch_all(&mut *tx).await.on(shard)? {
        if let Some(k) = row_key(shard, spec, &r)? {
            found.insert(key_id(&k), id_column(shard, &r, "entity_id")?);
        }
    }
    // Per key, its first asker here, if it got the row.
    let mut first: HashMap<Vec<u8>, Option<EntityId>> = HashMap::new();
    let (mut insert, mut own) = (Vec::new(), Vec::new());
    let mut looks = Vec::with_capacity(wants.len());
    for (key, owner) in wants {
        let id = key_id(key);
        let look = match (first.get(&id), found.get(&id)) {
            (Some(Some(by)), _) if by == owner => Look::Answered(Reserved::Mine),
            (Some(Some(by)), _) => Look::Answered(Reserved::HeldBy(*by)),
            // Another entity's row: every asker goes the one-key way.
            (Some(None), _) => Look::Contended,
            (None, Some(by)) if by != owner => Look::Contended,
            (None, found) => {
                if found.is_some() {
                    own.push((key, *owner));
                } else {
                    insert.push((key, *owner));
                }
                Look::Answered(Reserved::Mine)
            }
        };
        let got = matches!(look, Look::Answered(Reserved::Mine)).then_some(*owner);
        first.entry(id).or_insert(got);
        looks.push(look);
    }
    if !insert.is_empty() {
        let sql = format!(
            "INSERT INTO `{}` ({}, entity_id, version, logical, token, reserved_until_us) VALUES {}",
            spec.table,
            spec.properties.iter().map(|p| format!("`{}`", p.name)).collect::<Vec<_>>().join(", "),
            tuples(insert.len(), width + 5),
        );
        let mut q = sqlx::query(&sql);
        for (key, owner) in &insert {
            q = bind_key(q, key).bind(&owner.0[..]).bind(0u64).bind(spec.logical_of_key(key, l));
            q = q.bind(&token[..]).bind(until);
        }
        q.execute(&mut *tx).await.on(shard)?;
    }
    if !own.is_empty() {
        let sql = format!(
            "UPDATE `{}` SET token = ?, reserved_until_us = ? WHERE ({}, entity_id) IN ({})",
            spec.table,
            spec.properties.iter().map(|p| format!("`{}`", p.name)).collect::<Vec<_>>().join(", "),
            tuples(own.len(), width + 1),
        );
        let mut q = sqlx::query(&sql).bind(&token[..]).bind(until);
        for (key, owner) in &own {
            q = bind_key(q, key).bind(&owner.0[..]);
        }
        q.execute(&mut *tx).await.on(shard)?;
    }
    tx.commit().await.on(shard)?;
    Ok(looks)
}

/// After a committed write under `token`, on `shard` (by the map when
/// the write ended): its reservations of `held` become held, those of
/// `dropped` are deleted, and `freed` (key, entity) rows held by entities
/// that no longer hold them are deleted. One statement each, without the
/// proof of ownership: each matches only its own rows exactly, so on a
/// shard a move has since emptied it changes nothing, and a row left as
/// it was resolves when its reservation runs out (see the module's
/// protocol).
pub async fn settle_many(
    shards: &Shards,
    shard: usize,
    spec: &IndexSpec,
    token: &[u8],
    held: &[&IndexKey],
    dropped: &[&IndexKey],
    freed: &[(&IndexKey, EntityId)],
) -> Result<()> {
    let pool = shards.pool(shard);
    let width = spec.properties.len();
    let tuple = key_tuple(spec);
    if !held.is_empty() {
        let sql = format!(
            "UPDATE `{}` SET token = NULL, reserved_until_us = NULL WHERE token = ? AND {tuple} IN ({})",
            spec.table,
            tuples(held.len(), width)
        );
        bind_keys(sqlx::query(&sql).bind(token), held).execute(pool).await.on(shard)?;
    }
    if !dropped.is_empty() {
        let sql = format!(
            "DELETE FROM `{}` WHERE token = ? AND {tuple} IN ({})",
            spec.table,
            tuples(dropped.len(), width)
        );
        bind_keys(sqlx::query(&sql).bind(token), dropped).execute(pool).await.on(shard)?;
    }
    if !freed.is_empty() {
        let cols = spec.properties.iter().map(|p| format!("`{}`", p.name)).collect::<Vec<_>>().join(", ");
        let sql = format!(
            "DELETE FROM `{}` WHERE token IS NULL AND ({cols}, entity_id) IN ({})",
            spec.table,
            tuples(freed.len(), width + 1)
        );
        let mut q = sqlx::query(&sql);
        for (key, owner) in freed {
            q = bind_key(q, key).bind(&owner.0[..]);
        }
        q.execute(pool).await.on(shard)?;
    }
    Ok(())
}

/// Whether `token`'s write committed (its claim is on `entity`'s shard):
/// a contender need not wait for a reservation whose write is done.
pub async fn claimed(shards: &Shards, entity: EntityId, token: &[u8]) -> Result<bool> {
    let shard = shards.of_id(&entity);
    let row = sqlx::query("SELECT claimed FROM bagstore_unique_claims WHERE token = ?")
        .bind(token)
        .fetch_optional(shards.pool(shard))
        .await
        .on(shard)?;
    Ok(match row {
        Some(r) => r.try_get::<bool, _>("claimed").on(shard)?,
        None => false,
    })
}
