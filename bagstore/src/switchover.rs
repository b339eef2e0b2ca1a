//! `bagstore shards switchover SHARD [--to ADDRESS]`: a planned change of
//! a shard's primary, both servers up. No acknowledged write is lost and
//! none is taken twice:
//!
//! 1. the old primary is fenced: `read_only` (its commits in flight end
//!    first; the services' account cannot write there after it);
//! 2. the new primary is given until [`CATCH_UP`] to hold everything the
//!    old one has (`MASTER_GTID_WAIT`); if it cannot, the fence is lifted
//!    and nothing else has changed;
//! 3. the new primary stops replicating; the old primary and the other
//!    replicas replicate from it (each from what it holds);
//! 4. the new primary waits for a replica's acknowledgement of every
//!    commit (unless `mysql.allow_async`), then takes writes;
//! 5. the map records it (address, `failovers` + 1, the old primary among
//!    the replicas, a new epoch): running processes move their connections.
//!
//! Between 1 and 5 writes to the shard fail as `NotPrimary` (a stale map,
//! retried by the writers) and readers keep reading the old primary.

use anyhow::{bail, ensure, Context};
use schemas::gtid::GtidPos;
use schemas::settings::Dsn;
use schemas::Settings;
use std::time::{Duration, Instant};
use storage::dsn::{place_of, ServerConnection};
use storage::replication::{self, server_state};
use storage::topology::{self, META_SHARD};
use storage::Shards;

use crate::replicas::{admin, connect, shard_named, source};

/// How long the new primary may take to hold everything the old one has.
const CATCH_UP: Duration = Duration::from_secs(30);

/// How long the new primary waits for a replica to acknowledge before it
/// takes writes (past it, the writers refuse them until one does).
const ACKS_WAIT: Duration = Duration::from_secs(10);

/// One server of the shard, as the admin account reaches it.
struct Server {
    address: String,
    conn: ServerConnection,
    current: GtidPos,
}

pub async fn switchover(settings: Settings, shard: &str, to: Option<&str>) -> anyhow::Result<()> {
    let shards = Shards::connect(&settings.mysql).await?;
    let result = run(&shards, &settings, shard, to).await;
    shards.close().await;
    let (old, new, took) = result?;
    println!(
        "shard {shard}: {new} is the primary now ({old} replicates from it); writes waited {} ms",
        took.as_millis()
    );
    Ok(())
}

async fn run(
    shards: &Shards,
    settings: &Settings,
    name: &str,
    to: Option<&str>,
) -> anyhow::Result<(String, String, Duration)> {
    let p = shard_named(shards, name)?;
    let id = p.id as usize;
    let t = shards.topology();
    let mut replicas = Vec::new();
    for r in t.replicas_of(p.id) {
        replicas.push(reach(shards, settings, id, &r.address).await?);
    }
    ensure!(!replicas.is_empty(), "shard {name} has no replica to switch over to");
    let mut old = reach(shards, settings, id, &p.address).await?;
    let pick = match to {
        Some(address) => {
            replicas.iter().position(|r| place_of(&r.address) == place_of(address)).with_context(|| {
                format!("{address} is not a replica of shard {name} (see bagstore shards list)")
            })?
        }
        // The most advanced: the fewest transactions behind the primary.
        None => (0..replicas.len()).min_by_key(|&i| replicas[i].current.behind(&old.current)).unwrap_or(0),
    };
    let mut new = replicas.remove(pick);
    let started = Instant::now();
    replication::set_read_only(id, &mut old.conn, true).await?;
    let fenced = server_state(id, &mut old.conn).await?.current;
    if !replication::wait_for(id, &mut new.conn, &fenced, CATCH_UP).await? {
        replication::set_read_only(id, &mut old.conn, false).await?;
        bail!(
            "{} did not reach the primary's position {fenced} within {} s; the primary takes writes again",
            new.address,
            CATCH_UP.as_secs()
        );
    }
    replication::stop_replicating(id, &mut new.conn).await?;
    let from_new = source(settings, &new.address)?;
    for r in std::iter::once(&mut old).chain(replicas.iter_mut()) {
        replication::replicate_from(id, &mut r.conn, &from_new, None)
            .await
            .with_context(|| format!("pointing {} at the new primary", r.address))?;
    }
    replication::require_acks(id, &mut new.conn, !settings.mysql.allow_async).await?;
    if !settings.mysql.allow_async {
        // Writes taken before a replica connects would wait for it.
        let until = Instant::now() + ACKS_WAIT;
        while server_state(id, &mut new.conn).await?.semi_sync_clients == 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    replication::set_read_only(id, &mut new.conn, false).await?;
    let took = started.elapsed();
    // The map lives on the metadata shard's primary: the new one, when the
    // metadata shard is the one that changed.
    let meta_address = if id == META_SHARD { new.address.clone() } else { meta_primary(&t)? };
    let mut meta = connect(&shards.credentials_for(&meta_address)?, "the metadata shard's primary").await?;
    topology::switch_primary(&mut meta, p.id, &new.address, &old.address).await?;
    Ok((old.address, new.address, took))
}

fn meta_primary(t: &schemas::topology::Topology) -> anyhow::Result<String> {
    let p = t.shard(META_SHARD as u32).context("the map has no metadata shard")?;
    Ok(p.address.clone())
}

async fn reach(shards: &Shards, settings: &Settings, shard: usize, address: &str) -> anyhow::Result<Server> {
    let dsn: Dsn = admin(settings, &shards.credentials_for(address)?);
    let mut conn = connect(&dsn, address).await?;
    let current = server_state(shard, &mut conn).await?.current;
    Ok(Server { address: address.to_string(), conn, current })
}

/// How long a dead primary's replicas get to apply what they received.
const APPLY_WAIT: Duration = Duration::from_secs(30);
/// How long the primary gets to answer before it counts as gone.
const PRIMARY_ANSWER: Duration = Duration::from_secs(2);

/// `bagstore shards failover SHARD [--to ADDRESS] [--accept-async]`: the
/// primary is gone; the most advanced replica takes its place.
///
/// 1. Every replica must answer: one that does not may hold the newest
///    acknowledged write (semi-sync needs only one acknowledgement).
/// 2. Revocation: every replica stops receiving from the old primary, so
///    were it only cut off, not dead, no commit of it can be acknowledged
///    any more (semi-sync never falls back to asynchronous here).
/// 3. Each replica applies what it received; the one that then holds
///    everything the others hold is promoted (`--to` must name that one,
///    or one as advanced): promoting another would lose acknowledged
///    writes, and is refused.
/// 4. The others replicate from it; it takes writes once a replica
///    acknowledges (a shard left with no other replica stays read-only,
///    refusing writes, until one joins, unless `--accept-async`); the map
///    records it.
///
/// The dead primary rejoins as a replica through `shards replicas add`,
/// started with `--rpl-semi-sync-slave-enabled` and `--init-rpl-role=SLAVE`
/// so its recovery discards its unacknowledged tail: `replicas add`
/// refuses a server holding a transaction the new primary lacks.
pub async fn failover(
    settings: Settings,
    shard: &str,
    to: Option<&str>,
    accept_async: bool,
) -> anyhow::Result<()> {
    let shards = Shards::connect(&settings.mysql).await?;
    let result = run_failover(&shards, &settings, shard, to, accept_async).await;
    shards.close().await;
    let (old, new, note) = result?;
    println!("shard {shard}: {new} is the primary now, in place of {old}{note}");
    Ok(())
}

async fn run_failover(
    shards: &Shards,
    settings: &Settings,
    name: &str,
    to: Option<&str>,
    accept_async: bool,
) -> anyhow::Result<(String, String, String)> {
    let p = shard_named(shards, name)?;
    let id = p.id as usize;
    let t = shards.topology();
    ensure!(t.replicas_of(p.id).next().is_some(), "shard {name} has no replica to fail over to");
    if tokio::time::timeout(PRIMARY_ANSWER, reach(shards, settings, id, &p.address))
        .await
        .is_ok_and(|r| r.is_ok())
    {
        bail!("the primary of shard {name} ({}) answers: use `bagstore shards switchover`", p.address);
    }
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
    let from_new = source(settings, &new.address)?;
    for r in &mut replicas {
        replication::replicate_from(id, &mut r.conn, &from_new, None).await?;
    }
    let acks = !(settings.mysql.allow_async || accept_async);
    replication::require_acks(id, &mut new.conn, acks).await?;
    if acks && !replicas.is_empty() {
        let until = Instant::now() + ACKS_WAIT;
        while server_state(id, &mut new.conn).await?.semi_sync_clients == 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // Left with no replica to acknowledge them, writes would wait: the new
    // primary stays read-only (writes are refused, nothing waits) until a
    // replica joins (`replicas add` then opens it).
    let alone = acks && replicas.is_empty();
    if !alone {
        replication::set_read_only(id, &mut new.conn, false).await?;
    }
    let meta_address = if id == META_SHARD { new.address.clone() } else { meta_primary(&t)? };
    let mut meta = connect(&shards.credentials_for(&meta_address)?, "the metadata shard's primary").await?;
    topology::switch_primary(&mut meta, p.id, &new.address, &p.address).await?;
    let note = match (acks, replicas.is_empty()) {
        (true, true) => "; it has no replica left, so it stays read-only (writes are refused) until one \
                         joins (`shards replicas add`, the old primary among them)"
            .to_string(),
        (false, _) => "; it replicates asynchronously (accepted)".to_string(),
        _ => String::new(),
    };
    Ok((p.address, new.address, note))
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
