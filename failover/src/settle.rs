//! A primary that answers but is read-only with no switchover under way:
//! it died and was restarted before its failover was due, and a server
//! restarts read-only, as a replica (`--init-rpl-role=SLAVE`, so its
//! recovery discards a tail no replica acknowledged). Left so, its shard
//! would refuse writes until an operator acted. Once the coordinator has
//! seen it so for `mysql.failover_after_ms` (counted from when it stopped
//! answering), it settles it:
//!
//! - **A replica holds more.** A replica that replicated from it holds a
//!   transaction it lacks: its recovery discarded a tail that replica had
//!   received (a commit never acknowledged, or acknowledged by that
//!   replica just before the crash). That replica may hold the newest
//!   acknowledged write, so the shard fails over to its most advanced
//!   replica as for a dead primary (`promote`), and the old primary is
//!   then taken back as a replica.
//! - **It holds everything its replicas hold.** Its commits wait for
//!   acknowledgements again and its replicas are taken back (`rejoin`:
//!   each reconnects, as an acknowledging replica, and catches up); then
//!   it takes writes, as `bagstore dev` reopens its primaries after a
//!   restart of the whole cluster.
//! - **No replica answers**: nothing is done (a primary a failover left
//!   alone waits so for its replica).
//!
//! All of it runs under the shard's switchover lock, taken on the primary
//! without waiting: a switchover holds that lock for as long as it keeps
//! the primary read-only, so a primary fenced by a switchover is never
//! reopened nor replaced under it.

use anyhow::Context;
use schemas::gtid::GtidPos;
use schemas::topology::PhysicalShard;
use schemas::Settings;
use std::time::Duration;
use storage::replication::{self, server_state, ReplicaState};
use storage::{locks, Shards};

use crate::promote::{replace, Promoted};
use crate::rejoin::{rejoin, Rejoin};
use crate::servers::{reach, source, Server};

/// What settling a read-only primary came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// A switchover holds the shard (or the map moved on): nothing done.
    Switching,
    /// It takes writes already.
    Writable,
    /// The replicas that answered were taken back (their addresses), or
    /// refused (the reasons); `opened`: the primary takes writes again.
    TakenBack { rejoined: Vec<String>, refused: Vec<String>, opened: bool },
    /// A replica held more, and was promoted.
    FailedOver(Promoted),
}

/// Settles physical shard `p`, whose primary answered read-only.
pub async fn settle(shards: &Shards, settings: &Settings, p: &PhysicalShard) -> anyhow::Result<Settled> {
    let id = p.id as usize;
    let Some(mut primary) = hold(shards, settings, p).await? else { return Ok(Settled::Switching) };
    let state = server_state(id, &mut primary.conn).await?;
    if !state.read_only {
        return Ok(Settled::Writable);
    }
    let from = source(settings, &p.address)?;
    let mut replicas = Vec::new();
    for r in shards.topology().replicas_of(p.id) {
        let Ok(mut server) = reach(shards, settings, id, &r.address).await else { continue };
        let of = server_state(id, &mut server.conn).await?.replica;
        // Only what it received from this primary says the primary lost a
        // tail: a revived former primary holds errant commits of its own,
        // which the rejoin refuses.
        let pointed = of.as_ref().filter(|r| r.master_host == from.host && r.master_port == from.port);
        if let Some(of) = pointed {
            if holds_more(&server.current, of, &state.current) {
                tracing::warn!(shard = %p.name, primary = %p.address, replica = %server.address,
                    primary_holds = %state.current, replica_holds = %server.current, replica_received = %of.received,
                    "a replica holds transactions its read-only primary lost: failing over");
                return Ok(Settled::FailedOver(replace(shards, settings, p, None, false).await?));
            }
        }
        replicas.push((server, pointed.is_some()));
    }
    let (mut rejoined, mut refused, mut opened) = (Vec::new(), Vec::new(), false);
    if replicas.is_empty() {
        return Ok(Settled::TakenBack { rejoined, refused, opened });
    }
    // Before they reconnect: a replica that connected while the primary's
    // commits did not wait for acknowledgements does not acknowledge.
    replication::require_acks(id, &mut primary.conn, !settings.mysql.allow_async).await?;
    for (mut server, pointed) in replicas {
        if pointed {
            // Taken back afresh: the rejoin reconnects a replica that
            // does not receive.
            replication::stop_receiving(id, &mut server.conn).await?;
        }
        match rejoin(shards, settings, p, &server.address).await {
            Ok(Rejoin::Rejoined { opened: o }) => {
                rejoined.push(server.address);
                opened |= o;
            }
            Ok(Rejoin::Replicating) => {}
            Err(e) => refused.push(format!("{}: {e:#}", server.address)),
        }
    }
    Ok(Settled::TakenBack { rejoined, refused, opened })
}

/// Reaches `p`'s primary holding the shard's switchover lock: `None` when
/// a switchover holds it, or the map names another primary by the time
/// it is held.
pub(crate) async fn hold(
    shards: &Shards,
    settings: &Settings,
    p: &PhysicalShard,
) -> anyhow::Result<Option<Server>> {
    let id = p.id as usize;
    let mut primary = reach(shards, settings, id, &p.address).await?;
    let held = locks::take_switchover_lock(id, &mut primary.conn, Duration::ZERO)
        .await
        .with_context(|| format!("taking shard {}'s switchover lock", p.name))?;
    if !held {
        return Ok(None);
    }
    shards.reload_now().await.context("loading the map")?;
    let still = shards.topology().shard(p.id).is_some_and(|q| q.address == p.address);
    Ok(still.then_some(primary))
}

/// Whether a replica that replicated from a primary holding `primary`
/// holds (has applied, or received) a transaction the primary lacks.
fn holds_more(applied: &GtidPos, of: &ReplicaState, primary: &GtidPos) -> bool {
    !primary.includes(applied) || !primary.includes(&of.received)
}

#[cfg(test)]
mod tests {
    use super::holds_more;
    use schemas::gtid::GtidPos;
    use storage::replication::ReplicaState;

    fn pos(s: &str) -> GtidPos {
        GtidPos::parse(s).unwrap()
    }

    fn receiving(received: &str) -> ReplicaState {
        ReplicaState {
            master_host: "127.0.0.1".into(),
            master_port: 3306,
            io_running: false,
            sql_running: true,
            received: pos(received),
            lag_secs: None,
            last_error: None,
        }
    }

    #[test]
    fn a_replica_holds_more_when_it_applied_or_received_what_the_primary_lost() {
        // The primary's recovery discarded 0-1-12; the replica had applied it.
        assert!(holds_more(&pos("0-1-12"), &receiving("0-1-12"), &pos("0-1-11")));
        // Received, not applied yet.
        assert!(holds_more(&pos("0-1-11"), &receiving("0-1-12"), &pos("0-1-11")));
        // Behind or level: the primary holds everything it does.
        assert!(!holds_more(&pos("0-1-10"), &receiving("0-1-11"), &pos("0-1-11")));
        assert!(!holds_more(&pos("0-1-11"), &receiving("0-1-11"), &pos("0-1-11")));
    }
}
