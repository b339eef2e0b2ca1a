//! The replica watch: how old each replica's data may be, measured often
//! enough for `reader.max_replica_lag_ms` to mean what it says. It runs in
//! readers with `reader.read_from = "replicas"`.
//!
//! Every [`probe_every`], for each shard with replicas, it reads the
//! primary's GTID position (`@@gtid_current_pos`) and remembers when it
//! asked, then asks each replica its position and who it is. A replica
//! whose position includes one its primary had at instant `t` holds every
//! transaction committed before `t`, so its data is at most `now - t` old:
//! an upper bound, in milliseconds, good to about a probe interval. (MariaDB's
//! `Seconds_Behind_Master` is whole seconds, 0 while the I/O thread is the
//! one behind, and NULL with a thread stopped.) A replica that stops
//! applying (its SQL thread stopped, its primary gone) keeps the last
//! instant it was current and leaves routing once that is more than the
//! bound ago, while the primary takes writes; a replica that does not
//! answer within [`PROBE_TIMEOUT`], answers as another shard's server, or
//! has no primary to replicate from (a former primary back but not yet
//! rejoined) is down and leaves routing at once. Positions compare as
//! `GtidPos::holds`: a forked history's transaction under the primary's
//! number does not count.
//!
//! What it finds goes on each replica (`storage::shards::Seen`), where
//! `routing` reads it, and to `bagstore_reader_replicas_usable`.

use schemas::gtid::GtidPos;
use schemas::settings::ReadFrom;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};
use storage::dsn::place_of;
use storage::shards::{Replica, Seen};
use storage::{replication, topology};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::Reader;

/// How long a server may take to answer a probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// How often replicas are probed for a lag bound of `max_lag`: a fifth of
/// it, within 10 to 250 ms (a replica just past the bound is out of
/// routing within about a probe).
pub fn probe_every(max_lag: Duration) -> Duration {
    (max_lag / 5).clamp(Duration::from_millis(10), Duration::from_millis(250))
}

/// One shard's primary positions, each with the instant it was asked for,
/// oldest first: as many as a replica within the bound can be current as
/// of.
#[derive(Debug, Default)]
struct Samples {
    /// The primary they were read on (after a failover, the new primary's
    /// positions are a new history).
    primary: String,
    at: VecDeque<(Instant, GtidPos)>,
    /// Whether each replica (by place) was usable at the last probe, so a
    /// change is logged once.
    serving: HashMap<String, bool>,
}

impl Reader {
    /// Starts the replica watch, if reads go to replicas.
    pub fn spawn_replica_watch(&self, tracker: &TaskTracker, stop: CancellationToken) {
        if self.settings().reader.read_from != ReadFrom::Replicas {
            return;
        }
        let reader = self.clone();
        tracker.spawn(async move { reader.watch_replicas(stop).await });
    }

    async fn watch_replicas(&self, stop: CancellationToken) {
        let every = probe_every(self.max_replica_lag());
        let mut samples: HashMap<usize, Samples> = HashMap::new();
        loop {
            for shard in self.shards().ids() {
                self.probe_shard(shard, &mut samples).await;
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    /// One probe of `shard`'s primary and replicas.
    async fn probe_shard(&self, shard: usize, samples: &mut HashMap<usize, Samples>) {
        let usable = self.inner.metrics.usable_replicas.with_label_values(&[&shard.to_string()]);
        let replicas = self.shards().replicas(shard);
        if replicas.is_empty() {
            samples.remove(&shard);
            usable.set(0);
            return;
        }
        let max = self.max_replica_lag();
        let primary = place_of(self.shards().dsn(shard).expose());
        let s = samples.entry(shard).or_default();
        if s.primary != primary {
            *s = Samples { primary, ..Samples::default() };
        }
        let asked = Instant::now();
        let position = replication::current_position(shard, self.shards().pool(shard));
        // A primary that does not answer gives no newer instant: the
        // replicas age until it does (or a failover replaces it).
        if let Ok(Ok(pos)) = tokio::time::timeout(PROBE_TIMEOUT, position).await {
            s.at.push_back((asked, pos));
        }
        let keep = max + probe_every(max);
        while s.at.len() > 1 && s.at.front().is_some_and(|(t, _)| t.elapsed() > keep) {
            s.at.pop_front();
        }
        let found = futures::future::join_all(replicas.iter().map(|r| probe(shard, r))).await;
        let now = Instant::now();
        let mut n = 0;
        for (r, pos) in replicas.iter().zip(found) {
            let was = r.seen();
            let seen = match pos {
                None => Seen { up: false, ..was },
                Some(pos) => {
                    let newest = s.at.iter().rev().find(|(_, p)| pos.holds(p)).map(|(t, _)| *t);
                    Seen { up: true, current_as_of: newest.max(was.current_as_of) }
                }
            };
            r.observe(seen);
            let within = r.staleness(now).is_some_and(|lag| lag <= max);
            if s.serving.insert(r.place().to_string(), within) != Some(within) {
                let lag_ms = r.staleness(now).map(|l| l.as_millis() as u64);
                tracing::info!(shard, replica = %r.place(), up = seen.up, ?lag_ms, serving = within,
                    "a replica {} read routing", if within { "joins" } else { "leaves" });
            }
            n += i64::from(within);
        }
        usable.set(n);
    }
}

/// A replica's position, if it answers within [`PROBE_TIMEOUT`] as a
/// server of `shard` that replicates (its threads may be stopped).
async fn probe(shard: usize, r: &Replica) -> Option<GtidPos> {
    let ask = async {
        let mut conn = r.pool().acquire().await.ok()?;
        let id = topology::identity_on(shard, &mut conn).await.ok()??;
        if id.physical as usize != shard {
            return None;
        }
        replication::replica_state(shard, &mut conn).await.ok()??;
        replication::current_position(shard, &mut *conn).await.ok()
    };
    tokio::time::timeout(PROBE_TIMEOUT, ask).await.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_come_a_fifth_of_the_bound_apart_within_limits() {
        assert_eq!(probe_every(Duration::from_millis(1000)), Duration::from_millis(200));
        assert_eq!(probe_every(Duration::from_millis(60_000)), Duration::from_millis(250));
        assert_eq!(probe_every(Duration::from_millis(20)), Duration::from_millis(10));
        assert_eq!(probe_every(Duration::ZERO), Duration::from_millis(10));
    }
}
