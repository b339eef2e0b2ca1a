//! A server the map lists as a replica, answering but not replicating
//! from its shard's primary (a dead primary restarted after a failover),
//! taken back as a replica, and a primary a failover left alone opened
//! for writes once it has.
//!
//! Never an errant transaction served: the server rejoins only if the
//! primary holds every transaction it holds. A former primary restarted
//! with `--rpl-semi-sync-slave-enabled` and `--init-rpl-role=SLAVE` has
//! had its unacknowledged tail discarded by its recovery, and passes; one
//! that still holds commits nobody acknowledged (it was frozen, not dead,
//! and came back) is refused until it is restarted that way or re-seeded.
//! Nothing on it is changed before it passes, but `read_only`.

use anyhow::{ensure, Context};
use schemas::topology::PhysicalShard;
use schemas::Settings;
use std::time::Duration;
use storage::replication::{self, server_state};
use storage::Shards;

use crate::promote::wait_for_acknowledger;
use crate::servers::{reach, source};

/// How long a rejoining server may take to catch up before the primary
/// waits for its acknowledgements.
const CATCH_UP: Duration = Duration::from_secs(60);
/// How long fencing a server may take (`read_only` waits for the commits
/// in flight to end; a frozen primary's never do).
const FENCE_WAIT: Duration = Duration::from_secs(5);

/// What a rejoin found or did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejoin {
    /// It replicated from the primary already.
    Replicating,
    /// It replicates from the primary again.
    Rejoined {
        /// The primary was read-only, left alone by a failover, and now
        /// takes writes.
        opened: bool,
    },
}

/// Takes the server at `address` (listed as a replica of `p`) back as a
/// replica of `p`'s primary.
pub async fn rejoin(
    shards: &Shards,
    settings: &Settings,
    p: &PhysicalShard,
    address: &str,
) -> anyhow::Result<Rejoin> {
    let id = p.id as usize;
    let from = source(settings, &p.address)?;
    let mut server = reach(shards, settings, id, address).await?;
    let state = server_state(id, &mut server.conn).await?;
    let follows = |r: &storage::replication::ReplicaState| {
        r.master_host == from.host && r.master_port == from.port && r.io_running && r.sql_running
    };
    if state.replica.as_ref().is_some_and(follows) {
        return Ok(Rejoin::Replicating);
    }
    ensure!(
        state.waiting_commits == 0,
        "{address} still waits for acknowledgements of {} commit(s) of its own (a primary a failover left \
         behind): restart it with --rpl-semi-sync-slave-enabled and --init-rpl-role=SLAVE, so its recovery \
         discards them, or re-seed it",
        state.waiting_commits
    );
    tokio::time::timeout(FENCE_WAIT, replication::set_read_only(id, &mut server.conn, true))
        .await
        .with_context(|| format!("{address} did not turn read-only within {} s", FENCE_WAIT.as_secs()))??;
    let mut primary = reach(shards, settings, id, &p.address).await?;
    let mine = server_state(id, &mut server.conn).await?.current;
    ensure!(
        primary.current.includes(&mine),
        "{address} holds transactions the primary does not ({mine} against the primary's {}): errant, never \
         acknowledged; re-seed it (an empty server, `shards replicas add`) rather than let it rejoin",
        primary.current
    );
    replication::replicate_from(id, &mut server.conn, &from, None).await?;
    let target = server_state(id, &mut primary.conn).await?.current;
    ensure!(
        replication::wait_for(id, &mut server.conn, &target, CATCH_UP).await?,
        "{address} did not catch up with the primary ({target}) within {} s",
        CATCH_UP.as_secs()
    );
    let acks = !settings.mysql.allow_async;
    replication::require_acks(id, &mut primary.conn, acks).await?;
    let opened = server_state(id, &mut primary.conn).await?.read_only;
    if opened {
        if acks {
            wait_for_acknowledger(id, &mut primary).await?;
        }
        replication::set_read_only(id, &mut primary.conn, false).await?;
    }
    Ok(Rejoin::Rejoined { opened })
}
