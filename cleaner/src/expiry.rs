//! Expiry and tombstone purge: the two ways rows leave `entities`.
//!
//! - Expired entities ([`Cleaner::expire_entities`]): each shard is searched
//!   every `cleaner.expiry_interval_ms` along the `expires_us` key, and the
//!   entities found are deleted by the write transaction every write goes
//!   through (`storage::write`, as [`Change::Expire`]): it checks under the
//!   row lock that each entity is still expired, and commits a delete
//!   event, so indexes and every consumer of the change topic follow. Reads
//!   hide the entity from its expiry instant on, before the delete.
//! - Tombstones ([`Cleaner::purge_tombstones`]): rows of deleted entities
//!   older than `cleaner.tombstone_retention_secs` and settled in every
//!   index, removed under a version floor (see `storage::purge`).

use schemas::clock::now_micros;
use std::time::Duration;
use storage::purge::{self, ExpiryCursor, PurgeCursor};
use storage::write::{self, Change, Item, Precondition, WriteError};
use storage::StaleMapRetry;
use tokio_util::sync::CancellationToken;

use crate::{Cleaner, STALE_MAP_WAIT};

/// Expired entities looked up per statement.
const EXPIRY_BATCH: usize = 500;
/// Expiry deletes per transaction: few enough that the locks they hold
/// and the delete events (each carries its entity's last bag, for the
/// indexes) stay small.
const EXPIRY_PER_TRANSACTION: usize = 64;
/// Rows the purge walks per statement, and statements per round.
const PURGE_BATCH: usize = 1000;
const PURGE_STEPS_PER_ROUND: usize = 20;

impl Cleaner {
    /// Deletes expired entities until `shutdown` (nothing when
    /// `expiry.property` is unset).
    pub async fn expire_entities(&self, shutdown: CancellationToken) {
        // Every shard's series exist from the start (at 0).
        for shard in self.shards().ids() {
            self.metrics().expired.with_label_values(&[&shard.to_string()]);
        }
        if self.settings().expiry.property.is_none() {
            return;
        }
        let every = Duration::from_millis(self.settings().cleaner.expiry_interval_ms);
        while !shutdown.is_cancelled() {
            for shard in self.shards().ids() {
                if let Err(e) = self.expire_on(shard, &shutdown).await {
                    tracing::warn!(shard, error = %e, "expiring entities failed; next round retries");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    /// One round on one shard: every entity expired by now, oldest expiry
    /// first. One that will not go (rewritten meanwhile, or failing) is
    /// passed, not retried in this round.
    async fn expire_on(&self, shard: usize, shutdown: &CancellationToken) -> Result<(), storage::StoreError> {
        let now = now_micros();
        let label = shard.to_string();
        let mut after: Option<ExpiryCursor> = None;
        while !shutdown.is_cancelled() {
            let found =
                purge::expired_entities(shard, self.shards().pool(shard), now, after, EXPIRY_BATCH).await?;
            let Some(last) = found.last() else { break };
            after = Some(last.at);
            let full = found.len() == EXPIRY_BATCH;
            for chunk in found.chunks(EXPIRY_PER_TRANSACTION) {
                // Each goes to the shard that owns it now (the one searched,
                // unless a move took it since), there in one transaction.
                let items: Vec<Item> = chunk
                    .iter()
                    .map(|e| Item { id: e.id, change: Change::Expire, pre: Precondition::default() })
                    .collect();
                let mut stale = StaleMapRetry::new(STALE_MAP_WAIT);
                let results = write::commit_all(self.write_context(), &items, &mut stale, |_| {}).await;
                for (e, result) in chunk.iter().zip(results) {
                    match result {
                        Ok(_) => {
                            self.metrics().expired.with_label_values(&[&label]).inc();
                            let late = (now_micros() - e.at.expires_us).max(0) as f64 / 1e6;
                            self.metrics().expiry_delay.with_label_values(&[&label]).observe(late);
                        }
                        // Rewritten since (a new expiry or none), or deleted.
                        Err(WriteError::NotExpired) => {}
                        Err(err) => {
                            tracing::warn!(shard, id = %e.id, error = %err, "could not delete an expired entity")
                        }
                    }
                }
            }
            if !full {
                break;
            }
        }
        Ok(())
    }

    /// Purges old tombstones until `shutdown` (nothing when
    /// `cleaner.tombstone_retention_secs` is 0). Each shard is walked in
    /// `updated` order from where the last round stopped (from the start
    /// after a restart, or when the shard's logical shards changed).
    pub async fn purge_tombstones(&self, shutdown: CancellationToken) {
        for shard in self.shards().ids() {
            self.metrics().tombstones_purged.with_label_values(&[&shard.to_string()]);
        }
        let retention = self.settings().cleaner.tombstone_retention_secs;
        if retention == 0 {
            return;
        }
        let every = Duration::from_millis(self.settings().cleaner.purge_interval_ms);
        let mut cursors: std::collections::HashMap<usize, (u64, PurgeCursor)> = Default::default();
        while !shutdown.is_cancelled() {
            for shard in self.shards().ids() {
                // A shard that gained logical shards may hold old tombstones
                // behind its cursor: walk it again from the start.
                let epoch = self.shards().epoch_of(shard);
                let cursor = cursors.entry(shard).or_insert((epoch, PurgeCursor::default()));
                if cursor.0 != epoch {
                    *cursor = (epoch, PurgeCursor::default());
                }
                let cutoff = match self.purge_cutoff(retention).await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot read the index catalog; purging waits");
                        break;
                    }
                };
                match self.purge_on(shard, cursor.1, cutoff).await {
                    Ok(next) => cursor.1 = next,
                    Err(e) => {
                        tracing::warn!(shard, error = %e, "purging tombstones failed; next round retries")
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    /// Tombstones updated before this may go: older than the retention, and
    /// settled in every index (each index has applied every event committed
    /// before it, see [`crate::lag`]). A delete event an indexer has not
    /// applied yet thus always finds its tombstone, and the cleaner never
    /// takes the index rows it is about to remove for dangling ones. An
    /// index whose settled time is not known yet holds the purge back.
    async fn purge_cutoff(&self, retention_secs: u64) -> Result<i64, storage::StoreError> {
        let mut cutoff = now_micros() - (retention_secs as i64).saturating_mul(1_000_000);
        for m in self.index_metas().await? {
            if m.state == schemas::index::IndexState::Dropping {
                continue;
            }
            cutoff = cutoff.min(self.settled_us(&m.spec.table).unwrap_or(i64::MIN));
        }
        Ok(cutoff)
    }

    /// Walks up to [`PURGE_STEPS_PER_ROUND`] steps from `from`, purging the
    /// tombstones found; returns where it stopped.
    async fn purge_on(
        &self,
        shard: usize,
        from: PurgeCursor,
        cutoff: i64,
    ) -> Result<PurgeCursor, storage::StoreError> {
        let pool = self.shards().pool(shard);
        let label = shard.to_string();
        let mut at = from;
        for _ in 0..PURGE_STEPS_PER_ROUND {
            let step = purge::walk_for_tombstones(shard, pool, at, cutoff, PURGE_BATCH).await?;
            let done = purge::purge_tombstones(shard, pool, &step.tombstones, cutoff).await?;
            self.metrics().tombstones_purged.with_label_values(&[&label]).inc_by(done.deleted);
            at = step.next;
            if step.seen < PURGE_BATCH {
                break;
            }
        }
        Ok(at)
    }
}
