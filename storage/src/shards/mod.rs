//! The physical shards of a cluster, how to reach them, and the map a
//! process routes with.
//!
//! Each physical shard's database knows its own name and id
//! ([`crate::topology::identity`]), so the configuration is just a set of
//! DSNs in any order: [`Shards::connect`] asks each who it is, loads the map
//! from the metadata shard, and refuses a configuration that does not name
//! exactly the registered shards. Shards registered later (`bagstore shards
//! add`) are picked up by [`Shards::reload`]: their address comes from the
//! map, their credentials from the metadata shard's DSN in the
//! configuration (one account for the whole cluster).
//!
//! Slots are indexed by physical id and never move, so pools and
//! connections can be borrowed for as long as the `Shards` lives; a slot
//! follows its shard to another server when the map says the shard's
//! primary moved (a failover, a switchover: see [`slot`]). Each shard's
//! replicas, which reads may use, follow the map the same way (see
//! [`replicas`]).

use schemas::settings::{Dsn, MysqlSettings};
use schemas::topology::{PhysicalId, Topology};
use schemas::{logical_of, EntityId};
use sqlx::mysql::MySqlPool;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use crate::conns::Conns;
use crate::dsn::with_credentials_of;
use crate::error::{OnShard, Result, StoreError};
use crate::topology::{self, META_SHARD};

mod discovery;
mod replicas;
mod slot;
pub use replicas::{Replica, Seen};
use slot::{PoolSizes, Server, Slot};

/// The most physical shards a cluster can ever have registered.
pub const MAX_PHYSICAL: usize = 1024;

/// How long a starting process waits for a configured server that
/// refuses connections once another configured server has answered.
const SILENT_GRACE: Duration = Duration::from_secs(1);

/// Reloads of the map closer together than this are served by the last.
const RELOAD_EVERY: Duration = Duration::from_millis(50);

/// The shards of one cluster. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Shards {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    settings: MysqlSettings,
    /// By physical id; set when the shard is first reached, moved to
    /// another server when its primary moves.
    slots: Vec<OnceLock<Slot>>,
    routing: RwLock<Arc<Routing>>,
    /// When the map was last loaded; held while loading.
    reloaded: tokio::sync::Mutex<Option<Instant>>,
    /// Map loads since the process started (a storm of them means maps
    /// keep going stale).
    reloads: AtomicU64,
    /// The configured DSNs of the metadata shard's servers: where its
    /// primary is looked for again when the one in use stops being it.
    meta_seeds: RwLock<Vec<Dsn>>,
    /// Each shard's replicas, as the map lists them.
    replicas: replicas::ReplicaSets,
}

impl Routing {
    /// Logical shards of the cluster.
    pub fn logical_shards(&self) -> u16 {
        self.topology.as_ref().map_or(schemas::shard::DEFAULT_LOGICAL_SHARDS, |t| t.logical_shards)
    }

    /// The physical shard owning logical shard `k` in this map (by `k mod
    /// N` before a cluster exists).
    pub fn of_logical(&self, k: u16) -> usize {
        match &self.topology {
            Some(t) => t.owner(k) as usize,
            None => self.live[k as usize % self.live.len()],
        }
    }

    /// The physical shard an entity lives on in this map.
    pub fn of_id(&self, id: &EntityId) -> usize {
        self.of_logical(logical_of(id.as_bytes(), self.logical_shards()))
    }

    /// The epoch this map gives physical shard `shard`: a read that routed
    /// with this map and found another epoch on the shard read a shard the
    /// map is stale about ([`StoreError::StaleMap`]).
    pub fn epoch_of(&self, shard: usize) -> u64 {
        self.topology.as_ref().and_then(|t| t.shard(shard as PhysicalId)).map_or(0, |p| p.epoch)
    }

    /// `ids` grouped by the physical shard each lives on in this map (one
    /// list per physical id up to the highest live one, possibly empty),
    /// keeping their order: what a fan-out by entity needs.
    pub fn by_shard(&self, ids: &[EntityId]) -> Vec<Vec<EntityId>> {
        let mut out = vec![Vec::new(); self.slots_len()];
        for id in ids {
            out[self.of_id(id)].push(*id);
        }
        out
    }

    /// One past the highest live physical id.
    pub fn slots_len(&self) -> usize {
        self.live.iter().max().map_or(0, |m| m + 1)
    }
}

/// What a process routes with: the map it loaded (none before `migrate`
/// made the cluster), and the physical shards live in it.
#[derive(Debug, Clone)]
pub struct Routing {
    pub topology: Option<Topology>,
    /// Physical ids of the registered shards (with a slot), in order.
    pub live: Vec<usize>,
}

impl Shards {
    /// The configured DSNs as shards `0..N` in configuration order, without
    /// a map: for `migrate` before the cluster exists. Pools connect lazily.
    pub fn configured(settings: &MysqlSettings) -> Result<Shards> {
        let shards = Shards::empty(settings);
        for (i, dsn) in settings.shards.iter().enumerate() {
            shards.set_slot(i, &format!("s{i}"), dsn.clone(), 0)?;
        }
        let live = (0..settings.shards.len()).collect();
        *shards.inner.routing.write().expect("not poisoned") = Arc::new(Routing { topology: None, live });
        Ok(shards)
    }

    fn empty(settings: &MysqlSettings) -> Shards {
        Shards {
            inner: Arc::new(Inner {
                settings: settings.clone(),
                slots: (0..MAX_PHYSICAL).map(|_| OnceLock::new()).collect(),
                routing: RwLock::new(Arc::new(Routing { topology: None, live: Vec::new() })),
                reloaded: tokio::sync::Mutex::new(None),
                reloads: AtomicU64::new(0),
                meta_seeds: RwLock::new(Vec::new()),
                replicas: replicas::ReplicaSets::default(),
            }),
        }
    }

    fn sizes(&self) -> PoolSizes {
        let s = &self.inner.settings;
        PoolSizes {
            max_connections: s.max_connections,
            connect_timeout: Duration::from_millis(s.connect_timeout_ms),
        }
    }

    /// Reaches physical shard `id` at `dsn`, the server of its
    /// `failovers`-th primary: its slot is made, or, when it was on another
    /// server, moved there.
    fn set_slot(&self, id: usize, name: &str, dsn: Dsn, failovers: u64) -> Result<()> {
        if id >= MAX_PHYSICAL {
            return Err(StoreError::BadTopology(format!(
                "physical shard id {id} is over the limit of {MAX_PHYSICAL}"
            )));
        }
        match self.inner.slots[id].get() {
            Some(slot) => slot.move_to(id, dsn, failovers, self.sizes()).map(|_| ()),
            None => {
                let _ = self.inner.slots[id].set(Slot::new(id, name, dsn, failovers, self.sizes())?);
                Ok(())
            }
        }
    }

    /// The configured shards as the cluster knows them: asks each database
    /// who it is, loads the map from the metadata shard, and checks that the
    /// configuration names exactly the registered shards (and, if it gives
    /// one, the cluster's number of logical shards). Waits up to
    /// `connect_timeout_ms` for the databases to answer.
    pub async fn connect(settings: &MysqlSettings) -> Result<Shards> {
        // Several DSNs may name one physical shard: its servers (a primary
        // and replicas, in any role: seeds to find the primary among).
        let mut servers: BTreeMap<PhysicalId, Vec<(topology::Identity, Dsn)>> = BTreeMap::new();
        let mut silent = 0;
        for (dsn, id) in settings.shards.iter().zip(Shards::ask_configured(settings).await?) {
            // A server that does not answer (a dead primary, say) is left
            // out; the map names its shard's servers.
            let id = match id {
                Ok(id) => id,
                Err(e) => {
                    tracing::warn!(server = %dsn.redacted(), error = %e, "a configured server does not answer; going on without it");
                    silent += 1;
                    continue;
                }
            };
            let Some(id) = id else {
                return Err(StoreError::BadTopology(format!(
                    "{} is not a shard of a bagstore cluster (run `bagstore migrate` for a new cluster, \
                     or `bagstore shards add` for a new shard)",
                    dsn.redacted()
                )));
            };
            servers.entry(id.physical).or_default().push((id, dsn.clone()));
        }
        let shards = Shards::empty(settings);
        let Some(meta) = servers.get(&(META_SHARD as PhysicalId)) else {
            return Err(StoreError::BadTopology(
                "the configuration lacks the metadata shard (physical shard 0, the first of the cluster)"
                    .into(),
            ));
        };
        *shards.inner.meta_seeds.write().expect("not poisoned") =
            meta.iter().map(|(_, d)| d.clone()).collect();
        for (physical, found) in &servers {
            let (id, dsn) = discovery::primary_among(*physical as usize, found).await?;
            // The failover count is the map's, once loaded (`install`).
            shards.set_slot(*physical as usize, &id.name, dsn, 0)?;
        }
        let t = topology::load(shards.meta()).await?.ok_or_else(|| {
            StoreError::BadTopology("the metadata shard holds no cluster map (run `bagstore migrate`)".into())
        })?;
        let names: BTreeSet<String> = servers.values().map(|found| found[0].0.name.clone()).collect();
        match t.check_config(&names, settings.logical_shards) {
            // Its configured server is among the silent ones.
            Err(schemas::topology::TopologyError::MissingShard { .. }) if silent > 0 => {}
            checked => checked.map_err(StoreError::Topology)?,
        }
        shards.settle_primaries(&t).await?;
        shards.install(t)?;
        if !discovery::is_writable(META_SHARD, shards.meta()).await.unwrap_or(false) {
            shards.follow_meta_primary().await?;
        }
        Ok(shards)
    }

    /// A data shard's primary is the one the map names, when it takes
    /// writes: a configured server elsewhere (a replica, or a former
    /// primary listed in a configuration written before a failover,
    /// writable or not: one a failover could not reach is not fenced)
    /// gives way to it. When the map's address does not take writes and
    /// the configured server does, the configured one stays (`bagstore dev`
    /// restarted its servers on other ports than the map recorded). The
    /// metadata shard's is found among its servers instead
    /// ([`Shards::follow_meta_primary`]).
    async fn settle_primaries(&self, t: &Topology) -> Result<()> {
        for p in &t.shards {
            let id = p.id as usize;
            let Some(slot) = self.inner.slots.get(id).and_then(OnceLock::get) else { continue };
            if id == META_SHARD || slot.current().place == crate::dsn::place_of(&p.address) {
                slot.adopt(p.failovers);
                continue;
            }
            let named = self.credentials_for(&p.address)?;
            if discovery::answers_writable(id, &named).await
                || !discovery::is_writable(id, &slot.current().pool).await.unwrap_or(false)
            {
                self.set_slot(id, &p.name, named, p.failovers)?;
            } else {
                slot.adopt(p.failovers);
            }
        }
        Ok(())
    }

    /// Who each configured database says it is (`None`: not a shard, or no
    /// such database yet), in configuration order. Writes nothing. Waits up
    /// to `connect_timeout_ms` for the servers to answer.
    pub async fn identities(settings: &MysqlSettings) -> Result<Vec<Option<topology::Identity>>> {
        Shards::ask_configured(settings).await?.into_iter().collect()
    }

    /// [`Shards::identities`], with each server that did not answer in
    /// time as its error rather than the whole answer's. A server that
    /// refuses connections is waited for up to `connect_timeout_ms` while
    /// no configured server has answered (a cluster starting), and for
    /// [`SILENT_GRACE`] once one has (a dead server of a running cluster:
    /// its shard's other servers are asked instead).
    async fn ask_configured(settings: &MysqlSettings) -> Result<Vec<Result<Option<topology::Identity>>>> {
        let probe = Shards::configured(settings)?;
        let deadline = Instant::now() + Duration::from_millis(settings.connect_timeout_ms);
        // When a configured server first answered.
        let answered: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
        let ask = |i: usize| {
            let (probe, answered) = (&probe, &answered);
            async move {
                loop {
                    let first = *answered.lock().expect("not poisoned");
                    let until = first.map_or(deadline, |at| deadline.min(at + SILENT_GRACE));
                    match topology::identity(i, probe.pool(i)).await {
                        Ok(id) => {
                            answered.lock().expect("not poisoned").get_or_insert_with(Instant::now);
                            return Ok(Ok(id));
                        }
                        Err(e) if e.mysql_number() == Some(1049) => return Ok(Ok(None)),
                        Err(e) if e.is_dead_connection() && Instant::now() < until => {
                            tokio::time::sleep(Duration::from_millis(200)).await
                        }
                        Err(e)
                            if e.is_dead_connection()
                                || matches!(
                                    e,
                                    StoreError::Shard { source: sqlx::Error::PoolTimedOut, .. }
                                ) =>
                        {
                            return Ok(Err(e))
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        };
        let answers = futures::future::join_all((0..settings.shards.len()).map(ask)).await;
        probe.close().await;
        answers.into_iter().collect()
    }

    /// Makes `t` the map routed with, reaching shards registered since, and
    /// shards whose primary changed (a failover) since this process reached
    /// them, at the map's address with the metadata shard's credentials.
    /// (The metadata shard itself is found among its servers: the map is
    /// read from it.)
    fn install(&self, t: Topology) -> Result<()> {
        for p in &t.shards {
            let id = p.id as usize;
            let known = self.inner.slots.get(id).and_then(OnceLock::get);
            let moved = known.is_some_and(|s| id != META_SHARD && p.failovers > s.failovers());
            if id < MAX_PHYSICAL && (known.is_none() || moved) {
                let dsn = self.credentials_for(&p.address)?;
                self.set_slot(id, &p.name, dsn, p.failovers)?;
            }
        }
        self.inner.replicas.follow(&t, |address| self.credentials_for(address), self.sizes())?;
        let live = t.shards.iter().map(|p| p.id as usize).collect();
        *self.inner.routing.write().expect("not poisoned") = Arc::new(Routing { topology: Some(t), live });
        Ok(())
    }

    /// `address` (a DSN without password, as the map records servers) with
    /// the metadata shard's user and password: how this process reaches
    /// any server of the cluster.
    pub fn credentials_for(&self, address: &str) -> Result<Dsn> {
        let meta = &self.slot(META_SHARD).dsn;
        Ok(Dsn(with_credentials_of(address, meta.expose())))
    }

    /// Loads the map again (at most every [`RELOAD_EVERY`]; concurrent
    /// callers share one load): after a write found its shard does not own
    /// what it wrote, or a read found a shard's epoch moved.
    pub async fn reload(&self) -> Result<()> {
        self.load_map(false).await
    }

    /// Loads the map again now, whenever the last load was: after this
    /// process changed it (a failover it coordinated), a load that began
    /// before the change must not stand for one after it.
    pub async fn reload_now(&self) -> Result<()> {
        self.load_map(true).await
    }

    async fn load_map(&self, now: bool) -> Result<()> {
        let mut last = self.inner.reloaded.lock().await;
        if !now && last.is_some_and(|t| t.elapsed() < RELOAD_EVERY) {
            return Ok(());
        }
        self.follow_meta_primary().await?;
        let t = topology::load(self.meta()).await?;
        *last = Some(Instant::now());
        self.inner.reloads.fetch_add(1, Ordering::Relaxed);
        match t {
            Some(t) => self.install(t),
            None => Ok(()),
        }
    }

    /// Makes sure the metadata shard's slot is on its primary: when the
    /// server in use no longer answers as a writable primary (dead, or
    /// fenced by a failover), its primary is looked for among its
    /// configured servers and the replicas the last map knew.
    async fn follow_meta_primary(&self) -> Result<()> {
        if discovery::is_writable(META_SHARD, self.meta()).await.unwrap_or(false) {
            return Ok(());
        }
        let mut candidates: Vec<Dsn> = self.inner.meta_seeds.read().expect("not poisoned").clone();
        if let Some(t) = self.routing().topology.as_ref() {
            for address in t.servers_of(META_SHARD as PhysicalId) {
                candidates.push(self.credentials_for(address)?);
            }
        }
        let found = discovery::identify(META_SHARD, &candidates).await;
        let (id, dsn) = discovery::primary_among(META_SHARD, &found).await?;
        let failovers = self.inner.slots[META_SHARD].get().map_or(0, Slot::failovers);
        self.set_slot(META_SHARD, &id.name, dsn, failovers)
    }

    /// Map loads since the process started.
    pub fn reloads(&self) -> u64 {
        self.inner.reloads.load(Ordering::Relaxed)
    }

    /// The map's epoch (0 before a cluster exists).
    pub fn epoch(&self) -> u64 {
        self.routing().topology.as_ref().map_or(0, |t| t.epoch)
    }

    /// The current routing (a snapshot: cheap, and consistent for one
    /// operation).
    pub fn routing(&self) -> Arc<Routing> {
        self.inner.routing.read().expect("not poisoned").clone()
    }

    /// The map routed with. Panics before a cluster exists (`migrate` uses
    /// [`Shards::configured`] and needs none).
    pub fn topology(&self) -> Topology {
        self.routing().topology.clone().expect("a cluster map (the process connected with Shards::connect)")
    }

    /// Logical shards of the cluster.
    pub fn logical_shards(&self) -> u16 {
        self.routing().logical_shards()
    }

    /// Physical ids of the live shards, in order.
    pub fn ids(&self) -> Vec<usize> {
        self.routing().live.clone()
    }

    /// How many physical shards are live.
    pub fn count(&self) -> usize {
        self.routing().live.len()
    }

    fn slot(&self, shard: usize) -> &Server {
        self.inner.slots[shard]
            .get()
            .unwrap_or_else(|| panic!("physical shard {shard} is not connected"))
            .current()
    }

    pub fn pool(&self, shard: usize) -> &MySqlPool {
        &self.slot(shard).pool
    }

    /// Physical shard `shard`'s replicas, as the map last loaded lists
    /// them (empty when it has none).
    pub fn replicas(&self, shard: usize) -> Arc<[Arc<Replica>]> {
        self.inner.replicas.of(shard)
    }

    /// Ping-free connections for the hot paths (see [`crate::conns`]).
    pub fn conns(&self, shard: usize) -> &Conns {
        &self.slot(shard).conns
    }

    pub fn dsn(&self, shard: usize) -> &Dsn {
        &self.slot(shard).dsn
    }

    /// A physical shard's name.
    pub fn name(&self, shard: usize) -> &str {
        &self.slot(shard).name
    }

    /// The metadata shard: the one well-known place of the cluster's own
    /// tables (the map, the index catalog, index progress).
    pub fn meta(&self) -> &MySqlPool {
        self.pool(META_SHARD)
    }

    /// The logical shard of an entity id.
    pub fn logical_of_id(&self, id: &EntityId) -> u16 {
        logical_of(id.as_bytes(), self.logical_shards())
    }

    /// The physical shard owning logical shard `k`, by the current map.
    /// Several lookups that must agree take one [`Shards::routing`] and ask
    /// it instead: the map can be reloaded between two calls.
    pub fn of_logical(&self, k: u16) -> usize {
        self.routing().of_logical(k)
    }

    /// The physical shard an entity lives on, by the current map.
    pub fn of_id(&self, id: &EntityId) -> usize {
        self.routing().of_id(id)
    }

    /// The epoch the current map gives physical shard `shard`.
    pub fn epoch_of(&self, shard: usize) -> u64 {
        self.routing().epoch_of(shard)
    }

    /// [`Routing::by_shard`] with the current map.
    pub fn by_shard(&self, ids: &[EntityId]) -> Vec<Vec<EntityId>> {
        self.routing().by_shard(ids)
    }

    /// One past the highest live physical id: the length of a per-shard
    /// list indexed by physical id.
    pub fn slots_len(&self) -> usize {
        self.routing().slots_len()
    }

    /// Runs `f` on every live shard at once and returns the results in
    /// shard order: the one fan-out every cross-shard read and write uses.
    pub async fn each<'a, T, F, Fut>(&'a self, f: F) -> Vec<T>
    where
        F: Fn(usize, &'a MySqlPool) -> Fut,
        Fut: std::future::Future<Output = T> + 'a,
    {
        let ids = self.ids();
        futures::future::join_all(ids.into_iter().map(|shard| f(shard, &self.slot(shard).pool))).await
    }

    /// Runs `f` at once on every shard whose list in `work` (indexed by
    /// physical id) is not empty; returns `(shard, result)` in shard order.
    pub async fn each_with<'a, W, T, F, Fut>(&'a self, work: &'a [Vec<W>], f: F) -> Vec<(usize, T)>
    where
        F: Fn(usize, &'a MySqlPool, &'a [W]) -> Fut,
        Fut: std::future::Future<Output = T> + 'a,
    {
        let jobs = work.iter().enumerate().filter(|(_, w)| !w.is_empty()).map(|(shard, w)| {
            let job = f(shard, &self.slot(shard).pool, w);
            async move { (shard, job.await) }
        });
        futures::future::join_all(jobs).await
    }

    /// [`Shards::each`], stopping at the first error.
    pub async fn try_each<'a, T, F, Fut>(&'a self, f: F) -> Result<Vec<T>>
    where
        F: Fn(usize, &'a MySqlPool) -> Fut,
        Fut: std::future::Future<Output = Result<T>> + 'a,
    {
        self.each(f).await.into_iter().collect()
    }

    /// Waits until every live shard answers, up to `deadline`.
    pub async fn wait_ready(&self, deadline: Duration) -> Result<()> {
        let until = tokio::time::Instant::now() + deadline;
        for shard in self.ids() {
            loop {
                match sqlx::query("SELECT 1").execute(self.pool(shard)).await {
                    Ok(_) => break,
                    Err(e) if tokio::time::Instant::now() >= until => return Err(e).on(shard),
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        }
        Ok(())
    }

    /// One round trip to a physical shard (`SELECT 1`), for health checks.
    pub async fn ping(&self, shard: usize) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT 1").execute(self.pool(shard)).await.map(|_| ())
    }

    pub async fn close(&self) {
        for slot in self.inner.slots.iter().filter_map(OnceLock::get) {
            for server in slot.all() {
                server.pool.close().await;
            }
        }
        for pool in self.inner.replicas.pools() {
            pool.close().await;
        }
    }
}
