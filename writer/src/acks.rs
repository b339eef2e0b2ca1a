//! The writer's watch on its shards' acknowledging replicas: every
//! [`EVERY`], each shard with replicas in the map is asked how many
//! semi-sync replicas its primary has connected. With none (and the map,
//! loaded again, still listing replicas of it), new writes to
//! it are refused (503 `no-acknowledging-replica`, nothing written; see
//! `storage::acks`), health names the shard and the gauge shows 0; with
//! one again, writes pass. A shard without replicas, or a cluster that
//! chose asynchronous replication (`mysql.allow_async`), is never gated.
//! A primary that does not answer leaves its gate as it was: its writes
//! fail on their own.

use schemas::topology::PhysicalId;
use std::sync::Arc;
use std::time::Duration;
use storage::acks::AckGate;
use storage::{replication, Shards};
use tokio_util::sync::CancellationToken;

use crate::Writer;

/// How often the primaries are asked.
pub const EVERY: Duration = Duration::from_millis(500);

/// How long a primary gets to answer. A dead primary's pool retries its
/// connection for `mysql.connect_timeout_ms`; waited for, it would hold
/// every shard's gate as it was until then, a refusing gate included,
/// long after a failover's new primary (which the next round asks) has an
/// acknowledging replica.
const ANSWER: Duration = Duration::from_secs(1);

impl Writer {
    /// Starts the watch (see the module's docs).
    pub fn spawn_ack_watch(&self, tracker: &tokio_util::task::TaskTracker, stop: CancellationToken) {
        let w = self.clone();
        tracker.spawn(async move {
            let gate = w.inner.commit.context().acks().clone();
            while !stop.is_cancelled() {
                w.check_acks(&gate).await;
                if !service::serve::sleep_or_stop(&stop, EVERY).await {
                    break;
                }
            }
        });
    }

    async fn check_acks(&self, gate: &Arc<AckGate>) {
        let shards: &Shards = &self.inner.shards;
        let t = shards.topology();
        let allow_async = self.inner.settings.mysql.allow_async;
        for p in &t.shards {
            let id = p.id as usize;
            let part = format!("replicas of shard {}", p.name);
            let gauge = self.inner.metrics.acknowledging.with_label_values(&[&id.to_string()]);
            // How many replicas acknowledge; `None` for a shard whose
            // writes need no acknowledgement.
            let clients = if allow_async || t.replicas_of(p.id).next().is_none() {
                None
            } else {
                let asked =
                    tokio::time::timeout(ANSWER, replication::acknowledging(id, shards.pool(id))).await;
                let Ok(Ok((n, _))) = asked else { continue };
                // A primary counting none may have lost its last replica
                // to `replicas remove`, which stops the primary waiting,
                // updates the map, then stops the replica.
                (n > 0 || self.still_has_replicas(p.id).await).then_some(n)
            };
            let refusing = clients == Some(0);
            gate.set(id, refusing);
            gauge.set(clients.map_or(-1, |n| n as i64));
            let outcome = if refusing {
                Err("no replica acknowledges writes: new writes to the shard are refused until one does"
                    .into())
            } else {
                Ok(())
            };
            self.inner.health.report(&part, outcome);
        }
    }

    /// Whether the map, loaded again now, still lists replicas of shard
    /// `id`. A map that cannot be loaded counts as still listing them: the
    /// gate then errs on refusing.
    async fn still_has_replicas(&self, id: PhysicalId) -> bool {
        let shards = &self.inner.shards;
        let Ok(Ok(())) = tokio::time::timeout(ANSWER, shards.reload_now()).await else { return true };
        shards.topology().replicas_of(id).next().is_some()
    }
}
