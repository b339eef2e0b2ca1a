//! The mover: moves logical shards between physical shards while the
//! cluster serves, and rebalances.
//!
//! A move of logical shards S from physical shard P (source) to Q (target)
//! runs in phases, each recorded on the metadata shard so a killed move
//! resumes where it was ([`Mover::run`]):
//! 1. **copy** ([`copy`]): P starts journaling changes to S (see
//!    `storage::moves`); S's entities, index rows and idempotency records
//!    are copied to Q in `(logical, clustered key)` order, throttled, a
//!    few logical shards at a time, progress saved after each; the journal
//!    is replayed onto Q until it is short (an entity P no longer has goes
//!    from Q too); Q is compared with P ([`verify`]: with the digests
//!    of the rows the copy read, where the journal says P has not changed
//!    since, else with P's rows as they are now); the idempotency records
//!    written meanwhile are copied again.
//! 2. **cutover** ([`cutover`]): P's ownership rows of S are locked
//!    exclusively (writes to S wait), the journal is replayed to empty,
//!    the rows that differed at verification are compared again, the
//!    last idempotency records are copied, P's outbox events up to the
//!    fence reach Kafka (Invariant W), Q is granted S with P's version
//!    floors, P gives S up and the map flips, in that order. Writes that
//!    waited find P no longer owns S, reload the map and go to Q.
//! 3. **cleanup** ([`cleanup`]): once every live process routes with the
//!    new map, P's journaling stops and its copy of S (rows and
//!    idempotency records) is deleted.
//!
//! A move that has not flipped the map can be rolled back
//! ([`Mover::abort`]): Q gives S back and forgets its copy. One move runs
//! at a time in a cluster, by the process holding the mover lock.
//!
//! Layout: this file (the [`Mover`], phases in order); [`plan`]: the moves
//! a command asks for; [`copy`] (the first copy), [`verify`] (catch-up and
//! verification), [`cutover`], [`cleanup`]: the phases; [`metrics`].

pub mod cleanup;
pub mod copy;
pub mod cutover;
pub mod metrics;
pub mod plan;
pub mod runs;
pub mod verify;

use schemas::topology::{format_logicals, PhysicalId};
use schemas::{IndexSpec, Settings};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage::moves::{self, MoveRecord, Phase};
use storage::{catalog, locks, Shards, StoreError};
use tokio_util::sync::CancellationToken;

pub use metrics::MoverMetrics;

#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("another process is running the cluster's moves (it holds the mover lock)")]
    Busy,
    #[error("{0}")]
    Invalid(String),
    #[error("stopped; the move resumes from its saved progress")]
    Stopped,
    #[error(
        "move {id}: the cutover did not succeed in {attempts} attempts (writes in flight or the outbox did \
         not finish in time, or the copy kept differing); the move stays in phase copy and can be resumed"
    )]
    CutoverGaveUp { id: u64, attempts: u32 },
    #[error("move {id} has flipped the map already; it can only be finished, not rolled back")]
    TooLateToAbort { id: u64 },
    #[error("a copy task failed: {0}")]
    Task(String),
}

impl MoveError {
    /// This run lost its move to another run of the mover (see
    /// `StoreError::MoveTakenOver` and `StoreError::MovePhaseMoved`).
    pub fn is_taken_over(&self) -> bool {
        matches!(self, MoveError::Store(StoreError::MoveTakenOver { .. } | StoreError::MovePhaseMoved { .. }))
    }
}

pub type Result<T, E = MoveError> = std::result::Result<T, E>;

/// Transient failures in a row (no progress between them) a move rides
/// out before its command gives up (and the move waits for `resume`).
const TRANSIENT_RETRIES: u32 = 10;

/// What a running move reports, for a progress bar or a log line.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Progress {
    pub move_id: u64,
    pub phase: Phase,
    pub source: String,
    pub target: String,
    pub logicals: usize,
    /// Rows copied once (the first copy) and how many there are.
    pub rows_copied: u64,
    pub rows_total: u64,
    /// Rows copied again from the journal.
    pub rows_caught_up: u64,
    pub journal_backlog: u64,
    pub rows_per_sec: f64,
    pub elapsed_secs: f64,
}

/// How a finished move went.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Outcome {
    pub move_id: u64,
    pub logicals: usize,
    pub rows_copied: u64,
    /// The copy phase: first copy, catch-up and verification.
    pub copy_secs: f64,
    /// Of which the first copy.
    pub first_copy_secs: f64,
    /// Rows copied per second of the copy phase.
    pub rows_per_sec: f64,
    /// How long writes to the moved logical shards waited at the cutover.
    pub pause_secs: f64,
    pub cutover_attempts: u32,
    pub total_secs: f64,
    /// (table, logical shard) slices the last full verification compared
    /// with the copy's digests, and all it compared.
    pub verified_against_copy: usize,
    pub verified_slices: usize,
}

/// Receives progress; called at most every few hundred milliseconds.
pub type Report<'a> = &'a (dyn Fn(&Progress) + Sync);

/// Runs moves. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Mover {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    settings: Settings,
    shards: Shards,
    metrics: MoverMetrics,
}

/// The mover lock: held while it lives.
pub type MoverLock = locks::HeldLock;

/// One move being run: its record and what the phases share.
pub(crate) struct Running<'a> {
    pub rec: MoveRecord,
    pub indexes: Vec<IndexSpec>,
    pub report: Report<'a>,
    pub stop: &'a CancellationToken,
    pub started: Instant,
    /// This run's token: the target accepts copies only from the run that
    /// claimed its incoming rows last (see `storage::moves::claim_incoming`).
    pub token: u64,
    pub rows_total: u64,
    pub rows_caught_up: u64,
    /// Idempotency records stamped at or after this (µs, writers' clocks)
    /// may have changed since they were last copied: the next pass of
    /// [`Mover::carry_records`] copies them again. Set when the copy
    /// starts, moved up by each pass.
    pub records_since_us: Option<i64>,
    pub journal_backlog: u64,
    pub last_report: Option<Instant>,
    pub outcome: Outcome,
    /// The digests of the rows this run's copy read from the source.
    pub copy_sums: copy::CopySums,
    /// The `(table, logical shard)`s the journal has named to this run.
    pub touched: std::collections::BTreeSet<(String, u16)>,
}

impl Mover {
    pub fn new(settings: Settings, shards: Shards, metrics: MoverMetrics) -> Mover {
        Mover { inner: Arc::new(Inner { settings, shards, metrics }) }
    }

    pub fn shards(&self) -> &Shards {
        &self.inner.shards
    }

    pub(crate) fn settings(&self) -> &schemas::settings::MoverSettings {
        &self.inner.settings.mover
    }

    pub(crate) fn metrics(&self) -> &MoverMetrics {
        &self.inner.metrics
    }

    /// Runs one move from its recorded phase to the end.
    pub async fn run(
        &self,
        _lock: &MoverLock,
        rec: MoveRecord,
        report: Report<'_>,
        stop: &CancellationToken,
    ) -> Result<Outcome> {
        self.shards().reload().await?;
        let indexes = self.indexes().await?;
        let outcome = Outcome { move_id: rec.id, logicals: rec.logicals.len(), ..Default::default() };
        let mut run = Running {
            rec,
            indexes,
            report,
            stop,
            started: Instant::now(),
            token: run_token(),
            rows_total: 0,
            rows_caught_up: 0,
            records_since_us: None,
            journal_backlog: 0,
            last_report: None,
            outcome,
            copy_sums: copy::CopySums::default(),
            touched: Default::default(),
        };
        tracing::info!(
            id = run.rec.id,
            logicals = %format_logicals(&run.rec.logicals),
            source = run.rec.source,
            target = run.rec.target,
            phase = run.rec.phase.as_str(),
            "running move"
        );
        self.metrics().in_flight.set(1);
        self.metrics().progressed();
        let result = self.drive_through_transient_errors(&mut run).await;
        self.metrics().in_flight.set(0);
        self.metrics().phase.set(0);
        result?;
        run.outcome.total_secs = run.started.elapsed().as_secs_f64();
        tracing::info!(id = run.rec.id, outcome = ?run.outcome, "move done");
        Ok(run.outcome)
    }

    /// Drives the move; a step that fails on a transient error (a killed
    /// session, a restarted or failed-over server, a deadlock; see
    /// `StoreError::is_transient`) resumes from the saved record, on the map
    /// as it is then, as after a kill, up to [`TRANSIENT_RETRIES`] times in
    /// a row without progress.
    async fn drive_through_transient_errors(&self, run: &mut Running<'_>) -> Result<()> {
        let mut failures = 0u32;
        loop {
            let before = (run.rec.phase, run.rec.copied.len());
            match self.drive(run).await {
                Err(MoveError::Store(e)) if e.is_transient() && failures < TRANSIENT_RETRIES => {
                    failures = if (run.rec.phase, run.rec.copied.len()) == before { failures + 1 } else { 1 };
                    tracing::warn!(
                        id = run.rec.id,
                        attempt = failures,
                        error = %e,
                        "a move step failed on a transient error; resuming from the saved progress"
                    );
                    self.pause(run, Duration::from_millis(250 * u64::from(failures))).await?;
                    // A shard that failed over is reached at its new primary.
                    if let Err(e) = self.shards().reload().await {
                        tracing::debug!(error = %e, "the map could not be loaded yet");
                    }
                    run.rec = self.saved_record(run).await?;
                }
                other => return other,
            }
        }
    }

    /// The move's record as the metadata shard has it (read again a few
    /// times if the metadata shard's connection died too).
    async fn saved_record(&self, run: &Running<'_>) -> Result<MoveRecord> {
        let mut tries = 0u32;
        loop {
            match moves::get_move(self.shards().meta(), run.rec.id).await {
                Ok(Some(rec)) => return Ok(rec),
                Ok(None) => {
                    return Err(MoveError::Invalid(format!("move {} is no longer recorded", run.rec.id)))
                }
                Err(e) if e.is_transient() && tries < TRANSIENT_RETRIES => {
                    tries += 1;
                    self.pause(run, Duration::from_millis(250 * u64::from(tries))).await?;
                    if let Err(e) = self.shards().reload().await {
                        tracing::debug!(error = %e, "the map could not be loaded yet");
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    async fn drive(&self, run: &mut Running<'_>) -> Result<()> {
        let mut attempts = 0;
        loop {
            self.metrics().phase.set(phase_code(run.rec.phase));
            self.show(run, true);
            match run.rec.phase {
                Phase::Copy => {
                    let copy_start = Instant::now();
                    self.copy(run).await?;
                    let first = copy_start.elapsed().as_secs_f64();
                    run.outcome.first_copy_secs += first;
                    tracing::info!(
                        id = run.rec.id,
                        rows = run.rec.rows_copied,
                        secs = first,
                        "first copy done; catching up and verifying"
                    );
                    let differs = self.verify_until_settled(run).await?;
                    // Idempotency records written since their step was
                    // copied, so the pass under the fence has few to copy.
                    self.carry_records(run).await?;
                    let secs = copy_start.elapsed().as_secs_f64();
                    run.outcome.copy_secs += secs;
                    run.outcome.rows_per_sec =
                        run.outcome.rows_copied as f64 / run.outcome.copy_secs.max(1e-9);
                    self.set_phase(run, Phase::Cutover).await?;
                    match self.cutover(run, &differs).await {
                        Ok(pause) => {
                            run.outcome.pause_secs = pause.as_secs_f64();
                            run.rec.phase = Phase::Cleanup;
                        }
                        Err(cutover::Retry::Again(why)) => {
                            attempts += 1;
                            run.outcome.cutover_attempts = attempts;
                            tracing::warn!(
                                id = run.rec.id,
                                attempt = attempts,
                                why,
                                "cutover did not complete"
                            );
                            self.set_phase(run, Phase::Copy).await?;
                            if attempts >= self.settings().cutover_attempts {
                                return Err(MoveError::CutoverGaveUp { id: run.rec.id, attempts });
                            }
                            self.pause(run, Duration::from_millis(200 * u64::from(attempts.min(10)))).await?;
                        }
                        Err(cutover::Retry::Recover) => {
                            // The phase is still cutover: recovered next, on the new map.
                            self.shards().reload().await?;
                        }
                        Err(cutover::Retry::Fatal(e)) => return Err(e),
                    }
                }
                Phase::Cutover => self.recover_cutover(run).await?,
                Phase::Cleanup => {
                    self.cleanup(run).await?;
                    self.set_phase(run, Phase::Done).await?;
                }
                Phase::RollingBack => {
                    self.roll_back(run).await?;
                    self.set_phase(run, Phase::RolledBack).await?;
                }
                Phase::Done | Phase::RolledBack => return Ok(()),
            }
        }
    }

    /// The service loop (in the cleaner role): whenever a move is in
    /// flight and no other process runs it, run it. A move recorded by
    /// `bagstore shards` while this process held the lock, or left behind
    /// by a killed process, is finished here.
    pub async fn serve(self, stop: CancellationToken) {
        let log = |p: &Progress| {
            tracing::debug!(
                id = p.move_id,
                phase = p.phase.as_str(),
                copied = p.rows_copied,
                total = p.rows_total,
                "move progress"
            )
        };
        loop {
            let mut wait = Duration::from_secs(1);
            match moves::moves_in_flight(self.shards().meta()).await {
                Ok(m) if !m.is_empty() => match self.lock().await {
                    Ok(lock) => {
                        if let Err(e) = self.resume_in_flight(&lock, &log, &stop).await {
                            tracing::error!(error = %e, "move failed; it stays resumable, tried again in 10 s");
                            wait = Duration::from_secs(10);
                        }
                    }
                    Err(MoveError::Busy) => {}
                    Err(e) => tracing::warn!(error = %e, "cannot take the mover lock"),
                },
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot read the moves in flight"),
            }
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    /// Rolls back a move that has not flipped the map: the target gives
    /// back what it was granted and forgets its copy; the source stops
    /// journaling.
    pub async fn abort(&self, id: u64, report: Report<'_>, stop: &CancellationToken) -> Result<Outcome> {
        let lock = self.lock().await?;
        let rec = moves::get_move(self.shards().meta(), id)
            .await?
            .ok_or_else(|| MoveError::Invalid(format!("there is no move {id}")))?;
        match rec.phase {
            Phase::Copy | Phase::Cutover | Phase::RollingBack => {}
            Phase::Cleanup | Phase::Done => return Err(MoveError::TooLateToAbort { id }),
            Phase::RolledBack => return Ok(Outcome { move_id: id, ..Default::default() }),
        }
        if rec.phase == Phase::Cutover {
            // Past the release the map must flip: finish instead.
            let source_owns =
                moves::owns(rec.source as usize, self.shards().pool(rec.source as usize), &rec.logicals)
                    .await?
                    .len();
            if source_owns < rec.logicals.len() {
                return Err(MoveError::TooLateToAbort { id });
            }
        }
        moves::set_phase(self.shards().meta(), id, rec.phase, Phase::RollingBack).await?;
        let rec = MoveRecord { phase: Phase::RollingBack, ..rec };
        self.run(&lock, rec, report, stop).await
    }

    /// Index tables a move carries: every index that is not being dropped.
    async fn indexes(&self) -> Result<Vec<IndexSpec>> {
        Ok(catalog::list_index_meta(self.shards())
            .await?
            .into_iter()
            .filter(|m| m.state != schemas::index::IndexState::Dropping)
            .map(|m| m.spec)
            .collect())
    }

    pub(crate) async fn set_phase(&self, run: &mut Running<'_>, phase: Phase) -> Result<()> {
        moves::set_phase(self.shards().meta(), run.rec.id, run.rec.phase, phase).await?;
        run.rec.phase = phase;
        self.metrics().phase.set(phase_code(phase));
        self.metrics().progressed();
        Ok(())
    }

    /// Reports progress (at most every 250 ms unless `now`).
    pub(crate) fn show(&self, run: &mut Running<'_>, now: bool) {
        if !now && run.last_report.is_some_and(|t| t.elapsed() < Duration::from_millis(250)) {
            return;
        }
        run.last_report = Some(Instant::now());
        let t = self.shards().topology();
        let name = |id: PhysicalId| t.shard(id).map_or_else(|| id.to_string(), |p| p.name.clone());
        let elapsed = run.started.elapsed().as_secs_f64();
        let p = Progress {
            move_id: run.rec.id,
            phase: run.rec.phase,
            source: name(run.rec.source),
            target: name(run.rec.target),
            logicals: run.rec.logicals.len(),
            rows_copied: run.rec.rows_copied,
            rows_total: run.rows_total.max(run.rec.rows_copied),
            rows_caught_up: run.rows_caught_up,
            journal_backlog: run.journal_backlog,
            rows_per_sec: run.outcome.rows_copied as f64 / elapsed.max(1e-9),
            elapsed_secs: elapsed,
        };
        self.metrics().rows_per_second.set(p.rows_per_sec);
        self.metrics().rows_remaining.set(p.rows_total.saturating_sub(p.rows_copied) as i64);
        self.metrics().journal_backlog.set(p.journal_backlog as i64);
        (run.report)(&p);
    }

    /// Sleeps unless stopped.
    pub(crate) async fn pause(&self, run: &Running<'_>, d: Duration) -> Result<()> {
        pause(run.stop, d).await
    }
}

/// Waits `d`, unless the run is stopped first.
pub(crate) async fn pause(stop: &CancellationToken, d: Duration) -> Result<()> {
    tokio::select! {
        _ = tokio::time::sleep(d) => Ok(()),
        _ = stop.cancelled() => Err(MoveError::Stopped),
    }
}

/// A token no other run of the mover has: the time in nanoseconds and the
/// process id.
fn run_token() -> u64 {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    (nanos as u64) ^ (u64::from(std::process::id()) << 40)
}

fn phase_code(p: Phase) -> i64 {
    match p {
        Phase::Copy => 1,
        Phase::Cutover => 2,
        Phase::Cleanup => 3,
        Phase::RollingBack => 4,
        Phase::Done | Phase::RolledBack => 0,
    }
}
