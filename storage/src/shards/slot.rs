//! A physical shard's connections, replaceable while a process runs.
//!
//! A failover or a switchover moves a physical shard to another server:
//! the map records the new primary's address, and a process that loads it
//! must reach the new server without a restart. Callers borrow a shard's
//! pool and hot-path connections for as long as the `Shards` lives, so a
//! slot never drops what it handed out: it keeps every server it was on
//! (a generation each, the old ones' pools closed) and points at the
//! newest. [`GENERATIONS`] bounds how often one process follows a shard
//! to another server.

use schemas::settings::Dsn;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::conns::Conns;
use crate::dsn::{connect_options, place_of};
use crate::error::{Result, StoreError};

/// Servers one physical shard can move to within one process's life (a
/// failover each); past it the process must be restarted.
pub(crate) const GENERATIONS: usize = 64;

/// How to reach the server a physical shard is on.
#[derive(Debug)]
pub(crate) struct Server {
    pub(crate) name: String,
    pub(crate) dsn: Dsn,
    /// `host:port/database` of `dsn`: what tells two servers apart.
    pub(crate) place: String,
    pub(crate) pool: MySqlPool,
    pub(crate) conns: Arc<Conns>,
}

/// Every server a physical shard was on in this process, newest current.
#[derive(Debug)]
pub(crate) struct Slot {
    current: AtomicUsize,
    /// The shard's failover count (see `schemas::topology::PhysicalShard`)
    /// its current server stands for: a map with a higher one moves it.
    failovers: AtomicU64,
    gens: Box<[OnceLock<Server>]>,
    /// Held while a generation is added.
    moving: Mutex<()>,
}

/// How servers' pools are made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolSizes {
    pub(crate) max_connections: u32,
    pub(crate) connect_timeout: Duration,
}

impl Server {
    pub(crate) fn open(id: usize, name: &str, dsn: Dsn, sizes: PoolSizes) -> Result<Server> {
        let opts = connect_options(&dsn)?;
        let conns = Arc::new(Conns::new(id, opts.clone(), sizes.max_connections));
        let pool = MySqlPoolOptions::new()
            .max_connections(sizes.max_connections)
            .acquire_timeout(sizes.connect_timeout)
            // READ COMMITTED: a locking read of an absent id takes no gap
            // lock, so concurrent inserts of different new ids do not
            // deadlock; two inserts of the same new id collide on the unique
            // key instead, and the loser retries.
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .execute(&mut *conn)
                        .await
                        .map(|_| ())
                })
            })
            .connect_lazy_with(opts);
        Ok(Server { name: name.to_string(), place: place_of(dsn.expose()), dsn, pool, conns })
    }
}

impl Slot {
    pub(crate) fn new(id: usize, name: &str, dsn: Dsn, failovers: u64, sizes: PoolSizes) -> Result<Slot> {
        let gens: Box<[OnceLock<Server>]> = (0..GENERATIONS).map(|_| OnceLock::new()).collect();
        let _ = gens[0].set(Server::open(id, name, dsn, sizes)?);
        Ok(Slot {
            current: AtomicUsize::new(0),
            failovers: AtomicU64::new(failovers),
            gens,
            moving: Mutex::new(()),
        })
    }

    /// The failover count the current server stands for.
    pub(crate) fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Acquire)
    }

    /// Takes the current server as the shard's `failovers`-th primary (it
    /// was found to take writes).
    pub(crate) fn adopt(&self, failovers: u64) {
        self.failovers.fetch_max(failovers, Ordering::AcqRel);
    }

    /// Which of the servers the shard was on in this process is current
    /// (0 first; one more after each move).
    pub(crate) fn generation(&self) -> usize {
        self.current.load(Ordering::Acquire)
    }

    pub(crate) fn current(&self) -> &Server {
        self.gens[self.current.load(Ordering::Acquire)].get().expect("the current generation is set")
    }

    /// Every generation, oldest first (to close them all).
    pub(crate) fn all(&self) -> impl Iterator<Item = &Server> {
        self.gens.iter().filter_map(OnceLock::get)
    }

    /// Points the slot at the server behind `dsn` (standing for the
    /// shard's `failovers`-th primary), unless it is there already; true if
    /// it moved. The old server's pool is closed (what borrowed it gets
    /// errors and goes through the map again).
    pub(crate) fn move_to(&self, id: usize, dsn: Dsn, failovers: u64, sizes: PoolSizes) -> Result<bool> {
        let _one = self.moving.lock().expect("not poisoned");
        self.failovers.fetch_max(failovers, Ordering::AcqRel);
        let now = self.current.load(Ordering::Acquire);
        let old = self.gens[now].get().expect("the current generation is set");
        if old.place == place_of(dsn.expose()) {
            return Ok(false);
        }
        let next = now + 1;
        if next >= GENERATIONS {
            return Err(StoreError::BadTopology(format!(
                "physical shard {id} moved to another server {GENERATIONS} times in this process; restart it"
            )));
        }
        let _ = self.gens[next].set(Server::open(id, &old.name, dsn, sizes)?);
        self.current.store(next, Ordering::Release);
        tracing::info!(shard = id, from = %old.place, to = %self.current().place, "the shard moved to another server");
        let pool = old.pool.clone();
        tokio::spawn(async move { pool.close().await });
        Ok(true)
    }
}

/// Following a shard from server to server.
impl super::Shards {
    /// How many times physical shard `shard` moved to another server in
    /// this process (a failover or a switchover each): work tied to the
    /// server it was on can tell that it no longer is.
    pub fn generation(&self, shard: usize) -> usize {
        self.inner.slots[shard].get().map_or(0, Slot::generation)
    }

    /// Returns once physical shard `shard` is no longer on the server of
    /// `generation` (looked at every 200 ms). Work stuck on a server the
    /// shard left — a frozen or cut-off old primary answers nothing, a
    /// commit there waits for an acknowledgement nobody gives — races this
    /// to let go of it.
    pub async fn moved(&self, shard: usize, generation: usize) {
        while self.generation(shard) == generation {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Runs `work` on physical shard `shard`'s current server, and gives
    /// it up should the shard move to another server first: it then fails
    /// as its closed pool would (transient: run again, it goes to the new
    /// server).
    pub async fn unless_moved<T>(
        &self,
        shard: usize,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let generation = self.generation(shard);
        tokio::select! {
            done = work => done,
            _ = self.moved(shard, generation) => Err(StoreError::Shard { shard, source: sqlx::Error::PoolClosed }),
        }
    }
}
