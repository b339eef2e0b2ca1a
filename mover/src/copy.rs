//! The copy phase: journal on, first copy, catch-up, verification.

use schemas::names::tables;
use schemas::EntityId;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};
use storage::carry::{self, IdempotencyRow, RecordCursor};
use storage::entities::{self, LogicalCursor};
use storage::journal;
use storage::moves;
use storage::{checksums, index_rows, migrate, server, EntityRecord, IndexRow, OnShard};
use tokio_util::sync::CancellationToken;

use crate::{pause, MoveError, Mover, Result, Running};

/// Logical shards copied per step (progress is saved after each step).
const LOGICALS_PER_STEP: usize = 16;
/// Logical shards compared per verification step.
const LOGICALS_PER_VERIFY: usize = 256;
/// Journal entries applied per catch-up round.
const JOURNAL_BATCH: usize = 2000;
/// The catch-up before verification stops once the journal is this short.
const SHORT_JOURNAL: u64 = 200;

/// How far back from the start of a pass the next pass of idempotency
/// records looks: records are stamped with their writer's clock, the
/// bounds with the mover's (or, for a resumed move, the metadata shard's),
/// and a write stamps its record before it commits. 5 minutes covers clock
/// skew and any write's time in flight.
const RECORDS_SLACK_US: i64 = 5 * 60 * 1_000_000;

/// Batches read from the source, in flight to the target at most.
const READ_AHEAD: usize = 2;

/// Copy transactions in flight on the target at most.
const WRITERS: usize = 2;

/// A write in flight, or the end of a step behind it.
enum Pending<'t> {
    Write(tokio::task::JoinHandle<Result<u64>>),
    StepDone(&'t [u16]),
}

/// What the copy's reader hands its writer.
enum Batch<'t> {
    /// Entity rows of a step's logical shards.
    Entities(&'t [u16], Vec<EntityRecord>),
    /// Rows of the index `.1` (its place in `Running::indexes`).
    Index(&'t [u16], usize, Vec<IndexRow>),
    /// Idempotency records of a step's logical shards.
    Records(&'t [u16], Vec<IdempotencyRow>),
    /// Every row of the step has been sent: save progress once written.
    StepDone(&'t [u16]),
}

/// Entities whose rows differed between source and target, by table
/// (`entities` or an index table).
pub type Differs = BTreeMap<String, Vec<EntityId>>;

/// What a run's copy read from the source, summed up per table and
/// logical shard: the checksums the source had then. Where the journal
/// names no change since, the source still has them, and the verification
/// compares the target with these instead of reading the source again.
#[derive(Debug, Clone, Default)]
pub struct CopySums {
    /// Per table (`entities` or an index table).
    pub tables: BTreeMap<String, checksums::Sums>,
    /// The logical shards whose every row this run read.
    pub logicals: BTreeSet<u16>,
}

impl CopySums {
    fn merge(&mut self, other: CopySums) {
        for (table, sums) in other.tables {
            let mine = self.tables.entry(table).or_default();
            for (k, c) in sums.0 {
                mine.0.insert(k, c);
            }
        }
        self.logicals.extend(other.logicals);
    }
}

impl Mover {
    /// Turns the source's journal on, then copies every logical shard not
    /// yet copied, saving progress after each step. Reading the next batch
    /// from the source overlaps writing the last one to the target.
    pub(crate) async fn copy(&self, run: &mut Running<'_>) -> Result<()> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let shards = self.shards().clone();
        let dst = shards.pool(target);
        migrate::create_base_tables(target, dst).await?;
        for spec in &run.indexes {
            migrate::create_index_table(target, dst, spec).await?;
        }
        // From here on only this run writes the copy (a run that lost the
        // move, frozen or cut off, finds its token replaced).
        moves::claim_incoming(target, dst, &run.rec.logicals, run.token).await?;
        journal::start_journal(source, shards.pool(source), &run.rec.logicals, &run.indexes).await?;
        if run.records_since_us.is_none() {
            // Records a step's copy misses were stamped after it began: for
            // the steps this run copies, after now; for those an earlier
            // run copied, after the move began.
            let from =
                if run.rec.copied.is_empty() { schemas::clock::now_micros() } else { run.rec.started_us };
            run.records_since_us = Some(from - RECORDS_SLACK_US);
        }
        let done: BTreeSet<u16> = run.rec.copied.iter().copied().collect();
        let todo: Vec<u16> = run.rec.logicals.iter().copied().filter(|k| !done.contains(k)).collect();
        run.rows_total = run.rec.rows_copied + self.count_rows(source, &todo, run).await?;

        let (batches, next) = tokio::sync::mpsc::channel::<Batch<'_>>(READ_AHEAD);
        let indexes = run.indexes.clone();
        let read = self.read_batches(source, &todo, &indexes, run.stop, batches);
        let write = async {
            // Owned here, so a failed write closes the channel.
            let mut next = next;
            // Writes in flight, oldest first; a step's progress is saved
            // once every write before its marker has committed.
            let mut pending: VecDeque<Pending> = VecDeque::new();
            let result = async {
                while let Some(batch) = next.recv().await {
                    pending.push_back(match batch {
                        Batch::Entities(step, rows) => {
                            let (pool, step, token) = (dst.clone(), step.to_vec(), run.token);
                            Pending::Write(tokio::spawn(async move {
                                let mut tx = moves::begin_incoming(target, &pool, &step, token).await?;
                                entities::copy_entities(target, &mut tx, &rows).await?;
                                tx.commit().await.on(target)?;
                                Ok(rows.len() as u64)
                            }))
                        }
                        Batch::Index(step, spec, rows) => {
                            let (pool, step, token) = (dst.clone(), step.to_vec(), run.token);
                            let spec = indexes[spec].clone();
                            Pending::Write(tokio::spawn(async move {
                                let mut tx = moves::begin_incoming(target, &pool, &step, token).await?;
                                index_rows::copy_rows(target, &mut tx, &spec, &rows).await?;
                                tx.commit().await.on(target)?;
                                Ok(rows.len() as u64)
                            }))
                        }
                        Batch::Records(step, rows) => {
                            let (pool, step, token) = (dst.clone(), step.to_vec(), run.token);
                            Pending::Write(tokio::spawn(async move {
                                let mut tx = moves::begin_incoming(target, &pool, &step, token).await?;
                                carry::copy_idempotency_records(target, &mut tx, &rows).await?;
                                tx.commit().await.on(target)?;
                                Ok(rows.len() as u64)
                            }))
                        }
                        Batch::StepDone(step) => Pending::StepDone(step),
                    });
                    while pending.iter().filter(|p| matches!(p, Pending::Write(_))).count() >= WRITERS {
                        self.settle_oldest(run, &mut pending).await?;
                    }
                }
                while !pending.is_empty() {
                    self.settle_oldest(run, &mut pending).await?;
                }
                Ok::<_, MoveError>(())
            }
            .await;
            for p in pending {
                if let Pending::Write(task) = p {
                    task.abort();
                }
            }
            result
        };
        let (read, write) = tokio::join!(read, write);
        // A failed write ends the reader too (its sends fail): the write's
        // error is the one to report.
        write?;
        run.copy_sums.merge(read?);
        Ok(())
    }

    /// Waits for the oldest write in flight and counts it, or saves the
    /// progress of a step whose rows have all been written.
    async fn settle_oldest(&self, run: &mut Running<'_>, pending: &mut VecDeque<Pending<'_>>) -> Result<()> {
        match pending.pop_front() {
            Some(Pending::Write(task)) => {
                let n = task.await.map_err(|e| MoveError::Task(e.to_string()))??;
                self.copied(run, n);
            }
            Some(Pending::StepDone(step)) => {
                run.rec.copied.extend_from_slice(step);
                moves::set_copied(self.shards().meta(), run.rec.id, &run.rec.copied, run.rec.rows_copied)
                    .await?;
                self.metrics().progressed();
                self.show(run, false);
            }
            None => {}
        }
        Ok(())
    }

    /// Reads the logical shards of `todo` from the source, a step at a time
    /// (entities in batches, then each index's rows, then the idempotency
    /// records in batches), and sends them to the writer, throttled.
    /// Returns the digests of the rows read.
    async fn read_batches<'t>(
        &self,
        source: usize,
        todo: &'t [u16],
        indexes: &[schemas::index::IndexSpec],
        stop: &tokio_util::sync::CancellationToken,
        out: tokio::sync::mpsc::Sender<Batch<'t>>,
    ) -> Result<CopySums> {
        let src = self.shards().pool(source);
        let mut sums = CopySums::default();
        let batch = self.settings().batch;
        let start = Instant::now();
        let mut read = 0u64;
        let send = |b: Batch<'t>| {
            let out = out.clone();
            async move { out.send(b).await.map_err(|_| MoveError::Stopped) }
        };
        for step in todo.chunks(LOGICALS_PER_STEP) {
            let mut cursor: Option<LogicalCursor> = None;
            loop {
                self.throttle(stop, source, read, start).await?;
                let rows = entities::scan_logicals(source, src, step, cursor, batch).await?;
                let Some((last, _)) = rows.last() else { break };
                cursor = Some(LogicalCursor { logical: last.logical, added_id: last.added_id });
                let full = rows.len() == batch;
                read += rows.len() as u64;
                let entity_sums = sums.tables.entry(tables::ENTITIES.to_string()).or_default();
                for (row, digest) in &rows {
                    entity_sums.add(row.logical, *digest);
                }
                send(Batch::Entities(step, rows.into_iter().map(|(row, _)| row).collect())).await?;
                if !full {
                    break;
                }
            }
            for (i, spec) in indexes.iter().enumerate() {
                self.throttle(stop, source, read, start).await?;
                let rows = index_rows::digested_rows_in_logicals(source, src, spec, step).await?;
                read += rows.len() as u64;
                let index_sums = sums.tables.entry(spec.table.clone()).or_default();
                for (row, digest) in &rows {
                    index_sums.add(row.logical, *digest);
                }
                if !rows.is_empty() {
                    send(Batch::Index(step, i, rows.into_iter().map(|(row, _)| row).collect())).await?;
                }
            }
            let mut after: Option<RecordCursor> = None;
            loop {
                self.throttle(stop, source, read, start).await?;
                let rows = carry::idempotency_records_in(source, src, step, i64::MIN, after, batch).await?;
                let Some(last) = rows.last() else { break };
                after = Some(RecordCursor::after(last));
                let full = rows.len() == batch;
                read += rows.len() as u64;
                send(Batch::Records(step, rows)).await?;
                if !full {
                    break;
                }
            }
            send(Batch::StepDone(step)).await?;
            sums.logicals.extend(step);
        }
        Ok(sums)
    }

    fn copied(&self, run: &mut Running<'_>, n: u64) {
        run.rec.rows_copied += n;
        run.outcome.rows_copied += n;
        self.metrics().rows_copied.inc_by(n);
        self.show(run, false);
    }

    async fn count_rows(&self, source: usize, logicals: &[u16], run: &Running<'_>) -> Result<u64> {
        let pool = self.shards().pool(source);
        let mut n = entities::count_in_logicals(source, pool, logicals).await?;
        n += carry::count_idempotency_records(source, pool, logicals).await?;
        for spec in &run.indexes {
            n += index_rows::count_in_logicals(source, pool, spec, logicals).await?;
        }
        Ok(n)
    }

    /// Keeps the copy under `mover.rate` rows/s, and pauses it while the
    /// source is busier than `mover.max_threads_running`.
    async fn throttle(
        &self,
        stop: &CancellationToken,
        source: usize,
        copied: u64,
        start: Instant,
    ) -> Result<()> {
        if stop.is_cancelled() {
            return Err(MoveError::Stopped);
        }
        let rate = self.settings().rate;
        if rate > 0 {
            let due = Duration::from_secs_f64(copied as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                pause(stop, wait).await?;
            }
        }
        let max = u64::from(self.settings().max_threads_running);
        if max > 0 {
            let pool = self.shards().pool(source);
            let mut waited = Instant::now();
            // Our own statement counts as one running thread.
            while server::threads_running(source, pool).await? > max {
                pause(stop, Duration::from_millis(100)).await?;
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
            let entries = journal::read_journal(source, src, JOURNAL_BATCH).await?;
            if entries.is_empty() {
                break;
            }
            run.touched.extend(entries.iter().map(|e| (e.table.clone(), e.logical)));
            let n = self.apply(run, &journal::by_table(&entries)).await?;
            journal::trim_journal(source, src, &entries).await?;
            applied += entries.len() as u64;
            run.rows_caught_up += n;
            run.outcome.rows_copied += n;
            self.metrics().rows_copied.inc_by(n);
            self.metrics().progressed();
            run.journal_backlog =
                if entries.len() < JOURNAL_BATCH { 0 } else { journal::journal_backlog(source, src).await? };
            self.show(run, false);
            if run.journal_backlog <= until {
                break;
            }
        }
        Ok(applied)
    }

    /// Makes the target's rows of the journaled entities what the source
    /// has now (none, where the source has none). Returns the rows written
    /// or deleted.
    async fn apply(&self, run: &Running<'_>, changed: &BTreeMap<String, Vec<EntityId>>) -> Result<u64> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (self.shards().pool(source), self.shards().pool(target));
        let mut written = 0;
        for (table, ids) in changed {
            if table == tables::ENTITIES {
                let rows = entities::read_entities_any(source, src, ids).await?.records;
                // An entity the source no longer has (a purged tombstone)
                // goes from the target too, or the two would differ for
                // good. Only ids of the moving logical shards: nothing else
                // of the target's is ours to delete.
                let present: BTreeSet<EntityId> = rows.iter().map(|r| r.id).collect();
                let logicals = &run.rec.logicals;
                let gone: Vec<EntityId> = ids
                    .iter()
                    .copied()
                    .filter(|id| !present.contains(id))
                    .filter(|id| logicals.binary_search(&self.shards().logical_of_id(id)).is_ok())
                    .collect();
                let mut tx = moves::begin_incoming(target, dst, logicals, run.token).await?;
                entities::copy_entities(target, &mut tx, &rows).await?;
                let deleted = carry::delete_entities(target, &mut tx, &gone).await?;
                tx.commit().await.on(target)?;
                written += rows.len() as u64 + deleted;
            } else if let Some(spec) = run.indexes.iter().find(|s| s.table == *table) {
                let logicals = &run.rec.logicals;
                let rows: Vec<_> = index_rows::index_rows_of(source, src, spec, ids)
                    .await?
                    .into_iter()
                    .filter(|r| logicals.binary_search(&r.logical).is_ok())
                    .collect();
                let mut tx = moves::begin_incoming(target, dst, logicals, run.token).await?;
                index_rows::replace_rows_of(target, &mut tx, spec, logicals, ids, &rows).await?;
                tx.commit().await.on(target)?;
                written += rows.len() as u64;
            }
            // A table no index has any more (dropped meanwhile): nothing to carry.
        }
        Ok(written)
    }

    /// Copies the rows of `differs`' entities again from the source, as a
    /// catch-up would: for a row the journal did not bring. That happens:
    /// the chaos suite once left two new entities of a move uncopied (a
    /// journal entry lost across the mover's kills and killed
    /// connections), and without this the cutover compared, differed and
    /// retried forever.
    pub(crate) async fn recopy(&self, run: &Running<'_>, differs: &Differs) -> Result<u64> {
        if differs.values().all(Vec::is_empty) {
            return Ok(0);
        }
        self.apply(run, differs).await
    }

    /// Copies again the idempotency records of the moving logical shards
    /// stamped since the last pass (`Running::records_since_us`), then
    /// moves that bound to this pass's start, less [`RECORDS_SLACK_US`].
    /// Run before the cutover, so few are left, and under the fence, where
    /// no record of the moving logical shards can change (every write to
    /// them is held): what that pass copies completes the target's set.
    /// Returns the records copied.
    pub(crate) async fn carry_records(&self, run: &mut Running<'_>) -> Result<u64> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (self.shards().pool(source), self.shards().pool(target));
        let started = schemas::clock::now_micros();
        let since = run.records_since_us.unwrap_or(run.rec.started_us - RECORDS_SLACK_US);
        let batch = self.settings().batch;
        let mut copied = 0u64;
        for step in run.rec.logicals.chunks(LOGICALS_PER_STEP) {
            let mut after: Option<RecordCursor> = None;
            loop {
                if run.stop.is_cancelled() {
                    return Err(MoveError::Stopped);
                }
                let rows = carry::idempotency_records_in(source, src, step, since, after, batch).await?;
                let Some(last) = rows.last() else { break };
                after = Some(RecordCursor::after(last));
                let mut tx = moves::begin_incoming(target, dst, step, run.token).await?;
                carry::copy_idempotency_records(target, &mut tx, &rows).await?;
                tx.commit().await.on(target)?;
                copied += rows.len() as u64;
                if rows.len() < batch {
                    break;
                }
            }
        }
        run.records_since_us = Some(started - RECORDS_SLACK_US);
        tracing::debug!(
            id = run.rec.id,
            since_us = since,
            records = copied,
            "idempotency records copied again"
        );
        Ok(copied)
    }

    /// Catches up, then compares the target with the source logical shard
    /// by logical shard, copies the differing entities again, then catches
    /// up again. Returns the entities that differed: a change the journal
    /// will bring, or a copy that went wrong; the cutover compares them
    /// again once writes are held.
    pub(crate) async fn verify_until_settled(&self, run: &mut Running<'_>) -> Result<Differs> {
        let t = Instant::now();
        self.catch_up(run, SHORT_JOURNAL).await?;
        let caught_up = t.elapsed();
        let differs = self.verify(run, None).await?;
        let verified = t.elapsed() - caught_up;
        self.recopy(run, &differs).await?;
        self.catch_up(run, SHORT_JOURNAL).await?;
        let n: usize = differs.values().map(Vec::len).sum();
        tracing::info!(
            id = run.rec.id,
            differing = n,
            catch_up_secs = (t.elapsed() - verified).as_secs_f64(),
            verify_secs = verified.as_secs_f64(),
            "move verified; differing entities are compared again at the cutover"
        );
        Ok(differs)
    }

    /// Compares source and target: every row of the moving logical shards
    /// (by checksums, then row by row where those differ), or (with `only`)
    /// the rows of those entities. Source and target are read at once.
    pub(crate) async fn verify(&self, run: &mut Running<'_>, only: Option<&Differs>) -> Result<Differs> {
        if only.is_some() {
            return self.compare_rows(run, &run.rec.logicals, only).await;
        }
        // Changes the journal holds and the catch-up has not applied yet.
        let source = run.rec.source as usize;
        let pending: BTreeSet<(String, u16)> =
            journal::pending_logicals(source, self.shards().pool(source)).await?.into_iter().collect();
        let mut out = Differs::new();
        let mut against_copy = 0;
        for step in run.rec.logicals.chunks(LOGICALS_PER_VERIFY) {
            if run.stop.is_cancelled() {
                return Err(MoveError::Stopped);
            }
            let (differing, trusted) = self.differing_logicals(run, step, &pending).await?;
            against_copy += trusted;
            if !differing.is_empty() {
                for (table, ids) in self.compare_rows(run, &differing, None).await? {
                    out.entry(table).or_default().extend(ids);
                }
            }
        }
        // An entity's index rows may lie in logical shards of several steps.
        for ids in out.values_mut() {
            ids.sort_unstable();
            ids.dedup();
        }
        let slices = run.rec.logicals.len() * (1 + run.indexes.len());
        run.outcome.verified_against_copy = against_copy;
        run.outcome.verified_slices = slices;
        tracing::debug!(
            id = run.rec.id,
            against_copy,
            against_source = slices - against_copy,
            "compared (table, logical shard) slices with the copy's digests or the source's rows"
        );
        Ok(out)
    }

    /// The logical shards of `step` whose checksums differ between source
    /// and target, in any table; and how many (table, logical shard)s were
    /// compared with the copy's digests. The target is always summed up
    /// by its server. The source is only where this run's copy did not read
    /// the logical shard, or the journal has named a change to it in that
    /// table since (applied, or `pending`): elsewhere it still has what the
    /// copy read.
    async fn differing_logicals(
        &self,
        run: &Running<'_>,
        step: &[u16],
        pending: &BTreeSet<(String, u16)>,
    ) -> Result<(Vec<u16>, usize)> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (self.shards().pool(source), self.shards().pool(target));
        let mut out: BTreeSet<u16> = BTreeSet::new();
        let mut trusted_total = 0;
        let mut tables: Vec<Option<&schemas::index::IndexSpec>> = vec![None];
        tables.extend(run.indexes.iter().map(Some));
        for spec in tables {
            let table = spec.map_or(tables::ENTITIES, |s| s.table.as_str());
            let copied = run.copy_sums.tables.get(table);
            let key = |k: u16| (table.to_string(), k);
            let (trusted, reread): (Vec<u16>, Vec<u16>) = step.iter().partition(|k| {
                copied.is_some()
                    && run.copy_sums.logicals.contains(k)
                    && !run.touched.contains(&key(**k))
                    && !pending.contains(&key(**k))
            });
            trusted_total += trusted.len();
            let (source_sums, target_sums) = match spec {
                None => tokio::try_join!(
                    checksums::entities(source, src, &reread),
                    checksums::entities(target, dst, step)
                )?,
                Some(spec) => tokio::try_join!(
                    checksums::index_rows(source, src, spec, &reread),
                    checksums::index_rows(target, dst, spec, step)
                )?,
            };
            let mut want = source_sums;
            if let Some(copied) = copied {
                want.extend(trusted.iter().filter_map(|k| copied.0.get(k).map(|c| (*k, *c))));
            }
            out.extend(checksums::differing(&want, &target_sums));
        }
        Ok((out.into_iter().collect(), trusted_total))
    }

    /// Compares the rows of `logicals` (or, with `only`, of those entities
    /// among them) one by one.
    async fn compare_rows(
        &self,
        run: &Running<'_>,
        logicals: &[u16],
        only: Option<&Differs>,
    ) -> Result<Differs> {
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (self.shards().pool(source), self.shards().pool(target));
        let mut out = Differs::new();
        let ids = only.map(|d| d.get(tables::ENTITIES).map_or(&[][..], Vec::as_slice));
        if ids.is_none_or(|ids| !ids.is_empty()) {
            let (a, b) = tokio::try_join!(
                entities::fingerprints(source, src, logicals, ids),
                entities::fingerprints(target, dst, logicals, ids)
            )?;
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
                None => tokio::try_join!(
                    index_rows::rows_in_logicals(source, src, spec, logicals),
                    index_rows::rows_in_logicals(target, dst, spec, logicals)
                )?,
                Some(d) => {
                    let Some(ids) = d.get(&spec.table).filter(|ids| !ids.is_empty()) else { continue };
                    let keep = |rows: Vec<IndexRow>| -> Vec<IndexRow> {
                        rows.into_iter().filter(|r| logicals.binary_search(&r.logical).is_ok()).collect()
                    };
                    let (a, b) = tokio::try_join!(
                        index_rows::index_rows_of(source, src, spec, ids),
                        index_rows::index_rows_of(target, dst, spec, ids)
                    )?;
                    (keep(a), keep(b))
                }
            };
            let fp = |rows: &[IndexRow]| -> Vec<(EntityId, _)> {
                rows.iter().map(|r| (r.entity, index_rows::row_fingerprint(r))).collect()
            };
            let differ = symmetric_difference(fp(&a).into_iter(), fp(&b).into_iter());
            if !differ.is_empty() {
                out.entry(spec.table.clone()).or_default().extend(differ);
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
