//! The coordinator: every cleaner runs one (`mysql.failover = "auto"`, the
//! default); the one elected for a shard fails it over when its primary
//! has not answered for `mysql.failover_after_ms`, settles a primary that
//! answers read-only that long (restarted before its failover was due,
//! see the `settle` module), and takes back, as replicas, listed servers
//! that answer again without replicating (a dead primary restarted),
//! opening a primary a failover left alone. It takes a server back only
//! under the shard's switchover lock, which a switchover holds while the
//! primary is read-only.
//!
//! **Election.** A coordinator acts on a shard only while it holds the
//! failover lock (a MySQL named lock, `storage::locks`) of another shard:
//! the metadata shard's for every other shard, and the lowest other
//! shard's (the deputy) for the metadata shard. A lock lives on a server
//! that is not the one failing, so a dead primary takes no election with
//! it, and two coordinators cannot hold one lock. Should the lock's own
//! server die in the middle of a failover (two shards failing at once),
//! the map's compare-and-set (`storage::topology::switch_primary` changes
//! the primary only from the one the failover replaced) lets one record
//! it; the other's promotion is refused there. A cluster of one physical
//! shard has no other shard to hold the lock: run one cleaner there, or
//! `mysql.failover = "manual"`.

use schemas::settings::FailoverMode;
use schemas::topology::{PhysicalShard, Topology};
use schemas::Settings;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use storage::dsn::{dedicated_connection, ServerConnection};
use storage::replication::server_state;
use storage::topology::META_SHARD;
use storage::{locks, Shards};
use tokio_util::sync::CancellationToken;

use crate::metrics::FailoverMetrics;
use crate::promote::fail_over;
use crate::promote::Promoted;
use crate::rejoin::{rejoin, Rejoin};
use crate::servers::{reach, source};
use crate::settle::{hold, settle, Settled};

/// How long one probe of a server may take: a frozen server accepts a
/// connection and never answers.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long after a failed failover the next attempt comes.
const RETRY_EVERY: Duration = Duration::from_secs(5);
/// How often a shard's servers are looked at (state exported, strays
/// taken back).
const LOOK_EVERY: Duration = Duration::from_secs(2);

/// How often primaries are probed: a quarter of the failover delay, within
/// 100 to 500 ms.
fn probe_every(failover_after_ms: u64) -> Duration {
    Duration::from_millis((failover_after_ms / 4).clamp(100, 500))
}

/// Runs the coordinator until `stop` (returns at once when failovers are
/// manual).
pub async fn watch(settings: Settings, shards: Shards, metrics: FailoverMetrics, stop: CancellationToken) {
    if settings.mysql.failover == FailoverMode::Manual {
        tracing::info!("mysql.failover is manual: no automatic failover from this process");
        return;
    }
    let every = probe_every(settings.mysql.failover_after_ms);
    let mut c = Coordinator {
        after: Duration::from_millis(settings.mysql.failover_after_ms),
        settings,
        shards,
        metrics,
        no_writes_since: HashMap::new(),
        alone_since: HashMap::new(),
        retry_at: HashMap::new(),
        look_at: HashMap::new(),
        locks: HashMap::new(),
    };
    while !stop.is_cancelled() {
        c.round().await;
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => break,
        }
    }
}

struct Coordinator {
    settings: Settings,
    shards: Shards,
    metrics: FailoverMetrics,
    after: Duration,
    /// Shards whose primary has taken no writes since: it has not
    /// answered, or answered read-only (or one, then the other).
    no_writes_since: HashMap<u32, Instant>,
    /// Shards a failover left with a read-only primary, since their
    /// primary stopped answering: the unavailability runs until a rejoin
    /// opens it.
    alone_since: HashMap<u32, Instant>,
    retry_at: HashMap<u32, Instant>,
    look_at: HashMap<u32, Instant>,
    /// This process's failover-lock connections, by the shard they hold
    /// the lock on, with that shard's primary they are on.
    locks: HashMap<usize, (String, ServerConnection)>,
}

impl Coordinator {
    async fn round(&mut self) {
        let t = self.shards.topology();
        let mut up = Vec::new();
        for p in &t.shards {
            self.metrics.zero(&p.name);
            if t.replicas_of(p.id).next().is_none() {
                up.push(p); // Nothing to fail over to; its state is still shown.
                continue;
            }
            let due = self.retry_at.get(&p.id).is_none_or(|at| Instant::now() >= *at);
            let probe = self.probe(&p.address).await;
            if probe == Probe::Writable {
                if self.no_writes_since.remove(&p.id).is_some() {
                    tracing::info!(shard = %p.name, primary = %p.address, "the primary takes writes again");
                }
                self.metrics.blocked.with_label_values(&[&p.name]).set(0);
                up.push(p);
                continue;
            }
            let since = *self.no_writes_since.entry(p.id).or_insert_with(Instant::now);
            let acting = since.elapsed() >= self.after && due;
            if probe == Probe::ReadOnly {
                if acting {
                    self.settle(&t, p, since).await;
                }
                up.push(p);
            } else {
                self.metrics.server(&p.name, &storage::dsn::place_of(&p.address), "primary", false);
                if acting {
                    self.fail_over(&t, p, since).await;
                }
            }
        }
        for p in up {
            self.look_at_servers(&t, p).await;
        }
    }

    /// Whether the primary at `address` answers in time, and whether it
    /// takes writes.
    async fn probe(&self, address: &str) -> Probe {
        let Ok(dsn) = self.shards.credentials_for(address) else { return Probe::Silent };
        match tokio::time::timeout(PROBE_TIMEOUT, read_only(dsn)).await {
            Ok(Some(false)) => Probe::Writable,
            Ok(Some(true)) => Probe::ReadOnly,
            _ => Probe::Silent,
        }
    }

    async fn fail_over(&mut self, t: &Topology, p: &PhysicalShard, since: Instant) {
        if !self.elected(t, p.id as usize).await {
            return;
        }
        // Another coordinator (or the operator) may have done it already.
        if let Err(e) = self.shards.reload().await {
            tracing::debug!(error = %e, "reloading the map before a failover failed");
        }
        let now = self.shards.topology();
        if now.shard(p.id).is_none_or(|q| q.address != p.address) {
            self.no_writes_since.remove(&p.id);
            return;
        }
        tracing::warn!(shard = %p.name, primary = %p.address, down_ms = since.elapsed().as_millis() as u64,
            "the primary does not answer: failing over");
        match fail_over(&self.shards, &self.settings, p, None, false).await {
            Ok(promoted) => self.promoted(p, promoted, since, "primary_unreachable").await,
            Err(e) => {
                self.metrics.blocked.with_label_values(&[&p.name]).set(1);
                self.retry_at.insert(p.id, Instant::now() + RETRY_EVERY);
                tracing::error!(shard = %p.name, error = format!("{e:#}"),
                    "no safe failover: the shard takes no writes until this is resolved; retrying");
            }
        }
    }

    /// What follows a promotion: the metrics, the log, and the map loaded
    /// at once (the next round must see the new primary: a revived old
    /// one would otherwise look like the primary answering again).
    async fn promoted(&mut self, p: &PhysicalShard, promoted: Promoted, since: Instant, reason: &str) {
        self.metrics.failovers.with_label_values(&[&p.name, reason]).inc();
        self.metrics.blocked.with_label_values(&[&p.name]).set(0);
        self.no_writes_since.remove(&p.id);
        self.retry_at.remove(&p.id);
        if promoted.alone {
            self.alone_since.insert(p.id, since);
        } else {
            self.metrics.unavailable.with_label_values(&[&p.name]).set(since.elapsed().as_secs_f64());
        }
        tracing::warn!(shard = %p.name, old = %promoted.old, new = %promoted.new, alone = promoted.alone,
            took_ms = since.elapsed().as_millis() as u64, reason, "failed over");
        if let Err(e) = self.shards.reload_now().await {
            tracing::warn!(shard = %p.name, error = %e, "the map could not be loaded after the failover");
        }
    }

    /// Settles `p`, whose primary has answered read-only since `since`
    /// (see the `settle` module).
    async fn settle(&mut self, t: &Topology, p: &PhysicalShard, since: Instant) {
        if !self.elected(t, p.id as usize).await {
            return;
        }
        match settle(&self.shards, &self.settings, p).await {
            Ok(Settled::FailedOver(promoted)) => self.promoted(p, promoted, since, "primary_read_only").await,
            Ok(Settled::TakenBack { rejoined, refused, opened }) => {
                for server in &rejoined {
                    self.metrics.rejoins.with_label_values(&[&p.name, "ok"]).inc();
                    tracing::warn!(shard = %p.name, server = %server, opened, "took a server back as a replica");
                }
                for why in &refused {
                    self.metrics.rejoins.with_label_values(&[&p.name, "refused"]).inc();
                    tracing::error!(shard = %p.name, error = %why, "a listed replica cannot rejoin");
                }
                if !opened {
                    self.retry_at.insert(p.id, Instant::now() + LOOK_EVERY);
                    return;
                }
                let since = self.alone_since.remove(&p.id).unwrap_or(since);
                self.metrics.unavailable.with_label_values(&[&p.name]).set(since.elapsed().as_secs_f64());
                self.metrics.blocked.with_label_values(&[&p.name]).set(0);
                self.no_writes_since.remove(&p.id);
                self.retry_at.remove(&p.id);
                tracing::warn!(shard = %p.name, primary = %p.address, took_ms = since.elapsed().as_millis() as u64,
                    "a read-only primary holding everything its replicas hold takes writes again");
            }
            Ok(Settled::Writable) => {
                self.no_writes_since.remove(&p.id);
            }
            Ok(Settled::Switching) => {
                self.retry_at.insert(p.id, Instant::now() + LOOK_EVERY);
            }
            Err(e) => {
                self.metrics.blocked.with_label_values(&[&p.name]).set(1);
                self.retry_at.insert(p.id, Instant::now() + RETRY_EVERY);
                tracing::error!(shard = %p.name, error = format!("{e:#}"),
                    "a read-only primary could not be settled: the shard takes no writes until this is resolved; retrying");
            }
        }
    }

    /// Looks at `p`'s servers (at most every [`LOOK_EVERY`]): exports
    /// their state, and takes back the listed replicas that answer without
    /// replicating from its primary.
    async fn look_at_servers(&mut self, t: &Topology, p: &PhysicalShard) {
        if self.look_at.get(&p.id).is_some_and(|at| Instant::now() < *at) {
            return;
        }
        self.look_at.insert(p.id, Instant::now() + LOOK_EVERY);
        let (id, m) = (p.id as usize, self.metrics.clone());
        let Some(primary) = state_of(&self.shards, &self.settings, id, &p.address).await else { return };
        let server = |address: &str| storage::dsn::place_of(address);
        m.server(&p.name, &server(&p.address), "primary", true);
        m.semi_sync_clients.with_label_values(&[&p.name]).set(primary.semi_sync_clients as i64);
        m.semi_sync_waiting.with_label_values(&[&p.name]).set(primary.waiting_commits as i64);
        let Ok(from) = source(&self.settings, &p.address) else { return };
        for r in t.replicas_of(p.id) {
            let at = server(&r.address);
            let Some(state) = state_of(&self.shards, &self.settings, id, &r.address).await else {
                m.server(&p.name, &at, "replica", false);
                continue;
            };
            m.server(&p.name, &at, "replica", true);
            m.replica_behind
                .with_label_values(&[&p.name, &at])
                .set(state.current.behind(&primary.current) as i64);
            let lag = state.replica.as_ref().and_then(|r| r.lag_secs).map_or(-1.0, |s| s as f64);
            m.replica_lag.with_label_values(&[&p.name, &at]).set(lag);
            // Pointed at the primary with a thread running (one stopped by
            // hand is the operator's); a restarted server has neither.
            let follows = state.replica.is_some_and(|r| {
                r.master_host == from.host && r.master_port == from.port && (r.io_running || r.sql_running)
            });
            if !follows && self.elected(t, id).await {
                self.rejoin(p, &r.address).await;
            }
        }
    }

    /// Takes the server at `address` back as a replica of `p`, under the
    /// shard's switchover lock (none while a switchover holds it).
    async fn rejoin(&mut self, p: &PhysicalShard, address: &str) {
        let _held = match hold(&self.shards, &self.settings, p).await {
            Ok(Some(held)) => held,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(shard = %p.name, error = format!("{e:#}"), "the switchover lock was not taken");
                return;
            }
        };
        match rejoin(&self.shards, &self.settings, p, address).await {
            Ok(Rejoin::Replicating) => {}
            Ok(Rejoin::Rejoined { opened }) => {
                self.metrics.rejoins.with_label_values(&[&p.name, "ok"]).inc();
                tracing::warn!(shard = %p.name, server = %address, opened, "took a server back as a replica");
                if let Some(since) = self.alone_since.remove(&p.id).filter(|_| opened) {
                    self.metrics.unavailable.with_label_values(&[&p.name]).set(since.elapsed().as_secs_f64());
                }
            }
            Err(e) => {
                self.metrics.rejoins.with_label_values(&[&p.name, "refused"]).inc();
                tracing::error!(shard = %p.name, server = %address, error = format!("{e:#}"),
                    "a listed replica cannot rejoin");
            }
        }
    }

    /// Whether this process holds the failover lock that elects the
    /// coordinator of `shard` (see the module docs).
    async fn elected(&mut self, t: &Topology, shard: usize) -> bool {
        let on = if shard == META_SHARD {
            match t.shards.iter().map(|p| p.id as usize).filter(|id| *id != META_SHARD).min() {
                Some(deputy) => deputy,
                None => return true,
            }
        } else {
            META_SHARD
        };
        let Some(address) = t.shard(on as u32).map(|p| p.address.clone()) else { return false };
        if self.locks.get(&on).is_some_and(|(at, _)| *at != address) {
            self.locks.remove(&on);
        }
        if !self.locks.contains_key(&on) {
            let Ok(dsn) = self.shards.credentials_for(&address) else { return false };
            match tokio::time::timeout(PROBE_TIMEOUT * 2, dedicated_connection(&dsn)).await {
                Ok(Ok(conn)) => {
                    self.locks.insert(on, (address, conn));
                }
                _ => return false,
            }
        }
        let (_, conn) = self.locks.get_mut(&on).expect("inserted above");
        match tokio::time::timeout(PROBE_TIMEOUT, locks::try_failover_lock(on, conn)).await {
            Ok(Ok(held)) => held,
            _ => {
                self.locks.remove(&on);
                false
            }
        }
    }
}

/// What a probe of a primary found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    Silent,
    Writable,
    ReadOnly,
}

/// Whether the server behind `dsn` is read-only; `None` when it does not
/// answer.
async fn read_only(dsn: schemas::settings::Dsn) -> Option<bool> {
    let mut conn = dedicated_connection(&dsn).await.ok()?;
    let on: String =
        sqlx::query_scalar("SELECT CAST(@@read_only AS CHAR)").fetch_one(&mut conn).await.ok()?;
    Some(matches!(on.trim(), "1" | "ON" | "on"))
}

/// The replication state of the server at `address`, if it answers.
async fn state_of(
    shards: &Shards,
    settings: &Settings,
    shard: usize,
    address: &str,
) -> Option<storage::replication::ServerState> {
    // A frozen server accepts a connection and never answers: it must not
    // hold up the round (and every other shard's failover with it).
    let ask = async {
        let mut s = reach(shards, settings, shard, address).await.ok()?;
        server_state(shard, &mut s.conn).await.ok()
    };
    tokio::time::timeout(PROBE_TIMEOUT * 2, ask).await.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::probe_every;
    use std::time::Duration;

    #[test]
    fn primaries_are_probed_four_times_per_failover_delay_within_bounds() {
        assert_eq!(probe_every(3000), Duration::from_millis(500));
        assert_eq!(probe_every(1000), Duration::from_millis(250));
        assert_eq!(probe_every(200), Duration::from_millis(100));
    }
}
