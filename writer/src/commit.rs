//! The writer's transactions: each runs as `storage::write::commit`, and a
//! commit is followed here by what the storage layer leaves to its caller:
//! the writes counted, the shard's relay woken at once (instead of at its
//! next poll), and the crash drill.
//!
//! A batch goes straight here (one transaction per shard, see
//! `storage::write::batch`); single writes come through `group`.

use schemas::Settings;
use std::sync::Arc;
use std::time::Duration;
use storage::write::{self, Committed, Item, Outcome, WriteContext, WriteError};
use storage::StaleMapRetry;

use crate::metrics::Metrics;
use crate::relay::Wake;

/// How long a write keeps going after its map turned out stale (a move's
/// cutover in progress, or completed since the map was loaded) before it
/// fails: a cutover pauses a logical shard's writes for much less.
pub(crate) const STALE_MAP_WAIT: Duration = Duration::from_secs(10);

/// Runs the writer's transactions.
#[derive(Debug)]
pub(crate) struct Commit {
    ctx: WriteContext,
    metrics: Metrics,
    /// Each shard's relay, woken by a commit there.
    wake: Arc<Wake>,
    /// `writer.drill_exit_after_commit`.
    drill_exit_after_commit: bool,
}

impl Commit {
    pub(crate) fn new(ctx: WriteContext, settings: &Settings, metrics: Metrics, wake: Arc<Wake>) -> Commit {
        Commit { ctx, metrics, wake, drill_exit_after_commit: settings.writer.drill_exit_after_commit }
    }

    pub(crate) fn context(&self) -> &WriteContext {
        &self.ctx
    }

    /// `items` in one transaction on `shard`; each item's answer, in order.
    pub(crate) async fn on_shard(&self, shard: usize, items: &[Item]) -> Vec<Result<Outcome, WriteError>> {
        let result = write::commit(&self.ctx, shard, items).await;
        if let Ok(committed) = &result {
            self.committed(shard, committed);
        }
        write::per_item(shard, result.map(|c| c.results), items.len())
    }

    /// `items`, those on one shard in one transaction; answers in input
    /// order. Items whose shard turned out not to own them (a stale map) go
    /// again to the owner the reloaded map names, for up to
    /// [`STALE_MAP_WAIT`].
    pub(crate) async fn batch(&self, items: Vec<Item>) -> Vec<Result<Outcome, WriteError>> {
        let mut stale = StaleMapRetry::new(STALE_MAP_WAIT);
        let answers = write::commit_all(&self.ctx, &items, &mut stale, |shard| {
            if let Ok(committed) = &shard.result {
                self.committed(shard.shard, committed);
            }
        })
        .await;
        self.metrics.stale_map_retries.inc_by(stale.tries().into());
        answers
    }

    /// What follows a commit on `shard`, before anyone is answered.
    fn committed(&self, shard: usize, c: &Committed) {
        if self.drill_exit_after_commit && c.recorded {
            tracing::warn!(shard, "drill: exiting after a committed keyed write, before answering");
            std::process::exit(137);
        }
        let label = shard.to_string();
        for kind in &c.kinds {
            self.metrics.writes.with_label_values(&[label.as_str(), kind]).inc();
        }
        self.wake.wake(shard);
    }
}
