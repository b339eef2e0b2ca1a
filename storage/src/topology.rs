//! The cluster's map in the database, and the ownership each transaction
//! proves.
//!
//! The metadata shard holds the map (`bagstore_cluster`: the number of
//! logical shards and the epoch; `bagstore_physical`: the physical shards;
//! `bagstore_map`: logical → physical) and the processes' last known epochs
//! (`bagstore_processes`). Every physical shard holds who it is
//! (`bagstore_shard`: its name and the epoch of the last change that
//! touched it) and what it owns (`bagstore_owned`: one row per logical
//! shard).
//!
//! Ownership, not the map, is what a write trusts: a transaction that
//! writes rows of logical shards first reads their `bagstore_owned` rows
//! with a shared lock ([`check_owned`]). A cutover takes those rows
//! exclusively and deletes them, so a write that started before waits for
//! it, and one that comes after finds it does not own them, reloads the map
//! and goes to the new owner. A read checks the shard's epoch
//! ([`shard_epoch`]) against its map instead: a mismatch means the map it
//! routed with is out of date.

use schemas::topology::{PhysicalId, PhysicalShard, Replica, Topology};
use sqlx::mysql::MySqlPool;
use sqlx::{MySqlConnection, Row};
use std::collections::HashMap;

use crate::error::{OnShard, Result, StoreError};
use crate::rows::{marks, Rows, KEYS_PER_STATEMENT};

/// The metadata shard: physical shard 0, the first of the cluster. It holds
/// the map (and the index catalog) and is never removed.
pub const META_SHARD: usize = 0;

/// Who a physical shard's database says it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub name: String,
    pub physical: PhysicalId,
    pub epoch: u64,
}

/// The identity recorded in a shard's database; `None` for a database that
/// is not (yet) part of a cluster.
pub async fn identity(shard: usize, pool: &MySqlPool) -> Result<Option<Identity>> {
    let mut conn = pool.acquire().await.on(shard)?;
    identity_on(shard, &mut conn).await
}

/// [`identity`] on a connection of its own (a server probed outside the
/// pools, when a process looks for the primary among its seeds).
pub async fn identity_on(shard: usize, conn: &mut MySqlConnection) -> Result<Option<Identity>> {
    let exists: (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'bagstore_shard'",
    )
    .fetch_one(&mut *conn)
    .await
    .on(shard)?;
    if exists.0 == 0 {
        return Ok(None);
    }
    let row = sqlx::query("SELECT name, physical, epoch FROM bagstore_shard WHERE id = 1")
        .fetch_optional(&mut *conn)
        .await
        .on(shard)?;
    row.map(|r| {
        Ok(Identity {
            name: r.try_get("name").on(shard)?,
            physical: r.try_get("physical").on(shard)?,
            epoch: r.try_get("epoch").on(shard)?,
        })
    })
    .transpose()
}

/// Whether this database holds a cluster's map (it is the metadata shard).
pub async fn holds_map(shard: usize, pool: &MySqlPool) -> Result<bool> {
    let (n,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'bagstore_cluster'",
    )
    .fetch_one(pool)
    .await
    .on(shard)?;
    if n == 0 {
        return Ok(false);
    }
    let (rows,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM bagstore_cluster").fetch_one(pool).await.on(shard)?;
    Ok(rows > 0)
}

/// The map, from the metadata shard; `None` before the cluster exists.
pub async fn load(meta: &MySqlPool) -> Result<Option<Topology>> {
    let s = META_SHARD;
    let Some(cluster) = sqlx::query("SELECT logical_shards, epoch FROM bagstore_cluster WHERE id = 1")
        .fetch_optional(meta)
        .await
        .on(s)?
    else {
        return Ok(None);
    };
    let logical_shards: u16 = cluster.try_get("logical_shards").on(s)?;
    let epoch: u64 = cluster.try_get("epoch").on(s)?;
    let shards = load_physical(meta).await?;
    let mut owners = vec![PhysicalId::MAX; logical_shards as usize];
    for r in sqlx::query("SELECT logical, physical FROM bagstore_map").fetch_all(meta).await.on(s)? {
        let k: u16 = r.try_get("logical").on(s)?;
        if let Some(slot) = owners.get_mut(k as usize) {
            *slot = r.try_get("physical").on(s)?;
        }
    }
    if owners.contains(&PhysicalId::MAX) {
        return Err(StoreError::BadTopology("the map lacks some logical shards".into()));
    }
    let replicas = load_replicas(meta).await?;
    Ok(Some(Topology { logical_shards, epoch, shards, owners, replicas }))
}

/// The registered physical shards.
async fn load_physical(meta: &MySqlPool) -> Result<Vec<PhysicalShard>> {
    let s = META_SHARD;
    // A metadata shard `migrate` has not given `failovers` yet reads as
    // none happened (until it runs, nothing can fail over).
    let rows = match sqlx::query("SELECT id, name, address, epoch, failovers FROM bagstore_physical ORDER BY id")
        .fetch_all(meta)
        .await
        .on(s)
    {
        Err(e) if e.mysql_number() == Some(1054) => sqlx::query(
            "SELECT id, name, address, epoch, CAST(0 AS UNSIGNED) AS failovers FROM bagstore_physical ORDER BY id",
        )
        .fetch_all(meta)
        .await
        .on(s)?,
        other => other?,
    };
    rows.iter()
        .map(|r| {
            Ok(PhysicalShard {
                id: r.try_get("id").on(s)?,
                name: r.try_get("name").on(s)?,
                address: r.try_get("address").on(s)?,
                epoch: r.try_get("epoch").on(s)?,
                failovers: r.try_get("failovers").on(s)?,
            })
        })
        .collect()
}

/// The registered replicas; none on a metadata shard `migrate` has not
/// given the table yet.
async fn load_replicas(meta: &MySqlPool) -> Result<Vec<Replica>> {
    let rows =
        sqlx::query("SELECT physical, address FROM bagstore_replicas ORDER BY physical, added, address")
            .fetch_all(meta)
            .await;
    let rows = match rows.on(META_SHARD) {
        Ok(rows) => rows,
        Err(e) if e.mysql_number() == Some(1146) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    rows.iter()
        .map(|r| {
            Ok(Replica {
                physical: r.try_get("physical").on(META_SHARD)?,
                address: r.try_get("address").on(META_SHARD)?,
            })
        })
        .collect()
}

/// Records a new cluster's map on the metadata shard (in one transaction).
pub async fn create(meta: &MySqlPool, t: &Topology) -> Result<()> {
    let s = META_SHARD;
    let mut tx = meta.begin().await.on(s)?;
    sqlx::query("INSERT INTO bagstore_cluster (id, logical_shards, epoch) VALUES (1, ?, ?)")
        .bind(t.logical_shards)
        .bind(t.epoch)
        .execute(&mut *tx)
        .await
        .on(s)?;
    for p in &t.shards {
        insert_physical(&mut tx, p).await?;
    }
    let logicals: Vec<u16> = (0..t.logical_shards).collect();
    let map = Rows::new("INSERT INTO bagstore_map (logical, physical) VALUES ", "(?, ?)", "")
        .at_most(KEYS_PER_STATEMENT);
    for st in map.statements(&logicals) {
        st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k).bind(t.owner(*k))).execute(&mut *tx).await.on(s)?;
    }
    tx.commit().await.on(s)
}

async fn insert_physical(conn: &mut MySqlConnection, p: &PhysicalShard) -> Result<()> {
    sqlx::query("INSERT INTO bagstore_physical (id, name, address, epoch) VALUES (?, ?, ?, ?)")
        .bind(p.id)
        .bind(&p.name)
        .bind(&p.address)
        .bind(p.epoch)
        .execute(conn)
        .await
        .on(META_SHARD)?;
    Ok(())
}

/// Registers a new physical shard (owning nothing yet) and bumps the epoch,
/// so running processes notice it on their next reload.
pub async fn register(meta: &MySqlPool, name: &str, address: &str) -> Result<PhysicalShard> {
    let s = META_SHARD;
    let mut tx = meta.begin().await.on(s)?;
    let (epoch,): (u64,) = sqlx::query_as("SELECT epoch FROM bagstore_cluster WHERE id = 1 FOR UPDATE")
        .fetch_one(&mut *tx)
        .await
        .on(s)?;
    let (next,): (u32,) =
        sqlx::query_as("SELECT CAST(COALESCE(MAX(id) + 1, 0) AS UNSIGNED) FROM bagstore_physical")
            .fetch_one(&mut *tx)
            .await
            .on(s)?;
    let p = PhysicalShard {
        id: next,
        name: name.to_string(),
        address: address.to_string(),
        epoch: epoch + 1,
        failovers: 0,
    };
    insert_physical(&mut tx, &p).await?;
    sqlx::query("UPDATE bagstore_cluster SET epoch = ? WHERE id = 1")
        .bind(epoch + 1)
        .execute(&mut *tx)
        .await
        .on(s)?;
    tx.commit().await.on(s)?;
    Ok(p)
}

/// Registers a replica of physical shard `physical` (an address without
/// password) and raises the map's epoch, so running processes reload the
/// map and see it. Idempotent.
pub async fn add_replica(meta: &MySqlPool, physical: PhysicalId, address: &str) -> Result<()> {
    let s = META_SHARD;
    let mut tx = meta.begin().await.on(s)?;
    sqlx::query("INSERT IGNORE INTO bagstore_replicas (physical, address) VALUES (?, ?)")
        .bind(physical)
        .bind(address)
        .execute(&mut *tx)
        .await
        .on(s)?;
    sqlx::query("UPDATE bagstore_cluster SET epoch = epoch + 1 WHERE id = 1")
        .execute(&mut *tx)
        .await
        .on(s)?;
    tx.commit().await.on(s)
}

/// Records a change of physical shard `physical`'s primary, in one
/// transaction on `meta` (a connection to the metadata shard's primary,
/// which is `new_address` itself when the metadata shard is the one that
/// changed): the shard's address becomes `new_address`, its epoch at
/// least `epoch` (the one the new primary was given, see
/// [`raise_shard_epoch`]), its `failovers` count rises (running processes move the shard's connections when they
/// see it, see the shards module), the new primary leaves the replicas and
/// `old_address` joins them, and the map's epoch rises so every process
/// reloads it.
pub async fn switch_primary(
    meta: &mut MySqlConnection,
    physical: PhysicalId,
    new_address: &str,
    old_address: &str,
    epoch: u64,
) -> Result<()> {
    let s = META_SHARD;
    sqlx::query("BEGIN").execute(&mut *meta).await.on(s)?;
    let work = async {
        // Only from the primary the caller replaced: two coordinators that
        // both promoted (they cannot, see the failover crate; this is the
        // last guard) record one change, and the second learns it.
        let changed = sqlx::query(
            "UPDATE bagstore_physical SET address = ?, epoch = GREATEST(epoch, ?), failovers = failovers + 1 \
             WHERE id = ? AND address = ?",
        )
        .bind(new_address)
        .bind(epoch)
        .bind(physical)
        .bind(old_address)
        .execute(&mut *meta)
        .await
        .on(s)?;
        if changed.rows_affected() == 0 {
            return Err(StoreError::BadTopology(format!(
                "physical shard {physical}'s primary is no longer {old_address} in the map: another \
                 switchover or failover recorded a change first"
            )));
        }
        sqlx::query("DELETE FROM bagstore_replicas WHERE physical = ? AND address = ?")
            .bind(physical)
            .bind(new_address)
            .execute(&mut *meta)
            .await
            .on(s)?;
        sqlx::query("INSERT IGNORE INTO bagstore_replicas (physical, address) VALUES (?, ?)")
            .bind(physical)
            .bind(old_address)
            .execute(&mut *meta)
            .await
            .on(s)?;
        sqlx::query("UPDATE bagstore_cluster SET epoch = epoch + 1 WHERE id = 1")
            .execute(&mut *meta)
            .await
            .on(s)?;
        sqlx::query("COMMIT").execute(&mut *meta).await.on(s)?;
        Ok(())
    };
    let done: Result<()> = work.await;
    if done.is_err() {
        let _ = sqlx::query("ROLLBACK").execute(&mut *meta).await;
    }
    done
}

/// Unregisters a replica (and raises the map's epoch); false if it was not
/// registered.
pub async fn remove_replica(meta: &MySqlPool, physical: PhysicalId, address: &str) -> Result<bool> {
    let s = META_SHARD;
    let mut tx = meta.begin().await.on(s)?;
    let gone = sqlx::query("DELETE FROM bagstore_replicas WHERE physical = ? AND address = ?")
        .bind(physical)
        .bind(address)
        .execute(&mut *tx)
        .await
        .on(s)?
        .rows_affected();
    if gone > 0 {
        sqlx::query("UPDATE bagstore_cluster SET epoch = epoch + 1 WHERE id = 1")
            .execute(&mut *tx)
            .await
            .on(s)?;
    }
    tx.commit().await.on(s)?;
    Ok(gone > 0)
}

/// Unregisters a physical shard that owns nothing any more.
pub async fn unregister(meta: &MySqlPool, id: PhysicalId) -> Result<()> {
    let s = META_SHARD;
    let mut tx = meta.begin().await.on(s)?;
    let (owned,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM bagstore_map WHERE physical = ?")
        .bind(id)
        .fetch_one(&mut *tx)
        .await
        .on(s)?;
    if owned > 0 {
        return Err(StoreError::BadTopology(format!(
            "physical shard {id} still owns {owned} logical shards"
        )));
    }
    sqlx::query("DELETE FROM bagstore_physical WHERE id = ?").bind(id).execute(&mut *tx).await.on(s)?;
    sqlx::query("UPDATE bagstore_cluster SET epoch = epoch + 1 WHERE id = 1")
        .execute(&mut *tx)
        .await
        .on(s)?;
    tx.commit().await.on(s)
}

/// Makes a database physical shard `physical` named `name` (idempotent for
/// the same name; refuses a database that is another shard already).
pub async fn claim_identity(
    shard: usize,
    pool: &MySqlPool,
    name: &str,
    physical: PhysicalId,
    epoch: u64,
) -> Result<()> {
    for ddl in [crate::ddl::shard_identity(), crate::ddl::owned()] {
        sqlx::query(&ddl).execute(pool).await.on(shard)?;
    }
    sqlx::query("INSERT IGNORE INTO bagstore_shard (id, name, physical, epoch) VALUES (1, ?, ?, ?)")
        .bind(name)
        .bind(physical)
        .bind(epoch)
        .execute(pool)
        .await
        .on(shard)?;
    match identity(shard, pool).await? {
        Some(me) if me.name == name && me.physical == physical => Ok(()),
        Some(me) => Err(StoreError::BadTopology(format!(
            "this database is already physical shard {:?} (id {}), not {name:?}",
            me.name, me.physical
        ))),
        None => Err(StoreError::BadTopology("the shard identity did not stick".into())),
    }
}

/// Makes a removed shard's database a plain database again: no identity,
/// nothing owned (it can be added again, or dropped).
pub async fn forget_identity(shard: usize, pool: &MySqlPool) -> Result<()> {
    sqlx::query("DELETE FROM bagstore_owned").execute(pool).await.on(shard)?;
    sqlx::query("DELETE FROM bagstore_shard").execute(pool).await.on(shard)?;
    Ok(())
}

/// Grants `logicals` to a shard (its `bagstore_owned` rows) and sets its
/// epoch, in one transaction.
pub async fn grant(shard: usize, pool: &MySqlPool, logicals: &[u16], epoch: u64) -> Result<()> {
    let mut tx = pool.begin().await.on(shard)?;
    let own = Rows::new("INSERT IGNORE INTO bagstore_owned (logical) VALUES ", "(?)", "")
        .at_most(KEYS_PER_STATEMENT);
    for st in own.statements(logicals) {
        st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k)).execute(&mut *tx).await.on(shard)?;
    }
    sqlx::query("UPDATE bagstore_shard SET epoch = GREATEST(epoch, ?) WHERE id = 1")
        .bind(epoch)
        .execute(&mut *tx)
        .await
        .on(shard)?;
    tx.commit().await.on(shard)
}

/// The logical shards a shard's database says it owns.
pub async fn owned(shard: usize, pool: &MySqlPool) -> Result<Vec<u16>> {
    let rows: Vec<(u16,)> = sqlx::query_as("SELECT logical FROM bagstore_owned ORDER BY logical")
        .fetch_all(pool)
        .await
        .on(shard)?;
    Ok(rows.into_iter().map(|r| r.0).collect())
}

/// The ownership proof of a write: inside the caller's transaction, reads
/// the `bagstore_owned` rows of `logicals` with a shared lock (held until
/// the transaction ends, so no cutover or tombstone purge can change them
/// meanwhile). Fails with [`StoreError::NotOwner`] if any is missing: the
/// caller's map is stale. Returns each logical shard's version floor (see
/// [`crate::ddl::FLOOR_COLUMN`]).
///
/// It proves the server's role too: the ownership rows replicate, so a
/// replica (or a primary fenced by a failover) holds them as well, and
/// only `read_only` tells it is not the shard's primary. Such a server
/// fails the proof with [`StoreError::NotPrimary`], before anything is
/// written, instead of on the first write (the map is stale then too).
pub async fn check_owned(
    shard: usize,
    conn: &mut MySqlConnection,
    logicals: &[u16],
) -> Result<HashMap<u16, u64>> {
    let mut wanted: Vec<u16> = logicals.to_vec();
    wanted.sort_unstable();
    wanted.dedup();
    if wanted.is_empty() {
        return Ok(HashMap::new());
    }
    let sql = format!(
        "SELECT logical, version_floor, CAST(@@GLOBAL.read_only AS SIGNED) FROM bagstore_owned \
         WHERE logical IN ({}) LOCK IN SHARE MODE",
        marks(wanted.len())
    );
    let mut q = sqlx::query_as::<_, (u16, u64, i64)>(&sql);
    for k in &wanted {
        q = q.bind(*k);
    }
    let rows = q.fetch_all(&mut *conn).await.on(shard)?;
    if rows.iter().any(|r| r.2 != 0) {
        return Err(StoreError::NotPrimary { shard });
    }
    let found: HashMap<u16, u64> = rows.into_iter().map(|(k, floor, _)| (k, floor)).collect();
    if found.len() == wanted.len() {
        return Ok(found);
    }
    let missing = wanted.into_iter().find(|k| !found.contains_key(k)).unwrap_or_default();
    Err(StoreError::NotOwner { shard, logical: missing })
}

/// Begins a transaction on `shard` that owns `logicals` (see
/// [`check_owned`]): every write of rows of logical shards goes through one.
pub async fn begin_owned(
    shard: usize,
    pool: &MySqlPool,
    logicals: &[u16],
) -> Result<sqlx::Transaction<'static, sqlx::MySql>> {
    let mut tx = pool.begin().await.on(shard)?;
    check_owned(shard, &mut tx, logicals).await?;
    Ok(tx)
}

/// Raises the epoch a shard's database says it has to at least `epoch`
/// (never lowers it); returns the epoch now. A move raises its target's
/// (`moves::raise_epoch`), a promotion its new primary's: a server of the
/// shard that shows an older epoch (a replica that has not applied the
/// change) is behind, and a process whose map shows an older one reloads.
pub async fn raise_shard_epoch(shard: usize, conn: &mut MySqlConnection, epoch: u64) -> Result<u64> {
    sqlx::query("UPDATE bagstore_shard SET epoch = GREATEST(epoch, ?) WHERE id = 1")
        .bind(epoch)
        .execute(&mut *conn)
        .await
        .on(shard)?;
    shard_epoch(shard, conn).await
}

/// The shard's epoch as a scalar subquery: a read selects it beside its
/// rows, so rows and epoch come from one snapshot.
pub const SHARD_EPOCH: &str = "(SELECT epoch FROM bagstore_shard WHERE id = 1)";

/// A shard's epoch as its database has it: what a read compares with the
/// epoch its map gives that shard.
pub async fn shard_epoch(shard: usize, conn: impl sqlx::MySqlExecutor<'_>) -> Result<u64> {
    let (epoch,): (u64,) =
        sqlx::query_as("SELECT epoch FROM bagstore_shard WHERE id = 1").fetch_one(conn).await.on(shard)?;
    Ok(epoch)
}

/// Records that process `id` (of `role`) routes with map `epoch`.
pub async fn heartbeat(meta: &MySqlPool, id: &str, role: &str, epoch: u64) -> Result<()> {
    sqlx::query(
        "INSERT INTO bagstore_processes (id, role, epoch) VALUES (?, ?, ?) \
         ON DUPLICATE KEY UPDATE role = VALUES(role), epoch = VALUES(epoch), seen = NOW(6)",
    )
    .bind(id)
    .bind(role)
    .bind(epoch)
    .execute(meta)
    .await
    .on(META_SHARD)?;
    Ok(())
}

/// Forgets processes not seen for a day (each start is a new process).
pub async fn forget_old_processes(meta: &MySqlPool) -> Result<u64> {
    let done = sqlx::query("DELETE FROM bagstore_processes WHERE seen < NOW(6) - INTERVAL 1 DAY")
        .execute(meta)
        .await
        .on(META_SHARD)?;
    Ok(done.rows_affected())
}

/// The lowest map epoch among processes seen within `within_secs`, and how
/// many such processes there are.
pub async fn oldest_live_epoch(meta: &MySqlPool, within_secs: u32) -> Result<(Option<u64>, u64)> {
    let row = sqlx::query(
        "SELECT MIN(epoch) AS e, COUNT(*) AS n FROM bagstore_processes WHERE seen > NOW(6) - INTERVAL ? SECOND",
    )
    .bind(within_secs)
    .fetch_one(meta)
    .await
    .on(META_SHARD)?;
    Ok((row.try_get("e").on(META_SHARD)?, row.try_get::<i64, _>("n").on(META_SHARD)? as u64))
}
