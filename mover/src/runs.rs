//! The mover's runs: its lock, a plan's moves one after another, and the
//! moves in flight finished first, also after this run lost one to
//! another process.

use schemas::topology::MovePlan;
use std::time::Duration;
use storage::moves;
use storage::{locks, META_SHARD};
use tokio_util::sync::CancellationToken;

use crate::{MoveError, Mover, MoverLock, Outcome, Report, Result};

impl Mover {
    /// Takes the mover lock, or fails with [`MoveError::Busy`].
    pub async fn lock(&self) -> Result<MoverLock> {
        locks::take_mover_lock(self.shards().dsn(META_SHARD)).await?.ok_or(MoveError::Busy)
    }

    /// Runs `plans` one after another (after finishing any move already in
    /// flight), holding the mover lock. Stops at the first error; what was
    /// done stays done, and the move that failed resumes on the next run.
    /// A run that loses its move (its lock's connection died, and a
    /// cleaner's mover took the lock and the move) waits for the lock,
    /// finishes what is in flight and goes on with the plan.
    pub async fn execute(
        &self,
        plans: &[MovePlan],
        report: Report<'_>,
        stop: &CancellationToken,
    ) -> Result<Vec<Outcome>> {
        let mut out = Vec::new();
        let mut lock = self.finish_in_flight(self.lock().await?, &mut out, report, stop).await?;
        for plan in plans {
            loop {
                // A resumed move may have done part of the plan already.
                self.shards().reload().await?;
                let t = self.shards().topology();
                let logicals: Vec<u16> =
                    plan.logicals.iter().copied().filter(|k| t.owner(*k) == plan.from).collect();
                if logicals.is_empty() {
                    break;
                }
                if t.shard(plan.to).is_none() {
                    return Err(MoveError::Invalid(format!("physical shard {} is not registered", plan.to)));
                }
                let rec = moves::create_move(self.shards().meta(), &logicals, plan.from, plan.to).await?;
                match self.run(&lock, rec, report, stop).await {
                    Ok(outcome) => {
                        out.push(outcome);
                        break;
                    }
                    Err(e) if e.is_taken_over() => {
                        tracing::warn!(error = %e,
                            "this run lost the mover lock and its move to another process; waiting for the lock");
                        drop(lock);
                        lock = self
                            .finish_in_flight(self.wait_for_lock(stop).await?, &mut out, report, stop)
                            .await?;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(out)
    }

    /// Finishes the moves in flight (into `out`). A run that loses one to
    /// another process (its lock's connection died, with its server in a
    /// failover of the metadata shard, say, and a cleaner's mover took the
    /// lock and the move) waits for the lock and finishes what is still in
    /// flight then. Returns the lock held at the end.
    async fn finish_in_flight(
        &self,
        mut lock: MoverLock,
        out: &mut Vec<Outcome>,
        report: Report<'_>,
        stop: &CancellationToken,
    ) -> Result<MoverLock> {
        loop {
            match self.resume_in_flight(&lock, report, stop).await {
                Ok(done) => {
                    out.extend(done);
                    return Ok(lock);
                }
                Err(e) if e.is_taken_over() => {
                    tracing::warn!(error = %e,
                        "this run lost the mover lock and its move to another process; waiting for the lock");
                    drop(lock);
                    lock = self.wait_for_lock(stop).await?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes the mover lock once the process holding it lets it go.
    async fn wait_for_lock(&self, stop: &CancellationToken) -> Result<MoverLock> {
        loop {
            match self.lock().await {
                Ok(lock) => return Ok(lock),
                Err(MoveError::Busy) => {}
                // The lock's server (the metadata shard's primary) may be
                // failing over: asked again on the map as it is then.
                Err(MoveError::Store(e)) if e.is_transient() => {
                    if let Err(e) = self.shards().reload().await {
                        tracing::debug!(error = %e, "the map could not be loaded yet");
                    }
                }
                Err(e) => return Err(e),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.cancelled() => return Err(MoveError::Stopped),
            }
        }
    }

    /// Finishes the move in flight, if any.
    pub async fn resume_in_flight(
        &self,
        lock: &MoverLock,
        report: Report<'_>,
        stop: &CancellationToken,
    ) -> Result<Vec<Outcome>> {
        let mut out = Vec::new();
        for rec in moves::moves_in_flight(self.shards().meta()).await? {
            out.push(self.run(lock, rec, report, stop).await?);
        }
        Ok(out)
    }
}
