//! Which server of a physical shard is its primary, when a process knows
//! several (the configuration may list a shard's servers in any role, and
//! the map lists its replicas): the one that takes writes (`read_only`
//! off) with the highest epoch. A promotion raises the new primary's epoch
//! (`bagstore_shard.epoch`, which replicates to its replicas); a primary a
//! failover fenced keeps its older one, and is read-only if the failover
//! could reach it.

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
/// the highest epoch. None taking writes is a shard mid-failover; two at
/// one epoch is a split no process can settle: both are errors.
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
        [] => Err(StoreError::NoPrimary { shard, servers: distinct.len() }),
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
