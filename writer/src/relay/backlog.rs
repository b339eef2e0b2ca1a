//! The outbox backlog gauges, kept by the shard's relay leader only (a
//! follower exports none).

use std::time::{Duration, Instant};
use storage::outbox;

use crate::relay::Relays;

/// How often a leading relay refreshes the outbox backlog gauges.
const BACKLOG_EVERY: Duration = Duration::from_millis(500);

/// When the gauges were last refreshed: they cost a statement, so a busy
/// relay refreshes them at most every [`BACKLOG_EVERY`].
#[derive(Debug, Default)]
pub(super) struct Every {
    at: Option<Instant>,
}

impl Every {
    /// Whether a refresh is due now (if so, it counts as done now).
    pub(super) fn due(&mut self) -> bool {
        let due = self.at.is_none_or(|t| t.elapsed() >= BACKLOG_EVERY);
        if due {
            self.at = Some(Instant::now());
        }
        due
    }
}

/// Sets the shard's backlog gauges from its outbox.
pub(super) async fn report(relays: &Relays, shard: usize) {
    let label = shard.to_string();
    match outbox::outbox_backlog(shard, relays.shards.pool(shard)).await {
        Ok(backlog) => {
            relays.metrics.outbox_backlog.with_label_values(&[&label]).set(backlog.rows as i64);
            let oldest = backlog.oldest_commit_us.map_or(0.0, |us| us as f64 / 1e6);
            relays.metrics.outbox_oldest.with_label_values(&[&label]).set(oldest);
        }
        Err(e) => tracing::debug!(shard, error = %e, "backlog query failed"),
    }
}

/// Removes the shard's backlog gauges: only the leader knows the backlog.
pub(super) fn forget(relays: &Relays, shard: usize) {
    let label = shard.to_string();
    let _ = relays.metrics.outbox_backlog.remove_label_values(&[&label]);
    let _ = relays.metrics.outbox_oldest.remove_label_values(&[&label]);
}
