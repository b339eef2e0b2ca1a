//! The replicas of each physical shard, as reads reach them
//! (`reader.read_from = "replicas"`).
//!
//! The map lists each physical shard's replicas. [`ReplicaSets`] keeps a
//! pool and hot-path connections per listed replica and follows the map
//! as it changes: a replica the map no longer lists (removed, or promoted
//! to its shard's primary) leaves its set at the next map load and its
//! pool is closed; a newly listed one is reached lazily, and serves no
//! read before it has been seen current. Like a shard's slot, a set never
//! invalidates what it handed out: replicas are shared ([`Arc`]), so a
//! read holding one that has just left keeps a valid handle whose
//! statements fail, and reads the primary instead.
//!
//! Each replica carries what was last seen of it ([`Seen`]): whether it
//! answered as a server of its shard, and the newest moment its primary
//! held nothing it lacked. Whoever routes reads measures that (the
//! reader's replica watch) and decides with it; nothing here does.

use schemas::settings::Dsn;
use schemas::topology::{PhysicalId, Topology};
use sqlx::mysql::MySqlPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::slot::{PoolSizes, Server};
use crate::conns::Conns;
use crate::dsn::place_of;
use crate::error::Result;

/// One replica of a physical shard.
#[derive(Debug)]
pub struct Replica {
    /// The physical shard it replicates.
    pub shard: usize,
    /// Its address as the map lists it (a DSN without password).
    pub address: String,
    server: Server,
    seen: Mutex<Seen>,
}

/// What was last seen of a replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seen {
    /// It answered, as a server of its shard.
    pub up: bool,
    /// The newest moment its shard's primary held nothing the replica
    /// lacks (None: never seen so). A replica only gains transactions, so
    /// this stays true of it as time passes: its data is at most
    /// `now - current_as_of` old.
    pub current_as_of: Option<Instant>,
}

impl Replica {
    /// Ping-free connections for reads (see [`crate::conns`]).
    pub fn conns(&self) -> &Conns {
        &self.server.conns
    }

    pub fn pool(&self) -> &MySqlPool {
        &self.server.pool
    }

    /// `host:port/database`: what tells two servers apart.
    pub fn place(&self) -> &str {
        &self.server.place
    }

    pub fn seen(&self) -> Seen {
        *self.seen.lock().expect("not poisoned")
    }

    /// Records what a probe found.
    pub fn observe(&self, seen: Seen) {
        *self.seen.lock().expect("not poisoned") = seen;
    }

    /// How old its data may be at `now`: None while it is down or was
    /// never seen current.
    pub fn staleness(&self, now: Instant) -> Option<Duration> {
        let seen = self.seen();
        if !seen.up {
            return None;
        }
        seen.current_as_of.map(|at| now.saturating_duration_since(at))
    }
}

/// Every physical shard's replicas, as the last map loaded lists them.
#[derive(Debug, Default)]
pub(crate) struct ReplicaSets {
    by_shard: RwLock<HashMap<usize, Arc<[Arc<Replica>]>>>,
}

impl ReplicaSets {
    /// The replicas of physical shard `shard` (empty when it has none).
    pub(crate) fn of(&self, shard: usize) -> Arc<[Arc<Replica>]> {
        self.by_shard.read().expect("not poisoned").get(&shard).cloned().unwrap_or_else(|| Arc::from([]))
    }

    /// Makes the sets those `t` lists: replicas still listed are kept as
    /// they are (with what was seen of them), new ones reached at their
    /// address through `dsn_of`, and those no longer listed dropped with
    /// their pools closed. A replica listed at its shard's primary's
    /// address (a map written mid-promotion) is no replica.
    pub(crate) fn follow(
        &self,
        t: &Topology,
        dsn_of: impl Fn(&str) -> Result<Dsn>,
        sizes: PoolSizes,
    ) -> Result<()> {
        let old = self.by_shard.read().expect("not poisoned").clone();
        let mut next: HashMap<usize, Arc<[Arc<Replica>]>> = HashMap::new();
        for p in &t.shards {
            let shard = p.id as usize;
            let kept = old.get(&shard);
            let primary = place_of(&p.address);
            let mut set: Vec<Arc<Replica>> = Vec::new();
            for r in t.replicas_of(p.id as PhysicalId) {
                let place = place_of(&r.address);
                if place == primary || set.iter().any(|s| s.place() == place) {
                    continue;
                }
                match kept.and_then(|k| k.iter().find(|s| s.place() == place)) {
                    Some(same) => set.push(same.clone()),
                    None => {
                        let server = Server::open(shard, &p.name, dsn_of(&r.address)?, sizes)?;
                        let seen = Mutex::new(Seen::default());
                        set.push(Arc::new(Replica { shard, address: r.address.clone(), server, seen }));
                    }
                }
            }
            if !set.is_empty() {
                next.insert(shard, set.into());
            }
        }
        let gone: Vec<Arc<Replica>> = old
            .values()
            .flat_map(|set| set.iter())
            .filter(|r| !next.get(&r.shard).is_some_and(|set| set.iter().any(|s| Arc::ptr_eq(s, r))))
            .cloned()
            .collect();
        *self.by_shard.write().expect("not poisoned") = next;
        for r in gone {
            tracing::info!(shard = r.shard, replica = %r.place(), "a replica left the map; reads no longer go to it");
            let pool = r.pool().clone();
            tokio::spawn(async move { pool.close().await });
        }
        Ok(())
    }

    /// Every replica's pool, to close them all.
    pub(crate) fn pools(&self) -> Vec<MySqlPool> {
        let sets = self.by_shard.read().expect("not poisoned");
        sets.values().flat_map(|set| set.iter().map(|r| r.pool().clone())).collect()
    }
}
