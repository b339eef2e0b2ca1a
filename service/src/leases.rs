//! Keeping a consumer's member lease (`storage::leases`) while it runs, so
//! the consumers of a group split its partitions among themselves: the
//! indexers of an index, the writers' Kafka ingest. They never join the
//! broker's consumer group; they only commit their offsets under its id.
//!
//! Why not the broker's group protocol (which bagstore ran too, until the
//! numbers below and two defective coordinators retired it, DESIGN §13;
//! docs/design-notes.md, "Levers tried and removed"): a member killed with `kill -9`
//! holds its partitions until the broker ends its session, and when it is
//! restarted at once it waits for a rebalance the broker runs (6 to 18 s in
//! the chaos reports, and a lone tansu survivor never got them back). With
//! leases, a member restarted under its name computes the same share as
//! before from the same member list and applies it at once; a member
//! that does not come back drops out of the list when its lease runs out,
//! and the others take its partitions at their next read of the list. And
//! tansu 0.6.0's coordinator can keep a dead member as the group's leader,
//! after which the group never forms again (docs/design-notes.md, "tansu's
//! group coordinator and a dead leader").
//!
//! [`Lease`] renews in a task of its own (every third of its length, and
//! reads the member list every [`Lease::every`] in between), so a consumer
//! busy on a slow batch keeps its lease. What the consumer loop
//! asks is [`Lease::share`]: the partitions it should hold now. A lease not
//! renewed for its whole length may have run out (the metadata shard out
//! of reach), and then the share is empty: others may hold the partitions.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use storage::leases::{self, Beat};
use storage::Shards;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A member's lease in one consumer group, renewed until [`Lease::leave`].
#[derive(Debug)]
pub struct Lease {
    me: Member,
    view: watch::Receiver<View>,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Whose lease it is: a member of a group, as one process (incarnation).
#[derive(Debug, Clone)]
struct Member {
    shards: Shards,
    group: String,
    name: String,
    incarnation: [u8; 16],
    ttl: Duration,
    /// The setting that names members, for the error when two processes
    /// share a name (`indexer.member`, `ingest.member`).
    setting: &'static str,
}

/// What the last renewal found.
#[derive(Debug, Clone, Default)]
pub struct View {
    members: Vec<String>,
    /// When the last renewal that succeeded started (its lease runs at
    /// least `ttl` from then).
    renewed: Option<Instant>,
    /// A process started later took this member's name.
    taken: bool,
}

impl Lease {
    /// Starts renewing `member`'s lease of length `ttl` in `group`;
    /// `setting` names the member setting (for the error when another
    /// process takes the name).
    pub fn start(
        shards: Shards,
        group: String,
        member: String,
        ttl: Duration,
        setting: &'static str,
    ) -> Lease {
        let incarnation = *uuid::Uuid::new_v4().as_bytes();
        let me = Member { shards, group, name: member, incarnation, ttl, setting };
        let (tx, view) = watch::channel(View::default());
        let stop = CancellationToken::new();
        let task = tokio::spawn(Keeper { me: me.clone(), tx }.run(stop.clone()));
        Lease { me, view, stop, task: Some(task) }
    }

    /// How often the member list is read under a lease of length `ttl`: a
    /// tenth of it, between 100 and 250 ms (a dead member's partitions
    /// move within its lease and one read).
    fn every(ttl: Duration) -> Duration {
        (ttl / 10).clamp(Duration::from_millis(100), Duration::from_millis(250))
    }

    pub fn member(&self) -> &str {
        &self.me.name
    }

    /// The partitions of a topic of `partitions` this member should hold
    /// now; an error once another process took its name.
    pub fn share(&self, partitions: usize) -> Result<BTreeSet<i32>, String> {
        let v = self.view.borrow();
        if v.taken {
            return Err(format!(
                "another process started under the member name {:?} in group {:?}; \
                 member names must be unique per process ({})",
                self.me.name, self.me.group, self.me.setting
            ));
        }
        if v.renewed.is_none_or(|t| t.elapsed() >= self.me.ttl) {
            return Ok(BTreeSet::new());
        }
        Ok(leases::share(&v.members, &self.me.name, partitions))
    }

    /// Whether the lease is held now: renewed within its length, so the
    /// share is this member's (an empty share too: more members than
    /// partitions).
    pub fn is_live(&self) -> bool {
        let v = self.view.borrow();
        !v.taken && v.renewed.is_some_and(|t| t.elapsed() < self.me.ttl)
    }

    /// A receiver that wakes when the members change, the name is taken, or
    /// a renewal succeeds after the lease may have run out.
    pub fn changes(&self) -> watch::Receiver<View> {
        self.view.clone()
    }

    /// Stops renewing and ends the lease, so the others take the partitions
    /// at once rather than when it would run out.
    pub async fn leave(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        if let Err(e) =
            leases::leave(&self.me.shards, &self.me.group, &self.me.name, self.me.incarnation).await
        {
            tracing::warn!(group = %self.me.group, member = %self.me.name, error = %e,
                "cannot end the member lease; the others take its partitions when it runs out");
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

struct Keeper {
    me: Member,
    tx: watch::Sender<View>,
}

impl Keeper {
    /// Renews (a write) every third of the lease, and between renewals
    /// reads the members every [`Lease::every`], so a member costs the
    /// metadata shard one small commit every few seconds, not one per read.
    async fn run(self, stop: CancellationToken) {
        let me = &self.me;
        let every = Lease::every(me.ttl);
        let renew_every = me.ttl / 3;
        let mut renewed: Option<Instant> = None;
        let mut failing_since: Option<Instant> = None;
        loop {
            let started = Instant::now();
            let write = renewed.is_none_or(|t| t.elapsed() >= renew_every);
            let found = if write {
                leases::beat(&me.shards, &me.group, &me.name, me.incarnation, me.ttl, renewed.is_none()).await
            } else {
                leases::look(&me.shards, &me.group, &me.name, me.incarnation).await
            };
            match found {
                Ok(Beat::Members(members)) => {
                    failing_since = None;
                    if write {
                        renewed = Some(started);
                    }
                    self.tx.send_if_modified(|v| {
                        let lapsed = v.renewed.is_none_or(|t| t.elapsed() >= me.ttl);
                        let changed = v.members != members;
                        if changed {
                            tracing::info!(group = %me.group, member = %me.name, ?members, "group members");
                            v.members = members;
                        }
                        if write {
                            v.renewed = Some(started);
                        }
                        changed || (lapsed && write)
                    });
                }
                Ok(Beat::Taken) => {
                    tracing::error!(group = %me.group, member = %me.name,
                        "a process started later took this member name; this one stops applying");
                    self.tx.send_modify(|v| v.taken = true);
                    return;
                }
                Err(e) => {
                    let since = *failing_since.get_or_insert(started);
                    if since.elapsed() >= me.ttl {
                        tracing::warn!(group = %me.group, member = %me.name, error = %e,
                            "cannot renew the member lease; holding no partitions until it is renewed");
                        // Wake the consumer: its share is now empty.
                        self.tx.send_modify(|_| {});
                    } else {
                        tracing::debug!(group = %me.group, error = %e, "cannot renew the member lease yet");
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(every.saturating_sub(started.elapsed())) => {}
                _ = stop.cancelled() => return,
            }
        }
    }
}
