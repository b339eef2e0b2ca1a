//! Index lag, measured from outside the indexers: the cleaner always runs,
//! so lag is reported even when an index has no live consumer at all.
//!
//! Offset lag comes from Kafka (the topic's high watermarks against the
//! group's committed offsets); time lag from MySQL (the newest commit on
//! any shard against the newest commit the index applied).
//!
//! The same measurement tells the sweep where lag ends and drift begins
//! ([`Settled`]). Each probe notes the shards' clock, the start of the
//! oldest transaction open on each shard and the oldest unpublished outbox
//! row (`storage::outbox::OutboxProbe`), then the topic's high watermarks:
//! every event stamped before all of them was on the topic below those
//! watermarks. (Without the open transactions, a write stamped before the
//! probe and committed after it, seconds late on a busy machine, was
//! counted as settled before its event was even published.) Once an
//! index's group has committed offsets at or past a probe's watermarks,
//! every such event is applied, and a row missing (or left over) for an
//! entity last written before that time is drift, not an event in flight.
//! Judging by "the newest event the index applied" instead would call a
//! slow partition's backlog drift whenever another partition ran ahead.

use schemas::index::IndexState;
use service::freshness::Freshness;
use service::kafka;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use storage::{catalog, entities, outbox};
use tokio_util::sync::CancellationToken;

use crate::{Cleaner, CleanerError};

/// How often lag is measured (and the settled time can move).
pub const LAG_INTERVAL: Duration = Duration::from_secs(1);

/// Margin for clocks: a write's timestamp comes from its writer's clock,
/// the probe's from the shard's (a transaction still open when probed is
/// covered by its start, see `storage::outbox::OutboxProbe`).
const VISIBILITY_MARGIN_US: i64 = 500_000;

/// Probes kept per index while its group catches up (one per interval).
const MAX_PROBES: usize = 3600;

/// One probe: events committed before `before_us` were on the topic below
/// `watermarks` (partition → high watermark).
#[derive(Debug, Clone)]
pub(crate) struct Probe {
    before_us: i64,
    watermarks: HashMap<i32, i64>,
}

/// Per index: probes not yet covered by the group's committed offsets, and
/// the settled time: every event committed before it has been applied.
#[derive(Debug, Default)]
pub(crate) struct Settled {
    probes: VecDeque<Probe>,
    pub(crate) at_us: Option<i64>,
}

impl Settled {
    /// Records a probe and moves `at_us` to the newest probe the committed
    /// offsets cover (partition → committed offset).
    fn advance(&mut self, probe: Probe, committed: &HashMap<i32, i64>) {
        self.probes.push_back(probe);
        while self.probes.len() > MAX_PROBES {
            self.probes.pop_front();
        }
        let covered =
            |p: &Probe| p.watermarks.iter().all(|(part, w)| committed.get(part).copied().unwrap_or(0) >= *w);
        if let Some(i) = self.probes.iter().rposition(covered) {
            let at = self.probes[i].before_us;
            self.at_us = Some(self.at_us.map_or(at, |old| old.max(at)));
            self.probes.drain(..=i);
        }
    }
}

impl Cleaner {
    /// Measures and publishes lag every [`LAG_INTERVAL`] until `shutdown`.
    pub async fn report_lag(&self, shutdown: CancellationToken) {
        while !shutdown.is_cancelled() {
            if let Err(e) = self.measure_lag().await {
                tracing::debug!(error = %e, "lag measurement failed");
            }
            tokio::select! {
                _ = tokio::time::sleep(LAG_INTERVAL) => {}
                _ = shutdown.cancelled() => break,
            }
        }
    }

    pub async fn measure_lag(&self) -> Result<(), CleanerError> {
        let shards = self.shards();
        // First the clocks and the outbox, then (below) the watermarks: the
        // order a probe needs (see the module docs).
        let probes = shards.try_each(outbox::outbox_probe).await?;
        let before_us = probes
            .iter()
            .map(|p| p.settled_before_us())
            .min()
            .unwrap_or(i64::MAX)
            .saturating_sub(VISIBILITY_MARGIN_US);
        let newest = shards.try_each(entities::newest_commit_us).await?;
        let newest = newest.into_iter().flatten().max();
        let k = &self.settings().kafka;
        let m = self.metrics();
        for meta in self.index_metas().await? {
            let table = meta.spec.table.as_str();
            if meta.state == IndexState::Dropping {
                // A dropped index has no lag; stop exporting its last values.
                let _ = m.lag_seconds.remove_label_values(&[table]);
                let _ = m.lag_events.remove_label_values(&[table, &k.group_for(table), &k.topic]);
                let _ = m.applied_through.remove_label_values(&[table]);
                let _ = m.consumers.remove_label_values(&[table]);
                let _ = m.lag_probe.remove_label_values(&[table]);
                let _ = m.settled.remove_label_values(&[table]);
                continue;
            }
            if meta.spec.unique {
                // Its rows are written with each write: it has no lag.
                continue;
            }
            let applied = catalog::index_progress(shards, table).await?;
            if let Some(a) = applied {
                m.applied_through.with_label_values(&[table]).set(a as f64 / 1e6);
            }
            let mut events_behind = None;
            if !k.brokers.is_empty() {
                match kafka::group_lag(k, &k.group_for(table)).await {
                    Ok(parts) => {
                        let probe = Probe {
                            before_us,
                            watermarks: parts.iter().map(|p| (p.partition, p.high_watermark)).collect(),
                        };
                        let committed: HashMap<i32, i64> =
                            parts.iter().map(|p| (p.partition, p.committed.unwrap_or(0))).collect();
                        self.settled_mut(table, |s| s.advance(probe, &committed));
                        if let Some(at) = self.settled_us(table) {
                            m.settled.with_label_values(&[table]).set(at as f64 / 1e6);
                        }
                        let mut sum = 0;
                        let group = k.group_for(table);
                        for p in parts {
                            m.partition_lag
                                .with_label_values(&[table, &group, &k.topic, &p.partition.to_string()])
                                .set(p.lag());
                            sum += p.lag();
                        }
                        m.lag_events.with_label_values(&[table, &group, &k.topic]).set(sum);
                        m.lag_probe
                            .with_label_values(&[table])
                            .set(schemas::clock::now_micros() as f64 / 1e6);
                        events_behind = Some(sum);
                    }
                    Err(e) => tracing::debug!(index = table, error = %e, "cannot read consumer-group lag"),
                }
            }
            let fresh = Freshness { applied_through_us: applied, newest_commit_us: newest };
            let lag_us = fresh.lag_us(events_behind, schemas::clock::now_micros());
            m.lag_seconds.with_label_values(&[table]).set(lag_us as f64 / 1e6);
            let group = k.group_for(table);
            // The indexers holding member leases in the index's group.
            match storage::leases::live_members(shards, &group).await {
                Ok(n) => m.consumers.with_label_values(&[table]).set(n as i64),
                Err(e) => tracing::debug!(index = table, error = %e, "cannot count member leases"),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(before_us: i64, w: &[(i32, i64)]) -> Probe {
        Probe { before_us, watermarks: w.iter().copied().collect() }
    }

    #[test]
    fn settled_time_moves_only_as_far_as_the_committed_offsets_cover() {
        let mut s = Settled::default();
        let committed = |c: &[(i32, i64)]| c.iter().copied().collect::<HashMap<_, _>>();
        // Partition 1 lags: nothing is settled, however far partition 0 ran.
        s.advance(probe(100, &[(0, 10), (1, 10)]), &committed(&[(0, 50), (1, 4)]));
        assert_eq!(s.at_us, None);
        s.advance(probe(200, &[(0, 20), (1, 12)]), &committed(&[(0, 50), (1, 10)]));
        assert_eq!(s.at_us, Some(100), "the first probe is covered, the second not yet");
        s.advance(probe(300, &[(0, 25), (1, 12)]), &committed(&[(0, 25), (1, 12)]));
        assert_eq!(s.at_us, Some(300));
        assert!(s.probes.is_empty());
        // It never moves back.
        s.advance(probe(250, &[(0, 30)]), &committed(&[(0, 30)]));
        assert_eq!(s.at_us, Some(300));
    }

    #[test]
    fn a_group_that_committed_nothing_settles_nothing_on_a_non_empty_topic() {
        let mut s = Settled::default();
        s.advance(probe(100, &[(0, 3)]), &HashMap::new());
        assert_eq!(s.at_us, None);
        s.advance(probe(200, &[(0, 0)]), &HashMap::new());
        assert_eq!(s.at_us, Some(200), "an empty partition needs nothing");
    }
}
