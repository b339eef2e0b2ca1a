//! Online backfill of a new index.
//!
//! Walks every shard's entities newest insert first (`added_id`
//! descending, below the highest id present when the backfill started:
//! later writes reach the index through its consumer group, which starts
//! with the index), writes their rows with multi-row upserts (a shard's
//! next batch is read while up to `WRITES_IN_FLIGHT` of its batches are
//! written), and persists
//! a cursor, in one statement with the row count, at most every
//! `SAVE_EVERY` and at the end. A backfill killed at any point resumes from
//! its last saved cursor: it redoes at most that long of work (the upserts
//! are idempotent), and rows counted as done are never scanned again.
//! Saving after every batch cost a durable commit per batch on shard 0,
//! as many as the index rows' own. A named lock keeps one backfiller per
//! index; a shard concurrency and a pace ([`crate::pace`]: a fixed rate, or
//! one that follows the shards' health) keep live traffic healthy.

use futures::stream::{FuturesOrdered, StreamExt};
use schemas::codec;
use schemas::index::IndexState;
use schemas::IndexSpec;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage::index_rows::{self, IndexRow};
use storage::{
    catalog, entities, locks, migrate, topology, EntityRecord, IndexMeta, OnShard, StoreError, META_SHARD,
};
use tokio::sync::{Mutex, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::pace::{self, Pace};
use crate::unique::Clashes;
use crate::{Cleaner, CleanerError};

/// How often the cursor is persisted while the backfill runs.
const SAVE_EVERY: Duration = Duration::from_secs(1);

/// Batches of one shard whose rows are being written while the next is
/// read. A pace that follows health keeps one: its probes judge one
/// batch's effect at a time, and its rate, not concurrency, is its bound.
const WRITES_IN_FLIGHT: usize = 4;

/// Persisted in `bagstore_indexes.backfill_cursor` as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Cursor {
    /// By physical id: scan entities with `added_id` below this (a cursor
    /// saved by an older cluster is shorter: shards past its end are done).
    pub(crate) below: Vec<u64>,
    pub(crate) done: Vec<bool>,
    /// When the scan began (µs; 0 in cursors saved before it was kept):
    /// a unique index's recheck covers what was written since.
    #[serde(default)]
    pub(crate) started_us: i64,
}

/// Progress as shown to the operator.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub rows_done: u64,
    pub rows_total: u64,
    /// Rows this process scanned.
    pub scanned_this_run: u64,
    pub elapsed: Duration,
}

impl Progress {
    pub fn ratio(&self) -> f64 {
        if self.rows_total == 0 {
            1.0
        } else {
            (self.rows_done as f64 / self.rows_total as f64).min(1.0)
        }
    }

    pub fn rate(&self) -> f64 {
        self.scanned_this_run as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// What the shards' jobs of one backfill share.
struct Shared {
    cursor: Cursor,
    rows_done: u64,
    scanned_this_run: u64,
    saved_at: Instant,
    /// A unique index's keys held by more than one entity.
    clashes: Clashes,
}

/// One backfill run: what its per-shard jobs need.
struct Run<'a> {
    cleaner: &'a Cleaner,
    /// The index as the catalog has it.
    spec: &'a IndexSpec,
    table: &'a str,
    rows_total: u64,
    started: Instant,
    pace: Arc<Pace>,
    shared: Mutex<Shared>,
    report: &'a (dyn Fn(Progress) + Sync),
    shutdown: &'a CancellationToken,
}

impl Cleaner {
    /// Saves the cursor and the row counts in one statement.
    async fn save_cursor(
        &self,
        table: &str,
        cursor: &Cursor,
        rows_done: u64,
        rows_total: u64,
    ) -> Result<(), CleanerError> {
        let text = serde_json::to_string(cursor).expect("cursor serializes");
        catalog::set_backfill_progress(self.shards(), table, Some(&text), rows_done, rows_total).await?;
        Ok(())
    }

    /// Backfills `spec` to ACTIVE. `report` is called after every batch.
    pub async fn backfill(
        &self,
        spec: &IndexSpec,
        report: &(dyn Fn(Progress) + Sync),
        shutdown: &CancellationToken,
    ) -> Result<Progress, CleanerError> {
        let table = spec.table.clone();
        let shards = self.shards();
        let n = shards.slots_len();
        let meta = self
            .index_metas()
            .await?
            .into_iter()
            .find(|m| m.spec.table == table && m.state != IndexState::Dropping)
            .ok_or_else(|| CleanerError::UnknownIndex(table.clone()))?;
        let start = Instant::now();
        if meta.state == IndexState::Active {
            return Ok(Progress {
                rows_done: meta.rows_done,
                rows_total: meta.rows_total,
                scanned_this_run: 0,
                elapsed: start.elapsed(),
            });
        }
        // Held for the whole backfill: closing this connection frees it.
        let _lock = self.backfill_lock(&table).await?;
        shards.try_each(|shard, pool| migrate::create_index_table(shard, pool, &meta.spec)).await?;
        if matches!(meta.state, IndexState::Creating | IndexState::Conflicted) {
            catalog::set_index_state(shards, &table, IndexState::Backfilling).await?;
            if meta.spec.unique {
                // Every writer keeps the new index's rows before its scan.
                tokio::time::sleep(storage::unique::WRITERS_KNOW_WITHIN).await;
            }
        }
        let (cursor, rows_done, rows_total) = self.backfill_cursor(&meta, n).await?;
        let stop_pace = CancellationToken::new();
        let _stop_pace = stop_pace.clone().drop_guard();
        let pace = self.backfill_pace(&table, stop_pace).await?;
        tracing::info!(index = %table, rows_done, rows_total, "backfill running");
        let run = Run {
            cleaner: self,
            spec: &meta.spec,
            table: &table,
            rows_total,
            started: start,
            pace,
            shared: Mutex::new(Shared {
                cursor,
                rows_done,
                scanned_this_run: 0,
                saved_at: Instant::now(),
                clashes: Clashes::default(),
            }),
            report,
            shutdown,
        };
        let gate = Semaphore::new(self.settings().cleaner.backfill_concurrency);
        let jobs = shards.ids().into_iter().filter(|s| *s < n).map(|shard| {
            let (gate, run) = (&gate, &run);
            async move {
                let _permit = gate.acquire().await.expect("semaphore open");
                run.shard(shard).await
            }
        });
        let results = futures::future::join_all(jobs).await;
        if let Some(e) = results.into_iter().find_map(Result::err) {
            // Keep what the other shards finished since the last save (best
            // effort: the error may be shard 0's own).
            if let Err(save_err) = run.save(&*run.shared.lock().await).await {
                tracing::warn!(index = %table, error = %save_err, "could not save the backfill cursor");
            }
            return Err(e);
        }
        run.save(&*run.shared.lock().await).await?;
        let mut clashes = std::mem::take(&mut run.shared.lock().await.clashes);
        if clashes.is_empty() {
            catalog::set_index_state(shards, &table, IndexState::Active).await?;
            if meta.spec.unique {
                // Writes decided before their writer saw it ACTIVE were not
                // refused: once every writer enforces, what was written
                // since the scan began is looked at again.
                tokio::time::sleep(storage::unique::WRITERS_KNOW_WITHIN).await;
                let since = run.shared.lock().await.cursor.started_us;
                clashes = crate::unique::recheck_since(self, &meta.spec, since).await?;
            }
        }
        if !clashes.is_empty() {
            catalog::set_conflicted(shards, &table, &clashes.to_json()).await?;
            let state = crate::state_code(IndexState::Conflicted);
            self.metrics().index_state.with_label_values(&[&table]).set(state);
            return Err(CleanerError::Conflicted { table, keys: clashes.len() });
        }
        self.metrics().index_state.with_label_values(&[&table]).set(crate::state_code(IndexState::Active));
        let p = run.progress(&*run.shared.lock().await);
        self.metrics().backfill_progress.with_label_values(&[&table]).set(1.0);
        report(p);
        Ok(p)
    }

    /// The index's backfill lock, on a connection of its own: held until
    /// the connection closes.
    async fn backfill_lock(&self, table: &str) -> Result<sqlx::MySqlConnection, CleanerError> {
        let mut lock = storage::dsn::dedicated_connection(self.shards().dsn(META_SHARD))
            .await
            .map_err(|source| StoreError::Shard { shard: META_SHARD, source })?;
        if !locks::try_backfill_lock(&mut lock, table).await? {
            return Err(CleanerError::Busy(table.to_string()));
        }
        Ok(lock)
    }

    /// Where the backfill resumes (its saved cursor and counts), or where a
    /// new one starts, saved before it writes anything: every live shard
    /// below its highest `added_id` now, indexed by physical id (`n` of
    /// them; a shard not live is done).
    async fn backfill_cursor(&self, meta: &IndexMeta, n: usize) -> Result<(Cursor, u64, u64), CleanerError> {
        let (shards, table) = (self.shards(), &meta.spec.table);
        if let Some(text) = catalog::backfill_cursor(shards, table).await? {
            let mut c: Cursor = serde_json::from_str(&text)
                .map_err(|source| CleanerError::BadCursor { table: table.clone(), source })?;
            c.below.resize(n.max(c.below.len()), 0);
            c.done.resize(n.max(c.done.len()), true);
            return Ok((c, meta.rows_done, meta.rows_total));
        }
        let bounds = shards
            .try_each(|shard, pool| async move { Ok((shard, entities::entity_bounds(shard, pool).await?)) })
            .await?;
        let mut c =
            Cursor { below: vec![0; n], done: vec![true; n], started_us: schemas::clock::now_micros() };
        for (shard, b) in &bounds {
            c.below[*shard] = b.max_added_id + 1;
            c.done[*shard] = false;
        }
        let total = bounds.iter().map(|(_, b)| b.count).sum();
        let text = serde_json::to_string(&c).expect("cursor serializes");
        catalog::set_backfill_progress(shards, table, Some(&text), 0, total).await?;
        Ok((c, 0, total))
    }

    /// The backfill's pace: one that follows the shards' health (its
    /// probes stop with `stop`), or the fixed rate.
    async fn backfill_pace(&self, table: &str, stop: CancellationToken) -> Result<Arc<Pace>, CleanerError> {
        let c = &self.settings().cleaner;
        if c.backfill_follow_health {
            let m = self.metrics().clone();
            let (pace, _) = pace::follow_health(
                self.shards(),
                table,
                c.backfill_health_slack_ms,
                c.backfill_rate,
                m,
                stop,
            )
            .await?;
            return Ok(pace);
        }
        self.metrics().backfill_pace.with_label_values(&[table]).set(c.backfill_rate as f64);
        Ok(Arc::new(Pace::fixed(c.backfill_rate)))
    }

    /// Upserts the rows of a batch of entities, grouped by target shard.
    async fn write_rows(&self, spec: &IndexSpec, batch: &[EntityRecord]) -> Result<(), StoreError> {
        let per_shard = self.index_rows_of(spec, batch);
        let done = self
            .shards()
            .each_with(&per_shard, |shard, pool, rows| async move {
                let logicals: Vec<u16> = rows.iter().map(|r| r.logical).collect();
                let mut tx = topology::begin_owned(shard, pool, &logicals).await?;
                index_rows::upsert_index_rows(shard, &mut tx, spec, rows).await?;
                tx.commit().await.on(shard)
            })
            .await;
        done.into_iter().try_for_each(|(_, r)| r)
    }

    /// The index rows of a batch of entities, by the physical shard each
    /// goes to (that of its logical shard). Tombstones have none.
    pub(crate) fn index_rows_of<'e>(
        &self,
        spec: &IndexSpec,
        batch: impl IntoIterator<Item = &'e EntityRecord>,
    ) -> Vec<Vec<IndexRow>> {
        let n = self.shards().slots_len();
        let l = self.shards().logical_shards();
        let mut per_shard: Vec<Vec<IndexRow>> = vec![Vec::new(); n];
        for e in batch {
            let Some(body) = e.body.as_deref() else { continue };
            match codec::decode_body(body) {
                Ok(bag) => {
                    for key in spec.keys(&bag) {
                        let logical = spec.logical_of_key(&key, l);
                        per_shard[self.shards().of_logical(logical)].push(IndexRow {
                            key,
                            entity: e.id,
                            logical,
                            version: e.version,
                            entity_added_id: Some(e.added_id),
                            reservation: None,
                        });
                    }
                }
                Err(err) => tracing::error!(id = %e.id, error = %err, "corrupt entity body; not indexed"),
            }
        }
        per_shard
    }
}

impl Run<'_> {
    fn progress(&self, s: &Shared) -> Progress {
        Progress {
            rows_done: s.rows_done,
            rows_total: self.rows_total,
            scanned_this_run: s.scanned_this_run,
            elapsed: self.started.elapsed(),
        }
    }

    /// Saves the cursor, which covers only batches whose rows are committed.
    async fn save(&self, s: &Shared) -> Result<(), CleanerError> {
        self.cleaner.save_cursor(self.table, &s.cursor, s.rows_done, self.rows_total).await
    }

    /// Backfills one shard's entities from its cursor to its end. The scan
    /// reads ahead: while up to [`WRITES_IN_FLIGHT`] batches' rows are being
    /// written, the next batch is read, and the cursor moves past each batch
    /// in scan order once its rows are committed.
    async fn shard(&self, shard: usize) -> Result<(), CleanerError> {
        let below = {
            let s = self.shared.lock().await;
            if s.cursor.done[shard] {
                return Ok(());
            }
            s.cursor.below[shard]
        };
        // Where the next read starts; `None` once the shard's last (empty)
        // batch is read.
        let mut next = Some(below);
        let mut writes = FuturesOrdered::new();
        let in_flight = if self.pace.follows_health() { 1 } else { WRITES_IN_FLIGHT };
        loop {
            let Some(from) = next.filter(|_| writes.len() < in_flight) else {
                // Nothing to read now: wait for the oldest batch's rows.
                let Some(written) = writes.next().await else { return Ok(()) };
                let written: Vec<EntityRecord> = written?;
                self.advance(shard, &written).await?;
                continue;
            };
            let read = self.scan(shard, from);
            tokio::pin!(read);
            loop {
                tokio::select! {
                    read = &mut read => {
                        let (scanned, mine) = read?;
                        next = scanned.last().map(|e| e.added_id);
                        writes.push_back(self.write_batch(mine, scanned));
                        break;
                    }
                    Some(written) = writes.next() => self.advance(shard, &written?).await?,
                }
            }
        }
    }

    /// Writes `mine`'s index rows; returns `scanned`, the batch they came
    /// from, for the cursor.
    async fn write_batch(
        &self,
        mine: Vec<EntityRecord>,
        scanned: Vec<EntityRecord>,
    ) -> Result<Vec<EntityRecord>, CleanerError> {
        self.write(&mine).await?;
        Ok(scanned)
    }

    /// Reads the shard's next batch below `below`: every entity scanned, and
    /// those whose rows are this shard's to write. Returns when the pace
    /// allows the batch.
    async fn scan(
        &self,
        shard: usize,
        below: u64,
    ) -> Result<(Vec<EntityRecord>, Vec<EntityRecord>), CleanerError> {
        let shards = self.cleaner.shards();
        loop {
            if self.shutdown.is_cancelled() {
                return Err(CleanerError::Interrupted(self.table.to_string()));
            }
            let map = shards.routing();
            let batch = self.pace.batch(self.cleaner.settings().cleaner.backfill_batch);
            let scanned =
                entities::scan_entities_by_added_id(shard, shards.pool(shard), Some(below), batch).await?;
            // A moved-away copy's rows are not this shard's to index,
            // by a map the shard's epoch (read with the rows) still
            // vouches for (else a move released logical shards the
            // map gives it: reload and scan the batch again).
            if scanned.shard_epoch.is_some_and(|e| e != map.epoch_of(shard)) {
                shards.reload().await?;
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let scanned = scanned.records;
            let mine = scanned.iter().filter(|e| map.of_logical(e.logical) == shard).cloned().collect();
            // The pace meters what is read, so what is written in flight
            // follows it too.
            self.pace.after(scanned.len() as u64).await;
            return Ok((scanned, mine));
        }
    }

    /// Writes a batch's index rows. Live indexer writes can deadlock with
    /// ours; InnoDB rolled the statement back, so run it again (upserts
    /// are idempotent).
    async fn write(&self, batch: &[EntityRecord]) -> Result<(), CleanerError> {
        if self.spec.unique {
            let found = crate::unique::hold_batch(self.cleaner, self.spec, batch).await?;
            self.shared.lock().await.clashes.extend(found);
            return Ok(());
        }
        let mut attempt = 0u32;
        loop {
            match self.cleaner.write_rows(self.spec, batch).await {
                Ok(()) => return Ok(()),
                Err(e) if e.is_retryable_conflict() && attempt < 20 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(10 << attempt.min(6))).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Moves the shard's cursor past `scanned`, whose rows are written (no
    /// rows: the shard is done); saves it at most every [`SAVE_EVERY`];
    /// reports.
    async fn advance(&self, shard: usize, scanned: &[EntityRecord]) -> Result<(), CleanerError> {
        let mut s = self.shared.lock().await;
        match scanned.last() {
            Some(last) => s.cursor.below[shard] = last.added_id,
            None => s.cursor.done[shard] = true,
        }
        s.rows_done += scanned.len() as u64;
        s.scanned_this_run += scanned.len() as u64;
        if s.saved_at.elapsed() >= SAVE_EVERY {
            self.save(&s).await?;
            s.saved_at = Instant::now();
        }
        let p = self.progress(&s);
        drop(s);
        let m = self.cleaner.metrics();
        m.backfill_rows.with_label_values(&[self.table]).inc_by(scanned.len() as u64);
        m.backfill_progress.with_label_values(&[self.table]).set(p.ratio());
        (self.report)(p);
        Ok(())
    }
}
