//! Which server of a physical shard is its primary, when a process knows
//! several (the configuration may list a shard's servers in any role, and
//! the map lists its replicas): the one that takes writes (`read_only`
//! off), the one with the highest identity epoch if several do (two at
//! one epoch is an error no process can settle). A failover sets
//! `read_only` on the old primary where it can reach it, and a revived one
//! starts read-only (`--read-only`, as a replica). The metadata shard's
//! primary may be read-only too (left alone by a failover until a replica
//! joins): then the newest map among its servers names it.

use schemas::settings::Dsn;
use sqlx::mysql::MySqlPool;
use std::time::Duration;

use crate::dsn::{dedicated_connection, place_of};
use crate::error::{OnShard, Result, StoreError};
use crate::topology::{self, Identity};

/// How long one server may take to say who it is: a frozen one accepts a
/// TCP connection and never answers.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether the server behind `pool` takes writes now.
pub(super) async fn is_writable(shard: usize, pool: &MySqlPool) -> Result<bool> {
    let probe = sqlx::query_scalar::<_, i64>("SELECT CAST(@@GLOBAL.read_only AS SIGNED)").fetch_one(pool);
    match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
        Ok(read_only) => Ok(read_only.on(shard)? == 0),
        Err(_) => Ok(false),
    }
}

/// Whether the server behind `dsn` (of physical shard `shard`) answers and
/// takes writes.
pub(super) async fn answers_writable(shard: usize, dsn: &Dsn) -> bool {
    probe(dsn).await.is_some_and(|(id, writable)| writable && id.physical as usize == shard)
}

/// What a server says of itself: who it is, and whether it takes writes.
async fn probe(dsn: &Dsn) -> Option<(Identity, bool)> {
    let ask = async {
        let mut conn = dedicated_connection(dsn).await.ok()?;
        let id = topology::identity_on(0, &mut conn).await.ok()??;
        let read_only: i64 = sqlx::query_scalar("SELECT CAST(@@GLOBAL.read_only AS SIGNED)")
            .fetch_one(&mut conn)
            .await
            .ok()?;
        Some((id, read_only == 0))
    };
    tokio::time::timeout(PROBE_TIMEOUT, ask).await.ok().flatten()
}

/// Those of `dsns` that answer and say they are physical shard `shard`,
/// each once (by host, port and database).
pub(super) async fn identify(shard: usize, dsns: &[Dsn]) -> Vec<(Identity, Dsn)> {
    let mut unique: Vec<&Dsn> = Vec::new();
    for d in dsns {
        if !unique.iter().any(|u| place_of(u.expose()) == place_of(d.expose())) {
            unique.push(d);
        }
    }
    let answers = futures::future::join_all(unique.iter().map(|d| probe(d))).await;
    unique
        .into_iter()
        .zip(answers)
        .filter_map(|(d, a)| a.filter(|(id, _)| id.physical as usize == shard).map(|(id, _)| (id, d.clone())))
        .collect()
}

/// The primary among `found` (servers of physical shard `shard`): a lone
/// server is taken as it is; of several, the one that takes writes with
/// the highest epoch. None taking writes is a shard mid-failover (or
/// restarted): the metadata shard's is the one its newest map names, a
/// data shard's any of them until the map names one. Two at one epoch is
/// a split no process can settle: an error.
pub(super) async fn primary_among(shard: usize, found: &[(Identity, Dsn)]) -> Result<(Identity, Dsn)> {
    let distinct: Vec<&(Identity, Dsn)> = {
        let mut out: Vec<&(Identity, Dsn)> = Vec::new();
        for f in found {
            if !out.iter().any(|o| place_of(o.1.expose()) == place_of(f.1.expose())) {
                out.push(f);
            }
        }
        out
    };
    if let [only] = distinct.as_slice() {
        return Ok((*only).clone());
    }
    let answers = futures::future::join_all(distinct.iter().map(|(_, d)| probe(d))).await;
    let mut writable: Vec<(Identity, Dsn)> = distinct
        .iter()
        .zip(answers)
        .filter_map(|((_, d), a)| a.filter(|(_, w)| *w).map(|(id, _)| (id, d.clone())))
        .collect();
    writable.sort_by_key(|(id, _)| std::cmp::Reverse(id.epoch));
    match writable.as_slice() {
        [] if shard == topology::META_SHARD => named_by_newest_map(&distinct)
            .await
            .ok_or(StoreError::NoPrimary { shard, servers: distinct.len() }),
        // A data shard's primary is the map's to name (`settle_primaries`):
        // none takes writes while a failover or a restart settles roles.
        [] => distinct.first().map(|f| (*f).clone()).ok_or(StoreError::NoPrimary { shard, servers: 0 }),
        [a, b, ..] if a.0.epoch == b.0.epoch => Err(StoreError::BadTopology(format!(
            "physical shard {shard} has two writable servers at epoch {} ({} and {}): fence one \
             (set read_only) before bagstore goes on",
            a.0.epoch,
            place_of(a.1.expose()),
            place_of(b.1.expose())
        ))),
        [first, ..] => Ok(first.clone()),
    }
}

/// The metadata shard's server that the newest map among `found` names
/// its primary, when none takes writes: a primary a failover left alone
/// stays read-only until a replica joins, and the map it holds (recorded
/// there by the failover) is newer than any a fenced or revived former
/// primary holds.
async fn named_by_newest_map(found: &[&(Identity, Dsn)]) -> Option<(Identity, Dsn)> {
    let maps = futures::future::join_all(found.iter().map(|(_, d)| map_names(d))).await;
    let (_, primary) = maps.into_iter().flatten().max_by_key(|(epoch, _)| *epoch)?;
    found.iter().find(|(_, d)| place_of(d.expose()) == place_of(&primary)).map(|f| (*f).clone())
}

/// The map's epoch on the server behind `dsn`, and the address it gives
/// the metadata shard's primary.
async fn map_names(dsn: &Dsn) -> Option<(u64, String)> {
    let ask = async {
        let mut conn = dedicated_connection(dsn).await.ok()?;
        let epoch: u64 = sqlx::query_scalar("SELECT epoch FROM bagstore_cluster WHERE id = 1")
            .fetch_one(&mut conn)
            .await
            .ok()?;
        let address: String = sqlx::query_scalar("SELECT address FROM bagstore_physical WHERE id = ?")
            .bind(topology::META_SHARD as u32)
            .fetch_one(&mut conn)
            .await
            .ok()?;
        Some((epoch, address))
    };
    tokio::time::timeout(PROBE_TIMEOUT, ask).await.ok().flatten()
}
