//! A dead primary's replacement: the most advanced replica promoted,
//! without losing an acknowledged write.
//!
//! 1. Every replica must answer: one that does not may hold the newest
//!    acknowledged write (semi-sync needs only one acknowledgement).
//! 2. Revocation: every replica stops receiving from the old primary, so
//!    were it only cut off, not dead, no commit of it can be acknowledged
//!    any more (semi-sync never falls back to asynchronous here).
//! 3. Each replica applies what it received; the one that then holds
//!    everything the others hold is promoted (`to` must name that one, or
//!    one as advanced): promoting another would lose acknowledged writes,
//!    and is refused.
//! 4. Its epoch rises above every epoch the shard had (and the map
//!    records it): a replica that has not applied that from it is behind,
//!    and a process routing with the old map reloads.
//! 5. The others replicate from it; it takes writes once a replica
//!    acknowledges (a shard left with no other replica stays read-only,
//!    refusing writes, until one joins, unless asynchronous replication was
//!    accepted); the map records it.
//!
//! The dead primary rejoins as a replica (the coordinator's rejoin, see
//! the watch module, or `shards replicas add`), restarted with
//! `--rpl-semi-sync-slave-enabled` and `--init-rpl-role=SLAVE` so its
//! recovery discards its unacknowledged tail: a server holding a
//! transaction the new primary lacks is never taken back.

use anyhow::{bail, ensure, Context};
use schemas::topology::PhysicalShard;
use schemas::Settings;
use std::time::{Duration, Instant};
use storage::dsn::place_of;
use storage::replication::{self, server_state};
use storage::topology::{self, META_SHARD};
use storage::Shards;

use crate::servers::{connect, meta_primary, reach, source, Server};

/// How long a dead primary's replicas get to apply what they received.
const APPLY_WAIT: Duration = Duration::from_secs(30);
/// How long the primary gets to answer before it counts as gone.
const PRIMARY_ANSWER: Duration = Duration::from_secs(2);
/// How long a new primary waits for a replica to acknowledge before it
/// takes writes (past it, the writers refuse them until one does).
pub(crate) const ACKS_WAIT: Duration = Duration::from_secs(10);

/// What a failover did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Promoted {
    pub old: String,
    pub new: String,
    /// No replica was left to acknowledge: the new primary stays
    /// read-only until one joins.
    pub alone: bool,
    /// Its commits do not wait for a replica (accepted by the operator).
    pub asynchronous: bool,
}

/// Fails physical shard `p` over to its most advanced replica (or `to`).
pub async fn fail_over(
    shards: &Shards,
    settings: &Settings,
    p: &PhysicalShard,
    to: Option<&str>,
    accept_async: bool,
) -> anyhow::Result<Promoted> {
    let id = p.id as usize;
    ensure!(
        shards.topology().replicas_of(p.id).next().is_some(),
        "shard {} has no replica to fail over to",
        p.name
    );
    if tokio::time::timeout(PRIMARY_ANSWER, reach(shards, settings, id, &p.address))
        .await
        .is_ok_and(|r| r.is_ok())
    {
        bail!("the primary of shard {} ({}) answers: use `bagstore shards switchover`", p.name, p.address);
    }
    replace(shards, settings, p, to, accept_async).await
}

/// Replaces physical shard `p`'s primary, which takes no write (it does
/// not answer, or answers read-only and is held by the caller's
/// switchover lock), with its most advanced replica (or `to`): steps 1
/// to 5 of the module docs.
pub(crate) async fn replace(
    shards: &Shards,
    settings: &Settings,
    p: &PhysicalShard,
    to: Option<&str>,
    accept_async: bool,
) -> anyhow::Result<Promoted> {
    let id = p.id as usize;
    let t = shards.topology();
    let mut replicas = Vec::new();
    for r in t.replicas_of(p.id) {
        let server = reach(shards, settings, id, &r.address).await.with_context(|| {
            format!(
                "replica {} does not answer, and may hold the newest acknowledged write: bring it back, or \
                 remove it (`shards replicas remove`) to fail over without it",
                r.address
            )
        })?;
        replicas.push(server);
    }
    for r in &mut replicas {
        replication::stop_receiving(id, &mut r.conn).await?;
    }
    for r in &mut replicas {
        ensure!(
            replication::wait_applied(id, &mut r.conn, APPLY_WAIT).await?,
            "{} did not apply what it received within {} s",
            r.address,
            APPLY_WAIT.as_secs()
        );
        r.current = server_state(id, &mut r.conn).await?.current;
    }
    let pick = most_advanced(&replicas, to)?;
    let mut new = replicas.remove(pick);
    replication::stop_replicating(id, &mut new.conn).await?;
    let epoch = raise_epoch(p, &mut new).await?;
    let acks = !(settings.mysql.allow_async || accept_async);
    // Left with no replica to acknowledge them, writes would wait: the new
    // primary stays read-only (writes are refused, nothing waits) until a
    // replica joins (the rejoin, or `replicas add`, then opens it).
    let alone = acks && replicas.is_empty();
    if alone && id == META_SHARD {
        // The map lives on this read-only server: recorded there as the
        // admin account, before its commits wait for a replica that is
        // not there.
        let address = new.address.clone();
        record(shards, p, &address, epoch, Some(&mut new)).await?;
    }
    // Before a replica connects: one that connects first may be served as
    // an asynchronous replica until it reconnects.
    replication::require_acks(id, &mut new.conn, acks).await?;
    let from_new = source(settings, &new.address)?;
    for r in &mut replicas {
        replication::replicate_from(id, &mut r.conn, &from_new, None).await?;
    }
    if acks && !replicas.is_empty() {
        wait_for_acknowledger(id, &mut new).await?;
    }
    if !alone {
        replication::set_read_only(id, &mut new.conn, false).await?;
    }
    if !(alone && id == META_SHARD) {
        record(shards, p, &new.address, epoch, None).await?;
    }
    Ok(Promoted { old: p.address.clone(), new: new.address, alone, asynchronous: !acks })
}

/// Waits (up to [`ACKS_WAIT`]) for a semi-sync replica to connect to the
/// new primary: writes taken before one does would wait for it.
pub(crate) async fn wait_for_acknowledger(shard: usize, new: &mut Server) -> anyhow::Result<()> {
    let until = Instant::now() + ACKS_WAIT;
    while server_state(shard, &mut new.conn).await?.semi_sync_clients == 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Gives a new primary (replicating from nobody now, still read-only) an
/// epoch above every epoch its shard had, as the admin account; its
/// commits do not wait for acknowledgements yet (a former primary may
/// still have them on), as no replica follows it. Returns the epoch.
pub(crate) async fn raise_epoch(p: &PhysicalShard, new: &mut Server) -> anyhow::Result<u64> {
    let id = p.id as usize;
    replication::require_acks(id, &mut new.conn, false).await?;
    let had = topology::shard_epoch(id, &mut new.conn).await?;
    Ok(topology::raise_shard_epoch(id, &mut new.conn, had.max(p.epoch) + 1).await?)
}

/// Records the new primary, with its `epoch`, in the map, which lives on the metadata
/// shard's primary: `on_new` (reached as the admin account), when the
/// metadata shard is the one that changed and its new primary is still
/// read-only; otherwise that primary as the services' account.
pub(crate) async fn record(
    shards: &Shards,
    p: &PhysicalShard,
    new: &str,
    epoch: u64,
    on_new: Option<&mut Server>,
) -> anyhow::Result<()> {
    let old = p.address.as_str();
    if let Some(server) = on_new {
        topology::switch_primary(&mut server.conn, p.id, new, old, epoch).await?;
        return Ok(());
    }
    let meta_address =
        if p.id as usize == META_SHARD { new.to_string() } else { meta_primary(&shards.topology())? };
    let mut meta = connect(&shards.credentials_for(&meta_address)?, "the metadata shard's primary").await?;
    topology::switch_primary(&mut meta, p.id, new, old, epoch).await?;
    Ok(())
}

/// The replica to promote: one that holds everything every other holds
/// (`to`, when given, must be one).
fn most_advanced(replicas: &[Server], to: Option<&str>) -> anyhow::Result<usize> {
    let complete = |i: usize| replicas.iter().all(|o| replicas[i].current.includes(&o.current));
    match to {
        Some(address) => {
            let i = replicas
                .iter()
                .position(|r| place_of(&r.address) == place_of(address))
                .with_context(|| format!("{address} is not a replica of this shard"))?;
            if let Some(o) = replicas.iter().find(|o| !replicas[i].current.includes(&o.current)) {
                bail!(
                    "{address} is {} transaction(s) behind {}: promoting it would lose acknowledged writes",
                    replicas[i].current.behind(&o.current),
                    o.address
                );
            }
            Ok(i)
        }
        None => (0..replicas.len()).find(|&i| complete(i)).context(
            "no replica holds everything the others hold (their histories diverged): promote none by hand",
        ),
    }
}
