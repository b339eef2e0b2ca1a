//! Unique indexes: at most one live entity holds each key.
//!
//! A unique index's table has one row per key (its unique key is the key
//! alone), on the shard of the key's logical shard like any index row, so
//! every writer wanting one key meets on one row. The write path writes
//! these rows itself, around the entity's own transaction on another shard:
//!
//! 1. **Reserve.** Before a write gives entity E a key K that E does not
//!    hold, K's row is made E's, pending under the write's token T until
//!    now + `writer.unique_reservation_ms` ([`reserve`]).
//! 2. **Claim.** E's write transaction inserts T into
//!    `bagstore_unique_claims` on E's shard ([`claim`]).
//! 3. **Confirm.** After the commit, K's row drops its token (it is held),
//!    and the rows of keys E no longer holds are deleted ([`settle`],
//!    [`free`]).
//!
//! Another entity's row is taken over only when that entity does not hold
//! K now (its row read on its own shard, expired counting as absent), and
//! while the row is pending only once its reservation has run out, after
//! revoking its token: a `claimed = FALSE` row under the same primary key
//! as the claim, so of a claim and a revocation exactly one is inserted,
//! and a revoked token's write can never commit. Nothing else can give E
//! the key meanwhile: a write of E newly holding K must claim a token the
//! row holds, and every change of the row's token or owner is a
//! compare-and-set on both. So a live entity's key row is never missing
//! and never another's; a row whose writer died (an orphan) blocks others
//! only until its reservation runs out.

use schemas::codec;
use schemas::expiry;
use schemas::index::{IndexKey, IndexSpec};
use schemas::EntityId;
use sqlx::{MySql, MySqlConnection, Row, Transaction};
use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

pub mod many;
pub mod sweep;

use crate::catalog;
use crate::entities;
use crate::error::{id_column, OnShard, Result, StoreError};
use crate::index_rows::{bind_key, key_bytes};
use crate::topology::begin_owned;
use crate::{Shards, StaleMapRetry};

/// One unique index a writer maintains, and whether it refuses writes
/// (only an ACTIVE one does; while it is built, its rows are kept but a
/// clash is let through for the backfill to find).
#[derive(Debug, Clone, PartialEq)]
pub struct UniqueSpec {
    pub spec: IndexSpec,
    pub enforced: bool,
}

/// The unique indexes of the catalog, as last loaded: read before the
/// first write, then again whenever its owner reloads it (the writer every
/// second, see `writer::unique`).
#[derive(Debug, Default)]
pub struct UniqueCatalog {
    current: RwLock<Option<Arc<Vec<UniqueSpec>>>>,
}

impl UniqueCatalog {
    /// The unique indexes, read from the catalog if never read yet.
    pub async fn get(&self, shards: &Shards) -> Result<Arc<Vec<UniqueSpec>>> {
        if let Some(specs) = self.current.read().expect("not poisoned").clone() {
            return Ok(specs);
        }
        self.reload(shards).await
    }

    pub fn set(&self, specs: Vec<UniqueSpec>) -> Arc<Vec<UniqueSpec>> {
        let specs = Arc::new(specs);
        *self.current.write().expect("not poisoned") = Some(specs.clone());
        specs
    }

    /// Reads the catalog again: every unique index not being dropped.
    pub async fn reload(&self, shards: &Shards) -> Result<Arc<Vec<UniqueSpec>>> {
        let metas = catalog::list_index_meta(shards).await?;
        Ok(self.set(of_catalog(metas)))
    }
}

/// The unique indexes among `metas`: those not being dropped, enforced
/// when ACTIVE.
pub fn of_catalog(metas: Vec<catalog::IndexMeta>) -> Vec<UniqueSpec> {
    use schemas::index::IndexState;
    metas
        .into_iter()
        .filter(|m| m.spec.unique && m.state != IndexState::Dropping)
        .map(|m| UniqueSpec { enforced: m.state == IndexState::Active, spec: m.spec })
        .collect()
}

/// How often a writer reads the unique indexes from the catalog.
pub const RELOAD_EVERY: Duration = Duration::from_secs(1);

/// How long after a unique index is registered every running writer keeps
/// its rows: a backfill waits this long before its scan, so no write it
/// does not see lacks its row.
pub const WRITERS_KNOW_WITHIN: Duration = Duration::from_secs(3);

/// What a reservation found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved {
    /// The row is the asker's, under its token.
    Mine,
    /// Another entity holds the key (or its write still may, after the
    /// reservation's wait ran out).
    HeldBy(EntityId),
}

/// A key row as the reservation read it.
#[derive(Debug, Clone)]
struct KeyRow {
    owner: EntityId,
    token: Option<Vec<u8>>,
    reserved_until_us: Option<i64>,
}

/// How long a reservation waits for another writer's pending reservation
/// of the same key to be confirmed or released, beyond its own bound.
const BUSY_SLACK: Duration = Duration::from_secs(5);

/// Makes `key`'s row `owner`'s under `token`, pending for `hold_us`: see
/// the module's protocol. `expiry` is `expiry.property`.
pub async fn reserve(
    shards: &Shards,
    expiry: Option<&str>,
    spec: &IndexSpec,
    key: &IndexKey,
    owner: EntityId,
    token: [u8; 16],
    hold_us: i64,
) -> Result<Reserved> {
    let deadline = Instant::now() + Duration::from_micros(hold_us.max(0) as u64) + BUSY_SLACK;
    let mut stale = StaleMapRetry::new(Duration::from_secs(10));
    let mut pause = Duration::from_millis(1);
    loop {
        let logical = spec.logical_of_key(key, shards.logical_shards());
        let shard = shards.of_logical(logical);
        let until = schemas::clock::now_micros().saturating_add(hold_us);
        let found = match try_reserve(shards, shard, logical, spec, key, owner, token, until).await {
            Ok(found) => found,
            Err(e) if e.is_stale_map() && stale.again(shards).await => continue,
            Err(e) if e.is_retryable_conflict() && Instant::now() < deadline => continue,
            Err(e) => return Err(e),
        };
        let Some(row) = found else { return Ok(Reserved::Mine) };
        let now = schemas::clock::now_micros();
        if let Some(t) = row.token.as_ref().filter(|_| row.reserved_until_us.is_some_and(|u| now < u)) {
            // Another write's reservation runs: wait for its outcome,
            // unless its write has committed already.
            if !many::claimed(shards, row.owner, t).await? {
                if Instant::now() >= deadline {
                    return Ok(Reserved::HeldBy(row.owner));
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(50));
                continue;
            }
        }
        if let Some(t) = &row.token {
            revoke(shards, row.owner, t).await?;
        }
        if holds(shards, expiry, row.owner, spec, key).await? {
            if let Some(t) = &row.token {
                confirm(shards, spec, key, row.owner, t).await?;
            }
            return Ok(Reserved::HeldBy(row.owner));
        }
        if take_over(shards, shard, logical, spec, key, &row, owner, token, until).await? {
            return Ok(Reserved::Mine);
        }
        // The row changed since it was read: look again.
    }
}

pub(crate) fn key_equals(spec: &IndexSpec) -> String {
    spec.properties.iter().map(|p| format!("`{}` = ?", p.name)).collect::<Vec<_>>().join(" AND ")
}

/// One look at the key's row: made `owner`'s (inserted, or re-tokened when
/// already its) and None, or the row of another entity, left as it is.
#[allow(clippy::too_many_arguments)]
async fn try_reserve(
    shards: &Shards,
    shard: usize,
    logical: u16,
    spec: &IndexSpec,
    key: &IndexKey,
    owner: EntityId,
    token: [u8; 16],
    until: i64,
) -> Result<Option<KeyRow>> {
    let mut tx = begin_owned(shard, shards.pool(shard), &[logical]).await?;
    let select = format!(
        "SELECT entity_id, token, reserved_until_us FROM `{}` WHERE {} FOR UPDATE",
        spec.table,
        key_equals(spec)
    );
    let found = bind_key(sqlx::query(&select), key).fetch_optional(&mut *tx).await.on(shard)?;
    let row = match found {
        Some(r) => Some(KeyRow {
            owner: id_column(shard, &r, "entity_id")?,
            token: r.try_get("token").on(shard)?,
            reserved_until_us: r.try_get("reserved_until_us").on(shard)?,
        }),
        None => None,
    };
    match row {
        Some(row) if row.owner != owner => return Ok(Some(row)),
        Some(_) => {
            let sql = format!(
                "UPDATE `{}` SET token = ?, reserved_until_us = ? WHERE {}",
                spec.table,
                key_equals(spec)
            );
            let q = sqlx::query(&sql).bind(&token[..]).bind(until);
            bind_key(q, key).execute(&mut *tx).await.on(shard)?;
        }
        None => {
            let mut cols: Vec<String> = spec.properties.iter().map(|p| format!("`{}`", p.name)).collect();
            cols.extend(["entity_id", "version", "logical", "token", "reserved_until_us"].map(String::from));
            let sql = format!(
                "INSERT INTO `{}` ({}) VALUES ({})",
                spec.table,
                cols.join(", "),
                crate::rows::marks(cols.len())
            );
            let q = bind_key(sqlx::query(&sql), key);
            q.bind(&owner.0[..])
                .bind(0u64)
                .bind(logical)
                .bind(&token[..])
                .bind(until)
                .execute(&mut *tx)
                .await
                .on(shard)?;
        }
    }
    tx.commit().await.on(shard)?;
    Ok(None)
}

/// Revokes `token` on its entity's shard: a write under it can no longer
/// commit (its claim would clash). Already claimed: nothing changes.
pub(crate) async fn revoke(shards: &Shards, entity: EntityId, token: &[u8]) -> Result<()> {
    on_owner(shards, |s| s.logical_of_id(&entity), |shard, mut tx| async move {
        sqlx::query("INSERT IGNORE INTO bagstore_unique_claims (token, claimed, recorded_us) VALUES (?, FALSE, ?)")
            .bind(token)
            .bind(schemas::clock::now_micros())
            .execute(&mut *tx)
            .await
            .on(shard)?;
        Ok(((), tx))
    })
    .await
}

/// Runs `work` in one transaction on the shard of the logical shard
/// `logical` names, under the proof that shard owns it, and commits; again
/// on the new owner after a stale map (the map is read again each time).
/// `work` is given the shard and the transaction, and gives the
/// transaction back with its result.
async fn on_owner<T, F>(
    shards: &Shards,
    logical: impl Fn(&Shards) -> u16,
    mut work: impl FnMut(usize, Transaction<'static, MySql>) -> F,
) -> Result<T>
where
    F: Future<Output = Result<(T, Transaction<'static, MySql>)>>,
{
    let mut stale = StaleMapRetry::new(Duration::from_secs(10));
    loop {
        let logical = logical(shards);
        let shard = shards.of_logical(logical);
        let done = async {
            let tx = begin_owned(shard, shards.pool(shard), &[logical]).await?;
            let (out, tx) = work(shard, tx).await?;
            tx.commit().await.on(shard)?;
            Ok::<_, StoreError>(out)
        }
        .await;
        match done {
            Err(e) if e.is_stale_map() && stale.again(shards).await => continue,
            other => return other,
        }
    }
}

/// Whether `entity` holds `key` now: live, not expired, and its bag yields
/// the key (read on its own shard, under the proof it owns it).
pub async fn holds(
    shards: &Shards,
    expiry: Option<&str>,
    entity: EntityId,
    spec: &IndexSpec,
    key: &IndexKey,
) -> Result<bool> {
    let record = on_owner(
        shards,
        |s| s.logical_of_id(&entity),
        |shard, mut tx| async move {
            let found = entities::read_entities_any(shard, &mut *tx, &[entity]).await?;
            Ok((found.records.into_iter().next(), tx))
        },
    )
    .await?;
    let Some(bag) = record.and_then(|r| r.body).and_then(|b| codec::decode_body(&b).ok()) else {
        return Ok(false);
    };
    if expiry::bag_is_expired(&bag, expiry, schemas::clock::now_micros()) {
        return Ok(false);
    }
    let want = key_bytes(key);
    Ok(spec.keys(&bag).iter().any(|k| key_bytes(k) == want))
}

/// Gives the row to `owner` under `token` if it is still as `row` read it.
#[allow(clippy::too_many_arguments)]
async fn take_over(
    shards: &Shards,
    shard: usize,
    logical: u16,
    spec: &IndexSpec,
    key: &IndexKey,
    row: &KeyRow,
    owner: EntityId,
    token: [u8; 16],
    until: i64,
) -> Result<bool> {
    let mut tx = begin_owned(shard, shards.pool(shard), &[logical]).await?;
    let sql = format!(
        "UPDATE `{}` SET entity_id = ?, version = 0, entity_added_id = NULL, token = ?, \
         reserved_until_us = ? WHERE {} AND entity_id = ? AND token <=> ?",
        spec.table,
        key_equals(spec)
    );
    let q = sqlx::query(&sql).bind(&owner.0[..]).bind(&token[..]).bind(until);
    let changed = bind_key(q, key)
        .bind(&row.owner.0[..])
        .bind(row.token.as_deref())
        .execute(&mut *tx)
        .await
        .on(shard)?
        .rows_affected();
    tx.commit().await.on(shard)?;
    Ok(changed == 1)
}

/// Runs `sql` (a statement on `spec`'s table ending in the key's equality,
/// then binds from `more`) on the key's shard, under the proof it owns
/// the key's logical shard; again on the owner after a stale map.
pub(crate) async fn on_key_shard(
    shards: &Shards,
    spec: &IndexSpec,
    key: &IndexKey,
    sql: &str,
    more: &[Option<&[u8]>],
) -> Result<u64> {
    on_owner(
        shards,
        |s| spec.logical_of_key(key, s.logical_shards()),
        |shard, mut tx| async move {
            let mut q = bind_key(sqlx::query(sql), key);
            for b in more {
                q = q.bind(*b);
            }
            let n = q.execute(&mut *tx).await.on(shard)?.rows_affected();
            Ok((n, tx))
        },
    )
    .await
}

/// The reservation `token` of `owner` becomes a held key (the write
/// committed, or the entity held the key already).
pub async fn confirm(
    shards: &Shards,
    spec: &IndexSpec,
    key: &IndexKey,
    owner: EntityId,
    token: &[u8],
) -> Result<()> {
    let sql = format!(
        "UPDATE `{}` SET token = NULL, reserved_until_us = NULL WHERE {} AND entity_id = ? AND token = ?",
        spec.table,
        key_equals(spec)
    );
    on_key_shard(shards, spec, key, &sql, &[Some(&owner.0[..]), Some(token)]).await.map(drop)
}

/// After a write under `token`: its reservation of `key` for `owner`
/// becomes held when `owner` holds the key now, else it is deleted.
pub async fn settle(
    shards: &Shards,
    spec: &IndexSpec,
    key: &IndexKey,
    owner: EntityId,
    token: &[u8],
    held: bool,
) -> Result<()> {
    if held {
        return confirm(shards, spec, key, owner, token).await;
    }
    let sql =
        format!("DELETE FROM `{}` WHERE {} AND entity_id = ? AND token = ?", spec.table, key_equals(spec));
    on_key_shard(shards, spec, key, &sql, &[Some(&owner.0[..]), Some(token)]).await.map(drop)
}

/// Deletes `owner`'s held row of a key it no longer holds (a pending
/// reservation of a later write of it is left to that write).
pub async fn free(shards: &Shards, spec: &IndexSpec, key: &IndexKey, owner: EntityId) -> Result<()> {
    let sql = format!(
        "DELETE FROM `{}` WHERE {} AND entity_id = ? AND token IS NULL",
        spec.table,
        key_equals(spec)
    );
    on_key_shard(shards, spec, key, &sql, &[Some(&owner.0[..])]).await.map(drop)
}

/// In a write transaction on `shard`: claims `token`. False when it was
/// revoked (a contender took a reservation of it over): the transaction
/// must not commit.
pub async fn claim(shard: usize, conn: &mut MySqlConnection, token: &[u8], now: i64) -> Result<bool> {
    let inserted = sqlx::query(
        "INSERT IGNORE INTO bagstore_unique_claims (token, claimed, recorded_us) VALUES (?, TRUE, ?)",
    )
    .bind(token)
    .bind(now)
    .execute(&mut *conn)
    .await
    .on(shard)?
    .rows_affected();
    Ok(inserted == 1)
}

/// What [`hold`] found of an entity's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// The key's row is the entity's (it was, or is now).
    Kept,
    /// The entity no longer holds the key: nothing to keep.
    NotHeld,
    /// Another live entity holds the key too (data written before the
    /// index was enforced).
    Clash(EntityId),
}

/// The backfill's step: makes sure `owner`, found holding `key`, has its
/// row, unless another entity holding the key has it (a clash).
pub async fn hold(
    shards: &Shards,
    expiry: Option<&str>,
    spec: &IndexSpec,
    key: &IndexKey,
    owner: EntityId,
    hold_us: i64,
) -> Result<Held> {
    if holder(shards, spec, key).await? == Some(owner) {
        return Ok(Held::Kept);
    }
    let token = new_token();
    let reserved = reserve(shards, expiry, spec, key, owner, token, hold_us).await?;
    let held = holds(shards, expiry, owner, spec, key).await?;
    match reserved {
        Reserved::Mine => {
            settle(shards, spec, key, owner, &token, held).await?;
            Ok(if held { Held::Kept } else { Held::NotHeld })
        }
        Reserved::HeldBy(other) if held => Ok(Held::Clash(other)),
        Reserved::HeldBy(_) => Ok(Held::NotHeld),
    }
}

/// Who `key`'s row names now, if it has one.
pub async fn holder(shards: &Shards, spec: &IndexSpec, key: &IndexKey) -> Result<Option<EntityId>> {
    let logical = spec.logical_of_key(key, shards.logical_shards());
    let shard = shards.of_logical(logical);
    let sql = format!("SELECT entity_id FROM `{}` WHERE {}", spec.table, key_equals(spec));
    let row = bind_key(sqlx::query(&sql), key).fetch_optional(shards.pool(shard)).await.on(shard)?;
    row.map(|r| id_column(shard, &r, "entity_id")).transpose()
}

/// A new reservation token.
pub fn new_token() -> [u8; 16] {
    EntityId::random().0
}

/// The key's values as comparable bytes (see `index_rows`).
pub fn key_id(key: &IndexKey) -> Vec<u8> {
    key_bytes(key)
}
