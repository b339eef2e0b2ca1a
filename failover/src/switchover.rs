//! A planned change of a shard's primary, both servers up. No
//! acknowledged write is lost and none is taken twice:
//!
//! 1. the old primary is fenced: `read_only` (its commits in flight end
//!    first; the services' account cannot write there after it), under
//!    the shard's switchover lock (`storage::locks`), held until the end:
//!    the failover coordinator takes no server back and opens no
//!    read-only primary of the shard meanwhile (see the `settle` module);
//! 2. the new primary is given until [`CATCH_UP`] to hold everything the
//!    old one has (`MASTER_GTID_WAIT`); if it cannot, the fence is lifted
//!    and nothing else has changed;
//! 3. the new primary stops replicating; the old primary and the other
//!    replicas replicate from it (each from what it holds);
//! 4. the new primary waits for a replica's acknowledgement of every
//!    commit (unless `mysql.allow_async`), then takes writes;
//! 5. the map records it (address, `failovers` + 1, the old primary among
//!    the replicas, the new primary's raised epoch, a new map epoch):
//!    running processes move their connections.
//!
//! Between 1 and 5 writes to the shard fail as `NotPrimary` (a stale map,
//! retried by the writers) and readers keep reading the old primary.

use anyhow::{bail, ensure, Context};
use schemas::topology::PhysicalShard;
use schemas::Settings;
use std::time::{Duration, Instant};
use storage::dsn::place_of;
use storage::replication::{self, server_state};
use storage::{locks, Shards};

use crate::promote::{raise_epoch, record, wait_for_acknowledger};
use crate::servers::{reach, source};

/// How long the new primary may take to hold everything the old one has.
const CATCH_UP: Duration = Duration::from_secs(30);
/// How long a switchover (or `shards replicas add`) waits for the shard's
/// switchover lock: the coordinator taking a replica back holds it while
/// the replica catches up.
pub const SWITCHOVER_WAIT: Duration = Duration::from_secs(90);

/// What a switchover did: the old and new primary, and how long writes to
/// the shard were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Switched {
    pub old: String,
    pub new: String,
    pub writes_waited: Duration,
}

/// Switches physical shard `p`'s primary to its most advanced replica (or
/// `to`).
pub async fn switch_over(
    shards: &Shards,
    settings: &Settings,
    p: &PhysicalShard,
    to: Option<&str>,
) -> anyhow::Result<Switched> {
    let id = p.id as usize;
    let t = shards.topology();
    let mut replicas = Vec::new();
    for r in t.replicas_of(p.id) {
        replicas.push(reach(shards, settings, id, &r.address).await?);
    }
    ensure!(!replicas.is_empty(), "shard {} has no replica to switch over to", p.name);
    let mut old = reach(shards, settings, id, &p.address).await?;
    let pick = match to {
        Some(address) => {
            replicas.iter().position(|r| place_of(&r.address) == place_of(address)).with_context(|| {
                format!("{address} is not a replica of shard {} (see bagstore shards list)", p.name)
            })?
        }
        // The most advanced: the fewest transactions behind the primary.
        None => (0..replicas.len()).min_by_key(|&i| replicas[i].current.behind(&old.current)).unwrap_or(0),
    };
    let mut new = replicas.remove(pick);
    // Held by `old.conn` until it is dropped, when this returns.
    ensure!(
        locks::take_switchover_lock(id, &mut old.conn, SWITCHOVER_WAIT).await?,
        "the failover coordinator has been changing shard {}'s servers for {} s: try again later",
        p.name,
        SWITCHOVER_WAIT.as_secs()
    );
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
    let epoch = raise_epoch(p, &mut new).await?;
    // Before the replicas connect (see `promote`).
    replication::require_acks(id, &mut new.conn, !settings.mysql.allow_async).await?;
    let from_new = source(settings, &new.address)?;
    for r in std::iter::once(&mut old).chain(replicas.iter_mut()) {
        replication::replicate_from(id, &mut r.conn, &from_new, None)
            .await
            .with_context(|| format!("pointing {} at the new primary", r.address))?;
    }
    if !settings.mysql.allow_async {
        wait_for_acknowledger(id, &mut new).await?;
    }
    replication::set_read_only(id, &mut new.conn, false).await?;
    let writes_waited = started.elapsed();
    record(shards, p, &new.address, epoch, None).await?;
    Ok(Switched { old: old.address, new: new.address, writes_waited })
}
