//! The bulk backfill (`cleaner.backfill_method = "bulk"`): every shard's
//! entities are scanned as in the upsert method, their index rows are held
//! per target shard and loaded in bulk into an empty copy of the index
//! table, which is then swapped in (`storage::bulk` has the SQL side and
//! the merge's rule).
//!
//! - **Scope of the scan.** Entities below the cursor's `below`, as the
//!   upsert method: later writes reach the index through its consumer
//!   group. Rows an earlier upsert run wrote above the cursor are in the
//!   live table and come over in the merge.
//! - **Stopping.** A backfill stopped before a shard's swap loads that shard
//!   again from the start of the scan next time; swapped shards are
//!   recorded in the cursor and not loaded again.
//! - **Moves.** A move copies the live index table, not the loaded copy, so
//!   the backfill holds the mover's lock throughout and refuses to start
//!   while a move is in flight.
//! - **Pace.** `backfill_rate` / `backfill_follow_health` pace the scan; a
//!   load is one statement per shard and cannot be paced.

use futures::TryFutureExt;
use schemas::index::{IndexSpec, IndexState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use storage::index_rows::IndexRow;
use storage::{bulk, catalog, entities, locks, moves, META_SHARD};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::backfill::{Cursor, Progress};
use crate::pace::Pace;
use crate::{Cleaner, CleanerError};

/// What [`Cleaner::backfill_bulk`] is given by the backfill's start.
pub(crate) struct BulkRun<'a> {
    pub(crate) spec: &'a IndexSpec,
    pub(crate) rows_total: u64,
    pub(crate) start: Instant,
    pub(crate) report: &'a (dyn Fn(Progress) + Sync),
    pub(crate) shutdown: &'a CancellationToken,
}

impl Cleaner {
    /// Runs a backfill by the bulk method; the caller holds the index's
    /// backfill lock and has set it BACKFILLING.
    pub(crate) async fn backfill_bulk(
        &self,
        run: BulkRun<'_>,
        mut cursor: Cursor,
        pace: &Pace,
    ) -> Result<Progress, CleanerError> {
        let BulkRun { spec, rows_total, start, report, shutdown } = run;
        let table = &spec.table;
        let refuse = |why: String| CleanerError::BulkRefused { table: table.clone(), why };
        if !bulk::names_fit(table) {
            return Err(refuse(format!(
                "{} is longer than MariaDB's 64 characters; use backfill_method = \"upsert\"",
                bulk::bulk_table(table)
            )));
        }
        let shards = self.shards();
        let Some(_mover) = locks::take_mover_lock(shards.dsn(META_SHARD)).await? else {
            return Err(refuse("a move is running (it holds the mover's lock); try again after it".into()));
        };
        if let Some(m) = moves::moves_in_flight(shards.pool(META_SHARD)).await?.first() {
            return Err(refuse(format!("move {} is in flight; finish it first", m.id)));
        }
        let n = shards.slots_len();
        let live: Vec<usize> = shards.ids().into_iter().filter(|s| *s < n).collect();
        cursor.bulk_done.resize(n, false);
        for &shard in &live {
            if bulk::finish_swap(shard, shards.pool(shard), spec).await? {
                tracing::info!(index = %table, shard, "merged the live rows of a swap an earlier backfill began");
                cursor.bulk_done[shard] = true;
                self.save_cursor(table, &cursor, 0, rows_total).await?;
            }
        }
        let targets: Vec<usize> = live.iter().copied().filter(|s| !cursor.bulk_done[*s]).collect();
        for &shard in &targets {
            bulk::create(shard, shards.pool(shard), table).await?;
        }
        tracing::info!(index = %table, ?targets, rows_total, "bulk backfill scanning");

        let held: Vec<Mutex<Vec<IndexRow>>> = (0..n).map(|_| Mutex::new(Vec::new())).collect();
        let loaded = AtomicU64::new(0);
        let scanned = AtomicU64::new(0);
        let progress = || Progress {
            rows_done: scanned.load(Ordering::Relaxed).min(rows_total),
            rows_total,
            scanned_this_run: scanned.load(Ordering::Relaxed),
            elapsed: start.elapsed(),
        };
        // Loads what `shard` holds (all of it, or only once it is full).
        let flush = |shard: usize, all: bool| {
            let (held, loaded) = (&held, &loaded);
            async move {
                let rows = {
                    let mut h = held[shard].lock().await;
                    if h.is_empty() || (!all && h.len() < self.settings().cleaner.backfill_bulk_rows) {
                        return Ok::<(), CleanerError>(());
                    }
                    std::mem::take(&mut *h)
                };
                let n = bulk::load(shard, shards.dsn(shard), spec, rows).await?;
                loaded.fetch_add(n, Ordering::Relaxed);
                Ok(())
            }
        };
        // Reads do not lock, so the scan reads ten upsert batches a statement.
        let batch = self.settings().cleaner.backfill_batch.saturating_mul(10);
        // Nothing to load when every shard was swapped in by earlier runs.
        let sources: Vec<usize> = if targets.is_empty() {
            Vec::new()
        } else {
            live.iter().copied().filter(|s| !cursor.done[*s]).collect()
        };
        let scans = sources.into_iter().map(|source| {
            let (held, scanned, targets, cursor) = (&held, &scanned, &targets, &cursor);
            let scan = move |below: u64| {
                entities::scan_entities_by_added_id(
                    source,
                    shards.pool(source),
                    Some(below),
                    pace.batch(batch),
                )
                .map_ok(|f| f.records)
            };
            async move {
                let mut found = scan(cursor.below[source]).await?;
                while let Some(last) = found.last() {
                    if shutdown.is_cancelled() {
                        return Err(CleanerError::Interrupted(table.to_string()));
                    }
                    // The next batch is read while this one's rows are computed.
                    let hold = async {
                        // A moved-away copy's rows are not this shard's to index.
                        let mine = found.iter().filter(|e| shards.of_logical(e.logical) == source);
                        for (shard, rows) in self.index_rows_of(spec, mine).into_iter().enumerate() {
                            if !rows.is_empty() && targets.contains(&shard) {
                                held[shard].lock().await.extend(rows);
                            }
                        }
                    };
                    let (next, ()) = futures::join!(scan(last.added_id), hold);
                    for &shard in targets {
                        flush(shard, false).await?;
                    }
                    scanned.fetch_add(found.len() as u64, Ordering::Relaxed);
                    self.metrics().backfill_rows.with_label_values(&[table]).inc_by(found.len() as u64);
                    let p = progress();
                    self.metrics().backfill_progress.with_label_values(&[table]).set(p.ratio());
                    report(p);
                    pace.after(found.len() as u64).await;
                    found = next?;
                }
                Ok(())
            }
        });
        // The first error stops the other shards' scans.
        futures::future::try_join_all(scans).await?;
        for &shard in &targets {
            flush(shard, true).await?;
        }
        tracing::info!(index = %table, rows = loaded.load(Ordering::Relaxed), elapsed = ?start.elapsed(),
            "bulk backfill loaded; swapping in");
        for &shard in &targets {
            bulk::swap_in(shard, shards.pool(shard), spec).await?;
            cursor.bulk_done[shard] = true;
            self.save_cursor(table, &cursor, progress().rows_done, rows_total).await?;
        }
        cursor.done.iter_mut().for_each(|d| *d = true);
        self.save_cursor(table, &cursor, rows_total, rows_total).await?;
        catalog::set_index_state(shards, table, IndexState::Active).await?;
        self.metrics().index_state.with_label_values(&[table]).set(crate::state_code(IndexState::Active));
        self.metrics().backfill_progress.with_label_values(&[table]).set(1.0);
        let p = Progress { rows_done: rows_total, ..progress() };
        report(p);
        Ok(p)
    }

    /// Saves the cursor and the row counts in one statement.
    pub(crate) async fn save_cursor(
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
}
