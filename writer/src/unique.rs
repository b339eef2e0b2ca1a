//! The writer's copy of the unique indexes (`storage::unique`): read from
//! the catalog every [`EVERY`], so an index added, made ACTIVE or dropped
//! is kept, enforced or let go by every writer within a second.

use tokio_util::sync::CancellationToken;

use crate::Writer;

/// How often the catalog is read.
pub const EVERY: std::time::Duration = storage::unique::RELOAD_EVERY;

impl Writer {
    /// Starts the reloads (see the module's docs).
    pub fn spawn_unique_watch(&self, tracker: &tokio_util::task::TaskTracker, stop: CancellationToken) {
        let w = self.clone();
        tracker.spawn(async move {
            let catalog = w.inner.commit.context().unique().clone();
            while !stop.is_cancelled() {
                if let Err(e) = catalog.reload(&w.inner.shards).await {
                    tracing::warn!(error = %e, "cannot read the unique indexes from the catalog; keeping the last read");
                }
                if !service::serve::sleep_or_stop(&stop, EVERY).await {
                    break;
                }
            }
        });
    }
}
