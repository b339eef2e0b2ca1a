//! MySQL named locks: who publishes a shard's outbox, who backfills an
//! index, who coordinates failovers. A named lock lives as long as the connection that took it, so a
//! holder that dies frees it, and another process takes over. Lock names
//! are server-wide, so they include the database name (two shards may
//! share one server).

use sqlx::{MySqlConnection, Row};
use std::time::Duration;

use crate::error::{OnShard, Result};
use crate::topology::META_SHARD;

/// "The relay of this database".
const RELAY_LOCK: &str = "CONCAT('bagstore.relay.', DATABASE())";
/// "The failover coordinator", on the shard whose lock elects it.
const FAILOVER_LOCK: &str = "CONCAT('bagstore.failover.', DATABASE())";
/// "The mover of this cluster", on the metadata shard.
const MOVER_LOCK: &str = "CONCAT('bagstore.mover.', DATABASE())";
/// "The backfiller of index ?", on the metadata shard.
const BACKFILL_LOCK: &str = "CONCAT('bagstore.backfill.', DATABASE(), '.', ?)";
/// "A change of this shard's primary under way", on its primary: held by
/// a switchover while the primary is read-only, and by the failover
/// coordinator while it takes a server back or settles a read-only
/// primary, so neither acts on the other's half-done change.
const SWITCHOVER_LOCK: &str = "CONCAT('bagstore.switchover.', DATABASE())";

/// `GET_LOCK` of the lock `name` (an SQL expression, with `bind` for its
/// `?` if it has one) without waiting: whether `conn` got it.
async fn get_lock(shard: usize, conn: &mut MySqlConnection, name: &str, bind: Option<&str>) -> Result<bool> {
    get_lock_within(shard, conn, name, bind, Duration::ZERO).await
}

/// [`get_lock`], waiting up to `wait` for the holder to let go.
async fn get_lock_within(
    shard: usize,
    conn: &mut MySqlConnection,
    name: &str,
    bind: Option<&str>,
    wait: Duration,
) -> Result<bool> {
    let sql = format!("SELECT GET_LOCK({name}, {}) AS got", wait.as_secs());
    let row = match bind {
        Some(v) => sqlx::query(&sql).bind(v).fetch_one(conn).await,
        None => sqlx::query(&sql).fetch_one(conn).await,
    }
    .on(shard)?;
    Ok(row.try_get::<Option<i64>, _>("got").on(shard)? == Some(1))
}

/// Whether `conn` holds the lock `name` (false if its session was killed
/// and someone else took the lock since).
async fn holds_lock(shard: usize, conn: &mut MySqlConnection, name: &str) -> Result<bool> {
    let row = sqlx::query(&format!("SELECT IS_USED_LOCK({name}) = CONNECTION_ID() AS mine"))
        .fetch_one(conn)
        .await
        .on(shard)?;
    Ok(row.try_get::<Option<i64>, _>("mine").on(shard)? == Some(1))
}

/// Tries to become the shard's relay leader; the lock lives as long as `conn`.
pub async fn try_relay_lock(shard: usize, conn: &mut MySqlConnection) -> Result<bool> {
    get_lock(shard, conn, RELAY_LOCK, None).await
}

/// Whether `conn` still holds the relay lock (false if it was killed and
/// someone else took over).
pub async fn holds_relay_lock(shard: usize, conn: &mut MySqlConnection) -> Result<bool> {
    holds_lock(shard, conn, RELAY_LOCK).await
}

/// Makes `conn` (on `shard`) the one failover coordinator of the shards
/// this lock's shard elects for, if no one else is. Held already: true.
pub async fn try_failover_lock(shard: usize, conn: &mut MySqlConnection) -> Result<bool> {
    if holds_failover_lock(shard, conn).await? {
        return Ok(true);
    }
    get_lock(shard, conn, FAILOVER_LOCK, None).await
}

/// Whether `conn` holds the failover lock of its shard.
pub async fn holds_failover_lock(shard: usize, conn: &mut MySqlConnection) -> Result<bool> {
    holds_lock(shard, conn, FAILOVER_LOCK).await
}

/// Makes `conn` (on the metadata shard) the one backfiller of index
/// `table`, if no one else is.
pub async fn try_backfill_lock(conn: &mut MySqlConnection, table: &str) -> Result<bool> {
    get_lock(META_SHARD, conn, BACKFILL_LOCK, Some(table)).await
}

/// Takes the switchover lock of the shard whose primary `conn` is on,
/// waiting up to `wait`: whether `conn` got it. Released with the
/// connection.
pub async fn take_switchover_lock(shard: usize, conn: &mut MySqlConnection, wait: Duration) -> Result<bool> {
    get_lock_within(shard, conn, SWITCHOVER_LOCK, None, wait).await
}

/// A named lock held by a connection of its own: held until dropped.
#[derive(Debug)]
pub struct HeldLock {
    _conn: MySqlConnection,
}

/// Makes this process the one running the cluster's moves, if no one else
/// is: `None` when another process holds the lock.
pub async fn take_mover_lock(meta: &schemas::settings::Dsn) -> Result<Option<HeldLock>> {
    let mut conn = crate::dsn::dedicated_connection(meta).await.on(META_SHARD)?;
    let got = get_lock(META_SHARD, &mut conn, MOVER_LOCK, None).await?;
    Ok(got.then_some(HeldLock { _conn: conn }))
}
