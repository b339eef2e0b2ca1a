//! The series the failover coordinator exports (`bagstore_failover…`).

use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};

#[derive(Debug, Clone)]
pub struct FailoverMetrics {
    /// Failovers this process ran, by shard and reason
    /// (`primary_unreachable`; `primary_read_only`: a primary restarted
    /// before its failover, a replica holding more than it, see the
    /// `settle` module).
    pub failovers: IntCounterVec,
    /// The last failover's write unavailability by shard: from the first
    /// probe the primary did not answer to the new primary taking writes.
    pub unavailable: GaugeVec,
    /// 1 while a shard's primary is down and no failover could be run
    /// safely (no replica answers, none holds everything, …).
    pub blocked: IntGaugeVec,
    /// Servers taken back as replicas, by shard and outcome (`ok`,
    /// `refused`).
    pub rejoins: IntCounterVec,
    /// Per server of a replicated shard: 1 while it answers, by role.
    pub server_up: IntGaugeVec,
    /// Per replica: `Seconds_Behind_Master` (-1 while its threads stop).
    pub replica_lag: GaugeVec,
    /// Per replica: transactions the primary holds that it does not.
    pub replica_behind: IntGaugeVec,
    /// Per primary: semi-sync replicas connected, and commits waiting.
    pub semi_sync_clients: IntGaugeVec,
    pub semi_sync_waiting: IntGaugeVec,
}

impl FailoverMetrics {
    /// Makes shard `shard`'s series exist (at 0 where nothing happened
    /// yet), so a dashboard and alerts see every shard from the start.
    pub fn zero(&self, shard: &str) {
        for reason in ["primary_unreachable", "primary_read_only"] {
            self.failovers.with_label_values(&[shard, reason]).inc_by(0);
        }
        for outcome in ["ok", "refused"] {
            self.rejoins.with_label_values(&[shard, outcome]).inc_by(0);
        }
        let _ = self.unavailable.with_label_values(&[shard]);
        let _ = self.blocked.with_label_values(&[shard]);
    }

    /// Server `server` of `shard` answers (`up`) or not, in `role`. Its
    /// series of the other role goes (a failover or a rejoin changed its
    /// role: a stale one would show it in both), as do a primary's replica
    /// series.
    pub fn server(&self, shard: &str, server: &str, role: &str, up: bool) {
        let other = if role == "primary" { "replica" } else { "primary" };
        let _ = self.server_up.remove_label_values(&[shard, server, other]);
        if role == "primary" {
            let _ = self.replica_lag.remove_label_values(&[shard, server]);
            let _ = self.replica_behind.remove_label_values(&[shard, server]);
        }
        self.server_up.with_label_values(&[shard, server, role]).set(i64::from(up));
    }

    pub fn register(r: &Registry) -> prometheus::Result<FailoverMetrics> {
        let m = FailoverMetrics {
            failovers: IntCounterVec::new(
                Opts::new("bagstore_failovers_total", "Automatic failovers run, by shard and reason"),
                &["shard", "reason"],
            )?,
            unavailable: GaugeVec::new(
                Opts::new(
                    "bagstore_failover_unavailable_seconds",
                    "The last automatic failover's write unavailability: first unanswered probe to the new \
                     primary taking writes",
                ),
                &["shard"],
            )?,
            blocked: IntGaugeVec::new(
                Opts::new(
                    "bagstore_failover_blocked",
                    "1 while a shard's primary is down and no safe failover candidate was found",
                ),
                &["shard"],
            )?,
            rejoins: IntCounterVec::new(
                Opts::new("bagstore_rejoins_total", "Servers taken back as replicas, by shard and outcome"),
                &["shard", "outcome"],
            )?,
            server_up: IntGaugeVec::new(
                Opts::new("bagstore_server_up", "1 while a server of a replicated shard answers, by role"),
                &["shard", "server", "role"],
            )?,
            replica_lag: GaugeVec::new(
                Opts::new(
                    "bagstore_replica_lag_seconds",
                    "A replica's Seconds_Behind_Master (-1 while its replication threads stop)",
                ),
                &["shard", "server"],
            )?,
            replica_behind: IntGaugeVec::new(
                Opts::new(
                    "bagstore_replica_gtid_behind",
                    "Transactions a shard's primary holds that the replica does not",
                ),
                &["shard", "server"],
            )?,
            semi_sync_clients: IntGaugeVec::new(
                Opts::new("bagstore_semi_sync_clients", "Semi-sync replicas connected to a shard's primary"),
                &["shard"],
            )?,
            semi_sync_waiting: IntGaugeVec::new(
                Opts::new(
                    "bagstore_semi_sync_waiting_commits",
                    "Commits on a shard's primary waiting for a replica's acknowledgement",
                ),
                &["shard"],
            )?,
        };
        r.register(Box::new(m.server_up.clone()))?;
        r.register(Box::new(m.replica_lag.clone()))?;
        r.register(Box::new(m.replica_behind.clone()))?;
        r.register(Box::new(m.semi_sync_clients.clone()))?;
        r.register(Box::new(m.semi_sync_waiting.clone()))?;
        r.register(Box::new(m.failovers.clone()))?;
        r.register(Box::new(m.unavailable.clone()))?;
        r.register(Box::new(m.blocked.clone()))?;
        r.register(Box::new(m.rejoins.clone()))?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_whose_role_changed_is_shown_in_its_new_role_only() {
        let r = Registry::new();
        let m = FailoverMetrics::register(&r).unwrap();
        m.server("s1", "a:1/db", "replica", true);
        m.replica_lag.with_label_values(&["s1", "a:1/db"]).set(0.5);
        m.server("s1", "b:1/db", "primary", true);
        // A failover: a is the primary now, b (dead) a replica.
        m.server("s1", "a:1/db", "primary", true);
        m.server("s1", "b:1/db", "replica", false);
        let text = prometheus::TextEncoder::new().encode_to_string(&r.gather()).unwrap();
        let up: Vec<&str> = text.lines().filter(|l| l.starts_with("bagstore_server_up{")).collect();
        assert_eq!(up.len(), 2, "{text}");
        assert!(up
            .iter()
            .any(|l| l.contains("server=\"a:1/db\"") && l.contains("role=\"primary\"") && l.ends_with(" 1")));
        assert!(up
            .iter()
            .any(|l| l.contains("server=\"b:1/db\"") && l.contains("role=\"replica\"") && l.ends_with(" 0")));
        assert!(!text.contains("bagstore_replica_lag_seconds{"), "{text}");
    }
}
