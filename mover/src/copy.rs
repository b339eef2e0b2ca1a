//! The copy phase: journal on, first copy, catch-up, verification.

use schemas::names::tables;
use schemas::EntityId;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use storage::entities::{self, LogicalCursor};
use storage::moves::{self, JournalEntry};
use storage::{index_rows, migrate, server, OnShard};

use crate::{MoveError, Mover, Result, Running};

/// Logical shards copied per step (progress is saved after each step).
const LOGICALS_PER_STEP: usize = 16;
/// Logical shards compared per verification step.
const LOGICALS_PER_VERIFY: usize = 64;
/// Journal entries applied per catch-up round.
const JOURNAL_BATCH: usize = 2000;
/// The catch-up before verification stops once the journal is this short.
const SHORT_JOURNAL: u64 = 200;

/// Entities whose rows differed between source and target, by table
/// (`entities` or an index table).
pub type Differs = BTreeMap<String, Vec<EntityId>>;

impl Mover {
    /// Turns the source's journal on, then copies every logical shard not
    /// yet copied, saving progress after each step.
    pub(crate) async fn copy(&self, run: &mut Running<'_>) -> Result<()> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let shards = self.shards().clone();
        let (src, dst) = (shards.pool(source), shards.pool(target));
        migrate::create_base_tables(target, dst).await?;
        for spec in &run.indexes {
            migrate::create_index_table(target, dst, spec).await?;
        }
        // From here on only this run writes the copy (a run that lost the
        // move, frozen or cut off, finds its token replaced).
        moves::claim_incoming(target, dst, &run.rec.logicals, run.token).await?;
        moves::start_journal(source, src, &run.rec.logicals, &run.indexes).await?;
        let done: BTreeSet<u16> = run.rec.copied.iter().copied().collect();
        let todo: Vec<u16> = run.rec.logicals.iter().copied().filter(|k| !done.contains(k)).collect();
        run.rows_total = run.rec.rows_copied + self.count_rows(source, &todo, run).await?;
        let start = Instant::now();
        let mut copied_here = 0u64;
        for step in todo.chunks(LOGICALS_PER_STEP) {
            let mut cursor: Option<LogicalCursor> = None;
            loop {
                self.throttle(run, source, copied_here, start).await?;
                let rows = entities::scan_logicals(source, src, step, cursor, self.settings().batch).await?;
                let Some(last) = rows.last() else { break };
                cursor = Some(LogicalCursor { logical: last.logical, added_id: last.added_id });
                let mut tx = moves::begin_incoming(target, dst, step, run.token).await?;
                entities::copy_entities(target, &mut tx, &rows).await?;
                tx.commit().await.on(target)?;
                self.copied(run, rows.len() as u64, &mut copied_here);
                if rows.len() < self.settings().batch {
                    break;
                }
            }
            for spec in run.indexes.clone() {
                self.throttle(run, source, copied_here, start).await?;
                let rows = index_rows::rows_in_logicals(source, src, &spec, step).await?;
                let mut tx = moves::begin_incoming(target, dst, step, run.token).await?;
                index_rows::copy_rows(target, &mut tx, &spec, &rows).await?;
                tx.commit().await.on(target)?;
                self.copied(run, rows.len() as u64, &mut copied_here);
            }
            run.rec.copied.extend_from_slice(step);
            moves::set_copied(shards.meta(), run.rec.id, &run.rec.copied, run.rec.rows_copied).await?;
            self.metrics().progressed();
            self.show(run, false);
        }
        Ok(())
    }

    fn copied(&self, run: &mut Running<'_>, n: u64, copied_here: &mut u64) {
        *copied_here += n;
        run.rec.rows_copied += n;
        run.outcome.rows_copied += n;
        self.metrics().rows_copied.inc_by(n);
        self.show(run, false);
    }

    async fn count_rows(&self, source: usize, logicals: &[u16], run: &Running<'_>) -> Result<u64> {
        let pool = self.shards().pool(source);
        let mut n = entities::count_in_logicals(source, pool, logicals).await?;
        for spec in &run.indexes {
            n += index_rows::count_in_logicals(source, pool, spec, logicals).await?;
        }
        Ok(n)
    }

    /// Keeps the copy under `mover.rate` rows/s, and pauses it while the
    /// source is busier than `mover.max_threads_running`.
    async fn throttle(&self, run: &Running<'_>, source: usize, copied: u64, start: Instant) -> Result<()> {
        if run.stop.is_cancelled() {
            return Err(MoveError::Stopped);
        }
        let rate = self.settings().rate;
        if rate > 0 {
            let due = Duration::from_secs_f64(copied as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                self.pause(run, wait).await?;
            }
        }
        let max = u64::from(self.settings().max_threads_running);
        if max > 0 {
            let pool = self.shards().pool(source);
            let mut waited = Instant::now();
            // Our own statement counts as one running thread.
            while server::threads_running(source, pool).await? > max {
                self.pause(run, Duration::from_millis(100)).await?;
                self.metrics().throttled_seconds.add(waited.elapsed().as_secs_f64());
                waited = Instant::now();
            }
        }
        Ok(())
    }

    /// Applies the journal to the target until it is at most `until`
    /// entries long (0: empty). Returns how many entries were applied.
    pub(crate) async fn catch_up(&self, run: &mut Running<'_>, until: u64) -> Result<u64> {
        let source = run.rec.source as usize;
        let src = self.shards().pool(source);
        let mut applied = 0;
        loop {
            if run.stop.is_cancelled() {
                return Err(MoveError::Stopped);
            }
            let entries = moves::read_journal(source, src, JOURNAL_BATCH).await?;
            let Some(last) = entries.last().map(|e| e.seq) else { break };
            let n = self.apply(run, &entries).await?;
            moves::trim_journal(source, src, last).await?;
            applied += entries.len() as u64;
            run.rows_caught_up += n;
            run.outcome.rows_copied += n;
            self.metrics().rows_copied.inc_by(n);
            self.metrics().progressed();
            run.journal_backlog =
                if entries.len() < JOURNAL_BATCH { 0 } else { moves::journal_backlog(source, src).await? };
            self.show(run, false);
            if run.journal_backlog <= until {
                break;
            }
        }
        Ok(applied)
    }

    /// Makes the target's rows of the journaled entities what the source
    /// has now. Returns the rows written.
    async fn apply(&self, run: &Running<'_>, entries: &[JournalEntry]) -> Result<u64> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (self.shards().pool(source), self.shards().pool(target));
        let mut written = 0;
        for (table, ids) in moves::by_table(entries) {
            if table == tables::ENTITIES {
                let rows = entities::read_entities_any(source, src, &ids).await?.records;
                let mut tx = moves::begin_incoming(target, dst, &run.rec.logicals, run.token).await?;
                entities::copy_entities(target, &mut tx, &rows).await?;
                tx.commit().await.on(target)?;
                written += rows.len() as u64;
            } else if let Some(spec) = run.indexes.iter().find(|s| s.table == table) {
                let logicals = &run.rec.logicals;
                let rows: Vec<_> = index_rows::index_rows_of(source, src, spec, &ids)
                    .await?
                    .into_iter()
                    .filter(|r| logicals.binary_search(&r.logical).is_ok())
                    .collect();
                let mut tx = moves::begin_incoming(target, dst, logicals, run.token).await?;
                index_rows::replace_rows_of(target, &mut tx, spec, logicals, &ids, &rows).await?;
                tx.commit().await.on(target)?;
                written += rows.len() as u64;
            }
            // A table no index has any more (dropped meanwhile): nothing to carry.
        }
        Ok(written)
    }

    /// Catches up, then compares the target with the source logical shard
    /// by logical shard, then catches up again. Returns the entities that
    /// differed: a change the journal will bring, or a copy that went wrong;
    /// the cutover compares them again once writes are held.
    pub(crate) async fn verify_until_settled(&self, run: &mut Running<'_>) -> Result<Differs> {
        self.catch_up(run, SHORT_JOURNAL).await?;
        let differs = self.verify(run, None).await?;
        self.catch_up(run, SHORT_JOURNAL).await?;
        let n: usize = differs.values().map(Vec::len).sum();
        tracing::info!(
            id = run.rec.id,
            differing = n,
            "move verified; differing entities are compared again at the cutover"
        );
        Ok(differs)
    }

    /// Compares source and target: every row of the moving logical shards,
    /// or (with `only`) the rows of those entities.
    pub(crate) async fn verify(&self, run: &Running<'_>, only: Option<&Differs>) -> Result<Differs> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (self.shards().pool(source), self.shards().pool(target));
        let logicals = &run.rec.logicals;
        let mut out = Differs::new();
        let steps: Vec<&[u16]> =
            if only.is_some() { vec![&logicals[..]] } else { logicals.chunks(LOGICALS_PER_VERIFY).collect() };
        for step in steps {
            if run.stop.is_cancelled() {
                return Err(MoveError::Stopped);
            }
            let ids = only.map(|d| d.get(tables::ENTITIES).map_or(&[][..], Vec::as_slice));
            if ids.is_none_or(|ids| !ids.is_empty()) {
                let a = entities::fingerprints(source, src, step, ids).await?;
                let b = entities::fingerprints(target, dst, step, ids).await?;
                let differ = symmetric_difference(
                    a.iter().map(|f| (f.id, f.clone())),
                    b.iter().map(|f| (f.id, f.clone())),
                );
                if !differ.is_empty() {
                    out.entry(tables::ENTITIES.to_string()).or_default().extend(differ);
                }
            }
            for spec in &run.indexes {
                let (a, b) = match only {
                    None => (
                        index_rows::rows_in_logicals(source, src, spec, step).await?,
                        index_rows::rows_in_logicals(target, dst, spec, step).await?,
                    ),
                    Some(d) => {
                        let Some(ids) = d.get(&spec.table).filter(|ids| !ids.is_empty()) else { continue };
                        let keep = |rows: Vec<storage::IndexRow>| -> Vec<storage::IndexRow> {
                            rows.into_iter().filter(|r| step.binary_search(&r.logical).is_ok()).collect()
                        };
                        (
                            keep(index_rows::index_rows_of(source, src, spec, ids).await?),
                            keep(index_rows::index_rows_of(target, dst, spec, ids).await?),
                        )
                    }
                };
                let fp = |rows: &[storage::IndexRow]| -> Vec<(EntityId, _)> {
                    rows.iter().map(|r| (r.entity, index_rows::row_fingerprint(r))).collect()
                };
                let differ = symmetric_difference(fp(&a).into_iter(), fp(&b).into_iter());
                if !differ.is_empty() {
                    out.entry(spec.table.clone()).or_default().extend(differ);
                }
            }
        }
        for ids in out.values_mut() {
            ids.sort_unstable();
            ids.dedup();
        }
        Ok(out)
    }
}

/// The entities whose items are not the same on both sides.
fn symmetric_difference<T: Ord>(
    a: impl Iterator<Item = (EntityId, T)>,
    b: impl Iterator<Item = (EntityId, T)>,
) -> Vec<EntityId> {
    let a: BTreeSet<(EntityId, T)> = a.collect();
    let b: BTreeSet<(EntityId, T)> = b.collect();
    let ids: BTreeSet<EntityId> = a.symmetric_difference(&b).map(|(id, _)| *id).collect();
    ids.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entities_differ_when_any_of_their_items_differ() {
        let id = |b: u8| EntityId([b; 16]);
        let a = vec![(id(1), 1), (id(2), 5), (id(3), 1)];
        let b = vec![(id(1), 1), (id(2), 6), (id(4), 1)];
        assert_eq!(symmetric_difference(a.into_iter(), b.into_iter()), vec![id(2), id(3), id(4)]);
    }
}
