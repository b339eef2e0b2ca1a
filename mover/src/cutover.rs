//! The cutover: a short fence on the source, then ownership changes hands
//! and the map flips. Also the recovery of a cutover that was killed.

use std::time::{Duration, Instant};
use storage::moves::{self, Fence, Phase};
use storage::{carry, topology, StoreError};

use crate::verify::Differs;
use crate::{MoveError, Mover, Result, Running};

/// Why a cutover attempt did not complete.
#[derive(Debug)]
pub(crate) enum Retry {
    /// Nothing changed; try again later.
    Again(&'static str),
    /// A failover of the source or target ran during the cutover: the map
    /// did not flip; the cutover is recovered against the new primaries
    /// (the move stays in its cutover phase).
    Recover,
    Fatal(MoveError),
}

impl<E: Into<MoveError>> From<E> for Retry {
    fn from(e: E) -> Retry {
        Retry::Fatal(e.into())
    }
}

impl Mover {
    /// One cutover attempt. On success returns how long writes to the
    /// moving logical shards waited (from the fence closing to the map
    /// flipping).
    pub(crate) async fn cutover(&self, run: &mut Running<'_>, differs: &Differs) -> Result<Duration, Retry> {
        let shards = self.shards().clone();
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (shards.pool(source), shards.pool(target));
        let logicals = run.rec.logicals.clone();
        // The flip happens only if neither primary changes from here on.
        let failovers = moves::failovers(shards.meta(), run.rec.source, run.rec.target).await?;
        let conn = storage::dsn::dedicated_connection(shards.dsn(source))
            .await
            .map_err(|e| StoreError::Shard { shard: source, source: e })?;
        let wait_secs = self.settings().fence_wait_ms.div_ceil(1000) as u32;
        let closing = Instant::now();
        let fence = match Fence::close(source, conn, &logicals, wait_secs).await {
            Ok(f) => f,
            Err(e) if e.is_retryable_conflict() => {
                self.metrics().cutover_attempts.with_label_values(&["busy"]).inc();
                return Err(Retry::Again("writes in flight did not finish within mover.fence_wait_ms"));
            }
            Err(e) => return Err(e.into()),
        };
        // Held from here: no write to the moving logical shards commits on
        // the source, and every earlier one has committed and is journaled.
        let held = async {
            self.catch_up(run, 0).await?;
            let mut still = self.verify(run, Some(differs)).await?;
            if !still.is_empty() {
                // The source is still now (writes held): copy those rows
                // again and compare once more.
                self.recopy(run, &still).await?;
                still = self.verify(run, Some(&still)).await?;
            }
            if !still.is_empty() {
                let n: usize = still.values().map(Vec::len).sum();
                tracing::error!(id = run.rec.id, differing = n, tables = ?still.keys().collect::<Vec<_>>(),
                    "the copy differs from the source with writes held: not cutting over");
                self.metrics().cutover_attempts.with_label_values(&["differs"]).inc();
                return Ok::<_, MoveError>(Err("the copy differs from the source"));
            }
            // The last idempotency records: those stamped since the pass
            // before the fence (less the slack); none can change now.
            self.carry_records(run).await?;
            // Invariant W: the source's events reach Kafka before the target
            // can commit a later version of the same entity.
            let deadline = Instant::now() + Duration::from_millis(self.settings().outbox_wait_ms);
            let l = shards.logical_shards();
            while moves::outbox_pending_in(source, src, fence.outbox_upto, &logicals, l).await? > 0 {
                if Instant::now() >= deadline {
                    self.metrics().cutover_attempts.with_label_values(&["outbox"]).inc();
                    return Ok(Err("the source's outbox did not reach Kafka within mover.outbox_wait_ms"));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // The source's version floors: a purge raises one only with the
            // owned row locked, and the fence holds them all, so these are
            // final (read on another connection: the fence's rows are
            // locked, not hidden).
            Ok(Ok(carry::version_floors(source, src, &logicals).await?))
        }
        .await;
        let floors = match held {
            Ok(Ok(floors)) => floors,
            Ok(Err(why)) => {
                fence.open().await;
                return Err(Retry::Again(why));
            }
            Err(e) => {
                fence.open().await;
                return Err(e.into());
            }
        };
        // The hand-over, in the order a kill can interrupt safely (see
        // `recover_cutover`): target owns, with the source's floors (if
        // this run still holds the move), source gives up, target's epoch
        // rises to the source's, map flips.
        moves::take_over(target, dst, &logicals, run.token, &floors).await?;
        self.drill_hold().await;
        let source_epoch = moves::cluster_epoch(shards.meta()).await? + 1;
        fence.release(source_epoch).await?;
        self.drill_hold().await;
        let target_epoch = moves::raise_epoch(target, dst, source_epoch).await?;
        let epochs = (source_epoch, target_epoch);
        let (id, from, to) = (run.rec.id, run.rec.source, run.rec.target);
        match moves::flip(shards.meta(), id, &logicals, from, to, epochs, failovers).await {
            Ok(_) => {}
            Err(e @ StoreError::FailedOverMidCutover { .. }) => {
                tracing::warn!(id, error = %e, "a failover ran during the cutover: recovering it");
                return Err(Retry::Recover);
            }
            Err(e) => return Err(e.into()),
        }
        let pause = closing.elapsed();
        run.rec.phase = Phase::Cleanup;
        self.metrics().cutover_pause.observe(pause.as_secs_f64());
        self.metrics().cutover_attempts.with_label_values(&["ok"]).inc();
        self.metrics().progressed();
        shards.reload().await?;
        tracing::info!(id = run.rec.id, pause_ms = pause.as_millis() as u64, "cutover done: the map flipped");
        Ok(pause)
    }

    /// `mover.drill_hold_ms`: a window to kill the mover in, for drills.
    async fn drill_hold(&self) {
        let hold = self.settings().drill_hold_ms;
        if hold > 0 {
            tracing::warn!(hold_ms = hold, "holding the cutover for a drill (mover.drill_hold_ms)");
            tokio::time::sleep(Duration::from_millis(hold)).await;
        }
    }

    /// A move found in phase cutover was killed during one. If the source
    /// still owns the logical shards the fence never released: take back
    /// any grant to the target (its floors go with it) and copy again (the
    /// next cutover reads the floors and the last records again). If it
    /// gave them up, the target was granted them first, with the floors in
    /// the same transaction, and the records were copied under the fence:
    /// raise the target's epoch (again: it is idempotent) and flip the map.
    ///
    /// "The source still owns them" is judged under the fence, not by a
    /// plain read: a run that lost the mover lock without knowing may be
    /// in its cutover, its fence holding those rows and about to release
    /// them. Closing the fence waits for that run's fence to end. If the
    /// source still owns everything then, this run claims the copy (the
    /// other run's `take_over` now fails) and revokes the target's grant
    /// before it lets writes go on.
    pub(crate) async fn recover_cutover(&self, run: &mut Running<'_>) -> Result<()> {
        let shards = self.shards().clone();
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        let (src, dst) = (shards.pool(source), shards.pool(target));
        let logicals = run.rec.logicals.clone();
        let failovers = moves::failovers(shards.meta(), run.rec.source, run.rec.target).await?;
        let conn = storage::dsn::dedicated_connection(shards.dsn(source))
            .await
            .map_err(|e| StoreError::Shard { shard: source, source: e })?;
        let wait_secs = self.settings().fence_wait_ms.div_ceil(1000) as u32;
        match Fence::close(source, conn, &logicals, wait_secs).await {
            Ok(fence) => {
                let undone = async {
                    moves::claim_incoming(target, dst, &logicals, run.token).await?;
                    moves::revoke(target, dst, &logicals).await
                }
                .await;
                fence.open().await;
                undone?;
                tracing::info!(id = run.rec.id, "resuming a cutover that did not release: copying again");
                return self.set_phase(run, Phase::Copy).await;
            }
            // The source gave some up: the release committed (below).
            Err(StoreError::BadTopology(_)) => {}
            Err(e) => return Err(e.into()),
        }
        let source_owns = moves::owns(source, src, &logicals).await?.len();
        let target_owns = moves::owns(target, dst, &logicals).await?.len();
        if source_owns != 0 || target_owns != logicals.len() {
            return Err(MoveError::Invalid(format!(
                "move {}: ownership is split (source owns {source_owns}, target {target_owns} of {}); \
                 this needs an operator",
                run.rec.id,
                logicals.len()
            )));
        }
        let me = topology::identity(source, shards.pool(source))
            .await?
            .ok_or_else(|| MoveError::Invalid(format!("physical shard {source} lost its identity")))?;
        let target_epoch = moves::raise_epoch(target, dst, me.epoch).await?;
        let epochs = (me.epoch, target_epoch);
        let (id, from, to) = (run.rec.id, run.rec.source, run.rec.target);
        match moves::flip(shards.meta(), id, &logicals, from, to, epochs, failovers).await {
            Ok(_) => {}
            Err(e @ StoreError::FailedOverMidCutover { .. }) => {
                // Still in its cutover phase: recovered again, on the new map.
                tracing::warn!(id, error = %e, "a failover ran during the cutover's recovery: recovering again");
                shards.reload().await?;
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
        run.rec.phase = Phase::Cleanup;
        shards.reload().await?;
        tracing::info!(id = run.rec.id, "finished a cutover killed after the release: the map flipped");
        Ok(())
    }
}
