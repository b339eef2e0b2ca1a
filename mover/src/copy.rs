//! The copy phase's first copy: the source's journal on, then every row of
//! the moving logical shards copied to the target a few logical shards at
//! a time, reading ahead of the writes, progress saved after each step;
//! and the idempotency records copied again before the cutover. Catching
//! up and verifying follow ([`crate::verify`]).

use schemas::names::tables;
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
        // Refused once the source gave them up (this run lost its move).
        journal::start_journal(source, shards.pool(source), run.rec.id, &run.rec.logicals, &run.indexes)
            .await?;
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
}
