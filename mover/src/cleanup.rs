//! After the flip: wait for every process to route with the new map, then
//! remove the source's copy. And the rollback of a move that did not flip.

use std::time::{Duration, Instant};
use storage::{carry, entities, index_rows, journal, moves, topology};

use crate::{Mover, Result, Running};

/// Rows deleted per statement when a copy is removed.
const DELETE_BATCH: usize = 5000;

impl Mover {
    /// Waits until every live process routes with a map at least as new
    /// as the flip, stops the source's journal and deletes its copy.
    pub(crate) async fn cleanup(&self, run: &mut Running<'_>) -> Result<()> {
        let shards = self.shards().clone();
        let epoch = moves::cluster_epoch(shards.meta()).await?;
        let ttl = self.settings().process_ttl_secs;
        let mut logged = Instant::now();
        loop {
            let (oldest, live) = topology::oldest_live_epoch(shards.meta(), ttl).await?;
            if oldest.is_none_or(|e| e >= epoch) {
                break;
            }
            if logged.elapsed() >= Duration::from_secs(10) {
                logged = Instant::now();
                tracing::info!(id = run.rec.id, epoch, oldest = ?oldest, live, "waiting for processes to load the new map");
            }
            self.pause(run, Duration::from_millis(100)).await?;
        }
        let source = run.rec.source as usize;
        // This move's journal only: a run that lost the move and comes here
        // late must not stop the journal of the move after it.
        journal::stop_journal(source, shards.pool(source), run.rec.id, &run.rec.logicals, &run.indexes)
            .await?;
        self.forget_copy(run, source).await
    }

    /// Deletes one shard's rows and idempotency records of the moving
    /// logical shards (a shard that does not own them: nobody reads them;
    /// the deletes skip any of them the shard owns again).
    async fn forget_copy(&self, run: &mut Running<'_>, shard: usize) -> Result<()> {
        let pool = self.shards().pool(shard);
        let logicals = run.rec.logicals.clone();
        while entities::delete_logicals(shard, pool, &logicals, DELETE_BATCH).await? > 0 {
            self.metrics().progressed();
            self.pause(run, Duration::ZERO).await?;
        }
        for spec in &run.indexes {
            while index_rows::delete_logicals(shard, pool, spec, &logicals, DELETE_BATCH).await? > 0 {
                self.metrics().progressed();
                self.pause(run, Duration::ZERO).await?;
            }
        }
        while carry::delete_idempotency_records(shard, pool, &logicals, DELETE_BATCH).await? > 0 {
            self.metrics().progressed();
            self.pause(run, Duration::ZERO).await?;
        }
        Ok(())
    }

    /// Undoes a move that has not flipped the map: the target gives back
    /// anything it was granted and forgets its copy; the source's journal
    /// stops.
    pub(crate) async fn roll_back(&self, run: &mut Running<'_>) -> Result<()> {
        let shards = self.shards().clone();
        let (source, target) = (run.rec.source as usize, run.rec.target as usize);
        // Fence off any earlier run still copying, then undo.
        moves::claim_incoming(target, shards.pool(target), &run.rec.logicals, run.token).await?;
        moves::revoke(target, shards.pool(target), &run.rec.logicals).await?;
        journal::stop_journal(source, shards.pool(source), run.rec.id, &run.rec.logicals, &run.indexes)
            .await?;
        self.forget_copy(run, target).await?;
        moves::drop_incoming(target, shards.pool(target), &run.rec.logicals).await?;
        Ok(())
    }
}
