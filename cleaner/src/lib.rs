//! The cleaner: finds and repairs index drift, and backfills new indexes.
//!
//! Drift is judged per entity by [`reconcile`]: the keys its stored
//! properties produce (none for a tombstone or an absent id) against the
//! rows the index holds for it on every shard. Missing rows are written
//! with the entity's version; a row the entity no longer produces is
//! deleted only after the entity is re-read, and only if no newer version
//! rewrote it meanwhile, so a concurrent indexer write is never undone.
//!
//! The continuous sweep ([`Cleaner::run`]) does, every cycle: the entities
//! updated within `recent_window_secs` (fresh drift is fixed within a
//! cycle), one step of the deep pass through all entities newest `updated`
//! first, and one step of the pass through each index table's entity ids
//! (rows of entities that no longer exist). It also starts the backfill of
//! every CREATING or BACKFILLING index ([`backfill`]).
//!
//! In: entities and index rows from the shards, consumer-group offsets
//! from Kafka. Out: repaired index rows, index states, the index lag series.
//!
//! Layout:
//! - this file: the [`Cleaner`] and its sweep cycle.
//! - [`reconcile`]: per-entity drift judgment and repair.
//! - [`backfill`]: a new index's online backfill, resumable, throttled.
//! - [`pace`]: the backfill's pace, fixed or following the shards' health.
//! - [`expiry`]: deleting expired entities (through the write transaction,
//!   `storage::write`) and purging old tombstones.
//! - [`lag`]: index lag and the settled time (before which drift is drift,
//!   not lag), measured for every index, live consumer or not.
//! - [`metrics`]: the series this crate exports.

pub mod backfill;
pub mod expiry;
pub mod lag;
pub mod metrics;
pub mod pace;
pub mod reconcile;
pub mod unique;

use schemas::index::IndexState;
use schemas::{EntityId, IndexSpec, Settings};
use service::health::Health;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use storage::entities::{self, EntityRecord, Fetched, UpdatedCursor};
use storage::index_rows;
use storage::shards::Routing;
use storage::write::{Rules, WriteContext};
use storage::{catalog, topology, IndexMeta, Shards, StaleMapRetry, StoreError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long [`Cleaner::read_any`] reloads a map found stale before it
/// gives up with [`StoreError::StaleMap`] (a move per reload is rare).
const READ_STALE_MAP_WAIT: Duration = Duration::from_secs(1);

/// How long the sweep, and an expiry's delete, go on after their map
/// turned out stale (a move's cutover pauses writes for much less) before
/// they fail like any other error.
const STALE_MAP_WAIT: Duration = Duration::from_secs(10);

pub use metrics::CleanerMetrics;

#[derive(Debug, thiserror::Error)]
pub enum CleanerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("index {0:?} is not registered; run bagstore migrate with it in the config")]
    UnknownIndex(String),
    #[error("another process is backfilling index {0:?}")]
    Busy(String),
    #[error("stopped before the backfill of {0:?} finished; it resumes from its saved cursor")]
    Interrupted(String),
    /// A unique index's backfill found entities sharing keys: the index
    /// is CONFLICTED, its clashes listed in the catalog.
    #[error(
        "index {table:?} is CONFLICTED: {keys} key(s) are held by more than one entity (listed in GET /v1/indexes); \
         fix the data, then run the backfill again"
    )]
    Conflicted { table: String, keys: usize },
    #[error("the backfill cursor of {table:?} is unreadable")]
    BadCursor {
        table: String,
        #[source]
        source: serde_json::Error,
    },
}

/// Cheap to clone; shared by the sweep and the backfill tasks.
#[derive(Debug, Clone)]
pub struct Cleaner {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    settings: Settings,
    shards: Shards,
    metrics: CleanerMetrics,
    /// Where the sweep reports how it is doing (`/health/ready`).
    health: Health,
    /// Indexes whose backfill runs in this process.
    backfilling: Mutex<HashSet<String>>,
    /// Per index: up to when every event is applied (see [`lag`]).
    settled: Mutex<HashMap<String, lag::Settled>>,
    /// What the expiry's deletes need (they are write transactions).
    write: WriteContext,
}

/// Where each pass of the sweep stands.
#[derive(Debug, Default)]
pub(crate) struct SweepState {
    started: Option<Instant>,
    /// Per shard: the deep pass's `(updated, added_id)` cursor, `None` at the start.
    deep: Vec<Option<UpdatedCursor>>,
    deep_done: Vec<bool>,
    /// Per (index, shard): the index pass's entity-id cursor.
    index_pass: HashMap<(String, usize), Option<EntityId>>,
    index_done: HashSet<(String, usize)>,
    /// Per (unique index, shard): the held-row pass's entity-id cursor.
    unique_pass: HashMap<(String, usize), Option<EntityId>>,
}

impl SweepState {
    /// A sweep from the start over `n` physical ids, of which only `live`
    /// have entities to pass through.
    fn fresh(n: usize, live: &[usize]) -> SweepState {
        SweepState {
            deep: vec![None; n],
            deep_done: (0..n).map(|s| !live.contains(&s)).collect(),
            ..Default::default()
        }
    }
}

/// The rows of a scan that `shard` answers for by `map`. A moved-away
/// copy's rows are not this shard's to judge. Nor are rows of a shard whose
/// epoch (read with them) moved since `map` was loaded: a move released
/// logical shards the map still gives it, and their rows there may be that
/// stale copy (StaleMap: reloaded, swept again).
fn owned_rows(map: &Routing, shard: usize, scanned: Fetched) -> Result<Vec<EntityRecord>, CleanerError> {
    if scanned.shard_epoch.is_some_and(|e| e != map.epoch_of(shard)) {
        return Err(CleanerError::Store(StoreError::StaleMap { shard }));
    }
    Ok(scanned.records.into_iter().filter(|e| map.of_logical(e.logical) == shard).collect())
}

pub fn state_code(s: IndexState) -> i64 {
    match s {
        IndexState::Creating => 0,
        IndexState::Backfilling => 1,
        IndexState::Active => 2,
        IndexState::Dropping => 3,
        IndexState::Conflicted => 4,
    }
}

impl Cleaner {
    pub fn new(settings: Settings, shards: Shards, metrics: CleanerMetrics, health: Health) -> Cleaner {
        Cleaner {
            inner: Arc::new(Inner {
                write: WriteContext::new(shards.clone(), Rules::from_settings(&settings)),
                settings,
                shards,
                metrics,
                health,
                backfilling: Mutex::new(HashSet::new()),
                settled: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    pub fn shards(&self) -> &Shards {
        &self.inner.shards
    }

    pub fn metrics(&self) -> &CleanerMetrics {
        &self.inner.metrics
    }

    pub(crate) fn write_context(&self) -> &WriteContext {
        &self.inner.write
    }

    /// Commit time before which every event of `table` has been applied;
    /// `None` until the lag measurement has established one.
    pub fn settled_us(&self, table: &str) -> Option<i64> {
        self.inner.settled.lock().expect("not poisoned").get(table).and_then(|s| s.at_us)
    }

    pub(crate) fn settled_mut(&self, table: &str, f: impl FnOnce(&mut lag::Settled)) {
        f(self.inner.settled.lock().expect("not poisoned").entry(table.to_string()).or_default())
    }

    pub async fn index_metas(&self) -> Result<Vec<IndexMeta>, StoreError> {
        catalog::list_index_meta(self.shards()).await
    }

    /// Deletes `Idempotency-Key` records older than the window (and unique
    /// key claims older than a minute, revocations than an hour), on every
    /// shard, once a minute until `shutdown` (a batch of at most 10,000
    /// rows per shard and round, so a backlog never holds a long lock).
    pub async fn purge_idempotency_keys(&self, shutdown: CancellationToken) {
        let window = Duration::from_secs(self.settings().writer.idempotency_window_secs);
        loop {
            let before = schemas::clock::now_micros() - window.as_micros() as i64;
            for shard in self.shards().ids() {
                match storage::idempotency::purge(shard, self.shards().pool(shard), before, 10_000).await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(shard, purged = n, "expired idempotency keys purged"),
                    Err(e) => {
                        tracing::warn!(shard, error = %e, "purging idempotency keys failed; next round retries")
                    }
                }
                // Unique key claims after a minute, revocations after an
                // hour: far past any reservation (at most 10 s).
                let now = schemas::clock::now_micros();
                let (claims, revoked) = (now - 60_000_000, now - 3_600_000_000);
                let pool = self.shards().pool(shard);
                if let Err(e) =
                    storage::unique::sweep::purge_claims(shard, pool, claims, revoked, 100_000).await
                {
                    tracing::warn!(shard, error = %e, "purging unique key claims failed; next round retries");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(60)) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    /// Sweeps until `shutdown`; starts backfills of new indexes on `tracker`.
    pub async fn run(&self, tracker: &TaskTracker, shutdown: CancellationToken) {
        let interval = Duration::from_millis(self.settings().cleaner.interval_ms);
        let mut state = SweepState::default();
        let mut stale = StaleMapRetry::new(STALE_MAP_WAIT);
        while !shutdown.is_cancelled() {
            let outcome = self.cycle(&mut state, tracker, &shutdown).await;
            let report = outcome.as_ref().map(|_| ()).map_err(|e| format!("sweep failed: {e}"));
            self.inner.health.report("sweep", report);
            if let Err(e) = outcome {
                // A move changed the map: reload and sweep again, after a
                // short wait (longer if it happens again) while a cutover ends.
                if matches!(&e, CleanerError::Store(s) if s.is_stale_map())
                    && stale.again(self.shards()).await
                {
                    continue;
                }
                tracing::warn!(error = %e, source = ?std::error::Error::source(&e).map(|s| s.to_string()),
                    "cleaner cycle failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = shutdown.cancelled() => break,
                }
                stale = StaleMapRetry::new(STALE_MAP_WAIT);
                continue;
            }
            stale = StaleMapRetry::new(STALE_MAP_WAIT);
            if interval.is_zero() {
                tokio::task::yield_now().await;
                continue;
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = shutdown.cancelled() => break,
            }
        }
    }

    async fn cycle(
        &self,
        st: &mut SweepState,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
    ) -> Result<(), CleanerError> {
        let specs = self.swept_specs(tracker, shutdown).await?;
        let settled = self.settled_times(&specs);
        // One map for the whole cycle: which rows each shard answers for,
        // where index rows belong, and the epochs that vouch for both.
        let map = self.shards().routing();
        let map = &*map;
        // Per physical id; ids not live count as done.
        let live = map.live.clone();
        let n = map.slots_len();
        if st.deep.len() != n {
            *st = SweepState::fresh(n, &live);
        }
        let started = *st.started.get_or_insert_with(Instant::now);
        self.sweep_unique(st).await?;
        if specs.is_empty() {
            return Ok(());
        }
        let now_us = schemas::clock::now_micros();
        for &shard in &live {
            self.sweep_entities(map, st, shard, &specs, &settled, now_us).await?;
            // One step of each index table's pass.
            for spec in &specs {
                self.sweep_index(map, st, shard, spec, settled[&spec.table], now_us).await?;
            }
        }
        let all_index_done =
            specs.iter().all(|s| live.iter().all(|sh| st.index_done.contains(&(s.table.clone(), *sh))));
        if st.deep_done.iter().all(|d| *d) && all_index_done {
            self.inner.metrics.sweeps.inc();
            self.inner.metrics.sweep_seconds.set(started.elapsed().as_secs_f64());
            *st = SweepState::fresh(n, &live);
        }
        Ok(())
    }

    /// The indexes a sweep judges (ACTIVE and BACKFILLING); every index's
    /// state is exported, and the backfill of each new one started.
    async fn swept_specs(
        &self,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
    ) -> Result<Vec<IndexSpec>, CleanerError> {
        let metas = self.index_metas().await?;
        // Expiry frees the unique keys of what it deletes.
        self.write_context().unique().set(storage::unique::of_catalog(metas.clone()));
        for m in &metas {
            self.inner.metrics.index_state.with_label_values(&[&m.spec.table]).set(state_code(m.state));
            if matches!(m.state, IndexState::Creating | IndexState::Backfilling) {
                self.start_backfill(m.spec.clone(), tracker, shutdown.clone());
            }
        }
        // A unique index's rows are written by the writers: its sweep is
        // `unique_sweep`'s, not this one.
        Ok(metas
            .into_iter()
            .filter(|m| !m.spec.unique && matches!(m.state, IndexState::Active | IndexState::Backfilling))
            .map(|m| m.spec)
            .collect())
    }

    /// Per index, its settled time: entities written after it may have
    /// events in flight (lag, not drift) and are not judged this cycle.
    fn settled_times(&self, specs: &[IndexSpec]) -> HashMap<String, i64> {
        let mut settled = HashMap::new();
        for spec in specs {
            settled.insert(spec.table.clone(), self.settled_us(&spec.table).unwrap_or(i64::MIN));
            for kind in ["missing", "dangling"] {
                // Present from the start, so increase() sees the first drift.
                self.inner.metrics.drift_found.with_label_values(&[&spec.table, kind]);
                self.inner.metrics.drift_fixed.with_label_values(&[&spec.table, kind]);
            }
        }
        settled
    }

    /// One shard's entity passes in a cycle: everything updated within the
    /// recent window, then one step of the deep pass.
    async fn sweep_entities(
        &self,
        map: &Routing,
        st: &mut SweepState,
        shard: usize,
        specs: &[IndexSpec],
        settled: &HashMap<String, i64>,
        now_us: i64,
    ) -> Result<(), CleanerError> {
        let batch = self.settings().cleaner.batch;
        let window_us = self.settings().cleaner.recent_window_secs as i64 * 1_000_000;
        let pool = self.shards().pool(shard);
        // Fresh drift first: everything updated within the window.
        let recent = entities::scan_entities_by_updated(shard, pool, now_us - window_us, None, batch).await?;
        self.reconcile_scanned(map, specs, settled, owned_rows(map, shard, recent)?).await?;
        // One step of the deep pass.
        if !st.deep_done[shard] {
            let rows = entities::scan_entities_by_updated(shard, pool, 0, st.deep[shard], batch).await?;
            st.deep[shard] = rows.records.last().map(UpdatedCursor::after);
            st.deep_done[shard] = rows.records.len() < batch;
            self.reconcile_scanned(map, specs, settled, owned_rows(map, shard, rows)?).await?;
        }
        Ok(())
    }

    /// One step of an index table's pass on one shard: the rows of entities
    /// that no longer exist, then the tombstones long past the settled time.
    async fn sweep_index(
        &self,
        map: &Routing,
        st: &mut SweepState,
        shard: usize,
        spec: &IndexSpec,
        settled_us: i64,
        now_us: i64,
    ) -> Result<(), CleanerError> {
        let k = (spec.table.clone(), shard);
        if st.index_done.contains(&k) {
            return Ok(());
        }
        let batch = self.settings().cleaner.batch;
        let pool = self.shards().pool(shard);
        let after = st.index_pass.get(&k).cloned().flatten();
        let ids = index_rows::index_entity_ids(shard, pool, spec, after.as_ref(), batch).await?;
        if ids.len() < batch {
            st.index_done.insert(k.clone());
        }
        st.index_pass.insert(k, ids.last().copied());
        let found = self.read_any(&ids).await?;
        self.inner.metrics.rows_scanned.with_label_values(&[&spec.table]).inc_by(ids.len() as u64);
        reconcile::reconcile(self, map, spec, &ids, &found, settled_us).await?;
        // Tombstones long past the settled time have done their job.
        let keep_us =
            (self.settings().cleaner.index_tombstone_retention_secs as i64).saturating_mul(1_000_000);
        let before = settled_us.min(now_us).saturating_sub(keep_us);
        let purged = index_rows::purge_tombstones_of(shard, pool, spec, &ids, before).await?;
        if purged > 0 {
            tracing::debug!(index = %spec.table, shard, purged, "purged index tombstones");
        }
        Ok(())
    }

    async fn reconcile_scanned(
        &self,
        map: &Routing,
        specs: &[IndexSpec],
        settled: &HashMap<String, i64>,
        rows: Vec<EntityRecord>,
    ) -> Result<(), CleanerError> {
        if rows.is_empty() {
            return Ok(());
        }
        let ids: Vec<EntityId> = rows.iter().map(|e| e.id).collect();
        for spec in specs {
            self.inner.metrics.rows_scanned.with_label_values(&[&spec.table]).inc_by(rows.len() as u64);
            reconcile::reconcile(self, map, spec, &ids, &rows, settled[&spec.table]).await?;
        }
        Ok(())
    }

    /// Entities among `ids` as stored now, on whatever shards own them,
    /// tombstones included. Each attempt routes with one map and checks
    /// every shard it read against that map's epoch for it (rows or none:
    /// a moved-away copy, or its absence once removed, must not pass for
    /// the entity); a stale map is reloaded and the read run again, for up
    /// to [`READ_STALE_MAP_WAIT`], then [`StoreError::StaleMap`].
    pub async fn read_any(&self, ids: &[EntityId]) -> Result<Vec<EntityRecord>, StoreError> {
        let shards = self.shards();
        let mut stale = StaleMapRetry::new(READ_STALE_MAP_WAIT);
        loop {
            match self.read_any_once(ids).await {
                Err(e) if e.is_stale_map() && stale.again(shards).await => {}
                other => return other,
            }
        }
    }

    /// One attempt of [`Cleaner::read_any`], with the current map.
    async fn read_any_once(&self, ids: &[EntityId]) -> Result<Vec<EntityRecord>, StoreError> {
        let shards = self.shards();
        let map = shards.routing();
        let per_shard = map.by_shard(ids);
        let map = &map;
        let found = shards
            .each_with(&per_shard, |shard, pool, ids| async move {
                let f = entities::read_entities_any(shard, pool, ids).await?;
                let epoch = match f.shard_epoch {
                    Some(e) => e,
                    None => topology::shard_epoch(shard, pool).await?,
                };
                if epoch != map.epoch_of(shard) {
                    return Err(StoreError::StaleMap { shard });
                }
                Ok(f.records)
            })
            .await;
        let mut out = Vec::new();
        let mut stale = None;
        for (_, r) in found {
            match r {
                Ok(r) => out.extend(r),
                Err(e) if e.is_stale_map() => stale = Some(e),
                Err(e) => return Err(e),
            }
        }
        stale.map_or(Ok(out), Err)
    }

    fn start_backfill(&self, spec: IndexSpec, tracker: &TaskTracker, shutdown: CancellationToken) {
        if !self.inner.backfilling.lock().expect("not poisoned").insert(spec.table.clone()) {
            return;
        }
        let me = self.clone();
        tracker.spawn(async move {
            let table = spec.table.clone();
            match me.backfill(&spec, &|_| {}, &shutdown).await {
                Ok(o) => tracing::info!(index = %table, scanned = o.scanned_this_run, "backfill done; index ACTIVE"),
                Err(CleanerError::Busy(_)) => tracing::debug!(index = %table, "another process backfills"),
                Err(e) => tracing::warn!(index = %table, error = %e, "backfill stopped"),
            }
            me.inner.backfilling.lock().expect("not poisoned").remove(&table);
        });
    }
}
